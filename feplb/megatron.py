"""FEPLB for Megatron-Core MoE models: one call makes each MoE layer's expert parallelism balanced.

Megatron-Core (0.16) computes every MoE layer (``megatron.core.transformer.moe.moe_layer.MoELayer``) as router
-> token dispatcher -> experts -> combine, over its expert-parallel group (``expert_model_parallel_size``), each
rank holding ``E / EP`` experts. :func:`apply` keeps that group, the router (aux losses, load-balancing bias, token
counts) and the shared experts, and replaces, in each MoE layer, the token dispatcher and the experts
(``SequentialMLP``) with FEPLB: the same local experts (the very ``MLP`` modules, parameters and names:
``mlp.experts.local_experts.{i}.linear_fc1.weight`` ...) computed by a :class:`feplb.MoELayer` that balances every
micro-batch between the GPUs of a node (``gpus_per_node``). The experts' parameters stay expert-parallel parameters
for Megatron (``allreduce=False``: reduced over the expert data-parallel group).

Precision follows the experts' parameters (Megatron computes the experts in their dtype; ``dtype=`` chooses
another); the router's probabilities weigh the outputs in fp32 when they are fp32 (``moe_router_dtype='fp32'``).

What FEPLB cannot run exactly is refused, on every rank together and before anything is replaced, by name: experts
other than ``SequentialMLP`` (``TEGroupedMLP`` and ``GroupedMLP`` are not supported yet) or with linears other than
Megatron's or Transformer Engine's, activations other than SwiGLU (``gated_linear_unit`` with ``F.silu``), expert
biases, token dropping (``moe_expert_capacity_factor``), probabilities applied on the input, fp8/fp4, latent
projections, tensor parallelism (attention or experts), overlapped shared experts or EP communication, delayed
weight gradients, CUDA graphs, forward or backward hooks on the modules whose forward FEPLB no longer runs (their
forward pre-hooks it runs, with its whole input: Megatron's DDP waits there for the parameters' all-gather with
``overlap_param_gather``; one that returns new inputs is refused). Call :func:`apply` on every pipeline stage
together; one without MoE layers gets ``[]``.

Weights travel per micro-batch by default (``weights="per-microbatch"``): the copies' gradients return inside the
backward, where Megatron's ``DistributedDataParallel`` sees them (with or without ``overlap_grad_reduce``). With
``weights="per-step"`` and a policy that keeps copies of experts on other GPUs, ``overlap_grad_reduce`` and
``overlap_param_gather`` must be off (the latter is refused) and, per optimizer step, :func:`reduce_replica_grads`
run after the last backward and before Megatron reduces the gradients (``finish_grad_sync``, inside
``finalize_model_grads``), :func:`refresh_replicas` after ``optimizer.step()``. Under Megatron's distributed
optimizer the weights change through DDP's buffers, which a forgotten :func:`refresh_replicas` does not notice.
Under Megatron's DDP the gradients are in ``main_grad``: clip with Megatron's optimizer, not :func:`clip_grad_norm_`
(which reads ``.grad``). Checkpoints: the model's ``state_dict()`` keeps Megatron's local names;
:func:`full_state_dict` gives every expert under its global index (the state dict of the same model with
``expert_model_parallel_size=1``); Megatron's distributed checkpointing (``sharded_state_dict``) gets exactly
``SequentialMLP``'s sharded state dict, so its checkpoints load into either layer.

Legend: T tokens on this rank, K top-k, H hidden, F expert ffn dim, E experts, W EP ranks, L = E / W.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from feplb.dropin import (
    _agree,
    agree_to_replace,
    attach_optimizer,
    average_expert_grads,
    check_overrides,
    clip_grad_norm_,
    expert_parameters,
    experts_modules,
    full_state_dict,
    hooks_problem,
    layer_config,
    reduce_replica_grads,
    refresh_replicas,
)
from feplb.layer import FEPLBConfig, MoELayer
from feplb.recompute import in_backward

__all__ = ["FEPLBSequentialMLP", "apply", "expert_parameters", "experts_modules", "full_state_dict",
           "attach_optimizer", "average_expert_grads", "reduce_replica_grads", "refresh_replicas", "clip_grad_norm_"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (linear_fc1, linear_fc2) classes whose forward, with fp8 refused, is x @ weight.T
_LINEARS = {("ColumnParallelLinear", "RowParallelLinear"), ("TEColumnParallelLinear", "TERowParallelLinear")}


class FEPLBSequentialMLP(MoELayer):
    """An expert-parallel, balanced drop-in for a Megatron-Core ``SequentialMLP`` (made by :func:`apply`).

    ``local_experts`` are Megatron's own ``MLP`` modules of this rank's experts ``rank * L ...`` (``linear_fc1.weight``
    [2F, H]: the gate's rows, then the up projection's; ``linear_fc2.weight`` [H, F]). Megatron's ``MoELayer`` calls
    it as its experts, ``forward(x [T, H], tokens_per_expert, routing) -> (y [T, H], None)``, where the routing
    is the (ids [T, K], weights [T, K]) pair :class:`FEPLBTokenDispatcher` passes in the probabilities' place:
    ``y = sum_k w_k * fc2(silu(gate x) * up x)``, the gradient flowing into the weights (the router).
    Collective over the EP group, like every ``MoELayer`` forward.
    """

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None, local_experts: list[nn.Module],
                 name: str = "") -> None:
        if config.router != "external":
            raise ValueError(f"FEPLBSequentialMLP needs FEPLBConfig.router='external', got {config.router!r}")
        # Read by _init_experts, which MoELayer.__init__ calls before this constructor could set attributes.
        object.__setattr__(self, "_megatron_local", local_experts)
        super().__init__(config, group)
        object.__delattr__(self, "_megatron_local")
        self.megatron_name = name
        self._megatron_groups: tuple | None = None   # (EP group, expert data-parallel group), set by apply
        self._warned_ddp = False
        self._joined: tuple[torch.Tensor, torch.Tensor] | None = None

    def _init_experts(self, L: int, H: int, F: int, device: torch.device, dtype: torch.dtype) -> None:
        local = self._megatron_local
        if len(local) != L:
            raise ValueError(f"FEPLBSequentialMLP: {len(local)} local experts, expected E / W = {L}")
        # Megatron's modules themselves: the parameters keep their identity, dtype, names and attributes.
        self.local_experts = nn.ModuleList(local)

    def expert_params(self) -> tuple[nn.Parameter, ...]:
        return tuple(p for m in self.local_experts for p in (m.linear_fc1.weight, m.linear_fc2.weight))

    def _join(self) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self.config.dtype
        w1 = torch.stack([m.linear_fc1.weight for m in self.local_experts]).to(dt)   # [L, 2F, H]
        w2 = torch.stack([m.linear_fc2.weight for m in self.local_experts]).to(dt)   # [L, H, F]
        return w1.transpose(1, 2), w2.transpose(1, 2)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [L, H, 2F], w2 [L, F, H]) in the layer's dtype, strided views of the stacked weights: made once per
        forward and shared by all its uses, made afresh outside a forward."""
        return self._joined if self._joined is not None else self._join()

    def full_entries(self, pname: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's ``local_experts.{i}`` is the model's expert ``rank * L + i``."""
        head, i, tail = pname.split(".", 2)
        if head != "local_experts":
            return super().full_entries(pname, parts)
        return {f"local_experts.{r * self.num_local + int(i)}.{tail}": t for r, t in enumerate(parts)}

    def full_state_entries(self, name: str, value: Any) -> dict[str, Any]:
        """Megatron's linears keep an empty ``_extra_state`` per expert (None; Transformer Engine's without fp8: a
        tensor of no elements): one under every global index."""
        head, i, tail = name.split(".", 2) if name.count(".") >= 2 else (name, "", "")
        if head != "local_experts":
            return super().full_state_entries(name, value)
        if value is not None and not (isinstance(value, torch.Tensor) and value.numel() == 0):
            raise NotImplementedError(f"feplb.megatron.full_state_dict: local expert state {name!r} is not empty "
                                      "and cannot be gathered")
        return {f"local_experts.{r * self.num_local + int(i)}.{tail}": value for r in range(self.world_size)}

    def forward(self, x_TH: torch.Tensor, tokens_per_expert: Any = None,  # type: ignore[override]
                routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, None]:
        del tokens_per_expert
        if not isinstance(routing, tuple):
            raise TypeError("FEPLBSequentialMLP takes the routing (ids, weights) from FEPLBTokenDispatcher; "
                            "use it through feplb.megatron.apply, not with Megatron's own token dispatcher")
        # Hooks registered after apply (by Megatron's DDP, say). The forward pre-hooks run first, on every rank alike
        # (Megatron's DDP waits there for collectives of the expert data-parallel group; a rank that skipped them
        # would leave its peers waiting). Then hooks FEPLB cannot run, or pre-hooks that replaced the input, are
        # refused on every rank together; not in a recompute, whose peers are in the replay's own collectives (the
        # next forward refuses them).
        why = self._run_pre_hooks((x_TH,)) or _lost_hooks(self.local_experts)
        if why is not None and not in_backward():
            self._experts(None, None, None, (RuntimeError, f"{self.megatron_name or 'FEPLBSequentialMLP'}: {why}"))
        self._joined = self._join()
        try:
            y = super().forward(x_TH.to(self.config.dtype), routing=routing)
        finally:
            self._joined = None
        return y.to(x_TH.dtype), None

    def _run_pre_hooks(self, args: tuple) -> str | None:
        """Run the kept modules' forward pre-hooks (called with ``args``: FEPLB's whole input, not the module's);
        why FEPLB cannot honour one (it returned new inputs), or None."""
        why = None
        for mod in _kept_modules(self.local_experts):
            for key, hook in list(mod._forward_pre_hooks.items()):
                got = hook(mod, args, {}) if key in mod._forward_pre_hooks_with_kwargs else hook(mod, args)
                if got is not None and why is None:
                    why = (f"a forward pre-hook of {type(mod).__name__} returned new inputs, which FEPLB (reading the "
                           "weights, not running the module) cannot use")
        return why

    def refresh_replicas(self) -> None:
        # Per-step copies read the weights now, right after the optimizer step. With forward pre-hooks on the kept
        # modules (Megatron's DDP with overlap_param_gather), the updated weights arrive only in the next forward's
        # hooks: the copies would be stale. Refused on every rank.
        if self.config.weights == "per-step" and (self.base != "none" or self.place):
            hooked = any(mod._forward_pre_hooks for mod in _kept_modules(self.local_experts))
            # over the layer's CPU control group, as the layer's other per-step checks
            if int(self.control.all_reduce_min(torch.tensor([int(not hooked)]), "group",
                                               "refresh_replicas pre-hook check")[0]) == 0:
                raise RuntimeError(
                    f"{self.megatron_name or 'FEPLBSequentialMLP'}: per-step expert copies with forward pre-hooks on "
                    "the experts (Megatron's DistributedDataParallel with overlap_param_gather all-gathers the "
                    "updated weights only in the next forward): use weights='per-microbatch' (the default), or "
                    "overlap_param_gather=False")
        super().refresh_replicas()

    def reduce_replica_grads(self) -> None:
        if self.replicas.pairs and not self._warned_ddp and any(hasattr(p, "main_grad") for p in self.expert_params()):
            self._warned_ddp = True
            warnings.warn(f"{self.megatron_name or 'FEPLBSequentialMLP'}: per-step expert copies under Megatron's "
                          "DistributedDataParallel: their gradients reach main_grad correctly only with "
                          "overlap_grad_reduce=False and this call before finish_grad_sync; weights='per-microbatch' "
                          "has neither condition", stacklevel=2)
        super().reduce_replica_grads()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed checkpointing: exactly ``SequentialMLP``'s sharded state dict (each local expert
        under its global index, replicated over the expert data-parallel group), so checkpoints move between this
        layer and Megatron's own."""
        if self._megatron_groups is None:
            raise NotImplementedError("FEPLBSequentialMLP made outside feplb.megatron.apply has no Megatron groups to "
                                      "shard its checkpoint by")
        _, mc_experts = _megatron()
        view = _ShardingView(self.local_experts, self.num_local, *self._megatron_groups)
        return mc_experts.SequentialMLP.sharded_state_dict(view, prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        return f"{self.megatron_name!r}, " + super().extra_repr()


class _ShardingView:
    """What ``SequentialMLP.sharded_state_dict`` reads of its module."""

    def __init__(self, local_experts: nn.ModuleList, num_local_experts: int, ep_group, dp_group) -> None:
        self.local_experts, self.num_local_experts = local_experts, num_local_experts
        self.ep_group, self.dp_group = ep_group, dp_group


@functools.cache
def _dispatcher_class():
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    class FEPLBTokenDispatcher(MoETokenDispatcher):
        """Megatron's token dispatcher interface around a FEPLB layer: the dispatch is the layer's own, so this only
        turns Megatron's routing (``routing_map`` [T, E] bool, ``probs`` [T, E]) into top-k ids and weights, passes
        them to the experts in the probabilities' place, and restores the hidden states' shape."""

        def __init__(self, old: MoETokenDispatcher, top_k: int) -> None:
            # Megatron's attributes, taken from the dispatcher it replaces (no process group is made here).
            for a in ("config", "ep_group", "tp_group", "tp_ep_group", "tp_size", "tp_rank", "ep_size"):
                setattr(self, a, getattr(old, a, None))
            self.shared_experts = None
            self.cudagraph_attrs: list[str] = []
            self.valid_cudagraph_attrs = None
            self.top_k = top_k
            self.hidden_shape: torch.Size | None = None

        def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
            self.hidden_shape = tokens.shape
            x_TH = tokens.reshape(-1, tokens.shape[-1])
            k = self.top_k
            if routing_map.shape != probs.shape or routing_map.shape[0] != x_TH.shape[0]:
                # (a router other than Megatron's) not raised here, on this rank alone: the layer refuses a routing
                # of no tokens on every rank together, naming its shape
                empty = torch.empty((0, k), device=tokens.device)
                return x_TH, (empty.long(), empty)
            # the k selected experts of each token (a stable sort puts the True entries first, in expert order);
            # no host sync. A row with fewer than k (never with the routers apply() admits) would add experts
            # weighted 0, which changes neither the output nor any gradient.
            ids_TK = routing_map.to(torch.uint8).sort(dim=1, descending=True, stable=True).indices[:, :k]
            sel_TK = routing_map.gather(1, ids_TK)
            w_TK = torch.where(sel_TK, probs.gather(1, ids_TK), torch.zeros((), dtype=probs.dtype,
                                                                                device=probs.device))
            return x_TH, (ids_TK, w_TK)

        def token_dispatch(self, hidden_states, probs):
            return hidden_states, probs

        def dispatch_postprocess(self, hidden_states, probs):
            return hidden_states, None, probs

        def combine_preprocess(self, hidden_states):
            return hidden_states

        def token_combine(self, hidden_states):
            return hidden_states

        def combine_postprocess(self, hidden_states):
            if self.hidden_shape is None:
                raise RuntimeError("FEPLBTokenDispatcher: combine before dispatch")
            return hidden_states.view(self.hidden_shape)

    return FEPLBTokenDispatcher


# ---------------------------------------------------------------------------------------------------- discovery

def _megatron():
    try:
        from megatron.core.transformer.moe import experts, moe_layer
    except ImportError as e:
        raise ImportError("feplb.megatron needs Megatron-Core 0.16 (pip install 'feplb[megatron]') "
                          f"({e})") from e
    return moe_layer, experts


_CONFIG_REFUSALS = (
    # (TransformerConfig field, allowed values, why)
    ("moe_expert_capacity_factor", (None,), "token dropping (FEPLB computes every token)"),
    ("moe_pad_expert_input_to_capacity", (False, None), "padding experts' inputs to capacity"),
    ("moe_router_padding_for_quantization", (False, None), "routing padded for fp8/fp4"),
    ("moe_router_padding_for_fp8", (False, None), "routing padded for fp8"),
    ("moe_apply_probs_on_input", (False, None), "probabilities applied on the experts' input"),
    ("fp8", (None, False), "fp8 experts"),
    ("fp4", (None, False), "fp4 experts"),
    ("moe_latent_size", (None, 0), "latent projections around the experts"),
    ("moe_shared_expert_overlap", (False, None), "shared experts overlapped inside the token dispatcher"),
    ("overlap_moe_expert_parallel_comm", (False, None), "overlapped expert-parallel communication"),
    ("delay_wgrad_compute", (False, None), "delayed weight gradients (backward_dw)"),
    ("add_bias_linear", (False,), "expert biases"),
    ("activation_func_clamp_value", (None,), "a clamped activation"),
    ("glu_linear_offset", (0, 0.0, None), "an offset in the gated unit"),
    ("activation_func_fp8_input_store", (False, None), "the activation's input stored in fp8 for the backward"),
    ("use_te_activation_func", (False, None), "Transformer Engine's activation module"),
    ("cuda_graph_impl", ("none", None), "CUDA graphs (FEPLB plans on the CPU every micro-batch)"),
    ("enable_cuda_graph", (False, None), "CUDA graphs (FEPLB plans on the CPU every micro-batch)"),
    ("external_cuda_graph", (False, None), "CUDA graphs (FEPLB plans on the CPU every micro-batch)"),
)


# What FEPLB would lose of the expert modules it keeps but whose forward it does not run: forward hooks and backward
# hooks. Their forward pre-hooks it runs (Megatron's DistributedDataParallel waits there for the parameters'
# all-gather with overlap_param_gather); their state-dict hooks stay with them.
_LOST_HOOKS = ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


def _kept_modules(local_experts) -> list[nn.Module]:
    return [s for m in local_experts for s in (m, m.linear_fc1, m.linear_fc2)]


def _lost_hooks(local_experts) -> str | None:
    return next(filter(None, (hooks_problem(mod, _LOST_HOOKS) for mod in _kept_modules(local_experts))), None)


def _problem(moe: nn.Module, mc_experts, world: int, rank: int, dtype: torch.dtype | None
             ) -> tuple[str | None, dict, list]:
    """Why FEPLB cannot run ``moe``'s experts exactly (None if it can), the FEPLBConfig fields they give, and the
    local expert modules."""
    cfg = moe.config
    experts = moe.experts
    if type(experts) is not mc_experts.SequentialMLP:
        return (f"experts {type(experts).__name__}: only Megatron's SequentialMLP (moe_grouped_gemm=False) is "
                "supported yet"), {}, []
    for field, allowed, why in _CONFIG_REFUSALS:
        v = getattr(cfg, field, None)
        if v not in allowed:
            return f"{why} ({field}={v!r})", {}, []
    if not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
        return (f"activation {getattr(cfg.activation_func, '__name__', cfg.activation_func)} with "
                f"gated_linear_unit={cfg.gated_linear_unit}: FEPLB computes SwiGLU (F.silu, gated)"), {}, []
    for label, g in (("tensor", getattr(moe, "tp_group", None)), ("expert tensor", moe.token_dispatcher.tp_group)):
        if g is not None and dist.get_world_size(g) > 1:
            return f"{label} parallelism of size {dist.get_world_size(g)} (FEPLB needs it 1)", {}, []
    # The SequentialMLP goes; the local experts' modules stay (with their state-dict hooks), but FEPLB reads their
    # weights and runs none of their forwards.
    why = hooks_problem(experts)
    if why is None:
        why = _lost_hooks(experts.local_experts)
    if why is not None:
        return why, {}, []
    E, K, H = cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size
    Fd = cfg.moe_ffn_hidden_size
    L = E // world if E % world == 0 else None
    if L is None or moe.num_local_experts != L or list(moe.local_expert_indices) != list(range(rank * L,
                                                                                               rank * L + L)):
        return (f"local experts {list(moe.local_expert_indices)} of {E}: expected this rank's E / W block of the "
                f"EP group ({world} ranks)"), {}, []
    local = list(experts.local_experts)
    ws = []
    for i, m in enumerate(local):
        own = sorted(n for n, _ in m.named_parameters())
        if own != ["linear_fc1.weight", "linear_fc2.weight"]:
            return f"local expert {i} has parameters {own}; expected linear_fc1.weight, linear_fc2.weight", {}, []
        if sorted(n for n, _ in m.named_buffers()):
            return f"local expert {i} has buffers (quantized experts are not supported)", {}, []
        kinds = (type(m.linear_fc1).__name__, type(m.linear_fc2).__name__)
        if kinds not in _LINEARS:
            return (f"local expert {i}'s linears are {kinds[0]} and {kinds[1]}; expected Megatron's or Transformer "
                    "Engine's column- and row-parallel linears (FEPLB multiplies by their weights)"), {}, []
        w1, w2 = m.linear_fc1.weight, m.linear_fc2.weight
        if w1.shape != (2 * Fd, H) or w2.shape != (H, Fd):
            return (f"local expert {i}: linear_fc1 {list(w1.shape)}, linear_fc2 {list(w2.shape)}; expected "
                    f"[{2 * Fd}, {H}] and [{H}, {Fd}]"), {}, []
        ws += [w1, w2]
    if any(w.is_meta for w in ws):
        return "weights on the meta device; initialise or load them before apply", {}, []
    if len({w.dtype for w in ws}) != 1 or ws[0].dtype not in _DTYPES:
        return f"weight dtypes {sorted({str(w.dtype) for w in ws})}; expected one of {_DTYPES}", {}, []
    if ws[0].device.type not in ("cpu", "cuda") or len({w.device for w in ws}) != 1:
        return f"weights on {sorted({str(w.device) for w in ws})}; expected one CPU or CUDA device", {}, []
    if not isinstance(K, int) or not 1 <= K <= E:
        return f"moe_router_topk {K!r}; expected an int in [1, {E}]", {}, []
    return None, {"hidden": int(H), "ffn": int(Fd), "num_experts": int(E), "top_k": K,
                  "dtype": dtype if dtype is not None else ws[0].dtype, "device": ws[0].device.type}, local


# ---------------------------------------------------------------------------------------------------- apply

def apply(model: nn.Module, *, dtype: torch.dtype | None = None, **config_overrides: Any) -> list[str]:
    """Replace the token dispatcher and experts of every Megatron-Core ``MoELayer`` of ``model``, in place, with
    FEPLB over the layer's own expert-parallel group, keeping this rank's experts (the same modules). Collective
    over that group; every MoE layer of the model must use the same one.

    dtype: what the experts compute in, and the rows travel in (default: the parameters' dtype, as Megatron
        computes them). The parameters keep their own dtype.
    config_overrides: :class:`feplb.FEPLBConfig` fields (policy, gpus_per_node, dyn, weights, plan_wait_ms, ...).
        hidden, ffn, num_experts and top_k come from Megatron's config; the router is the model's own. The device
        defaults to the experts', ``weights`` to "per-microbatch" (see the module's docstring).

    Returns the qualified names of the replaced experts modules ([] on a pipeline stage without MoE layers: call it
    on every stage, or every virtual-pipeline chunk). Raises, on every rank together and before anything
    is replaced: ValueError naming each MoE layer FEPLB cannot run exactly and why (see the module's docstring), or
    when the ranks' models differ; TypeError for an unknown or derived override; ImportError without
    Megatron-Core.
    """
    if not dist.is_initialized():
        raise RuntimeError("feplb.megatron.apply needs torch.distributed initialised (and Megatron's parallel "
                           "state) first")
    mc_layer, mc_experts = _megatron()
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, mc_layer.MoELayer) and not isinstance(m.experts, FEPLBSequentialMLP)]
    groups = {id(m.ep_group): m.ep_group for _, m in found}
    if len(groups) > 1:
        raise ValueError("feplb.megatron.apply: the model's MoE layers use different expert-parallel groups")
    from megatron.core import parallel_state as ps

    megatron_state = ps.model_parallel_is_initialized()
    # A rank without MoE layers (a pipeline stage of dense layers) agrees with its own EP group all the same.
    group = next(iter(groups.values())) if groups else ps.get_expert_model_parallel_group() if megatron_state \
        else None
    pipelined = megatron_state and ps.get_pipeline_model_parallel_world_size() > 1
    check_overrides("feplb.megatron.apply", group, config_overrides)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # Per-micro-batch weights by default: their gradients return inside the backward, where Megatron's
    # DistributedDataParallel (also with overlap_grad_reduce) sees them; per-step copies need reduce_replica_grads
    # before Megatron's gradient reduction, and overlap_grad_reduce off.
    config_overrides = {"weights": "per-microbatch", **config_overrides}
    problems, plans = [], []
    if dtype is not None and dtype not in _DTYPES:
        problems.append(f"  dtype={dtype}: expected one of {_DTYPES}")
    for name, moe in found:
        why, fields_of, local = _problem(moe, mc_experts, world, rank, dtype)
        if why is None:
            cfg = layer_config(fields_of, config_overrides)
            if isinstance(cfg, str):
                why = cfg
        if why is not None:
            problems.append(f"  {name or type(model).__name__} ({type(moe).__name__}): {why}")
        else:
            plans.append((name, moe, cfg, local))
    # The experts differ between ranks by design (each holds its own); the layers' shapes must not.
    shapes = [(n, c.hidden, c.ffn, c.num_experts, c.top_k) for n, _, c, _ in plans]

    def none_found() -> str:
        done = " (feplb.megatron.apply already replaced their experts)" if experts_modules(model) else ""
        return f"found no Megatron-Core MoELayer in {type(model).__name__}{done}"

    # With pipeline stages, a stage without MoE layers gets [] as long as some stage has them (agreed over the
    # world, which calls apply on every stage together); none anywhere, or a second apply, raises everywhere.
    elsewhere = pipelined and any(_agree(bool(found), None))
    agree_to_replace("feplb.megatron.apply", group, problems, [n for n, _ in found], shapes, none_found,
                     allow_none=elsewhere)

    # Every layer is built (collective) before the first module is swapped: a layer that cannot be built leaves the
    # model as it was.
    Dispatcher = _dispatcher_class()
    made = []
    for name, moe, cfg, local in plans:
        new = FEPLBSequentialMLP(cfg, group, local, name=f"{name}.experts" if name else "experts")
        new._megatron_groups = (moe.experts.ep_group, moe.experts.dp_group)
        new.train(moe.experts.training)
        new.refresh_replicas()
        made.append((moe, new, Dispatcher(moe.token_dispatcher, cfg.top_k)))
    for moe, new, dispatcher in made:
        moe.experts = new
        moe.token_dispatcher = dispatcher
    return [f"{name}.experts" if name else "experts" for name, _, _, _ in plans]
