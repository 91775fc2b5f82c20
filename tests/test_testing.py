"""feplb.testing.run_dist: results, the environment its ranks see, fresh random states, failures reported."""

import os
import uuid

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


def test_ranks_see_the_import_time_variables_their_job_gives(monkeypatch):
    """feplb's modules preloaded by the server read TRITON_INTERPRET (and FEPLB_AUTOTUNE_MS) at import: a job that
    gives its ranks other values than the server had starts them afresh, where feplb.kernels reads the job's."""
    import feplb.kernels  # noqa: F401 - loaded in the caller, as a test run that collected the kernel tests has it

    monkeypatch.delenv("FEPLB_RUN_DIST_START", raising=False)
    if testing._start_method("gloo") != "forkserver":
        pytest.skip("ranks start afresh on this host (spawn): nothing is preloaded")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fresh_server = not testing._server_env   # none started yet: the next one preloads feplb.kernels
    usual = run_dist(_import_time_state, 2)
    assert all(r["env"] == "1" and r["interpret"] is True for r in usual), usual
    assert all(r["parent"] != os.getpid() and (r["preloaded"] or not fresh_server) for r in usual), usual
    for value in ("0", None):
        env_now = {} if value is None else {"TRITON_INTERPRET": value}
        if value is None:
            monkeypatch.delenv("TRITON_INTERPRET")
        other = run_dist(_import_time_state, 2, env=env_now)
        assert all(r["env"] == value and r["interpret"] is False for r in other), (value, other)
        assert all(r["parent"] == os.getpid() for r in other), other   # spawned by the caller itself
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    again = run_dist(_import_time_state, 2)
    assert all(r["env"] == "1" and r["interpret"] is True for r in again), again


_SERVER_THREADS = """
import os, sys
sys.path.insert(0, sys.argv[1])
import accelerate, trl  # noqa: F401 - as a run that collected the Trainer's and TRL's tests has them
import job
from multiprocessing import forkserver
from feplb import testing
print(testing.run_dist(job.loaded, 2))
pid = forkserver._forkserver._forkserver_pid
print(sorted(open(f"/proc/{pid}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{pid}/task")))
"""


def test_the_server_preloads_the_trainer_and_holds_no_thread_but_its_own(tmp_path):
    """Where the caller has the Trainer's dependencies, the server imports the Trainer, TRL's trainers and
    feplb's mixin once (pyarrow with them), yet forks every rank from its only thread: pyarrow's allocator would
    start one of its own unless told not to."""
    import subprocess
    import sys

    pytest.importorskip("accelerate")
    pytest.importorskip("trl")
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc")
    env = {k: v for k, v in os.environ.items() if k != "FEPLB_RUN_DIST_START"}
    if testing._start_method("gloo") != "forkserver" and "FEPLB_RUN_DIST_START" not in os.environ:
        pytest.skip("ranks start afresh on this host (spawn): no server")
    (tmp_path / "job.py").write_text("import sys\n\n\ndef loaded(rank, world):\n"
                                     "    return sorted(m for m in ('transformers.trainer', 'feplb.hf_trainer', "
                                     "'trl.trainer.sft_trainer', 'pyarrow') if m in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", _SERVER_THREADS, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ranks, threads = proc.stdout.strip().splitlines()[-2:]
    want = sorted(["transformers.trainer", "feplb.hf_trainer", "trl.trainer.sft_trainer", "pyarrow"])
    assert ranks == repr([want, want]), ranks
    assert len(eval(threads)) == 1, threads   # noqa: S307 - a list of names this test printed


def _import_in_rank(rank, world_size, name):
    import importlib
    import sys

    failed = dict(getattr(sys.modules.get("feplb._preload"), "failed", {}))
    try:
        importlib.import_module(name)
    except (RuntimeError, SystemExit) as exc:
        return failed, f"{type(exc).__name__}: {exc}"
    return failed, None


def test_run_dist_survives_preloaded_modules_that_raise(monkeypatch, tmp_path):
    """multiprocessing's forkserver goes past a preloaded module whose import raises an ImportError only; another
    error would end it, and every later job's ranks with it. The server goes past those too: a rank that imports
    the module meets the error itself, and later jobs start from the same server."""
    from multiprocessing import forkserver

    if testing._start_method("gloo") != "forkserver":
        pytest.skip("run_dist starts its ranks without a forkserver here")
    tag = uuid.uuid4().hex[:12]
    broken, leaving = f"feplb_test_broken_{tag}", f"feplb_test_exits_{tag}"
    (tmp_path / f"{broken}.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp_path / f"{leaving}.py").write_text("raise SystemExit(3)\n")
    # the server imports what its environment's path finds (Python 3.11's forkserver does not take the caller's
    # sys.path); a rank has the caller's sys.path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setattr(testing, "_PRELOAD", (*testing._PRELOAD, broken, leaving, "json"))
    forkserver._forkserver._stop()   # the next job's server preloads them
    try:
        failed, error = run_dist(_import_in_rank, 2, broken)[1]
        assert failed == {broken: "RuntimeError: broken at import", leaving: "SystemExit: 3"}, failed
        assert error == "RuntimeError: broken at import"
        server = forkserver._forkserver._forkserver_pid
        assert run_dist(_import_in_rank, 3, leaving) == [(failed, "SystemExit: 3")] * 3
        assert run_dist(_import_in_rank, 2, "json") == [(failed, None)] * 2
        assert forkserver._forkserver._forkserver_pid == server, "the server died and was started again"
    finally:
        forkserver._forkserver._stop()   # later tests' jobs start a server without the modules


def test_run_dist_reports_the_failing_rank():
    with pytest.raises(DistError, match=r"(?s)rank 1: ValueError: rank one refuses"):
        run_dist(_fail_on_one, 2, collective_timeout_s=10)


def _exit_quietly_on_one(rank, world_size):
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
