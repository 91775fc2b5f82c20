"""The layer's pure layouts (``feplb.layout``) row by row against a brute-force simulation, without processes.

Every row is tagged with its identity (source rank, slot, index among that source's rows of the slot); the
simulation moves the tags exactly as the design describes (phase 1 by source then slot, home order by slot in
static-then-dynamic order then source, moves taking ranges of an expert's home order, results returning home), and
the layouts must put every tag where the simulation does. Thousands of random cases, including empty sources, empty
experts, whole-expert moves and several moves per expert.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from feplb.layout import Item, exchange_layout, home_layout, inverse, phase2_layout


def _random_case(rng):
    W = int(rng.choice([1, 2, 3, 4]))
    L = int(rng.integers(1, 5))
    G = int(rng.choice([g for g in (1, 2, 4) if W % g == 0]))
    hi = int(rng.choice([0, 1, 3, 9]))
    counts_WS = rng.integers(0, hi + 1, size=(W, W * L))
    counts_WS[rng.random(counts_WS.shape) < 0.2] = 0
    dyn = [sorted(rng.choice(L, size=int(rng.integers(0, L + 1)), replace=False).tolist()) for _ in range(W)]
    # moves: ranges of dynamic slots' home order to other GPUs of the node, disjoint, random cut points
    moves = []
    n_S = counts_WS.sum(axis=0)
    for r in range(W):
        peers = [g for g in range(r // G * G, r // G * G + G) if g != r]
        for i in dyn[r]:
            n = int(n_S[r * L + i])
            if not peers or n == 0:
                continue
            cuts = sorted(set(rng.integers(0, n + 1, size=int(rng.integers(0, 4))).tolist()) | {0, n})
            for a, b in zip(cuts, cuts[1:], strict=False):
                if rng.random() < 0.5:
                    moves.append(SimpleNamespace(expert=r * L + i, src=r, dst=int(rng.choice(peers)), row_start=a,
                                                 row_end=b, rows=b - a))
    moves.sort(key=lambda m: (m.expert, m.row_start))
    return W, L, G, counts_WS, dyn, moves


def _brute(W, L, counts_WS, dyn, moves, r):
    """Tags in receive order, home order, and the tags each GPU computes (per move: the hosted tags)."""
    recv = [(s, r * L + i, k) for s in range(W) for i in range(L) for k in range(int(counts_WS[s, r * L + i]))]
    order = [i for i in range(L) if i not in dyn[r]] + sorted(dyn[r])
    home = [(s, r * L + i, k) for i in order for s in range(W) for k in range(int(counts_WS[s, r * L + i]))]

    def expert_rows(slot):  # an expert's home order
        return [(s, slot, k) for s in range(W) for k in range(int(counts_WS[s, slot]))]

    moved_out = {}
    for j, m in enumerate(moves):
        if m.src == r:
            moved_out[j] = expert_rows(m.expert)[m.row_start:m.row_end]
    taken = {t for ts in moved_out.values() for t in ts}
    kept = [t for i in sorted(dyn[r]) for t in expert_rows(r * L + i) if t not in taken]
    static = [t for t in home if (t[1] - r * L) not in dyn[r]]
    return recv, home, static, kept, moved_out


@pytest.mark.parametrize("seed", range(6))
def test_home_and_phase2_layouts_match_row_simulation(seed):
    rng = np.random.default_rng(seed)
    for _ in range(400):
        W, L, G, counts_WS, dyn, moves = _random_case(rng)
        computed = {}   # tag -> number of GPUs computing it
        for r in range(W):
            recv, home_tags, static, kept, moved_out = _brute(W, L, counts_WS, dyn, moves, r)
            home = home_layout(counts_WS[:, r * L:(r + 1) * L], dyn[r])
            # phase 1 into home order
            assert [recv[p] for p in home.perm] == home_tags
            assert home.n_static == len(static)
            assert home.recv_splits == [int(counts_WS[s, r * L:(r + 1) * L].sum()) for s in range(W)]
            assert np.array_equal(np.cumsum(home.static_L)[-1:], [len(static)] if L else [])
            slot_of = {r * L + i: i for i in range(L)}
            lay = phase2_layout(home, moves, slot_of, r)
            # rows sent: each move's home-order range
            assert [j for j, _, _ in lay.out] == sorted(moved_out)
            for j, a, b in lay.out:
                assert home_tags[a:b] == moved_out[j]
            # rows kept at home, grouped by slot (grouped GEMM sizes)
            assert [home_tags[p] for p in lay.kept_idx] == kept
            assert lay.kept_L.sum() == len(kept) and all(lay.kept_L[i] == 0 for i in range(L) if i not in dyn[r])
            assert [t[1] for t in kept] == sorted(t[1] for t in kept)
            # results: compute order (static, kept, returned per move out) gathered back into receive order
            compute = static + kept + [t for j, _, _ in lay.out for t in moved_out[j]]
            assert [compute[g] for g in lay.gather] == recv
            assert lay.hosted == [j for j, m in enumerate(moves) if m.dst == r]
            for t in static + kept:
                computed[t] = computed.get(t, 0) + 1
            for j in lay.hosted:
                m = moves[j]
                rows = _brute(W, L, counts_WS, dyn, moves, m.src)[4][j]
                for t in rows:
                    computed[t] = computed.get(t, 0) + 1
        every = {(s, e, k) for s in range(W) for e in range(W * L) for k in range(int(counts_WS[s, e]))}
        assert set(computed) == every and set(computed.values()) <= {1}, "a row computed twice or never"


def test_phase2_layout_rejects_moves_of_static_slots():
    home = home_layout(np.array([[3, 2], [1, 4]]), dynamic=[1])
    bad = SimpleNamespace(expert=0, src=0, dst=1, row_start=0, row_end=2, rows=2)
    with pytest.raises(ValueError, match="not a dynamic slot"):
        phase2_layout(home, [bad], {0: 0, 1: 1}, 0)
    over = SimpleNamespace(expert=1, src=0, dst=1, row_start=0, row_end=7, rows=7)
    with pytest.raises(ValueError, match="outside"):
        phase2_layout(home, [over], {0: 0, 1: 1}, 0)
    with pytest.raises(ValueError, match="distinct"):
        home_layout(np.array([[3, 2]]), dynamic=[1, 1])


@pytest.mark.parametrize("seed", range(3))
def test_exchange_layout_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(500):
        G = int(rng.choice([1, 2, 4]))
        W = G * int(rng.integers(1, 4))
        items = [Item(int(rng.integers(W)), int(rng.integers(W)), int(rng.integers(0, 5)))
                 for _ in range(int(rng.integers(0, 12)))]
        cross_any = any(it.src // G != it.dst // G and it.numel for it in items)
        for r in range(W):
            lay = exchange_layout(items, r, G)
            live = [(k, it) for k, it in enumerate(items) if it.src != it.dst and it.numel]
            assert lay.send == {d: [k for k, it in live if it.src == r and it.dst == d]
                                for d in sorted({it.dst for _, it in live if it.src == r})}
            assert lay.recv == {s: [k for k, it in live if it.dst == r and it.src == s]
                                for s in sorted({it.src for _, it in live if it.dst == r})}
            assert lay.recv_numel == {s: sum(items[k].numel for k in ks) for s, ks in lay.recv.items()}
            base = r // G * G
            nm = np.zeros((G, G), np.int64)
            for _, it in live:
                if base <= it.src < base + G and base <= it.dst < base + G:
                    nm[it.src - base, it.dst - base] += it.numel
            assert np.array_equal(lay.node_matrix, nm)
            assert lay.cross_node == cross_any
            assert lay.intra_node == bool(nm.any())


def test_inverse():
    rng = np.random.default_rng(0)
    p = rng.permutation(50)
    x = rng.random(50)
    assert np.array_equal(x[p][inverse(p)], x)


def test_cuda_handoff_exchange_needs_a_ready_event():
    """A worker thread cannot know which stream produced the sends: a CUDA exchange it issues (``start``, or
    ``issue(handoff=True)``) without their ready event is refused, naming the exchange, before anything runs."""
    import torch

    from feplb.dispatch import Exchange

    comm = SimpleNamespace(rank=0, gpus_per_node=2)
    ex = Exchange(comm, [Item(0, 1, 4), Item(1, 0, 4)], dtype=torch.float32, device=torch.device("cuda", 0),
                  op="rows to helpers")
    with pytest.raises(ValueError, match="rows to helpers: Exchange.start on CUDA needs the sends' ready event"):
        ex.start([torch.zeros(4)], worker=None)
    with pytest.raises(ValueError, match="rows to helpers: a hand-off exchange on CUDA needs the sends' ready"):
        ex.issue([torch.zeros(4)], None, handoff=True)
