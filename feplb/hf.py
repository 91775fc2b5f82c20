"""FEPLB for Hugging Face transformers MoE models: one call turns a model's experts into balanced expert parallelism.

transformers (>= 5) gives every MoE model the same experts module, called by its sparse block as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` and holding
``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, ...;
or ``[E, H, 2F]`` and ``[E, F, H]`` where the module says ``is_transposed=True``, e.g. Aria).
:func:`apply` replaces each such module, in place, with a :class:`FEPLBExperts` that keeps only this rank's
``E / W`` experts under the same parameter names and layout, takes the model's own router output as its routing,
and balances every micro-batch like :class:`feplb.MoELayer` (it is one, with ``router="external"``).

What stays replicated (data parallel over the EP group): embeddings, attention, norms, routers (including
DeepSeek-V3's ``e_score_correction_bias``), shared experts and dense MLPs: every parameter not in
:func:`expert_parameters`. Their gradients cover this rank's tokens only: all-reduce them over the group (mean) as
in plain data parallelism (DDP around the model leaves the shards alone: :func:`apply` calls
``feplb.ignore_experts_in_ddp(model)``; around a part of it, call that on the part), or shard them
with FSDP (``fully_shard(..., ignored_params=set(expert_parameters(m)))``, which averages them). Expert shards are
never all-reduced: the dispatch's backward already sums every rank's gradient into the owner
(:func:`average_expert_grads` divides them by W, for the global mean's gradient).
Once per optimizer step, helpers' replica gradients must reach the owners and the owners' new weights the replicas:
:func:`reduce_replica_grads` before ``optimizer.step()`` (and before gradient clipping), :func:`refresh_replicas`
after it; or :func:`attach_optimizer` hooks both into ``optimizer.step()``. Gradient clipping: :func:`clip_grad_norm_`
reduces the replica gradients first and clips by the norm of the whole model's gradient (each expert shard counted
on its owner, FSDP's DTensor gradients by their whole tensors), where ``torch.nn.utils.clip_grad_norm_`` would see
this rank's shards only.

transformers' ``Trainer``: :class:`feplb.hf.Trainer` (or :class:`feplb.hf.TrainerMixin` over another Trainer
class) makes these calls where the Trainer needs them and checkpoints every rank's shards (``feplb/hf_trainer.py``).

Checkpoints: ``model.state_dict()`` holds the expert shards as DTensors over the EP group (``feplb.sharded``;
the optimizer's state of them likewise), for ``torch.distributed.checkpoint`` at any EP size;
:func:`full_state_dict` gathers them back into the original names and shapes, so
``model.save_pretrained(d, state_dict=full)`` writes a checkpoint that plain transformers loads (without a full
state dict, ``save_pretrained`` is refused before it writes anything: :func:`saves_full_only`). Load full
checkpoints before :func:`apply`, or after it with ``load_state_dict`` (each rank keeps its rows).
:func:`set_state_dict_type` ``"local"``: plain per-rank shards instead.

Legend: T tokens on this rank, K top-k, H hidden, F expert ffn, E experts, W EP ranks, L = E / W.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from feplb.control import _smaller_group_hint
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
    joined_for_forward,
    layer_config,
    load_policy_state_dict,
    mark_replaced,
    overrides_problem,
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

if TYPE_CHECKING:   # imported when asked for (__getattr__): transformers' Trainer imports accelerate
    from feplb.hf_trainer import Trainer, TrainerMixin

__all__ = ["FEPLBExperts", "FEPLBLlama4TextMoe", "apply", "supported", "expert_parameters", "experts_modules",
           "full_state_dict", "saves_full_only", "attach_optimizer", "average_expert_grads", "reduce_replica_grads",
           "zero_replica_grads", "refresh_replicas", "clip_grad_norm_", "set_state_dict_type", "track_optimizer",
           "generate_in_step", "Trainer", "TrainerMixin", "policy_state_dict", "load_policy_state_dict"]


def __getattr__(name: str) -> Any:
    # transformers' Trainer (and accelerate, which it needs) imported only when asked for
    if name in ("Trainer", "TrainerMixin"):
        from feplb import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'feplb.hf' has no attribute {name!r}")

# the experts' call: transformers' standard names, and gpt-oss's
_SIGNATURES = (("hidden_states", "top_k_index", "top_k_weights"),
               ("hidden_states", "router_indices", "routing_weights"))
def _w1_name(gated: bool) -> str:
    """The first projection's parameter name: gate_up_proj, or up_proj for non-gated experts."""
    return "gate_up_proj" if gated else "up_proj"


def _biases(w1name: str) -> tuple[str, str]:
    """The names of the biases FEPLB takes for experts whose first projection is ``w1name`` (gate_up_proj, or
    up_proj: non-gated): gpt-oss's, added to x @ w1 and to the down projection."""
    return f"{w1name}_bias", "down_proj_bias"
# the activations an experts module's act_fn (one input) may compute: FEPLBConfig.activation's but swiglu_oai
_ACT_FN_KINDS = ("silu", "gelu_tanh", "gelu")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# where transformers configs keep the number of experts per token (the first one set wins)
_TOP_K_FIELDS = ("num_experts_per_tok", "top_k", "moe_topk", "moe_k", "top_k_experts")


class FEPLBExperts(MoELayer):
    """An expert-parallel, balanced drop-in for a transformers experts module (made by :func:`apply`).

    Parameters: ``gate_up_proj`` [L, 2F, H] and ``down_proj`` [L, H, F], this rank's experts ``rank * L ...`` in
    the layout (and under the names) of the module it replaces; the layer computes with their transposed views.
    With ``transposed=True`` (a module with ``is_transposed=True``, e.g. Aria's: weights stored [in, out]) they are
    [L, H, 2F] and [L, F, H], the layer's own layout, used as they are. Non-gated experts (``config.gated`` False,
    Nemotron-H's) hold ``up_proj`` [L, F, H] instead of ``gate_up_proj``; experts with biases (gpt-oss's)
    ``gate_up_proj_bias`` (or ``up_proj_bias``) and ``down_proj_bias`` too. A norm after each expert
    (``post_expert_norm``, transformers' ``has_post_expert_norm``: Muse Spark's) stays the model's module, replicated
    (its parameters are not expert-parallel), applied to every expert output row on the token's GPU; one that is
    called with each row's expert id (``per_expert_norm``: Ergo's ``ErgoExpertNorm``, a learned RMSNorm scale per
    expert, [E, H]) likewise, given each row's global expert id there. With
    ``zero_experts`` Z (LongCat-Flash's zero-computation experts), ids E ... E + Z - 1 return the token itself
    weighed by its gate, computed on the token's GPU (masked routes for the layer); transformers' ``gate_up_proj``
    holds E + Z experts there, the last Z never read: each rank keeps Z / W of them after its own L, so that
    :func:`full_state_dict` gives back the original layout. The parameters keep the dtype of the module's; the
    experts compute in ``config.dtype``: where the two differ (:func:`apply`'s ``dtype=``), the weights are cast
    once per forward (derived again in the backward, their gradients cast back), and with ``cast_inputs`` (set by
    ``apply`` when ``dtype=`` is given) the input is cast to ``config.dtype`` and the output returns in the input's
    dtype; otherwise an input of another dtype is refused outside ``torch.autocast``.
    ``forward(hidden_states [T, H], top_k_index [T, K] int, top_k_weights [T, K] float) -> [T, H]`` returns
    ``sum_k w_k * down(act(gate(x)) * up(x))`` over each token's experts (act: SiLU or GeLU, ``config.activation``),
    like the module it replaces, with the
    gradient flowing into ``top_k_weights`` (the model's router). Collective over the EP group, like every
    ``MoELayer`` forward: every rank of the group must run every forward.
    """

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, name: str = "", transposed: bool = False,
                 gate_up_proj_bias: torch.Tensor | None = None, down_proj_bias: torch.Tensor | None = None,
                 post_expert_norm: nn.Module | None = None, zero_experts: int = 0,
                 per_expert_norm: bool = False, cast_inputs: bool = False) -> None:
        if config.router != "external":
            raise ValueError(f"FEPLBExperts needs FEPLBConfig.router='external', got {config.router!r}")
        if per_expert_norm and post_expert_norm is None:
            raise ValueError("FEPLBExperts: per_expert_norm needs a post_expert_norm module")
        if (gate_up_proj_bias is None) != (down_proj_bias is None) or \
                config.expert_bias != (gate_up_proj_bias is not None):
            raise ValueError("FEPLBExperts: give gate_up_proj_bias and down_proj_bias exactly when "
                             f"FEPLBConfig.expert_bias is set (it is {config.expert_bias})")
        # Read by _init_experts, which MoELayer.__init__ calls before this constructor could set attributes.
        object.__setattr__(self, "_hf_full", (gate_up_proj, down_proj, group, gate_up_proj_bias, down_proj_bias))
        # the first projection's name: gate_up_proj, or up_proj for non-gated experts
        object.__setattr__(self, "w1_name", _w1_name(config.gated))
        object.__setattr__(self, "is_transposed", bool(transposed))   # read by expert_weights()
        if zero_experts and (transposed or not config.masked_routes or zero_experts % dist.get_world_size(group)):
            raise ValueError("FEPLBExperts: zero_experts need weights stored [out, in], FEPLBConfig.masked_routes and "
                             "a number divisible by the EP group size")
        object.__setattr__(self, "zero_experts", int(zero_experts))   # read by _init_experts()
        # the weights cast for one forward (joined_for_forward), where the parameters' dtype is not config.dtype
        object.__setattr__(self, "_joined", None)
        super().__init__(config, group)
        object.__delattr__(self, "_hf_full")
        self.hf_name = name
        self.cast_inputs = bool(cast_inputs)
        if post_expert_norm is not None:
            self.post_expert_norm = post_expert_norm
        # Ergo's: a norm per expert, called with each row's expert id
        self.post_expert_ids = bool(per_expert_norm)

    def _init_experts(self, L: int, H: int, F: int, device: torch.device, dtype: torch.dtype) -> None:
        # each bias right after its weight (gpt-oss's order, so the state dict's keys keep theirs)
        gu, dn, _, gub, dnb = self._hf_full
        b1name, b2name = _biases(self.w1_name)
        for pname, full in ((self.w1_name, gu), (b1name, gub), ("down_proj", dn), (b2name, dnb)):
            if full is None:
                continue
            with torch.no_grad():
                # clone: the shard must not keep the full tensor's storage alive; the parameters keep their dtype
                shard = self.local_shard(pname, full).to(device=device).clone()
            setattr(self, pname, nn.Parameter(shard, requires_grad=full.requires_grad))

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        """(w1 [L, H, 2F], w2 [L, F, H]): ``gate_up_proj`` and ``down_proj`` themselves when transposed, else their
        strided transposed views; then (b1 [L, 2F], b2 [L, H]) = ``gate_up_proj_bias``, ``down_proj_bias`` where the
        experts have biases. Cast to ``config.dtype`` where the parameters have another: then made once per forward
        and shared by all its uses, made afresh outside a forward."""
        joined = self.__dict__.get("_joined")
        return joined if joined is not None else self._join()

    def _join(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`expert_weights` from ``params`` (``expert_params()``, in its order; by default the current
        ones)."""
        if params:
            get = dict(zip((n for n, _ in self.named_parameters(recurse=False)), params, strict=True)).__getitem__
        else:   # (the common call, several times a forward: no walk over the parameters)
            get = functools.partial(getattr, self)
        dt = self.config.dtype
        w1, w2 = (w if w.dtype == dt else w.to(dt) for w in (get(self.w1_name), get("down_proj")))
        if self.zero_experts:   # this rank's experts, not its share of the zero experts' unused rows
            w1 = w1[:self.num_local]
        ws = (w1, w2) if self.is_transposed else (w1.transpose(1, 2), w2.transpose(1, 2))
        if not self.config.expert_bias:
            return ws
        return (*ws, *(b if b.dtype == dt else b.to(dt) for b in map(get, _biases(self.w1_name))))

    def _casts_weights(self) -> bool:
        """Whether the experts compute in another dtype than their parameters'."""
        return any(p.dtype != self.config.dtype for p in self.expert_params())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,  # type: ignore[override]
                top_k_weights: torch.Tensor | None = None, *, router_indices: torch.Tensor | None = None,
                routing_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``top_k_index`` / ``top_k_weights``, or gpt-oss's names for them, ``router_indices`` /
        ``routing_weights``."""
        ids = top_k_index if router_indices is None else router_indices
        weights = top_k_weights if routing_weights is None else routing_weights
        if ids is None or weights is None or (top_k_index is not None and router_indices is not None) or \
                (top_k_weights is not None and routing_weights is not None):
            raise TypeError("FEPLBExperts.forward: give the routing once, as (top_k_index, top_k_weights) or "
                            "(router_indices, routing_weights)")
        x = hidden_states
        if self.cast_inputs and isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.to(self.config.dtype)
        if not self._casts_weights():
            return self._routed(x, ids, weights).to(hidden_states.dtype)
        with joined_for_forward(self, self.hf_name or type(self).__name__):
            y = checked_at_backward(self._routed(x, ids, weights))
        return y.to(hidden_states.dtype)

    def _routed(self, hidden_states: torch.Tensor, ids: Any, weights: Any) -> torch.Tensor:
        if not self.zero_experts or not isinstance(ids, torch.Tensor) or not isinstance(weights, torch.Tensor):
            return super().forward(hidden_states, routing=(ids, weights))
        # zero-computation experts: the token itself weighed by their gates, here; no route to the layer (ids out
        # of [0, E + Z) still reach it, which refuses them on every rank)
        E = self.config.num_experts
        zero = (ids >= E) & (ids < E + self.zero_experts)
        out = super().forward(hidden_states, routing=(torch.where(zero, -1, ids), weights))
        return out + self._zero_expert_out(hidden_states, zero, weights).to(out.dtype)

    @staticmethod
    def _zero_expert_out(hidden_states: torch.Tensor, zero: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """What the zero-computation experts add: each token weighed by the sum of its gates to them."""
        gate = weights.masked_fill(~zero, 0).sum(-1)
        return hidden_states * gate.reshape(*hidden_states.shape[:-1], 1)

    def local_shard(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        """With zero experts, the first projection's shard is this rank's L experts, then its share of the Z unused
        rows."""
        shard = super().local_shard(pname, full)
        if not self.zero_experts or pname != self.w1_name:
            return shard
        Zw, E = self.zero_experts // self.world_size, self.config.num_experts
        return torch.cat([shard, full[E + self.rank * Zw:E + (self.rank + 1) * Zw]])

    def expert_shard_dim(self, pname: str) -> int | None:
        """With zero experts the first projection's shard is two blocks (its experts, its unused rows): None."""
        return None if self.zero_experts and pname == self.w1_name else super().expert_shard_dim(pname)

    def full_entries(self, pname: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """With zero experts, each rank's first projection holds its L experts, then its Z / W unused rows: the
        original's E experts come first, then the Z rows, in rank order."""
        if not self.zero_experts or pname != self.w1_name:
            return super().full_entries(pname, parts)
        L = self.num_local
        return {pname: torch.cat([p[:L] for p in parts] + [p[L:] for p in parts])}

    def post_expert(self, y_MD: torch.Tensor, expert_M: torch.Tensor | None = None) -> torch.Tensor:
        norm = self._modules.get("post_expert_norm")
        if norm is None:
            return y_MD
        return norm(y_MD) if expert_M is None else norm(y_MD, expert_M)

    def extra_repr(self) -> str:
        return f"{self.hf_name!r}, " + super().extra_repr()


# ---------------------------------------------------------------------------------------------------- discovery

def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that hold 3-D ``gate_up_proj``, ``up_proj`` or ``down_proj`` parameters of their own: experts
    modules, supported or not (dense MLPs hold nn.Linear submodules, not such parameters), except shared experts
    stored that way (:func:`_shared_stack`). A module reachable under several names appears under each, so that
    every reference to it is replaced."""
    out = []
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, FEPLBExperts) or _shared_stack(name, mod):
            continue
        own = mod._parameters
        if any(isinstance(own.get(k), torch.Tensor) and own[k].dim() == 3
               for k in ("gate_up_proj", "up_proj", "down_proj")):
            out.append((name, mod))
    return out


def _zero_experts(module: nn.Module) -> int:
    """LongCat-Flash's zero-computation experts (``zero_expert_num``: ids E ... E + Z - 1 return the token itself,
    weighed by its gate), or 0."""
    z = getattr(module, "zero_expert_num", 0)
    return z if isinstance(z, int) and not isinstance(z, bool) and z > 0 else 0


def _shared_stack(name: str, mod: nn.Module) -> bool:
    """Whether ``mod`` is a model's shared experts (held as ``shared_experts`` / ``shared_expert``) stored as 3-D
    parameters, e.g. Inkling's ``InklingSharedExperts`` (every token through every one, ``forward(hidden_states,
    gammas)``): dense, not routed, so it stays replicated like any shared expert. Not when transformers' experts
    interface made it an experts class, or its forward takes the routing's expert ids."""
    if name.rpartition(".")[2] not in ("shared_experts", "shared_expert") or hasattr(mod, "_is_expert_parallel"):
        return False
    try:
        second = list(inspect.signature(mod.forward).parameters)[1:2]
    except (TypeError, ValueError):
        return False
    return not any(second == [sig[1]] for sig in _SIGNATURES)


def _config_of(module: nn.Module, model: nn.Module) -> Any:
    cfg = getattr(module, "config", None)
    if cfg is None:
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
    return cfg


def _config_field(cfg: Any, name: str) -> Any:
    """``cfg.name``, or None where the config lacks it or refuses a global value (a per-layer field that varies
    across layers, e.g. in Gemma 4's heterogeneous configs)."""
    try:
        return getattr(cfg, name, None)
    except Exception:
        return None


def _probe_values(limits: list[float]) -> torch.Tensor:
    """fp64 values a probe calls a gate or an activation on: every magnitude from 1e-3 to 1e6 of both signs (a clamp
    at any bound shows), random values around the limits (or in [-12, 12]), and the limits themselves."""
    gen = torch.Generator().manual_seed(0)
    mags = torch.logspace(-3, 6, 28, dtype=torch.float64)
    lim = torch.tensor(limits, dtype=torch.float64)
    return torch.cat([mags, -mags, (torch.rand(200, generator=gen, dtype=torch.float64) * 2 - 1)
                      * 4 * max(limits, default=3.0), lim, -lim])


def _act_kind(act: object, kinds: tuple[str, ...] = ("silu", "gelu_tanh", "gelu")) -> str | None:
    """The FEPLB activation among ``kinds`` (``FEPLBConfig.activation``'s: "silu", "gelu_tanh", "gelu"; "relu2" for
    non-gated experts) that the callable ``act`` computes, or None: decided by calling it on fp32 values
    (:func:`_probe_values`) and comparing element by element with torch's, so any module or function computing one
    of them (transformers' SiLUActivation, GELUTanh, NewGELUActivation, nn.GELU, ReLUSquaredActivation, ...) is
    recognised, and nothing else."""
    if act is None or not callable(act):
        return None
    from feplb.kernels.activation import mlp_act_ref

    x = _probe_values([]).float()[None, :]
    try:
        with torch.no_grad():
            got = act(x.clone())
    except Exception:   # an activation that cannot take fp32 CPU values is not one FEPLB stands in for
        return None
    for kind in kinds:
        want = mlp_act_ref(x, kind)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                torch.allclose(got.float(), want, rtol=1e-5, atol=1e-6, equal_nan=True):
            return kind
    return None


# Where experts modules keep their clamped SwiGLU's limit (DeepSeek-V4: limit; GLM-5, Hunyuan-V4: swiglu_limit) and
# gpt-oss-style gates their sigmoid slope (gpt-oss: alpha; MiniMax-M3: swiglu_alpha).
_LIMIT_ATTRS = ("limit", "swiglu_limit", "clamp_limit")
_ALPHA_ATTRS = ("alpha", "swiglu_alpha")


def _numbers(module: nn.Module, attrs: tuple[str, ...]) -> list[float]:
    """The positive finite numbers (Python, numpy or one-element tensors) under the module's attributes ``attrs``."""
    out = set()
    for a in attrs:
        v = getattr(module, a, None)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v)) and float(v) > 0:
            out.add(float(v))
    return sorted(out)


def _softcaps(module: nn.Module) -> list[float]:
    """The positive finite numbers the module keeps as softcaps: attributes named ``*softcap*`` of it and of its
    submodules (Inkling 2's act_fn: ``gate_softcap.softcap``, ``up_softcap.softcap``), and fields so named of its
    config (``mlp_gate_softcap``, ...)."""
    out = set()
    for holder in (*module.modules(), getattr(module, "config", None)):
        names = [n for n in getattr(holder, "__dict__", {}) if "softcap" in n]
        out.update(_numbers(holder, tuple(names)))
    return sorted(out)


def _gate(module: nn.Module, ffn: int) -> tuple[str | None, tuple | None]:
    """(why FEPLB cannot compute ``module``'s gate, or None; (activation, clamp limit or None, alpha, interleaved,
    softcaps or None), or None).

    A module with its own ``_apply_gate`` runs if that gate computes what FEPLB's kernels do: act(gate) * up with
    act one of ``FEPLBConfig.activation``'s (swiglu_oai's slope one of its alpha attributes, :data:`_ALPHA_ATTRS`),
    plain or clamped at one of its limit attributes (:data:`_LIMIT_ATTRS`), silu_postclamp with one of them (the
    clamp after the activation: Step 3.7's), or silu_softcap with two of its softcaps (:func:`_softcaps`), with gate
    and up side by side or interleaved (gpt-oss's). Checked by calling it on fp32 rows of the module's own width
    (2 * ``ffn``), in each layout: every probe value (:func:`_probe_values`) as a gate beside every other as an up,
    compared with FEPLB's own element by element. Without a custom gate: (None, None); the module's ``act_fn`` is
    checked by the caller."""
    if not _custom_gate(module):
        return None, None
    from feplb.kernels.activation import ACTS, glu_ref

    limits, alphas, caps = _numbers(module, _LIMIT_ATTRS), _numbers(module, _ALPHA_ATTRS), _softcaps(module)
    values = _probe_values(limits + caps)
    # every value as a gate beside every other as an up (rows of 2 * ffn columns; pairs spread over the columns)
    gate, up = torch.meshgrid(values, values, indexing="ij")
    pairs = torch.stack([gate.reshape(-1), up.reshape(-1)], dim=1)
    rows = -(-pairs.shape[0] // ffn)
    pairs = torch.cat([pairs, pairs[: rows * ffn - pairs.shape[0]]])
    gates, ups = pairs[:, 0].view(rows, ffn).float(), pairs[:, 1].view(rows, ffn).float()
    name = f"{type(module).__name__}._apply_gate"
    got = {}
    for interleaved in (False, True):
        probe = torch.stack([gates, ups], dim=2).reshape(rows, 2 * ffn) if interleaved else \
            torch.cat([gates, ups], dim=1)
        try:
            with torch.no_grad():   # a copy: a gate that changes its input in place must not change the reference
                got[interleaved] = (probe, module._apply_gate(probe.clone()))
        except Exception as e:  # a gate that cannot take fp32 [rows, 2F] CPU rows is not one FEPLB stands in for
            return (f"a custom gating function ({name}) that fails on fp32 [rows, {2 * ffn}] CPU rows "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"), None
    forms = [(act, limit, alpha, None) for act in ACTS for limit in (None, *limits)
             for alpha in (alphas if act == "swiglu_oai" else (1.0,))]
    forms += [("silu_softcap", None, 1.0, (cg, cu)) for cg in caps for cu in caps]
    forms += [("silu_postclamp", limit, 1.0, None) for limit in limits]
    for act, limit, alpha, softcap in forms:
        for interleaved, (probe, out) in got.items():
            want = glu_ref(probe, limit, act, alpha, interleaved, softcap)
            if isinstance(out, torch.Tensor) and out.shape == want.shape and \
                    torch.allclose(out.float(), want, rtol=1e-5, atol=1e-6, equal_nan=True):
                return None, (act, limit, alpha, interleaved, softcap)
    clamped = f", plain or clamped at limit {', '.join(f'{v:g}' for v in limits)} (or silu_postclamp's after the " \
        "activation)" if limits else ""
    slopes = f", swiglu_oai's alpha {', '.join(f'{v:g}' for v in alphas)}" if alphas else \
        " (swiglu_oai's alpha: no alpha / swiglu_alpha attribute)"
    capped = f", silu_softcap with softcaps {', '.join(f'{v:g}' for v in caps)}" if caps else ""
    return (f"a custom gating function ({name}) that computes none of FEPLB's act(gate) * up for act in "
            f"{ACTS}{clamped}{slopes}{capped}, gate and up side by side or interleaved"), None


def _custom_gate(module: nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    if gate is None:
        return False
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return True
    return gate is not _default_apply_gate


def _llama4_blocks(model: nn.Module) -> dict[int, tuple[nn.Module, list[str]] | str]:
    """{id(experts module): (its block, the block's names in ``model``)} for every Llama 4 MoE block inside
    ``model`` (not ``model`` itself: FEPLB replaces the block in its parent): transformers' own ``Llama4TextMoe``
    with its own router and experts classes (a subclass may compute otherwise). The value is the reason instead
    when one experts module sits in several blocks, whose routers and shared experts differ."""
    try:
        from transformers.models.llama4 import modeling_llama4 as l4
    except ImportError:
        return {}
    out: dict[int, tuple[nn.Module, list[str]] | str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if not name or type(m) is not l4.Llama4TextMoe or type(getattr(m, "experts", None)) is not \
                l4.Llama4TextExperts or type(getattr(m, "router", None)) is not l4.Llama4Router:
            continue
        prev = out.get(id(m.experts))
        if prev is None:
            out[id(m.experts)] = (m, [name])
        elif isinstance(prev, tuple) and prev[0] is m:
            prev[1].append(name)
        else:
            out[id(m.experts)] = "one Llama 4 experts module in several MoE blocks (with their own routers)"
    return out


class FEPLBLlama4TextMoe(nn.Module):
    """Llama 4's MoE block (``Llama4TextMoe``) with its experts balanced by FEPLB (made by :func:`apply`): the
    block's own ``router`` and ``shared_expert``, and an :class:`FEPLBExperts` that weighs each expert's input by the
    token's sigmoid gate, as Llama 4 does (``gate_on_input``): ``out = shared_expert(x) + sum_k expert_k(g_k * x)``
    over each token's top-k experts. Llama 4 computes every expert on every token, the unselected ones on zero
    inputs, which adds exactly zero; here only the selected ones run. Returns ``(out, router_logits)`` as the block
    does; its parameters keep their names (``experts.gate_up_proj`` [E/W, H, 2F], ``experts.down_proj``
    [E/W, F, H])."""

    def __init__(self, block: nn.Module, experts: FEPLBExperts) -> None:
        super().__init__()
        # the router's top-k is the one the block's forward selects with
        self.top_k, self.hidden_dim, self.num_experts = block.router.top_k, block.hidden_dim, block.num_experts
        self.experts = experts
        self.router = block.router
        self.shared_expert = block.shared_expert

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(x)   # sigmoid of the top-k logits, 0 elsewhere
        ids = torch.topk(logits, self.top_k, dim=1).indices   # the router's own selection, recomputed alike
        routed = self.experts(x, ids, scores.gather(1, ids))
        out = self.shared_expert(x)
        out.add_(routed)
        return out, logits


def _problem(module: nn.Module, model: nn.Module, world: int,
             llama4: tuple[nn.Module, list[str]] | str | None = None, name: str = "") -> tuple[str | None, dict]:
    """Why FEPLB cannot run ``module`` (reached as ``name``) exactly (None if it can), and the FEPLBConfig fields
    it gives. ``llama4``: the Llama 4 MoE block holding ``module`` and its names (:func:`_llama4_blocks`), which
    FEPLB replaces whole, or why it cannot."""
    if isinstance(llama4, str):
        return llama4, {}
    block = None if llama4 is None else llama4[0]
    if llama4 is not None and name.rpartition(".")[0] not in llama4[1]:
        return f"a Llama 4 experts module also reachable as {name!r}, outside its MoE block", {}
    if torch.nn.utils.parametrize.is_parametrized(module):   # (its weights then live under other names)
        return hooks_problem(module), {}
    own = dict(module.named_parameters())
    # gated experts hold gate_up_proj; non-gated ones (Nemotron-H's) up_proj
    w1name = "gate_up_proj" if "gate_up_proj" in own else "up_proj" if "up_proj" in own else None
    if w1name is None or "down_proj" not in own:
        return "no gate_up_proj or up_proj parameter beside down_proj", {}
    is_gated = w1name == "gate_up_proj"
    why = hooks_problem(module) or (hooks_problem(block) if block is not None else None)
    if why is not None:
        return why, {}
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if leaf == "base_layer" and parent is not module and getattr(parent, "base_layer", None) is module:
        # PEFT's LoRA on the expert weights (target_parameters): its ParamWrapper parametrizes them in its forward
        # with a delta for every expert, [E, ...], around a module that would hold this rank's shards only
        return (f"the base_layer of a {type(parent).__module__}.{type(parent).__name__} wrapper, whose forward may "
                "change the weights FEPLB shards (PEFT's LoRA on the expert weights, target_parameters: not "
                "supported; LoRA on other modules, attention say, is)"), {}
    biases = _biases(w1name)
    bias = sorted(n for n in own if "bias" in n)
    if bias and set(bias) != set(biases):
        return (f"bias terms {', '.join(bias)}; FEPLB's experts take biases as {' and '.join(biases)} (gpt-oss's "
                "names), both or neither"), {}
    if not bias and getattr(module, "has_bias", False):
        return f"has_bias=True without {' and '.join(biases)} parameters", {}
    # a norm after each expert (transformers' has_post_expert_norm): its own module, kept and run as it is
    post_norm = getattr(module, "has_post_expert_norm", False)
    norm = module._modules.get("post_expert_norm")
    if post_norm and not isinstance(norm, nn.Module):
        return "has_post_expert_norm=True without a post_expert_norm module", {}
    # a norm per expert (Ergo's): called with the rows and each row's expert id, its parameters [E, ...]; kept whole
    # (replicated, not expert-parallel) and run on the token's GPU. The call decides, whether or not the module
    # also sets has_post_expert_norm (Ergo's does not).
    per_expert = isinstance(norm, nn.Module) and _takes_expert_ids(norm)
    extra = sorted(set(own) - {w1name, "down_proj", *bias} -
                   ({f"post_expert_norm.{n}" for n, _ in norm.named_parameters()} if post_norm or per_expert
                    else set()))
    if "gate_proj" in extra and w1name == "up_proj":
        return ("a gate_proj parameter apart from up_proj (gated experts with the gate stored separately; FEPLB "
                "takes gated experts' weights joined, as gate_up_proj)"), {}
    if extra:
        return f"parameters besides {w1name} and down_proj (and their biases): {', '.join(extra)}", {}
    buffers = sorted(n for n, _ in module.named_buffers())
    if buffers:
        return f"buffers {', '.join(buffers)} (scaled or quantized experts are not supported)", {}
    if not getattr(module, "is_concatenated", True) and not _custom_gate(module):
        return ("interleaved gate/up layout (is_concatenated=False) with the default gate, which splits halves; "
                "expected a gate of the module's own that reads the interleaved columns"), {}
    # The call first: a module called otherwise (Llama 4's experts take router-scaled inputs) is refused for that.
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = tuple(p.name for p in params[:3])
    required_rest = [p.name for p in params[3:] if p.default is inspect.Parameter.empty
                     and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if block is None and (names not in _SIGNATURES or required_rest):
        return (f"forward({', '.join(p.name for p in params)}); expected forward(hidden_states, top_k_index, "
                "top_k_weights)"), {}
    gu, dn = own[w1name], own["down_proj"]
    # Llama 4's experts store [in, out] (gate_up_proj [E, H, 2F]) without saying so
    transposed = bool(getattr(module, "is_transposed", False)) or block is not None
    if gu.dim() != 3 or dn.dim() != 3:
        E = H = Fd = -1
    elif transposed:   # [in, out] per expert: gate_up_proj [E, H, 2F], down_proj [E, F, H]
        E, Fd, H = dn.shape
    else:
        E, H, Fd = dn.shape
    G, g = (2 * Fd, "2F") if is_gated else (Fd, "F")
    # LongCat's zero-computation experts: Z more ids that return the token itself, weighed by their gate;
    # gate_up_proj holds E + Z experts, the last Z never read
    Z = _zero_experts(module)
    want = ((E, H, G), (E, Fd, H)) if transposed else ((E + Z, G, H), (E, H, Fd))
    if E < 0 or (tuple(gu.shape), tuple(dn.shape)) != want:
        layout = (f"{w1name} [E, H, {g}] and down_proj [E, F, H] (is_transposed=True)" if transposed else
                  f"{w1name} [E, {g}, H] and down_proj [E, H, F]")
        return f"weight layout {w1name} {list(gu.shape)}, down_proj {list(dn.shape)}; expected {layout}", {}
    if per_expert:
        shapes = {n: list(p.shape) for n, p in norm.named_parameters()}
        if not shapes or any(len(sh) < 2 or sh[0] != E for sh in shapes.values()):
            return (f"a post_expert_norm called with expert ids whose parameters are {shapes}; expected each "
                    f"[{E}, ...] (two dimensions or more), one row per expert"), {}
    if bias:
        gb, db = own[biases[0]], own[biases[1]]
        if tuple(gb.shape) != (E, G) or tuple(db.shape) != (E, H) or gb.dtype != gu.dtype or db.dtype != gu.dtype:
            return (f"bias shapes {biases[0]} {list(gb.shape)} {gb.dtype}, {biases[1]} {list(db.shape)} {db.dtype}; "
                    f"expected [{E}, {G}] and [{E}, {H}] in the weights' dtype {gu.dtype}"), {}
    if is_gated:
        why, gated = _gate(module, Fd)
        if why is not None:
            return why, {}
    elif _custom_gate(module):
        return f"a gating function of its own ({type(module).__name__}._apply_gate) on non-gated experts", {}
    else:
        gated = None
    if gated is None:   # the module's act_fn: act_fn(gate) * up, or act_fn(up(x)) for non-gated experts
        from feplb.kernels.activation import PLAIN_ACTS

        kinds, what = (_ACT_FN_KINDS, "FEPLB computes gated experts: act(gate) * up") if is_gated else \
            (PLAIN_ACTS, "non-gated experts: act(up(x))")
        act_fn = getattr(module, "act_fn", None)
        kind = _act_kind(act_fn, kinds)
        if kind is None:
            return (f"activation {type(act_fn).__name__ if act_fn is not None else None} is none of FEPLB's "
                    f"{kinds} ({what})"), {}
        gated = (kind, None, 1.702, False, None)
    cfg = _config_of(module, model)
    if gu.dtype not in _DTYPES:
        return f"dtype {gu.dtype}; expected one of {_DTYPES}", {}
    if gu.device.type not in ("cpu", "cuda") or dn.device != gu.device:
        return f"weights on {gu.device} / {dn.device}; expected both on the CPU or on one CUDA device", {}
    top_k = block.router.top_k if block is not None else \
        next((v for v in (_config_field(cfg, k) for k in _TOP_K_FIELDS) if v is not None), None)
    if not isinstance(top_k, int) or not 1 <= top_k <= E + Z:
        return (f"top-k from the model config ({' / '.join(_TOP_K_FIELDS)}) is {top_k!r}; expected an int in "
                f"[1, {E + Z}]"), {}
    if E % world:
        return f"{E} experts are not divisible by the EP group size {world}", {}
    if Z:
        if Z % world:
            return (f"{Z} zero-computation experts (their unused gate_up_proj rows, sharded like the experts') are "
                    f"not divisible by the EP group size {world}"), {}
        if transposed or bias or block is not None or not is_gated:
            return "zero-computation experts with transposed weights, biases, a Llama 4 block or no gate", {}
    return None, {"hidden": int(H), "ffn": int(Fd), "num_experts": int(E), "top_k": top_k, "dtype": gu.dtype,
                  "device": gu.device.type, "activation": gated[0], "swiglu_limit": gated[1],
                  "swiglu_alpha": gated[2], "glu_interleaved": gated[3], "glu_softcap": gated[4],
                  "expert_bias": bool(bias), "gated": is_gated,
                  "gate_on_input": block is not None, "transposed": transposed,
                  # zero-computation experts: their ids leave the layer's routing as masked routes
                  "masked_routes": bool(Z), "zero_experts": Z, "per_expert_norm": per_expert}


def _takes_expert_ids(norm: nn.Module) -> bool:
    """Whether a post-expert norm's forward takes each row's expert id beside the rows (Ergo's ``ErgoExpertNorm``:
    ``forward(hidden_states, expert_ids)``, one learned scale per expert)."""
    try:
        params = list(inspect.signature(norm.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_kw = [p for p in params if p.kind == p.KEYWORD_ONLY and p.default is inspect.Parameter.empty]
    return len(positional) >= 2 and not required_kw and \
        all(p.default is inspect.Parameter.empty for p in positional[:2]) and \
        all(p.default is not inspect.Parameter.empty for p in positional[2:])


def _version_hint() -> str:
    try:
        import transformers
    except ImportError:
        return " (pip install 'feplb[hf]': transformers >= 5)"
    major = transformers.__version__.split(".")[0]
    if major.isdigit() and int(major) < 5:
        return (f" (transformers {transformers.__version__}: feplb.hf needs >= 5, where every MoE model has one "
                "experts module; pip install 'feplb[hf]')")
    return ""


def _module_config(module: nn.Module, model: nn.Module, world: int, blocks: dict, name: str,
                   overrides: dict[str, Any], dtype: torch.dtype | None = None
                   ) -> tuple[str | None, FEPLBConfig | None, dict]:
    """(why FEPLB cannot run ``module`` on ``world`` EP ranks, or None; its layer's FEPLBConfig, or None; what the
    layer takes beside its config: ``transposed``, whether its weights are stored [in, out], ``zero_experts``,
    LongCat's zero-computation experts, and ``per_expert_norm``, whether its post-expert norm takes expert ids):
    :func:`_problem`, then the config FEPLBConfig builds from it and ``overrides`` (``dtype``: the experts' compute
    dtype, by default their parameters'). What :func:`apply` and :func:`supported` both decide per module."""
    why, fields_of = _problem(module, model, world, blocks.get(id(module)), name)
    extras = {"transposed": fields_of.pop("transposed", False), "zero_experts": fields_of.pop("zero_experts", 0),
              "per_expert_norm": fields_of.pop("per_expert_norm", False)}
    if why is not None:
        return why, None, extras
    if dtype is not None:
        fields_of["dtype"] = dtype
    cfg = layer_config(fields_of, overrides)
    return (cfg, None, extras) if isinstance(cfg, str) else (None, cfg, extras)


def _dtype_problem(dtype: object) -> str | None:
    """Why ``dtype`` (:func:`apply`'s) cannot be the experts' compute dtype, or None."""
    if dtype is None or dtype in _DTYPES:
        return None
    return f"dtype={dtype!r}: expected None (the parameters' dtype) or one of {_DTYPES}"


def supported(model: nn.Module, ep_size: int = 1, *, dtype: torch.dtype | None = None,
              **config_overrides: Any) -> dict[str, str | None]:
    """What :func:`apply` would make of ``model`` on ``ep_size`` EP ranks, without a process group and without
    changing it: ``{qualified name: None}`` for every experts module FEPLB can run, ``{name: why not}`` for every
    one it cannot (the reason :func:`apply` gives). :func:`apply` replaces all of them or none: it raises unless
    every value is None. Empty when the model holds no experts module it recognises. ``dtype`` and
    ``config_overrides`` are checked as :func:`apply` checks them, ``gpus_per_node`` against ``ep_size`` included."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size: expected an int >= 1, got {ep_size!r}")
    if (why := _dtype_problem(dtype)) is not None:
        raise ValueError(f"feplb.hf.supported: {why}")
    problem = overrides_problem(config_overrides)
    if problem is not None:
        raise TypeError(f"feplb.hf.supported: {problem}")
    out: dict[str, str | None] = {}
    blocks = _llama4_blocks(model)
    runnable = []
    for name, mod in _candidates(model):
        why, cfg, _ = _module_config(mod, model, ep_size, blocks, name, config_overrides, dtype)
        if why is None and ep_size % cfg.gpus_per_node:
            why = (f"gpus_per_node={cfg.gpus_per_node} does not divide the EP group size {ep_size}"
                   + _smaller_group_hint(cfg.gpus_per_node, ep_size))
        out[name] = why
        if why is None:
            runnable.append((name, mod, cfg))
    out.update((name, why) for name, _, why in _tied(runnable))
    return out


def _expert_weights(mod: nn.Module, cfg: FEPLBConfig) -> list[torch.Tensor | None]:
    """The experts module's w1, w2, then its two biases (None where it has none)."""
    w1name = _w1_name(cfg.gated)
    return [getattr(mod, w1name), mod.down_proj] + \
        ([getattr(mod, b) for b in _biases(w1name)] if cfg.expert_bias else [None, None])


def _tied(named: list[tuple[str, nn.Module, FEPLBConfig]]) -> list[tuple[str, nn.Module, str]]:
    """(name, module, why) of every experts module whose weights another one holds too (one module under two
    names is one module): FEPLB would untie them (two layers, two shards, two gradients)."""
    owner_of: dict[int, int] = {}
    return [(n, m, "expert weights tied to another experts module's (FEPLB would untie them)")
            for n, m, cfg in named
            if any(owner_of.setdefault(id(w), id(m)) != id(m) for w in _expert_weights(m, cfg) if w is not None)]


# ---------------------------------------------------------------------------------------------------- apply

def apply(model: nn.Module, *, group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
          **config_overrides: Any) -> list[str]:
    """Replace every transformers experts module of ``model``, in place, with a balanced expert-parallel
    :class:`FEPLBExperts` holding this rank's ``E / W`` experts. Collective over the EP group ``group`` (default:
    the world); ``torch.distributed`` must be initialised and every rank must hold the same full weights.

    dtype: what the experts compute in, and their rows travel in (default: the parameters' dtype, as transformers
        computes them). The parameters keep their own dtype (fp32 ones then get fp32 gradients), and the experts'
        output returns in their input's dtype. With FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
        over the rest of the model (which leaves the experts out, and so feeds them bf16), pass that dtype: the
        experts then compute as FSDP's would have.
    config_overrides: :class:`feplb.FEPLBConfig` fields (policy, gpus_per_node, dyn, weights, plan_wait_ms, ...).
        hidden, ffn, num_experts, top_k and dtype come from the module and the model config; the router is the
        model's own. The device defaults to the experts' (``"cuda"`` or ``"cpu"``).

    Returns the qualified names of the replaced experts modules (with Llama 4, whose whole MoE blocks are replaced
    by :class:`FEPLBLlama4TextMoe`, the names of their experts inside them). Raises, on every rank together and
    before anything is replaced: ValueError naming each module FEPLB cannot run exactly (bias terms, an activation
    FEPLB does not compute, another weight layout or signature, E not divisible by W) and why, or when the ranks'
    models differ; TypeError for an unknown or derived override.
    """
    if not dist.is_initialized():
        raise RuntimeError("feplb.hf.apply needs torch.distributed initialised (init_process_group) first")
    check_overrides("feplb.hf.apply", group, config_overrides)
    world = dist.get_world_size(group)
    found = _candidates(model)
    # Every problem, a config FEPLBConfig refuses included, goes through the one agreement: all ranks raise together.
    problems, plans = [why] if (why := wrapper_problem(model)) else [], []
    if (why := _dtype_problem(dtype)) is not None:
        problems.append(f"  {why}")
        dtype = None
    configs: dict[int, FEPLBConfig] = {}
    extras: dict[int, dict] = {}
    blocks = _llama4_blocks(model)
    for name, mod in found:
        why, cfg, extras[id(mod)] = _module_config(mod, model, world, blocks, name, config_overrides, dtype)
        if why is None:
            configs[id(mod)] = cfg
            plans.append((name, mod))
        else:
            problems.append(f"  {name or type(model).__name__} ({type(mod).__name__}): {why}")
    # One agreement: every rank raises together, or none does. The weights' checksums catch ranks that built or
    # loaded different models (each rank slices its experts from its own copy).
    def weights_of(m: nn.Module) -> list[torch.Tensor]:   # w1, w2, then the biases where there are
        return _expert_weights(m, configs[id(m)])

    problems += [f"  {n} ({type(m).__name__}): {why}"
                 for n, m, why in _tied([(n, m, configs[id(m)]) for n, m in plans])]
    digests = [(n, *weights_digest(*(w for w in weights_of(m) if w is not None))) for n, m in plans]

    def none_found() -> str:
        done = " (feplb.hf.apply already replaced them)" if experts_modules(model) else _version_hint()
        return (f"found no experts module in {type(model).__name__}{done}; expected modules holding "
                "gate_up_proj [E, 2F, H] and down_proj [E, H, F] parameters (or [E, H, 2F] and [E, F, H] with "
                "is_transposed=True)")

    agree_to_replace("feplb.hf.apply", group, problems, [n for n, _ in found], digests, none_found)

    # Every layer is built (collective) before the first module is swapped: a layer that cannot be built leaves the
    # model as it was.
    made: dict[int, FEPLBExperts] = {}
    try:
        for name, mod in plans:
            if id(mod) not in made:
                w1, w2, b1, b2 = weights_of(mod)
                made[id(mod)] = new = FEPLBExperts(
                    configs[id(mod)], group, w1, w2, name=name, **extras[id(mod)], gate_up_proj_bias=b1,
                    down_proj_bias=b2,
                    post_expert_norm=mod.post_expert_norm if getattr(mod, "has_post_expert_norm", False) or
                    extras[id(mod)]["per_expert_norm"] else None, cast_inputs=dtype is not None)
                new.train(mod.training)
                new.refresh_replicas()
    except BaseException:
        # the model is left as it was: release what the layers built so far hold (threads, hooks, copy paths),
        # newest first
        for new in reversed(made.values()):
            new.close()
        raise
    # Llama 4: the whole block, whose forward scales the experts' inputs, becomes FEPLB's, under each of its names
    # (every name of its experts lies under one of them: checked in _problem)
    wrapped: dict[int, FEPLBLlama4TextMoe] = {}
    for name, mod in plans:
        mark_replaced(mod, "feplb.hf.apply", name, keep=made[id(mod)])
        entry = blocks.get(id(mod))
        if entry is None:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, made[id(mod)])
        elif id(entry[0]) not in wrapped:
            wrapped[id(entry[0])] = wrapper = FEPLBLlama4TextMoe(entry[0], made[id(mod)])
            wrapper.training = entry[0].training
            for block_name in entry[1]:
                outer, _, attr = block_name.rpartition(".")
                setattr(model.get_submodule(outer), attr, wrapper)
    # DDP around the model leaves the shards alone (it would broadcast rank 0's experts to every rank and average
    # the shards of different experts, silently); DDP around a part of the model needs ignore_experts_in_ddp(part)
    ignore_experts_in_ddp(model)
    if plans:
        saves_full_only(model)
    if world > 1 and plans:
        generate_in_step(model)
    return [name for name, _ in plans]


def _holds_shards(model: nn.Module | None, state_dict: dict) -> bool:
    """Whether ``state_dict`` holds some FEPLB layer's expert entry as this rank's shard (a plain tensor of the
    shard's shape: ``set_state_dict_type(model, "local")``) where the whole model's tensor goes."""
    if model is None:
        return False
    from feplb.dropin import _state_dict_name
    from feplb.sharded import expert_named_params

    for name, m in model.named_modules():
        if isinstance(m, MoELayer) and m.world_size > 1:
            prefix = _state_dict_name(name) + "." if name else ""
            for pname, _ in expert_named_params(m):
                whole, got = m.whole_shape(pname), state_dict.get(prefix + pname)
                if whole is not None and isinstance(got, torch.Tensor) and got.shape != whole:
                    return True
    return False


def saves_full_only(model: nn.Module) -> bool:
    """Make ``model.save_pretrained`` (and ``push_to_hub``, which calls it) refuse, before it writes anything, a
    call without a ``state_dict`` or with one holding the expert shards as DTensors: each rank holds its own
    experts, which transformers cannot write (it failed deep in safetensors on some ranks, or, called on rank 0
    only, waited for the other ranks until the process group's timeout, leaving a folder without weights), and
    gathering them is collective. The message says what to do: ``full = feplb.hf.full_state_dict(model)`` on every
    rank, then ``model.save_pretrained(d, state_dict=full)`` on rank 0. :func:`apply` does this to the model it is
    given and ``feplb.hf.Trainer`` to its model (whose ``save_model`` gathers them). Returns whether ``model`` has a
    ``save_pretrained``. Local."""
    from feplb.sharded import is_dtensor

    inner = getattr(model, "save_pretrained", None)
    if inner is None:
        return False
    if getattr(inner, "_feplb_full_only", False):
        return True
    cls, call = type(model).__name__, _weak_method(model, inner)
    model_ref = weakref.ref(model)
    try:
        signature = inspect.signature(inner)
    except (TypeError, ValueError):
        signature = None

    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        state_dict = kwargs.get("state_dict")
        if "state_dict" not in kwargs and signature is not None:   # (given by position: the third argument)
            try:
                state_dict = signature.bind(*args, **kwargs).arguments.get("state_dict")
            except TypeError:
                return call(*args, **kwargs)   # (its own error for wrong arguments)
        sharded = state_dict is not None and (any(is_dtensor(v) for v in state_dict.values())
                                              or _holds_shards(model_ref(), state_dict))
        if state_dict is None or sharded:
            raise ValueError(
                f"{cls}.save_pretrained with FEPLB experts: "
                + ("the state_dict holds expert shards (DTensors: this rank's experts only)" if sharded else
                   "without a state_dict it would write model.state_dict(), whose expert shards are DTensors (this "
                   "rank's experts only), which transformers cannot write")
                + "; gather every expert first, on every rank (collective): full = feplb.hf.full_state_dict(model), "
                  "then on rank 0: model.save_pretrained(d, state_dict=full). Nothing was written")
        return call(*args, **kwargs)

    model.save_pretrained = _like(save_pretrained, inner, _feplb_full_only=True)
    return True


def generate_in_step(model: nn.Module) -> bool:
    """Make ``model.generate`` keep the ranks in step, on the instance; returns whether ``model`` has a ``generate``
    (True also when it was kept in step before). :func:`apply` does this to the model it is given and
    ``feplb.hf.Trainer`` to its model; call it on an outer model whose ``generate`` you use when ``apply`` was given
    a part of it (its decoder, say). Local.

    Every forward of a FEPLB layer is collective, so a rank whose sequences end first must keep stepping with the
    others: transformers' ``generate(synced_gpus=True)`` does that (it turns it on by itself under DeepSpeed ZeRO-3
    and FSDP only; TRL's trainers call ``generate`` without it, transformers' ``Seq2SeqTrainer`` passes False).
    Here ``synced_gpus`` is always True, whatever the caller passes (keeping in step changes no output: a finished
    rank's extra forwards are discarded). Continuous batching (``generate_batch``, ``init_continuous_batching``,
    ``continuous_batching_context_manager``, ``cache_implementation="paged"``: each rank schedules its own forwards,
    and the ranks would run different numbers of them) is refused, on every rank together for ``generate`` (one
    small all-gather over the world per call agrees on it; transformers' own step check all-reduces over the world
    too)."""
    inner = getattr(model, "generate", None)
    if inner is None:
        return False
    cls = type(model).__name__
    if not getattr(inner, "_feplb_in_step", False):
        call = _weak_method(model, inner)

        def generate(*args: Any, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
            problem = _CONTINUOUS_BATCHING if kwargs.get("cache_implementation") == "paged" else None
            views = _agree(problem, None)
            bad = [r for r, v in enumerate(views) if v is not None]
            if bad:
                raise ValueError(f"{cls}.generate with FEPLB experts: {views[bad[0]]}"
                                 + ("" if len(bad) == len(views) else f" (on rank(s) {bad})"))
            return call(*args, synced_gpus=True, **kwargs)

        model.generate = _like(generate, inner, _feplb_in_step=True)
    for name in ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager"):
        fn = getattr(model, name, None)
        if fn is not None and not getattr(fn, "_feplb_in_step", False):
            def refuse(*args: Any, _name: str = name, **kwargs: Any) -> Any:
                raise ValueError(f"{cls}.{_name} with FEPLB experts: {_CONTINUOUS_BATCHING}")

            setattr(model, name, _like(refuse, fn, _feplb_in_step=True))
    return True


def _weak_method(model: nn.Module, method: Any) -> Any:
    """``method`` (``model``'s bound method, or another callable) as a callable that does not hold ``model``: a
    wrapper kept on the instance that held it made a reference cycle, which only the garbage collector frees (a
    model's memory kept after ``del model``)."""
    func = getattr(method, "__func__", None)
    if func is None or getattr(method, "__self__", None) is not model:
        return method
    me = weakref.ref(model)

    def call(*args: Any, **kwargs: Any) -> Any:
        return func(me(), *args, **kwargs)

    return call


def _like(wrapper: Any, wrapped: Any, **marks: Any) -> Any:
    """``wrapper`` with ``wrapped``'s name, docstring and signature (``functools.wraps``, with the signature kept in
    ``__signature__`` instead of the ``__wrapped__`` reference, which would hold the model through a bound method)
    and the attributes ``marks``."""
    import functools

    functools.update_wrapper(wrapper, wrapped, updated=())
    del wrapper.__wrapped__
    with contextlib.suppress(TypeError, ValueError):   # (a callable without one)
        wrapper.__signature__ = inspect.signature(wrapped)
    for key, value in marks.items():
        setattr(wrapper, key, value)
    return wrapper


_CONTINUOUS_BATCHING = ("continuous batching schedules each rank's forwards on its own, and every forward of the "
                        "FEPLB layers is collective; use generate() (it keeps the ranks in step)")
