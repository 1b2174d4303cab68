#!/usr/bin/env bash
# The whole test suite on CUDA, for a GPU session with the time for it (the GPU check,
# scripts/gpu_check.sh, runs only the gpu_quick subset):
#     bash scripts/gpu_full_suite.sh [PYTEST ARGS...]      (device tool: timeout_s=600)
# Installs offline, prints the versions, then runs every test but the AOT compile check
# (tests/test_compile.py needs no GPU; CI runs it) with pytest-xdist -n 14, within BUDGET=560
# s. FUSED_BLOCK_TUNE=0 by default (each kernel's first config, no timing: a third of the
# compiles, and no timing of large cases). FUSED_BLOCK_TUNE=1 times the candidates as users
# run them. The whole suite may not fit in one call: pass a part of it,
# e.g. `tests/test_linear.py tests/test_fuzz_ops.py` or `-k fp32`, and run the rest in another
# call. Output under $OUT: gpu_check.log, steps.tsv, junit-suite.xml.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET="${BUDGET:-560}"
source scripts/gpu_lib.sh

WORKERS="${WORKERS:-14}"
[ "$#" -gt 0 ] || set -- tests
install_and_versions
# shellcheck disable=SC2046  # xdist_args is a list of options
step suite "$(left)" env FUSED_BLOCK_TUNE="${FUSED_BLOCK_TUNE:-0}" "$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=25 \
    --junitxml="$OUT/junit-suite.xml" $(xdist_args "$WORKERS") --ignore=tests/test_compile.py "$@"
finish gpu_full_suite
