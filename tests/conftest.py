"""Every test plans afresh: the plan cache goes to the test's own folder, not the user's."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # A test that wraps one model twice may meet its own first plan, as a user's second run does.
    monkeypatch.setenv("PIPEDP_PLAN_CACHE", str(tmp_path_factory.mktemp("plans")))
