"""Kernel throughput: Triton grouped GEMM (forward, dX, dW) and permute / unpermute, next to their baselines.

GPU part (``@pytest.mark.gpu``): the GLM-5 expert shape (H = 6144, F = 2048, 16 local experts, bf16) at 128 to
4096 rows per expert, uniform and Zipf-skewed counts. Each row of the results holds TFLOP/s of ours next to
``torch._grouped_mm`` and to one dense matmul of the same FLOPs, or GB/s of permute / unpermute next to a
device-to-device copy of the same bytes, all measured in the same run. Run on a GPU:
``.venv/bin/pytest bench/bench_kernels.py --benchmark-enable -m gpu --benchmark-json=runs/bench_kernels_pb.json``;
the table is written to ``runs/bench_kernels.json`` (or ``$FEPLB_BENCH_KERNELS_JSON``), with device, versions
and command. Targets (targets.md): forward >= torch._grouped_mm at >= 256 rows per expert and >= 650 TFLOP/s
at >= 1024; dX and dW >= 85% of forward; permute / unpermute >= 80% of the copy's bandwidth.

CPU part: every op once at a tiny shape under the Triton interpreter, to show the benchmarks run (CI runs them
with --benchmark-disable); those timings say nothing about a GPU.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from feplb.kernels import HAVE_TRITON, INTERPRET
from feplb.kernels.activation import swiglu_triton
from feplb.kernels.grouped_gemm import grouped_mm_dw_triton, grouped_mm_triton
from feplb.kernels.permutation import permute_triton, unpermute_triton
from feplb.kernels.routing import routing_metadata_triton

HIDDEN, FFN, LOCAL_EXPERTS, TOP_K = 6144, 2048, 16, 8
ROWS_PER_EXPERT = [128, 256, 512, 1024, 2048, 4096]
PROJECTIONS = {"gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}  # (K, N) of each expert projection
CUDA = torch.cuda.is_available()


def expert_counts(rows_per_expert: int, dist: str, num_experts: int = LOCAL_EXPERTS) -> list[int]:
    """Rows per expert summing to rows_per_expert * E: equal, or Zipf (p_e ~ 1 / (e + 1)) rounded down with the
    remainder given to the hottest expert."""
    total = rows_per_expert * num_experts
    if dist == "uniform":
        return [rows_per_expert] * num_experts
    weights = [1.0 / (e + 1) for e in range(num_experts)]
    counts = [int(total * w / sum(weights)) for w in weights]
    counts[0] += total - sum(counts)
    return counts


# ---------------------------------------------------------------------------------------------------- CPU smoke

smoke = pytest.mark.skipif(CUDA or not (HAVE_TRITON and INTERPRET), reason="CPU interpreter smoke run")


@smoke
@pytest.mark.parametrize("op", ["forward", "dx", "dw"])
def test_grouped_mm_smoke(benchmark, op):
    counts = expert_counts(8, "zipf", num_experts=4)
    offsets = torch.tensor(counts).cumsum(0)
    x, w, dy = torch.randn(sum(counts), 32), torch.randn(4, 32, 48), torch.randn(sum(counts), 48)
    fns = {"forward": lambda: grouped_mm_triton(x, w, offsets),
           "dx": lambda: grouped_mm_triton(dy, w.transpose(1, 2), offsets),
           "dw": lambda: grouped_mm_dw_triton(x, dy, offsets)}
    benchmark.group = "interpreter smoke"
    assert torch.isfinite(benchmark(fns[op])).all()


@smoke
def test_routing_permute_swiglu_smoke(benchmark):
    ids = torch.rand(16, 4).topk(2, dim=1).indices
    x, weights = torch.randn(16, 64), torch.rand(16, 2)

    def step():
        _, _, src, dst = routing_metadata_triton(ids, 4)
        x_MD = permute_triton(x, src, dst)
        return unpermute_triton(swiglu_triton(x_MD).repeat(1, 2).contiguous(), src, dst, weights)

    benchmark.group = "interpreter smoke"
    assert torch.isfinite(benchmark(step)).all()


# ---------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
RESULTS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    if not RESULTS:
        return
    out = Path(os.environ.get("FEPLB_BENCH_KERNELS_JSON", "runs/bench_kernels.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "command": " ".join(sys.argv),
            "shape": {"hidden": HIDDEN, "ffn": FFN, "local_experts": LOCAL_EXPERTS, "top_k": TOP_K,
                      "dtype": "bfloat16"}}
    out.write_text(json.dumps({"meta": meta, "results": RESULTS}, indent=1))


def _timed(benchmark, fn, inner: int = 10) -> float:
    """Mean seconds per call of a CUDA function: rounds of ``inner`` back-to-back calls, one sync per round."""
    def run():
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()

    fn()  # compile, autotune
    torch.cuda.synchronize()
    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=2)
    return benchmark.stats.stats.mean / inner if benchmark.stats is not None else float("nan")


def _grouped_inputs(rows_per_expert: int, dist: str, proj: str):
    K, N = PROJECTIONS[proj]
    counts = expert_counts(rows_per_expert, dist)
    M = sum(counts)
    dev, dt = "cuda", torch.bfloat16
    offsets = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=dev, dtype=dt)
    w = torch.randn(LOCAL_EXPERTS, K, N, device=dev, dtype=dt) / K**0.5
    dy = torch.randn(M, N, device=dev, dtype=dt)
    return x, w, dy, offsets


def _ours(op, x, w, dy, offsets):
    return {"forward": lambda: grouped_mm_triton(x, w, offsets, check_values=False),
            "dx": lambda: grouped_mm_triton(dy, w.transpose(1, 2), offsets, check_values=False),
            "dw": lambda: grouped_mm_dw_triton(x, dy, offsets, check_values=False)}[op]


def _torch_grouped(op, x, w, dy, offsets):
    return {"forward": lambda: torch._grouped_mm(x, w, offs=offsets),
            "dx": lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offsets),
            "dw": lambda: torch._grouped_mm(x.t(), dy, offs=offsets)}[op]


def _dense(op, x, w, dy, offsets):
    # One matmul with the same FLOPs (2 * M * K * N) and shapes: the ceiling a grouped GEMM can approach.
    w0 = w[0]
    return {"forward": lambda: x @ w0, "dx": lambda: dy @ w0.t(), "dw": lambda: x.t() @ dy}[op]


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["feplb", "torch_grouped_mm", "dense"])
@pytest.mark.parametrize("op", ["forward", "dx", "dw"])
@pytest.mark.parametrize("proj", list(PROJECTIONS))
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("rows_per_expert", ROWS_PER_EXPERT)
def test_grouped_mm_tflops(benchmark, rows_per_expert, dist, proj, op, impl):
    x, w, dy, offsets = _grouped_inputs(rows_per_expert, dist, proj)
    make = {"feplb": _ours, "torch_grouped_mm": _torch_grouped, "dense": _dense}[impl]
    fn = make(op, x, w, dy, offsets)
    if impl == "feplb":  # correctness of the measured kernel on this very input, against torch
        ref = _torch_grouped(op, x, w, dy, offsets) if hasattr(torch, "_grouped_mm") else None
        if ref is not None:
            try:
                expected = ref()
            except RuntimeError:
                expected = None
            if expected is not None:
                torch.testing.assert_close(fn().float(), expected.float(), rtol=2e-2, atol=2e-2)
    benchmark.group = f"grouped_mm {proj} {op} {dist} {rows_per_expert}/expert"
    row = {"bench": "grouped_mm", "proj": proj, "op": op, "dist": dist, "rows_per_expert": rows_per_expert,
           "impl": impl, "M": x.shape[0], "K": x.shape[1], "N": w.shape[2]}
    try:
        seconds = _timed(benchmark, fn)
    except RuntimeError as err:  # e.g. torch._grouped_mm unsupported on this device or layout
        row["error"] = str(err).splitlines()[0]
        RESULTS.append(row)
        pytest.skip(f"{impl} unavailable: {row['error']}")
    flops = 2.0 * x.shape[0] * x.shape[1] * w.shape[2]
    row.update(us=seconds * 1e6, tflops=flops / seconds / 1e12)
    benchmark.extra_info.update(row)
    RESULTS.append(row)


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["permute", "unpermute", "copy"])
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("rows_per_expert", ROWS_PER_EXPERT)
def test_permute_bandwidth(benchmark, rows_per_expert, dist, impl):
    counts = expert_counts(rows_per_expert, dist)
    M = sum(counts)
    T = M // TOP_K
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Each token picks TOP_K distinct local experts, with the expert popularity of `dist`.
    popularity = torch.tensor(counts, dtype=torch.float32, device="cuda")
    ids = torch.multinomial(popularity.expand(T, -1), TOP_K, replacement=False, generator=gen).to(torch.int32)
    _, _, src, dst = routing_metadata_triton(ids, LOCAL_EXPERTS)
    x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(T * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(T, TOP_K, device="cuda")
    copy_out = torch.empty_like(y)
    row_bytes = HIDDEN * 2
    fns = {  # bytes read + written by each
        "permute": (lambda: permute_triton(x, src, dst), 2 * T * TOP_K * row_bytes),
        "unpermute": (lambda: unpermute_triton(y, src, dst, weights), (T * TOP_K + T) * row_bytes),
        "copy": (lambda: copy_out.copy_(y), 2 * T * TOP_K * row_bytes),
    }
    fn, nbytes = fns[impl]
    benchmark.group = f"permute {dist} {rows_per_expert}/expert"
    seconds = _timed(benchmark, fn)
    row = {"bench": "permute", "impl": impl, "dist": dist, "rows_per_expert": rows_per_expert, "T": T,
           "K": TOP_K, "D": HIDDEN, "bytes": nbytes, "us": seconds * 1e6, "gbps": nbytes / seconds / 1e9}
    benchmark.extra_info.update(row)
    RESULTS.append(row)
