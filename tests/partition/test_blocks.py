import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipedp
from pipedp.models import resnet18, resnet50
from pipedp.partition import Chain, blocks_of, check_chain
from pipedp.partition.blocks import traced_points
from tests.reference import TwoPaths, sequential_cnn


def run_chain(blocks, x):
    with torch.no_grad():
        return Chain(blocks).eval()(x)


def test_sequential_children_are_blocks():
    model = sequential_cnn()
    blocks = blocks_of(model)
    assert [b.name for b in blocks] == [str(i) for i in range(len(model))]
    assert all(b.module is m for b, m in zip(blocks, model))


def test_nested_sequential_expands_with_depth():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    assert [b.name for b in blocks_of(model)] == ["0", "1"]
    assert [b.name for b in blocks_of(model, depth=2)] == ["0.0", "0.1", "1"]


def test_resnet_blocks_follow_torchvision_layout():
    model = resnet18(width=8)
    names = [b.name for b in blocks_of(model)]
    assert names[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert names[4:12] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert names[12:] == ["avgpool", "flatten", "fc"]
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    assert torch.allclose(run_chain(blocks_of(model), x), model(x))
    assert len(blocks_of(resnet50(width=4))) == 4 + 16 + 3


def test_blocks_share_the_models_parameters():
    model = resnet18(width=8)
    ids = {id(p) for b in blocks_of(model) for p in b.module.parameters()}
    assert ids == {id(p) for p in model.parameters()}


class FunctionalNet(nn.Module):
    """Not a Sequential: fx must find the chain."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.res = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x = F.relu(self.conv(x))
        x = x + self.res(x)  # a residual: no cut between res and add
        x = x * self.scale
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def test_fx_chain_cuts_where_one_tensor_is_live():
    model = FunctionalNet()
    blocks = blocks_of(model)
    names = [b.name for b in blocks]
    assert names[0] == "conv" and "res..add" in names and names[-1] == "fc"
    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(run_chain(blocks, x), model(x))
    ids = {id(p) for b in blocks for p in b.module.parameters()}
    assert ids == {id(p) for p in model.parameters()}
    assert check_chain(model, blocks, x) == [False] * len(blocks)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return x


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return y, x


class DenseSkips(nn.Module):
    """Every point between nodes has the input and the running value live."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x) + x
        return self.b(y) * x


class ShapeKept(nn.Module):
    """A shape read at the start is live to the end: no cut can pass a number."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[0]
        return self.b(self.a(x).relu()).reshape(n, -1)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, z):
        return self.a(x) + z


@pytest.mark.parametrize(
    "model, match",
    [
        (DataDependent(), r"torch.fx could not trace .*control flow"),
        (TwoOutputs(), r"returns tuple .*not a single tensor"),
        (ShapeKept(), r"a value that is not a tensor is live \(at best after node '\w+': (getattr|getitem)\w*\)"),
        (TwoInputs(), r"takes 2 inputs \(x, z\)"),
        (nn.Sequential(), r"empty"),
    ],
)
def test_uncuttable_models_get_a_clear_error(model, match):
    with pytest.raises(ValueError, match=match) as e:
        blocks_of(model)
    if not isinstance(model, nn.Sequential):
        assert "nn.Sequential" in str(e.value) and "stages=1" in str(e.value)


class LooksLikeResNet(nn.Module):
    """Has ResNet's attributes but a different forward: check_chain must notice."""

    def __init__(self):
        super().__init__()
        base = resnet18(width=4)
        for n, m in base.named_children():
            setattr(self, n, m)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1)) * 2.0


def test_check_chain_catches_a_different_forward():
    model = LooksLikeResNet()
    blocks = blocks_of(model)
    with pytest.raises(ValueError, match=r"forward is not the chain of its blocks .*nn.Sequential"):
        check_chain(model, blocks, torch.randn(2, 3, 8, 8))


def test_check_chain_rejects_block_outputs_that_cannot_pass_a_boundary():
    class Named(nn.Module):
        def forward(self, x):
            return {"x": x}

    class Pair(nn.Module):
        def forward(self, x):
            return x, x * 2

    class Join(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    model = nn.Sequential(nn.Linear(4, 4), Named(), nn.Identity())
    with pytest.raises(ValueError, match=r"block '1' .*returns dict, not a tensor or a tuple of tensors"):
        check_chain(model, blocks_of(model), torch.randn(2, 4))
    passing = nn.Sequential(nn.Linear(4, 4), Pair(), Join())
    assert check_chain(passing, blocks_of(passing), torch.randn(2, 4)) == [False, False, False]  # a tuple passes


def test_check_chain_flags_blocks_that_modify_their_input():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.ReLU(inplace=True), nn.Linear(4, 2))
    flags = check_chain(model, blocks_of(model), torch.randn(3, 4))
    assert flags == [False, True, True, False]
    # The model's training flags are restored afterwards.
    assert model.training


def test_a_reused_module_is_a_block_at_every_use():
    act = nn.ReLU()
    inner = nn.Sequential(nn.Linear(4, 4), act)
    model = nn.Sequential(inner, act, inner, nn.Linear(4, 2))
    keys = list(model.state_dict())
    assert [b.name for b in blocks_of(model)] == ["0", "1", "2", "3"]
    blocks = blocks_of(model, depth=2)
    assert [b.name for b in blocks] == ["0.0", "0.1", "1", "2.0", "2.1", "3"]
    assert blocks[0].module is blocks[3].module is inner[0]
    assert blocks[1].module is blocks[2].module is blocks[4].module is act
    x = torch.randn(3, 4)
    assert check_chain(model, blocks, x) == [False] * 6
    assert list(model.state_dict()) == keys  # nothing copied or re-registered


def test_a_residual_block_reused_in_a_resnet_layer_is_a_block_at_every_use():
    model = resnet18(width=4)
    model.layer1 = nn.Sequential(model.layer1[0], model.layer1[0])
    blocks = {b.name: b.module for b in blocks_of(model)}
    assert blocks["layer1.0"] is blocks["layer1.1"] is model.layer1[0]
    check_chain(model, blocks_of(model), torch.randn(2, 3, 8, 8))


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for negative inputs


def test_check_chain_names_a_non_finite_output_and_where_it_starts():
    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 2))
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"not finite .*first appear in the output of block '1'.*sample=") as e:
        check_chain(model, blocks_of(model), torch.randn(8, 4))
    assert "not the chain" not in str(e.value)
    x = torch.randn(8, 4)
    x[3, 1] = float("inf")
    model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"not finite .*the batch itself holds NaN/inf"):
        check_chain(model, blocks_of(model), x)


class ResNetWithFeatures(LooksLikeResNet):
    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        feats = torch.flatten(self.avgpool(x), 1)
        return self.fc(feats), feats


def test_a_short_forward_with_two_tensors_live_everywhere_gets_a_tuple_cut():
    model = DenseSkips()
    blocks = blocks_of(model)
    assert len(blocks) == 2
    x = torch.randn(3, 4)
    between = blocks[0].module(x)
    assert isinstance(between, tuple) and len(between) == 2  # the input and the running value
    check_chain(model, blocks, x)
    assert torch.allclose(blocks[1].module(between), model(x))


def test_check_chain_sends_a_model_returning_a_tuple_to_one_stage():
    model = ResNetWithFeatures()
    with pytest.raises(ValueError, match=r"forward returns tuple, not a single tensor.*use stages=1") as e:
        check_chain(model, blocks_of(model), torch.randn(2, 3, 8, 8))
    assert "not the chain" not in str(e.value)


class ChunkNet(nn.Module):
    """Splits its activations and joins them again, as ShuffleNet, MixNet and CSP blocks do."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left, self.right = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.head = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        a, b = self.stem(x).chunk(2, dim=1)
        parts = torch.split(self.head(torch.cat((self.left(a), self.right(b)), 1)), [3, 5], dim=1)
        return torch.cat((parts[0].relu(), parts[1].sigmoid()), 1).mean((2, 3))


def test_no_cut_passes_a_tuple_of_pieces_the_cut_falls_where_they_are_joined():
    model = ChunkNet()
    blocks = blocks_of(model)
    assert len(blocks) >= 3 and not any(b.name.endswith("chunk") or b.name.endswith("split") for b in blocks)
    check_chain(model, blocks, torch.randn(2, 3, 8, 8))


def test_a_block_handing_its_input_on_to_one_that_modifies_it_is_flagged_too():
    # Identity then an in-place ReLU: a stage starting at the Identity gets its input modified by the ReLU.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Identity(), nn.ReLU(inplace=True), nn.Flatten(),
                          nn.ReLU(inplace=True), nn.Linear(4 * 6 * 6, 2))
    assert check_chain(model, blocks_of(model), torch.randn(2, 3, 8, 8)) == [False, True, True, True, True, False]


def test_a_long_stretch_without_a_one_tensor_point_is_cut_where_several_tensors_are_live():
    model = TwoPaths()
    blocks = blocks_of(model)
    x = torch.randn(2, 3, 8, 8)
    outs, y = [], x
    for b in blocks:
        y = b.module(y)
        outs.append(y)
    tuples = [o for o in outs if isinstance(o, tuple)]
    assert tuples and all(len(t) == 2 for t in tuples)  # the two branches
    assert len(blocks) >= 4  # the 30-node stretch in pieces of at most SPAN nodes (or just past it)
    check_chain(model, blocks, x)


def test_a_cut_point_is_never_placed_where_a_number_is_live():
    model = ShapeKept()
    traced, points = traced_points(model)
    assert points and not any(p.cut for p in points)


def test_a_model_with_lazy_layers_not_yet_made_is_refused_with_the_fix():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(10))
    with pytest.raises(ValueError, match=r"lazy layers .*2\.weight.*run one forward pass first"):
        pipedp.wrap(model, optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
                    loss_fn=nn.CrossEntropyLoss(), progress=False)
    model(torch.randn(2, 3, 8, 8))  # made: then it trains
    engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                         progress=False, profile=False, microbatches=1)
    engine.train_step(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
