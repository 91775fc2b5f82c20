"""Slow-timescale decisions from routing history: expert placement across nodes and EPLB-style replicas.

Legend: W GPUs, G GPUs per node, E experts. ``load_E`` is a history of per-expert rows (e.g. an EMA), int64 [E].
Both functions are deterministic: ties break on (load, node or GPU id, expert id), all in integers.
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


def eplb_replicas(load_E: np.ndarray, home_E: np.ndarray, topo: Topology, slots_per_gpu: int) -> tuple[
        tuple[int, int], ...]:
    """Redundant experts in the style of DeepSeek's EPLB, from a load history.

    ``W * slots_per_gpu`` extra replicas go one at a time to the expert with the highest load per replica; the
    replicas, heaviest per-replica load first, are packed onto the GPU with the least predicted load that has a
    free slot and holds no copy of that expert yet. Rows are later split evenly among an expert's copies.
    Returns sorted (expert, gpu) pairs of the extra replicas.
    """
    load = _check_load(load_E, topo)
    if slots_per_gpu < 0:
        raise ValueError(f"slots_per_gpu must be >= 0, got {slots_per_gpu}")
    W, E = topo.num_ranks, topo.num_experts
    home = [int(h) for h in home_E]
    n_rep = [1] * E
    for _ in range(min(W * slots_per_gpu, E * (W - 1))):
        best = -1
        for e in range(E):
            # load[e] / n_rep[e] > load[best] / n_rep[best], compared exactly in integers
            if n_rep[e] < W and (best < 0 or load[e] * n_rep[best] > load[best] * n_rep[e]):
                best = e
        if best < 0 or load[best] == 0:
            break
        n_rep[best] += 1
    gpu_load = [0] * W  # per-replica loads scaled by the common denominator of all replica counts
    scale = math.lcm(*set(n_rep))
    for e in range(E):
        gpu_load[home[e]] += load[e] * scale // n_rep[e]
    holders = [{home[e]} for e in range(E)]
    items = sorted(((load[e] * scale // n_rep[e], e) for e in range(E) for _ in range(n_rep[e] - 1)),
                   key=lambda t: (-t[0], t[1]))
    free = [slots_per_gpu] * W
    out = []
    for per, e in items:
        best_g = -1
        for g in range(W):
            if free[g] and g not in holders[e] and (best_g < 0 or gpu_load[g] < gpu_load[best_g]):
                best_g = g
        if best_g < 0:
            continue
        free[best_g] -= 1
        holders[e].add(best_g)
        gpu_load[best_g] += per
        out.append((e, best_g))
    return tuple(sorted(out))
