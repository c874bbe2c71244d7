"""What the console scripts share: defaults in help, --version, one-line failures and exit codes."""

import pytest

from pipedp import __version__
from pipedp.console import MissingExtra, make_parser, require, run, run_job


def _parser():
    p = make_parser("tool", "Does a thing.")
    p.add_argument("--count", type=int, default=3, help="how many")
    return p


def test_help_shows_defaults_and_version_names_pipedp(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--help"])
    assert e.value.code == 0 and "how many (default: 3)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tool (pipedp) {__version__}"


def test_usage_errors_are_one_line_with_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--count", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid int value: 'x'" in err


def test_run_maps_expected_failures_to_one_line(capsys, monkeypatch):
    monkeypatch.delenv("PIPEDP_DEBUG", raising=False)

    def bad(argv):
        raise ValueError("--count must be positive\nsecond line")

    assert run(bad, [], "tool") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tool: error: --count must be positive" in err
    assert run(lambda argv: 0, [], "tool") == 0
    with pytest.raises(TypeError, match="not an exit status"):
        run(lambda argv: {"results": 1}, [], "tool")  # a script's main returns a status, never data
    monkeypatch.setenv("PIPEDP_DEBUG", "1")
    with pytest.raises(ValueError):
        run(bad, [], "tool")


def test_run_job_returns_0_for_a_job_that_returns_data(capsys, monkeypatch):
    monkeypatch.delenv("PIPEDP_DEBUG", raising=False)
    seen = []
    assert run_job(lambda argv: seen.append(argv) or {"results": 1}, ["--x"], "tool") == 0 and seen == [["--x"]]

    def bad(argv):
        raise OSError("out/ is not writable")

    assert run_job(bad, [], "tool") == 1 and "tool: error: out/ is not writable" in capsys.readouterr().err


def test_require_names_the_extra():
    assert require("json", "dev", "x").dumps(1) == "1"
    with pytest.raises(MissingExtra, match=r"pip install 'pipedp\[tvm\]'"):
        require("no_such_module_pipedp", "tvm", "tune-kernels")
