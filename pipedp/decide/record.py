"""A decision as plain data, and back: what a checkpoint keeps and the plan cache stores.

Plain data (str, int, float, bool, None, lists, dicts) so that a checkpoint
holding it still loads with ``weights_only=True`` and a cache entry is JSON.
The record carries the block profiles too, so a replayed plan shows the
table it was chosen from, and the fingerprint sections it was made for
(:mod:`pipedp.decide.fingerprint`), which replay and the cache check.
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields, replace
from typing import Any, Mapping, Sequence

from ..partition.profile import BlockProfile
from ..pipeline.orders import check_schedule
from .config import Config
from .decision import Decision
from .fingerprint import SECTIONS, Fingerprint

__all__ = ["RECORD_FORMAT", "to_record", "from_record", "RecordError", "replayed"]

RECORD_FORMAT = 1


class RecordError(ValueError):
    """A saved decision that is not one this version can read, or not one for this model."""


def to_record(profiles: Sequence[BlockProfile], decision: Decision, made_for: Fingerprint) -> dict[str, Any]:
    """``decision`` (with the block ``profiles`` behind it) as plain data, stamped with what it was made for."""
    c = decision.config
    config = asdict(c)
    config["counts"] = list(c.counts)
    config["threads"] = list(c.threads) if c.threads is not None else None
    return {
        "format": RECORD_FORMAT,
        "sections": dict(made_for.sections),
        "machine": made_for.machine,
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": config,
        "notes": list(decision.notes),
        "trials": [[label, float(ms)] for label, ms in decision.trials],
        "bar": decision.bar,
        "bar_ms": decision.bar_ms,
        "planning_s": float(decision.planning_s),
        "hint": decision.hint,
        "source": decision.source,
        "schedule": decision.schedule,
        "profiles": [[p.name, p.forward_ms, p.backward_ms, p.output_bytes, p.saved_bytes, p.param_bytes]
                     for p in profiles],
    }


def from_record(record: Mapping[str, Any]) -> tuple[list[BlockProfile], Decision]:
    """The profiles and decision a :func:`to_record` value holds; RecordError where it is not one."""
    if not isinstance(record, Mapping) or record.get("format") != RECORD_FORMAT:
        found = record.get("format") if isinstance(record, Mapping) else type(record).__name__
        raise RecordError(f"not a saved pipedp decision of format {RECORD_FORMAT} (found {found!r}): pass "
                          f"engine.decision_record() or a checkpoint's ['engine']['decision'] from this version")
    try:
        raw = dict(record["config"])
        names = {f.name for f in fields(Config)}
        raw = {k: v for k, v in raw.items() if k in names}
        raw["counts"] = tuple(int(v) for v in raw["counts"])
        raw["threads"] = tuple(int(v) for v in raw["threads"]) if raw.get("threads") is not None else None
        config = Config(**raw)
        profiles = [BlockProfile(str(n), float(f), float(b), int(o), int(s), int(p))
                    for n, f, b, o, s, p in record["profiles"]]
        decision = Decision(config, tuple(record["notes"]), tuple((str(lb), float(ms)) for lb, ms in record["trials"]),
                            bar=str(record["bar"]), bar_ms=None if record["bar_ms"] is None else float(record["bar_ms"]),
                            planning_s=float(record["planning_s"]), hint=str(record["hint"]),
                            source=str(record["source"]), schedule=check_schedule(str(record.get("schedule", "1f1b"))))
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(f"the saved decision is incomplete or damaged ({type(e).__name__}: {e}): plan anew "
                          f"(leave decision= unset)") from e
    if not all(isinstance(record.get("sections", {}).get(s), str) for s in SECTIONS):
        raise RecordError("the saved decision does not say what it was made for (its fingerprint is missing): "
                          "plan anew (leave decision= unset)")
    return profiles, decision


def replayed(record: Mapping[str, Any], now: Fingerprint, blocks: Sequence[str],
             where: str) -> tuple[list[BlockProfile], Decision]:
    """The saved decision in ``record``, checked against this model's ``blocks`` and ``now``'s fingerprint.

    The model and the request must be the ones it was made for (else the cut
    or the levers would mean something else): RecordError naming the
    difference. Another input shape, machine or library version is allowed
    and said in a note (the plan was timed elsewhere). ``where``: whence the
    record came, for the note.
    """
    profiles, decision = from_record(record)
    differing = now.differing(record["sections"])
    fatal = [s for s in differing if s in ("model", "request")]
    if fatal:
        what = " and ".join(f"the {s}" for s in fatal)
        raise RecordError(
            f"the saved decision was made for another model or other options ({what} differ(s) from this "
            f"engine's): wrap the model it was made for with the options it was made with, or leave decision= "
            f"unset to plan anew")
    names = [p.name for p in profiles]
    if names != list(blocks) or sum(decision.counts) != len(blocks):
        raise RecordError(
            f"the saved decision cuts {sum(decision.counts)} blocks ({', '.join(names[:3])}, ...), this model has "
            f"{len(blocks)} ({', '.join(list(blocks)[:3])}, ...): pass depth= as when it was made, or plan anew")
    note = (f"plan replayed from {where} (made {record['made']} on {record['machine']} in "
            f"{float(record['planning_s']):.1f} s); no trials ran")
    if differing:
        note += f"; made for another {', '.join(differing)} than this run's"
    return profiles, replace(decision, notes=(note, *decision.notes))
