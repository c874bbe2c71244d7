import pytest
import torch
from torch import nn

from pipedp.partition import blocks_of, estimate_blocks, profile_blocks
from pipedp.partition.blocks import Block
from pipedp.snapshot import preserved_state
from tests.reference import sequential_cnn


def test_profile_measures_every_block_and_leaves_the_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Dropout(0.5), nn.Flatten(), nn.Linear(8 * 16, 4))
    blocks = blocks_of(model)
    x = torch.randn(4, 3, 4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with preserved_state(model):
        profs = profile_blocks(blocks, x, warmup=1, repeats=3, progress=False)
    assert [p.name for p in profs] == ["0", "1", "2", "3", "4"]
    assert all(p.forward_ms > 0 for p in profs)
    assert profs[0].backward_ms > 0  # weight grads of the first conv
    assert profs[0].output_bytes == 4 * 8 * 4 * 4 * 4
    assert profs[4].param_bytes == (8 * 16 * 4 + 4) * 4
    assert profs[0].saved_bytes >= x.numel() * 4  # the conv keeps its input
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_cost_model_orders_blocks_by_work():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 64, 3, padding=1), nn.ReLU())
    profs = estimate_blocks(blocks_of(model), torch.randn(2, 3, 16, 16))
    assert profs[1].cost_ms > profs[0].cost_ms > 0
    assert profs[1].backward_ms == 2 * profs[1].forward_ms
    assert sum(p.cost_ms for p in estimate_blocks(blocks_of(sequential_cnn()), torch.randn(2, 3, 8, 8))) > 0


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return x, self.lin(x)


class _Join(nn.Module):
    def forward(self, pair):
        return pair[0] * pair[1]


class _Named(nn.Module):
    def forward(self, x):
        return {"x": x}


def test_blocks_passing_a_tuple_are_timed_and_sized_and_a_dict_is_a_clear_error():
    profiles = profile_blocks([Block("pair", _Pair()), Block("join", _Join())], torch.randn(4, 3), progress=False,
                              warmup=0, repeats=1)
    assert profiles[0].output_bytes == 2 * 4 * 3 * 4  # both tensors of the tuple
    assert profiles[1].backward_ms > 0  # gradients flow back into both
    estimated = estimate_blocks([Block("pair", _Pair()), Block("join", _Join())], torch.randn(4, 3))
    assert estimated[0].output_bytes == 96
    with pytest.raises(ValueError, match="block 'named' returns dict, not a tensor or a tuple of tensors"):
        profile_blocks([Block("named", _Named())], torch.randn(2, 3), progress=False)
