"""Where this process sits in a data-parallel × pipeline layout over ``torch.distributed``.

pipedp brings no launcher or collective of its own: ``torchrun`` starts the
processes, the user calls ``init_process_group``, and the groups come from
torch (``new_subgroups_by_enumeration``, or the user's ``DeviceMesh`` /
groups). Ranks are laid out like ``init_device_mesh((dp, pp), ("dp", "pp"))``:
global rank = dp_rank * pp + pp_rank, so the ranks of one pipeline are
neighbours (on one host, when pp divides the GPUs per host).
"""

from __future__ import annotations

import datetime
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .checks import positive_int, positive_number
from .defaults import DEFAULT_TIMEOUT_S

__all__ = [
    "Layout", "resolve_layout", "check_backend", "missing_ranks", "missing_note", "DistributedError", "StepMismatch",
    "behind_note", "DEFAULT_TIMEOUT_S", "timed", "use_counts", "let_go", "gather_objects", "broadcast_object",
    "broadcast_tensors", "barrier", "all_reduce",
]


class DistributedError(RuntimeError):
    """A collective or point-to-point transfer failed or timed out (a peer died or hung)."""


class StepMismatch(DistributedError):
    """The ranks of a group compared their step numbers and differ: a rank is behind.

    Every rank of the group raises it at the same point, from the same
    numbers, so no rank is gone and none is waited for.
    """


def behind_note(group: str, steps: Sequence[int], ranks: Sequence[int], me: int) -> str:
    """The message of a :class:`StepMismatch`: each rank's step (``steps[i]`` of global rank ``ranks[i]``), the
    ranks behind, why and the fix."""
    where = ", ".join(f"rank {r} at step {s}" for r, s in sorted(zip(ranks, steps)))
    late = sorted(r for r, s in zip(ranks, steps) if s < max(steps))
    return (
        f"the {group} ranks are not at the same step (this is rank {me}): {where}; rank(s) {late} behind: a step "
        f"failed there (an exception from train_step caught and gone on from) or was skipped while the others "
        f"trained it, so the ranks' parameters are from different steps now. Every rank must run every step: "
        f"restart every rank from the last checkpoint; to skip a bad batch, skip it on every rank alike (decide "
        f"before train_step, e.g. with an all-reduce of a flag)"
    )


@dataclass(frozen=True)
class Layout:
    """This rank's place: its data-parallel replica group and its pipeline group.

    ``world_group`` holds every rank with ``timeout`` (the default group has the
    process group's own): a collective of all ranks that a dead peer leaves
    behind ends with our timeout, not minutes later at exit.
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: Any
    pp_group: Any
    timeout: datetime.timedelta
    world_group: Any = None

    @property
    def everyone(self) -> Any:
        """The group of all ranks (ours, made with ``timeout``, when there is one)."""
        return self.world_group if self.world_group is not None else dist.group.WORLD

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world(self) -> int:
        return dist.get_world_size()

    def pp_peer(self, pp_index: int) -> int:
        """Global rank of the pipeline neighbour at ``pp_index`` in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, pp_index) if self.pp > 1 else self.rank

    def describe(self) -> str:
        return (
            f"rank {self.rank} of {self.world}: data-parallel replica {self.dp_rank} of {self.dp}, "
            f"pipeline rank {self.pp_rank} of {self.pp} ({dist.get_backend()})"
        )


def _from_groups(dp_group: Any, pp_group: Any, timeout: datetime.timedelta) -> Layout:
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    pp_rank = dist.get_rank(pp_group) if pp_group is not None else 0
    if dp_rank < 0 or pp_rank < 0:
        raise ValueError("this rank is not a member of the dp_group/pp_group passed to wrap(): pass its own groups")
    world = dist.new_group(timeout=timeout)
    return Layout(dp, pp, dp_rank, pp_rank, dp_group, pp_group if pp > 1 else None, timeout, world)


def resolve_layout(
    *,
    pp: int = 1,
    mesh: Any = None,
    dp_group: Any = None,
    pp_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Layout | None:
    """The layout for this process, or None when ``torch.distributed`` is not in use.

    Exactly one way to say it: ``pp`` (dp = world // pp, groups built here),
    a ``DeviceMesh`` with dims ``("dp", "pp")`` or ``("dp",)``, or explicit groups.
    Building groups is collective: every rank must call this in the same order.
    """
    positive_int("pp", pp)
    td = datetime.timedelta(seconds=positive_number("timeout", timeout, "seconds"))
    given = [n for n, v in (("mesh", mesh), ("dp_group", dp_group), ("pp_group", pp_group)) if v is not None]
    if not (dist.is_available() and dist.is_initialized()):
        if given or pp > 1:
            raise ValueError(
                f"{', '.join(given) or f'pp={pp}'} needs torch.distributed: launch with torchrun and call "
                f"torch.distributed.init_process_group() before wrap()"
            )
        return None
    if mesh is not None:
        if dp_group is not None or pp_group is not None or pp != 1:
            raise ValueError("pass either mesh= or dp_group=/pp_group=/pp=, not both")
        names = tuple(mesh.mesh_dim_names or ())
        if "dp" not in names or not set(names) <= {"dp", "pp"}:
            raise ValueError(
                f"the mesh's dims are {names}; pipedp needs init_device_mesh(..., mesh_dim_names=('dp', 'pp')) "
                f"or ('dp',)"
            )
        return _from_groups(mesh.get_group("dp"), mesh.get_group("pp") if "pp" in names else None, td)
    if dp_group is not None or pp_group is not None:
        if pp != 1:
            raise ValueError("pass either pp= or dp_group=/pp_group=, not both")
        return _from_groups(dp_group, pp_group, td)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % pp:
        raise ValueError(f"pp={pp} does not divide the world size {world}: use a divisor of {world}")
    dp = world // pp
    everyone = dist.new_group(timeout=td)
    if pp == 1:
        return Layout(dp, 1, rank, 0, everyone, None, td, everyone)
    dp_groups = [[d * pp + p for d in range(dp)] for p in range(pp)]
    pp_groups = [[d * pp + p for p in range(pp)] for d in range(dp)]
    dp_g, _ = dist.new_subgroups_by_enumeration(dp_groups, timeout=td)
    pp_g, _ = dist.new_subgroups_by_enumeration(pp_groups, timeout=td)
    return Layout(dp, pp, rank // pp, rank % pp, dp_g, pp_g, td, everyone)


def check_backend(devices: list[torch.device], pp: int) -> None:
    """NCCL moves CUDA tensors only; gloo's point-to-point ops move CPU tensors only."""
    backend = dist.get_backend()
    if backend == "nccl" and any(d.type != "cuda" for d in devices):
        raise ValueError(
            "the process group uses NCCL but the model is on the CPU: move it to this rank's GPU "
            "(torch.cuda.set_device(local_rank); model.cuda()) or init_process_group('gloo')"
        )
    if backend == "gloo" and pp > 1 and any(d.type == "cuda" for d in devices):
        raise ValueError(
            "pp > 1 with the model on a GPU needs the NCCL backend: init_process_group('nccl') "
            "(gloo sends CPU tensors only)"
        )


def missing_ranks(event: int | str, world: int, wait_s: float = 3.0) -> list[int] | None:
    """Ranks that do not check in on the rendezvous store within ``wait_s`` after a failure.

    ``event`` names the failed work the same way on every rank (a step number,
    or a label of a collective every rank counts alike). Survivors each write a
    key; a rank that died or hangs never does. None if the store cannot be
    reached (its host is gone).
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"pipedp/failed/{event}/"
        store.set(prefix + str(dist.get_rank()), "1")
        deadline = time.monotonic() + wait_s
        while True:
            here = [r for r in range(world) if store.check([prefix + str(r)])]
            if len(here) == world or time.monotonic() > deadline:
                return [r for r in range(world) if r not in here]
            time.sleep(0.05)
    except Exception:  # the store's host may be the rank that died
        return None


def missing_note(event: int | str, world: int, during: str | None = None) -> str:
    """A sentence for an error: which ranks did not check in after a failure at step ``event``.

    ``during`` says what was being done instead of "at step ``event``" (then
    ``event`` is only the key the ranks agree on).
    """
    gone = missing_ranks(event, world)
    if gone is None:
        return " (could not reach the rendezvous store to find which rank is gone)"
    if not gone:
        return ""
    when = f"at step {event}" if during is None else f"while {during}"
    return f" Ranks that did not report {when}: {gone} (dead or hung)."


# -- collectives that honour our timeout -----------------------------------------------------------
# A blocking collective (and every object collective) waits as long as its group's own timeout,
# the process group's for the default group. These issue the collective asynchronously and wait
# with ``work.wait(timeout)``, which bounds the wait whatever the group (a step's collectives on NCCL
# wait on the stream instead); a failure or time-out is a DistributedError (the caller adds what was
# being done and who is gone).


LET_GO_S = 1.0  # the most a caller waits for gloo's thread to drop a finished collective's tensors


def timed(
    issue: Callable[[], Any], timeout: datetime.timedelta, lent: Sequence[torch.Tensor] = (),
    device_side: bool = False,
) -> None:
    """Issue one asynchronous collective (``issue()`` returns its work) and wait for it at most ``timeout``.

    ``lent`` are the tensors the collective was given: it returns only once
    gloo's thread has let go of those on the host (:func:`let_go`). With
    ``device_side`` (CUDA tensors on NCCL, inside a step) only the current
    stream waits, so the host neither blocks nor bounds the wait; the object
    and file collectives wait on the host, where ``timeout`` holds.
    On a failure the work is not waited for further and the error's traceback
    keeps it alive.
    """
    host = [t for t in lent if not t.is_cuda]
    before = use_counts(host)
    try:
        work = issue()
        if device_side:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as e:
        raise DistributedError(f"a collective failed or ran past {timeout.total_seconds():g} s: {e}") from e
    del work  # the caller's last reference to the work: gloo's thread may still hold one
    let_go(host, before)


def use_counts(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Each tensor's references now, C++ and Python, to pass to :func:`let_go` with the same list.

    Both count: while C++ holds a tensor (a collective's work), it also holds
    a reference to the tensor's Python object, which it drops, taking the GIL,
    when it lets go. Empty where this torch lacks the (private) C++ count:
    :func:`let_go` then waits for nothing.
    """
    count = getattr(torch.Tensor, "_use_count", None)
    return [(count(t), sys.getrefcount(t)) for t in tensors] if count is not None else []


def let_go(tensors: Sequence[torch.Tensor], before: Sequence[tuple[int, int]], limit_s: float = LET_GO_S) -> None:
    """Wait until the references to ``tensors`` are back to ``before`` (:func:`use_counts` before the collective).

    Why: gloo runs a collective on a thread of its own, which wakes the waiter
    first and lets go of the work's tensors after. Letting go of a tensor that
    Python also holds drops a reference to its Python object, which needs the
    GIL on that thread; if the interpreter is exiting by then, the thread
    cannot take it, and the process aborts ("terminate called without an
    active exception"). Waiting here until both counts are back leaves no such
    step to that thread. The wait is usually none or a few short sleeps; past
    ``limit_s`` it gives up.
    """
    deadline = time.monotonic() + limit_s
    while before and time.monotonic() < deadline and any(
        c > c0 or p > p0 for (c, p), (c0, p0) in zip(use_counts(tensors), before)
    ):
        time.sleep(1e-5)  # a real sleep: it gives up the GIL and the core to gloo's thread


def _wire(group: Any) -> torch.device:
    """Where a group's messages live: NCCL moves CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    # Ranks of one job trust each other's messages, as torch's own object collectives do.
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(t[:size].cpu().numpy().tobytes())


def gather_objects(obj: Any, group: Any, timeout: datetime.timedelta) -> list[Any]:
    """Every member's ``obj`` (picklable), by group rank, on every member of ``group``."""
    dev = _wire(group)
    n = dist.get_world_size(group)
    mine = _encode(obj, dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=dev)
    timed(lambda: dist.all_gather(sizes, size, group=group, async_op=True), timeout, [*sizes, size])
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
    padded[: mine.numel()] = mine
    parts = [torch.empty_like(padded) for _ in range(n)]
    timed(lambda: dist.all_gather(parts, padded, group=group, async_op=True), timeout, [*parts, padded])
    return [_decode(p, k) for p, k in zip(parts, lengths)]


def broadcast_object(obj: Any, src: int, group: Any, timeout: datetime.timedelta) -> Any:
    """Global rank ``src``'s ``obj`` on every member of ``group`` (the others pass anything)."""
    dev = _wire(group)
    sender = dist.get_rank() == src
    payload = _encode(obj, dev) if sender else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=dev)
    timed(lambda: dist.broadcast(size, src=src, group=group, async_op=True), timeout, [size])
    buf = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    timed(lambda: dist.broadcast(buf, src=src, group=group, async_op=True), timeout, [buf])
    return obj if sender else _decode(buf, buf.numel())


BROADCAST_CHUNK_BYTES = 256 * 1024 * 1024  # the most of one flat message (DDP's broadcast buffer is 250 MB)


def _chunks(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """``tensors`` in runs of at most ``cap`` bytes (a bigger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = cap
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > cap:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def broadcast_tensors(tensors: list[torch.Tensor], src: int, group: Any, timeout: datetime.timedelta) -> None:
    """Global rank ``src``'s values of ``tensors`` copied in place into every member's (same shapes and dtypes).

    One flat message per device, dtype and 256 MiB, on the group's wire device.
    """
    dev = _wire(group)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for ts in groups.values():
        for part in _chunks(ts, BROADCAST_CHUNK_BYTES):
            flat = torch.cat([t.detach().reshape(-1) for t in part]).to(dev)
            wire = flat.view(torch.uint8) if flat.dtype == torch.bool else flat  # gloo moves no bools
            timed(lambda: dist.broadcast(wire, src=src, group=group, async_op=True), timeout, [wire])
            off = 0
            with torch.no_grad():
                for t in part:
                    t.copy_(flat[off : off + t.numel()].view_as(t))
                    off += t.numel()


def barrier(group: Any, timeout: datetime.timedelta) -> None:
    """Wait until every member of ``group`` got here (at most ``timeout``)."""
    token = torch.zeros(1, device=_wire(group))
    timed(lambda: dist.all_reduce(token, group=group, async_op=True), timeout, [token])


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX} if dist.is_available() else {}


def all_reduce(tensor: torch.Tensor, op: str, group: Any, timeout: datetime.timedelta) -> None:
    """``tensor`` summed (``op="sum"``) or maximised (``"max"``) in place over ``group``.

    It travels on the group's wire device (a copy there and back when it
    lives elsewhere). On NCCL the wait is device-side, so a step stays free
    of host syncs; elsewhere the host waits at most ``timeout``.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {tuple(_OPS)}, got {op!r}")
    wire = _wire(group)
    buf = tensor if tensor.device == wire else tensor.to(wire)
    timed(lambda: dist.all_reduce(buf, op=_OPS[op], group=group, async_op=True), timeout, [buf],
          device_side=buf.is_cuda)
    if buf is not tensor:
        tensor.copy_(buf)
