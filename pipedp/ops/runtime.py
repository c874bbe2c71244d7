"""Loading exported kernel libraries with the TVM runtime only (no compiler in the training process).

The runtime libraries come from ``PIPEDP_TVM_LIB`` (a folder with
``libtvm_runtime.so`` and, for CUDA, ``libtvm_runtime_cuda.so``: a GPU host
can carry just these) or from the installed apache-tvm package, found without
importing it. A library is loaded only if its sha256 equals the one its
export record states: a half-written or tampered file never runs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from typing import Any, Callable

import torch

from kernels.tvm import parallel
from kernels.tvm import records as rec
from kernels.tvm.artifact import cpu_flags, sha256
from kernels.tvm.problem import DepthwiseConv

__all__ = ["KernelLibrary", "load_library", "default_db", "runtime_folder", "target_for"]

_lock = threading.Lock()
_loaded_runtime: set[str] = set()


def default_db() -> str:
    """The per-user kernel database (``$XDG_CACHE_HOME/pipedp/kernels``)."""
    return os.path.join(parallel.cache_folder(), "kernels")


def runtime_folder() -> str:
    folder = os.environ.get("PIPEDP_TVM_LIB")
    if folder:
        return folder
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "TVM kernels need the TVM runtime: pip install 'pipedp[tvm]', or set PIPEDP_TVM_LIB to a folder "
            "holding libtvm_runtime.so (and libtvm_runtime_cuda.so for CUDA)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "lib")


def _load_runtime(cuda: bool) -> Any:
    import tvm_ffi

    names = ["libtvm_runtime.so"] + (["libtvm_runtime_cuda.so"] if cuda else [])
    with _lock:
        for name in names:
            if name in _loaded_runtime:
                continue
            path = os.path.join(runtime_folder(), name)
            if not os.path.exists(path):
                raise RuntimeError(f"the TVM runtime library {path} is missing: reinstall apache-tvm or fix PIPEDP_TVM_LIB")
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded_runtime.add(name)
    return tvm_ffi


def target_for(device: torch.device) -> str | None:
    """The target key of records usable on ``device``: ``cuda:sm_90``, or ``cpu`` (any CPU export)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm_{major}{minor}"
    return "cpu" if device.type == "cpu" else None


class KernelLibrary:
    """The kernels exported for one target, ready to call with torch tensors."""

    def __init__(self, db: str, export: dict[str, Any]) -> None:
        self.db = db
        self.target = export["target"]
        self.path = os.path.join(db, export["library"])
        if not os.path.exists(self.path):
            raise RuntimeError(f"the kernel library {self.path} is missing: run tune-kernels again to export it")
        digest = sha256(self.path)
        if digest != export["sha256"]:
            raise RuntimeError(
                f"refusing to load {self.path}: its sha256 {digest[:16]}... is not the exported {export['sha256'][:16]}... "
                f"(the file was changed or half-written); run tune-kernels again to re-export it"
            )
        tvm_ffi = _load_runtime(self.target.startswith("cuda"))
        self.module = tvm_ffi.load_module(self.path)
        # CPU kernels' parallel loops on torch's OpenMP team (False: they keep TVM's pool)
        self.torch_team = not self.target.startswith("cuda") and parallel.route(self.path)
        self.kernels: dict[str, str] = dict(export["kernels"])
        self.timings: dict[str, dict[str, Any]] = dict(export.get("timings") or {})
        self.faster_only = False  # kernels="auto": only kernels that beat torch when they were tuned
        self._funcs: dict[str, Callable[..., Any]] = {}
        self.lookups: dict[tuple, Callable[..., Any] | None] = {}  # pipedp.ops.depthwise's per-signature answers

    def find(self, op: str, problem: DepthwiseConv, layout: str = "NCHW") -> Callable[..., Any] | None:
        """The kernel for ``op`` on ``problem`` with ``layout`` activations, or None (torch runs it).

        With ``faster_only`` a kernel whose tuning measured it no faster than
        torch in the same layout is passed over too.
        """
        pk = rec.problem_key(op, problem.key(), self.target, layout)
        sym = self.kernels.get(pk)
        if sym is None or (self.faster_only and not self.beats_torch(pk)):
            return None
        if sym not in self._funcs:
            self._funcs[sym] = self.module[sym]
        return self._funcs[sym]

    def beats_torch(self, problem_key: str) -> bool:
        """Whether the tuned kernel measured faster than torch in its layout (True when not recorded)."""
        t = self.timings.get(problem_key) or {}
        us, base = t.get("us"), t.get("torch_us")
        return not (isinstance(us, (int, float)) and isinstance(base, (int, float))) or us < base


def load_library(db: str, device: torch.device) -> KernelLibrary | None:
    """The latest export usable on ``device`` in ``db``, verified and loaded (None if there is none)."""
    want = target_for(device)
    if want is None:
        return None
    records = rec.read(os.path.join(db, rec.RECORDS_FILE))
    if want == "cpu":
        flags = cpu_flags()
        exports = [r for r in records if r.get("kind") == "export" and str(r.get("target", "")).startswith("cpu:")]
        exports = [r for r in exports if set(r.get("cpu_flags", [])) <= flags]
        export = exports[-1] if exports else None
    else:
        export = rec.latest_export(records, want)
    return KernelLibrary(db, export) if export is not None else None
