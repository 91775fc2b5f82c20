"""``NcclCopyEngine``: the GPU copy path's fallback where CUDA IPC is unavailable: one NCCL all-to-all inside the
node, on the engine's copy stream. Correct, but NCCL moves the bytes with SM kernels, not copy engines."""

from __future__ import annotations

import torch
import torch.distributed as dist

from feplb.control import group_timeout, guard
from feplb.copy.cuda import CudaStreams

__all__ = ["NcclCopyEngine"]


class NcclCopyEngine(CudaStreams):
    """GPU copy path over NCCL: one ``all_to_all`` (lists: one send tensor per peer, one fresh receive tensor per
    source, uneven sizes) in an NCCL group of the node's ranks (the EP group itself when it is NCCL and one node,
    else one created here, collectively over the node), enqueued on the copy stream after ``ready``. A peer's single
    piece is sent as it is; several are packed first, one ``cudaMemcpyAsync`` each on the copy stream. ``consumer``
    waits on an event. Sizes are agreed over gloo (or read off ``matrix``), never over NCCL. NCCL refuses two ranks
    on one GPU. ``close()`` is local. Untested without a GPU.

    Args:
        control: the EP group's ``Control``.  device: this rank's GPU (default: the current device).
    """

    name = "nccl"

    def __init__(self, control, device: torch.device | None = None):
        super().__init__(control, device)
        ep = control.ep_group
        if "nccl" in str(dist.get_backend(ep)) and control.world_size == control.gpus_per_node:
            self.group = ep
        else:
            timeout = group_timeout(ep)
            kw = {} if timeout is None else {"timeout": timeout}
            self.group = dist.new_group(control.node_ranks, backend="nccl", use_local_synchronization=True, **kw)

    def _exchange(self, send, recv_numel, *, dtype, device, op, matrix, ready, consumer):
        m = self._split_matrix(send, recv_numel, dtype, device, op, matrix, ready, consumer)
        me, g = self.node_rank, self.node_size
        with torch.cuda.device(self.device):
            if not m.any():
                return self._results(recv_numel, lambda q: torch.empty(0, dtype=dtype, device=self.device))
            self._after(ready)
            ins = []
            for p in range(g):
                pieces = [t for t in send.get(p, ()) if t.numel()]
                if len(pieces) == 1:
                    ins.append(pieces[0].reshape(-1))
                    continue
                with torch.cuda.stream(self.stream):
                    flat = torch.empty(int(m[me, p]), dtype=dtype, device=self.device)
                self._copy_pieces(flat.view(torch.uint8), 0, pieces, dtype)
                ins.append(flat)
            with torch.cuda.stream(self.stream):
                outs = [torch.empty(int(m[q, me]), dtype=dtype, device=self.device) for q in range(g)]
                with guard(f"copy path ({op})", self.group):
                    # NCCL's stream waits for the copy stream here, and the copy stream for NCCL's on return
                    # (a stream wait; the host does not wait for the exchange).
                    dist.all_to_all(outs, ins, group=self.group)
            for t in ins:
                t.record_stream(self.stream)
            self._hand_over(outs, consumer)
        return self._results(recv_numel, outs.__getitem__)
