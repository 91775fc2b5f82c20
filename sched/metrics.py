"""Balance metrics of one MoE layer and micro-batch (the one definition the runtime and the simulator share).

Legend: W GPUs; loads_W[d] = (token, expert) rows GPU d computes.
"""

from __future__ import annotations

import numpy as np


def _loads(loads_W: object) -> np.ndarray:
    a = np.asarray(loads_W)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"loads_W must be a non-empty 1-D array [W], got shape {list(a.shape)}")
    if a.dtype.kind not in "iuf":
        raise TypeError(f"loads_W must be numeric, got dtype {a.dtype}")
    return a


def token_straggler(loads_W: object) -> float:
    """``max_d T_d - mean_d T_d`` in rows; 0 is perfect balance. loads_W: numeric [W]."""
    a = _loads(loads_W)
    return float(a.max()) - float(a.sum()) / a.size


def max_over_mean(loads_W: object) -> float:
    """``max_d T_d / mean_d T_d``; 1.0 is perfect balance (and the value for an all-zero load)."""
    a = _loads(loads_W)
    total = float(a.sum())
    return 1.0 if total == 0 else float(a.max()) * a.size / total


def pct_of_ideal(loads_W: object) -> float:
    """``100 * mean / max``: the layer's speed as a percentage of what perfect balance would give."""
    return 100.0 / max_over_mean(loads_W)


def gemm_straggler(times_W: object) -> float:
    """``max_d G_d - mean_d G_d`` for per-GPU grouped-GEMM times (any unit)."""
    return token_straggler(times_W)
