"""The bench_links plot: one line per configuration and model, placed on log axes by rate and step time."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest

from experiments.links_plot import main, merge, points, svg

NS = "{http://www.w3.org/2000/svg}"


def _report() -> dict:
    def run(rate, ddp, dp, pipes, delay=0.0):
        ms = {"ddp": ddp, "pipedp-dp": dp, **{f"pipedp-pp2x{m}": v for m, v in pipes.items()}, "pp-auto": min(
            ddp, dp, *pipes.values())}
        return {"rate_mbit": rate, "delay_ms": delay, "results": [{"model": "resnet18", "ms": ms},
                                                                  {"model": "vgg11_bn", "ms": dict(ms)}]}

    return {"machine": {"cpu": "test", "cpu_cores": 2}, "settings": {"batch": 64},
            "runs": [run(None, 100, 101, {2: 150, 4: 140}), run(100, 900, 880, {2: 300, 4: 250}),
                     run(1000, 200, 190, {2: 180, 4: 185}), run(100, 5000, 5000, {2: 900}, delay=1.0)]}


def test_points_take_the_fastest_pipeline_in_rate_order_at_one_delay():
    data = points(_report())
    assert set(data) == {"resnet18", "vgg11_bn"}
    assert data["resnet18"]["pipeline"] == [(100, 250), (1000, 180), (math.inf, 140)]
    assert data["resnet18"]["ddp"] == [(100, 900), (1000, 200), (math.inf, 100)]  # the 1 ms run is left out


def test_the_svg_draws_each_series_on_log_axes():
    root = ET.fromstring(svg(_report(), "t"))
    lines = root.findall(f"{NS}polyline")
    assert len(lines) == 2 * 4  # ddp, pipedp-dp, pipeline, pp-auto per model
    ddp = next(ln for ln in lines if ln.get("data-series") == "ddp")
    xy = [tuple(map(float, p.split(","))) for p in ddp.get("points").split()]
    assert xy[0][0] < xy[1][0] < xy[2][0]  # rising rates left to right, unlimited last
    assert xy[0][1] < xy[1][1] < xy[2][1]  # slower steps higher up: 900 > 200 > 100 ms
    # log axes: unlimited sits at 3x the fastest rate, so 1000 -> "3000" spans log(3) / log(10) of 100 -> 1000
    assert (xy[2][0] - xy[1][0]) / (xy[1][0] - xy[0][0]) == pytest.approx(math.log(3) / math.log(10), rel=1e-3)
    assert (math.log(900) - math.log(200)) / (math.log(200) - math.log(100)) == pytest.approx(
        (xy[1][1] - xy[0][1]) / (xy[2][1] - xy[1][1]), rel=1e-2)  # coordinates at 0.1 px


def test_the_command_writes_the_figure(tmp_path):
    src, out = tmp_path / "links.json", tmp_path / "links.svg"
    src.write_text(json.dumps(_report()))
    assert main([str(src), "--out", str(out)]) == 0
    assert ET.parse(out).getroot().tag == f"{NS}svg" and "2 cores" in out.read_text()


def test_a_later_report_replaces_an_earlier_ones_run_at_the_same_rate():
    old, new = _report(), _report()
    new["runs"] = [new["runs"][1]]
    new["runs"][0]["results"][0]["ms"]["ddp"] = 777
    merged = merge([old, new])
    assert len(merged["runs"]) == 4 and dict(points(merged)["resnet18"]["ddp"])[100] == 777
