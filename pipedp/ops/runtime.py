"""Loading exported kernel libraries with the TVM runtime only (no compiler in the training process).

The runtime libraries come from ``PIPEDP_TVM_LIB`` (a folder with
``libtvm_runtime.so`` and, for CUDA, ``libtvm_runtime_cuda.so``: a GPU host
can carry just these) or from the installed apache-tvm package, found without
importing it. A library is loaded only if its sha256 equals the one its
export record states: a half-written or tampered file never runs. The
export record is checked field by field and every function it names is
looked up at load, so a damaged database fails there, before any layer is
swapped, with a :class:`~pipedp.ops.records.KernelDbError` naming the file
and the fix (``kernels="auto"`` then keeps torch).

An exported kernel takes any batch size, so a library is looked up per layer
(:func:`~pipedp.ops.records.layer_key`): every microbatch and the last,
smaller batch of an epoch run the layer's tuned kernel. Its index arithmetic
is 32-bit, as for a kernel of a fixed batch that fits, so a batch whose
tensors reach 2**31 elements runs in slices that do not (:func:`_in_slices`).
Libraries exported before kernels took any batch size keyed each kernel by
its exact problem (:func:`~pipedp.ops.records.problem_key`) and were compiled
for exactly that batch size: they still load, and serve exactly that size.
"""

from __future__ import annotations

import ctypes
import logging
import importlib.util
import json
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from . import parallel
from . import records as rec
from .artifact import cpu_flags, cpu_name, sha256
from .layout import ALIGNMENT, aligned
from .problem import DepthwiseConv
from .records import KernelDbError

__all__ = ["KernelLibrary", "KernelChoice", "load_library", "library", "library_or_none", "library_key", "default_db",
           "runtime_folder", "target_for", "batch_limit", "INDEX_LIMIT", "KernelDbError", "ExportForOtherCpu"]

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
        raise KernelDbError(
            "TVM kernels need the TVM runtime: pip install 'pipedp[tvm]', or set PIPEDP_TVM_LIB to a folder "
            "holding libtvm_runtime.so (and libtvm_runtime_cuda.so for CUDA)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "lib")


def _load_runtime(cuda: bool) -> Any:
    try:
        import tvm_ffi
    except ImportError as e:
        raise KernelDbError(f"TVM kernels need the TVM runtime ({e}): pip install 'pipedp[tvm]'") from None

    names = ["libtvm_runtime.so"] + (["libtvm_runtime_cuda.so"] if cuda else [])
    with _lock:
        for name in names:
            if name in _loaded_runtime:
                continue
            path = os.path.join(runtime_folder(), name)
            if not os.path.exists(path):
                raise KernelDbError(f"the TVM runtime library {path} is missing: reinstall apache-tvm or fix "
                                    f"PIPEDP_TVM_LIB")
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise KernelDbError(f"cannot load the TVM runtime library {path} ({e}): reinstall apache-tvm or fix "
                                    f"PIPEDP_TVM_LIB") from None
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
        _check_export(db, export)
        self.db = db
        self.target: str = export["target"]
        self.path = os.path.join(db, export["library"])
        self.sha256: str = export["sha256"]
        self.kernels: dict[str, str] = dict(export["kernels"])
        self.timings: dict[str, dict[str, Any]] = dict(export.get("timings") or {})
        _check_cpu(db, export)  # a model saved with these kernels and loaded on another machine
        _verify(db, self.path, self.sha256)
        tvm_ffi = _load_runtime(self.target.startswith("cuda"))
        self.module = _load_module(tvm_ffi, db, self.path)
        self._funcs: dict[str, Callable[..., Any]] = _functions(self.module, db, self.path, self.kernels.values())
        # CPU kernels' parallel loops on torch's OpenMP team (False: they keep TVM's pool)
        self.torch_team = not self.target.startswith("cuda") and parallel.route(self.path)
        self.lookups: dict[tuple, Callable[..., Any] | None] = {}  # pipedp.ops.depthwise's per-signature answers
        if any(_batch_bound(k) for k in self.kernels):
            log.warning("%s was exported before kernels served every batch size: its kernels run at the batch size "
                        "they were tuned at only (torch runs the others; kernels='tvm' refuses them). Run tune-kernels "
                        "again to re-export it for every batch size (the tuning records are kept)", self.path)

    @property
    def key(self) -> str:
        """What names this library in a :class:`KernelChoice` (and in the compiled op's arguments)."""
        return library_key(self.db, os.path.basename(self.path), self.sha256)

    def find(self, op: str, problem: DepthwiseConv, layout: str = "NCHW", faster_only: bool = False) \
            -> Callable[..., Any] | None:
        """The kernel for ``op`` on ``problem`` with ``layout`` activations, or None (torch runs it).

        The layer's kernel serves any batch size; an older library's kernel
        only the batch size it was compiled for. With ``faster_only`` a kernel
        whose tuning measured it no faster than torch in the same layout is
        passed over too.
        """
        key = rec.layer_key(op, problem.key(), self.target, layout)
        any_batch = key in self.kernels
        if not any_batch:
            key = rec.problem_key(op, problem.key(), self.target, layout)  # exported before any batch size
            if key not in self.kernels:
                return None
        if faster_only and not self.beats_torch(key):
            return None
        kernel = self._funcs[self.kernels[key]]
        limit = batch_limit(problem)
        return _in_slices(kernel, op, limit) if any_batch and problem.n > limit else kernel

    def fixed_batches(self, op: str, problem: DepthwiseConv, layout: str = "NCHW") -> list[int]:
        """The batch sizes at which a library exported before kernels took any batch size has this layer's
        ``op`` kernel (empty for a newer library): what an error about a missing kernel should name."""
        want = rec.layer_key(op, problem.key(), self.target, layout)
        sizes = []
        for key in self.kernels:
            try:
                n = rec.batch_of(key)
                k_op, k_problem, k_layout, k_target = json.loads(key)
            except ValueError:  # not a key this pipedp writes: no kernel of this layer
                continue
            if n is not None and rec.layer_key(k_op, k_problem, k_target, k_layout) == want:
                sizes.append(n)
        return sorted(sizes)

    def beats_torch(self, key: str) -> bool:
        """Whether the kernel exported under ``key`` measured faster than torch in its layout when tuned (at the
        batch size it was tuned at; True when not recorded). A timing that carries a decision of its own
        (``"faster": true/false``, e.g. a benchmark's: faster by a margin, and confirmed in fresh rounds) is
        taken as it says."""
        t = self.timings.get(key) or {}
        if isinstance(t.get("faster"), bool):
            return t["faster"]
        us, base = t.get("us"), t.get("torch_us")
        return not (isinstance(us, (int, float)) and isinstance(base, (int, float))) or us < base


def library_key(db: str, name: str, digest: str) -> str:
    """``<database folder>/<library file>@<sha256>``: the library's place in its database, the same in every
    process. The folder is resolved (one key per database however it is spelled), the file is not: a library
    replaced by a link to a copy elsewhere keeps its key, and :func:`library` finds its export record again."""
    return f"{os.path.join(os.path.realpath(db), name)}@{digest}"


def _batch_bound(key: str) -> bool:
    """Whether an export key names a kernel compiled for one batch size (a library from before any batch size)."""
    try:
        return rec.batch_of(key) is not None
    except ValueError:
        return False


INDEX_LIMIT = 2**31  # elements a kernel's 32-bit index arithmetic can address


def batch_limit(problem: DepthwiseConv) -> int:
    """The most samples one call of an any-batch kernel takes: every tensor it indexes (the padded input and
    gradient too, where a schedule keeps them whole) stays under :data:`INDEX_LIMIT` elements."""
    (kh, kw), (ph, pw), (dh, dw) = problem.kernel, problem.padding, problem.dilation
    (oh, ow), o = problem.out_hw, problem.out_channels
    per_sample = max(problem.c * (problem.h + 2 * ph) * (problem.w + 2 * pw),
                     o * (problem.h + (kh - 1) * dh) * (problem.w + (kw - 1) * dw), o * oh * ow)
    return max(1, (INDEX_LIMIT - 1) // per_sample)


def _in_slices(kernel: Callable[..., Any], op: str, limit: int) -> Callable[..., Any]:
    """``kernel`` run on slices of at most ``limit`` samples (views along the batch, the outermost dimension in
    both layouts); grad-weight adds up the slices' weight gradients.

    A slice must start on the kernels' alignment (see :mod:`pipedp.ops.layout`): slices are whole multiples of
    the samples after which every sliced tensor starts on it again, and where ``limit`` is fewer than that,
    the inputs are copied and the output written to an aligned buffer and copied back."""

    def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        n = a.shape[0]
        sliced = (a, b) if op == "wgrad" else (a, out)
        period = math.lcm(*(ALIGNMENT // math.gcd(ALIGNMENT, t[0].numel() * t.element_size()) for t in sliced))
        step = limit // period * period if limit >= period else limit
        for start in range(0, n, step):
            part = slice(start, min(n, start + step))
            if op != "wgrad":  # (activation, weight) -> activation
                dst = out[part]
                tmp = dst if dst.data_ptr() % ALIGNMENT == 0 else torch.empty_like(dst)
                kernel(aligned(a[part]), b, tmp)
                if tmp is not dst:
                    dst.copy_(tmp)
            elif start == 0:  # (activation, activation) -> weight
                kernel(aligned(a[part]), aligned(b[part]), out)
            else:
                partial = torch.empty_like(out)
                kernel(aligned(a[part]), aligned(b[part]), partial)
                out += partial

    return run


def _damaged(db: str, problem: str) -> KernelDbError:
    return KernelDbError(f"{problem}: run tune-kernels again to re-export the kernels, or delete {db}")


def _check_export(db: str, export: dict[str, Any]) -> None:
    """Refuse an export record whose fields the loader could not use, naming the field (a hand edit, a foreign
    or truncated record): a clear error here beats a KeyError or a missing function at the first step."""
    where = f"the export record in {os.path.join(db, rec.RECORDS_FILE)}"
    for field in ("target", "library", "sha256"):
        if not isinstance(export.get(field), str) or not export[field]:
            raise _damaged(db, f"{where} has no {field!r} string (got {export.get(field)!r:.60})")
    name = export["library"]
    if os.path.basename(name) != name or name in (".", ".."):
        raise _damaged(db, f"{where} names the library {name!r:.80}, which is not a file name inside {db}")
    kernels = export.get("kernels")
    if not isinstance(kernels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in kernels.items()):
        raise _damaged(db, f"{where} has 'kernels' {kernels!r:.60}, not a map of kernel keys to function names")
    timings = export.get("timings")
    if timings is not None and not (isinstance(timings, dict) and all(isinstance(t, dict) for t in timings.values())):
        raise _damaged(db, f"{where} has 'timings' {timings!r:.60}, not a map of kernel keys to "
                           f"{{'us': ..., 'torch_us': ...}}")
    _cpu_flags(db, export)


def _cpu_flags(db: str, export: dict[str, Any]) -> set[str]:
    """The vector extensions a CPU export needs (none recorded: none needed)."""
    flags = export.get("cpu_flags", [])
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise _damaged(db, f"the export record in {os.path.join(db, rec.RECORDS_FILE)} has 'cpu_flags' "
                           f"{flags!r:.60}, not a list of CPU feature names")
    return set(flags)


class ExportForOtherCpu(KernelDbError):
    """The database's CPU kernels were exported for vector extensions this CPU lacks (they would not run here)."""


def _check_cpu(db: str, export: dict[str, Any]) -> None:
    """Refuse a CPU export that needs features this CPU lacks, naming them and the command that exports here."""
    missing = sorted(_cpu_flags(db, export) - cpu_flags())
    if not missing or not str(export.get("target", "")).startswith("cpu"):
        return
    raise ExportForOtherCpu(
        f"{db} holds CPU kernels ({export.get('library')}, target {export.get('target')}) exported on a CPU with "
        f"{', '.join(missing)}, which this CPU ({cpu_name()}) lacks, so they cannot run here. Tune and export them "
        f"for this CPU: run `tune-kernels --model <your model> --input-shape N,C,H,W --target cpu --db {db}` on this "
        f"machine (or pass another --db to keep both)")


def _verify(db: str, path: str, expected: str) -> None:
    """The library file is the one exported, byte for byte: anything else is code nobody checked."""
    if not os.path.isfile(path):
        raise _damaged(db, f"the kernel library {path} is missing")
    try:
        digest = sha256(path)
    except OSError as e:
        raise _damaged(db, f"cannot read the kernel library {path} ({e.strerror or e})") from None
    if digest != expected:
        raise _damaged(db, f"refusing to load {path}: its sha256 {digest[:16]}... is not the exported "
                           f"{expected[:16]}... (the file was changed or half-written)")


def _load_module(tvm_ffi: Any, db: str, path: str) -> Any:
    try:
        return tvm_ffi.load_module(path)
    except Exception as e:  # the loader's own error types: a library built for another machine or TVM version
        raise _damaged(db, f"the TVM runtime cannot load {path} ({type(e).__name__}: {e})") from e


def _functions(module: Any, db: str, path: str, symbols: Iterable[str]) -> dict[str, Callable[..., Any]]:
    """Every function the export record names, looked up now, so a record and a library that do not belong
    together fail at load, before any layer runs them."""
    found: dict[str, Callable[..., Any]] = {}
    missing = []
    for sym in sorted(set(symbols)):
        try:
            found[sym] = module[sym]
        except AttributeError:
            missing.append(sym)
    if missing:
        raise _damaged(db, f"{path} lacks {len(missing)} function(s) its export record names "
                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    return found


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
log = logging.getLogger(__name__)
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
    raise _damaged(db, f"{os.path.join(db, rec.RECORDS_FILE)} has no export record of {path} with sha256 "
                       f"{digest[:16]}...")


_unusable: dict[str, str] = {}  # library key -> why it cannot be loaded in this process (warned once)


def library_or_none(key: str) -> KernelLibrary | None:
    """:func:`library`, or None when its database is damaged: what ``kernels="auto"`` layers run on.

    A model swapped onto the kernels may be used in another process (a
    pickled model, a DataLoader worker) whose database was damaged since: its
    layers then fall back to torch, with one warning per library, as a wrap
    with ``kernels="auto"`` would have done.
    """
    if key in _unusable:
        return None
    try:
        return library(key)
    except KernelDbError as e:
        _unusable[key] = str(e)
        log.warning("kernels='auto': torch computes the depthwise layers tuned in %s: %s", key, e)
        return None


def load_library(db: str, device: torch.device) -> KernelLibrary | None:
    """The latest export usable on ``device`` in ``db``, verified and loaded (None if there is none)."""
    want = target_for(device)
    if want is None:
        return None
    records = rec.read(os.path.join(db, rec.RECORDS_FILE))
    if want == "cpu":
        flags = cpu_flags()
        exports = [r for r in records if r.get("kind") == "export" and str(r.get("target", "")).startswith("cpu:")]
        fitting = [r for r in exports if _cpu_flags(db, r) <= flags]
        if exports and not fitting:
            _check_cpu(db, exports[-1])  # raises: the latest export's missing features and how to export here
        export = fitting[-1] if fitting else None
    else:
        export = rec.latest_export(records, want)
    if export is None:
        return None
    _check_export(db, export)
    cached = _loaded.get(library_key(db, export["library"], export["sha256"]))
    return cached if cached is not None else _remember(KernelLibrary(db, export))
