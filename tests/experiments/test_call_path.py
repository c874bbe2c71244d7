import json

from experiments import call_path


def test_a_file_left_and_entered_again_counts_once_per_return():
    s = call_path.summary(["a.py", "b.py", "a.py", "c.py", "b.py", "a.py"])
    assert (s["files"], s["reentries"]) == (3, 3)
    assert call_path.summary(["a.py", "b.py", "c.py"])["reentries"] == 0


def test_the_path_goes_from_wrap_through_the_build_to_the_first_step(tmp_path):
    out = tmp_path / "path.json"
    call_path.main(["--out", str(out)])
    report = json.loads(out.read_text())
    path = report["path"]
    assert path[0] == "pipedp/api.py" and report["files"] == len(set(path))
    assert {"pipedp/build.py", "pipedp/decide/choose.py", "pipedp/lower.py", "pipedp/pipeline/interpreter.py",
            "pipedp/step.py"} <= set(path)
    assert all(path[i] != path[i + 1] for i in range(len(path) - 1))  # repeats collapsed
    assert report["stack_reentries"] == len(report["back"])
    assert all(callee != caller for callee, caller in report["back"])


def test_a_call_back_into_a_file_still_on_the_stack_is_counted():
    trace = call_path.Trace("/pkg")

    class Code:
        def __init__(self, name):
            self.co_filename = name

    class Frame:
        def __init__(self, name):
            self.f_code = Code(name)

    for event, name in [("call", "/pkg/a.py"), ("call", "/pkg/b.py"), ("call", "/pkg/a.py"), ("return", ""),
                        ("return", ""), ("call", "/pkg/c.py"), ("call", "/other/x.py"), ("call", "/pkg/c.py")]:
        trace(Frame(name), event, None)
    assert trace.back == [("pkg/a.py", "pkg/b.py")]  # c.py called again from outside pipedp, itself below: no
    assert trace.path == ["pkg/a.py", "pkg/b.py", "pkg/a.py", "pkg/c.py"]
