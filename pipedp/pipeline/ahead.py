"""Receives posted ahead of the actions that take them, so a transfer crosses while its receiver computes.

gloo moves a point-to-point message only once the receiver has posted its
receive: the sender's ``isend`` announces the message and waits for the
peer's "ready" before any byte goes. A pipeline rank that posts each receive
when its action needs it therefore waits for the whole transfer after it was
already free: over a slow link, most of the step.

:class:`Ahead` walks one rank's order of actions and posts the receives still
to come, per peer in the order the rank takes them (gloo matches a peer's
messages in posting order), as soon as their sizes are known, at most
:data:`LOOKAHEAD` per peer (each holds a buffer). A receive whose size is not
known yet (an activation's first crossing, before its metadata) stops its
peer's walk there: the action receives it itself, and the walk goes on after.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from .schedule import Action

__all__ = ["Ahead", "Receiver", "LOOKAHEAD"]

LOOKAHEAD = 2  # receives posted ahead per peer: enough to cover the next action's compute, two buffers held


class Receiver(Protocol):
    """What one step receives: the peer an action receives from, and posting its receive."""

    def peer_of(self, s: int, act: Action) -> int | None:
        """The rank ``act`` of stage ``s`` receives from (None: it receives nothing over the transport)."""
        ...

    def post(self, s: int, act: Action) -> bool | None:
        """Post the action's receive now: True posted, None nothing to receive after all, False not known yet."""
        ...


class Ahead:
    """The receives of one rank's step, posted ahead in order (see the module docstring)."""

    def __init__(self, order: Sequence[tuple[int, Action]], rx: Receiver, lookahead: int = LOOKAHEAD) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.rx, self.lookahead = rx, lookahead
        self.todo: dict[int, list[tuple[int, Action]]] = {}  # per peer, its receives in the order they are taken
        for s, act in order:
            peer = rx.peer_of(s, act)
            if peer is not None:
                self.todo.setdefault(peer, []).append((s, act))
        self.next = {peer: 0 for peer in self.todo}  # per peer, the first receive neither posted nor taken
        self.posted: dict[int, set[tuple[int, Action]]] = {peer: set() for peer in self.todo}  # not yet taken

    def fill(self) -> None:
        """Post every peer's next receives while their sizes are known, up to the lookahead."""
        for peer, todo in self.todo.items():
            while self.next[peer] < len(todo) and len(self.posted[peer]) < self.lookahead:
                s, act = todo[self.next[peer]]
                done = self.rx.post(s, act)
                if done is False:
                    break
                if done:
                    self.posted[peer].add((s, act))
                self.next[peer] += 1

    def take(self, stage: int, action: Action) -> bool:
        """The action is about to receive: True where its receive was posted ahead (the transport holds it),
        False where the action posts it itself (nothing after it was posted: the walk stopped there)."""
        peer = self.rx.peer_of(stage, action)
        if peer is None:
            return False
        if (stage, action) in self.posted[peer]:
            self.posted[peer].discard((stage, action))
            return True
        todo = self.todo[peer]
        if self.next[peer] < len(todo) and todo[self.next[peer]] == (stage, action):
            self.next[peer] += 1
        return False
