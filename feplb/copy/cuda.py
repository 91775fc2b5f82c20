"""What the CUDA engines share: the copy stream, ordering after ``ready``, per-piece copies, copy-outs into
fresh tensors and the hand-over to the ``consumer`` stream. No host sync anywhere in here."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from feplb.copy.base import CopyEngine

__all__ = ["CudaStreams"]


class CudaStreams(CopyEngine):
    """Mixin base of the CUDA engines. ``self.stream`` is the engine's copy stream, on ``self.device``."""

    device_type = "cuda"

    def __init__(self, control, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError(f"the {self.name} copy path needs a CUDA GPU (use kind='shm' or 'gloo' for CPU "
                               "tensors)")
        dev = None if device is None else torch.device(device)
        if dev is not None and dev.type != "cuda":
            raise ValueError(f"the {self.name} copy path moves CUDA tensors, got device={dev}")
        index = torch.cuda.current_device() if dev is None or dev.index is None else dev.index
        super().__init__(control, torch.device("cuda", index))
        self.stream = torch.cuda.Stream(self.device)

    def _after(self, ready: torch.cuda.Event | None) -> None:
        """The copy stream waits for ``ready`` (default: the calling thread's current stream, now)."""
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)

    def _copy_pieces(self, dst: torch.Tensor, start: int, pieces: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Each piece, in order, into the uint8 buffer ``dst`` from byte ``start``: one ``cudaMemcpyAsync`` each
        (same dtype, both contiguous) on the copy stream."""
        with torch.cuda.stream(self.stream):
            for t in pieces:
                n = t.numel() * dtype.itemsize
                dst[start:start + n].view(dtype).copy_(t.reshape(-1), non_blocking=True)
                # the caching allocator must not hand the piece's memory out again before this copy read it
                t.record_stream(self.stream)
                start += n

    def _copy_out(self, blocks: dict[int, tuple[torch.Tensor, int, int]], dtype: torch.dtype,
                  ) -> dict[int, torch.Tensor]:
        """{q: fresh tensor of blocks[q] = (uint8 buffer, byte offset, elements)}, copied on the copy stream. The
        results are allocated on the copy stream, so the allocator orders their memory's earlier uses before the
        copies."""
        out = {}
        with torch.cuda.stream(self.stream):
            for q, (buf, off, n) in blocks.items():
                t = torch.empty(n, dtype=dtype, device=self.device)
                if n:
                    t.copy_(buf[off:off + n * dtype.itemsize].view(dtype), non_blocking=True)
                out[q] = t
        return out

    def _hand_over(self, results: Iterable[torch.Tensor], consumer: torch.cuda.Stream | None) -> None:
        """``consumer`` (default: the calling thread's current stream) waits for everything enqueued on the copy
        stream so far; the results are marked as used there, for the allocator."""
        consumer = torch.cuda.current_stream(self.device) if consumer is None else consumer
        done = torch.cuda.Event()
        done.record(self.stream)
        consumer.wait_event(done)
        for t in results:
            t.record_stream(consumer)
