"""Phase 2 of the in-node path: planning and copies beside the static GEMM, then the dynamic GEMM and the results'
return (steps 5, 7 and 8 of ``feplb.layer``).

``start_phase2`` (main thread, before the static GEMM is launched) hands the planner thread the counts and the copy
thread a job: wait for the plan, agree with the node (``feplb.balance``), lay the plan out
(``feplb.layout.phase2_layout``) and issue one ``feplb.dispatch.Exchange`` with the rows to helpers and the plan's
weight copies (``Plan.weight_copies``, executed as given). ``dynamic_and_return`` (main thread, after the static
GEMM) finishes that exchange inside autograd, computes the dynamic rows kept at home and the rows hosted for other
GPUs, sends the hosted results home (again through the copy thread) and gathers every result into receive order.

Legend: R rows at home on this rank after phase 1, H hidden, F ffn.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass

import numpy as np
import torch

from feplb.balance import PlanResult
from feplb.dispatch import Exchange
from feplb.experts import expert_mlp, handoff, span, to_device
from feplb.layout import Item, Phase2Layout, inverse, phase2_layout
from feplb.steps import Counts, Split

__all__ = ["Phase2", "dynamic_and_return", "hosted_gemm", "no_phase2", "start_phase2"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Phase2:
    """The plan as executed by the node, and its copies (issued by the copy thread, finished by the main one)."""

    result: PlanResult
    fell_back: bool
    moves: tuple
    layout: Phase2Layout | None
    exchange: Exchange | None          # rows to helpers, then the plan's weight copies (w1s, then w2s)
    spec: tuple                        # per send of this rank: ("rows", start, end) or ("w1" | "w2", expert)
    pending: concurrent.futures.Future | None
    copies: tuple                      # the plan's weight copies executed (expert, src, dst)
    bank_bytes: int = 0                # bytes the owners sent for this rank's slot weights (per-microbatch +place)


class _HostEvent:
    """The CPU stand-in for the static GEMM's end event (the CPU copy thread does not watch it)."""

    def record(self) -> None:
        pass


def no_phase2(wanted: bool) -> Phase2:
    return Phase2(result=PlanResult(plan=None, plan_us=0.0, ready=0, error=None), fell_back=False, moves=(),
                  layout=None, exchange=None, spec=(), pending=None, copies=())


def materialize(spec: tuple, h_RD: torch.Tensor, local, detach: bool = False) -> list[torch.Tensor]:
    """The tensors a send spec names: rows of h_RD ("rows", start, end) or an expert's weights ("w1"/"w2", e)."""
    out = []
    for s in spec:
        if s[0] == "rows":
            t = h_RD[s[1]:s[2]]
        else:
            w1, w2 = local(s[1])
            t = w1 if s[0] == "w1" else w2
        t = t.reshape(-1)
        out.append(t.detach() if detach else t)
    return out


def start_phase2(layer, h_RD: torch.Tensor, counts: Counts, split: Split, slot_w, tl):
    """Step 5: planning on the planner thread, agreement and copies on the copy thread. Returns (the copy job's
    future, the static GEMM's end event to record, the flag saying it is recorded)."""
    state = layer._plan_state
    plan_f = layer._balancer.submit_plan(lambda: layer._plan(counts.counts_WE, state, tl))
    on_gpu = h_RD.is_cuda
    end = torch.cuda.Event() if on_gpu else _HostEvent()
    launched = threading.Event()
    ready, consumer = handoff(h_RD)
    static_end = (lambda: launched.is_set() and end.query()) if on_gpu else None
    job = layer._balancer.copier.submit(_phase2_job, layer, h_RD.detach(), split, slot_w, plan_f, static_end,
                                        ready, consumer, tl)
    return job, end, launched


def _phase2_job(layer, h_RD, split: Split, slot_w, plan_f, static_end, ready, consumer, tl) -> Phase2:
    """On the copy thread: wait for the plan, agree with the node, lay out and issue the copies."""
    c = layer.config
    res = layer._balancer.wait_plan(plan_f, static_end)
    with span(tl, "agree", "copy"):
        agreed = layer.control.all_reduce_min(torch.tensor([res.ready, int(res.error is None)], dtype=torch.int64),
                                             layer._scope_group(), "readiness agreement")
    if int(agreed[1]) == 0:
        raise RuntimeError(f"MoELayer: the planner failed on a rank of the node ({res.error or 'on another rank'})"
                           "; every rank of the node stops this step")
    if int(agreed[0]) == 0:
        return Phase2(result=res, fell_back=True, moves=(), layout=None, exchange=None, spec=(), pending=None,
                      copies=())
    plan = res.plan
    moves = tuple(m for m in plan.moves if m.row_end > m.row_start)
    for m in moves:
        if m.src != int(layer.placement.home_E[m.expert]):
            raise RuntimeError(f"plan move {m} does not start at expert {m.expert}'s home GPU")
    lay = phase2_layout(split.home, moves, layer.placement.slot_pos, layer.rank)
    copies = tuple(plan.weight_copies)
    H, Fd, n = c.hidden, c.ffn, len(copies)
    items = [Item(m.src, m.dst, m.rows * H) for m in moves]
    items += [Item(s, d, H * 2 * Fd) for _, s, d in copies] + [Item(s, d, Fd * H) for _, s, d in copies]
    ex = Exchange(layer.comm, items, dtype=h_RD.dtype, device=h_RD.device, op="phase-2 rows and weights to helpers")
    spec = {}
    for j, a, b in lay.out:
        spec[j] = ("rows", a, b)
    for k, (e, s, _) in enumerate(copies):
        if s == layer.rank:
            spec[len(moves) + k], spec[len(moves) + n + k] = ("w1", e), ("w2", e)
    order = tuple(spec[k] for ks in ex.layout.send.values() for k in ks)
    pending = None
    if ex.active:
        with span(tl, "copy_rows", "copy", stream=getattr(layer.comm.copy, "stream", None)):
            got = ex._run(materialize(order, h_RD, lambda e: layer._local_weights(e, slot_w), detach=True),
                          ready, consumer)
        pending = concurrent.futures.Future()
        pending.set_result(got)
    return Phase2(result=res, fell_back=False, moves=moves, layout=lay, exchange=ex, spec=order, pending=pending,
                  copies=copies)


def dynamic_and_return(layer, h_RD, y_static, split: Split, p2: Phase2, slot_w, tl):
    """Steps 7-8: the dynamic GEMM (kept rows, then hosted rows) and the hosted results back home; returns the
    results in RECEIVE order (for the reverse all-to-all) and a tail to keep in the graph."""
    c = layer.config
    H = c.hidden
    if p2.layout is None:
        # no moves: the dynamic slots compute at home (the home order's tail), one more grouped launch
        dyn_L = split.home.n_L - split.home.static_L
        with span(tl, "dynamic_gemm"):
            y_dyn = expert_mlp(h_RD[split.home.n_static:], slot_w.w1, slot_w.w2,
                               to_device(np.cumsum(dyn_L), h_RD.device)) if dyn_L.any() else h_RD[:0]
        y_home = torch.cat([y_static, y_dyn])
        gather = inverse(split.home.perm)
        return y_home.index_select(0, to_device(gather, h_RD.device)), layer._anchor(h_RD)
    lay, ex, moves = p2.layout, p2.exchange, p2.moves
    tail1, got = ex(materialize(p2.spec, h_RD, lambda e: layer._local_weights(e, slot_w)), layer._anchor(h_RD),
                    pending=p2.pending) if ex.active else (layer._anchor(h_RD), {})
    with span(tl, "dynamic_gemm"):
        kept = h_RD.index_select(0, to_device(lay.kept_idx, h_RD.device))
        y_kept = expert_mlp(kept, slot_w.w1, slot_w.w2, to_device(np.cumsum(lay.kept_L), h_RD.device)) \
            if lay.kept_idx.size else h_RD[:0]
        y_hosted = hosted_gemm(layer, lay.hosted, moves, p2.copies, got, slot_w, h_RD)
    back = [Item(m.dst, m.src, m.rows * H) for m in moves]
    rex = Exchange(layer.comm, back, dtype=h_RD.dtype, device=h_RD.device, op="phase-2 results home")
    sends = {j: y_hosted[j] for j in lay.hosted}
    with span(tl, "copy_results", "copy"):
        ready, consumer = handoff(h_RD)
        pending = rex.start(rex.sends_of(sends), layer._balancer.copier, ready=ready, consumer=consumer) \
            if rex.active else None
        tail2, ret = rex(rex.sends_of(sends), layer._anchor(y_static), pending=pending)
    with span(tl, "assemble"):
        parts = [y_static, y_kept] + [ret[j].view(-1, H) for j, _, _ in lay.out]
        y_recv = torch.cat(parts).index_select(0, to_device(lay.gather, h_RD.device))
    return y_recv, torch.cat([tail1.reshape(-1), tail2.reshape(-1)])


def hosted_gemm(layer, hosted: list[int], moves: tuple, copies: tuple, got: dict, slot_w, h_RD,
                 ) -> dict[int, torch.Tensor]:
    """The rows this GPU computes for others: one grouped launch per weight bank (the per-step replicas, each
    source's weight copies received this micro-batch, this rank's own parameters). Returns {move: [rows, H]}."""
    if not hosted:
        return {}
    c = layer.config
    H, Fd = c.hidden, c.ffn
    n_mv, n_cp = len(moves), len(copies)
    copy_k = {(e, d): k for k, (e, _, d) in enumerate(copies)}
    banks: dict[object, tuple] = {}
    groups: dict[object, list[tuple[int, int]]] = {}
    for j in hosted:
        e = moves[j].expert
        k = copy_k.get((e, layer.rank))
        if k is not None:
            src = copies[k][1]
            key = ("copy", src)
            if key not in banks:
                ks = [kk for kk, (_, s, d) in enumerate(copies) if s == src and d == layer.rank]
                w1 = torch.cat([got[n_mv + kk] for kk in ks]).view(len(ks), H, 2 * Fd) if len(ks) > 1 \
                    else got[n_mv + ks[0]].view(1, H, 2 * Fd)
                w2 = torch.cat([got[n_mv + n_cp + kk] for kk in ks]).view(len(ks), Fd, H) if len(ks) > 1 \
                    else got[n_mv + n_cp + ks[0]].view(1, Fd, H)
                banks[key] = (w1, w2, {copies[kk][0]: i for i, kk in enumerate(ks)})
        elif e in layer.replicas.replica_of:
            key = "replica"
            banks[key] = (*layer.replicas.replica_bank, layer.replicas.replica_of)
        elif e // layer.num_local == layer.rank:
            key = "own"
            w1, w2 = layer.expert_weights()
            banks[key] = (w1, w2, {layer.rank * layer.num_local + i: i for i in range(layer.num_local)})
        else:
            raise RuntimeError(f"MoELayer: GPU {layer.rank} computes rows of expert {e} without its weights")
        groups.setdefault(key, []).append((banks[key][2][e], j))
    out: dict[int, torch.Tensor] = {}
    for key, members in groups.items():
        w1, w2, _ = banks[key]
        members.sort()
        rows = [got[j].view(-1, H) for _, j in members]
        sizes = np.zeros(w1.shape[0], dtype=np.int64)
        for (i, _), t in zip(members, rows, strict=True):
            sizes[i] += t.shape[0]
        y = expert_mlp(torch.cat(rows) if len(rows) > 1 else rows[0], w1, w2,
                       to_device(np.cumsum(sizes), h_RD.device))
        pos = 0
        for (_, j), t in zip(members, rows, strict=True):
            out[j] = y[pos:pos + t.shape[0]]
            pos += t.shape[0]
    return out
