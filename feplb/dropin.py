"""What every framework drop-in shares (``feplb.hf``, ``feplb.titan``, ``feplb.megatron``): a model whose MoE
layers FEPLB replaced holds, in each such layer (a :class:`feplb.MoELayer`), this rank's ``E / W`` experts under the
names and layout of the module it replaced; everything else is replicated. These helpers act on every ``MoELayer``
of a model: the per-step upkeep of the helpers' weight copies, gradient averaging and clipping over sharded experts,
and the full checkpoint gathered from the shards. The adapters re-export them; they also work on a model built from
``feplb.MoELayer`` directly.

The replacement itself (``apply``) is collective and all or nothing: every rank checks its modules, the ranks
agree (:func:`agree_to_replace`), and only then is anything built and swapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from feplb.experts import rebuilt_in_backward
from feplb.layer import FEPLBConfig, MoELayer
from feplb.sharded import expert_named_params, is_dtensor, local_state_dicts, track_optimizer
from feplb.steps import ENTRY_AVERAGE, ENTRY_CLIP, ENTRY_REDUCE, ENTRY_REFRESH
from feplb.training import (
    GRAD_BUFFERS_REFUSAL,
    average_args,
    averages_prepared,
    compare_over_replicas,
    handshaken,
    holds_grad_buffers,
    prepare_and_compare,
)

__all__ = ["experts_modules", "expert_parameters", "reduce_replica_grads", "zero_replica_grads", "average_expert_grads",
           "attach_optimizer", "clip_grad_norm_", "refresh_replicas", "full_state_dict", "set_state_dict_type",
           "track_optimizer", "policy_state_dict", "load_policy_state_dict", "PolicyStates"]


# ---------------------------------------------------------------------------------------------------- apply

# FEPLBConfig fields an adapter's apply() reads off the module, its config and router (or takes as its own
# argument); overriding them is an error.
DERIVED = ("hidden", "ffn", "num_experts", "top_k", "router", "router_bias", "dtype", "swiglu_limit",
           "activation", "swiglu_alpha", "glu_softcap", "glu_interleaved", "expert_bias", "gated", "gate_on_input",
           "masked_routes")


def overrides_problem(overrides: dict[str, Any]) -> str | None:
    """Why FEPLBConfig overrides cannot be taken (fields that do not exist, or that the adapter derives from the
    model: :data:`DERIVED`), or None."""
    fields = {f.name for f in dataclasses.fields(FEPLBConfig)}
    unknown = sorted(set(overrides) - fields)
    bad = sorted(set(overrides) & set(DERIVED))
    return (f"unknown FEPLBConfig field(s) {unknown}; expected some of {sorted(fields)}" if unknown else
            f"{bad} come from the model (module shapes, config, router); do not pass them" if bad else None)


def check_overrides(api: str, group: dist.ProcessGroup | None, overrides: dict[str, Any]) -> None:
    """TypeError, on every rank together (collective), when some rank passed overrides :func:`overrides_problem`
    refuses; ValueError, on this rank (outside the group's collectives), when it is not a member of ``group``."""
    if group is not None and dist.is_initialized():
        members = dist.get_process_group_ranks(group)
        if dist.get_rank() not in members:
            raise ValueError(f"{api}: global rank {dist.get_rank()} is not a member of group= (global ranks "
                             f"{members}); pass each rank its own EP group, the one holding it")
    views = _agree(overrides_problem(overrides), group)
    ranks = [r for r, v in enumerate(views) if v is not None]
    if ranks:
        raise TypeError(f"{api}: {views[ranks[0]]}" + ("" if len(ranks) == len(views) else f" (on EP rank(s) {ranks})"))


def wrapper_problem(model: nn.Module) -> str | None:
    """Why a drop-in's ``apply`` cannot take ``model`` as it is wrapped, or None: DDP keeps the parameters it was
    built with (the replaced experts among them; its second step then fails on their missing gradients) and would
    broadcast and average the new shards of different experts."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return ("  (the model): wrapped in DistributedDataParallel, which keeps the experts it was built with; apply "
                "to the model first, then wrap it (apply leaves the new shards out of DDP)")
    return None


def layer_config(fields: dict[str, Any], overrides: dict[str, Any]) -> FEPLBConfig | str:
    """The FEPLBConfig of a module's FEPLB layer (external router), or why FEPLBConfig refuses it: a problem line
    for :func:`agree_to_replace`, so a rank whose config is bad does not raise alone."""
    try:
        return FEPLBConfig(**{**fields, **overrides, "router": "external"})
    except (TypeError, ValueError) as e:
        return f"FEPLBConfig: {e}"


# hooks of a module that FEPLB would silently drop with it
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def hooks_problem(module: nn.Module, kinds: tuple[str, ...] = _HOOKS) -> str | None:
    """Why replacing ``module`` would drop something it runs (its own hooks, an instance-level forward such as
    accelerate's offloading wrapper), or None. ``kinds``: the hook dictionaries that would be lost (a module FEPLB
    keeps but whose forward it does not run keeps its state-dict hooks, say)."""
    if any(is_dtensor(p) for p in module.parameters()):   # (FSDP2 adds state-dict hooks too: this says why)
        return (f"{type(module).__name__}'s weights are already sharded (DTensors: FSDP's fully_shard or tensor "
                "parallelism ran before apply); apply first, then shard the rest with the experts left out")
    if torch.nn.utils.parametrize.is_parametrized(module):
        return (f"{type(module).__name__}'s weights are parametrized (torch.nn.utils.parametrize): FEPLB computes on "
                "its own shards of the parameters, never on a parametrization's output")
    hooks = [k.strip("_") for k in kinds if getattr(module, k, None)]
    if hooks or "forward" in vars(module):
        return (f"{type(module).__name__} has hooks or a forward of its own "
                f"({', '.join(hooks) or 'an instance forward'}); FEPLB would not run them")
    return None


def weights_digest(*ts: torch.Tensor) -> tuple[str, ...]:
    """A checksum of each tensor (fp64 sum, exact hex): ranks that built or loaded different weights differ."""
    with torch.no_grad():
        return tuple(float(t.sum(dtype=torch.float64)).hex() for t in ts)


@contextlib.contextmanager
def derived_for_forward(holder: object, attr: str, make: Callable[..., tuple[torch.Tensor, ...]],
                        sources: Mapping[str, torch.Tensor], name: str,
                        versioned: Mapping[str, torch.Tensor] | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
    """``holder.<attr>``: the experts' weights ``make`` derives from ``sources`` (parameter names to tensors), made
    once for one forward and shared by all its uses, derived again in the backward rather than kept
    (``feplb.experts.rebuilt_in_backward``: errors name ``name`` and the parameter; ``versioned``: the parameters
    behind the sources where autograd versions them apart); None again after the forward. What every adapter
    joining its experts' parameters per forward runs its layer in."""
    with rebuilt_in_backward(make, sources, name, versioned or {}) as weights:
        setattr(holder, attr, weights)
        try:
            yield weights
        finally:
            setattr(holder, attr, None)


@contextlib.contextmanager
def joined_for_forward(layer: MoELayer, name: str) -> Iterator[None]:
    """``layer._joined``: the experts' weights ``layer._join()`` derives from ``layer.expert_params()``
    (:func:`derived_for_forward`, the parameters named as in the layer), and ``layer._joined_with_grad``: whether
    they were derived with autograd on."""
    names = {id(p): n for n, p in layer.named_parameters()}
    ps = layer.expert_params()
    params = {names.get(id(p), f"parameter {k} of the experts"): p for k, p in enumerate(ps)}
    if len(params) != len(ps):
        raise RuntimeError(f"{name}: the experts' parameters {[names.get(id(p)) for p in ps]} name one twice")
    layer._joined_with_grad = torch.is_grad_enabled()   # (whether the weights below carry autograd: own_weights)
    with derived_for_forward(layer, "_joined", layer._join, params, name):
        yield


def _agree(local: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``local`` over ``group`` (collective; ``[local]`` where torch.distributed is not initialised)."""
    if not dist.is_initialized():
        return [local]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)
    return out


def agree_to_replace(api: str, group: dist.ProcessGroup | None, problems: list[str], names: list[str],
                     digests: list, none_found: Callable[[], str], allow_none: bool = False) -> None:
    """One agreement before anything is replaced (collective): every rank raises the same ValueError together, or
    none does. ``problems``: one line per module this rank cannot run exactly; ``names``: every candidate module;
    ``digests``: checksums of the weights each rank will slice its experts from (ranks holding other modules or
    other weights are named); ``none_found()``: the message when no module was found, unless ``allow_none`` (a
    pipeline stage without MoE layers)."""
    views = _agree((tuple(problems), tuple(names), tuple(digests)), group)
    bad = [r for r, v in enumerate(views) if v[0]]
    if bad:
        msg = "\n".join(views[bad[0]][0])
        raise ValueError(f"{api}: cannot run these experts modules exactly (nothing was replaced):\n{msg}"
                         + ("" if len(bad) == len(views) else f"\n(on EP rank(s) {bad})"))
    if any(v[1:] != views[0][1:] for v in views):
        differ = [r for r, v in enumerate(views) if v[1:] != views[0][1:]]
        raise ValueError(f"{api}: EP rank(s) {differ} hold other experts modules or other expert weights than rank "
                         "0; build the same model on every rank (same seed, or load the same checkpoint, or "
                         "broadcast) before apply")
    if not names and not allow_none:
        raise ValueError(f"{api}: {none_found()}")


def mark_replaced(module: nn.Module, api: str, name: str, keep: nn.Module | None = None) -> None:
    """Mark the parameters of an experts module ``api`` replaced (``name``): an optimizer made before the
    replacement holds them, steps tensors the model no longer uses and never trains its experts; its first
    ``step()`` refuses that (``feplb.training``). Those its replacement ``keep`` still holds (a norm it took over)
    stay unmarked."""
    kept = set() if keep is None else {id(p) for p in keep.parameters()}
    for p in module.parameters():
        if id(p) not in kept:
            p._feplb_replaced = f"{api} replaced {name or '(the root)'}"


# ---------------------------------------------------------------------------------------------------- helpers

class HoldsEngine:
    """A module whose FEPLB layer is not a submodule but made at its first forward (``feplb.titan_ep``'s experts,
    which torchtitan builds, shards and checkpoints as its own): ``engine``, the layer or None; ``make_engine()``
    makes it now (collective over its EP group, as its first forward would). The balancing histories' save and
    restore name such a layer after the module, and a restore makes the layers not made yet."""

    engine: MoELayer | None

    def make_engine(self) -> MoELayer:
        raise NotImplementedError


def roots(model: nn.Module | list[nn.Module] | tuple[nn.Module, ...]) -> list[nn.Module]:
    """``model`` as a list of modules: itself, or the modules of a list (Megatron's virtual-pipeline chunks)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def experts_modules(model: nn.Module | list[nn.Module] | tuple[nn.Module, ...]) -> list[MoELayer]:
    """The model's FEPLB layers (``MoELayer``, which the adapters' experts modules are), in module order (each
    once). ``model`` may be a list of modules, as Megatron's virtual-pipeline chunks are."""
    seen, out = set(), []
    for m in (m for root in roots(model) for m in root.modules()):
        if isinstance(m, MoELayer) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters (every FEPLB layer's ``expert_params()``: ``gate_up_proj`` and ``down_proj`` with
    transformers, ``w1_EFD``, ``w2_EDF`` and ``w3_EFD`` with torchtitan): never all-reduce these. Every other
    parameter of the model is replicated and its gradient is all-reduced over the group by the user."""
    return [p for m in experts_modules(model) for p in m.expert_params()]


def reduce_replica_grads(model: nn.Module) -> None:
    """``reduce_replica_grads()`` of every FEPLB layer (collective): once per optimizer step, after the
    last backward and before gradient clipping and ``optimizer.step()``."""
    moes = experts_modules(model)
    with handshaken(moes, ENTRY_REDUCE):
        for m in moes:
            m.reduce_replica_grads()


def zero_replica_grads(model: nn.Module) -> None:
    """``zero_replica_grads()`` of every FEPLB layer (local): drop the gradients per-step expert copies accumulated
    since the last reduction. Call it where the training loop discards gradients without a step (a skipped
    step, a discarded accumulation) and zeroes them by hand or with an optimizer not given to
    :func:`attach_optimizer`; ``optimizer.zero_grad()`` of an attached optimizer does it, ``model.zero_grad()``
    does not (the copies are not parameters)."""
    for m in experts_modules(model):
        m.zero_replica_grads()


def average_expert_grads(model: nn.Module, data_parallel_group: dist.ProcessGroup | None = None, *,
                         divide: bool = True) -> None:
    """Make the expert shards' gradients the mean over the ranks' losses instead of the sum the dispatch leaves
    (collective): ``MoELayer.average_expert_grads`` of every FEPLB layer (replica gradients reduced,
    then divided by the EP group's size; with ``data_parallel_group``, EP x DP, first summed over it and divided
    by both sizes). Call it once per optimizer step, after the last backward and before clipping and
    ``optimizer.step()``, when the replicated parameters' gradients are averaged (FSDP's ``fully_shard`` and DDP
    do that) over the same ranks, so that the whole model follows the mean of the ranks' losses.

    divide=False: the sum of the ranks' losses' gradients instead (summed over ``data_parallel_group``, not
    divided), where the replicated parameters' gradients are summed too: torchtitan's convention, whose FSDP does
    not divide (the loss scaled by the global token count). Needed under EP x DP; with the EP group all the ranks
    the dispatch already leaves the sum."""
    moes = experts_modules(model)
    args, problem = average_args(moes, data_parallel_group, divide)
    with handshaken(moes, ENTRY_AVERAGE, force=True, problem=problem, args=args):
        if data_parallel_group is None and holds_grad_buffers(moes):   # (agreed in the handshake's arguments)
            raise ValueError(f"average_expert_grads: {GRAD_BUFFERS_REFUSAL}")
        # (with a data-parallel group, the layers' preparation raises it, and the comparison below carries it to the
        # other replicas, which the handshake does not reach)
        # every layer prepared (its refusals, its replica gradients reduced), then, under EP x DP, the replicas
        # compared once for the whole model, a replica's refusal among what they compare (each layer's own check of
        # the group first: it names a group of other experts): every rank raises together before any sum
        if data_parallel_group is not None and moes:
            for m in moes:
                m._check_dp_group(data_parallel_group)
            prepare_and_compare(moes, data_parallel_group, divide)
        else:
            for m in moes:
                m._average_prepare()
        with averages_prepared():
            for m in moes:
                m.average_expert_grads(data_parallel_group, divide=divide)


def attach_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler | None = None, *, average_required: bool | None = None) -> None:
    """``attach_optimizer(optimizer, scaler)`` of every FEPLB layer: each ``optimizer.step()`` then reduces the
    replica gradients before it and refreshes the replicas after it (collective at every step). With a
    ``torch.amp.GradScaler``, pass it: its ``unscale_`` and ``step`` then reduce first, so the replicas' gradients
    are unscaled and checked for inf / NaN with the owners' (and :func:`clip_grad_norm_` after
    ``scaler.unscale_`` sees them reduced); accelerate's ``AcceleratedOptimizer`` brings its own when none is
    given. Clip with :func:`clip_grad_norm_` (it reduces first). ``average_required`` (default: for accelerate's
    ``AcceleratedOptimizer``): a step whose expert gradients :func:`average_expert_grads` did not divide since its
    last backward is refused on every rank (``MoELayer.attach_optimizer``)."""
    for m in experts_modules(model):
        m.attach_optimizer(optimizer, scaler, average_required=average_required)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose experts FEPLB shards (collective over the EP group):
    the helpers' replica gradients are reduced into the owners first (:func:`reduce_replica_grads`; a later
    reduction, such as :func:`attach_optimizer`'s, then adds nothing), and the norm is the whole model's: every
    replicated parameter's gradient counted once (call this after the data-parallel reduction of those, so that
    they are equal on every rank), every expert shard's once, on its owner. Every rank then scales every gradient
    by the same factor. Returns the total norm (a 0-d tensor, equal on every rank). With a ``GradScaler``, call it after
    ``scaler.unscale_(optimizer)``, and pass the scaler to :func:`attach_optimizer` (or call
    :func:`reduce_replica_grads` before ``unscale_``): unscaling divides the gradients the optimizer holds, not the
    replicas' still to be reduced."""
    moes = experts_modules(model)
    if not moes:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
    groups = {id(m.group) for m in moes}
    if len(groups) != 1:
        raise ValueError("clip_grad_norm_: the model's FEPLB layers use different process groups; clip "
                         "each group's parameters yourself")
    # (its arguments agreed in the handshake: another norm_type on one rank would reduce with another op and size,
    # the ranks' collectives mismatched; another max_norm scale every gradient there by another factor, the
    # replicated parameters drifting apart silently; so would another part of the model on one rank, its FEPLB
    # layers or its parameters: a rank clipping one layer where the others clip the model)
    # EP x DP: the data-parallel group the layers' average_expert_grads last summed over (its size agreed here too,
    # so that every EP rank compares the call over its replicas below, or none does)
    dp = next((g for g in (m.__dict__.get("_dp_group_used") for m in moes) if g is not None), None)
    args = (float(max_norm), float(norm_type), bool(error_if_nonfinite), tuple(m.layer_id for m in moes),
            sum(1 for _ in model.parameters()), 0 if dp is None else dist.get_world_size(dp),
            holds_grad_buffers(moes))
    with handshaken(moes, ENTRY_CLIP, force=True, args=args):   # (its norm's all-reduce is collective anyway)
        if dp is not None:
            # (the layers' ids are agreed within each EP group only, and differ between replicas where one built
            # other layers before: their number goes across instead; the Megatron-buffers flag among the rest, so
            # that the replicas raise it together, below)
            _check_clip_replicas(moes, dp, (*args[:3], len(moes), *args[4:]))
        if args[-1]:
            raise ValueError(f"clip_grad_norm_: {GRAD_BUFFERS_REFUSAL}")
        return _clip_grad_norm(model, moes, max_norm, norm_type, error_if_nonfinite)


def _check_clip_replicas(moes: list, dp: dist.ProcessGroup, args: tuple) -> None:
    """Under EP x DP the handshake compares the call over the EP group only: each replica (EP group) would scale its
    gradients by its own norm's factor, and the replicas drift apart silently, where their calls differ or where
    the expert gradients are not averaged over the replicas yet (each replica's own, so their norms differ). One
    all-gather over ``dp`` of the call's digest and whether this rank's experts are averaged, then the verdict agreed
    over the EP group: every rank raises together."""
    from feplb.steps import args_digest

    table, ok = compare_over_replicas(
        moes, dp, [args_digest(args), int(any(m._not_averaged() for m in moes))],
        lambda t: [all(row[0] == t[0][0] for row in t), not any(row[1] for row in t)],
        "clip_grad_norm_'s comparison over the data-parallel group")
    apart = any(row[0] != table[0][0] for row in table)
    late = any(row[1] for row in table)
    ranks = dist.get_process_group_ranks(dp)
    if not ok[0]:
        where = f" (global ranks {ranks})" if apart else " (on another rank of this EP group)"
        raise ValueError("clip_grad_norm_: the data-parallel replicas of the experts passed other arguments (max_norm, "
                         "norm_type, error_if_nonfinite, or another part of the model), or one holds its expert "
                         f"gradients in Megatron DDP's main_grad buffers{where}: each replica would "
                         "scale its gradients by another factor, the replicas drifting apart. Nothing was clipped, "
                         "on any rank: pass the same on every rank")
    if not ok[1]:
        where = (f" on global rank(s) {[g for g, row in zip(ranks, table, strict=True) if row[1]]}" if late else
                 " on another rank of this EP group's replicas")
        raise RuntimeError("clip_grad_norm_: the expert gradients are not averaged over the data-parallel group yet"
                           f"{where}: average_expert_grads(model, data_parallel_group) was not called since the last "
                           "backward. Each replica's norm would be its own, and the replicas would drift apart. "
                           "Nothing was clipped, on any rank: call average_expert_grads first, then clip")


def _clip_grad_norm(model: nn.Module, moes: list, max_norm: float, norm_type: float,
                    error_if_nonfinite: bool) -> torch.Tensor:
    reduce_replica_grads(model)
    group = moes[0].group
    experts = expert_parameters(model)
    expert_ids = {id(p) for p in experts}
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    # FSDP (fully_shard) makes the replicated parameters DTensors: their norms are the whole tensors' (DTensor
    # reduces over its mesh), computed apart from plain tensors (torch's foreach ops refuse a mix)
    dtensors = [g for p, g in zip(params, grads, strict=True) if id(p) not in expert_ids and is_dtensor(g)]
    replicated = [g for p, g in zip(params, grads, strict=True) if id(p) not in expert_ids and not is_dtensor(g)]
    sharded = [g for p, g in zip(params, grads, strict=True) if id(p) in expert_ids]
    device = grads[0].device if grads else experts[0].device
    norm_type = float(norm_type)
    # (the per-tensor norms, each in its gradient's dtype, summed in fp32, or in fp64 for a model with fp64
    # parameters: read from the model, alike on every rank, not from the gradients this rank happens to hold, as the
    # norms' all-reduce must be of one dtype on every rank)
    acc = torch.float64 if any(p.dtype == torch.float64 for p in model.parameters()) else torch.float32

    def local(gs):
        if not gs:
            return torch.zeros((), dtype=acc, device=device)
        norm = torch.nn.utils.get_total_norm(gs, norm_type)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        return norm.to(device=device, dtype=acc)

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
        local_grads = [g.to_local() if is_dtensor(g) else g for g in grads]
        for dev_grads in _by_device(local_grads).values():
            torch._foreach_mul_(dev_grads, coef.to(dev_grads[0].device))
    return total


def _by_device(ts: list[torch.Tensor]) -> dict:
    out: dict = {}
    for t in ts:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def refresh_replicas(model: nn.Module | list[nn.Module]) -> None:
    """``refresh_replicas()`` of every FEPLB layer (collective): after every ``optimizer.step()`` and
    after any other change of the expert weights (loading a shard, say)."""
    _refresh(experts_modules(model))


def _refresh(moes: list[MoELayer]) -> None:
    with handshaken(moes, ENTRY_REFRESH):
        for m in moes:
            m.refresh_replicas()


def set_state_dict_type(model: nn.Module, kind: str) -> None:
    """What ``model.state_dict()`` gives for every FEPLB layer's expert shards, and an optimizer's
    ``state_dict()`` for their state (``MoELayer.set_state_dict_type``): ``"sharded"`` (the default), DTensors
    sharded over each layer's EP group, for ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``,
    ``get_model_state_dict`` and ``get_optimizer_state_dict``, torchtitan's ``CheckpointManager``), which then
    loads them at any EP size; ``"local"``, plain per-rank tensors (one ``torch.save`` file per rank, loaded back
    into the same EP layout). ``load_state_dict`` takes either, and the model's whole expert tensors too."""
    for m in experts_modules(model):
        m.set_state_dict_type(kind)


# the levels a wrapper's state-dict hook removes from its entries' names (torch's checkpoint_wrapper and
# offload_wrapper, which torchtitan's activation checkpointing applies; FSDP1's wrapper)
_WRAPPER_LEVELS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _named_layers(model: nn.Module | list[nn.Module], make: bool = False) -> list[tuple[str, MoELayer]]:
    """(name, layer) of every FEPLB layer, in module order (each once): its name as ``state_dict()`` spells it
    without the wrappers' levels (DDP's ``module``, ``torch.compile``'s ``_orig_mod``, FSDP's and activation
    checkpointing's: a model saved wrapped and loaded bare, or the reverse, names its layers alike), prefixed by the
    chunk's index where ``model`` is a list of chunks. A :class:`HoldsEngine` module's layer goes by the module's
    name: the one it made, or with ``make`` the one it makes now (collective) if it has none yet."""
    from torch.nn.parallel import DistributedDataParallel

    def unwrapped(m: nn.Module) -> nn.Module:
        while True:
            inner = m.module if isinstance(m, DistributedDataParallel) else getattr(m, "_orig_mod", None) \
                if type(m).__name__ == "OptimizedModule" else None
            if not isinstance(inner, nn.Module):
                return m
            m = inner

    seen, out = set(), []

    def walk(m: nn.Module, path: list[str], prefix: str) -> None:
        m = unwrapped(m)
        layer = m if isinstance(m, MoELayer) else \
            (m.make_engine() if make else m.engine) if isinstance(m, HoldsEngine) else None
        if layer is not None and id(layer) not in seen:
            seen.add(id(layer))
            out.append((prefix + ".".join(path), layer))
        for child_name, child in m.named_children():
            walk(child, path if child_name in _WRAPPER_LEVELS else [*path, child_name], prefix)

    many = isinstance(model, (list, tuple))
    for i, root in enumerate(roots(model)):
        walk(root, [], f"{i}." if many else "")
    return out


def _entry(layer: MoELayer) -> dict | None:
    """``layer``'s history as :func:`policy_state_dict` keeps it (None for policy ``none``), with its EP group."""
    st = layer.state
    if st is None:
        return None
    out = {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in st.to_dict().items()}
    out["ep_ranks"] = list(layer.control.ranks)
    return out


def policy_state_dict(model: nn.Module | list[nn.Module]) -> dict[str, list[dict | None]]:
    """Every FEPLB layer's balancing history (``MoELayer.state``: the ``@ema`` load averages and dynamic sets, the
    ``+place`` placement, EPLB's layout, the step count), by layer name, one entry per EP group holding a layer of
    that name (EP x DP: each group trains on its own data; pipeline stages name their layers alike), each with the
    group's global ranks (``ep_ranks``); as int64 tensors and Python numbers and strings, which
    ``torch.load(..., weights_only=True)`` reads; None for a layer without one (policy ``none``). Collective over
    the job (an all-gather of objects): call it on every rank, then save it on one (the result is the same on
    every rank). Save it beside the weights: resumed without it, a layer starts its history afresh and plans the
    next steps otherwise (the same math, other rows moved, so neither bit for bit the same run nor as well balanced
    at first). ``feplb.titan_ep``'s experts modules (:class:`HoldsEngine`) give their layers' under their own
    names, once a forward has made them. RuntimeError on every rank between the micro-batches of a step where a
    per-step copy holds a gradient not yet reduced (``load_policy_state_dict`` refuses that restore alike): the
    history then holds the step's earlier micro-batches, which a run resumed at the step's start would fold in
    twice, planning otherwise than the uninterrupted run. Where no per-step copy holds a gradient (per-micro-batch
    weights, a policy that keeps no copies) nothing marks the middle of a step, and such a save is taken: the same
    math, other plans after the resume. Save between steps."""
    me = dist.get_rank() if dist.is_initialized() else 0
    layers = _named_layers(model)
    # (one rank of each EP group sends its layers' histories, which the group's ranks share)
    mine = [(name, _entry(layer), list(layer.control.ranks)) for name, layer in layers
            if layer.control.ranks[0] == me]
    # (every rank its layers whose copies hold gradients: a rank whose copies no backward reached has none)
    midway = [name or "(the model itself)" for name, layer in layers
              if layer.replicas.ever_held and not layer.replicas.grads_clean()]
    views = _agree((mine, midway), None)
    bad = [f"  {name} on rank {r}" for r, (_, names) in enumerate(views) for name in names]
    if bad:
        raise RuntimeError("policy_state_dict: called between the micro-batches of a step (per-step copies hold "
                           "gradients not yet reduced), where the histories hold the step's earlier micro-batches "
                           "and a run resumed from them at the step's start would plan otherwise than this one; "
                           "call it (and dcp.save / dcp.load of PolicyStates, which call it) between steps, after "
                           "reduce_replica_grads() / the optimizer step:\n" + "\n".join(bad))
    out: dict[str, list[dict | None]] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for view, _ in views:
        for name, entry, ranks in view:
            if (name, tuple(ranks)) not in seen:   # (the group's ranks hold the same: one's)
                seen.add((name, tuple(ranks)))
                out.setdefault(name, []).append(entry)
    return out


def _pick(entries: Any, layer: MoELayer) -> tuple[dict | None, str | None]:
    """(the saved entry of ``layer``'s EP group among ``entries``, why there is none)."""
    ranks = list(layer.control.ranks)
    if not isinstance(entries, (list, tuple)):
        return None, f"saved as {type(entries).__name__}, expected a list of entries (policy_state_dict's form)"
    if layer.state is None:
        return (None, None) if any(e is None for e in entries) else \
            (None, f"saved with a history, the layer's policy {layer.config.policy!r} keeps none")
    for e in entries:
        if e is not None and not isinstance(e, Mapping):
            return None, f"an entry is a {type(e).__name__}, expected a dict (policy_state_dict's form) or None"
        got = None if e is None else e.get("ep_ranks")
        if e is not None and not (isinstance(got, (list, tuple)) and all(type(r) is int for r in got)):
            return None, f"an entry's ep_ranks is {got!r}, expected a list of global ranks"
    found = [e for e in entries if isinstance(e, Mapping) and list(e.get("ep_ranks", ())) == ranks]
    if found:
        return found[0], None
    groups = [list(e["ep_ranks"]) for e in entries if isinstance(e, Mapping) and "ep_ranks" in e]
    if any(e is None for e in entries) and not groups:
        return None, "saved without a history (policy 'none')"
    return None, f"saved for the EP group(s) of global ranks {groups}, not for this layer's {ranks}"


def load_policy_state_dict(model: nn.Module | list[nn.Module], state: Mapping[str, Any], *,
                           strict: bool = True) -> list[str]:
    """Restore the histories :func:`policy_state_dict` gave (each layer its own EP group's), then
    ``refresh_replicas`` (collective: call it on every rank of the job, between steps, after loading the weights;
    the layers adopt the restored decisions and copy the weights they name). RuntimeError on every rank, before any
    layer adopts anything, where the ranks of a group would restore different histories (with ``strict=False``
    too: some restoring, others keeping their own) or a per-step copy holds a gradient not yet reduced (a restore
    between the micro-batches of a step, which is refused there only: elsewhere such a restore is taken, and the
    step's later micro-batches plan from the restored history); should the refresh still fail, the layers get
    their own histories back and adopt them again. strict:
    every layer's history must be in ``state``, saved by its EP group (the same global ranks), for its topology
    (EP size, GPUs per node, experts, ``dyn``) and settings (policy, ``refresh_every``, ...): otherwise
    ValueError on every rank, naming the layers, before anything is restored. With ``strict=False`` such layers
    keep their own history (a run resumed at another EP size or on other ranks, say). Returns the names of the
    layers that kept their own. A ``feplb.titan_ep`` experts module that has not run a forward yet (a run resumed
    before its first step) makes its layer first, as its first forward would (collective over its EP group). A
    ``state`` that is no mapping on some rank, or ``strict`` differing between the ranks, is refused on every
    rank."""
    return _load_policy_state(model, state, strict, None)


def _load_policy_state(model: nn.Module | list[nn.Module], state: Any, strict: bool, refused: str | None
                       ) -> list[str]:
    """:func:`load_policy_state_dict`; ``refused``: why this rank's ``state`` cannot be read at all (a
    :class:`PolicyStates` blob that is no ``torch.save`` file), refused on every rank in the first agreement, as a
    ``state`` that is no mapping is, before any collective the peers would wait in."""
    import hashlib

    from feplb.replicas import state_digest
    from feplb.sched import PolicyState

    if refused is None and not isinstance(state, Mapping):
        refused = f"load_policy_state_dict: state must be a mapping of layer names, got {type(state).__name__}"
    if refused is not None:
        state = {}      # (every layer "not in the saved state" here: the refusal below comes first)
    layers = _named_layers(model, make=True)
    restored, kept, problems, decided = [], [], [], []
    for name, layer in layers:
        saved, why = None, None
        try:
            if name not in state:
                why = "not in the saved state"
            else:
                saved, why = _pick(state[name], layer)
            if why is None and saved is not None:
                try:
                    saved = PolicyState.from_dict({k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
                                                   for k, v in dict(saved).items() if k != "ep_ranks"}, layer.state)
                except (TypeError, ValueError) as e:
                    why = str(e)
            digest = None if why is not None else \
                "none" if saved is None else hashlib.sha256(state_digest(saved)).hexdigest()[:16]
        except Exception as e:  # noqa: BLE001 - a malformed entry, named and agreed below on every rank
            saved, why, digest = None, f"a malformed entry ({type(e).__name__}: {e})", None
        if why is None:
            restored.append((name, layer, saved))
        else:
            kept.append(name)
            problems.append(f"  {name or '(the model itself)'}: {why}")
        decided.append((name, tuple(layer.control.ranks), digest))
    # one agreement: every rank's problems, its layers' names (unknown: a name no rank's model holds; pipeline
    # stages hold layers of other names, or none), and what each of its layers would restore (the ranks of an EP
    # group must restore the same, or all keep their own: with strict=False too, as one rank's stale file would
    # make them differ, and the checks below are collective over the group)
    # (and whether each rank's state could be read, and its strict: a rank refusing alone, or alone going on to the
    # collectives below, would leave the others waiting there)
    views = _agree((problems if strict else [], sorted(n for n, _ in layers), decided, refused, bool(strict)), None)
    unread = [r for r, v in enumerate(views) if v[3] is not None]
    if unread:
        raise TypeError(views[unread[0]][3]
                        + ("" if len(unread) == len(views) else f" (on rank(s) {unread})") + "; nothing restored, on "
                        "any rank: give every rank the same saved histories (policy_state_dict's result)")
    stricts = [bool(v[4]) for v in views]
    if len(set(stricts)) > 1:
        on = [r for r, x in enumerate(stricts) if x]
        raise ValueError(f"load_policy_state_dict: strict differs across ranks (True on rank(s) {on}, False on "
                         f"{[r for r in range(len(stricts)) if r not in on]}); nothing restored, on any rank: pass "
                         "the same strict on every rank")
    views = [v[:3] for v in views]
    unknown = sorted(set(state) - {n for _, names, _ in views for n in names})
    bad = next((list(v) for v, _, _ in views if v), [])
    if unknown and strict:
        bad.append(f"  names of no FEPLB layer of the model: {unknown}")
    if bad:
        raise ValueError("load_policy_state_dict: the saved balancing histories do not fit the model's layers "
                         "(strict=True):\n" + "\n".join(bad))
    by_layer: dict[tuple, dict] = {}
    for r, (_, _, dec) in enumerate(views):
        for name, ranks, digest in dec:
            by_layer.setdefault((name, ranks), {}).setdefault(digest, []).append(r)

    def what(d: str | None) -> str:
        return "keeps its own" if d is None else "restores none (policy none)" if d == "none" else \
            f"restores history {d}"

    split = [f"  {name or '(the model itself)'} (EP group of global ranks {list(ranks)}): "
             + "; ".join(f"{what(d)} on rank(s) {rs}" for d, rs in ds.items())
             for (name, ranks), ds in by_layer.items() if len(ds) > 1]
    if split:
        raise RuntimeError("load_policy_state_dict: nothing restored, on any rank: the ranks of an EP group would "
                           "restore different histories (give every rank the same saved histories, the same "
                           "file):\n" + "\n".join(split))
    # What the refresh would refuse, checked before any layer adopts anything (so that none is left half restored:
    # its placement and copies adopted, its history its own), each check collective over the layer's EP group and
    # raising on all its ranks alike; then agreed over the job, so that every rank raises together.
    problems = []
    for name, layer, _ in restored:
        try:
            if layer.replicas.ever_held:
                layer.replicas.agree("refresh_replicas")
        except (RuntimeError, ValueError) as e:
            problems.append(f"  {name or '(the model itself)'}: {e}")
    bad = next((v for v in _agree(problems, None) if v), None)
    if bad:
        raise RuntimeError("load_policy_state_dict: nothing restored, on any rank (call it between steps, on "
                           "every rank, with the same saved histories):\n" + "\n".join(bad))
    own = [(layer, layer.state) for _, layer, _ in restored]
    failed: BaseException | None = None
    try:
        for _, layer, saved in restored:
            layer.state = saved
        _refresh([layer for _, layer in layers])
    except Exception as e:   # noqa: BLE001 - agreed over the job below, then raised
        failed = e
    # (a refresh refused in one EP group raises on that group's ranks only: agreed, so that every rank raises)
    views = _agree(None if failed is None else f"{type(failed).__name__}: {failed}", None)
    if failed is None and all(v is None for v in views):
        return kept
    # the layers get their own histories back, and adopt them again (placement, sets, copies: what a refresh
    # partly did for the restored ones is undone), on every rank
    for layer, st in own:
        layer.state = st
    try:
        _refresh([layer for _, layer in layers])
    except Exception as e:   # noqa: BLE001 - reported with the first failure
        why = next(v for v in views if v is not None)
        raise RuntimeError(f"load_policy_state_dict: the refresh after the restore failed ({why}), and so did the "
                           f"refresh with the layers' own histories back ({type(e).__name__}: {e}); call "
                           "refresh_replicas() before the next step") from failed
    if failed is not None:
        raise failed
    raise RuntimeError("load_policy_state_dict: the refresh after the restore was refused on other ranks (the "
                       "layers have their own histories back): " + next(v for v in views if v is not None))


class PolicyStates:
    """The FEPLB layers' balancing histories of a model (or of a list of its parts) as a ``Stateful`` for
    ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``, torchtitan's ``CheckpointManager``): one entry,
    ``histories``, :func:`policy_state_dict` as ``torch.save`` writes it (every EP group's, the same on every rank,
    which DCP writes once), restored by :func:`load_policy_state_dict` with ``strict=False``: a layer whose EP group,
    EP layout or settings have no history there (a run resumed at another EP size, or with another policy) starts
    afresh, with a warning naming it. Both collective over the job, as DCP's save and load are. Put one in the state
    dict you give ``dcp.save`` and ``dcp.load``; ``feplb.titan_ep.FEPLBCheckpointManager`` holds one in torchtitan's
    trainer. The restore refreshes the layers' copies of the expert weights (``refresh_replicas``): DCP loads the
    tensors in place before any ``Stateful``, so they are the loaded weights; weights that another ``Stateful``
    applies in its own ``load_state_dict`` may come after it, so call ``refresh_replicas`` after ``dcp.load`` there
    (a stale copy is refused at the next forward on every rank otherwise)."""

    def __init__(self, model: nn.Module | list[nn.Module] | tuple[nn.Module, ...]):
        parts = roots(model)
        self._model = parts[0] if len(parts) == 1 else parts

    def state_dict(self) -> dict[str, bytes]:
        buf = io.BytesIO()
        torch.save(policy_state_dict(self._model), buf)
        return {"histories": buf.getvalue()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # (what cannot be read on one rank is refused on every rank, in the restore's first agreement)
        blob = state_dict.get("histories") if isinstance(state_dict, Mapping) else None
        saved, refused = None, None
        if not isinstance(blob, bytes):
            refused = ("PolicyStates.load_state_dict: expected {'histories': bytes} (what its state_dict() gives), "
                       f"got {type(state_dict).__name__}"
                       + (f" with histories of type {type(blob).__name__}" if isinstance(state_dict, Mapping) else ""))
        else:
            try:
                saved = torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as e:  # noqa: BLE001 - agreed in the restore, raised on every rank
                refused = ("PolicyStates.load_state_dict: its histories are no torch.save file "
                           f"({type(e).__name__}: {e})")
        kept = _load_policy_state(self._model, saved, False, refused)
        if kept:
            warnings.warn(f"feplb: no balancing history in the checkpoint for FEPLB layer(s) {kept} (saved at another "
                          "EP size, on other ranks, with other settings, or before their first forward); they start "
                          "afresh: the same math, other rows moved at first", RuntimeWarning, stacklevel=2)


def _state_dict_name(name: str) -> str:
    """A module's name (``named_modules``) as ``state_dict()`` spells its entries."""
    return ".".join(level for level in name.split(".") if level not in _WRAPPER_LEVELS)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = False
                    ) -> dict[str, torch.Tensor]:
    """The model's state dict with every FEPLB layer's expert shards gathered back into the original names and
    shapes (with transformers ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F], or [E, H, 2F] and [E, F, H]
    where the module was ``is_transposed``; with torchtitan
    ``w1_EFD`` [E, F, D], ``w2_EDF`` [E, D, F] and ``w3_EFD`` [E, F, D]; with Megatron-Core the model with
    ``expert_model_parallel_size=1``: every expert's ``local_experts.{j}`` or ``linear_fc1.weight{j}`` ... under its
    global index j, the legacy GroupedMLP's ``weight1`` [H, E * 2F] and ``weight2`` [E * F, H]), ready for
    ``save_pretrained(d, state_dict=...)`` or ``load_state_dict`` of an unmodified model. Collective over each
    layer's EP group.

    rank0_only: the full dict on rank 0 of the EP group and an empty dict elsewhere (True), or on every rank.
    cpu_offload: the tensors returned on the CPU (True), each gathered parameter moved there before the next is
        gathered, so a device holds at most one expert parameter's whole tensor (and this rank's copy of its shard)
        at a time beyond the model (as ``StateDictOptions(cpu_offload=True)`` does for DCP's full state dict): what
        saving a checkpoint wants, where the whole model's experts may not fit in one GPU's memory beside the
        training state. Entries sharing the model's storage (tied weights) share one CPU copy. False: on the
        parameters' devices, every expert parameter's whole tensor held there at once on the ranks that return it.
    Tensors are detached; the non-expert entries share storage with the model where they stay on its device
    (always without cpu_offload), except those FSDP (``fully_shard``) holds as DTensors, which are gathered into
    plain tensors (collective over their meshes; every rank gathers them, also with rank0_only). A layer reachable
    under several names is gathered once and written under each.
    """
    def placed(t: Any) -> Any:   # (an entry may be another object: a module's _extra_state)
        return t.cpu() if cpu_offload and isinstance(t, torch.Tensor) else t

    copies: dict[tuple, torch.Tensor] = {}

    def placed_once(t: Any) -> Any:
        """``placed``, one CPU copy for the entries that are one tensor of the model (tied weights: embed_tokens and
        lm_head), which save_pretrained then writes once, as without cpu_offload (every tensor here lives until the
        return: no address is reused meanwhile)."""
        if not (cpu_offload and isinstance(t, torch.Tensor)) or t.device.type == "cpu":
            return t
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key not in copies:
            copies[key] = t.cpu()
        return copies[key]

    owners: dict[str, MoELayer] = {_state_dict_name(name): m for name, m in model.named_modules(remove_duplicate=False)
                                   if isinstance(m, MoELayer)}
    keep = not rank0_only or dist.get_rank(next(iter(owners.values())).group if owners else None) == 0
    sd = {}
    with local_state_dicts(owners.values()):   # the expert entries are replaced below, by gathered parameters
        local = model.state_dict()
    for k, v in local.items():
        if is_dtensor(v):
            v = v.full_tensor()   # collective: every rank gathers, one tensor at a time
            if not keep:
                del v             # (freed before the next is gathered)
                continue          # and only the ranks that return it hold it
            v = placed(v)         # one gathered tensor on the device at a time
        sd[k] = v
    full: dict[str, dict[str, torch.Tensor]] = {}   # local key -> the full model's entries it stands for
    gathered: dict[tuple[int, str], dict[str, torch.Tensor]] = {}   # (layer, parameter name): entries, relative
    for prefix, m in owners.items():
        group = m.group
        W, r = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        for pname, p in expert_named_params(m):
            key = f"{prefix}.{pname}" if prefix else pname
            if (id(m), pname) not in gathered:
                shard = p.detach().contiguous()
                if rank0_only:
                    parts = [torch.empty_like(shard) for _ in range(W)] if r == 0 else None
                    dist.gather(shard, parts, dst=dst, group=group)
                else:
                    parts = [torch.empty_like(shard) for _ in range(W)]
                    dist.all_gather(parts, shard, group=group)
                del shard   # (a copy where the parameter is strided: freed before the next parameter's)
                if parts is not None and cpu_offload:
                    parts = [t.cpu() for t in parts]   # this parameter's device buffers freed before the next
                # not returned (rank0_only, not rank 0): an empty mark that it was gathered
                gathered[id(m), pname] = m.full_entries(pname, parts) if parts is not None else {}
            full[key] = {(f"{prefix}.{n}" if prefix else n): t for n, t in gathered[id(m), pname].items()}
    if not keep:
        return {}
    for prefix, m in owners.items():   # the layers' other entries (a layer keeping per-expert state renames it)
        head = f"{prefix}." if prefix else ""
        for k in sd:
            if k.startswith(head) and k not in full:
                entries = m.full_state_entries(k[len(head):], sd[k])
                if list(entries) != [k[len(head):]]:
                    full[k] = {head + n: t for n, t in entries.items()}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k in full:
            out.update({n: placed_once(t) for n, t in full[k].items()})
        else:
            out[k] = placed_once(v)
    return out
