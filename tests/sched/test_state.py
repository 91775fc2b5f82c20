"""PolicyState: pure updates, the integer EMA, refresh cadence, placement and replicas."""

import itertools

import numpy as np
import pytest

from feplb.sched import PolicyState, Topology, make_plan, place_experts
from feplb.sched.placement import _assign_max
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


def test_a_history_that_reads_plans_refuses_a_plan_not_its_own():
    """A plan of another topology, policy or kind folded into a lazy @ema history would keep copies of experts or
    GPUs it has not resident, silently: the next refresh, the simulator, and loading a checkpoint of it back fail
    far away. observe refuses it, naming what differs; the state is unchanged (observe is pure)."""
    from feplb.sched import Plan

    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    big = Topology(num_ranks=4, gpus_per_node=4, num_experts=64, dyn=4)
    rng = np.random.default_rng(7)
    for _ in range(20):
        c = rng.integers(0, 50, size=(2, 4))
        c[0, rng.integers(4)] += 500
        lazy = PolicyState(topo=topo, policy="feplb@ema", replicas_mode="lazy").observe(c)
        cb = rng.integers(0, 5, size=(4, 64))
        cb[0, 60 + rng.integers(4)] += 5000
        foreign = make_plan("feplb-split", cb, big)
        assert foreign.weight_copies, "the foreign plan must copy weights (else the case tests little)"
        with pytest.raises(ValueError, match="made by policy 'feplb-split'"):
            lazy.observe(c, foreign)
        same_policy = make_plan("feplb@ema", cb, big, PolicyState(topo=big, policy="feplb@ema").observe(cb))
        with pytest.raises(ValueError, match="covers 4 GPUs with 4 dynamic experts each, this history's topology 2"):
            lazy.observe(c, same_policy)
        # copies out of range in a plan of the right shape (made by hand)
        own = make_plan("feplb@ema", c, topo, lazy, tau=0)
        forged = Plan(policy=own.policy, moves=own.moves, weight_copies=((60, 0, 1),), dynamic_WD=own.dynamic_WD,
                      loads_before_W=own.loads_before_W, loads_after_W=own.loads_after_W)
        with pytest.raises(ValueError, match=r"copies weights \[\(60, 0, 1\)\]"):
            lazy.observe(c, forged)
        with pytest.raises(TypeError, match="plan must be the feplb.sched.Plan"):
            lazy.observe(c, "feplb@ema")
        got = lazy.observe(c, own)
        assert got.resident == frozenset((e, d) for e, _, d in own.weight_copies)
        # the history taken this way saves and loads back
        back = PolicyState.from_dict(got.to_dict(), PolicyState(topo=topo, policy="feplb@ema", replicas_mode="lazy"))
        assert back.resident == got.resident and back.step == got.step


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


@pytest.mark.parametrize("field, value, match", [
    ("home_E", [0, 0, 0, 1], "home_E must give each"),
    ("home_E", [0, 5, 1, 1], "home_E must give each"),
    ("home_E", [0, 1, 1], "home_E must be an integer array of shape"),
    ("dynamic_WD", [[2], [0]], "dynamic_WD must be"),          # expert 2 is not at home on GPU 0
    ("dynamic_WD", [[0, 0], [2, 3]], "dynamic_WD must be"),    # repeated, and dyn is 1
    ("dynamic_WD", [[0], [9]], "dynamic_WD must be"),
    ("ema_E", [-5], "ema_E must be"),
    ("ema_E", [1, 2, 3, -1], "ema_E must be"),
    ("ema_E", [1.0, 2.0, 3.0, 4.0], "ema_E must be"),
    ("place_min_gain", 1.0, "place_min_gain"),
    ("place_min_gain", -0.1, "place_min_gain"),
    ("place_min_gain", True, "place_min_gain"),
])
def test_inconsistent_derived_fields_are_refused(field, value, match):
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    with pytest.raises(ValueError, match=match):
        PolicyState(topo=topo, policy="feplb+place@ema",
                    **{field: np.asarray(value) if field != "place_min_gain" else value})
    # the same fields, consistent, are accepted
    PolicyState(topo=topo, policy="feplb+place@ema", home_E=np.array([1, 0, 1, 0]), dynamic_WD=np.array([[1], [0]]),
                ema_E=np.array([0, 1, 2, 3]))


@pytest.mark.parametrize("policy", ["feplb@ema", "feplb-split", "eplb", "lp", "fastermoe", "none"])
def test_a_placement_without_place_is_refused(policy):
    """Only '+place' moves experts from their owners: a history holding another home_E (edited, or another
    layer's) was taken; eplb's plans then failed at the next forward naming no history, the others fell back to plain
    EP for good. Refused by name, directly and through from_dict."""
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    moved = np.roll(topo.default_home_E(), 2)
    with pytest.raises(ValueError, match=rf"home_E places experts \[0, 1, 2, 3, 4, 5, 6, 7\] away from their "
                                         rf"owners, but policy '{policy}' has no '\+place'"):
        PolicyState(topo=topo, policy=policy, home_E=moved)
    like = PolicyState(topo=topo, policy=policy)
    saved = like.to_dict()
    saved["home_E"] = moved
    with pytest.raises(ValueError, match="has no '\\+place'"):
        PolicyState.from_dict(saved, like)
    placed = policy.split("@")[0] + "+place" + ("@" + policy.split("@")[1] if "@" in policy else "")
    if policy != "none":
        assert PolicyState(topo=topo, policy=placed, home_E=moved).home_E.tolist() == moved.tolist()


def _node_loads(home, load, topo):
    return np.bincount(home // topo.gpus_per_node, weights=load, minlength=topo.num_nodes)


def test_place_experts_keeps_the_owners_on_flat_routing_and_moves_on_skew():
    topo = Topology(num_ranks=16, gpus_per_node=8, num_experts=64, dyn=4)
    owner = topo.default_home_E()
    rng = np.random.default_rng(5)
    for _ in range(20):
        # flat: every expert within 1% of the others; a new placement could gain at most ~1% on the busiest node
        flat = rng.integers(10_000, 10_100, size=64)
        assert np.array_equal(place_experts(flat, topo, min_gain=0.02), owner)
        # skewed: the hot experts all on node 0; the placement balances the nodes (LPT: within the largest load)
        skew = rng.integers(1, 100, size=64)
        skew[:8] += 10_000
        home = place_experts(skew, topo, min_gain=0.02)
        assert np.bincount(home, minlength=16).tolist() == [4] * 16
        nodes = _node_loads(home, skew, topo)
        assert nodes.max() - nodes.min() <= skew.max()
        assert nodes.max() < 0.98 * _node_loads(owner, skew, topo).max()


def test_place_experts_min_gain_is_a_threshold_on_the_busiest_node():
    topo = Topology(num_ranks=2, gpus_per_node=1, num_experts=4, dyn=1)
    # owners: node 0 carries 10 + 8, node 1 carries 6 + 4; LPT: {10, 4} and {8, 6}, busiest 14 instead of 18
    load = np.array([10, 8, 6, 4])
    best = place_experts(load, topo)
    assert sorted(_node_loads(best, load, topo).tolist()) == [14, 14] and best[0] == 0   # expert 0 stays home
    assert np.array_equal(place_experts(load, topo, min_gain=0.2), best)     # 14 < 0.8 * 18
    assert place_experts(load, topo, min_gain=0.23).tolist() == [0, 0, 1, 1]  # 14 >= 0.77 * 18: keep the owners


def test_place_experts_relabels_interchangeable_nodes_toward_the_owners():
    # 3 nodes of 2 GPUs, 2 experts per GPU, random loads: LPT's node groups are matched to the nodes so that the
    # most experts stay on their owner's node (checked against every relabelling), never raising the busiest node
    topo = Topology(num_ranks=6, gpus_per_node=2, num_experts=12, dyn=1)
    owner_node = topo.default_home_E() // 2
    rng = np.random.default_rng(11)
    for _ in range(30):
        load = rng.integers(0, 1000, size=12)
        home = place_experts(load, topo, min_gain=0.0)
        assert np.bincount(home, minlength=6).tolist() == [2] * 6
        assert _node_loads(home, load, topo).max() <= _node_loads(topo.default_home_E(), load, topo).max()
        node = home // 2
        best = max(int((np.asarray(perm)[node] == owner_node).sum()) for perm in itertools.permutations(range(3)))
        assert int((node == owner_node).sum()) == best


def test_assign_max_against_every_permutation():
    rng = np.random.default_rng(2)
    for n in range(1, 7):
        for _ in range(50):
            gain = rng.integers(0, 6, size=(n, n)).tolist()
            col = _assign_max(gain)
            assert sorted(col) == list(range(n))
            best = max(sum(gain[i][p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
            assert sum(gain[i][col[i]] for i in range(n)) == best


@pytest.mark.parametrize("owner, gain, match", [
    ([0, 0, 0, 1], 0.0, "owner_E must give each"),
    ([0, 1], 0.0, "owner_E must be an integer array"),
    (None, 1.0, "min_gain"),
    (None, -1e-3, "min_gain"),
    (None, "0.1", "min_gain"),
])
def test_place_experts_refusals(owner, gain, match):
    topo = Topology(num_ranks=2, gpus_per_node=1, num_experts=4, dyn=1)
    with pytest.raises(ValueError, match=match):
        place_experts(np.array([1, 2, 3, 4]), topo, None if owner is None else np.asarray(owner), min_gain=gain)


def test_place_refresh_sends_every_expert_away_from_its_owner():
    """A +place refresh's weight copies are the bank the layer re-sends after every optimizer step: every expert
    computed away from its owner, from the owner, whether or not the placement changed."""
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=2)
    c = np.array([[50, 40, 30, 20, 1, 1, 1, 1]] * 4, dtype=np.int64)
    s = PolicyState(topo=topo, policy="feplb+place", refresh_every=2).observe(c)
    owner = topo.default_home_E()
    away = np.flatnonzero(s.home_E != owner)
    assert away.size and s.last_weight_copies == tuple((int(e), int(owner[e]), int(s.home_E[e])) for e in away)
    s2 = s.observe(c)   # step 2: a refresh, same placement, the bank re-sent
    assert not s2.last_migrations and s2.last_weight_copies == s.last_weight_copies
    assert s2.observe(c).last_weight_copies == ()


def test_counts_past_the_planners_integer_range_are_refused():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    ok = np.array([[1, 2, 3, topo.max_count], [0, 0, 0, 0]])
    assert make_plan("feplb", ok, topo).loads_before_W.tolist() == [3, topo.max_count + 3]
    state = PolicyState(topo=topo, policy="feplb@ema").observe(ok)
    assert state.ema_rows_E[3] == topo.max_count            # the EMA's fixed point did not wrap
    for bad, match in ((ok + np.array([[0, 0, 0, 1], [0] * 4]), "exceed the planner's bound"),
                       (np.array([[2**63 + 5, 0, 0, 0], [0] * 4], dtype=np.uint64), r"9223372036854775813 rows"),
                       (np.array([[0, -1, 0, 0], [0] * 4]), ">= 0, got -1")):
        with pytest.raises(ValueError, match=match):
            make_plan("feplb", bad, topo)
        with pytest.raises(ValueError, match=match):
            state.observe(bad)


@pytest.mark.parametrize("kw, match", [
    (dict(max_shadow=-3), "max_shadow must be an int >= 0"),
    (dict(max_shadow=1.5), "max_shadow must be an int >= 0"),
    (dict(tau=True), "tau must be"),
    (dict(tau=float("nan")), "tau must be"),
    (dict(min_chunk=0), "min_chunk must be"),
    (dict(min_chunk=np.float64(4)), "min_chunk must be"),
    (dict(cost="x"), "cost must be a feplb.sched.CostModel"),
])
def test_bad_planner_options(kw, match):
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    c = np.array([[5, 1, 0, 0], [3, 2, 0, 1]])
    with pytest.raises((ValueError, TypeError), match=match):
        make_plan("fastermoe" if "max_shadow" in kw else "feplb-split", c, topo, **kw)


@pytest.mark.parametrize("policy, match", [("feplb+", "'\\+' names no modifier"), ("feplb@", "'@' names no"),
                                           ("feplb+@", "names no"), ("feplb-split+@ema", "'\\+' names no"),
                                           ("feplb+plac", "unknown modifier"), ("feplb@emma", "unknown dynamic-set"),
                                           # '@ema' on a base without dynamic experts changed nothing
                                           ("none@ema", "'none' has none, so it would change nothing"),
                                           ("eplb@ema", "'eplb' has none"), ("fastermoe+place@ema", "'fastermoe'")])
def test_malformed_policy_names_are_refused(policy, match):
    from feplb import FEPLBConfig
    from feplb.sched import PolicyState, parse_policy

    with pytest.raises(ValueError, match=match):
        parse_policy(policy)
    with pytest.raises(ValueError, match=match):
        FEPLBConfig(hidden=8, ffn=8, num_experts=4, top_k=2, policy=policy)
    with pytest.raises(ValueError, match=match):
        PolicyState(topo=Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1), policy=policy)


@pytest.mark.parametrize("policy", ["none", "eplb@current", "fastermoe+place", "feplb@ema", "feplb-split+place@ema",
                                    "lp@ema"])
def test_policy_names_with_their_modifiers_are_taken(policy):
    from feplb.sched import parse_policy

    base, place, mode = parse_policy(policy)
    assert base + ("+place" if place else "") + "@" + mode == (policy if "@" in policy else policy + "@current")


def test_a_huge_tau_moves_nothing():
    """No gap between GPUs exceeds the node's rows: any tau past that moves nothing, however large (finite)."""
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=2)
    c = np.random.default_rng(3).integers(0, 500, size=(4, 8))
    c[:, 0] += 3000
    for policy in ("feplb", "feplb-split", "lp"):
        assert make_plan(policy, c, topo).moves, policy
        for tau in (4.0, 1e30, 1e308):
            plan = make_plan(policy, c, topo, tau=tau)
            assert (plan.moves == ()) == (policy != "lp"), (policy, tau)   # (lp ignores tau)
            assert plan.loads_after_W.sum() == c.sum()


def test_numpy_scalars_are_numbers_to_the_planner():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=2)
    c = np.random.default_rng(0).integers(0, 500, size=(4, 8))
    for policy, kw, np_kw in (("feplb-split", dict(tau=0.1, min_chunk=4, node=1),
                               dict(tau=np.float32(0.1), min_chunk=np.int64(4), node=np.int32(1))),
                              ("fastermoe", dict(max_shadow=2), dict(max_shadow=np.int64(2)))):
        assert make_plan(policy, c, topo, **kw).moves == make_plan(policy, c, topo, **np_kw).moves
    # "feplb" and "feplb@current" are one policy: one history serves both names
    state = PolicyState(topo=topo, policy="feplb@current").observe(c)
    assert make_plan("feplb", c, topo, state).moves == make_plan("feplb@current", c, topo, state).moves


def test_refresh_copies_come_from_the_owner_and_never_go_to_it():
    """What a refresh lists is what the layer's refresh sends: from each expert's owner (its parameters), to every
    GPU holding a copy besides it (a +place bank, @ema or EPLB replicas), never to the owner itself, also when a
    placement computes an expert away from its owner and a replica then sits on the owner."""
    topo = Topology(num_ranks=8, gpus_per_node=4, num_experts=32, dyn=2)
    owner = topo.default_home_E()
    rng = np.random.default_rng(4)
    for policy in ("feplb+place@ema", "feplb-split+place@ema", "eplb+place", "eplb", "feplb@ema"):
        s = PolicyState(topo=topo, policy=policy, refresh_every=2)
        seen_away = 0
        for _ in range(6):
            c = rng.integers(0, 50, size=(8, 32))
            c[:, :8] += rng.integers(100, 400, size=(8, 8))   # node 0's experts hot: placement moves some
            s = s.observe(c)
            if not s.last_weight_copies and s.step % 2:
                continue
            held = set(s.resident) | {(e, int(h)) for e, h in enumerate(s.home_E) if h != owner[e]}
            want = {(e, int(owner[e]), g) for e, g in held if g != owner[e]}
            assert set(s.last_weight_copies) == want, policy
            seen_away += int((s.home_E != owner).sum())
        assert seen_away or "+place" not in policy, f"{policy}: the case places nothing away from its owner"


def test_eplb_relabelling_counts_an_experts_replicas_on_one_gpu_once():
    # the layout's GPUs, being interchangeable, are matched to the packs so that the fewest (expert, GPU) pairs
    # sit away from home: checked against every relabelling of a one-node layout (two replicas of an expert on
    # one GPU are one pair)
    from feplb.sched import eplb_layout, eplb_replicas

    topo = Topology(num_ranks=4, gpus_per_node=4, num_experts=8, dyn=1)
    home = topo.default_home_E()
    rng = np.random.default_rng(9)
    dup = 0
    for _ in range(60):
        load = (rng.zipf(1.3, size=8) * 10).clip(max=10**6).astype(np.int64)
        layout = eplb_layout(load, topo, slots_per_gpu=int(rng.integers(1, 4)))
        dup += sum(len(set(row)) < len(row) for row in layout.tolist())
        best = min(len(eplb_replicas(layout[list(perm)], home)) for perm in itertools.permutations(range(4)))
        assert len(eplb_replicas(layout, home)) == best
    assert dup, "no layout put two replicas of an expert on one GPU: the case tests nothing"


def test_a_dynamic_set_repeating_an_expert_is_refused():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=8, dyn=2)
    with pytest.raises(ValueError, match="row d holds distinct experts"):
        PolicyState(topo=topo, policy="feplb@ema", dynamic_WD=np.array([[1, 1], [4, 5]]))
    PolicyState(topo=topo, policy="feplb@ema", dynamic_WD=np.array([[1, 0], [4, 5]]))


def test_owners_away_follow_the_placement_and_arrays_keep_their_roles():
    """``owners_away``: (expert, owner) of every expert placed away from its owner, derived once per placement;
    an array a state checked in another role (its EMA) is checked again when given as a placement."""
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    assert PolicyState(topo=topo, policy="feplb+place").owners_away == frozenset()
    home = np.array([1, 0, 0, 1, 2, 2, 3, 3])
    st = PolicyState(topo=topo, policy="feplb+place", home_E=home)
    assert st.owners_away == {(0, 0), (2, 1)}
    again = st.observe(np.ones((4, 8), dtype=np.int64))   # (a refresh may move experts: derived again)
    owner = topo.default_home_E()
    assert again.owners_away == {(e, int(owner[e])) for e in range(8) if again.home_E[e] != owner[e]}
    with pytest.raises(ValueError, match="home_E"):
        PolicyState(topo=topo, policy="feplb+place", home_E=again.ema_E)


@pytest.mark.parametrize("policy", ["feplb-split@ema", "lp@ema", "eplb", "feplb+place", "feplb-split+place@ema",
                                    "fastermoe", "feplb"])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_to_dict_round_trips_and_the_restored_history_plans_alike(policy, mode):
    """A history after random micro-batches, through to_dict / from_dict: every field equal, and the two states
    then plan and observe the same next micro-batches alike (plans, dynamic sets, placement, EPLB layout)."""
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=16, dyn=2)
    rng = np.random.default_rng(sum(map(ord, policy + mode)))
    fresh = PolicyState(topo=topo, policy=policy, refresh_every=3, replicas_mode=mode)
    st = fresh
    for _ in range(7):
        c = rng.integers(0, 50, size=(4, 16))
        c[:, int(rng.integers(16))] += 300
        st = st.observe(c, make_plan(policy, c, topo, st))
    d = st.to_dict()
    assert all(isinstance(v, (int, float, str, list, np.ndarray)) or v is None for v in d.values()), d
    back = PolicyState.from_dict(d, fresh)
    for f in ("step", "replicas", "resident", "last_weight_copies", "last_migrations", *PolicyState.SETTINGS):
        assert getattr(back, f) == getattr(st, f), f
    for f in ("ema_E", "home_E", "dynamic_WD", "layout_WP"):
        a, b = getattr(st, f), getattr(back, f)
        assert (a is None and b is None) or np.array_equal(a, b), f
    for _ in range(5):
        c = rng.integers(0, 50, size=(4, 16))
        c[:, int(rng.integers(16))] += 300
        p, q = make_plan(policy, c, topo, st), make_plan(policy, c, topo, back)
        assert p.fingerprint() == q.fingerprint()
        st, back = st.observe(c, p), back.observe(c, q)
        assert np.array_equal(st.home_E, back.home_E) and st.resident == back.resident


def test_from_dict_refuses_another_setup_and_bad_arrays():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=16, dyn=2)
    st = PolicyState(topo=topo, policy="feplb@ema").observe(np.ones((4, 16), dtype=np.int64))
    d = st.to_dict()
    other = PolicyState(topo=Topology(num_ranks=2, gpus_per_node=2, num_experts=16, dyn=2), policy="feplb-split")
    with pytest.raises(ValueError, match=r"another layer setup: topology \[4, 2, 16, 2\] \(the layer's: \[2, 2, 16, 2\]"
                                         r"\), policy 'feplb@ema' \(the layer's: 'feplb-split'\)"):
        PolicyState.from_dict(d, other)
    like = PolicyState(topo=topo, policy="feplb@ema")
    with pytest.raises(ValueError, match=r"lacks \['ema_E'\]"):
        PolicyState.from_dict({k: v for k, v in d.items() if k != "ema_E"}, like)
    with pytest.raises(ValueError, match="home_E"):
        PolicyState.from_dict({**d, "home_E": np.zeros(16, dtype=np.int64)}, like)   # 16 experts on GPU 0
    with pytest.raises(ValueError, match=r"holds keys no policy history has: 'ema'$"):
        PolicyState.from_dict({**d, "ema": d["ema_E"]}, like)      # a mistyped key is not ignored
    with pytest.raises(ValueError, match=r"resident must be an integer array \[N, 2\]"):
        PolicyState.from_dict({**d, "resident": np.zeros((1, 3), dtype=np.int64)}, like)
    with pytest.raises(ValueError, match="must be a dict"):
        PolicyState.from_dict([1, 2], like)
    # pairs naming experts or GPUs outside the topology, refused here rather than deep in a later refresh
    for key, row in (("resident", [16, 1]), ("resident", [3, 4]), ("replicas", [-1, 0]),
                     ("last_weight_copies", [0, 0, 9]), ("last_migrations", [20, 0, 1])):
        with pytest.raises(ValueError, match=rf"PolicyState.{key} must hold .* experts in \[0, 16\) and GPUs in "
                                             rf"\[0, 4\), got \({row[0]}, "):
            PolicyState.from_dict({**d, key: np.array([row], dtype=np.int64)}, like)
    # an EPLB layout of fractional expert ids is no layout (the int64 cast would truncate it to one, silently)
    st = PolicyState(topo=topo, policy="eplb").observe(np.ones((4, 16), dtype=np.int64))
    ed = st.to_dict()
    with pytest.raises(ValueError, match="layout_WP must be an integer array of expert ids, got float64"):
        PolicyState.from_dict({**ed, "layout_WP": ed["layout_WP"] + 0.5}, PolicyState(topo=topo, policy="eplb"))
    with pytest.raises(ValueError, match="layout_WP must be an integer array"):
        PolicyState(topo=topo, policy="eplb", layout_WP=np.full((4, 5), 1.5))
    # an in-range pair, and a step saved as a 0-d array (np.savez), are taken
    back = PolicyState.from_dict({**d, "resident": np.array([[3, 1]]), "step": np.array(d["step"])}, like)
    assert back.resident == frozenset({(3, 1)}) and back.step == st.step and type(back.step) is int
