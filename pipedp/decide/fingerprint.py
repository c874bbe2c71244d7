"""What a plan was made for, in five sections: the model, the input, the request, the machine, the versions.

A saved plan is reused only where it still answers the same question. Each
section is a digest of plain values, so a mismatch can be named ("the
model differs"), and the whole key names a plan-cache entry. The model is
described by what decides its cut and its times: every module's class, its
constructor arguments as ``repr`` shows them, its mode, its forward's code,
and every parameter's and buffer's name, shape, dtype and ``requires_grad``
(not their values: training changes those, the plan stays right).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

__all__ = ["Fingerprint", "fingerprint", "SECTIONS"]

SECTIONS = ("model", "input", "request", "machine", "versions")


@dataclass(frozen=True)
class Fingerprint:
    """One digest per section (hex, 16 characters each) and a one-line description of the machine."""

    sections: Mapping[str, str]
    machine: str

    @property
    def key(self) -> str:
        """The plan-cache key: one digest over all sections."""
        return _digest([self.sections[s] for s in SECTIONS])

    def differing(self, other: Mapping[str, str]) -> list[str]:
        """The sections whose digests differ from ``other``'s (a saved plan's), in :data:`SECTIONS` order."""
        return [s for s in SECTIONS if other.get(s) != self.sections[s]]


def _digest(value: object) -> str:
    text = json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _code(cls: type) -> list[object]:
    """A module class's forward as the interpreter runs it: bytecode, constants and names (no source files)."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is None:
        return [cls.__module__, cls.__qualname__]
    return [code.co_code.hex(), repr(code.co_consts), list(code.co_names)]


def _model(model: nn.Module) -> list[object]:
    modules = [[name, f"{type(m).__module__}.{type(m).__qualname__}", m.extra_repr(), m.training]
               for name, m in model.named_modules()]
    forwards = {f"{type(m).__module__}.{type(m).__qualname__}": _code(type(m)) for m in model.modules()}
    tensors = [[name, list(t.shape), str(t.dtype), bool(getattr(t, "requires_grad", False))]
               for name, t in (*model.named_parameters(), *model.named_buffers())]
    return [modules, forwards, tensors]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(devices: Sequence[torch.device]) -> str:
    """The hardware the plan was timed on, as one line."""
    names = []
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            names.append(f"{d}: {torch.cuda.get_device_name(d)}")
        else:
            names.append(f"{d}: {_cpu_name()}, {torch.get_num_threads()} threads")
    return "; ".join(names)


def fingerprint(model: nn.Module, batch: torch.Tensor, devices: Sequence[torch.device],
                request: Mapping[str, object]) -> Fingerprint:
    """The fingerprint of planning ``model`` on ``batch`` over ``devices`` for ``request``.

    ``request``: every setting that shapes the decision (the shared option
    fields, the world's layout, the kernels on offer), as plain values.
    """
    from .. import __version__  # the package imports this module's users: read at call time

    machine = _machine(devices)
    sections = {
        "model": _digest(_model(model)),
        "input": _digest([list(batch.shape), str(batch.dtype)]),
        "request": _digest(dict(request)),
        "machine": _digest([platform.machine(), machine]),
        "versions": _digest([torch.__version__, __version__, sys.version_info[:2]]),
    }
    return Fingerprint(sections, machine)
