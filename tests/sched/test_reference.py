"""The optimized planner against plain references of the paper's greedy and of the token split (feplb-split, lp),
written here from their descriptions.

The reference uses Python lists and sorted() only, no numpy and nothing from feplb.sched but the Topology fields,
so a fast path in make_plan (integer sort keys, frozen arrays, per-node lists) cannot agree with it by sharing
code. Inputs: random topologies and skewed counts in several dtypes and layouts, with and without node=k.
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feplb.sched import Topology, make_plan, select_dynamic

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def ref_dynamic(n: list[int], topo: Topology) -> list[list[int]]:
    """Each GPU's dyn experts with the most rows, ties to the lower expert id, in that order."""
    S = topo.experts_per_rank
    return [sorted(range(g * S, (g + 1) * S), key=lambda e: (-n[e], e))[: topo.dyn] for g in range(topo.num_ranks)]


def ref_greedy(counts: list[list[int]], topo: Topology, tau: float = 0.01):
    """The paper's greedy, node by node: (moves as (expert, src, dst, 0, rows) sorted, loads before, after)."""
    W, E, G, S = topo.num_ranks, topo.num_experts, topo.gpus_per_node, topo.experts_per_rank
    n = [sum(counts[s][e] for s in range(W)) for e in range(E)]
    before = [sum(n[g * S:(g + 1) * S]) for g in range(W)]
    after = list(before)
    dynamic = ref_dynamic(n, topo)
    moves = []
    for node in range(topo.num_nodes):
        gpus = list(range(node * G, (node + 1) * G))
        left = {g: list(dynamic[g]) for g in gpus}  # not yet moved, still in (rows desc, id asc) order
        tau_gap = int(tau * sum(after[g] for g in gpus) / G)
        while True:
            hi = min(gpus, key=lambda g: (-after[g], g))  # most loaded, lowest id
            lo = min(gpus, key=lambda g: (after[g], g))   # least loaded, lowest id
            gap = after[hi] - after[lo]
            if gap <= tau_gap:
                break
            fits = [e for e in left[hi] if n[e] < gap]
            if not fits or n[fits[0]] == 0:
                break
            e = fits[0]
            left[hi].remove(e)
            after[hi] -= n[e]
            after[lo] += n[e]
            moves.append((e, hi, lo, 0, n[e]))
    return sorted(moves), before, after, dynamic


@st.composite
def cases(draw):
    g = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.integers(1, 3))
    epr = draw(st.integers(1, 8))
    topo = Topology(num_ranks=g * nodes, gpus_per_node=g, num_experts=g * nodes * epr, dyn=draw(st.integers(0, epr)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = draw(st.sampled_from([0, 1, 5, 100, 4000]))
    alpha = draw(st.sampled_from([0.05, 0.5, 5.0]))
    counts = rng.multinomial(rows, rng.dirichlet(np.full(topo.num_experts, alpha)), size=topo.num_ranks)
    layout = draw(st.sampled_from(["int64", "int32", "uint16", "fortran", "strided"]))
    if layout == "fortran":
        given_WE = np.asfortranarray(counts.astype(np.int64))
    elif layout == "strided":
        wide = np.zeros((topo.num_ranks, 2 * topo.num_experts), dtype=np.int64)
        wide[:, ::2] = counts
        given_WE = wide[:, ::2]
    else:
        given_WE = counts.astype(layout)
    tau = draw(st.sampled_from([0.0, 0.01, 0.2]))
    return topo, counts.astype(np.int64).tolist(), given_WE, tau


@SETTINGS
@given(case=cases())
def test_feplb_and_none_equal_the_plain_reference(case):
    topo, counts, given_WE, tau = case
    moves, before, after, dynamic = ref_greedy(counts, topo, tau)
    dyn_WD = np.asarray(dynamic, dtype=np.int64).reshape(topo.num_ranks, topo.dyn)
    assert select_dynamic("feplb", given_WE, topo).tolist() == dyn_WD.tolist()

    plan = make_plan("feplb", given_WE, topo, tau=tau)
    assert [tuple(m) for m in plan.moves] == moves
    assert plan.weight_copies == tuple(sorted({(e, s, d) for e, s, d, _, _ in moves}))
    assert plan.loads_before_W.tolist() == before
    assert plan.loads_after_W.tolist() == after
    assert plan.dynamic_WD.tolist() == dyn_WD.tolist()
    for a in (plan.dynamic_WD, plan.loads_before_W, plan.loads_after_W):
        assert a.dtype == np.int64 and not a.flags.writeable
    plan.validate(np.asarray(counts, dtype=np.int64), topo)

    none = make_plan("none", given_WE, topo)
    assert none.moves == () and none.weight_copies == ()
    assert none.loads_before_W.tolist() == none.loads_after_W.tolist() == before
    assert none.dynamic_WD.tolist() == dyn_WD.tolist()

    G = topo.gpus_per_node
    for k in range(topo.num_nodes):
        part = make_plan("feplb", given_WE, topo, tau=tau, node=k)
        assert [tuple(m) for m in part.moves] == [m for m in moves if m[1] // G == k]
        assert part.loads_after_W.tolist() == before[:k * G] + after[k * G:(k + 1) * G] + before[(k + 1) * G:]


def test_inputs_are_not_modified_nor_aliased():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=2)
    counts = np.arange(32, dtype=np.int64).reshape(4, 8)
    keep = counts.copy()
    for policy in ("none", "feplb", "feplb-split", "lp", "fastermoe", "eplb"):
        plan = make_plan(policy, counts, topo)
        assert np.array_equal(counts, keep) and counts.flags.writeable
        for a in (plan.dynamic_WD, plan.loads_before_W, plan.loads_after_W):
            assert not np.shares_memory(a, counts) and not a.flags.writeable


def ref_split(counts: list[list[int]], topo: Topology, tau: float, m: int, greedy_first: bool):
    """feplb-split (greedy_first, pieces of at least m rows, stop at tau) or lp (no greedy, m = 1, tau = 0), from
    the policy's description: (moves as tuples, loads after)."""
    W, E, G, S = topo.num_ranks, topo.num_experts, topo.gpus_per_node, topo.experts_per_rank
    n = [sum(counts[s][e] for s in range(W)) for e in range(E)]
    if greedy_first:
        whole, _, after, dynamic = ref_greedy(counts, topo, tau)
    else:
        whole, after, dynamic = [], [sum(n[g * S:(g + 1) * S]) for g in range(W)], ref_dynamic(n, topo)
    moved = {mv[0] for mv in whole}
    held = {g: [[e, 0, n[e], g] for e in dynamic[g] if n[e] and e not in moved] for g in range(W)}
    for e, src, dst, _, rows in whole:
        held[dst].append([e, 0, rows, src])
    for node in range(topo.num_nodes):
        gpus = list(range(node * G, (node + 1) * G))
        total = sum(after[g] for g in gpus)
        target = -(-total // G)
        tau_gap = int(tau * total / G) if greedy_first else 0
        for _ in range(10_000):
            hi = min(gpus, key=lambda g: (-after[g], g))
            lo = min(gpus, key=lambda g: (after[g], g))
            gap = after[hi] - after[lo]
            if after[hi] <= target or gap <= tau_gap:
                break
            want = min(after[hi] - target, target - after[lo])
            choice = None
            for p in sorted(held[hi], key=lambda p: (p[1] - p[2], p[0], p[1])):
                size = p[2] - p[1]
                options = [size] if size < gap else []
                if size >= 2 * m:
                    c = min(max(want, m), size - m)
                    if c < gap:
                        options.append(c)
                if options:
                    # the whole piece unless a chunk is strictly closer to want
                    x = options[0] if len(options) == 1 or abs(options[0] - want) <= abs(options[1] - want) \
                        else options[1]
                    choice = (p, x)
                    break
            if choice is None:
                break
            p, x = choice
            if x == p[2] - p[1]:
                held[hi].remove(p)
                held[lo].append(p)
            else:
                p[2] -= x
                held[lo].append([p[0], p[2], p[2] + x, p[3]])
            after[hi] -= x
            after[lo] += x
    pieces = sorted((e, a, b, h, g) for g in range(W) for e, a, b, h in held[g] if h != g)
    moves: list[list[int]] = []
    for e, a, b, h, g in pieces:
        if moves and moves[-1][0] == e and moves[-1][2] == g and moves[-1][4] == a:
            moves[-1][4] = b
        else:
            moves.append([e, h, g, a, b])
    return [tuple(mv) for mv in moves], after


@SETTINGS
@given(case=cases(), m=st.sampled_from([1, 16, 128]))
def test_split_and_lp_equal_the_plain_reference(case, m):
    topo, counts, given_WE, tau = case
    moves, after = ref_split(counts, topo, tau, m, greedy_first=True)
    plan = make_plan("feplb-split", given_WE, topo, tau=tau, min_chunk=m)
    assert [tuple(mv) for mv in plan.moves] == moves
    assert plan.loads_after_W.tolist() == after
    assert plan.weight_copies == tuple(sorted({(e, s, d) for e, s, d, _, _ in moves}))
    lp_moves, lp_after = ref_split(counts, topo, 0.0, 1, greedy_first=False)
    lp = make_plan("lp", given_WE, topo)
    assert [tuple(mv) for mv in lp.moves] == lp_moves and lp.loads_after_W.tolist() == lp_after
    G = topo.gpus_per_node
    for k in range(topo.num_nodes):
        part = make_plan("feplb-split", given_WE, topo, tau=tau, min_chunk=m, node=k)
        assert [tuple(mv) for mv in part.moves] == [mv for mv in moves if mv[1] // G == k]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(128, 8, 8), (256, 64, 8), (64, 16, 4)]),
       alpha=st.sampled_from([0.1, 0.5, 2.0]), m=st.sampled_from([1, 64, 128]))
def test_benchmark_shapes_equal_the_plain_reference(seed, shape, alpha, m):
    """The planner's fast paths at the shapes it is tuned for (bench/bench_sched.py: E=128, W=8 and E=256, W=64,
    dyn=4; skewed counts of 2048 tokens x top-8 per rank), every in-node policy, all nodes and each node alone."""
    E, W, G = shape
    topo = Topology(num_ranks=W, gpus_per_node=G, num_experts=E, dyn=4)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(2048 * 8, rng.dirichlet(np.full(E, alpha)), size=W).astype(np.int64)
    lists = counts.tolist()
    whole, before, after, dynamic = ref_greedy(lists, topo)
    split, split_after = ref_split(lists, topo, 0.01, m, greedy_first=True)
    lp, lp_after = ref_split(lists, topo, 0.0, 1, greedy_first=False)
    for policy, kw, moves, loads in (("feplb", {}, whole, after), ("feplb-split", {"min_chunk": m}, split, split_after),
                                     ("lp", {}, lp, lp_after)):
        plan = make_plan(policy, counts, topo, **kw)
        assert [tuple(mv) for mv in plan.moves] == moves, policy
        assert plan.weight_copies == tuple(sorted({(e, s, d) for e, s, d, _, _ in moves})), policy
        assert plan.loads_before_W.tolist() == before and plan.loads_after_W.tolist() == loads, policy
        assert plan.dynamic_WD.tolist() == dynamic, policy
        plan.validate(counts, topo)
        k = int(rng.integers(topo.num_nodes))
        part = make_plan(policy, counts, topo, node=k, **kw)
        assert [tuple(mv) for mv in part.moves] == [mv for mv in moves if mv[1] // G == k], policy
        assert part.loads_after_W.tolist() == before[:k * G] + loads[k * G:(k + 1) * G] + before[(k + 1) * G:]
