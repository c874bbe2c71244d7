"""Deferred BatchNorm statistics: running statistics updated once a step's forwards are done, in a chosen order.

With microbatches, every BatchNorm normalises each microbatch with that
microbatch's statistics (as GPipe does) and, left alone, updates its running
statistics once per microbatch and use. ``batchnorm="batch"`` instead
accumulates the microbatch statistics of each use (count, mean, M2; Chan's
parallel merge) and commits one running-statistics update per use and step,
equal to what one forward over the whole batch would have done.

A BatchNorm object the model uses twice, with the uses in different stages,
needs deferring under ``batchnorm="microbatch"`` too: plain PyTorch updates it
use after use within each microbatch, while a pipeline runs a stage's
microbatches before the next stage's, and running statistics (an exponential
average) depend on the order of updates. Deferred per microbatch, the commit
replays the updates in plain order: microbatch by microbatch, use by use.

The commit is an action of each rank's program (BN_COMMIT, :mod:`.ranks`):
after the last forward of the last stage that uses a deferred BatchNorm, its
statistics are complete and applied, while the step's backwards go on
(:func:`commit_stages` names those stages; :meth:`DeferredBatchNorm.commit_stage`
applies them). What is left (uses outside any stage) is applied by
:meth:`DeferredBatchNorm.commit` at the end of the step.

A use is identified by the stage (chain) running it and by how many times that
chain's forward has called the module before; a chain's forwards within a step
are its microbatches in order. The user's modules are not replaced: for each
forward a hook hands BatchNorm scratch copies of its running buffers to update
(autograd may save them, so they are never touched again) and puts the
originals back after; the commit then updates the originals. Parameter and
buffer names and objects never change. The hooks reach this object weakly
(:mod:`.weak_hooks`): the model stays copyable and picklable, and the hooks
leave when :meth:`DeferredBatchNorm.remove` is called or this object dies.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from .weak_hooks import WeakHook, remove_all

__all__ = ["DeferredBatchNorm", "batchnorms_in_several", "deferred_in", "commit_stages"]

_Use = tuple[int, int]  # (chain position, -1 outside any chain; call number within that chain's forward)
_Moments = tuple[int, torch.Tensor, torch.Tensor]  # (count, mean, M2) of one call's input


class _Stats:
    __slots__ = ("calls", "saved")

    def __init__(self) -> None:
        self.calls: dict[_Use, list[_Moments]] = {}  # per use, one entry per microbatch in order
        self.saved: tuple[torch.Tensor, ...] | None = None


def _tracked(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def batchnorms_in_several(chains: Sequence[nn.Module]) -> list[_BatchNorm]:
    """Running-stats BatchNorms that more than one of ``chains`` (stages) uses."""
    seen: dict[_BatchNorm, int] = {}
    for chain in chains:
        for m in set(_tracked(chain)):
            seen[m] = seen.get(m, 0) + 1
    return [m for m, n in seen.items() if n > 1]


def deferred_in(chains: Sequence[nn.Module], mode: str) -> list[_BatchNorm]:
    """The BatchNorms of ``chains`` whose statistics a step defers: all for ``"batch"``, else those used by
    several stages (updated stage by stage they would leave plain order)."""
    if mode == "batch":
        return list(dict.fromkeys(m for chain in chains for m in _tracked(chain)))
    return batchnorms_in_several(chains)


def _last_users(chains: Sequence[nn.Module], modules: Iterable[_BatchNorm]) -> dict[_BatchNorm, int]:
    """Per module, the position of the last of ``chains`` that uses it (-1: none)."""
    wanted = set(modules)
    last = dict.fromkeys(wanted, -1)
    for pos, chain in enumerate(chains):
        for m in _tracked(chain):
            if m in wanted:
                last[m] = pos
    return last


def commit_stages(chains: Sequence[nn.Module], mode: str) -> list[int]:
    """The positions of ``chains`` after whose last forward deferred statistics are complete (BN_COMMIT)."""
    return sorted({p for p in _last_users(chains, deferred_in(chains, mode)).values() if p >= 0})


def _merge(calls: list[_Moments]) -> _Moments:
    """The moments of the concatenated inputs of ``calls`` (Chan's parallel merge)."""
    count, mean, m2 = calls[0]
    for n, mu, q in calls[1:]:
        total = count + n
        delta = mu - mean
        mean = mean + delta * (n / total)
        m2 = m2 + q + delta * delta * (count * n / total)
        count = total
    return count, mean, m2


def _update(m: _BatchNorm, moments: _Moments) -> None:
    """One running-statistics update of ``m``, as its own forward on that input would make."""
    count, mean, m2 = moments
    m.num_batches_tracked.add_(1)
    # A Python float for a fixed momentum: no host-to-device copy, so no sync.
    factor: torch.Tensor | float
    if m.momentum is None:
        factor = 1.0 / m.num_batches_tracked.to(torch.float32)
    else:
        factor = float(m.momentum)
    unbiased = m2 / max(count - 1, 1)
    rm, rv = m.running_mean, m.running_var
    rm.copy_((rm.float() * (1 - factor) + mean * factor).to(rm.dtype))
    rv.copy_((rv.float() * (1 - factor) + unbiased * factor).to(rv.dtype))


class DeferredBatchNorm:
    """Hooks on a model's running-stats BatchNorms (and its stages' chains); active only inside a step.

    ``chains`` are the stages' modules in pipeline order, so that each use of a
    BatchNorm is told apart. ``per_microbatch=False`` (``batchnorm="batch"``)
    commits one update per use from the whole batch; ``per_microbatch=True``
    commits the per-microbatch updates plain training makes, in its order.
    ``only`` limits the hooks to those BatchNorms (default: all of the model's).
    """

    def __init__(
        self,
        model: nn.Module,
        chains: Sequence[nn.Module] = (),
        *,
        per_microbatch: bool = False,
        only: Iterable[_BatchNorm] | None = None,
    ) -> None:
        self.active = False
        self.per_microbatch = per_microbatch
        keep = set(only) if only is not None else None
        self._stats: dict[_BatchNorm, _Stats] = {
            m: _Stats() for m in _tracked(model) if keep is None or m in keep
        }
        self._last = _last_users(chains, self._stats)  # the chain whose last forward completes each one's uses
        # Per thread: concurrent CPU stages run their chains' forwards on their own worker threads.
        self._here = threading.local()
        self._handles: list[RemovableHandle] = []
        self._finalizer = weakref.finalize(self, remove_all, self._handles)  # hooks leave when this object dies
        self._finalizer.atexit = False
        for pos, chain in enumerate(chains):
            self._handles.append(chain.register_forward_pre_hook(WeakHook(self, "_enter", pos)))
            self._handles.append(chain.register_forward_hook(WeakHook(self, "_leave")))
        for m in self._stats:
            self._handles.append(m.register_forward_pre_hook(WeakHook(self, "_before")))
            self._handles.append(m.register_forward_hook(WeakHook(self, "_after")))

    def __len__(self) -> int:
        return len(self._stats)

    def remove(self) -> None:
        """Take every hook off the modules (safe to call more than once)."""
        self._finalizer()

    def begin(self) -> None:
        for st in self._stats.values():
            st.calls, st.saved = {}, None
        self._leave()
        self.active = True

    def abort(self) -> None:
        """Drop the step's statistics and put back any buffer a failed forward left swapped."""
        for m in self._stats:
            self._put_back(m)
        self.begin()
        self.active = False

    def _enter(self, pos: int, *_hook_args: Any) -> None:
        self._here.chain, self._here.calls = pos, {}  # the chain running here; its calls of each module

    def _leave(self, *_hook_args: Any) -> None:
        self._here.chain, self._here.calls = -1, {}

    def _use(self, m: _BatchNorm) -> _Use:
        chain, calls = getattr(self._here, "chain", -1), getattr(self._here, "calls", {})
        if chain < 0:
            return (-1, 0)  # no chain: every call is the next microbatch of one use
        k = calls.get(m, 0)
        calls[m] = k + 1
        return (chain, k)

    def _before(self, m: _BatchNorm, args: tuple[Any, ...]) -> None:
        if not (self.active and m.training):
            return
        x = args[0].detach()
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.shape[1]
        st = self._stats[m]
        with torch.no_grad():
            var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
            st.calls.setdefault(self._use(m), []).append((n, mean, var * n))
            if st.saved is None:
                st.saved = (m.running_mean, m.running_var, m.num_batches_tracked)
            m.running_mean = m.running_mean.clone()
            m.running_var = m.running_var.clone()
            m.num_batches_tracked = m.num_batches_tracked.clone()

    def _after(self, m: _BatchNorm, args: tuple[Any, ...], output: Any) -> None:
        if self.active and m.training:
            self._put_back(m)

    def _put_back(self, m: _BatchNorm) -> None:
        st = self._stats[m]
        if st.saved is not None:
            m.running_mean, m.running_var, m.num_batches_tracked = st.saved
            st.saved = None

    def commit_stage(self, pos: int) -> None:
        """BN_COMMIT: apply the updates of the BatchNorms whose last use is chain ``pos`` (its last forward ran)."""
        with torch.no_grad():
            for m, st in self._stats.items():
                if self._last[m] == pos:
                    self._apply(m, st)

    def commit(self) -> None:
        """End the step's recording and apply the updates no BN_COMMIT applied (uses outside any chain)."""
        self.active = False
        with torch.no_grad():
            for m, st in self._stats.items():
                self._apply(m, st)

    def _apply(self, m: _BatchNorm, st: _Stats) -> None:
        """The step's running-statistics updates of ``m``: per use (whole batch) or per microbatch and use."""
        uses = [st.calls[u] for u in sorted(st.calls)]  # chain order, then call order: the model's
        if self.per_microbatch:
            for i in range(max((len(c) for c in uses), default=0)):
                for calls in uses:
                    if i < len(calls):
                        _update(m, calls[i])
        else:
            for calls in uses:
                _update(m, _merge(calls))
        st.calls = {}
