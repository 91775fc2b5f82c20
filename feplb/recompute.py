"""Activation checkpointing of the MoE layer: a recompute replays the forward it recomputes.

A forward is collective and plans from live counts, timing and the policy's history, so running it again in the
backward pass would not repeat it: the plan could differ (another fallback decision, a history that has moved on,
another placement), and with non-reentrant checkpointing the tensors it saves must be the very ones the first
forward saved. So every training forward that may be recomputed leaves a :class:`Record` of what it decided (the
placement and policy state it ran under, the gathered counts, the plan it executed or its fallback), and a forward
that runs inside a backward pass (``torch.utils.checkpoint`` in either mode, transformers' gradient checkpointing,
``checkpoint_wrapper``) finds its record and executes exactly that again: same layouts, same copies, same GEMMs,
no planning, no agreement, no history update. Its collectives still run, in the same order on every rank.

Which forwards may be recomputed: training-mode forwards that run without autograd recording (reentrant
checkpointing runs the first forward under ``no_grad``) or under saved-tensor hooks (non-reentrant checkpointing).
A plain training forward leaves none. Records are found by content, not order (a recompute may come in any order:
gradient accumulation over one backward, pipeline schedules): each rank marks the records whose counts of its own
rows per expert equal the recompute's, the ranks intersect their marks in one all-gather and take the oldest
common record. A record nobody recomputes (a ``no_grad`` forward in training mode, say) ages out: at most
``MAX_RECORDS`` are kept, identically on every rank.

Legend: W EP ranks, E experts.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["MAX_RECORDS", "Record", "Records", "in_backward", "may_be_recomputed"]

MAX_RECORDS = 62
"""Records kept per layer (a bit each in one int64 of the matching all-gather)."""


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass (a checkpoint recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def may_be_recomputed() -> bool:
    """Whether a forward running now may be recomputed by activation checkpointing: autograd is not recording
    (reentrant checkpointing's first forward) or saved-tensor hooks are active (non-reentrant checkpointing)."""
    return not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@dataclass(frozen=True, kw_only=True, eq=False)
class Record:
    """What one forward decided, for its recompute to execute again.

    placement / slot_of_E: the placement it grouped its rows by (``feplb.replicas.Placement``, its device map);
    plan_state: the policy state it planned from; counts: the gathered ``feplb.steps.Counts``; direct: it took the
    peers' direct path; plan: the plan it executed (None: none, or it fell back); fell_back: the node agreed to
    compute at home."""

    placement: Any
    slot_of_E: torch.Tensor
    plan_state: Any
    counts: Any
    direct: bool
    plan: Any
    fell_back: bool

    def local_counts_E(self, rank: int) -> np.ndarray:
        """int64 [E]: the rows this rank sent to each expert in that forward."""
        return self.counts.counts_WE[rank]


class Records:
    """The records of one layer, oldest first, identical on every rank (appended by collective forwards, taken by
    agreed choices)."""

    def __init__(self, max_records: int = MAX_RECORDS):
        if not 1 <= max_records <= MAX_RECORDS:
            raise ValueError(f"max_records must be in [1, {MAX_RECORDS}], got {max_records}")
        self._items: collections.deque[tuple[int, Record]] = collections.deque(maxlen=max_records)
        self._next = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, record: Record) -> None:
        self._items.append((self._next, record))
        self._next += 1

    def first_seq(self) -> int:
        """The sequence number of the oldest record kept (the next one's when none is kept)."""
        return self._items[0][0] if self._items else self._next

    def mask(self, rank: int, local_counts_E: np.ndarray) -> int:
        """Bit i set when the i-th oldest record's counts of this rank's rows equal ``local_counts_E``."""
        bits = 0
        for i, (_, rec) in enumerate(self._items):
            if np.array_equal(rec.local_counts_E(rank), local_counts_E):
                bits |= 1 << i
        return bits

    def take(self, common: int) -> Record:
        """Remove and return the oldest record whose bit is set in ``common`` (the ranks' masks intersected)."""
        if common <= 0:
            raise ValueError(f"common: expected a non-empty mask, got {common}")
        i = (common & -common).bit_length() - 1
        if i >= len(self._items):
            raise ValueError(f"common: bit {i} names no record (holding {len(self._items)})")
        seq_rec = self._items[i]
        del self._items[i]
        return seq_rec[1]
