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
    # summed in float64: an int64 sum near its limit wraps (a negative mean)
    lo = a.min()
    if not lo >= 0 or (a.dtype.kind == "f" and not np.isfinite(a).all()):
        bad = int(np.argmax(~(a >= 0) | ~np.isfinite(a.astype(np.float64))))
        raise ValueError(f"loads_W must be finite and >= 0, got {a[bad].item()!r} at GPU {bad}")
    return a


def token_straggler(loads_W: object) -> float:
    """``max_d T_d - mean_d T_d`` in rows; 0 is perfect balance. loads_W: numeric [W], finite, >= 0."""
    a = _loads(loads_W)
    return float(a.max()) - float(a.sum(dtype=np.float64)) / a.size


def max_over_mean(loads_W: object) -> float:
    """``max_d T_d / mean_d T_d``; 1.0 is perfect balance (and the value for an all-zero load)."""
    a = _loads(loads_W)
    total = float(a.sum(dtype=np.float64))
    return 1.0 if total == 0 else float(a.max()) * a.size / total


def pct_of_ideal(loads_W: object) -> float:
    """``100 * mean / max``: the layer's speed as a percentage of what perfect balance would give."""
    return 100.0 / max_over_mean(loads_W)


def gemm_straggler(times_W: object) -> float:
    """``max_d G_d - mean_d G_d`` for per-GPU grouped-GEMM times (any unit)."""
    return token_straggler(times_W)
