"""Receives posted ahead: the walk over a rank's order on a fake receiver, and a real transport over gloo."""

from __future__ import annotations

import datetime

import pytest
import torch

from pipedp.pipeline.ahead import Ahead
from pipedp.pipeline.p2p import Transport
from pipedp.pipeline.schedule import Action
from tests import multiproc

F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))


class FakeReceiver:
    """Stage 1 receives activations from rank 0 and gradients from rank 2; ``unknown`` are not postable yet."""

    def __init__(self, unknown=(), empty=()):
        self.unknown, self.empty, self.log = set(unknown), set(empty), []

    def peer_of(self, s, act):
        return 0 if act.kind == "F" else 2

    def post(self, s, act):
        if act in self.unknown:
            return False
        if act in self.empty:
            return None
        self.log.append(act)
        return True


def test_receives_are_posted_per_peer_in_order_up_to_the_lookahead():
    order = [(1, F(0)), (1, F(1)), (1, B(0)), (1, F(2)), (1, B(1)), (1, B(2))]
    rx = FakeReceiver()
    ahead = Ahead(order, rx, lookahead=2)
    ahead.fill()
    assert rx.log == [F(0), F(1), B(0), B(1)]  # two per peer
    assert ahead.take(1, F(0)) and ahead.take(1, F(1))
    ahead.fill()
    assert rx.log[-1] == F(2) and ahead.take(1, B(0)) and ahead.take(1, F(2))
    ahead.fill()
    assert rx.log[4:] == [F(2), B(2)] and ahead.take(1, B(1)) and ahead.take(1, B(2))


def test_an_unknown_size_stops_its_peer_until_the_action_takes_it_itself():
    order = [(1, F(0)), (1, F(1)), (1, B(0)), (1, B(1))]
    rx = FakeReceiver(unknown={F(0)}, empty={B(0)})
    ahead = Ahead(order, rx, lookahead=2)
    ahead.fill()
    assert rx.log == [B(1)]  # F(1) waits behind F(0) (gloo matches in posting order); B(0) receives nothing
    assert ahead.take(1, F(0)) is False  # the action receives it itself...
    rx.unknown.clear()
    ahead.fill()
    assert rx.log == [B(1), F(1)] and ahead.take(1, F(1))  # ...and the walk goes on after it


def test_the_lookahead_must_be_positive():
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        Ahead([], FakeReceiver(), lookahead=0)


def _transfer(rank: int, world: int) -> dict:
    t = Transport(None, torch.device("cpu"), datetime.timedelta(seconds=30))
    key = (0, "k")
    if rank == 0:
        for v in range(4):
            t.send_activation(torch.full((2, 3), float(v), requires_grad=True), 1, key)
        t.flush()
        return {}
    first = t.recv_activation(0, key)  # its metadata first: now the size is known
    assert t.knows(key)
    t.post_activation(0, key)
    t.post_activation(0, key)
    second = t.recv_activation(0, key, posted=True)
    third = t.recv_activation(0, key, posted=True)
    fourth = t.recv_activation(0, key)
    with pytest.raises(RuntimeError, match="out of posting order"):
        t.recv_grads([first], 0, posted=(0, 0))
    t.flush()
    return {"values": [x[0, 0].item() for x in (first, second, third, fourth)], "grad": second.requires_grad}


def test_a_posted_receive_takes_the_next_message_in_order():
    _, got = multiproc.run(_transfer, 2, timeout_s=60)
    assert got["values"] == [0.0, 1.0, 2.0, 3.0] and got["grad"]


def _left_posted(rank: int, world: int) -> str:
    t = Transport(None, torch.device("cpu"), datetime.timedelta(seconds=30))
    if rank == 0:
        t.send_activation(torch.zeros(2), 1, "k")
        t.send_activation(torch.ones(2), 1, "k")
        t.flush()
        return ""
    t.recv_activation(0, "k")
    t.post_activation(0, "k")
    try:
        t.flush()
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_receive_posted_and_never_taken_fails_the_step():
    _, msg = multiproc.run(_left_posted, 2, timeout_s=60)
    assert "never taken" in msg
