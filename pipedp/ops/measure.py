"""Measure a round of candidate kernels on this machine, with torch and the TVM runtime only.

    python -m pipedp.ops.measure ROUND_DIR                  # writes ROUND_DIR/results.json
    python -m pipedp.ops.measure ROUND_DIR --out results.json --time-limit 300

The measuring half of "build here, measure there": ``tune-kernels
--remote-round ROUND_DIR`` compiles a round of candidates on a machine with
the compiler (no GPU needed) into one library with a manifest (round.json);
this command, run where the kernels will run (a GPU host without network or
compiler: torch, tvm_ffi and libtvm_runtime*.so from apache-tvm or
PIPEDP_TVM_LIB), checks and times every candidate and writes the results
file that tune-kernels ingests to build the next round.

- The library is loaded only if its sha256 is the one the manifest states.
- Each candidate runs in a worker process with a time limit
  (--candidate-timeout): one that crashes or hangs is recorded as failed
  ("crash", "timeout") and the next one runs in a fresh worker.
- A candidate must match torch on random data before it is timed; a wrong
  one is recorded as failed ("wrong"), never as a time.
- The candidate and torch's kernel in both layouts are timed in turn, round
  after round (CUDA events on a GPU, the host clock on a CPU), medians.
- The results file is rewritten (atomically) after every candidate and
  running again measures only what it lacks, so a run cut short (the
  --time-limit, a killed session) loses nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any, Callable, Sequence

import torch

from .. import console
from ..atomic import write_text
from . import harness, parallel
from .artifact import cpu_flags, cpu_name, sha256
from .problem import OPS, DepthwiseConv
from .runtime import _load_runtime, target_for
from .worker import CandidateFailed, Worker

__all__ = ["main", "measure_round", "measure_candidate", "read_manifest", "read_results", "MANIFEST", "RESULTS",
           "ROUND_FORMAT", "RESULTS_FORMAT", "ROUND_VERSION"]

PROG = "python -m pipedp.ops.measure"
MANIFEST = "round.json"
RESULTS = "results.json"
ROUND_FORMAT, RESULTS_FORMAT = "pipedp-round", "pipedp-round-results"
ROUND_VERSION = 1  # of both files: a reader refuses a newer one


def _bad(path: str, why: str, fix: str) -> ValueError:
    return ValueError(f"{path} {why}: {fix}")


def _load_json(path: str, what: str, fix: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise _bad(path, "does not exist", fix) from None
    except (OSError, ValueError) as e:
        raise _bad(path, f"is not a readable {what} ({e})", fix) from None
    if not isinstance(data, dict):
        raise _bad(path, f"is not a {what} (not a JSON object)", fix)
    return data


def _check_format(path: str, data: dict[str, Any], fmt: str, fix: str) -> None:
    if data.get("format") != fmt:
        raise _bad(path, f"is not a {fmt} file (format {data.get('format')!r:.40})", fix)
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _bad(path, f"has no valid version ({version!r:.40})", fix)
    if version > ROUND_VERSION:
        raise _bad(path, f"is version {version}, written by a newer pipedp (this one reads {ROUND_VERSION})",
                   "upgrade pipedp on this machine")


def _need(path: str, ok: bool, why: str, fix: str) -> None:
    if not ok:
        raise _bad(path, why, fix)


def read_manifest(folder: str) -> dict[str, Any]:
    """The round's manifest, checked field by field (a ValueError naming the file, the field and the fix)."""
    path = os.path.join(folder, MANIFEST)
    fix = f"build the round again with tune-kernels --remote-round {folder}"
    data = _load_json(path, "round manifest", fix)
    _check_format(path, data, ROUND_FORMAT, fix)
    for name in ("target", "library", "sha256"):
        _need(path, isinstance(data.get(name), str) and bool(data[name]), f"has no {name!r} string", fix)
    _need(path, os.path.basename(data["library"]) == data["library"] and data["library"] not in (".", ".."),
          f"names the library {data['library']!r:.60}, not a file in {folder}", fix)
    _need(path, isinstance(data.get("round"), int), "has no round number", fix)
    _need(path, isinstance(data.get("cpu_flags", []), list), "has 'cpu_flags' that is not a list", fix)
    cands = data.get("candidates")
    _need(path, isinstance(cands, list), "has no list of candidates", fix)
    ids = set()
    for c in cands:
        _need(path, isinstance(c, dict) and isinstance(c.get("id"), int) and c["id"] not in ids
              and isinstance(c.get("symbol"), str) and c.get("op") in OPS and isinstance(c.get("problem"), dict)
              and isinstance(c.get("layout"), str) and isinstance(c.get("config"), dict),
              f"has a malformed candidate ({c!r:.80})", fix)
        ids.add(c["id"])
    return data


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and 0 < v < float("inf")


def read_results(path: str) -> dict[str, Any]:
    """A results file, checked entry by entry (a ValueError naming the file, the entry and the fix)."""
    fix = "measure the round again (python -m pipedp.ops.measure ROUND_DIR)"
    data = _load_json(path, "results file", fix)
    _check_format(path, data, RESULTS_FORMAT, fix)
    _need(path, isinstance(data.get("sha256"), str), "has no library sha256", fix)
    entries = data.get("results")
    _need(path, isinstance(entries, list), "has no list of results", fix)
    for e in entries:
        ok = isinstance(e, dict) and isinstance(e.get("id"), int) and isinstance(e.get("status"), str)
        if ok and e["status"] == "ok":
            times = e.get("torch_us")
            ok = _positive(e.get("us")) and isinstance(times, dict) and all(_positive(v) for v in times.values())
        elif ok:
            ok = e.get("us") is None
        _need(path, ok, f"has a malformed result ({e!r:.80})", fix)
    return data


def _device(manifest: dict[str, Any], choice: str) -> torch.device:
    """The device the round's kernels run on here; an error naming the machine they need otherwise."""
    target = manifest["target"]
    if target.startswith("cuda"):
        if choice == "cpu" or not torch.cuda.is_available():
            raise RuntimeError(f"the round is built for {target}: run this where torch sees that GPU")
        here = target_for(torch.device("cuda"))
        if here != target:
            raise RuntimeError(f"the round is built for {target} but this GPU is {here}: build the round with "
                               f"--arch {here.split(':', 1)[1] if here else '...'}")
        return torch.device("cuda")
    if choice == "cuda":
        raise RuntimeError(f"the round is built for the CPU target {target}, not a GPU: leave out --device")
    missing = set(manifest.get("cpu_flags", [])) - cpu_flags()
    if missing:
        raise RuntimeError(f"the round's kernels use {', '.join(sorted(missing))}, which this CPU lacks: build the "
                           f"round on a machine with this machine's CPU")
    return torch.device("cpu")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


@functools.lru_cache(maxsize=1)  # one round's library per worker, loaded at its start
def _library(path: str, cuda: bool) -> Any:
    module = _load_runtime(cuda).load_module(path)
    if not cuda:
        parallel.route(path)  # parallel loops on torch's OpenMP team, as in training
    return module


def _start(threads: int, path: str, cuda: bool) -> None:
    """A worker's setup: the parent's torch thread count, the round's library loaded (not a candidate's time)."""
    torch.set_num_threads(threads)
    _library(path, cuda)


def measure_candidate(path: str, target: str, candidate: dict[str, Any], device: str, rounds: int,
                      min_ms: float) -> dict[str, Any]:
    """Check one candidate against torch, then time it and torch in both layouts in turn (runs in the worker)."""
    kernel = _library(path, target.startswith("cuda"))[candidate["symbol"]]
    conv, op, layout = DepthwiseConv.from_key(candidate["problem"]), candidate["op"], candidate["layout"]
    dev = torch.device(device)
    err = harness.check(kernel, conv, op, dev, layout)
    t = harness.alternate({"us": harness.kernel_fn(kernel, conv, op, dev, layout),
                           "nchw": harness.torch_fn(conv, op, dev, channels_last=False),
                           "nhwc": harness.torch_fn(conv, op, dev, channels_last=True)}, dev, rounds, min_ms)
    return {"us": t["us"], "torch_us": {"nchw": t["nchw"], "nhwc": t["nhwc"]}, "max_err": err}


def _earlier(out: str, manifest: dict[str, Any], device: str) -> dict[str, Any]:
    """Results of this round already in ``out`` (a run cut short), or a fresh results object."""
    fresh = {"format": RESULTS_FORMAT, "version": ROUND_VERSION, "round": manifest["round"],
             "target": manifest["target"], "sha256": manifest["sha256"], "device": device,
             "torch": torch.__version__, "complete": False, "results": []}
    if not os.path.exists(out):
        return fresh
    try:
        old = read_results(out)
    except ValueError:
        return fresh  # a damaged or foreign file is measured over
    return old if old["sha256"] == manifest["sha256"] else fresh


def _line(c: dict[str, Any], entry: dict[str, Any]) -> str:
    p = c["problem"]
    what = f"{c['op']} {p.get('n')},{p.get('c')},{p.get('h')},{p.get('w')} {c['layout']}"
    if entry["status"] == "ok":
        return f"{what}: {entry['us']:.1f} us (torch {min(entry['torch_us'].values()):.1f} us)"
    return f"{what}: {entry['status']} ({entry['error'][:120]})"


def measure_round(folder: str, out: str | None = None, *, device: str = "auto", timeout: float = 60.0,
                  time_limit: float = 480.0, rounds: int = 3, min_ms: float = 20.0,
                  job: Callable[..., dict[str, Any]] | None = None,
                  log: Callable[[str], object] = print) -> dict[str, Any]:
    """Measure every candidate of the round in ``folder`` not yet in ``out``; returns the results written there.

    ``job`` is what each worker runs per candidate (module-level; by
    default :func:`measure_candidate`); tests give one that crashes.
    """
    manifest = read_manifest(folder)
    out = out or os.path.join(folder, RESULTS)
    library = os.path.join(folder, manifest["library"])
    if not os.path.isfile(library):
        raise ValueError(f"the round's library {library} is missing: copy the whole round folder {folder}")
    digest = sha256(library)
    if digest != manifest["sha256"]:
        raise ValueError(f"refusing to load {library}: its sha256 {digest[:16]}... is not the round's "
                         f"{manifest['sha256'][:16]}... (changed or half-copied): copy the round folder again")
    dev = _device(manifest, device)
    results = _earlier(out, manifest, _device_name(dev))
    done = {e["id"] for e in results["results"]}
    todo = [c for c in manifest["candidates"] if c["id"] not in done]
    log(f"round {manifest['round']}: {len(todo)} of {len(manifest['candidates'])} candidate(s) to measure on "
        f"{results['device']}")
    deadline = time.monotonic() + time_limit
    cuda = dev.type == "cuda"
    with Worker(_start, (torch.get_num_threads(), os.path.abspath(library), cuda)) as worker:
        for i, c in enumerate(todo, 1):
            if time.monotonic() > deadline:
                log(f"time limit of {time_limit:g} s reached: {len(todo) - i + 1} candidate(s) left; run this "
                    f"command again to measure them")
                break
            try:
                r = worker.call(job or measure_candidate, (os.path.abspath(library), manifest["target"], c, str(dev),
                                                           rounds, min_ms), timeout)
                entry = {"id": c["id"], "status": "ok", "us": float(r["us"]), "torch_us": r["torch_us"],
                         "max_err": r.get("max_err")}
            except CandidateFailed as e:
                entry = {"id": c["id"], "status": e.status, "us": None, "error": str(e)[:300]}
            results["results"].append(entry)
            results["complete"] = len(results["results"]) == len(manifest["candidates"])
            write_text(out, json.dumps(results, indent=1) + "\n")
            log(f"[{i}/{len(todo)}] {_line(c, entry)}")
    if not os.path.exists(out):  # nothing was left to measure, or nothing could be
        write_text(out, json.dumps(results, indent=1) + "\n")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = console.make_parser(PROG, __doc__)
    p.add_argument("round", help="the round folder tune-kernels --remote-round wrote (round.json and its library)")
    p.add_argument("--out", default="ROUND/results.json", help="where the results go (tune-kernels reads them "
                   "from the round folder)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the GPU for a CUDA round, the CPU for a CPU round")
    p.add_argument("--candidate-timeout", type=float, default=60.0,
                   help="seconds one candidate may take (check and timing) before it is killed as hung")
    p.add_argument("--time-limit", type=float, default=480.0,
                   help="seconds after which no further candidate is started (run again to measure the rest)")
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds of each candidate and torch")
    p.add_argument("--min-ms", type=float, default=20.0, help="milliseconds of calls in each timing")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or not args.min_ms > 0 or not args.candidate_timeout > 0 or not args.time_limit > 0:
        raise ValueError("--rounds must be at least 1 and --min-ms, --candidate-timeout, --time-limit positive")
    out = os.path.join(args.round, RESULTS) if args.out == "ROUND/results.json" else args.out
    results = measure_round(args.round, out, device=args.device, timeout=args.candidate_timeout,
                            time_limit=args.time_limit, rounds=args.rounds, min_ms=args.min_ms)
    ok = sum(e["status"] == "ok" for e in results["results"])
    print(f"{ok} measured, {len(results['results']) - ok} failed; results in {out}"
          + ("" if results["complete"] else " (incomplete: run again to measure the rest)"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 on success, a one-line reason on stderr and non-zero on failure."""
    return console.run(_main, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
