"""The compiler side: depthwise-convolution kernels generated, tuned and exported with apache-tvm.

Nothing here is imported at training time; pipedp loads the exported
libraries with the TVM runtime only (``pipedp.ops``).
"""
