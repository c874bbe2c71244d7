"""Checks of user-supplied values with errors that name the option, the value and what is allowed."""

from __future__ import annotations

from typing import Sequence, TypeVar

__all__ = ["positive_int", "non_negative_int", "positive_number", "one_of"]

T = TypeVar("T")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(name: str, v: object) -> int:
    """``v`` if it is an int >= 1 (a bool is not an int here), else ``ValueError``."""
    if not _is_int(v) or v < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v  # type: ignore[return-value]


def non_negative_int(name: str, v: object) -> int:
    """``v`` if it is an int >= 0, else ``ValueError``."""
    if not _is_int(v) or v < 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return v  # type: ignore[return-value]


def positive_number(name: str, v: object, unit: str = "") -> float:
    """``v`` as a float if it is a finite number > 0, else ``ValueError``."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
    if not ok:
        raise ValueError(f"{name} must be a positive number{' of ' + unit if unit else ''}, got {v!r}")
    return float(v)  # type: ignore[arg-type]


def one_of(name: str, v: T, choices: Sequence[T]) -> T:
    """``v`` if it is one of ``choices``, else ``ValueError`` listing them."""
    if v not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {v!r}")
    return v
