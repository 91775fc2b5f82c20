"""The GPU check's verdict: every step and every target of ../shared/design/targets.md, PASS / FAIL / NOT RUN.

Reads what one run of ``bench/gpu_check.sh`` left behind and prints two tables, the targets last:

* ``OUT/machine.json``, ``OUT/bench_kernels.json``, ``OUT/bench_overlap.json``, ``OUT/bench_straggler.json``,
  ``OUT/bench_layer.json``: written by the script and the benchmarks (a missing file or key makes its targets
  NOT RUN, never PASS);
* ``WORK/steps.tsv``: one line per step, ``name<TAB>rc<TAB>seconds<TAB>mode`` (mode ``run`` or ``dry``);
* ``WORK/junit_<step>.xml``: pytest's junit report of each step; ``WORK/bench_sched.json``: the planner
  benchmark's pytest-benchmark JSON.

Writes ``OUT/report.json`` (steps and targets) and exits 1 when any step or target FAILED, else 0 (a dry run,
where everything is NOT RUN, exits 0).

Keys read (the first one present wins; nested dicts are searched):

* bench_kernels.json ``results``: rows ``{bench: grouped_mm, impl: feplb | torch_grouped_mm | dense, op: forward |
  dx | dw, proj, dist, rows_per_expert, tflops}`` and ``{bench: permute, impl: permute | unpermute | copy, dist,
  rows_per_expert, gbps}``; a row with ``error`` is a failure (ours) or an unavailable baseline;
* bench_overlap.json: ``copy_engine_slowdown_pct``, else ``100 * (gemm_with_h2d_ms / static_gemm_ms - 1)``;
  ``hidden`` (plan + measured copy fit beside the static GEMM), else ``overlap_holds``;
* bench_layer.json (then bench_overlap.json): ``host_syncs_after_counts`` (must be 0), else
  ``host_syncs_per_forward`` (a number or one per variant, the counts all-gather's own sync included: at most 1);
  ``balanced_routing_overhead_pct``, else ``100 * (balanced_routing_over_plain - 1)``;
  ``exact`` / ``balanced_equals_plain`` (bool), else the GPU runtime tests
  whose name holds "equal" or "layer" (they compare balancing on with plain EP), with ``max_abs_diff_vs_plain``,
  ``max_abs_grad_diff_vs_plain`` and ``output_scale`` shown beside;
* bench_straggler.json (then bench_layer.json): ``gemm_straggler_reduction_pct`` (the paper policy's, ranks'
  grouped GEMMs timed on one GPU, run in parallel by assumption), with ``gemm_straggler_before_ms`` /
  ``gemm_straggler_after_ms``, ``gemm_straggler_policy`` and ``gemm_straggler_reduction_pct_by_policy`` shown
  beside; a file with ``complete: false`` (a run stopped part-way) counts for nothing;
* bench_sched.json: ``extra_info.p99_us`` (wall; ``cpu_p99_us`` shown beside it) of
  ``test_planner_latency[<shape>-<policy>]``.

    python bench/gpu_report.py OUT [--work WORK]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
# Tests that need two GPUs are the only ones allowed to skip in the one-GPU runtime step: their skip reason says
# "2 GPUs" ("2 CUDA GPUs", "two GPUs" too).
ALLOWED_RUNTIME_SKIP = re.compile(r"\b(2|two) (CUDA )?GPUs\b", re.IGNORECASE)
TEST_STEPS = ("kernels", "runtime_gpu")
BENCH_STEPS = ("bench_kernels", "planner", "bench_overlap", "bench_straggler", "bench_layer")


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
        if len(parts) == 4:
            name, rc, seconds, mode = parts
            steps[name] = {"rc": int(rc), "seconds": int(seconds), "mode": mode}
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
            rows.append(Row(name=name, measured="-", verdict=NOT_RUN, note="dry run" if step else "step missing"))
            continue
        rc, took = step["rc"], f"{step['seconds']} s"
        junit = junits.get(name)
        summary = took if junit is None else \
            f"{junit['passed']} passed, {junit['failed']} failed, {len(junit['skipped'])} skipped, {took}"
        if rc in (124, 130, 137):
            rows.append(Row(name=name, measured=summary, verdict=FAIL, note=f"stopped at its time limit (rc {rc})"))
            continue
        if (junit is not None and junit["failed"]) or rc not in (0, 5):
            rows.append(Row(name=name, measured=summary, verdict=FAIL, note=f"rc {rc}"))
            continue
        ours_failed = [r for r in (kernels or {}).get("results", []) if name == "bench_kernels" and "error" in r
                       and r.get("impl") in ("feplb", "permute", "unpermute")]
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
        bad_skips = [(t, r) for t, r in (junit or {}).get("skipped", []) if not ALLOWED_RUNTIME_SKIP.search(r)]
        if name == "runtime_gpu" and bad_skips:
            test, reason = bad_skips[0]
            rows.append(Row(name=name, measured=summary, verdict=FAIL,
                            note=f"{len(bad_skips)} one-GPU test(s) skipped, e.g. {test}: {reason}"))
            continue
        rows.append(Row(name=name, measured=summary, verdict=PASS))
    return rows


# ---------------------------------------------------------------------------------------------------- targets

def _case(r: dict) -> str:
    parts = [r.get("proj"), r.get("op"), r.get("dist"), f"{r.get('rows_per_expert')}/expert"]
    return " ".join(str(p) for p in parts if p is not None)


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
        _ratio_row("dW >= 0.85x forward", [(1 / r, c) for r, c in vs("feplb", "dw", ours_fwd)], 0.85),
    ]
    perm = _results(kernels, "permute")
    gbps = {(r["impl"], r["dist"], r["rows_per_expert"]): r.get("gbps") for r in perm}
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
                                         info["limit_p99_us"], info.get("p99_us"), params.get("policy")))
    rows = []
    for shape, target in (("E128-W8", 50.0), ("E256-W64", 200.0)):
        name = f"planner p99 <= {target:.0f} us ({shape}, dyn=4)"
        if not got[shape]:
            rows.append(Row(name=name, measured="-", verdict=NOT_RUN, note="no measurement"))
            continue
        _, worst, limit, wall, policy = max(got[shape])
        rows.append(Row(name=name, measured=f"{worst:.1f} us (worst: {policy})",
                        verdict=PASS if worst <= limit else FAIL,
                        note=f"p99 of the fastest of repeats, limit {limit:.0f} us"
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
                           "copy-engine (pinned host-to-device) copy beside the static GEMM"))
    hidden = find_key(overlap, ("hidden",))
    note = "measured plan p50 + host-to-device copy vs the GEMM"
    if hidden is None:
        hidden, note = find_key(overlap, ("overlap_holds",)), "copy time modelled"
    name = "plan + phase-2 copies fit beside the static experts' GEMM"
    rows.append(Row(name=name, measured=str(hidden), verdict=PASS if hidden else FAIL, note=note)
                if isinstance(hidden, bool) else Row(name=name, measured="-", verdict=NOT_RUN, note="no measurement"))
    rows.append(_syncs_row(layer if layer is not None else overlap))
    overhead = find_key(layer, ("balanced_routing_overhead_pct",))
    if overhead is None:
        ratio = find_key(layer, ("balanced_routing_over_plain",))
        overhead = 100 * (ratio - 1) if _number(ratio) else None
    rows.append(_limit_row("balancing on <= 2% slower than plain EP on balanced routing", overhead, 2.0, "%"))
    rows.append(_straggler_row(straggler, layer))
    rows.append(_exactness_row(layer, runtime))
    return rows


def _syncs_row(doc: dict | None) -> Row:
    """``host_syncs_after_counts`` must be 0; ``host_syncs_per_forward`` (a number, or one per layer variant)
    counts every sync of the forward, the counts all-gather's own included, so it may be 1."""
    name = "blocking host syncs after the counts all-gather = 0"
    after = find_key(doc, ("host_syncs_after_counts",))
    if _number(after):
        return _limit_row(name, after, 0, "", "per layer forward")
    total = find_key(doc, ("host_syncs_per_forward", "host_syncs"))
    if _number(total):
        total = {"forward": total}
    if not isinstance(total, dict) or not total or not all(_number(v) for v in total.values()):
        return Row(name=name, measured="-", verdict=NOT_RUN, note="no measurement")
    measured = ", ".join(f"{k}: {v:g}" for k, v in total.items())
    return Row(name=name, measured=measured, verdict=PASS if max(total.values()) <= 1 else FAIL,
               note="syncs per forward, the counts all-gather's own (1 allowed) included")


def _straggler_row(straggler: dict | None, layer: dict | None) -> Row:
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
                   note="bench_layer" + (f"; {incomplete}" if incomplete else ""))
    return Row(name=name, measured="-", verdict=NOT_RUN, note=incomplete or "no measurement")


def _exactness_row(layer: dict | None, runtime: dict | None) -> Row:
    name = "exactness: balancing on equals plain EP (outputs and gradients)"
    exact = find_key(layer, ("exact", "balanced_equals_plain"))
    if isinstance(exact, bool):
        return Row(name=name, measured=str(exact), verdict=PASS if exact else FAIL, note="bench_layer")
    diffs = [find_key(layer, (k,)) for k in ("max_abs_diff_vs_plain", "max_abs_grad_diff_vs_plain", "output_scale")]
    beside = "" if not all(_number(d) for d in diffs) else \
        f"; bench_layer max |diff| out {diffs[0]:.3g}, grad {diffs[1]:.3g} (output scale {diffs[2]:.3g})"
    # The GPU layer tests assert balancing on equals plain EP (tests/runtime/test_gpu.py).
    cases = {t: o for t, o in (runtime or {}).get("cases", {}).items()
             if "equal" in t.split("::")[-1] or "layer" in t.split("::")[-1]}
    ran = {t: o for t, o in cases.items() if o != "skipped"}
    if not ran:
        return Row(name=name, measured="-", verdict=NOT_RUN, note="no GPU equality test ran" + beside)
    failed = [t for t, o in ran.items() if o == "failed"]
    return Row(name=name, measured=f"{len(ran) - len(failed)} of {len(ran)} GPU equality tests passed",
               verdict=FAIL if failed else PASS, note=(failed[0] if failed else "runtime tests") + beside)


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
    report = build(args.out, args.work or args.out)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(render("steps", report["steps"]))
    print(render("targets (../shared/design/targets.md)", report["targets"]))
    verdicts = [r["verdict"] for r in (*report["steps"], *report["targets"])]
    return 1 if FAIL in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
