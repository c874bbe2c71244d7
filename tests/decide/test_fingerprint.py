"""The fingerprint names what changed: the model, the input, the request, the machine or the versions."""

from __future__ import annotations

import torch
from torch import nn

from pipedp.decide.fingerprint import SECTIONS, fingerprint

CPU = [torch.device("cpu")]


def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU(), nn.Flatten(), nn.Linear(width * 36, 4))


def _fp(model: nn.Module, shape=(4, 3, 8, 8), request=None):
    return fingerprint(model, torch.zeros(shape), CPU, request or {"stages": "auto"})


def test_the_same_question_has_the_same_key_whatever_the_weights():
    a, b = _model(), _model()
    with torch.no_grad():
        b[0].weight.add_(1.0)  # training changes values, not the plan's question
    assert _fp(a).key == _fp(b).key
    assert _fp(a).differing(_fp(b).sections) == []


def test_each_change_is_named_by_its_section():
    base = _fp(_model())
    assert _fp(_model(16)).differing(base.sections) == ["model"]
    assert _fp(_model(), shape=(8, 3, 8, 8)).differing(base.sections) == ["input"]
    assert _fp(_model(), request={"stages": 2}).differing(base.sections) == ["request"]
    other = dict(base.sections, machine="0" * 16, versions="1" * 16)
    assert base.differing(other) == ["machine", "versions"]
    assert set(base.sections) == set(SECTIONS) and base.key != _fp(_model(16)).key


def test_mode_frozen_parameters_and_forward_code_are_part_of_the_model():
    base = _fp(_model())
    m = _model()
    m[1].eval()  # a BatchNorm frozen by the user normalises per sample: another model to plan
    assert _fp(m).differing(base.sections) == ["model"]
    m = _model()
    m[0].weight.requires_grad_(False)
    assert _fp(m).differing(base.sections) == ["model"]

    class Doubled(nn.Sequential):
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(0)
    d = Doubled(*_model())
    plain = nn.Sequential(*_model())
    assert _fp(d).sections["model"] != _fp(plain).sections["model"]


def test_the_machine_is_described_in_words():
    fp = _fp(_model())
    assert fp.machine.startswith("cpu: ") and f"{torch.get_num_threads()} threads" in fp.machine
