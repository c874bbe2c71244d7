"""The committed layout benchmark, re-predicted from its own profiles and links.

The JSON holds each run's profile, measured links and measured steps; the
layout model is re-run on them here: every prediction must come out as
recorded (the results page's figures are this code's), and the ResNet-18 runs, the
reproduction the results page states, must stay within the 15% goal with the
fastest layout chosen. The other misses are recorded on docs/results.md
(the data-parallel step on a shared 2-core host is slower than its profile).
"""

import glob
import json
import os

import pytest

from pipedp.decide.layout import BlockCosts, Layout, predict
from pipedp.decide.links import Link
from pipedp.partition.profile import BlockProfile

RESULTS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results",
                                        "layouts_cpu_*.json")))


# The runs whose ResNet-18 rows docs/results.md states within 15%; two pp="auto" runs (same VM, other hours)
# measured ResNet-18 22% and 24-33% slower than predicted, which the page records as misses.
STATED = {"layouts_cpu_epyc_2026-11-27_b64.json", "layouts_cpu_epyc_2026-11-27_b128.json",
          "layouts_cpu_epyc_2026-11-27c_auto_b64.json", "layouts_cpu_epyc_2026-11-27e_auto_b64.json"}


def test_the_results_are_there():
    assert RESULTS, "experiments/results/layouts_cpu_*.json: the committed runs this test re-predicts"


def _runs():
    for path in RESULTS:
        with open(path) as f:
            for run in json.load(f)["results"]:
                yield os.path.basename(path), run


@pytest.mark.parametrize("name,run", list(_runs()), ids=lambda v: v if isinstance(v, str) else v["model"])
def test_the_forecast_reproduces_a_measured_run(name, run):
    p = run["profile"]
    costs = BlockCosts(tuple(BlockProfile(**b) for b in p["blocks"]), p["batch"],
                       tuple(BlockProfile(**b) for b in p["small"]), p["small_batch"])
    link, p2p = Link(**run["allreduce_link"]), Link(**run["p2p_link"])
    predicted = {}
    for row in run["rows"]:
        lay = Layout(row["dp"], tuple(row["counts"]), row["microbatches"])
        predicted[row["layout"]] = predict(costs, lay, run["global_batch"], link, p2p=p2p, update_ms=p["update_ms"],
                                           bucket_bytes=run["bucket_mb"] * 2**20).step_ms
        assert predicted[row["layout"]] == pytest.approx(row["predicted_ms"], rel=1e-9)
    if run["model"] != "resnet18" or name not in STATED:
        return
    for row in run["rows"]:
        assert abs(predicted[row["layout"]] / row["measured_ms"] - 1) <= 0.15
    # The layout the forecast picks is the fastest measured, or within 2% of it.
    chosen = min(predicted, key=predicted.get)
    fastest = min(run["rows"], key=lambda r: r["measured_ms"])["measured_ms"]
    assert next(r for r in run["rows"] if r["layout"] == chosen)["measured_ms"] <= fastest * 1.02
