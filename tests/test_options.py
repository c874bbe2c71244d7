"""Option groups validate when made and carry what wrap()'s flat keywords say."""

import inspect

import pytest
import torch

import pipedp
from pipedp import DataParallelOptions, KernelOptions, PipelineOptions


@pytest.mark.parametrize("kw, match", [
    (dict(microbatches=0), "microbatches must be a positive int"),
    (dict(stages="many"), "stages must be an int, 'auto' or a list"),
    (dict(stages=0), "stages must be a positive int"),
    (dict(stages=True), "stages must be an int"),
    (dict(schedule="zigzag"), "unknown schedule 'zigzag'"),
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
    (dict(reduce_dtype=torch.int8), "reduce_dtype must be None, torch.bfloat16 or torch.float16"),
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


def test_groups_are_frozen_values_with_the_defaults():
    opts = PipelineOptions()
    with pytest.raises(AttributeError):
        opts.microbatches = 8  # type: ignore[misc]
    assert (opts.microbatches, opts.stages, opts.schedule, opts.batchnorm) == (4, "auto", "1f1b", "microbatch")
    assert DataParallelOptions().bucket_bytes == 25 * 2**20


def test_wrap_has_a_typed_signature_matching_the_groups():
    sig = inspect.signature(pipedp.wrap)
    params = sig.parameters
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values())
    assert all(p.annotation is not inspect.Parameter.empty for p in params.values())
    assert sig.return_annotation in ("Engine", pipedp.Engine)
    groups = {
        "pipeline": PipelineOptions(), "data_parallel": DataParallelOptions(), "kernels": KernelOptions(),
    }
    flat = {"enabled": "distributed", "mode": "kernels", "db": "kernel_db"}
    for name, group in groups.items():
        for field in group.__dataclass_fields__:
            key = flat.get(field, field)
            assert key in params, f"wrap() lacks {name}.{field} (as {key})"
            assert params[key].default == getattr(group, field), f"wrap()'s default for {key} differs"
