"""Runtime side of the tuned kernels: TVM-runtime loading and torch custom ops.

``import pipedp.ops`` needs neither TVM nor a GPU; loading a library needs
the TVM runtime libraries (see :mod:`pipedp.ops.runtime`). What the kernel
compiler (``pipedp.kernels.tvm``) shares with training lives here too (problem
description, records, artifact checks, layouts, the thread hand-off), so the
compiler builds on the runtime and never the other way round.
"""

from .depthwise import depthwise_conv2d
from .records import KernelDbError
from .runtime import KernelChoice, KernelLibrary, load_library
from .swap import KERNEL_MODES, Swap, TunedDepthwiseConv2d, swap_depthwise

__all__ = [
    "depthwise_conv2d", "KernelChoice", "KernelLibrary", "load_library", "swap_depthwise", "TunedDepthwiseConv2d",
    "KERNEL_MODES", "Swap", "KernelDbError",
]
