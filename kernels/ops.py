"""The public ops of feplb.kernels, as ``torch.library`` custom ops (namespace ``feplb``).

Legend: T tokens, K top-k, M = T*K grouped rows, D hidden, E experts, F ffn, N output features.

Each op dispatches by device: CUDA tensors run the Triton kernels, CPU tensors the pure-torch twins (inside
:func:`feplb.kernels.triton_on_cpu`, CPU tensors run the kernels through Triton's interpreter). Fake impls give
shapes to torch.compile; autograd is registered, so an expert block built from these ops trains and compiles.
Value checks that need the data (expert-id range, offsets) run inside the real impls, each as one device->host
sync on a GPU; ``check=False`` skips them where the caller built the inputs itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, MAX_EXPERTS, check_rows, check_tensor
from ._triton import use_triton
from .activation import check_swiglu_input, swiglu_bwd_ref, swiglu_bwd_triton, swiglu_ref, swiglu_triton
from .grouped_gemm import (
    check_grouped_mm_inputs,
    grouped_mm_dw_ref,
    grouped_mm_dw_triton,
    grouped_mm_ref,
    grouped_mm_triton,
)
from .permutation import (
    check_permute_inputs,
    check_unpermute_inputs,
    permute_ref,
    permute_triton,
    unpermute_bwd_ref,
    unpermute_bwd_triton,
    unpermute_ref,
    unpermute_triton,
)
from .routing import RoutingMetadata, check_routing_inputs, routing_metadata_ref, routing_metadata_triton

__all__ = ["grouped_mm", "permute", "routing_metadata", "swiglu", "unpermute"]


# ---------------------------------------------------------------------------------------------------- routing

@torch.library.custom_op("feplb::routing_metadata", mutates_args=())
def _routing_metadata_op(topk_ids_TK: Tensor, num_experts: int, check: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if use_triton(topk_ids_TK):
        return routing_metadata_triton(topk_ids_TK, num_experts, check_values=check)
    return routing_metadata_ref(topk_ids_TK, num_experts)


@_routing_metadata_op.register_fake
def _(topk_ids_TK, num_experts, check):
    check_routing_inputs(topk_ids_TK, num_experts, check_values=False)
    T, K = topk_ids_TK.shape
    new = topk_ids_TK.new_empty
    return (new(num_experts, dtype=torch.int32), new(num_experts, dtype=torch.int32),
            new(T * K, dtype=torch.int32), new(T, K, dtype=torch.int32))


def routing_metadata(topk_ids_TK: Tensor, num_experts: int, *, check: bool = True) -> RoutingMetadata:
    """Counts, end offsets and permutation of the (token, expert) rows, grouped by expert.

    Inside one expert, rows are ordered by token index t, then by k (deterministic).

    Args:
        topk_ids_TK: int32 or int64 [T, K], expert ids in [0, num_experts); T may be 0.
        num_experts: E.
        check: check the id range; costs one device->host sync (a min/max reduction) on a GPU.

    Returns:
        :class:`RoutingMetadata` (all tensors int32, on the ids' device).
    """
    check_routing_inputs(topk_ids_TK, num_experts, check_values=False)
    counts_E, offsets_E, src_idx_M, dst_idx_TK = _routing_metadata_op(topk_ids_TK.contiguous(), num_experts, check)
    return RoutingMetadata(num_experts=num_experts, top_k=topk_ids_TK.shape[1], counts_E=counts_E,
                           offsets_E=offsets_E, src_idx_M=src_idx_M, dst_idx_TK=dst_idx_TK, checked=True)


# ---------------------------------------------------------------------------------------------------- permute

@torch.library.custom_op("feplb::permute", mutates_args=())
def _permute_op(x_TD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor) -> Tensor:
    if use_triton(x_TD):
        return permute_triton(x_TD, src_idx_M, dst_idx_TK)
    return permute_ref(x_TD, src_idx_M, dst_idx_TK)


@_permute_op.register_fake
def _(x_TD, src_idx_M, dst_idx_TK):
    check_permute_inputs(x_TD, src_idx_M, dst_idx_TK)
    return x_TD.new_empty(src_idx_M.shape[0], x_TD.shape[1])


def _permute_setup(ctx, inputs, output):
    _, src_idx_M, dst_idx_TK = inputs
    ctx.save_for_backward(src_idx_M, dst_idx_TK)


def _permute_backward(ctx, grad_MD):
    src_idx_M, dst_idx_TK = ctx.saved_tensors
    # Each token's gradient is the sum of its K grouped rows: an unweighted unpermute (a gather, no atomics).
    return _unpermute_op(grad_MD.contiguous(), src_idx_M, dst_idx_TK, None), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


def permute(x_TD: Tensor, meta: RoutingMetadata) -> Tensor:
    """Token rows into expert-grouped order: x_MD[m] = x_TD[meta.src_idx_M[m] // K].

    Args:
        x_TD: float (fp32/bf16/fp16/fp64) [T, D], contiguous.
        meta: the :class:`RoutingMetadata` of this batch; a hand-built one (``checked=False``) has its index
            values validated first (one device->host sync on a GPU).

    Returns:
        x_MD [M, D] in x's dtype; differentiable w.r.t. x.
    """
    _check_meta(meta)
    return _permute_op(x_TD, meta.src_idx_M, meta.dst_idx_TK)


# ---------------------------------------------------------------------------------------------------- unpermute

@torch.library.custom_op("feplb::unpermute", mutates_args=())
def _unpermute_op(y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, topk_weights_TK: Tensor | None) -> Tensor:
    if use_triton(y_MD):
        return unpermute_triton(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    return unpermute_ref(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)


@_unpermute_op.register_fake
def _(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK):
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    return y_MD.new_empty(dst_idx_TK.shape[0], y_MD.shape[1])


@torch.library.custom_op("feplb::unpermute_bwd", mutates_args=())
def _unpermute_bwd_op(grad_TD: Tensor, y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, topk_weights_TK: Tensor,
                      need_dw: bool) -> tuple[Tensor, Tensor]:
    if use_triton(y_MD):
        return unpermute_bwd_triton(grad_TD, y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, need_dw)
    return unpermute_bwd_ref(grad_TD, y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, need_dw)


@_unpermute_bwd_op.register_fake
def _(grad_TD, y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, need_dw):
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    dw = topk_weights_TK.new_empty(dst_idx_TK.shape) if need_dw else topk_weights_TK.new_empty(0)
    return torch.empty_like(y_MD), dw


def _unpermute_setup(ctx, inputs, output):
    y_MD, src_idx_M, dst_idx_TK, topk_weights_TK = inputs
    ctx.has_weights = topk_weights_TK is not None
    ctx.need_dw = ctx.has_weights and ctx.needs_input_grad[3]
    # y is needed only for the weights' gradient.
    ctx.save_for_backward(y_MD if ctx.need_dw else None, src_idx_M, dst_idx_TK, topk_weights_TK)


def _unpermute_backward(ctx, grad_TD):
    y_MD, src_idx_M, dst_idx_TK, topk_weights_TK = ctx.saved_tensors
    grad_TD = grad_TD.contiguous()
    if not ctx.has_weights:
        return _permute_op(grad_TD, src_idx_M, dst_idx_TK), None, None, None
    y_for_dw = y_MD if ctx.need_dw else grad_TD.new_empty(src_idx_M.shape[0], grad_TD.shape[1])
    dy_MD, dw_TK = _unpermute_bwd_op(grad_TD, y_for_dw, src_idx_M, dst_idx_TK, topk_weights_TK, ctx.need_dw)
    return dy_MD, None, None, dw_TK if ctx.need_dw else None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def unpermute(y_MD: Tensor, meta: RoutingMetadata, topk_weights_TK: Tensor) -> Tensor:
    """Back to token order, with the gate-weighted sum over k.

    out_TD[t] = sum_k topk_weights_TK[t, k] * y_MD[meta.dst_idx_TK[t, k]], accumulated in fp32 in the order
    k = 0..K-1 (deterministic), returned in y's dtype.

    Args:
        y_MD: float [M, D], contiguous, in grouped order.
        meta: the :class:`RoutingMetadata` of this batch; a hand-built one (``checked=False``) has its index
            values validated first (one device->host sync on a GPU).
        topk_weights_TK: float [T, K], contiguous (any float dtype; its gradient comes back in that dtype).

    Returns:
        out_TD [T, D] in y's dtype; differentiable w.r.t. y_MD and topk_weights_TK (the router gradient).
    """
    _check_meta(meta)
    check_tensor("topk_weights_TK", topk_weights_TK, dtypes=FLOAT_DTYPES)
    return _unpermute_op(y_MD, meta.src_idx_M, meta.dst_idx_TK, topk_weights_TK)


def _check_meta(meta: object) -> None:
    if not isinstance(meta, RoutingMetadata):
        raise TypeError(f"meta: expected a RoutingMetadata (from routing_metadata()), got {type(meta).__name__}")
    if not meta.checked:
        # Kernels index rows with these values: an out-of-range one would read or write out of bounds.
        meta.validate()


# ---------------------------------------------------------------------------------------------------- grouped_mm

@torch.library.custom_op("feplb::grouped_mm", mutates_args=())
def _grouped_mm_op(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, check: bool) -> Tensor:
    if use_triton(x_MK):
        return grouped_mm_triton(x_MK, w_EKN, offsets_E, check_values=check)
    return grouped_mm_ref(x_MK, w_EKN, offsets_E)  # checks the offsets always: cheap on the host


@_grouped_mm_op.register_fake
def _(x_MK, w_EKN, offsets_E, check):
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])


@torch.library.custom_op("feplb::grouped_mm_dw", mutates_args=())
def _grouped_mm_dw_op(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor) -> Tensor:
    if use_triton(x_MK):
        return grouped_mm_dw_triton(x_MK, dy_MN, offsets_E, check_values=False)
    return grouped_mm_dw_ref(x_MK, dy_MN, offsets_E)


@_grouped_mm_dw_op.register_fake
def _(x_MK, dy_MN, offsets_E):
    return x_MK.new_empty(offsets_E.shape[0], x_MK.shape[1], dy_MN.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x_MK, w_EKN, offsets_E, _ = inputs
    ctx.save_for_backward(x_MK if ctx.needs_input_grad[1] else None, w_EKN if ctx.needs_input_grad[0] else None,
                          offsets_E)


def _grouped_mm_backward(ctx, grad_MN):
    x_MK, w_EKN, offsets_E = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        # The forward already checked the offsets; the transposed weights are a strided view, not a copy.
        dx = _grouped_mm_op(grad_MN, w_EKN.transpose(1, 2), offsets_E, False)
    if ctx.needs_input_grad[1]:
        dw = _grouped_mm_dw_op(x_MK, grad_MN, offsets_E)
    return dx, dw, None, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, *, check: bool = True) -> Tensor:
    """Grouped GEMM: rows of group e times w[e].

    y_MN[offsets_E[e-1]:offsets_E[e]] = x_MK[offsets_E[e-1]:offsets_E[e]] @ w_EKN[e], fp32 accumulation.

    Args:
        x_MK: float (fp32/bf16/fp16/fp64) [M, K].
        w_EKN: [E, K, N] of x's dtype.
        offsets_E: int32 or int64 [E] END offsets (torch._grouped_mm convention), non-decreasing,
            offsets_E[-1] == M; empty groups allowed.
        check: check the offsets' values; costs one device->host sync on a GPU.

    Returns:
        y_MN [M, N] in x's dtype; differentiable w.r.t. x and w (dX and dW are grouped kernels too).
    """
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    check_rows("x_MK", x_MK.shape[0], "M")
    if w_EKN.shape[0] > MAX_EXPERTS:
        raise ValueError(f"w_EKN: expected at most {MAX_EXPERTS} groups (experts), got shape {list(w_EKN.shape)}")
    return _grouped_mm_op(x_MK, w_EKN, offsets_E, check)


# ---------------------------------------------------------------------------------------------------- swiglu

@torch.library.custom_op("feplb::swiglu", mutates_args=())
def _swiglu_op(h_M2F: Tensor) -> Tensor:
    if use_triton(h_M2F):
        return swiglu_triton(h_M2F)
    return swiglu_ref(h_M2F)


@_swiglu_op.register_fake
def _(h_M2F):
    check_swiglu_input(h_M2F)
    return h_M2F.new_empty(h_M2F.shape[0], h_M2F.shape[1] // 2)


@torch.library.custom_op("feplb::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(grad_MF: Tensor, h_M2F: Tensor) -> Tensor:
    if use_triton(h_M2F):
        return swiglu_bwd_triton(grad_MF, h_M2F)
    return swiglu_bwd_ref(grad_MF, h_M2F)


@_swiglu_bwd_op.register_fake
def _(grad_MF, h_M2F):
    return torch.empty_like(h_M2F)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx, grad_MF):
    (h_M2F,) = ctx.saved_tensors
    return _swiglu_bwd_op(grad_MF.contiguous(), h_M2F)


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def swiglu(h_M2F: Tensor) -> Tensor:
    """SwiGLU: out_MF = silu(h[:, :F]) * h[:, F:], computed in fp32.

    Args:
        h_M2F: float [M, 2F], contiguous (gate columns first, then up).

    Returns:
        out_MF [M, F] in h's dtype; differentiable.
    """
    check_swiglu_input(h_M2F)
    check_rows("h_M2F", h_M2F.shape[0], "M")
    return _swiglu_op(h_M2F)
