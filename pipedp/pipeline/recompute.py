"""Per-stage activation recompute: keep a stage's input, rerun its forward in backward.

A stage's activations are most of a pipeline's memory (1F1B keeps up to
``stages`` microbatches of them in flight on the first stage). With recompute
a stage keeps only its input and recomputes the rest when its backward needs
it (``torch.utils.checkpoint``, non-reentrant): one more forward per
microbatch for that stage's memory.

The recomputed forward must be the same computation and must leave no trace:

* random layers draw the same masks (``preserve_rng_state``: the RNG state
  of the first forward is replayed);
* autocast is replayed as it was (checkpoint records it), although backward
  itself runs outside autocast;
* buffers are not updated twice: during the recomputation every buffer of the
  stage is swapped for a scratch copy, so a BatchNorm in training mode
  updates the copy, which is dropped (the originals are never written, so
  nothing autograd saved of them changes either); and hooks that record
  statistics (deferred BatchNorm) are paused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Recompute"]


class Recompute:
    """``fn`` (a stage's chain, maybe compiled) run so that its activations are recomputed in backward.

    ``module`` holds the buffers the recomputation must not change. ``paused``:
    objects whose ``active`` flag is turned off while recomputing (hooks that
    record each forward, such as deferred BatchNorm statistics).
    """

    def __init__(self, fn: Callable[[torch.Tensor], Any], module: nn.Module) -> None:
        self.fn = fn
        self.module = module
        self.paused: list[Any] = []

    def __call__(self, x: torch.Tensor) -> Any:
        if not torch.is_grad_enabled():  # inference: nothing would be kept anyway
            return self.fn(x)
        return checkpoint(self.fn, x, use_reentrant=False, preserve_rng_state=True, context_fn=self._contexts)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), self._recomputing()

    @contextlib.contextmanager
    def _recomputing(self) -> Iterator[None]:
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        scratch: dict[int, torch.Tensor] = {}  # a buffer registered twice gets one scratch copy
        flags = [(h, h.active) for h in self.paused]
        try:
            with torch.no_grad():
                for mod in self.module.modules():
                    for name, b in list(mod._buffers.items()):
                        if b is not None:
                            swapped.append((mod, name, b))
                            mod._buffers[name] = scratch.setdefault(id(b), b.clone())
            for h, _ in flags:
                h.active = False
            yield
        finally:
            for mod, name, b in swapped:
                mod._buffers[name] = b
            for h, active in flags:
                h.active = active
