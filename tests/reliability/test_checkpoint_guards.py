"""Checkpoints that would load and break later are refused at load; saves respect the user's files.

Issue 25 item 10: optimizer state saved for another parameter order (same
counts) is refused at load, naming the parameter, and nothing changes.
Decisions of issue 25: an Adam checkpoint into an AdamW engine (or the
reverse) is refused, not applied with the other weight decay; a save over a
file the user made read-only fails as ``torch.save`` would (PermissionError)
and leaves the file; temporary files of saves killed mid-write are removed by
the next save to that path, while a save still in progress keeps its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import pipedp

from ..reference import data, sequential_cnn

X, Y = data(n=8, steps=1)[0]


def _engine(model: nn.Module | None = None, optimizer=None) -> pipedp.Engine:
    model = model if model is not None else sequential_cnn()
    opt = optimizer(list(model.parameters())) if optimizer is not None else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return pipedp.wrap(model, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), microbatches=2, stages=2,
                       profile=False, progress=False)


def _trained(optimizer=None) -> pipedp.Engine:
    engine = _engine(optimizer=optimizer)
    engine.train_step(X, Y)
    return engine


def _snapshot(engine: pipedp.Engine) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in engine.module.state_dict().items()}
    for i, st in enumerate(engine.optimizer.state.values()):
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    out.update({f"group.{i}.{k}": torch.tensor(float(v)) for i, g in enumerate(engine.optimizer.param_groups)
                for k, v in g.items() if isinstance(v, (int, float))})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- item 10: optimizer state for another parameter order -------------------------------------------------------


def _reversed_sgd(params):
    return torch.optim.SGD(list(reversed(params)), lr=0.05, momentum=0.9)


def test_optimizer_state_for_another_parameter_order_is_refused_at_load():
    """Item 10: same counts, other order: refused at load naming a parameter and the shapes; nothing changes."""
    saved = _trained(optimizer=_reversed_sgd).state_dict()
    engine = _trained()
    before = _snapshot(engine)
    with pytest.raises(ValueError) as err:
        engine.load_state_dict(saved)
    msg = str(err.value)
    assert "momentum_buffer" in msg and "order" in msg and "Nothing was loaded" in msg, msg
    assert _same(_snapshot(engine), before)
    assert torch.isfinite(engine.train_step(X, Y))


def test_an_untrained_engine_refuses_it_too():
    """Item 10: the check needs no optimizer state in the engine: shapes come from its parameters."""
    saved = _trained(optimizer=_reversed_sgd).state_dict()
    engine = _engine()
    with pytest.raises(ValueError, match="momentum_buffer"):
        engine.load_state_dict(saved)
    assert not engine.optimizer.state


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.Adafactor, torch.optim.Rprop],
                         ids=["Adam", "Adafactor", "Rprop"])
def test_matching_optimizer_state_still_loads_and_trains(optimizer):
    """Item 10: per-parameter state of the right shapes loads (Adafactor's factored statistics included)."""
    make = lambda ps: optimizer(ps, lr=1e-3)  # noqa: E731
    saved = _trained(optimizer=make).state_dict()
    engine = _engine(optimizer=make)
    engine.load_state_dict(saved)
    assert torch.isfinite(engine.train_step(X, Y))


# -- decision: Adam and AdamW are not interchangeable ------------------------------------------------------------


@pytest.mark.parametrize("saved_with, loaded_into", [(torch.optim.Adam, torch.optim.AdamW),
                                                     (torch.optim.AdamW, torch.optim.Adam)],
                         ids=["Adam into AdamW", "AdamW into Adam"])
@pytest.mark.parametrize("recorded", [True, False], ids=["pipedp checkpoint", "kind not recorded"])
def test_an_adam_checkpoint_into_an_adamw_engine_is_refused(saved_with, loaded_into, recorded):
    """Decision: loading would switch the engine's weight decay (coupled vs decoupled); refused, nothing changes."""
    saved = _trained(optimizer=lambda ps: saved_with(ps, lr=1e-3)).state_dict()
    if not recorded:  # a checkpoint written before the optimizer's kind was recorded, or assembled by hand
        saved["engine"] = {k: v for k, v in saved["engine"].items() if k != "optimizer"}
    engine = _trained(optimizer=lambda ps: loaded_into(ps, lr=1e-3))
    before = _snapshot(engine)
    with pytest.raises(ValueError) as err:
        engine.load_state_dict(saved)
    msg = str(err.value)
    assert saved_with.__name__ in msg and loaded_into.__name__ in msg and "weight decay" in msg, msg
    assert _same(_snapshot(engine), before)


# -- decision: a read-only file is not replaced -----------------------------------------------------------------


def test_save_over_a_read_only_file_fails_as_torch_save_does(tmp_path, monkeypatch):
    """Decision: the user's chmod a-w protects the file from pipedp.save as from torch.save (PermissionError)."""
    path = tmp_path / "best.pt"
    path.write_bytes(b"the user's protected checkpoint")
    os.chmod(path, 0o444)
    if os.geteuid() == 0:  # root may write anything: play an ordinary user's answer
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if os.fspath(p) == str(path) and m & os.W_OK
                            else real(p, m, *a, **k))
    engine = _trained()
    with pytest.raises(PermissionError) as err:
        engine.save(path)
    assert "read-only" in str(err.value) and "chmod" in str(err.value)
    assert path.read_bytes() == b"the user's protected checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"]  # no temporary file left either


# -- decision: temporary files of killed saves do not pile up ----------------------------------------------------


_SAVE = r"""
import os, signal, sys, time, torch
from pipedp import checkpoint

class Stop:  # pickled in the middle of the checkpoint: the writer dies (or hangs) with half a file written
    def __reduce__(self):
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        open(sys.argv[1] + ".writing", "w").close()
        time.sleep(60)
        return (int, ())

checkpoint.save({"w": torch.ones(1000), "stop": Stop()}, sys.argv[1])
"""


def _writer(path, how: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SAVE, str(path), how], cwd=os.getcwd())


def test_temporary_files_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    """Decision: a save killed mid-write leaves its temporary file; the next save to that path removes it."""
    path = tmp_path / "ck.pt"
    for _ in range(3):
        assert _writer(path, "kill").wait(timeout=120) != 0
    # each killed writer removed its predecessor's file: only the last one's is left, not three
    assert len([p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]) == 1
    engine = _trained()
    engine.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    engine.load(path)


def test_a_save_in_progress_keeps_its_temporary_file(tmp_path):
    """Decision: only a dead writer's temporary file is removed, never that of a save still writing."""
    path = tmp_path / "ck.pt"
    writer = _writer(path, "hang")
    try:
        deadline = time.time() + 120
        while not (tmp_path / "ck.pt.writing").exists():
            assert writer.poll() is None and time.time() < deadline
            time.sleep(0.1)
        _trained().save(path)
        assert len([p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]) == 1
    finally:
        writer.kill()
        writer.wait()
