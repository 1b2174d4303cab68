"""Opt-in backward with dQ reduce-added in fp32 (FlashAttention-3's design): one program per
key block computes that block's dK and dV over the query blocks of its group's heads and, in
the same step, the block's part of dQ, dS K, added into an fp32 accumulator (B, Hq, Lq, D)
through the tensor descriptor's ``atomic_add`` (a TMA bulk reduce-add); a small kernel then
writes dQ = accumulator * scale in q's dtype. Five tile products a step, against the seven of
the atomic-free backward (``backward.py``), whose dQ programs recompute QK^T and dO V^T.

Taken only when ``FUSED_BLOCK_ATTN_DQ_ATOMIC=1`` is set, never while
``torch.are_deterministic_algorithms_enabled()`` (the order of the reduce-adds varies from run
to run, so dQ's last bits do), for the cases :func:`supports` names: 16-bit q/k/v, head dim
class 64 or 128 (D <= 128), TMA-able layouts, on sm_90 CUDA or the interpreter; causal
(bottom-right) or not, GQA/MQA, any lengths, the LSE's gradient and sinks (both live in the
row statistics of ``_attn_bwd_preprocess``). Dropout, padding masks, windows, varlen, softcap,
ALiBi, biases and bool masks run the atomic-free backward. The interpreter has no descriptor
reduce-add: there the accumulator takes masked ``tl.atomic_add`` (same numerics, fp32 adds).

This kernel has not yet run on a GPU: it stays opt-in until a committed GPU run of
``tests/test_attention_dq_atomic.py`` and ``bench/attention_dq_atomic.py`` verifies it
(``docs/attention-hopper.md``).
"""
import os

import torch
import triton
import triton.language as tl

from fused_block.kernels import common
from fused_block.kernels.attention.configs import _bucket
from fused_block.kernels.attention.helpers import _desc, _desc3, _query_ranges

ENV = "FUSED_BLOCK_ATTN_DQ_ATOMIC"
# The opt-in switch, read once at import (tests set ENABLED).
ENABLED = os.environ.get(ENV, "0") == "1"
BLOCK_DS = (64, 128)
# Per head-dim class, the candidates (BLOCK_M query rows a step, BLOCK_N keys a program, warps,
# stages), timed once per key on the GPU (``ConfigCache``; the first with FUSED_BLOCK_TUNE=0).
# FA3's tiles are 128 x 128 at D64 and 64 x 128 at D128 (two MMA warpgroups); the dK and dV
# accumulators (BLOCK_N x D fp32 each) and the dQ part (BLOCK_M x D) share the registers.
# Compiled for sm_90 (the compile check): D64 at 128-193 registers; at D128, 32x128 and 64x128
# spilled (16-176 B of stack) and so did 32x64 and 64x64 with 4 warps; these take 140-240.
CONFIGS = {
    64: [common.Config.of(num_warps=8, num_stages=2, BLOCK_M=64, BLOCK_N=128),
         common.Config.of(num_warps=8, num_stages=3, BLOCK_M=32, BLOCK_N=128)],
    128: [common.Config.of(num_warps=8, num_stages=2, BLOCK_M=64, BLOCK_N=64),
          common.Config.of(num_warps=8, num_stages=2, BLOCK_M=16, BLOCK_N=128),
          common.Config.of(num_warps=8, num_stages=2, BLOCK_M=32, BLOCK_N=64)],
}
INTERPRET_CONFIG = common.Config.of(num_warps=1, num_stages=1, BLOCK_M=32, BLOCK_N=64)
CONVERT_BLOCK_M = 64
_CACHE = common.ConfigCache("attention_bwd_dq_atomic")
_LOG2E = 1.4426950408889634


@triton.jit
def _step(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_h, stats_h, stride_stat, h, start_m, offs_n, Lq, D,
          diag_hi, qk_scale, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """Query block [start_m, start_m + BLOCK_M) of head ``h``: its contributions to the key
    block's dK, dV (returned) and the key block's contribution to its dQ (reduce-added into
    the accumulator: ``dq_desc``, or at ``DQ_h``, the head's rows, in the interpreter).

    Queries past Lq (zero rows) and rows with no visible key have LSE * log2(e) = +inf in the
    statistics, hence P = 0 and dS = 0; keys past Lk are zero rows of K and V (their dK, dV rows
    are never stored, their dQ part is dS times a zero row). ``MASKED``: the block straddles
    the causal diagonal (keys j <= i + diag_hi)."""
    PRECISION: tl.constexpr = "tf32"  # 16-bit operands: unused
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([h, start_m, 0]).reshape([BLOCK_M, BLOCK_D])
    do = do_desc.load([h, start_m, 0]).reshape([BLOCK_M, BLOCK_D])
    stats = stats_h + start_m + tl.arange(0, BLOCK_M)
    lse2 = tl.load(stats)
    qkT = common.dot(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET, PRECISION)
    pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
    if MASKED:
        pT = tl.where(offs_n[:, None] <= offs_m[None, :] + diag_hi, pT, 0.0)
    dv = common.dot(common.cast(pT, do.dtype, INTERPRET), do, dv, INTERPRET, PRECISION)
    dpT = common.dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET, PRECISION)
    delta = tl.load(stats + stride_stat)
    dsT = common.cast(pT * (dpT - delta[None, :]), q.dtype, INTERPRET)
    dk = common.dot(dsT, q, dk, INTERPRET, PRECISION)
    dq = common.dot(tl.trans(dsT), k, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), INTERPRET, PRECISION)
    if INTERPRET:
        cols = tl.arange(0, BLOCK_D)
        ptrs = DQ_h + h.to(tl.int64) * Lq * D + offs_m[:, None].to(tl.int64) * D + cols[None, :]
        tl.atomic_add(ptrs, dq, mask=(offs_m < Lq)[:, None] & (cols < D)[None, :])
    else:
        dq_desc.atomic_add([h, start_m, 0], dq.reshape([1, BLOCK_M, BLOCK_D]))
    return dk, dv


# Shape arguments are not specialized (as the other attention kernels'): the compile check
# builds exactly what runs.
@triton.jit(do_not_specialize=("Hq", "GROUPS", "Lq", "Lk"))
def _attn_bwd_dq_atomic(Q, K, V, DO, DQ_ACC, DK, DV, STATS,
                        stride_qb, stride_qh, stride_qm,
                        stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn,
                        stride_dob, stride_doh, stride_dom,
                        stride_dkb, stride_dkh, stride_dkn, stride_stat,
                        Hq, Hkv, GROUPS, Lq, Lk, D, scale,
                        IS_CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """Program = (batch, kv head, key block), key blocks in order (under a causal mask the
    first see the most queries: the heaviest start first). dK, dV of the block summed over the
    group's heads (DK and DV share strides), dQ parts into ``DQ_ACC`` (contiguous (B, Hq, Lq, D)
    fp32, zeroed by the launcher), unscaled. ``STATS``: ``_attn_bwd_preprocess``'s rows."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(Lk, BLOCK_N)
    bhk = pid // num_n_blocks
    start_n = (pid % num_n_blocks) * BLOCK_N
    b = bhk // Hkv
    hk = bhk % Hkv
    qk_scale = scale * 1.4426950408889634
    diag_hi = Lk - Lq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    k = _desc(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, True).load([start_n, 0])
    v = _desc(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, True).load([start_n, 0])
    q_desc = _desc3(Q + b.to(tl.int64) * stride_qb, Hq, Lq, D, stride_qh, stride_qm, BLOCK_M, BLOCK_D, True)
    do_desc = _desc3(DO + b.to(tl.int64) * stride_dob, Hq, Lq, D, stride_doh, stride_dom, BLOCK_M, BLOCK_D, True)
    DQ_b = DQ_ACC + b.to(tl.int64) * Hq * Lq * D
    if INTERPRET:
        dq_desc = DQ_b  # unused: the interpreter adds through pointers
    else:
        dq_desc = tl.make_tensor_descriptor(DQ_b, [Hq, Lq, D], [Lq.to(tl.int64) * D, D, 1], [1, BLOCK_M, BLOCK_D])
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # [m_lo, head_end): blocks on the causal diagonal (masked); [head_end, m_end): every key
    # of the block visible (the partial last query block too: zero rows, P = 0).
    m_lo, head_end, full_end, m_end = _query_ranges(start_n, Lq, diag_hi, 0, BLOCK_M, BLOCK_N, IS_CAUSAL, False,
                                                    True)
    h0 = hk * GROUPS
    stats0 = STATS + (b * Hq + h0).to(tl.int64) * (2 * stride_stat)
    # One flat loop per part over the (group head, query block) pairs, with counters (as
    # backward.py's): the block advances and past the part's end wraps to the next head.
    n_full = (m_end - head_end) // BLOCK_M
    h = h0
    stats_h = stats0
    start_m = head_end
    for _ in tl.range(0, GROUPS * n_full):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        dk, dv = _step(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, stats_h, stride_stat, h, start_m, offs_n, Lq,
                       D, diag_hi, qk_scale, False, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)
        start_m += BLOCK_M
        wrap = start_m >= m_end
        start_m = tl.where(wrap, head_end, start_m)
        h += wrap.to(tl.int32)
        stats_h += tl.where(wrap, 2 * stride_stat, 0)
    if IS_CAUSAL:
        n_head = (head_end - m_lo) // BLOCK_M
        h = h0
        stats_h = stats0
        start_m = m_lo
        for _ in tl.range(0, GROUPS * n_head):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _step(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, stats_h, stride_stat, h, start_m, offs_n,
                           Lq, D, diag_hi, qk_scale, True, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)
            start_m += BLOCK_M
            wrap = start_m >= head_end
            start_m = tl.where(wrap, m_lo, start_m)
            h += wrap.to(tl.int32)
            stats_h += tl.where(wrap, 2 * stride_stat, 0)
    dk_base = DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    dv_base = DV + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    _desc(dk_base, Lk, D, stride_dkn, BLOCK_N, BLOCK_D, True).store(
        [start_n, 0], common.cast(dk * scale, DK.dtype.element_ty, INTERPRET))
    _desc(dv_base, Lk, D, stride_dkn, BLOCK_N, BLOCK_D, True).store(
        [start_n, 0], common.cast(dv, DV.dtype.element_ty, INTERPRET))


@triton.jit(do_not_specialize=("Hq", "Lq"))
def _dq_convert(DQ_ACC, DQ, stride_dqb, stride_dqh, stride_dqm, Hq, Lq, D, scale, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """dQ = accumulator * scale in DQ's dtype, rows [start_m, start_m + BLOCK_M) of one
    (batch, head); DQ any (batch, head, row) strides with a contiguous last dim."""
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(Lq, BLOCK_M)
    bh = pid // num_m_blocks
    rows = (pid % num_m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < Lq)[:, None] & (cols < D)[None, :]
    acc = tl.load(DQ_ACC + bh.to(tl.int64) * Lq * D + rows[:, None].to(tl.int64) * D + cols[None, :], mask=mask)
    b = bh // Hq
    h = bh % Hq
    dq_ptrs = (DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + rows[:, None].to(tl.int64) * stride_dqm
               + cols[None, :])
    tl.store(dq_ptrs, common.cast(acc * scale, DQ.dtype.element_ty, INTERPRET), mask=mask)


def supports(*, arch: int, dtype, block_d: int, use_tma: bool, dropout_p: float, key_padding_mask, has_window: bool,
             varlen, score_mod: bool, dbias) -> bool:
    """Whether the atomic-dQ backward takes a call (the switch and determinism aside).
    ``has_window``: a window, or a right bound other than the causal diagonal's."""
    return (arch in (0, 90) and use_tma and dtype in (torch.float16, torch.bfloat16) and block_d in BLOCK_DS
            and dropout_p == 0.0 and key_padding_mask is None and not has_window and varlen is None
            and not score_mod and dbias is None)


def taken(**features) -> bool:
    """The switch, deterministic mode and :func:`supports`: whether this call runs here."""
    return ENABLED and not torch.are_deterministic_algorithms_enabled() and supports(**features)


def backward(q, k, v, do, dq, dk, dv, stats, stride_stat: int, causal: bool, scale: float, strides, arch: int,
             block_d: int) -> None:
    """dQ, dK, dV into ``dq``, ``dk``, ``dv`` (``launchers.backward``'s, after its preprocess
    wrote ``stats``); ``strides``: the (batch, head, row) strides of q, k, v, do, dq, dk."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    sq, sk, sv, sdo, sdq, sdk = strides
    acc = torch.empty((B, Hq, Lq, D), dtype=torch.float32, device=q.device)
    if arch:
        common.scratch_allocator()  # device-side descriptors' scratch
    args = (q, k, v, do, acc, dk, dv, stats, *sq, *sk, *sv, *sdo, *sdk, stride_stat, Hq, Hkv, Hq // Hkv, Lq, Lk, D,
            float(scale))
    constexprs = dict(IS_CAUSAL=causal, BLOCK_D=block_d, INTERPRET=arch == 0)

    def run(cfg):
        acc.zero_()  # idempotent for the tuner's timing: the kernel accumulates
        common.launch("attention_bwd_dq_atomic", _attn_bwd_dq_atomic,
                      (B * Hkv * common.cdiv(Lk, cfg["BLOCK_N"]),), args, constexprs, cfg)

    key = (arch, block_d, causal, Hq // Hkv > 1, _bucket(Lq), _bucket(Lk))
    cands = CONFIGS[block_d] if arch else [INTERPRET_CONFIG]
    cfg = _CACHE.chosen.get(key)
    if cfg is None:
        cfg = _CACHE.get(key, cands, run)
    run(cfg)
    common.launch("attention_dq_convert", _dq_convert, (B * Hq * common.cdiv(Lq, CONVERT_BLOCK_M),),
                  (acc, dq, *sdq, Hq, Lq, D, float(scale)),
                  dict(BLOCK_M=CONVERT_BLOCK_M, BLOCK_D=block_d, INTERPRET=arch == 0),
                  common.Config.of(num_warps=4))
