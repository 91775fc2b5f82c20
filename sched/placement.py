"""Slow-timescale decisions from routing history: expert placement across nodes and EPLB-style replicas.

Legend: W GPUs, G GPUs per node, E experts. ``load_E`` is a history of per-expert rows (e.g. an EMA), int64 [E].
All functions are deterministic: ties break on (load, node or GPU id, expert id), all in integers.
"""

from __future__ import annotations

import math

import numpy as np

from feplb.sched.topology import Topology


def _check_load(load_E: np.ndarray, topo: Topology) -> list[int]:
    a = np.asarray(load_E)
    if a.shape != (topo.num_experts,) or a.dtype.kind not in "iu":
        raise ValueError(f"load_E must be an integer array of shape [{topo.num_experts}], "
                         f"got {a.dtype} {list(a.shape)}")
    if a.size and int(a.min()) < 0:
        raise ValueError(f"load_E must be >= 0, got min {int(a.min())}")
    return [int(v) for v in a]


def place_experts(load_E: np.ndarray, topo: Topology) -> np.ndarray:
    """A placement that balances the history's load between nodes, then between the GPUs of each node.

    Longest-processing-time first: experts in order of decreasing load go to the least loaded node with a free
    slot, then to the least loaded GPU of that node with a free slot. Every GPU keeps E // W experts, so memory
    per GPU is unchanged. Returns home_E: int64 [E], the GPU of every expert.
    """
    load = _check_load(load_E, topo)
    W, G, epr = topo.num_ranks, topo.gpus_per_node, topo.experts_per_rank
    n_nodes = topo.num_nodes
    order = sorted(range(topo.num_experts), key=lambda e: (-load[e], e))
    node_load = [0] * n_nodes
    node_free = [G * epr] * n_nodes
    gpu_load = [0] * W
    gpu_free = [epr] * W
    home = [0] * topo.num_experts
    for e in order:
        best_n = -1
        for n in range(n_nodes):
            if node_free[n] and (best_n < 0 or node_load[n] < node_load[best_n]):
                best_n = n
        best_g = -1
        for g in range(best_n * G, best_n * G + G):
            if gpu_free[g] and (best_g < 0 or gpu_load[g] < gpu_load[best_g]):
                best_g = g
        node_load[best_n] += load[e]
        node_free[best_n] -= 1
        gpu_load[best_g] += load[e]
        gpu_free[best_g] -= 1
        home[e] = best_g
    return np.asarray(home, dtype=np.int64)


def _packing(weights: list[int], num_packs: int) -> list[int]:
    """EPLB's balanced packing: items, heaviest first (ties: lower index), each to the lightest pack that still has
    room (ties: lower pack id); every pack takes exactly len(weights) // num_packs items. Returns each item's pack.
    """
    cap = len(weights) // num_packs
    if cap == 1:
        return list(range(len(weights)))
    load, room, pack = [0] * num_packs, [cap] * num_packs, [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        best = -1
        for p in range(num_packs):
            if room[p] and (best < 0 or load[p] < load[best]):
                best = p
        pack[i] = best
        load[best] += weights[i]
        room[best] -= 1
    return pack


def _replicate(load: list[int], num_phy: int) -> list[int]:
    """EPLB's replication: each of the ``num_phy - len(load)`` redundant slots goes to the expert with the highest
    load per replica (exact integer comparison, ties to the lower index). Returns every expert's replica count."""
    cnt = [1] * len(load)
    for _ in range(num_phy - len(load)):
        best = 0
        for e in range(1, len(load)):
            if load[e] * cnt[best] > load[best] * cnt[e]:
                best = e
        cnt[best] += 1
    return cnt


def _relabel(members: list[list[int]], home_of: list[int], targets: list[int]) -> list[int]:
    """Match interchangeable packs to targets (nodes or GPUs): the pairs sharing the most members with a target's
    homes first (ties: lower pack, then lower target). The balance is unchanged; fewer experts leave home."""
    pairs = sorted(((-sum(home_of[e] == t for e in set(m)), p, t) for p, m in enumerate(members) for t in targets))
    out, used_p, used_t = [-1] * len(members), set(), set()
    for _, p, t in pairs:
        if p not in used_p and t not in used_t:
            out[p] = t
            used_p.add(p)
            used_t.add(t)
    return out


def eplb_layout(load_E: np.ndarray, topo: Topology, slots_per_gpu: int, num_groups: int = 1,
                home_E: np.ndarray | None = None) -> np.ndarray:
    """DeepSeek's EPLB (github.com/deepseek-ai/EPLB, ``rebalance_experts``): a full physical layout of the experts.

    Every GPU gets ``P = E // W + slots_per_gpu`` expert slots; the ``W * slots_per_gpu`` redundant slots go to the
    logical experts with the highest load per replica, and a balanced packing places the replicas (load / replica
    count each) so that per-GPU load is even. Hierarchical when the number of nodes divides ``num_groups`` (the
    model's expert groups, contiguous blocks of E // num_groups experts): groups are packed onto nodes, then the
    experts of each node are replicated and packed onto its GPUs (replicas stay inside the node); otherwise global
    (one group, one node). Tokens of a replicated expert are later split evenly among its copies.

    Packs are interchangeable, so they are matched to nodes and GPUs that already hold most of their experts at home
    (``home_E``, default ``e // (E // W)``): same loads as EPLB's labelling, fewer weights away from home.
    load_E: int [E] load history. Returns layout_WP: int64 [W, P], the logical expert in each slot (rows ascending);
    an expert may fill several slots, also on one GPU.
    """
    load = _check_load(load_E, topo)
    if isinstance(slots_per_gpu, bool) or not isinstance(slots_per_gpu, int) or slots_per_gpu < 0:
        raise ValueError(f"slots_per_gpu must be an int >= 0, got {slots_per_gpu!r}")
    E, W, G = topo.num_experts, topo.num_ranks, topo.gpus_per_node
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1 or E % num_groups:
        raise ValueError(f"num_groups must be a positive int dividing E={E}, got {num_groups!r}")
    home = topo.default_home_E().tolist() if home_E is None else [int(h) for h in home_E]
    nodes = topo.num_nodes
    if num_groups % nodes:
        nodes, G, num_groups = 1, W, 1  # EPLB's global policy: all GPUs one pool
    P = E // W + slots_per_gpu
    size = E // num_groups
    # step 1: groups to nodes (packs of num_groups // nodes groups), in arrival order inside each node
    g_load = [sum(load[g * size:(g + 1) * size]) for g in range(num_groups)]
    g_pack = _packing(g_load, nodes)
    # EPLB numbers a node's experts by its groups' arrival order in the packing (heaviest first)
    node_groups = [sorted((g for g in range(num_groups) if g_pack[g] == n), key=lambda g: (-g_load[g], g))
                   for n in range(nodes)]
    node_of = _relabel([[e for g in gs for e in range(g * size, (g + 1) * size)] for gs in node_groups],
                       [h // G for h in home], list(range(nodes)))
    layout: list[list[int]] = [[] for _ in range(W)]
    for n, gs in enumerate(node_groups):
        # step 2: replicate the node's experts into its G * P slots
        mlog = [e for g in gs for e in range(g * size, (g + 1) * size)]
        cnt = _replicate([load[e] for e in mlog], G * P)
        scale = math.lcm(*set(cnt))
        items = [(mlog[j], load[mlog[j]] * (scale // cnt[j])) for j in range(len(mlog)) for _ in range(cnt[j])]
        # step 3: pack the replicas (load / count each, scaled to integers) onto the node's GPUs
        pack = _packing([w for _, w in items], G)
        members = [[e for (e, _), p in zip(items, pack, strict=True) if p == k] for k in range(G)]
        n0 = node_of[n] * G
        gpu_of = _relabel(members, home, list(range(n0, n0 + G)))
        for k, m in enumerate(members):
            layout[gpu_of[k]] = sorted(m)
    return np.asarray(layout, dtype=np.int64).reshape(W, P)


def eplb_replicas(layout_WP: np.ndarray, home_E: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Sorted distinct (expert, gpu) pairs of a layout whose GPU is not the expert's home: the weights held away
    from home. layout_WP: int64 [W, P] (``eplb_layout``); home_E: int64 [E]."""
    return tuple(sorted({(int(e), g) for g, row in enumerate(layout_WP.tolist()) for e in row
                         if int(home_E[e]) != g}))
