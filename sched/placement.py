"""Slow-timescale decisions from routing history: expert placement across nodes and EPLB-style replicas.

Legend: W GPUs, G GPUs per node, E experts. ``load_E`` is a history of per-expert rows (e.g. an EMA), int64 [E].
All functions are deterministic: ties break on (load, the expert's owner or home, node or GPU id, expert id), all
in integers (``place_experts``'s ``min_gain`` compares two integer loads in floating point, identically on every
rank).
"""

from __future__ import annotations

import math
import numbers

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


def place_experts(load_E: np.ndarray, topo: Topology, owner_E: np.ndarray | None = None, *,
                  min_gain: float = 0.0) -> np.ndarray:
    """A placement that balances the history's load between nodes, then between the GPUs of each node.

    Longest-processing-time first (LPT): experts in order of decreasing load go to the least loaded node with a
    free slot, then each node's experts to its least loaded GPU with a free slot. Every GPU keeps E // W experts,
    so memory per GPU is unchanged. An expert placed away from its owner (the GPU holding its parameters and
    optimizer state, ``owner_E``, default plain EP's ``e // (E // W)``) is computed from a copy of its weights,
    re-sent after every optimizer step, so the placement keeps as many experts with their owner as its balance
    allows: LPT's ties go to the owner's node and GPU; nodes (and a node's GPUs), being interchangeable, are matched
    to the LPT groups holding most of their own experts (as ``eplb_layout`` does); and the owners' own assignment
    is kept, at the node level and inside each node that holds exactly its own experts, unless the new one lowers
    the most loaded node (GPU) by more than ``min_gain`` of its load (a float in [0, 1); 0: any gain).

    load_E: int [E] load history. owner_E: int [E], E // W experts per GPU. Returns home_E: int64 [E], the GPU
    where every expert is computed.
    """
    load = _check_load(load_E, topo)
    G, epr, E = topo.gpus_per_node, topo.experts_per_rank, topo.num_experts
    owner = topo.default_home_E().tolist() if owner_E is None else _check_home(owner_E, topo, "owner_E").tolist()
    keep = 1.0 - check_min_gain(min_gain, "min_gain")
    owner_node = [g // G for g in owner]
    nodes = list(range(topo.num_nodes))
    node = _settle(_lpt(range(E), load, nodes, G * epr, owner_node), owner_node, load, nodes, keep, True)
    home = [0] * E
    for n in nodes:
        mine = [e for e in range(E) if node[e] == n]
        gpus = list(range(n * G, n * G + G))
        own = all(n * G <= owner[e] < n * G + G for e in mine)   # the node holds exactly its own experts
        for e, g in _settle(_lpt(mine, load, gpus, epr, owner), owner, load, gpus, keep, own).items():
            home[e] = g
    return np.asarray(home, dtype=np.int64)


def check_min_gain(value: object, name: str) -> float:
    """``place_experts``' ``min_gain`` (a number in [0, 1)) as a float, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _check_home(home_E: object, topo: Topology, name: str) -> np.ndarray:
    """home_E checked (int [E], values in [0, W), E // W experts on every GPU) as an int64 array."""
    a = np.asarray(home_E)
    if a.shape != (topo.num_experts,) or a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array of shape [{topo.num_experts}], got {a.dtype} "
                         f"{list(a.shape)}")
    per_gpu = np.bincount(a.astype(np.int64), minlength=topo.num_ranks) if a.size and a.min() >= 0 else None
    if per_gpu is None or per_gpu.size != topo.num_ranks or per_gpu.min() != topo.experts_per_rank:
        raise ValueError(f"{name} must give each of the W={topo.num_ranks} GPUs exactly E // W = "
                         f"{topo.experts_per_rank} experts (GPU ids in [0, {topo.num_ranks})), got {a.tolist()}")
    return a.astype(np.int64, copy=False)


def _lpt(experts, load: list[int], bins: list[int], cap: int, prefer: list[int]) -> dict[int, int]:
    """LPT: ``experts`` in order of decreasing load (ties: lower id), each to the least loaded of ``bins`` with
    room left (``cap`` experts each); ties go to the expert's ``prefer`` bin, then to the lower bin. {expert: bin}."""
    b_load = dict.fromkeys(bins, 0)
    room = dict.fromkeys(bins, cap)
    out = {}
    for e in sorted(experts, key=lambda e: (-load[e], e)):
        best = -1
        for b in bins:
            if room[b] and (best < 0 or b_load[b] < b_load[best] or (b_load[b] == b_load[best] and b == prefer[e])):
                best = b
        out[e] = best
        b_load[best] += load[e]
        room[best] -= 1
    return out


def _settle(assign: dict[int, int], prefer: list[int], load: list[int], bins: list[int], keep: float,
            may_keep: bool) -> dict[int, int]:
    """``assign``'s groups matched to ``bins`` by most experts in their ``prefer`` bin (the balance is unchanged);
    or, when ``may_keep`` (the experts are exactly those ``prefer`` puts in ``bins``), ``prefer``'s own assignment
    unless the matched one brings the most loaded bin below ``keep`` times ``prefer``'s."""
    members = [[e for e, b in assign.items() if b == p] for p in bins]
    label = _relabel(members, prefer, bins)
    new = {e: label[i] for i, m in enumerate(members) for e in m}
    if may_keep:
        old = {e: prefer[e] for e in assign}
        if _max_load(new, load, bins) >= keep * _max_load(old, load, bins):
            return old
    return new


def _max_load(assign: dict[int, int], load: list[int], bins: list[int]) -> int:
    acc = dict.fromkeys(bins, 0)
    for e, b in assign.items():
        acc[b] += load[e]
    return max(acc.values())


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
    """Match interchangeable packs to targets (nodes or GPUs), one each, so that the most members stay in their
    ``home_of`` target (an optimal assignment). The balance is unchanged; fewer experts leave home."""
    # a pack may hold several replicas of one expert (EPLB): one weight copy each way, so experts count once
    keep = [[sum(home_of[e] == t for e in set(m)) for t in targets] for m in members]
    return [targets[j] for j in _assign_max(keep)]


def _assign_max(gain: list[list[int]]) -> list[int]:
    """The assignment of rows to columns of the square integer matrix ``gain`` with the largest total: column of
    each row. The Hungarian method with potentials (shortest augmenting paths, O(n^3)); deterministic."""
    n = len(gain)
    u, v, row_of, way = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    for i in range(1, n + 1):
        row_of[0], j0 = i, 0
        slack, used = [math.inf] * (n + 1), [False] * (n + 1)
        while row_of[j0]:
            used[j0] = True
            i0, delta, j1 = row_of[j0], math.inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = -gain[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < slack[j]:
                        slack[j], way[j] = cur, j0
                    if slack[j] < delta:
                        delta, j1 = slack[j], j
            for j in range(n + 1):
                if used[j]:
                    u[row_of[j]] += delta
                    v[j] -= delta
                else:
                    slack[j] -= delta
            j0 = j1
        while j0:
            j1 = way[j0]
            row_of[j0] = row_of[j1]
            j0 = j1
    col = [0] * n
    for j in range(1, n + 1):
        col[row_of[j] - 1] = j - 1
    return col


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
    # (numpy integers taken, as make_plan takes them; a bool is no count)
    if isinstance(slots_per_gpu, bool | np.bool_) or not isinstance(slots_per_gpu, numbers.Integral) or \
            slots_per_gpu < 0:
        raise ValueError(f"slots_per_gpu must be an int >= 0, got {slots_per_gpu!r}")
    E, W, G = topo.num_experts, topo.num_ranks, topo.gpus_per_node
    if isinstance(num_groups, bool | np.bool_) or not isinstance(num_groups, numbers.Integral) or num_groups < 1 or \
            E % num_groups:
        raise ValueError(f"num_groups must be a positive int dividing E={E}, got {num_groups!r}")
    slots_per_gpu, num_groups = int(slots_per_gpu), int(num_groups)
    # (checked as place_experts checks its owner_E: any values were taken, 99 or 0.7, and a short one failed later
    # with an IndexError)
    home = (topo.default_home_E() if home_E is None else _check_home(home_E, topo, "home_E")).tolist()
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
