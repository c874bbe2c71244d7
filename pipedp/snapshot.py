"""Saving and putting back what a step or a measurement may change: buffers, gradients, RNG streams.

Three users share these: a failed training step puts BatchNorm statistics
back (:class:`BufferSnapshot`, reused every step without new allocations),
profiling and trial steps leave the model and the random streams as they
found them (:func:`preserved_state`), and checkpoints carry every RNG stream
(:func:`rng_state`) as tensors and plain values, so they pass
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["BufferSnapshot", "preserved_state", "rng_state", "set_rng_state"]


class BufferSnapshot:
    """Copies of a model's buffers, refreshed in place by :meth:`save` and copied back by :meth:`restore`."""

    def __init__(self, model: nn.Module) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in model.buffers():
            groups.setdefault((b.device, b.dtype), []).append(b)
        self.groups = list(groups.values())
        self.saved: list[list[torch.Tensor]] | None = None

    def save(self) -> None:
        with torch.no_grad():
            if self.saved is None:
                self.saved = [[b.clone() for b in g] for g in self.groups]
            else:
                for dst, src in zip(self.saved, self.groups):
                    torch._foreach_copy_(dst, src)

    def restore(self) -> None:
        if self.saved is None:
            return
        with torch.no_grad():
            for dst, src in zip(self.groups, self.saved):
                torch._foreach_copy_(dst, src)


def _cuda_indices(devices: Sequence[torch.device | str]) -> list[int]:
    return sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})


@contextlib.contextmanager
def preserved_state(model: nn.Module, devices: Sequence[torch.device | str] = ()) -> Iterator[None]:
    """Put back buffers, ``.grad`` and torch's RNG (CPU and the given CUDA devices) on exit."""
    buffers = BufferSnapshot(model)
    buffers.save()
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = [(i, torch.cuda.get_rng_state(i)) for i in _cuda_indices(devices)]
    try:
        yield
    finally:
        buffers.restore()
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(cpu_rng)
        for i, state in cuda_rng:
            torch.cuda.set_rng_state(state, i)


def rng_state() -> dict[str, Any]:
    """torch (CPU and every initialised CUDA device), Python and NumPy RNG states, loadable as data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "python": [version, list(internal), gauss],
        "numpy": [str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda:
        if torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            for i, s in enumerate(cuda):
                torch.cuda.set_rng_state(s, i)
        else:
            warnings.warn(
                f"the checkpoint has CUDA RNG states for {len(cuda)} device(s), this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: CUDA RNG not restored",
                stacklevel=2,
            )
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
