"""The single-process communicator: a world of one where every collective is the identity."""

import torch
from torch import nn

from pipedp.comm import Local, communicator
from pipedp.options import DataParallelOptions, PipelineOptions
from pipedp.state import mismatch_message, model_signature


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


def _signature(model, optimizer=None, **settings):
    return model_signature(model, optimizer, {"microbatches": 4, **settings})


def _mlp(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def test_a_single_process_has_no_other_rank_to_compare_with():
    assert Local().check_same_model(_mlp(), None, PipelineOptions()) is None


def test_equal_models_have_equal_signatures():
    a, b = _mlp(), _mlp()  # different values: ranks may load a checkpoint after wrap()
    sigs = [_signature(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (a, b)]
    assert sigs[0] == sigs[1] and mismatch_message(sigs) is None


def _first_difference(other, model=None, optimizer=None) -> str:
    """The message for ranks 0 and 1 holding ``model`` and rank 2 holding ``other``."""
    model = model if model is not None else _mlp()
    msg = mismatch_message([_signature(model, optimizer), _signature(model, optimizer), other])
    assert msg is not None and msg.startswith("the ranks do not hold the same model: rank(s) [2] differ from rank 0")
    return msg


def test_what_ranks_must_share_and_the_first_difference_named():
    frozen = _mlp()
    frozen[0].weight.requires_grad_(False)
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    cases = {  # rank 2's signature -> what the message must name
        "parameter '0.weight' is shape (16, 8), torch.float32, trainable on rank 0 but shape (12, 8)":
            _signature(_mlp(12)),
        "torch.float64": _signature(_mlp().double()),
        "parameter '0.weight' is shape (16, 8), torch.float32, trainable on rank 0 but shape (16, 8), "
        "torch.float32, frozen on rank 2": _signature(frozen),
        "module '1' is ReLU() on rank 0 but Tanh() on rank 2":
            _signature(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))),
        "option 'microbatches' is 4 on rank 0 but 2 on rank 2": _signature(_mlp(), microbatches=2),
        "rank 2 has option 'bucket_bytes' (1024) where rank 0 has none": _signature(_mlp(), bucket_bytes=1024),
    }
    for expected, other in cases.items():
        assert expected in _first_difference(other), expected
    untied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert "parameter '1.weight' is the same tensor as '0.weight' on rank 0 but shape (4, 4)" in _first_difference(
        _signature(untied), tied)
    model = _mlp()
    msg = _first_difference(_signature(model, torch.optim.SGD(model.parameters(), lr=0.2)), model,
                            torch.optim.SGD(model.parameters(), lr=0.1))
    assert "optimizer 'param_groups[0]'" in msg and "lr=0.1" in msg and "lr=0.2" in msg
