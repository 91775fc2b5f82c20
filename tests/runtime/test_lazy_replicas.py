"""Lazy ``@ema`` replicas (``FEPLBConfig(replicas="lazy")``) on 4 gloo ranks, as 2 nodes x 2 GPUs and 1 node x 4:

* a weight a plan copies to a helper is held there until the next ``refresh_replicas()`` (also with experts placed
  away from their owners, ``+place``): no (expert, GPU) pair
  is copied twice in a step, the micro-batches after the first copy less than it, every rank notes the same held
  pairs (those the plans copied, the owners left out), each rank holds exactly its own, and the plans' history
  (the layer's adopted state) finds them resident;
* outputs and every gradient over three accumulated micro-batches equal plain EP's once the held copies'
  gradients are reduced, and nothing is left on the copies; two optimizer steps with a refresh between end where
  plain EP does, and the refresh lets go of the held copies (the next step copies again);
* under activation checkpointing the recompute copies nothing (the forward's copies are held) and the gradients
  are bit for bit the uncheckpointed layer's;
* copies held by a forward inside ``torch.inference_mode`` train in the micro-batches after it; in bf16 the held
  copies' gradients match plain EP's, sent to their owners as fp32 sums (``reduce_in_fp32``, the default) or, lazy
  and eager replicas alike, rounded to bf16 (``reduce_in_fp32=False``);
* an optimizer step without ``refresh_replicas()`` makes the next forward raise on every rank (held copies are
  stale), also where they are the only copies; a layer that never refreshed holds copies without a false alarm;
* eager replicas: the reduction sends the gradients of the replicas some forward used, and no others (their
  gradients are zero), agreed on every rank, and the owners' gradients equal plain EP's;
* a backward restricted to chosen tensors (``backward(inputs=...)``, ``torch.autograd.grad``) that reaches the
  experts' weights is refused on every rank while per-step copies hold part of their gradient (it would leave
  their share out); one for the input alone is exact, and the layer trains on after a refusal;
* fp16 weights of fp32 parameters: a step's sum of replica gradients beyond fp16's range (each micro-batch's within
  it) reaches the owners finite and equal to plain EP's, sent in fp32 with ``reduce_in_fp32`` either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import feplb.replicas
from feplb.testing import load_global_weights, load_module, run_dist

pytestmark = pytest.mark.dist

# the routing of test_layer.py ("skewed": GPU 0's experts are hot)
_layer_tests = load_module(Path(__file__).with_name("test_layer.py"))
H, FF, E, K, W = _layer_tests.H, _layer_tests.FF, _layer_tests.E, _layer_tests.K, _layer_tests.W
MICROBATCHES = 3
LAZY = ("feplb@ema", "feplb-split@ema", "feplb-split+place@ema")   # (+place: placement adopted at the refresh)


def _build(G: int, policy: str, replicas: str, seed: int = 210, **kw):
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2, xs, dys = _layer_tests.make_inputs("skewed", seed, G)
    cfg = FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2, policy=policy,
                      replicas=replicas, plan_wait_ms=60_000, min_straggler_rows=0, min_chunk=2, **kw)
    layer = MoELayer(cfg)
    load_global_weights(layer, router, w1, w2)
    return layer, xs, dys


def _grads(layer, x) -> dict:
    return {"dx": x.grad.clone(), "drouter": layer.router.weight.grad.clone(), "dw1": layer.w1.grad.clone(),
            "dw2": layer.w2.grad.clone()}


def _accumulate(rank: int, G: int, policy: str, replicas: str = "eager", ckpt: bool = False,
                dtype: torch.dtype = torch.float32, inference_first: bool = False, **kw) -> dict:
    from torch.utils.checkpoint import checkpoint

    layer, xs, dys = _build(G, policy, replicas, dtype=dtype, **kw)
    xs, dys = [x.to(dtype) for x in xs], [d.to(dtype) for d in dys]
    with torch.no_grad():
        layer(xs[rank])            # the history picks the @ema dynamic sets
    layer.refresh_replicas()
    if inference_first:
        with torch.inference_mode():
            layer(xs[rank])        # copies held from inside inference_mode must still train
    holds = []
    hold = layer.replicas.hold

    def counting_hold(experts, parts):
        holds.append(tuple(experts))
        return hold(experts, parts)

    layer.replicas.hold = counting_hold
    reduction, reduce = {}, layer.replicas.reduce_grads

    def capturing(placement, idle=None):   # the eager replicas' gradients as the reduction finds them
        rep = layer.replicas
        grads = [feplb.replicas._grad(b) for b in rep.replica_bank or ()]
        reduction.update(pairs=rep.all_pairs(), idle=None if idle is None else idle.tolist(), used=sorted(rep.used),
                         replicas=sorted(rep.replica_of),
                         nonzero=sorted(e for e, j in rep.replica_of.items()
                                        if any(g is not None and bool(g[j].ne(0).any()) for g in grads)))
        return reduce(placement, idle)

    layer.replicas.reduce_grads = capturing
    x = xs[rank].clone().requires_grad_(True)
    copied, outs = [], []
    for _ in range(MICROBATCHES):
        out = checkpoint(layer, x, use_reentrant=False) if ckpt else layer(x)
        (out * dys[rank]).sum().backward()
        outs.append(out.detach())
        copied.append(tuple(layer.last_plan.weight_copies) if layer.last_plan is not None else ())
    held_before = sorted(layer.replicas.held)
    lazy_pairs = sorted(layer.replicas.lazy_pairs)
    resident = sorted(layer._plan_state.resident) if layer._plan_state is not None else []
    wire, exchange = [], feplb.replicas.Exchange

    def recording(*args, **kwargs):   # the dtype the replica gradients travel in
        if kwargs.get("op") == "reduction of replica gradients":
            wire.append(kwargs["dtype"])
        return exchange(*args, **kwargs)

    feplb.replicas.Exchange = recording
    try:
        layer.reduce_replica_grads()
    finally:
        feplb.replicas.Exchange = exchange
    res = {"outs": outs, **_grads(layer, x), "copied": copied, "held": held_before, "lazy_pairs": lazy_pairs,
           "resident": resident, "clean": layer.replicas.grads_clean(), "holds": len(holds),
           "placed": len(layer.placement.placed_pairs), "wire": wire, "reduction": reduction}
    layer.close()
    return res


def _train(rank: int, G: int, policy: str, replicas: str = "eager", steps: int = 2) -> dict:
    layer, xs, dys = _build(G, policy, replicas, refresh_every=MICROBATCHES)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    first_copies, held_after_refresh = [], []
    for step in range(steps):
        for mb in range(MICROBATCHES):
            x = xs[rank] * (1 + 0.1 * mb + 0.05 * step)
            (layer(x) * dys[rank]).sum().backward()
            if mb == 0:
                first_copies.append(layer.last_stats.weight_copies)
        layer.reduce_replica_grads()
        opt.step()
        opt.zero_grad()
        layer.refresh_replicas()
        held_after_refresh.append(len(layer.replicas.held) + len(layer.replicas.lazy_pairs))
    res = {"w1": layer.w1.detach().clone(), "w2": layer.w2.detach().clone(),
           "router": layer.router.weight.detach().clone(), "first_copies": first_copies,
           "held_after_refresh": held_after_refresh}
    layer.close()
    return res


def _fp16_sums(rank: int, G: int, policy: str, scale: float, **kw) -> dict:
    """fp32 parameters behind fp16 expert weights (as ``feplb.titan`` with ``dtype=float16`` makes them), upstream
    gradients scaled so that each micro-batch's weight gradient fits fp16 and the step's sum of four does not."""
    from feplb import FEPLBConfig, MoELayer

    class Fp16Weights(MoELayer):
        def _init_experts(self, L, H_, F_, device, dtype):
            super()._init_experts(L, H_, F_, device, torch.float32)

        def expert_weights(self):
            return self.w1.to(torch.float16), self.w2.to(torch.float16)

    router, w1, w2, xs, dys = _layer_tests.make_inputs("skewed", 210, G)
    cfg = FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2, policy=policy,
                      plan_wait_ms=60_000, min_straggler_rows=0, min_chunk=2, dtype=torch.float16, **kw)
    layer = Fp16Weights(cfg)
    load_global_weights(layer, router, w1, w2)
    x = xs[rank].half()
    with torch.no_grad():
        layer(x)
    layer.refresh_replicas()
    wire, exchange = [], feplb.replicas.Exchange

    def recording(*args, **kwargs):
        if kwargs.get("op") == "reduction of replica gradients":
            wire.append(kwargs["dtype"])
        return exchange(*args, **kwargs)

    mb = []
    for _ in range(4):
        (layer(x).float() * dys[rank] * scale).sum().backward()
        mb.append(max(float(g.abs().max()) for g in (layer.w1.grad, layer.w2.grad)))
    feplb.replicas.Exchange = recording
    try:
        layer.reduce_replica_grads()
    finally:
        feplb.replicas.Exchange = exchange
    res = {"dw1": layer.w1.grad.clone(), "dw2": layer.w2.grad.clone(), "wire": wire, "sums": mb}
    layer.close()
    return res


def _restricted(rank: int, G: int, policy: str, replicas: str) -> dict:
    """Backwards restricted to chosen tensors while per-step copies hold part of the experts' gradients: refused on
    every rank where they reach the experts' weights, fine where they do not (the input's gradient), and the layer
    trains on after a refusal."""
    layer, xs, dys = _build(G, policy, replicas)
    with torch.no_grad():
        layer(xs[rank])
    layer.refresh_replicas()
    out = {}

    def attempt(name, run):
        x = xs[rank].clone().requires_grad_(True)
        loss = (layer(x) * dys[rank]).sum()
        try:
            got = run(loss, x)
            out[name] = None if got is None else got.clone()
        except RuntimeError as exc:
            out[name] = str(exc)

    attempt("backward_inputs_w1", lambda loss, x: loss.backward(inputs=[layer.w1]))
    attempt("grad_w2", lambda loss, x: torch.autograd.grad(loss, [layer.w2])[0])
    attempt("grad_x", lambda loss, x: torch.autograd.grad(loss, [x])[0])
    attempt("backward_inputs_x", lambda loss, x: loss.backward(inputs=[x]) or x.grad)
    layer.zero_grad()
    attempt("full", lambda loss, x: loss.backward() or x.grad)
    # the experts' outputs stay modifiable in place (a post-expert hook that scales them, say)
    layer.post_expert = lambda y, *_: y.mul_(2.0)
    attempt("inplace", lambda loss, x: loss.backward() or x.grad)
    out["held"] = bool(layer.replicas.all_pairs())
    layer.close()
    return out


def _stale(rank: int, G: int) -> dict:
    """An unattached optimizer steps after a micro-batch whose plan copied weights (held, and the only per-step
    copies: lazy @ema keeps no eager replica): the next forward must raise; a layer built and run without any
    refresh_replicas() must not."""
    layer, xs, dys = _build(G, "feplb-split@ema", "lazy")
    x = xs[rank]
    for _ in range(2):               # never refreshed: the held copies are of the weights as they are
        (layer(x) * dys[rank]).sum().backward()
    unrefreshed_ok = bool(layer.replicas.lazy_pairs)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer.reduce_replica_grads()
    opt.step()
    try:
        layer(x)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    layer.refresh_replicas()
    out = layer(x)                   # refreshed: runs again
    layer.close()
    return {"unrefreshed_ok": unrefreshed_ok, "error": error, "after": bool(torch.isfinite(out).all())}


def _worker(rank: int, world: int, G: int) -> dict:
    torch.manual_seed(0)
    res = {p: _accumulate(rank, G, p, "lazy") for p in LAZY}
    res["none"] = _accumulate(rank, G, "none")
    res["eager"] = {p: _accumulate(rank, G, p, "eager") for p in ("feplb@ema", "feplb-split@ema")}
    res["ckpt"] = _accumulate(rank, G, "feplb-split@ema", "lazy", ckpt=True)
    res["inference_first"] = _accumulate(rank, G, "feplb-split@ema", "lazy", inference_first=True)
    res["bf16"] = {p: _accumulate(rank, G, p, "lazy" if p != "none" else "eager", dtype=torch.bfloat16)
                   for p in ("feplb-split@ema", "none")}
    # the held copies' fp32 sums sent rounded to bf16 (half the bytes), lazy and eager replicas
    res["bf16_wire"] = {m: _accumulate(rank, G, "feplb-split@ema", m, dtype=torch.bfloat16, reduce_in_fp32=False)
                        for m in ("lazy", "eager")}
    res["train"] = {"lazy": _train(rank, G, "feplb-split@ema", "lazy"), "none": _train(rank, G, "none")}
    res["stale"] = _stale(rank, G)
    res["restricted"] = {(p, m): _restricted(rank, G, p, m) for p, m in (("feplb-split@ema", "eager"),
                                                                        ("feplb-split@ema", "lazy"), ("none", "eager"))}
    res["fp16"] = {"none": _fp16_sums(rank, G, "none", 1000.0),
                   "fp32": _fp16_sums(rank, G, "feplb-split@ema", 1000.0),
                   "rounded": _fp16_sums(rank, G, "feplb-split@ema", 1000.0, reduce_in_fp32=False)}
    return res


def _close(got, want, what, tol=1e-5):
    err = (got.double() - want.double()).abs().max().item()
    scale = max(want.abs().max().item(), 1e-6)
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"


@pytest.mark.parametrize("gpus_per_node", [2, 4], ids=["2nodes_x_2gpus", "1node_x_4gpus"])
def test_lazy_replicas_held_for_the_step_and_exact(gpus_per_node):
    results = run_dist(_worker, W, gpus_per_node, timeout_s=400)
    L = E // W
    for policy in LAZY:
        per_rank = [res[policy] for res in results]
        copied = per_rank[0]["copied"]
        flat = [(e, d) for c in copied for e, _, d in c]
        assert copied[0], f"{policy}: the first micro-batch copied no weights (nothing to hold)"
        assert len(flat) == len(set(flat)), f"{policy}: a pair was copied twice in one step: {copied}"
        assert sum(len(c) for c in copied[1:]) < len(copied[0]), f"{policy}: later micro-batches copied as much"
        want = sorted((e, d) for e, d in flat if d != e // L)
        assert ("+place" in policy) == (per_rank[0]["placed"] > 0), f"{policy}: {per_rank[0]['placed']} placed"
        for r, res in enumerate(per_rank):
            assert res["copied"] == copied, f"{policy}: rank {r} executed other plans"
            assert res["lazy_pairs"] == want, f"{policy} rank {r}: held pairs {res['lazy_pairs']} != {want}"
            assert res["held"] == sorted(e for e, d in want if d == r), f"{policy} rank {r}: holds {res['held']}"
            assert set(flat) <= set(res["resident"]), f"{policy} rank {r}: the plans' state lacks the held pairs"
            assert res["clean"], f"{policy} rank {r}: gradients left on held copies after the reduction"
            ref = results[r]["none"]
            for i, (a, b) in enumerate(zip(res["outs"], ref["outs"], strict=True)):
                _close(a, b, f"{policy} rank {r} micro-batch {i} output")
            for k in ("dx", "drouter", "dw1", "dw2"):
                _close(res[k], ref[k], f"{policy} rank {r} {k}")
    # eager replicas: the reduction sends the gradients of the replicas a forward used, and only those; every
    # replica with a nonzero gradient is among them, and the owners end where plain EP's do
    skipped = 0
    for policy in ("feplb@ema", "feplb-split@ema"):
        red0 = results[0]["eager"][policy]["reduction"]
        pairs, idle = red0["pairs"], red0["idle"]
        assert idle is not None and len(idle) == len(pairs), (policy, red0)
        sent = {pair for pair, f in zip(pairs, idle, strict=True) if f == 0}
        for r, res in enumerate(results):
            got = res["eager"][policy]
            red = got["reduction"]
            assert (red["pairs"], red["idle"]) == (pairs, idle), f"{policy} rank {r}: another reduction"
            assert set(red["nonzero"]) <= set(red["used"]) <= set(red["replicas"]), (policy, r, red)
            assert {e for e, g in sent if g == r and e in red["replicas"]} == set(red["used"]), (policy, r, red)
            skipped += len(red["replicas"]) - len(red["used"])
            assert got["clean"], f"{policy} rank {r}: gradients left on replicas after the reduction"
            ref = results[r]["none"]
            for k in ("dx", "drouter", "dw1", "dw2"):
                _close(got[k], ref[k], f"eager {policy} rank {r} {k}")
    assert skipped > 0, "every eager replica was used: the test shows no gradient left unsent"
    # a backward restricted to chosen tensors that reaches the experts' weights is refused on every rank where
    # per-step copies hold part of their gradient; the input's gradient alone, and a full backward after, are fine
    for (policy, mode) in (("feplb-split@ema", "eager"), ("feplb-split@ema", "lazy")):
        for r, res in enumerate(results):
            got, ref = res["restricted"][(policy, mode)], res["restricted"][("none", "eager")]
            assert got["held"], (policy, mode, r)
            for name in ("backward_inputs_w1", "grad_w2"):
                assert isinstance(got[name], str) and "restricted to chosen tensors" in got[name], \
                    (policy, mode, r, name, got[name])
                assert not isinstance(ref[name], str), (r, name, ref[name])
            for name in ("grad_x", "backward_inputs_x", "full", "inplace"):
                assert not isinstance(got[name], str), (policy, mode, r, name, got[name])
                _close(got[name], ref[name], f"{policy} {mode} rank {r} {name}")
            _close(got["inplace"], 2 * got["full"], f"{policy} {mode} rank {r}: outputs doubled in place")
    # fp16 weights of fp32 parameters: a step's sum beyond fp16's range reaches the owners whole, in fp32 on the
    # wire either way (reduce_in_fp32=False rounds bf16 sums only)
    top = torch.finfo(torch.float16).max
    assert max(res["fp16"]["none"]["sums"][-1] for res in results) > top, "no step sum beyond fp16's range"
    for r, res in enumerate(results):
        ref = res["fp16"]["none"]
        assert ref["sums"][0] < top and torch.isfinite(ref["dw1"]).all(), (r, ref["sums"])   # one fits fp16
        for mode in ("fp32", "rounded"):
            got = res["fp16"][mode]
            assert got["wire"] == [torch.float32], (r, mode, got["wire"])
            for k in ("dw1", "dw2"):
                assert torch.isfinite(got[k]).all(), f"rank {r} {mode}: {k} not finite"
                _close(got[k], ref[k], f"fp16 weights, rank {r} {mode} {k}", tol=2e-3)
    assert sum(res["ckpt"]["holds"] for res in results) > 0
    for r, res in enumerate(results):
        ck, plain = res["ckpt"], res["feplb-split@ema"]
        assert ck["holds"] == plain["holds"], f"rank {r}: the recompute held copies again ({ck['holds']})"
        for k in ("dx", "drouter", "dw1", "dw2"):
            assert torch.equal(ck[k], plain[k]), f"rank {r}: {k} under checkpointing differs"
        inf = res["inference_first"]
        # the inference_mode forward made the copies (same input, same plan): the training micro-batches copy none
        assert inf["lazy_pairs"] == plain["lazy_pairs"] and not any(inf["copied"]), (r, inf["copied"])
        for k in ("dx", "drouter", "dw1", "dw2"):
            _close(inf[k], res["none"][k], f"rank {r} {k} after an inference_mode forward")
        # bf16: the held copies sum their micro-batches' gradients in fp32, as the owners' do, and send the sums in
        # fp32 (reduce_in_fp32, the default) or rounded once to bf16
        fp32_wire = res["bf16"]["feplb-split@ema"]
        assert fp32_wire["wire"] == [torch.float32], (r, fp32_wire["wire"])
        for k in ("dx", "drouter", "dw1", "dw2"):
            _close(fp32_wire[k], res["bf16"]["none"][k], f"bf16 rank {r} {k}", tol=2e-2)
        for mode, got in res["bf16_wire"].items():
            assert got["wire"] == [torch.bfloat16], (r, mode, got["wire"])
            assert got["clean"], (r, mode)
            for k in ("dx", "drouter", "dw1", "dw2"):
                _close(got[k], res["bf16"]["none"][k], f"bf16 {mode} replicas, bf16 sums, rank {r} {k}", tol=2e-2)
        # one rounding of each held copy's sum apart from the fp32 sums: a bf16 ulp or two of the owners' gradients
        for k in ("dw1", "dw2"):
            _close(res["bf16_wire"]["lazy"][k], fp32_wire[k], f"bf16 sums vs fp32 sums, rank {r} {k}", tol=2 ** -7)
        lazy, none = res["train"]["lazy"], res["train"]["none"]
        for k in ("w1", "w2", "router"):
            _close(lazy[k], none[k], f"train rank {r} {k}", tol=2e-5)
        assert lazy["held_after_refresh"] == [0, 0], f"rank {r}: the refresh kept held copies"
        assert all(n > 0 for n in lazy["first_copies"]), f"rank {r}: a step after a refresh copied nothing"
        st = res["stale"]
        assert st["unrefreshed_ok"] and st["after"]
        assert st["error"] is not None and "refresh_replicas" in st["error"], f"rank {r}: {st['error']}"


def _failed_refresh_worker(rank: int, world: int) -> dict:
    """A refresh of the per-step copies that raises part way (its exchange, on every rank: an OOM receiving them),
    and an attached optimizer's step whose refresh never runs (a step post-hook registered before attaching raises):
    the next forward refuses on every rank, naming the unfinished refresh, instead of computing (a ``+place`` bank
    dropped and never received had the rank compute placed experts' rows with its own experts' weights); after
    ``refresh_replicas()`` the outputs are plain EP's on the same weights again."""
    from feplb.testing import error_of

    out = {}
    for case in ("exchange", "post_hook"):
        layer, xs, dys = _build(2, "feplb-split+place@ema", "eager")
        ref, _, _ = _build(2, "none", "eager")
        x, dy = xs[rank], dys[rank]
        opt = torch.optim.SGD(layer.parameters(), lr=1e-2)
        if case == "post_hook":
            fail = [False]

            def hook(*_, fail=fail):
                if fail[0]:
                    raise ValueError("a step hook of the user's")

            opt.register_step_post_hook(hook)      # (before attaching: it runs before the layer's refresh)
        layer.attach_optimizer(opt)
        errors = []
        for step in range(2):
            for _ in range(2):
                (layer(x.clone().requires_grad_()) * dy).sum().backward()
            orig = feplb.replicas.Exchange
            if step == 1 and case == "exchange":
                class Failing(orig):
                    def __call__(self, *a, **k):
                        if self.op == "refresh of per-step expert copies":
                            raise torch.OutOfMemoryError("out of memory receiving the refreshed copies")
                        return super().__call__(*a, **k)

                feplb.replicas.Exchange = Failing
            elif step == 1:
                fail[0] = True
            try:
                errors.append(error_of(opt.step))
            finally:
                feplb.replicas.Exchange = orig
                if case == "post_hook":
                    fail[0] = False
            opt.zero_grad()
        ref.load_state_dict(layer.state_dict())
        with torch.no_grad():
            refused = error_of(lambda layer=layer, x=x: layer(x))
            layer.refresh_replicas()
            got, want = layer(x), ref(x)
        out[case] = {"errors": errors, "placed": len(layer.placement.placed_pairs), "refused": refused,
                     "got": got, "want": want}
        layer.close()
        ref.close()
    # a layer that holds no per-step copies (feplb@current with per-step weights): a step hook raising leaves nothing
    # stale, and the next forward runs
    layer, xs, dys = _build(2, "feplb", "eager", weights="per-step")
    opt = torch.optim.SGD(layer.parameters(), lr=1e-2)

    def hook(*_):
        raise ValueError("a step hook of the user's")

    handle = opt.register_step_post_hook(hook)
    layer.attach_optimizer(opt)
    (layer(xs[rank].clone().requires_grad_()) * dys[rank]).sum().backward()
    out["no_copies"] = {"step": error_of(opt.step), "held": layer.replicas.ever_held}
    handle.remove()
    opt.zero_grad()
    with torch.no_grad():
        out["no_copies"]["next"] = error_of(lambda: layer(xs[rank]))
    layer.close()
    return out


def test_a_refresh_that_raised_is_refused_until_done_again():
    results = run_dist(_failed_refresh_worker, W, timeout_s=300, collective_timeout_s=20)
    for r, res in enumerate(results):
        none = res.pop("no_copies")
        assert none["step"].startswith("ValueError: a step hook") and not none["held"], (r, none)
        assert none["next"] is None, (r, none["next"])
        for case, got in res.items():
            assert got["errors"][0] is None, (r, case, got["errors"])
            want_error = "OutOfMemoryError: out of memory" if case == "exchange" else "ValueError: a step hook"
            assert got["errors"][1].startswith(want_error), (r, case, got["errors"])
            assert got["placed"] > 0, f"rank {r} {case}: no expert placed away from its owner (nothing to lose)"
            assert got["refused"] is not None and "were not refreshed" in got["refused"] and \
                "refresh_replicas()" in got["refused"], (r, case, got["refused"])
            assert torch.equal(got["got"], got["want"]), (r, case, (got["got"] - got["want"]).abs().max())
