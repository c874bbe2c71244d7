"""A CUDA schedule run on the CPU, one thread after another: its results, its writes and its reads checked.

A GPU kernel that indexes out of bounds shows up on the GPU as a wrong
result, or as an illegal memory access that takes the whole CUDA context
(and every later kernel of the process) down. Both come from the schedule,
not from the hardware, so they can be found where there is no GPU:
:func:`emulate` takes the scheduled module of a CUDA template and rewrites
it into a CPU kernel of the same loops and index expressions:

- every loop bound to ``blockIdx``/``threadIdx``/``vthread`` becomes a
  serial loop (a thread block's stages are separate loop nests over its
  threads, with a barrier between them on the GPU: serially they run in
  the same order), over its own extent;
- shared and local buffers become ordinary buffers of their full logical
  shape (a thread's registers are the elements it indexes);
- every store to the kernel's output also counts that element's writes in
  an extra ``int32`` output (a sum kept in the output counts once, at its
  init), so an element that no thread writes, or that two threads write
  (one of them with a value it never computed), is seen even where the
  serial order happens to leave the right value behind.

:func:`check` then runs it on random operands at a batch size of its own
(the kernels take any) inside buffers guarded by NaN on both sides: a read
past a tensor's end brings NaN into the result, a write past the output's
end changes the guard. What the serial loops cannot show is found from the
schedule (:func:`thread_mismatches`): a GPU runs every loop bound to a
thread axis over the threads its kernel is launched with along that axis,
which TVM takes from the kernel's first such loop and guards no other, so
the threads past a shorter loop run its body past its extent, into the
kernel's own buffers (partial sums in global memory, shared and local
stages) where no guard would see them, or past the end of its memory. A
read far past the guard can end the process with a segfault, as it faults
on the GPU: run :func:`check` in a worker process
(:class:`pipedp.ops.worker.Worker`) where that must not end the caller.

What it cannot see: races between the threads of a block on a reduction
target or in shared memory (serially they take turns), timing, the
alignment of vector loads (its operands are aligned, as torch's
allocations are; see :mod:`pipedp.ops.layout`), and a stage's writes past
the end of a row of the kernel's own buffers into the next, where a later
block or thread writes the right values over them before they are read
(e.g. a channel tile that does not divide the channels): on the GPU such a
buffer is cut to the block's tile, and the same writes may fall past its
end. The schedule shows them, as loops whose blocks have no predicate.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import tvm

from pipedp.ops.problem import DepthwiseConv

from .space import Config

__all__ = ["COUNTS", "emulated_source", "thread_mismatches", "emulate", "compile_emulated", "Finding", "check"]

COUNTS = "writes_"  # the extra output: how often each output element was stored

_SIGNATURE = re.compile(r"def (\w+)\((.*)\):\n")
_PARAM = re.compile(r'(\w+): T\.Buffer\((\(.*?\)), "(\w+)"\)')
_THREAD = re.compile(r'T\.thread_binding\(([^,]+), thread="((?:blockIdx|threadIdx)\.[xyz])"')


def _thread_loops(lines: list[str]) -> dict[int, tuple[str, str, str]]:
    """The loops of a TVMScript's lines bound to a thread axis, by line: (axis, extent, the kernel's extent along
    the axis). A kernel is a loop nest at the root with thread bindings; TVM launches it with the extent of its
    first loop bound to each axis, whatever the extents of its later loops bound to the same axis."""
    found: dict[int, tuple[str, str, str]] = {}
    kernel_indent, launch = -1, {}
    for k, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent <= kernel_indent:
            kernel_indent = -1  # the kernel's nest ended
        if kernel_indent < 0 and "T.thread_binding(" in line:
            kernel_indent, launch = indent, {}
        bound = _THREAD.search(line)
        if bound:
            extent, axis = bound.groups()
            found[k] = (axis, extent, launch.setdefault(axis, extent))
    return found


def thread_mismatches(script: str) -> list[str]:
    """The loops of a scheduled CUDA module's TVMScript bound to a thread axis at other than its kernel's extent
    along it: TVM guards none of them, so the threads past a shorter loop's extent run its body past its domain
    (indices past its buffers' ends, or into their next row), and a longer loop's iterations past the kernel's
    extent never run."""
    out = []
    for k, (axis, extent, launch) in sorted(_thread_loops(script.splitlines()).items()):
        if extent != launch:
            if not (extent.isdigit() and launch.isdigit()):
                what = "the extents may differ"
            elif int(extent) < int(launch):
                what = f"its {axis} {extent}..{int(launch) - 1} run its body past its extent"
            else:
                what = f"its iterations {launch}..{int(extent) - 1} never run"
            out.append(f"line {k + 1}: a loop over {extent} {axis} in a kernel launched with {launch}: {what}")
    return out


def emulated_source(script: str) -> str:
    """The TVMScript of a scheduled CUDA module rewritten to run serially on a CPU (see the module docstring),
    with a last parameter :data:`COUNTS` (the output's shape, ``int32``) counting the output's stores."""
    sig = _SIGNATURE.search(script)
    if sig is None:
        raise ValueError("no prim func in the script")
    params = sig.group(2)
    out, shape, _ = _PARAM.findall(params)[-1]
    text = script.replace(sig.group(0), f'def {sig.group(1)}({params}, {COUNTS}: T.Buffer({shape}, "int32")):\n')
    text = re.sub(r'T\.thread_binding\(([^,]+), thread="[^"]+"', r"T.serial(\1", text)
    text = re.sub(r', scope="(shared|local)"', "", text)
    lines = []
    for line in text.splitlines():
        if re.match(r"\s*T\.(reads|writes)\(", line):  # (the parser infers them again, the counts included)
            continue
        lines.append(line)
        store = re.match(rf"(\s*){out}\[(.*?)\] = (.*)$", line)
        if store:
            pad, index, value = store.groups()
            if value.startswith(f"{out}[{index}] "):  # a reduction's update in place: its init was counted
                continue
            lines.append(f"{pad}{COUNTS}[{index}] = {COUNTS}[{index}] + 1")
    return "\n".join(lines) + "\n"


def _scheduled(conv: DepthwiseConv, op: str, config: Config, arch: str = "sm_90") -> tvm.IRModule:
    from .builder import schedule
    from .target import make_target

    return schedule(conv, op, config, make_target("cuda", arch)).mod


def emulate(conv: DepthwiseConv, op: str, config: Config, arch: str = "sm_90") -> tuple[Any, str]:
    """``config``'s CUDA kernel of ``op`` on ``conv`` (any batch size), compiled to run serially on this CPU:
    the module and its function's name. Called as the kernel is, with the write counts after its output."""
    mod = _scheduled(conv, op, config, arch)
    return compile_emulated(mod), _symbol(mod)


def compile_emulated(mod: tvm.IRModule) -> Any:
    """A scheduled CUDA module (one prim func) compiled to run serially on this CPU (see :func:`emulate`)."""
    return tvm.compile(tvm.script.from_source(emulated_source(mod.script())), target="llvm")


def _symbol(mod: tvm.IRModule) -> str:
    (func,) = mod.get_global_vars()
    return func.name_hint


@dataclass(frozen=True)
class Finding:
    """What one emulated call did: the largest error against torch (NaN where a read left the tensors), how many
    output elements were stored other than once, whether the output's guards still hold, and the tolerance; and
    the schedule's loops bound to a thread axis at other than their kernel's extent (:func:`thread_mismatches`)."""

    n: int
    error: float
    tolerance: float
    miswritten: int
    guards_intact: bool
    thread_mismatches: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return (self.error <= self.tolerance and self.miswritten == 0 and self.guards_intact
                and not self.thread_mismatches)

    def __str__(self) -> str:
        return (f"n={self.n}: error {self.error:.3g} (tolerance {self.tolerance:.3g}), {self.miswritten} output "
                f"element(s) not stored exactly once, guards {'intact' if self.guards_intact else 'OVERWRITTEN'}"
                + "".join(f"\n  {m}" for m in self.thread_mismatches))


def _guarded(t: Any, layout: str) -> tuple[Any, int, Any]:
    """A copy of NCHW-shaped ``t`` in ``layout``'s memory order inside a buffer with NaN on both sides."""
    import torch

    guard = max(t.numel(), 4096)
    buf = torch.full((t.numel() + 2 * guard,), float("nan"), dtype=t.dtype)
    inner = buf[guard:guard + t.numel()]
    if layout == "NHWC" and t.dim() == 4:
        n, c, h, w = t.shape
        view = inner.view(n, h, w, c).permute(0, 3, 1, 2)
    else:
        view = inner.view(t.shape)
    view.copy_(t)
    return buf, guard, view


def check(conv: DepthwiseConv, op: str, config: Config, batches: tuple[int, ...] = (1, 3),
          scheduled: tvm.IRModule | None = None) -> list[Finding]:
    """:func:`emulate` ``config`` and run it at each of ``batches`` against torch (see the module docstring);
    ``scheduled``: a scheduled module of ``op`` on ``conv`` to check in place of ``config``'s."""
    import torch

    from pipedp.ops import harness
    from pipedp.ops.layout import arrange

    from .template import layout_of

    mod = scheduled if scheduled is not None else _scheduled(conv, op, config)
    module, symbol, mismatched = compile_emulated(mod), _symbol(mod), tuple(thread_mismatches(mod.script()))
    layout = layout_of(config)
    acts = {"fwd": (True, False, True), "dgrad": (True, False, True), "wgrad": (True, True, False)}[op]
    found = []
    for n in batches:
        problem = dataclasses.replace(conv, n=n)
        inputs, ref = harness.reference(problem, op, torch.device("cpu"), seed=n)
        ins = [_guarded(t, layout if act else "NCHW")[2] for t, act in zip(inputs, acts)]
        out_layout = layout if acts[2] else "NCHW"
        buf, guard, out = _guarded(torch.full(ref.shape, float("nan"), dtype=ref.dtype), out_layout)
        counts = torch.zeros(arrange(out, out_layout).shape, dtype=torch.int32)
        module[symbol](*(arrange(t, layout if act else "NCHW") for t, act in zip(ins, acts)),
                       arrange(out, out_layout), counts)
        error = (out.float() - ref.float()).abs().max().item()
        tolerance = harness.tolerance(problem, op) * max(1.0, ref.float().abs().max().item())
        intact = bool(torch.isnan(buf[:guard]).all() and torch.isnan(buf[guard + out.numel():]).all())
        found.append(Finding(n, error, tolerance, int((counts != 1).sum()), intact, mismatched))
    return found
