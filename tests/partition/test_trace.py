import torch
import torch.nn.functional as F
from torch import nn

from pipedp.partition.blocks import blocks_of
from pipedp.partition.check import check_chain
from pipedp.partition.trace import leaf_reason, trace


class NormAct(nn.BatchNorm2d):
    """A norm-act layer as timm writes them: a BatchNorm2d subclass whose forward branches on the mode."""

    def forward(self, x):
        torch._assert(x.shape[1] == self.num_features, "channels")
        training = self.training or self.running_mean is None
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, training,
                                   self.momentum, self.eps))


class DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class SamePad(nn.Module):
    """Pads by the input's size in Python: fx cannot trace it (ints from proxies)."""

    def forward(self, x):
        h = int(x.shape[-1])
        pad = max(0, 3 - h % 3)
        return F.pad(x, (0, pad % 3, 0, pad % 3)) if pad % 3 else x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = NormAct(8)
        self.pad = SamePad()
        self.body = nn.Conv2d(8, 8, 3)
        self.drop = DropPath(0.0)
        self.head = nn.Linear(8, 5)

    def forward(self, x, mask=None, scale: float = 1.0):
        x = self.drop(self.body(self.pad(self.norm(self.stem(x)))))
        if mask is not None:
            x = x * mask
        return self.head(x.mean((2, 3))) * scale


def test_mode_dependent_subclassed_and_untraceable_modules_are_kept_whole():
    model = Net()
    assert leaf_reason(model.norm) == "a subclass of a torch.nn layer"
    assert leaf_reason(model.drop) == "its forward depends on train/eval mode"
    assert leaf_reason(model.pad) is None and leaf_reason(nn.Sequential()) is None
    traced = trace(model)  # the root's forward traces once SamePad (untraceable alone) is kept whole
    graph = traced.module.graph
    assert {"norm", "pad", "drop"} <= {n.target for n in graph.nodes if n.op == "call_module"}
    assert traced.kept_whole == {"norm": "a subclass of a torch.nn layer", "pad": "fx cannot trace it",
                                 "drop": "its forward depends on train/eval mode"}
    assert [n.name for n in graph.nodes if n.op == "placeholder"] == ["x"]  # mask, scale held at defaults


def test_a_model_with_such_modules_is_cut_and_its_blocks_compute_it_in_both_modes():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 3, 7, 7)
    blocks = blocks_of(model)
    assert len(blocks) >= 4
    check_chain(model, blocks, x)  # eval mode: the norm uses its running statistics in the blocks too
    model.train()
    y = x
    for b in blocks:
        y = b.module(y)
    torch.manual_seed(0)
    assert torch.allclose(y, model(x), atol=1e-6)
