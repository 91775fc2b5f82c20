"""What the first steps of a forward produce, read by the later ones (frozen, identical in meaning on every rank)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from feplb.config import FEPLBConfig, LayerStats
from feplb.layout import HomeLayout

__all__ = ["Counts", "NonFiniteRoutingError", "Split", "layer_stats", "read_counts", "read_step", "step_row"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Counts:
    """The all-gathered counts of one forward, read identically on every rank."""

    counts_WS: np.ndarray       # int64 [W, E]: rows source s sends each flat slot
    counts_WE: np.ndarray       # int64 [W, E]: rows source s sends each expert
    loads_default_W: np.ndarray  # int64 [W]: rows per GPU with every expert at its owner (plain EP)
    loads_home_W: np.ndarray    # int64 [W]: rows per GPU with the current placement, before balancing
    want_plan: bool             # balancing is on and the straggler is worth it (identical everywhere)
    needs_grad: bool = True     # autograd on and, on some rank, the rows or the expert parameters need grad


@dataclass(frozen=True, kw_only=True, eq=False)
class Split:
    """Static and dynamic experts of this micro-batch and this rank's home layout."""

    dynamic_WD: np.ndarray      # int64 [W, D]: dynamic experts of every GPU (D = 0 without a plan)
    home: HomeLayout
    send_splits: list[int]      # [W] rows this rank sends each rank in phase 1
    split_WW: torch.Tensor      # int64 CPU [W, W]: rows rank s sends rank d in phase 1


# The bits of a rank's way of calling a layer in its counts row, and what the ranks differing in one is refused as:
# (bit, what differs, set, unset, what to do)
_CALL_BITS = (
    (1, "run this layer in different modes", "training", "eval",
     "the balancing history follows training forwards only, so call model.train() or model.eval() on every rank "
     "alike; or the ranks ran different numbers of forwards (an evaluation over shards of different lengths, as "
     "accelerate's even_batches=False gives, or on some ranks only): every rank must run every forward"),
    (2, "run this layer with autograd on some ranks and off on others", "autograd on",
     "off (torch.no_grad, inference_mode)",
     "its backward is collective, so run the forward under the same grad mode on every rank; or the ranks ran "
     "different numbers of forwards (an evaluation over shards of different lengths, as accelerate's "
     "even_batches=False gives, or on some ranks only): every rank must run every forward"),
    (4, "call this layer in different ways", "forward_dispatched", "forward",
     "every rank must call the same method (forward_dispatched behind the caller's own dispatch, forward with "
     "FEPLB's)"),
    (8, "run this layer under saved-tensor hooks on some ranks only", "under hooks (non-reentrant activation "
     "checkpointing, save_on_cpu)", "without",
     "a forward under saved-tensor hooks leaves a record for its recompute, which every rank must keep alike: "
     "checkpoint the layer (and use saved-tensor hooks) alike on every rank"),
    (16, "would recompute this forward on some ranks only (reentrant activation checkpointing)",
     "inputs of the checkpointed block needing grad", "none needing grad",
     "under torch.utils.checkpoint(..., use_reentrant=True) a rank whose checkpointed block's inputs need no grad "
     "never recomputes it (its output needs no grad), and the recompute moves rows between the ranks: make those "
     "inputs need grad on every rank alike (or use use_reentrant=False)"),
)

# and, above those bits, the autocast the layer's device runs under (AUTOCASTS: its dtype; 0 off): rows balancing
# moves to another rank are computed under that rank's autocast
AUTOCAST_SHIFT = 5
AUTOCASTS = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64)


def autocast_code(dtype: torch.dtype | None) -> int:
    """The CALLS field's code of an autocast dtype (``feplb.kernels.autocast_dtype``; None: off)."""
    return AUTOCASTS.index(dtype) if dtype in AUTOCASTS else len(AUTOCASTS)


class NonFiniteRoutingError(ValueError):
    """Router logits (or routing weights given to ``forward``) holding NaN or inf on some EP rank: raised on every
    rank together, in the forward's counts all-gather (weights a too large learning rate grew, say)."""


# The counts all-gather's row (int64): a header of fixed width, then the counts, padded to the width every layer of
# the group shares (layers of different E may meet in one all-gather when ranks run different layers)
HEADER = ("flags", "stale", "problem", "layer", "calls", "digest", "skips", "dropped", "frozen", "needs", "rounds")
FLAGS, STALE, PROBLEM, LAYER, CALLS, DIGEST, SKIPS, DROPPED, FROZEN, NEEDS, ROUNDS = range(len(HEADER))
# The same row sent by a rank entering one of the calls that run collectives between a backward and the next forward
# (``step_row``: an attached optimizer's step, reduce_replica_grads, refresh_replicas, average_expert_grads,
# clip_grad_norm_, an attached GradScaler's unscale_ and step): its LAYER is negative, so that a rank that skipped
# the call (a GradScaler not attached with the optimizer skipping a step an overflow only that rank saw; the loop's
# own condition), already in the next forward's counts all-gather, meets it there and every rank raises together
# instead of waiting in collectives the others never run. Its CALLS field names the call (ENTRIES).
# The recompute of a checkpointed forward (in its backward) sends the same row too (ENTRY_RECOMPUTE), carrying its
# candidates (``feplb.recompute.Records.candidates``) after the header: a rank that does not recompute (its
# checkpoint's output needed no grad there, or it skipped the backward), already in the next forward, meets it.
ENTRIES = {1: "optimizer.step() of an optimizer attached to the layer", 2: "reduce_replica_grads()",
           3: "refresh_replicas()", 4: "average_expert_grads()", 5: "feplb.clip_grad_norm_()",
           6: "the unscale_() or step() of a GradScaler attached with the optimizer",
           7: "the recompute of a checkpointed forward (in its backward)",
           8: "the refusal of a state dict whose expert shards another EP rank saved (load_state_dict)"}
ENTRY_STEP, ENTRY_REDUCE, ENTRY_REFRESH, ENTRY_AVERAGE, ENTRY_CLIP, ENTRY_SCALER, ENTRY_RECOMPUTE, ENTRY_LOAD = ENTRIES
# (ENTRY_LOAD: a rank refusing, in load_state_dict, a state dict another EP rank torch.save'd sends it before raising,
# so that the ranks that loaded theirs, already in their next forward or per-step call, raise too: feplb.sharded)
# what a step row's DIGEST agrees, for the calls that take arguments every rank must pass alike (``args_digest``
# of them; 0 for the other calls): a rank passing others would compute apart silently, or run other collectives
ENTRY_ARGS = {ENTRY_AVERAGE: "average_expert_grads()'s arguments (divide, the data_parallel_group's size, whether "
                            "the layers met that group before, whether the expert gradients live in Megatron DDP's "
                            "main_grad buffers)",
              ENTRY_CLIP: "clip_grad_norm_'s arguments (max_norm, norm_type, error_if_nonfinite, the part of the "
                          "model: its FEPLB layers and how many parameters it has, the data-parallel group's size, "
                          "whether the expert gradients live in Megatron DDP's main_grad buffers)"}
# bits of a step row's PROBLEM
STEP_PROBLEM_UNATTACHED_SCALER = 1
STEP_PROBLEM_NOT_AVERAGED = 2
STEP_PROBLEM_BAD_DP_GROUP = 4     # average_expert_grads' data_parallel_group cannot be that rank's (dp_group_problem)

DP_GROUP_HINT = ("Under EP x DP, pass the group of the ranks that hold the same experts, one per EP group (Megatron's "
                 "expert data-parallel group, not its dense data-parallel group; with a DeviceMesh of dims "
                 "(\"dp\", \"ep\"), mesh[\"dp\"].get_group()); with the EP group all the ranks, pass none")


def not_averaged(ranks: list[int] | None) -> str:
    """The refusal of a step of an optimizer attached with ``average_required`` whose expert gradients
    ``average_expert_grads`` did not divide since the step's last backward (on ``ranks``, None: this one)."""
    where = "" if ranks is None else f" on EP rank(s) {ranks}"
    return ("MoELayer: optimizer.step() of an optimizer whose loop averages the replicated parameters' gradients "
            f"(accelerate's prepared optimizer: its DDP averages them), while the experts' gradients{where} are "
            "not averaged: average_expert_grads was not called since the step's last backward (forgotten, called "
            "after the step, or before the last backward of an accumulation). The dispatch leaves each expert's "
            "gradient summed over the EP group's ranks, W times the mean the rest of the model follows. Nothing was "
            "stepped: call feplb.hf.average_expert_grads(model) after the step's last backward, before clipping and "
            "the step (with accelerate: under `if accelerator.sync_gradients:`), here before stepping again, or, "
            "where a backward came after it, zero the gradients and redo the step from its first backward. For a "
            "loss summed over the ranks, attach_optimizer(..., average_required=False)")


def args_digest(args: tuple) -> int:
    """A step row's DIGEST of a call's arguments (a tuple of ints, floats, bools, None and tuples of those), equal
    on every rank that passed the same: 63 bits of the SHA-256 of their repr (Python's hash() of a NaN is its
    object's, another on every rank)."""
    return int.from_bytes(hashlib.sha256(repr(args).encode()).digest()[:8], "little") >> 1


def step_row(layer_id: int, width: int, entry: int, problem: int = 0, *, args: int = 0, as_numpy: bool = False,
             ) -> torch.Tensor | np.ndarray:
    """The row a rank sends in the handshake of a call between a backward and the next forward (int64
    [len(HEADER) + width]): LAYER ``-1 - layer_id``, CALLS the call (``ENTRIES``), PROBLEM ``problem``
    (``STEP_PROBLEM_*``, 0 for none), DIGEST ``args`` (``args_digest`` of its arguments, ``ENTRY_ARGS``); a numpy
    array with ``as_numpy``."""
    row = np.zeros(len(HEADER) + width, dtype=np.int64)
    row[LAYER] = -1 - layer_id
    row[CALLS] = entry
    row[PROBLEM] = problem
    row[DIGEST] = args
    return row if as_numpy else torch.from_numpy(row)


def _by_entry(gathered: np.ndarray, ranks: list[int]) -> str:
    calls: dict[str, list[int]] = {}
    for r in ranks:
        calls.setdefault(ENTRIES.get(int(gathered[r, CALLS]), "?"), []).append(r)
    return "; ".join(f"EP rank(s) {rs} in {what}" for what, rs in calls.items())


def refused_load(gathered: np.ndarray) -> str | None:
    """The error of the ranks that went on after some refused, in ``load_state_dict``, a state dict whose expert
    shards another EP rank saved (their ``ENTRY_LOAD`` rows), or None where no rank did."""
    refusing = np.nonzero((gathered[:, LAYER] < 0) & (gathered[:, CALLS] == ENTRY_LOAD))[0].tolist()
    if not refusing:
        return None
    others = [r for r in range(len(gathered)) if r not in refusing]
    return (f"MoELayer: EP rank(s) {refusing} refused, in load_state_dict, a state dict whose expert shards another "
            f"EP rank saved (see the error there), while EP rank(s) {others} loaded it and went on: one rank's "
            "torch.save'd state dict (accelerate's save_state, which writes the main process's alone) loaded on every "
            "rank would give every rank that rank's experts. Every rank stops here; the ranks' weights now differ in "
            "what they loaded: load each rank's own shards (torch.distributed.checkpoint, at any EP size; one file "
            "per rank; or a whole state dict, full_state_dict(model), which every rank loads) on every rank again")


def _ranks_by(values: np.ndarray) -> list[list[int]]:
    """The ranks grouped by their value (a digest column of the all-gathered rows), sorted: [[0, 1, 3], [2]]."""
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(values.tolist()):
        groups.setdefault(v, []).append(r)
    return sorted(groups.values())


def _skipped(gathered: np.ndarray) -> str:
    load = refused_load(gathered)
    if load is not None:
        return load
    layers = gathered[:, LAYER]
    forward, calling = np.nonzero(layers >= 0)[0].tolist(), np.nonzero(layers < 0)[0].tolist()
    if (gathered[calling, CALLS] == ENTRY_RECOMPUTE).all():
        return _not_recomputed(calling, forward)
    return (f"MoELayer: {_by_entry(gathered, calling)}, while EP rank(s) {forward} went on to the next forward "
            "without it: a part of the training step was skipped on some ranks only, as the loop's own condition "
            "does, or a torch.amp.GradScaler not attached with the optimizer when an overflow in one rank's expert "
            "gradients (which that rank alone sees) skips its step there; or the ranks ran different numbers of "
            "forwards (a data loader that gives some ranks fewer micro-batches). Their collectives would never meet; "
            "every rank stops here. Run the same per-step calls on every rank; pass a scaler with the optimizer: "
            "attach_optimizer(optimizer, scaler=scaler) (feplb.hf.attach_optimizer(model, optimizer, scaler) for "
            "a model), which agrees its inf check over the EP group. The ranks' experts may already differ in "
            "their steps: rebuild the model (or restart the processes) and resume from a checkpoint")


def _not_recomputed(recomputing: list[int], forward: list[int]) -> str:
    return (f"MoELayer: EP rank(s) {recomputing} recompute a checkpointed forward of this layer in their backward, "
            f"while EP rank(s) {forward} went on to the next forward without recomputing it: under reentrant "
            "activation checkpointing (use_reentrant=True) a rank whose checkpointed block's inputs need no grad "
            "never recomputes it (its output needs no grad), or the backward of that forward was skipped on some "
            "ranks only. The recompute moves rows between the ranks, so every rank must run it: make the inputs of "
            "the checkpointed block need grad on every rank alike (or use use_reentrant=False), and run every "
            "backward on every rank; every rank stops here")


def read_recompute(gathered: np.ndarray) -> None:
    """Read the all-gathered rows of a recompute's search for its record (``step_row`` with ``ENTRY_RECOMPUTE``),
    raising on every rank together where some rank went on to the next forward, is in another call, or recomputes
    another layer."""
    layers, calls = gathered[:, LAYER], gathered[:, CALLS]
    if (layers >= 0).any() or (calls != ENTRY_RECOMPUTE).any():
        read_step(gathered)     # (raises: the ranks are in different calls)
    if (layers != layers[0]).any():
        raise RuntimeError(f"MoELayer: the EP ranks recompute different MoE layers at once (layer number per EP rank: "
                           f"{(-1 - layers).tolist()}); every rank must run the backward of every MoE layer, in the "
                           "same order")


def read_step(gathered: np.ndarray) -> None:
    """Read a handshake's all-gathered rows (``step_row`` from ranks in a call between a backward and the next
    forward, a forward's counts row from a rank already in the next forward), raising on every rank together where
    the ranks are not all in the same call, or some rank's call is refused."""
    layers = gathered[:, LAYER]
    load = refused_load(gathered)
    if load is not None:
        raise ValueError(load)
    if (layers >= 0).any():
        raise RuntimeError(_skipped(gathered))
    calls = gathered[:, CALLS]
    if (calls != calls[0]).any() or (layers != layers[0]).any():
        where = _by_entry(gathered, list(range(len(calls))))
        raise RuntimeError(
            f"MoELayer: the EP ranks are in different calls after the backward ({where}; the layer's number per "
            f"EP rank: {(-1 - layers).tolist()}): a call skipped on some ranks only, or "
            "optimizers attached to different layers. Run the same per-step calls on every rank, and attach the "
            "same optimizers to the same layers, in the same order")
    # (before the arguments' digests: a rank with such a group passed another size, or the same one not new to
    # its layers, and the digests' message would name the size or the flag, not the group)
    bad_dp = np.nonzero(gathered[:, PROBLEM] & STEP_PROBLEM_BAD_DP_GROUP)[0].tolist()
    if bad_dp:
        raise ValueError(
            f"MoELayer: the data_parallel_group average_expert_grads was given on EP rank(s) {bad_dp} cannot be "
            "theirs: it holds other ranks of the layer's own EP group, which hold other experts (whose gradients "
            "it would add into each shard's, silently), or not the rank itself. Nothing was done, on any rank. "
            + DP_GROUP_HINT)
    digests = gathered[:, DIGEST]
    if (digests != digests[0]).any():
        raise ValueError(
            f"MoELayer: {ENTRY_ARGS.get(int(calls[0]), 'the arguments of ' + ENTRIES.get(int(calls[0]), '?'))} "
            f"differs across ranks (EP ranks grouped by what they passed: {_ranks_by(digests)}): every rank "
            "must pass the same (each rank would otherwise scale its gradients by another factor, or run other "
            "collectives); nothing was done, on any rank")
    unaveraged = np.nonzero(gathered[:, PROBLEM] & STEP_PROBLEM_NOT_AVERAGED)[0].tolist()
    if unaveraged:
        raise RuntimeError(not_averaged(unaveraged))
    unattached = np.nonzero(gathered[:, PROBLEM] & STEP_PROBLEM_UNATTACHED_SCALER)[0].tolist()
    if unattached:
        raise RuntimeError(
            f"MoELayer: a torch.amp.GradScaler not attached with the optimizer steps the optimizer attached to this "
            f"layer on EP rank(s) {unattached}: its inf / NaN check is each rank's own, so a step it skips on one "
            "rank only leaves the others in this step's collectives, and it unscales the gradients before the "
            "per-step copies' share (weights='per-step') is reduced into them. Pass it: "
            "attach_optimizer(optimizer, scaler=scaler) (feplb.hf.attach_optimizer(model, optimizer, scaler) for a "
            "model). Nothing was stepped, but the scaler has unscaled this step's gradients in place: after "
            "attaching it, zero them and run the step again from its backward")


def _frozen_apart(gathered: np.ndarray, within: int) -> tuple[list[int], list[list[int]]] | None:
    """The first block of ranks whose FROZEN fields differ (the ranks, and them grouped by that field), or None:
    blocks of ``within`` consecutive ranks (a node's, where per-step copies stay in their node), or the whole group
    (``within`` 0)."""
    frozen = gathered[:, FROZEN]
    n = within or len(frozen)
    blocks = frozen.reshape(-1, n)       # (the forward's fast path: one comparison, however many nodes)
    apart = np.flatnonzero((blocks != blocks[:, :1]).any(axis=1))
    if not apart.size:
        return None
    start = int(apart[0]) * n
    return list(range(start, start + n)), [[start + r for r in g] for g in _ranks_by(frozen[start:start + n])]


def read_counts(gathered: np.ndarray, slots_WS: np.ndarray, *, balance: bool, min_straggler: float,
                frozen_within: int = 0, refused: list[str | None] | None = None) -> Counts:
    """Read the all-gathered rows (int64 [W, len(HEADER) + E + padding]: this rank's routing flags (1: NaN or inf,
    2: ids out of range), its replicas-stale flag, its bad-input flag, the number of the layer it runs, how it
    calls it (bits: 1 training mode, 2 autograd on, 4 ``forward_dispatched``, 8 saved-tensor hooks active with
    autograd on, 16 inside a reentrant checkpoint whose inputs need grad), the digest of its slow decisions,
    the steps its process's GradScalers skipped (``feplb.training.scaler_skips``), whether it dropped the experts'
    gradients while per-step copies held theirs, a digest of which of its expert parameters require grad (0 where the
    layer keeps no per-step copies of other ranks' experts), whether its rows or expert parameters need grad (autograd
    on; or-ed over the ranks: ``Counts.needs_grad``), a digest of the per-layer calls made over the group since its
    last forward (``feplb.training.forward_began``: which call, for which layers; 0 for none);
    then the counts per flat slot), raising on every rank together when any rank reported a problem or the
    ranks run different layers, in different modes, from different histories, after GradScalers skipped different
    steps or with experts frozen apart. The header comes first, so the layer numbers are read alike
    whatever layer (and number of experts) each rank runs.

    slots_WS: int64 [W, L] the experts at home on each GPU. balance: the policy balances (and W > 1).
    min_straggler: rows of token straggler below which balancing is not worth it. frozen_within: the ranks whose
    FROZEN fields must agree: blocks of that many consecutive ranks (a node's), or all of them (0).
    refused: each rank's error where it refused its input (None where it did not), to say in the error raised here.
    """
    W, L = slots_WS.shape
    E = W * L
    # The usual case first: no rank reports a problem, flag, stale copy or dropped gradient, and every rank runs the
    # same layer, the same way, from the same history and steps: nothing below can raise (one comparison instead of
    # about twenty small numpy reductions). Otherwise the checks below run in full and raise as they always did.
    head = gathered[:, :len(HEADER)]
    if not (head[:, _ZERO_COLS].any() or (head[:, _EQUAL_COLS] != head[0, _EQUAL_COLS]).any()
            or head[0, LAYER] < 0 or (head[:, FROZEN].any() and _frozen_apart(gathered, frozen_within))):
        return _counts(gathered, slots_WS, W, L, balance=balance, min_straggler=min_straggler)
    layers = gathered[:, LAYER]
    if (layers < 0).any():      # ranks in a call between the backward and this forward that this rank skipped
        load = refused_load(gathered)
        raise RuntimeError(_skipped(gathered)) if load is None else ValueError(load)
    if (layers != layers[0]).any():
        raise RuntimeError(
            f"MoELayer: the EP ranks ran different MoE layers in one forward (layer number per EP rank: "
            f"{layers.tolist()}); every rank of the EP group must run every MoE layer's forward, in the same order. "
            "A model that skips an experts module on some ranks (say, a multimodal model's vision experts on a "
            "micro-batch without images) cannot run under expert parallelism as it is; every rank stops this step")
    # how each rank calls (_CALL_BITS), compared over the ranks without a problem of their own (theirs is raised
    # below; the caller has none, so there is at least one)
    ranks = np.nonzero(gathered[:, PROBLEM] == 0)[0]
    calls = gathered[ranks, CALLS]
    for bit, what, on, off, advice in _CALL_BITS:
        got = (calls & bit) != 0
        if (got != got[0]).any():
            raise RuntimeError(f"MoELayer: the EP ranks {what} ({on} on EP rank(s) {ranks[got].tolist()}, {off} on "
                               f"{ranks[~got].tolist()}); {advice}")
    casts = calls >> AUTOCAST_SHIFT
    if (casts != casts[0]).any():
        names = [str(AUTOCASTS[c]).removeprefix("torch.") if c < len(AUTOCASTS) else "another dtype" for c in casts]
        raise RuntimeError(
            f"MoELayer: the EP ranks run this layer under different torch.autocast settings (per EP rank: "
            f"{dict(zip(ranks.tolist(), [n.replace('None', 'off') for n in names], strict=True))}): a row balancing "
            "moves to another rank would be computed under that rank's autocast, not its own. Run the forward under "
            "the same torch.autocast (device type and dtype) on every rank")
    rounds = gathered[ranks, ROUNDS]
    if (rounds != rounds[0]).any():
        raise RuntimeError(
            f"MoELayer: the EP ranks made different per-layer calls (reduce_replica_grads, refresh_replicas, "
            f"average_expert_grads) since the group's last forward: EP ranks grouped by the calls and layers: "
            f"{_ranks_by(rounds)}. Each handshakes once per round, so a rank that left out a layer (average_expert_"
            "grads of one layer of two, say) went unseen there, and its experts' gradients or copies now differ from "
            "the others' (a rank dividing one layer's gradients alone steps them at another scale): call them for "
            "every layer on every rank alike. The ranks' experts may already differ: this step is refused on every "
            "rank; resume from a checkpoint")
    skips = gathered[ranks, SKIPS]
    if (skips != skips[0]).any():
        raise RuntimeError(
            f"MoELayer: the EP ranks' torch.amp.GradScalers skipped different numbers of optimizer steps (steps "
            f"skipped per EP rank: {dict(zip(ranks.tolist(), skips.tolist(), strict=True))}), as a scaler not "
            "attached does when an overflow in one rank's expert gradients (which that rank alone sees) skips its "
            "step and lowers its scale there only: the ranks then scale their losses apart, and every expert's "
            "gradient sums them. "
            "Pass the scaler to attach_optimizer(optimizer, scaler=scaler) (feplb.hf.attach_optimizer(model, "
            "optimizer, scaler) for a model), which agrees its inf check over the EP group, and step the optimizer "
            "on every rank alike. The ranks' experts already differ in their steps: this layer refuses every forward "
            "from here; rebuild the model (or restart the processes) and resume from a checkpoint")
    digests = gathered[:, DIGEST]
    if (digests != digests[0]).any():
        raise RuntimeError(
            f"MoELayer: the EP ranks plan from different balancing state (policy history and placement), EP ranks "
            f"grouped by what they hold: {_ranks_by(digests)}; every rank must run the same forwards in the "
            "same mode and restore the same PolicyState")
    apart = _frozen_apart(gathered, frozen_within)
    if apart is not None:
        raise RuntimeError(
            f"MoELayer: the EP ranks' expert parameters differ in which of them require grad (EP ranks "
            f"{apart[0]} grouped by their experts' requires_grad flags: {apart[1]}), and this layer keeps per-step "
            "copies of experts on other ranks (weights='per-step' with feplb, feplb-split or lp @ema, +place or "
            "eplb): a copy takes its holder's flags, so the share of a trainable expert's gradient computed on a "
            "rank whose own experts are frozen would be lost. Freeze (requires_grad_) the expert parameters alike "
            "on every EP rank (the same local parameters: with weights='per-step' a rank cannot freeze experts the "
            "others train), or use weights='per-microbatch', whose copies return their gradients to the owners as "
            "they are (there experts frozen on some ranks only train as in plain EP)")
    input_ranks = np.nonzero(gathered[:, PROBLEM])[0].tolist()
    if input_ranks:
        said: dict[str, list[int]] = {}
        for r in input_ranks:
            if refused is not None and refused[r]:
                said.setdefault(refused[r], []).append(r)
        why = "; ".join(f"on EP rank(s) {ranks}: {error}" for error, ranks in said.items()) if said else \
            "a malformed input, or what feeds the layer there; see the error on that rank"
        raise ValueError(f"MoELayer: EP rank(s) {input_ranks} refused this forward ({why}); every rank stops this "
                         "step")
    id_ranks = np.nonzero(gathered[:, FLAGS] & 2)[0].tolist()
    if id_ranks:
        raise ValueError(f"MoELayer: routing passed to forward() holds expert ids outside [0, {E}) on EP rank(s) "
                         f"{id_ranks} (-1 only with FEPLBConfig.masked_routes: a slot routed to no expert)")
    bad_ranks = np.nonzero(gathered[:, FLAGS])[0].tolist()
    if bad_ranks:
        raise NonFiniteRoutingError(f"MoELayer: router logits (or routing weights, or the router's selection "
                                    f"bias) contain NaN or inf on EP rank(s) {bad_ranks}; check the input and the "
                                    "router weights")
    dropped_ranks = np.nonzero(gathered[:, DROPPED])[0].tolist()
    if dropped_ranks:
        raise RuntimeError(
            f"MoELayer: the experts' gradients were dropped or changed in place (zero_grad: the model's, or an "
            f"optimizer's not attached to the layer, or Megatron's zero_grad_buffer; or an in-place op on them) on "
            f"EP rank(s) {dropped_ranks} while "
            "the per-step expert copies there still held their share of the same backward: they are not "
            "parameters, zero_grad does not reach them, and the next reduction would add them, as they are, to the "
            "experts' gradients. Drop them with the experts' gradients: layer.zero_grad(), "
            "layer.zero_replica_grads() (zero_replica_grads(model) of feplb.hf, feplb.megatron or feplb.titan for a "
            "model), or attach the optimizer "
            "(attach_optimizer), whose zero_grad() then does it; then go on (or change the gradients only after "
            "reduce_replica_grads(), as average_expert_grads and feplb.clip_grad_norm_ do)")
    stale_ranks = np.nonzero(gathered[:, STALE])[0].tolist()
    if stale_ranks:
        unfinished = np.nonzero(gathered[:, STALE] & 4)[0].tolist()
        if unfinished:
            raise RuntimeError(
                f"MoELayer: the per-step expert copies on EP rank(s) {unfinished} were not refreshed: a "
                "refresh_replicas(), or the step of an optimizer attached to the layer (whose step hook "
                "refreshes them), raised before the refresh completed. Call layer.refresh_replicas() on every rank "
                "(feplb.hf.refresh_replicas(model) for a model) before the next forward (weights='per-step')")
        if (gathered[stale_ranks, STALE] & 2).all():
            # the attached optimizer's step refreshed the copies, and the weights changed after it
            raise RuntimeError(
                f"MoELayer: expert weights changed since the last refresh_replicas() on EP rank(s) {stale_ranks}, "
                "after the last step of the optimizer attached to the layer (which refreshes the copies), or before "
                "its first step, after the copies were first made: written there (copied back from fp32 master "
                "weights, loaded, set through .data?). Call "
                "layer.refresh_replicas() (refresh_replicas(model) of feplb.hf, feplb.megatron or feplb.titan for a "
                "model) after such a write (weights='per-step'); where it follows every step, "
                "do not attach that optimizer: call layer.reduce_replica_grads() before its step and "
                "layer.refresh_replicas() after the write")
        raise RuntimeError(f"MoELayer: expert weights changed since the last refresh_replicas() on EP rank(s) "
                           f"{stale_ranks}; call layer.refresh_replicas() (refresh_replicas(model) of feplb.hf, "
                           "feplb.megatron or feplb.titan for a model) after optimizer.step() or a load "
                           "(weights='per-step'), or layer.attach_optimizer(optimizer) once")
    return _counts(gathered, slots_WS, W, L, balance=balance, min_straggler=min_straggler)


# header columns that are 0 on every rank, and columns equal on every rank, when nothing is wrong (read_counts; and
# FROZEN equal over the ranks that share per-step copies: _frozen_apart)
_ZERO_COLS = [FLAGS, STALE, PROBLEM, DROPPED]
_EQUAL_COLS = [LAYER, CALLS, DIGEST, SKIPS, ROUNDS]


def _counts(gathered: np.ndarray, slots_WS: np.ndarray, W: int, L: int, *, balance: bool,
            min_straggler: float) -> Counts:
    """The counts part of :func:`read_counts`, once its header passed."""
    from feplb.sched.metrics import token_straggler

    E = W * L
    counts_WS = np.ascontiguousarray(gathered[:, len(HEADER):len(HEADER) + E])
    counts_WE = np.empty_like(counts_WS)
    counts_WE[:, slots_WS.reshape(-1)] = counts_WS
    loads_home = counts_WS.sum(axis=0).reshape(W, L).sum(axis=1)
    want = balance and token_straggler(loads_home) >= max(min_straggler, 1e-9)
    return Counts(counts_WS=counts_WS, counts_WE=counts_WE,
                  loads_default_W=counts_WE.sum(axis=0).reshape(W, L).sum(axis=1), loads_home_W=loads_home,
                  want_plan=bool(want), needs_grad=bool(gathered[:, NEEDS].any()))


def plan_digest(plan) -> int:
    """62 bits of what a plan makes the ranks exchange and compute (its moves, weight copies, dynamic sets and
    loads), equal on every rank that made the same plan: Python's hash() of tuples of ints is not salted per
    process, unlike its hash of strings and bytes. Cheap enough for every micro-batch: no repr and no sha256 of the
    whole fingerprint (``Plan.fingerprint``), whose cost grew with the plan's size."""
    return hash((plan.moves, plan.weight_copies, tuple(plan.dynamic_WD.ravel().tolist()),
                 tuple(plan.loads_after_W.tolist()))) & ((1 << 62) - 1)


def layer_stats(config: FEPLBConfig, counts: Counts, p2, plan, *, recv_grew: bool, experts_placed: int,
                planned_ranks: range | None = None) -> LayerStats:
    """What one forward did (``LayerStats``), from its counts and its executed phase 2 (``feplb.phase2.Phase2``);
    copy bytes are counted from the items exchanged (in-node exchanges carry the moves' rows first, then weights;
    with ``recopy_weights`` the weights in an exchange of their own, counted once: the forward's copies).
    planned_ranks: the GPUs this rank plans for (its node's under a node plan), None for all; the stragglers are
    taken over them."""
    from feplb.sched.metrics import token_straggler

    after = counts.loads_home_W.copy()
    for m in p2.moves:
        after[m.src] -= m.rows
        after[m.dst] += m.rows
    elem = torch.empty((), dtype=config.dtype).element_size()
    items = (p2.exchange.items if p2.exchange is not None else []) + \
        (p2.wexchange.items if p2.wexchange is not None else [])
    n_rows = len(p2.moves) if p2.layout is not None else 0
    row_bytes = sum(it.numel for it in items[:n_rows]) * elem
    w_bytes = sum(it.numel for it in items[n_rows:]) * elem
    W = counts.loads_home_W.size
    w_in = [0] * W
    for it in items[n_rows:]:
        w_in[it.dst] += it.numel * elem
    ranks = range(W) if planned_ranks is None else planned_ranks
    scope = slice(ranks.start, ranks.stop)
    dyn = np.asarray(plan.dynamic_WD) if plan is not None else np.zeros((W, 0), np.int64)
    return LayerStats(
        loads_before_W=counts.loads_default_W.tolist(), loads_after_W=after.tolist(),
        token_straggler_before=float(token_straggler(counts.loads_default_W[scope])),
        token_straggler_after=float(token_straggler(after[scope])), planned_ranks=list(ranks),
        rows_moved=sum(m.rows for m in p2.moves),
        copy_bytes=2 * row_bytes + w_bytes + p2.bank_bytes, weight_copies=len(p2.copies),
        plan_us=p2.result.plan_us, balanced=plan is not None, fell_back=p2.fell_back,
        plan_fingerprint=plan_digest(plan) if plan is not None else 0, recv_grew=recv_grew,
        policy=config.policy, dynamic_WD=dyn.tolist(), experts_placed=experts_placed,
        rows_at_home_W=counts.loads_home_W.tolist(), counts_WE=counts.counts_WE.tolist(),
        row_bytes_moved=row_bytes, weight_bytes_moved=w_bytes, weight_bytes_in_W=w_in)


def join_stats(per_rank: list[LayerStats]) -> dict:
    """The whole EP group's balancing from every rank's ``LayerStats`` of one forward (e.g. gathered with
    ``torch.distributed.all_gather_object``): each GPU's rows after balancing from a rank that planned it (with
    an in-node policy on several nodes a rank reports its own node, ``LayerStats.planned_ranks``).

    Returns, over all GPUs: "loads_after_W", "weight_bytes_in_W" (each GPU's from a rank that planned it),
    "token_straggler_before", "token_straggler_after", "rows_moved",
    "row_bytes_moved", "weight_bytes_moved", "weight_copies" (summed over the distinct planned scopes),
    "copy_bytes" (those plus the per-micro-batch placement bank, which every rank counts for the whole group once)
    and "fell_back" (on any rank).
    Raises ValueError when a GPU is reported by no rank, two ranks disagree on a GPU, or rows are lost."""
    from feplb.sched.metrics import token_straggler

    if not per_rank:
        raise ValueError("join_stats: no stats given")
    before = per_rank[0].loads_before_W
    after: list[int | None] = [None] * len(before)
    scopes: dict[tuple[int, ...], LayerStats] = {}
    for r, st in enumerate(per_rank):
        if st.loads_before_W != before:
            raise ValueError(f"join_stats: rank {r}'s loads_before_W differ from rank 0's (not the same forward)")
        if not st.planned_ranks:
            raise ValueError(f"join_stats: rank {r}'s stats name no planned_ranks")
        for g in st.planned_ranks:
            if after[g] is not None and after[g] != st.loads_after_W[g]:
                raise ValueError(f"join_stats: ranks disagree on GPU {g}'s rows after balancing "
                                 f"({after[g]} vs rank {r}'s {st.loads_after_W[g]})")
            after[g] = st.loads_after_W[g]
        scopes.setdefault(tuple(st.planned_ranks), st)
    missing = [g for g, v in enumerate(after) if v is None]
    if missing:
        raise ValueError(f"join_stats: no rank reported GPUs {missing}")
    if sum(after) != sum(before):
        raise ValueError(f"join_stats: {sum(after)} rows after balancing, {sum(before)} before")
    first = per_rank[0]
    bank = first.copy_bytes - 2 * first.row_bytes_moved - first.weight_bytes_moved
    out = {"loads_after_W": after, "token_straggler_before": float(token_straggler(before)),
           "token_straggler_after": float(token_straggler(after)),
           "fell_back": any(st.fell_back for st in per_rank)}
    for key in ("rows_moved", "row_bytes_moved", "weight_bytes_moved", "weight_copies"):
        out[key] = sum(getattr(st, key) for st in scopes.values())
    w_in = [0] * len(before)
    for st in scopes.values():
        for g in st.planned_ranks:
            w_in[g] = st.weight_bytes_in_W[g] if st.weight_bytes_in_W else 0
    out["weight_bytes_in_W"] = w_in
    out["copy_bytes"] = bank + 2 * out["row_bytes_moved"] + out["weight_bytes_moved"]
    return out
