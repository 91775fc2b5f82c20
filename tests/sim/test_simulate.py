"""The simulator: metrics against their definitions, the FLAME "never worse" check, and refusals."""

import dataclasses

import numpy as np
import pytest

from feplb.sched import CostModel, PolicyState, Topology, make_plan, token_straggler
from feplb.simulate import SimConfig, sampling_notes, simulate, summarize
from feplb.traces import ExpertShape, RoutingTrace, SyntheticWorkload, load_trace, trace_counts

OURS = ("feplb", "feplb-split", "lp", "feplb@ema", "feplb-split@ema")


def test_metrics_match_an_independent_replay():
    w = SyntheticWorkload(kind="dirichlet", num_experts=32, top_k=4, num_layers=2, alpha=0.3, seed=1)
    cfg = SimConfig(num_ranks=4, gpus_per_node=2, tokens_per_rank=128, dyn=2, microbatches=3, warmup=2,
                    policies=("none", "feplb-split"), plan_us=30.0)
    res = simulate(w, cfg)
    cm = CostModel()
    # replay: same micro-batches, same histories, straggler recomputed from loads by hand
    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=32, dyn=2)
    gen = w.microbatches(np.random.default_rng(cfg.seed), 4, 128)
    states = [PolicyState(topo=topo, policy="feplb-split") for _ in range(2)]
    for step in range(5):
        c = next(gen)
        for layer in range(2):
            plan = make_plan("feplb-split", c[layer], topo, states[layer], min_chunk=None)
            states[layer] = states[layer].observe(c[layer])
            if step >= 2:
                loads = plan.loads_after_W
                assert res.metrics["feplb-split"]["token_straggler"][layer, step - 2] == loads.max() - loads.mean()
                before = c[layer].sum(axis=0).reshape(4, -1).sum(axis=1)
                assert res.metrics["none"]["token_straggler"][layer, step - 2] == before.max() - before.mean()
                # the layer time charges the fixed planning time, on top of the GEMMs of plain EP's busiest GPU
                times = cm.layer_times(plan, c[layer], topo, 30.0)
                assert res.metrics["feplb-split"]["layer_ms"][layer, step - 2] == pytest.approx(times.layer_us / 1e3)
                assert res.metrics["feplb-split"]["hidden"][layer, step - 2] == times.hidden
                plain = cm.gemm_us(c[layer].sum(axis=0)).reshape(4, -1).sum(axis=1).max() / 1e3
                assert res.metrics["none"]["layer_ms"][layer, step - 2] == pytest.approx(plain)
                # and the backward's
                back = cm.backward_times(plan, c[layer], topo)
                assert res.metrics["feplb-split"]["backward_ms"][layer, step - 2] == pytest.approx(back.layer_us / 1e3)
                assert res.metrics["none"]["backward_ms"][layer, step - 2] == pytest.approx(2 * plain)
    s = res.summary()
    m = res.metrics["feplb-split"]
    assert s["feplb-split"]["token_straggler_reduction"] == pytest.approx(
        1 - m["token_straggler"].mean() / m["token_straggler_before"].mean())
    assert s["none"]["token_straggler_reduction"] == 0 and s["none"]["ce_bytes_per_microbatch"] == 0
    assert s["feplb-split"]["samples"] == 6 and s["feplb-split"]["planner_us_p99"] > 0
    assert s["feplb-split"]["fwd_bwd_ms"] == pytest.approx(m["layer_ms"].mean() + m["backward_ms"].mean())
    assert s["feplb-split"]["fwd_bwd_speedup"] == pytest.approx(
        3 * res.metrics["none"]["layer_ms"].mean() / (m["layer_ms"].mean() + m["backward_ms"].mean()))
    assert s["none"]["fwd_bwd_speedup"] == pytest.approx(1.0) and s["none"]["backward_speedup"] == pytest.approx(1.0)


def test_a_fixed_planning_time_makes_layer_times_deterministic():
    w = SyntheticWorkload(kind="zipf", num_experts=32, top_k=4, num_layers=2, alpha=1.0, seed=3)
    kw = dict(num_ranks=8, gpus_per_node=4, tokens_per_rank=256, dyn=2, microbatches=3, warmup=1,
              policies=("none", "feplb", "feplb-split@ema", "eplb"))
    runs = [simulate(w, SimConfig(**kw, plan_us=plan_us)).metrics for plan_us in (40.0, 40.0, 400.0)]
    for p in kw["policies"]:
        for k in ("layer_ms", "hidden"):
            assert np.array_equal(runs[0][p][k], runs[1][p][k]), (p, k)
    # a longer plan delays every layer that moves rows, and hides no more of them
    assert np.all(runs[2]["feplb"]["layer_ms"] >= runs[0]["feplb"]["layer_ms"])
    assert runs[2]["feplb"]["layer_ms"].sum() > runs[0]["feplb"]["layer_ms"].sum()
    assert runs[2]["feplb"]["hidden"].sum() <= runs[0]["feplb"]["hidden"].sum()
    assert np.array_equal(runs[2]["none"]["layer_ms"], runs[0]["none"]["layer_ms"])


def test_flame_no_policy_makes_things_worse(flame_path):
    trace = load_trace(flame_path)
    cfg = SimConfig(num_ranks=8, gpus_per_node=8, tokens_per_rank=256, microbatches=4, warmup=2,
                    policies=("none", *OURS, "feplb-split+place", "fastermoe", "eplb"))
    s = simulate(trace, cfg).summary()
    for p in OURS:
        assert s[p]["worse_than_none"] == 0, p  # on every layer and micro-batch
    for p in ("feplb-split+place", "fastermoe", "eplb"):
        # history-based choices may lose on a single micro-batch, never on average
        assert s[p]["token_straggler"] <= s["none"]["token_straggler"], p


def test_policy_ordering_on_skewed_routing():
    w = SyntheticWorkload(kind="zipf", num_experts=64, top_k=6, num_layers=2, alpha=0.8, seed=2)
    cfg = SimConfig(num_ranks=8, gpus_per_node=4, tokens_per_rank=512, microbatches=3, warmup=1,
                    policies=("none", "feplb", "feplb-split", "lp"))
    s = simulate(w, cfg).summary()
    assert 0 < s["feplb"]["token_straggler_reduction"] <= s["feplb-split"]["token_straggler_reduction"]
    assert s["feplb-split"]["token_straggler_reduction"] <= s["lp"]["token_straggler_reduction"] + 1e-12


def test_summarize_pools_workloads():
    cfg = SimConfig(num_ranks=2, gpus_per_node=2, tokens_per_rank=64, dyn=1, microbatches=2, warmup=0,
                    policies=("none", "feplb"))
    a = simulate(SyntheticWorkload(num_experts=8, top_k=2, num_layers=1, seed=0), cfg)
    b = simulate(SyntheticWorkload(num_experts=8, top_k=2, num_layers=3, seed=1), cfg)
    pooled = summarize([a, b])["feplb"]
    both = np.concatenate([r.metrics["feplb"]["token_straggler"].ravel() for r in (a, b)])
    assert pooled["samples"] == 8 and pooled["token_straggler"] == pytest.approx(both.mean())


class _BadWorkload:
    name, num_experts, top_k, num_layers, layer_names = "bad", 8, 2, 1, ("0",)

    def microbatches(self, rng, num_ranks, tokens_per_rank):
        while True:
            c = np.zeros((1, num_ranks, 8), dtype=np.int64)
            c[0, :, 0] = tokens_per_rank * 2 + 1
            yield c


def test_counts_disagreeing_with_the_microbatch_size_are_refused():
    cfg = SimConfig(num_ranks=2, gpus_per_node=2, tokens_per_rank=4, dyn=1, microbatches=1, warmup=0)
    with pytest.raises(ValueError, match=r"per-rank sums \[9\].*S \* K = 8 rows per rank"):
        simulate(_BadWorkload(), cfg)


@pytest.mark.parametrize(
    "kw, match",
    [({"policies": ("none", "none")}, "repeats"), ({"policies": ("magic",)}, "unknown base policy"),
     ({"microbatches": 0}, "microbatches must be"), ({"tokens_per_rank": -1}, "tokens_per_rank must be"),
     ({"plan_us": -1.0}, "plan_us must be None"), ({"plan_us": float("nan")}, "plan_us must be None")],
    ids=["repeated-policy", "unknown-policy", "zero-microbatches", "negative-tokens", "negative-plan", "nan-plan"],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(**kw)


def test_bad_topology_for_workload():
    with pytest.raises(ValueError, match="must divide num_experts"):
        simulate(SyntheticWorkload(num_experts=12, top_k=2, num_layers=1), SimConfig(num_ranks=8, gpus_per_node=8))


def test_token_straggler_is_the_shared_definition():
    assert token_straggler(np.array([3, 1])) == 1.0


def test_cost_model_uses_the_traces_expert_shape():
    rng = np.random.default_rng(5)
    # a hot expert 0 (half of the first choices): FasterMoE shadows it
    first = np.where(rng.random((8192, 2)) < 0.5, 0, rng.integers(1, 16, size=(8192, 2)))
    ids = np.stack([first, (first + 1 + rng.integers(0, 15, size=first.shape)) % 16], axis=2).astype(np.uint8)
    trace = RoutingTrace(name="skewed", topk_ids_TLK=ids, num_experts=16,
                         expert_shape=ExpertShape(model="small", hidden=1024, ffn=704))
    cfg = SimConfig(num_ranks=4, gpus_per_node=4, tokens_per_rank=2048, dyn=2, microbatches=2, warmup=0,
                    policies=("none", "fastermoe"))
    own = simulate(trace, cfg)
    glm = simulate(trace, SimConfig(**{**cfg.__dict__, "shape_from_trace": False}))
    assert own.expert_shape["model"] == "small" and (own.expert_shape["hidden"], own.expert_shape["ffn"]) == (1024, 704)
    assert glm.expert_shape["hidden"] == 6144 and glm.expert_shape["model"] is None
    s_own, s_glm = own.summary()["none"], glm.summary()["none"]
    assert (s_own["expert_hidden"], s_own["expert_ffn"], s_glm["expert_hidden"]) == (1024, 704, 6144)
    # GEMM times scale with H * F: the same routing costs 1024 * 704 / (6144 * 2048) as much
    ratio = 1024 * 704 / (6144 * 2048)
    assert s_own["gemm_straggler_before_ms"] == pytest.approx(s_glm["gemm_straggler_before_ms"] * ratio, rel=1e-9)
    # and the weights FasterMoE broadcasts are 3 * H * F elements (its decisions are the same: both sides of its
    # comparison scale with H * F under this cost model)
    f_own, f_glm = own.summary()["fastermoe"], glm.summary()["fastermoe"]
    assert f_own["rows_moved_per_microbatch"] == f_glm["rows_moved_per_microbatch"] > 0
    assert f_own["ce_bytes_per_microbatch"] == pytest.approx(f_glm["ce_bytes_per_microbatch"] * ratio, rel=1e-9)


def test_pooled_summary_marks_mixed_shapes():
    cfg = SimConfig(num_ranks=2, gpus_per_node=2, tokens_per_rank=32, dyn=1, microbatches=1, warmup=0,
                    policies=("none",))
    a = simulate(SyntheticWorkload(num_experts=8, top_k=2, num_layers=1), cfg)
    b = simulate(SyntheticWorkload(num_experts=8, top_k=2, num_layers=1),
                 SimConfig(**{**cfg.__dict__, "cost": CostModel(hidden=64, ffn=32)}))
    assert summarize([a])["none"]["expert_hidden"] == 6144
    assert np.isnan(summarize([a, b])["none"]["expert_hidden"])


def test_extra_weights_held_per_gpu():
    """The memory metric (expert weights the busiest GPU holds beyond its own): nothing for plain EP; for
    per-micro-batch policies the copies a plan sends the GPU receiving most; (G - 1) x dyn eager replicas per GPU
    under @ema after a refresh; the experts +place puts on a GPU away from their owners; the slots of EPLB's
    layout away from their owners."""
    from feplb.sched import parse_policy
    from feplb.simulate import extra_weights

    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    topo = Topology(num_ranks=8, gpus_per_node=4, num_experts=32, dyn=2)
    owner = topo.default_home_E()
    seen = set()
    for _ in range(5):
        counts = rng.zipf(1.3, size=(8, 32)).clip(max=400).astype(np.int64)
        for policy in ("none", "feplb", "feplb-split", "feplb-split@ema", "feplb-split+place", "eplb"):
            state = PolicyState(topo=topo, policy=policy, refresh_every=1, eplb_slots=2)
            state = state.observe(counts, make_plan(policy, counts, topo, state))   # a refresh: replicas, placement
            plan = make_plan(policy, counts, topo, state)
            got = extra_weights(state, plan, topo)
            to_gpu = np.bincount([dst for _, _, dst in plan.weight_copies], minlength=8)
            if policy == "none":
                assert got == 0 and not plan.weight_copies
            elif policy == "eplb":
                # every slot of the layout away from its expert's owner: the copies each step re-sends there
                away = np.bincount([g for e, g in state.replicas if g != owner[e]], minlength=8)
                assert set(state.replicas) <= state.resident and away.sum() == len(state.last_weight_copies)
                assert got == (away + to_gpu).max() >= 2
                seen.add("eplb" if got > 2 else "eplb-slots-only")
            elif parse_policy(policy)[2] == "ema":
                per_gpu = np.bincount([g for _, g in state.resident], minlength=8)
                assert (per_gpu == (topo.gpus_per_node - 1) * topo.dyn).all(), per_gpu
                assert got == (per_gpu + to_gpu).max()
            elif parse_policy(policy)[1]:
                placed = np.bincount(state.home_E[state.home_E != owner], minlength=8)
                assert got == (placed + to_gpu).max()
                seen.add("placed" if placed.any() else "unplaced")
            else:
                assert got == to_gpu.max()
                seen.add("copied" if to_gpu.any() else "uncopied")
    assert {"placed", "copied", "eplb"} <= seen, seen   # the cases with something to count came up


def test_extra_weights_in_the_summary():
    w = SyntheticWorkload(kind="zipf", num_experts=32, top_k=4, num_layers=2, alpha=1.0, seed=3)
    cfg = SimConfig(num_ranks=8, gpus_per_node=4, tokens_per_rank=256, dyn=2, microbatches=3, warmup=2,
                    refresh_every=2, policies=("none", "feplb-split", "feplb-split@ema"))
    res = simulate(w, cfg)
    s = res.summary()
    cost, _ = cfg.cost_for(w)
    assert s["none"]["extra_weight_bytes"] == 0 and s["none"]["extra_weight_pct"] == 0
    for p in ("feplb-split", "feplb-split@ema"):
        m = res.metrics[p]
        assert s[p]["extra_weight_bytes"] == pytest.approx(m["extra_weight_bytes"].mean())
        # whole experts' weights, and a percentage of the GPU's own 32 / 8 experts
        assert np.all(m["extra_weight_bytes"] % cost.weight_bytes == 0)
        assert np.allclose(m["extra_weight_pct"], 100 * m["extra_weight_bytes"] / cost.weight_bytes / 4)
    # @ema holds the node's other dynamic experts all step: (4 - 1) x 2 per GPU at least
    assert res.metrics["feplb-split@ema"]["extra_weight_pct"].min() >= 100 * 6 / 4


def test_step_traffic_lands_at_refreshes_for_policies_that_hold_copies():
    """``step_ms``: the held copies' gradients back and the refresh's copies, at each refresh only (every 4th
    micro-batch here), for the policies that hold copies; none for those that do not. ``train`` adds it. Only the
    copies the step's plans used send their gradients (the others' are zero, and the runtime sends none)."""
    from feplb.sched import make_plan
    from feplb.simulate import plan_uses, step_us

    w = SyntheticWorkload(kind="zipf", num_experts=32, top_k=4, num_layers=1, alpha=1.0, seed=5)
    cfg = SimConfig(num_ranks=8, gpus_per_node=4, tokens_per_rank=256, dyn=2, microbatches=8, warmup=4,
                    refresh_every=4, policies=("none", "feplb", "feplb@ema", "eplb"), plan_us=30.0)
    res = simulate(w, cfg)
    for p in ("none", "feplb"):
        assert not res.metrics[p]["step_ms"].any(), p
    for p in ("feplb@ema", "eplb"):
        step = res.metrics[p]["step_ms"][0]
        assert np.flatnonzero(step).tolist() == [3, 7], (p, step)   # micro-batches 8 and 12 of the run refresh
    # the ema replicas: every GPU holds its node's other dynamic experts (3 GPUs x 2), both ways at each refresh
    topo = cfg.topology(32)
    cm = CostModel()
    state = PolicyState(topo=topo, policy="feplb@ema", refresh_every=4)
    gen = w.microbatches(np.random.default_rng(cfg.seed), 8, 256)
    used = set()
    for _ in range(8):
        counts = next(gen)[0]
        plan = make_plan("feplb@ema", counts, topo, state, tau=cfg.tau, cost=cm)
        new = state.observe(counts, plan)
        used |= {(m.expert, m.dst) for m in plan.moves if m.rows} | {(e, s) for e, s, _ in plan.weight_copies}
        step_used, used = used, (set() if new.refreshed else used)
        state, prev, last = new, state, plan
    assert len(prev.resident) == 8 * 3 * 2 and len(state.last_weight_copies) == 8 * 3 * 2
    assert plan_uses(last) <= step_used and 0 < len(prev.resident & step_used) < len(prev.resident), step_used
    assert res.metrics["feplb@ema"]["step_ms"][0, 3] == \
        pytest.approx(step_us(prev, state, cm, topo, last, step_used) / 1e3)
    # the used replicas' gradients (fp32 sums of the bf16 copies, twice the weights' bytes), then the refresh's copies
    owner = topo.default_home_E()
    back = [(g, int(owner[e])) for e, g in prev.resident & step_used]
    assert step_us(prev, state, cm, topo, last, step_used) == \
        pytest.approx(cm.weights_us(back, topo, grads=True) + cm.weights_us([(0, 1)] * 6, topo))
    # every replica's: both ways at each refresh
    assert step_us(prev, state, cm, topo) == pytest.approx(3 * cm.weights_us([(0, 1)] * 6, topo))
    rounded = dataclasses.replace(cm, grad_dtype_bytes=2)    # FEPLBConfig(reduce_in_fp32=False)
    assert step_us(prev, state, rounded, topo) == pytest.approx(2 * cm.weights_us([(0, 1)] * 6, topo))
    s = res.summary()["feplb@ema"]
    m = res.metrics["feplb@ema"]
    assert s["train_ms"] == pytest.approx(m["layer_ms"].mean() + m["backward_ms"].mean() + m["step_ms"].mean())
    assert s["train_speedup"] < s["fwd_bwd_speedup"]


def test_step_traffic_of_lazy_replicas_counts_every_copy_of_the_step_once():
    """Lazy replicas: what a step's plans copied (the last micro-batch's too) returns its gradients at the refresh,
    each pair once, and no micro-batch's backward returns them; nothing held on an owner is charged."""
    from feplb.sched import make_plan
    from feplb.simulate import extra_weights, step_us

    w = SyntheticWorkload(kind="zipf", num_experts=32, top_k=4, num_layers=1, alpha=1.2, seed=7)
    topo = Topology(num_ranks=8, gpus_per_node=4, num_experts=32, dyn=2)
    cm = CostModel()
    state = PolicyState(topo=topo, policy="feplb-split@ema", refresh_every=4, replicas_mode="lazy")
    gen = w.microbatches(np.random.default_rng(3), 8, 256)
    copied, checked = set(), 0
    for _ in range(8):
        counts = next(gen)[0]
        plan = make_plan("feplb-split@ema", counts, topo, state)
        held = {(e, d) for e, _, d in plan.weight_copies}
        assert not held & copied, "a lazy replica was copied twice in a step"
        copied |= held
        new = state.observe(counts, plan)
        if plan.weight_copies:
            # the backward sends the rows' gradients only: as if no weight had been copied
            bare = dataclasses.replace(plan, weight_copies=())
            assert cm.backward_times(plan, counts, topo, held=True).end_W.tolist() == \
                cm.backward_times(bare, counts, topo).end_W.tolist()
        if new.refreshed and state.step == 0:
            copied = set()        # (the first micro-batch refreshes: a step of one)
        elif new.refreshed:
            owner = topo.default_home_E()
            back = [(g, int(owner[e])) for e, g in copied if g != owner[e]]
            assert copied and step_us(state, new, cm, topo, plan) == pytest.approx(cm.weights_us(back, topo,
                                                                                             grads=True))
            # without the micro-batch's plan, its own copies would be missing
            if held - set(state.resident):
                assert step_us(state, new, cm, topo) < step_us(state, new, cm, topo, plan)
            checked += 1
            copied = set()
        state = new
    assert checked == 2
    # a copy on its expert's owner (placement can compute an expert away from its owner) is never held there
    base = PolicyState(topo=topo, policy="feplb@ema")
    on_owner = dataclasses.replace(base, resident=frozenset({(0, 0)}))   # GPU 0 owns expert 0
    away = dataclasses.replace(base, resident=frozenset({(0, 1)}))
    assert step_us(on_owner, base, cm, topo) == 0.0
    assert step_us(away, base, cm, topo) == pytest.approx(cm.weights_us([(1, 0)], topo, grads=True))
    assert cm.weights_us([(1, 0)], topo) > 0
    # nor is it an extra weight there (the owner's parameters are its own experts')
    nothing = make_plan("none", np.ones((8, 32), dtype=np.int64), topo)
    assert extra_weights(on_owner, nothing, topo) == 0 and extra_weights(away, nothing, topo) == 1


def test_recopy_weights_lengthens_the_backward_of_plans_that_copy_weights_only():
    """``recopy_weights``: FEPLB plans that copy weights per micro-batch receive them again in the backward (a
    longer backward); plans that copy none, plain EP and the peers (modelled as published) are unchanged, and so
    is every forward figure."""
    w = SyntheticWorkload(kind="zipf", num_experts=32, top_k=4, num_layers=2, alpha=1.2, seed=5)
    kw = dict(num_ranks=8, gpus_per_node=4, tokens_per_rank=256, dyn=2, microbatches=6, warmup=2,
              policies=("none", "feplb", "feplb-split", "fastermoe", "eplb"), plan_us=30.0)
    base, again = simulate(w, SimConfig(**kw)), simulate(w, SimConfig(**kw, recopy_weights=True))
    for p in kw["policies"]:
        a, b = base.metrics[p], again.metrics[p]
        for k in ("layer_ms", "copy_bytes", "token_straggler", "step_ms"):
            assert np.array_equal(a[k], b[k]), (p, k)
        if p in ("feplb", "feplb-split"):
            assert (b["backward_ms"] >= a["backward_ms"] - 1e-12).all(), p
            assert (b["backward_ms"] > a["backward_ms"]).any(), f"{p}: no micro-batch copied weights"
        else:
            assert np.array_equal(a["backward_ms"], b["backward_ms"]), p
    with pytest.raises(TypeError, match="recopy_weights must be a bool"):
        SimConfig(recopy_weights=1)
    with pytest.raises(ValueError, match=r"recopy_weights: .*\['feplb@ema'\] per step"):
        SimConfig(recopy_weights=True, policies=("none", "feplb@ema"))


def test_one_dimension_given_keeps_the_other_of_each_workload():
    ids = np.random.default_rng().integers(0, 16, size=(512, 1, 2))
    trace = RoutingTrace(name="t", topk_ids_TLK=ids, num_experts=16,
                         expert_shape=ExpertShape(model="small", hidden=1024, ffn=704))
    synthetic = SyntheticWorkload(kind="zipf", num_experts=16, top_k=2, num_layers=1, seed=0)
    for given, want_trace, want_synthetic in (({"ffn": 512}, (1024, 512), (6144, 512)),
                                              ({"hidden": 4096}, (4096, 704), (4096, 2048)),
                                              ({}, (1024, 704), (6144, 2048))):
        cfg = SimConfig(num_ranks=2, gpus_per_node=2, **given)
        for w, want in ((trace, want_trace), (synthetic, want_synthetic)):
            cost, shape = cfg.cost_for(w)
            assert (cost.hidden, cost.ffn) == (shape["hidden"], shape["ffn"]) == want, (given, w.name)
            assert all(f"SimConfig.{k}" in shape["source"] for k in given)
    with pytest.raises(ValueError, match="SimConfig.ffn must be None or an int >= 1"):
        SimConfig(ffn=0)


def test_sampling_notes_say_what_the_micro_batches_are():
    """Each claim of ``sampling_notes`` checked on the micro-batches themselves."""
    rng = np.random.default_rng(11)
    T, W = 64, 4
    trace = RoutingTrace(name="t", topk_ids_TLK=rng.integers(0, 16, size=(T, 2, 2)), num_experts=16)

    def draws(S, n=5, seed=0):
        gen = trace.microbatches(np.random.default_rng(seed), W, S)
        return [next(gen) for _ in range(n)]

    def notes(S, **kw):
        return sampling_notes(trace, SimConfig(num_ranks=W, gpus_per_node=W, tokens_per_rank=S, dyn=1,
                                               policies=("none", "feplb"), microbatches=2, warmup=0, **kw))

    # S = T: every rank routes the whole trace, the same counts on every rank in every micro-batch
    assert len(notes(T)) == 1 and "every rank routes the same tokens" in notes(T)[0]
    mbs = draws(T)
    assert all((mb == mbs[0][:, :1]).all() for mb in mbs)
    assert len(notes(2 * T)) == 1 and "every rank routes the same tokens" in notes(2 * T)[0]
    assert all((mb == 2 * mbs[0][:, :1]).all() for mb in draws(2 * T, seed=1))
    # S > T, not a multiple: every rank routes the whole trace S // T times, plus S % T tokens of its own
    S = T + T // 4
    assert notes(S) == (f"t: each rank's S={S} tokens wrap around the whole trace of T={T}: every rank routes all of "
                        f"it 1 time(s), and the ranks and micro-batches differ only in their other {T // 4} tokens",)
    whole = trace_counts(trace.topk_ids_TLK[None], 16)[:, 0]       # [L, E]
    for mb in draws(S):
        rest = mb - whole[:, None, :]
        assert (rest >= 0).all() and (rest.sum(axis=2) == (T // 4) * 2).all()
    assert any((mb != mb[:, :1]).any() for mb in draws(S))
    # W x S > T (but S < T): the ranks' slices overlap
    assert len(notes(T // 2)) == 1 and "the ranks' slices overlap" in notes(T // 2)[0]
    # S <= T / W: nothing to say; the ranks' counts differ
    assert notes(T // W) == ()
    assert any((mb != mb[:, :1]).any() for mb in draws(T // W))
    # few sample starts: slices repeat
    starts = RoutingTrace(name="t", topk_ids_TLK=trace.topk_ids_TLK, num_experts=16, seq_offsets=np.array([0, 32, 64]))
    got = sampling_notes(starts, SimConfig(num_ranks=W, gpus_per_node=W, tokens_per_rank=8, dyn=1,
                                           policies=("none",), microbatches=2, warmup=1))
    assert got == ("t: 2 sample starts for 12 rank slices: slices repeat, so a measured micro-batch may hold slices "
                   "the histories have seen",)
    gen = starts.microbatches(np.random.default_rng(0), W, 8)
    slices = [tuple(c.ravel()) for _ in range(3) for c in next(gen).transpose(1, 0, 2)]   # each rank's counts
    assert len(set(slices)) < len(slices) <= 12
    # per-step costs over a window of no whole steps, only for the policies that have them
    assert notes(T // W, refresh_every=4) == ()
    for policy in ("feplb@ema", "eplb", "feplb+place"):
        cfg = SimConfig(num_ranks=W, gpus_per_node=2, tokens_per_rank=T // W, dyn=1, policies=(policy,),
                        microbatches=6, warmup=0, refresh_every=4)
        assert sampling_notes(trace, cfg) == (f"--microbatches 6 is not a multiple of --refresh-every 4: the "
                                              f"per-step costs of {policy} count only the refreshes inside the "
                                              "measured micro-batches (too few or too many per micro-batch)",)
        # a whole number of steps, but without warm-up the window holds the first micro-batch's refresh too: 3
        # refreshes over 8 micro-batches of 4-micro-batch steps (steps 1, 4 and 8)
        assert sampling_notes(trace, dataclasses.replace(cfg, microbatches=8)) == (
            f"with --warmup 0 the measured micro-batches hold 3 refreshes (the first micro-batch's refresh among "
            f"them), not 2: the per-step costs of {policy} count only the refreshes inside the measured "
            "micro-batches (too few or too many per micro-batch)",)
        assert sampling_notes(trace, dataclasses.replace(cfg, microbatches=8, warmup=1)) == ()
        assert sampling_notes(trace, dataclasses.replace(cfg, microbatches=8, warmup=4)) == ()


@pytest.mark.parametrize("kw, error, match", [
    ({"tau": -1.0}, ValueError, r"SimConfig.tau must be a finite number >= 0, got -1.0"),
    ({"tau": float("inf")}, ValueError, "SimConfig.tau must be"),
    ({"min_chunk": 0}, ValueError, r"SimConfig.min_chunk must be None \(the cost model's knee\) or an int >= 1"),
    ({"replicas_mode": "bogus"}, ValueError, "SimConfig.replicas_mode must be 'eager' or 'lazy', got 'bogus'"),
    ({"ema_shift": -1}, ValueError, "SimConfig.ema_shift must be an int >= 0, got -1"),
    ({"validate": "no"}, TypeError, "SimConfig.validate must be a bool, got 'no'"),
    ({"policies": "feplb"}, TypeError, "SimConfig.policies must be a sequence of policy names, got the string"),
], ids=["tau-negative", "tau-inf", "min-chunk", "replicas-mode", "ema-shift", "validate", "policies-string"])
def test_config_refuses_planner_options_by_their_names(kw, error, match):
    """The planner's and the history's options are refused by SimConfig itself, naming the field (simulate() raised
    later without the name, "no" validated, a string's letters were taken for policies)."""
    with pytest.raises(error, match=match):
        SimConfig(**kw)


def test_dyn_past_the_experts_per_rank_is_named_by_its_field():
    """SimConfig.dyn above a workload's E // W: refused naming SimConfig.dyn (the topology's message named its own
    field; the layer clips its dyn instead, which the message says)."""
    cfg = SimConfig(num_ranks=8, gpus_per_node=8, dyn=4, policies=("feplb",), microbatches=1, warmup=0)
    wl = SyntheticWorkload(kind="zipf", num_experts=16, top_k=2, num_layers=1, alpha=1.0, drift=0.0, seed=0)
    with pytest.raises(ValueError, match=r"^SimConfig.dyn must be <= experts per rank E // W = 2, got dyn=4 "
                                         r"\(E=16, W=8; the layer clips FEPLBConfig.dyn"):
        simulate(wl, cfg)

@pytest.mark.parametrize("np_type", ["int64", "int32", "uint16"])
def test_config_takes_numpy_numbers_as_python_ones(np_type):
    """A sweep's numpy scalars (np.arange, an array's items) configure the simulator as the Python numbers they
    hold, stored as those (SimConfig refused np.int64(8) as "not an int"); numpy bools and whole floats stay refused
    where an int is asked."""
    t = getattr(np, np_type)
    got = SimConfig(num_ranks=t(4), gpus_per_node=t(2), tokens_per_rank=t(64), dyn=t(1), microbatches=t(3),
                    warmup=t(1), seed=t(5), refresh_every=t(2), ema_shift=t(1), eplb_slots=t(1), eplb_groups=t(1),
                    min_chunk=t(3), hidden=t(32), ffn=t(48), plan_us=t(7), tau=np.float32(0.25),
                    place_min_gain=np.float64(0.125), validate=np.bool_(False))
    want = SimConfig(num_ranks=4, gpus_per_node=2, tokens_per_rank=64, dyn=1, microbatches=3, warmup=1, seed=5,
                     refresh_every=2, ema_shift=1, eplb_slots=1, eplb_groups=1, min_chunk=3, hidden=32, ffn=48,
                     plan_us=7, tau=0.25, place_min_gain=0.125, validate=False)
    assert got == want
    for f in dataclasses.fields(SimConfig):
        assert type(getattr(got, f.name)) is type(getattr(want, f.name)), f.name
    for name in ("num_ranks", "min_chunk", "hidden"):
        for bad in (np.bool_(True), np.float64(4.0)):
            with pytest.raises(ValueError, match=rf"SimConfig.{name} must be .*an int >= 1, got"):
                SimConfig(**{name: bad})
    with pytest.raises(ValueError, match="SimConfig.num_ranks must be an int >= 1"):
        SimConfig(num_ranks=t(0))
