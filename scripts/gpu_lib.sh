# Shared by scripts/gpu_check.sh and scripts/gpu_full_suite.sh (sourced, not run).
#
# Steps run one after the other inside a total wall-time budget: `step NAME CAP CMD...` runs
# CMD under `timeout` with the smaller of CAP and what is left of the budget, appends its
# output to $LOG (and prints it when the step ends), and records NAME, exit code, seconds and
# limit in $OUT/steps.tsv. SIGINT first, so pytest still prints its summary and writes its
# JUnit file; SIGKILL KILL_AFTER seconds later.
# A step's failure never stops the script: the later steps still run and report.
# `summarize NAME JUNIT...` (scripts/junit_summary.py) ends a script: per file what passed,
# failed, was skipped and never ran, into $OUT/summary.txt and the log.
#
# Environment: PYTHON (python3), OUT (/tmp/gpu-check-out), BUDGET (seconds), WORKERS (pytest-xdist
# workers, 16: the machine's cores; 0 runs in one process), INSTALL (1; 0 skips the offline
# install and runs from the source tree: the CPU dry run, which must not repoint a shared
# environment's editable install), TRITON_CACHE_DIR (default .triton-cache in the checkout:
# ignored by git, so it stays on a warm device machine and a second call there reuses the
# kernels the first compiled; docs/gpu-check.md), COMMIT (the summary's commit where the copy
# has no .git).

PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gpu-check-out}"
BUDGET="${BUDGET:-540}"     # seconds of wall time for the whole script
RESERVE=10                   # kept for packing the results after the last step
KILL_AFTER=10
GRACE=30                     # seconds between the tests' deadline and the step's limit
WORKERS="${WORKERS:-16}"
LOG="$OUT/gpu_check.log"
WORK="$(mktemp -d)"          # what the summary reads besides the JUnit files: not brought back
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton-cache}"
# The test steps' tests/conftest.py options: scripts/gpu_first.txt's tests run first unless the
# caller names another file (or none: FUSED_BLOCK_FIRST=); each step sets FUSED_BLOCK_COLLECTED
# to $WORK/collected-<step>.txt for the summary.
export FUSED_BLOCK_FIRST="${FUSED_BLOCK_FIRST-scripts/gpu_first.txt}"
mkdir -p "$OUT"
: >"$LOG"
printf 'step\texit\tseconds\tlimit\n' >"$OUT/steps.tsv"
export PYTHONUNBUFFERED=1
START=$SECONDS
FAILED=()
TIMES=()

left() {  # seconds of the budget a step may still use
    echo $((BUDGET - RESERVE - KILL_AFTER - (SECONDS - START)))
}

step() {
    local name="$1" cap="$2"; shift 2
    local limit
    limit=$(left)
    [ "$cap" -lt "$limit" ] && limit="$cap"
    if [ "$limit" -lt 5 ]; then
        echo "=== $name: skipped, the ${BUDGET} s budget is used up" | tee -a "$LOG"
        printf '%s\tskipped\t0\t0\n' "$name" >>"$OUT/steps.tsv"
        FAILED+=("$name (skipped)")
        return 0
    fi
    echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
    local t0=$SECONDS offset
    offset=$(stat -c %s "$LOG")
    # Into the log file, not through a pipe: a process the step leaves behind (a compile
    # worker, say) would hold a pipe open and stall the script past the step's limit.
    # Tests stop starting GRACE seconds before the limit (tests/conftest.py), so pytest ends
    # by itself with its summary and JUnit file; `timeout` is the backstop.
    FUSED_BLOCK_DEADLINE=$(( $(date +%s) + (limit > 2 * GRACE ? limit - GRACE : limit / 2) )) \
        timeout -s INT -k "$KILL_AFTER" "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    tail -c +$((offset + 1)) "$LOG"
    local took=$((SECONDS - t0))
    echo "=== $name: exit $rc after ${took} s" | tee -a "$LOG"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$limit" >>"$OUT/steps.tsv"
    TIMES+=("$name ${took} s")
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        FAILED+=("$name (timed out at ${limit} s)")
    elif [ "$rc" -ne 0 ]; then
        FAILED+=("$name (exit $rc)")
    fi
    return 0
}

install_and_versions() {
    # Offline: the machine's own torch, triton and setuptools; nothing is downloaded.
    if [ "${INSTALL:-1}" = 1 ]; then
        step install 60 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e .
    else
        echo "=== install: skipped (INSTALL=0)" | tee -a "$LOG"
    fi
    if [ "${INSTALL:-1}" != 1 ] || ! (cd / && "$PY" -c "import fused_block.kernels") >/dev/null 2>&1; then
        # No install, or it failed (still reported as failed): run the later steps from the
        # source tree, kernels/ linked where the package expects it.
        echo "=== fused_block.kernels not installed: running from the source tree" | tee -a "$LOG"
        ln -sfn ../kernels fused_block/kernels
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # shellcheck disable=SC2016  # expanded by the inner bash
    step versions 20 bash -o pipefail -c '"$1" scripts/versions.py | tee "$2"' versions "$PY" "$WORK/versions.txt"
    step nvidia-smi 15 nvidia-smi
}

# NAME JUNIT...: the per-file summary of the test steps (their lists in $WORK/collected-*.txt),
# the failed ids in FAILURES_OUT ($OUT/failures.txt) and those not run in NOT_RUN_OUT
# ($OUT/not-run.txt; `pytest @not-run.txt` runs them); empty: not written.
summarize() {
    local name="$1"; shift
    {
        echo "$name: $(date -u '+%Y-%m-%d %H:%M UTC'), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
        cat "$WORK/versions.txt" 2>/dev/null
        echo "steps (name, exit, seconds, limit):"
        tail -n +2 "$OUT/steps.tsv"
    } >"$WORK/header.txt"
    cat "$WORK"/collected-*.txt >"$WORK/collected.txt" 2>/dev/null
    local args=()
    for j in "$@"; do args+=(--junit "$j"); done
    [ -n "$FUSED_BLOCK_FIRST" ] && args+=(--first "$FUSED_BLOCK_FIRST")
    local failures="${FAILURES_OUT-$OUT/failures.txt}" not_run="${NOT_RUN_OUT-$OUT/not-run.txt}"
    [ -n "$failures" ] && args+=(--failures "$failures")
    [ -n "$not_run" ] && args+=(--not-run "$not_run")
    echo "=== summary (also in summary.txt${failures:+; failures.txt, not-run.txt: the node ids})" | tee -a "$LOG"
    timeout 60 "$PY" scripts/junit_summary.py --collected "$WORK/collected.txt" --header "$WORK/header.txt" \
        --out "$OUT/summary.txt" "${args[@]}" 2>&1 | tee -a "$LOG"
}

xdist_args() {  # "-n N" when pytest-xdist is installed and N > 0, else nothing (and a note)
    if [ "$1" = 0 ]; then
        return
    elif "$PY" -c "import xdist" >/dev/null 2>&1; then
        echo "-n $1"
    else
        echo "pytest-xdist is not installed: the tests run in one process" | tee -a "$LOG" >&2
    fi
}

finish() {  # the summary line; exit status 0 only when every step passed
    local total=$((SECONDS - START))
    local times
    times=$(IFS=,; echo "${TIMES[*]}")
    if [ "${#FAILED[@]}" -eq 0 ]; then
        echo "=== $1: PASS in ${total} s of ${BUDGET} s (${times//,/, })" | tee -a "$LOG"
        exit 0
    fi
    local failed
    failed=$(IFS=,; echo "${FAILED[*]}")
    echo "=== $1: FAIL: ${failed//,/, } in ${total} s of ${BUDGET} s (${times//,/, })" | tee -a "$LOG"
    exit 1
}
