"""PolicyState: pure updates, the integer EMA, refresh cadence, placement and replicas."""

import numpy as np
import pytest

from feplb.sched import PolicyState, Topology, make_plan, place_experts
from feplb.sched.state import EMA_FRAC_BITS


def test_observe_is_pure_and_ema_matches_reference():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    rng = np.random.default_rng(3)
    s0 = PolicyState(topo=topo, policy="feplb@ema", ema_shift=2)
    state, ref = s0, None
    for _ in range(5):
        c = rng.integers(0, 100, size=(4, 8))
        state = state.observe(c)
        x = c.sum(axis=0).astype(np.int64) * 2**EMA_FRAC_BITS
        ref = x if ref is None else ref + np.floor_divide(x - ref, 4)
        assert np.array_equal(state.ema_E, ref)
    assert s0.step == 0 and s0.ema_E is None and state.step == 5
    assert np.array_equal(state.ema_rows_E, ref // 2**EMA_FRAC_BITS)
    with pytest.raises(ValueError):
        state.ema_E[0] = 1


def test_refresh_cadence_and_weights_once_per_step():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    c = np.array([[9, 1, 0, 0, 0, 0, 0, 0]] * 4, dtype=np.int64)  # GPU 0: 40 rows, the others none
    s = PolicyState(topo=topo, policy="feplb@ema", refresh_every=3, replicas_mode="lazy").observe(c)
    assert s.dynamic_WD.tolist() == [[0], [2], [4], [6]] and s.resident == frozenset()
    plan = make_plan("feplb@ema", c, topo, s, tau=0)
    assert plan.weight_copies == ((0, 0, 1),)  # expert 0 (36 rows) helps inside node 0
    s2 = s.observe(c, plan)  # step 2: the copied weights stay resident until the step ends
    assert s2.resident == frozenset({(0, 1)}) and s2.dynamic_WD.tolist() == s.dynamic_WD.tolist()
    again = make_plan("feplb@ema", c, topo, s2, tau=0)
    assert again.moves == plan.moves and again.weight_copies == ()  # rows only now
    again.validate(c, topo, s2)
    with pytest.raises(ValueError, match="without its weights"):
        again.validate(c, topo, s)
    # step 3 ends the optimizer step: stale replicas are dropped; the EMA now favours expert 1 on GPU 0
    c2 = np.array([[0, 9, 0, 0, 0, 0, 0, 0]] * 4, dtype=np.int64)
    s3 = s2.observe(c2, again)
    assert s3.step == 3 and s3.resident == frozenset()
    s6 = s3.observe(c2).observe(c2).observe(c2)
    assert s6.dynamic_WD[0, 0] == 1
    assert s3.observe(c2).dynamic_WD[0, 0] == s3.dynamic_WD[0, 0]  # no refresh between steps


def test_a_history_that_reads_plans_refuses_a_node_plan():
    """Lazy @ema replicas keep what a plan copied resident: the history of every rank must see the whole plan, so a
    node plan (what a rank of an in-node policy makes on several nodes) is refused there and accepted elsewhere."""
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    c = np.array([[9, 1, 0, 0, 0, 0, 0, 0]] * 4, dtype=np.int64)
    reads = {(p, m): PolicyState(topo=topo, policy=p, replicas_mode=m).reads_plans
             for p in ("feplb", "feplb-split@ema", "lp@ema", "eplb", "none") for m in ("eager", "lazy")}
    assert {k for k, v in reads.items() if v} == {("feplb-split@ema", "lazy"), ("lp@ema", "lazy")}
    lazy = PolicyState(topo=topo, policy="feplb@ema", replicas_mode="lazy").observe(c)
    node_plan = make_plan("feplb@ema", c, topo, lazy, tau=0, node=0)
    assert node_plan.weight_copies == ((0, 0, 1),)
    with pytest.raises(ValueError, match="needs the whole plan, got the plan of node 0"):
        lazy.observe(c, node_plan)
    assert lazy.observe(c, make_plan("feplb@ema", c, topo, lazy, tau=0)).resident == frozenset({(0, 1)})
    eager = PolicyState(topo=topo, policy="feplb@ema").observe(c)
    assert eager.observe(c, make_plan("feplb@ema", c, topo, eager, tau=0, node=1)).step == 2


def test_eager_replicas_fill_the_node_at_each_refresh():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    c = np.array([[9, 1, 0, 0, 0, 0, 0, 0]] * 4, dtype=np.int64)
    s = PolicyState(topo=topo, policy="feplb-split@ema", refresh_every=2).observe(c)
    assert s.resident == frozenset({(0, 1), (2, 0), (4, 3), (6, 2)})
    assert s.last_weight_copies == ((0, 0, 1), (2, 1, 0), (4, 2, 3), (6, 3, 2))
    plan = make_plan("feplb-split@ema", c, topo, s)
    assert plan.moves and plan.weight_copies == ()
    plan.validate(c, topo, s)
    assert s.observe(c, plan).last_weight_copies == ((0, 0, 1), (2, 1, 0), (4, 2, 3), (6, 3, 2))  # new step
    with pytest.raises(ValueError, match="replicas_mode"):
        PolicyState(topo=topo, replicas_mode="sometimes")


def test_eplb_replicas_resync_every_refresh():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=2, dyn=1)
    c = np.array([[5, 1], [5, 1]])
    s = PolicyState(topo=topo, policy="eplb", refresh_every=2).observe(c)
    assert s.layout_WP.tolist() == [[0, 0], [0, 1]] and s.replicas == ((0, 1),)
    assert s.last_weight_copies == ((0, 0, 1),) and (0, 1) in s.resident
    assert s.observe(c).last_weight_copies == ((0, 0, 1),)  # step 2: refresh, re-sync
    assert s.observe(c).observe(c).last_weight_copies == ()


def test_place_experts_golden_and_balance():
    topo = Topology(num_ranks=2, gpus_per_node=1, num_experts=4, dyn=1)
    # 8 -> node 0, 7 -> node 1, 1 -> node 1 (7 < 8), 1 -> node 0 (8 == 8, lower id)
    assert place_experts(np.array([8, 7, 1, 1]), topo).tolist() == [0, 1, 1, 0]
    topo = Topology(num_ranks=16, gpus_per_node=8, num_experts=64, dyn=4)
    load = np.random.default_rng(0).zipf(1.5, size=64).clip(max=10**6).astype(np.int64)
    home = place_experts(load, topo)
    assert np.bincount(home, minlength=16).tolist() == [4] * 16
    node_loads = np.bincount(home // 8, weights=load, minlength=2)
    default_nodes = np.bincount(np.arange(64) // 32, weights=load, minlength=2)
    assert node_loads.max() - node_loads.min() <= max(default_nodes.max() - default_nodes.min(), load.max())


def test_place_state_and_plan_agree():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=2)
    c = np.array([[50, 40, 30, 20, 1, 1, 1, 1]] * 4, dtype=np.int64)
    s = PolicyState(topo=topo, policy="feplb-split+place").observe(c)
    assert s.last_migrations and not np.array_equal(s.home_E, topo.default_home_E())
    plan = make_plan("feplb-split+place", c, topo, s)
    assert np.array_equal(plan.home_E, s.home_E)
    plan.validate(c, topo, s)
    # the two nodes now carry about the same rows (plain EP: 560 vs 16)
    node = plan.loads_after_W.reshape(2, 2).sum(axis=1)
    assert abs(int(node[0]) - int(node[1])) <= 4 * 20


def test_bad_state_arguments():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    with pytest.raises(ValueError, match="refresh_every"):
        PolicyState(topo=topo, refresh_every=0)
    with pytest.raises(ValueError, match="unknown base policy"):
        PolicyState(topo=topo, policy="magic")
    with pytest.raises(ValueError, match=r"shape \[W, E\]"):
        PolicyState(topo=topo).observe(np.zeros((3, 4), dtype=np.int64))
