"""The single-device training steps pipedp is measured against: what a user reaches for first.

Four ways to run the plain step (forward, loss, backward, SGD update) of the
unmodified model, each in two numerics:

* ``eager``: plain PyTorch;
* ``graph``: the whole eager step captured once as a CUDA graph and replayed
  (PyTorch's documented recipe; CUDA only);
* ``compile``: ``torch.compile(model)`` in its default mode;
* ``max-autotune``: ``torch.compile(model, mode="max-autotune")``, which also
  autotunes kernels and runs the compiled graphs as CUDA graphs (CUDA only;
  its compile takes minutes);
* ``graph+compile`` and ``graph+max-autotune``: the compiled model (default
  mode, or ``max-autotune-no-cudagraphs``) inside the whole step captured as
  one CUDA graph, optimizer update included. torch.compile's own CUDA graphs
  cover only the compiled forward and backward, so the eager optimizer step
  and the host stay on the critical path (measured on an H100: max-autotune
  at 0.61x of the graphed eager step); capturing the whole step of a
  compiled model is what a user who knows both tools builds by hand, and the
  strongest single-GPU baseline here (CUDA only).

Besides these, :func:`accum_step` is the plain step with gradient
accumulation over equal chunks of the batch (one update): what a user tries
when activations crowd memory or the cache, and pipedp's one-stage plans
without the pipeline.

Numerics ``fp32`` is NCHW without autocast; ``bf16cl`` is bf16 autocast with
the model and batches in channels-last memory format (what tensor cores
prefer). Each step trains its own model and optimizer; compile time is the
time its first steps take, reported apart from the timed windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipedp.pipeline import microbatch
from pipedp.pipeline.graphed import capturing, fresh_cublas_workspaces

__all__ = ["Step", "Numerics", "NUMERICS", "BASELINES", "numerics", "in_format", "prepare", "skip_reason",
           "make_baseline", "plain_step", "accum_step", "graphed_step"]

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BASELINES = ("eager", "graph", "compile", "max-autotune", "graph+compile", "graph+max-autotune")
_CUDA_ONLY = {"graph": "CUDA graphs need a CUDA device",
              "max-autotune": "mode='max-autotune' runs CUDA graphs: it needs a CUDA device",
              "graph+compile": "CUDA graphs need a CUDA device",
              "graph+max-autotune": "CUDA graphs need a CUDA device"}


@dataclass(frozen=True)
class Numerics:
    """How a step computes: autocast dtype (None: fp32) and memory format."""

    name: str
    autocast: torch.dtype | None
    channels_last: bool

    @property
    def precision(self) -> str:
        """pipedp's ``precision=`` for the same numerics."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.autocast, "fp32")  # type: ignore[arg-type]


NUMERICS = {"fp32": Numerics("fp32", None, False), "bf16cl": Numerics("bf16cl", torch.bfloat16, True)}


def numerics(name: str) -> Numerics:
    if name not in NUMERICS:
        raise ValueError(f"unknown numerics {name!r}: choose from {', '.join(NUMERICS)}")
    return NUMERICS[name]


def in_format(x: torch.Tensor, num: Numerics) -> torch.Tensor:
    """Batch ``x`` in the memory format of ``num``."""
    return x.contiguous(memory_format=torch.channels_last) if num.channels_last and x.dim() == 4 else x


def prepare(model: nn.Module, x: torch.Tensor, num: Numerics) -> tuple[nn.Module, torch.Tensor]:
    """``model`` and batch ``x`` in the memory format of ``num``."""
    if num.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, in_format(x, num)


def skip_reason(kind: str, device: torch.device, compile_on_cpu: bool = False) -> str | None:
    """Why baseline ``kind`` does not run on ``device`` (None: it runs)."""
    if kind not in BASELINES:
        raise ValueError(f"unknown baseline {kind!r}: choose from {', '.join(BASELINES)}")
    if device.type != "cuda" and kind in _CUDA_ONLY:
        return _CUDA_ONLY[kind]
    if device.type != "cuda" and kind == "compile" and not compile_on_cpu:
        return "torch.compile on a CPU takes minutes per model: pass --compile-on-cpu to time it"
    return None


def _forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num: Numerics,
                  cache: bool = True) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=num.autocast, enabled=num.autocast is not None, cache_enabled=cache):
        return F.cross_entropy(model(x), y)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, num: Numerics,
               before: Callable[[], object] | None = None) -> Step:
    """The eager step; ``before`` runs first each step (max-autotune marks a new CUDA-graph step there)."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if before is not None:
            before()
        opt.zero_grad(set_to_none=True)
        loss = _forward_loss(model, x, y, num)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def accum_step(model: nn.Module, opt: torch.optim.Optimizer, num: Numerics, chunks: int) -> Step:
    """The step over ``chunks`` equal parts of the batch, one update: gradient accumulation (``model`` may be compiled).

    Each part's mean loss is weighted by its share of the batch, so the
    gradient is the full batch's (exactly so without BatchNorm, whose
    statistics are per part); the loss returned is the full batch's too.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        xs, ys = microbatch.split(x, chunks), microbatch.split(y, chunks)
        total = torch.zeros((), device=x.device)
        for xc, yc, share in zip(xs, ys, microbatch.shares([c.shape[0] for c in xs])):
            loss = _forward_loss(model, xc, yc, num) * share
            loss.backward()
            total += loss.detach()
        opt.step()
        return total

    return step


def graphed_step(model: nn.Module, opt: torch.optim.Optimizer, num: Numerics, x0: torch.Tensor, y0: torch.Tensor,
                 stream: torch.cuda.Stream | None = None) -> tuple[Step, Callable[[], None]]:
    """The eager step captured whole as a CUDA graph: (step copying a batch in and replaying, bare replay).

    Warm-up runs on a side stream (cuDNN plans, optimizer state), then one
    capture on its own stream with fresh cuBLAS workspaces, as several graphs
    live in one process (see ``pipedp.pipeline.graphed``). Autocast's weight
    cache is off inside the capture, as CUDA graphs require. The bare replay
    (no copies) runs on ``stream`` when given: the ceiling test replays copies
    of it side by side.
    """
    sx, sy = x0.clone(memory_format=torch.preserve_format), y0.clone()

    def body() -> torch.Tensor:
        loss = _forward_loss(model, sx, sy, num, cache=False)
        loss.backward()
        opt.step()
        return loss

    # The warm-up runs exactly what the capture records (the static inputs, autocast's cache off): a compiled
    # model then compiles, and recompiles on whatever its guards see, outside the capture, where compiling
    # may launch work (inside it, graph+compile-nchw failed with "operation not permitted when stream is
    # capturing", H100 2026-11-27).
    side = torch.cuda.Stream(x0.device)
    side.wait_stream(torch.cuda.current_stream(x0.device))
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream(x0.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    fresh_cublas_workspaces()
    with capturing(graph, x0.device, torch.cuda.Stream(x0.device)):
        loss = body()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sx.copy_(x, non_blocking=True)
        sy.copy_(y, non_blocking=True)
        graph.replay()
        return loss.detach().clone()

    def replay() -> None:
        if stream is None:
            graph.replay()
            return
        with torch.cuda.stream(stream):
            graph.replay()

    # The graph writes into the model's parameters and the optimizer's state: they live as long as the steps.
    step.owners = replay.owners = (model, opt, graph)  # type: ignore[attr-defined]
    return step, replay


def make_baseline(kind: str, num: Numerics, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  lr: float = 0.05) -> Step:
    """Baseline ``kind`` training ``model`` (already in ``num``'s memory format) with SGD on batches like ``x``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if kind == "eager":
        return plain_step(model, opt, num)
    if kind == "graph":
        return graphed_step(model, opt, num, x, y)[0]
    if kind == "compile":
        return plain_step(torch.compile(model), opt, num)  # type: ignore[arg-type]
    if kind == "max-autotune":
        return plain_step(torch.compile(model, mode="max-autotune"), opt, num,  # type: ignore[arg-type]
                          before=torch.compiler.cudagraph_mark_step_begin)
    if kind in ("graph+compile", "graph+max-autotune"):
        # The graph's warm-up steps compile the model; the capture then records the compiled kernels.
        mode = "max-autotune-no-cudagraphs" if kind == "graph+max-autotune" else None
        return graphed_step(torch.compile(model, mode=mode), opt, num, x, y)[0]  # type: ignore[arg-type]
    raise ValueError(f"unknown baseline {kind!r}: choose from {', '.join(BASELINES)}")
