"""Permute token rows into expert-grouped order, and un-permute with the gate-weighted sum over k.

Legend: T tokens, K top-k, M = T*K grouped rows, D hidden.

Both directions are gathers (no atomics), so results are deterministic: permute copies bits, and unpermute
adds the K products of one token in the order k = 0..K-1, in fp32, exactly as the pure-torch twin does (the
kernel is compiled without FMA contraction so a GPU rounds each product as torch does).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, check_rows, check_same_device, check_tensor
from ._triton import alloc, autotune_configs, cdiv, check_launch_device, launch, next_power_of_2, tl, triton

__all__ = [
    "check_permute_inputs",
    "check_unpermute_inputs",
    "permute_ref",
    "permute_triton",
    "unpermute_bwd_ref",
    "unpermute_bwd_triton",
    "unpermute_ref",
    "unpermute_triton",
]


def check_permute_inputs(x_TD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor) -> None:
    """x_TD float [T, D] contiguous; src_idx_M int32 [T*K]; dst_idx_TK int32 [T, K] (shapes and dtypes only)."""
    check_tensor("dst_idx_TK", dst_idx_TK, dtypes=(torch.int32,), ndim=2, contiguous=True)
    T, K = dst_idx_TK.shape
    check_rows("dst_idx_TK", T * K, "M = T*K", T, K)
    check_tensor("src_idx_M", src_idx_M, dtypes=(torch.int32,), shape=(T * K,), contiguous=True)
    check_tensor("x_TD", x_TD, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    if x_TD.shape[0] != T:
        raise ValueError(f"x_TD: expected {T} rows (tokens of the routing metadata), got shape {list(x_TD.shape)}")
    check_same_device(x_TD=x_TD, src_idx_M=src_idx_M, dst_idx_TK=dst_idx_TK)


def check_unpermute_inputs(y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor,
                           topk_weights_TK: Tensor | None) -> None:
    """y_MD float [M, D] contiguous; index tensors as for permute; weights float [T, K] contiguous, or None."""
    check_tensor("dst_idx_TK", dst_idx_TK, dtypes=(torch.int32,), ndim=2, contiguous=True)
    T, K = dst_idx_TK.shape
    check_rows("dst_idx_TK", T * K, "M = T*K", T, K)
    check_tensor("src_idx_M", src_idx_M, dtypes=(torch.int32,), shape=(T * K,), contiguous=True)
    check_tensor("y_MD", y_MD, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    if y_MD.shape[0] != T * K:
        raise ValueError(f"y_MD: expected {T * K} rows (M = T*K of the routing metadata), got shape {list(y_MD.shape)}")
    check_same_device(y_MD=y_MD, src_idx_M=src_idx_M, dst_idx_TK=dst_idx_TK)
    if topk_weights_TK is not None:
        check_tensor("topk_weights_TK", topk_weights_TK, dtypes=FLOAT_DTYPES, shape=(T, K), contiguous=True)
        check_same_device(y_MD=y_MD, topk_weights_TK=topk_weights_TK)


# ---------------------------------------------------------------------------------------------------- references

def permute_ref(x_TD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor) -> Tensor:
    """x_MD[m] = x_TD[src_idx_M[m] // K]. Returns [M, D] in x's dtype."""
    check_permute_inputs(x_TD, src_idx_M, dst_idx_TK)
    return x_TD[src_idx_M.long() // dst_idx_TK.shape[1]]


def unpermute_ref(y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, topk_weights_TK: Tensor | None) -> Tensor:
    """out_TD[t] = sum_k w[t, k] * y_MD[dst_idx_TK[t, k]] (w = 1 when None), fp32, returned in y's dtype."""
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    T, K = dst_idx_TK.shape
    acc_TD = torch.zeros(T, y_MD.shape[1], dtype=torch.float32, device=y_MD.device)
    if y_MD.dtype == torch.float64:
        acc_TD = acc_TD.double()
    for k in range(K):
        rows_TD = y_MD[dst_idx_TK[:, k].long()].to(acc_TD.dtype)
        if topk_weights_TK is not None:
            rows_TD = topk_weights_TK[:, k : k + 1].to(acc_TD.dtype) * rows_TD
        acc_TD = acc_TD + rows_TD
    return acc_TD.to(y_MD.dtype)


def unpermute_bwd_ref(grad_TD: Tensor, y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor,
                      topk_weights_TK: Tensor, need_dw: bool) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`unpermute_ref` with weights.

    Returns:
        dy_MD [M, D] in y's dtype: dy[dst[t, k]] = w[t, k] * grad[t];
        dw_TK [T, K] in the weights' dtype: dw[t, k] = <grad[t], y[dst[t, k]]> (fp32), or an empty [0] tensor
        when ``need_dw`` is False.
    """
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    check_tensor("grad_TD", grad_TD, dtypes=(y_MD.dtype,), shape=(dst_idx_TK.shape[0], y_MD.shape[1]))
    K = dst_idx_TK.shape[1]
    acc = torch.float64 if y_MD.dtype == torch.float64 else torch.float32
    flat_src = src_idx_M.long()
    w_M = topk_weights_TK.reshape(-1)[flat_src].to(acc)
    dy_MD = (w_M[:, None] * grad_TD[flat_src // K].to(acc)).to(y_MD.dtype)
    if not need_dw:
        return dy_MD, topk_weights_TK.new_empty(0)
    y_TKD = y_MD[dst_idx_TK.long()].to(acc)
    dw_TK = (grad_TD.to(acc)[:, None, :] * y_TKD).sum(-1)
    return dy_MD, dw_TK.to(topk_weights_TK.dtype)


# ---------------------------------------------------------------------------------------------------- kernels

PERMUTE_HOPPER_CONFIGS = [dict(BLOCK_R=2, BLOCK_D=2048, num_warps=8), dict(BLOCK_R=4, BLOCK_D=1024, num_warps=8),
                          dict(BLOCK_R=8, BLOCK_D=512, num_warps=4), dict(BLOCK_R=16, BLOCK_D=256, num_warps=4)]
_PERMUTE_CONFIGS = autotune_configs(PERMUTE_HOPPER_CONFIGS, dict(BLOCK_R=64, BLOCK_D=128))


@triton.autotune(configs=_PERMUTE_CONFIGS, key=["D"])
@triton.jit
def _permute_kernel(x_ptr, src_ptr, out_ptr, M, D, K, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < D)[None, :]
    tokens = (tl.load(src_ptr + rows, mask=row_ok, other=0) // K).to(tl.int64)
    vals = tl.load(x_ptr + tokens[:, None] * D + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], vals, mask=mask)


UNPERMUTE_HOPPER_CONFIGS = [dict(BLOCK_T=2, BLOCK_D=2048, num_warps=8), dict(BLOCK_T=2, BLOCK_D=1024, num_warps=8),
                            dict(BLOCK_T=4, BLOCK_D=512, num_warps=4), dict(BLOCK_T=8, BLOCK_D=256, num_warps=4)]
_UNPERMUTE_CONFIGS = autotune_configs(UNPERMUTE_HOPPER_CONFIGS, dict(BLOCK_T=32, BLOCK_D=128))


@triton.autotune(configs=_UNPERMUTE_CONFIGS, key=["D", "K"])
@triton.jit
def _unpermute_kernel(y_ptr, dst_ptr, w_ptr, out_ptr, T, D, K: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                      ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = tokens < T
    mask = tok_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    for k in tl.static_range(K):
        rows = tl.load(dst_ptr + tokens * K + k, mask=tok_ok, other=0).to(tl.int64)
        vals = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(ACC)
        if HAS_WEIGHTS:
            w = tl.load(w_ptr + tokens * K + k, mask=tok_ok, other=0.0).to(ACC)
            vals = w[:, None] * vals
        acc += vals
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


UNPERMUTE_BWD_HOPPER_CONFIGS = [dict(BLOCK_T=2, BLOCK_D=512, num_warps=4), dict(BLOCK_T=2, BLOCK_D=1024, num_warps=8),
                                dict(BLOCK_T=4, BLOCK_D=512, num_warps=4)]
_UNPERMUTE_BWD_CONFIGS = autotune_configs(UNPERMUTE_BWD_HOPPER_CONFIGS, dict(BLOCK_T=32, BLOCK_D=128))


@triton.autotune(configs=_UNPERMUTE_BWD_CONFIGS, key=["D", "K"])
@triton.jit
def _unpermute_bwd_kernel(grad_ptr, y_ptr, dst_ptr, w_ptr, dy_ptr, dw_ptr, T, D, K: tl.constexpr,
                          BLOCK_K: tl.constexpr, NEED_DW: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    # One program owns whole tokens: it reads grad[t] once per D chunk, scatters w*grad to the K grouped rows
    # and reduces <grad[t], y[dst[t, k]]> over all of D without atomics.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tokens < T
    kcols = tl.arange(0, BLOCK_K)
    dw_acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = tok_ok[:, None] & (cols < D)[None, :]
        g = tl.load(grad_ptr + tokens.to(tl.int64)[:, None] * D + cols[None, :], mask=mask, other=0.0)
        g = g.to(ACC)
        for k in tl.static_range(K):
            rows = tl.load(dst_ptr + tokens * K + k, mask=tok_ok, other=0).to(tl.int64)
            w = tl.load(w_ptr + tokens * K + k, mask=tok_ok, other=0.0).to(ACC)
            offs = rows[:, None] * D + cols[None, :]
            tl.store(dy_ptr + offs, (w[:, None] * g).to(dy_ptr.dtype.element_ty), mask=mask)
            if NEED_DW:
                y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(ACC)
                part = tl.sum(g * y, axis=1)
                dw_acc = tl.where(kcols[None, :] == k, dw_acc + part[:, None], dw_acc)
    if NEED_DW:
        dw_mask = tok_ok[:, None] & (kcols < K)[None, :]
        tl.store(dw_ptr + tokens[:, None] * K + kcols[None, :], dw_acc.to(dw_ptr.dtype.element_ty), mask=dw_mask)


# ---------------------------------------------------------------------------------------------------- launchers

def _acc(t: Tensor):
    # fp32 accumulation for every dtype but fp64 (kept so float64 gradchecks see full precision).
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def permute_triton(x_TD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, *, config: dict | None = None) -> Tensor:
    """Launcher of the permute kernel: x_MD[m] = x_TD[src_idx_M[m] // K].

    Args:
        x_TD: float [T, D], contiguous.
        src_idx_M: int32 [M], M = T*K.
        dst_idx_TK: int32 [T, K] (only its shape is read).

    Returns:
        x_MD [M, D] in x's dtype.
    """
    check_permute_inputs(x_TD, src_idx_M, dst_idx_TK)
    check_launch_device("permute_triton", x_TD)
    M, D = src_idx_M.shape[0], x_TD.shape[1]
    out_MD = alloc((M, D), x_TD.dtype, x_TD.device)
    if M > 0 and D > 0:
        def grid(meta):
            return cdiv(M, meta["BLOCK_R"]), cdiv(D, meta["BLOCK_D"])

        launch(_permute_kernel, grid, x_TD, src_idx_M, out_MD, M, D, dst_idx_TK.shape[1], config=config)
    return out_MD


def unpermute_triton(y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, topk_weights_TK: Tensor | None, *,
                     config: dict | None = None) -> Tensor:
    """Launcher of the unpermute kernel: out_TD[t] = sum_k w[t, k] * y_MD[dst_idx_TK[t, k]].

    Args:
        y_MD: float [M, D], contiguous.
        src_idx_M: int32 [M] (checked, not read).
        dst_idx_TK: int32 [T, K].
        topk_weights_TK: float [T, K], or None for weights of 1 (the backward of permute).

    Returns:
        out_TD [T, D] in y's dtype, accumulated in fp32 in the order k = 0..K-1.
    """
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    check_launch_device("unpermute_triton", y_MD)
    (T, K), D = dst_idx_TK.shape, y_MD.shape[1]
    out_TD = alloc((T, D), y_MD.dtype, y_MD.device)
    if T > 0 and D > 0:
        def grid(meta):
            return cdiv(T, meta["BLOCK_T"]), cdiv(D, meta["BLOCK_D"])

        w = topk_weights_TK if topk_weights_TK is not None else dst_idx_TK
        launch(_unpermute_kernel, grid, y_MD, dst_idx_TK, w, out_TD, T, D, K=K,
               HAS_WEIGHTS=topk_weights_TK is not None, ACC=_acc(y_MD), enable_fp_fusion=False, config=config)
    return out_TD


def unpermute_bwd_triton(
    grad_TD: Tensor, y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, topk_weights_TK: Tensor, need_dw: bool,
    *, config: dict | None = None,
) -> tuple[Tensor, Tensor]:
    """Launcher of the fused unpermute backward (same contract as :func:`unpermute_bwd_ref`).

    Args:
        grad_TD: [T, D] in y's dtype, contiguous.
        y_MD: float [M, D], contiguous (read only when ``need_dw``).
        src_idx_M: int32 [M]; dst_idx_TK: int32 [T, K]; topk_weights_TK: float [T, K].

    Returns:
        (dy_MD [M, D] in y's dtype, dw_TK [T, K] in the weights' dtype, or an empty [0] tensor).
    """
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    check_tensor("grad_TD", grad_TD, dtypes=(y_MD.dtype,), shape=(dst_idx_TK.shape[0], y_MD.shape[1]),
                 contiguous=True)
    check_launch_device("unpermute_bwd_triton", y_MD)
    (T, K), D = dst_idx_TK.shape, y_MD.shape[1]
    dy_MD = alloc((y_MD.shape[0], D), y_MD.dtype, y_MD.device)
    dw_TK = alloc((T, K) if need_dw else (0,), topk_weights_TK.dtype, y_MD.device)
    if need_dw and D == 0:
        dw_TK.zero_()
    if T > 0 and D > 0:
        def grid(meta):
            return (cdiv(T, meta["BLOCK_T"]),)

        launch(_unpermute_bwd_kernel, grid, grad_TD, y_MD, dst_idx_TK, topk_weights_TK, dy_MD,
               dw_TK if need_dw else dy_MD, T, D, K=K, BLOCK_K=max(next_power_of_2(K), 16), NEED_DW=need_dw,
               ACC=_acc(y_MD), config=config)
    return dy_MD, dw_TK
