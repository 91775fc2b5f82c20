"""``NcclCopyEngine``: the GPU copy path's fallback where CUDA IPC is unavailable: one NCCL all-to-all inside the
node, on the engine's copy stream. Correct, but NCCL moves the bytes with SM kernels, not copy engines."""

from __future__ import annotations

import torch
import torch.distributed as dist

from feplb.control import group_timeout, guard
from feplb.copy.cuda import CudaStreams

__all__ = ["NcclCopyEngine"]


class NcclCopyEngine(CudaStreams):
    """GPU copy path over NCCL: ``all_to_all_single`` in an NCCL group of the node's ranks (the EP group itself
    when it is NCCL and one node, else one created here, collectively over the node), enqueued on the copy stream
    after ``ready``. The pieces are packed into one send buffer with one ``cudaMemcpyAsync`` each on the copy
    stream; the results are views of one fresh receive buffer; ``consumer`` waits on an event. Sizes are agreed
    over gloo (or read off ``matrix``), never over NCCL. NCCL refuses two ranks on one GPU. ``close()`` is local.
    Untested without a GPU.

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
        send_splits, recv_splits = m[me].tolist(), m[:, me].tolist()
        starts = [sum(recv_splits[:q]) for q in range(g)]
        with torch.cuda.device(self.device):
            if not m.any():
                return self._results(recv_numel, lambda q: torch.empty(0, dtype=dtype, device=self.device))
            self._after(ready)
            with torch.cuda.stream(self.stream):
                flat = torch.empty(sum(send_splits), dtype=dtype, device=self.device)
            flat_bytes = flat.view(torch.uint8)
            self._copy_pieces(flat_bytes, 0, [t for p in range(g) for t in send.get(p, ()) if t.numel()], dtype)
            with torch.cuda.stream(self.stream):
                out = torch.empty(sum(recv_splits), dtype=dtype, device=self.device)
                with guard(f"copy path ({op})", self.group):
                    # NCCL's stream waits for the copy stream here, and the copy stream for NCCL's on return
                    # (a stream wait; the host does not wait for the exchange).
                    dist.all_to_all_single(out, flat, recv_splits, send_splits, group=self.group)
            flat.record_stream(self.stream)
            self._hand_over([out], consumer)
        return self._results(recv_numel, lambda q: out[starts[q]:starts[q] + recv_splits[q]])
