"""Policies: validity, determinism and "never worse" on random inputs; small cases worked out by hand."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feplb.sched import (
    POLICIES,
    CostModel,
    Plan,
    PolicyState,
    Topology,
    make_plan,
    select_dynamic,
    token_straggler,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ALL = [*POLICIES, "feplb+place", "feplb-split+place", "feplb@ema", "feplb-split+place@ema", "eplb+place",
       "fastermoe+place"]
# GEMM time = rows us (linear table), weight transfer = 6 bytes at 0.002 GB/s = 3 us, rows (2 bytes) at 1 us
LIN = CostModel(hidden=1, ffn=1, table_hidden=1, table_ffn=1, table_rows=(1, 2), table_us=(1.0, 2.0), ce_gbps=0.002)


def _topo_counts(draw_seed: int, g: int, nodes: int, epr: int, dyn_frac: float, alpha: float, rows: int):
    dyn = round(dyn_frac * epr)
    topo = Topology(num_ranks=g * nodes, gpus_per_node=g, num_experts=g * nodes * epr, dyn=dyn)
    rng = np.random.default_rng(draw_seed)
    counts = rng.multinomial(rows, rng.dirichlet(np.full(topo.num_experts, alpha)), size=topo.num_ranks)
    return topo, counts.astype(np.int64), rng


CASES = st.tuples(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3), st.integers(1, 6),
                  st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.05, 0.3, 1.0, 10.0]),
                  st.sampled_from([0, 1, 7, 300, 3000]))


def _node_max_bound(n_E, topo, dyn_WD):
    """Independent water-filling bound: per node, max(ceil(node rows / G), largest static load)."""
    static = n_E.reshape(topo.num_ranks, -1).sum(axis=1) - np.array([n_E[row].sum() for row in dyn_WD])
    out = []
    for node in range(topo.num_nodes):
        r = list(topo.node_ranks(node))
        tot = int(n_E.reshape(topo.num_ranks, -1)[r].sum())
        out.append(max(-(-tot // topo.gpus_per_node), int(static[r].max())))
    return out


def _ref_fastermoe(counts, topo, cost, max_shadow=None, home_E=None):
    """FasterMoE's shadowing rule, from its description, on lists: shadow the hottest experts (ties: lower id) while
    3 x the busiest GPU's GEMM + 4 x the busiest GPU's all-to-all rows + one weight transfer per shadowed expert
    gets shorter, at most max_shadow of them; experts computed on home_E (default: their owners). Returns the
    shadowed experts, sorted."""
    W, E, S = topo.num_ranks, topo.num_experts, topo.experts_per_rank
    home = [e // S for e in range(E)] if home_E is None else list(home_E)
    c = counts.tolist()
    n = [sum(c[s][e] for s in range(W)) for e in range(E)]
    inter = topo.gpus_per_node < W
    row, weights = cost.copy_us(cost.row_bytes, inter), cost.copy_us(cost.weight_bytes, inter)

    def latency(shadow):
        gemm, sent, recv = [0.0] * W, [0] * W, [0] * W
        for e in range(E):
            h = home[e]
            if e in shadow:
                for s in range(W):
                    gemm[s] += float(cost.gemm_us(c[s][e]))
            else:
                gemm[h] += float(cost.gemm_us(n[e]))
                for s in range(W):
                    if s != h:
                        sent[s] += c[s][e]
                        recv[h] += c[s][e]
        a2a = max(max(a, b) for a, b in zip(sent, recv, strict=True))
        return 3 * max(gemm) + 4 * row * a2a + len(shadow) * weights

    shadow: list[int] = []
    cur = latency(shadow)
    for e in sorted(range(E), key=lambda e: (-n[e], e)):
        if n[e] == 0 or len(shadow) == max_shadow:
            break
        new = latency([*shadow, e])
        if not new < cur:
            break
        shadow.append(e)
        cur = new
    return tuple(sorted(shadow))


@SETTINGS
@given(case=CASES)
def test_every_policy_valid_deterministic_never_worse(case):
    topo, counts, rng = _topo_counts(*case)
    history = rng.multinomial(int(counts.sum()) or 1, rng.dirichlet(np.ones(topo.num_experts)), size=topo.num_ranks)
    for policy in ALL:
        state = PolicyState(topo=topo, policy=policy, refresh_every=2).observe(history).observe(counts)
        plan = make_plan(policy, counts, topo, state)
        plan.validate(counts, topo, state)
        # identical inputs in another layout and dtype give the identical plan
        again = make_plan(policy, np.asfortranarray(counts).astype(np.int32), topo, state)
        assert again.fingerprint() == plan.fingerprint()
        assert plan.loads_after_W.sum() == counts.sum()
        if policy.split("@")[0] in ("feplb", "feplb-split", "lp"):
            # ours never make a micro-batch worse; peers' history-based choices (eplb, +place) may
            assert token_straggler(plan.loads_after_W) <= token_straggler(plan.loads_before_W), policy
        if policy == "fastermoe":
            assert plan.info["shadowed"] == _ref_fastermoe(counts, topo, CostModel())


@SETTINGS
@given(case=CASES)
def test_lp_is_the_bound_and_split_beats_greedy(case):
    topo, counts, _ = _topo_counts(*case)
    n_E = counts.sum(axis=0)
    greedy = make_plan("feplb", counts, topo)
    split = make_plan("feplb-split", counts, topo)
    lp = make_plan("lp", counts, topo)
    bound = _node_max_bound(n_E, topo, lp.dynamic_WD)
    G = topo.gpus_per_node
    for node in range(topo.num_nodes):
        sl = slice(node * G, (node + 1) * G)
        assert int(lp.loads_after_W[sl].max()) == bound[node]
        assert bound[node] <= split.loads_after_W[sl].max() <= greedy.loads_after_W[sl].max()
        assert greedy.loads_after_W[sl].max() <= greedy.loads_before_W[sl].max()


@SETTINGS
@given(case=CASES, min_chunk=st.sampled_from([1, 16, 128]))
def test_split_chunks_respect_minimum(case, min_chunk):
    topo, counts, _ = _topo_counts(*case)
    n_E = counts.sum(axis=0)
    plan = make_plan("feplb-split", counts, topo, min_chunk=min_chunk)
    plan.validate(counts, topo)
    pieces = {}
    for m in plan.moves:
        pieces.setdefault(m.expert, []).append(m.row_end - m.row_start)
    for e, sizes in pieces.items():
        home = int(n_E[e]) - sum(sizes)
        if len(sizes) == 1 and home == 0:
            continue  # a whole-expert move
        assert min(sizes) >= min_chunk and (home == 0 or home >= min_chunk), (e, sizes, home)


def test_golden_feplb_greedy():
    # one node of 4 GPUs, 2 experts each, all dynamic; loads [9, 1, 4, 2]
    topo = Topology(num_ranks=4, gpus_per_node=4, num_experts=8, dyn=2)
    counts = np.array([[6, 3, 1, 0, 2, 2, 1, 1]] + [[0] * 8] * 3, dtype=np.int64)
    plan = make_plan("feplb", counts, topo, tau=0)
    # GPU 0 (9) gives expert 0 (6 < gap 8) to GPU 1 -> [3, 7, 4, 2]; GPU 1 gives expert 2 (1 < 5) to GPU 3 ->
    # [3, 6, 4, 3]; GPU 1 has no dynamic expert left at home: stop.
    assert [(m.expert, m.src, m.dst, m.row_start, m.row_end) for m in plan.moves] == [(0, 0, 1, 0, 6), (2, 1, 3, 0, 1)]
    assert plan.loads_after_W.tolist() == [3, 6, 4, 3]
    assert plan.weight_copies == ((0, 0, 1), (2, 1, 3))


def test_golden_split_and_min_chunk():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    counts = np.array([[5, 1, 1, 0], [5, 1, 0, 1]], dtype=np.int64)  # n = [10, 2, 1, 1], loads [12, 2]
    assert make_plan("feplb", counts, topo).moves == ()  # expert 0 (10) is not below the gap (10)
    plan = make_plan("feplb-split", counts, topo, min_chunk=1)
    assert [(m.expert, m.src, m.dst, m.row_start, m.row_end) for m in plan.moves] == [(0, 0, 1, 5, 10)]
    assert plan.loads_after_W.tolist() == [7, 7]
    assert make_plan("feplb-split", counts, topo, min_chunk=6).moves == ()  # 10 rows cannot split into 6 + 6


def test_golden_lp_water_filling():
    topo = Topology(num_ranks=4, gpus_per_node=4, num_experts=4, dyn=1)
    counts = np.array([[10, 0, 0, 2]] + [[0] * 4] * 3, dtype=np.int64)
    plan = make_plan("lp", counts, topo)
    assert plan.loads_after_W.tolist() == [3, 3, 3, 3]
    assert [(m.expert, m.dst, m.row_start, m.row_end) for m in plan.moves] == [(0, 3, 3, 4), (0, 2, 4, 7),
                                                                               (0, 1, 7, 10)]


def test_golden_fastermoe():
    cost = LIN
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=2, dyn=1)
    counts = np.array([[6, 1], [6, 1]], dtype=np.int64)  # GEMM [12, 2] us; GPU 1 sends 6 rows, GPU 0 sends 1
    plan = make_plan("fastermoe", counts, topo, cost=cost)
    # no shadow: 3 * 12 + 4 * 6 = 60; shadow 0: 3 * 8 + 4 * 1 + 3 = 31, taken; shadow 1 too: 3 * 7 + 0 + 6 = 27,
    # taken (one weight transfer per shadowed expert, FasterMoE's send_model_time)
    assert plan.info["shadowed"] == (0, 1)
    assert plan.info["model_us_before"] == pytest.approx(60) and plan.info["model_us"] == pytest.approx(27)
    assert [(m.expert, m.src, m.dst, m.row_start, m.row_end) for m in plan.moves] == [(0, 0, 1, 6, 12),
                                                                                      (1, 1, 0, 0, 1)]
    assert plan.weight_copies == ((0, 0, 1), (1, 1, 0)) and plan.rows_from_source
    assert plan.loads_after_W.tolist() == [7, 7]
    plan.validate(counts, topo)
    # 20x wider experts, same GEMM times: a weight transfer takes 60 us, shadowing expert 0 (3 * 8 + 4 + 60 = 88)
    # no longer pays; at 10x (30 us: 58 < 60) it still does
    slow = dataclasses.replace(cost, ffn=20, table_ffn=20)
    assert make_plan("fastermoe", counts, topo, cost=dataclasses.replace(cost, ffn=10, table_ffn=10)
                     ).info["shadowed"] == (0,)
    assert make_plan("fastermoe", counts, topo, cost=slow).info["shadowed"] == ()


def test_fastermoe_does_not_shadow_on_a_tie():                # M18
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=2, dyn=1)
    plan = make_plan("fastermoe", np.array([[0, 0], [3, 3]]), topo, cost=LIN)
    # none: 3 * 3 + 4 * 3 = 21; shadowing 0: 3 * 6 + 0 + 3 = 21, not shorter
    assert plan.info["model_us_before"] == pytest.approx(21) and plan.info["shadowed"] == ()


@pytest.mark.parametrize("seed", range(4))
def test_fastermoe_many_shadowed_matches_reference(seed):
    # the planner evaluates candidates in blocks of 16, 32, 64, ...: 64 hot experts, cheap weight transfers, so
    # that about 50 are shadowed (three blocks), also cut short by max_shadow at and around the blocks' edges
    cost = CostModel(hidden=1, ffn=1, table_hidden=1, table_ffn=1, table_rows=(1, 2), table_us=(1.0, 2.0),
                     ce_gbps=2.0)
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=256, dyn=2)   # GPU 0 holds the 64 hot experts
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, size=(4, 256))
    counts[:, :64] += rng.integers(50, 400, size=(4, 64))
    counts[:, rng.permutation(64)[:8]] = counts[:, :8]  # ties of rows between hot experts
    for max_shadow in (None, 1, 15, 16, 17, 47, 48, 49, 100):
        plan = make_plan("fastermoe", counts, topo, cost=cost, max_shadow=max_shadow)
        ref = _ref_fastermoe(counts, topo, cost, max_shadow)
        assert plan.info["shadowed"] == ref
        plan.validate(counts, topo)
        # each shadowed expert's rows are computed where they come from: every source but its home holds one move
        # of exactly its own rows, in source order
        home = topo.default_home_E()
        got = [(m.expert, m.src, m.dst, m.row_end - m.row_start) for m in plan.moves]
        want = [(e, int(home[e]), s, int(counts[s, e])) for e in ref for s in range(4)
                if s != home[e] and counts[s, e]]
        assert got == want
    assert len(_ref_fastermoe(counts, topo, cost)) > 48


def test_golden_eplb():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    state = PolicyState(topo=topo, policy="eplb", eplb_slots=1).observe(np.array([[6, 1, 2, 1], [6, 1, 2, 1]]))
    # history [12, 2, 4, 2]: both redundant slots to expert 0 (12, then 6 > 4); replicas 4, 4, 4, 4, 2, 2 packed
    # three per GPU: {0, 0, 1} and {0, 2, 3} (4+4+2 against 4+4+2), matched to the GPUs with most of their homes
    assert state.layout_WP.tolist() == [[0, 0, 1], [0, 2, 3]]
    assert state.replicas == ((0, 1),)
    counts = np.array([[5, 2, 1, 0], [4, 1, 3, 2]], dtype=np.int64)  # n = [9, 3, 4, 2]
    plan = make_plan("eplb", counts, topo, state)
    # expert 0: 3 rows per slot, two slots on GPU 0 (home: rows [0, 6)), one on GPU 1 ([6, 9)); expert 1 (home 0)
    # stays; experts 2 and 3 are at home on GPU 1
    assert [(m.expert, m.src, m.dst, m.row_start, m.row_end) for m in plan.moves] == [(0, 0, 1, 6, 9)]
    assert plan.loads_after_W.tolist() == [9, 9] and plan.weight_copies == ()
    assert plan.dispatched and CostModel().plan_copy_bytes(plan) == 0  # rows go straight to replicas
    plan.validate(counts, topo, state)


def test_select_dynamic_modes():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=8, dyn=2)
    counts = np.array([[1, 5, 5, 0, 9, 0, 3, 3]] * 2, dtype=np.int64)
    assert select_dynamic("feplb", counts, topo).tolist() == [[1, 2], [4, 6]]
    state = PolicyState(topo=topo, policy="feplb@ema").observe(np.array([[9, 0, 0, 1, 0, 0, 0, 5]] * 2))
    assert select_dynamic("feplb@ema", counts, topo, state).tolist() == [[0, 3], [4, 7]]  # by current rows
    # no history: the current counts decide
    assert select_dynamic("feplb@ema", counts, topo, PolicyState(topo=topo, policy="feplb@ema")).tolist() == [
        [1, 2], [4, 6]]


@pytest.mark.parametrize("policy", ["feplbx", "feplb+foo", "feplb@later", ""])
def test_unknown_policy(policy):
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    with pytest.raises(ValueError, match="policy"):
        make_plan(policy, np.zeros((2, 4), dtype=np.int64), topo)


def test_bad_inputs():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    counts = np.ones((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="sums to 8 rows, but the micro-batch has total_rows=9"):
        make_plan("feplb", counts, topo, total_rows=9)
    with pytest.raises(ValueError, match="must be >= 0"):
        make_plan("feplb", -counts, topo)
    with pytest.raises(ValueError, match="state was made for policy 'feplb'"):
        make_plan("lp", counts, topo, PolicyState(topo=topo, policy="feplb"))
    with pytest.raises(ValueError, match="min_chunk"):
        make_plan("feplb-split", counts, topo, min_chunk=0)
    with pytest.raises(TypeError, match="topo must be a Topology"):
        make_plan("feplb", counts, (2, 2, 4))


@SETTINGS
@given(case=CASES)
def test_node_plans_are_slices_of_the_full_plan(case):
    topo, counts, _ = _topo_counts(*case)
    G = topo.gpus_per_node
    for policy in ("none", "feplb", "feplb-split", "lp"):
        full = make_plan(policy, counts, topo)
        for k in range(topo.num_nodes):
            part = make_plan(policy, counts, topo, node=k)
            part.validate(counts, topo)
            assert part.moves == tuple(m for m in full.moves if m.src // G == k)
            sl = slice(k * G, (k + 1) * G)
            assert part.loads_after_W[sl].tolist() == full.loads_after_W[sl].tolist()
            rest = np.ones(topo.num_ranks, bool)
            rest[sl] = False
            assert part.loads_after_W[rest].tolist() == part.loads_before_W[rest].tolist()


def test_node_option_refusals():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    counts = np.ones((4, 8), dtype=np.int64)
    with pytest.raises(ValueError, match=r"node must be an int in \[0, 2\)"):
        make_plan("feplb", counts, topo, node=2)
    with pytest.raises(ValueError, match="plans all of them"):
        make_plan("eplb", counts, topo, node=0)
    plan = make_plan("feplb", counts * np.arange(1, 9), topo, node=1)
    bad = Plan._trusted(**{**plan.__dict__, "node": 0})
    if plan.moves:
        with pytest.raises(ValueError, match="outside node 0"):
            bad.validate(counts * np.arange(1, 9), topo)


@pytest.mark.parametrize("seed", range(10))
def test_fastermoe_with_placement_matches_reference(seed):    # M22, M23
    rng = np.random.default_rng(seed)
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    cost = dataclasses.replace(LIN, net_gbps=0.002)           # GEMM 1 us per row, a row 1 us, a weight 3 us
    hist = rng.multinomial(400, rng.dirichlet(np.full(8, 0.3)), size=4)
    state = PolicyState(topo=topo, policy="fastermoe+place", place_min_gain=0.0).observe(hist)
    counts = rng.multinomial(40, rng.dirichlet(np.full(8, 0.3)), size=4)
    plan = make_plan("fastermoe+place", counts, topo, state, cost=cost)
    plan.validate(counts, topo, state)
    assert plan.info["shadowed"] == _ref_fastermoe(counts, topo, cost, home_E=state.home_E.tolist())



@pytest.mark.parametrize("policy", ["feplb+place", "feplb-split+place", "lp+place", "eplb+place"])
def test_owners_keep_the_weights_of_experts_placed_away(policy):
    """An expert that ``+place`` computes away from its owner: the owner keeps its parameters, so rows moved to the
    owner need no weight copy; rows moved to any other GPU still do (nothing is resident here)."""
    topo = Topology(num_ranks=4, gpus_per_node=4, num_experts=8, dyn=1)
    # expert 0 (owner GPU 0) computed at home on GPU 1, expert 2 (owner GPU 1) at home on GPU 0
    home = np.array([1, 0, 0, 1, 2, 2, 3, 3])
    counts = np.ones((4, 8), dtype=np.int64)
    counts[:, 0] = 40         # expert 0 is hot: its home GPU 1 sheds rows to the others, its owner GPU 0 among them
    layout = None
    if policy == "feplb+place":
        counts[:, 0] = counts[:, 3] = 20   # two hot experts on GPU 1: the greedy moves expert 0 whole to GPU 0
    if policy == "eplb+place":
        layout = np.array([[1, 2, 0], [0, 3, 0], [4, 5, 0], [6, 7, 0]])   # expert 0's redundant slots everywhere
    state = PolicyState(topo=topo, policy=policy, home_E=home, layout_WP=layout)
    assert state.owners_away == {(0, 0), (2, 1)} and not state.resident
    plan = make_plan(policy, counts, topo, state, min_chunk=1)
    plan.validate(counts, topo, state)
    moved_to = {(m.expert, m.dst) for m in plan.moves}
    assert (0, 0) in moved_to, f"{policy}: no rows of expert 0 moved to its owner ({plan.moves})"
    assert {(e, d) for e, _, d in plan.weight_copies} == moved_to - {(0, 0)}, plan.weight_copies
    # a GPU other than the owner without a copy is refused
    others = sorted(moved_to - {(0, 0)})
    if others:
        bad = dataclasses.replace(plan, weight_copies=tuple(c for c in plan.weight_copies if c[::2] != others[0]))
        with pytest.raises(ValueError, match="without its weights"):
            bad.validate(counts, topo, state)
