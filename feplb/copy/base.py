"""The copy-path interface (``CopyEngine``) and what every engine checks and agrees on alike.

Legend: G ranks per node (peers are node ranks 0..G-1), N elements of a flat buffer.
"""

from __future__ import annotations

import numbers
import operator
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from feplb.control import Control
from feplb.recompute import hidden_from_selective_checkpoint

__all__ = ["CopyEngine", "PeerMemoryUnavailable"]

# dtypes the agreement can name (a rank's code is its dtype's index; -1: another dtype, compared by element size)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)


class PeerMemoryUnavailable(RuntimeError):
    """Peer memory (shared memory files or CUDA IPC) could not be set up on some rank of the node.

    Raised on every rank of the node together (the failure is agreed collectively), so a caller may fall back to
    another engine on all of them."""


class CopyEngine:
    """Exchange of flat buffers between the ranks of one node (one class per mechanism; see ``feplb.copy``).

    Args (constructor):
        control: the EP group's ``Control``; the engine's collectives run in its node group (gloo), and its node
            (``control.gpus_per_node`` ranks, peers named by node rank 0..G-1) is the engine's.
    Attributes:
        device: where received tensors live and sent tensors must be.  node_size: G.  node_rank: this rank in
        the node.
    """

    name = "abstract"
    device_type = "cpu"

    def __init__(self, control: Control, device: torch.device | None = None):
        if not isinstance(control, Control):
            raise ValueError(f"control must be a feplb.control.Control, got {type(control).__name__}")
        self.control = control
        self.node_size = control.gpus_per_node
        self.node_rank = control.node_rank
        self.device = torch.device(self.device_type) if device is None else torch.device(device)
        self._busy = threading.Lock()
        self._closed = False
        # exchanges begun on this rank, refused ones included: engines that can carry it in their end-of-writes
        # collective compare it over the node, so a rank that left an exchange the others ran (a local refusal it
        # caught) stops there instead of pairing its next exchange's data with theirs (_out_of_step)
        self.calls = 0
        self._broken: str | None = None   # why no exchange of this engine can be trusted any more

    # -- public API ---------------------------------------------------------------------------------------------------
    @hidden_from_selective_checkpoint
    def exchange(self, send: Mapping[int, Sequence[torch.Tensor]], recv_numel: Mapping[int, int], *,
                 dtype: torch.dtype, device: torch.device, op: str, matrix=None,
                 ready: torch.cuda.Event | None = None, consumer: torch.cuda.Stream | None = None,
                 ) -> dict[int, torch.Tensor]:
        """Send the pieces ``send[p]`` back to back to node peer ``p``; receive ``recv_numel[q]`` elements from q.

        Collective inside the node: every rank of the node calls it, in the same order. ``op`` names the step in
        errors and timeouts. A peer may appear in neither mapping (nothing exchanged with it).

        Args:
            send: {p: [piece, ...]}: contiguous ``dtype`` tensors of any shape on ``device``, written in order into
                p's inbox, each its own copy (on GPUs one ``cudaMemcpyAsync`` per piece on the engine's copy
                stream: copy-engine DMA, no gather kernel).
            recv_numel: {q: elements expected from q}.
            dtype: the element type of every piece and result; the same on every rank of the node.
            device: ``self.device`` (the caller's statement of where its tensors live, checked).
            matrix: optional G x G element counts of the whole exchange (``matrix[i][j]``: elements node rank i
                sends node rank j; tuple of tuples, list or integer array), identical on every rank of the node, and
                given on every rank of the node or on none of them (the caller's guarantee). This rank's ``send``
                and ``recv_numel`` must match its row and column: a ValueError otherwise, raised on this rank alone
                before any collective; if that rank goes on to another exchange given a matrix, the node's ranks
                raise RuntimeError there (the engines that can tell: the CPU ones, IPC; where only some of them
                must grow their inboxes for theirs, TimeoutError after the group's timeout), never pairing its data
                with the refused exchange's. Without it the engine agrees on the sizes (one node all-gather) and every
                rank checks the whole exchange, so bad arguments on one rank raise ValueError on all of them.
            ready: CUDA engines only: an event the pieces depend on; the copies start after it (default: an event
                recorded now on the calling thread's current stream).
            consumer: CUDA engines only: the stream that will read the results (default: the calling thread's
                current stream); it is made to WAIT for the copies (a stream wait, no host sync).
        Returns:
            {q: 1-D ``dtype`` tensor of recv_numel[q] elements} for every q in ``recv_numel``, owned by the caller:
            never a view of a buffer the engine reuses (several results may share one fresh allocation).

        Blocking: on CUDA nothing in here waits for the device (no ``.item()``, blocking copy or synchronize), except
        when the inboxes grow. May be called from a worker thread; one exchange in flight per engine at a time.
        Runs hidden from selective activation checkpointing (other dispatch modes see it in a forward, none in a
        backward pass): a transport, no part of the computation (a policy saving views would cache one of an inbox,
        then refuse the engine's next write into it).
        """
        if self._closed:
            raise RuntimeError(f"copy path ({op}): the {self.name} engine was closed")
        if self._broken is not None:
            raise RuntimeError(f"copy path ({op}): the {self.name} engine {self._broken}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"copy path ({op}): another exchange of this {self.name} engine is in flight; an "
                               "engine runs one exchange at a time (wait for it, or use one engine per thread)")
        self.calls += 1
        try:
            with torch.no_grad():
                return self._exchange(send, recv_numel, dtype=dtype, device=device, op=op, matrix=matrix,
                                      ready=ready, consumer=consumer)
        finally:
            self._busy.release()

    def close(self) -> None:
        """Release what the engine holds (shared memory, peer mappings, symmetric memory). Idempotent; local to
        this rank unless the engine's docstring says otherwise. The engine refuses exchanges afterwards."""
        if not self._closed:
            self._closed = True
            self._release()

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- for engines --------------------------------------------------------------------------------------------------
    def _in_step(self, op: str, stage: str) -> None:
        """One node all-reduce comparing the exchanges begun (``calls``: min and -max, equal on every rank in step),
        which is also a barrier: raises ``_out_of_step``'s error on every rank of the node where they differ."""
        got = self.control.all_reduce_min(torch.tensor([self.calls, -self.calls], dtype=torch.int64), "node",
                                          f"copy path ({op}): {stage}").tolist()
        if got[0] != -got[1]:
            raise self._out_of_step(op, got[0], -got[1])

    def _out_of_step(self, op: str, lowest: int, highest: int) -> RuntimeError:
        """The error of an exchange whose ranks began different numbers of exchanges (``calls``); the engine refuses
        every exchange after it (the ranks' inbox halves and counters are apart)."""
        self._broken = (f"stopped at an exchange its node's ranks were not all at (its exchanges number {lowest} to "
                        f"{highest}); it cannot be used again")
        return RuntimeError(
            f"copy path ({op}): the node's ranks are at different exchanges (this engine's exchanges number {lowest} "
            f"to {highest}, counted on each rank as it begins one): a rank left an exchange its peers ran (an error "
            "raised there on that rank alone, and caught), so its next exchange met theirs; every rank of the node "
            "stops here, and this engine cannot be used again")

    def _exchange(self, send, recv_numel, *, dtype, device, op, matrix, ready, consumer) -> dict[int, torch.Tensor]:
        raise NotImplementedError

    def _release(self) -> None:
        """Drop what the engine holds (close)."""

    def _problem(self, send, recv_numel, dtype, device, ready, consumer) -> str | None:
        """Why these arguments are invalid on this rank, or None (no collective)."""
        # (fast paths first: the layer passes dicts, lists and ints, whose exact types answer the abstract-class
        # checks below without their cost; any other type takes those checks as before)
        if not (type(send) is dict or isinstance(send, Mapping)) or \
                not (type(recv_numel) is dict or isinstance(recv_numel, Mapping)):
            return (f"send and recv_numel must be mappings (peer -> pieces, peer -> elements), got "
                    f"{type(send).__name__} and {type(recv_numel).__name__}")
        for p in list(send) + list(recv_numel):
            if not (type(p) is int or isinstance(p, numbers.Integral) and not isinstance(p, bool)) \
                    or not 0 <= p < self.node_size or p == self.node_rank:
                return (f"copy-path peer must be another GPU of the node (0..{self.node_size - 1}, "
                        f"not {self.node_rank}), got {p!r}")
        for p, n in recv_numel.items():
            try:
                ok = operator.index(n) >= 0
            except TypeError:
                ok = False
            if not ok:
                return f"recv_numel[{p}] must be an int >= 0, got {n!r}"
        if not isinstance(dtype, torch.dtype):
            return f"dtype must be a torch.dtype, got {dtype!r}"
        try:
            dev = torch.device(device)
        except (TypeError, RuntimeError):
            return f"device must be a torch.device, got {device!r}"
        if not _same_device(dev, self.device):
            return f"the {self.name} copy path moves tensors on {self.device}, got device={dev}"
        for p, pieces in send.items():
            if type(pieces) is not list and (isinstance(pieces, torch.Tensor) or not isinstance(pieces, Sequence)):
                return f"send[{p}] must be a list of tensors (the pieces for peer {p}), got {type(pieces).__name__}"
            for i, t in enumerate(pieces):
                if not isinstance(t, torch.Tensor):
                    return f"send[{p}][{i}] must be a tensor, got {type(t).__name__}"
                if t.dtype != dtype:
                    return f"send[{p}][{i}] must have dtype {dtype} (engines move bytes, never cast), got {t.dtype}"
                if t.device != self.device and not _same_device(t.device, self.device):
                    return f"the {self.name} copy path sends tensors on {self.device}, send[{p}][{i}] is on {t.device}"
                if not t.is_contiguous():
                    return (f"send[{p}][{i}] must be contiguous (each piece is one flat copy), got a view of shape "
                            f"{list(t.shape)} with strides {list(t.stride())}")
        if self.device_type == "cpu" and (ready is not None or consumer is not None):
            return f"ready and consumer order CUDA streams; the {self.name} copy path moves CPU tensors (pass None)"
        if ready is not None and not isinstance(ready, torch.cuda.Event):
            return f"ready must be a torch.cuda.Event, got {type(ready).__name__}"
        if consumer is not None and not isinstance(consumer, torch.cuda.Stream):
            return f"consumer must be a torch.cuda.Stream, got {type(consumer).__name__}"
        return None

    def _sizes(self, send, recv_numel) -> tuple[list[int], list[int]]:
        g = self.node_size
        send_n = [sum(t.numel() for t in send[p]) if p in send else 0 for p in range(g)]
        recv_n = [int(recv_numel.get(p, 0)) for p in range(g)]
        return send_n, recv_n

    def _split_matrix(self, send, recv_numel, dtype, device, op, matrix, ready=None, consumer=None) -> np.ndarray:
        """int64 [G, G], elements node rank s sends node rank r, checked (known) or agreed (``matrix=None``)."""
        if matrix is not None:
            return self._known_matrix(send, recv_numel, dtype, device, op, matrix, ready, consumer)
        return self._agree(send, recv_numel, dtype, device, op, ready, consumer)

    def _known_matrix(self, send, recv_numel, dtype, device, op, matrix, ready, consumer) -> np.ndarray:
        """The caller's split matrix after the local checks (no collective): the arguments, and that this rank's
        sends are its row and its receives its column."""
        g, me = self.node_size, self.node_rank
        bad = self._problem(send, recv_numel, dtype, device, ready, consumer)
        if bad is not None:
            raise ValueError(f"copy path ({op}): {bad}")
        try:
            m = np.asarray(matrix)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"copy path ({op}): matrix must be a {g} x {g} array of element counts: {exc}") from exc
        # (dtype.kind "iu": the signed and unsigned integer dtypes, without np.issubdtype's cost; unlike it, numpy's
        # timedelta64 is refused too, which no count is)
        if m.shape != (g, g) or not (m.dtype.kind in "iu" or m.dtype == np.bool_ and not m.any()):
            raise ValueError(f"copy path ({op}): matrix must be a {g} x {g} array of integer element counts, got "
                             f"shape {m.shape} of {m.dtype}")
        m = m.astype(np.int64, copy=False)
        # (the counts as Python ints, read once: the checks below compare a few numbers, cheaper than array ops)
        ml = m.tolist()
        if any(v < 0 for r in ml for v in r) or any(ml[i][i] for i in range(g)):
            raise ValueError(f"copy path ({op}): matrix must hold counts >= 0 with a zero diagonal (no rank sends "
                             f"to itself), got {ml}")
        send_n, recv_n = self._sizes(send, recv_numel)
        for p in range(g):
            if p == me:
                continue
            if send_n[p] != ml[me][p]:
                raise ValueError(f"copy path ({op}): node rank {me} sends {send_n[p]} elements to node rank {p} but "
                                 f"matrix[{me}][{p}] is {ml[me][p]}; send must match this rank's row")
            if recv_n[p] != ml[p][me]:
                raise ValueError(f"copy path ({op}): node rank {me} expects {recv_n[p]} elements from node rank {p} "
                                 f"but matrix[{p}][{me}] is {ml[p][me]}; recv_numel must match this rank's "
                                 "column")
        return m

    def _agree(self, send, recv_numel, dtype, device, op, ready, consumer) -> np.ndarray:
        """One node all-gather of every rank's sizes, then the checks every rank makes alike (the agreed matrix)."""
        g = self.node_size
        bad = self._problem(send, recv_numel, dtype, device, ready, consumer)
        row = torch.zeros(3 + 2 * g, dtype=torch.int64)
        if bad is None:
            row[1] = dtype.itemsize
            row[2] = _DTYPES.index(dtype) if dtype in _DTYPES else -1
            send_n, recv_n = self._sizes(send, recv_numel)
            row[3:3 + g] = torch.tensor(send_n)
            row[3 + g:] = torch.tensor(recv_n)
        else:
            row[0] = 1
        rows = self.control.all_gather(row, f"copy path ({op}): split exchange", scope="node")
        if bad is not None:
            raise ValueError(f"copy path ({op}): {bad}")
        failed = [r for r in range(g) if rows[r, 0]]
        if failed:
            raise ValueError(f"copy path ({op}): node rank(s) {failed} passed invalid arguments (their error says "
                             "which); no data was exchanged")
        codes = rows[:, 2].tolist()
        if len(set(codes)) != 1 or len(set(rows[:, 1].tolist())) != 1:
            names = [str(_DTYPES[c]).removeprefix("torch.") if c >= 0 else f"{int(b)}-byte type"
                     for c, b in zip(codes, rows[:, 1].tolist(), strict=True)]
            raise ValueError(f"copy path ({op}): node ranks disagree on the dtype (per node rank: {names}); every "
                             "rank must pass the same dtype")
        send_GG, recv_GG = rows[:, 3:3 + g], rows[:, 3 + g:]
        diff = (send_GG != recv_GG.t()).nonzero().tolist()
        if diff:
            s, r = diff[0]
            raise ValueError(f"copy path ({op}): node rank {s} sends {int(send_GG[s, r])} elements to node rank {r}, "
                             f"which expects {int(recv_GG[r, s])}; send and recv_numel must match pairwise")
        return send_GG.numpy()

    def _results(self, recv_numel, make) -> dict[int, torch.Tensor]:
        """{q: make(q)} for every q asked for (``make`` returns the tensor of q's elements)."""
        return {q: make(q) for q in sorted(recv_numel)}


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
