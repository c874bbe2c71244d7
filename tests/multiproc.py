"""Run a test function in N real processes over torch.distributed (gloo on loopback).

Each rank's return value comes back to the test (saved with torch.save); an
exception in any rank fails the test with that rank's traceback. Every rank
ends with a barrier before ``destroy_process_group`` (without it a gloo rank
can abort at exit while a peer still talks to it).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, fn: Callable, args: tuple, out: str, timeout_s: float, barrier: bool,
    backend: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
        if barrier:
            dist.barrier()
    except BaseException:
        with open(os.path.join(out, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # The rank's work is done and saved: leave without the interpreter's teardown, where gloo's worker threads
    # releasing their last tensors can abort the process ("terminate called without an active exception",
    # pytorch/pytorch#179291), now and then, after every test assertion's data is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 120.0,
    expect_dead: set[int] = frozenset(),
    backend: str = "gloo",
) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` processes; their results in rank order.

    Ranks in ``expect_dead`` are meant to die or hang: they return nothing, are
    killed once the others are done, and no rank waits at the final barrier.
    """
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(
                target=_entry, args=(r, world, port, fn, args, out, timeout_s, not expect_dead, backend), daemon=True
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for r, p in enumerate(procs):
            if r not in expect_dead:
                p.join(timeout_s + 60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world):
            path = os.path.join(out, f"{r}.err")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"rank {r}:\n{f.read()}")
        if errors:
            raise AssertionError("\n".join(errors))
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0 and r not in expect_dead]
        assert not bad, f"ranks exited abnormally (rank, exit code): {bad}"
        return [
            torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) if r not in expect_dead else None
            for r in range(world)
        ]
