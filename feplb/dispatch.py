"""Autograd functions of the two-phase dispatch: every communication step is differentiable, so backward mirrors
forward by construction (gradients of moved rows return home, weight gradients computed on a helper return to the
owner's ``.grad`` through the same path, exactly once).

* ``all_to_all_rows``: phase-1 rows to the experts' home ranks (backward: the reverse all-to-all).
* ``exchange``: flat buffers between arbitrary ranks of the EP group (phase-2 rows, results and weight copies);
  pairs inside a node go through the copy path, pairs across nodes through the transport.

Both are collective: every rank calls them in the same order. Their backward is collective too, so every rank must
reach it: ``exchange`` always returns a tensor that callers feed into the rest of the graph (at least an empty slice
of it), and takes an input that requires grad whenever autograd is recording (an empty slice of the layer's rows).

Both take an optional ``node_matrix``, the G x G element counts that the ranks of the caller's node send each other
in the call (identical on every rank of the node, given on all of them or none): the copy path then skips its size
agreement (``CopyEngine.exchange``'s ``matrix``); ``exchange``'s backward passes the transpose.

Legend: M rows sent, R rows received, D row width, N elements of a flat buffer, G GPUs per node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from feplb.control import guard
from feplb.copy_engine import CopyEngine
from feplb.transport import Transport

__all__ = ["PeerComm", "all_to_all_rows", "exchange"]


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, transport: Transport, send_splits: tuple, recv_splits: tuple, out,
                split_matrix, anchor):
        ctx.transport, ctx.send_splits, ctx.recv_splits = transport, send_splits, recv_splits
        ctx.split_matrix = split_matrix
        ctx.anchor_shape = None if anchor is None else anchor.shape
        return transport.all_to_all(x_MD, send_splits, recv_splits, out=out, split_matrix=split_matrix)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        m = ctx.split_matrix
        grad_MD = ctx.transport.all_to_all(grad_RD.contiguous(), ctx.recv_splits, ctx.send_splits,
                                           split_matrix=None if m is None else m.t().contiguous())
        grad_anchor = None if ctx.anchor_shape is None else grad_RD.new_zeros(ctx.anchor_shape)
        return grad_MD, None, None, None, None, None, grad_anchor


def all_to_all_rows(x_MD: torch.Tensor, transport: Transport, send_splits: Sequence[int],
                    recv_splits: Sequence[int], out: torch.Tensor | None = None,
                    split_matrix: torch.Tensor | None = None, anchor: torch.Tensor | None = None) -> torch.Tensor:
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
    Returns:
        recv_RD: [R, D], rank s's rows in block s.
    """
    return _AllToAllRows.apply(x_MD, transport, tuple(int(s) for s in send_splits),
                               tuple(int(s) for s in recv_splits), out, split_matrix, anchor)


@dataclass
class PeerComm:
    """Routes flat buffers between ranks of the EP group: node peers through ``copy``, other ranks through
    ``transport`` (an all-to-all over the whole group, used only when ``cross_node`` is set for that call)."""

    transport: Transport
    copy: CopyEngine
    gpus_per_node: int

    @property
    def rank(self) -> int:
        return self.transport.rank

    def node_of(self, r: int) -> int:
        return r // self.gpus_per_node

    def run(self, send: dict[int, list[torch.Tensor]], recv_numel: dict[int, int], *, cross_node: bool,
            dtype: torch.dtype, device: torch.device, op: str, intra_node: bool = True,
            node_matrix=None) -> dict[int, torch.Tensor]:
        """Send the pieces ``send[dst]`` (contiguous ``dtype`` tensors, sent back to back) to each EP rank dst;
        return {src: 1-D buffer of recv_numel[src] elements}.

        node_matrix: optional G x G elements node rank i of this rank's node sends node rank j in this call (int64
        array or tuple of tuples; see the module docstring); passed to the copy path, which checks this rank's part
        of ``send`` and ``recv_numel`` against it."""
        me, g = self.rank, self.gpus_per_node
        base = self.node_of(me) * g
        out: dict[int, torch.Tensor] = {}
        local_send = {p - base: t for p, t in send.items() if self.node_of(p) == self.node_of(me)}
        local_recv = {q - base: n for q, n in recv_numel.items() if self.node_of(q) == self.node_of(me)}
        if intra_node and g > 1:
            got = self.copy.exchange(local_send, local_recv, dtype=dtype, device=device, op=op, matrix=node_matrix)
            out.update({q + base: t for q, t in got.items()})
        elif local_send or local_recv:
            raise ValueError(f"{op}: intra-node traffic without a copy path call")
        remote_send = {p: t for p, t in send.items() if self.node_of(p) != self.node_of(me)}
        remote_recv = {q: n for q, n in recv_numel.items() if self.node_of(q) != self.node_of(me)}
        if cross_node:
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
            raise ValueError(f"{op}: cross-node traffic but cross_node=False")
        return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat_send: torch.Tensor, comm: PeerComm, send_layout: tuple, recv_layout: tuple,
                cross_node: bool, intra_node: bool, op: str, node_matrix: np.ndarray | None):
        ctx.comm, ctx.send_layout, ctx.recv_layout = comm, send_layout, recv_layout
        ctx.cross_node, ctx.intra_node, ctx.op, ctx.node_matrix = cross_node, intra_node, op, node_matrix
        return _run_layout(comm, flat_send, send_layout, recv_layout, cross_node, intra_node, op, node_matrix)

    @staticmethod
    def backward(ctx, grad_recv: torch.Tensor):
        # Gradients flow back along every pair: what i sent j, j now sends i.
        back = None if ctx.node_matrix is None else ctx.node_matrix.T
        grad_send = _run_layout(ctx.comm, grad_recv.contiguous(), ctx.recv_layout, ctx.send_layout, ctx.cross_node,
                                ctx.intra_node, f"{ctx.op}, backward", back)
        return grad_send, None, None, None, None, None, None, None


def _run_layout(comm: PeerComm, flat: torch.Tensor, send_layout: tuple, recv_layout: tuple, cross_node: bool,
                intra_node: bool, op: str, node_matrix: np.ndarray | None = None) -> torch.Tensor:
    send, start = {}, 0
    for peer, n in send_layout:
        send[peer] = [flat[start:start + n]]
        start += n
    if start != flat.numel():
        raise ValueError(f"{op}: send layout covers {start} elements but the buffer has {flat.numel()}")
    recv_numel = dict(recv_layout)
    got = comm.run(send, recv_numel, cross_node=cross_node, dtype=flat.dtype, device=flat.device, op=op,
                   intra_node=intra_node, node_matrix=node_matrix)
    parts = [got[q] for q, n in recv_layout]
    for (q, n), t in zip(recv_layout, parts, strict=True):
        if t.numel() != n:
            raise RuntimeError(f"{op}: expected {n} elements from rank {q}, got {t.numel()}")
    return torch.cat(parts) if parts else flat.new_empty(0)


def exchange(flat_send: torch.Tensor, comm: PeerComm, send_layout: Sequence[tuple[int, int]],
             recv_layout: Sequence[tuple[int, int]], *, cross_node: bool, intra_node: bool = True,
             op: str = "exchange", node_matrix=None) -> torch.Tensor:
    """Differentiable exchange of flat buffers with arbitrary EP ranks.

    Args:
        flat_send: 1-D [N_send], the blocks for each destination concatenated in ``send_layout`` order.
        send_layout: ((dst rank, elements), ...) with distinct dst; recv_layout: ((src rank, elements), ...).
        cross_node: whether any rank of the group exchanges across nodes in this call (globally agreed).
        intra_node: whether the node's copy path is called (every rank of the node must agree).
        node_matrix: optional G x G elements node rank i of this rank's node sends node rank j (an integer array
            or tuple of tuples, identical on the node's ranks; see the module docstring); the backward uses its
            transpose.
    Returns:
        1-D [N_recv], the blocks from each source concatenated in ``recv_layout`` order.
    """
    if dist.get_world_size(comm.transport.group) == 1:
        return flat_send[:0]
    nm = None if node_matrix is None else np.asarray(node_matrix)
    return _Exchange.apply(flat_send, comm, tuple(send_layout), tuple(recv_layout), cross_node, intra_node, op, nm)
