"""StepGraph's bookkeeping on CPU (capture itself is covered by tests/test_cuda.py)."""

import pytest
import torch

from pipedp.pipeline.graphed import StepGraph, hyper_signature


def test_hyper_signature_follows_scalar_hyper_parameters():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    a = hyper_signature(opt)
    opt.param_groups[0]["lr"] = 0.05
    assert hyper_signature(opt) != a
    opt.param_groups[0]["lr"] = 0.1
    assert hyper_signature(opt) == a


def test_capture_is_due_after_warmup_steps_with_one_signature():
    g = StepGraph(lambda x, y: x.sum(), warmup=2)
    x, y, h = torch.zeros(4, 3), torch.zeros(4), ("h",)
    assert not g.due(x, y, h)
    g.note_eager(x, y, h)
    assert not g.due(x, y, h)
    g.note_eager(x, y, h)
    assert g.due(x, y, h) and not g.captured and not g.replayable(x, y, h)
    g.note_eager(x[:2], y[:2], h)  # a new shape starts counting again
    assert not g.due(x[:2], y[:2], h) and not g.due(x, y, h)


def test_warmup_must_be_positive():
    with pytest.raises(ValueError, match="at least one eager warm-up step"):
        StepGraph(lambda x, y: x, warmup=0)
