"""The baselines train as plain PyTorch does, in the numerics they name; what needs CUDA says so."""

import pytest
import torch

from experiments.baselines import graphed_step, make_baseline, numerics, prepare, skip_reason
from tests.reference import clone, data, max_diff, plain_steps, sequential_cnn

CPU = torch.device("cpu")


def test_numerics_and_skip_reasons():
    assert numerics("fp32").autocast is None and numerics("fp32").precision == "fp32"
    bf = numerics("bf16cl")
    assert bf.autocast is torch.bfloat16 and bf.channels_last and bf.precision == "bf16"
    with pytest.raises(ValueError, match="unknown numerics 'fp8'"):
        numerics("fp8")
    assert skip_reason("eager", CPU) is None and "--compile-on-cpu" in skip_reason("compile", CPU)
    assert skip_reason("compile", CPU, compile_on_cpu=True) is None
    assert "CUDA" in skip_reason("graph", CPU) and "CUDA" in skip_reason("max-autotune", CPU, compile_on_cpu=True)
    assert skip_reason("graph", torch.device("cuda")) is None
    for kind in ("graph+compile", "graph+max-autotune"):  # whole-step capture of a compiled model
        assert "CUDA" in skip_reason(kind, CPU, compile_on_cpu=True) and skip_reason(kind, torch.device("cuda")) is None
    with pytest.raises(ValueError, match="unknown baseline 'fast'"):
        skip_reason("fast", CPU)


def test_eager_fp32_is_plain_training():
    model = sequential_cnn()
    ref = clone(model)
    batches = data(n=6)
    step = make_baseline("eager", numerics("fp32"), model, *batches[0])
    for x, y in batches:
        step(x, y)
    plain_steps(ref, batches, microbatches=1)
    # The same ops in the same order; the fp32 contract (1e-5) with room, not bit equality: a CPU
    # convolution's reduction order may differ between two calls (seen once at 1.1e-7 in a full run).
    assert max_diff(model, ref) <= 1e-6


def test_warm_up_steps_and_later_steps_are_one_run_of_plain_training():
    # What test_graphed_step_replays_the_eager_step (CUDA) compares, on CPU with the eager step: warm-up steps and the
    # steps after them share one optimizer, so the reference is one run. Two runs (a fresh optimizer after the
    # warm-up) drop the momentum: that reference was 0.077 off the graphed step on the H100.
    model = sequential_cnn()
    ref, restarted = clone(model), clone(model)
    batches = data(n=8, steps=5)
    step = make_baseline("eager", numerics("fp32"), model, *batches[0])
    for x, y in [batches[0]] * 3 + batches:
        step(x, y)
    plain_steps(ref, [batches[0]] * 3 + batches, microbatches=1)
    assert max_diff(model, ref) <= 1e-6
    plain_steps(restarted, [batches[0]] * 3, microbatches=1)
    plain_steps(restarted, batches, microbatches=1)
    assert max_diff(model, restarted) > 1e-2


def test_bf16cl_runs_convolutions_in_bf16_on_channels_last_weights():
    model, x = prepare(sequential_cnn(), torch.randn(4, 3, 8, 8), numerics("bf16cl"))
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    before = clone(model)
    loss = make_baseline("eager", numerics("bf16cl"), model, x, torch.zeros(4, dtype=torch.long))(
        x, torch.zeros(4, dtype=torch.long))
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32 and max_diff(model, before) > 0
    assert model[0].weight.dtype == torch.float32  # parameters stay fp32 under autocast


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_step_replays_the_eager_step():
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    cuda = torch.device("cuda")
    model = sequential_cnn().to(cuda)
    ref = clone(model)
    batches = [(x.to(cuda), y.to(cuda)) for x, y in data(n=8, steps=5)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, _ = graphed_step(model, opt, numerics("fp32"), *batches[0])
    for x, y in batches:
        step(x, y)
    # The graph's warm-up ran 3 eager steps on the first batch with the same optimizer: the reference does the same
    # in one run, so that its momentum carries on from the warm-up into the steps, as the graph's does.
    plain_steps(ref, [batches[0]] * 3 + batches, microbatches=1)
    assert max_diff(model, ref) <= 1e-5
