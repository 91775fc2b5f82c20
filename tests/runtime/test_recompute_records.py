"""The records a recompute finds its forward by (``feplb.recompute.Records``), without processes: content matching
by kind, the agreed choice (the oldest not yet replayed, else the newest replayed), the bound on what is kept, and
which forwards leave which kind of record."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from feplb.recompute import MAX_RECORDS, Record, Records, in_backward, recompute_kind, record_kind
from feplb.steps import read_counts


def _record(counts_WE: np.ndarray, tag: str = "", kind: str = "hooks") -> Record:
    W, E = counts_WE.shape
    slots = np.arange(E).reshape(W, E // W)
    gathered = np.concatenate([counts_WE, np.zeros((W, 3), dtype=np.int64)], axis=1)
    counts = read_counts(gathered, slots, balance=True, min_straggler=0.0)
    return Record(kind=kind, placement=tag, slot_of_E=torch.arange(E), plan_state=None, counts=counts, direct=False,
                  plan=None, fell_back=False)


def _random_counts(rng, W=2, E=4):
    return rng.integers(0, 9, size=(W, E)).astype(np.int64)


def test_masks_mark_the_records_of_the_kind_whose_counts_of_this_ranks_rows_match():
    rng = np.random.default_rng(0)
    recs = Records()
    counts = [_random_counts(rng) for _ in range(5)]
    counts[3] = counts[1].copy()
    counts[3][1] += 1                  # rank 0's rows alike in records 1 and 3, rank 1's not
    counts[4] = counts[1].copy()       # record 4: equal counts, but another kind
    for i, c in enumerate(counts):
        recs.add(_record(c, str(i), kind="no_grad" if i == 4 else "hooks"))
    assert recs.masks(0, counts[1][0], "hooks") == (0b01010, 0)
    assert recs.masks(1, counts[1][1], "hooks") == (0b00010, 0)
    assert recs.masks(0, counts[1][0], "no_grad") == (0b10000, 0)
    assert recs.masks(0, np.full(4, 99), "hooks") == (0, 0)
    # the ranks' masks intersected name record 1: taken and kept, marked replayed
    assert recs.take(0b01010 & 0b00010, 0).placement == "1"
    assert len(recs) == 5 and recs.replayed() == 1
    assert recs.masks(0, counts[1][0], "hooks") == (0b01000, 0b00010)


def test_take_prefers_the_oldest_fresh_record_then_the_newest_replayed():
    rng = np.random.default_rng(1)
    recs = Records()
    same = _random_counts(rng)
    for tag in "abc":
        recs.add(_record(same, tag))
    # recomputes of identical counts take the oldest not yet replayed first
    got = []
    for _ in range(3):
        got.append(recs.take(*recs.masks(0, same[0], "hooks")).placement)
    assert got == ["a", "b", "c"]
    # a second backward through a graph whose records were all replayed: the newest replayed
    assert recs.take(*recs.masks(0, same[0], "hooks")).placement == "c"
    with pytest.raises(ValueError, match="non-empty mask"):
        recs.take(0, 0)
    with pytest.raises(ValueError, match="bit 5 names no record"):
        recs.take(0b100000, 0)


def test_at_most_max_records_are_kept_oldest_dropped_first():
    rng = np.random.default_rng(2)
    recs = Records()
    counts = [_random_counts(rng, E=8) + 100 * i for i in range(MAX_RECORDS + 5)]
    for i, c in enumerate(counts):
        recs.add(_record(c, str(i)))
        if i == 2:
            recs.take(*recs.masks(0, c[0], "hooks"))
    assert len(recs) == MAX_RECORDS and recs.first_seq() == 5
    assert recs.replayed() == 0                                  # the replayed one aged out with its mark
    assert recs.masks(0, counts[0][0], "hooks") == (0, 0)        # aged out
    last, _ = recs.masks(0, counts[-1][0], "hooks")
    assert last == 1 << (MAX_RECORDS - 1) and last < 2**63      # fits one int64 of the all-gather
    assert recs.take(last, 0).placement == str(MAX_RECORDS + 4)
    with pytest.raises(ValueError, match="max_records"):
        Records(MAX_RECORDS + 1)


def test_which_forwards_leave_which_record_and_which_recomputes_read_them():
    seen = []

    def f(x, training=True):
        seen.append(recompute_kind() if in_backward() else record_kind(training))
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()                                          # plain training forward: no record
    with torch.no_grad():
        f(x)                                                       # training under no_grad: maybe reentrant's
        f(x, training=False)                                       # inference: no record
    checkpoint(f, x, use_reentrant=True).sum().backward()          # no_grad first run, recompute without hooks
    checkpoint(f, x, use_reentrant=False).sum().backward()         # saved-tensor hooks in both runs
    checkpoint(f, x, False, use_reentrant=False).sum().backward()  # in eval mode too
    assert seen == [None, "no_grad", None, "no_grad", "no_grad", "hooks", "hooks", "hooks", "hooks"]
