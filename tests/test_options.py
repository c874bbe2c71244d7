"""Option groups validate when made and carry what wrap()'s flat keywords say."""

import inspect

import pytest
import torch

import pipedp
from pipedp import options
from pipedp import ConcurrencyOptions, DataParallelOptions, KernelOptions, PipelineOptions, TrainingOptions


@pytest.mark.parametrize("kw, match", [
    (dict(microbatches=0), "microbatches must be a positive int"),
    (dict(microbatches="many"), r"microbatches must be a positive int, 'auto' or None \(your step's math\)"),
    (dict(microbatches="auto", stages=2), "microbatches='auto' lets stages='auto' choose"),
    (dict(stages="many"), "stages must be an int, 'auto' or a list"),
    (dict(stages=0), "stages must be a positive int"),
    (dict(stages=True), "stages must be an int"),
    (dict(schedule="zigzag"), "unknown schedule 'zigzag'"),
    (dict(schedule="interleaved", stages=2, threads=[1, 1]), "pass threads=None, or schedule='1f1b'"),
    (dict(schedule="zb-h1", stages=2, threads=[1, 1]), "pass threads=None, or schedule='1f1b'"),
    (dict(batchnorm="sync"), "batchnorm must be one of"),
    (dict(depth=0), "depth must be a positive int"),
    (dict(measure_steps=-1), "measure_steps must be an int >= 0"),
    (dict(cuda_graph="yes"), "cuda_graph must be True or False"),
])
def test_pipeline_options_reject(kw, match):
    with pytest.raises(ValueError, match=match):
        PipelineOptions(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(pp=0), "pp must be a positive int"),
    (dict(bucket_mb=0), "bucket_mb must be a positive number of MiB"),
    (dict(timeout=-1), "timeout must be a positive number of seconds"),
    (dict(reduce_dtype=torch.int8), "reduce_dtype must be None, torch.bfloat16, torch.float16 or 'auto'"),
    (dict(reduce_dtype="auto"), "pp=1 is fixed: pass pp='auto'"),
    (dict(enabled=1), "distributed must be True or False"),
])
def test_data_parallel_options_reject(kw, match):
    with pytest.raises(ValueError, match=match):
        DataParallelOptions(**kw)


def test_kernel_options():
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'torch', 'tvm'\)"):
        KernelOptions(mode="fast")
    with pytest.raises(ValueError, match="kernel_db must be a folder path"):
        KernelOptions(db=3)
    import pathlib

    assert KernelOptions(db=pathlib.Path("/tmp/k")).db == "/tmp/k"


@pytest.mark.parametrize("kw, match", [
    (dict(precision="bf16-mixed"), r"precision must be one of \('fp32', 'bf16', 'fp16'\), got 'bf16-mixed'"),
    (dict(precision=16), "precision must be one of"),
    (dict(channels_last=1), "channels_last must be True, False or 'auto'"),
    (dict(compile="yes"), "compile must be True, False or 'auto'"),
    (dict(clip_grad_norm=0), "clip_grad_norm must be a positive number"),
    (dict(clip_grad_norm=float("inf")), "clip_grad_norm must be a positive number"),
    (dict(recompute=[0, 0]), "recompute must be True, False or a list of distinct stage indices"),
    (dict(recompute=[-1]), "recompute must be True, False or a list of distinct stage indices"),
    (dict(recompute="all"), "recompute must be True, False or a list of distinct stage indices"),
    (dict(recompute=[True]), "recompute must be True, False or a list of distinct stage indices"),
])
def test_training_options_reject(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainingOptions(**kw)


def test_training_options_normalise_and_answer():
    opts = TrainingOptions(precision="bf16", clip_grad_norm=1, recompute=[2, 0])
    assert opts.clip_grad_norm == 1.0 and isinstance(opts.clip_grad_norm, float)
    assert opts.recompute == (0, 2) and hash(opts)  # a frozen value: usable as a key
    assert [opts.recomputes(s) for s in range(3)] == [True, False, True]
    assert opts.autocast_dtype is torch.bfloat16 and TrainingOptions(precision="fp16").autocast_dtype is torch.float16
    assert TrainingOptions().autocast_dtype is None and not TrainingOptions().recomputes(0)
    assert TrainingOptions(recompute=True).recomputes(7)


def test_wrap_passes_the_training_options_to_the_engine():
    engine = pipedp.wrap(torch.nn.Linear(2, 2), precision="fp16", channels_last=True, clip_grad_norm=2.0,
                         recompute=[0])
    assert engine.training_options == TrainingOptions(precision="fp16", channels_last=True, clip_grad_norm=2.0,
                                                      recompute=(0,))


def test_groups_are_frozen_values_with_the_defaults():
    opts = PipelineOptions()
    with pytest.raises(AttributeError):
        opts.microbatches = 8  # type: ignore[misc]
    assert (opts.microbatches, opts.stages, opts.schedule, opts.batchnorm) == (None, "auto", "1f1b", "microbatch")
    assert DataParallelOptions().bucket_bytes == 25 * 2**20


def test_wrap_has_a_typed_signature_matching_the_groups():
    sig = inspect.signature(pipedp.wrap)
    params = sig.parameters
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values())
    assert all(p.annotation is not inspect.Parameter.empty for p in params.values())
    assert sig.return_annotation in ("Engine", pipedp.Engine)
    groups = {
        "pipeline": PipelineOptions(), "data_parallel": DataParallelOptions(), "kernels": KernelOptions(),
        "training": TrainingOptions(), "concurrency": ConcurrencyOptions(),
    }
    flat = {"enabled": "distributed", "mode": "kernels", "db": "kernel_db"}
    for name, group in groups.items():
        for field in group.__dataclass_fields__:
            key = flat.get(field, field)
            assert key in params, f"wrap() lacks {name}.{field} (as {key})"
            assert params[key].default == getattr(group, field), f"wrap()'s default for {key} differs"

    engine_params = inspect.signature(pipedp.Engine).parameters
    assert all(name in engine_params for name in groups), "Engine() takes every group"


@pytest.mark.parametrize("name", ["branches", "split_grads", "early_update"])
def test_concurrency_options_are_flags_off_by_default(name):
    assert getattr(ConcurrencyOptions(), name) is False and not ConcurrencyOptions().any
    assert ConcurrencyOptions(**{name: True}).any
    with pytest.raises(ValueError, match=f"{name} must be True or False, got 1"):
        ConcurrencyOptions(**{name: 1})


def test_wrap_passes_the_concurrency_options_to_the_engine():
    engine = pipedp.wrap(torch.nn.Linear(2, 2), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         branches=True, split_grads=True, early_update=True)
    assert engine.concurrency_options == ConcurrencyOptions(branches=True, split_grads=True, early_update=True)


def test_schedule_auto_is_a_request_the_plan_resolves():
    assert PipelineOptions(schedule="auto").schedule == "auto"  # the request stays the user's
    assert PipelineOptions(schedule="auto", stages=2, threads=[1, 1]).threads == (1, 1)  # resolves to 1f1b there


def test_check_threads_errors():
    assert options.check_threads(None) is None and options.check_threads("auto") == "auto"
    assert options.check_threads([1, 1], stages=2, cores=2) == (1, 1)
    with pytest.raises(ValueError, match="one count per stage"):
        options.check_threads([1, 1], stages=3, cores=8)
    with pytest.raises(ValueError, match="sum to <= 2"):
        options.check_threads([2, 1], cores=2)
    with pytest.raises(ValueError, match="positive thread counts"):
        options.check_threads([0, 1], cores=8)
    with pytest.raises(ValueError, match="positive thread counts"):
        options.check_threads("many")
