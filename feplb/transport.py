"""Phase-1 transports: the EP all-to-all of rows, data only.

One interface, two implementations:

* ``TorchTransport``: ``torch.distributed.all_to_all_single``: NCCL on CUDA tensors, gloo on CPU tensors, and gloo
  on CUDA tensors staged through pinned host memory (several processes on one GPU without NVSHMEM, where NCCL
  refuses: a correctness path, whose host waits for the rows each call).
* ``NvshmemTransport``: nvshmem4py symmetric buffers, one on-stream put per peer and a barrier on the stream;
  CUDA only, import-guarded (``pip install 'feplb[nvshmem]'``).

Control collectives (counts, agreements, config checks) live in ``feplb.control.Control``; a transport only moves
rows, and uses the control plane for what it must agree on (NVSHMEM's bootstrap and, without a split matrix, its
split exchange). Every blocking call runs under ``guard(op)`` (a stall becomes a ``TimeoutError`` naming it).

Legend: W ranks in the group, M rows sent by this rank, R rows received, D row width.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from feplb.control import Control, _registered, guard
from feplb.recompute import hidden_from_selective_checkpoint

__all__ = ["NVSHMEM_HINT", "NvshmemTransport", "TRANSPORTS", "TorchTransport", "Transport", "make_transport",
           "nvshmem_modules", "nvshmem_shared_gpu"]

NVSHMEM_HINT = "the nvshmem transport needs nvshmem4py and a CUDA GPU: pip install 'feplb[nvshmem]'"
TRANSPORTS = ("torch", "nvshmem")


class Transport:
    """The phase-1 all-to-all over one EP process group. Collective: every rank of the group calls ``all_to_all``
    in the same order with matching splits.

    Args:
        group: the EP process group (None: the default group).
        control: the group's ``Control`` (used by transports that must agree on something; optional otherwise).
    """

    name = "abstract"

    def __init__(self, group: dist.ProcessGroup | None = None, control: Control | None = None):
        if not dist.is_initialized():
            raise RuntimeError("feplb: torch.distributed is not initialised; call init_process_group first")
        self.group = group
        self.control = control
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

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
        Returns:
            recv_RD: [R, D] on send_MD's device (a view of ``out`` when given).

        The transports run hidden from selective activation checkpointing
        (``feplb.recompute.hidden_from_selective_checkpoint``): a transport, no part of the computation (the
        caller's autograd node is), whose staging writes into buffers it just made, which a policy saving every op
        would cache and then refuse. Other dispatch modes see them in a forward, none in a backward pass.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _splits(self, send_MD: torch.Tensor, send_splits, recv_splits, split_matrix,
                ) -> tuple[list[int], list[int], torch.Tensor | None]:
        W = self.world_size
        send_splits, recv_splits = [int(s) for s in send_splits], [int(s) for s in recv_splits]
        if len(send_splits) != W or len(recv_splits) != W:
            raise ValueError(f"send_splits and recv_splits must hold {W} entries (one per rank), got "
                             f"{len(send_splits)} and {len(recv_splits)}")
        if min(send_splits + recv_splits, default=0) < 0:
            raise ValueError(f"splits must be >= 0, got send {send_splits}, recv {recv_splits}")
        if sum(send_splits) != send_MD.shape[0]:
            raise ValueError(f"send_splits sum to {sum(send_splits)} but send_MD has {send_MD.shape[0]} rows")
        if split_matrix is None:
            return send_splits, recv_splits, None
        m = torch.as_tensor(split_matrix, dtype=torch.int64).cpu()
        r = self.rank
        rows = m.tolist() if m.shape == (W, W) else None
        if rows is None or rows[r] != send_splits or [row[r] for row in rows] != recv_splits:
            raise ValueError(f"split_matrix {list(m.shape)} disagrees with this rank's send/recv splits "
                             f"(rank {r}: send {send_splits}, recv {recv_splits})")
        return send_splits, recv_splits, m


def _recv_view(out: torch.Tensor | None, like: torch.Tensor, rows: int) -> torch.Tensor:
    if out is None:
        return like.new_empty((rows, *like.shape[1:]))
    if out.shape[0] < rows or out.shape[1:] != like.shape[1:] or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"receive buffer out of shape {list(out.shape)} ({out.dtype}, {out.device}) cannot hold "
                         f"{rows} rows of {list(like.shape[1:])} ({like.dtype}, {like.device})")
    return out[:rows]


class TorchTransport(Transport):
    """``torch.distributed.all_to_all_single`` (see the module docstring for which backend moves which tensors).

    With CUDA tensors over a group without a CUDA backend (gloo), the rows are staged through pinned host memory:
    device -> host copy, the host waits for it (the one host sync of this path, by construction), gloo exchange,
    host -> device copy enqueued on the current stream without waiting.
    """

    name = "torch"

    def __init__(self, group: dist.ProcessGroup | None = None, control: Control | None = None):
        super().__init__(group, control)
        backend = str(dist.get_backend(group))
        self._cuda_native = "nccl" in backend or "cuda" in backend
        self._cpu_native = "gloo" in backend or "cpu" in backend or "mpi" in backend
        self._backend = backend

    @hidden_from_selective_checkpoint
    def all_to_all(self, send_MD, send_splits, recv_splits, out=None, split_matrix=None):
        send_splits, recv_splits, _ = self._splits(send_MD, send_splits, recv_splits, split_matrix)
        recv = _recv_view(out, send_MD, sum(recv_splits))
        if send_MD.is_cuda and not self._cuda_native:
            return self._staged(send_MD.contiguous(), send_splits, recv_splits, recv)
        if not send_MD.is_cuda and not self._cpu_native:
            raise ValueError(f"the torch transport over a {self._backend!r} group moves CUDA tensors only, got "
                             f"send_MD on {send_MD.device}")
        with guard("phase-1 all_to_all of rows", self.group):
            dist.all_to_all_single(recv, send_MD.contiguous(), recv_splits, send_splits, group=self.group)
        return recv

    def _staged(self, send_MD: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                recv: torch.Tensor) -> torch.Tensor:
        stream = torch.cuda.current_stream(send_MD.device)
        host_send = torch.empty(send_MD.shape, dtype=send_MD.dtype, pin_memory=True)
        host_send.copy_(send_MD, non_blocking=True)
        host_recv = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=True)
        landed = torch.cuda.Event()
        landed.record(stream)
        landed.synchronize()       # gloo reads host_send on this thread, now
        with guard("phase-1 all_to_all of rows (staged through host memory)", self.group):
            dist.all_to_all_single(host_recv, host_send, recv_splits, send_splits, group=self.group)
        # The caching host allocator keeps host_recv alive until this copy has run on the stream.
        recv.copy_(host_recv, non_blocking=True)
        return recv


def nvshmem_modules():
    """(nvshmem.core, nvshmem.bindings), or ImportError with the install hint.

    The runtime calls nvshmem4py's raw bindings (device pointers and stream handles): its high-level calls accept
    only whole nvshmem-allocated tensors, not the slices and ordinary tensors the exchanges move.
    """
    _load_nvshmem_host()
    try:
        import nvshmem.core as core  # type: ignore[import-not-found]
        from nvshmem import bindings  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(NVSHMEM_HINT) from exc
    return core, bindings


def nvshmem_unavailable() -> str | None:
    """Why nvshmem4py cannot be used here, as ``"ErrorType: first line"`` (its import fails: not installed,
    cuda.core too old, a library that does not load), or None when it imports."""
    try:
        nvshmem_modules()
    except Exception as exc:  # noqa: BLE001 - any failure of the third-party import is the answer
        cause = exc.__cause__ or exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return None


@functools.lru_cache(maxsize=1)
def _load_nvshmem_host() -> str | None:
    """Load libnvshmem_host (from the nvidia-nvshmem wheel, else the system) before nvshmem4py's bindings, which
    open it by name and otherwise find it only when another import (torch's) happened to load it. Uses
    ``cuda.pathfinder`` when installed; returns the library's path, or None (no pathfinder, or not found: the
    bindings' own import then says what is missing)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return load_nvidia_dynamic_lib("nvshmem_host").abs_path
    except (RuntimeError, ValueError):  # DynamicLibNotFoundError, or a name this pathfinder does not know
        return None


def nvshmem_shared_gpu(core) -> bool:
    """True when several PEs share one GPU without MPS ("limited MPG"): on-stream signal waits and team barriers
    are unavailable there (nvshmem exits), only puts and ``barrier_all`` work."""
    return int(core.init_status()) == int(core.InitStatus.STATUS_LIMITED_MPG)


# nvshmem as this runtime started it: the transports using it, and whether this runtime initialised it. The last
# one to close finalises it: a layer closed while others live (the first built, in model order) must not.
_NV_LOCK = threading.Lock()
_NV_USERS = 0
_NV_OWNED = False


def nvshmem_initialized(core) -> bool:
    """Whether nvshmem is up in this process (by this runtime or by the application)."""
    up = {int(core.InitStatus.STATUS_IS_INITIALIZED), int(core.InitStatus.STATUS_LIMITED_MPG),
          int(core.InitStatus.STATUS_FULL_MPG)}
    return int(core.init_status()) in up


def _cuda_core_device(index: int):
    try:
        from cuda.core import Device  # type: ignore[import-not-found]
    except ImportError:
        from cuda.core.experimental import Device  # type: ignore[import-not-found]
    return Device(index)


class NvshmemTransport(Transport):
    """All-to-all through nvshmem4py symmetric memory: each rank stages its rows in a symmetric send buffer (puts
    to PEs behind a network need a symmetric source), puts its block for rank d straight into d's receive buffer
    at the offset every rank reads off the split matrix, then a ``barrier_all`` on the stream (the one barrier that
    also works with several PEs on one GPU).

    The symmetric buffers grow collectively, by the same rule on every rank (every rank holds the same matrix),
    when a micro-batch needs more rows; rows are never dropped. nvshmem is bootstrapped with a unique id that rank 0
    hands out over the control group (gloo), unless the application initialised it already. CUDA only; the group
    must be the whole job (PE numbers are global ranks). ``close()`` (collective) frees the buffers; the last
    transport of the process to close finalises nvshmem if this runtime initialised it (close every nvshmem copy
    engine first: a layer closes its own before its transport).

    Args:
        group: the EP group (None or one spanning the whole job).  control: its ``Control``; None makes one
            (collective) that ``close()`` closes.
    """

    name = "nvshmem"

    def __init__(self, group: dist.ProcessGroup | None = None, control: Control | None = None):
        self._nv, self._bind = nvshmem_modules()
        if not torch.cuda.is_available():
            raise RuntimeError(NVSHMEM_HINT)
        super().__init__(group, control)
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("feplb: the nvshmem transport spans the whole job; pass group=None")
        self._own_control = control is None
        if control is None:
            self.control = Control(group, self.world_size)
        self._uses_nv = False
        self._buf: torch.Tensor | None = None   # flat uint8 symmetric receive buffer
        self._sbuf: torch.Tensor | None = None  # flat uint8 symmetric send buffer, same capacity
        self._init_nvshmem()

    def _init_nvshmem(self) -> None:
        global _NV_USERS, _NV_OWNED
        nv = self._nv
        with _NV_LOCK:
            if not nvshmem_initialized(nv):   # else initialised by the application or another layer: share it
                dev = _cuda_core_device(torch.cuda.current_device())
                dev.set_current()
                uid = nv.get_unique_id() if self.rank == 0 else None
                uid = self.control.all_gather_object(uid, "group", "nvshmem bootstrap (unique id from rank 0)")[0]
                nv.init(device=dev, uid=uid, rank=self.rank, nranks=self.world_size, initializer_method="uid")
                _NV_OWNED = True
            _NV_USERS += 1
            self._uses_nv = True

    def _ensure(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buf is None or self._buf.numel() < nbytes:
            if self._buf is not None:
                # collective like the allocation; no put may still read or write the old buffers, on any stream
                # (the compute stream's calls and a worker thread's both use them)
                torch.cuda.synchronize(self._buf.device)
                self._nv.free_tensor(self._buf)
                self._nv.free_tensor(self._sbuf)
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            self._buf = self._nv.interop.torch.tensor((cap,), dtype=torch.uint8)
            self._sbuf = self._nv.interop.torch.tensor((cap,), dtype=torch.uint8)
        return self._buf, self._sbuf

    def close(self) -> None:
        """Free the symmetric buffers (collective); the last transport of the process to close finalises nvshmem
        if this runtime initialised it (collective)."""
        global _NV_USERS, _NV_OWNED
        if self._buf is not None:
            torch.cuda.synchronize()
            self._nv.free_tensor(self._buf)
            self._nv.free_tensor(self._sbuf)
            self._buf = self._sbuf = None
        if self._uses_nv:
            self._uses_nv = False
            with _NV_LOCK:
                _NV_USERS -= 1
                last = _NV_USERS == 0 and _NV_OWNED
                if last:
                    _NV_OWNED = False
                    self._nv.finalize()
        if self._own_control:
            self.control.close()

    @hidden_from_selective_checkpoint
    def all_to_all(self, send_MD, send_splits, recv_splits, out=None, split_matrix=None):
        if not send_MD.is_cuda:
            raise ValueError(f"the nvshmem transport moves CUDA tensors only, got send_MD on {send_MD.device}")
        send_splits, recv_splits, all_splits = self._splits(send_MD, send_splits, recv_splits, split_matrix)
        row_bytes = math.prod(send_MD.shape[1:]) * send_MD.element_size()
        if all_splits is None:
            # My block inside rank d's buffer starts after the rows that ranks < me send to d: one host all-gather
            # of the split rows over the control group.
            all_splits = self.control.all_gather(torch.tensor(send_splits, dtype=torch.int64),
                                                 "nvshmem all_to_all: split exchange")
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


class Shares:
    """What the layers of a process share, by key (a transport's or a copy path's buffers, which grow to the
    largest exchange and never shrink: one per layer summed those over the model's depth). The first user makes it,
    the last to give it back (``close()`` of the layers) closes it. Every rank of a group builds and closes its
    layers in the same order, so all of them find a shared object, or make it together (collective), alike; a layer
    never closed keeps its share for good (a garbage collection, which happens at different times on different
    ranks, must not decide that). The layers' exchanges never overlap: a layer's forward and backward wait for
    their own before returning."""

    def __init__(self) -> None:
        self._held: dict[tuple, list] = {}
        # [object, close, users] of a process group since destroyed: no key reaches them, their users still count
        self._orphans: list[list] = []

    def take(self, key: tuple, make: Callable[[], tuple[Any, Callable[[], None]]]) -> Any:
        """The object under ``key`` (which may hold process groups), made by ``make() -> (object, its close)`` if
        there is none. Objects of a process group since destroyed (on every rank) are taken off their keys first:
        no key can reach them again, and their users keep what they hold (the last of them to give it back still
        closes it)."""
        for k in [k for k in self._held if any(isinstance(x, dist.ProcessGroup) and not _registered(x) for x in k)]:
            self._orphans.append(self._held.pop(k))
        held = self._held.get(key)
        if held is None:
            obj, close = make()
            held = self._held[key] = [obj, close, 0]
        held[2] += 1
        return held[0]

    def give(self, obj: Any) -> bool:
        """One user less of ``obj``; the last one closes it. False: ``obj`` is not shared here."""
        # (under its key, or among the orphans: where it is, and its key or index there)
        found = next(((self._held, k) for k, h in self._held.items() if h[0] is obj), None) or \
            next(((self._orphans, i) for i, h in enumerate(self._orphans) if h[0] is obj), None)
        if found is None:
            return False
        where, at = found
        held = where[at]
        held[2] -= 1
        if held[2] <= 0:
            del where[at]
            held[1]()
        return True

    def __len__(self) -> int:
        return len(self._held)


_SHARED_TRANSPORTS = Shares()


def shared_transport(name: str, group: dist.ProcessGroup, control: Control) -> Transport:
    """``make_transport``'s transport for a layer: the NVSHMEM one (symmetric buffers) shared by the layers of this
    process over the same group, with its own Control (collective when made); the torch one, which holds no
    buffers, made anew. Give it back with :func:`release_transport`."""
    if name != "nvshmem":
        return make_transport(name, group, control)

    def make() -> tuple[Transport, Callable[[], None]]:
        t = NvshmemTransport(group, None)
        return t, t.close

    return _SHARED_TRANSPORTS.take((name, group), make)


def release_transport(transport: Transport) -> None:
    """A layer's :func:`shared_transport` given back (closed with its last user; one not shared, at once)."""
    if not _SHARED_TRANSPORTS.give(transport):
        transport.close()


def make_transport(name: str, group: dist.ProcessGroup | None = None, control: Control | None = None) -> Transport:
    """'torch' -> TorchTransport, 'nvshmem' -> NvshmemTransport (ImportError with the install hint if missing)."""
    if name == "torch":
        return TorchTransport(group, control)
    if name == "nvshmem":
        return NvshmemTransport(group, control)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
