"""Non-temporal (streaming) stores for a CPU kernel's output.

A plain store first reads the cache line it writes (write-allocate), so a
kernel whose output does not stay in cache moves its output bytes twice;
a streaming store writes the line without reading it. TVM has no way to
ask for such stores, so this is a pass over the LLVM IR it generates: every
vector store whose address derives from the kernel's output buffer gets
``!nontemporal`` (LLVM then emits ``vmovntps``), each function that streams
ends with ``sfence`` (streaming stores are weakly ordered; the fence makes
them visible before the parallel loop reports done), and the IR is compiled
by TVM's own LLVM (``ffi.Module.load_from_file.ll``). The pass refuses a
kernel in which it found no output store to mark, so a config never claims
streaming it did not get.

Streaming leaves the output in memory rather than cache, so the layer that
reads it next cannot hit in cache: the template offers the knob only for
outputs of at least :data:`MIN_BYTES`, which do not stay in cache anyway.
"""

from __future__ import annotations

import os
import platform
import re
import tempfile
from typing import TYPE_CHECKING, Mapping, Protocol

if TYPE_CHECKING:
    from .builder import Compiled

__all__ = ["MIN_BYTES", "available", "mark", "compile_streaming", "StreamingError"]

MIN_BYTES = 16 << 20  # several times the L2 of the cores a process runs on: such outputs leave the cache anyway

_DEFINE = re.compile(r"^define [^@]*@([\w.$]+)\(")
_VALUE = re.compile(r"%[\w.$]+")
_POINTER = re.compile(r"^\s*(%[\w.$]+) = (?:getelementptr|phi ptr|select|bitcast|addrspacecast)\b(.*)$")
_STORE = re.compile(r"^\s*store <\d+ x (?:float|double|half|bfloat)> [^,]+, ptr (%[\w.$]+)")
_LAMBDA = re.compile(r"@(__tvm_parallel_lambda(?:\.\d+)?)\b")
_METADATA = re.compile(r"^!(\d+) = ", re.M)
_FENCE = "declare void @llvm.x86.sse.sfence()"


class StreamingError(ValueError):
    """No output store to mark: the kernel cannot stream as asked."""


def available() -> bool:
    """Streaming stores (with an ``sfence``) are an x86-64 feature of this pass."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _functions(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Function name -> (first, last) line of its body."""
    out: dict[str, tuple[int, int]] = {}
    start, name = -1, ""
    for i, line in enumerate(lines):
        m = _DEFINE.match(line)
        if m:
            start, name = i, m.group(1)
        elif line == "}" and start >= 0:
            out[name] = (start, i)
            start = -1
    return out


def _derived(lines: list[str], first: int, last: int, root: str) -> set[str]:
    """Values in a function body that are addresses within buffer ``root`` (GEPs, phis, selects of it)."""
    found = {root}
    changed = True
    while changed:
        changed = False
        for line in lines[first:last]:
            m = _POINTER.match(line)
            if m and m.group(1) not in found and any(v in found for v in _VALUE.findall(m.group(2))):
                found.add(m.group(1))
                changed = True
    return found


def mark(ll: str, kernels: Mapping[str, str]) -> str:
    """``ll`` with the output stores of each kernel made non-temporal.

    ``kernels`` maps a kernel's symbol to the name of its output buffer
    (``y`` for forward, ``dx`` for grad-input). The kernel's code is its
    ``<symbol>_compute_`` function (or its FFI wrapper, where that was
    inlined) and the parallel-loop bodies it launches; TVM names the output
    pointer after the buffer in each of them.
    """
    lines = ll.split("\n")
    funcs = _functions(lines)
    ids = [int(i) for i in _METADATA.findall(ll)]
    tag = (max(ids) + 1) if ids else 0
    fenced: set[str] = set()
    for symbol, buffer in kernels.items():
        names = [n for n in (f"{symbol}_compute_", f"__tvm_ffi_{symbol}") if n in funcs]
        if not names:
            raise StreamingError(f"kernel {symbol}: no function of that name in the generated code")
        for n in list(names):
            first, last = funcs[n]
            names += [m for line in lines[first:last] for m in _LAMBDA.findall(line) if m in funcs and m not in names]
        marked = 0
        for n in names:
            first, last = funcs[n]
            here = _derived(lines, first, last, f"%{buffer}")
            for i in range(first, last):
                m = _STORE.match(lines[i])
                if m and m.group(1) in here and "!nontemporal" not in lines[i]:
                    lines[i] += f", !nontemporal !{tag}"
                    marked += 1
                    fenced.add(n)
        if not marked:
            raise StreamingError(f"kernel {symbol}: no vector store to its output {buffer!r} to stream")
    out: list[str] = []
    current = ""
    for line in lines:
        m = _DEFINE.match(line)
        if m:
            current = m.group(1)
        if current in fenced and re.match(r"^\s*ret\b", line):
            out.append("  call void @llvm.x86.sse.sfence()")
        out.append(line)
    text = "\n".join(out)
    if _FENCE not in text:
        text += "\n" + _FENCE + "\n"
    return text + f"\n!{tag} = !{{i32 1}}\n"


class LLVMModule(Protocol):
    """A compiled CPU module that shows the LLVM IR it was compiled from."""

    def inspect_source(self, fmt: str = "") -> str: ...


def compile_streaming(module: LLVMModule, kernels: Mapping[str, str]) -> Compiled:
    """A compiled CPU module rebuilt from its LLVM IR with ``kernels``' output stores streaming."""
    import tvm_ffi

    text = mark(module.inspect_source("ll"), kernels)
    fd, path = tempfile.mkstemp(prefix="pipedp-stream-", suffix=".ll")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return tvm_ffi.get_global_func("ffi.Module.load_from_file.ll")(path, "ll")
    finally:
        os.unlink(path)
