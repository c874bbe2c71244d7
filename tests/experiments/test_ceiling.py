import json

import pytest
import torch

from experiments.ceiling import captured_fraction, ceiling_summary, main, measure_ceiling
from experiments.workload import Workload


def test_ceiling_is_the_best_speedup_of_k_copies_over_one():
    s = ceiling_summary({1: 100.0, 2: 150.0, 4: 140.0})
    assert s == {"speedup": {"1": 1.0, "2": 1.5, "4": 1.4}, "best_copies": 2, "ceiling": 1.5}
    assert ceiling_summary({1: 100.0, 2: 90.0})["ceiling"] == 1.0  # copies only slow it down: no spare capacity
    with pytest.raises(ValueError, match="K=1"):
        ceiling_summary({2: 100.0})


def test_captured_fraction_of_the_spare_capacity():
    assert captured_fraction(1.25, 1.5) == pytest.approx(0.5)
    assert captured_fraction(0.9, 1.5) == pytest.approx(-0.2)
    assert captured_fraction(1.1, 1.01) is None and captured_fraction(None, 1.5) is None


def test_a_cpu_run_records_why_it_skipped(tmp_path):
    out = tmp_path / "ceiling.json"
    assert main(["--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "needs a CUDA device" in data["skipped"] and data["machine"]["device"] == "cpu"
    assert main(["--device", "cpu", "--copies", "2,4"]) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_replay_side_by_side_on_a_gpu():
    r = measure_ceiling(Workload("resnet18"), 16, "bf16cl", [1, 2], torch.device("cuda"), rounds=2, steps=3,
                        width=8)
    assert set(r["images_per_s"]) == {"1", "2"} and r["ceiling"] >= 1.0 and r["speedup"]["1"] == 1.0
