#!/usr/bin/env bash
# The one script a GPU task runs on the device machine (an H200; see CONTRIBUTING.md):
#   bash scripts/gpu_check.sh        (device tool: run with timeout_s=600)
# 1. installs the project (no downloads: the machine's own torch and triton are used),
# 2. prints nvidia-smi,
# 3. runs the whole test suite on CUDA,
# 4. runs `python3 -m bench --quick` and collects its results.
# Everything lands in $OUT (the folder the device tool brings back; /tmp/gpu-check-out when
# unset), in at most 4 files because the tool brings back 8 at most:
#   gpu_check.log                 everything printed, step by step, with each step's exit code
#   results/<gpu>-<date>-quick.json, .md   the benchmark's results file and table
#   results.tar.gz                the whole results folder, plots included
# Each step has a time limit (GPU_TEST_TIMEOUT, TEST_TIMEOUT, BENCH_TIMEOUT seconds) so the script ends within
# the tool's 10-minute limit; a step cut short still leaves what it wrote. Optional peers
# that are not installed (Liger-Kernel, an SDPA backend) show up as "unavailable" in the
# results, not as failures. PYTEST_ARGS adds pytest options (e.g. "-n 8" with pytest-xdist).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-/tmp/gpu-check-out}"
GPU_TEST_TIMEOUT="${GPU_TEST_TIMEOUT:-120}"
TEST_TIMEOUT="${TEST_TIMEOUT:-200}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-270}"
RESULTS_TMP="$(mktemp -d)"
LOG="$OUT/gpu_check.log"
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1
: >"$LOG"

status=0
step() {  # step NAME COMMAND...: runs it, logs its output and exit code, never stops the script
    local name="$1"; shift
    echo "=== $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
    return 0
}

step install python3 -m pip install -q --no-deps --no-build-isolation -e .
step nvidia-smi nvidia-smi
step versions python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of options
# The GPU-only checks first (determinism, >2^31 elements, grid limits, streams, CUDA graphs,
# memory growth), then the rest of the suite on CUDA. The AOT compile check needs no GPU (CI
# runs it), so it is left out here to save device time.
step gpu-checks timeout "$GPU_TEST_TIMEOUT" python3 -m pytest -q -rs tests/test_gpu.py ${PYTEST_ARGS:-}
step tests timeout "$TEST_TIMEOUT" python3 -m pytest -q tests --ignore=tests/test_gpu.py \
    --ignore=tests/test_compile.py ${PYTEST_ARGS:-}
step bench timeout "$BENCH_TIMEOUT" python3 -m bench --quick --out "$RESULTS_TMP"

cp "$RESULTS_TMP"/*.json "$RESULTS_TMP"/*.md "$OUT/results/" 2>/dev/null
tar -czf "$OUT/results.tar.gz" -C "$RESULTS_TMP" .
echo "=== results: $(ls "$RESULTS_TMP" | tr '\n' ' ')" | tee -a "$LOG"
echo "=== gpu_check: $([ "$status" -eq 0 ] && echo 'all steps passed' || echo 'some step failed, see above')" | tee -a "$LOG"
exit "$status"
