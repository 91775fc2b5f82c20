"""The peer-tensor protocol shared by the shm and CUDA IPC engines (``PeerInboxEngine``).

Each rank of the node owns an inbox of two halves (parity 0 and 1) that every peer of the node addresses directly;
exchange number n (counted alike on every rank, exchanges without any traffic in the node excepted) uses half
n % 2. One exchange:

1. the G x G split matrix (elements each node rank sends each other one), from one of two sources:

   * agreed (``matrix=None``): an all-gather of one small row per rank (its send and receive sizes, dtype,
     argument status) in the node's gloo group; every rank checks the whole exchange, so bad arguments on one rank
     raise ValueError on all of them;
   * known (``matrix=`` given, identical on every rank of the node: the caller's guarantee): no collective; each
     rank checks its own arguments against its row and column, and raises ValueError alone (before any collective:
     its peers then stop at the end barrier, with a TimeoutError after the group's timeout);

2. growth, when the largest receiver needs more than a half holds: every rank derives the same power-of-two
   capacity from the same matrix, so the node regrows together (a collective) and nothing is dropped;
3. writes: each sender copies its pieces for receiver r, back to back and each piece its own copy, straight into
   r's inbox half, at the offset the matrix gives (blocks ordered by sender rank);
4. end of writes: a barrier in the node's gloo group (plus, on CUDA, events that order the copies themselves);
5. read: each receiver copies every sender's block out into a tensor of its own (the half is reused two exchanges
   later, so results never alias it).

Why one barrier per exchange suffices (the two halves): a writer enters exchange n+2, and writes into half n % 2,
only after leaving the end barrier of exchange n+1, which every reader enters only after it finished reading
exchange n (reads come before ``exchange`` returns); exchange n+1 itself writes into the other half, which nobody
reads before the end barrier of n+1. Exchange n's reads see all of n's writes because of n's end barrier. So the
start barrier the all-gather used to provide is not needed, and the known-matrix path costs one control collective.
The price is memory: every inbox holds two halves, twice the largest exchange's receive size (rounded up to a
power of two).

On CUDA "finished reading" and "the writes landed" are statements about streams, not about the host: the host
only ISSUES the copies, on the engine's copy stream, and returns. ``IpcCopyEngine`` turns the host ordering above
into device ordering with two interprocess events per rank and half (see its docstring): the host barriers order
the event records and waits, the events order the copies.

Threads: every step runs on the calling thread (the layer calls from its copy thread); the collectives go through
the ``Control`` of the EP group, whose per-group lock keeps another thread's control call from interleaving.
Every wait runs under ``guard``: a peer that stalls or dies fails the step with an error naming it after the
process group's timeout (``TimeoutError``, or ``RuntimeError`` where another peer gave up first and closed the
connection), instead of hanging.

Legend: G ranks per node (peers are node ranks 0..G-1).
"""

from __future__ import annotations

import torch

from feplb.copy.base import CopyEngine, PeerMemoryUnavailable

__all__ = ["PeerInboxEngine"]


class PeerInboxEngine(CopyEngine):
    """The peer-tensor protocol of the module docstring; backends provide the inboxes and the data movement.

    Attributes:
        capacity: bytes one exchange can deliver to a rank, i.e. of each half of every rank's inbox (the same on
            all ranks of the node; a power of two). Every inbox holds ``PARITIES * capacity`` bytes.
        grows: how many times the inboxes were (re)built, setup included.
        exchanges: exchanges that used the inboxes so far (the same on all ranks; its parity picks the half).
    """

    PARITIES = 2
    min_capacity = 1 << 16

    def __init__(self, control, device=None):
        super().__init__(control, device)
        self.capacity = 0
        self.grows = 0
        self.exchanges = 0

    def _agree_setup(self, item: object, err: str | None, stage: str, what: str) -> list:
        """One setup step's (item, error) from every rank of the node (collective, under ``guard(stage)``).

        Raises PeerMemoryUnavailable on every rank together when any rank failed (``what`` it could not do), so no
        rank goes on into a collective its peers never reach. Returns the gathered (item, error) pairs.
        """
        got = self.control.all_gather_object((item, err), "node", stage)
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

    def _begin(self, ready) -> None:
        """Called before the first write of an exchange (CUDA: the copy stream waits for ``ready``)."""

    def _write(self, p: int, parity: int, offset: int, pieces: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Copy ``pieces`` back to back into half ``parity`` of peer p's inbox, from ``offset`` bytes into the half."""
        raise NotImplementedError

    def _writes_done(self, parity: int) -> None:
        """Called after this rank's last write of an exchange into half ``parity``, before the end barrier."""

    def _read(self, parity: int, blocks: dict[int, tuple[int, int]], dtype: torch.dtype,
              consumer) -> dict[int, torch.Tensor]:
        """{q: fresh 1-D ``dtype`` tensor} of ``blocks[q] = (byte offset into half ``parity``, elements)`` of this
        rank's inbox (CUDA: copied on the copy stream; ``consumer`` waits for them)."""
        raise NotImplementedError

    def _next_parity(self) -> int:
        parity = self.exchanges % self.PARITIES
        self.exchanges += 1
        return parity

    # Protocol -----------------------------------------------------------------------------------------------------
    def _grow(self, need: int, op: str) -> None:
        cap = max(self.min_capacity, 1 << (max(need, 1) - 1).bit_length())
        # A failed growth fails on every rank alike; capacity 0 makes the next exchange retry it everywhere.
        self.capacity = 0
        self._open_inboxes(cap, op)
        self.capacity = cap
        self.grows += 1

    def _exchange(self, send, recv_numel, *, dtype, device, op, matrix, ready, consumer):
        me, g = self.node_rank, self.node_size
        send_GG = self._split_matrix(send, recv_numel, dtype, device, op, matrix, ready, consumer)
        elem = dtype.itemsize
        if not send_GG.any():
            # Every rank sees the same empty matrix: nothing to write, wait for or read; no half is used.
            return self._results(recv_numel, lambda q: torch.empty(0, dtype=dtype, device=self.device))
        need = int(send_GG.sum(0).max()) * elem
        if need > self.capacity:
            # Collective, entered by every rank alike (same matrix). Each rank drops only its own mappings,
            # after its own reads; a peer still reading keeps its mapping of its own inbox.
            self._grow(need, f"copy path ({op}): inbox growth")
        # Ordering (see the module docstring): these writes go into half `parity`, last used by the exchange
        # before the previous one; every reader finished reading that one before it entered the previous
        # exchange's end barrier, which this rank has left. No peer reads this half before our end barrier.
        parity = self._next_parity()
        self._begin(ready)
        # My block in peer p's inbox half starts after what lower node ranks send p.
        offsets = (send_GG[:me].sum(0) * elem).tolist()
        for p in range(g):
            pieces = [t for t in send.get(p, ()) if t.numel()]
            if pieces:
                self._write(p, parity, offsets[p], pieces, dtype)
        self._writes_done(parity)
        # the end barrier, which also compares the exchanges begun
        self._in_step(op, "end of writes")
        # each sender's block in this rank's half: its offset (what lower node ranks send) and size, as Python ints
        col = send_GG[:, me].tolist()
        blocks, pos = {}, 0
        for q in range(g):
            if col[q] or q in recv_numel:
                blocks[q] = (pos * elem, col[q])
            pos += col[q]
        got = self._read(parity, blocks, dtype, consumer)
        return self._results(recv_numel, got.__getitem__)

    def _release(self) -> None:
        self.capacity = 0
