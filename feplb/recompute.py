"""Activation checkpointing of the MoE layer: a recompute replays the forward it recomputes.

A forward is collective and plans from live counts, timing and the policy's history, so running it again in the
backward pass would not repeat it: the plan could differ (another fallback decision, a history that has moved on,
another placement), and with non-reentrant checkpointing the tensors it saves must be the very ones the first
forward saved. So every training forward that may be recomputed leaves a :class:`Record` of what it decided (the
placement and policy state it ran under, the gathered counts, the plan it executed or its fallback), and a forward
that runs inside a backward pass (``torch.utils.checkpoint`` in either mode, transformers' gradient checkpointing,
``checkpoint_wrapper``) finds its record and executes exactly that again: same layouts, same copies, same GEMMs,
no planning, no agreement, no history update. Its collectives still run, in the same order on every rank.

Which forwards leave a record: one under saved-tensor hooks with grad enabled (non-reentrant checkpointing, in any
mode) a ``hooks`` record, holding the innermost ``torch.utils.checkpoint`` frame among the active hooks; one under
``no_grad`` in training mode (reentrant checkpointing runs its first forward so) a ``no_grad`` record; a plain
forward none. A recompute finds its record in one all-gather of per-rank bit masks (a bit per record kept, at most
``MAX_RECORDS``), intersected, so that every rank takes the same one:

* under a checkpoint frame (non-reentrant checkpointing): a record of that very frame with equal counts (the layer
  called several times in the block: in forward order);
* else the one ``hooks`` record of a checkpoint still alive, or made under saved-tensor hooks with no checkpoint
  among them (no frame) and never replayed, whose counts of every rank's rows per expert equal the recompute's (a
  checkpoint nested in a recomputed one runs under a new frame, also on a second backward; a checkpoint whose
  backward never ran is gone, and so is its record's claim; several cannot be told apart: refused);
* else the oldest ``no_grad`` record with equal counts (reentrant checkpointing, also nested with the other kind).
  A reentrant recompute builds a graph of its own, so an equal forward's record (old log-probabilities computed
  under ``no_grad`` in RL, say) computes the same function, up to rounding.

Among a frame's own candidates, records replayed fewer times in the current backward pass come first (a second
backward through the same graph, with ``retain_graph=True``, replays them again, in order; so does a backward
retried after one that raised midway); among the ``no_grad`` candidates, those replayed fewer times ever (each of
several equal micro-batches, backwarded one by one, its own). A checkpoint whose first run is itself a replay (one
nested in a reentrant checkpoint's recompute) binds its frame to the record it repeats, for its own recompute:
kept beside the records, gone with the frame. Where per-step copies are
held, only records of their current generation are candidates; a match of an older one only means that
``refresh_replicas()`` ran between a forward and its recompute, which raises. Records are kept after a replay and
age out.

Legend: W EP ranks, E experts.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feplb.frames import caller_frame

__all__ = ["MAX_RECORDS", "Record", "Records", "checkpoint_frame", "hooks_active", "in_backward", "record_kind"]

MAX_RECORDS = 62
"""Records kept per layer (a bit each in one int64 of the matching all-gather)."""


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass (a checkpoint recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def _top_hooks() -> tuple[Callable, Callable] | None:
    """The active saved-tensor hooks, or None; FEPLB's own (``feplb.experts.rebuilt_in_backward``, around a plain
    forward of an adapter: they never run under other hooks) count as none."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if hooks is None or getattr(hooks[0], "feplb_rebuilt", False) else hooks


def hooks_active() -> bool:
    """Whether saved-tensor hooks are active (non-reentrant checkpointing, in its forward and its recompute)."""
    return _top_hooks() is not None


def _hooks_stack(depth: int = 16) -> list[tuple[Callable, Callable]]:
    """The active saved-tensor hooks, the top ones first (at most ``depth``): torch exposes the top of its
    thread-local stack only, so the pairs are popped and pushed back, unchanged and in order, before returning (not
    where pushing is disabled, ``torch.autograd.graph.disable_saved_tensors_hooks``: then the top pair only)."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return [] if top is None else [top]
    popped: list[tuple[Callable, Callable]] = []
    try:
        while len(popped) < depth:
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if hooks is None:
                break
            popped.append(hooks)
            torch._C._autograd._pop_saved_tensors_default_hooks()
    finally:
        for pack, unpack in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return popped


def _frame_of(pack: Callable) -> Any | None:
    """The ``torch.utils.checkpoint`` frame a pack hook belongs to, read from its closure; None for other hooks."""
    fn = pack
    for _ in range(4):   # the recompute's hook is wrapped by torch._dynamo.disable
        inner = getattr(fn, "__wrapped__", None) or getattr(fn, "_torchdynamo_orig_callable", None)
        if inner is None:
            break
        fn = inner
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:   # an empty cell
            continue
        if isinstance(value, weakref.ref):
            value = value()
        if type(value).__name__ == "_CheckpointFrame":
            return value
    return None


def checkpoint_frame() -> Any | None:
    """The innermost ``torch.utils.checkpoint`` frame among the active saved-tensor hooks (non-reentrant
    checkpointing: the same object in the forward and in its recompute), also below other hooks pushed inside the
    checkpointed block (``save_on_cpu`` there, pushed again in the recompute); None where no hooks are active (or
    only FEPLB's own), or none of them is a checkpoint's (or torch keeps it otherwise)."""
    top = _top_hooks()
    if top is None:
        return None
    frame = _frame_of(top[0])
    if frame is not None:
        return frame
    for pack, _ in _hooks_stack()[1:]:
        frame = _frame_of(pack)
        if frame is not None:
            return frame
    return None


def hidden_from_selective_checkpoint(fn: Callable) -> Callable:
    """``fn`` run outside selective activation checkpointing: what only a forward does (the counts all-gather, its
    stats and history, the per-step copies' guard), what only a recompute does (its counts, the search for its
    record), and communication that writes into buffers it just made (the transports, the copy path). Under
    selective activation checkpointing (torch's ``create_selective_checkpoint_contexts``, torchtitan's op-level
    mode) the recompute is matched to its forward op by op, by each op's invocation count, and an op the policy
    saved (torchtitan's saves every device-to-host copy, every other matrix product) hands the recompute the
    forward's result: the recompute must dispatch the forward's ops, in its order, and the control, which differs,
    must not take part; a policy saving every op would cache the communication's new buffers and then refuse their
    writes. Where such a checkpoint's mode is active, and in a backward pass (torch's CommDebugMode fails on a
    collective in a backward that recomputed a checkpoint, a KeyError in its module tracker, whatever module makes
    the collective), ``fn`` runs outside every active dispatch mode (a tool's mode entered around it misses ``fn``'s
    ops there); in a forward outside selective checkpointing the modes see it whole (CommDebugMode counts the
    layer's forward collectives, a memory tracker its buffers)."""

    @functools.wraps(fn)
    def outside(*args, **kwargs):
        with outside_selective_checkpoint():
            return fn(*args, **kwargs)

    return outside


def outside_selective_checkpoint() -> contextlib.AbstractContextManager:
    """A context outside the active dispatch modes where selective activation checkpointing's are among them, or in
    a backward pass (see :func:`hidden_from_selective_checkpoint`), else one that changes nothing. For a forward's
    own scratch work that writes in place into a tensor it just made (say, weights joined and cast in one pass): a
    policy that saves every op caches the new tensor, and torch then refuses the write ("Tensor cached during
    selective activation checkpoint has been mutated"). Hidden from the modes in the forward and in its recompute
    alike, the work is redone at the recompute, not saved."""
    from torch._C import _len_torch_dispatch_stack
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    if not _len_torch_dispatch_stack():
        return contextlib.nullcontext()
    if in_backward():
        return _disable_current_modes()
    sac = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
    if any(isinstance(m, sac) for m in _get_current_dispatch_mode_stack()):
        return _disable_current_modes()
    return contextlib.nullcontext()


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def reentrant_inputs_need_grad(depth: int = 48) -> bool:
    """Whether a forward running now under ``no_grad`` is a reentrant checkpoint's first run
    (``torch.utils.checkpoint(..., use_reentrant=True)``, its ``CheckpointFunction.forward`` among the callers' frames,
    up to ``depth``) whose inputs include a tensor needing grad: only then is its output differentiable and the
    block recomputed in the backward (a rank whose inputs need none never recomputes it)."""
    frame = caller_frame(lambda f: f.f_code.co_name == "forward" and f.f_code.co_filename.endswith(_CHECKPOINT_FILE)
                         and "run_function" in f.f_code.co_varnames, depth)
    return frame is not None and any(isinstance(a, torch.Tensor) and a.requires_grad
                                     for a in frame.f_locals.get("args", ()))


def record_kind() -> str | None:
    """The kind of record a forward running now leaves: ``hooks`` (grad enabled under saved-tensor hooks: a
    non-reentrant checkpoint's forward), ``no_grad`` (a forward under no_grad: maybe a reentrant checkpoint's, in
    train or eval mode: a loop that trains in eval mode to turn dropout off recomputes too), or None (a plain
    forward, which nobody recomputes)."""
    if torch.is_grad_enabled():
        return "hooks" if hooks_active() else None
    return "no_grad"


@dataclass(frozen=True, kw_only=True, eq=False)
class Record:
    """What one forward decided, for its recompute to execute again.

    kind: ``hooks`` or ``no_grad`` (:func:`record_kind`); placement / slot_of_E: the placement it grouped its rows
    by (``feplb.replicas.Placement``, its device map); plan_state: the policy state it planned from; counts: the
    gathered ``feplb.steps.Counts``; direct: it took the peers' direct path; plan: the plan it executed (None: none,
    or it fell back); fell_back: the node agreed to compute at home; generation: the per-step copies it computed
    with (``Replicas.generation``); requires: the flags it took them with (``Replicas.forward_requires``); frame: a
    weak reference to the ``torch.utils.checkpoint`` frame it ran under (:func:`checkpoint_frame`), or None;
    grad_free: it ran with autograd on but made no graph, nothing it read needing grad on any rank (its recompute
    makes none either)."""

    kind: str
    placement: Any
    slot_of_E: torch.Tensor
    plan_state: Any
    counts: Any
    direct: bool
    plan: Any
    fell_back: bool
    generation: int = 0
    frame: Any = None                  # a weakref to the checkpoint frame it ran under (hooks records), or None
    dispatched: bool = False           # a forward_dispatched call (rows at home already, by local expert)
    requires: tuple = ()               # the expert parameters' requires_grad flags it took per-step copies with
    grad_free: bool = False            # autograd was on, but nothing the layer read needed grad on any rank

    def local_counts_E(self, rank: int) -> np.ndarray:
        """int64 [E]: the rows this rank sent to each expert in that forward."""
        return self.counts.counts_WE[rank]


class Records:
    """The records of one layer, oldest first, identical on every rank (appended by collective forwards, chosen by
    agreed masks)."""

    def __init__(self, max_records: int = MAX_RECORDS):
        if not 1 <= max_records <= MAX_RECORDS:
            raise ValueError(f"max_records must be in [1, {MAX_RECORDS}], got {max_records}")
        self._items: collections.deque[tuple[int, Record]] = collections.deque(maxlen=max_records)
        self._next = 0
        self._replayed: dict[int, int] = {}   # seq -> times replayed
        # seq -> (the backward pass (autograd graph task) of its last replays, how many there): a frame's own
        # records are taken in order within each pass, so a backward retried after one that raised midway (with
        # retain_graph=True) repeats them in order again, as a second backward does
        self._in_pass: dict[int, tuple[int, int]] = {}
        # checkpoint frame -> the records bound to it ([record, (graph task, replays there)], oldest first): a
        # checkpoint whose first run was itself a replay (nested in a reentrant checkpoint's recompute) repeats in
        # its own recompute what that run repeated. Kept outside the window, gone with the frame.
        self._bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, record: Record) -> None:
        if len(self._items) == self._items.maxlen:
            self._replayed.pop(self._items[0][0], None)
            self._in_pass.pop(self._items[0][0], None)
        self._items.append((self._next, record))
        self._next += 1

    @staticmethod
    def _in_this_pass(entry: tuple[int, int] | None) -> int:
        """Replays counted in ``entry`` (graph task, replays) that belong to the current backward pass."""
        return entry[1] if entry is not None and entry[0] == torch._C._current_graph_task_id() else 0

    def first_seq(self) -> int:
        """The sequence number of the oldest record kept (the next one's when none is kept)."""
        return self._items[0][0] if self._items else self._next

    def mask(self, pred: Callable[[Record, int], bool]) -> int:
        """Bit i set when ``pred(record, times replayed)`` holds for the i-th oldest record."""
        bits = 0
        for i, (seq, rec) in enumerate(self._items):
            if pred(rec, self._replayed.get(seq, 0)):
                bits |= 1 << i
        return bits

    @staticmethod
    def _fewest(counts: list[int], bits: int) -> int:
        """The bits of ``bits`` whose ``counts`` are the smallest among them."""
        named = [i for i in range(len(counts)) if bits >> i & 1]
        fewest = min((counts[i] for i in named), default=0)
        return sum(1 << i for i in named if counts[i] == fewest)

    def least_replayed(self, bits: int, this_pass: bool = False) -> int:
        """The bits of ``bits`` whose records were replayed the fewest times: ever (a first recompute before a
        second backward's), or with ``this_pass`` in the current backward pass (a frame's own records: within a
        pass in forward order; a second backward, or one retried after a backward that raised midway, from the
        first again)."""
        return self._fewest([self._in_this_pass(self._in_pass.get(seq)) if this_pass else self._replayed.get(seq, 0)
                             for seq, _ in self._items], bits)

    def _pick(self, bits: int, this_pass: bool = False) -> int:
        """The index of the record :meth:`take` takes from ``bits``, taking nothing."""
        bits = self.least_replayed(bits, this_pass)
        if bits <= 0:
            raise ValueError(f"expected a non-empty mask, got {bits}")
        return (bits & -bits).bit_length() - 1   # least_replayed kept only bits that name a record

    def _take_at(self, i: int) -> Record:
        """The i-th oldest record, counted as replayed once more (ever, and in this backward pass)."""
        seq, rec = self._items[i]
        self._replayed[seq] = self._replayed.get(seq, 0) + 1
        self._in_pass[seq] = (torch._C._current_graph_task_id(), self._in_this_pass(self._in_pass.get(seq)) + 1)
        return rec

    def take(self, bits: int, this_pass: bool = False) -> Record:
        """Among the records whose bit is set in ``bits`` (agreed by every rank), the oldest of those replayed the
        fewest times (:meth:`least_replayed`); it is counted as replayed once more and kept."""
        return self._take_at(self._pick(bits, this_pass))

    def _pick_bound(self, frame: Any, bits: int) -> int:
        """The index, among the records bound to ``frame``, of the oldest whose bit is set that was replayed the
        fewest times in this pass."""
        bits = self._fewest([self._in_this_pass(e[1]) for e in self._bound[frame]], bits)
        return (bits & -bits).bit_length() - 1

    def _take_bound_at(self, frame: Any, j: int) -> Record:
        """The j-th record bound to ``frame``, counted as replayed once more in this pass."""
        entry = self._bound[frame][j]
        entry[1] = (torch._C._current_graph_task_id(), self._in_this_pass(entry[1]) + 1)
        return entry[0]

    def replayed(self) -> int:
        """How many of the records kept were replayed (at least once)."""
        return len(self._replayed)

    def candidates(self, local_E: np.ndarray, rank: int, generation: int, held: bool, dispatched: bool,
                   layer_id: int, refused: Callable[[Record], bool] | None = None) -> np.ndarray:
        """This rank's row of the all-gather that picks the record a recompute repeats (:meth:`choose` reads every
        rank's): int64 [13], the bit masks of the records that may be it, in the order they are preferred (of the
        active checkpoint frame; bound to it; ``hooks`` records of a checkpoint still alive, or made under other
        hooks and never replayed; ``no_grad`` ones; older per-step copies' ones, which only explain a refusal),
        then what every rank must share (under a frame, under hooks, the oldest record's number, the records kept,
        those bound to the frame, the layer's number), then the records this rank refuses to repeat (kept; bound to
        the frame).

        local_E: int64 [E] the rows the recompute sends to each expert from this rank; generation / held: the
        per-step copies' generation now, and whether any are held (``Replicas``); dispatched: a
        ``forward_dispatched`` call (whose records only it repeats); refused: whether this rank cannot repeat a
        record (say, the experts' requires_grad flags changed since its forward under a non-reentrant checkpoint):
        every rank then raises together if the record agreed on is one some rank refuses."""
        frame = checkpoint_frame()

        def equal(rec: Record) -> bool:
            return rec.dispatched == dispatched and np.array_equal(rec.local_counts_E(rank), local_E)

        def current(rec: Record) -> bool:   # made with the per-step copies held now (any, when none are held)
            return (not held or rec.generation == generation) and equal(rec)

        def alive(rec: Record) -> bool:
            # the checkpoint it ran under still holds its saved tensors (its forward completed: a block that raised
            # after the layer, its exception kept, keeps a frame that will never recompute)
            f = rec.frame()
            return f is not None and getattr(f, "forward_completed", True)

        bound = self._bound.get(frame, []) if frame is not None else []
        masks = [
            self.mask(lambda rec, n: frame is not None and rec.frame is not None and rec.frame() is frame
                      and equal(rec)),
            sum(1 << i for i, (rec, _) in enumerate(bound) if equal(rec)),
            # of a checkpoint still alive (a nested one's, also on a second backward), or, made under other hooks
            # (no frame), never replayed: a fallback never takes a finished forward's record, nor one whose
            # checkpoint is gone (a forward whose backward never ran)
            self.mask(lambda rec, n: rec.kind == "hooks" and current(rec)
                      and (alive(rec) if rec.frame is not None else n == 0)),
            self.mask(lambda rec, n: rec.kind == "no_grad" and current(rec)),
            self.mask(lambda rec, n: not current(rec) and equal(rec)),
        ]
        no = [self.mask(lambda rec, n: refused(rec)),
              sum(1 << i for i, (rec, _) in enumerate(bound) if refused(rec))] if refused is not None else [0, 0]
        return np.array([*masks, int(frame is not None), int(hooks_active()), self.first_seq(), len(self),
                         len(bound), layer_id, *no], dtype=np.int64)

    def choose(self, rows: np.ndarray, generation: int, held: bool, frame: Any = None,
               refusal: Callable[[list[int], Record], Exception] | None = None) -> Record:
        """The record every rank repeats, from every rank's :meth:`candidates` row (int64 [W, 13], the same on
        every rank, so every rank takes the same record or raises the same error): the first kind of candidate that
        all ranks share (among several ``hooks`` records not of the frame: refused, they cannot be told apart);
        taken (:meth:`take`). frame: the active checkpoint frame (:func:`checkpoint_frame`, present on every rank
        alike, as the rows agree): a record of another forward taken under it (the first run of a non-reentrant
        checkpoint nested in a reentrant one's recompute, which is itself a replay) is bound to it, so that this
        checkpoint's own recompute, under the same frame, repeats that very record and not another of equal
        counts. refusal: the error to raise, on every rank, when the record agreed on is one that some ranks (the
        list) refuse to repeat (``candidates``'s ``refused``); nothing is taken then."""
        if len({int(r[10]) for r in rows}) != 1:
            raise RuntimeError(f"MoELayer: the EP ranks recompute different MoE layers at once (layer number per EP "
                               f"rank: {rows[:, 10].tolist()}); every rank must run the backward of every MoE layer, "
                               "in the same order")
        if len({tuple(int(v) for v in r[5:10]) for r in rows}) != 1:
            raise RuntimeError(f"MoELayer: the ranks recompute differently or hold different forward records "
                               f"(frame, hooks, first, count, bound: {[[int(v) for v in r[5:10]] for r in rows]}); "
                               "every rank must run the same forwards and checkpoint them alike")
        by_frame, bound, hooks, no_grad, older = (int(np.bitwise_and.reduce(rows[:, i])) for i in range(5))

        if by_frame:
            i, col = self._pick(by_frame, this_pass=True), 11
        elif bound:
            i, col = self._pick_bound(frame, bound), 12
        elif hooks and hooks & (hooks - 1) == 0 or no_grad and not hooks:
            i, col = self._pick(hooks or no_grad), 11
        elif hooks:
            raise RuntimeError(
                f"MoELayer: {bin(hooks).count('1')} recorded forwards of this layer under saved-tensor hooks have "
                "the same counts on every rank as this recompute, and none was made under its checkpoint frame: "
                "the one it repeats cannot be told apart; backward each such micro-batch before the next equal one")
        elif older:
            # the same on every rank (refresh_replicas is collective): all raise, none enters the replay
            raise refreshed()
        else:
            raise RuntimeError(
                "MoELayer: activation checkpointing recomputed a forward that matches none of the forwards recorded "
                "for it on every rank: the recompute routes its rows otherwise (a router or routing that is not "
                "deterministic, or inputs that changed: recompute with the same inputs and RNG state, "
                "torch.utils.checkpoint's default preserve_rng_state=True), or its forward left no record (only a "
                "forward under no_grad, or under saved-tensor hooks with grad enabled, does; the "
                f"last {len(self)} are kept)")
        refusing = [w for w in range(rows.shape[0]) if int(rows[w, col]) >> i & 1]
        if refusing:
            # (nothing taken: the same record stays the candidate of a backward retried once that is put right)
            rec = self._items[i][1] if col == 11 else self._bound[frame][i][0]
            raise refusal(refusing, rec) if refusal is not None else RuntimeError(
                f"MoELayer: EP ranks {refusing} refuse to repeat the forward this recompute repeats")
        rec = self._take_at(i) if col == 11 else self._take_bound_at(frame, i)
        if rec.generation != generation and held:
            raise refreshed()
        if frame is not None and not by_frame and not bound:
            # (every rank alike: the rows agree on the frame's presence, its bound records and the record taken)
            self._bound.setdefault(frame, []).append([rec, (torch._C._current_graph_task_id(), 1)])
        return rec


def refreshed() -> RuntimeError:
    """The error of a recompute whose forward's per-step copies were replaced."""
    return RuntimeError("MoELayer: refresh_replicas() ran between a forward and its recompute by activation "
                        "checkpointing: the per-step copies it computed with were replaced, so its backward cannot be "
                        "computed; refresh after optimizer.step(), once the backward is done")
