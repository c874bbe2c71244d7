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
