"""EPLB (``eplb``): the layout against a plain reference of DeepSeek's algorithm, written here from its description
(github.com/deepseek-ai/EPLB: replicate the heaviest experts, balanced packing, hierarchical or global), and the
plan on balanced and skewed routing.

The reference uses lists and exact fractions only, nothing from feplb.sched but the Topology fields. Tie rules
(the algorithm leaves them open; these are the ones feplb documents): replicas go to the earliest position in
the list replicated (a node's experts in EPLB's order, its groups heaviest first, in hierarchical mode; expert ids
in global mode) among equal loads per replica; packing takes items by weight descending, then by (expert
position, replica), to the lightest pack with room, lowest pack id among equals.
"""

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feplb.sched import PolicyState, Topology, make_plan, token_straggler
from feplb.sched.placement import eplb_layout

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def ref_replicate(load: list[int], slots: int) -> list[int]:
    cnt = [1] * len(load)
    for _ in range(slots - len(load)):
        best = max(range(len(load)), key=lambda e: (Fraction(load[e], cnt[e]), -e))
        cnt[best] += 1
    return cnt


def ref_pack(items: list[Fraction], packs: int) -> list[list[int]]:
    """Item indices of each pack (items already in tie order)."""
    cap = len(items) // packs
    out: list[list[int]] = [[] for _ in range(packs)]
    weight = [Fraction(0)] * packs
    for i in sorted(range(len(items)), key=lambda i: (-items[i], i)):
        p = min((p for p in range(packs) if len(out[p]) < cap), key=lambda p: (weight[p], p))
        out[p].append(i)
        weight[p] += items[i]
    return out


def ref_eplb(load: list[int], W: int, G: int, slots: int, groups: int) -> tuple[list[Fraction], list, set]:
    """Per-GPU load (sorted) of EPLB's layout; per GPU, its experts, in EPLB's own labelling; replica counts."""
    E = len(load)
    nodes = W // G
    if groups % nodes:
        nodes, G, groups = 1, W, 1
    size = E // groups
    group_load = [sum(load[g * size:(g + 1) * size]) for g in range(groups)]
    node_groups = ref_pack([Fraction(x) for x in group_load], nodes) if groups // nodes > 1 else [
        [g] for g in range(groups)]
    per_gpu_loads, per_gpu_experts, counts = [], [], set()
    for gs in node_groups:
        experts = [e for g in gs for e in range(g * size, (g + 1) * size)]
        cnt = ref_replicate([load[e] for e in experts], G * (E // W + slots))
        counts |= set(cnt)
        items, owners = [], []
        for j, e in enumerate(experts):
            for _ in range(cnt[j]):
                items.append(Fraction(load[e], cnt[j]))
                owners.append(e)
        packs = ref_pack(items, G) if len(items) // G > 1 else [[i] for i in range(len(items))]
        for p in packs:
            per_gpu_loads.append(sum(items[i] for i in p))
            per_gpu_experts.append(sorted(owners[i] for i in p))
    return sorted(per_gpu_loads), per_gpu_experts, counts


def _round_robin(W: int, E: int, S: int, K: int) -> np.ndarray:
    """Token t of rank s goes to experts (s + t * K + k) % E: every expert gets the same rows."""
    t = np.arange(S)[:, None] * K + np.arange(K)[None, :]
    return np.stack([np.bincount(((t + s) % E).ravel(), minlength=E) for s in range(W)]).astype(np.int64)


def _spread(n_E: np.ndarray, W: int, rng: np.random.Generator) -> np.ndarray:
    """A counts_WE [W, E] whose columns sum to n_E, split at random among the sources."""
    out = np.zeros((W, n_E.size), dtype=np.int64)
    for e, n in enumerate(n_E.tolist()):
        out[:, e] = rng.multinomial(n, np.full(W, 1 / W))
    return out


@pytest.mark.parametrize("W", [8, 16], ids=["ep8", "ep16"])
@pytest.mark.parametrize("slots", [1, 2])
def test_balanced_routing_is_never_made_worse(W, slots):
    topo = Topology(num_ranks=W, gpus_per_node=8, num_experts=64, dyn=4)
    counts = _round_robin(W, 64, 2048, 6)
    state = PolicyState(topo=topo, policy="eplb", eplb_slots=slots)
    for _ in range(4):
        plan = make_plan("eplb", counts, topo, state)
        plan.validate(counts, topo, state)
        assert token_straggler(plan.loads_before_W) == 0
        assert token_straggler(plan.loads_after_W) == 0
        state = state.observe(counts, plan)
    assert state.layout_WP is not None


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(8, 8, 64, 1), (16, 8, 64, 1), (16, 8, 64, 4),
                                                               (16, 4, 48, 3), (4, 2, 16, 2), (8, 1, 8, 8)]),
       slots=st.sampled_from([0, 1, 2]), alpha=st.sampled_from([0.3, 1.0, 5.0]))
def test_static_skew_reaches_the_reference_balance(seed, shape, slots, alpha):
    W, G, E, groups = shape
    rng = np.random.default_rng(seed)
    # distinct skewed loads, then scaled so that every expert's rows divide evenly among its copies
    load = (rng.dirichlet(np.full(E, alpha)) * 10**6).astype(np.int64) * E + np.arange(E)
    load = load * math.lcm(*ref_eplb(load.tolist(), W, G, slots, groups)[2])
    ref_loads, _, _ = ref_eplb(load.tolist(), W, G, slots, groups)

    topo = Topology(num_ranks=W, gpus_per_node=G, num_experts=E, dyn=1)
    counts = _spread(load, W, rng)
    state = PolicyState(topo=topo, policy="eplb", eplb_slots=slots, eplb_groups=groups).observe(counts)
    plan = make_plan("eplb", counts, topo, state)
    plan.validate(counts, topo, state)
    assert sorted(plan.loads_after_W.tolist()) == ref_loads
    assert plan.loads_after_W.max() / plan.loads_after_W.mean() == pytest.approx(
        float(max(ref_loads) / (sum(ref_loads) / W)), rel=1e-12)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(16, 8, 64, 4), (16, 8, 64, 1), (8, 2, 32, 8)]),
       slots=st.sampled_from([0, 1, 3]))
def test_layout_invariants(seed, shape, slots):
    W, G, E, groups = shape
    rng = np.random.default_rng(seed)
    load = rng.zipf(1.3, size=E).clip(max=10**6).astype(np.int64)
    topo = Topology(num_ranks=W, gpus_per_node=G, num_experts=E)
    layout = eplb_layout(load, topo, slots, groups)
    assert layout.shape == (W, E // W + slots)
    assert np.all(np.bincount(layout.ravel(), minlength=E) >= 1)
    # the same experts per GPU as EPLB's own labelling, up to which GPU is which
    _, ref_experts, _ = ref_eplb(load.tolist(), W, G, slots, groups)
    assert sorted(map(list, layout.tolist())) == sorted(ref_experts)
    if groups % (W // G) == 0:
        # hierarchical: every copy of an expert stays in one node, a group's experts in the same node
        node_of = {}
        for g, row in enumerate(layout.tolist()):
            for e in row:
                assert node_of.setdefault(e, g // G) == g // G
        size = E // groups
        assert all(len({node_of[e] for e in range(k * size, (k + 1) * size)}) == 1 for k in range(groups))


def test_uneven_rows_go_to_the_least_loaded_copy():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=2, dyn=1)
    state = PolicyState(topo=topo, policy="eplb", eplb_slots=1).observe(np.array([[5, 1], [5, 1]]))
    # history [10, 2]: expert 0 takes both redundant slots (10 > 2, then 5 > 2); packing 10/3, 10/3, 10/3, 2
    # -> {0, 0} and {0, 1}, matched to the GPUs that are home to most of their experts
    assert state.layout_WP.tolist() == [[0, 0], [0, 1]]
    assert state.replicas == ((0, 1),) and state.last_weight_copies == ((0, 0, 1),)
    counts = np.array([[5, 2], [5, 2]], dtype=np.int64)  # n = [10, 4]: 3 rows per slot of expert 0, one left
    plan = make_plan("eplb", counts, topo, state)
    plan.validate(counts, topo, state)
    # base loads [6, 3 + 4]: the odd row goes to GPU 0 -> [7, 7] (GPU 1 would give [6, 8])
    assert plan.loads_after_W.tolist() == [7, 7]
    assert [tuple(m) for m in plan.moves] == [(0, 0, 1, 7, 10)]
    assert plan.weight_copies == () and plan.dispatched


def test_no_history_is_plain_ep_and_bad_groups_are_refused():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    counts = np.arange(32, dtype=np.int64).reshape(4, 8)
    plan = make_plan("eplb", counts, topo, PolicyState(topo=topo, policy="eplb"))
    assert plan.moves == () and plan.loads_after_W.tolist() == plan.loads_before_W.tolist()
    with pytest.raises(ValueError, match="eplb_groups must divide E=8"):
        PolicyState(topo=topo, policy="eplb", eplb_groups=3)
    with pytest.raises(ValueError, match="num_groups must be a positive int dividing E=8"):
        eplb_layout(np.ones(8, dtype=np.int64), topo, 1, 5)
    # home_E checked as place_experts checks owner_E (any values were taken; a short one was an IndexError later)
    load = np.arange(1, 9, dtype=np.int64)
    for home, words in ((np.full(8, 99), "home_E must give each of the W=4 GPUs exactly E // W = 2 experts"),
                        (np.zeros(8, dtype=np.int64), "exactly E // W = 2 experts"),
                        (np.full(8, 0.7), r"home_E must be an integer array of shape \[8\], got float64"),
                        (np.arange(4), r"home_E must be an integer array of shape \[8\]")):
        with pytest.raises(ValueError, match=words):
            eplb_layout(load, topo, 1, 1, home)
    mine = np.array([3, 3, 2, 2, 1, 1, 0, 0])
    assert eplb_layout(load, topo, 1, 1, mine).shape == (4, 3)
    with pytest.raises(ValueError, match=r"layout_WP must have shape .* \[4, 3\]"):
        PolicyState(topo=topo, policy="eplb", layout_WP=np.zeros((4, 2), dtype=np.int64))


@pytest.mark.parametrize("seed", range(6))
def test_plan_copies_exactly_the_weights_not_resident(seed):
    """A state holding only some of its layout's replicas (a runtime that keeps none per step, or a part): the plan
    copies (expert, home, GPU) for every move whose GPU holds no copy of the expert, once, sorted, and no other."""
    rng = np.random.default_rng(seed)
    topo = Topology(num_ranks=8, gpus_per_node=4, num_experts=32, dyn=2)
    state = PolicyState(topo=topo, policy="eplb", eplb_slots=2)
    for _ in range(3):
        state = state.observe(rng.multinomial(2048, rng.dirichlet(np.full(32, 0.3)), size=8))
    assert state.replicas
    keep = frozenset(r for r in state.replicas if rng.random() < 0.5)
    for resident in (state.resident, frozenset(), keep):
        partial = replace(state, resident=resident)
        counts = rng.multinomial(2048, rng.dirichlet(np.full(32, 0.3)), size=8)
        plan = make_plan("eplb", counts, topo, partial)
        plan.validate(counts, topo, partial)
        want = sorted({(m.expert, m.src, m.dst) for m in plan.moves if (m.expert, m.dst) not in resident})
        assert list(plan.weight_copies) == want
        assert (plan.weight_copies == ()) == (resident == state.resident)
