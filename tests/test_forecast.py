import json

import pytest
import torch

from pipedp.decide.links import NAMED
from pipedp.forecast import Forecast, Profile, forecast, main, profile_model
from pipedp.models import resnet18
from pipedp.partition.profile import BlockProfile


def _profile(params=8 << 20):
    return Profile(tuple(BlockProfile(f"b{i}", 1.0, 2.0, 1 << 18, 1 << 18, params) for i in range(6)), 8, "test", 1,
                   update_ms=3.0)


def test_a_forecast_ranks_every_layout_and_states_its_assumptions():
    f = forecast(_profile(), 4, 64, "pcie4")
    assert isinstance(f, Forecast) and f.best is f.predictions[0]
    assert [p.step_ms for p in f.predictions] == sorted(p.step_ms for p in f.predictions)
    assert {p.layout.pp for p in f.predictions} == {1, 2, 4}
    text = str(f)
    assert "best" in text and "link pcie4: 22 GB/s, 10 us per message (nominal)" in text
    assert "4 devices like the profiled one: test" in text and "assumes: a block's time at any microbatch size" in text
    assert forecast(_profile(), 4, 64, NAMED["nvlink4"]).link.name == "nvlink4"


def test_a_forecast_refuses_what_no_layout_can_run():
    with pytest.raises(ValueError, match="multiple of 8"):  # 6 blocks: at most 6 stages, so 8 ranks need dp >= 2
        forecast(_profile(), 8, 3, "pcie4")
    with pytest.raises(ValueError, match="unknown link"):
        forecast(_profile(), 2, 64, "pcie9")


def test_a_profile_of_a_real_model_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model = resnet18(width=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prof = profile_model(model, torch.randn(4, 3, 32, 32))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is left as it was
    assert prof.batch == 4 and len(prof.blocks) > 4 and prof.update_ms > 0
    assert prof.small == () and prof.small_batch == 0  # a quarter of 4 samples is too few for BatchNorm
    prof8 = profile_model(model, torch.randn(8, 3, 32, 32))
    assert prof8.small_batch == 2 and len(prof8.small) == len(prof8.blocks)
    assert sum(b.param_bytes for b in prof.blocks) == sum(p.numel() * 4 for p in model.parameters())
    path = tmp_path / "p.json"
    prof8.save(path)
    assert Profile.load(path) == prof8
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot read a profile.*--save-profile"):
        Profile.load(tmp_path / "bad.json")


def test_the_command_line_forecasts_from_a_saved_profile(tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile().save(path)
    out = tmp_path / "f.json"
    assert main(["--profile", str(path), "--batch", "64", "--devices", "2,4", "--link", "pcie4,eth10",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(f["ranks"], f["link"]["name"]) for f in data["forecasts"]] == [(2, "pcie4"), (4, "pcie4"),
                                                                          (2, "eth10"), (4, "eth10")]
    assert "forecast: 4 devices, global batch 64, link eth10" in capsys.readouterr().out
    assert main(["--profile", str(path), "--batch", "64", "--link", "9 parsecs"]) == 2
    assert main(["--model", "resnet18", "--input", "3,x", "--batch", "8", "--device", "cpu"]) == 2  # no traceback


def test_the_blocks_add_up_to_the_whole_step():
    from pipedp.forecast import _calibrated

    blocks = [BlockProfile("a", 1.0, 2.0, 0, 0, 0), BlockProfile("b", 3.0, 4.0, 0, 0, 0)]
    got = _calibrated(blocks, 20.0)
    assert sum(b.cost_ms for b in got) == pytest.approx(20.0)
    assert got[0].forward_ms == pytest.approx(2.0) and got[1].backward_ms == pytest.approx(8.0)  # shares kept
