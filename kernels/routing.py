"""Routing metadata: per-expert row counts, end offsets and the permutation between token order and
expert-grouped order.

Legend: T tokens, K top-k, M = T*K rows, E experts.

Grouped order: rows sorted by expert; inside one expert by token index t, then by k (a stable sort of the flat
(t, k) index by expert id). The Triton path computes it without atomics in three steps: a per-block histogram
into an expert-major table counts_EB[e, b], one flat exclusive cumsum of that table (which is exactly the first
grouped row of every (expert, block) pair, so counts, end offsets and block bases all come from it), and a
scatter that ranks each row inside its block. No step walks the row blocks serially.

Sizes are bounded where the kernels' 32-bit indices or their O(M * E) expert comparison would break: at most
``MAX_EXPERTS`` experts and ``MAX_ROWS`` (2**31 - 2**16) rows, each a ``ValueError`` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._checks import INDEX_DTYPES, check_num_experts, check_positive_int, check_rows, check_tensor
from ._triton import alloc, cdiv, check_launch_device, next_power_of_2, tl, triton

__all__ = ["RoutingMetadata", "check_routing_inputs", "routing_metadata_ref", "routing_metadata_triton"]


@dataclass(frozen=True, kw_only=True, eq=False)   # compared by identity: its tensors have no truth value
class RoutingMetadata:
    """Where every (token, expert) row goes. Build it with :func:`feplb.kernels.routing_metadata`.

    Attributes:
        num_experts: E.
        top_k: K.
        counts_E: int32 [E], rows per expert.
        offsets_E: int32 [E], END offsets, cumsum(counts_E) (torch._grouped_mm convention); offsets_E[-1] == M.
        src_idx_M: int32 [M], grouped row m came from the flat (t, k) index src_idx_M[m] = t*K + k.
        dst_idx_TK: int32 [T, K], the grouped row of (t, k).
        checked: True when the index values are known to be consistent: set by :func:`routing_metadata` alone (not
            an argument; ``dataclasses.replace`` of such metadata, whose indices may then differ, is unchecked);
            :func:`feplb.kernels.permute` and :func:`feplb.kernels.unpermute` call :meth:`validate` on metadata
            with ``checked=False`` (a hand-built or edited one) before any kernel reads its indices, and, in eager
            mode, on checked metadata whose index tensors were since changed in place (their version counters
            moved; not tracked for metadata built under ``torch.compile`` or of inference tensors, nor for writes
            through ``.data``, which torch does not count: call :meth:`validate` after such an edit).

    ``__post_init__`` checks types, dtypes, shapes, devices and sizes only (no device sync).
    """

    num_experts: int
    top_k: int
    counts_E: Tensor
    offsets_E: Tensor
    src_idx_M: Tensor
    dst_idx_TK: Tensor
    checked: bool = field(default=False, init=False)
    # the index tensors' version counters when checked (None: not tracked)
    _versions: tuple[int, ...] | None = field(default=None, init=False, repr=False)

    @classmethod
    def _consistent(cls, **fields) -> RoutingMetadata:
        """Metadata whose index values are consistent by construction (``routing_metadata``'s): ``checked``."""
        meta = cls(**fields)
        object.__setattr__(meta, "checked", True)
        object.__setattr__(meta, "_versions", meta._index_versions())
        return meta

    def _index_versions(self) -> tuple[int, ...] | None:
        """The index tensors' version counters, or None where they cannot be read (while torch.compile traces;
        inference tensors have none)."""
        tensors = (self.counts_E, self.offsets_E, self.src_idx_M, self.dst_idx_TK)
        if torch.compiler.is_compiling() or any(t.is_inference() for t in tensors):
            return None
        return tuple(t._version for t in tensors)

    def changed_in_place(self) -> bool:
        """Whether an index tensor of checked metadata was changed in place since it was checked (False where that
        is not tracked)."""
        return self._versions is not None and self._index_versions() not in (None, self._versions)

    def _validate_unless_checked(self) -> None:
        """:meth:`validate` unless checked and unchanged since; checked metadata changed in place and found
        consistent is checked again as it is now."""
        if self.checked and not self.changed_in_place():
            return
        self.validate()
        if self.checked:
            object.__setattr__(self, "_versions", self._index_versions())

    def __post_init__(self) -> None:
        check_num_experts("num_experts", self.num_experts)
        check_positive_int("top_k", self.top_k)
        e = self.num_experts
        check_tensor("counts_E", self.counts_E, dtypes=(torch.int32,), shape=(e,))
        check_tensor("offsets_E", self.offsets_E, dtypes=(torch.int32,), shape=(e,))
        check_tensor("dst_idx_TK", self.dst_idx_TK, dtypes=(torch.int32,), shape=(None, self.top_k))
        check_tensor("src_idx_M", self.src_idx_M, dtypes=(torch.int32,), shape=(self.dst_idx_TK.numel(),))
        t, k = self.dst_idx_TK.shape
        check_rows("dst_idx_TK", self.dst_idx_TK.numel(), "M = T*K", t, k)
        devices = {name: getattr(self, name).device for name in ("counts_E", "offsets_E", "src_idx_M", "dst_idx_TK")}
        if len(set(devices.values())) > 1:
            raise ValueError(f"RoutingMetadata: expected all tensors on one device, got {devices}")

    def validate(self) -> None:
        """Check the index values (one device->host sync on a GPU): src_idx_M and dst_idx_TK in [0, M) and inverse
        permutations of each other, counts_E >= 0 summing to M, offsets_E == cumsum(counts_E).

        Raises:
            ValueError naming the first inconsistent field, what was expected and what was given.
        """
        M = self.num_rows
        counts = self.counts_E.long()
        bad_offsets = (self.offsets_E.long() != counts.cumsum(0)).sum()
        stats = torch.stack([*_permutation_stats(self.src_idx_M, self.dst_idx_TK), counts.min(), counts.sum(),
                             bad_offsets]).tolist()
        _raise_permutation(M, *stats[:5])
        counts_min, counts_sum, bad_offsets = stats[5:]
        if counts_min < 0 or counts_sum != M:
            raise ValueError(f"counts_E: expected non-negative counts summing to M = {M}, got min {counts_min}, "
                             f"sum {counts_sum}")
        if bad_offsets:
            raise ValueError(f"offsets_E: expected the end offsets cumsum(counts_E), got {bad_offsets} of "
                             f"{self.num_experts} that differ")

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

    The range check costs one device->host sync on a GPU (a single min/max reduction). Sizes are bounded
    (no sync): num_experts <= MAX_EXPERTS, M = T*K <= MAX_ROWS.
    """
    check_num_experts("num_experts", num_experts)
    check_tensor("topk_ids_TK", topk_ids_TK, dtypes=INDEX_DTYPES, ndim=2)
    if topk_ids_TK.shape[1] < 1:
        raise ValueError(f"topk_ids_TK: expected K >= 1 columns, got shape {list(topk_ids_TK.shape)}")
    t, k = topk_ids_TK.shape
    check_rows("topk_ids_TK", t * k, "M = T*K", t, k)
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
def _block_histogram_kernel(ids_ptr, counts_EB_ptr, M, E, num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    # counts_EB[e, b]: rows of expert e in row block b, stored expert-major so that one flat cumsum of the table
    # yields every (expert, block) base in grouped order.
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + rows, mask=rows < M, other=-1).to(tl.int32)
    for e0 in range(0, E, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        tl.store(counts_EB_ptr + experts.to(tl.int64) * num_blocks + pid, tl.sum(hits, axis=0), mask=experts < E)


@triton.jit
def _scatter_kernel(ids_ptr, base_EB_ptr, src_ptr, dst_ptr, M, E, num_blocks, BLOCK_M: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = rows < M
    ids = tl.load(ids_ptr + rows, mask=in_range, other=-1).to(tl.int32)
    dst = tl.zeros([BLOCK_M], dtype=tl.int32)
    for e0 in range(0, E, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        # Inclusive scan down the block: a row's rank among the block's earlier rows of the same expert.
        rank = tl.cumsum(hits, axis=0) - 1
        base = tl.load(base_EB_ptr + experts.to(tl.int64) * num_blocks + pid, mask=experts < E, other=0)
        dst += tl.sum(tl.where(hits != 0, base[None, :] + rank, 0), axis=1)
    tl.store(dst_ptr + rows, dst, mask=in_range)
    tl.store(src_ptr + dst, rows.to(tl.int32), mask=in_range)


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
    src_idx_M = alloc((M,), torch.int32, dev)
    dst_idx_TK = alloc((T, K), torch.int32, dev)
    num_blocks = cdiv(M, block_m)
    if block_e is None:
        block_e = min(max(next_power_of_2(E), 16), 64 if topk_ids_TK.is_cuda else 1024)
    if num_blocks == 0:
        zeros_E = torch.zeros(E, dtype=torch.int32, device=dev)
        return zeros_E, zeros_E.clone(), src_idx_M, dst_idx_TK
    counts_EB = alloc((E, num_blocks), torch.int32, dev)
    _block_histogram_kernel[(num_blocks,)](topk_ids_TK, counts_EB, M, E, num_blocks, BLOCK_M=block_m,
                                           BLOCK_E=block_e)
    # Expert-major flat order is grouped order: the inclusive cumsum ends expert e's last block at its end offset,
    # and minus the block's own count it is the block's first grouped row. Values stay below M < 2**31.
    ends_EB = counts_EB.reshape(-1).cumsum(0, dtype=torch.int32).reshape(E, num_blocks)
    base_EB = ends_EB - counts_EB
    offsets_E = ends_EB[:, -1].contiguous()
    counts_E = counts_EB.sum(1, dtype=torch.int32)
    _scatter_kernel[(num_blocks,)](topk_ids_TK, base_EB, src_idx_M, dst_idx_TK, M, E, num_blocks,
                                   BLOCK_M=block_m, BLOCK_E=block_e)
    return counts_E, offsets_E, src_idx_M, dst_idx_TK


def _permutation_stats(src_idx_M: torch.Tensor, dst_idx_TK: torch.Tensor) -> list[torch.Tensor]:
    """0-d tensors (no sync): the ranges of src_idx_M and dst_idx_TK, and how many rows break the inverse
    relation src_idx_M[dst_idx_TK[t, k]] == t*K + k (checked on clamped indices, so an out-of-range value cannot
    fault here)."""
    M = src_idx_M.numel()
    src = src_idx_M.long()
    dst = dst_idx_TK.reshape(-1).long()
    zero = torch.zeros((), dtype=torch.long, device=src.device)
    src_lo, src_hi = (torch.aminmax(src) if M else (zero, zero))
    dst_lo, dst_hi = (torch.aminmax(dst) if M and dst.numel() else (zero, zero))
    roundtrip = src[dst.clamp(0, max(M - 1, 0))] if M else src
    mismatches = (roundtrip != torch.arange(roundtrip.numel(), device=src.device)).sum() if M else zero
    return [src_lo, src_hi, dst_lo, dst_hi, mismatches]


def _raise_permutation(M: int, src_lo: int, src_hi: int, dst_lo: int, dst_hi: int, mismatches: int) -> None:
    if M and (src_lo < 0 or src_hi >= M):
        raise ValueError(f"src_idx_M: expected indices in [0, {M}) (M = T*K rows), got values in "
                         f"[{src_lo}, {src_hi}]")
    if M and (dst_lo < 0 or dst_hi >= M):
        raise ValueError(f"dst_idx_TK: expected indices in [0, {M}) (M = T*K rows), got values in "
                         f"[{dst_lo}, {dst_hi}]")
    if mismatches:
        raise ValueError(f"dst_idx_TK: expected the inverse permutation of src_idx_M "
                         f"(src_idx_M[dst_idx_TK[t, k]] == t*K + k), got {mismatches} of {M} rows that differ")


def check_permutation_values(src_idx_M: torch.Tensor, dst_idx_TK: torch.Tensor) -> None:
    """src_idx_M and dst_idx_TK hold indices in [0, M) that are inverse permutations of each other (one
    device->host sync on a GPU): what the permute and unpermute kernels index rows with.

    Raises:
        ValueError naming the first inconsistent tensor, what was expected and what was given.
    """
    _raise_permutation(src_idx_M.numel(), *torch.stack(_permutation_stats(src_idx_M, dst_idx_TK)).tolist())
