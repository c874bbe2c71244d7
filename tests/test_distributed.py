"""Host collectives hand their tensors back before they return (gloo's threads never free them)."""

import datetime
import threading
import time
import weakref

import torch
import torch.distributed as dist

from pipedp.distributed import all_reduce, broadcast_object, let_go, timed, use_counts
from tests import multiproc

ROUNDS = 200


def _freed_where(rank: int, world: int) -> dict:
    """Where each collective's tensor was freed once the caller let go of it (a thread id per tensor)."""
    timeout = datetime.timedelta(seconds=60)
    main = threading.get_ident()
    freed: list[int] = []
    for i in range(ROUNDS):
        buf = torch.full((8,), float(rank + i))
        weakref.finalize(buf, lambda: freed.append(threading.get_ident()))
        timed(lambda: dist.all_reduce(buf, async_op=True), timeout, [buf])
        assert buf[0].item() == 2 * i + 1
        del buf  # the caller's last reference: the tensor is freed here, on this thread
    t = torch.tensor([float(rank)])
    all_reduce(t, "max", None, timeout)
    got = broadcast_object({"from": rank}, 0, dist.group.WORLD, timeout)
    return {"off_main": sum(1 for tid in freed if tid != main), "freed": len(freed), "max": t.item(), "got": got}


def test_a_host_collective_returns_holding_the_only_reference_to_its_tensors():
    # gloo wakes the waiter before its thread drops the work; freed there, a tensor needs the GIL,
    # which an exiting interpreter no longer gives (the process aborts)
    for res in multiproc.run(_freed_where, 2):
        assert res["freed"] == ROUNDS and res["off_main"] == 0, res
        assert res["max"] == 1.0 and res["got"] == {"from": 0}


def test_let_go_gives_up_after_its_limit_where_another_reference_stays():
    t = torch.zeros(4)
    before = use_counts([t])
    view = t.view(2, 2)  # a second reference that never goes away while the wait runs
    start = time.monotonic()
    let_go([t], before, limit_s=0.05)
    assert 0.05 <= time.monotonic() - start < 1.0
    del view
    start = time.monotonic()
    let_go([t], before, limit_s=5.0)  # back to the count before: no wait
    assert time.monotonic() - start < 0.5


class _LateWork:
    """A collective's work whose thread still holds its tensor for ``hold_s`` after ``wait()`` returns."""

    def __init__(self, t: torch.Tensor, hold_s: float) -> None:
        self.held = [t.view(-1)]  # the thread's reference (a view counts against the tensor)
        threading.Timer(hold_s, self.held.clear).start()

    def wait(self, timeout=None) -> bool:
        return True


def test_timed_returns_only_after_the_collective_s_thread_let_go():
    t = torch.zeros(4)
    start = time.monotonic()
    timed(lambda: _LateWork(t, 0.05), datetime.timedelta(seconds=5), [t])
    assert time.monotonic() - start >= 0.05 and t._use_count() == 1
    start = time.monotonic()
    timed(lambda: _LateWork(t, 0.05), datetime.timedelta(seconds=5), [t], device_side=True)  # nothing lent on CUDA
    assert time.monotonic() - start >= 0.05  # the host tensor is still waited for
