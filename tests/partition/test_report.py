import torch
from torch import nn

import pipedp
from pipedp.models import resnet18

from .test_blocks import ChunkNet
from .test_trace import Net


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y.mean((2, 3)), y.amax((2, 3))


def test_inspect_lists_blocks_leaves_and_where_no_cut_can_pass():
    report = pipedp.inspect(ChunkNet(), (2, 3, 8, 8))
    assert report.structure == "fx graph" and report.reason is None and len(report.blocks) >= 3
    # Between the chunk and the join the tuple of pieces is live, taken apart later: no cut point there.
    assert any("chunk" in b and "not a tensor: chunk" in b for b in report.blocked), report.blocked
    text = str(report)
    assert text.startswith(f"ChunkNet (fx graph): {len(report.blocks)} blocks") and "no cut: " in text
    net = pipedp.inspect(Net(), torch.randn(2, 3, 7, 7))
    assert dict(net.kept_whole) == {"norm": "a subclass of a torch.nn layer", "pad": "fx cannot trace it",
                                    "drop": "its forward depends on train/eval mode"}
    assert "kept whole (fx cannot trace it): pad" in str(net)


def test_inspect_says_why_a_model_is_not_cut_and_changes_nothing():
    model = TwoOut()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = pipedp.inspect(model, (2, 3, 8, 8))
    assert report.blocks == () and "returns tuple" in report.reason
    assert str(report).startswith("TwoOut (fx graph): not cut: cannot cut TwoOut: its forward returns tuple")
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    res = pipedp.inspect(resnet18(width=4), (2, 3, 16, 16))
    assert res.structure == "ResNet layout" and res.blocks[:3] == ("conv1", "bn1", "relu") and not res.blocked
