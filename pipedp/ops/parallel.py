"""TVM kernels' parallel loops on torch's own OpenMP thread team.

A compiled CPU kernel hands each parallel loop to ``TVMBackendParallelLaunch``
through a function pointer in its library (``__TVMBackendParallelLaunch``),
which the TVM runtime points at its own thread pool when the library loads.
In a training step that pool and torch's OpenMP team then share the cores:
each spins after its work while the other needs the core, and a training
step ran slower with kernels that were each faster alone (the README has the
figures). Here that pointer is aimed at a ten-line C
launcher that runs the loop's tasks in an OpenMP parallel region of the
libgomp torch already loaded, so kernels and torch ops use one team, sized by
``torch.set_num_threads``.

The launcher is compiled once per machine with the system C compiler into
the per-user cache (written whole or not at all). Loading a library runs its
constructors, so the cached one is loaded only if it is the one pipedp built
there, as kernel libraries are checked against their export record: its
sha256, recorded beside it at build (``<name>.sha256``), must match, and both
files must be regular files of this user that nobody else may write (a
checksum in a folder others can write would vouch for nothing). Anything
else is rebuilt, never loaded. Without a compiler, or with a torch not built
on OpenMP, :func:`route` returns False and the kernel keeps TVM's pool (see
:mod:`.threads`). Needs no TVM compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading

import torch

from .artifact import sha256

__all__ = ["route", "launcher_address", "cache_folder"]

log = logging.getLogger(__name__)

# TVM's C ABI: int (*)(int task_id, TVMParallelGroupEnv* env, void* cdata); env = {sync_handle, num_task}.
# A loop splits its iterations by env->num_task, so num_task must equal the threads that run it.
_SOURCE = r"""
#include <omp.h>
#include <stdint.h>
typedef struct { void* sync_handle; int32_t num_task; } pipedp_env;
typedef int (*pipedp_lambda)(int task_id, pipedp_env* env, void* cdata);
int pipedp_parallel_launch(pipedp_lambda f, void* cdata, int num_task) {
  int n = num_task > 0 ? num_task : omp_get_max_threads();
  if (n <= 1 || omp_in_parallel()) { pipedp_env env = {0, 1}; return f(0, &env, cdata); }
  int failed = 0;
  #pragma omp parallel num_threads(n) reduction(|:failed)
  {
    pipedp_env env = {0, omp_get_num_threads()};
    failed |= f(omp_get_thread_num(), &env, cdata) != 0;
  }
  return failed ? -1 : 0;
}
"""
_POINTER = "__TVMBackendParallelLaunch"
_lock = threading.Lock()


def cache_folder() -> str:
    """pipedp's per-user cache (``$XDG_CACHE_HOME/pipedp``): the launcher here, kernel databases below."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pipedp")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _distrust(path: str) -> str | None:
    """Why the file at ``path`` may not be this user's own (None: a regular file only this user may write)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it is missing"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"it belongs to user id {st.st_uid}, not to this user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _untrusted(path: str) -> str | None:
    """Why the launcher at ``path`` is not the one pipedp built there (None: it is, checked by sha256)."""
    for p in (path, path + ".sha256"):
        why = _distrust(p)
        if why is not None:
            return f"{os.path.basename(p)}: {why}"
    try:
        with open(path + ".sha256") as f:
            want = f.read().strip()
        got = sha256(path)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    return None if got == want else f"its sha256 {got[:16]}... is not the {want[:16]}... recorded at build"


def _build(folder: str) -> str:
    """The launcher library in ``folder``: the one built there before if it checks out, else built now."""
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    path = os.path.join(folder, f"omp-launch-{digest}.so")
    why = _untrusted(path)
    if why is None:
        return path
    if os.path.lexists(path):
        log.warning("not loading the OpenMP launcher %s (%s): building it again", path, why)
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC)")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:  # private (0700) until renamed into place
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-fopenmp", "-x", "c", "-", "-o", "launch.so"],
                              input=_SOURCE, cwd=work, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:300]}")
        out, check = os.path.join(work, "launch.so"), os.path.join(work, "launch.so.sha256")
        with open(check, "w") as f:
            f.write(sha256(out) + "\n")
        for p in (out, check):
            os.chmod(p, 0o755 if p == out else 0o644)  # not the umask's: nobody else may write either
        # Library first, then its checksum: a crash between leaves a mismatch, which builds again.
        os.replace(out, path)
        os.replace(check, path + ".sha256")
    return path


@functools.lru_cache(maxsize=1)
def launcher_address() -> int | None:
    """Address of the OpenMP launcher, or None where it cannot run on torch's team (logged once)."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        log.info("torch's parallel backend is not OpenMP: TVM kernels keep TVM's thread pool")
        return None
    try:
        lib = ctypes.CDLL(_build(cache_folder()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("TVM kernels keep TVM's thread pool (it contends with torch's): cannot build the OpenMP "
                    "launcher: %s", e)
        return None
    return ctypes.cast(lib.pipedp_parallel_launch, ctypes.c_void_p).value


def route(library_path: str) -> bool:
    """Aim the parallel loops of the loaded kernel library at ``library_path`` at torch's OpenMP team.

    Call after the TVM runtime loaded the library (it sets the pointer at
    load). Returns False, changing nothing, where the launcher is unavailable
    or the library has no parallel loops.
    """
    address = launcher_address()
    if address is None:
        return False
    try:
        pointer = ctypes.c_void_p.in_dll(ctypes.CDLL(library_path), _POINTER)
    except (OSError, ValueError):
        return False
    with _lock:
        pointer.value = address
    return True
