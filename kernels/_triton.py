"""Import guard for Triton, and the switches that decide where kernels run.

Triton is a Linux-only dependency. Without it the pure-torch twins still work (CPU tensors never need
Triton); only launching a kernel raises, with an install hint. Under ``TRITON_INTERPRET=1`` (set before this
module is imported) the kernels run on CPU tensors through Triton's interpreter, which is how they are tested
without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
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

AUTOTUNE_BUDGET_ENV = "FEPLB_AUTOTUNE_MS"


def parse_autotune_budget(spec: str | None) -> tuple[float, float] | None:
    """``"WARMUP,REP"`` in milliseconds (both > 0) from :data:`AUTOTUNE_BUDGET_ENV`, or None when unset/empty."""
    if not spec:
        return None
    try:
        warmup, rep = (float(v) for v in spec.split(","))
    except ValueError as err:
        raise ValueError(f"{AUTOTUNE_BUDGET_ENV}: expected 'WARMUP,REP' in milliseconds, got {spec!r}") from err
    if not (0 < warmup < math.inf and 0 < rep < math.inf):
        raise ValueError(f"{AUTOTUNE_BUDGET_ENV}: expected finite WARMUP > 0 and REP > 0 milliseconds, got {spec!r}")
    return warmup, rep


def apply_autotune_budget(spec: str | None = None) -> tuple[float, float] | None:
    """Time-box Triton's autotuning: every autotuner times each candidate config for WARMUP + REP ms (from
    ``spec``, default the environment's :data:`AUTOTUNE_BUDGET_ENV`) instead of Triton's 25 + 100.

    Runs at import of feplb.kernels, so processes a test or benchmark spawns (they inherit the environment) are
    time-boxed too. The choice gets noisier, never wrong: every config computes the same result up to rounding (tiles
    that split a reduction add it in another order; the winner, picked by timing per process, is not bitwise
    reproducible from run to run; under ``torch.use_deterministic_algorithms(True)`` :func:`launch` does not time
    them, see :func:`deterministic_config`). Unset, or
    without Triton, or under the interpreter (which never tunes): no effect. Returns the budget applied.
    """
    budget = parse_autotune_budget(os.environ.get(AUTOTUNE_BUDGET_ENV) if spec is None else spec)
    if budget is None or not HAVE_TRITON or INTERPRET:
        return None
    try:
        import triton.testing
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # pragma: no cover - another Triton layout
        return None
    warmup, rep = budget

    def do_bench(kernel_call, quantiles=None, **_ignored):
        return triton.testing.do_bench(kernel_call, warmup=warmup, rep=rep, quantiles=quantiles)

    # Autotuner.do_bench is a cached property returning the benchmarking function; a class-level property
    # takes precedence over it for every autotuner, existing or new.
    Autotuner.do_bench = property(lambda self: do_bench)
    return budget


apply_autotune_budget()

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
    return _to_configs(hopper, num_warps=num_warps, num_stages=num_stages)


def _to_configs(entries: list[dict], *, num_warps: int = 4, num_stages: int = 1) -> list:
    configs = []
    for entry in entries:
        meta = {k: v for k, v in entry.items() if k not in ("num_warps", "num_stages")}
        configs.append(triton.Config(meta, num_warps=entry.get("num_warps", num_warps),
                                     num_stages=entry.get("num_stages", num_stages)))
    return configs


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers, for grids and launch sizes. ``triton.cdiv`` gives the same but is a constexpr
    function (about 2 us per call from Python with Triton 3.9): a launch's grid calls it several times."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1) of a host integer; ``triton.next_power_of_2`` without its
    constexpr-function call cost."""
    return 1 << max(n - 1, 0).bit_length()


SHARED_MEMORY_BYTES = 232_448
"""Shared memory one block may use on an H100/H200 (sm_90: 227 KiB)."""


def rows_bucket(num_rows: int, num_groups: int) -> int:
    """Autotune key for the rows per group: the next power of two of the mean, clamped to [16, 4096].

    A config tuned at 128 rows per expert is then not reused at 4096. Always a multiple of 16, so the kernels'
    integer argument that carries it compiles to one specialisation for every bucket.
    """
    mean = -(-num_rows // max(num_groups, 1))
    return min(max(1 << max(mean - 1, 0).bit_length(), 16), 4096)


def shared_memory_prune(shared_bytes, fallback: list[dict], dtype_arg: str):
    """An ``early_config_prune`` for an autotuned kernel: keep the configs whose shared memory fits one block.

    ``shared_bytes(entry, itemsize) -> int`` estimates a config's shared memory (``entry``: its block sizes
    plus ``num_stages``) for operands of ``itemsize`` bytes, the itemsize of argument ``dtype_arg``. When no
    config fits (fp64, say), the fitting configs of ``fallback`` (dicts as in :func:`autotune_configs`) are used
    instead. ``tests/kernels/hopper_compile.py`` compiles what this keeps and checks the compiler's own figure
    against the limit and the estimate.
    """

    def prune(configs, named_args, **_kwargs):
        itemsize = named_args[dtype_arg].element_size()

        def fits(c):
            return shared_bytes({**c.kwargs, "num_stages": c.num_stages}, itemsize) <= SHARED_MEMORY_BYTES

        return [c for c in configs if fits(c)] or [c for c in _to_configs(fallback) if fits(c)]

    return prune


def fitting_configs(configs: list[dict], fallback: list[dict], shared_bytes, itemsize: int) -> list[dict]:
    """The config dicts :func:`shared_memory_prune` keeps on a GPU for operands of ``itemsize`` bytes."""
    def fits(entry):
        return shared_bytes(entry, itemsize) <= SHARED_MEMORY_BYTES

    return [c for c in configs if fits(c)] or [c for c in fallback if fits(c)]


def check_config_fits(config: dict | None, shared_bytes, t: torch.Tensor) -> None:
    """An explicit config for a GPU launch must fit shared memory with ``t``'s operands (ValueError otherwise)."""
    if config is not None and t.is_cuda:
        need = shared_bytes(config, t.element_size())
        if need > SHARED_MEMORY_BYTES:
            raise ValueError(f"config: {config} needs about {need} bytes of shared memory with {t.dtype} operands, "
                             f"over the {SHARED_MEMORY_BYTES} of a block; use fewer stages or smaller blocks")


def num_programs(t: torch.Tensor) -> int:
    """Programs a persistent kernel launches: one per SM on a GPU; 3 under the interpreter (so that tests see
    programs loop over several tiles)."""
    if t.is_cuda:
        return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 3


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _alloc_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator() -> None:
    """Tensor descriptors made inside a kernel need global scratch memory from Triton's allocator; install a
    torch allocator unless one is set (Triton's default raises). Triton keeps it in a context variable, so this
    runs before every launch that needs it (another thread starts with the default)."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except (ImportError, AttributeError):  # pragma: no cover - another Triton layout: set ours
        pass
    triton.set_allocator(_alloc_scratch)


def launch(kernel, grid, *args, config: dict | None = None, **kwargs) -> None:
    """Launch an autotuned kernel; with ``config`` (block sizes, optional num_warps / num_stages), launch its
    JIT function with exactly that config instead (to test every GPU config under the interpreter, or to time
    one config). Under ``torch.use_deterministic_algorithms(True)``, the config :func:`deterministic_config` picks
    without timing instead of the autotuner's."""
    if config is None:
        fixed = deterministic_config(kernel, args, kwargs)
        if fixed is None:
            kernel[grid](*args, **kwargs)
        else:
            kernel.fn[grid](*args, **kwargs, **fixed.all_kwargs())
    else:
        kernel.fn[grid](*args, **kwargs, **config)


def deterministic_config(kernel, args: tuple, kwargs: dict):
    """Under ``torch.use_deterministic_algorithms(True)``, the config an autotuned kernel launches with: the first
    of its configs that its ``early_config_prune`` keeps for these arguments (shared memory, dtype), a function of
    the shapes and dtypes (and, for the persistent variants, of the GPU's SM count, which sets their programs and
    the weight gradients' row chunks) and never of timing, so every run on one kind of GPU computes with the same
    tiles. Triton's autotuner times the configs instead and keeps the fastest, per process: tiles that split a
    reduction otherwise (the GEMMs' BLOCK_K, the weight gradients' BLOCK_M) round differently, so two runs of the
    same job would differ in their last bits. The first config is not the fastest everywhere: the flag costs kernel
    time (not measured: the kernels have not yet run on a GPU). None where the autotuner decides nothing (the flag
    off, a single config, not an autotuned kernel)."""
    if not torch.are_deterministic_algorithms_enabled():
        return None
    configs = getattr(kernel, "configs", None)
    if not configs or len(configs) == 1 or not hasattr(kernel, "arg_names"):
        return None
    prune = getattr(kernel, "early_config_prune", None)
    kept = prune(configs, dict(zip(kernel.arg_names, args, strict=False)), **kwargs) if prune else configs
    if not kept:
        raise RuntimeError(f"{getattr(kernel, 'base_fn', kernel)}: no config fits these arguments")
    return kept[0]


def require_triton(where: str) -> None:
    """Raise ImportError with an install hint when a kernel is launched without Triton."""
    if not HAVE_TRITON:
        raise ImportError(f"{where}: Triton is not installed; install it with `pip install triton` (Linux)")


def check_launch_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors only under an interpreter that can run them."""
    require_triton(name)
    if not t.is_cuda:
        if not INTERPRET:
            raise ValueError(f"{name}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
                             f"got a tensor on {t.device}")
        problem = interpreter_problem()
        if problem:
            raise RuntimeError(f"{name}: {problem}")


@triton.jit
def _interpreter_probe_kernel(out_ptr, n):
    acc = 0
    for _ in range(0, n, 2):   # a loop bounded by a runtime scalar, as the routing and GEMM kernels have
        acc += 1
    tl.store(out_ptr, acc)


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None (also None off the interpreter).

    Found by running a probe kernel once. Known case: Triton 3.6's interpreter turns a runtime scalar into an
    index with ``int()`` of a one-element array, which numpy 2.4 and later refuse, so every kernel with a loop
    bounded by an argument fails (Triton 3.9 runs them; so does 3.6 with numpy < 2.4).
    """
    if not (HAVE_TRITON and INTERPRET):
        return None
    import numpy as np

    out = torch.full((1,), -1, dtype=torch.int32)
    versions = f"Triton {triton.__version__} with numpy {np.__version__}"
    try:
        _interpreter_probe_kernel[(1,)](out, 5)
    except Exception as err:  # any failure of the probe means the kernels cannot run either
        cause = err.__cause__ or err
        return (f"Triton's interpreter (TRITON_INTERPRET=1) cannot run the kernels here: {versions} fails a probe "
                f"kernel ({type(cause).__name__}: {cause}); use numpy<2.4 with this Triton, or a newer Triton")
    if int(out.item()) != 3:
        return (f"Triton's interpreter (TRITON_INTERPRET=1) miscomputes a probe kernel here ({versions}): a loop "
                f"over range(0, 5, 2) ran {int(out.item())} times, not 3")
    return None


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
