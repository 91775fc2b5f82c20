"""Is balancing nearly free on one GPU? The static experts' GEMM next to what FEPLB runs beside it, timed together.

From one real micro-batch (ESFT routing trace, DeepSeek-V2-Lite layer: 64 experts, top-6, H = 2048, F = 1408,
EP = 8 in one node, 2048 tokens per GPU, 4 dynamic experts per GPU, ``feplb-split``), take the busiest GPU: its
static experts' grouped GEMM (gate/up, SwiGLU, down, bf16, ``feplb.kernels``) and the bytes its plan sends out
(rows, and weights unless resident). The GEMM's output is first checked against a per-expert fp32 reference. Then,
in one run, with the four cases interleaved iteration by iteration so that drift hits them alike:

* ``static_gemm_ms``: the static GEMM alone (CUDA events, median of ``ITERS``);
* ``gemm_with_plan_ms``: the same while a CPU thread runs ``feplb.sched.make_plan`` on the micro-batch's counts,
  started once the GEMM is queued, the layer's order on a GPU (``plan_us_p50`` / ``plan_us_p99``: that thread's
  wall time);
* ``gemm_with_plan_first_ms``: the same with the planner thread started before the GEMM is launched (the layer's
  order before 2026-12-01): the planner holds the GIL while it plans, so the GEMM's launches can wait for it; the
  first H200 run measured this order only (``plan_thread_slowdown_pct`` 12.0% then);
* ``gemm_with_h2d_ms``: the same while a side stream copies the plan's bytes from pinned host memory (a copy
  engine, the stand-in for a peer copy on a one-GPU machine);
* ``gemm_with_d2d_ms``: the same while a side stream copies them device to device (on one GPU that copy runs on
  SMs; the design notes measured ~20% slowdown, which is why FEPLB copies between GPUs);
* ``copy_ms_h2d``: the pinned host-to-device copy of the plan's bytes alone (PCIe).

What one GPU measures, and what it cannot (the targets' "phase-2 copies run beside the static experts' GEMM, not
after it" and "copies a plan issues slow concurrent expert GEMMs by <= 1%"):

* ``plan_hidden``: the host's issue of the static GEMM (``static_gemm_launch_us``; the layer starts planning after
  it on a GPU) plus the planner thread's time (``plan_us_p50``, measured while the GEMM runs) fit inside the static
  GEMM: ``static_gemm_launch_us + plan_us_p50 <= static_gemm_ms``. Measured, decided here. (``gemm_with_plan_ms``
  is then a control: the GEMM is wholly queued before the planner starts, so it should not slow down.)
* ``copy_engine_slowdown_pct``: how much a copy-engine copy (pinned host to device, the engine peer copies use)
  slows the GEMM. Measured, decided here.
* ``copy_fits_h2d``: ``static_gemm_launch_us + plan_us_p50 + copy_ms_h2d <= static_gemm_ms`` with the plan's
  bytes copied host to device over PCIe (``copy_ms_h2d``, measured). A real node copies them GPU to GPU over
  NVLink, which one GPU cannot measure; PCIe is the slower link, so True decides that the copies fit, while False
  decides nothing (the report then says NOT RUN). ``copy_ms_nvlink_modelled`` is the cost model's NVLink time for
  the same bytes: a model, shown beside, never a verdict.

Asserted: the GEMM is correct, and a copy-engine copy slows it by at most ``COPY_ENGINE_SLOWDOWN_MAX_PCT``. Results
go to ``$FEPLB_BENCH_OVERLAP_JSON`` (default ``runs/bench_overlap.json``) with device and versions:
``.venv/bin/pytest bench/bench_overlap.py -m gpu -s``.

The trace is looked up in ``$FEPLB_TRACES``, then ``../shared/routing_traces`` next to the repository, then
``.traces/`` in it (where a machine without ``../shared`` gets a copy), each with the layout
``esft_deepseek_v2_lite/esft_vanilla_lite_law.npz``. The CPU part (CI) checks the workload extraction; it times
nothing.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from feplb.files import write_json
from feplb.sched import CostModel, PolicyState, Topology, make_plan

ROOT = Path(__file__).resolve().parents[1]
TRACE_REL = Path("esft_deepseek_v2_lite") / "esft_vanilla_lite_law.npz"
HIDDEN, FFN, EP, TOKENS, DYN, POLICY = 2048, 1408, 8, 2048, 4, "feplb-split"
ITERS, WARMUP = 40, 3
LAUNCH_SLEEP_CYCLES = 2_000_000   # ~1 ms of GPU sleep queued before the static GEMM's issue is timed
# Targets (design notes): copies a plan issues slow concurrent expert GEMMs by <= 1%; a pinned copy beside a long
# GEMM loop measured ~0.5%. One sub-millisecond GEMM timed by events jitters by a few percent, so the assertion
# allows 5% (the JSON reports the measured value against the 1% target).
COPY_ENGINE_SLOWDOWN_MAX_PCT = 5.0
CUDA = torch.cuda.is_available()


def trace_candidates() -> list[Path]:
    """Where the trace may be, in order: $FEPLB_TRACES, ../shared/routing_traces, .traces/ in the repository."""
    roots = [Path(os.environ["FEPLB_TRACES"])] if os.environ.get("FEPLB_TRACES") else []
    roots += [ROOT.parent / "shared" / "routing_traces", ROOT / ".traces"]
    return [r / TRACE_REL for r in roots]


def find_trace() -> Path | None:
    return next((p for p in trace_candidates() if p.is_file()), None)


def _no_trace() -> str:
    return "routing trace not found; looked at " + ", ".join(str(p) for p in trace_candidates())


def workload(trace_path: Path, tokens: int = TOKENS, seed: int = 0) -> dict:
    """One micro-batch of the trace: the busiest GPU's static rows per expert, its outgoing copy bytes, the plan."""
    from feplb.traces import load_trace

    trace = load_trace(trace_path)
    E = trace.num_experts
    counts_LWE = next(trace.microbatches(np.random.default_rng(seed), EP, tokens))
    topo = Topology(num_ranks=EP, gpus_per_node=EP, num_experts=E, dyn=DYN)
    # the layer with the largest straggler under plain EP: where balancing has work to do
    loads = counts_LWE.sum(axis=1).reshape(counts_LWE.shape[0], EP, -1).sum(axis=2)
    layer = int(np.argmax(loads.max(axis=1) - loads.mean(axis=1)))
    counts_WE = np.ascontiguousarray(counts_LWE[layer])
    state = PolicyState(topo=topo, policy=POLICY)
    plan = make_plan(POLICY, counts_WE, topo, state)
    n_E = counts_WE.sum(axis=0)
    gpu = int(np.argmax(plan.loads_before_W))
    L = E // EP
    dyn = {int(e) for e in plan.dynamic_WD[gpu]}
    static_rows = [int(n_E[e]) if e not in dyn else 0 for e in range(gpu * L, (gpu + 1) * L)]
    elem = 2
    row_bytes = HIDDEN * elem
    w_bytes = 3 * HIDDEN * FFN * elem
    out_rows = sum(m.rows for m in plan.moves if m.src == gpu)
    out_weights = sum(1 for e, s, _ in plan.weight_copies if s == gpu)
    return {"layer": layer, "gpu": gpu, "counts_WE": counts_WE, "topo": topo, "state": state,
            "static_rows": static_rows, "copy_bytes": out_rows * row_bytes + out_weights * w_bytes,
            "rows_out": out_rows, "weights_out": out_weights, "loads_before": plan.loads_before_W.tolist(),
            "loads_after": plan.loads_after_W.tolist()}


def test_workload_extraction_cpu():
    """CI: the workload the GPU benchmark times can be built (trace present, plan valid, busiest GPU sends)."""
    path = find_trace()
    if path is None:
        pytest.skip(_no_trace())
    w = workload(path, tokens=256)
    assert sum(w["static_rows"]) > 0 and len(w["static_rows"]) == w["topo"].experts_per_rank
    assert w["loads_before"][w["gpu"]] == max(w["loads_before"])
    assert max(w["loads_after"]) <= max(w["loads_before"])
    assert sum(w["loads_after"]) == sum(w["loads_before"]) == 256 * EP * 6, "every row computed exactly once"
    assert w["rows_out"] > 0
    assert w["copy_bytes"] == w["rows_out"] * HIDDEN * 2 + w["weights_out"] * 3 * HIDDEN * FFN * 2


def test_trace_lookup_order(tmp_path, monkeypatch):
    """$FEPLB_TRACES first, then ../shared, then .traces/ in the repository: a machine without ../shared finds the
    copy the GPU check puts in .traces/."""
    monkeypatch.setenv("FEPLB_TRACES", str(tmp_path))
    got = trace_candidates()
    assert got == [tmp_path / TRACE_REL, ROOT.parent / "shared" / "routing_traces" / TRACE_REL,
                   ROOT / ".traces" / TRACE_REL]
    (tmp_path / TRACE_REL).parent.mkdir(parents=True)
    (tmp_path / TRACE_REL).write_bytes(b"")
    assert find_trace() == tmp_path / TRACE_REL
    monkeypatch.delenv("FEPLB_TRACES")
    assert trace_candidates()[0] == ROOT.parent / "shared" / "routing_traces" / TRACE_REL


LAUNCHES, GIL_ROUNDS = 40, 200


def test_planner_thread_and_launches_cpu(benchmark):
    """Host side only (CPU, any machine; never a GPU figure): how long the main thread takes to issue LAUNCHES tiny
    torch ops (the host's part of queueing a static GEMM's kernels) alone, with the planner thread handed a plan
    just before (the layer's order on a GPU until 2026-12-01) and just after (its order since). The planner holds
    the GIL while it plans, so issued first it delays the launches; both orders plan the same."""
    import concurrent.futures

    from feplb.traces import SyntheticWorkload

    path = find_trace()
    if path is not None:
        w = workload(path, tokens=TOKENS)
        counts, topo, state = [w["counts_WE"]], w["topo"], w["state"]
    else:   # the trace's shape (64 experts, top-6, EP 8) with synthetic Zipf counts
        topo = Topology(num_ranks=EP, gpus_per_node=EP, num_experts=64, dyn=DYN)
        gen = SyntheticWorkload(kind="zipf", num_experts=64, top_k=6, num_layers=1, alpha=1.0, drift=0.1,
                                seed=0).microbatches(np.random.default_rng(0), EP, TOKENS)
        counts, state = [next(gen)[0] for _ in range(8)], PolicyState(topo=topo, policy=POLICY)
    t = torch.zeros(1)

    def issue() -> float:
        t0 = time.perf_counter()
        for _ in range(LAUNCHES):
            t.add_(1)
        return (time.perf_counter() - t0) * 1e6

    def plan(c):
        t0 = time.perf_counter()
        return make_plan(POLICY, c, topo, state), (time.perf_counter() - t0) * 1e6

    got = {"alone": [], "plan_first": [], "plan_after": []}
    plan_us = {"plan_first": [], "plan_after": []}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as planner:
        planner.submit(plan, counts[0]).result()    # the thread exists and numpy is warm
        for i in range(GIL_ROUNDS):
            c = counts[i % len(counts)]
            got["alone"].append(issue())
            f = planner.submit(plan, c)
            got["plan_first"].append(issue())
            first, us = f.result()
            plan_us["plan_first"].append(us)
            got["plan_after"].append(issue())
            after, us = planner.submit(plan, c).result()
            plan_us["plan_after"].append(us)
            assert first.moves == after.moves and first.weight_copies == after.weight_copies
    info = {f"issue_{k}_us_p50": float(np.percentile(v, 50)) for k, v in got.items()}
    info.update({f"{k}_plan_us_p50": float(np.percentile(v, 50)) for k, v in plan_us.items()},
                launches=LAUNCHES, rounds=GIL_ROUNDS, workload="ESFT trace" if path is not None else "synthetic zipf",
                what="host-side CPU times of issuing tiny torch ops beside the planner thread; not GPU times")
    benchmark.extra_info.update(info)
    benchmark.pedantic(issue, rounds=3, iterations=1)
    print(f"\n[CPU, host side] issuing {LAUNCHES} tiny torch ops: alone {info['issue_alone_us_p50']:.0f} us, "
          f"planner handed a plan just before {info['issue_plan_first_us_p50']:.0f} us, just after "
          f"{info['issue_plan_after_us_p50']:.0f} us (plan {info['plan_after_plan_us_p50']:.0f} us)")
    assert all(v > 0 and math.isfinite(v) for v in info.values() if isinstance(v, float)), info


def overlap_verdicts(static_gemm_ms: float, plan_us_p50: float, copy_ms_h2d: float,
                     launch_us: float = 0.0) -> dict[str, bool]:
    """What the one-GPU times decide: ``plan_hidden`` (the host's issue of the static GEMM, after which the layer
    starts planning on a GPU, plus the planner thread's time fit inside the static GEMM) and ``copy_fits_h2d``
    (that plus the plan's bytes copied over PCIe fit inside it; PCIe is slower than the NVLink peer copy a node
    uses, so only True decides anything)."""
    plan_ms = (launch_us + plan_us_p50) / 1e3
    return {"plan_hidden": bool(plan_ms <= static_gemm_ms),
            "copy_fits_h2d": bool(plan_ms + copy_ms_h2d <= static_gemm_ms)}


def test_overlap_verdicts():
    """The verdicts compare measured times only: the plan against the GEMM, plan + PCIe copy against the GEMM."""
    assert overlap_verdicts(0.5, 80.0, 0.3) == {"plan_hidden": True, "copy_fits_h2d": True}
    assert overlap_verdicts(0.5, 80.0, 0.45) == {"plan_hidden": True, "copy_fits_h2d": False}
    assert overlap_verdicts(0.05, 80.0, 0.0) == {"plan_hidden": False, "copy_fits_h2d": False}
    # planning starts once the static GEMM is issued: the host's issue time counts against the window
    assert overlap_verdicts(0.5, 80.0, 0.3, launch_us=450.0) == {"plan_hidden": False, "copy_fits_h2d": False}
    assert overlap_verdicts(0.5, 80.0, 0.3, launch_us=100.0) == {"plan_hidden": True, "copy_fits_h2d": True}


def _gemm_reference(x_MH, w1_LH2F, w2_LFH, rows_L) -> torch.Tensor:
    """Per-expert fp32 matmuls with the kernel path's bf16 roundings (after each GEMM and after SwiGLU)."""
    out, start = [], 0
    for j, n in enumerate(rows_L):
        h = (x_MH[start:start + n].float() @ w1_LH2F[j].float()).to(x_MH.dtype).float()
        gate, up = h.chunk(2, dim=1)
        a = (torch.nn.functional.silu(gate) * up).to(x_MH.dtype).float()
        out.append(a @ w2_LFH[j].float())
        start += n
    return torch.cat(out)


def _timed_ms(fn, side=None, after=None) -> float:
    """One GEMM timed by CUDA events on the current stream: ``side()`` started just before it is launched, or
    ``after()`` once it is queued (its end event included), and joined after."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    join = side() if side is not None else None
    a.record()
    fn()
    b.record()
    if after is not None:
        join = after()
    if join is not None:
        join()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_overlap_gpu(benchmark):
    path = find_trace()
    if path is None:
        pytest.fail(_no_trace() + " (copy the trace to one of them)")
    from feplb.layer import expert_mlp

    w = workload(path)
    dev = torch.device("cuda")
    L = len(w["static_rows"])
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(sum(w["static_rows"]), HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
    w1 = torch.randn(L, HIDDEN, 2 * FFN, device=dev, dtype=torch.bfloat16, generator=gen) / HIDDEN ** 0.5
    w2 = torch.randn(L, FFN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) / FFN ** 0.5
    offs = torch.tensor(np.cumsum(w["static_rows"]), device=dev)

    # Correct before timed: a wrong (or empty) GEMM would make every number below meaningless.
    got = expert_mlp(x, (w1, w2), offs).float()
    want = _gemm_reference(x, w1, w2, w["static_rows"])
    scale = float(want.abs().max())
    max_err = float((got - want).abs().max())
    assert got.shape == want.shape and math.isfinite(max_err) and max_err <= 2e-2 * scale, (max_err, scale)

    nbytes = max(w["copy_bytes"], 1)
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src_dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    side_stream = torch.cuda.Stream()

    def gemm():
        expert_mlp(x, (w1, w2), offs)

    def copy_from(src):
        def start():
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                dst.copy_(src, non_blocking=True)
            return lambda: torch.cuda.current_stream().wait_stream(side_stream)
        return start

    plan_us: list[float] = []

    def planner():
        def run():
            t0 = time.perf_counter()
            make_plan(POLICY, w["counts_WE"], w["topo"], w["state"])
            plan_us.append((time.perf_counter() - t0) * 1e6)
        th = threading.Thread(target=run)
        th.start()
        return th.join

    # (side started before the GEMM's launch, or after it is queued)
    cases = {"static_gemm_ms": (None, None), "gemm_with_plan_ms": (None, planner),
             "gemm_with_plan_first_ms": (planner, None), "gemm_with_h2d_ms": (copy_from(host), None),
             "gemm_with_d2d_ms": (copy_from(src_dev), None)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    plans: dict[str, list[float]] = {"gemm_with_plan_ms": [], "gemm_with_plan_first_ms": []}
    for i in range(WARMUP + ITERS):
        for key, (side, after) in cases.items():
            n = len(plan_us)
            t = _timed_ms(gemm, side, after)
            if i >= WARMUP:
                times[key].append(t)
                if key in plans:
                    assert len(plan_us) == n + 1, f"{key}: the planner thread did not run once"
                    plans[key].append(plan_us[-1])
    plan_us = plans["gemm_with_plan_ms"]
    copy_times = []
    for _ in range(WARMUP + ITERS):
        copy_times.append(_timed_ms(lambda: dst.copy_(host, non_blocking=True)))
    dst_check = dst.cpu()
    assert torch.equal(dst_check, host), "the timed host-to-device copy delivered other bytes"

    # The host's time to issue the static GEMM (the GPU busy with a sleep, so no launch waits for it): on a GPU the
    # layer starts planning after it, so it counts against the window planning hides in.
    launch_us = []
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(WARMUP + ITERS):
        torch.cuda.synchronize()
        if sleep is not None:
            sleep(LAUNCH_SLEEP_CYCLES)
        t0 = time.perf_counter()
        gemm()
        launch_us.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    res = {k: statistics.median(v) for k, v in times.items()}
    res["static_gemm_launch_us"] = statistics.median(launch_us[WARMUP:])
    g = res["static_gemm_ms"]
    res.update(plan_us_p50=float(np.percentile(plan_us, 50)), plan_us_p99=float(np.percentile(plan_us, 99)),
               copy_ms_h2d=statistics.median(copy_times[WARMUP:]),
               copy_engine_slowdown_pct=100 * (res["gemm_with_h2d_ms"] / g - 1),
               sm_copy_slowdown_pct=100 * (res["gemm_with_d2d_ms"] / g - 1),
               plan_thread_slowdown_pct=100 * (res["gemm_with_plan_ms"] / g - 1),
               plan_first_slowdown_pct=100 * (res["gemm_with_plan_first_ms"] / g - 1),
               plan_first_us_p50=float(np.percentile(plans["gemm_with_plan_first_ms"], 50)))
    res.update(overlap_verdicts(g, res["plan_us_p50"], res["copy_ms_h2d"], res["static_gemm_launch_us"]))
    cost = CostModel()
    info = {**res, "copy_engine_slowdown_max_pct": COPY_ENGINE_SLOWDOWN_MAX_PCT, "copy_engine_target_pct": 1.0,
            "copy_ms_nvlink_modelled": cost.copy_us(w["copy_bytes"]) / 1e3,
            "gemm_max_abs_err": max_err, "gemm_out_max_abs": scale, "iters": ITERS,
            "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "command": " ".join(sys.argv), "trace": str(path), "layer": w["layer"], "gpu": w["gpu"],
            "static_rows": w["static_rows"], "copy_bytes": w["copy_bytes"], "rows_out": w["rows_out"],
            "weights_out": w["weights_out"], "loads_before": w["loads_before"], "loads_after": w["loads_after"]}
    write_json(os.environ.get("FEPLB_BENCH_OVERLAP_JSON", "runs/bench_overlap.json"), info)
    benchmark.extra_info.update(info)
    benchmark.pedantic(gemm, rounds=3, iterations=1)
    print(f"\n[GPU {info['device']}] static GEMM of GPU {w['gpu']} ({sum(w['static_rows'])} rows): {g:.3f} ms")
    for k in ("gemm_with_plan_ms", "gemm_with_plan_first_ms", "gemm_with_h2d_ms", "gemm_with_d2d_ms"):
        print(f"  {k:18s} {res[k]:.3f} ms ({100 * (res[k] / g - 1):+.1f}%)")
    print(f"  plan p50 {res['plan_us_p50']:.0f} us, p99 {res['plan_us_p99']:.0f} us; copies "
          f"{w['copy_bytes'] / 1e6:.1f} MB: {res['copy_ms_h2d']:.3f} ms measured host-to-device over PCIe "
          f"({info['copy_ms_nvlink_modelled']:.3f} ms modelled over NVLink, not a measurement)")
    print(f"  planning hidden (GEMM issue {res['static_gemm_launch_us']:.0f} us + plan p50 <= static GEMM): "
          f"{res['plan_hidden']}; issue + plan p50 + PCIe copy <= static "
          f"GEMM: {res['copy_fits_h2d']} (True decides the copies fit; False decides nothing on one GPU)")

    for k in ("static_gemm_ms", "gemm_with_plan_ms", "gemm_with_plan_first_ms", "gemm_with_h2d_ms",
              "gemm_with_d2d_ms", "copy_ms_h2d"):
        assert math.isfinite(res[k]) and res[k] > 0, (k, res[k])
    assert len(plan_us) == ITERS and res["plan_us_p50"] > 0
    assert res["copy_engine_slowdown_pct"] <= COPY_ENGINE_SLOWDOWN_MAX_PCT, \
        f"a copy-engine copy slowed the static GEMM by {res['copy_engine_slowdown_pct']:.1f}%"
