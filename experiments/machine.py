"""A one-line description of the machine, for every figure we print or save."""

from __future__ import annotations

import os
import platform

import torch

from pipedp.ops.artifact import cpu_name

__all__ = ["describe", "sync"]


def describe(device: torch.device | str = "cpu") -> dict[str, object]:
    device = torch.device(device)
    out: dict[str, object] = {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
