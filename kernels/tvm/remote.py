"""Build here, measure there: tuning rounds compiled on this machine and measured on another, with no network.

An air-gapped GPU host (torch and the TVM runtime, no compiler) can still
steer the search. A round is one step of every kernel's search, split
across the two machines:

1. :func:`build_round` (here; nvcc is enough for CUDA, no GPU): for every
   kernel not tuned yet, its search (:class:`~.tuner.Search`) is rebuilt
   from the records (its own measurements, the model over the target's
   history) and proposes its next batch; every candidate of every kernel is
   compiled into one shared library, written beside a manifest
   (``round.json``: target, library and its sha256, and per candidate its
   symbol, operator, problem, layout and config).
2. ``python -m pipedp.ops.measure ROUND_DIR`` (there; runtime only, see
   :mod:`pipedp.ops.measure`) checks and times every candidate against
   torch and writes ``results.json``.
3. :func:`ingest` (here) appends each result to the records as a
   measurement of its config, failures with their status, and the next
   :func:`build_round` proposes from them.

Rules, and why:

- One library, one manifest and one results file per round: small to
  carry, one compiler run (one nvcc call for CUDA) to build.
- The library's sha256 is in the manifest and in the results: the measuring
  side refuses a library that is not the one built, :func:`ingest` refuses
  results of another round, and a round is ingested once (a ``round``
  record remembers it), however often the command is repeated.
- A candidate that does not compile is recorded as failed here and not
  shipped; if the round's module fails to compile as a whole, each
  candidate is compiled alone to find the ones at fault.
- A kernel is tuned when it has its trial budget of measurements, when its
  space is exhausted, or when ``patience`` rounds in a row did not improve
  its best by 0.5%, as :func:`~.tuner.tune` stops; then a ``tuned`` record
  marks it and later rounds skip it.
- A round's search is a function of the records and the seed (its random
  stream is seeded with the seed and the kernel's number of measurements),
  so building a round again from the same records proposes the same batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import tvm

from pipedp.atomic import write_text
from pipedp.ops import records as R
from pipedp.ops.artifact import cpu_flags
from pipedp.ops.measure import MANIFEST, RESULTS, ROUND_FORMAT, ROUND_VERSION, read_manifest, read_results
from pipedp.ops.problem import DepthwiseConv

from .builder import Compiled, compile_module, schedule, streamed
from .cost_model import CostModel, XGBoostModel
from .database import Task, TuningRecords, measure_record, record_key, task_key, tuned_record
from .export import versions, write_library
from .target import Target, target_key
from .tuner import Measurement, Search, history_key

__all__ = ["Round", "Ingested", "build_round", "write_round", "compile_candidates", "ingest", "ingested",
           "round_state", "clear"]


@dataclass
class Round:
    """A round written to a folder: its number, manifest, and what it holds."""

    folder: str
    manifest: dict[str, Any]
    kernels: int  # kernels with candidates in the round
    failed: int = 0  # candidates that did not compile (recorded, not shipped)

    @property
    def library(self) -> str:
        return os.path.join(self.folder, self.manifest["library"])


@dataclass
class Ingested:
    """What :func:`ingest` took from a results file."""

    round: int
    measured: int = 0
    failed: int = 0
    again: bool = False  # the round was ingested before: nothing appended
    statuses: dict[str, int] = field(default_factory=dict)


def round_state(folder: str) -> str:
    """``none`` (no round), ``built`` (not measured yet), ``measured`` (results of this round are there)."""
    if not os.path.exists(os.path.join(folder, MANIFEST)):
        return "none"
    manifest = read_manifest(folder)
    results = os.path.join(folder, RESULTS)
    if not os.path.exists(results):
        return "built"
    if read_results(results)["sha256"] != manifest["sha256"]:
        raise ValueError(f"{results} holds the results of another round than {os.path.join(folder, MANIFEST)} "
                         f"(library sha256 differs): measure this round again (python -m pipedp.ops.measure "
                         f"{folder}), or delete {folder} to start a new round")
    return "measured"


def _ingested(records: list[dict[str, Any]], digest: str) -> bool:
    return any(r["kind"] == "round" and r.get("sha256") == digest for r in records)


def ingested(folder: str, records_path: str) -> bool:
    """Whether the round in ``folder`` is in the records already (its results were ingested)."""
    return _ingested(R.read(records_path), read_manifest(folder)["sha256"])


def ingest(folder: str, records_path: str, target: str) -> Ingested:
    """Append the round's results in ``folder`` to the records (once), as measurements of their configs."""
    manifest = read_manifest(folder)
    results = read_results(os.path.join(folder, RESULTS))
    if results["sha256"] != manifest["sha256"]:
        raise ValueError(f"{os.path.join(folder, RESULTS)} is not of the round in {folder}: measure it again")
    if manifest["target"] != target:
        raise ValueError(f"the round in {folder} is built for {manifest['target']}, this run tunes for {target}: "
                         f"give the same --target/--arch as the run that built it")
    done = Ingested(manifest["round"])
    if _ingested(R.read(records_path), manifest["sha256"]):
        done.again = True
        return done
    candidates = {c["id"]: c for c in manifest["candidates"]}
    tool = {**manifest.get("versions", {}), "torch": results.get("torch", "?")}
    for entry in results["results"]:
        c = candidates.get(entry["id"])
        if c is None:
            continue  # (read_results checked the entry; an id not in the manifest is not ours to record)
        task: Task = (DepthwiseConv.from_key(c["problem"]), c["op"], c["layout"])
        ok = entry["status"] == "ok"
        m = Measurement(c["config"], float(entry["us"]) if ok else math.inf, str(entry.get("error", "")),
                        entry["status"])
        extra = {"torch_us": entry["torch_us"], "versions": tool} if ok else {}
        R.append(records_path, measure_record(task, target, m, device=results.get("device", "?"),
                                              round=manifest["round"], **extra))
        done.measured += ok
        done.failed += not ok
        done.statuses[entry["status"]] = done.statuses.get(entry["status"], 0) + 1
    R.append(records_path, {"kind": "round", "target": target, "round": manifest["round"],
                            "sha256": manifest["sha256"], "candidates": len(candidates), "measured": done.measured,
                            "failed": done.failed, "device": results.get("device", "?"),
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return done


def _stale_rounds(records: Iterable[dict[str, Any]], key: str) -> int:
    """Rounds in a row, the latest last, that did not improve the kernel's best by 0.5% (counted from its last
    ``tuned`` record: a larger budget gives the search ``patience`` rounds again)."""
    best, stale = math.inf, 0
    rounds: list[tuple[Any, float]] = []  # (round, its best) in the order measured; None: a tuned record
    for r in records:
        if r["kind"] not in ("measure", "tuned") or record_key(r) != key:
            continue
        if r["kind"] == "tuned":
            rounds.append((None, math.inf))
        elif "round" in r:
            us = r["us"] if r.get("status", "ok") == "ok" else math.inf
            if rounds and rounds[-1][0] == r["round"]:
                rounds[-1] = (r["round"], min(rounds[-1][1], us))
            else:
                rounds.append((r["round"], us))
    for number, us in rounds:
        if number is None:
            stale = 0
        elif us < best * 0.995:
            best, stale = us, 0
        else:
            stale += 1
    return stale



def _fail_record(task: Task, target: str, config: dict[str, Any], e: Exception, number: int) -> dict[str, Any]:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return measure_record(task, target, Measurement(config, math.inf, f"{type(e).__name__}: {first}", "error"),
                          round=number)


def compile_candidates(funcs: dict[str, Any], streams: dict[str, str],
                       target: Target) -> tuple[Compiled, set[str]]:
    """The round's module compiled; if that fails, each function alone to find the ones that do not compile."""
    try:
        return compile_module(tvm.IRModule(funcs), target, streams), set()
    except Exception:  # one bad candidate must not sink the round: find it
        bad = set()
        for sym, f in funcs.items():
            try:
                compile_module(tvm.IRModule({sym: f}), target, {sym: streams[sym]} if sym in streams else None)
            except Exception:
                bad.add(sym)
        good = {s: f for s, f in funcs.items() if s not in bad}
        if not good:
            raise
        return compile_module(tvm.IRModule(good), target, {s: v for s, v in streams.items() if s in good}), bad


def _next_number(records: list[dict[str, Any]], target: str) -> int:
    return 1 + max((r["round"] for r in records if r["kind"] == "round" and r["target"] == target
                    and isinstance(r.get("round"), int)), default=0)


@dataclass
class _Batch:
    """The candidates of a round, scheduled: functions by symbol, which of them stream, and where each came from."""

    funcs: dict[str, Any] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=dict)
    origin: dict[str, tuple[Task, dict[str, Any]]] = field(default_factory=dict)
    kernels: int = 0
    failed: int = 0
    number: int = 1  # the round's number


def _propose(tasks: list[Task], target: Target, records_path: str, trials: int, batch: int, patience: int, seed: int,
             cost_model: Callable[[int], CostModel]) -> _Batch | None:
    """Every unfinished kernel's next batch, scheduled (failures recorded); None when every kernel is tuned."""
    key = target_key(target)
    db = TuningRecords.load(records_path)
    tuned = db.tuned(key, trials)
    todo = [t for t in tasks if task_key(t, key) not in tuned]
    history = db.history(key, exclude={task_key(t, key) for t in todo})
    number = _next_number(db.records, key)
    out = _Batch(number=number)
    for task in todo:
        conv, op, layout = task
        earlier = db.measurements(task, key)
        search = Search(conv, op, target, layout=layout, seed=seed * 1_000_003 + len(earlier), cost_model=cost_model,
                        prior=history.get(history_key(conv, op, target, layout)))
        search.resume(earlier)
        left = trials - len(search.measurements)
        configs: list[dict[str, Any]] = []
        if left > 0 and _stale_rounds(db.records, task_key(task, key)) < patience:
            search.refit()
            configs = search.propose(min(batch, left))
        if not configs:
            R.append(records_path, tuned_record(task, key, search.measurements, trials))
            continue
        out.kernels += 1
        for config in configs:
            sym = f"pipedp_c{len(out.origin) + out.failed}"
            try:
                out.funcs[sym] = schedule(conv, op, config, target, symbol=sym).mod[sym]
            except Exception as e:  # (the search proposes valid configs: a scheduling error is a bug to record)
                R.append(records_path, _fail_record(task, key, config, e, number))
                out.failed += 1
                continue
            out.origin[sym] = (task, config)
            if stream := streamed(op, config):
                out.streams[sym] = stream
    return out if out.kernels else None


def build_round(folder: str, tasks: list[Task], target: Target, records_path: str, *, trials: int, batch: int,
                patience: int = 4, seed: int = 0,
                cost_model: Callable[[int], CostModel] = XGBoostModel) -> Round | None:
    """The next round of every kernel in ``tasks`` not tuned yet, written to ``folder``; None when all are tuned.

    Kernels that reach their end here (budget, exhausted space, patience)
    get their ``tuned`` record.
    """
    key = target_key(target)
    for _ in range(3):  # a batch none of whose candidates schedules is recorded as failed, and proposed anew
        found = _propose(tasks, target, records_path, trials, batch, patience, seed, cost_model)
        if found is None:
            return None
        if found.origin:
            break
    else:
        raise RuntimeError("three batches in a row had no candidate that could be scheduled (see the failed "
                           f"records in {records_path}): report this as a bug of the templates")
    lib, bad = compile_candidates(found.funcs, found.streams, target)
    for sym in sorted(bad):
        task, config = found.origin.pop(sym)
        R.append(records_path, _fail_record(task, key, config, RuntimeError("does not compile"), found.number))
        found.failed += 1
    entries = [{"id": i, "symbol": sym, "op": task[1], "problem": task[0].key(), "layout": task[2], "config": config}
               for i, (sym, (task, config)) in enumerate(found.origin.items())]
    return Round(folder, write_round(folder, lib, found.number, key, target, entries), found.kernels, found.failed)


def write_round(folder: str, lib: Compiled, number: int, key: str, target: Target,
                entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The library, then the manifest naming it (atomically), the previous round's files removed; ``entries``
    are the candidates (id, symbol, op, problem, layout, config) :func:`~pipedp.ops.measure.read_manifest` checks.

    A crash in between leaves either the previous round (ingested, so the
    next run builds this one again) or this one, never a results file beside
    a manifest of another round.
    """
    os.makedirs(folder, exist_ok=True)
    name = f"kernels-round-{number}.so"
    digest = write_library(lib, folder, name)
    manifest = {"format": ROUND_FORMAT, "version": ROUND_VERSION, "round": number, "target": key,
                "library": name, "sha256": digest, "versions": versions(),
                "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "sse4")))
                if target.kind.name != "cuda" else [], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "candidates": entries}
    with contextlib.suppress(FileNotFoundError):  # the last round's results go first: never beside the new manifest
        os.unlink(os.path.join(folder, RESULTS))
    write_text(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for f in os.listdir(folder):
        if f.startswith("kernels-round-") and f.endswith(".so") and f != name:
            os.unlink(os.path.join(folder, f))
    return manifest


def clear(folder: str) -> None:
    """Remove a finished round's files (manifest, library, results) from ``folder``."""
    if not os.path.isdir(folder):
        return
    for f in os.listdir(folder):
        if f in (MANIFEST, RESULTS) or (f.startswith("kernels-round-") and f.endswith(".so")):
            os.unlink(os.path.join(folder, f))
