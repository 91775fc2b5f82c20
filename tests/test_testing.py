"""feplb.testing.run_dist: results, the environment its ranks see, fresh random states, failures reported."""

import os
import uuid
from pathlib import Path

import pytest

from feplb import testing
from feplb.testing import DistError, run_dist


def _report(rank, world_size, tag):
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {"rank": rank, "world": world_size, "tag": tag, "sum": int(total), "mark": os.environ.get("FEPLB_T_MARK"),
            "gone": os.environ.get("FEPLB_T_GONE"), "extra": os.environ.get("FEPLB_T_EXTRA"),
            "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
            "np": float(np.random.rand()), "py": random.random()}


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_run_dist_results_environment_and_random_states(monkeypatch):
    mark = uuid.uuid4().hex
    monkeypatch.setenv("FEPLB_T_MARK", mark)
    monkeypatch.setenv("FEPLB_T_GONE", "first")
    first = run_dist(_report, 2, "a", env={"FEPLB_T_EXTRA": "x"})
    assert [r["rank"] for r in first] == [0, 1] and all(r["world"] == 2 and r["sum"] == 3 and r["tag"] == "a"
                                                        for r in first)
    assert all(r["mark"] == mark and r["gone"] == "first" and r["extra"] == "x" for r in first), first
    assert all(r["omp"] == "1" and r["threads"] == 1 for r in first), first
    # the caller's environment as it is at each job, not as it was when a forkserver started
    monkeypatch.delenv("FEPLB_T_GONE")
    monkeypatch.setenv("FEPLB_T_MARK", mark + "2")
    second = run_dist(_report, 3, "b", threads=2)
    assert [r["sum"] for r in second] == [6, 6, 6]
    assert all(r["mark"] == mark + "2" and r["gone"] is None and r["extra"] is None for r in second), second
    assert all(r["omp"] == "2" and r["threads"] == 2 for r in second), second
    # every rank of every job draws its own numbers, as a freshly spawned process does
    draws = [(r["np"], r["py"]) for r in first + second]
    assert len({d[0] for d in draws}) == len(draws) and len({d[1] for d in draws}) == len(draws), draws


def test_run_dist_start_method(monkeypatch):
    import torch

    monkeypatch.delenv("FEPLB_RUN_DIST_START", raising=False)
    assert testing._start_method("nccl") == "spawn"
    assert testing._start_method("gloo") == ("spawn" if torch.cuda.is_available() else "forkserver")
    monkeypatch.setenv("FEPLB_RUN_DIST_START", "spawn")
    assert testing._start_method("gloo") == "spawn"
    out = run_dist(_report, 2, "spawned")
    assert [r["sum"] for r in out] == [3, 3] and out[0]["np"] != out[1]["np"]
    monkeypatch.setenv("FEPLB_RUN_DIST_START", "fork")
    with pytest.raises(ValueError, match="FEPLB_RUN_DIST_START must be 'forkserver' or 'spawn', got 'fork'"):
        run_dist(_report, 2, "never")


def test_forkserver_preloads_what_the_callers_tests_use():
    """The server imports the heavy third-party modules the caller has loaded (the tests it collected use them), so
    that each rank need not; not those of tests not collected."""
    bare = testing._preload({"sys", "torch"})
    assert bare == list(testing._PRELOAD) and "transformers.trainer" not in bare
    assert "torch" in bare and "transformers" in bare
    with_hf = testing._preload({"torch", "transformers.modeling_utils", "pytest"})
    assert with_hf[:len(bare)] == bare
    assert {"transformers.models", "transformers.modeling_utils", "pytest"} <= set(with_hf)
    assert "transformers.trainer" not in with_hf   # only where the caller has the Trainer's tests
    for key in ("transformers.trainer", "accelerate"):
        assert {"transformers.trainer", "feplb.hf_trainer"} <= set(testing._preload({key}))
    assert "trl.trainer.sft_trainer" in testing._preload({"trl"})
    both = testing._preload({"accelerate", "transformers.trainer", "feplb.hf_trainer"})
    assert len(both) == len(set(both)), both   # each once
    assert not any(m.startswith(("megatron", "torchtitan")) for m in with_hf), with_hf
    # the caller's own feplb modules, whichever it has loaded (the layer's jobs then import none afresh)
    own = testing._preload({"torch", "feplb", "feplb.layer", "feplb.kernels", "feplbx", "other.feplb"})
    assert own[len(bare):] == ["feplb", "feplb.kernels", "feplb.layer"], own
    assert not any(m.startswith("feplb") for m in bare)
    everything = testing._preload(set(testing._PRELOAD_IF_LOADED))
    assert {m for mods in testing._PRELOAD_IF_LOADED.values() for m in mods} <= set(everything)
    import importlib.util

    for name in everything:   # each exists where its package is installed (the server skips one that fails)
        top = name.partition(".")[0]
        if importlib.util.find_spec(top) is not None:
            assert importlib.util.find_spec(name) is not None, name


def _import_time_state(rank, world_size):
    import sys

    preloaded = "feplb.kernels" in sys.modules
    import feplb.kernels

    return {"parent": os.getppid(), "env": os.environ.get("TRITON_INTERPRET"), "preloaded": preloaded,
            "interpret": feplb.kernels.INTERPRET}


@pytest.fixture
def own_server(monkeypatch):
    """A forkserver of the test's own in place of this process's (which later tests' jobs keep, with its preload):
    ``own_server(*modules)`` sets what it preloads when the test's first job starts it."""
    from multiprocessing import forkserver

    monkeypatch.delenv("FEPLB_RUN_DIST_START", raising=False)
    if testing._start_method("gloo") != "forkserver":
        pytest.skip("run_dist starts its ranks without a forkserver here")
    server = forkserver.ForkServer()
    monkeypatch.setattr(forkserver, "_forkserver", server)
    for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload"):
        monkeypatch.setattr(forkserver, name, getattr(server, name))
    monkeypatch.setattr(testing, "_server_env", {})

    def preload(*modules: str):
        monkeypatch.setattr(testing, "_preload", lambda loaded: list(modules))
        return server

    yield preload
    server._stop()


def test_ranks_see_the_import_time_variables_their_job_gives(monkeypatch, own_server):
    """feplb's modules preloaded by the server read TRITON_INTERPRET (and FEPLB_AUTOTUNE_MS) at import: a job that
    gives its ranks other values than the server had starts them afresh, where feplb.kernels reads the job's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    own_server("torch", "torch.distributed", "feplb.kernels")
    usual = run_dist(_import_time_state, 2)
    assert all(r["env"] == "1" and r["interpret"] is True for r in usual), usual
    assert all(r["parent"] != os.getpid() and r["preloaded"] for r in usual), usual   # forked by the server
    other = run_dist(_import_time_state, 2, env={"TRITON_INTERPRET": "0"})
    assert all(r["env"] == "0" and r["interpret"] is False for r in other), other
    assert all(r["parent"] == os.getpid() for r in other), other   # spawned by the caller itself
    again = run_dist(_import_time_state, 2)
    assert all(r["env"] == "1" and r["interpret"] is True and r["parent"] != os.getpid() for r in again), again


def _loaded_in_rank(rank, world_size, names):
    import sys

    return sorted(m for m in names if m in sys.modules)


def test_the_server_holds_no_thread_but_its_own(own_server):
    """The server forks every rank from its only thread, with transformers' Trainer preloaded too: pyarrow's
    allocator, which the Trainer imports, would start a thread of its own unless told not to."""
    pytest.importorskip("transformers")
    pytest.importorskip("pyarrow")
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc")
    server = own_server("torch", "torch.distributed", "transformers.trainer", "pyarrow")
    names = ["transformers.trainer", "pyarrow"]
    assert run_dist(_loaded_in_rank, 2, names) == [sorted(names)] * 2
    tasks = f"/proc/{server._forkserver_pid}/task"
    threads = [Path(tasks, t, "comm").read_text().strip() for t in os.listdir(tasks)]
    assert len(threads) == 1, threads


def _gc_state(rank, world_size):
    import gc

    import torch

    return {"frozen": gc.get_freeze_count(),
            "walked": any(o is torch.nn.Module.__init__ for o in gc.get_objects())}


def test_ranks_collections_skip_the_servers_objects(monkeypatch, own_server):
    """The server freezes what it preloaded (gc.freeze): a rank's garbage collections never walk those objects (nor
    copy the pages they lie on), and a rank spawned afresh walks its own as usual."""
    own_server("torch", "torch.distributed")
    forked = run_dist(_gc_state, 2)
    assert all(r["frozen"] > 10_000 and not r["walked"] for r in forked), forked
    monkeypatch.setenv("FEPLB_RUN_DIST_START", "spawn")
    spawned = run_dist(_gc_state, 2)
    assert all(r["frozen"] == 0 and r["walked"] for r in spawned), spawned


def _import_in_rank(rank, world_size, name):
    import importlib
    import sys

    failed = dict(getattr(sys.modules.get("feplb._preload"), "failed", {}))
    try:
        importlib.import_module(name)
    except (RuntimeError, SystemExit) as exc:
        return failed, f"{type(exc).__name__}: {exc}"
    return failed, None


def test_run_dist_survives_preloaded_modules_that_raise(monkeypatch, tmp_path, own_server):
    """multiprocessing's forkserver goes past a preloaded module whose import raises an ImportError only; another
    error would end it, and every later job's ranks with it. The server goes past those too: a rank that imports
    the module meets the error itself, and later jobs start from the same server."""
    tag = uuid.uuid4().hex[:12]
    broken, leaving = f"feplb_test_broken_{tag}", f"feplb_test_exits_{tag}"
    (tmp_path / f"{broken}.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp_path / f"{leaving}.py").write_text("raise SystemExit(3)\n")
    # the server imports what its environment's path finds (Python 3.11's forkserver does not take the caller's
    # sys.path); a rank has the caller's sys.path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    monkeypatch.syspath_prepend(tmp_path)
    server = own_server("torch", "torch.distributed", broken, leaving, "json")
    failed, error = run_dist(_import_in_rank, 2, broken)[1]
    assert failed == {broken: "RuntimeError: broken at import", leaving: "SystemExit: 3"}, failed
    assert error == "RuntimeError: broken at import"
    pid = server._forkserver_pid
    assert run_dist(_import_in_rank, 3, leaving) == [(failed, "SystemExit: 3")] * 3
    assert run_dist(_import_in_rank, 2, "json") == [(failed, None)] * 2
    assert server._forkserver_pid == pid, "the server died and was started again"
    # a rank's error names what the server left out (a module may fail otherwise on a second import)
    with pytest.raises(DistError, match=rf"could not preload \['{broken}', '{leaving}'\]"):
        run_dist(_fail_on_one, 2)


def _feplb_file(rank, world_size):
    import feplb

    return feplb.__file__


def test_a_rank_running_another_copy_of_feplb_fails_saying_so(monkeypatch):
    """The server imports feplb from the path its environment gives, which may find another copy than the caller's
    sys.path: a rank that runs another copy than the caller's refuses to, naming both."""
    import feplb

    here = os.path.realpath(feplb.__file__)
    assert run_dist(_feplb_file, 2) == [feplb.__file__] * 2
    real = os.path.realpath

    def elsewhere(path):   # the caller's copy as seen from the job: somewhere else
        return "/elsewhere/feplb/__init__.py" if real(path) == here else real(path)

    monkeypatch.setattr(testing.os.path, "realpath", elsewhere)
    with pytest.raises(DistError, match=r"runs feplb from \S+, the caller's is /elsewhere/feplb/__init__.py"):
        run_dist(_feplb_file, 2)


def test_run_dist_reports_the_failing_rank():
    with pytest.raises(DistError, match=r"(?s)rank 1: ValueError: rank one refuses"):
        run_dist(_fail_on_one, 2, collective_timeout_s=10)


def _exit_quietly_on_one(rank, world_size):
    import torch.distributed as dist

    # (after both ranks' process group is up: gloo connects its mesh lazily, and a peer gone during that failed rank
    # 0's connect, "Connection closed by peer", seen once in CI under load)
    dist.barrier()
    if rank == 1:
        os._exit(0)   # gone with status 0, without reporting
    return rank


def test_run_dist_reports_a_rank_gone_without_reporting_at_once():
    with pytest.raises(DistError) as info:
        run_dist(_exit_quietly_on_one, 2, timeout_s=120, collective_timeout_s=10)
    msg = str(info.value)
    # reported when it is gone, not after the job's timeout with the stragglers
    assert "rank 1: process exited with code 0 without reporting" in msg and "did not finish" not in msg, msg
    assert "rank 0" not in msg
    assert [r for r in run_dist(_fail_on_one, 1)] == [0]   # a rank that reported and exited is not mistaken for it


def _stuck_helper(release):
    release.wait()


def _hang_on_one(rank, world_size):
    import threading

    if rank == 1:
        release = threading.Event()
        threading.Thread(target=_stuck_helper, args=(release,), name="feplb-test-helper", daemon=True).start()
        release.wait()   # never set: this rank hangs, as one waiting on a lost peer would
    return rank


def test_run_dist_reports_where_a_straggler_hangs(monkeypatch):
    made = []

    def mkdtemp(**kw):
        made.append(real(**kw))
        return made[-1]

    real = testing.tempfile.mkdtemp
    monkeypatch.setattr(testing.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(DistError) as info:
        run_dist(_hang_on_one, 2, timeout_s=8)
    msg = str(info.value)
    assert "ranks [1] did not finish within 8 s (killed)" in msg
    stack = msg.split("rank 1's threads at the deadline (most recent call first):\n", 1)[1]
    # both of the rank's threads, each where it waits
    assert 'in _hang_on_one' in stack and 'in _stuck_helper' in stack, stack
    assert "rank 0" not in msg   # the rank that returned is not reported
    assert len(made) == 1 and not os.path.exists(made[0])   # the stack files go with the job


def _blas_threads(rank, world_size):
    import numpy as np

    def tasks():
        return len(os.listdir("/proc/self/task"))

    before = tasks()
    a = np.ones((512, 512))
    for _ in range(3):
        a = a @ a / 512
    return tasks() - before


def test_ranks_use_one_blas_thread(monkeypatch):
    # numpy's BLAS sizes its thread pool when it loads: in the forkserver, before any job's OMP_NUM_THREADS=1. A
    # forked rank must still get one thread, as a spawned one does (2 ranks per core would each start more)
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    monkeypatch.delenv("FEPLB_RUN_DIST_START", raising=False)
    assert run_dist(_blas_threads, 2) == [0, 0]


def _shout(rank, world_size, word):
    import sys

    print(f"rank {rank} says {word}", flush=True)
    print(f"rank {rank} warns {word}", file=sys.stderr, flush=True)
    return rank


@pytest.mark.parametrize("start", ["default", "spawn"])
def test_ranks_write_to_the_callers_output_as_it_is_now(capfd, monkeypatch, start):
    if start == "spawn":
        monkeypatch.setenv("FEPLB_RUN_DIST_START", "spawn")
    else:
        monkeypatch.delenv("FEPLB_RUN_DIST_START", raising=False)
    # the forkserver (if any) may have started under another capture of fd 1 and 2; each job's ranks write to the
    # caller's fds as they are when the job starts
    with capfd.disabled():   # a silent job: it only starts the server (if none runs) with fd 1 and 2 elsewhere
        run_dist(_report, 2, "early")
    capfd.readouterr()
    word = uuid.uuid4().hex
    assert run_dist(_shout, 2, word) == [0, 1]
    got = capfd.readouterr()
    for r in (0, 1):
        assert f"rank {r} says {word}" in got.out and f"rank {r} warns {word}" in got.err, got
