"""``NvshmemCopyEngine``: the GPU copy path over nvshmem4py: on-stream puts with signals into symmetric inboxes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from feplb.copy.cuda import CudaStreams
from feplb.transport import nvshmem_initialized, nvshmem_modules, nvshmem_shared_gpu

__all__ = ["NvshmemCopyEngine"]


class NvshmemCopyEngine(CudaStreams):
    """GPU copy path over nvshmem4py (raw bindings: its high-level calls take only whole nvshmem tensors).

    Each GPU owns one symmetric inbox. On the copy stream, after ``ready``: a sender puts its pieces for peer p
    straight into p's inbox, at the offset the split matrix gives (blocks by sender node rank), one on-stream put
    per piece (the last one carries the signal "epoch n" into p's signal word for this sender, after a
    ``quiet_on_stream`` when there were several pieces, so the signal follows all of them); then the receiver's
    copy stream waits on every sender's signal (``signal_wait_until_on_stream``), copies each sender's block out
    into a fresh tensor, and enters ``barrier_all_on_stream``: no PE puts into an inbox for the next exchange before
    its owner copied this one out. ``consumer`` waits on an event recorded after that. Exchanges without traffic
    still count an epoch (alike on every rank).

    Requirements: nvshmem initialised (``NvshmemTransport`` does it with ``transport="nvshmem"``) with PE numbers
    equal to global ranks; the node is the whole job (symmetric allocations are collective over every PE, so the
    inbox can only grow where all PEs exchange together); one GPU per process (several PEs on one GPU without MPS
    cannot wait on signals). The inbox grows collectively, by the same rule on every rank, with a device sync.
    nvshmem calls are not thread-safe: no other thread may call nvshmem while an exchange runs. ``close()`` frees
    the inbox and the signals, collectively like their allocation; close it before the transport finalises
    nvshmem. Untested without a GPU.

    Args:
        control: the EP group's ``Control``.  device: this rank's GPU (default: the current device).
    """

    name = "nvshmem"

    def __init__(self, control, device: torch.device | None = None):
        self._nv, self._bind = nvshmem_modules()
        super().__init__(control, device)
        if control.gpus_per_node != dist.get_world_size():
            raise ValueError("the nvshmem copy path needs the node to be the whole job (its symmetric inbox grows "
                             "collectively over every PE); use kind='ipc' across several nodes")
        if not nvshmem_initialized(self._nv):
            raise ValueError("the nvshmem copy path needs nvshmem initialised (transport='nvshmem' does it); use "
                             "kind='ipc' otherwise")
        if nvshmem_shared_gpu(self._nv):
            raise ValueError("the nvshmem copy path cannot wait on signals with several processes on one GPU "
                             "(nvshmem 'limited MPG' mode, no MPS); use kind='ipc'")
        self._pes = list(control.node_ranks)
        self._inbox: torch.Tensor | None = None
        self._signal: torch.Tensor | None = None
        self._epoch = 0

    def _ensure_inbox(self, nbytes: int) -> torch.Tensor:
        """The symmetric inbox of at least ``nbytes`` (collective: every PE asks for the same size, read off the
        same matrix); the signal words on first use, zeroed on every PE before any put (a barrier on the copy
        stream)."""
        nv = self._nv
        if self._inbox is None or self._inbox.numel() < nbytes:
            if self._inbox is not None:
                torch.cuda.synchronize(self.device)    # no put may still target the old inbox when it is freed
                nv.free_tensor(self._inbox)
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            self._inbox = nv.interop.torch.tensor((cap,), dtype=torch.uint8)
        if self._signal is None:
            # NVSHMEM signals are 64-bit words (nvshmem memory is not zeroed); the epoch never nears the sign bit.
            self._signal = nv.interop.torch.tensor((self.node_size,), dtype=torch.int64)
            with torch.cuda.stream(self.stream):
                self._signal.zero_()
            self._bind.barrier_all_on_stream(self.stream.cuda_stream)
        return self._inbox

    def _exchange(self, send, recv_numel, *, dtype, device, op, matrix, ready, consumer):
        m = self._split_matrix(send, recv_numel, dtype, device, op, matrix, ready, consumer)
        me, g, elem = self.node_rank, self.node_size, dtype.itemsize
        nv, bind = self._nv, self._bind
        with torch.cuda.device(self.device):
            self._epoch += 1
            if not m.any():
                return self._results(recv_numel, lambda q: torch.empty(0, dtype=dtype, device=self.device))
            # the copy stream waits for ``ready`` first: the signal words' first zeroing and barrier (and every
            # later on-stream nvshmem call of this engine) then come after the transport's on-stream barriers that
            # the compute stream queued before ``ready`` (no two nvshmem collectives of one PE run concurrently)
            self._after(ready)
            inbox = self._ensure_inbox(int(m.sum(0).max()) * elem)
            h = self.stream.cuda_stream
            set_op, ge = int(nv.SignalOp.SIGNAL_SET), int(nv.ComparisonType.CMP_GE)
            sig = self._signal.data_ptr()
            sig_bytes = self._signal.element_size()
            for p in range(g):
                pieces = [t for t in send.get(p, ()) if t.numel()]
                off = int(m[:me, p].sum()) * elem
                for i, t in enumerate(pieces):
                    n = t.numel() * elem
                    if i < len(pieces) - 1:
                        bind.putmem_on_stream(inbox.data_ptr() + off, t.data_ptr(), n, self._pes[p], h)
                    else:
                        if len(pieces) > 1:
                            bind.quiet_on_stream(h)
                        bind.putmem_signal_on_stream(inbox.data_ptr() + off, t.data_ptr(), n, sig + me * sig_bytes,
                                                     self._epoch, set_op, self._pes[p], h)
                    t.record_stream(self.stream)
                    off += n
            col = m[:, me]
            for q in range(g):
                if col[q]:
                    bind.signal_wait_until_on_stream(sig + q * sig_bytes, ge, self._epoch, h)
            out = self._copy_out({q: (inbox, int(col[:q].sum()) * elem, int(col[q])) for q in recv_numel}, dtype)
            bind.barrier_all_on_stream(h)
            self._hand_over(out.values(), consumer)
        return self._results(recv_numel, out.__getitem__)

    def _release(self) -> None:
        if self._inbox is not None or self._signal is not None:
            torch.cuda.synchronize(self.device)
        for t in (self._inbox, self._signal):
            if t is not None:
                self._nv.free_tensor(t)
        self._inbox = self._signal = None
