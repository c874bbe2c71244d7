import torch

from pipedp.decide.choose import COMPILE_S_PER_LEAF, _compile_estimate_s
from pipedp.models import resnet18


def test_the_compile_estimate_follows_the_device_that_builds_the_kernels():
    model = resnet18()  # 52 leaf modules
    cpu, cuda = _compile_estimate_s(model, torch.device("cpu")), _compile_estimate_s(model, torch.device("cuda"))
    assert cpu == COMPILE_S_PER_LEAF["cpu"] * 52
    # A GPU host's compile (12-22 s measured on the H100 host) must fit the default 30 s budget after the trials
    # (6-8 s there); at the CPU's rate it never did.
    assert cuda < 20 < cpu
    assert _compile_estimate_s(model, torch.device("meta")) == cpu  # another device: the conservative rate


def test_a_batchnorm_model_kept_at_one_microbatch_has_accumulation_timed_for_a_hint_only():
    from pipedp.decide.choose import _kept_whole
    from pipedp.options import PipelineOptions

    assert _kept_whole(PipelineOptions(), "bn1", 128) == 4
    assert _kept_whole(PipelineOptions(), "bn1", 4) == 2  # the count nearest 4 that the batch fits
    assert _kept_whole(PipelineOptions(), None, 128) is None  # no coupled layer: the trials may microbatch
    assert _kept_whole(PipelineOptions(microbatches=1), "bn1", 128) is None  # the user's own count
    assert _kept_whole(PipelineOptions(), "bn1", 2) is None  # nothing fits
