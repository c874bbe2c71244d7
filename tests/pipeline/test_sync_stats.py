"""The span arithmetic behind a step's sync statistics."""

import pytest

from pipedp.pipeline.sync_stats import union_ms


def test_union_of_spans_and_the_part_before_the_wait():
    total, before = union_ms([(0.0, 1e-3), (0.5e-3, 2e-3), (3e-3, 4e-3)], until=1.5e-3)
    assert total == pytest.approx(3.0) and before == pytest.approx(1.5)
