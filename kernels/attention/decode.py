"""Split-KV decoding (flash-decoding): few query rows against a long KV cache.

With Lq <= 16 (a decode step) the forward's grid has B * Hq * 1 programs: too few to fill the
GPU while each walks the whole cache. Here the keys are split into ``n_splits`` chunks, one
program per (batch, kv head, row block, chunk), and a second kernel combines the chunks'
partial outputs by their log-sum-exps. The programs of a kv head take the whole GQA group's
query rows at once (row r is query r % Lq of head hk * GROUPS + r // Lq), so each K/V tile
is read once per group, not once per query head.

- ``_attn_decode_split``: one chunk's partial output (fp32, normalized by the chunk's own
  denominator) and its LSE (log2 domain, -inf where no key of the chunk is visible). Key
  blocks inside the chunk that every row sees run unmasked (the forward's key step,
  :func:`forward._fwd_step`), the others masked; causal (bottom-right), window, key padding,
  softcap, ALiBi, an additive bias and a bool mask as the forward's (key blocks the mask hides
  from every row of the program skipped). fp32 under TF32: P @ V with P split into two TF32
  parts (:func:`forward._pv_tf32`), so that the backward's delta matches its sum P dP.
- ``_attn_decode_combine``: per (batch, head) and rows, out = sum_s 2^(lse_s - m) out_s / sum_s
  2^(lse_s - m) (+ the sink's 2^(sink - m) in the denominator), LSE in natural log.

The output and LSE are the forward's (same semantics), so the backward is the regular one.
"""
import triton
import triton.language as tl

from fused_block.kernels import common
from fused_block.kernels.attention.forward import _fwd_step
from fused_block.kernels.attention.helpers import _clamp_ranges, _desc


@triton.jit(do_not_specialize=["Hq", "GROUPS", "Lq", "Lk", "stride_mb", "win_left", "win_right", "n_splits",
                               "split_len"])
def _attn_decode_split(Q, K, V, OP, LSEP, MASK, SLOPES, BIAS, AMASK, KR,
                       stride_qb, stride_qh, stride_qm,
                       stride_kb, stride_kh, stride_kn,
                       stride_vb, stride_vh, stride_vn,
                       stride_mb, stride_slb,
                       stride_bb, stride_bh, stride_bm, stride_bn,
                       stride_ab, stride_ah, stride_am, stride_an, stride_krb, stride_krh,
                       Hq, Hkv, GROUPS, Lq, Lk, D, win_left, win_right, n_splits, split_len,
                       scale, softcap,
                       IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, SOFTCAP: tl.constexpr,
                       HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_AMASK: tl.constexpr,
                       USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """Program (((b * Hkv + hk) * n_row_blocks + row block) * n_splits + split): rows [r0, r0 +
    BLOCK_M) of the group's GROUPS * Lq rows against keys [split * split_len, (split + 1) *
    split_len) (split_len a multiple of BLOCK_N). OP: (B * Hq, n_splits, Lq, BLOCK_D) fp32,
    LSEP: (B * Hq, n_splits, Lq) fp32 (log2 domain).

    ``HAS_BIAS`` / ``HAS_AMASK``: the forward's additive bias and bool mask (4 strides each over
    (B, Hq, Lq, Lk), 0 along broadcast dims), read at each row's (head, query); KR: per (batch,
    kv head) the key range [r0, r1) of the blocks the mask leaves visible to any query of the
    GQA group (``launchers._mask_ranges`` with one query block, heads merged per group), int32
    pairs, strides ``stride_kr*``: the chunk's blocks outside it are skipped."""
    pid = tl.program_id(0)
    split = pid % n_splits
    n_rb = tl.cdiv(GROUPS * Lq, BLOCK_M)
    rb = (pid // n_splits) % n_rb
    bhk = pid // (n_splits * n_rb)
    b = bhk // Hkv
    hk = bhk % Hkv
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUPS * Lq
    qi = rows % Lq  # query index of each row
    h = hk * GROUPS + tl.minimum(rows // Lq, GROUPS - 1)  # its head
    cols = tl.arange(0, BLOCK_D)
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64)[:, None] * stride_qh
              + qi.to(tl.int64)[:, None] * stride_qm + cols[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (cols < D)[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    k_desc = _desc(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
    v_desc = _desc(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
    pad_base = MASK + b.to(tl.int64) * stride_mb
    qk_scale = scale * 1.4426950408889634
    cap_in = 0.0
    cap_out = 0.0
    if SOFTCAP:
        cap_in = scale / softcap
        cap_out = softcap * 1.4426950408889634
    slope2 = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if HAS_ALIBI:
        slope2 = (tl.load(SLOPES + b * stride_slb + h) * 1.4426950408889634)[:, None]
    diag_hi = Lk - Lq + win_right
    diag_lo = Lk - Lq - win_left
    # The chunk's keys within the band: rows see j <= qi + diag_hi (qi < Lq) and j >= qi + diag_lo.
    lo = split * split_len
    hi = tl.minimum(Lk, lo + split_len)
    full_hi = tl.maximum(lo, (hi // BLOCK_N) * BLOCK_N)
    if IS_CAUSAL:
        hi = tl.minimum(hi, tl.maximum(Lq - 1 + diag_hi + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(diag_hi + 1, 0) // BLOCK_N) * BLOCK_N)
    full_lo = lo
    if WINDOW:
        lo = tl.maximum(lo, (tl.maximum(diag_lo, 0) // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(lo, tl.cdiv(tl.maximum(Lq - 1 + diag_lo, 0), BLOCK_N) * BLOCK_N)
        # Never past the chunk's last block (its keys are the next chunk's).
        full_lo = tl.minimum(full_lo, tl.maximum(lo, tl.cdiv(hi, BLOCK_N) * BLOCK_N))
    full_hi = tl.maximum(full_hi, full_lo)
    hi = tl.maximum(hi, lo)
    # Bias and mask rows per row (its head's, its query's): the steps add the key offsets only.
    b64, h64, qi64 = b.to(tl.int64), h.to(tl.int64), qi.to(tl.int64)
    bias_base = BIAS
    if HAS_BIAS:
        bias_base = BIAS + (b64 * stride_bb + h64 * stride_bh + qi64 * stride_bm)[:, None]
    amask_base = AMASK
    if HAS_AMASK:
        amask_base = AMASK + (b64 * stride_ab + h64 * stride_ah + qi64 * stride_am)[:, None]
        kr = KR + b64 * stride_krb + hk.to(tl.int64) * stride_krh
        lo, full_lo, full_hi, hi = _clamp_ranges(lo, full_lo, full_hi, hi, tl.load(kr), tl.load(kr + 1))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in tl.range(full_lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, 0, start_n, qi,
                                  diag_hi, diag_lo, Lq, Lk, D, stride_kn, stride_vn, qk_scale, 0, 0, 0.0, cap_in,
                                  cap_out, slope2, bias_base, 0, stride_bn, amask_base, 0, stride_an,
                                  False, IS_CAUSAL, WINDOW, HAS_PAD, False, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK,
                                  USE_TMA, False, IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET, True)
    for start_n in tl.range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, 0, start_n, qi,
                                  diag_hi, diag_lo, Lq, Lk, D, stride_kn, stride_vn, qk_scale, 0, 0, 0.0, cap_in,
                                  cap_out, slope2, bias_base, 0, stride_bn, amask_base, 0, stride_an,
                                  True, IS_CAUSAL, WINDOW, HAS_PAD, False, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK,
                                  USE_TMA, False, IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET, True)
    if WINDOW:
        for start_n in tl.range(lo, full_lo, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, 0, start_n,
                                      qi, diag_hi, diag_lo, Lq, Lk, D, stride_kn, stride_vn, qk_scale, 0, 0, 0.0,
                                      cap_in, cap_out, slope2, bias_base, 0, stride_bn, amask_base, 0, stride_an,
                                      True, IS_CAUSAL, WINDOW, HAS_PAD, False, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                                      HAS_AMASK, USE_TMA, False, IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET,
                                      True)
    empty = l_i == 0.0
    out = acc * (1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    bh = (b * Hq + h).to(tl.int64)
    part = (bh * n_splits + split) * Lq + qi
    tl.store(OP + part[:, None] * BLOCK_D + cols[None, :], out, mask=row_ok[:, None])
    tl.store(LSEP + part, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["Hq", "Lq", "n_splits"])
def _attn_decode_combine(OP, LSEP, O, LSE, SINKS, stride_ob, stride_oh, stride_om, Hq, Lq, D, n_splits,
                         HAS_SINKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """Program (b * Hq + h) * cdiv(Lq, BLOCK_M) + row block: rows of one head, the chunks'
    partials combined by their LSEs (two passes over the chunks: the maximum, then the sums)."""
    pid = tl.program_id(0)
    n_mb = tl.cdiv(Lq, BLOCK_M)
    bh = pid // n_mb
    rows = (pid % n_mb) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Lq
    cols = tl.arange(0, BLOCK_D)
    base = bh.to(tl.int64) * n_splits * Lq
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(0, n_splits):
        m = tl.maximum(m, tl.load(LSEP + base + s * Lq + rows, mask=row_ok, other=float("-inf")))
    if HAS_SINKS:
        sink2 = tl.load(SINKS + bh % Hq).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(0, n_splits):
        w = tl.math.exp2(tl.load(LSEP + base + s * Lq + rows, mask=row_ok, other=float("-inf")) - m_use)
        part = tl.load(OP + (base + s * Lq + rows)[:, None] * BLOCK_D + cols[None, :], mask=row_ok[:, None],
                       other=0.0)
        acc += w[:, None] * part
        den += w
    if HAS_SINKS:
        den += tl.math.exp2(sink2 - m_use)
    empty = den == 0.0
    out = acc * (1.0 / tl.where(empty, 1.0, den))[:, None]
    lse = tl.where(empty, float("-inf"), (m_use + tl.math.log2(tl.where(empty, 1.0, den))) * 0.6931471805599453)
    b = bh // Hq
    h = bh % Hq
    o_ptrs = (O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows.to(tl.int64)[:, None] * stride_om
              + cols[None, :])
    tl.store(o_ptrs, common.cast(out, O.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & (cols < D)[None, :])
    tl.store(LSE + bh.to(tl.int64) * Lq + rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["Hkv", "L_new", "L_cache"])
def _kv_cache_append(KC, VC, KN, VN, SEQLENS,
                     stride_kcb, stride_kch, stride_kcn,
                     stride_vcb, stride_vch, stride_vcn,
                     stride_knb, stride_knh, stride_knn,
                     stride_vnb, stride_vnh, stride_vnn,
                     Hkv, L_new, L_cache, D, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program ((b * Hkv + hk) * cdiv(L_new, BLOCK_M) + row block): rows [r0, r0 + BLOCK_M) of the
    new keys and values of (b, hk) written into the caches at SEQLENS[b] + row, in place; rows
    that would land outside [0, L_cache) are dropped (never out of bounds, a negative
    SEQLENS[b] included)."""
    pid = tl.program_id(0)
    n_rb = tl.cdiv(L_new, BLOCK_M)
    bh = pid // n_rb
    b = bh // Hkv
    hk = bh % Hkv
    rows = (pid % n_rb) * BLOCK_M + tl.arange(0, BLOCK_M)
    dst = tl.load(SEQLENS + b) + rows
    cols = tl.arange(0, BLOCK_D)
    ok = ((rows < L_new) & (dst >= 0) & (dst < L_cache))[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    d64 = dst.to(tl.int64)[:, None]
    k = tl.load(KN + b.to(tl.int64) * stride_knb + hk.to(tl.int64) * stride_knh + r64 * stride_knn + cols[None, :],
                mask=ok)
    tl.store(KC + b.to(tl.int64) * stride_kcb + hk.to(tl.int64) * stride_kch + d64 * stride_kcn + cols[None, :], k,
             mask=ok)
    v = tl.load(VN + b.to(tl.int64) * stride_vnb + hk.to(tl.int64) * stride_vnh + r64 * stride_vnn + cols[None, :],
                mask=ok)
    tl.store(VC + b.to(tl.int64) * stride_vcb + hk.to(tl.int64) * stride_vch + d64 * stride_vcn + cols[None, :], v,
             mask=ok)
