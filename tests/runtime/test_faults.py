"""Bad input and faults on 4 gloo ranks (2 nodes x 2 GPUs): clear errors raised on every rank together, a slow
planner that makes its node fall back (identical outputs, fell_back=True), receive buffers that grow or fail, stale
replicas, and a stalled peer that ends in a timeout naming the operation instead of a hang."""

from __future__ import annotations

import re

import pytest
import torch

from feplb.testing import error_of, load_global_weights, run_dist

pytestmark = [pytest.mark.dist, pytest.mark.timing]   # waits bounded in seconds

H, FF, E, K = 16, 32, 8, 2


def _weights(seed):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    router[:, 0] = 0.0
    router[[0, 4], 0] = 4.0     # one hot expert per node: GPU 0's expert 0 and GPU 2's expert 4
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    xs = [torch.randn(24 + 8 * r, H, generator=gen) for r in range(4)]
    for x in xs:
        x[:, 0] = x[:, 0].abs() + 1.0
    return router, w1, w2, xs


def _layer(rank, world, seed, **kw):
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2, xs = _weights(seed)
    kw.setdefault("gpus_per_node", 2)
    cfg = FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, min_chunk=2, dyn=2, **kw)
    layer = MoELayer(cfg)
    load_global_weights(layer, router, w1, w2)
    return layer, xs[rank]


def _delay_next_plan(layer, seconds: float) -> None:
    """Make the layer's next plan take ``seconds`` longer (a slow planner), injected from the test."""
    import time

    plan = layer._plan

    def slow(*args, **kwargs):
        layer._plan = plan
        time.sleep(seconds)
        return plan(*args, **kwargs)

    layer._plan = slow


def _warned_forward(layer, ref, x):
    """(layer's output equals ref's, the RuntimeWarnings it gave, whether it fell back) of one forward."""
    import warnings

    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        same = torch.allclose(layer(x), ref(x), rtol=1e-5, atol=1e-6)
    return same, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], layer.last_stats.fell_back


def _fault_worker(rank, world):
    from feplb import FEPLBConfig, MoELayer

    res = {}
    layer, x = _layer(rank, world, 1, policy="feplb-split", weights="per-microbatch", plan_wait_ms=60_000,
                      min_straggler_rows=0)
    ref, _ = _layer(rank, world, 1, policy="none")

    # Bad shapes and dtypes fail locally, before any collective, with the argument named.
    res["hidden"] = error_of(lambda: layer(torch.randn(4, H + 1)))
    res["ndim"] = error_of(lambda: layer(torch.randn(H)))
    res["dtype"] = error_of(lambda: layer(torch.randn(4, H, dtype=torch.float64)))

    # NaN logits on rank 2 only: every rank raises, naming rank 2; the layer stays usable.
    bad = x.clone()
    if rank == 2:
        bad[3, 5] = float("nan")
    res["nan"] = error_of(lambda: layer(bad))
    inf = x.clone()
    if rank == 1:
        inf[0, 0] = float("inf")
    res["inf"] = error_of(lambda: layer(inf))
    with torch.no_grad():
        res["after_nan_ok"] = torch.allclose(layer(x), ref(x), rtol=1e-5, atol=1e-6)
    # a NaN in the selection bias on rank 3 (a bias update gone wrong): it would drop its expert from selection,
    # silently; every rank raises, naming rank 3
    biased, _ = _layer(rank, world, 5, router_bias=True)
    if rank == 3:
        with torch.no_grad():
            biased.router_bias[1] = float("nan")
    res["nan_bias"] = error_of(lambda: biased(x))
    biased.close()

    # A slow planner on rank 1: node 0 (ranks 0, 1) computes at home, node 1 balances; outputs never change.
    slow, _ = _layer(rank, world, 1, policy="feplb-split", weights="per-microbatch", plan_wait_ms=1000,
                     min_straggler_rows=0, timeline=True)
    if rank == 1:
        _delay_next_plan(slow, 3.0)
    with torch.no_grad():
        out = slow(x)
        first = slow.last_timeline
        res["slow_spans"] = first.spans()       # (as the forward returned)
        res["slow_same"] = torch.allclose(out, ref(x), rtol=1e-5, atol=1e-6)
    res["slow_fell_back"] = slow.last_stats.fell_back
    res["slow_balanced"] = slow.last_stats.balanced
    # The next micro-batch, while rank 1's planner is still busy: node 0 computes at home without waiting again.
    import time

    t0 = time.perf_counter()
    with torch.no_grad():
        out = slow(x)
    res["busy_s"] = time.perf_counter() - t0
    res["busy_same"] = torch.allclose(out, ref(x), rtol=1e-5, atol=1e-6)
    res["busy_fell_back"] = slow.last_stats.fell_back
    # the late plan's span, which ends after its forward returned, is kept apart: the forward's spans stay as read
    for _ in range(100):
        if first.late() or rank != 1:
            break
        time.sleep(0.05)
    res["slow_late"] = [(s.name, s.lane) for s in first.late()]
    res["slow_spans_after"] = first.spans() == res.pop("slow_spans")
    # A forward that raises (refused input on one rank; an out-of-memory in the static GEMM on every rank) leaves
    # last_timeline, as last_stats, the last returned forward's: not the failed one's, open, whose spans change later
    kept, stats = slow.last_timeline, slow.last_stats
    bad_x = x.clone()
    if rank == 1:
        bad_x[0, 0] = float("nan")

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("out of memory in the static GEMM")

    with torch.no_grad():
        res["timeline_refused"] = error_of(lambda: slow(bad_x))
        slow._static_gemm = oom
        res["timeline_oom"] = error_of(lambda: slow(x))
        del slow._static_gemm
    res["timeline_kept"] = slow.last_timeline is kept and slow.last_stats is stats
    with torch.no_grad():
        slow(x)
    res["timeline_next"] = slow.last_timeline is not kept and slow.last_timeline._closed
    # a post-expert step raising after the experts' results: the forward's own timeline and stats, closed
    kept = slow.last_timeline
    slow._post_expert = oom
    with torch.no_grad():
        res["timeline_post"] = error_of(lambda: slow(x))
    del slow._post_expert
    res["timeline_post_closed"] = slow.last_timeline is not kept and slow.last_timeline._closed

    # A planner stuck past the group's collective timeout (8 s here) while plans are waited for (plan_wait_ms None,
    # the CPU default): its rank gives up after half the timeout and computes at home; its peers, waiting in the
    # readiness agreement meanwhile, do not time out
    stuck, _ = _layer(rank, world, 1, policy="feplb-split", weights="per-microbatch", min_straggler_rows=0)
    if rank == 1:
        _delay_next_plan(stuck, 9.0)
    t0 = time.perf_counter()
    with torch.no_grad():
        res["stuck"] = error_of(lambda: stuck(x))
    res["stuck_s"] = time.perf_counter() - t0
    res["stuck_fell_back"] = stuck.last_stats.fell_back if res["stuck"] is None else None
    stuck.close()   # rank 1 waits for its stuck plan here; the next collectives wait for it, within the timeout

    # A planner that raises on rank 1: its node (ranks 0, 1) computes at home, both warn naming rank 1 (rank 1 with
    # the error itself), node 1 balances; outputs never change
    failing, _ = _layer(rank, world, 1, policy="feplb-split", weights="per-microbatch", min_straggler_rows=0)
    if rank == 1:
        plan = failing._plan

        def broken(*args, **kwargs):
            failing._plan = plan
            raise RuntimeError("injected planner failure")

        failing._plan = broken
    res["failed_same"], res["failed_warnings"], res["failed_fell_back"] = _warned_forward(failing, ref, x)

    # A planner on rank 1 that makes another valid plan than its node's other rank (one row fewer in one move: a
    # planner bug, or another feplb version there): the readiness agreement compares the plans' digests, and the
    # node computes at home, both warning; outputs never change (the exchanges would otherwise read rows the other
    # rank does not send)
    diverging, _ = _layer(rank, world, 1, policy="feplb-split", weights="per-microbatch", min_straggler_rows=0)
    if rank == 1:
        import dataclasses

        plan_fn = diverging._plan

        def other(*args, **kwargs):
            plan, us = plan_fn(*args, **kwargs)
            moves = list(plan.moves)
            i = next(i for i, m in enumerate(moves) if m.row_end - m.row_start >= 2)
            m = moves[i]
            moves[i] = m._replace(row_end=m.row_end - 1)
            after = plan.loads_after_W.copy()
            after[m.src] += 1
            after[m.dst] -= 1
            return dataclasses.replace(plan, moves=tuple(moves), loads_after_W=after), us

        diverging._plan = other
    res["diverged_same"], res["diverged_warnings"], res["diverged_fell_back"] = _warned_forward(diverging, ref, x)
    diverging.close()

    # Receive capacity: too small with on_overflow="error" raises everywhere; "grow" grows and stays exact.
    small, _ = _layer(rank, world, 1, policy="feplb", recv_capacity=4, on_overflow="error", plan_wait_ms=60_000,
                      min_straggler_rows=0)
    res["cap_error"] = error_of(lambda: small(x))
    grow, _ = _layer(rank, world, 1, policy="feplb", recv_capacity=4, on_overflow="grow", plan_wait_ms=60_000,
                     min_straggler_rows=0, weights="per-microbatch")
    with torch.no_grad():
        res["grow_same"] = torch.allclose(grow(x), ref(x), rtol=1e-5, atol=1e-6)
    res["grew"] = grow.last_stats.recv_grew

    # Per-step replicas: weights changed without refresh_replicas() -> a clear error on every rank.
    step, _ = _layer(rank, world, 1, policy="feplb-split@ema", weights="per-step", plan_wait_ms=60_000,
                     min_straggler_rows=0)
    with torch.no_grad():
        step(x)
    step.refresh_replicas()
    res["has_replicas"] = len(step.replicas.pairs) > 0
    with torch.no_grad():
        step.w1.mul_(1.0)        # an optimizer step bumps the parameters' versions
    res["stale"] = error_of(lambda: step(x))
    step.refresh_replicas()
    xg = x.clone().requires_grad_(True)
    step(xg).sum().backward()
    res["step_moved"] = step.last_stats.rows_moved
    res["step_copies"] = step.last_stats.weight_copies
    res["unreduced"] = error_of(step.refresh_replicas)
    step.reduce_replica_grads()
    step.refresh_replicas()

    # A policy state restored from another layout (another EP size or node shape, another policy), or not a state:
    # refused by name, the layer keeping its own; one of this layer's topology and policy is taken.
    from feplb.sched.state import PolicyState
    from feplb.sched.topology import Topology

    own = step.state

    def restore(value):
        step.state = value

    res["state_topo"] = error_of(lambda: restore(PolicyState(
        topo=Topology(num_ranks=world, gpus_per_node=1, num_experts=E, dyn=2), policy="feplb-split@ema")))
    res["state_policy"] = error_of(lambda: restore(PolicyState(topo=step.topo, policy="feplb-split")))
    res["state_type"] = error_of(lambda: restore(dict(vars(own))))
    res["state_none"] = error_of(lambda: restore(None))
    # the settings the config holds too (a pickled history of another run's): not adopted silently
    res["state_settings"] = error_of(lambda: restore(PolicyState(topo=step.topo, policy="feplb-split@ema",
                                                                 refresh_every=3, replicas_mode="lazy")))
    res["state_kept"] = step.state is own
    restore(PolicyState(topo=step.topo, policy="feplb-split@ema", ema_shift=3))       # no config field: taken
    res["state_taken"] = step.state is not own
    restore(own)
    step.refresh_replicas()

    # The NVSHMEM transport without nvshmem4py (or without a GPU): the install hint, not an obscure failure.
    from feplb.transport import make_transport

    res["nvshmem"] = error_of(lambda: make_transport("nvshmem"))

    # A GPU asked for on a machine without one: a clear error on every rank, before any collective.
    if not torch.cuda.is_available():
        res["no_gpu"] = error_of(lambda: MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K,
                                                            gpus_per_node=2, device="cuda")))

    # Configs that differ across ranks: caught at construction, on every rank.
    ffn = FF + 8 if rank == 3 else FF
    res["config"] = error_of(lambda: MoELayer(FEPLBConfig(hidden=H, ffn=ffn, num_experts=E, top_k=K,
                                                        gpus_per_node=2)))

    # Ranks that run different layers in one forward (a model that skips an experts module on some ranks): an error
    # on every rank, instead of rows of one layer computed with another's weights; both layers stay usable.
    other, _ = _layer(rank, world, 2, policy="feplb-split", weights="per-microbatch", plan_wait_ms=60_000,
                      min_straggler_rows=0)
    with torch.no_grad():
        want = layer(x)
    res["mixed"] = error_of(lambda: (other if rank == 0 else layer)(x))
    with torch.no_grad():
        res["mixed_after_same"] = torch.equal(layer(x), want)
    # ... also layers of different sizes (a multimodal model's vision experts, twice as many as its text experts):
    # their counts rows meet padded to one width, so the same error, not a backend abort of the process
    bigger = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=2 * E, top_k=K, gpus_per_node=2))
    res["mixed_sizes"] = error_of(lambda: (bigger if rank == 0 else layer)(x))
    with torch.no_grad():
        res["mixed_sizes_after"] = torch.equal(layer(x), want) and bigger(x).shape == x.shape
    bigger.close()

    # Two checkpointed layers whose recomputes run in another order on rank 1 (separate backward calls): an error on
    # every rank, instead of one layer's recompute replaying the other's rows.
    from torch.utils.checkpoint import checkpoint

    first, _ = _layer(rank, world, 3, policy="none")
    second, _ = _layer(rank, world, 4, policy="none")
    la = checkpoint(first, x.clone().requires_grad_(), use_reentrant=False).square().sum()
    lb = checkpoint(second, x.clone().requires_grad_(), use_reentrant=False).square().sum()
    order = (lb, la) if rank == 1 else (la, lb)
    res["recompute_order"] = error_of(lambda: [loss.backward() for loss in order])
    with torch.no_grad():
        res["recompute_after_same"] = torch.equal(layer(x), want)

    # An optimizer step between a forward and its backward (a loop's mistake every rank makes), rows moving: the
    # backward raises on every rank at one point, ahead of the layer's exchanges (before, the ranks whose GEMM
    # backward came first raised autograd's error while a helper waited in the exchange of its homes' gradients);
    # the layer works on. Under an autocast that casts the weights the GEMMs saved their casts, as torch.matmul's
    # do: no error, the gradient is the forward's weights'.
    moved, _ = _layer(rank, world, 1, policy="feplb-split", weights="per-microbatch", plan_wait_ms=60_000,
                      min_straggler_rows=0)
    opt = torch.optim.SGD(moved.expert_params(), lr=0.1)

    def early_step():
        y = moved(x.clone().requires_grad_())
        res["early_moved"] = moved.last_stats.rows_moved
        y.square().sum().backward()    # gradients for the step
        y = moved(x.clone().requires_grad_())
        opt.step()
        y.square().sum().backward()

    res["early_step"] = error_of(early_step)
    opt.zero_grad()
    xr = x.clone().requires_grad_()
    moved(xr).square().sum().backward()
    xf = x.clone().requires_grad_()
    ref_now, _ = _layer(rank, world, 1, policy="none")
    ref_now.load_state_dict(moved.state_dict())
    ref_now(xf).square().sum().backward()
    res["early_after_same"] = torch.allclose(xr.grad, xf.grad, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xa = x.clone().requires_grad_()
        moved(xa).square().sum().backward()
        opt.zero_grad()
        xb = x.clone().requires_grad_()
        y = moved(xb)
        moved.w1.grad = torch.ones_like(moved.w1)
        opt.step()
        res["early_autocast"] = error_of(lambda: y.square().sum().backward())
    res["early_autocast_same"] = xb.grad is not None and torch.allclose(xb.grad, xa.grad, rtol=2e-2, atol=1e-3)
    moved.close()
    ref_now.close()
    # the experts' biases are not saved for the backward (torch's addmm does not object to a bias changed there)
    biased_experts = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, gpus_per_node=2,
                                          policy="feplb-split", weights="per-microbatch", expert_bias=True))
    y = biased_experts(x.clone().requires_grad_())
    with torch.no_grad():
        biased_experts.b1.add_(0.5)
    res["early_bias"] = error_of(lambda: y.square().sum().backward())
    biased_experts.close()

    # A stalled peer (rank 3 stops calling): the others time out naming the operation, no hang.
    if rank == 3:
        return res
    res["stall"] = error_of(lambda: layer(x))
    return res


def test_faults_and_bad_input():
    results = run_dist(_fault_worker, 4, timeout_s=240, collective_timeout_s=8)
    assert sum(res["early_moved"] for res in results) > 0
    for rank, res in enumerate(results):
        assert res["hidden"].startswith("ValueError") and f"[tokens, {H}]" in res["hidden"], res["hidden"]
        assert res["ndim"].startswith("ValueError"), res["ndim"]
        assert res["dtype"].startswith("TypeError") and "float64" in res["dtype"], res["dtype"]
        # (a ValueError: what catches ValueError still catches it)
        assert res["nan"].startswith("NonFiniteRoutingError") and "rank(s) [2]" in res["nan"], res["nan"]
        assert res["inf"].startswith("NonFiniteRoutingError") and "rank(s) [1]" in res["inf"], res["inf"]
        assert res["nan_bias"].startswith("NonFiniteRoutingError") and "rank(s) [3]" in res["nan_bias"], \
            res["nan_bias"]
        assert res["after_nan_ok"]
        assert res["slow_same"], f"rank {rank}: output changed by a slow planner"
        assert res["timeline_refused"].startswith("NonFiniteRoutingError"), res["timeline_refused"]
        assert res["timeline_oom"].startswith("OutOfMemoryError"), res["timeline_oom"]
        assert res["timeline_kept"] and res["timeline_next"], f"rank {rank}: a failed forward replaced last_timeline"
        assert res["timeline_post"].startswith("OutOfMemoryError") and res["timeline_post_closed"], \
            (rank, res["timeline_post"])
        assert res["slow_fell_back"] == (rank < 2), (rank, res["slow_fell_back"])
        assert res["slow_balanced"] == (rank >= 2), (rank, res["slow_balanced"])
        assert res["slow_late"] == ([("plan", "planner")] if rank == 1 else []), (rank, res["slow_late"])
        assert res["slow_spans_after"], rank
        assert res["busy_same"] and res["busy_fell_back"] == (rank < 2), (rank, res["busy_fell_back"])
        if rank < 2:   # no second wait of plan_wait_ms (1 s) behind the busy planner
            assert res["busy_s"] < 0.8, res["busy_s"]
        assert res["failed_same"] and res["failed_fell_back"] == (rank < 2), (rank, res["failed_fell_back"])
        assert res["diverged_same"] and res["diverged_fell_back"] == (rank < 2), (rank, res["diverged_fell_back"])
        diverged = [w for w in res["diverged_warnings"] if "made different plans" in w]
        assert len(diverged) == (rank < 2), (rank, res["diverged_warnings"])
        failed = [w for w in res["failed_warnings"] if "the plan failed" in w]
        if rank < 2:
            assert len(failed) == 1 and "on EP rank 1 of the node" in failed[0], (rank, res["failed_warnings"])
            want = "RuntimeError: injected planner failure" if rank == 1 else "that rank warns why"
            assert want in failed[0], (rank, failed[0])
        else:
            assert not failed, (rank, failed)
        assert res["stuck"] is None and res["stuck_fell_back"] == (rank < 2), (rank, res["stuck"])
        assert res["stuck_s"] < 8.0, (rank, res["stuck_s"])
        assert res["cap_error"].startswith("ValueError") and "recv_capacity" in res["cap_error"], res["cap_error"]
        assert res["grow_same"] and res["grew"]
        assert res["has_replicas"] and res["step_moved"] > 0 and res["step_copies"] == 0, res
        assert res["stale"].startswith("RuntimeError") and "refresh_replicas" in res["stale"], res["stale"]
        assert res["unreduced"].startswith("RuntimeError") and "reduce_replica_grads" in res["unreduced"]
        assert res["state_topo"].startswith("ValueError") and "gpus_per_node=1" in res["state_topo"], res["state_topo"]
        assert "serves policy 'feplb-split'" in res["state_policy"], res["state_policy"]
        assert "expected a feplb.sched.PolicyState, got dict" in res["state_type"], res["state_type"]
        assert "needs a PolicyState, got None" in res["state_none"], res["state_none"]
        assert res["state_settings"] == (
            "ValueError: MoELayer.state: the state's refresh_every=3 (FEPLBConfig.refresh_every=8), "
            "replicas_mode='lazy' (FEPLBConfig.replicas='eager') differ from the layer's config; the layer keeps its "
            "own"), res["state_settings"]
        assert res["state_kept"] and res["state_taken"]
        assert res["config"].startswith("ValueError") and "differs across ranks" in res["config"] and \
            f"; ffn: rank 0 {FF}, rank 1 {FF}, rank 2 {FF}, rank 3 {FF + 8}; every rank" in res["config"], res["config"]
        assert "feplb[nvshmem]" in res["nvshmem"], res["nvshmem"]
        if "no_gpu" in res:
            assert res["no_gpu"].startswith("RuntimeError") and "needs a CUDA GPU" in res["no_gpu"], res["no_gpu"]
        assert res["mixed"].startswith("RuntimeError") and "different MoE layers" in res["mixed"], res["mixed"]
        assert res["mixed_sizes"].startswith("RuntimeError") and "different MoE layers" in res["mixed_sizes"], \
            res["mixed_sizes"]
        assert res["mixed_sizes_after"]
        assert res["mixed_after_same"], rank
        assert res["recompute_order"] is not None and "recompute different MoE layers" in res["recompute_order"], \
            res["recompute_order"]
        assert res["recompute_after_same"], rank
        assert res["early_step"] is not None and "w1 [2, 16, 64] was modified in place between the forward and its " \
            "backward" in res["early_step"], (rank, res["early_step"])
        assert res["early_after_same"], rank
        assert res["early_bias"] is None, (rank, res["early_bias"])
        assert res["early_autocast"] is None and res["early_autocast_same"], (rank, res["early_autocast"])
        if rank != 3:
            assert res["stall"] is not None and "all_gather of expert counts" in res["stall"], res["stall"]
            assert res["stall"].startswith(("TimeoutError", "RuntimeError")), res["stall"]


def _feplb_threads():
    import threading

    return sorted(t.name.split("_")[0] for t in threading.enumerate() if t.name.startswith("feplb"))


def _lifecycle_worker(rank, world):
    """Faults around a layer's life, each followed by what the caller does next (see the test)."""
    import datetime
    import gc
    import time

    import torch.distributed as dist
    from torch.optim.optimizer import _global_optimizer_post_hooks

    from feplb import MoELayer, training
    from feplb.testing import free_port

    res = {}
    # 1. Building the parameters fails on rank 1 only (out of memory): every rank raises at once, none keeps a
    # layer, and the threads it started are gone.
    threads, hooks = _feplb_threads(), len(_global_optimizer_post_hooks)
    build = MoELayer._init_experts

    def fail(self, *a):
        raise MemoryError("injected: out of memory building the experts")

    if rank == 1:
        MoELayer._init_experts = fail
    t0 = time.perf_counter()
    res["init"] = error_of(lambda: _layer(rank, world, 1, policy="feplb-split"))
    res["init_s"] = time.perf_counter() - t0
    MoELayer._init_experts = build
    for _ in range(50):
        if _feplb_threads() == threads:
            break
        time.sleep(0.05)
    res["init_threads"] = (threads, _feplb_threads())

    # 2. The static GEMM fails on every rank while rank 0's plan is late: the error leaves the layer only once the
    # copy thread's agreement and copies are done, so the caller's next collective meets its peers' own.
    layer, x = _layer(rank, world, 1, gpus_per_node=4, policy="feplb-split", weights="per-microbatch",
                      plan_wait_ms=60_000, min_straggler_rows=0)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("injected: out of memory in the static GEMM")

    layer._static_gemm = oom
    if rank == 0:
        _delay_next_plan(layer, 1.0)
    with torch.no_grad():
        res["gemm"] = error_of(lambda: layer(x))
    time.sleep(0.0 if rank == 0 else 0.3)
    vote = torch.tensor([1, 10 * rank, 7])
    dist.all_reduce(vote)
    res["vote"] = vote.tolist()
    del layer._static_gemm
    with torch.no_grad():
        res["gemm_after"] = error_of(lambda: layer(x))
    layer.close()

    # 3. A planner stuck for good (its rank computes at home): close() does not wait for it.
    layer, x = _layer(rank, world, 1, policy="feplb-split", weights="per-microbatch", min_straggler_rows=0)
    if rank == 0:
        _delay_next_plan(layer, 3600.0)
    with torch.no_grad():
        layer(x)
    res["stuck_fell_back"] = layer.last_stats.fell_back
    t0 = time.perf_counter()
    layer.close()
    res["close_s"] = time.perf_counter() - t0

    # 4. Layers never closed leave no optimizer hook behind; a closed or collected layer is forgotten ...
    threads = ["feplb-plan"] if rank == 0 else []   # rank 0's stuck planner thread sleeps on (a daemon)
    made = [_layer(rank, world, 1, policy="feplb-split", min_straggler_rows=0)[0] for _ in range(3)]
    outs = []
    for m in made:
        with torch.no_grad():
            outs.append(m(x))    # (its planner thread has run a plan of it)
    res["hooks"] = (hooks, len(_global_optimizer_post_hooks), len(training._LAYERS))
    # ... and layers over the same ranks share their node's control group (one per layer held its sockets for good)
    res["shared_group"] = len({id(m.control.node_group) for m in made}) == 1 and made[0].control.node_group is not \
        made[0].control.group
    # ... and one copy path (its inbox as large as the largest exchange of any of them, not one inbox each), which
    # outlives the first of them closed
    res["shared_engine"] = len({id(m.comm.copy) for m in made}) == 1
    made[0].close()
    with torch.no_grad():
        res["after_first_closed"] = torch.equal(made[1](x), outs[1])
    made[1].close()
    from feplb import copy as copy_mod

    res["engines_kept"] = len(copy_mod._SHARED)          # made[2] is never closed: it keeps its share for good
    del made, m
    gc.collect()
    res["forgotten"] = len(training._LAYERS)
    res["engines_after"] = len(copy_mod._SHARED)
    for _ in range(100):         # the collected layers' threads end (the closed ones' too)
        if _feplb_threads() == threads:
            break
        time.sleep(0.05)
    res["threads_after"] = (threads, _feplb_threads())

    # 5. The default group is destroyed and another made, its ranks in reverse order: a layer built on the first
    # still runs on it (the group it was built with), not on the new default group with its old rank numbers.
    layer, x = _layer(rank, world, 1, policy="feplb-split", min_straggler_rows=0)
    other = _layer(rank, world, 1, policy="feplb-split", min_straggler_rows=0)[0]    # sharing its copy path
    res["old_shared"] = other.comm.copy is layer.comm.copy
    with torch.no_grad():
        before = layer(x)
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=world - 1 - rank,
                            world_size=world, timeout=datetime.timedelta(seconds=8))
    fresh = _layer(rank, world, 1, policy="feplb-split", min_straggler_rows=0)[0]
    # the old group's shared copy path (kept by made[2], never closed) is forgotten; the old layer still holds its own
    res["engines_after_reinit"] = len(copy_mod._SHARED)
    # ... and its users still count: closing one of them leaves the copy path open for the other
    other.close()
    res["old_engine_open"] = not layer.comm.copy._closed
    with torch.no_grad():
        res["old_group"] = error_of(lambda: res.__setitem__("old_group_same", torch.equal(layer(x), before)))
        res["fresh"] = error_of(lambda: fresh(x))
    return res


def test_lifecycle_faults():
    results = run_dist(_lifecycle_worker, 4, timeout_s=180, collective_timeout_s=8)
    for rank, res in enumerate(results):
        if rank == 1:
            assert res["init"].startswith("MemoryError: injected"), res["init"]
        else:
            assert res["init"].startswith("RuntimeError") and "EP rank(s) [1]" in res["init"], res["init"]
        assert res["init_s"] < 4.0, res["init_s"]          # agreed at once, not after the 8 s timeout
        assert res["init_threads"][0] == res["init_threads"][1], res["init_threads"]
        assert res["gemm"].startswith("OutOfMemoryError: injected"), res["gemm"]
        assert res["vote"] == [4, 60, 28], (rank, res["vote"])
        assert res["gemm_after"] is None, res["gemm_after"]
        assert res["stuck_fell_back"] == (rank < 2), (rank, res["stuck_fell_back"])
        assert res["close_s"] < 2.0, (rank, res["close_s"])
        before, during, live = res["hooks"]
        assert during == before and live == 3, res["hooks"]
        assert res["forgotten"] == 0, res["forgotten"]
        assert res["shared_group"], rank
        assert res["shared_engine"] and res["after_first_closed"], res
        assert res["engines_kept"] == 1 and res["engines_after"] == 1, res
        assert res["threads_after"][0] == res["threads_after"][1], res["threads_after"]
        assert res["old_shared"] and res["old_engine_open"], (rank, res)
        assert res["old_group"] is None and res["old_group_same"], (rank, res["old_group"])
        assert res["fresh"] is None and res["engines_after_reinit"] == 1, (rank, res)


def _bad_direct_plan_worker(rank, world):
    """The peers' direct path handed a plan that is not executable (a move past its expert's rows, or two moves over
    the same rows: a planner's bug), made alike on every rank: the same ValueError on every rank, at once, naming
    the violation; the layer then runs on, equal to plain EP."""
    import dataclasses
    import time

    res = {}
    ref, x = _layer(rank, world, 3, policy="none")
    x = x.repeat(8, 1)          # (rows enough for FasterMoE to shadow)
    with torch.no_grad():
        want = ref(x)
    ref.close()
    for policy in ("fastermoe", "eplb"):
        layer, _ = _layer(rank, world, 3, policy=policy, weights="per-microbatch", min_straggler_rows=0,
                          refresh_every=1)
        with torch.no_grad():
            layer(x)            # (EPLB's replicas from the history of this micro-batch)
        plan_fn = layer._plan
        for how in ("beyond", "overlap"):
            def bad(*args, how=how, plan_fn=plan_fn, **kwargs):
                plan, us = plan_fn(*args, **kwargs)
                moves = list(plan.moves)
                m = next(m for m in moves if m.row_end - m.row_start >= 2)
                if how == "beyond":
                    moves[moves.index(m)] = m._replace(row_end=m.row_end + 3)
                else:
                    moves.insert(moves.index(m), m._replace(row_end=m.row_start + 1))
                return dataclasses.replace(plan, moves=tuple(moves)), us

            layer._plan = bad
            t0 = time.perf_counter()
            with torch.no_grad():
                res[f"{policy}_{how}"] = error_of(lambda layer=layer: layer(x))
            res[f"{policy}_{how}_s"] = time.perf_counter() - t0
            layer._plan = plan_fn
        with torch.no_grad():
            got = layer(x)
        res[f"{policy}_moved"] = layer.last_stats.rows_moved
        res[f"{policy}_after"] = (got - want).abs().max().item()
        layer.close()
    return res


def test_a_direct_plan_not_executable_is_refused_on_every_rank():
    for res in run_dist(_bad_direct_plan_worker, 4, timeout_s=120, collective_timeout_s=8):
        for policy in ("fastermoe", "eplb"):
            for how, why in (("beyond", r"move \d+: rows \[\d+, \d+\) of expert \d+ (outside|do not all come|overlap)"),
                             ("overlap", "moves must be sorted|overlap a previous move")):
                err = res[f"{policy}_{how}"]
                assert err is not None and err.startswith(f"ValueError: MoELayer: the '{policy}' plan is not "
                                                          "executable"), (policy, how, err)
                assert re.search(why, err), (policy, how, err)
                assert res[f"{policy}_{how}_s"] < 4.0, res      # at once, not after the 8 s timeout
            assert res[f"{policy}_moved"] > 0 and res[f"{policy}_after"] < 1e-5, res
