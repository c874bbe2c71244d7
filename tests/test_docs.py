"""The documentation cannot rot: every example in README.md and docs/ runs, every command answers, every module
and every public name is on its page.

Conventions of the pages (docs/README.md says them for writers):

* a ```` ```python ```` block is a whole script: it runs as written in a fresh process (the checkout on the
  path, a temporary folder as the working directory); an HTML comment ``<!-- run: torchrun N -->`` right
  before it runs it under ``torchrun --nproc-per-node N`` (gloo on loopback) instead;
* a ```` ```bash ```` block holds command lines: each program line answers ``--help`` (``python -m M``,
  torchrun's module, the console scripts), a ``make`` line names a target of the Makefile (``make -n``), a
  ``bash SCRIPT`` line names a script that parses (``bash -n``); ``pip``/``git``/``cd``/``export`` lines
  are not run;
* ```` ```text ```` blocks are output and are not run.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pipedp

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
CONSOLE_SCRIPTS = {"tune-kernels", "reproduce-paper", "pipedp-measure", "pipedp-advise"}
NOT_RUN = {"pip", "git", "cd", "export", "source", "nvidia-smi", "ls", "cat"}
BLOCK = re.compile(r"^(?:<!--\s*run:\s*(?P<run>[^>]*?)\s*-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```", re.M | re.S)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@functools.lru_cache(maxsize=None)
def _blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, body, run directive) of every fenced block of ``page`` (MyST directives excluded)."""
    text = page.read_text(encoding="utf-8")
    return [(m["lang"], m["body"], m["run"] or "") for m in BLOCK.finditer(text)]


def _python_blocks() -> list[tuple[str, int, str, str]]:
    out = []
    for page in PAGES:
        for i, (lang, body, run) in enumerate(_blocks(page)):
            if lang == "python":
                out.append((_rel(page), i, body, run))
    return out


def _command_lines() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for lang, body, _ in _blocks(page):
            if lang in ("bash", "sh", "shell", ""):
                for line in body.splitlines():
                    line = line.strip()
                    if line and not line.startswith("#"):
                        out.append((_rel(page), line))
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # 25-40 scripts of a few seconds each: the slow run (CI runs it) keeps the default suite short
@pytest.mark.parametrize("page, index, body, run", _python_blocks(),
                         ids=[f"{p}#{i}" for p, i, _, _ in _python_blocks()])
def test_every_python_block_runs_as_written(page, index, body, run, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(body, encoding="utf-8")
    if run.startswith("torchrun"):
        procs = run.split()[1] if len(run.split()) > 1 else "2"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", str(script)]
    else:
        argv = [sys.executable, str(script)]
    done = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}, python block {index}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def _help_argv(line: str) -> list[str] | None:
    """What checks a command line: its program's ``--help`` (or a dry run); None where the line is not run."""
    argv = shlex.split(line, comments=True)
    while argv and "=" in argv[0] and not argv[0].startswith("-"):  # VAR=value prefixes
        argv = argv[1:]
    if not argv:
        return None
    prog = os.path.basename(argv[0])
    if prog in NOT_RUN:
        return None
    if prog == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        return ["make", "-n", "-C", str(ROOT), *targets, "VENV=" + str(Path(sys.executable).parents[1])]
    if prog == "bash":
        return ["bash", "-n", str(ROOT / argv[1])]
    if prog in ("python", "python3") or prog.startswith("python3."):
        if "-m" in argv:
            return [sys.executable, "-m", argv[argv.index("-m") + 1], "--help"]
        return [sys.executable, str(ROOT / argv[1]), "--help"]
    if prog == "torchrun":
        if "-m" in argv:
            return [sys.executable, "-m", argv[argv.index("-m") + 1], "--help"]
        script = next(a for a in argv[1:] if a.endswith(".py"))
        return [sys.executable, str(ROOT / script), "--help"]
    if prog in CONSOLE_SCRIPTS:
        exe = shutil.which(prog) or str(Path(sys.executable).parent / prog)
        return [exe, "--help"]
    raise AssertionError(f"a command line the docs' test does not know how to check: {line!r} (see docs/README.md)")


@pytest.mark.slow  # one interpreter start per command line
@pytest.mark.parametrize("page, line", _command_lines(), ids=[f"{p}: {ln[:60]}" for p, ln in _command_lines()])
def test_every_command_line_answers(page, line):
    argv = _help_argv(line)
    if argv is None:
        return
    if not Path(argv[0]).exists() and argv[0] not in ("make", "bash"):
        pytest.skip(f"{argv[0]} is not installed beside {sys.executable}")
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{page}: {line}\n{' '.join(argv)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def _modules(folder: str) -> list[str]:
    return sorted(_rel(p) for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_architecture_page_names_every_module():
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    missing = [m for m in _modules("pipedp") + _modules("kernels") if m not in page]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_every_public_name_is_in_the_reference():
    page = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [n for n in pipedp.__all__ if n != "__version__" and f"pipedp.{n}" not in page]
    assert not missing, f"docs/api.md does not document: {missing}"


def _docstring_names(cls: type) -> set[str]:
    return set(re.findall(r"``(\w+)``", cls.__doc__ or ""))


@pytest.mark.parametrize("group", [pipedp.PipelineOptions, pipedp.DataParallelOptions, pipedp.KernelOptions,
                                   pipedp.TrainingOptions, pipedp.ConcurrencyOptions], ids=lambda c: c.__name__)
def test_every_option_field_is_documented_in_its_group(group):
    fields = [f for f in group.__dataclass_fields__]  # type: ignore[attr-defined]
    missing = [f for f in fields if f not in _docstring_names(group)]
    assert not missing, f"{group.__name__}'s docstring does not say ``{'``, ``'.join(missing)}``"


def test_every_wrap_keyword_is_an_option_field_or_documented_in_wrap():
    fields = {f for g in (pipedp.PipelineOptions, pipedp.DataParallelOptions, pipedp.KernelOptions,
                          pipedp.TrainingOptions, pipedp.ConcurrencyOptions)
              for f in g.__dataclass_fields__}  # type: ignore[attr-defined]
    tree = ast.parse((ROOT / "pipedp" / "api.py").read_text(encoding="utf-8"))
    wrap = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "wrap")
    keywords = [a.arg for a in wrap.args.kwonlyargs] + [a.arg for a in wrap.args.args[1:]]
    renamed = {"distributed": "enabled", "kernels": "mode", "kernel_db": "db"}  # wrap's flat names for fields
    own = _docstring_names_of(pipedp.wrap)
    missing = [k for k in keywords if renamed.get(k, k) not in fields and k not in own]
    assert not missing, f"wrap() keywords documented nowhere: {missing}"


def _docstring_names_of(fn: object) -> set[str]:
    return set(re.findall(r"``(\w+)``", getattr(fn, "__doc__", "") or ""))
