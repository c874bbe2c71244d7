"""``tune-kernels``: find a model's depthwise convolutions, tune them, export one library per target.

    tune-kernels --model mobilenet_v2 --input-shape 32,3,32,32 --target cpu --trials 64
    tune-kernels --model path/to/net.py:build --input-shape 8,3,224,224 --target cuda --ops fwd,dgrad

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
from typing import Any

import torch
from torch import nn

from . import build as B
from . import export as E
from . import records as R
from . import allocator
from .problem import OPS, DepthwiseConv
from .roofline import bound_us
from .tuner import History, Measurement, TuneResult, tune

__all__ = ["main", "find_depthwise", "load_model", "parse_input_shape"]


def load_model(spec: str, num_classes: int = 10) -> nn.Module:
    """A zoo name (experiments.models) or ``path/to/file.py:factory`` returning an nn.Module."""
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path, factory = spec.split(":", 1)
        if not os.path.exists(path):
            raise SystemExit(f"--model {spec}: no file {path}")
        mod_spec = importlib.util.spec_from_file_location("pipedp_user_model", path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        fn = getattr(module, factory, None)
        if not callable(fn):
            raise SystemExit(f"--model {spec}: {path} has no function {factory!r}")
        model = fn()
        if not isinstance(model, nn.Module):
            raise SystemExit(f"--model {spec}: {factory}() returned {type(model).__name__}, not an nn.Module")
        return model
    from experiments.models import MODELS, get_model

    if spec not in MODELS:
        raise SystemExit(f"--model {spec!r}: not a zoo model ({', '.join(sorted(MODELS))}) nor file.py:factory")
    return get_model(spec, num_classes=num_classes)


def find_depthwise(model: nn.Module, shape: tuple[int, ...]) -> list[DepthwiseConv]:
    """Every distinct depthwise convolution ``model`` runs on an input of ``shape``, in order."""
    from pipedp.ops.swap import is_depthwise

    found: list[DepthwiseConv] = []
    hooks = []

    def hook(m: nn.Conv2d, args: tuple[Any, ...]) -> None:
        x = args[0]
        n, c, h, w = x.shape
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
    """``N,C,H,W`` as given to ``--input-shape`` (a clear exit for anything else)."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:  # (not an assert: python -O would drop it)
        raise SystemExit(f"--input-shape {text!r}: give N,C,H,W, e.g. 32,3,32,32")
    return shape


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tune-kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="zoo name (e.g. mobilenet_v2) or path/to/file.py:factory")
    p.add_argument("--input-shape", required=True, help="N,C,H,W the model is called with")
    p.add_argument("--target", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90 (default: the GPU's)")
    p.add_argument("--trials", type=int, default=64, help="measured candidates per kernel")
    p.add_argument("--batch", type=int, default=8, help="candidates per tuning round")
    p.add_argument("--db", default=None, help="records and libraries (default: the per-user cache)")
    p.add_argument("--ops", default="fwd,dgrad,wgrad")
    p.add_argument("--layouts", default="auto",
                   help="activation layouts to tune, nchw,nhwc (auto: every layout the target has a template for; "
                        "a channels_last model runs the nhwc kernels)")
    allocator.add_argument(p)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from pipedp.ops.runtime import default_db

    shape = parse_input_shape(args.input_shape)
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise SystemExit(f"--ops {args.ops!r}: choose from {','.join(OPS)}")
    if args.trials < 1:
        raise SystemExit("--trials must be at least 1")
    if args.target == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--target cuda measures candidates on the GPU: run where torch sees one")
        major, minor = torch.cuda.get_device_capability()
        arch = args.arch or f"sm_{major}{minor}"
        device = torch.device("cuda")
    else:
        arch, device = None, torch.device("cpu")
    target = B.make_target(args.target, arch)
    layouts = _layouts(args.layouts, target)
    key = B.target_key(target)
    db = args.db or default_db()
    os.makedirs(db, exist_ok=True)
    records_path = os.path.join(db, R.RECORDS_FILE)

    problems = find_depthwise(load_model(args.model, args.num_classes), shape)
    if not problems:
        print(f"{args.model} has no depthwise convolution: nothing to tune")
        return 0
    print(f"{len(problems)} distinct depthwise convolution(s) x {len(ops)} op(s) x {'/'.join(layouts)} on {key}; "
          f"records in {records_path}")
    if not allocator.measure_with(args.allocator):
        print("tune-kernels: not glibc; measuring with the allocator as it is", file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(total=len(problems) * len(ops) * len(layouts) * args.trials, disable=args.no_progress, unit="trial")
    torch_us: dict[tuple[DepthwiseConv, str], dict[str, float]] = {}
    results: list[TuneResult] = []
    versions = E.versions()
    interrupted = False
    history = History()  # what each template's knobs did on the model's earlier shapes
    try:
        for prob in problems:
            for op in ops:
                base = {
                    "nchw": B.torch_us(prob, op, device, channels_last=False),
                    "nhwc": B.torch_us(prob, op, device, channels_last=True),
                }
                torch_us[(prob, op)] = base

                def on_measure(m: Measurement, r: TuneResult, prob: DepthwiseConv = prob, op: str = op,
                               base: dict[str, float] = base) -> None:
                    bar.update(1)
                    if math.isfinite(m.us):
                        R.append(records_path, {
                            "kind": "measure", "op": op, "problem": prob.key(), "layout": B.layout_of(m.config),
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
        interrupted = True
        print("\ninterrupted: exporting what was measured", file=sys.stderr)
    finally:
        bar.close()
    exported = E.export(db, target)
    _print_table(results, torch_us, device, key)
    if exported:
        print(f"exported {len(exported['kernels'])} kernel(s) to {os.path.join(db, exported['library'])} "
              f"(sha256 {exported['sha256'][:16]}...)")
    return 130 if interrupted else 0


def _layouts(spec: str, target: B.Target) -> list[str]:
    have = B.layouts_for(target)
    if spec == "auto":
        return list(have)
    want = [v.strip().upper() for v in spec.split(",") if v.strip()]
    bad = [v for v in want if v not in have]
    if bad or not want:
        raise SystemExit(f"--layouts {spec!r}: {target.kind.name} kernels come in {','.join(v.lower() for v in have)}")
    return want


def _print_table(results: list[TuneResult], torch_us: dict, device: torch.device, key: str) -> None:
    """One row per (problem, op): our best per layout, torch per layout, and best-vs-best speedup."""
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
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    print(f"\n{key}; µs per call; speedup = torch's best layout / our best layout; bw bound = a copy of the "
          f"operands' bytes on {device.type} ({'HBM' if device.type == 'cuda' else 'timed at their size'})")
    print(_row(head, widths))
    for row in rows:
        print(_row(row, widths))


if __name__ == "__main__":
    raise SystemExit(main())
