"""Host time per call of the public ops, next to the registration they replaced, in one run.

The ops of ``feplb.kernels`` are ``torch.library`` operators (``define`` / ``impl`` / ``register_fake``) inside
``torch.autograd.Function`` s. Their former registration, ``torch.library.custom_op`` with ``register_autograd``,
is rebuilt here around the very same implementations and backward operators (namespace ``feplb_bench``) as the
baseline; the implementation called directly is the floor. For ``swiglu`` and ``grouped_mm`` (the expert MLP's ops)
each is timed three ways: forward on inputs that need no gradient, forward on inputs that do, and forward plus
backward. Inputs are tiny (8 rows), so the time is the host's: dispatch, autograd and the Python around the kernel.
Rounds alternate the variants; each reports the fastest round's time per call.

On a CPU the implementations are the pure-torch twins and the numbers are this CPU's host overheads; on a GPU the
same code times the host's issue of the Triton launches (no sync inside a round). Results go to
``extra_info`` and, with ``--benchmark-enable``, to ``runs/bench_ops_host_<cpu|cuda>.json`` (FEPLB_BENCH_OPS_HOST_CALLS
sets the calls per round); every variant's output and gradients are checked equal to the public op's first (also
with ``--benchmark-disable``, as in CI).

    .venv/bin/pytest bench/bench_ops_host.py -s -p no:randomly --benchmark-enable
"""

from __future__ import annotations

import os
import platform
import time

import pytest
import torch

from feplb.files import write_json
from feplb.kernels import grouped_mm, ops, swiglu

CALLS = 2000
ROUNDS = 7


def _baseline_ops():
    """The former registration: ``torch.library.custom_op`` with autograd registered on the op, around the same
    implementations as feplb's operators (defined once per process)."""
    if not hasattr(_baseline_ops, "made"):
        def sw_impl(h_M2F: torch.Tensor, limit: float | None, act: str, alpha: float,
                    interleaved: bool) -> torch.Tensor:
            return ops._glu_impl(h_M2F, limit, act, alpha, interleaved)

        sw = torch.library.custom_op("feplb_bench::glu", mutates_args=())(sw_impl)
        sw.register_fake(ops._glu_fake)
        sw.register_autograd(ops._glu_backward, setup_context=ops._glu_setup)

        def gm_impl(x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, check: bool) -> torch.Tensor:
            return ops._grouped_mm_impl(x_MK, w_EKN, offsets_E, check)

        gm = torch.library.custom_op("feplb_bench::grouped_mm", mutates_args=())(gm_impl)
        gm.register_fake(ops._grouped_mm_fake)

        def gm_backward(ctx, grad_MN):
            # as the former registration did: dX through the custom op itself
            x, w, offsets = ctx.saved_tensors
            dx = gm(grad_MN, w.transpose(1, 2), offsets, False) if ctx.needs_input_grad[0] else None
            dw = ops._GROUPED_MM_DW(x, grad_MN, offsets, False) if ctx.needs_input_grad[1] else None
            return dx, dw, None, None

        gm.register_autograd(gm_backward, setup_context=ops._grouped_mm_setup)
        _baseline_ops.made = {"swiglu": sw, "grouped_mm": gm}
    return _baseline_ops.made


def _cases(device: torch.device) -> dict:
    """op -> (inputs, grad of the output, {variant: fn(*inputs)}, the public op). feplb's variant is the op's
    autograd Function as the public op applies it, without the public op's input checks (the baseline has none)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(8, 32, generator=gen).to(device)
    x, w = torch.randn(8, 16, generator=gen).to(device), torch.randn(2, 16, 16, generator=gen).to(device)
    offsets = torch.tensor([4, 8], dtype=torch.int32, device=device)
    base = _baseline_ops()
    return {
        "swiglu": ((h,), torch.randn(8, 16, generator=gen).to(device),
                   {"feplb": lambda a: ops._GLU_FN.apply(a, None, "silu", 1.0, False),
                    "custom_op": lambda a: base["swiglu"](a, None, "silu", 1.0, False),
                    "implementation": lambda a: ops._glu_impl(a, None, "silu", 1.0, False)},
                   swiglu),
        "grouped_mm": ((x, w), torch.randn(8, 16, generator=gen).to(device),
                       {"feplb": lambda a, b: ops._GroupedMM.apply(a, b, offsets, False),
                        "custom_op": lambda a, b: base["grouped_mm"](a, b, offsets, False),
                        "implementation": lambda a, b: ops._grouped_mm_impl(a, b, offsets, False)},
                       lambda a, b: grouped_mm(a, b, offsets)),
    }


def _check_equal(inputs, grad_out, fns, public) -> None:
    """Every variant computes the same output as the public op, and the two differentiable ones its gradients."""
    outs = {k: f(*inputs) for k, f in fns.items()}
    grads = {}
    for k in ("feplb", "custom_op"):
        leaves = [t.detach().requires_grad_() for t in inputs]
        fns[k](*leaves).backward(grad_out)
        grads[k] = [t.grad for t in leaves]
    leaves = [t.detach().requires_grad_() for t in inputs]
    want = public(*leaves)
    want.backward(grad_out)
    for k, out in outs.items():
        assert torch.equal(out, want), f"{k}: output differs from the public op's"
    for k, got in grads.items():
        assert all(torch.equal(a, b.grad) for a, b in zip(got, leaves, strict=True)), \
            f"{k}: gradients differ from the public op's"


def _time(fns: dict, inputs, grad_out, calls: int, rounds: int, sync) -> dict:
    """Fastest round's us per call, per (variant, mode); the variants alternate inside every round."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    modes = {"no_grad_inputs": lambda f: f(*inputs), "forward": lambda f: f(*leaves),
             "forward_backward": lambda f: f(*leaves).backward(grad_out)}
    best: dict = {}
    for _ in range(rounds + 1):  # the first round warms up
        for mode, call in modes.items():
            for k, f in fns.items():
                if mode != "no_grad_inputs" and k == "implementation":
                    continue  # the bare implementation records no graph
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call(f)
                sync()
                us = (time.perf_counter() - t0) / calls * 1e6
                best[(k, mode)] = min(best.get((k, mode), float("inf")), us)
            for t in leaves:
                t.grad = None
    return best


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ops_host_time(benchmark, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    calls, rounds = (CALLS, ROUNDS) if not benchmark.disabled else (20, 1)
    calls = int(os.environ.get("FEPLB_BENCH_OPS_HOST_CALLS", calls))
    results = {}
    for op, (inputs, grad_out, fns, public) in _cases(dev).items():
        _check_equal(inputs, grad_out, fns, public)
        best = _time(fns, inputs, grad_out, calls, rounds, sync)
        results[op] = {mode: {k: round(best[(k, mode)], 2) for k in fns if (k, mode) in best}
                       for mode in ("no_grad_inputs", "forward", "forward_backward")}
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
            (platform.processor() or platform.machine()), "device_type": dev.type, "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "calls_per_round": calls,
            "rounds": rounds, "us_per_call": results}
    benchmark.extra_info.update(info)
    if not benchmark.disabled:
        write_json(f"runs/bench_ops_host_{dev.type}.json", info)
    label = "GPU (host issue)" if dev.type == "cuda" else "CPU"
    print(f"\n[{label}] host us per call, fastest of {rounds} rounds of {calls} calls, 8 rows:")
    for op, modes in results.items():
        for mode, r in modes.items():
            print(f"  {op:10s} {mode:16s} " + "  ".join(f"{k} {v:7.2f}" for k, v in r.items()))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    assert all(v > 0 for modes in results.values() for r in modes.values() for v in r.values())
