"""Checkpoint contracts: a damaged file is refused, and a load is whole or nothing (issue items 2 and 6)."""

from __future__ import annotations

import zipfile

import pytest
import torch
from torch import nn

import pipedp
from pipedp import checkpoint

from ..reference import data, sequential_cnn


def _engine(model: nn.Module | None = None, optimizer: type = torch.optim.SGD, **opt_kw) -> pipedp.Engine:
    model = model if model is not None else sequential_cnn()
    opt_kw = opt_kw or ({"lr": 0.05, "momentum": 0.9} if optimizer is torch.optim.SGD else {"lr": 1e-3})
    return pipedp.wrap(model, optimizer=optimizer(model.parameters(), **opt_kw), loss_fn=nn.CrossEntropyLoss(),
                       microbatches=2, stages=2, profile=False, progress=False)


def _trained(steps: int = 2, **kw) -> pipedp.Engine:
    engine = _engine(**kw)
    for x, y in data(n=8, steps=steps):
        engine.train_step(x, y)
    return engine


def _state(engine: pipedp.Engine) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors and the step count, copied."""
    out = {f"model.{k}": v.clone() for k, v in engine.module.state_dict().items()}
    for i, st in enumerate(engine.optimizer.state.values()):
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    out["steps"] = torch.tensor(engine.steps)
    return out


def _unchanged(engine: pipedp.Engine, before: dict[str, torch.Tensor]) -> bool:
    after = _state(engine)
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def _flip_a_bit_inside(path, entry_suffix: str) -> str:
    """Flip one bit in the middle of the stored bytes of the archive's entry ending with ``entry_suffix``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(entry_suffix))
    raw = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26: info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28: info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    raw[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return info.filename


def test_a_flipped_bit_inside_a_weight_is_refused_before_loading(tmp_path):
    """Item 2: the archive's CRC-32 of every entry is checked; torch.load alone would load a wrong weight."""
    engine = _trained()
    path = tmp_path / "ckpt.pt"
    engine.save(path)
    largest = max(engine.module.state_dict().items(), key=lambda kv: kv[1].numel())[1]
    with zipfile.ZipFile(path) as z:  # the entry holding the largest tensor's bytes
        entry = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    assert entry.file_size == largest.numel() * largest.element_size()
    name = _flip_a_bit_inside(path, entry.filename)
    # torch alone reads the damaged number without a word: the check is ours
    plain = torch.load(path, weights_only=True)["model"]
    assert any(not torch.equal(v, engine.module.state_dict()[k]) for k, v in plain.items())
    fresh = _engine()
    before = _state(fresh)
    with pytest.raises(ValueError, match=f"corrupt: its entry '{name}' does not match the checksum"):
        fresh.load(path)
    assert _unchanged(fresh, before)


def test_a_checkpoint_of_another_model_changes_nothing():
    """Item 6: same keys, other shapes: refused before any parameter is overwritten."""
    wide = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    narrow = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(),
                           nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    state = _engine(wide).state_dict()
    engine = _engine(narrow)
    before = _state(engine)
    with pytest.raises(ValueError, match=r"another model .*shapes differ .*2\.weight \(8, 8, 3, 3\) vs \(4, 8, 3, 3\)"):
        engine.load_state_dict(state)
    assert _unchanged(engine, before)  # the first conv's weight fits, and was not loaded either


def test_an_adam_checkpoint_into_an_sgd_engine_is_refused_at_load():
    """Item 6: the optimizer's kind is checked at load, not discovered as a KeyError at the next step."""
    state = _trained(optimizer=torch.optim.Adam).state_dict()
    engine = _trained()
    before = _state(engine)
    with pytest.raises(ValueError, match=r"another optimizer than this engine's SGD: its groups hold .*'betas'"):
        engine.load_state_dict(state)
    assert _unchanged(engine, before)
    x, y = data(n=8, steps=1)[0]
    assert torch.isfinite(engine.train_step(x, y))  # and it still trains


@pytest.mark.parametrize("entry, match", [
    ({"steps": "7"}, "steps='7', not a count of steps"),
    ({"steps": 3, "rng": [{"torch": 1}]}, "malformed RNG states"),
    ({"steps": 3, "format": 99}, "format 99, this pipedp reads up to"),
    ("steps=3", "'engine' entry is a str"),
])
def test_a_malformed_engine_entry_fails_before_model_and_optimizer_load(entry, match):
    """Item 6: the engine entry is checked with the rest, before anything is applied."""
    state = _trained(steps=3).state_dict()
    state["engine"] = entry
    engine = _trained(steps=1)
    before = _state(engine)
    with pytest.raises(ValueError, match=match):
        engine.load_state_dict(state)
    assert _unchanged(engine, before)


def test_a_failure_while_applying_a_checked_checkpoint_puts_everything_back(monkeypatch):
    """Item 6: what the checks cannot see (here: the optimizer's own load raising) still leaves nothing changed."""
    state = _trained(steps=3).state_dict()
    engine = _trained(steps=1)
    before = _state(engine)
    calls = []
    real = torch.optim.SGD.load_state_dict

    def fails_once(self, sd):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("disk went away")
        return real(self, sd)

    monkeypatch.setattr(torch.optim.SGD, "load_state_dict", fails_once)
    with pytest.raises(RuntimeError, match="disk went away"):
        engine.load_state_dict(state)
    assert _unchanged(engine, before)  # the model had been loaded; it was put back


def test_a_good_checkpoint_still_resumes_exactly(tmp_path):
    """The checks refuse nothing that resumes: save, load into a fresh engine, train on: same as never stopping."""
    batches = data(n=8, steps=4)
    a = _engine()
    for x, y in batches[:2]:
        a.train_step(x, y)
    a.save(tmp_path / "c.pt")
    b = _engine()
    b.load(tmp_path / "c.pt")
    for x, y in batches[2:]:
        a.train_step(x, y)
        b.train_step(x, y)
    assert _unchanged(b, _state(a))


def test_checkpoint_verify_refuses_a_file_that_is_not_a_zip_archive(tmp_path):
    """Item 2: torch's legacy format carries no checksums, so it cannot be verified: refused with the fix."""
    torch.save({"w": torch.ones(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="legacy format, which has no checksums: save it again"):
        checkpoint.load(tmp_path / "legacy.pt")
