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
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .checks import positive_int, positive_number

__all__ = ["Layout", "resolve_layout", "check_backend", "missing_ranks", "missing_note", "DistributedError", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 600.0


class DistributedError(RuntimeError):
    """A collective or point-to-point transfer failed or timed out (a peer died or hung)."""


@dataclass(frozen=True)
class Layout:
    """This rank's place: its data-parallel replica group and its pipeline group."""

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: Any
    pp_group: Any
    timeout: datetime.timedelta

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
    return Layout(dp, pp, dp_rank, pp_rank, dp_group, pp_group if pp > 1 else None, timeout)


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
    if pp == 1:
        return Layout(dp, 1, rank, 0, dist.new_group(timeout=td), None, td)
    dp_groups = [[d * pp + p for d in range(dp)] for p in range(pp)]
    pp_groups = [[d * pp + p for p in range(pp)] for d in range(dp)]
    dp_g, _ = dist.new_subgroups_by_enumeration(dp_groups, timeout=td)
    pp_g, _ = dist.new_subgroups_by_enumeration(pp_groups, timeout=td)
    return Layout(dp, pp, rank // pp, rank % pp, dp_g, pp_g, td)


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


def missing_ranks(step: int, world: int, wait_s: float = 3.0) -> list[int] | None:
    """Ranks that do not check in on the rendezvous store within ``wait_s`` after a failure.

    Survivors of a failed collective each write a key; a rank that died or
    hangs never does. None if the store cannot be reached (its host is gone).
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"pipedp/failed-step/{step}/"
        store.set(prefix + str(dist.get_rank()), "1")
        deadline = time.monotonic() + wait_s
        while True:
            here = [r for r in range(world) if store.check([prefix + str(r)])]
            if len(here) == world or time.monotonic() > deadline:
                return [r for r in range(world) if r not in here]
            time.sleep(0.05)
    except Exception:  # the store's host may be the rank that died
        return None


def missing_note(step: int, world: int) -> str:
    """A sentence for an error: which ranks did not check in after a failure at ``step``."""
    gone = missing_ranks(step, world)
    if gone is None:
        return " (could not reach the rendezvous store to find which rank is gone)"
    if not gone:
        return ""
    return f" Ranks that did not report at step {step}: {gone} (dead or hung)."
