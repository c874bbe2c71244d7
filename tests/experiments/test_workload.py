import pytest
import torch

from experiments.workload import Workload, parse_ints, parse_workload


def test_model_specs():
    assert parse_workload("resnet18") == Workload("resnet18", 32, 10)
    assert parse_workload("resnet18/100") == Workload("resnet18", 32, 100)
    w = parse_workload("resnet50@224/101")
    assert w == Workload("resnet50", 224, 101) and w.name == "resnet50@224/101"
    assert parse_workload("resnet18").name == "resnet18"
    for bad in ("", "resnet18@x", "resnet18@224/1", "resnet18@4"):
        with pytest.raises(ValueError, match="cannot read model spec"):
            parse_workload(bad)


def test_batch_and_model_follow_the_spec():
    w = parse_workload("resnet18@16/100")
    x, y = w.batch(3, torch.device("cpu"))
    assert x.shape == (3, 3, 16, 16) and int(y.max()) < 100
    assert w.build(width=4)(x).shape == (3, 100)
    assert torch.equal(w.batch(3, torch.device("cpu"))[0], x)  # the same batch every time


def test_parse_ints():
    assert parse_ints("32,64", "--batch") == [32, 64]
    for bad in ("", "0", "a,b"):
        with pytest.raises(ValueError, match="--batch must be a comma list of positive ints"):
            parse_ints(bad, "--batch")
