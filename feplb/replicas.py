"""Expert weights held besides their owner: per-step replicas, the bank of placed experts, and their gradients.

An expert is OWNED by one rank (its parameters and optimizer state live there, ``MoELayer.expert_weights()``).
Other GPUs hold copies of it when

* a ``+place`` placement computes it elsewhere (its HOME): that GPU keeps a bank of the weights of every expert
  placed on it (its SLOTS), built once per step (weights='per-step') or sent by the owners every micro-batch
  (weights='per-microbatch', a differentiable exchange);
* the policy state keeps a resident replica of it there (``PolicyState.resident``: ``@ema`` dynamic sets, EPLB
  replicas), weights='per-step' only: a per-step bank of replicas, so a plan copies rows only for those;
* a plan copied it there in this step under lazy ``@ema`` replicas (``FEPLBConfig.replicas='lazy'``,
  ``PolicyState.reads_plans``), weights='per-step' only: the copies a micro-batch received are held (``hold``)
  until the next refresh, and the plans after it find them resident.

Per-step copies (held ones too) are leaves whose gradients accumulate over the step's micro-batches;
``reduce_grads`` sends them to the owners once per step. Each forward takes them through a node of its own that
holds its expert parameters' requires_grad flags (``Replicas.view``), so that each backward trains through the
copies what plain EP's graph of that forward trains: flags changed between forwards and backwards included.
Whatever a plan needs beyond these, ``Plan.weight_copies`` copies per micro-batch.

Staleness (per-step copies of weights the optimizer has changed) is detected without trusting version counters
alone: fused and foreach optimizers write parameters without bumping them, so a global optimizer step hook marks
the layer stale whenever any optimizer steps one of its expert parameters (``MoELayer.attach_optimizer`` instead
reduces and refreshes around the step, for the user), and a sample of the owners' bits taken when the copies are
made is compared at every forward (:meth:`Replicas.changed`), for writes neither sees (through ``.data`` outside an
optimizer).

Legend: L experts per GPU, H hidden, F ffn, S slots per GPU (= L).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from feplb.dispatch import Exchange
from feplb.layout import Item, weight_items, weight_sends
from feplb.recompute import hidden_from_selective_checkpoint

__all__ = ["Placement", "Replicas", "SlotWeights", "state_digest"]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Placement:
    """Where every expert is computed by default (its home), as seen from one rank."""

    home_E: np.ndarray                 # int64 [E]: home GPU of each expert
    slots_WS: np.ndarray               # int64 [W, L]: experts at home on each GPU, ascending ids
    my_slots: tuple[int, ...]          # this rank's slots
    slot_pos: dict[int, int]           # expert -> index among this rank's slots
    slot_of_E: np.ndarray              # int64 [E]: flat slot (home GPU * L + index) of each expert
    placed_pairs: tuple[tuple[int, int], ...]  # (expert, home) of every expert computed away from its owner
    own_slots: bool                    # this rank's slots are exactly the experts it owns

    @classmethod
    def of(cls, home_E: np.ndarray, num_ranks: int, rank: int) -> Placement:
        home = np.asarray(home_E, dtype=np.int64)
        E = home.size
        L = E // num_ranks
        slots = np.argsort(home, kind="stable").reshape(num_ranks, L)
        mine = tuple(int(e) for e in slots[rank])
        slot_of = np.empty(E, dtype=np.int64)
        slot_of[slots.reshape(-1)] = np.arange(E)
        placed = tuple((e, int(h)) for e, h in enumerate(home.tolist()) if h != e // L)
        return cls(home_E=home, slots_WS=slots, my_slots=mine, slot_pos={e: i for i, e in enumerate(mine)},
                   slot_of_E=slot_of, placed_pairs=placed, own_slots=mine == tuple(range(rank * L, rank * L + L)))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SlotWeights:
    """The weights one forward computes this rank's slots with: one tensor per part of the experts' weights
    (``MoELayer.part_shapes``: w1 [L, H, 2F], w2 [L, F, H], then b1 [L, 2F], b2 [L, H] where the experts have
    biases)."""

    parts: tuple[torch.Tensor, ...]
    tail: torch.Tensor    # empty; keeps the exchange that sent them (if any) in the graph
    copied_bytes: int     # bytes the owners sent for them this micro-batch
    gemm_parts: tuple[torch.Tensor, ...] | None = None   # in the GEMMs' dtype under torch.autocast (``for_gemms``)

    def gemm(self) -> tuple[torch.Tensor, ...]:
        """The weights the GEMMs take: cast once per forward under autocast, else the parts themselves."""
        return self.parts if self.gemm_parts is None else self.gemm_parts

    def for_gemms(self) -> SlotWeights:
        """These weights with their GEMM copies cast to the autocast dtype now, when ``torch.autocast`` is on for
        their device (call on the forward's thread: autocast's state is the thread's). Every GEMM of the forward
        then shares one cast (one pass over the weights) instead of casting the whole bank at each launch; the
        parts, which the copy path sends, keep the layer's dtype, and so do biases (added after the GEMM, in the
        wider dtype)."""
        from feplb.experts import derived_cast
        from feplb.kernels import autocast_matmul_inputs

        cast = autocast_matmul_inputs(*self.parts[:2])
        if all(a is b for a, b in zip(cast, self.parts[:2], strict=True)):
            return self
        derived_cast(cast, self.parts[:2])   # casts of weights an adapter derives: derived again in the backward
        return dataclasses.replace(self, gemm_parts=(*cast, *self.parts[2:]))


_SAMPLED = 128   # elements per local expert in the staleness sample (Replicas.changed), over all its parameters
_SAMPLED_MIN = 16   # and at least this many per parameter


def _places(params: list[torch.Tensor], experts: int) -> list[torch.Tensor]:
    """Fixed random places in each parameter (row-major element numbers, for ``torch.take``, whatever its
    strides), on its device: ``_SAMPLED`` per expert over all the parameters, shared by their sizes (an adapter with
    one parameter per expert, Megatron's, gets as many as one with every expert in one tensor), at least
    ``_SAMPLED_MIN`` each."""
    total = sum(p.numel() for p in params) or 1
    out = []
    for k, p in enumerate(params):
        n = p.numel()
        count = min(n, max(_SAMPLED_MIN, round(_SAMPLED * max(experts, 1) * n / total)))
        idx = torch.randint(max(n, 1), (count,), generator=torch.Generator().manual_seed(0x5EED + k))
        if p.device.type == "cuda":   # from pinned memory: no host sync
            idx = idx.pin_memory().to(p.device, non_blocking=True)
        out.append(idx.to(p.device))
    return out


def _where(params) -> list:
    """What the sampled places depend on: the parameters' identity, shape, dtype and device."""
    return [(id(p), p.shape, p.dtype, p.device) for p in params]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as bytes: compared bit for bit (a NaN equals itself), whatever their dtype."""
    return t.contiguous().view(torch.uint8).reshape(-1)


class Replicas:
    """The per-step copies of one layer on one rank (see the module docstring). ``layer`` is the owning
    ``MoELayer`` (held weakly): its ``expert_weights()``, ``comm``, ``control`` and sizes."""

    def __init__(self, layer):
        self._layer = weakref.ref(layer)
        self.pairs: tuple[tuple[int, int], ...] = ()     # (expert, gpu != owner) holding a per-step copy
        self.replica_of: dict[int, int] = {}             # expert -> index in the replica bank (this rank)
        self.replica_bank: tuple[torch.Tensor, ...] | None = None   # leaves [N, H, 2F], [N, F, H] (, [N, 2F], [N, H])
        self.slot_bank: tuple[torch.Tensor, ...] | None = None      # leaves [L, H, 2F], [L, F, H] (, [L, 2F], [L, H])
        # lazy @ema replicas: (expert, gpu != owner) a plan copied this step, on any rank (a global fact: the plans
        # are agreed over the group), and this rank's held copies: expert -> (bank, index), banks of leaves
        self.lazy_pairs: frozenset[tuple[int, int]] = frozenset()
        self.held: dict[int, tuple[int, int]] = {}
        self.held_banks: list[tuple[torch.Tensor, ...]] = []
        # experts of the replica bank a forward with autograd on computed rows with, or sent weights from, since the
        # refresh: the others' gradients are zero, and the reduction sends none of them
        self.used: set[int] = set()
        self.ever_held = False        # some rank has held per-step copies (a global fact: pairs are global)
        self.generation = 0           # bumped by every refresh; a gradient of an older generation is late
        self.late_grad = False
        # indices into expert_params() of those that required grad when a backward reached the copies, since the
        # last reduction (the copies' gradient hook, _watch)
        self.trained: set[int] = set()
        # the expert parameters' requires_grad flags at every backward of the layer since the last reduction, as one
        # running digest (MoELayer._watch_backward_flags): the ranks sharing copies must agree on it at the reduction
        self.backward_flags = 0
        self.stepped = False          # an optimizer stepped the owner's parameters since the last refresh
        # a refresh began and has not completed (it raised: the copies' bookkeeping may name banks never received),
        # or an attached optimizer's step began whose refresh has not run (its step or a step hook raised)
        self.unfinished = False
        self._versions: tuple[int, ...] = ()
        # the running forward's expert parameters' requires_grad flags and grad mode (begin_forward), and the banks
        # as its graph takes them (view: bank id -> (bank, view))
        self._fwd: tuple[tuple[bool, ...], bool] | None = None
        self._views: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        # a sample of the owner's parameters' bits when the copies were made (the third check of staleness, for
        # writes nothing marks: through .data outside an optimizer, a master copy written back by hand), and
        # where it was taken: the parameters' _where and one index tensor per parameter
        self._sample = torch.zeros(0, dtype=torch.uint8)
        self._sample_key: list = []                      # _where of the parameters sampled (no reference kept)
        self._sample_places: list[torch.Tensor] = []

    # ------------------------------------------------------------------------------------------------ state
    def own_weights(self) -> tuple[torch.Tensor, ...]:
        """The layer's ``expert_weights()`` made with autograd on, also inside ``no_grad``: which parts need a
        gradient is read off them (``part_requires``), and the reduction adds the copies' share through them; a
        layer whose weights are computed from its parameters (cast, joined: ``feplb.titan``) would otherwise hand
        out weights that need none. Inside a forward such a layer hands out the weights that forward derived
        (``_join``, once per forward), without autograd in a forward under ``no_grad``: derived again here with it.
        Those a forward derived with autograd are handed out as they are, also where some parameters are frozen
        (their weights then need no gradient)."""
        lay = self._layer()
        with torch.enable_grad():
            ws = lay.expert_weights()
            join = getattr(lay, "_join", None)
            if join is not None and getattr(lay, "_joined", None) is not None and \
                    not getattr(lay, "_joined_with_grad", True) and any(p.requires_grad for p in lay.expert_params()):
                ws = join()
            return ws

    def versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._layer().expert_params())

    def requires(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self._layer().expert_params())

    def fresh(self) -> bool:
        """Whether the per-step copies still hold the owners' current weights (True when there are none; False
        after a refresh that did not complete)."""
        if self.unfinished:
            return False
        if not self.pairs and not self.lazy_pairs:
            return True
        return not self.stepped and self._versions == self.versions()

    def changed(self) -> torch.Tensor | None:
        """int64 [1] on the parameters' device, 1 where a sampled element of the owner's expert parameters has
        other bits than when the per-step copies were made (or the parameters were replaced, cast or moved),
        computed without a host sync (the forward's counts row carries it); None when there are no copies. A
        sample (``_SAMPLED`` elements per local expert, at fixed random places), so a write that changes a few
        elements only can escape it; the optimizer step hook and the version counters (:meth:`fresh`) catch every
        optimizer step and every in-place op. Never raises."""
        if (not self.pairs and not self.lazy_pairs) or not self._sample_key:
            return None
        params = list(self._layer().expert_params())
        if _where(params) != self._sample_key:
            return torch.ones(1, dtype=torch.int64, device=params[0].device if params else None)
        return (self._take(params, self._sample_places) != self._sample).any().reshape(1).to(torch.int64)

    def _mark(self) -> None:
        """Sample the owner's expert parameters now (the copies are being made from them)."""
        params = list(self._layer().expert_params())
        if _where(params) != self._sample_key:
            self._sample_places = _places(params, self._layer().num_local)
            self._sample_key = _where(params)
        self._sample = self._take(params, self._sample_places)

    @staticmethod
    @torch.no_grad()
    def _take(params: list[torch.Tensor], places: list[torch.Tensor]) -> torch.Tensor:
        """The sampled elements' bytes, all parameters in one uint8 tensor: one gather per parameter, one compare."""
        if not params:
            return torch.zeros(0, dtype=torch.uint8)
        return torch.cat([_bytes(torch.take(p.detach(), idx)) for p, idx in zip(params, places, strict=True)])

    def begin_forward(self, requires: tuple[bool, ...] | None = None) -> None:
        """Note the flags a forward starting now takes the per-step copies with: which expert parameters require
        grad (``requires``: a recompute's forward's, recorded; else now) and whether autograd is on. Every forward
        (and every replay of one) calls this before it reads a bank (:meth:`view`). Local."""
        self._fwd = (tuple(requires) if requires else self.requires(), torch.is_grad_enabled())
        self._views = {}

    def forward_requires(self) -> tuple[bool, ...]:
        """The flags the running forward takes the copies with (:meth:`begin_forward`), for its record."""
        return self.requires() if self._fwd is None else self._fwd[0]

    def view(self, bank: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
        """A bank of per-step copies (``replica_bank``, ``slot_bank``, one of ``held_banks``) as the running
        forward's GEMMs take it. The copies are leaves that keep requiring grad from the refresh on, and each
        forward takes them through a node of its own (:class:`_Gate`), which holds that forward's flags, as plain
        EP's graph holds its parameters' flags from its forward: a part that no parameter requiring grad then
        feeds is taken without a gradient, and the node's backward passes on only what comes from parameters that
        required grad at the forward and still do at the backward (autograd leaves alone one frozen since). Flags
        that change between the forwards of two micro-batches before their backwards then give each backward its
        own forward's flags. Under ``no_grad`` the bank itself (no graph is made). One view per bank and forward."""
        if bank is None:
            return None
        if self._fwd is None:
            self.begin_forward()
        req, grad = self._fwd
        if not grad:
            return bank
        hit = self._views.get(id(bank))
        if hit is not None and hit[0] is bank:
            return hit[1]
        diff = self.part_requires(req)
        out = _gate(weakref.ref(self), self.generation, req, diff, bank) if any(diff) else \
            tuple(t.detach() for t in bank)
        self._views[id(bank)] = (bank, out)
        return out

    @hidden_from_selective_checkpoint
    def part_requires(self, req: tuple[bool, ...]) -> tuple[bool, ...]:
        """For each part of the experts' weights (``MoELayer.part_shapes``), whether a parameter requiring grad
        under the flags ``req`` feeds it (where a layer joins several parameters into one part, torchtitan's
        [w1 | w3], any of them). Cached per set of flags; read off the weights the layer derives when ``req`` are
        the flags now, else off their masks (:meth:`_masks`). Outside the dispatch modes: a recompute under
        selective activation checkpointing dispatches its forward's ops only, and this may compute (once per set
        of flags, on some ranks only: the cache is each rank's)."""
        n = len(self._layer().part_shapes)
        if all(req):
            return (True,) * n
        if not any(req):
            return (False,) * n
        cache = self.__dict__.setdefault("_part_req", {})
        hit = cache.get(req)
        if hit is None:
            if req == self.requires():
                hit = tuple(w.requires_grad for w in self.own_weights())
            else:
                hit = tuple(bool(m.any()) for m in self._masks(req))
            cache[req] = hit
        return hit

    def grads_clean(self) -> bool:
        return not any(_grad(w) is not None for w in self._held())

    def zero_grads(self) -> None:
        """Drop the gradients the per-step copies accumulated (what ``zero_grad`` does to the owners'): a backward
        whose gradients the training loop discards must not reach the owners at the next reduction; nor do they
        count as trained any more (``trained``: a backward sets it)."""
        self.trained = set()
        self.backward_flags = 0
        for w in self._held():
            w.grad = None
            w._feplb_grad32 = None

    def _held(self) -> list[torch.Tensor]:
        return list(self.replica_bank or ()) + list(self.slot_bank or ()) + [w for b in self.held_banks for w in b]

    def all_pairs(self) -> list[tuple[int, int]]:
        """Every (expert, GPU) holding a per-step copy besides the owner, refreshed or held (identical on every
        rank), in a fixed order."""
        return sorted(set(self.pairs) | self.lazy_pairs)

    def _watch(self, leaf: torch.Tensor, *, slot: bool = False) -> torch.Tensor:
        """A per-step leaf (requiring grad from now on: each forward's node, :meth:`view`, decides what of it a
        backward trains). A bf16 / fp16 leaf sums its micro-batches' gradients in fp32 (``_grad``), as the owner's
        fp32 parameters (mixed precision) or an fp32 main-grad buffer do: summed in the leaf's own dtype, the most
        loaded experts', whose copies take the most rows, would lose precision with every micro-batch of the step.
        slot: a leaf of the ``+place`` bank, which the GEMMs read instead of the owner's parameters: each gradient
        it accumulates also gives those a zero gradient where they hold none (``MoELayer._hold_zero_grads``)."""
        leaf.requires_grad_(True)
        me = weakref.ref(self)
        if slot and not getattr(leaf, "_feplb_slot", False):
            leaf._feplb_slot = True

            def owners(_leaf: torch.Tensor) -> None:
                rep = me()
                lay = rep._layer() if rep is not None else None
                if lay is not None:
                    lay._hold_zero_grads()

            leaf.register_post_accumulate_grad_hook(owners)
        if leaf.dtype in (torch.bfloat16, torch.float16) and not getattr(leaf, "_feplb_wide", False):
            leaf._feplb_wide = True
            leaf.register_post_accumulate_grad_hook(_widen)
        return leaf

    @hidden_from_selective_checkpoint
    def _masks(self, req: tuple[bool, ...]) -> tuple[torch.Tensor, ...]:
        """One tensor per part of the experts' weights, shaped as the owner's: 1 where the element comes from a
        parameter requiring grad under the flags ``req``, 0 where from one that does not (the layer's ``_join`` of
        0 / 1 tensors shaped as its parameters, where it derives its weights from them). Made once per set of
        flags (the last one kept)."""
        lay = self._layer()
        params = lay.expert_params()
        key = (req, tuple((p.device, p.dtype) for p in params))
        cache = self.__dict__.get("_keep_masks")
        if cache is None or cache[0] != key:
            with torch.no_grad():
                flags = [torch.full(p.shape, float(r), dtype=p.dtype, device=p.device)
                         for p, r in zip(params, req, strict=True)]
                join = getattr(lay, "_join", None)
                masks = tuple(m.detach() for m in (join(*flags) if join is not None else flags))
            self._keep_masks = cache = (key, masks)
        return cache[1]

    def _keep(self, part: int, rows: tuple[int, ...], req: tuple[bool, ...]) -> torch.Tensor | None:
        """What of a gradient of part ``part``'s copies (of the owners' local experts ``rows``, one per copy) reaches
        the owners under the flags ``req``: None where every expert parameter requires grad, else the copies' rows
        of :meth:`_masks`. The owners' flags are read off this rank's parameters: the ranks freeze alike (a
        forward with the ranks' flags apart is refused on every rank, ``MoELayer._frozen_code``, and a reduction
        after a backward that ran with them apart, ``MoELayer._watch_backward_flags``)."""
        if all(req):
            return None
        return self._masks(req)[part][list(rows)]

    def mark_used(self, e: int) -> None:
        """Note that this forward computes with (or sends) this rank's replica of expert e: its gradient may be
        nonzero (only with autograd on; the forward's thread)."""
        if torch.is_grad_enabled():
            self.used.add(e)

    def idle_flags(self, placement: Placement) -> torch.Tensor:
        """int64 [len(all_pairs())]: 0 where this rank holds that pair's copy and may have a gradient to send, 1
        elsewhere: where it holds none, or holds a replica (``replica_bank``) no forward of the step used (its
        gradient is zero). The bank of placed experts and lazy replicas' held copies always send (a plan computes
        with every held copy, and the static GEMM with every slot). Their MIN over the group is 0 exactly for the
        pairs whose holder sends."""
        r = self._layer().rank
        return torch.tensor([0 if g == r and (e in placement.slot_pos or e not in self.replica_of or e in self.used)
                             else 1 for e, g in self.all_pairs()], dtype=torch.int64)

    def agree(self, what: str, extra: torch.Tensor | None = None) -> tuple[bool, torch.Tensor | None]:
        """Raise on every rank together if some rank's per-step copies lost or kept gradients (collective).
        Returns whether every rank's copies are free of gradients, and the MIN over the group of ``extra`` (int64
        flags agreed in the same collective; None without)."""
        lay = self._layer()
        flags = torch.tensor([int(self.grads_clean()), int(not self.late_grad)])
        if extra is not None:
            flags = torch.cat([flags, extra])
        agreed = lay.control.all_reduce_min(flags, "group", f"{what} check")
        if int(agreed[1]) == 0:
            raise RuntimeError(f"MoELayer.{what}: a backward pass ran through expert weight copies that "
                               "refresh_replicas() had already replaced, so their gradients were lost; call "
                               "refresh_replicas() only after the backward of every earlier forward")
        if what == "refresh_replicas" and int(agreed[0]) == 0:
            raise RuntimeError(
                "MoELayer.refresh_replicas: replica gradients were not reduced on some rank: its per-step copies "
                "hold a backward's share since the last reduction, which a refresh would lose. Refresh after the "
                "step's reduction (reduce_replica_grads() before optimizer.step(), then refresh_replicas(); "
                "attach_optimizer does both), not between the micro-batches of a step; where the loop discarded "
                "that backward (model.zero_grad(), an optimizer not attached), drop the copies' share first: "
                "zero_replica_grads() (layer.zero_grad() and an attached optimizer's zero_grad() do). If an "
                "optimizer stepped since that backward without the reduction, its step missed the copies' share of "
                "the experts' gradients: run that step again from its backward")
        return bool(agreed[0]), None if extra is None else agreed[2:]

    # ------------------------------------------------------------------------------------------------ weights
    def owned(self, e: int, weights: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """This rank's weights of its own expert e (one per part), from ``weights`` (``expert_weights()``, fetched
        once by a caller that reads several: a layer may compute them from its parameters) or fetched now."""
        lay = self._layer()
        ws = weights if weights is not None else lay.expert_weights()
        i = e - lay.rank * lay.num_local
        return tuple(w[i] for w in ws)

    def exchange_weights(self, copies: list[tuple[int, int, int]],
                         weights: tuple[torch.Tensor, ...] | None = None,
                         ) -> tuple[list[Item], dict[int, torch.Tensor], dict[tuple[int, int], int]]:
        """Exchange items for the owners' weights of experts (expert, owner, dst) (``feplb.layout.weight_items``,
        identical on every rank), sent from ``weights`` (this rank's ``expert_weights()``; fetched when None).
        Returns (items, {item: tensor this rank sends}, {(expert, dst): k}): copy k's part j is item
        ``j * len(copies) + k``."""
        lay = self._layer()
        sizes = lay.part_sizes
        items = weight_items(copies, sizes)
        sends = {}
        mine = weights if weights is not None else lay.expert_weights()
        for k, (_, j, e) in weight_sends(copies, lay.rank, 0, len(sizes)).items():
            sends[k] = self.owned(e, mine)[j].reshape(-1)
        return items, sends, {(e, d): k for k, (e, _, d) in enumerate(copies)}

    def _received(self, got: dict, k: int, n: int) -> tuple[torch.Tensor, ...]:
        """Copy k's parts from the items an exchange of ``n`` copies received, in their shapes."""
        return tuple(got[j * n + k].view(shape) for j, shape in enumerate(self._layer().part_shapes))

    def _bank(self, ws: list[tuple[torch.Tensor, ...]], experts: list[int] | None = None, *,
              slot: bool = False) -> tuple[torch.Tensor, ...]:
        """The experts ``ws`` (one tuple of parts each) stacked part by part; with ``experts`` (their ids, in ``ws``'s
        order), as watched leaves (slot: of the ``+place`` bank, see ``_watch``)."""
        stacked = tuple(torch.stack([w[j] for w in ws]) for j in range(len(ws[0])))
        if experts is None:
            return stacked
        rows = tuple(e % self._layer().num_local for e in experts)
        for t in stacked:
            t._feplb_rows = rows     # (the owners' local experts, copy by copy: see _keep)
        return tuple(self._watch(t, slot=slot) for t in stacked)

    def forward_slot_weights(self, placement: Placement, anchor: torch.Tensor) -> SlotWeights:
        """This forward's weights of this rank's slots. With weights='per-microbatch' and experts placed away from
        their owners, the owners send them now (a differentiable exchange hung on ``anchor``)."""
        lay = self._layer()
        if lay.config.weights == "per-step" or not placement.placed_pairs:
            parts = self.view(self.slot_bank) if self.slot_bank is not None else lay.expert_weights()
            return SlotWeights(parts=tuple(parts), tail=anchor[:0].reshape(-1), copied_bytes=0)
        copies = [(e, e // lay.num_local, h) for e, h in placement.placed_pairs]
        own = lay.expert_weights()
        items, sends, index = self.exchange_weights(copies, own)
        w1 = own[0]
        ex = Exchange(lay.comm, items, dtype=w1.dtype, device=w1.device, op="expert weights to their homes")
        rcv = ex(ex.sends_of(sends), lay._anchor(anchor))
        tail, got = rcv.tail, rcv.items
        n = len(copies)
        nbytes = n * sum(lay.part_sizes) * w1.element_size()
        if placement.own_slots:
            return SlotWeights(parts=own, tail=tail, copied_bytes=nbytes)
        ws = [self._received(got, index[(e, lay.rank)], n) if e // lay.num_local != lay.rank
              else self.owned(e, own) for e in placement.my_slots]
        return SlotWeights(parts=self._bank(ws), tail=tail, copied_bytes=nbytes)

    def note_lazy(self, pairs) -> None:
        """(expert, GPU != owner) pairs a plan executed on every rank just copied, held from now to the next
        refresh (lazy replicas; call on every rank alike)."""
        new = frozenset(pairs) - self.lazy_pairs
        if not new:
            return
        if not self.pairs and not self.lazy_pairs:
            # the first copies held since the last refresh (if any) are of the owners' weights as they are now (the
            # forward found nothing stale): staleness counts from here
            self._versions, self.stepped = self.versions(), False
            self._mark()
        self.lazy_pairs = self.lazy_pairs | new
        self.ever_held = True

    @torch.inference_mode(False)   # (a forward inside inference_mode: the held copies must still train later)
    @torch.no_grad()
    def hold(self, experts: list[int], parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Hold the weights of ``experts`` this rank received this micro-batch (``parts``: one [n, ...] tensor per
        part, in the order of ``experts``) until the next refresh: returns them as watched leaves (each forward's
        node decides what of them trains, :meth:`view`), one bank, which this micro-batch's GEMMs and the step's
        later plans use."""
        for e in experts:
            if e in self.held:
                raise RuntimeError(f"MoELayer: GPU {self._layer().rank} received expert {e}'s weights again in a step "
                                   "that already holds them (lazy replicas)")
        rows = tuple(e % self._layer().num_local for e in experts)
        leaves = [t.detach() for t in parts]
        for t in leaves:
            t._feplb_rows = rows
        bank = tuple(self._watch(t) for t in leaves)
        b = len(self.held_banks)
        self.held_banks.append(bank)
        self.held.update({e: (b, i) for i, e in enumerate(experts)})
        return bank

    @torch.inference_mode(False)   # copies made inside inference_mode could never be trained
    @torch.no_grad()
    def refresh(self, placement: Placement, resident: frozenset[tuple[int, int]]) -> None:
        """Copy the owners' current weights to every per-step holder (collective; weights='per-step'): the replicas
        of ``resident`` (expert, gpu) and the slot banks of GPUs computing placed experts."""
        lay = self._layer()
        r = lay.rank
        keep = sorted((e, g) for e, g in resident if g != int(placement.home_E[e]) and g != e // lay.num_local)
        pairs = sorted(set(keep) | set(placement.placed_pairs))
        if pairs or self.ever_held:   # (pairs are global: every rank alike) until the copies below are made
            self.unfinished = True
        self.pairs = tuple(pairs)
        self.generation += 1
        self.stepped = False
        self._versions = self.versions()
        self.ever_held = self.ever_held or bool(pairs)
        self.replica_bank, self.slot_bank, self.replica_of, self.used = None, None, {}, set()
        self.lazy_pairs, self.held, self.held_banks = frozenset(), {}, []
        self._fwd, self._views = None, {}      # (the last forward's views would keep the replaced banks alive)
        self.trained = set()
        if not pairs:
            self.unfinished = False
            return
        self._mark()
        copies = [(e, e // lay.num_local, g) for e, g in pairs]
        own = self.own_weights()
        w1 = own[0]
        items, sends, index = self.exchange_weights(copies, own)
        ex = Exchange(lay.comm, items, dtype=w1.dtype, device=w1.device, op="refresh of per-step expert copies")
        got = ex(ex.sends_of(sends), w1.new_empty(0)).items
        n = len(copies)
        mine = [e for e, g in keep if g == r and e not in placement.slot_pos]
        if mine:
            self.replica_of = {e: j for j, e in enumerate(mine)}
            self.replica_bank = self._bank([self._received(got, index[(e, r)], n) for e in mine], mine)
        if not placement.own_slots:
            self.slot_bank = self._bank([self._received(got, index[(e, r)], n) if e // lay.num_local != r
                                         else self.owned(e, own) for e in placement.my_slots],
                                        list(placement.my_slots), slot=True)
        self.unfinished = False

    @torch.inference_mode(False)
    @torch.no_grad()
    def reduce_grads(self, placement: Placement, idle: torch.Tensor | None = None) -> None:
        """Add the per-step copies' gradients to the owners' expert gradients (collective; once per step).
        idle: the group's MIN of ``idle_flags`` (the same on every rank): the pairs flagged 1 send nothing (their
        copies' gradients are zero); None sends every pair."""
        lay = self._layer()
        pairs = self.all_pairs()
        if not pairs:
            return
        if idle is not None:
            if idle.shape != (len(pairs),):
                raise RuntimeError(f"MoELayer: idle flags for {list(idle.shape)} pairs, {len(pairs)} held")
            pairs = [pair for pair, f in zip(pairs, idle.tolist(), strict=True) if f == 0]
        # Experts frozen (requires_grad_(False)) after a backward of the step: their parameters keep the gradient
        # they had, and an optimizer steps it, as in plain EP, so the copies' share is added to it too (with
        # requires_grad on for the addition only); so is one without a gradient that a backward trained through the
        # copies since the last reduction (a +place bank, which the GEMMs read instead of the owners' parameters,
        # holds all of the step's gradient until now); one frozen all along gets none
        params = list(lay.expert_params())
        frozen = [p for i, p in enumerate(params) if not p.requires_grad and (p.grad is not None or i in self.trained)]
        # And one that requires grad now without a gradient, which no backward trained since the last reduction
        # (frozen at each forward or backward of the step, unfrozen since, on every rank alike: the copies' share of
        # it is zero) keeps none, as in plain EP: a zero gradient would be stepped (momentum, weight decay). Not one
        # with a main-grad buffer (Megatron's DDP), whose gradient is there, never in .grad.
        untouched = [p for i, p in enumerate(params) if p.requires_grad and p.grad is None and i not in self.trained
                     and not hasattr(p, "main_grad")]
        for p in frozen:
            p.requires_grad_(True)
        for p in untouched:
            p.requires_grad_(False)
        try:
            self._reduce(placement, pairs)
        finally:
            for p in frozen:
                p.requires_grad_(False)
            for p in untouched:
                p.requires_grad_(True)

    def _reduce(self, placement: Placement, pairs: list[tuple[int, int]]) -> None:
        lay = self._layer()
        r, L = lay.rank, lay.num_local
        shapes, sizes = lay.part_shapes, lay.part_sizes
        own = self.own_weights()
        w1 = own[0]

        # summed and added in fp32 where the weights are bf16 / fp16 (the copies' fp32 sums, see _watch); sent so,
        # or rounded once to bf16 (FEPLBConfig.reduce_in_fp32=False: half the bytes). fp16 sums stay fp32 on the
        # wire: a step's sum of micro-batch gradients that each fit fp16 need not fit it
        gdt = torch.float32 if w1.dtype in (torch.bfloat16, torch.float16) else w1.dtype
        wire = w1.dtype if not lay.config.reduce_in_fp32 and w1.dtype == torch.bfloat16 else gdt

        def grads_of(e: int) -> tuple[torch.Tensor, ...]:
            i = placement.slot_pos.get(e)
            if i is not None:
                bank, j = self.slot_bank, i
            elif e in self.replica_of:
                bank, j = self.replica_bank, self.replica_of[e]
            else:
                held_bank, j = self.held[e]
                bank = self.held_banks[held_bank]
            return tuple(g[j].to(gdt) if (g := _grad(b)) is not None else b.new_zeros(b[j].shape, dtype=gdt)
                         for b in bank)

        adds = [torch.zeros(w.shape, dtype=gdt, device=w.device) for w in own]
        if self.slot_bank is not None:
            for e in placement.my_slots:
                if e // L == r:           # own experts in the bank: their gradient stays here
                    for a, g in zip(adds, grads_of(e), strict=True):
                        a[e - r * L] += g
        back = [(e, g, e // L) for e, g in pairs]    # (expert, holder -> owner)
        items = [Item(g, o, sum(sizes)) for _, g, o in back]
        sends = {}
        for k, (e, g, _) in enumerate(back):
            if g == r:
                sends[k] = torch.cat([t.reshape(-1) for t in grads_of(e)]).to(wire)
        got = {}
        if items:   # (identical on every rank: from the agreed flags)
            ex = Exchange(lay.comm, items, dtype=wire, device=w1.device, op="reduction of replica gradients")
            got = ex(ex.sends_of(sends), w1.new_empty(0)).items
        for k, (e, _, o) in enumerate(back):
            if o == r and k in got:
                for a, part, shape in zip(adds, got[k].split(sizes), shapes, strict=True):
                    a[e - r * L] += part.view(shape)   # (type promotion: added in fp32)
        self.zero_grads()     # (and trained)
        # through expert_weights() (made with autograd on): the owner's parameters get the gradient whatever their
        # layout, each weight its parts one backward pass at a time (one call takes each tensor once), each part made
        # when its pass comes (fp16 sums far beyond its range take many)
        now = [(t, next(ps), ps) for t, a in zip(own, adds, strict=True) if t.requires_grad
               for ps in [_parts(a, t.dtype)]]
        while now:
            after = [(t, part, ps) for t, _, ps in now if (part := next(ps, None)) is not None]
            torch.autograd.backward([t for t, _, _ in now], [g for _, g, _ in now], retain_graph=bool(after))
            now = after


class _Gate(torch.autograd.Function):
    """The identity on a bank of per-step copies, one node per forward (``Replicas.view``), holding that forward's
    flags ``req`` (which expert parameters required grad) and the copies' generation. Outputs for parts no such
    parameter fed are not differentiable. Its backward notes a gradient after a refresh replaced the copies
    (``late_grad``), counts the parameters requiring grad both then and now as trained (``trained``), and masks
    each part's gradient to the elements those feed (``Replicas._keep``): what plain EP's graph, made with the
    forward's flags, and its gradient accumulation, which skips a parameter frozen since, give the owners."""

    @staticmethod
    def forward(ctx, rep_ref, gen: int, req: tuple[bool, ...], diff: tuple[bool, ...], *bank: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.rep_ref, ctx.gen, ctx.req, ctx.diff = rep_ref, gen, req, diff
        ctx.rows = bank[0]._feplb_rows
        out = tuple(t.view_as(t) for t in bank)
        ctx.mark_non_differentiable(*(o for o, d in zip(out, diff, strict=True) if not d))
        return out

    @staticmethod
    def backward(ctx, *grads):
        lead = (None,) * 4
        rep = ctx.rep_ref()
        if rep is None or all(g is None for g in grads):
            return (*lead, *grads)
        if rep.generation != ctx.gen:
            rep.late_grad = True
        now = rep.requires()
        eff = tuple(a and b for a, b in zip(ctx.req, now, strict=True)) if len(now) == len(ctx.req) else now
        rep.trained.update(i for i, r in enumerate(eff) if r)
        live = rep.part_requires(now)
        out = []
        for j, g in enumerate(grads):
            if g is None or not (ctx.diff[j] and live[j]):
                out.append(None)
                continue
            keep = rep._keep(j, ctx.rows, eff)
            out.append(g if keep is None else g * keep.to(g.dtype))
        return (*lead, *out)


@hidden_from_selective_checkpoint
def _gate(rep_ref, gen: int, req: tuple[bool, ...], diff: tuple[bool, ...],
          bank: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """:class:`_Gate` on ``bank``, hidden from selective checkpointing: a recompute under selective activation
    checkpointing must dispatch its forward's ops, and whether a forward's views come from here is bookkeeping,
    not computation."""
    return _Gate.apply(rep_ref, gen, req, diff, *bank)


def _parts(a: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """``a`` (a gradient summed in a wider dtype) as tensors of ``dtype`` that add up to it: itself where the dtypes
    agree; else the rounded sum and what rounding left (an fp32 parameter behind a 16-bit weight then receives it
    to about twice the weight's precision, not once), preceded, for fp16, by as many parts at fp16's largest value
    as a sum beyond its range needs (each micro-batch's gradient fits fp16, the step's sum of them need not). A
    non-finite sum is passed as it is, as plain EP's would be."""
    if a.dtype == dtype:
        yield a
        return
    if dtype == torch.float16:
        top = torch.finfo(dtype).max
        big = float(a.abs().max()) if a.numel() else 0.0
        if math.isfinite(big):
            for _ in range(math.ceil(big / top) - 1):
                part = a.clamp(-top, top).to(dtype)
                yield part
                a = a - part.to(a.dtype)
    hi = a.to(dtype)
    yield hi
    yield (a - hi.to(a.dtype)).to(dtype)


def _grad(leaf: torch.Tensor) -> torch.Tensor | None:
    """The gradient a per-step copy accumulated: its fp32 sum (bf16 / fp16 leaves), else its ``.grad``."""
    wide = getattr(leaf, "_feplb_grad32", None)
    return wide if wide is not None else leaf.grad


def _widen(leaf: torch.Tensor) -> None:
    """Post-accumulate hook of a bf16 / fp16 per-step copy: move the micro-batch's gradient into the fp32 sum."""
    if leaf.grad is None:
        return
    wide = getattr(leaf, "_feplb_grad32", None)
    if wide is None:
        leaf._feplb_grad32 = leaf.grad.float()
    else:
        wide.add_(leaf.grad)
    leaf.grad = None


def state_fingerprint(st) -> bytes:
    """A few microseconds' digest of a PolicyState's slow decisions for a check at every forward: its policy, step,
    EMA, placement, dynamic sets and EPLB layout (what ranks whose histories diverged differ in first; the
    resident set, which ``state_digest`` also compares, follows from them and the plans)."""
    h = hashlib.blake2b(repr((st.policy, st.step)).encode(), digest_size=16)
    for a in (st.ema_E, st.home_E, st.dynamic_WD, st.layout_WP):
        h.update(b"-" if a is None else a.tobytes())
    return h.digest()


def state_digest(st) -> bytes:
    """The bytes of a PolicyState's slow decisions (equal on every rank that restored the same state)."""
    parts = [repr((st.policy, st.step, st.replicas, sorted(st.resident))).encode()]
    for a in (st.ema_E, st.home_E, st.dynamic_WD, st.layout_WP):
        parts.append(b"-" if a is None else np.ascontiguousarray(a).tobytes())
    return b"|".join(parts)
