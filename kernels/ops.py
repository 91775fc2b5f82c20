"""The public ops of feplb.kernels: operators of the ``feplb`` namespace, differentiable.

Legend: T tokens, K top-k, M = T*K grouped rows, D hidden, E experts, F ffn, N output features.

Each operator dispatches by device: CUDA tensors run the Triton kernels, CPU tensors the pure-torch twins (inside
:func:`feplb.kernels.triton_on_cpu`, CPU tensors run the kernels through Triton's interpreter). The operators are
declared with ``torch.library`` (schema, one implementation for every device, a fake implementation that gives
torch.compile their shapes, and registered autograd, so ``torch.ops.feplb.*`` differentiates wherever it is
called). The public functions apply a ``torch.autograd.Function`` per op that records the same backward and calls
the operator past its autograd kernel: that costs the least host time per call in eager mode, where the operator's
Python autograd kernel (like a ``torch.library.custom_op`` with registered autograd) hops between Python and the
dispatcher on every call (``bench/bench_ops_host.py`` measures both side by side). First derivatives only. Value
checks that need the data (expert-id range, offsets, and the index values of permute / unpermute, which the
public functions check once per metadata) run inside the real implementations, each as one device->host sync on a
GPU; ``check=False`` skips them where the caller built or checked the inputs itself (the public functions and the
backward passes do).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, MAX_EXPERTS, check_bool, check_rows, check_tensor
from ._triton import use_triton
from .activation import (
    check_glu_act,
    check_glu_input,
    check_glu_limit,
    check_mlp_act,
    glu_bwd_ref,
    glu_bwd_triton,
    glu_ref,
    glu_triton,
    mlp_act_bwd_ref,
    mlp_act_bwd_triton,
    mlp_act_ref,
    mlp_act_triton,
)
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
from .routing import (
    RoutingMetadata,
    check_permutation_values,
    check_routing_inputs,
    routing_metadata_ref,
    routing_metadata_triton,
)

__all__ = ["autocast_dtype", "autocast_matmul_inputs", "glu", "grouped_mm", "mlp_act", "permute", "routing_metadata",
           "swiglu", "unpermute"]

_LIB = torch.library.Library("feplb", "DEF")


def _operator(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Declare ``feplb::<schema>`` with one implementation for every device (``impl`` dispatches by device itself)
    and its fake implementation; returns the operator."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"feplb::{name}", fake, lib=_LIB)
    return getattr(torch.ops.feplb, name).default


def _below_autograd(op: torch._ops.OpOverload, *args):
    """Call an operator past its autograd kernel (the caller records the graph: an autograd Function, or the
    operator's own autograd kernel). Under torch.compile the plain call, which the compiler traces."""
    if torch.compiler.is_compiling():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _apply(function: type[torch.autograd.Function], op: torch._ops.OpOverload, *args):
    """A public op's call: its autograd Function in eager mode (the fast path), the operator itself, with its
    registered autograd, when torch.compile or torch.export traces it (strict export would otherwise run the
    Function's forward without grad and drop the gradients)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return function.apply(*args)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` gives matmul-class ops on ``device_type`` now, or None when it is off there.
    (CPU and CUDA, the ops' devices, always have autocast: asking is skipped for them, as torch 2.10's
    torch.compile cannot trace ``torch.amp.is_autocast_available``.)"""
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_matmul_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``torch.autocast``'s rule for matmul-class ops (torch.matmul, F.linear; torch._grouped_mm is not on its list):
    where autocast is on for the tensors' device, every floating tensor except float64 is cast to the autocast dtype
    (a differentiable cast, so each gradient comes back in its tensor's own dtype); otherwise the tensors as
    given."""
    dtype = autocast_dtype(tensors[0].device.type)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t
                 for t in tensors)


def _register_autocast(op: torch._ops.OpOverload, cast: Callable) -> None:
    """Give a direct call of ``op`` inside ``torch.autocast`` the public function's casts (``cast(*args)`` -> the
    args to run with), on the device types feplb runs on: the kernel casts, then calls the operator again with
    autocast's key excluded (autograd, dispatched after autocast, records the casts)."""
    name = op.name().split("::")[1]
    for device_type in ("cpu", "cuda"):
        key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

        def kernel(*args, _key=key):
            args = cast(*args)   # before the guard: excluding the key is what turns autocast off
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*args)

        # The Python dispatcher's kernel (tracing) and the C++ dispatcher's (eager), as torch.library does.
        op.py_impl(key)(kernel)
        _LIB.impl(name, kernel, key.name)


def _differentiable(op: torch._ops.OpOverload, setup: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """Give an operator its autograd (``setup(ctx, inputs, output)``, ``backward(ctx, grad)``) twice over: registered
    on the operator, so ``torch.ops.feplb.<op>`` differentiates wherever it is called (an exported graph, say),
    and as the returned ``torch.autograd.Function``, which the public op applies: it records the same graph node
    without the operator's Python autograd kernel and its dispatcher round trips on every call (10 to 20 us of
    host time per call on the 2-core CPU, ``bench/bench_ops_host.py``). First derivatives only: a backward that
    would record a graph (``create_graph=True``) raises."""
    name = op.name()

    def first_order(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(f"{name}: feplb's ops have first derivatives only; a backward with create_graph=True "
                               "(a second derivative) through them is not supported")
        return backward(ctx, *grads)

    torch.library.register_autograd(name, first_order, setup_context=setup, lib=_LIB)

    def forward(ctx, *args):
        setup(ctx, args, None)
        return _below_autograd(op, *args)

    return type(f"_{name.split('::')[1]}_function", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(first_order)})


# ---------------------------------------------------------------------------------------------------- routing

def _routing_metadata_impl(topk_ids_TK: Tensor, num_experts: int, check: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if use_triton(topk_ids_TK):
        return routing_metadata_triton(topk_ids_TK, num_experts, check_values=check)
    return routing_metadata_ref(topk_ids_TK, num_experts)


def _routing_metadata_fake(topk_ids_TK, num_experts, check):
    check_routing_inputs(topk_ids_TK, num_experts, check_values=False)
    T, K = topk_ids_TK.shape
    new = topk_ids_TK.new_empty
    return (new(num_experts, dtype=torch.int32), new(num_experts, dtype=torch.int32),
            new(T * K, dtype=torch.int32), new(T, K, dtype=torch.int32))


_ROUTING_METADATA = _operator(
    "routing_metadata(Tensor topk_ids_TK, int num_experts, bool check) -> (Tensor, Tensor, Tensor, Tensor)",
    _routing_metadata_impl, _routing_metadata_fake)


def routing_metadata(topk_ids_TK: Tensor, num_experts: int, *, check: bool = True) -> RoutingMetadata:
    """Counts, end offsets and permutation of the (token, expert) rows, grouped by expert.

    Inside one expert, rows are ordered by token index t, then by k (deterministic).

    Args:
        topk_ids_TK: int32 or int64 [T, K], expert ids in [0, num_experts); T may be 0.
        num_experts: E.
        check: check the id range; costs one device->host sync (a min/max reduction) on a GPU. ``check=False``
            is the caller's guarantee that every id is in range (the MoE layer clamps its ids and flags bad ones
            itself): with an id outside it, the Triton path's metadata is undefined (unwritten rows, offsets short
            of M) and a ``permute`` / ``unpermute`` with it reads out of bounds. The CPU twin checks regardless.

    Returns:
        :class:`RoutingMetadata` (all tensors int32, on the ids' device).
    """
    check_routing_inputs(topk_ids_TK, num_experts, check_values=False)
    check_bool("check", check)
    counts_E, offsets_E, src_idx_M, dst_idx_TK = _ROUTING_METADATA(topk_ids_TK.contiguous(), num_experts, check)
    return RoutingMetadata._consistent(num_experts=num_experts, top_k=topk_ids_TK.shape[1], counts_E=counts_E,
                                       offsets_E=offsets_E, src_idx_M=src_idx_M, dst_idx_TK=dst_idx_TK)


# ---------------------------------------------------------------------------------------------------- permute

def _permute_impl(x_TD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, check: bool = True) -> Tensor:
    if check:
        check_permute_inputs(x_TD, src_idx_M, dst_idx_TK)
        check_permutation_values(src_idx_M, dst_idx_TK)
    if use_triton(x_TD):
        return permute_triton(x_TD, src_idx_M, dst_idx_TK)
    return permute_ref(x_TD, src_idx_M, dst_idx_TK)


def _permute_fake(x_TD, src_idx_M, dst_idx_TK, check=True):
    check_permute_inputs(x_TD, src_idx_M, dst_idx_TK)
    return x_TD.new_empty(src_idx_M.shape[0], x_TD.shape[1])


_PERMUTE = _operator("permute(Tensor x_TD, Tensor src_idx_M, Tensor dst_idx_TK, bool check=True) -> Tensor",
                     _permute_impl, _permute_fake)


def _permute_setup(ctx, inputs, output):
    _, src_idx_M, dst_idx_TK, _ = inputs
    ctx.save_for_backward(src_idx_M, dst_idx_TK)


def _permute_backward(ctx, grad_MD: Tensor):
    src_idx_M, dst_idx_TK = ctx.saved_tensors
    # Each token's gradient is the sum of its K grouped rows: an unweighted unpermute (a gather, no atomics).
    return _below_autograd(_UNPERMUTE, grad_MD.contiguous(), src_idx_M, dst_idx_TK, None, False), None, None, None


def permute(x_TD: Tensor, meta: RoutingMetadata) -> Tensor:
    """Token rows into expert-grouped order: x_MD[m] = x_TD[meta.src_idx_M[m] // K].

    Args:
        x_TD: float (fp32/bf16/fp16/fp64) [T, D], contiguous.
        meta: the :class:`RoutingMetadata` of this batch; a hand-built one (``checked=False``), or one whose index
            tensors were changed in place, has its index values validated first (one device->host sync on a GPU).

    Returns:
        x_MD [M, D] in x's dtype; differentiable w.r.t. x.
    """
    _check_meta(meta)
    return _apply(_Permute, _PERMUTE, x_TD, meta.src_idx_M, meta.dst_idx_TK, False)


# ---------------------------------------------------------------------------------------------------- unpermute

def _unpermute_impl(y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor, topk_weights_TK: Tensor | None,
                    check: bool = True) -> Tensor:
    if check:
        check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
        check_permutation_values(src_idx_M, dst_idx_TK)
    if use_triton(y_MD):
        return unpermute_triton(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    return unpermute_ref(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)


def _unpermute_fake(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, check=True):
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    return y_MD.new_empty(dst_idx_TK.shape[0], y_MD.shape[1])


def _unpermute_bwd_impl(grad_TD: Tensor, y_MD: Tensor, src_idx_M: Tensor, dst_idx_TK: Tensor,
                        topk_weights_TK: Tensor, need_dw: bool, check: bool = True) -> tuple[Tensor, Tensor]:
    if check:
        check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
        check_permutation_values(src_idx_M, dst_idx_TK)
    if use_triton(y_MD):
        return unpermute_bwd_triton(grad_TD, y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, need_dw)
    return unpermute_bwd_ref(grad_TD, y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, need_dw)


def _unpermute_bwd_fake(grad_TD, y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, need_dw, check=True):
    check_unpermute_inputs(y_MD, src_idx_M, dst_idx_TK, topk_weights_TK)
    dw = topk_weights_TK.new_empty(dst_idx_TK.shape) if need_dw else topk_weights_TK.new_empty(0)
    return torch.empty_like(y_MD), dw


_UNPERMUTE = _operator(
    "unpermute(Tensor y_MD, Tensor src_idx_M, Tensor dst_idx_TK, Tensor? topk_weights_TK, bool check=True) -> Tensor",
    _unpermute_impl, _unpermute_fake)
_UNPERMUTE_BWD = _operator(
    "unpermute_bwd(Tensor grad_TD, Tensor y_MD, Tensor src_idx_M, Tensor dst_idx_TK, Tensor topk_weights_TK, "
    "bool need_dw, bool check=True) -> (Tensor, Tensor)", _unpermute_bwd_impl, _unpermute_bwd_fake)


def _unpermute_setup(ctx, inputs, output):
    y_MD, src_idx_M, dst_idx_TK, topk_weights_TK, _ = inputs
    ctx.has_weights = topk_weights_TK is not None
    ctx.need_dw = ctx.has_weights and ctx.needs_input_grad[3]
    # y is needed only for the weights' gradient.
    ctx.save_for_backward(y_MD if ctx.need_dw else None, src_idx_M, dst_idx_TK, topk_weights_TK)


def _unpermute_backward(ctx, grad_TD: Tensor):
    y_MD, src_idx_M, dst_idx_TK, topk_weights_TK = ctx.saved_tensors
    grad_TD = grad_TD.contiguous()
    if not ctx.has_weights:
        return _below_autograd(_PERMUTE, grad_TD, src_idx_M, dst_idx_TK, False), None, None, None, None
    y_for_dw = y_MD if ctx.need_dw else grad_TD.new_empty(src_idx_M.shape[0], grad_TD.shape[1])
    dy_MD, dw_TK = _below_autograd(_UNPERMUTE_BWD, grad_TD, y_for_dw, src_idx_M, dst_idx_TK, topk_weights_TK,
                                   ctx.need_dw, False)
    return dy_MD, None, None, dw_TK if ctx.need_dw else None, None


_Permute = _differentiable(_PERMUTE, _permute_setup, _permute_backward)
_Unpermute = _differentiable(_UNPERMUTE, _unpermute_setup, _unpermute_backward)


def unpermute(y_MD: Tensor, meta: RoutingMetadata, topk_weights_TK: Tensor) -> Tensor:
    """Back to token order, with the gate-weighted sum over k.

    out_TD[t] = sum_k topk_weights_TK[t, k] * y_MD[meta.dst_idx_TK[t, k]], accumulated in fp32 in the order
    k = 0..K-1 (deterministic), returned in y's dtype.

    Args:
        y_MD: float [M, D], contiguous, in grouped order.
        meta: the :class:`RoutingMetadata` of this batch; a hand-built one (``checked=False``), or one whose index
            tensors were changed in place, has its index values validated first (one device->host sync on a GPU).
        topk_weights_TK: float [T, K], contiguous (any float dtype; its gradient comes back in that dtype).

    Returns:
        out_TD [T, D] in y's dtype; differentiable w.r.t. y_MD and topk_weights_TK (the router gradient).
    """
    _check_meta(meta)
    check_tensor("topk_weights_TK", topk_weights_TK, dtypes=FLOAT_DTYPES)
    return _apply(_Unpermute, _UNPERMUTE, y_MD, meta.src_idx_M, meta.dst_idx_TK, topk_weights_TK, False)


def _check_meta(meta: object) -> None:
    if not isinstance(meta, RoutingMetadata):
        raise TypeError(f"meta: expected a RoutingMetadata (from routing_metadata()), got {type(meta).__name__}")
    # Kernels index rows with these values: an out-of-range one would read or write out of bounds.
    meta._validate_unless_checked()


# ---------------------------------------------------------------------------------------------------- grouped_mm

def _check_grouped_limits(x_MK: Tensor, name: str, t: Tensor) -> None:
    """The kernels' limits on rows and groups, checked in the operators themselves too: a call of
    ``torch.ops.feplb.grouped_mm`` / ``grouped_mm_dw`` skips the wrapper's checks, and the kernels index rows with
    32-bit integers."""
    check_rows("x_MK", x_MK.shape[0], "M")
    if t.shape[0] > MAX_EXPERTS:
        raise ValueError(f"{name}: expected at most {MAX_EXPERTS} groups (experts), got shape {list(t.shape)}")


def _grouped_mm_impl(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, check: bool) -> Tensor:
    _check_grouped_limits(x_MK, "w_EKN", w_EKN)
    if use_triton(x_MK):
        return grouped_mm_triton(x_MK, w_EKN, offsets_E, check_values=check)
    return grouped_mm_ref(x_MK, w_EKN, offsets_E)  # checks the offsets always: cheap on the host


def _grouped_mm_fake(x_MK, w_EKN, offsets_E, check):
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    _check_grouped_limits(x_MK, "w_EKN", w_EKN)
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])


def _grouped_mm_dw_impl(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor, check: bool = True) -> Tensor:
    _check_grouped_limits(x_MK, "offsets_E", offsets_E)
    if use_triton(x_MK):
        return grouped_mm_dw_triton(x_MK, dy_MN, offsets_E, check_values=check)
    return grouped_mm_dw_ref(x_MK, dy_MN, offsets_E)


def _grouped_mm_dw_fake(x_MK, dy_MN, offsets_E, check=True):
    _check_grouped_limits(x_MK, "offsets_E", offsets_E)
    return x_MK.new_empty(offsets_E.shape[0], x_MK.shape[1], dy_MN.shape[1])


_GROUPED_MM = _operator("grouped_mm(Tensor x_MK, Tensor w_EKN, Tensor offsets_E, bool check) -> Tensor",
                        _grouped_mm_impl, _grouped_mm_fake)
_GROUPED_MM_DW = _operator("grouped_mm_dw(Tensor x_MK, Tensor dy_MN, Tensor offsets_E, bool check=True) -> Tensor",
                           _grouped_mm_dw_impl, _grouped_mm_dw_fake)


def _grouped_mm_setup(ctx, inputs, output):
    x_MK, w_EKN, offsets_E, _ = inputs
    ctx.save_for_backward(x_MK if ctx.needs_input_grad[1] else None, w_EKN if ctx.needs_input_grad[0] else None,
                          offsets_E)


def _grouped_mm_backward(ctx, grad_MN: Tensor):
    x_MK, w_EKN, offsets_E = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        # The forward already checked the offsets; the transposed weights are a strided view, not a copy.
        dx = _below_autograd(_GROUPED_MM, grad_MN, w_EKN.transpose(1, 2), offsets_E, False)
    if ctx.needs_input_grad[1]:
        dw = _below_autograd(_GROUPED_MM_DW, x_MK, grad_MN, offsets_E, False)
    return dx, dw, None, None


_GroupedMM = _differentiable(_GROUPED_MM, _grouped_mm_setup, _grouped_mm_backward)


def _grouped_mm_autocast(x_MK, w_EKN, offsets_E, check):
    return (*autocast_matmul_inputs(x_MK, w_EKN), offsets_E, check)


_register_autocast(_GROUPED_MM, _grouped_mm_autocast)


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

    Inside ``torch.autocast`` it follows torch.matmul (unlike torch._grouped_mm, which autocast leaves alone):
    where autocast is on for x's device, x and w (float64 excepted) are cast to the autocast dtype first and y
    comes back in it; their gradients return in their own dtypes through the casts. Each call casts the whole w
    it is given (autocast's weight cache is torch's own).
    """
    check_tensor("x_MK", x_MK)   # before the cast, which reads their attributes
    check_tensor("w_EKN", w_EKN)
    check_bool("check", check)
    x_MK, w_EKN = autocast_matmul_inputs(x_MK, w_EKN)
    check_grouped_mm_inputs(x_MK, w_EKN, offsets_E)
    # (the row and group limits: the operator's own check, its implementations' and fake's)
    return _apply(_GroupedMM, _GROUPED_MM, x_MK, w_EKN, offsets_E, check)


# ---------------------------------------------------------------------------------------------------- glu

def _caps(softcap: list[float] | None) -> tuple[float, float] | None:
    return None if softcap is None else tuple(softcap)


def _traced_numbers(limit: object, alpha: object, softcap: object) -> tuple[object, object, object, bool]:
    """Under ``torch.compile``: ``glu``'s numbers with each numpy scalar as a float, and whether there was one.
    Dynamo traces a numpy scalar (np.float32(7.0), say) as a 0-d array whose value is known only at run time: as
    such the number checks would refuse it (and no message could format it while tracing), and ``float()`` of it is
    a float known only at run time too, whose range the compiler's own checks cannot all state (it takes a symbol
    for a finite number): each is checked as a tensor, at run time, with a message naming it. (A 0-d numeric array,
    which Dynamo cannot tell from a numpy scalar, is taken too; a numpy bool or complex number is refused, as eager
    refuses it.)"""
    import numpy as np

    seen = False

    def number(v: object, name: str, positive: bool, expected: str) -> object:
        nonlocal seen
        if not (isinstance(v, np.ndarray) and v.ndim == 0):
            return v
        t = torch.as_tensor(v)
        if t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"{name}: expected a finite real number, got a numpy "
                             f"{'bool' if t.dtype == torch.bool else 'complex number'}")
        torch._assert_async(torch.isfinite(t) & (t > 0) if positive else torch.isfinite(t),
                            f"{name}: expected {expected}")
        seen = True
        return float(v)

    limit = number(limit, "limit", True, "a finite number > 0")
    alpha = number(alpha, "alpha", False, "a finite number")
    if isinstance(softcap, (tuple, list)):
        softcap = tuple(number(c, "softcap", True, "finite numbers > 0") for c in softcap)
    return limit, alpha, softcap, seen


def _glu_impl(h_M2F: Tensor, limit: float | None = None, act: str = "silu", alpha: float = 1.0,
              interleaved: bool = False, softcap: list[float] | None = None) -> Tensor:
    if use_triton(h_M2F):
        return glu_triton(h_M2F, limit, act, alpha, interleaved, _caps(softcap))
    return glu_ref(h_M2F, limit, act, alpha, interleaved, _caps(softcap))


def _glu_fake(h_M2F, limit=None, act="silu", alpha=1.0, interleaved=False, softcap=None):
    check_glu_input(h_M2F)
    return h_M2F.new_empty(h_M2F.shape[0], h_M2F.shape[1] // 2)


def _glu_bwd_impl(grad_MF: Tensor, h_M2F: Tensor, limit: float | None = None, act: str = "silu",
                  alpha: float = 1.0, interleaved: bool = False, softcap: list[float] | None = None) -> Tensor:
    if use_triton(h_M2F):
        return glu_bwd_triton(grad_MF, h_M2F, limit, act, alpha, interleaved, _caps(softcap))
    return glu_bwd_ref(grad_MF, h_M2F, limit, act, alpha, interleaved, _caps(softcap))


def _glu_bwd_fake(grad_MF, h_M2F, limit=None, act="silu", alpha=1.0, interleaved=False, softcap=None):
    return torch.empty_like(h_M2F)


_GLU = _operator('glu(Tensor h_M2F, float? limit=None, str act="silu", float alpha=1.0, bool interleaved=False, '
                 'float[]? softcap=None) -> Tensor', _glu_impl, _glu_fake)
_GLU_BWD = _operator('glu_bwd(Tensor grad_MF, Tensor h_M2F, float? limit=None, str act="silu", float alpha=1.0, '
                     'bool interleaved=False, float[]? softcap=None) -> Tensor', _glu_bwd_impl, _glu_bwd_fake)


def _glu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.args = inputs[1:]


def _glu_backward(ctx, grad_MF: Tensor):
    (h_M2F,) = ctx.saved_tensors
    return (_below_autograd(_GLU_BWD, grad_MF.contiguous(), h_M2F, *ctx.args), *(None,) * len(ctx.args))


_GLU_FN = _differentiable(_GLU, _glu_setup, _glu_backward)


def glu(h_M2F: Tensor, limit: float | None = None, act: str = "silu", alpha: float = 1.0,
        interleaved: bool = False, softcap: tuple[float, float] | None = None) -> Tensor:
    """Gated activation of the experts: out_MF = act(h[:, :F]) * h[:, F:], computed in fp32. ``act``: ``"silu"``
    (SwiGLU), ``"gelu_tanh"`` (GeGLU, tanh approximation: Gemma 4), ``"gelu"`` (GeGLU, erf), ``"swiglu_oai"``
    (gpt-oss's and MiniMax-M3's: gate * sigmoid(alpha * gate) * (up + 1)) or ``"silu_softcap"`` (Inkling 2's:
    cap(gate, c_gate) * sigmoid(gate) * cap(up, c_up), cap(x, c) = c tanh(x / c), ``softcap`` = (c_gate, c_up)).
    With ``limit``, the clamped form act(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4's experts,
    Megatron's ``activation_func_clamp_value``; gpt-oss clamps at 7); ``"silu_postclamp"`` (Step 3.7's) clamps after
    the activation instead, min(silu(gate), limit) * clamp(up, -limit, limit), and needs ``limit``.

    Args:
        h_M2F: float [M, 2F], contiguous (gate columns first, then up; alternating, gate first, if ``interleaved``:
            gpt-oss's layout).
        limit: None, or a finite number > 0.
        act: one of ``feplb.kernels.activation.ACTS``, ``SOFTCAP_ACTS`` or ``POSTCLAMP_ACTS``.
        alpha: swiglu_oai's sigmoid slope (a finite number; the other activations ignore it). The default, 1.0, is
            not gpt-oss's: pass its 1.702 (``FEPLBConfig.swiglu_alpha``'s default).
        softcap: (c_gate, c_up), finite numbers > 0, with ``"silu_softcap"`` (which takes no limit); None otherwise.

    Numbers may be Python's or numpy's scalars, under ``torch.compile`` too.

    Returns:
        out_MF [M, F] in h's dtype; differentiable.
    """
    from_numpy = False
    if torch.compiler.is_compiling():   # numpy scalars, which Dynamo traces as arrays, as the numbers they hold
        limit, alpha, softcap, from_numpy = _traced_numbers(limit, alpha, softcap)
    check_glu_input(h_M2F)
    check_glu_limit(limit)
    check_glu_act(act, alpha, softcap, limit)
    check_rows("h_M2F", h_M2F.shape[0], "M")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool, got {interleaved!r}")
    if from_numpy:
        # A number known only at run time, which no operator takes as its float argument (the compiler would need
        # its value to trace the call): the pure-torch twin's ops take it, and the compiler differentiates them
        # (torch's own rules, which the operator's backward follows: torch.clamp's at the bounds included).
        return glu_ref(h_M2F, limit, act, alpha, interleaved, None if softcap is None else tuple(softcap))
    return _apply(_GLU_FN, _GLU, h_M2F, None if limit is None else float(limit), act, float(alpha), interleaved,
                  None if softcap is None else [float(c) for c in softcap])


def _mlp_act_impl(h_MF: Tensor, act: str) -> Tensor:
    if use_triton(h_MF):
        return mlp_act_triton(h_MF, act)
    return mlp_act_ref(h_MF, act)


def _mlp_act_fake(h_MF, act):
    check_mlp_act(h_MF, act)
    return torch.empty_like(h_MF)


def _mlp_act_bwd_impl(grad_MF: Tensor, h_MF: Tensor, act: str) -> Tensor:
    if use_triton(h_MF):
        return mlp_act_bwd_triton(grad_MF, h_MF, act)
    return mlp_act_bwd_ref(grad_MF, h_MF, act)


def _mlp_act_bwd_fake(grad_MF, h_MF, act):
    return torch.empty_like(h_MF)


_MLP_ACT = _operator("mlp_act(Tensor h_MF, str act) -> Tensor", _mlp_act_impl, _mlp_act_fake)
_MLP_ACT_BWD = _operator("mlp_act_bwd(Tensor grad_MF, Tensor h_MF, str act) -> Tensor", _mlp_act_bwd_impl,
                         _mlp_act_bwd_fake)


def _mlp_act_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.act = inputs[1]


def _mlp_act_backward(ctx, grad_MF: Tensor):
    (h_MF,) = ctx.saved_tensors
    return _below_autograd(_MLP_ACT_BWD, grad_MF.contiguous(), h_MF, ctx.act), None


_MLP_ACT_FN = _differentiable(_MLP_ACT, _mlp_act_setup, _mlp_act_backward)


def mlp_act(h_MF: Tensor, act: str) -> Tensor:
    """The activation of non-gated experts (Nemotron-H's ``down(relu(up(x))^2)``): act(h) elementwise, computed in
    fp32, act one of ``feplb.kernels.activation.PLAIN_ACTS`` (``"relu2"``, ``"silu"``, ``"gelu_tanh"``,
    ``"gelu"``).

    Args:
        h_MF: float [M, F], contiguous.

    Returns:
        [M, F] in h's dtype; differentiable.
    """
    check_mlp_act(h_MF, act)
    check_rows("h_MF", h_MF.shape[0], "M")
    return _apply(_MLP_ACT_FN, _MLP_ACT, h_MF, act)


def swiglu(h_M2F: Tensor, limit: float | None = None) -> Tensor:
    """SwiGLU, silu(h[:, :F]) * h[:, F:] (clamped by ``limit``): :func:`glu` with ``act="silu"``."""
    return glu(h_M2F, limit, "silu", 1.0, False)
