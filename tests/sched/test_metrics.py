"""Balance metrics against their definitions, computed independently."""

import numpy as np
import pytest

from feplb.sched import gemm_straggler, max_over_mean, pct_of_ideal, token_straggler


def test_against_definition():
    rng = np.random.default_rng(1)
    for _ in range(20):
        loads = rng.integers(0, 1000, size=rng.integers(1, 65))
        mean = sum(int(v) for v in loads) / len(loads)
        assert token_straggler(loads) == pytest.approx(max(loads) - mean)
        if mean:
            assert max_over_mean(loads) == pytest.approx(max(loads) / mean)
            assert pct_of_ideal(loads) == pytest.approx(100 * mean / max(loads))
    assert gemm_straggler([1.0, 3.0]) == 1.0


def test_edge_cases():
    assert token_straggler([5, 5, 5]) == 0.0
    assert max_over_mean([0, 0]) == 1.0
    with pytest.raises(ValueError, match="non-empty 1-D"):
        token_straggler([])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        max_over_mean([[1, 2]])


def test_loads_near_int64_limits_and_loads_that_are_no_loads():
    """int64 loads whose sum passes int64's limit (summed as int64 it wrapped: max/mean -2.0) give the definition's
    value; a negative, NaN or infinite load is refused, naming it (it gave a number)."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        loads = rng.integers(2**61, 2**63 - 1, size=rng.integers(2, 9), dtype=np.int64)
        mean = sum(float(v) for v in loads) / len(loads)
        assert max_over_mean(loads) == pytest.approx(float(max(loads)) / mean, rel=1e-12)
        assert token_straggler(loads) == pytest.approx(float(max(loads)) - mean, rel=1e-9, abs=1e3)
    for bad, shown in (([1, -1], "-1 at GPU 1"), ([np.nan, 1.0], "nan at GPU 0"), ([1.0, np.inf], "inf at GPU 1"),
                       ([2.0, -np.inf, 1.0], "-inf at GPU 1")):
        for fn in (token_straggler, max_over_mean, pct_of_ideal, gemm_straggler):
            with pytest.raises(ValueError, match=f"finite and >= 0, got {shown}"):
                fn(bad)
