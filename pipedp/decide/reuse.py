"""Planning that reuses a decision where one exists: a saved one the user hands back, else the plan cache's.

Order: a saved decision (``wrap(..., decision=)``) is replayed or refused
with the reason, never silently re-planned; else a cache entry made for
exactly this fingerprint is replayed; else the plan is made and stored. The
record returned is the one to save with the model: the original one when a
decision was replayed (replaying it again gives the same plan, with its
first note), else the new one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from ..partition.profile import BlockProfile
from .cache import PlanCache
from .decision import Decision
from .fingerprint import Fingerprint
from .record import RecordError, replayed, to_record

__all__ = ["reuse_or_decide", "Planned"]

Planned = tuple[list[BlockProfile], Decision, dict[str, Any]]


def reuse_or_decide(make: Callable[[], tuple[list[BlockProfile], Decision]], fp: Fingerprint,
                    blocks: Sequence[str], saved: Mapping[str, Any] | None, cache: PlanCache | None,
                    now: Callable[[], float] = time.perf_counter) -> Planned:
    """The profiles, decision and record for this build: replayed from ``saved`` or ``cache``, or ``make()``-d.

    ``blocks``: the names of the model's blocks here, which a replayed cut must match.
    """
    start = now()
    if saved is not None:
        profiles, decision = replayed(saved, fp, blocks, "the saved decision (wrap's decision=)")
        return profiles, replace(decision, planning_s=now() - start), dict(saved)
    if cache is not None:
        hit = cache.get(fp)
        if hit is not None:
            try:
                profiles, decision = replayed(hit, fp, blocks, f"the plan cache ({cache.path(fp.key)})")
            except RecordError:
                pass  # an entry this build cannot use is made again below and replaced
            else:
                first, *rest = decision.notes  # the replay note: how to leave the cache out
                decision = replace(decision, planning_s=now() - start,
                                   notes=(f"{first}; plan_cache=False plans anew", *rest))
                return profiles, decision, hit
    profiles, decision = make()
    record = to_record(profiles, decision, fp)
    if cache is not None:
        cache.put(record)
    return profiles, decision, record
