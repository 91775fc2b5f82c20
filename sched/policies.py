"""Balancing policies: pure functions of (counts, topology, state) that return a Plan.

Legend: W GPUs, G GPUs per node, E experts, D dynamic experts per GPU, S = E // W expert slots per GPU.
counts_WE: int [W, E], counts_WE[s, e] = rows source rank s sends to expert e (identical on every rank).

Every policy is deterministic: ties break on (load, GPU id, expert id) explicitly, on integer row counts, so
every rank derives the same plan from the same counts without talking. The inner loops run over a handful of
Python ints per node: at this size that is faster than numpy calls.

Policies (``BASE[+place][@current|@ema]``, see ``parse_policy``):
* ``none``: plain EP.
* ``feplb``: the paper's greedy. Per node, repeat: take the most loaded GPU, move its busiest dynamic expert
  whose rows are fewer than the gap to the least loaded GPU there, whole; stop when nothing helps or the gap is
  at most ``tau`` times the node's mean load.
* ``feplb-split``: ``feplb``, then split rows of dynamic experts (left at home, or already sent to a helper)
  into chunks of at least ``min_chunk`` rows (default: the cost model's knee, below which a GEMM costs its
  weight-read floor anyway), moving each chunk from the most to the least loaded GPU of the node toward the
  node's mean; every chunk is smaller than the gap it closes, so the node's maximum never rises.
* ``lp``: the optimal fractional balance inside each node with the same dynamic set (water-filling, any chunk
  size): the lower bound for in-node, dynamic-only policies.
* ``fastermoe``: FasterMoE's dynamic shadowing (He et al., PPoPP 2022; laekov/fastmoe ``shadow_policy.py``): the
  hottest experts, one at a time while FasterMoE's model of the iteration gets shorter (3x the busiest GPU's
  forward GEMM for forward + backward, 4 all-to-all transfers of its rows, one weight transfer per shadowed expert:
  its ``send_model_time``, which leaves out the gradients' reduction; times from ``cost``, i.e. the simulated
  expert shape), are broadcast to every GPU and each source computes its own rows of them.
* ``eplb``: DeepSeek's EPLB: a full physical layout from the load history (``PolicyState``,
  ``feplb.sched.placement.eplb_layout``): equal slots per GPU, redundant slots to the heaviest experts, balanced
  packing, hierarchical or global; each expert's rows split evenly among its slots, dispatched straight to them.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import chain, repeat
from operator import itemgetter

import numpy as np

from feplb.sched.cost import CostModel
from feplb.sched.plan import BASE_POLICIES, Move, Plan, parse_policy
from feplb.sched.state import PolicyState, slots_of
from feplb.sched.topology import Topology

POLICIES: tuple[str, ...] = BASE_POLICIES

_DEFAULT_COST = CostModel()
# ufunc reductions called directly: ndarray.sum's Python wrapper costs about a microsecond per call here
_ADD = np.add.reduce
_ADD_AT = np.add.reduceat
_MAX = np.maximum.reduce
_CUMSUM = np.add.accumulate
# (expert, row_start) of a feplb-split piece (-rows, expert, row_start, row_end, home, holder)
_EXPERT_ROW = itemgetter(1, 2)
_COPY_FIELDS = itemgetter(1, 4, 5)


def _moves(fields) -> tuple[Move, ...]:
    """Moves from 5-tuples in field order, without Move._make's length check (the planner builds them itself):
    tuple.__new__ called by map directly."""
    return tuple(map(tuple.__new__, repeat(Move), fields))


@lru_cache(maxsize=64)
def _default_slots(topo: Topology) -> np.ndarray:
    return slots_of(topo.default_home_E(), topo)


def _check_args(policy: str, topo: Topology, state: PolicyState | None) -> tuple[str, bool, str]:
    parsed = _parse(policy) if isinstance(policy, str) else parse_policy(policy)
    if not isinstance(topo, Topology):
        raise TypeError(f"topo must be a Topology, got {type(topo).__name__}")
    if state is not None:
        if not isinstance(state, PolicyState):
            raise TypeError(f"state must be a PolicyState or None, got {type(state).__name__}")
        if state.topo is not topo and state.topo != topo:
            raise ValueError(f"state was made for {state.topo}, not {topo}")
        if state.policy != policy and _parse(state.policy) != parsed:
            raise ValueError(f"state was made for policy {state.policy!r}, not {policy!r}")
    return parsed


_REAL = (int, float, np.integer, np.floating)
_INT = (int, np.integer)


def _int_arg(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, _INT) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def _slots(topo: Topology, state: PolicyState | None) -> np.ndarray:
    return _default_slots(topo) if state is None else state.slots_WS


@lru_cache(maxsize=4096)
def _broadcast(e: int, home: int, W: int) -> tuple[tuple[int, int, int], ...]:
    """The weight copies of FasterMoE shadowing expert e: (e, home, s) for every other GPU s, in order."""
    return tuple((e, home, s) for s in range(W) if s != home)


@lru_cache(maxsize=256)
def _parse(policy: str) -> tuple[str, bool, str]:
    return parse_policy(policy)


@lru_cache(maxsize=64)
def _consts(topo: Topology) -> tuple[np.ndarray, ...]:
    """What make_plan needs of a topology on every call: the first expert slot of each GPU (reduceat offsets), the
    default slots int64 [W, S], and the bit width B of the dynamic selection's keys (2**B > any expert id) and
    its mask, as 0-d arrays (a Python int or numpy scalar operand costs a conversion per ufunc call)."""
    b = (topo.num_experts - 1).bit_length()
    out = (np.arange(0, topo.num_experts, topo.experts_per_rank, dtype=np.int64), _default_slots(topo),
           np.array(b, dtype=np.int64), np.array((1 << b) - 1, dtype=np.int64))
    for a in out:
        a.setflags(write=False)
    return out


def _top(n_E: np.ndarray, cand_WK: np.ndarray | None, topo: Topology, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k candidates of each GPU with the most rows, ties to the lower expert id, as int64 [W, k] experts and
    their rows NEGATED (fresh arrays; only some callers need the rows, they negate them).
    cand_WK: int64 [W, K] candidate experts, or None for the default slots."""
    if k == 0:
        return np.zeros((topo.num_ranks, 0), dtype=np.int64), np.zeros((topo.num_ranks, 0), dtype=np.int64)
    _, slots, bits, mask = _consts(topo)
    if cand_WK is None:
        n_WK, ids_WK = n_E.reshape(topo.num_ranks, -1), slots
    else:
        n_WK, ids_WK = n_E[cand_WK], cand_WK
    # one integer key per expert, id - rows * 2**B, ascending = (rows descending, id ascending): no float or
    # sort-stability ties; an arithmetic shift gives back -rows, the low B bits the id
    keys = np.left_shift(n_WK, bits)
    np.subtract(ids_WK, keys, out=keys)
    keys.sort(axis=1)
    # a contiguous copy of the first k columns: elementwise ops on the strided slice cost twice as much
    top_k = keys[:, :k].copy()
    return np.bitwise_and(top_k, mask), np.right_shift(top_k, bits, out=top_k)


def _dynamic(n_E: np.ndarray, topo: Topology, state: PolicyState | None, mode: str, place: bool,
             ) -> tuple[np.ndarray, np.ndarray]:
    if mode == "ema" and state is not None and state.dynamic_WD is not None:
        return _top(n_E, state.dynamic_WD, topo, topo.dyn)
    return _top(n_E, state.slots_WS if (place and state is not None) else None, topo, topo.dyn)


def select_dynamic(policy: str, counts_WE: np.ndarray, topo: Topology, state: PolicyState | None = None,
                   ) -> np.ndarray:
    """The dynamic experts of every GPU for this micro-batch: int64 [W, D], each row by (rows desc, id).

    ``@current`` (default): each GPU's D experts with the most rows in counts_WE (int [W, E]), ties to the lower
    expert id. ``@ema``: the set frozen by the state's last refresh (from the EMA of past micro-batches), or
    the ``@current`` choice before any history exists.
    """
    _, place, mode = _check_args(policy, topo, state)
    counts_WE = topo.check_counts(counts_WE)
    return _dynamic(counts_WE.sum(axis=0), topo, state, mode, place)[0]


def _greedy(L: list[int], ex: list[list[int]], nx: list[list[int]], tau_gap: int):
    """The paper's greedy on one node. L: loads (mutated); ex[i], nx[i]: GPU i's movable dynamic experts and their
    rows, sorted by (rows desc, expert asc) (both consumed together). Yields each whole-expert move as (source,
    destination, expert, rows), GPUs as indices into L."""
    while True:
        # first index of the max / min: ties go to the lower GPU id
        top, bottom = max(L), min(L)
        gap = top - bottom
        if gap <= tau_gap:
            return
        hi = L.index(top)
        rows = nx[hi]
        j = 0
        for n in rows:
            if n < gap:
                break
            j += 1
        else:
            return
        if n == 0:  # candidates are sorted by rows: only empty experts are left below the gap
            return
        lo = L.index(bottom)
        del rows[j]
        L[hi] = top - n
        L[lo] = bottom + n
        yield hi, lo, ex[hi].pop(j), n


def _give(size: int, gap: int, want: int, m: int) -> int:
    """The rows a piece of ``size`` rows gives in a split step (0: none): whole if below the gap, or a chunk in
    [m, size - m] below the gap, whichever is closer to ``want`` (the whole piece on a tie)."""
    x = size if size < gap else 0
    if 2 * m <= size:
        c = want if want > m else m
        if c > size - m:
            c = size - m
        if c < gap and (x == 0 or abs(c - want) < abs(x - want)):
            x = c
    return x


def _split_node(L: list[int], ex: list[list[int]], nx: list[list[int]], tau_gap: int, m: int, g0: int,
                greedy: bool, out: list[tuple[int, int, int, int, int, int]]) -> bool:
    """Token split on one node (feplb-split: after the paper's greedy; lp: alone, m = 1, tau_gap = 0).

    A piece is the tuple (-rows, expert, row_start, row_end, home GPU, GPU holding it): its plain order is (rows
    desc, expert asc, row_start asc), a total order (the row ranges of an expert are disjoint).
    L: the node's loads (mutated). ex[i], nx[i]: GPU i's dynamic experts and their rows, sorted by (rows desc,
    expert asc) (consumed). Appends every piece that changed GPU to out; returns whether one of them is back at
    its home GPU (_finish drops those, sorts the rest and joins adjacent ones).

    Greedy (feplb-split), ``_greedy``: whole experts become pieces of their destination.
    Split: move rows from the most to the least loaded GPU (ties: lower GPU id), toward the node's (integer) mean,
    in pieces of at least m rows (or whole pieces). Each step gives the busiest GPU's first piece in piece order,
    or the next one that can give: the whole piece if it is below the gap, or a chunk in [m, rows - m] below the
    gap, whichever is closer to the rows the pair needs to reach the mean (``want``; the whole piece on a tie). A
    chunk is cut from the piece's end. A GPU's pieces are what it received and, once it gives, its own experts with
    rows (a GPU that never gives keeps them whole at home).
    """
    G = len(L)
    recv: list[list[tuple[int, int, int, int, int, int]]] = [[] for _ in range(G)]
    if greedy:
        for hi, lo, e, n in _greedy(L, ex, nx, tau_gap):
            recv[lo].append((-n, e, 0, n, g0 + hi, g0 + lo))
    # the same iteration bound as the reference description (a safety net: every step moves rows downhill)
    bound = 4 * G * (max(map(len, recv)) + max(map(len, ex)) + 2)
    target = -(-sum(L) // G)
    own: list[list[tuple[int, int, int, int, int, int]] | None] = [None] * G
    back = False
    for _ in range(bound):
        top, bottom = max(L), min(L)
        gap = top - bottom
        if top <= target or gap <= tau_gap:
            break
        hi = L.index(top)
        mine = own[hi]
        if mine is None:
            h = g0 + hi
            mine = own[hi] = [(-r, e, 0, r, h, h) for e, r in zip(ex[hi], nx[hi], strict=True) if r]
        got = recv[hi]
        if mine:
            p = min(mine)
            if got:
                q = min(got)
                if q < p:
                    p, mine = q, got
        elif got:
            p, mine = min(got), got
        else:
            break
        want = top - target
        if target - bottom < want:
            want = target - bottom
        size = -p[0]
        x = _give(size, gap, want, m)
        if not x:
            # the other pieces of this GPU in the same order, until one can give
            for p in sorted(own[hi] + got)[1:]:
                size = -p[0]
                x = _give(size, gap, want, m)
                if x:
                    mine = got if p in got else own[hi]
                    break
            else:
                break
        lo = L.index(bottom)
        d = g0 + lo
        _, e, a, b, h, held = p
        if d == h:
            back = True
        if x == size:
            mine.remove(p)
            recv[lo].append((-x, e, a, b, h, d))
        else:
            mine[mine.index(p)] = (x - size, e, a, b - x, h, held)
            recv[lo].append((-x, e, b - x, b, h, d))
        L[hi] = top - x
        L[lo] = bottom + x
    for got in recv:
        out += got
    return back


def _finish(policy: str, raw: list[tuple[int, int, int, int, int]], resident: frozenset[tuple[int, int]],
            dyn_WD: np.ndarray, before_W: np.ndarray, after: list[int] | np.ndarray, home_E: np.ndarray | None,
            rows_from_source: bool = False, weight_copies: tuple[tuple[int, int, int], ...] | None = None,
            info: dict | None = None, node: int | None = None, dispatched: bool = False, whole: bool = False,
            owners: frozenset[tuple[int, int]] = frozenset()) -> Plan:
    """dyn_WD, before_W (and ``after`` when an array): read-only int64 arrays that own their data (make_plan
    freezes them once); ``after`` as a list becomes a new frozen array. whole: raw holds tuples in Move's field
    order, at most one per (expert, dst), whose plain sort is the (expert, row_start) order and which have nothing
    to join (the feplb greedy's whole experts; FasterMoE's per-source ranges; EPLB's replicas). owners: (expert,
    GPU) pairs that hold an expert's weights besides ``resident`` (its owner, under a placement): no copy there."""
    new = tuple.__new__
    if not raw:
        moves = ()
        if weight_copies is None:
            weight_copies = ()
    elif whole:
        # nothing to join, and the (expert, src, dst) weight copies come out sorted and distinct
        raw.sort()
        moves = _moves(raw)
        if weight_copies is None:
            weight_copies = tuple([t[:3] for t in raw if (t[0], t[2]) not in resident and (t[0], t[2]) not in owners]
                                  if resident or owners else [t[:3] for t in raw])
    else:
        # pieces (-rows, expert, row_start, row_end, home, holder) away from home, in (expert, row_start) order;
        # a piece that starts where another of the same (expert, holder) ends follows it in that order
        raw.sort(key=_EXPERT_ROW)
        # the weight copies: one per (expert, home, holder)
        need = sorted(set(map(_COPY_FIELDS, raw)))
        if len(need) == len(raw):
            # at most one piece per (expert, holder): nothing to join
            moves = tuple([new(Move, (e, s, d, a, b)) for _, e, a, b, s, d in raw])
        else:
            joined: list[Move] = []
            append = joined.append
            pe = pd = pb = -1
            for _, e, a, b, s, d in raw:
                if a == pb and d == pd and e == pe:
                    joined[-1] = new(Move, (e, s, d, joined[-1][3], b))
                else:
                    append(new(Move, (e, s, d, a, b)))
                    pe, pd = e, d
                pb = b
            moves = tuple(joined)
        if weight_copies is None:
            weight_copies = tuple([c for c in need if (c[0], c[2]) not in resident and (c[0], c[2]) not in owners]
                                  if resident or owners else need)
    if isinstance(after, np.ndarray):
        after_W = after
    else:
        after_W = np.array(after, dtype=np.int64)
        after_W.setflags(write=False)
    return Plan._trusted(policy=policy, moves=moves, weight_copies=weight_copies, dynamic_WD=dyn_WD,
                         loads_before_W=before_W, loads_after_W=after_W, home_E=home_E,
                         rows_from_source=rows_from_source, dispatched=dispatched, node=node, info=info or {})


def make_plan(policy: str, counts_WE: np.ndarray, topo: Topology, state: PolicyState | None = None, *,
              tau: float = 0.01, min_chunk: int | None = None, cost: CostModel | None = None,
              max_shadow: int | None = None, total_rows: int | None = None, node: int | None = None) -> Plan:
    """Plan one MoE layer's micro-batch. Pure and deterministic.

    counts_WE: int [W, E] rows per (source rank, expert); never negative.
    state: the policy's history (EMA, placement, replicas); None means no history.
    tau: feplb / feplb-split stop once the node's max-min gap is at most tau x the node's mean load.
    min_chunk: smallest piece of an expert feplb-split moves (default: ``cost.knee_rows``).
    cost: the cost model (fastermoe's decision; feplb-split's default min_chunk).
    max_shadow: at most this many shadowed experts for fastermoe (default: no limit but the cost model's).
    total_rows: if given, counts_WE.sum() must equal it (the micro-batch's W * T * K rows).
    node: plan only this node (in-node policies and ``none``): the moves and balanced loads of that node, the other
        nodes' GPUs left at home. In-node plans of different nodes are independent, so a rank needs only its own
        node's, identical to that part of the full plan, at a fraction of the cost on many nodes.
    """
    base, place, mode = _check_args(policy, topo, state)
    counts_WE = topo.check_counts(counts_WE)
    W, G = topo.num_ranks, topo.gpus_per_node
    n_E = _ADD(counts_WE, 0)
    before_W = _ADD_AT(n_E, _consts(topo)[0])
    if total_rows is not None and int(_ADD(before_W)) != total_rows:
        raise ValueError(f"counts_WE sums to {int(_ADD(before_W))} rows, but the micro-batch has total_rows="
                         f"{total_rows}")
    if isinstance(tau, bool) or not (isinstance(tau, _REAL) and 0 <= tau < float("inf")):
        raise ValueError(f"tau must be a finite number >= 0, got {tau!r}")
    if cost is None:
        cost = _DEFAULT_COST
    elif not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a feplb.sched.CostModel or None, got {type(cost).__name__}")
    min_chunk = _int_arg("min_chunk", cost.knee_rows if min_chunk is None else min_chunk, 1)
    if max_shadow is not None:
        max_shadow = _int_arg("max_shadow", max_shadow, 0)
    if node is not None:
        if isinstance(node, bool) or not isinstance(node, _INT) or not 0 <= node < topo.num_nodes:
            raise ValueError(f"node must be an int in [0, {topo.num_nodes}), got {node!r}")
        node = int(node)
        if base in ("fastermoe", "eplb"):
            raise ValueError(f"node={node}: policy {policy!r} places rows across nodes and plans all of them")
    # fresh arrays that own their data: frozen in place once, the plan holds them without copies
    before_W.setflags(write=False)
    home_E = None if (state is None or not place) else state.home_E
    if home_E is None:
        at_home_W = before_W
    else:
        at_home_W = _ADD(n_E[state.slots_WS], 1)
        at_home_W.setflags(write=False)
    dyn_WD, neg_dyn_n_WD = _dynamic(n_E, topo, state, mode, place)
    dyn_WD.setflags(write=False)
    resident = frozenset() if state is None else state.resident
    # experts placed away from their owners: an owner keeps its parameters, so it computes their rows without a copy
    owners = frozenset() if home_E is None else state.owners_away

    if base == "none":
        return _finish(policy, [], resident, dyn_WD, before_W, at_home_W, home_E, node=node)
    if base == "fastermoe":
        return _fastermoe(policy, counts_WE, n_E, topo, _slots(topo, state), dyn_WD, before_W, at_home_W, home_E,
                          cost, max_shadow)
    L_all = at_home_W.tolist()
    if base == "eplb":
        return _eplb(policy, n_E, topo, state, dyn_WD, before_W, L_all, home_E)

    # the planned nodes' rows only: the other nodes' dynamic sets are not needed as Python lists
    g_first, g_end = (0, W) if node is None else (node * G, node * G + G)
    dyn = dyn_WD[g_first:g_end].tolist()
    dyn_n = np.negative(neg_dyn_n_WD[g_first:g_end]).tolist()
    raw: list = []
    after = L_all
    back = False
    for g0 in range(g_first, g_end, G):
        i0 = g0 - g_first
        L = L_all[g0:g0 + G]
        # (no gap exceeds the node's rows: a larger tau moves nothing, and a huge one must not overflow int())
        total = sum(L)
        tau_gap = int(min(tau * total / G, total))
        # the row lists are this call's own (tolist), the planners may consume them
        if base == "feplb":
            raw.extend((e, g0 + hi, g0 + lo, 0, n) for hi, lo, e, n in _greedy(L, dyn[i0:i0 + G], dyn_n[i0:i0 + G],
                                                                                tau_gap))
        elif base == "feplb-split":
            back |= _split_node(L, dyn[i0:i0 + G], dyn_n[i0:i0 + G], tau_gap, min_chunk, g0, True, raw)
        else:
            back |= _split_node(L, dyn[i0:i0 + G], dyn_n[i0:i0 + G], 0, 1, g0, False, raw)
        after[g0:g0 + G] = L
    if back:
        raw = [p for p in raw if p[4] != p[5]]
    return _finish(policy, raw, resident, dyn_WD, before_W, after, home_E, node=node, whole=base == "feplb",
                   owners=owners)


@lru_cache(maxsize=64)
def _fastermoe_consts(topo: Topology) -> tuple[np.ndarray, ...]:
    """The default homes int64 [E], the GPU ids int64 [W], and every expert's id reversed ((2**B - 1) - e, int64 [E]):
    with the rows shifted left by B bits, a key unique per expert that orders by (rows desc, id asc) when sorted
    descending."""
    _, _, bits, mask = _consts(topo)
    out = (topo.default_home_E(), np.arange(topo.num_ranks, dtype=np.int64),
           mask - np.arange(topo.num_experts, dtype=np.int64))
    for a in out:
        a.setflags(write=False)
    return (*out, bits)


def _fastermoe(policy: str, counts_WE: np.ndarray, n_E: np.ndarray, topo: Topology, slots: np.ndarray,
               dyn_WD: np.ndarray, before_W: np.ndarray, at_home_W: np.ndarray, home_E: np.ndarray | None,
               cost: CostModel, max_shadow: int | None) -> Plan:
    """at_home_W: int64 [W] (read-only), the loads with every expert at home (this plan's placement).

    Its time goes to numpy calls on [W] and [k, W] blocks and to the Move objects (bench/bench_sched.py): at this
    size each numpy call costs more than its arithmetic, so the fewer the better."""
    W, E = topo.num_ranks, topo.num_experts
    default_home, ar_W, rev_E, bits = _fastermoe_consts(topo)
    home_arr = default_home if home_E is None else home_E
    inter = topo.gpus_per_node < W
    t_E = cost.gemm_us(n_E)
    # the model's per-GPU state, one array: forward GEMM time [0:W], rows each GPU sends to other GPUs' experts
    # [W:2W] and rows it receives from other GPUs [2W:3W] (exact integers in float64)
    own_W = _ADD(counts_WE[ar_W[:, None], slots], 1)
    cur_W = np.empty(3 * W)
    cur_W[:W] = _ADD(t_E[slots], 1)
    np.subtract(_ADD(counts_WE, 1), own_W, out=cur_W[W:2 * W])
    np.subtract(at_home_W, own_W, out=cur_W[2 * W:])
    row_us = cost.copy_us(cost.row_bytes, inter_node=inter)
    bcast_us = cost.copy_us(cost.weight_bytes, inter_node=inter)
    a2a = 4 * row_us

    # FasterMoE's model of one iteration: forward and backward GEMMs (3x the forward), the dispatch and combine
    # all-to-alls of forward and backward (4 transfers of each row), and per shadowed expert one transfer of its
    # weights (its shadow_policy's send_model_time: the expert's parameters over the network); the busiest GPU
    # decides
    cur = before = 3 * float(_MAX(cur_W[:W])) + a2a * float(_MAX(cur_W[W:]))
    # candidates: the hottest experts first (ties to the lower id: the key is unique per expert), none without rows.
    # The rule takes them while the model's time drops, i.e. the longest prefix along which it falls: evaluated for
    # every prefix of a block at once (cumulative sums), blocks doubling until the time stops falling. A first
    # block of 16 holds what one iteration usually shadows (a second block costs as much as the first)
    # (FasterMoE's loop also never reaches the last expert of its order of all E, a cold one unless every expert
    # has rows: here every expert with rows may be shadowed)
    n_cand = min(E if max_shadow is None else max_shadow, int(np.count_nonzero(n_E)))
    order = np.argsort((n_E << bits) | rev_E)[::-1]
    shadow: list[int] = []
    pos, block = 0, 16
    while pos < n_cand:
        k = min(block, n_cand - pos)
        blk = order[pos:pos + k]
        ar = ar_W[:k] if k <= W else np.arange(k)
        h = home_arr[blk]
        cols = counts_WE[:, blk].T
        # row j: what shadowing candidate j changes in cur_W. Each source computes its own rows of it and sends
        # none; its home keeps only its own rows and receives none
        D = np.empty((k, 3 * W))
        D[:, :W] = cost.gemm_us(cols)
        D[ar, h] -= t_E[blk]
        np.negative(cols, out=D[:, W:2 * W])
        D[ar, W + h] = 0
        D[:, 2 * W:] = 0
        D[ar, 2 * W + h] = cols[ar, h] - n_E[blk]
        # cumulative over the candidates, row by row (np.cumsum along axis 0 calls its loop once per column)
        for j in range(1, k):
            D[j] += D[j - 1]
        D += cur_W
        lat = (3 * _MAX(D[:, :W], axis=1) + a2a * _MAX(D[:, W:], axis=1)).tolist()
        take, n0 = 0, len(shadow)
        for t in lat:
            t += bcast_us * (n0 + take + 1)
            if not t < cur:
                break
            cur = t
            take += 1
        if take:
            shadow += blk[:take].tolist()
            cur_W = D[take - 1]
        if take < k:
            break
        pos += k
        block *= 2
    info = {"shadowed": tuple(sorted(shadow)), "gemm_us_max": float(_MAX(cur_W[:W])), "model_us": cur,
            "model_us_before": before, "broadcast_us": len(shadow) * bcast_us}
    if not shadow:
        return _finish(policy, [], frozenset(), dyn_WD, before_W, at_home_W, home_E, rows_from_source=True,
                       info=info)
    # every source s computes its own rows of a shadowed expert e, rows [a, b) of e's home order (sources in rank
    # order), and receives its weights; in (expert, source) order, i.e. sorted by (expert, row_start)
    S_k = np.sort(np.asarray(shadow, dtype=np.int64))
    k = S_k.size
    h_k = home_arr[S_k]
    cols_kW = counts_WE.T[S_k]
    # the fields of the (expert, source) pairs [5, k, W], then those of the pairs with a move: away from the home,
    # with rows
    F = np.empty((5, k, W), dtype=np.int64)
    F[0] = S_k[:, None]
    F[1] = h_k[:, None]
    F[2] = ar_W
    _CUMSUM(cols_kW, axis=1, out=F[4])
    np.subtract(F[4], cols_kW, out=F[3])
    moved_kW = cols_kW.copy()
    moved_kW[ar_W[:k] if k <= W else np.arange(k), h_k] = 0
    moves = _moves(zip(*F[:, moved_kW != 0].tolist(), strict=True))
    copies = tuple(chain.from_iterable(map(_broadcast, S_k.tolist(), h_k.tolist(), repeat(W, k))))
    # loads: sources gain their own rows of e, its home loses the others'
    loads = at_home_W + _ADD(moved_kW, 0)
    np.subtract.at(loads, h_k, _ADD(moved_kW, 1))
    loads.setflags(write=False)
    return Plan._trusted(policy=policy, moves=moves, weight_copies=copies, dynamic_WD=dyn_WD, loads_before_W=before_W,
                         loads_after_W=loads, home_E=home_E, rows_from_source=True, dispatched=False, node=None,
                         info=info)


def _eplb(policy: str, n_E: np.ndarray, topo: Topology, state: PolicyState | None,
          dyn_WD: np.ndarray, before_W: np.ndarray, L: list[int], home_E: np.ndarray | None) -> Plan:
    """EPLB's physical layout (``PolicyState.layout_WP``, from the load history) executed on this micro-batch: the
    rows of each expert split evenly among its slots (``n // c`` each; the ``n % c`` rows left over go one by one
    to the slot whose GPU is least loaded so far, ties to the lower GPU id), the home GPU's share first in home
    order, then the other GPUs ascending. Without a layout yet (no history): plain EP."""
    pairs = None if state is None else state.eplb_pairs
    if pairs is None:
        return _finish(policy, [], frozenset(), dyn_WD, before_W, L, home_E, dispatched=True)
    pair_e, pair_g, mult, copies_E, src, away, shared = pairs
    W = topo.num_ranks
    q_E, r_E = np.divmod(n_E, copies_E)
    share = q_E[pair_e] * mult
    loads = np.zeros(W, dtype=np.int64)
    np.add.at(loads, pair_g, share)   # (in int64: bincount's float64 weights round sums past 2**53)
    r = r_E.tolist()
    todo = [(e, idx) for e, idx in shared if r[e]]
    if todo:
        ld = loads.tolist()
        g_all, m_all = pair_g.tolist(), mult.tolist()
        extra: dict[int, int] = {}
        for e, idx in todo:
            for _ in range(r[e]):
                # the least loaded GPU among this expert's pairs with a slot left, ties to the lower GPU id
                best, key = -1, None
                for i in idx:
                    if extra.get(i, 0) < m_all[i] and (key is None or (ld[g_all[i]], g_all[i]) < key):
                        best, key = i, (ld[g_all[i]], g_all[i])
                extra[best] = extra.get(best, 0) + 1
                ld[g_all[best]] += 1
        share[list(extra)] += list(extra.values())
        loads = np.asarray(ld, dtype=np.int64)
    end = np.cumsum(share)
    # rows in each expert's home order: less the rows of the experts before it
    end -= (np.cumsum(n_E) - n_E)[pair_e]
    start = end - share
    keep = away & (share > 0)
    # pairs are ordered by (expert, home first, GPU): the moves come out sorted by (expert, row_start); every
    # (expert, GPU) of the layout is normally resident (PolicyState.replicas, re-synced once per step), so nothing
    # is copied per micro-batch; a state that holds no replicas (a runtime keeping nothing per step) copies them
    moves = _moves(zip(pair_e[keep].tolist(), src[keep].tolist(), pair_g[keep].tolist(), start[keep].tolist(),
                       end[keep].tolist(), strict=True))
    resident = state.resident
    owners = frozenset() if home_E is None else state.owners_away   # (an owner keeps its experts' parameters)
    need = [m for m in moves if (m.expert, m.dst) not in resident and (m.expert, m.dst) not in owners]
    copies = tuple(sorted({(m.expert, m.src, m.dst) for m in need})) if need else ()
    loads.setflags(write=False)
    return Plan._trusted(policy=policy, moves=moves, weight_copies=copies, dynamic_WD=dyn_WD, loads_before_W=before_W,
                         loads_after_W=loads, home_E=home_E, rows_from_source=False, dispatched=True, node=None,
                         info={})
