"""Topology: its arithmetic and its refusals."""

import warnings

import numpy as np
import pytest

from feplb.sched import Topology


def test_arithmetic():
    t = Topology(num_ranks=16, gpus_per_node=8, num_experts=64, dyn=4)
    assert (t.experts_per_rank, t.num_nodes) == (4, 2)
    assert [t.home(e) for e in (0, 3, 4, 63)] == [0, 0, 1, 15]
    assert t.node_of(7) == 0 and t.node_of(8) == 1
    assert list(t.node_ranks(1)) == list(range(8, 16))
    assert list(t.local_experts(2)) == [8, 9, 10, 11]
    assert t.default_home_E().tolist() == [e // 4 for e in range(64)]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_ranks": 6, "gpus_per_node": 4, "num_experts": 24}, "gpus_per_node .*must divide num_ranks"),
        ({"num_ranks": 8, "gpus_per_node": 8, "num_experts": 60}, "num_ranks .*must divide num_experts"),
        ({"num_ranks": 8, "gpus_per_node": 8, "num_experts": 64, "dyn": 9}, "dyn must be <= "),
        ({"num_ranks": 8, "gpus_per_node": 8, "num_experts": 64, "dyn": -1}, "dyn must be >= 0"),
        ({"num_ranks": 0, "gpus_per_node": 1, "num_experts": 64}, "num_ranks must be >= 1"),
    ],
    ids=["G-not-dividing-W", "W-not-dividing-E", "dyn-too-big", "dyn-negative", "zero-ranks"],
)
def test_bad_topology(kw, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kw)


def test_bad_types():
    with pytest.raises(TypeError, match="num_experts must be an int"):
        Topology(num_ranks=2, gpus_per_node=1, num_experts=4.0)
    with pytest.raises(TypeError, match="dyn must be an int"):
        Topology(num_ranks=2, gpus_per_node=1, num_experts=4, dyn=True)


def test_range_checks():
    t = Topology(num_ranks=4, gpus_per_node=2, num_experts=8, dyn=1)
    with pytest.raises(ValueError, match="expert must be in"):
        t.home(8)
    with pytest.raises(ValueError, match="rank must be in"):
        t.node_of(4)
    with pytest.raises(ValueError, match="node must be in"):
        t.node_ranks(2)


def test_check_counts(tmp_path):
    t = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    ok = t.check_counts(np.ones((2, 4), dtype=np.int32))
    assert ok.dtype == np.int64
    with pytest.raises(ValueError, match=r"shape \[W, E\] = \[2, 4\], got \[4, 2\]"):
        t.check_counts(np.ones((4, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="integer dtype, got float64"):
        t.check_counts(np.ones((2, 4)))
    bad = np.ones((2, 4), dtype=np.int64)
    bad[1, 3] = -2
    with pytest.raises(ValueError, match=r"must be >= 0, got -2 at \[source 1, expert 3\]"):
        t.check_counts(bad)
    with pytest.raises(TypeError, match="numpy array"):
        t.check_counts([[1, 2, 3, 4], [1, 2, 3, 4]])
    # a matrix (which indexes otherwise) and a masked array (whose mask would be ignored) are refused by name; a
    # memmap is taken as the array it is
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)   # (numpy's, on making a matrix)
        matrix = np.asmatrix(np.ones((2, 4), dtype=np.int64))
    for sub in (matrix,
                np.ma.masked_array(np.ones((2, 4), dtype=np.int64), mask=np.eye(2, 4, dtype=bool))):
        with pytest.raises(TypeError, match=f"not a matrix or masked array\\), got {type(sub).__name__}"):
            t.check_counts(sub)
    mm = np.memmap(tmp_path / "counts.bin", dtype=np.int64, mode="w+", shape=(2, 4))
    mm[:] = np.arange(8).reshape(2, 4)
    got = t.check_counts(mm)
    assert type(got) is np.ndarray and got.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
