"""Measure: the path of calls from ``pipedp.wrap`` to the end of the first training step, by file.

Every pipedp function is recorded at its first call, in call order, by the
file it lives in; consecutive calls in one file count once. The figures are
how many files the path enters, and how many times it comes back to a file
it had left (a file re-entered): a path that goes down through the layers
(decide, lower, run) and stays in each re-enters few; one that bounces
between modules re-enters many. Loops do not count (a function is recorded
once), so the figure describes the code's structure, not the model's size.

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


def trace_first_step() -> list[str]:
    """The pipedp files of the path from wrap() to the first step's end, first calls only, repeats collapsed."""
    root = os.path.dirname(pipedp.__file__)
    seen: set[Any] = set()
    path: list[str] = []

    def hook(frame: Any, event: str, _: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(root) or code in seen:
            return
        seen.add(code)
        rel = os.path.relpath(code.co_filename, os.path.dirname(root))
        if not path or path[-1] != rel:
            path.append(rel)

    torch.manual_seed(0)
    model = resnet18(width=8)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    sys.setprofile(hook)
    try:
        engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=nn.CrossEntropyLoss(), stages=2, microbatches=2, devices="cpu",
                             progress=False, plan_cache=False)
        engine.train_step(x, y)
    finally:
        sys.setprofile(None)
    return path


def summary(path: list[str]) -> dict[str, Any]:
    """Files entered and files re-entered (a file the path had left and comes back to)."""
    back = sum(1 for i, f in enumerate(path) if f in path[:i])
    return {"files": len(set(path)), "reentries": back, "path": path}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the figures and the path as JSON here")
    args = ap.parse_args(argv)
    report = {"benchmark": "call_path", "plan": "torchvision-style ResNet-18 (width 8), stages=2, microbatches=2",
              **summary(trace_first_step())}
    print(f"files entered: {report['files']}, re-entered: {report['reentries']}")
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
