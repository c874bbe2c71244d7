import copy

import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline.batchnorm import DeferredBatchNorm, batchnorms_in_several, commit_stages, deferred_in


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


def _used_in_two_chains():
    """A BatchNorm used at 0 and 2 of a model cut into two chains (stages): [bn, linear] and [bn]."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    model = nn.Sequential(bn, nn.Linear(3, 3), bn)
    chains = [Chain([Block("0", bn), Block("1", model[1])]), Chain([Block("2", bn)])]
    return model, chains


def _pipelined(chains, xs):
    """Stage by stage, as a pipeline runs them: every microbatch through chain 0, then through chain 1."""
    with torch.no_grad():
        hs = [chains[0](x) for x in xs]
        return hs, [chains[1](h) for h in hs]


def test_uses_in_two_stages_commit_per_microbatch_updates_in_plain_order():
    model, chains = _used_in_two_chains()
    ref = copy.deepcopy(model)  # the copy keeps the sharing
    assert batchnorms_in_several(chains) == [model[0]]
    assert batchnorms_in_several([Chain([Block("m", model)])]) == []  # both uses in one stage
    deferred = DeferredBatchNorm(model, chains, per_microbatch=True, only=batchnorms_in_several(chains))
    xs = [torch.randn(5, 3) * 2 + 1 for _ in range(3)]
    deferred.begin()
    _, outs = _pipelined(chains, xs)
    assert model[0].num_batches_tracked.item() == 0  # nothing committed yet
    deferred.commit()
    with torch.no_grad():
        plain = [ref(x) for x in xs]  # per microbatch: use 0, then use 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outs, plain))
    for name in ("running_mean", "running_var"):
        assert torch.allclose(getattr(model[0], name), getattr(ref[0], name), atol=1e-6), name
    assert model[0].num_batches_tracked.item() == ref[0].num_batches_tracked.item() == 6


def test_batch_mode_commits_one_whole_batch_update_per_use():
    model, chains = _used_in_two_chains()
    deferred = DeferredBatchNorm(model, chains)
    xs = [torch.randn(5, 3) * 2 + 1 for _ in range(2)]
    deferred.begin()
    hs, _ = _pipelined(chains, xs)
    deferred.commit()
    rm, rv = torch.zeros(3), torch.ones(3)
    with torch.no_grad():
        for inputs in (xs, hs):  # use 0 sees the batch, use 2 the outputs of chain 0
            nn.functional.batch_norm(torch.cat(inputs), rm, rv, training=True, momentum=0.1)
    assert torch.allclose(model[0].running_mean, rm, atol=1e-6)
    assert torch.allclose(model[0].running_var, rv, atol=1e-6)
    assert model[0].num_batches_tracked.item() == 2


def test_bn_commit_applies_the_statistics_of_the_batchnorms_a_stage_is_the_last_to_use():
    model, chains = _used_in_two_chains()  # model[0] used by both chains
    own = nn.BatchNorm1d(3)
    third = Chain([Block("own", own)])
    chains = [*chains, third]
    assert deferred_in(chains, "microbatch") == [model[0]] and set(deferred_in(chains, "batch")) == {model[0], own}
    assert commit_stages(chains, "microbatch") == [1]  # the shared one completes with chain 1's last forward
    assert commit_stages(chains, "batch") == [1, 2]
    outer = nn.ModuleList([model, own])
    deferred = DeferredBatchNorm(outer, chains)
    xs = [torch.randn(5, 3) * 2 + 1 for _ in range(2)]
    deferred.begin()
    hs, _ = _pipelined(chains, xs)
    with torch.no_grad():
        for x in xs:
            third(x)
    deferred.commit_stage(0)  # chain 0 is not the last to use model[0]: nothing yet
    assert model[0].num_batches_tracked.item() == 0 and own.num_batches_tracked.item() == 0
    deferred.commit_stage(2)
    assert own.num_batches_tracked.item() == 1 and model[0].num_batches_tracked.item() == 0
    deferred.commit_stage(1)
    assert model[0].num_batches_tracked.item() == 2  # one whole-batch update per use
    before = model[0].running_mean.clone()
    deferred.commit()  # the end of the step: nothing left to apply
    assert torch.equal(model[0].running_mean, before) and own.num_batches_tracked.item() == 1

