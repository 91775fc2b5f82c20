"""FEPLB for torchtitan MoE models: one call turns a model's routed experts into balanced expert parallelism.

torchtitan (>= 0.3) builds every MoE model (Qwen3-MoE, DeepSeek-V3, Llama 4, ...) from one ``MoE`` module: a
``router`` (``TokenChoiceTopKRouter``), optional ``shared_experts``, and ``routed_experts`` (``RoutedExperts``),
which holds a token dispatcher and ``inner_experts`` (``GroupedExperts``: ``w1_EFD`` [E, F, D], ``w2_EDF``
[E, D, F], ``w3_EFD`` [E, F, D], computed ``(silu(x w1^T) * (x w3^T)) w2^T`` in bfloat16; GPT-OSS's
``GptOssGroupedExperts``: ``mlp1_weight_EGD`` [E, 2F, D] with gate and up rows interleaved, ``mlp1_bias_EG``,
``mlp2_weight_EDF`` [E, D, F], ``mlp2_bias_ED``, and its clamped gate ``gate * sigmoid(1.702 gate) * (up + 1)``).
:func:`apply` replaces each MoE's ``routed_experts``, in place, with a :class:`FEPLBRoutedExperts` (GPT-OSS's: a
:class:`FEPLBGptOssRoutedExperts`) that keeps only this rank's ``E / W`` experts under the same names
(``routed_experts.inner_experts.w1_EFD``, ...) and layout, takes the router's output as its routing, and balances
every micro-batch like :class:`feplb.MoELayer` (it is one, with ``router="external"``).
The router, its load-balancing bias (``expert_bias_E``) and token counts (``tokens_per_expert_E``), and the shared
experts stay torchtitan's: ``MoE.forward`` runs unchanged around the replaced module.

Precision: like ``GroupedExperts``, the experts compute in bfloat16 whatever their parameters' dtype (``dtype=``
chooses another); the rows travel, and the routed outputs combine, in that dtype too. The parameters keep their
dtype (fp32 master weights stay fp32); each forward casts them once, as ``GroupedExperts`` does, and the
gradients return in the parameters' dtype.

Apply it to a model built with real weights (not on the meta device) and before torchtitan parallelizes it, with
torchtitan's own expert parallelism off: FEPLB is the expert parallelism, over ``group``. Everything that is not an
expert shard stays replicated over the group, and data parallelism over it is yours: DDP with
``feplb.ignore_experts_in_ddp(model)``, or FSDP with ``fully_shard(..., ignored_params=set(expert_parameters(m)))``;
torchtitan's ``parallelize`` functions do not know these shards and must not shard them. Per optimizer step, as
with every FEPLB layer: :func:`reduce_replica_grads` before ``optimizer.step()`` (and clipping),
:func:`refresh_replicas` after it, or :func:`attach_optimizer`; :func:`clip_grad_norm_` clips by the whole
model's norm. Checkpoints: the model's ``state_dict()`` holds the expert shards as DTensors over the EP group
(``feplb.sharded``; the optimizer's state of them likewise), so torchtitan's ``CheckpointManager``
(``torch.distributed.checkpoint``) saves and loads them, at any EP size; :func:`full_state_dict` gives the original
names and shapes.
Activation checkpointing of whole blocks (non-reentrant ``torch.utils.checkpoint``, what torchtitan's ``full`` and
per-layer modes wrap blocks in) replays each forward exactly, and so does torch's selective activation
checkpointing (torchtitan's op-level ``SelectiveAC``): the recompute dispatches the forward's ops, in its order.

With torchtitan's own expert parallelism on (its dispatcher, DeepEP or HybridEP, FSDP over the shards), use
``feplb.titan_ep`` instead: FEPLB behind torchtitan's dispatch, turned on by torchtitan's override mechanism.

Legend: T tokens on this rank, K top-k, D model dim, F expert ffn dim, E experts, W EP ranks, L = E / W.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from feplb.dropin import (
    PolicyStates,
    agree_to_replace,
    attach_optimizer,
    average_expert_grads,
    check_overrides,
    clip_grad_norm_,
    expert_parameters,
    experts_modules,
    full_state_dict,
    hooks_problem,
    is_dtensor,
    joined_for_forward,
    layer_config,
    load_policy_state_dict,
    mark_replaced,
    policy_state_dict,
    reduce_replica_grads,
    refresh_replicas,
    set_state_dict_type,
    track_optimizer,
    weights_digest,
    wrapper_problem,
    zero_replica_grads,
)
from feplb.experts import checked_at_backward
from feplb.layer import FEPLBConfig, MoELayer, ignore_experts_in_ddp
from feplb.recompute import outside_selective_checkpoint

__all__ = ["FEPLBGptOssRoutedExperts", "FEPLBRoutedExperts", "apply", "expert_parameters", "experts_modules",
           "full_state_dict", "attach_optimizer", "average_expert_grads", "reduce_replica_grads", "zero_replica_grads",
           "refresh_replicas", "clip_grad_norm_", "set_state_dict_type", "track_optimizer", "policy_state_dict",
           "load_policy_state_dict", "PolicyStates"]

_NAMES = ("w1_EFD", "w2_EDF", "w3_EFD")

try:   # torchtitan's module protocol: its init_states() initialises the parameters of such modules only
    from torchtitan.protocols.module import Module as _TitanModule
except ImportError:   # (torchtitan absent or of another layout: the shards are a plain module)
    _TitanModule = nn.Module


class _ExpertShards(_TitanModule):
    """``inner_experts`` of a :class:`FEPLBRoutedExperts`: this rank's expert shards. torchtitan's
    ``init_states()`` (its trainer's meta-device build: ``to_empty``, then ``init_states``) initialises them as
    the unmodified model's experts module: each weight drawn whole, [E, ...], by that module's own initializer
    (``param_init``), and this rank's experts ``lo ... lo + L`` kept, so the random draws, the shards' values and
    everything initialised after them equal the unmodified model's."""

    def __init__(self, num_experts: int, lo: int, param_init: dict | None):
        nn.Module.__init__(self)
        self.num_experts = num_experts
        if param_init is not None:
            self._param_init = {name: _whole_then_shard(fn, num_experts, lo) for name, fn in param_init.items()}


def _whole_then_shard(init, num_experts: int, lo: int):
    @torch.no_grad()
    def shard_init(param: torch.Tensor) -> None:
        whole = torch.empty((num_experts, *param.shape[1:]), dtype=param.dtype, device=param.device)
        init(whole)
        param.copy_(whole[lo:lo + param.shape[0]])
    return shard_init
_OSS_NAMES = ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")
# the sigmoid slope of torchtitan's GPT-OSS swiglu (its default: GptOssGroupedExperts passes none)
_OSS_ALPHA = 1.702
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _GateUp(torch.autograd.Function):
    """(w1 [L, F, D], w3 [L, F, D]) -> [L, 2F, D] in ``dtype``: w1's rows, then w3's, written in one pass that also
    casts (``GroupedExperts`` casts each weight to bfloat16 every forward: the same traffic). The gradient returns
    split, in each weight's dtype. Saves nothing, so one result serves every use in a forward."""

    @staticmethod
    def forward(w1: torch.Tensor, w3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        L, F, D = w1.shape
        with outside_selective_checkpoint():   # (written in place: a policy saving every op would refuse that)
            out = torch.empty((L, 2 * F, D), dtype=dtype, device=w1.device)
            out[:, :F].copy_(w1)
            out[:, F:].copy_(w3)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        w1, w3, _ = inputs
        ctx.F, ctx.dtypes = w1.shape[1], (w1.dtype, w3.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        F = ctx.F
        return g[:, :F].to(ctx.dtypes[0]), g[:, F:].to(ctx.dtypes[1]), None


class FEPLBRoutedExperts(MoELayer, _TitanModule):
    """An expert-parallel, balanced drop-in for a torchtitan ``RoutedExperts`` (made by :func:`apply`).

    Parameters: ``inner_experts.w1_EFD`` [L, F, D], ``inner_experts.w2_EDF`` [L, D, F] and ``inner_experts.w3_EFD``
    [L, F, D], this rank's experts ``rank * L ...`` in the layout, dtype and names of the module it replaces
    (``inner_experts.num_experts`` is the model's E, as torchtitan's ``MoE`` reads it).
    ``forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E) -> [B, L, D]`` in x's
    dtype: ``sum_k score_k * w2(silu(w1 x) * w3 x)`` over each token's experts, with the gradient flowing into the
    scores (the router). The counts argument is torchtitan's and not needed: the layer counts what it dispatches.
    Collective over the EP group, like every ``MoELayer`` forward: every rank of the group must run every forward.
    """

    _no_forward_dispatched = ("torchtitan's experts join their weights per call in forward(), which takes torchtitan's "
                              "routing (forward_dispatched serves feplb.MoELayer and feplb.hf's experts)")

    _names = _NAMES   # the experts module's parameters, in its order

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None, *weights: torch.Tensor,
                 name: str = "", param_init: dict | None = None) -> None:
        if config.router != "external":
            raise ValueError(f"FEPLBRoutedExperts needs FEPLBConfig.router='external', got {config.router!r}")
        if len(weights) != len(self._names):
            raise TypeError(f"{type(self).__name__}: expected the full weights {', '.join(self._names)}, got "
                            f"{len(weights)} tensors")
        # Read by _init_experts, which MoELayer.__init__ calls before this constructor could set attributes.
        object.__setattr__(self, "_titan_full", (*weights, group))
        object.__setattr__(self, "_titan_init", param_init)
        super().__init__(config, group)
        object.__delattr__(self, "_titan_full")
        object.__delattr__(self, "_titan_init")
        self.titan_name = name
        self._joined: tuple[torch.Tensor, torch.Tensor] | None = None

    def _init_experts(self, L: int, H: int, F: int, device: torch.device, dtype: torch.dtype) -> None:
        full = self._titan_full
        lo = dist.get_rank(full[-1]) * L
        inner = _ExpertShards(self.config.num_experts, lo, self._titan_init)
        for pname, w in zip(self._names, full[:-1], strict=True):
            with torch.no_grad():
                # clone: the shard must not keep the full tensor's storage alive; the parameters keep their dtype
                shard = w[lo:lo + L].to(device=device).clone()
            setattr(inner, pname, nn.Parameter(shard, requires_grad=w.requires_grad))
        self.inner_experts = inner

    def expert_params(self) -> tuple[nn.Parameter, ...]:
        return tuple(getattr(self.inner_experts, n) for n in self._names)

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """torchtitan's initialisation (its trainer's ``to_empty``, then ``init_states``), in the replaced module's
        place in the model's order: this rank's expert shards drawn as the unmodified model draws its experts
        (``_ExpertShards``), then the per-step copies refreshed from them (collective over the EP group, as
        torchtitan calls it on every rank)."""
        self.inner_experts.init_states(buffer_device=buffer_device)
        self.refresh_replicas()

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's ``parallelize``: refused with its tensor or expert parallelism on (every rank parallelizes
        alike, so every rank raises). FEPLB is the expert parallelism and takes each rank's own tokens; under TP
        torchtitan gives the MoE the same tokens on every TP rank and sums the routed outputs over them."""
        on = [f"{name}={getattr(parallel_dims, name, '?')}" for name in ("tp", "ep")
              if getattr(parallel_dims, f"{name}_enabled", False)]
        if on:
            raise ValueError(
                f"{self.titan_name or type(self).__name__}: torchtitan's parallelism {', '.join(on)} is on around "
                "routed experts made by feplb.titan.apply, which are the model's expert parallelism over their EP "
                "group and take local tensors: parallelize with tp=1 and ep=1 (with torchtitan's expert parallelism "
                "on, use feplb.titan_ep instead)")
        super().parallelize(parallel_dims)

    def _join(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The experts' weights (``expert_weights``) from ``params`` (``expert_params()``, by default the current
        ones)."""
        w1, w2, w3 = params or self.expert_params()
        return swiglu_weights(w1, w2, w3, self.config.dtype)

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        """(w1 [L, D, 2F], w2 [L, F, D]) in the layer's dtype: [w1 | w3] joined and cast, and w2 cast, as strided
        views (GPT-OSS's: mlp1 and mlp2 cast, and their biases); made once per forward and shared by all its uses,
        made afresh outside a forward."""
        return self._joined if self._joined is not None else self._join()

    @torch.compiler.disable(reason="FEPLB's forward plans on the host and runs its own collectives and threads: "
                                   "it cannot be traced; compile torchtitan's blocks without fullgraph, or not at all")
    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,  # type: ignore[override]
                topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor | None = None) -> torch.Tensor:
        del num_local_tokens_per_expert_E
        if any(is_dtensor(t) for t in (x_BLD, topk_scores_BLK, topk_expert_ids_BLK)):
            raise TypeError(
                f"{self.titan_name or type(self).__name__}: got DTensor inputs (a sharding plan redistributes the "
                "MoE's tokens, such as torchtitan's tensor or context parallelism); routed experts made by "
                "feplb.titan.apply are the expert parallelism themselves and take each rank's own tokens as local "
                "tensors")
        with joined_for_forward(self, self.titan_name or type(self).__name__):
            y = checked_at_backward(super().forward(x_BLD.to(self.config.dtype),
                                                    routing=(topk_expert_ids_BLK, topk_scores_BLK)))
        return y.to(x_BLD.dtype)

    def extra_repr(self) -> str:
        return f"{self.titan_name!r}, " + super().extra_repr()


class FEPLBGptOssRoutedExperts(FEPLBRoutedExperts):
    """:class:`FEPLBRoutedExperts` for torchtitan's GPT-OSS experts (``GptOssGroupedExperts``): parameters
    ``inner_experts.mlp1_weight_EGD`` [L, 2F, D] (gate and up rows interleaved), ``inner_experts.mlp1_bias_EG``
    [L, 2F], ``inner_experts.mlp2_weight_EDF`` [L, D, F] and ``inner_experts.mlp2_bias_ED`` [L, D], in the layout,
    dtype and names of the module it replaces; computes ``sum_k score_k * (w2(g(w1 x + b1)) + b2)`` with g GPT-OSS's
    clamped gate (``FEPLBConfig(activation="swiglu_oai", glu_interleaved=True, expert_bias=True)``), the weights and
    biases cast to the layer's dtype as torchtitan casts them (bfloat16 by default)."""

    _names = _OSS_NAMES

    def _join(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return oss_weights(*(params or self.expert_params()), self.config.dtype)


def swiglu_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """torchtitan's GroupedExperts weights (w1 [L, F, D], w2 [L, D, F], w3 [L, F, D]) as a MoELayer's experts:
    (w1 [L, D, 2F]: [w1 | w3] joined and cast, w2 [L, F, D] cast), strided views."""
    return _GateUp.apply(w1, w3, dt).transpose(1, 2), w2.to(dt).transpose(1, 2)


def oss_weights(g1: torch.Tensor, b1: torch.Tensor, g2: torch.Tensor, b2: torch.Tensor, dt: torch.dtype
                ) -> tuple[torch.Tensor, ...]:
    """torchtitan's GPT-OSS experts (mlp1 [L, 2F, D], its bias [L, 2F], mlp2 [L, D, F], its bias [L, D]) as a
    MoELayer's experts with biases, cast to ``dt`` as torchtitan casts them."""
    return g1.to(dt).transpose(1, 2), g2.to(dt).transpose(1, 2), b1.to(dt), b2.to(dt)


def oss_fields(limit: object) -> dict[str, Any] | str:
    """The FEPLBConfig fields of GPT-OSS's experts clamped at ``limit`` (None or inf: no clamp), or why ``limit``
    is none."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or
                              not 0 < limit <= float("inf")):
        return f"swiglu_limit {limit!r}; expected a number > 0 (inf: no clamp)"
    return {"activation": "swiglu_oai", "swiglu_alpha": _OSS_ALPHA,
            "swiglu_limit": None if limit is None or limit == float("inf") else float(limit),
            "glu_interleaved": True, "expert_bias": True}


# ---------------------------------------------------------------------------------------------------- discovery

def _torchtitan():
    try:
        from torchtitan.models.common import moe, token_dispatcher
    except ImportError as e:
        raise ImportError("feplb.titan needs torchtitan >= 0.3 (pip install 'feplb[titan]'), where every MoE model "
                          f"has one MoE module ({e})") from e
    return moe, token_dispatcher


def _oss_experts() -> type | None:
    """torchtitan's GPT-OSS experts class, or None where this torchtitan has none."""
    try:
        from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
    except ImportError:
        return None
    return GptOssGroupedExperts


def _is_oss(inner: nn.Module) -> bool:
    oss = _oss_experts()
    return oss is not None and type(inner) is oss


def _class_of(inner: nn.Module) -> type[FEPLBRoutedExperts]:
    """The FEPLB class replacing the experts module ``inner`` (its ``_names`` are ``inner``'s parameters)."""
    return FEPLBGptOssRoutedExperts if _is_oss(inner) else FEPLBRoutedExperts


def _problem(moe: nn.Module, tt, td, world: int, dtype: torch.dtype) -> tuple[str | None, dict]:
    """Why FEPLB cannot run ``moe``'s routed experts exactly (None if it can), and the FEPLBConfig fields they give."""
    routed = moe.routed_experts
    if type(routed) is not tt.RoutedExperts:
        return f"routed experts {type(routed).__name__}, not torchtitan's RoutedExperts", {}
    inner = routed.inner_experts
    for mod in (routed, inner):
        why = hooks_problem(mod)
        if why is not None:
            return why, {}
    dispatcher = routed.token_dispatcher
    if type(dispatcher) not in (td.LocalTokenDispatcher, td.AllToAllTokenDispatcher):
        return (f"token dispatcher {type(dispatcher).__name__}: FEPLB replaces the dispatch with its own exchange, "
                "which may not do what this one does (low-precision dispatch, say); build the model with "
                "comm_backend='standard'"), {}
    oss = _is_oss(inner)
    if not (oss or type(inner) is tt.GroupedExperts) or "_grouped_mm" in vars(inner):
        return (f"experts {type(inner).__name__} are not torchtitan's plain GroupedExperts or GPT-OSS's "
                "GptOssGroupedExperts (FEPLB computes their experts with its own grouped GEMM; low-precision "
                "converters and other activations are not supported)"), {}
    names = _class_of(inner)._names
    own = dict(inner.named_parameters())
    if sorted(own) != sorted(names):
        return f"parameters {sorted(own)}; expected {list(names)}", {}
    buffers = sorted(n for n, _ in inner.named_buffers())
    if buffers:
        return f"buffers {', '.join(buffers)} (scaled or quantized experts are not supported)", {}
    ws = [own[n] for n in names]
    if any(is_dtensor(w) for w in ws) or getattr(routed.token_dispatcher, "ep_mesh", None) is not None:
        return ("already parallelized by torchtitan (DTensor weights or an EP mesh); apply feplb.titan before "
                "parallelizing, with torchtitan's expert parallelism off: FEPLB is the expert parallelism (with "
                "torchtitan's EP on, feplb.titan_ep balances behind its dispatch)"), {}
    if any(w.is_meta for w in ws):
        return "weights on the meta device; initialise (init_states) or load them before apply", {}
    gated: dict = {}
    if oss:
        g1, b1, g2, b2 = ws
        E, G, D = g1.shape if g1.dim() == 3 else (-1, -1, -1)
        Fd = G // 2
        if E < 0 or G % 2 or tuple(b1.shape) != (E, G) or tuple(g2.shape) != (E, D, Fd) or \
                tuple(b2.shape) != (E, D):
            return (f"weight layout mlp1_weight_EGD {list(g1.shape)}, mlp1_bias_EG {list(b1.shape)}, "
                    f"mlp2_weight_EDF {list(g2.shape)}, mlp2_bias_ED {list(b2.shape)}; expected [E, 2F, D], [E, 2F], "
                    "[E, D, F], [E, D]"), {}
        gated = oss_fields(getattr(inner, "swiglu_limit", None))
        if isinstance(gated, str):
            return gated, {}
    else:
        w1, w2, w3 = ws
        if w1.dim() != 3 or w1.shape != w3.shape or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
            return (f"weight layout w1_EFD {list(w1.shape)}, w2_EDF {list(w2.shape)}, w3_EFD {list(w3.shape)}; "
                    "expected [E, F, D], [E, D, F], [E, F, D]"), {}
        E, Fd, D = w1.shape
    w1 = ws[0]
    if inner.num_experts != E or getattr(moe.router, "num_experts", E) != E:
        return (f"{E} experts in the weights, num_experts {inner.num_experts} (experts) and "
                f"{getattr(moe.router, 'num_experts', None)} (router)"), {}
    if len({w.dtype for w in ws}) != 1 or w1.dtype not in _PARAM_DTYPES:
        return f"weight dtypes {[w.dtype for w in ws]}; expected one of {_PARAM_DTYPES}", {}
    if w1.device.type not in ("cpu", "cuda") or len({w.device for w in ws}) != 1:
        return f"weights on {[str(w.device) for w in ws]}; expected one CPU or CUDA device", {}
    top_k = getattr(moe.router, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        return f"the router's top_k is {top_k!r}; expected an int in [1, {E}]", {}
    if getattr(routed.token_dispatcher, "top_k", top_k) != top_k:
        return (f"the router's top_k ({top_k}) differs from the token dispatcher's "
                f"({routed.token_dispatcher.top_k})"), {}
    if E % world:
        return f"{E} experts are not divisible by the EP group size {world}", {}
    return None, {"hidden": int(D), "ffn": int(Fd), "num_experts": int(E), "top_k": top_k, "dtype": dtype,
                  "device": w1.device.type, **gated}


# ---------------------------------------------------------------------------------------------------- apply

def apply(model: nn.Module, *, group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.bfloat16,
          **config_overrides: Any) -> list[str]:
    """Replace the ``routed_experts`` of every torchtitan ``MoE`` of ``model``, in place, with a balanced
    expert-parallel :class:`FEPLBRoutedExperts` holding this rank's ``E / W`` experts. Collective over the EP group
    ``group`` (default: the world); ``torch.distributed`` must be initialised and every rank must hold the same full
    weights.

    dtype: what the experts compute in, and the rows travel and combine in (bfloat16 by default, as torchtitan's
        ``GroupedExperts`` computes; float32 for an exact reference). The parameters keep their own dtype.
    config_overrides: :class:`feplb.FEPLBConfig` fields (policy, gpus_per_node, dyn, weights, plan_wait_ms, ...).
        hidden, ffn, num_experts and top_k come from the module and its router; the router is the model's own.
        The device defaults to the experts'.

    Returns the qualified names of the replaced modules. Raises, on every rank together and before anything is
    replaced: ValueError naming each MoE whose experts FEPLB cannot run exactly (another experts class, a
    low-precision converter, hooks, weights already parallelized or on the meta device, E not divisible by W, a
    config FEPLBConfig refuses, an unsupported ``dtype``) and why, or when the ranks' models differ; TypeError for
    an unknown or derived override; ImportError without torchtitan.
    """
    if not dist.is_initialized():
        raise RuntimeError("feplb.titan.apply needs torch.distributed initialised (init_process_group) first")
    check_overrides("feplb.titan.apply", group, config_overrides)
    tt, td = _torchtitan()
    world = dist.get_world_size(group)
    found = [(name, m) for name, m in model.named_modules(remove_duplicate=False)
             if isinstance(m, tt.MoE) and not isinstance(m.routed_experts, FEPLBRoutedExperts)]
    # Every problem, the arguments' included, goes through the one agreement: all ranks raise together.
    problems, plans = [why] if (why := wrapper_problem(model)) else [], []
    if dtype not in _DTYPES:
        problems.append(f"  dtype={dtype}: expected one of {_DTYPES}")
    # One FEPLB layer per GroupedExperts: MoEs (or RoutedExperts) sharing experts keep sharing them.
    configs: dict[int, FEPLBConfig] = {}
    owner_of: dict[int, int] = {}   # expert parameter -> its GroupedExperts
    for name, moe in found:
        why, fields_of = _problem(moe, tt, td, world, dtype)
        inner = moe.routed_experts.inner_experts
        if why is None and any(owner_of.setdefault(id(getattr(inner, p)), id(inner)) != id(inner)
                               for p in _class_of(inner)._names):
            why = "expert weights shared with another experts module (FEPLB would untie them)"
        if why is None:
            cfg = layer_config(fields_of, config_overrides)
            if isinstance(cfg, str):
                why = cfg
            elif id(inner) in configs and configs[id(inner)] != cfg:
                # one FEPLB layer serves every MoE sharing these experts: it can take only one routing shape
                changed = sorted(f.name for f in dataclasses.fields(cfg)
                                 if getattr(cfg, f.name) != getattr(configs[id(inner)], f.name))
                why = (f"experts shared with another MoE that routes them otherwise ({', '.join(changed)} differ); "
                       "FEPLB runs one layer per experts module")
            else:
                configs[id(inner)] = cfg
        if why is not None:
            problems.append(f"  {name or type(model).__name__} ({type(moe).__name__}): {why}")
        else:
            plans.append((name, moe, id(inner)))
    digests = [(n, *weights_digest(*(getattr(m.routed_experts.inner_experts, p)
                                     for p in _class_of(m.routed_experts.inner_experts)._names)))
               for n, m, _ in plans]

    def none_found() -> str:
        done = " (feplb.titan.apply already replaced their experts)" if experts_modules(model) else ""
        return f"found no torchtitan MoE module in {type(model).__name__}{done}"

    agree_to_replace("feplb.titan.apply", group, problems, [n for n, _ in found], digests, none_found)

    # Every layer is built (collective) before the first module is swapped: a layer that cannot be built leaves the
    # model as it was.
    made: dict[int, FEPLBRoutedExperts] = {}
    try:
        for name, moe, key in plans:
            if key not in made:
                inner = moe.routed_experts.inner_experts
                cls = _class_of(inner)
                made[key] = new = cls(configs[key], group, *(getattr(inner, p) for p in cls._names),
                                      name=f"{name}.routed_experts" if name else "routed_experts",
                                      param_init=getattr(inner, "_param_init", None))
                new.train(moe.routed_experts.training)
                new.refresh_replicas()
    except BaseException:
        # the model is left as it was: release what the layers built so far hold (threads, copy paths), newest
        # first
        for new in reversed(made.values()):
            new.close()
        raise
    for name, moe, key in plans:
        mark_replaced(moe.routed_experts.inner_experts, "feplb.titan.apply",
                      f"{name}.routed_experts" if name else "routed_experts", keep=made[key])
        moe.routed_experts = made[key]
    # DDP around the model leaves the shards alone (it would broadcast rank 0's experts to every rank and average
    # the shards of different experts, silently); DDP around a part of the model needs ignore_experts_in_ddp(part)
    ignore_experts_in_ddp(model)
    return [f"{name}.routed_experts" if name else "routed_experts" for name, _, _ in plans]
