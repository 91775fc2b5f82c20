"""feplb.megatron on Megatron-Core's own MoELayer (router, allgather token dispatcher, SequentialMLP experts with
SwiGLU; a softmax router, and a sigmoid router with expert groups, a scaling factor, a load-balancing bias and
shared experts), expert-parallel over 1 gloo rank and over 4 as 2 nodes x 2, balancing on (feplb-split, rows really
move) and off.

* The reference is Megatron's own expert-parallel MoELayer, built with the same weights on the same ranks (every
  expert initialised from its global index, so a mix-up of experts between ranks shows): the output and every
  gradient (input, router, local experts) in fp32 within the project's exactness criterion (1e-5 of each tensor's
  largest element); in bf16 within twice the error Megatron's own bf16 layer makes against its fp32 one.
* Training with the policies that keep expert copies on other GPUs (replicas, placed experts), gradient
  accumulation over micro-batches (also two forwards before their backwards, as pipeline schedules run them) and the
  per-step calls: the final weights against Megatron's layer trained alike.
* ``full_state_dict`` names every expert by its global index with its weights; Megatron's ``sharded_state_dict`` (what
  its distributed checkpoints store and load) is exactly that of Megatron's own layer; a non-reentrant
  ``torch.utils.checkpoint`` of the layer gives the same gradients; what FEPLB cannot run is refused by name on every
  rank before anything is replaced.

Megatron's own DistributedOptimizer (``get_megatron_optimizer``, on the CPU through ``_cpu_megatron_optimizer``) at EP 2
x expert data parallelism 2, fp32 and bf16, with per-step copies: the expert gradients against Megatron's model, and
a forgotten ``refresh_replicas`` refused, also for a layer none of whose experts is in this rank's optimizer shard.

Megatron's DistributedDataParallel around both layers (its grad buffers, with and without overlap_grad_reduce): the
gradients it reduces match Megatron's layer's, also for per-step expert copies reduced before its reduction; and its
own activation recompute of the MoE layer (``recompute_modules=["moe"]``, a reentrant checkpoint) with two forwards
before their backwards.

Expert biases (``add_bias_linear``, every expert's a function of its global index): the layer (fp32, bf16),
training, DDP and the state dicts, with SequentialMLP at 4 ranks (Megatron's own cannot run its backward with biases
at EP = 1 and TP = 1) and TEGroupedMLP at 1 and 4.

Megatron's grouped experts, TEGroupedMLP and the legacy GroupedMLP (``moe_grouped_gemm=True``), run through the same
cases: the layer, training, DDP, the state dicts (also with expert data parallelism), hooks. A whole GPTModel of two
MoE layers (Megatron's local spec) trains as Megatron's does.

Behind Megatron's own token dispatcher (``token_dispatcher="megatron"``: its alltoall and allgather dispatchers
kept, FEPLB balancing the rows they deliver), at 4 ranks as 2 nodes x 2: against Megatron's layer with the same
dispatcher, the layer in fp32 (both routers, the three experts layouts, expert biases, probabilities on the input,
capacity drops, an fp64 router) and bf16, training with per-micro-batch and per-step copies, Megatron's DDP, its
recompute, a non-reentrant checkpoint, a whole GPT model; the policies it cannot follow, a dispatcher that differs
between ranks and wrong arguments on one rank refused on every rank.

Megatron-Core expects CUDA where its CPU path reaches: the router moves its weight (and DDP its grad buffers) to
``torch.cuda.current_device()``, its gating GEMM names Transformer Engine's GEMM, which it imports only when
Transformer Engine is installed, and its checkpoint saves and restores the CUDA RNG state. The gloo workers point
the first at the CPU, define the second as absent and make the third a no-op (``_cpu_megatron``). The legacy
GroupedMLP's grouped GEMM (the CUDA-only ``grouped_gemm`` package) becomes one matmul per expert, and Megatron's
``torch.compile``'d functions (``megatron.core.jit.jit_fuser``: activations, fused GeGLU, the router's expert bias) the
plain functions they wrap; TEGroupedMLP gets a stand-in of Transformer Engine's grouped
linear (no CPU build); the alltoall dispatcher's host copies of its split sizes (on a side CUDA stream) become
plain numpy conversions. Nothing of feplb is patched."""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core.transformer.moe.moe_layer")

from feplb.testing import DerivedWeights, error_of, run_dist  # noqa: E402

pytestmark = pytest.mark.dist

H, FF, E, K = 32, 48, 8, 2
TOKENS = (12, 2)   # Megatron's [S, B] per rank
OPTS = dict(min_chunk=1, plan_wait_ms=60_000, min_straggler_rows=0)


def _cpu_megatron(world: int) -> None:
    """Megatron's parallel state over this gloo job (EP = every rank), and its CUDA-only spots on the CPU."""
    import megatron.core.tensor_parallel.random as mr
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as mu
    import megatron.core.transformer.moe.token_dispatcher as td
    from megatron.core import parallel_state as ps

    torch.cuda.current_device = lambda: "cpu"
    if not hasattr(mu, "te_general_gemm"):
        mu.te_general_gemm = None
    mr._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)
    mr._set_cuda_rng_state = lambda *a, **k: None
    # the legacy GroupedMLP's grouped GEMM (the CUDA-only grouped_gemm package) as one matmul per expert
    gg.grouped_gemm = gg.ops = SimpleNamespace(gmm=_gmm)
    # Megatron-Core's jit_fuser functions (torch.compile'd: activations, GroupedMLP's, the router's expert bias,
    # fused GeGLU and squared ReLU, the flex dispatcher's preprocessing) run as the plain functions they wrap:
    # Inductor compiling each one in every rank cost about a third of this file's CPU time, and none is FEPLB's
    torch._dynamo.config.disable = True
    # the alltoall token dispatcher moves its split sizes to the host on a side CUDA stream: on the CPU they are on
    # the host already, and become the numpy arrays its all-to-all takes
    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = SimpleNamespace()
    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _splits_on_host
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)


@contextlib.contextmanager
def _cpu_shared_expert_stream():
    """``moe_shared_expert_overlap``'s side CUDA stream on the CPU, where every op runs in order: a stream whose
    waits are nothing. Megatron's SharedExpertMLP makes its stream at construction unless its class has one."""
    import megatron.core.transformer.moe.shared_experts as mse

    side = SimpleNamespace(wait_stream=lambda other: None)
    saved = mse.SharedExpertMLP.stream, torch.cuda.current_stream
    mse.SharedExpertMLP.stream, torch.cuda.current_stream = side, lambda *a, **k: side
    try:
        yield
    finally:
        mse.SharedExpertMLP.stream, torch.cuda.current_stream = saved


def _cpu_deepep() -> None:
    """The flex token dispatcher's DeepEP backend (CUDA only) as a gloo stand-in with DeepEP's contract, as
    Megatron's ``fused_a2a`` wraps it: ``fused_dispatch`` sends each token once to every rank holding one of its
    experts (in token order per source rank) and returns the received rows, their top-k ids as local expert indices
    (-1 where another rank's, or dropped), their fp32 probabilities, the tokens per local expert as a host tensor,
    and a handle; ``fused_combine`` sums each token's returned rows at its source (in fp32, rounded once). Both
    differentiate as DeepEP's do (the backward of one is the other; the probabilities' gradients summed back over the
    ranks that received the token). Real DeepEP combines bf16 rows only: the fp32 cases check the contract, not a
    set-up DeepEP runs."""
    import megatron.core.transformer.moe.token_dispatcher as td

    td.fused_dispatch = lambda x, idx, probs, num_experts, group, async_finish=False, allocate_on_comm_stream=False: \
        _DeepEPDispatch.apply(x.contiguous(), idx, probs, num_experts, group)
    td.fused_combine = lambda x, group, handle, async_finish=False, allocate_on_comm_stream=False: \
        (_DeepEPCombine.apply(x, group, handle), None)
    td.set_deepep_num_sms = lambda num_sms: None


def _a2a_rows(t: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    out = t.new_empty((sum(recv), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), recv, send, group=group)
    return out


class _DeepEPDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, idx, probs, num_experts, group):
        import torch.distributed as dist

        assert idx.dtype == torch.int64 and probs.dtype == torch.float32, (idx.dtype, probs.dtype)   # DeepEP's
        W = dist.get_world_size(group)
        L = num_experts // W
        dest = torch.where(idx >= 0, idx.div(L, rounding_mode="floor"), -1)   # [T, K] the rank of each slot
        rows = [torch.nonzero((dest == r).any(dim=1)).flatten() for r in range(W)]
        sent = torch.cat(rows)
        to = torch.cat([torch.full((len(t),), r) for r, t in enumerate(rows)])   # each sent row's rank
        send = [len(t) for t in rows]
        counts = torch.tensor(send)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
        recv = got.tolist()
        mine = dest[sent] == to[:, None]
        local = torch.where(mine, idx[sent] - to[:, None] * L, -1)
        recv_x = _a2a_rows(x[sent], send, recv, group)
        recv_idx = _a2a_rows(local, send, recv, group)
        recv_probs = _a2a_rows(torch.where(mine, probs[sent].float(), 0.0), send, recv, group)
        per_expert = torch.bincount(recv_idx[recv_idx >= 0], minlength=L).tolist()
        handle = (sent, send, recv, x.shape[0])
        ctx.handle, ctx.group = handle, group
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_probs, torch.tensor(per_expert), handle

    @staticmethod
    def backward(ctx, g_x, g_idx, g_probs, g_counts, g_handle):
        sent, send, recv, T = ctx.handle
        gx = _sum_home(_a2a_rows(g_x, recv, send, ctx.group), sent, T)
        gp = None if g_probs is None else _sum_home(_a2a_rows(g_probs.float(), recv, send, ctx.group), sent, T)
        return gx, None, gp, None, None


def _sum_home(back: torch.Tensor, sent: torch.Tensor, T: int) -> torch.Tensor:
    """Each token's returned rows summed at its source, in fp32 and rounded once, as DeepEP's combine adds them."""
    return back.new_zeros((T, back.shape[1]), dtype=torch.float32).index_add_(0, sent, back.float()).to(back.dtype)


class _DeepEPCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, handle):
        sent, send, recv, T = handle
        ctx.handle, ctx.group = handle, group
        return _sum_home(_a2a_rows(y, recv, send, group), sent, T)

    @staticmethod
    def backward(ctx, g):
        sent, send, recv, _ = ctx.handle
        return _a2a_rows(g[sent], send, recv, ctx.group), None, None


def _splits_on_host(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on the CPU: at its host-copy point the split sizes
    become numpy arrays (as its CUDA path makes them); there is no stream to synchronise."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm.ops.gmm: rows of expert i (batch_sizes [L], in order) times b[i] [in, out]."""
    assert not trans_b
    return torch.cat([x @ w for x, w in zip(a.split(batch_sizes.tolist()), b, strict=True)])


class TEColumnParallelGroupedLinear(nn.Module):
    """What TEGroupedMLP needs of Transformer Engine's grouped linear (which has no CPU build), with its parameter
    layout (expert i's weight as ``weight{i}`` [out, in], its bias as ``bias{i}`` [out], one empty
    ``_extra_state`` without fp8), its biases (added, or returned one per expert with ``skip_bias_add``) and its
    sharded state dict's scheme (each weight and bias under the key SequentialMLP's experts share, offset by its
    global expert index)."""

    TP_AXES = {"weight": 0, "bias": 0}

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name=None, pg_collection=None) -> None:
        super().__init__()
        assert is_expert
        self.num_gemms, self.ep, self.bias, self.skip_bias_add = num_gemms, pg_collection.ep, bias, skip_bias_add
        for i in range(num_gemms):
            w = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(w)
            w.allreduce = False
            self.register_parameter(f"weight{i}", w)
        for i in range(num_gemms) if bias else ():
            b = nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
            b.allreduce = False
            self.register_parameter(f"bias{i}", b)

    def forward(self, x: torch.Tensor, m_splits: list[int]):
        out = torch.cat([xi @ getattr(self, f"weight{i}").T + (getattr(self, f"bias{i}") if self.bias and
                                                                  not self.skip_bias_add else 0)
                         for i, xi in enumerate(x.split(m_splits))])
        return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.bias and \
            self.skip_bias_add else None

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """As Megatron's wrapper of Transformer Engine's grouped linear makes it (without the extra state): each
        expert's weight (and bias) under the key SequentialMLP's experts share, its global expert index a prepended
        axis, tensor-parallel along ``TP_AXES``, replicated over the expert data-parallel group."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        L, ep_axis = self.num_gemms, len(sharded_offsets)
        first, edp = dist.get_rank(self.ep) * L, ps.get_expert_data_parallel_rank()
        kinds = ("weight", "bias") if self.bias else ("weight",)
        out = {}
        for i in range(L):
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.{k}": getattr(self, f"{k}{i}") for k in kinds}, "",
                {f"{i}.{k}": axis for k, axis in self.TP_AXES.items()},
                (*sharded_offsets, (ep_axis, first + i, dist.get_world_size(self.ep) * L)),
                tp_group=ps.get_expert_tensor_parallel_group(), dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            for k in kinds:
                t = sub[f"{i}.{k}"]
                t.replica_id = (*t.replica_id[:2], edp)
                out[f"{prefix}{k}{i}"] = t
        return out


class TERowParallelGroupedLinear(TEColumnParallelGroupedLinear):
    TP_AXES = {"weight": 1}


def _expert_weights(e: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (linear_fc1 [2F, H], linear_fc2 [H, F]), a function of e alone."""
    g = torch.Generator().manual_seed(1000 + e)
    return ((torch.randn(2 * FF, H, generator=g) * 0.2).to(dtype),
            (torch.randn(H, FF, generator=g) * 0.2).to(dtype))


def _expert_biases(e: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (linear_fc1.bias [2F], linear_fc2.bias [H]) with ``add_bias_linear``, a function of e alone (not
    Megatron's zeros, so a bias lost or taken from another expert shows)."""
    g = torch.Generator().manual_seed(2000 + e)
    return (torch.randn(2 * FF, generator=g) * 0.3).to(dtype), (torch.randn(H, generator=g) * 0.3).to(dtype)


def make_moe(arch: str = "softmax", dtype: torch.dtype = torch.float32, experts: str = "sequential",
             copy_weights: bool = True, **over):
    """A Megatron-Core MoELayer of this rank's experts (E / EP of them), every expert's weights a function of its
    global index, the router the same on every rank. experts: Megatron's SequentialMLP ("sequential"), legacy
    GroupedMLP ("grouped") or TEGroupedMLP ("te"); copy_weights=False keeps Megatron's own initialisation (expert
    tensor parallelism shards the weights this would copy whole)."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64, moe_ffn_hidden_size=FF,
              num_moe_experts=E, moe_router_topk=K, use_cpu_initialization=True, params_dtype=dtype,
              bf16=dtype == torch.bfloat16, moe_token_dispatcher_type="allgather", gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, moe_router_load_balancing_type="none",
              expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), moe_router_dtype="fp32")
    if arch == "sigmoid":
        kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
                  moe_shared_expert_intermediate_size=FF)
    if experts != "sequential":
        # the legacy GroupedMLP's forward asserts bf16 training (its parameters may be fp32)
        kw.update(moe_grouped_gemm=True, bf16=True)
    kw.update(over)
    cfg = TransformerConfig(**kw)
    torch.manual_seed(0)
    subs = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=experts != "sequential").submodules.mlp.submodules
    if experts == "te":
        subs = dataclasses.replace(subs, experts=ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear)))
    moe = MoELayer(cfg, subs)
    assert type(moe.experts).__name__ == {"sequential": "SequentialMLP", "grouped": "GroupedMLP",
                                          "te": "TEGroupedMLP"}[experts]
    with torch.no_grad():
        for i, e in enumerate(moe.local_expert_indices if copy_weights else ()):
            w1, w2 = _expert_weights(e, dtype)
            b1, b2 = _expert_biases(e, dtype)
            if experts == "sequential":
                m = moe.experts.local_experts[i]
                m.linear_fc1.weight.copy_(w1[:m.linear_fc1.weight.shape[0]])   # [F, H] without the gate
                m.linear_fc2.weight.copy_(w2)
                if cfg.add_bias_linear:
                    m.linear_fc1.bias.copy_(b1[:m.linear_fc1.bias.shape[0]])
                    m.linear_fc2.bias.copy_(b2)
            elif experts == "te":   # [2F, H], or [F, H] without the gate
                fc1 = getattr(moe.experts.linear_fc1, f"weight{i}")
                fc1.copy_(w1[:fc1.shape[0]])
                getattr(moe.experts.linear_fc2, f"weight{i}").copy_(w2)
                if cfg.add_bias_linear:
                    getattr(moe.experts.linear_fc1, f"bias{i}").copy_(b1[:fc1.shape[0]])
                    getattr(moe.experts.linear_fc2, f"bias{i}").copy_(b2)
            else:   # weight1 [H, L * 2F] holds expert i's [H, 2F] as its i-th block in memory, weight2 [L * F, H]
                L = moe.num_local_experts
                block = moe.experts.weight1.view(L, H, -1)[i]
                block.copy_(w1[:block.shape[1]].T)
                moe.experts.weight2.view(L, -1, H)[i].copy_(w2.T)
        # a router that prefers the first experts: skewed load, so feplb-split moves rows
        g = torch.Generator().manual_seed(5)
        w = torch.randn(E, H, generator=g) * 0.3
        w[:2] += 0.05
        moe.router.weight.copy_(w.to(moe.router.weight.dtype))
    return moe


def _inputs(rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(*TOKENS, H, generator=g) + 0.8    # the shift makes the first experts' logits larger
    return x.to(dtype), torch.randn(*TOKENS, H, generator=g).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in fp64 (max |got - want| when want is zero)."""
    diff, scale = (got.double() - want.double()).abs().max(), want.double().abs().max()
    return float(diff / scale) if scale else float(diff)


def _grads(moe, x: torch.Tensor, g: torch.Tensor, watch: DerivedWeights | None = None) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    y, bias = moe(x)
    assert bias is None
    if watch is not None:
        watch.at_backward(y)
    y.backward(g)
    if watch is not None:
        watch.after_backward()   # (y still held)
    out = {"out": y.detach(), "x": x.grad}
    for n, p in moe.named_parameters():
        out[n] = p.grad
    return out


def _moved(moe) -> int:
    import torch.distributed as dist

    s = moe.experts.last_stats
    t = torch.tensor([s.rows_moved if s is not None else 0])
    dist.all_reduce(t)
    return int(t)


def _layer_case(rank: int, world: int, arch: str, policy: str, dtype: torch.dtype,
                experts: str = "sequential", *, dispatcher: str = "feplb", **over) -> dict:
    """One forward and backward of ours and Megatron's layer; bf16 also against Megatron's fp32 layer. ``over``:
    TransformerConfig fields; ``dispatcher``: apply's token_dispatcher."""
    import feplb.megatron as fm

    moe, ref = make_moe(arch, dtype, experts, **over), make_moe(arch, dtype, experts, **over)
    params = list(moe.parameters())
    names = fm.apply(moe, policy=policy, gpus_per_node=min(2, world), token_dispatcher=dispatcher, **OPTS)
    x, g = _inputs(rank, dtype)
    with DerivedWeights() as watch:   # the experts' weights stacked per forward: derived again in the backward
        ours = _grads(moe, x, g, watch)
    theirs = _grads(ref, x, g)
    out = {"names": names, "same_names": list(ours) == list(theirs), "moved": _moved(moe),
           "derived": (watch.made, watch.alive_at_backward, watch.alive_after_backward),
           "out_dtype": ours["out"].dtype, "param_dtypes": sorted({str(p.dtype) for p in moe.parameters()}),
           "class": type(moe.experts).__name__, "dispatcher": type(moe.token_dispatcher).__name__,
           "same_params": all(p is q for p, q in zip(moe.parameters(), params, strict=True)),
           # (moe_shared_expert_overlap: the shared experts are the dispatcher's, ours as Megatron's)
           "shared_in_dispatcher": [getattr(m.token_dispatcher, "shared_experts", None) is m.shared_experts
                                    is not None for m in (moe, ref)]}
    if dtype == torch.float32:
        out["err"] = {n: _rel(ours[n], theirs[n]) for n in theirs}
    else:
        exact = _grads(make_moe(arch, torch.float32, experts, **over), x.float(), g.float())
        out["err"] = {n: (_rel(ours[n], exact[n]), _rel(theirs[n], exact[n])) for n in theirs}
    if over.get("moe_expert_capacity_factor") is not None:   # slots Megatron's router dropped at capacity
        with torch.no_grad():
            _, routing_map = ref.router(x)
        out["dropped"] = TOKENS[0] * TOKENS[1] * ref.config.moe_router_topk - int(routing_map.sum())
        if dispatcher == "feplb":
            # the rows FEPLB sent from this rank: the kept slots only (dropped ones are masked, not weighed 0)
            out["sent"] = int(sum(moe.experts.last_stats.counts_WE[rank]))
    if arch == "sigmoid":
        out["bias_counts_equal"] = torch.equal(moe.router.local_tokens_per_expert, ref.router.local_tokens_per_expert)
        out["bias_counts_sum"] = float(moe.router.local_tokens_per_expert.sum())
    if arch == "softmax" and dtype == torch.float32 and dispatcher == "feplb" and not over:
        # an optimizer step between a forward and its backward (every rank): each names the parameter
        y, _ = moe(x.clone().requires_grad_())
        first = moe.experts.expert_params()[0]
        first.grad = torch.ones_like(first)
        torch.optim.SGD([first], lr=0.1, foreach=True).step()
        out["stepped"] = error_of(lambda: y.backward(g))
    return out


def _overlap_after_refusal_case(rank: int, world: int) -> dict:
    """Shared experts overlapped in FEPLB's dispatcher: a forward FEPLB refuses (on every rank, after the shared
    experts were queued), then a good one, against Megatron's layer."""
    import feplb.megatron as fm

    over = dict(moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall")
    moe, ref = make_moe("sigmoid", **over), make_moe("sigmoid", **over)
    fm.apply(moe, policy="feplb-split", gpus_per_node=min(2, world), **OPTS)
    x, g = _inputs(rank)
    hook = moe.experts.local_experts[0].register_forward_hook(lambda *a: None)
    refused = error_of(lambda: moe(x))
    hook.remove()
    ours, theirs = _grads(moe, x, g), _grads(ref, x, g)
    return {"refused": refused, "err": {n: _rel(ours[n], theirs[n]) for n in theirs}}


def _two_layers_case(rank: int, world: int) -> dict:
    """A model of two MoE layers (each its own FEPLB layer over the same EP group), chained."""
    from torch import nn

    import feplb.megatron as fm

    def model():
        m = nn.Module()
        m.layers = nn.ModuleList([make_moe(), make_moe("sigmoid")])
        return m

    ours, ref = model(), model()
    names = fm.apply(ours, policy="feplb-split", gpus_per_node=min(2, world), **OPTS)
    x, g = _inputs(rank)
    res = []
    for m in (ours, ref):
        xx = x.clone().requires_grad_()
        y = m.layers[1](m.layers[0](xx)[0])[0]
        y.backward(g)
        res.append({"out": y.detach(), "x": xx.grad} | {n: p.grad for n, p in m.named_parameters()})
    return {"names": names, "distinct": ours.layers[0].experts is not ours.layers[1].experts,
            "err": max(_rel(res[0][n], res[1][n]) for n in res[1]), "same_keys": list(res[0]) == list(res[1])}


def _train_case(rank: int, world: int, policy: str, weights: str, experts: str = "sequential", *,
                dispatcher: str = "feplb", arch: str = "softmax", replicas: str = "eager", **over) -> dict:
    """Two SGD steps of two accumulated micro-batches each, ours and Megatron's layer; the per-step calls. ``over``:
    TransformerConfig fields; ``dispatcher``: apply's token_dispatcher; ``replicas``: FEPLBConfig's."""
    import feplb.megatron as fm

    moe, ref = make_moe(arch, experts=experts, **over), make_moe(arch, experts=experts, **over)
    fm.apply(moe, policy=policy, weights=weights, gpus_per_node=min(2, world), refresh_every=1,
             token_dispatcher=dispatcher, replicas=replicas, **OPTS)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (moe, ref)]
    moved = held = 0
    for step in range(2):
        # step 0 runs each micro-batch's backward after its forward; step 1 both forwards first, as a pipeline
        # schedule interleaves them
        pending = []
        for mb in range(2):
            x, g = _inputs(rank + 10 * step + 100 * mb)
            for m in (moe, ref):
                pending.append((m(x)[0], g))
            moved += _moved(moe)
            held = max(held, len(moe.experts.replicas.all_pairs()))   # (the same on every rank)
            if step == 0:
                for y, gy in pending:
                    y.backward(gy)
                pending = []
        for y, gy in pending:
            y.backward(gy)
        fm.reduce_replica_grads(moe)
        for o in opts:
            o.step()
            o.zero_grad()
        fm.refresh_replicas(moe)
    theirs = dict(ref.named_parameters())
    # relative to the whole update (the absolute difference for a weight no token updated)
    err = {}
    for n, p in moe.named_parameters():
        diff = (p.detach().double() - theirs[n].detach().double()).abs().max()
        upd = (theirs[n].detach().double() - start[n].double()).abs().max()
        err[n] = float(diff / upd) if upd else float(diff)
    return {"err": err, "moved": moved, "held": held,
            "final": {n: p.detach().clone() for n, p in moe.named_parameters()},
            "update": {n: float((theirs[n].detach().double() - start[n].double()).abs().max()) for n in theirs}}


def _bias_grads_changed_case(rank: int, world: int, **over) -> tuple[int, str | None]:
    """eplb's resident replicas of biased experts (held from the second step on, once there is a history): the
    second step's two micro-batches' backwards, then one expert bias's gradient scaled in place before the
    reduction. The biases' gradients are views of one storage (stacked per forward), whose version counter every
    accumulation bumps: judged by that storage's last accumulation, the change after it is still refused. The
    copies held then, and the error (None if none)."""
    import feplb.megatron as fm

    moe = make_moe("softmax", **over)
    fm.apply(moe, policy="eplb", weights="per-step", gpus_per_node=min(2, world), refresh_every=1, **OPTS)
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    bias = next(p for n, p in moe.named_parameters() if n.startswith("experts.") and n.endswith(".bias"))
    for step in range(2):
        for mb in range(2):
            x, g = _inputs(rank + 10 * step + 100 * mb)
            moe(x)[0].backward(g)
        held = len(moe.experts.replicas.all_pairs())
        if step == 1:
            bias.grad.mul_(2.0)
        try:
            fm.reduce_replica_grads(moe)
        except RuntimeError as err:
            return held, str(err)
        opt.step()
        opt.zero_grad()
        fm.refresh_replicas(moe)
    return held, None


def _sharded_fields(sd: dict) -> dict:
    """Every field of each entry of a Megatron sharded state dict that a distributed checkpoint stores or reads."""
    out = {}
    for k, v in sd.items():
        fields = [type(v).__name__] + [getattr(v, a, None) for a in ("key", "global_shape", "global_offset",
                                                                     "axis_fragmentations", "replica_id", "dtype",
                                                                     "flattened_range", "allow_shape_mismatch")]
        data = getattr(v, "data", None)
        out[k] = (fields, data.detach().clone() if isinstance(data, torch.Tensor) else data)
    return out


def _same_sharded(moe, ref) -> tuple[bool, dict]:
    """Whether ours and Megatron's layer give the same sharded state dict (every field, the data); Megatron's."""
    ours, theirs = (_sharded_fields(m.sharded_state_dict(prefix="decoder.layers.0.mlp.")) for m in (moe, ref))
    return sorted(ours) == sorted(theirs) and all(
        ours[k][0] == theirs[k][0] and (torch.equal(ours[k][1], theirs[k][1]) if isinstance(theirs[k][1], torch.Tensor)
                                        else ours[k][1] == theirs[k][1]) for k in theirs), theirs


def _checkpoint_equal(moe, rank: int) -> bool:
    """Whether a non-reentrant ``torch.utils.checkpoint`` of the layer gives bit-identical gradients."""
    import torch.utils.checkpoint as ckpt

    x, g = _inputs(rank)
    plain = _grads(moe, x, g)
    moe.zero_grad()
    xc = x.clone().requires_grad_()
    ckpt.checkpoint(lambda t: moe(t)[0], xc, use_reentrant=False).backward(g)
    return torch.equal(xc.grad, plain["x"]) and all(torch.equal(p.grad, plain[n]) for n, p in moe.named_parameters())


def _state_case(rank: int, world: int, bias: bool = False) -> dict:
    """full_state_dict, sharded_state_dict, and a checkpointed layer; with ``bias``, of experts with biases."""

    import feplb.megatron as fm

    moe, ref = make_moe(add_bias_linear=bias), make_moe(add_bias_linear=bias)
    fm.apply(moe, policy="feplb-split", gpus_per_node=min(2, world), **OPTS)
    same, theirs = _same_sharded(moe, ref)
    sd = fm.full_state_dict(moe, rank0_only=False)
    want = {"router.weight": moe.router.weight.detach()}
    if bias:   # Megatron's router has a bias too with add_bias_linear
        want["router.bias"] = moe.router.bias.detach()
    for e in range(E):
        w1, w2 = _expert_weights(e)
        want[f"experts.local_experts.{e}.linear_fc1.weight"] = w1
        want[f"experts.local_experts.{e}.linear_fc2.weight"] = w2
        if bias:
            b1, b2 = _expert_biases(e)
            want[f"experts.local_experts.{e}.linear_fc1.bias"] = b1
            want[f"experts.local_experts.{e}.linear_fc2.bias"] = b2
        for j in (1, 2):   # Megatron's linears' (empty) extra state
            want[f"experts.local_experts.{e}.linear_fc{j}._extra_state"] = None
    out = {"keys": sorted(sd) == sorted(want),
           "equal": all(sd[k] is None if v is None else torch.equal(sd[k], v) for k, v in want.items() if k in sd),
           "local_keys": sorted(moe.state_dict()),
           "sharded_same": same, "sharded_experts": sum("local_experts" in k for k in theirs)}
    off = fm.full_state_dict(moe, rank0_only=False, cpu_offload=True)   # the extra states (None) pass through
    out["offload_equal"] = sorted(off) == sorted(sd) and all(
        off[k] is None if v is None else (off[k].device.type == "cpu" and torch.equal(off[k], v))
        for k, v in sd.items())
    # state_dict() keeps Megatron's plain local shards (its distributed checkpoints go through sharded_state_dict);
    # the DTensor type of the other drop-ins is refused by name
    from torch.distributed.tensor import DTensor

    out["plain_local"] = not any(isinstance(v, DTensor) for v in moe.state_dict().values())
    out["no_dtensor_type"] = error_of(lambda: fm.set_state_dict_type(moe, "sharded"))
    out["default_weights"] = moe.experts.config.weights
    # Transformer Engine's linears (without fp8) keep a tensor of no elements as their extra state
    for m in moe.experts.local_experts:
        m.linear_fc1.get_extra_state = lambda: torch.empty(0, dtype=torch.uint8)
    te = fm.full_state_dict(moe, rank0_only=False)
    out["te_extra"] = sorted(k for k, v in te.items() if isinstance(v, torch.Tensor) and v.numel() == 0)
    out["ckpt_equal"] = _checkpoint_equal(moe, rank)
    return out


def _ddp_case(rank: int, world: int, policy: str, weights: str, overlap: bool, experts: str = "sequential", *,
              dispatcher: str = "feplb", arch: str = "softmax", replicas: str = "eager", **over) -> dict:
    """Megatron's DistributedDataParallel around ours and Megatron's layer: two steps of two micro-batches (the first
    under no_sync), reduce_replica_grads before finish_grad_sync, SGD on the reduced main_grad, refresh_replicas.
    ``over``: TransformerConfig fields; ``dispatcher``: apply's token_dispatcher; ``replicas``: FEPLBConfig's."""
    import contextlib
    import warnings

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import feplb.megatron as fm

    moe, ref = make_moe(arch, experts=experts, **over), make_moe(arch, experts=experts, **over)
    fm.apply(moe, policy=policy, weights=weights, gpus_per_node=min(2, world), refresh_every=1,
             token_dispatcher=dispatcher, replicas=replicas, **OPTS)
    ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=overlap, grad_reduce_in_fp32=True)
    wrapped = [DistributedDataParallel(m.config, ddp_cfg, m) for m in (moe, ref)]
    first, err, moved, warned = 0.0, 0.0, 0, 0
    for step in range(2):
        for w in wrapped:
            w.zero_grad_buffer()
        for mb in range(2):
            x, g = _inputs(rank + 10 * step + 100 * mb)
            for w in wrapped:
                with w.no_sync() if mb == 0 else contextlib.nullcontext():
                    w(x)[0].backward(g)
            moved += _moved(moe)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fm.reduce_replica_grads(moe)
        warned += sum("overlap_grad_reduce=False" in str(c.message) for c in caught)
        for w in wrapped:
            w.finish_grad_sync()
        theirs = dict(ref.named_parameters())
        step_err = max(_rel(p.main_grad, theirs[n].main_grad) for n, p in moe.named_parameters())
        first = step_err if step == 0 else first   # the same weights: only the layers differ
        err = max(err, step_err)
        with torch.no_grad():
            for m in (moe, ref):
                for p in m.parameters():
                    p -= 0.5 * p.main_grad.to(p.dtype)
        fm.refresh_replicas(moe)
    return {"first": first, "err": err, "moved": moved, "warned": warned}


def _recompute_case(rank: int, world: int, policy: str, weights: str, *, dispatcher: str = "feplb",
                    arch: str = "softmax", **over) -> dict:
    """Megatron's recompute of the MoE layer; two micro-batches forwarded before their backwards (in reverse).
    ``over``: TransformerConfig fields; ``dispatcher``: apply's token_dispatcher."""
    import feplb.megatron as fm

    over = dict(recompute_granularity="selective", recompute_modules=["moe"], **over)
    moe, ref = make_moe(arch, **over), make_moe(arch, **over)
    assert moe.moe_layer_recompute
    fm.apply(moe, policy=policy, weights=weights, gpus_per_node=min(2, world), token_dispatcher=dispatcher, **OPTS)
    res = []
    for m in (moe, ref):
        xs = [_inputs(rank + 7 * mb)[0].requires_grad_() for mb in range(2)]
        ys = [m(x)[0] for x in xs]
        for mb in (1, 0):
            ys[mb].backward(_inputs(rank + 7 * mb)[1])
        d = {f"out{i}": y.detach() for i, y in enumerate(ys)} | {f"x{i}": x.grad for i, x in enumerate(xs)}
        res.append(d | {n: p.grad for n, p in m.named_parameters()})
    return {"err": max(_rel(res[0][n], res[1][n]) for n in res[1]), "moved": _moved(moe)}


def _refusal_case(rank: int, world: int) -> dict:
    """What FEPLB cannot run, refused on every rank and nothing replaced."""
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_geglu import quick_gelu as fused_quick_gelu

    import feplb.megatron as fm

    out = {}
    for label, over in (("gelu_fused", dict(activation_func=F.gelu, bias_activation_fusion=True)),
                        ("clamp_fused", dict(activation_func_clamp_value=0.5, bias_activation_fusion=True)),
                        ("offset", dict(glu_linear_offset=0.5)),
                        ("pad", dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)),
                        ("plain_tanh", dict(gated_linear_unit=False, activation_func=torch.tanh)),
                        ("fp8_store", dict(activation_func_fp8_input_store=True)),
                        # SequentialMLP's fused paths with fc1 biases: its fused SwiGLU raises, its fused quick-GeGLU
                        # clamps before adding the bias (its unfused path and TEGroupedMLP after)
                        ("bias_fused_swiglu", dict(add_bias_linear=True, bias_activation_fusion=True)),
                        ("bias_fused_clamp", dict(add_bias_linear=True, bias_activation_fusion=True,
                                                  activation_func=fused_quick_gelu, glu_linear_offset=1.0,
                                                  activation_func_clamp_value=0.5))):
        moe = make_moe(**over)
        before = type(moe.experts).__name__
        out[label] = (error_of(lambda m=moe: fm.apply(m, **OPTS)), before, type(moe.experts).__name__)
    moe = make_moe()
    if rank == world - 1:
        moe.experts.local_experts[0].linear_fc1.register_forward_hook(lambda *a: None)
    out["hook"] = (error_of(lambda: fm.apply(moe, **OPTS)), type(moe.experts).__name__)
    moe = make_moe()
    bad = {"top_k": 3} if rank == 0 else {}
    out["derived"] = error_of(lambda: fm.apply(moe, **bad, **OPTS))
    out["dtype"] = error_of(lambda: fm.apply(moe, dtype=torch.int8, **OPTS))
    fm.apply(moe, **OPTS)
    out["again"] = error_of(lambda: fm.apply(moe, **OPTS))
    out["dispatched"] = error_of(lambda: moe.experts.forward_dispatched(torch.zeros(0, moe.experts.config.hidden),
                                                                          [0] * moe.experts.num_local))
    # hooks registered after apply: forward pre-hooks run (as the module's forward would run them); others refused on
    # every rank at the next forward
    calls = []
    moe.experts.local_experts[0].linear_fc1.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape))
    x, _ = _inputs(rank)
    moe(x)
    out["pre_hook_calls"] = list(calls)
    late = moe.experts.local_experts[-1].register_forward_hook(lambda *a: None) if rank == world - 1 else None
    out["late_hook"] = error_of(lambda: moe(x))
    if late is not None:
        late.remove()
    out["usable_again"] = error_of(lambda: moe(x))
    # padding to capacity turned on after apply (as Megatron's set_decode_expert_padding does): the router pads the
    # routing map, which FEPLB's dispatch cannot take; every rank raises, and the layer works once it is off
    cfg = moe.experts.megatron_config
    cfg.moe_pad_expert_input_to_capacity, cfg.moe_expert_capacity_factor = True, 1.0
    out["padded_later"] = error_of(lambda: moe(x))
    cfg.moe_pad_expert_input_to_capacity, cfg.moe_expert_capacity_factor = False, None
    out["unpadded_again"] = error_of(lambda: moe(x))
    # a pre-hook that replaces the module's input: FEPLB runs no module forward to give it to
    swap = moe.experts.local_experts[0].register_forward_pre_hook(lambda mod, args: args) if rank == 0 else None
    out["input_hook"] = error_of(lambda: moe(x))
    if swap is not None:
        swap.remove()
    # a hook added between a checkpointed forward and its backward: the recompute runs (its peers are replaying),
    # the next forward refuses it
    import torch.utils.checkpoint as ckpt

    xc = x.clone().requires_grad_()
    y = ckpt.checkpoint(lambda t: moe(t)[0], xc, use_reentrant=False)
    if rank == world - 1:
        moe.experts.local_experts[0].register_forward_hook(lambda *a: None)
    out["hook_in_backward"] = error_of(lambda: y.sum().backward())
    out["hook_after_backward"] = error_of(lambda: moe(x))
    return out


def _usage_case(rank: int, world: int) -> dict:
    """Transformer Engine's CUDA graphs of the attention only leave the MoE layer eager: applied, and it runs; graphs
    of the MoE layer (its router, or the whole layer), or Megatron's own implementation, refused. ``apply`` takes the
    list of virtual-pipeline chunks, one of them dense. Per-step copies under Megatron's DDP with
    ``overlap_grad_reduce``: refused on every rank by ``reduce_replica_grads`` given the DDP-wrapped chunk; given the
    module inside, it warns (it cannot see the wrapper)."""
    import warnings

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import feplb.megatron as fm

    out = {}
    x, g = _inputs(rank)
    for label, over in (("graph_attn", dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"])),
                        ("graph_router", dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router"])),
                        ("graph_whole", dict(cuda_graph_impl="transformer_engine")),
                        ("graph_local_attn", dict(cuda_graph_impl="local", cuda_graph_scope=["attn"]))):
        moe = make_moe(**over)
        out[label] = error_of(lambda m=moe: fm.apply(m, gpus_per_node=min(2, world), **OPTS))
        if out[label] is None:
            out[label + "/forward"] = error_of(lambda m=moe: m(x))
    dense, moe = torch.nn.Sequential(torch.nn.Linear(H, H)), make_moe()
    out["chunks"] = fm.apply([dense, moe], gpus_per_node=min(2, world), **OPTS)
    out["chunks/refresh"] = error_of(lambda: fm.refresh_replicas([dense, moe]))   # (the chunks, as after a step)
    out["chunks/forward"] = error_of(lambda: moe(x))
    moe = make_moe()
    fm.apply(moe, policy="feplb-split@ema", weights="per-step", gpus_per_node=min(2, world), **OPTS)
    ddp = DistributedDataParallel(moe.config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                            grad_reduce_in_fp32=True), moe)
    ddp.zero_grad_buffer()
    with torch.no_grad():
        moe(x)
    fm.refresh_replicas(moe)
    ddp(x)[0].backward(g)
    out["overlap"] = error_of(lambda: fm.reduce_replica_grads([ddp]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["overlap/inner"] = error_of(lambda: fm.reduce_replica_grads(moe))
    out["overlap/warned"] = any("overlap_grad_reduce=False" in str(c.message) for c in caught)
    ddp.finish_grad_sync()
    # the gradients in DDP's buffers (main_grad, .grad None): the calls that read .grad refuse instead of clipping by
    # a norm of 0 and averaging nothing
    main_grads = [p.main_grad.clone() for p in fm.expert_parameters(moe)]
    out["ddp/clip"] = error_of(lambda: fm.clip_grad_norm_(moe, 1e-3))
    out["ddp/average"] = error_of(lambda: fm.average_expert_grads(moe))
    out["ddp/kept"] = all(torch.equal(p.main_grad, m) for p, m in zip(fm.expert_parameters(moe), main_grads,
                                                                      strict=True))
    return out


def _job(rank: int, world: int) -> dict:
    _cpu_megatron(world)
    res = {}
    for arch in ("softmax", "sigmoid"):
        for policy in ("feplb-split", "none"):
            res["layer", arch, policy, "fp32"] = _layer_case(rank, world, arch, policy, torch.float32)
    # the shared experts overlapped with the dispatch, on their side stream (Megatron allows it with alltoall)
    with _cpu_shared_expert_stream():
        res["layer", "sigmoid-shared-overlap", "feplb-split", "fp32"] = _layer_case(
            rank, world, "sigmoid", "feplb-split", torch.float32, moe_shared_expert_overlap=True,
            moe_token_dispatcher_type="alltoall")
        res["overlap-after-refusal"] = _overlap_after_refusal_case(rank, world)
    # the router's probabilities on the experts' inputs (Megatron allows it with top-1)
    for policy in ("feplb-split", "none"):
        res["layer", "probs-on-input", policy, "fp32"] = _layer_case(
            rank, world, "softmax", policy, torch.float32, moe_apply_probs_on_input=True, moe_router_topk=1,
            moe_router_pre_softmax=True)
    # tokens dropped at an expert's capacity by Megatron's router (both drop policies): masked routes
    for policy in ("feplb-split", "none"):
        for drop in ("probs", "position"):
            res["layer", f"capacity-{drop}", policy, "fp32"] = _layer_case(
                rank, world, "softmax", policy, torch.float32, moe_expert_capacity_factor=1.0,
                moe_token_drop_policy=drop)
    for policy in ("feplb-split+place", "none"):
        res["train-capacity", policy] = _train_case(rank, world, policy, "per-microbatch",
                                                    moe_expert_capacity_factor=1.0)
    # other activations: GeGLU (erf), SwiGLU clamped, gpt-oss's gate (quick-GELU, offset 1, clamped), Nemotron's
    # non-gated squared ReLU
    from megatron.core.activations import quick_gelu, squared_relu

    for label, over in (("geglu", dict(activation_func=torch.nn.functional.gelu)),
                        ("clamped", dict(activation_func_clamp_value=0.5)),
                        ("quick-geglu", dict(activation_func=quick_gelu, glu_linear_offset=1.0,
                                             activation_func_clamp_value=0.5)),
                        ("squared-relu", dict(gated_linear_unit=False, activation_func=squared_relu)),
                        ("silu-plain", dict(gated_linear_unit=False, activation_func=torch.nn.functional.silu)),
                        ("gelu-plain", dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu))):
        for policy in ("feplb-split", "none") if "plain" not in label else ("feplb-split",):
            res["layer", label, policy, "fp32"] = _layer_case(rank, world, "softmax", policy, torch.float32, **over)
    # gpt-oss's gate in bf16, against Megatron's own bf16 error
    res["layer", "quick-geglu", "feplb-split", "bf16"] = _layer_case(
        rank, world, "softmax", "feplb-split", torch.bfloat16, activation_func=quick_gelu, glu_linear_offset=1.0,
        activation_func_clamp_value=0.5)
    if world > 1:
        # expert biases (add_bias_linear): Megatron's own SequentialMLP with biases cannot run its backward at EP = 1
        # and TP = 1 (its MLP adds the fc2 bias in place into the output of a custom autograd Function, which that
        # size returns as it came); at EP > 1 it can
        bias = dict(add_bias_linear=True)
        oss = dict(bias, activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=0.5)
        for policy in ("feplb-split", "none"):
            res["layer", "bias", policy, "fp32"] = _layer_case(rank, world, "softmax", policy, torch.float32, **bias)
        # (Megatron's shared experts take no bias)
        res["layer", "bias-sigmoid", "feplb-split", "fp32"] = _layer_case(
            rank, world, "sigmoid", "feplb-split", torch.float32, moe_shared_expert_intermediate_size=None, **bias)
        res["layer", "bias-quick-geglu", "feplb-split", "fp32"] = _layer_case(rank, world, "softmax", "feplb-split",
                                                                              torch.float32, **oss)
        # SequentialMLP's fused quick-GeGLU (the fusion's own quick_gelu) with the fc1 bias, unclamped (clamped,
        # Megatron's paths disagree)
        from megatron.core.fusions.fused_bias_geglu import quick_gelu as fused_quick_gelu

        res["layer", "bias-fused-quick-geglu", "feplb-split", "fp32"] = _layer_case(
            rank, world, "softmax", "feplb-split", torch.float32, add_bias_linear=True,
            activation_func=fused_quick_gelu, glu_linear_offset=1.0, bias_activation_fusion=True)
        res["layer", "bias-probs-on-input", "feplb-split", "fp32"] = _layer_case(
            rank, world, "softmax", "feplb-split", torch.float32, moe_apply_probs_on_input=True, moe_router_topk=1,
            moe_router_pre_softmax=True, **bias)
        res["layer", "bias-quick-geglu", "feplb-split", "bf16"] = _layer_case(
            rank, world, "softmax", "feplb-split", torch.bfloat16, **oss)
        for weights in ("per-step", "per-microbatch"):
            res["train", "bias", weights] = _train_case(rank, world, "feplb-split+place", weights, **oss)
        # resident replicas of biased experts: the per-expert biases are stacked per forward, so their gradients
        # are views of one storage sharing a version counter (no false "changed in place" at the reduction)
        res["train", "bias", "eplb"] = _train_case(rank, world, "eplb", "per-step", **bias)
        res["bias_grads_changed"] = _bias_grads_changed_case(rank, world, **bias)
        res["ddp", "bias", "per-microbatch", True] = _ddp_case(rank, world, "feplb-split+place", "per-microbatch",
                                                               True, **bias)
        res["state_bias"] = _state_case(rank, world, bias=True)
    res["two_layers"] = _two_layers_case(rank, world)
    res["layer", "softmax", "feplb-split", "bf16"] = _layer_case(rank, world, "softmax", "feplb-split",
                                                                 torch.bfloat16)
    for policy, weights in (("eplb", "per-step"), ("feplb-split@ema", "per-step"), ("feplb-split+place", "per-step"),
                            ("feplb-split+place", "per-microbatch")):
        res["train", policy, weights] = _train_case(rank, world, policy, weights)
    # lazy @ema replicas: the weights a plan copies held for the step (both forwards before their backwards in the
    # second step), their gradients reduced to the owners, also through Megatron's DDP buffers
    res["train", "feplb-split@ema", "lazy"] = _train_case(rank, world, "feplb-split@ema", "per-step",
                                                          replicas="lazy")
    res["ddp", "feplb-split@ema", "per-step", False, "lazy"] = _ddp_case(rank, world, "feplb-split@ema", "per-step",
                                                                         False, replicas="lazy")
    for policy, weights, overlap in (("eplb", "per-step", False), ("eplb", "per-microbatch", True),
                                     ("feplb-split+place", "per-microbatch", True)):
        res["ddp", policy, weights, overlap] = _ddp_case(rank, world, policy, weights, overlap)
    for policy, weights in (("feplb-split", "per-step"), ("eplb", "per-step"), ("feplb-split+place", "per-microbatch")):
        res["recompute", policy, weights] = _recompute_case(rank, world, policy, weights)
    with _cpu_shared_expert_stream():
        overlap = dict(arch="sigmoid", moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall")
        # the shared experts overlapped, queued again by the recompute's dispatch
        res["recompute", "feplb-split", "shared-overlap"] = _recompute_case(rank, world, "feplb-split",
                                                                            "per-microbatch", **overlap)
        # ... over training steps (forwards interleaved, as a pipeline schedule does), and under Megatron's DDP
        res["train", "shared-overlap", "per-step"] = _train_case(rank, world, "feplb-split+place", "per-step",
                                                                 **overlap)
        res["ddp", "shared-overlap", "per-microbatch", True] = _ddp_case(rank, world, "feplb-split",
                                                                        "per-microbatch", True, **overlap)
    res["state"] = _state_case(rank, world)
    res["refusal"] = _refusal_case(rank, world)
    res["usage"] = _usage_case(rank, world)
    return res


def _grouped_state_case(rank: int, world: int, experts: str, bias: bool = False) -> dict:
    """The grouped layouts' state: names, full_state_dict (the EP = 1 model's layout), Megatron's sharded state dict,
    loading, a checkpointed layer; with ``bias``, of experts with biases (TEGroupedMLP)."""

    import feplb.megatron as fm

    moe, ref = make_moe(experts=experts, add_bias_linear=bias), make_moe(experts=experts, add_bias_linear=bias)
    fm.apply(moe, policy="feplb-split", gpus_per_node=min(2, world), **OPTS)
    same, theirs = _same_sharded(moe, ref)
    sd = fm.full_state_dict(moe, rank0_only=False)
    want = {"router.weight": moe.router.weight.detach()}
    if bias:   # Megatron's router has a bias too with add_bias_linear
        want["router.bias"] = moe.router.bias.detach()
    w = [_expert_weights(e) for e in range(E)]
    if experts == "te":
        for e, (w1, w2) in enumerate(w):
            want[f"experts.linear_fc1.weight{e}"], want[f"experts.linear_fc2.weight{e}"] = w1, w2
            if bias:
                want[f"experts.linear_fc1.bias{e}"], want[f"experts.linear_fc2.bias{e}"] = _expert_biases(e)
        for j in (1, 2):
            want[f"experts.linear_fc{j}._extra_state"] = torch.empty(0, dtype=torch.uint8)
    else:   # GroupedMLP with every expert: weight1 [H, E * 2F] holding expert e's [H, 2F] as its e-th block
        want["experts.weight1"] = torch.stack([w1.T for w1, _ in w]).reshape(H, -1)
        want["experts.weight2"] = torch.cat([w2.T for _, w2 in w])
    out = {"keys": (sorted(sd), sorted(want)),
           "equal": all(torch.equal(sd[k], v) for k, v in want.items() if k in sd),
           "local_keys": (sorted(moe.state_dict()), sorted(ref.state_dict())),
           "sharded_same": same, "sharded_keys": len(theirs)}
    # a state dict of Megatron's layer loads (strictly) into ours; the legacy GroupedMLP's own post-hook forgives
    # SequentialMLP's extra-state keys
    extra = {"experts.local_experts.0.linear_fc1._extra_state": None} if experts == "grouped" else {}
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01)
    if experts == "te":
        # Transformer Engine's extra state without fp8 as its versions store it: a pickled None in a uint8 tensor
        # (2.0 - 2.3), a torch.save'd None (1.x); state that is not empty is refused
        import io
        import pickle

        def saved(v):
            b = io.BytesIO()
            torch.save(v, b)
            return b

        for label, make in (("pickled", lambda: torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)),
                            ("saved", lambda: saved(None)),
                            ("fp8", lambda: torch.frombuffer(bytearray(pickle.dumps({"scale": 1})),
                                                             dtype=torch.uint8))):
            moe.experts.linear_fc1.get_extra_state = make
            try:
                got = fm.full_state_dict(moe, rank0_only=False)
                out["extra", label] = ("ok", type(got["experts.linear_fc1._extra_state"]).__name__)
            except NotImplementedError as e:
                out["extra", label] = ("refused", str(e))
        del moe.experts.linear_fc1.get_extra_state
    out["load"] = error_of(lambda: moe.load_state_dict(ref.state_dict() | extra))
    out["loaded"] = all(torch.equal(a, b) for a, b in zip(moe.parameters(), ref.parameters(), strict=True))
    out["ckpt_equal"] = _checkpoint_equal(moe, rank)
    return out


def _grouped_refusal_case(rank: int, world: int) -> dict:
    """Hooks FEPLB would drop, on one rank, refused on every rank; a grouped linear's hook added after apply refused
    at the next forward; a derived shape mismatch named."""
    import feplb.megatron as fm

    out = {}
    # options that save the experts' activation memory inside Megatron's experts: FEPLB runs the experts exactly
    # without them, and says so
    import warnings

    moe = make_moe(experts="te", recompute_granularity="selective", recompute_modules=["moe_act"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fm.apply(moe, **OPTS)
    out["memory_warning"] = [str(w.message) for w in caught if "FEPLB's experts do not" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fm.apply(make_moe(experts="te"), **OPTS)
    out["no_memory_warning"] = [str(w.message) for w in caught if "FEPLB's experts do not" in str(w.message)]
    x, _ = _inputs(rank)
    for experts in ("grouped", "te"):
        moe = make_moe(experts=experts)
        if rank == world - 1:
            (moe.experts if experts == "grouped" else moe.experts.linear_fc2).register_forward_hook(lambda *a: None)
        out["hook", experts] = (error_of(lambda m=moe: fm.apply(m, **OPTS)), type(moe.experts).__name__)
        # the legacy GroupedMLP ignores the clamp; TEGroupedMLP's fused path takes no GeGLU
        moe = make_moe(experts=experts, **({"activation_func_clamp_value": 0.5} if experts == "grouped" else
                                           {"activation_func": torch.nn.functional.gelu,
                                            "bias_activation_fusion": True}))
        out["gelu", experts] = error_of(lambda m=moe: fm.apply(m, **OPTS))
    moe = make_moe(experts="grouped")   # a load-state-dict post-hook other than GroupedMLP's own
    moe.experts.register_load_state_dict_post_hook(lambda *a: None)
    out["post_hook"] = error_of(lambda: fm.apply(moe, **OPTS))
    moe = make_moe(experts="te")   # Transformer Engine's per-module quantization (Megatron's quant_recipe)
    moe.experts.linear_fc2.te_quant_params = object()
    out["quantized"] = error_of(lambda: fm.apply(moe, **OPTS))
    moe = make_moe(experts="te")
    fm.apply(moe, **OPTS)
    late = moe.experts.linear_fc1.register_forward_hook(lambda *a: None) if rank == 0 else None
    out["late"] = error_of(lambda: moe(x))
    if late is not None:
        late.remove()
    out["usable_again"] = error_of(lambda: moe(x))
    # padding to capacity turned on after apply (as Megatron's set_decode_expert_padding does): the router pads the
    # routing map, which FEPLB's dispatch cannot take; every rank raises, and the layer works once it is off
    cfg = moe.experts.megatron_config
    cfg.moe_pad_expert_input_to_capacity, cfg.moe_expert_capacity_factor = True, 1.0
    out["padded_later"] = error_of(lambda: moe(x))
    cfg.moe_pad_expert_input_to_capacity, cfg.moe_expert_capacity_factor = False, None
    out["unpadded_again"] = error_of(lambda: moe(x))
    return out


VOCAB, SEQ = 64, 12


def make_gpt(experts: str = "sequential", dispatcher: str = "allgather", **over):
    """A Megatron-Core GPTModel of two transformer layers with MoE MLPs (the local spec: Megatron's attention,
    norms, rotary embeddings, output layer and its fused loss), the router's auxiliary load-balancing loss on,
    dropout off; the same weights on every rank and for every call. ``dispatcher``: Megatron's token dispatcher
    type; ``over``: TransformerConfig fields."""
    import copy

    import megatron.core.tensor_parallel.random as mr
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    # the attention's dropout forks Megatron's CUDA RNG states (made no-ops by _cpu_megatron): registered here
    tracker = mr.get_cuda_rng_tracker()
    for name in (mr._MODEL_PARALLEL_RNG_TRACKER_NAME, mr._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                 mr._DATA_PARALLEL_RNG_TRACKER_NAME):
        tracker.states_.setdefault(name, torch.zeros(1))
    grouped = experts != "sequential"
    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64,
                            moe_ffn_hidden_size=FF, num_moe_experts=E, moe_router_topk=K,
                            use_cpu_initialization=True, moe_token_dispatcher_type=dispatcher,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                            moe_router_dtype="fp32", hidden_dropout=0.0, attention_dropout=0.0,
                            moe_grouped_gemm=grouped, **over)
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=grouped))
    if experts == "te":
        spec.submodules.mlp.submodules.experts = ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))
    torch.manual_seed(0)
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def _gpt_case(rank: int, world: int, experts: str, dispatcher: str = "feplb", data_rank: int | None = None,
              kind: str | None = None, **over) -> dict:
    """Two SGD steps of a whole GPT model (next-token loss plus the routers' auxiliary losses), ours and Megatron's.
    ``dispatcher``: apply's token_dispatcher ("megatron": both models keep Megatron's dispatcher, ``kind``, by
    default alltoall; allgather by default with FEPLB's); ``data_rank``: whose batch this rank takes (the ranks of a
    tensor-parallel group take the same; default its rank); ``over``: TransformerConfig fields."""
    import feplb.megatron as fm

    kind = kind or ("alltoall" if dispatcher == "megatron" else "allgather")
    data_rank = rank if data_rank is None else data_rank
    ours, ref = make_gpt(experts, kind, **over), make_gpt(experts, kind, **over)
    names = fm.apply(ours, policy="feplb-split", gpus_per_node=min(2, world), token_dispatcher=dispatcher, **OPTS)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]   # causal (Megatron's default builds it on CUDA)
    pos = torch.arange(SEQ).expand(2, SEQ)
    out = {"names": names}
    runs = []
    for m in (ours, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses, moved = [], 0
        for step in range(2):
            ids = torch.randint(0, VOCAB, (2, SEQ),
                                generator=torch.Generator().manual_seed(50 + data_rank + 10 * step))
            loss = m(ids, pos, mask, labels=ids.roll(-1, 1)).mean()
            loss.backward()
            if over.get("sequence_parallel"):   # as Megatron's finalize_model_grads: the norms' over the TP group
                from megatron.core import parallel_state as ps

                for p in m.parameters():
                    if getattr(p, "sequence_parallel", False) and p.grad is not None:
                        torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            losses.append(loss.detach())
            if step == 0:
                first = {n: p.grad.clone() for n, p in m.named_parameters()}
            if m is ours:
                moved += sum(_moved(layer.mlp) for layer in m.decoder.layers)
            opt.step()
            opt.zero_grad()
        runs.append((losses, first, dict(m.named_parameters()), moved))
    (l_ours, g_ours, p_ours, moved), (l_ref, g_ref, p_ref, _) = runs
    out["loss"] = max(_rel(a, b) for a, b in zip(l_ours, l_ref, strict=True))
    out["same_names"] = list(g_ours) == list(g_ref)
    out["grad"] = max(_rel(g_ours[n], g_ref[n]) for n in g_ref)
    # relative to each weight's update, beyond one fp32 ulp of the weight itself (a weight near 1, a norm's, updated by
    # 2e-4 differs by half an ulp when the two models sum in other orders)
    ulp = torch.finfo(torch.float32).eps
    err = {}
    for n in p_ref:
        diff = float((p_ours[n].detach().double() - p_ref[n].detach().double()).abs().max())
        upd = float((p_ref[n].detach().double() - start[n].double()).abs().max())
        err[n] = max(0.0, diff - ulp * float(p_ref[n].detach().abs().max())) / (upd or 1.0)
    out["weights"] = max(err.values())
    out["moved"] = moved
    return out


def _grouped_job(rank: int, world: int) -> dict:
    """Megatron's grouped experts: the legacy GroupedMLP and TEGroupedMLP."""
    _cpu_megatron(world)
    res = {}
    for experts in ("grouped", "te"):
        for arch in ("softmax", "sigmoid"):
            res["layer", experts, arch] = _layer_case(rank, world, arch, "feplb-split", torch.float32, experts)
        # other activations (the legacy GroupedMLP has no clamp or offset, and no fused path)
        from megatron.core.activations import squared_relu
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        acts = {"geglu": dict(activation_func=torch.nn.functional.gelu),
                "squared-relu": dict(gated_linear_unit=False, activation_func=squared_relu,
                                     use_fused_weighted_squared_relu=experts == "te")}
        if experts == "te":
            acts["quick-geglu"] = dict(activation_func=quick_gelu, glu_linear_offset=1.0,
                                       activation_func_clamp_value=0.5, bias_activation_fusion=True)
        for label, over in acts.items():
            res["layer", experts, label] = _layer_case(rank, world, "softmax", "feplb-split", torch.float32, experts,
                                                       **over)
        res["bf16", experts] = _layer_case(rank, world, "softmax", "feplb-split", torch.bfloat16, experts)
        if experts == "te":
            # expert biases: fc1's inside Transformer Engine's grouped linear, fc2's returned per expert and weighed
            # by TEGroupedMLP; unfused SwiGLU and gpt-oss's fused quick-GeGLU
            res["layer", experts, "bias"] = _layer_case(rank, world, "softmax", "feplb-split", torch.float32, experts,
                                                        add_bias_linear=True)
            res["layer", experts, "bias-quick-geglu"] = _layer_case(
                rank, world, "softmax", "feplb-split", torch.float32, experts, add_bias_linear=True,
                **acts["quick-geglu"])
            res["train", experts, "bias"] = _train_case(rank, world, "feplb-split+place", "per-microbatch", experts,
                                                        add_bias_linear=True)
            res["state", experts, "bias"] = _grouped_state_case(rank, world, experts, bias=True)
        for policy, weights in (("feplb-split+place", "per-step"), ("feplb-split+place", "per-microbatch")):
            res["train", experts, weights] = _train_case(rank, world, policy, weights, experts)
        res["ddp", experts] = _ddp_case(rank, world, "feplb-split+place", "per-microbatch", True, experts)
        res["state", experts] = _grouped_state_case(rank, world, experts)
    res["refusal"] = _grouped_refusal_case(rank, world)
    # (not the legacy GroupedMLP: its forward asserts config.bf16, which makes Megatron's attention expect bf16)
    for experts in ("sequential", "te"):
        res["gpt", experts] = _gpt_case(rank, world, experts)
    return res


def _grid_job(rank: int, world: int) -> dict:
    """4 ranks as two other Megatron grids: pipeline 2 x EP 2 (stage 0 holds no MoE layer), then EP 2 x expert data
    parallelism 2 under the distributed optimizer's buffers with overlap_param_gather."""
    import contextlib
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer
    from torch import nn

    import feplb.megatron as fm

    out = {}
    _cpu_megatron(world)   # EP = world, then re-made below
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2, expert_model_parallel_size=2)
    stage = ps.get_pipeline_model_parallel_rank()
    model, ref = (make_moe(), make_moe()) if stage == 1 else (nn.Linear(H, H), None)
    out["pp_names"] = fm.apply(model, policy="feplb-split", gpus_per_node=2, **OPTS)
    out["pp_again"] = error_of(lambda: fm.apply(model, **OPTS))   # nothing left on any stage: raised everywhere
    if stage == 1:
        x, g = _inputs(rank)
        ours, theirs = _grads(model, x, g), _grads(ref, x, g)
        out["pp_err"] = max(_rel(ours[n], theirs[n]) for n in theirs)
    dist.barrier()
    ps.destroy_model_parallel()

    # Megatron's DistributedOptimizer needs CUDA; its step is what it does to DDP's buffers: each rank updates its
    # own shard of every bucket, and the parameters' all-gather, which with overlap_param_gather the modules' forward
    # pre-hooks start and wait for, brings the other shards.
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    for experts in ("sequential", "grouped", "te"):   # Megatron's sharded state dict with expert data parallelism
        moe, ref = make_moe(experts=experts), make_moe(experts=experts)
        fm.apply(moe, policy="feplb-split", gpus_per_node=2, **OPTS)
        out["edp_sharded", experts] = _same_sharded(moe, ref)[0]
    errs = {}
    # per-micro-batch weights with overlapped gradient reduction, per-step copies without (and their per-step calls);
    # per-step copies with overlap_param_gather are refused at their refresh, on every rank
    # (the legacy GroupedMLP's parameters are FEPLB's layer's own: Megatron's DDP hooks that layer)
    for weights, overlap, experts in (("per-microbatch", False, "sequential"), ("per-microbatch", True, "sequential"),
                                      ("per-step", False, "sequential"), ("per-step", True, "sequential"),
                                      ("per-microbatch", True, "grouped"), ("per-step", True, "grouped"),
                                      ("per-microbatch", True, "te"), ("per-step", True, "te")):
        models = []
        for ours in (True, False):
            moe = make_moe(experts=experts)
            if ours:
                fm.apply(moe, policy="feplb-split" if weights == "per-microbatch" else "eplb", weights=weights,
                         refresh_every=1, gpus_per_node=2, **OPTS)
            cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=overlap,
                                                overlap_grad_reduce=weights == "per-microbatch")
            models.append((moe, DistributedDataParallel(moe.config, cfg, moe)))
        worst, moved, refused = 0.0, 0, None
        for step in range(3):
            ys = []
            for i, (_, w) in enumerate(models):
                w.zero_grad_buffer()
                x, g = _inputs(rank + 10 * step)
                y = w(x)[0]
                y.backward(g)
                ys.append(y.detach())
                if i == 0:
                    moved += _moved(models[0][0])
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")   # the per-step copies' warning under Megatron's DDP
                        fm.reduce_replica_grads(models[0][0])
                w.finish_grad_sync()
                with torch.no_grad():
                    for bg in w.bucket_groups + w.expert_parallel_bucket_groups:
                        n = bg.intra_distributed_optimizer_instance_size
                        r = bg.intra_distributed_optimizer_instance_rank
                        for b in bg.buckets:
                            shard_buffer(b.param_data, n)[r].sub_(0.05 * shard_buffer(b.grad_data, n)[r])
                    if not overlap:
                        w.start_param_sync()
                if i == 0:
                    refused = error_of(lambda m=models[0][0]: fm.refresh_replicas(m))
                    if refused is not None:
                        break
            if refused is not None:
                break
            theirs = dict(models[1][0].named_parameters())
            worst = max([worst, _rel(ys[0], ys[1])]
                        + [_rel(p.detach(), theirs[n].detach()) for n, p in models[0][0].named_parameters()])
        errs[weights, overlap, experts] = (worst, moved, refused)
        with contextlib.suppress(Exception):
            for _, w in models:
                w.start_param_sync(force_sync=True)
    out["distopt_err"] = errs
    ps.destroy_model_parallel()

    # attention tensor parallelism 2 with sequence parallelism x EP 2, expert tensor parallelism 1: each rank of a
    # tensor-parallel group brings its own sequence shard to the MoE layer (FEPLB's dispatch and Megatron's alike)
    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    tp = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
    # Megatron's norms with sequence parallelism are Transformer Engine's or Apex's (CUDA): torch's LayerNorm stands
    # in, its parameters marked sequence-parallel as theirs are (their gradients summed over the TP group)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def sp_norm(cls, config, hidden_size, eps=1e-5, **kw):
        norm = nn.LayerNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    megatron_norm = WrappedTorchNorm.__new__
    WrappedTorchNorm.__new__ = staticmethod(sp_norm)
    out["tp_ep_ranks"] = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    for dispatcher in ("feplb", "megatron"):
        for arch in ("softmax", "sigmoid"):   # sigmoid: with shared experts, tensor-parallel as the attention
            out["tp", dispatcher, arch] = _layer_case(rank, world, arch, "feplb-split", torch.float32,
                                                      dispatcher=dispatcher, moe_token_dispatcher_type="alltoall", **tp)
        with _cpu_shared_expert_stream():   # their sequence-parallel gather and reduce-scatter on the side stream
            out["tp", dispatcher, "sigmoid-shared-overlap"] = _layer_case(
                rank, world, "sigmoid", "feplb-split", torch.float32, dispatcher=dispatcher,
                moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=True, **tp)
        # a whole GPT model on that grid: attention, embeddings and the loss tensor-parallel, one batch per TP group
        out["tp_gpt", dispatcher] = _gpt_case(rank, world, "sequential", dispatcher,
                                              data_rank=ps.get_data_parallel_rank(), kind="alltoall", **tp)
        # Megatron's DDP (overlapped gradient reduction) over the layer on that grid
        out["tp_ddp", dispatcher] = _ddp_case(rank, world, "feplb-split", "per-microbatch", True,
                                              dispatcher=dispatcher, moe_token_dispatcher_type="alltoall", **tp)
    WrappedTorchNorm.__new__ = megatron_norm
    out["tp_no_sp"] = error_of(lambda: fm.apply(make_moe(**{**tp, "sequence_parallel": False}), **OPTS))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    out["expert_tp"] = error_of(lambda: fm.apply(make_moe(copy_weights=False,
                                                          **{**tp, "expert_tensor_parallel_size": 2}), **OPTS))
    ps.destroy_model_parallel()
    return out


def test_pipeline_stage_without_moe_distributed_optimizer_and_tensor_parallelism():
    res = run_dist(_grid_job, 4, timeout_s=300)
    for rank, r in enumerate(res):
        stage = rank // 2
        assert r["pp_names"] == ([] if stage == 0 else ["experts"])
        assert r["pp_again"] is not None and "found no Megatron-Core MoELayer" in r["pp_again"], r["pp_again"]
        if stage == 1:
            assert r["pp_err"] <= 1e-5
        # the weights each forward reads, against Megatron's layer trained alike (fp32; three steps)
        assert all(r["edp_sharded", experts] for experts in ("sequential", "grouped", "te")), r
        for case, (e, moved, refused) in r["distopt_err"].items():
            if case[:2] == ("per-step", True):
                assert refused is not None and "overlap_param_gather" in refused, refused
                continue
            assert refused is None, (case, refused)
            assert e <= 3e-5, (case, e)   # measured up to 4.5e-6; 1.0 without running the pre-hooks
            if rank == 0:
                assert moved > 0, case
        # tensor parallelism 2 x EP 2: the EP groups are the tensor-parallel pairs, whose ranks hold other tokens
        assert r["tp_ep_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1], r["tp_ep_ranks"]
        for dispatcher in ("feplb", "megatron"):
            for arch in ("softmax", "sigmoid", "sigmoid-shared-overlap"):
                case = r["tp", dispatcher, arch]
                assert case["same_params"] and case["names"] == ["experts"], (dispatcher, arch)
                assert case["shared_in_dispatcher"] == [arch == "sigmoid-shared-overlap"] * 2, (dispatcher, arch)
                for n, e in case["err"].items():
                    # against Megatron's layer on the same grid (measured 4.8e-7)
                    assert e <= 1e-5, (dispatcher, arch, n, e)
                assert case["moved"] > 0, (dispatcher, arch)
            g = r["tp_gpt", dispatcher]
            assert g["names"] == ["decoder.layers.0.mlp.experts", "decoder.layers.1.mlp.experts"] and g["same_names"]
            assert g["loss"] <= 1e-5 and g["grad"] <= 1e-5 and g["weights"] <= 1e-4, (dispatcher, g)
            assert g["moved"] > 0, dispatcher
            d = r["tp_ddp", dispatcher]
            assert d["first"] <= 1e-5 and d["err"] <= 1e-4 and d["warned"] == 0 and d["moved"] > 0, (dispatcher, d)
        assert "tensor parallelism of size 2 without sequence parallelism" in r["tp_no_sp"], r["tp_no_sp"]
        assert "expert tensor parallelism of size 2" in r["expert_tp"], r["expert_tp"]


@contextlib.contextmanager
def _cpu_megatron_optimizer():
    """Megatron's optimizers on the CPU: they check ``param.type()`` against ``torch.cuda.*`` names, and make small
    tensors (loss scales, norms, flags) on ``device="cuda"`` or ``torch.cuda.current_device()``. Inside the block
    the type names read as CUDA's and those tensors are made on the CPU."""
    import importlib

    def on_cpu(make):
        def made(*args, **kwargs):
            d = kwargs.get("device")
            if d is not None and (isinstance(d, int) or torch.device(d).type == "cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return made

    cpu = SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    for n in ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "empty_like"):
        setattr(cpu, n, on_cpu(getattr(torch, n)))
    cpu.cuda = SimpleNamespace(**{n: getattr(torch.cuda, n) for n in dir(torch.cuda) if not n.startswith("__")})
    cpu.cuda.current_device = lambda: "cpu"
    cpu.cuda.FloatTensor = lambda *a: torch.FloatTensor(*a)
    cpu.cuda.IntTensor = lambda *a: torch.IntTensor(*a)
    saved = []
    for name in ("megatron.core.optimizer", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads",
                 "megatron.core.optimizer.grad_scaler", "megatron.core.distributed.param_and_grad_buffer",
                 "megatron.core.distributed.finalize_model_grads", "megatron.core.utils"):
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            saved.append(mod)
            mod.torch = cpu
    type_name = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: type_name(self, *a, **k) if a or k else \
        type_name(self).replace("torch.", "torch.cuda.", 1)
    try:
        yield
    finally:
        torch.Tensor.type = type_name
        for mod in saved:
            mod.torch = torch


def _distopt_job(rank: int, world: int) -> dict:
    """Megatron's own DistributedOptimizer (Adam; through ``get_megatron_optimizer``) at EP 2 x expert data
    parallelism 2, over a GPT model of two MoE layers with per-step copies (``eplb``), in fp32 and bf16: each rank's
    optimizer steps one shard of the flat expert buffer (its main copies, in bf16) and all-gathers the rest. The
    expert gradients with copies in use against Megatron's own model from the same weights, and a forgotten
    ``refresh_replicas`` after its step refused at the next forward, on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import feplb.megatron as fm

    _cpu_megatron(world)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]
    pos = torch.arange(SEQ).expand(2, SEQ)
    out = {"edp": ps.get_expert_data_parallel_world_size()}
    for dtype in (torch.float32, torch.bfloat16):
        half = dtype == torch.bfloat16
        built = []
        # ours, Megatron's, and in bf16 Megatron's fp32 model (no optimizer): the gradients' reference
        for ours, kind in ((True, dtype), (False, dtype)) + (((False, torch.float32),) if half else ()):
            m = make_gpt(params_dtype=kind, bf16=kind == torch.bfloat16)
            if ours:
                fm.apply(m, policy="eplb", weights="per-step", gpus_per_node=2, **OPTS)
            ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True), m)
            opt = None
            if kind == dtype:
                with _cpu_megatron_optimizer():
                    opt = get_megatron_optimizer(OptimizerConfig(
                        optimizer="adam", lr=1e-2, bf16=half, params_dtype=dtype, use_distributed_optimizer=True),
                        [ddp])
            built.append((m, ddp, opt))

        def train(m, ddp, opt, step, ours, update=True):
            ddp.zero_grad_buffer()
            if opt is not None:
                opt.zero_grad()
            for mb in range(2):
                ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(
                    70 + rank + 10 * step + 100 * mb))
                m(ids, pos, mask, labels=ids.roll(-1, 1)).float().mean().backward()
            if ours:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")    # the per-step copies' warning under Megatron's DDP
                    fm.reduce_replica_grads(m)
            ddp.finish_grad_sync()
            grads = {n: p.main_grad.detach().double().clone() for n, p in m.named_parameters() if ".experts." in n}
            if update:
                with _cpu_megatron_optimizer():
                    opt.step()
            return grads

        (m, ddp, opt), (rm, rddp, ropt) = built[:2]
        layers = fm.experts_modules(m)
        train(m, ddp, opt, 0, True)
        train(rm, rddp, ropt, 0, False)
        fm.refresh_replicas(m)
        held = sum(len(layer.replicas.all_pairs()) for layer in layers)
        with torch.no_grad():     # Megatron's models from our weights (their optimizers are not stepped again)
            for other, _, _ in built[1:]:
                theirs = dict(other.named_parameters())
                for n, p in m.named_parameters():
                    theirs[n].copy_(p)
        ours_g = train(m, ddp, opt, 1, True)
        moved = torch.tensor([sum(layer.last_stats.rows_moved for layer in layers)])
        dist.all_reduce(moved)
        ref_g = train(rm, rddp, ropt, 1, False, update=False)
        fp32_g = train(*built[2], 1, False, update=False) if half else ref_g

        def off(got, want=fp32_g):
            return max(float((got[n] - want[n]).abs().max()) / max(float(want[n].abs().max()), 1e-30) for n in want)
        err = off(ours_g), off(ref_g)
        # the step above updated the experts: every layer's copies are stale on every rank, also where this rank's
        # shard held none of the layer's experts; refresh_replicas forgotten: the next forward refuses them
        marked = [not layer.replicas.fresh() for layer in layers]
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
        stale = error_of(lambda m=m, ids=ids: m(ids, pos, mask))
        fm.refresh_replicas(m)
        again = error_of(lambda m=m, ids=ids: m(ids, pos, mask))
        out[str(dtype)] = {"held": held, "moved": int(moved), "err": err, "grads": len(ref_g), "stale": stale,
                           "again": again, "marked": marked}
        if half:
            continue
        # a backward the loop discards (Megatron's zero_grad_buffer, no step) while the copies hold their share:
        # the next forward refuses on every rank (the share reached the next step's main_grad, silently); after
        # zero_replica_grads the step is Megatron's own again
        ddp.zero_grad_buffer()
        m(ids, pos, mask, labels=ids.roll(-1, 1)).float().mean().backward()
        ddp.zero_grad_buffer()
        discarded = error_of(lambda m=m, ids=ids: m(ids, pos, mask))
        fm.zero_replica_grads(m)
        with torch.no_grad():
            theirs = dict(rm.named_parameters())
            for n, p in m.named_parameters():
                theirs[n].copy_(p)
        after = off(train(m, ddp, opt, 2, True, update=False), train(rm, rddp, ropt, 2, False, update=False))
        out[str(dtype)].update(discarded=discarded, after_discard=after)
    ps.destroy_model_parallel()
    return out


def test_megatrons_distributed_optimizer_with_per_step_copies():
    res = run_dist(_distopt_job, 4, timeout_s=300)
    for rank, r in enumerate(res):
        assert r["edp"] == 2
        for dtype, case in r.items():
            if dtype == "edp":
                continue
            assert case["grads"] > 0 and case["moved"] > 0, (dtype, case)
            # fp32 exact; bf16 within twice the error Megatron's own bf16 model makes against its fp32 one
            ours, theirs = case["err"]
            if dtype == "torch.float32":
                assert ours <= 1e-5, (rank, ours)
            else:
                assert theirs > 0 and ours <= 2 * theirs, (rank, ours, theirs)
            assert case["stale"] is not None and "changed since the last refresh_replicas()" in case["stale"], \
                (rank, dtype, case["stale"])
            assert case["again"] is None, (rank, dtype, case["again"])
            assert case["marked"] == [True, True], (rank, dtype, case["marked"])
            if dtype == "torch.float32":
                assert case["discarded"] is not None and "Megatron's zero_grad_buffer" in case["discarded"], \
                    (rank, case["discarded"])
                assert case["after_discard"] <= 1e-5, (rank, case["after_discard"])
    assert any(case["held"] for r in res for k, case in r.items() if k != "edp")


@pytest.fixture(scope="module", params=[1, 4], ids=["1rank", "4ranks"])
def job(request):
    world = request.param
    return world, run_dist(_job, world, timeout_s=600)


def test_layer_matches_megatron_fp32(job):
    world, res = job
    for r in res:
        for key, case in r.items():
            if key[0] != "layer" or key[3] != "fp32":
                continue
            assert case["names"] == ["experts"] and case["same_names"], key
            assert case["out_dtype"] == torch.float32
            for n, e in case["err"].items():
                assert e <= 1e-5, (key, n, e)
            # SequentialMLP's weights, stacked every forward (w1, w2, and b1, b2 with biases), are not kept
            # (nor, once the backward has run, those derived again, though the output is still held)
            assert case["derived"] == (4 if key[1].startswith("bias") else 2, [0], [0]), (key, case["derived"])
            if key[1] in ("sigmoid", "sigmoid-shared-overlap"):
                assert case["bias_counts_equal"] and case["bias_counts_sum"] == TOKENS[0] * TOKENS[1] * K
            assert case["shared_in_dispatcher"] == [key[1] == "sigmoid-shared-overlap"] * 2, key
            if key[1] == "softmax":
                assert "experts: local_experts.0.linear_fc1.weight [" in (case["stepped"] or ""), (key, case)
                assert "was modified in place" in case["stepped"], (key, case["stepped"])
                # (raised by the output's check, before any of the layer's backward: the same on every rank)
                assert "seen as the layer's output gradient arrived" in case["stepped"], (key, case["stepped"])
    if world > 1:
        # balancing really ran: feplb-split moved rows, none did not
        assert res[0]["layer", "softmax", "feplb-split", "fp32"]["moved"] > 0
        assert res[0]["layer", "sigmoid", "feplb-split", "fp32"]["moved"] > 0
        assert res[0]["layer", "sigmoid-shared-overlap", "feplb-split", "fp32"]["moved"] > 0
        assert res[0]["layer", "softmax", "none", "fp32"]["moved"] == 0
        assert res[0]["layer", "probs-on-input", "feplb-split", "fp32"]["moved"] > 0
        for label in ("geglu", "clamped", "quick-geglu", "squared-relu", "silu-plain", "gelu-plain", "bias",
                      "bias-sigmoid", "bias-quick-geglu", "bias-probs-on-input", "bias-fused-quick-geglu"):
            assert res[0]["layer", label, "feplb-split", "fp32"]["moved"] > 0, label
        assert res[0]["layer", "bias", "none", "fp32"]["moved"] == 0
        for drop in ("probs", "position"):
            assert res[0]["layer", f"capacity-{drop}", "feplb-split", "fp32"]["moved"] > 0, drop
        # the biases' gradients are compared (each expert's, under Megatron's names)
        errs = res[0]["layer", "bias", "feplb-split", "fp32"]["err"]
        assert {n for n in errs if n.endswith(".bias")} == {"router.bias"} | {
            f"experts.local_experts.{i}.linear_fc{j}.bias" for i in range(E // world) for j in (1, 2)}
    for r in res:   # tokens were dropped: the capacity cases mask slots on every rank, and send no row for them
        for drop in ("probs", "position"):
            case = r["layer", f"capacity-{drop}", "feplb-split", "fp32"]
            assert case["dropped"] > 0, drop
            assert case["sent"] == TOKENS[0] * TOKENS[1] * K - case["dropped"], (drop, case["sent"], case["dropped"])


def test_shared_expert_overlap_after_a_refusal(job):
    world, res = job
    for r in res:
        case = r["overlap-after-refusal"]
        assert case["refused"] is not None and "forward_hooks" in case["refused"], case["refused"]
        for n, e in case["err"].items():
            assert e <= 1e-5, (n, e)


def test_two_layers(job):
    _, res = job
    for r in res:
        c = r["two_layers"]
        assert c["names"] == ["layers.0.experts", "layers.1.experts"] and c["distinct"] and c["same_keys"]
        assert c["err"] <= 1e-5, c["err"]


def test_layer_bf16_within_megatrons_error(job):
    world, res = job
    for r in res:
        for arch in ("softmax", "quick-geglu") + (("bias-quick-geglu",) if world > 1 else ()):
            case = r["layer", arch, "feplb-split", "bf16"]
            assert case["out_dtype"] == torch.bfloat16
            assert case["param_dtypes"] == ["torch.bfloat16"]
            for n, (ours, theirs) in case["err"].items():
                # With biases, Megatron adds p * b2 in fp32 (the router's fp32 probability times the bias) into the
                # bf16 output, so the gradients of b2 and of the router see no bf16 rounding of the biased output;
                # FEPLB weighs the biased expert output, p * (y + b2), as transformers' gpt-oss does, whose
                # gradient is the bf16 gradient of that output (as w2's is). There: within 2x Megatron's error or
                # 4 bf16 unit roundoffs of the largest element (measured: 6.7e-3 against Megatron's 1.6e-3 for a
                # b2, 8.4e-3 against 3.5e-3 for the router; a lost or swapped bias is off by its whole size).
                loose = arch.startswith("bias") and (n.startswith("router.") or n.endswith("linear_fc2.bias"))
                assert ours <= (max(2 * theirs, 2 ** -6) if loose else 2 * theirs + 1e-6), (arch, n, ours, theirs)
    if world > 1:
        assert res[0]["layer", "softmax", "feplb-split", "bf16"]["moved"] > 0
        assert res[0]["layer", "bias-quick-geglu", "feplb-split", "bf16"]["moved"] > 0


def test_training_matches_megatron(job):
    world, res = job
    for r in res:
        for key, case in r.items():
            if key[0] != "train":
                continue
            # both fp32, summing the same terms in different orders (Megatron weighs each expert's activation,
            # FEPLB its output): within 1e-4 of the update (measured up to 3.9e-5, the router's)
            for n, e in case["err"].items():
                assert e <= 1e-4, (key, n, e)
    for r in res:
        # tokens dropped at capacity: balancing on equals balancing off (the same FEPLB sums); both against
        # Megatron's layer within 2.5e-4 of the update (measured up to 1.6e-4: the router of a rank whose
        # update, from the tokens its capacity kept, is small; the same without balancing)
        on, off = r["train-capacity", "feplb-split+place"], r["train-capacity", "none"]
        for n, upd in off["update"].items():
            diff = float((on["final"][n].double() - off["final"][n].double()).abs().max())
            assert diff <= 1e-5 * (upd or 1.0), (n, diff, upd)
            assert on["err"][n] <= 2.5e-4 and off["err"][n] <= 2.5e-4, (n, on["err"][n], off["err"][n])
    if world > 1:
        assert res[0]["train-capacity", "feplb-split+place"]["moved"] > 0
        for key in (("train", "eplb", "per-step"), ("train", "feplb-split+place", "per-microbatch"),
                    ("train", "bias", "per-step"), ("train", "bias", "per-microbatch"), ("train", "bias", "eplb"),
                    ("train", "shared-overlap", "per-step"), ("train", "feplb-split@ema", "lazy")):
            assert res[0][key]["moved"] > 0, key
        assert res[0]["train", "feplb-split@ema", "lazy"]["held"] > 0, "lazy replicas held no copy"
        # a bias's gradient changed in place after the backward is refused, on every rank
        assert res[0]["bias_grads_changed"][0] > 0, "eplb held no copy in the second step"
        assert all("changed in place" in (r["bias_grads_changed"][1] or "") for r in res), [r["bias_grads_changed"]
                                                                                          for r in res]
        # the biases trained too (every expert's: the +place bank's per-step copies, eplb's resident replicas,
        # per-micro-batch copies)
        for weights in ("per-step", "per-microbatch", "eplb"):
            assert sum(n.startswith("experts.") and n.endswith(".bias")
                       for n in res[0]["train", "bias", weights]["err"]) == 2 * E // world


def test_state_dicts_and_checkpoint(job):
    _, res = job
    for r in res:
        s = r["state"]
        assert s["keys"] and s["equal"] and s["offload_equal"]
        assert s["local_keys"] == sorted(["router.weight"] + [f"experts.local_experts.{i}.linear_fc{j}.{k}"
                                                              for i in range(E // len(res)) for j in (1, 2)
                                                              for k in ("weight", "_extra_state")])
        # Megatron's distributed checkpoint sees exactly what it sees of its own layer: same keys, global offsets,
        # replica ids, data
        assert s["sharded_same"] and s["sharded_experts"] == 2 * 2 * E // len(res)   # weight, extra state
        assert s["ckpt_equal"]
        assert s["plain_local"], r
        assert s["no_dtensor_type"] is not None and "sharded_state_dict" in s["no_dtensor_type"], s["no_dtensor_type"]
        assert s["default_weights"] == "per-microbatch"
        assert s["te_extra"] == sorted(f"experts.local_experts.{e}.linear_fc1._extra_state" for e in range(E))
        if len(res) > 1:   # experts with biases (see _job): every expert's under its global index
            s = r["state_bias"]
            assert s["keys"] and s["equal"] and s["offload_equal"] and s["sharded_same"] and s["ckpt_equal"]
            assert s["local_keys"] == sorted(["router.weight", "router.bias"] + [
                f"experts.local_experts.{i}.linear_fc{j}.{k}" for i in range(E // len(res)) for j in (1, 2)
                for k in ("weight", "bias", "_extra_state")])
            assert s["sharded_experts"] == 3 * 2 * E // len(res)   # weight, bias, extra state


def test_refusals_on_every_rank(job):
    world, res = job
    for rank, r in enumerate(res):
        f = r["refusal"]
        for label, why in (("gelu_fused", "gated gelu with bias_activation_fusion"),
                           ("clamp_fused", "Megatron's fused SwiGLU ignores the clamp"),
                           ("offset", "FEPLB takes an offset with quick_gelu only"),
                           ("pad", "padding experts' inputs to capacity"),
                           ("plain_tanh", "activation tanh (non-gated)"), ("fp8_store", "stored in fp8"),
                           ("bias_fused_swiglu", "fused weighted SwiGLU takes no bias"),
                           ("bias_fused_clamp", "clamps before adding linear_fc1's bias")):
            err, before, after = f[label]
            assert err is not None and err.startswith("ValueError") and why in err, (label, err)
            assert before == after == "SequentialMLP", label
        err, after = f["hook"]
        assert err is not None and "hooks" in err and after == "SequentialMLP"
        if world > 1:
            assert f"EP rank(s) [{world - 1}]" in err
        assert f["derived"] is not None and f["derived"].startswith("TypeError") and "top_k" in f["derived"]
        assert f["dtype"] is not None and "dtype=torch.int8" in f["dtype"]
        assert f["again"] is not None and "already replaced" in f["again"]
        assert f["dispatched"].startswith("TypeError") and "forward pre-hooks" in f["dispatched"], f["dispatched"]
        assert f["pre_hook_calls"] == [torch.Size([TOKENS[0] * TOKENS[1], H])]
        late = f["late_hook"]   # the rank with the hook says why, its peers which rank stopped them
        assert late is not None, rank
        if rank == world - 1:
            assert late.startswith("RuntimeError") and "forward_hooks" in late, late
        else:
            assert f"EP rank(s) [{world - 1}]" in late, late
        assert f["usable_again"] is None, f["usable_again"]
        assert "moe_pad_expert_input_to_capacity was turned on after" in f["padded_later"], f["padded_later"]
        assert f["unpadded_again"] is None, f["unpadded_again"]
        swap = f["input_hook"]
        assert swap is not None and ("returned new inputs" in swap if rank == 0 else "EP rank(s) [0]" in swap), swap
        assert f["hook_in_backward"] is None, f["hook_in_backward"]
        assert f["hook_after_backward"] is not None


def test_cuda_graphs_chunks_and_overlapped_grad_reduce(job):
    world, res = job
    for rank, r in enumerate(res):
        u = r["usage"]
        assert u["graph_attn"] is None and u["graph_attn/forward"] is None, u
        for label in ("graph_router", "graph_whole", "graph_local_attn"):
            assert u[label] is not None and u[label].startswith("ValueError") and "CUDA graphs" in u[label] and \
                "cuda_graph_scope=" in u[label], (label, u[label])
        assert u["chunks"] == ["1.experts"] and u["chunks/refresh"] is None and u["chunks/forward"] is None, u
        if world > 1:
            assert u["overlap"] is not None and u["overlap"].startswith("ValueError") and \
                "overlap_grad_reduce=True" in u["overlap"], (rank, u["overlap"])
            assert u["overlap/inner"] is None and u["overlap/warned"], (rank, u)
            for call in ("clip", "average"):
                err = u["ddp/" + call]
                assert err is not None and err.startswith("ValueError") and "Megatron DDP's buffers (main_grad" in \
                    err and "Nothing was done, on any rank" in err, (rank, call, err)
            assert u["ddp/kept"], rank


def test_under_megatron_ddp_and_recompute(job):
    world, res = job
    for r in res:
        for key, case in r.items():
            if key[0] == "recompute":
                assert case["err"] <= 1e-5, (key, case["err"])
            if key[0] == "ddp":
                # the first step's reduced gradients (the same weights) at the exactness criterion; the second's
                # after an SGD step of each model, whose fp32 rounding differs (measured up to 5.2e-5, the router's)
                assert case["first"] <= 1e-5, (key, case["first"])
                assert case["err"] <= 1e-4, (key, case["err"])
    if world > 1:
        for key, case in res[0].items():
            # rows really moved (eplb's first forwards have no history to replicate from)
            if key[0] == "ddp" or key[:2] == ("recompute", "feplb-split"):
                assert case["moved"] > 0, key
            # per-step copies under Megatron's DDP say what they need (once per layer); per-micro-batch ones need
            # nothing
            if key[0] == "ddp":
                assert case["warned"] == (1 if key[2] == "per-step" else 0), (key, case["warned"])


def _decode_padding_case(rank: int, world: int) -> dict:
    """Padding to capacity turned on after apply on the model's config, as Megatron's set_decode_expert_padding sets
    it (``get_model_config(model)``, which the router reads): SequentialMLP experts whose moe_ffn_hidden_size differs
    from ffn_hidden_size hold a deep copy of that config, which does not see the change."""
    import feplb.megatron as fm

    _cpu_megatron(world)
    over = dict(moe_token_dispatcher_type="alltoall")
    moe, ref = make_moe("softmax", **over), make_moe("softmax", **over)
    fm.apply(moe, policy="feplb-split", gpus_per_node=min(2, world), **OPTS)
    out = {"copied": moe.experts.megatron_config is not moe.config}
    x, g = _inputs(rank)
    for m in (moe, ref):
        m.config.moe_pad_expert_input_to_capacity, m.config.moe_expert_capacity_factor = True, 1.0
    out["padded"] = error_of(lambda: moe(x))
    for m in (moe, ref):
        m.config.moe_pad_expert_input_to_capacity, m.config.moe_expert_capacity_factor = False, None
    ours, theirs = _grads(moe, x, g), _grads(ref, x, g)
    out["err"] = {n: _rel(ours[n], theirs[n]) for n in theirs}
    return out


def test_decode_padding_on_the_models_config_is_refused():
    """The router pads the routing map to capacity (more than k routes per token), which FEPLB's dispatch would
    read as top-k routes: silently wrong outputs. Refused on every rank; the layer works again once it is off."""
    res = run_dist(_decode_padding_case, 2, timeout_s=300)
    for r in res:
        assert r["copied"]   # (the case this covers: the experts' config is Megatron's deep copy)
        assert "moe_pad_expert_input_to_capacity was turned on after" in (r["padded"] or ""), r["padded"]
        for n, e in r["err"].items():
            assert e <= 1e-5, (n, e)


def _own_dispatcher_refusal_case(rank: int, world: int) -> dict:
    """Behind Megatron's dispatcher: the policies that move tokens, and an unknown dispatcher, refused on every rank
    with nothing replaced; bad dispatched probabilities on one rank stop every rank; a direct forward_dispatched
    refused."""
    import feplb.megatron as fm

    out = {}
    for policy in ("feplb-split+place", "eplb", "fastermoe"):
        moe = make_moe(moe_token_dispatcher_type="alltoall")
        out["policy", policy] = (error_of(lambda m=moe, p=policy: fm.apply(m, policy=p, token_dispatcher="megatron",
                                                                          **OPTS)),
                                 type(moe.experts).__name__, type(moe.token_dispatcher).__name__)
    moe = make_moe(moe_token_dispatcher_type="alltoall")
    out["unknown"] = (error_of(lambda: fm.apply(moe, token_dispatcher="deepep", **OPTS)), type(moe.experts).__name__)
    # one rank behind another dispatcher: its forwards would run other collectives than its peers'
    mixed = "feplb" if rank == 0 else "megatron"
    out["mixed"] = (error_of(lambda: fm.apply(moe, token_dispatcher=mixed, **OPTS)), type(moe.experts).__name__,
                    type(moe.token_dispatcher).__name__)
    fm.apply(moe, policy="feplb-split", gpus_per_node=min(2, world), token_dispatcher="megatron", **OPTS)
    L = E // world
    rows = torch.randn(3 * L, H)
    probs = torch.rand(3 * L - 1 if rank == 0 else 3 * L)
    out["bad_probs"] = error_of(lambda: moe.experts(rows, torch.tensor([3] * L), probs))
    out["bad_counts"] = error_of(lambda: moe.experts(rows, torch.tensor([3] * (L - 1) + [2 if rank == 1 else 3]),
                                                     torch.rand(3 * L)))
    out["routing_pair"] = error_of(lambda: moe.experts(rows, None, (torch.zeros(3, K).long(), torch.rand(3, K))))
    pair = (torch.zeros(3 * L, K).long(), torch.rand(3 * L, K))   # the wrong kind of routing on one rank only
    out["routing_pair_one_rank"] = error_of(lambda: moe.experts(rows, torch.tensor([3] * L),
                                                                pair if rank == 2 else torch.rand(3 * L)))
    out["probs_device"] = error_of(lambda: moe.experts(rows, torch.tensor([3] * L),
                                                       torch.rand(3 * L, device="meta" if rank == 3 else "cpu")))
    out["direct"] = error_of(lambda: moe.experts.forward_dispatched(rows, [3] * L))
    x, _ = _inputs(rank)
    out["usable_again"] = error_of(lambda: moe(x))
    return out


def _own_ckpt_case(rank: int, world: int) -> dict:
    """A non-reentrant checkpoint around the layer (Megatron's dispatcher inside): the same gradients."""
    import feplb.megatron as fm

    moe = make_moe(moe_token_dispatcher_type="alltoall")
    fm.apply(moe, policy="feplb-split", gpus_per_node=min(2, world), token_dispatcher="megatron", **OPTS)
    return {"equal": _checkpoint_equal(moe, rank), "moved": _moved(moe)}


def _flex_stand_in_case(rank: int, world: int) -> dict:
    """The DeepEP stand-in checked against Megatron's alltoall dispatcher: Megatron's own layers (no FEPLB), the same
    weights and tokens, behind either dispatcher; with capacity drops too (DeepEP's -1 slots)."""
    out = {}
    for label, over in (("plain", {}), ("capacity", dict(moe_expert_capacity_factor=1.0))):
        x, g = _inputs(rank)
        flex = _grads(make_moe(moe_token_dispatcher_type="flex", **over), x, g)
        a2a = _grads(make_moe(moe_token_dispatcher_type="alltoall", **over), x, g)
        out[label] = {n: _rel(flex[n], a2a[n]) for n in a2a}
    return out


def _own_dispatcher_job(rank: int, world: int) -> dict:
    """feplb.megatron.apply(..., token_dispatcher="megatron"): Megatron's alltoall and allgather dispatchers kept,
    and its flex dispatcher over a stand-in of DeepEP."""
    _cpu_megatron(world)
    _cpu_deepep()
    from megatron.core.activations import quick_gelu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu as fused_quick_gelu

    res = {}
    for kind in ("alltoall", "allgather"):
        for policy in ("feplb-split", "none", "lp"):
            res["layer", kind, "softmax", policy] = _layer_case(
                rank, world, "softmax", policy, torch.float32, dispatcher="megatron", moe_token_dispatcher_type=kind)
    # DeepEP's contract (rows once per rank, local top-k ids, fp32 probabilities, counts on the host)
    res["flex-stand-in"] = _flex_stand_in_case(rank, world)
    flex = dict(dispatcher="megatron", moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    for label, arch, over in (("softmax", "softmax", {}), ("sigmoid", "sigmoid", {}),
                              ("capacity", "softmax", dict(moe_expert_capacity_factor=1.0))):
        for policy in ("feplb-split", "none") if label == "softmax" else ("feplb-split",):
            res["layer", "flex", label, policy] = _layer_case(rank, world, arch, policy, torch.float32, **flex,
                                                              **over)
    res["layer", "flex", "te-bias", "feplb-split"] = _layer_case(rank, world, "softmax", "feplb-split",
                                                                 torch.float32, "te", **flex, add_bias_linear=True)
    res["bf16", "flex"] = _layer_case(rank, world, "softmax", "feplb-split", torch.bfloat16, **flex)
    a2a = dict(dispatcher="megatron", moe_token_dispatcher_type="alltoall")
    oss = dict(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=0.5)
    for label, arch, experts, over in (
            ("sigmoid", "sigmoid", "sequential", {}),   # expert groups, scaling, load-balancing bias, shared experts
            ("probs-on-input", "softmax", "sequential", dict(moe_apply_probs_on_input=True, moe_router_topk=1,
                                                             moe_router_pre_softmax=True)),
            ("capacity", "softmax", "sequential", dict(moe_expert_capacity_factor=1.0)),
            # padded to capacity: every expert gets its capacity of rows, the padding weighed 0 (refused with
            # FEPLB's own dispatch)
            ("pad-capacity", "softmax", "sequential", dict(moe_expert_capacity_factor=1.0,
                                                           moe_pad_expert_input_to_capacity=True)),
            # the bias inside the unweighted output of rows weighed on the input
            ("bias-probs-on-input", "softmax", "sequential", dict(add_bias_linear=True, moe_apply_probs_on_input=True,
                                                                  moe_router_topk=1, moe_router_pre_softmax=True)),
            ("fp64-router", "softmax", "sequential", dict(moe_router_dtype="fp64")),   # weighed in fp64, as Megatron
            ("bias-quick-geglu", "softmax", "sequential", dict(add_bias_linear=True, **oss)),
            ("te-bias", "softmax", "te", dict(add_bias_linear=True)),
            ("te-fused-quick-geglu", "softmax", "te", dict(oss, bias_activation_fusion=True,
                                                           activation_func=fused_quick_gelu)),
            ("grouped", "softmax", "grouped", {})):
        res["layer", "alltoall", label, "feplb-split"] = _layer_case(rank, world, arch, "feplb-split", torch.float32,
                                                                     experts, **a2a, **over)
    with _cpu_shared_expert_stream():   # Megatron's dispatcher overlaps the shared experts with its own exchange
        res["layer", "alltoall", "sigmoid-shared-overlap", "feplb-split"] = _layer_case(
            rank, world, "sigmoid", "feplb-split", torch.float32, **a2a, moe_shared_expert_overlap=True)
    res["bf16", "softmax"] = _layer_case(rank, world, "softmax", "feplb-split", torch.bfloat16, **a2a)
    res["bf16", "te-bias"] = _layer_case(rank, world, "softmax", "feplb-split", torch.bfloat16, "te", **a2a,
                                         add_bias_linear=True)
    for policy, weights in (("feplb-split", "per-microbatch"), ("feplb-split@ema", "per-step")):
        res["train", policy, weights] = _train_case(rank, world, policy, weights, **a2a)
    res["ddp"] = _ddp_case(rank, world, "feplb-split", "per-microbatch", True, **a2a)
    res["recompute"] = _recompute_case(rank, world, "feplb-split", "per-microbatch", **a2a)
    with _cpu_shared_expert_stream():
        res["recompute-overlap"] = _recompute_case(rank, world, "feplb-split", "per-microbatch", arch="sigmoid",
                                                   moe_shared_expert_overlap=True, **a2a)
        res["ddp-overlap"] = _ddp_case(rank, world, "feplb-split", "per-microbatch", True, arch="sigmoid",
                                       moe_shared_expert_overlap=True, **a2a)
    res["ckpt"] = _own_ckpt_case(rank, world)
    res["gpt"] = _gpt_case(rank, world, "te", dispatcher="megatron")
    res["refusal"] = _own_dispatcher_refusal_case(rank, world)
    return res


@pytest.fixture(scope="module")
def own_dispatcher_job():
    return run_dist(_own_dispatcher_job, 4, timeout_s=600)


def test_behind_megatrons_own_dispatcher_the_layer_matches_megatron(own_dispatcher_job):
    """The experts replaced, Megatron's alltoall / allgather / flex (DeepEP, a stand-in) dispatcher kept: outputs and
    every gradient against Megatron's layer with the same dispatcher; rows really move between the GPUs of a
    node."""
    res = own_dispatcher_job
    for r in res:
        for key, case in r.items():
            if key[0] != "layer":
                continue
            assert case["names"] == ["experts"] and case["same_names"] and case["same_params"], key
            # the dispatcher is Megatron's own, the same object kind as the reference's
            assert case["dispatcher"] == {"alltoall": "MoEAlltoAllTokenDispatcher",
                                          "allgather": "MoEAllGatherTokenDispatcher",
                                          "flex": "MoEFlexTokenDispatcher"}[key[1]], key
            assert case["shared_in_dispatcher"] == [key[2] == "sigmoid-shared-overlap"] * 2, key
            for n, e in case["err"].items():
                assert e <= 1e-5, (key, n, e)
        # the stand-in of DeepEP computes Megatron's layer as its alltoall dispatcher does
        for label, errs in r["flex-stand-in"].items():
            for n, e in errs.items():
                assert e <= 1e-5, ("flex stand-in", label, n, e)
        for key in (("bf16", "softmax"), ("bf16", "te-bias"), ("bf16", "flex")):
            case = r[key]
            assert case["out_dtype"] == torch.bfloat16
            for n, (ours, theirs) in case["err"].items():
                # FEPLB weighs fc2's output (bias included) by the fp32 probability, Megatron the activation before
                # fc2 (and fc2's bias beside it, in fp32): see test_layer_bf16_within_megatrons_error. With biases
                # the weights' gradients too differ by bf16 roundings of their own: within 2x Megatron's error or 4
                # bf16 unit roundoffs of the largest element (measured: 1.2e-2 against Megatron's 5.7e-3 for a
                # linear_fc1.weight, the same with FEPLB's own dispatch; a lost or swapped bias is off by its size)
                loose = key[1] == "te-bias" and n not in ("out", "x")
                assert ours <= (max(2 * theirs, 2 ** -6) if loose else 2 * theirs + 1e-6), (key, n, ours, theirs)
    assert all(r["layer", "flex", "capacity", "feplb-split"]["dropped"] > 0 for r in res)
    for key, case in res[0].items():
        if key[0] in ("layer", "bf16"):
            # padded to capacity, every GPU computes the same number of rows: nothing to balance, nothing moves (the
            # same skewed routing moves rows unpadded, so this also shows the padding took effect)
            still = key[-1] == "none" or (key[0] == "layer" and key[2] == "pad-capacity")
            assert case["moved"] == 0 if still else case["moved"] > 0, (key, case["moved"])
    assert all(r["layer", "alltoall", "capacity", "feplb-split"]["dropped"] > 0 for r in res)   # tokens were dropped


def test_behind_megatrons_own_dispatcher_training_ddp_recompute_and_gpt(own_dispatcher_job):
    res = own_dispatcher_job
    for r in res:
        for policy in (("feplb-split", "per-microbatch"), ("feplb-split@ema", "per-step")):
            for n, e in r[("train", *policy)]["err"].items():
                assert e <= 1e-4, (policy, n, e)
        assert r["ddp"]["first"] <= 1e-5 and r["ddp"]["err"] <= 1e-4, r["ddp"]
        assert r["ddp"]["warned"] == 0
        assert r["recompute"]["err"] <= 1e-5, r["recompute"]
        assert r["recompute-overlap"]["err"] <= 1e-5 and r["recompute-overlap"]["moved"] > 0, r["recompute-overlap"]
        ddp = r["ddp-overlap"]   # the shared experts on Megatron's side stream, under its DDP
        assert ddp["first"] <= 1e-5 and ddp["err"] <= 1e-4 and ddp["warned"] == 0 and ddp["moved"] > 0, ddp
        assert r["ckpt"]["equal"]
        g = r["gpt"]
        assert g["names"] == ["decoder.layers.0.mlp.experts", "decoder.layers.1.mlp.experts"] and g["same_names"]
        assert g["loss"] <= 1e-5 and g["grad"] <= 1e-5 and g["weights"] <= 1e-4, g
    r = res[0]
    for case in (r["train", "feplb-split", "per-microbatch"], r["train", "feplb-split@ema", "per-step"], r["ddp"],
                 r["recompute"], r["ckpt"], r["gpt"]):
        assert case["moved"] > 0


def test_behind_megatrons_own_dispatcher_refusals(own_dispatcher_job):
    res = own_dispatcher_job
    for rank, r in enumerate(res):
        f = r["refusal"]
        for policy in ("feplb-split+place", "eplb", "fastermoe"):
            err, experts, dispatcher = f["policy", policy]
            assert err is not None and err.startswith("ValueError") and f"policy {policy!r}" in err, err
            assert "token_dispatcher='megatron'" in err, err
            assert (experts, dispatcher) == ("SequentialMLP", "MoEAlltoAllTokenDispatcher"), policy
        err, experts = f["unknown"]
        assert err is not None and "token_dispatcher='deepep'" in err and experts == "SequentialMLP", err
        # the bad rank says what was wrong, its peers which rank stopped them
        bad = f["bad_probs"]
        assert bad is not None and ("one float per row" in bad if rank == 0 else "EP rank(s) [0]" in bad), bad
        bad = f["bad_counts"]
        assert bad is not None and ("add up to" in bad if rank == 1 else "EP rank(s) [1]" in bad), bad
        assert f["routing_pair"] is not None and f["routing_pair"].startswith("TypeError"), f["routing_pair"]
        assert "token_dispatcher='megatron'" in f["routing_pair"], f["routing_pair"]
        one = f["routing_pair_one_rank"]
        assert one is not None and ("token_dispatcher='megatron'" in one if rank == 2 else "EP rank(s) [2]" in one), one
        dev = f["probs_device"]
        assert dev is not None and ("on meta" in dev if rank == 3 else "EP rank(s) [3]" in dev), dev
        err, experts, dispatcher = f["mixed"]
        assert err is not None and err.startswith("ValueError") and "'feplb', 'megatron'" in err, err
        assert (experts, dispatcher) == ("SequentialMLP", "MoEAlltoAllTokenDispatcher")
        assert f["direct"] is not None and f["direct"].startswith("TypeError"), f["direct"]
        assert f["usable_again"] is None, f["usable_again"]


@pytest.fixture(scope="module", params=[1, 4], ids=["1rank", "4ranks"])
def grouped_job(request):
    world = request.param
    return world, run_dist(_grouped_job, world, timeout_s=600)


def test_grouped_experts_match_megatron(grouped_job):
    """GroupedMLP and TEGroupedMLP: the layer (fp32, bf16), training, Megatron's DDP."""
    world, res = grouped_job
    for r in res:
        for experts, cls in (("grouped", "FEPLBGroupedMLP"), ("te", "FEPLBTEGroupedMLP")):
            for arch in ("softmax", "sigmoid", "geglu", "squared-relu") + (
                    ("quick-geglu", "bias", "bias-quick-geglu") if experts == "te" else ()):
                case = r["layer", experts, arch]
                assert case["names"] == ["experts"] and case["class"] == cls
                # the very parameters, under Megatron's names
                assert case["same_names"] and case["same_params"], (experts, arch)
                for n, e in case["err"].items():
                    assert e <= 1e-5, (experts, arch, n, e)
                # TEGroupedMLP's weights, stacked every forward, are derived again in the backward; GroupedMLP's
                # are views of its parameters (nothing derived)
                made = (4 if "bias" in arch else 2) if experts == "te" else 0
                assert case["derived"] == (made, [0], [0]), (experts, arch, case["derived"])
                if arch == "softmax":   # a step between a forward and its backward (GroupedMLP's views too)
                    want = "experts: linear_fc1.weight0 [" if experts == "te" else "experts: weight1 ["
                    assert want in (case["stepped"] or ""), (experts, case["stepped"])
                    assert "was modified in place" in case["stepped"], (experts, case["stepped"])
                    assert "seen as the layer's output gradient arrived" in case["stepped"], (experts, case["stepped"])
            case = r["bf16", experts]
            assert case["out_dtype"] == torch.bfloat16 and case["param_dtypes"] == ["torch.bfloat16"]
            for n, (ours, theirs) in case["err"].items():
                assert ours <= 2 * theirs + 1e-6, (experts, n, ours, theirs)
            for weights in ("per-step", "per-microbatch") + (("bias",) if experts == "te" else ()):
                for n, e in r["train", experts, weights]["err"].items():
                    assert e <= 1e-4, (experts, weights, n, e)
            ddp = r["ddp", experts]
            assert ddp["first"] <= 1e-5 and ddp["err"] <= 1e-4, (experts, ddp)
            assert ddp["warned"] == 0
    if world > 1:
        for experts in ("grouped", "te"):
            assert res[0]["layer", experts, "softmax"]["moved"] > 0
            assert res[0]["train", experts, "per-step"]["moved"] > 0
            assert res[0]["ddp", experts]["moved"] > 0
        for case in (res[0]["layer", "te", "bias"], res[0]["layer", "te", "bias-quick-geglu"],
                     res[0]["train", "te", "bias"]):
            assert case["moved"] > 0


def test_grouped_experts_state(grouped_job):
    world, res = grouped_job
    for r in res:
        for experts in (("grouped",), ("te",), ("te", "bias")):
            s = r[("state", *experts)]
            assert s["keys"][0] == s["keys"][1] and s["equal"], (experts, s["keys"])
            # with biases: every expert's under its global index (a bias lost would leave its key out)
            assert sum(k.startswith("experts.") and ".bias" in k for k in s["keys"][1]) == (2 * E if "bias" in experts
                                                                                  else 0), experts
            assert s["local_keys"][0] == s["local_keys"][1], experts
            assert s["sharded_same"] and s["sharded_keys"] > 0, experts
            assert s["load"] is None and s["loaded"], (experts, s["load"])
            assert s["ckpt_equal"], experts
        te = r["state", "te"]
        assert te["extra", "pickled"] == ("ok", "Tensor") and te["extra", "saved"] == ("ok", "BytesIO"), te
        assert te["extra", "fp8"][0] == "refused" and "not empty" in te["extra", "fp8"][1], te["extra", "fp8"]


def test_grouped_experts_refusals(grouped_job):
    world, res = grouped_job
    for rank, r in enumerate(res):
        f = r["refusal"]
        for experts, cls in (("grouped", "GroupedMLP"), ("te", "TEGroupedMLP")):
            err, after = f["hook", experts]
            assert err is not None and after == cls, (experts, err)
            assert ("hooks" in err if rank == world - 1 else f"EP rank(s) [{world - 1}]" in err), (experts, err)
            gelu = f["gelu", experts]
            why = "the legacy GroupedMLP (which ignores them)" if experts == "grouped" else \
                "gated gelu with bias_activation_fusion"
            assert gelu is not None and why in gelu, (experts, gelu)
        assert f["post_hook"] is not None and "load_state_dict_post_hooks" in f["post_hook"], f["post_hook"]
        assert len(f["memory_warning"]) == 1 and "'moe_act' in recompute_modules" in f["memory_warning"][0], \
            f["memory_warning"]
        assert f["no_memory_warning"] == []
        assert f["quantized"] is not None and "te_quant_params" in f["quantized"], f["quantized"]
        late = f["late"]
        assert late is not None and ("forward_hooks" in late if rank == 0 else "EP rank(s) [0]" in late), late
        assert f["usable_again"] is None, f["usable_again"]
        assert "moe_pad_expert_input_to_capacity was turned on after" in f["padded_later"], f["padded_later"]
        assert f["unpadded_again"] is None, f["unpadded_again"]


def test_whole_gpt_model(grouped_job):
    """Megatron's GPTModel of two MoE layers (SequentialMLP, TEGroupedMLP): the loss, every gradient, two SGD steps."""
    world, res = grouped_job
    for r in res:
        for experts in ("sequential", "te"):
            g = r["gpt", experts]
            assert g["names"] == ["decoder.layers.0.mlp.experts", "decoder.layers.1.mlp.experts"], g["names"]
            assert g["same_names"], experts
            assert g["loss"] <= 1e-5 and g["grad"] <= 1e-5, (experts, g)
            assert g["weights"] <= 1e-4, (experts, g)
    if world > 1:
        assert all(res[0]["gpt", experts]["moved"] > 0 for experts in ("sequential", "te"))
