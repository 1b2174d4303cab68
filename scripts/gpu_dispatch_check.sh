#!/usr/bin/env bash
# Issue 29's GPU-side checks of the GEMM dispatch (items 1, 4, 6), about 5 minutes on an H200
# (device tool: timeout_s=420); run after the offline install of scripts/gpu_check.sh:
#   1. the dispatch tests on CUDA (gpu_quick subset, FUSED_BLOCK_TUNE=0: the static rule): the
#      cuBLAS candidate's numerics for every epilogue, forward and backward, the new elementwise
#      epilogue kernel and act_grad's STORE_H on the GPU, the static rule's choices; and the
#      profile's format (~90 s, mostly compiles);
#   2. python -m bench --profile block,hf: one training step of the Pre-LN layer (d1024 B8 L1024)
#      and of LLaMA-1B at 4 layers (B4 T2048) under torch.profiler, ours beside eager and
#      torch.compile (and Liger when installed), every kernel; the GEMM dispatch timed per key
#      (FUSED_BLOCK_PRINT_TUNING=1 prints both candidates' times for each key) and its table
#      (~3-4 min, torch.compile's compiles included).
# Output in $OUT: dispatch_check.log and results/<gpu>-<date>-quick-profile.json.
set -u
OUT=${OUT:-/tmp/gpu-dispatch-out}
mkdir -p "$OUT/results"
LOG="$OUT/dispatch_check.log"
{
  echo "== dispatch tests (CUDA, gpu_quick, FUSED_BLOCK_TUNE=0) =="
  timeout 150 env FUSED_BLOCK_TUNE=0 python -m pytest -q -x -m gpu_quick -p no:cacheprovider \
    tests/test_dispatch.py tests/test_bench_profile.py 2>&1 | tail -25
  echo "exit ${PIPESTATUS[0]}"
  echo "== python -m bench --profile block,hf =="
  timeout 260 env FUSED_BLOCK_PRINT_TUNING=1 python -m bench --profile block,hf --out "$OUT/results" 2>&1 \
    | grep -v '^\[fused_block\] matmul '
  echo "exit ${PIPESTATUS[0]}"
} > "$LOG" 2>&1
tail -c 11000 "$LOG"
