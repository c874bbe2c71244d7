"""The measuring side of a remote round: the library checked, a wrong kernel or a crash recorded as failed, a run cut
short resumed, a round for another machine or a damaged file refused."""

import json
import os
import shutil

import pytest
import torch

from pipedp.ops import measure

from tests import faults

pytest.importorskip("tvm")
pytest.importorskip("xgboost")

FAST = dict(rounds=1, min_ms=1, log=lambda line: None)


@pytest.fixture(scope="module")
def round_dir(tmp_path_factory):
    """A built round: two forward candidates of a 3x3, stride 1, padding 1 problem (whose grad-input has the same
    shapes)."""
    from pipedp.kernels.tvm import remote
    from pipedp.kernels.tvm.ops import DepthwiseConv
    from pipedp.kernels.tvm.target import make_target

    root = tmp_path_factory.mktemp("round")
    conv = DepthwiseConv(2, 8, 12, 12, padding=1)
    remote.build_round(str(root / "round"), [(conv, "fwd", "NCHW")], make_target("cpu"), str(root / "records.jsonl"),
                       trials=2, batch=2)
    return root / "round"


def _copy(round_dir, tmp_path, edit=None):
    folder = tmp_path / "round"
    shutil.copytree(round_dir, folder)
    if edit is not None:
        manifest = json.loads((folder / measure.MANIFEST).read_text())
        edit(manifest)
        (folder / measure.MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_a_library_that_is_not_the_rounds_is_refused(round_dir, tmp_path):
    folder = _copy(round_dir, tmp_path)
    library = folder / measure.read_manifest(str(folder))["library"]
    with open(library, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="refusing to load .*: its sha256 .* is not the round's .*copy the round"):
        measure.measure_round(str(folder), **FAST)
    assert not (folder / measure.RESULTS).exists()


def test_a_wrong_kernel_is_recorded_as_failed_never_as_a_time(round_dir, tmp_path):
    def as_grad_input(manifest):  # the forward kernel, said to be the grad-input: same shapes, other numbers
        manifest["candidates"][0]["op"] = "dgrad"

    folder = _copy(round_dir, tmp_path, as_grad_input)
    results = measure.measure_round(str(folder), **FAST)
    wrong, right = results["results"]
    assert wrong["status"] == "wrong" and wrong["us"] is None and "differs from torch" in wrong["error"]
    assert right["status"] == "ok" and right["us"] > 0 and right["max_err"] <= 1e-5
    assert measure.read_results(str(folder / measure.RESULTS)) == results and results["complete"]


def test_a_crash_is_survived_and_a_second_run_measures_only_what_is_missing(round_dir, tmp_path, monkeypatch):
    folder = _copy(round_dir, tmp_path)
    monkeypatch.setenv(faults.FAULTS, str(tmp_path))  # the first candidate crashes its worker
    results = measure.measure_round(str(folder), job=faults.measure_candidate, **FAST)
    crashed, measured = results["results"]
    assert crashed["status"] == "crash" and "SIGSEGV" in crashed["error"] and measured["status"] == "ok"
    out = folder / measure.RESULTS
    cut = dict(results, results=[crashed], complete=False)  # as if the session ended after the first candidate
    out.write_text(json.dumps(cut))
    again = measure.measure_round(str(folder), **FAST)
    assert again["results"][0] == crashed and again["results"][1]["id"] == measured["id"] and again["complete"]


def test_a_round_for_another_machine_is_refused(round_dir, tmp_path):
    def for_gpu(manifest):
        manifest["target"] = "cuda:sm_90"

    def for_another_cpu(manifest):
        manifest["cpu_flags"] = ["avx_from_the_future"]

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="built for cuda:sm_90: run this where torch sees that GPU"):
            measure.measure_round(str(_copy(round_dir, tmp_path / "gpu", for_gpu)), **FAST)
    with pytest.raises(RuntimeError, match="use avx_from_the_future, which this CPU lacks"):
        measure.measure_round(str(_copy(round_dir, tmp_path / "cpu", for_another_cpu)), **FAST)


def test_a_damaged_manifest_or_results_file_is_a_clear_error(round_dir, tmp_path):
    def no_symbol(manifest):
        del manifest["candidates"][1]["symbol"]

    folder = _copy(round_dir, tmp_path, no_symbol)
    with pytest.raises(ValueError, match="round.json has a malformed candidate .*build the round again"):
        measure.measure_round(str(folder))
    with pytest.raises(ValueError, match="does not exist: build the round again with tune-kernels --remote-round"):
        measure.read_manifest(str(tmp_path))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"format": measure.RESULTS_FORMAT, "version": 99}))
    with pytest.raises(ValueError, match="is version 99, written by a newer pipedp .*: upgrade pipedp"):
        measure.read_results(str(results))
    results.write_text(json.dumps({"format": measure.RESULTS_FORMAT, "version": 1, "sha256": "0",
                                   "results": [{"id": 0, "status": "ok", "us": -1.0, "torch_us": {}}]}))
    with pytest.raises(ValueError, match="has a malformed result .*measure the round again"):
        measure.read_results(str(results))
    assert os.path.exists(folder / measure.MANIFEST)
