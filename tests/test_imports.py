"""Import direction and the wheel's package list, as DESIGN.md has them.

The repository keeps ``pipedp/`` (the training runtime), ``kernels/`` (the
kernel compiler, installed as ``pipedp.kernels``) and ``experiments/``
(installed as ``pipedp.experiments``). Nothing points back up: the runtime
imports neither the compiler, nor the experiments, nor TVM's compiler package
``tvm`` (the runtime FFI ``tvm_ffi`` is fine); the compiler does not import the
experiments; nothing installed imports the top-level names ``kernels`` or
``experiments`` (the wheel has no such names); the library's tests do not import
the experiments. Imports are read statically (every ``import``, also inside
functions, relative ones resolved, plus ``importlib.import_module``,
``__import__`` and ``pipedp.console.require`` of a literal name), so a code
path no test runs is checked too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
# repository folder -> its import name once installed
INSTALLED = {"pipedp": "pipedp", "kernels": "pipedp.kernels", "experiments": "pipedp.experiments"}
DYNAMIC = {"import_module", "__import__", "require"}  # calls whose first argument, a literal, is imported


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_of(rel: str) -> tuple[str, str, bool]:
    """(installed name, name in the checkout, is a package) of the file at ``rel`` (a repository path)."""
    parts = list(Path(rel).with_suffix("").parts)
    package = parts[-1] == "__init__"
    if package:
        parts.pop()
    checkout = ".".join(parts)
    return ".".join([INSTALLED.get(parts[0], parts[0]), *parts[1:]]), checkout, package


def _imports(rel: str, source: str) -> Iterator[tuple[int, str, str | None]]:
    """(line, imported module or ``module.name``, problem with the import statement itself) of every import."""
    name, checkout, is_package = _module_of(rel)
    package = name if is_package else name.rpartition(".")[0]
    depth = checkout.count(".") + (1 if is_package else 0)  # levels a relative import may climb in the checkout
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            problem = None
            base = node.module or ""
            if node.level:
                if node.level > depth:
                    problem = "a relative import that climbs out of its repository folder (fails in a checkout)"
                parts = package.split(".")
                base = ".".join(filter(None, [*parts[: max(0, len(parts) - node.level + 1)], node.module]))
            yield node.lineno, base, problem
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}", None
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if called in DYNAMIC and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value, None


def _rule(rel: str, target: str) -> str | None:
    """Why the file at ``rel`` must not import ``target`` (None: it may)."""
    importer = _module_of(rel)[0]
    if _under(importer, "tests"):
        if not _under(importer, "tests.experiments") and _under(target, "experiments", "pipedp.experiments"):
            return "the library's tests must not import the experiments"
        return None
    if _under(target, "kernels", "experiments"):
        return "installed code must not import the top-level names kernels/experiments (the wheel has neither)"
    if _under(importer, "pipedp.experiments"):
        return None
    if _under(importer, "pipedp.kernels"):
        return "the compiler must not import the experiments" if _under(target, "pipedp.experiments") else None
    if _under(target, "pipedp.kernels", "pipedp.experiments", "tvm"):
        return "the runtime must not import the compiler (pipedp.kernels, tvm; tvm_ffi is fine) or the experiments"
    return None


def _violations(rel: str, source: str) -> list[str]:
    lines = source.splitlines()
    found: dict[tuple[int, str], str] = {}  # one report per statement and rule (not per imported name)
    for line, target, problem in _imports(rel, source):
        why = problem or _rule(rel, target)
        if why and (line, why) not in found:
            found[line, why] = f"{rel}:{line}: {lines[line - 1].strip()}  [imports {target}: {why}]"
    return list(found.values())


def _files() -> Iterator[str]:
    for folder in (*INSTALLED, "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix()


def test_nothing_imports_back_up():
    found = [v for rel in _files() for v in _violations(rel, (ROOT / rel).read_text(encoding="utf-8"))]
    assert not found, "imports against the direction runtime <- compiler <- experiments:\n" + "\n".join(found)


def test_the_check_sees_imports_inside_functions_relative_and_dynamic_ones():
    source = textwrap.dedent("""\
        import tvm_ffi
        from .problem import DepthwiseConv

        def load():
            from .. import kernels
            import tvm.runtime
            importlib.import_module("experiments.models")
    """)
    found = _violations("pipedp/ops/new.py", source)
    assert [v.split(":")[1] for v in found] == ["5", "6", "7"], found
    assert "from .. import kernels  [imports pipedp.kernels:" in found[0] and "the runtime" in found[0]
    assert "[imports tvm.runtime:" in found[1] and "[imports experiments.models:" in found[2]
    (found,) = _violations("kernels/tvm/new.py", "import pipedp\nfrom pipedp.experiments import data\n")
    assert found.startswith("kernels/tvm/new.py:2: from pipedp.experiments import data") and "compiler" in found
    assert _violations("experiments/new.py", "from .. import models\n")  # fine installed, not in a checkout
    assert not _violations("experiments/new.py", "from .data import load\nfrom pipedp.kernels.tvm import cli\n")
    assert _violations("tests/ops/test_new.py", "from experiments.models import paper_model\n")
    assert not _violations("tests/experiments/test_new.py", "from experiments.models import paper_model\n")


def test_every_package_folder_is_in_the_wheel():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert setuptools["package-dir"] == {v: k for k, v in INSTALLED.items() if k != v}
    listed = set(setuptools["packages"])
    packages, loose = set(), []
    for folder in INSTALLED:
        for d in sorted(p for p in (ROOT / folder).rglob("*") if p.is_dir() and p.name != "__pycache__"):
            rel = d.relative_to(ROOT).as_posix()
            if (d / "__init__.py").exists():
                packages.add(_module_of(f"{rel}/__init__.py")[0])
            elif any(d.glob("*.py")):
                loose.append(rel)
        packages.add(INSTALLED[folder])
    assert not loose, f"folders of Python files without __init__.py (the wheel would leave them out): {loose}"
    assert not packages - listed, (f"packages missing from [tool.setuptools] packages in pyproject.toml (the wheel "
                                   f"would leave them out): {sorted(packages - listed)}")
    assert not listed - packages, f"pyproject.toml lists packages that do not exist: {sorted(listed - packages)}"


TRAIN_ON_CPU = """
import sys

import torch
from torch import nn

import pipedp, pipedp.ops

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                     microbatches=2, devices="cpu", kernels="auto", kernel_db=sys.argv[1], progress=False)
loss = engine.train_step(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))
assert torch.isfinite(loss), loss
up = ("tvm", "kernels", "experiments", "pipedp.kernels", "pipedp.experiments")
loaded = {m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in up)}
print("loaded:", sorted(m for m in loaded if m.rpartition(".")[0] not in loaded))  # the outermost of each
"""


def test_training_loads_no_compiler_and_no_experiments(tmp_path):
    done = subprocess.run([sys.executable, "-c", TRAIN_ON_CPU, str(tmp_path / "kernel_db")], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "loaded: []" in done.stdout, done.stdout


# The add-ons stay at the edge (issue 59): the advisor, CPU thread teams and the concurrency pieces load when used.
ADD_ONS = ("pipedp.advisor", "pipedp.partition.threads", "pipedp.decide.cpu", "pipedp.pipeline.concurrency",
           "pipedp.pipeline.branches", "pipedp.forecast")
TRAIN_PLAIN = """
import sys

import torch
from torch import nn

import pipedp

up = sys.argv[1].split(",")
after_import = sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in up))
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 4))
engine = pipedp.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                     stages=2, microbatches=2, progress=False, plan_cache=False)
engine.train_step(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))
after_step = sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in up))
print("import:", after_import, "step:", after_step, "advise:", callable(pipedp.advise))
"""


def test_import_and_a_two_stage_step_load_no_add_on(tmp_path):
    done = subprocess.run([sys.executable, "-c", TRAIN_PLAIN, ",".join(ADD_ONS)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "import: [] step: [] advise: True" in done.stdout, done.stdout


# The planner (pipedp.decide) and the runtime import each other nowhere: decide weighs plans through the protocols
# of pipedp.decide.measuring, which pipedp.trials implements on the lowering. The runtime is the lowering, the build,
# the step, the engine, the trials and every pipeline module but the schedules-as-data the planner simulates.
SCHEDULE_DATA = {"schedule", "simulate", "orders", "deps", "microbatch", "ranks", "zero_bubble", "interleaved"}
RUNTIME = ("pipedp.lower", "pipedp.build", "pipedp.step", "pipedp.engine", "pipedp.api", "pipedp.trials",
           "pipedp.comm")


# The options (the user's request) validate against names kept below both sides (pipedp.defaults), the host's
# devices and the schedules' names; nothing else of pipedp.
OPTIONS_MAY = ("pipedp.checks", "pipedp.defaults", "pipedp.device")


def _schedule_data(name: str) -> bool:
    parts = name.split(".")
    return parts[:2] == ["pipedp", "pipeline"] and len(parts) > 2 and parts[2] in SCHEDULE_DATA


def _runtime(name: str) -> bool:
    if _under(name, *RUNTIME):
        return True
    parts = name.split(".")
    return parts[:2] == ["pipedp", "pipeline"] and len(parts) > 2 and parts[2] not in SCHEDULE_DATA


def _layer_violations(rel: str, source: str) -> list[str]:
    importer = _module_of(rel)[0]
    found = []
    for line, target, _ in _imports(rel, source):
        if _under(importer, "pipedp.decide") and _runtime(target) and target != "pipedp.pipeline":
            found.append(f"{rel}:{line}: the planner imports the runtime ({target})")
        elif _runtime(importer) and _under(importer, "pipedp.pipeline") and _under(target, "pipedp.decide"):
            found.append(f"{rel}:{line}: the runtime imports the planner ({target})")
        elif importer == "pipedp.options" and _under(target, "pipedp") and not _under(target, *OPTIONS_MAY) \
                and not _schedule_data(target):
            found.append(f"{rel}:{line}: the options import the runtime or the planner ({target})")
    return sorted(set(found))


def test_the_planner_and_the_runtime_import_each_other_nowhere_and_the_options_neither():
    found = [v for rel in _files() if rel.startswith("pipedp/")
             for v in _layer_violations(rel, (ROOT / rel).read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)
    # The check sees both directions.
    assert _layer_violations("pipedp/decide/new.py", "from ..lower import make_executor\n")
    assert _layer_violations("pipedp/decide/new.py", "from ..pipeline.executor import Executor\n")
    assert not _layer_violations("pipedp/decide/new.py", "from ..pipeline.orders import rank_orders\n")
    assert _layer_violations("pipedp/pipeline/new.py", "from ..decide.cut import stage_places\n")
    assert _layer_violations("pipedp/options.py", "from .ops.swap import KERNEL_MODES\n")
    assert not _layer_violations("pipedp/options.py", "from .defaults import KERNEL_MODES\n")
    assert _layer_violations("pipedp/options.py", "from .partition.threads import check_threads\n")
    assert not _layer_violations("pipedp/options.py", "from .pipeline.orders import check_schedule\n")
