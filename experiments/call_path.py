"""Measure: the path of calls from ``pipedp.wrap`` to the end of the first training step, by file.

Every pipedp function is recorded at its first call, in call order, by the
file it lives in; consecutive calls in one file count once. The figures are
how many files the path enters, and how many times it comes back to a file
it had left (a file re-entered): a path that goes down through the layers
(decide, lower, run) and stays in each re-enters few; one that bounces
between modules re-enters many. Loops do not count (a function is recorded
once), so the figure describes the code's structure, not the model's size.
A second figure counts the first calls into a file that is still on the
call stack below another file: a callback, or a call back up the layers
(a generator expression handed to another module counts too).

    python -m experiments.call_path --out experiments/results/call_path.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from torch import nn

import pipedp
from pipedp.models import resnet18

from .report import write_json


class Trace:
    """The first calls of pipedp functions, in order, with the files on the call stack at each."""

    def __init__(self, root: str) -> None:
        self.root, self.base = root, os.path.dirname(root)
        self.seen: set[Any] = set()
        self.path: list[str] = []
        self.back: list[tuple[str, str]] = []  # (file called again, file that called it) while it is on the stack
        self.stack: list[str | None] = []

    def __call__(self, frame: Any, event: str, _: Any) -> None:
        if event == "return":
            if self.stack:
                self.stack.pop()
            return
        if event != "call":
            return
        code = frame.f_code
        rel = os.path.relpath(code.co_filename, self.base) if code.co_filename.startswith(self.root) else None
        if rel is not None and code not in self.seen:
            self.seen.add(code)
            if not self.path or self.path[-1] != rel:
                self.path.append(rel)
            on = [f for f in self.stack if f is not None]
            if on and on[-1] != rel and rel in on:
                self.back.append((rel, on[-1]))
        self.stack.append(rel)


def trace_first_step() -> Trace:
    """The path from wrap() to the first step's end: pipedp files by first call, and the calls back up the stack."""
    trace = Trace(os.path.dirname(pipedp.__file__))
    torch.manual_seed(0)
    model = resnet18(width=8)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    sys.setprofile(trace)
    try:
        engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=nn.CrossEntropyLoss(), stages=2, microbatches=2, devices="cpu",
                             progress=False, plan_cache=False)
        engine.train_step(x, y)
    finally:
        sys.setprofile(None)
    return trace


def summary(path: list[str], back: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Files entered and files re-entered (a file the path had left and comes back to); ``back``: the calls
    into a file still on the stack below another (callbacks, calls up the layers), each (callee, caller)."""
    reentries = sum(1 for i, f in enumerate(path) if f in path[:i])
    out: dict[str, Any] = {"files": len(set(path)), "reentries": reentries, "path": path}
    if back is not None:
        out["stack_reentries"] = len(back)
        out["back"] = [list(b) for b in back]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the figures and the path as JSON here")
    args = ap.parse_args(argv)
    report = {"benchmark": "call_path", "plan": "torchvision-style ResNet-18 (width 8), stages=2, microbatches=2",
              **summary((trace := trace_first_step()).path, trace.back)}
    print(f"files entered: {report['files']}, re-entered: {report['reentries']}, "
          f"entered again while on the stack: {report['stack_reentries']}")
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
