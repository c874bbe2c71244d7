"""build_gpu_kernels: one library of CUDA kernels in the rounds' format, tuned configs where records have them."""

import shutil

import pytest

pytest.importorskip("tvm")
if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc (the CUDA toolkit) to compile CUDA kernels", allow_module_level=True)

from experiments import build_gpu_kernels  # noqa: E402
from experiments.bench_depthwise_gpu import layers  # noqa: E402
from pipedp.kernels.tvm.defaults import default_config  # noqa: E402
from pipedp.ops import records as rec  # noqa: E402
from pipedp.ops.artifact import sha256  # noqa: E402
from pipedp.ops.measure import read_manifest  # noqa: E402


def test_builds_every_layout_of_a_problem_into_one_checked_library(tmp_path):
    (_, conv), *_ = layers(["mobilenet_v2"], [32], ["bfloat16"], batch=128)
    tuned = {"tile_c": 1, "vt_h": 1, "vt_w": 2, "th": 4, "tw": 8, "ih": 2, "iw": 1, "unroll": 0, "flat": 0}
    records = tmp_path / "records.jsonl"
    rec.append(records, {"kind": "measure", "op": "fwd", "problem": conv.key(), "target": "cuda:sm_90",
                         "layout": "NCHW", "config": tuned, "us": 10.0, "status": "ok"})
    out = tmp_path / "k"
    build_gpu_kernels.main(["--models", "mobilenet_v2", "--sizes", "32", "--dtypes", "bfloat16", "--ops", "fwd",
                            "--limit", "1", "--records", str(records), "--out", str(out)])
    manifest = read_manifest(str(out))
    assert manifest["target"] == "cuda:sm_90" and sha256(str(out / manifest["library"])) == manifest["sha256"]
    got = {c["layout"]: c for c in manifest["candidates"]}
    assert set(got) == {"NCHW", "NHWC"} and all(c["problem"]["dtype"] == "bfloat16" for c in got.values())
    assert got["NCHW"]["config"] == tuned  # the tuned config, where the records have one
    assert got["NHWC"]["config"] == default_config(conv, "fwd", "NHWC")
    assert b"sm_90" in (out / manifest["library"]).read_bytes()
