"""Deferred BatchNorm statistics: running stats updated once per step, from the whole batch.

With microbatches, every BatchNorm normalises each microbatch with that
microbatch's statistics (as GPipe does) and, left alone, updates its running
statistics once per microbatch. ``batchnorm="batch"`` instead accumulates the
microbatch statistics (count, mean, M2; Chan's parallel merge) and commits one
running-statistics update per step, equal to what one forward over the whole
batch would have done. The user's modules are not replaced: for each
microbatch's forward a hook hands BatchNorm scratch copies of its running
buffers to update (autograd may save them, so they are never touched again) and
puts the originals back after; the commit then updates the originals once.
Parameter and buffer names and objects never change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredBatchNorm"]


class _Stats:
    __slots__ = ("count", "mean", "m2", "saved")

    def __init__(self) -> None:
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None
        self.saved: tuple[torch.Tensor, ...] | None = None


class DeferredBatchNorm:
    """Hooks on every running-stats BatchNorm of a model; active only inside a step."""

    def __init__(self, model: nn.Module) -> None:
        self.active = False
        self._stats: dict[_BatchNorm, _Stats] = {}
        self._handles = []
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.track_running_stats:
                self._stats[m] = _Stats()
                self._handles.append(m.register_forward_pre_hook(self._before))
                self._handles.append(m.register_forward_hook(self._after))

    def __len__(self) -> int:
        return len(self._stats)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def begin(self) -> None:
        for st in self._stats.values():
            st.count, st.mean, st.m2, st.saved = 0, None, None, None
        self.active = True

    def abort(self) -> None:
        """Drop the step's statistics and put back any buffer a failed forward left swapped."""
        for m in self._stats:
            self._put_back(m)
        self.begin()
        self.active = False

    def _before(self, m: _BatchNorm, args: tuple[Any, ...]) -> None:
        if not (self.active and m.training):
            return
        x = args[0].detach()
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
            st = self._stats[m]
            if st.count == 0:
                st.count, st.mean, st.m2 = n, mean, var * n
            else:
                total = st.count + n
                delta = mean - st.mean
                st.mean = st.mean + delta * (n / total)
                st.m2 = st.m2 + var * n + delta * delta * (st.count * n / total)
                st.count = total
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

    def commit(self) -> None:
        """Apply one running-statistics update per BatchNorm from the accumulated batch."""
        self.active = False
        with torch.no_grad():
            for m, st in self._stats.items():
                if st.count == 0 or st.mean is None or st.m2 is None:
                    continue
                m.num_batches_tracked.add_(1)
                # A Python float for a fixed momentum: no host-to-device copy, so no sync.
                factor: torch.Tensor | float
                if m.momentum is None:
                    factor = 1.0 / m.num_batches_tracked.to(torch.float32)
                else:
                    factor = float(m.momentum)
                unbiased = st.m2 / max(st.count - 1, 1)
                rm, rv = m.running_mean, m.running_var
                rm.copy_((rm.float() * (1 - factor) + st.mean * factor).to(rm.dtype))
                rv.copy_((rv.float() * (1 - factor) + unbiased * factor).to(rv.dtype))
                st.count, st.mean, st.m2 = 0, None, None
