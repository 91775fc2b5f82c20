"""MoELayer in the ways training code uses it, and misuses it, on 4 gloo ranks.

* EP x DP: two EP groups of 2 ranks wrapped in DDP over the data-parallel groups, each EP group placing its experts
  from its own routing (``+place``): the output equals the dense reference on every replica (DDP broadcasts
  buffers; the placement must not be one).
* A rank whose input needs no gradient while its peers' do: the backward collectives still run on every rank.
* ``module.eval()`` forwards leave the policy history and the placement alone.
* Routing from a router outside the layer (``layer(x, routing=(ids, weights))``) equals the layer's own.
* torch's CommDebugMode counts the layer's forward collectives, also beside activation checkpointing.
* Misuse gives the same clear error on every rank, never a hang: a malformed input or routing on ONE rank, activation
  checkpointing around the layer, ``refresh_replicas()`` between a forward and its backward, and a restored
  policy state that differs across ranks.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from feplb.testing import dense_moe_reference, error_of, load_global_weights, run_dist

pytestmark = pytest.mark.dist

H, FF, E, K = 16, 32, 8, 2


def _weights(seed, hot=(0, 1)):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen) / H ** 0.5
    router[:, 0] = 0.0
    router[list(hot), 0] = 3.0
    w1 = torch.randn(E, H, 2 * FF, generator=gen) / H ** 0.5
    w2 = torch.randn(E, FF, H, generator=gen) / FF ** 0.5
    xs = [torch.randn(16 + 8 * r, H, generator=gen) for r in range(4)]
    for x in xs:
        x[:, 0] = x[:, 0].abs() + 1.0
    return router, w1, w2, xs


def _layer(seed, group=None, **kw):
    from feplb import FEPLBConfig, MoELayer

    router, w1, w2, xs = _weights(seed)
    kw.setdefault("gpus_per_node", 2)
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=FF, num_experts=E, top_k=K, min_chunk=2, dyn=2,
                                 plan_wait_ms=60_000, min_straggler_rows=0, **kw), group=group)
    load_global_weights(layer, router, w1, w2)
    return layer, router, w1, w2, xs


def _close(got, want):
    return (got.double() - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-6)


EPDP_STEPS = 3


def _epdp_input(step, rank):
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(100 * step + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _epdp_dense():
    """The EP x DP case's parameters after its SGD steps on the mean of the four ranks' losses, dense in fp64."""
    router, w1, w2, _ = _weights(18)
    params = [t.double().requires_grad_(True) for t in (router, w1, w2)]
    for step in range(EPDP_STEPS):
        loss = sum(dense_moe_reference(_epdp_input(step, r).double(), *params, K).pow(2).mean() for r in range(4)) / 4
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= 0.5 * g
    return [p.detach() for p in params]


def _usage_worker(rank, world):
    import torch.distributed as dist

    res = {}
    # EP x DP: EP groups {0,1}, {2,3}; DP groups {0,2}, {1,3}. Replica 1's tokens prefer other experts, so the
    # two EP groups place their experts differently.
    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, dp, replica = eps[rank // 2], dps[rank % 2], rank // 2
    layer, router, w1, w2, xs = _layer(10, group=ep, gpus_per_node=1, policy="none+place", weights="per-microbatch",
                                       refresh_every=1)
    x = xs[layer.rank].clone()
    if replica == 1:
        x[:, 0] = -x[:, 0]
    with torch.no_grad():
        layer(x)                 # routing history: the placement is adopted after this micro-batch
    ddp = torch.nn.parallel.DistributedDataParallel(layer, process_group=dp)
    y = ddp(x)
    res["ddp_ok"] = _close(y.detach(), dense_moe_reference(x.double(), router.double(), w1.double(), w2.double(), K))
    res["home_E"] = layer.home_E.tolist()
    y.sum().backward()

    # EP x DP training: DDP over all four ranks with the shards left out (feplb.ignore_experts_in_ddp),
    # average_expert_grads over the data-parallel group, resident replicas (@ema, per-step weights): three SGD steps
    # on the mean of the four ranks' losses, compared with a dense fp64 run in the test.
    import feplb

    layer, *_ = _layer(18, group=ep, policy="feplb-split@ema")
    root = torch.nn.Sequential(layer)
    feplb.ignore_experts_in_ddp(root)
    ddp = torch.nn.parallel.DistributedDataParallel(root)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer.attach_optimizer(opt)
    moved = 0
    for step in range(EPDP_STEPS):
        ddp(_epdp_input(step, rank)).pow(2).mean().backward()
        moved += layer.last_stats.rows_moved
        layer.average_expert_grads(dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
    res["epdp"] = {"router": layer.router.weight.detach().clone(), "w1": layer.w1.detach().clone(),
                   "w2": layer.w2.detach().clone(), "ep_rank": layer.rank, "moved": moved}
    layer.close()

    # DDP over the EP group around a bare MoELayer (its shards named at the root): the shards keep their own
    # values and gradients, the router is averaged
    layer, *_, xs = _layer(17, policy="feplb-split", weights="per-microbatch")
    layer(xs[rank]).pow(2).mean().backward()
    bare = layer.w1.grad.clone()
    layer.zero_grad(set_to_none=True)
    shard = layer.w1.detach().clone()
    feplb.ignore_experts_in_ddp(layer)
    ddp = torch.nn.parallel.DistributedDataParallel(layer)
    res["root_shard_kept"] = torch.equal(layer.w1.detach(), shard)
    ddp(xs[rank]).pow(2).mean().backward()
    res["root_grad_own"] = _close(layer.w1.grad, bare.double())

    # One rank's input needs no gradient, the others' do: everyone finishes its backward.
    layer, *_, xs = _layer(11, policy="feplb-split", weights="per-microbatch")
    x = xs[rank].clone().requires_grad_(rank != 1)
    res["mixed_grad"] = error_of(lambda: layer(x).sum().backward())
    res["mixed_grad_w1"] = layer.w1.grad is not None

    # eval() forwards do not advance the history or the placement.
    layer, *_, xs = _layer(12, policy="feplb-split+place", weights="per-microbatch", refresh_every=1)
    layer.eval()
    with torch.no_grad():
        layer(xs[rank])
    res["eval_step"] = layer.state.step
    layer.train()
    with torch.no_grad():
        layer(xs[rank])
    res["train_step"] = layer.state.step

    # A malformed input on rank 2 only: rank 2 gets its own error, the others a ValueError naming rank 2.
    layer, *_, xs = _layer(13, policy="feplb-split")
    bad = torch.randn(4, H + 1) if rank == 2 else xs[rank]
    res["bad_one"] = error_of(lambda: layer(bad))
    res["after_bad_ok"] = error_of(lambda: layer(xs[rank])) is None

    # Routing from a router outside the layer: the layer's own routing passed in gives the same output and router
    # gradient; an expert id out of range (rank 3) or a wrongly shaped routing (rank 1) raises on every rank.
    layer, *_, xs = _layer(16, policy="feplb-split")
    x = xs[rank]
    out_own = layer(x)
    out_own.square().sum().backward()
    g_own, layer.router.weight.grad = layer.router.weight.grad.clone(), None
    ids, w, _ = layer.route(x)
    out_ext = layer(x, routing=(ids, w))
    out_ext.square().sum().backward()
    res["routing_same"] = torch.equal(out_own, out_ext) and torch.allclose(layer.router.weight.grad, g_own)
    bad_ids = ids.clone()
    if rank == 3:
        bad_ids[0, 0] = E
    res["routing_bad_id"] = error_of(lambda: layer(x, routing=(bad_ids, w.detach())))
    res["routing_bad_shape"] = error_of(lambda: layer(x, routing=(ids[:, :1] if rank == 1 else ids, w.detach())))

    # Activation checkpointing recomputes the layer by replaying its forward (tests/runtime/test_checkpoint.py
    # checks it against no checkpointing): here a layer that has seen malformed input and outside routing.
    from torch.utils.checkpoint import checkpoint

    x = xs[rank].clone().requires_grad_(True)
    res["checkpoint"] = error_of(lambda: checkpoint(layer, x, use_reentrant=False).sum().backward())

    # refresh_replicas() between a forward and its backward: the late gradient is noticed, on every rank.
    layer, *_, xs = _layer(14, policy="feplb-split+place", weights="per-step")
    with torch.no_grad():
        layer(xs[rank])
    layer.refresh_replicas()
    out = layer(xs[rank].clone().requires_grad_(True))
    layer.refresh_replicas()
    out.sum().backward()
    res["late_grad"] = error_of(layer.reduce_replica_grads)

    # A restored policy state that differs across ranks (rank 0 restored a later step): refused by every rank.
    layer, *_, xs = _layer(15, policy="feplb-split@ema", weights="per-step")
    with torch.no_grad():
        layer(xs[rank])
    if rank == 0:
        layer.state = layer.state.observe(np.ones((world, E), dtype=np.int64))
    res["state_mismatch"] = error_of(layer.refresh_replicas)

    # A mixed-precision optimizer that steps fp32 main copies of the experts (Megatron's: ``param.main_param``) and
    # writes them back through .data, which bumps no version: its step still marks the per-step copies stale, so
    # the next forward refuses them on every rank instead of computing with the old weights
    layer, *_, xs = _layer(23, policy="eplb", weights="per-step")
    with torch.no_grad():
        layer(xs[rank])
    layer.refresh_replicas()
    mains = []
    for p in layer.expert_params():
        p.main_param = p.detach().clone().requires_grad_(True)
        p.main_param.grad = torch.ones_like(p)
        mains.append(p.main_param)
    torch.optim.SGD(mains, lr=0.1).step()
    for p in layer.expert_params():
        p.data.copy_(p.main_param)
    held = bool(layer.replicas.all_pairs())
    res["main_params"] = (held, error_of(lambda: layer(xs[rank])))
    layer.refresh_replicas()
    res["main_params_refreshed"] = error_of(lambda: layer(xs[rank]))

    # Writes that no optimizer step marks and no version counter shows: through .data outside any optimizer (a
    # master copy written back by hand, as DeepSpeed's and apex's mixed precision do). The owners' sampled bits
    # differ from the copies', so the next forward refuses them on every rank; here rank 2 alone changed one of
    # its experts. Bits written back unchanged (and NaN among them) are no change
    layer, *_, xs = _layer(23, policy="eplb", weights="per-step")
    with torch.no_grad():
        layer(xs[rank])
    for p in layer.expert_params():
        p.data[-1] = float("nan")
    layer.refresh_replicas()
    for p in layer.expert_params():
        p.data.copy_(p.data.clone())
    same = error_of(lambda: layer(xs[rank]))
    if rank == 2:
        for p in layer.expert_params():
            p.data[0] += 0.01
    res["data_write"] = (bool(layer.replicas.all_pairs()), same, error_of(lambda: layer(xs[rank])))
    layer.refresh_replicas()
    res["data_write_refreshed"] = error_of(lambda: layer(xs[rank]))
    layer.close()

    # At the interpreter's exit every layer still open is released (threads still running at teardown could abort
    # a process whose run succeeded): the atexit function closes them, locally
    from feplb.layer import _close_at_exit

    left = _layer(24, policy="feplb-split", weights="per-step")[0]
    _close_at_exit()
    res["closed_at_exit"] = getattr(left, "_closed", False) and left._balancer.copier._shutdown
    # a closed layer's forward and per-step calls refuse, naming what happened (locally: it holds no group)
    res["after_close"] = [error_of(lambda: left(xs[rank])), error_of(left.refresh_replicas)]
    # closed between a forward and its backward (a `with layer:` block returning the loss): the backward refuses on
    # every rank, naming it (it failed in the copy thread's executor: "cannot schedule new futures after shutdown")
    # (also the layer dropped with its block: a `with` in a function that returns the loss)
    import gc

    def closed_loss(policy: str, x: torch.Tensor) -> torch.Tensor:
        with _layer(24, policy=policy)[0] as closing:
            return closing(x).square().sum()

    res["closed_before_backward"] = {}
    for policy in ("feplb-split", "none"):
        closing = _layer(24, policy=policy)[0]
        y = closing(xs[rank].clone().requires_grad_(True))
        closing.close()
        res["closed_before_backward"][policy] = error_of(lambda y=y: y.square().sum().backward())
        loss = closed_loss(policy, xs[rank].clone().requires_grad_(True))
        gc.collect()
        res["closed_before_backward"][policy + " dropped"] = error_of(loss.backward)

    # Megatron's DDP keeps every expert parameter of a model in one flat buffer; its distributed optimizer steps one
    # shard of it per expert-data-parallel rank (views of the buffer in fp32, fp32 main copies of the parameters in
    # the shard otherwise), writes through .data (no version counter moves), and all-gathers the other ranks'
    # shards. Here this rank's shard holds only layer b's experts, and layer a's new weights arrive from the
    # gather: layer a's next forward still refuses its stale copies, on every rank. A step of other parameters in
    # the buffer (layer a's router: a layout that mixes experts with other parameters) marks nothing
    res["flat_buffer"] = {}
    for kind in ("fp32 shard", "main copies", "other parameters"):
        a, *_, xs = _layer(23, policy="eplb", weights="per-step")
        b, *_ = _layer(24, policy="eplb", weights="per-step")
        params = list(a.expert_params()) + list(b.expert_params()) + [a.router.weight]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        at = 0
        for p in params:
            p.data = flat[at:at + p.numel()].view_as(p)
            at += p.numel()
        for layer in (a, b):
            with torch.no_grad():
                layer(xs[rank])
            layer.refresh_replicas()
        cut = sum(p.numel() for p in a.expert_params())
        experts = cut + sum(p.numel() for p in b.expert_params())
        if kind == "fp32 shard":
            stepped = [torch.nn.Parameter(flat[cut:experts])]
        elif kind == "other parameters":
            stepped = [torch.nn.Parameter(flat[experts:])]
        else:
            stepped = []
            for p in b.expert_params():
                p.main_param = p.detach().clone().requires_grad_(True)
                stepped.append(p.main_param)
        for t in stepped:
            t.grad = torch.ones_like(t)
        torch.optim.SGD(stepped, lr=0.1).step()
        with torch.no_grad():
            if kind == "main copies":
                for p in b.expert_params():
                    p.data.copy_(p.main_param)
            if kind != "other parameters":
                flat[:cut] -= 0.1          # the other rank's shard, all-gathered
        held = bool(a.replicas.all_pairs())
        stale = error_of(lambda a=a, x=xs[rank]: a(x))
        if kind == "other parameters":   # the experts are as they were: the copies too
            res["flat_buffer_other"] = (held, stale)
            a.close()
            b.close()
            continue
        a.refresh_replicas()
        b.refresh_replicas()
        res["flat_buffer"][kind] = (held, stale, error_of(lambda a=a, x=xs[rank]: a(x)))
        a.close()
        b.close()

    # refresh_replicas inside torch.inference_mode (an evaluation loop's, say): the copies still train afterwards,
    # and their gradients reach the owners as without it
    grads = []
    for inference in (False, True):
        layer, *_, xs = _layer(17, policy="eplb", weights="per-step")
        with torch.no_grad():
            layer(xs[rank])
        with torch.inference_mode(inference):
            layer.refresh_replicas()
        layer(xs[rank]).square().sum().backward()
        with torch.inference_mode(inference):
            layer.reduce_replica_grads()
        grads.append((layer.w1.grad.clone(), len(layer.replicas.pairs)))
    res["inference_refresh"] = torch.equal(grads[0][0], grads[1][0]) and grads[1][1] > 0

    # A backward the loop discards (zero_grad without a step): the gradients it left on per-step copies are
    # dropped with the owners', by an attached optimizer's zero_grad() and by layer.zero_grad(); the next step's
    # expert gradients equal plain EP's for the kept backward alone
    def loss(layer, seed):
        x = torch.randn(24, H, generator=torch.Generator().manual_seed(seed + rank))
        x[:, 0] = x[:, 0].abs() + 1.0
        layer(x).square().sum().backward()

    ref, *_ = _layer(19, policy="none")
    loss(ref, 200)
    for how in ("optimizer", "layer"):
        layer, *_ = _layer(19, policy="feplb-split@ema", weights="per-step", refresh_every=1)
        with torch.no_grad():
            layer(xs[rank])
        layer.refresh_replicas()
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        layer.attach_optimizer(opt)
        loss(layer, 100)
        held = not layer.replicas.grads_clean()
        opt.zero_grad() if how == "optimizer" else layer.zero_grad()
        loss(layer, 200)
        layer.reduce_replica_grads()
        res[f"discard_{how}"] = (held, _close(layer.w1.grad, ref.w1.grad.double()),
                                 _close(layer.w2.grad, ref.w2.grad.double()))

    # Experts frozen when the copies were made, unfrozen later: the copies follow, their rows' gradients reach the
    # owners
    layer, *_ = _layer(19, policy="feplb-split@ema", weights="per-step", refresh_every=1)
    layer.w1.requires_grad_(False)
    layer.w2.requires_grad_(False)
    with torch.no_grad():
        layer(xs[rank])
    layer.refresh_replicas()
    layer.w1.requires_grad_(True)
    layer.w2.requires_grad_(True)
    loss(layer, 200)
    held = not layer.replicas.grads_clean()
    layer.reduce_replica_grads()
    res["unfrozen"] = (held, _close(layer.w1.grad, ref.w1.grad.double()), _close(layer.w2.grad, ref.w2.grad.double()))

    # Experts frozen part way through a step (after its first backward, or after its last, before the reduction):
    # as in plain EP their parameters keep the gradients of the backward passes made while they trained, the copies'
    # share included, and stay frozen
    ref_first, *_ = _layer(19, policy="none")
    loss(ref_first, 100)
    loss(ref, 100)                     # (ref: the backward passes 200 and 100)
    for when in ("between", "after"):
        layer, *_ = _layer(19, policy="feplb-split@ema", weights="per-step", refresh_every=1)
        with torch.no_grad():
            layer(xs[rank])
        layer.refresh_replicas()
        loss(layer, 100)
        if when == "between":
            layer.w1.requires_grad_(False)
            layer.w2.requires_grad_(False)
        loss(layer, 200)
        layer.w1.requires_grad_(False)
        layer.w2.requires_grad_(False)
        held = not layer.replicas.grads_clean()
        layer.reduce_replica_grads()
        want = ref_first if when == "between" else ref
        res[f"frozen_{when}"] = (held, _close(layer.w1.grad, want.w1.grad.double()),
                                 _close(layer.w2.grad, want.w2.grad.double()),
                                 not layer.w1.requires_grad and not layer.w2.requires_grad)

    # One rank in eval mode, the others training: refused on every rank (the histories would diverge), no hang
    layer, *_, xs = _layer(20, policy="feplb-split+place", weights="per-microbatch", refresh_every=1)
    layer.train(rank != 0)
    with torch.no_grad():
        res["modes"] = error_of(lambda: [layer(xs[rank]) for _ in range(2)])

    # The layer cast after it was built (model.to(torch.bfloat16) after building it or after feplb.hf.apply): the
    # wrong input dtype is refused on every rank, naming the cast; an input of the built dtype still runs
    layer, *_, xs = _layer(22, policy="feplb")
    layer.to(torch.bfloat16)
    res["cast"] = error_of(lambda: layer(xs[rank].to(torch.bfloat16)))
    res["uncast"] = error_of(lambda: _layer(22, policy="feplb")[0](xs[rank].to(torch.bfloat16)))
    # ... moved after it was built (model.to(device), accelerate's prepare, after apply): the input on the new
    # device is refused on every rank, naming the move (meta stands in for a GPU here)
    layer, *_, xs = _layer(24, policy="feplb")
    layer.to("meta")
    res["moved"] = error_of(lambda: layer(xs[rank].to("meta")))
    # ... also with per-step copies held, cast on rank 0 alone: every rank refuses together (the staleness sample,
    # of other bytes after the cast, must not raise first on rank 0 while the others wait in the counts' gather)
    layer, *_, xs = _layer(23, policy="eplb", weights="per-step")
    with torch.no_grad():
        layer(xs[rank])
    layer.refresh_replicas()
    if rank == 0:
        layer.to(torch.float16)
    res["cast_copies"] = error_of(lambda: layer(xs[rank].to(torch.float16) if rank == 0 else xs[rank]))

    # float64 routing weights (Megatron's moe_router_dtype="fp64") with a bf16 layer weigh the outputs in fp32, as
    # float32 ones do, not rounded to bf16 first
    layer, *_, xs = _layer(21, policy="none", dtype=torch.bfloat16)
    x = xs[rank].to(torch.bfloat16)
    ids, _, _ = layer.route(x)
    w64 = torch.rand(ids.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    res["fp64_weights"] = torch.equal(layer(x, routing=(ids, w64)), layer(x, routing=(ids, w64.float()))) and \
        not torch.equal(layer(x, routing=(ids, w64)), layer(x, routing=(ids, w64.to(torch.bfloat16))))

    # torch's CommDebugMode around a training step counts the layer's forward collectives: the counts' all-gather
    # and the rows' all-to-alls (dispatch and combine; the copy path runs beside, on its own thread). In a backward
    # they run outside the modes: CommDebugMode's module tracker fails (KeyError) on any collective in a backward
    # that recomputed a checkpoint, so a mode around the backward, or inside the checkpointed block, must still run.
    from torch.distributed.tensor.debug import CommDebugMode

    layer, router, w1, w2, xs = _layer(24, policy="feplb-split")
    want = dense_moe_reference(xs[rank].double(), router.double(), w1.double(), w2.double(), K)
    x = xs[rank].clone().requires_grad_(True)
    with CommDebugMode() as cdm:
        y = layer(x)
        y.sum().backward()
    grad = x.grad
    res["comm_debug"] = ({str(k): v for k, v in cdm.get_comm_counts().items()}, layer.last_stats.rows_moved,
                         _close(y.detach(), want))

    def inside(t):
        with CommDebugMode():
            return layer(t)

    for reentrant in (False, True):
        for where in ("backward", "inside"):
            x = xs[rank].clone().requires_grad_(True)
            y = checkpoint(layer if where == "backward" else inside, x, use_reentrant=reentrant)
            with CommDebugMode() if where == "backward" else contextlib.nullcontext():
                err = error_of(lambda y=y: y.sum().backward())
            res[f"comm_debug_{where}_{reentrant}"] = (err, err is None and torch.equal(x.grad, grad)
                                                      and _close(y.detach(), want))

    # feplb.dropin.full_state_dict on layers built directly: every expert gathered, the rest (router) kept
    from feplb.dropin import full_state_dict

    layer, router, w1, w2, _ = _layer(16, router_bias=True)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), layer)
    sd = full_state_dict(model, rank0_only=False)
    # a copy of a model holding the layer (an EMA or reference model made with copy.deepcopy, torch.save of the
    # module): refused, naming the layer and what to do, instead of failing on a module it cannot pickle
    import copy
    import io
    import pickle

    res["copies"] = [error_of(lambda: copy.deepcopy(model)), error_of(lambda: pickle.dumps(model)),
                     error_of(lambda: torch.save(model, io.BytesIO()))]
    res["full_sd"] = (sorted(sd) == sorted(model.state_dict()) and torch.equal(sd["1.w1"], w1)
                      and torch.equal(sd["1.w2"], w2) and torch.equal(sd["1.router.weight"], router)
                      and torch.equal(sd["1.router_bias"], layer.router_bias))
    return res


def test_layer_usage_and_misuse():
    results = run_dist(_usage_worker, 4, timeout_s=300, collective_timeout_s=30)
    for key in ("discard_optimizer", "discard_layer", "unfrozen", "frozen_between", "frozen_after"):
        assert any(res[key][0] for res in results), f"{key}: no per-step copy got a gradient; the case tests nothing"
        for rank, res in enumerate(results):
            assert all(res[key][1:]), f"rank {rank}: {key}: expert gradients differ from plain EP's (or unfrozen)"
    for rank, res in enumerate(results):
        assert res["fp64_weights"], f"rank {rank}: float64 routing weights were not taken as float32 ones"
        assert res["cast"] is not None and "were cast from torch.float32 to torch.bfloat16" in res["cast"], \
            res["cast"]
        assert res["uncast"] is not None and "dtype" in res["uncast"] and "were cast" not in res["uncast"], \
            res["uncast"]
        assert res["moved"] is not None and "were moved to meta after it was built" in res["moved"], res["moved"]
        want = "were cast from torch.float32 to torch.float16" if rank == 0 else "EP rank(s) [0] refused"
        assert res["cast_copies"] is not None and want in res["cast_copies"], res["cast_copies"]
        if rank:   # the peers say what the refusing rank refused, with its error's type
            assert "(on EP rank(s) [0]: TypeError: " in res["cast_copies"] and \
                "were cast from torch.float32 to torch.float16" in res["cast_copies"], res["cast_copies"]
        assert res["modes"] is not None and "different modes" in res["modes"] and \
            "eval on [0]" in res["modes"], res["modes"]
        assert res["ddp_ok"], f"rank {rank}: EP x DP output differs from the dense reference"
        assert res["mixed_grad"] is None and res["mixed_grad_w1"], res["mixed_grad"]
        assert res["eval_step"] == 0 and res["train_step"] == 1, (res["eval_step"], res["train_step"])
        if rank == 2:
            assert res["bad_one"].startswith("ValueError") and f"[tokens, {H}]" in res["bad_one"], res["bad_one"]
        else:
            assert res["bad_one"].startswith("ValueError") and "EP rank(s) [2]" in res["bad_one"], res["bad_one"]
            assert "(on EP rank(s) [2]: ValueError: " in res["bad_one"] and f"[tokens, {H}]" in res["bad_one"], \
                res["bad_one"]
        assert res["after_bad_ok"]
        assert res["routing_same"], f"rank {rank}: routing passed in differs from the layer's own"
        assert res["routing_bad_id"].startswith("ValueError") and "outside [0, 8)" in res["routing_bad_id"] and \
            "rank(s) [3]" in res["routing_bad_id"], res["routing_bad_id"]
        want = "must be [" if rank == 1 else "EP rank(s) [1]"
        assert res["routing_bad_shape"].startswith("ValueError") and want in res["routing_bad_shape"], \
            res["routing_bad_shape"]
        assert res["checkpoint"] is None, res["checkpoint"]
        assert res["late_grad"] and res["late_grad"].startswith("RuntimeError") and \
            "already replaced" in res["late_grad"], res["late_grad"]
        held, stale = res["main_params"]
        assert held and stale is not None and "changed since the last refresh_replicas()" in stale, stale
        assert res["main_params_refreshed"] is None, res["main_params_refreshed"]
        held, same, stale = res["data_write"]
        assert held and same is None, same
        assert stale is not None and "changed since the last refresh_replicas() on EP rank(s) [2]" in stale and \
            "refresh_replicas(model) of feplb.hf, feplb.megatron or feplb.titan" in stale, stale
        assert res["data_write_refreshed"] is None, res["data_write_refreshed"]
        assert res["closed_at_exit"], "a layer left open was not closed by the atexit function"
        fwd, refresh = res["after_close"]
        assert fwd is not None and "this layer was closed" in fwd and "build a new one" in fwd, fwd
        assert refresh is not None and "its MoE layer was closed" in refresh, refresh
        for policy, err in res["closed_before_backward"].items():
            assert err is not None and err.startswith("RuntimeError: MoELayer backward (") and \
                "the layer was closed between this forward and its backward" in err, (policy, err)
        for kind, (held, stale, refreshed) in res["flat_buffer"].items():
            assert held and stale is not None and "changed since the last refresh_replicas()" in stale, (kind, stale)
            assert refreshed is None, (kind, refreshed)
        assert res["flat_buffer_other"] == (True, None), res["flat_buffer_other"]
        assert res["state_mismatch"] and res["state_mismatch"].startswith("ValueError") and \
            "policy state" in res["state_mismatch"], res["state_mismatch"]
        counts, _, same = res["comm_debug"]
        assert same and counts == {"c10d.allgather_": 1, "c10d.alltoall_base_": 2}, (rank, counts, same)
        for reentrant in (False, True):
            for where in ("backward", "inside"):
                err, same = res[f"comm_debug_{where}_{reentrant}"]
                assert err is None and same, (rank, where, reentrant, err)
        assert res["full_sd"], f"rank {rank}: full_state_dict of plain layers"
        deep, pickled, saved = res["copies"]
        assert deep is not None and "MoELayer cannot be deep-copied" in deep and "state_dict" in deep, deep
        for msg in (pickled, saved):
            assert msg is not None and "MoELayer cannot be pickled" in msg, msg
        assert res["inference_refresh"], f"rank {rank}: refresh / reduce inside inference_mode"
    router, w1, w2 = _epdp_dense()
    L = E // 2
    for rank, res in enumerate(results):
        ep = res["epdp"]
        lo = ep["ep_rank"] * L
        assert _close(ep["router"], router), f"rank {rank}: EP x DP router differs from the dense run"
        assert _close(ep["w1"], w1[lo:lo + L]) and _close(ep["w2"], w2[lo:lo + L]), f"rank {rank}: EP x DP experts"
        assert res["root_shard_kept"] and res["root_grad_own"], (rank, res["root_shard_kept"], res["root_grad_own"])
    assert all(res["epdp"]["moved"] > 0 for res in results[:2]), [res["epdp"]["moved"] for res in results]
    assert sum(res["comm_debug"][1] for res in results) > 0, "CommDebugMode: no rows moved; the case tests no copy"
    # the two EP groups placed their experts differently (else the DDP case proves nothing)
    assert results[0]["home_E"] != results[2]["home_E"], (results[0]["home_E"], results[2]["home_E"])


def _dp_group_worker(rank, world):
    """average_expert_grads under EP x DP (EP groups {0,1}, {2,3}) given data-parallel groups that cannot be: the
    world or the EP group itself (other experts' gradients added into each shard's, silently: the shards have one
    shape), and groups made across the EP groups' ranks in the crossed order ({0,3}, {1,2}: EP rank 0's experts
    summed with EP rank 1's). Each is refused on every rank, nothing summed or divided; then the right groups
    ({0,2}, {1,3}) sum over the replicas and divide by 4, over two steps (the second without a new check)."""
    import torch.distributed as dist

    from feplb.dropin import average_expert_grads

    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, dp = eps[rank // 2], dps[rank % 2]
    cross = crossed[0] if rank in (0, 3) else crossed[1]
    res = {}
    for policy in ("none", "feplb-split@ema"):
        layer, *_ = _layer(19, group=ep, policy=policy)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        layer.attach_optimizer(opt)
        for case, group in (("world", dist.group.WORLD), ("ep", ep), ("crossed", cross), ("right", dp),
                            ("again", dp)):
            layer(_epdp_input(len(res), rank)).pow(2).mean().backward()
            layer.reduce_replica_grads()
            before = [p.grad.clone() for p in layer.expert_params()]
            want = [b.clone() for b in before]
            for w in want:
                dist.all_reduce(w, group=dp)     # (the independent reference: summed over the right group)
            if case == "again":
                res[policy, case] = error_of(lambda m=layer, g=group: m.average_expert_grads(g))
            else:
                res[policy, case] = error_of(lambda m=layer, g=group: average_expert_grads(m, g))
            got = [p.grad for p in layer.expert_params()]
            if res[policy, case] is None:
                res[policy, case, "grads"] = all(torch.allclose(g, w / 4, rtol=1e-6, atol=1e-7)
                                                 for g, w in zip(got, want, strict=True))
                opt.step()
            else:
                res[policy, case, "grads"] = all(torch.equal(g, b) for g, b in zip(got, before, strict=True))
            opt.zero_grad(set_to_none=True)
        res[policy, "checks"] = len(layer.__dict__.get("_dp_checked", ()))
        layer.close()
    return res


def test_data_parallel_group_that_cannot_be_refused_on_every_rank():
    results = run_dist(_dp_group_worker, 4, timeout_s=240, collective_timeout_s=30)
    for rank, res in enumerate(results):
        for policy in ("none", "feplb-split@ema"):
            for case in ("world", "ep"):
                err = res[policy, case]
                assert err is not None and err.startswith("ValueError") and "cannot be" in err and \
                    "Nothing was done, on any rank" in err and "expert data-parallel group" in err, \
                    (rank, policy, case, err)
            err = res[policy, "crossed"]
            assert err is not None and err.startswith("ValueError") and "hold other experts" in err, \
                (rank, policy, err)
            for case in ("world", "ep", "crossed"):
                assert res[policy, case, "grads"], f"rank {rank} {policy} {case}: gradients changed by a refusal"
            for case in ("right", "again"):
                assert res[policy, case] is None, (rank, policy, case, res[policy, case])
                assert res[policy, case, "grads"], f"rank {rank} {policy} {case}: not the mean over the 4 ranks"
            assert res[policy, "checks"] == 1, (rank, policy, res[policy, "checks"])
