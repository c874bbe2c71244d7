"""The plain attributes a cut baked in: what the traced forwards read, and a check that they still hold.

A block cut from a traced forward does not run that forward: ``torch.fx``
ran it once on proxies and recorded its tensor operations, so a Python value
the forward read from ``self`` (``logits / self.temp``, timm's
``F.dropout(x, p=self.drop_rate)``) is a constant of the graph. A script that
changes it between steps (a temperature or drop-rate schedule) would train
with the value of wrap time, silently. Modules that run their own forward
at every step (leaves kept whole, the blocks of a Sequential or a ResNet)
read their attributes live; only the forwards a cut replaces are read here:
the model's own and those of the submodules fx traced through.

What a forward reads is taken from its code (the attribute names its
functions load, nested ones included) and the module's instance attributes
of plain value (numbers, strings, None, tuples and lists of them). The
engine compares them at every step boundary and refuses a change by name
(:meth:`BakedReads.check`): the fix is a buffer, which the graph reads live,
or the uncut model.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from types import CodeType
from typing import Sequence

from torch import nn

from .blocks import Block

__all__ = ["BakedRead", "BakedReads", "baked_reads"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_MODULE_STATE = frozenset(nn.Module().__dict__)  # training, _parameters, _modules, the hook dicts ...
_NOT_RUN = frozenset({"__init__", "__repr__", "extra_repr", "__getstate__", "__setstate__"})  # not per step


def _plain(value: object) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list, frozenset)):
        return all(_plain(v) for v in value)
    return False


def _names(code: CodeType) -> set[str]:
    """The names ``code`` loads as attributes or globals, and those of the functions nested in it."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            out |= _names(const)
    return out


def _read_names(cls: type) -> set[str]:
    """Every name the methods of ``cls`` (and its bases above nn.Module) load: a forward may call a helper."""
    out: set[str] = set()
    for base in cls.__mro__:
        if base is nn.Module or base is object or base.__module__.startswith("torch.nn."):
            break
        for key, value in base.__dict__.items():
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if inspect.isfunction(fn) and key not in _NOT_RUN:
                out |= _names(fn.__code__)
    return out


@dataclass(frozen=True)
class BakedRead:
    """One attribute a traced forward read: the module's qualified name, the attribute, its value at the cut."""

    module: str
    attribute: str
    value: object

    @property
    def where(self) -> str:
        return f"{self.module}.{self.attribute}" if self.module else self.attribute


@dataclass(frozen=True)
class BakedReads:
    """The attributes a cut baked in, with the module objects to read them from again at each step."""

    reads: tuple[BakedRead, ...]
    owners: tuple[nn.Module, ...]  # the module each read is of, in the same order
    model: str  # the model's class name, for messages

    def __bool__(self) -> bool:
        return bool(self.reads)

    def check(self) -> None:
        """``ValueError`` naming the first attribute that no longer has its value of wrap time (nothing changed)."""
        for read, owner in zip(self.reads, self.owners):
            now = owner.__dict__.get(read.attribute, _GONE)
            if now is _GONE or type(now) is not type(read.value) or now != read.value:
                was, shown = read.value, "removed" if now is _GONE else repr(now)
                raise ValueError(
                    f"{read.where} changed from {was!r} to {shown} after wrap(): the pipeline's blocks were traced "
                    f"from {self.model}'s forward, which torch.fx runs once, so the blocks keep computing with "
                    f"{read.attribute}={was!r}. To change it during training, keep it in a buffer the forward reads "
                    f"(self.register_buffer('{read.attribute}', torch.tensor({was!r})), then "
                    f"self.{read.attribute}.fill_(value)), or train uncut (stages=1); nothing was changed")


_GONE = object()


def baked_reads(model: nn.Module, blocks: Sequence[Block]) -> BakedReads:
    """The plain attributes read by the forwards that ``blocks`` replace (those of modules no block runs itself).

    A module some block holds (a leaf kept whole, a Sequential's entry, a
    ResNet's residual block, and everything inside them) runs its own forward
    and reads live; the others' forwards were traced, or are not run at all.
    """
    live = {id(m) for b in blocks for m in b.module.modules()}
    reads: list[BakedRead] = []
    owners: list[nn.Module] = []
    for qual, m in model.named_modules():
        if id(m) in live:
            continue
        names = _read_names(type(m))
        for attr, value in m.__dict__.items():
            if attr in names and attr not in _MODULE_STATE and _plain(value):
                reads.append(BakedRead(qual, attr, copy.deepcopy(value)))  # a list changed in place too
                owners.append(m)
    return BakedReads(tuple(reads), tuple(owners), type(model).__name__)
