"""FEPLB: per-micro-batch MoE load balancing with copy engines and a CPU scheduler.

Rooms: ``feplb.kernels`` (Triton kernels and custom ops), ``feplb.sched`` (CPU planning, numpy only) and this
package (runtime, simulator, CLI). Heavy members are imported lazily so that ``import feplb.sched`` needs no torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "FEPLBConfig": "feplb.layer",
    "MoELayer": "feplb.layer",
    "LayerStats": "feplb.layer",
    "join_stats": "feplb.steps",
    "NonFiniteRoutingError": "feplb.steps",
    "ignore_experts_in_ddp": "feplb.layer",
    "clip_grad_norm_": "feplb.dropin",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'feplb' has no attribute {name!r}")


__all__ = sorted(_LAZY)
