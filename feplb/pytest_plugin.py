"""A pytest plugin for feplb's own suite (loaded by the repository's ``conftest.py``): turns under pytest-xdist.

The README's test command runs two pytest-xdist workers, each taking whole files (``--dist loadfile``) in the order
this plugin gives them (``--no-loadscope-reorder``).

A test marked ``timing`` asserts a wall-clock bound (a planner's latency, a stalled peer reported within a few
seconds of a timeout). Those bounds were set for a machine running one test, not two, so such a test runs while no
other test runs, on any worker: every other test holds a shared lock for its whole run (setup, call and teardown, so
that a module fixture it starts counts), timing tests an exclusive one, kept from one to the next while they follow
each other on a worker. A gate taken before either keeps the other worker's stream of short tests from starving a
timing test that waits. Without pytest-xdist (a plain ``pytest``) nothing is locked.

Order: files holding timing tests first (their exclusive turn then comes while the other worker waits at its first
test, not in the middle of a long one), then the files that take longest on a 2-core machine (``HEAVY``), so that
none is left to run alone at the end, then the rest as collected; each file's tests keep their order.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

MARKER = "timing"
# The longest files on a 2-core machine, 40-160 s each (pytest --durations, 2026-12-02; the last 2026-12-03),
# the two longest first.
HEAVY = ("tests/examples/test_train_moe.py", "tests/hf/test_hf_architectures.py", "tests/megatron/test_megatron.py",
         "tests/hf/test_hf.py", "tests/titan/test_titan.py", "tests/runtime/test_checkpoint.py",
         "tests/hf/test_hf_example.py", "tests/titan/test_titan_trainer.py", "tests/runtime/test_recopy.py")


def _timing(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker(MARKER) is not None


def _lock(stack: contextlib.ExitStack, path: Path, mode: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    stack.callback(os.close, fd)   # closing the descriptor releases its lock
    fcntl.flock(fd, mode)
    return fd


def _turn(config: pytest.Config, exclusive: bool) -> contextlib.ExitStack:
    """The locks of one turn, held until the returned stack closes."""
    # The workers' base temporary directories are siblings in the session's own (pytest-xdist gives each worker
    # <session>/popen-gwN), which holds the lock files and goes with pytest's clean-up of old runs.
    root = config._tmp_path_factory.getbasetemp().parent
    with contextlib.ExitStack() as stack:   # an error on the way closes what was opened
        gate = _lock(stack, root / "feplb-turns.gate", fcntl.LOCK_EX)
        _lock(stack, root / "feplb-turns.lock", fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)   # timing tests keep the gate until their turn ends
        return stack.pop_all()


_exclusive: contextlib.ExitStack | None = None   # this worker's timing turn, while it lasts


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: asserts a wall-clock bound; under pytest-xdist it runs while no "
                                       "other test runs (feplb.pytest_plugin)")


def order(items: Sequence[pytest.Item], root: Path) -> list[pytest.Item]:
    """``items`` in the plugin's order (see the module's doc), each file's own order kept."""
    first: dict[Path, int] = {}
    timed: set[Path] = set()
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
        if _timing(item):
            timed.add(item.path)
    heavy = {root / f: i for i, f in enumerate(HEAVY)}
    return sorted(items, key=lambda it: (it.path not in timed, heavy.get(it.path, len(HEAVY)), first[it.path]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = order(items, config.rootpath)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    global _exclusive
    if not hasattr(item.config, "workerinput"):   # not a pytest-xdist worker
        return (yield)
    if not _timing(item):
        with _turn(item.config, exclusive=False):
            return (yield)
    if _exclusive is None:
        _exclusive = _turn(item.config, exclusive=True)
    try:
        return (yield)
    finally:
        if not _timing(nextitem):
            _exclusive.close()
            _exclusive = None
