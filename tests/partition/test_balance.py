import itertools
import math
import random

import pytest

from pipedp.partition import balance, stage_costs


def brute_force(costs, stages, transfer=None):
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0,) + cuts + (n,)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        best = min(best, max(stage_costs(costs, counts, transfer=transfer)))
    return best


def random_cases(count, seed, with_transfer):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 10)
        stages = rng.randint(1, n)
        kind = rng.random()
        if kind < 0.3:
            costs = [rng.randint(0, 5) for _ in range(n)]  # many ties
        elif kind < 0.6:
            costs = [rng.expovariate(1.0) for _ in range(n)]  # skewed
        else:
            costs = [rng.uniform(0, 10) for _ in range(n)]
        transfer = [rng.uniform(0, 3) for _ in range(n - 1)] if with_transfer else None
        yield costs, stages, transfer


@pytest.mark.parametrize("with_transfer", [False, True])
def test_balance_equals_brute_force(with_transfer):
    cases = list(random_cases(250, seed=1 + with_transfer, with_transfer=with_transfer))
    assert len(cases) >= 200
    for costs, stages, transfer in cases:
        counts = balance(costs, stages, transfer=transfer)
        assert len(counts) == stages and sum(counts) == len(costs) and min(counts) >= 1
        got = max(stage_costs(costs, counts, transfer=transfer))
        assert got == pytest.approx(brute_force(costs, stages, transfer), rel=1e-9, abs=1e-12), (costs, stages)


def test_balance_beats_naive_equal_split():
    costs = [1, 1, 1, 1, 1, 1, 10, 1]
    counts = balance(costs, 3)
    assert max(stage_costs(costs, counts)) == 10
    assert counts[2] <= 2  # the heavy block sits (almost) alone


def test_transfer_moves_the_cut():
    costs = [1.0, 1.0, 1.0, 1.0]
    # Cutting after block 1 is expensive; the optimum avoids it.
    assert balance(costs, 2, transfer=[0.0, 5.0, 0.0]) in ([1, 3], [3, 1])
    assert balance(costs, 2) == [2, 2]


def test_deterministic():
    costs = [1.0] * 6
    assert balance(costs, 3) == balance(costs, 3)


@pytest.mark.parametrize(
    "costs, stages, transfer, match",
    [
        ([1, 2], 3, None, r"cannot cut 2 blocks into 3 non-empty stages"),
        ([1, 2], 0, None, r"stages must be a positive int"),
        ([1, 2], True, None, r"stages must be a positive int"),
        ([], 1, None, r"costs is empty"),
        ([1, -2], 1, None, r"non-negative"),
        ([1, float("nan")], 1, None, r"finite"),
        ([1, 2, 3], 2, [1.0], r"transfer has 1 entries but needs 2"),
    ],
)
def test_balance_errors(costs, stages, transfer, match):
    with pytest.raises(ValueError, match=match):
        balance(costs, stages, transfer=transfer)


def test_stage_costs_checks_counts():
    assert stage_costs([1, 2, 3], [1, 2], transfer=[5, 7]) == [6, 5]
    with pytest.raises(ValueError, match="sum to 3"):
        stage_costs([1, 2, 3], [1, 1])


def _rank_sums(costs, ranks):
    """A stand-in step: the busiest rank's load where stage s runs on rank s mod ``ranks`` (interleaved)."""
    def step(counts):
        sums = stage_costs(costs, counts)
        return max(sum(sums[s] for s in range(r, len(sums), ranks)) for r in range(ranks))
    return step


def test_refine_never_returns_a_slower_cut_and_stops_where_no_move_helps():
    from pipedp.partition.balance import refine

    for costs, stages, _ in random_cases(60, seed=5, with_transfer=False):
        if stages < 2:
            continue
        step = _rank_sums(costs, 2)
        start = balance(costs, stages)
        out = refine(start, step)
        assert sum(out) == len(costs) and min(out) >= 1 and step(out) <= step(start)
        for i in range(len(out) - 1):  # a local optimum: no single move of one cut point is faster
            for d in (-1, 1):
                c = list(out)
                c[i], c[i + 1] = c[i] + d, c[i + 1] - d
                if min(c) >= 1:
                    assert step(c) >= step(out) * (1 - 1e-9)


def test_refine_moves_a_bottleneck_optimal_cut_that_loads_one_rank():
    from pipedp.partition.balance import refine

    # Four stages over two ranks (0 and 2 on rank 0): min-max balances the stages, not the ranks' sums.
    costs = [5, 1, 3, 1, 4, 4]
    step = _rank_sums(costs, 2)
    start = balance(costs, 4)
    assert start == [1, 2, 2, 1] and step(start) == 10  # stages 5, 4, 5, 4: ranks 10 and 8
    assert refine(start, step) == [1, 3, 1, 1]  # stages 5, 5, 4, 4: ranks 9 and 9
    with pytest.raises(ValueError, match="positive block counts"):
        refine([0, 8], step)


def test_refine_breaks_a_tie_at_the_top_by_the_next_figure():
    from pipedp.partition.balance import refine

    # Figures (the busiest load, the next): a move that keeps the top and lowers the next is taken.
    table = {(2, 2, 2): (5.0, 5.0, 1.0), (3, 1, 2): (5.0, 4.0, 2.0), (2, 3, 1): (6.0, 1.0, 1.0)}
    assert refine([2, 2, 2], lambda c: table.get(tuple(c), (9.0, 9.0, 9.0))) == [3, 1, 2]
    assert refine([2, 2, 2], lambda c: table.get(tuple(c), (9.0,))[0]) == [2, 2, 2]  # one figure: a tie stays
