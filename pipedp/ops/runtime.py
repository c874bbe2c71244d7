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
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import parallel
from . import records as rec
from .artifact import cpu_flags, sha256
from .problem import DepthwiseConv

__all__ = ["KernelLibrary", "KernelChoice", "load_library", "library", "default_db", "runtime_folder", "target_for"]

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
    """The kernels exported for one target, ready to call with torch tensors.

    Which of them a layer runs is the layer's choice (:class:`KernelChoice`);
    the library only answers lookups, so two models in one process can use it
    with different policies.
    """

    def __init__(self, db: str, export: dict[str, Any]) -> None:
        self.db = db
        try:
            self.target = str(export["target"])
            self.path = os.path.join(db, export["library"])
            self.sha256 = str(export["sha256"])
            self.kernels: dict[str, str] = dict(export["kernels"])
        except (KeyError, TypeError, ValueError) as e:
            raise RuntimeError(
                f"the export record for {db} is malformed ({type(e).__name__}: {e}): run tune-kernels again to "
                f"re-export the kernels"
            ) from None
        if not os.path.exists(self.path):
            raise RuntimeError(f"the kernel library {self.path} is missing: run tune-kernels again to export it")
        digest = sha256(self.path)
        if digest != self.sha256:
            raise RuntimeError(
                f"refusing to load {self.path}: its sha256 {digest[:16]}... is not the exported {self.sha256[:16]}... "
                f"(the file was changed or half-written); run tune-kernels again to re-export it"
            )
        tvm_ffi = _load_runtime(self.target.startswith("cuda"))
        self.module = tvm_ffi.load_module(self.path)
        # CPU kernels' parallel loops on torch's OpenMP team (False: they keep TVM's pool)
        self.torch_team = not self.target.startswith("cuda") and parallel.route(self.path)
        self.timings: dict[str, dict[str, Any]] = dict(export.get("timings") or {})
        self._funcs: dict[str, Callable[..., Any]] = {}
        self.lookups: dict[tuple, Callable[..., Any] | None] = {}  # pipedp.ops.depthwise's per-signature answers

    @property
    def key(self) -> str:
        """What names this library in a :class:`KernelChoice` (and in the compiled op's arguments)."""
        return f"{os.path.realpath(self.path)}@{self.sha256}"

    def find(self, op: str, problem: DepthwiseConv, layout: str = "NCHW", faster_only: bool = False) \
            -> Callable[..., Any] | None:
        """The kernel for ``op`` on ``problem`` with ``layout`` activations, or None (torch runs it).

        With ``faster_only`` a kernel whose tuning measured it no faster than
        torch in the same layout is passed over too.
        """
        pk = rec.problem_key(op, problem.key(), self.target, layout)
        sym = self.kernels.get(pk)
        if sym is None or (faster_only and not self.beats_torch(pk)):
            return None
        if sym not in self._funcs:
            self._funcs[sym] = self.module[sym]
        return self._funcs[sym]

    def beats_torch(self, problem_key: str) -> bool:
        """Whether the tuned kernel measured faster than torch in its layout (True when not recorded)."""
        t = self.timings.get(problem_key) or {}
        us, base = t.get("us"), t.get("torch_us")
        return not (isinstance(us, (int, float)) and isinstance(base, (int, float))) or us < base


@dataclass(frozen=True)
class KernelChoice:
    """What one layer runs: the kernels of ``library`` (a :attr:`KernelLibrary.key`), under a policy.

    ``faster_only`` passes over kernels that measured slower than torch when
    tuned (``kernels="auto"``); ``strict`` makes a missing kernel an error
    (``kernels="tvm"``). Plain data, so a model holding it copies and pickles.
    """

    library: str
    faster_only: bool = False
    strict: bool = False


# Loaded libraries by key: loading is slow and a library's lookups are worth keeping. Only a cache: which
# library and policy a layer uses is the layer's own KernelChoice.
_loaded: dict[str, KernelLibrary] = {}


def _remember(lib: KernelLibrary) -> KernelLibrary:
    with _lock:
        return _loaded.setdefault(lib.key, lib)


def library(key: str) -> KernelLibrary:
    """The loaded library named ``key`` (loaded again, checked, if this process has not loaded it yet)."""
    lib = _loaded.get(key)
    if lib is not None:
        return lib
    path, _, digest = key.rpartition("@")
    db, name = os.path.split(path)
    for r in reversed(rec.read(os.path.join(db, rec.RECORDS_FILE))):
        if r.get("kind") == "export" and r.get("library") == name and r.get("sha256") == digest:
            return _remember(KernelLibrary(db, r))
    raise RuntimeError(f"no export record of {path} with sha256 {digest[:16]}...: run tune-kernels again")


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
    if export is None:
        return None
    if not isinstance(export.get("library"), str) or not isinstance(export.get("sha256"), str):
        raise RuntimeError(f"the export record for {db} has no library file or sha256: run tune-kernels again")
    path = os.path.realpath(os.path.join(db, export["library"]))
    cached = _loaded.get(f"{path}@{export['sha256']}")
    return cached if cached is not None else _remember(KernelLibrary(db, export))
