"""Grouped matrix multiply for MoE experts: rows of group e times w[e], plus its backward.

Legend: M rows (grouped by expert), K reduction features, N output features, E groups (experts).

``offsets_E`` are END offsets (torch._grouped_mm convention): group e owns rows [offsets_E[e-1], offsets_E[e]),
with offsets_E[-1] == M; empty groups are allowed. The forward kernel maps program ids to (group, row tile)
inside the kernel from the offsets (a cumulative sum of per-group tile counts), so the launch needs no host
sync: it launches cdiv(M, BLOCK_M) + E row tiles, an upper bound, and the surplus programs return at once. dX
runs the same kernel on the transposed weights (a strided view, no copy); dW has its own kernel, one program
per (group, K tile, N tile) looping over the group's rows (an empty group writes zeros).

Loads use plain masked pointers, which also serve the strided (transposed) weights of dX. TMA tensor
descriptors on Hopper, and a gate/up GEMM with the SwiGLU in its epilogue, are candidates to add once a GPU
benchmark (bench/bench_kernels.py) shows what they gain over this version.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from ._triton import alloc, autotune_configs, check_launch_device, launch, tl, triton

__all__ = [
    "check_grouped_mm_inputs",
    "check_offsets_values",
    "grouped_mm_dw_ref",
    "grouped_mm_dw_triton",
    "grouped_mm_ref",
    "grouped_mm_triton",
]


def check_grouped_mm_inputs(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> None:
    """Shapes and dtypes (no device sync): x float [M, K]; w [E, K, N] of x's dtype; offsets int32/int64 [E]."""
    check_tensor("x_MK", x_MK, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("w_EKN", w_EKN, dtypes=FLOAT_DTYPES, ndim=3)
    if w_EKN.dtype != x_MK.dtype:
        raise TypeError(f"w_EKN: expected the dtype of x_MK ({x_MK.dtype}), got {w_EKN.dtype}")
    if w_EKN.shape[1] != x_MK.shape[1]:
        raise ValueError(f"w_EKN: expected K = {x_MK.shape[1]} (x_MK has shape {list(x_MK.shape)}) in shape [E, K, N], "
                         f"got shape {list(w_EKN.shape)}")
    if w_EKN.shape[0] < 1:
        raise ValueError(f"w_EKN: expected at least one group, got shape {list(w_EKN.shape)}")
    check_tensor("offsets_E", offsets_E, dtypes=INDEX_DTYPES, shape=(w_EKN.shape[0],), contiguous=True)
    check_same_device(x_MK=x_MK, w_EKN=w_EKN, offsets_E=offsets_E)


def check_offsets_values(offsets_E: Tensor, num_rows: int) -> None:
    """End offsets must be >= 0, non-decreasing and end at ``num_rows`` (one device->host sync on a GPU)."""
    first_bad = offsets_E[0] < 0
    decreasing = (offsets_E[1:] < offsets_E[:-1]).any()
    wrong_end = offsets_E[-1] != num_rows
    if torch.stack([first_bad, decreasing, wrong_end]).any().item():
        values = offsets_E.tolist()
        if first_bad.item() or decreasing.item():
            raise ValueError(f"offsets_E: expected non-negative, non-decreasing end offsets, got {values}")
        raise ValueError(f"offsets_E: expected the last end offset to equal M = {num_rows}, got {values[-1]} "
                         f"(offsets {values})")


# ---------------------------------------------------------------------------------------------------- references

def grouped_mm_ref(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Pure-torch twin: y_MN[rows of group e] = x_MK[rows of group e] @ w_EKN[e]. Returns [M, N] in x's dtype."""
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    check_offsets_values(offsets_E, x_MK.shape[0])
    y_MN = alloc((x_MK.shape[0], w_EKN.shape[2]), x_MK.dtype, x_MK.device)
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            y_MN[start:end] = x_MK[start:end] @ w_EKN[e]
        start = end
    return y_MN


def grouped_mm_dw_ref(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor) -> Tensor:
    """Pure-torch twin of the weight gradient: dw_EKN[e] = x_MK[group e]^T @ dy_MN[group e] (zeros when empty).

    Args:
        x_MK: float [M, K]; dy_MN: [M, N] of x's dtype; offsets_E: int32/int64 [E] end offsets.

    Returns:
        dw_EKN [E, K, N] in x's dtype.
    """
    check_dw_inputs(x_MK, dy_MN, offsets_E)
    check_offsets_values(offsets_E, x_MK.shape[0])
    dw_EKN = x_MK.new_zeros(offsets_E.shape[0], x_MK.shape[1], dy_MN.shape[1])
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            dw_EKN[e] = x_MK[start:end].T @ dy_MN[start:end]
        start = end
    return dw_EKN


def check_dw_inputs(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor) -> None:
    check_tensor("x_MK", x_MK, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("dy_MN", dy_MN, dtypes=(x_MK.dtype,), ndim=2)
    if dy_MN.shape[0] != x_MK.shape[0]:
        raise ValueError(f"dy_MN: expected {x_MK.shape[0]} rows (as x_MK), got shape {list(dy_MN.shape)}")
    check_tensor("offsets_E", offsets_E, dtypes=INDEX_DTYPES, ndim=1, contiguous=True)
    if offsets_E.shape[0] < 1:
        raise ValueError("offsets_E: expected at least one group, got an empty tensor")
    check_same_device(x_MK=x_MK, dy_MN=dy_MN, offsets_E=offsets_E)


# ---------------------------------------------------------------------------------------------------- kernels

def _dot_meta(t: Tensor) -> dict:
    """Compile-time arguments of the dot: accumulator dtype, input precision, interpreter upcast."""
    # fp32 follows torch's own switch (full precision by default); other dtypes take Triton's default.
    precision = None
    if t.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return dict(ACC=tl.float64 if t.dtype == torch.float64 else tl.float32, DOT_PRECISION=precision,
                # The interpreter computes bf16 dots wrongly; it gets fp32 tiles (exact products of bf16 values).
                UPCAST=(not t.is_cuda) and t.dtype == torch.bfloat16)


# Hopper: 128-row tiles feed wgmma (one warpgroup per 64 rows); a 64-row config serves small groups.
FWD_HOPPER_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
]
_FWD_CONFIGS = autotune_configs(FWD_HOPPER_CONFIGS, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2))


@triton.autotune(configs=_FWD_CONFIGS, key=["N", "K"])
@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, offsets_ptr, M, N, K, E,
                       stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
                       BLOCK_E: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M) + E
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    # Bands of GROUP_M row tiles, all column tiles of a band before the next: programs running together share
    # their rows of x and their columns of w in L2, instead of re-reading x once per column tile.
    tiles_per_band = GROUP_M * num_n_tiles
    band = pid // tiles_per_band
    first_m = band * GROUP_M
    band_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_band) % band_rows
    pid_n = (pid % tiles_per_band) // band_rows

    # Which group owns row tile pid_m: count the groups whose cumulative tile count ends at or before it.
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    ends = tl.load(offsets_ptr + experts, mask=valid, other=0).to(tl.int32)
    starts = tl.load(offsets_ptr + experts - 1, mask=valid & (experts > 0), other=0).to(tl.int32)
    counts = tl.where(valid, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    group = tl.sum((tile_ends <= pid_m).to(tl.int32), axis=0)
    if group >= E:
        return
    is_group = experts == group
    first_tile = tl.sum(tl.where(is_group, tile_ends - tiles, 0), axis=0)
    row_start = tl.sum(tl.where(is_group, starts, 0), axis=0) + (pid_m - first_tile) * BLOCK_M
    # Bounded by M so that unchecked (check=False) bad offsets can never write outside y.
    row_end = tl.minimum(tl.sum(tl.where(is_group, ends, 0), axis=0), M)

    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < row_end
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = (w_ptr + group.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk
              + offs_n.to(tl.int64)[None, :] * stride_wn)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


DW_HOPPER_CONFIGS = [
    dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=64, num_warps=8, num_stages=4),
    dict(BLOCK_K=128, BLOCK_N=256, BLOCK_M=64, num_warps=8, num_stages=3),
    dict(BLOCK_K=64, BLOCK_N=128, BLOCK_M=64, num_warps=4, num_stages=4),
    dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=32, num_warps=4, num_stages=4),
]
_DW_CONFIGS = autotune_configs(DW_HOPPER_CONFIGS, dict(BLOCK_K=32, BLOCK_N=32, BLOCK_M=32))


@triton.autotune(configs=_DW_CONFIGS, key=["N", "K"])
@triton.jit
def _grouped_mm_dw_kernel(x_ptr, dy_ptr, dw_ptr, offsets_ptr, M, K, N,
                          stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
                          ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    group = pid // (k_tiles * n_tiles)
    rest = pid % (k_tiles * n_tiles)
    pid_k = rest % k_tiles
    pid_n = rest // k_tiles
    start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0).to(tl.int32)
    end = tl.minimum(tl.load(offsets_ptr + group).to(tl.int32), M)

    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=ACC)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < end
        rows64 = rows.to(tl.int64)
        xt = tl.load(x_ptr + offs_k[:, None] * stride_xk + rows64[None, :] * stride_xm,
                     mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        g = tl.load(dy_ptr + rows64[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(xt, g, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
    dw_ptrs = dw_ptr + group.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------------- launchers

def grouped_mm_triton(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, *, check_values: bool = True,
                      config: dict | None = None) -> Tensor:
    """Launcher of the grouped GEMM: y_MN[rows of group e] = x_MK[rows of group e] @ w_EKN[e].

    Args:
        x_MK: float [M, K], any strides.
        w_EKN: [E, K, N] of x's dtype, any strides (dX passes the transposed weights as a view).
        offsets_E: int32/int64 [E] end offsets, offsets_E[-1] == M.
        check_values: check the offsets' values (one device->host sync on a GPU).
        config: explicit block sizes instead of the autotuner (see ``_triton.launch``).

    Returns:
        y_MN [M, N] in x's dtype, accumulated in fp32.
    """
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    check_launch_device("grouped_mm_triton", x_MK)
    if check_values:
        check_offsets_values(offsets_E, x_MK.shape[0])
    (M, K), (E, _, N) = x_MK.shape, w_EKN.shape
    y_MN = alloc((M, N), x_MK.dtype, x_MK.device)
    if M == 0 or N == 0:
        return y_MN
    if K == 0:
        return y_MN.zero_()

    def grid(meta):
        return ((triton.cdiv(M, meta["BLOCK_M"]) + E) * triton.cdiv(N, meta["BLOCK_N"]),)

    launch(_grouped_mm_kernel, grid, x_MK, w_EKN, y_MN, offsets_E, M, N, K, E,
           x_MK.stride(0), x_MK.stride(1), *w_EKN.stride(), y_MN.stride(0), y_MN.stride(1),
           BLOCK_E=max(triton.next_power_of_2(E), 16), **_dot_meta(x_MK), config=config)
    return y_MN


def grouped_mm_dw_triton(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor, *, check_values: bool = True,
                         config: dict | None = None) -> Tensor:
    """Launcher of the weight gradient: dw_EKN[e] = x_MK[group e]^T @ dy_MN[group e] (zeros for empty groups).

    Args:
        x_MK: float [M, K], any strides; dy_MN: [M, N] of x's dtype, any strides;
        offsets_E: int32/int64 [E] end offsets, offsets_E[-1] == M.

    Returns:
        dw_EKN [E, K, N] in x's dtype, accumulated in fp32.
    """
    check_dw_inputs(x_MK, dy_MN, offsets_E)
    check_launch_device("grouped_mm_dw_triton", x_MK)
    if check_values:
        check_offsets_values(offsets_E, x_MK.shape[0])
    (M, K), N, E = x_MK.shape, dy_MN.shape[1], offsets_E.shape[0]
    dw_EKN = alloc((E, K, N), x_MK.dtype, x_MK.device)
    if K == 0 or N == 0:
        return dw_EKN
    if M == 0:
        return dw_EKN.zero_()

    def grid(meta):
        return (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    launch(_grouped_mm_dw_kernel, grid, x_MK, dy_MN, dw_EKN, offsets_E, M, K, N, x_MK.stride(0), x_MK.stride(1),
           dy_MN.stride(0), dy_MN.stride(1), *dw_EKN.stride(), **_dot_meta(x_MK), config=config)
    return dw_EKN
