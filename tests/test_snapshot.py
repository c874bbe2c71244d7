"""Buffers, gradients and RNG streams put back as they were."""

import random

import numpy as np
import torch
from torch import nn

from pipedp import checkpoint
from pipedp.snapshot import BufferSnapshot, UpdateSnapshot, preserved_state, rng_state, set_rng_state


def _bn_model():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))


def test_buffer_snapshot_restores_after_each_save():
    model = _bn_model()
    snap = BufferSnapshot(model)
    snap.restore()  # nothing saved yet: a no-op
    snap.save()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(2, 3, 5, 5))  # training mode: running stats and the step counter move
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    snap.restore()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model(torch.randn(2, 3, 5, 5))
    snap.save()  # refreshed in place: the next restore goes back to this point
    later = model[1].running_mean.clone()
    model(torch.randn(2, 3, 5, 5))
    snap.restore()
    assert torch.equal(model[1].running_mean, later)


def test_preserved_state_puts_back_buffers_grads_and_rng():
    model = _bn_model()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    grad = model[0].weight.grad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with preserved_state(model):
        model(torch.randn(2, 3, 5, 5))  # moves BatchNorm's statistics and draws from the RNG
        model[0].weight.grad = None
        model[0].bias.grad = torch.zeros_like(model[0].bias)
    assert model[0].weight.grad is grad and model[0].bias.grad is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_rng_round_trip_through_a_data_only_file(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    checkpoint.save({"rng": rng_state()}, tmp_path / "r.pt")
    first = (torch.rand(3), random.random(), np.random.rand(3))
    set_rng_state(checkpoint.load(tmp_path / "r.pt")["rng"])
    again = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and np.array_equal(first[2], again[2])


def test_update_snapshot_reuses_its_copies_and_restores_values_keys_and_groups():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snap = UpdateSnapshot(opt)
    snap.save()  # no state yet
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    snap.restore()  # the state the step created is dropped, the parameters put back
    assert len(opt.state) == 0
    opt.step()
    weight, momentum = model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"]
    snap.save()
    copies = [t.data_ptr() for t in snap.tensors.saved.values()]
    snap.save()
    assert [t.data_ptr() for t in snap.tensors.saved.values()] == copies  # no new allocations step to step
    kept = momentum.clone()
    opt.step()
    opt.state[model.weight]["added"] = 1
    opt.param_groups[0]["lr"] = 5.0
    snap.restore()
    assert torch.equal(model.weight, weight) and torch.equal(opt.state[model.weight]["momentum_buffer"], kept)
    assert opt.state[model.weight]["momentum_buffer"] is momentum  # restored in place, same tensor
    assert "added" not in opt.state[model.weight] and opt.param_groups[0]["lr"] == 0.1


def test_update_snapshot_follows_parameters_that_change_dtype_or_shape_in_place():
    # model.double() keeps the parameter objects and gives them new data: the copies follow, not the old dtype.
    # Plain SGD keeps no tensor state, so nothing but the parameters' own dtype and shape tells the save.
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = UpdateSnapshot(opt)
    snap.save()
    model.double()
    with torch.no_grad():
        model.weight.add_(1e-12)  # a change only a float64 copy keeps
    before = model.weight.detach().clone()
    snap.save()
    assert all(t.dtype == torch.float64 for t in snap.tensors.saved.values())
    with torch.no_grad():
        model.weight.mul_(3.0)
    snap.restore()
    assert torch.equal(model.weight, before)
    model.weight.data = torch.zeros(5, 3, dtype=torch.float64)  # another shape, same object
    snap.save()
    with torch.no_grad():
        model.weight.fill_(1.0)
    snap.restore()
    assert torch.equal(model.weight, torch.zeros(5, 3, dtype=torch.float64))


def test_update_snapshot_copies_follow_a_change_of_memory_format_then_are_reused():
    # model.to(memory_format=channels_last) keeps the parameter objects and restrides them: the copy is made
    # anew in the new strides once (else every later save would regroup), then reused step after step.
    model = nn.Conv2d(3, 4, 3)
    snap = UpdateSnapshot(torch.optim.SGD(model.parameters(), lr=0.1))
    snap.save()
    model.to(memory_format=torch.channels_last)
    snap.save()
    copy, pairs = snap.tensors.saved[0, ""], snap.tensors.pairs
    assert copy.stride() == model.weight.stride() != torch.empty(4, 3, 3, 3).stride()
    with torch.no_grad():
        model.weight.add_(1.0)
    snap.save()
    assert snap.tensors.pairs is pairs and snap.tensors.saved[0, ""] is copy and torch.equal(copy, model.weight)


def test_update_snapshot_copies_state_that_can_change_in_place():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight] = {"history": [1, 2], "count": 3}
    opt.param_groups[0]["betas"] = (0.9, 0.99)
    opt.param_groups[0]["schedule"] = {"warmup": 5}
    snap = UpdateSnapshot(opt)
    snap.save()
    opt.state[model.weight]["history"].append(3)
    opt.state[model.weight]["count"] = 4
    opt.param_groups[0]["schedule"]["warmup"] = 0
    snap.restore()
    assert opt.state[model.weight] == {"history": [1, 2], "count": 3}
    assert opt.param_groups[0]["schedule"] == {"warmup": 5} and opt.param_groups[0]["betas"] == (0.9, 0.99)
    snap.restore()  # restoring twice gives the same values, not objects the first restore handed out
    opt.state[model.weight]["history"].append(9)
    snap.restore()
    assert opt.state[model.weight]["history"] == [1, 2]
