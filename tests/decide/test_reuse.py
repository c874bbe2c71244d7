"""A saved decision is replayed or refused, a cached one replayed, and only a miss plans (and is stored)."""

from __future__ import annotations

import pytest

from pipedp.decide.cache import PlanCache
from pipedp.decide.fingerprint import Fingerprint
from pipedp.decide.record import RecordError, to_record
from pipedp.decide.reuse import reuse_or_decide
from pipedp.partition.profile import BlockProfile
from tests.decide.test_record import DECISION, FP, PROFILES

BLOCKS = ["a", "b"]


class Planner:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return list(PROFILES), DECISION


def test_a_miss_plans_and_stores_and_the_next_build_replays_it(tmp_path):
    cache, plan = PlanCache(tmp_path), Planner()
    profiles, decision, record = reuse_or_decide(plan, FP, BLOCKS, None, cache)
    assert plan.calls == 1 and decision == DECISION and cache.get(FP) == record
    profiles, again, same = reuse_or_decide(plan, FP, BLOCKS, None, cache)
    assert plan.calls == 1 and again.config == DECISION.config and same == record
    assert again.notes[0].startswith("plan replayed from the plan cache") and "plan_cache=False" in again.notes[0]


def test_without_a_cache_every_build_plans(tmp_path):
    plan = Planner()
    reuse_or_decide(plan, FP, BLOCKS, None, None)
    reuse_or_decide(plan, FP, BLOCKS, None, None)
    assert plan.calls == 2


def test_a_saved_decision_wins_over_the_cache_and_is_never_replanned(tmp_path):
    cache, plan = PlanCache(tmp_path), Planner()
    saved = to_record(PROFILES, DECISION, FP)
    _, decision, record = reuse_or_decide(plan, FP, BLOCKS, saved, cache)
    assert plan.calls == 0 and record == saved and "saved decision" in decision.notes[0]
    other = Fingerprint({**FP.sections, "request": "c" * 16}, FP.machine)
    with pytest.raises(RecordError, match="the request differ"):
        reuse_or_decide(plan, other, BLOCKS, saved, cache)
    assert plan.calls == 0


def test_a_cached_entry_for_other_blocks_is_planned_again_and_replaced(tmp_path):
    cache = PlanCache(tmp_path)
    reuse_or_decide(Planner(), FP, BLOCKS, None, cache)
    plan = Planner()
    renamed = [BlockProfile(n, p.forward_ms, p.backward_ms, p.output_bytes, p.saved_bytes, p.param_bytes)
               for n, p in zip(["x", "y"], PROFILES)]
    _, decision, record = reuse_or_decide(lambda: (plan() and renamed, DECISION), FP, ["x", "y"], None, cache)
    assert plan.calls == 1 and decision == DECISION  # the entry named blocks a and b: planned, not replayed
    assert [p[0] for p in cache.get(FP)["profiles"]] == ["x", "y"] and cache.get(FP) == record
