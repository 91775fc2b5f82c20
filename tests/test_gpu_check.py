"""The GPU check's plumbing on a CPU: ``bench/gpu_check.sh`` in its dry mode end to end, and the verdicts of
``bench/gpu_report.py`` on made-up results (passing, failing and missing)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
TRACE = "esft_deepseek_v2_lite/esft_vanilla_lite_law.npz"


def _load_report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "bench" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_report", module)
    spec.loader.exec_module(module)
    return module


gr = _load_report()
TARGET_COUNT = 15
STEP_NAMES = ["kernels", "runtime_gpu", "runtime_gpu: NVSHMEM tests", "bench_kernels", "planner", "bench_overlap",
              "bench_straggler", "bench_layer", "ops_host", "calibrate"]


# ---------------------------------------------------------------------------------------------------- dry run

@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_dry_run_reports_every_step_and_target_not_run(tmp_path):
    shared = tmp_path / "shared"
    (shared / TRACE).parent.mkdir(parents=True)
    (shared / TRACE).write_bytes(b"trace bytes")
    out, cache = tmp_path / "out", tmp_path / "cache"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "FEPLB_GPU_CHECK_DRY": "1",
           "FEPLB_GPU_CHECK_COLLECT": "0", "FEPLB_SHARED_TRACES": str(shared), "FEPLB_TRACE_CACHE": str(cache),
           "TMPDIR": str(tmp_path), "FEPLB_GIT_COMMIT": "c0ffee", "GIT_DIR": str(tmp_path / "no-git")}
    env.pop("FEPLB_TRACES", None)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The trace travels in the working tree's cache, and the benchmarks are pointed at it.
    assert (cache / TRACE).read_bytes() == b"trace bytes"
    machine = json.loads((out / "machine.json").read_text())
    assert machine["dry_run"] is True and machine["traces"] == str(cache)
    assert {"torch", "cuda", "triton", "nvshmem4py", "gpu", "nvidia_smi", "python", "numpy", "transformers"} <= set(
        machine)
    # When and how it ran, and from which commit (FEPLB_GIT_COMMIT here, as in a copied tree without .git; git's
    # HEAD in a checkout).
    started = datetime.datetime.strptime(machine["date_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    assert abs((datetime.datetime.now(datetime.UTC) - started).total_seconds()) < 300
    assert machine["command"] == "bash bench/gpu_check.sh" and machine["environment"]["FEPLB_GPU_CHECK_DRY"] == "1"
    assert machine["commit"] == "c0ffee" and machine["commit_dirty"] is None
    # The cost table's step writes where the device tool returns files from.
    assert f"===== calibrate (dry run, not run): {sys.executable} -m feplb.cli calibrate --device cuda --out " \
        f"{out}/cost_table.json" in (out / "log.txt").read_text()
    # The fallback when pip cannot install on the GPU machine: the sources as pyproject.toml maps them, which the dry
    # run uses. The script runs everything from the repository root, whose feplb/ must not shadow the tree.
    (src,) = tmp_path.glob("feplb_gpu_check.*/src")
    assert machine["feplb_path"] == str(src / "feplb"), machine["feplb_path"]
    # Without an editable install's finder (a GPU machine where pip failed), from the repository root as the
    # script runs its commands.
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
            "import feplb.kernels, feplb.sched\n"
            "print(feplb.__file__, feplb.kernels.__file__, feplb.sched.__file__)\n")
    files = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(src), "PYTHONSAFEPATH": "1"})
    assert files.returncode == 0, files.stderr[-2000:]
    assert files.stdout.split() == [str(src / "feplb" / "__init__.py"), str(src / "feplb" / "kernels" / "__init__.py"),
                                    str(src / "feplb" / "sched" / "__init__.py")]
    assert (src / "feplb" / "kernels").resolve() == ROOT / "kernels"
    # The table comes last: every target of targets.md, each NOT RUN.
    lines = proc.stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("----- targets"))
    targets = lines[start + 2:]
    assert len(targets) == TARGET_COUNT, targets
    assert all(line.split("  (")[0].rstrip().endswith("NOT RUN") for line in targets), targets
    report = json.loads((out / "report.json").read_text())
    assert [r["verdict"] for r in report["steps"]] == ["NOT RUN"] * len(STEP_NAMES)
    assert [r["name"] for r in report["steps"]] == STEP_NAMES
    assert machine["nvshmem_import"] == "not tried (dry run)" and machine["budget_s"] == 540
    assert len(list(out.iterdir())) <= 8


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_dry_run_without_traces_says_so(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "FEPLB_GPU_CHECK_DRY": "1",
           "FEPLB_GPU_CHECK_COLLECT": "0", "FEPLB_SHARED_TRACES": str(tmp_path / "none"),
           "FEPLB_TRACE_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    env.pop("FEPLB_TRACES", None)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "routing traces: NOT FOUND" in proc.stdout


# ---------------------------------------------------------------------------------------------------- report

def _junit(path: Path, cases: list[tuple[str, str, str]]) -> None:
    """cases: (name, outcome passed|failed|skipped, skip reason)."""
    body = []
    for name, outcome, reason in cases:
        inner = {"passed": "", "failed": '<failure message="boom"/>',
                 "skipped": f'<skipped type="pytest.skip" message="{reason}"/>'}[outcome]
        body.append(f'<testcase classname="tests.runtime.test_gpu" name="{name}" time="1">{inner}</testcase>')
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(body)}'
                    "</testsuite></testsuites>")


def _gemm(impl, op, rows, tflops, proj="gate_up", dist="uniform", **extra):
    return {"bench": "grouped_mm", "impl": impl, "op": op, "proj": proj, "dist": dist, "rows_per_expert": rows,
            "tflops": tflops, **extra}


def _fake_run(tmp_path: Path, *, steps=None, runtime_cases=None, kernel_rows=None, overlap=None, layer=None,
              sched=None, straggler=None) -> tuple[Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    steps = steps or {n: (0, "run") for n in (*gr.TEST_STEPS, *gr.BENCH_STEPS)}
    (work / "steps.tsv").write_text("".join(f"{n}\t{rc}\t12\t{mode}\n" for n, (rc, mode) in steps.items()))
    _junit(work / "junit_kernels.xml", [("test_a", "passed", ""), ("test_b", "passed", "")])
    _junit(work / "junit_runtime_gpu.xml", runtime_cases or [
        ("test_layer_ipc_balanced_equals_plain_ep", "passed", ""),
        ("test_layer_nccl_two_gpus", "skipped", "needs at least 2 CUDA GPUs (one rank per GPU)"),
        ("test_layer_nvshmem_four_gpus", "skipped", "needs two GPUs")])
    rows = kernel_rows if kernel_rows is not None else [
        _gemm("feplb", "forward", 256, 500.0), _gemm("torch_grouped_mm", "forward", 256, 550.0),
        _gemm("feplb", "forward", 1024, 700.0), _gemm("torch_grouped_mm", "forward", 1024, 600.0),
        _gemm("feplb", "dx", 256, 450.0), _gemm("feplb", "dx", 1024, 630.0),
        _gemm("feplb", "dw", 256, 250.0), _gemm("feplb", "dw", 1024, 650.0),
        _gemm("torch_grouped_mm", "dw", 128, None, error="RuntimeError: unsupported"),
        {"bench": "permute", "impl": "permute", "dist": "zipf", "rows_per_expert": 512, "gbps": 3600.0},
        {"bench": "permute", "impl": "unpermute", "dist": "zipf", "rows_per_expert": 512, "gbps": 3000.0},
        {"bench": "permute", "impl": "copy", "dist": "zipf", "rows_per_expert": 512, "gbps": 4200.0}]
    (out / "bench_kernels.json").write_text(json.dumps({"meta": {}, "results": rows}))
    (out / "bench_overlap.json").write_text(json.dumps(overlap if overlap is not None else OVERLAP))
    (out / "bench_layer.json").write_text(json.dumps(layer if layer is not None else {"gpu": {"host_syncs": 0}}))
    if straggler is not None:
        (out / "bench_straggler.json").write_text(json.dumps(straggler))
    limits = {"E128-W8": 50.0, "E256-W64": 200.0}
    benchmarks = [{"params": {"shape": s, "policy": p},
                   "extra_info": {"fastest_p99_us": v, "limit_p99_us": limits[s], "p99_us": 3 * v}}
                  for (s, p), v in (sched or {("E128-W8", "feplb"): 31.0, ("E128-W8", "feplb-split"): 62.5,
                                              ("E256-W64", "feplb[node]"): 150.0}).items()]
    (work / "bench_sched.json").write_text(json.dumps({"benchmarks": benchmarks}))
    return out, work


OVERLAP = {"static_gemm_ms": 2.0, "gemm_with_h2d_ms": 2.01, "plan_us_p50": 80.0, "plan_us_p99": 120.0,
           "plan_hidden": True, "copy_ms_h2d": 1.5, "copy_fits_h2d": True, "copy_ms_nvlink_modelled": 0.2}
PLAN_HIDDEN = "planning hides behind the static experts' GEMM"
COPIES_FIT = "phase-2 copies run beside the static experts' GEMM (copy volume vs the GEMM)"
SYNCS = "blocking host syncs after the counts all-gather = 0"


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def test_report_verdicts_from_measurements(tmp_path, capsys):
    out, work = _fake_run(tmp_path)
    assert gr.main([str(out), "--work", str(work)]) == 1  # some targets FAIL
    report = json.loads((out / "report.json").read_text())
    assert [r["verdict"] for r in report["steps"]] == ["PASS"] * len(STEP_NAMES)
    t = _by_name(report["targets"])
    assert len(t) == TARGET_COUNT
    fwd = t["forward >= torch._grouped_mm at >= 256 rows/expert"]
    assert fwd["verdict"] == "FAIL" and fwd["measured"].startswith(f"{500 / 550:.2f}x")
    assert "256/expert" in fwd["measured"]
    assert t["forward >= 650 TFLOP/s at >= 1024 rows/expert"]["verdict"] == "PASS"
    assert t["forward >= 650 TFLOP/s at >= 1024 rows/expert"]["measured"].startswith("700 TFLOP/s")
    assert t["dX >= 0.85x forward"]["verdict"] == "PASS"                      # 0.90 at both sizes
    assert t["dW >= 0.85x forward"]["verdict"] == "FAIL"                      # 0.50 at 256 rows
    assert t["dW >= 0.85x forward"]["measured"].startswith("0.50x")
    assert "persistent" not in t["dW >= 0.85x forward"]["note"]              # not timed in this run
    assert t["permute >= 0.80x device copy bandwidth"]["verdict"] == "PASS"   # 0.86
    assert t["unpermute >= 0.80x device copy bandwidth"]["verdict"] == "FAIL"  # 0.71
    p50 = t["planner p99 <= 50 us (E128-W8, dyn=4)"]
    assert p50["verdict"] == "FAIL" and p50["measured"].startswith("62.5 us") and "feplb-split" in p50["measured"]
    assert t["planner p99 <= 200 us (E256-W64, dyn=4)"]["verdict"] == "PASS"
    assert "scaled" not in p50["note"]
    copies = t["plan's copies slow concurrent expert GEMMs <= 1%"]
    assert copies["verdict"] == "PASS" and copies["measured"] == "0.50%"
    assert t[PLAN_HIDDEN]["verdict"] == "PASS" and t[PLAN_HIDDEN]["measured"] == "plan p50 80 us vs GEMM 2.000 ms"
    fits = t[COPIES_FIT]
    assert fits["verdict"] == "PASS" and fits["measured"] == "plan + PCIe copy 1.500 ms fit in GEMM 2.000 ms"
    assert "0.200 ms modelled" in fits["note"] and "PCIe" in fits["note"]
    assert t[SYNCS]["verdict"] == "PASS"
    assert t["balancing on <= 2% slower than plain EP on balanced routing"]["verdict"] == "NOT RUN"
    assert t["GEMM straggler >= 80% lower on skewed real routing"]["verdict"] == "NOT RUN"
    exact = t["exactness: balancing on equals plain EP (outputs and gradients)"]
    assert exact["verdict"] == "PASS" and exact["measured"] == "1 of 1 GPU equality tests passed"
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed.index("----- steps") < printed.index("----- targets (../shared/design/targets.md)")
    assert printed[-1].startswith("exactness") and printed[-1].endswith("PASS  (runtime tests)")


def test_report_notes_the_persistent_dw_variant_beside_the_default(tmp_path):
    """The dW verdict is the default kernel's; the opt-in persistent variant timed in the same run goes in the note
    (its worst ratio to forward, and its speed over the default dW case by case); a failure of it fails the step."""
    rows = [_gemm("feplb", "forward", 256, 500.0), _gemm("feplb", "forward", 1024, 700.0),
            _gemm("feplb", "dw", 256, 250.0), _gemm("feplb", "dw", 1024, 650.0),
            _gemm("feplb_dw_persistent", "dw", 256, 400.0), _gemm("feplb_dw_persistent", "dw", 1024, 630.0)]
    out, work = _fake_run(tmp_path, kernel_rows=rows)
    dw = _by_name(gr.build(out, work)["targets"])["dW >= 0.85x forward"]
    assert dw["verdict"] == "FAIL" and dw["measured"].startswith("0.50x")
    assert "persistent dW variant (opt-in, FEPLB_GROUPED_MM_DW_VARIANT=persistent): 0.80x forward" in dw["note"]
    assert f"{630 / 650:.2f}x-{400 / 250:.2f}x the default dW's speed, faster in 1 of 2 cases" in dw["note"]
    failed = [*rows, _gemm("feplb_dw_persistent", "dw", 128, None, error="AssertionError: not close")]
    (tmp_path / "failed").mkdir()
    out, work = _fake_run(tmp_path / "failed", kernel_rows=failed)
    step = _by_name(gr.build(out, work)["steps"])["bench_kernels"]
    assert step["verdict"] == "FAIL" and "1 of our cases failed" in step["note"] and "not close" in step["note"]


def test_report_reads_the_benchmarks_json_as_written(tmp_path):
    overlap = {**OVERLAP, "gemm_with_h2d_ms": 2.1, "copy_engine_slowdown_pct": 0.4, "plan_hidden": False,
               "plan_us_p50": 2500.0, "plan_thread_slowdown_pct": 0.3, "plan_first_slowdown_pct": 11.5,
               "static_gemm_launch_us": 150.0}
    layer = {"balanced_routing_overhead_pct": 1.5, "host_syncs_per_forward": {"none": 1, "feplb-split": 1},
             "max_abs_diff_vs_plain": 0.0, "max_abs_grad_diff_vs_plain": 1e-7, "output_scale": 2.0}
    out, work = _fake_run(tmp_path, overlap=overlap, layer=layer)
    t = _by_name(gr.build(out, work)["targets"])
    copies = t["plan's copies slow concurrent expert GEMMs <= 1%"]
    assert copies["verdict"] == "PASS" and copies["measured"] == "0.40%"  # the key wins over the times
    hidden = t[PLAN_HIDDEN]
    assert hidden["verdict"] == "FAIL" and hidden["measured"] == "GEMM issue 150 us + plan p50 2500 us vs GEMM 2.000 ms"
    assert "measured" in hidden["note"] and "p99 120 us" in hidden["note"] and "GEMM +0.3%" in hidden["note"]
    assert "+11.5% with it started before the GEMM's launch" in hidden["note"]
    syncs = t["blocking host syncs after the counts all-gather = 0"]
    assert syncs["verdict"] == "PASS" and syncs["measured"] == "none: 1, feplb-split: 1"
    balanced = t["balancing on <= 2% slower than plain EP on balanced routing"]
    assert balanced["verdict"] == "PASS" and balanced["measured"] == "1.50%"
    exact = t["exactness: balancing on equals plain EP (outputs and gradients)"]
    assert exact["verdict"] == "PASS" and "grad 1e-07" in exact["note"]
    layer["host_syncs_per_forward"]["feplb-split"] = 4
    (out / "bench_layer.json").write_text(json.dumps(layer))
    syncs = _by_name(gr.build(out, work)["targets"])["blocking host syncs after the counts all-gather = 0"]
    assert syncs["verdict"] == "FAIL" and "feplb-split: 4" in syncs["measured"]


def test_report_layer_keys_and_failures(tmp_path):
    layer = {"host_syncs_per_forward": 3, "balanced_routing_over_plain": 1.05, "exact": False,
             "gemm_straggler_reduction_pct": 85.0}
    out, work = _fake_run(tmp_path, layer=layer, overlap={"copy_slowdown_pct": 4.0, "copy_fits_h2d": False,
                                                          "copy_ms_h2d": 2.5, "static_gemm_ms": 2.0,
                                                          "copy_ms_nvlink_modelled": 0.3})
    t = _by_name(gr.build(out, work)["targets"])
    assert t["blocking host syncs after the counts all-gather = 0"]["measured"] == "forward: 3"
    assert t["blocking host syncs after the counts all-gather = 0"]["verdict"] == "FAIL"
    balanced = t["balancing on <= 2% slower than plain EP on balanced routing"]
    assert balanced["verdict"] == "FAIL" and balanced["measured"] == "5.00%"
    assert t["exactness: balancing on equals plain EP (outputs and gradients)"]["verdict"] == "FAIL"
    assert t["plan's copies slow concurrent expert GEMMs <= 1%"]["verdict"] == "FAIL"
    # A PCIe copy that does not fit decides nothing about the NVLink copy a node makes, and a model never decides
    fits = t[COPIES_FIT]
    assert fits["verdict"] == "NOT RUN" and fits["measured"] == "plan + PCIe copy 2.500 ms > GEMM 2.000 ms"
    assert "one GPU cannot decide" in fits["note"] and "0.300 ms modelled" in fits["note"]
    assert t[PLAN_HIDDEN]["verdict"] == "NOT RUN"
    assert t["GEMM straggler >= 80% lower on skewed real routing"]["verdict"] == "PASS"
    (out / "bench_layer.json").write_text(json.dumps({**layer, "host_syncs_after_counts": 1}))
    syncs = _by_name(gr.build(out, work)["targets"])["blocking host syncs after the counts all-gather = 0"]
    assert syncs["verdict"] == "FAIL" and syncs["measured"] == "1"


STRAGGLER = "GEMM straggler >= 80% lower on skewed real routing"


def _straggler_doc(pct: float, before: float = 0.150, after: float | None = None) -> dict:
    after = before * (1 - pct / 100) if after is None else after
    return {"complete": True, "gemm_straggler_reduction_pct": pct, "gemm_straggler_policy": "feplb",
            "gemm_straggler_before_ms": before, "gemm_straggler_after_ms": after,
            "gemm_straggler_reduction_pct_by_policy": {"feplb": pct, "feplb-split": 97.6, "fastermoe": -1.0},
            "samples": [{"layer": 4}, {"layer": 14}]}


@pytest.mark.parametrize(("pct", "verdict"), [(85.0, "PASS"), (80.0, "PASS"), (79.4, "FAIL"), (-3.0, "FAIL")])
def test_report_reads_the_gemm_straggler_from_bench_straggler(tmp_path, pct, verdict):
    out, work = _fake_run(tmp_path, straggler=_straggler_doc(pct),
                          layer={"gemm_straggler_reduction_pct": 99.0 if verdict == "FAIL" else 10.0})
    row = _by_name(gr.build(out, work)["targets"])[STRAGGLER]
    # bench_straggler's measurement wins over bench_layer's, with the times before and after and the assumption
    assert row["verdict"] == verdict
    before, after = 0.150, 0.150 * (1 - pct / 100)
    assert row["measured"] == f"{pct:.1f}% (feplb, {before:.3f} -> {after:.3f} ms)"
    assert "parallel" in row["note"] and "feplb-split 98%" in row["note"] and "fastermoe -1%" in row["note"]


def test_report_gemm_straggler_fallbacks(tmp_path):
    # a run stopped part-way counts for nothing: bench_layer's value if it has one, else NOT RUN, saying why
    partial = {"complete": False, "samples": [{"layer": 4}]}
    out, work = _fake_run(tmp_path, straggler=partial, layer={"gemm_straggler_reduction_pct": 83.0})
    row = _by_name(gr.build(out, work)["targets"])[STRAGGLER]
    assert row["verdict"] == "PASS" and row["measured"] == "83.0%" and "bench_layer" in row["note"]
    assert "stopped after 1 sample" in row["note"]
    (out / "bench_layer.json").write_text(json.dumps({}))
    row = _by_name(gr.build(out, work)["targets"])[STRAGGLER]
    assert row["verdict"] == "NOT RUN" and "stopped after 1 sample" in row["note"]
    # no bench_straggler file: bench_layer's
    (out / "bench_straggler.json").unlink()
    (out / "bench_layer.json").write_text(json.dumps({"gemm_straggler_reduction_pct": 50.0}))
    row = _by_name(gr.build(out, work)["targets"])[STRAGGLER]
    assert row["verdict"] == "FAIL" and row["note"] == "bench_layer"
    # a file left from an earlier run, its step not run in this one: nothing measured
    steps = {n: (0, "run") for n in (*gr.TEST_STEPS, *gr.BENCH_STEPS)}
    steps["bench_straggler"] = (0, "dry")
    steps["bench_layer"] = (0, "dry")
    (tmp_path / "stale").mkdir()
    out2, work2 = _fake_run(tmp_path / "stale", steps=steps, straggler=_straggler_doc(90.0))
    assert _by_name(gr.build(out2, work2)["targets"])[STRAGGLER]["verdict"] == "NOT RUN"


@pytest.mark.parametrize(("cases", "note"), [
    ([("test_layer_ipc_balanced_equals_plain_ep", "passed", ""),
      ("test_layer_nvshmem_balanced_equals_plain_ep", "skipped", "needs nvshmem4py: pip install 'feplb[nvshmem]'")],
     "1 one-GPU test(s) skipped"),
    ([("test_layer_ipc_balanced_equals_plain_ep", "skipped", "needs a CUDA GPU")], "no test ran"),
    ([("test_layer_ipc_balanced_equals_plain_ep", "failed", "")], "rc 0"),
    ([("test_layer_two_processes_one_gpu[ipc]", "passed", ""),
      ("test_layer_two_processes_one_gpu[auto]", "skipped", "needs 12 GPUs")], "1 one-GPU test(s) skipped"),
], ids=["one-gpu-test-skipped", "all-skipped", "failed", "12-is-not-2"])
def test_runtime_step_fails_on_skips_that_should_have_run(tmp_path, cases, note):
    out, work = _fake_run(tmp_path, runtime_cases=cases)
    steps = _by_name(gr.build(out, work)["steps"])
    assert steps["runtime_gpu"]["verdict"] == "FAIL"
    assert note in steps["runtime_gpu"]["note"]


def test_our_kernel_failing_in_the_benchmark_fails_its_step(tmp_path):
    rows = [_gemm("feplb", "forward", 512, None, error="OutOfResources: shared memory"),
            _gemm("torch_grouped_mm", "forward", 512, 560.0)]
    out, work = _fake_run(tmp_path, kernel_rows=rows)
    report = gr.build(out, work)
    step = _by_name(report["steps"])["bench_kernels"]
    assert step["verdict"] == "FAIL" and "OutOfResources" in step["note"]
    assert _by_name(report["targets"])["forward >= torch._grouped_mm at >= 256 rows/expert"]["verdict"] == "NOT RUN"


def test_time_limits_fail_and_stale_files_do_not_count(tmp_path):
    steps = {n: (0, "dry") for n in (*gr.TEST_STEPS, *gr.BENCH_STEPS)}
    steps["kernels"] = (124, "run")
    out, work = _fake_run(tmp_path, steps=steps)
    report = gr.build(out, work)
    assert _by_name(report["steps"])["kernels"]["verdict"] == "FAIL"
    assert "time limit" in _by_name(report["steps"])["kernels"]["note"]
    # The benchmark files exist, but their steps did not run in this check: nothing measured.
    assert {r["verdict"] for r in report["targets"]} == {"NOT RUN"}


_BUDGET_PROBE = """
import triton.testing
calls = []
triton.testing.do_bench = lambda fn, **kw: calls.append(kw) or 1.0
import feplb.kernels
from triton.runtime.autotuner import Autotuner
tuner = Autotuner.__new__(Autotuner)
print(tuner.do_bench(lambda: None, quantiles=(0.5, 0.2, 0.8)), calls)
"""


def _probe_budget(spec: str | None):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FEPLB_AUTOTUNE_MS")}
    if spec is not None:
        env["FEPLB_AUTOTUNE_MS"] = spec
    return subprocess.run([sys.executable, "-c", _BUDGET_PROBE], env=env, capture_output=True, text=True,
                          timeout=120)


def test_autotune_budget_from_the_environment_at_import():
    """FEPLB_AUTOTUNE_MS is applied when feplb.kernels is imported (so spawned processes inherit it): every
    autotuner then times candidates with that warmup and rep; a bad value names the variable."""
    pytest.importorskip("triton.runtime.autotuner")
    proc = _probe_budget("5,20")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "1.0 [{'warmup': 5.0, 'rep': 20.0, 'quantiles': (0.5, 0.2, 0.8)}]"
    proc = _probe_budget("fast")
    assert proc.returncode != 0 and "FEPLB_AUTOTUNE_MS: expected 'WARMUP,REP'" in proc.stderr
    assert "'fast'" in proc.stderr


def test_autotune_budget_parse():
    from feplb.kernels import _triton

    assert _triton.parse_autotune_budget(None) is None and _triton.parse_autotune_budget("") is None
    assert _triton.parse_autotune_budget("5,20") == (5.0, 20.0)
    for bad in ("5", "5,20,1", "0,20", "5,-1", "a,b", "inf,100", "5,nan"):
        with pytest.raises(ValueError, match="FEPLB_AUTOTUNE_MS"):
            _triton.parse_autotune_budget(bad)


# ---------------------------------------------------------------------------------------------------- budget, signals

def test_steps_skipped_or_cut_by_the_budget(tmp_path):
    steps = {n: (0, "run") for n in (*gr.TEST_STEPS, *gr.BENCH_STEPS)}
    out, work = _fake_run(tmp_path, steps=steps)
    lines = (work / "steps.tsv").read_text().splitlines()
    lines = [ln for ln in lines if not ln.startswith(("bench_layer\t", "bench_straggler\t", "runtime_gpu\t"))]
    lines += ["bench_straggler\t0\t0\tbudget\t12 s left of the check's 540 s, the step needs up to 45 s",
              "bench_layer\t130\t31\trun\tlimit cut from 60 s to 31 s by the check's 540 s budget"]
    (work / "steps.tsv").write_text("\n".join(lines) + "\n")
    steps = _by_name(gr.build(out, work)["steps"])
    straggler = steps["bench_straggler"]
    assert straggler["verdict"] == "NOT RUN" and straggler["note"].startswith("budget: 12 s left")
    layer = steps["bench_layer"]
    assert layer["verdict"] == "FAIL" and "time limit" in layer["note"] and "cut from 60 s to 31 s" in layer["note"]
    # a step the check never reached (stopped by a signal): NOT RUN, its NVSHMEM row with it
    assert steps["runtime_gpu"]["verdict"] == "NOT RUN" and "not reached" in steps["runtime_gpu"]["note"]
    assert steps["runtime_gpu: NVSHMEM tests"]["verdict"] == "NOT RUN"
    # the file a budget-skipped step would have written does not count
    assert _by_name(gr.build(out, work)["targets"])[STRAGGLER]["verdict"] == "NOT RUN"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_expect_gpu_makes_no_cuda_an_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "FEPLB_GPU_CHECK_EXPECT_GPU": "1",
           "TMPDIR": str(tmp_path)}
    for key in ("FEPLB_GPU_CHECK_DRY", "FEPLB_GPU_CHECK_FORCE"):
        env.pop(key, None)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [proc.stdout.strip()]
    assert "FEPLB_GPU_CHECK_EXPECT_GPU=1" in proc.stdout and "no CUDA GPU" in proc.stdout
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_report_still_comes_out_after_sigterm(tmp_path):
    """SIGTERM while a step's command runs: the script exits 130 after it, and the EXIT trap prints the tables and
    writes report.json."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "FEPLB_GPU_CHECK_DRY": "1",
           "FEPLB_GPU_CHECK_COLLECT": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = out / "log.txt", time.monotonic() + 120
    while time.monotonic() < deadline and "collecting every step" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 130, stdout + stderr
    assert "interrupted" in stdout and "----- targets" in stdout
    report = json.loads((out / "report.json").read_text())
    assert len(report["targets"]) == TARGET_COUNT


# ---------------------------------------------------------------------------------------------------- one GPU

NVSHMEM_REASON = ("NVSHMEM unavailable: ImportError: nvshmem4py requires cuda.core>=0.5.0 "
                  "(pip install 'feplb[nvshmem]')")


def test_nvshmem_import_failure_is_not_run_with_its_reason(tmp_path):
    cases = [("test_layer_two_processes_one_gpu_without_nvshmem", "passed", ""),
             ("test_layer_two_processes_one_gpu", "skipped", NVSHMEM_REASON),
             ("test_no_host_sync_after_counts_one_gpu", "skipped", NVSHMEM_REASON),
             ("test_layer_nccl_balanced_equals_plain_ep", "skipped", "needs at least 2 CUDA GPUs (one rank per GPU)")]
    out, work = _fake_run(tmp_path, runtime_cases=cases, layer={})
    report = gr.build(out, work)
    steps, t = _by_name(report["steps"]), _by_name(report["targets"])
    assert steps["runtime_gpu"]["verdict"] == "PASS"
    nv = steps["runtime_gpu: NVSHMEM tests"]
    assert nv["verdict"] == "NOT RUN" and nv["measured"] == "2 test(s) skipped" and nv["note"] == NVSHMEM_REASON
    syncs = t[SYNCS]
    assert syncs["verdict"] == "NOT RUN" and "cuda.core>=0.5.0" in syncs["note"]
    assert "test_no_host_sync_after_counts_one_gpu skipped" in syncs["note"]


@pytest.mark.parametrize(("outcome", "verdict", "measured"), [("passed", "PASS", "0 after counts"),
                                                             ("failed", "FAIL", "> 0 after counts")])
def test_host_syncs_from_the_runtime_test_when_no_benchmark_counts_them(tmp_path, outcome, verdict, measured):
    cases = [("test_layer_two_processes_one_gpu", "passed", ""),
             ("test_no_host_sync_after_counts_one_gpu", outcome, "")]
    out, work = _fake_run(tmp_path, runtime_cases=cases, layer={}, overlap=OVERLAP)
    syncs = _by_name(gr.build(out, work)["targets"])[SYNCS]
    assert (syncs["verdict"], syncs["measured"]) == (verdict, measured)
    assert f"test_no_host_sync_after_counts_one_gpu {outcome}" in syncs["note"]
    # a benchmark's count of 0 is the measurement when the test passed; a failed test fails the target anyway
    (out / "bench_layer.json").write_text(json.dumps({"host_syncs_after_counts": 0}))
    syncs = _by_name(gr.build(out, work)["targets"])[SYNCS]
    if outcome == "passed":
        assert syncs["verdict"] == "PASS" and syncs["measured"] == "0" and "runtime test" not in syncs["note"]
    else:
        assert syncs["verdict"] == "FAIL" and "test_no_host_sync_after_counts_one_gpu failed" in syncs["note"]


def test_a_failed_gpu_equality_test_fails_exactness_whatever_bench_layer_found(tmp_path):
    cases = [("test_layer_two_processes_one_gpu_without_nvshmem", "failed", ""),
             ("test_no_host_sync_after_counts_one_gpu", "passed", "")]
    out, work = _fake_run(tmp_path, runtime_cases=cases, layer={"exact": True, "host_syncs_after_counts": 0})
    t = _by_name(gr.build(out, work)["targets"])
    exact = t["exactness: balancing on equals plain EP (outputs and gradients)"]
    assert exact["verdict"] == "FAIL" and "test_layer_two_processes_one_gpu_without_nvshmem" in exact["note"]
    assert t[SYNCS]["verdict"] == "PASS"


def test_one_gpu_layer_rows_say_the_gpu_was_shared(tmp_path):
    layer = {"processes_per_gpu": 2, "transport": "nvshmem", "copy_path": "ipc", "host_syncs_per_forward": 1,
             "balanced_routing_overhead_pct": 1.2, "exact": True}
    out, work = _fake_run(tmp_path, layer=layer)
    t = _by_name(gr.build(out, work)["targets"])
    for name in (SYNCS, "balancing on <= 2% slower than plain EP on balanced routing",
                 "exactness: balancing on equals plain EP (outputs and gradients)"):
        assert t[name]["verdict"] == "PASS"
        assert "2 processes time-slice one GPU (transport nvshmem, copy path ipc)" in t[name]["note"], name
        assert "not multi-GPU speed" in t[name]["note"]
    (out / "bench_layer.json").write_text(json.dumps({**layer, "processes_per_gpu": 1}))
    t = _by_name(gr.build(out, work)["targets"])
    assert "time-slice" not in t[SYNCS]["note"]


def test_step_rows_in_order_when_run(tmp_path):
    out, work = _fake_run(tmp_path)
    assert [r["name"] for r in gr.build(out, work)["steps"]] == STEP_NAMES


def test_planner_limit_scaled_to_a_slow_core_is_said_so(tmp_path):
    sched = {("E128-W8", "feplb-split"): 55.8, ("E256-W64", "feplb[node]"): 150.0}
    out, work = _fake_run(tmp_path, sched=sched)
    data = json.loads((work / "bench_sched.json").read_text())
    for bench in data["benchmarks"]:   # a core 1.6x slower than the reference: limits 80 and 320 us
        bench["extra_info"].update(limit_p99_us=1.6 * bench["extra_info"]["limit_p99_us"], py_loop_ms=32.0)
    (work / "bench_sched.json").write_text(json.dumps(data))
    gr.main([str(out), "--work", str(work)])
    t = _by_name(json.loads((out / "report.json").read_text())["targets"])
    row = t["planner p99 <= 50 us (E128-W8, dyn=4)"]
    assert row["verdict"] == "PASS" and row["measured"].startswith("55.8 us")
    assert ("limit 80 us, the 50 us target scaled to this core's speed (yardstick 32 ms); above the unscaled "
            "target") in row["note"], row["note"]
    row = t["planner p99 <= 200 us (E256-W64, dyn=4)"]
    assert "scaled to this core's speed" in row["note"] and "above the unscaled" not in row["note"], row["note"]


@pytest.mark.parametrize("basis, said", [
    # bench_sched scales a limit by whichever shows the core slower: its Python yardstick or its numpy one
    ("numpy", "small numpy calls 2.4x their reference time"),
    # results of runs before 2026-12-05, whose bench_sched scaled a limit by the none baseline too
    ("none", "none's plan 2.4x its reference time")])
def test_planner_limit_scaled_by_a_second_yardstick_is_said_so(tmp_path, basis, said):
    out, work = _fake_run(tmp_path, sched={("E128-W8", "feplb-split"): 90.0, ("E128-W8", "feplb"): 130.0})
    data = json.loads((work / "bench_sched.json").read_text())
    for bench in data["benchmarks"]:   # 2.4x slower than on the reference core by that yardstick, the loop 1.6x
        bench["extra_info"].update(limit_p99_us=2.4 * bench["extra_info"]["limit_p99_us"], py_loop_ms=32.0,
                                   slowdown=2.4, slowdown_basis=basis)
    (work / "bench_sched.json").write_text(json.dumps(data))
    gr.main([str(out), "--work", str(work)])
    row = _by_name(json.loads((out / "report.json").read_text())["targets"])["planner p99 <= 50 us (E128-W8, dyn=4)"]
    # the worst against its limit of 120 us: feplb's 130 us, over it
    assert row["verdict"] == "FAIL" and row["measured"].startswith("130.0 us (worst: feplb)"), row
    assert f"limit 120 us, the 50 us target scaled to this core's speed ({said})" in row["note"], row["note"]


def test_permute_bandwidth_counts_the_bytes_the_kernel_moves():
    """permute reads T distinct rows and writes T x K: a row of a run that recorded 2 x T x K rows (the copy's
    count) is recounted from its T, K, D and time, so it is not credited with bytes it never moved."""
    T, K, D, us = 8192, 8, 6144, 255.3
    row = {"bench": "permute", "impl": "permute", "T": T, "K": K, "D": D, "us": us,
           "bytes": 2 * T * K * D * 2, "gbps": 2 * T * K * D * 2 / (us * 1e3)}
    assert gr._moved_gbps(row) == pytest.approx((T + T * K) * D * 2 / (us * 1e3))
    assert gr._moved_gbps(row) == pytest.approx(row["gbps"] * (1 + K) / (2 * K))
    copy = {"bench": "permute", "impl": "copy", "T": T, "K": K, "D": D, "us": 190.4, "gbps": 4230.0}
    assert gr._moved_gbps(copy) == 4230.0 and gr._moved_gbps({"impl": "permute", "gbps": 3.0}) == 3.0


def test_a_committed_runs_report_is_not_overwritten(tmp_path, capsys):
    """A results folder holds the run's files but not its work folder's step files: the report it holds stays."""
    out = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results" / "2026-11-30-h200", out)
    before = (out / "report.json").read_bytes()
    gr.main([str(out)])
    assert (out / "report.json").read_bytes() == before
    assert "kept" in capsys.readouterr().err
