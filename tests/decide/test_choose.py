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
