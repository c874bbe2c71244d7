"""The OpenMP launcher: TVM's parallel-loop ABI run on torch's OpenMP team."""

import ctypes

import pytest
import torch

from pipedp.ops import parallel


class _Env(ctypes.Structure):
    _fields_ = [("sync_handle", ctypes.c_void_p), ("num_task", ctypes.c_int32)]


_LAMBDA = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Env), ctypes.c_void_p)
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, _LAMBDA, ctypes.c_void_p, ctypes.c_int)


@pytest.fixture(scope="module")
def launch():
    address = parallel.launcher_address()
    if address is None:
        pytest.skip("no C compiler or torch without OpenMP")
    return _LAUNCH(address)


def _run(launch, num_task, fail_at=None):
    seen = []

    @_LAMBDA
    def body(task_id, env, _cdata):
        seen.append((task_id, env.contents.num_task))
        return 1 if task_id == fail_at else 0

    return launch(body, None, num_task), sorted(seen)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_every_task_runs_once_and_knows_the_team_size(launch, two_threads):
    # num_task 0: as many tasks as torch's threads; each task id once, num_task = the team that ran them
    rc, seen = _run(launch, 0)
    assert rc == 0
    team = seen[0][1]
    assert seen == [(i, team) for i in range(team)] and 1 <= team <= 2


def test_one_task_runs_inline(launch):
    assert _run(launch, 1) == (0, [(0, 1)])


def test_a_failing_task_fails_the_launch(launch, two_threads):
    rc, seen = _run(launch, 2, fail_at=0)
    assert rc != 0 and (0, seen[0][1]) in seen


def test_without_a_compiler_kernels_keep_tvms_pool(monkeypatch, tmp_path):
    parallel.launcher_address.cache_clear()
    monkeypatch.setattr(parallel, "cache_folder", lambda: str(tmp_path))
    monkeypatch.setattr(parallel, "_compiler", lambda: None)
    try:
        assert parallel.launcher_address() is None
        assert parallel.route(str(tmp_path / "missing.so")) is False
        assert not list(tmp_path.iterdir())  # nothing half-built left behind
    finally:
        parallel.launcher_address.cache_clear()


def test_the_launcher_is_built_once_into_the_cache(monkeypatch, tmp_path):
    if parallel._compiler() is None:
        pytest.skip("no C compiler")
    path = parallel._build(str(tmp_path))
    name = path.rsplit("/", 1)[1]
    assert path.endswith(".so") and sorted(p.name for p in tmp_path.iterdir()) == [name, name + ".sha256"]
    calls = []
    monkeypatch.setattr(parallel.subprocess, "run", lambda *a, **k: calls.append(a))
    assert parallel._build(str(tmp_path)) == path and not calls


def test_route_points_an_exported_library_at_the_launcher(tmp_path):
    tvm = pytest.importorskip("tvm")  # noqa: F841
    import tvm_ffi

    from pipedp.kernels.tvm import runner
    from pipedp.kernels.tvm.builder import compile_module, schedule
    from pipedp.kernels.tvm.target import make_target
    from pipedp.ops.problem import DepthwiseConv

    if parallel.launcher_address() is None:
        pytest.skip("no C compiler or torch without OpenMP")
    conv = DepthwiseConv(2, 8, 6, 6, padding=(1, 1))
    target = make_target("cpu")
    cfg = {"layout": "NHWC", "vec": 8, "tile_w": 2, "task": "row", "cache": 0, "unroll": 1}
    path = str(tmp_path / "k.so")
    compile_module(schedule(conv, "fwd", cfg, target).mod, target).export_library(path)
    module = tvm_ffi.load_module(path)
    pointer = ctypes.c_void_p.in_dll(ctypes.CDLL(path), "__TVMBackendParallelLaunch")
    assert pointer.value != parallel.launcher_address()  # the TVM runtime's pool, as loaded
    assert parallel.route(path)
    assert pointer.value == parallel.launcher_address()
    inputs, ref = runner.prepare(conv, "fwd", "NHWC", torch.device("cpu"))
    out = runner.call(module["depthwise_fwd"], "fwd", "NHWC", inputs, tuple(ref.shape))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
