"""The backward kernels: the row statistics (preprocess), then one kernel whose programs compute
dK/dV of a key block or dQ of a query block."""
import triton
import triton.language as tl

from fused_block.kernels import common
from fused_block.kernels.attention.forward import _SHAPE_ARGS, _lpt_tile
from fused_block.kernels.attention.helpers import (_clamp_ranges, _desc, _desc3, _dropout_keep, _find_seq,
                                                   _key_ranges, _load, _query_ranges, _score_mod, _store, _tile)


@triton.jit
def _attn_bwd_preprocess(O, DO, LSE, DLSE, STATS, CU_Q, SINKS, DSINK,
                         stride_ob, stride_oh, stride_om,
                         stride_dob, stride_doh, stride_dom,
                         Hq, Lq, D, NSEQ, num_m_blocks, stride_stat,
                         HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr,
                         STAT_ALIGN: tl.constexpr, TF32: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    """The backward's per-row statistics ``STATS`` (B * Hq + 1, 2, stride_stat) fp32, rows
    padded to ``stride_stat`` (a multiple of every backward query block, so the backward loads
    them unmasked): [:, 0] = LSE * log2(e) (+inf for rows with no visible key and for padding
    rows: P = 0 there without a select in the backward's loops), [:, 1] = delta =
    rowsum(dO * O) - dLSE (0 for padding rows). The last (batch, head) slab is a spare, never
    written: the dK/dV loops' loads one step ahead read it after the last head.

    ``VARLEN`` (B = 1, Lq = total tokens): each head's rows are the virtual STAT_ALIGN-row
    blocks of :func:`_find_seq`, every sequence padded to a multiple of STAT_ALIGN.

    ``HAS_SINKS``: DSINK[pid] = this program's part of the sink's gradient, -sum_i P_sink,i *
    delta_i with P_sink,i = exp(sink - lse_i) (the sink takes no value: dP = 0 there), summed
    over the programs by the launcher (deterministic, no atomics).

    ``TF32`` (fp32 under TF32 products): delta from dO rounded to TF32, as the backward's dP =
    dO @ V^T reads it. delta stands for sum_j P_ij dP_ij, and dS = P (dP - delta) cancels
    exactly where it should only if both see the same dO: with a single visible key (P = 1,
    dS = 0) raw dO left dS at dO's rounding error, 5x torch's error in dQ (whose softmax
    backward sums P dP from its own dP)."""
    pid = tl.program_id(0)
    bh = pid // num_m_blocks
    b = bh // Hq
    h = bh % Hq
    if VARLEN:
        r0 = (pid % num_m_blocks) * BLOCK_M
        seq, first = _find_seq(CU_Q, NSEQ, r0 // STAT_ALIGN, STAT_ALIGN)
        q0 = tl.load(CU_Q + seq)
        t = r0 - first * STAT_ALIGN + tl.arange(0, BLOCK_M)  # rows of the sequence
        m_ok = t < tl.load(CU_Q + seq + 1) - q0
        offs_m = q0 + t  # tokens
        out_rows = r0 + tl.arange(0, BLOCK_M)
    else:
        offs_m = (pid % num_m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Lq
        out_rows = offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask = m_ok[:, None] & (offs_d < D)[None, :]
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dom
                 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if TF32:
        do = common.to_tf32(do, INTERPRET)
    delta = tl.sum(o * do, 1)
    row_base = bh.to(tl.int64) * Lq
    if HAS_DLSE:
        delta -= tl.load(DLSE + row_base + offs_m, mask=m_ok, other=0.0)
    lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    stats = STATS + bh.to(tl.int64) * (2 * stride_stat)
    tl.store(stats + out_rows, lse2)
    tl.store(stats + stride_stat + out_rows, delta)
    if HAS_SINKS:
        p_sink = tl.where(m_ok, tl.exp(tl.load(SINKS + h).to(tl.float32) - lse), 0.0)
        tl.store(DSINK + pid, -tl.sum(p_sink * delta, 0))


@triton.constexpr_function
def _tf32_scaled_ds(dtype, IEEE):
    """Whether dK = dS^T Q and dQ = dS K take dS * scale as their operand (fp32 under TF32
    products) rather than dS, the sums scaled at the end (IEEE fp32, 16-bit).

    PyTorch's baseline computes s = (Q K^T) * scale; its backward hands the products dS *
    scale, rounded to TF32 as their operand. dS rounded, then scaled, rounds a different value
    (scale = 1 / sqrt(D) is no power of two): as accurate on average, but not the same error.
    A decode step's dK sums only GROUPS * Lq such products per element, so its error is a few
    single roundings, compared with torch's: with different rounding points the ratio swung
    from 0.5 to 2.25 across seeds (``tests/test_attention_decode.py::
    test_decode_matches_reference[pointer-step-gqa-fp32-tf32]``); with torch's, 1.0. Products
    of exact fp32 or 16-bit operands are scaled once at the end (one multiply per dK / dQ
    element, not per dS element)."""
    return dtype == tl.float32 and not IEEE


@triton.jit
def _stats_ahead(stats_h, start_m, stride_stat, BLOCK_M: tl.constexpr, AHEAD: tl.constexpr):
    """``AHEAD``: LSE * log2(e) and delta of rows [start_m, start_m + BLOCK_M) of the head
    whose statistics are at ``stats_h`` (the next step's, loaded a step ahead); else nothing
    to carry (the step loads its own)."""
    if AHEAD:
        stats = stats_h + start_m + tl.arange(0, BLOCK_M)
        return tl.load(stats), tl.load(stats + stride_stat)
    else:
        return 0.0, 0.0


@triton.jit
def _dkdv_step(dk, dv, k, v, q_desc, do_desc, Q_b, DO_b, lse2, delta, stats_desc, stats_h, stride_stat, bh, h,
               start_m, start_n, offs_n, Lq, diag_hi, diag_lo, D, stride_qh, stride_qm, stride_doh, stride_dom,
               scale, qk_scale, seed, dropout_p, inv_keep, Lk, cap_in, cap_out, slopes_b, bias_b, stride_bh, stride_bm,
               stride_bn, amask_b, stride_ah, stride_am, stride_an, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
               EVEN_D: tl.constexpr, PART: tl.constexpr, AHEAD: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr, b=0,
               HOST: tl.constexpr = False):
    """Query block [start_m, start_m + BLOCK_M) of head ``h`` (flat ``bh``, statistics at
    ``stats_h``: the head's rows of STATS): its contribution to a key block's dK and dV (scores
    computed transposed); ``PART`` 1 / 2: only dV / only dK. ``q_desc``/``do_desc`` are
    (H, L, D) descriptors of the batch (TMA), ``Q_b``/``DO_b`` the batch's base pointers.
    ``AHEAD``: the rows' statistics are ``lse2`` and ``delta``, loaded by the caller; else the
    step loads them (``stats_desc``, a TMA tile, or at ``stats_h``).

    Keys past Lk need no mask: their rows of dK/dV are never stored. Queries past Lq (zero
    rows of Q and dO) and rows with no visible key have LSE * log2(e) = +inf, hence P = 0: the
    statistics need neither masks nor selects. Score modifications as the forward's, transposed
    (``slopes_b``, ``bias_b``, ``amask_b``: the batch's rows; bias and mask loads are bounded).
    ``HOST``: ``q_desc``/``do_desc`` are the host's (B, Hq, Lq, D) descriptors (batch ``b``),
    ``stats_desc`` the host's over STATS (B * Hq + 1, 2, stride_stat).
    """
    PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"  # for fp32 operands
    SCORE_MOD: tl.constexpr = SOFTCAP or HAS_ALIBI or HAS_BIAS or HAS_AMASK
    # fp32 under TF32 products: dK's operand is dS * scale, not dS (``_tf32_scaled_ds``).
    TF32: tl.constexpr = _tf32_scaled_ds(k.dtype, IEEE)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if HOST:
        q = _tile(q_desc, b, h, start_m, BLOCK_M, BLOCK_D)
        do = _tile(do_desc, b, h, start_m, BLOCK_M, BLOCK_D)
    elif USE_TMA:
        q = q_desc.load([h, start_m, 0]).reshape([BLOCK_M, BLOCK_D])
        do = do_desc.load([h, start_m, 0]).reshape([BLOCK_M, BLOCK_D])
    else:
        q = _load(q_desc, Q_b + h.to(tl.int64) * stride_qh, start_m, Lq, stride_qm, D, BLOCK_M, BLOCK_D, MASKED,
                  EVEN_D, False)
        do = _load(do_desc, DO_b + h.to(tl.int64) * stride_doh, start_m, Lq, stride_dom, D, BLOCK_M, BLOCK_D,
                   MASKED, EVEN_D, False)
    if not AHEAD:
        if HOST:
            lse2, delta = tl.split(tl.trans(stats_desc.load([bh, 0, start_m]).reshape([2, BLOCK_M])))
        elif USE_TMA:
            # One (2, BLOCK_M) tile: this block's LSE * log2(e) and delta rows.
            lse2, delta = tl.split(tl.trans(stats_desc.load([h, 0, start_m]).reshape([2, BLOCK_M])))
        else:
            # A scalar address + arange: constant offsets, no 64-bit add per element.
            stats = stats_h + start_m + tl.arange(0, BLOCK_M)
            lse2 = tl.load(stats)
    qkT = common.dot(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET, PRECISION)
    if SCORE_MOD:
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(slopes_b + h) * 1.4426950408889634
        sT, tT = _score_mod(qkT, offs_n, offs_m, Lk, Lq, qk_scale, cap_in, cap_out, slope2, Lk - Lq,
                            bias_b + h.to(tl.int64) * stride_bh, stride_bn, stride_bm,
                            amask_b + h.to(tl.int64) * stride_ah, stride_an, stride_am, True, True, True, SOFTCAP,
                            HAS_ALIBI, HAS_BIAS, HAS_AMASK)
        pT = tl.math.exp2(sT - lse2[None, :])
    else:
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
    if MASKED and IS_CAUSAL:
        pT = tl.where(offs_n[:, None] <= offs_m[None, :] + diag_hi, pT, 0.0)
    if MASKED and WINDOW:
        pT = tl.where(offs_n[:, None] >= offs_m[None, :] + diag_lo, pT, 0.0)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, True, IEEE)
    if PART != 2:
        if HAS_DROPOUT:
            pdT = tl.where(keep, pT * inv_keep, 0.0)
        else:
            pdT = pT
        dv = common.dot(common.cast(pdT, do.dtype, INTERPRET), do, dv, INTERPRET, PRECISION)
    if PART != 1:
        dpT = common.dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET, PRECISION)
        if HAS_DROPOUT:
            dpT = tl.where(keep, dpT * inv_keep, 0.0)
        if not AHEAD and not USE_TMA:
            delta = tl.load(stats + stride_stat)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)  # d softcap(x) / dx = 1 - tanh^2
        if TF32:
            dsT = dsT * scale  # the product's operand is dS * scale, rounded as torch's (see TF32 above)
        dk = common.dot(common.cast(dsT, q.dtype, INTERPRET), q, dk, INTERPRET, PRECISION)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, pad_base, start_m, start_n, offs_m,
             diag_hi, diag_lo, Lk, D, stride_kn, stride_vn, scale, qk_scale, seed, bh, dropout_p, inv_keep,
             Lq, cap_in, cap_out, slope2, bias_bh, stride_bm, stride_bn, amask_bh, stride_am, stride_an,
             MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_PAD: tl.constexpr,
             HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
             EVEN_D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
             b=0, hk=0, HOST: tl.constexpr = False):
    """One key block's contribution to a query block's dQ. ``HOST``: ``k_desc``/``v_desc`` are
    the host's (B, Hkv, Lk, D) descriptors (batch ``b``, kv head ``hk``)."""
    PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"  # for fp32 operands
    SCORE_MOD: tl.constexpr = SOFTCAP or HAS_ALIBI or HAS_BIAS or HAS_AMASK
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if HOST:
        k = _tile(k_desc, b, hk, start_n, BLOCK_N, BLOCK_D)
    else:
        k = _load(k_desc, k_base, start_n, Lk, stride_kn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
    qk = common.dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    if SCORE_MOD:
        s, t = _score_mod(qk, offs_m, offs_n, Lq, Lk, qk_scale, cap_in, cap_out, slope2, Lk - Lq, bias_bh,
                          stride_bm, stride_bn, amask_bh, stride_am, stride_an, True, MASKED, False, SOFTCAP,
                          HAS_ALIBI, HAS_BIAS, HAS_AMASK)
        p = tl.math.exp2(s - lse2[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASKED:
        visible = (offs_n < Lk)[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_hi)
        if WINDOW:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_lo)
        p = tl.where(visible, p, 0.0)
    if HAS_PAD:
        pad = tl.load(pad_base + offs_n, mask=offs_n < Lk, other=1)
        p = tl.where((pad == 0)[None, :], p, 0.0)
    if HOST:
        v = _tile(v_desc, b, hk, start_n, BLOCK_N, BLOCK_D)
    else:
        v = _load(v_desc, v_base, start_n, Lk, stride_vn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
    dp = common.dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False, IEEE)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)  # d softcap(x) / dx = 1 - tanh^2
    if _tf32_scaled_ds(q.dtype, IEEE):
        ds = ds * scale  # the product's operand is dS * scale (``_tf32_scaled_ds``)
    dq = common.dot(common.cast(ds, k.dtype, INTERPRET), k, dq, INTERPRET, PRECISION)
    return dq


@triton.jit
def _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk, start_n, q0, k0,
                      stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                      stride_dkb, stride_dkh, stride_dkn, stride_stat,
                      Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                      softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm, stride_bn,
                      stride_ab, stride_ah, stride_am, stride_an, QR, stride_qrb, stride_qrh,
                      IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr,
                      HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
                      EVEN_D: tl.constexpr,
                      PART: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      STAT_ALIGN: tl.constexpr, INTERPRET: tl.constexpr, HOST: tl.constexpr = 0, QD=0, DOD=0,
                      KD=0, VD=0, STD=0, DKD=0, DVD=0):
    """dK, dV of keys [start_n, start_n + BLOCK_N), summed over the group's query heads
    (``PART`` 1: only dV, 2: only dK, 0: both). ``VARLEN``: sequence ``b``, its queries and
    keys from tokens ``q0`` and ``k0``, Lq and Lk its lengths. ``HOST`` (dense batches on the
    TMA path) 1: every tile through the host's descriptors ``QD``..``DVD`` (blocks BLOCK_M x
    BLOCK_D of Q and dO, BLOCK_N x BLOCK_D of K, V, dK and dV, 2 x BLOCK_M of STATS), none
    built here; 2: K, V, dK and dV through them, the loop's Q, dO and STATS through tensor
    maps built here (the loop as without ``HOST``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    cap_in = 0.0
    cap_out = 0.0
    if SOFTCAP:
        cap_in = scale / softcap
        cap_out = softcap * 1.4426950408889634
    slopes_b = SLOPES + b * stride_slb
    bias_b = BIAS + b.to(tl.int64) * stride_bb
    amask_b = AMASK + b.to(tl.int64) * stride_ab
    if HOST:
        k = _tile(KD, b, hk, start_n, BLOCK_N, BLOCK_D)
        v = _tile(VD, b, hk, start_n, BLOCK_N, BLOCK_D)
    else:
        k_desc = _desc(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
        v_desc = _desc(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
        k = _load(k_desc, k_base, start_n, Lk, stride_kn, D, BLOCK_N, BLOCK_D, True, EVEN_D, USE_TMA)
        v = _load(v_desc, v_base, start_n, Lk, stride_vn, D, BLOCK_N, BLOCK_D, True, EVEN_D, USE_TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Query blocks: [m_lo, head_end) straddle the band's right edge (the causal diagonal),
    # [full_end, m_end) its left edge, the partial last block and (pointer path) the blocks
    # past Lq (masked); [head_end, full_end) see every key of the block (unmasked).
    m_lo, head_end, full_end, m_end = _query_ranges(start_n, Lq, diag_hi, diag_lo, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                                    WINDOW, USE_TMA)
    if HAS_AMASK:
        # The query blocks the bool mask leaves any key of this block visible to (the group's heads').
        qr = QR + b.to(tl.int64) * stride_qrb + hk.to(tl.int64) * stride_qrh + (start_n // BLOCK_N) * 2
        m_lo, head_end, full_end, m_end = _clamp_ranges(m_lo, head_end, full_end, m_end, tl.load(qr), tl.load(qr + 1))
    n_head = (head_end - m_lo) // BLOCK_M
    n_full = (full_end - head_end) // BLOCK_M
    if VARLEN:
        Q_b = Q + q0.to(tl.int64) * stride_qm
        DO_b = DO + q0.to(tl.int64) * stride_dom
        STATS_b = STATS + (q0 // STAT_ALIGN + b) * STAT_ALIGN  # the sequence's rows (see _find_seq)
    else:
        Q_b = Q + b.to(tl.int64) * stride_qb
        DO_b = DO + b.to(tl.int64) * stride_dob
        STATS_b = STATS + (b * Hq).to(tl.int64) * (2 * stride_stat)
    if HOST == 1:
        q_desc, do_desc, stats_desc = QD, DOD, STD
    else:
        Lq_desc = tl.maximum(Lq, 1) if VARLEN else Lq  # an empty sequence: no load, a valid descriptor
        q_desc = _desc3(Q_b, Hq, Lq_desc, D, stride_qh, stride_qm, BLOCK_M, BLOCK_D, USE_TMA)
        do_desc = _desc3(DO_b, Hq, Lq_desc, D, stride_doh, stride_dom, BLOCK_M, BLOCK_D, USE_TMA)
        stats_desc = _desc3(STATS_b, Hq, 2, stride_stat, 2 * stride_stat, stride_stat, 2, BLOCK_M, USE_TMA)
    # Each loop walks the (group head, query block) pairs with counters (no division per
    # step): the block advances, and past its segment's end moves on to the next segment or
    # wraps to the next head. One flat loop, not a nest: the pipeline runs across heads.
    # The unmasked loop comes first (ptxas allocates the first loop's registers better).
    #
    # ``AHEAD`` (Hopper's TMA path, 16-bit operands, dK and dV together, query blocks of at
    # most 32 rows): each step's row statistics are loaded one step ahead, into registers. A
    # load that reaches the products only through the loop's carried values is left to ptxas
    # by the pipeliner: two plain global loads, without the shared-memory stage, barrier wait
    # and fence of a TMA tile of their own, their latency hidden behind the step's products
    # (D128, 32x128 blocks: 242 instructions a trip against 262). The loads after a group's
    # last step read the next group's first head or, past the last head, STATS' spare slab.
    # The others load them in the step: the split dV / dK programs and fp32 operands (configs
    # at 255 registers), the pointer path, and 64-row blocks (their carried statistics cost
    # the D64 causal loops 17 instructions a trip).
    AHEAD: tl.constexpr = USE_TMA and PART == 0 and Q.dtype.element_ty != tl.float32 and BLOCK_M <= 32
    h0 = hk * GROUPS
    if VARLEN:
        stats0 = STATS_b + h0.to(tl.int64) * (2 * stride_stat)  # the group's first head
    else:
        stats0 = STATS + (b * Hq + h0).to(tl.int64) * (2 * stride_stat)
    h = h0
    stats_h = stats0
    start_m = head_end
    lse2, delta = _stats_ahead(stats_h, start_m, stride_stat, BLOCK_M, AHEAD)
    for _ in tl.range(0, GROUPS * n_full):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        dk, dv = _dkdv_step(dk, dv, k, v, q_desc, do_desc, Q_b, DO_b, lse2, delta, stats_desc, stats_h, stride_stat,
                            b * Hq + h, h, start_m, start_n, offs_n, Lq, diag_hi, diag_lo, D, stride_qh, stride_qm,
                            stride_doh, stride_dom, scale, qk_scale, seed, dropout_p, inv_keep, Lk, cap_in, cap_out,
                            slopes_b, bias_b, stride_bh, stride_bm, stride_bn, amask_b, stride_ah, stride_am,
                            stride_an, False, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                            HAS_AMASK, USE_TMA, IEEE, EVEN_D, PART, AHEAD, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET,
                            b=b, HOST=HOST == 1)
        start_m += BLOCK_M
        wrap = start_m >= full_end
        start_m = tl.where(wrap, head_end, start_m)
        h += wrap.to(tl.int32)
        stats_h += tl.where(wrap, 2 * stride_stat, 0)
        lse2, delta = _stats_ahead(stats_h, start_m, stride_stat, BLOCK_M, AHEAD)
    if IS_CAUSAL or WINDOW or not USE_TMA:
        # The masked blocks of each head: [m_lo, head_end), then [full_end, m_end).
        n_masked = n_head + (m_end - full_end) // BLOCK_M
        first = tl.where(n_head > 0, m_lo, full_end)
        h = h0
        stats_h = stats0
        start_m = first
        lse2, delta = _stats_ahead(stats_h, start_m, stride_stat, BLOCK_M, AHEAD)
        for _ in tl.range(0, GROUPS * n_masked):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _dkdv_step(dk, dv, k, v, q_desc, do_desc, Q_b, DO_b, lse2, delta, stats_desc, stats_h,
                                stride_stat, b * Hq + h, h, start_m, start_n, offs_n, Lq, diag_hi, diag_lo, D,
                                stride_qh, stride_qm, stride_doh, stride_dom, scale, qk_scale, seed, dropout_p,
                                inv_keep, Lk, cap_in, cap_out, slopes_b, bias_b, stride_bh, stride_bm, stride_bn,
                                amask_b, stride_ah, stride_am, stride_an, True, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP,
                                HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, IEEE, EVEN_D, PART, AHEAD, BLOCK_M, BLOCK_N,
                                BLOCK_D, INTERPRET, b=b, HOST=HOST == 1)
            start_m += BLOCK_M
            start_m = tl.where(start_m == head_end, full_end, start_m)
            wrap = start_m >= m_end
            start_m = tl.where(wrap, first, start_m)
            h += wrap.to(tl.int32)
            stats_h += tl.where(wrap, 2 * stride_stat, 0)
            lse2, delta = _stats_ahead(stats_h, start_m, stride_stat, BLOCK_M, AHEAD)
    if not _tf32_scaled_ds(Q.dtype.element_ty, IEEE):
        dk = dk * scale  # TF32: scaled in dS (``_tf32_scaled_ds``)
    if HAS_PAD:
        # A padded key is invisible to every query: its dK and dV are exactly 0.
        pad = tl.load(pad_base + offs_n, mask=offs_n < Lk, other=1)
        dk = tl.where((pad == 0)[:, None], dk, 0.0)
        dv = tl.where((pad == 0)[:, None], dv, 0.0)
    if VARLEN:
        dk_base = DK + k0.to(tl.int64) * stride_dkn + hk.to(tl.int64) * stride_dkh
        dv_base = DV + k0.to(tl.int64) * stride_dkn + hk.to(tl.int64) * stride_dkh
    else:
        dk_base = DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
        dv_base = DV + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    if HOST:
        if PART != 1:
            DKD.store([b, hk, start_n, 0], common.cast(dk, DK.dtype.element_ty, INTERPRET).reshape(
                [1, 1, BLOCK_N, BLOCK_D]))
        if PART != 2:
            DVD.store([b, hk, start_n, 0], common.cast(dv, DV.dtype.element_ty, INTERPRET).reshape(
                [1, 1, BLOCK_N, BLOCK_D]))
    else:
        if PART != 1:
            dk_desc = _desc(dk_base, Lk, D, stride_dkn, BLOCK_N, BLOCK_D, USE_TMA)
            _store(dk_desc, dk_base, start_n, Lk, stride_dkn, D, common.cast(dk, DK.dtype.element_ty, INTERPRET),
                   BLOCK_N, BLOCK_D, USE_TMA)
        if PART != 2:
            dv_desc = _desc(dv_base, Lk, D, stride_dkn, BLOCK_N, BLOCK_D, USE_TMA)
            _store(dv_desc, dv_base, start_n, Lk, stride_dkn, D, common.cast(dv, DV.dtype.element_ty, INTERPRET),
                   BLOCK_N, BLOCK_D, USE_TMA)


@triton.jit
def _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, pad_base, b, h, start_m, q0,
                    stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                    stride_dqb, stride_dqh, stride_dqm, stride_stat,
                    Hq, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                    softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm, stride_bn,
                    stride_ab, stride_ah, stride_am, stride_an, KR, stride_krb, stride_krh,
                    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr,
                    HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
                    EVEN_D: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAT_ALIGN: tl.constexpr,
                    INTERPRET: tl.constexpr, hk=0, HOST: tl.constexpr = 0, QD=0, DOD=0, KD=0, VD=0, DQD=0):
    """dQ of queries [start_m, start_m + BLOCK_M) of head ``h`` (``VARLEN``: of sequence ``b``,
    from token ``q0``). ``HOST`` (dense batches on the TMA path) 1: every tile through the host's
    descriptors ``QD``..``DQD`` (kv head ``hk``), none built here; 2: Q, dO and dQ through them,
    the loop's K and V through tensor maps built here (the loop as without ``HOST``)."""
    bh = b * Hq + h
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if VARLEN:
        q_base = Q + q0.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
        do_base = DO + q0.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
        dq_base = DQ + q0.to(tl.int64) * stride_dqm + h.to(tl.int64) * stride_dqh
    else:
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        dq_base = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    if HOST:
        q = _tile(QD, b, h, start_m, BLOCK_M, BLOCK_D)
        do = _tile(DOD, b, h, start_m, BLOCK_M, BLOCK_D)
        if HOST == 1:
            k_desc, v_desc = KD, VD
        else:
            k_desc = _desc(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
            v_desc = _desc(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
    else:
        q_desc = _desc(q_base, Lq, D, stride_qm, BLOCK_M, BLOCK_D, USE_TMA)
        do_desc = _desc(do_base, Lq, D, stride_dom, BLOCK_M, BLOCK_D, USE_TMA)
        k_desc = _desc(k_base, tl.maximum(Lk, 1) if VARLEN else Lk, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
        v_desc = _desc(v_base, tl.maximum(Lk, 1) if VARLEN else Lk, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
        q = _load(q_desc, q_base, start_m, Lq, stride_qm, D, BLOCK_M, BLOCK_D, True, EVEN_D, USE_TMA)
        do = _load(do_desc, do_base, start_m, Lq, stride_dom, D, BLOCK_M, BLOCK_D, True, EVEN_D, USE_TMA)
    if VARLEN:
        stats = STATS + h.to(tl.int64) * (2 * stride_stat) + (q0 // STAT_ALIGN + b) * STAT_ALIGN + start_m
    else:
        stats = STATS + bh.to(tl.int64) * (2 * stride_stat) + start_m
    lse2 = tl.load(stats + tl.arange(0, BLOCK_M))
    delta = tl.load(stats + stride_stat + tl.arange(0, BLOCK_M))
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cap_in = 0.0
    cap_out = 0.0
    if SOFTCAP:
        cap_in = scale / softcap
        cap_out = softcap * 1.4426950408889634
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * stride_slb + h) * 1.4426950408889634
    bias_bh = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    amask_bh = AMASK + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah
    lo, full_lo, full_hi, hi = _key_ranges(start_m, Lk, diag_hi, diag_lo, BLOCK_N, BLOCK_M, IS_CAUSAL, WINDOW)
    if HAS_AMASK:
        kr = KR + b.to(tl.int64) * stride_krb + h.to(tl.int64) * stride_krh + (start_m // BLOCK_M) * 2
        lo, full_lo, full_hi, hi = _clamp_ranges(lo, full_lo, full_hi, hi, tl.load(kr), tl.load(kr + 1))
    for start_n in tl.range(full_lo, full_hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, pad_base, start_m, start_n, offs_m,
                      diag_hi, diag_lo, Lk, D, stride_kn, stride_vn, scale, qk_scale, seed, bh, dropout_p, inv_keep,
                      Lq, cap_in, cap_out, slope2, bias_bh, stride_bm, stride_bn, amask_bh, stride_am, stride_an,
                      False, IS_CAUSAL, WINDOW, HAS_PAD, HAS_DROPOUT,
                      SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, IEEE, EVEN_D, BLOCK_M, BLOCK_N,
                      BLOCK_D, INTERPRET, b=b, hk=hk, HOST=HOST == 1)
    for start_n in tl.range(full_hi, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, pad_base, start_m, start_n, offs_m,
                      diag_hi, diag_lo, Lk, D, stride_kn, stride_vn, scale, qk_scale, seed, bh, dropout_p, inv_keep,
                      Lq, cap_in, cap_out, slope2, bias_bh, stride_bm, stride_bn, amask_bh, stride_am, stride_an,
                      True, IS_CAUSAL, WINDOW, HAS_PAD, HAS_DROPOUT,
                      SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, IEEE, EVEN_D, BLOCK_M, BLOCK_N,
                      BLOCK_D, INTERPRET, b=b, hk=hk, HOST=HOST == 1)
    if WINDOW:
        for start_n in tl.range(lo, full_lo, BLOCK_N):
            dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, pad_base, start_m, start_n,
                          offs_m, diag_hi, diag_lo, Lk, D, stride_kn, stride_vn, scale, qk_scale, seed, bh, dropout_p,
                          inv_keep, Lq, cap_in, cap_out, slope2, bias_bh, stride_bm, stride_bn, amask_bh, stride_am,
                          stride_an, True, IS_CAUSAL, WINDOW, HAS_PAD,
                          HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, IEEE, EVEN_D,
                          BLOCK_M,
                          BLOCK_N, BLOCK_D, INTERPRET, b=b, hk=hk, HOST=HOST == 1)
    if not HOST:
        dq_desc = _desc(dq_base, Lq, D, stride_dqm, BLOCK_M, BLOCK_D, USE_TMA)
    if not _tf32_scaled_ds(Q.dtype.element_ty, IEEE):
        dq = dq * scale  # TF32: scaled in dS (``_tf32_scaled_ds``)
    if HOST:
        DQD.store([b, h, start_m, 0], common.cast(dq, DQ.dtype.element_ty, INTERPRET).reshape(
            [1, 1, BLOCK_M, BLOCK_D]))
    else:
        _store(dq_desc, dq_base, start_m, Lq, stride_dqm, D, common.cast(dq, DQ.dtype.element_ty, INTERPRET),
               BLOCK_M, BLOCK_D, USE_TMA)


@triton.jit
def _bwd_varlen_roles(r, hk, b, start, q0, k0, Lq, Lk, n_kv, n_q, kv_programs, seed, inv_keep, qk_scale, Q, K, V, DO,
                   DQ, DK, DV, STATS, MASK, SLOPES, BIAS, AMASK, KR, QR, stride_qb, stride_qh, stride_qm, stride_kb,
                   stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                   stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn, stride_mb, stride_stat,
                   stride_slb, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                   stride_krb, stride_krh, stride_qrb, stride_qrh, Hq, Hkv, GROUPS, D, win_left, win_right, scale,
                   dropout_p, softcap, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                   HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
                   EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                   BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, SPLIT_KV: tl.constexpr, STAT_ALIGN: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Program ``r`` of kv head ``hk`` on packed sequences: sequence ``b``, its queries and keys
    from tokens ``q0`` and ``k0`` (``Lq``, ``Lk`` its lengths), its block from row ``start``
    (the role by ``r``: :func:`_attn_bwd`'s numbering)."""
    k_base = K + k0.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
    v_base = V + k0.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
    diag_hi = Lk - Lq + win_right
    diag_lo = Lk - Lq - win_left
    h = hk * GROUPS + (r - kv_programs) // n_q
    if SPLIT_KV:
        if r < n_kv:
            _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, MASK, b, hk, start, q0, k0,
                              stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                              stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_stat,
                              Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                              softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                              stride_bn, stride_ab, stride_ah, stride_am, stride_an, QR, stride_qrb, stride_qrh,
                              IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                              HAS_AMASK, USE_TMA, IEEE, EVEN_D, 1, BLOCK_D,
                              BLOCK_M1, BLOCK_N1, STAT_ALIGN, INTERPRET)
        elif r < 2 * n_kv:
            _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, MASK, b, hk, start, q0, k0,
                              stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                              stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_stat,
                              Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                              softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                              stride_bn, stride_ab, stride_ah, stride_am, stride_an, QR, stride_qrb, stride_qrh,
                              IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                              HAS_AMASK, USE_TMA, IEEE, EVEN_D, 2, BLOCK_D,
                              BLOCK_M1, BLOCK_N1, STAT_ALIGN, INTERPRET)
        else:
            _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, MASK, b, h, start, q0,
                            stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                            stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_stat,
                            Hq, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                            softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                            stride_bn, stride_ab, stride_ah, stride_am, stride_an, KR, stride_krb, stride_krh,
                            IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                            HAS_AMASK, USE_TMA, IEEE, EVEN_D, BLOCK_D,
                            BLOCK_M2, BLOCK_N2, STAT_ALIGN, INTERPRET)
    elif r < n_kv:
        _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, MASK, b, hk, start, q0, k0,
                          stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                          stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_stat,
                          Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                          softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                          stride_bn, stride_ab, stride_ah, stride_am, stride_an, QR, stride_qrb, stride_qrh,
                          IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                          HAS_AMASK, USE_TMA, IEEE, EVEN_D, 0, BLOCK_D,
                          BLOCK_M1, BLOCK_N1, STAT_ALIGN, INTERPRET)
    else:
        _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, MASK, b, h, start, q0,
                        stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                        stride_dqb, stride_dqh, stride_dqm, stride_stat,
                        Hq, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                        softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                        stride_bn, stride_ab, stride_ah, stride_am, stride_an, KR, stride_krb, stride_krh,
                        IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK,
                        USE_TMA, IEEE, EVEN_D, BLOCK_D,
                        BLOCK_M2, BLOCK_N2, STAT_ALIGN, INTERPRET)


@triton.jit
def _bwd_dense_roles(r, bhk, num_n_blocks, num_m_blocks, Lq, Lk, seed, inv_keep, qk_scale, Q, K, V, DO, DQ, DK, DV,
                  STATS, MASK, SLOPES, BIAS, AMASK, KR, QR, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                  stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_dqb,
                  stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn, stride_mb, stride_stat, stride_slb,
                  stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an, stride_krb,
                  stride_krh, stride_qrb, stride_qrh, Hq, Hkv, GROUPS, D, win_left, win_right, scale, dropout_p,
                  softcap, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr,
                  HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr,
                  BLOCK_N2: tl.constexpr, SPLIT_KV: tl.constexpr, STAT_ALIGN: tl.constexpr, INTERPRET: tl.constexpr,
                  HOST: tl.constexpr = 0, QD1=0, DOD1=0, KD1=0, VD1=0, STD=0, DKD=0, DVD=0, QD2=0, DOD2=0, KD2=0,
                  VD2=0, DQD=0):
    """Program ``r`` of the flat (batch, kv head) ``bhk`` (the role by ``r``: :func:`_attn_bwd`'s
    numbering). ``HOST``: the host's descriptors (:func:`_attn_bwd`)."""
    b = bhk // Hkv
    hk = bhk % Hkv
    # Known non-negative, hk's int64 offsets are zero-extended: no sign word held across the
    # loops for the epilogue (ptxas spilled it, 8 B at D = 256 with dropout, ALiBi, a bias
    # and a mask on sm_90's pointer path).
    tl.assume(hk >= 0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    pad_base = MASK + b.to(tl.int64) * stride_mb
    diag_hi = Lk - Lq + win_right
    diag_lo = Lk - Lq - win_left
    # One call per (SPLIT_KV, role): folding the calls into fewer (a computed key block, a
    # constexpr part) moved several configs sitting at 255 registers into spills.
    if SPLIT_KV:
        # dK and dV accumulators do not fit in registers together: a dV program and a dK
        # program per key block (the dK one recomputes P).
        if r < num_n_blocks:
            _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk, r * BLOCK_N1, 0, 0,
                              stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                              stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_stat,
                              Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                              softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                              stride_bn, stride_ab, stride_ah, stride_am, stride_an, QR, stride_qrb, stride_qrh,
                              IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                              HAS_AMASK, USE_TMA, IEEE, EVEN_D, 1, BLOCK_D,
                              BLOCK_M1, BLOCK_N1, STAT_ALIGN, INTERPRET, HOST, QD1, DOD1, KD1, VD1, STD, DKD, DVD)
        elif r < 2 * num_n_blocks:
            _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk,
                              (r - num_n_blocks) * BLOCK_N1, 0, 0,
                              stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                              stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_stat,
                              Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                              softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                              stride_bn, stride_ab, stride_ah, stride_am, stride_an, QR, stride_qrb, stride_qrh,
                              IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                              HAS_AMASK, USE_TMA, IEEE, EVEN_D, 2, BLOCK_D,
                              BLOCK_M1, BLOCK_N1, STAT_ALIGN, INTERPRET, HOST, QD1, DOD1, KD1, VD1, STD, DKD, DVD)
        else:
            r2 = r - 2 * num_n_blocks
            _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, pad_base, b, hk * GROUPS + r2 // num_m_blocks,
                            (num_m_blocks - 1 - r2 % num_m_blocks) * BLOCK_M2, 0,
                            stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                            stride_dom,
                            stride_dqb, stride_dqh, stride_dqm, stride_stat,
                            Hq, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                            softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                            stride_bn, stride_ab, stride_ah, stride_am, stride_an, KR, stride_krb, stride_krh,
                            IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                            HAS_AMASK, USE_TMA, IEEE, EVEN_D, BLOCK_D,
                            BLOCK_M2, BLOCK_N2, STAT_ALIGN, INTERPRET, hk, HOST, QD2, DOD2, KD2, VD2, DQD)
    elif r < num_n_blocks:
        _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk, r * BLOCK_N1, 0, 0,
                          stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                          stride_dkb, stride_dkh, stride_dkn, stride_stat,
                          Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                          softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                          stride_bn, stride_ab, stride_ah, stride_am, stride_an, QR, stride_qrb, stride_qrh,
                          IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                          HAS_AMASK, USE_TMA, IEEE, EVEN_D, 0, BLOCK_D,
                          BLOCK_M1, BLOCK_N1, STAT_ALIGN, INTERPRET, HOST, QD1, DOD1, KD1, VD1, STD, DKD, DVD)
    else:
        r2 = r - num_n_blocks
        _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, pad_base, b, hk * GROUPS + r2 // num_m_blocks,
                        (num_m_blocks - 1 - r2 % num_m_blocks) * BLOCK_M2, 0,
                        stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                        stride_dqb, stride_dqh, stride_dqm, stride_stat,
                        Hq, Lq, Lk, D, diag_hi, diag_lo, scale, qk_scale, seed, dropout_p, inv_keep,
                        softcap, SLOPES, BIAS, AMASK, stride_slb, stride_bb, stride_bh, stride_bm,
                        stride_bn, stride_ab, stride_ah, stride_am, stride_an, KR, stride_krb, stride_krh,
                        IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK,
                        USE_TMA, IEEE, EVEN_D, BLOCK_D, BLOCK_M2,
                        BLOCK_N2, STAT_ALIGN, INTERPRET, hk, HOST, QD2, DOD2, KD2, VD2, DQD)




@triton.jit(do_not_specialize=_SHAPE_ARGS + ("GH",))
def _attn_bwd(Q, K, V, DO, DQ, DK, DV, STATS, MASK, SEED, CU_Q, CU_K, ORDER, SLOPES, BIAS, AMASK, KR, QR,
              QD1, DOD1, KD1, VD1, STD, DKD, DVD, QD2, DOD2, KD2, VD2, DQD,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_dob, stride_doh, stride_dom,
              stride_dqb, stride_dqh, stride_dqm,
              stride_dkb, stride_dkh, stride_dkn,
              stride_mb, stride_stat, stride_slb,
              stride_bb, stride_bh, stride_bm, stride_bn,
              stride_ab, stride_ah, stride_am, stride_an, stride_krb, stride_krh, stride_qrb, stride_qrh,
              Hq, Hkv, GROUPS, Lq, Lk, D, NSEQ, GH, win_left, win_right,
              scale, dropout_p, softcap,
              IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
              EVEN_D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr,
              BLOCK_N2: tl.constexpr, SPLIT_KV: tl.constexpr, SCHED: tl.constexpr, STAT_ALIGN: tl.constexpr,
              INTERPRET: tl.constexpr, HOST_DESC: tl.constexpr = 0):
    """Per (batch, kv head): programs [0, kv_blocks) compute dK/dV (BLOCK_N1 keys, BLOCK_M1
    queries per step), the next q_blocks * GROUPS programs dQ (BLOCK_M2 queries, BLOCK_N2 keys
    per step), each head's query blocks heaviest first. DK and DV share strides. The band as
    in the forward (``IS_CAUSAL``: keys j <= i + Lk - Lq + win_right; ``WINDOW``: j >= i + Lk
    - Lq - win_left).

    Score modifications as the forward's (bias and mask: dense batches only; the bias's
    gradient is :func:`dbias._attn_dbias`'s).

    ``VARLEN``: per kv head, the virtual key blocks of :func:`_find_seq` (twice with
    ``SPLIT_KV``), then the group's virtual query blocks; unused ones return at once.

    ``SCHED`` = 1: the programs in longest-first order over all kv heads
    (:func:`forward._lpt_tile`: kv heads in groups of ``GH``, a group's programs by rank, its
    heads innermost); ``ORDER`` maps a rank to the program number above (its role and block),
    most work first (the launcher's ``_bwd_order``). 2: the same order persistent, the grid's
    programs taking its tiles in turn (snake order: round k's in reverse when k is odd).

    ``HOST_DESC`` (dense batches on the TMA path; timed candidates, docs/attention-scheduling.md):
    1, every tile through the host's descriptors instead of tensor maps written per program:
    ``QD1``, ``DOD1`` (Q, dO: (B, Hq, Lq, D), blocks of BLOCK_M1 rows), ``KD1``, ``VD1``,
    ``DKD``, ``DVD`` (K, V, dK, dV: (B, Hkv, Lk, D), BLOCK_N1 rows) and ``STD`` (STATS, block
    (1, 2, BLOCK_M1)) for the dK/dV programs, ``QD2``, ``DOD2``, ``DQD`` (BLOCK_M2 rows),
    ``KD2``, ``VD2`` (BLOCK_N2 rows) for the dQ programs; 2, the tiles a program reads or writes
    once through them (K, V, dK, dV; Q, dO, dQ), its loop's through tensor maps as without.
    Otherwise (and for packed sequences) they are unused."""
    HOST: tl.constexpr = HOST_DESC if USE_TMA and not VARLEN else 0
    pid = tl.program_id(0)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    inv_keep = 1.0 / (1.0 - dropout_p)
    qk_scale = scale * 1.4426950408889634
    if VARLEN:
        n_kv = Lk // BLOCK_N1 + NSEQ
        n_q = Lq // BLOCK_M2 + NSEQ
        kv_programs = n_kv * (2 if SPLIT_KV else 1)
        per_head = kv_programs + n_q * GROUPS
        if SCHED == 2:
            nprog = tl.num_programs(0)
            n_tiles = per_head * Hkv
            for rnd in tl.range(0, tl.cdiv(n_tiles, nprog), disable_licm=True):
                t = rnd * nprog + tl.where(rnd % 2 == 0, pid, nprog - 1 - pid)
                if t < n_tiles:
                    hk, rank = _lpt_tile(t, per_head, Hkv, GH)
                    r = tl.load(ORDER + rank)
                    if r < kv_programs:
                        b, first = _find_seq(CU_K, NSEQ, r % n_kv, BLOCK_N1)
                        start = (r % n_kv - first) * BLOCK_N1
                    else:
                        b, first = _find_seq(CU_Q, NSEQ, n_q - 1 - (r - kv_programs) % n_q, BLOCK_M2)
                        start = (n_q - 1 - (r - kv_programs) % n_q - first) * BLOCK_M2
                    q0 = tl.load(CU_Q + b)
                    k0 = tl.load(CU_K + b)
                    seq_q = tl.load(CU_Q + b + 1) - q0
                    seq_k = tl.load(CU_K + b + 1) - k0
                    if start < tl.where(r < kv_programs, seq_k, seq_q):  # else an unused virtual block
                        _bwd_varlen_roles(r, hk, b, start, q0, k0, seq_q, seq_k, n_kv, n_q, kv_programs, seed,
                                          inv_keep, qk_scale, Q, K, V, DO, DQ, DK, DV, STATS, MASK, SLOPES, BIAS,
                                          AMASK, KR, QR, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                                          stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh,
                                          stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh,
                                          stride_dkn, stride_mb, stride_stat, stride_slb, stride_bb, stride_bh,
                                          stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an, stride_krb,
                                          stride_krh, stride_qrb, stride_qrh, Hq, Hkv, GROUPS, D, win_left, win_right,
                                          scale, dropout_p, softcap, IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT,
                                          SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, IEEE, EVEN_D, BLOCK_D,
                                          BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, SPLIT_KV, STAT_ALIGN, INTERPRET)
        else:
            if SCHED == 1:
                hk, rank = _lpt_tile(pid, per_head, Hkv, GH)
                r = tl.load(ORDER + rank)
            else:
                hk = pid // per_head
                r = pid % per_head
            if r < kv_programs:
                b, first = _find_seq(CU_K, NSEQ, r % n_kv, BLOCK_N1)
                start = (r % n_kv - first) * BLOCK_N1
            else:
                b, first = _find_seq(CU_Q, NSEQ, n_q - 1 - (r - kv_programs) % n_q, BLOCK_M2)
                start = (n_q - 1 - (r - kv_programs) % n_q - first) * BLOCK_M2
            q0 = tl.load(CU_Q + b)
            k0 = tl.load(CU_K + b)
            Lq = tl.load(CU_Q + b + 1) - q0
            Lk = tl.load(CU_K + b + 1) - k0
            if start >= tl.where(r < kv_programs, Lk, Lq):
                return  # an unused virtual block
            _bwd_varlen_roles(r, hk, b, start, q0, k0, Lq, Lk, n_kv, n_q, kv_programs, seed, inv_keep, qk_scale, Q, K,
                              V, DO, DQ, DK, DV, STATS, MASK, SLOPES, BIAS, AMASK, KR, QR, stride_qb, stride_qh,
                              stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dob,
                              stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh,
                              stride_dkn, stride_mb, stride_stat, stride_slb, stride_bb, stride_bh, stride_bm,
                              stride_bn, stride_ab, stride_ah, stride_am, stride_an, stride_krb, stride_krh,
                              stride_qrb, stride_qrh, Hq, Hkv, GROUPS, D, win_left, win_right, scale, dropout_p,
                              softcap, IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                              HAS_AMASK, USE_TMA, IEEE, EVEN_D, BLOCK_D, BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2,
                              SPLIT_KV, STAT_ALIGN, INTERPRET)
    else:
        num_n_blocks = tl.cdiv(Lk, BLOCK_N1)
        num_m_blocks = tl.cdiv(Lq, BLOCK_M2)
        per_head = num_n_blocks * (2 if SPLIT_KV else 1) + num_m_blocks * GROUPS
        if SCHED == 2:
            nprog = tl.num_programs(0)
            n_tiles = per_head * NSEQ * Hkv
            for rnd in tl.range(0, tl.cdiv(n_tiles, nprog), disable_licm=True):
                t = rnd * nprog + tl.where(rnd % 2 == 0, pid, nprog - 1 - pid)
                if t < n_tiles:
                    bhk, rank = _lpt_tile(t, per_head, NSEQ * Hkv, GH)
                    _bwd_dense_roles(tl.load(ORDER + rank), bhk, num_n_blocks, num_m_blocks, Lq, Lk, seed, inv_keep,
                                     qk_scale, Q, K, V, DO, DQ, DK, DV, STATS, MASK, SLOPES, BIAS, AMASK, KR, QR,
                                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                                     stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh,
                                     stride_dqm, stride_dkb, stride_dkh, stride_dkn, stride_mb, stride_stat,
                                     stride_slb, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah,
                                     stride_am, stride_an, stride_krb, stride_krh, stride_qrb, stride_qrh, Hq, Hkv,
                                     GROUPS, D, win_left, win_right, scale, dropout_p, softcap, IS_CAUSAL, WINDOW,
                                     VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA,
                                     IEEE, EVEN_D, BLOCK_D, BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, SPLIT_KV,
                                     STAT_ALIGN, INTERPRET, HOST, QD1, DOD1, KD1, VD1, STD, DKD, DVD, QD2, DOD2,
                                     KD2, VD2, DQD)
        else:
            if SCHED == 1:
                bhk, rank = _lpt_tile(pid, per_head, NSEQ * Hkv, GH)
                r = tl.load(ORDER + rank)
            else:
                bhk = pid // per_head
                r = pid % per_head
            _bwd_dense_roles(r, bhk, num_n_blocks, num_m_blocks, Lq, Lk, seed, inv_keep, qk_scale, Q, K, V, DO, DQ, DK,
                             DV, STATS, MASK, SLOPES, BIAS, AMASK, KR, QR, stride_qb, stride_qh, stride_qm, stride_kb,
                             stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                             stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn, stride_mb,
                             stride_stat, stride_slb, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah,
                             stride_am, stride_an, stride_krb, stride_krh, stride_qrb, stride_qrh, Hq, Hkv, GROUPS, D,
                             win_left, win_right, scale, dropout_p, softcap, IS_CAUSAL, WINDOW, VARLEN, HAS_PAD,
                             HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, IEEE, EVEN_D, BLOCK_D,
                             BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, SPLIT_KV, STAT_ALIGN, INTERPRET, HOST, QD1,
                             DOD1, KD1, VD1, STD, DKD, DVD, QD2, DOD2, KD2, VD2, DQD)
