"""The MoE layer's part in a training step, around ``optimizer.step()``: the per-step copies of expert weights
(``weights="per-step"``: resident replicas, the ``+place`` bank) reduced into their owners' gradients before a step
and refreshed after it, the policy's slow decisions adopted there, and the hooks that make any optimizer keep them
consistent.

``TrainingSteps`` is mixed into ``feplb.layer.MoELayer``, which provides what it reads (``replicas``,
``placement``, ``control``, ``config``, ...). Every optimizer in the process is hooked once (not once per layer):
after a step of an optimizer no layer is attached to, a live layer whose experts it stepped marks its copies stale
(its next forward raises on every rank, naming ``refresh_replicas``); before a step, the expert parameters' state
an optimizer loaded as DTensors (a sharded state dict) is made local. ``attach_optimizer`` instead refreshes the
copies itself at every step; with a ``torch.amp.GradScaler`` it also reduces the replica gradients before the
scaler unscales and checks them, and agrees on that check over the EP group.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from feplb.control import guard
from feplb.dispatch import settle_abandoned
from feplb.frames import caller_frame
from feplb.replicas import state_digest
from feplb.sharded import localize_state, track_optimizer
from feplb.steps import (
    DP_GROUP_HINT,
    ENTRY_AVERAGE,
    ENTRY_REDUCE,
    ENTRY_REFRESH,
    ENTRY_SCALER,
    ENTRY_STEP,
    STEP_PROBLEM_BAD_DP_GROUP,
    STEP_PROBLEM_NOT_AVERAGED,
    STEP_PROBLEM_UNATTACHED_SCALER,
    args_digest,
    not_averaged,
)

__all__ = ["TrainingSteps", "handshaken"]

# The live layers: one optimizer step hook for all of them, gone with them (a hook per layer stayed registered for
# every layer never closed, and ran at every step of every optimizer).
_LAYERS: weakref.WeakSet[TrainingSteps] = weakref.WeakSet()


def _extent(t: torch.Tensor) -> tuple[tuple[int, int], int, int] | None:
    """Where ``t``'s elements live: (its storage (device index, address), first byte, end byte), or None where there is
    nothing to read (no elements, the meta device, a tensor subclass without a storage). A DTensor's is its local
    shard's."""
    t = getattr(t, "_local_tensor", t)
    n = t.numel()
    try:
        ptr = t.untyped_storage().data_ptr() if n else 0
    except Exception:   # (a wrapper subclass with no storage of its own)
        return None
    if not ptr:
        return None
    first, size = t.storage_offset(), t.element_size()
    span = n if t.is_contiguous() else 1 + sum((k - 1) * s for k, s in zip(t.shape, t.stride(), strict=True))
    return (t.get_device(), ptr), first * size, (first + span) * size


def _in_flat(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a storage that holds more than it (a flat buffer of several parameters)."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage().nbytes() > t.numel() * t.element_size()
    except Exception:   # (a wrapper subclass with no storage of its own)
        return False


class _Spans:
    """The bytes a set of tensors covers, per storage: merged [first, end) intervals, searched by bisection."""

    def __init__(self, tensors) -> None:
        by: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for ext in map(_extent, tensors):
            if ext is not None:
                by.setdefault(ext[0], []).append(ext[1:])
        self._spans = {}
        for key, spans in by.items():
            merged: list[list[int]] = []
            for lo, hi in sorted(spans):
                if merged and lo <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            self._spans[key] = ([lo for lo, _ in merged], [hi for _, hi in merged])

    def hits(self, t: torch.Tensor) -> bool:
        """Whether any byte of ``t`` is among them."""
        ext = _extent(t)
        if ext is None or ext[0] not in self._spans:
            return False
        starts, ends = self._spans[ext[0]]
        i = bisect.bisect_left(starts, ext[2]) - 1    # the last interval starting before t's end
        return i >= 0 and ends[i] > ext[1]


def _stepped(opt: torch.optim.Optimizer, *_: Any) -> None:
    """After any ``optimizer.step()``: a live layer whose experts it stepped, and that is not attached to it (an
    attached one refreshes its copies itself), holds stale per-step copies.

    Stepped means: it holds the expert parameters, or their fp32 main copies (``param.main_param``, Megatron's
    mixed-precision optimizers, which write back through ``.data``: no version counter moves); and, for the layers
    with per-step copies, a tensor of any layer's expert weights' bytes (a view, a shard of a flat buffer) steps
    every layer whose experts share that storage. Megatron's DDP puts every expert parameter of a model chunk into
    one flat buffer, and its distributed optimizer steps one shard of that buffer per expert-data-parallel rank
    (views of it in fp32, fp32 main copies of the parameters in the shard otherwise) and all-gathers the rest: a
    rank whose shard holds none of a layer's parameters still receives that layer's new weights. (Transformer
    Engine's and Apex's fused optimizers write through ``.data`` too.) A step of other parameters in such a buffer
    marks no layer."""
    layers = list(_LAYERS)
    if not layers:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    held = {id(p) for p in params}

    def own(p) -> bool:
        return id(p) in held or id(getattr(p, "main_param", None)) in held

    marked = [layer for layer in layers if any(own(p) for p in layer.expert_params())]
    if marked:
        track_optimizer(opt)     # its state_dict() shards the experts' state like their parameters
    # (the bytes it steps are read only where some per-step layer's experts live in a storage larger than
    # themselves, a flat buffer: elsewhere a view of an expert parameter shares its version counter)
    watched = [layer for layer in layers if layer.config.weights == "per-step"]
    if any(layer not in marked for layer in watched) and any(_in_flat(p) for layer in watched
                                                            for p in layer.expert_params()):
        where = {id(p): (p, _extent(p)) for layer in layers for p in layer.expert_params()}
        # the storages of the expert parameters it holds; where it holds none, of those whose bytes it holds
        stepped = {ext[0] for p, ext in where.values() if ext is not None and own(p)}
        if not stepped:
            spans = _Spans(params)
            stepped = {ext[0] for p, ext in where.values() if ext is not None and spans.hits(p)}
        marked += [layer for layer in watched if layer not in marked
                   and any((ext := where[id(p)][1]) is not None and ext[0] in stepped for p in layer.expert_params())]
    attached = _attached(opt)
    for layer in marked:
        layer._forget_average()    # the step's averaging is done with
        if layer not in attached:
            layer.replicas.stepped = True


def _stepping(opt: torch.optim.Optimizer, *_: Any) -> None:
    """Before any ``optimizer.step()``: refused where it holds experts a drop-in's ``apply`` replaced (made before
    it: it would step tensors the model no longer uses, and the experts would never train), checked again when its
    parameter groups change; of an optimizer not yet tracked, the expert parameters' state it loaded as DTensors (a
    sharded state dict) made local."""
    count = sum(len(g["params"]) for g in opt.param_groups)
    if opt.__dict__.get("_feplb_checked") != count:
        problem = _replaced_problem(opt)
        if problem is not None:
            raise ValueError(f"{type(opt).__name__}.step(): {problem}")
        opt._feplb_checked = count
    if not opt.__dict__.get("_feplb_sharded"):
        localize_state(opt)


def _replaced_problem(opt: torch.optim.Optimizer) -> str | None:
    """Why ``opt`` cannot step a FEPLB model: it holds experts a drop-in's ``apply`` replaced; or None."""
    old = next((why for g in opt.param_groups for p in g["params"]
                if (why := getattr(p, "_feplb_replaced", None)) is not None), None)
    if old is None:
        return None
    return (f"this optimizer holds expert parameters from before {old} with FEPLB's (it was made before that "
            "call): it would step tensors the model no longer uses, and the experts would never train. Make the "
            "optimizer after apply")


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (whose ``step()`` steps it), else
    ``optimizer`` itself."""
    inner = getattr(optimizer, "optimizer", None)
    # (a torch.optim.Optimizer subclass that never ran Optimizer.__init__: it has no hooks of its own)
    if type(optimizer).__name__ == "AcceleratedOptimizer" and isinstance(inner, torch.optim.Optimizer):
        return inner
    return optimizer


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """``optimizer``, or the torch optimizer inside accelerate's ``AcceleratedOptimizer`` (whose ``step()`` steps
    it); anything else that is no ``torch.optim.Optimizer`` is refused, naming it (a wrapper whose step does more
    after its inner optimizer's, as Megatron's distributed optimizer all-gathers the new weights, would see its
    copies refreshed too early)."""
    inner = _inner_optimizer(optimizer)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"attach_optimizer: expected a torch.optim.Optimizer (or accelerate's AcceleratedOptimizer), got "
                    f"{type(optimizer).__name__}")


register_optimizer_step_post_hook(_stepped)
register_optimizer_step_pre_hook(_stepping)


def _versioned_unscale(unscale_grads: Callable) -> Callable:
    """``GradScaler._unscale_grads_`` that also bumps the version of every gradient it unscaled: its fused kernel
    (``_amp_foreach_non_finite_check_and_unscale_``) divides them in place without the version counter autograd
    keeps, so a scaler not attached to the optimizer, unscaling before ``reduce_replica_grads`` (the owners'
    gradients divided by the scale, the per-step copies' share still scaled), escaped the reduction's refusal of
    gradients changed in place, and the reduction added the copies' share at the scale, silently. (An attached
    scaler reduces before it unscales: the reduction after it finds nothing to add.)"""

    def unscale(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        out = unscale_grads(self, optimizer, *args, **kwargs)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.layout is torch.strided:
                    torch.autograd.graph.increment_version(p.grad)
        # (whether update counts this optimizer's inf checks: _counting_update)
        self.__dict__.setdefault("_feplb_counted", {})[id(optimizer)] = _counted_optimizer(self, optimizer)
        return out

    unscale._feplb_versioned = True   # type: ignore[attr-defined]
    return unscale


# The steps this process's torch.amp.GradScalers skipped (an inf or NaN found) where they step an optimizer holding
# a parameter of a live layer and attached to none (an attached scaler's check is agreed over the EP group already),
# by the scaler's device, counted on it (no host sync): every forward compares them over the EP ranks, those since the
# layer was made (feplb.steps.read_counts). Such a scaler skips where only some ranks saw an overflow (in their own
# experts' gradients, which that rank alone sees): the ranks then scale their losses apart, and every expert's
# gradient sums them. (Counting the optimizers' steps of each layer's experts told it only where every rank's
# optimizers held their experts alike: a rank whose experts were frozen and left out of its optimizer, ESFT's, or
# optimizers stepped per parameter, or an optimizer wrapping another, were refused as if a scaler had skipped.)
_SCALER_SKIPS: dict[torch.device, torch.Tensor] = {}


def scaler_skips(device: torch.device) -> torch.Tensor | None:
    """int64 [1] on ``device``: the steps this process's GradScalers skipped so far (None: none counted)."""
    if not _SCALER_SKIPS:
        return None
    # (a copy to the host waits for the device: a non-blocking one could be read before it lands)
    return sum(t.to(device, non_blocking=device.type != "cpu") for t in _SCALER_SKIPS.values())


def _counted_optimizer(scaler: Any, optimizer: Any) -> tuple[bool, bool]:
    """What ``scaler``'s unscale of ``optimizer`` notes for its ``update`` (``_counting_update``): (it holds a
    parameter of a live layer: its router's, or its experts', as a rank whose experts are frozen and left out still
    steps its router; its inf check is agreed over the EP group: the scaler was attached with it)."""
    agreed = isinstance(scaler, _ReducingScaler) and bool(_attached(_inner_optimizer(optimizer)))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return (any(id(p) in held for layer in list(_LAYERS) if not getattr(layer, "_closed", False)
                for p in layer.parameters()), agreed)


def _counting_update(update: Callable) -> Callable:
    """``GradScaler.update`` that first counts the step it ends as skipped (an inf found by any of its optimizers'
    checks: the same found_inf tensors ``update`` combines into the scale, on the scaler's device), where the scaler
    steps some optimizer holding a live layer's parameters and not every check of its was agreed over the EP group
    (``_counted_optimizer``, noted at each unscale): a scaler of another model, or of a probe on some ranks only, is
    none of the layers' business, and an attached scaler's checks are agreed already. Also where a new scale is
    given."""

    @functools.wraps(update)
    def counted(self: Any, new_scale: Any = None) -> Any:
        counted_ids = self.__dict__.pop("_feplb_counted", {})
        if getattr(self, "_enabled", False) and getattr(self, "_scale", None) is not None:
            notes = list(counted_ids.values())
            count = any(rel for rel, _ in notes) and not all(agr for _, agr in notes)
            found = [f for state in self._per_optimizer_states.values()
                     for f in state.get("found_inf_per_device", {}).values()] if count else []
            if found:
                dev = self._scale.device
                skipped = (sum(f.to(dev, non_blocking=True) for f in found) > 0).to(torch.int64).reshape(1)
                before = _SCALER_SKIPS.get(dev)
                _SCALER_SKIPS[dev] = skipped if before is None else before + skipped
        return update(self, new_scale)

    return counted


def _wrap_scaler_class(cls: type) -> None:
    """Wrap ``cls``'s own ``update`` (``_counting_update``) and ``_unscale_grads_`` (``_versioned_unscale``), where
    it defines them and they are not wrapped yet: torch's GradScaler, and a subclass defining its own (FSDP's
    ShardedGradScaler, whose checks are agreed over its own process group: counted all the same, as that group need
    not hold the EP group's ranks)."""
    update = cls.__dict__.get("update")
    if callable(update) and not getattr(update, "_feplb_counts_skips", False):
        cls.update = _counting_update(update)
        cls.update._feplb_counts_skips = True
    # (a private method of torch's: where a torch release renames it, nothing is wrapped, and such a loop goes as
    # before)
    unscale = cls.__dict__.get("_unscale_grads_")
    if callable(unscale) and not getattr(unscale, "_feplb_versioned", False):
        cls._unscale_grads_ = _versioned_unscale(unscale)


def _wrapping(method: Callable) -> Callable:
    """``GradScaler.__init__`` or ``__setstate__`` (unpickling) that first wraps the instance's classes defining their
    own ``update`` or ``_unscale_grads_`` (FSDP's ShardedGradScaler, whose ``__init__`` calls GradScaler's; a
    subclass of the user's), however late their module was imported: every such scaler's skips are counted."""

    @functools.wraps(method)
    def wrapping(self: Any, *args: Any, **kwargs: Any) -> Any:
        for cls in type(self).__mro__:
            if cls is torch.amp.GradScaler:
                break
            _wrap_scaler_class(cls)
        return method(self, *args, **kwargs)

    wrapping._feplb_wraps_subclasses = True   # type: ignore[attr-defined]
    return wrapping


# torch's GradScaler and the subclasses that exist already (a scaler made before feplb was imported); later ones as
# their scalers are made or unpickled
_SCALER_CLASSES = [torch.amp.GradScaler]
while _SCALER_CLASSES:
    _cls = _SCALER_CLASSES.pop()
    _wrap_scaler_class(_cls)
    _SCALER_CLASSES.extend(_cls.__subclasses__())
for _name in ("__init__", "__setstate__"):
    _method = torch.amp.GradScaler.__dict__.get(_name)
    if callable(_method) and not getattr(_method, "_feplb_wraps_subclasses", False):
        setattr(torch.amp.GradScaler, _name, _wrapping(_method))

# How deep this thread is inside calls that run collectives between a backward and the next forward: only the
# outermost one handshakes (a model's clip_grad_norm_ reduces every layer's replica gradients inside its own).
_CALLS = threading.local()
# The per-layer calls a loop makes for every layer in turn (layer.reduce_replica_grads(), ...): handshaken once per
# round over the EP group's layers until the group's next forward (forward_began), not once per layer; a layer
# calling again starts a new round (a second call on some ranks only meets the others' next forward).
# {id(group): {entry: the numbers (layer_id) of the layers that called it in this round}}
_PER_LAYER = (ENTRY_REDUCE, ENTRY_REFRESH, ENTRY_AVERAGE)
_SINCE_FORWARD: dict[int, dict[int, set[int]]] = {}
# {id(group): {(entry, layer_id) of every per-layer call made over the group since its last forward}}
_ROUND_CALLS: dict[int, set[tuple[int, int]]] = {}


def forward_began(group: Any) -> int:
    """A forward of a layer over ``group`` began (its counts all-gather): its per-layer calls handshake again.
    Returns the digest of the per-layer calls made over the group since its last forward (which call, for which
    layers; 0 for none), which that all-gather compares: each handshakes once per round, so a rank leaving out a
    layer's call is seen there only."""
    _SINCE_FORWARD.pop(id(group), None)
    calls = _ROUND_CALLS.pop(id(group), None)
    return args_digest(tuple(sorted(calls))) if calls else 0


@contextlib.contextmanager
def handshaken(layers: list[TrainingSteps], entry: int, *, force: bool = False,
               problem: int = 0, args: tuple = ()) -> Iterator[None]:
    """Run the block as a call between a backward and the next forward (``feplb.steps.ENTRIES``): where it is the
    outermost such call, it first handshakes once per EP group of ``layers`` (those over several ranks whose
    per-step calls are collective, or all with ``force``: the call itself runs collectives over their groups; the
    per-layer calls ``reduce_replica_grads``, ``refresh_replicas`` and ``average_expert_grads`` once per group
    until its next forward, however many layers a loop calls them for), so
    that a rank that skipped it, already in its next forward's counts all-gather, meets the others there and every
    rank raises together (``MoELayer._step_handshake``), instead of waiting in collectives the others never run.
    Covered: a rank whose next collective over the group is a FEPLB layer's forward or another of these calls. Not:
    a collective of its own before (a caller's dispatch before ``forward_dispatched``, DDP's buffer broadcast at
    the start of a forward, FSDP's all-gathers before the first FEPLB layer), a rank that skipped the backward
    (the others wait in its exchanges), ranks outside the group (EP x DP's data-parallel peers), or layers over
    different groups: there the ranks may still wait until the process group's timeout. ``args``: the call's
    arguments every rank must pass alike (``feplb.steps.ENTRY_ARGS``), refused on every rank where they differ."""
    groups = []
    if getattr(_CALLS, "depth", 0) == 0:
        settle_abandoned()   # (a backward that raised may have left exchanges on copy threads: they end first)
        mine = {x.layer_id for x in layers}   # (agreed over the group, never reused: an id() would be)
        for lay in layers:
            if lay.world_size > 1 and (force or lay._step_collective()) and not any(lay.group is g for g in groups):
                groups.append(lay.group)
                callers = _SINCE_FORWARD.setdefault(id(lay.group), {}).setdefault(entry, set())
                if entry in _PER_LAYER and callers and not callers & mine:
                    callers |= mine
                    continue    # (this call of another layer of the group handshook since its last forward)
                try:
                    lay._step_handshake(entry, problem, args_digest(args) if args else 0)
                except BaseException:
                    _forget_round(groups)   # (refused on every rank together: the round starts again)
                    raise
                callers.clear()
                callers |= mine
    try:
        with _inside():
            yield
    except BaseException:
        _forget_round(groups)
        raise
    if entry in _PER_LAYER:
        # (the next forward compares these: forward_began)
        for g in groups:
            _ROUND_CALLS.setdefault(id(g), set()).update((entry, x.layer_id) for x in layers if x.group is g)


def _forget_round(groups: list) -> None:
    """A per-step call over ``groups`` raised: the calls made since their last forward are no longer compared (a
    refusal raises on every rank together; a call raising on some ranks only is refused at the next forward by
    what it left undone)."""
    for g in groups:
        _ROUND_CALLS.pop(id(g), None)


def compare_over_replicas(layers: list[TrainingSteps], data_parallel_group: dist.ProcessGroup, row: list[int],
                          verdicts: Callable[[list[list[int]]], list[bool]],
                          op: str) -> tuple[list[list[int]], list[bool]]:
    """EP x DP's comparison of a call across the replicas: every rank's ``row`` of ints over ``data_parallel_group``
    (one all-gather, on the layers' device), then the ``verdicts`` this rank reads off that table agreed (their
    minimum) over each of the layers' EP groups, so that a rank whose replicas are in order still raises with an EP
    peer whose replicas are not. Returns (the table, the agreed verdicts)."""
    device = next((p.device for lay in layers for p in lay.expert_params()), torch.device("cpu"))
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(data_parallel_group))]
    with guard(op, data_parallel_group):
        dist.all_gather(parts, mine, group=data_parallel_group)
    table = torch.stack(parts).cpu().tolist()
    agreed = [int(v) for v in verdicts(table)]
    for lay in {id(lay.control): lay for lay in layers}.values():    # (each EP group's control plane once)
        got = lay.control.all_reduce_min(torch.tensor(agreed, dtype=torch.int64), "group", op).tolist()
        agreed = [min(a, g) for a, g in zip(agreed, got, strict=True)]
    return table, [bool(v) for v in agreed]


def prepare_and_compare(layers: list[TrainingSteps], data_parallel_group: dist.ProcessGroup, divide: bool) -> None:
    """Every layer's ``_average_prepare`` (its refusals, its replica gradients reduced), then the comparison over the
    data-parallel group, which also carries whether a replica refused: its error is raised there, and every other
    replica raises with it, before any sum (which a refusing replica would never reach)."""
    refused: BaseException | None = None
    try:
        for lay in layers:
            lay._average_prepare()
    except Exception as err:   # noqa: BLE001 - carried to the other replicas, then raised here
        refused = err
    check_dp_peers(layers, data_parallel_group, divide, refused=refused)


def check_dp_peers(layers: list[TrainingSteps], data_parallel_group: dist.ProcessGroup, divide: bool, *,
                   refused: BaseException | None = None) -> None:
    """Refuse, on every rank, an ``average_expert_grads`` whose data-parallel peers (the other EP groups' ranks holding
    these experts) pass another ``divide`` or hold gradients of other expert parameters (experts frozen in one
    replica only): the handshake compares the call over the EP group only, and the sums pair each rank's gradients
    with its peers' in order, so one replica dividing alone, or a gradient summed with another parameter's, would go
    on silently. One all-gather over the group for all of ``layers`` (a model's: one check per step, not one per
    layer), then the verdict agreed over each of their EP groups."""
    import hashlib

    params = [p for lay in layers for p in lay.expert_params()]
    flags = [int(p.grad is not None) for p in params]
    # (which of them hold one, as one int64: a bit each, or a digest where there are more than 62)
    held = sum(f << i for i, f in enumerate(flags)) if len(flags) <= 62 else \
        int(hashlib.sha256(bytes(flags)).hexdigest()[:15], 16)
    table, (agreed,) = compare_over_replicas(
        layers, data_parallel_group, [int(bool(divide)), len(params), sum(flags), held, int(refused is not None)],
        lambda t: [all(row == t[0] for row in t) and not t[0][4]],
        "average_expert_grads' comparison over data_parallel_group")
    same = all(row == table[0] for row in table) and not table[0][4]
    if refused is not None:
        raise refused
    ranks = dist.get_process_group_ranks(data_parallel_group)
    gave_up = [g for g, row in zip(ranks, table, strict=True) if row[4]]
    if gave_up:
        raise RuntimeError(f"MoELayer.average_expert_grads: the replica of global rank(s) {gave_up} refused the "
                           "call (its error says why; the replica gradients' reduction, say); nothing was summed, "
                           "on any rank")
    hint = "nothing was summed. Pass the same divide on every rank, and freeze the experts alike in every replica"
    if not same:
        names = []
        for lay in layers:
            name_of = {id(p): n for n, p in lay.named_parameters()}
            names += [name_of.get(id(p), f"expert parameter {i}") for i, p in enumerate(lay.expert_params())]

        def grads(n: int, count: int, mask: int) -> str:
            if n > 62 or n != len(params):
                return f"{count} of {n} expert parameters"
            return "[" + ", ".join(names[i] for i in range(n) if mask >> i & 1) + "]"

        rows = "; ".join(f"global rank {g}: divide={bool(d)}, gradients of {grads(n, c, h)}"
                         for g, (d, n, c, h, _) in zip(ranks, table, strict=True))
        raise ValueError("MoELayer.average_expert_grads: the ranks of data_parallel_group (the replicas of these "
                         f"experts) differ ({rows}); {hint}")
    if not agreed:
        raise ValueError("MoELayer.average_expert_grads: on another rank of this EP group, the ranks of its "
                         f"data_parallel_group differ in divide or in which expert parameters hold gradients; {hint}")


@contextlib.contextmanager
def averages_prepared() -> Iterator[None]:
    """Within: the layers' ``average_expert_grads`` leave out their own preparation and comparison over the
    data-parallel group (a model's call made them, :func:`prepare_and_compare`, for all its layers)."""
    before = getattr(_CALLS, "averages_prepared", False)
    _CALLS.averages_prepared = True
    try:
        yield
    finally:
        _CALLS.averages_prepared = before


def average_args(layers: list[TrainingSteps], data_parallel_group: dist.ProcessGroup | None,
                 divide: bool) -> tuple[tuple, int]:
    """What ``average_expert_grads`` agrees over the EP group: ``handshaken``'s ``args`` (``divide``, the size of
    the data-parallel group (each EP rank has its own, of other ranks; one of a single rank sums nothing, as None),
    and whether the group is new to one of ``layers``, whose first call checks it over its ranks) and ``problem``
    (``STEP_PROBLEM_BAD_DP_GROUP`` where the group cannot be this rank's: ``dp_group_problem``). A rank dividing
    alone, or summing over more ranks, would leave its experts' gradients at another scale than the others',
    silently: its handshake is forced under every policy."""
    grad_buffers = holds_grad_buffers(layers)
    if data_parallel_group is None:
        return (bool(divide), 1, False, grad_buffers), 0
    bad = dp_group_problem(layers, data_parallel_group) is not None
    new = not bad and any(lay._dp_key(data_parallel_group) not in lay.__dict__.get("_dp_checked", ())
                          for lay in layers)
    return ((bool(divide), dist.get_world_size(data_parallel_group), new, grad_buffers),
            STEP_PROBLEM_BAD_DP_GROUP if bad else 0)


def holds_grad_buffers(layers: list[TrainingSteps]) -> bool:
    """Whether the layers' expert parameters keep their gradients in Megatron DDP's buffers (``main_grad``, their
    ``.grad`` None): ``average_expert_grads`` and ``clip_grad_norm_``, which read ``.grad``, would find none and do
    nothing. Agreed in their handshakes' arguments, then refused on every rank."""
    return any(hasattr(p, "main_grad") and p.grad is None for lay in layers for p in lay.expert_params())


GRAD_BUFFERS_REFUSAL = ("the expert parameters keep their gradients in Megatron DDP's buffers (main_grad; their "
                        ".grad is None): this call reads .grad and would find nothing (a clipping norm of 0, nothing "
                        "averaged). Under Megatron's DDP, Megatron reduces, averages and clips them (its optimizer's "
                        "clip_grad: docs/megatron.md). Nothing was done, on any rank")


def dp_group_problem(layers: list[TrainingSteps], data_parallel_group: dist.ProcessGroup) -> str | None:
    """Why ``data_parallel_group`` cannot be this rank's EP x DP group for ``layers`` (it must hold this rank and,
    besides it, only ranks of other EP groups: those holding the same experts), or None. A group holding other
    ranks of a layer's own EP group (the world, the dense data-parallel group of a model whose experts are sharded
    over more ranks than its other parameters) would add other experts' gradients into each shard's, silently
    (the shards have one shape)."""
    me = dist.get_rank()
    try:
        ranks = set(dist.get_process_group_ranks(data_parallel_group))
    except (ValueError, RuntimeError, KeyError):
        ranks = set()
    if me not in ranks:
        return (f"it does not hold this rank (global rank {me}): a group made by dist.new_group without it is "
                "only a placeholder here")
    for lay in layers:
        ep = set(dist.get_process_group_ranks(lay.group if lay.group is not None else dist.group.WORLD))
        if ranks & ep != {me}:
            return (f"it holds global ranks {sorted(ranks & ep - {me})} of the layer's own EP group (global ranks "
                    f"{sorted(ep)}), which hold other experts")
    return None


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    """A call nested in another (its handshake done, or none due: the hooks of one optimizer step)."""
    _CALLS.depth = getattr(_CALLS, "depth", 0) + 1
    try:
        yield
    finally:
        _CALLS.depth -= 1


class TrainingSteps:
    """The layer's policy state (its history) and its methods around ``optimizer.step()`` (mixed into
    ``feplb.layer.MoELayer``)."""

    @property
    def state(self):
        """The policy's history (``feplb.sched.PolicyState``: load averages, dynamic sets, placement), or None for
        plain EP. Not in ``state_dict()``: save it beside (it pickles) and assign it back on every rank, then call
        ``refresh_replicas()``, which checks the ranks restored the same one. A history assigned must be of this
        layer's topology and policy, with the config's ``refresh_every`` and ``replicas`` (ValueError otherwise);
        its other settings (``ema_shift``, ``eplb_slots``, ``eplb_groups``, ``place_min_gain``) are the layer's
        from then on."""
        return self.__dict__.get("_policy_state")

    @state.setter
    def state(self, value) -> None:
        problem = self._state_problem(value)
        if problem is not None:
            raise ValueError(f"MoELayer.state: {problem}; the layer keeps its own")
        self.__dict__["_policy_state"] = value

    def _state_problem(self, value) -> str | None:
        """Why ``value`` cannot be this layer's policy state (a state of another layer's topology or policy: a
        checkpoint of another EP size, say), or None."""
        from feplb.sched.plan import parse_policy
        from feplb.sched.state import PolicyState

        needs = self.base != "none" or self.place
        if value is None:
            return None if not needs else f"policy {self.config.policy!r} needs a PolicyState, got None"
        if not isinstance(value, PolicyState):
            return f"expected a feplb.sched.PolicyState, got {type(value).__name__}"
        if not needs:
            return f"policy {self.config.policy!r} keeps no state (None), got a PolicyState"
        if value.topo != self.topo:
            return f"the state was made for {value.topo}, this layer's topology is {self.topo}"
        if value.policy != self.config.policy and parse_policy(value.policy) != parse_policy(self.config.policy):
            return f"the state serves policy {value.policy!r}, this layer runs {self.config.policy!r}"
        # the history's settings that are the config's too (the others, ema_shift, eplb_slots, ..., have no field
        # there: a history assigned is how they are set)
        differ = [f"{k}={getattr(value, k)!r} (FEPLBConfig.{f}={getattr(self.config, f)!r})"
                  for k, f in (("refresh_every", "refresh_every"), ("replicas_mode", "replicas"))
                  if getattr(value, k) != getattr(self.config, f)]
        if differ:
            return "the state's " + ", ".join(differ) + " differ from the layer's config"
        return None

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None, *,
                         average_required: bool | None = None) -> None:
        """Reduce replica gradients before and refresh the replicas after every ``optimizer.step()`` (per-step
        weights), so no optimizer, fused or not, can leave stale copies behind. Collective at every step. The
        optimizer's ``zero_grad()`` then also drops the copies' gradients (``zero_replica_grads``), so a backward
        the training loop discards (a skipped step) never reaches the owners. Attaching twice does nothing more.

        scaler: the ``torch.amp.GradScaler`` that steps ``optimizer``, if one does. Its ``unscale_(optimizer)`` and
        ``step(optimizer)`` then reduce the replica gradients first, so that they are unscaled and checked for
        inf / NaN with the owners' (a step hook runs too late: inside ``optimizer.step()``, after both). Without
        it, under a balancing policy, a scaler stepping the optimizer is refused at its first step, on every rank
        (found in the step's callers; the step's handshake carries it). That handshake, the step's first
        collective, is shaped like the forward's counts all-gather: a rank whose step was skipped (by the scaler,
        or the loop) meets it in its next forward, and every rank raises together.

        accelerate's ``AcceleratedOptimizer`` is taken for the torch optimizer it steps, with its GradScaler when
        ``scaler`` is not given; another object that is no
        ``torch.optim.Optimizer`` is refused, and so is an optimizer holding experts a drop-in's ``apply`` replaced
        (made before it: the experts would never train).

        average_required: the loop averages the replicated parameters' gradients over the ranks (DDP, FSDP's
        default), so each step of ``optimizer`` (on several processes) is refused, on every rank, where the experts
        hold gradients ``average_expert_grads`` did not divide since the step's last backward: forgotten, called
        after the step, or before the last backward of an accumulation (their share would stay summed over the EP
        group, W times the mean). None: for accelerate's ``AcceleratedOptimizer`` (accelerate's DDP averages), not
        for a torch optimizer (its loop may sum). A step of ``torch.distributed.checkpoint``'s state
        initialisation (an empty state, learning rates 0) is let through."""
        accelerated = type(optimizer).__name__ == "AcceleratedOptimizer"
        if scaler is None and accelerated:
            # accelerate's prepared optimizer steps through its GradScaler (fp16): attached with it, or a step it
            # skipped on one rank only would leave the others in this attachment's step collectives
            scaler = getattr(optimizer, "scaler", None)
        keyed = optimizer     # (the object the scaler keys its per-optimizer state by)
        optimizer = _torch_optimizer(optimizer)
        problem = _replaced_problem(optimizer)
        if problem is not None:
            raise ValueError(f"MoELayer.attach_optimizer: {problem}")
        if scaler is not None:
            if not isinstance(scaler, torch.amp.GradScaler):
                raise TypeError(f"MoELayer.attach_optimizer: scaler must be a torch.amp.GradScaler, got "
                                f"{type(scaler).__name__}")
            _reduce_before_unscale(scaler)
            # (keyed by the object its unscale_ is given: accelerate's loop gives the torch optimizer, a plain
            # loop the object it attached; both are looked up)
            scalers = self.__dict__.setdefault("_scalers", [])
            for key in {id(keyed): keyed, id(optimizer): optimizer}.values():
                if not any(sr() is scaler and kr() is key for sr, kr in scalers):
                    scalers.append((weakref.ref(scaler), weakref.ref(key)))
        if average_required is not None:
            optimizer._feplb_average_required = average_required
        else:     # (the default decides once: a later attach of another layer keeps an explicit choice)
            optimizer.__dict__.setdefault("_feplb_average_required", accelerated)
        if optimizer._feplb_average_required:
            self._watch_after_average()
        if self in _attached(optimizer):
            return
        _attach(optimizer, self)    # (first: its step handshake is the optimizer's first pre-hook)
        self._hooks += [optimizer.register_step_pre_hook(self._reduce_in_step),
                        optimizer.register_step_post_hook(lambda *_: self._refresh_in_step())]
        self.__dict__.setdefault("_attached_to", weakref.WeakSet()).add(optimizer)

    def _step_collective(self) -> bool:
        """Whether the attached optimizer's step runs collectives of this layer (a balancing or placing policy
        over several ranks: the replica gradients' reduction, the refresh and its agreements)."""
        return self.world_size > 1 and (self.base != "none" or bool(self.place))

    def _refresh_in_step(self) -> None:
        """``refresh_replicas()`` from the step post-hook: the step's handshake ran in its pre-hook."""
        with _inside():
            self.refresh_replicas()

    def _reduce_in_step(self, optimizer: torch.optim.Optimizer, args: tuple = (), kwargs: dict | None = None,
                        ) -> tuple[tuple, dict] | None:
        """``reduce_replica_grads()`` from the step pre-hook. A GradScaler stepping a fused optimizer has set
        ``found_inf`` by then, from the owners' gradients alone: copies still holding gradients there would be
        stepped scaled (non-finite ones unseen), so that raises on every rank. A step given a closure
        (``optimizer.step(closure)``, LBFGS's only form) runs its backward inside the step: the closure is
        wrapped to refresh the copies before each call of it (the step may have moved the weights since) and to
        reduce after it (``args[0]`` is the optimizer, as torch passes it)."""
        self._reduce_before_step(optimizer)
        if self.replicas.ever_held:     # (copies are held with per-step weights only)
            # the step's post-hook refreshes the copies; a step or step hook raising before it leaves them stale
            self.replicas.unfinished = True
        kwargs = dict(kwargs or {})
        in_kwargs = kwargs.get("closure") is not None
        closure = kwargs["closure"] if in_kwargs else args[1] if len(args) > 1 else None
        if closure is None:
            return None

        def reducing_closure(closure=closure):
            with _inside():      # (the step's handshake ran in its pre-hook)
                # the step may have moved the weights before this call (LBFGS's later evaluations, SAM's
                # perturbation): the copies are made again from them first
                self.refresh_replicas()
            loss = closure()
            with _inside():
                self._reduce_replica_grads(None)
            return loss

        if in_kwargs:
            kwargs["closure"] = reducing_closure
        else:
            args = (args[0], reducing_closure, *args[2:])
        return args, kwargs

    def _reduce_before_step(self, optimizer: torch.optim.Optimizer) -> None:
        scaled = hasattr(optimizer, "found_inf")
        try:
            self._reduce_replica_grads(
                None if not scaled else
                "a torch.amp.GradScaler unscaled and checked the gradients before the replica gradients were "
                "reduced into them; pass the scaler: attach_optimizer(optimizer, scaler=scaler)")
        except BaseException:
            if scaled:   # GradScaler.step removes them only after a step; a retry would multiply the scale again
                optimizer.__dict__.pop("grad_scale", None)
                optimizer.__dict__.pop("found_inf", None)
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and ``zero_replica_grads()``."""
        super().zero_grad(set_to_none)
        self.zero_replica_grads()

    def zero_replica_grads(self) -> None:
        """Drop the gradients accumulated on per-step expert copies since the last ``reduce_replica_grads()``
        (local). They are not parameters: ``optimizer.zero_grad()`` and ``model.zero_grad()`` do not reach them,
        and the next reduction would add them to the owners. Call it wherever the training loop discards the
        experts' gradients without a step (``layer.zero_grad()`` and an attached optimizer's ``zero_grad()`` do)."""
        self.replicas.zero_grads()
        self._forget_average()
        self.__dict__.pop("_averaged_grads", None)     # (the experts' gradients are dropped with the copies')
        self.__dict__.pop("_grad_after_average", None)

    def _grads_dropped(self) -> bool:
        """Whether the experts' gradients were dropped (``zero_grad(set_to_none=True)``: the model's, or an optimizer's
        not attached to the layer), or changed in place (``zero_grad(set_to_none=False)``, any in-place op), while
        this rank's per-step copies still hold their share of the backward those came from: a backward the training
        loop discarded, whose copies' share the next reduction would add to the next step's gradients, or gradients
        the loop scaled or zeroed while the copies' share was left as it was. (After a backward every expert
        parameter the GEMMs read holds a gradient, a zero one where no row reached it; each accumulation's result
        is noted, its tensor and version, by a hook, and a tensor of that version no more means that something
        wrote it in place since; under a ``+place`` bank, which the GEMMs read instead of the owners' parameters,
        these hold a zero gradient until the reduction, noted alike (``_hold_zero_grads``). Megatron's
        DistributedDataParallel keeps them in ``main_grad``, whose zeroing ``feplb.megatron`` marks
        (``_grad_buffers_zeroed``).) Local; every forward."""
        rep = self.replicas
        # (an evaluation forward between is left alone; a training one without autograd is checked: a reentrant
        # checkpoint's forward, whose recompute adds to the copies' gradients)
        evaluation = not self.training and not torch.is_grad_enabled()
        own = [p for p in self.expert_params() if p.requires_grad and not hasattr(p, "main_grad")]
        if not rep.ever_held:
            # (watched already: lazy replicas are first held inside this forward, whose backward's accumulations
            # must be noted for the reduction to tell an in-place change after them (a scaling, an unscale))
            if self.config.weights == "per-step" and self.base != "none":
                self._watch_accumulated(own)
            return False
        self._watch_accumulated(own)
        if not evaluation and rep.grads_clean():
            # nothing held: whatever the owners' gradients are now is where the copies' next share starts from.
            # A parameter frozen through the step's first micro-batches (no accumulation notes it) would otherwise
            # keep the note of an earlier step, whose tensor a reduction or a zero_grad(set_to_none=False) has
            # written since, and be taken for dropped once unfrozen
            self._note_current_grads()
            self.__dict__.pop("_grad_buffers_zeroed", None)
            return False
        if evaluation:
            return False
        if self.__dict__.get("_grad_buffers_zeroed"):   # (Megatron's zero_grad_buffer: feplb.megatron)
            return True
        if not own:
            return False
        # (judged: the parameters noted since, by an accumulation or that note; one frozen all along and unfrozen
        # now has no gradient as plain EP's has none, and nothing of the copies' share is its)
        marks = self.__dict__.get("_accumulated", {})
        # Gradients that share one version counter: where the forward stacked several parameters (Megatron's
        # per-expert biases, say), the first backward's accumulation keeps the stack's gradient's slices, views of
        # one storage, as the parameters' .grad, and every later accumulation into any of them bumps the counter
        # of all. Each is then judged by the last accumulation noted into its storage.
        latest: dict[int, int] = {}
        for p in own:
            mark = marks.get(p)
            if mark is not None and p.grad is not None and mark[0]() is p.grad:
                key = p.grad.untyped_storage().data_ptr()
                latest[key] = max(latest.get(key, mark[1]), mark[1])
        for p in own:
            mark = marks.get(p)
            if mark is None:
                continue
            if p.grad is None:
                return True
            if mark[0]() is p.grad and p.grad._version not in (mark[1],
                                                               latest.get(p.grad.untyped_storage().data_ptr())):
                return True
        return False

    def _note_current_grads(self) -> None:
        """Note every watched expert parameter's gradient as it is now (tensor and version; none where it has
        none), as an accumulation would (``_grads_dropped``, while no copy holds a gradient). Local."""
        marks = self.__dict__.get("_accumulated")
        if marks is None:
            return
        for p in self.expert_params():
            if p.grad is None or hasattr(p, "main_grad"):
                marks.pop(p, None)
            elif p in self._accumulated_hooked:
                marks[p] = (weakref.ref(p.grad), p.grad._version)

    @torch.no_grad()
    def _hold_zero_grads(self) -> None:
        """Under a ``+place`` bank with per-step weights the GEMMs read the bank, not the owner's expert parameters,
        which get the step's gradient only at the reduction (``reduce_replica_grads``). From the step's first
        backward until then (a post-accumulate hook of the bank's leaves calls this) each of them that trained
        holds a zero gradient, as plain EP's hold theirs after a backward, noted as an accumulation is: a loop
        that drops it (a model's ``zero_grad``) or changes it in place (torch's clipping, a scaling) before the
        reduction is then refused (``_grads_dropped``) instead of the bank's share being added unchanged, and the
        reduction adds into it (also what a write through ``.data``, which no version counter sees, put there, as
        plain EP's gradient would keep it). Local."""
        trained = self.replicas.trained
        params = [p for i, p in enumerate(self.expert_params())
                  if p.grad is None and p.requires_grad and i in trained and not hasattr(p, "main_grad")]
        if not params:
            return
        self._watch_accumulated(params)
        for p in params:
            p.grad = torch.zeros_like(p)
            self._accumulated[p] = (weakref.ref(p.grad), p.grad._version)

    def _watch_accumulated(self, params: list) -> None:
        """Note, after every accumulation into an expert parameter's gradient, that tensor and its version
        (``_grads_dropped``): a hook on each of ``params`` (which require grad) not yet watched (from the first
        forward with per-step copies on, before its backward; one unfrozen or replaced later, at the next)."""
        hooked = self.__dict__.get("_accumulated_hooked")
        if hooked is None:
            from torch.utils.weak import WeakIdKeyDictionary

            # (parameters by identity: a tensor's == is elementwise)
            self._accumulated = WeakIdKeyDictionary()
            self._accumulated_hooked = hooked = WeakIdKeyDictionary()
        new = [p for p in params if p not in hooked]
        if not new:
            return
        ref = weakref.ref(self)

        def accumulated(p: torch.Tensor) -> None:
            lay = ref()
            if lay is not None and p.grad is not None:
                lay._accumulated[p] = (weakref.ref(p.grad), p.grad._version)

        for p in new:
            self._hooks.append(p.register_post_accumulate_grad_hook(accumulated))
            hooked[p] = True

    def _adopt(self, state) -> None:
        """Execute the slow decisions of ``state`` from now on (placement, @ema sets, EPLB replicas)."""
        if self.config.weights == "per-microbatch" and state is not None and state.resident:
            state = dataclasses.replace(state, resident=frozenset())   # nothing is held: plans copy every weight
        self._plan_state = state
        if self.place and not np.array_equal(state.home_E, self.placement.home_E):
            self._set_placement(state.home_E)

    @torch.no_grad()
    def refresh_replicas(self) -> None:
        """Adopt the policy's slow decisions and copy the owners' current expert weights to the GPUs that hold
        them besides their owner (collective; weights='per-step').

        Call after ``optimizer.step()`` (and after loading weights), or let ``attach_optimizer`` do it. Adopted here,
        identically on every rank: the ``+place`` placement (each GPU then keeps a bank of the experts placed on
        it), the ``@ema`` dynamic sets and EPLB replicas, and the resident replicas the policy state names
        (``PolicyState.resident``); a plan copies every other weight it needs per micro-batch
        (``Plan.weight_copies``, executed as given). The copies lazy replicas held over the step are let go.
        """
        with handshaken([self], ENTRY_REFRESH):
            self._refresh_replicas()

    def _refresh_replicas(self) -> None:
        self._forget_average()     # (after a step: the next average_expert_grads is the next step's)
        if self.replicas.ever_held:     # (copies are held with per-step weights only)
            # Unfinished until Replicas.refresh completes: one that raises part way leaves banks dropped or never
            # received, and the next forward must refuse them rather than compute with the owners' own weights in
            # their place (a layer that never held copies has none to leave stale; Replicas.refresh marks the first
            # it makes).
            self.replicas.unfinished = True
            # Agreed over the group, so that no rank enters the refresh exchange while another raises.
            self.replicas.agree("refresh_replicas")   # (raises where gradients were lost or left)
        if self.state is not None:
            # e.g. a state restored from a checkpoint: every rank must adopt the same slow decisions
            self.control.check_same(state_digest(self.state), "the policy state (MoELayer.state)",
                                    "every rank must restore the same PolicyState (same checkpoint step)")
            self._adopt(self.state)
        if self.config.weights != "per-step":
            return
        resident = self._plan_state.resident if self._plan_state is not None and self.base != "none" else frozenset()
        self.replicas.refresh(self.placement, frozenset(resident) if self.world_size > 1 else frozenset())

    @torch.no_grad()
    def reduce_replica_grads(self) -> None:
        """Add the gradients accumulated on per-step copies (resident replicas, the bank of placed experts, the
        copies lazy replicas hold) to the owners' expert gradients (collective; weights='per-step'). Call once per
        optimizer step, after the last backward and before ``optimizer.step()`` (``attach_optimizer`` does it for
        you); a second call before the next backward finds nothing to add and sends nothing."""
        with handshaken([self], ENTRY_REDUCE):
            self._reduce_replica_grads(None)

    def _reduce_replica_grads(self, refuse_held: str | None) -> None:
        if not self.replicas.ever_held:
            return
        # one collective agrees on all: whether any copy holds a gradient, whether the owners' gradients are as the
        # backward left them, and which copies a forward used
        rep = self.replicas
        frozen = self._backward_flags_vector()
        nf = 1 + frozen.numel()
        clean, flags = rep.agree("reduce_replica_grads", torch.cat([
            torch.tensor([int(not self._grads_dropped())], dtype=torch.int64), frozen,
            rep.idle_flags(self.placement)]))
        apart = self._backward_flags_apart(flags[1:nf]) if nf > 1 else []
        # (every rank passes here together, also where nothing is reduced: the next reduction compares the backwards
        # after this one only, whatever a rank's local zero_replica_grads() reset meanwhile)
        rep.backward_flags = 0
        if apart:
            raise RuntimeError(
                f"MoELayer.reduce_replica_grads: the expert parameters of EP ranks {apart[0]} differed in which of "
                "them require grad at a backward since the last reduction (some rank froze or unfroze its experts "
                "between a forward and its backward, the others not), and this layer keeps per-step copies of experts "
                "across those ranks: a copy's gradient follows its holder's flags, so a share of an expert's "
                "gradient was lost or left. Nothing was reduced or stepped. Discard the step's gradients (zero_grad() "
                "of an attached optimizer, or layer.zero_grad()) and run it again with the experts frozen alike on "
                "every EP rank, or use weights='per-microbatch'")
        if clean:
            return                      # no rank's copies hold a gradient
        if refuse_held is not None:
            raise RuntimeError(f"MoELayer.reduce_replica_grads: {refuse_held}")
        if int(flags[0]) == 0:
            raise RuntimeError(
                "MoELayer.reduce_replica_grads: on some EP rank the experts' gradients were changed in place "
                "(torch.nn.utils.clip_grad_value_ or clip_grad_norm_, a scaling, zero_grad(set_to_none=False)) or "
                "dropped after the backward, while the per-step copies still hold their share of it, which the "
                "reduction would add unchanged. Nothing was reduced or stepped. Reduce first, then change them: "
                "feplb.clip_grad_norm_(model, ...) (it reduces), or layer.reduce_replica_grads() before "
                "clip_grad_value_ or any scaling; here zero the gradients (an attached optimizer's zero_grad(), "
                "layer.zero_grad()) and run the step again from its backward")
        rep.reduce_grads(self.placement, flags[nf:])

    @torch.no_grad()
    def average_expert_grads(self, data_parallel_group: dist.ProcessGroup | None = None, *,
                             divide: bool = True) -> None:
        """Make the expert shards' gradients the mean over every rank that trains on its own data (collective):
        reduce the replica gradients (``reduce_replica_grads``), sum each shard's gradient over
        ``data_parallel_group`` if given (EP x DP: the ranks that hold the same experts, one per EP group), and
        divide by the number of such ranks (EP group size x data-parallel group size). The dispatch's backward
        leaves the sum over the EP group's ranks; DDP or FSDP averaging the replicated parameters (the router) over
        all of those ranks then trains the mean of their losses.

        divide=False: the sum over those ranks instead, where the replicated parameters' gradients are summed too
        (torchtitan's convention: its FSDP does not divide, and the loss is scaled by the global token count); with
        the EP group all the ranks, the dispatch's backward already leaves that sum, and only the replicas'
        gradients are reduced.

        Once per optimizer step, after the last backward
        and before clipping and ``optimizer.step()``. A second call before the step would divide again (after
        another backward of an accumulation, the first micro-batches' share twice): refused while an expert
        parameter still holds the gradient tensor the last call divided and no optimizer step (of any optimizer
        holding the experts), ``zero_replica_grads()`` (an attached optimizer's ``zero_grad()``, ``layer.zero_grad()``)
        or ``refresh_replicas()`` came between; zeroing with ``set_to_none=True`` makes new tensors."""
        args, problem = average_args([self], data_parallel_group, divide)
        with handshaken([self], ENTRY_AVERAGE, force=True, problem=problem, args=args):
            self._average_expert_grads(data_parallel_group, divide)

    def _average_expert_grads(self, data_parallel_group: dist.ProcessGroup | None, divide: bool = True) -> None:
        if data_parallel_group is not None:
            self._check_dp_group(data_parallel_group)
        if getattr(_CALLS, "averages_prepared", False):
            pass    # (the model's call prepared, and compared, every layer before summing any)
        elif data_parallel_group is None:
            self._average_prepare()
        else:
            prepare_and_compare([self], data_parallel_group, divide)
        self._average_sum(data_parallel_group, divide)

    def _average_prepare(self) -> None:
        """What comes before any sum over the data-parallel group (this rank's refusals, and the replica gradients
        reduced over the EP group: collective there)."""
        if holds_grad_buffers([self]):   # (agreed in the handshake's arguments: every rank raises)
            raise ValueError(f"MoELayer.average_expert_grads: {GRAD_BUFFERS_REFUSAL}")
        done = self.__dict__.get("_averaged")
        if done is not None and self._same_grads(done):
            raise RuntimeError("MoELayer.average_expert_grads: called again before the optimizer step, on the "
                               "gradients it already averaged (or summed, divide=False); call it once per step, "
                               "after the step's last backward (with accelerate: under `if "
                               "accelerator.sync_gradients:`, not after every backward of an accumulation). (A step "
                               "a GradScaler skipped, then gradients zeroed in place, looks the same where the "
                               "scaler is not attached (attach_optimizer(optimizer, scaler=scaler)): zero them with "
                               "set_to_none=True, or call zero_replica_grads() after)")
        self.reduce_replica_grads()

    def _average_sum(self, data_parallel_group: dist.ProcessGroup | None, divide: bool) -> None:
        ranks = self.world_size * (dist.get_world_size(data_parallel_group) if data_parallel_group is not None
                                   else 1)
        for p in self.expert_params():
            if p.grad is not None:
                if data_parallel_group is not None:
                    with guard("average_expert_grads' sum over data_parallel_group", data_parallel_group):
                        dist.all_reduce(p.grad, group=data_parallel_group)
                if divide:
                    p.grad.div_(ranks)
        if data_parallel_group is not None:
            self._agree_unscaled_overflow(data_parallel_group)
        # (the replicas' group, which feplb.clip_grad_norm_ compares its call over: None without one)
        self.__dict__["_dp_group_used"] = data_parallel_group
        self._averaged = [None if p.grad is None else weakref.ref(p.grad) for p in self.expert_params()]
        # what the steps of an optimizer attached with average_required check: unlike the mark above, which a step
        # ends (the next call is the next step's), it holds for every optimizer stepping these gradients
        self._averaged_grads = self._averaged
        self.__dict__.pop("_grad_after_average", None)
        if "_watching_average" in self.__dict__ or data_parallel_group is not None:
            # (an expert parameter unfrozen since the attach gets its hook too; under EP x DP, clip_grad_norm_ reads
            # the mark, so gradients zeroed in place, the same tensors, are not taken for averaged ones after a
            # backward)
            self._watch_after_average()

    def _dp_key(self, data_parallel_group: dist.ProcessGroup) -> tuple[int, ...]:
        """``_dp_checked``'s key of a data-parallel group: its global ranks."""
        return tuple(dist.get_process_group_ranks(data_parallel_group))

    def _check_dp_group(self, data_parallel_group: dist.ProcessGroup) -> None:
        """Refuse a data-parallel group that cannot be EP x DP's (``dp_group_problem``; the handshake refused it on
        every rank already, unless another layer's call of the group handshook for it), and, the first time this
        layer meets it, one whose ranks hold other experts than this one: another position in their EP group, of
        another size or over another number of experts (the data-parallel groups made across the EP groups' ranks
        in another order). That check gathers over the group, then agrees over the EP group: every rank raises
        together (the ranks that meet in a group or an EP group all raise where one does)."""
        problem = dp_group_problem([self], data_parallel_group)
        if problem is not None:
            raise ValueError(f"MoELayer.average_expert_grads: data_parallel_group cannot be this rank's: {problem}. "
                             f"{DP_GROUP_HINT}")
        key = self._dp_key(data_parallel_group)
        checked = self.__dict__.setdefault("_dp_checked", set())
        if key in checked:
            return
        table, (agreed,) = compare_over_replicas(
            [self], data_parallel_group, [self.rank, self.world_size, self.config.num_experts],
            lambda t: [all(row == t[0] for row in t)], "average_expert_grads' check of data_parallel_group")
        if any(row != table[0] for row in table):
            held = "; ".join(f"global rank {g}: EP rank {r} of {w}, {e} experts"
                             for g, (r, w, e) in zip(key, table, strict=True))
            raise ValueError("MoELayer.average_expert_grads: the ranks of data_parallel_group hold other experts "
                             f"({held}); nothing was summed. {DP_GROUP_HINT}")
        if not agreed:
            raise ValueError("MoELayer.average_expert_grads: on another rank of this EP group, the ranks of its "
                             "data_parallel_group hold other experts; nothing was summed. " + DP_GROUP_HINT)
        checked.add(key)

    def _agree_unscaled_overflow(self, data_parallel_group: dist.ProcessGroup) -> None:
        """An attached GradScaler that already unscaled this step (a loop calling ``scaler.unscale_`` before
        ``average_expert_grads``) checked for inf / NaN before the sum over ``data_parallel_group`` brought in the
        data-parallel peers' gradients, and agreed on it over the EP group only: an overflow in one EP group's
        experts would then skip the step there and step inf into the other replicas' experts, their scales apart.
        Agree the check over the data-parallel group too (after the EP agreement every EP group's ranks agree, and
        every data-parallel group holds one rank of each EP group, so a maximum over it is every rank's)."""
        from torch.amp.grad_scaler import OptState

        for sref, oref in self.__dict__.get("_scalers", ()):
            scaler, opt = sref(), oref()
            if scaler is None or opt is None or not scaler.is_enabled():
                continue
            state = scaler._per_optimizer_states.get(id(opt))   # (a defaultdict: .get adds nothing)
            if not state or state.get("stage") is not OptState.UNSCALED:
                continue
            per_device = state["found_inf_per_device"]
            device = next(iter(per_device)) if per_device else scaler._scale.device
            bad = torch.tensor([float(any(bool(v.item()) for v in per_device.values()))], device=device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=data_parallel_group)
            if bool(bad.item()):
                for v in per_device.values():
                    v.fill_(1.0)
                if not per_device:
                    per_device[device] = torch.ones((), dtype=torch.float32, device=device)

    def _forget_average(self) -> None:
        """The step's averaging is over (a step, zeroed gradients, a refresh): the next call is the next step's."""
        self.__dict__.pop("_averaged", None)

    def _not_averaged(self) -> bool:
        """Whether the expert gradients reach an optimizer step undivided: held, and ``average_expert_grads`` not
        called on them since the last backward (no mark, new gradient tensors, or a backward that accumulated into
        them after it: ``_watch_after_average``)."""
        if not any(p.grad is not None for p in self.expert_params()):
            return False
        mark = self.__dict__.get("_averaged_grads")
        return mark is None or not self._same_grads(mark) or bool(self.__dict__.get("_grad_after_average"))

    def _watch_after_average(self) -> None:
        """Mark a backward that accumulates into the expert gradients after ``average_expert_grads`` divided them
        (its share would stay summed): a hook on each expert parameter that requires a gradient, once (frozen
        ones, as under PEFT's LoRA on other modules, get none, and torch refuses a hook on them: hooked once
        unfrozen, at the next ``average_expert_grads``, before any backward after it)."""
        from torch.utils.weak import WeakIdKeyDictionary

        hooked = self.__dict__.get("_watching_average")
        if hooked is None:
            hooked = self._watching_average = WeakIdKeyDictionary()
        todo = [p for p in self.expert_params() if p.requires_grad and p not in hooked]
        if not todo:
            return
        ref = weakref.ref(self)

        def after_accumulate(_: torch.Tensor) -> None:
            lay = ref()
            if lay is not None and "_averaged_grads" in lay.__dict__:
                lay._grad_after_average = True

        self._hooks += [p.register_post_accumulate_grad_hook(after_accumulate) for p in todo]
        for p in todo:
            hooked[p] = True

    def _same_grads(self, mark: list) -> bool:
        """Whether an expert parameter holds the very gradient tensor ``mark`` saw (not a new one, as a backward
        after zeroing with ``set_to_none=True`` makes)."""
        return any(m is not None and p.grad is not None and m() is p.grad
                   for p, m in zip(self.expert_params(), mark, strict=True))


def _attached(optimizer: torch.optim.Optimizer) -> list[TrainingSteps]:
    """The live layers attached to ``optimizer``, in the order they were attached (the same on every rank: the
    order their collectives run in)."""
    return [lay for ref in optimizer.__dict__.get("_feplb_layers", ())
            if (lay := ref()) is not None and not getattr(lay, "_closed", False)]


def _attach(optimizer: torch.optim.Optimizer, layer: TrainingSteps) -> None:
    """Remember ``layer`` on ``optimizer`` (weakly: the optimizer itself, not its id, which a later optimizer may
    reuse), and make ``optimizer.zero_grad()`` also call ``zero_replica_grads()`` of its layers (one wrapper per
    optimizer)."""
    refs = optimizer.__dict__.get("_feplb_layers")
    if refs is None:
        refs = []
        inner = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            inner(set_to_none)
            for lay in _attached(optimizer_ref()):
                lay.zero_replica_grads()

        optimizer_ref = weakref.ref(optimizer)
        zero_grad.__doc__ = inner.__doc__
        optimizer._feplb_layers = refs
        optimizer.zero_grad = zero_grad
        optimizer.register_step_pre_hook(lambda opt, *_: _step_handshake(opt))
    refs[:] = [r for r in refs if r() is not None] + [weakref.ref(layer)]
    track_optimizer(optimizer)     # its state_dict() shards the experts' state like their parameters


def _step_handshake(optimizer: torch.optim.Optimizer) -> None:
    """Before the step of an optimizer with attached layers whose step is collective: one handshake per EP group
    (``MoELayer._step_handshake``), before any other collective of the step, carrying whether a GradScaler not
    attached with it is stepping it. A rank whose step was skipped meets it in its next forward, and every rank
    raises together instead of waiting in collectives the others never run."""
    if getattr(_CALLS, "depth", 0):
        return      # inside an attached GradScaler's step, which handshook
    layers = [lay for lay in _attached(optimizer) if lay._step_collective()]
    problem = _average_problem(optimizer, handshaking=bool(layers))
    if not layers:
        return
    scaler = _stepping_scaler()
    if scaler is not None and scaler.is_enabled() and not isinstance(scaler, _ReducingScaler):
        problem |= STEP_PROBLEM_UNATTACHED_SCALER
    try:
        with handshaken(layers, ENTRY_STEP, problem=problem):   # (in the order attached: the same on every rank)
            pass
    except BaseException:
        # a fused optimizer's GradScaler removes them only after a step; a retry would multiply the scale again
        optimizer.__dict__.pop("grad_scale", None)
        optimizer.__dict__.pop("found_inf", None)
        if scaler is not None and scaler.is_enabled():
            # nothing was stepped: the scaler's record of having unscaled this optimizer's gradients goes too, or a
            # step redone from its backward would skip the unscaling and step scaled gradients
            scaler._per_optimizer_states[id(optimizer)] = torch.amp.grad_scaler._refresh_per_optimizer_state()
        raise


def _average_problem(optimizer: torch.optim.Optimizer, *, handshaking: bool) -> int:
    """``STEP_PROBLEM_NOT_AVERAGED`` where ``optimizer`` was attached with ``average_required`` and an attached
    layer's expert gradients reach its step undivided (several processes only), else 0; raised here, on this rank,
    where no handshake follows to agree it (no layer's step is collective: every rank sees alike)."""
    if not optimizer.__dict__.get("_feplb_average_required") or not dist.is_initialized() or \
            dist.get_world_size() == 1:
        return 0
    if not optimizer.state and _initialising_state():
        return 0    # torch.distributed.checkpoint initialising the state: one step at lr 0 on zero gradients
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    # (the layers whose experts this optimizer steps: another attached optimizer may step the rest of the model)
    if not any(lay._not_averaged() for lay in _attached(optimizer) if any(id(p) in held for p in lay.expert_params())):
        return 0
    if not handshaking:
        raise RuntimeError(not_averaged(None))
    return STEP_PROBLEM_NOT_AVERAGED


def _caller(match: Any, depth: int) -> Any:
    """The first of the frames above the caller of this function's caller (up to ``depth`` of them) that
    ``match(frame)`` accepts, or None: what called the optimizer step in progress."""
    return caller_frame(match, depth, skip=2)


def _initialising_state() -> bool:
    """Whether the optimizer step in progress is ``torch.distributed.checkpoint``'s initialisation of an empty
    optimizer state (``_init_optim_state``: zero gradients, learning rates 0), found in the callers' frames."""
    return _caller(lambda f: f.f_code.co_name == "_init_optim_state" and "checkpoint" in f.f_code.co_filename,
                   24) is not None


def _stepping_scaler() -> torch.amp.GradScaler | None:
    """The ``torch.amp.GradScaler`` whose ``step`` runs the optimizer step in progress (found in the callers'
    frames: a scaler keeps no record of the optimizers it steps before it steps them), or None."""
    frame = _caller(lambda f: f.f_code.co_name in ("step", "_maybe_opt_step")
                    and isinstance(f.f_locals.get("self"), torch.amp.GradScaler), 48)
    return None if frame is None else frame.f_locals["self"]


class _ReducingScaler:
    """Mixed into a ``torch.amp.GradScaler`` passed to ``attach_optimizer`` (its class swapped for one with this
    first, so that it still pickles): ``unscale_(opt)`` and ``step(opt)`` first reduce the replica gradients of the
    layers attached to ``opt`` (a reduction that finds nothing to add sends nothing), and the inf / NaN check of
    ``opt``'s gradients is agreed over those layers' groups: an owner whose experts' gradients overflowed skips the
    step, and so must every rank whose replicas it refreshes with. Pickled or deep-copied, it is the plain scaler
    again (attach the copy to use it so)."""

    # (the layers are attached to the torch optimizer: accelerate's AcceleratedOptimizer given here is looked through,
    # and given on to the scaler itself, which keys its state by it)
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # (its inf check is collective over the attached layers' groups, plain EP's included)
        inner = _torch_optimizer(optimizer)
        with handshaken(_attached(inner), ENTRY_SCALER, force=True):
            _reduce_attached(inner)
            return super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        inner = _torch_optimizer(optimizer)
        layers = _attached(inner)
        problem = _average_problem(inner, handshaking=any(lay.world_size > 1 for lay in layers))
        with handshaken(layers, ENTRY_SCALER, force=True, problem=problem):
            _reduce_attached(inner)
            out = super().step(optimizer, *args, **kwargs)
        # a step the scaler skipped (its inf check agreed over the group, _unscale_grads_) ends the step's averaging
        # as a real step does (the optimizer's post-hook pops the mark there): else the next step's
        # average_expert_grads, on gradients zeroed in place (the same tensors), was refused as a second call
        state = self._per_optimizer_states.get(id(optimizer), {}) if self._enabled else {}
        if any(bool(v.item()) for v in state.get("found_inf_per_device", {}).values()):
            for lay in layers:
                lay._forget_average()
        return out

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        layers, groups = _attached(_torch_optimizer(optimizer)), []
        if layers:
            bad = any(bool(v.item()) for v in per_device.values())
            for lay in layers:
                if not any(lay.group is g for g in groups):
                    groups.append(lay.group)
                    ok = lay.control.all_reduce_min(torch.tensor([int(not bad)]), "group", "GradScaler inf check")
                    bad = not bool(ok[0])
            if bad:     # the scaler reads this dict: its step is skipped, its scale lowered
                for v in per_device.values():
                    v.fill_(1.0)
                if not per_device:
                    per_device[found_inf.device] = torch.ones_like(found_inf)
        return per_device

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return _plain_scaler, (type(self)._feplb_base, self.__getstate__())


_REDUCING: dict[type, type] = {}


def _reduce_attached(optimizer: torch.optim.Optimizer) -> None:
    for lay in _attached(optimizer):     # (in the order attached: the same on every rank)
        lay.reduce_replica_grads()


def _plain_scaler(base: type, state: dict) -> torch.amp.GradScaler:
    scaler = base.__new__(base)
    scaler.__setstate__(state)
    return scaler


def _reduce_before_unscale(scaler: torch.amp.GradScaler) -> None:
    """Make ``scaler`` a :class:`_ReducingScaler` (once)."""
    if isinstance(scaler, _ReducingScaler):
        return
    base = type(scaler)
    if not hasattr(base, "_unscale_grads_"):
        raise TypeError(f"MoELayer.attach_optimizer: {base.__name__} has no _unscale_grads_ (the inf / NaN check "
                        "of torch.amp.GradScaler) to agree over the EP group")
    cls = _REDUCING.get(base)
    if cls is None:
        cls = _REDUCING[base] = type(f"FEPLB{base.__name__}", (_ReducingScaler, base),
                                         {"__module__": __name__, "_feplb_base": base})
    scaler.__class__ = cls
