"""Small pieces every step of the MoE layer shares: the gated experts over grouped rows, host index arrays to the
device without a blocking copy, the hand-off of device work to a helper thread, and timeline spans."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from feplb.timeline import Timeline

__all__ = ["expert_mlp", "ready_event", "span", "to_device"]


def expert_mlp(x_MH: torch.Tensor, w1_LH2F: torch.Tensor, w2_LFH: torch.Tensor,
               offsets_L: torch.Tensor, limit: float | None = None, act: str = "silu") -> torch.Tensor:
    """Gated experts over grouped rows: grouped_mm(x, w1) -> act(gate) * up -> grouped_mm(., w2).

    x_MH: [M, H]; w1_LH2F: [L, H, 2F]; w2_LFH: [L, F, H]; offsets_L: int32/int64 [L] END offsets; limit: the
    clamp's limit (``FEPLBConfig.swiglu_limit``), None for none; act: the gate's activation
    (``FEPLBConfig.activation``: "silu", "gelu_tanh", "gelu"). Returns [M, H]
    in x's dtype: inside ``torch.autocast`` the GEMMs (and the SwiGLU between them) run in the autocast dtype, and
    their result is cast back, so the rows the layer exchanges keep the layer's dtype.
    """
    from feplb.kernels import glu, grouped_mm

    if w1_LH2F.shape[0] == 0 or x_MH.shape[0] == 0:
        return x_MH.new_zeros((0, w2_LFH.shape[-1])) + (x_MH.sum() + w1_LH2F.sum() + w2_LFH.sum()) * 0
    h = grouped_mm(x_MH, w1_LH2F, offsets_L, check=False)
    y = grouped_mm(glu(h, limit, act), w2_LFH, offsets_L, check=False)
    return y if y.dtype == x_MH.dtype else y.to(x_MH.dtype)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host int64 array on ``device`` without a blocking copy (pinned staging on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def ready_event(t: torch.Tensor) -> torch.cuda.Event | None:
    """The event that work a worker thread issues must wait for: recorded now on the calling thread's stream,
    after whatever produced ``t`` (None on a CPU, where the calling thread's work is already done)."""
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def span(tl: Timeline | None, name: str, lane: str = "compute", stream=None):
    return contextlib.nullcontext() if tl is None else tl.span(name, lane, stream=stream)
