"""The plan cache returns only whole entries made for exactly this fingerprint, and never blocks planning."""

from __future__ import annotations

import json
import os

from pipedp.decide.cache import PlanCache, default_folder
from pipedp.decide.fingerprint import Fingerprint
from pipedp.decide.record import to_record
from tests.decide.test_record import DECISION, FP, PROFILES


def test_an_entry_is_found_by_its_fingerprint_only(tmp_path):
    cache = PlanCache(tmp_path / "plans")  # made on the first write
    assert cache.get(FP) is None
    record = to_record(PROFILES, DECISION, FP)
    path = cache.put(record)
    assert path == cache.path(FP.key) and os.path.exists(path)
    assert cache.get(FP) == record
    assert cache.get(Fingerprint({**FP.sections, "versions": "9" * 16}, FP.machine)) is None


def test_a_truncated_edited_or_misfiled_entry_is_not_used(tmp_path):
    cache = PlanCache(tmp_path)
    record = to_record(PROFILES, DECISION, FP)
    path = cache.put(record)
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    assert cache.get(FP) is None
    entry = json.loads(text)
    entry["record"]["config"]["microbatches"] = 8  # edited without its digest
    open(path, "w").write(json.dumps(entry))
    assert cache.get(FP) is None
    other = Fingerprint({**FP.sections, "model": "a" * 16}, FP.machine)
    os.replace(cache.put(to_record(PROFILES, DECISION, other)), path)  # another model's entry under this key
    assert cache.get(FP) is None


def test_an_unwritable_folder_gives_no_entry_and_no_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert PlanCache(blocked / "plans").put(to_record(PROFILES, DECISION, FP)) is None


def test_the_folder_comes_from_the_environment_else_the_per_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPEDP_PLAN_CACHE", str(tmp_path))
    assert default_folder() == str(tmp_path)
    monkeypatch.delenv("PIPEDP_PLAN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_folder() == str(tmp_path / "xdg" / "pipedp" / "plans")
