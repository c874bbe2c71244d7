"""What the CUDA templates of both layouts share: the GPU's limits, constraint checks, and schedule steps.

Constraints are checked before anything compiles (:meth:`~.template.Template.validate`), so a config that
cannot compile, or would compile to a kernel that spills, costs microseconds:

- threads per block within 32..1024 and threadIdx.z within 64 (CUDA's limits; fewer than a warp idles lanes);
- shared memory within the 48 KiB a block gets without opting in to more: estimated from the tile before
  scheduling, and counted once more after it as TVM will allocate it (:func:`allocated_shared`, a fraction of
  a second), since TVM may stage more than the tile;
- registers: the fp32 accumulators a thread holds (outputs, or grad-weight's taps x channels) within
  :data:`MAX_ACCUMULATORS`, and within the 64K registers of an SM for the whole block. TVM emits
  ``__launch_bounds__(threads)``, so nvcc never fails such a kernel at launch: it spills the accumulators to
  local memory instead, which is slower than any config that fits, so those configs are never worth a compile.

Schedule steps shared by the templates: staging a block's tile in shared memory with every thread of the block
(:func:`cooperative_fetch`, vectorised along contiguous channels where asked), and writing a thread's fp32
accumulators back (:func:`write_back`: a plain copy for fp32 problems, the rounding to fp16/bf16 for others,
see :func:`.ops.rounded`), and small elementwise stages as kernels of their own (:func:`own_kernel`).

Threads of one kernel share one extent per thread axis: a loop bound to ``threadIdx.x`` with fewer
iterations than the block has threads must be split by the block's width (its predicate idles the rest),
and what it writes must be written inside that predicate: TVM adds no guard of its own. (TVM launches a
kernel with the extent of its first loop bound to each axis. A stage moved below a block's loop gets loops
as long as the data it covers there, shorter than the block's threads where one tile is wider than the
data: NHWC grad-weight with ``tc`` > c faulted so on an H200, 2026-11-28. ``kernels.tvm.emulate``'s
``thread_mismatches`` lists such loops.)

Two more rules of the same kind, each learnt from a kernel that was wrong or faulted on an H100
(2026-11-25; ``kernels.tvm.emulate`` finds both on a CPU):

- A stage computed at a loop (``reverse_compute_at``, ``compute_at``) is guarded by the bounds of the
  buffer it writes, not by the predicates of the loops above it: put it below a loop *before* that loop
  is split by a factor that does not divide it (the split then guards everything below it), or bind the
  loop so that running past its end runs past the buffer's end too. A fused loop whose tail runs into the
  next tile's (valid) coordinates is guarded by nothing.
- ``compute_at`` rebuilds the moved block's loops from its iteration domain and drops its predicate: never
  move a block whose predicate keeps it inside its data (a reduction split by a factor that does not
  divide it, e.g. one over a symbolic batch). Leave it at its loops and move its consumer below it
  (``reverse_compute_at``).
"""

from __future__ import annotations

import math
import re

import tvm
from tvm import s_tir

from pipedp.ops.problem import DepthwiseConv

from .space import InvalidConfig

__all__ = ["MAX_THREADS", "MAX_THREADS_Z", "MAX_SHARED", "MAX_ACCUMULATORS", "REGISTERS_PER_SM", "SPLITS",
           "check_threads", "check_shared", "allocated_shared", "check_accumulators", "check_splits", "vector_widths",
           "cooperative_fetch", "own_loops", "write_back", "own_kernel", "sum_splits", "bind_flat"]

MAX_THREADS = 1024  # threads per block on every CUDA GPU
MAX_THREADS_Z = 64  # threadIdx.z extent
MAX_SHARED = 48 * 1024  # shared memory per block without opting in to more
MAX_ACCUMULATORS = 128  # fp32 accumulators a thread keeps in registers (of 255) beside its indices and loads
REGISTERS_PER_SM = 64 * 1024  # 32-bit registers of one SM (and at most of one block) on every GPU since sm_50
SPLITS = (1, 2, 4, 8, 16, 32)  # grad-weight's reduction split over blocks (1: one stage, as before the knob)


def check_threads(threads: int, z: int = 1) -> None:
    """At least a warp, at most a block's threads, threadIdx.z within its limit."""
    if threads > MAX_THREADS or threads < 32:
        raise InvalidConfig(f"{threads} threads per block: use 32..{MAX_THREADS}")
    if z > MAX_THREADS_Z:
        raise InvalidConfig(f"{z} threads along threadIdx.z: at most {MAX_THREADS_Z}")


def check_shared(nbytes: int) -> None:
    """A block's shared memory within what it gets without opting in."""
    if nbytes > MAX_SHARED:
        raise InvalidConfig(f"{nbytes} bytes of shared memory per block: at most {MAX_SHARED}")


def check_accumulators(per_thread: int, threads: int) -> None:
    """Accumulators that fit a thread's registers, and the block's registers within an SM's (else nvcc spills)."""
    if per_thread > MAX_ACCUMULATORS:
        raise InvalidConfig(f"{per_thread} fp32 accumulators per thread: at most {MAX_ACCUMULATORS} fit the "
                            f"registers (the rest would spill to local memory)")
    regs = threads * (per_thread + 24)  # (+ indices, addresses, loaded operands)
    if regs > REGISTERS_PER_SM:
        raise InvalidConfig(f"{threads} threads x {per_thread} accumulators need about {regs} registers per block: "
                            f"at most {REGISTERS_PER_SM}")


def check_splits(conv: DepthwiseConv, splits: int, threads: int) -> None:
    """A split of grad-weight's (n, h, w) sum over blocks that leaves each block's threads at least a few terms."""
    oh, ow = conv.out_hw
    per_thread = conv.n * oh * ow / (splits * threads)
    if splits > 1 and per_thread < 4:
        raise InvalidConfig(f"splits={splits} x {threads} threads leave {per_thread:.1f} terms of the "
                            f"{conv.n}x{oh}x{ow} sum per thread: use fewer splits or threads")


_SHARED_ALLOC = re.compile(r'T\.(?:sblock_)?alloc_buffer\(\(([^)]*)\),(?: "(\w+)",)? scope="shared"')


def allocated_shared(mod: tvm.IRModule) -> int:
    """Bytes of shared memory a scheduled module allocates, as TVM sizes its buffers when it lowers it.

    TVM sizes a block's shared tile by the region its threads touch, which
    with a split that does not divide its loop (or a fused block index) can
    be the whole axis rather than the tile: an estimate from the tile sizes
    alone can be short by half, and nvcc then refuses the kernel. The
    passes that size the buffers run in a fraction of a second, against an
    nvcc run of seconds that would fail.
    """
    passes = tvm.transform.Sequential([
        s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation()])
    total = 0
    for dims, dtype in _SHARED_ALLOC.findall(passes(mod).script()):
        try:
            elems = math.prod(int(d) for d in dims.split(",") if d.strip())
        except ValueError:  # a symbolic extent (the batch): unbounded
            raise InvalidConfig(f"a shared-memory buffer of extent ({dims}) depends on the batch size") from None
        total += elems * tvm.DataType(dtype or "float32").bits // 8
    return total


def vector_widths(channels: int, dtype: str) -> tuple[int, ...]:
    """Channels per vector load: up to 16 bytes (float4, 8 halves), dividing the channels (1 when none does)."""
    lanes = 16 // (4 if dtype == "float32" else 2)
    return tuple(v for v in (1, 2, 4, 8) if v <= lanes and channels % v == 0)


def own_loops(sch: s_tir.Schedule, block: s_tir.SBlockRV, at: s_tir.LoopRV) -> int:
    """How many of ``block``'s loops lie below ``at``."""
    loops = sch.get_loops(block)
    for k, lp in enumerate(loops):
        if sch.get(lp).same_as(sch.get(at)):
            return len(loops) - k - 1
    raise ValueError("loop not found")


def bind_flat(sch: s_tir.Schedule, loop: s_tir.LoopRV, threads: list[tuple[int, str]]) -> None:
    """Split ``loop`` over the block's threads (outermost first, ``(extent, "threadIdx.z")``...) and bind them."""
    extents = [e for e, _ in threads]
    parts = sch.split(loop, [None, *extents])
    for part, (_, tag) in zip(parts[1:], threads, strict=True):
        sch.bind(part, tag)


def cooperative_fetch(sch: s_tir.Schedule, block: s_tir.SBlockRV, at: s_tir.LoopRV, threads: list[tuple[int, str]],
                      vec: int = 1) -> None:
    """Compute ``block`` (a shared-memory stage) per thread block at ``at``, its elements spread over all the
    block's threads; with ``vec`` > 1 each thread moves ``vec`` contiguous elements (its innermost axis, whose
    extent ``vec`` divides) with one vector load and store."""
    sch.compute_at(block, at)
    loops = sch.get_loops(block)
    inner = loops[len(loops) - own_loops(sch, block, at):]
    lanes = None
    if vec > 1:
        inner[-1], lanes = sch.split(inner[-1], [None, vec])
    bind_flat(sch, sch.fuse(*inner), threads)
    if lanes is not None:
        sch.vectorize(lanes)


def write_back(sch: s_tir.Schedule, out: s_tir.SBlockRV, cast: s_tir.SBlockRV | None, at: s_tir.LoopRV) -> None:
    """Accumulate ``out`` in registers and write it once per thread at ``at`` (rounded, when ``cast`` is the
    fp16/bf16 stage after the fp32 sum)."""
    if cast is None:
        sch.reverse_compute_at(sch.cache_write(out, 0, "local"), at)
    else:
        sch.set_scope(out, 0, "local")
        sch.reverse_compute_at(cast, at)


def sum_splits(sch: s_tir.Schedule, out: s_tir.SBlockRV, threads: int = 64) -> None:
    """Grad-weight's second kernel: ``out``'s sum over the splits' partial sums (its last loop), one output per
    thread, ``threads`` per block, kept in a register and written once. The write goes below the outputs' loop
    before that loop is split by the threads, so the split's predicate guards it: computed at the split's thread
    loop, with fewer outputs than a block has threads (kh*kw*c < 64, as for 3x3 and up to 7 channels) it had
    none, and its threads wrote past the outputs' end."""
    outputs = sch.fuse(*sch.get_loops(out)[:-1])
    write_back(sch, out, None, outputs)
    bind_flat(sch, outputs, [(threads, "threadIdx.x")])
    sch.bind(sch.get_loops(out)[0], "blockIdx.x")


def own_kernel(sch: s_tir.Schedule, block: s_tir.SBlockRV, threads: int = 64) -> None:
    """``block`` (an elementwise stage, e.g. grad-weight's rounding) as a small kernel of its own: its loops
    fused, ``threads`` per block."""
    bind_flat(sch, sch.fuse(*sch.get_loops(block)), [(threads, "threadIdx.x")])
    sch.bind(sch.get_loops(block)[0], "blockIdx.x")


def log2(v: float) -> float:
    """log2 of a positive count (features; 0 for anything below 1)."""
    return math.log2(max(v, 1.0))
