"""``tune-kernels``: find a model's depthwise convolutions, tune them, export one library per target.

    tune-kernels --model mobilenet_v2 --input-shape 32,3,32,32 --target cpu --trials 64
    tune-kernels --model path/to/net.py:build --input-shape 8,3,224,224 --target cuda --ops fwd,dgrad

Needs the 'tvm' extra (apache-tvm, apache-tvm-ffi, xgboost; xgboost-cpu on
Linux and Windows): pip install 'pipedp[tvm]'. Training with the exported kernels needs only
the TVM runtime.

On CPU both activation layouts are tuned by default (torch's own depthwise
convolution is far faster channels_last there, and so are ours): train with
``model.to(memory_format=torch.channels_last)`` and inputs in that format to
run the NHWC kernels.

An exported kernel serves every batch size of its layer; the shape each
layer will mostly see is the best one to tune at: with
pipedp.wrap(microbatches=M) that is the microbatch (batch / M). Every measurement is appended to the records as
it is made, so Ctrl-C keeps what was measured and still exports it.

A run resumes: kernels the records have tuned with --trials or more are
skipped (a larger --trials tunes them further, --retune for --trials more),
a kernel cut short goes on where it stopped, and the cost model starts from
every measurement of the target in the records. Each candidate is built and measured in a worker process with a
time limit (--candidate-timeout): one that crashes or hangs is recorded as
failed and the run goes on.

Build here, measure there (a GPU host without compiler or network):

    tune-kernels --model mobilenet_v2 --input-shape 128,3,32,32 --target cuda --arch sm_90 --remote-round round
    python -m pipedp.ops.measure round        # on the GPU host: writes round/results.json
    tune-kernels ... --remote-round round     # the same line again: ingests, builds the next round

until it reports every kernel tuned and exports the library.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from pipedp import console
from pipedp.ops import records as R
from pipedp.ops.problem import OPS, DepthwiseConv

from . import allocator  # (stdlib only: no compiler module is imported before the extra is checked)

if TYPE_CHECKING:
    from .database import Task
    from .target import Target

__all__ = ["main", "build_parser", "find_depthwise", "load_model", "parse_input_shape"]

PROG = "tune-kernels"
EXTRA = "tvm"
_NEEDS = ("tvm", "tvm_ffi", "xgboost")  # what the 'tvm' extra installs, checked before the compiler is imported


def load_model(spec: str, num_classes: int = 10) -> nn.Module:
    """A zoo name (:data:`pipedp.models.MODELS`) or ``path/to/file.py:factory`` returning an nn.Module."""
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path, factory = spec.split(":", 1)
        if not os.path.exists(path):
            raise ValueError(f"--model {spec}: no file {path}")
        mod_spec = importlib.util.spec_from_file_location("pipedp_user_model", path)
        if mod_spec is None or mod_spec.loader is None:
            raise ValueError(f"--model {spec}: {path} cannot be imported")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        fn = getattr(module, factory, None)
        if not callable(fn):
            raise ValueError(f"--model {spec}: {path} has no function {factory!r}")
        model = fn()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {spec}: {factory}() returned {type(model).__name__}, not an nn.Module")
        return model
    from pipedp.models import MODELS, get_model

    if spec not in MODELS:
        raise ValueError(f"--model {spec!r}: not a zoo model ({', '.join(sorted(MODELS))}) nor file.py:factory")
    return get_model(spec, num_classes=num_classes)


def find_depthwise(model: nn.Module, shape: tuple[int, ...]) -> list[DepthwiseConv]:
    """Every distinct depthwise convolution ``model`` runs on an input of ``shape``, in order."""
    from pipedp.ops.swap import is_depthwise

    found: list[DepthwiseConv] = []
    hooks = []

    def hook(m: nn.Conv2d, args: tuple[Any, ...]) -> None:
        n, c, h, w = args[0].shape
        p = DepthwiseConv(n, c, h, w, multiplier=m.out_channels // c, kernel=tuple(m.kernel_size),
                          stride=tuple(m.stride), padding=tuple(m.padding), dilation=tuple(m.dilation))
        if p not in found:
            found.append(p)

    for m in model.modules():
        if is_depthwise(m):
            hooks.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(shape))
    finally:
        for h in hooks:
            h.remove()
    return found


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``N,C,H,W`` as given to ``--input-shape`` (a ValueError naming the option for anything else)."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"--input-shape {text!r}: give N,C,H,W, e.g. 32,3,32,32")
    return shape


def _parse_ops(text: str) -> list[str]:
    ops = [o for o in text.split(",") if o]
    if not ops or any(o not in OPS for o in ops):
        raise ValueError(f"--ops {text!r}: choose from {','.join(OPS)}")
    return ops


def build_parser() -> argparse.ArgumentParser:
    """tune-kernels' options (every one with its default shown in --help)."""
    from pipedp.ops.runtime import default_db

    p = console.make_parser(PROG, __doc__)
    required = dict(required=True, default=argparse.SUPPRESS)  # (no default to show)
    p.add_argument("--model", **required, help="zoo name (e.g. mobilenet_v2) or path/to/file.py:factory (required)")
    p.add_argument("--input-shape", **required, help="N,C,H,W the model is called with (required)")
    p.add_argument("--target", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: this host's CPU; cuda: the GPU torch sees (candidates are measured on it)")
    p.add_argument("--arch", default="auto", help="CUDA arch such as sm_90 (--target cuda); auto: the arch of the GPU "
                   "torch sees")
    p.add_argument("--trials", type=int, default=64, help="measured candidates per kernel")
    p.add_argument("--batch", type=int, default=8, help="candidates per tuning round")
    p.add_argument("--db", default=default_db(), help="folder of the records and exported libraries")
    p.add_argument("--ops", default=",".join(OPS), help="operators to tune: fwd (forward), dgrad (grad-input), "
                   "wgrad (grad-weight)")
    p.add_argument("--layouts", default="auto",
                   help="activation layouts to tune, nchw,nhwc (auto: every layout the target has a template for; "
                        "a channels_last model runs the nhwc kernels)")
    allocator.add_argument(p)
    p.add_argument("--num-classes", type=int, default=10, help="classes of a zoo model's classifier")
    p.add_argument("--seed", type=int, default=0, help="seed of the search (the same seed proposes the same configs)")
    p.add_argument("--retune", action="store_true", help="tune kernels the records already have tuned again, for "
                   "--trials more candidates (without it a kernel tuned with --trials or more is skipped)")
    p.add_argument("--candidate-timeout", type=float, default=60.0, help="seconds a candidate's build, check and "
                   "timing may take before it is killed and recorded as hung")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="build and measure each candidate in a worker process, so one that crashes or hangs fails "
                        "alone (--no-isolate: in this process, no time limit)")
    p.add_argument("--remote-round", default="off", metavar="DIR",
                   help="build here, measure there: ingest DIR/results.json if there, write the next round of "
                        "candidates to DIR for python -m pipedp.ops.measure DIR on the machine that runs the kernels, "
                        "and export once every kernel is tuned (off: measure here)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar of the "
                   "trials")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: 0 on success, a one-line reason on stderr and non-zero on failure."""
    return console.run(_main, argv, PROG)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    shape = parse_input_shape(args.input_shape)
    ops = _parse_ops(args.ops)
    if args.trials < 1 or args.batch < 1:
        raise ValueError("--trials and --batch must be at least 1")
    if not args.candidate_timeout > 0:
        raise ValueError(f"--candidate-timeout {args.candidate_timeout}: give a positive number of seconds")
    remote = None if args.remote_round == "off" else args.remote_round
    if remote is not None and args.retune:
        raise ValueError("--retune does not go with --remote-round: give a larger --trials to tune the kernels "
                         "further")
    for module in _NEEDS:
        console.require(module, EXTRA, PROG)
    from .target import make_target, target_key

    arch, device = _device(args, remote is not None)
    target = make_target(args.target, arch)
    layouts = _layouts(args.layouts, target)
    key = target_key(target)
    problems = find_depthwise(load_model(args.model, args.num_classes), shape)
    if not problems:
        print(f"{args.model} has no depthwise convolution: nothing to tune")
        return 0
    os.makedirs(args.db, exist_ok=True)
    records_path = os.path.join(args.db, R.RECORDS_FILE)
    tasks: list[Task] = [(p, op, layout) for p in problems for op in ops for layout in layouts]
    print(f"{len(problems)} distinct depthwise convolution(s) x {len(ops)} op(s) x {'/'.join(layouts)} on {key}; "
          f"records in {records_path}")
    if remote is not None:
        return _remote_round(remote, tasks, target, records_path, args)
    if not allocator.measure_with(args.allocator):
        print(f"{PROG}: not glibc; measuring with the allocator as it is", file=sys.stderr)
    interrupted = _tune_all(tasks, target, device, records_path, args)
    _export(args.db, target, tasks, device)
    return 130 if interrupted else 0


def _device(args: argparse.Namespace, remote: bool) -> tuple[str | None, torch.device | None]:
    """The CUDA arch (None for a CPU) and the device candidates are measured on here (None: on another machine)."""
    if args.target != "cuda":
        return None, None if remote else torch.device("cpu")
    if remote:
        if args.arch == "auto":
            raise ValueError("--remote-round with --target cuda needs the GPU host's --arch, e.g. sm_90 (there: "
                             "python -c 'import torch; print(torch.cuda.get_device_capability())')")
        return args.arch, None
    if not torch.cuda.is_available():
        raise RuntimeError("--target cuda measures candidates on the GPU: run where torch sees one, or build rounds "
                           "here and measure them there with --remote-round DIR")
    major, minor = torch.cuda.get_device_capability()
    return (args.arch if args.arch != "auto" else f"sm_{major}{minor}"), torch.device("cuda")


def _export(db: str, target: Target, tasks: list[Task], device: torch.device | None) -> None:
    """Export the best kernel of every tuned problem for ``target``, and print this run's kernels."""
    from .export import export
    from .target import target_key

    exported = export(db, target)
    _print_table(tasks, os.path.join(db, R.RECORDS_FILE), device, target_key(target))
    if exported:
        print(f"exported {len(exported['kernels'])} kernel(s) to {os.path.join(db, exported['library'])} "
              f"(sha256 {exported['sha256'][:16]}...)")


def _tune_all(tasks: list[Task], target: Target, device: torch.device, records_path: str,
              args: argparse.Namespace) -> bool:
    """Tune every kernel the records do not have tuned (all with --retune), appending each candidate as measured.

    Returns whether Ctrl-C cut the run short (what was measured is kept,
    and the next run resumes the kernel it was tuning).
    """
    from tqdm import tqdm

    from .builder import LocalBuilder
    from .database import TuningRecords, measure_record, task_key, tuned_record
    from .export import versions as tool_versions
    from .isolated import DeferredBuilder, ProcessRunner
    from .runner import LocalRunner
    from .runner import torch_us as time_torch
    from .target import target_key
    from .tuner import Measurement, TuneResult, tune

    key = target_key(target)
    db = TuningRecords.load(records_path)
    tuned = db.tuned(key, args.trials)
    todo = tasks if args.retune else [t for t in tasks if task_key(t, key) not in tuned]
    if len(todo) < len(tasks):
        print(f"{len(tasks) - len(todo)} of {len(tasks)} kernel(s) already tuned with --trials {args.trials} or more "
              f"in {records_path}: skipped (a larger --trials tunes them further, --retune again)")
    history = db.history(key, exclude={task_key(t, key) for t in todo})  # the model's prior, across runs
    bar = tqdm(total=len(todo) * args.trials, disable=not args.progress, unit="trial")
    torch_us: dict[tuple[DepthwiseConv, str], dict[str, float]] = {}
    versions = tool_versions()
    runner = ProcessRunner(timeout=args.candidate_timeout, reuse_memory=args.allocator == "reuse") \
        if args.isolate else LocalRunner()
    builder = DeferredBuilder() if args.isolate else LocalBuilder()

    def baseline(prob: DepthwiseConv, op: str) -> dict[str, float]:
        """Torch's µs in both layouts, timed once per (problem, op), when a first candidate of it succeeds."""
        if (prob, op) not in torch_us:
            torch_us[(prob, op)] = {"nchw": time_torch(prob, op, device, channels_last=False),
                                    "nhwc": time_torch(prob, op, device, channels_last=True)}
        return torch_us[(prob, op)]

    try:
        for task in todo:
            prob, op, layout = task

            def on_measure(m: Measurement, r: TuneResult, task: Task = task) -> None:
                bar.update(1)
                ok = math.isfinite(m.us)
                extra = {"torch_us": baseline(task[0], task[1]), "versions": versions} if ok else {}
                R.append(records_path, measure_record(task, key, m, **extra))
                best = r.best
                p = task[0]
                bar.set_postfix_str(f"{task[1]} {task[2]} {p.c}x{p.h}x{p.w}/s{p.stride[0]}: "
                                    f"{best.us if best else float('nan'):.1f} us")

            earlier = db.measurements(task, key)
            budget = len(earlier) + args.trials if args.retune else args.trials
            before = bar.n
            result = tune(prob, op, target, device, trials=budget, batch=args.batch, seed=args.seed,
                          on_measure=on_measure, layout=layout, history=history, builder=builder, runner=runner,
                          resume=earlier)
            R.append(records_path, tuned_record(task, key, result.measurements, budget))
            bar.update(max(0, args.trials - (bar.n - before)))  # an early stop or a resumed kernel skips the rest
    except KeyboardInterrupt:
        print("\ninterrupted: exporting what was measured (the next run resumes)", file=sys.stderr)
        return True
    finally:
        bar.close()
        if isinstance(runner, ProcessRunner):
            runner.close()
    return False


def _remote_round(folder: str, tasks: list[Task], target: Target, records_path: str,
                  args: argparse.Namespace) -> int:
    """Ingest the round in ``folder`` if it was measured, then build the next one, or export when all are tuned."""
    from pipedp.ops.measure import RESULTS, read_manifest

    from . import remote
    from .target import target_key

    key = target_key(target)
    state = remote.round_state(folder)
    if state == "measured":
        done = remote.ingest(folder, records_path, key)
        print(f"round {done.round} was ingested before: nothing added" if done.again else
              f"round {done.round}: {done.measured} candidate(s) measured, {done.failed} failed "
              f"({', '.join(f'{v} {k}' for k, v in sorted(done.statuses.items()))}), added to {records_path}")
    elif state == "built" and not remote.ingested(folder, records_path):
        m = read_manifest(folder)
        raise RuntimeError(f"{folder} holds round {m['round']} ({len(m['candidates'])} candidates), not measured yet: "
                           f"run python -m pipedp.ops.measure {folder} where the kernels run and bring "
                           f"{os.path.join(folder, RESULTS)} back, or delete {folder} to build the round again")
    built = remote.build_round(folder, tasks, target, records_path, trials=args.trials, batch=args.batch,
                               seed=args.seed)
    if built is None:
        remote.clear(folder)
        print(f"every kernel is tuned (its --trials measured, or no better for 4 rounds): nothing left to measure "
              f"in {folder}")
        _export(args.db, target, tasks, None)
        return 0
    n = len(built.manifest["candidates"])
    print(f"round {built.manifest['round']}: {n} candidate(s) of {built.kernels} kernel(s) in {built.library} "
          f"({os.path.getsize(built.library) / 1e6:.1f} MB)"
          + (f"; {built.failed} did not compile (recorded as failed)" if built.failed else ""))
    print(f"measure it where the kernels run (torch and the TVM runtime suffice), bring {folder}/{RESULTS} back and "
          f"run this command again:\n  python -m pipedp.ops.measure {folder}")
    return 0


def _layouts(spec: str, target: Target) -> list[str]:
    from .template import layouts_for

    have = layouts_for(target)
    if spec == "auto":
        return list(have)
    want = [v.strip().upper() for v in spec.split(",") if v.strip()]
    if not want or any(v not in have for v in want):
        raise ValueError(f"--layouts {spec!r}: {target.kind.name} kernels come in {','.join(v.lower() for v in have)}")
    return want


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def _print_table(tasks: list[Task], records_path: str, device: torch.device | None, key: str) -> None:
    """One row per (problem, op): our best per layout, torch per layout, and best-vs-best speedup (from the records,
    so kernels tuned by earlier runs are shown too)."""
    from .database import task_key
    from .roofline import bound_us

    best = R.best(R.read(records_path))
    head = ["problem (N,C,H,W k/s/p x mult)", "op", "ours NCHW", "ours NHWC", "torch NCHW", "torch NHWC", "speedup",
            "bw bound us"]
    ours: dict[tuple[DepthwiseConv, str], dict[str, float]] = {}
    base: dict[tuple[DepthwiseConv, str], dict[str, float]] = {}
    for task in tasks:
        p, op, layout = task
        r = best.get(task_key(task, key))
        ours.setdefault((p, op), {})[layout] = r["us"] if r else math.nan
        if r and isinstance(r.get("torch_us"), dict):
            base.setdefault((p, op), r["torch_us"])
    rows = []
    for (p, op), mine in ours.items():
        torch_us = base.get((p, op), {})
        mine_best = min((v for v in mine.values() if math.isfinite(v)), default=math.nan)
        theirs = min((v for v in torch_us.values() if isinstance(v, (int, float))), default=math.nan)
        rows.append([
            f"{p.n},{p.c},{p.h},{p.w} {p.kernel[0]}x{p.kernel[1]}/s{p.stride[0]}/p{p.padding[0]} x{p.multiplier}",
            op, *(f"{mine[v]:.1f}" if v in mine else "-" for v in ("NCHW", "NHWC")),
            *(f"{torch_us[v]:.1f}" if isinstance(torch_us.get(v), (int, float)) else "-" for v in ("nchw", "nhwc")),
            f"{theirs / mine_best:.2f}x" if math.isfinite(mine_best) and math.isfinite(theirs) else "-",
            f"{bound_us(p, op, device):.1f}" if device is not None else "-",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    where = (f"on {device.type} ({'HBM' if device.type == 'cuda' else 'timed at their size'})" if device is not None
             else "(not timed: the kernels were measured on another machine)")
    print(f"\n{key}; µs per call; speedup = torch's best layout / our best layout; bw bound = a copy of the "
          f"operands' bytes {where}")
    print(_row(head, widths))
    for row in rows:
        print(_row(row, widths))


if __name__ == "__main__":
    raise SystemExit(main())
