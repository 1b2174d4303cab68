#!/usr/bin/env bash
# The GPU check: the one script a task with a GPU runs on the device machine (an H200 with
# 16 cores and no network; CONTRIBUTING.md):
#     bash scripts/gpu_check.sh                (device tool: timeout_s=600)
# It fits in BUDGET=540 s of wall time in all; each step runs under `timeout` and its time is
# printed:
#   install     pip install --no-index --no-deps --no-build-isolation -e . (offline, with the
#               machine's torch, triton and setuptools)
#   versions    GPU, driver, torch, triton, CUDA, the test plugins; then nvidia-smi
#   gpu-tests   tests/test_gpu.py: determinism, >2^31 elements, grid limits, streams, CUDA
#               graphs, memory growth; FUSED_BLOCK_TUNE=0 (first config): timing every
#               candidate would compile ~4x the kernels (~170 instead of ~45) and time three
#               D=256 attention configs on the >2^31-element case (0.56 PFLOP a run, 8 runs
#               each): far past the step's limit. The bench step times candidates as users do.
#   quick       the gpu_quick subset of the rest of the suite (every test function, dtype and
#               parameter value at least once; tests/conftest.py) with pytest-xdist -n 16,
#               FUSED_BLOCK_TUNE=0 (first config, no config timing) and FUSED_BLOCK_FUZZ=quick,
#               scripts/gpu_first.txt's tests first (FUSED_BLOCK_FIRST); the AOT compile check
#               (tests/test_compile.py) needs no GPU and is left to CI. The whole suite, in
#               the same order: scripts/gpu_full_suite.sh (docs/gpu-check.md)
#   bench       python -m bench --quick: every spec (norm, attention, matmul, block, and any
#               other in bench/specs/) with torch.compile's default mode, in the time left;
#               --spec-budget shares it out so every spec gets its turn, a spec's unused
#               share going to the next (cases not started in time are recorded as not run)
#   summary     scripts/junit_summary.py: per file what passed, failed, was skipped, never ran
# Everything lands in $OUT (the folder the device tool brings back; /tmp/gpu-check-out when
# unset): 8 files, 2 folders deep at most (the tool brings back 8):
#   gpu_check.log                    all output, step by step; the last line is the verdict
#   summary.txt                      the test steps' summary (versions, date, per file, the
#                                    failed, skipped and not-run tests)
#   steps.tsv                        step, exit code, seconds, limit
#   junit-gpu.xml, junit-quick.xml   every test's outcome and time
#   results/<gpu>-<date>-quick.json, .md
#                                    the benchmark's results (GPU, versions, date): commit them
#                                    under bench/results/
#   results.tar.gz                   the same folder with the plots:
#                                    tar -xzf results.tar.gz -C bench/results
# Exit status 0 when every step passed. Environment: BUDGET (540), PYTHON (python3), WORKERS
# (16), OUT, and the others scripts/gpu_lib.sh lists.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_lib.sh

RESULTS="$(mktemp -d)"
mkdir -p "$OUT/results"

install_and_versions
step gpu-tests 110 env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_COLLECTED="$WORK/collected-gpu.txt" "$PY" -m pytest -q -rfEs \
    -p no:cacheprovider --durations=10 --junitxml="$OUT/junit-gpu.xml" tests/test_gpu.py
# shellcheck disable=SC2046  # xdist_args is a list of options
step quick 170 env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_FUZZ=quick FUSED_BLOCK_COLLECTED="$WORK/collected-quick.txt" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider --durations=25 --junitxml="$OUT/junit-quick.xml" $(xdist_args "$WORKERS") -m gpu_quick tests \
    --ignore=tests/test_gpu.py --ignore=tests/test_compile.py
# What is left goes to the benchmark: about 60 s of numerics and ceilings, the rest shared
# among the specs with one share kept for the case running when a spec's share ends.
specs=$(find bench/specs -name '[!_]*.py' | wc -l)
bench_limit=$(left)
spec_budget=$(( (bench_limit - 60) / (specs + 1) ))
[ "$spec_budget" -lt 10 ] && spec_budget=10
step bench "$bench_limit" "$PY" -m bench --quick --spec-budget "$spec_budget" --out "$RESULTS"

cp "$RESULTS"/*.json "$RESULTS"/*.md "$OUT/results/" 2>/dev/null
tar -czf "$OUT/results.tar.gz" -C "$RESULTS" .
echo "=== results: $(ls "$RESULTS" | tr '\n' ' ')" | tee -a "$LOG"
# No failures.txt nor not-run.txt: the tool brings back 8 files, the ones above (the ids are in
# summary.txt).
FAILURES_OUT="" NOT_RUN_OUT="" summarize gpu_check "$OUT/junit-gpu.xml" "$OUT/junit-quick.xml"
finish gpu_check
