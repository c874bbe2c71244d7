"""CPU worker lanes: own thread counts, in-order work, exact concurrent stages, clean failures."""

import copy
import gc
import threading

import pytest
import torch
from torch import nn

from pipedp.partition import Block, Chain
from pipedp.pipeline import microbatch
from pipedp.pipeline.cpu_lane import CpuWorker, Flight, core_sets
from pipedp.pipeline.executor import Executor
from pipedp.pipeline.schedule import get_schedule
from pipedp.pipeline.stage import Stage
from pipedp.pipeline.stream import new_lane
from tests.reference import data, max_diff, plain_steps, sequential_cnn


class Probe(nn.Module):
    """Records the intra-op thread count and thread it runs on."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.append((torch.get_num_threads(), threading.current_thread().name))
        return x


def test_worker_has_its_own_thread_count_and_leaves_the_hosts():
    host = torch.get_num_threads()
    a, b = CpuWorker(3, name="a"), CpuWorker(1, name="b")
    try:
        assert a.call(torch.get_num_threads) == 3
        assert b.call(torch.get_num_threads) == 1
        assert a.call(torch.get_num_threads) == 3  # b's set did not change a's
        assert torch.get_num_threads() == host
        fresh = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert fresh == [host]  # threads started later still get the host's count
    finally:
        a.close()
        b.close()
    assert not a.alive and not b.alive


def test_worker_runs_in_order_and_pins_to_its_cores():
    cores = core_sets([1])[0]
    w = CpuWorker(1, cores, name="pinned")
    try:
        import os

        assert w.call(lambda: sorted(os.sched_getaffinity(threading.get_native_id()))) == list(cores)
        log, flight = [], Flight()
        for i in range(20):
            flight.submit(w, i, lambda i=i: log.append(i))
        flight.wait()
        assert log == list(range(20))
    finally:
        w.close()


def test_core_sets_are_disjoint_and_unpinned_when_oversubscribed():
    assert core_sets([2, 1, 1], cores=[4, 5, 6, 7]) == [(4, 5), (6,), (7,)]
    assert core_sets([2, 2], cores=[0, 1]) == [None, None]


def test_worker_is_stopped_when_collected():
    w = CpuWorker(1, name="gc")
    thread = w._thread
    del w
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_bad_thread_count_is_refused():
    with pytest.raises(ValueError, match="positive int"):
        CpuWorker(0)
    with pytest.raises(ValueError, match="threads=None"):
        new_lane(torch.device("cuda"), "s0", threads=2)


def _stages(model: nn.Sequential, counts, threads, probe=None):
    mods, start, out = list(model), 0, []
    for s, k in enumerate(counts):
        blocks = [Block(str(start + j), m) for j, m in enumerate(mods[start : start + k])]
        if probe is not None:
            blocks.insert(0, Block(f"probe{s}", Probe(probe)))
        lane = new_lane(torch.device("cpu"), f"stage{s}", threads=threads[s])
        out.append(Stage(s, Chain(blocks), torch.device("cpu"), lane))
        start += k
    return out


def _train(model, batches, counts, threads, schedule, m, probe=None):
    ex = Executor(_stages(model, counts, threads, probe), get_schedule(schedule)(len(counts), m))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        xs, ys = microbatch.split(x, m), microbatch.split(y, m)
        ex.train(xs, ys, microbatch.shares([t.shape[0] for t in xs]), nn.CrossEntropyLoss())
        opt.step()
    return ex


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("counts", [[9], [4, 5], [3, 3, 3], [2, 2, 2, 3]])
def test_concurrent_stages_equal_plain_training(schedule, counts):
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = plain_steps(copy.deepcopy(model), data(), microbatches=4)
    _train(model, data(), counts, [1] * len(counts), schedule, 4)
    assert max_diff(model, ref) <= 1e-5


def test_each_stage_runs_on_its_worker_with_its_thread_count():
    seen = []
    model = sequential_cnn()
    _train(model, data(steps=1), [4, 5], [2, 1], "1f1b", 2, probe=seen)
    assert {(k, name) for k, name in seen} == {(2, "pipedp-stage0"), (1, "pipedp-stage1")}


class Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_a_failing_stage_raises_with_its_name_and_leaves_workers_usable():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10), nn.ReLU(), Boom())
    ex = Executor(_stages(model, [2, 2], [1, 1]), get_schedule("1f1b")(2, 2))
    (x, y), = data(steps=1)
    xs, ys = microbatch.split(x, 2), microbatch.split(y, 2)
    with pytest.raises(RuntimeError, match="boom") as info:
        ex.train(xs, ys, [0.5, 0.5], nn.CrossEntropyLoss())
    assert any("stage 1" in n for n in info.value.__notes__)
    model[3] = nn.Identity()
    ex.stages[1].chain = Chain([Block("2", model[2]), Block("3", model[3])])
    loss = ex.train(xs, ys, [0.5, 0.5], nn.CrossEntropyLoss())  # the same workers run the next step
    assert loss is not None and torch.isfinite(loss)


def test_inference_runs_under_the_callers_grad_mode():
    model = sequential_cnn()
    ex = Executor(_stages(model, [4, 5], [1, 1]), get_schedule("1f1b")(2, 2))
    (x, _), = data(steps=1)
    with torch.no_grad():
        outs = ex.forward(microbatch.split(x, 2))
    assert not any(o.requires_grad for o in outs)
    assert torch.allclose(torch.cat(outs), model(x), atol=1e-6)


def test_a_dropped_executor_stops_its_workers():
    ex = _train(sequential_cnn(), data(steps=1), [4, 5], [1, 1], "1f1b", 2)
    threads = [st.lane.worker._thread for st in ex.stages]
    del ex
    gc.collect()
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()


def test_a_stage_with_a_team_of_threads_equals_plain_training():
    torch.manual_seed(0)
    model = sequential_cnn()
    ref = plain_steps(copy.deepcopy(model), data(), microbatches=2)
    _train(model, data(), [9], [2], "1f1b", 2)
    assert max_diff(model, ref) <= 1e-5


def test_an_interrupted_wait_skips_the_rest_and_waits_for_the_running_closure():
    import time

    w = CpuWorker(1, name="slow")
    try:
        ran, flight, started = [], Flight(), threading.Event()
        flight.submit(w, 0, lambda: (started.set(), time.sleep(0.3), ran.append(0)))
        flight.submit(w, 1, lambda: ran.append(1))
        started.wait()

        class Interrupt(BaseException):
            pass

        first = flight.done[0]
        real_wait, calls = first.wait, []

        def interrupted_once(timeout=None):
            calls.append(1)
            if len(calls) == 1:
                raise Interrupt()  # the host is interrupted while waiting
            return real_wait(timeout)

        first.wait = interrupted_once
        with pytest.raises(Interrupt):
            flight.wait()
        assert ran == [0]  # the running closure finished before wait() returned; the queued one was skipped
        assert flight.done[1].is_set()
    finally:
        w.close()
