"""Defaults and names the options offer and the runtime applies, kept below both.

The options validate a request against these; the runtime modules use them
as their own defaults. Neither side imports the other for them.
"""

from __future__ import annotations

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_BUCKET_BYTES", "KERNEL_MODES"]

DEFAULT_TIMEOUT_S = 600.0  # seconds a collective may wait before the ranks give up
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
KERNEL_MODES = ("auto", "torch", "tvm")  # depthwise layers: tuned where found, torch's always, tuned always
