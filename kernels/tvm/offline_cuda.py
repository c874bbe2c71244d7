"""Compile CUDA kernels to a fatbin on a machine without a GPU.

TVM hands generated CUDA source to its CUDA runtime module, which compiles it
with nvcc through ``tvm_callback_cuda_compile``. Where the CUDA runtime
library cannot load (no driver: a build machine, CI), TVM falls back to a
module that keeps the *source*, and the exported library would need a
compiler wherever it is loaded. So here we load TVM's CUDA runtime against a
stub driver (a few entry points that report "no device", built once with the
C compiler; the toolkit's own stubs are used when present) - module creation
then compiles with nvcc for the target's arch and stores the binary, which is
all an exported library needs. Nothing in the stub is ever called to run a
kernel.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import shutil
import subprocess
import tempfile

import tvm
import tvm_ffi

__all__ = ["ensure_cuda_codegen", "CUDA_SOURCE_MARKERS"]

# Strings only CUDA C source has (a compiled fatbin/cubin holds neither).
CUDA_SOURCE_MARKERS = (b"__global__", b'extern "C"')
_DRIVER_SYMBOLS = (
    "cuDeviceGetName cuFuncSetAttribute cuGetErrorName cuGetErrorString cuLaunchKernelEx "
    "cuModuleGetFunction cuModuleLoadData cuModuleUnload cuTensorMapEncodeTiled"
).split()
_ready = False


def _toolkit() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("compiling CUDA kernels needs nvcc on PATH (the CUDA toolkit); none found")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _stub_driver(cache: str) -> str:
    path = os.path.join(cache, "libcuda.so.1")
    if os.path.exists(path):
        return path
    src = os.path.join(cache, "cuda_stub.c")
    with open(src, "w") as f:
        f.write("\n".join(f"int {s}(void) {{ return 100; }}" for s in _DRIVER_SYMBOLS) + "\n")
    tmp = path + f".{os.getpid()}.tmp"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", tmp, src], check=True)
    os.replace(tmp, path)
    return path


def _load(path: str) -> None:
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def ensure_cuda_codegen() -> None:
    """Make ``tvm.compile`` for CUDA targets embed an nvcc-compiled binary, GPU or not."""
    global _ready
    if _ready:
        return
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    importlib.import_module("tvm.support.nvcc")  # registers tvm_callback_cuda_compile

    if tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is None:
        root = _toolkit()
        try:
            ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            stubs = glob.glob(os.path.join(root, "lib*", "stubs", "libcuda.so"))
            cache = os.path.join(tempfile.gettempdir(), f"pipedp-cuda-stub-{os.getuid()}")
            os.makedirs(cache, exist_ok=True)
            _load(stubs[0] if stubs else _stub_driver(cache))
        cudart = sorted(glob.glob(os.path.join(root, "lib*", "libcudart.so.*")))
        if cudart:
            _load(cudart[0])
        _load(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so"))
        if tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is None:
            raise RuntimeError("TVM's CUDA runtime did not register; cannot embed compiled CUDA kernels")
    _ready = True
