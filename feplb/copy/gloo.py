"""``GlooCopyEngine``: the CPU copy path through gloo's TCP pairs (the reference the other CPU engine is checked
against, and the fallback where the node's processes share no memory)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from feplb.copy.base import CopyEngine

__all__ = ["GlooCopyEngine"]


class GlooCopyEngine(CopyEngine):
    """CPU copy path: one ``all_to_all_single`` of flat buffers in the node's gloo group, zero-sized splits for
    pairs that exchange nothing. The pieces for all peers are concatenated into one send buffer (gloo takes one);
    the results are views of one fresh receive buffer. Sizes are agreed like every engine's (one node all-gather)
    unless the caller gives ``matrix``, which is then checked, and the exchanges begun compared (one all-reduce):
    two collectives per exchange."""

    name = "gloo"
    device_type = "cpu"

    def _exchange(self, send, recv_numel, *, dtype, device, op, matrix, ready, consumer):
        m = self._split_matrix(send, recv_numel, dtype, device, op, matrix, ready, consumer)
        if matrix is not None:
            # A known matrix is checked on each rank alone: a rank that left a refused exchange its peers ran (and
            # caught the error) would meet theirs in the all-to-all below, with data of another exchange or sizes
            # gloo aborts the process on. The exchanges begun are compared first, in a collective of fixed size.
            self._in_step(op, "exchanges in step")
        me, g = self.node_rank, self.node_size
        send_splits, recv_splits = m[me].tolist(), m[:, me].tolist()
        parts = [t.reshape(-1) for p in range(g) for t in send.get(p, ())]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
        out = torch.empty(sum(recv_splits), dtype=dtype)
        # as bytes: gloo's all-to-all refuses some element types (int16, float8) that the copy path moves
        size = torch.empty(0, dtype=dtype).element_size()
        with self.control.collective("node", f"copy path ({op})") as group:
            dist.all_to_all_single(out.view(torch.uint8), flat.view(torch.uint8), [n * size for n in recv_splits],
                                   [n * size for n in send_splits], group=group)
        starts = [sum(recv_splits[:q]) for q in range(g)]
        return self._results(recv_numel, lambda q: out[starts[q]:starts[q] + recv_splits[q]])
