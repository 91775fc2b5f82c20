"""Cost model: the GEMM curve's shape, a measured table from JSON, per-GPU times under a plan, copy sizes."""

import dataclasses
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


def test_the_last_slope_holds_for_every_row_count_the_planner_takes():
    """Past the table the time grows along its last slope for any count the planner accepts (an expert's rows up to
    2**62), not flat from some point on (a simulation of huge micro-batches then read a straggler's GEMM as free)."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        rows = np.cumsum(rng.integers(1, 5000, size=rng.integers(2, 6)))
        us = np.cumsum(rng.uniform(1.0, 300.0, size=rows.size))
        cm = CostModel(table_rows=tuple(int(r) for r in rows), table_us=tuple(float(u) for u in us))
        slope = (us[-1] - us[-2]) / (rows[-1] - rows[-2])
        for n in (int(rows[-1]) + 1, 2**39, 2**41, 2**44, 2**50, 2**62):
            want = us[-1] + (n - rows[-1]) * slope
            assert cm.gemm_us(n) == pytest.approx(want, rel=1e-9), (n, list(rows), list(us))
    big = Topology(num_ranks=4, gpus_per_node=4, num_experts=32, dyn=2)
    cm = CostModel()
    assert cm.gemm_us(4 * big.max_count) > cm.gemm_us(2 * big.max_count) > cm.gemm_us(big.max_count)


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
    # the table given as iterators (read once) is taken as the tuples
    assert CostModel(table_rows=iter((64, 1024)), table_us=(u for u in (10.0, 100.0))).gemm_us(544) == \
        pytest.approx(CostModel(table_rows=(64, 1024), table_us=(10.0, 100.0)).gemm_us(544))


@pytest.mark.parametrize(
    "kw, match",
    [({"table_rows": (128, 64), "table_us": (1.0, 2.0)}, "strictly ascending"),
     ({"table_rows": (1, 2), "table_us": (2.0, 1.0)}, "non-decreasing"),
     ({"table_rows": (1,), "table_us": (1.0,)}, "length >= 2"),
     ({"ce_gbps": 0}, "ce_gbps must be a positive"),
     ({"hidden": 0}, "hidden must be a positive int"),
     ({"grad_dtype_bytes": 0}, "grad_dtype_bytes must be a positive int or None, got 0"),
     ({"grad_dtype_bytes": 2.0}, "grad_dtype_bytes must be a positive int or None"),
     # a flat last segment: its slope, carried past the table, made any number of rows past it free
     ({"table_rows": (128, 256, 4096), "table_us": (20.0, 40.0, 40.0)},
      r"must grow over its last segment .* got 40 us at 256 rows and 40 us at 4096"),
     # far past what an expert's rows reach: the interpolation's points no longer ascended, and every lookup failed
     ({"table_rows": (128, 2**70), "table_us": (20.0, 40.0)},
      r"must stay below 2\*\*46 rows .* got 1180591620717411303424"),
     ({"table_rows": (128, 2**46), "table_us": (20.0, 40.0)}, r"must stay below 2\*\*46 rows")],
    ids=["rows-not-ascending", "us-decreasing", "one-point", "zero-bandwidth", "zero-hidden", "zero-grad-bytes",
         "float-grad-bytes", "flat-end", "rows-past-2**64", "rows-2**46"],
)
def test_bad_cost_model(kw, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kw)


def test_bad_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rows": [1, 2]}))
    with pytest.raises(ValueError, match="needs keys 'rows' and 'us'"):
        CostModel.from_json(path)
    # a hand-written table's values as written: a fractional row count or shape, a bool, a string is refused,
    # never truncated or converted (128.9 rows read as 128, "hidden": true as H = 1)
    for doc, match in (({"rows": [128.9, 256], "us": [1, 2]}, r"table_rows must hold whole numbers of rows, got 128.9"),
                       ({"rows": [True, 256], "us": [1, 2]}, r"table_rows must hold whole numbers of rows, got True"),
                       ({"rows": [128, 256], "us": ["1", 2]}, r"table_us must hold numbers of us, got '1'"),
                       ({"rows": [128, 256], "us": [1, 2], "hidden": 2048.7},
                        r"hidden must be a positive int, got 2048.7"),
                       ({"rows": [128, 256], "us": [1, 2], "ffn": True}, r"ffn must be a positive int, got True"),
                       ({"rows": [128, 256], "us": [1, 2], "hidden": 10**9},
                        r"CostModel.hidden must be at most 1048576 \(2\*\*20.* got 1000000000"),
                       # the constructor's names beside the file's: they replaced them without a word
                       ({"rows": [128, 256], "us": [1, 2], "table_rows": [1, 2]},
                        r"gives its points and shape as 'rows', 'us', 'hidden' and 'ffn', not \['table_rows'\]"),
                       ({"rows": [128, 256], "us": [1, 2], "table_hidden": 7, "table_us": [1, 3]},
                        r"not \['table_hidden', 'table_us'\]"),
                       # a JSON integer beyond a float (OverflowError from float())
                       ({"rows": [128, 256], "us": [1, 10**400]},
                        r"table_us must hold numbers a float can hold, got one of 401 digits"),
                       ({"rows": [128, 256], "us": [float("inf"), 10**400]},
                        r"table_us must hold numbers a float can hold, got one of 401 digits")):
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=match):
            CostModel.from_json(path)
    path.write_text("[" * 100_000 + "]" * 100_000)     # (json's RecursionError)
    with pytest.raises(ValueError, match="not a cost table .its JSON is nested too deeply to read"):
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


def _two_gpu_case(e3_rows: int, *, policy: str = "feplb-split", from_source: bool = False):
    """GPU 0 homes experts 0 (1000 rows, dynamic) and 1 (200); GPU 1 homes 2 (100, dynamic) and 3 (``e3_rows``).
    Rows [0, 300) of expert 0 (or, ``from_source``, its 300 rows from source rank 1, computed there) run on GPU 1,
    with expert 0's weights copied there."""
    from feplb.sched import Move, Plan

    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    if from_source:
        counts = np.array([[700, 200, 0, 0], [300, 0, 100, e3_rows]], dtype=np.int64)
        move = Move(expert=0, src=0, dst=1, row_start=700, row_end=1000)
    else:
        counts = np.array([[1000, 200, 0, 0], [0, 0, 100, e3_rows]], dtype=np.int64)
        move = Move(expert=0, src=0, dst=1, row_start=0, row_end=300)
    plan = Plan(policy=policy, moves=(move,), weight_copies=((0, 0, 1),), dynamic_WD=np.array([[0], [2]]),
                loads_before_W=np.array([1200, 100 + e3_rows]), loads_after_W=np.array([900, 400 + e3_rows]),
                rows_from_source=from_source)
    plan.validate(counts, topo)
    # 10 us up to 100 rows, then 0.1 us per row; a row is 100 bytes, an expert's weights 30,000; the copy engines
    # move 1,000 bytes per us, a copy inside one GPU 10,000; such a copy halves the speed of a GEMM beside it
    cm = CostModel(hidden=50, ffn=100, table_hidden=50, table_ffn=100, table_rows=(100, 1000),
                   table_us=(10.0, 100.0), ce_gbps=1.0, d2d_gbps=10.0, copy_out_slowdown=0.5)
    return cm, plan, counts, topo


def test_layer_times_by_hand_copy_out_beside_the_static_gemm_and_results_home_last():
    cm, plan, counts, topo = _two_gpu_case(800)
    t = cm.layer_times(plan, counts, topo, plan_us=5.0)
    # GPU 0 sends 300 rows + the weights (60,000 bytes: 60 us), GPU 1 receives them and copies them out (6 us)
    assert t.ready_W.tolist() == pytest.approx([5 + 60, 5 + 60 + 6])
    # GPU 1's copy-out [65, 71] runs beside its static GEMM (expert 3, 80 us): 6 us at half speed costs 3 us
    assert t.static_W.tolist() == pytest.approx([20, 80 + 3])
    assert not t.hidden  # GPU 0's static GEMM (20 us) ends long before its copies
    # GPU 1: starts at 83, hosts 300 rows (30 us) then its own 100 rows (10 us): 123, but its send of the results
    # (30,000 bytes) leaves at 113 and ends at 143; GPU 0 copies them out (3 us) after its own 700 rows (65 + 70)
    assert t.end_W.tolist() == pytest.approx([146, 143])
    assert t.layer_us == pytest.approx(146)


def test_layer_times_by_hand_results_copy_out_beside_the_homes_gemm():
    cm, plan, counts, topo = _two_gpu_case(100)
    t = cm.layer_times(plan, counts, topo, plan_us=5.0)
    assert t.static_W.tolist() == pytest.approx([20, 10])  # GPU 1's copy-out [65, 71] after its static GEMM
    # GPU 1: 71 + 30 (hosted) + 10 = 111; results leave at 101, arrive at 131 (GPU 1 ends then), copied out
    # [131, 134] beside GPU 0's own rows [65, 135]: 3 us at half speed delays them by 1.5 us
    assert t.end_W.tolist() == pytest.approx([136.5, 131])


def test_layer_times_rows_computed_where_they_come_from_send_no_results_home():
    cm, plan, counts, topo = _two_gpu_case(800, policy="fastermoe", from_source=True)
    t = cm.layer_times(plan, counts, topo, plan_us=5.0)
    # FasterMoE plans before the dispatch (5 us), then every GEMM with its weights at hand runs: GPU 0 its 900 rows
    # (90 us), GPU 1 its 900 own (90 us), beside the weights' copy (30 us, broadcast in place: no copy-out); GPU 1
    # then computes the 300 rows of expert 0 that came from it (30 us); nothing goes home
    assert t.static_W.tolist() == pytest.approx([95, 95])
    assert t.ready_W[1] == pytest.approx(35) and t.hidden
    assert t.end_W.tolist() == pytest.approx([95, 125])
    # EPLB's rows come with the dispatch and need no plan in the micro-batch
    eplb = dataclasses.replace(plan, policy="eplb", rows_from_source=False, dispatched=True)
    assert cm.layer_times(eplb, counts, topo, plan_us=5.0).end_W.tolist() == pytest.approx([90, 120])


def test_layer_times_by_hand_a_receiver_waits_for_all_its_senders_copies():
    from feplb.sched import Move, Plan

    # GPU 0 homes expert 0 (1000 rows) and sends 300 of them to GPU 1, 100 to GPU 2, with the weights to both
    topo = Topology(num_ranks=3, gpus_per_node=3, num_experts=3, dyn=1)
    counts = np.array([[1000, 0, 0], [0, 100, 0], [0, 0, 100]], dtype=np.int64)
    plan = Plan(policy="feplb-split", moves=(Move(0, 0, 1, 0, 300), Move(0, 0, 2, 300, 400)),
                weight_copies=((0, 0, 1), (0, 0, 2)), dynamic_WD=np.array([[0], [1], [2]]),
                loads_before_W=np.array([1000, 100, 100]), loads_after_W=np.array([600, 400, 200]))
    plan.validate(counts, topo)
    cm = _two_gpu_case(0)[0]
    t = cm.layer_times(plan, counts, topo, plan_us=5.0)
    # GPU 0 sends 100,000 bytes (100 us); GPU 2 receives only 40,000 but its copy-out waits for all of GPU 0's
    # sends: 5 + 100 + 4, not 5 + 40 + 4
    assert t.ready_W.tolist() == pytest.approx([105, 111, 109])
    # GPU 1 hosts [111, 141] and sends 30 us of results (171), GPU 2 [109, 119] and 10 us (129); GPU 0, done with
    # its own 600 rows at 165, copies 40,000 bytes of results out once both arrived: [171, 175]
    assert t.end_W.tolist() == pytest.approx([175, 171, 129])


def test_backward_times_by_hand_static_rows_first_then_the_hosted_rows_and_their_gradients_home_beside_the_kept():
    cm, plan, counts, topo = _two_gpu_case(800)
    t = cm.backward_times(plan, counts, topo)
    # every backward GEMM takes twice its forward: GPU 0's static 200 rows 40 us and kept 700 rows 140 us; GPU 1's
    # static 800 rows 160 us, its 300 hosted rows 60 us and its kept 100 rows 20 us. The results' gradients
    # (30,000 bytes, 30 us) reach GPU 1 and are copied out at [30, 33], beside its static GEMM (half speed: +1.5 us)
    assert t.ready_W.tolist() == pytest.approx([0, 33]) and t.hidden
    assert t.static_W.tolist() == pytest.approx([40, 161.5])
    # GPU 1's hosted rows [161.5, 221.5], then its kept rows [221.5, 241.5] while the rows' and the weights'
    # gradients (60,000 bytes) go home: 281.5; GPU 0, its own GEMMs done (180), copies them out (6 us)
    assert t.end_W.tolist() == pytest.approx([287.5, 281.5])
    # weights held for the step (no weight copy this micro-batch) return no weight gradient: 30 us
    held = dataclasses.replace(plan, weight_copies=())
    assert cm.backward_times(held, counts, topo).end_W.tolist() == pytest.approx([254.5, 251.5])
    # recopy_weights: the weights (30,000 bytes) go to GPU 1 again beside the results' gradients: 60 us, copied
    # out at [60, 66] beside its static GEMM (+3 us); its hosted rows [163, 223], their gradients home by 283
    # (beside its kept rows), GPU 0 copies them out after its own GEMMs: 289
    again = cm.backward_times(plan, counts, topo, recopy=True)
    assert again.ready_W.tolist() == pytest.approx([0, 66]) and again.hidden
    assert again.static_W.tolist() == pytest.approx([40, 163])
    assert again.end_W.tolist() == pytest.approx([289, 283])
    assert cm.backward_times(plan, counts, topo, recopy=True, held=True).end_W.tolist() == pytest.approx(
        [254.5, 251.5])   # (held weights are not copied per micro-batch: nothing to copy again)
    # lazy replicas hold the weights this micro-batch copied for the rest of the step: same as no weight copy
    lazy = cm.backward_times(plan, counts, topo, held=True)
    assert lazy.end_W.tolist() == pytest.approx([254.5, 251.5])
    assert lazy.static_W.tolist() == t.static_W.tolist() and lazy.ready_W.tolist() == t.ready_W.tolist()
    # the results' gradients later than the static experts' backward: not hidden, and the hosted rows wait
    late = cm.backward_times(plan, np.array([[1000, 200, 0, 0], [0, 0, 100, 100]]), topo)
    assert late.static_W.tolist() == pytest.approx([40, 20]) and not late.hidden   # (the copy-out after it)
    # GPU 1: hosted [33, 93], kept [93, 113], sends home by 153; GPU 0 copies them out at [153, 159], beside its
    # kept rows' backward [40, 180] (half speed: +3 us), and ends with it: 183
    assert late.end_W.tolist() == pytest.approx([183, 153])


def test_backward_times_of_the_peers():
    cm, plan, counts, topo = _two_gpu_case(800, policy="fastermoe", from_source=True)
    # FasterMoE: GPU 1 computes its shadow's backward first (300 rows, 60 us) and reduces its weight gradients to
    # expert 0's owner beside its other GEMMs ([60, 90]); the owner, busy 180 us with its own 900 rows, waits for
    # nothing; GPU 1 ends with its 1200 rows at 240
    t = cm.backward_times(plan, counts, topo)
    assert t.end_W.tolist() == pytest.approx([180, 240])
    assert t.ready_W.tolist() == pytest.approx([180, 90]) and t.hidden
    # EPLB without copies in the micro-batch: every GPU its backward, nothing to wait for
    eplb = dataclasses.replace(plan, policy="eplb", rows_from_source=False, dispatched=True, weight_copies=())
    assert cm.backward_times(eplb, counts, topo).end_W.tolist() == pytest.approx([180, 240])


def test_backward_times_fastermoe_reduces_its_shadows_gradients_on_the_way():
    from feplb.sched import Move, Plan

    # expert 0 (GPU 0's, 100 rows of its own) shadowed on GPUs 1 and 2, each computing its own 300 rows of it
    topo = Topology(num_ranks=3, gpus_per_node=3, num_experts=3, dyn=1)
    counts = np.array([[100, 0, 0], [300, 100, 0], [300, 0, 100]], dtype=np.int64)
    plan = Plan(policy="fastermoe", moves=(Move(0, 0, 1, 100, 400), Move(0, 0, 2, 400, 700)),
                weight_copies=((0, 0, 1), (0, 0, 2)), dynamic_WD=np.array([[0], [1], [2]]),
                loads_before_W=np.array([700, 100, 100]), loads_after_W=np.array([100, 400, 400]),
                rows_from_source=True)
    plan.validate(counts, topo)
    cm = _two_gpu_case(0)[0]
    t = cm.backward_times(plan, counts, topo)
    # backward GEMMs 20 / 80 / 80 us; each shadow's first (60 us), then its gradients go (30 us): [60, 90]. The
    # owner receives them reduced, once (30 us, not 60: done at 90, not 120), after its own 20 us
    assert t.end_W.tolist() == pytest.approx([90, 90, 90])
    assert t.static_W.tolist() == pytest.approx([20, 80, 80]) and not t.hidden


def test_weights_us_by_hand_the_busiest_gpu_both_ways_per_link():
    cm = _two_gpu_case(0)[0]   # 30,000 bytes of weights; 1,000 bytes/us in a node, 50,000 between nodes
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=4, dyn=1)
    # GPU 0 sends two experts to GPU 1 (60 us) and receives one from GPU 2, across nodes (0.6 us), at once
    assert cm.weights_us([(0, 1), (0, 1), (2, 0)], topo) == pytest.approx(60.6)
    assert cm.weights_us([(1, 0), (0, 1)], topo) == pytest.approx(30)   # both ways at once
    assert cm.weights_us([], topo) == 0


def test_step_gradients_travel_as_the_runtime_sends_them():
    """A step's end sends the held copies' gradients as the runtime does (``FEPLBConfig.reduce_in_fp32``): fp32 sums
    of 16-bit weights' gradients by default, twice the weights' bytes; in the weights' dtype when asked; fp32 (or
    wider) weights in their own dtype. Weights themselves travel in their dtype."""
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=4, dyn=1)
    pairs = [(0, 1), (0, 1), (2, 0)]
    shape = dict(hidden=10, ffn=50, ce_gbps=1.0, net_gbps=50.0)   # 1,500 elements per expert
    bf16 = CostModel(**shape)
    assert (bf16.weight_bytes, bf16.grad_bytes) == (3000, 6000)
    # GPU 0 sends two experts' gradients to GPU 1 (2 x 6 us) and receives one from GPU 2 across nodes (0.12 us)
    assert bf16.weights_us(pairs, topo, grads=True) == pytest.approx(12.12)
    assert bf16.weights_us(pairs, topo) == pytest.approx(6.06)
    rounded = CostModel(**shape, grad_dtype_bytes=2)
    assert rounded.grad_bytes == 3000 and rounded.weights_us(pairs, topo, grads=True) == pytest.approx(6.06)
    for nbytes in (4, 8):
        wide = CostModel(**shape, dtype_bytes=nbytes)
        assert wide.grad_bytes == wide.weight_bytes == 1500 * nbytes


@pytest.mark.parametrize("policy", ["none", "feplb", "feplb-split", "fastermoe", "eplb", "lp"])
def test_layer_times_bounds_on_planned_layers(policy):
    rng = np.random.default_rng()
    topo = Topology(num_ranks=8, gpus_per_node=4, num_experts=32, dyn=2)
    cm = CostModel(hidden=1024, ffn=512)
    slow = CostModel(hidden=1024, ffn=512, d2d_gbps=cm.d2d_gbps / 10, copy_out_slowdown=1.0)
    for _ in range(5):
        counts = rng.multinomial(2048, rng.dirichlet(np.full(32, 0.3)), size=8).astype(np.int64)
        plan = make_plan(policy, counts, topo, min_chunk=None) if policy != "fastermoe" else \
            make_plan(policy, counts, topo, cost=cm)
        plan_us = float(rng.uniform(0, 200))
        t = cm.layer_times(plan, counts, topo, plan_us)
        gemm = cm.gemm_times_W(plan, counts, topo)
        static0 = cm.static_us_W(plan, counts, topo)
        # nothing ends before its GEMMs, or before planning where the plan delays them
        waits = plan_us if policy == "fastermoe" else 0.0
        assert np.all(static0 <= gemm + 1e-9) and np.all(t.end_W >= gemm + waits - 1e-9)
        if policy == "none":
            assert t.end_W.tolist() == pytest.approx(gemm.tolist()) and t.hidden
        if policy in ("feplb", "feplb-split", "lp"):
            # the dynamic work after the plan and the copies
            ready0 = plan_us + cm.copy_us_W(plan, topo)
            assert np.all(t.ready_W >= ready0 - 1e-9) and np.all(t.static_W >= static0 - 1e-9)
            assert np.all(t.end_W >= np.maximum(static0, ready0) + gemm - static0 - 1e-9)
        # a slower same-GPU copy that stops the GEMM beside it never makes the layer faster
        assert slow.layer_times(plan, counts, topo, plan_us).layer_us >= t.layer_us - 1e-9
        # the backward: no GPU ends before its backward GEMMs; plain EP's is exactly them
        b = cm.backward_times(plan, counts, topo)
        assert np.all(b.end_W >= cm.backward_factor * gemm - 1e-9) and np.all(b.static_W <= b.end_W + 1e-9)
        if policy in ("none", "eplb"):
            assert b.end_W.tolist() == pytest.approx((cm.backward_factor * gemm).tolist())
        assert slow.backward_times(plan, counts, topo).layer_us >= b.layer_us - 1e-9


@pytest.mark.parametrize("kw, match", [({"d2d_gbps": 0}, "d2d_gbps must be a positive"),
                                       ({"copy_out_slowdown": 1.5}, r"copy_out_slowdown must be a number in \[0, 1\]"),
                                       ({"copy_out_slowdown": True}, "copy_out_slowdown"),
                                       ({"backward_factor": 0}, "backward_factor must be a positive")])
def test_bad_copy_out_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kw)
