"""Expert weights a helper received, let go after its forward and copied to it again for the backward
(``FEPLBConfig.recopy_weights``, the paper's scheme).

A helper computes rows of other GPUs' experts with weights their owners sent it this micro-batch. The hosted GEMMs'
backward needs those weights again (the input gradient multiplies by them), so by default autograd keeps them from
the forward to the backward. With a :class:`Recopy` the hosted GEMMs save them as a recipe instead
(``feplb.experts.rebuilt_in_backward``), whose rebuild reads what the same exchange receives a second time, in the
backward. That second exchange starts as soon as the gradient of the layer's expert outputs arrives
(:meth:`Recopy.start_at`: a hook on the tensor ``MoELayer._experts`` returns, which every rank of the exchange
reaches in the same order, before the backward of the reverse all-to-all and of every collective that carries the
hosted GEMMs' outputs). On a GPU, over CUDA IPC inside the node, its copies then run on the copy stream beside the
reverse all-to-all's backward, and the compute stream waits for them when the hosted GEMMs' backward reads them
(:meth:`Recopy.received`), or before, where the results-home exchange's backward queues behind them on the copy
stream (elsewhere it waits at once: :meth:`Recopy.overlaps`). Where that hook has not
run (a backward that starts inside the layer), it starts first in the backward of that collective (phase 2: the
results-home exchange; the peers' direct path: the reverse all-to-all): :meth:`Recopy.start` there too. Gradients of the
received weights still return to their owners through the first exchange's backward.

The owners send the same tensors again. They are saved as autograd would save them: through an enclosing
``rebuilt_in_backward`` block's hooks where an adapter derives its experts' weights per forward (so they are not held
either), else as they are. Before copying, the ranks of the exchange agree (one host collective) that every owner
still has them as the forward read them: an in-place change in between (an optimizer step before the backward)
raises the same RuntimeError on all of them, naming the rank and the expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from feplb.dispatch import Exchange, Received, refuse_compiled_autograd, settle_abandoned
from feplb.experts import rebuilding_applies

__all__ = ["Recopy"]

_NO_RANK = (1 << 63) - 1


class Recopy:
    """One exchange of expert weights (``ex``), run again in the backward.

    Args:
        ex: the exchange that carried the weights in the forward (weight items only).
        spec: this rank's sends in the exchange's order, ``("w", part, expert)`` each (``feplb.phase2.materialize``).
        sends: the tensors this rank sent (views of its weights; the same order).
        control: the layer's ``feplb.control.Control``; the agreement runs over the ranks of the exchange: the node,
            or the group where it crosses nodes.
        rank: this EP rank (in errors).
    """

    @classmethod
    def of(cls, ex: Exchange, spec: tuple, sends: list[torch.Tensor], control, rank: int) -> Recopy | None:
        """The exchange's Recopy where this forward saves for a backward that uses it (the exchange active here,
        :func:`feplb.experts.rebuilding_applies`: alike on every rank of the exchange), else None."""
        return cls(ex, spec, sends, control, rank) if ex.active and rebuilding_applies() else None

    def __init__(self, ex: Exchange, spec: tuple, sends: list[torch.Tensor], control, rank: int):
        if len(spec) != len(sends):
            raise ValueError(f"{ex.op}: {len(spec)} sends specified, {len(sends)} given")
        self.ex, self.control, self.rank = ex, control, rank
        self.scope = "group" if ex.layout.cross_node else "node"
        self.experts = tuple((s[1], s[2]) for s in spec)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._unpack: Callable | None = None
        if hooks is not None and getattr(hooks[0], "feplb_rebuilt", False):
            pack, self._unpack = hooks   # an adapter's block: its derived weights are saved as its recipe
            self._saved = [pack(t.detach()) for t in sends]
        else:
            self._saved = [(t.detach(), t._version) for t in sends]
        self.got: Received | None = None
        self._pending: tuple | None = None   # started in the backward, not yet read: (buffers, event, anchor)

    def _sends(self) -> tuple[list[torch.Tensor], int | None, str]:
        """The tensors to send again; the index of the first this rank cannot send as the forward read it (None if
        none) and why."""
        out = []
        for i, saved in enumerate(self._saved):
            if self._unpack is not None:
                try:
                    out.append(self._unpack(saved))
                except RuntimeError as exc:   # the enclosing block's recipe: changed in place, or freed
                    return out, i, str(exc)
                continue
            t, v = saved
            if t._version != v:
                return out, i, f"version {v} -> {t._version}"
            out.append(t)
        return out, None, ""

    def start_at(self, y: torch.Tensor) -> None:
        """Start the exchange again (:meth:`start`) in the first backward that reaches ``y``'s gradient: ``y`` is the
        layer's expert outputs, downstream of every collective whose backward would otherwise run it, on every rank
        of the exchange. Nothing is registered where ``y`` records no graph."""
        if not y.requires_grad:
            return
        cell = [self]

        def hook(_grad):
            refuse_compiled_autograd("recopy of the weights for the backward")
            settle_abandoned()   # (an earlier backward's that raised: it ends before this backward's collectives)
            rc, cell[0] = cell[0], None   # once (a second backward copies nothing again), and let go of it
            if rc is not None:
                rc.start()

        y.register_hook(hook)

    def start(self) -> dict[int, torch.Tensor] | None:
        """Collective over the ranks of the exchange (once: None, and nothing done, once started; also the
        ``on_backward`` of the first collective carrying the hosted GEMMs' outputs, where :meth:`start_at` did not run):
        agree that every owner can send what it sent in the forward, then issue the exchange again without
        autograd. Returns the buffers it receives ({source: buffer}). On a GPU its copies run on the copy stream
        after what the calling thread's stream has queued so far, and that stream waits for them in
        :meth:`received`, or at once where they must not overlap the next collective (:meth:`overlaps`)."""
        if self._saved is None:
            return None
        sends, bad, why = self._sends()
        # the lowest rank that cannot, and its first such send's part and expert: (rank << 40) | (expert << 8) | part
        code = _NO_RANK if bad is None else self.rank << 40 | self.experts[bad][1] << 8 | self.experts[bad][0]
        agreed = self.control.all_reduce_min(torch.tensor([code], dtype=torch.int64), self.scope,
                                             f"{self.ex.op}, again for the backward")
        code = int(agreed[0])
        if code != _NO_RANK:
            r, e, part = code >> 40, code >> 8 & (1 << 32) - 1, code & 255
            raise RuntimeError(f"{self.ex.op}, again for the backward (FEPLBConfig.recopy_weights): part {part} of "
                               f"expert {e}'s weights was modified in place on EP rank {r} between the forward and "
                               "its backward, and its helpers need them as the forward read them"
                               f"{f' ({why})' if bad is not None else ''}; step the optimizer after the backward")
        ready = None
        if self.ex.device.type == "cuda":   # the sends (an adapter's recipe made them just now) are ready here
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.ex.device))
        got, done = self.ex.issue(sends, ready, handoff=ready is not None)
        self._saved = None   # (an adapter's packs keep its recipe, and its weights derived again, alive)
        self._pending = got, done, sends[0].new_empty(0) if sends else torch.empty(0)
        if not self.overlaps():
            self._finish()
        return got

    def overlaps(self) -> bool:
        """Whether the copies may still run when the calling thread's stream goes on to the next collective (the
        reverse all-to-all's backward): only over CUDA IPC inside the node, whose copies are copy-engine copies
        ordered by events and host barriers. NVSHMEM's on-stream barriers on the transport's team, an NCCL
        communicator of the node's, or a part crossing nodes through the transport itself would be in flight
        beside that collective: there the stream waits for the copies at once."""
        return self.ex.comm.copy.name == "ipc" and not self.ex.layout.cross_node

    def _finish(self) -> None:
        got, done, anchor = self._pending
        self._pending = None
        self.got = self.ex.received(self.ex.handed(got, done), anchor)

    def received(self) -> Received:
        """What the exchange received: the forward's while the forward uses it, then the backward's (on a GPU the
        calling thread's stream waits for its copies here)."""
        if self._pending is not None:
            self._finish()
        if self.got is None:
            raise RuntimeError(f"{self.ex.op}: the hosted GEMMs' backward needs the expert weights copied again, and "
                               "they were not (the collective that copies them has not run its backward)")
        return self.got
