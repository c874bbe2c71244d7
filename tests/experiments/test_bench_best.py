"""bench_best times what runs here, rates pipedp against the best of it and says why the rest is skipped."""

import json

import pytest
import torch

from experiments.baselines import accum_step, numerics, plain_step
from experiments.bench_best import main
from tests.reference import clone, data, max_diff, sequential_cnn

ALTERNATIVES = {"eager-nchw", "eager-cl", "accum2", "accum4"}  # what runs on a CPU under --no-compile


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick CPU run of two groups (fp32, bf16) on a tiny ResNet-18, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("bench_best")
    out, md = tmp / "best.json", tmp / "best.md"
    assert main(["--device", "cpu", "--quick", "--no-compile", "--models", "resnet18@16", "--batch", "8",
                 "--precision", "fp32,bf16", "--plan-budget", "5", "--compile-accum", "--out", str(out),
                 "--md", str(md)]) == 0
    return json.loads(out.read_text()), md.read_text()


def test_every_alternative_is_timed_and_the_rest_skipped_with_a_reason(quick_run):
    data_, _ = quick_run
    assert data_["machine"]["device"] == "cpu" and data_["torch"] == torch.__version__
    assert (data_["rounds"], data_["steps_per_window"], data_["width"], data_["compile"]) == (2, 1, 8, False)
    assert [(g["model"], g["batch"], g["precision"]) for g in data_["groups"]] == [
        ("resnet18@16/10", 8, "fp32"), ("resnet18@16/10", 8, "bf16")]
    for g in data_["groups"]:
        rows = g["rows"]
        assert ALTERNATIVES <= set(rows) and set(rows) <= ALTERNATIVES | {"pipedp", "pipedp-defaults"}
        assert "pipedp-defaults" in rows
        for name, row in rows.items():
            assert row["ms_per_step"] > 0 and len(row["windows_ms"]) == 2 and row["setup_s"] > 0, name
            assert row["spread_ms"] == [min(row["windows_ms"]), max(row["windows_ms"])]
            assert row["images_per_s"] == pytest.approx(8 * 1e3 / row["ms_per_step"])
        assert {"graph-nchw", "graph-cl", "graph+compile-nchw", "graph+compile-cl"} <= set(g["skipped"])
        assert "CUDA" in g["skipped"]["graph-cl"] and "--no-compile" in g["skipped"]["compile-nchw"]
        assert all("--no-compile" in g["skipped"][f"compile-accum{c}"] for c in (2, 4))
        assert "--threads" in g["skipped"]["pipedp-threads"]
        assert g["accum_layout"] in ("nchw", "cl") and set(g["eager_probe_ms"]) == {"eager-nchw", "eager-cl"}
        assert not g["errors"]


def test_ratios_come_from_the_medians_and_the_bar_excludes_pipedp(quick_run):
    for g in quick_run[0]["groups"]:
        rows = g["rows"]
        alternatives = {n: r for n, r in rows.items() if r["kind"] == "alternative"}
        assert set(alternatives) == ALTERNATIVES
        best = min(alternatives, key=lambda n: alternatives[n]["ms_per_step"])
        assert g["best_alternative"] == best and g["best_alternative_ms"] == rows[best]["ms_per_step"]
        same = min((n for n in alternatives if "accum" not in n), key=lambda n: alternatives[n]["ms_per_step"])
        assert g["best_same_math"] == same and "accum" not in same
        for name, row in rows.items():
            # a median of two windows is their mean
            assert row["ms_per_step"] == pytest.approx(sum(row["windows_ms"]) / 2)
            assert row["vs_best"] == pytest.approx(rows[best]["ms_per_step"] / row["ms_per_step"])
            assert row["vs_eager"] == pytest.approx(rows["eager-nchw"]["ms_per_step"] / row["ms_per_step"])
            assert row["vs_same_math"] == pytest.approx(rows[same]["ms_per_step"] / row["ms_per_step"])
            paired = sorted(b / w for b, w in zip(rows[best]["windows_ms"], row["windows_ms"]))
            assert row["vs_best_paired"] == pytest.approx(sum(paired) / 2)  # per round, then the median
        assert rows[best]["vs_best"] == 1.0 and all(r["vs_best"] <= 1.0 for r in alternatives.values())


def test_markdown_has_a_line_per_group(quick_run):
    data_, md = quick_run
    lines = [line for line in md.splitlines() if line.startswith("| resnet18")]
    assert len(lines) == len(data_["groups"]) == 2
    for line, g in zip(lines, data_["groups"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == ["resnet18@16/10", "8", g["precision"], g["best_alternative"]]
        assert cells[4] == f"{g['best_alternative_ms']:.1f}"
        assert cells[7] == f"{g['rows']['pipedp']['vs_best_paired']:.2f}"


def test_pipedp_row_reports_its_plan_and_planning_time(quick_run):
    for g in quick_run[0]["groups"]:
        assert "pipedp" not in g["errors"]
        row = g["rows"]["pipedp"]
        assert row["kind"] == "pipedp" and row["ms_per_step"] > 0
        assert 0 < row["planning_s"] < row["setup_s"]  # setup adds the warm-up steps
        assert row["planning_share_10min"] == pytest.approx(row["planning_s"] / 600)
        assert quick_run[0]["kernel_db"] is None and row["kernel_layers"] == 0  # no --kernel-db: torch's kernels
        plan = row["plan"]
        assert set(plan) >= {"channels_last", "compiled", "microbatches", "counts", "planning_s", "bar",
                             "trial_baseline_ms", "hint", "text"}
        assert plan["text"].startswith("pipedp plan:") and plan["compiled"] is False  # --no-compile
        assert isinstance(plan["microbatches"], int) and sum(plan["counts"]) > 0
        # The planner's own bar: the faster of the user's eager steps in the two layouts, timed beside its plans.
        assert plan["bar"] in ("plain", "plain channels_last") and plan["trial_baseline_ms"] > 0
        assert plan["channels_last"] in (True, False) and 0 < plan["planning_s"] <= row["planning_s"]


def test_kernel_db_runs_pipedp_on_its_tuned_kernels_and_none_runs_torchs(tmp_path, monkeypatch):
    import experiments.bench_best as bench_best

    asked, wrap = [], bench_best.pipedp.wrap

    def spy(model, **kw):
        asked.append((kw["kernels"], kw["kernel_db"]))
        return wrap(model, **kw)

    monkeypatch.setattr(bench_best.pipedp, "wrap", spy)
    db = tmp_path / "db"
    db.mkdir()  # a database with nothing tuned: every layer stays torch's, nothing fails
    quick = ["--device", "cpu", "--quick", "--no-compile", "--models", "mobilenet_v2@16", "--batch", "4",
             "--plan-budget", "2", "--rounds", "1"]
    assert main(quick + ["--kernel-db", str(db), "--out", str(tmp_path / "a.json")]) == 0
    assert main(quick + ["--out", str(tmp_path / "b.json")]) == 0
    assert asked == [("auto", str(db))] * 2 + [("torch", None)] * 2  # pipedp and pipedp-defaults
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert (a["kernel_db"], b["kernel_db"]) == (str(db), None)
    assert a["groups"][0]["rows"]["pipedp"]["kernel_layers"] == 0  # nothing exported for this CPU


def test_accumulation_over_two_chunks_is_full_batch_training():
    model = sequential_cnn()  # no BatchNorm: chunk statistics cannot differ from the batch's
    ref, init = clone(model), clone(model)
    (x, y), = data(n=8, steps=1)
    loss = accum_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), numerics("fp32"), 2)(x, y)
    ref_loss = plain_step(ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9), numerics("fp32"))(x, y)
    assert max_diff(model, ref) <= 1e-6 and max_diff(model, init) > 0
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)


def test_bad_input_is_one_line_and_status_1(capsys):
    assert main(["--device", "cpu", "--quick", "--precision", "fp8"]) == 1
    assert "unknown precision 'fp8'" in capsys.readouterr().err
    assert main(["--device", "cpu", "--quick", "--batch", "0"]) == 1
    assert "--batch must be a comma list of positive ints" in capsys.readouterr().err
