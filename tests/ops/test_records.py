"""Records: atomic appends, corrupt lines skipped with a warning, best per problem, exports."""

import json

import pytest

from pipedp.ops import records as R


def _measure(us, op="fwd", n=1):
    return {"kind": "measure", "op": op, "problem": {"n": n}, "target": "cpu:x", "config": {"a": us}, "us": us}


def test_append_read_and_best(tmp_path):
    path = tmp_path / "r.jsonl"
    for us, n in ((5.0, 1), (3.0, 1), (7.0, 2)):
        R.append(path, _measure(us, n=n))
    R.append(path, {"kind": "export", "target": "cpu:x", "library": "a.so", "sha256": "0", "kernels": {}})
    R.append(path, {"kind": "export", "target": "cpu:x", "library": "b.so", "sha256": "1", "kernels": {}})
    recs = R.read(path)
    assert len(recs) == 5
    best = R.best(recs)
    assert sorted(r["us"] for r in best.values()) == [3.0, 7.0]
    assert R.latest_export(recs, "cpu:x")["library"] == "b.so" and R.latest_export(recs, "cuda:sm_90") is None


def test_corrupt_lines_are_skipped_with_a_warning(tmp_path):
    path = tmp_path / "r.jsonl"
    R.append(path, _measure(2.0))
    with open(path, "a") as f:
        f.write('{"kind": "measure", "op": "fw\n')  # a torn line
        f.write("[1, 2]\n")                         # not a record
    R.append(path, _measure(1.0))
    with pytest.warns(UserWarning) as rec:
        recs = R.read(path)
    assert [r["us"] for r in recs] == [2.0, 1.0]
    msgs = [str(w.message) for w in rec]
    assert any(":2:" in m for m in msgs) and any(":3:" in m for m in msgs)


def test_problem_key_is_stable():
    a = R.problem_key("fwd", {"n": 1, "c": 2}, "cpu:x")
    assert a == R.problem_key("fwd", {"c": 2, "n": 1}, "cpu:x") and json.loads(a)[0] == "fwd"


def test_a_records_file_that_cannot_be_read_is_a_clear_error(tmp_path, monkeypatch):
    folder = tmp_path / R.RECORDS_FILE
    folder.mkdir()
    with pytest.raises(R.KernelDbError, match=f"{folder} is a folder, not a records file: remove it"):
        R.read(folder)
    path = tmp_path / "r.jsonl"
    R.append(path, _measure(1.0))

    def refuse(p, *args, **kw):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(R, "open", refuse, raising=False)
    with pytest.raises(R.KernelDbError, match=f"cannot read the tuning records {path} .Permission denied.: fix"):
        R.read(path)
