"""feplb.titan_ep: FEPLB behind torchtitan's own expert parallelism (its token dispatcher, its DTensor or local
expert shards, FSDP), on 4 gloo ranks as 2 nodes x 2, torchtitan 0.3.0's own modules, parallelized by torchtitan's
own ``parallelize`` under both of its SPMD backends (``partial_dtensor``; ``spmd_types``, its default).

* The routed experts (torchtitan's ``RoutedExperts``: its all-to-all dispatch and combine around FEPLB's experts)
  against an fp64 dense reference: output and the gradients of x, the scores and this rank's expert shards (the
  reference's summed over every rank's input): within 1e-5 of each tensor's largest element with float32 experts,
  within twice torchtitan's own error with bfloat16 ones (torchtitan's module parallelized alike, same input);
  rows really move with feplb-split, none with ``none``. The module keeps torchtitan's parameters: the same names,
  shapes, types (DTensor or local) as torchtitan's own.
* Training: SGD steps of two accumulated micro-batches on the DTensor shards, the final weights against fp64 SGD;
  a non-reentrant ``torch.utils.checkpoint`` replays the forward bit for bit.
* FSDP2 on the expert shards (EP 2 x expert-FSDP 2, torchtitan's mesh): the reduce-scattered gradients against the
  fp64 reference, torchtitan's own module alike as the check of the reference.
* Refusals: settings FEPLB cannot run (at config time, by name), torchtitan's EP off (at the first forward), a
  low-precision grouped GEMM, ranks with different settings (every rank raises at the first forward).

On the CPU two torchtitan spots need a stand-in: torchtitan picks "cuda" as its device type where no accelerator
is found (set to "cpu"), and gloo's ``all_to_all`` takes equal chunks only (``spmd_types``' uneven all-to-all runs as
the equivalent ``all_to_all_single`` with split sizes, which gloo has; NCCL takes uneven chunks). Nothing of feplb
is patched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.models.common.moe")

from pathlib import Path  # noqa: E402

from feplb.testing import DerivedWeights, error_of, load_module, run_dist  # noqa: E402

# test_titan.py's model shapes, inputs and fp64 reference (loaded by path: test folders are no packages, and the
# ranks load this file by path)
_titan = load_module(Path(__file__).with_name("test_titan.py"))
D, E, FF, K, OPTS, OSS_LIMIT, TOKENS = (_titan.D, _titan.E, _titan.FF, _titan.K, _titan.OPTS, _titan.OSS_LIMIT,
                                        _titan.TOKENS)
_dense_routed, _inputs, _rel = _titan._dense_routed, _titan._inputs, _titan._rel

pytestmark = pytest.mark.dist

WORLD = 4
BACKENDS = ("partial_dtensor", "spmd_types")
# (policy, FEPLB dtype): exact in fp32 with rows moving and not; bf16 as torchtitan computes
ROUTED = (("feplb-split", "float32"), ("none", "float32"), ("feplb-split", "bfloat16"))
NAMES = ("w1_EFD", "w2_EDF", "w3_EFD")


OSS_NAMES = ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")


def _config(arch: str = "qwen3", **feplb):
    """torchtitan's MoE config (Qwen3-MoE style; GPT-OSS's experts with ``arch="gpt_oss"``, clamped at OSS_LIMIT)
    with its EP sharding; FEPLB's experts when ``feplb`` is given."""
    from functools import partial

    import spmd_types as spmd
    from torch import nn
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    import feplb.titan_ep as fte

    init = {"weight": partial(nn.init.normal_, std=0.2)}
    experts = {n: partial(nn.init.normal_, std=0.2) for n in NAMES}
    router = make_router_config(dim=D, num_experts=E, gate_param_init=init, top_k=K, score_func="softmax",
                                route_norm=True)
    cfg = make_moe_config(num_experts=E, router=router, shared_experts=None,
                          routed_experts=make_routed_experts_config(dim=D, hidden_dim=FF, num_experts=E, top_k=K,
                                                                    param_init=experts, comm_backend="standard"))
    layout = {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}
    if arch == "gpt_oss":
        cfg.routed_experts.inner_experts = GptOssGroupedExperts.Config(
            dim=D, hidden_dim=FF, num_experts=E, swiglu_limit=OSS_LIMIT,
            param_init={n: partial(nn.init.normal_, std=0.2) for n in OSS_NAMES})
        # torchtitan's GPT-OSS layout (models/gpt_oss/sharding.py)
        layout = {"mlp1_weight_EGD": spmd.S(1), "mlp1_bias_EG": spmd.S(1), "mlp2_weight_EDF": spmd.S(2),
                  "mlp2_bias_ED": spmd.R}
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False, expert_param_layout=layout)
    if feplb:
        assert fte.convert(cfg, **feplb) == ["routed_experts.inner_experts"]
    return cfg


def _build(cfg):
    """The MoE with fixed weights (the same on every rank, and for every config: the same initialisation order)."""
    torch.manual_seed(0)
    moe = cfg.build()
    with torch.no_grad():
        moe.init_states()
    return moe


def _full_weights(arch: str = "qwen3") -> dict[str, torch.Tensor]:
    moe = _build(_config(arch))
    return {n: p.detach().clone() for n, p in moe.routed_experts.inner_experts.named_parameters()}


def _cpu_torchtitan() -> None:
    """torchtitan's CUDA-only spots on the CPU (see the module docstring)."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as tpd
    import torchtitan.distributed.utils as tdu
    import torchtitan.models.common.token_dispatcher as ttd
    import torchtitan.tools.utils as tu

    for mod in (tpd, tdu, ttd, tu):
        mod.device_type = "cpu"
    equal_chunks = dist.all_to_all

    def all_to_all(outs, ins, group=None, async_op=False):
        if len({t.shape for t in [*outs, *ins]}) == 1:
            return equal_chunks(outs, ins, group=group, async_op=async_op)
        assert not async_op
        got = torch.empty((sum(t.shape[0] for t in outs), *outs[0].shape[1:]), dtype=outs[0].dtype)
        dist.all_to_all_single(got, torch.cat(ins), [t.shape[0] for t in outs], [t.shape[0] for t in ins],
                               group=group)
        for o, piece in zip(outs, got.split([t.shape[0] for t in outs]), strict=True):
            o.copy_(piece)
        return None

    dist.all_to_all = all_to_all


def _dims(backend: str, **degrees):
    from torchtitan.distributed import utils as tdu
    from torchtitan.distributed.parallel_dims import ParallelDims

    tdu.set_spmd_backend(backend)
    dims = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=WORLD)
    dims.update(degrees)
    pd = ParallelDims(**dims, world_size=WORLD, spmd_backend=backend)
    pd.build_mesh()
    return pd, tdu.get_spmd_context(parallel_dims=pd)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _reference(rank: int, full: dict, x, scores, ids, g) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64: (expert weight gradients summed over every rank's input, out, x's and the scores' gradients)."""
    import torch.distributed as dist

    ws = {n: w.detach().double().clone().requires_grad_() for n, w in full.items()}
    xr, sr = x.double().requires_grad_(), scores.double().requires_grad_()
    yr = _dense_routed(xr, sr, ids, ws)
    yr.backward(g.double())
    grads = {}
    for n, w in ws.items():
        grads[n] = w.grad.clone()
        dist.all_reduce(grads[n])
    return grads, yr, xr.grad, sr.grad


def _run(mod, ctx, x, scores, ids, g, checkpoint: bool = False, watch: DerivedWeights | None = None):
    xx, ss = x.clone().requires_grad_(), scores.clone().requires_grad_()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    with ctx():
        if checkpoint:
            from torch.utils.checkpoint import checkpoint as ckpt

            y = ckpt(mod.routed_experts, xx, ss, ids, counts, use_reentrant=False)
        else:
            y = mod.routed_experts(xx, ss, ids, counts)
    if watch is not None:
        watch.at_backward(y)
    y.backward(g)
    if watch is not None:
        watch.after_backward()   # (y still held)
    return y, xx.grad, ss.grad


def _moved(inner) -> int:
    import torch.distributed as dist

    stats = inner.engine.last_stats if inner.engine is not None else None
    t = torch.tensor([stats.rows_moved if stats is not None else 0])
    dist.all_reduce(t)
    return int(t)


def _routed_case(rank: int, backend: str, arch: str = "qwen3") -> dict:
    """FEPLB's experts and torchtitan's own, both parallelized by torchtitan, against the fp64 reference. GPT-OSS's
    experts: torchtitan's return bfloat16 whatever the input, which its combine cannot take with fp32 activations,
    so the bf16 comparison runs on bf16 activations there."""
    pd, ctx = _dims(backend)
    names = NAMES if arch == "qwen3" else OSS_NAMES
    full = _full_weights(arch)
    x32, scores, ids = _inputs(rank)
    g32 = torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(7 + rank))
    L, lo = E // WORLD, rank * (E // WORLD)
    refs: dict = {}

    def errors(act, y, gx, gs, grads) -> dict:
        if act not in refs:   # the fp64 reference on the activations as the modules get them
            refs[act] = _reference(rank, full, x32.to(act), scores, ids, g32.to(act))
        want_w, yr, gxr, gsr = refs[act]
        return {"out": _rel(y.detach(), yr), "x": _rel(gx, gxr), "scores": _rel(gs, gsr),
                **{n: _rel(_local(grads[n]), want_w[n][lo:lo + L]) for n in names}}

    titan_act = torch.float32 if arch == "qwen3" else torch.bfloat16
    titan = _build(_config(arch))
    titan.parallelize(pd)
    yt, gxt, gst = _run(titan, ctx, x32.to(titan_act), scores, ids, g32.to(titan_act))
    tw = dict(titan.routed_experts.inner_experts.named_parameters())
    titan_err = errors(titan_act, yt, gxt, gst, {n: p.grad for n, p in tw.items()})
    out = {}
    for policy, dtype in ROUTED:
        act = torch.float32 if dtype == "float32" else titan_act
        x, g = x32.to(act), g32.to(act)
        moe = _build(_config(arch, policy=policy, gpus_per_node=2, dtype=dtype, **OPTS))
        moe.parallelize(pd)
        inner = moe.routed_experts.inner_experts
        with DerivedWeights() as watch:   # the joined weights: derived again in the backward, not kept
            y, gx, gs = _run(moe, ctx, x, scores, ids, g, watch=watch)
        moved = _moved(inner)
        ow = dict(inner.named_parameters())
        err = errors(act, y, gx, gs, {n: p.grad for n, p in ow.items()})
        # checkpointed: the same module again, everything bit for bit
        grads = {n: _local(p.grad).clone() for n, p in ow.items()}
        for p in ow.values():
            p.grad = None
        yc, gxc, gsc = _run(moe, ctx, x, scores, ids, g, checkpoint=True)
        same_ckpt = bool(torch.equal(yc, y) and torch.equal(gxc, gx) and torch.equal(gsc, gs)) and \
            all(torch.equal(grads[n], _local(p.grad)) for n, p in ow.items())
        out[(policy, dtype)] = {
            "err": {k: (v, titan_err[k]) for k, v in err.items()}, "moved": moved,
            "derived": (watch.made, watch.alive_at_backward, watch.alive_after_backward),
            "checkpoint_equal": same_ckpt, "out_dtype": y.dtype, "act": act, "cls": type(inner).__name__,
            "params": [(n, type(p).__name__, tuple(p.shape), p.dtype) for n, p in ow.items()],
            "titan_params": [(n, type(p).__name__, tuple(p.shape), p.dtype) for n, p in tw.items()],
            "state_dict": sorted(moe.state_dict()) == sorted(titan.state_dict()),
            "repr": repr(inner)}
        inner.close()
    return out


def _tail_case(rank: int) -> dict:
    """Rows past the counts (a dispatcher's padding at the tail): computed as without them, and zeros."""
    pd, _ = _dims("partial_dtensor")
    moe = _build(_config(policy="feplb-split", gpus_per_node=2, dtype="float32", **OPTS))
    moe.parallelize(pd)
    inner = moe.routed_experts.inner_experts
    L = E // WORLD
    counts = torch.tensor([5 + rank, 0][:L] + [1] * (L - 2))
    rows = torch.randn(int(counts.sum()), D, generator=torch.Generator().manual_seed(3 + rank))
    y = inner(rows, counts)
    padded = inner(torch.cat([rows, torch.randn(3, D)]), counts)
    # a copy after the first forward: the parameters, not FEPLB's layer (threads, process groups)
    import copy

    twin = copy.deepcopy(inner)
    copied = twin.engine is None and inner.engine is not None and all(
        torch.equal(_local(a), _local(b)) for a, b in zip(twin.parameters(), inner.parameters(), strict=True))
    # an optimizer step on the DTensor parameters between a forward and its backward: the backward, which derives
    # the joined weights again, raises (on every rank: all stepped)
    out = inner(rows.requires_grad_(), counts)
    with torch.no_grad():
        inner.w3_EFD.mul_(2)
    stepped = error_of(lambda: out.sum().backward())
    inner.close()
    return {"same": bool(torch.equal(padded[:len(rows)], y)), "tail_zero": bool((padded[len(rows):] == 0).all()),
            "shape": tuple(padded.shape), "copied": copied, "stepped": stepped}


def _typecheck_case(rank: int) -> dict:
    """torchtitan's SPMD type checking on (--debug.spmd_typechecking, spmd_types backend): against fp64."""
    pd, _ = _dims("spmd_types")
    from torchtitan.distributed import utils as tdu

    ctx = tdu.get_spmd_context(parallel_dims=pd, spmd_typechecking=True)
    full = _full_weights()
    x, scores, ids = _inputs(rank)
    g = torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(7 + rank))
    want_w, yr, gxr, gsr = _reference(rank, full, x, scores, ids, g)
    moe = _build(_config(policy="feplb-split", gpus_per_node=2, dtype="float32", **OPTS))
    moe.parallelize(pd)
    inner = moe.routed_experts.inner_experts
    y, gx, gs = _run(moe, ctx, x, scores, ids, g)
    L, lo = E // WORLD, rank * (E // WORLD)
    err = {"out": _rel(y.detach(), yr), "x": _rel(gx, gxr), "scores": _rel(gs, gsr),
           **{n: _rel(_local(p.grad), want_w[n][lo:lo + L]) for n, p in inner.named_parameters()}}
    moved = _moved(inner)
    inner.close()
    return {"err": err, "moved": moved}


def _batch(rank: int, seed: int):
    """A micro-batch like ``_inputs``' (skewed toward the first experts), drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(*TOKENS, D, generator=g)
    p = torch.tensor([8.0, 6.0] + [1.0] * (E - 2))
    ids = torch.multinomial(p.expand(TOKENS[0] * TOKENS[1], E), K, generator=g).view(*TOKENS, K)
    return x, torch.rand(*TOKENS, K, generator=g) + 0.1, ids, torch.randn(*TOKENS, D, generator=g)


STEPS, MICRO, LR = 2, 2, 0.05


def _train_case(rank: int) -> dict:
    """SGD on torchtitan's DTensor shards through FEPLB (two accumulated micro-batches a step) against fp64 SGD."""
    pd, ctx = _dims("partial_dtensor")
    moe = _build(_config(policy="feplb-split", gpus_per_node=2, dtype="float32", **OPTS))
    moe.parallelize(pd)
    inner = moe.routed_experts.inner_experts
    opt = torch.optim.SGD([getattr(inner, n) for n in NAMES], lr=LR)
    start = {n: w.double() for n, w in _full_weights().items()}
    ref = dict(start)
    moved = 0
    for step in range(STEPS):
        opt.zero_grad()
        acc = {n: torch.zeros_like(w) for n, w in ref.items()}
        for mb in range(MICRO):
            x, scores, ids, g = _batch(rank, 100 + step * MICRO + mb)
            _run(moe, ctx, x, scores, ids, g)
            moved += _moved(inner)
            grads = _reference(rank, ref, x, scores, ids, g)[0]
            acc = {n: acc[n] + grads[n] for n in acc}
        opt.step()
        ref = {n: ref[n] - LR * acc[n] for n in ref}
    got = {n: getattr(inner, n).full_tensor() for n in NAMES}
    return {"err": {n: float((got[n].double() - ref[n]).abs().max() / (ref[n] - start[n]).abs().max())
                    for n in NAMES}, "moved": moved}


def _fsdp_case(rank: int) -> dict:
    """EP 2 (a node of 2 GPUs) x expert-FSDP 2 on torchtitan's mesh, FSDP2 sharding the expert shards again."""
    from torch.distributed.fsdp import fully_shard

    pd, ctx = _dims("partial_dtensor", dp_shard=WORLD, ep=2)
    full = _full_weights()
    x, scores, ids = _inputs(rank)
    g = torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(7 + rank))
    want_w, yr, gxr, gsr = _reference(rank, full, x, scores, ids, g)
    out = {}
    for name, cfg in (("titan", _config()),
                      ("ours", _config(policy="feplb-split", gpus_per_node=2, dtype="float32", **OPTS))):
        moe = _build(cfg)
        moe.parallelize(pd)
        inner = moe.routed_experts.inner_experts
        # freed after the forward and gathered again for the backward, as torchtitan's blocks are
        fully_shard(inner, mesh=pd.get_mesh("efsdp"), reshard_after_forward=True)
        with DerivedWeights() as watch:
            y, gx, gs = _run(moe, ctx, x, scores, ids, g, watch=watch)
        out[name + "_derived"] = (watch.made, watch.alive_at_backward, watch.alive_after_backward)
        # FSDP averages the gradients over expert-FSDP: two ranks holding the same experts, other tokens each
        out[name] = {"out": _rel(y.detach(), yr), "x": _rel(gx, gxr), "scores": _rel(gs, gsr),
                     **{n: _rel(p.grad.full_tensor(), want_w[n] / 2) for n, p in inner.named_parameters()}}
        out[name + "_placements"] = str(inner.w1_EFD.placements)
        if name == "ours":
            out["moved"] = _moved(inner)
            inner.close()
    return out


def _errors_case(rank: int) -> dict:
    """A rank built with other settings: the first forward raises on every rank, none waits."""
    pd, ctx = _dims("partial_dtensor")
    moe = _build(_config(policy="feplb-split", gpus_per_node=2, dtype="float32", **OPTS,
                         **({"dyn": 2} if rank == 1 else {})))
    moe.parallelize(pd)
    x, scores, ids = _inputs(rank)
    try:
        _run(moe, ctx, x, scores, ids, torch.ones(*TOKENS, D))
        got = "no error"
    except Exception as e:   # noqa: BLE001 - the message is the result
        got = f"{type(e).__name__}: {e}"
    moe = _build(_config(policy="feplb-split", gpus_per_node=3, **OPTS))
    try:
        moe.parallelize(pd)
        indivisible = "no error"
    except Exception as e:   # noqa: BLE001 - the message is the result
        indivisible = f"{type(e).__name__}: {e}"
    engine = moe.routed_experts.inner_experts.engine is None
    # a node's GPU count larger than the EP group: the error says what to pass
    larger = error_of(lambda: _build(_config(policy="feplb-split", gpus_per_node=8, **OPTS)).parallelize(pd))
    return {"differ": got, "engine": engine, "indivisible": indivisible, "node_larger": larger}


def _frozen_tokens_case(rank: int) -> dict:
    """Tokens needing no grad on any rank (everything below the experts frozen: fine-tuning the experts alone), the
    shards trainable: the experts' and the scores' gradients against the fp64 reference. The engine holds no
    parameters (its weights are joined from the module's shards each forward): before, the layer took nothing it
    read for needing grad, computed without a graph on every rank, and the shards got no gradient, silently."""
    pd, ctx = _dims("partial_dtensor")
    full = _full_weights("qwen3")
    x, scores, ids = _inputs(rank)
    g = torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(7 + rank))
    want_w, yr, _, gsr = _reference(rank, full, x, scores, ids, g)
    L, lo = E // WORLD, rank * (E // WORLD)
    moe = _build(_config(policy="feplb-split", gpus_per_node=2, dtype="float32", **OPTS))
    moe.parallelize(pd)
    inner = moe.routed_experts.inner_experts
    ss = scores.clone().requires_grad_()
    with ctx():
        y = moe.routed_experts(x.clone(), ss, ids, torch.bincount(ids.reshape(-1), minlength=E))
    y.backward(g)
    out = {"out": _rel(y.detach(), yr), "scores": _rel(ss.grad, gsr), "moved": _moved(inner),
           **{n: None if p.grad is None else _rel(_local(p.grad), want_w[n][lo:lo + L])
              for n, p in inner.named_parameters()}}
    inner.close()
    return out


def _worker(rank: int, world: int) -> dict:
    _cpu_torchtitan()
    return {"routed": {(b, a): _routed_case(rank, b, a) for b in BACKENDS for a in ("qwen3", "gpt_oss")
                       if a == "qwen3" or b == "partial_dtensor"},
            "tail": _tail_case(rank), "typecheck": _typecheck_case(rank), "train": _train_case(rank),
            "fsdp": _fsdp_case(rank), "errors": _errors_case(rank), "frozen tokens": _frozen_tokens_case(rank)}


@pytest.fixture(scope="module")
def four_ranks():
    return run_dist(_worker, WORLD, timeout_s=300, collective_timeout_s=120)


def test_routed_experts_behind_torchtitans_dispatch(four_ranks):
    for r, res in enumerate(four_ranks):
        for (backend, arch), cases in res["routed"].items():
            for (policy, dtype), case in cases.items():
                where = f"rank {r}, {backend}, {arch}, {policy}, {dtype}"
                for what, (ours, titan) in case["err"].items():
                    if dtype == "float32":
                        assert ours <= 1e-5, f"{where}: {what} off the fp64 reference by {ours:.2e} (relative)"
                    else:   # bf16 GEMMs on both sides (measured at most 1.77x torchtitan's error)
                        # GPT-OSS's bias gradients: torchtitan sums them in fp32 (its biases repeat in fp32 before
                        # the cast), FEPLB in bf16, as its experts add the cast bias (measured 1.99x, 3.6e-3):
                        # within bf16's rounding of the largest element
                        bound = max(2 * titan, 2 ** -7) if "bias" in what else 2 * titan
                        assert ours <= bound, (f"{where}: {what} off the fp64 reference by {ours:.2e}, "
                                               f"torchtitan's own by {titan:.2e}")
                assert case["out_dtype"] == case["act"], where
                # balancing moved rows (skewed routing, 2 nodes of 2), and none without a policy
                assert (case["moved"] > 0) == (policy != "none"), f"{where}: {case['moved']} rows moved"
                assert case["checkpoint_equal"], f"{where}: a checkpointed forward differs"
                # the join ([w1 | w3] in the layer's dtype; w2 too, cast) is derived again in the backward
                made, alive, after = case["derived"]
                # (GPT-OSS in fp32: its parameters are the weights, nothing is derived)
                assert made == {"qwen3": {"float32": 1, "bfloat16": 2},
                                "gpt_oss": {"float32": 0, "bfloat16": 4}}[arch][dtype], where
                assert alive == [0], f"{where}: {alive} derived weights kept between the forward and the backward"
                assert after == [0], f"{where}: {after} recipes (weights derived again) held after the backward"
                # torchtitan's parameters, untouched: names, types (DTensor or local shard), shapes, dtype
                assert case["params"] == case["titan_params"] and case["state_dict"], where
                kind = "DTensor" if backend == "partial_dtensor" else "Parameter"
                L = E // WORLD
                lead = E if kind == "DTensor" else L
                shapes = ((FF, D), (D, FF), (FF, D)) if arch == "qwen3" else ((2 * FF, D), (2 * FF,), (D, FF), (D,))
                assert [p[1:3] for p in case["params"]] == [(kind, (lead, *s)) for s in shapes], where
                assert case["cls"] == ("FEPLBGroupedExperts" if arch == "qwen3" else "FEPLBGptOssGroupedExperts")
                assert f"policy='{policy}', gpus_per_node=2, dtype={dtype}" in case["repr"], case["repr"]


def test_experts_train_behind_tokens_that_need_no_grad(four_ranks):
    for r, res in enumerate(four_ranks):
        case = res["frozen tokens"]
        for what in ("out", "scores", *NAMES):
            assert case[what] is not None and case[what] <= 1e-5, (r, what, case[what])
    assert four_ranks[0]["frozen tokens"]["moved"] > 0


def test_rows_past_the_counts_come_back_as_zeros(four_ranks):
    for r, res in enumerate(four_ranks):
        assert res["tail"]["same"] and res["tail"]["tail_zero"], (r, res["tail"])
        assert res["tail"]["copied"], r
        stepped = res["tail"]["stepped"]
        assert stepped is not None and "w3_EFD (the DTensor) [8, 48, 32] was modified in place" in stepped, stepped
        assert "seen as the layer's output gradient arrived" in stepped, stepped   # (before the layer's backward)


def test_under_spmd_type_checking(four_ranks):
    for r, res in enumerate(four_ranks):
        case = res["typecheck"]
        assert case["moved"] > 0, r
        for what, err in case["err"].items():
            assert err <= 1e-5, f"rank {r}: {what} off the fp64 reference by {err:.2e} (relative)"


def test_training_on_torchtitans_shards(four_ranks):
    for r, res in enumerate(four_ranks):
        case = res["train"]
        assert case["moved"] > 0, r
        for n, err in case["err"].items():
            # fp32 against fp64 SGD, relative to the whole update (lost or doubled gradients are off by >= 0.5)
            assert err <= 3e-5, f"rank {r}: {n} off fp64 SGD by {err:.2e} of the update"


def test_under_fsdp(four_ranks):
    for r, res in enumerate(four_ranks):
        case = res["fsdp"]
        assert case["moved"] > 0, r
        assert "Shard(dim=0)" in case["ours_placements"] and case["ours_placements"] == case["titan_placements"]
        # the join derived again from the parameters FSDP gathered again for the backward
        assert case["ours_derived"] == (1, [0], [0]) and case["titan_derived"] == (0, [0], [0]), r
        for what, err in case["titan"].items():   # the reference, checked: torchtitan's own bf16 experts
            assert err <= 2e-2, f"rank {r}: torchtitan's {what} off the reference by {err:.2e}"
        for what, err in case["ours"].items():
            assert err <= 1e-5, f"rank {r}: {what} off the fp64 reference by {err:.2e} (relative)"


def test_ranks_with_other_settings_raise_together(four_ranks):
    for r, res in enumerate(four_ranks):
        got = res["errors"]["differ"]
        assert got.startswith("ValueError") and "same config" in got, f"rank {r}: {got}"
        assert res["errors"]["engine"], r
        got = res["errors"]["indivisible"]
        assert got.startswith("ValueError") and "gpus_per_node=3 does not divide" in got, f"rank {r}: {got}"
        got = res["errors"]["node_larger"]
        assert got is not None and "gpus_per_node=8 does not divide" in got and "is gpus_per_node=4)" in got, (r, got)


# ------------------------------------------------------------------------------------------- without processes

@pytest.mark.parametrize("settings, kind, words", [
    ({"weights": "per-step"}, TypeError, "['weights'] come from the experts module"),
    ({"top_k": 2}, TypeError, "['top_k'] come from the experts module"),
    ({"polcy": "feplb"}, TypeError, "unknown FEPLBConfig field(s) ['polcy']"),
    ({"policy": "feplb-split+place"}, ValueError, "+place puts experts on other GPUs"),
    ({"policy": "eplb"}, ValueError, "'eplb' moves where tokens are dispatched"),
    ({"dtype": "float64"}, ValueError, "dtype 'float64'; expected one of"),
    ({"gpus_per_node": 0}, ValueError, "gpus_per_node"),
    ({"policy": "no-such-policy"}, ValueError, "no-such-policy"),
    ({"gpus_per_node": None}, TypeError, "gpus_per_node is required"),
])
def test_settings_refused_at_config_time(settings, kind, words):
    import feplb.titan_ep as fte

    cfg = _config()
    settings = {k: v for k, v in {"gpus_per_node": 2, **settings}.items() if v is not None}
    with pytest.raises(kind) as err:
        fte.convert(cfg, **settings)
    assert words in str(err.value), str(err.value)
    assert type(cfg.routed_experts.inner_experts).__name__ == "Config" and \
        type(cfg.routed_experts.inner_experts).__qualname__ == "GroupedExperts.Config"   # nothing replaced


def test_torchtitans_override_mechanism():
    """``--override.imports 'feplb.titan_ep.feplb_experts={...}'`` as torchtitan parses and applies it."""
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports

    import feplb.titan_ep as fte

    settings = {"policy": "feplb-split", "gpus_per_node": 2}
    imports = parse_cli_imports(['feplb.titan_ep.feplb_experts={"policy": "feplb-split", "gpus_per_node": 2}'])
    assert imports == [("feplb.titan_ep.feplb_experts", settings)]
    cfg = _config()
    lines = apply_overrides(OverrideConfig(imports=imports), cfg)
    inner = cfg.routed_experts.inner_experts
    assert type(inner) is fte.FEPLBGroupedExperts.Config and inner.feplb == settings
    assert len(lines) == 1 and "routed_experts.inner_experts" in lines[0], lines
    # the module holds what GroupedExperts holds, initialised alike: same names, shapes, values
    ours, theirs = _build(cfg), _build(_config())
    assert type(ours.routed_experts.inner_experts) is fte.FEPLBGroupedExperts
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert ours.routed_experts.inner_experts.num_experts == E
    # a setting FEPLB cannot run fails the override, at config time
    with pytest.raises(TypeError, match="weights"):
        apply_overrides(OverrideConfig(imports=[("feplb.titan_ep.feplb_experts", {"weights": "per-step"})]),
                        _config())



def test_converting_twice():
    """convert() and the feplb_experts override both applied (the override matches FEPLB's own config, a subclass):
    with the same settings the config stays as it is; with others both are named (it said FEPLB's own experts were
    ones it does not compute)."""
    from torchtitan.config.override import OverrideConfig, apply_overrides

    import feplb.titan_ep as fte

    settings = {"policy": "feplb-split", "gpus_per_node": 2}
    cfg = _config()
    fte.convert(cfg, **settings)
    inner = cfg.routed_experts.inner_experts
    assert fte.convert(cfg, **settings) == ["routed_experts.inner_experts"]
    assert cfg.routed_experts.inner_experts is inner and inner.feplb == settings
    apply_overrides(OverrideConfig(imports=[("feplb.titan_ep.feplb_experts", settings)]), cfg)
    assert cfg.routed_experts.inner_experts is inner
    for again in (lambda: fte.convert(cfg, policy="feplb", gpus_per_node=2),
                  lambda: fte.feplb_experts(inner, policy="feplb", gpus_per_node=2)):
        with pytest.raises(ValueError, match=r"converted to FEPLB's already, with settings \{'policy': 'feplb-split'"
                                             r".*given \{'policy': 'feplb'.*apply one of them"):
            again()
    assert cfg.routed_experts.inner_experts is inner


def test_parallelize_refuses_an_ep_group_feplb_cannot_balance():
    """An expert_parallel_degree that does not divide the experts, or that gpus_per_node does not divide: refused
    by name at parallelize (torchtitan's dispatch failed at the first forward with a reshape error)."""
    import feplb.titan_ep as fte

    class Mesh:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    class Dims:
        def __init__(self, n):
            self.n = n

        def get_optional_mesh(self, name):
            return Mesh(self.n) if name == "ep" else None

    mod = _config(policy="feplb-split", gpus_per_node=2).routed_experts.inner_experts.build()
    assert isinstance(mod, fte.FEPLBGroupedExperts) and E == 8
    with pytest.raises(ValueError, match=f"expert_parallel_degree 6 does not divide the {E} experts"):
        mod.parallelize(Dims(6))
    with pytest.raises(ValueError, match="gpus_per_node=2 does not divide torchtitan's EP group \\(1 ranks\\)"):
        mod.parallelize(Dims(1))
    assert mod._ep_mesh is None

def test_experts_feplb_does_not_compute_are_refused():
    """Another GroupedExperts subclass (a low-precision one, say), a swapped grouped GEMM (low-precision converters)
    and a GPT-OSS clamp that is no number > 0; GPT-OSS's experts themselves convert."""
    from dataclasses import dataclass

    from torchtitan.models.common.moe import GroupedExperts

    import feplb.titan_ep as fte

    cfg = _config("gpt_oss")
    assert fte.convert(cfg, policy="feplb-split", gpus_per_node=2) == ["routed_experts.inner_experts"]
    assert type(cfg.routed_experts.inner_experts) is fte.FEPLBGptOssGroupedExperts.Config
    cfg.routed_experts.inner_experts.swiglu_limit = -1.0
    with pytest.raises(ValueError, match="swiglu_limit -1.0; expected a number > 0"):
        cfg.routed_experts.inner_experts.build()

    class Scaled(GroupedExperts):
        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            scale: float = 1.0

    cfg = _config()
    cfg.routed_experts.inner_experts = Scaled.Config(dim=D, hidden_dim=FF, num_experts=E)
    with pytest.raises(ValueError, match="got .*Scaled.Config, whose experts FEPLB does not compute"):
        fte.convert(cfg, policy="feplb-split", gpus_per_node=2)
    assert type(cfg.routed_experts.inner_experts) is Scaled.Config
    with pytest.raises(ValueError, match="found no GroupedExperts.Config"):
        fte.convert(_config().router, policy="feplb-split", gpus_per_node=2)

    class Quantized(fte.FEPLBGroupedExperts):
        def _grouped_mm(self, *, A, B_t, offs):
            return torch._grouped_mm(A, B_t, offs=offs)

    conf = _config(policy="feplb-split", gpus_per_node=2).routed_experts.inner_experts
    with pytest.raises(TypeError, match="grouped GEMM was replaced"):
        Quantized(conf)
    mod = conf.build()
    mod._grouped_mm = lambda **kw: None   # swapped on the instance after the build
    with pytest.raises(TypeError, match="grouped GEMM was replaced"):
        mod(torch.randn(3, D), torch.tensor([3] + [0] * (E - 1)))


def test_expert_parallelism_off_raises():
    """Built but never parallelized with EP: nothing to balance, said at the first forward."""
    import feplb.titan_ep as fte

    mod = _config(policy="feplb-split", gpus_per_node=2).routed_experts.inner_experts.build()
    assert isinstance(mod, fte.FEPLBGroupedExperts)
    with pytest.raises(RuntimeError, match="expert_parallel_degree > 1"):
        mod(torch.randn(3, D), torch.tensor([3] + [0] * (E - 1)))
    assert mod.engine is None


def test_fullgraph_compile_says_why_not():
    """torchtitan compiles its blocks with fullgraph=True: the error names the reason."""
    mod = _config(policy="feplb-split", gpus_per_node=2).routed_experts.inner_experts.build()
    with pytest.raises(Exception, match="FEPLB's forward plans on the host"):
        torch.compile(mod, fullgraph=True, backend="eager")(torch.randn(3, D), torch.tensor([3] + [0] * (E - 1)))


def test_cuda_graph_capture_refused(monkeypatch):
    """torchtitan captures some EP dispatchers in CUDA graphs unless told not to: FEPLB says so (the refusal path;
    a capture itself needs a GPU)."""
    import feplb.titan_ep as fte

    monkeypatch.setattr(fte, "_capturing", lambda: True)
    mod = _config(policy="feplb-split", gpus_per_node=2).routed_experts.inner_experts.build()
    with pytest.raises(RuntimeError, match="--training.disable_cuda_graphs"):
        mod(torch.randn(3, D), torch.tensor([3] + [0] * (E - 1)))


def _selective_first_forward_case(rank: int, world: int) -> dict:
    """torchtitan's op-level SelectiveAC around the experts and an op it saves (``aten.max``), the FEPLB layer made
    by the first forward, inside that region: the recompute is handed the forward's own ops' outputs (none of the
    layer's construction: its agreement's collectives and max, on CUDA its device-to-host copies, which torchtitan's
    policy saves), bit for bit the module without checkpointing."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    _cpu_torchtitan()
    pd, ctx = _dims("partial_dtensor")
    mods = []
    for _ in range(2):
        moe = _build(_config("qwen3", policy="feplb-split", gpus_per_node=2, dtype="float32", **OPTS))
        moe.parallelize(pd)
        mods.append(moe)

    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, x, scores, ids, counts):
            y = self.moe.routed_experts(x, scores, ids, counts)
            return y / y.abs().max()

    plain, selective = Block(mods[0]), SelectiveAC(SelectiveAC.Config())._wrap_block(Block(mods[1]))
    out = {"equal": [], "moved": 0}
    for mb in range(2):
        x, scores, ids = _inputs(rank + 10 * mb)
        g = torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(7 + rank + mb))
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        got = []
        for block, moe in ((plain, mods[0]), (selective, mods[1])):
            xx, ss = x.clone().requires_grad_(), scores.clone().requires_grad_()
            with ctx():
                y = block(xx, ss, ids, counts)
            y.backward(g)
            inner = moe.routed_experts.inner_experts
            got.append([y.detach(), xx.grad, ss.grad] + [_local(p.grad).clone() for p in inner.parameters()])
            for p in moe.parameters():
                p.grad = None
        out["equal"].append(all(torch.equal(a, b) for a, b in zip(*got, strict=True)))
        out["moved"] += _moved(mods[1].routed_experts.inner_experts)
    for moe in mods:
        moe.routed_experts.inner_experts.close()
    return out


def test_selective_ac_with_the_layer_made_inside_its_region():
    for r, res in enumerate(run_dist(_selective_first_forward_case, WORLD, timeout_s=300, collective_timeout_s=120)):
        assert res["equal"] == [True, True], (r, res)
        assert res["moved"] > 0, (r, res)
