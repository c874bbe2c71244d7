import torch
from torch import nn

from pipedp.decide.coupling import batch_coupled, contract, kept_note, resolve_microbatches
from pipedp.options import DEFAULT_MICROBATCHES

from ..reference import bn_cnn, sequential_cnn


def test_a_batchnorm_that_trains_couples_the_batch_and_one_frozen_in_eval_mode_does_not():
    x = torch.randn(4, 3, 8, 8)
    assert batch_coupled(bn_cnn(), x) == "'1' calls batch_norm over the batch"
    assert batch_coupled(sequential_cnn(), x) is None
    frozen = bn_cnn()
    for m in frozen.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()  # frozen statistics, as detection backbones keep them: per-sample at train time
    assert batch_coupled(frozen, x) is None
    model = bn_cnn().eval()
    assert batch_coupled(model, x) == "'1' calls batch_norm over the batch"  # left in eval mode: its BatchNorms train
    assert not any(m.training for m in model.modules())  # and it is left in eval mode
    assert batch_coupled(nn.Sequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4)), x) is None
    assert batch_coupled(nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4)), x) == (
        "'1' calls batch_norm over the batch")


def test_none_keeps_the_math_and_a_request_is_taken_as_given():
    assert resolve_microbatches(None, "auto", "bn") == 1
    assert resolve_microbatches(None, 2, "bn") == 1
    assert resolve_microbatches(None, "auto", None) == "auto"
    assert resolve_microbatches(None, 2, None) == DEFAULT_MICROBATCHES
    assert resolve_microbatches(4, "auto", "bn") == 4
    assert resolve_microbatches("auto", "auto", "bn") == "auto"


def test_the_contract_names_what_changes():
    assert contract(1, "bn") == "the same math as your step"
    assert contract(4, None).startswith("the same math as your step (accumulation over 4 microbatches")
    assert contract(4, "'layer1.0.bn1' calls batch_norm over the batch") == (
        "accumulation over 4 microbatches, which can change the math of your step: 'layer1.0.bn1' calls batch_norm "
        "over the batch")


def test_a_pipeline_kept_at_one_microbatch_says_how_to_overlap_it():
    (note,) = kept_note(None, 2, "bn")
    assert "microbatches=N or 'auto'" in note and "one after another" in note
    assert kept_note(None, [3, 4], "bn") and not kept_note(None, [7], "bn")
    assert kept_note(4, 2, "bn") == kept_note(None, "auto", "bn") == kept_note(None, 2, None) == []
    assert kept_note(None, "auto", "bn", ranks=2)  # pipeline ranks are a pipeline the user asked for too
