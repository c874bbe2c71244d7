import torch

from pipedp.pipeline.stream import current_lane, new_lane


def test_cpu_lanes_are_in_order_stand_ins():
    lane = new_lane(torch.device("cpu"), "stage0")
    assert not lane.is_cuda and lane.stream is None
    assert lane.record() is None
    lane.wait(None)
    lane.wait_lane(current_lane(torch.device("cpu")))
    t = torch.ones(2)
    lane.keep(t)
    with lane.use() as same:
        assert same is lane
    assert "stage0" in repr(lane)
