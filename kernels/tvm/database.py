"""What the tuner reads back from the records: which kernels are tuned, each one's measurements, the model's history.

Rules, and why:

- A kernel (operator, problem, layout, target) is tuned for a trial budget
  once a ``tuned`` record names it with that budget or a larger one: a
  search for it ended (the budget, an exhausted space, or no improvement for
  ``patience`` batches). A run cut short (Ctrl-C, a killed machine) leaves
  none, and a run with a larger budget finds it not tuned for that, so such
  a run resumes the kernel where it stopped: what it measured counts
  towards the budget and is never measured again.
- Every candidate has a measure record, a failed one too (its ``status``),
  so a resumed search knows every config it tried, and the cost model
  learns to avoid where crashes and wrong results live.
- The cost model of a run starts from every successful measurement of the
  target in the records (:meth:`TuningRecords.history`), across runs, except
  those of the kernels the run searches: those come in as their own
  search's measurements (``tune(resume=...)``), not twice.
- Kernels are named by :func:`pipedp.ops.records.problem_key`, the batch
  size included: a timing compares only with one at the same size.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

from pipedp.ops import records as R
from pipedp.ops.problem import DepthwiseConv

from .cost_model import History, config_features
from .space import InvalidConfig
from .template import get_template
from .tuner import Measurement

__all__ = ["Task", "task_key", "record_key", "measure_record", "tuned_record", "TuningRecords"]

Task = tuple[DepthwiseConv, str, str]  # (problem, operator, layout)


def task_key(task: Task, target: str) -> str:
    """The records' name of one kernel to tune on ``target`` (a target key such as ``cpu:skylake``)."""
    conv, op, layout = task
    return R.problem_key(op, conv.key(), target, layout)


def record_key(r: dict[str, Any]) -> str:
    """The :func:`task_key` of the kernel a measure or tuned record is about."""
    return R.problem_key(r["op"], r["problem"], r["target"], r.get("layout", "NCHW"))


def measure_record(task: Task, target: str, m: Measurement, **extra: Any) -> dict[str, Any]:
    """The record of one candidate: its µs, or its failure (``status``, ``error``, and a null ``us``)."""
    conv, op, layout = task
    ok = math.isfinite(m.us)
    record: dict[str, Any] = {"kind": "measure", "op": op, "problem": conv.key(), "layout": layout, "target": target,
                              "config": m.config, "status": "ok" if ok else m.status, "us": m.us if ok else None,
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if not ok:
        record["error"] = m.error[:300]
    record.update(extra)
    return record


def tuned_record(task: Task, target: str, measurements: list[Measurement], trials: int) -> dict[str, Any]:
    """The mark of a search that ended with a budget of ``trials``: later runs with that budget or a smaller one
    skip this kernel."""
    conv, op, layout = task
    best = min((m.us for m in measurements), default=math.inf)
    return {"kind": "tuned", "op": op, "problem": conv.key(), "layout": layout, "target": target,
            "trials": trials, "measured": len(measurements), "best_us": best if math.isfinite(best) else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _measurement(r: dict[str, Any]) -> Measurement:
    ok = r.get("status", "ok") == "ok"
    return Measurement(dict(r["config"]), float(r["us"]) if ok else math.inf, str(r.get("error", "")),
                       str(r.get("status", "ok")))


def _budget(r: dict[str, Any]) -> float:
    trials = r.get("trials")
    return trials if isinstance(trials, int) and not isinstance(trials, bool) else math.inf


def _target_kind(target: str) -> str:
    """The TVM target kind of a target key (``cuda:sm_90`` -> cuda, ``cpu:...`` -> llvm)."""
    return "cuda" if target.startswith("cuda") else "llvm"


@dataclass
class TuningRecords:
    """The records of a kernel database, read once, seen as the tuner needs them."""

    records: list[dict[str, Any]]

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TuningRecords":
        return cls(R.read(path))

    def tuned(self, target: str, trials: int) -> set[str]:
        """Keys (:func:`task_key`) of the kernels on ``target`` whose search ended with ``trials`` or more (a mark
        without its budget: with any)."""
        return {record_key(r) for r in self.records if r["kind"] == "tuned" and r["target"] == target
                and _budget(r) >= trials}

    def measurements(self, task: Task, target: str) -> list[Measurement]:
        """Every candidate measured for ``task`` on ``target``, failures included, in the order measured."""
        key = task_key(task, target)
        return [_measurement(r) for r in self.records
                if r["kind"] == "measure" and r["target"] == target and record_key(r) == key]

    def history(self, target: str, exclude: Iterable[str] = ()) -> History:
        """Every successful measurement on ``target`` as cost-model points, but those of the ``exclude`` keys.

        A record whose problem or config this version's templates cannot read
        (a knob choice since removed, a foreign problem) is passed over.
        """
        skip = set(exclude)
        history = History()
        spaces: dict[tuple[str, str, str], Any] = {}
        for r in self.records:
            if (r["kind"] != "measure" or r["target"] != target or r.get("status", "ok") != "ok"
                    or record_key(r) in skip):
                continue
            layout = r.get("layout", "NCHW")
            try:
                conv = DepthwiseConv.from_key(r["problem"])
                template = get_template(_target_kind(target), layout)
                sk = (record_key(r), r["op"], layout)
                if sk not in spaces:
                    spaces[sk] = template.space(conv, r["op"])
                space = spaces[sk]
                config = space.complete(r["config"])
                space.check(config)
                x = config_features(space, template, conv, r["op"], config)
            except (InvalidConfig, KeyError, TypeError, ValueError):
                continue
            history.add(History.key(space, r["op"]), [x], [math.log(r["us"]) - math.log(conv.min_bytes(r["op"]))])
        return history
