"""The tuning records: one JSON object per line, appended atomically, read forgivingly.

A record says what was measured: operator, problem (shape, stride, padding,
dilation, dtype, layout), target, config, the kernel's µs, torch's µs in both
layouts, and the tool versions. Every candidate the tuner tried has one, a
failed one too (``status`` says how it failed: ``error``, ``wrong``,
``crash``, ``timeout``; its ``us`` is null), so a later run's cost model
learns from all of them; ``tuned`` records mark a kernel whose search is
done, so a later run skips it. Export records name a shared library and its
sha256, so a loader can refuse a library that is not the one exported.

Every record carries the :data:`SCHEMA` it was written in (none: schema 1,
the format before it was stamped, read as it is). A record of a newer schema
than this pipedp knows is skipped with one warning naming the upgrade: its
fields may mean something this reader would get wrong. A line that does not
parse, or a record whose fields are not what its kind needs (a crash
mid-write, a hand edit), is skipped with a warning naming the line; it never
stops a run. A records file that cannot be read at all (a folder in its
place, no permission) raises :class:`KernelDbError`, the one error a damaged
kernel database raises, so ``kernels="auto"`` can fall back to torch on
exactly that and nothing else.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Iterable

__all__ = ["append", "read", "best", "problem_key", "layer_key", "batch_of", "latest_export", "RECORDS_FILE",
           "KernelDbError", "SCHEMA"]

RECORDS_FILE = "records.jsonl"
# 2: records carry "schema"; every candidate is recorded (failed ones with a "status" and a null "us"); "tuned"
# records mark finished searches. Schema 1 (no "schema" field): successful measurements and exports only.
SCHEMA = 2


class KernelDbError(RuntimeError):
    """A kernel database (records file, export record, exported library) or TVM runtime that cannot be used.

    ``kernels="auto"`` keeps torch on exactly this error; ``"tvm"`` raises it.
    """


def problem_key(op: str, problem: dict[str, Any], target: str, layout: str = "NCHW") -> str:
    """A stable string naming one kernel to tune: operator, problem (its batch size included), layout and target.

    Measurements are keyed by it: a timing is only comparable with another at the same batch size.
    """
    return json.dumps([op, problem, layout, target], sort_keys=True, separators=(",", ":"))


def layer_key(op: str, problem: dict[str, Any], target: str, layout: str = "NCHW") -> str:
    """A stable string naming one exported kernel: :func:`problem_key` without the batch size.

    An exported kernel takes any batch size, so it serves a layer, not one
    shape of it. Export libraries written before that keyed their kernels by
    :func:`problem_key` (the batch included, compiled for exactly that size);
    :func:`batch_of` tells the two apart.
    """
    return problem_key(op, {k: v for k, v in problem.items() if k != "n"}, target, layout)


def batch_of(key: str) -> int | None:
    """The batch size an export key is bound to (a :func:`problem_key`), or None for a :func:`layer_key`.

    Raises ValueError for a string that is not such a key.
    """
    try:
        op, problem, layout, target = json.loads(key)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{key!r:.80} is not a kernel key") from e
    if not isinstance(problem, dict):
        raise ValueError(f"{key!r:.80} is not a kernel key")
    n = problem.get("n")
    return n if isinstance(n, int) else None


def append(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Add one record as one line, with one ``write`` on an O_APPEND descriptor, then fsync.

    Concurrent writers never interleave inside a line; a crash leaves at most
    one torn last line, which :func:`read` skips. The record is stamped with
    :data:`SCHEMA`: this pipedp writes it in its own format.
    """
    line = (json.dumps({**record, "schema": SCHEMA}, sort_keys=True) + "\n").encode()
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records this pipedp can use; corrupt lines are skipped with a warning naming the line, records of a
    newer schema with one warning naming the upgrade.

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
    newer: dict[int, int] = {}  # schema -> records of it skipped
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            schema = _schema(rec)
            if schema <= SCHEMA:
                _check_fields(rec)
        except ValueError as e:
            warnings.warn(f"{path}:{no}: skipping a corrupt tuning record ({e})", stacklevel=3)
            continue
        if schema > SCHEMA:
            newer[schema] = newer.get(schema, 0) + 1
            continue
        out.append(rec)
    if newer:
        warnings.warn(f"{path}: skipping {sum(newer.values())} record(s) of schema {max(newer)}, written by a newer "
                      f"pipedp (this one reads schema {SCHEMA} and older): upgrade pipedp (pip install -U pipedp) to "
                      f"use them", stacklevel=3)
    return out


def _schema(rec: Any) -> int:
    """The record's schema (1 when unstamped); a ValueError for anything that is not a record object."""
    if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
        raise ValueError("not a record object")
    schema = rec.get("schema", 1)
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise ValueError(f"schema {schema!r} is not a positive integer")
    return schema


# Fields a record of each kind must have, and their types, for the code that reads it not to fail later.
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "measure": {"op": str, "problem": dict, "target": str, "config": dict},
    "tuned": {"op": str, "problem": dict, "target": str},
}


def _check_fields(rec: dict[str, Any]) -> None:
    """A ValueError naming the first field a record of a known kind lacks or has of the wrong type."""
    for name, kind in _FIELDS.get(rec["kind"], {}).items():
        if not isinstance(rec.get(name), kind):
            raise ValueError(f"a {rec['kind']} record whose {name!r} is {rec.get(name)!r:.40}")
    if not isinstance(rec.get("layout", "NCHW"), str):
        raise ValueError(f"a {rec['kind']} record whose 'layout' is {rec['layout']!r:.40}")
    if rec["kind"] == "measure":
        status, us = rec.get("status", "ok"), rec.get("us")
        if status == "ok" and not _time(us):
            raise ValueError(f"a measure record whose 'us' is {us!r:.40}, not a positive time")
        if status != "ok" and (not isinstance(status, str) or us is not None):
            raise ValueError(f"a failed measure record (status {status!r:.40}) with a time ({us!r:.40})")


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def best(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fastest successful measure record per problem key (failed candidates are never chosen)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") != "measure" or r.get("status", "ok") != "ok" or not _time(r.get("us")):
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
