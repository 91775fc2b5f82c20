"""Expert shards in state dicts as DTensors over the EP group, for ``torch.distributed.checkpoint`` (DCP).

Rank r of an EP group of W ranks owns experts ``r * L ... r * L + L - 1``: its expert parameters are [L, ...] shards
of the model's [E, ...] tensors, the experts along dim 0. As plain tensors under names every rank shares, DCP (and
``get_model_state_dict``, torchtitan's ``CheckpointManager``) takes them for replicated ones: it writes one rank's and
loads it on every rank, silently. So by default (state-dict type ``"sharded"``) a layer's ``state_dict()`` gives each
expert shard as a DTensor sharded along dim 0 over a one-dimensional mesh of the EP group's ranks, global shape
[E, ...], sharing storage with the parameter; the optimizer's state of those parameters likewise (its
``state_dict()`` gains a hook at ``attach_optimizer``, at the first step of any optimizer stepping expert parameters,
or through :func:`track_optimizer`). DCP then writes every rank's experts at their global offsets (once over
data-parallel replicas of the EP group), loads them back at any EP size, and
``get_model_state_dict(..., options=StateDictOptions(full_state_dict=True))`` gathers the original layout.

Optimizer state of the parameter's rank that is not per expert (Adafactor's column statistics of a 2-D expert bias,
[1, G]) is stacked per rank along dim 0 the same way: it loads back at the same EP size, and DCP's shape check
refuses another. State of another rank (LBFGS's flat vectors, whose length grows with L) is refused.

``"local"``: plain per-rank tensors, what the parameters are (Megatron-Core's layers keep this: their checkpoints go
through ``sharded_state_dict``). ``load_state_dict`` (the layer's and the optimizer's) takes either, a DTensor over
any group of the EP group's size (a per-rank file of another data-parallel replica), and for a layer's expert
parameter also the model's whole [E, ...] tensor (this rank's rows are copied from it).

Legend: E experts, L = E / W experts per rank, W EP ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from feplb.frames import caller_frame

__all__ = ["STATE_DICT_TYPES", "ExpertShards", "local_state_dicts", "localize_state", "track_optimizer"]

STATE_DICT_TYPES = ("sharded", "local")


class ExpertShards:
    """How a layer's expert parameters map onto the full model's tensors, and what its ``state_dict()`` gives for
    them (mixed into ``feplb.layer.MoELayer``; adapters whose experts keep another layout override these)."""

    # what state_dict() gives for the expert shards: DTensors over the EP group, or plain per-rank tensors ("local")
    state_dict_type = "sharded"

    def full_entries(self, pname: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full model's entries (names relative to this layer) of expert parameter ``pname``, given every EP
        rank's shard of it in rank order (``feplb.dropin.full_state_dict``). Shards of all the local experts
        ([L, ...], rank r holding experts r * L ...) concatenate; a layer keeping one parameter per expert
        overrides this."""
        return {pname: torch.cat(parts)}

    def local_shard(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of expert parameter ``pname`` (or of its gradient) cut from the full model's tensor: the
        inverse of :meth:`full_entries` for a layer keeping [L, ...] shards, rows ``rank * L ...``."""
        lo = self.rank * self.num_local
        return full[lo:lo + self.num_local]

    def expert_shard_dim(self, pname: str) -> int | None:
        """The dim along which this rank's shard of expert parameter ``pname`` is one block of the full model's
        tensor, block ``rank`` of W (``feplb.sharded``: its DTensor in ``state_dict()``): 0 for [L, ...] shards,
        rows ``rank * L ...`` (:meth:`local_shard`); None where it is not one block."""
        return 0

    def whole_shape(self, pname: str) -> torch.Size | None:
        """The shape of the full model's tensor of expert parameter ``pname`` whose rows :meth:`local_shard` cuts
        (``load_state_dict`` takes it too), or None where the full model names it otherwise."""
        p = self.get_parameter(pname)
        return torch.Size((p.shape[0] * self.world_size, *p.shape[1:]))

    def set_state_dict_type(self, kind: str) -> None:
        """What ``state_dict()`` gives for the expert shards, and the optimizer's ``state_dict()`` for their state:
        ``"sharded"`` (the default), DTensors sharded over the EP group, which ``torch.distributed.checkpoint``
        saves and loads at any EP size; ``"local"``, plain per-rank tensors, for one ``torch.save`` file per rank
        only, loaded on the same EP rank: nothing in them names their rank (another rank's file loads without an
        error), and never through ``torch.distributed.checkpoint`` (``dcp.save``, ``get_state_dict``, torchtitan's
        ``CheckpointManager``), which writes one rank's copy of each entry whose name every rank shares (a
        different rank for different entries) and loads it on every rank: ``state_dict()`` under DCP's own calls
        (``dcp.save`` / ``dcp.load`` of a Stateful object, ``get_state_dict``) raises; a dict made beforehand and
        handed to ``dcp.save`` is not told apart.
        ``load_state_dict`` takes both either way."""
        if kind not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict type must be one of {STATE_DICT_TYPES}, got {kind!r}")
        self.state_dict_type = kind

    def full_state_entries(self, name: str, value: Any) -> dict[str, Any]:
        """The full model's entries of this layer's state-dict entry ``name`` that is not an expert parameter (a
        router, a buffer): by default itself, replicated on every rank."""
        return {name: value}


# one 1-D DeviceMesh per (layer, device type), made on first use (no collective: DeviceMesh.from_group)
_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# every layer built in this process, closed ones too (a checkpoint saved after close() shards their state alike)
_KNOWN: weakref.WeakSet = weakref.WeakSet()


def register(layer) -> None:
    """Hook ``layer``'s state dict (``MoELayer.__init__``) and let optimizers find its expert parameters."""
    layer.register_state_dict_post_hook(state_dict_post_hook)
    layer.register_load_state_dict_pre_hook(load_state_dict_pre_hook)
    _KNOWN.add(layer)


@functools.cache
def _dtensor():
    """(DTensor, Shard), imported once: ``is_dtensor`` runs before every step of an optimizer not tracked."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor, Shard


def is_dtensor(t: Any) -> bool:
    return isinstance(t, _dtensor()[0])


def _mesh(layer, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    per = _MESHES.setdefault(layer, {})
    if device_type not in per:
        per[device_type] = DeviceMesh.from_group(layer.group, device_type)
    return per[device_type]


def expert_named_params(layer) -> list[tuple[str, nn.Parameter]]:
    """``(name relative to layer, parameter)`` of each of ``layer.expert_params()``."""
    ids = {id(p) for p in layer.expert_params()}
    return [(n, p) for n, p in layer.named_parameters() if id(p) in ids]


def _global_shape(t: torch.Tensor, dim: int, world: int) -> torch.Size:
    shape = list(t.shape)
    shape[dim] *= world
    return torch.Size(shape)


def _sharded(layer, t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t``, this rank's shard, as the DTensor of the EP group's [E, ...] tensor (sharing its storage), marked with
    this rank's index in the EP group (``_feplb_ep_rank``, kept by ``torch.save``): a DTensor unpickled on another
    rank holds the saving rank's local part, which nothing else tells apart from the loading rank's."""
    DTensor, Shard = _dtensor()
    shape = _global_shape(t, dim, layer.world_size)
    stride = torch.empty(shape, device="meta").stride()
    out = DTensor.from_local(t, _mesh(layer, t.device.type), [Shard(dim)], run_check=False, shape=shape,
                             stride=stride)
    out._feplb_ep_rank = layer.rank
    return out


def _local(layer, key: str, value: Any, dim: int | None, like: torch.Tensor | None = None,
           pname: str | None = None) -> Any:
    """What a per-rank tensor loads from ``value``: a DTensor sharded along ``dim`` over W ranks (this layer's EP
    group, or another group of its size: a per-rank file of a data-parallel replica) its local part (for an expert
    parameter ``pname`` shaped like ``like``, of the model's whole shape); the model's whole tensor of expert
    parameter ``pname`` this rank's rows (a copy, never a view that would keep the whole tensor alive); anything
    else itself (``load_state_dict``'s own checks judge it)."""
    DTensor, Shard = _dtensor()
    W = layer.world_size
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        ok = dim is not None and mesh.ndim == 1 and mesh.size() == W and tuple(value.placements) == (Shard(dim),) \
            and (like is None or value.shape == _global_shape(like, dim, W))
        if not ok:
            layout = ("no DTensor (its shard is not one block of the model's tensor)" if dim is None else
                      f"a DTensor sharded along dim {dim} over {W} ranks"
                      + (f", shape {tuple(_global_shape(like, dim, W))}" if like is not None else ""))
            raise ValueError(f"{key}: a DTensor of shape {tuple(value.shape)} placed {list(value.placements)} over "
                             f"ranks {mesh.mesh.flatten().tolist()}; this rank's layer loads {layout}")
        saved_by = getattr(value, "_feplb_ep_rank", None)
        if saved_by is not None and saved_by != layer.rank:
            _refusal_met(layer)
            raise ValueError(f"{key}: this DTensor's local part is the shard of EP rank {saved_by}, which saved it "
                             f"(this is EP rank {layer.rank}): a state dict torch.save'd on one rank and loaded on "
                             "every rank would give each rank the saving rank's experts. Load each rank's own "
                             "shards: torch.distributed.checkpoint (dcp.save / dcp.load, at any EP size), one file "
                             "per rank, or a whole state dict (full_state_dict(model)), which every rank loads")
        return value.to_local()
    whole = None if pname is None else layer.whole_shape(pname)
    if whole is not None and W > 1 and isinstance(value, torch.Tensor) and value.shape == whole:
        return layer.local_shard(pname, value).clone()
    return value


def _refusal_met(layer) -> None:
    """Before this rank refuses a state dict another EP rank saved: the handshake of that refusal over the layer's
    EP group (``feplb.steps.ENTRY_LOAD``), so that the ranks that loaded it without an error (the saving rank's own,
    when one rank's ``torch.save`` file is loaded on every rank, as accelerate's ``load_state`` does), already in
    their next forward or per-step call, raise there too instead of waiting for this rank; ranks refusing alike meet
    here. Whatever the handshake says (or a peer gone), this rank then raises its own refusal."""
    from feplb.steps import ENTRY_LOAD

    handshake = getattr(layer, "_step_handshake", None)
    if handshake is None or layer.world_size <= 1 or layer.__dict__.get("_closed") \
            or getattr(layer, "control", None) is None:
        return
    with contextlib.suppress(Exception):   # noqa: BLE001 - this rank's own refusal follows
        handshake(ENTRY_LOAD)


# ------------------------------------------------------------------------------------------------ module hooks
def _shard_digests(layer) -> dict[str, torch.Tensor]:
    """{expert parameter name: int64 [W, 4]}, the SHA-256 of every EP rank's shard of it (its bytes), the same on
    every rank (collective over the layer's EP group, once per ``local_state_dicts(..., "digest")``)."""
    import hashlib

    import numpy as np

    got = layer.__dict__.get("_shard_digests")
    if got is None:
        named = expert_named_params(layer)
        # (hashlib reads the host copy's buffer in place: no second copy of the shard)
        digests = [np.frombuffer(hashlib.sha256(p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
                                 .digest(), dtype=np.int64) for _, p in named]
        row = torch.from_numpy(np.concatenate(digests) if digests else np.zeros(0, np.int64)).clone()
        gathered = layer.control.all_gather(row, "all_gather of the expert shards' digests")
        got = {n: gathered[:, 4 * i:4 * i + 4].clone() for i, (n, _) in enumerate(named)}
        layer.__dict__["_shard_digests"] = got
    return got


def state_dict_post_hook(layer, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """``layer.state_dict()`` with the expert shards as DTensors (state-dict type ``"sharded"``); the parameters
    themselves where ``keep_vars=True`` asked for them. Under the ``"digest"`` type (``local_state_dicts``: while
    ``feplb.hf.TrainerMixin`` builds a Trainer), each expert parameter's entry is every rank's digest of its shard
    instead (int64 [W, 4], the same on every rank, collective once): a Trainer subclass that hashes the state dict
    in its construction then names what it caches alike on every rank (TRL's DPO, its reference log-probs)."""
    if layer.state_dict_type == "digest":
        keys = {prefix + n: n for n, _ in expert_named_params(layer)}
        if any(isinstance(state_dict.get(k), torch.Tensor) and not isinstance(state_dict[k], nn.Parameter)
               for k in keys):
            digests = _shard_digests(layer)
            for key, pname in keys.items():
                if key in state_dict:
                    state_dict[key] = digests[pname]
        return
    if layer.state_dict_type != "sharded":
        if layer.state_dict_type == "local" and layer.world_size > 1 and any(
                isinstance(v := state_dict.get(prefix + n), torch.Tensor) and not isinstance(v, nn.Parameter)
                for n, _ in expert_named_params(layer)):
            _refuse_local_in_dcp(f"{type(layer).__name__} {prefix.rstrip('.') or '(root)'}.state_dict()")
        return
    for pname, _ in expert_named_params(layer):
        key = prefix + pname
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter) or is_dtensor(value):
            continue
        dim = layer.expert_shard_dim(pname)
        if dim is None:
            raise ValueError(f"{type(layer).__name__} {prefix.rstrip('.') or '(root)'}: its {pname!r} shard is not "
                             "one block of the model's tensor, so it has no DTensor for torch.distributed.checkpoint; "
                             "use full_state_dict(model), or set_state_dict_type(model, 'local') for per-rank files")
        state_dict[key] = _sharded(layer, value, dim)


_DCP_DIR = os.sep + os.path.join("torch", "distributed", "checkpoint") + os.sep


def _dcp_caller(depth: int = 64) -> str | None:
    """The function of ``torch.distributed.checkpoint`` among the callers' frames (up to ``depth``), or None."""
    frame = caller_frame(lambda f: _DCP_DIR in f.f_code.co_filename, depth)
    return None if frame is None else f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"


def _refuse_local_in_dcp(what: str) -> None:
    """Refuse state-dict type ``"local"`` expert shards asked for by ``torch.distributed.checkpoint`` (``dcp.save``
    / ``dcp.load`` of a Stateful object, ``get_state_dict``): every rank holds the same names, so DCP would write
    one rank's experts and load them on every rank. Every rank of the collective call asks alike, and all raise."""
    caller = _dcp_caller()
    # (a checkpoint of this rank alone, dcp.save(..., no_dist=True), holds this rank's shards, as a torch.save file)
    alone = caller is not None and caller_frame(
        lambda f: _DCP_DIR in f.f_code.co_filename and f.f_locals.get("no_dist") is True, 64) is not None
    if caller is not None and not alone:
        raise RuntimeError(f"{what}: state-dict type 'local' (plain per-rank expert shards under names every rank "
                           f"shares) asked for by torch.distributed.checkpoint ({caller}), which would write one "
                           "rank's experts and load them on every rank. Use the 'sharded' type "
                           "(set_state_dict_type(model, 'sharded'), the default) with torch.distributed.checkpoint; "
                           "'local' is for one torch.save file per rank")


def load_state_dict_pre_hook(layer, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                             missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """``layer.load_state_dict`` takes a sharded, local or whole tensor for each expert parameter."""
    for pname, p in expert_named_params(layer):
        key = prefix + pname
        if key in state_dict:
            state_dict[key] = _local(layer, key, state_dict[key], layer.expert_shard_dim(pname), p, pname)


@contextlib.contextmanager
def local_state_dicts(layers: Iterable, kind: str = "local") -> Iterator[None]:
    """Within: the layers' ``state_dict()`` (and an optimizer's of their parameters) gives plain per-rank shards
    (``full_state_dict`` gathers them itself), or what ``kind`` names (one of :data:`STATE_DICT_TYPES`, or
    ``"digest"``: each expert parameter's entry every EP rank's digest of its shard, see ``state_dict_post_hook``;
    an optimizer's state plain per-rank)."""
    if kind not in (*STATE_DICT_TYPES, "digest"):
        raise ValueError(f"state dict type must be one of {STATE_DICT_TYPES}, got {kind!r}")
    layers = list({id(lay): lay for lay in layers}.values())   # a layer reachable under several names: once
    before = [lay.__dict__.get("state_dict_type") for lay in layers]
    for lay in layers:
        lay.state_dict_type = kind
    try:
        yield
    finally:
        for lay in layers:
            lay.__dict__.pop("_shard_digests", None)
        for lay, b in zip(layers, before, strict=True):
            if b is None:
                del lay.state_dict_type
            else:
                lay.state_dict_type = b


# --------------------------------------------------------------------------------------------- optimizer hooks
def _owners() -> dict[int, tuple[Any, str, int | None]]:
    """id(parameter) -> (layer, its name there, shard dim) of every expert parameter of the layers built."""
    out = {}
    for layer in list(_KNOWN):
        for pname, p in expert_named_params(layer):
            out[id(p)] = (layer, pname, layer.expert_shard_dim(pname))
    return out


def _indexed(optimizer: torch.optim.Optimizer, state_dict: dict) -> list[tuple[torch.Tensor, Any]]:
    """(parameter, its key in ``state_dict["state"]``), in the optimizer's order; none where the groups differ
    (``load_state_dict`` refuses that itself)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = [k for g in state_dict.get("param_groups", ()) for k in g["params"]]
    return list(zip(params, keys, strict=True)) if len(params) == len(keys) else []


def optimizer_state_dict_post_hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """The optimizer's state of expert parameters of layers of state-dict type ``"sharded"`` as DTensors sharded
    along dim 0 like the parameters (its live state untouched): a state per expert (Adam's moments, [L, ...])
    reshards at any EP size; one of the parameter's rank but not per expert (Adafactor's column statistics of a
    2-D expert bias, [1, G]) is stacked per rank and loads at the same EP size only (another is refused by DCP's
    shape check). A scalar (a step count) stays as it is, equal on every rank. State of another rank (a flat
    vector over several parameters, as LBFGS keeps, whose length grows with L and would reshard silently), nested
    in containers, or of a parameter whose shard is not one block, is refused, naming it."""
    owners = _owners()
    state = dict(state_dict["state"])
    for p, key in _indexed(optimizer, state_dict):
        own = owners.get(id(p))
        if own is not None and key in state and own[0].state_dict_type == "local" and own[0].world_size > 1 and \
                any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in state[key].values()):
            _refuse_local_in_dcp(f"{type(optimizer).__name__}.state_dict() (the state of expert parameter "
                                 f"{own[1]!r})")
        if own is None or key not in state or own[0].state_dict_type != "sharded":
            continue
        layer, pname, dim = own
        entry = {}
        for name, v in state[key].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and not is_dtensor(v):
                if dim is None or v.dim() != p.dim():
                    why = ("the parameter's shard is not one block of the model's tensor" if dim is None else
                           "it is neither per expert nor shaped like the parameter (a flat vector, say), and "
                           "could be resharded wrongly")
                    raise ValueError(f"{type(optimizer).__name__}.state_dict(): its state {name!r} of shape "
                                     f"{tuple(v.shape)} for expert parameter {pname!r} {tuple(p.shape)} has no "
                                     f"DTensor for torch.distributed.checkpoint ({why}); "
                                     "set_state_dict_type(model, 'local') for per-rank files")
                v = _sharded(layer, v, 0)
            elif isinstance(v, (dict, list, tuple)) and _holds_tensor(v):
                raise ValueError(f"{type(optimizer).__name__}.state_dict(): its state {name!r} of expert parameter "
                                 f"{pname!r} nests tensors, which torch.distributed.checkpoint would take for "
                                 "replicated ones; set_state_dict_type(model, 'local') for per-rank files")
            entry[name] = v
        state[key] = entry
    state_dict["state"] = state
    return state_dict


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dim() > 0
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def optimizer_load_pre_hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``optimizer.load_state_dict`` takes the expert parameters' state sharded or local (the caller's dict left
    as it was)."""
    owners = _owners()
    state_dict = dict(state_dict)
    state = dict(state_dict.get("state", {}))
    for p, key in _indexed(optimizer, state_dict):
        own = owners.get(id(p))
        if own is None or key not in state:
            continue
        live = optimizer.state.get(p)
        live = live if isinstance(live, dict) else {}
        state[key] = {name: _state_local(own, name, v, live.get(name)) if is_dtensor(v) else v
                      for name, v in state[key].items()}
    state_dict["state"] = state
    return state_dict


def _state_local(own: tuple, name: str, value: Any, live: Any = None) -> torch.Tensor:
    """The local part of a DTensor of optimizer state ``name`` of an expert parameter (``own``: its layer, name and
    shard dim, as :func:`_owners` gives it), stacked along dim 0 (none where the parameter's shard is no block).
    ``live``: the optimizer's own state of that name, if it holds one: the DTensor must be W of it stacked."""
    layer, pname, dim = own
    key = f"optimizer state {name!r} of {pname!r}"
    W = layer.world_size
    per_rank = ("state kept per EP rank (a statistic over each rank's whole shard, as Adafactor's of a 2-D "
                "parameter) loads at the EP size it was saved at only")
    if dim is not None and is_dtensor(value) and value.dim() and isinstance(live, torch.Tensor) and \
            not is_dtensor(live) and live.dim() == value.dim():
        # (any state of the parameter's rank, per expert or per rank: [n, ...] here is [W * n, ...] stacked; a
        # per-rank one of another EP size, whose rows the stacking would hand out wrongly, differs)
        want = (W * live.shape[0], *live.shape[1:])
        if tuple(value.shape) != want:
            raise ValueError(f"{key}: shape {tuple(value.shape)}, but this rank's optimizer holds it as "
                             f"{tuple(live.shape)}, {want} over this layer's {W} EP ranks: {per_rank}")
        return _local(layer, key, value, 0)
    # Without state of its own to compare with (a fresh optimizer loading a per-rank file of a sharded state_dict()),
    # the DTensor's mesh says the EP size it was saved at (``_local`` refuses another), and at that size the local
    # part is this rank's own state, whatever its rows. (torch's set_optimizer_state_dict, the way in for DCP and
    # full state dicts, which may come from another EP size, makes the optimizer's state before it loads.)
    return _local(layer, key, value, 0 if dim is not None else None)


def localize_state(optimizer: torch.optim.Optimizer) -> None:
    """The local parts of the DTensors an optimizer's ``load_state_dict`` took into its live state for expert
    parameters before :func:`track_optimizer` hooked it (a per-rank file of a sharded ``state_dict()`` loaded into a
    fresh optimizer): run when it is hooked, and before each step of an optimizer not hooked."""
    # (torch lets an optimizer keep other values than per-parameter dicts in its state)
    if not any(is_dtensor(v) for st in optimizer.state.values() if isinstance(st, dict) for v in st.values()):
        return
    owners = _owners()
    for p, st in optimizer.state.items():
        own = owners.get(id(p)) if isinstance(p, torch.Tensor) and isinstance(st, dict) else None
        if own is None:
            continue
        for name, v in list(st.items()):
            if is_dtensor(v):
                st[name] = _state_local(own, name, v)


def track_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` give the state of expert parameters sharded like them (and its
    ``load_state_dict`` take it back). Done by ``attach_optimizer`` and at the first step of any optimizer that
    steps expert parameters; needed only for an optimizer whose state was loaded and is saved again before it
    ever stepped (one that loaded a sharded state before has it made local here, or else at its next step).
    Idempotent."""
    if optimizer.__dict__.get("_feplb_sharded"):
        return
    localize_state(optimizer)     # what it loaded before (later loads go through its load hook)
    optimizer.register_state_dict_post_hook(optimizer_state_dict_post_hook)
    optimizer.register_load_state_dict_pre_hook(optimizer_load_pre_hook)
    optimizer._feplb_sharded = True
