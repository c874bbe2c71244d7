"""Packing parameters into gradient buckets: DDP's caps, the first layers apart."""

import torch
from torch import nn

from pipedp.pipeline.buckets import layout_stamp, pack, same_stamp


def test_buckets_go_last_layer_first_and_close_at_their_cap():
    """DDP's rule: a bucket closes once it holds its cap (the tensor that reaches it included)."""
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5, 5)]
    assert [[p.numel() for p in b] for b in pack(params, cap=80)] == [[5, 5, 30], [10, 10]]  # 80 bytes: 20 floats
    assert [[p.numel() for p in b] for b in pack(params, cap=10**6)] == [[5, 5, 30, 10, 10]]
    half = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    assert len(pack([params[0], half], cap=10**6)) == 2  # one dtype per bucket


def test_the_first_bucket_closes_early_and_the_first_layers_go_last_on_their_own():
    """The last layers' small bucket launches with the first big tensor; the forward's first layers (whose
    gradients come last) make their own last bucket, so little waits for the end of backward."""
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5, 5)]
    assert [[p.numel() for p in b] for b in pack(params, cap=80, first_cap=40)] == [[5, 5], [30], [10], [10]]
    assert [[p.numel() for p in b] for b in pack(params, cap=200, first_cap=40)] == [[5, 5], [30, 10], [10]]
    assert [[p.numel() for p in b] for b in pack(params[:1], cap=80, first_cap=4)] == [[10]]  # one tensor: one bucket
    packed = pack(params, cap=200, first_cap=40)
    assert sorted(map(id, (p for b in packed for p in b))) == sorted(map(id, params))  # each parameter once


def test_the_stamp_tells_ranks_that_train_the_same_parameters_from_ranks_that_do_not():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    same, frozen = layout_stamp([[a, b]]), layout_stamp([[a, nn.Parameter(torch.zeros(2), requires_grad=False)]])
    assert same[0] == 0.0 and same == layout_stamp([[a, b]])  # the place of the batch count, then the digests
    assert same_stamp([x + y for x, y in zip(same[1:], same[1:])], ranks=2)
    assert not same_stamp([x + y for x, y in zip(same[1:], frozen[1:])], ranks=2)
