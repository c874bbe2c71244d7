"""Runtime side of the tuned kernels: TVM-runtime loading and torch custom ops.

``import pipedp.ops`` needs neither TVM nor a GPU; loading a library needs
the TVM runtime libraries (see :mod:`pipedp.ops.runtime`).
"""

from .depthwise import depthwise_conv2d, load, use_library
from .swap import KERNEL_MODES, TunedDepthwiseConv2d, swap_depthwise

__all__ = ["depthwise_conv2d", "load", "use_library", "swap_depthwise", "TunedDepthwiseConv2d", "KERNEL_MODES"]
