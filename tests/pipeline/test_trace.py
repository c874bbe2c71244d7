"""Chrome/Perfetto traces of one pipelined step: the format, and what the engine records."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import pipedp
from pipedp.pipeline.trace import Span, chrome_trace
from tests import multiproc
from tests.reference import clone, data, sequential_cnn


def _engine(model, **kw):
    kw.setdefault("profile", False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), progress=False, **kw)


def _lanes(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def _spans(trace: dict) -> dict[str, list[dict]]:
    lanes = _lanes(trace)
    out: dict[str, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out.setdefault(lanes[e["tid"]], []).append(e)
    return out


def test_chrome_trace_names_lanes_and_converts_ms_to_us():
    spans = [Span("b", "x", 2.0, 2.5), Span("a", "y", 0.0, 1.0, "forward", {"k": 1}), Span("b", "z", 1.0, 1.5)]
    trace = chrome_trace(spans, process="p", metadata={"m": 1})
    assert _lanes(trace) == {0: "b", 1: "a"}
    got = _spans(trace)
    assert [(e["name"], e["ts"], e["dur"]) for e in got["b"]] == [("z", 1000.0, 500.0), ("x", 2000.0, 500.0)]
    assert got["a"][0]["cat"] == "forward" and got["a"][0]["args"] == {"k": 1}
    assert trace["otherData"] == {"m": 1}
    json.dumps(trace, allow_nan=False)


def test_engine_trace_records_every_action_of_one_step_and_trains_as_usual(tmp_path):
    torch.manual_seed(0)
    model = sequential_cnn()
    twin = clone(model)
    traced, plain = _engine(model, stages=2, microbatches=3), _engine(twin, stages=2, microbatches=3)
    batches = data(n=6, size=16, steps=3)
    path = tmp_path / "step.json"
    for k, (x, y) in enumerate(batches):
        if k == 1:
            traced.trace(path)
        traced.train_step(x, y)
        plain.train_step(x, y)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    trace = json.loads(path.read_text())
    assert trace["otherData"]["step"] == 1 and trace["otherData"]["microbatches"] == 3
    spans = _spans(trace)
    stage_lanes = sorted(lane for lane in spans if lane.startswith("stage"))
    assert len(stage_lanes) == 2 and any(lane.startswith("optimizer") for lane in spans)
    for lane in stage_lanes:
        events = spans[lane]
        assert sorted(e["name"] for e in events) == sorted(f"{k}{i}" for k in "FB" for i in range(3))
        for a, b in zip(events, events[1:]):  # one in-order lane on the CPU: spans never overlap
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    last = [e["name"] for e in spans[stage_lanes[1]]]
    assert last.index("F0") < last.index("B0") < last.index("F2")  # 1F1B on the last stage
    opt = next(e for lane, es in spans.items() if lane.startswith("optimizer") for e in es)
    assert opt["ts"] >= max(e["ts"] + e["dur"] for lane in stage_lanes for e in spans[lane]) - 1e-3


def test_only_the_next_step_is_traced_and_a_missing_folder_is_a_clear_error(tmp_path):
    engine = _engine(sequential_cnn(), stages=2, microbatches=2)
    with pytest.raises(ValueError, match="does not exist"):
        engine.trace(tmp_path / "nope" / "t.json")
    path = tmp_path / "t.json"
    engine.trace(path)
    (x, y), (x2, y2) = data(n=4, size=16, steps=2)
    engine.train_step(x, y)
    path.unlink()
    engine.train_step(x2, y2)
    assert not path.exists()


def _traced_dp(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(0)
    engine = _engine(sequential_cnn(), stages=2, microbatches=2, bucket_mb=0.001)
    (x, y), = data(n=8, size=16, steps=1, seed=rank)
    engine.trace(f"{folder}/dp.json")
    engine.train_step(x, y)
    return _spans(json.loads(open(f"{folder}/dp.rank{rank}.json").read()))


def test_distributed_trace_has_gradient_sync_lanes_per_rank(tmp_path):
    for spans in multiproc.run(_traced_dp, 2, str(tmp_path)):
        sync = {lane: es for lane, es in spans.items() if lane.startswith("gradsync")}
        assert len(sync) == 2 and all(e["name"].startswith("all-reduce") for es in sync.values() for e in es)
        first_backward_end = min(e["ts"] + e["dur"] for lane, es in spans.items() if lane.startswith("stage 1")
                                 for e in es if e["name"].startswith("B"))
        starts = [e["ts"] for es in sync.values() for e in es]
        assert min(starts) >= first_backward_end - 1e-3  # launched from inside backward, not before
