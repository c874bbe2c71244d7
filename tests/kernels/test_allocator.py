"""reuse_freed_memory: large blocks come back without page faults (run in a fresh process: it is lasting)."""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = """
import resource, sys, torch
from pipedp.kernels.tvm.allocator import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
n = 48 << 20  # above glibc's 32 MiB mmap ceiling
faults = []
for _ in range(24):  # glibc's bins settle after a few rounds (memalign slack keeps the first blocks apart)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(n, dtype=torch.uint8).fill_(1)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults[-8:])[4])  # the median of the settled rounds
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True,
                          cwd=ROOT)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_second_large_block_reuses_memory_instead_of_faulting_it_in():
    pages = (48 << 20) // 4096
    assert _faults("default") > pages // 2  # glibc alone: every call a fresh mapping, every page faulted again
    assert _faults("reuse") < pages // 20  # reused: (almost) no page faults once settled
