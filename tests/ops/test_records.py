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



def test_every_record_is_written_in_this_schema_and_a_failed_candidate_is_never_the_best(tmp_path):
    path = tmp_path / "r.jsonl"
    R.append(path, _measure(5.0))
    R.append(path, dict(_measure(None), status="crash", error="killed by SIGSEGV"))  # a failed candidate
    with open(path, "a") as f:
        f.write(json.dumps(_measure(7.0, n=2)) + "\n")  # schema 1: no stamp, still read
    assert [json.loads(line).get("schema") for line in path.read_text().splitlines()] == [R.SCHEMA, R.SCHEMA, None]
    recs = R.read(path)
    assert [r.get("status", "ok") for r in recs] == ["ok", "crash", "ok"]
    assert sorted(r["us"] for r in R.best(recs).values()) == [5.0, 7.0]


def test_records_of_a_newer_schema_are_skipped_with_one_warning_naming_the_upgrade(tmp_path):
    path = tmp_path / "r.jsonl"
    R.append(path, _measure(2.0))
    with open(path, "a") as f:
        for us in (1.0, 0.5):  # faster, but their fields may mean what this reader does not know
            f.write(json.dumps(dict(_measure(us), schema=R.SCHEMA + 1)) + "\n")
    with pytest.warns(UserWarning) as caught:
        recs = R.read(path)
    assert [r["us"] for r in recs] == [2.0]
    (warning,) = caught
    assert (f"skipping 2 record(s) of schema {R.SCHEMA + 1}, written by a newer pipedp" in str(warning.message)
            and "upgrade pipedp (pip install -U pipedp)" in str(warning.message))


@pytest.mark.parametrize("bad, why", [
    (dict(schema="2"), "schema '2' is not a positive integer"),
    (dict(schema=True), "schema True is not a positive integer"),
    (dict(config=None), "a measure record whose 'config' is None"),
    (dict(problem="n=1"), "a measure record whose 'problem' is 'n=1'"),
    (dict(us="fast"), "'us' is 'fast', not a positive time"),
    (dict(us=float("nan")), "'us' is nan, not a positive time"),
    (dict(status="wrong"), "a failed measure record (status 'wrong') with a time"),
    (dict(layout=["NHWC"]), "a measure record whose 'layout' is ['NHWC']"),
])
def test_a_record_whose_fields_its_kind_cannot_use_is_skipped_with_a_warning(tmp_path, bad, why):
    path = tmp_path / "r.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(dict(_measure(1.0), **bad)) + "\n")
    R.append(path, _measure(3.0))
    with pytest.warns(UserWarning, match=":1: skipping a corrupt tuning record") as caught:
        recs = R.read(path)
    assert [r["us"] for r in recs] == [3.0] and why in str(caught[0].message)

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


def test_a_layer_key_names_a_kernel_for_every_batch_size():
    problem = {"n": 4, "c": 8, "h": 6, "w": 6, "kernel": [3, 3]}
    layer = R.layer_key("fwd", problem, "cpu:x", "NHWC")
    assert layer == R.layer_key("fwd", {**problem, "n": 32}, "cpu:x", "NHWC") != R.problem_key("fwd", problem, "cpu:x")
    assert layer != R.layer_key("fwd", {**problem, "c": 16}, "cpu:x", "NHWC")  # anything else tells layers apart
    assert layer != R.layer_key("dgrad", problem, "cpu:x", "NHWC") != R.layer_key("fwd", problem, "cpu:x", "NCHW")
    assert R.batch_of(layer) is None and R.batch_of(R.problem_key("fwd", problem, "cpu:x", "NHWC")) == 4
    for junk in ("", "not json", '{"a": 1}', '["fwd", 3, "NCHW", "cpu:x"]'):
        with pytest.raises(ValueError, match="not a kernel key"):
            R.batch_of(junk)
