"""Phase-2 copy path: flat buffers between the GPUs of one node, behind one interface.

* ``GlooCopyEngine`` (CPU tensors): one ``all_to_all_single`` inside the node's gloo subgroup; zero-sized splits for
  pairs that exchange nothing. This is the CPU stand-in for the copy engines; it runs in CI.
* ``CudaCopyEngine`` (CUDA tensors): a push over NVLink peers. Each GPU owns a symmetric inbox (nvshmem4py); a
  sender puts its blocks straight into the peer's inbox with one on-stream ``put_signal`` per peer on a dedicated
  copy stream, ordered after the producer by an event; the receiver's compute stream waits on the signal, so
  neither host nor SMs wait or copy. Without nvshmem4py it falls back to ``all_to_all_single`` over NCCL inside
  the node subgroup, issued on the same dedicated stream (correct, but that copy runs on SMs).

Every rank of a node calls ``exchange`` in the same order (it is collective inside the node); pairs across nodes are
never handled here (the layer sends those through the transport).

Legend: G GPUs per node, N elements of a flat buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from feplb.transport import NVSHMEM_HINT, all_gather_stack, guard, nv_stream

__all__ = ["CopyEngine", "CudaCopyEngine", "GlooCopyEngine", "make_node_groups"]


def make_node_groups(group: dist.ProcessGroup | None, gpus_per_node: int) -> tuple[dist.ProcessGroup | None, list]:
    """Create one subgroup per node of the EP group (collective: every rank creates all of them, in order).

    Returns (this rank's node subgroup, global ranks of that node in group-rank order). With one node the EP
    group itself is returned.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world % gpus_per_node:
        raise ValueError(f"gpus_per_node ({gpus_per_node}) must divide the EP group size ({world})")
    ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    node = rank // gpus_per_node
    if world == gpus_per_node:
        return group, ranks
    mine = None
    for n in range(world // gpus_per_node):
        members = ranks[n * gpus_per_node:(n + 1) * gpus_per_node]
        g = dist.new_group(members)
        if n == node:
            mine = g
    return mine, ranks[node * gpus_per_node:(node + 1) * gpus_per_node]


class CopyEngine:
    """Exchange of flat buffers inside one node.

    Args (constructor):
        node_group: the process group of this rank's node.
        node_size: G, GPUs of the node; peers are named by their index inside the node (0..G-1).
    """

    name = "abstract"

    def __init__(self, node_group: dist.ProcessGroup | None, node_size: int):
        self.node_group = node_group
        self.node_size = node_size
        self.node_rank = dist.get_rank(node_group)

    def exchange(self, send: dict[int, torch.Tensor], recv_numel: dict[int, int], *, dtype: torch.dtype,
                 device: torch.device, op: str) -> dict[int, torch.Tensor]:
        """Send ``send[p]`` (1-D, ``dtype``) to node peer ``p``; receive ``recv_numel[q]`` elements from each q.

        Returns {q: 1-D tensor of recv_numel[q] elements}. Collective inside the node; ``op`` names the step in
        timeout errors. A peer may appear in neither dict (nothing exchanged with it).
        """
        raise NotImplementedError

    def _split(self, out: torch.Tensor, recv_splits: list[int], recv_numel: dict[int, int]) -> dict[int, torch.Tensor]:
        """The flat receive buffer ``out`` (peers in node order) -> {q: its part} for every peer asked for."""
        res, start = {}, 0
        for q in range(self.node_size):
            if recv_splits[q] or q in recv_numel:
                res[q] = out[start:start + recv_splits[q]]
            start += recv_splits[q]
        return res

    def _layout(self, send: dict[int, torch.Tensor], recv_numel: dict[int, int]) -> tuple[list[int], list[int]]:
        for p in list(send) + list(recv_numel):
            if not 0 <= p < self.node_size or p == self.node_rank:
                raise ValueError(f"copy-path peer must be another GPU of the node (0..{self.node_size - 1}, "
                                 f"not {self.node_rank}), got {p}")
        send_splits = [send[p].numel() if p in send else 0 for p in range(self.node_size)]
        recv_splits = [int(recv_numel.get(p, 0)) for p in range(self.node_size)]
        return send_splits, recv_splits


class GlooCopyEngine(CopyEngine):
    """CPU copy path: ``all_to_all_single`` of flat buffers inside the node's gloo subgroup."""

    name = "gloo"

    def exchange(self, send, recv_numel, *, dtype, device, op):
        send_splits, recv_splits = self._layout(send, recv_numel)
        parts = [send[p].reshape(-1).to(dtype) for p in range(self.node_size) if p in send]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        with guard(f"copy path ({op})", self.node_group):
            dist.all_to_all_single(out, flat, recv_splits, send_splits, group=self.node_group)
        return self._split(out, recv_splits, recv_numel)


class CudaCopyEngine(CopyEngine):
    """GPU copy path on a dedicated copy stream (see the module docstring). Untested without a GPU."""

    name = "cuda"

    def __init__(self, node_group, node_size: int, *, use_nvshmem: bool = True):
        super().__init__(node_group, node_size)
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA copy path needs a CUDA GPU")
        self.stream = torch.cuda.Stream()
        self._nv = None
        if use_nvshmem:
            try:
                import nvshmem.core as nv  # type: ignore[import-not-found]

                self._nv = nv
            except ImportError:
                self._nv = None
        self._inbox: torch.Tensor | None = None
        self._signal: torch.Tensor | None = None
        self._epoch = 0

    def _ensure_inbox(self, nbytes: int) -> torch.Tensor:
        nv = self._nv
        if self._inbox is None or self._inbox.numel() < nbytes:
            # Symmetric allocations are collective; every rank asks for the node-wide max (agreed by the caller).
            if self._inbox is not None:
                nv.free_tensor(self._inbox)
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            self._inbox = nv.interop.torch.empty((cap,), dtype=torch.uint8)
        if self._signal is None:
            # NVSHMEM signals are 64-bit words; the epoch counter never gets near the sign bit.
            self._signal = nv.interop.torch.empty((self.node_size,), dtype=torch.int64)
            self._signal.zero_()
            nv.barrier(nv.Teams.TEAM_NODE, stream=nv_stream(torch.cuda.current_stream()))
        return self._inbox

    def exchange(self, send, recv_numel, *, dtype, device, op):
        send_splits, recv_splits = self._layout(send, recv_numel)
        compute = torch.cuda.current_stream()
        ready = torch.cuda.Event()
        ready.record(compute)
        self.stream.wait_event(ready)
        elem = torch.empty((), dtype=dtype).element_size()
        if self._nv is None:
            with torch.cuda.stream(self.stream):
                parts = [send[p].reshape(-1).to(dtype) for p in range(self.node_size) if p in send]
                flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
                out = torch.empty(sum(recv_splits), dtype=dtype, device=device)
                with guard(f"copy path ({op})", self.node_group):
                    dist.all_to_all_single(out, flat, recv_splits, send_splits, group=self.node_group)
                done = torch.cuda.Event()
                done.record(self.stream)
            compute.wait_event(done)
            out.record_stream(compute)
        else:
            nv = self._nv
            # Inbox layout on peer q: blocks by sender node rank; my block on q starts after what ranks < me send q.
            all_send = torch.tensor(send_splits, dtype=torch.int64, device=device)
            with guard(f"copy path ({op}): split exchange", self.node_group):
                matrix = all_gather_stack(all_send, self.node_group).cpu()
            need = int(matrix.sum(0).max()) * elem
            inbox = self._ensure_inbox(need)
            self._epoch += 1
            with torch.cuda.stream(self.stream):
                for p in range(self.node_size):
                    if p in send and send[p].numel():
                        off = int(matrix[: self.node_rank, p].sum()) * elem
                        src = send[p].reshape(-1).to(dtype).contiguous().view(torch.uint8)
                        peer_pe = dist.get_global_rank(self.node_group, p) if self.node_group is not None else p
                        slot = self._signal[self.node_rank: self.node_rank + 1]
                        nv.put_signal(inbox[off: off + src.numel()], src, slot, self._epoch,
                                      nv.SignalOp.SIGNAL_SET, remote_pe=peer_pe, stream=nv_stream(self.stream))
            for q in range(self.node_size):
                if recv_splits[q]:
                    nv.signal_wait(self._signal[q: q + 1], self._epoch, nv.ComparisonType.CMP_GE,
                                   stream=nv_stream(compute))
            out = inbox[: sum(recv_splits) * elem].clone().view(dtype)
            # The inbox is reused by the next exchange: no peer may put into it before this copy-out ran.
            nv.barrier(nv.Teams.TEAM_NODE, stream=nv_stream(compute))
        return self._split(out, recv_splits, recv_numel)


def make_copy_engine(device: torch.device, node_group, node_size: int, *, use_nvshmem: bool = False) -> CopyEngine:
    """The copy path for tensors on ``device``: CUDA peers on GPUs (nvshmem4py puts when ``use_nvshmem``, which
    needs nvshmem initialised, e.g. by ``NvshmemTransport``), gloo on CPUs."""
    if device.type == "cuda":
        return CudaCopyEngine(node_group, node_size, use_nvshmem=use_nvshmem)
    if device.type == "cpu":
        return GlooCopyEngine(node_group, node_size)
    raise ValueError(f"no copy path for device type {device.type!r} (expected 'cpu' or 'cuda'); {NVSHMEM_HINT}")
