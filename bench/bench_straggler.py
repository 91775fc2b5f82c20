"""GEMM straggler of an EP group on real routing, measured on one GPU: plain EP next to the balancing policies.

The GEMM straggler of one MoE layer and micro-batch is ``max - mean`` over the EP ranks of each rank's expert
grouped-GEMM time (``feplb.sched.metrics.gemm_straggler``, the simulator's and the paper's "GEMM straggler": how
long the group waits for its slowest GPU); the time of the slowest rank itself (``slowest_rank_ms``) is recorded
beside it.

Workload: the ESFT routing trace (DeepSeek-V2-Lite: 64 experts, top-6; its expert shape H = 2048, F = 1408, bf16),
EP = 8 in one node, 2048 tokens per GPU, 4 dynamic experts per GPU, layers ``LAYERS`` x ``MICROBATCHES``
micro-batches drawn as ``feplb simulate`` draws them (same seed), after ``HISTORY`` micro-batches that only feed
the policies' histories. For each (layer, micro-batch) every policy of ``POLICIES`` plans from the same counts
(``make_plan``, checked by ``Plan.validate``), and each rank's work under the plan is split into GEMM groups
exactly as the cost model charges it (``CostModel.gemm_times_W``): per expert at home the rows no move takes, per
move its rows on the GPU that computes them. Every routed row is one real row of a global input; rank ``d``'s
input gathers its rows, its weights gather its groups' experts, and its forward expert MLP (gate/up grouped GEMM,
SwiGLU, down grouped GEMM) runs

* with ``feplb.experts.expert_mlp`` (the ``feplb::grouped_mm`` / ``feplb::swiglu`` custom ops: Triton on CUDA),
* beside it, when this torch and GPU have it, with ``torch._grouped_mm`` for both GEMMs (same SwiGLU op),

each rank's output checked against an fp32 per-expert reference of the whole micro-batch (the rows of every plan
computed once, in the right place) before anything is timed. Times: CUDA events around one rank's call, behind a
short GPU sleep so that no launch gap is timed (``cuda_timer``), ``WARMUP_REPS`` + ``REPS`` rounds interleaved over
policies, ranks and implementations so that drift hits them alike; a rank's time is the median of its rounds. Per
(layer, micro-batch, policy, implementation): the per-rank times, the GEMM straggler, the slowest rank, and the cost
model's prediction for the same plan (the model the planners use, with the trace's expert shape) to recalibrate it;
per policy the mean and median over samples and the reduction against plain EP (``1 - mean(policy) / mean(none)``,
as the simulator reduces).

ASSUMED, not measured: the ranks run at the same time on their own GPUs. Here one GPU runs the ranks' grouped GEMMs
one after another; each is timed alone with the whole GPU to itself, which is what an H200 of an EP group gives
its rank. Not included: dispatch, phase-2 copies, planning, backward (the layer benchmark covers those on several
GPUs).

Results: ``$FEPLB_BENCH_STRAGGLER_JSON`` (default ``runs/bench_straggler_gpu.json``), with machine, versions,
command, workload, assumptions; ``gemm_straggler_reduction_pct`` is the paper policy's (``feplb``, the policy the
target "GEMM straggler >= 80% lower on skewed real routing" is about) with our kernel; every policy's is under
``policies``. Run: ``.venv/bin/pytest bench/bench_straggler.py -m gpu -s --benchmark-enable``. The trace is looked
up as ``bench/bench_overlap.py`` does ($FEPLB_TRACES, ../shared/routing_traces, .traces/); missing, the GPU test
skips naming the paths.

CPU part (CI, seconds): the same code path at a tiny shape on a synthetic skewed workload (and on the trace's
counts when present), the custom ops running their pure-torch twins: every routed row computed exactly once for
every plan, per-rank rows equal to the plan's, the groups costed as the cost model costs the plan, the stragglers
and reductions recomputed from the recorded times, a wrong or failing kernel of ours failing the run. CPU timings
say nothing about a GPU and are labelled so.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from feplb.experts import expert_mlp
from feplb.files import write_json
from feplb.sched import CostModel, Plan, PolicyState, Topology, make_plan
from feplb.sched.metrics import gemm_straggler, token_straggler
from feplb.simulate import SimConfig

BENCH = Path(__file__).resolve().parent


def _sibling(name: str):
    """A sibling benchmark module (``bench/NAME.py``); pytest's importlib mode keeps ``bench/`` off sys.path."""
    key = f"_feplb_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


_overlap = _sibling("bench_overlap")   # trace lookup, the fp32 expert reference, the CUDA-event timer, the shape
_kernels = _sibling("bench_kernels")   # BaselineUnavailable, error_line, the autotuners' chosen configs

POLICIES = ("none", "feplb", "feplb-split", "eplb", "fastermoe")
TARGET_POLICY = "feplb"           # the paper policy: the one the 80% target names
IMPLS = ("feplb", "torch_grouped_mm")
LAYERS = (4, 14, 24)              # as the layer benchmark's trace test; spread over the model's 26 MoE layers
MICROBATCHES, HISTORY = 2, 8
REPS, WARMUP_REPS = 5, 1
SLEEP_CYCLES = 1_000_000          # ~0.5 ms of GPU sleep before each timed call, longer than a launch (cuda_timer)
EP, TOKENS, DYN, HIDDEN, FFN = _overlap.EP, _overlap.TOKENS, _overlap.DYN, _overlap.HIDDEN, _overlap.FFN
CUDA = torch.cuda.is_available()
ASSUMPTIONS = (
    "The EP ranks run at the same time on their own GPUs: one GPU ran the ranks' grouped GEMMs one after another, "
    "each timed alone with the whole GPU (CUDA events), and the straggler is computed over those times.",
    "GEMM straggler = max - mean over ranks of the per-rank expert grouped-GEMM time (feplb.sched.metrics."
    "gemm_straggler); slowest_rank_ms is the max itself.",
    "A rank's work is one grouped GEMM per projection over the groups the cost model charges "
    "(CostModel.gemm_times_W): its experts' rows left at home, and one group per move it computes.",
    "Forward only (gate/up grouped GEMM, SwiGLU, down grouped GEMM); no dispatch, phase-2 copies, planning or "
    "backward.",
)


# ---------------------------------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class Group:
    """One GEMM group of a rank: rows ``[a, b)`` of each range of ``expert`` (the expert's home order)."""

    expert: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return sum(b - a for a, b in self.ranges)


def rank_groups(plan: Plan, counts_WE: np.ndarray, topo: Topology) -> list[list[Group]]:
    """The GEMM groups each rank computes under ``plan``: per expert with rows, on its home GPU, the rows no move
    takes (one group, maybe several ranges); per move, its rows on its destination (one group each). These are the
    pieces ``CostModel.gemm_times_W`` charges."""
    n_E = topo.check_counts(counts_WE).sum(axis=0)
    home_E = plan.home_of(topo)
    moved: dict[int, list[tuple[int, int]]] = {}
    for m in plan.moves:
        moved.setdefault(m.expert, []).append((m.row_start, m.row_end))
    groups: list[list[Group]] = [[] for _ in range(topo.num_ranks)]
    for e in range(topo.num_experts):
        left, pos = [], 0
        for a, b in sorted(moved.get(e, ())):
            if a > pos:
                left.append((pos, a))
            pos = b
        if pos < n_E[e]:
            left.append((pos, int(n_E[e])))
        if left:
            groups[int(home_E[e])].append(Group(e, tuple(left)))
    for m in plan.moves:
        groups[m.dst].append(Group(m.expert, ((m.row_start, m.row_end),)))
    return groups


def row_offsets(counts_WE: np.ndarray) -> np.ndarray:
    """int64 [E]: where expert e's rows start in the global input (rows grouped by expert, home order inside)."""
    n_E = np.asarray(counts_WE).sum(axis=0)
    return np.concatenate([[0], np.cumsum(n_E)[:-1]]).astype(np.int64)


def rank_rows(groups: list[Group], offsets_E: np.ndarray) -> np.ndarray:
    """int64 [rows]: the global rows one rank computes, in its groups' order."""
    parts = [np.arange(offsets_E[g.expert] + a, offsets_E[g.expert] + b) for g in groups for a, b in g.ranges]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def check_groups(groups_W: list[list[Group]], plan: Plan, counts_WE: np.ndarray, topo: Topology,
                 cost: CostModel) -> None:
    """Every routed row is computed exactly once across the ranks, each rank computes the rows the plan says, and
    the groups cost what the cost model charges for the plan. Raises AssertionError naming the first violation."""
    offsets_E = row_offsets(counts_WE)
    total = int(np.asarray(counts_WE).sum())
    hits = np.bincount(np.concatenate([rank_rows(g, offsets_E) for g in groups_W]), minlength=total)
    assert hits.size == total and np.all(hits == 1), \
        f"{plan.policy}: rows computed {np.unique(hits).tolist()} times (each must be computed exactly once)"
    rows_W = [sum(g.rows for g in groups) for groups in groups_W]
    assert rows_W == plan.loads_after_W.tolist(), f"{plan.policy}: rank rows {rows_W} != plan {plan.loads_after_W}"
    us_W = [float(sum(cost.gemm_us(g.rows) for g in groups)) for groups in groups_W]
    model_W = cost.gemm_times_W(plan, counts_WE, topo)
    assert np.allclose(us_W, model_W, rtol=1e-9), f"{plan.policy}: groups cost {us_W}, the model charges {model_W}"


@dataclass
class Sample:
    """One (layer, micro-batch): its counts and every policy's plan and per-rank groups."""

    layer: int
    layer_name: str
    microbatch: int
    counts_WE: np.ndarray
    plans: dict[str, Plan]
    groups: dict[str, list[list[Group]]]


def plan_samples(workload, *, policies=POLICIES, layers=LAYERS, microbatches=MICROBATCHES, history=HISTORY,
                 ranks=EP, gpus_per_node=None, tokens=TOKENS, dyn=DYN, seed=0):
    """(samples, cost model, topology, expert shape record): the plans of ``policies`` for ``layers`` x
    ``microbatches`` of ``workload``, with the simulator's configuration, micro-batch draw and policy histories
    (``feplb.simulate``); layers past the workload's are dropped. gpus_per_node: default all ranks in one node."""
    config = SimConfig(num_ranks=ranks, gpus_per_node=gpus_per_node or ranks, tokens_per_rank=tokens, dyn=dyn,
                       policies=tuple(policies), microbatches=microbatches, warmup=history, seed=seed)
    if "none" not in config.policies:
        raise ValueError(f"policies: plain EP ('none') is the baseline and must be one of them, got {policies}")
    layers = [layer for layer in layers if 0 <= layer < workload.num_layers] or [0]
    topo = config.topology(workload.num_experts)
    cost, shape = config.cost_for(workload)
    states = {(p, layer): PolicyState(topo=topo, policy=p, refresh_every=config.refresh_every,
                                      ema_shift=config.ema_shift, eplb_slots=config.eplb_slots,
                                      eplb_groups=config.eplb_groups, replicas_mode=config.replicas_mode)
              for p in config.policies for layer in layers}
    gen = workload.microbatches(np.random.default_rng(seed), ranks, tokens)
    samples = []
    for step in range(history + microbatches):
        counts_LWE = next(gen)
        for layer in layers:
            counts_WE = np.ascontiguousarray(counts_LWE[layer])
            plans = {}
            for p in config.policies:
                state = states[p, layer]
                plan = make_plan(p, counts_WE, topo, state, tau=config.tau, min_chunk=config.min_chunk, cost=cost)
                plan.validate(counts_WE, topo, state)
                states[p, layer] = state.observe(counts_WE, plan)
                plans[p] = plan
            if step >= history:
                groups = {p: rank_groups(plan, counts_WE, topo) for p, plan in plans.items()}
                samples.append(Sample(layer=layer, layer_name=str(workload.layer_names[layer]),
                                      microbatch=step - history, counts_WE=counts_WE, plans=plans, groups=groups))
    return samples, cost, topo, shape


# ---------------------------------------------------------------------------------------------------- measuring

def torch_grouped_mlp(x, w1, w2, offsets):
    """The baseline: ``torch._grouped_mm`` for both projections, the same SwiGLU op as ours between them."""
    from feplb.kernels import swiglu

    if not hasattr(torch, "_grouped_mm"):
        raise _kernels.BaselineUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    offs = offsets.to(torch.int32)
    try:
        return torch._grouped_mm(swiglu(torch._grouped_mm(x, w1, offs=offs)), w2, offs=offs)
    except RuntimeError as err:  # e.g. unsupported on this GPU, dtype or layout
        raise _kernels.BaselineUnavailable(f"torch._grouped_mm: {str(err).splitlines()[0]}") from err


def feplb_mlp(x, w1, w2, offsets):
    """Ours: ``feplb.experts.expert_mlp`` (the layer's expert GEMMs)."""
    return expert_mlp(x, (w1, w2), offsets)


IMPL_FNS = {"feplb": feplb_mlp, "torch_grouped_mm": torch_grouped_mlp}


def cuda_timer(fn) -> float:
    """Milliseconds of one call on the GPU: CUDA events around it (bench_overlap's timer), behind a short GPU sleep
    queued first, so that the host's kernel launches run ahead and the time holds no launch gaps."""
    sleep = getattr(torch.cuda, "_sleep", None)
    return _overlap._timed_ms(fn, side=(lambda: sleep(SLEEP_CYCLES)) if sleep is not None else None)


def cpu_timer(fn) -> float:
    """Milliseconds of one call on the CPU (wall clock): for the CPU run only, never a GPU figure."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(samples: list[Sample], *, cost: CostModel, topo: Topology, device: str, dtype: torch.dtype,
            hidden: int, ffn: int, impls=IMPLS, timer=None, reps: int = REPS, warmup_reps: int = WARMUP_REPS,
            rel_tol: float = 2e-2, seed: int = 0, impl_fns=None, on_sample=None) -> tuple[list[dict], dict]:
    """Time every rank's expert MLP under every plan of every sample; return (per-sample results, baseline
    errors by implementation).

    Our implementation (``impls[0]`` must be ``"feplb"``) failing or computing a wrong row raises; a baseline that
    cannot run or disagrees with the reference is recorded in the errors and left out from then on.
    ``on_sample(results)`` is called after each sample (to save progress).
    """
    if not impls or impls[0] != "feplb":
        raise ValueError(f"impls: our implementation 'feplb' must come first, got {impls}")
    fns = {**IMPL_FNS, **(impl_fns or {})}
    timer = timer or (cuda_timer if device == "cuda" else cpu_timer)
    E = topo.num_experts
    gen = torch.Generator(device=device).manual_seed(seed)
    w1_all = (torch.randn(E, hidden, 2 * ffn, device=device, generator=gen) / hidden ** 0.5).to(dtype)
    w2_all = (torch.randn(E, ffn, hidden, device=device, generator=gen) / ffn ** 0.5).to(dtype)
    total = int(samples[0].counts_WE.sum())
    rows = torch.randn(total, hidden, device=device, generator=gen).to(dtype)
    active = list(impls)
    errors: dict[str, str] = {}
    results = []
    for sample in samples:
        n_E = sample.counts_WE.sum(axis=0)
        offsets_E = row_offsets(sample.counts_WE)
        want = _overlap._gemm_reference(rows, w1_all, w2_all, n_E.tolist())   # fp32 [total, H], bf16 roundings
        scale = float(want.abs().max())
        cases: dict[tuple[str, int], tuple] = {}
        for policy, groups_W in sample.groups.items():
            check_groups(groups_W, sample.plans[policy], sample.counts_WE, topo, cost)
            for d, groups in enumerate(groups_W):
                idx = torch.from_numpy(rank_rows(groups, offsets_E)).to(device)
                experts = torch.tensor([g.expert for g in groups], dtype=torch.long, device=device)
                # int64 as the layer passes them (torch_grouped_mlp converts for torch._grouped_mm)
                ends = np.cumsum([g.rows for g in groups], dtype=np.int64)
                cases[policy, d] = (rows[idx], w1_all[experts], w2_all[experts],
                                    torch.from_numpy(ends).to(device), idx)
        # Correct before timed: each rank's rows against the reference rows they are.
        for (policy, d), (x, w1, w2, offs, idx) in cases.items():
            for impl in list(active) if x.shape[0] else ():
                try:
                    got = fns[impl](x, w1, w2, offs)
                    err = float((got.float() - want[idx]).abs().max()) if got.shape[0] else 0.0
                    assert got.shape == (x.shape[0], hidden) and err <= rel_tol * scale, \
                        f"{impl} on rank {d} under {policy}: max |error| {err:.3g} > {rel_tol} x {scale:.3g}"
                except (_kernels.BaselineUnavailable, RuntimeError, AssertionError) as why:
                    if impl == "feplb":
                        raise
                    errors[impl] = _kernels.error_line(why)
                    active.remove(impl)
        times = {key: {impl: [] for impl in active} for key in cases}
        for rep in range(warmup_reps + reps):
            for key, (x, w1, w2, offs, _) in cases.items():
                for impl in list(active):
                    try:   # a rank with nothing to compute waits for nothing
                        t = timer(lambda impl=impl, x=x, w1=w1, w2=w2, offs=offs: fns[impl](x, w1, w2, offs)) \
                            if x.shape[0] else 0.0
                    except Exception as why:
                        if impl == "feplb":
                            raise
                        errors[impl] = _kernels.error_line(why)
                        active.remove(impl)
                        continue
                    if rep >= warmup_reps:
                        times[key][impl].append(t)
        result = {"layer": sample.layer, "layer_name": sample.layer_name, "microbatch": sample.microbatch,
                  "policies": {}}
        for policy, plan in sample.plans.items():
            model_ms_W = cost.gemm_times_W(plan, sample.counts_WE, topo) / 1e3
            entry = {"token_straggler": token_straggler(plan.loads_after_W),
                     "token_straggler_before": token_straggler(plan.loads_before_W),
                     "rows_W": plan.loads_after_W.tolist(), "groups_W": [len(g) for g in sample.groups[policy]],
                     "rows_moved": int(plan.rows_moved), "model_ms_W": model_ms_W.tolist(),
                     "model_gemm_straggler_ms": gemm_straggler(model_ms_W),
                     "model_slowest_rank_ms": float(model_ms_W.max()), "impls": {}}
            for impl in active:
                ms_W = [statistics.median(times[policy, d][impl]) for d in range(topo.num_ranks)]
                entry["impls"][impl] = {"ms_W": ms_W, "gemm_straggler_ms": gemm_straggler(ms_W),
                                        "slowest_rank_ms": max(ms_W)}
            result["policies"][policy] = entry
        results.append(result)
        del cases, want
        if on_sample is not None:
            on_sample(results)
    # a baseline dropped part-way is left out of every sample, so all samples compare the same implementations
    for result in results:
        for entry in result["policies"].values():
            entry["impls"] = {k: v for k, v in entry["impls"].items() if k in active}
    return results, errors


def _pct_lower(before: float, after: float) -> float | None:
    return 100.0 * (1.0 - after / before) if before > 0 else None


def summarize(results: list[dict], target_policy: str = TARGET_POLICY) -> dict:
    """Per policy, over samples: mean and median GEMM straggler and slowest rank (measured per implementation, and
    modelled), mean token straggler, and each one's reduction against plain EP (``1 - mean / mean(none)``); the
    headline keys for ``target_policy`` with our kernel."""
    policies = list(results[0]["policies"])
    impls = list(results[0]["policies"]["none"]["impls"])

    def series(policy, getter):
        return [getter(r["policies"][policy]) for r in results]

    def stats(policy, getter):
        v = series(policy, getter)
        base = float(np.mean(series("none", getter)))
        return {"mean": float(np.mean(v)), "median": float(statistics.median(v)),
                "reduction_pct": _pct_lower(base, float(np.mean(v)))}

    out = {"policies": {}}
    for p in policies:
        out["policies"][p] = {
            "token_straggler": stats(p, lambda e: e["token_straggler"]),
            "model_gemm_straggler_ms": stats(p, lambda e: e["model_gemm_straggler_ms"]),
            "model_slowest_rank_ms": stats(p, lambda e: e["model_slowest_rank_ms"]),
            "measured": {impl: {"gemm_straggler_ms": stats(p, lambda e, i=impl: e["impls"][i]["gemm_straggler_ms"]),
                                "slowest_rank_ms": stats(p, lambda e, i=impl: e["impls"][i]["slowest_rank_ms"])}
                         for impl in impls}}
    if target_policy in out["policies"] and "feplb" in impls:
        before = out["policies"]["none"]["measured"]["feplb"]["gemm_straggler_ms"]
        after = out["policies"][target_policy]["measured"]["feplb"]["gemm_straggler_ms"]
        tok_before, tok = out["policies"]["none"]["token_straggler"], out["policies"][target_policy]["token_straggler"]
        out.update(gemm_straggler_reduction_pct=after["reduction_pct"], gemm_straggler_policy=target_policy,
                   gemm_straggler_before_ms=before["mean"], gemm_straggler_after_ms=after["mean"],
                   token_straggler_before=tok_before["mean"], token_straggler_after=tok["mean"],
                   token_straggler_reduction_pct=tok["reduction_pct"])
    out["gemm_straggler_reduction_pct_by_policy"] = {
        p: v["measured"]["feplb"]["gemm_straggler_ms"]["reduction_pct"] for p, v in out["policies"].items()
        if p != "none" and "feplb" in v["measured"]}
    return out


def machine_info(device: str) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()})",
            "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
            "timings": "GPU (CUDA events)" if device == "cuda" else "CPU wall clock, pure-torch twins: not GPU figures",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": platform.python_version(), "command": " ".join(sys.argv)}


def run(workload, out: Path, *, device: str, dtype: torch.dtype, hidden: int, ffn: int, ranks: int = EP,
        tokens: int = TOKENS, dyn: int = DYN, layers=LAYERS, microbatches: int = MICROBATCHES, history: int = HISTORY,
        policies=POLICIES, impls=IMPLS, reps: int = REPS, rel_tol: float = 2e-2, timer=None, impl_fns=None,
        source: str | None = None) -> dict:
    """Plan, measure and write the JSON (progress after every sample with ``complete: false`` and no headline
    keys; the summary once every sample is measured). Returns the final document."""
    samples, cost, topo, shape = plan_samples(workload, policies=policies, layers=layers, microbatches=microbatches,
                                              history=history, ranks=ranks, gpus_per_node=ranks, tokens=tokens,
                                              dyn=dyn)
    doc = {"complete": False, "machine": machine_info(device),
           "workload": {"name": workload.name, "source": source, "experts": topo.num_experts,
                        "top_k": workload.top_k, "ep": ranks, "gpus_per_node": ranks, "tokens_per_rank": tokens,
                        "dyn": dyn, "layers": sorted({s.layer for s in samples}), "microbatches": microbatches,
                        "history": history, "policies": list(policies), "hidden": hidden, "ffn": ffn,
                        "dtype": str(dtype).removeprefix("torch."), "reps": reps,
                        "cost_model_expert_shape": shape},
           "assumptions": list(ASSUMPTIONS)}

    def save(results):
        write_json(out, {**doc, "samples": results})

    results, errors = measure(samples, cost=cost, topo=topo, device=device, dtype=dtype, hidden=hidden, ffn=ffn,
                              impls=impls, timer=timer, reps=reps, rel_tol=rel_tol, impl_fns=impl_fns,
                              on_sample=save)
    doc.update(complete=True, baseline_errors=errors, configs=_kernels.chosen_configs() if device == "cuda" else {},
               **summarize(results), samples=results)
    write_json(out, doc)
    return doc


def print_table(doc: dict) -> None:
    print(f"\n[{doc['machine']['device']}] GEMM straggler (max - mean over {doc['workload']['ep']} ranks, ms) and "
          f"slowest rank, mean of {len(doc['samples'])} (layer, micro-batch) samples:")
    for p, v in doc["policies"].items():
        parts = [f"{impl}: {m['gemm_straggler_ms']['mean']:.4f} ({_fmt(m['gemm_straggler_ms']['reduction_pct'])}), "
                 f"slowest {m['slowest_rank_ms']['mean']:.4f}" for impl, m in v["measured"].items()]
        print(f"  {p:12s} tokens {v['token_straggler']['mean']:8.1f}  model {v['model_gemm_straggler_ms']['mean']:.4f}"
              f"  " + "  ".join(parts))


def _fmt(pct) -> str:
    return "-" if pct is None else f"{pct:.1f}% lower"


# ---------------------------------------------------------------------------------------------------- CPU

TINY = dict(ranks=4, tokens=32, dyn=2, hidden=32, ffn=16, microbatches=2, history=2, reps=2)


def _tiny_workload():
    from feplb.traces import SyntheticWorkload

    return SyntheticWorkload(kind="zipf", num_experts=16, top_k=2, num_layers=2, alpha=1.5, seed=3)


@pytest.mark.parametrize("which", ["synthetic", "esft"])
def test_every_row_computed_exactly_once(which):
    """Host side of the GPU run: for every plan, the ranks' groups cover every routed row exactly once, carry the
    plan's per-rank rows, and cost what the cost model charges."""
    if which == "esft":
        path = _overlap.find_trace()
        if path is None:
            pytest.skip(_overlap._no_trace())
        from feplb.traces import load_trace

        samples, cost, topo, _ = plan_samples(load_trace(path), tokens=256, microbatches=1, history=2)
    else:
        samples, cost, topo, _ = plan_samples(_tiny_workload(), ranks=4, tokens=64, dyn=2, layers=(0, 1))
    moved = set()
    for s in samples:
        assert set(s.plans) == set(POLICIES)
        for p, groups_W in s.groups.items():
            check_groups(groups_W, s.plans[p], s.counts_WE, topo, cost)
            if s.plans[p].moves:
                moved.add(p)
            assert all(g.rows > 0 for groups in groups_W for g in groups)
    assert moved >= {"feplb", "feplb-split", "eplb"}, f"policies that moved rows: {sorted(moved)}"


def test_groups_of_a_split_expert():
    """An expert whose middle rows move: its home keeps one group of two ranges, the helper one group."""
    topo = Topology(num_ranks=2, gpus_per_node=2, num_experts=4, dyn=1)
    counts = np.array([[5, 1, 1, 1], [5, 1, 1, 1]])
    from feplb.sched import Move

    plan = Plan(policy="feplb-split", moves=(Move(0, 0, 1, 3, 7),), weight_copies=((0, 0, 1),),
                dynamic_WD=np.array([[0], [2]]), loads_before_W=np.array([12, 4]), loads_after_W=np.array([8, 8]))
    plan.validate(counts, topo)
    groups = rank_groups(plan, counts, topo)
    assert groups == [[Group(0, ((0, 3), (7, 10))), Group(1, ((0, 2),))],
                      [Group(2, ((0, 2),)), Group(3, ((0, 2),)), Group(0, ((3, 7),))]]
    assert rank_rows(groups[1], row_offsets(counts)).tolist() == [12, 13, 14, 15, 3, 4, 5, 6]
    check_groups(groups, plan, counts, topo, CostModel(hidden=8, ffn=8))
    bad = [[Group(0, ((0, 3),)), Group(1, ((0, 2),))], groups[1]]        # rows 7..9 of expert 0 nowhere
    with pytest.raises(AssertionError, match="exactly once"):
        check_groups(bad, plan, counts, topo, CostModel(hidden=8, ffn=8))


def test_straggler_cpu_twin(benchmark, tmp_path):
    """The whole path at a tiny shape on the CPU (the custom ops' pure-torch twins): outputs checked, stragglers
    and reductions recomputed from the recorded times. CPU wall-clock times, labelled so: no GPU figure."""
    t = dict(TINY)
    hidden, ffn = t.pop("hidden"), t.pop("ffn")
    out = tmp_path / "straggler.json"
    doc = run(_tiny_workload(), out, device="cpu", dtype=torch.float32, hidden=hidden, ffn=ffn, layers=(0, 1),
              rel_tol=1e-4, **t)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["complete"] and "not GPU" in doc["machine"]["timings"] and doc["machine"]["device"].startswith("CPU")
    assert len(doc["samples"]) == 2 * t["microbatches"] and doc["assumptions"]
    for r in doc["samples"]:
        for entry in r["policies"].values():
            for m in entry["impls"].values():
                ms = m["ms_W"]
                assert len(ms) == t["ranks"] and all(v > 0 and math.isfinite(v) for v in ms)
                assert m["slowest_rank_ms"] == max(ms)
                assert math.isclose(m["gemm_straggler_ms"], max(ms) - sum(ms) / len(ms), rel_tol=1e-12)
            assert sum(entry["rows_W"]) == t["ranks"] * t["tokens"] * 2
    impls = list(doc["samples"][0]["policies"]["none"]["impls"])
    assert impls[0] == "feplb" and set(impls) | set(doc["baseline_errors"]) == set(IMPLS)
    for p in POLICIES:
        for impl in impls:
            vals = [r["policies"][p]["impls"][impl]["gemm_straggler_ms"] for r in doc["samples"]]
            base = [r["policies"]["none"]["impls"][impl]["gemm_straggler_ms"] for r in doc["samples"]]
            got = doc["policies"][p]["measured"][impl]["gemm_straggler_ms"]
            assert math.isclose(got["mean"], sum(vals) / len(vals), rel_tol=1e-12)
            assert math.isclose(got["reduction_pct"], 100 * (1 - sum(vals) / sum(base)), rel_tol=1e-9, abs_tol=1e-9)
    tok = [r["policies"]["feplb"]["token_straggler"] for r in doc["samples"]]
    tok0 = [r["policies"]["none"]["token_straggler"] for r in doc["samples"]]
    assert doc["gemm_straggler_policy"] == "feplb"
    assert doc["gemm_straggler_reduction_pct"] == doc["policies"]["feplb"]["measured"]["feplb"]["gemm_straggler_ms"][
        "reduction_pct"] == doc["gemm_straggler_reduction_pct_by_policy"]["feplb"]
    assert math.isclose(doc["token_straggler_reduction_pct"], 100 * (1 - sum(tok) / sum(tok0)), rel_tol=1e-9)
    assert set(doc["gemm_straggler_reduction_pct_by_policy"]) == set(POLICIES) - {"none"}
    # pytest-benchmark's own timing: the expert MLP (the CPU twin) on 64 rows in 4 equal groups at the tiny shape,
    # a fixed reference of the twin's speed, not one of the run's GEMMs (those are in the document, kept in
    # extra_info with its conditions)
    benchmark.extra_info.update(machine=doc["machine"], policies=doc["policies"],
                                gemm_straggler_reduction_pct_by_policy=doc["gemm_straggler_reduction_pct_by_policy"],
                                token_straggler_reduction_pct=doc["token_straggler_reduction_pct"])
    x = torch.randn(64, hidden)
    w1, w2 = torch.randn(4, hidden, 2 * ffn), torch.randn(4, ffn, hidden)
    benchmark.group = "straggler CPU twin"
    assert benchmark(feplb_mlp, x, w1, w2, torch.tensor([16, 32, 48, 64])).shape == (64, hidden)


def test_our_kernel_wrong_or_failing_fails_a_baseline_is_dropped(tmp_path):
    t = dict(TINY, microbatches=1, reps=1)
    hidden, ffn = t.pop("hidden"), t.pop("ffn")
    common = dict(device="cpu", dtype=torch.float32, hidden=hidden, ffn=ffn, layers=(0,), rel_tol=1e-4, **t)

    def zeros(x, w1, w2, offs):
        return torch.zeros(x.shape[0], w2.shape[-1])

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(AssertionError, match="feplb on rank .* max \\|error\\|"):
        run(_tiny_workload(), tmp_path / "a.json", impl_fns={"feplb": zeros}, **common)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run(_tiny_workload(), tmp_path / "b.json", impl_fns={"feplb": broken}, **common)
    # Failing in the second sample: the progress written after the first has no headline keys, so a report cannot
    # mistake an unfinished run for a result.
    per_sample = len(POLICIES) * t["ranks"] * (1 + WARMUP_REPS + t["reps"])
    calls = []

    def fails_later(*args):
        calls.append(1)
        return broken() if len(calls) > per_sample else feplb_mlp(*args)

    with pytest.raises(RuntimeError, match="illegal memory access"):
        run(_tiny_workload(), tmp_path / "d.json", impl_fns={"feplb": fails_later}, **dict(common, microbatches=2))
    progress = json.loads((tmp_path / "d.json").read_text())
    assert progress["complete"] is False and len(progress["samples"]) == 1
    assert "gemm_straggler_reduction_pct" not in progress
    doc = run(_tiny_workload(), tmp_path / "c.json", impl_fns={"torch_grouped_mm": zeros}, **common)
    assert "max |error|" in doc["baseline_errors"]["torch_grouped_mm"]
    assert all(list(e["impls"]) == ["feplb"] for r in doc["samples"] for e in r["policies"].values())


def test_cuda_timer_queues_a_sleep_before_the_timed_call(monkeypatch):
    """The GPU timer is bench_overlap's event timer with a GPU sleep as its side work (queued before the start
    event), so the call's launches are queued before the GPU reaches them."""
    order = []

    def fake_timed_ms(fn, side=None):
        assert side() is None      # nothing to join: the sleep runs on the timed stream itself
        order.append("start event")
        fn()
        return 0.25

    monkeypatch.setattr(_overlap, "_timed_ms", fake_timed_ms)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append(("sleep", cycles)), raising=False)
    assert cuda_timer(lambda: order.append("call")) == 0.25
    assert order == [("sleep", SLEEP_CYCLES), "start event", "call"]


# ---------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gemm_straggler_gpu(benchmark):
    path = _overlap.find_trace()
    if path is None:
        pytest.skip(_overlap._no_trace())
    from feplb.traces import load_trace

    trace = load_trace(path)
    shape = trace.expert_shape
    hidden, ffn = (shape.hidden, shape.ffn) if shape is not None else (HIDDEN, FFN)
    out = Path(os.environ.get("FEPLB_BENCH_STRAGGLER_JSON", "runs/bench_straggler_gpu.json"))
    doc = run(trace, out, device="cuda", dtype=torch.bfloat16, hidden=hidden, ffn=ffn, source=str(path))
    print_table(doc)
    benchmark.extra_info.update({k: v for k, v in doc.items() if k not in ("samples", "policies")})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    for r in doc["samples"]:
        for p, entry in r["policies"].items():
            ms = entry["impls"]["feplb"]["ms_W"]
            assert all(math.isfinite(v) and v > 0 for v in ms), (r["layer"], r["microbatch"], p, ms)
    assert doc["gemm_straggler_before_ms"] > 0, "plain EP shows no GEMM straggler on skewed real routing"
