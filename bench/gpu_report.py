"""The GPU check's verdict: every step and every target of ../shared/design/targets.md, PASS / FAIL / NOT RUN.

Reads what one run of ``bench/gpu_check.sh`` left behind and prints two tables, the targets last:

* ``OUT/machine.json``, ``OUT/bench_kernels.json``, ``OUT/bench_overlap.json``, ``OUT/bench_straggler.json``,
  ``OUT/bench_layer.json``: written by the script and the benchmarks (a missing file or key makes its targets
  NOT RUN, never PASS);
* ``WORK/steps.tsv``: one line per step, ``name<TAB>rc<TAB>seconds<TAB>mode[<TAB>note]`` (mode ``run``, ``dry``,
  or ``budget``: skipped, the check's time budget spent; the note says why, or that the step's limit was cut);
* ``WORK/junit_<step>.xml``: pytest's junit report of each step; ``WORK/bench_sched.json``: the planner
  benchmark's pytest-benchmark JSON.

Writes ``OUT/report.json`` (steps and targets) and exits 1 when any step or target FAILED, else 0 (a dry run,
where everything is NOT RUN, exits 0).

Keys read (the first one present wins; nested dicts are searched):

* bench_kernels.json ``results``: rows ``{bench: grouped_mm, impl: feplb | feplb_dw_persistent (op dw only) |
  torch_grouped_mm | dense, op: forward | dx | dw, proj, dist, rows_per_expert, tflops}`` and ``{bench: permute,
  impl: permute | unpermute | copy, dist, rows_per_expert, gbps}``; a row with ``error`` is a failure (ours) or an
  unavailable baseline;
* bench_overlap.json: ``copy_engine_slowdown_pct``, else ``100 * (gemm_with_h2d_ms / static_gemm_ms - 1)``;
  ``plan_hidden`` (the planner thread's time vs the static GEMM, measured); ``copy_fits_h2d`` (plan + the plan's
  bytes copied host to device over PCIe fit beside the GEMM: True decides, since a node's NVLink peer copy is
  faster; False decides nothing on one GPU: NOT RUN), with ``copy_ms_h2d`` and ``copy_ms_nvlink_modelled`` (a
  model, shown, never a verdict) beside;
* bench_layer.json (then bench_overlap.json): ``host_syncs_after_counts`` (must be 0), else
  ``host_syncs_per_forward`` (a number or one per variant, the counts all-gather's own sync included: at most 1),
  else the runtime test ``test_no_host_sync_after_counts_one_gpu`` / ``_nccl`` (passed: no sync after the counts);
  a bench_layer.json with ``processes_per_gpu`` > 1 (several processes time-slicing one GPU) has that, its
  ``transport`` and ``copy_path`` in the notes of the rows it fills;
  ``balanced_routing_overhead_pct``, else ``100 * (balanced_routing_over_plain - 1)``;
  ``exact`` / ``balanced_equals_plain`` (bool), else the GPU runtime tests
  whose name holds "equal" or "layer" (they compare balancing on with plain EP), with ``max_abs_diff_vs_plain``,
  ``max_abs_grad_diff_vs_plain`` and ``output_scale`` shown beside;
* bench_straggler.json (then bench_layer.json): ``gemm_straggler_reduction_pct`` (the paper policy's, ranks'
  grouped GEMMs timed on one GPU, run in parallel by assumption), with ``gemm_straggler_before_ms`` /
  ``gemm_straggler_after_ms``, ``gemm_straggler_policy`` and ``gemm_straggler_reduction_pct_by_policy`` shown
  beside; a file with ``complete: false`` (a run stopped part-way) counts for nothing;
* bench_sched.json: ``extra_info.fastest_p99_us`` against ``limit_p99_us`` (the wall ``p99_us`` in the note) of
  ``test_planner_latency[<shape>-<policy>]``.

    python bench/gpu_report.py OUT [--work WORK]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
# Tests that need two GPUs are the only ones allowed to skip in the one-GPU runtime step: their skip reason says
# "2 GPUs" ("2 CUDA GPUs", "two GPUs" too).
ALLOWED_RUNTIME_SKIP = re.compile(r"\b(2|two) (CUDA )?GPUs\b", re.IGNORECASE)
# nvshmem4py missing or not importing (tests/runtime/test_gpu.py's skip reason): those tests are NOT RUN, with the
# reason, in their own row; the rest of the runtime step still counts.
NVSHMEM_SKIP = "NVSHMEM unavailable"
SYNC_TESTS = ("test_no_host_sync_after_counts_one_gpu", "test_no_host_sync_after_counts_nccl")
TEST_STEPS = ("kernels", "runtime_gpu")
BENCH_STEPS = ("bench_kernels", "planner", "bench_overlap", "bench_straggler", "bench_layer", "ops_host",
               "calibrate")


# bench_kernels' rows of the project's own kernels (a failure of one fails the step; baselines may skip)
OUR_IMPLS = ("feplb", "feplb_dw_persistent", "permute", "unpermute")
PERSISTENT_DW = "feplb_dw_persistent"


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    measured: str
    verdict: str
    note: str = ""


# ---------------------------------------------------------------------------------------------------- inputs

def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(work: Path) -> dict[str, dict]:
    steps = {}
    try:
        lines = (work / "steps.tsv").read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        parts = line.split("\t")
        if len(parts) in (4, 5):
            name, rc, seconds, mode = parts[:4]
            steps[name] = {"rc": int(rc), "seconds": int(seconds), "mode": mode,
                           "note": parts[4] if len(parts) == 5 else ""}
    return steps


def read_junit(path: Path) -> dict | None:
    """{passed, failed, skipped: [(test, reason)], cases: {test: outcome}} of a pytest junit XML, or None."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {"passed": 0, "failed": 0, "skipped": [], "cases": {}}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"] += 1
            out["cases"][test] = "failed"
        elif (skip := case.find("skipped")) is not None:
            out["skipped"].append((test, skip.get("message", "")))
            out["cases"][test] = "skipped"
        else:
            out["passed"] += 1
            out["cases"][test] = "passed"
    return out


def find_key(doc, names: tuple[str, ...]):
    """The value of the first of ``names`` found in a JSON document (depth-first through dicts), or None."""
    if not isinstance(doc, dict):
        return None
    for name in names:
        if name in doc and doc[name] is not None:
            return doc[name]
    for value in doc.values():
        if isinstance(value, dict) and (found := find_key(value, names)) is not None:
            return found
    return None


# ---------------------------------------------------------------------------------------------------- steps

def step_rows(steps: dict[str, dict], junits: dict[str, dict | None], kernels: dict | None) -> list[Row]:
    """A step FAILS when it stopped at its time limit, exited with an error, or a test failed; a test step also
    when no test ran, and the runtime step when a one-GPU test skipped. A benchmark step where every case
    skipped is NOT RUN (its targets say what is missing)."""
    rows = []
    for name in (*TEST_STEPS, *BENCH_STEPS):
        step = steps.get(name)
        if step is None or step["mode"] != "run":
            why = ("not reached (the check stopped before it)" if step is None else
                   f"budget: {step['note']}" if step["mode"] == "budget" else "dry run")
            rows.append(Row(name=name, measured="-", verdict=NOT_RUN, note=why))
            if name == "runtime_gpu":
                nvshmem = Row(name=NVSHMEM_ROW, measured="-", verdict=NOT_RUN, note=why)
            continue
        rc, took = step["rc"], f"{step['seconds']} s"
        cut = f"; {step['note']}" if step.get("note") else ""
        junit = junits.get(name)
        summary = took if junit is None else \
            f"{junit['passed']} passed, {junit['failed']} failed, {len(junit['skipped'])} skipped, {took}"
        if name == "runtime_gpu":
            nvshmem = _nvshmem_row(junit)
        if rc in (124, 130, 137):
            rows.append(Row(name=name, measured=summary, verdict=FAIL,
                            note=f"stopped at its time limit (rc {rc}){cut}"))
            continue
        if (junit is not None and junit["failed"]) or rc not in (0, 5):
            rows.append(Row(name=name, measured=summary, verdict=FAIL, note=f"rc {rc}"))
            continue
        ours_failed = [r for r in (kernels or {}).get("results", []) if name == "bench_kernels" and "error" in r
                       and r.get("impl") in OUR_IMPLS]
        if ours_failed:
            r = ours_failed[0]
            rows.append(Row(name=name, measured=summary, verdict=FAIL,
                            note=f"{len(ours_failed)} of our cases failed, e.g. {_case(r)}: {r['error']}"))
            continue
        if rc == 5 or (junit is not None and junit["passed"] == 0):
            why = junit["skipped"][0][1] if junit and junit["skipped"] else "no test collected"
            verdict = FAIL if name in TEST_STEPS else NOT_RUN
            rows.append(Row(name=name, measured=summary, verdict=verdict, note=f"no test ran: {why}"))
            continue
        bad_skips = [(t, r) for t, r in (junit or {}).get("skipped", [])
                     if not ALLOWED_RUNTIME_SKIP.search(r) and not r.startswith(NVSHMEM_SKIP)]
        if name == "runtime_gpu" and bad_skips:
            test, reason = bad_skips[0]
            rows.append(Row(name=name, measured=summary, verdict=FAIL,
                            note=f"{len(bad_skips)} one-GPU test(s) skipped, e.g. {test}: {reason}"))
            continue
        rows.append(Row(name=name, measured=summary, verdict=PASS, note=cut[2:]))
    # the NVSHMEM row right after the runtime step's
    at = next(i for i, r in enumerate(rows) if r.name == "runtime_gpu") + 1
    return [*rows[:at], nvshmem, *rows[at:]]


NVSHMEM_ROW = "runtime_gpu: NVSHMEM tests"


def _nvshmem_row(junit: dict | None) -> Row:
    """NOT RUN, with nvshmem4py's import error, when the runtime step skipped tests for it; else they ran inside
    runtime_gpu and its verdict is theirs."""
    skipped = [(t, r) for t, r in (junit or {}).get("skipped", []) if r.startswith(NVSHMEM_SKIP)]
    if skipped:
        return Row(name=NVSHMEM_ROW, measured=f"{len(skipped)} test(s) skipped", verdict=NOT_RUN,
                   note=skipped[0][1])
    return Row(name=NVSHMEM_ROW, measured="-", verdict=NOT_RUN if junit is None else PASS,
               note="no junit report" if junit is None else "none skipped: their outcomes are runtime_gpu's")


# ---------------------------------------------------------------------------------------------------- targets

def _case(r: dict) -> str:
    parts = [r.get("proj"), r.get("op"), r.get("dist"), f"{r.get('rows_per_expert')}/expert"]
    return " ".join(str(p) for p in parts if p is not None)


def _moved_gbps(r: dict) -> float | None:
    """GB/s of a permute-bench row by the bytes its kernel must move: permute T distinct bf16 rows read and T x K
    written (runs before 2026-12-05 recorded 2 x T x K rows, the copy's count, for it), unpermute and the copy as
    recorded."""
    if r.get("impl") == "permute" and all(_number(r.get(k)) for k in ("T", "K", "D", "us")) and r["us"] > 0:
        return (r["T"] + r["T"] * r["K"]) * r["D"] * 2 / (r["us"] * 1e3)
    return r.get("gbps")


def _results(kernels: dict | None, bench: str) -> list[dict]:
    rows = (kernels or {}).get("results", [])
    return [r for r in rows if r.get("bench") == bench and "error" not in r]


def _ratio_row(name: str, pairs: list[tuple[float, str]], threshold: float, unit: str = "x") -> Row:
    """The worst of (value, case) pairs against ``value >= threshold``."""
    pairs = [(v, c) for v, c in pairs if isinstance(v, (int, float)) and math.isfinite(v)]
    if not pairs:
        return Row(name=name, measured="-", verdict=NOT_RUN, note="no measurement")
    value, case = min(pairs)
    text = f"{value:.2f}x" if unit == "x" else f"{value:.0f}{unit}" if unit == "%" else f"{value:.0f} {unit}"
    return Row(name=name, measured=f"{text} (worst: {case})", verdict=PASS if value >= threshold else FAIL,
               note=f"{len(pairs)} cases")


def _dw_row(default: list[tuple[float, str]], persistent: list[tuple[float, str]],
            speedup: list[tuple[float, str]]) -> Row:
    """The dW target, judged on the default dW kernel; the note adds the opt-in persistent variant timed in the same
    run (its worst ratio to forward, and its speed over the default dW case by case), for choosing the default."""
    row = _ratio_row("dW >= 0.85x forward", default, 0.85)
    persistent = [(v, c) for v, c in persistent if math.isfinite(v)]
    speedup = [(1 / v, c) for v, c in speedup if v and math.isfinite(v)]
    if not persistent:
        return row
    value, case = min(persistent)
    faster = sum(v > 1 for v, _ in speedup)
    extra = (f"persistent dW variant (opt-in, FEPLB_GROUPED_MM_DW_VARIANT=persistent): {value:.2f}x forward "
             f"(worst: {case}); {min(speedup)[0]:.2f}x-{max(speedup)[0]:.2f}x the default dW's speed, faster in "
             f"{faster} of {len(speedup)} cases" if speedup else
             f"persistent dW variant (opt-in): {value:.2f}x forward (worst: {case})")
    return Row(name=row.name, measured=row.measured, verdict=row.verdict,
               note=f"{row.note}; {extra}" if row.note else extra)


def kernel_targets(kernels: dict | None) -> list[Row]:
    gemm = _results(kernels, "grouped_mm")
    by = {(r["impl"], r["op"], r["proj"], r["dist"], r["rows_per_expert"]): r.get("tflops") for r in gemm}
    ours_fwd = {k[2:]: v for k, v in by.items() if k[:2] == ("feplb", "forward")}

    def vs(impl: str, op: str, base: dict, keep=lambda key: True) -> list[tuple[float, str]]:
        """(base / impl-op, case) for every case both measured: how far impl-op is from the base."""
        pairs = []
        for key, ours in base.items():
            other = by.get((impl, op, *key))
            if keep(key) and other and ours:
                pairs.append((ours / other, f"{key[0]} {key[1]} {key[2]}/expert"))
        return pairs

    rows = [
        _ratio_row("forward >= torch._grouped_mm at >= 256 rows/expert",
                   vs("torch_grouped_mm", "forward", ours_fwd, lambda k: k[2] >= 256), 1.0),
        _ratio_row("forward >= 650 TFLOP/s at >= 1024 rows/expert",
                   [(v, f"{k[0]} {k[1]} {k[2]}/expert") for k, v in ours_fwd.items() if k[2] >= 1024 and v], 650.0,
                   unit="TFLOP/s"),
        _ratio_row("dX >= 0.85x forward", [(1 / r, c) for r, c in vs("feplb", "dx", ours_fwd)], 0.85),
        _dw_row([(1 / r, c) for r, c in vs("feplb", "dw", ours_fwd)],
                [(1 / r, c) for r, c in vs(PERSISTENT_DW, "dw", ours_fwd)],
                vs(PERSISTENT_DW, "dw", {k[2:]: v for k, v in by.items() if k[:2] == ("feplb", "dw")})),
    ]
    perm = _results(kernels, "permute")
    gbps = {(r["impl"], r["dist"], r["rows_per_expert"]): _moved_gbps(r) for r in perm}
    for impl in ("permute", "unpermute"):
        pairs = [(v / gbps[("copy", d, n)], f"{d} {n}/expert") for (i, d, n), v in gbps.items()
                 if i == impl and v and gbps.get(("copy", d, n))]
        rows.append(_ratio_row(f"{impl} >= 0.80x device copy bandwidth", pairs, 0.80))
    return rows


def planner_targets(sched: dict | None) -> list[Row]:
    """The planner's own cost per micro-batch against its target (``bench_sched``'s asserted measure: the p99 over
    micro-batches of each one's fastest plan, with the limit scaled to the machine's speed in the same run); the raw
    wall-clock p99 goes in the note. At E=256, W=64 the target covers what one rank plans (its node's plan) and the
    peers' whole plans."""
    got: dict[str, list] = {"E128-W8": [], "E256-W64": []}
    for bench in (sched or {}).get("benchmarks", []):
        params, info = bench.get("params") or {}, bench.get("extra_info") or {}
        if "fastest_p99_us" in info and params.get("shape") in got and "limit_p99_us" in info:
            got[params["shape"]].append((info["fastest_p99_us"] / info["limit_p99_us"], info["fastest_p99_us"],
                                         info["limit_p99_us"], info.get("p99_us"), params.get("policy"),
                                         info.get("py_loop_ms"), info.get("slowdown_basis"), info.get("slowdown")))
    rows = []
    for shape, target in (("E128-W8", 50.0), ("E256-W64", 200.0)):
        name = f"planner p99 <= {target:.0f} us ({shape}, dyn=4)"
        if not got[shape]:
            rows.append(Row(name=name, measured="-", verdict=NOT_RUN, note="no measurement"))
            continue
        _, worst, limit, wall, policy, yardstick, basis, slowdown = max(got[shape], key=lambda g: g[0])
        scaled = ""
        if limit > target:
            # bench_sched's method: the target holds for a reference core; a slower one gets a proportional limit,
            # by its Python yardstick or its numpy one (before 2026-12-05: by the none baseline) against a reference
            if basis == "none" and _number(slowdown):
                speed = f" (none's plan {slowdown:.1f}x its reference time)"
            elif basis == "numpy" and _number(slowdown):
                speed = f" (small numpy calls {slowdown:.1f}x their reference time)"
            else:
                speed = f" (yardstick {yardstick:.0f} ms)" if _number(yardstick) else ""
            scaled = (f", the {target:.0f} us target scaled to this core's speed{speed}"
                      + ("; above the unscaled target" if worst > target else ""))
        rows.append(Row(name=name, measured=f"{worst:.1f} us (worst: {policy})",
                        verdict=PASS if worst <= limit else FAIL,
                        note=f"p99 of the fastest of repeats, limit {limit:.0f} us{scaled}"
                             + (f"; raw wall p99 {wall:.1f} us" if wall is not None else "")))
    return rows


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def runtime_targets(overlap: dict | None, layer: dict | None, runtime: dict | None,
                    straggler: dict | None = None) -> list[Row]:
    rows = []
    slowdown = find_key(overlap, ("copy_engine_slowdown_pct", "copy_slowdown_pct"))
    if slowdown is None:
        g = find_key(overlap, ("static_gemm_ms", "gemm_ms"))
        h = find_key(overlap, ("gemm_with_h2d_ms", "gemm_h2d_ms"))
        slowdown = 100 * (h / g - 1) if _number(g) and _number(h) and g else None
    rows.append(_limit_row("plan's copies slow concurrent expert GEMMs <= 1%", slowdown, 1.0, "%",
                           "copy-engine (pinned host-to-device) copy, the engine peer copies use, beside the static "
                           "GEMM"))
    rows.extend(_overlap_rows(overlap))
    conditions = _shared_gpu_note(layer)
    rows.append(_syncs_row(layer if layer is not None else overlap, runtime, conditions))
    overhead = find_key(layer, ("balanced_routing_overhead_pct",))
    if overhead is None:
        ratio = find_key(layer, ("balanced_routing_over_plain",))
        overhead = 100 * (ratio - 1) if _number(ratio) else None
    rows.append(_limit_row("balancing on <= 2% slower than plain EP on balanced routing", overhead, 2.0, "%",
                           conditions))
    rows.append(_straggler_row(straggler, layer, conditions))
    rows.append(_exactness_row(layer, runtime, conditions))
    return rows


PLAN_HIDDEN = "planning hides behind the static experts' GEMM"
COPIES_FIT = "phase-2 copies run beside the static experts' GEMM (copy volume vs the GEMM)"


def _overlap_rows(overlap: dict | None) -> list[Row]:
    """What one GPU decides about "the phase-2 copies run beside the static experts' GEMM, not after it": the
    planner thread's measured time against the GEMM, and the plan's bytes copied host to device over PCIe (the
    slower link) against it. A node copies them over NVLink, which one GPU cannot measure: a PCIe copy that fits
    decides PASS; one that does not decides nothing (NOT RUN); the NVLink time is a model, only ever shown."""
    g = find_key(overlap, ("static_gemm_ms",))
    plan_us, plan_p99 = find_key(overlap, ("plan_us_p50",)), find_key(overlap, ("plan_us_p99",))
    gemm = f"GEMM {g:.3f} ms" if _number(g) else "GEMM ?"
    hidden, slowed = find_key(overlap, ("plan_hidden",)), find_key(overlap, ("plan_thread_slowdown_pct",))
    first = find_key(overlap, ("plan_first_slowdown_pct",))
    if isinstance(hidden, bool):
        launch = find_key(overlap, ("static_gemm_launch_us",))
        issue = f"GEMM issue {launch:.0f} us + " if _number(launch) else ""
        plan = f"{issue}plan p50 {plan_us:.0f} us vs {gemm}" if _number(plan_us) else str(hidden)
        rows = [Row(name=PLAN_HIDDEN, measured=plan, verdict=PASS if hidden else FAIL,
                    note=_join("measured: planner thread beside the real static GEMM",
                               f"plan p99 {plan_p99:.0f} us" if _number(plan_p99) else "",
                               f"GEMM {slowed:+.1f}% with the planner thread started once it is queued (the "
                               "layer's order; a control)" if _number(slowed) else "",
                               f"{first:+.1f}% with it started before the GEMM's launch" if _number(first) else ""))]
    else:
        rows = [Row(name=PLAN_HIDDEN, measured="-", verdict=NOT_RUN, note="no measurement")]
    fits, h2d = find_key(overlap, ("copy_fits_h2d",)), find_key(overlap, ("copy_ms_h2d",))
    nvlink = find_key(overlap, ("copy_ms_nvlink_modelled",))
    model = f"; NVLink peer copy {nvlink:.3f} ms modelled (a model, not a verdict)" if _number(nvlink) else ""
    if not isinstance(fits, bool):
        rows.append(Row(name=COPIES_FIT, measured="-", verdict=NOT_RUN, note="no measurement"))
    elif fits:
        rows.append(Row(name=COPIES_FIT, measured=f"plan + PCIe copy {h2d:.3f} ms fit in {gemm}"
                        if _number(h2d) else "True", verdict=PASS,
                        note="measured host-to-device over PCIe, slower than the NVLink peer copy" + model))
    else:
        rows.append(Row(name=COPIES_FIT, measured=f"plan + PCIe copy {h2d:.3f} ms > {gemm}" if _number(h2d)
                        else "False", verdict=NOT_RUN,
                        note="one GPU cannot decide: its PCIe host-to-device copy is slower than the NVLink peer "
                             "copy a node uses" + model))
    return rows


def _shared_gpu_note(layer: dict | None) -> str:
    """The conditions of a bench_layer run with several processes on one GPU, for the notes of its rows."""
    per_gpu = find_key(layer, ("processes_per_gpu",))
    if not _number(per_gpu) or per_gpu <= 1:
        return ""
    how = ", ".join(f"{k.replace('_', ' ')} {v}" for k in ("transport", "copy_path")
                    if (v := find_key(layer, (k,))) is not None)
    return (f"{per_gpu:g} processes time-slice one GPU{f' ({how})' if how else ''}: times comparable with each "
            "other, not multi-GPU speed")


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _failed_tests(runtime: dict | None, is_case) -> list[str]:
    """Names of the runtime step's failed tests for which ``is_case(name)`` holds."""
    return [t.split("::")[-1] for t, o in (runtime or {}).get("cases", {}).items()
            if o == "failed" and is_case(t.split("::")[-1])]


def _is_equality_test(name: str) -> bool:
    """The GPU layer tests assert balancing on equals plain EP (tests/runtime/test_gpu.py)."""
    return "equal" in name or "layer" in name


def _syncs_row(doc: dict | None, runtime: dict | None = None, conditions: str = "") -> Row:
    """``host_syncs_after_counts`` must be 0; ``host_syncs_per_forward`` (a number, or one per layer variant)
    counts every sync of the forward, the counts all-gather's own included, so it may be 1. Without either, the
    runtime test that runs a forward and backward under ``set_sync_debug_mode("error")`` after the counts."""
    name = "blocking host syncs after the counts all-gather = 0"
    # A failed runtime sync test fails the target whatever a benchmark counted (another transport, another run).
    if failed := _failed_tests(runtime, lambda t: t in SYNC_TESTS):
        return Row(name=name, measured="> 0 after counts", verdict=FAIL,
                   note=f"runtime test {failed[0]} failed (forward + backward under set_sync_debug_mode('error') "
                        "after the counts step)")
    after = find_key(doc, ("host_syncs_after_counts",))
    if _number(after):
        return _limit_row(name, after, 0, "", _join("per layer forward", conditions))
    total = find_key(doc, ("host_syncs_per_forward", "host_syncs"))
    if _number(total):
        total = {"forward": total}
    if not isinstance(total, dict) or not total or not all(_number(v) for v in total.values()):
        return _sync_test_row(name, runtime)
    measured = ", ".join(f"{k}: {v:g}" for k, v in total.items())
    return Row(name=name, measured=measured, verdict=PASS if max(total.values()) <= 1 else FAIL,
               note=_join("syncs per forward, the counts all-gather's own (1 allowed) included", conditions))


def _sync_test_row(name: str, runtime: dict | None) -> Row:
    cases = {t: o for t, o in (runtime or {}).get("cases", {}).items() if t.split("::")[-1] in SYNC_TESTS}
    reasons = dict((runtime or {}).get("skipped", []))
    for test, outcome in cases.items():
        if outcome == "skipped":
            continue
        return Row(name=name, measured="0 after counts" if outcome == "passed" else "> 0 after counts",
                   verdict=PASS if outcome == "passed" else FAIL,
                   note=f"runtime test {test.split('::')[-1]} {outcome} (forward + backward under "
                        "set_sync_debug_mode('error') after the counts step)")
    skipped = [t for t, o in cases.items() if o == "skipped"]
    return Row(name=name, measured="-", verdict=NOT_RUN,
               note=f"no measurement; {skipped[0].split('::')[-1]} skipped: {reasons.get(skipped[0], '')}"
               if skipped else "no measurement")


def _straggler_row(straggler: dict | None, layer: dict | None, conditions: str = "") -> Row:
    """The GEMM straggler target: bench_straggler's measurement (one GPU, the ranks' grouped GEMMs one after
    another, parallel execution assumed) first, then the multi-GPU layer benchmark's."""
    name, target = "GEMM straggler >= 80% lower on skewed real routing", 80.0
    incomplete = ""
    if isinstance(straggler, dict) and straggler.get("complete") is False:
        incomplete = f"bench_straggler stopped after {len(straggler.get('samples') or [])} sample(s)"
        straggler = None
    value = straggler.get("gemm_straggler_reduction_pct") if isinstance(straggler, dict) else None
    if _number(value) and math.isfinite(value):
        before, after = straggler.get("gemm_straggler_before_ms"), straggler.get("gemm_straggler_after_ms")
        policy = straggler.get("gemm_straggler_policy", "?")
        ms = f", {before:.3f} -> {after:.3f} ms" if _number(before) and _number(after) else ""
        others = ", ".join(f"{p} {v:.0f}%" for p, v in (straggler.get("gemm_straggler_reduction_pct_by_policy")
                                                         or {}).items() if p != policy and _number(v))
        note = ("bench_straggler: each rank's grouped GEMM timed alone on one GPU, the ranks assumed to run in "
                "parallel on their own GPUs" + (f"; {others}" if others else ""))
        return Row(name=name, measured=f"{value:.1f}% ({policy}{ms})", verdict=PASS if value >= target else FAIL,
                   note=note)
    value = find_key(layer, ("gemm_straggler_reduction_pct",))
    if _number(value) and math.isfinite(value):
        return Row(name=name, measured=f"{value:.1f}%", verdict=PASS if value >= target else FAIL,
                   note=_join("bench_layer", conditions, incomplete))
    return Row(name=name, measured="-", verdict=NOT_RUN, note=incomplete or "no measurement")


def _exactness_row(layer: dict | None, runtime: dict | None, conditions: str = "") -> Row:
    name = "exactness: balancing on equals plain EP (outputs and gradients)"
    # A failed GPU equality test fails the target whatever bench_layer's own (smaller) run found.
    if failed := _failed_tests(runtime, _is_equality_test):
        return Row(name=name, measured=f"{len(failed)} GPU equality test(s) failed", verdict=FAIL,
                   note=_join(failed[0], conditions))
    exact = find_key(layer, ("exact", "balanced_equals_plain"))
    if isinstance(exact, bool):
        return Row(name=name, measured=str(exact), verdict=PASS if exact else FAIL,
                   note=_join("bench_layer", conditions))
    diffs = [find_key(layer, (k,)) for k in ("max_abs_diff_vs_plain", "max_abs_grad_diff_vs_plain", "output_scale")]
    beside = "" if not all(_number(d) for d in diffs) else \
        f"; bench_layer max |diff| out {diffs[0]:.3g}, grad {diffs[1]:.3g} (output scale {diffs[2]:.3g})"
    ran = [t for t, o in (runtime or {}).get("cases", {}).items()
           if o != "skipped" and _is_equality_test(t.split("::")[-1])]
    if not ran:
        return Row(name=name, measured="-", verdict=NOT_RUN, note="no GPU equality test ran" + beside)
    return Row(name=name, measured=f"{len(ran)} of {len(ran)} GPU equality tests passed", verdict=PASS,
               note="runtime tests" + beside)


def _limit_row(name: str, value, limit: float, unit: str, note: str = "") -> Row:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return Row(name=name, measured="-", verdict=NOT_RUN, note="no measurement")
    text = f"{value:.2f}{unit}" if unit else f"{value:g}"
    return Row(name=name, measured=text, verdict=PASS if value <= limit else FAIL, note=note)


# ---------------------------------------------------------------------------------------------------- report

def build(out: Path, work: Path) -> dict:
    steps = read_steps(work)
    junits = {name: read_junit(work / f"junit_{name}.xml") for name in (*TEST_STEPS, *BENCH_STEPS)}
    kernels = read_json(out / "bench_kernels.json")
    ran = {name for name, s in steps.items() if s["mode"] == "run"}

    def produced(name: str, step: str) -> dict | None:
        # A file only counts when its step ran in this check (not one left from an earlier run).
        return read_json(out / name) if step in ran else None

    kernels = kernels if "bench_kernels" in ran else None
    targets = [*kernel_targets(kernels), *planner_targets(read_json(work / "bench_sched.json") if "planner" in ran
                                                           else None),
               *runtime_targets(produced("bench_overlap.json", "bench_overlap"),
                                produced("bench_layer.json", "bench_layer"),
                                junits.get("runtime_gpu") if "runtime_gpu" in ran else None,
                                produced("bench_straggler.json", "bench_straggler"))]
    return {"machine": read_json(out / "machine.json"), "steps": [asdict(r) for r in step_rows(steps, junits, kernels)],
            "targets": [asdict(r) for r in targets]}


def render(title: str, rows: list[dict]) -> str:
    w_name = max(len(r["name"]) for r in rows)
    w_meas = max(len(r["measured"]) for r in rows)
    lines = [f"----- {title}", f"{'':{w_name}}  {'measured':{w_meas}}  verdict"]
    for r in rows:
        note = f"  ({r['note']})" if r["note"] else ""
        lines.append(f"{r['name']:{w_name}}  {r['measured']:{w_meas}}  {r['verdict']}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the GPU check's output folder")
    parser.add_argument("--work", type=Path, default=None, help="its work folder (default: OUT)")
    args = parser.parse_args(argv)
    work = args.work or args.out
    report = build(args.out, work)
    kept = args.out / "report.json"
    if kept.exists() and not (work / "steps.tsv").exists():
        # a committed run's folder (bench/results/...): its step files stayed in the check's work folder, so a
        # report rebuilt here would say NOT RUN where the run ran; the run's own report stays
        print(f"gpu_report: kept {kept}: the check's step files (steps.tsv, junit_*.xml) are not in {work}, so the "
              "report below cannot say what ran; pass --work with them to rebuild it", file=sys.stderr)
    else:
        # whole or not at all, without importing feplb (the report is made whatever state the package is in)
        tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(report, indent=1))
            os.replace(tmp, kept)
        finally:
            tmp.unlink(missing_ok=True)
    print(render("steps", report["steps"]))
    print(render("targets (../shared/design/targets.md)", report["targets"]))
    verdicts = [r["verdict"] for r in (*report["steps"], *report["targets"])]
    return 1 if FAIL in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
