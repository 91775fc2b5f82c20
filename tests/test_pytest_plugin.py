"""feplb.pytest_plugin: under pytest-xdist a test marked ``timing`` runs while no other test runs.

A small suite is run in a pytest subprocess on two xdist workers: one file of short plain tests, one of two timing
tests between two plain ones. Each test records when it ran. With the plugin, no other test runs from the first timing
test's start to the second's end; without it (the control) the two files' tests run side by side, which shows the
check can see an overlap. The plugin's order is checked on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("xdist")

RECORD = """
import json, os, time

def record(name, seconds):
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    with open(os.path.join(os.environ["TURNS_LOG"], name + ".json"), "w") as f:
        json.dump([t0, t1], f)
"""

PLAIN = """
import pytest
from record import record

@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    record(f"plain{i}", 0.3)
"""

TIMED = """
import pytest
from record import record

def test_before():
    record("before", 0.2)

@pytest.mark.timing
def test_timed():
    record("timed", 0.4)

@pytest.mark.timing
def test_timed_next():
    record("timed_next", 0.4)

def test_after():
    record("after", 0.2)
"""


def _run(tmp_path, name: str, *plugin: str) -> dict[str, list[float]]:
    suite, log = tmp_path / name / "suite", tmp_path / name / "log"
    suite.mkdir(parents=True)
    log.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")   # the suite's own root: none of the repository's options
    (suite / "record.py").write_text(RECORD)
    (suite / "test_a_plain.py").write_text(PLAIN)
    (suite / "test_b_timed.py").write_text(TIMED)
    # only the plugins named (each of the installed ones would cost every worker its import)
    env = {**os.environ, "TURNS_LOG": str(log), "PYTHONPATH": str(suite), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    # the README's xdist options
    args = ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "--basetemp", str(tmp_path / name / "tmp")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist.plugin", *args,
                           *plugin, "."], cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 passed" in proc.stdout, proc.stdout
    return {p.stem: json.loads(p.read_text()) for p in log.iterdir()}


def _overlap(x: list[float], y: list[float]) -> bool:
    return x[0] < y[1] and y[0] < x[1]


def _overlapping(runs: dict[str, list[float]]) -> list[str]:
    """The tests that ran while the timing tests did, from the first one's start to the second one's end (one turn:
    no test of the other worker between them either)."""
    turn = [runs["timed"][0], runs["timed_next"][1]]
    return sorted(n for n, run in runs.items() if not n.startswith("timed") and _overlap(run, turn))


@pytest.mark.timing   # the control needs the two workers to run side by side
@pytest.mark.slow
def test_timing_tests_run_alone_under_xdist(tmp_path):
    runs = _run(tmp_path, "plugin", "-p", "feplb.pytest_plugin")
    assert len(runs) == 12
    assert _overlapping(runs) == [], runs
    # and the other tests still ran side by side: a plain test beside the timing file's untimed ones
    untimed = (runs["before"], runs["after"])
    assert any(_overlap(run, u) for n, run in runs.items() if n.startswith("plain") for u in untimed), runs

    control = _run(tmp_path, "control")   # the marker unregistered there: a warning, not an error
    assert _overlapping(control), control


class _Item:
    def __init__(self, path, timing=False):
        self.path, self.timing = path, timing

    def get_closest_marker(self, name):
        return object() if name == "timing" and self.timing else None


def test_order_puts_timing_files_then_heavy_ones_first_and_keeps_each_files_order(tmp_path):
    from feplb.pytest_plugin import HEAVY, order

    a, b, t, h0, h1 = (tmp_path / n for n in ("a.py", "b.py", "t.py", HEAVY[0], HEAVY[1]))
    items = [_Item(a), _Item(h1), _Item(b), _Item(t), _Item(h0), _Item(a), _Item(t, timing=True), _Item(h1)]
    got = order(items, tmp_path)
    assert [(it.path, it.timing) for it in got] == [(t, False), (t, True), (h0, False), (h1, False), (h1, False),
                                                   (a, False), (a, False), (b, False)]
    assert [items.index(it) for it in got if it.path == a] == [0, 5]
