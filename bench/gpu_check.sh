#!/usr/bin/env bash
# feplb's GPU check: everything one CUDA GPU can show, in one command sized for <= 9 minutes on one H200 from a
# cold start (limits: 130 + 90 + 140 + 25 + 50 + 50 + 15 s = 500 s, plus about 30 s of installing; bench_layer gets
# 55 s instead of 15 only with >= 2 GPUs: on one GPU its only GPU test skips at once, so its time is collection).
# Steps, each under its own time limit (a step that runs out is stopped with SIGINT, so pytest still writes its
# report, and the next runs):
#
#   kernels        tests/kernels on the GPU, without -x, autotuning time-boxed (bench/_autotune_budget.py)
#   runtime_gpu    -m gpu tests/runtime (the layer with two processes on the one GPU over the CUDA IPC copy path,
#                  NVSHMEM too when nvshmem4py is installed); FAILS when a test that runs on one GPU skipped (only
#                  skips whose reason says "2 GPUs" are allowed)
#   bench_kernels  grouped GEMM forward / dX / dW next to torch._grouped_mm, permute / unpermute next to a copy
#   planner        planner latency p99 (bench/bench_sched.py, E=128 W=8 and E=256 W=64, pinned to one core)
#   bench_overlap  the planner thread and a copy-engine copy beside a real static GEMM
#   bench_straggler  GEMM straggler of an EP=8 group on the ESFT trace: every rank's grouped GEMM under plain EP
#                  and each balancing plan, timed one after another on the one GPU (ranks in parallel assumed)
#   bench_layer    the layer's forward + backward with balancing on and off, host syncs per forward (>= 2 GPUs)
#
# then prints, last, the table of ../shared/design/targets.md: measured value and PASS / FAIL / NOT RUN for each
# (bench/gpu_report.py). Exit status 1 when a step or a target FAILED, 0 otherwise.
#
# Before lending the GPU, on a machine that has ../shared and a network:
#   bash bench/gpu_check.sh --prepare     copy the routing trace it needs into .traces/ and download the
#                                         nvshmem4py wheel into .whl/ (both git-ignored: carry them)
# On the GPU machine, from the repository root:
#   OUT=/some/dir bash bench/gpu_check.sh
#
#   OUT                  results (default runs/gpu): machine.json, log.txt, report.json, bench_kernels.json,
#                        bench_overlap.json, bench_straggler.json, bench_layer.json (7 files; a device tool
#                        returns at most 8)
#   PYTHON               the interpreter holding a CUDA torch (default python3)
#   FEPLB_TRACES         routing traces folder (default: .traces/ when it holds the files, else ../shared/...)
#   FEPLB_GPU_CHECK_DRY  1: check the script's own plumbing only, run no step (automatic without a CUDA GPU);
#                        every step and target reports NOT RUN, exit status 0
#   FEPLB_GPU_CHECK_COLLECT  0: in a dry run, skip collecting the steps' tests (the slow part of the dry run)
#   FEPLB_GPU_CHECK_FORCE    1: run every step even without a GPU (to try the script itself on a CPU)
#   .whl/*.whl           wheels installed first (no index, no dependencies) into a private folder on PYTHONPATH
set -uo pipefail
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
    "$OUT/bench_layer.json"
: > "$LOG"
: > "$WORK/steps.tsv"
export PYTHONUNBUFFERED=1
echo "feplb GPU check: results in $OUT, work files in $WORK" | tee -a "$LOG"

# ---------------------------------------------------------------------------------------------- mode, inputs
DRY=${FEPLB_GPU_CHECK_DRY:-0}
if [ "$DRY" != 1 ] && [ "${FEPLB_GPU_CHECK_FORCE:-0}" != 1 ] && \
        ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >> "$LOG" 2>&1; then
    DRY=1
    echo "no CUDA GPU visible to $PY's torch: dry run (plumbing only, every step NOT RUN)" | tee -a "$LOG"
fi

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
source_tree() {  # the package as pyproject.toml maps it (feplb, feplb.kernels, feplb.sched), from symlinks
    local src=$WORK/src f
    mkdir -p "$src/feplb"
    for f in "$ROOT"/feplb/*; do ln -sfn "$f" "$src/feplb/$(basename "$f")"; done
    ln -sfn "$ROOT/kernels" "$src/feplb/kernels"
    ln -sfn "$ROOT/sched" "$src/feplb/sched"
    export PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH}
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

DRY=$DRY WHEELS=$WHEELS INSTALL=$INSTALL "$PY" - > "$OUT/machine.json" 2>> "$LOG" <<'EOF'
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
print(json.dumps({
    "dry_run": os.environ["DRY"] == "1", "gpu": torch.cuda.get_device_name() if cuda else None,
    "capability": list(torch.cuda.get_device_capability()) if cuda else None, "nvidia_smi": smi,
    "torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
    "nvshmem4py": version("nvshmem4py-cu13", "nvshmem4py-cu12"), "python": platform.python_version(),
    "wheels": os.environ["WHEELS"].split(), "traces": os.environ.get("FEPLB_TRACES") or None,
    "feplb": os.environ["INSTALL"], "feplb_path": os.path.dirname(feplb.__file__),
}, indent=1))
EOF
[ -s "$OUT/machine.json" ] || { echo "feplb does not import, or the machine could not be recorded:"; tail -20 "$LOG"
                               exit 1; }

# ---------------------------------------------------------------------------------------------- steps
step() {  # step NAME SECONDS COMMAND...: run under a time limit (SIGINT first, so pytest writes its reports)
    local name=$1 limit=$2 start rc
    shift 2
    if [ "$DRY" = 1 ]; then
        printf '%s\t0\t0\tdry\n' "$name" >> "$WORK/steps.tsv"
        echo "===== $name (dry run, not run): $*" >> "$LOG"
        return
    fi
    start=$(date +%s)
    echo "===== $name: $*" >> "$LOG"
    timeout -s INT -k 10 "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    printf '%s\t%s\t%s\trun\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$WORK/steps.tsv"
    echo "$name: rc=$rc, $(( $(date +%s) - start )) s"
}

pytest_step() {  # pytest_step NAME SECONDS PYTEST-ARGS...
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/junit_$name.xml" "$@"
}

export PYTHONPATH=$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}
FEPLB_AUTOTUNE_MS=5,20 pytest_step kernels 130 -p _autotune_budget tests/kernels \
    --ignore=tests/kernels/test_hopper_compile.py
pytest_step runtime_gpu 90 -m gpu tests/runtime
FEPLB_AUTOTUNE_MS=10,40 FEPLB_BENCH_KERNELS_JSON=$OUT/bench_kernels.json \
    pytest_step bench_kernels 140 -p _autotune_budget -m gpu bench/bench_kernels.py --benchmark-enable
PLANNER_TESTS=()
for case in E128-W8-feplb E128-W8-feplb-split "E256-W64-feplb[node]" "E256-W64-feplb-split[node]" \
        E256-W64-fastermoe E256-W64-eplb; do
    PLANNER_TESTS+=("bench/bench_sched.py::test_planner_latency[$case]")
done
PIN=""
command -v taskset > /dev/null && PIN="taskset -c 1"
step planner 25 $PIN "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/junit_planner.xml" \
    --benchmark-enable --benchmark-json="$WORK/bench_sched.json" "${PLANNER_TESTS[@]}"
FEPLB_BENCH_OVERLAP_JSON=$OUT/bench_overlap.json \
    pytest_step bench_overlap 50 -s -m gpu bench/bench_overlap.py --benchmark-enable
# After bench_overlap, which compiles the same ESFT-shape kernels into Triton's disk cache: what is left is
# time-boxed autotuning of a few row buckets and 6 samples x 5 policies x 8 ranks x 2 GEMM paths x 6 rounds of
# ~0.5 ms each (estimated; not yet run on a GPU).
FEPLB_AUTOTUNE_MS=5,20 FEPLB_BENCH_STRAGGLER_JSON=$OUT/bench_straggler.json \
    pytest_step bench_straggler 50 -s -p _autotune_budget -m gpu bench/bench_straggler.py --benchmark-enable
NGPU=0
[ "$DRY" = 1 ] || NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>> "$LOG") || NGPU=0
LAYER_LIMIT=15  # one GPU: bench_layer's GPU test needs two and skips at once
[ "$NGPU" -ge 2 ] 2> /dev/null && LAYER_LIMIT=55
FEPLB_BENCH_LAYER_JSON=$OUT/bench_layer.json \
    pytest_step bench_layer $LAYER_LIMIT -s -m gpu bench/bench_layer.py --benchmark-enable

if [ "$DRY" = 1 ] && [ "${FEPLB_GPU_CHECK_COLLECT:-1}" != 0 ]; then
    # The plumbing of every step: its tests import and are selected, and the autotune plugin loads.
    echo "===== dry run: collecting every step's tests" >> "$LOG"
    if ! "$PY" -m pytest --collect-only -q -p no:cacheprovider -p _autotune_budget tests/kernels tests/runtime \
            bench/bench_kernels.py "${PLANNER_TESTS[@]}" bench/bench_overlap.py bench/bench_straggler.py \
            bench/bench_layer.py \
            --ignore=tests/kernels/test_hopper_compile.py >> "$LOG" 2>&1; then
        echo "dry run: the steps' tests do not collect (see $LOG)"; exit 1
    fi
fi

# ---------------------------------------------------------------------------------------------- report
files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
[ "$files" -le 8 ] || echo "warning: $files files under $OUT (a device tool returns at most 8)" | tee -a "$LOG"
echo "----- machine"
cat "$OUT/machine.json"
echo "----- failures (log: $LOG)"
grep -E "^(FAILED|ERROR) " "$LOG" | cut -c1-200 | head -n 15
"$PY" "$ROOT/bench/gpu_report.py" "$OUT" --work "$WORK"
exit $?   # a dry run reports every row NOT RUN, so it exits 0 unless its own plumbing broke
