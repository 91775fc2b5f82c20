"""``GlooCopyEngine``: the CPU copy path through gloo's TCP pairs (the reference the other CPU engine is checked
against, and the fallback where the node's processes share no memory)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from feplb.copy.base import CopyEngine

__all__ = ["GlooCopyEngine"]

HEADER = 16   # bytes leading each block (the exchange's number): a multiple of every element size, complex128's too


class GlooCopyEngine(CopyEngine):
    """CPU copy path: one ``all_to_all_single`` of flat buffers in the node's gloo group, zero-sized splits for
    pairs that exchange nothing. The pieces for all peers are concatenated into one send buffer (gloo takes one);
    the results are views of one fresh receive buffer (each block led by the exchange's number, checked). Sizes are
    agreed like every engine's (one node all-gather) unless the caller gives ``matrix``, which is then only
    checked: one or two collectives per exchange."""

    name = "gloo"
    device_type = "cpu"

    def _exchange(self, send, recv_numel, *, dtype, device, op, matrix, ready, consumer):
        m = self._split_matrix(send, recv_numel, dtype, device, op, matrix, ready, consumer)
        me, g = self.node_rank, self.node_size
        # As bytes (gloo's all-to-all refuses some element types, int16 or float8, that the copy path moves), each
        # peer's block led by a header of HEADER bytes holding the exchanges this rank began (``calls``): a rank out
        # of step with its peers (it left a refused exchange they ran) is told apart instead of pairing its data
        # with theirs. HEADER is a multiple of every element size, so every block's data stays aligned.
        size = torch.empty(0, dtype=dtype).element_size()
        send_b = [0 if p == me else HEADER + n * size for p, n in enumerate(m[me].tolist())]
        recv_b = [0 if q == me else HEADER + n * size for q, n in enumerate(m[:, me].tolist())]
        head = torch.zeros(HEADER // 8, dtype=torch.int64)
        head[0] = self.calls
        head = head.view(torch.uint8)
        parts = []
        for p in range(g):
            if p != me:
                parts += [head, *(t.reshape(-1).view(torch.uint8) for t in send.get(p, ()))]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(recv_b), dtype=torch.uint8)
        with self.control.collective("node", f"copy path ({op})") as group:
            dist.all_to_all_single(out, flat, recv_b, send_b, group=group)
        starts = [sum(recv_b[:q]) for q in range(g)]
        # (copied out: a header's offset need not be a multiple of 8)
        seen = [int(out[starts[q]:starts[q] + 8].clone().view(torch.int64)) for q in range(g) if q != me]
        if any(c != self.calls for c in seen):
            raise self._out_of_step(op, min(seen + [self.calls]), max(seen + [self.calls]))
        return self._results(recv_numel, lambda q: out[starts[q] + HEADER:starts[q] + recv_b[q]].view(dtype))
