"""Schedules whose stages span ranks: each rank's program of compute, send and receive.

When stage s and stage s+1 live on different ranks, an activation goes from
s's forward to s+1's forward and its gradient comes back, as point-to-point
messages. Every rank walks the *same* global order (the simulator's), keeping
its own actions and inserting a receive right before the action that needs a
remote value and a send right after the action that makes one. Sends do not
block and receives do; :func:`check_programs` runs the programs symbolically
with one FIFO channel per (sender, receiver) pair and reports a receive that
would get the wrong message, or ranks that would wait on each other forever.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Sequence

from .schedule import Action
from .simulate import ScheduleError

__all__ = ["Op", "rank_programs", "check_programs"]


class Op(NamedTuple):
    """One step of a rank's program: compute ("F"/"B") or a message ("send"/"recv")."""

    kind: str
    stage: int
    microbatch: int
    payload: str = ""  # "act" or "grad" for messages
    peer: int = -1

    def tag(self) -> tuple[int, int, str]:
        """What a message carries: (boundary after stage b, microbatch, "act"/"grad")."""
        right = (self.kind == "send") == (self.payload == "act")  # send act / recv grad: boundary after stage
        return (self.stage if right else self.stage - 1, self.microbatch, self.payload)

    def __str__(self) -> str:
        if self.kind in ("F", "B"):
            return f"{self.kind}{self.microbatch}@stage{self.stage}"
        arrow = "to" if self.kind == "send" else "from"
        return f"{self.kind} {self.payload}{self.microbatch} of stage {self.stage} {arrow} rank {self.peer}"


def rank_programs(order: Sequence[tuple[int, Action]], stage_rank: Sequence[int]) -> dict[int, list[Op]]:
    """Per rank, its ops in the global ``order`` with the messages between ranks inserted."""
    n = len(stage_rank)
    progs: dict[int, list[Op]] = {r: [] for r in dict.fromkeys(stage_rank)}
    for s, a in order:
        if not 0 <= s < n:
            raise ScheduleError(f"order names stage {s}, but there are {n} stages")
        r, i = stage_rank[s], a.microbatch
        prev = stage_rank[s - 1] if s > 0 else r
        nxt = stage_rank[s + 1] if s < n - 1 else r
        prog = progs[r]
        if a.kind == "F":
            if prev != r:
                prog.append(Op("recv", s, i, "act", prev))
            prog.append(Op("F", s, i))
            if nxt != r:
                prog.append(Op("send", s, i, "act", nxt))
        else:
            if nxt != r:
                prog.append(Op("recv", s, i, "grad", nxt))
            prog.append(Op("B", s, i))
            if prev != r:
                prog.append(Op("send", s, i, "grad", prev))
    return progs


def check_programs(programs: dict[int, list[Op]]) -> None:
    """Raise :class:`ScheduleError` if some receive would mismatch or the ranks would deadlock."""
    channels: dict[tuple[int, int], deque[Op]] = {}
    ptr = {r: 0 for r in programs}
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while ptr[r] < len(prog):
                op = prog[ptr[r]]
                if op.kind == "send":
                    channels.setdefault((r, op.peer), deque()).append(op)
                elif op.kind == "recv":
                    q = channels.get((op.peer, r))
                    if not q:
                        break
                    sent = q.popleft()
                    if sent.tag() != op.tag():
                        raise ScheduleError(
                            f"rank {r} expects {op} but rank {op.peer} sent {sent} first: "
                            f"messages between two ranks must be sent in the order they are received"
                        )
                ptr[r] += 1
                progress = True
    blocked = [f"rank {r} waits at {prog[ptr[r]]}" for r, prog in programs.items() if ptr[r] < len(prog)]
    if blocked:
        raise ScheduleError("deadlock across ranks: " + "; ".join(blocked))
    left = [f"{op} (rank {src} to {dst})" for (src, dst), q in channels.items() for op in q]
    if left:
        raise ScheduleError("messages sent but never received: " + "; ".join(left))
