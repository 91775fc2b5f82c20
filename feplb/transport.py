"""Phase-1 transports: the EP all-to-all of rows and the small collectives the layer needs.

One interface, two implementations:

* ``TorchTransport``: ``torch.distributed`` (gloo on CPU tensors, NCCL on CUDA tensors).
* ``NvshmemTransport``: nvshmem4py symmetric buffers, one on-stream put per peer and a barrier on the stream;
  CUDA only, import-guarded (``pip install 'feplb[nvshmem]'``).

Every blocking call runs under ``guard(op)``, which turns a backend timeout into a ``TimeoutError`` naming the
operation and the rank, so a peer that dies or stalls fails the step with a readable message instead of hanging
(the timeout itself is the process group's, set by ``init_process_group(timeout=...)``).

Legend: W ranks in the group, E experts, M rows sent by this rank, R rows received, D row width.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["NVSHMEM_HINT", "NvshmemTransport", "TorchTransport", "Transport", "guard", "make_transport"]

NVSHMEM_HINT = "the nvshmem transport needs nvshmem4py and a CUDA GPU: pip install 'feplb[nvshmem]'"

_TIMEOUT_MARKERS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer")


@contextlib.contextmanager
def guard(op: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Re-raise a communication failure inside the block as ``TimeoutError`` (stall) or ``RuntimeError`` (peer gone)
    whose message names ``op`` and this rank."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).lower()
        if not any(m in text for m in _TIMEOUT_MARKERS):
            raise
        rank = dist.get_rank() if dist.is_initialized() else -1
        size = dist.get_world_size(group) if dist.is_initialized() else -1
        kind = TimeoutError if ("timed out" in text or "timeout" in text) else RuntimeError
        raise kind(f"feplb: {op} failed on global rank {rank} (group of {size}): a peer died or stalled "
                   f"past the process group's timeout; backend said: {str(exc).splitlines()[0][:300]}") from exc


class Transport:
    """Collectives over one EP process group. All methods are collective: every rank of the group calls them in the
    same order with matching arguments."""

    name = "abstract"

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("feplb: torch.distributed is not initialised; call init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """counts_E int64 [E] on this rank -> counts_WE int64 [W, E] (row s from rank s), on counts_E's device."""
        with guard("all_gather of expert counts", self.group):
            t = counts_E.to(torch.int64).to(collective_device(self.group)).contiguous()
            return all_gather_stack(t, self.group).to(counts_E.device)

    def all_to_all(self, send_MD: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                   out: torch.Tensor | None = None, split_matrix: torch.Tensor | None = None) -> torch.Tensor:
        """Rows send_MD[sum(send_splits[:d]) : ...] go to rank d; returns recv_RD with rank s's rows at block s.

        Args:
            send_MD: [M, D] rows grouped by destination rank (any dtype).
            send_splits: W ints summing to M.  recv_splits: W ints, rows coming from each rank.
            out: optional receive buffer with at least R rows (R = sum(recv_splits)); a too-small one raises.
            split_matrix: optional int64 CPU [W, W], rows rank s sends rank d, identical on every rank (the
                caller's guarantee, e.g. derived from all-gathered expert counts); transports that would otherwise
                exchange the splits skip that collective. Row ``rank`` must equal send_splits and column ``rank``
                recv_splits (checked locally).
        """
        raise NotImplementedError

    def _check_matrix(self, split_matrix: torch.Tensor | None, send_splits: list[int], recv_splits: list[int],
                      ) -> torch.Tensor | None:
        if split_matrix is None:
            return None
        m = torch.as_tensor(split_matrix, dtype=torch.int64).cpu()
        W, r = self.world_size, self.rank
        if m.shape != (W, W) or m[r].tolist() != send_splits or m[:, r].tolist() != recv_splits:
            raise ValueError(f"split_matrix {list(m.shape)} disagrees with this rank's send/recv splits "
                             f"(rank {r}: send {send_splits}, recv {recv_splits})")
        return m

    def all_reduce_min(self, flags: torch.Tensor, group: dist.ProcessGroup | None, op: str) -> torch.Tensor:
        """Elementwise MIN of a small int64 CPU tensor over ``group`` (agreement on readiness/consistency)."""
        out = flags.to(collective_device(group), copy=True)
        with guard(op, group):
            dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group)
        return out.cpu()

    def check_same(self, blob: bytes, what: str,
                   hint: str = "every rank of the EP group must build the layer with the same config") -> None:
        """Raise ValueError on every rank unless ``blob`` is byte-identical on all ranks (one all_gather of a hash)."""
        digest = int.from_bytes(hashlib.sha256(blob).digest()[:7], "little")
        mine = torch.tensor([digest], dtype=torch.int64)
        dev = collective_device(self.group)
        with guard(f"consistency check of {what}", self.group):
            allh = all_gather_stack(mine.to(dev), self.group).reshape(-1).cpu()
        bad = [r for r in range(self.world_size) if int(allh[r]) != digest]
        if bad:
            raise ValueError(f"feplb: {what} differs across ranks: rank {self.rank} disagrees with ranks {bad}; "
                             f"{hint}")


def nvshmem_modules():
    """(nvshmem.core, nvshmem.bindings), or ImportError with the install hint.

    The layer calls nvshmem4py's raw bindings (device pointers and stream handles): its high-level calls accept
    only whole nvshmem-allocated tensors, not the slices and ordinary tensors the exchanges move.
    """
    try:
        import nvshmem.core as core  # type: ignore[import-not-found]
        from nvshmem import bindings  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(NVSHMEM_HINT) from exc
    return core, bindings


def nvshmem_shared_gpu(core) -> bool:
    """True when several PEs share one GPU without MPS ("limited MPG"): on-stream signal waits and team barriers
    are unavailable there (nvshmem exits), only puts and ``barrier_all`` work."""
    return int(core.init_status()) == int(core.InitStatus.STATUS_LIMITED_MPG)


def _cuda_core_device(index: int):
    try:
        from cuda.core import Device  # type: ignore[import-not-found]
    except ImportError:
        from cuda.core.experimental import Device  # type: ignore[import-not-found]
    return Device(index)


def _recv_view(out: torch.Tensor | None, like: torch.Tensor, rows: int) -> torch.Tensor:
    if out is None:
        return like.new_empty((rows, *like.shape[1:]))
    if out.shape[0] < rows or out.shape[1:] != like.shape[1:] or out.dtype != like.dtype:
        raise ValueError(f"receive buffer of shape {list(out.shape)} ({out.dtype}) cannot hold {rows} rows of "
                         f"{list(like.shape[1:])} ({like.dtype})")
    return out[:rows]


def all_gather_stack(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[*S] on every rank -> [W, *S] stacked in group-rank order (works on gloo and NCCL)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.stack(parts)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class TorchTransport(Transport):
    """``torch.distributed.all_to_all_single``: gloo for CPU tensors, NCCL for CUDA tensors."""

    name = "torch"

    def all_to_all(self, send_MD, send_splits, recv_splits, out=None, split_matrix=None):
        send_splits, recv_splits = [int(s) for s in send_splits], [int(s) for s in recv_splits]
        if sum(send_splits) != send_MD.shape[0]:
            raise ValueError(f"send_splits sum to {sum(send_splits)} but send_MD has {send_MD.shape[0]} rows")
        self._check_matrix(split_matrix, send_splits, recv_splits)
        recv = _recv_view(out, send_MD, sum(recv_splits))
        with guard("phase-1 all_to_all of rows", self.group):
            dist.all_to_all_single(recv, send_MD.contiguous(), recv_splits, send_splits, group=self.group)
        return recv


class NvshmemTransport(Transport):
    """All-to-all through nvshmem4py symmetric memory: each rank stages its rows in a symmetric send buffer (puts
    to PEs behind a network need a symmetric source), puts its block for rank d straight into d's receive buffer
    at the offset every rank reads off the split matrix, then a ``barrier_all`` on the stream (the one barrier that
    also works with several PEs on one GPU).

    The symmetric buffers grow collectively, by the same rule on every rank (every rank holds the same matrix),
    when a micro-batch needs more rows; rows are never dropped. CUDA only; ``close()`` frees the buffers and, if this
    transport initialised nvshmem, finalises it.
    """

    name = "nvshmem"

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__(group)
        self._nv, self._bind = nvshmem_modules()
        if not torch.cuda.is_available():
            raise RuntimeError(NVSHMEM_HINT)
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("feplb: the nvshmem transport spans the whole world; pass group=None")
        self._owns_init = False
        self._init_nvshmem()
        self._buf: torch.Tensor | None = None   # flat uint8 symmetric receive buffer
        self._sbuf: torch.Tensor | None = None  # flat uint8 symmetric send buffer, same capacity

    def _init_nvshmem(self) -> None:
        nv = self._nv
        up = {int(nv.InitStatus.STATUS_IS_INITIALIZED), int(nv.InitStatus.STATUS_LIMITED_MPG),
              int(nv.InitStatus.STATUS_FULL_MPG)}
        if int(nv.init_status()) in up:
            return   # initialised by the application (or another layer): share it
        dev = _cuda_core_device(torch.cuda.current_device())
        dev.set_current()
        uid = nv.get_unique_id(empty=True)
        if self.rank == 0:
            uid = nv.get_unique_id()
        box = [uid if self.rank == 0 else None]
        with guard("nvshmem bootstrap (broadcast of the unique id)", self.group):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
        nv.init(device=dev, uid=box[0], rank=self.rank, nranks=self.world_size, initializer_method="uid")
        self._owns_init = True

    def _ensure(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buf is None or self._buf.numel() < nbytes:
            if self._buf is not None:
                # collective like the allocation; no put may still read or write the old buffers
                torch.cuda.current_stream().synchronize()
                self._nv.free_tensor(self._buf)
                self._nv.free_tensor(self._sbuf)
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            self._buf = self._nv.interop.torch.tensor((cap,), dtype=torch.uint8)
            self._sbuf = self._nv.interop.torch.tensor((cap,), dtype=torch.uint8)
        return self._buf, self._sbuf

    def close(self) -> None:
        """Free the symmetric buffers (collective) and finalise nvshmem if this transport initialised it."""
        if self._buf is not None:
            torch.cuda.synchronize()
            self._nv.free_tensor(self._buf)
            self._nv.free_tensor(self._sbuf)
            self._buf = self._sbuf = None
        if self._owns_init:
            self._nv.finalize()
            self._owns_init = False

    def all_to_all(self, send_MD, send_splits, recv_splits, out=None, split_matrix=None):
        if not send_MD.is_cuda:
            raise ValueError(f"the nvshmem transport moves CUDA tensors only, got a tensor on {send_MD.device}")
        send_splits, recv_splits = [int(s) for s in send_splits], [int(s) for s in recv_splits]
        if sum(send_splits) != send_MD.shape[0]:
            raise ValueError(f"send_splits sum to {sum(send_splits)} but send_MD has {send_MD.shape[0]} rows")
        row_bytes = math.prod(send_MD.shape[1:]) * send_MD.element_size()
        all_splits = self._check_matrix(split_matrix, send_splits, recv_splits)
        if all_splits is None:
            # My block inside rank d's buffer starts after the rows that ranks < me send to d, learnt from one
            # all_gather of the split matrix (on the control backend's device: gloo keeps it on the host).
            splits = torch.tensor(send_splits, dtype=torch.int64, device=collective_device(self.group))
            with guard("nvshmem all_to_all: split exchange", self.group):
                all_splits = all_gather_stack(splits, self.group).cpu()
        # Every rank needs the same buffer size (symmetric allocation): the max over ranks of rows sent or received,
        # which every rank reads off the same matrix.
        rows = max(int(all_splits.sum(0).max()), int(all_splits.sum(1).max())) if all_splits.numel() else 0
        buf, sbuf = self._ensure(rows * row_bytes)
        h = torch.cuda.current_stream().cuda_stream
        src = send_MD.contiguous().view(torch.uint8).reshape(-1)
        sbuf[: src.numel()].copy_(src)
        start = 0
        for d in range(self.world_size):
            n = send_splits[d] * row_bytes
            if n:
                off = int(all_splits[: self.rank, d].sum()) * row_bytes
                self._bind.putmem_on_stream(buf.data_ptr() + off, sbuf.data_ptr() + start, n, d, h)
            start += n
        self._bind.barrier_all_on_stream(h)
        total = sum(recv_splits)
        res = _recv_view(out, send_MD, total)
        res.copy_(buf[: total * row_bytes].view(send_MD.dtype).reshape(total, *send_MD.shape[1:]))
        # The buffers are reused by the next call; no rank may overwrite them before everyone copied out.
        self._bind.barrier_all_on_stream(h)
        return res


def make_transport(name: str, group: dist.ProcessGroup | None = None) -> Transport:
    """'torch' -> TorchTransport, 'nvshmem' -> NvshmemTransport (ImportError with the install hint if missing)."""
    if name == "torch":
        return TorchTransport(group)
    if name == "nvshmem":
        return NvshmemTransport(group)
    raise ValueError(f"transport must be 'torch' or 'nvshmem', got {name!r}")
