"""Compilation targets and the names records and exports give them.

A CPU target names this host's CPU explicitly, so LLVM uses every vector
unit it has (``"mcpu": "native"`` silently means generic x86 in TVM); a
CUDA target names its arch, since kernels may be compiled on a machine
without the GPU. :func:`target_key` is how records, exports and the
runtime's loader agree on a target, so it must not change for a target
that already has records.
"""

from __future__ import annotations

import tvm

__all__ = ["Target", "make_target", "target_key"]

Target = tvm.target.Target


def make_target(kind: str, arch: str | None = None) -> Target:
    """``cpu`` (this host's CPU, all its vector units) or ``cuda`` (``arch`` like ``sm_90``)."""
    if kind == "cpu":
        return Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    if kind == "cuda":
        if not arch:
            raise ValueError("a CUDA target needs an arch, e.g. --arch sm_90 (or run where torch sees the GPU)")
        return Target({"kind": "cuda", "arch": arch})
    raise ValueError(f"target {kind!r}: use 'cpu' or 'cuda'")


def target_key(target: Target) -> str:
    """How records and exports name a target: ``cpu:znver4``, ``cuda:sm_90``."""
    if target.kind.name == "cuda":
        return f"cuda:{target.attrs['arch']}"
    return f"cpu:{target.attrs.get('mcpu', 'generic')}"
