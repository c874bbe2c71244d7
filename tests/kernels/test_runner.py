"""Candidates built and measured in a worker process: a crash or a hang is a failed candidate, the search goes on."""

import math

import pytest

pytest.importorskip("tvm")
pytest.importorskip("xgboost")
import torch  # noqa: E402

from pipedp.kernels.tvm import tuner as T  # noqa: E402
from pipedp.kernels.tvm.isolated import DeferredBuilder, ProcessRunner  # noqa: E402
from pipedp.kernels.tvm.ops import DepthwiseConv  # noqa: E402
from pipedp.kernels.tvm.space import InvalidConfig  # noqa: E402
from pipedp.kernels.tvm.target import make_target  # noqa: E402

from tests import faults  # noqa: E402

CONV = DepthwiseConv(2, 8, 12, 12, padding=1)


def test_a_candidate_that_crashes_or_hangs_is_a_failed_measurement_and_the_search_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.FAULTS, str(tmp_path))  # the first candidate crashes, the second hangs
    told = []
    with ProcessRunner(timeout=2, job=faults.synthetic) as runner:
        r = T.tune(CONV, "fwd", make_target("cpu"), torch.device("cpu"), trials=6, batch=3, builder=DeferredBuilder(),
                   runner=runner, on_measure=lambda m, _: told.append(m.status))
    assert told == [m.status for m in r.measurements] == ["crash", "timeout", "ok", "ok", "ok", "ok"]
    crashed, hung = r.measurements[:2]
    assert "SIGSEGV" in crashed.error and "time limit of 2 s" in hung.error
    assert not math.isfinite(crashed.us) and not math.isfinite(hung.us)
    assert r.best.us == min(1.0 + m.config["tile_w"] for m in r.measurements[2:])
    assert runner.worker.starts == 3  # a fresh worker after each


def test_an_invalid_config_is_refused_before_any_worker_starts():
    with ProcessRunner() as runner:
        with pytest.raises(InvalidConfig, match="tile_w=5 is not one of"):
            DeferredBuilder().build(CONV, "fwd", {"tile_h": 4, "tile_w": 5, "pad": "tile", "cache": 1, "unroll": 1},
                                    make_target("cpu"))
        assert runner.worker.starts == 0
