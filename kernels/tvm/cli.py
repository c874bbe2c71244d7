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

Use the shape each layer will see: with pipedp.wrap(microbatches=M) that is
the microbatch (batch / M). Every measurement is appended to the records as
it is made, so Ctrl-C keeps what was measured and still exports it.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from pipedp import console
from pipedp.ops import records as R
from pipedp.ops.problem import OPS, DepthwiseConv

from . import allocator  # (stdlib only: no compiler module is imported before the extra is checked)

if TYPE_CHECKING:
    from .target import Target
    from .tuner import TuneResult

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
    for module in _NEEDS:
        console.require(module, EXTRA, PROG)
    from .target import make_target, target_key

    if args.target == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--target cuda measures candidates on the GPU: run where torch sees one")
        major, minor = torch.cuda.get_device_capability()
        arch, device = args.arch if args.arch != "auto" else f"sm_{major}{minor}", torch.device("cuda")
    else:
        arch, device = None, torch.device("cpu")
    target = make_target(args.target, arch)
    layouts = _layouts(args.layouts, target)
    key = target_key(target)
    problems = find_depthwise(load_model(args.model, args.num_classes), shape)
    if not problems:
        print(f"{args.model} has no depthwise convolution: nothing to tune")
        return 0
    os.makedirs(args.db, exist_ok=True)
    records_path = os.path.join(args.db, R.RECORDS_FILE)
    print(f"{len(problems)} distinct depthwise convolution(s) x {len(ops)} op(s) x {'/'.join(layouts)} on {key}; "
          f"records in {records_path}")
    if not allocator.measure_with(args.allocator):
        print(f"{PROG}: not glibc; measuring with the allocator as it is", file=sys.stderr)
    results, torch_us, interrupted = _tune_all(problems, ops, layouts, target, device, records_path, args)
    from .export import export

    exported = export(args.db, target)
    _print_table(results, torch_us, device, key)
    if exported:
        print(f"exported {len(exported['kernels'])} kernel(s) to {os.path.join(args.db, exported['library'])} "
              f"(sha256 {exported['sha256'][:16]}...)")
    return 130 if interrupted else 0


_TorchUs = dict[tuple[DepthwiseConv, str], dict[str, float]]


def _tune_all(problems: list[DepthwiseConv], ops: list[str], layouts: list[str], target: Target,
              device: torch.device, records_path: str,
              args: argparse.Namespace) -> tuple[list[TuneResult], _TorchUs, bool]:
    """Tune every (problem, op, layout), appending each good measurement to the records as it is made.

    Returns the results, torch's µs per (problem, op) in both layouts, and
    whether Ctrl-C cut the run short (what was measured is kept).
    """
    from tqdm import tqdm

    from .export import versions as tool_versions
    from .runner import torch_us as time_torch
    from .target import target_key
    from .template import layout_of
    from .tuner import History, Measurement, tune

    key = target_key(target)
    bar = tqdm(total=len(problems) * len(ops) * len(layouts) * args.trials, disable=not args.progress, unit="trial")
    torch_us: _TorchUs = {}
    results: list[TuneResult] = []
    versions = tool_versions()
    history = History()  # what each template's knobs did on the model's earlier shapes
    try:
        for prob in problems:
            for op in ops:
                base = {"nchw": time_torch(prob, op, device, channels_last=False),
                        "nhwc": time_torch(prob, op, device, channels_last=True)}
                torch_us[(prob, op)] = base

                def on_measure(m: Measurement, r: TuneResult, prob: DepthwiseConv = prob, op: str = op,
                               base: dict[str, float] = base) -> None:
                    bar.update(1)
                    if math.isfinite(m.us):
                        R.append(records_path, {
                            "kind": "measure", "op": op, "problem": prob.key(), "layout": layout_of(m.config),
                            "target": key,
                            "config": m.config, "us": m.us, "torch_us": base, "versions": versions,
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        })
                    best = r.best
                    bar.set_postfix_str(f"{op} {r.layout} {prob.c}x{prob.h}x{prob.w}/s{prob.stride[0]}: "
                                        f"{best.us if best else float('nan'):.1f} us")

                for layout in layouts:
                    before = bar.n
                    results.append(tune(prob, op, target, device, trials=args.trials, batch=args.batch,
                                        seed=args.seed, on_measure=on_measure, layout=layout, history=history))
                    bar.update(args.trials - (bar.n - before))  # an early stop skips the rest
    except KeyboardInterrupt:
        print("\ninterrupted: exporting what was measured", file=sys.stderr)
        return results, torch_us, True
    finally:
        bar.close()
    return results, torch_us, False


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


def _print_table(results: list[TuneResult], torch_us: _TorchUs, device: torch.device, key: str) -> None:
    """One row per (problem, op): our best per layout, torch per layout, and best-vs-best speedup."""
    from .roofline import bound_us

    head = ["problem (N,C,H,W k/s/p x mult)", "op", "ours NCHW", "ours NHWC", "torch NCHW", "torch NHWC", "speedup",
            "bw bound us"]
    ours: dict[tuple[DepthwiseConv, str], dict[str, float]] = {}
    for r in results:
        ours.setdefault((r.problem, r.op), {})[r.layout] = r.best.us if r.best else math.nan
    rows = []
    for (p, op), mine in ours.items():
        base = torch_us[(p, op)]
        bound = bound_us(p, op, device)
        best = min((v for v in mine.values() if math.isfinite(v)), default=math.nan)
        rows.append([
            f"{p.n},{p.c},{p.h},{p.w} {p.kernel[0]}x{p.kernel[1]}/s{p.stride[0]}/p{p.padding[0]} x{p.multiplier}",
            op, *(f"{mine[v]:.1f}" if v in mine else "-" for v in ("NCHW", "NHWC")),
            f"{base['nchw']:.1f}", f"{base['nhwc']:.1f}",
            f"{min(base.values()) / best:.2f}x" if math.isfinite(best) else "-", f"{bound:.1f}",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    print(f"\n{key}; µs per call; speedup = torch's best layout / our best layout; bw bound = a copy of the "
          f"operands' bytes on {device.type} ({'HBM' if device.type == 'cuda' else 'timed at their size'})")
    print(_row(head, widths))
    for row in rows:
        print(_row(row, widths))


if __name__ == "__main__":
    raise SystemExit(main())
