import torch
from torch import nn

from pipedp.pipeline.batchnorm import DeferredBatchNorm


def test_commit_equals_one_full_batch_update_and_outputs_are_unchanged():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    ref = nn.BatchNorm2d(3)
    x = torch.randn(10, 3, 4, 4) * 3 + 1
    deferred = DeferredBatchNorm(bn)
    assert len(deferred) == 1
    deferred.begin()
    outs = [bn(part) for part in x.split([4, 3, 3])]
    assert torch.equal(bn.running_mean, torch.zeros(3))  # nothing committed yet
    deferred.commit()
    ref(x)
    assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, ref.running_var, atol=1e-6)
    assert bn.num_batches_tracked.item() == 1
    # Each microbatch is still normalised with its own statistics.
    assert torch.allclose(outs[0], nn.functional.batch_norm(x[:4], None, None, training=True), atol=1e-6)


def test_inactive_outside_a_step_and_abort_restores_buffers():
    bn = nn.BatchNorm1d(2)
    deferred = DeferredBatchNorm(bn)
    bn(torch.randn(5, 2))  # not in a step: ordinary BatchNorm
    assert bn.num_batches_tracked.item() == 1
    before = bn.running_mean.clone(), bn.running_mean
    deferred.begin()
    bn._forward_hooks.clear()  # simulate a forward that failed before its after-hook
    bn(torch.randn(5, 2))
    deferred.abort()
    assert bn.running_mean is before[1] and torch.equal(bn.running_mean, before[0])
    deferred.remove()
    assert not bn._forward_pre_hooks
