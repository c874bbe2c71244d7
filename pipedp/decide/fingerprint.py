"""What a plan was made for, in five sections: the model, the input, the request, the machine, the versions.

A saved plan is reused only where it still answers the same question. Each
section is a digest of plain values, so a mismatch can be named ("the
model differs"), and the whole key names a plan-cache entry. The model is
described by what decides its cut and its times: every module's class, its
constructor arguments as ``repr`` shows them, its mode, its forward's code
(with the methods of its class that the forward calls by name),
and every parameter's and buffer's name, shape, dtype and ``requires_grad``
(not their values: training changes those, the plan stays right).

A key must be the same in the next process, or the cache never hits and
grows an entry per run. So code is described by its own bytecode, constants
and names, recursively (a comprehension, a nested function or a lambda is a
code object among the constants, whose ``repr`` is an address), functions by
their code, defaults and closures, sets in sorted order (their ``repr``
follows the hash seed), and no ``repr`` that shows an address (``at 0x...``)
reaches a digest with it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import re
import sys
import types
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

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
    text = json.dumps(value, sort_keys=True, default=_plain, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _unaddressed(text: str) -> str:
    """``text`` without the addresses a default ``repr`` shows: they differ in every process."""
    return _ADDRESS.sub("", text)


def _plain(value: object, seen: frozenset[int] = frozenset()) -> object:
    """``value`` as plain JSON data that is the same in every process: no addresses, no hash-seed order.

    ``seen``: the functions and code objects being described further up (a
    nested function that refers to itself is named, not described again).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v, seen) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_plain(v, seen) for v in value]
        return ["set", sorted(items, key=lambda v: json.dumps(v, sort_keys=True))]
    if isinstance(value, dict):
        return {str(k): _plain(v, seen) for k, v in value.items()}
    if isinstance(value, (types.CodeType, types.FunctionType)):
        if id(value) in seen:
            return ["recursive", value.co_name if isinstance(value, types.CodeType) else value.__qualname__]
        seen = seen | {id(value)}
        if isinstance(value, types.CodeType):
            return ["code", value.co_name, value.co_code.hex(), _plain(value.co_consts, seen), list(value.co_names)]
        return ["function", value.__qualname__, _plain(value.__code__, seen), _plain(value.__defaults__, seen),
                _plain(value.__kwdefaults__, seen), [_plain(c, seen) for c in _cells(value)]]
    if isinstance(value, functools.partial):
        return ["partial", _plain(value.func, seen), _plain(value.args, seen), _plain(value.keywords, seen)]
    if isinstance(value, types.MethodType):
        return ["method", _plain(value.__func__, seen)]  # not its object: the module it is bound to, say
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (types.BuiltinFunctionType, types.ModuleType)):
        return f"{getattr(value, '__module__', None) or ''}.{value.__name__}"
    if isinstance(value, nn.Module):  # its structure is described with the model's modules
        return ["module", f"{type(value).__module__}.{type(value).__qualname__}"]
    if isinstance(value, torch.Tensor):  # as parameters are: not the values
        return ["tensor", list(value.shape), str(value.dtype)]
    return _unaddressed(repr(value))


def _cells(fn: types.FunctionType) -> Iterator[object]:
    """What ``fn``'s closure holds (an empty cell, a name bound later, is skipped)."""
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:
            continue


def _names(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names ``code`` and the code nested in it read."""
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _names(c)


def _methods(cls: type, name: str) -> Iterator[tuple[str, types.FunctionType]]:
    """Every definition of method ``name`` along ``cls``'s MRO (``super()`` calls reach the later ones).

    Not ``nn.Module``'s or ``object``'s own: the machinery every module shares.
    """
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            return
        attr = klass.__dict__.get(name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        elif isinstance(attr, property):
            attr = attr.fget
        if isinstance(attr, types.FunctionType):
            yield f"{klass.__qualname__}.{name}", attr


def _code(cls: type) -> object:
    """A module class's forward as the interpreter runs it, and the methods of its class it calls by name.

    Bytecode, constants, names, defaults and closures (no source files, no
    addresses), so editing a helper such as torchvision's ``_forward_impl``
    makes another key as editing ``forward`` does.
    """
    if not isinstance(getattr(cls, "forward", None), types.FunctionType):
        return [cls.__module__, cls.__qualname__]
    described: dict[str, object] = {}
    todo = ["forward"]
    while todo:
        name = todo.pop()
        for key, fn in _methods(cls, name):
            if key not in described:
                described[key] = _plain(fn)
                todo.extend(n for n in _names(fn.__code__) if n != name)
    return described


def _model(model: nn.Module) -> list[object]:
    modules = [[name, f"{type(m).__module__}.{type(m).__qualname__}", _unaddressed(m.extra_repr()), m.training]
               for name, m in model.named_modules()]
    classes = dict.fromkeys(type(m) for m in model.modules())  # each class once: a ResNet has few
    forwards = {f"{c.__module__}.{c.__qualname__}": _code(c) for c in classes}
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
