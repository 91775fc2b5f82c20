"""Phase-2 copy path: flat buffers between the GPUs (or CPU processes) of one node, behind one interface.

Engines, by ``make_copy_engine(..., kind=...)``:

* ``"gloo"`` ``GlooCopyEngine`` (CPU tensors): one ``all_to_all_single`` inside the node's gloo subgroup; zero-sized
  splits for pairs that exchange nothing. Every byte goes through gloo's TCP pairs.
* ``"shm"`` ``ShmCopyEngine`` (CPU tensors): peer tensors in POSIX shared memory; see the protocol below.
* ``"ipc"`` ``IpcCopyEngine`` (CUDA tensors): peer tensors shared through CUDA IPC; a sender's writes are
  ``cudaMemcpyAsync`` calls into the peer's memory on a dedicated copy stream, i.e. copy-engine DMA over NVLink
  between GPUs, no SM work; ordering across processes by interprocess CUDA events; control plane over gloo.
* ``"nvshmem"`` ``CudaCopyEngine`` (CUDA tensors): each GPU owns a symmetric inbox (nvshmem4py); a sender puts its
  blocks straight into the peer's inbox with one on-stream ``putmem_signal`` per peer on a dedicated copy stream,
  ordered after the producer by an event; the receiver's compute stream waits on the signal (nvshmem4py's raw
  bindings: its high-level calls take only whole nvshmem tensors). One node = the whole job, one GPU per process
  (signal waits do not exist with several processes on one GPU); the inbox reuse is ordered by ``barrier_all``.
* ``"nccl"`` ``CudaCopyEngine`` without nvshmem: ``all_to_all_single`` over NCCL inside the node subgroup on the
  dedicated stream (correct, but that copy runs on SMs).

Peer-tensor protocol (``PeerInboxEngine``, shared by ``"shm"`` and ``"ipc"``). Each rank of the node owns an inbox
of two halves (parity 0 and 1) that every peer of the node addresses directly; exchange number n (counted alike on
every rank, exchanges without any traffic in the node excepted) uses half n % 2. One exchange:

1. the G x G split matrix (elements each node rank sends each other one), from one of two sources:

   * agreed (``matrix=None``): an all-gather of one small row per rank (its send and receive sizes, element size,
     argument status) in the node's gloo group; every rank checks the whole exchange, so bad arguments on one rank
     raise ValueError on all of them;
   * known (``matrix=`` given, identical on every rank of the node: the caller's guarantee): no collective; each
     rank checks its own arguments against its row and column, and raises ValueError alone (before any collective:
     its peers then stop at the end barrier, with a TimeoutError after the group's timeout);

2. growth, when the largest receiver needs more than a half holds: every rank derives the same power-of-two
   capacity from the same matrix, so the node regrows together (a collective) and nothing is dropped;
3. writes: each sender copies its block straight into the receiver's inbox half, at the offset the matrix gives
   (blocks ordered by sender rank);
4. end of writes: a barrier in the node's gloo group (plus, on CUDA, events that order the copies themselves);
5. read: each receiver copies its part out (the half is reused two exchanges later).

Why one barrier per exchange suffices (the two halves): a writer enters exchange n+2, and writes into half n % 2,
only after leaving the end barrier of exchange n+1, which every reader enters only after it finished reading
exchange n (reads come before ``exchange`` returns); exchange n+1 itself writes into the other half, which nobody
reads before the end barrier of n+1. Exchange n's reads see all of n's writes because of n's end barrier. So the
start barrier the all-gather used to provide is not needed, and the known-matrix path costs one control collective.
The price is memory: every inbox holds two halves, twice the largest exchange's receive size (rounded up to a
power of two).

Every wait runs under ``guard``: a peer that stalls or dies fails the step with a ``TimeoutError`` naming it after
the process group's timeout, instead of hanging.

Every rank of a node calls ``exchange`` in the same order (it is collective inside the node); pairs across nodes are
never handled here (the layer sends those through the transport).

Legend: G ranks per node (peers are node ranks 0..G-1), N elements of a flat buffer.
"""

from __future__ import annotations

import contextlib
import mmap
import numbers
import operator
import os
import secrets
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist

from feplb.transport import (
    NVSHMEM_HINT,
    all_gather_stack,
    collective_device,
    guard,
    nvshmem_modules,
    nvshmem_shared_gpu,
)

__all__ = ["COPY_KINDS", "SHM_DIR", "CopyEngine", "CudaCopyEngine", "GlooCopyEngine", "IpcCopyEngine",
           "PeerInboxEngine", "PeerMemoryUnavailable", "ShmCopyEngine", "make_copy_engine", "make_node_groups"]

COPY_KINDS = ("auto", "gloo", "shm", "nvshmem", "ipc", "nccl")
# Where ShmCopyEngine puts its inboxes unless told otherwise (a tmpfs shared by the processes of a node).
SHM_DIR = "/dev/shm"
_CPU_KINDS = ("gloo", "shm")
_CUDA_KINDS = ("nvshmem", "ipc", "nccl")


class PeerMemoryUnavailable(RuntimeError):
    """Peer memory (shared memory files or CUDA IPC) could not be set up on some rank of the node.

    Raised on every rank of the node together (the failure is agreed collectively), so a caller may fall back to
    another engine on all of them."""


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
        if dist.get_world_size(node_group) != node_size:
            raise ValueError(f"node_size ({node_size}) must equal the size of node_group "
                             f"({dist.get_world_size(node_group)})")

    def exchange(self, send: dict[int, torch.Tensor], recv_numel: dict[int, int], *, dtype: torch.dtype,
                 device: torch.device, op: str, matrix=None) -> dict[int, torch.Tensor]:
        """Send ``send[p]`` (any shape, converted to 1-D ``dtype``) to node peer ``p``; receive ``recv_numel[q]``
        elements from each q.

        Returns {q: 1-D ``dtype`` tensor of recv_numel[q] elements} for every q in ``recv_numel`` or sending to this
        rank; the tensors are this rank's own (never views of a buffer the engine reuses). Collective inside the
        node; ``op`` names the step in timeout errors. A peer may appear in neither dict (nothing exchanged with it).

        matrix: optional G x G element counts of the whole exchange (``matrix[i][j]`` elements node rank i sends
            node rank j; a tuple of tuples or an integer array), identical on every rank of the node, and given on
            every rank of the node or on none of them (the caller's guarantee). This rank's ``send`` and
            ``recv_numel`` must match its row and column: a ValueError otherwise, raised on this rank alone before
            any collective. Peer-tensor engines then skip the size agreement (one control collective per exchange
            instead of two, see the module docstring); the others only check.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds (shared memory, peer mappings). Idempotent; local to this rank unless the
        engine's docstring says otherwise. The engine must not be used afterwards."""

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _split(self, out: torch.Tensor, recv_splits: list[int], recv_numel: dict[int, int]) -> dict[int, torch.Tensor]:
        """The flat receive buffer ``out`` (peers in node order) -> {q: its part} for every peer asked for."""
        res, start = {}, 0
        for q in range(self.node_size):
            if recv_splits[q] or q in recv_numel:
                res[q] = out[start:start + recv_splits[q]]
            start += recv_splits[q]
        return res

    def _bad_peer(self, send: dict[int, torch.Tensor], recv_numel: dict[int, int]) -> str | None:
        """Why these arguments are invalid on this rank, or None."""
        for p in list(send) + list(recv_numel):
            if not isinstance(p, numbers.Integral) or isinstance(p, bool) or not 0 <= p < self.node_size \
                    or p == self.node_rank:
                return (f"copy-path peer must be another GPU of the node (0..{self.node_size - 1}, "
                        f"not {self.node_rank}), got {p!r}")
        for p, n in recv_numel.items():
            try:
                ok = operator.index(n) >= 0
            except TypeError:
                ok = False
            if not ok:
                return f"recv_numel[{p}] must be an int >= 0, got {n!r}"
        return None

    def _check_tensor(self, p: int, t: torch.Tensor) -> str | None:
        """Why ``send[p]`` cannot be sent by this engine, or None."""
        return None if isinstance(t, torch.Tensor) else f"send[{p}] must be a tensor, got {type(t).__name__}"

    def _known_matrix(self, send: dict[int, torch.Tensor], recv_numel: dict[int, int], matrix, dtype: torch.dtype,
                      op: str) -> np.ndarray:
        """The caller's split matrix as int64 [G, G] after the local checks (no collective): the arguments, and that
        this rank's sends are its row and its receives its column."""
        g, me = self.node_size, self.node_rank
        bad = self._bad_peer(send, recv_numel)
        if bad is None:
            bad = next((m for p, t in send.items() if (m := self._check_tensor(p, t))), None)
        if bad is None and not isinstance(dtype, torch.dtype):
            bad = f"dtype must be a torch.dtype, got {dtype!r}"
        if bad is not None:
            raise ValueError(f"copy path ({op}): {bad}")
        try:
            m = np.asarray(matrix)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"copy path ({op}): matrix must be a {g} x {g} array of element counts: {exc}") from exc
        if m.shape != (g, g) or not (np.issubdtype(m.dtype, np.integer) or m.dtype == np.bool_ and not m.any()):
            raise ValueError(f"copy path ({op}): matrix must be a {g} x {g} array of integer element counts, got "
                             f"shape {m.shape} of {m.dtype}")
        m = m.astype(np.int64, copy=False)
        if (m < 0).any() or m.diagonal().any():
            raise ValueError(f"copy path ({op}): matrix must hold counts >= 0 with a zero diagonal (no rank sends "
                             f"to itself), got {m.tolist()}")
        for p in range(g):
            if p == me:
                continue
            n = send[p].numel() if p in send else 0
            if n != m[me, p]:
                raise ValueError(f"copy path ({op}): node rank {me} sends {n} elements to node rank {p} but "
                                 f"matrix[{me}][{p}] is {int(m[me, p])}; send must match this rank's row")
            n = int(recv_numel.get(p, 0))
            if n != m[p, me]:
                raise ValueError(f"copy path ({op}): node rank {me} expects {n} elements from node rank {p} but "
                                 f"matrix[{p}][{me}] is {int(m[p, me])}; recv_numel must match this rank's column")
        return m

    def _layout(self, send: dict[int, torch.Tensor], recv_numel: dict[int, int], matrix=None, dtype=None,
                op: str = "") -> tuple[list[int], list[int]]:
        if matrix is not None:
            m = self._known_matrix(send, recv_numel, matrix, dtype, op)
            return m[self.node_rank].tolist(), m[:, self.node_rank].tolist()
        bad = self._bad_peer(send, recv_numel)
        if bad:
            raise ValueError(bad)
        send_splits = [send[p].numel() if p in send else 0 for p in range(self.node_size)]
        recv_splits = [int(recv_numel.get(p, 0)) for p in range(self.node_size)]
        return send_splits, recv_splits


class GlooCopyEngine(CopyEngine):
    """CPU copy path: ``all_to_all_single`` of flat buffers inside the node's gloo subgroup (one collective per
    exchange; a known ``matrix`` is only checked)."""

    name = "gloo"

    def exchange(self, send, recv_numel, *, dtype, device, op, matrix=None):
        send_splits, recv_splits = self._layout(send, recv_numel, matrix, dtype, op)
        parts = [send[p].reshape(-1).to(dtype) for p in range(self.node_size) if p in send]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        with guard(f"copy path ({op})", self.node_group):
            dist.all_to_all_single(out, flat, recv_splits, send_splits, group=self.node_group)
        return self._split(out, recv_splits, recv_numel)


def _gloo_group(node_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group over the node's ranks for the control plane: ``node_group`` itself when it already speaks gloo,
    else a new one created by the node's ranks only (no NCCL kernel ever runs for control)."""
    if "gloo" in str(dist.get_backend(node_group)):
        return node_group
    ranks = dist.get_process_group_ranks(node_group) if node_group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


class PeerInboxEngine(CopyEngine):
    """The peer-tensor protocol of the module docstring; backends provide the inboxes and the data movement.

    Attributes:
        out_device: where received tensors live.
        capacity: bytes one exchange can deliver to a rank, i.e. of each half of every rank's inbox (the same on
            all ranks of the node; a power of two). Every inbox holds ``PARITIES * capacity`` bytes.
        grows: how many times the inboxes were (re)built, setup included.
        exchanges: exchanges that used the inboxes so far (the same on all ranks; its parity picks the half).
    """

    PARITIES = 2
    min_capacity = 1 << 16
    out_device = torch.device("cpu")

    def __init__(self, node_group, node_size: int):
        super().__init__(node_group, node_size)
        self.control = _gloo_group(node_group)
        self.capacity = 0
        self.grows = 0
        self.exchanges = 0
        self._closed = False

    def _agree_setup(self, item: object, err: str | None, stage: str, what: str) -> list:
        """One setup step's (item, error) from every rank of the node (collective, under ``guard(stage)``).

        Raises PeerMemoryUnavailable on every rank together when any rank failed (``what`` it could not do), so no
        rank goes on into a collective its peers never reach. Returns the gathered (item, error) pairs.
        """
        got = [None] * self.node_size
        with guard(stage, self.control):
            dist.all_gather_object(got, (item, err), group=self.control)
        errors = [f"node rank {r}: {e}" for r, (_, e) in enumerate(got) if e]
        if errors:
            raise PeerMemoryUnavailable(self._setup_failure(what) + "; ".join(errors))
        return got

    # Backend hooks -------------------------------------------------------------------------------------------------
    def _setup_failure(self, what: str) -> str:
        """The start of the setup error's message: what could not be done, and what to do instead."""
        raise NotImplementedError

    def _open_inboxes(self, capacity: int, op: str) -> None:
        """Collectively replace every inbox by one of ``PARITIES * capacity`` bytes (half ``h`` starts at byte
        ``h * capacity``); every peer's is addressable afterwards."""
        raise NotImplementedError

    def _prepare(self, send: dict[int, torch.Tensor], dtype: torch.dtype) -> dict[int, torch.Tensor]:
        return {p: t.reshape(-1) for p, t in send.items()}

    def _write(self, p: int, parity: int, offset: int, src: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``src`` into half ``parity`` of peer p's inbox, ``offset`` bytes into the half."""
        raise NotImplementedError

    def _writes_done(self, parity: int) -> None:
        """Called after this rank's last write of an exchange into half ``parity``, before the end barrier."""

    def _read(self, parity: int, nbytes: int, dtype: torch.dtype, senders: list[int]) -> torch.Tensor:
        """The first ``nbytes`` of half ``parity`` of this rank's inbox as a fresh 1-D ``dtype`` tensor (``senders``
        wrote into it)."""
        raise NotImplementedError

    def _next_parity(self) -> int:
        parity = self.exchanges % self.PARITIES
        self.exchanges += 1
        return parity

    def _release(self) -> None:
        """Drop inboxes and peer mappings (close)."""

    # Protocol -----------------------------------------------------------------------------------------------------
    def _grow(self, need: int, op: str) -> None:
        cap = max(self.min_capacity, 1 << (max(need, 1) - 1).bit_length())
        # A failed growth fails on every rank alike; capacity 0 makes the next exchange retry it everywhere.
        self.capacity = 0
        self._open_inboxes(cap, op)
        self.capacity = cap
        self.grows += 1

    def _agree(self, send, recv_numel, dtype: torch.dtype, op: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """All-gather of every rank's sizes and the checks every rank makes alike (the agreed split matrix).

        Returns (send_GG, recv_GG, element size): send_GG[s, r] elements s sends r, recv_GG[r, s] elements r
        expects from s (int64, CPU)."""
        g = self.node_size
        bad = self._bad_peer(send, recv_numel)
        if bad is None:
            bad = next((m for p, t in send.items() if (m := self._check_tensor(p, t))), None)
        if bad is None and not isinstance(dtype, torch.dtype):
            bad = f"dtype must be a torch.dtype, got {dtype!r}"
        row = torch.zeros(2 + 2 * g, dtype=torch.int64)
        if bad is None:
            row[1] = dtype.itemsize
            for p, t in send.items():
                row[2 + p] = t.numel()
            for q, n in recv_numel.items():
                row[2 + g + q] = int(n)
        else:
            row[0] = 1
        with guard(f"copy path ({op}): split exchange", self.control):
            rows = all_gather_stack(row, self.control)
        if bad is not None:
            raise ValueError(f"copy path ({op}): {bad}")
        failed = [r for r in range(g) if rows[r, 0]]
        if failed:
            raise ValueError(f"copy path ({op}): node rank(s) {failed} passed invalid arguments (their error says "
                             "which); no data was exchanged")
        elems = rows[:, 1].tolist()
        if len(set(elems)) != 1:
            raise ValueError(f"copy path ({op}): node ranks disagree on the element size (bytes per rank: {elems}); "
                             "every rank must pass the same dtype")
        send_GG, recv_GG = rows[:, 2:2 + g], rows[:, 2 + g:]
        diff = (send_GG != recv_GG.t()).nonzero().tolist()
        if diff:
            s, r = diff[0]
            raise ValueError(f"copy path ({op}): node rank {s} sends {int(send_GG[s, r])} elements to node rank {r}, "
                             f"which expects {int(recv_GG[r, s])}; send and recv_numel must match pairwise")
        return send_GG, recv_GG, dtype.itemsize

    def exchange(self, send, recv_numel, *, dtype, device, op, matrix=None):
        if self._closed:
            raise RuntimeError(f"copy path ({op}): the {self.name} engine was closed")
        me = self.node_rank
        with torch.no_grad():
            if matrix is None:
                send_GG = self._agree(send, recv_numel, dtype, op)[0].numpy()
            else:
                send_GG = self._known_matrix(send, recv_numel, matrix, dtype, op)
            elem = dtype.itemsize
            if not send_GG.any():
                # Every rank sees the same empty matrix: nothing to write, wait for or read; no half is used.
                return self._split(torch.empty(0, dtype=dtype, device=self.out_device), [0] * self.node_size,
                                   recv_numel)
            need = int(send_GG.sum(0).max()) * elem
            if need > self.capacity:
                # Collective, entered by every rank alike (same matrix). Each rank drops only its own mappings,
                # after its own reads; a peer still reading keeps its mapping of its own inbox.
                self._grow(need, f"copy path ({op}): inbox growth")
            # Ordering (see the module docstring): these writes go into half `parity`, last used by the exchange
            # before the previous one; every reader finished reading that one before it entered the previous
            # exchange's end barrier, which this rank has left. No peer reads this half before our end barrier.
            parity = self._next_parity()
            srcs = self._prepare({p: t for p, t in send.items() if t.numel()}, dtype)
            # My block in peer p's inbox half starts after what lower node ranks send p.
            offsets = (send_GG[:me].sum(0) * elem).tolist()
            for p in sorted(srcs):
                self._write(p, parity, offsets[p], srcs[p], dtype)
            self._writes_done(parity)
            with guard(f"copy path ({op}): end of writes", self.control):
                dist.barrier(group=self.control)
            recv_splits = send_GG[:, me].tolist()
            senders = [q for q in range(self.node_size) if recv_splits[q]]
            out = self._read(parity, sum(recv_splits) * elem, dtype, senders)
        return self._split(out, recv_splits, recv_numel)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()
            self.capacity = 0


def _unlink_all(paths: list[str]) -> None:
    while paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths.pop())


class ShmCopyEngine(PeerInboxEngine):
    """CPU copy path over POSIX shared memory (``/dev/shm``): the peer-tensor protocol with plain ``copy_`` writes.

    Each rank's inbox is a file ``feplb-<job token>-n<node rank>-g<generation>`` in ``shm_dir``, created with
    O_EXCL (the token is random and agreed in the node group, so concurrent jobs never collide), reserved with
    ``posix_fallocate`` (a full tmpfs raises a clear error instead of a SIGBUS later), memory-mapped by its owner and
    by every peer, then unlinked as soon as every peer has mapped it: the memory lives as long as the mappings, and
    no file outlives setup or growth, even if a process dies later. ``close()`` unmaps; it is local.

    Cost: two small gloo collectives per exchange (sizes, end of writes), or one (end of writes) when the caller
    passes the split ``matrix``, where ``GlooCopyEngine`` needs one; then plain memory copies instead of TCP
    (``bench/bench_copy.py`` compares the three). Memory: each rank's inbox is two halves of ``capacity`` bytes
    (the module docstring says why), so the node holds ``2 * G * capacity`` bytes of shared memory.

    Args:
        node_group: the node's process group (gloo); node_size: G.
        shm_dir: a tmpfs directory visible to every process of the node (default: the module's ``SHM_DIR``,
            ``/dev/shm``).
    Raises:
        PeerMemoryUnavailable: on every rank of the node, when some rank cannot create, reserve or map an inbox
            (e.g. the node's processes do not share ``shm_dir``, or it is full).
    """

    name = "shm"

    def __init__(self, node_group, node_size: int, *, shm_dir: str | None = None):
        super().__init__(node_group, node_size)
        self.shm_dir = SHM_DIR if shm_dir is None else shm_dir
        self._inbox: torch.Tensor | None = None
        self._peer_inbox: dict[int, torch.Tensor] = {}
        self._pending: list[str] = []     # files created by this rank and not unlinked yet
        self._finalizer = weakref.finalize(self, _unlink_all, self._pending)
        tokens = [None] * node_size
        with guard("copy path setup: job token", self.control):
            dist.all_gather_object(tokens, secrets.token_hex(8), group=self.control)
        self.token = tokens[0]
        self._grow(self.min_capacity, "copy path setup")

    def _check_tensor(self, p, t):
        bad = super()._check_tensor(p, t)
        if bad is None and t.device.type != "cpu":
            bad = f"the shm copy path moves CPU tensors, send[{p}] is on {t.device}"
        return bad

    def _path(self, generation: int) -> str:
        return os.path.join(self.shm_dir, f"feplb-{self.token}-n{self.node_rank}-g{generation}")

    def _open_inboxes(self, capacity, op):
        # Every rank enters growth after its reads of the previous exchanges, and its writes into peers' inboxes
        # are plain copies that have finished, so its old mappings can go before the new ones are made (a peer
        # still reading its own inbox keeps its own mapping).
        self._inbox, self._peer_inbox = None, {}
        nbytes = capacity * self.PARITIES
        path = self._path(self.grows)
        try:
            err = None
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self._pending.append(path)
                try:
                    if hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(fd, 0, nbytes)
                    else:
                        os.ftruncate(fd, nbytes)
                    self._inbox = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
                finally:
                    os.close(fd)
            except OSError as exc:
                err = f"cannot create a {nbytes}-byte inbox {path!r}: {exc}"
            names = self._agree_setup(path, err, f"{op} (inbox names)", "create")
            err = None
            for p, (peer_path, _) in enumerate(names):
                if p == self.node_rank:
                    continue
                try:
                    # No O_CREAT: a peer's file that is not visible here must fail, never become a private one.
                    fd = os.open(peer_path, os.O_RDWR)
                    try:
                        size = os.fstat(fd).st_size
                        if size != nbytes:
                            raise OSError(f"size {size} instead of {nbytes}")
                        self._peer_inbox[p] = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
                    finally:
                        os.close(fd)
                except OSError as exc:
                    err = f"cannot map node rank {p}'s inbox {peer_path!r}: {exc}"
                    break
            # Doubles as the barrier after which nobody opens this generation's files any more.
            self._agree_setup(None, err, f"{op} (inbox mapping)", "map")
        except BaseException:
            self._inbox, self._peer_inbox = None, {}
            raise
        finally:
            _unlink_all(self._pending)

    def _setup_failure(self, what: str) -> str:
        return (f"the shm copy path could not {what} its shared-memory inboxes in {self.shm_dir!r} (use kind='gloo' "
                f"if the node's processes do not share it, or make it larger): ")

    def _write(self, p, parity, offset, src, dtype):
        start = parity * self.capacity + offset
        self._peer_inbox[p][start:start + src.numel() * dtype.itemsize].view(dtype).copy_(src)

    def _read(self, parity, nbytes, dtype, senders):
        start = parity * self.capacity
        return self._inbox[start:start + nbytes].view(dtype).clone()

    def _release(self):
        self._inbox, self._peer_inbox = None, {}
        self._finalizer()


class IpcCopyEngine(PeerInboxEngine):
    """GPU copy path over CUDA IPC: the peer-tensor protocol with copy-engine writes. Needs a CUDA GPU.

    Each rank's inbox is a CUDA allocation; its storage is shared with every peer through CUDA IPC (torch's
    ``_share_cuda_`` / ``_new_shared_cuda``, which keep the memory alive while any peer maps it); peers map it on
    their own device, so a peer's view is labelled with the mapping process's device. A sender's writes are
    ``copy_(non_blocking=True)`` into the peer's inbox view on ``self.stream``, ordered after the producer by an
    event: between GPUs that is a peer ``cudaMemcpyAsync``, run by a copy engine. Ordering across processes uses
    two interprocess events per rank and inbox half: "written[h]", recorded on the sender's copy stream after its
    writes into half h (the receiver's compute stream waits on it; the end barrier guarantees the record is issued
    before the wait, and the next record of written[h] comes only after the next end barrier, which the receiver
    enters after issuing its wait), and "consumed[h]", recorded on the receiver's compute stream after its copy-out
    of half h (the sender's copy stream waits on it before writing into that half two exchanges later: the record
    was issued before the receiver entered the end barrier in between, and the next record of consumed[h] only
    comes after the end barrier of that later exchange). So the host barriers order the event calls, and the events
    order the copies on the devices. Control plane (sizes, barrier, handles) over gloo. ``close()`` is local.
    Memory: each inbox holds two halves of ``capacity`` bytes of device memory.

    Args:
        node_group: the node's process group (any backend; a gloo group over its ranks is made for control).
        node_size: G.  device: this rank's GPU (default: the current device).
    Raises:
        PeerMemoryUnavailable: on every rank of the node, when some rank cannot share or open an inbox or event.
    """

    name = "ipc"

    def __init__(self, node_group, node_size: int, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the ipc copy path needs a CUDA GPU (use kind='shm' or 'gloo' for CPU tensors)")
        super().__init__(node_group, node_size)
        self.device = self.out_device = torch.device(
            "cuda", torch.cuda.current_device() if device is None or device.index is None else device.index)
        self.stream = torch.cuda.Stream(self.device)
        self._inbox: torch.Tensor | None = None
        self._peer_inbox: dict[int, torch.Tensor] = {}
        self._written = [torch.cuda.Event(interprocess=True) for _ in range(self.PARITIES)]
        self._consumed = [torch.cuda.Event(interprocess=True) for _ in range(self.PARITIES)]
        self._peer_written: dict[int, list[torch.cuda.Event]] = {}
        self._peer_consumed: dict[int, list[torch.cuda.Event]] = {}
        err, mine = None, None
        try:
            with torch.cuda.device(self.device):
                mine = (self.device.index, [e.ipc_handle() for e in self._written],
                        [e.ipc_handle() for e in self._consumed])
        except RuntimeError as exc:
            err = f"cannot share interprocess events: {exc}"
        events = self._agree_setup(mine, err, "copy path setup: event handles", "share events")
        err = None
        try:
            for p, ((_, written, consumed), _) in enumerate(events):
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

    def _check_tensor(self, p, t):
        bad = super()._check_tensor(p, t)
        if bad is None and t.device != self.device:
            bad = f"the ipc copy path sends tensors on {self.device}, send[{p}] is on {t.device}"
        return bad

    def _open_inboxes(self, capacity, op):
        # Copies into the old inboxes (mine from peers, peers' from me) and copy-outs may still run: finish them
        # before the old mappings go (torch's IPC release only syncs the current stream). Growth is rare.
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

    def _prepare(self, send, dtype):
        compute = torch.cuda.current_stream(self.device)
        # Casts run on the producer's stream, so the copy stream moves bytes only (plain memcpy, no kernel).
        srcs = {p: t.reshape(-1).to(dtype=dtype).contiguous() for p, t in send.items()}
        ready = torch.cuda.Event()
        ready.record(compute)
        self.stream.wait_event(ready)
        return srcs

    def _write(self, p, parity, offset, src, dtype):
        self.stream.wait_event(self._peer_consumed[p][parity])
        start = parity * self.capacity + offset
        with torch.cuda.stream(self.stream):
            self._peer_inbox[p][start:start + src.numel() * dtype.itemsize].view(dtype).copy_(src,
                                                                                              non_blocking=True)
        src.record_stream(self.stream)

    def _writes_done(self, parity):
        self._written[parity].record(self.stream)

    def _read(self, parity, nbytes, dtype, senders):
        compute = torch.cuda.current_stream(self.device)
        for q in senders:
            compute.wait_event(self._peer_written[q][parity])
        start = parity * self.capacity
        out = self._inbox[start:start + nbytes].view(dtype).clone()
        self._consumed[parity].record(compute)
        return out

    def _release(self):
        torch.cuda.synchronize(self.device)
        self._inbox, self._peer_inbox = None, {}
        self._peer_written, self._peer_consumed = {}, {}


class CudaCopyEngine(CopyEngine):
    """GPU copy path on a dedicated copy stream over nvshmem4py (``use_nvshmem``) or NCCL (see the module
    docstring). ``close()`` frees the nvshmem inbox, which is collective like its allocation. A known ``matrix``
    replaces nvshmem's split all-gather; NCCL only checks it. Untested without a GPU."""

    def __init__(self, node_group, node_size: int, *, use_nvshmem: bool = True):
        super().__init__(node_group, node_size)
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA copy path needs a CUDA GPU")
        self.stream = torch.cuda.Stream()
        self._nv = self._bind = None
        if use_nvshmem:
            self._nv, self._bind = nvshmem_modules()
            # Symmetric allocations are collective over every PE: the inbox can only grow where all PEs exchange
            # together, i.e. when the node is the whole job. Several PEs on one GPU (without MPS) cannot wait on
            # signals at all.
            if dist.get_world_size(node_group) != dist.get_world_size():
                raise ValueError("the nvshmem copy path needs the node to be the whole job (its symmetric inbox "
                                 "grows collectively over every PE); use copy_path='ipc' across several nodes")
            if nvshmem_shared_gpu(self._nv):
                raise ValueError("the nvshmem copy path cannot wait on signals with several processes on one GPU "
                                 "(nvshmem 'limited MPG' mode, no MPS); use copy_path='ipc'")
        self.name = "nvshmem" if use_nvshmem else "nccl"
        self._inbox: torch.Tensor | None = None
        self._signal: torch.Tensor | None = None
        self._epoch = 0

    def _ensure_inbox(self, nbytes: int) -> torch.Tensor:
        """The symmetric inbox of at least ``nbytes`` (collective: every PE asks for the same size, read off the
        same matrix). Enqueued on the current stream, before anything is put into it."""
        nv = self._nv
        h = torch.cuda.current_stream().cuda_stream
        if self._inbox is None or self._inbox.numel() < nbytes:
            if self._inbox is not None:
                torch.cuda.synchronize()    # no put may still target the old inbox when it is freed
                nv.free_tensor(self._inbox)
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            self._inbox = nv.interop.torch.tensor((cap,), dtype=torch.uint8)
        if self._signal is None:
            # NVSHMEM signals are 64-bit words (nvshmem memory is not zeroed); the epoch never nears the sign bit.
            self._signal = nv.interop.torch.tensor((self.node_size,), dtype=torch.int64)
            self._signal.zero_()
            self._bind.barrier_all_on_stream(h)   # every PE's zeroing lands before any put_signal
        return self._inbox

    def exchange(self, send, recv_numel, *, dtype, device, op, matrix=None):
        send_splits, recv_splits = self._layout(send, recv_numel, matrix, dtype, op)
        compute = torch.cuda.current_stream()
        elem = dtype.itemsize
        if self._nv is None:
            ready = torch.cuda.Event()
            ready.record(compute)
            self.stream.wait_event(ready)
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
            nv, bind = self._nv, self._bind
            # Inbox layout on peer q: blocks by sender node rank; my block on q starts after what ranks < me send q.
            if matrix is not None:
                # Known on every rank (checked against this rank's arguments by _layout): no split exchange. The
                # inbox reuse is ordered by the nvshmem barrier after the copy-out below, not by this all-gather.
                matrix = torch.from_numpy(np.asarray(matrix, dtype=np.int64))
            else:
                all_send = torch.tensor(send_splits, dtype=torch.int64, device=collective_device(self.node_group))
                with guard(f"copy path ({op}): split exchange", self.node_group):
                    matrix = all_gather_stack(all_send, self.node_group).cpu()
            need = int(matrix.sum(0).max()) * elem
            inbox = self._ensure_inbox(need)
            # Recorded after the inbox (and, the first time, the zeroed signals and their barrier) were enqueued:
            # the puts on the copy stream follow every PE's zeroing.
            ready = torch.cuda.Event()
            ready.record(compute)
            self.stream.wait_event(ready)
            self._epoch += 1
            set_op, ge = int(nv.SignalOp.SIGNAL_SET), int(nv.ComparisonType.CMP_GE)
            sig_bytes = self._signal.element_size()
            srcs = []
            with torch.cuda.stream(self.stream):
                for p in range(self.node_size):
                    if p in send and send[p].numel():
                        off = int(matrix[: self.node_rank, p].sum()) * elem
                        src = send[p].reshape(-1).to(dtype).contiguous().view(torch.uint8)
                        srcs.append(src)
                        peer_pe = dist.get_global_rank(self.node_group, p) if self.node_group is not None else p
                        bind.putmem_signal_on_stream(inbox.data_ptr() + off, src.data_ptr(), src.numel(),
                                                     self._signal.data_ptr() + self.node_rank * sig_bytes,
                                                     self._epoch, set_op, peer_pe, self.stream.cuda_stream)
            for src in srcs:
                src.record_stream(self.stream)   # the caching allocator must not reuse it before the put read it
            for q in range(self.node_size):
                if recv_splits[q]:
                    bind.signal_wait_until_on_stream(self._signal.data_ptr() + q * sig_bytes, ge, self._epoch,
                                                     compute.cuda_stream)
            out = inbox[: sum(recv_splits) * elem].clone().view(dtype)
            # The inbox is reused by the next exchange: no peer may put into it before this copy-out ran, and the
            # compute stream must not run ahead of the puts reading its send buffers.
            bind.barrier_all_on_stream(compute.cuda_stream)
            done = torch.cuda.Event()
            done.record(self.stream)
            compute.wait_event(done)
        return self._split(out, recv_splits, recv_numel)

    def close(self) -> None:
        if self._nv is not None:
            for t in (self._inbox, self._signal):
                if t is not None:
                    self._nv.free_tensor(t)
        self._inbox = self._signal = None


def _nvshmem_importable() -> bool:
    try:
        import nvshmem.core  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def make_copy_engine(device: torch.device, node_group, node_size: int, *, use_nvshmem: bool = False,
                     kind: str = "auto") -> CopyEngine:
    """The copy path for tensors on ``device`` (collective inside the node).

    kind:
        ``"auto"``: CPU -> ``"shm"``, or ``"gloo"`` (with a warning) when the node's ranks cannot share memory;
        CUDA -> ``"nvshmem"`` if ``use_nvshmem``, nvshmem4py imports (it needs nvshmem initialised, e.g. by
        ``NvshmemTransport``), the node is the whole job and each process has its own GPU; else ``"ipc"``, or
        ``"nccl"`` (with a warning) when CUDA IPC fails on the node.
        ``"gloo"``, ``"shm"``: CPU only.  ``"ipc"``, ``"nvshmem"``, ``"nccl"``: CUDA only. See the module docstring.
    Raises:
        ValueError: unknown kind, or one that does not fit ``device``.
        ImportError: ``"nvshmem"`` without nvshmem4py.  PeerMemoryUnavailable: ``"shm"`` / ``"ipc"`` setup failed.
    """
    if kind not in COPY_KINDS:
        raise ValueError(f"copy path kind must be one of {COPY_KINDS}, got {kind!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no copy path for device type {device.type!r} (expected 'cpu' or 'cuda'); {NVSHMEM_HINT}")
    fits = _CPU_KINDS if device.type == "cpu" else _CUDA_KINDS
    if kind != "auto" and kind not in fits:
        raise ValueError(f"copy path kind {kind!r} does not move {device.type} tensors; for {device.type} use one of "
                         f"{('auto', *fits)}")
    if kind == "gloo":
        return GlooCopyEngine(node_group, node_size)
    if kind == "shm":
        return ShmCopyEngine(node_group, node_size)
    if kind == "nvshmem":
        return CudaCopyEngine(node_group, node_size, use_nvshmem=True)
    if kind == "nccl":
        return CudaCopyEngine(node_group, node_size, use_nvshmem=False)
    if kind == "ipc":
        return IpcCopyEngine(node_group, node_size, device)
    if device.type == "cpu":
        try:
            return ShmCopyEngine(node_group, node_size)
        except PeerMemoryUnavailable as exc:
            warnings.warn(f"feplb: falling back to the gloo copy path: {exc}", RuntimeWarning, stacklevel=2)
            return GlooCopyEngine(node_group, node_size)
    if use_nvshmem and _nvshmem_importable() and dist.get_world_size(node_group) == dist.get_world_size():
        # one node, one GPU per process: signals work; otherwise (several nodes, or several processes on one GPU
        # without MPS) the IPC path below serves the node
        core, _ = nvshmem_modules()
        if not nvshmem_shared_gpu(core):
            return CudaCopyEngine(node_group, node_size, use_nvshmem=True)
    try:
        return IpcCopyEngine(node_group, node_size, device)
    except PeerMemoryUnavailable as exc:
        warnings.warn(f"feplb: falling back to the nccl copy path: {exc}", RuntimeWarning, stacklevel=2)
        return CudaCopyEngine(node_group, node_size, use_nvshmem=False)
