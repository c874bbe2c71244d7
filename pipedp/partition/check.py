"""Checking that a model's blocks compute what its forward computes, as it infers and as it trains.

A cut is only as good as this check: the blocks come from the model's
structure or from an fx trace, and either can miss what the author wrote
(a forward that does something other than its attributes suggest, a
grad-mode region, a mode read as a constant, Python randomness baked in).
The blocks must give the model's output in eval mode, and in train mode its
output and its gradients (of every trainable parameter and of the input),
with every random generator forked so that both runs draw the same numbers
and the user's generators, buffers and ``.grad`` are left as they were.
"""

from __future__ import annotations

import contextlib
import io
import sys

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from ..snapshot import BufferSnapshot, preserved_state, rng_state, set_rng_state
from .blocks import Block, Chain, CutError, module_mode
from .boundary import Value, is_value, leaf, map_tensors, tensors

__all__ = ["check_chain", "changes_input", "mutates_input", "CHECK_SAMPLES"]

# Samples of the planning batch each check runs on: what a cut computes does not depend on the batch size, and
# the whole first microbatch (a batch of 224-pixel images, say) made the check cost seconds per plan.
CHECK_SAMPLES = 4


_INPLACE_LEAF = "leaf Variable that requires grad is being used in an in-place operation"


def mutates_input(err: BaseException) -> bool:
    """Is ``err`` autograd refusing an in-place op on a stage's leaf input?"""
    return isinstance(err, RuntimeError) and _INPLACE_LEAF in str(err)


def check_chain(model: nn.Module, blocks: list[Block], sample: torch.Tensor) -> list[bool]:
    """Check that the blocks compute the model; return which blocks modify their input (:func:`changes_input`).

    First in eval mode (deterministic): catches a model that looks like a
    known structure but whose forward does something else, and blocks that
    return what cannot pass a boundary (not a tensor or a tuple of tensors).
    Then in train mode with gradients (:func:`_check_training`). Every run
    is on a copy of ``sample``'s first :data:`CHECK_SAMPLES` samples, with
    the generators forked.

    NaN/inf in the eval output alone is no reason to refuse: a model whose
    BatchNorm running statistics went NaN (an fp16 first batch that
    overflowed, as under plain autocast) gives NaN in eval mode but trains on
    batch statistics, and plain PyTorch trains it. There the chain must give
    NaN/inf where the model does, and the train-mode comparison checks the
    cut. A train-mode output with NaN/inf cannot be compared at all, so it is
    refused as such (naming where the NaN/inf first appears) rather than
    passed unchecked.
    """
    sample = sample[:CHECK_SAMPLES]
    not_finite = _check_inference(model, blocks, sample)
    flags = changes_input(model, blocks, sample)
    _check_training(model, blocks, sample, input_grad=not flags[0], not_finite=not_finite)
    return flags


def _check_inference(model: nn.Module, blocks: list[Block], sample: torch.Tensor) -> str | None:
    """The eval-mode comparison; returns where NaN/inf first appears when the model's eval output has some."""
    first_bad: str | None = None  # the first block whose output is not finite
    # The model and the chain each on a copy: a forward may change its input in place.
    with preserved_state(model, [sample.device]), module_mode(model, training=False), torch.no_grad():
        ref = model(sample.clone())
        y: Value = sample.clone()
        for i, b in enumerate(blocks):
            y = b.module(y)
            if not is_value(y) or (i == len(blocks) - 1 and not isinstance(y, torch.Tensor)):
                raise CutError(
                    f"block '{b.name}' of {type(model).__name__} returns {type(y).__name__}, not a tensor"
                    f"{'' if i == len(blocks) - 1 else ' or a tuple of tensors'}; only those pass between stages"
                )
            if first_bad is None and not all(_finite(t) for t in tensors(y)):
                first_bad = b.name
    assert isinstance(y, torch.Tensor)
    _check_output(model, ref)
    # NaN/inf must be where the model has them (isclose takes equal infinities as equal), the rest close.
    if ref.shape != y.shape or not torch.allclose(ref.float(), y.float(), rtol=1e-4, atol=1e-5, equal_nan=True):
        raise CutError(
            f"{type(model).__name__}.forward is not the chain of its blocks "
            f"({', '.join(b.name for b in blocks[:6])}{', ...' if len(blocks) > 6 else ''}): "
            f"running them in order gives a different result"
        )
    return None if _finite(ref) else _where_not_finite(sample, first_bad)


def _check_training(model: nn.Module, blocks: list[Block], sample: torch.Tensor, *, input_grad: bool,
                    not_finite: str | None = None) -> None:
    """The blocks train as the model does: the same output and gradients in train mode, the same random draws.

    Both runs start from one random state (torch CPU and CUDA, Python,
    NumPy) and one set of buffers, so dropout and drop path draw the same
    masks, and the loss is a fixed random projection of the output.
    Gradients are taken with ``torch.autograd.grad``: ``.grad`` is not
    touched. The input's gradient is compared where the forward does not
    change its input (such a forward cannot take a leaf that requires grad).
    A model that fails to train on the sample itself is not judged here:
    its first step fails as plain PyTorch's would. A train-mode output with
    NaN/inf is refused (ValueError); ``not_finite``: where the eval-mode
    check saw NaN/inf first, to name in that refusal.
    """
    name = type(model).__name__
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    input_grad = input_grad and sample.is_floating_point()
    buffers = BufferSnapshot(model)
    start = rng_state()
    buffers.save()
    try:
        with module_mode(model, training=True), torch.enable_grad():
            try:
                x, out = _forward(model, sample, input_grad)
            except Exception:  # noqa: BLE001 - the model itself does not train on this: its first step says why
                return
            _refuse_reentrant(model, out)
            try:
                ref = _gradients(x, out, params, input_grad)
            except Exception:  # noqa: BLE001 - as above
                return
            if not _finite(ref[0]):
                raise _not_finite(model, ref[0], not_finite or _where_not_finite(sample, None, train=True))
            set_rng_state(start)
            buffers.restore()
            chain = Chain(blocks)
            try:
                got = _trained(chain, sample, params, input_grad)
            except Exception as e:  # noqa: BLE001 - the model trained on this batch, its blocks did not
                raise CutError(f"{name}'s blocks fail in train mode where its forward runs: {type(e).__name__}: "
                               f"{e}") from e
    finally:
        set_rng_state(start)
        buffers.restore()
    names = ["the output", *(f"the gradient of '{n}'" for n, _ in params),
             *(["the input's gradient"] if input_grad else [])]
    for what, a, b in zip(names, ref, got):
        if not _close(a, b):
            why = ("its forward does something the blocks do not record (a grad-mode switch, an autograd hook, "
                   "Python randomness or state read once when traced)")
            raise CutError(f"{name} trains differently from the chain of its blocks: in train mode {what} differs "
                           f"({_gap(a, b)}); {why}")


def _trained(module: nn.Module, sample: torch.Tensor, params: list[tuple[str, nn.Parameter]],
             input_grad: bool) -> list[torch.Tensor | None]:
    """``module``'s output on a copy of ``sample`` and the gradients of a fixed projection of it."""
    return _gradients(*_forward(module, sample, input_grad), params, input_grad)


def _forward(module: nn.Module, sample: torch.Tensor, input_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The input (a copy of ``sample``) and ``module``'s output on it."""
    x = sample.clone().requires_grad_(input_grad)
    out = module(x)
    if not isinstance(out, torch.Tensor):
        raise CutError(f"{type(module).__name__} returns {type(out).__name__} in train mode, not a tensor")
    return x, out


def _gradients(x: torch.Tensor, out: torch.Tensor, params: list[tuple[str, nn.Parameter]],
               input_grad: bool) -> list[torch.Tensor | None]:
    """``out`` (detached) and the gradients of a fixed random projection of it."""
    wrt = [p for _, p in params] + ([x] if input_grad else [])
    if not out.requires_grad or not wrt:
        return [out.detach()] + [None] * len(wrt)
    g = torch.Generator(device=out.device).manual_seed(0)
    w = torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float32)
    grads = torch.autograd.grad((out.float() * w).sum(), wrt, allow_unused=True)
    return [out.detach()] + list(grads)


def _refuse_reentrant(model: nn.Module, out: torch.Tensor) -> None:
    """Refuse a cut of a forward that runs ``torch.utils.checkpoint`` with reentrant autograd, naming what it wraps.

    Such a checkpoint runs its function under ``no_grad`` and recomputes it in
    its own backward. fx traces through it, so the blocks see a no-grad
    region and drop the gradients the checkpoint passes; and the check's
    ``torch.autograd.grad``, which it refuses, cannot show that.
    """
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "_forward_cls", None) is CheckpointFunction:
            raise CutError(
                f"{type(model).__name__}.forward runs torch.utils.checkpoint with use_reentrant=True around "
                f"{_callee(model, getattr(node, 'run_function', None))}: torch.fx traces through it as a no-grad "
                f"region, so blocks cut from it would drop the gradients it passes",
                "pass use_reentrant=False to torch.utils.checkpoint (the same gradients, and it can be cut)")
        todo.extend(n for n, _ in node.next_functions)


def _callee(model: nn.Module, fn: object) -> str:
    """``fn`` as the user knows it: the name of the module it is (or a method of), else its qualified name."""
    target = getattr(fn, "__self__", fn)
    for name, m in model.named_modules():
        if m is target:
            return f"'{name or type(model).__name__}'"
    return f"'{getattr(fn, '__qualname__', type(fn).__name__)}'"


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None or bool(((a if b is None else b) == 0).all())  # unused is a zero gradient
    if a.shape != b.shape:
        return False
    rtol = 1e-3 if a.dtype in (torch.float32, torch.float64) else 5e-2
    a, b = a.double(), b.double()
    return bool((a - b).abs().max() <= rtol * a.abs().max() + 1e-6)


def _gap(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return "one of them has none"
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)} against {tuple(a.shape)}"
    return f"by up to {(a.double() - b.double()).abs().max().item():.3g}, against values up to {a.abs().max().item():.3g}"


def changes_input(model: nn.Module, blocks: list[Block], sample: torch.Tensor) -> list[bool]:
    """Which blocks modify their input in place as they train, so that a stage starting with one gives it a copy.

    The blocks run as stages train them: train mode, gradients on, each
    block after the first on a fresh leaf that requires grad. Eval mode
    would hide some (``Dropout(inplace=True)`` does nothing there), and so
    would ``no_grad`` (an engine whose first call is inference plans under
    it, where autograd lets an in-place change of a leaf pass). Reported: a
    block that modifies its leaf input (``ReLU(inplace=True)`` right after a
    cut), a first block that changes the batch (its stage copies each
    microbatch, and the user's batch is left as it was), and a block that
    hands its input on as it is (an ``Identity``, a view) to one that
    modifies it, as the same input reaches that one. Runs on a copy of
    ``sample``, and puts back buffers, ``.grad`` and the RNG: the user's
    model, batch and generators are left as they were.
    """
    flags: list[bool] = []
    passes: list[bool] = []  # the block returns its input itself, or a view of it
    with preserved_state(model, [sample.device]), module_mode(model, training=True), torch.enable_grad():
        y: Value = sample.clone()
        for i, b in enumerate(blocks):
            x = leaf(y, i > 0)
            versions = [t._version for t in tensors(x)]
            said = io.StringIO()  # what torch.fx prints about a failing generated forward: kept for real failures
            try:
                with contextlib.redirect_stderr(said):
                    y = b.module(x)
                # A change autograd lets pass (the first block's input, which needs no gradient; an integer
                # tensor) shows in the version counter.
                flags.append(any(t._version != v for t, v in zip(tensors(x), versions)))
            except RuntimeError as e:
                if not mutates_input(e):
                    sys.stderr.write(said.getvalue())
                    raise
                y = b.module(map_tensors(x, torch.clone))
                flags.append(True)
            passes.append(any(t is u or t._base is u for t in tensors(y) for u in tensors(x)))
    for i in range(len(flags) - 2, -1, -1):
        flags[i] = flags[i] or (passes[i] and flags[i + 1])
    return flags


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def _check_output(model: nn.Module, ref: object) -> None:
    """Refuse a model output that cannot be compared with the chain's: not a tensor."""
    if not isinstance(ref, torch.Tensor):
        raise CutError(
            f"{type(model).__name__}.forward returns {type(ref).__name__}, not a single tensor, so it cannot be cut "
            f"into stages (a loss_fn that takes it still works on one stage)",
            "wrap the model so that its forward returns one tensor",
        )


def _where_not_finite(sample: torch.Tensor, first_bad: str | None, *, train: bool = False) -> str:
    """Where a non-finite output comes from, as the refusal names it."""
    if not _finite(sample):
        return "the batch itself holds NaN/inf"
    if first_bad is not None:
        return f"they first appear in the output of block '{first_bad}'"
    if train:
        return "the eval-mode output is finite"
    return "the blocks run one by one stay finite, so the model's forward does more than its blocks"


def _not_finite(model: nn.Module, out: torch.Tensor, where: str) -> ValueError:
    bad = int((~torch.isfinite(out)).sum())
    return ValueError(
        f"{type(model).__name__}'s output on the batch it is planned on is not finite ({bad} of {out.numel()} "
        f"values are NaN/inf in train mode; {where}), so pipedp cannot check that its blocks compute the model. "
        f"To proceed, check the data and the model's initialisation, or plan on a finite batch with "
        f"wrap(..., sample=<batch>), or use stages=1 (no pipeline cut, no check)"
    )
