import json

import pytest

from experiments import forecast_cluster
from pipedp.decide.topology import ASSUMPTIONS as TOPOLOGY_ASSUMPTIONS


def _block(name, ms, out, params):
    return {"name": name, "forward_ms": ms / 3, "backward_ms": 2 * ms / 3, "output_bytes": out,
            "saved_bytes": out, "param_bytes": params}


# A tiny chain on 16 samples (and 4): wide activations early, most parameters late, a small last cut.
BLOCKS = [_block("stem", 1.0, 16 << 20, 1 << 10), _block("body", 2.0, 8 << 20, 4 << 20),
          _block("head", 1.0, 1 << 20, 40 << 20), _block("fc", 0.1, 1 << 10, 1 << 20)]
SMALL = [dict(b, forward_ms=b["forward_ms"] / 2, backward_ms=b["backward_ms"] / 2,
              output_bytes=b["output_bytes"] // 4, saved_bytes=b["saved_bytes"] // 4) for b in BLOCKS]
PROFILE = {"batch": 16, "device": "toy", "threads": 1, "update_ms": 0.2, "blocks": BLOCKS, "small_batch": 4,
           "small": SMALL}


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(PROFILE))
    return path


def _run(profile, tmp_path, *extra):
    out, md = tmp_path / "c.json", tmp_path / "c.md"
    forecast_cluster.forecast(["--profile", str(profile), "--models", "tiny", "--devices", "4,8,16", "--per-node",
                               "4", "--inside", "nvlink4", "--between", "eth10,eth100", "--batch", "8",
                               "--out", str(out), "--md", str(md), *extra])
    return json.loads(out.read_text()), md.read_text()


def test_every_world_has_each_kind_its_bytes_and_the_assumptions(profile, tmp_path):
    data, md = _run(profile, tmp_path)
    (m,) = data["models"]
    assert m["model"] == "tiny" and m["profile_device"] == "toy" and m["param_bytes"] == sum(
        b["param_bytes"] for b in BLOCKS)
    assert [(w["devices"], w["nodes"], w["between"]["name"]) for w in m["worlds"]] == [
        (4, 1, "eth10"), (4, 1, "eth100"), (8, 2, "eth10"), (8, 2, "eth100"), (16, 4, "eth10"), (16, 4, "eth100")]
    for w in m["worlds"]:
        assert w["global_batch"] == 8 * w["devices"] and w["dp"]["pp"] == 1 and w["dp"]["dp"] == w["devices"]
        kinds = [w[k] for k in ("dp", "pp_across", "dp_across") if w[k] is not None]
        assert w["best"]["step_ms"] == min(e["step_ms"] for e in kinds)
        assert w["best_vs_dp"] == pytest.approx(w["dp"]["step_ms"] / w["best"]["step_ms"]) and w["best_vs_dp"] >= 1
        for e in kinds:
            assert {"layout", "counts", "cut", "cut_after", "step_ms", "nic_bytes", "node_link_bytes", "p2p_exact",
                    "allreduce_link", "p2p_link"} <= set(e)
            assert e["nic_bytes"] <= e["node_link_bytes"]
            if w["nodes"] == 1:
                assert e["nic_bytes"] == 0
        if w["nodes"] > 1:  # data parallelism sends 2 (nodes - 1) / nodes of the gradients through each NIC
            assert w["dp"]["nic_bytes"] == pytest.approx(2 * (w["nodes"] - 1) / w["nodes"] * m["param_bytes"])
            assert w["pp_across"]["pp"] > 1 and w["pp_across"]["p2p_link"]["alpha_s"] == pytest.approx(
                w["between"]["alpha_s"])
    assert set(TOPOLOGY_ASSUMPTIONS) <= set(data["assumptions"])
    assert "| model | devices | inside | between |" in md and md.count("| tiny | 4 (1 x 4) |") == 1  # one node once


def test_a_slower_link_between_nodes_never_speeds_anything_up(profile, tmp_path):
    data, _ = _run(profile, tmp_path)
    worlds = {(w["devices"], w["between"]["name"]): w for w in data["models"][0]["worlds"]}
    for d in (8, 16):
        slow, fast = worlds[d, "eth10"], worlds[d, "eth100"]
        assert slow["dp"]["step_ms"] > fast["dp"]["step_ms"]
        assert slow["best"]["step_ms"] >= fast["best"]["step_ms"]
        # Data parallelism pays the slow link in full; the best layout gains on it there at least as much.
        assert slow["best_vs_dp"] >= fast["best_vs_dp"]
    # One node: the link between nodes is not used.
    assert worlds[4, "eth10"]["best"]["step_ms"] == worlds[4, "eth100"]["best"]["step_ms"]


def test_profiles_of_forecast_table_and_errors(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"models": [{"model": "a", "profile": PROFILE}, {"model": "b", "profile": PROFILE}]}))
    assert [n for n, _ in forecast_cluster.load_profiles(str(table))] == ["a", "b"]
    assert [n for n, _ in forecast_cluster.load_profiles(str(table), ["b"])] == ["b"]
    with pytest.raises(ValueError, match="no profile of c"):
        forecast_cluster.load_profiles(str(table), ["c"])
    with pytest.raises(ValueError, match="cannot read profiles"):
        forecast_cluster.load_profiles(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="multiple of --per-node"):
        forecast_cluster.forecast(["--profile", str(table), "--devices", "6", "--per-node", "4"])
