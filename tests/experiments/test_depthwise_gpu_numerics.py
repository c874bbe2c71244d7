"""The prebuilt CUDA kernels against torch on the GPU: every kernel of the benchmark's library, at odd batch sizes.

Runs where torch sees a GPU and the library of ``experiments/build_gpu_kernels.py`` is carried
(``.gpu/kernels``, or ``PIPEDP_GPU_KERNELS``); needs torch and the TVM runtime only, no compiler.
It covers what the CUDA templates generate for these problems: NCHW tiles with virtual threads, the flat
mapping of small planes, NHWC vector loads, split grad-weight sums, fp32 and bf16. The batch sizes (1 and 3)
are not the one the configs were validated at (64): a kernel serves any batch size, including fewer samples
than grad-weight has splits.
"""

import os

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FOLDER = os.environ.get("PIPEDP_GPU_KERNELS", ".gpu/kernels")


@pytest.fixture(scope="module")
def library():
    from experiments.bench_depthwise_gpu import Library

    if not os.path.exists(os.path.join(FOLDER, "round.json")):
        pytest.skip(f"no kernel library in {FOLDER}: build one with python -m experiments.build_gpu_kernels")
    return Library(FOLDER, torch.device("cuda"))


@pytest.mark.parametrize("n", [1, 3])
def test_every_prebuilt_kernel_matches_torch(library, n):
    import dataclasses

    from experiments.bench_depthwise_gpu import compare
    from pipedp.ops.problem import DepthwiseConv

    wrong, checked = [], 0
    for entry in library.manifest["candidates"]:
        conv = dataclasses.replace(DepthwiseConv.from_key(entry["problem"]), n=n)
        kernel, _ = library.kernel(conv, entry["op"], entry["layout"])
        err, limit = compare(kernel, conv, entry["op"], entry["layout"], torch.device("cuda"), seed=n)
        checked += 1
        if not err <= limit:
            wrong.append(f"{entry['layout']} {entry['op']} {conv} {entry['config']}: error {err:.3g} > {limit:.3g}")
    torch.cuda.synchronize()
    assert checked == len(library.manifest["candidates"]) > 0
    assert not wrong, f"{len(wrong)} of {checked} kernels differ from torch:\n" + "\n".join(wrong[:10])


@pytest.fixture
def fp32_exact():
    """No TF32 in torch's own convolutions and matmuls (it would round the layers around ours to 10 bits)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
def test_a_mobilenet_step_on_every_kernel_matches_torch(library, tmp_path, channels_last, fp32_exact):
    # The runtime op (autograd, either layout) with the library's kernels in all 17 depthwise layers.
    import copy
    import shutil

    from pipedp.models import mobilenet_v2
    from pipedp.ops import records as rec
    from pipedp.ops.problem import DepthwiseConv
    from pipedp.ops.swap import swap_depthwise

    db = tmp_path / "db"
    db.mkdir()
    shutil.copyfile(library.path, db / library.manifest["library"])
    kernels = {rec.layer_key(c["op"], DepthwiseConv.from_key(c["problem"]).key(), library.target, c["layout"]):
               c["symbol"] for c in library.manifest["candidates"]}
    rec.append(db / rec.RECORDS_FILE, {"kind": "export", "target": library.target, "kernels": kernels,
                                       "library": library.manifest["library"], "sha256": library.manifest["sha256"],
                                       "cpu_flags": []})
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    torch.manual_seed(0)
    plain = mobilenet_v2(cifar=True).cuda().to(memory_format=fmt)
    tuned = copy.deepcopy(plain)
    assert swap_depthwise(tuned, "tvm", str(db), torch.device("cuda")).count == 17
    x = torch.randn(6, 3, 32, 32, device="cuda").contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (6,), device="cuda")
    grads = []
    for m in (plain, tuned):
        torch.nn.functional.cross_entropy(m(x), y).backward()
        grads.append([p.grad for p in m.parameters()])
    scale = max(g.abs().max().item() for g in grads[0])
    diff = max((a - b).abs().max().item() for a, b in zip(*grads))
    assert diff <= 1e-4 * scale
