"""Configurations and the grid: what fits, what is profiled by default, and bad values named."""

import pytest

from pipedp.advisor.space import Config, SearchSpace


def test_grid_keeps_what_fits_and_sorts_values():
    space = SearchSpace((2, 1), (4, 2), (1, 4))
    assert space.resources == (1, 2) and space.batches == (2, 4)
    assert sorted(space.configs()) == [Config(1, 2, 1), Config(1, 4, 1), Config(1, 4, 4), Config(2, 2, 1),
                                       Config(2, 4, 1), Config(2, 4, 4)]  # 4 microbatches do not fit a batch of 2
    assert space.directions == (-1, 1, 1)
    assert SearchSpace((1,), (2,), microbatch_direction=-1).directions == (-1, 1, -1)


def test_design_is_corners_and_middles():
    space = SearchSpace((1, 2, 4), (16, 32, 64, 128, 256), (1, 2, 4))
    design = space.design()
    corners = {Config(r, b, m) for r in (1, 4) for b in (16, 256) for m in (1, 4)}
    assert corners <= set(design)
    assert set(design) - corners == {Config(r, 64, 2) for r in (1, 2, 4)}
    assert len(design) < len(space.configs()) / 3


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="4 microbatches do not fit a batch of 2"):
        Config(1, 2, 4)
    with pytest.raises(ValueError, match="resources must be a positive int"):
        Config(0, 2)
    with pytest.raises(ValueError, match="batches must list at least one value"):
        SearchSpace((1,), ())
    with pytest.raises(ValueError, match="microbatch_direction"):
        SearchSpace((1,), (2,), microbatch_direction=0)
