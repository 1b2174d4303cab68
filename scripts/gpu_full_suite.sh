#!/usr/bin/env bash
# The CUDA suite in one device call, most valuable tests first (docs/gpu-check.md):
#     bash scripts/gpu_full_suite.sh [PYTEST ARGS...]      (device tool: timeout_s=560)
# Installs offline, prints the versions, then runs the default suite (tests/, the heavy marker
# left out as in CI; not the AOT compile check, tests/test_compile.py, which needs no GPU) with
# pytest-xdist on the machine's 16 cores within BUDGET=540 s, in this order (tests/conftest.py):
#   1. scripts/gpu_first.txt's tests (FUSED_BLOCK_FIRST; the last run's failures),
#   2. the rest of the gpu_quick subset, every test function's first case before any second,
#   3. the rest of the suite, in the same rounds,
# until FUSED_BLOCK_DEADLINE (30 s before the step's limit) stops tests from starting. Then
# scripts/junit_summary.py prints per file what passed, failed, was skipped and never ran.
# FUSED_BLOCK_TUNE=0 by default (each kernel's first config, no timing: a third of the
# compiles, and no timing of large cases); FUSED_BLOCK_TUNE=1 times the candidates as users
# run them. FUSED_BLOCK_FUZZ=quick by default (a quarter of the fuzz examples, derandomized:
# each new shape is a compile here); FUSED_BLOCK_FUZZ=ci runs CI's count. PYTEST ARGS narrow
# the run (a part: files, -k, -m, @FILE of node ids) or add to it (-m heavy).
# Output under $OUT (6 files): gpu_check.log (all output; the summary, then one line of
# verdict last), steps.tsv, junit-suite.xml, summary.txt (versions, date, the table, every
# failed, skipped and not-run test: commit it under bench/results/), failures.txt (the failed
# ids: FUSED_BLOCK_FIRST=failures.txt for the next run), not-run.txt (the tests that did not
# run: a second call runs them, `bash scripts/gpu_full_suite.sh @not-run.txt`). Environment:
# see scripts/gpu_lib.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET="${BUDGET:-540}"
source scripts/gpu_lib.sh

[ "$#" -gt 0 ] || set -- tests
install_and_versions
# shellcheck disable=SC2046  # xdist_args is a list of options
step suite "$(left)" env FUSED_BLOCK_TUNE="${FUSED_BLOCK_TUNE:-0}" FUSED_BLOCK_FUZZ="${FUSED_BLOCK_FUZZ:-quick}" \
    FUSED_BLOCK_COLLECTED="$WORK/collected-suite.txt" \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=25 --junitxml="$OUT/junit-suite.xml" \
    $(xdist_args "$WORKERS") --ignore=tests/test_compile.py "$@"
summarize gpu_full_suite "$OUT/junit-suite.xml"
finish gpu_full_suite
