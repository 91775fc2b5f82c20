"""Forward + backward time of one MoELayer with balancing on vs off, measured in the same process group and run.

Variants: plain EP; ``feplb-split`` over the default copy path (shared memory on CPUs) and over gloo; ``feplb-split``
configured with ``weights="per-microbatch"`` (the same work: ``feplb-split`` picks its dynamic experts per
micro-batch and holds no per-step copies, so it copies their weights every micro-batch under either setting, as
``copy_bytes`` and ``weight_copies`` show; resident replicas are ``@ema``'s, ``+place``'s and ``eplb``'s);
``feplb-split+place`` (placement from routing history, then in-node balancing, its bank held for the step);
``eplb`` (redundant experts, rows dispatched straight to the replicas).

* ``test_layer_cpu_gloo``: 4 gloo processes on the CPU (2 nodes x 2 "GPUs"), a small layer (H=64, F=128, E=16,
  top-2, 256 tokens per rank) on skewed routing. CPU NUMBERS: they show the runtime's overhead and that the
  balanced layer computes the same thing; they say nothing about GPU speed or copy-engine overlap.
* ``test_layer_gpu_nccl``: the same on CUDA GPUs over NCCL (one rank per GPU, needs >= 2 GPUs), a GLM-5-like
  expert shape; skipped without them.
* ``test_layer_gpu_shared``: the same with TWO PROCESSES ON ONE GPU, run when exactly one CUDA GPU exists (with
  more, the NCCL test measures). NCCL refuses two ranks on one GPU, so gloo carries the host collectives; phase 1
  goes over NVSHMEM (2 PEs on the one GPU) when nvshmem4py imports, else over gloo staged through pinned host
  memory; the copy path is CUDA IPC (NVSHMEM's copy path cannot wait on signals with several PEs on one GPU). The
  two processes time-slice the GPU: the times compare the variants with each other in this run; they are not
  multi-GPU speed (no parallel GPUs, no NVLink peer copies). Sized to fit the
  GPU check's bench_layer step, process spawn, CUDA and NVSHMEM start-up and the first forward's and backward's
  Triton compiles included, when the check's earlier steps left the compiled kernels in Triton's cache: H=2048,
  F=1024, E=16, top-4, 2048 tokens per process, bf16, 12 timed iterations, autotuning time-boxed
  (``FEPLB_AUTOTUNE_MS``, default ``5,20`` ms per config, as the GPU check sets it for every step).
  A process still running after 35 s prints every thread's stack (then every 35 s), and the run fails after
  60 s (inside the GPU check's 70 s step; the first H200 run took 34 s), so it never hangs.

Each policy's iterations alternate inside one job (none, balanced, none, ...), each timed from a barrier to a
barrier and reduced as the max over ranks (the step waits for the slowest rank). Besides the skewed routing:

* every variant's output, input gradient and parameter gradients on the same input, against plain EP's
  (``max_abs_diff_vs_plain``, ``max_abs_param_grad_diff_vs_plain``,
  ``exact``: within the tolerance ``exact_criterion`` states): balancing changes where a row is computed, never
  what;
* plain EP written with torch alone (``TorchEP``: ``all_to_all_single``, ``torch._grouped_mm``), timed in the same
  alternation on both routings, its output and gradients checked against FEPLB's plain EP (``torch_ep``,
  ``plain_over_torch_ep``): what FEPLB's plain EP, the baseline of every other row, costs next to what an EP user
  runs without FEPLB;
* plain EP and ``feplb-split`` on perfectly balanced routing (``layer(x, routing=...)``, every GPU the same rows):
  what balancing costs when there is nothing to balance (``balanced_routing_overhead_pct``, target <= 2%);
* on CUDA, the blocking host syncs of one training forward and backward per variant, by step (``host_syncs``): what
  ``torch.cuda.set_sync_debug_mode("warn")`` flags (implicit device-to-host copies, ``.item()``, stream
  synchronizes, from every thread), plus calls of ``torch.cuda.Event.synchronize`` and ``torch.cuda.synchronize``,
  which the debug mode does not flag. The steps are told apart by wrapping the layer's counts step
  (``MoELayer._count``) on the instance for that one call. ``host_syncs_after_counts`` (target 0): the most, over
  variants and ranks, after the counts step (rest of the forward, and the backward), not counting the host waits of
  the gloo-staged phase-1 transport, which that one-GPU fallback makes by construction (counted apart,
  ``host_syncs_in_staged_transport``); ``host_syncs_per_forward``: every sync of the forward, the counts
  all-gather's own and the staged transport's included.

The JSON states the conditions of the run: ``processes_per_gpu``, ``transport`` and ``phase1``, ``copy_path``,
``backend``, ``control``, ``timing`` (what the times can be compared with), ``phase_s`` (rank 0's seconds per phase:
setup, warm-up with the compiles, timed loops) and ``wall_s`` (the whole run, spawn included).

Results go to ``runs/bench_layer_cpu.json``, or for the GPU tests to ``$FEPLB_BENCH_LAYER_JSON`` (default
``runs/bench_layer_gpu.json``), each written whole after the run's checks with their outcome (``checks``:
``"passed"`` or ``"failed: ..."``), and not at all under ``--benchmark-disable`` (the test suite's smoke runs, and
the project's pytest defaults: give ``--benchmark-enable``); and to ``benchmark.extra_info``:
``.venv/bin/pytest bench/bench_layer.py -s -p no:randomly --benchmark-enable``. ``test_layer_cpu_trace`` (below)
runs the layer on real routing.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from feplb.files import write_json
from feplb.testing import run_dist
from feplb.transport import nvshmem_unavailable

SHAPES = {"cpu": dict(hidden=64, ffn=128, num_experts=16, top_k=2, tokens=256, gpus_per_node=2, world=4, iters=8),
          "gpu": dict(hidden=2048, ffn=1024, num_experts=32, top_k=4, tokens=4096, gpus_per_node=8, world=0, iters=20),
          # two processes on one GPU, within about a minute with spawn, start-up and first-call compiles
          "gpu_shared": dict(hidden=2048, ffn=1024, num_experts=16, top_k=4, tokens=2048, gpus_per_node=2, world=2,
                             iters=12)}
BALANCED = "feplb-split"
# name -> (policy, weights mode, copy path; "auto": the run's own, see _setup)
VARIANTS = {"none": ("none", "per-step", "auto"), BALANCED: (BALANCED, "per-step", "auto"),
            f"{BALANCED}/gloo-copy": (BALANCED, "per-step", "gloo"),
            f"{BALANCED}/per-microbatch": (BALANCED, "per-microbatch", "auto"),
            f"{BALANCED}+place": (f"{BALANCED}+place", "per-step", "auto"),
            "eplb": ("eplb", "per-step", "auto")}


NVSHMEM_UNAVAILABLE = nvshmem_unavailable()
# Steps of one training forward + backward whose host syncs are counted apart; "staged_*": inside the gloo-staged
# phase-1 transport (host waits by construction).
SYNC_STEPS = ("before_counts", "counts", "after_counts", "backward", "staged_forward", "staged_backward")


def _setup(device: str, *, transport: str = "torch", copy_path: str = "auto", processes_per_gpu: int | None = None,
           watchdog_s: float | None = None) -> dict:
    """Where a run's processes compute and how rows move (a plain dict: it travels to the spawned workers).

    device: "cpu" or "cuda" (each rank's current GPU; with ``processes_per_gpu`` > 1 every process uses GPU 0).
    transport: phase 1 (``FEPLBConfig.transport``). copy_path: the copy path of the variants that take the run's
    own. watchdog_s: a worker still running this many seconds after its start prints every thread's stack (and
    again every as many seconds), so a run stopped at a time limit shows where it was.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dict(device=device, transport=transport, copy_path=copy_path, processes_per_gpu=processes_per_gpu,
                watchdog_s=watchdog_s)


def _gpu_env(setup: dict) -> dict[str, str]:
    """Environment of the GPU workers: autotuning time-boxed (run_dist sets it in each child before anything
    imports feplb.kernels, which applies it at import), and NVSHMEM's symmetric heap sized for the variants'
    phase-1 buffers (each layer holds its own)."""
    env = {"FEPLB_AUTOTUNE_MS": os.environ.get("FEPLB_AUTOTUNE_MS", "5,20")}
    if setup["transport"] == "nvshmem":
        env["NVSHMEM_SYMMETRIC_SIZE"] = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "2G")
    return env


class _Phases:
    """Seconds a worker spends in each phase (rank 0 prints each as it ends), and the watchdog of ``_setup``."""

    def __init__(self, rank: int, watchdog_s: float | None):
        self.rank, self.current, self.seconds = rank, None, {}
        self._start = self._t = time.perf_counter()
        self._done = threading.Event()
        if watchdog_s:
            threading.Thread(target=self._watch, args=(watchdog_s,), daemon=True).start()

    def begin(self, name: str | None) -> None:
        """End the current phase (if any) and start ``name`` (None: stop)."""
        now = time.perf_counter()
        if self.current is not None:
            self.seconds[self.current] = round(now - self._t, 3)
            if self.rank == 0:
                print(f"[bench_layer] {self.current}: {now - self._t:.1f} s", flush=True)
        self.current, self._t = name, now

    def end(self) -> None:
        self.begin(None)
        self._done.set()

    def _watch(self, every: float) -> None:
        while not self._done.wait(every):
            print(f"[bench_layer] rank {self.rank} still running after {time.perf_counter() - self._start:.0f} s, in "
                  f"phase {self.current!r}; every thread's stack:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _bench_worker(rank, world, shape, setup):
    phases = _Phases(rank, setup["watchdog_s"])
    try:
        return _bench(rank, shape, setup, phases)
    finally:
        phases.end()


def _bench(rank, shape, setup, phases):
    import numpy as np
    import torch.distributed as dist

    from feplb import FEPLBConfig, MoELayer

    phases.begin("setup: device, transport and copy path of every variant")
    s = dict(shape)
    tokens, iters = s.pop("tokens"), s.pop("iters")
    s.pop("world")
    on_gpu = setup["device"] == "cuda"
    if on_gpu and (setup["processes_per_gpu"] or 1) > 1:
        torch.cuda.set_device(0)   # every process on the one GPU (run_dist's gloo children pick none)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    backend = str(dist.get_backend())
    layers = {}
    for name, (policy, weights, copy_path) in VARIANTS.items():
        if on_gpu and copy_path == "gloo":
            continue
        torch.manual_seed(0)
        layers[name] = MoELayer(FEPLBConfig(policy=policy, dyn=2, dtype=dtype, plan_wait_ms=50.0, min_straggler_rows=0,
                                            weights=weights, transport=setup["transport"], device=setup["device"],
                                            copy_path=setup["copy_path"] if copy_path == "auto" else copy_path, **s))
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
    torch_ep = TorchEP(layers["none"])     # the same experts, written with torch alone

    phases.begin("warm-up: first forward of every variant (Triton compiles and autotuning)")
    for layer in layers.values():
        with torch.no_grad():
            layer(x)
        layer.refresh_replicas()
    # NCCL reduces device tensors; gloo host tensors (also beside a shared GPU)
    red_dev = dev if "nccl" in backend else torch.device("cpu")

    def max_over_ranks(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64, device=red_dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    # The baseline's first forward: where it cannot run (an exchange this backend refuses), every rank records why
    # and FEPLB's variants are still measured; the run's check then fails on it (_check).
    tep_error = None
    try:
        with torch.no_grad():
            torch_ep(x)
    except Exception as err:
        tep_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if max_over_ranks(float(tep_error is not None)):
        torch_ep, tep_error = None, tep_error or "failed on another rank"

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

    phases.begin("skewed routing: timed forward + backward (the first 2 of each variant compile the backward)")
    times = {p: [] for p in layers}
    stats, outs = {}, {}
    tep_times, tep_out = [], None
    copy_use = {p: dict.fromkeys(_copy_counters(layer), 0) for p, layer in layers.items()}
    for it in range(iters + 2):
        for policy, layer in layers.items():
            xi = x.clone().requires_grad_(True)

            def step(layer=layer, xi=xi):
                y = layer(xi)
                y.float().sum().backward()
                return y

            before = _copy_counters(layer)
            t, y = timed_ms(step)
            after = _copy_counters(layer)
            if it >= 2:
                times[policy].append(t)
                for k in after:
                    copy_use[policy][k] += after[k] - before[k]
            layer.reduce_replica_grads()
            if it == 2:
                outs[policy] = {"out": y.detach().float(), "grad": xi.grad.float(),
                                **{k: _grad_of(p) for k, p in (("w1_grad", layer.w1), ("w2_grad", layer.w2),
                                                               ("router_grad", layer.router.weight))}}
            layer.zero_grad()
            st = layer.last_stats
            group = _group_balance(st)
            stats[policy] = {"token_straggler_before": group["token_straggler_before"],
                             "token_straggler_after": group["token_straggler_after"],
                             "rows_moved": group["rows_moved"], "fell_back": group["fell_back"],
                             "plan_us": st.plan_us, "copy_bytes": group["copy_bytes"],
                             "weight_copies": group["weight_copies"], "experts_placed": st.experts_placed}
        if torch_ep is None:
            continue
        xi = x.clone().requires_grad_(True)

        def step(xi=xi):
            y = torch_ep(xi)
            y.float().sum().backward()
            return y

        t, y = timed_ms(step)
        if it >= 2:
            tep_times.append(t)
        if it == 2:
            tep_out = {"out": y.detach().float(), "grad": xi.grad.float(), **torch_ep.grads()}
        torch_ep.zero_grad()

    # Each variant against plain EP: the output, the input gradient and the parameters' gradients (the expert
    # weights' gradients are where split rows' sums meet), max over ranks, next to plain EP's largest |value|.
    ref = outs["none"]
    scale = {k: max_over_ranks(float(t.abs().max())) if t.numel() else 0.0 for k, t in ref.items()}
    diffs = {p: {k: max_over_ranks(float((o[k] - t).abs().max())) if t.numel() else 0.0 for k, t in ref.items()}
             for p, o in {**outs, **({"torch-ep": tep_out} if torch_ep is not None else {})}.items()}

    # Perfectly balanced routing: token t's k-th choice is expert (t * K + k) mod E on every rank, so each expert,
    # and each GPU, receives the same rows: nothing to balance, and whatever balancing costs shows.
    phases.begin("balanced routing: timed forward + backward")
    T, K, E = tokens, s["top_k"], s["num_experts"]
    ids = ((torch.arange(T)[:, None] * K + torch.arange(K)[None, :]) % E).to(dev)
    gates = torch.full((T, K), 1.0 / K, device=dev, dtype=dtype)
    even = {p: layers[p] for p in ("none", BALANCED)}
    even_times = {p: [] for p in even}
    even_stats, even_tep = {}, []
    for it in range(iters + 2):
        for policy, layer in even.items():
            xi = x.clone().requires_grad_(True)
            t, _ = timed_ms(lambda layer=layer, xi=xi: layer(xi, routing=(ids, gates)).float().sum().backward())
            if it >= 2:
                even_times[policy].append(t)
            layer.reduce_replica_grads()
            layer.zero_grad()
            group = _group_balance(layer.last_stats)
            even_stats[policy] = {"token_straggler_before": group["token_straggler_before"],
                                  "rows_moved": group["rows_moved"]}
        if torch_ep is None:
            continue
        xi = x.clone().requires_grad_(True)
        t, _ = timed_ms(lambda xi=xi: torch_ep(xi, routing=(ids, gates)).float().sum().backward())
        if it >= 2:
            even_tep.append(t)
        torch_ep.zero_grad()

    syncs = {}
    if dev.type == "cuda":
        phases.begin("host syncs: one forward + backward per variant")
        for policy, layer in layers.items():
            hits = _host_syncs(layer, x)
            syncs[policy] = {k: int(max_over_ranks(v)) for k, v in hits.items()}
            layer.reduce_replica_grads()
            layer.zero_grad()

    phases.begin("copy path: one exchange's latency, alone")
    probe = _copy_probe(layers[BALANCED], dev, dtype)

    phases.begin("close")
    conditions = {"transport": layers[BALANCED].transport.name, "copy_path": layers[BALANCED].comm.copy.name,
                  "backend": backend}
    for layer in reversed(list(layers.values())):   # the first layer's transport may own NVSHMEM: finalise it last
        layer.close()
    phases.end()
    per_step = {p: {f"copy_{k}_per_step": (max_over_ranks(v) / iters) for k, v in use.items()}
                for p, use in copy_use.items()}
    return {"results": {p: {"median_ms": float(np.median(v)), "min_ms": float(np.min(v)), **stats[p],
                            **per_step[p],
                            "max_abs_diff_vs_plain": diffs[p]["out"], "max_abs_grad_diff_vs_plain": diffs[p]["grad"],
                            "max_abs_param_grad_diff_vs_plain": {k: v for k, v in diffs[p].items()
                                                                 if k not in ("out", "grad")}}
                        for p, v in times.items()},
            "torch_ep": {"error": tep_error} if torch_ep is None else
            {"median_ms": float(np.median(tep_times)), "min_ms": float(np.min(tep_times)),
             "balanced_routing_median_ms": float(np.median(even_tep)),
             "max_abs_diff_vs_plain": diffs["torch-ep"]["out"], "max_abs_grad_diff_vs_plain": diffs["torch-ep"]["grad"],
             "max_abs_param_grad_diff_vs_plain": {k: v for k, v in diffs["torch-ep"].items()
                                                  if k not in ("out", "grad")}},
            "copy_probe": {k: max_over_ranks(v) for k, v in probe.items()},
            "scale": scale,
            "balanced_routing": {p: {"median_ms": float(np.median(v)), **even_stats[p]}
                                 for p, v in even_times.items()},
            "host_syncs": syncs, "conditions": conditions, "phase_s": dict(phases.seconds)}


class TorchEP:
    """Plain expert parallelism written with torch alone: the baseline FEPLB's own plain EP (policy ``none``) is
    timed against, so that both are compared with what an EP user runs without FEPLB. The recipe of Megatron-Core's
    all-to-all token dispatcher: route (fp32 softmax scores, top-k), sort the token copies by expert (so by owner:
    expert e lives on rank e // L), exchange the per-expert counts with one ``all_to_all_single`` and read the split
    sizes on the host (one blocking read per forward), exchange the rows with
    ``all_to_all_single_autograd`` (torch's differentiable functional collective), group them by local expert, two
    ``torch._grouped_mm`` with SwiGLU between, the reverse exchange, weigh by the gates and sum per token in fp32.

    Its parameters are copies of ``layer``'s (router, w1, w2: the same global experts on every rank), leaves of their
    own, so its gradients never touch the layer's. Only the layer's default experts (softmax router without bias,
    SwiGLU, no biases, gate and up halves) are written here; another configuration raises."""

    DEFAULTS = {"router": "softmax", "router_bias": False, "activation": "silu", "gated": True,
                "glu_interleaved": False, "expert_bias": False, "swiglu_limit": None, "gate_on_input": False,
                "masked_routes": False}

    def __init__(self, layer):
        c = layer.config
        unsupported = {k: getattr(c, k) for k, v in self.DEFAULTS.items() if getattr(c, k) != v}
        if unsupported:
            raise ValueError(f"TorchEP writes the layer's default experts only, got {unsupported}")
        self.num_experts, self.top_k = c.num_experts, c.top_k
        self.params = {"router": layer.router.weight, "w1": layer.w1, "w2": layer.w2}
        self.params = {k: v.detach().clone().requires_grad_(True) for k, v in self.params.items()}

    def __call__(self, x_TD: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        p, E, K = self.params, self.num_experts, self.top_k
        W = dist.get_world_size()
        L = E // W
        if routing is None:
            scores_TE = F.linear(x_TD, p["router"]).float().softmax(-1)
            ids_TK = scores_TE.detach().topk(K, dim=-1).indices
            gates_TK = scores_TE.gather(-1, ids_TK).to(x_TD.dtype)
        else:
            ids_TK, gates_TK = routing
        T, H = x_TD.shape
        flat = ids_TK.reshape(-1)
        order = flat.argsort(stable=True)                      # token copies by expert, so by owner rank
        rows = x_TD.index_select(0, order // K)
        counts_E = torch.bincount(flat, minlength=E)
        got_E = torch.empty_like(counts_E)                      # [source rank, my local expert]
        dist.all_to_all_single(got_E, counts_E)
        send, recv = torch.stack([counts_E.view(W, L).sum(1), got_E.view(W, L).sum(1)]).tolist()
        inbox = all_to_all_single_autograd(rows, recv, send, dist.group.WORLD)
        local = torch.arange(L, device=x_TD.device).repeat(W)
        perm = torch.repeat_interleave(local, got_E).argsort(stable=True)   # received rows by local expert
        offs = got_E.view(W, L).sum(0).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(inbox.index_select(0, perm), p["w1"], offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, p["w2"], offs=offs)
        y = y.index_select(0, perm.argsort())                  # back in the order received
        out = all_to_all_single_autograd(y, send, recv, dist.group.WORLD)
        y_TKD = out.index_select(0, order.argsort()).view(T, K, H)
        return (y_TKD.float() * gates_TK.float()[..., None]).sum(1).to(x_TD.dtype)

    def grads(self) -> dict[str, torch.Tensor]:
        return {f"{k}_grad": _grad_of(v) for k, v in (("w1", self.params["w1"]), ("w2", self.params["w2"]),
                                                      ("router", self.params["router"]))}

    def zero_grad(self) -> None:
        for v in self.params.values():
            v.grad = None


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient as fp32 (zeros when it has none: no row reached it on this rank)."""
    if param.grad is None:
        return torch.zeros_like(param, dtype=torch.float32)
    return param.grad.detach().float().clone()


def _copy_counters(layer) -> dict[str, int]:
    """The copy path's own counters (``feplb.copy.peer.PeerInboxEngine``: exchanges with data, inbox rebuilds);
    empty for an engine without them."""
    eng = layer.comm.copy
    return {k: int(getattr(eng, k)) for k in ("exchanges", "grows") if hasattr(eng, k)}


PROBE_ITERS = 20


def _copy_probe(layer, dev: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """One copy-path exchange of 4 KiB between the node's ranks, alone (collective on the node): the median time of
    one exchange issued and waited for (``synced_us``: on a GPU the host waits for the copy stream's results, so
    every cross-process event wait and the processes' turns on a shared GPU are in it) and the mean of
    ``PROBE_ITERS`` issued back to back then waited for once (``pipelined_us``). Checks what arrived."""
    import numpy as np
    import torch.distributed as dist

    eng, g, me = layer.comm.copy, layer.comm.copy.node_size, layer.comm.copy.node_rank
    if g < 2:
        return {}
    n = 4096 // torch.empty(0, dtype=dtype).element_size()
    rank = dist.get_rank()
    piece = torch.full((n,), float(rank % 64), dtype=dtype, device=dev)
    peers = [p for p in range(g) if p != me]
    base = rank - me

    def once():
        return eng.exchange({p: [piece] for p in peers}, dict.fromkeys(peers, n), dtype=dtype, device=dev,
                            op="copy probe")

    def wait(got):
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()
        for p, t in got.items():
            if not bool((t == float((base + p) % 64)).all()):
                raise RuntimeError(f"copy probe: rank {rank} received other data from node rank {p}")

    wait(once())                                   # a first exchange: grow the inboxes if need be
    synced = []
    for _ in range(PROBE_ITERS):
        dist.barrier()
        t0 = time.perf_counter()
        wait(once())
        synced.append((time.perf_counter() - t0) * 1e6)
    dist.barrier()
    t0 = time.perf_counter()
    got = [once() for _ in range(PROBE_ITERS)]
    for g_ in got:
        wait(g_)
    pipelined = (time.perf_counter() - t0) * 1e6 / PROBE_ITERS
    return {"synced_us": float(np.median(synced)), "pipelined_us": pipelined}


def _group_balance(st) -> dict:
    """The whole group's balancing of a forward (``feplb.join_stats``): with a node plan (in-node policy on several
    nodes) the ranks' stats are all-gathered first (collective then, on every rank alike)."""
    import torch.distributed as dist

    from feplb import join_stats

    per_rank = [st]
    if st.planned_ranks != list(range(len(st.loads_before_W))):
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, st)
    return join_stats(per_rank)


def _host_syncs(layer, x: torch.Tensor) -> dict[str, int]:
    """One training forward + backward of ``layer`` on a copy of x [T, H]; its blocking host syncs, by step
    (``SYNC_STEPS``).

    A sync is a warning of ``torch.cuda.set_sync_debug_mode("warn")`` (from any thread; the autograd engine replays
    its workers' warnings in the caller) or a call of ``torch.cuda.Event.synchronize`` / ``torch.cuda.synchronize``
    (torch does not flag those). Steps: until the layer's counts step (``_count``), in it, after it, then the
    backward; waits inside the gloo-staged transport (``TorchTransport._staged``) are counted apart. Both private
    methods are wrapped on the instances, for this call only."""
    hits = dict.fromkeys(SYNC_STEPS, 0)
    now = {"step": "before_counts", "count_calls": 0}
    in_staged = threading.local()
    lock = threading.Lock()

    def hit() -> None:
        step = now["step"]
        if getattr(in_staged, "on", False):
            step = "staged_backward" if step == "backward" else "staged_forward"
        with lock:
            hits[step] += 1

    def show(message, *_args, **_kwargs) -> None:
        if "synchroniz" in str(message):
            hit()

    count, staged = layer._count, getattr(layer.transport, "_staged", None)
    event_sync, device_sync = torch.cuda.Event.synchronize, torch.cuda.synchronize

    def counts_step(*args, **kwargs):
        now["count_calls"] += 1
        now["step"] = "counts"
        try:
            return count(*args, **kwargs)
        finally:
            now["step"] = "after_counts"

    def staged_exchange(*args, **kwargs):
        in_staged.on = True
        try:
            return staged(*args, **kwargs)
        finally:
            in_staged.on = False

    def event_synchronize(event) -> None:
        hit()
        event_sync(event)

    def synchronize(device=None) -> None:
        hit()
        device_sync(device)

    xi = x.clone().requires_grad_(True)
    torch.cuda.synchronize()
    layer._count = counts_step
    if staged is not None:
        layer.transport._staged = staged_exchange
    torch.cuda.Event.synchronize, torch.cuda.synchronize = event_synchronize, synchronize
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                y = layer(xi)
                now["step"] = "backward"
                y.float().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.Event.synchronize, torch.cuda.synchronize = event_sync, device_sync
        del layer._count
        if staged is not None:
            del layer.transport._staged
    if now["count_calls"] != 1:
        raise RuntimeError(f"MoELayer._count ran {now['count_calls']} times in one forward; the host-sync count "
                           "splits the forward at that one step")
    return hits


def _conditions(setup: dict, out: dict) -> dict:
    """What the run's numbers can be compared with: processes per GPU, phase 1, copy path, control."""
    c = out["conditions"]
    ppg = setup["processes_per_gpu"]
    if setup["device"] == "cpu":
        phase1 = "gloo all_to_all_single of CPU tensors"
        timing = "CPU processes over gloo: the runtime's overhead, not GPU speed"
    else:
        if c["transport"] == "nvshmem":
            phase1 = "NVSHMEM puts" + (f", {ppg} PEs on one GPU (NVSHMEM's limited mode: no signal waits, "
                                       "barrier_all on the stream)" if (ppg or 1) > 1 else ", one PE per GPU")
        elif "nccl" in c["backend"]:
            phase1 = "NCCL all_to_all_single"
        else:
            phase1 = ("gloo all_to_all_single staged through pinned host memory (the host waits for each "
                      "exchange's rows: host_syncs_in_staged_transport)"
                      + (f"; NVSHMEM unavailable: {NVSHMEM_UNAVAILABLE}" if NVSHMEM_UNAVAILABLE else ""))
        timing = (f"{ppg} processes time-slice one GPU: the times compare the variants with each other in this run, "
                  "they are not multi-GPU speed (no parallel GPUs, no NVLink peer copies)" if (ppg or 1) > 1
                  else "one process per GPU")
    return {"processes_per_gpu": ppg, "transport": c["transport"], "phase1": phase1, "copy_path": c["copy_path"],
            "backend": c["backend"], "control": "gloo (feplb.control)", "timing": timing}


def _report(benchmark, shape, setup, out, rel_tol: float, wall_s: float | None = None) -> dict:
    res, even, scale = out["results"], out["balanced_routing"], out["scale"]
    none, bal = res["none"], res[BALANCED]
    device = "cpu" if setup["device"] == "cpu" else "gpu"
    cond = _conditions(setup, out)
    info = {"device": device, "shape": shape, "results": res, "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), **cond,
            "fwd_bwd_ms": {p: r["median_ms"] for p, r in res.items()},
            "balanced_over_none": bal["median_ms"] / none["median_ms"],
            "max_abs_diff_vs_plain": max(r["max_abs_diff_vs_plain"] for r in res.values()),
            "max_abs_grad_diff_vs_plain": max(r["max_abs_grad_diff_vs_plain"] for r in res.values()),
            "output_scale": scale,
            "max_abs_param_grad_diff_vs_plain": {k: max(r["max_abs_param_grad_diff_vs_plain"][k] for r in res.values())
                                                 for k in none["max_abs_param_grad_diff_vs_plain"]},
            "exact": all(r["max_abs_diff_vs_plain"] <= rel_tol * scale["out"]
                         and r["max_abs_grad_diff_vs_plain"] <= rel_tol * scale["grad"]
                         and all(d <= rel_tol * scale[k] for k, d in r["max_abs_param_grad_diff_vs_plain"].items())
                         for r in res.values()),
            "exact_criterion": f"every variant's output, input gradient and parameter gradients (w1, w2, router) "
                               f"within {rel_tol:g} x the largest |value| of plain EP's, on the same input (max over "
                               "ranks)",
            "balanced_routing": even,
            "balanced_routing_overhead_pct": 100 * (even[BALANCED]["median_ms"] / even["none"]["median_ms"] - 1),
            "torch_ep": {**out["torch_ep"], "exchange": _torch_ep_exchange(setup, cond)},
            **({} if "error" in out["torch_ep"] else {
                "plain_over_torch_ep": none["median_ms"] / out["torch_ep"]["median_ms"],
                "plain_over_torch_ep_balanced_routing": even["none"]["median_ms"]
                / out["torch_ep"]["balanced_routing_median_ms"]}),
            "torch_ep_note": "plain EP written with torch alone (TorchEP: all_to_all_single with the split sizes read "
                             "on the host, torch._grouped_mm), the same experts and inputs, timed in the same "
                             "alternation: plain_over_torch_ep is FEPLB's plain EP (policy none) over it",
            "phase_s": out["phase_s"], "wall_s": wall_s,
            "copy_probe": out["copy_probe"],
            "copy_probe_note": "one copy-path exchange of 4 KiB between the node's ranks, alone: synced_us issued and "
                               "waited for (cross-process event waits, and on a shared GPU the processes' turns, "
                               "included), pipelined_us issued back to back; each variant's copy_exchanges_per_step "
                               "says how many exchanges with data one forward + backward makes"}
    staged = {}
    if device == "gpu":
        syncs = out["host_syncs"]
        staged = {p: n["staged_forward"] + n["staged_backward"] for p, n in syncs.items()}
        info.update(
            host_syncs=syncs,
            host_syncs_after_counts=max(n["after_counts"] + n["backward"] for n in syncs.values()),
            host_syncs_per_forward={p: n["before_counts"] + n["counts"] + n["after_counts"] + n["staged_forward"]
                                    for p, n in syncs.items()},
            host_syncs_in_staged_transport=staged,
            host_syncs_counted="blocking host syncs of one training forward + backward per variant (max over ranks): "
                               "torch.cuda.set_sync_debug_mode('warn') warnings plus torch.cuda.Event.synchronize and "
                               "torch.cuda.synchronize calls; host_syncs_after_counts: after the counts step, forward "
                               "and backward, the gloo-staged transport's own waits excluded (counted apart); "
                               "host_syncs_per_forward: the whole forward, the counts all-gather's own included",
            gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    benchmark.extra_info.update(info)
    where = device.upper() if (cond["processes_per_gpu"] or 1) <= 1 else \
        f"GPU, {cond['processes_per_gpu']} processes on one GPU"
    print(f"\n[{where}] MoELayer fwd+bwd, median over iterations (max over ranks):")
    print(f"  phase 1: {cond['transport']} ({cond['phase1']}); copy path: {cond['copy_path']}; backend "
          f"{cond['backend']}")
    print(f"  timing: {cond['timing']}")
    for p, r in res.items():
        print(f"  {p:28s} {r['median_ms']:8.2f} ms  token straggler {r['token_straggler_before']:.0f} -> "
              f"{r['token_straggler_after']:.0f}  rows moved {r['rows_moved']}  copy {r['copy_bytes'] / 1e6:.2f} MB "
              f"({r['weight_copies']} weight copies)  fell back {r['fell_back']}  "
              f"max |out - plain EP| {r['max_abs_diff_vs_plain']:.2e}"
              + (f"  copy-path exchanges {r['copy_exchanges_per_step']:.1f} per step"
                 if "copy_exchanges_per_step" in r else "")
              + (f", inbox rebuilds {r['copy_grows_per_step']:.2f}" if r.get("copy_grows_per_step") else ""))
    probe = info["copy_probe"]
    if probe:
        print(f"  one copy-path exchange of 4 KiB alone: {probe['synced_us']:.0f} us issued and waited for, "
              f"{probe['pipelined_us']:.0f} us each back to back")
    print(f"  balanced routing: plain EP {even['none']['median_ms']:.2f} ms, {BALANCED} "
          f"{even[BALANCED]['median_ms']:.2f} ms ({info['balanced_routing_overhead_pct']:+.1f}%)")
    tep = info["torch_ep"]
    if "error" in tep:
        print(f"  plain EP written with torch alone ({tep['exchange']}): did not run: {tep['error']}")
    else:
        print(f"  plain EP written with torch alone ({tep['exchange']}): {tep['median_ms']:.2f} ms skewed, "
              f"{tep['balanced_routing_median_ms']:.2f} ms balanced; FEPLB's plain EP over it "
              f"{info['plain_over_torch_ep']:.2f}x skewed, {info['plain_over_torch_ep_balanced_routing']:.2f}x "
              f"balanced; max |out - plain EP| {tep['max_abs_diff_vs_plain']:.2e}")
    print(f"  equal to plain EP ({info['exact_criterion']}): {info['exact']}")
    worst = {k: d / max(info["output_scale"][k], 1e-30) for k, d in info["max_abs_param_grad_diff_vs_plain"].items()}
    print("  parameter gradients, max |variant - plain EP| / max |plain EP|: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    if device == "gpu":
        print(f"  host syncs after the counts step, forward + backward (target 0): {info['host_syncs_after_counts']}"
              f"; per forward, the counts' own included: {info['host_syncs_per_forward']}")
        if any(staged.values()):
            print(f"  host waits inside the gloo-staged phase-1 transport (by construction, counted apart): {staged}")
    took = ", ".join(f"{k.split(':')[0]} {v:.1f} s" for k, v in info["phase_s"].items())
    print(f"  rank 0's phases: {took}" + (f"; whole run with spawn {wall_s:.1f} s" if wall_s is not None else ""))
    return info


def _write_checked(benchmark, path: str, info: dict, *checks) -> None:
    """Run the checks, then write the JSON with their outcome (``checks``: ``"passed"``, or ``"failed: ..."`` and the
    error, which is raised again): a run whose checks fail keeps its numbers, marked as such. Under
    ``--benchmark-disable`` (the test suite's smoke runs) nothing is written, so a smoke run never replaces a
    measurement's file."""
    try:
        for check in checks:
            check()
    except BaseException as e:
        info["checks"] = f"failed: {type(e).__name__}: {e}"
        raise
    else:
        info["checks"] = "passed"
    finally:
        benchmark.extra_info["checks"] = info.get("checks", "failed: not run")
        if not benchmark.disabled:
            write_json(path, info)


def _torch_ep_exchange(setup: dict, cond: dict) -> str:
    """How TorchEP's rows travel in this run."""
    if "nccl" in cond["backend"]:
        return "NCCL all_to_all_single"
    if setup["device"] == "cpu":
        return "gloo all_to_all_single of CPU tensors"
    return ("gloo all_to_all_single of CUDA tensors, which gloo stages through host memory: not how FEPLB's rows "
            f"travel in this run (phase 1: {cond['phase1']}), so compare the two times with care")


def test_write_checked_records_the_checks_outcome(tmp_path):
    class Bench:                                            # what _write_checked reads of pytest-benchmark's fixture
        def __init__(self, disabled):
            self.disabled, self.extra_info = disabled, {}

    def bad():
        raise AssertionError("rows moved 0")

    out = tmp_path / "runs" / "r.json"
    _write_checked(Bench(False), str(out), {"ms": 1.0}, lambda: None)
    assert json.loads(out.read_text()) == {"ms": 1.0, "checks": "passed"}
    bench = Bench(False)
    with pytest.raises(AssertionError, match="rows moved 0"):
        _write_checked(bench, str(out), {"ms": 2.0}, lambda: None, bad, lambda: pytest.fail("ran after a failure"))
    assert json.loads(out.read_text()) == {"ms": 2.0, "checks": "failed: AssertionError: rows moved 0"}
    assert bench.extra_info == {"checks": "failed: AssertionError: rows moved 0"}
    # a smoke run (--benchmark-disable) writes nothing, passed or failed
    with pytest.raises(AssertionError):
        _write_checked(Bench(True), str(tmp_path / "smoke.json"), {}, bad)
    _write_checked(Bench(True), str(tmp_path / "smoke.json"), {}, lambda: None)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["r.json", "runs"]


def _check(info: dict, rel_tol: float) -> None:
    """What every run must show, CPU or GPU: the numbers exist next to plain EP's, balancing computes the same
    outputs and gradients, it balances skewed routing, and balanced routing leaves it nothing to move; plain EP
    written with torch alone computes what FEPLB's plain EP computes."""
    res, even = info["results"], info["balanced_routing"]
    tep = info["torch_ep"]
    assert "error" not in tep, f"plain EP written with torch alone did not run: {tep}"
    for k in ("median_ms", "balanced_routing_median_ms"):
        assert math.isfinite(tep[k]) and tep[k] > 0, tep
    assert tep["max_abs_diff_vs_plain"] <= rel_tol * info["output_scale"]["out"], tep
    assert tep["max_abs_grad_diff_vs_plain"] <= rel_tol * info["output_scale"]["grad"], tep
    assert set(tep["max_abs_param_grad_diff_vs_plain"]) == {"w1_grad", "w2_grad", "router_grad"}, tep
    for k, d in tep["max_abs_param_grad_diff_vs_plain"].items():
        assert d <= rel_tol * info["output_scale"][k], (k, d)
    for p, ms in info["fwd_bwd_ms"].items():
        assert math.isfinite(ms) and ms > 0, (p, ms)
    assert "none" in info["fwd_bwd_ms"] and BALANCED in info["fwd_bwd_ms"]
    for p, r in res.items():
        assert r["max_abs_diff_vs_plain"] <= rel_tol * info["output_scale"]["out"], (p, r)
        assert r["max_abs_grad_diff_vs_plain"] <= rel_tol * info["output_scale"]["grad"], (p, r)
        for k, d in r["max_abs_param_grad_diff_vs_plain"].items():
            assert d <= rel_tol * info["output_scale"][k], (p, k, d)
    assert set(info["output_scale"]) == {"out", "grad", "w1_grad", "w2_grad", "router_grad"}
    assert all(v > 0 for v in info["output_scale"].values()), info["output_scale"]
    assert info["exact"]
    assert res[BALANCED]["rows_moved"] > 0 and not res[BALANCED]["fell_back"], res[BALANCED]
    assert res[BALANCED]["token_straggler_after"] < res[BALANCED]["token_straggler_before"]
    assert res["none"]["rows_moved"] == 0
    for p, r in even.items():
        assert r["token_straggler_before"] == 0 and r["rows_moved"] == 0, (p, r)
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0
    assert math.isfinite(info["balanced_routing_overhead_pct"])
    # The copy path's use: a balanced step exchanges rows (and weights), plain EP never uses it; the probe ran.
    if "copy_exchanges_per_step" in res[BALANCED]:
        assert res[BALANCED]["copy_exchanges_per_step"] > 0 and res["none"]["copy_exchanges_per_step"] == 0, res
    probe = info["copy_probe"]
    assert set(probe) == {"synced_us", "pipelined_us"} and all(v > 0 for v in probe.values()), probe


def _check_syncs(info: dict) -> None:
    """The host-sync count covers every variant and sees the one sync every forward makes by design: the counts
    all-gather copies the counts to the host (a count of 0 there means the counting saw nothing)."""
    syncs = info["host_syncs"]
    assert set(syncs) == set(info["fwd_bwd_ms"]), syncs
    for p, n in syncs.items():
        assert set(n) == set(SYNC_STEPS) and all(isinstance(v, int) and v >= 0 for v in n.values()), (p, n)
        assert n["counts"] >= 1, (p, n)
    assert isinstance(info["host_syncs_after_counts"], int)


@pytest.mark.dist
@pytest.mark.slow
def test_layer_cpu_gloo(benchmark):
    shape, setup = SHAPES["cpu"], _setup("cpu")
    out = run_dist(_bench_worker, shape["world"], shape, setup, timeout_s=600)[0]
    info = _report(benchmark, shape, setup, out, rel_tol=1e-5)
    # The timing itself is in extra_info; the fixture records the (cheap) report call so the JSON has an entry.
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    _write_checked(benchmark, "runs/bench_layer_cpu.json", info, lambda: _check(info, rel_tol=1e-5))


# bf16: a row computed on another GPU, or in a group of another size, may round differently (other tile shapes).
GPU_REL_TOL = 2e-2


@pytest.mark.gpu
@pytest.mark.dist
def test_layer_gpu_nccl(benchmark):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 CUDA GPUs (one NCCL rank per GPU)")
    shape = dict(SHAPES["gpu"])
    shape["world"] = torch.cuda.device_count()
    shape["gpus_per_node"] = min(shape["gpus_per_node"], shape["world"])
    setup = _setup("cuda", processes_per_gpu=1)
    t0 = time.perf_counter()
    out = run_dist(_bench_worker, shape["world"], shape, setup, timeout_s=600, backend="nccl", env=_gpu_env(setup))[0]
    info = _report(benchmark, shape, setup, out, GPU_REL_TOL, time.perf_counter() - t0)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    _write_checked(benchmark, os.environ.get("FEPLB_BENCH_LAYER_JSON", "runs/bench_layer_gpu.json"), info,
                   lambda: _check(info, rel_tol=GPU_REL_TOL), lambda: _check_syncs(info))


@pytest.mark.gpu
@pytest.mark.dist
def test_layer_gpu_shared(benchmark):
    """Two processes on one GPU (gloo control, NVSHMEM or gloo-staged phase 1, CUDA IPC copy path): everything the
    NCCL test measures, on the one GPU (see the module docstring for what its times mean)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() > 1:
        pytest.skip("more than one GPU: test_layer_gpu_nccl measures the layer there, one rank per GPU")
    shape = SHAPES["gpu_shared"]
    setup = _setup("cuda", transport="torch" if NVSHMEM_UNAVAILABLE else "nvshmem", copy_path="ipc",
                   processes_per_gpu=shape["world"], watchdog_s=35)
    t0 = time.perf_counter()
    # gloo's collective timeout outlasts a peer's first-call compiles; the run's limit stops a hang with an error.
    out = run_dist(_bench_worker, shape["world"], shape, setup, timeout_s=60, collective_timeout_s=45,
                   env=_gpu_env(setup))[0]
    info = _report(benchmark, shape, setup, out, GPU_REL_TOL, time.perf_counter() - t0)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)

    def conditions():
        assert (info["processes_per_gpu"], info["transport"], info["copy_path"]) == (2, setup["transport"], "ipc"), \
            info

    _write_checked(benchmark, os.environ.get("FEPLB_BENCH_LAYER_JSON", "runs/bench_layer_gpu.json"), info,
                   conditions, lambda: _check(info, rel_tol=GPU_REL_TOL), lambda: _check_syncs(info))


def _torch_ep_worker(rank, world, seed):
    """TorchEP (fp32: torch._grouped_mm takes no fp64) against the dense single-process reference in fp64 on the
    same values, weights and inputs drawn from ``seed``: this
    rank's output, its input's gradient and the router's (this rank's tokens), and the reference's gradients of
    every expert from this rank's tokens (the test sums them over the ranks for each owner). One expert gets no
    row."""
    from feplb import FEPLBConfig, MoELayer
    from feplb.testing import dense_moe_reference, load_global_weights

    H, F, E, K, T = 16, 24, 8, 2, 40
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen, dtype=torch.float64)
    w1 = torch.randn(E, H, 2 * F, generator=gen, dtype=torch.float64) / H ** 0.5
    w2 = torch.randn(E, F, H, generator=gen, dtype=torch.float64) / F ** 0.5
    x = torch.randn(world, T, H, generator=gen, dtype=torch.float64)
    dy = torch.randn(world, T, H, generator=gen, dtype=torch.float64)
    x[:, :, 0] = x[:, :, 0].abs() + 1
    router[E - 1, 0] = -1e3                                 # expert E - 1: never chosen
    router, w1, w2, x, dy = (t.float().double() for t in (router, w1, w2, x, dy))   # values fp32 holds
    layer = MoELayer(FEPLBConfig(hidden=H, ffn=F, num_experts=E, top_k=K, policy="none", device="cpu"))
    try:
        load_global_weights(layer, router.float(), w1.float(), w2.float())
        tep = TorchEP(layer)
    finally:
        layer.close()
    xi = x[rank].float().requires_grad_(True)
    y = tep(xi)
    (y * dy[rank].float()).sum().backward()
    got = {k: v.double() for k, v in {"out": y.detach(), "x": xi.grad, **tep.grads()}.items()}

    ref = {k: v.clone().requires_grad_(True) for k, v in (("router", router), ("w1", w1), ("w2", w2))}
    xr = x[rank].clone().requires_grad_(True)
    yr = dense_moe_reference(xr, ref["router"], ref["w1"], ref["w2"], K)
    (yr * dy[rank]).sum().backward()
    want = {"out": yr.detach(), "x": xr.grad, "router_grad": ref["router"].grad, "w1_grad": ref["w1"].grad,
            "w2_grad": ref["w2"].grad}
    return got, want


@pytest.mark.dist
def test_torch_ep_matches_dense_reference():
    """The baseline computes the layer's math: TorchEP on 2 gloo ranks against the dense fp64 reference (each
    tensor within fp32's rounding of its own scale)."""
    import random

    world, seed = 2, random.randrange(2**31)
    res = run_dist(_torch_ep_worker, world, seed, timeout_s=120)
    L = res[0][0]["w1_grad"].shape[0]
    for rank, (got, want) in enumerate(res):
        for k in ("out", "x", "router_grad"):
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5 * float(want[k].abs().max()),
                                       msg=lambda m, k=k, r=rank: f"seed {seed}, rank {r}, {k}: {m}")
        for k in ("w1_grad", "w2_grad"):        # the owner's shard: every rank's tokens
            full = sum(w[k] for _, w in res)
            torch.testing.assert_close(got[k], full[rank * L:(rank + 1) * L], rtol=1e-5,
                                       atol=1e-5 * float(full.abs().max()),
                                       msg=lambda m, k=k, r=rank: f"seed {seed}, rank {r}, {k}: {m}")
        assert got["out"].abs().max() > 0
    assert not res[-1][0]["w1_grad"][-1].any()           # the expert no token chose: no gradient


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
            stats, outs = [], []
            for i, ids_WSLK in enumerate(mbs):
                ids = torch.from_numpy(np.ascontiguousarray(ids_WSLK[rank, :, layer_idx, :])).long()
                with torch.no_grad():
                    y = layer(xs[i], routing=(ids, gates[i]))
                if i >= s["warmup"]:
                    stats.append(layer.last_stats)   # a rank reports its own node's GPUs; the caller joins the nodes
                    outs.append(y)
            ys[policy] = outs
            err = max(float((a - b).abs().max()) for a, b in zip(outs, ys["none"], strict=True))
            out[(layer_idx, policy)] = {"stats": stats, "max_abs_diff_vs_none": err}
    return out


def _join_ranks(per_rank: list[dict], key) -> dict:
    """One (layer, policy) over the whole group: the means over micro-batches of ``feplb.join_stats``."""
    import numpy as np

    from feplb import join_stats

    joined = [join_stats([res[key]["stats"][i] for res in per_rank]) for i in range(len(per_rank[0][key]["stats"]))]
    return {"before": float(np.mean([j["token_straggler_before"] for j in joined])),
            "after": float(np.mean([j["token_straggler_after"] for j in joined])),
            "rows_moved": float(np.mean([j["rows_moved"] for j in joined])),
            "max_abs_diff_vs_none": max(res[key]["max_abs_diff_vs_none"] for res in per_rank)}


@pytest.mark.dist
@pytest.mark.slow
def test_layer_cpu_trace(benchmark):
    """The MoE layer itself (not the simulator) on real routing: ESFT trace ids fed to ``layer(x, routing=...)`` on
    4 gloo ranks (2 nodes x 2); token stragglers are device-independent, the outputs equal plain EP's."""

    root = Path(os.environ.get("FEPLB_TRACES", Path(__file__).resolve().parents[2] / "shared" / "routing_traces"))
    path = root / "esft_deepseek_v2_lite" / "esft_vanilla_lite_law.npz"
    if not path.exists():
        pytest.skip(f"routing trace not found: {path}")
    s = TRACE_SHAPE
    per_rank = run_dist(_trace_worker, s["world"], str(path), s, timeout_s=900)
    table = {}
    for policy in TRACE_POLICIES:
        rows = [_join_ranks(per_rank, (layer, policy)) for layer in s["layers"]]
        before = sum(r["before"] for r in rows) / len(rows)
        after = sum(r["after"] for r in rows) / len(rows)
        table[policy] = {"token_straggler_before": before, "token_straggler_after": after,
                         "reduction": 1 - after / before if before else 0.0,
                         "rows_moved": sum(r["rows_moved"] for r in rows) / len(rows),
                         "max_abs_diff_vs_none": max(r["max_abs_diff_vs_none"] for r in rows)}
    info = {"trace": str(path), "shape": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
            "results": table, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "command": "pytest bench/bench_layer.py -s -p no:randomly --benchmark-enable -k trace"}
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nMoELayer on real routing (ESFT law, layers {list(s['layers'])}, EP {s['world']} as "
          f"{s['world'] // s['gpus_per_node']} nodes x {s['gpus_per_node']}, {s['tokens']} tokens/rank, "
          f"mean of {s['measured']} micro-batches):")
    for policy, r in table.items():
        print(f"  {policy:20s} token straggler {r['token_straggler_before']:7.1f} -> {r['token_straggler_after']:7.1f} "
              f"({100 * r['reduction']:5.1f}% lower)  rows moved {r['rows_moved']:7.1f}  "
              f"max |out - plain EP| {r['max_abs_diff_vs_none']:.2e}")

    def check():
        for policy, r in table.items():
            assert r["max_abs_diff_vs_none"] <= 1e-4, (policy, r)
        assert table["feplb-split"]["token_straggler_after"] < table["feplb-split"]["token_straggler_before"]

    _write_checked(benchmark, "runs/bench_layer_trace_cpu.json", info, check)
