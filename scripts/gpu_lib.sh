# Shared by scripts/gpu_check.sh and scripts/gpu_full_suite.sh (sourced, not run).
#
# Steps run one after the other inside a total wall-time budget: `step NAME CAP CMD...` runs
# CMD under `timeout` with the smaller of CAP and what is left of the budget, appends its
# output to $LOG (and prints it when the step ends), and records NAME, exit code, seconds and
# limit in $OUT/steps.tsv. SIGINT first, so pytest still prints its summary and writes its
# JUnit file; SIGKILL KILL_AFTER seconds later.
# A step's failure never stops the script: the later steps still run and report.

PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gpu-check-out}"
BUDGET="${BUDGET:-540}"     # seconds of wall time for the whole script
RESERVE=10                   # kept for packing the results after the last step
KILL_AFTER=10
GRACE=30                     # seconds between the tests' deadline and the step's limit
LOG="$OUT/gpu_check.log"
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
    step install 60 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e .
    if ! (cd / && "$PY" -c "import fused_block.kernels") >/dev/null 2>&1; then
        # The install step failed (it is still reported as failed): run the later steps from
        # the source tree, kernels/ linked where the package expects it.
        echo "=== fused_block.kernels does not import after the install: running from the source tree" | tee -a "$LOG"
        ln -sfn ../kernels fused_block/kernels
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    step versions 20 "$PY" scripts/versions.py
    step nvidia-smi 15 nvidia-smi
}

xdist_args() {  # "-n N" when pytest-xdist is installed, else nothing (and a note)
    if "$PY" -c "import xdist" >/dev/null 2>&1; then
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
