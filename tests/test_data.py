"""The prefetcher: order, values, nesting, errors; stream waits where CUDA exists."""

from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipedp.data import prefetch

Pair = namedtuple("Pair", "x y")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_batches_pass_through_in_order():
    batches = [
        torch.arange(3.0),
        (torch.ones(2), torch.zeros(2, dtype=torch.long)),
        {"x": torch.full((2,), 5.0), "meta": "keep"},
        [Pair(torch.ones(1), 7), {"deep": (torch.zeros(1),)}],
    ]
    out = list(prefetch(batches, "cpu"))
    assert len(out) == 4
    assert out[0] is batches[0] and out[1][0] is batches[1][0]
    assert out[2]["meta"] == "keep" and out[2]["x"] is batches[2]["x"]
    assert isinstance(out[3][0], Pair) and out[3][0].y == 7 and out[3][1]["deep"][0] is batches[3][1]["deep"][0]


def test_len_and_iterating_twice():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    pf = prefetch(loader, torch.device("cpu"))
    assert len(pf) == 3
    first = [b[0].tolist() for b in pf]
    assert first == [b[0].tolist() for b in pf] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_loader_error_arrives_after_the_batches_before_it():
    def loader():
        yield torch.zeros(1)
        yield torch.ones(1)
        raise OSError("disk gone")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for b in prefetch(loader(), "cpu"):
            got.append(b.item())
    assert got == [0.0, 1.0]


def test_bad_devices_are_clear_errors():
    with pytest.raises(ValueError, match="not a device"):
        prefetch([], "gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="prefetch asks for cuda.*CUDA is not available"):
            prefetch([], "cuda")


@pytest.mark.cuda
@needs_cuda
def test_cuda_values_arrive_intact_behind_a_busy_stream():
    host = [torch.randn(256, 256).pin_memory() for _ in range(6)]
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # the prefetcher never synchronises the host
    try:
        pf = prefetch(host, "cuda")
        assert pf.stream is not None and pf.stream != torch.cuda.current_stream()
        outs = []
        for b in pf:
            a = a @ a / 2048  # keep the consumer's stream busy while the next copy is in flight
            outs.append(b * 1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for h, o in zip(host, outs):
        assert torch.equal(o.cpu(), h)


@pytest.mark.cuda
@needs_cuda
def test_cuda_unpinned_input_warns_once():
    with pytest.warns(UserWarning, match="pin_memory=True") as rec:
        out = [b.cpu() for b in prefetch([torch.ones(3), torch.zeros(3)], "cuda")]
    assert len([w for w in rec if "pin_memory" in str(w.message)]) == 1
    assert torch.equal(out[0], torch.ones(3))
