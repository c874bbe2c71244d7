"""The xgboost-guided search on a small CPU problem."""

import math

import pytest

pytest.importorskip("tvm")
pytest.importorskip("xgboost")
import torch  # noqa: E402

from pipedp.kernels.tvm import tuner as T  # noqa: E402
from pipedp.kernels.tvm.builder import LocalBuilder  # noqa: E402
from pipedp.kernels.tvm.cost_model import History, XGBoostModel  # noqa: E402
from pipedp.kernels.tvm.ops import DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.runner import LocalRunner  # noqa: E402
from pipedp.kernels.tvm.target import make_target  # noqa: E402
from pipedp.kernels.tvm.template import get_template  # noqa: E402

CONV = DepthwiseConv(2, 8, 12, 12, padding=1)


def test_budget_curve_and_no_repeats():
    seen = []
    r = T.tune(CONV, "fwd", make_target("cpu"), torch.device("cpu"), trials=10, batch=4, min_ms=1,
               on_measure=lambda m, _: seen.append(m))
    assert len(r.measurements) == len(seen) <= 10
    keys = [T._key(m.config) for m in r.measurements]
    assert len(set(keys)) == len(keys)
    curve = r.best_so_far()
    assert all(b <= a for a, b in zip(curve, curve[1:], strict=False)) and curve[-1] == r.best.us


def test_a_wrong_kernel_never_becomes_a_measurement():
    current = {}

    class Recording(LocalBuilder):
        def build(self, conv, op, cfg, target):
            current["cfg"] = cfg
            return super().build(conv, op, cfg, target)

    class Flaky(LocalRunner):
        def run(self, kernel, conv, op, layout, device, min_ms):
            if T._key(current["cfg"]).count('"cache": 1'):
                raise ValueError("differs from torch")
            return super().run(kernel, conv, op, layout, device, min_ms)

    r = T.tune(CONV, "fwd", make_target("cpu"), torch.device("cpu"), trials=8, batch=4, min_ms=1,
               builder=Recording(), runner=Flaky())
    for m in r.measurements:
        assert (m.config["cache"] == 1) == (not math.isfinite(m.us))
    assert r.best is None or r.best.config["cache"] == 0


def test_the_model_steers_from_the_second_batch():
    """A model fit on one batch already ranks unseen configs: its top pick beats the median."""
    target = make_target("cpu")
    tmpl = get_template(target)
    space = tmpl.space(CONV, "dgrad")
    rs = T.tune(CONV, "dgrad", target, torch.device("cpu"), trials=8, batch=8, min_ms=1)  # one random batch
    model = XGBoostModel(0)

    def feats(c):
        return space.features(c) + tmpl.features(CONV, "dgrad", c)

    ok = [m for m in rs.measurements if math.isfinite(m.us)]
    model.fit([feats(m.config) for m in ok], [math.log(m.us) for m in ok])
    pred = model.predict([feats(m.config) for m in ok])
    order = sorted(range(len(ok)), key=lambda i: pred[i])
    # fit on the batch, the model orders it: its predicted best is faster than its predicted worst
    assert ok[order[0]].us < ok[order[-1]].us


class Synthetic:
    """Builder and runner of a synthetic law (nothing compiles): fast where cache, unroll and row tasks are on."""

    def build(self, conv, op, cfg, target):
        return cfg

    def run(self, cfg, conv, op, layout, device, min_ms):
        slow = 1 + 3 * (cfg["cache"] != 1) + 2 * (cfg["unroll"] != 1) + (cfg["task"] != "row")
        return conv.min_bytes(op) * 1e-3 * slow


def test_history_from_earlier_problems_steers_the_first_batch():
    """A law that holds across shapes (here a synthetic one) is learnt on one problem and used on the next."""
    target, cpu = make_target("cpu"), torch.device("cpu")
    first, second = DepthwiseConv(2, 32, 12, 12, padding=1), DepthwiseConv(4, 64, 8, 8, padding=1)
    law = dict(builder=Synthetic(), runner=Synthetic())

    def good(r):
        return sum(m.config["cache"] == 1 and m.config["unroll"] == 1 and m.config["task"] == "row"
                   for m in r.measurements)

    history = History()
    T.tune(first, "fwd", target, cpu, trials=24, batch=8, layout="NHWC", history=history, **law)
    key = History.key(get_template(target, "NHWC").space(first, "fwd"), "fwd")
    assert len(history.get(key)[1]) == 24
    guided = T.tune(second, "fwd", target, cpu, trials=8, batch=8, layout="NHWC", history=history, seed=1, **law)
    cold = T.tune(second, "fwd", target, cpu, trials=8, batch=8, layout="NHWC", seed=1, **law)
    assert good(guided) >= 6 > good(cold)  # one batch: 1 in 8 configs is in the fast region
    assert len(history.get(key)[1]) == 32


def test_the_same_seed_proposes_the_same_configs():
    """The search is a function of its seed and what it measured: builders and runners elsewhere change nothing."""
    target, cpu = make_target("cpu"), torch.device("cpu")
    runs = [T.tune(CONV, "fwd", target, cpu, trials=16, batch=4, layout="NHWC", seed=3, builder=Synthetic(),
                   runner=Synthetic()) for _ in range(2)]
    assert [m.config for m in runs[0].measurements] == [m.config for m in runs[1].measurements]
    assert len(runs[0].measurements) > 8  # past the first batch: the model's proposals too


def test_a_cost_model_plugs_in():
    fits = []

    class Constant:
        def __init__(self, seed):
            pass

        def fit(self, x, y):
            fits.append(len(y))

        def predict(self, x):
            return [0.0] * len(x)

    r = T.tune(CONV, "fwd", make_target("cpu"), torch.device("cpu"), trials=8, batch=4, layout="NHWC",
               builder=Synthetic(), runner=Synthetic(), cost_model=Constant)
    assert len(r.measurements) == 8 and fits == [4, 8]
