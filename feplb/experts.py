"""Small pieces every step of the MoE layer shares: the gated experts over grouped rows, host index arrays to the
device without a blocking copy, the hand-off of device work to a helper thread, and timeline spans."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from feplb.timeline import Timeline

__all__ = ["expert_mlp", "ready_event", "span", "to_device"]


def expert_mlp(x_MH: torch.Tensor, weights: tuple[torch.Tensor, ...], offsets_L: torch.Tensor,
               limit: float | None = None, act: str = "silu", alpha: float = 1.0,
               interleaved: bool = False, gated: bool = True,
               softcap: tuple[float, float] | None = None) -> torch.Tensor:
    """Experts over grouped rows: grouped_mm(x, w1) [+ b1] -> act(gate) * up -> grouped_mm(., w2) [+ b2], or
    act(.) for non-gated experts (``gated=False``: w1 [L, H, F]).

    x_MH: [M, H]; weights: (w1 [L, H, 2F], w2 [L, F, H]) or (w1, w2, b1 [L, 2F], b2 [L, H]) (``expert_bias``);
    offsets_L: int32/int64 [L] END offsets; limit: the clamp's limit, None for none; act, alpha, interleaved,
    gated, softcap: the activation (``FEPLBConfig.glu`` gives all six: ``swiglu_limit``, ``activation``,
    ``swiglu_alpha``, ``glu_interleaved``, ``gated``, ``glu_softcap``). Returns [M, H]
    in x's dtype: inside ``torch.autocast`` the GEMMs (and the SwiGLU between them) run in the autocast dtype, and
    their result is cast back, so the rows the layer exchanges keep the layer's dtype.
    """
    from feplb.kernels import glu, grouped_mm, mlp_act

    w1_LH2F, w2_LFH, *bias = weights
    if w1_LH2F.shape[0] == 0 or x_MH.shape[0] == 0:
        return x_MH.new_zeros((0, w2_LFH.shape[-1])) + (x_MH.sum() + sum(w.sum() for w in weights)) * 0
    h = grouped_mm(x_MH, w1_LH2F, offsets_L, check=False)
    group_M = None
    if bias:   # each row's expert: the number of group ends at or before it (on the device, no host sync)
        group_M = torch.searchsorted(offsets_L, torch.arange(x_MH.shape[0], device=x_MH.device,
                                                             dtype=offsets_L.dtype), right=True)
        # in the wider of the two dtypes (under torch.autocast: a bf16 GEMM plus the fp32 bias, as a biased
        # F.linear's output would be promoted in eager code such as gpt-oss's)
        h = h + _RowBias.apply(bias[0], group_M)
    a = glu(h, limit, act, alpha, interleaved, softcap) if gated else mlp_act(h, act)
    y = grouped_mm(a, w2_LFH, offsets_L, check=False)
    if bias:
        y = y + _RowBias.apply(bias[1], group_M)
    return y if y.dtype == x_MH.dtype else y.to(x_MH.dtype)


class _RowBias(torch.autograd.Function):
    """Each row's expert bias, ``bias_LN[group_M]``; the gradient summed in fp32 (fp64 for fp64) and rounded to the
    bias's dtype once (``index_select``'s own backward adds in the bias's dtype: bf16 atomics on a GPU round after
    every row)."""

    @staticmethod
    def forward(bias_LN: torch.Tensor, group_M: torch.Tensor) -> torch.Tensor:
        return bias_LN.index_select(0, group_M)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        bias_LN, group_M = inputs
        ctx.save_for_backward(group_M)
        ctx.shape, ctx.dtype = tuple(bias_LN.shape), bias_LN.dtype

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        (group_M,) = ctx.saved_tensors
        acc = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        total = torch.zeros(ctx.shape, dtype=acc, device=grad_MN.device).index_add_(0, group_M, grad_MN.to(acc))
        return total.to(ctx.dtype), None


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
