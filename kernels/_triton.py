"""Import guard for Triton, and the switches that decide where kernels run.

Triton is a Linux-only dependency. Without it the pure-torch twins still work (CPU tensors never need
Triton); only launching a kernel raises, with an install hint. Under ``TRITON_INTERPRET=1`` (set before this
module is imported) the kernels run on CPU tensors through Triton's interpreter, which is how they are tested
without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAVE_TRITON = False

    def _missing(*_args, **_kwargs):
        raise ImportError("feplb.kernels: Triton is not installed; install it with `pip install triton` (Linux)")

    def _identity_decorator(*_args, **_kwargs):
        def wrap(fn):
            return fn

        return wrap

    triton = SimpleNamespace(jit=lambda fn=None, **_kw: fn if fn is not None else (lambda f: f),
                             autotune=_identity_decorator, heuristics=_identity_decorator, Config=_missing,
                             cdiv=lambda a, b: -(-a // b), next_power_of_2=_missing)
    tl = SimpleNamespace(constexpr=object)

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when Triton's interpreter runs kernels on the CPU (read once, at import, as Triton itself does)."""

_force_triton_on_cpu = False


def use_triton(t: torch.Tensor) -> bool:
    """Whether the custom ops run the Triton kernel for a tensor on ``t``'s device (CUDA: always)."""
    return t.is_cuda or _force_triton_on_cpu


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Make the custom ops run their Triton kernels on CPU tensors, through the interpreter (for tests).

    Raises RuntimeError unless ``TRITON_INTERPRET=1`` was set before feplb.kernels was imported.
    """
    global _force_triton_on_cpu
    if not (HAVE_TRITON and INTERPRET):
        raise RuntimeError("triton_on_cpu() needs Triton and TRITON_INTERPRET=1 set before importing feplb.kernels")
    previous, _force_triton_on_cpu = _force_triton_on_cpu, True
    try:
        yield
    finally:
        _force_triton_on_cpu = previous


def autotune_configs(hopper: list[dict], interpreter: dict, *, num_warps: int = 4, num_stages: int = 1) -> list:
    """Autotune configs: the Hopper list on a GPU, the single ``interpreter`` config under the interpreter.

    Triton's autotuner cannot benchmark under the interpreter; with a single config it never tries. Entries of
    ``hopper`` hold block sizes plus optional ``num_warps`` / ``num_stages``.
    """
    if not HAVE_TRITON:
        return []
    if INTERPRET:
        return [triton.Config(dict(interpreter), num_warps=num_warps, num_stages=num_stages)]
    configs = []
    for entry in hopper:
        meta = {k: v for k, v in entry.items() if k not in ("num_warps", "num_stages")}
        configs.append(triton.Config(meta, num_warps=entry.get("num_warps", num_warps),
                                     num_stages=entry.get("num_stages", num_stages)))
    return configs


def launch(kernel, grid, *args, config: dict | None = None, **kwargs) -> None:
    """Launch an autotuned kernel; with ``config`` (block sizes, optional num_warps / num_stages), launch its
    JIT function with exactly that config instead (to test every GPU config under the interpreter, or to time
    one config)."""
    if config is None:
        kernel[grid](*args, **kwargs)
    else:
        kernel.fn[grid](*args, **kwargs, **config)


def require_triton(where: str) -> None:
    """Raise ImportError with an install hint when a kernel is launched without Triton."""
    if not HAVE_TRITON:
        raise ImportError(f"{where}: Triton is not installed; install it with `pip install triton` (Linux)")


def check_launch_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors only under the interpreter."""
    require_triton(name)
    if not t.is_cuda and not INTERPRET:
        raise ValueError(f"{name}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
                         f"got a tensor on {t.device}")


_poison = False


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output: uninitialised, or NaN (-1 for integers) inside :func:`poison_outputs`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _poison:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Fill every output the launchers allocate with NaN (or -1), so an element a kernel never writes fails."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous
