"""Swapping a model's depthwise ``nn.Conv2d`` layers onto the tuned-kernel op.

A layer keeps its object, parameters and state_dict keys; only its class
becomes :class:`TunedDepthwiseConv2d` (an ``nn.Conv2d`` whose forward calls
``pipedp.ops.depthwise_conv2d``). ``kernels="auto"`` swaps every depthwise
layer and lets each call fall back to torch where no kernel was tuned for the
layer, or where the tuned kernel measured slower than torch in the same
layout (forward, grad-input and grad-weight are chosen separately), and
``stages="auto"`` keeps them only where the plan's step runs faster with
them than on torch (:attr:`Swap.levers`); ``"tvm"``
uses every tuned kernel and makes a missing one an error that names the
command to run; ``"torch"`` swaps nothing. A layer's kernel serves every
batch size (microbatches, a last partial batch), whatever size it was tuned
at; only a library exported before that serves just the size it was tuned at,
and ``"tvm"`` then says to re-export it.

On a CPU ``"auto"`` swaps only where the kernels run on torch's OpenMP team
(:mod:`pipedp.ops.parallel`; that needs a C compiler at first use): on
TVM's own thread pool beside torch's the two pools contend for the cores,
and a training step ran slower with kernels that each beat torch alone
(the README has the figures). ``"tvm"`` uses them either way.

A kernel database that cannot be used (unreadable or corrupt records, a
missing, truncated or tampered library, an export record with missing
fields) never stops ``"auto"``: it logs a warning naming the problem and the
fix and keeps torch; ``"tvm"`` raises that error. :func:`swap_depthwise`
returns a :class:`Swap` that can put every layer back as it was, so a
``wrap`` that fails after the swap leaves the user's model unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..defaults import KERNEL_MODES
from .depthwise import depthwise_conv2d, problem_of
from .layout import layout_of_tensor
from .records import KernelDbError
from .runtime import ExportForOtherCpu, KernelChoice, KernelLibrary, default_db, library, load_library

__all__ = ["TunedDepthwiseConv2d", "is_depthwise", "swap_depthwise", "Swap", "KERNEL_MODES"]

log = logging.getLogger(__name__)


def is_depthwise(m: nn.Module) -> bool:
    """A plain ``nn.Conv2d`` that the depthwise kernels can compute (or one already swapped onto them)."""
    return (
        type(m) in (nn.Conv2d, TunedDepthwiseConv2d)
        and m.groups == m.in_channels > 1
        and m.out_channels % m.in_channels == 0
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    )


class TunedDepthwiseConv2d(nn.Conv2d):
    """A depthwise ``nn.Conv2d`` computed by the tuned kernels its :attr:`kernels` choice names."""

    kernels: KernelChoice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        kind = x.device.type
        if torch.is_autocast_enabled(kind) and x.is_floating_point():
            # As autocast runs torch's convolutions: input, weight and bias in the autocast dtype.
            dtype = torch.get_autocast_dtype(kind)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if self.kernels is not None and self.kernels.strict:
            self._require(x, self.kernels)
        return depthwise_conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.kernels)

    def _require(self, x: torch.Tensor, choice: KernelChoice) -> None:
        lib = library(choice.library)
        p = problem_of(x.shape, self.weight.shape, self.stride, self.padding, self.dilation, x.dtype)
        layout = layout_of_tensor(x)
        missing = [op for op in ("fwd", "dgrad", "wgrad") if lib.find(op, p, layout, choice.faster_only) is None]
        if not missing:
            return
        what = (f"kernels='tvm': no tuned {layout} {'/'.join(missing)} kernel on {x.device} for a depthwise layer "
                f"(kernel {tuple(self.kernel_size)}, stride {tuple(self.stride)}) whose input is {tuple(x.shape)}")
        command = (f"tune-kernels --model <your model> --input-shape N,C,H,W --target {x.device.type} "
                   f"--layouts {layout.lower()} --db {lib.db}")
        sizes = sorted({n for op in missing for n in lib.fixed_batches(op, p, layout)})
        if sizes:
            raise RuntimeError(
                f"{what}: {lib.path} was exported before kernels served every batch size, and has this layer's "
                f"kernels for batch size {', '.join(map(str, sizes))} only. Run `{command}` again to re-export them "
                f"for every batch size (the tuning records are kept), or wrap with kernels='auto' to use torch at "
                f"other batch sizes")
        raise RuntimeError(
            f"{what}. Run `{command}` with your model's input shape (any batch size N: a kernel tuned for a layer "
            f"serves every batch and microbatch size), or wrap with kernels='auto' to use torch where no kernel was "
            f"tuned")


_ABSENT = object()


@dataclass
class Swap:
    """What :func:`swap_depthwise` did: ``count`` layers were put on the kernels; :meth:`undo` puts every
    layer it touched back to the class and kernel choice it had before (a layer an earlier engine swapped gets
    that engine's choice back, not plain ``nn.Conv2d``).

    Whether the kernels pay in a whole step is the planner's question, not
    the swap's: a kernel that beat torch alone can still lose in a step
    (MobileNetV2 on a 2-core EPYC), so :attr:`levers` says what a plan may
    choose, :meth:`use` puts the swapped layers on the kernels or on torch,
    and :attr:`on` says which they run now.
    """

    count: int
    _before: list[tuple[nn.Module, type, object]] = field(default_factory=list, repr=False)
    choice: KernelChoice | None = None  # what the swapped layers run (None: nothing swapped)
    on: bool = False  # do the swapped layers run the kernels now (the last :meth:`use`)?

    @property
    def running(self) -> int:
        """How many layers run the tuned kernels now."""
        return self.count if self.on else 0

    @property
    def levers(self) -> tuple[bool, ...]:
        """Tuned kernels on or off, as a plan may choose: both under ``"auto"``, on under ``"tvm"``, else off."""
        if self.choice is None or not self.count:
            return (False,)
        return (True,) if self.choice.strict else (False, True)

    def use(self, on: bool) -> None:
        """Run the swapped layers on the kernels (``on``) or on torch; nothing to do where none was swapped."""
        if self.choice is None:
            return
        for m, _, _ in self._before:
            _put(m, self.choice if on else None)
        self.on = on

    def undo(self) -> None:
        """Restore the layers as they were before the swap (safe to call more than once)."""
        for m, cls, kernels in self._before:
            m.__class__ = cls
            if kernels is _ABSENT:
                m.__dict__.pop("kernels", None)
            else:
                m.kernels = kernels
        self.on = False


def _put(m: nn.Module, choice: KernelChoice | None) -> None:
    if choice is None:
        m.__class__ = nn.Conv2d
        m.__dict__.pop("kernels", None)
    else:
        m.__class__ = TunedDepthwiseConv2d
        m.kernels = choice


def _set(layers: list[nn.Module], choice: KernelChoice | None, count: int) -> Swap:
    swap = Swap(count, [(m, type(m), m.__dict__.get("kernels", _ABSENT)) for m in layers], choice,
                on=choice is not None and count > 0)
    for m in layers:
        _put(m, choice)
    return swap


def swap_depthwise(model: nn.Module, mode: str, db: str | None, device: torch.device) -> Swap:
    """Put the depthwise layers of ``model`` on the kernels per ``mode``; ``.count`` says how many run them.

    Each layer keeps its own choice (library and policy), so models wrapped
    with different ``mode``s in one process each run what they asked for;
    ``"torch"`` (or no usable library under ``"auto"``) puts layers swapped
    earlier back to plain ``nn.Conv2d``. Nothing changes before the library
    is loaded and checked, so an error leaves the model as it was.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    layers = [m for m in model.modules() if is_depthwise(m)]
    if mode == "torch" or not layers:
        return _set(layers, None, 0)
    db = db or default_db()
    lib = _library(db, mode, device, len(layers))
    if lib is None:
        if mode == "tvm":
            raise RuntimeError(
                f"kernels='tvm' but {db} holds no exported kernels for {device}: run `tune-kernels --model ... "
                f"--input-shape N,C,H,W --target {device.type} --db {db}` first, or wrap with kernels='auto'"
            )
        return _set(layers, None, 0)
    if mode == "auto" and device.type == "cpu" and not lib.torch_team:
        log.info("kernels='auto' on CPU: torch runs the %d depthwise layer(s), since the kernels could not join "
                 "torch's OpenMP team (no C compiler?) and on TVM's pool they slow a step (see pipedp.ops.swap); "
                 "kernels='tvm' uses them anyway", len(layers))
        return _set(layers, None, 0)
    return _set(layers, KernelChoice(lib.key, faster_only=mode == "auto", strict=mode == "tvm"), len(layers))


def _library(db: str, mode: str, device: torch.device, layers: int) -> KernelLibrary | None:
    """The checked library in ``db`` for ``device``; a damaged database is an error under ``"tvm"`` and, under
    ``"auto"``, a warning and None (torch runs the layers: a cache must never block training)."""
    if not os.path.isdir(db):
        return None
    try:
        return load_library(db, device)
    except KernelDbError as e:
        if mode == "tvm":
            raise KernelDbError(f"kernels='tvm' cannot use the kernels in {db}: {e}; or wrap with kernels='auto' "
                                f"to run torch") from e
        if isinstance(e, ExportForOtherCpu):  # not damage: a database made elsewhere (a shared home folder)
            log.info("kernels='auto': torch runs the %d depthwise layer(s): %s", layers, e)
            return None
        log.warning("kernels='auto': torch runs the %d depthwise layer(s), since the kernel database %s cannot be "
                    "used: %s", layers, db, e)
        return None
