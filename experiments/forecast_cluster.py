"""The layout forecast at cluster scale: nodes of devices, a fast link inside each, Ethernet between.

For each model of a saved profile, each device count, each link inside a
node and each link between nodes, every data parallel x pipeline layout is
predicted (:func:`pipedp.decide.layout.predict`) in the two placements of
:mod:`pipedp.decide.topology`: the pipeline across nodes with data
parallelism inside, and data parallelism across nodes with the pipeline
inside. Reported: the best pure data-parallel layout, the best of each
placement, the best overall against data parallelism, and what each sends
over the node link per step. Nothing is timed: the profile is read, the rest
is arithmetic, so it runs anywhere in seconds.

The profile: a ``experiments.forecast_table`` JSON (one per model) or a
``python -m pipedp.forecast --save-profile`` JSON (one model, named by
``--models``); GPU nodes from a GPU profile, CPU nodes from a CPU one.

    python -m experiments.forecast_cluster --devices 8,16,64 --per-node 8 --out cluster.json --md cluster.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from dataclasses import asdict, replace
from typing import Any, Sequence

from pipedp import console
from pipedp.decide import topology
from pipedp.decide.layout import ASSUMPTIONS, BlockCosts, Layout, Prediction, layouts, predict
from pipedp.decide.links import Link, p2p_s, parse_link
from pipedp.forecast import Profile
from pipedp.partition.balance import balance
from pipedp.partition.profile import BlockProfile

from .report import write_json, write_text

PROG = "python -m experiments.forecast_cluster"
DEFAULT_PROFILE = os.path.join(os.path.dirname(__file__), "results", "forecast_h100_2026-11-27.json")
KINDS = ("dp", "pp-across", "dp-across")  # pure data parallel, and the pipelines of each placement


def _profile(data: dict[str, Any]) -> Profile:
    return Profile(tuple(BlockProfile(**b) for b in data["blocks"]), int(data["batch"]), str(data["device"]),
                   int(data.get("threads", 0)), float(data.get("update_ms", 0.0)),
                   tuple(BlockProfile(**b) for b in data.get("small", ())), int(data.get("small_batch", 0)))


def load_profiles(path: str, names: Sequence[str] = ()) -> list[tuple[str, Profile]]:
    """(model, profile) of each model in ``path``: a forecast_table JSON, or one profile named by ``names``."""
    try:
        with open(path) as f:
            data = json.load(f)
        if "models" in data:
            found = [(m["model"], _profile(m["profile"])) for m in data["models"]]
        else:
            name = names[0] if len(names) == 1 else os.path.splitext(os.path.basename(path))[0]
            found = [(name, _profile(data))]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read profiles from {path!r} ({e}): write them with `python -m "
                         f"experiments.forecast_table --out FILE` or `python -m pipedp.forecast --save-profile "
                         f"FILE`") from e
    if names and "models" in data:
        missing = [n for n in names if n not in dict(found)]
        if missing:
            raise ValueError(f"{path!r} has no profile of {', '.join(missing)}: it has "
                             f"{', '.join(n for n, _ in found)}")
        found = [(n, p) for n, p in found if n in names]
    return found


def _stage_bytes(profile: Profile, counts: Sequence[int]) -> list[float]:
    out, start = [], 0
    for k in counts:
        out.append(float(sum(b.param_bytes for b in profile.blocks[start : start + k])))
        start += k
    return out


def _entry(kind: str, pred: Prediction, pl: topology.Placement, profile: Profile, global_batch: int,
           cut: str) -> dict[str, Any]:
    lay = pred.layout
    ends = [sum(lay.counts[: s + 1]) - 1 for s in range(lay.pp - 1)]
    cuts = [profile.blocks[e].output_bytes / profile.batch * global_batch for e in ends]
    nic, total = topology.node_link_bytes(pl, _stage_bytes(profile, lay.counts), cuts)
    return {"kind": kind, "layout": lay.label, "dp": lay.dp, "pp": lay.pp, "microbatches": lay.microbatches,
            "counts": list(lay.counts), "cut": cut, "cut_after": [profile.blocks[e].name for e in ends],
            "stages_per_node": pl.stages, "nodes_per_pipeline": pl.span, "node_groups": pl.groups,
            "step_ms": pred.step_ms, "compute_ms": pred.compute_ms, "allreduce_ms": pred.allreduce_ms,
            "exposed_ms": pred.exposed_ms, "p2p_ms": pred.p2p_ms, "bubble": pred.bubble, "nic_bytes": nic,
            "node_link_bytes": total, "p2p_exact": pl.p2p_exact, "allreduce_link": asdict(pl.allreduce),
            "p2p_link": asdict(pl.p2p)}


def link_aware(costs: BlockCosts, lay: Layout, global_batch: int, p2p: Link) -> tuple[int, ...]:
    """The cut minimising the slowest stage with each cut's transfer over ``p2p`` counted (a microbatch's).

    :func:`~pipedp.decide.layout.layouts` balances compute alone; across a
    slow link the cut where the activation is small (after a model's
    pooling) can be worth an unbalanced pipeline.
    """
    blocks = costs.at(global_batch / lay.dp / lay.microbatches)
    transfer = [2 * p2p_s(p2p, b.output_bytes) * 1e3 for b in blocks[:-1]]
    return tuple(balance([b.cost_ms for b in blocks], lay.pp, transfer=transfer))


def world(profile: Profile, cluster: topology.Cluster, per_device_batch: int, *,
          microbatches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), schedules: Sequence[str] = ("1f1b",),
          bucket_mb: float = 25.0) -> dict[str, Any]:
    """The best layout of each kind (:data:`KINDS`) on ``cluster``, each device training ``per_device_batch``.

    Every layout of :func:`~pipedp.decide.layout.layouts` is predicted in
    each placement it fits, with its compute-balanced cut and with the cut
    balanced counting the placement's hops (:func:`link_aware`); pure data
    parallelism (``pp = 1``) is its own kind. ``best`` is the fastest of all,
    ``best_vs_dp`` the data-parallel step over it.
    """
    global_batch = per_device_batch * cluster.devices
    costs = profile.costs()
    best: dict[str, dict[str, Any] | None] = {k: None for k in KINDS}
    for lay in layouts(costs.blocks, cluster.devices, global_batch, microbatches, schedules):
        # One stage: data parallelism alone, which spans the nodes (pp-across fits it only on one node).
        for placement in topology.PLACEMENTS if lay.pp > 1 else ("dp-across",):
            first = topology.place(cluster, lay.dp, lay.pp, placement)
            if first is None:
                continue
            kind = placement if lay.pp > 1 else "dp"
            cuts = {lay.counts: "balanced"}
            if lay.pp > 1:
                cuts.setdefault(link_aware(costs, lay, global_batch, first.p2p), "link-aware")
            for counts, how in cuts.items():
                pl = topology.place(cluster, lay.dp, lay.pp, placement, _stage_bytes(profile, counts))
                pred = predict(costs, replace(lay, counts=counts), global_batch, pl.allreduce, p2p=pl.p2p,
                               update_ms=profile.update_ms, bucket_bytes=bucket_mb * 2**20)
                cur = best[kind]
                if cur is None or pred.step_ms < cur["step_ms"]:
                    best[kind] = _entry(kind, pred, pl, profile, global_batch, how)
    if best["dp"] is None:
        raise ValueError(f"no data-parallel layout of {cluster.devices} devices at {per_device_batch} samples each")
    top = min((e for e in best.values() if e is not None), key=lambda e: e["step_ms"])
    return {"devices": cluster.devices, "nodes": cluster.nodes, "per_node": cluster.per_node,
            "inside": asdict(cluster.inside), "between": asdict(cluster.between), "global_batch": global_batch,
            **{k.replace("-", "_"): best[k] for k in KINDS}, "best": top,
            "best_vs_dp": best["dp"]["step_ms"] / top["step_ms"]}


def _links(text: str) -> list[Link]:
    """Named links (comma list) or given ones (``'25 GB/s, 10 us'``; several separated by ``;``)."""
    parts = text.split(";") if ";" in text or "/s" in text else text.split(",")
    return [parse_link(p) for p in parts if p.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


NOTES = (
    "each pipeline is predicted with its compute-balanced cut and with the cut balanced counting each hop over its "
    "link (a microbatch's activation and gradient); the faster is kept",
    "vs one node: samples a second against one node's best layout at the same samples per device, so a larger "
    "global batch (its effect on convergence is not modelled)",
)


def assumptions(profile: Profile, links: Sequence[Link], per_device_batch: int) -> list[str]:
    """What every figure rests on: the profile, the links' nominal figures, the models' assumptions."""
    sizes = f"{profile.batch}" + (f" and {profile.small_batch}" if profile.small else "")
    return [f"every device like the profiled one: {profile.device}, blocks timed on {sizes} samples; "
            f"{per_device_batch} samples per device", *(f"link {lk.describe()}" for lk in links),
            *ASSUMPTIONS, *topology.ASSUMPTIONS, *NOTES]


def forecast(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Every world of the command line, each model's best layouts in it; written where ``--out``/``--md`` say."""
    p = console.make_parser(PROG, __doc__)
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profiles (JSON) of forecast_table or "
                   "pipedp.forecast --save-profile (default: the committed H100 one)")
    p.add_argument("--models", default="", help="models of the profile (comma list; default: all)")
    p.add_argument("--devices", type=_ints, default=[8, 16, 64], help="device counts (comma list)")
    p.add_argument("--per-node", type=int, default=8, help="devices in a node")
    p.add_argument("--inside", default="nvlink4,pcie4", help="links inside a node (named, comma list; or "
                   "given, ';' list)")
    p.add_argument("--between", default="eth10,eth25,eth100", help="links between nodes (likewise)")
    p.add_argument("--batch", type=int, default=32, help="samples per device per step")
    p.add_argument("--microbatches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--out", default=None, help="write the forecasts here (JSON)")
    p.add_argument("--md", default=None, help="write the table here (markdown)")
    args = p.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    profiles = load_profiles(args.profile, names)
    inside, between = _links(args.inside), _links(args.between)
    if not inside or not between:
        raise ValueError("name at least one link inside a node (--inside) and one between nodes (--between)")
    for d in args.devices:
        if d < args.per_node or d % args.per_node:
            raise ValueError(f"{d} devices do not fill nodes of {args.per_node}: use a multiple of --per-node")
    out: dict[str, Any] = {"benchmark": "forecast_cluster", "date": datetime.date.today().isoformat(),
                           "settings": {**vars(args), "profile": os.path.relpath(args.profile)}, "models": []}
    for name, prof in profiles:
        entry: dict[str, Any] = {"model": name, "profile_device": prof.device, "profile_batch": prof.batch,
                                 "profile_small_batch": prof.small_batch,
                                 "param_bytes": sum(b.param_bytes for b in prof.blocks), "worlds": []}
        nodes = {lin: world(prof, topology.Cluster(1, args.per_node, lin, between[0]), args.batch,
                            microbatches=args.microbatches, bucket_mb=args.bucket_mb)["best"] for lin in inside}
        for d in args.devices:
            for lin in inside:
                node = nodes[lin]
                for lbt in between:
                    w = world(prof, topology.Cluster(d // args.per_node, args.per_node, lin, lbt), args.batch,
                              microbatches=args.microbatches, bucket_mb=args.bucket_mb)
                    # Samples a second against one node's best at the same samples per device (a smaller batch).
                    w["one_node"] = {"layout": node["layout"], "step_ms": node["step_ms"]}
                    w["vs_one_node"] = w["nodes"] * node["step_ms"] / w["best"]["step_ms"]
                    entry["worlds"].append(w)
                    print(f"{name:<10} {d:>3} = {w['nodes']} x {args.per_node} {lin.name:<8} {lbt.name:<7} "
                          f"dp {w['dp']['step_ms']:8.2f} ms, best {w['best']['layout']} ({w['best']['kind']}) "
                          f"{w['best']['step_ms']:8.2f} ms, {w['best_vs_dp']:.2f}x", flush=True)
        out["models"].append(entry)
    first = profiles[0][1]
    out["assumptions"] = assumptions(first, [*inside, *between], args.batch)
    if args.out:
        write_json(args.out, out, indent=1)
    if args.md:
        write_text(args.md, markdown(out))
    return out


def _label(e: dict[str, Any]) -> str:
    """``8 x 2 x 4 mb [13+2]``: replicas x stages x microbatches, and the blocks of each stage."""
    if e["pp"] == 1:
        return f"DP {e['dp']}"
    return f"{e['dp']} x {e['pp']} x {e['microbatches']} mb [{'+'.join(map(str, e['counts']))}]"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}" if n < 1e7 else f"{n / 1e6:.0f}"


def _cell(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    return f"{_label(e)}: {e['step_ms']:.2f}" + ("" if e["p2p_exact"] else " (bound)")


def markdown(out: dict[str, Any]) -> str:
    """The table of :func:`forecast`'s result: a node's worlds once per inside link, the rest per link pair."""
    s = out["settings"]
    lines = [f"# The forecast at cluster scale ({out['date']})", "",
             f"`{PROG} --profile {s['profile']} --devices {','.join(map(str, s['devices']))} --per-node "
             f"{s['per_node']} --inside {s['inside']} --between {s['between']} --batch {s['batch']}`", "",
             f"ms per step predicted, {s['batch']} samples per device; `dp x pp x m mb [blocks per stage]`; MB: what "
             "the busiest node's NIC sends per step (data parallel / best); vs 1 node: the best layout's samples a "
             "second over one node's best (its own batch: the same samples per device).", "",
             "| model | devices | inside | between | data parallel | pipeline across nodes | data parallel across "
             "nodes | best (vs DP) | NIC MB: DP / best | vs 1 node |",
             "|---|---|---|---|---:|---|---|---|---:|---:|"]
    for m in out["models"]:
        seen = set()
        for w in m["worlds"]:
            one = w["nodes"] == 1
            key = (w["devices"], w["inside"]["name"], None if one else w["between"]["name"])
            if key in seen:
                continue
            seen.add(key)
            b, between = w["best"], "-" if one else w["between"]["name"]
            lines.append(f"| {m['model']} | {w['devices']} ({w['nodes']} x {w['per_node']}) | {w['inside']['name']} "
                         f"| {between} | {w['dp']['step_ms']:.2f} | {_cell(w['pp_across'])} "
                         f"| {_cell(w['dp_across'])} | {_label(b)}: {b['step_ms']:.2f} ({w['best_vs_dp']:.2f}x) "
                         f"| {_mb(w['dp']['nic_bytes'])} / {_mb(b['nic_bytes'])} | {w['vs_one_node']:.2f}x |")
    lines += ["", "(bound): some cuts inside a node charged the NIC's share, an upper bound.", "",
              "Assumptions:", "", *(f"- {a}" for a in out["assumptions"]), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.forecast_cluster: exit status 0 on success; a failure is one line on stderr, status 1."""
    return console.run_job(forecast, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
