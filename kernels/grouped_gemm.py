"""Grouped matrix multiply for MoE experts: rows of group e times w[e], plus its backward.

Legend: M rows (grouped by expert), K reduction features, N output features, E groups (experts).

``offsets_E`` are END offsets (torch._grouped_mm convention): group e owns rows [offsets_E[e-1], offsets_E[e]),
with offsets_E[-1] == M; empty groups are allowed. Kernels map work to groups inside the kernel from the offsets
(a cumulative sum of per-group tile counts), so no launch needs a host sync. dX runs the forward kernels on the
transposed weights (a strided view, no copy).

Forward / dX come in two variants (:func:`choose_variant` picks one per call):

* ``classic``: one program per (row tile, column tile), masked pointer loads (any strides and dtypes); it
  launches cdiv(M, BLOCK_M) + E row tiles, an upper bound, and the surplus programs return at once.
* ``persistent``: one program per SM walks the exact tile list in bands of GROUP_M row tiles, operands through
  tensor descriptors (TMA on sm_90, 128x256x64 tiles with 3 stages among its configs); for bf16/fp16 operands
  with 16-byte-aligned strides on compute capability >= 9.

dW (x^T dy per group) splits the rows of large groups into chunks whose fp32 partial sums a second kernel adds
in a fixed order (:func:`dw_split_rows` picks the chunk). It comes in two variants too (:func:`choose_dw_variant`):
``classic`` (one program per work item, masked pointer loads; the default) and ``persistent`` (one program per SM,
two for the 4-warp tiles, walk the exact work list, x and dy through tensor descriptors, the chunk's partial last block
zeroed past its end; opt-in until a GPU run times it against the classic one).

Autotune configs are pruned by the shared memory they need for the operands' dtype (fp64 and fp32 fall back to
smaller tiles), and every autotune key holds the rows per group, bucketed to a power of two, so a config tuned at
128 rows per expert is not reused at 4096.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from ._triton import (
    alloc,
    autotune_configs,
    cdiv,
    check_config_fits,
    check_launch_device,
    ensure_descriptor_allocator,
    launch,
    next_power_of_2,
    num_programs,
    rows_bucket,
    shared_memory_prune,
    tl,
    triton,
)

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


def _check_offsets_list(values: list[int], num_rows: int) -> None:
    """:func:`check_offsets_values` on offsets already read to the host (the CPU twins read them anyway): the same
    errors, without the device reductions."""
    if values[0] < 0 or any(b < a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"offsets_E: expected non-negative, non-decreasing end offsets, got {values}")
    if values[-1] != num_rows:
        raise ValueError(f"offsets_E: expected the last end offset to equal M = {num_rows}, got {values[-1]} "
                         f"(offsets {values})")


def check_offsets_values(offsets_E: Tensor, num_rows: int) -> None:
    """End offsets must be >= 0, non-decreasing and end at ``num_rows`` (one device->host sync on a GPU)."""
    first_bad = offsets_E[0] < 0
    decreasing = (offsets_E[1:] < offsets_E[:-1]).any()
    wrong_end = offsets_E[-1] != num_rows
    if torch.stack([first_bad, decreasing, wrong_end]).any().item():
        _check_offsets_list(offsets_E.tolist(), num_rows)


# ---------------------------------------------------------------------------------------------------- references

def grouped_mm_ref(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Pure-torch twin: y_MN[rows of group e] = x_MK[rows of group e] @ w_EKN[e]. Returns [M, N] in x's dtype."""
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    ends = offsets_E.tolist()
    _check_offsets_list(ends, x_MK.shape[0])
    y_MN = alloc((x_MK.shape[0], w_EKN.shape[2]), x_MK.dtype, x_MK.device)
    start = 0
    for e, end in enumerate(ends):
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
    ends = offsets_E.tolist()
    _check_offsets_list(ends, x_MK.shape[0])
    dw_EKN = x_MK.new_zeros(offsets_E.shape[0], x_MK.shape[1], dy_MN.shape[1])
    start = 0
    for e, end in enumerate(ends):
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
    # fp32 follows torch's own switch for matmuls (full precision by default); other dtypes take Triton's default.
    # (read through fp32_precision, which allow_tf32 = True/False also sets: allow_tf32 itself raises once a program
    # has set TF32 through fp32_precision, torch's API since 2.9; "none" inherits torch.backends.fp32_precision,
    # whose own default is full precision)
    precision = None
    if t.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "ieee"
    return dict(ACC=tl.float64 if t.dtype == torch.float64 else tl.float32, DOT_PRECISION=precision,
                # The interpreter computes bf16 dots wrongly; it gets fp32 tiles (exact products of bf16 values).
                UPCAST=(not t.is_cuda) and t.dtype == torch.bfloat16)


@triton.jit
def _group_bounds(offsets_ptr, E, M, BLOCK_E: tl.constexpr):
    """Lanes [BLOCK_E] of every group: (lane ids, start rows, end rows), clamped so that 0 <= start <= end <= M
    (unchecked bad offsets then give empty or shorter groups, never rows outside x); lanes >= E are empty."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    ends = tl.load(offsets_ptr + experts, mask=valid, other=0).to(tl.int32)
    starts = tl.load(offsets_ptr + experts - 1, mask=valid & (experts > 0), other=0).to(tl.int32)
    ends = tl.minimum(tl.maximum(ends, 0), M)
    starts = tl.minimum(tl.maximum(starts, 0), ends)
    return experts, starts, ends


@triton.jit
def _locate(index, item_ends, items, experts, starts, ends):
    """Work items are numbered group after group (``items`` per group, ``item_ends`` their cumulative sum):
    (group, item index inside the group, group start row, group end row) of item ``index``; group == number of
    lanes with item_ends <= index, so an index past the last item gives a group >= E."""
    group = tl.sum((item_ends <= index).to(tl.int32), axis=0)
    is_group = experts == group
    first = tl.sum(tl.where(is_group, item_ends - items, 0), axis=0)
    start = tl.sum(tl.where(is_group, starts, 0), axis=0)
    end = tl.sum(tl.where(is_group, ends, 0), axis=0)
    return group, index - first, start, end


@triton.jit
def _band_swizzle(tile, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """Tile index -> (row tile, column tile), in bands of GROUP_M row tiles, all column tiles of a band before the
    next: programs running together share their rows of x and their columns of w in L2."""
    tiles_per_band = GROUP_M * num_n_tiles
    first_m = (tile // tiles_per_band) * GROUP_M
    band_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    return first_m + (tile % tiles_per_band) % band_rows, (tile % tiles_per_band) // band_rows


def fwd_shared_bytes(entry: dict, itemsize: int) -> int:
    """Shared memory of a forward / dX config: num_stages stages of an x tile [BLOCK_M, BLOCK_K] and a w tile
    [BLOCK_K, BLOCK_N] (the epilogue reuses the ring), plus 1 KiB for the pipeline's barriers and scratch."""
    stages = max(entry.get("num_stages", 1), 1)
    return stages * (entry["BLOCK_M"] + entry["BLOCK_N"]) * entry["BLOCK_K"] * itemsize + 1024


def persistent_shared_bytes(entry: dict, itemsize: int) -> int:
    """The persistent variant's flattened tile loop keeps the ring alive through the epilogue, whose layout
    conversion of the [BLOCK_M, BLOCK_N] output tile needs its own buffer (counted whole)."""
    return fwd_shared_bytes(entry, itemsize) + entry["BLOCK_M"] * entry["BLOCK_N"] * itemsize


def dw_shared_bytes(entry: dict, itemsize: int) -> int:
    """Shared memory of a dW config: num_stages stages of an x^T tile [BLOCK_K, BLOCK_M] and a dy tile
    [BLOCK_M, BLOCK_N], plus 1 KiB."""
    stages = max(entry.get("num_stages", 1), 1)
    return stages * entry["BLOCK_M"] * (entry["BLOCK_K"] + entry["BLOCK_N"]) * itemsize + 1024


# Hopper: 128-row tiles feed wgmma (one warpgroup per 64 rows); 64-row configs serve small groups; the
# 128x128x32 tile is the one fp32 operands fit (4-byte operands double the shared memory of a stage).
FWD_HOPPER_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
]
# Used when no config above fits shared memory (fp64: 8-byte operands).
FWD_FALLBACK_CONFIGS = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)]
_FWD_CONFIGS = autotune_configs(FWD_HOPPER_CONFIGS, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2))
_fwd_prune = shared_memory_prune(fwd_shared_bytes, FWD_FALLBACK_CONFIGS, "x_ptr")


@triton.autotune(configs=_FWD_CONFIGS, key=["N", "K", "M_BUCKET"], prune_configs_by={"early_config_prune": _fwd_prune})
@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, offsets_ptr, M, N, K, E, M_BUCKET,
                       stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
                       BLOCK_E: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    """Classic variant, one program per (row tile, column tile); masked pointer loads (any strides).

    Grid: (cdiv(M, BLOCK_M) + E) * cdiv(N, BLOCK_N) programs, an upper bound on the row tiles that needs no host
    sync; the surplus programs return at once. M_BUCKET only keys the autotuner (rows per group, bucketed)."""
    pid = tl.program_id(0)
    experts, starts, ends = _group_bounds(offsets_ptr, E, M, BLOCK_E)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    pid_m, pid_n = _band_swizzle(pid, tl.cdiv(M, BLOCK_M) + E, tl.cdiv(N, BLOCK_N), GROUP_M)
    group, m_tile, row_start, row_end = _locate(pid_m, tl.cumsum(tiles, axis=0), tiles, experts, starts, ends)
    if group >= E:
        return
    row_start += m_tile * BLOCK_M

    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < row_end
    n_ok = offs_n < N
    # 64-bit offsets along K too: a column-major x (stride M along K) or a weight with 2**25 elements between its
    # K rows passes 2**31 within a tile (the pointers are made from k0 at every step: a 32-bit BLOCK_K * stride
    # added at each step wrapped the same way)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + group.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        ks64 = ks.to(tl.int64)
        a = tl.load(x_rows + ks64[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks64[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Persistent TMA variant (16-bit operands on sm_90): 128-row tiles, 3-4 stages; 64-row tiles for small groups.
# (128x256x64 with 4 stages compiles to 229,408 bytes with the flattened loop: too close to the limit to keep.)
PERSISTENT_HOPPER_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
]
PERSISTENT_FALLBACK_CONFIGS = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)]
_PERSISTENT_CONFIGS = autotune_configs(PERSISTENT_HOPPER_CONFIGS, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2))
_persistent_prune = shared_memory_prune(persistent_shared_bytes, PERSISTENT_FALLBACK_CONFIGS, "x_ptr")


@triton.autotune(configs=_PERSISTENT_CONFIGS, key=["N", "K", "M_BUCKET", "W_K_CONTIGUOUS"],
                 prune_configs_by={"early_config_prune": _persistent_prune})
@triton.jit
def _grouped_mm_persistent_kernel(x_ptr, w_ptr, y_ptr, offsets_ptr, M, N, K, E, M_BUCKET, NUM_PROGRAMS,
                                  stride_xm, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
                                  W_K_CONTIGUOUS: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent variant: NUM_PROGRAMS programs (one per SM) walk the exact tile list, in bands of GROUP_M row
    tiles; operands come through tensor descriptors (TMA on sm_90). The tile loop is flattened with the K loop,
    so the loads of a program's next tile start while it stores the current one.

    x [M, K] (unit stride along K) is one descriptor; rows past a group's end are loaded but only feed
    accumulator rows that the store drops, and columns past K load as zeros. w is one 3-D descriptor, [E, K, N]
    (unit stride along N: forward) or [E, N, K] (W_K_CONTIGUOUS, unit stride along K: dX on the transposed
    weights), so a K or N tile is clipped at the expert's own edge. The store is masked at the group's end."""
    pid = tl.program_id(0)
    experts, starts, ends = _group_bounds(offsets_ptr, E, M, BLOCK_E)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    num_m_tiles = tl.sum(tiles, axis=0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    if W_K_CONTIGUOUS:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E, N, K], strides=[stride_we, stride_wn, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E, K, N], strides=[stride_we, stride_wk, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    for tile in tl.range(pid, num_m_tiles * num_n_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _band_swizzle(tile, num_m_tiles, num_n_tiles, GROUP_M)
        group, m_tile, row_start, row_end = _locate(pid_m, tile_ends, tiles, experts, starts, ends)
        row_start += m_tile * BLOCK_M
        col_start = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([row_start, k0])
            if W_K_CONTIGUOUS:
                b = w_desc.load([group, col_start, k0]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = w_desc.load([group, k0, col_start]).reshape(BLOCK_K, BLOCK_N)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        offs_m = row_start + tl.arange(0, BLOCK_M)
        offs_n = col_start + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < row_end)[:, None] & (offs_n < N)[None, :])


# The 3-stage 128x128 tile (97 KiB) lets two programs share an SM, so that one's prologue and epilogue overlap
# the other's main loop: with 256-512 rows per group a dW program runs only 4-8 steps of its reduction. The last
# one is for fp32 with IEEE dots (no tensor cores): ptxas spills every other config kept for it to local memory
# (about 10-26 KB per thread for the 64-row reductions, 3 KB for 32 rows on 4 warps), this one not
# (tests/kernels/test_hopper_compile.py).
DW_HOPPER_CONFIGS = [
    dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=64, num_warps=8, num_stages=4),
    dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=64, num_warps=8, num_stages=3),
    dict(BLOCK_K=128, BLOCK_N=256, BLOCK_M=64, num_warps=8, num_stages=3),
    dict(BLOCK_K=64, BLOCK_N=128, BLOCK_M=64, num_warps=4, num_stages=4),
    dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=32, num_warps=4, num_stages=4),
    _DW_FP32_IEEE := dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=32, num_warps=8, num_stages=3),
]
DW_FALLBACK_CONFIGS = [dict(BLOCK_K=64, BLOCK_N=64, BLOCK_M=32, num_warps=4, num_stages=3)]
_DW_CONFIGS = autotune_configs(DW_HOPPER_CONFIGS, dict(BLOCK_K=32, BLOCK_N=32, BLOCK_M=32))
_dw_prune = shared_memory_prune(dw_shared_bytes, DW_FALLBACK_CONFIGS, "x_ptr")


@triton.jit
def _dw_chunks(offsets_ptr, E, M, CHUNK, BLOCK_E: tl.constexpr):
    """Lanes [BLOCK_E] of every group for dW: (lane ids, start rows, end rows, chunks); a group of r rows is
    max(cdiv(r, CHUNK), 1) chunks (an empty group is one chunk, which writes zeros), lanes >= E none."""
    experts, starts, ends = _group_bounds(offsets_ptr, E, M, BLOCK_E)
    chunks = tl.where(experts < E, tl.maximum((ends - starts + CHUNK - 1) // CHUNK, 1), 0)
    return experts, starts, ends, chunks


@triton.jit
def _dw_store(acc, group, chunk, experts, chunks, offs_k, offs_n, K, N, NUM_PARTS, dw_ptr, part_ptr, stride_we,
              stride_wk, stride_wn):
    """Store one [BLOCK_K, BLOCK_N] tile of a chunk's x^T dy: straight into dw[group] when the group is one chunk,
    else into the chunk's partial-sum slot (its split groups' chunks before it plus the chunk index), which
    ``_dw_reduce_kernel`` adds up in chunk order."""
    k_ok = offs_k < K
    n_ok = offs_n < N
    parts = tl.where(chunks > 1, chunks, 0)
    # (64-bit offsets: an expert of K * N >= 2**31 weights wrote its last rows 2**32 elements before dw)
    k64 = offs_k.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    if tl.sum(tl.where(experts == group, parts, 0), axis=0) == 0:
        dw_ptrs = dw_ptr + group.to(tl.int64) * stride_we + k64[:, None] * stride_wk + n64[None, :] * stride_wn
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])
    else:
        slot = tl.sum(tl.where(experts < group, parts, 0), axis=0) + chunk
        part_ptrs = part_ptr + slot.to(tl.int64) * K * N + k64[:, None] * N + n64[None, :]
        slot_ok = (offs_k * 0 + slot) < NUM_PARTS  # a bound the slot never reaches (kept as a guard)
        tl.store(part_ptrs, acc.to(part_ptr.dtype.element_ty), mask=(k_ok & slot_ok)[:, None] & n_ok[None, :])


@triton.autotune(configs=_DW_CONFIGS, key=["N", "K", "M_BUCKET", "CHUNK"],
                 prune_configs_by={"early_config_prune": _dw_prune})
@triton.jit
def _grouped_mm_dw_kernel(x_ptr, dy_ptr, dw_ptr, part_ptr, offsets_ptr, M, K, N, E, CHUNK, NUM_PARTS, M_BUCKET,
                          stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
                          BLOCK_E: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Split-M weight gradient, classic variant: one program per (row chunk, K tile, N tile), masked pointer loads
    (any strides and dtypes).

    A group of r rows is cut into max(cdiv(r, CHUNK), 1) chunks of CHUNK rows (an empty group is one chunk that
    writes zeros). A group in one chunk writes dw[group] directly; the chunks of a larger group write their
    partial sums (accumulator dtype) to part [NUM_PARTS, K, N] (``_dw_store``), and ``_dw_reduce_kernel`` adds
    them in chunk order (deterministic). Grid: (cdiv(M, CHUNK) + E) * cdiv(K, BLOCK_K) * cdiv(N, BLOCK_N), an
    upper bound on the chunks; the surplus programs return at once."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    item = pid // (k_tiles * n_tiles)
    rest = pid % (k_tiles * n_tiles)
    pid_k = rest % k_tiles
    pid_n = rest // k_tiles
    experts, starts, ends, chunks = _dw_chunks(offsets_ptr, E, M, CHUNK, BLOCK_E)
    group, chunk, start, end = _locate(item, tl.cumsum(chunks, axis=0), chunks, experts, starts, ends)
    if group >= E:
        return
    row_lo = start + chunk * CHUNK
    row_hi = tl.minimum(end, row_lo + CHUNK)

    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=ACC)
    for m0 in range(row_lo, row_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < row_hi
        rows64 = rows.to(tl.int64)
        # 64-bit offsets: with column-major x or dy (stride M along K or N), K * M passes 2**31 at realistic sizes.
        xt = tl.load(x_ptr + offs_k.to(tl.int64)[:, None] * stride_xk + rows64[None, :] * stride_xm,
                     mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        g = tl.load(dy_ptr + rows64[:, None] * stride_dym + offs_n.to(tl.int64)[None, :] * stride_dyn,
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(xt, g, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
    _dw_store(acc, group, chunk, experts, chunks, offs_k, offs_n, K, N, NUM_PARTS, dw_ptr, part_ptr, stride_we,
              stride_wk, stride_wn)


# The persistent dW variant takes the classic's tile shapes, each with the programs it launches per SM: two where
# two fit one SM in shared memory and in registers, so that one's prologue and epilogue overlap the other's main
# loop (its tile loop is not flattened: a work item's row count varies). ptxas for sm_90 gives the 4-warp tiles
# 171 and 218 registers per thread (two blocks of 128 threads fit the SM's 64K), the 8-warp ones 154 to 242 (two
# blocks of 256 threads do not); tests/kernels/test_hopper_compile.py checks both limits for every config. (Not
# the fp32 IEEE tile: the persistent variant runs 16-bit operands only.)
DW_PERSISTENT_HOPPER_CONFIGS = [dict(c, PROGRAMS_PER_SM=2 if c["num_warps"] == 4 else 1) for c in DW_HOPPER_CONFIGS
                                if c is not _DW_FP32_IEEE]
DW_PERSISTENT_FALLBACK_CONFIGS = [dict(c, PROGRAMS_PER_SM=1) for c in DW_FALLBACK_CONFIGS]
_DW_PERSISTENT_CONFIGS = autotune_configs(DW_PERSISTENT_HOPPER_CONFIGS,
                                          dict(BLOCK_K=32, BLOCK_N=32, BLOCK_M=32, PROGRAMS_PER_SM=1))
_dw_persistent_prune = shared_memory_prune(dw_shared_bytes, DW_PERSISTENT_FALLBACK_CONFIGS, "x_ptr")


@triton.autotune(configs=_DW_PERSISTENT_CONFIGS, key=["N", "K", "M_BUCKET", "CHUNK"],
                 prune_configs_by={"early_config_prune": _dw_persistent_prune})
@triton.jit
def _grouped_mm_dw_persistent_kernel(x_ptr, dy_ptr, dw_ptr, part_ptr, offsets_ptr, M, K, N, E, CHUNK, NUM_PARTS,
                                     M_BUCKET, stride_xm, stride_dym, stride_we, stride_wk, stride_wn,
                                     BLOCK_E: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_K: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr = 1):
    """Split-M weight gradient, persistent variant: the grid's programs (PROGRAMS_PER_SM per SM: the launcher's
    grid reads it from the config) walk the exact list of (row chunk, K
    tile, N tile) work items (chunks as in the classic variant, whose ``_dw_store`` it shares); x [M, K] and dy
    [M, N] (unit stride along K and N) come through tensor descriptors (TMA on sm_90).

    The rows of a chunk are the reduction dimension, so rows of the next group must not enter it: whole BLOCK_M
    blocks feed the dot straight from the descriptor loads, and the chunk's last, partial block is zeroed past the
    chunk's end in both operands (rows past M load as zeros). Consecutive work items share their chunk's rows of x
    and dy, which programs running together then read from L2."""
    pid = tl.program_id(0)
    experts, starts, ends, chunks = _dw_chunks(offsets_ptr, E, M, CHUNK, BLOCK_E)
    item_ends = tl.cumsum(chunks, axis=0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_item = k_tiles * n_tiles
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[stride_dym, 1],
                                        block_shape=[BLOCK_M, BLOCK_N])
    # the programs launched depend on the config (PROGRAMS_PER_SM), so the grid says how many there are
    for tile in tl.range(pid, tl.sum(chunks, axis=0) * tiles_per_item, tl.num_programs(0)):
        item = tile // tiles_per_item
        rest = tile % tiles_per_item
        k0 = (rest % k_tiles) * BLOCK_K
        n0 = (rest // k_tiles) * BLOCK_N
        group, chunk, start, end = _locate(item, item_ends, chunks, experts, starts, ends)
        row_lo = start + chunk * CHUNK
        row_hi = tl.minimum(end, row_lo + CHUNK)
        full_end = row_lo + (row_hi - row_lo) // BLOCK_M * BLOCK_M
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=ACC)
        for m0 in range(row_lo, full_end, BLOCK_M):
            a = x_desc.load([m0, k0])
            g = dy_desc.load([m0, n0])
            if UPCAST:
                a = a.to(tl.float32)
                g = g.to(tl.float32)
            acc = tl.dot(a.T, g, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        if full_end < row_hi:
            keep = (full_end + tl.arange(0, BLOCK_M)) < row_hi
            a = tl.where(keep[:, None], x_desc.load([full_end, k0]), 0.0)
            g = tl.where(keep[:, None], dy_desc.load([full_end, n0]), 0.0)
            if UPCAST:
                a = a.to(tl.float32)
                g = g.to(tl.float32)
            acc = tl.dot(a.T, g, acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        _dw_store(acc, group, chunk, experts, chunks, k0 + tl.arange(0, BLOCK_K), n0 + tl.arange(0, BLOCK_N), K, N,
                  NUM_PARTS, dw_ptr, part_ptr, stride_we, stride_wk, stride_wn)


@triton.jit
def _dw_reduce_kernel(part_ptr, dw_ptr, offsets_ptr, M, KN, E, CHUNK, NUM_PARTS, stride_we,
                      BLOCK_E: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """dw[g] = sum of the partial sums of split group g, in chunk order. Grid: :func:`dw_reduce_grid`,
    (cdiv(K * N, BLOCK), split groups bound); program (b, s) adds BLOCK elements of the s-th split group (none
    left: returns). The element blocks go on axis 0, whose limit is 2**31 - 1 (axis 1's is 65,535)."""
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    experts, _, _, chunks = _dw_chunks(offsets_ptr, E, M, CHUNK, BLOCK_E)
    split = chunks > 1
    group = tl.sum((tl.cumsum(split.to(tl.int32), axis=0) <= pid_s).to(tl.int32), axis=0)
    if group >= E:
        return
    parts = tl.where(split, chunks, 0)
    count = tl.sum(tl.where(experts == group, parts, 0), axis=0)
    base = tl.sum(tl.where(experts < group, parts, 0), axis=0)
    offs = pid_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)    # (K * N may pass 2**31)
    ok = offs < KN
    acc = tl.zeros([BLOCK], dtype=ACC)
    for p in range(0, count):
        slot_ok = (offs * 0 + base + p) < NUM_PARTS
        acc += tl.load(part_ptr + (base + p).to(tl.int64) * KN + offs, mask=ok & slot_ok, other=0.0)
    tl.store(dw_ptr + group.to(tl.int64) * stride_we + offs, acc.to(dw_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------------- launchers

VARIANTS = ("classic", "persistent")
"""Forward / dX kernels: ``classic`` (one program per tile, pointer loads, any strides and dtypes) and
``persistent`` (one program per SM, tensor descriptors; 16-bit operands with TMA-compatible strides)."""

_VARIANT_ENV = "FEPLB_GROUPED_MM_VARIANT"


def persistent_unsupported(x_MK: Tensor, w_EKN: Tensor) -> str | None:
    """Why the persistent (tensor-descriptor) variant cannot take these operands, or None when it can.

    Tensor descriptors need a unit stride along the last dimension, other strides that are positive and, with the
    base addresses, multiples of 16 bytes; on a GPU it takes bf16/fp16 on compute capability >= 9 (TMA and wgmma).
    """
    if not hasattr(tl, "make_tensor_descriptor"):
        return "the installed Triton has no tl.make_tensor_descriptor"
    if x_MK.is_cuda:
        if x_MK.dtype not in (torch.bfloat16, torch.float16):
            return f"it takes bf16/fp16 on a GPU, got {x_MK.dtype}"
        if torch.cuda.get_device_capability(x_MK.device) < (9, 0):
            return "it needs compute capability >= 9.0 (TMA)"
    size = x_MK.element_size()
    if x_MK.stride(1) != 1 or w_EKN.stride(2) != 1 and w_EKN.stride(1) != 1:
        return "x_MK needs a unit stride along K and w_EKN a unit stride along K or N"
    outer = [x_MK.stride(0), w_EKN.stride(0), w_EKN.stride(1) if w_EKN.stride(2) == 1 else w_EKN.stride(2)]
    if 0 in outer and x_MK.numel() and w_EKN.numel():
        # a broadcast operand (a gradient of a sum, say): a descriptor's strides must be positive
        return f"strides {outer} hold a zero (a broadcast operand)"
    if any(s * size % 16 for s in outer) or x_MK.data_ptr() % 16 or w_EKN.data_ptr() % 16:
        return f"strides {outer} (elements of {size} bytes) and base addresses must be multiples of 16 bytes"
    if max(x_MK.shape[0], x_MK.shape[1], w_EKN.shape[2]) >= 2**31:
        return "descriptor coordinates are 32-bit"
    return None


def choose_variant(x_MK: Tensor, w_EKN: Tensor) -> str:
    """The rule the launcher uses: ``persistent`` where it can run (see :func:`persistent_unsupported`) on a GPU,
    else ``classic``. The environment variable FEPLB_GROUPED_MM_VARIANT=classic turns the persistent variant off
    (=persistent asks for it where it can run, under the interpreter too)."""
    wanted = os.environ.get(_VARIANT_ENV, "auto")
    if wanted not in ("auto", *VARIANTS):
        raise ValueError(f"{_VARIANT_ENV}: expected one of auto, classic, persistent, got {wanted!r}")
    if wanted == "classic" or (wanted == "auto" and not x_MK.is_cuda):
        return "classic"
    return "classic" if persistent_unsupported(x_MK, w_EKN) else "persistent"


DW_VARIANTS = ("classic", "persistent")
"""dW kernels: ``classic`` (one program per work item, pointer loads, any strides and dtypes) and ``persistent``
(one program per SM, two for the 4-warp tiles; tensor descriptors; 16-bit operands with TMA-compatible strides)."""

_DW_VARIANT_ENV = "FEPLB_GROUPED_MM_DW_VARIANT"


def dw_persistent_unsupported(x_MK: Tensor, dy_MN: Tensor) -> str | None:
    """Why the persistent (tensor-descriptor) dW variant cannot take these operands, or None when it can: the
    forward's conditions (:func:`persistent_unsupported`) for x [M, K] and dy [M, N], each with a unit stride
    along its columns."""
    if x_MK.stride(1) != 1 or dy_MN.stride(1) != 1:
        return "x_MK and dy_MN need a unit stride along their columns (K and N)"
    # dy [M, N] with a unit stride along N is laid out as a weight [1, M, N] would be
    return persistent_unsupported(x_MK, dy_MN.unsqueeze(0))


def choose_dw_variant(x_MK: Tensor, dy_MN: Tensor) -> str:
    """The rule the dW launcher uses: ``classic``, unless the environment variable FEPLB_GROUPED_MM_DW_VARIANT=
    persistent asks for the persistent variant (where it can run, under the interpreter too; elsewhere classic).

    ``auto`` (the default) is ``classic`` because the persistent variant has not been timed on a GPU yet;
    ``bench/bench_kernels.py`` times both next to ``torch._grouped_mm`` so that a GPU run can decide."""
    wanted = os.environ.get(_DW_VARIANT_ENV, "auto")
    if wanted not in ("auto", *DW_VARIANTS):
        raise ValueError(f"{_DW_VARIANT_ENV}: expected one of auto, classic, persistent, got {wanted!r}")
    if wanted != "persistent":
        return "classic"
    return "classic" if dw_persistent_unsupported(x_MK, dy_MN) else "persistent"


def _resolve_variant(variant: str | None, variants: tuple[str, ...], choose, unsupported, a: Tensor,
                     b: Tensor) -> str:
    """A launcher's ``variant`` argument: the rule's choice (``choose(a, b)``) when None, else checked, with a
    ValueError naming what is wrong (an unknown name, or operands ``unsupported(a, b)`` says the persistent
    variant cannot take)."""
    if variant is None:
        return choose(a, b)
    if variant not in variants:
        raise ValueError(f"variant: expected one of {variants} or None, got {variant!r}")
    if variant == "persistent" and (why := unsupported(a, b)):
        raise ValueError(f"variant: 'persistent' cannot run these operands: {why}")
    return variant


def _check_programs(programs: int | None, variant: str) -> None:
    """A launcher's ``programs`` argument: None, or an int >= 1 for the persistent variant (the classic one
    launches a grid of its own)."""
    if programs is None:
        return
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs: expected an int >= 1 or None, got {programs!r}")
    if variant != "persistent":
        raise ValueError(f"programs: only the persistent variant takes it, got programs={programs} with the "
                         f"{variant} variant")


def dw_programs(sms: int, meta: dict) -> int:
    """Programs the persistent dW variant launches for a config's block sizes (``meta``, as Triton hands the grid
    the kernel's arguments and the config's constants, never num_stages or num_warps): its PROGRAMS_PER_SM per SM
    (one when it names none)."""
    return sms * meta.get("PROGRAMS_PER_SM", 1)


def grouped_mm_triton(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, *, check_values: bool = True,
                      config: dict | None = None, variant: str | None = None, programs: int | None = None) -> Tensor:
    """Launcher of the grouped GEMM: y_MN[rows of group e] = x_MK[rows of group e] @ w_EKN[e].

    Args:
        x_MK: float [M, K], any strides.
        w_EKN: [E, K, N] of x's dtype, any strides (dX passes the transposed weights as a view).
        offsets_E: int32/int64 [E] end offsets, offsets_E[-1] == M.
        check_values: check the offsets' values (one device->host sync on a GPU).
        config: explicit block sizes instead of the autotuner (see ``_triton.launch``).
        variant: ``classic``, ``persistent`` or None (:func:`choose_variant`); ``persistent`` raises ValueError
            where the operands do not suit it.
        programs: persistent variant only: programs to launch (default: one per SM; 3 under the interpreter).

    Returns:
        y_MN [M, N] in x's dtype, accumulated in fp32 (fp64 for fp64).
    """
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    check_launch_device("grouped_mm_triton", x_MK)
    variant = _resolve_variant(variant, VARIANTS, choose_variant, persistent_unsupported, x_MK, w_EKN)
    _check_programs(programs, variant)
    check_config_fits(config, fwd_shared_bytes if variant == "classic" else persistent_shared_bytes, x_MK)
    if check_values:
        check_offsets_values(offsets_E, x_MK.shape[0])
    (M, K), (E, _, N) = x_MK.shape, w_EKN.shape
    y_MN = alloc((M, N), x_MK.dtype, x_MK.device)
    if M == 0 or N == 0:
        return y_MN
    if K == 0:
        return y_MN.zero_()
    common = dict(BLOCK_E=max(next_power_of_2(E), 16), **_dot_meta(x_MK))
    bucket = rows_bucket(M, E)

    if variant == "classic":
        def grid(meta):
            return ((cdiv(M, meta["BLOCK_M"]) + E) * cdiv(N, meta["BLOCK_N"]),)

        launch(_grouped_mm_kernel, grid, x_MK, w_EKN, y_MN, offsets_E, M, N, K, E, bucket,
               x_MK.stride(0), x_MK.stride(1), *w_EKN.stride(), y_MN.stride(0), y_MN.stride(1),
               **common, config=config)
        return y_MN

    if x_MK.is_cuda:
        ensure_descriptor_allocator()
    n_programs = programs or num_programs(x_MK)

    def grid(meta):
        upper = (cdiv(M, meta["BLOCK_M"]) + E) * cdiv(N, meta["BLOCK_N"])
        return (min(n_programs, upper),)

    launch(_grouped_mm_persistent_kernel, grid, x_MK, w_EKN, y_MN, offsets_E, M, N, K, E, bucket, n_programs,
           x_MK.stride(0), *w_EKN.stride(), y_MN.stride(0), y_MN.stride(1),
           W_K_CONTIGUOUS=w_EKN.stride(2) != 1, **common, config=config)
    return y_MN


def dw_split_rows(num_rows: int, num_groups: int, K: int, N: int, *, programs: int, itemsize: int) -> int:
    """Rows per dW work item (the CHUNK of ``_grouped_mm_dw_kernel``), a multiple of 256.

    Groups over 4x the mean rows per group are split (a Zipf-hot expert no longer runs alone at the end); when
    the (group, 128 x 128 tile) programs are fewer than 2 per SM (``programs`` = SMs), every group is split so
    that they fill the GPU. The partial-sum buffer (at most 2 * num_rows / CHUNK slots of K x N accumulators)
    is kept within the larger of 64 MiB and twice the size of dW.
    """
    mean = max(-(-num_rows // num_groups), 1)
    chunk = 4 * mean
    tiles = num_groups * -(-K // 128) * -(-N // 128)
    if tiles < 2 * programs:
        chunk = min(chunk, -(-mean // -(-2 * programs // tiles)))
    chunk = max(-(-chunk // 256) * 256, 256)
    budget = max(64 << 20, 2 * num_groups * K * N * itemsize)
    while chunk < num_rows and (2 * num_rows // chunk) * K * N * 8 > budget:
        chunk *= 2
    return chunk


MAX_GRID = (2**31 - 1, 65_535, 65_535)
"""CUDA's launch limits on the grid's axes 0, 1, 2."""


def dw_reduce_grid(split_groups: int, num_elements: int, block: int) -> tuple[int, int]:
    """Grid of ``_dw_reduce_kernel``: (element blocks of one expert's dW, split groups). The block count grows
    with the expert's K * N (over 65,535 blocks of 1024 past 67.1M elements), so it takes axis 0."""
    grid = (cdiv(num_elements, block), split_groups)
    if any(g > limit for g, limit in zip(grid, MAX_GRID, strict=False)):
        raise ValueError(f"dW reduce grid {grid} exceeds CUDA's limits {MAX_GRID[:2]} "
                         f"(K * N = {num_elements}, {split_groups} split groups)")
    return grid


def grouped_mm_dw_triton(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor, *, check_values: bool = True,
                         config: dict | None = None, split_rows: int | None = None, variant: str | None = None,
                         programs: int | None = None) -> Tensor:
    """Launcher of the weight gradient: dw_EKN[e] = x_MK[group e]^T @ dy_MN[group e] (zeros for empty groups).

    Args:
        x_MK: float [M, K], any strides; dy_MN: [M, N] of x's dtype, any strides;
        offsets_E: int32/int64 [E] end offsets, offsets_E[-1] == M.
        check_values: check the offsets' values (one device->host sync on a GPU).
        config: explicit block sizes instead of the autotuner (see ``_triton.launch``).
        split_rows: rows per work item; groups with more rows are split and their partial sums reduced
            (default: :func:`dw_split_rows`).
        variant: ``classic``, ``persistent`` or None (:func:`choose_dw_variant`); ``persistent`` raises
            ValueError where the operands do not suit it.
        programs: persistent variant only: programs to launch (default: :func:`dw_programs`, the config's
            PROGRAMS_PER_SM per SM; 3 under the interpreter).

    Returns:
        dw_EKN [E, K, N] in x's dtype, accumulated in fp32 (fp64 for fp64).
    """
    check_dw_inputs(x_MK, dy_MN, offsets_E)
    check_launch_device("grouped_mm_dw_triton", x_MK)
    if split_rows is not None and (isinstance(split_rows, bool) or not isinstance(split_rows, int)
                                   or split_rows < 1):
        raise ValueError(f"split_rows: expected an int >= 1 or None, got {split_rows!r}")
    variant = _resolve_variant(variant, DW_VARIANTS, choose_dw_variant, dw_persistent_unsupported, x_MK, dy_MN)
    _check_programs(programs, variant)
    check_config_fits(config, dw_shared_bytes, x_MK)
    if check_values:
        check_offsets_values(offsets_E, x_MK.shape[0])
    (M, K), N, E = x_MK.shape, dy_MN.shape[1], offsets_E.shape[0]
    dw_EKN = alloc((E, K, N), x_MK.dtype, x_MK.device)
    if K == 0 or N == 0:
        return dw_EKN
    if M == 0:
        return dw_EKN.zero_()
    chunk = split_rows or dw_split_rows(M, E, K, N, programs=num_programs(x_MK) if x_MK.is_cuda else 132,
                                        itemsize=x_MK.element_size())
    meta = _dot_meta(x_MK)
    part_dtype = torch.float64 if x_MK.dtype == torch.float64 else torch.float32
    # Split groups have more than `chunk` rows each; their chunks number at most 2 * M / chunk (see the kernel).
    split_groups = min(E, M // (chunk + 1))
    num_parts = min(2 * M // chunk, cdiv(M, chunk) + E) if split_groups else 0
    part = alloc((max(num_parts, 1), K, N) if num_parts else (1,), part_dtype, x_MK.device)
    block_e = max(next_power_of_2(E), 16)

    def upper(meta):  # work items: at most cdiv(M, chunk) + E chunks, each of K x N tiles
        return (cdiv(M, chunk) + E) * cdiv(K, meta["BLOCK_K"]) * cdiv(N, meta["BLOCK_N"])

    if variant == "classic":
        launch(_grouped_mm_dw_kernel, lambda m: (upper(m),), x_MK, dy_MN, dw_EKN, part, offsets_E, M, K, N, E,
               chunk, num_parts, rows_bucket(M, E), x_MK.stride(0), x_MK.stride(1), dy_MN.stride(0),
               dy_MN.stride(1), *dw_EKN.stride(), BLOCK_E=block_e, **meta, config=config)
    else:
        if x_MK.is_cuda:
            ensure_descriptor_allocator()
        sms = num_programs(x_MK)

        def grid(m):
            n = programs or dw_programs(sms, m)
            return (min(n, upper(m)),)

        launch(_grouped_mm_dw_persistent_kernel, grid, x_MK, dy_MN, dw_EKN, part, offsets_E, M, K, N, E, chunk,
               num_parts, rows_bucket(M, E), x_MK.stride(0), dy_MN.stride(0), *dw_EKN.stride(),
               BLOCK_E=block_e, **meta, config=config)
    if num_parts:
        block = 1024
        _dw_reduce_kernel[dw_reduce_grid(split_groups, K * N, block)](
            part, dw_EKN, offsets_E, M, K * N, E, chunk, num_parts, dw_EKN.stride(0), BLOCK_E=block_e,
            ACC=meta["ACC"], BLOCK=block, num_warps=4)
    return dw_EKN
