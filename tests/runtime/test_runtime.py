"""The runtime's schedule and its promises, on 4 gloo ranks as 2 nodes x 2 GPUs:

* the timeline: rows gathered before the static GEMM starts, planning and the phase-2 copies beside the static GEMM
  (the copy thread is the CPU stand-in for the copy stream), the dynamic GEMM after its copies; Chrome-trace and
  PNG export;
* no optimizer leaves stale per-step replicas silently (fused and foreach AdamW and SGD): without
  ``attach_optimizer`` the next forward raises on every rank; with it, training stays equal to plain EP;
* non-contiguous inputs and routing on one rank are accepted (and bad ones raise on every rank together);
* defaults: a layer built with defaults balances skewed routing on a CPU and does not plan on balanced routing;
* one source of truth for weights: the bytes the layer moves equal the simulator's ``plan_copy_bytes`` of the plan;
* per-expert counts of the last forward; ``close()`` and context-manager use.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from feplb.sched import token_straggler
from feplb.testing import error_of, load_global_weights, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K, W, G = 32, 48, 16, 2, 4, 2


def _weights(seed):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    router[:, 0] = 0.0
    router[[0, 1, 9], 0] = torch.tensor([4.0, 3.0, 3.5])    # GPU 0's and GPU 2's experts are hot
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    xs = [torch.randn(t, H, generator=gen) for t in (96, 80, 64, 72)]
    for x in xs:
        x[:, 0] = x[:, 0].abs() + 1.0
    return router, w1, w2, xs


def _layer(seed, **kw):
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2, xs = _weights(seed)
    kw.setdefault("min_straggler_rows", 0)
    kw.setdefault("min_chunk", 2)
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G, dyn=2, **kw))
    load_global_weights(layer, router, w1, w2)
    return layer, xs


def _slow_static_gemm(layer, seconds):
    """Injected from the test: the static GEMM takes ``seconds`` longer, so the schedule's order is observable."""
    import time

    gemm = layer._static_gemm

    def slow(*args):
        out = gemm(*args)
        time.sleep(seconds)
        return out

    layer._static_gemm = slow


def _timeline(rank, res, tmp):
    from feplb.timeline import plot, to_chrome_trace

    layer, xs = _layer(1, policy="feplb-split", weights="per-microbatch", timeline=True)
    _slow_static_gemm(layer, 1.5)   # room for 4 ranks on 2 cores to plan, agree and copy
    x = xs[rank].clone().requires_grad_(True)
    layer(x).sum().backward()
    tl = layer.last_timeline
    spans = {s.name: s for s in tl.spans()}
    res["timeline"] = {n: (s.lane, s.start_us, s.end_us) for n, s in spans.items()}
    res["moved"] = layer.last_stats.rows_moved
    res["fell_back"] = layer.last_stats.fell_back
    if rank == 0:
        trace = to_chrome_trace([tl, tl], f"{tmp}/trace.json")
        res["trace_events"] = len(trace["traceEvents"])
        res["trace_file"] = json.loads(Path(tmp, "trace.json").read_text())["traceEvents"][0]["ph"]
        plot(tl.spans(), f"{tmp}/timeline.png")
        res["png"] = Path(tmp, "timeline.png").read_bytes()[:8]
    layer.close()


def _gpu_order(rank, res):
    """The GPU's order on CPU tensors (planning starts once the static GEMM is queued; here, once it has computed):
    the same plan, outputs and gradients as the CPU's order (planning first, beside the static GEMM)."""
    got = {}
    for plan_first in (True, False):
        layer, xs = _layer(1, policy="feplb-split", weights="per-microbatch", timeline=True)
        layer._plan_first = lambda h_RD, first=plan_first: first
        _slow_static_gemm(layer, 0.05)   # longer than a thread's wake-up on a loaded 2-core machine
        x = xs[rank].clone().requires_grad_(True)
        y = layer(x)
        y.square().sum().backward()
        spans = {s.name: s for s in layer.last_timeline.spans()}
        got[plan_first] = {"out": y.detach(), "dx": x.grad, "dw1": layer.w1.grad, "dw2": layer.w2.grad,
                           "plan_start": spans["plan"].start_us, "static_end": spans["static_gemm"].end_us,
                           "static_start": spans["static_gemm"].start_us, "moved": layer.last_stats.rows_moved,
                           "fell_back": layer.last_stats.fell_back, "plan": layer.last_plan}
        layer.close()
    res["gpu_order"] = got


def _optimizers(rank, res):
    """Fused / foreach optimizers: stale replicas are caught; attach_optimizer keeps training equal to plain EP."""
    kinds = [("AdamW", {"fused": True}), ("AdamW", {"foreach": True}), ("SGD", {"fused": True}),
             ("SGD", {"foreach": True})]
    for name, kw in kinds:
        tag = f"{name}-{next(iter(kw))}"
        layer, xs = _layer(2, policy="feplb-split@ema", weights="per-step")
        x = xs[rank]
        with torch.no_grad():
            layer(x)
        layer.refresh_replicas()
        opt = getattr(torch.optim, name)(layer.parameters(), lr=0.05, **kw)
        layer(x).pow(2).mean().backward()
        layer.reduce_replica_grads()
        opt.step()
        res[f"stale/{tag}"] = error_of(lambda layer=layer, x=x: layer(x))
        layer.close()

        bal, _ = _layer(2, policy="feplb-split@ema", weights="per-step")
        ref, _ = _layer(2, policy="none")
        opts = []
        for lay in (bal, ref):
            opts.append(getattr(torch.optim, name)(lay.parameters(), lr=0.05, **kw))
            lay.attach_optimizer(opts[-1])
        with torch.no_grad():
            bal(x)
        bal.refresh_replicas()
        diffs, copies = [], 0
        for _ in range(3):
            outs = []
            for lay, opt in zip((bal, ref), opts, strict=True):
                opt.zero_grad()
                out = lay(x)
                out.pow(2).mean().backward()
                opt.step()
                outs.append(out.detach())
            diffs.append(float((outs[0] - outs[1]).abs().max()))
            copies += bal.last_stats.rows_moved
        res[f"attached/{tag}"] = (max(diffs), float((bal.w1 - ref.w1).abs().max()), copies)
        bal.close()
        ref.close()


def _scaled_training(rank, res):
    """torch.amp.GradScaler with per-step replicas: passed to attach_optimizer, training equals plain EP (the
    replicas' gradients are reduced before the scaler unscales them), an overflow in one rank's replica skips the
    step on every rank; not passed, a fused optimizer's scaled step raises on every rank. An optimizer that reuses
    an attached one's address is not taken for it."""
    import gc

    x = _weights(2)[3][rank]
    for fused in (False, True):
        layers = {p: _layer(2, policy=p, weights="per-step")[0] for p in ("feplb-split@ema", "none")}
        opts, scalers = {}, {}
        for p, lay in layers.items():
            opts[p] = torch.optim.SGD(lay.parameters(), lr=0.05, fused=fused)
            scalers[p] = torch.amp.GradScaler("cpu", init_scale=1024.0)
            lay.attach_optimizer(opts[p], scaler=scalers[p])
        with torch.no_grad():
            layers["feplb-split@ema"](x)
        layers["feplb-split@ema"].refresh_replicas()
        diffs, moved = [], 0
        for step in range(3):
            outs = {}
            for p, lay in layers.items():
                opts[p].zero_grad()
                out = lay(x)
                scalers[p].scale(out.pow(2).mean()).backward()
                if step == 1:
                    scalers[p].unscale_(opts[p])      # where a training loop clips
                scalers[p].step(opts[p])
                scalers[p].update()
                outs[p] = out.detach()
            diffs.append(float((outs["feplb-split@ema"] - outs["none"]).abs().max()))
            moved += layers["feplb-split@ema"].last_stats.rows_moved
        bal, ref = layers["feplb-split@ema"], layers["none"]
        res[f"scaled/{fused}"] = (max(diffs), float((bal.w1 - ref.w1).abs().max()), moved)

        # an overflow on one rank's replicas only: every rank skips the step, its weights and replicas unchanged
        opt, scaler = opts["feplb-split@ema"], scalers["feplb-split@ema"]
        opt.zero_grad()
        scaler.scale(bal(x).pow(2).mean()).backward()
        held = [w for w in bal.replicas.replica_bank or () if w.grad is not None]
        flags = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(flags, bool(held))
        injected = rank == min((r for r, h in enumerate(flags) if h), default=-1)
        if injected:
            held[0].grad.view(-1)[0] = float("inf")
        before = bal.w1.detach().clone()
        scaler.step(opt)
        scaler.update()
        res[f"overflow/{fused}"] = (bool(held), injected, torch.equal(bal.w1, before), scaler.get_scale(),
                                    error_of(lambda bal=bal: bal(x)))
        for lay in layers.values():
            lay.close()

    # a scaler stepping a fused optimizer it was not attached with: refused on every rank
    bal = _layer(2, policy="feplb-split@ema", weights="per-step")[0]
    opt = torch.optim.SGD(bal.parameters(), lr=0.05, fused=True)
    bal.attach_optimizer(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with torch.no_grad():
        bal(x)
    bal.refresh_replicas()
    scaler.scale(bal(x).pow(2).mean()).backward()
    res["unpassed"] = error_of(lambda opt=opt: scaler.step(opt))
    res["unpassed_clean"] = not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")   # for a retry
    bal.close()

    # a scaler attached with a layer since closed (the rest of the model trains on); pickled and copied: plain again
    import copy
    import pickle

    dense = torch.nn.Parameter(torch.ones(3))
    bal = _layer(2, policy="feplb-split@ema", weights="per-step")[0]
    opt = torch.optim.SGD([*bal.parameters(), dense], lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    bal.attach_optimizer(opt, scaler=scaler)
    with torch.no_grad():
        bal(x)
    bal.refresh_replicas()
    scaler.scale(bal(x).pow(2).mean() + dense.sum()).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    bal.close()
    scaler.scale(dense.sum()).backward()
    res["after_close"] = error_of(lambda opt=opt: (scaler.step(opt), scaler.update()))
    res["copies"] = [(type(c).__name__, c.get_scale()) for c in (pickle.loads(pickle.dumps(scaler)),
                                                                  copy.deepcopy(scaler))]

    # attached optimizer garbage collected, a new unattached fused one at its address: stale replicas still caught
    bal = _layer(2, policy="feplb-split@ema", weights="per-step")[0]
    with torch.no_grad():
        bal(x)
    bal.refresh_replicas()
    opt = torch.optim.AdamW(bal.parameters(), lr=0.05, fused=True)
    bal.attach_optimizer(opt)
    bal(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    old = id(opt)
    del opt
    gc.collect()
    keep = []
    for _ in range(200_000):
        keep.append(torch.optim.AdamW.__new__(torch.optim.AdamW))
        if id(keep[-1]) == old:
            break
    reused = keep.pop() if id(keep[-1]) == old else None
    del keep
    res["reused"] = reused is not None
    if reused is not None:
        reused.__init__(bal.parameters(), lr=0.05, fused=True)
        bal(x).pow(2).mean().backward()
        bal.reduce_replica_grads()
        reused.step()
        res["reused_stale"] = error_of(lambda: bal(x))
    bal.close()


def _inputs(rank, res):
    """Non-contiguous input and routing on one rank only; bad routing on one rank raises everywhere."""
    layer, xs = _layer(3, policy="feplb-split", weights="per-microbatch")
    x = xs[rank]
    with torch.no_grad():
        ids, w, _ = layer.route(x)
        ref = layer(x, routing=(ids, w))
        res["routed_ref"] = float((ref - layer(x)).abs().max())
        if rank == 1:
            x_nc = x.t().contiguous().t()               # same values, column-major strides
            ids_nc = ids.t().contiguous().t()
            w_nc = w.t().contiguous().t()
            assert not (x_nc.is_contiguous() or ids_nc.is_contiguous() or w_nc.is_contiguous())
        else:
            x_nc, ids_nc, w_nc = x, ids, w
        res["noncontig"] = float((layer(x_nc, routing=(ids_nc, w_nc)) - ref).abs().max())
        res["noncontig_router"] = float((layer(x_nc) - ref).abs().max())
        bad_w = w.clone()
        if rank == 3:
            bad_w = bad_w.t().contiguous().t()
            bad_w[0, 0] = float("nan")
        res["bad_w"] = error_of(lambda: layer(x, routing=(ids, bad_w)))
        res["bad_shape"] = error_of(lambda: layer(x, routing=(ids, w[:, :1] if rank == 2 else w)))
        res["after_ok"] = float((layer(x) - ref).abs().max())
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        torch.distributed.all_reduce(counts)
        res["tokens_per_expert"] = (layer.last_stats.tokens_per_expert, counts.tolist())
    layer.close()


def _defaults(rank, res):
    """A layer built with defaults (no planning options) balances on a CPU; balanced routing plans nothing."""
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2, xs = _weights(4)
    with MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=G)) as layer:
        load_global_weights(layer, router, w1, w2)
        x = torch.cat([xs[rank]] * 4)                  # enough rows that the straggler passes the cost model's knee
        with torch.no_grad():
            layer(x)
        s = layer.last_stats
        # in-node policy on 2 nodes: each rank plans and reports its own node's GPUs
        mine = s.loads_after_W[s.planned_ranks[0]:s.planned_ranks[-1] + 1]
        res["default_skewed"] = (s.balanced, s.fell_back, s.token_straggler_before, s.token_straggler_after,
                                 s.planned_ranks, mine, s.loads_before_W)
        T = 64
        ids = (torch.arange(T * K).reshape(T, K) + rank * T * K) % E   # round robin: every expert equal
        w = torch.full((T, K), 1.0 / K)
        with torch.no_grad():
            layer(torch.randn(T, H), routing=(ids, w))
        s = layer.last_stats
        res["default_balanced"] = (s.balanced, s.plan_us, s.token_straggler_before)
    res["closed_twice"] = error_of(layer.close)


def _copy_bytes(rank, res):
    """The bytes the layer moves are the simulator's: CostModel.plan_copy_bytes of the executed plan."""
    for policy in ("feplb-split", "feplb-split@ema", "feplb", "fastermoe"):
        layer, xs = _layer(5, policy=policy, weights="per-step")
        x = xs[rank]
        with torch.no_grad():
            layer(x)
        layer.refresh_replicas()
        got = []
        for _ in range(2):
            with torch.no_grad():
                layer(x)
            s = layer.last_stats
            want = layer._cost.plan_copy_bytes(layer.last_plan) if layer.last_plan is not None else 0
            # each planned GPU's received weights: an expert's every part per copy the plan sends it
            expert_bytes = sum(layer.part_sizes) * torch.empty((), dtype=layer.config.dtype).element_size()
            w_in = [0] * len(s.loads_before_W)
            for _, _, dst in (layer.last_plan.weight_copies if layer.last_plan is not None else ()):
                if dst in s.planned_ranks:
                    w_in[dst] += expert_bytes
            got.append((s.row_bytes_moved + s.weight_bytes_moved, want, s.weight_copies, s.rows_moved,
                        (s.weight_bytes_in_W, w_in, s.weight_bytes_moved)))
        res[f"bytes/{policy}"] = got
        layer.close()


def _copy_thread_sends(rank, res):
    """The copy thread calls no torch function on a tensor linked to autograd (one that requires grad, or a view of
    one): the forward's thread uses those at the same moment. Watched by a torch function mode on the copy thread;
    per policy, the exchanges it issued (op, sends) and the calls on autograd tensors it made (function names)."""
    import threading

    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    from feplb import dispatch

    def linked(t):
        return isinstance(t, torch.Tensor) and (t.requires_grad or (t._base is not None and t._base.requires_grad))

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(linked(t) for t in tree_leaves((args, kwargs))):
                self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **kwargs)

    issue = dispatch.Exchange.issue
    issued = []

    def spy(ex, sends, *a, **kw):
        if threading.current_thread().name.startswith("feplb-copy"):
            issued.append((ex.op, len(sends)))
        return issue(ex, sends, *a, **kw)

    dispatch.Exchange.issue = spy
    try:
        for policy in ("feplb-split", "feplb-split+place"):
            layer, xs = _layer(3, policy=policy, weights="per-microbatch")
            watch = Watch()
            layer._balancer.copier.submit(watch.__enter__).result()
            issued.clear()
            for _ in range(2):   # (+place: the second forward computes placed experts away from their owners)
                x = xs[rank].clone().requires_grad_(True)
                layer(x).sum().backward()
            layer._balancer.copier.submit(watch.__exit__, None, None, None).result()
            res[f"copy_thread/{policy}"] = (list(issued), watch.calls)
            layer.close()
    finally:
        dispatch.Exchange.issue = issue


def _worker(rank, world, tmp):
    res = {}
    _copy_thread_sends(rank, res)
    _timeline(rank, res, tmp)
    _gpu_order(rank, res)
    _inputs(rank, res)
    _defaults(rank, res)
    _copy_bytes(rank, res)
    _optimizers(rank, res)
    return res


def _scaled_worker(rank, world):
    res = {}
    _scaled_training(rank, res)
    return res


def test_grad_scaler_and_optimizer_identity():
    results = run_dist(_scaled_worker, W, timeout_s=300, collective_timeout_s=60)
    for fused in (False, True):
        for rank, res in enumerate(results):
            out_diff, w_diff, _ = res[f"scaled/{fused}"]
            assert out_diff < 1e-4 and w_diff < 1e-4, (fused, rank, out_diff, w_diff)   # unfixed: ~1e4
        assert sum(r[f"scaled/{fused}"][2] for r in results) > 0, "rows must move"
        assert sum(r[f"overflow/{fused}"][1] for r in results) == 1, "one rank's replica overflowed"
        for rank, res in enumerate(results):
            _, _, unchanged, scale, after = res[f"overflow/{fused}"]
            assert unchanged and scale == 512.0, (fused, rank, res[f"overflow/{fused}"])
            assert after is None, (fused, rank, after)       # no step, so the replicas are still fresh
    for rank, res in enumerate(results):
        assert res["unpassed"] is not None and "attach_optimizer(optimizer, scaler=scaler)" in res["unpassed"], \
            (rank, res["unpassed"])
        assert res["unpassed_clean"], rank
        assert res["after_close"] is None, (rank, res["after_close"])
        assert res["copies"] == [("GradScaler", 1024.0)] * 2, res["copies"]
        assert res["reused"], "CPython handed out the freed optimizer's address again"
        assert res["reused_stale"] is not None and "refresh_replicas" in res["reused_stale"], res["reused_stale"]


def test_runtime_schedule_optimizers_inputs_defaults(tmp_path):
    results = run_dist(_worker, W, str(tmp_path), timeout_s=400, collective_timeout_s=60)
    assert sum(r["moved"] for r in results) > 0
    for policy in ("feplb-split", "feplb-split+place"):
        issued = [x for r in results for x in r[f"copy_thread/{policy}"][0]]
        ops = {op for op, n in issued if n}
        assert {"phase-2 rows and weights to helpers", "phase-2 results home"} <= ops, (policy, issued)
        for rank, res in enumerate(results):
            calls = res[f"copy_thread/{policy}"][1]
            assert not calls, (policy, rank, "the copy thread used autograd tensors", calls[:10])
    for rank, res in enumerate(results):
        t = res["timeline"]
        for name in ("counts", "phase1", "gather", "static_gemm", "plan", "agree", "dynamic_gemm", "phase1_reverse",
                     "combine"):
            assert name in t, (rank, name, sorted(t))
        assert t["plan"][0] == "planner" and t["agree"][0] == "copy" and t["static_gemm"][0] == "compute"
        assert not res["fell_back"]
        assert t["gather"][2] <= t["static_gemm"][1], "rows must be gathered before the static GEMM starts"
        assert t["plan"][1] < t["static_gemm"][2], "planning must start while the static GEMM runs"
        assert t["agree"][1] < t["static_gemm"][2], "the agreement must run beside the static GEMM"
        if "copy_rows" in t:
            assert t["copy_rows"][0] == "copy"
            assert t["copy_rows"][1] < t["static_gemm"][2], "phase-2 copies must start beside the static GEMM"
            assert t["copy_rows"][2] <= t["dynamic_gemm"][1] + 1.0, "the dynamic GEMM must wait for its copies"
        if "copy_results" in t:
            # the results' exchange, timed on the copy thread that issued it; the compute thread's wait for it apart
            assert t["copy_results"][0] == "copy" and t["wait_results"][0] == "compute", (rank, t)
            assert t["copy_results"][2] <= t["wait_results"][2], (rank, t["copy_results"], t["wait_results"])
        assert t["dynamic_gemm"][1] >= t["static_gemm"][2]
        assert t["phase1_reverse"][1] >= t["dynamic_gemm"][2] and t["combine"][1] >= t["phase1_reverse"][2]
    assert any("copy_rows" in r["timeline"] for r in results)
    assert any("copy_results" in r["timeline"] for r in results)
    for rank, res in enumerate(results):
        cpu, gpu = res["gpu_order"][True], res["gpu_order"][False]
        assert cpu["plan_start"] < cpu["static_end"], "CPU order: planning starts beside the static GEMM"
        assert gpu["plan_start"] >= gpu["static_end"], "GPU order: planning starts once the static GEMM is queued"
        assert not cpu["fell_back"] and not gpu["fell_back"] and cpu["moved"] == gpu["moved"]
        assert cpu["plan"].moves == gpu["plan"].moves and cpu["plan"].weight_copies == gpu["plan"].weight_copies
        for k in ("out", "dx", "dw1", "dw2"):
            assert torch.equal(cpu[k], gpu[k]), (rank, k)
    assert sum(r["gpu_order"][False]["moved"] for r in results) > 0
    assert results[0]["trace_events"] >= 20 and results[0]["trace_file"] == "X"
    assert results[0]["png"] == b"\x89PNG\r\n\x1a\n"

    for rank, res in enumerate(results):
        assert res["routed_ref"] < 1e-5 and res["noncontig"] < 1e-5 and res["noncontig_router"] < 1e-5, res
        assert res["bad_w"] is not None and res["bad_w"].startswith("NonFiniteRoutingError") and \
            "[3]" in res["bad_w"], res
        assert res["bad_shape"] is not None and res["bad_shape"].startswith("ValueError"), res["bad_shape"]
        assert res["after_ok"] < 1e-5
        assert res["tokens_per_expert"][0] == res["tokens_per_expert"][1]

        balanced, fell_back, before, after, ranks, _, before_W = res["default_skewed"]
        assert balanced and not fell_back and after <= before, res["default_skewed"]
        assert ranks == list(range(rank // G * G, rank // G * G + G)), ranks
        assert before == pytest.approx(token_straggler(np.array(before_W)[ranks])), res["default_skewed"]
        assert res["default_balanced"] == (False, 0.0, 0.0), res["default_balanced"]
        assert res["closed_twice"] is None

        for *_, (w_in, want_in, w_moved) in res["bytes/fastermoe"]:
            # the direct path's exchange carries weights only: each GPU's shadows, as the plan sends them
            assert w_in == want_in and sum(w_in) == w_moved, ("fastermoe", w_in, want_in, w_moved)
        assert any(c > 0 for _, _, c, _, _ in res["bytes/fastermoe"]), "the skewed routing is shadowed"
        for policy in ("feplb-split", "feplb-split@ema", "feplb"):
            for moved_bytes, want, copies, rows, (w_in, want_in, w_moved) in res[f"bytes/{policy}"]:
                assert moved_bytes == want, (policy, moved_bytes, want)
                assert w_in == want_in and sum(w_in) == w_moved, (policy, w_in, want_in, w_moved)
                assert rows > 0, policy
                if policy.endswith("@ema"):
                    assert copies == 0, "resident replicas: the plan copies rows only"
        assert any(c > 0 for _, _, c, _, _ in res["bytes/feplb-split"]), "@current: weights travel as the plan says"

        for tag in ("AdamW-fused", "AdamW-foreach", "SGD-fused", "SGD-foreach"):
            assert res[f"stale/{tag}"] is not None and "refresh_replicas" in res[f"stale/{tag}"], (tag, res)
            out_diff, w_diff, moved = res[f"attached/{tag}"]
            assert out_diff < 1e-4 and w_diff < 1e-4, (tag, out_diff, w_diff)   # stale replicas: ~1
    assert all(sum(r[f"attached/{t}"][2] for r in results) > 0 for t in ("AdamW-fused", "SGD-foreach"))
    # the group's loads after balancing, each node's from a rank of that node: the straggler drops
    after_W = [v for n in range(0, len(results), G) for v in results[n]["default_skewed"][5]]
    before_W = results[0]["default_skewed"][6]
    assert sum(after_W) == sum(before_W) and token_straggler(after_W) < token_straggler(before_W), (before_W, after_W)


def test_chrome_trace_of_spans_is_valid(tmp_path):
    from feplb.timeline import Span, to_chrome_trace

    spans = [Span(name="static_gemm", lane="compute", start_us=0.0, end_us=50.0),
             Span(name="copy_rows", lane="copy", start_us=10.0, end_us=30.0)]
    trace = to_chrome_trace([spans, spans], tmp_path / "t.json")
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in xs] == [0.0, 10.0, 60.0, 70.0]
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    assert not list(tmp_path.glob("*.tmp"))
    assert np.isclose(xs[1]["dur"], 20.0)
    # a time that is not a finite number (JSON has none) is refused by name, and the file written before stays whole
    before = (tmp_path / "t.json").read_bytes()
    bad = [*spans, Span(name="recv_rows", lane="copy", start_us=5.0, end_us=float("nan"))]
    with pytest.raises(ValueError, match=r"span 'recv_rows' on lane 'copy' has a time that is not a finite number"):
        to_chrome_trace([bad], tmp_path / "t.json")
    assert (tmp_path / "t.json").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_plot_takes_a_timeline_or_its_spans(tmp_path):
    """``plot`` takes what ``to_chrome_trace`` takes for one forward: ``layer.last_timeline`` itself, or its spans."""
    from feplb.timeline import Timeline, plot

    tl = Timeline()
    tl.add("static_gemm", "compute", 0.0, 50.0)
    tl.add("copy_rows", "copy", 10.0, 30.0)
    plot(tl, tmp_path / "a.png")
    plot(tl.spans(), tmp_path / "b.png")
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in ("a.png", "b.png"))
    # the path's suffix names the format (a PNG named .svg or .pdf is no such file); an unknown one is refused, and
    # no file or temporary file is left
    plot(tl, tmp_path / "c.svg")
    plot(tl, tmp_path / "d.pdf")
    assert b"<svg" in (tmp_path / "c.svg").read_bytes()[:1000] and (tmp_path / "d.pdf").read_bytes()[:5] == b"%PDF-"
    with pytest.raises(ValueError, match=r"e\.xyz: unknown image format 'xyz'; expected one of .*png"):
        plot(tl, tmp_path / "e.xyz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png", "c.svg", "d.pdf"]


def test_the_copy_thread_records_no_autograd_graph():
    """Grad mode is per thread: the copy thread's is off, so its sends never become autograd views of weights the
    compute thread is using at the same moment, while the calling thread's stays on."""
    from feplb.balance import Balancer

    b = Balancer(plan_wait_s=None, device=torch.device("cpu"))
    try:
        w = torch.randn(3, 4, requires_grad=True)
        assert b.copier.submit(torch.is_grad_enabled).result(timeout=10) is False
        assert b.copier.submit(lambda: w[1].grad_fn).result(timeout=10) is None   # no autograd view
        assert torch.is_grad_enabled() and w[1].grad_fn is not None
    finally:
        b.close()


@pytest.mark.parametrize("exc", [RuntimeError, SystemExit, GeneratorExit])
def test_any_planner_error_is_a_failed_plan(exc):
    """Whatever the planner thread raises becomes the failed plan the copy thread agrees on with its scope (every
    rank then computes at home), a BaseException that is no Exception too: raised on the copy thread, it left that
    rank before the readiness agreement (its peers waited there until the group's timeout) and ended the caller."""
    from feplb.balance import Balancer

    def plan():
        raise exc("injected in the planner")

    b = Balancer(plan_wait_s=None, device=torch.device("cpu"))
    try:
        got = b.copier.submit(b.wait_plan, b.submit_plan(plan), None).result(timeout=10)
    finally:
        b.close()
    assert got.plan is None and got.ready == 0 and got.error == f"{exc.__name__}: injected in the planner", got
