"""Routing metadata: per-expert row counts, end offsets and the permutation between token order and
expert-grouped order.

Legend: T tokens, K top-k, M = T*K rows, E experts.

Grouped order: rows sorted by expert; inside one expert by token index t, then by k (a stable sort of the flat
(t, k) index by expert id). The Triton path computes it with three kernels and no float atomics: a per-block
histogram, a one-program prefix sum over (block, expert), and a scatter that ranks each row inside its block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import INDEX_DTYPES, check_positive_int, check_tensor
from ._triton import alloc, check_launch_device, tl, triton

__all__ = ["RoutingMetadata", "check_routing_inputs", "routing_metadata_ref", "routing_metadata_triton"]


@dataclass(frozen=True, kw_only=True)
class RoutingMetadata:
    """Where every (token, expert) row goes. Build it with :func:`feplb.kernels.routing_metadata`.

    Attributes:
        num_experts: E.
        top_k: K.
        counts_E: int32 [E], rows per expert.
        offsets_E: int32 [E], END offsets, cumsum(counts_E) (torch._grouped_mm convention); offsets_E[-1] == M.
        src_idx_M: int32 [M], grouped row m came from the flat (t, k) index src_idx_M[m] = t*K + k.
        dst_idx_TK: int32 [T, K], the grouped row of (t, k).

    ``__post_init__`` checks dtypes and shapes only (no device sync).
    """

    num_experts: int
    top_k: int
    counts_E: Tensor
    offsets_E: Tensor
    src_idx_M: Tensor
    dst_idx_TK: Tensor

    def __post_init__(self) -> None:
        check_positive_int("num_experts", self.num_experts)
        check_positive_int("top_k", self.top_k)
        e = self.num_experts
        check_tensor("counts_E", self.counts_E, dtypes=(torch.int32,), shape=(e,))
        check_tensor("offsets_E", self.offsets_E, dtypes=(torch.int32,), shape=(e,))
        check_tensor("dst_idx_TK", self.dst_idx_TK, dtypes=(torch.int32,), shape=(None, self.top_k))
        check_tensor("src_idx_M", self.src_idx_M, dtypes=(torch.int32,), shape=(self.dst_idx_TK.numel(),))

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.dst_idx_TK.shape[0]

    @property
    def num_rows(self) -> int:
        """M = T*K."""
        return self.src_idx_M.shape[0]


def check_routing_inputs(topk_ids_TK: Tensor, num_experts: int, *, check_values: bool = True) -> None:
    """Check ids: int32/int64 [T, K], K >= 1; with ``check_values``, every id in [0, num_experts).

    The range check costs one device->host sync on a GPU (a single min/max reduction).
    """
    check_positive_int("num_experts", num_experts)
    check_tensor("topk_ids_TK", topk_ids_TK, dtypes=INDEX_DTYPES, ndim=2)
    if topk_ids_TK.shape[1] < 1:
        raise ValueError(f"topk_ids_TK: expected K >= 1 columns, got shape {list(topk_ids_TK.shape)}")
    if check_values and topk_ids_TK.numel() > 0:
        lo, hi = torch.stack(torch.aminmax(topk_ids_TK)).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids_TK: expected expert ids in [0, {num_experts}), got values in [{lo}, {hi}]")


def routing_metadata_ref(topk_ids_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pure-torch twin of :func:`routing_metadata_triton`.

    Args:
        topk_ids_TK: int32 or int64 [T, K], expert ids in [0, num_experts).
        num_experts: E.

    Returns:
        (counts_E, offsets_E, src_idx_M, dst_idx_TK), all int32, as in :class:`RoutingMetadata`.
    """
    check_routing_inputs(topk_ids_TK, num_experts)
    flat_M = topk_ids_TK.reshape(-1).long()
    counts_E = torch.bincount(flat_M, minlength=num_experts)
    # A stable sort keeps the flat (t, k) order inside each expert, which is the documented tie order.
    order_M = torch.sort(flat_M, stable=True).indices
    dst_M = torch.empty_like(order_M)
    dst_M[order_M] = torch.arange(flat_M.numel(), device=flat_M.device)
    return (counts_E.to(torch.int32), counts_E.cumsum(0).to(torch.int32), order_M.to(torch.int32),
            dst_M.to(torch.int32).reshape(topk_ids_TK.shape))


@triton.jit
def _block_histogram_kernel(ids_ptr, block_counts_ptr, M, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + rows, mask=rows < M, other=-1).to(tl.int32)
    for e0 in range(0, E, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        tl.store(block_counts_ptr + pid * E + experts, tl.sum(hits, axis=0), mask=experts < E)


@triton.jit
def _expert_offsets_kernel(block_counts_ptr, block_base_ptr, counts_ptr, offsets_ptr, num_blocks, E,
                           BLOCK_E: tl.constexpr):
    # One program: E and the number of row blocks are small, and a single pass keeps the scan deterministic.
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b in range(0, num_blocks):
        totals += tl.load(block_counts_ptr + b * E + experts, mask=valid, other=0)
    ends = tl.cumsum(totals, axis=0)
    tl.store(counts_ptr + experts, totals, mask=valid)
    tl.store(offsets_ptr + experts, ends, mask=valid)
    running = ends - totals
    for b in range(0, num_blocks):
        count = tl.load(block_counts_ptr + b * E + experts, mask=valid, other=0)
        tl.store(block_base_ptr + b * E + experts, running, mask=valid)
        running += count


@triton.jit
def _scatter_kernel(ids_ptr, block_base_ptr, src_ptr, dst_ptr, M, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = rows < M
    ids = tl.load(ids_ptr + rows, mask=in_range, other=-1).to(tl.int32)
    dst = tl.zeros([BLOCK_M], dtype=tl.int32)
    for e0 in range(0, E, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        # Inclusive scan down the block: a row's rank among the block's earlier rows of the same expert.
        rank = tl.cumsum(hits, axis=0) - 1
        base = tl.load(block_base_ptr + pid * E + experts, mask=experts < E, other=0)
        dst += tl.sum(tl.where(hits != 0, base[None, :] + rank, 0), axis=1)
    tl.store(dst_ptr + rows, dst, mask=in_range)
    tl.store(src_ptr + dst, rows, mask=in_range)


def routing_metadata_triton(
    topk_ids_TK: Tensor, num_experts: int, *, block_m: int | None = None, block_e: int | None = None,
    check_values: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launcher: validate, allocate, launch the three routing kernels.

    Args:
        topk_ids_TK: int32 or int64 [T, K], contiguous, expert ids in [0, num_experts).
        num_experts: E.
        block_m: rows per program (power of two >= 16); default 256 on a GPU, 1024 under the interpreter.
        block_e: experts per inner step (power of two >= 16); default min(next_pow2(E), 64) on a GPU.
        check_values: check the id range (one device->host sync).

    Returns:
        (counts_E, offsets_E, src_idx_M, dst_idx_TK), all int32, as in :class:`RoutingMetadata`.
    """
    check_routing_inputs(topk_ids_TK, num_experts, check_values=check_values)
    check_tensor("topk_ids_TK", topk_ids_TK, contiguous=True)
    check_launch_device("routing_metadata_triton", topk_ids_TK)
    if block_m is None:
        block_m = 256 if topk_ids_TK.is_cuda else 1024
    for name, value in (("block_m", block_m), ("block_e", block_e)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name}: expected a power of two >= 16, got {value}")
    T, K = topk_ids_TK.shape
    M, E = T * K, num_experts
    dev = topk_ids_TK.device
    counts_E = alloc((E,), torch.int32, dev)
    offsets_E = alloc((E,), torch.int32, dev)
    src_idx_M = alloc((M,), torch.int32, dev)
    dst_idx_TK = alloc((T, K), torch.int32, dev)
    num_blocks = triton.cdiv(M, block_m)
    block_e_all = max(triton.next_power_of_2(E), 16)
    if block_e is None:
        block_e = min(block_e_all, 64 if topk_ids_TK.is_cuda else 1024)
    block_counts = alloc((max(num_blocks, 1), E), torch.int32, dev)
    block_base = alloc((max(num_blocks, 1), E), torch.int32, dev)
    if num_blocks > 0:
        _block_histogram_kernel[(num_blocks,)](topk_ids_TK, block_counts, M, E, BLOCK_M=block_m, BLOCK_E=block_e)
    _expert_offsets_kernel[(1,)](block_counts, block_base, counts_E, offsets_E, num_blocks, E, BLOCK_E=block_e_all)
    if num_blocks > 0:
        _scatter_kernel[(num_blocks,)](topk_ids_TK, block_base, src_idx_M, dst_idx_TK, M, E,
                                       BLOCK_M=block_m, BLOCK_E=block_e)
    return counts_E, offsets_E, src_idx_M, dst_idx_TK
