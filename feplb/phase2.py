"""Phase 2 of the in-node path: planning and copies beside the static GEMM, then the dynamic GEMM and the results'
return (steps 5, 7 and 8 of ``feplb.layer``).

``start_phase2`` (main thread: on a CPU before the static GEMM computes, on a GPU once it is queued, so the planner
thread, which holds the GIL while it plans, never delays its launch) hands the planner thread the counts and the copy
thread a job: wait for the plan, check it and lay it out (``feplb.layout.phase2_layout``), agree with the node
(``feplb.balance``; the group, when the policy history reads whole plans: ``MoELayer._scope_group``), then issue one
``feplb.dispatch.Exchange`` with the rows to helpers and the plan's weight copies (``Plan.weight_copies``, executed
as given). On a GPU the copies are issued only once the static GEMM is launched, and their results are handed to a
hand-off stream, so nothing on the compute stream waits for them before it must.
``dynamic_and_return`` (main thread, after the static GEMM) finishes that exchange inside autograd, computes the rows
hosted for other GPUs first (their homes wait for them), sends those results home through the copy thread, computes
the dynamic rows kept at home meanwhile, and gathers every result into receive order; its backward runs in the
mirrored order (see there).

Legend: R rows at home on this rank after phase 1, H hidden, F ffn.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from feplb.balance import PlanResult
from feplb.dispatch import BackwardJoin, Exchange, Received
from feplb.experts import (
    EarlyBackward,
    expert_mlp,
    fresh_sequence_nr,
    ready_event,
    rebuilt_in_backward,
    span,
    to_device,
)
from feplb.layout import Item, Phase2Layout, inverse, phase2_layout, weight_items, weight_sends
from feplb.recompute import hidden_from_selective_checkpoint
from feplb.recopy import Recopy
from feplb.steps import Counts, Split, plan_digest

__all__ = ["Phase2", "Phase2Job", "dynamic_and_return", "hosted_gemm", "no_phase2", "start_phase2"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Phase2:
    """The plan as executed by the node, and its copies (issued by the copy thread, finished by the main one)."""

    result: PlanResult
    fell_back: bool
    moves: tuple
    layout: Phase2Layout | None
    exchange: Exchange | None          # rows to helpers, then the plan's weight copies (every w1, every w2, ...)
    spec: tuple                        # per send of this rank: ("rows", start, end) or ("w", part, expert)
    pending: concurrent.futures.Future | None
    copies: tuple                      # the plan's weight copies executed (expert, src, dst)
    bank_bytes: int = 0                # bytes the owners sent for this rank's slot weights (per-microbatch +place)
    wexchange: Exchange | None = None  # recopy_weights: the weight copies in an exchange of their own (then
    wspec: tuple = ()                  # ``exchange`` carries rows only), this rank's sends in it,
    wpending: concurrent.futures.Future | None = None   # and its copies
    recopy: Recopy | None = None       # recopy_weights: that exchange, run again in the backward


@dataclass(frozen=True, kw_only=True, eq=False)
class Phase2Job:
    """The copy thread's job for one micro-batch, and the main thread's signals to it."""

    future: concurrent.futures.Future   # -> Phase2
    static_end: object                  # a CUDA event recorded after the static GEMM (GPU; None on a CPU)
    launched: threading.Event           # set once the static GEMM is launched (and static_end recorded)

    def static_launched(self) -> None:
        if self.static_end is not None:
            self.static_end.record()
        self.launched.set()

    def result(self) -> Phase2:
        return self.future.result()


def no_phase2() -> Phase2:
    return Phase2(result=PlanResult(plan=None, plan_us=0.0, ready=0, error=None), fell_back=False, moves=(),
                  layout=None, exchange=None, spec=(), pending=None, copies=())


def materialize(spec: tuple, h_RD: torch.Tensor, local) -> list[torch.Tensor]:
    """The tensors a send spec names: rows of h_RD ("rows", start, end) or a part of an expert's weights ("w", j, e):
    ``local(e)[j]``.

    Views, as they are (a weight may be strided, e.g. a transposed transformers parameter): no kernel runs here.
    The exchange flattens them when it issues the copies, on its own stream in order after the sends' ``ready``
    event; gradients come back in each tensor's shape."""
    out = []
    for s in spec:
        out.append(h_RD[s[1]:s[2]] if s[0] == "rows" else local(s[2])[s[1]])
    return out


def start_phase2(layer, h_RD: torch.Tensor, counts: Counts, split: Split, slot_w, tl, ready,
                 replay_plan=None) -> Phase2Job:
    """Step 5: planning on the planner thread; checks, agreement and copies on the copy thread.

    ready: ``feplb.experts.ready_event(h_RD)`` recorded once h_RD is gathered, before the static GEMM is queued (the
    copies wait for it, not for the static GEMM); None on a CPU.
    replay_plan: a recompute (``feplb.recompute``) executes this plan, the one its forward executed on every rank:
    no planning and no agreement."""
    state = layer._plan_state
    plan_f = None if replay_plan is not None else \
        layer._balancer.submit_plan(lambda: layer._plan(counts.counts_WE, state, tl))
    on_gpu = h_RD.is_cuda
    end = torch.cuda.Event() if on_gpu else None
    launched = threading.Event()
    static_end = (lambda: launched.is_set() and end.query()) if on_gpu else None
    # (the copy thread reads detached aliases only: see MoELayer._send_weights)
    future = layer._balancer.copier.submit(_phase2_job, layer, h_RD.detach(), counts, split,
                                           layer._send_weights(slot_w), state, plan_f, static_end, launched, ready,
                                           tl, replay_plan)
    return Phase2Job(future=future, static_end=end, launched=launched)


def _lay_out(layer, plan, counts: Counts, split: Split, state, dtype, device):
    """The plan's moves, this rank's phase-2 layout, the exchange (rows to helpers, then the weight copies: every
    w1, then every w2, ...) and this rank's send spec; raises ValueError if the plan is not executable here."""
    c = layer.config
    plan.validate(counts.counts_WE, layer.topo, state)
    moves = tuple(m for m in plan.moves if m.row_end > m.row_start)
    lay = phase2_layout(split.home, moves, layer.placement.slot_pos, layer.rank)
    copies = tuple(plan.weight_copies)
    hold = layer._holds(state)
    if hold:
        # lazy replicas: a recompute repeats a plan whose copies its forward made and the layer still holds
        copies = tuple(cp for cp in copies if (cp[0], cp[2]) not in layer.replicas.lazy_pairs)
    for e, _, d in copies:
        if d == layer.rank and not any(m.expert == e and m.dst == d for m in moves):
            raise ValueError(f"plan copies expert {e}'s weights to GPU {d}, which computes none of its rows")
    for j in lay.hosted:
        e = moves[j].expert
        if not (any(cp[0] == e and cp[2] == layer.rank for cp in copies) or e in layer.replicas.replica_of
                or e in layer.replicas.held or e // layer.num_local == layer.rank):
            raise ValueError(f"GPU {layer.rank} would compute rows of expert {e} without its weights")
    sizes = layer.part_sizes
    rows = [Item(m.src, m.dst, m.rows * c.hidden) for m in moves]
    spec = {j: ("rows", a, b) for j, a, b in lay.out}
    wex, worder = None, ()
    # (the copies are the same on every rank of the node). With lazy replicas the weights travel in an exchange of
    # their own too, without autograd: a helper holds them as leaves whose gradients go home at the step's end
    if (c.recopy_weights or hold) and copies:
        ex = Exchange(layer.comm, rows, dtype=dtype, device=device, op="phase-2 rows to helpers")
        wex = Exchange(layer.comm, weight_items(copies, sizes), dtype=dtype, device=device,
                       op="phase-2 weights to helpers")
        wspec = weight_sends(copies, layer.rank, 0, len(sizes))
        worder = tuple(wspec[k] for ks in wex.layout.send.values() for k in ks)
    else:
        ex = Exchange(layer.comm, rows + weight_items(copies, sizes), dtype=dtype, device=device,
                      op="phase-2 rows and weights to helpers")
        spec.update(weight_sends(copies, layer.rank, len(moves), len(sizes)))
    order = tuple(spec[k] for ks in ex.layout.send.values() for k in ks)
    return moves, lay, copies, ex, order, wex, worder


def _phase2_job(layer, h_RD, counts: Counts, split: Split, local, state, plan_f, static_end, launched, ready,
                tl, replay_plan=None) -> Phase2:
    """On the copy thread: wait for the plan, check and lay it out, agree with the scope, issue the copies. A plan
    that is late, or that fails (the planner raised, or the plan is not executable here) on any rank of the scope,
    makes the whole scope compute at home: results never depend on it, so a failure is a warning, not a desync.
    A replay (a recompute) lays out the plan its forward executed everywhere, with no agreement. h_RD and ``local``
    (``MoELayer._send_weights``) are detached: this thread touches no autograd metadata the forward's uses."""
    if replay_plan is not None:   # the recorded plan: no wait, no deadline
        res = PlanResult(plan=replay_plan, plan_us=0.0, ready=1, error=None)
        laid = _lay_out(layer, res.plan, counts, split, state, h_RD.dtype, h_RD.device)
        return _issue(layer, h_RD, local, res, laid, launched, ready, tl)
    res = layer._balancer.wait_plan(plan_f, static_end)
    laid, error = None, res.error
    if res.plan is not None:
        try:
            laid = _lay_out(layer, res.plan, counts, split, state, h_RD.dtype, h_RD.device)
        except Exception as exc:  # noqa: BLE001 - agreed below, then a fallback on every rank of the scope
            error = f"{type(exc).__name__}: {exc}"
    # the plan's digest, and its negation: their minima over the scope are equal only where every rank laid out the
    # same plan (made from the same counts and history, it is; a rank that planned otherwise, a bug or another
    # version of the planner, would exchange rows the others do not expect)
    digest = plan_digest(res.plan) if laid is not None else 0
    with span(tl, "agree", "copy"):
        # readiness, success, and the lowest EP rank whose plan failed (the minimum of each)
        agreed = layer.control.all_reduce_min(
            torch.tensor([int(laid is not None), int(error is None), layer.rank if error is not None else 1 << 62,
                          digest, -digest], dtype=torch.int64), layer._scope_group(state), "readiness agreement")
    if int(agreed[1]) == 0:
        import warnings

        warnings.warn(f"MoELayer: the plan failed on EP rank {int(agreed[2])} of the {layer._scope_group(state)} "
                      f"({error or 'that rank warns why'}); this micro-batch computes at home", RuntimeWarning,
                      stacklevel=1)
    elif int(agreed[0]) == 1 and int(agreed[3]) != -int(agreed[4]):
        import warnings

        warnings.warn(f"MoELayer: the ranks of the {layer._scope_group(state)} made different plans from the same "
                      "counts (a planner bug, or different feplb versions on the ranks); this micro-batch computes "
                      "at home", RuntimeWarning, stacklevel=1)
        agreed[0] = 0
    if int(agreed[0]) == 0:
        return Phase2(result=res, fell_back=True, moves=(), layout=None, exchange=None, spec=(), pending=None,
                      copies=())
    return _issue(layer, h_RD, local, res, laid, launched, ready, tl)


def _issue(layer, h_RD, local, res, laid, launched, ready, tl) -> Phase2:
    """Issue the copies of an agreed (or replayed) plan's layout ``laid`` (``_lay_out``)."""
    moves, lay, copies, ex, order, wex, worder = laid
    pending = wpending = None
    if ex.active:
        if h_RD.is_cuda:
            launched.wait()   # the static GEMM is queued before anything the copies hand to the compute stream
        with span(tl, "copy_rows", "copy", stream=getattr(layer.comm.copy, "stream", None)):
            pending = concurrent.futures.Future()
            pending.set_result(ex.issue(materialize(order, h_RD, local), ready, handoff=True))
            if wex is not None and wex.active:
                wpending = concurrent.futures.Future()
                wpending.set_result(wex.issue(materialize(worder, h_RD, local), ready, handoff=True))
    return Phase2(result=res, fell_back=False, moves=moves, layout=lay, exchange=ex, spec=order, pending=pending,
                  copies=copies, wexchange=wex, wspec=worder, wpending=wpending)


def dynamic_and_return(layer, h_RD, y_static, early: EarlyBackward, split: Split, p2: Phase2, slot_w, tl):
    """Steps 7-8: the rows hosted for others (their results go home at once, through the copy thread), the dynamic
    rows kept at home meanwhile, then every result in RECEIVE order (for the reverse all-to-all), a tail to keep in
    the graph, and the weights' ``Recopy`` (with ``recopy_weights`` where weights were copied, else None).

    early: the static experts' GEMM (``MoELayer._static_gemm``), promoted here, after the dynamic work and before
    the results-home exchange is made. The backward then mirrors the forward, in this order: the results-home
    exchange's backward, started on the copy thread (``feplb.dispatch.BackwardJoin``); the static experts'
    backward, beside it; the hosted rows' once their gradients are in; the phase-2 exchanges' backward, which
    return the gradients of the rows (and weights) to their homes, started on the copy thread too; the kept rows'
    backward, beside them; then each phase-2 exchange's join (through its anchor, on every rank) waits for it,
    before phase 1's backward. So every copy runs beside this GPU's own GEMMs, a helper sends its homes' gradients
    as soon as it has them, and a home waits for its helpers only after its own work. Over copy paths that may not
    run beside other collectives (NCCL, NVSHMEM) or across nodes, the exchanges' backward run in place, and the
    hosted rows' after the kept rows' (their exchange waits for every rank of the node: started before the kept
    rows, it would make a helper wait for its homes' own work)."""
    c = layer.config
    H = c.hidden
    dev = h_RD.device
    if p2.layout is None:
        # no moves: the dynamic slots compute at home (the home order's tail), one more grouped launch (none without
        # dynamic rows: an empty tensor then, not a slice of the rows, whose backward fills full-size zeros)
        dyn_L = split.home.n_L - split.home.static_L
        with span(tl, "dynamic_gemm"):
            y_dyn = expert_mlp(h_RD[split.home.n_static:], slot_w.gemm(), to_device(np.cumsum(dyn_L), dev),
                               *c.glu) if dyn_L.any() else h_RD.new_empty((0, H))
        y_home = torch.cat([y_static, y_dyn])
        return y_home.index_select(0, to_device(inverse(split.home.perm), dev)), layer._anchor(h_RD), None
    lay, ex, moves = p2.layout, p2.exchange, p2.moves
    local = layer._weights_of(slot_w)
    # The backward's joins (``BackwardJoin``): the results-home exchange's (``join``) and the phase-2 exchanges'
    # (``joins[1:]``, through their anchors: finished on every rank, after the kept rows' backward) start on the
    # copy thread where the copy path allows it; else they run in place, the phase-2 exchanges' after the
    # results-home one has ended (``settle``)
    copier = layer._balancer.copier
    join = BackwardJoin(copier)
    joins = [join]
    layer._backward_join = joins

    nodes = []   # the phase-2 exchanges' autograd nodes, in the order made

    def exchange(x: Exchange, sends: list[torch.Tensor], pending) -> Received:
        joins.append(BackwardJoin(copier))
        anchor, sends = joins[-1].wrap_anchored(x, layer._anchor(h_RD), sends, after=join)
        got = x(sends, anchor, pending=pending, join=joins[-1], settle=join)
        nodes.append(got.tail.grad_fn)
        return got

    rcv = exchange(ex, materialize(p2.spec, h_RD, local), p2.pending)
    rcv_w, w_base, recopy, copies = rcv, len(moves), None, p2.copies
    if p2.wexchange is not None and c.recopy_weights:
        wsends = materialize(p2.wspec, h_RD, local)
        rcv_w, w_base = exchange(p2.wexchange, wsends, p2.wpending), 0
        recopy = Recopy.of(p2.wexchange, p2.wspec, wsends, layer.control, layer.rank)
    elif p2.wexchange is not None:
        # lazy replicas: the copies are held from here to the step's end (the hosted GEMMs find them there)
        hold_copies(layer, p2, h_RD, local)
        copies = ()
    # the hosted rows' nodes (from their GEMMs to the results-home join's), promoted below
    hosted_first = EarlyBackward()
    with span(tl, "dynamic_gemm"):
        y_hosted = hosted_gemm(layer, lay.hosted, moves, copies, lambda js: rcv.joined(js).view(-1, H), rcv_w,
                               w_base, dev, recopy=recopy)
    # (1-D already: a reshape would add a node made here, which the phase-2 exchanges' backward would wait for)
    tails = [rcv.tail] if rcv_w is rcv else [rcv.tail, rcv_w.tail]
    del rcv_w   # (with recopy_weights, what holds the received weights from here to the backward is a bug)
    back = [Item(m.dst, m.src, m.rows * H) for m in moves]
    rex = Exchange(layer.comm, back, dtype=h_RD.dtype, device=dev, op="phase-2 results home")
    if recopy is not None and not rex.active:
        raise RuntimeError(f"MoELayer: GPU {layer.rank} exchanges weights for phase 2 but no results")
    sends = rex.sends_of({j: y_hosted[j] for j in lay.hosted})
    # the backward's join, right after the GEMMs that made the sends: they alone wait for the gradients' copies
    sends = join.wrap(rex, sends)
    hosted_first.capture(*sends)
    ready = ready_event(h_RD)
    # (detached here: the copy thread touches no autograd metadata this thread uses)
    # (its span on the copy lane is the copy thread's, beside the kept rows' GEMM below; what this thread then waits
    # for it is wait_results)
    timed = None if tl is None else functools.partial(
        tl.span, "copy_results", "copy", stream=getattr(layer.comm.copy, "stream", None))
    pending = rex.start([t.detach() for t in sends], layer._balancer.copier, ready=ready, timed=timed) \
        if rex.active else None
    try:
        with span(tl, "dynamic_gemm"):
            # (no rows kept: an empty tensor made of nothing, not a slice of the rows, whose backward would
            # allocate a full-size zero gradient of them and add it to theirs)
            y_kept = expert_mlp(h_RD.index_select(0, to_device(lay.kept_idx, dev)), slot_w.gemm(),
                                to_device(np.cumsum(lay.kept_L), dev), *c.glu) \
                if lay.kept_idx.size else h_RD.new_empty((0, H))
    except BaseException:
        if pending is not None:   # the copy thread's results-home exchange ends before the error leaves
            concurrent.futures.wait([pending])
        raise
    with span(tl, "wait_results"):
        # the backward's order (dynamic_and_return's docstring): where the phase-2 exchanges' backward starts on
        # the copy thread, they and the hosted rows' nodes run before the kept rows' (the exchange made last, the
        # weights' under recopy_weights, first: the higher number), and the static experts' before all of them
        if len(joins) > 1 and all(j.armed for j in joins[1:]):
            for node in nodes:
                node._set_sequence_nr(fresh_sequence_nr())
            hosted_first.promote()
        # (with recopy_weights, the weights go to the helpers again when the layer's output gradient arrives
        # (MoELayer._experts), else first in this exchange's backward: every rank of the node runs it, and before
        # any hosted GEMM's backward, as it carries their outputs)
        early.promote()
        ret = rex(sends, layer._anchor(y_static), pending=pending, on_backward=None if recopy is None else recopy.start,
                  join=join)
    with span(tl, "assemble"):
        parts = [y_static, y_kept] + [ret.items[j].view(-1, H) for j, _, _ in lay.out]
        y_recv = torch.cat(parts).index_select(0, to_device(lay.gather, dev))
    return y_recv, torch.cat([*tails, ret.tail.reshape(-1)]), recopy


@hidden_from_selective_checkpoint
def hold_copies(layer, p2: Phase2, h_RD: torch.Tensor, local) -> None:
    """Lazy replicas (``MoELayer._holds``): the plan's weight copies, received in an exchange of their own without
    autograd, become this rank's held copies (``Replicas.hold``, one bank per source) until the next refresh, and
    every rank notes the pairs the plan copied (the plans after this one find them resident). A copy to the
    expert's owner is not held (plans make none: the owner computes with its own parameters)."""
    wex, copies, L = p2.wexchange, p2.copies, layer.num_local
    layer.replicas.note_lazy((e, d) for e, _, d in copies if d != e // L)
    if not wex.active:
        return
    got = wex.handed(*p2.wpending.result()) if p2.wpending is not None else \
        wex.issue(materialize(p2.wspec, h_RD, local))[0]
    n = len(copies)
    # (outside inference_mode, where a forward may run: a join that must concatenate would make an inference
    # tensor, which could never be trained)
    with torch.inference_mode(False):
        rcv = wex.received(got, torch.empty(0, device=h_RD.device))   # (no tail: not in the graph)
        for src in sorted({s for _, s, d in copies if d == layer.rank}):
            ks = [k for k, (e, s, d) in enumerate(copies) if s == src and d == layer.rank and d != e // L]
            if ks:
                layer.replicas.hold([copies[k][0] for k in ks],
                                    tuple(rcv.joined([p * n + k for k in ks]).view(len(ks), *shape)
                                          for p, shape in enumerate(layer.part_shapes)))


def hosted_gemm(layer, hosted: list[int], moves: tuple, copies: tuple, rows, weights: Received | None, w_base: int,
                device, recopy: Recopy | None = None) -> dict[int, torch.Tensor]:
    """The rows this GPU computes for others: one grouped launch per weight bank (the per-step replicas, each
    source's weight copies received this micro-batch viewed in place, the lazy replicas this rank holds, this rank's
    own parameters).

    hosted: indices of the moves into this GPU; rows(js): their rows back to back ([N, H]); weights: the exchange
    that carried ``copies``, whose items ``w_base + j * len(copies) + k`` are copy k's part j (w1, w2, b1, b2).
    recopy: ``weights``' exchange, run again in the backward (``feplb.recopy``): the received weights' GEMMs save
    them as a recipe that reads what it receives then, and ``weights`` is not held after the forward.
    Returns {move index: [rows, H]}."""
    if not hosted:
        return {}
    shapes = layer.part_shapes
    n_cp = len(copies)
    copy_k = {(e, d): k for k, (e, _, d) in enumerate(copies)}
    banks: dict[object, tuple] = {}
    groups: dict[object, list[tuple[int, int]]] = {}
    held = layer.replicas.held
    for j in hosted:
        e = moves[j].expert
        k = copy_k.get((e, layer.rank))
        if e in held:
            b = held[e][0]
            key = ("held", b)
            if key not in banks:
                index = {x: i for x, (bb, i) in held.items() if bb == b}
                banks[key] = (layer.replicas.view(layer.replicas.held_banks[b]), index, len(index))
        elif k is not None:
            src = copies[k][1]
            key = ("copy", src)
            if key not in banks:
                ks = [kk for kk, (_, s, d) in enumerate(copies) if s == src and d == layer.rank]

                def parts_of(rcv: Received, ks=ks) -> tuple[torch.Tensor, ...]:
                    return tuple(rcv.joined([w_base + p * n_cp + kk for kk in ks]).view(len(ks), *shape)
                                 for p, shape in enumerate(shapes))

                banks[key] = (parts_of, {copies[kk][0]: i for i, kk in enumerate(ks)}, len(ks))
        elif e in layer.replicas.replica_of:
            key = "replica"
            layer.replicas.mark_used(e)
            bank = layer.replicas.view(layer.replicas.replica_bank)
            banks[key] = (bank, layer.replicas.replica_of, bank[0].shape[0])
        elif e // layer.num_local == layer.rank:
            key = "own"
            banks[key] = (layer.expert_weights(),
                          {layer.rank * layer.num_local + i: i for i in range(layer.num_local)}, layer.num_local)
        else:
            raise RuntimeError(f"MoELayer: GPU {layer.rank} computes rows of expert {e} without its weights")
        groups.setdefault(key, []).append((banks[key][1][e], j))
    out: dict[int, torch.Tensor] = {}
    if recopy is not None:
        recopy.got = weights   # what the recipes read in this forward (let go of below)
    try:
        for key, members in groups.items():
            out.update(_bank_gemm(layer, key, banks[key], members, moves, rows, weights, recopy, device))
    finally:
        if recopy is not None:
            recopy.got = None
    return out


def _bank_gemm(layer, key, bank, members: list[tuple[int, int]], moves, rows, weights, recopy, device
               ) -> dict[int, torch.Tensor]:
    """One bank's grouped launch over its members (slot in the bank, move index): {move index: [rows, H]}."""
    parts, _, n_bank = bank
    members.sort()
    js = [j for _, j in members]
    x = rows(js)
    sizes = np.zeros(n_bank, dtype=np.int64)
    for i, j in members:
        sizes[i] += moves[j].rows
    offsets = to_device(np.cumsum(sizes), device)
    if callable(parts) and recopy is not None:   # received weights, received again for the backward
        with rebuilt_in_backward(lambda: parts(recopy.received()), (),
                                 f"expert weights GPU {layer.rank} received from GPU {key[1]}") as ws:
            y = expert_mlp(x, ws, offsets, *layer.config.glu)
    else:
        y = expert_mlp(x, parts(weights) if callable(parts) else parts, offsets, *layer.config.glu)
    out, pos = {}, 0
    for j in js:
        out[j] = y[pos:pos + moves[j].rows]
        pos += moves[j].rows
    return out
