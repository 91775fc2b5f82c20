"""The peers' policies' path (FasterMoE shadowing, EPLB replicas): plan before phase 1, then send every row straight
to the GPU that computes it (``feplb.layout.direct_layout``), with no phase 2 (``feplb.layer``'s ``_experts``)."""

from __future__ import annotations

import numpy as np
import torch

from feplb.balance import PlanResult
from feplb.dispatch import Exchange, all_to_all_rows
from feplb.experts import expert_mlp, span, to_device
from feplb.layout import direct_layout, direct_split_matrix, inverse, weight_items, weight_sends
from feplb.phase2 import Phase2, hosted_gemm, materialize
from feplb.recopy import Recopy
from feplb.steps import Counts
from feplb.timeline import Timeline

__all__ = ["forward_direct"]


def forward_direct(layer, x_MD: torch.Tensor, counts: Counts, tl: Timeline | None,
                   replay_plan=None) -> tuple[torch.Tensor, Phase2]:
    """Peers' policies (FasterMoE shadowing, EPLB replicas): plan first, then phase 1 sends every row straight
    to the GPU that computes it (a shadowed expert's rows stay on their source), no phase 2. A recompute
    (``feplb.recompute``) passes the plan its forward executed as ``replay_plan``."""
    r, H = layer.rank, layer.config.hidden
    dev = x_MD.device
    if replay_plan is not None:
        plan, plan_us = replay_plan, 0.0
    else:
        with span(tl, "plan", "compute"):
            plan, plan_us = layer._plan(counts.counts_WE, layer._plan_state, None)
        # Every rank made this plan from the same counts and state: one that is not executable (a planner's bug)
        # raises the same ValueError on every rank here, before any collective, instead of failing in the layouts on
        # some ranks while the others wait in phase 1. (A replayed plan was checked in its forward.)
        try:
            plan.validate(counts.counts_WE, layer.topo, layer._plan_state)
        except ValueError as e:
            raise ValueError(f"MoELayer: the {layer.config.policy!r} plan is not executable (every rank made the same "
                             f"plan and refuses it): {e}") from e
    moves = tuple(m for m in plan.moves if m.row_end > m.row_start)
    for m in moves:
        if m.src != int(layer.placement.home_E[m.expert]):
            raise RuntimeError(f"plan move {m} does not start at expert {m.expert}'s home GPU")
    lay = direct_layout(counts.counts_WE, layer.placement.slots_WS, moves, r)
    split_WW = torch.from_numpy(direct_split_matrix(counts.counts_WE, layer.placement.slots_WS, moves))
    recv_W = split_WW.sum(dim=0).numpy()
    send_idx = None if lay.send_idx is None else to_device(lay.send_idx, dev)
    x_send = x_MD if send_idx is None else x_MD.index_select(0, send_idx)
    with span(tl, "phase1"):
        recv = layer._phase1(x_send, counts, lay.send_splits, lay.recv_splits, split_WW, recv_W)
    slot_w = layer.replicas.forward_slot_weights(layer.placement, recv).for_gemms()
    h = recv.index_select(0, to_device(lay.perm, dev))
    copies = tuple(plan.weight_copies)
    sizes = layer.part_sizes
    ex = Exchange(layer.comm, weight_items(copies, sizes), dtype=h.dtype, device=dev, op="weights to helpers")
    spec = weight_sends(copies, r, 0, len(sizes))
    order = tuple(spec[k] for ks in ex.layout.send.values() for k in ks)
    with span(tl, "copy_weights", "copy"):
        wsends = materialize(order, h, layer._weights_of(slot_w))
        rcv = ex(wsends, layer._anchor(h))
    # (copied again in the backward: from the gradient of the layer's expert outputs, MoELayer._experts; else first
    # in the reverse all-to-all's backward, every rank's and before the hosted GEMMs')
    recopy = Recopy.of(ex, order, wsends, layer.control, r) if layer.config.recopy_weights else None
    n_home = int(lay.kept_L.sum())
    # the hosted rows follow the kept ones in plan order
    start, pos = {}, n_home
    for j in lay.hosted:
        start[j] = pos
        pos += moves[j].rows
    order_of = {j: i for i, j in enumerate(lay.hosted)}

    def rows(js: list[int]) -> torch.Tensor:
        if all(order_of[b] == order_of[a] + 1 for a, b in zip(js, js[1:], strict=False)):
            return h[start[js[0]]:start[js[-1]] + moves[js[-1]].rows]
        return torch.cat([h[start[j]:start[j] + moves[j].rows] for j in js])

    with span(tl, "dynamic_gemm"):
        parts = [expert_mlp(h[:n_home], slot_w.gemm(), to_device(np.cumsum(lay.kept_L), dev),
                            *layer.config.glu)]
        y_h = hosted_gemm(layer, lay.hosted, moves, copies, rows, rcv, 0, dev, recopy=recopy)
        parts += [y_h[j] for j in lay.hosted]
    parts += [rcv.tail.view(0, H), slot_w.tail.view(0, H), layer._anchor(h).view(0, H)]
    y = torch.cat(parts)
    with span(tl, "phase1_reverse"):
        y_back = all_to_all_rows(y.index_select(0, to_device(inverse(lay.perm), dev)), layer.transport,
                                 lay.recv_splits, lay.send_splits, split_matrix=split_WW.t().contiguous(),
                                 on_backward=None if recopy is None else recopy.start)
    if send_idx is not None:
        y_back = y_back.index_select(0, to_device(inverse(lay.send_idx), dev))
    res = PlanResult(plan=plan, plan_us=plan_us, ready=1, error=None)
    return y_back, Phase2(result=res, fell_back=False, moves=moves, layout=None, exchange=ex, spec=order,
                          pending=None, copies=copies, bank_bytes=slot_w.copied_bytes, recopy=recopy)
