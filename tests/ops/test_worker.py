"""Jobs in a worker process: a crash or a hang fails one job, the next runs in a fresh worker."""

import pytest

from pipedp.ops.worker import CandidateFailed, Worker

from tests import faults


def test_a_crash_or_a_hang_fails_one_job_and_the_next_runs_in_a_fresh_worker():
    with Worker() as worker:
        first = worker.call(faults.pid, (), 60)
        with pytest.raises(CandidateFailed, match="the worker process died .killed by SIGSEGV.") as failed:
            worker.call(faults.crash, (), 60)
        assert failed.value.status == "crash"
        second = worker.call(faults.pid, (), 60)
        with pytest.raises(CandidateFailed, match="no result within the time limit of 1 s") as failed:
            worker.call(faults.hang, (), 1)
        assert failed.value.status == "timeout"
        third = worker.call(faults.pid, (), 60)
    assert len({first, second, third}) == 3 and worker.starts == 3


def test_an_exception_fails_its_job_with_its_status_and_the_worker_serves_on():
    with Worker() as worker:
        first = worker.call(faults.pid, (), 60)
        with pytest.raises(CandidateFailed, match="_Wrong: differs from torch by 1") as failed:
            worker.call(faults.wrong, (), 60)
        assert failed.value.status == "wrong"
        assert worker.call(faults.pid, (), 60) == first and worker.starts == 1


def test_a_cuda_error_takes_its_worker_down_and_only_its_own_job():
    # A kernel that reads out of bounds on a GPU raises (torch's AcceleratorError) and leaves its CUDA context
    # broken: in the same process every later job would fail with it (the H100 benchmark of 2026-11-25 lost
    # 175 rows that way). The child reports it and exits; the next job runs in a fresh one.
    with Worker() as worker:
        first = worker.call(faults.pid_unless_broken, (), 60)
        with pytest.raises(CandidateFailed, match="illegal memory access") as failed:
            worker.call(faults.illegal_access, (), 60)
        assert failed.value.status == "error"
        second = worker.call(faults.pid_unless_broken, (), 60)
        third = worker.call(faults.pid_unless_broken, (), 60)
    assert first != second == third and worker.starts == 2


def test_restart_after_error_and_restart_give_the_next_job_a_fresh_worker():
    with Worker(restart_after_error=True) as worker:
        first = worker.call(faults.pid, (), 60)
        with pytest.raises(CandidateFailed, match="differs from torch"):
            worker.call(faults.wrong, (), 60)
        second = worker.call(faults.pid, (), 60)
        worker.restart()
        third = worker.call(faults.pid, (), 60)
    assert len({first, second, third}) == 3 and worker.starts == 3


def test_breaks_process_knows_cuda_errors_from_others():
    from pipedp.ops.worker import breaks_process

    assert breaks_process(faults.AcceleratorError("anything"))
    assert breaks_process(RuntimeError("CUDA Runtime Error: cudaErrorIllegalAddress (700): an illegal memory access"))
    assert breaks_process(RuntimeError("CUDA error: unspecified launch failure"))
    assert not breaks_process(ValueError("differs from torch by 1"))
    assert not breaks_process(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
