"""Planner latency per layer plan (one MoE layer, one micro-batch) on the CPU, next to the ``none`` baseline.

Shapes: (E=128, W=8, G=8, dyn=4) and (E=256, W=64, G=8, dyn=4); counts from a drifting Zipf popularity
(``synthetic:zipf``, top-8, 2048 tokens per rank), 32 micro-batches cycled. Run pinned to one core, e.g.
``taskset -c 1 .venv/bin/pytest bench/bench_sched.py --benchmark-enable --benchmark-json=runs/bench_sched.json``.

Every test, also with ``--benchmark-disable`` (CI), times single plans in the thread's CPU time (what one
dedicated core would take, free of waits for a shared CPU), alternating the policy with ``none`` on the same
counts so both see the same machine: each of the 32 micro-batches ``REPEATS`` times. It reports p50 / p99 over
all these plans, and asserts the targets (shared/design/targets.md) on the p99 over micro-batches of each one's
fastest plan (the planner's own cost on those counts, without what other processes on a shared runner do to the
core's time and caches; on this project's shared 2-core machine the raw p99 of even ``none`` was 7x its p50):
* p99 <= 50 us at E=128, W=8 for ``feplb`` and ``feplb-split``;
* p99 <= 200 us at E=256, W=64 for what one rank plans: its node's plan for the in-node policies
  (``make_plan(..., node=k)``), the whole plan for the peers' policies (``fastermoe``, ``eplb``), which place rows
  across nodes (``MoELayer`` plans the same way). Full in-node plans of all 8 nodes are measured and reported,
  not asserted: a rank needs them only under a policy history that folds in whole plans (lazy ``@ema``
  replicas, ``PolicyState.reads_plans``).
The targets are for the core these numbers were first measured on (docs/simulation.md): one that runs
``py_loop_ms`` (10^6 Python integer additions in a function) in 20 ms, and ``_np_calls`` (a fixed mix of small
numpy calls on a [8, 128] array, the kind a planner makes, none of them feplb's) in ``NP_REF_US`` (the p99 of
fastest, timed as the plans are). A slower core (a CI runner) gets a limit larger by the factor it is slower,
measured in the same run, on whichever of the two shows more:
``limit = target * max(1, py_loop_ms / 20, np_calls / NP_REF_US)``. Both are needed: a shared core
slows numpy's many small calls far more than a tight Python loop (on this project's machine one day: ``none`` 6.4x
its reference time, the loop 3.4x), and a limit scaled by the loop alone failed planners that were as fast as ever
next to their baseline. Neither yardstick runs feplb's code: a slowdown of the planners' shared code (one ``none``
shares too) is not taken for a slow core. The Python yardstick is the fastest of samples taken between the
repeats (10^5 additions each), and the numpy mix is timed alternating with the plans, as they are: a shared
core's speed changes within a second (one 10^6 loop read 79 ms before the timings and 122 ms right after them), so
the fastest plans are compared with the core at its fastest in the same stretch of time. ``none`` is timed
alternating with each policy too and reported (``none_*``, and its slowdown against ``NONE_REF_US``), not used to
scale the limit.
``Plan.validate`` of each policy's plans is timed alternating with them too and reported (``validate_*``), not
asserted: the layer runs it on the critical path for the peers' policies (``feplb.direct``: a plan checked before
phase 1) and on the copy thread for the in-node ones.
``extra_info`` holds the statistics of the policy, of ``none`` and of the check, the yardsticks and the limit; with
``--benchmark-enable`` pytest-benchmark adds its own wall-time statistics.
"""

import gc
import itertools
import time

import numpy as np
import pytest

from feplb.sched import PolicyState, Topology, make_plan
from feplb.traces import SyntheticWorkload

SHAPES = {"E128-W8": (128, 8, 8), "E256-W64": (256, 64, 8)}
POLICIES = ["none", "feplb", "feplb-split", "feplb-split@ema", "lp", "fastermoe", "eplb", "feplb-split+place",
            "none[node]", "feplb[node]", "feplb-split[node]", "lp[node]"]
# (shape, policy) -> p99 target in us on an idle core (targets.md); the rest is reported only
TARGETS = {("E128-W8", "feplb"): 50.0, ("E128-W8", "feplb-split"): 50.0,
           **{("E256-W64", p): 200.0 for p in ("none[node]", "feplb[node]", "feplb-split[node]", "lp[node]",
                                               "fastermoe", "eplb")}}
IDLE_PY_LOOP_MS = 20.0
# ``none``'s p99 of fastest (us) on that core, per shape and planned scope (docs/simulation.md's table): reported
NONE_REF_US = {("E128-W8", False): 8.3, ("E128-W8", True): 8.6, ("E256-W64", False): 14.1, ("E256-W64", True): 13.9}
# ``_np_calls``' p99 of fastest (us) on that core: on this project's 2-core machine, nearly idle (2026-12-05), the
# median over 48 tests of that p99 scaled by 20 ms / the same test's ``py_loop_ms`` (about 30 ms then)
NP_REF_US = 16.8
_NP_COUNTS = np.random.default_rng(0).integers(0, 50, size=(4, 8, 128))
REPEATS = 15


def _inputs(shape: str, policy: str):
    E, W, G = SHAPES[shape]
    topo = Topology(num_ranks=W, gpus_per_node=G, num_experts=E, dyn=4)
    gen = SyntheticWorkload(kind="zipf", num_experts=E, top_k=8, num_layers=1, alpha=1.0, drift=0.1,
                            seed=0).microbatches(np.random.default_rng(0), W, 2048)
    counts = [next(gen)[0] for _ in range(33)]
    state = PolicyState(topo=topo, policy=policy)
    for c in counts[:8]:
        state = state.observe(c)
    return topo, state, counts[1:]


def _py_loop_ms(n: int = 10**6) -> float:
    """The thread's CPU time (ms) of n Python integer additions in a function, scaled to 10^6 additions."""
    t0 = time.thread_time_ns()
    x = 0
    for i in range(n):
        x += i
    return (time.thread_time_ns() - t0) / 1e6 * (10**6 / n)


def _np_calls(i: int) -> None:
    """A fixed mix of small numpy calls (sums, a sort, a cumulative sum, a bincount, a selection) on the [8, 128]
    count array ``i``: the kind of calls a planner makes, none of feplb's code."""
    c = _NP_COUNTS[i % len(_NP_COUNTS)]
    loads = c.sum(axis=0)
    order = np.argsort(-loads, kind="stable")
    np.cumsum(loads[order])
    c.reshape(8, -1, 16).sum(axis=2).max(axis=0)
    np.bincount(order % 8, weights=loads, minlength=8)
    np.flatnonzero(loads > loads.mean())


def _cpu_us(fns, n: int) -> tuple[np.ndarray, float]:
    """CPU time (us) of fn(i) for every input i < n, REPEATS times each, the functions alternating after a
    warm-up: float64 [len(fns), REPEATS, n]; and the Python yardstick (ms, ``_py_loop_ms``), the fastest of one
    sample after the warm-up and one after every repeat."""
    out = np.empty((len(fns), REPEATS, n))
    yard = []
    clock = time.thread_time_ns
    for r in range(-1, REPEATS):
        for i in range(n):
            for k, f in enumerate(fns):
                t0 = clock()
                f(i)
                t1 = clock()
                if r >= 0:
                    out[k, r, i] = (t1 - t0) / 1e3
        yard.append(_py_loop_ms(10**5))
    return out, min(yard)


@pytest.mark.timing   # the latency limits
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_planner_latency(benchmark, shape, policy):
    # "NAME[node]": what one rank plans, its own node only (make_plan(..., node=0))
    name, kw = (policy[:-6], {"node": 0}) if policy.endswith("[node]") else (policy, {})
    topo, state, counts = _inputs(shape, name)
    base_topo, base_state, _ = _inputs(shape, "none")
    plans = [make_plan(name, c, topo, state, **kw) for c in counts]
    for c, plan in zip(counts, plans, strict=True):
        plan.validate(c, topo, state)
    cycle = itertools.cycle(counts)
    benchmark.group = f"planner {shape} dyn=4"
    benchmark.pedantic(lambda: make_plan(name, next(cycle), topo, state, **kw), rounds=2000, iterations=1,
                       warmup_rounds=50)

    n = len(counts)
    target = TARGETS.get((shape, policy))

    def measure() -> tuple[dict, float, float | None]:
        gc.collect()
        (cpu, base, calls, check), yardstick = _cpu_us(
            [lambda i: make_plan(name, counts[i], topo, state, **kw),
             lambda i: make_plan("none", counts[i], base_topo, base_state, **kw),
             _np_calls,
             lambda i: plans[i].validate(counts[i], topo, state)], n)
        stat = {}
        for key, t in (("", cpu), ("none_", base), ("np_calls_", calls), ("validate_", check)):
            stat.update({f"{key}cpu_p50_us": float(np.percentile(t, 50)),
                         f"{key}cpu_p99_us": float(np.percentile(t, 99)),
                         f"{key}fastest_p99_us": float(np.percentile(t.min(axis=0), 99))})
        np_calls = stat["np_calls_fastest_p99_us"]
        slowdown = {"py_loop": yardstick / IDLE_PY_LOOP_MS, "numpy": np_calls / NP_REF_US}
        basis = max(slowdown, key=slowdown.get)
        stat.update(slowdown=max(1.0, slowdown[basis]), slowdown_basis=basis, np_calls_us=np_calls,
                    none_slowdown=stat["none_fastest_p99_us"] / NONE_REF_US[shape, "node" in kw],
                    **{f"slowdown_{k}": v for k, v in slowdown.items()})
        return stat, yardstick, None if target is None else target * stat["slowdown"]

    stat, yardstick, limit = measure()
    passes = 1
    if limit is not None and stat["fastest_p99_us"] > limit:
        # a second, independent pass (timings and yardstick again): a shared core's load comes and goes; a planner
        # that is slow stays over its limit in both
        stat, yardstick, limit = min(((stat, yardstick, limit), measure()), key=lambda m: m[0]["fastest_p99_us"] / m[2])
        passes = 2
    benchmark.extra_info.update(stat, py_loop_ms=yardstick, target_p99_us=target, limit_p99_us=limit, passes=passes)
    if benchmark.stats is not None:
        wall = np.asarray(benchmark.stats.stats.data) * 1e6
        benchmark.extra_info.update(p50_us=float(np.percentile(wall, 50)), p99_us=float(np.percentile(wall, 99)))
    if limit is not None:
        p99 = stat["fastest_p99_us"]
        assert p99 <= limit, (f"{policy} at {shape}: p99 over micro-batches {p99:.1f} us > {limit:.1f} us (target "
                              f"{target} us x this core's slowdown {stat['slowdown']:.2f} by {stat['slowdown_basis']}: "
                              f"yardsticks {yardstick:.0f} ms / {IDLE_PY_LOOP_MS:.0f} ms and "
                              f"{stat['np_calls_us']:.0f} us / {NP_REF_US:.0f} us; none in the same run "
                              f"{stat['none_fastest_p99_us']:.1f} us / {NONE_REF_US[shape, 'node' in kw]} us)")
