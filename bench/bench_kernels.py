"""Kernel throughput: Triton grouped GEMM (forward, dX, dW) and permute / unpermute, next to their baselines.

GPU part (``@pytest.mark.gpu``): the GLM-5 expert shape (H = 6144, F = 2048, 16 local experts, bf16) at 128 to
4096 rows per expert, uniform and Zipf-skewed counts. Each row of the results holds TFLOP/s of ours next to
``torch._grouped_mm`` and to one dense matmul of the same FLOPs, or GB/s of permute / unpermute next to a
device-to-device copy of the same bytes, all measured in the same run. Run on a GPU:
``.venv/bin/pytest bench/bench_kernels.py --benchmark-enable -m gpu --benchmark-json=runs/bench_kernels_pb.json``;
the table is written to ``runs/bench_kernels.json`` (or ``$FEPLB_BENCH_KERNELS_JSON``), with device, versions
and command. Targets (targets.md): forward >= torch._grouped_mm at >= 256 rows per expert and >= 650 TFLOP/s
at >= 1024; dX and dW >= 85% of forward; permute / unpermute >= 80% of the copy's bandwidth.

Rules every case follows:

* its result is checked against a reference on the very input it times, before timing (ours and the baselines);
  when ``torch._grouped_mm`` is unavailable or raises, ours is checked against the pure-torch twins (``*_ref``);
* a failure of the project's own kernel (wrong values, or any exception while checking or timing) FAILS the
  case; only a baseline that this torch or GPU cannot run is skipped (and recorded with its error);
* results do not depend on the order the cases run in: the autotuners' caches are cleared before each of ours,
  so every case picks its configuration on its own input (the chosen one is recorded);
* ``us`` is GPU time: CUDA events around back-to-back calls queued behind a GPU sleep, so the host's launches
  run ahead and no launch gap is timed; ``host_us`` is the host's time to issue one call (checks, autotuner
  dispatch, launcher), and ``launch_bound`` says the host issues calls slower than the GPU runs them (a real
  program then waits for the host at this size). The first H200 run (2026-11-30) timed host wall time, which at
  128 to 512 rows per expert measured launches, not the permute kernels.

CPU part: the same case builders at a tiny shape under the Triton interpreter (values checked, CI runs them with
--benchmark-disable), and the failure rules above on stand-ins; CPU timings say nothing about a GPU.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import pytest
import torch

from feplb.files import write_json
from feplb.kernels import HAVE_TRITON, INTERPRET
from feplb.kernels.activation import glu_triton
from feplb.kernels.grouped_gemm import grouped_mm_dw_ref, grouped_mm_dw_triton, grouped_mm_ref, grouped_mm_triton
from feplb.kernels.permutation import permute_ref, permute_triton, unpermute_ref, unpermute_triton
from feplb.kernels.routing import routing_metadata_ref, routing_metadata_triton

HIDDEN, FFN, LOCAL_EXPERTS, TOP_K = 6144, 2048, 16, 8
ROWS_PER_EXPERT = [4096, 2048, 1024, 512, 256, 128]  # largest first (see the GPU cases below)
OPS = ["forward", "dx", "dw"]
CUDA = torch.cuda.is_available()
# bf16 outputs of fp32 accumulations that differ only in summation order: a few bf16 ulps.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
# The dense baseline's check is norm-wise: its dW reduces up to 65536 rows through cuBLAS (split-K partial sums),
# and on the first H200 run 13 to 21 of about 0.5 to 0.8 million elements near zero missed BF16_TOL element-wise.
DENSE_REL_TOL = 1e-2   # ||got - want|| / ||want|| (bf16 output rounding alone is about 2e-3)


def projections(hidden: int = HIDDEN, ffn: int = FFN) -> dict[str, tuple[int, int]]:
    """(K, N) of each expert projection."""
    return {"gate_up": (hidden, 2 * ffn), "down": (ffn, hidden)}


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


# ---------------------------------------------------------------------------------------------------- case builders

class BaselineUnavailable(Exception):
    """A baseline (not ours) that this torch / GPU cannot run."""


def error_line(err: BaseException) -> str:
    """``"ErrorType: first line of the message"``, as the results record a failure."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _autotuners() -> dict[str, object]:
    """Every autotuned kernel of the project's kernel modules (whichever are imported), by qualified name."""
    if not HAVE_TRITON:
        return {}
    from triton.runtime.autotuner import Autotuner

    return {f"{mod_name.rsplit('.', 1)[-1]}.{name}": obj
            for mod_name, module in list(sys.modules.items()) if mod_name.startswith("feplb.kernels.")
            for name, obj in vars(module).items() if isinstance(obj, Autotuner)}


def fresh_autotune() -> None:
    """Forget every configuration the project's autotuners chose, so the next launch tunes on its own input."""
    for tuner in _autotuners().values():
        tuner.cache.clear()


def chosen_configs() -> dict[str, str]:
    """The configuration each autotuned kernel last chose."""
    return {name: str(t.best_config) for name, t in _autotuners().items() if getattr(t, "best_config", None)}


def grouped_inputs(rows_per_expert: int, dist: str, proj: str, *, device: str, dtype=torch.bfloat16,
                   num_experts: int = LOCAL_EXPERTS, hidden: int = HIDDEN, ffn: int = FFN, seed: int = 0):
    K, N = projections(hidden, ffn)[proj]
    counts = expert_counts(rows_per_expert, dist, num_experts)
    M = sum(counts)
    gen = torch.Generator(device=device).manual_seed(seed)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=device, dtype=dtype, generator=gen)
    w = (torch.randn(num_experts, K, N, device=device, generator=gen) / K**0.5).to(dtype)
    dy = torch.randn(M, N, device=device, dtype=dtype, generator=gen)
    return x, w, dy, offsets


def ours(op, x, w, dy, offsets, dw_variant=None):
    """Our kernel for ``op`` (forward and dX choose their variant; dW takes ``dw_variant``, None: the default)."""
    return {"forward": lambda: grouped_mm_triton(x, w, offsets, check_values=False),
            "dx": lambda: grouped_mm_triton(dy, w.transpose(1, 2), offsets, check_values=False),
            "dw": lambda: grouped_mm_dw_triton(x, dy, offsets, check_values=False, variant=dw_variant)}[op]


# Our implementations: the default kernels, and the persistent (TMA) dW variant, opt-in until a GPU run shows it
# faster (kernels/grouped_gemm.py, choose_dw_variant).
OURS = {"feplb": None, "feplb_dw_persistent": "persistent"}


def twin(op, x, w, dy, offsets):
    """The pure-torch twin of our kernel (per-group matmuls)."""
    return {"forward": lambda: grouped_mm_ref(x, w, offsets),
            "dx": lambda: grouped_mm_ref(dy, w.transpose(1, 2), offsets),
            "dw": lambda: grouped_mm_dw_ref(x, dy, offsets)}[op]


def torch_grouped(op, x, w, dy, offsets):
    def call(*args):
        if not hasattr(torch, "_grouped_mm"):
            raise BaselineUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
        try:
            return torch._grouped_mm(*args, offs=offsets)
        except RuntimeError as err:  # e.g. unsupported on this GPU or for this layout
            raise BaselineUnavailable(f"torch._grouped_mm: {str(err).splitlines()[0]}") from err

    return {"forward": lambda: call(x, w), "dx": lambda: call(dy, w.transpose(1, 2)),
            "dw": lambda: call(x.t(), dy)}[op]


def dense(op, x, w, dy, offsets):
    # One matmul with the same FLOPs (2 * M * K * N) and shapes: the ceiling a grouped GEMM can approach.
    w0 = w[0]
    return {"forward": lambda: x @ w0, "dx": lambda: dy @ w0.t(), "dw": lambda: x.t() @ dy}[op]


def reference(op, x, w, dy, offsets) -> tuple[torch.Tensor, str]:
    """(expected result of the grouped op, its source): torch._grouped_mm, or the twin when that cannot run."""
    try:
        return torch_grouped(op, x, w, dy, offsets)(), "torch._grouped_mm"
    except BaselineUnavailable as why:
        return twin(op, x, w, dy, offsets)(), f"twin ({why})"


def check_grouped(impl: str, op: str, x, w, dy, offsets):
    """Run ``impl`` once on this input and check its values; return its function (for timing) and what checked it.

    Ours and torch._grouped_mm against the reference (the other of the two when one cannot run: the twin); the
    dense matmul against an fp32 matmul of a 128-wide slice, norm-wise (``DENSE_REL_TOL``).
    """
    if impl == "dense":
        fn = dense(op, x, w, dy, offsets)
        got, w0 = fn(), w[0].float()
        expected = {"forward": lambda: x[:128].float() @ w0, "dx": lambda: dy[:128].float() @ w0.t(),
                    "dw": lambda: x[:, :128].t().float() @ dy.float()}[op]()
        got = got[:128].float()
        assert got.shape == expected.shape, f"dense {op}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        rel = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
        assert rel <= DENSE_REL_TOL, f"dense {op}: relative error {rel:.3g} > {DENSE_REL_TOL} (norm-wise)"
        return fn, "fp32 matmul (128-wide slice, norm-wise)"
    if impl == "torch_grouped_mm":
        fn = torch_grouped(op, x, w, dy, offsets)
        got = fn()  # BaselineUnavailable propagates: the caller skips this baseline
        torch.testing.assert_close(got.float(), twin(op, x, w, dy, offsets)().float(), **BF16_TOL)
        return fn, "twin"
    if impl not in OURS:
        raise ValueError(f"impl: expected one of {[*OURS, 'torch_grouped_mm', 'dense']}, got {impl!r}")
    fn = ours(op, x, w, dy, offsets, dw_variant=OURS[impl])
    got = fn()
    expected, source = reference(op, x, w, dy, offsets)
    torch.testing.assert_close(got.float(), expected.float(), **BF16_TOL)
    return fn, source


def permute_case(rows_per_expert: int, dist: str, impl: str, *, device: str, num_experts: int = LOCAL_EXPERTS,
                 top_k: int = TOP_K, hidden: int = HIDDEN, seed: int = 0):
    """Build one permute / unpermute / copy case, run it once and check its values; return (fn, bytes moved,
    tokens). Routing from ids drawn with the expert popularity of ``dist``, checked against the twin too."""
    counts = expert_counts(rows_per_expert, dist, num_experts)
    T = sum(counts) // top_k
    gen = torch.Generator(device=device).manual_seed(seed)
    # Each token picks top_k distinct local experts, with the expert popularity of `dist`.
    popularity = torch.tensor(counts, dtype=torch.float32, device=device)
    ids = torch.multinomial(popularity.expand(T, -1), top_k, replacement=False, generator=gen).to(torch.int32)
    routing = routing_metadata_triton(ids, num_experts)
    for name, got, want in zip(("counts", "offsets", "src", "dst"), routing, routing_metadata_ref(ids, num_experts),
                               strict=True):
        assert torch.equal(got, want), f"routing {name} differs from the twin"
    _, _, src, dst = routing
    x = torch.randn(T, hidden, device=device, generator=gen).to(torch.bfloat16)
    y = torch.randn(T * top_k, hidden, device=device, generator=gen).to(torch.bfloat16)
    weights = torch.rand(T, top_k, device=device, generator=gen)
    copy_out = torch.empty_like(y)
    row_bytes = hidden * y.element_size()
    if impl == "permute":
        # the bytes it must move: T distinct rows read (each read for its K copies), T x K written
        fn, nbytes = (lambda: permute_triton(x, src, dst)), (T + T * top_k) * row_bytes
        assert torch.equal(fn(), permute_ref(x, src, dst)), "permute differs from its twin"
    elif impl == "unpermute":
        fn, nbytes = (lambda: unpermute_triton(y, src, dst, weights)), (T * top_k + T) * row_bytes
        torch.testing.assert_close(fn(), unpermute_ref(y, src, dst, weights), **BF16_TOL)
    elif impl == "copy":
        fn, nbytes = (lambda: copy_out.copy_(y)), 2 * T * top_k * row_bytes
        assert torch.equal(fn(), y), "device copy differs from its source"
    else:
        raise ValueError(f"impl: expected permute, unpermute or copy, got {impl!r}")
    return fn, nbytes, T


def measure(timer, impl: str, fn, row: dict, record):
    """Time ``fn`` with ``timer``; ours propagates any failure (after ``record``-ing the row with its error), a
    baseline that raises is recorded and skipped."""
    try:
        return timer(fn)
    except Exception as err:
        row["error"] = error_line(err)
        record(row)
        if impl == "feplb":
            raise
        if isinstance(err, (RuntimeError, BaselineUnavailable)):
            pytest.skip(f"{impl} unavailable: {row['error']}")
        raise


# ---------------------------------------------------------------------------------------------------- CPU

smoke = pytest.mark.skipif(CUDA or not (HAVE_TRITON and INTERPRET), reason="CPU interpreter smoke run")
TINY = dict(num_experts=4, hidden=32, ffn=24)


@smoke
@pytest.mark.parametrize("impl", ["feplb", "torch_grouped_mm", "dense"])
@pytest.mark.parametrize("op", OPS)
def test_grouped_mm_smoke(benchmark, op, impl):
    x, w, dy, offsets = grouped_inputs(8, "zipf", "gate_up", device="cpu", dtype=torch.float32, **TINY)
    try:
        fn, _ = check_grouped(impl, op, x, w, dy, offsets)
    except BaselineUnavailable as why:
        pytest.skip(str(why))
    benchmark.group = "interpreter smoke"
    assert torch.isfinite(benchmark(fn)).all()


@smoke
def test_persistent_dw_smoke(benchmark):
    x, w, dy, offsets = grouped_inputs(8, "zipf", "gate_up", device="cpu", dtype=torch.float32, **TINY)
    fn, _ = check_grouped("feplb_dw_persistent", "dw", x, w, dy, offsets)
    benchmark.group = "interpreter smoke"
    assert torch.isfinite(benchmark(fn)).all()


@smoke
@pytest.mark.parametrize("impl", ["permute", "unpermute", "copy"])
def test_permute_smoke(benchmark, impl):
    fn, nbytes, T = permute_case(8, "zipf", impl, device="cpu", num_experts=4, top_k=2, hidden=64)
    # the bytes each must move (bf16 rows of 64): permute reads T rows and writes T x K, unpermute reads T x K and
    # writes T, the copy reads and writes T x K
    rows = {"permute": T + 2 * T, "unpermute": 2 * T + T, "copy": 2 * 2 * T}[impl]
    assert T == 16 and nbytes == rows * 64 * 2, (impl, nbytes)
    benchmark.group = "interpreter smoke"
    benchmark(fn)


@smoke
def test_routing_permute_swiglu_smoke(benchmark):
    ids = torch.rand(16, 4).topk(2, dim=1).indices
    x, weights = torch.randn(16, 64), torch.rand(16, 2)

    def step():
        _, _, src, dst = routing_metadata_triton(ids, 4)
        x_MD = permute_triton(x, src, dst)
        return unpermute_triton(glu_triton(x_MD).repeat(1, 2).contiguous(), src, dst, weights)

    benchmark.group = "interpreter smoke"
    assert torch.isfinite(benchmark(step)).all()


def test_our_kernel_failing_fails_and_a_baseline_failing_skips():
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    results: list[dict] = []
    with pytest.raises(RuntimeError, match="illegal memory access"):
        measure(lambda fn: fn(), "feplb", broken, {"impl": "feplb"}, results.append)
    with pytest.raises(pytest.skip.Exception, match="torch_grouped_mm unavailable"):
        measure(lambda fn: fn(), "torch_grouped_mm", broken, {"impl": "torch_grouped_mm"}, results.append)
    assert [r["impl"] for r in results] == ["feplb", "torch_grouped_mm"]
    assert all("illegal memory access" in r["error"] for r in results)
    assert measure(lambda fn: 0.25, "feplb", broken, {}, results.append) == 0.25


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_fresh_autotune_forgets_every_choice():
    tuners = _autotuners()
    assert {name.split(".")[0] for name in tuners} >= {"grouped_gemm", "permutation"}, sorted(tuners)
    for tuner in tuners.values():
        tuner.cache[("made-up key",)] = "made-up config"
    fresh_autotune()
    assert all(not tuner.cache for tuner in tuners.values())


def test_results_are_written_after_every_row(tmp_path, monkeypatch):
    out = tmp_path / "kernels.json"
    monkeypatch.setenv("FEPLB_BENCH_KERNELS_JSON", str(out))
    monkeypatch.setitem(globals(), "RESULTS", [])
    record({"bench": "permute", "impl": "copy", "gbps": 1.0})
    record({"bench": "permute", "impl": "permute", "error": "RuntimeError: boom"})
    doc = json.loads(out.read_text())
    assert [r["impl"] for r in doc["results"]] == ["copy", "permute"]
    assert {"device", "torch", "triton", "cuda", "command", "shape"} <= set(doc["meta"])
    assert os.listdir(tmp_path) == ["kernels.json"]         # no temporary file left


@pytest.mark.parametrize("op", OPS)
def test_ours_is_checked_against_the_twin_when_grouped_mm_raises(monkeypatch, op):
    x, w, dy, offsets = grouped_inputs(4, "zipf", "down", device="cpu", dtype=torch.float32, **TINY)

    def unsupported(*args, **kwargs):
        raise RuntimeError("grouped gemm is only supported on SM90")

    monkeypatch.setattr(torch, "_grouped_mm", unsupported, raising=False)
    expected, source = reference(op, x, w, dy, offsets)
    assert source.startswith("twin") and "only supported on SM90" in source
    torch.testing.assert_close(expected, twin(op, x, w, dy, offsets)())
    # A wrong result of ours is caught by that twin: a kernel that returns zeros fails the check.
    monkeypatch.setitem(globals(), "ours", lambda *a, **kw: (lambda: torch.zeros_like(expected)))
    with pytest.raises(AssertionError):
        check_grouped("feplb", op, x, w, dy, offsets)


def test_cuda_timer_times_the_gpu_behind_a_sleep(monkeypatch):
    """The GPU timer's order on stand-ins: per round a GPU sleep, the start event, INNER calls, the end event, one
    sync; GPU time from the events (medians, warm-up dropped), host time from the issue loop."""
    order: list = []
    elapsed = iter([99.0, 2.0, 3.0, 1.0, 5.0, 4.0, 6.0])     # ms per round of INNER calls; the first is warm-up

    made = []

    class Event:                                             # made in pairs: start, end
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.name = ("start", "end")[len(made) % 2]
            made.append(self)

        def record(self):
            order.append(self.name)

        def elapsed_time(self, end):
            return next(elapsed)

    class Bench:
        def pedantic(self, run, rounds, iterations, warmup_rounds):
            assert iterations == 1
            for _ in range(rounds + warmup_rounds):
                run()

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append("sleep"), raising=False)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: order.append("sync"))
    t = _cuda_timer(Bench())(lambda: order.append("call"))
    first_round = ["sleep", "start"] + ["call"] * INNER + ["end", "sync"]
    assert order == ["call", "sync"] + first_round * (ROUNDS + 1)
    disabled = Bench()
    disabled.disabled = True
    disabled.pedantic = None                                 # never called when benchmarking is disabled
    order.clear()
    elapsed = iter([99.0, 2.0, 3.0, 1.0, 5.0, 4.0, 6.0])
    assert _cuda_timer(disabled)(lambda: order.append("call"))["gpu_s"] == pytest.approx(3.5e-3 / INNER)
    assert order == ["call", "sync"] + first_round * (ROUNDS + 1)
    assert t["gpu_s"] == pytest.approx(3.5e-3 / INNER) and 0 < t["host_s"] < 1e-3
    row = timed_row({"gpu_s": 2e-5, "host_s": 5e-5})
    assert row == {"us": pytest.approx(20.0), "host_us": pytest.approx(50.0), "launch_bound": True}
    assert not timed_row({"gpu_s": 2e-3, "host_s": 5e-5})["launch_bound"]


@pytest.mark.parametrize("op", OPS)
def test_dense_check_is_norm_wise(monkeypatch, op):
    """The dense baseline's check passes an error an element-wise bound rejects (one element near zero off by the
    rounding of a long bf16 reduction) and fails a result 5% off."""
    x, w, dy, offsets = grouped_inputs(512, "uniform", "down", device="cpu", dtype=torch.bfloat16, **TINY)
    exact = dense(op, x.float(), w.float(), dy.float(), offsets)()

    def near_zero_off():
        got = exact.clone()
        i = got[:128].abs().argmin()
        got.view(-1)[i] += 0.01 * got[:128].abs().max()
        return got.to(torch.bfloat16)

    monkeypatch.setitem(globals(), "dense", lambda *a: near_zero_off)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(near_zero_off()[:128].float(), exact[:128], **BF16_TOL)
    assert check_grouped("dense", op, x, w, dy, offsets)[1].endswith("norm-wise)")
    monkeypatch.setitem(globals(), "dense", lambda *a: (lambda: (exact * 1.05).to(torch.bfloat16)))
    with pytest.raises(AssertionError, match=f"dense {op}: relative error"):
        check_grouped("dense", op, x, w, dy, offsets)


# ---------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
RESULTS: list[dict] = []


def record(row: dict) -> None:
    """Keep a result row and rewrite the JSON at once, so a run stopped at its time limit keeps what it measured."""
    RESULTS.append(row)
    out = os.environ.get("FEPLB_BENCH_KERNELS_JSON", "runs/bench_kernels.json")
    import triton

    meta = {"device": torch.cuda.get_device_name() if CUDA else platform.processor() or platform.machine(),
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "command": " ".join(sys.argv),
            "shape": {"hidden": HIDDEN, "ffn": FFN, "local_experts": LOCAL_EXPERTS, "top_k": TOP_K,
                      "dtype": "bfloat16"}}
    write_json(out, {"meta": meta, "results": RESULTS})


# GPU sleep queued before each timed round (~2 ms on an H200's ~2 GHz clock): longer than the host needs to issue
# INNER calls of ours (about 40 to 65 us each on the first H200 run), so the events time no launch gap.
SLEEP_CYCLES = 4_000_000
INNER, ROUNDS = 10, 6


def _cuda_timer(benchmark, inner: int = INNER, rounds: int = ROUNDS):
    """Per call of a CUDA function: {"gpu_s", "host_s"} (medians over ``rounds``, one warm-up round dropped).

    Each round queues a GPU sleep, then ``inner`` calls between two CUDA events, then syncs: the host's launches
    run ahead while the GPU sleeps, so the events time the GPU's work without launch gaps; the host's wall time to
    issue the ``inner`` calls is the launch cost. pytest-benchmark records the rounds' wall time beside."""
    def timer(fn) -> dict[str, float]:
        gpu, host = [], []

        def run():
            torch.cuda._sleep(SLEEP_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            host.append((time.perf_counter() - t0) / inner)
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) / 1e3 / inner)

        fn()
        torch.cuda.synchronize()
        if getattr(benchmark, "disabled", False):   # --benchmark-disable runs pedantic's function once
            for _ in range(rounds + 1):
                run()
        else:
            benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
        if len(gpu) != rounds + 1:
            raise RuntimeError(f"timer: {len(gpu)} rounds ran, expected {rounds} and a warm-up")
        return {"gpu_s": statistics.median(gpu[1:]), "host_s": statistics.median(host[1:])}

    return timer


def timed_row(t: dict[str, float]) -> dict:
    """The timer's result as a result row's fields: ``us`` (GPU), ``host_us``, ``launch_bound``."""
    return {"us": t["gpu_s"] * 1e6, "host_us": t["host_s"] * 1e6, "launch_bound": t["host_s"] > t["gpu_s"]}


# The permute cases run first and the grouped GEMM cases from the largest rows per expert down: the cases the
# targets need most (>= 1024 rows per expert for 650 TFLOP/s) come before any a time limit may cut.
@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["permute", "unpermute", "copy"])
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("rows_per_expert", ROWS_PER_EXPERT)
def test_permute_bandwidth(benchmark, rows_per_expert, dist, impl):
    row = {"bench": "permute", "impl": impl, "dist": dist, "rows_per_expert": rows_per_expert, "K": TOP_K,
           "D": HIDDEN}
    if impl != "copy":
        fresh_autotune()
    try:
        fn, nbytes, T = permute_case(rows_per_expert, dist, impl, device="cuda")
    except Exception as err:
        record({**row, "error": error_line(err)})
        raise
    row.update(T=T, bytes=nbytes)
    benchmark.group = f"permute {dist} {rows_per_expert}/expert"
    t = measure(_cuda_timer(benchmark), "feplb" if impl != "copy" else impl, fn, row, record)
    row.update(timed_row(t), gbps=nbytes / t["gpu_s"] / 1e9)
    benchmark.extra_info.update(row)
    record(row)


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["feplb", "torch_grouped_mm", "dense"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("proj", list(projections()))
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("rows_per_expert", ROWS_PER_EXPERT)
def test_grouped_mm_tflops(benchmark, rows_per_expert, dist, proj, op, impl):
    x, w, dy, offsets = grouped_inputs(rows_per_expert, dist, proj, device="cuda")
    row = {"bench": "grouped_mm", "proj": proj, "op": op, "dist": dist, "rows_per_expert": rows_per_expert,
           "impl": impl, "M": x.shape[0], "K": x.shape[1], "N": w.shape[2]}
    if impl in OURS:
        fresh_autotune()
    try:
        fn, row["checked_against"] = check_grouped(impl, op, x, w, dy, offsets)
    except BaselineUnavailable as why:
        record({**row, "error": str(why)})
        pytest.skip(str(why))
    except Exception as err:
        record({**row, "error": error_line(err)})
        raise
    if impl in OURS:
        row["configs"] = chosen_configs()
    benchmark.group = f"grouped_mm {proj} {op} {dist} {rows_per_expert}/expert"
    t = measure(_cuda_timer(benchmark), "feplb" if impl in OURS else impl, fn, row, record)
    flops = 2.0 * x.shape[0] * x.shape[1] * w.shape[2]
    row.update(timed_row(t), tflops=flops / t["gpu_s"] / 1e12)
    benchmark.extra_info.update(row)
    record(row)


# After every case above, so a time limit can cut these and never the default kernels' cases: the persistent
# dW variant on the same inputs, beside the default dW and torch._grouped_mm of the same run.
@gpu
@needs_cuda
@pytest.mark.parametrize("proj", list(projections()))
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("rows_per_expert", ROWS_PER_EXPERT)
def test_grouped_mm_dw_persistent_tflops(benchmark, rows_per_expert, dist, proj):
    test_grouped_mm_tflops(benchmark, rows_per_expert, dist, proj, "dw", "feplb_dw_persistent")
