"""SwiGLU activation of the first expert projection: out = silu(gate) * up, with gate = h[:, :F], up = h[:, F:].

Clamped SwiGLU (``limit``, as DeepSeek-V4, GLM-5 and Hunyuan-V4 experts compute it, and Megatron's
``activation_func_clamp_value``): out = silu(min(gate, limit)) * clamp(up, -limit, limit); the gradient passes the
clamps where the input lies within them, bounds included (torch.clamp's rule).

Legend: M rows, F ffn features (h holds gate and up side by side, 2F columns).
Computed in fp32, returned in the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, check_tensor
from ._triton import alloc, autotune_configs, cdiv, check_launch_device, launch, tl, triton

__all__ = ["check_swiglu_input", "check_swiglu_limit", "swiglu_bwd_ref", "swiglu_bwd_triton", "swiglu_ref",
           "swiglu_triton"]


def check_swiglu_input(h_M2F: Tensor) -> None:
    """h float [M, 2F], contiguous, an even number of columns."""
    check_tensor("h_M2F", h_M2F, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    if h_M2F.shape[1] % 2:
        raise ValueError(f"h_M2F: expected an even number of columns [M, 2F], got shape {list(h_M2F.shape)}")


def check_swiglu_limit(limit: float | None) -> None:
    """None (plain SwiGLU) or a finite number > 0."""
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"limit: expected None or a finite number > 0, got {limit!r}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu_ref(h_M2F: Tensor, limit: float | None = None) -> Tensor:
    """Pure-torch twin: silu(h[:, :F]) * h[:, F:] (clamped by ``limit``, see the module docstring). Returns [M, F]
    in h's dtype."""
    check_swiglu_input(h_M2F)
    check_swiglu_limit(limit)
    gate, up = h_M2F.to(_acc_dtype(h_M2F.dtype)).chunk(2, dim=1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (torch.nn.functional.silu(gate) * up).to(h_M2F.dtype)


def swiglu_bwd_ref(grad_MF: Tensor, h_M2F: Tensor, limit: float | None = None) -> Tensor:
    """Gradient of :func:`swiglu_ref`: grad_MF [M, F] (h's dtype) -> dh [M, 2F] in h's dtype."""
    check_swiglu_input(h_M2F)
    check_swiglu_limit(limit)
    check_tensor("grad_MF", grad_MF, dtypes=(h_M2F.dtype,), shape=(h_M2F.shape[0], h_M2F.shape[1] // 2))
    acc = _acc_dtype(h_M2F.dtype)
    gate, up = h_M2F.to(acc).chunk(2, dim=1)
    g = grad_MF.to(acc)
    if limit is not None:
        gate_in, up_in = gate <= limit, (up >= -limit) & (up <= limit)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    sig = torch.sigmoid(gate)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    if limit is not None:
        d_gate, d_up = torch.where(gate_in, d_gate, 0.0), torch.where(up_in, d_up, 0.0)
    return torch.cat([d_gate, d_up], dim=1).to(h_M2F.dtype)


HOPPER_CONFIGS = [dict(BLOCK_R=2, BLOCK_F=2048, num_warps=8), dict(BLOCK_R=4, BLOCK_F=1024, num_warps=8),
                  dict(BLOCK_R=8, BLOCK_F=512, num_warps=4)]
_CONFIGS = autotune_configs(HOPPER_CONFIGS, dict(BLOCK_R=64, BLOCK_F=128))


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _swiglu_kernel(h_ptr, out_ptr, M, F, limit: tl.float64, ACC: tl.constexpr, CLAMP: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    base = h_ptr + rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(ACC)
    up = tl.load(base + F, mask=mask, other=0.0).to(ACC)
    if CLAMP:   # torch.clamp's: NaN stays NaN (tl.minimum would return the limit)
        lim = tl.cast(limit, ACC)
        gate = tl.where(gate > lim, lim, gate)
        up = tl.where(up > lim, lim, tl.where(up < -lim, -lim, up))
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rows[:, None] * F + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_CONFIGS, key=["F"])
@triton.jit
def _swiglu_bwd_kernel(grad_ptr, h_ptr, dh_ptr, M, F, limit: tl.float64, ACC: tl.constexpr, CLAMP: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    offs = rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(h_ptr + offs, mask=mask, other=0.0).to(ACC)
    up = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(ACC)
    g = tl.load(grad_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(ACC)
    if CLAMP:   # a NaN input is inside no bound: its clamp passes no gradient (torch.clamp's where)
        lim = tl.cast(limit, ACC)
        gate_in = gate <= lim
        up_in = (up >= -lim) & (up <= lim)
        gate = tl.where(gate > lim, lim, gate)
        up = tl.where(up > lim, lim, tl.where(up < -lim, -lim, up))
    sig = tl.sigmoid(gate)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    if CLAMP:
        d_gate = tl.where(gate_in, d_gate, 0.0)
        d_up = tl.where(up_in, d_up, 0.0)
    tl.store(dh_ptr + offs, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + offs + F, d_up.to(dh_ptr.dtype.element_ty), mask=mask)


def _launch_grid(M: int, F: int):
    def grid(meta):
        return cdiv(M, meta["BLOCK_R"]), cdiv(F, meta["BLOCK_F"])

    return grid


def swiglu_triton(h_M2F: Tensor, limit: float | None = None, *, config: dict | None = None) -> Tensor:
    """Launcher of the SwiGLU kernel. h float [M, 2F] contiguous -> [M, F] in h's dtype (fp32 math), clamped by
    ``limit`` (see the module docstring).

    ``config``: explicit block sizes instead of the autotuner (see ``_triton.launch``)."""
    check_swiglu_input(h_M2F)
    check_swiglu_limit(limit)
    check_launch_device("swiglu_triton", h_M2F)
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    out_MF = alloc((M, F), h_M2F.dtype, h_M2F.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_M2F.dtype == torch.float64 else tl.float32
        launch(_swiglu_kernel, _launch_grid(M, F), h_M2F, out_MF, M, F, float(limit or 0.0), ACC=acc,
               CLAMP=limit is not None, config=config)
    return out_MF


def swiglu_bwd_triton(grad_MF: Tensor, h_M2F: Tensor, limit: float | None = None, *,
                      config: dict | None = None) -> Tensor:
    """Launcher of the SwiGLU backward: grad [M, F] (h's dtype, contiguous), h [M, 2F] -> dh [M, 2F]."""
    check_swiglu_input(h_M2F)
    check_swiglu_limit(limit)
    check_tensor("grad_MF", grad_MF, dtypes=(h_M2F.dtype,), shape=(h_M2F.shape[0], h_M2F.shape[1] // 2),
                 contiguous=True)
    check_launch_device("swiglu_bwd_triton", h_M2F)
    M, F = grad_MF.shape
    dh_M2F = alloc(tuple(h_M2F.shape), h_M2F.dtype, h_M2F.device)
    if M > 0 and F > 0:
        acc = tl.float64 if h_M2F.dtype == torch.float64 else tl.float32
        launch(_swiglu_bwd_kernel, _launch_grid(M, F), grad_MF, h_M2F, dh_M2F, M, F, float(limit or 0.0), ACC=acc,
               CLAMP=limit is not None, config=config)
    return dh_M2F
