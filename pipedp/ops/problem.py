"""One depthwise-convolution problem: shapes and conv parameters, without importing TVM.

The tuner and the runtime both name kernels by this value (its ``key()`` is
what the records store), and the runtime side must not need the compiler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..checks import positive_int

__all__ = ["DepthwiseConv", "OPS"]

OPS = ("fwd", "dgrad", "wgrad")


def _pair(v: Any, name: str, minimum: int) -> tuple[int, int]:
    t = (v, v) if isinstance(v, int) else tuple(v)
    if len(t) != 2 or not all(isinstance(a, int) and not isinstance(a, bool) and a >= minimum for a in t):
        raise ValueError(f"{name} must be an int or a pair of ints >= {minimum}, got {v!r}")
    return t  # type: ignore[return-value]


@dataclass(frozen=True)
class DepthwiseConv:
    """One depthwise convolution problem: input shape and conv parameters."""

    n: int
    c: int
    h: int
    w: int
    multiplier: int = 1
    kernel: tuple[int, int] = (3, 3)
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("n", "c", "h", "w", "multiplier"):
            positive_int(name, getattr(self, name))
        object.__setattr__(self, "kernel", _pair(self.kernel, "kernel", 1))
        object.__setattr__(self, "stride", _pair(self.stride, "stride", 1))
        object.__setattr__(self, "padding", _pair(self.padding, "padding", 0))
        object.__setattr__(self, "dilation", _pair(self.dilation, "dilation", 1))
        if max(self.kernel) > 7:
            raise ValueError(f"kernel {self.kernel}: depthwise kernels of 1..7 are supported")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype {self.dtype!r}: use float32 (float16/bfloat16 on CUDA)")
        oh, ow = self.out_hw
        if oh < 1 or ow < 1:
            raise ValueError(f"{self}: the output would be empty ({oh}x{ow}); check kernel, padding and dilation")

    @property
    def out_channels(self) -> int:
        return self.c * self.multiplier

    @property
    def out_hw(self) -> tuple[int, int]:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel, self.stride, self.padding, self.dilation
        return (self.h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (self.w + 2 * pw - dw * (kw - 1) - 1) // sw + 1

    def shapes(self) -> dict[str, tuple[int, ...]]:
        oh, ow = self.out_hw
        return {
            "x": (self.n, self.c, self.h, self.w),
            "w": (self.out_channels, 1, *self.kernel),
            "y": (self.n, self.out_channels, oh, ow),
        }

    def key(self) -> dict[str, Any]:
        """The record key (JSON-friendly)."""
        d = asdict(self)
        for k in ("kernel", "stride", "padding", "dilation"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_key(cls, d: dict[str, Any]) -> "DepthwiseConv":
        d = dict(d)
        for k in ("kernel", "stride", "padding", "dilation"):
            d[k] = tuple(d[k])
        return cls(**d)

    def flops(self) -> int:
        """Multiply-adds x 2 of the forward (the gradients cost the same)."""
        oh, ow = self.out_hw
        return 2 * self.n * self.out_channels * oh * ow * self.kernel[0] * self.kernel[1]

    @property
    def itemsize(self) -> int:
        return {"float32": 4}.get(self.dtype, 2)

    def min_bytes(self, op: str) -> int:
        """Bytes each operator must at least read and write once (the bandwidth bound)."""
        elems = {k: _prod(v) for k, v in self.shapes().items()}
        return self.itemsize * sum(elems[k] for k in _MOVED[op])

    def output_bytes(self, op: str) -> int:
        """Bytes of what ``op`` writes (y, dx or dw)."""
        return self.itemsize * _prod(self.shapes()[_MOVED[op][-1]])


_MOVED = {"fwd": ("x", "w", "y"), "dgrad": ("y", "w", "x"), "wgrad": ("y", "x", "w")}  # inputs..., output


def _prod(t: tuple[int, ...]) -> int:
    out = 1
    for v in t:
        out *= v
    return out
