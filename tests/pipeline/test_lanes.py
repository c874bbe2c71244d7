"""This rank's lanes (pipedp/pipeline/lanes.py): where each action runs, the side lanes, moves between devices."""

import pytest
import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline.lanes import RankLanes
from pipedp.pipeline.ranks import Op
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import Lane, new_lane

CPU = torch.device("cpu")


def test_a_device_without_its_index_is_the_same_device_as_its_tensors():
    # torch.device("cuda") != torch.device("cuda", 0), but a CUDA tensor always reports its index. Stages declared on
    # "cuda" once sent their own inputs through the copy lanes, which exist only across devices: KeyError (H100 run
    # of test_auto_on_one_gpu_times_real_trials_beside_the_plain_step). The logic needs no GPU: stand-in lanes.
    from pipedp.device import canonical_device

    cuda0 = canonical_device("cuda")
    assert cuda0.type == "cuda" and cuda0.index is not None and canonical_device("cuda:1").index == 1
    assert canonical_device("cpu") == torch.device("cpu")
    lanes = [Lane(torch.device("cuda"), None, "L0"), Lane(cuda0, None, "L1")]
    assert lanes[0].device == cuda0
    st = [Stage(i, Chain([Block(str(i), nn.Identity())]), d, lanes[i])
          for i, d in enumerate([torch.device("cuda"), cuda0])]
    assert [s.device for s in st] == [cuda0, cuda0]
    rank = RankLanes({s.index: s for s in st})
    assert rank.devices == [cuda0] and rank.copy == {}
    t = torch.ones(2)  # stands for a tensor on cuda0
    assert rank.move(t, None, cuda0, lanes[0]) is t
    assert rank.move(t, None, torch.device("cuda"), lanes[1]) is t


def _stages(n):
    return {i: Stage(i, Chain([Block(str(i), nn.Identity())]), CPU, new_lane(CPU, f"stage{i}")) for i in range(n)}


def test_w_runs_on_its_stages_side_lane_where_there_is_one_and_everything_else_on_the_stage():
    stages = _stages(2)
    plain, side = RankLanes(stages), RankLanes(stages, side_weights=True)
    for op in (Op("F", 1, 0), Op("I", 1, 0), Op("W", 1, 0), Op("B", 0, 1)):
        assert plain.of(op) is stages[op.stage].lane
        assert side.of(op) is (side.weights[1] if op.kind == "W" else stages[op.stage].lane)
    assert plain.side == [] and plain.of_stage(0) == []
    assert [lane.name for lane in side.side] == ["wgrad0", "wgrad1"] and side.of_stage(1) == [side.weights[1]]


def test_a_lane_installed_later_joins_the_stages_side_lanes_and_the_anchors_exist_only_where_held():
    stages = _stages(1)
    rank = RankLanes(stages, held=True)
    extra = new_lane(CPU, "branch0")
    rank.extra.setdefault(0, []).append(extra)
    assert rank.side == [extra] and rank.of_stage(0) == [extra]
    leaf = rank.anchor(CPU)
    assert leaf.requires_grad and leaf.numel() == 0 and rank.anchor(torch.device("cpu")) is leaf
    with pytest.raises(KeyError):  # a rank without split backwards holds no weight gradients: no anchors
        RankLanes(stages).anchor(CPU)
