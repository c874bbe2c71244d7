"""The single-process communicator: a world of one where every collective is the identity."""

import torch
from torch import nn

from pipedp.comm import Local, communicator
from pipedp.options import DataParallelOptions


def test_without_a_process_group_the_communicator_is_local():
    comm = communicator(DataParallelOptions())
    assert isinstance(comm, Local) and comm.layout is None and (comm.pp, comm.rank, comm.world) == (1, 0, 1)
    assert comm.describe() == ""
    assert isinstance(communicator(DataParallelOptions(enabled=False)), Local)


def test_local_collectives_are_the_identity(tmp_path):
    comm = Local()
    loss = torch.tensor(1.5)
    assert comm.share_loss(loss, torch.device("cpu"), 0) is loss
    assert comm.decide(lambda: [3]) == [3]
    assert comm.stage_ranks([0, 0]) is None and comm.transport(torch.device("cpu"), 0) is None
    assert comm.grad_sync([]) is None and comm.failure_note(3) == ""
    assert comm.rng_states({"a": 1}) == [{"a": 1}]
    assert comm.writes_files() and comm.own_path(str(tmp_path / "t.json")) == str(tmp_path / "t.json")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state, optim = comm.model_state(model, [], opt)
    assert set(state) == {"weight", "bias"} and optim == opt.state_dict()
