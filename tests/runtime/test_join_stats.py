"""feplb.join_stats: the whole group's balancing from per-rank LayerStats that each report their own node."""

from __future__ import annotations

import numpy as np
import pytest

from feplb import LayerStats, join_stats
from feplb.sched import Topology, make_plan, token_straggler

ROW_BYTES, W_BYTES, BANK = 8, 1000, 7   # bytes per row and per copied weight, placement bank bytes (any values)


def _stats(plan, planned: list[int], fell_back: bool = False) -> LayerStats:
    """A rank's stats as the layer reports them: plan loads for its planned GPUs, rows at home elsewhere (all of
    them when its node fell back)."""
    after = plan.loads_before_W.copy()
    moves = [] if fell_back else [m for m in plan.moves if m.src in planned]
    copies = [] if fell_back else [c for c in plan.weight_copies if c[2] in planned]
    for m in moves:
        after[m.src] -= m.rows
        after[m.dst] += m.rows
    rows = sum(m.rows for m in moves)
    w_in = [0] * len(after)
    for _, _, dst in copies:
        w_in[dst] += W_BYTES
    return LayerStats(loads_before_W=plan.loads_before_W.tolist(), loads_after_W=after.tolist(),
                      token_straggler_before=0.0, token_straggler_after=0.0, rows_moved=rows,
                      copy_bytes=2 * rows * ROW_BYTES + len(copies) * W_BYTES + BANK, weight_copies=len(copies),
                      plan_us=0.0, balanced=not fell_back, fell_back=fell_back, planned_ranks=planned,
                      row_bytes_moved=rows * ROW_BYTES, weight_bytes_moved=len(copies) * W_BYTES,
                      weight_bytes_in_W=w_in)


@pytest.mark.parametrize("policy", ["feplb", "feplb-split", "lp"])
def test_node_reports_join_into_the_whole_plan(policy):
    seed = int(np.random.SeedSequence().entropy % 2**32)   # fresh inputs every run, named in any failure
    rng = np.random.default_rng(seed)
    topo = Topology(num_ranks=8, gpus_per_node=2, num_experts=32, dyn=2)
    for _ in range(5):
        counts = rng.zipf(1.5, size=(8, 32)).clip(max=500)
        whole = make_plan(policy, counts, topo)
        per_rank = [_stats(make_plan(policy, counts, topo, node=r // 2), list(topo.node_ranks(r // 2)))
                    for r in range(8)]
        got = join_stats(per_rank)
        assert got["loads_after_W"] == whole.loads_after_W.tolist(), seed
        assert got["token_straggler_after"] == pytest.approx(token_straggler(whole.loads_after_W)), seed
        assert got["token_straggler_before"] == pytest.approx(token_straggler(whole.loads_before_W)), seed
        assert got["rows_moved"] == whole.rows_moved and not got["fell_back"], seed
        assert got["weight_copies"] == len(whole.weight_copies), seed
        assert got["copy_bytes"] == 2 * whole.rows_moved * ROW_BYTES + len(whole.weight_copies) * W_BYTES + BANK
        # each GPU's received weights, from the node that planned it, as the whole plan's copies say
        dst = np.bincount([c[2] for c in whole.weight_copies], minlength=8)
        assert got["weight_bytes_in_W"] == (W_BYTES * dst).tolist(), seed
        # stats of a whole plan (one node, or the peers' policies): any one rank is enough
        assert join_stats([_stats(whole, list(range(8)))])["loads_after_W"] == whole.loads_after_W.tolist()
        # node 1 fell back: its GPUs computed at home, the other nodes' moves stand
        per_rank[2:4] = [_stats(make_plan(policy, counts, topo, node=1), [2, 3], fell_back=True)] * 2
        got = join_stats(per_rank)
        want = whole.loads_after_W.copy()
        want[2:4] = whole.loads_before_W[2:4]
        assert got["loads_after_W"] == want.tolist() and got["fell_back"], seed
        assert got["weight_bytes_in_W"][2:4] == [0, 0], seed   # nothing received where the node fell back
        assert got["rows_moved"] == sum(m.rows for m in whole.moves if m.src not in (2, 3)), seed


def test_bad_reports_are_named():
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    counts = np.array([[9, 1, 0, 0, 0, 0, 0, 0]] * 4)
    plan = make_plan("feplb", counts, topo, node=0)
    node0 = _stats(plan, [0, 1])
    with pytest.raises(ValueError, match=r"no rank reported GPUs \[2, 3\]"):
        join_stats([node0, node0])
    with pytest.raises(ValueError, match="no stats given"):
        join_stats([])
    other = make_plan("feplb", counts * 2, topo, node=1)
    with pytest.raises(ValueError, match="rank 1's loads_before_W differ"):
        join_stats([node0, _stats(other, [2, 3])])
    wrong = LayerStats(**{**node0.__dict__, "loads_after_W": [36, 4, 0, 0]})
    with pytest.raises(ValueError, match="ranks disagree on GPU 0"):
        join_stats([node0, wrong, _stats(make_plan("feplb", counts, topo, node=1), [2, 3])])
