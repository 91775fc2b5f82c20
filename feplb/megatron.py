"""FEPLB for Megatron-Core MoE models: one call makes each MoE layer's expert parallelism balanced.

Megatron-Core (0.16) computes every MoE layer (``megatron.core.transformer.moe.moe_layer.MoELayer``) as router
-> token dispatcher -> experts -> combine, over its expert-parallel group (``expert_model_parallel_size``), each
rank holding ``E / EP`` experts. :func:`apply` keeps that group, the router (aux losses, load-balancing bias, token
counts) and the shared experts, and replaces, in each MoE layer, the token dispatcher and the experts with FEPLB:
the same local experts (the very parameters under the same names, in the same modules where there are any)
computed by a :class:`feplb.MoELayer` that balances every micro-batch between the GPUs of a node
(``gpus_per_node``). With ``token_dispatcher="megatron"`` it keeps the token dispatcher too (alltoall, allgather, or
flex with DeepEP / HybridEP) and replaces only the experts, which balance the rows it delivers
(``MoELayer.forward_dispatched``) and weigh them by their probabilities, as Megatron's experts do. Each of
Megatron's experts layouts has its class: ``SequentialMLP`` (``moe_grouped_gemm=False``; its ``MLP`` modules,
``local_experts.{i}.linear_fc1.weight`` ...) -> :class:`FEPLBSequentialMLP`; ``TEGroupedMLP``
(``moe_grouped_gemm=True`` with Transformer Engine; its grouped linears, ``linear_fc1.weight{i}`` ...) ->
:class:`FEPLBTEGroupedMLP`; the legacy ``GroupedMLP`` (``weight1`` [H, L * 2F], ``weight2`` [L * F, H]) ->
:class:`FEPLBGroupedMLP`. The experts' parameters stay expert-parallel parameters for Megatron (``allreduce=False``:
reduced over the expert data-parallel group).

Precision follows the experts' parameters (Megatron computes the experts in their dtype; ``dtype=`` chooses
another); the router's probabilities weigh the outputs in fp32 when they are fp32 or fp64 (``moe_router_dtype``
'fp32' or 'fp64'; Megatron weighs fp64 ones in fp64, FEPLB in fp32, or in fp64 behind Megatron's own token
dispatcher, where it weighs the rows as Megatron's experts do).

What FEPLB cannot run exactly is refused, on every rank together and before anything is replaced, by name: other
experts classes, or those three with linears other than Megatron's or Transformer Engine's, activations FEPLB does
not compute as Megatron does (it computes gated SiLU, clamped or not, gated GeLU, gated quick-GELU with
``glu_linear_offset=1``, gpt-oss's form, and non-gated squared ReLU, SiLU and GeLU; combinations where Megatron's
own paths disagree are refused: a clamp under ``bias_activation_fusion``, whose fused SwiGLU ignores it, a clamp or
offset with the legacy GroupedMLP, which ignores both), padding to capacity
(``moe_pad_expert_input_to_capacity``; behind Megatron's own token dispatcher it runs),
fp8/fp4, latent projections, expert tensor parallelism and attention's without sequence parallelism (with it,
each rank of a tensor-parallel group brings its own tokens, and FEPLB runs), overlapped EP communication, delayed
weight gradients, CUDA graphs over the MoE layer (Transformer Engine's graphs of other parts only, such as
``cuda_graph_scope=["attn"]``, run), forward or backward hooks on the modules whose forward FEPLB
no longer runs (their forward pre-hooks it runs, with its whole input: Megatron's DDP waits there for the
parameters' all-gather with ``overlap_param_gather``; one that returns new inputs is refused). The router's
probabilities on the experts' inputs (``moe_apply_probs_on_input``) run as ``FEPLBConfig.gate_on_input``. Expert
biases (``add_bias_linear``: ``linear_fc1.bias`` [2F] added before the activation, ``linear_fc2.bias`` [H] weighed by
the router's probability with the rest of the expert's output, as Megatron's experts add it) run as
``FEPLBConfig.expert_bias``: copies of an expert carry its biases (refused with ``bias_activation_fusion`` and
SequentialMLP experts for SwiGLU, which Megatron's fused form cannot bias, and a clamped quick-GELU, which it clamps
before the bias). Tokens Megatron's router drops at an expert's capacity (``moe_expert_capacity_factor``, without
padding) leave their slots to no expert (``FEPLBConfig.masked_routes``): no row, no compute. Call :func:`apply` on
every pipeline stage
together; one without MoE layers gets ``[]``.

Weights travel per micro-batch by default (``weights="per-microbatch"``): the copies' gradients return inside the
backward, where Megatron's ``DistributedDataParallel`` sees them (with or without ``overlap_grad_reduce``). With
``weights="per-step"`` and a policy that keeps copies of experts on other GPUs, ``overlap_grad_reduce`` and
``overlap_param_gather`` must be off (both are refused: the former by :func:`reduce_replica_grads` given the
DDP-wrapped model, as ``finalize_model_grads`` is) and, per optimizer step, :func:`reduce_replica_grads` run after
the last backward and before Megatron reduces the gradients (``finish_grad_sync``, inside
``finalize_model_grads``), :func:`refresh_replicas` after ``optimizer.step()``. A forgotten :func:`refresh_replicas`
is refused at the next forward on every rank, also under Megatron's distributed optimizer, whose weights change
through DDP's flat buffers (docs/megatron.md).
Under Megatron's DDP the gradients are in ``main_grad``: clip with Megatron's optimizer, not :func:`clip_grad_norm_`
(which reads ``.grad``). Checkpoints: the model's ``state_dict()`` keeps Megatron's local names (plain per-rank
shards, not for ``torch.distributed.checkpoint`` of ``state_dict()``);
:func:`full_state_dict` gives every expert under its global index (the state dict of the same model with
``expert_model_parallel_size=1``); Megatron's distributed checkpointing (``sharded_state_dict``) gets exactly the
sharded state dict of the experts module replaced, so its checkpoints load into either layer (and, as Megatron's
own, between its layouts).

Legend: T tokens on this rank, K top-k, H hidden, F expert ffn dim, E experts, W EP ranks, L = E / W.
"""

from __future__ import annotations

import functools
import io
import pickle
import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from feplb.config import dispatched_policy_problem
from feplb.dropin import (
    _HOOKS,
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
    joined_for_forward,
    layer_config,
    load_policy_state_dict,
    policy_state_dict,
    refresh_replicas,
    roots,
    set_state_dict_type,
    zero_replica_grads,
)
from feplb.dropin import reduce_replica_grads as _reduce_replica_grads
from feplb.experts import checked_at_backward
from feplb.layer import FEPLBConfig, MoELayer
from feplb.recompute import in_backward
from feplb.steps import ENTRY_REFRESH
from feplb.training import handshaken

__all__ = ["FEPLBExperts", "FEPLBSequentialMLP", "FEPLBTEGroupedMLP", "FEPLBGroupedMLP", "apply", "expert_parameters",
           "experts_modules", "full_state_dict", "attach_optimizer", "average_expert_grads", "reduce_replica_grads",
           "zero_replica_grads", "refresh_replicas", "clip_grad_norm_", "set_state_dict_type", "policy_state_dict",
           "load_policy_state_dict"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (linear_fc1, linear_fc2) classes whose forward, with fp8 refused, is x @ weight.T
_LINEARS = {("ColumnParallelLinear", "RowParallelLinear"), ("TEColumnParallelLinear", "TERowParallelLinear")}
# TEGroupedMLP's (linear_fc1, linear_fc2) classes, whose forward, with fp8 refused, is x_i @ weight{i}.T for expert i
_TE_GROUPED = ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")


class FEPLBExperts(MoELayer):
    """An expert-parallel, balanced drop-in for a Megatron-Core experts module (made by :func:`apply`): one subclass
    per Megatron layout, :class:`FEPLBSequentialMLP`, :class:`FEPLBTEGroupedMLP`, :class:`FEPLBGroupedMLP`.

    It holds this rank's experts ``rank * L ...`` as Megatron's module held them (the very parameters, under the same
    names, in the same modules where there are any) and reads them as (w1 [L, H, 2F]: the gate's columns, then the up
    projection's; w2 [L, F, H]), then, with ``add_bias_linear``, (b1 [L, 2F], b2 [L, H]). Megatron's ``MoELayer``
    calls it as its experts, ``forward(x, tokens_per_expert, probs) -> (y, None)``. Behind
    :class:`FEPLBTokenDispatcher` (``token_dispatcher="feplb"``) x is [T, H], this rank's tokens, and ``probs`` the
    (ids [T, K], weights [T, K]) routing it passes in the probabilities' place: ``y = sum_k w_k * (fc2(act(fc1 x +
    b1)) + b2)``, the gradient flowing into the weights (the router). Behind Megatron's own token dispatcher
    (``"megatron"``) x is [R, H], the rows it delivered for this rank's experts, grouped by local expert, with their
    counts and probabilities [R], and y each row's output weighed by its probability, as Megatron's experts return
    it. Collective over the EP group, like every ``MoELayer`` forward.
    """

    _no_forward_dispatched = ("Megatron's experts run their forward pre-hooks and join their weights per call in "
                              "forward(), which Megatron's MoELayer calls: behind Megatron's own token dispatcher "
                              "(feplb.megatron.apply(..., token_dispatcher='megatron')) it balances the dispatched "
                              "rows as forward_dispatched does")

    # Megatron keeps its local names in state_dict() (per-rank checkpoints); its distributed checkpoints go through
    # sharded_state_dict
    state_dict_type = "local"

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None, experts: nn.Module,
                 name: str = "", token_dispatcher: str = "feplb", layer_config: Any = None) -> None:
        if config.router != "external":
            raise ValueError(f"{type(self).__name__} needs FEPLBConfig.router='external', got {config.router!r}")
        why = _token_dispatcher_problem(token_dispatcher, config.policy)
        if why is not None:
            raise ValueError(f"{type(self).__name__}: {why}")
        # Read by _init_experts, which MoELayer.__init__ calls before this constructor could set attributes.
        object.__setattr__(self, "_megatron_src", experts)
        super().__init__(config, group)
        object.__delattr__(self, "_megatron_src")
        self.megatron_name = name
        self.megatron_config = experts.config
        # The MoE layer's config, which its router reads (the model's: Megatron's set_decode_expert_padding flips
        # it). SequentialMLP deep-copies it when moe_ffn_hidden_size differs from ffn_hidden_size, so the experts'
        # own config does not see such a change.
        self.megatron_layer_config = experts.config if layer_config is None else layer_config
        # "feplb": FEPLBTokenDispatcher hands over the routing and FEPLB dispatches; "megatron": Megatron's own
        # token dispatcher hands over the rows of this rank's experts, grouped by local expert
        self.token_dispatcher = token_dispatcher
        # (EP group, expert data-parallel group, expert tensor-parallel group) of the module this replaced: what
        # Megatron's sharded state dict names the shards by
        self._megatron_groups = tuple(getattr(experts, a, None) for a in ("ep_group", "dp_group", "tp_group"))
        self._warned_ddp = False
        self._joined: tuple[torch.Tensor, ...] | None = None

    # ------------------------------------------------------------------------------------- the layout (subclasses)
    def _init_experts(self, L: int, H: int, F: int, device: torch.device, dtype: torch.dtype) -> None:
        src = self._megatron_src
        if src.num_local_experts != L:
            raise ValueError(f"{type(self).__name__}: {src.num_local_experts} local experts, expected E / W = {L}")
        self._take_experts(src)

    def _take_experts(self, src: nn.Module) -> None:
        """Take Megatron's modules or parameters of the local experts (keeping their identity, dtype, names and
        attributes)."""
        raise NotImplementedError

    @staticmethod
    def _kept(holder: nn.Module) -> list[nn.Module]:
        """The modules ``holder`` (Megatron's experts module, or this layer, which keeps them under the same names)
        holds whose forward FEPLB does not run."""
        return []

    def kept_modules(self) -> list[nn.Module]:
        """Megatron's modules this layer keeps but whose forward it does not run (their forward pre-hooks it runs;
        other hooks on them it refuses)."""
        return self._kept(self)

    def _param_modules(self) -> list[nn.Module]:
        """The modules whose own parameters are the experts' (where Megatron's DDP hooks its parameters'
        all-gather)."""
        return self.kept_modules()

    def _join(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(w1 [L, H, 2F], w2 [L, F, H]), then (b1 [L, 2F], b2 [L, H]) with expert biases, in the layer's dtype, from
        ``params`` (``expert_params()``, in its order; by default the current ones)."""
        raise NotImplementedError

    def _sharding_source(self) -> tuple[type, Any]:
        """(Megatron's experts class, an object with what its ``sharded_state_dict`` reads of its module)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------- common
    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        """(w1 [L, H, 2F], w2 [L, F, H][, b1 [L, 2F], b2 [L, H]]) in the layer's dtype, views of the parameters:
        made once per forward and shared by all its uses, made afresh outside a forward."""
        return self._joined if self._joined is not None else self._join()

    def forward(self, x_TH: torch.Tensor, tokens_per_expert: Any = None,  # type: ignore[override]
                routing: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        """Megatron's experts call. Behind FEPLBTokenDispatcher (``token_dispatcher="feplb"``): x_TH [T, H] this
        rank's tokens, ``routing`` the (ids [T, K], weights [T, K]) pair; FEPLB dispatches, computes and combines.
        Behind Megatron's own token dispatcher (``"megatron"``): x_TH [R, H] the rows it delivered for this rank's
        experts, grouped by local expert, ``tokens_per_expert`` [L] their counts, ``routing`` their router
        probabilities [R]; FEPLB computes them, balanced over the node, and returns each row's output weighed by
        its probability (or, with ``moe_apply_probs_on_input``, the row weighed before the experts), as Megatron's
        experts do, for Megatron's combine."""
        own = self.token_dispatcher == "megatron"
        name = self.megatron_name or type(self).__name__
        wrong = None
        if own != isinstance(routing, torch.Tensor) or not (own or isinstance(routing, tuple)):
            wrong = (f"{name} was made for token_dispatcher={self.token_dispatcher!r} and "
                     + ("takes the probabilities of the dispatched rows from Megatron's token dispatcher"
                        if own else "takes the routing (ids, weights) from FEPLBTokenDispatcher")
                     + f", got {type(routing).__name__}; use it through feplb.megatron.apply")
            if in_backward():   # (a recompute repeats its forward's arguments: not reached)
                raise TypeError(wrong)
        # Hooks registered after apply (by Megatron's DDP, say). The forward pre-hooks run first, on every rank alike
        # (Megatron's DDP waits there for collectives of the expert data-parallel group; a rank that skipped them
        # would leave its peers waiting). Then hooks FEPLB cannot run, or pre-hooks that replaced the input, are
        # refused on every rank together (as are wrong arguments); not in a recompute, whose peers are in the
        # replay's own collectives (the next forward refuses them).
        kept = self.kept_modules()
        why = self._run_pre_hooks(kept, (x_TH,)) or _lost_hooks(kept)
        if why is None and not own and any(getattr(c, "moe_pad_expert_input_to_capacity", False)
                                           for c in (self.megatron_layer_config, self.megatron_config)):
            # turned on after apply (Megatron's inference decode padding, set_decode_expert_padding): the routing map
            # then holds up to capacity routes per token, not its top k, which FEPLB's dispatch cannot tell apart
            why = ("moe_pad_expert_input_to_capacity was turned on after feplb.megatron.apply (by "
                   "set_decode_expert_padding, say): FEPLB's own dispatch takes each token's top-k routes, not "
                   "routing padded to capacity; turn it off")
        if wrong is not None:
            self._experts(None, None, None, (TypeError, wrong), dispatched=own)
        if why is not None and not in_backward():
            self._experts(None, None, None, (RuntimeError, f"{name}: {why}"), dispatched=own)
        with joined_for_forward(self, name):
            if own:
                y = self._dispatched_rows(x_TH, tokens_per_expert, routing)
            else:
                y = super().forward(x_TH.to(self.config.dtype), routing=routing)
            y = checked_at_backward(y)
        return y.to(x_TH.dtype), None

    def _dispatched_rows(self, x_RH: torch.Tensor, tokens_per_expert: Any, probs_R: torch.Tensor) -> torch.Tensor:
        """The rows Megatron's token dispatcher delivered -> their outputs weighed by their probabilities, in
        x_RH's dtype, as Megatron's experts return them (they weigh the activation before fc2, in the product's
        dtype, and fc2's bias with it; FEPLB weighs fc2's output, bias included, by the same rule)."""
        c = self.config
        problem = None
        # (rows that are not [R, H] are refused by forward_dispatched's own checks, on every rank)
        rows = isinstance(x_RH, torch.Tensor) and x_RH.dim() == 2
        if rows and (probs_R.dim() != 1 or probs_R.shape[0] != x_RH.shape[0] or not probs_R.is_floating_point()
                     or probs_R.device != x_RH.device):
            problem = (ValueError, f"{self.megatron_name or type(self).__name__}: the dispatched probabilities must "
                                   f"be one float per row ([{x_RH.shape[0]}] on {x_RH.device}), got a {probs_R.dtype} "
                                   f"tensor of shape {list(probs_R.shape)} on {probs_R.device}")
        elif rows and c.gate_on_input:   # moe_apply_probs_on_input (top-1): Megatron weighs the rows, in their dtype
            x_RH = (probs_R.unsqueeze(-1) * x_RH).to(x_RH.dtype)
        y_RH = self._forward_dispatched(x_RH.to(c.dtype) if rows else x_RH, tokens_per_expert, problem)
        return y_RH if c.gate_on_input else y_RH * probs_R.unsqueeze(-1)

    @staticmethod
    def _run_pre_hooks(kept: list[nn.Module], args: tuple) -> str | None:
        """Run the kept modules' forward pre-hooks (called with ``args``: FEPLB's whole input, not the module's);
        why FEPLB cannot honour one (it returned new inputs), or None."""
        why = None
        for mod in kept:
            for key, hook in list(mod._forward_pre_hooks.items()):
                got = hook(mod, args, {}) if key in mod._forward_pre_hooks_with_kwargs else hook(mod, args)
                if got is not None and why is None:
                    why = (f"a forward pre-hook of {type(mod).__name__} returned new inputs, which FEPLB (reading the "
                           "weights, not running the module) cannot use")
        return why

    def refresh_replicas(self) -> None:
        with handshaken([self], ENTRY_REFRESH):   # (before the check's collective below)
            self._check_then_refresh()

    def _check_then_refresh(self) -> None:
        # Per-step copies read the weights now, right after the optimizer step. With forward pre-hooks on the
        # modules of the experts' parameters (Megatron's DDP with overlap_param_gather), the updated weights arrive
        # only in the next forward's hooks: the copies would be stale. Refused on every rank.
        if self.config.weights == "per-step" and (self.base != "none" or self.place):
            hooked = any(mod._forward_pre_hooks for mod in self._param_modules())
            # over the layer's CPU control group, as the layer's other per-step checks
            if int(self.control.all_reduce_min(torch.tensor([int(not hooked)]), "group",
                                               "refresh_replicas pre-hook check")[0]) == 0:
                raise RuntimeError(
                    f"{self.megatron_name or type(self).__name__}: per-step expert copies with forward pre-hooks on "
                    "the experts (Megatron's DistributedDataParallel with overlap_param_gather all-gathers the "
                    "updated weights only in the next forward): use weights='per-microbatch' (the default), or "
                    "overlap_param_gather=False")
        super().refresh_replicas()

    def reduce_replica_grads(self) -> None:
        if self.replicas.all_pairs() and not self._warned_ddp and \
                any(hasattr(p, "main_grad") for p in self.expert_params()):
            self._warned_ddp = True
            warnings.warn(f"{self.megatron_name or type(self).__name__}: per-step expert copies under Megatron's "
                          "DistributedDataParallel: their gradients reach main_grad correctly only with "
                          "overlap_grad_reduce=False and this call before finish_grad_sync; weights='per-microbatch' "
                          "has neither condition", stacklevel=2)
        super().reduce_replica_grads()

    def expert_shard_dim(self, pname: str) -> int | None:
        """None: Megatron names each local expert by its local index (or packs them into one weight)."""
        return None

    def whole_shape(self, pname: str) -> torch.Size | None:
        """None: the full model names each expert by its global index (:func:`full_state_dict`)."""
        return None

    def set_state_dict_type(self, kind: str) -> None:
        """Only ``"local"``: Megatron's distributed checkpoints go through :meth:`sharded_state_dict`."""
        if kind != "local":
            raise ValueError(f"{type(self).__name__}: state_dict() keeps Megatron's local names; Megatron's "
                             "distributed checkpointing (sharded_state_dict) shards the experts, not state_dict "
                             f"type {kind!r}")
        super().set_state_dict_type(kind)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed checkpointing: exactly the sharded state dict of the Megatron experts module this
        replaced (each local expert under its global index, replicated over the expert data-parallel group), so
        checkpoints move between this layer and Megatron's own."""
        if self._megatron_groups[0] is None:
            raise NotImplementedError(f"{type(self).__name__} made outside feplb.megatron.apply has no Megatron "
                                      "groups to shard its checkpoint by")
        cls, view = self._sharding_source()
        return cls.sharded_state_dict(view, prefix, sharded_offsets, metadata)

    def _view(self, **attrs: Any) -> SimpleNamespace:
        """What Megatron's experts module's ``sharded_state_dict`` reads of its module."""
        ep, dp, tp = self._megatron_groups
        return SimpleNamespace(config=self.megatron_config, num_local_experts=self.num_local, ep_group=ep,
                               dp_group=dp, tp_group=tp, **attrs)

    @staticmethod
    def _empty_state(name: str, value: Any) -> Any:
        """``value`` if it is an empty extra state; raises otherwise (per-expert state is not gathered)."""
        if not _empty_extra_state(value):
            raise NotImplementedError(f"feplb.megatron.full_state_dict: local expert state {name!r} is not empty "
                                      "and cannot be gathered")
        return value

    def extra_repr(self) -> str:
        return f"{self.megatron_name!r}, token_dispatcher={self.token_dispatcher!r}, " + super().extra_repr()


# A pickled None, as Transformer Engine 2.0 - 2.3 store the extra state of a module without fp8 (uint8 tensor).
_PICKLED_NONE = {pickle.dumps(None, protocol=p) for p in range(2, pickle.HIGHEST_PROTOCOL + 1)}


def _empty_extra_state(value: Any) -> bool:
    """Whether a linear's ``_extra_state`` holds nothing: None (Megatron's linears); Transformer Engine's without fp8:
    a tensor of no elements (2.4 on), a pickled None in a uint8 tensor (2.0 - 2.3), a ``torch.save``'d None in a
    BytesIO (1.x)."""
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 0 or (value.dtype == torch.uint8 and value.dim() == 1 and value.numel() <= 8
                                      and bytes(value.cpu().tolist()) in _PICKLED_NONE)
    if isinstance(value, io.BytesIO):
        at = value.tell()
        try:
            value.seek(0)
            return torch.load(value, weights_only=True) is None
        except Exception:
            return False
        finally:
            value.seek(at)
    return False


class FEPLBSequentialMLP(FEPLBExperts):
    """Replaces ``SequentialMLP``: keeps Megatron's ``MLP`` modules of the local experts (``local_experts.{i}``:
    ``linear_fc1.weight`` [2F, H], the gate's rows, then the up projection's; ``linear_fc2.weight`` [H, F]; with
    ``add_bias_linear``, ``linear_fc1.bias`` [2F] and ``linear_fc2.bias`` [H])."""

    def _take_experts(self, src: nn.Module) -> None:
        self.local_experts = nn.ModuleList(src.local_experts)

    @staticmethod
    def _kept(holder: nn.Module) -> list[nn.Module]:
        return [s for m in holder.local_experts for s in (m, m.linear_fc1, m.linear_fc2)]

    def _parts(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.config.expert_bias else ("weight",)

    def expert_params(self) -> tuple[nn.Parameter, ...]:
        return tuple(getattr(lin, k) for m in self.local_experts for lin in (m.linear_fc1, m.linear_fc2)
                     for k in self._parts())

    def _join(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # expert_params(): each expert's fc1 weight (and bias), then its fc2 weight (and bias)
        dt, ps = self.config.dtype, params or self.expert_params()
        n = len(self._parts())
        fc1, fc2 = ps[0::2 * n], ps[n::2 * n]
        w1, w2 = torch.stack(fc1).to(dt), torch.stack(fc2).to(dt)   # [L, 2F, H], [L, H, F]
        if not self.config.expert_bias:
            return w1.transpose(1, 2), w2.transpose(1, 2)
        b1, b2 = torch.stack(ps[1::2 * n]).to(dt), torch.stack(ps[n + 1::2 * n]).to(dt)   # [L, 2F], [L, H]
        return w1.transpose(1, 2), w2.transpose(1, 2), b1, b2

    def full_entries(self, pname: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's ``local_experts.{i}`` is the model's expert ``rank * L + i``."""
        head, i, tail = pname.split(".", 2)
        return {f"{head}.{r * self.num_local + int(i)}.{tail}": t for r, t in enumerate(parts)}

    def full_state_entries(self, name: str, value: Any) -> dict[str, Any]:
        """Megatron's linears keep an empty ``_extra_state`` per expert: one under every global index."""
        head, _, tail = name.split(".", 2) if name.count(".") >= 2 else (name, "", "")
        if head != "local_experts":
            return super().full_state_entries(name, value)
        value = self._empty_state(name, value)
        return {f"local_experts.{e}.{tail}": value for e in range(self.config.num_experts)}

    def _sharding_source(self) -> tuple[type, Any]:
        return _megatron()[1].SequentialMLP, self._view(local_experts=self.local_experts)


class FEPLBTEGroupedMLP(FEPLBExperts):
    """Replaces ``TEGroupedMLP`` (``moe_grouped_gemm=True`` with Transformer Engine): keeps its two grouped linears
    (``linear_fc1.weight{i}`` [2F, H], the gate's rows, then the up projection's; ``linear_fc2.weight{i}`` [H, F];
    with ``add_bias_linear``, ``linear_fc1.bias{i}`` [2F] and ``linear_fc2.bias{i}`` [H])."""

    def _take_experts(self, src: nn.Module) -> None:
        self.linear_fc1, self.linear_fc2 = src.linear_fc1, src.linear_fc2

    @staticmethod
    def _kept(holder: nn.Module) -> list[nn.Module]:
        return [holder.linear_fc1, holder.linear_fc2]

    def expert_params(self) -> tuple[nn.Parameter, ...]:
        kinds = ("weight", "bias") if self.config.expert_bias else ("weight",)
        return tuple(p for k in kinds for pair in zip(_gemm_weights(self.linear_fc1, self.num_local, k),
                                                      _gemm_weights(self.linear_fc2, self.num_local, k), strict=True)
                     for p in pair)

    def _join(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # expert_params(): (fc1's weight{i}, fc2's weight{i}) for each i, then the same of the biases
        dt, L, ps = self.config.dtype, self.num_local, params or self.expert_params()
        w1, w2 = torch.stack(ps[0:2 * L:2]).to(dt), torch.stack(ps[1:2 * L:2]).to(dt)   # [L, 2F, H], [L, H, F]
        if not self.config.expert_bias:
            return w1.transpose(1, 2), w2.transpose(1, 2)
        b1, b2 = torch.stack(ps[2 * L::2]).to(dt), torch.stack(ps[2 * L + 1::2]).to(dt)   # [L, 2F], [L, H]
        return w1.transpose(1, 2), w2.transpose(1, 2), b1, b2

    def full_entries(self, pname: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's ``weight{i}`` (``bias{i}``) is the model's ``weight{rank * L + i}`` (``bias{...}``)."""
        lin, w = pname.split(".")
        kind = w.rstrip("0123456789")
        i = int(w[len(kind):])
        return {f"{lin}.{kind}{r * self.num_local + i}": t for r, t in enumerate(parts)}

    def full_state_entries(self, name: str, value: Any) -> dict[str, Any]:
        """Each grouped linear's one ``_extra_state`` (empty without fp8) stays one."""
        if name.startswith(("linear_fc1.", "linear_fc2.")):
            value = self._empty_state(name, value)
        return super().full_state_entries(name, value)

    def _sharding_source(self) -> tuple[type, Any]:
        return _megatron()[1].TEGroupedMLP, self._view(_modules={"linear_fc1": self.linear_fc1,
                                                                 "linear_fc2": self.linear_fc2})


class FEPLBGroupedMLP(FEPLBExperts):
    """Replaces the legacy ``GroupedMLP`` (``moe_grouped_gemm=True`` without Transformer Engine): keeps its two
    parameters, ``weight1`` [H, L * 2F] (read as [L, H, 2F]: each expert's gate columns, then its up projection's)
    and ``weight2`` [L * F, H] (read as [L, F, H]), as its own."""

    def _take_experts(self, src: nn.Module) -> None:
        self.weight1, self.weight2 = src.weight1, src.weight2
        # GroupedMLP's own post-hook: loading forgives the extra-state keys of a SequentialMLP's state dict
        for hook in src._load_state_dict_post_hooks.values():
            self.register_load_state_dict_post_hook(hook)

    def _param_modules(self) -> list[nn.Module]:
        return [self]

    def expert_params(self) -> tuple[nn.Parameter, ...]:
        return self.weight1, self.weight2

    def _join(self, *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt, L = self.config.dtype, self.num_local
        w1, w2 = params or self.expert_params()
        return w1.view(L, self.config.hidden, -1).to(dt), w2.view(L, -1, self.config.hidden).to(dt)

    def full_entries(self, pname: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank r's block of experts is the model's experts ``r * L ...``, in memory order: ``weight1`` [H, E * 2F]
        holds them one [H, 2F] block after another, as its view [E, H, 2F] reads them."""
        whole = torch.cat([p.reshape(-1) for p in parts])
        return {pname: whole.view(self.config.hidden, -1) if pname == "weight1" else whole.view(-1,
                                                                                                 self.config.hidden)}

    def _sharding_source(self) -> tuple[type, Any]:
        w1, w2 = self.weight1, self.weight2
        return _megatron()[1].GroupedMLP, self._view(
            weight1=w1, weight2=w2,
            state_dict=lambda prefix="", keep_vars=False: {"weight1": w1 if keep_vars else w1.detach(),
                                                            "weight2": w2 if keep_vars else w2.detach()})


def _gemm_weights(lin: nn.Module, L: int, kind: str = "weight") -> list[torch.Tensor]:
    """A Transformer Engine grouped linear's weights of its L experts (``weight{i}``, [out, in]), or their biases
    (``kind="bias"``: ``bias{i}`` [out])."""
    return [getattr(lin, f"{kind}{i}") for i in range(L)]


@functools.cache
def _dispatcher_class():
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    class FEPLBTokenDispatcher(MoETokenDispatcher):
        """Megatron's token dispatcher interface around a FEPLB layer: the dispatch is the layer's own, so this only
        turns Megatron's routing (``routing_map`` [T, E] bool, ``probs`` [T, E]) into top-k ids and weights, passes
        them to the experts in the probabilities' place, and restores the hidden states' shape.

        With ``moe_shared_expert_overlap`` the shared experts are the dispatcher's, as in Megatron's own: their
        whole forward (the sequence-parallel gather, both linears, the reduce-scatter) is queued on their side stream
        as the dispatch begins, so it runs beside FEPLB's layer, and their output is added, after waiting for that
        stream, as the combine ends."""

        def __init__(self, old: MoETokenDispatcher, top_k: int) -> None:
            # Megatron's attributes, taken from the dispatcher it replaces (no process group is made here).
            for a in ("config", "ep_group", "tp_group", "tp_ep_group", "tp_size", "tp_rank", "ep_size"):
                setattr(self, a, getattr(old, a, None))
            # (set by Megatron's MoELayer with moe_shared_expert_overlap, which then leaves them to the dispatcher)
            self.shared_experts = getattr(old, "shared_experts", None)
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
            # no host sync. A token with fewer than k (some dropped at an expert's capacity,
            # moe_expert_capacity_factor) has its other slots masked: id -1, no row, no compute
            # (FEPLBConfig.masked_routes).
            ids_TK = routing_map.to(torch.uint8).sort(dim=1, descending=True, stable=True).indices[:, :k]
            sel_TK = routing_map.gather(1, ids_TK)
            w_TK = torch.where(sel_TK, probs.gather(1, ids_TK), torch.zeros((), dtype=probs.dtype,
                                                                                device=probs.device))
            return x_TH, (torch.where(sel_TK, ids_TK, -1), w_TK)

        def token_dispatch(self, hidden_states, probs):
            shared = self.shared_experts
            if shared is not None:   # queued on the shared experts' stream, beside the layer that follows
                # (a forward that raised after this point, as FEPLB's refusals do on every rank, left these set:
                # Megatron's pre_forward_comm would refuse the next forward, and they would hold that one's graph)
                for a in ("cached_fc1_input", "cached_fc2_input", "cached_fc2_output", "cached_output", "gate_score"):
                    setattr(shared, a, None)
                shared.pre_forward_comm(hidden_states.view(self.hidden_shape))
                shared.linear_fc1_forward_and_act()
                shared.linear_fc2_forward()
                shared.post_forward_comm()
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
            out = hidden_states.view(self.hidden_shape)
            if self.shared_experts is not None:
                out = out + self.shared_experts.get_output()
            return out

    return FEPLBTokenDispatcher


def _watch_grad_buffer_resets() -> None:
    """Have Megatron's ``DistributedDataParallel.zero_grad_buffer`` (once, for the class) mark the FEPLB layers of
    its module whose per-step copies hold gradients: it zeroes the experts' ``main_grad`` in place, a backward the
    training loop discards, and the copies' share of it would reach the next step's gradients at the next reduction
    (``_grads_dropped`` tells ``.grad`` apart by its version counter; ``main_grad``, a view of the bucket that the
    backward hooks and Megatron's reduction write, it cannot). The next forward then refuses on every rank, as for a
    model's ``zero_grad``, until ``feplb.megatron.zero_replica_grads(model)`` drops the copies' share too."""
    try:
        from megatron.core.distributed import DistributedDataParallel
    except ImportError:
        return
    inner = DistributedDataParallel.zero_grad_buffer
    if getattr(inner, "_feplb_watched", False):
        return

    @functools.wraps(inner)
    def zero_grad_buffer(self, *args: Any, **kwargs: Any) -> Any:
        for m in self.module.modules():
            if isinstance(m, MoELayer) and m.replicas.ever_held and not m.replicas.grads_clean():
                m._grad_buffers_zeroed = True
        return inner(self, *args, **kwargs)

    zero_grad_buffer._feplb_watched = True
    DistributedDataParallel.zero_grad_buffer = zero_grad_buffer


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
    ("moe_pad_expert_input_to_capacity", (False, None), "padding experts' inputs to capacity"),
    ("moe_router_padding_for_quantization", (False, None), "routing padded for fp8/fp4"),
    ("moe_router_padding_for_fp8", (False, None), "routing padded for fp8"),
    ("fp8", (None, False), "fp8 experts"),
    ("fp4", (None, False), "fp4 experts"),
    ("quant_recipe", (None,), "a per-module quantization recipe (Transformer Engine's linears then run in fp8/fp4)"),
    ("moe_latent_size", (None, 0), "latent projections around the experts"),
    ("overlap_moe_expert_parallel_comm", (False, None), "overlapped expert-parallel communication"),
    ("delay_wgrad_compute", (False, None), "delayed weight gradients (backward_dw)"),
    ("activation_func_fp8_input_store", (False, None), "the activation's input stored in fp8 for the backward"),
    ("use_te_activation_func", (False, None), "Transformer Engine's activation module"),
    ("cuda_graph_impl", ("none", None), "CUDA graphs (FEPLB plans on the CPU every micro-batch)"),
    ("enable_cuda_graph", (False, None), "CUDA graphs (FEPLB plans on the CPU every micro-batch)"),
    ("external_cuda_graph", (False, None), "CUDA graphs (FEPLB plans on the CPU every micro-batch)"),
)


# Transformer Engine's CUDA graphs of these parts only leave the MoE layer (router, dispatch, experts) eager
_GRAPH_SCOPES_OUTSIDE_MOE = frozenset({"attn", "mlp", "mamba"})


def _scopes(cfg: Any) -> list[str]:
    scope = getattr(cfg, "cuda_graph_scope", None)
    scope = [] if scope is None else scope if isinstance(scope, (list, tuple)) else [scope]
    return [getattr(s, "name", s) for s in scope]


def _graphs_leave_moe_out(cfg: Any) -> bool:
    """Whether the config's CUDA graphs (Transformer Engine's, ``cuda_graph_impl="transformer_engine"``) capture
    parts other than the MoE layer only (``cuda_graph_scope`` of attention, dense MLPs, Mamba): FEPLB's forward,
    which plans on the CPU every micro-batch, then runs eagerly as in any run without graphs. An empty scope is the
    whole layer; Megatron's own implementation (``"local"``) is refused whatever its scope."""
    scopes = _scopes(cfg)
    return getattr(cfg, "cuda_graph_impl", None) == "transformer_engine" and bool(scopes) and \
        set(scopes) <= _GRAPH_SCOPES_OUTSIDE_MOE and not getattr(cfg, "enable_cuda_graph", False) and \
        not getattr(cfg, "external_cuda_graph", False)


# What FEPLB would lose of the expert modules it keeps but whose forward it does not run: forward hooks and backward
# hooks. Their forward pre-hooks it runs (Megatron's DistributedDataParallel waits there for the parameters'
# all-gather with overlap_param_gather); their state-dict hooks stay with them.
_LOST_HOOKS = ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


_TOKEN_DISPATCHERS = ("feplb", "megatron")


def _token_dispatcher_problem(token_dispatcher: object, policy: str) -> str | None:
    """Why FEPLB's experts cannot run behind ``token_dispatcher`` with ``policy``, or None."""
    if token_dispatcher not in _TOKEN_DISPATCHERS:
        return f"token_dispatcher={token_dispatcher!r}: expected one of {_TOKEN_DISPATCHERS}"
    why = dispatched_policy_problem(policy) if token_dispatcher == "megatron" else None
    return None if why is None else f"behind Megatron's own token dispatcher (token_dispatcher='megatron'), {why}"


def _lost_hooks(kept: list[nn.Module]) -> str | None:
    return next(filter(None, (hooks_problem(mod, _LOST_HOOKS) for mod in kept)), None)


def _megatrons_own_hook(hook: Any) -> bool:
    """GroupedMLP's load-state-dict post-hook (it forgives SequentialMLP's extra-state keys), which
    :class:`FEPLBGroupedMLP` takes over."""
    return getattr(hook, "__name__", "") == "remove_extra_states_check"


def _activation(cfg: Any, kind: str) -> tuple[str | None, dict]:
    """(why FEPLB cannot compute the experts' activation as Megatron does, or None; the FEPLBConfig fields it gives).

    Megatron's unfused path computes ``act(min(gate, c)) * (clamp(up, -c, c) + offset)`` for gated units
    (``activation_func_clamp_value`` c, ``glu_linear_offset``), ``act(h)`` otherwise. Its fused paths
    (``bias_activation_fusion``) take gated SiLU (ignoring the clamp) and gated quick-GELU (with the clamp and the
    offset) only, and the legacy GroupedMLP ignores both: where Megatron's paths disagree or cannot run, FEPLB
    refuses rather than pick one. Mapped: gated SiLU (clamped or not), gated GeLU (erf, unfused), gated quick-GELU
    with offset 1 (gpt-oss's gate, ``swiglu_oai``, alpha 1.702), and non-gated squared ReLU (Nemotron's), SiLU,
    GeLU."""
    from megatron.core.activations import quick_gelu as quick_gelu_a
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu as quick_gelu_f

    act, clamp, offset = cfg.activation_func, cfg.activation_func_clamp_value, cfg.glu_linear_offset or 0.0
    # the legacy GroupedMLP has no fused path: it computes the unfused form whatever bias_activation_fusion says
    fused = bool(getattr(cfg, "bias_activation_fusion", False)) and kind != "GroupedMLP"
    # SequentialMLP's MLP hands linear_fc1's bias to the fused activation apart (TEGroupedMLP's grouped linear adds
    # it in the GEMM): Megatron's fused weighted SwiGLU then raises, and its fused quick-GeGLU clamps before adding it
    fc1_bias_apart = fused and kind == "SequentialMLP" and bool(getattr(cfg, "add_bias_linear", False))
    name = getattr(act, "__name__", repr(act))
    if not cfg.gated_linear_unit:
        kinds = {squared_relu: "relu2", F.silu: "silu", F.gelu: "gelu"}
        if act not in kinds:
            return f"activation {name} (non-gated): FEPLB computes squared_relu, silu or gelu there", {}
        if fused:
            return "bias_activation_fusion with non-gated experts (Megatron's fused path takes gated ones only)", {}
        if clamp is not None or offset:
            return "activation_func_clamp_value / glu_linear_offset on non-gated experts (Megatron ignores them)", {}
        return None, {"gated": False, "activation": kinds[act]}
    if kind == "GroupedMLP" and (clamp is not None or offset):
        return "activation_func_clamp_value / glu_linear_offset with the legacy GroupedMLP (which ignores them)", {}
    if act is F.silu:
        if clamp is not None and fused:
            return ("activation_func_clamp_value with bias_activation_fusion: Megatron's fused SwiGLU ignores the "
                    "clamp, its unfused one applies it"), {}
        if fc1_bias_apart:
            return ("add_bias_linear with bias_activation_fusion and SequentialMLP experts: Megatron's fused weighted "
                    "SwiGLU takes no bias (its forward raises)"), {}
        fields = {"activation": "silu"}
    elif act is F.gelu:
        if fused:
            return "gated gelu with bias_activation_fusion (Megatron fuses SwiGLU and quick-GELU only here)", {}
        fields = {"activation": "gelu"}
    elif act is quick_gelu_a or act is quick_gelu_f:
        if offset != 1.0:
            return (f"gated quick_gelu with glu_linear_offset {offset!r}: FEPLB computes it with offset 1 "
                    "(gpt-oss's)"), {}
        if fc1_bias_apart and clamp is not None:
            return ("activation_func_clamp_value with add_bias_linear, bias_activation_fusion and SequentialMLP "
                    "experts: Megatron's fused quick-GeGLU clamps before adding linear_fc1's bias, its unfused path "
                    "and TEGroupedMLP after"), {}
        fields = {"activation": "swiglu_oai", "swiglu_alpha": 1.702}
    else:
        return f"activation {name} (gated): FEPLB computes silu, gelu or quick_gelu there", {}
    if offset and fields["activation"] != "swiglu_oai":
        return f"glu_linear_offset {offset!r} with {name}: FEPLB takes an offset with quick_gelu only", {}
    return None, {**fields, "swiglu_limit": None if clamp is None else float(clamp)}


def _sequential_weights(experts, L: int, H: int, Fd: int, G: int, bias: bool) -> tuple[str | None, list]:
    """(why not, [w1, w2] of every local expert, then [b1, b2] with ``bias``) of a ``SequentialMLP`` (fc1 G = 2F
    rows, F without a gate)."""
    local = list(experts.local_experts)
    if len(local) != L:
        return f"{len(local)} local expert modules, expected {L}", []
    ws = []
    want = sorted(f"linear_fc{j}.{k}" for j in (1, 2) for k in (("weight", "bias") if bias else ("weight",)))
    for i, m in enumerate(local):
        own = sorted(n for n, _ in m.named_parameters())
        if own != want:
            return f"local expert {i} has parameters {own}; expected {', '.join(want)}", []
        if sorted(n for n, _ in m.named_buffers()):
            return f"local expert {i} has buffers (quantized experts are not supported)", []
        kinds = (type(m.linear_fc1).__name__, type(m.linear_fc2).__name__)
        if kinds not in _LINEARS:
            return (f"local expert {i}'s linears are {kinds[0]} and {kinds[1]}; expected Megatron's or Transformer "
                    "Engine's column- and row-parallel linears (FEPLB multiplies by their weights)"), []
        w1, w2 = m.linear_fc1.weight, m.linear_fc2.weight
        if w1.shape != (G, H) or w2.shape != (H, Fd):
            return (f"local expert {i}: linear_fc1 {list(w1.shape)}, linear_fc2 {list(w2.shape)}; expected "
                    f"[{G}, {H}] and [{H}, {Fd}]"), []
        ws += [w1, w2]
        if bias:
            b1, b2 = m.linear_fc1.bias, m.linear_fc2.bias
            if b1.shape != (G,) or b2.shape != (H,):
                return (f"local expert {i}: linear_fc1.bias {list(b1.shape)}, linear_fc2.bias {list(b2.shape)}; "
                        f"expected [{G}] and [{H}]"), []
            ws += [b1, b2]
    return None, ws


def _te_grouped_weights(experts, L: int, H: int, Fd: int, G: int, bias: bool) -> tuple[str | None, list]:
    """(why not, the grouped linears' weights, then their biases with ``bias``) of a ``TEGroupedMLP``: Transformer
    Engine's ``GroupedLinear`` keeps expert i's weight as ``weight{i}`` [out, in], its bias as ``bias{i}`` [out]."""
    subs = list(experts.named_children())
    if [n for n, _ in subs] != ["linear_fc1", "linear_fc2"] or list(experts.named_parameters(recurse=False)):
        return (f"modules {[n for n, _ in subs]} and parameters "
                f"{[n for n, _ in experts.named_parameters(recurse=False)]}; expected linear_fc1 and linear_fc2 "
                "alone"), []
    kinds = tuple(type(m).__name__ for _, m in subs)
    if kinds != _TE_GROUPED:
        return (f"grouped linears {kinds[0]} and {kinds[1]}; expected Transformer Engine's {_TE_GROUPED[0]} and "
                f"{_TE_GROUPED[1]} (FEPLB multiplies by their weights)"), []
    ws, bs = [], []
    for (name, lin), shape in zip(subs, ((G, H), (H, Fd)), strict=True):
        own = sorted(n for n, _ in lin.named_parameters())
        want = sorted(f"{k}{i}" for i in range(L) for k in (("weight", "bias") if bias else ("weight",)))
        if own != want:
            return f"{name} has parameters {own}; expected {want}", []
        for kind, shape_, got in (("weight", shape, ws),) + ((("bias", shape[:1], bs),) if bias else ()):
            for i, w in enumerate(_gemm_weights(lin, L, kind)):
                if w.shape != shape_:
                    return f"{name}.{kind}{i} {list(w.shape)}; expected {list(shape_)}", []
                got.append(w)
    return None, ws + bs


def _grouped_weights(experts, L: int, H: int, Fd: int, G: int, bias: bool) -> tuple[str | None, list]:
    """(why not, [weight1, weight2]) of the legacy ``GroupedMLP`` (which Megatron builds without biases)."""
    if bias:
        return "add_bias_linear with the legacy GroupedMLP (Megatron's has no biases)", []
    if list(experts.children()) or sorted(n for n, _ in experts.named_parameters()) != ["weight1", "weight2"]:
        return (f"parameters {sorted(n for n, _ in experts.named_parameters())}; expected weight1 and weight2 "
                "alone"), []
    w1, w2 = experts.weight1, experts.weight2
    if w1.shape != (H, L * G) or w2.shape != (L * Fd, H):
        return (f"weight1 {list(w1.shape)}, weight2 {list(w2.shape)}; expected [{H}, {L * G}] and "
                f"[{L * Fd}, {H}]"), []
    return None, [w1, w2]


# Megatron's experts class -> (FEPLB's class, the check of its weights)
_LAYOUTS = {"SequentialMLP": (FEPLBSequentialMLP, _sequential_weights),
            "TEGroupedMLP": (FEPLBTEGroupedMLP, _te_grouped_weights),
            "GroupedMLP": (FEPLBGroupedMLP, _grouped_weights)}


# What FEPLB behind Megatron's own token dispatcher runs of _CONFIG_REFUSALS: padded to capacity, the dispatcher
# delivers each expert's capacity of rows, the padding weighed by probability 0, which FEPLB computes like any row
_OWN_DISPATCH_RUNS = ("moe_pad_expert_input_to_capacity",)


def _problem(moe: nn.Module, mc_experts, world: int, rank: int, dtype: torch.dtype | None, own: bool = False
             ) -> tuple[str | None, dict, type | None]:
    """Why FEPLB cannot run ``moe``'s experts exactly (None if it can), the FEPLBConfig fields they give, and the
    FEPLB class replacing them; ``own``: behind Megatron's own token dispatcher."""
    cfg = moe.config
    experts = moe.experts
    kind = next((k for k in _LAYOUTS if type(experts) is getattr(mc_experts, k, None)), None)
    if kind is None:
        return (f"experts {type(experts).__name__}: FEPLB replaces Megatron's SequentialMLP, TEGroupedMLP and "
                "GroupedMLP"), {}, None
    for field, allowed, why in _CONFIG_REFUSALS:
        v = getattr(cfg, field, None)
        if field == "cuda_graph_impl" and _graphs_leave_moe_out(cfg):
            continue
        if v not in allowed and not (own and field in _OWN_DISPATCH_RUNS):
            return f"{why} ({field}={v!r}, cuda_graph_scope={_scopes(cfg)})" if field == "cuda_graph_impl" \
                else f"{why} ({field}={v!r})", {}, None
    why, act_fields = _activation(cfg, kind)
    if why is not None:
        return why, {}, None
    for g in (moe.token_dispatcher.tp_group, getattr(experts, "tp_group", None)):
        if g is not None and dist.get_world_size(g) > 1:
            return (f"expert tensor parallelism of size {dist.get_world_size(g)} (FEPLB needs it 1: "
                    "expert_tensor_parallel_size=1)"), {}, None
    attn_tp = getattr(moe, "tp_group", None)
    if attn_tp is not None and dist.get_world_size(attn_tp) > 1 and not cfg.sequence_parallel:
        # each rank of a tensor-parallel group would dispatch the same tokens
        return (f"tensor parallelism of size {dist.get_world_size(attn_tp)} without sequence parallelism (the MoE "
                "layer's tokens must differ between ranks)"), {}, None
    E, K, H = cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size
    Fd = cfg.moe_ffn_hidden_size
    L = E // world if E % world == 0 else None
    if L is None or moe.num_local_experts != L or experts.num_local_experts != L or \
            list(moe.local_expert_indices) != list(range(rank * L, rank * L + L)):
        return (f"local experts {list(moe.local_expert_indices)} of {E}: expected this rank's E / W block of the "
                f"EP group ({world} ranks)"), {}, None
    cls, check = _LAYOUTS[kind]
    bias = bool(getattr(cfg, "add_bias_linear", False))
    why, ws = check(experts, L, H, Fd, 2 * Fd if cfg.gated_linear_unit else Fd, bias)
    if why is not None:
        return f"{kind}: {why}", {}, None
    # The experts module goes (GroupedMLP's own load-state-dict post-hook FEPLB takes over); the modules kept stay
    # (with their state-dict hooks), but FEPLB reads their weights and runs none of their forwards.
    why = hooks_problem(experts, tuple(k for k in _HOOKS if k != "_load_state_dict_post_hooks"))
    if why is None and not (kind == "GroupedMLP" and all(map(_megatrons_own_hook,
                                                             experts._load_state_dict_post_hooks.values()))):
        why = hooks_problem(experts, ("_load_state_dict_post_hooks",))
    if why is None:
        why = _lost_hooks(cls._kept(experts))
    if why is None:
        quantized = [type(m).__name__ for m in experts.modules() if getattr(m, "te_quant_params", None) is not None]
        if quantized:
            why = f"{quantized[0]} quantized (te_quant_params set: it runs in fp8/fp4)"
    if why is not None:
        return why, {}, None
    if any(w.is_meta for w in ws):
        return "weights on the meta device; initialise or load them before apply", {}, None
    if len({w.dtype for w in ws}) != 1 or ws[0].dtype not in _DTYPES:
        return f"weight dtypes {sorted({str(w.dtype) for w in ws})}; expected one of {_DTYPES}", {}, None
    if ws[0].device.type not in ("cpu", "cuda") or len({w.device for w in ws}) != 1:
        return f"weights on {sorted({str(w.device) for w in ws})}; expected one CPU or CUDA device", {}, None
    if not isinstance(K, int) or not 1 <= K <= E:
        return f"moe_router_topk {K!r}; expected an int in [1, {E}]", {}, None
    return None, {"hidden": int(H), "ffn": int(Fd), "num_experts": int(E), "top_k": K,
                  "dtype": dtype if dtype is not None else ws[0].dtype, "device": ws[0].device.type,
                  # the router's probabilities scale the experts' inputs (Megatron allows it with top-1 only)
                  "gate_on_input": bool(getattr(cfg, "moe_apply_probs_on_input", False)), "expert_bias": bias,
                  # tokens dropped at an expert's capacity (moe_expert_capacity_factor) leave slots to no expert
                  "masked_routes": True,
                  **act_fields}, cls


# ---------------------------------------------------------------------------------------------------- apply

def apply(model: nn.Module | list[nn.Module], *, dtype: torch.dtype | None = None, token_dispatcher: str = "feplb",
          **config_overrides: Any) -> list[str]:
    """Replace the token dispatcher and experts of every Megatron-Core ``MoELayer`` of ``model``, in place, with
    FEPLB over the layer's own expert-parallel group, keeping this rank's experts (the same modules). Collective
    over that group; every MoE layer of the model must use the same one.

    dtype: what the experts compute in, and the rows travel in (default: the parameters' dtype, as Megatron
        computes them). The parameters keep their own dtype.
    token_dispatcher: "feplb" (default): FEPLB dispatches the tokens itself (phase 1 over the EP group, then the
        node's GPUs share the work). "megatron": the model keeps its own token dispatcher (``alltoall``,
        ``allgather``, or ``flex`` with DeepEP or HybridEP) and only the experts are replaced: FEPLB balances the
        rows that dispatcher delivers to each GPU between the GPUs of its node (``MoELayer.forward_dispatched``)
        and returns them weighed by their probabilities, as Megatron's experts do. Every expert stays at its owner
        there: policies with ``+place`` and the direct ones (``fastermoe``, ``eplb``) are refused.
    config_overrides: :class:`feplb.FEPLBConfig` fields (policy, gpus_per_node, dyn, weights, plan_wait_ms, ...).
        hidden, ffn, num_experts and top_k come from Megatron's config; the router is the model's own. The device
        defaults to the experts', ``weights`` to "per-microbatch" (see the module's docstring).

    model: the model, or the list of its virtual-pipeline chunks (as Megatron's ``get_model`` returns them): pass
        every chunk of this stage in one call (a chunk of dense layers on every stage is no error then; the names
        returned start with the chunk's index).

    Returns the qualified names of the replaced experts modules ([] on a pipeline stage without MoE layers: call it
    on every stage). Raises, on every rank together and before anything
    is replaced: ValueError naming each MoE layer FEPLB cannot run exactly and why (see the module's docstring), or
    when the ranks' models differ; TypeError for an unknown or derived override; ImportError without
    Megatron-Core.
    """
    if not dist.is_initialized():
        raise RuntimeError("feplb.megatron.apply needs torch.distributed initialised (and Megatron's parallel "
                           "state) first")
    if isinstance(model, (list, tuple)):
        model = nn.ModuleList(model)    # (the chunks' modules themselves, named by their index)
    mc_layer, mc_experts = _megatron()
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, mc_layer.MoELayer) and not isinstance(m.experts, FEPLBExperts)]
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
    # the dispatch decides every forward's collectives: one rank behind another dispatcher would hang its peers
    dispatchers = _agree(repr(token_dispatcher), group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # Per-micro-batch weights by default: their gradients return inside the backward, where Megatron's
    # DistributedDataParallel (also with overlap_grad_reduce) sees them; per-step copies need reduce_replica_grads
    # before Megatron's gradient reduction, and overlap_grad_reduce off.
    config_overrides = {"weights": "per-microbatch", **config_overrides}
    problems, plans = [], []
    if dtype is not None and dtype not in _DTYPES:
        problems.append(f"  dtype={dtype}: expected one of {_DTYPES}")
    if token_dispatcher not in _TOKEN_DISPATCHERS:
        problems.append(f"  {_token_dispatcher_problem(token_dispatcher, 'none')}")
    if len(set(dispatchers)) > 1:
        problems.append(f"  token_dispatcher differs between EP ranks: {', '.join(dispatchers)} (in rank order)")
    for name, moe in found:
        why, fields_of, cls = _problem(moe, mc_experts, world, rank, dtype, own=token_dispatcher == "megatron")
        if why is None:
            cfg = layer_config(fields_of, config_overrides)
            if isinstance(cfg, str):
                why = cfg
            elif token_dispatcher in _TOKEN_DISPATCHERS:
                why = _token_dispatcher_problem(token_dispatcher, cfg.policy)
        if why is not None:
            problems.append(f"  {name or type(model).__name__} ({type(moe).__name__}): {why}")
        else:
            plans.append((name, moe, cfg, cls))
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
    try:
        for name, moe, cfg, cls in plans:
            new = cls(cfg, group, moe.experts, name=f"{name}.experts" if name else "experts",
                      token_dispatcher=token_dispatcher, layer_config=moe.config)
            made.append((moe, new, None))
            new.train(moe.experts.training)
            new.refresh_replicas()
            made[-1] = (moe, new, Dispatcher(moe.token_dispatcher, cfg.top_k) if token_dispatcher == "feplb"
                        else moe.token_dispatcher)
    except BaseException:
        # the model is left as it was: release what the layers built so far hold (threads, copy paths), newest first
        for _, new, _ in reversed(made):
            new.close()
        raise
    for moe, new, dispatcher in made:
        moe.experts = new
        moe.token_dispatcher = dispatcher
    if made:
        _watch_grad_buffer_resets()
    ignored = sorted({opt for _, moe, _, _ in plans for opt in _memory_options(moe.config)})
    if ignored:
        warnings.warn(f"feplb.megatron.apply: FEPLB's experts do not {' or '.join(ignored)}: the results are the same, "
                      "but their activations take the memory they take without these options", stacklevel=2)
    return [f"{name}.experts" if name else "experts" for name, _, _, _ in plans]


def reduce_replica_grads(model: nn.Module | list[nn.Module]) -> None:
    """``reduce_replica_grads()`` of every FEPLB layer of ``model`` (collective; the model, or the list of chunks
    Megatron's ``finalize_model_grads`` is given): after a step's last backward, before Megatron reduces the
    gradients. Refused, on every rank, where ``model`` holds a Megatron ``DistributedDataParallel`` with
    ``overlap_grad_reduce`` around layers with per-step copies: it reduced their buckets during the backward, so
    the copies' gradients would reach ``main_grad`` after the reduction (wrong expert gradients, no error). Given
    the modules inside the wrappers, only a warning can say so (``FEPLBExperts.reduce_replica_grads``)."""
    from megatron.core.distributed import DistributedDataParallel

    overlapped = any(isinstance(m, DistributedDataParallel) and m.ddp_config.overlap_grad_reduce
                     for root in roots(model) for m in root.modules())
    copies = [lay for lay in experts_modules(model)
              if lay.config.weights == "per-step" and (lay.base != "none" or lay.place) and lay.world_size > 1]
    if overlapped and copies:    # (the same config on every rank: all raise)
        raise ValueError(
            f"feplb.megatron.reduce_replica_grads: weights='per-step' (policy {copies[0].config.policy!r}) under "
            "Megatron's DistributedDataParallel with overlap_grad_reduce=True: it reduces the experts' gradient "
            "buckets during the backward, before this call can add the per-step copies' gradients to main_grad, "
            "and they would be lost from the step. Use weights='per-microbatch' (the default, whose copies' "
            "gradients return inside the backward), or overlap_grad_reduce=False")
    _reduce_replica_grads(model)


def _memory_options(config: Any) -> list[str]:
    """Megatron's options that save the experts' activation memory inside its experts' forward, which FEPLB's
    experts do not run: what each asks for, or []."""
    out = []
    if getattr(config, "recompute_granularity", None) == "selective" and \
            "moe_act" in (getattr(config, "recompute_modules", None) or ()):
        out.append("recompute their activation ('moe_act' in recompute_modules)")
    offload = getattr(config, "offload_modules", None) or ()
    if getattr(config, "fine_grained_activation_offloading", False):
        out += [f"offload {m!r} (offload_modules)" for m in ("expert_fc1", "moe_act") if m in offload]
    return out
