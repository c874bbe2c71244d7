"""bench_kernels_train end to end on a tiny model: tune, swap, alternate windows, compare losses."""

import json

import pytest

pytest.importorskip("tvm")
pytest.importorskip("xgboost")

from experiments import bench_kernels_train  # noqa: E402

from tests.model_files import DEPTHWISE_NET as MODEL  # noqa: E402


@pytest.mark.slow  # tens of seconds on 2 cores: the slow run (CI runs it) keeps the default suite short
def test_tunes_then_times_both_runs_on_the_same_batches(tmp_path, capsys):
    (tmp_path / "net.py").write_text(MODEL)
    out = tmp_path / "r.json"
    report = bench_kernels_train.main([
        "--model", f"{tmp_path / 'net.py'}:build", "--input-shape", "4,3,16,16", "--tune", "--trials", "1",
        "--kernels", "tvm", "--db", str(tmp_path / "db"), "--windows", "2", "--window", "2", "--allocator", "default",
        "--out", str(out)])
    assert report["depthwise_layers_swapped"] == 2
    assert len(report["step_s"]["plain"]) == len(report["step_s"]["kernels"]) == 2
    # warm-up window + 2 timed windows of 2 steps each, the same batches for both runs
    assert len(report["losses"]["plain"]) == len(report["losses"]["kernels"]) == 6
    assert report["grad_rel_diff"] < 1e-5  # one step from the same weights: rounding only
    assert report["max_loss_diff"] < 1e-3
    assert report["speedup"] > 0
    assert json.loads(out.read_text())["speedup"] == pytest.approx(report["speedup"])
    assert "speedup" in capsys.readouterr().out


def test_without_kernels_it_says_how_to_get_them(tmp_path):
    (tmp_path / "net.py").write_text(MODEL)
    with pytest.raises(SystemExit, match="--tune"):
        bench_kernels_train.main(["--model", f"{tmp_path / 'net.py'}:build", "--input-shape", "4,3,16,16",
                                  "--db", str(tmp_path / "empty"), "--allocator", "default"])


@pytest.mark.parametrize("shape", ["4,3,12", "a,b,c,d", "0,3,12,12"])
def test_bad_input_shape(tmp_path, shape):
    with pytest.raises(SystemExit, match="input-shape"):
        bench_kernels_train.main(["--input-shape", shape, "--db", str(tmp_path)])


@pytest.mark.slow  # (tunes both layouts)
def test_best_layout_runs_both_formats_with_and_without_kernels(tmp_path):
    (tmp_path / "net.py").write_text(MODEL)
    report = bench_kernels_train.main([
        "--model", f"{tmp_path / 'net.py'}:build", "--input-shape", "4,3,16,16", "--tune", "--trials", "1",
        "--kernels", "tvm", "--layout", "best", "--db", str(tmp_path / "db"), "--windows", "1", "--window", "1",
        "--allocator", "default"])
    med = report["median_step_s"]
    assert set(med) == {"plain nchw", "plain nhwc", "kernels nchw", "kernels nhwc"}
    assert report["swapped_by_layout"] == {"nchw": 2, "nhwc": 2}
    assert report["plain_best"] == min(("plain nchw", "plain nhwc"), key=med.get)
    assert report["speedup"] == pytest.approx(med[report["plain_best"]] / med[report["kernels_best"]])
    assert report["speedup_same_layout"]["nhwc"] == pytest.approx(med["plain nhwc"] / med["kernels nhwc"])
    assert report["grad_rel_diff"] < 1e-5 and all(len(v) == 2 for v in report["losses"].values())
