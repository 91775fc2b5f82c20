"""pytest plugin (``-p _autotune_budget`` with ``bench/`` on PYTHONPATH): time-box Triton's autotuning.

``FEPLB_AUTOTUNE_MS="WARMUP,REP"`` makes every autotuner time each candidate configuration for WARMUP + REP
milliseconds instead of Triton's default 25 + 100, so a GPU check that tunes many kernels and shapes fits its
time limit. The choice gets noisier, never wrong: every configuration computes the same result. Unset: no effect.
"""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    spec = os.environ.get("FEPLB_AUTOTUNE_MS")
    if not spec:
        return
    try:
        warmup, rep = (float(v) for v in spec.split(","))
    except ValueError as err:
        raise ValueError(f"FEPLB_AUTOTUNE_MS: expected 'WARMUP,REP' in milliseconds, got {spec!r}") from err
    try:
        import triton.testing
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return

    def do_bench(kernel_call, quantiles=None, **_ignored):
        return triton.testing.do_bench(kernel_call, warmup=warmup, rep=rep, quantiles=quantiles)

    # Autotuner.do_bench is a cached property returning the benchmarking function; a class-level property
    # takes precedence over it for every autotuner, existing or new.
    Autotuner.do_bench = property(lambda self: do_bench)
