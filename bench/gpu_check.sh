#!/usr/bin/env bash
# feplb's GPU check: everything one CUDA GPU can show, in one command that fits a 600 s command limit on one H200
# from a cold start. A global budget (FEPLB_GPU_CHECK_BUDGET_S, default 540 s from the script's start) bounds it:
# a step whose limit would cross the budget is cut to what is left, or skipped and reported NOT RUN ("budget")
# when under 15 s are left; 10 s are kept for the kill grace of a stopped step and 10 s for the report.
# Planned (one GPU): about 30 s of installs and imports (two pip installs, four cold Python starts, three with
# torch), then limits 170 + 125 + 105 + 20 + 25 + 30 + 70 + 45 + 20 s = 610 s (kernels, runtime_gpu, bench_kernels,
# planner, bench_overlap, bench_straggler, bench_layer, ops_host, calibrate): about 640 s if every step used its
# whole limit; only then does the budget cut bench_layer (by up to 55 s) and skip the last two steps. The limits
# follow the first H200 run (2026-11-30): kernels ran out of 110 s over 8 workers by file; the other steps used 94,
# 67, 11, 12, 15 and 38 s (ops_host and calibrate did not exist yet), 370 s in all. A step's limit and kill grace
# never reach past the budget, so the command ends by about 540 s even when one is killed.
# The report runs from an EXIT trap (also after SIGINT / SIGTERM, once the running step has stopped), so
# report.json and the table always come out. Steps, each under its own time limit (a step that runs out is
# stopped with SIGINT, so pytest still writes its report, and the next runs):
#
#   kernels        tests/kernels on the GPU, without -x, over 14 pytest-xdist workers test by test when xdist
#                  imports (else serially; Triton's on-disk cache shares the compiled kernels between workers), the
#                  per-config correctness tests (test_triton_kernels.py) first, the 25 slowest tests listed in the
#                  log; the CPU-only torch-inductor case is left to CI
#   runtime_gpu    -m gpu tests/runtime over 3 xdist workers by file (the layer with two processes on the one GPU
#                  over the CUDA IPC copy path, NVSHMEM too when nvshmem4py imports, each also under activation
#                  checkpointing: 110 s became 125 s for that third layer); FAILS when a test that runs on
#                  one GPU skipped (skips whose reason says "2 GPUs" are allowed; NVSHMEM tests skipped because
#                  nvshmem4py does not import are NOT RUN in their own row, with the import error)
#   bench_kernels  permute / unpermute next to a copy, then grouped GEMM forward / dX / dW next to
#                  torch._grouped_mm, largest rows per expert first, then the opt-in persistent (TMA) dW variant on
#                  the same cases (24 more; its limit grew from 90 to 105 s for them)
#   planner        planner latency p99 (bench/bench_sched.py, E=128 W=8 and E=256 W=64, pinned to one core)
#   bench_overlap  the planner thread and a copy-engine copy beside a real static GEMM
#   bench_straggler  GEMM straggler of an EP=8 group on the ESFT trace: every rank's grouped GEMM under plain EP
#                  and each balancing plan, timed one after another on the one GPU (ranks in parallel assumed)
#   bench_layer    the layer's forward + backward with balancing on and off, host syncs per forward (on one GPU
#                  two processes share it: spawn, CUDA init and compiles took 38 s on the first H200 run)
#   ops_host       host time per op call of the ops next to their former registration (bench/bench_ops_host.py)
#   calibrate      the cost model's GEMM table (`feplb calibrate`: torch._grouped_mm, GLM-5 expert, 32 to 4096
#                  rows per expert, CUDA events) into OUT/cost_table.json
#
# Autotuning is time-boxed in every step and in the processes the tests spawn: FEPLB_AUTOTUNE_MS (read when
# feplb.kernels is imported) is exported per step. Then prints, last, the table of ../shared/design/targets.md:
# measured value and PASS / FAIL / NOT RUN for each (bench/gpu_report.py). Exit status 1 when a step or a target
# FAILED, 0 otherwise.
#
# Before lending the GPU, on a machine that has ../shared and a network:
#   bash bench/gpu_check.sh --prepare     copy the routing trace it needs into .traces/ and download the
#                                         nvshmem4py wheel into .whl/ (both git-ignored: carry them)
# On the GPU machine, from the repository root (the GPU session sets FEPLB_GPU_CHECK_EXPECT_GPU=1):
#   FEPLB_GPU_CHECK_EXPECT_GPU=1 FEPLB_GIT_COMMIT=<commit> OUT=/some/dir bash bench/gpu_check.sh
#
#   OUT                  results (default runs/gpu): machine.json, log.txt, report.json, bench_kernels.json,
#                        bench_overlap.json, bench_straggler.json, bench_layer.json, cost_table.json (8 files; a
#                        device tool returns at most 8)
#   PYTHON               the interpreter holding a CUDA torch (default python3)
#   FEPLB_TRACES         routing traces folder (default: .traces/ when it holds the files, else ../shared/...)
#   FEPLB_GPU_CHECK_BUDGET_S  seconds from the script's start that all steps must end within (default 540)
#   FEPLB_GPU_CHECK_EXPECT_GPU  1: no CUDA GPU visible is an error (one line, exit status 1), not a dry run
#   FEPLB_GPU_CHECK_DRY  1: check the script's own plumbing only, run no step (automatic without a CUDA GPU);
#                        every step and target reports NOT RUN, exit status 0
#   FEPLB_GPU_CHECK_COLLECT  0: in a dry run, skip collecting the steps' tests (the slow part of the dry run)
#   FEPLB_GPU_CHECK_FORCE    1: run every step even without a GPU (to try the script itself on a CPU)
#   FEPLB_GIT_COMMIT     the commit to record in machine.json where the tree is a copy without .git (with .git,
#                        git's HEAD and whether tracked files changed); machine.json also records the UTC start,
#                        the command, the FEPLB_* / TRITON_* / CUDA_VISIBLE* environment and the stack's versions
#   .whl/*.whl           wheels installed first (no index, no dependencies) into a private folder on PYTHONPATH;
#                        then `import nvshmem.core, cuda.core` is tried and logged (nvshmem4py-cu13 0.4.1 needs
#                        cuda.core >= 0.5.0)
set -uo pipefail
START=$(date +%s)
BUDGET_S=${FEPLB_GPU_CHECK_BUDGET_S:-540}
KILL_GRACE_S=10   # timeout -k: a step stopped with SIGINT gets this long before SIGKILL
REPORT_RESERVE_S=10
MIN_STEP_S=15     # a step with less time left than this is skipped (NOT RUN, "budget")
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
TRACE_FILES="esft_deepseek_v2_lite/esft_vanilla_lite_law.npz"
SHARED_TRACES=${FEPLB_SHARED_TRACES:-$ROOT/../shared/routing_traces}
TRACE_CACHE=${FEPLB_TRACE_CACHE:-$ROOT/.traces}

copy_traces() {  # copy the trace files the benchmarks need from ../shared into the ignored .traces/
    local f
    for f in $TRACE_FILES; do
        if [ -f "$SHARED_TRACES/$f" ] && ! cmp -s "$SHARED_TRACES/$f" "$TRACE_CACHE/$f"; then
            mkdir -p "$(dirname "$TRACE_CACHE/$f")" && cp "$SHARED_TRACES/$f" "$TRACE_CACHE/$f"
        fi
    done
}

if [ "${1:-}" = "--prepare" ]; then
    copy_traces
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl nvshmem4py-cu13==0.4.1 || echo "nvshmem4py wheel not downloaded: the NVSHMEM tests will skip (FAIL)"
    du -sh .traces .whl 2>/dev/null
    echo "carry: .traces .whl"
    exit 0
fi

mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/feplb_gpu_check.XXXXXX") || exit 1
LOG=$OUT/log.txt
# Results of an earlier run must not pass for this one's.
rm -f "$OUT"/{machine.json,log.txt,report.json,bench_kernels.json,bench_overlap.json,bench_straggler.json} \
    "$OUT"/{bench_layer.json,cost_table.json}
: > "$LOG"
: > "$WORK/steps.tsv"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------------------------------------- mode, inputs
DRY=${FEPLB_GPU_CHECK_DRY:-0}
if [ "$DRY" != 1 ] && [ "${FEPLB_GPU_CHECK_FORCE:-0}" != 1 ] && \
        ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >> "$LOG" 2>&1; then
    if [ "${FEPLB_GPU_CHECK_EXPECT_GPU:-0}" = 1 ]; then
        echo "error: FEPLB_GPU_CHECK_EXPECT_GPU=1 but $PY's torch sees no CUDA GPU (log: $LOG)" | tee -a "$LOG"
        exit 1
    fi
    DRY=1
fi
echo "feplb GPU check: results in $OUT, work files in $WORK, budget ${BUDGET_S} s" | tee -a "$LOG"
[ "$DRY" = 1 ] && echo "no CUDA GPU visible to $PY's torch, or FEPLB_GPU_CHECK_DRY=1: dry run (plumbing only," \
    "every step NOT RUN)" | tee -a "$LOG"

REPORTED=0
report() {  # the tables and report.json, once, from the EXIT trap: also after a failure or a signal
    local rc=$1 files report_rc
    [ "$REPORTED" = 1 ] && return "$rc"
    REPORTED=1
    trap - INT TERM
    files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
    [ "$files" -le 8 ] || echo "warning: $files files under $OUT (a device tool returns at most 8)" | tee -a "$LOG"
    echo "----- machine"
    cat "$OUT/machine.json" 2> /dev/null || echo "(no machine.json)"
    echo "----- failures (log: $LOG)"
    grep -E "^(FAILED|ERROR) " "$LOG" | cut -c1-200 | head -n 15
    echo "feplb GPU check: $(( $(date +%s) - START )) s of the ${BUDGET_S} s budget" | tee -a "$LOG"
    "$PY" "$ROOT/bench/gpu_report.py" "$OUT" --work "$WORK"
    report_rc=$?
    # a dry run reports every row NOT RUN, so it exits 0 unless its own plumbing broke
    [ "$rc" != 0 ] && return "$rc"
    return "$report_rc"
}
trap 'report $?; exit $?' EXIT
# Bash runs these once the running step (a foreground child) has returned; the EXIT trap then reports.
trap 'echo "feplb GPU check: interrupted" | tee -a "$LOG"; exit 130' INT TERM

copy_traces
if [ -z "${FEPLB_TRACES:-}" ]; then
    FEPLB_TRACES=""
    for root in "$TRACE_CACHE" "$SHARED_TRACES"; do
        missing=0
        for f in $TRACE_FILES; do [ -f "$root/$f" ] || missing=1; done
        if [ "$missing" = 0 ]; then FEPLB_TRACES=$(cd "$root" && pwd); break; fi
    done
fi
export FEPLB_TRACES
echo "routing traces: ${FEPLB_TRACES:-NOT FOUND (the trace benchmarks will skip)}" | tee -a "$LOG"

SITE=$WORK/site
WHEELS=$(compgen -G ".whl/*.whl" | tr '\n' ' ')
if [ -n "$WHEELS" ]; then
    if [ "$DRY" = 1 ]; then
        echo "dry run: would install $WHEELS into $SITE" >> "$LOG"
    elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $WHEELS \
            >> "$LOG" 2>&1; then
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
        echo "installed $WHEELS" | tee -a "$LOG"
    else
        echo "installing $WHEELS failed (see log)" | tee -a "$LOG"
    fi
fi
XDIST=0
"$PY" -c "import xdist" >> "$LOG" 2>&1 && XDIST=1
source_tree() {  # the package as pyproject.toml maps it (feplb, feplb.kernels, feplb.sched), from symlinks
    local src=$WORK/src f
    mkdir -p "$src/feplb"
    for f in "$ROOT"/feplb/*; do ln -sfn "$f" "$src/feplb/$(basename "$f")"; done
    ln -sfn "$ROOT/kernels" "$src/feplb/kernels"
    ln -sfn "$ROOT/sched" "$src/feplb/sched"
    export PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH}
    # Every command runs from the repository root, whose feplb/ (without kernels/ and sched/ inside) would come
    # first on sys.path and shadow the tree (python -c, python -, python -m pytest): keep the cwd off sys.path.
    export PYTHONSAFEPATH=1
}
INSTALL="pip install -e ."
if [ "$DRY" = 1 ]; then
    echo "dry run: not installing; trying the fallback (the source tree on PYTHONPATH)" >> "$LOG"
    INSTALL="source tree on PYTHONPATH (dry run)"
    source_tree
elif ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$LOG" 2>&1; then
    # No network for an isolated build, or no bdist_wheel in an old setuptools: use the sources as they are.
    INSTALL="source tree on PYTHONPATH (pip install -e . failed, see log)"
    source_tree
fi
echo "project: $INSTALL" | tee -a "$LOG"
NVSHMEM_IMPORT="not tried (dry run)"
if [ "$DRY" != 1 ]; then
    # nvshmem4py-cu13 0.4.1 needs cuda.core >= 0.5.0: a failure here makes the NVSHMEM tests skip (NOT RUN) with
    # it. The same check the tests make (feplb.transport.nvshmem_unavailable, libnvshmem_host loaded first).
    if NVSHMEM_IMPORT=$("$PY" -c "
import sys
from feplb.transport import nvshmem_unavailable
why = nvshmem_unavailable()
if why:
    sys.exit(why)
import cuda.core
print('ok, cuda.core', cuda.core.__version__)" 2>&1); then :; else
        NVSHMEM_IMPORT="fails: $(printf '%s' "$NVSHMEM_IMPORT" | tail -n 1)"
    fi
    echo "import nvshmem.core, cuda.core: $NVSHMEM_IMPORT" | tee -a "$LOG"
fi

# The commit: from git where the tree is a checkout, else FEPLB_GIT_COMMIT (a copied working tree has no .git).
if COMMIT=$(git -C "$ROOT" rev-parse HEAD 2> /dev/null); then
    DIRTY=$(git -C "$ROOT" status --porcelain --untracked-files=no 2> /dev/null | head -c 1 | wc -c)
else
    COMMIT=${FEPLB_GIT_COMMIT:-} DIRTY=unknown
fi
DRY=$DRY WHEELS=$WHEELS INSTALL=$INSTALL NVSHMEM_IMPORT=$NVSHMEM_IMPORT XDIST=$XDIST BUDGET_S=$BUDGET_S \
    COMMIT=$COMMIT DIRTY=$DIRTY COMMAND="bash bench/gpu_check.sh${*:+ $*}" \
    STARTED=$(date -u -d "@$START" +%Y-%m-%dT%H:%M:%SZ) \
    "$PY" - > "$OUT/machine.json" 2>> "$LOG" <<'EOF'
import importlib.metadata as md, json, os, platform, shutil, subprocess
import torch
import feplb.kernels, feplb.sched  # the project imports (and from where: "feplb_path")

def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None

smi = None
if shutil.which("nvidia-smi"):
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
cuda = torch.cuda.is_available()
env_used = {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("FEPLB_", "CUDA_VISIBLE", "TRITON_")) and k != "FEPLB_GIT_COMMIT"}
print(json.dumps({
    "date_utc": os.environ["STARTED"], "command": os.environ["COMMAND"], "environment": env_used,
    "commit": os.environ["COMMIT"] or None,
    "commit_dirty": None if os.environ["DIRTY"] == "unknown" else os.environ["DIRTY"] != "0",
    "dry_run": os.environ["DRY"] == "1", "gpu": torch.cuda.get_device_name() if cuda else None,
    "capability": list(torch.cuda.get_device_capability()) if cuda else None, "nvidia_smi": smi,
    "torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
    "numpy": version("numpy"), "transformers": version("transformers"),
    "nvshmem4py": version("nvshmem4py-cu13", "nvshmem4py-cu12"), "python": platform.python_version(),
    "wheels": os.environ["WHEELS"].split(), "traces": os.environ.get("FEPLB_TRACES") or None,
    "feplb": os.environ["INSTALL"], "feplb_path": os.path.dirname(feplb.__file__),
    "nvshmem_import": os.environ["NVSHMEM_IMPORT"], "xdist": os.environ["XDIST"] == "1",
    "budget_s": int(os.environ["BUDGET_S"]),
}, indent=1))
EOF
[ -s "$OUT/machine.json" ] || { echo "feplb does not import, or the machine could not be recorded:"; tail -20 "$LOG"
                               exit 1; }

# ---------------------------------------------------------------------------------------------- steps
step() {  # step NAME SECONDS COMMAND...: run under a time limit (SIGINT first, so pytest writes its reports), cut
    local name=$1 limit=$2 start rc left note=""   # to what the budget leaves, or skipped when too little is left
    shift 2
    if [ "$DRY" = 1 ]; then
        printf '%s\t0\t0\tdry\n' "$name" >> "$WORK/steps.tsv"
        echo "===== $name (dry run, not run): $*" >> "$LOG"
        return
    fi
    left=$(( START + BUDGET_S - $(date +%s) - KILL_GRACE_S - REPORT_RESERVE_S ))
    if [ "$left" -lt "$MIN_STEP_S" ]; then
        note="${left} s left of the check's ${BUDGET_S} s, the step needs up to ${limit} s"
        printf '%s\t0\t0\tbudget\t%s\n' "$name" "$note" >> "$WORK/steps.tsv"
        echo "===== $name: not run (budget: $note)" | tee -a "$LOG"
        return
    fi
    if [ "$left" -lt "$limit" ]; then
        note="limit cut from ${limit} s to ${left} s by the check's ${BUDGET_S} s budget"
        limit=$left
    fi
    start=$(date +%s)
    echo "===== $name (limit ${limit} s${note:+; $note}): $*" >> "$LOG"
    timeout -s INT -k "$KILL_GRACE_S" "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    printf '%s\t%s\t%s\trun\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$note" >> "$WORK/steps.tsv"
    echo "$name: rc=$rc, $(( $(date +%s) - start )) s${note:+ ($note)}"
}

pytest_step() {  # pytest_step NAME SECONDS PYTEST-ARGS...
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/junit_$name.xml" "$@"
}

export PYTHONPATH=$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}
KERNEL_XDIST=()
RUNTIME_XDIST=()
if [ "$XDIST" = 1 ]; then
    # Test by test: by file, the 95 per-config compiles of test_triton_kernels.py queue on one worker (2026-11-30)
    KERNEL_XDIST=(-n 14 --dist load)
    RUNTIME_XDIST=(-n 3 --dist loadfile)  # the three files with one-GPU tests side by side (correctness only)
fi
# The per-config correctness tests first (pytest keeps the order of the files named; with xdist the first file is
# handed out first). test_hopper_compile.py compiles without a GPU (CI); the torch-inductor case compiles CPU twins
# only: CI covers it.
KERNEL_TESTS=(tests/kernels/test_triton_kernels.py)
for f in tests/kernels/test_*.py; do
    case $f in */test_triton_kernels.py | */test_hopper_compile.py) ;; *) KERNEL_TESTS+=("$f") ;; esac
done
FEPLB_AUTOTUNE_MS=5,20 pytest_step kernels 170 "${KERNEL_XDIST[@]}" --durations=25 "${KERNEL_TESTS[@]}" \
    --deselect "tests/kernels/test_custom_ops.py::test_torch_compile_fullgraph[torch-inductor]"
FEPLB_AUTOTUNE_MS=5,20 pytest_step runtime_gpu 125 "${RUNTIME_XDIST[@]}" -m gpu tests/runtime
FEPLB_AUTOTUNE_MS=10,40 FEPLB_BENCH_KERNELS_JSON=$OUT/bench_kernels.json \
    pytest_step bench_kernels 105 -m gpu bench/bench_kernels.py --benchmark-enable
PLANNER_TESTS=()
for case in E128-W8-feplb E128-W8-feplb-split "E256-W64-feplb[node]" "E256-W64-feplb-split[node]" \
        E256-W64-fastermoe E256-W64-eplb; do
    PLANNER_TESTS+=("bench/bench_sched.py::test_planner_latency[$case]")
done
PIN=""
command -v taskset > /dev/null && PIN="taskset -c 1"
step planner 20 $PIN "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/junit_planner.xml" \
    --benchmark-enable --benchmark-json="$WORK/bench_sched.json" "${PLANNER_TESTS[@]}"
FEPLB_AUTOTUNE_MS=5,20 FEPLB_BENCH_OVERLAP_JSON=$OUT/bench_overlap.json \
    pytest_step bench_overlap 25 -s -m gpu bench/bench_overlap.py --benchmark-enable
# After bench_overlap, which compiled the ESFT-shape kernels (int64 offsets, as here) into Triton's disk cache:
# rank row counts not divisible by 16 and new row buckets still compile and autotune (time-boxed; estimated
# 10-20 s), then 6 samples x 5 policies x 8 ranks x 2 GEMM paths x 6 rounds of ~0.5 ms plus a 0.5 ms GPU sleep
# each (estimated; not yet run on a GPU).
FEPLB_AUTOTUNE_MS=5,20 FEPLB_BENCH_STRAGGLER_JSON=$OUT/bench_straggler.json \
    pytest_step bench_straggler 30 -s -m gpu bench/bench_straggler.py --benchmark-enable
# On one GPU bench_layer runs two processes on it (spawn, CUDA init, compiles: 38 s on 2026-11-30; its own run
# limit is 60 s, inside the step's 70 s); with more, one per GPU.
FEPLB_AUTOTUNE_MS=5,20 FEPLB_BENCH_LAYER_JSON=$OUT/bench_layer.json \
    pytest_step bench_layer 70 -s -m gpu bench/bench_layer.py --benchmark-enable
# Host time per op call, the operators in autograd Functions next to the custom_op registration they replaced,
# printed into the log (estimated 15-40 s: fp32 at 8 rows compiles every config the autotuners keep, about 11,
# then 500 calls x 7 rounds x 8 timings of 20-200 us).
FEPLB_AUTOTUNE_MS=5,20 FEPLB_BENCH_OPS_HOST_CALLS=500 \
    pytest_step ops_host 45 -s -m gpu bench/bench_ops_host.py --benchmark-enable
# The measured GEMM curve the simulator's cost model can take (feplb simulate --cost-table): estimated 10-15 s,
# most of it torch's start (8 row counts x 13 calls of at most ~8 ms plus a ~2 ms GPU sleep each; the SwiGLU
# kernel tunes once, its key is F).
FEPLB_AUTOTUNE_MS=5,20 step calibrate 20 "$PY" -m feplb.cli calibrate --device cuda --out "$OUT/cost_table.json"

if [ "$DRY" = 1 ] && [ "${FEPLB_GPU_CHECK_COLLECT:-1}" != 0 ]; then
    # The plumbing of every step: its tests import and are selected.
    echo "===== dry run: collecting every step's tests" >> "$LOG"
    if ! "$PY" -m pytest --collect-only -q -p no:cacheprovider "${KERNEL_TESTS[@]}" tests/runtime \
            bench/bench_kernels.py "${PLANNER_TESTS[@]}" bench/bench_overlap.py bench/bench_straggler.py \
            bench/bench_layer.py bench/bench_ops_host.py >> "$LOG" 2>&1; then
        echo "dry run: the steps' tests do not collect (see $LOG)"; exit 1
    fi
    if ! "$PY" -m feplb.cli calibrate --help >> "$LOG" 2>&1; then
        echo "dry run: feplb calibrate does not start (see $LOG)"; exit 1
    fi
fi

exit 0   # the EXIT trap reports (and exits 1 when a step or target FAILED)
