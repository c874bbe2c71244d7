"""A decision survives plain data (JSON, weights_only checkpoints) and is replayed only for its own model."""

from __future__ import annotations

import io
import json

import pytest
import torch

from pipedp.decide.config import Config
from pipedp.decide.decision import Decision
from pipedp.decide.fingerprint import SECTIONS, Fingerprint
from pipedp.decide.record import RecordError, from_record, replayed, to_record
from pipedp.partition.profile import BlockProfile

FP = Fingerprint({s: f"{i:016x}" for i, s in enumerate(SECTIONS)}, "cpu: test machine, 2 threads")
PROFILES = [BlockProfile("a", 1.5, 3.25, 100, 200, 300), BlockProfile("b", 2.0, 4.0, 10, 20, 30)]
DECISION = Decision(Config((1, 1), 4, channels_last=True, compiled=True, threads=(1, 1)), ("a note",),
                    (("plain", 10.0), ("2x4 channels_last compiled threads 1+1", 8.5)), bar="plain", bar_ms=10.0,
                    planning_s=1.25, hint="a hint", source="profile")


def test_the_record_is_plain_data_that_round_trips_through_json_and_weights_only_load():
    record = to_record(PROFILES, DECISION, FP)
    assert from_record(json.loads(json.dumps(record))) == (PROFILES, DECISION)
    buf = io.BytesIO()
    torch.save({"engine": {"decision": record}}, buf)
    buf.seek(0)
    assert from_record(torch.load(buf, weights_only=True)["engine"]["decision"]) == (PROFILES, DECISION)


@pytest.mark.parametrize("damage", [
    lambda r: "not a record",
    lambda r: {**r, "format": 99},
    lambda r: {k: v for k, v in r.items() if k != "config"},
    lambda r: {**r, "profiles": [["a", "x"]]},
    lambda r: {**r, "sections": {}},
])
def test_a_damaged_or_foreign_record_is_refused_with_the_fix(damage):
    with pytest.raises(RecordError, match="plan anew|engine.decision_record"):
        from_record(damage(to_record(PROFILES, DECISION, FP)))


def test_replay_refuses_another_model_or_request_and_notes_another_machine():
    record = to_record(PROFILES, DECISION, FP)
    profiles, decision = replayed(record, FP, ["a", "b"], "here")
    assert profiles == PROFILES and decision.config == DECISION.config
    assert decision.notes[0].startswith("plan replayed from here") and "made for another" not in decision.notes[0]
    for section in ("model", "request"):
        other = Fingerprint({**FP.sections, section: "f" * 16}, FP.machine)
        with pytest.raises(RecordError, match=f"the {section} differ"):
            replayed(record, other, ["a", "b"], "here")
    moved = Fingerprint({**FP.sections, "machine": "f" * 16, "input": "e" * 16}, "cpu: another")
    _, decision = replayed(record, moved, ["a", "b"], "here")
    assert decision.notes[0].endswith("made for another input, machine than this run's")


def test_replay_refuses_a_cut_over_other_blocks():
    record = to_record(PROFILES, DECISION, FP)
    with pytest.raises(RecordError, match="cuts 2 blocks .* this model has 3"):
        replayed(record, FP, ["a", "b", "c"], "here")
