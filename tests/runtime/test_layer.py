"""MoELayer on 4 gloo ranks (2 nodes x 2 GPUs, and 1 node x 4): output and every gradient with balancing on equal
those with balancing off and those of a single-process dense reference built from the same weights, on random and
adversarial routing; plans identical on every rank of the plan's scope (the node under node plans, else the
group); balancing lowers the token straggler on skewed routing.

One process group per topology; every case runs inside it (process start-up dominates the cost on 2 cores).
"""

from __future__ import annotations

import functools

import pytest
import torch

from feplb.testing import dense_moe_reference, error_bound, load_global_weights, max_abs_error, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W = 16, 32, 16, 2, 4
IN_NODE = ("feplb", "feplb-split", "lp", "feplb@ema", "feplb-split@ema")
ROUTINGS = ("random", "skewed", "one_expert", "hot_per_node", "empty_experts", "no_tokens")


def make_inputs(routing: str, seed: int, gpus_per_node: int, router: str = "softmax"):
    """Global weights, per-rank tokens and upstream gradients for one case (identical in every process)."""
    gen = torch.Generator().manual_seed(seed)
    router_EH = torch.randn(E, H, generator=gen) / H ** 0.5
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    tokens = [24, 40, 8, 32]
    if routing == "no_tokens":
        tokens[1] = 0
    xs = [torch.randn(t, H, generator=gen) for t in tokens]
    for x in xs:
        x[:, 0] = x[:, 0].abs() + 1.0   # coordinate 0 steers the router below
    router_EH[:, 0] = 0.0
    L = E // W
    if routing in ("skewed", "no_tokens"):
        router_EH[[0, 1, 2], 0] = torch.tensor([3.0, 2.0, 1.5])   # GPU 0's experts are hot
    elif routing == "one_expert":
        router_EH[5, 0] = 6.0                                      # every token picks expert 5
    elif routing == "hot_per_node":
        for node in range(W // gpus_per_node):
            router_EH[node * gpus_per_node * L + 1, 0] = 6.0        # one hot expert on each node
    elif routing == "empty_experts":
        router_EH[1::2, 0] = -6.0                                   # odd experts receive nothing
    dys = [torch.randn(t, H, generator=gen) for t in tokens]
    return router_EH, w1, w2, xs, dys


def make_biases(seed: int):
    """The experts' biases (b1 [E, 2F], b2 [E, H]) for cases with ``expert_bias``: their own stream, so the other
    inputs of a seed stay as they are."""
    gen = torch.Generator().manual_seed(seed + 10_000)
    return torch.randn(E, 2 * FF, generator=gen) * 0.5, torch.randn(E, H, generator=gen) * 0.5


def _run_layer(rank, world, cfg_kwargs, routing, seed, microbatches=1):
    from feplb import FEPLBConfig, MoELayer
    from feplb.replicas import state_digest

    G = cfg_kwargs["gpus_per_node"]
    router_EH, w1, w2, xs, dys = make_inputs(routing, seed, G, cfg_kwargs.get("router", "softmax"))
    replicas_mode = cfg_kwargs.get("replicas_mode")   # FEPLBConfig.replicas
    cfg = FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, plan_wait_ms=60_000, min_straggler_rows=0, min_chunk=2,
                      **{k: v for k, v in cfg_kwargs.items() if k != "replicas_mode"},
                      **({} if replicas_mode is None else {"replicas": replicas_mode}))
    layer = MoELayer(cfg)
    biases = make_biases(seed) if cfg.expert_bias else ()
    if not cfg.gated:   # non-gated experts: w1 [E, H, F] (the gate half's columns), b1 [E, F]
        w1, biases = w1[:, :, :FF].contiguous(), tuple(b[:, :FF].contiguous() if b.shape[1] == 2 * FF else b
                                                       for b in biases)
    load_global_weights(layer, router_EH, w1, w2, *biases)
    if replicas_mode is not None:
        assert layer.state.replicas_mode == replicas_mode
    if cfg.weights == "per-step":
        with torch.no_grad():
            layer(xs[rank])            # a micro-batch that tells the layer which experts are dynamic
        layer.refresh_replicas()
    x = xs[rank].clone().requires_grad_(True)
    for _ in range(microbatches):
        out = layer(x)
        (out * dys[rank]).sum().backward()
    layer.reduce_replica_grads()
    if layer.last_plan is not None:
        # Every row computed exactly once, moves start at home, in-node policies stay in the node.
        counts_WE, state = layer.last_plan_inputs
        layer.last_plan.validate(counts_WE, layer.topo, state)
        assert sum(layer.last_stats.loads_before_W) == sum(layer.last_stats.loads_after_W) == counts_WE.sum()
        # A node plan is exactly that node's part of the whole plan (made here, in one call, from the same inputs).
        from feplb.sched import make_plan

        plan = layer.last_plan
        whole = make_plan(cfg.policy, counts_WE, layer.topo, state, tau=cfg.tau, min_chunk=cfg.min_chunk,
                          cost=layer._cost)
        mine = (lambda gpu: True) if plan.node is None else (lambda gpu: gpu // layer.topo.gpus_per_node == plan.node)
        assert plan.moves == tuple(m for m in whole.moves if mine(m.src)), (plan.moves, whole.moves)
        assert plan.weight_copies == tuple(cp for cp in whole.weight_copies if mine(cp[2]))
        ranks = layer.last_stats.planned_ranks
        assert ranks == ([r for r in range(world) if mine(r)])
        assert layer.last_stats.loads_after_W[ranks[0]:ranks[-1] + 1] == whole.loads_after_W[ranks].tolist()
    s = layer.last_stats
    plan_node = None if layer.last_plan is None else layer.last_plan.node
    return {"out": out.detach(), "dx": x.grad, "drouter": layer.router.weight.grad, "dw1": layer.w1.grad,
            "plan_node": plan_node, "reads_plans": layer.state is not None and layer.state.reads_plans,
            "state": None if layer.state is None else state_digest(layer.state),
            "dw2": layer.w2.grad, "fp": s.plan_fingerprint, "before": s.token_straggler_before,
            "after": s.token_straggler_after, "moved": s.rows_moved, "balanced": s.balanced,
            "fell_back": s.fell_back, "copies": s.weight_copies,
            "db1": layer.b1.grad if cfg.expert_bias else None, "db2": layer.b2.grad if cfg.expert_bias else None}


def _run_stack(rank, world, G, seed=300):
    """Two balanced layers with residuals, h = x + moe1(x); out = h + moe2(h): backward collectives of both
    layers must interleave identically on every rank."""
    from feplb import FEPLBConfig, MoELayer

    layers = []
    for j in range(2):
        router_EH, w1, w2, xs, dys = make_inputs("skewed", seed + j, G)
        layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2,
                                     policy="feplb-split", weights="per-microbatch", min_chunk=2,
                                     plan_wait_ms=60_000, min_straggler_rows=0))
        load_global_weights(layer, router_EH, w1, w2)
        layers.append(layer)
    _, _, _, xs, dys = make_inputs("skewed", seed, G)
    x = xs[rank].clone().requires_grad_(True)
    h = x + layers[0](x)
    out = h + layers[1](h)
    (out * dys[rank]).sum().backward()
    return {"out": out.detach(), "dx": x.grad, "moved": [lay.last_stats.rows_moved for lay in layers],
            "dw1": [lay.w1.grad for lay in layers], "drouter": [lay.router.weight.grad for lay in layers]}


def _layer_worker(rank, world, cases):
    return [_run_layer(rank, world, *case) for case in cases] + [_run_stack(rank, world, cases[0][0]["gpus_per_node"])]


def _check_stack(per_rank, G, seed=300):
    L = E // W
    params = []
    for j in range(2):
        router_EH, w1, w2, _, _ = make_inputs("skewed", seed + j, G)
        params.append([t.double().requires_grad_(True) for t in (router_EH, w1, w2)])
    _, _, _, xs, dys = make_inputs("skewed", seed, G)
    for r, res in enumerate(per_rank):
        x = xs[r].double().requires_grad_(True)
        routers = [p[0].detach().clone().requires_grad_(True) for p in params]
        h = x + dense_moe_reference(x, routers[0], params[0][1], params[0][2], K)
        out = h + dense_moe_reference(h, routers[1], params[1][1], params[1][2], K)
        (out * dys[r].double()).sum().backward()
        _close(res["out"], out.detach(), f"stack rank {r} output", tol=2e-5)
        _close(res["dx"], x.grad, f"stack rank {r} input grad", tol=2e-5)
        for j in range(2):
            _close(res["drouter"][j], routers[j].grad, f"stack rank {r} layer {j} router grad", tol=2e-5)
    for r, res in enumerate(per_rank):
        for j in range(2):
            _close(res["dw1"][j], params[j][1].grad[r * L:(r + 1) * L], f"stack rank {r} layer {j} w1 grad", tol=2e-5)
    assert sum(per_rank[0]["moved"]) > 0


def _dense_in(dtype, routing, seed, G, microbatches, router, limit=None, gate_on_input=False, act="silu",
              interleaved=False, bias=False, gated=True, softcap=None):
    router_EH, w1, w2, xs, dys = make_inputs(routing, seed, G, router)
    b1, b2 = make_biases(seed) if bias else (None, None)
    if not gated:
        w1, b1 = w1[:, :, :FF], b1 if b1 is None else b1[:, :FF]
    router_EH, w1, w2 = (t.to(dtype).requires_grad_(True) for t in (router_EH, w1, w2))
    b1, b2 = (None, None) if not bias else (b1.to(dtype).requires_grad_(True), b2.to(dtype).requires_grad_(True))
    outs, dxs, drouters = [], [], []
    for x, dy in zip(xs, dys, strict=True):
        x = x.to(dtype).requires_grad_(True)
        r_leaf = router_EH.detach().clone().requires_grad_(True)
        for _ in range(microbatches):
            out = dense_moe_reference(x, r_leaf, w1, w2, K, router, swiglu_limit=limit, gate_on_input=gate_on_input,
                                      activation=act, glu_interleaved=interleaved, b1_E2F=b1, b2_EH=b2,
                                      gated=gated, glu_softcap=softcap)
            if out.requires_grad:   # a rank without tokens contributes nothing
                (out * dy.to(dtype)).sum().backward()
        outs.append(out.detach())
        dxs.append(x.grad if x.grad is not None else torch.zeros_like(x))
        drouters.append(r_leaf.grad if r_leaf.grad is not None else torch.zeros_like(r_leaf))
    zeros = torch.zeros(E, 1, dtype=dtype)   # no biases: nothing to compare
    return (outs, dxs, drouters, w1.grad, w2.grad, b1.grad if bias else zeros, b2.grad if bias else zeros)


@functools.lru_cache(maxsize=None)
def _dense(routing, seed, G, microbatches=1, router="softmax", limit=None, gate_on_input=False, act="silu",
           interleaved=False, bias=False, gated=True, softcap=None):
    """fp64 dense reference, plus the error torch's own fp32 makes on the same math (the floor of any tolerance:
    saturated softmax gradients cancel catastrophically in fp32 whatever the dispatch)."""
    ref64 = _dense_in(torch.float64, routing, seed, G, microbatches, router, limit, gate_on_input, act, interleaved,
                      bias, gated, softcap)
    ref32 = _dense_in(torch.float32, routing, seed, G, microbatches, router, limit, gate_on_input, act, interleaved,
                      bias, gated, softcap)
    return tuple(_Ref(a, b) if isinstance(a, torch.Tensor) else [_Ref(x, y) for x, y in zip(a, b, strict=True)]
                 for a, b in zip(ref64, ref32, strict=True))


class _Ref:
    """An fp64 reference and the max error of torch's fp32 on the same computation."""

    def __init__(self, t64, t32):
        self.t = t64
        self.floor = (t32.double() - t64).abs().max().item() if t64.numel() else 0.0

    def __getitem__(self, idx):
        sub = _Ref(self.t[idx], self.t[idx])
        sub.floor = self.floor
        return sub


def _close(got, want, what, tol=1e-5):
    """max |got - want| <= max(tol * max |want|, 2 * fp32 floor)."""
    floor = 0.0
    if isinstance(want, _Ref):
        want, floor = want.t, want.floor
    scale, bound = error_bound(want, floor, tol)
    err = max_abs_error(got, want)
    assert err <= bound, f"{what}: max abs error {err:.3g} > bound {bound:.3g} (scale {scale:.3g})"


def _check(results, cases, G):
    L = E // W
    by_key = {}
    for ci, (cfg_kwargs, routing, seed, *rest) in enumerate(cases):
        mb = rest[0] if rest else 1
        per_rank = [results[r][ci] for r in range(W)]
        router, limit = cfg_kwargs.get("router", "softmax"), cfg_kwargs.get("swiglu_limit")
        goi, act = cfg_kwargs.get("gate_on_input", False), cfg_kwargs.get("activation", "silu")
        inter, bias = cfg_kwargs.get("glu_interleaved", False), cfg_kwargs.get("expert_bias", False)
        gated, softcap = cfg_kwargs.get("gated", True), cfg_kwargs.get("glu_softcap")
        outs, dxs, drouters, dw1, dw2, db1, db2 = _dense(routing, seed, G, mb, router, limit, goi, act, inter, bias,
                                                        gated, softcap)
        tag = f"{routing}/{cfg_kwargs['policy']}/{cfg_kwargs.get('weights', 'per-step')}" + \
            ("/recopy" if cfg_kwargs.get("recopy_weights") else "")
        for r, res in enumerate(per_rank):
            _close(res["out"], outs[r], f"{tag} rank {r} output")
            if outs[r].t.numel():
                _close(res["dx"], dxs[r], f"{tag} rank {r} input grad")
                _close(res["drouter"], drouters[r], f"{tag} rank {r} router grad")
            _close(res["dw1"], dw1[r * L:(r + 1) * L], f"{tag} rank {r} w1 grad")
            _close(res["dw2"], dw2[r * L:(r + 1) * L], f"{tag} rank {r} w2 grad")
            if bias:
                _close(res["db1"], db1[r * L:(r + 1) * L], f"{tag} rank {r} b1 grad")
                _close(res["db2"], db2[r * L:(r + 1) * L], f"{tag} rank {r} b2 grad")
        # In-node policies on several nodes: each rank plans its own node (ranks of a node hold the same plan),
        # unless the policy's history folds in whole plans.
        node_plans = cfg_kwargs["policy"] in IN_NODE and G < W and not per_rank[0]["reads_plans"]
        for r, res in enumerate(per_rank):
            if res["fp"]:
                assert res["plan_node"] == (r // G if node_plans else None), (tag, r, res["plan_node"])
        scopes = [list(range(n, n + G)) for n in range(0, W, G)] if node_plans else [list(range(W))]
        for ranks in scopes:
            assert len({per_rank[r]["fp"] for r in ranks}) == 1, f"{tag}: plans differ across ranks {ranks}"
        assert not any(res["fell_back"] for res in per_rank), f"{tag}: fell back with a generous wait"
        # The policy's history is the same on every rank (node plans never reach a history that reads plans).
        assert len({res["state"] for res in per_rank}) == 1, f"{tag}: policy histories differ across ranks"
        if cfg_kwargs.get("replicas_mode") == "lazy":
            assert per_rank[0]["reads_plans"] and all(res["fp"] for res in per_rank), tag
        by_key[(routing, seed, mb, router, limit, goi, act, inter, bias, gated, cfg_kwargs["policy"],
                cfg_kwargs.get("weights"))] = per_rank
        if cfg_kwargs["policy"] in IN_NODE and routing in ("skewed", "no_tokens", "hot_per_node") and \
                cfg_kwargs["policy"] != "feplb":
            res = per_rank[0]
            assert res["after"] < res["before"], f"{tag}: straggler {res['before']} -> {res['after']}"
            assert res["moved"] > 0
    # Balancing on equals balancing off (same tolerance, independent of the dense reference).
    for (routing, seed, mb, router, limit, goi, act, inter, bias, gated, policy, weights), per_rank in by_key.items():
        off = by_key.get((routing, seed, mb, router, limit, goi, act, inter, bias, gated, "none", None))
        if off is None or policy == "none":
            continue
        for r in range(W):
            for k in ("out", "dx", "dw1", "dw2", "drouter", "db1", "db2"):
                if per_rank[r][k] is not None and off[r][k] is not None and off[r][k].numel():
                    _close(per_rank[r][k], off[r][k], f"{routing}/{policy}/{weights} vs none, rank {r} {k}")


def _cases_for(G):
    cases = []
    for i, routing in enumerate(ROUTINGS):
        seed = 100 + i
        cases.append(({"policy": "none", "gpus_per_node": G}, routing, seed))
        for policy, weights in (("feplb", "per-microbatch"), ("feplb-split", "per-step"),
                                ("feplb-split", "per-microbatch")):
            cases.append(({"policy": policy, "gpus_per_node": G, "weights": weights, "dyn": 2}, routing, seed))
    # Other planners and router variants on skewed routing; two micro-batches accumulate grads exactly once.
    cases.append(({"policy": "lp", "gpus_per_node": G, "dyn": 4}, "skewed", 200))
    cases.append(({"policy": "feplb@ema", "gpus_per_node": G, "dyn": 2}, "skewed", 200, 2))
    # A lazy @ema history (it folds whole plans in): whole plans, agreed over the group, on one node or two.
    cases.append(({"policy": "feplb-split@ema", "gpus_per_node": G, "dyn": 2, "replicas_mode": "lazy"},
                  "hot_per_node", 203, 2))
    cases.append(({"policy": "fastermoe", "gpus_per_node": G, "weights": "per-microbatch"}, "one_expert", 201))
    cases.append(({"policy": "eplb", "gpus_per_node": G}, "skewed", 200))
    # Received weights let go after the forward and copied again for the backward (phase 2; the direct path)
    cases.append(({"policy": "feplb-split", "gpus_per_node": G, "weights": "per-microbatch", "dyn": 2,
                   "recopy_weights": True}, "skewed", 200, 2))
    cases.append(({"policy": "fastermoe", "gpus_per_node": G, "weights": "per-microbatch", "recopy_weights": True},
                  "one_expert", 201))
    cases.append(({"policy": "none", "gpus_per_node": G}, "skewed", 200))
    cases.append(({"policy": "none", "gpus_per_node": G}, "one_expert", 201))
    cases.append(({"policy": "feplb-split", "gpus_per_node": G, "router": "sigmoid", "weights": "per-microbatch"},
                  "skewed", 202))
    cases.append(({"policy": "none", "gpus_per_node": G, "router": "sigmoid"}, "skewed", 202))
    # The clamped SwiGLU (DeepSeek-V4's experts): a limit that clamps a good share of the gates and ups.
    for policy, weights in (("feplb-split", "per-microbatch"), ("feplb-split", "per-step"), ("none", None)):
        kw = {"policy": policy, "gpus_per_node": G, "swiglu_limit": 0.5, "dyn": 2}
        cases.append(({**kw, "weights": weights} if weights else kw, "skewed", 204))
    # Gates on the experts' inputs (Llama 4), with the sigmoid router whose gates do not sum to one.
    for policy, weights in (("feplb-split", "per-microbatch"), ("none", None)):
        kw = {"policy": policy, "gpus_per_node": G, "gate_on_input": True, "router": "sigmoid", "dyn": 2}
        cases.append(({**kw, "weights": weights} if weights else kw, "skewed", 205))
    # GeGLU experts (Gemma 4's tanh form; the erf form clamped), gpt-oss's gate clamped (its alpha, the default).
    for act, limit in (("gelu_tanh", None), ("gelu", 0.5), ("swiglu_oai", 0.5)):
        for policy, weights in (("feplb-split", "per-microbatch"), ("none", None)):
            kw = {"policy": policy, "gpus_per_node": G, "activation": act, "swiglu_limit": limit, "dyn": 2}
            cases.append(({**kw, "weights": weights} if weights else kw, "skewed", 206))
    # Inkling 2's softcapped SwiGLU, caps small enough to bend the tiny layer's gates and ups
    for policy, weights in (("feplb-split", "per-microbatch"), ("none", None)):
        kw = {"policy": policy, "gpus_per_node": G, "activation": "silu_softcap", "glu_softcap": (0.3, 0.5), "dyn": 2}
        cases.append(({**kw, "weights": weights} if weights else kw, "skewed", 209))
    # gpt-oss's experts: biases, gate and up interleaved, its gate clamped; rows and weights moving per micro-batch
    # and per-step copies (their biases' gradients reduced to the owners)
    gpt_oss = {"gpus_per_node": G, "activation": "swiglu_oai", "swiglu_limit": 0.5, "glu_interleaved": True,
               "expert_bias": True, "dyn": 2}
    for policy, weights in (("feplb-split", "per-microbatch"), ("feplb-split@ema", "per-step"),
                            ("lp", "per-microbatch"), ("fastermoe", "per-microbatch"), ("eplb", "per-step"),
                            ("none", None)):
        kw = {**gpt_oss, "policy": policy}
        cases.append(({**kw, "weights": weights} if weights else kw, "skewed", 207, 2))
    cases.append(({**gpt_oss, "policy": "feplb-split", "weights": "per-microbatch", "recopy_weights": True},
                  "skewed", 207, 2))
    # Non-gated experts (Nemotron-H's relu^2), with biases, rows and weights moving and per-step copies
    for policy, weights in (("feplb-split", "per-microbatch"), ("feplb-split@ema", "per-step"), ("none", None)):
        kw = {"policy": policy, "gpus_per_node": G, "gated": False, "activation": "relu2", "expert_bias": True,
              "dyn": 2}
        cases.append(({**kw, "weights": weights} if weights else kw, "skewed", 208, 2))
    return cases


@pytest.mark.parametrize("gpus_per_node", [2, 4], ids=["2nodes_x_2gpus", "1node_x_4gpus"])
def test_layer_exact_vs_dense_and_plain_ep(gpus_per_node):
    cases = _cases_for(gpus_per_node)
    results = run_dist(_layer_worker, W, cases, timeout_s=300)
    _check(results, cases, gpus_per_node)
    _check_stack([res[-1] for res in results], gpus_per_node)


def test_plan_scope_follows_the_policy_history():
    """A rank plans its node (``_node``) and agrees readiness with it, unless a policy history (the adopted one or
    the layer's own, which a user may have replaced) folds in whole plans (lazy @ema replicas): then whole plans,
    agreed over the group, so that every rank executes the same plan or none and the histories stay equal."""
    from types import SimpleNamespace

    from feplb import MoELayer
    from feplb.sched import PolicyState, Topology

    topo = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    eager, lazy = (PolicyState(topo=topo, policy="feplb@ema", replicas_mode=m) for m in ("eager", "lazy"))

    def layer(node, state, in_node=True):
        me = SimpleNamespace(_node=node, state=state, in_node_policy=in_node)
        me._plan_node = lambda st: MoELayer._plan_node(me, st)
        return me

    for state in (None, eager):
        assert MoELayer._plan_node(layer(1, state), state) == 1
        assert MoELayer._scope_group(layer(1, state), state) == "node"
    assert MoELayer._plan_node(layer(1, lazy), lazy) is None
    assert MoELayer._plan_node(layer(1, lazy), eager) is None        # a lazy history assigned, not adopted yet
    assert MoELayer._plan_node(layer(1, eager), lazy) is None
    assert MoELayer._scope_group(layer(1, lazy), lazy) == "group"
    assert MoELayer._plan_node(layer(None, eager), eager) is None    # one node: the whole plan is the node's
    assert MoELayer._scope_group(layer(None, lazy), lazy) == "node"
    assert MoELayer._scope_group(layer(None, None, in_node=False), None) == "group"


def _bf16_selection_worker(rank, world):
    """A bf16 layer (plain EP, one rank) and the dense reference on the same bf16 values: each token's output."""
    from feplb import FEPLBConfig, MoELayer
    from feplb.testing import dense_moe_reference, load_global_weights

    H, F, E, K, T = 64, 16, 16, 2, 4096
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    router = torch.randn(E, H, generator=g).bfloat16()
    w1 = (torch.randn(E, H, 2 * F, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, F, H, generator=g) / F ** 0.5).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=F, num_experts=E, top_k=K, dtype=torch.bfloat16, policy="none",
                                 device="cpu"))
    try:
        load_global_weights(layer, router, w1, w2)
        with torch.no_grad():
            got = layer(x).float()
    finally:
        layer.close()
    with torch.no_grad():
        want = dense_moe_reference(x, router, w1, w2, K).float()
    return got, want


def test_reference_selects_the_experts_a_bf16_layer_selects():
    """dense_moe_reference scores a bf16 model's logits as the layer does (a bf16 GEMM, then fp32): with fp32 GEMM
    logits about 0.5% of tokens chose other experts, whose outputs then differed by their whole size."""
    got, want = run_dist(_bf16_selection_worker, 1, timeout_s=120)[0]
    per_token = (got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-3)
    assert per_token.max() < 0.1, (int((per_token >= 0.1).sum()), float(per_token.max()))
