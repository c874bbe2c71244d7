"""The xgboost-guided search on a small CPU problem."""

import math

import pytest

pytest.importorskip("tvm")
pytest.importorskip("xgboost")
import torch  # noqa: E402

from kernels.tvm import build as B  # noqa: E402
from kernels.tvm import tuner as T  # noqa: E402
from kernels.tvm.ops import DepthwiseConv  # noqa: E402

CONV = DepthwiseConv(2, 8, 12, 12, padding=1)


def test_budget_curve_and_no_repeats():
    seen = []
    r = T.tune(CONV, "fwd", B.make_target("cpu"), torch.device("cpu"), trials=10, batch=4, min_ms=1,
               on_measure=lambda m, _: seen.append(m))
    assert len(r.measurements) == len(seen) <= 10
    keys = [T._key(m.config) for m in r.measurements]
    assert len(set(keys)) == len(keys)
    curve = r.best_so_far()
    assert all(b <= a for a, b in zip(curve, curve[1:])) and curve[-1] == r.best.us


def test_a_wrong_kernel_never_becomes_a_measurement(monkeypatch):
    real = B.check

    def flaky(kernel, conv, op, device, layout):
        if T._key(current["cfg"]).count('"cache": 1'):
            raise ValueError("differs from torch")
        return real(kernel, conv, op, device, layout)

    current = {}
    real_build = B.build

    def build(conv, op, cfg, target):
        current["cfg"] = cfg
        return real_build(conv, op, cfg, target)

    monkeypatch.setattr(B, "check", flaky)
    monkeypatch.setattr(B, "build", build)
    r = T.tune(CONV, "fwd", B.make_target("cpu"), torch.device("cpu"), trials=8, batch=4, min_ms=1)
    for m in r.measurements:
        assert (m.config["cache"] == 1) == (not math.isfinite(m.us))
    assert r.best is None or r.best.config["cache"] == 0


def test_the_model_steers_from_the_second_batch():
    """A model fit on one batch already ranks unseen configs: its top pick beats the median."""
    target = B.make_target("cpu")
    space = B.space(CONV, "dgrad", target)
    rs = T.tune(CONV, "dgrad", target, torch.device("cpu"), trials=8, batch=8, min_ms=1)  # one random batch
    model = T._Model(0)
    tmpl = B.template(target)

    def feats(c):
        return space.features(c) + tmpl.features(CONV, "dgrad", c)

    ok = [m for m in rs.measurements if math.isfinite(m.us)]
    model.fit([feats(m.config) for m in ok], [math.log(m.us) for m in ok])
    pred = model.predict([feats(m.config) for m in ok])
    order = sorted(range(len(ok)), key=lambda i: pred[i])
    # fit on the batch, the model orders it: its predicted best is faster than its predicted worst
    assert ok[order[0]].us < ok[order[-1]].us


def test_history_from_earlier_problems_steers_the_first_batch(monkeypatch):
    """A law that holds across shapes (here a synthetic one) is learnt on one problem and used on the next."""

    def fake(conv, op, cfg, target, device, min_ms):
        slow = 1 + 3 * (cfg["cache"] != 1) + 2 * (cfg["unroll"] != 1) + (cfg["task"] != "row")
        return T.Measurement(cfg, conv.min_bytes(op) * 1e-3 * slow)

    monkeypatch.setattr(T, "_measure", fake)
    target, cpu = B.make_target("cpu"), torch.device("cpu")
    first, second = DepthwiseConv(2, 32, 12, 12, padding=1), DepthwiseConv(4, 64, 8, 8, padding=1)

    def good(r):
        return sum(m.config["cache"] == 1 and m.config["unroll"] == 1 and m.config["task"] == "row"
                   for m in r.measurements)

    history = T.History()
    T.tune(first, "fwd", target, cpu, trials=24, batch=8, layout="NHWC", history=history)
    key = T.History.key(B.space(first, "fwd", target, "NHWC"), "fwd")
    assert len(history.get(key)[1]) == 24
    guided = T.tune(second, "fwd", target, cpu, trials=8, batch=8, layout="NHWC", history=history, seed=1)
    cold = T.tune(second, "fwd", target, cpu, trials=8, batch=8, layout="NHWC", seed=1)
    assert good(guided) >= 6 > good(cold)  # one batch: 1 in 8 configs is in the fast region
    assert len(history.get(key)[1]) == 32
