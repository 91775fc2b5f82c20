"""``ShmCopyEngine``: the CPU copy path over POSIX shared memory (the peer-tensor protocol of ``feplb.copy.peer``
with plain memory copies)."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref

import torch

from feplb.copy.peer import PeerInboxEngine

__all__ = ["SHM_DIR", "ShmCopyEngine"]

# Where ShmCopyEngine puts its inboxes unless told otherwise (a tmpfs shared by the processes of a node).
SHM_DIR = "/dev/shm"


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
    passes the split ``matrix``; then one memory copy per piece into the peer's inbox and one per source out of
    this rank's (``bench/bench_copy.py`` compares it with gloo). Memory: each rank's inbox is two halves of
    ``capacity`` bytes (``feplb.copy.peer`` says why), so the node holds ``2 * G * capacity`` bytes of shared memory.

    Args:
        control: the EP group's ``Control`` (its node group carries the control plane).
        shm_dir: a tmpfs directory visible to every process of the node (default: the module's ``SHM_DIR``,
            ``/dev/shm``).
    Raises:
        PeerMemoryUnavailable: on every rank of the node, when some rank cannot create, reserve or map an inbox
            (e.g. the node's processes do not share ``shm_dir``, or it is full).
    """

    name = "shm"
    device_type = "cpu"

    def __init__(self, control, *, shm_dir: str | None = None):
        super().__init__(control)
        self.shm_dir = SHM_DIR if shm_dir is None else shm_dir
        self._inbox: torch.Tensor | None = None
        self._peer_inbox: dict[int, torch.Tensor] = {}
        self._pending: list[str] = []     # files created by this rank and not unlinked yet
        self._finalizer = weakref.finalize(self, _unlink_all, self._pending)
        self.token = control.all_gather_object(secrets.token_hex(8), "node", "copy path setup: job token")[0]
        self._grow(self.min_capacity, "copy path setup")

    def _path(self, generation: int, node_rank: int | None = None) -> str:
        r = self.node_rank if node_rank is None else node_rank
        return os.path.join(self.shm_dir, f"feplb-{self.token}-n{r}-g{generation}")

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
            # A peer that died in the agreements (killed, say) never unlinks its file: the names are known, so
            # the survivors do (the node abandons this generation whatever happened)
            for r in range(self.node_size):
                if r != self.node_rank:
                    with contextlib.suppress(OSError):
                        os.unlink(self._path(self.grows, r))
            raise
        finally:
            _unlink_all(self._pending)

    def _setup_failure(self, what: str) -> str:
        return (f"the shm copy path could not {what} its shared-memory inboxes in {self.shm_dir!r} (use kind='gloo' "
                f"if the node's processes do not share it, or make it larger): ")

    def _write(self, p, parity, offset, pieces, dtype):
        start = parity * self.capacity + offset
        inbox = self._peer_inbox[p]
        for t in pieces:
            n = t.numel() * dtype.itemsize
            inbox[start:start + n].view(dtype).copy_(t.reshape(-1))
            start += n

    def _read(self, parity, blocks, dtype, consumer):
        base = parity * self.capacity
        return {q: self._inbox[base + off:base + off + n * dtype.itemsize].view(dtype).clone()
                for q, (off, n) in blocks.items()}

    def _release(self):
        super()._release()
        self._inbox, self._peer_inbox = None, {}
        self._finalizer()
