"""Turning what a user passes as a device into a checked ``torch.device``."""

from __future__ import annotations

import os
from typing import Any, Sequence, Union

import torch
from torch import nn

__all__ = ["parse_device", "resolve_devices", "canonical_device", "sync_devices", "available_cores", "DeviceSpec"]

DeviceSpec = Union[None, str, int, torch.device, Sequence[Union[str, int, torch.device]]]


def canonical_device(d: Any) -> torch.device:
    """``d`` as a tensor's ``.device`` reads it: ``cuda`` gets the current CUDA device's index.

    ``torch.device("cuda") != torch.device("cuda", 0)``, while every CUDA tensor
    reports its index, so devices compared with tensors' devices, or used as
    keys, must carry it. Without CUDA (tests of the logic on a CPU) ``cuda``
    means ``cuda:0``, the device CUDA would make current.
    """
    dev = torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return dev


def parse_device(d: Any, what: str = "devices") -> torch.device:
    """``d`` as a device that exists here (``cuda`` gets its index); a clear error otherwise."""
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what}: {d!r} is not a device ({e}); use e.g. 'cpu', 'cuda', 'cuda:1'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{what} asks for {dev} but CUDA is not available here: use 'cpu', or install a CUDA build of torch"
            )
        n = torch.cuda.device_count()
        idx = torch.cuda.current_device() if dev.index is None else dev.index
        if idx >= n:
            raise ValueError(f"{what} asks for {dev} but this machine has {n} CUDA device(s): cuda:0..cuda:{n - 1}")
        return torch.device("cuda", idx)
    if dev.type != "cpu":
        raise ValueError(f"{what}: {dev} is not supported; pipedp runs on 'cpu' and 'cuda' devices")
    return dev


def resolve_devices(model: nn.Module, devices: DeviceSpec) -> list[torch.device]:
    """The devices to run on (default: the model's), checked: they must exist on this machine."""
    if devices is None:
        p = next(model.parameters(), None)
        items: list[Any] = [p.device if p is not None else torch.device("cpu")]
    elif isinstance(devices, (str, int, torch.device)):
        items = [devices]
    else:
        items = list(devices)
    if not items:
        raise ValueError("devices is empty: pass None (the model's device), a device, or a list of devices")
    out = [parse_device(d) for d in items]
    if len(set(out)) != len(out):
        raise ValueError(
            f"devices {[str(d) for d in out]} lists a device twice; list each device once "
            f"(several stages share a device on their own when stages > len(devices))"
        )
    return out


def sync_devices(devices: Sequence[torch.device]) -> None:
    """Wait for every CUDA device in ``devices`` (a no-op on CPUs)."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))
