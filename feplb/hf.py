"""FEPLB for Hugging Face transformers MoE models: one call turns a model's experts into balanced expert parallelism.

transformers (>= 5) gives every MoE model the same experts module, called by its sparse block as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` and holding
``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, ...).
:func:`apply` replaces each such module, in place, with a :class:`FEPLBExperts` that keeps only this rank's
``E / W`` experts under the same parameter names and layout, takes the model's own router output as its routing,
and balances every micro-batch like :class:`feplb.MoELayer` (it is one, with ``router="external"``).

What stays replicated (data parallel over the EP group): embeddings, attention, norms, routers (including
DeepSeek-V3's ``e_score_correction_bias``), shared experts and dense MLPs: every parameter not in
:func:`expert_parameters`. Their gradients cover this rank's tokens only: all-reduce them over the group (mean) as
in plain data parallelism (with DDP, call ``feplb.ignore_experts_in_ddp(model)`` before wrapping), or shard them
with FSDP (``fully_shard(..., ignored_params=set(expert_parameters(m)))``, which averages them). Expert shards are
never all-reduced: the dispatch's backward already sums every rank's gradient into the owner
(:func:`average_expert_grads` divides them by W, for the global mean's gradient).
Once per optimizer step, helpers' replica gradients must reach the owners and the owners' new weights the replicas:
:func:`reduce_replica_grads` before ``optimizer.step()`` (and before gradient clipping), :func:`refresh_replicas`
after it; or :func:`attach_optimizer` hooks both into ``optimizer.step()``. Gradient clipping: :func:`clip_grad_norm_`
reduces the replica gradients first and clips by the norm of the whole model's gradient (each expert shard counted
on its owner, FSDP's DTensor gradients by their whole tensors), where ``torch.nn.utils.clip_grad_norm_`` would see
this rank's shards only.

Checkpoints: ``model.state_dict()`` is this rank's shard (same keys, ``E / W`` experts); :func:`full_state_dict`
gathers the shards back into the original names and shapes, so ``model.save_pretrained(d, state_dict=full)``
writes a checkpoint that plain transformers loads. Load full checkpoints before :func:`apply`.

Legend: T tokens on this rank, K top-k, H hidden, F expert ffn, E experts, W EP ranks, L = E / W.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from feplb.layer import FEPLBConfig, MoELayer

__all__ = ["FEPLBExperts", "apply", "expert_parameters", "experts_modules", "full_state_dict",
           "attach_optimizer", "average_expert_grads", "reduce_replica_grads", "refresh_replicas", "clip_grad_norm_"]

# FEPLBConfig fields that apply() reads off the module and the model config; overriding them is an error.
_DERIVED = ("hidden", "ffn", "num_experts", "top_k", "router", "router_bias", "dtype")
_SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")
_SWIGLU_ACTS = ("silu", "swish")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class FEPLBExperts(MoELayer):
    """An expert-parallel, balanced drop-in for a transformers experts module (made by :func:`apply`).

    Parameters: ``gate_up_proj`` [L, 2F, H] and ``down_proj`` [L, H, F], this rank's experts ``rank * L ...`` in
    the layout (and under the names) of the module it replaces; the layer computes with their transposed views.
    ``forward(hidden_states [T, H], top_k_index [T, K] int, top_k_weights [T, K] float) -> [T, H]`` returns
    ``sum_k w_k * down(silu(gate(x)) * up(x))`` over each token's experts, like the module it replaces, with the
    gradient flowing into ``top_k_weights`` (the model's router). Collective over the EP group, like every
    ``MoELayer`` forward: every rank of the group must run every forward.
    """

    def __init__(self, config: FEPLBConfig, group: dist.ProcessGroup | None, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, name: str = "") -> None:
        if config.router != "external":
            raise ValueError(f"FEPLBExperts needs FEPLBConfig.router='external', got {config.router!r}")
        # Read by _init_experts, which MoELayer.__init__ calls before this constructor could set attributes.
        object.__setattr__(self, "_hf_full", (gate_up_proj, down_proj, group))
        super().__init__(config, group)
        object.__delattr__(self, "_hf_full")
        self.hf_name = name

    def _init_experts(self, L: int, H: int, F: int, device: torch.device, dtype: torch.dtype) -> None:
        gate_up_E2FH, down_EHF, group = self._hf_full
        lo = dist.get_rank(group) * L
        with torch.no_grad():
            # clone: the shard must not keep the full tensor's storage alive
            gu = gate_up_E2FH[lo:lo + L].to(device=device, dtype=dtype).clone()
            dn = down_EHF[lo:lo + L].to(device=device, dtype=dtype).clone()
        self.gate_up_proj = nn.Parameter(gu, requires_grad=gate_up_E2FH.requires_grad)
        self.down_proj = nn.Parameter(dn, requires_grad=down_EHF.requires_grad)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [L, H, 2F], w2 [L, F, H]): strided views of ``gate_up_proj`` and ``down_proj``."""
        return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # type: ignore[override]
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states, routing=(top_k_index, top_k_weights))

    def extra_repr(self) -> str:
        return f"{self.hf_name!r}, " + super().extra_repr()


# ---------------------------------------------------------------------------------------------------- discovery

def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that hold 3-D ``gate_up_proj``, ``up_proj`` or ``down_proj`` parameters of their own: experts
    modules, supported or not (dense MLPs hold nn.Linear submodules, not such parameters). A module reachable
    under several names appears under each, so that every reference to it is replaced."""
    out = []
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, FEPLBExperts):
            continue
        own = mod._parameters
        if any(isinstance(own.get(k), torch.Tensor) and own[k].dim() == 3
               for k in ("gate_up_proj", "up_proj", "down_proj")):
            out.append((name, mod))
    return out


def _config_of(module: nn.Module, model: nn.Module) -> Any:
    cfg = getattr(module, "config", None)
    if cfg is None:
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
    return cfg


def _is_silu(act: object) -> bool:
    if isinstance(act, nn.SiLU) or act is torch.nn.functional.silu:
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return isinstance(act, SiLUActivation)


def _custom_gate(module: nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    if gate is None:
        return False
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return True
    return gate is not _default_apply_gate


def _problem(module: nn.Module, model: nn.Module, world: int) -> tuple[str | None, dict]:
    """Why FEPLB cannot run ``module`` exactly (None if it can), and the FEPLBConfig fields it gives."""
    own = dict(module.named_parameters())
    if "gate_up_proj" not in own:
        return "no gate_up_proj parameter (non-gated experts; FEPLB computes SwiGLU experts)", {}
    bias = sorted(n for n in own if "bias" in n)
    if bias or getattr(module, "has_bias", False):
        return f"bias terms ({', '.join(bias) or 'has_bias=True'}); FEPLB's experts have none", {}
    extra = sorted(set(own) - {"gate_up_proj", "down_proj"})
    if extra:
        return f"parameters besides gate_up_proj and down_proj: {', '.join(extra)}", {}
    buffers = sorted(n for n, _ in module.named_buffers())
    if buffers:
        return f"buffers {', '.join(buffers)} (scaled or quantized experts are not supported)", {}
    if getattr(module, "is_transposed", False):
        return "transposed weight layout (is_transposed=True); expected gate_up_proj [E, 2F, H]", {}
    if not getattr(module, "is_concatenated", True):
        return "interleaved gate/up layout (is_concatenated=False); expected [gate | up] halves", {}
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm=True)", {}
    if _custom_gate(module):
        return f"a custom gating function ({type(module).__name__}._apply_gate); FEPLB computes silu(gate) * up", {}
    gu, dn = own["gate_up_proj"], own["down_proj"]
    if gu.dim() != 3 or dn.dim() != 3 or dn.shape[0] != gu.shape[0] \
            or tuple(gu.shape) != (dn.shape[0], 2 * dn.shape[2], dn.shape[1]):
        return (f"weight layout gate_up_proj {list(gu.shape)}, down_proj {list(dn.shape)}; expected "
                "gate_up_proj [E, 2F, H] and down_proj [E, H, F]"), {}
    E, H, Fd = dn.shape
    act = getattr(module, "act_fn", None)
    if not _is_silu(act):
        return (f"activation {type(act).__name__ if act is not None else None} is not SiLU "
                "(FEPLB computes SwiGLU experts: silu(gate) * up)"), {}
    cfg = _config_of(module, model)
    hidden_act = getattr(cfg, "hidden_act", None)
    if hidden_act is not None and hidden_act not in _SWIGLU_ACTS:
        return f"the model config declares hidden_act={hidden_act!r}, not one of {_SWIGLU_ACTS}", {}
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = tuple(p.name for p in params[:3])
    required_rest = [p.name for p in params[3:] if p.default is inspect.Parameter.empty
                     and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if names != _SIGNATURE or required_rest:
        return (f"forward({', '.join(p.name for p in params)}); expected forward(hidden_states, top_k_index, "
                "top_k_weights)"), {}
    if gu.dtype not in _DTYPES:
        return f"dtype {gu.dtype}; expected one of {_DTYPES}", {}
    if gu.device.type not in ("cpu", "cuda") or dn.device != gu.device:
        return f"weights on {gu.device} / {dn.device}; expected both on the CPU or on one CUDA device", {}
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if top_k is None:
        top_k = getattr(cfg, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        return f"top-k from the model config (num_experts_per_tok) is {top_k!r}; expected an int in [1, {E}]", {}
    if E % world:
        return f"{E} experts are not divisible by the EP group size {world}", {}
    return None, {"hidden": int(H), "ffn": int(Fd), "num_experts": int(E), "top_k": top_k, "dtype": gu.dtype,
                  "device": gu.device.type}


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


def _agree(local: object, group: dist.ProcessGroup | None) -> list:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)
    return out


# ---------------------------------------------------------------------------------------------------- apply

def apply(model: nn.Module, *, group: dist.ProcessGroup | None = None, **config_overrides: Any) -> list[str]:
    """Replace every transformers experts module of ``model``, in place, with a balanced expert-parallel
    :class:`FEPLBExperts` holding this rank's ``E / W`` experts. Collective over the EP group ``group`` (default:
    the world); ``torch.distributed`` must be initialised and every rank must hold the same full weights.

    config_overrides: :class:`feplb.FEPLBConfig` fields (policy, gpus_per_node, dyn, weights, plan_wait_ms, ...).
        hidden, ffn, num_experts, top_k and dtype come from the module and the model config; the router is the
        model's own. The device defaults to the experts' (``"cuda"`` or ``"cpu"``).

    Returns the qualified names of the replaced modules. Raises, on every rank together and before anything is
    replaced: ValueError naming each module FEPLB cannot run exactly (bias terms, an activation other than SiLU
    gating, another weight layout or signature, E not divisible by W) and why, or when the ranks' models differ;
    TypeError for an unknown or derived override.
    """
    if not dist.is_initialized():
        raise RuntimeError("feplb.hf.apply needs torch.distributed initialised (init_process_group) first")
    fields = {f.name for f in dataclasses.fields(FEPLBConfig)}
    unknown = sorted(set(config_overrides) - fields)
    if unknown:
        raise TypeError(f"feplb.hf.apply: unknown FEPLBConfig field(s) {unknown}; expected some of {sorted(fields)}")
    derived = sorted(set(config_overrides) & set(_DERIVED))
    if derived:
        raise TypeError(f"feplb.hf.apply: {derived} come from the model (module shapes, config, router); "
                        "do not pass them")
    world = dist.get_world_size(group)
    found = _candidates(model)
    problems, plans = [], []
    for name, mod in found:
        why, fields_of = _problem(mod, model, world)
        if why is not None:
            problems.append(f"  {name or type(model).__name__} ({type(mod).__name__}): {why}")
        else:
            plans.append((name, mod, fields_of))
    # One agreement: every rank raises together, or none does. The weights' checksums catch ranks that built or
    # loaded different models (each rank slices its experts from its own copy).
    with torch.no_grad():
        sums = [(n, float(m.gate_up_proj.double().sum()).hex(), float(m.down_proj.double().sum()).hex())
                for n, m, _ in plans]
    mine = (tuple(problems), tuple(n for n, _ in found), tuple(sums))
    views = _agree(mine, group)
    bad = [r for r, v in enumerate(views) if v[0]]
    if bad:
        msg = "\n".join(views[bad[0]][0])
        raise ValueError(f"feplb.hf.apply: cannot run these experts modules exactly (nothing was replaced):\n{msg}"
                         + ("" if len(bad) == len(views) else f"\n(on EP rank(s) {bad})"))
    if not found:
        done = " (feplb.hf.apply already replaced them)" if experts_modules(model) else _version_hint()
        raise ValueError(f"feplb.hf.apply: found no experts module in {type(model).__name__}{done}; expected "
                         "modules holding gate_up_proj [E, 2F, H] and down_proj [E, H, F] parameters")
    if any(v[1:] != views[0][1:] for v in views):
        differ = [r for r, v in enumerate(views) if v[1:] != views[0][1:]]
        raise ValueError(f"feplb.hf.apply: EP rank(s) {differ} hold other experts modules or other expert weights "
                         "than rank 0; build the same model on every rank (same seed, or load the same checkpoint, "
                         "or broadcast) before apply")

    # Every config is checked, then every layer built (collective), before the first module is swapped: a bad
    # override or a layer that cannot be built leaves the model as it was.
    configs: dict[int, FEPLBConfig] = {}
    for _, mod, fields_of in plans:
        if id(mod) not in configs:
            configs[id(mod)] = FEPLBConfig(**{**fields_of, **config_overrides, "router": "external"})
    made: dict[int, FEPLBExperts] = {}
    for name, mod, _ in plans:
        if id(mod) not in made:
            new = FEPLBExperts(configs[id(mod)], group, mod.gate_up_proj, mod.down_proj, name=name)
            new.train(mod.training)
            new.refresh_replicas()
            made[id(mod)] = new
    for name, mod, _ in plans:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, made[id(mod)])
    return [name for name, _, _ in plans]


# ---------------------------------------------------------------------------------------------------- helpers

def experts_modules(model: nn.Module) -> list[FEPLBExperts]:
    """The model's FEPLB experts modules, in module order (each once)."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, FEPLBExperts) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters (every ``gate_up_proj`` and ``down_proj`` shard): never all-reduce these. Every
    other parameter of the model is replicated and its gradient is all-reduced over the group by the user."""
    return [p for m in experts_modules(model) for p in (m.gate_up_proj, m.down_proj)]


def reduce_replica_grads(model: nn.Module) -> None:
    """``reduce_replica_grads()`` of every FEPLB experts module (collective): once per optimizer step, after the
    last backward and before gradient clipping and ``optimizer.step()``."""
    for m in experts_modules(model):
        m.reduce_replica_grads()


def average_expert_grads(model: nn.Module, data_parallel_group: dist.ProcessGroup | None = None) -> None:
    """Make the expert shards' gradients the mean over the ranks' losses instead of the sum the dispatch leaves
    (collective): ``MoELayer.average_expert_grads`` of every FEPLB experts module (replica gradients reduced,
    then divided by the EP group's size; with ``data_parallel_group``, EP x DP, first summed over it and divided
    by both sizes). Call it once per optimizer step, after the last backward and before clipping and
    ``optimizer.step()``, when the replicated parameters' gradients are averaged (FSDP's ``fully_shard`` and DDP
    do that) over the same ranks, so that the whole model follows the mean of the ranks' losses."""
    for m in experts_modules(model):
        m.average_expert_grads(data_parallel_group)


def attach_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``attach_optimizer(optimizer)`` of every FEPLB experts module: each ``optimizer.step()`` then reduces the
    replica gradients before it and refreshes the replicas after it (collective at every step). Clip with
    :func:`clip_grad_norm_` (it reduces first); with a ``GradScaler``, call :func:`reduce_replica_grads` yourself
    before ``unscale_``: the hook runs inside ``step()``, after them."""
    for m in experts_modules(model):
        m.attach_optimizer(optimizer)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose experts FEPLB shards (collective over the EP group):
    the helpers' replica gradients are reduced into the owners first (:func:`reduce_replica_grads`; a later
    reduction, such as :func:`attach_optimizer`'s, then adds nothing), and the norm is the whole model's: every
    replicated parameter's gradient counted once (call this after the data-parallel reduction of those, so that
    they are equal on every rank), every expert shard's once, on its owner. Every rank then scales every gradient
    by the same factor. Returns the total norm (a 0-d tensor, equal on every rank). With a ``GradScaler``, call
    :func:`reduce_replica_grads` before ``scaler.unscale_(optimizer)``: unscaling divides the gradients the
    optimizer holds, not the replicas' still to be reduced."""
    moes = experts_modules(model)
    if not moes:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
    groups = {id(m.group) for m in moes}
    if len(groups) != 1:
        raise ValueError("clip_grad_norm_: the model's FEPLB experts modules use different process groups; clip "
                         "each group's parameters yourself")
    reduce_replica_grads(model)
    group = moes[0].group
    experts = expert_parameters(model)
    expert_ids = {id(p) for p in experts}
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    # FSDP (fully_shard) makes the replicated parameters DTensors: their norms are the whole tensors' (DTensor
    # reduces over its mesh), computed apart from plain tensors (torch's foreach ops refuse a mix)
    dtensors = [g for p, g in zip(params, grads, strict=True) if id(p) not in expert_ids and _is_dtensor(g)]
    replicated = [g for p, g in zip(params, grads, strict=True) if id(p) not in expert_ids and not _is_dtensor(g)]
    sharded = [g for p, g in zip(params, grads, strict=True) if id(p) in expert_ids]
    device = grads[0].device if grads else experts[0].device
    norm_type = float(norm_type)

    def local(gs):
        if not gs:
            return torch.zeros((), dtype=torch.float32, device=device)
        norm = torch.nn.utils.get_total_norm(gs, norm_type)
        if _is_dtensor(norm):
            norm = norm.full_tensor()
        return norm.to(device=device, dtype=torch.float32)

    shard_norm = local(sharded)
    if norm_type == float("inf"):
        # a MAX reduction may drop a NaN (gloo does): a non-finite flag travels beside the norm
        both = torch.stack([shard_norm, (~torch.isfinite(shard_norm)).to(shard_norm.dtype)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        shard_norm = torch.where(both[1] > 0, torch.full_like(both[0], float("nan")), both[0])
        total = torch.maximum(torch.maximum(local(replicated), local(dtensors)), shard_norm)
    else:
        shard_pow = shard_norm.pow(norm_type)
        dist.all_reduce(shard_pow, group=group)
        total = (local(replicated).pow(norm_type) + local(dtensors).pow(norm_type) + shard_pow).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite "
                           "(error_if_nonfinite=True)")
    # torch.nn.utils.clip_grads_with_norm_'s factor, applied to plain tensors (a DTensor's local part scales it)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        local_grads = [g.to_local() if _is_dtensor(g) else g for g in grads]
        for dev_grads in _by_device(local_grads).values():
            torch._foreach_mul_(dev_grads, coef.to(dev_grads[0].device))
    return total


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _by_device(ts: list[torch.Tensor]) -> dict:
    out: dict = {}
    for t in ts:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def refresh_replicas(model: nn.Module) -> None:
    """``refresh_replicas()`` of every FEPLB experts module (collective): after every ``optimizer.step()`` and
    after any other change of the expert weights (loading a shard, say)."""
    for m in experts_modules(model):
        m.refresh_replicas()


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every FEPLB experts module's shards gathered back into the original names and
    shapes (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]), ready for ``save_pretrained(d, state_dict=...)``
    or ``load_state_dict`` of an unmodified model. Collective over each module's EP group.

    rank0_only: the full dict on rank 0 of the EP group and an empty dict elsewhere (True), or on every rank.
    Tensors are detached, on the parameters' devices; the non-expert entries share storage with the model, except
    those FSDP (``fully_shard``) holds as DTensors, which are gathered into plain tensors (collective over their
    meshes; every rank gathers them, also with rank0_only).
    """
    owners: dict[str, FEPLBExperts] = {}
    for name, m in model.named_modules():
        if isinstance(m, FEPLBExperts):
            owners[name] = m
    keep = not rank0_only or dist.get_rank(next(iter(owners.values())).group if owners else None) == 0
    sd = {}
    for k, v in model.state_dict().items():
        if _is_dtensor(v):
            v = v.full_tensor()   # collective: every rank gathers, one tensor at a time
            if not keep:
                continue          # and only the ranks that return it hold it
        sd[k] = v
    full: dict[str, torch.Tensor] = {}
    for prefix, m in owners.items():
        group = m.group
        W, r = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        for pname in ("gate_up_proj", "down_proj"):
            shard = getattr(m, pname).detach().contiguous()
            if rank0_only:
                parts = [torch.empty_like(shard) for _ in range(W)] if r == 0 else None
                dist.gather(shard, parts, dst=dst, group=group)
            else:
                parts = [torch.empty_like(shard) for _ in range(W)]
                dist.all_gather(parts, shard, group=group)
            if parts is not None:
                full[f"{prefix}.{pname}"] = torch.cat(parts)
    if not keep:
        return {}
    out = {}
    for k, v in sd.items():
        prefix, _, leaf = k.rpartition(".")
        if prefix in owners:
            if leaf in ("gate_up_proj", "down_proj"):
                out[k] = full[k]
            continue   # the layer's own state (buffers of the runtime) is no part of the model's checkpoint
        out[k] = v
    return out
