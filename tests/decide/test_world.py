"""pp="auto": the finalists and the pick on injected costs, the choice in real 2-process gloo worlds."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch import nn

import pipedp
from pipedp.decide.layout import Layout, Prediction
from pipedp.decide.world import WITHHELD, WorldRow, _withheld_note, choose_world, finalists, pick
from tests import multiproc
from tests.reference import data, plain_steps, sequential_cnn


def _pred(dp: int, counts: tuple[int, ...], m: int, ms: float) -> Prediction:
    return Prediction(Layout(dp, counts, m), ms, ms, 0.0, 0.0, 0.0, 0.0)


def _table(rng: random.Random) -> list[Prediction]:
    preds = [_pred(4, (9,), 1, rng.uniform(5, 50))]
    preds += [_pred(2, (4, 5), m, rng.uniform(5, 50)) for m in (1, 2, 4)]
    preds += [_pred(1, (2, 2, 2, 3), m, rng.uniform(5, 50)) for m in (2, 4, 8)]
    return preds


def test_finalists_are_the_fastest_predicted_within_reach_and_always_data_parallel():
    rng = random.Random(0)
    for _ in range(300):
        preds = _table(rng)
        best = min(preds, key=lambda p: p.step_ms)
        out = finalists(preds, k=3, within=1.25)
        assert out[0] == best and 1 <= len(out) <= 3
        assert any(p.layout.pp == 1 for p in out)  # the user's own layout is always timed
        assert all(p.step_ms <= 1.25 * best.step_ms for p in out if p.layout.pp > 1)
        assert [p.step_ms for p in out] == sorted(p.step_ms for p in out)
    assert finalists([]) == []


def test_the_pick_is_never_slower_than_a_layout_it_timed():
    rng = random.Random(1)
    for _ in range(300):
        preds = _table(rng)
        timed = finalists(preds)
        rows = [WorldRow(p, rng.uniform(5, 50) if p in timed else None) for p in preds]
        chosen = pick(rows)
        fastest = min(r.measured_ms for r in rows if r.measured_ms is not None)
        assert next(r.measured_ms for r in rows if r.layout == chosen) == fastest
    # Nothing timed: the fastest prediction.
    preds = _table(rng)
    assert pick([WorldRow(p) for p in preds]) == min(preds, key=lambda p: p.step_ms).layout


def test_a_withheld_pipeline_is_pointed_out_with_the_option_that_allows_it():
    dp = WorldRow(_pred(2, (9,), 1, 40.0), 41.0)
    held = [_pred(1, (4, 5), 4, 20.0), _pred(1, (4, 5), 2, 30.0)]
    (note,) = _withheld_note(dp, held, "'bn1' calls batch_norm over the batch")
    assert "dp 1 x pp 2 x 4 mb" in note and "2.00x" in note and "'bn1'" in note and "microbatches='auto'" in note
    assert _withheld_note(dp, [_pred(1, (4, 5), 4, 39.0)], "bn1") == []  # within 5%: not worth a word
    assert _withheld_note(dp, [], "bn1") == []


def _choose_with_withheld(rank: int, world: int) -> dict:
    """The default for a BatchNorm model: one microbatch allowed, pipelines of 2 and 4 predicted only."""
    built = []

    def trial(layout: Layout):
        built.append(layout)
        return (lambda: None), (lambda: None)

    choice = choose_world(sequential_cnn(), torch.randn(16, 3, 16, 16), torch.device("cpu"), trial,
                          microbatches=(1,), withheld=(2, 4), coupled="bn", budget_s=60.0, bucket_bytes=2**20,
                          within=float("inf"))
    return {"built": built, "rows": choice.rows, "withheld": choice.withheld, "table": choice.table()}


def test_withheld_layouts_are_predicted_and_shown_never_built():
    a, _ = multiproc.run(_choose_with_withheld, 2, timeout_s=120)
    assert a["built"] and all(lay.microbatches == 1 for lay in a["built"])
    assert all(r.layout.microbatches == 1 for r in a["rows"])
    assert {p.layout.microbatches for p in a["withheld"]} == {2, 4} and all(p.layout.pp == 2 for p in a["withheld"])
    assert a["table"].count(WITHHELD) == len(a["withheld"]) and "moves a step" in a["table"]


def _choose_with_injected_steps(rank: int, world: int, slow_dp: bool) -> dict:
    """The real collective path (profile, probes, broadcast, windows) with trials that sleep a set time."""
    torch.manual_seed(0)
    built = []

    def trial(layout: Layout):
        built.append(layout.label)
        # data parallelism 30 ms a step where slow_dp, 2 ms otherwise; every pipeline 10 ms
        ms = (30 if slow_dp else 2) if layout.pp == 1 else 10
        return (lambda: time.sleep(ms / 1e3)), (lambda: None)

    choice = choose_world(sequential_cnn(), torch.randn(16, 3, 16, 16), torch.device("cpu"), trial,
                          microbatches=(2, 4), budget_s=60.0, bucket_bytes=2**20, steps=1, rounds=2,
                          within=float("inf"))  # time the 3 best predicted whatever the tiny model's profile says
    return {"layout": choice.layout, "built": built, "table": choice.table(), "rows": choice.rows}


@pytest.mark.parametrize("slow_dp", [False, True])
def test_ranks_agree_on_the_fastest_measured_layout(slow_dp):
    a, b = multiproc.run(_choose_with_injected_steps, 2, slow_dp, timeout_s=120)
    assert a["layout"] == b["layout"] and a["built"] == b["built"]
    assert (a["layout"].pp > 1) == slow_dp  # the trials' clock, not the prediction, decides
    assert any(r.layout.pp == 1 and r.measured_ms is not None for r in a["rows"])
    assert "chosen" in a["table"] and "predicted ms" in a["table"]


def _choose_with_a_compressed_reduce(rank: int, world: int) -> dict:
    """reduce_dtype="auto": every layout with replicas is weighed in bf16 too, and its trial is built that way."""
    built = []

    def trial(layout: Layout):
        built.append(layout)
        # The bf16 all-reduce is the fastest: 2 ms, the fp32 one 20 ms, pipelines 10 ms.
        ms = (2 if layout.reduce_dtype == torch.bfloat16 else 20) if layout.pp == 1 else 10
        return (lambda: time.sleep(ms / 1e3)), (lambda: None)

    choice = choose_world(sequential_cnn(), torch.randn(16, 3, 16, 16), torch.device("cpu"), trial,
                          microbatches=(2, 4), budget_s=60.0, bucket_bytes=2**20, steps=1, rounds=2, k=8,
                          within=float("inf"), reduce_dtypes=(None, torch.bfloat16))
    return {"layout": choice.layout, "built": built, "rows": [r.layout for r in choice.rows], "table": choice.table()}


def test_pp_auto_weighs_a_compressed_reduce_where_the_user_allows_it():
    a, b = multiproc.run(_choose_with_a_compressed_reduce, 2, timeout_s=120)
    assert a["layout"] == b["layout"] == Layout(2, a["layout"].counts, 1, reduce_dtype=torch.bfloat16)
    assert {lay.reduce_dtype for lay in a["rows"] if lay.dp == 2} == {None, torch.bfloat16}
    assert all(lay.reduce_dtype is None for lay in a["rows"] if lay.dp == 1)
    assert any(lay.reduce_dtype == torch.bfloat16 for lay in a["built"]) and "bfloat16 reduce" in a["table"]


def _choose_on_a_budget(rank: int, world: int) -> dict:
    """A fake clock: each trial's steps take 4 s of it; with a 5 s budget only the first finalist fits."""
    clock = [0.0]

    def trial(layout: Layout):
        def step() -> None:
            clock[0] += 1.0  # a warm-up and 2 windows of 1 step: 3 s a trial, plus 1 s to build
        clock[0] += 1.0
        return step, (lambda: None)

    choice = choose_world(sequential_cnn(), torch.randn(16, 3, 16, 16), torch.device("cpu"), trial,
                          microbatches=(2, 4), budget_s=5.0, bucket_bytes=2**20, now=lambda: clock[0],
                          within=float("inf"))
    return {"timed": [r.layout for r in choice.rows if r.measured_ms is not None], "notes": choice.notes,
            "first": choice.rows and min(choice.rows, key=lambda r: r.prediction.step_ms).layout,
            "layout": choice.layout, "planning_s": choice.planning_s}


@pytest.mark.slow  # a process world; the budget arithmetic is in tests/decide
def test_a_finalist_is_timed_only_if_a_trial_like_the_last_still_fits_the_budget():
    a, b = multiproc.run(_choose_on_a_budget, 2, timeout_s=120)
    assert a["timed"] == b["timed"] == [a["first"]] and a["layout"] == a["first"]  # the first is always timed
    assert "would not fit" in a["notes"][0] and a["planning_s"] == 4.0
    # Where the planning went (the fake clock moves only in the trial): all of it in the one trial.
    assert a["notes"][-1] == ("planning 4.0 s on rank 0: profile 0.0 s, link probes and prediction 0.0 s, "
                              "1 trial(s) 4.0 s")


def _choose_untimed(rank: int, world: int, case: str) -> dict:
    """One finalist (k=1), or a budget the profile has spent already: no trial is built."""
    built = []

    def trial(layout: Layout):
        built.append(layout.label)
        return (lambda: None), (lambda: None)

    k, budget_s = (1, 60.0) if case == "lone" else (3, 0.0)
    choice = choose_world(sequential_cnn(), torch.randn(16, 3, 16, 16), torch.device("cpu"), trial,
                          microbatches=(2, 4), budget_s=budget_s, bucket_bytes=2**20, k=k, within=float("inf"))
    lone = finalists([r.prediction for r in choice.rows], k=1)[0].layout
    best = min(choice.rows, key=lambda r: r.prediction.step_ms).layout
    return {"built": built, "layout": choice.layout, "notes": choice.notes, "lone": lone, "best": best,
            "measured": [r.measured_ms for r in choice.rows if r.measured_ms is not None]}


@pytest.mark.slow  # two process worlds
@pytest.mark.parametrize("case", ["lone", "budget"])
def test_no_trial_is_timed_where_it_could_decide_nothing(case):
    a, b = multiproc.run(_choose_untimed, 2, case, timeout_s=120)
    assert a["built"] == b["built"] == [] and a["measured"] == []
    assert a["layout"] == b["layout"] == (a["lone"] if case == "lone" else a["best"])
    assert ("chosen by prediction, not timed" if case == "lone" else "two trials") in a["notes"][0]


def _train_auto(rank: int, world: int, reduce_dtype: str | None = None, kw: dict | None = None) -> dict:
    torch.manual_seed(0)
    model = sequential_cnn()
    batches = data(n=16, size=16, steps=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), pp="auto", sample=batches[0][0],
                         progress=False, profile=False, plan_budget_s=60.0, reduce_dtype=reduce_dtype, **(kw or {}))
    lay, chosen = engine.layout, engine.world.layout
    n = 16 // lay.dp  # this replica's share of each global batch
    for x, y in batches:
        engine.train_step(x[lay.dp_rank * n:(lay.dp_rank + 1) * n], y[lay.dp_rank * n:(lay.dp_rank + 1) * n])
    owned = {id(p) for st in engine.executor.stages for p in st.chain.parameters()}
    return {"chosen": chosen, "dp": lay.dp, "pp": lay.pp, "microbatches": engine.plan.microbatches,
            "reduce_dtype": engine.comm.reduce_dtype, "table": engine.world.table(),
            "params": {k: p.detach().clone() for k, p in model.named_parameters() if id(p) in owned},
            "plan": str(engine.plan), "places": [r for r, _ in engine.decision.places],
            "schedule": engine.schedule}


@pytest.mark.parametrize("reduce_dtype", [None, "auto"])
def test_pp_auto_builds_the_layout_it_chose_and_trains_as_plain_training(reduce_dtype):
    a, b = multiproc.run(_train_auto, 2, reduce_dtype, timeout_s=180)
    assert a["chosen"] == b["chosen"]
    chosen = a["chosen"]
    assert (a["dp"], a["pp"]) == (chosen.dp, chosen.pp) == (b["dp"], b["pp"])
    assert a["microbatches"] == chosen.microbatches and "pp=auto" in a["plan"]
    # The gradients travel in the dtype the choice says (fp32 unless the user allowed bf16 and it won).
    assert a["reduce_dtype"] == b["reduce_dtype"] == chosen.reduce_dtype
    assert ("bfloat16 reduce" in a["table"]) == (reduce_dtype == "auto")
    torch.manual_seed(0)
    ref = plain_steps(sequential_cnn(), data(n=16, size=16, steps=2), microbatches=chosen.microbatches)
    want = dict(ref.named_parameters())
    tol = 1e-5 if chosen.reduce_dtype is None else 2e-3  # bf16 rounds each rank's gradient to 8 bits
    for got in (a["params"], b["params"]):
        assert got  # every rank owns some parameters
        assert max((got[k] - want[k].detach()).abs().max().item() for k in got) < tol


def test_pp_auto_weighs_interleaved_layouts_and_trains_the_one_it_chose():
    a, b = multiproc.run(_train_auto, 2, None, dict(schedule="interleaved", microbatches=2), timeout_s=180)
    chosen = a["chosen"]
    assert a["chosen"] == b["chosen"] and "dp 1 x pp 2 x 2 mb interleaved v2" in a["table"]
    if chosen.pp == 2:  # two stages a rank, stage s on rank s mod 2
        assert chosen.per_rank == 2 and a["places"] == [0, 1, 0, 1] and a["schedule"] == "interleaved"
    torch.manual_seed(0)
    ref = plain_steps(sequential_cnn(), data(n=16, size=16, steps=2), microbatches=chosen.microbatches)
    want = dict(ref.named_parameters())
    for got in (a["params"], b["params"]):
        assert got and max((got[k] - want[k].detach()).abs().max().item() for k in got) < 1e-5


def test_pp_auto_in_one_process_is_the_one_layout_and_needs_no_sample():
    model = sequential_cnn()
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                         pp="auto", progress=False, profile=False)
    x, y = data(n=8, size=16, steps=1)[0]
    engine.train_step(x, y)
    assert engine.world is None and engine.layout is None


def _bad_auto(rank: int, world: int, kw: dict) -> str:
    model = sequential_cnn()
    try:
        pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                    pp="auto", progress=False, profile=False, **kw)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.slow  # two process worlds for two error messages
@pytest.mark.parametrize("kw, says", [({}, "pass sample="), ({"sample": (16, 3, 16, 16), "stages": 2}, "stages=2")])
def test_pp_auto_says_what_it_needs(kw, says):
    for msg in multiproc.run(_bad_auto, 2, kw, timeout_s=60):
        assert says in msg and "pp=N" in msg



def _predict_another(rank: int, world: int) -> dict:
    choice = choose_world(sequential_cnn(), torch.randn(16, 3, 16, 16), torch.device("cpu"),
                          lambda lay: ((lambda: None), (lambda: None)), microbatches=(2,), budget_s=0.0,
                          bucket_bytes=2**20)
    row = choice.rows[0]
    return {"same": choice.predict(row.layout) == row.prediction,
            "other": choice.predict(Layout(1, (1, sum(row.layout.counts) - 1), 4)).step_ms}


def test_the_choice_predicts_any_layout_as_it_predicted_its_rows():
    a, b = multiproc.run(_predict_another, 2, timeout_s=120)
    assert a["same"] and b["same"] and a["other"] == b["other"] > 0  # rank 0's profile, on every rank


def _choose_in_fewer_windows(rank: int, world: int) -> dict:
    """Two trials of 8 windows would not fit the budget, two of one window would: each is timed in one, not none.

    Each trial step is taken to last 1 s (``_trial_s`` patched in this spawned rank), so what fits does not
    hang on the tiny model's profile.
    """
    import pipedp.decide.world as w

    w._trial_s = lambda p, rounds, steps: (1 + rounds * steps) * 1.0
    calls: list[int] = []

    def trial(layout: Layout):
        calls.append(0)

        def step() -> None:
            calls[-1] += 1
        return step, (lambda: None)

    choice = choose_world(sequential_cnn(), torch.randn(16, 3, 16, 16), torch.device("cpu"), trial,
                          microbatches=(2, 4), bucket_bytes=2**20, steps=1, within=float("inf"), now=lambda: 0.0,
                          budget_s=4.5, rounds=8)  # two trials: 2 x 9 s in 8 windows, 2 x 2 s in one
    return {"calls": calls, "notes": choice.notes}


@pytest.mark.slow  # a process world
def test_where_two_trials_do_not_fit_they_are_timed_in_fewer_windows():
    a, b = multiproc.run(_choose_in_fewer_windows, 2, timeout_s=120)
    assert a["calls"] == b["calls"] and len(a["calls"]) >= 2 and set(a["calls"]) == {2}  # a warm-up and 1 window
    assert any("each trial timed in 1 window(s)" in n and "not 8" in n for n in a["notes"])
