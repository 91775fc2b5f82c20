"""Argument checks shared by the launchers, the references and the custom ops.

Every message names the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

MAX_ROWS = 2**31 - 2**16
"""Most rows (M = T*K) a kernel takes: row indices are int32, and a block of rows past the last one (at most
2**16 rows) must not wrap around either."""

MAX_EXPERTS = 2**14
"""Most experts the routing kernels take: they compare every row with every expert (O(M * E) work) and keep an
[E, M / block] int32 table; the largest public MoE models use a few hundred."""


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t: object, *, dtypes: Sequence[torch.dtype] | None = None, ndim: int | None = None,
                 shape: Sequence[int | None] | None = None, contiguous: bool = False) -> torch.Tensor:
    """Check type, dtype, rank, shape (None = any size) and contiguity of ``t``; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        got = str(t.dtype).removeprefix("torch.")
        raise TypeError(f"{name}: expected dtype in ({_dtype_names(dtypes)}), got {got}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None and (
        t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape, strict=True))
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got shape {list(t.shape)} with strides "
                         f"{list(t.stride())}; call .contiguous() first")
    return t


def check_same_device(**tensors: torch.Tensor) -> None:
    """All tensors on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"expected all tensors on one device, got {devices}")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    """A bool (a flag that turns a check off must not be turned off by None or 0, which torch's schema would read as
    False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


def check_num_experts(name: str, value: object) -> int:
    """An int in [1, MAX_EXPERTS]."""
    check_positive_int(name, value)
    if value > MAX_EXPERTS:
        raise ValueError(f"{name}: expected at most {MAX_EXPERTS} experts (the routing kernels compare every row with "
                         f"every expert), got {value}")
    return value


def check_rows(name: str, rows: int, what: str, *factors: int) -> None:
    """``rows`` (described by ``what`` and the ``factors`` it is the product of, e.g. "M = T*K", 3, 7) fits the
    kernels' 32-bit row indices. The message is formatted only when it is raised: under ``torch.compile`` a size
    turned into text is fixed to its value (one graph per token count, a dynamic one refused)."""
    if rows > MAX_ROWS:
        raise ValueError(f"{name}: expected at most {MAX_ROWS} rows (the kernels index rows with 32-bit integers), "
                         f"got {what}{' = ' + ' * '.join(map(str, factors)) if factors else ''} = {rows}")


def check_finite(value: float, name: str) -> bool:
    """Whether ``value`` (a number) is finite; under ``torch.compile``, where it may be symbolic (a float argument
    under ``dynamic=True``, which no message may format), a runtime check naming ``name`` instead (always True at
    tracing)."""
    if torch.compiler.is_compiling():
        # (abs(nan) < inf is False; value - value == 0, which says the same, fails Inductor's lowering for a float
        # only known at run time, numpy's float64 scalar's)
        torch._check(abs(value) < math.inf, lambda: f"{name}: expected a finite number")
        return True
    return math.isfinite(value)


def check_positive(value: float, name: str, what: str = "a number > 0") -> bool:
    """Whether ``value`` (a finite number) is > 0; under ``torch.compile``, where it may be symbolic (no message may
    format it), a runtime check saying "``name``: expected ``what``" instead (always True at tracing)."""
    if torch.compiler.is_compiling():
        torch._check(value > 0, lambda: f"{name}: expected {what}")
        return True
    return value > 0
