"""The immutable history a policy carries from one micro-batch to the next.

Legend: W GPUs, E experts, D dynamic experts per GPU, S = E // W expert slots per GPU.
All history is kept in integers (a fixed-point EMA) so that every rank derives bit-identical decisions.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field, replace

import numpy as np

from feplb.sched.placement import _check_home, check_min_gain, eplb_layout, eplb_replicas, place_experts
from feplb.sched.plan import DYNAMIC_SET_POLICIES, Plan, parse_policy
from feplb.sched.topology import Topology

EMA_FRAC_BITS = 16  # fixed-point fraction bits of ema_E
PLACE_MIN_GAIN = 0.02  # +place's default hysteresis (PolicyState.place_min_gain)


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.int64, copy=True)
    a.flags.writeable = False
    return a


# The read-only arrays PolicyState made and checked, by id, with what they were checked against (and what was
# derived from them): a state that observe() or a refresh derives with replace() keeps most of them, and checking
# them again at every micro-batch would cost more than the history's own update.
_CHECKED: dict[int, tuple] = {}
# Set while observe() or a refresh derives the next state: its (expert, GPU) pairs come from a checked state and the
# planner's own plans, and checking every pair again at every micro-batch would cost more than a plan.
_DERIVING = threading.local()


def _derive(state: PolicyState, **changes) -> PolicyState:
    """``replace(state, **changes)`` from this module's own derivations (observe, a refresh): pairs not checked."""
    _DERIVING.on = True
    try:
        return replace(state, **changes)
    finally:
        _DERIVING.on = False


def _known(a: object, *against: object):
    """What was stored with ``a`` if PolicyState checked it against exactly these objects, else None."""
    got = _CHECKED.get(id(a))
    if got is None or got[0]() is not a or len(got[1]) != len(against) or \
            any(x is not y for x, y in zip(got[1], against, strict=True)):
        return None
    return got[2]


def _remember(a: np.ndarray, against: tuple, derived: object = True) -> np.ndarray:
    k = id(a)

    def gone(ref, k=k):
        if _CHECKED.get(k, (None,))[0] is ref:
            del _CHECKED[k]

    _CHECKED[k] = (weakref.ref(a, gone), against, derived)
    return a


_HOME = object()   # tags what PolicyState derived from a placement (a home_E array), apart from other checked arrays


def slots_of(home_E: np.ndarray, topo: Topology) -> np.ndarray:
    """int64 [W, S]: the experts at home on each GPU, ascending ids."""
    return _ro(np.argsort(home_E, kind="stable").reshape(topo.num_ranks, topo.experts_per_rank))


@dataclass(frozen=True, kw_only=True, eq=False)
class PolicyState:
    """History of one MoE layer for one policy; ``observe`` returns the next state and never mutates this one.

    topo: the topology. policy: the policy name this state serves (``BASE[+place][@current|@ema]``).
    refresh_every: micro-batches between slow-timescale refreshes (one optimizer step of micro-batches): the
        ``@ema`` dynamic set (whose weights, once copied to a helper, stay there until the next refresh), EPLB
        replicas, and the ``+place`` placement.
    ema_shift: a new micro-batch enters the EMA with weight ``2 ** -ema_shift``.
    eplb_slots: redundant expert slots per GPU for ``eplb`` (EPLB's physical layout has E // W + eplb_slots slots
        per GPU).
    eplb_groups: the model's expert groups for ``eplb`` (group-limited routing; 1 = none): EPLB's hierarchical
        layout when the number of nodes divides it, else its global one.
    place_min_gain: ``+place`` keeps plain EP's placement (and inside a node, its GPUs' experts) unless the new
        placement lowers the most loaded node (GPU) of the history's load by more than this fraction of it
        (``place_experts``' ``min_gain``): weights placed away from their owner are re-sent after every step.
    replicas_mode: under ``@ema``, "eager" copies every dynamic expert's weights to the other GPUs of its node at
        each refresh (between optimizer steps, off the micro-batches' critical path; (G - 1) x dyn replicas per
        GPU and layer), "lazy" copies a weight the first time a plan needs it in the step and keeps it until the
        step ends (fewer bytes and less memory, but the first copy is on that micro-batch's critical path).
    Derived fields (step, ema_E, home_E, dynamic_WD, layout_WP, replicas, resident, last_*) are filled by
    ``observe``.
    """

    topo: Topology
    policy: str = "feplb"
    refresh_every: int = 8
    ema_shift: int = 2
    eplb_slots: int = 1
    eplb_groups: int = 1
    replicas_mode: str = "eager"
    place_min_gain: float = PLACE_MIN_GAIN
    step: int = 0
    ema_E: np.ndarray | None = None          # int64 [E], rows * 2**EMA_FRAC_BITS; None before any observe
    home_E: np.ndarray | None = None         # int64 [E] home GPU of each expert (default e // S)
    dynamic_WD: np.ndarray | None = None     # int64 [W, D] frozen dynamic set (@ema), None = pick per micro-batch
    layout_WP: np.ndarray | None = None      # int64 [W, E // W + eplb_slots] eplb's physical layout, None = none yet
    replicas: tuple[tuple[int, int], ...] = ()   # eplb: (expert, gpu) of the layout away from the expert's home
    resident: frozenset[tuple[int, int]] = frozenset()  # (expert, gpu) weights held on gpu besides its home
    last_weight_copies: tuple[tuple[int, int, int], ...] = ()  # (expert, src, dst) the last refresh copied
    last_migrations: tuple[tuple[int, int, int], ...] = ()     # (expert, old home, new home) of the last refresh
    slots_WS: np.ndarray = field(init=False, repr=False)
    # (expert, owner) of every expert placed away from its owner: the owner keeps its parameters, so a plan never
    # copies it that expert's weights
    owners_away: frozenset[tuple[int, int]] = field(init=False, repr=False)
    eplb_pairs: tuple | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.topo, Topology):
            raise TypeError(f"PolicyState.topo must be a Topology, got {type(self.topo).__name__}")
        parse_policy(self.policy)
        for name, lo in (("refresh_every", 1), ("ema_shift", 0), ("eplb_slots", 0), ("eplb_groups", 1),
                         ("step", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"PolicyState.{name} must be an int >= {lo}, got {v!r}")
        if self.replicas_mode not in ("eager", "lazy"):
            raise ValueError(f"PolicyState.replicas_mode must be 'eager' or 'lazy', got {self.replicas_mode!r}")
        if self.ema_shift > 16:
            raise ValueError(f"PolicyState.ema_shift must be <= 16, got {self.ema_shift}")
        check_min_gain(self.place_min_gain, "PolicyState.place_min_gain")
        topo = self.topo
        if parse_policy(self.policy)[0] == "eplb" and self.eplb_slots > topo.num_experts:
            # (past E - E // W slots every GPU could hold every expert: more only repeat experts on one GPU, whose
            # rows they split among themselves there, and the layout grows with them: a slip for a small count that
            # would exhaust memory)
            raise ValueError(f"PolicyState.eplb_slots must be at most E = {topo.num_experts} (redundant slots per "
                             f"GPU: from E - E // W on, every GPU can hold every expert), got {self.eplb_slots}")
        known = _known(self.home_E, _HOME, topo)
        if known is None:
            home = topo.default_home_E() if self.home_E is None else \
                _check_home(self.home_E, topo, "PolicyState.home_E")
            home = _ro(home)
            owner = topo.default_home_E()
            known = (slots_of(home, topo),
                     frozenset((e, int(owner[e])) for e in np.flatnonzero(home != owner).tolist()))
            object.__setattr__(self, "home_E", _remember(home, (_HOME, topo), known))
        object.__setattr__(self, "slots_WS", known[0])
        object.__setattr__(self, "owners_away", known[1])
        if known[1] and not parse_policy(self.policy)[1]:
            # only '+place' moves experts from their owners (a history edited or of another layer: eplb's plans then
            # failed at the next forward, naming no history; the others fell back to plain EP for good)
            moved = sorted(e for e, _ in known[1])
            raise ValueError(f"PolicyState.home_E places experts {moved[:8]}{' ...' if len(moved) > 8 else ''} away "
                             f"from their owners, but policy {self.policy!r} has no '+place' (only placement moves "
                             "experts: its home_E is the owners', e // (E // W))")
        if self.ema_E is not None and _known(self.ema_E, topo) is None:
            ema = np.asarray(self.ema_E)
            if ema.shape != (topo.num_experts,) or ema.dtype.kind not in "iu" or (ema.size and ema.min() < 0):
                raise ValueError(f"PolicyState.ema_E must be an integer array of shape [{topo.num_experts}] >= 0, "
                                 f"got {ema.dtype} {list(ema.shape)}")
            object.__setattr__(self, "ema_E", _remember(_ro(ema), (topo,)))
        if self.dynamic_WD is not None and _known(self.dynamic_WD, topo, self.home_E) is None:
            dyn = np.asarray(self.dynamic_WD)
            want = (topo.num_ranks, topo.dyn)
            ok = dyn.shape == want and dyn.dtype.kind in "iu" and (not dyn.size or 0 <= dyn.min() <= dyn.max() <
                                                                     topo.num_experts)
            if ok and dyn.size:   # each row: distinct experts at home on its GPU
                srt = np.sort(dyn, axis=1)
                ok = bool((self.home_E[dyn] == np.arange(want[0])[:, None]).all() and (srt[:, 1:] != srt[:, :-1]).all())
            if not ok:
                raise ValueError(f"PolicyState.dynamic_WD must be an integer array of shape [W, dyn] = {list(want)}"
                                 " whose row d holds distinct experts at home on GPU d (home_E), got "
                                 f"{dyn.tolist() if dyn.size <= 64 else list(dyn.shape)}")
            object.__setattr__(self, "dynamic_WD", _remember(_ro(dyn), (topo, self.home_E)))
        # the (expert, GPU) and (expert, GPU, GPU) pairs name experts and GPUs of this topology (a restored
        # history's are checked here: an expert or GPU past the end fails only later, deep in a refresh); not those
        # this module derives (_derive)
        pairs = () if getattr(_DERIVING, "on", False) else (
            ("resident", self.resident), ("replicas", self.replicas),
            ("last_weight_copies", self.last_weight_copies), ("last_migrations", self.last_migrations))
        for name, ids in pairs:
            n = 3 if name.startswith("last_") else 2
            for row in ids:
                if not (isinstance(row, tuple) and len(row) == n and all(type(v) is int for v in row)
                        and 0 <= row[0] < topo.num_experts and all(0 <= v < topo.num_ranks for v in row[1:])):
                    raise ValueError(f"PolicyState.{name} must hold ({'expert, GPU' if n == 2 else 'expert, GPU, GPU'})"
                                     f" tuples of ints with experts in [0, {topo.num_experts}) and GPUs in "
                                     f"[0, {topo.num_ranks}), got {row!r}")
        if self.topo.num_experts % self.eplb_groups:
            raise ValueError(f"PolicyState.eplb_groups must divide E={self.topo.num_experts}, got {self.eplb_groups}")
        pairs = None
        if self.layout_WP is not None:
            known = _known(self.layout_WP, topo, self.home_E)
            if known is not None and known[0] == self.eplb_slots:
                pairs = known[1]
            else:
                kind = np.asarray(self.layout_WP).dtype
                if kind.kind not in "iu":   # (the int64 copy would truncate a fractional id: 2.7 -> expert 2)
                    raise ValueError(f"PolicyState.layout_WP must be an integer array of expert ids, got {kind}")
                layout = _ro(self.layout_WP)
                pairs = _layout_pairs(layout, self.home_E, self.topo, self.eplb_slots)
                object.__setattr__(self, "layout_WP", _remember(layout, (topo, self.home_E),
                                                                (self.eplb_slots, pairs)))
        object.__setattr__(self, "eplb_pairs", pairs)

    @property
    def ema_rows_E(self) -> np.ndarray:
        """int64 [E]: the EMA of past per-expert rows, rounded down to whole rows (zeros before any observe)."""
        if self.ema_E is None:
            return np.zeros(self.topo.num_experts, dtype=np.int64)
        return self.ema_E >> EMA_FRAC_BITS

    def observe(self, counts_WE: np.ndarray, plan: Plan | None = None) -> PolicyState:
        """Fold one micro-batch's counts (int [W, E]) into the history; refresh slow decisions when due.

        plan: the plan executed for these counts. Under ``@ema`` the weights it copied stay resident on their
        destination until the next refresh (the optimizer step changes the weights), so each (expert, GPU) pair
        is copied at most once per step. Refreshes happen after the first micro-batch and then every
        ``refresh_every`` micro-batches (one optimizer step).
        """
        counts_WE = self.topo.check_counts(counts_WE)
        x = counts_WE.sum(axis=0) << EMA_FRAC_BITS
        ema = x if self.ema_E is None else self.ema_E + ((x - self.ema_E) >> self.ema_shift)
        step = self.step + 1
        resident = self.resident
        if plan is not None and self.reads_plans:
            self._check_plan(plan)
            if plan.weight_copies:
                resident = resident | {(e, dst) for e, _, dst in plan.weight_copies}
        new = _derive(self, step=step, ema_E=ema, resident=resident, last_weight_copies=(), last_migrations=())
        return new._refresh() if new.refreshed else new

    def _check_plan(self, plan: Plan) -> None:
        """Refuse a plan ``observe`` cannot fold into this history: one not made by this policy over this topology,
        whose copies would name experts or GPUs this history has not (a checkpoint of it could then never be
        loaded back), or one node's plan only. Cheap: the shapes and the copies, not the moves."""
        if not isinstance(plan, Plan):
            raise TypeError(f"PolicyState.observe: plan must be the feplb.sched.Plan executed for these counts (or "
                            f"None), got {type(plan).__name__}")
        if plan.policy != self.policy:
            raise ValueError(f"PolicyState.observe: the plan was made by policy {plan.policy!r}, this history is "
                             f"{self.policy!r}'s")
        t = self.topo
        if plan.dynamic_WD.shape != (t.num_ranks, t.dyn) or plan.loads_before_W.shape != (t.num_ranks,):
            raise ValueError(f"PolicyState.observe: the plan covers {plan.dynamic_WD.shape[0]} GPUs with "
                             f"{plan.dynamic_WD.shape[1]} dynamic experts each, this history's topology "
                             f"{t.num_ranks} with {t.dyn}")
        bad = [c for c in plan.weight_copies
               if not (0 <= c[0] < t.num_experts and 0 <= c[1] < t.num_ranks and 0 <= c[2] < t.num_ranks)]
        if bad:
            raise ValueError(f"PolicyState.observe: the plan copies weights {bad[:3]} (expert, src, dst) outside "
                             f"this history's {t.num_experts} experts on {t.num_ranks} GPUs")
        if plan.node is not None:
            raise ValueError(f"PolicyState.observe: {self.policy!r} keeps the weights a plan copied resident, so it "
                             f"needs the whole plan, got the plan of node {plan.node} only")

    # the settings a saved history must share with the state that takes it (to_dict / from_dict)
    SETTINGS = ("policy", "refresh_every", "ema_shift", "eplb_slots", "eplb_groups", "replicas_mode", "place_min_gain")
    _ARRAYS = ("ema_E", "home_E", "dynamic_WD", "layout_WP")
    _PAIRS = {"replicas": 2, "resident": 2, "last_weight_copies": 3, "last_migrations": 3}

    def to_dict(self) -> dict:
        """This history as plain values (ints, floats, strings, int64 arrays; None where unset): what
        :meth:`from_dict` rebuilds, to save with a checkpoint."""
        t = self.topo
        out: dict = {"topology": [t.num_ranks, t.gpus_per_node, t.num_experts, t.dyn], "step": self.step}
        out.update((k, getattr(self, k)) for k in self.SETTINGS)
        for k in self._ARRAYS:
            a = getattr(self, k)
            out[k] = None if a is None else np.array(a, dtype=np.int64)
        for k, n in self._PAIRS.items():
            out[k] = np.array(sorted(getattr(self, k)), dtype=np.int64).reshape(-1, n)
        return out

    @classmethod
    def from_dict(cls, d: dict, like: PolicyState) -> PolicyState:
        """The history :meth:`to_dict` gave, for a layer whose current state is ``like``: ValueError naming what
        differs where its topology or settings (policy, refresh_every, ...) are not ``like``'s, or where it is no
        such history (every array checked as the constructor checks it)."""
        if not isinstance(d, dict):
            raise ValueError(f"a saved policy state must be a dict, got {type(d).__name__}")
        t = like.topo
        want = {"topology": [t.num_ranks, t.gpus_per_node, t.num_experts, t.dyn],
                **{k: getattr(like, k) for k in cls.SETTINGS}}
        known = set(want) | {"step", *cls._ARRAYS, *cls._PAIRS}
        missing = sorted(known - set(d))
        if missing:
            raise ValueError(f"a saved policy state lacks {missing}")
        # (a key no history of this version writes: another format, or a mistyped one, never ignored silently)
        unknown = sorted(map(repr, set(d) - known))
        if unknown:
            raise ValueError(f"a saved policy state holds keys no policy history has: {', '.join(unknown)}")
        got = {k: list(d[k]) if k == "topology" else d[k] for k in want}
        differ = [f"{k} {got[k]!r} (the layer's: {want[k]!r})" for k in want if got[k] != want[k]]
        if differ:
            raise ValueError("the saved policy state is for another layer setup: " + ", ".join(differ))
        arrays = {k: None if d[k] is None else np.asarray(d[k]) for k in cls._ARRAYS}
        pairs = {}
        for k, n in cls._PAIRS.items():
            a = np.asarray(d[k])
            if a.dtype.kind not in "iu" or a.ndim != 2 or a.shape[1] != n:
                raise ValueError(f"a saved policy state's {k} must be an integer array [N, {n}], got "
                                 f"{a.dtype} {list(a.shape)}")
            pairs[k] = tuple(tuple(int(v) for v in row) for row in a.tolist())
        step = d["step"]
        if isinstance(step, (np.integer, np.ndarray)) and np.ndim(step) == 0 and np.asarray(step).dtype.kind in "iu":
            step = int(step)   # (a history saved with np.savez)
        return cls(topo=t, **{k: getattr(like, k) for k in cls.SETTINGS}, step=step, **arrays,
                   replicas=pairs["replicas"], resident=frozenset(pairs["resident"]),
                   last_weight_copies=pairs["last_weight_copies"], last_migrations=pairs["last_migrations"])

    @property
    def refreshed(self) -> bool:
        """Whether the last ``observe`` refreshed (after the first micro-batch, then every ``refresh_every``)."""
        return self.step == 1 or self.step % self.refresh_every == 0

    @property
    def reads_plans(self) -> bool:
        """Whether ``observe`` folds the executed plan into the history (``@ema`` sets with lazy replicas keep the
        weights a plan copied resident): such a history needs the whole plan on every rank, not one node's."""
        return self._ema_set and self.replicas_mode == "lazy"

    @property
    def _ema_set(self) -> bool:
        base, _, mode = parse_policy(self.policy)
        return mode == "ema" and base in DYNAMIC_SET_POLICIES

    def _refresh(self) -> PolicyState:
        topo = self.topo
        base, place, mode = parse_policy(self.policy)
        load = self.ema_E >> EMA_FRAC_BITS if self.ema_E is not None else np.zeros(topo.num_experts, np.int64)
        home = self.home_E
        migrations: tuple[tuple[int, int, int], ...] = ()
        copies: set[tuple[int, int, int]] = set()
        owner = topo.default_home_E()   # where each expert's parameters live: every refresh copy comes from there
        owner_l = owner.tolist()
        if place:
            new_home = place_experts(load, topo, owner, min_gain=self.place_min_gain)
            migrations = tuple((e, int(home[e]), int(new_home[e])) for e in range(topo.num_experts)
                               if home[e] != new_home[e])
            home = new_home
            # the GPUs computing experts away from their owner hold copies of their weights, re-sent from the
            # owner after every optimizer step (the layer's bank of placed experts)
            copies = {(e, owner_l[e], int(home[e])) for e in np.flatnonzero(home != owner).tolist()}
        dynamic = layout = None
        replicas: tuple[tuple[int, int], ...] = ()
        resident: frozenset[tuple[int, int]] = frozenset()
        if self._ema_set:
            # a new step: replicas of the old weights are stale
            dynamic = top_per_gpu(load, slots_of(home, topo), topo.dyn)
            if self.replicas_mode == "eager":
                G = topo.gpus_per_node
                resident = frozenset((int(e), g) for d in range(topo.num_ranks) for e in dynamic[d]
                                     for g in range(d // G * G, d // G * G + G) if g != d)
                copies |= _sent(resident, owner_l)
        if base == "eplb":
            # a new layout from the history; every copy away from home is re-synced from its owner after every
            # optimizer step (the weights changed)
            layout = eplb_layout(load, topo, self.eplb_slots, self.eplb_groups, home)
            replicas = eplb_replicas(layout, home)
            copies |= _sent(replicas, owner_l)
        return _derive(self, home_E=home, dynamic_WD=dynamic, layout_WP=layout, replicas=replicas,
                       resident=resident | set(replicas),
                       last_weight_copies=tuple(sorted(copies)), last_migrations=migrations)


def _sent(pairs, owner: list[int]) -> set[tuple[int, int, int]]:
    """The copies a refresh sends for the (expert, GPU) pairs held besides the expert's home: (expert, owner, GPU),
    from the owner (where its parameters live; the layer's refresh sends from there), none to the owner itself
    (a ``+place`` placement may compute an expert away from its owner while a replica sits on the owner)."""
    return {(e, owner[e], g) for e, g in pairs if g != owner[e]}


def _layout_pairs(layout_WP: np.ndarray, home_E: np.ndarray, topo: Topology, slots: int) -> tuple[np.ndarray, ...]:
    """The planner's view of an EPLB layout: its distinct (expert, GPU) pairs ordered by expert, the home GPU's
    pair first, then GPUs ascending (the order their rows take in the expert's home order). Returns read-only
    arrays over pairs: pair_e, pair_g, pair_mult (slots of that expert on that GPU), src (the expert's home), away
    (bool: GPU is not the home); copies_E (slots per expert, all >= 1); and a list of (expert, pair indices) of
    the experts with several slots."""
    W, E = topo.num_ranks, topo.num_experts
    P = E // W + slots
    if layout_WP.shape != (W, P):
        raise ValueError(f"PolicyState.layout_WP must have shape [W, E // W + eplb_slots] = [{W}, {P}], got "
                         f"{list(layout_WP.shape)}")
    if layout_WP.size and (layout_WP.min() < 0 or layout_WP.max() >= E):
        raise ValueError(f"PolicyState.layout_WP holds expert ids outside [0, {E})")
    copies_E = np.bincount(layout_WP.ravel(), minlength=E)
    if E and copies_E.min() < 1:
        raise ValueError(f"PolicyState.layout_WP leaves expert {int(np.argmin(copies_E))} without a slot")
    gpu = np.repeat(np.arange(W, dtype=np.int64), P)
    e = layout_WP.ravel()
    key = (e * 2 + (gpu != home_E[e])) * W + gpu
    uniq, mult = np.unique(key, return_counts=True)
    pair_e, pair_g = uniq // (2 * W), uniq % W
    src = home_E[pair_e]
    # the pairs of each replicated expert (the only ones whose rows may not divide evenly), as Python lists
    first = np.searchsorted(pair_e, np.arange(E + 1)).tolist()
    shared = [(x, list(range(first[x], first[x + 1]))) for x in np.flatnonzero(copies_E > 1).tolist()]
    out = (pair_e, pair_g, mult.astype(np.int64), copies_E.astype(np.int64), src, pair_g != src)
    for a in out:
        a.setflags(write=False)
    return (*out, shared)


def top_per_gpu(value_E: np.ndarray, slots_WS: np.ndarray, k: int) -> np.ndarray:
    """int64 [W, k]: on each GPU, the k experts of slots_WS with the highest value (ties: lower expert id first).

    value_E: int64 [E]. slots_WS: int64 [W, S], each row in ascending expert id.
    """
    vals = value_E[slots_WS]
    idx = np.argsort(-vals, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(slots_WS, idx, axis=1)
