"""Where every row goes: the MoE layer's layouts as pure numpy functions of the counts and the plan.

Nothing here touches a process group, a stream or a tensor: the layer computes a layout once per micro-batch and
executes it with index_select / slicing, and the tests check every layout row by row against a brute-force
simulation (``tests/runtime/test_layout.py``).

Orders of rows on one GPU (rank r) in the in-node path (FEPLB and its extensions):

* SEND ORDER (phase 1, on every source): grouped by slot (home GPU, then the expert's place among that GPU's
  slots), then token, then k: the permute kernel's order.
* RECEIVE ORDER (after phase 1): by source rank, then the source's send order restricted to r's slots.
* HOME ORDER: r's slots in ``order`` (static slots ascending, then dynamic slots ascending), each slot's rows by
  source rank then the source's order. Row ranges of ``feplb.sched.Move`` index an expert's home order.
* COMPUTE ORDER of results: the static block, then the dynamic rows kept at home, then the results of each move
  out of r returning from its helper (plan order); ``Phase2Layout.gather`` maps it back to receive order in one
  index_select.

Legend: W EP ranks, L slots (experts) per GPU, R rows at home on r after phase 1, M rows r sends in phase 1,
G GPUs per node, H hidden (row width).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DirectLayout", "ExchangeLayout", "HomeLayout", "Item", "Phase2Layout", "direct_layout",
           "direct_split_matrix", "exchange_layout", "home_layout", "inverse", "phase2_layout", "weight_items",
           "weight_sends"]


def inverse(perm: np.ndarray) -> np.ndarray:
    """int64: the inverse of a permutation, ``x[perm][inverse(perm)] == x``."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def _aranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64: concatenation of arange(s, s + n) for each (s, n), without a Python loop over the pieces."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    keep = lengths > 0
    starts, lengths = np.asarray(starts, dtype=np.int64)[keep], lengths[keep]
    ends = np.cumsum(lengths)
    out = np.ones(total, dtype=np.int64)
    out[0] = starts[0]
    out[ends[:-1]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(out)


@dataclass(frozen=True, kw_only=True, eq=False)
class HomeLayout:
    """Phase-1 rows of one GPU in home order (see ``home_layout``)."""

    perm: np.ndarray      # int64 [R]: receive-order index of each home-order row
    order: tuple[int, ...]  # slots in home order: static ascending, then dynamic ascending
    start_L: np.ndarray   # int64 [L]: first home-order row of each slot
    n_L: np.ndarray       # int64 [L]: rows of each slot
    n_static: int         # rows of the static slots (the first block of home order)
    dynamic: tuple[int, ...]  # dynamic slots, ascending
    recv_splits: list[int]  # [W] rows received from each source
    static_L: np.ndarray  # int64 [L]: rows of each slot in the static block (0 for dynamic slots)


def home_layout(c_WL: np.ndarray, dynamic: Sequence[int]) -> HomeLayout:
    """Home order of one GPU's phase-1 rows.

    c_WL: int [W, L] rows source s sends to this GPU's slot i. dynamic: this GPU's dynamic slots (any order).
    """
    c_WL = np.asarray(c_WL, dtype=np.int64)
    W, L = c_WL.shape
    dyn = tuple(sorted(int(i) for i in dynamic))
    if len(set(dyn)) != len(dyn) or any(not 0 <= i < L for i in dyn):
        raise ValueError(f"home_layout: dynamic slots {list(dynamic)} must be distinct and in [0, {L})")
    dset = set(dyn)
    order = tuple(i for i in range(L) if i not in dset) + dyn
    recv_W = c_WL.sum(axis=1)
    recv_off = np.cumsum(recv_W) - recv_W
    within_WL = np.cumsum(c_WL, axis=1) - c_WL
    o = np.asarray(order, dtype=np.int64)
    starts = (recv_off[None, :] + within_WL[:, o].T).reshape(-1)   # [slot in order, source]
    lengths = c_WL[:, o].T.reshape(-1)
    n_L = c_WL.sum(axis=0)
    start_L = np.zeros(L, dtype=np.int64)
    start_L[o] = np.cumsum(n_L[o]) - n_L[o]
    static_L = n_L.copy()
    static_L[list(dyn)] = 0
    return HomeLayout(perm=_aranges(starts, lengths), order=order, start_L=start_L, n_L=n_L,
                      n_static=int(static_L.sum()), dynamic=dyn, recv_splits=recv_W.tolist(), static_L=static_L)


@dataclass(frozen=True, kw_only=True, eq=False)
class Phase2Layout:
    """What one GPU does with a plan's moves (see ``phase2_layout``)."""

    out: list[tuple[int, int, int]]   # (move index, home-order start, end) of each move out of this GPU, plan order
    hosted: list[int]                 # move indices of the moves into this GPU, plan order
    kept_idx: np.ndarray              # int64 [K]: home-order rows of dynamic slots computed here, by slot then row
    kept_L: np.ndarray                # int64 [L]: rows of kept_idx per slot (grouped GEMM sizes; 0 for static)
    gather: np.ndarray                # int64 [R]: compute-order index of each RECEIVE-order row's result


def phase2_layout(home: HomeLayout, moves: Sequence, slot_of: dict[int, int], rank: int) -> Phase2Layout:
    """Rows this GPU sends, keeps and gets back under ``moves`` (non-empty moves: expert, src, dst, row_start,
    row_end, ranges in the expert's home order).

    slot_of: {expert: slot} of this GPU's slots. A move out of this GPU must take rows of one of its dynamic slots.
    """
    L = home.n_L.size
    dyn = set(home.dynamic)
    out, hosted = [], []
    cut_L: list[list[tuple[int, int]]] = [[] for _ in range(L)]
    for j, m in enumerate(moves):
        if m.dst == rank:
            hosted.append(j)
        if m.src != rank:
            continue
        i = slot_of.get(m.expert)
        if i is None or i not in dyn:
            raise ValueError(f"phase2_layout: move {m} takes expert {m.expert}, which is not a dynamic slot of GPU "
                             f"{rank} (dynamic: {sorted(e for e, s in slot_of.items() if s in dyn)})")
        if not 0 <= m.row_start < m.row_end <= home.n_L[i]:
            raise ValueError(f"phase2_layout: move {m} outside expert {m.expert}'s {int(home.n_L[i])} rows")
        s0 = int(home.start_L[i])
        out.append((j, s0 + m.row_start, s0 + m.row_end))
        cut_L[i].append((m.row_start, m.row_end))
    kept_starts, kept_lens = [], []
    kept_L = np.zeros(L, dtype=np.int64)
    for i in home.dynamic:
        cur, s0 = 0, int(home.start_L[i])
        for a, b in sorted(cut_L[i]):
            if a < cur:
                raise ValueError(f"phase2_layout: moves of slot {i} overlap at home-order row {a}")
            kept_starts.append(s0 + cur)
            kept_lens.append(a - cur)
            cur = b
        kept_starts.append(s0 + cur)
        kept_lens.append(int(home.n_L[i]) - cur)
        kept_L[i] = int(home.n_L[i]) - sum(b - a for a, b in cut_L[i])
    kept_idx = _aranges(np.asarray(kept_starts, np.int64), np.asarray(kept_lens, np.int64))
    # compute order -> home order: static block (home rows 0..n_static), kept rows, then each move out's rows
    R = int(home.n_L.sum())
    src_of_home = np.empty(R, dtype=np.int64)
    src_of_home[:home.n_static] = np.arange(home.n_static)
    src_of_home[kept_idx] = home.n_static + np.arange(kept_idx.size)
    pos = home.n_static + kept_idx.size
    for _, a, b in out:
        src_of_home[a:b] = np.arange(pos, pos + b - a)
        pos += b - a
    gather = np.empty(R, dtype=np.int64)
    gather[home.perm] = src_of_home      # receive-order row home.perm[p] is home-order row p
    return Phase2Layout(out=out, hosted=hosted, kept_idx=kept_idx, kept_L=kept_L, gather=gather)


# ---------------------------------------------------------------------------------------------------- exchanges
@dataclass(frozen=True)
class Item:
    """One block of an exchange: ``numel`` elements that rank ``src`` sends rank ``dst``."""

    src: int
    dst: int
    numel: int


@dataclass(frozen=True, kw_only=True, eq=False)
class ExchangeLayout:
    """One rank's part of an exchange whose items every rank of its scope knows (see ``exchange_layout``)."""

    send: dict[int, list[int]]       # dst rank -> item indices this rank sends it, in item order
    recv: dict[int, list[int]]       # src rank -> item indices this rank receives from it, in item order
    recv_numel: dict[int, int]       # src rank -> elements received from it
    node_matrix: np.ndarray          # int64 [G, G]: elements node rank i sends node rank j (this rank's node)
    cross_node: bool                 # some item anywhere crosses nodes (the transport is called, globally agreed)
    intra_node: bool                 # some item stays inside this rank's node (its copy path is called)


def exchange_layout(items: Sequence[Item], rank: int, gpus_per_node: int) -> ExchangeLayout:
    """Derive one rank's sends, receives and its node's traffic matrix from the exchange's items (identical on
    every rank of the node; identical on every rank of the group whenever any item crosses nodes, since
    ``cross_node`` decides a group-wide transport call: a node plan's phase-2 items stay in their node), so no
    size agreement is needed and every rank of a node agrees on whether to call the copy path.
    Items with src == dst are local (never sent); items of size 0 are left out of the traffic."""
    G = gpus_per_node
    node = rank // G
    base = node * G
    send: dict[int, list[int]] = {}
    recv: dict[int, list[int]] = {}
    recv_numel: dict[int, int] = {}
    nm = np.zeros((G, G), dtype=np.int64)
    cross = intra = False
    for k, it in enumerate(items):
        if it.src == it.dst or it.numel == 0:
            continue
        if it.src // G != it.dst // G:
            cross = True
        elif it.src // G == node:
            intra = True
            nm[it.src - base, it.dst - base] += it.numel
        if it.src == rank:
            send.setdefault(it.dst, []).append(k)
        if it.dst == rank:
            recv.setdefault(it.src, []).append(k)
            recv_numel[it.src] = recv_numel.get(it.src, 0) + it.numel
    return ExchangeLayout(send=dict(sorted(send.items())), recv=dict(sorted(recv.items())),
                          recv_numel=dict(sorted(recv_numel.items())), node_matrix=nm, cross_node=cross,
                          intra_node=intra)


def weight_items(copies: Sequence[tuple[int, int, int]], part_sizes: Sequence[int]) -> list[Item]:
    """Exchange items for expert weights (expert, src, dst), one per part of an expert's weights (``part_sizes``
    elements each: w1 [H, 2F], w2 [F, H], and the biases b1 [2F], b2 [H] where the experts have them): every copy's
    first part, then every copy's second, ..., each in ``copies`` order, so that a receiver's blocks from one source
    view in place as stacked weights. Copy k's part j is item ``j * len(copies) + k`` (offset by where the weights
    start)."""
    return [Item(s, d, size) for size in part_sizes for _, s, d in copies]


def weight_sends(copies: Sequence[tuple[int, int, int]], rank: int, base: int = 0,
                 parts: int = 2) -> dict[int, tuple[str, int, int]]:
    """{item index: ("w", part, expert)} of the ``weight_items`` (``parts`` per expert) that ``rank`` sends, the
    weight items starting at item ``base`` of the exchange."""
    n = len(copies)
    out: dict[int, tuple[str, int, int]] = {}
    for k, (e, s, d) in enumerate(copies):
        if s == rank and d != s:
            for j in range(parts):
                out[base + j * n + k] = ("w", j, e)
    return out


# ---------------------------------------------------------------------------------------------------- direct path
@dataclass(frozen=True)
class DirectLayout:
    """Phase-1 layout of a plan whose rows go straight to the GPU that computes them (see ``direct_layout``)."""

    send_idx: np.ndarray | None   # int64 [M]: local rows in send order; None when that is the identity
    send_splits: list[int]        # [W] rows sent to each rank
    recv_splits: list[int]        # [W] rows received from each rank
    perm: np.ndarray              # int64 [R]: received rows in compute order
    kept_L: np.ndarray            # int64 [L]: rows of each of my slots computed here (compute order's first part)
    hosted: list[int]             # indices into moves of the moves to this rank (compute order's second part)


def direct_layout(counts_WE: np.ndarray, slots_WS: np.ndarray, moves: tuple, rank: int) -> DirectLayout:
    """Where each row goes when the plan's moves are executed by the phase-1 dispatch itself.

    counts_WE: int [W, E] rows per (source, expert); slots_WS: int [W, L] the experts computed at home on each GPU
    (ascending); moves: non-empty moves (expert, src = home, dst, row_start, row_end), ranges in the expert's HOME
    ORDER (by source rank, then the source's own order). Source s sends destination d, in this order: for each
    slot of d, s's rows of that expert that no move takes; then for each move to d (plan order), s's rows inside
    the move's range. The receiver computes its slots' rows grouped by slot (home order), then each hosted move's
    rows (home order), exactly the rows a plain EP home would give that expert, minus or plus the moved ranges.
    """
    W, E = counts_WE.shape
    L = slots_WS.shape[1]
    off_WE = np.cumsum(counts_WE, axis=0) - counts_WE
    n_E = counts_WE.sum(axis=0)
    moved: dict[int, list[tuple[int, int]]] = {}
    to: list[list[int]] = [[] for _ in range(W)]
    for j, m in enumerate(moves):
        moved.setdefault(m.expert, []).append((m.row_start, m.row_end))
        to[m.dst].append(j)
    kept_cache: dict[int, list[tuple[int, int]]] = {}

    def kept(e: int) -> list[tuple[int, int]]:
        if e not in kept_cache:
            out, cur = [], 0
            for a, b in sorted(moved[e]):
                if a > cur:
                    out.append((cur, a))
                cur = max(cur, b)
            if cur < n_E[e]:
                out.append((cur, int(n_E[e])))
            kept_cache[e] = out
        return kept_cache[e]

    def clip(s: int, e: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """ranges of e's home order intersected with source s's rows, relative to s's first row of e."""
        o, c = int(off_WE[s, e]), int(counts_WE[s, e])
        return [(max(a, o) - o, min(b, o + c) - o) for a, b in ranges if min(b, o + c) > max(a, o)]

    slots = slots_WS.tolist()

    def items(s: int, d: int) -> list[tuple[tuple[str, int], int, list[tuple[int, int]]]]:
        out = []
        for i, e in enumerate(slots[d]):
            out.append((("k", i), e, clip(s, e, kept(e)) if e in moved else [(0, int(counts_WE[s, e]))]))
        for j in to[d]:
            m = moves[j]
            out.append((("m", j), m.expert, clip(s, m.expert, [(m.row_start, m.row_end)])))
        return out

    flat = slots_WS.reshape(-1)
    slot_of = np.empty(E, dtype=np.int64)
    slot_of[flat] = np.arange(E)
    c_r = counts_WE[rank, flat]
    xoff = np.cumsum(c_r) - c_r
    idx, send_splits = [], []
    for d in range(W):
        n = 0
        for _, e, rng in items(rank, d):
            base = int(xoff[slot_of[e]])
            for a, b in rng:
                idx.append(np.arange(base + a, base + b))
                n += b - a
        send_splits.append(n)
    send_idx = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    if np.array_equal(send_idx, np.arange(send_idx.size)):
        send_idx = None
    pos: dict[tuple[str, int], list[np.ndarray]] = {}
    recv_splits, start = [], 0
    for s in range(W):
        n0 = start
        for key, _, rng in items(s, rank):
            for a, b in rng:
                pos.setdefault(key, []).append(np.arange(start, start + b - a))
                start += b - a
        recv_splits.append(start - n0)
    kept_L = np.zeros(L, dtype=np.int64)
    perm = []
    for i in range(L):
        for p in pos.get(("k", i), ()):
            perm.append(p)
            kept_L[i] += p.size
    for j in to[rank]:
        got = sum(p.size for p in pos.get(("m", j), ()))
        if got != moves[j].rows:
            raise RuntimeError(f"direct dispatch: move {moves[j]} gathers {got} rows from its sources")
        perm.extend(pos.get(("m", j), ()))
    perm_R = np.concatenate(perm) if perm else np.zeros(0, np.int64)
    return DirectLayout(send_idx=send_idx, send_splits=send_splits, recv_splits=recv_splits, perm=perm_R,
                        kept_L=kept_L, hosted=list(to[rank]))


def direct_split_matrix(counts_WE: np.ndarray, slots_WS: np.ndarray, moves: tuple) -> np.ndarray:
    """int64 [W, W]: rows source s sends GPU d in the direct dispatch of ``direct_layout`` (identical on every rank,
    so the transport needs no size agreement): s's rows of each expert go to its home, except the parts of the
    expert's home order that a move sends to its destination."""
    counts_WE = np.asarray(counts_WE, dtype=np.int64)
    W, E = counts_WE.shape
    home_E = np.empty(E, dtype=np.int64)
    home_E[np.asarray(slots_WS).reshape(-1)] = np.repeat(np.arange(W), np.asarray(slots_WS).shape[1])
    out = np.zeros((W, W), dtype=np.int64)
    np.add.at(out, (np.repeat(np.arange(W), E), np.tile(home_E, W)), counts_WE.reshape(-1))
    lo_WE = np.cumsum(counts_WE, axis=0) - counts_WE     # first home-order row of each source, per expert
    for m in moves:
        lo, n = lo_WE[:, m.expert], counts_WE[:, m.expert]
        take = np.clip(np.minimum(lo + n, m.row_end) - np.maximum(lo, m.row_start), 0, None)
        out[:, m.src] -= take
        out[:, m.dst] += take
    return out
