"""Activation checkpointing of the MoE layer: a recompute replays the forward it recomputes.

A forward is collective and plans from live counts, timing and the policy's history, so running it again in the
backward pass would not repeat it: the plan could differ (another fallback decision, a history that has moved on,
another placement), and with non-reentrant checkpointing the tensors it saves must be the very ones the first
forward saved. So every training forward that may be recomputed leaves a :class:`Record` of what it decided (the
placement and policy state it ran under, the gathered counts, the plan it executed or its fallback), and a forward
that runs inside a backward pass (``torch.utils.checkpoint`` in either mode, transformers' gradient checkpointing,
``checkpoint_wrapper``) finds its record and executes exactly that again: same layouts, same copies, same GEMMs,
no planning, no agreement, no history update. Its collectives still run, in the same order on every rank.

Which forwards may be recomputed, and which records a recompute looks at: reentrant checkpointing runs the first
forward under ``no_grad`` and recomputes without saved-tensor hooks; non-reentrant checkpointing runs both under
saved-tensor hooks, with autograd recording. So a forward under hooks with grad enabled leaves a ``hooks`` record
(in any mode), a training-mode forward under ``no_grad`` a ``no_grad`` record, a plain training forward none; a
recompute under hooks looks at ``hooks`` records only, one without at ``no_grad`` records only. A ``no_grad``
forward that nobody recomputes (old log-probabilities in RL, say) can thus never be taken for a non-reentrant
checkpoint's forward; for a reentrant one, whose recompute builds a graph of its own, a record of an equal forward
(the same counts on every rank) computes the same function, up to rounding.

Records are found by content, not order (a recompute may come in any order: gradient accumulation over one backward,
pipeline schedules): each rank marks the records whose counts of its own rows per expert equal the recompute's,
the ranks intersect their marks in one all-gather and take the oldest common record not yet replayed, or, for a
second backward through the same graph (``retain_graph=True``), the newest one already replayed. Records are kept
after a replay and age out: at most ``MAX_RECORDS``, identically on every rank.

Legend: W EP ranks, E experts.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["MAX_RECORDS", "Record", "Records", "hooks_active", "in_backward", "recompute_kind", "record_kind"]

MAX_RECORDS = 62
"""Records kept per layer (a bit each in one int64 of the matching all-gather)."""


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass (a checkpoint recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def hooks_active() -> bool:
    """Whether saved-tensor hooks are active (non-reentrant checkpointing, in its forward and its recompute)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def record_kind(training: bool) -> str | None:
    """The kind of record a forward running now leaves: ``hooks`` (grad enabled under saved-tensor hooks: a
    non-reentrant checkpoint's forward), ``no_grad`` (a training forward under no_grad: maybe a reentrant
    checkpoint's), or None (a plain forward, which nobody recomputes)."""
    if torch.is_grad_enabled():
        return "hooks" if hooks_active() else None
    return "no_grad" if training else None


def recompute_kind() -> str:
    """The kind of record a recompute running now (inside a backward pass) replays."""
    return "hooks" if hooks_active() else "no_grad"


@dataclass(frozen=True, kw_only=True, eq=False)
class Record:
    """What one forward decided, for its recompute to execute again.

    kind: ``hooks`` or ``no_grad`` (:func:`record_kind`); placement / slot_of_E: the placement it grouped its rows
    by (``feplb.replicas.Placement``, its device map); plan_state: the policy state it planned from; counts: the
    gathered ``feplb.steps.Counts``; direct: it took the peers' direct path; plan: the plan it executed (None: none,
    or it fell back); fell_back: the node agreed to compute at home; generation: the per-step copies it computed
    with (``Replicas.generation``)."""

    kind: str
    placement: Any
    slot_of_E: torch.Tensor
    plan_state: Any
    counts: Any
    direct: bool
    plan: Any
    fell_back: bool
    generation: int = 0

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
        self._replayed: set[int] = set()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, record: Record) -> None:
        if len(self._items) == self._items.maxlen:
            self._replayed.discard(self._items[0][0])
        self._items.append((self._next, record))
        self._next += 1

    def first_seq(self) -> int:
        """The sequence number of the oldest record kept (the next one's when none is kept)."""
        return self._items[0][0] if self._items else self._next

    def masks(self, rank: int, local_counts_E: np.ndarray, kind: str) -> tuple[int, int]:
        """(not yet replayed, replayed): bit i set when the i-th oldest record is of ``kind`` and its counts of this
        rank's rows equal ``local_counts_E``."""
        fresh = replayed = 0
        for i, (seq, rec) in enumerate(self._items):
            if rec.kind == kind and np.array_equal(rec.local_counts_E(rank), local_counts_E):
                if seq in self._replayed:
                    replayed |= 1 << i
                else:
                    fresh |= 1 << i
        return fresh, replayed

    def take(self, fresh: int, replayed: int) -> Record:
        """The record the ranks' intersected masks choose: the oldest not yet replayed, else the newest replayed (a
        second backward through the same graph); it is marked replayed and kept."""
        if fresh > 0:
            i = (fresh & -fresh).bit_length() - 1
        elif replayed > 0:
            i = replayed.bit_length() - 1
        else:
            raise ValueError(f"expected a non-empty mask, got {fresh} and {replayed}")
        if i >= len(self._items):
            raise ValueError(f"bit {i} names no record (holding {len(self._items)})")
        seq, rec = self._items[i]
        self._replayed.add(seq)
        return rec

    def replayed(self) -> int:
        """How many of the records kept were replayed."""
        return len(self._replayed)
