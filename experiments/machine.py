"""A one-line description of the machine, for every figure we print or save."""

from __future__ import annotations

import os
import platform

import torch

from pipedp.ops.artifact import cpu_name

__all__ = ["describe", "cpu_features", "sync"]

# The vector and matrix instruction sets that decide a CPU's speed in fp32 and bf16 (a model name such as
# "AMD EPYC" names several generations: with and without AVX-512 BF16).
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Which of FEATURES this CPU has (from ``cpuinfo``'s first flags line; empty where there is none)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [name for name in FEATURES if name in have]
    except OSError:
        pass
    return []


def describe(device: torch.device | str = "cpu") -> dict[str, object]:
    device = torch.device(device)
    out: dict[str, object] = {
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    # What torch's kernels may use (an AVX-512 machine run as an AVX2 one sets both): part of the machine.
    capped = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)}
    if capped:
        out["isa_capped"] = capped
        out["aten_capability"] = torch.backends.cpu.get_cpu_capability()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
