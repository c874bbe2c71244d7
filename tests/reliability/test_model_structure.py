"""Model-structure contracts: every use of a reused module runs, and models pipedp cannot cut say why.

Issue item 1: a module object used at several places (a reused ReLU, Dropout
or BatchNorm, tied Linear weights, a residual block used twice in a ResNet
layer) runs at each of them, sharing the one object, and training equals
plain PyTorch (fp32, <= 1e-5), also when its uses fall in different stages.
Issue item 9 (model part): a batch whose output is NaN/inf is named as such,
and a model returning a tuple trains on one stage, as the error advises.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipedp
from pipedp.models import resnet18

from .. import multiproc
from ..reference import clone, data, plain_steps, sequential_cnn

TOL = 1e-5


def _engine(model: nn.Module, **kw) -> pipedp.Engine:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kw.setdefault("loss_fn", nn.CrossEntropyLoss())
    return pipedp.wrap(model, optimizer=opt, profile=False, progress=False, **kw)


def _state_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest difference over every state_dict entry, integer counters (num_batches_tracked) included."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def _train_both(model: nn.Module, batches, *, microbatches: int, **kw) -> tuple[nn.Module, nn.Module]:
    """(pipelined, plain) copies of ``model`` after training on ``batches`` from the same RNG state."""
    ref = clone(model)
    keys = list(model.state_dict())
    torch.manual_seed(1)
    engine = _engine(model, microbatches=microbatches, **kw)
    for x, y in batches:
        engine.train_step(x, y)
    assert list(engine.module.state_dict()) == keys  # names unchanged
    torch.manual_seed(1)
    plain_steps(ref, batches, microbatches=microbatches)
    return model, ref


def _reused(shared: nn.Module) -> nn.Sequential:
    """conv, shared, conv, shared, ...: blocks '1' and '3' are the same object."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), shared, nn.Conv2d(4, 4, 3, padding=1), shared,
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10),
    )


@pytest.mark.parametrize("shared", [nn.ReLU(), nn.Dropout(0.0)], ids=["relu", "dropout"])
def test_a_reused_module_runs_at_every_use_and_trains_exactly(shared):
    """Item 1: a reused ReLU/Dropout object is one block per use (uses in two stages), training equals plain."""
    model = _reused(shared)
    engine = _engine(model, microbatches=2, stages=[2, 5], sample=(4, 3, 8, 8))
    blocks = [n for st in engine.executor.stages for n in st.names]
    assert blocks == ["0", "1", "2", "3", "4", "5", "6"]
    assert engine.executor.stages[0].chain.parts[1] is engine.executor.stages[1].chain.parts[1] is shared
    pipelined, plain = _train_both(_reused(shared), data(n=8, size=8, steps=2), microbatches=2, stages=[2, 5])
    assert _state_diff(pipelined, plain) <= TOL


def test_a_reused_dropout_draws_as_plain_training_with_one_microbatch():
    """Item 1: a reused Dropout(0.5) split over two stages draws the same masks as plain training."""
    batches = data(n=6, size=8, steps=2)
    pipelined, plain = _train_both(_reused(nn.Dropout(0.5)), batches, microbatches=1, stages=[2, 5])
    assert _state_diff(pipelined, plain) <= TOL


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    return nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("stages", [[2, 3], [1, 2, 2]], ids=["two-stages", "three-stages"])
def test_a_tied_linear_split_over_stages_trains_exactly(stages):
    """Item 1: one nn.Linear used twice (tied weights), its uses in different stages, equals plain training."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    pipelined, plain = _train_both(_tied(), batches, microbatches=2, stages=stages)
    assert _state_diff(pipelined, plain) <= TOL


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [[2, 5], [2, 2, 3]], ids=["two-stages", "three-stages"])
def test_a_reused_batchnorm_updates_its_statistics_once_per_use_in_plain_order(stages, schedule):
    """Item 1: a BatchNorm used twice, in different stages: running stats and counter equal plain training."""
    batches = data(n=9, size=8, steps=2)
    pipelined, plain = _train_both(_reused(nn.BatchNorm2d(4)), batches, microbatches=3, stages=stages,
                                   schedule=schedule)
    assert pipelined[1].num_batches_tracked.item() == 2 * 2 * 3  # steps x uses x microbatches
    assert _state_diff(pipelined, plain) <= TOL


def _full_batch_statistics(model: nn.Sequential, batches, microbatches: int) -> dict[str, torch.Tensor]:
    """Running stats of model[1] (used at 1 and 3) after one update per use from each step's whole batch.

    Plain training with the same microbatches gives the parameters and each
    use's inputs; each use then updates once from all of its inputs at once,
    through BatchNorm's own kernel.
    """
    bn = model[1]
    inputs: list[torch.Tensor] = []
    hook = bn.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach()))
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    for x, y in batches:
        inputs.clear()
        plain_steps(model, [(x, y)], microbatches=microbatches)
        for use in (0, 1):  # plain order: use 0, use 1 of microbatch 0, then of microbatch 1, ...
            F.batch_norm(torch.cat(inputs[use::2]), stats[0], stats[1], training=True, momentum=bn.momentum)
            stats[2].add_(1)
    hook.remove()
    return {"running_mean": stats[0], "running_var": stats[1], "num_batches_tracked": stats[2]}


def test_a_reused_batchnorm_in_batch_mode_commits_one_whole_batch_update_per_use():
    """Item 1: batchnorm="batch" with a BatchNorm used twice: one full-batch update per use and step."""
    batches = data(n=8, size=8, steps=2)
    model = _reused(nn.BatchNorm2d(4))
    expected = _full_batch_statistics(clone(model), batches, microbatches=2)
    engine = _engine(model, microbatches=2, stages=[2, 5], batchnorm="batch")
    for x, y in batches:
        engine.train_step(x, y)
    for name, value in expected.items():
        assert torch.allclose(getattr(model[1], name).double(), value.double(), atol=TOL), name


def test_a_residual_block_used_twice_in_a_resnet_layer_trains_exactly():
    """Item 1: a torchvision-style ResNet whose layer1 holds one BasicBlock twice, uses in two stages."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        net = resnet18(width=4)
        net.layer1 = nn.Sequential(net.layer1[0], net.layer1[0])
        return net

    engine = _engine(model(), microbatches=2, stages=[5, 10], sample=(4, 3, 16, 16))
    assert engine.executor.stages[0].names[-1] == "layer1.0" and engine.executor.stages[1].names[0] == "layer1.1"
    pipelined, plain = _train_both(model(), data(n=8, size=16, steps=2), microbatches=2, stages=[5, 10])
    assert _state_diff(pipelined, plain) <= TOL


def test_a_non_finite_first_batch_is_reported_as_such():
    """Item 9: NaN/inf on the planning batch is named (with where it comes from), not "not the chain of its blocks"."""
    x, y = data(n=4, size=8, steps=1)[0]
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"not finite .*batch itself holds NaN/inf.*sample=") as e:
        _engine(sequential_cnn(), microbatches=2, stages=2).train_step(x, y)
    assert "not the chain" not in str(e.value)

    class Overflow(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * 1e38 * 1e38

    model = nn.Sequential(nn.Conv2d(3, 4, 3), Overflow(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    with pytest.raises(ValueError, match=r"not finite .*first appear in the output of block '1'"):
        _engine(model, microbatches=2, stages=2, sample=(4, 3, 8, 8))


class WithAux(nn.Module):
    """A forward returning (logits, auxiliary logits), as GoogLeNet/Inception do in training."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head, self.aux = nn.Linear(4, 10), nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), self.aux(h)


def _aux_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0], y) + 0.4 * F.cross_entropy(out[1], y)


def test_a_tuple_returning_model_trains_on_the_one_stage_the_error_advises():
    """Item 9: a model returning a tuple is told to use stages=1 when a cut was asked for, trains as one stage
    when none was (stages="auto"), and stages=1 trains and infers exactly."""
    batches = data(n=8, size=8, steps=2)
    with pytest.raises(ValueError, match=r"returns tuple.*stages=1"):
        _engine(WithAux(), loss_fn=_aux_loss, microbatches=2, stages=2, sample=(4, 3, 8, 8))
    # Not asked for a cut (stages="auto"): one stage, and the plan says why.
    auto = _engine(WithAux(), loss_fn=_aux_loss, microbatches=2, sample=(4, 3, 8, 8))
    assert len(auto.executor.stages) == 1
    assert auto.plan.notes[0].startswith("stages=auto: one stage (cannot cut WithAux: its forward returns tuple")
    torch.manual_seed(0)
    model = WithAux()
    ref = clone(model)
    engine = _engine(model, loss_fn=_aux_loss, microbatches=2, stages=1)
    for x, y in batches:
        engine.train_step(x, y)
    plain_steps(ref, batches, microbatches=2, loss_fn=_aux_loss)
    assert _state_diff(model, ref) <= TOL
    x = batches[0][0]
    engine.eval()
    out, expected = engine(x), ref.eval()(x)
    assert isinstance(out, tuple) and all(torch.allclose(a, b, atol=TOL) for a, b in zip(out, expected))


def _tied_over_ranks(rank: int, world: int) -> list[str]:
    msgs = []
    for stages in ([2, 3], [3, 2]):  # uses of the tied Linear (blocks 0 and 2) on two ranks, then on one
        try:
            engine = _engine(_tied(), microbatches=2, stages=stages, pp=2)
            engine.train_step(torch.randn(4, 8), torch.randint(0, 3, (4,)))
            msgs.append("trained")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_a_module_used_on_two_pipeline_ranks_is_refused():
    """Item 1: a tied module whose uses fall on different pipeline ranks is refused on every rank, not drifted."""
    for msgs in multiproc.run(_tied_over_ranks, 2):
        assert "'0.weight' is used by blocks '0' (stage 0, pipeline rank 0), '2' (stage 1, pipeline rank 1)" in msgs[0]
        assert "pp=1" in msgs[0]
        assert msgs[1] == "trained"
