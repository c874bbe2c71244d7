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


class _FakeCapture:
    """torch.cuda.graph as torch 2.11 behaves: an invalidated capture's capture_end raises before it ends the pool."""

    def __init__(self, allocator, invalidate):
        self.allocator, self.invalidate = allocator, invalidate

    def __call__(self, graph, pool=None, stream=None):
        self.pool = pool
        return self

    def __enter__(self):
        self.allocator["underway"].add(self.pool)

    def __exit__(self, kind, value, tb):
        if kind is not None and self.invalidate:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.allocator["underway"].discard(self.pool)  # endAllocateToPool, then the graph owns the pool


@pytest.mark.parametrize("outcome", ["fine", "invalidated", "python error"])
def test_a_failed_capture_is_ended_on_the_allocators_side(monkeypatch, outcome):
    # An invalidated capture left the allocator believing a capture was under way for the rest of the process:
    # blocks freed after record_stream were never reused and cached blocks never released, so on the H100 every
    # later configuration ran out of memory with ~72 GiB "reserved by PyTorch but unallocated".
    from pipedp.pipeline import graphed

    allocator = {"underway": set(), "released": []}

    def end(device, pool):
        if pool not in allocator["underway"]:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        allocator["underway"].discard(pool)

    streams = []
    monkeypatch.setattr(torch.cuda, "graph", _FakeCapture(allocator, invalidate=outcome == "invalidated"))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 7))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "caller's stream")
    monkeypatch.setattr(torch.cuda, "set_stream", streams.append)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, pool: allocator["released"].append((d, pool)),
                        raising=False)
    cause = RuntimeError("CUDA error: dependency created on uncaptured work in another stream")
    if outcome == "fine":
        with graphed.capturing(object(), torch.device("cuda", 0), "capture stream"):
            pass
    else:
        with pytest.raises(RuntimeError) as e:
            with graphed.capturing(object(), torch.device("cuda", 0), "capture stream"):
                raise cause
        assert e.value is cause  # the cause, not capture_end's "previous error"
    assert allocator["underway"] == set()
    # Released here only when capture_end never got to end it (else the graph owns and releases the pool).
    assert allocator["released"] == ([(0, (0, 7))] if outcome == "invalidated" else [])
    assert streams == ([] if outcome == "fine" else ["caller's stream"])
