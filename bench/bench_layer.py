"""Forward + backward time of one MoELayer with balancing on vs off, measured in the same process group and run.

Variants: plain EP; ``feplb-split`` with resident replicas (weights once per step), over the default copy path
(shared memory on CPUs) and over gloo; ``feplb-split`` with the weights copied every micro-batch (``copy_bytes`` and
``weight_copies`` show the difference in traffic); ``feplb-split+place`` (placement from routing history, then
in-node balancing); ``eplb`` (redundant experts, rows dispatched straight to the replicas).

* ``test_layer_cpu_gloo``: 4 gloo processes on the CPU (2 nodes x 2 "GPUs"), a small layer (H=64, F=128, E=16,
  top-2, 256 tokens per rank) on skewed routing. CPU NUMBERS: they show the runtime's overhead and that the
  balanced layer computes the same thing; they say nothing about GPU speed or copy-engine overlap.
* ``test_layer_gpu_nccl``: the same on CUDA GPUs over NCCL (one rank per GPU, needs >= 2 GPUs), a GLM-5-like
  expert shape; skipped without them.

Each policy's iterations alternate inside one job (none, balanced, none, ...), each timed from a barrier to a
barrier and reduced as the max over ranks (the step waits for the slowest rank). Besides the skewed routing:

* every variant's output and input gradient on the same input, against plain EP's (``max_abs_diff_vs_plain``):
  balancing changes where a row is computed, never what;
* plain EP and ``feplb-split`` on perfectly balanced routing (``layer(x, routing=...)``, every GPU the same rows):
  what balancing costs when there is nothing to balance (``balanced_routing_overhead_pct``, target <= 2%);
* on CUDA, the host syncs of one training forward per variant (``torch.cuda.set_sync_debug_mode("warn")``, its
  warnings counted): the total of the forward, the counts all-gather's own sync included, since the public API
  cannot separate the steps (``host_syncs_counted`` says so in the JSON).

Results go to ``runs/bench_layer_cpu.json``, or for the GPU test to ``$FEPLB_BENCH_LAYER_JSON`` (default
``runs/bench_layer_gpu.json``), and to ``benchmark.extra_info``:
``.venv/bin/pytest bench/bench_layer.py -s -p no:randomly``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
import warnings
from pathlib import Path

import pytest
import torch

from feplb.testing import run_dist

SHAPES = {"cpu": dict(hidden=64, ffn=128, num_experts=16, top_k=2, tokens=256, gpus_per_node=2, world=4, iters=8),
          "gpu": dict(hidden=2048, ffn=1024, num_experts=32, top_k=4, tokens=4096, gpus_per_node=8, world=0, iters=20)}
BALANCED = "feplb-split"
# name -> (policy, weights mode, copy path)
VARIANTS = {"none": ("none", "per-step", "auto"), BALANCED: (BALANCED, "per-step", "auto"),
            f"{BALANCED}/gloo-copy": (BALANCED, "per-step", "gloo"),
            f"{BALANCED}/per-microbatch": (BALANCED, "per-microbatch", "auto"),
            f"{BALANCED}+place": (f"{BALANCED}+place", "per-step", "auto"),
            "eplb": ("eplb", "per-step", "auto")}


def _bench_worker(rank, world, shape, device):
    import numpy as np
    import torch.distributed as dist

    from feplb import FEPLBConfig, MoELayer

    s = dict(shape)
    tokens, iters = s.pop("tokens"), s.pop("iters")
    s.pop("world")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dev = torch.device("cpu") if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    layers = {}
    for name, (policy, weights, copy_path) in VARIANTS.items():
        if device != "cpu" and copy_path == "gloo":
            continue
        torch.manual_seed(0)
        layers[name] = MoELayer(FEPLBConfig(policy=policy, dyn=2, dtype=dtype, plan_wait_ms=50.0, min_straggler_rows=0,
                                            weights=weights, copy_path=copy_path, **s))
    gen = torch.Generator().manual_seed(1)
    router = torch.randn(s["num_experts"], s["hidden"], generator=gen) / s["hidden"] ** 0.5
    router[:, 0] = 0
    router[:3, 0] = torch.tensor([3.0, 2.0, 1.0])     # the first GPU's experts are hot
    for layer in layers.values():
        with torch.no_grad():
            layer.router.weight.copy_(router.to(dtype))
            layer.w1.copy_(layers["none"].w1)
            layer.w2.copy_(layers["none"].w2)
    x = torch.randn(tokens, s["hidden"], generator=torch.Generator().manual_seed(2 + rank)).to(dev, dtype)
    x[:, 0] = x[:, 0].abs() + 1
    for layer in layers.values():
        with torch.no_grad():
            layer(x)
        layer.refresh_replicas()
    def max_over_ranks(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def timed_ms(step) -> tuple[float, object]:
        """step() on every rank at once, fwd + bwd: (its time in ms, the slowest rank's), step's result."""
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return max_over_ranks(time.perf_counter() - t0) * 1e3, out

    times = {p: [] for p in layers}
    stats, outs = {}, {}
    for it in range(iters + 2):
        for policy, layer in layers.items():
            xi = x.clone().requires_grad_(True)

            def step(layer=layer, xi=xi):
                y = layer(xi)
                y.float().sum().backward()
                return y

            t, y = timed_ms(step)
            if it >= 2:
                times[policy].append(t)
            if it == 2:
                outs[policy] = (y.detach().float(), xi.grad.float())
            layer.reduce_replica_grads()
            layer.zero_grad()
            st = layer.last_stats
            stats[policy] = {"token_straggler_before": st.token_straggler_before,
                             "token_straggler_after": st.token_straggler_after, "rows_moved": st.rows_moved,
                             "fell_back": st.fell_back, "plan_us": st.plan_us, "copy_bytes": st.copy_bytes,
                             "weight_copies": st.weight_copies, "experts_placed": st.experts_placed}

    y0, g0 = outs["none"]
    scale = {"out": max_over_ranks(float(y0.abs().max())), "grad": max_over_ranks(float(g0.abs().max()))}
    diffs = {p: {"out": max_over_ranks(float((y - y0).abs().max())),
                 "grad": max_over_ranks(float((g - g0).abs().max()))} for p, (y, g) in outs.items()}

    # Perfectly balanced routing: token t's k-th choice is expert (t * K + k) mod E on every rank, so each expert,
    # and each GPU, receives the same rows: nothing to balance, and whatever balancing costs shows.
    T, K, E = tokens, s["top_k"], s["num_experts"]
    ids = ((torch.arange(T)[:, None] * K + torch.arange(K)[None, :]) % E).to(dev)
    gates = torch.full((T, K), 1.0 / K, device=dev, dtype=dtype)
    even = {p: layers[p] for p in ("none", BALANCED)}
    even_times = {p: [] for p in even}
    even_stats = {}
    for it in range(iters + 2):
        for policy, layer in even.items():
            xi = x.clone().requires_grad_(True)
            t, _ = timed_ms(lambda layer=layer, xi=xi: layer(xi, routing=(ids, gates)).float().sum().backward())
            if it >= 2:
                even_times[policy].append(t)
            layer.reduce_replica_grads()
            layer.zero_grad()
            st = layer.last_stats
            even_stats[policy] = {"token_straggler_before": st.token_straggler_before, "rows_moved": st.rows_moved}

    syncs = {}
    if dev.type == "cuda":
        for policy, layer in layers.items():
            xi = x.clone().requires_grad_(True)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    y = layer(xi)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs[policy] = sum("synchroniz" in str(w.message) for w in caught)
            y.float().sum().backward()
            layer.reduce_replica_grads()
            layer.zero_grad()

    return {"results": {p: {"median_ms": float(np.median(v)), "min_ms": float(np.min(v)), **stats[p],
                            "max_abs_diff_vs_plain": diffs[p]["out"], "max_abs_grad_diff_vs_plain": diffs[p]["grad"]}
                        for p, v in times.items()},
            "scale": scale,
            "balanced_routing": {p: {"median_ms": float(np.median(v)), **even_stats[p]}
                                 for p, v in even_times.items()},
            "host_syncs_per_forward": syncs}


def _report(benchmark, device, shape, out, path) -> dict:
    res, even = out["results"], out["balanced_routing"]
    none, bal = res["none"], res[BALANCED]
    info = {"device": device, "shape": shape, "results": res, "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "fwd_bwd_ms": {p: r["median_ms"] for p, r in res.items()},
            "balanced_over_none": bal["median_ms"] / none["median_ms"],
            "max_abs_diff_vs_plain": max(r["max_abs_diff_vs_plain"] for r in res.values()),
            "max_abs_grad_diff_vs_plain": max(r["max_abs_grad_diff_vs_plain"] for r in res.values()),
            "output_scale": out["scale"],
            "balanced_routing": even,
            "balanced_routing_overhead_pct": 100 * (even[BALANCED]["median_ms"] / even["none"]["median_ms"] - 1)}
    if device == "gpu":
        info.update(host_syncs_per_forward=out["host_syncs_per_forward"],
                    host_syncs_counted="every sync of one training forward (torch.cuda.set_sync_debug_mode), the "
                                       "counts all-gather's included",
                    gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1))
    benchmark.extra_info.update(info)
    print(f"\n[{device.upper()}] MoELayer fwd+bwd, median over iterations (max over ranks):")
    for p, r in res.items():
        print(f"  {p:28s} {r['median_ms']:8.2f} ms  token straggler {r['token_straggler_before']:.0f} -> "
              f"{r['token_straggler_after']:.0f}  rows moved {r['rows_moved']}  copy {r['copy_bytes'] / 1e6:.2f} MB "
              f"({r['weight_copies']} weight copies)  fell back {r['fell_back']}  "
              f"max |out - plain EP| {r['max_abs_diff_vs_plain']:.2e}")
    print(f"  balanced routing: plain EP {even['none']['median_ms']:.2f} ms, {BALANCED} "
          f"{even[BALANCED]['median_ms']:.2f} ms ({info['balanced_routing_overhead_pct']:+.1f}%)")
    if device == "gpu":
        print(f"  host syncs per forward: {info['host_syncs_per_forward']}")
    return info


def _check(info: dict, rel_tol: float) -> None:
    """What every run must show, CPU or GPU: the numbers exist next to plain EP's, balancing computes the same
    outputs and gradients, it balances skewed routing, and balanced routing leaves it nothing to move."""
    res, even = info["results"], info["balanced_routing"]
    for p, ms in info["fwd_bwd_ms"].items():
        assert math.isfinite(ms) and ms > 0, (p, ms)
    assert "none" in info["fwd_bwd_ms"] and BALANCED in info["fwd_bwd_ms"]
    for p, r in res.items():
        assert r["max_abs_diff_vs_plain"] <= rel_tol * info["output_scale"]["out"], (p, r)
        assert r["max_abs_grad_diff_vs_plain"] <= rel_tol * info["output_scale"]["grad"], (p, r)
    assert res[BALANCED]["rows_moved"] > 0 and not res[BALANCED]["fell_back"], res[BALANCED]
    assert res[BALANCED]["token_straggler_after"] < res[BALANCED]["token_straggler_before"]
    assert res["none"]["rows_moved"] == 0
    for p, r in even.items():
        assert r["token_straggler_before"] == 0 and r["rows_moved"] == 0, (p, r)
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0
    assert math.isfinite(info["balanced_routing_overhead_pct"])


@pytest.mark.dist
@pytest.mark.slow
def test_layer_cpu_gloo(benchmark):
    shape = SHAPES["cpu"]
    out = run_dist(_bench_worker, shape["world"], shape, "cpu", timeout_s=600)[0]
    info = _report(benchmark, "cpu", shape, out, "runs/bench_layer_cpu.json")
    # The timing itself is in extra_info; the fixture records the (cheap) report call so the JSON has an entry.
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    _check(info, rel_tol=1e-5)


@pytest.mark.gpu
@pytest.mark.dist
def test_layer_gpu_nccl(benchmark):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 CUDA GPUs (one NCCL rank per GPU)")
    shape = dict(SHAPES["gpu"])
    shape["world"] = torch.cuda.device_count()
    shape["gpus_per_node"] = min(shape["gpus_per_node"], shape["world"])
    out = run_dist(_bench_worker, shape["world"], shape, "gpu", timeout_s=600, backend="nccl")[0]
    info = _report(benchmark, "gpu", shape, out, os.environ.get("FEPLB_BENCH_LAYER_JSON", "runs/bench_layer_gpu.json"))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    # bf16: a row computed on another GPU may round differently (other tile shapes); 2% of the output's scale.
    _check(info, rel_tol=2e-2)
    assert set(info["host_syncs_per_forward"]) == set(info["fwd_bwd_ms"])
    assert all(isinstance(n, int) and n >= 0 for n in info["host_syncs_per_forward"].values())


# ------------------------------------------------------------------------------------------------ real routing
TRACE_POLICIES = ("none", "feplb", "feplb-split", "feplb-split+place", "eplb")
TRACE_SHAPE = dict(hidden=64, ffn=128, tokens=512, world=4, gpus_per_node=2, dyn=4, layers=(4, 14, 24), warmup=4,
                   measured=8)


def _trace_ids(trace, world: int, tokens: int, count: int, seed: int = 0):
    """``count`` micro-batches of real routing: int64 [W, S, L, K] each, every rank S consecutive tokens from a
    random sample start (as ``feplb.traces`` draws them for the simulator)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    starts = trace.sample_starts()
    step = np.arange(tokens, dtype=np.int64)
    for _ in range(count):
        first = starts[rng.integers(0, starts.size, size=world)]
        yield trace.topk_ids_TLK[(first[:, None] + step[None, :]) % trace.num_tokens]


def _trace_worker(rank, world, path, shape):
    import numpy as np

    from feplb import FEPLBConfig, MoELayer
    from feplb.traces import load_trace

    trace = load_trace(path)
    E, K = trace.num_experts, trace.top_k
    s = shape
    mbs = list(_trace_ids(trace, world, s["tokens"], s["warmup"] + s["measured"]))
    gen = torch.Generator().manual_seed(5)
    out = {}
    for layer_idx in s["layers"]:
        xs = [torch.randn(s["tokens"], s["hidden"], generator=gen) for _ in mbs]
        gates = [torch.rand(s["tokens"], K, generator=gen) + 0.1 for _ in mbs]
        ys = {}
        for policy in TRACE_POLICIES:
            torch.manual_seed(0)
            layer = MoELayer(FEPLBConfig(hidden=s["hidden"], ffn=s["ffn"], num_experts=E, top_k=K,
                                         gpus_per_node=s["gpus_per_node"], dyn=s["dyn"], policy=policy,
                                         weights="per-microbatch", refresh_every=2, plan_wait_ms=60_000.0,
                                         min_straggler_rows=0))
            before, after, moved, outs = [], [], [], []
            for i, ids_WSLK in enumerate(mbs):
                ids = torch.from_numpy(np.ascontiguousarray(ids_WSLK[rank, :, layer_idx, :])).long()
                with torch.no_grad():
                    y = layer(xs[i], routing=(ids, gates[i]))
                if i >= s["warmup"]:
                    st = layer.last_stats
                    before.append(st.token_straggler_before)
                    after.append(st.token_straggler_after)
                    moved.append(st.rows_moved)
                    outs.append(y)
            ys[policy] = outs
            err = max(float((a - b).abs().max()) for a, b in zip(outs, ys["none"], strict=True))
            out[(layer_idx, policy)] = {"before": float(np.mean(before)), "after": float(np.mean(after)),
                                        "rows_moved": float(np.mean(moved)), "max_abs_diff_vs_none": err}
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_layer_cpu_trace(benchmark):
    """The MoE layer itself (not the simulator) on real routing: ESFT trace ids fed to ``layer(x, routing=...)`` on
    4 gloo ranks (2 nodes x 2); token stragglers are device-independent, the outputs equal plain EP's."""
    from pathlib import Path

    root = Path(os.environ.get("FEPLB_TRACES", Path(__file__).resolve().parents[2] / "shared" / "routing_traces"))
    path = root / "esft_deepseek_v2_lite" / "esft_vanilla_lite_law.npz"
    if not path.exists():
        pytest.skip(f"routing trace not found: {path}")
    s = TRACE_SHAPE
    res = run_dist(_trace_worker, s["world"], str(path), s, timeout_s=900)[0]
    table = {}
    for policy in TRACE_POLICIES:
        rows = [res[(layer, policy)] for layer in s["layers"]]
        before = sum(r["before"] for r in rows) / len(rows)
        after = sum(r["after"] for r in rows) / len(rows)
        table[policy] = {"token_straggler_before": before, "token_straggler_after": after,
                         "reduction": 1 - after / before if before else 0.0,
                         "rows_moved": sum(r["rows_moved"] for r in rows) / len(rows),
                         "max_abs_diff_vs_none": max(r["max_abs_diff_vs_none"] for r in rows)}
    info = {"trace": str(path), "shape": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
            "results": table, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "command": "pytest bench/bench_layer.py -s -p no:randomly -k trace"}
    os.makedirs("runs", exist_ok=True)
    with open("runs/bench_layer_trace_cpu.json", "w") as f:
        json.dump(info, f, indent=1)
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nMoELayer on real routing (ESFT law, layers {list(s['layers'])}, EP {s['world']} as "
          f"{s['world'] // s['gpus_per_node']} nodes x {s['gpus_per_node']}, {s['tokens']} tokens/rank, "
          f"mean of {s['measured']} micro-batches):")
    for policy, r in table.items():
        print(f"  {policy:20s} token straggler {r['token_straggler_before']:7.1f} -> {r['token_straggler_after']:7.1f} "
              f"({100 * r['reduction']:5.1f}% lower)  rows moved {r['rows_moved']:7.1f}  "
              f"max |out - plain EP| {r['max_abs_diff_vs_none']:.2e}")
    for policy, r in table.items():
        assert r["max_abs_diff_vs_none"] <= 1e-4, (policy, r)
    assert table["feplb-split"]["token_straggler_after"] < table["feplb-split"]["token_straggler_before"]
