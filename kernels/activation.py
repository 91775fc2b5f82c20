"""SwiGLU activation of the first expert projection: out = silu(gate) * up, with gate = h[:, :F], up = h[:, F:].

Legend: M rows, F ffn features (h holds gate and up side by side, 2F columns).
Computed in fp32, returned in the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, check_tensor
from ._triton import alloc, autotune_configs, cdiv, check_launch_device, launch, tl, triton

__all__ = ["check_swiglu_input", "swiglu_bwd_ref", "swiglu_bwd_triton", "swiglu_ref", "swiglu_triton"]


def check_swiglu_input(h_M2F: Tensor) -> None:
    """h float [M, 2F], contiguous, an even number of columns."""
    check_tensor("h_M2F", h_M2F, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    if h_M2F.shape[1] % 2:
        raise ValueError(f"h_M2F: expected an even number of columns [M, 2F], got shape {list(h_M2F.shape)}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu_ref(h_M2F: Tensor) -> Tensor:
    """Pure-torch twin: silu(h[:, :F]) * h[:, F:]. Returns [M, F] in h's dtype."""
    check_swiglu_input(h_M2F)
    gate, up = h_M2F.to(_acc_dtype(h_M2F.dtype)).chunk(2, dim=1)
    return (torch.nn.functional.silu(gate) * up).to(h_M2F.dtype)


def swiglu_bwd_ref(grad_MF: Tensor, h_M2F: Tensor) -> Tensor:
    """Gradient of :func:`swiglu_ref`: grad_MF [M, F] (h's dtype) -> dh [M, 2F] in h's dtype."""
    check_swiglu_input(h_M2F)
    check_tensor("grad_MF", grad_MF, dtypes=(h_M2F.dtype,), shape=(h_M2F.shape[0], h_M2F.shape[1] // 2))
    acc = _acc_dtype(h_M2F.dtype)
    gate, up = h_M2F.to(acc).chunk(2, dim=1)
    g = grad_MF.to(acc)
    sig = torch.sigmoid(gate)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    return torch.cat([d_gate, d_up], dim=1).to(h_M2F.dtype)


HOPPER_CONFIGS = [dict(BLOCK_R=2, BLOCK_F=2048, num_warps=8), dict(BLOCK_R=4, BLOCK_F=1024, num_warps=8),
                  dict(BLOCK_R=8, BLOCK_F=512, num_warps=4)]
_CONFIGS = autotune_configs(HOPPER_CONFIGS, dict(BLOCK_R=64, BLOCK_F=128))


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _swiglu_kernel(h_ptr, out_ptr, M, F, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    base = h_ptr + rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(ACC)
    up = tl.load(base + F, mask=mask, other=0.0).to(ACC)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rows[:, None] * F + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _swiglu_bwd_kernel(grad_ptr, h_ptr, dh_ptr, M, F, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    offs = rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(h_ptr + offs, mask=mask, other=0.0).to(ACC)
    up = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(ACC)
    g = tl.load(grad_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(ACC)
    sig = tl.sigmoid(gate)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    tl.store(dh_ptr + offs, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + offs + F, d_up.to(dh_ptr.dtype.element_ty), mask=mask)


def _launch_grid(M: int, F: int):
    def grid(meta):
        return cdiv(M, meta["BLOCK_R"]), cdiv(F, meta["BLOCK_F"])

    return grid


def swiglu_triton(h_M2F: Tensor, *, config: dict | None = None) -> Tensor:
    """Launcher of the SwiGLU kernel. h float [M, 2F] contiguous -> [M, F] in h's dtype (fp32 math).

    ``config``: explicit block sizes instead of the autotuner (see ``_triton.launch``)."""
    check_swiglu_input(h_M2F)
    check_launch_device("swiglu_triton", h_M2F)
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    out_MF = alloc((M, F), h_M2F.dtype, h_M2F.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_M2F.dtype == torch.float64 else tl.float32
        launch(_swiglu_kernel, _launch_grid(M, F), h_M2F, out_MF, M, F, ACC=acc, config=config)
    return out_MF


def swiglu_bwd_triton(grad_MF: Tensor, h_M2F: Tensor, *, config: dict | None = None) -> Tensor:
    """Launcher of the SwiGLU backward: grad [M, F] (h's dtype, contiguous), h [M, 2F] -> dh [M, 2F]."""
    check_swiglu_input(h_M2F)
    check_tensor("grad_MF", grad_MF, dtypes=(h_M2F.dtype,), shape=(h_M2F.shape[0], h_M2F.shape[1] // 2),
                 contiguous=True)
    check_launch_device("swiglu_bwd_triton", h_M2F)
    M, F = grad_MF.shape
    dh_M2F = alloc(tuple(h_M2F.shape), h_M2F.dtype, h_M2F.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_M2F.dtype == torch.float64 else tl.float32
        launch(_swiglu_bwd_kernel, _launch_grid(M, F), grad_MF, h_M2F, dh_M2F, M, F, ACC=acc, config=config)
    return dh_M2F
