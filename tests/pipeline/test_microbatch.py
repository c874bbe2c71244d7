from collections import namedtuple

import pytest
import torch

from pipedp.pipeline import count, gather, shares, sizes, split


def test_sizes_differ_by_at_most_one():
    assert sizes(10, 4) == [3, 3, 2, 2]
    assert sizes(8, 4) == [2, 2, 2, 2]
    assert sizes(5, 5) == [1] * 5
    assert shares([3, 1]) == [0.75, 0.25]


def test_split_is_views_and_gather_restores():
    x = torch.arange(30.0).reshape(10, 3)
    parts = split(x, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(gather(parts), x)


def test_batch_smaller_than_microbatches_is_a_clear_error():
    with pytest.raises(ValueError, match="batch of 3 samples cannot be split into 4 microbatches"):
        split(torch.zeros(3, 2), 4)


def test_count_keeps_two_samples_per_microbatch_and_never_refuses_a_small_batch():
    assert [count(b, 4) for b in (1, 2, 3, 4, 5, 7, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 4, 4, 4]
    assert count(1, 1) == 1 and count(64, 8) == 8
    with pytest.raises(ValueError, match="empty"):
        count(0, 4)


def test_split_rejects_scalars_and_non_tensors():
    with pytest.raises(ValueError, match="0-dim"):
        split(torch.tensor(1.0), 1)
    with pytest.raises(TypeError):
        split([1, 2], 1)
    with pytest.raises(ValueError, match="no microbatch outputs"):
        gather([])


def test_channels_last_survives_split_and_gather():
    x = torch.randn(6, 3, 4, 4).to(memory_format=torch.channels_last)
    parts = split(x, 3)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in parts)
    assert gather(parts).is_contiguous(memory_format=torch.channels_last)


def test_gather_takes_what_a_loss_function_takes_part_by_part():
    Out = namedtuple("Out", "logits aux")
    parts = [Out(torch.full((2, 3), float(i)), {"feat": torch.full((2,), float(i)), "k": 7}) for i in range(3)]
    whole = gather(parts)
    assert isinstance(whole, Out) and whole.logits.shape == (6, 3) and whole.aux["k"] == 7
    assert torch.equal(whole.aux["feat"], torch.tensor([0.0, 0, 1, 1, 2, 2]))
    with pytest.raises(ValueError, match="0-dim tensor"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(ValueError, match="cannot be gathered"):
        gather([(torch.ones(1),), (torch.ones(1), torch.ones(1))])
