"""The committed layout benchmark, re-predicted from its own profiles and links.

The JSON holds each run's profile, measured links and measured steps; the
layout model is re-run on them here (:mod:`experiments.repredict_layouts`):
every prediction must come out as the committed re-prediction records (the
results page quotes it; its older tables give the predictions recorded with
each run, before the fit changed), and the ResNet-18 runs, the
reproduction the results page states, must stay within the 15% goal with
the fastest layout chosen. The other misses are recorded on docs/results.md
(the data-parallel step on a shared 2-core host is slower than its profile).
"""

import glob
import json
import os

import pytest

from experiments.repredict_layouts import report

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results")
RESULTS = sorted(glob.glob(os.path.join(HERE, "layouts_cpu*.json")))
REPREDICTED = os.path.join(HERE, "layouts_repredicted_2026-11-29.json")


# The runs whose ResNet-18 rows docs/results.md states within 15%; two pp="auto" runs (same VM, other hours)
# measured ResNet-18 22% and 24-33% slower than predicted, which the page records as misses.
STATED = {"layouts_cpu_epyc_2026-11-27_b64.json", "layouts_cpu_epyc_2026-11-27_b128.json",
          "layouts_cpu_epyc_2026-11-27c_auto_b64.json", "layouts_cpu_epyc_2026-11-27e_auto_b64.json",
          "layouts_cpu_epyc_2026-11-28a_auto_b64.json"}


def test_the_results_are_there():
    assert RESULTS, "experiments/results/layouts_cpu_*.json: the committed runs this test re-predicts"


def test_the_committed_re_prediction_is_this_codes():
    with open(REPREDICTED) as f:
        committed = json.load(f)
    now = report(RESULTS)
    assert [(r["file"], r["model"]) for r in committed["runs"]] == [(r["file"], r["model"]) for r in now["runs"]]
    for old, new in zip(committed["runs"], now["runs"]):
        for a, b in zip(old["rows"], new["rows"], strict=True):
            assert a["layout"] == b["layout"] and a["predicted_ms"] == pytest.approx(b["predicted_ms"], rel=1e-9)
    assert committed["current"] == pytest.approx(now["current"])


def _stated():
    return [run for run in report(RESULTS)["runs"] if run["model"] == "resnet18" and run["file"] in STATED]


@pytest.mark.parametrize("run", _stated(), ids=lambda run: run["file"])
def test_the_forecast_reproduces_a_measured_run(run):
    predicted = {r["layout"]: r["predicted_ms"] for r in run["rows"]}
    for row in run["rows"]:
        assert abs(row["error"]) <= 0.15
    # The layout the forecast picks is the fastest measured, or within 2% of it.
    chosen = min(predicted, key=predicted.get)
    fastest = min(r["measured_ms"] for r in run["rows"])
    assert next(r for r in run["rows"] if r["layout"] == chosen)["measured_ms"] <= fastest * 1.02
