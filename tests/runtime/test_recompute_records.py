"""The records a recompute finds its forward by (``feplb.recompute.Records``), without processes: content matching,
the agreed choice of the oldest common record, the bound on what is kept, and when a forward may be recomputed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from feplb.recompute import MAX_RECORDS, Record, Records, in_backward, may_be_recomputed
from feplb.steps import read_counts


def _record(counts_WE: np.ndarray, tag: str = "") -> Record:
    W, E = counts_WE.shape
    slots = np.arange(E).reshape(W, E // W)
    gathered = np.concatenate([counts_WE, np.zeros((W, 3), dtype=np.int64)], axis=1)
    counts = read_counts(gathered, slots, balance=True, min_straggler=0.0)
    return Record(placement=tag, slot_of_E=torch.arange(E), plan_state=None, counts=counts, direct=False,
                  plan=None, fell_back=False)


def _random_counts(rng, W=2, E=4):
    return rng.integers(0, 9, size=(W, E)).astype(np.int64)


def test_mask_marks_the_records_whose_counts_of_this_ranks_rows_match():
    rng = np.random.default_rng(0)
    recs = Records()
    counts = [_random_counts(rng) for _ in range(5)]
    counts[3][0] = counts[1][0]        # rank 0's rows alike in records 1 and 3, rank 1's not
    for i, c in enumerate(counts):
        recs.add(_record(c, str(i)))
    assert recs.mask(0, counts[1][0]) == 0b01010
    assert recs.mask(1, counts[1][1]) == 0b00010 | (0b01000 if np.array_equal(counts[3][1], counts[1][1]) else 0)
    assert recs.mask(0, np.full(4, 99)) == 0
    # the ranks' masks intersected name record 1 only: taken, the others kept in order
    assert recs.take(recs.mask(0, counts[1][0]) & recs.mask(1, counts[1][1])).placement == "1"
    assert [r.placement for _, r in recs._items] == ["0", "2", "3", "4"]
    assert recs.first_seq() == 0


def test_take_takes_the_oldest_common_record_in_any_order():
    rng = np.random.default_rng(1)
    recs = Records()
    same = _random_counts(rng)
    for tag in "abc":
        recs.add(_record(same, tag))
    # a recompute of identical counts takes the oldest first, however many there are
    assert [recs.take(recs.mask(0, same[0])).placement for _ in range(3)] == ["a", "b", "c"]
    assert len(recs) == 0 and recs.first_seq() == 3
    with pytest.raises(ValueError, match="non-empty mask"):
        recs.take(0)
    recs.add(_record(same, "d"))
    with pytest.raises(ValueError, match="bit 3 names no record"):
        recs.take(0b1000)


def test_at_most_max_records_are_kept_oldest_dropped_first():
    rng = np.random.default_rng(2)
    recs = Records()
    counts = [_random_counts(rng, E=8) + 100 * i for i in range(MAX_RECORDS + 5)]
    for i, c in enumerate(counts):
        recs.add(_record(c, str(i)))
    assert len(recs) == MAX_RECORDS and recs.first_seq() == 5
    assert recs.mask(0, counts[0][0]) == 0                  # aged out
    last = recs.mask(0, counts[-1][0])
    assert last == 1 << (MAX_RECORDS - 1) and last < 2**63    # fits one int64 of the all-gather
    assert recs.take(last).placement == str(MAX_RECORDS + 4)
    with pytest.raises(ValueError, match="max_records"):
        Records(MAX_RECORDS + 1)


def test_which_forwards_may_be_recomputed():
    seen = []

    def f(x):
        seen.append((may_be_recomputed(), in_backward()))
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()                                          # plain training forward
    with torch.no_grad():
        f(x)                                                       # no_grad: reentrant checkpointing's first run
    checkpoint(f, x, use_reentrant=True).sum().backward()          # first run under no_grad, recompute in backward
    checkpoint(f, x, use_reentrant=False).sum().backward()         # saved-tensor hooks in both runs
    assert seen == [(False, False), (True, False), (True, False), (False, True), (True, False), (True, True)]
