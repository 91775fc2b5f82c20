"""The records a recompute finds its forward by (``feplb.recompute``), without processes: bit masks over the records
kept, the choice they make (the oldest of those replayed the fewest times), the bound on what is kept, which
forwards leave which kind of record, and the checkpoint frame read from torch's hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from feplb.recompute import MAX_RECORDS, Record, Records, checkpoint_frame, hooks_active, in_backward, record_kind
from feplb.steps import read_counts


def _record(counts_WE: np.ndarray, tag: str = "", kind: str = "hooks") -> Record:
    W, E = counts_WE.shape
    slots = np.arange(E).reshape(W, E // W)
    gathered = np.concatenate([counts_WE, np.zeros((W, 6), dtype=np.int64)], axis=1)
    counts = read_counts(gathered, slots, balance=True, min_straggler=0.0)
    return Record(kind=kind, placement=tag, slot_of_E=torch.arange(E), plan_state=None, counts=counts, direct=False,
                  plan=None, fell_back=False)


def _random_counts(rng, W=2, E=4):
    return rng.integers(0, 9, size=(W, E)).astype(np.int64)


def test_masks_and_takes():
    rng = np.random.default_rng(0)
    recs = Records()
    counts = [_random_counts(rng) for _ in range(5)]
    counts[3] = counts[1].copy()
    counts[3][1] += 1                  # rank 0's rows alike in records 1 and 3, rank 1's not
    counts[4] = counts[1].copy()       # record 4: equal counts, another kind
    for i, c in enumerate(counts):
        recs.add(_record(c, str(i), kind="no_grad" if i == 4 else "hooks"))

    def matching(rank, kind):
        return recs.mask(lambda rec, replayed: rec.kind == kind and np.array_equal(rec.local_counts_E(rank),
                                                                                   counts[1][rank]))

    assert matching(0, "hooks") == 0b01010 and matching(1, "hooks") == 0b00010
    assert matching(0, "no_grad") == 0b10000
    # the ranks' masks intersected name record 1: taken and kept, marked replayed
    assert recs.take(matching(0, "hooks") & matching(1, "hooks")).placement == "1"
    assert len(recs) == 5 and recs.replayed() == 1
    assert recs.mask(lambda rec, replayed: replayed) == 0b00010
    # the oldest of those replayed the fewest times: a second pass (retain_graph) replays them in order again
    assert [recs.take(0b01110).placement for _ in range(5)] == ["2", "3", "1", "2", "3"]
    assert recs.least_replayed(0b11110) == 0b10000
    with pytest.raises(ValueError, match="non-empty mask"):
        recs.take(0)
    with pytest.raises(ValueError, match="non-empty mask"):
        recs.take(0b100000)     # a bit past the records kept names none


def test_at_most_max_records_are_kept_oldest_dropped_first():
    rng = np.random.default_rng(2)
    recs = Records()
    counts = [_random_counts(rng, E=8) + 100 * i for i in range(MAX_RECORDS + 5)]
    for i, c in enumerate(counts):
        recs.add(_record(c, str(i)))
        if i == 2:
            recs.take(1 << 2)
    assert len(recs) == MAX_RECORDS and recs.first_seq() == 5
    assert recs.replayed() == 0                                   # the replayed one aged out with its mark
    first = recs.mask(lambda rec, replayed: np.array_equal(rec.local_counts_E(0), counts[0][0]))
    last = recs.mask(lambda rec, replayed: np.array_equal(rec.local_counts_E(0), counts[-1][0]))
    assert first == 0                                             # aged out
    assert last == 1 << (MAX_RECORDS - 1) and last < 2**63       # fits one int64 of the all-gather
    assert recs.take(last).placement == str(MAX_RECORDS + 4)
    with pytest.raises(ValueError, match="max_records"):
        Records(MAX_RECORDS + 1)


def test_which_forwards_leave_which_record_and_what_a_recompute_sees():
    seen = []

    def f(x):
        frame = checkpoint_frame()
        seen.append(("recompute" if in_backward() else record_kind(), hooks_active(), frame))
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()                                          # plain forward: no record
    with torch.no_grad():
        f(x)                                                       # under no_grad: maybe a reentrant checkpoint's
    checkpoint(f, x, use_reentrant=True).sum().backward()          # no_grad first run, recompute without hooks
    checkpoint(f, x, use_reentrant=False).sum().backward()         # saved-tensor hooks in both runs
    checkpoint(f, x, use_reentrant=False).sum().backward()         # another frame
    with torch.autograd.graph.save_on_cpu():
        f(x).sum().backward()                                      # other hooks: a hooks record without a frame
    kinds = [(k, h, fr is not None) for k, h, fr in seen]
    assert kinds == [(None, False, False), ("no_grad", False, False),
                     ("no_grad", False, False), ("recompute", False, False),
                     ("hooks", True, True), ("recompute", True, True),
                     ("hooks", True, True), ("recompute", True, True),
                     ("hooks", True, False)]
    # a non-reentrant recompute runs under the very frame its forward ran under, and each checkpoint has its own
    assert seen[4][2] is seen[5][2] and seen[6][2] is seen[7][2] and seen[4][2] is not seen[6][2]
