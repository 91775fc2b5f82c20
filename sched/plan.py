"""The plan type: which rows of which experts each GPU computes for one MoE layer and micro-batch.

Legend: W EP ranks, E experts, D dynamic experts per GPU. ``n_e = counts_WE[:, e].sum()`` rows of expert e.
HOME ORDER of expert e's rows: as they arrive on its home GPU after the phase-1 dispatch, ordered by source rank,
then by the source's grouped order (token t, then k). Row ranges of a Move index this order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from feplb.sched.topology import Topology

# Base policies whose plans only move dynamic experts, and only inside a node (the FEPLB rule). Peers' policies
# (fastermoe, eplb) may place rows of any expert on any GPU.
INTRA_NODE_BASES = frozenset({"feplb", "feplb-split", "lp"})


BASE_POLICIES = ("none", "feplb", "feplb-split", "fastermoe", "eplb", "lp")
DYNAMIC_MODES = ("current", "ema")
# the base policies that pick a GPU's dynamic experts, which '@ema' picks from history: the others have no such set
DYNAMIC_SET_POLICIES = ("feplb", "feplb-split", "lp")


def parse_policy(policy: str) -> tuple[str, bool, str]:
    """Split a policy name ``BASE[+place][@current|@ema]`` into (base, placement on, dynamic-set mode).

    ``+place`` adds the slow-timescale cross-node placement from routing history. ``@current`` (default) picks
    each GPU's dynamic experts from the current micro-batch's counts (their weights move with the rows);
    ``@ema`` picks them from the EMA of past micro-batches, frozen for a refresh period, with their weights
    replicated inside the node once per period (per-micro-batch copies are then rows only); only the bases with
    dynamic experts (``DYNAMIC_SET_POLICIES``) take it.
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__}")
    rest, at, mode = policy.partition("@")
    if at and not mode:
        raise ValueError(f"policy {policy!r}: '@' names no dynamic-set mode; expected one of {DYNAMIC_MODES}")
    mode = mode or "current"
    base, plus, extra = rest.partition("+")
    if plus and not extra:
        raise ValueError(f"policy {policy!r}: '+' names no modifier; only '+place' exists")
    if base not in BASE_POLICIES:
        raise ValueError(f"policy {policy!r}: unknown base policy {base!r}; expected one of {BASE_POLICIES} "
                         "optionally followed by '+place' and '@current' or '@ema'")
    if extra not in ("", "place"):
        raise ValueError(f"policy {policy!r}: unknown modifier '+{extra}'; only '+place' exists")
    if mode not in DYNAMIC_MODES:
        raise ValueError(f"policy {policy!r}: unknown dynamic-set mode '@{mode}'; expected one of {DYNAMIC_MODES}")
    if mode == "ema" and base not in DYNAMIC_SET_POLICIES:
        # (it changed nothing: a simulation of 'eplb' beside 'eplb@ema' compared a policy with itself)
        raise ValueError(f"policy {policy!r}: '@ema' picks the dynamic experts of {DYNAMIC_SET_POLICIES}; {base!r} "
                         "has none, so it would change nothing")
    return base, extra == "place", mode


def policy_base(policy: str) -> str:
    """``"feplb-split+place@ema"`` -> ``"feplb-split"``."""
    return parse_policy(policy)[0]


class Move(NamedTuple):
    """Rows ``[row_start, row_end)`` (home order) of ``expert``, at home on ``src``, are computed on ``dst``.

    Immutable, with named fields; a NamedTuple rather than a frozen dataclass because a plan holds tens of moves
    and building a tuple costs a tenth of a frozen dataclass's __init__ (the planner's latency budget).
    """

    expert: int
    src: int
    dst: int
    row_start: int
    row_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def _index_below(v: object, n: int) -> int:
    """``v`` as an index into ``n`` items, or 0 where it is none (of no integer type, or out of range)."""
    try:
        i = operator.index(v)
    except TypeError:
        return 0
    return i if 0 <= i < n else 0


def _frozen(a: np.ndarray) -> np.ndarray:
    """An int64 array nobody else can write: ``a`` itself when it already is one (read-only, owning its data)."""
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and not a.flags.writeable and a.base is None:
        return a
    a = np.array(a, dtype=np.int64, copy=True)
    a.flags.writeable = False
    return a


@dataclass(frozen=True, kw_only=True, eq=False)
class Plan:
    """A balancing plan for one MoE layer and one micro-batch.

    moves: sorted by (expert, row_start); rows of an expert not covered by a move stay on its home GPU.
    weight_copies: (expert, src, dst) weights to copy for this micro-batch (dst holds no resident replica).
    dynamic_WD: int64 [W, D] the dynamic experts of each GPU used by this plan.
    loads_before_W: int64 [W] rows each GPU computes under plain EP (default homes, no balancing).
    loads_after_W: int64 [W] rows each GPU computes under this plan.
    home_E: int64 [E] home GPU of each expert used by this plan (a slow-timescale placement), or None for the
        default ``e // (E // W)``.
    rows_from_source: True when every move's rows are computed on the rank they come from, without passing
        through the home GPU (FasterMoE shadowing); such rows are never copied.
    dispatched: True when the phase-1 dispatch sends each move's rows straight from their sources to the GPU
        that computes them (EPLB's replicas): no copy from the home GPU.
    node: the one node this plan covers (``make_plan(..., node=k)``); GPUs of other nodes keep their rows at
        home in it. None: all nodes.
    """

    policy: str
    moves: tuple[Move, ...]
    weight_copies: tuple[tuple[int, int, int], ...]
    dynamic_WD: np.ndarray
    loads_before_W: np.ndarray
    loads_after_W: np.ndarray
    home_E: np.ndarray | None = None
    rows_from_source: bool = False
    dispatched: bool = False
    node: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise TypeError(f"Plan.policy must be a str, got {type(self.policy).__name__}")
        if type(self.moves) is not tuple:
            object.__setattr__(self, "moves", tuple(self.moves))
        if type(self.weight_copies) is not tuple:
            # (operator.index: a float or a string is refused, not truncated by int(); validate refuses a bool)
            try:
                copies = tuple(tuple(operator.index(v) if type(v) is not bool else v for v in c)
                               for c in self.weight_copies)
            except TypeError:
                raise TypeError(f"Plan.weight_copies must hold (expert, src, dst) tuples of integers, got "
                                f"{self.weight_copies!r}") from None
            object.__setattr__(self, "weight_copies", copies)
        for name in ("dynamic_WD", "loads_before_W", "loads_after_W"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if self.home_E is not None:
            object.__setattr__(self, "home_E", _frozen(self.home_E))
        if self.dynamic_WD.ndim != 2:
            raise ValueError(f"Plan.dynamic_WD must be 2-D [W, D], got shape {list(self.dynamic_WD.shape)}")

    @classmethod
    def _trusted(cls, **fields: Any) -> Plan:
        """Build a plan from fields the planner has already frozen and typed (read-only int64 arrays, tuples),
        skipping the checks and copies of __init__: the planner's latency budget is tens of microseconds."""
        plan = object.__new__(cls)
        plan.__dict__.update(fields)
        return plan

    def fingerprint(self) -> tuple:
        """Everything the plan decides, as a hashable tuple: equal fingerprints mean identical plans (e.g. across
        ranks)."""
        return (self.policy, tuple((m.expert, m.src, m.dst, m.row_start, m.row_end) for m in self.moves),
                self.weight_copies, self.dynamic_WD.tobytes(), self.dynamic_WD.shape, self.loads_before_W.tobytes(),
                self.loads_after_W.tobytes(), None if self.home_E is None else self.home_E.tobytes(),
                self.rows_from_source, self.dispatched, self.node)

    @property
    def rows_moved(self) -> int:
        """Rows computed away from their home GPU."""
        return sum(m.row_end - m.row_start for m in self.moves)

    def home_of(self, topo: Topology) -> np.ndarray:
        """int64 [E]: the home GPU of every expert under this plan."""
        return topo.default_home_E() if self.home_E is None else self.home_E

    def validate(self, counts_WE: np.ndarray, topo: Topology, state: Any = None) -> None:
        """Check the plan against the counts it was made from; raise ValueError naming the first violation.

        counts_WE: integer [W, E], rows source rank s sends to expert e.
        Checks: every row of every expert is computed exactly once (move ranges inside [0, n_e), sorted, not
        overlapping; the rest stays home); moves start at the expert's home; FEPLB-family plans move only dynamic
        experts and only inside a node; every (expert, destination) has its weights copied or resident, or is the
        expert's owner (a ``+place`` placement computes an expert away from it; its parameters stay there); the
        recorded loads equal the loads recomputed from the moves.
        """
        counts_WE = topo.check_counts(counts_WE)
        W, E, S = topo.num_ranks, topo.num_experts, topo.experts_per_rank
        n_E = counts_WE.sum(axis=0)
        home_E = self.home_of(topo)
        if home_E.shape != (E,):
            raise ValueError(f"plan.home_E must have shape [{E}], got {list(home_E.shape)}")
        if state is not None and not np.array_equal(home_E, state.home_E):
            raise ValueError("plan.home_E differs from the placement held by the policy state")
        if self.home_E is not None:
            per_gpu = np.bincount(home_E, minlength=W)
            if home_E.min() < 0 or home_E.max() >= W or not np.all(per_gpu == topo.experts_per_rank):
                raise ValueError(f"plan.home_E must put exactly E // W = {topo.experts_per_rank} experts on each GPU")
        base = policy_base(self.policy)
        if self.dynamic_WD.shape != (W, topo.dyn):
            raise ValueError(f"plan.dynamic_WD must have shape [W, dyn] = [{W}, {topo.dyn}], "
                             f"got {list(self.dynamic_WD.shape)}")
        # (the loops below read Python ints: indexing numpy arrays element by element costs several times more)
        home_l, n_l, dyn_l = home_E.tolist(), n_E.tolist(), self.dynamic_WD.tolist()
        for d in range(W):
            row = dyn_l[d]
            if len(set(row)) != len(row):
                raise ValueError(f"plan.dynamic_WD[{d}] repeats an expert: {row}")
            for e in row:
                if not 0 <= e < E or home_l[e] != d:
                    raise ValueError(f"plan.dynamic_WD[{d}] holds expert {e}, which is not at home on GPU {d}")
        dynamic = {(e, d) for d in range(W) for e in dyn_l[d]}
        if base == "none" and self.moves:
            raise ValueError(f"policy 'none' must not move rows, got {len(self.moves)} moves")

        resident = getattr(state, "resident", frozenset()) if state is not None else frozenset()
        wc = self.weight_copies
        # (the common case, Python ints, checked in three C-level passes: a peer's plan holds hundreds of copies)
        if wc and not (set(map(type, wc)) == {tuple} and set(map(len, wc)) == {3}
                       and set(map(type, chain.from_iterable(wc))) == {int}):
            for i, cp in enumerate(wc):
                if not isinstance(cp, tuple) or len(cp) != 3 or bool in map(type, cp) or \
                        not all(isinstance(v, int | np.integer) for v in cp):
                    raise TypeError(f"plan.weight_copies[{i}] must be an (expert, src, dst) tuple of integers, got "
                                    f"{cp!r}")
        copies = {(e, dst): src for e, src, dst in self.weight_copies}
        for e, src, dst in self.weight_copies:
            if not (0 <= e < E and 0 <= dst < W):
                raise ValueError(f"weight copy {(e, src, dst)} names an expert or GPU out of range")
            if src != home_l[e]:
                raise ValueError(f"weight copy {(e, src, dst)} must start at expert {e}'s home GPU {home_l[e]}")
            if dst == src:
                raise ValueError(f"weight copy {(e, src, dst)} copies expert {e}'s weights to its own home GPU")
        if len(copies) != len(self.weight_copies):
            seen: set = set()
            dup = next(c for c in self.weight_copies if (c[0], c[2]) in seen or seen.add((c[0], c[2])))
            raise ValueError(f"weight copy {dup} is given twice (expert {dup[0]}'s weights to GPU {dup[2]})")
        src_rows = None
        if self.rows_from_source and self.moves:
            # each move's source rank's rows of its expert, [start, end), read at once for every move (a field out of
            # range or of no integer type reads a placeholder: the loop refuses that move before comparing these)
            cum = np.zeros((W + 1, E), dtype=np.int64)
            np.cumsum(counts_WE, axis=0, out=cum[1:])
            e_m = np.array([_index_below(m.expert, E) if isinstance(m, Move) else 0 for m in self.moves])
            d_m = np.array([_index_below(m.dst, W) if isinstance(m, Move) else 0 for m in self.moves])
            src_rows = list(zip(cum[d_m, e_m].tolist(), cum[d_m + 1, e_m].tolist(), strict=True))

        loads_np = np.zeros(W, dtype=np.int64)
        np.add.at(loads_np, home_E, n_E)
        loads = loads_np.tolist()
        prev: tuple[int, int] = (-1, -1)
        prev_end = 0
        for i, m in enumerate(self.moves):
            if not isinstance(m, Move):
                raise TypeError(f"plan.moves[{i}] must be a Move, got {type(m).__name__}")
            # (as Python ints: a numpy scalar would turn the loads below into its own, narrower, type)
            try:
                e, src, dst, a, b = map(operator.index, m)
                if bool in map(type, m):      # (a bool passes operator.index as 0 or 1)
                    raise TypeError
            except TypeError:
                raise TypeError(f"plan.moves[{i}]: its fields must be integers, got {m}") from None
            if not 0 <= e < E:
                raise ValueError(f"move {i}: expert {e} out of range [0, {E})")
            if not 0 <= dst < W:
                raise ValueError(f"move {i}: destination GPU {dst} out of range [0, {W})")
            if src != home_l[e]:
                raise ValueError(f"move {i}: src {src} is not expert {e}'s home GPU {home_l[e]}")
            if dst == src:
                raise ValueError(f"move {i}: expert {e} moves from GPU {src} to itself")
            if not 0 <= a < b <= n_l[e]:
                raise ValueError(f"move {i}: rows [{a}, {b}) of expert {e} outside [0, {n_l[e]}) or empty")
            if (e, a) <= prev:
                raise ValueError(f"move {i}: moves must be sorted by (expert, row_start), got {(e, a)} after {prev}")
            if prev[0] == e and a < prev_end:
                raise ValueError(f"move {i}: rows [{a}, {b}) of expert {e} overlap a previous move (computed twice)")
            prev, prev_end = (e, a), b
            if self.node is not None and not src // topo.gpus_per_node == dst // topo.gpus_per_node == self.node:
                raise ValueError(f"move {i}: GPU {src} -> {dst} is outside node {self.node}, the node this plan covers")
            if base in INTRA_NODE_BASES:
                if src // topo.gpus_per_node != dst // topo.gpus_per_node:
                    raise ValueError(f"move {i}: policy {self.policy!r} moved expert {e} across nodes "
                                     f"(GPU {src} -> {dst})")
                if (e, src) not in dynamic:
                    raise ValueError(f"move {i}: policy {self.policy!r} moved expert {e}, which is not dynamic "
                                     f"on GPU {src}")
            if (e, dst) not in resident and (e, dst) not in copies and dst != e // S:
                raise ValueError(f"move {i}: GPU {dst} computes expert {e} without its weights "
                                 "(no weight copy, no resident replica, not its owner)")
            if src_rows is not None and not (src_rows[i][0] <= a and b <= src_rows[i][1]):
                raise ValueError(f"move {i}: rows [{a}, {b}) of expert {e} do not all come from source rank {dst}")
            loads[src] -= b - a
            loads[dst] += b - a
        before = np.asarray(n_E.reshape(W, topo.experts_per_rank).sum(axis=1), dtype=np.int64)
        if not np.array_equal(self.loads_before_W, before):
            raise ValueError(f"plan.loads_before_W {self.loads_before_W.tolist()} != plain-EP loads {before.tolist()}")
        if self.loads_after_W.tolist() != loads:
            raise ValueError(f"plan.loads_after_W {self.loads_after_W.tolist()} != loads recomputed from the moves "
                             f"{loads}")
