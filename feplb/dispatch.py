"""The layer's two data movements, both differentiable so that backward mirrors forward by construction.

* ``all_to_all_rows``: phase-1 rows to the experts' home ranks (backward: the reverse all-to-all).
* ``Exchange``: one batched exchange of tensors between arbitrary EP ranks, used for everything phase 2 moves
  (rows to helpers, expert weights, results home) and for weight replicas and their gradients. The ranks build
  the same list of ``feplb.layout.Item`` (src, dst, elements): every rank of a node, and every rank of the group
  whenever an item crosses nodes; each rank gives the tensors of the items it sends
  and gets back those it receives. The exchange derives its traffic (``feplb.layout.exchange_layout``): pairs
  inside a node go through the copy path with the node's split matrix known (no size agreement), pairs across
  nodes through the transport. It can be STARTED on a worker thread (``start``: the CPU stand-in for the copy
  stream, running beside the compute) and FINISHED on the autograd thread (``__call__(..., pending=)``), so the
  copies run beside the static GEMM and still enter the autograd graph.

Both are collective: every rank calls them in the same order. Their backward is collective too, so every rank must
reach it: each takes an ``anchor`` (an empty tensor that requires grad whenever autograd records, on every rank)
and returns a ``tail`` (an empty tensor) that the caller keeps in the graph.

Legend: M rows sent, R rows received, D row width, G GPUs per node.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from feplb.control import guard
from feplb.copy import CopyEngine
from feplb.layout import Item, exchange_layout
from feplb.transport import Transport

__all__ = ["BackwardJoin", "Exchange", "ForwardEntry", "PeerComm", "Received", "all_to_all_rows", "entered_through",
           "forget_joins", "settle_abandoned", "settle_joins"]


def compiled_autograd_problem(op: str, *, forward: bool = False) -> str | None:
    """Why the layer cannot run here under compiled autograd (``torch._dynamo.compiled_autograd``), or None: its
    backward orders its nodes by the autograd engine's sequence numbers (copies beside compute, see
    ``feplb.experts.EarlyBackward``) and runs collectives on its copy thread, neither of which a compiled backward
    graph keeps (it failed there, or reordered the collectives between ranks). forward: asked by a forward that
    records autograd (compiled autograd enabled, as torchtitan's train context does around forward and backward);
    else by a backward node (running inside a compiled backward)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")   # (never imported: never enabled)
    if ca is None or not (ca.compiled_autograd_enabled if forward else ca.in_compiled_autograd_region):
        return None
    return (f"feplb: {op}: the MoE layer's backward cannot run under compiled autograd "
            "(torch._dynamo.compiled_autograd, torchtitan's experimental.enable_compiled_autograd): it orders copies "
            "beside the compute by the autograd engine's node order and runs collectives on a copy thread, which a "
            "compiled backward graph does not keep. Run the backward without compiled autograd (torch.compile of "
            "the forward works).")


def refuse_compiled_autograd(op: str) -> None:
    """Raise ``compiled_autograd_problem(op)``: called first in every backward node of the layer that talks to other
    ranks (and in its other backward hooks that do), so every rank raises there before any collective of the
    backward."""
    problem = compiled_autograd_problem(op)
    if problem is not None:
        raise RuntimeError(problem)


# The layer forward whose exchanges are being recorded on this thread (``entered_through``), or None.
_ENTRY: contextvars.ContextVar[ForwardEntry | None] = contextvars.ContextVar("feplb_forward", default=None)


class ForwardEntry:
    """Where one layer forward's backward may start: the backward calls (autograd graph tasks) in which the gradient
    of its output arrived (:meth:`arrived`, a hook on that output). Its exchanges' backward nodes check it before any
    collective (:meth:`check`): a backward that starts inside the layer instead, as a zero-bubble pipeline schedule's
    weight pass does (``torch.distributed.pipelining``'s ``stage_backward_weight`` restarts autograd from the nodes
    that use the parameters), would reach those collectives on some ranks only, or need gradients of exchanges that
    never ran their backward. Every rank then raises there, naming it. ``layer``: the layer of the forward: a
    backward after its ``close()`` is refused there too, naming it (it failed in the copy thread's executor, or ran
    on a closed transport). The entry holds the layer's open flag (``_open``, a one-item list ``close()`` clears), not
    the layer: a layer closed and dropped (a `with` block in a function returning the loss) is told apart too."""

    __slots__ = ("tasks", "open", "name")

    def __init__(self, layer=None) -> None:
        self.tasks: set[int] = set()
        self.open = None if layer is None else layer.__dict__.setdefault("_open", [True])
        self.name = type(layer).__name__

    def arrived(self, grad: torch.Tensor) -> None:
        self.tasks.add(torch._C._current_graph_task_id())

    def check(self, op: str) -> None:
        if self.open is not None and not self.open[0]:
            raise RuntimeError(
                f"{self.name} backward ({op}): the layer was closed between this forward and its backward "
                "(close(), or the end of a `with layer:` block holding the forward): its threads and copy path are "
                "gone; run the backward before closing it")
        if torch._C._current_graph_task_id() not in self.tasks:
            raise RuntimeError(
                f"MoELayer backward ({op}): this backward started inside the layer, not at its output, as a "
                "zero-bubble pipeline schedule's weight pass does (torch.distributed.pipelining's "
                "stage_backward_weight): not supported, FEPLB's backward exchanges run from the layer's output; "
                "use a schedule with whole backwards (1F1B, interleaved 1F1B, GPipe)")


@contextlib.contextmanager
def entered_through(entry: ForwardEntry | None):
    """Within: the exchanges recorded on this thread belong to the forward ``entry`` (None: to none, unchecked)."""
    token = _ENTRY.set(entry)
    try:
        yield
    finally:
        _ENTRY.reset(token)


def _refuse_backward(ctx, op: str) -> None:
    """Before an exchange's backward (``op``: names the node): refuse a compiled backward, and one that started
    inside the layer (``ctx.entry``: :class:`ForwardEntry`); then end what an earlier backward that raised left on
    the copy threads (:func:`settle_abandoned`), before this backward's collectives meet it on the same groups."""
    refuse_compiled_autograd(op)
    if ctx.entry is not None:
        ctx.entry.check(op)
    settle_abandoned()


def _run_once(ctx, op: str) -> None:
    """Run ``ctx.on_backward`` (if any) and let go of it: autograd keeps ``ctx`` as long as the graph, and what the
    callable holds (weights received again) must not outlive this backward. A second backward through the same
    graph (``retain_graph``) runs it no more, on every rank alike. First :func:`_refuse_backward`."""
    _refuse_backward(ctx, op)
    fn, ctx.on_backward = ctx.on_backward, None
    if fn is not None:
        fn()


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, transport: Transport, send_splits: tuple, recv_splits: tuple, out,
                split_matrix, anchor, on_backward):
        ctx.transport, ctx.send_splits, ctx.recv_splits = transport, send_splits, recv_splits
        ctx.on_backward, ctx.entry = on_backward, _ENTRY.get()
        ctx.split_matrix = split_matrix
        ctx.anchor_shape = None if anchor is None else anchor.shape
        return transport.all_to_all(x_MD, send_splits, recv_splits, out=out, split_matrix=split_matrix)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        _run_once(ctx, "phase-1 all-to-all of rows, backward")
        m = ctx.split_matrix
        grad_MD = ctx.transport.all_to_all(grad_RD.contiguous(), ctx.recv_splits, ctx.send_splits,
                                           split_matrix=None if m is None else m.t().contiguous())
        grad_anchor = None if ctx.anchor_shape is None else grad_RD.new_zeros(ctx.anchor_shape)
        return grad_MD, None, None, None, None, None, grad_anchor, None


def all_to_all_rows(x_MD: torch.Tensor, transport: Transport, send_splits: Sequence[int],
                    recv_splits: Sequence[int], out: torch.Tensor | None = None,
                    split_matrix: torch.Tensor | None = None, anchor: torch.Tensor | None = None,
                    on_backward=None) -> torch.Tensor:
    """Differentiable all-to-all of rows.

    Args:
        x_MD: [M, D] rows grouped by destination rank; send_splits: W row counts (sum M).
        recv_splits: W row counts expected from each rank.
        out: optional preallocated receive buffer [>= R, D]; the result is a view of its first R rows (valid until
            the buffer's next use, so callers copy it out, e.g. by an index_select).
        split_matrix: optional int64 CPU [W, W] rows rank s sends rank d, identical on every rank (see
            ``Transport.all_to_all``); backward uses its transpose.
        anchor: an optional empty tensor that requires grad whenever autograd records on ANY rank: the backward
            all-to-all (a collective) then runs on every rank even where ``x_MD`` itself needs no gradient.
        on_backward: optional callable run first in the (first) backward, on every rank that calls this, in the same
            order as the backward all-to-all (``feplb.recopy.Recopy.start``).
    Returns:
        recv_RD: [R, D], rank s's rows in block s.
    """
    return _AllToAllRows.apply(x_MD, transport, tuple(int(s) for s in send_splits),
                               tuple(int(s) for s in recv_splits), out, split_matrix, anchor, on_backward)


@dataclass
class PeerComm:
    """Routes blocks between ranks of the EP group: node peers through ``copy``, other ranks through
    ``transport`` (an all-to-all over the whole group, only when some pair anywhere crosses nodes)."""

    transport: Transport
    copy: CopyEngine
    gpus_per_node: int
    _streams: dict = field(default_factory=dict, repr=False)   # (role, device) -> stream, created on first use

    def _stream(self, role: str, device: torch.device):
        if (role, device) not in self._streams:
            self._streams[(role, device)] = torch.cuda.Stream(device)
        return self._streams[(role, device)]

    def handoff_stream(self, device: torch.device):
        """The stream a worker thread hands received tensors to (one per device)."""
        return self._stream("handoff", device)

    def worker_stream(self, device: torch.device):
        """The stream a worker thread issues an exchange's own kernels on (flattening strided sends, the
        cross-node part's concatenation and transport): ordered after the ``ready`` event only, so it neither
        queues behind the compute stream's static GEMM (a new thread's current stream is the default stream) nor
        runs before the sends exist (one per device)."""
        return self._stream("worker", device)

    @property
    def rank(self) -> int:
        return self.transport.rank

    def run(self, send: dict[int, list[torch.Tensor]], recv_numel: dict[int, int], *, cross_node: bool,
            dtype: torch.dtype, device: torch.device, op: str, intra_node: bool = True, node_matrix=None,
            ready=None, consumer=None) -> dict[int, torch.Tensor]:
        """Send the pieces ``send[dst]`` (1-D, back to back) to each EP rank dst; return {src: 1-D buffer of
        recv_numel[src] elements}, buffers this rank owns.

        node_matrix: G x G elements node rank i of this rank's node sends node rank j (see the copy path).
        ready / consumer (CUDA): the event the pieces depend on and the stream that reads the result (default: the
        calling thread's current stream), for the copy path. The cross-node part runs on the calling thread's
        current stream and honours neither: a worker thread issues through ``Exchange.issue(handoff=True)``,
        which runs this on a stream ordered after ``ready`` and joins that stream into the hand-off."""
        g = self.gpus_per_node
        me = self.rank
        base = me // g * g
        out: dict[int, torch.Tensor] = {}
        local_send = {p - base: t for p, t in send.items() if p // g == me // g}
        local_recv = {q - base: n for q, n in recv_numel.items() if q // g == me // g}
        if intra_node and g > 1:
            got = self.copy.exchange(local_send, local_recv, dtype=dtype, device=device, op=op, matrix=node_matrix,
                                     ready=ready, consumer=consumer)
            out.update({q + base: t for q, t in got.items()})
        elif local_send or local_recv:
            raise ValueError(f"{op}: intra-node traffic without a copy path call")
        remote_send = {p: ts for p, ts in send.items() if p // g != me // g}
        remote_recv = {q: n for q, n in recv_numel.items() if q // g != me // g}
        if cross_node:
            if intra_node and g > 1 and self.copy.name == "nccl" and device.type == "cuda" and \
                    self.transport.name == "torch" and "nccl" in str(dist.get_backend(self.transport.group)):
                # Two NCCL communicators (the node's on the copy stream, the group's here) in flight at once may
                # deadlock (NCCL asks for one order everywhere): the group's all-to-all starts after the node's.
                node_done = torch.cuda.Event()
                node_done.record(self.copy.stream)
                torch.cuda.current_stream(device).wait_event(node_done)
            w = self.transport.world_size
            send_splits = [sum(t.numel() for t in remote_send.get(p, ())) for p in range(w)]
            recv_splits = [int(remote_recv.get(q, 0)) for q in range(w)]
            parts = [t.reshape(-1).to(dtype) for p in range(w) for t in remote_send.get(p, ())]
            flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
            with guard(f"{op} (cross-node part)", self.transport.group):
                got_flat = self.transport.all_to_all(flat, send_splits, recv_splits)
            start = 0
            for q in range(w):
                if q in remote_recv:
                    out[q] = got_flat[start:start + recv_splits[q]]
                start += recv_splits[q]
        elif remote_send or remote_recv:
            raise ValueError(f"{op}: cross-node traffic but no pair crosses nodes")
        return out


class _ExchangeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: Exchange, pending, on_backward, join, settle, anchor: torch.Tensor, *sends: torch.Tensor):
        ctx.ex, ctx.on_backward, ctx.join, ctx.settle = ex, on_backward, join, settle
        ctx.entry = _ENTRY.get()
        ctx.send_shapes = [t.shape for t in sends]
        ctx.anchor_shape = anchor.shape
        got = ex.handed(*pending.result()) if pending is not None else ex.issue(list(sends))[0]
        return (anchor.new_empty(0),) + tuple(got[q] for q in ex.layout.recv)

    @staticmethod
    def backward(ctx, _tail, *grads):
        # What i sent j, j now sends i: each source gets the gradient of its whole block back in one piece.
        ex = ctx.ex
        _run_once(ctx, f"{ex.op}, backward")
        grad_anchor = torch.zeros(ctx.anchor_shape, dtype=ex.dtype, device=ex.device)
        join = ctx.join
        if join is not None and join.armed:
            # started on the copy thread (after what it runs already: one exchange at a time, in order); the
            # gradients reach the sends where ``join`` finishes it (BackwardJoin)
            join.start(ex, list(grads), ctx.send_shapes)
            zero = torch.zeros((), dtype=ex.dtype, device=ex.device)
            return (None, None, None, None, None, grad_anchor, *(zero.expand(s) for s in ctx.send_shapes))
        if ctx.settle is not None:   # a later exchange's backward, started on the copy thread, ends first
            ctx.settle.settle()
        got, _ = ex.issue_backward(list(grads))
        return (None, None, None, None, None, grad_anchor, *ex.send_grads(got, ctx.send_shapes))


class _JoinFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, join: BackwardJoin, anchored: bool, *sends: torch.Tensor):
        ctx.join, ctx.anchored, ctx.entry = join, anchored, _ENTRY.get()
        return tuple(t.view_as(t) for t in sends)

    @staticmethod
    def backward(ctx, *started):
        # the anchor's gradient (of an empty tensor) passes through; the sends' are the exchange's
        _refuse_backward(ctx, "copy path, backward")
        return (None, None, *started[:int(ctx.anchored)], *ctx.join.finish())


# The joins whose exchange's backward was started on a copy thread and not taken yet, with the autograd graph task
# that started them (BackwardJoin.start; in start order). A backward that succeeds settles its own in its callback;
# one that raises leaves them (autograd runs queue_callback's callbacks only when the backward succeeds), still
# running collectives on their copy threads: settle_abandoned ends them before the next collective of a forward, a
# backward or a step call, which would otherwise meet them on the same gloo groups in a different order on
# different ranks.
_STARTED: dict[int, tuple[BackwardJoin, int]] = {}
_STARTED_LOCK = threading.Lock()


def settle_abandoned() -> None:
    """End every exchange's backward that a backward other than the running one (any, outside a backward) started
    on a copy thread and never took: a backward that raised left it in flight. Called, on the calling thread,
    before a layer's construction, forward, backward or a step call runs its first collective
    (``MoELayer.__init__``, ``MoELayer._experts``, the backward nodes and hooks of the layer that talk to other
    ranks: ``_refuse_backward``, ``feplb.recopy.Recopy.start_at``; ``feplb.training.handshaken``) and by a
    layer's close (``settle_joins``): every rank's copy threads then finish what they started, in the same order,
    before the next collective over the same groups. Nothing to wait for where no backward raised (the running
    backward's own joins are left alone): a look at a dict. Raises the first of their errors, after settling
    all."""
    task = torch._C._current_graph_task_id()
    with _STARTED_LOCK:
        stale = [join for join, started in _STARTED.values() if started != task]
    _settle_all(stale)


def settle_joins(copier: concurrent.futures.Executor) -> None:
    """End every exchange's backward started on ``copier`` and not taken (a backward that raised left it in flight):
    its layer is closing it. Waited for, never cancelled: the copy thread of a peer may have started it already
    (the peers' copy threads run it whatever their main threads do next), and one cancelled here while a peer's ran
    left that peer's collective to meet this rank's next one on the same group (the next layer's construction:
    both waited out the group's timeout, or paired a barrier with an all-gather). Raises the first of their errors,
    after settling all."""
    with _STARTED_LOCK:
        mine = [join for join, _ in _STARTED.values() if join.copier is copier]
    _settle_all(mine)


def _settle_all(joins: list[BackwardJoin]) -> None:
    errors = []
    for join in joins:
        try:
            join.settle()
        except BaseException as exc:  # noqa: BLE001 - every one settled; the first error raised after
            errors.append(exc)
    if errors:
        raise errors[0]


def forget_joins(copier: concurrent.futures.Executor) -> None:
    """Drop the joins started on ``copier`` from those ``settle_abandoned`` ends: its layer closed it (shut down,
    after ``settle_joins``). Left there, they kept the closed layer's exchanges and gradient buffers alive until
    another layer's next forward, which then settled them against the released copy path."""
    with _STARTED_LOCK:
        for key in [key for key, (join, _) in _STARTED.items() if join.copier is copier]:
            del _STARTED[key]


class BackwardJoin:
    """An exchange's backward started on the copy thread and finished where the gradients of its sends are used.

    Autograd runs a node's backward before the nodes made earlier, so the backward of the results-home exchange
    comes first in phase 2's backward. Run there in place, it would make the compute stream wait for its copies
    before anything else of the layer's backward (and the calling thread for the exchange's host part). Started
    on the copy thread instead, the exchange runs beside what the backward computes next (the static experts' and
    the kept rows' GEMMs, whose nodes run first: see ``feplb.experts.EarlyBackward``), and only the GEMMs that
    produced the sends (made before ``wrap``) wait for it: ``wrap``'s node, the first of them to run, finishes the
    exchange (the calling thread waits until the copy thread has issued it, host barriers included; on a GPU the
    current stream then waits for its copies, a stream wait). Where no such node runs (this rank sends nothing, or
    its sends need no gradient), the next exchange's backward on this rank, which every rank of the node runs
    after this one, finishes it first (``settle``) where it runs in place; one started on the copy thread too
    queues behind it there: the copy path runs one exchange at a time, in order. Whatever is left pending is
    settled when the backward ends (an autograd callback: one that never reached those nodes), or, where the
    backward raised (autograd then runs no callback), before the next forward's, backward's or step call's first
    collective, by any layer (``settle_abandoned``); a layer's close waits for its copy thread too.

    The phase-2 exchanges (rows and weights to the helpers) use it too, through ``wrap_anchored``: their backward,
    which returns the rows' gradients to their homes, starts on the copy thread once the hosted rows' backward has
    run, and the anchor's node, on every rank, finishes it after the kept rows' backward
    (``feplb.phase2.dynamic_and_return``).

    Only where the exchange may run beside other collectives (``may_run_beside``): inside a node, over the CUDA
    IPC, shared-memory or gloo copy paths. An NCCL communicator or NVSHMEM's on-stream barriers in flight on the
    copy thread while the autograd thread starts another collective (a data-parallel gradient hook, say) could
    order them differently on different ranks; there the exchange's backward runs in place, as before.

    Args:
        copier: the copy thread (``Balancer.copier``).
    """

    BESIDE = ("ipc", "shm", "gloo")

    def __init__(self, copier: concurrent.futures.Executor):
        self.copier = copier
        self.after: BackwardJoin | None = None   # an earlier exchange's join, settled first (``wrap_anchored``)
        self.armed = False
        self._future: concurrent.futures.Future | None = None
        self._ex: Exchange | None = None
        self._shapes: list = []

    @classmethod
    def may_run_beside(cls, ex: Exchange) -> bool:
        """Whether ``ex``'s backward may run on the copy thread beside other collectives (see the class)."""
        return ex.comm.copy.name in cls.BESIDE and not ex.layout.cross_node

    def wrap(self, ex: Exchange, sends: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sends of ``ex``, through a node whose backward finishes the exchange (made right after the GEMMs that
        produced them, where they need gradients). Arms the join where autograd records and ``ex`` may run beside
        other collectives: its backward then starts on the copy thread (else it runs in place)."""
        self.armed = torch.is_grad_enabled() and ex.active and self.may_run_beside(ex)
        if not sends or not self.armed or not any(t.requires_grad for t in sends):
            return sends
        return list(_JoinFn.apply(self, False, *sends))

    def wrap_anchored(self, ex: Exchange, anchor: torch.Tensor, sends: list[torch.Tensor],
                      after: BackwardJoin | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``wrap`` with ``ex``'s anchor (``MoELayer._anchor``: it requires grad on every rank whenever autograd
        records) through the same node: that node then runs on every rank, before the backward of whatever made
        the anchor and the sends, and finishes the exchange there even where this rank sends nothing. Returns the
        anchor and the sends, wrapped where the join is armed. after: the join of an exchange whose backward the
        copy thread runs before this one's; ``finish`` settles it first, so that its error, if any, is the one
        raised (not this exchange's, which would then time out)."""
        self.after = after
        self.armed = torch.is_grad_enabled() and ex.active and self.may_run_beside(ex) and anchor.requires_grad
        if not self.armed:   # (in place: an anchor that needs no gradient would leave no node to finish it)
            return anchor, sends
        anchor, *sends = _JoinFn.apply(self, True, anchor, *sends)
        return anchor, list(sends)

    def start(self, ex: Exchange, grads: list[torch.Tensor], shapes: list) -> None:
        """Issue ``ex``'s backward with ``grads`` on the copy thread; settled at the latest when this backward ends."""
        self.settle()   # (a previous backward's, left pending: it ends, or raises, first)
        ready = None
        if ex.device.type == "cuda":   # the gradients are made on this stream, up to here
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(ex.device))
        self._ex, self._shapes = ex, shapes
        self._future = self.copier.submit(ex.issue_backward, grads, ready, handoff=True)
        with _STARTED_LOCK:
            _STARTED[id(self)] = (self, torch._C._current_graph_task_id())
        torch.autograd.Variable._execution_engine.queue_callback(self.settle)

    def _take(self) -> dict[int, torch.Tensor] | None:
        """The pending exchange's buffers, the current stream made to wait for them (None if none is pending)."""
        fut = self._future
        if fut is None:
            return None
        # (the exchange ends before the join lets go of it: interrupted here, a KeyboardInterrupt say, it stays
        # pending, for settle_abandoned or the next settle, instead of running on unseen beside what comes next)
        concurrent.futures.wait([fut])
        self._future = None
        with _STARTED_LOCK:
            _STARTED.pop(id(self), None)
        return self._ex.handed(*fut.result())

    def settle(self) -> None:
        """End the pending exchange, if any (its gradients, if any, are not needed here): the calling thread waits
        for the copy thread, and on a GPU the current stream for its copies; raises what it raised."""
        self._take()

    def finish(self) -> list[torch.Tensor]:
        """The gradients of the sends (waits for the exchange; on a GPU the current stream waits for its copies)."""
        if self.after is not None:
            self.after.settle()
        got = self._take()
        if got is None:
            raise RuntimeError("BackwardJoin.finish: the exchange's backward was not started (its node did not run "
                               "before the sends' gradients were needed)")
        return self._ex.send_grads(got, self._shapes)


@dataclass(frozen=True, kw_only=True, eq=False)
class Received:
    """What one rank received in an exchange: a 1-D view per item, and each source's whole buffer."""

    tail: torch.Tensor                # empty; keep it in the graph (the exchange's backward is collective)
    items: dict[int, torch.Tensor]    # item index -> 1-D view of its elements
    bufs: dict[int, torch.Tensor]     # source rank -> 1-D buffer of its items, in item order
    at: dict[int, tuple[int, int]]    # item index -> (source rank, offset in that source's buffer)

    def joined(self, ks: Sequence[int]) -> torch.Tensor:
        """The items ``ks`` back to back (1-D): a view when they lie in order in one source's buffer, else a cat."""
        if not ks:
            raise ValueError("joined() needs at least one item")
        src, start = self.at[ks[0]]
        end = start
        for k in ks:
            q, off = self.at[k]
            if q != src or off != end:
                return torch.cat([self.items[k] for k in ks])
            end = off + self.items[k].numel()
        return self.bufs[src][start:end]


class Exchange:
    """One batched, differentiable exchange between EP ranks (collective; see the module docstring).

    Args:
        comm: the layer's ``PeerComm``.
        items: every block of the exchange (``feplb.layout.Item``), identical on every rank of the node, and on every
            rank of the group whenever an item crosses nodes.
        dtype, device: of every block. op: names the step in errors and timeouts.
    """

    def __init__(self, comm: PeerComm, items: Sequence[Item], *, dtype: torch.dtype, device: torch.device, op: str):
        self.comm, self.items, self.dtype, self.device, self.op = comm, list(items), dtype, device, op
        self.layout = exchange_layout(self.items, comm.rank, comm.gpus_per_node)
        self.at: dict[int, tuple[int, int]] = {}
        for q, ks in self.layout.recv.items():
            pos = 0
            for k in ks:
                self.at[k] = (q, pos)
                pos += self.items[k].numel

    @property
    def active(self) -> bool:
        """Whether any rank this rank must talk to takes part (identical on every rank of a node)."""
        return self.layout.cross_node or self.layout.intra_node

    def sends_of(self, by_item: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's send tensors in the exchange's order, from {item index: tensor}."""
        return [by_item[k] for ks in self.layout.send.values() for k in ks]

    def issue(self, sends: list[torch.Tensor], ready=None, *, handoff: bool = False):
        """Run the exchange now on this thread, without autograd: ({source: buffer}, the event its hand-off stream
        recorded after the copies, or None). ready (CUDA): the event the sends depend on. handoff (CUDA): the
        results are for another thread's stream (a worker issues them): they are handed to the comm's hand-off
        stream and the returned event says when they are there; else the calling thread's stream waits for them.

        With ``handoff`` on CUDA everything this thread enqueues (flattening strided sends such as a transposed
        weight, the cross-node part) goes on the comm's worker stream, after ``ready``; the copy path then starts
        after that stream's work, and the hand-off stream waits for both."""
        lay = self.layout
        pieces: dict[int, list[torch.Tensor]] = {}
        it = iter(sends)
        for p, ks in lay.send.items():
            pieces[p] = []
            for k in ks:
                t = next(it)
                if t.numel() != self.items[k].numel:
                    raise ValueError(f"{self.op}: item {k} ({self.items[k]}) given {t.numel()} elements")
                pieces[p].append(t)
        return self._run(pieces, lay.recv_numel, lay.node_matrix, self.op, ready, handoff)

    def issue_backward(self, grads: list[torch.Tensor], ready=None, *, handoff: bool = False):
        """The exchange's backward, without autograd: ``grads`` are those of what this rank received (in
        ``layout.recv`` order); what i sent j, j now sends i, each source's whole block in one piece. Returns
        ({destination of the forward: buffer of the gradients of what this rank sent it}, event or None), as
        ``issue`` (``ready`` and ``handoff`` alike); ``send_grads`` splits it per send."""
        lay = self.layout
        back = {q: [g] for q, g in zip(lay.recv, grads, strict=True)}
        recv = {p: sum(self.items[k].numel for k in ks) for p, ks in lay.send.items()}
        return self._run(back, recv, lay.node_matrix.T, f"{self.op}, backward", ready, handoff)

    def send_grads(self, got: dict[int, torch.Tensor], shapes: list) -> list[torch.Tensor]:
        """``issue_backward``'s buffers as the gradient of each send (in ``sends_of`` order, each in its shape)."""
        out = []
        it = iter(shapes)
        for p, ks in self.layout.send.items():
            pos = 0
            for k in ks:
                n = self.items[k].numel
                out.append(got[p][pos:pos + n].view(next(it)))
                pos += n
        return out

    def _run(self, pieces, recv_numel, matrix, op, ready, handoff):
        if not (handoff and self.device.type == "cuda"):
            return self._issue(pieces, recv_numel, matrix, op, ready, None, None)
        if ready is None:
            raise ValueError(f"{op}: a hand-off exchange on CUDA needs the sends' ready event (recorded on the "
                             "stream that produced them): a worker thread cannot know that stream")
        work = self.comm.worker_stream(self.device)
        work.wait_event(ready)
        with torch.cuda.stream(work):
            return self._issue(pieces, recv_numel, matrix, op, None, work, self.comm.handoff_stream(self.device))

    def _issue(self, pieces, recv_numel, matrix, op, ready, work, consumer):
        flat: dict[int, list[torch.Tensor]] = {}
        for p, ts in pieces.items():
            flat[p] = []
            for t in ts:
                t = t.detach()
                if work is not None:
                    t.record_stream(work)   # made on the compute stream, read here: not reused before
                flat[p].append(t.reshape(-1).contiguous())
        if work is not None:
            ready = torch.cuda.Event()
            ready.record(work)              # the flattened sends exist (and the caller's ready has passed)
        lay = self.layout
        got = self.comm.run(flat, recv_numel, cross_node=lay.cross_node, intra_node=lay.intra_node,
                            dtype=self.dtype, device=self.device, op=op, node_matrix=matrix,
                            ready=ready, consumer=consumer)
        done = None
        if consumer is not None:
            if work is not None:
                # the cross-node part ran on the worker stream: the consumer waits for it too
                joined = torch.cuda.Event()
                joined.record(work)
                consumer.wait_event(joined)
                for t in got.values():
                    t.record_stream(consumer)
            done = torch.cuda.Event()
            done.record(consumer)
        return got, done

    def handed(self, got: dict[int, torch.Tensor], done) -> dict[int, torch.Tensor]:
        """``got`` of an exchange issued for the hand-off stream (``issue(..., handoff=True)``, on another thread),
        for the calling thread: its current stream waits for ``done`` (no host wait) and the buffers are marked as
        used there, for the allocator. ``done`` None (a CPU, or issued here): ``got`` as it is."""
        if done is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(done)
            for t in got.values():
                t.record_stream(cur)
        return got

    def start(self, sends: list[torch.Tensor], worker: concurrent.futures.Executor, *,
              ready=None, timed: Callable[[], Any] | None = None) -> concurrent.futures.Future:
        """Issue the exchange on ``worker`` (the copy thread); finish it with ``self(sends, anchor, pending=<the
        returned future>)``. The tensors must not change meanwhile. ready (CUDA, required): the event recorded
        after the sends were produced (``feplb.experts.ready_event``). timed: a context manager factory entered
        around the issue on the worker (a timeline's span of the copy lane), or None."""
        if ready is None and self.device.type == "cuda":
            raise ValueError(f"{self.op}: Exchange.start on CUDA needs the sends' ready event")
        if timed is None:
            return worker.submit(self.issue, list(sends), ready, handoff=True)

        def issue(sends: list[torch.Tensor], ready) -> Any:
            with timed():
                return self.issue(sends, ready, handoff=True)

        return worker.submit(issue, list(sends), ready)

    def __call__(self, sends: list[torch.Tensor], anchor: torch.Tensor,
                 pending: concurrent.futures.Future | None = None, on_backward=None,
                 join: BackwardJoin | None = None, settle: BackwardJoin | None = None) -> Received:
        """Differentiable exchange: sends in ``sends_of`` order -> what this rank received.

        anchor: an empty tensor requiring grad whenever autograd records (on every rank), so that every rank runs
        the backward. pending: a future of ``(buffers, event)`` from ``start`` or ``issue(..., handoff=True)`` with
        the same sends (the copies already ran, beside the compute). on_backward: a callable run first in the
        (first) backward, on every rank of the exchange in the same order (``feplb.recopy.Recopy.start``); not run
        where the exchange is not active on this rank. join: the ``BackwardJoin`` that ``sends`` went through
        (``join.wrap``): the backward starts there on the copy thread, and the sends' gradients wait for it only
        where that node runs. settle: a ``BackwardJoin`` of an exchange made after this one, whose backward comes
        before this one's: this backward waits for it to end first."""
        if not self.active:
            return Received(tail=anchor[:0].reshape(-1), items={}, bufs={}, at={})
        tail, *bufs = _ExchangeFn.apply(self, pending, on_backward, join, settle, anchor, *sends)
        return self.received(dict(zip(self.layout.recv, bufs, strict=True)), tail)

    def received(self, by_src: dict[int, torch.Tensor], tail: torch.Tensor) -> Received:
        """What this rank received, from {source: buffer} (``issue``'s, or the differentiable call's)."""
        out = {k: by_src[q][off:off + self.items[k].numel] for k, (q, off) in self.at.items()}
        return Received(tail=tail, items=out, bufs=by_src, at=dict(self.at))
