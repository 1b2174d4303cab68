"""FlashAttention-style fused softmax attention: forward, backward, and the dropout keep-mask.

Layout is SDPA's: q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D), any strides with a contiguous
last dim; Hq % Hkv == 0 (GQA/MQA: query head h reads K/V head h // (Hq // Hkv)). Causal
alignment is bottom-right: query i sees keys j <= i + Lk - Lq. ``MASK`` is the (B, Lk) key
padding mask as uint8 (1 = padding). A query row with no visible key outputs 0 and has
LSE = -inf; its gradients are 0.

- ``_attn_fwd``: one program per (query block, batch*head); online softmax in fp32 with
  ``exp2`` (log2(e) folded into the scale). Key blocks every row of the query block sees are
  processed without masks; only the blocks that straddle the causal diagonal (or the end of
  the keys) pay for masking, and blocks entirely above the diagonal are never visited.
  Saves only O and the fp32 natural-log LSE (B, Hq, Lq).
- ``_attn_bwd_preprocess``: delta = rowsum(dO * O) - dLSE (fp32). The dLSE term makes the
  LSE output differentiable: d lse_i / d s_ij = P_ij.
- ``_attn_bwd_dkdv``: one program per (key block, batch*kv_head); loops over the group's
  query heads and over query blocks, so GQA dK/dV are summed without atomics. Under a causal
  mask the query blocks that see none of the key block are skipped.
- ``_attn_bwd_dq``: one program per (query block, batch*head); loops over key blocks.
  Both backward kernels write the output columns [col0, col0 + BLOCK_DC): wide rows (D > 128,
  fp32) run in column chunks, one launch each, and where dK and dV do not fit in registers
  together (``DKDV_SPLIT``) a dV pass and a dK pass (``PART``) replace the joint one. This
  keeps every shipped config free of register spills on sm_80 and sm_90.
- ``_dropout_keep``: keep = uniform(seed, (j, i, batch*Hq + h)) >= p, Philox counters are the
  key index, query index and flattened head, so the mask is regenerated identically in every
  kernel and by ``dropout_keep_mask`` (a test helper) without storing it.

All grids are 1-D (axis 0 allows 2^31 - 1 programs), with the block index fastest so that
consecutive programs share one head's K/V in L2. Base offsets are int64. fp32 operands run
their products in TF32 on the GPU and exist up to D = 128.
"""

import torch
import triton
import triton.language as tl

from fused_block.kernels import common

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _dropout_keep(seed, bh, rows, cols, dropout_p):
    """Bool tile: True where the probability of (query ``rows``, key ``cols``) is kept.

    ``rows`` and ``cols`` are int32 tiles of the same shape; ``bh`` = batch * Hq + head.
    """
    c0 = cols.to(tl.uint32)
    c1 = rows.to(tl.uint32)
    zero = c0 * 0
    c2 = zero + bh.to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, zero)
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_base, v_base, pad_base, start_n, offs_m, offs_d, d_mask,
               stride_kn, stride_vn, Lq, Lk, qk_scale, seed, bh, dropout_p,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               INTERPRET: tl.constexpr):
    """One key block of the online softmax; ``MASKED`` blocks check bounds and causality."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Lk
    if MASKED:
        kv_mask = n_ok[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    # int64 block start (scalar), int32 offsets inside the block: few address registers.
    in_blk = tl.arange(0, BLOCK_N)[:, None]
    k = tl.load(k_base + tl.cast(start_n, tl.int64) * stride_kn + in_blk * stride_kn + offs_d[None, :], mask=kv_mask,
                other=0.0)
    qk = common.dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET)
    qk = qk * qk_scale
    if MASKED:
        visible = n_ok[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Lk - Lq))
        qk = tl.where(visible, qk, float("-inf"))
    if HAS_PAD:
        pad = tl.load(pad_base + offs_n, mask=n_ok, other=1)
        qk = tl.where(pad[None, :] == 0, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (no NaN).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        rows = offs_m[:, None] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        cols = offs_n[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        p = tl.where(_dropout_keep(seed, bh, rows, cols, dropout_p), p, 0.0)
    v = tl.load(v_base + tl.cast(start_n, tl.int64) * stride_vn + in_blk * stride_vn + offs_d[None, :], mask=kv_mask,
                other=0.0)
    acc = common.dot(common.cast(p, v.dtype, INTERPRET), v, acc, INTERPRET)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, MASK, SEED,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_ob, stride_oh, stride_om,
              stride_mb,
              Hq, GROUPS, Lq, Lk, D,
              scale, dropout_p,
              LQ_BUCKET, LK_BUCKET,  # autotune keys only
              IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(Lq, BLOCK_M)
    bh = pid // num_m_blocks
    # Reverse the block order: under a causal mask the last query blocks do the most work.
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUPS
    start_m = m_block * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m_ok = offs_m < Lq
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    pad_base = MASK + b.to(tl.int64) * stride_mb
    q = tl.load(q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=m_ok[:, None] & d_mask[None, :], other=0.0)

    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax with exp2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys [0, full_end) are visible to every row of the block and in bounds: no masks there.
    full_end = (Lk // BLOCK_N) * BLOCK_N
    hi = Lk
    if IS_CAUSAL:
        full_end = tl.minimum(full_end, (tl.maximum(start_m + Lk - Lq + 1, 0) // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(Lk, tl.maximum(start_m + BLOCK_M + Lk - Lq, 0))
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, pad_base, start_n, offs_m, offs_d,
                                   d_mask, stride_kn, stride_vn, Lq, Lk, qk_scale, seed, bh, dropout_p,
                                   False, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, BLOCK_M, BLOCK_N, INTERPRET)
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, pad_base, start_n, offs_m, offs_d,
                                   d_mask, stride_kn, stride_vn, Lq, Lk, qk_scale, seed, bh, dropout_p,
                                   True, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, BLOCK_M, BLOCK_N, INTERPRET)

    empty = l_i == 0.0  # no visible key: output 0, LSE -inf
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :],
             common.cast(out, O.dtype.element_ty, INTERPRET), mask=m_ok[:, None] & d_mask[None, :])
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=m_ok)


@triton.jit
def _attn_bwd_preprocess(O, DO, DLSE, DELTA,
                         stride_ob, stride_oh, stride_om,
                         stride_dob, stride_doh, stride_dom,
                         Hq, Lq, D, num_m_blocks,
                         HAS_DLSE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    bh = pid // num_m_blocks
    b = bh // Hq
    h = bh % Hq
    offs_m = (pid % num_m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    mask = m_ok[:, None] & (offs_d < D)[None, :]
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dom
                 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    row_base = bh.to(tl.int64) * Lq
    if HAS_DLSE:
        delta -= tl.load(DLSE + row_base + offs_m, mask=m_ok, other=0.0)
    tl.store(DELTA + row_base + offs_m, delta, mask=m_ok)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, offs_n, offs_d, d_mask,
                offs_c, c_mask, stride_qm, stride_dom, Lq, Lk, qk_scale, seed, bh, dropout_p, inv_keep,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, PART: tl.constexpr,
                CHUNKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """One query block's contribution to a key block's dK and dV (computed transposed).

    ``PART``: 0 computes both, 1 only dV, 2 only dK. ``CHUNKED``: only the output columns
    ``offs_c`` are accumulated (wide heads: smaller fp32 accumulators).
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Lq
    in_blk = tl.arange(0, BLOCK_M)
    qT = tl.load(q_base + tl.cast(start_m, tl.int64) * stride_qm + in_blk[None, :] * stride_qm + offs_d[:, None],
                 mask=d_mask[:, None] & m_ok[None, :], other=0.0)
    # Rows past Lq get LSE = +inf, hence P = 0; rows with no visible key (LSE = -inf) too.
    lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    qkT = common.dot(k, qT, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET)
    pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
    if MASKED and IS_CAUSAL:
        pT = tl.where(offs_n[:, None] <= offs_m[None, :] + (Lk - Lq), pT, 0.0)
    do = tl.load(do_base + tl.cast(start_m, tl.int64) * stride_dom + in_blk[:, None] * stride_dom + offs_d[None, :],
                 mask=m_ok[:, None] & d_mask[None, :], other=0.0)
    if HAS_DROPOUT:
        rows_t = offs_m[None, :] + tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        cols_t = offs_n[:, None] + tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        keep = _dropout_keep(seed, bh, rows_t, cols_t, dropout_p)
    if PART != 2:
        if HAS_DROPOUT:
            pdT = tl.where(keep, pT * inv_keep, 0.0)
        else:
            pdT = pT
        if CHUNKED:
            do_c = tl.load(do_base + tl.cast(start_m, tl.int64) * stride_dom + in_blk[:, None] * stride_dom
                           + offs_c[None, :], mask=m_ok[:, None] & c_mask[None, :], other=0.0)
        else:
            do_c = do
        dv = common.dot(common.cast(pdT, do.dtype, INTERPRET), do_c, dv, INTERPRET)
    if PART != 1:
        dpT = common.dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET)
        if HAS_DROPOUT:
            dpT = tl.where(keep, dpT * inv_keep, 0.0)
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        dsT = pT * (dpT - delta[None, :])
        if CHUNKED:
            q_c = tl.load(q_base + tl.cast(start_m, tl.int64) * stride_qm + in_blk[:, None] * stride_qm
                          + offs_c[None, :],
                          mask=m_ok[:, None] & c_mask[None, :], other=0.0)
        else:
            q_c = tl.trans(qT)
        dk = common.dot(common.cast(dsT, qT.dtype, INTERPRET), q_c, dk, INTERPRET)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, MASK, SEED,
                   stride_qb, stride_qh, stride_qm,
                   stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn,
                   stride_dob, stride_doh, stride_dom,
                   stride_dkb, stride_dkh, stride_dkn,
                   stride_mb,
                   Hq, Hkv, GROUPS, Lq, Lk, D, col0,
                   scale, dropout_p,
                   LQ_BUCKET, LK_BUCKET,  # autotune keys only
                   IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   PART: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(Lk, BLOCK_N)
    bhk = pid // num_n_blocks
    start_n = (pid % num_n_blocks) * BLOCK_N
    b = bhk // Hkv
    hk = bhk % Hkv

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    n_ok = offs_n < Lk
    kv_mask = n_ok[:, None] & d_mask[None, :]
    cols = offs_n[:, None].to(tl.int64)
    k = tl.load(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + cols * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + cols * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    # This program writes output columns [col0, col0 + BLOCK_DC) (all of them unless chunked).
    offs_c = col0 + tl.arange(0, BLOCK_DC)
    c_mask = offs_c < D
    dk = tl.zeros([BLOCK_N, BLOCK_DC], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DC], dtype=tl.float32)

    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    inv_keep = 1.0 / (1.0 - dropout_p)
    qk_scale = scale * 1.4426950408889634
    # Under a causal mask, query blocks before m_lo see no key of this block and are skipped;
    # the rest run in one loop with the mask applied (one loop body keeps register pressure
    # low enough for wgmma tiles without spills). Keys past Lk need no mask: their rows of dK
    # and dV are not stored.
    m_lo = 0
    if IS_CAUSAL:
        m_lo = (tl.maximum(start_n - (Lk - Lq), 0) // BLOCK_M) * BLOCK_M
    for g in range(0, GROUPS):
        h = hk * GROUPS + g
        bh = b * Hq + h
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        lse_base = LSE + bh.to(tl.int64) * Lq
        delta_base = DELTA + bh.to(tl.int64) * Lq
        for start_m in range(m_lo, Lq, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, offs_n, offs_d,
                                 d_mask, offs_c, c_mask, stride_qm, stride_dom, Lq, Lk, qk_scale, seed, bh,
                                 dropout_p, inv_keep, IS_CAUSAL, IS_CAUSAL, HAS_DROPOUT, PART, BLOCK_DC < BLOCK_D,
                                 BLOCK_M, BLOCK_N, INTERPRET)

    dk = dk * scale
    if HAS_PAD:
        # A padded key is invisible to every query: its dK and dV are exactly 0.
        pad = tl.load(MASK + b.to(tl.int64) * stride_mb + offs_n, mask=n_ok, other=1)
        dk = tl.where(pad[:, None] == 0, dk, 0.0)
        dv = tl.where(pad[:, None] == 0, dv, 0.0)
    out_off = b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + cols * stride_dkn + offs_c[None, :]
    out_mask = n_ok[:, None] & c_mask[None, :]
    if PART != 1:
        tl.store(DK + out_off, common.cast(dk, DK.dtype.element_ty, INTERPRET), mask=out_mask)
    if PART != 2:
        tl.store(DV + out_off, common.cast(dv, DV.dtype.element_ty, INTERPRET), mask=out_mask)


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_base, v_base, pad_base, start_n, offs_m, offs_d, d_mask, offs_c, c_mask,
              stride_kn, stride_vn, Lq, Lk, qk_scale, seed, bh, dropout_p, inv_keep,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, CHUNKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              INTERPRET: tl.constexpr):
    """One key block's contribution to a query block's dQ (columns ``offs_c`` when ``CHUNKED``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Lk
    if MASKED:
        kv_mask = d_mask[:, None] & n_ok[None, :]
    else:
        kv_mask = d_mask[:, None]
    in_blk = tl.arange(0, BLOCK_N)[None, :]
    kT = tl.load(k_base + tl.cast(start_n, tl.int64) * stride_kn + in_blk * stride_kn + offs_d[:, None], mask=kv_mask,
                 other=0.0)
    vT = tl.load(v_base + tl.cast(start_n, tl.int64) * stride_vn + in_blk * stride_vn + offs_d[:, None], mask=kv_mask,
                 other=0.0)
    qk = common.dot(q, kT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET)
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASKED:
        visible = n_ok[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Lk - Lq))
        p = tl.where(visible, p, 0.0)
    if HAS_PAD:
        pad = tl.load(pad_base + offs_n, mask=n_ok, other=1)
        p = tl.where(pad[None, :] == 0, p, 0.0)
    dp = common.dot(do, vT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET)
    if HAS_DROPOUT:
        rows = offs_m[:, None] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        cols_i = offs_n[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        keep = _dropout_keep(seed, bh, rows, cols_i, dropout_p)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    if CHUNKED:
        k_c = tl.load(k_base + tl.cast(start_n, tl.int64) * stride_kn + tl.arange(0, BLOCK_N)[:, None] * stride_kn
                      + offs_c[None, :],
                      mask=n_ok[:, None] & c_mask[None, :], other=0.0)
    else:
        k_c = tl.trans(kT)
    dq = common.dot(common.cast(ds, kT.dtype, INTERPRET), k_c, dq, INTERPRET)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, MASK, SEED,
                 stride_qb, stride_qh, stride_qm,
                 stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn,
                 stride_dob, stride_doh, stride_dom,
                 stride_dqb, stride_dqh, stride_dqm,
                 stride_mb,
                 Hq, GROUPS, Lq, Lk, D, col0,
                 scale, dropout_p,
                 LQ_BUCKET, LK_BUCKET,  # autotune keys only
                 IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(Lq, BLOCK_M)
    bh = pid // num_m_blocks
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUPS
    start_m = m_block * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m_ok = offs_m < Lq
    rows = offs_m[:, None].to(tl.int64)
    q_mask = m_ok[:, None] & d_mask[None, :]
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows * stride_qm + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dom
                 + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * Lq + offs_m, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + bh.to(tl.int64) * Lq + offs_m, mask=m_ok, other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    pad_base = MASK + b.to(tl.int64) * stride_mb

    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    inv_keep = 1.0 / (1.0 - dropout_p)
    qk_scale = scale * 1.4426950408889634
    # This program writes dQ columns [col0, col0 + BLOCK_DC) (all of them unless chunked).
    offs_c = col0 + tl.arange(0, BLOCK_DC)
    c_mask = offs_c < D
    dq = tl.zeros([BLOCK_M, BLOCK_DC], dtype=tl.float32)
    # Whole key blocks run without masks, the partial last one with. Under a causal mask the
    # blocks above the diagonal are skipped and the rest run in one masked loop (one loop body
    # keeps register pressure low enough for wgmma tiles without spills).
    full_end = (Lk // BLOCK_N) * BLOCK_N
    hi = Lk
    if IS_CAUSAL:
        full_end = 0
        hi = tl.minimum(Lk, tl.maximum(start_m + BLOCK_M + Lk - Lq, 0))
    for start_n in range(0, full_end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, pad_base, start_n, offs_m, offs_d, d_mask, offs_c,
                       c_mask, stride_kn, stride_vn, Lq, Lk, qk_scale, seed, bh, dropout_p, inv_keep,
                       False, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, BLOCK_DC < BLOCK_D, BLOCK_M, BLOCK_N, INTERPRET)
    for start_n in range(full_end, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, pad_base, start_n, offs_m, offs_d, d_mask, offs_c,
                       c_mask, stride_kn, stride_vn, Lq, Lk, qk_scale, seed, bh, dropout_p, inv_keep,
                       True, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, BLOCK_DC < BLOCK_D, BLOCK_M, BLOCK_N, INTERPRET)
    dq = dq * scale
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + rows * stride_dqm + offs_c[None, :],
             common.cast(dq, DQ.dtype.element_ty, INTERPRET), mask=m_ok[:, None] & c_mask[None, :])


@triton.jit
def _dropout_mask_kernel(SEED, OUT, Hq, Lq, Lk, num_m_blocks, num_n_blocks, dropout_p,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Materializes the keep mask (B, Hq, Lq, Lk) as uint8 with the kernels' formula (tests)."""
    pid = tl.program_id(0)
    per_head = num_m_blocks * num_n_blocks
    bh = pid // per_head
    offs_m = ((pid % per_head) // num_n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % num_n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m[:, None] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    cols = offs_n[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    keep = _dropout_keep(tl.load(SEED), bh, rows, cols, dropout_p)
    ptrs = OUT + bh.to(tl.int64) * Lq * Lk + offs_m[:, None].to(tl.int64) * Lk + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))


# ---------------------------------------------------------------------------------------------
# configs: (BLOCK_M, BLOCK_N, num_warps, num_stages) by (head-dim class, operand bytes, dropout).
# BLOCK_M is the query block and BLOCK_N the key block in every kernel. Dropout's Philox tile
# needs registers, so its configs have fewer elements per thread; fp32 operands (tf32 products)
# need twice the shared memory. Every entry is compiled by tests/test_compile.py.
# ---------------------------------------------------------------------------------------------

FWD_CONFIGS = {
    (64, 2, False): [(128, 64, 4, 3), (128, 128, 8, 3)],
    (64, 2, True): [(64, 64, 8, 3)],
    (128, 2, False): [(128, 32, 8, 3)],
    (128, 2, True): [(64, 32, 4, 2)],
    (256, 2, False): [(64, 32, 8, 2)],
    (256, 2, True): [(64, 16, 8, 1)],
    (128, 4, False): [(64, 32, 8, 2)],
    (128, 4, True): [(64, 16, 8, 2)],
}
DKDV_CONFIGS = {
    (64, 2, False): [(16, 64, 8, 1)],
    (64, 2, True): [(16, 64, 8, 1)],
    (128, 2, False): [(16, 64, 8, 2)],
    (128, 2, True): [(16, 64, 8, 2)],
    (256, 2, False): [(16, 64, 8, 1)],
    (256, 2, True): [(16, 64, 8, 1)],
    (128, 4, False): [(16, 64, 8, 1)],
    (128, 4, True): [(16, 64, 8, 1)],
}
# Classes whose dK and dV fp32 accumulators (plus the Philox tile) do not fit in registers
# together: a dV pass and a dK pass (PART 1 and 2) instead of one (PART 0).
DKDV_SPLIT = {(128, 2, True), (256, 2, False), (256, 2, True), (128, 4, False), (128, 4, True)}
DQ_CONFIGS = {
    (64, 2, False): [(64, 32, 4, 2)],
    (64, 2, True): [(64, 32, 4, 2)],
    (128, 2, False): [(64, 32, 8, 2)],
    (128, 2, True): [(64, 32, 4, 2)],
    (256, 2, False): [(64, 32, 8, 2)],
    (256, 2, True): [(64, 32, 8, 1)],
    (128, 4, False): [(64, 32, 8, 2)],
    (128, 4, True): [(64, 32, 8, 2)],
}
# One config on the interpreter: BLOCK_M != BLOCK_N so that tests cross both block grids.
INTERPRET_FWD = (64, 32, 1, 1)
INTERPRET_DKDV = (32, 64, 1, 1)
INTERPRET_DQ = (64, 32, 1, 1)
PRE_BLOCK_M = 64


def _config_class(block_d: int, elem_size: int, dropout: bool):
    """Config-table key. fp32 (TF32 products) exists up to D = 128 only: wider fp32 tiles spill."""
    if elem_size >= 4:
        if block_d > 128:
            raise ValueError(f"fp32 attention kernels take head dims up to 128, got BLOCK_D={block_d}")
        return (128, 4, dropout)
    return (64 if block_d <= 64 else 128 if block_d <= 128 else 256, 2, dropout)


def _configs(table):
    seen, out = set(), []
    for cfgs in table.values():
        for cfg in cfgs:
            if cfg not in seen:
                seen.add(cfg)
                bm, bn, w, s = cfg
                out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
    return out


def _pruner(table):
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        wanted = table[_config_class(args["BLOCK_D"], args["Q"].element_size(), args["HAS_DROPOUT"])]
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    return prune


# Keys: sequence lengths bucketed to powers of two, so a new length reuses the tuned config.
_KEY = ["LQ_BUCKET", "LK_BUCKET", "BLOCK_D", "IS_CAUSAL", "HAS_PAD", "HAS_DROPOUT"]
_DKDV_KEY = _KEY + ["PART", "BLOCK_DC"]
_attn_fwd_tuned = triton.autotune(_configs(FWD_CONFIGS), key=_KEY,
                                  prune_configs_by={"early_config_prune": _pruner(FWD_CONFIGS)})(_attn_fwd)
_attn_bwd_dkdv_tuned = triton.autotune(_configs(DKDV_CONFIGS), key=_DKDV_KEY,
                                       prune_configs_by={"early_config_prune": _pruner(DKDV_CONFIGS)})(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(_configs(DQ_CONFIGS), key=_KEY + ["BLOCK_DC"],
                                     prune_configs_by={"early_config_prune": _pruner(DQ_CONFIGS)})(_attn_bwd_dq)


def _bucket(n: int) -> int:
    """Autotune key for a sequence length: the next power of two (at least 16)."""
    return max(16, triton.next_power_of_2(n))


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _block_dc(block_d: int, elem_size: int, dropout: bool) -> int:
    """Output columns per backward program, so that the fp32 accumulators of wide rows fit in
    registers: 128 for 2-byte dtypes (64 with dropout's Philox tile at D > 128), 64 for fp32.
    Wider rows take one launch per chunk."""
    if elem_size >= 4:
        return min(block_d, 64)
    if block_d > 128:
        return 64 if dropout else 128
    return block_d


def _launch(tuned, bare, interpret_cfg, grid, args, flags):
    """Autotuned launch on CUDA; the bare kernel with one config on the interpreter."""
    if common.interpreting():
        bm, bn, w, s = interpret_cfg
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn}
        bare[grid(blocks)](*args, **flags, **blocks, INTERPRET=True, num_warps=w, num_stages=s)
    else:
        tuned[grid](*args, **flags, INTERPRET=False)


def _grid_size(n_programs: int) -> int:
    if n_programs > 2**31 - 1:
        raise ValueError(f"attention: {n_programs} programs exceed CUDA's grid limit; split the batch")
    return n_programs


# ---------------------------------------------------------------------------------------------
# launchers (inputs already validated by fused_block.attention; last dims contiguous)
# ---------------------------------------------------------------------------------------------

def _mask_arg(key_padding_mask, dummy):
    if key_padding_mask is None:
        return dummy, 0
    m = key_padding_mask.contiguous().view(torch.uint8)
    return m, m.stride(0)


def _flags(causal, key_padding_mask, dropout_p, d):
    return dict(IS_CAUSAL=bool(causal), HAS_PAD=key_padding_mask is not None,
                HAS_DROPOUT=dropout_p > 0.0, BLOCK_D=_block_d(d))


def attention_forward(q, k, v, key_padding_mask, seed, causal: bool, scale: float, dropout_p: float):
    """Returns ``out`` (B, Hq, Lq, D) in q's dtype and the fp32 natural-log ``lse`` (B, Hq, Lq).

    ``seed`` is a 1-element int64 tensor, read only when ``dropout_p > 0``.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = common.empty((B, Hq, Lq, D), q.dtype, q.device)
    lse = common.empty((B, Hq, Lq), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    mask, stride_mb = _mask_arg(key_padding_mask, q)
    args = (q, k, v, out, lse, mask, seed if dropout_p > 0.0 else q,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            stride_mb, Hq, Hq // Hkv, Lq, Lk, D, float(scale), float(dropout_p), _bucket(Lq), _bucket(Lk))

    def grid(meta):
        return (_grid_size(triton.cdiv(Lq, meta["BLOCK_M"]) * B * Hq),)

    common.count_launch("attention_fwd")
    _launch(_attn_fwd_tuned, _attn_fwd, INTERPRET_FWD, grid, args, _flags(causal, key_padding_mask, dropout_p, D))
    return out, lse


def attention_backward(do, q, k, v, out, lse, dlse, key_padding_mask, seed, causal: bool, scale: float,
                       dropout_p: float):
    """Gradients ``(dq, dk, dv)`` in the inputs' dtypes (dk, dv summed over each GQA group).

    ``do`` has out's shape (any strides with a contiguous last dim); ``lse`` is the forward's;
    ``dlse`` (B, Hq, Lq) or None is the gradient of the LSE output.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dq = common.empty(q.shape, q.dtype, q.device)
    dk = common.empty(k.shape, k.dtype, k.device)
    dv = common.empty(v.shape, v.dtype, v.device)
    if q.numel() == 0 or k.numel() == 0:
        # No query (nothing to differentiate) or no key (every row outputs the constant 0).
        return dq.zero_(), dk.zero_(), dv.zero_()
    mask, stride_mb = _mask_arg(key_padding_mask, q)
    seed_arg = seed if dropout_p > 0.0 else q
    flags = _flags(causal, key_padding_mask, dropout_p, D)
    lse = lse.contiguous()

    delta = common.empty((B, Hq, Lq), torch.float32, q.device)
    n_pre = triton.cdiv(Lq, PRE_BLOCK_M)
    common.count_launch("attention_bwd_preprocess")
    _attn_bwd_preprocess[(_grid_size(n_pre * B * Hq),)](
        out, do, dlse.contiguous() if dlse is not None else lse, delta,
        out.stride(0), out.stride(1), out.stride(2), do.stride(0), do.stride(1), do.stride(2),
        Hq, Lq, D, n_pre, HAS_DLSE=dlse is not None, BLOCK_D=flags["BLOCK_D"], BLOCK_M=PRE_BLOCK_M,
        num_warps=4)

    # Wide rows are accumulated in column chunks (one launch per chunk): see _block_dc.
    block_dc = _block_dc(flags["BLOCK_D"], q.element_size(), flags["HAS_DROPOUT"])
    split = _config_class(flags["BLOCK_D"], q.element_size(), flags["HAS_DROPOUT"]) in DKDV_SPLIT
    for col0 in range(0, D, block_dc):
        for part in (1, 2) if split else (0,):
            common.count_launch("attention_bwd_dkdv")
            _launch(_attn_bwd_dkdv_tuned, _attn_bwd_dkdv, INTERPRET_DKDV,
                    lambda meta: (_grid_size(triton.cdiv(Lk, meta["BLOCK_N"]) * B * Hkv),),
                    (q, k, v, do, lse, delta, dk, dv, mask, seed_arg,
                     q.stride(0), q.stride(1), q.stride(2),
                     k.stride(0), k.stride(1), k.stride(2),
                     v.stride(0), v.stride(1), v.stride(2),
                     do.stride(0), do.stride(1), do.stride(2),
                     dk.stride(0), dk.stride(1), dk.stride(2),
                     stride_mb, Hq, Hkv, Hq // Hkv, Lq, Lk, D, col0, float(scale), float(dropout_p),
                     _bucket(Lq), _bucket(Lk)),
                    dict(flags, PART=part, BLOCK_DC=block_dc))

    for col0 in range(0, D, block_dc):
        common.count_launch("attention_bwd_dq")
        _launch(_attn_bwd_dq_tuned, _attn_bwd_dq, INTERPRET_DQ,
                lambda meta: (_grid_size(triton.cdiv(Lq, meta["BLOCK_M"]) * B * Hq),),
                (q, k, v, do, lse, delta, dq, mask, seed_arg,
                 q.stride(0), q.stride(1), q.stride(2),
                 k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0), v.stride(1), v.stride(2),
                 do.stride(0), do.stride(1), do.stride(2),
                 dq.stride(0), dq.stride(1), dq.stride(2),
                 stride_mb, Hq, Hq // Hkv, Lq, Lk, D, col0, float(scale), float(dropout_p), _bucket(Lq),
                 _bucket(Lk)),
                dict(flags, BLOCK_DC=block_dc))
    return dq, dk, dv


def dropout_keep_mask(seed, B: int, Hq: int, Lq: int, Lk: int, dropout_p: float, device) -> torch.Tensor:
    """The bool keep mask (B, Hq, Lq, Lk) the kernels use for ``seed`` (a test helper)."""
    out = torch.empty((B, Hq, Lq, Lk), dtype=torch.uint8, device=device)
    if out.numel() == 0:
        return out.bool()
    bm = bn = 32
    nm, nn = triton.cdiv(Lq, bm), triton.cdiv(Lk, bn)
    common.count_launch("attention_dropout_mask")
    _dropout_mask_kernel[(_grid_size(nm * nn * B * Hq),)](seed, out, Hq, Lq, Lk, nm, nn, float(dropout_p),
                                                          BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out.bool()


# ---------------------------------------------------------------------------------------------
# ahead-of-time compile specs
# ---------------------------------------------------------------------------------------------

def _signature(fn, ptr_types: dict, floats=("scale", "dropout_p")) -> dict:
    sig = {}
    for param in fn.params:
        if param.is_constexpr:
            sig[param.name] = "constexpr"
        elif param.name in ptr_types:
            sig[param.name] = ptr_types[param.name]
        else:
            sig[param.name] = "fp32" if param.name in floats else "i32"
    return sig


def _strides(fn):
    return tuple(n for n in fn.arg_names if n.startswith("stride_") and n != "stride_mb")


def aot_specs() -> list:
    """Every shipped config, compiled with causal + padding on and dropout as its table says
    (bf16 for 2-byte classes, fp32 for the tf32 classes), plus preprocess and the mask helper.
    A config shared by a class's dropout and no-dropout lists compiles once, with dropout."""
    from fused_block.kernels import aot  # only the compile check needs it

    specs = []
    kernels = (("fwd", _attn_fwd, FWD_CONFIGS, ("Q", "K", "V", "O"), ("LSE",)),
               ("dkdv", _attn_bwd_dkdv, DKDV_CONFIGS, ("Q", "K", "V", "DO", "DK", "DV"), ("LSE", "DELTA")),
               ("dq", _attn_bwd_dq, DQ_CONFIGS, ("Q", "K", "V", "DO", "DQ"), ("LSE", "DELTA")))
    for kname, fn, table, data_ptrs, f32_ptrs in kernels:
        for (block_d, width, dropout), cfgs in table.items():
            same_code = (kname == "fwd" or (_block_dc(block_d, width, True) == _block_dc(block_d, width, False)
                                            and ((block_d, width, True) in DKDV_SPLIT)
                                            == ((block_d, width, False) in DKDV_SPLIT)))
            if not dropout and table[(block_d, width, True)] == cfgs and same_code:
                continue  # the same configs compile below with dropout, the heavier variant
            dt = "fp32" if width == 4 else "bf16"
            ptrs = {p: f"*{dt}" for p in data_ptrs}
            ptrs.update({p: "*fp32" for p in f32_ptrs})
            ptrs.update(MASK="*u8", SEED="*i64")
            parts = [{}]
            if kname == "dkdv":
                split = (block_d, width, dropout) in DKDV_SPLIT
                parts = [{"PART": 1}, {"PART": 2}] if split else [{"PART": 0}]
            for bm, bn, w, s in cfgs:
                for part in parts:
                    label = f" part{part['PART']}" if part.get("PART") else ""
                    specs.append(aot.KernelSpec(
                        name=f"attention_{kname}{label} D{block_d} {dt}{' dropout' if dropout else ''} {bm}x{bn}",
                        fn=fn, signature=_signature(fn, ptrs),
                        constexprs=dict(IS_CAUSAL=True, HAS_PAD=True, HAS_DROPOUT=dropout, BLOCK_D=block_d,
                                        BLOCK_M=bm, BLOCK_N=bn, INTERPRET=False, **part,
                                        **({} if kname == "fwd" else {"BLOCK_DC": _block_dc(block_d, width, dropout)})),
                        num_warps=w, num_stages=s, aligned=_strides(fn) + ("D",), wgmma=True))
    specs.append(aot.KernelSpec(
        name="attention_bwd_preprocess D128 bf16", fn=_attn_bwd_preprocess,
        signature=_signature(_attn_bwd_preprocess, {"O": "*bf16", "DO": "*bf16", "DLSE": "*fp32",
                                                    "DELTA": "*fp32"}),
        constexprs=dict(HAS_DLSE=True, BLOCK_D=128, BLOCK_M=PRE_BLOCK_M), num_warps=4,
        aligned=_strides(_attn_bwd_preprocess) + ("D",)))
    specs.append(aot.KernelSpec(
        name="attention_dropout_mask", fn=_dropout_mask_kernel,
        signature=_signature(_dropout_mask_kernel, {"SEED": "*i64", "OUT": "*u8"}),
        constexprs=dict(BLOCK_M=32, BLOCK_N=32), num_warps=4))
    return specs
