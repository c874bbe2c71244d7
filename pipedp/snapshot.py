"""Saving and putting back what a step or a measurement may change: buffers, gradients, RNG streams.

Four users share these: a failed training step puts BatchNorm statistics
back (:class:`BufferSnapshot`, reused every step without new allocations)
and, when the optimizer itself fails, parameters and optimizer state
(:class:`UpdateSnapshot`: an optimizer may update some parameters and then
raise, or create its state and then raise),
profiling and trial steps leave the model and the random streams as they
found them (:func:`preserved_state`), and checkpoints carry every RNG stream
(:func:`rng_state`) as tensors and plain values, so they pass
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import random
import warnings
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["BufferSnapshot", "UpdateSnapshot", "forked_rng", "preserved_state", "rng_state", "set_rng_state"]


class BufferSnapshot:
    """Copies of a model's buffers, refreshed by :meth:`save` and copied back by :meth:`restore`.

    Buffers are found by module and name at each :meth:`save`, not kept as the
    tensor objects of the first one: ``model.double()``, ``load_state_dict(...,
    assign=True)`` or ``bn.running_mean = t`` put other tensors there after
    wrap, and a failed step must put back what the model holds now. While
    those stay the same tensors, a save reuses its copies (no allocation).
    """

    def __init__(self, model: nn.Module) -> None:
        self.slots = [(m, name) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        self.live: list[torch.Tensor] = []  # the tensors of the last save, each once
        self.groups: list[list[torch.Tensor]] = []  # of ``live``, by device and dtype
        self.saved: list[list[torch.Tensor]] | None = None

    def _current(self) -> list[torch.Tensor]:
        found = (m._buffers.get(name) for m, name in self.slots)
        return list({id(b): b for b in found if b is not None}.values())

    def save(self) -> None:
        live = self._current()
        with torch.no_grad():
            if self.saved is not None and len(live) == len(self.live) and all(map(operator.is_, live, self.live)):
                for dst, src in zip(self.saved, self.groups):
                    torch._foreach_copy_(dst, src)
                return
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for b in live:
                groups.setdefault((b.device, b.dtype), []).append(b)
            self.live, self.groups = live, list(groups.values())
            self.saved = [[b.clone() for b in g] for g in self.groups]

    def restore(self) -> None:
        """Put the saved values back into the tensors the model held at :meth:`save`."""
        if self.saved is None:
            return
        with torch.no_grad():
            for dst, src in zip(self.groups, self.saved):
                torch._foreach_copy_(dst, src)


_IMMUTABLE = (int, float, bool, complex, str, bytes, type(None))


def _kept(value: Any) -> Any:
    """``value`` as it is now: itself where it cannot change in place (numbers, strings), else a deep copy."""
    if isinstance(value, _IMMUTABLE) or (isinstance(value, tuple) and all(isinstance(v, _IMMUTABLE) for v in value)):
        return value
    return copy.deepcopy(value)


class _Copies:
    """Reusable copies of a changing set of tensors, copied in one foreach call per device and dtype.

    While a save gets the same keys and tensor objects as the one before, of
    the same shapes and dtypes (every step of a training run, once the
    optimizer state exists; ``model.double()`` keeps the parameter objects
    and changes their dtype), it reuses the pairs it grouped: a step pays the
    copies, not the bookkeeping.
    """

    def __init__(self) -> None:
        self.saved: dict[tuple[int, str], torch.Tensor] = {}
        self.keys: list[tuple[int, str]] = []
        self.live: list[torch.Tensor] = []  # the tensors of the last save, in the order of ``keys``
        self.copies: list[torch.Tensor] = []  # their copies, in the same order
        self.pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def save(self, tensors: Sequence[tuple[tuple[int, str], torch.Tensor]]) -> None:
        keys = [k for k, _ in tensors]
        live = [t for _, t in tensors]
        if (keys != self.keys or not all(map(operator.is_, live, self.live))
                or not all(map(_alike, live, self.copies))):
            self._regroup(keys, live)
        for dsts, srcs in self.pairs:
            torch._foreach_copy_(dsts, srcs)

    def _regroup(self, keys: list[tuple[int, str]], live: list[torch.Tensor]) -> None:
        wanted = set(keys)
        for key in [k for k in self.saved if k not in wanted]:
            del self.saved[key]
        pairs: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for key, t in zip(keys, live):
            dst = self.saved.get(key)
            if dst is None or not _alike(dst, t):
                self.saved[key] = dst = torch.empty_like(t, memory_format=torch.preserve_format)
            dsts, srcs = pairs.setdefault((t.device, t.dtype), ([], []))
            dsts.append(dst)
            srcs.append(t)
        self.keys, self.live, self.pairs = keys, live, list(pairs.values())
        self.copies = [self.saved[k] for k in keys]


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()


class UpdateSnapshot:
    """Parameters, optimizer state and hyperparameters as they were before ``optimizer.step()``.

    :meth:`save` copies them into buffers kept from step to step (the memory
    of one more copy of parameters and optimizer state); :meth:`restore`
    puts every value back, drops state the failed step created and keys it
    added, so a step that raised inside the optimizer leaves nothing changed.
    Values that cannot change in place (numbers, strings) are kept as they
    are; others are copied.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params: list[torch.Tensor] = []
        self.tensors = _Copies()
        self.state: list[dict[str, Any] | None] = []  # per parameter: its non-tensor state, None if it had none
        self.groups: list[dict[str, Any]] = []

    def save(self) -> None:
        live: list[tuple[tuple[int, str], torch.Tensor]] = []
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]  # groups may have been added
        self.state = []
        for i, p in enumerate(self.params):
            live.append(((i, ""), p))
            st = self.optimizer.state.get(p)
            if st is None:
                self.state.append(None)
                continue
            plain = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    live.append(((i, k), v))
                else:
                    plain[k] = _kept(v)
            self.state.append(plain)
        self.groups = [{k: _kept(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        with torch.no_grad():
            self.tensors.save(live)

    def release(self) -> None:
        """Free the copies (the next :meth:`save` allocates them again)."""
        self.tensors = _Copies()
        self.params, self.state, self.groups = [], [], []

    def restore(self) -> None:
        saved = self.tensors.saved
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(saved[i, ""])
                plain = self.state[i]
                if plain is None:
                    self.optimizer.state.pop(p, None)
                    continue
                st = self.optimizer.state[p]
                tensors = {k: t for (j, k), t in saved.items() if j == i and k}
                for k in [k for k in st if k not in plain and k not in tensors]:
                    del st[k]
                st.update({k: _kept(v) for k, v in plain.items()})
                for k, t in tensors.items():
                    cur = st.get(k)
                    if isinstance(cur, torch.Tensor) and cur.shape == t.shape and cur.dtype == t.dtype \
                            and cur.device == t.device:
                        cur.copy_(t)
                    else:
                        st[k] = t.clone()
        for g, kept in zip(self.optimizer.param_groups, self.groups):
            g.update({k: _kept(v) for k, v in kept.items()})


def _cuda_indices(devices: Sequence[torch.device | str]) -> list[int]:
    return sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})


@contextlib.contextmanager
def forked_rng(devices: Sequence[torch.device | str] = ()) -> Iterator[None]:
    """Put torch's RNG (CPU and the given CUDA devices) back on exit: what runs inside draws without moving the
    user's generators, so a seeded script draws the same masks and data order with pipedp as without."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = [(i, torch.cuda.get_rng_state(i)) for i in _cuda_indices(devices)]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        for i, state in cuda_rng:
            torch.cuda.set_rng_state(state, i)


@contextlib.contextmanager
def preserved_state(model: nn.Module, devices: Sequence[torch.device | str] = ()) -> Iterator[None]:
    """Put back buffers, ``.grad`` and torch's RNG (CPU and the given CUDA devices) on exit."""
    buffers = BufferSnapshot(model)
    buffers.save()
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        with forked_rng(devices):
            yield
    finally:
        buffers.restore()
        for p, g in grads:
            p.grad = g


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
