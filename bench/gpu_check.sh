#!/usr/bin/env bash
# feplb's GPU checks in one run on one CUDA GPU (sized for a ~10-minute slot): the Triton kernels against their
# references, the GPU runtime tests (CUDA IPC copy path; two processes on one GPU over NVSHMEM when nvshmem4py is
# importable), the kernel benchmark next to torch._grouped_mm, and the overlap benchmark (static GEMM beside the
# planner thread and a copy-engine copy). Prints a short table last.
#
# From the repository root on the GPU machine:   OUT=/some/dir bash bench/gpu_check.sh
#   OUT            where results go (default runs/gpu): machine.json, summary.txt, log.txt, bench_kernels.json,
#                  bench_overlap.json (five files, so they fit a device tool's limit on returned files)
#   PYTHON         the interpreter that holds a CUDA torch (default python3)
#   FEPLB_TRACES   the routing traces folder (default ../shared/routing_traces, else ./.traces)
#   .whl/*.whl     optional wheels installed first into /tmp/site (e.g. nvshmem4py and what it needs)
set -uo pipefail
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/log.txt"
export PYTHONUNBUFFERED=1
if [ -z "${FEPLB_TRACES:-}" ]; then
    if [ -d ../shared/routing_traces ]; then FEPLB_TRACES=$PWD/../shared/routing_traces; else FEPLB_TRACES=$PWD/.traces; fi
fi
export FEPLB_TRACES
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$OUT/log.txt" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/log.txt" 2>&1 || { echo "install failed"; tail -20 "$OUT/log.txt"; exit 1; }

"$PY" - > "$OUT/machine.json" <<'EOF'
import importlib.util, json, platform, shutil, subprocess
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else None
print(json.dumps({"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "nvidia_smi": smi,
                  "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
                  "python": platform.python_version(),
                  "nvshmem4py": importlib.util.find_spec("nvshmem") is not None}, indent=1))
EOF

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log the output, record rc and duration
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "===== $name: $*" >> "$OUT/log.txt"
    timeout "$limit" "$@" >> "$OUT/log.txt" 2>&1
    rc=$?
    printf '%-16s rc=%-4s %5ss\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$OUT/summary.txt"
}

step kernels 200 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels
step runtime_gpu 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/runtime
FEPLB_BENCH_KERNELS_JSON=$OUT/bench_kernels.json \
    step bench_kernels 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu bench/bench_kernels.py --benchmark-enable
FEPLB_BENCH_OVERLAP_JSON=$OUT/bench_overlap.json \
    step bench_overlap 90 "$PY" -m pytest -q -s -p no:cacheprovider -m gpu bench/bench_overlap.py --benchmark-enable

echo "----- machine"
cat "$OUT/machine.json"
echo "----- overlap"
grep -A8 "static GEMM of GPU" "$OUT/log.txt" || echo "(no overlap result)"
echo "----- test summaries"
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/log.txt" | tail -n 20
echo "----- steps (rc 124 = time limit)"
cat "$OUT/summary.txt"
