"""``IpcCopyEngine``: the GPU copy path over CUDA IPC (the peer-tensor protocol of ``feplb.copy.peer`` with
copy-engine writes on a dedicated copy stream)."""

from __future__ import annotations

import torch

from feplb.copy.cuda import CudaStreams
from feplb.copy.peer import PeerInboxEngine

__all__ = ["IpcCopyEngine"]


class IpcCopyEngine(CudaStreams, PeerInboxEngine):
    """GPU copy path over CUDA IPC: the peer-tensor protocol with copy-engine writes. Needs a CUDA GPU.

    Each rank's inbox is a CUDA allocation; its storage is shared with every peer through CUDA IPC (torch's
    ``_share_cuda_`` / ``_new_shared_cuda``, which keep the memory alive while any peer maps it); peers map it on
    their own device, so a peer's view is labelled with the mapping process's device (two processes on one GPU map
    each other's inboxes like two GPUs do). All device work of an exchange runs on ``self.stream``, the copy stream:
    it waits for ``ready``; each piece is one ``copy_(non_blocking=True)`` into the peer's inbox view, i.e. a
    ``cudaMemcpyAsync`` run by a copy engine (over NVLink between GPUs), no SM work; then the copy-outs of every
    sender's block into fresh tensors; the ``consumer`` stream waits on an event recorded after them.

    Ordering across processes uses two interprocess events per rank and inbox half: "written[h]", recorded on the
    sender's copy stream after its writes into half h (the receiver's copy stream waits on it before its copy-out;
    the end barrier guarantees the record is issued before the wait, and the next record of written[h] comes only
    after the next end barrier, which the receiver enters after issuing its wait), and "consumed[h]", recorded on
    the receiver's copy stream after its copy-out of half h (the sender's copy stream waits on it before writing
    into that half two exchanges later: the record was issued before the receiver entered the end barrier in
    between, and the next record of consumed[h] only comes after the end barrier of that later exchange). So the
    host barriers order the event calls, and the events order the copies on the devices; the host never waits for
    the device, except when the inboxes grow. Control plane (sizes, barrier, handles) over the node's gloo group.
    ``close()`` is local. Memory: each inbox holds two halves of ``capacity`` bytes of device memory.

    Args:
        control: the EP group's ``Control``.  device: this rank's GPU (default: the current device).
    Raises:
        PeerMemoryUnavailable: on every rank of the node, when some rank cannot share or open an inbox or event.
    """

    name = "ipc"

    def __init__(self, control, device: torch.device | None = None):
        super().__init__(control, device)
        self._inbox: torch.Tensor | None = None
        self._peer_inbox: dict[int, torch.Tensor] = {}
        self._peer_written: dict[int, list[torch.cuda.Event]] = {}
        self._peer_consumed: dict[int, list[torch.cuda.Event]] = {}
        err, mine = None, None
        with torch.cuda.device(self.device):
            self._written = [torch.cuda.Event(interprocess=True) for _ in range(self.PARITIES)]
            self._consumed = [torch.cuda.Event(interprocess=True) for _ in range(self.PARITIES)]
            try:
                mine = ([e.ipc_handle() for e in self._written], [e.ipc_handle() for e in self._consumed])
            except RuntimeError as exc:
                err = f"cannot share interprocess events: {exc}"
            events = self._agree_setup(mine, err, "copy path setup: event handles", "share events")
            err = None
            try:
                for p, ((written, consumed), _) in enumerate(events):
                    if p != self.node_rank:
                        self._peer_written[p] = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in written]
                        self._peer_consumed[p] = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in consumed]
            except RuntimeError as exc:
                err = f"cannot open a peer's interprocess events: {exc}"
            self._agree_setup(None, err, "copy path setup: event handles", "open events")
            self._grow(self.min_capacity, "copy path setup")

    def _setup_failure(self, what: str) -> str:
        return (f"the ipc copy path could not {what} (CUDA IPC between the node's processes; use kind='nccl' where "
                "it is unavailable): ")

    def _open_inboxes(self, capacity, op):
        # Copies into the old inboxes (mine from peers, peers' from me) and copy-outs may still run: finish them
        # before the old mappings go (torch's IPC release only syncs the current stream). Growth is rare, and the
        # one place this engine waits for the device.
        torch.cuda.synchronize(self.device)
        self._inbox, self._peer_inbox = None, {}
        err, handles = None, None
        try:
            inbox = torch.empty(capacity * self.PARITIES, dtype=torch.uint8, device=self.device)
            storage = inbox.untyped_storage()
            # One share per peer: each holds its own reference count on this allocation.
            handles = {p: storage._share_cuda_() for p in range(self.node_size) if p != self.node_rank}
            self._inbox = inbox
        except RuntimeError as exc:
            err = f"cannot share a {capacity * self.PARITIES}-byte inbox: {exc}"
        shared = self._agree_setup(handles, err, f"{op} (inbox handles)", "share its inboxes")
        err = None
        try:
            for p, (their, _) in enumerate(shared):
                if p != self.node_rank:
                    # Opened on this rank's own device (peer access is enabled as needed): one CUDA context per
                    # process, and no reliance on the peers numbering devices as this process does.
                    st = torch.UntypedStorage._new_shared_cuda(self.device.index, *their[self.node_rank][1:])
                    self._peer_inbox[p] = torch.empty(0, dtype=torch.uint8, device=st.device).set_(
                        st, 0, (capacity * self.PARITIES,), (1,))
        except RuntimeError as exc:
            err = f"cannot open a peer's inbox: {exc}"
        self._agree_setup(None, err, f"{op} (inbox mapping)", "open its peers' inboxes")
        # Every peer has dropped its mappings of my previous inbox (before this collective): free it now rather
        # than at some later IPC release.
        torch.cuda.ipc_collect()

    def _exchange(self, send, recv_numel, *, dtype, device, op, matrix, ready, consumer):
        # The calling thread (e.g. the layer's copy thread) may have another current device.
        with torch.cuda.device(self.device):
            return super()._exchange(send, recv_numel, dtype=dtype, device=device, op=op, matrix=matrix,
                                     ready=ready, consumer=consumer)

    def _begin(self, ready):
        self._after(ready)

    def _write(self, p, parity, offset, pieces, dtype):
        self.stream.wait_event(self._peer_consumed[p][parity])
        self._copy_pieces(self._peer_inbox[p], parity * self.capacity + offset, pieces, dtype)

    def _writes_done(self, parity):
        self._written[parity].record(self.stream)

    def _read(self, parity, blocks, dtype, consumer):
        for q, (_, n) in blocks.items():
            if n:
                self.stream.wait_event(self._peer_written[q][parity])
        base = parity * self.capacity
        out = self._copy_out({q: (self._inbox, base + off, n) for q, (off, n) in blocks.items()}, dtype)
        self._consumed[parity].record(self.stream)
        self._hand_over(out.values(), consumer)
        return out

    def _release(self):
        super()._release()
        torch.cuda.synchronize(self.device)
        self._inbox, self._peer_inbox = None, {}
        self._peer_written, self._peer_consumed = {}, {}
