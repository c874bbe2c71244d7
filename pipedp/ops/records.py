"""The tuning records: one JSON object per line, appended atomically, read forgivingly.

A record says what was measured: operator, problem (shape, stride, padding,
dilation, dtype, layout), target, config, the kernel's µs, torch's µs in both
layouts, and the tool versions. Export records name a shared library and
its sha256, so a loader can refuse a library that is not the one exported.
A line that does not parse (a crash mid-write, a hand edit) is skipped with a
warning; it never stops a run. A records file that cannot be read at all
(a folder in its place, no permission) raises :class:`KernelDbError`, the
one error a damaged kernel database raises, so ``kernels="auto"`` can fall
back to torch on exactly that and nothing else.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Iterable

__all__ = ["append", "read", "best", "problem_key", "latest_export", "RECORDS_FILE", "KernelDbError"]

RECORDS_FILE = "records.jsonl"


class KernelDbError(RuntimeError):
    """A kernel database (records file, export record, exported library) or TVM runtime that cannot be used.

    ``kernels="auto"`` keeps torch on exactly this error; ``"tvm"`` raises it.
    """


def problem_key(op: str, problem: dict[str, Any], target: str, layout: str = "NCHW") -> str:
    """A stable string naming one kernel to tune: operator, problem, layout and target."""
    return json.dumps([op, problem, layout, target], sort_keys=True, separators=(",", ":"))


def append(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Add one record as one line, with one ``write`` on an O_APPEND descriptor, then fsync.

    Concurrent writers never interleave inside a line; a crash leaves at most
    one torn last line, which :func:`read` skips.
    """
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records that parse; corrupt lines are skipped with a warning naming the line.

    Raises :class:`KernelDbError` when the file exists but cannot be read.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        return []
    if os.path.isdir(path):
        raise KernelDbError(f"{path} is a folder, not a records file: remove it, or point --db / kernel_db at "
                            f"another folder, and run tune-kernels again")
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except OSError as e:
        raise KernelDbError(f"cannot read the tuning records {path} ({e.strerror or e}): fix its permissions, or "
                            f"delete {os.path.dirname(path) or '.'} and run tune-kernels again") from None
    return _parse(path, lines)


def _parse(path: str, lines: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or "kind" not in rec:
                raise ValueError("not a record object")
        except ValueError as e:
            warnings.warn(f"{path}:{no}: skipping a corrupt tuning record ({e})", stacklevel=3)
            continue
        out.append(rec)
    return out


def best(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fastest measured record per problem key."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") != "measure" or not isinstance(r.get("us"), (int, float)):
            continue
        k = problem_key(r["op"], r["problem"], r["target"], r.get("layout", "NCHW"))
        if k not in out or r["us"] < out[k]["us"]:
            out[k] = r
    return out


def latest_export(records: Iterable[dict[str, Any]], target: str) -> dict[str, Any] | None:
    """The last export record for ``target`` (the library the loader should use)."""
    found = None
    for r in records:
        if r.get("kind") == "export" and r.get("target") == target:
            found = r
    return found
