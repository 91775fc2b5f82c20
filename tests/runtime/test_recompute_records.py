"""The records a recompute finds its forward by (``feplb.recompute``), without processes: bit masks over the records
kept, the choice they make (the oldest of those replayed the fewest times), the bound on what is kept, which
forwards leave which kind of record, and the checkpoint frame read from torch's hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from feplb.recompute import MAX_RECORDS, Record, Records, checkpoint_frame, hooks_active, in_backward, record_kind
from feplb.steps import HEADER, read_counts


def _record(counts_WE: np.ndarray, tag: str = "", kind: str = "hooks") -> Record:
    W, E = counts_WE.shape
    slots = np.arange(E).reshape(W, E // W)
    gathered = np.concatenate([np.zeros((W, len(HEADER)), dtype=np.int64), counts_WE], axis=1)
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


class _Refused(Exception):
    pass


def _agree(per_rank: list[Records], local_WE: np.ndarray, generation: int = 0, held: bool = False,
           dispatched: bool = False, layer_ids: list[int] | None = None,
           refused: list[set[str]] | None = None) -> Record:
    """What the layer's _find_record does, each rank's row computed from its own records, without processes: the
    rows stacked as the all-gather returns them, then every rank's choice (asserted the same). refused: per rank,
    the records (by placement tag) it refuses to repeat; a refusal raises ``_Refused(ranks, tag)``, asserted the
    same on every rank."""
    W = len(per_rank)
    ids = layer_ids or [7] * W
    rows = np.stack([per_rank[r].candidates(local_WE[r], r, generation, held, dispatched, ids[r],
                                            None if refused is None else lambda rec, r=r: rec.placement in refused[r])
                     for r in range(W)])
    got: list[Record | tuple] = []
    for r in range(W):
        try:
            got.append(per_rank[r].choose(rows, generation, held,
                                          refusal=lambda ranks, rec: _Refused(ranks, rec.placement)))
        except _Refused as e:
            got.append((tuple(e.args[0]), e.args[1]))
    # each rank its own copy of the same record, or the same refusal
    seen = {g if isinstance(g, tuple) else g.placement for g in got}
    assert len(seen) == 1, got
    if isinstance(got[0], tuple):
        raise _Refused(list(got[0][0]), got[0][1])
    return got[0]


def _ranks(counts: list[np.ndarray], kinds: list[str], generations: list[int] | None = None) -> list[Records]:
    """Every rank's records of the same forwards (records are made alike on every rank)."""
    import dataclasses

    W = counts[0].shape[0]
    out = []
    for _ in range(W):
        recs = Records()
        for i, (c, k) in enumerate(zip(counts, kinds, strict=True)):
            rec = _record(c, str(i), kind=k)
            if generations is not None:
                rec = dataclasses.replace(rec, generation=generations[i])
            recs.add(rec)
        out.append(recs)
    return out


def test_the_agreed_choice_against_a_brute_force_reference():
    """Random forwards of random kinds on W ranks; a recompute routing as one of them: the record chosen is, by a
    reference written from the rules, the oldest never-replayed ``hooks`` record equal on every rank if exactly one
    is, else refused if several are, else the oldest ``no_grad`` one equal on every rank."""
    rng = np.random.default_rng(5)
    seen = {"refused": 0, "hooks": 0, "no_grad": 0}
    for trial in range(60):
        W, E, n = int(rng.choice([1, 2, 4])), 8, int(rng.integers(1, 7))
        counts = [rng.integers(0, 3, size=(W, E)).astype(np.int64) for _ in range(n)]
        for i in range(1, n):   # equal forwards, now and then
            if rng.random() < 0.3:
                counts[i] = counts[int(rng.integers(0, i))].copy()
        kinds = [str(rng.choice(["hooks", "no_grad"])) for _ in range(n)]
        target = counts[int(rng.integers(0, n))]
        per_rank = _ranks(counts, kinds)
        equal = [i for i in range(n) if np.array_equal(counts[i], target)]
        hooks = [i for i in equal if kinds[i] == "hooks"]
        no_grad = [i for i in equal if kinds[i] == "no_grad"]
        if len(hooks) > 1:
            with pytest.raises(RuntimeError, match=f"{len(hooks)} recorded forwards .* cannot be told apart"):
                _agree(per_rank, target)
            seen["refused"] += 1
            continue
        want = hooks[0] if hooks else no_grad[0]
        assert _agree(per_rank, target).placement == str(want), (trial, kinds, equal)
        seen["hooks" if hooks else "no_grad"] += 1
    assert min(seen.values()) >= 3, seen   # every rule was exercised


def test_the_agreed_choice_refuses_what_the_ranks_do_not_share():
    rng = np.random.default_rng(6)
    counts = [_random_counts(rng) + 10 * i for i in range(3)]
    # rank 0 routes as forward 1, rank 1 as forward 2: no record is equal on every rank
    mixed = np.stack([counts[1][0], counts[2][1]])
    with pytest.raises(RuntimeError, match="matches none of the forwards recorded"):
        _agree(_ranks(counts, ["hooks"] * 3), mixed)
    # the ranks recompute different layers
    with pytest.raises(RuntimeError, match=r"different MoE layers at once \(layer number per EP rank: \[7, 8\]\)"):
        _agree(_ranks(counts, ["hooks"] * 3), counts[1], layer_ids=[7, 8])
    # the ranks hold different records (one recorded a forward more)
    uneven = _ranks(counts, ["hooks"] * 3)
    uneven[1].add(_record(counts[0], "extra"))
    with pytest.raises(RuntimeError, match="hold different forward records"):
        _agree(uneven, counts[1])
    # per-step copies refreshed between the forward and its recompute: its record is of an older generation
    with pytest.raises(RuntimeError, match=r"refresh_replicas\(\) ran between a forward and its recompute"):
        _agree(_ranks(counts, ["hooks"] * 3, generations=[0, 0, 0]), counts[1], generation=1, held=True)
    # ... which does not matter where no copies are held
    assert _agree(_ranks(counts, ["hooks"] * 3, generations=[0, 0, 0]), counts[1], generation=1).placement == "1"
    # a forward_dispatched recompute repeats only a forward_dispatched record
    with pytest.raises(RuntimeError, match="matches none"):
        _agree(_ranks(counts, ["hooks"] * 3), counts[1], dispatched=True)
    # a hooks record replayed once, its checkpoint gone (no frame): no candidate, and no refresh to blame
    replayed = _ranks(counts, ["hooks"] * 3)
    assert _agree(replayed, counts[1]).placement == "1"
    with pytest.raises(RuntimeError, match="matches none"):
        _agree(replayed, counts[1])


def test_a_hooks_record_replayed_once_is_not_taken_again_without_its_checkpoint():
    """A ``hooks`` record already replayed, whose checkpoint is gone (no frame: other saved-tensor hooks), is no
    candidate any more; an equal ``no_grad`` record then is."""
    rng = np.random.default_rng(7)
    c = _random_counts(rng)
    per_rank = _ranks([c, c], ["hooks", "no_grad"])
    assert _agree(per_rank, c).placement == "0"
    assert _agree(per_rank, c).placement == "1"


def test_under_checkpoint_frames_each_recompute_takes_its_own_frames_record():
    """Non-reentrant checkpointing: records made under a checkpoint's frame (``Record.frame``); each recompute,
    under the same frame, takes that frame's record with its counts, also where another frame holds a record of
    equal counts (without frames: two candidates, refused). A recompute that routes otherwise matches none of its
    frame's records; one whose copies were refreshed since raises."""
    import dataclasses
    import weakref

    rng = np.random.default_rng(8)
    same, other = _random_counts(rng), _random_counts(rng) + 10
    per_rank = [Records() for _ in range(2)]
    chosen = []

    def block(x, calls, generation=0, held=False):
        for tag, counts, again in calls:   # the layer's calls: recorded in the forward, agreed in the recompute
            if in_backward():
                chosen.append((tag, _agree(per_rank, again, generation, held).placement))
            else:
                frame = weakref.ref(checkpoint_frame())
                for recs in per_rank:
                    recs.add(dataclasses.replace(_record(counts, tag), frame=frame))
        return x * x   # (saves x: the backward recomputes the block, the calls first)

    x = torch.ones(3, requires_grad=True)
    ya = checkpoint(block, x, [("a1", same, same), ("a2", other, other)], use_reentrant=False)
    yb = checkpoint(block, x, [("b1", same, same)], use_reentrant=False)
    (ya.sum() + yb.sum()).backward()
    assert sorted(chosen) == [("a1", "a1"), ("a2", "a2"), ("b1", "b1")], chosen
    # the same records without their frames: a1 and b1 cannot be told apart
    bare = [Records() for _ in range(2)]
    for tag, counts in (("a1", same), ("a2", other), ("b1", same)):
        for recs in bare:
            recs.add(_record(counts, tag))
    with pytest.raises(RuntimeError, match="cannot be told apart"):
        _agree(bare, same)
    # a recompute routing otherwise than its forward: its frame's record is no match, and nothing else is
    y = checkpoint(block, x, [("c1", other + 1, same + 1)], use_reentrant=False)
    with pytest.raises(RuntimeError, match="matches none of the forwards recorded"):
        y.sum().backward()
    # per-step copies held and refreshed (generation 0 -> 1) between the forward and its recompute
    y = checkpoint(block, x, [("d1", other + 2, other + 2)], 1, True, use_reentrant=False)
    with pytest.raises(RuntimeError, match=r"refresh_replicas\(\) ran between a forward and its recompute"):
        y.sum().backward()


def test_a_record_some_ranks_refuse_is_refused_on_every_rank_and_left_untaken():
    """A recompute whose record some ranks refuse to repeat (the layer: the experts' requires_grad flags changed
    there since a non-reentrant checkpoint's forward): every rank raises the same error naming those ranks, before
    any takes it; the same choice, refused by none, then takes it (before, the refusing ranks raised alone, after
    the agreement, while the others went on into the recompute's exchanges). Refusing records not chosen changes
    nothing. Random forwards as in the brute-force test, against the choice made without refusals."""
    import copy

    rng = np.random.default_rng(9)
    seen = {"refused": 0, "taken": 0}
    for trial in range(60):
        W, E, n = int(rng.choice([1, 2, 4])), 8, int(rng.integers(1, 6))
        counts = [rng.integers(0, 3, size=(W, E)).astype(np.int64) for _ in range(n)]
        kinds = [str(rng.choice(["hooks", "no_grad"])) for _ in range(n)]
        target = counts[int(rng.integers(0, n))]
        per_rank = _ranks(counts, kinds)
        try:
            want = _agree(copy.deepcopy(per_rank), target).placement
        except RuntimeError:
            continue   # several equal hooks records: refused before any refusal is read
        refused = [{str(i) for i in range(n) if rng.random() < 0.3} for _ in range(W)]
        ranks = [r for r in range(W) if want in refused[r]]
        if ranks:
            with pytest.raises(_Refused) as e:
                _agree(per_rank, target, refused=refused)
            assert e.value.args == (ranks, want), (trial, e.value.args)
            seen["refused"] += 1
        else:
            seen["taken"] += 1
        # taken once nobody refuses (a refused choice took nothing), as without refusals
        assert _agree(per_rank, target, refused=[set()] * W if ranks else refused).placement == want, trial
    assert min(seen.values()) >= 5, seen
