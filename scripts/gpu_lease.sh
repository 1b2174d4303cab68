#!/usr/bin/env bash
# One device call that spends a task's GPU lease on what the open issues need measured first
# (a task is lent 15 minutes of device time in all, a fresh machine's start included):
#     COMMIT=<hash> bash scripts/gpu_lease.sh            (device tool: timeout_s=600,
#                                                         carry: .whl when it holds wheels)
# Steps, each under its own limit within BUDGET=585 s (scripts/gpu_lib.sh), in priority order:
#   install      offline install (+ the wheels in .whl/, e.g. transformers and liger-kernel, into
#                /tmp/site: docs/gpu-check.md)
#   first        scripts/gpu_first.txt's tests (the last run's failures), -n 16, FUSED_BLOCK_TUNE=0
#   hopper       the opt-in Hopper attention kernels' numerics, never run on a GPU before (the
#                Gluon forwards and backward, the atomic-dQ backward); a wrong mbarrier phase
#                hangs instead of failing, hence steps of their own with short limits
#   hopper-ws    their warp-specialized, ping-pong and persistent forms (heavy cases)
#   sched        the Triton attention's new tile orders, varlen host-descriptor path and the
#                backward's host descriptors (timed candidates after the first config), each forced
#   hopper-bench the Gluon forwards beside our Triton kernel and SDPA cuDNN (L4096 D128, D64)
#   bwd-bench    the atomic-dQ and Gluon backwards beside ours and cuDNN
#   profile      python -m bench --profile block,hf: one training step of the Pre-LN layer and of
#                the LLaMA spec per provider under torch.profiler, with the dispatch's timings
#   normprobe    scripts/norm_bwd_probe.py (the RMSNorm backward's variants beside LayerNorm's)
#   hostgpu      scripts/host_gpu_probe.py (host time per step with real launches, ours / torch's)
#   bench        python -m bench --quick for SPECS (loss, norm, matmul), each within its share
#   new          the gpu_quick subset of FIRST_FILES (the files of this phase's new paths)
#   suite        the rest of the gpu_quick subset in the time left (breadth first)
# $OUT: gpu_check.log, steps.tsv, summary.txt (commit under bench/results/), junit.tar.gz,
# attention-hopper.json, attention-bwd.json, results.tar.gz (bench/results/ files: tar -xzf ...
# -C bench/results), failures.txt (8 files: the tool brings back 8).
# Dry run on the CPU (the plumbing): INSTALL=0 WORKERS=0 BUDGET=240 OUT=/tmp/dry
# PYTHON=.venv/bin/python bash scripts/gpu_lease.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET="${BUDGET:-585}"
source scripts/gpu_lib.sh

FIRST_FILES="${FIRST_FILES:-tests/test_dispatch.py tests/test_attention_sdpa.py tests/test_precision.py \
tests/test_guard.py tests/test_loss.py tests/test_bench_profile.py}"
SPECS="${SPECS:-loss,norm,matmul}"
RESULTS="$WORK/results"
mkdir -p "$RESULTS"

if compgen -G ".whl/*.whl" >/dev/null; then
    step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
install_and_versions

grep -v '^\s*#' scripts/gpu_first.txt | grep . >"$WORK/first.args"
new_files=()
for f in $FIRST_FILES; do [ -f "$f" ] && new_files+=("$f"); done
# shellcheck disable=SC2046  # xdist_args is a list of options
step first 60 env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_FUZZ=quick FUSED_BLOCK_COLLECTED="$WORK/collected-first.txt" \
    FUSED_BLOCK_ONLY=scripts/gpu_first.txt "$PY" -m pytest -q -rfE -p no:cacheprovider --durations=10 \
    --junitxml="$WORK/junit-first.xml" $(xdist_args "$WORKERS") tests --ignore=tests/test_compile.py

# The opt-in Hopper kernels (issue 30), never run on a GPU before: numerics first, each kind in
# a step of its own with a short limit (a wrong mbarrier phase hangs instead of failing).
# shellcheck disable=SC2046  # xdist_args is a list of options
step hopper 70 env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_COLLECTED="$WORK/collected-hopper.txt" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider $(xdist_args "$WORKERS") --junitxml="$WORK/junit-hopper.xml" \
    tests/test_attention_hopper.py tests/test_attention_hopper_bwd.py tests/test_attention_dq_atomic.py
# The warp-specialized, ping-pong (OVERLAP and persistent included) and persistent forms
# (heavy: deselected by default), before a benchmark times them: a kernel that hangs should do
# it here, within this step's limit (the conftest deadline stops starting tests before it).
# shellcheck disable=SC2046  # xdist_args is a list of options
step hopper-ws 45 env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_HEAVY=1 FUSED_BLOCK_COLLECTED="$WORK/collected-hopper-ws.txt" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider $(xdist_args "$WORKERS") --junitxml="$WORK/junit-hopper-ws.xml" \
    tests/test_attention_hopper.py tests/test_attention_hopper_bwd.py \
    -k "wspec or persist or pingpong or overlap"
# The Triton kernels' new tile orders, varlen host-descriptor path and the backward's host-side
# descriptors (timed candidates after the first config: forced one by one by these tests).
# shellcheck disable=SC2046  # xdist_args is a list of options
step sched 30 env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_COLLECTED="$WORK/collected-sched.txt" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider $(xdist_args "$WORKERS") --junitxml="$WORK/junit-sched.xml" \
    tests/test_attention.py tests/test_attention_varlen.py -k "(scheduled or host_descriptor) and (bfloat16 or strided)"
step hopper-bench 55 env FUSED_BLOCK_PRINT_TUNING=1 "$PY" -m bench.attention_hopper --rep 30 \
    --providers gluon,gluon_pingpong,triton,sdpa_cudnn --shapes "L4096 D128,D64" --json "$OUT/attention-hopper.json"
step bwd-bench 40 env FUSED_BLOCK_PRINT_TUNING=1 "$PY" -m bench.attention_dq_atomic --rep 30 \
    --providers atomic,gluon,triton,sdpa_cudnn --json "$OUT/attention-bwd.json"

# Issue 29: one training step per provider under torch.profiler, then the quick specs.
step profile 110 env FUSED_BLOCK_PRINT_TUNING=1 FUSED_BLOCK_COMMIT="${COMMIT:-}" \
    "$PY" -m bench --profile block,hf --out "$RESULTS"
# Issue 29 item 3: the add+RMSNorm backward beside add+LayerNorm's, variant by variant (into results).
step normprobe 40 bash -c "FUSED_BLOCK_PRINT_TUNING=1 \"$PY\" scripts/norm_bwd_probe.py >\"$RESULTS/norm-bwd-probe.txt\" 2>&1"
# Issue 29 item 1: the host time per step with real launches (the CPU benchmark's estimate), and
# a CUDA-graph replay's, at the host benchmark's tiny shape (into results).
step hostgpu 40 bash -c "\"$PY\" scripts/host_gpu_probe.py --json \"$RESULTS/host-gpu.json\" >\"$RESULTS/host-gpu.txt\" 2>&1"
n_specs=$(echo "$SPECS" | tr ',' '\n' | wc -l)
bench_limit=$(( $(left) - 100 ))
[ "$bench_limit" -gt 45 ] && bench_limit=45
spec_budget=$(( bench_limit / (n_specs + 1) ))
[ "$spec_budget" -lt 10 ] && spec_budget=10
step bench "$bench_limit" env FUSED_BLOCK_COMMIT="${COMMIT:-}" "$PY" -m bench --quick --only "$SPECS" \
    --spec-budget "$spec_budget" --out "$RESULTS"

# shellcheck disable=SC2046  # xdist_args is a list of options
step new 45 env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_FUZZ=quick FUSED_BLOCK_COLLECTED="$WORK/collected-new.txt" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider --durations=10 --junitxml="$WORK/junit-new.xml" \
    $(xdist_args "$WORKERS") -m gpu_quick "${new_files[@]}"

# shellcheck disable=SC2046  # xdist_args is a list of options
step suite "$(left)" env FUSED_BLOCK_TUNE=0 FUSED_BLOCK_FUZZ=quick FUSED_BLOCK_FIRST= \
    FUSED_BLOCK_COLLECTED="$WORK/collected-suite.txt" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider --durations=10 --junitxml="$WORK/junit-suite.xml" \
    $(xdist_args "$WORKERS") -m gpu_quick tests --ignore=tests/test_attention_hopper.py \
    --ignore=tests/test_attention_dq_atomic.py --ignore=tests/test_attention_hopper_bwd.py \
    --ignore=tests/test_compile.py \
    $(printf -- '--ignore=%s ' "${new_files[@]}") \
    $(sed 's/^/--deselect=/' "$WORK/first.args")  # an id that names no test deselects nothing

tar -czf "$OUT/results.tar.gz" -C "$RESULTS" . 2>/dev/null
tar -czf "$OUT/junit.tar.gz" -C "$WORK" $(cd "$WORK" && ls junit-*.xml 2>/dev/null)
echo "=== results: $(ls "$RESULTS" | tr '\n' ' ')" | tee -a "$LOG"
NOT_RUN_OUT="" summarize gpu_lease "$WORK"/junit-*.xml  # 8 files come back: the not-run ids are in summary.txt
finish gpu_lease
