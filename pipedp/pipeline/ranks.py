"""Schedules whose stages span ranks: each rank's program of compute, send and receive.

When stage s and stage s+1 live on different ranks, an activation goes from
s's forward to s+1's forward and its gradient comes back (from s+1's B or I),
as point-to-point messages. Each rank takes its own actions in order (from
the *same* global order, the simulator's, or a schedule's per-rank programs),
inserting a receive right before the action that needs a remote value and a
send right after the action that makes one. Sends do not
block and receives do; :func:`check_programs` runs the programs symbolically
with one FIFO channel per (sender, receiver) pair and reports a receive that
would get the wrong message, or ranks that would wait on each other forever.
"""

from __future__ import annotations

from collections import deque
from typing import Collection, Mapping, NamedTuple, Sequence

from .deps import ACCUMULATES, needs, sends
from .schedule import Action
from .simulate import ScheduleError

__all__ = ["Op", "rank_programs", "lower_programs", "close_stages", "check_programs", "format_program"]

COMPUTE = ("F", "B", "I", "W")
# A stage's close, as printed: its BatchNorm statistics after its last forward; its gradients and parameters after
# its last accumulation.
CLOSE = {"commit": "BN_COMMIT", "reduce": "REDUCE_GRAD", "update": "UPDATE"}


class Op(NamedTuple):
    """One step of a rank's program: compute ("F", "B", or its halves "I" and "W"), a message ("send"/"recv"),
    or a stage's close ("commit": its deferred BatchNorm statistics applied; "reduce": its gradients over the
    replicas; "update": its parameters stepped)."""

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
        if self.kind in COMPUTE:
            return f"{self.kind}{self.microbatch}@stage{self.stage}"
        if self.kind in CLOSE:
            return f"{CLOSE[self.kind]} of stage {self.stage}"
        arrow = "to" if self.kind == "send" else "from"
        return f"{self.kind} {self.payload}{self.microbatch} of stage {self.stage} {arrow} rank {self.peer}"


def rank_programs(order: Sequence[tuple[int, Action]], stage_rank: Sequence[int]) -> dict[int, list[Op]]:
    """Per rank, its ops in the global ``order`` with the messages between ranks inserted."""
    n = len(stage_rank)
    compute: dict[int, list[tuple[int, Action]]] = {r: [] for r in dict.fromkeys(stage_rank)}
    for s, a in order:
        if not 0 <= s < n:
            raise ScheduleError(f"order names stage {s}, but there are {n} stages")
        compute[stage_rank[s]].append((s, a))
    return lower_programs(compute, stage_rank)


def lower_programs(compute: Mapping[int, Sequence[tuple[int, Action]]], stage_rank: Sequence[int]
                   ) -> dict[int, list[Op]]:
    """Per rank, its (stage, action) pairs in order as ops, with the messages between ranks inserted."""
    n = len(stage_rank)
    progs: dict[int, list[Op]] = {}
    for r, acts in compute.items():
        prog = progs[r] = []
        for s, a in acts:
            if not 0 <= s < n or stage_rank[s] != r:
                raise ScheduleError(f"rank {r}'s program runs {a} of stage {s}, which is not on rank {r}")
            i, payload = a.microbatch, "act" if a.kind == "F" else "grad"
            for ds, _ in needs(s, a, n):
                if ds != s and stage_rank[ds] != r:
                    prog.append(Op("recv", s, i, payload, stage_rank[ds]))
            prog.append(Op(a.kind, s, i))
            to = sends(s, a, n)
            if to is not None and stage_rank[to] != r:
                prog.append(Op("send", s, i, payload, stage_rank[to]))
    return progs


def close_stages(ops: Sequence[Op], commits: Collection[int] = ()) -> list[Op]:
    """A rank's training program with each stage's REDUCE_GRAD and UPDATE after its last accumulation (its
    last B, or its last W where backwards split), and BN_COMMIT after the last forward of each stage in
    ``commits``; each after the send that follows its action.

    After its last accumulation a stage's gradients are whole: its buckets
    still to go are launched over the replicas, and its parameters may be
    stepped while other stages compute (an early update). After its last
    forward the statistics of the deferred BatchNorms it is the last to use
    are complete (:mod:`.batchnorm`). The message a peer waits for is sent first.
    """
    def after(kinds: Collection[str], stages: Collection[int] | None) -> dict[int, int]:
        last = {op.stage: k for k, op in enumerate(ops)
                if op.kind in kinds and (stages is None or op.stage in stages)}
        at = {}
        for s, k in last.items():
            while k + 1 < len(ops) and ops[k + 1].kind == "send" and ops[k + 1].stage == s:
                k += 1
            at[k] = s
        return at

    closes = (after(("F",), commits), ("commit",)), (after(ACCUMULATES, None), ("reduce", "update"))
    out: list[Op] = []
    for k, op in enumerate(ops):
        out.append(op)
        for at, kinds in closes:
            if k in at:
                out += [Op(kind, at[k], op.microbatch) for kind in kinds]
    return out


def format_program(ops: Sequence[Op]) -> str:
    """A rank's program in one line: compute as ``<stage><kind><microbatch>`` (``0F3``, ``1I2``), messages
    as ``<stage>SEND_F3`` / ``RECV_F3`` (activations) and ``SEND_B3`` / ``RECV_B3`` (gradients), a stage's
    close as ``<stage>BN_COMMIT``, ``<stage>REDUCE_GRAD`` and ``<stage>UPDATE``."""
    def one(op: Op) -> str:
        if op.kind in COMPUTE:
            return f"{op.stage}{op.kind}{op.microbatch}"
        if op.kind in CLOSE:
            return f"{op.stage}{CLOSE[op.kind]}"
        return f"{op.stage}{op.kind.upper()}_{'F' if op.payload == 'act' else 'B'}{op.microbatch}"
    return " ".join(one(op) for op in ops)


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
