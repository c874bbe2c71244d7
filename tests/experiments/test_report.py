"""Results files are strict JSON and written whole."""

import json
import math
import os

import pytest

from experiments.report import write_json, write_text


def test_write_json_is_strict_and_replaces_the_file(tmp_path):
    path = str(tmp_path / "sub" / "r.json")
    write_json(path, {"a": [1.5, math.inf, float("nan")], "b": {"c": -math.inf}})
    assert json.loads(open(path).read(), parse_constant=lambda c: pytest.fail(c)) == {"a": [1.5, None, None], "b": {"c": None}}
    write_json(path, {"a": 2})
    assert json.load(open(path)) == {"a": 2} and os.listdir(tmp_path / "sub") == ["r.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = str(tmp_path / "t.md")
    write_text(path, "old")
    with pytest.raises(TypeError):
        write_json(path, {"x": object()})
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["t.md"]
