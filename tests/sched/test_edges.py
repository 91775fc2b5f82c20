"""Cases random inputs almost never reach: boundary ties of the planners, the checks of Plan.validate and the
layouts, cost-model times by hand, fastermoe+place against a reference (each kills a mutation the rest of the suite
let through)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from feplb.layout import home_layout, phase2_layout
from feplb.sched import CostModel, Move, PolicyState, Topology, make_plan
from feplb.sched.placement import eplb_layout, place_experts

LIN = CostModel(hidden=1, ffn=1, table_hidden=1, table_ffn=1, table_rows=(1, 2), table_us=(1.0, 2.0), ce_gbps=0.002)


def _mv(plan):
    return [tuple(m) for m in plan.moves]


# ----------------------------------------------------------------------------------------------- in-node policies
def test_greedy_stops_at_a_gap_equal_to_tau_gap():            # M1
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=2)
    counts = np.array([[10, 1, 9, 0], [0, 0, 0, 0]])          # loads [11, 9]: gap 2
    assert _mv(make_plan("feplb", counts, topo, tau=0.2)) == []   # tau_gap = int(0.2 * 20 / 2) = 2: stop
    assert _mv(make_plan("feplb", counts, topo, tau=0.1)) == [(1, 0, 1, 0, 1)]   # tau_gap 1 < 2: expert 1 moves


def test_split_never_moves_a_whole_piece_equal_to_the_gap():  # M4
    topo = Topology(num_ranks=3, gpus_per_node=3, num_experts=3, dyn=1)
    plan = make_plan("feplb-split", np.array([[0, 0, 3]] * 3), topo, min_chunk=8)
    assert plan.moves == () and plan.loads_after_W.tolist() == [0, 0, 9]   # 9 rows, gap 9: moving swaps the max


def test_split_takes_the_whole_piece_on_a_tie():              # M6
    topo = Topology(num_ranks=3, gpus_per_node=3, num_experts=12, dyn=1)
    counts = np.zeros((3, 12), np.int64)
    counts[0] = [40, 0, 0, 0, 10, 10, 10, 9, 11, 0, 0, 0]     # loads [40, 39, 11], target 30
    plan = make_plan("feplb-split", counts, topo, tau=0, min_chunk=2)
    # step 2: GPU 1 (39) -> GPU 2 (21), want 9: whole expert 4 (10 rows) or chunk 8 are equally close: whole
    assert _mv(plan) == [(0, 0, 2, 30, 40), (4, 1, 2, 0, 10)]
    assert plan.loads_after_W.tolist() == [30, 29, 31]


# ---------------------------------------------------------------------------------------------------------- eplb
def _eplb_case(seed):
    rng = np.random.default_rng(seed)
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    state = PolicyState(topo=topo, policy="eplb", eplb_slots=2).observe(
        rng.multinomial(300, rng.dirichlet(np.full(8, 0.5)), size=4))
    counts = rng.multinomial(301, rng.dirichlet(np.ones(8)), size=4)
    return topo, state, counts, make_plan("eplb", counts, topo, state)


@pytest.mark.parametrize("seed", range(20))
def test_eplb_rows_split_evenly_home_share_first(seed):       # M25, M28
    topo, state, counts, plan = _eplb_case(seed)
    plan.validate(counts, topo, state)
    n_E, home = counts.sum(axis=0), state.home_E
    slots = {}
    for g, row in enumerate(state.layout_WP.tolist()):
        for e in row:
            slots[(e, g)] = slots.get((e, g), 0) + 1
    moved = {}
    for m in plan.moves:
        moved[(m.expert, m.dst)] = moved.get((m.expert, m.dst), 0) + m.rows
    for e in range(topo.num_experts):
        c = sum(v for (x, _), v in slots.items() if x == e)
        kept = int(n_E[e]) - sum(v for (x, _), v in moved.items() if x == e)
        for (x, g), k in slots.items():
            if x == e:   # each slot n // c rows, one more for at most n % c of them
                rows = kept if g == home[e] else moved.get((e, g), 0)
                assert k * (n_E[e] // c) <= rows <= k * -(-n_E[e] // c), (e, g, rows)
        # the home GPU's share is the first rows of the expert's home order
        assert all(m.row_start >= kept for m in plan.moves if m.expert == e)


# ----------------------------------------------------------------------------------------------------- placement
def test_place_experts_lpt_ties_go_to_the_owner():            # P2
    topo = Topology(num_ranks=3, gpus_per_node=1, num_experts=6, dyn=0)
    assert place_experts(np.array([0, 2, 4, 2, 1, 0]), topo, min_gain=0.1).tolist() == [0, 0, 1, 2, 2, 1]
    topo = Topology(num_ranks=2, gpus_per_node=1, num_experts=6, dyn=0)
    assert place_experts(np.array([6, 8, 2, 1, 2, 1]), topo).tolist() == [0, 1, 0, 1, 0, 1]


def test_place_experts_keeps_the_owners_without_a_gain():     # P3
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=0)
    # the owners' max (4) equals the best possible: no migration
    assert place_experts(np.array([4, 0, 0, 2]), topo).tolist() == [0, 0, 1, 1]


def test_eplb_layout_takes_numpy_integers_and_refuses_bools():
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=0)
    load = np.array([9, 1, 1, 1])
    want = eplb_layout(load, topo, 1, num_groups=2)
    assert np.array_equal(eplb_layout(load, topo, np.int64(1), num_groups=np.int32(2)), want)
    for bad in (True, np.bool_(True), 1.0, -1):
        with pytest.raises(ValueError, match="slots_per_gpu must be an int >= 0"):
            eplb_layout(load, topo, bad)
    with pytest.raises(ValueError, match="num_groups must be a positive int dividing E=4"):
        eplb_layout(load, topo, 1, num_groups=np.bool_(True))


def test_eplb_layout_ties():                                  # P4, P5
    # replication ties go to the lower expert: [2, 1] -> 3 + 1 copies, not 2 + 2
    assert eplb_layout(np.array([2, 1]), Topology(num_ranks=1, gpus_per_node=1, num_experts=2, dyn=0), 2).tolist() \
        == [[0, 0, 0, 1]]
    # packing ties go to the lower pack
    assert eplb_layout(np.array([3, 3]), Topology(num_ranks=2, gpus_per_node=1, num_experts=2, dyn=0), 2).tolist() \
        == [[0, 0, 1], [0, 1, 1]]


# ------------------------------------------------------------------------------------------------- Plan.validate
TOPO = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
COUNTS = np.array([[5, 1, 0, 0, 1, 0, 0, 0], [5, 0, 1, 0, 0, 1, 0, 0],
                   [5, 0, 0, 1, 0, 0, 1, 0], [5, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)


def _plan(moves, copies, **kw):
    good = make_plan("feplb-split", COUNTS, TOPO, min_chunk=1)
    loads = np.array([21, 2, 2, 2])
    for m in moves:
        loads[m.src] -= m.rows
        loads[m.dst] += m.rows
    return dataclasses.replace(good, moves=tuple(moves), weight_copies=copies, loads_after_W=loads, **kw)


def test_validate_one_row_overlap_and_empty_moves():          # V2, V3
    with pytest.raises(ValueError, match="overlap"):
        _plan([Move(0, 0, 1, 0, 5), Move(0, 0, 1, 4, 8)], ((0, 0, 1),)).validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match="empty"):
        _plan([Move(0, 0, 1, 3, 3)], ((0, 0, 1),)).validate(COUNTS, TOPO)


def test_validate_rows_from_source_range():                   # V4
    ok = _plan([Move(0, 0, 1, 5, 10)], ((0, 0, 1),), rows_from_source=True, policy="fastermoe")
    ok.validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match="do not all come from source rank 1"):
        _plan([Move(0, 0, 1, 4, 9)], ((0, 0, 1),), rows_from_source=True, policy="fastermoe").validate(COUNTS, TOPO)


def test_validate_moves_of_numpy_integer_fields():
    """Move fields of a narrow numpy type (a caller's plan): rows counted as Python ints, the decision and the
    message those of plain ints, however large the loads; a field of no integer type (a float, a bool) refused by
    name."""
    big = COUNTS * 20_000                  # expert 0: 400,000 rows, beyond int16 and uint8
    topo_plan = make_plan("feplb-split", big, TOPO, min_chunk=1)
    for t in (np.int16, np.uint8, np.int32, np.int64):
        moves = (Move(*(t(v) for v in (0, 0, 1, 0, 100)), ),) if t == np.uint8 else \
            (Move(*(t(v) for v in (0, 0, 1, 0, 30_000)), ),)
        rows = int(moves[0].row_end)
        loads = topo_plan.loads_before_W.copy()
        loads[0] -= rows
        loads[1] += rows
        plan = dataclasses.replace(topo_plan, moves=moves, weight_copies=((0, 0, 1),), loads_after_W=loads)
        plan.validate(big, TOPO)
        wrong = dataclasses.replace(plan, loads_after_W=loads + 1)
        with pytest.raises(ValueError, match=rf"recomputed from the moves \[{int(loads[0])}, {int(loads[1])}, "):
            wrong.validate(big, TOPO)
    good = _plan([Move(0, 0, 1, 0, 5)], ((0, 0, 1),))
    for bad in (Move(0, 0, 1, 0, 5.0), Move(0.0, 0, 1, 0, 5), Move(0, 0, 1.0, 0, 5), Move(0, 0, True, 0, 5),
                Move(False, 0, 1, 0, 5), Move(0, 0, 1, np.bool_(False), 5)):
        for kw in ({}, {"rows_from_source": True, "policy": "fastermoe"}):
            with pytest.raises(TypeError, match=r"plan.moves\[0\]: its fields must be integers"):
                dataclasses.replace(good, moves=(bad,), **kw).validate(COUNTS, TOPO)



def test_validate_weight_copies_of_no_integer_type():
    """A weight copy's fields are checked as a move's: a bool, a float or a numpy bool refused by name (they
    validated, a True as GPU 1); a list of copies given to Plan is not truncated by int() (1.9 became 1)."""
    for bad in ((0, 0, True), (0, False, 1), (0, 0, 1.0), (0.0, 0, 1), (np.bool_(False), 0, 1), (0, 1)):
        with pytest.raises(TypeError, match=r"plan.weight_copies\[0\] must be an \(expert, src, dst\) tuple"):
            _plan([Move(0, 0, 1, 0, 5)], (bad,)).validate(COUNTS, TOPO)
    with pytest.raises(TypeError, match="Plan.weight_copies must hold .* tuples of integers"):
        _plan([Move(0, 0, 1, 0, 5)], [(0, 0, 1.9)])
    _plan([Move(0, 0, 1, 0, 5)], [(np.int64(0), np.int32(0), 1)]).validate(COUNTS, TOPO)   # numpy ints: ints

def test_validate_weight_copy_source_home_and_state():        # V5, V8, V9
    with pytest.raises(ValueError, match="must start at expert 0's home GPU 0"):
        _plan([Move(0, 0, 1, 0, 5)], ((0, 2, 1),)).validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match=r"weight copy \(0, 0, 0\) copies expert 0's weights to its own home GPU"):
        _plan([Move(0, 0, 1, 0, 5)], ((0, 0, 1), (0, 0, 0))).validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match=r"weight copy \(0, 0, 1\) is given twice"):
        _plan([Move(0, 0, 1, 0, 5)], ((0, 0, 1), (0, 0, 1))).validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match="exactly E // W"):
        _plan([], (), home_E=np.array([0, 0, 0, 1, 2, 2, 3, 3])).validate(COUNTS, TOPO)
    other = PolicyState(topo=TOPO, policy="feplb-split+place", home_E=np.array([1, 0, 0, 1, 2, 3, 2, 3]))
    with pytest.raises(ValueError, match="differs from the placement"):
        _plan([], ()).validate(COUNTS, TOPO, other)


# ------------------------------------------------------------------------------------------------ layout, bounds
def test_phase2_layout_rejects_overlapping_moves():           # L5
    home = home_layout(np.array([[3, 2], [1, 4]]), dynamic=[1])
    a = SimpleNamespace(expert=1, src=0, dst=1, row_start=0, row_end=4, rows=4)
    b = SimpleNamespace(expert=1, src=0, dst=1, row_start=3, row_end=6, rows=3)
    with pytest.raises(ValueError, match="overlap"):
        phase2_layout(home, [a, b], {0: 0, 1: 1}, 0)


def test_max_count_from_every_source_does_not_wrap():         # T1
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    counts = np.zeros((4, 8), np.int64)
    counts[:, 3] = topo.max_count
    state = PolicyState(topo=topo, policy="feplb@ema").observe(counts)
    assert state.ema_rows_E[3] == 4 * topo.max_count
    assert make_plan("feplb", counts, topo).loads_before_W[1] == 4 * topo.max_count


@pytest.mark.parametrize("policy", ["eplb", "eplb+place"])
def test_eplb_loads_exact_near_the_count_bound(policy):
    """EPLB's per-GPU loads near Topology.max_count (sums far past 2**53): added in int64, equal to the loads
    recomputed from its moves (validate) and to the total rows."""
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=2048, dyn=1)
    rng = np.random.default_rng(0)
    counts = np.full((2, 2048), topo.max_count, dtype=np.int64) - rng.integers(0, 3, (2, 2048))
    state = PolicyState(topo=topo, policy=policy, refresh_every=1)
    state = state.observe(counts, make_plan(policy, counts, topo, state))   # the layout exists from here on
    plan = make_plan(policy, counts, topo, state)
    plan.validate(counts, topo, state)
    assert int(plan.loads_after_W.sum()) == int(counts.sum())


# ---------------------------------------------------------------------------------------------------- cost model
def test_copy_and_static_times_by_hand():                     # C2, C3, C5
    cm = CostModel()
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    counts = np.zeros((4, 8), np.int64)
    counts[0, 0], counts[0, 1] = 600, 300                     # GPU 0: 900 rows, others none
    plan = make_plan("lp", counts, topo)                      # moves 450 rows of expert 0 to GPU 1 in the node
    assert _mv(plan) == [(0, 0, 1, 150, 600)]
    t = 450 * cm.row_bytes / (cm.ce_gbps * 1e3)
    assert cm.copy_us_W(plan, topo).tolist() == pytest.approx([t + cm.weight_bytes / (cm.ce_gbps * 1e3)] * 2 + [0, 0])
    assert cm.static_us_W(plan, counts, topo).tolist() == pytest.approx([float(cm.gemm_us(300)), 0, 0, 0])
    # FasterMoE: the owner sends a shadowed expert's weights once per link class (intra, inter), each GPU gets one
    hot = np.zeros((4, 8), np.int64)
    hot[:, 0] = 4000
    fm = make_plan("fastermoe", hot, topo, cost=dataclasses.replace(LIN, ce_gbps=1e6, net_gbps=1e6))
    assert fm.info["shadowed"] == (0,)
    w_in, w_out = cm.weight_bytes / (cm.ce_gbps * 1e3), cm.weight_bytes / (cm.net_gbps * 1e3)
    assert cm.copy_us_W(fm, topo).tolist() == pytest.approx([w_in + w_out, w_in, w_out, w_out])


def test_finish_joins_only_adjacent_pieces_of_one_holder():  # M14 (a path no plan reaches today)
    from feplb.sched.policies import _finish

    z = np.zeros((3, 1), np.int64)
    raw = [(-3, 0, 7, 10, 0, 1), (-3, 0, 4, 7, 0, 2), (-4, 0, 0, 4, 0, 1), (-2, 0, 10, 12, 0, 1)]
    plan = _finish("lp", raw, frozenset(), z, np.zeros(3, np.int64), [0, 0, 0], None)
    assert _mv(plan) == [(0, 0, 1, 0, 4), (0, 0, 2, 4, 7), (0, 0, 1, 7, 12)]
    assert plan.weight_copies == ((0, 0, 1), (0, 0, 2))
