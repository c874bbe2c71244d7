import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipedp
from pipedp.partition.blocks import CutError, blocks_of
from pipedp.partition.modes import ModeBlock, differing
from pipedp.partition.trace import trace


class HeadDropout(nn.Module):
    """The root's forward reads self.training as an argument (timm's forward_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU())
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x).mean((2, 3))
        return self.fc(F.dropout(x, p=0.5, training=self.training))


class BranchesOnMode(nn.Module):
    """The root's forward takes another path in train mode: no one graph serves both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.training:
            x = x * 0.5
        return self.b(torch.relu(x))


def test_a_mode_read_as_an_argument_is_traced_in_both_modes_and_found_node_for_node():
    model = HeadDropout()
    traced = trace(model)
    assert traced.eval_module is not None and model.training
    where = differing(traced.module.graph, traced.eval_module.graph)
    nodes = list(traced.module.graph.nodes)
    assert where and {nodes[i].target for i in where} == {F.dropout}
    assert trace(nn.Sequential(nn.Linear(2, 2))).eval_module is None  # no mode read: one graph


def test_the_block_holding_the_mode_runs_the_graph_of_the_models_mode():
    torch.manual_seed(0)
    model = HeadDropout()
    blocks = blocks_of(model)
    switching = [b for b in blocks if isinstance(b.module, ModeBlock)]
    assert len(switching) == 1 and len(blocks) > 2
    x = torch.randn(8, 3, 8, 8)
    model.eval()
    y = x
    for b in blocks:
        y = b.module(y)
    torch.testing.assert_close(y, model(x))


def test_a_forward_that_branches_on_the_mode_is_kept_whole_with_that_reason():
    report = pipedp.inspect(BranchesOnMode(), torch.randn(4, 4))
    assert "other operations in eval mode than in train mode" in report.reason
    with pytest.raises(CutError, match="into a submodule"):
        blocks_of(BranchesOnMode())


def test_a_module_whose_helper_reads_the_mode_is_kept_whole():
    class Helper(nn.Module):
        def forward(self, x):
            return self._maybe_scale(x)

        def _maybe_scale(self, x):
            return x * 2 if self.training else x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.h = nn.Linear(3, 3), Helper()

        def forward(self, x):
            return self.h(self.lin(x))

    traced = trace(Net())
    assert traced.kept_whole == {"h": "its forward depends on train/eval mode"}
    assert traced.eval_module is None
