import pytest
import torch
from torch import nn

from pipedp.partition.blocks import Block, blocks_of
from pipedp.partition.parts import OneTensor, Parts, measurable, tensors_in


class _Dict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return {"logits": self.lin(x), "aux": (self.lin(x) * 2, torch.arange(3))}


def test_tensors_in_walks_tuples_lists_and_dicts():
    a, b, c = torch.ones(1), torch.zeros(2), torch.arange(3)
    assert tensors_in(a) == [a]
    assert tensors_in({"x": (a, [b]), "y": c, "n": None}) == [a, b, c]
    assert tensors_in("no tensor") == []


def test_a_lone_block_is_profiled_through_one_tensor_of_every_float_output():
    model = _Dict()
    (block,) = measurable([Block("model", model)])
    assert isinstance(block.module, OneTensor)
    out = block.module(torch.randn(4, 3))
    assert out.shape == (4 * 2 + 4 * 2,)  # the two float tensors, flat; the integer one left out
    out.sum().backward()
    assert model.lin.weight.grad is not None
    chain = blocks_of(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    assert measurable(chain) == chain  # several blocks: profiled as they are


def test_an_output_without_floats_has_nothing_to_train():
    class Ints(nn.Module):
        def forward(self, x):
            return (x.long(), {"n": x.shape[0]})

    with pytest.raises(ValueError, match="without a floating-point tensor"):
        OneTensor(Ints())(torch.randn(2, 3))


def test_parts_train_only_where_a_parameter_requires_grad():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    parts = Parts(blocks_of(model), [False, False])
    assert parts.trains
    model.requires_grad_(False)  # a frozen teacher: forward only
    assert not parts.trains
