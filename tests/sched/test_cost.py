"""Cost model: the GEMM curve's shape, a measured table from JSON, per-GPU times under a plan, copy sizes."""

import json

import numpy as np
import pytest

from feplb.sched import CostModel, Topology, make_plan


def test_default_curve_floor_linear_and_zero():
    cm = CostModel()
    t = cm.gemm_us(np.array([0, 1, 64, 128, 192, 256, 4096, 8192]))
    assert t[0] == 0.0
    assert t[1] == t[2] == t[3] == pytest.approx(26.25)  # weight-read floor up to 128 rows
    assert t[4] == pytest.approx((26.25 + 34.15) / 2)  # linear between table points
    assert t[6] == pytest.approx(512.83)
    slope = (512.83 - 259.43) / 2048
    assert t[7] == pytest.approx(512.83 + 4096 * slope)  # beyond the table: the last slope
    assert cm.knee_rows == 128
    assert cm.weight_bytes == 3 * 6144 * 2048 * 2 and cm.row_bytes == 6144 * 2


def test_shape_scaling_and_json_table(tmp_path):
    half = CostModel(hidden=3072)
    assert half.gemm_us(1024) == pytest.approx(CostModel().gemm_us(1024) / 2)
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"rows": [64, 1024], "us": [10.0, 100.0], "hidden": 1024, "ffn": 512,
                                "ce_gbps": 100.0}))
    cm = CostModel.from_json(path)
    assert (cm.hidden, cm.ffn, cm.knee_rows, cm.ce_gbps) == (1024, 512, 64, 100.0)
    assert cm.gemm_us(544) == pytest.approx(55.0)
    assert cm.copy_us(1e6) == pytest.approx(10.0)


@pytest.mark.parametrize(
    "kw, match",
    [({"table_rows": (128, 64), "table_us": (1.0, 2.0)}, "strictly ascending"),
     ({"table_rows": (1, 2), "table_us": (2.0, 1.0)}, "non-decreasing"),
     ({"table_rows": (1,), "table_us": (1.0,)}, "length >= 2"),
     ({"ce_gbps": 0}, "ce_gbps must be a positive"),
     ({"hidden": 0}, "hidden must be a positive int")],
    ids=["rows-not-ascending", "us-decreasing", "one-point", "zero-bandwidth", "zero-hidden"],
)
def test_bad_cost_model(kw, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kw)


def test_bad_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rows": [1, 2]}))
    with pytest.raises(ValueError, match="needs keys 'rows' and 'us'"):
        CostModel.from_json(path)


def test_gemm_times_under_a_plan_match_hand_sum():
    cm = CostModel()
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    counts = np.array([[500, 10, 0, 0], [500, 0, 20, 0]], dtype=np.int64)  # n = [1000, 10, 20, 0]
    plan = make_plan("feplb-split", counts, topo)
    moved = sum(m.rows for m in plan.moves if m.expert == 0)
    assert moved > 0
    g = lambda r: float(cm.gemm_us(r))  # noqa: E731
    expect0 = g(1000 - moved) + g(10)
    expect1 = g(20) + sum(g(m.rows) for m in plan.moves)
    assert cm.gemm_times_W(plan, counts, topo).tolist() == pytest.approx([expect0, expect1])
    assert cm.plan_copy_bytes(plan) == moved * cm.row_bytes + len(plan.weight_copies) * cm.weight_bytes
