"""Plan.validate: accepts what the policies make, and names each kind of broken plan."""

import dataclasses

import numpy as np
import pytest

from feplb.sched import Move, Plan, PolicyState, Topology, make_plan

TOPO = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
# n_E = [20, 1, 1, 1, 1, 1, 1, 1]: GPU 0 (experts 0, 1) is hot, its dynamic expert is 0.
COUNTS = np.array([[5, 1, 0, 0, 1, 0, 0, 0],
                   [5, 0, 1, 0, 0, 1, 0, 0],
                   [5, 0, 0, 1, 0, 0, 1, 0],
                   [5, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)


def _good() -> Plan:
    plan = make_plan("feplb-split", COUNTS, TOPO, min_chunk=1)
    plan.validate(COUNTS, TOPO)
    assert plan.moves, "the fixture must move something"
    return plan


def _with(plan: Plan, **kw) -> Plan:
    return dataclasses.replace(plan, **kw)


def test_good_plan_and_its_loads():
    plan = _good()
    assert plan.loads_before_W.tolist() == [21, 2, 2, 2]
    assert plan.loads_after_W.sum() == COUNTS.sum()
    assert plan.rows_moved == sum(m.row_end - m.row_start for m in plan.moves)


def test_overlap_detected():
    plan = _good()
    m = plan.moves[0]
    extra = Move(expert=m.expert, src=m.src, dst=m.dst, row_start=m.row_start, row_end=m.row_end)
    with pytest.raises(ValueError, match="sorted|overlap"):
        _with(plan, moves=(m, extra)).validate(COUNTS, TOPO)
    a = Move(expert=0, src=0, dst=1, row_start=0, row_end=5)
    b = Move(expert=0, src=0, dst=1, row_start=3, row_end=8)
    with pytest.raises(ValueError, match="overlap a previous move"):
        _with(plan, moves=(a, b), weight_copies=((0, 0, 1),)).validate(COUNTS, TOPO)


def test_rows_out_of_range():
    plan = _good()
    bad = Move(expert=0, src=0, dst=1, row_start=10, row_end=21)
    with pytest.raises(ValueError, match=r"outside \[0, 20\)"):
        _with(plan, moves=(bad,), weight_copies=((0, 0, 1),)).validate(COUNTS, TOPO)


def test_cross_node_and_static_moves_refused_for_feplb():
    plan = _good()
    cross = Move(expert=0, src=0, dst=2, row_start=0, row_end=4)
    with pytest.raises(ValueError, match="across nodes"):
        _with(plan, moves=(cross,), weight_copies=((0, 0, 2),)).validate(COUNTS, TOPO)
    static = Move(expert=1, src=0, dst=1, row_start=0, row_end=1)
    with pytest.raises(ValueError, match="not dynamic"):
        _with(plan, moves=(static,), weight_copies=((1, 0, 1),)).validate(COUNTS, TOPO)


def test_wrong_src_and_self_move():
    plan = _good()
    with pytest.raises(ValueError, match="not expert 0's home"):
        _with(plan, moves=(Move(expert=0, src=1, dst=0, row_start=0, row_end=1),)).validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match="to itself"):
        _with(plan, moves=(Move(expert=0, src=0, dst=0, row_start=0, row_end=1),)).validate(COUNTS, TOPO)


def test_missing_weights_detected():
    plan = _good()
    with pytest.raises(ValueError, match="without its weights"):
        _with(plan, weight_copies=()).validate(COUNTS, TOPO)


def test_resident_replica_replaces_copy():
    state = PolicyState(topo=TOPO, policy="feplb-split", resident=frozenset({(0, 1)}))
    plan = make_plan("feplb-split", COUNTS, TOPO, state, min_chunk=1)
    assert plan.moves and not any(c[0] == 0 and c[2] == 1 for c in plan.weight_copies)
    plan.validate(COUNTS, TOPO, state)
    with pytest.raises(ValueError, match="without its weights"):
        plan.validate(COUNTS, TOPO)


def test_wrong_loads_detected():
    plan = _good()
    after = plan.loads_after_W.copy()
    after[0] += 1
    after[1] -= 1
    with pytest.raises(ValueError, match="loads_after_W"):
        _with(plan, loads_after_W=after).validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match="loads_before_W"):
        _with(plan, loads_before_W=plan.loads_after_W).validate(COUNTS, TOPO)


def test_dynamic_set_checked():
    plan = _good()
    with pytest.raises(ValueError, match="not at home on GPU 0"):
        _with(plan, dynamic_WD=np.array([[2], [2], [4], [6]])).validate(COUNTS, TOPO)
    with pytest.raises(ValueError, match="dynamic_WD must have shape"):
        _with(plan, dynamic_WD=np.zeros((4, 2), dtype=np.int64)).validate(COUNTS, TOPO)


def test_none_must_not_move():
    plan = _good()
    with pytest.raises(ValueError, match="'none' must not move"):
        _with(plan, policy="none").validate(COUNTS, TOPO)


def test_arrays_are_read_only():
    plan = _good()
    with pytest.raises(ValueError):
        plan.loads_after_W[0] = 0
