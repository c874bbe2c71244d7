"""The plan cache: decisions on disk, keyed by their fingerprint, checked when read, written whole.

Planning times trials for seconds to a minute; the same model, input,
options, machine and versions get the same answer from the cache in well
under a second, and the same plan in every run of a command (timings
within the noise no longer pick between near-equal plans anew). An entry
is one JSON file named by the fingerprint's key, holding the record and a
digest of it: a truncated or edited file, or one of another format, is
not used (the plan is made again and the entry replaced).

The folder: ``plan_cache=`` (a path), else ``$PIPEDP_PLAN_CACHE``, else
``plans/`` in pipedp's per-user cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

from ..atomic import write_text
from .fingerprint import Fingerprint
from .record import RECORD_FORMAT

__all__ = ["PlanCache", "default_folder"]

ENV = "PIPEDP_PLAN_CACHE"


def default_folder() -> str:
    """``$PIPEDP_PLAN_CACHE``, else ``plans/`` under pipedp's per-user cache (``$XDG_CACHE_HOME/pipedp``)."""
    from ..ops.parallel import cache_folder  # the per-user cache's one owner

    return os.environ.get(ENV) or os.path.join(cache_folder(), "plans")


def _digest(record: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


class PlanCache:
    """Plan records in ``folder``, one JSON file per fingerprint key."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)

    def path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.json")

    def get(self, fp: Fingerprint) -> dict[str, Any] | None:
        """The record stored for ``fp`` when it is whole and made for exactly ``fp``; else None."""
        try:
            with open(self.path(fp.key)) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            return None
        record = entry.get("record") if isinstance(entry, dict) else None
        if not isinstance(record, dict) or entry.get("digest") != _digest(record):
            return None
        if record.get("format") != RECORD_FORMAT or fp.differing(record.get("sections", {})):
            return None
        return record

    def put(self, record: Mapping[str, Any]) -> str | None:
        """Store ``record`` under its fingerprint's key, atomically; the path, or None where it cannot be
        written (a read-only or missing home: planning goes on without the cache)."""
        sections = record["sections"]
        key = Fingerprint(sections, str(record["machine"])).key
        try:
            os.makedirs(self.folder, exist_ok=True)
            path = self.path(key)
            write_text(path, json.dumps({"record": dict(record), "digest": _digest(record)}, sort_keys=True,
                                        indent=1))
            return path
        except OSError:
            return None
