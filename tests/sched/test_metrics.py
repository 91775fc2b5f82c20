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
