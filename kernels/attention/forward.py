"""The forward kernel: online softmax over the visible key blocks of one query block."""
import triton
import triton.language as tl

from fused_block.kernels import common
from fused_block.kernels.attention.helpers import (_clamp_ranges, _desc, _dropout_keep, _find_seq, _key_ranges, _load,
                                                   _score_mod,
                                                   _store, _tile)


@triton.jit
def _pv_tf32(p, v, acc, INTERPRET: tl.constexpr):
    """``acc + P @ V`` for fp32 under TF32 products: V rounded to TF32, P split into two TF32
    parts (P = hi + lo, lo = P - hi exact in fp32), two products: P to about 2^-22, not 2^-11.

    The backward's delta = rowsum(dO * O) stands for sum_j P_ij dP_ij with dP = dO @ V^T from V
    rounded (``backward._attn_bwd_preprocess``); dS = P (dP - delta) subtracts it, and where dS
    is small against P dP (a decode row's few large-probability keys) any difference between O
    and sum_j P_ij V_j (rounded) lands in dK at P_ij times it. PyTorch's softmax backward sums
    P dP from its own dP (no such term). With P rounded to TF32 here, O carried P's rounding:
    ``tests/test_attention_decode.py::test_decode_matches_reference[pointer-step-gqa-fp32-tf32]``
    measured dK at 2.09x torch's error at FUSED_BLOCK_TEST_SEED=8, 1.00x with P split. P @ V
    without any rounding (IEEE) does not help: dP reads V rounded. One more TF32 product per
    key block, taken by the split-KV decode only (``SPLIT_P``): a decode row's dK sums a
    handful of products, so this one term decides its error; the full forward's dK sums many
    query rows (the term averages out), and its TF32 configs took the second product in
    registers they lack (sm_90 D64 band 128x32: 241 -> 255 registers and an 8 B spill; sm_80
    D128 dropout 128x32: a spill of 80 -> 152 B). 16-bit and IEEE fp32 products are unchanged."""
    v = common.to_tf32(v, INTERPRET)
    hi = common.to_tf32(p, INTERPRET)
    acc = tl.dot(hi, v, acc, input_precision="tf32")
    return tl.dot(common.to_tf32(p - hi, INTERPRET), v, acc, input_precision="tf32")


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, start_m, start_n, offs_m,
              diag_hi, diag_lo, Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p,
              cap_in, cap_out, slope2, bias_base, stride_bm, stride_bn, amask_base, stride_am, stride_an,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_PAD: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, HOST: tl.constexpr, IEEE: tl.constexpr,
              EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              INTERPRET: tl.constexpr, SPLIT_P: tl.constexpr = False, k_row0=0):
    """One key block of the online softmax; ``MASKED`` blocks check bounds and the band
    (query i sees keys i + diag_lo <= j <= i + diag_hi, each bound where its flag is set).
    ``HOST``: ``k_desc``/``v_desc`` are host-side (B, Hkv, Lk, D) descriptors, the block's
    rows from ``k_row0 + start_n`` (packed sequences: the sequence's first token). Score
    modifications (softcap, ALiBi, bias, bool mask: :func:`helpers._score_mod`) where their
    flags are set. ``SPLIT_P`` (the split-KV decode's): under TF32, P @ V by :func:`_pv_tf32`."""
    PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"  # for fp32 operands
    # Softcap alone: the scores stay tanh's values, cap * log2(e) riding in the max and in
    # exp2's FMA below as the scale does without modifications (max(t) * c = max(t * c), c > 0).
    CAP_ONLY: tl.constexpr = SOFTCAP and not (HAS_ALIBI or HAS_BIAS or HAS_AMASK)
    SCALED: tl.constexpr = (SOFTCAP or HAS_ALIBI or HAS_BIAS or HAS_AMASK) and not CAP_ONLY
    if CAP_ONLY:
        s_scale = cap_out
    else:
        s_scale = qk_scale
    if HOST:
        k = _tile(k_desc, b, hk, k_row0 + start_n, BLOCK_N, BLOCK_D)
    else:
        k = _load(k_desc, k_base, start_n, Lk, stride_kn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
    qk = common.dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if CAP_ONLY:
        qk = common.tanh(qk * cap_in)
    if SCALED:
        # Scores in the log2 domain (scale applied).
        qk, _ = _score_mod(qk, offs_m, offs_n, Lq, Lk, qk_scale, cap_in, cap_out, slope2, Lk - Lq, bias_base,
                           stride_bm, stride_bn, amask_base, stride_am, stride_an, True, MASKED, False, SOFTCAP,
                           HAS_ALIBI, HAS_BIAS, HAS_AMASK)
    if MASKED:
        visible = (offs_n < Lk)[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_hi)
        if WINDOW:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_lo)
        qk = tl.where(visible, qk, float("-inf"))
    if HAS_PAD:
        pad = tl.load(pad_base + offs_n, mask=offs_n < Lk, other=1)
        qk = tl.where((pad == 0)[None, :], qk, float("-inf"))
    if SCALED:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    else:
        # scale > 0, so max(qk) * scale = max(qk * scale): the scale rides in exp2's FMA below.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * s_scale)
    if MASKED or HAS_PAD or HAS_BIAS or HAS_AMASK:
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (no NaN).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if SCALED:
        p = tl.math.exp2(qk - m_use[:, None])
    else:
        p = tl.math.exp2(qk * s_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_ij = tl.sum(p, 1)
    if HAS_DROPOUT:
        # Before the rescale of acc: ptxas serializes the wgmma when the Philox rounds sit
        # between the rescale and the product (acc written by non-wgmma code in the stage).
        p = tl.where(_dropout_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False, IEEE), p, 0.0)
    acc = acc * alpha[:, None]
    if HOST:
        v = _tile(v_desc, b, hk, k_row0 + start_n, BLOCK_N, BLOCK_D)
    else:
        v = _load(v_desc, v_base, start_n, Lk, stride_vn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
    if SPLIT_P and not IEEE and v.dtype == tl.float32:
        acc = _pv_tf32(p, v, acc, INTERPRET)
    else:
        acc = common.dot(common.cast(p, v.dtype, INTERPRET), v, acc, INTERPRET, PRECISION)
    # l last: fewer live registers across the products (the tutorial's ordering).
    l_i = l_i * alpha + l_ij
    return acc, l_i, m_new


# Shape arguments are not specialized: Triton would compile a value of 1 (one head, MHA's
# group of 1, decoding's Lq = 1, the padding mask's row stride at Lk = 1) as a constant and a
# multiple of 16 with a divisibility hint, and both moved the register allocation into spills
# (16-divisible Lq/Lk/Hq: sm_90 IEEE fp32 forward 0 -> 16 B, D = 128 dropout forward 8 -> 40 B;
# all of them 1: IEEE fp32 backward 64 B on sm_90, 208 B on sm_80). Unspecialized, each config
# compiles to one body, the one the AOT check builds; they only index and bound loops.
_SHAPE_ARGS = ("Hq", "Hkv", "GROUPS", "Lq", "Lk", "NSEQ", "stride_mb", "win_left", "win_right")


@triton.jit
def _lpt_tile(t, n_blocks, n_heads, GH):
    """Tile ``t`` of the longest-first order as (head, rank): the heads (flat batch * head) in
    groups of ``GH`` (whose K/V the L2 cache holds together), a group's tiles by block rank
    (0: each head's heaviest block), its heads innermost; the last group may be smaller."""
    per_group = n_blocks * GH
    g = t // per_group
    gh = tl.minimum(GH, n_heads - g * GH)
    local = t - g * per_group
    rank = local // gh
    return g * GH + local - rank * gh, rank


@triton.jit
def _fwd_sched(t, CU_Q, ORDER, Hq, Lq, NSEQ, GH, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """The ``SCHED`` > 0 order's tile ``t``: (flat batch * head, first row of the query
    block; ``VARLEN``: head, sequence, first row within it). Dense: the blocks of each head
    last first (the most keys under causality). ``VARLEN``: ``ORDER`` lists the virtual query
    blocks (:func:`_find_seq`) by their key count, most first, the unused ones last (their
    row is past the sequence's end)."""
    if VARLEN:
        n_virtual = Lq // BLOCK_M + NSEQ
        h, rank = _lpt_tile(t, n_virtual, Hq, GH)
        v = tl.load(ORDER + rank)
        b, first = _find_seq(CU_Q, NSEQ, v, BLOCK_M)
        return h, b, (v - first) * BLOCK_M
    else:
        num_m = tl.cdiv(Lq, BLOCK_M)
        bh, rank = _lpt_tile(t, num_m, NSEQ * Hq, GH)
        return bh, bh // Hq, (num_m - 1 - rank) * BLOCK_M


@triton.jit(do_not_specialize=[a for a in _SHAPE_ARGS if a != "Hkv"] + ["GH"])
def _attn_fwd(Q, K, V, O, LSE, MASK, SEED, CU_Q, CU_K, ORDER, SINKS, SLOPES, BIAS, AMASK, KR, QD, KD, VD, OD,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_ob, stride_oh, stride_om,
              stride_mb, stride_slb,
              stride_bb, stride_bh, stride_bm, stride_bn,
              stride_ab, stride_ah, stride_am, stride_an, stride_krb, stride_krh,
              Hq, GROUPS, Lq, Lk, D, NSEQ, GH, win_left, win_right,
              scale, dropout_p, softcap,
              IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_AMASK: tl.constexpr,
              USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
              SCHED: tl.constexpr, VHOST: tl.constexpr, INTERPRET: tl.constexpr):
    """TMA without ``WS``: ``QD``..``OD`` are the host's (B, H, L, D) descriptors of Q, K, V, O.
    ``WS`` (warp-specialized K/V loops, Hopper): per-head descriptors built here (Triton's
    Hopper warp specialization partitions device-side descriptors only).

    The band (bottom-right aligned): query i sees keys j <= i + Lk - Lq + win_right where
    ``IS_CAUSAL`` (causal: win_right = 0) and j >= i + Lk - Lq - win_left where ``WINDOW``.

    ``VARLEN``: NSEQ packed sequences, tokens [CU_Q[b], CU_Q[b + 1]) of the (1, H, Lq, D)
    views (Lq, Lk: total tokens) against keys [CU_K[b], CU_K[b + 1]); the grid runs the
    virtual query blocks of :func:`_find_seq` (per head, in reverse: heaviest first under
    causality in each sequence), device-side descriptors per sequence on the TMA path, or
    with ``VHOST`` the host's descriptors of the packed (1, H, total, D) tensors (rows from
    the sequence's first token; O's last block of a sequence through masked pointers).

    ``SCHED`` (the tile order; 0: per head, its blocks last first): 1, one program per tile in
    the longest-first order of :func:`_fwd_sched` (heads in groups of ``GH``; ``ORDER``: the
    varlen blocks' order, built by the launcher); 2, the same order persistent: the grid's
    programs take its tiles in turn (snake order: round k's tiles in reverse when k is odd).

    Score modifications: ``SOFTCAP`` (s <- softcap * tanh(s / softcap)), ``HAS_ALIBI`` (SLOPES
    (B or 1, Hq) fp32, batch stride ``stride_slb``), ``HAS_BIAS`` (BIAS, 4 strides, zero along
    broadcast dims), ``HAS_AMASK`` (AMASK uint8, 1 = attend, 4 strides; KR: per (batch, head,
    query block) the key range [r0, r1) of the blocks the mask leaves visible, int32 pairs,
    strides ``stride_kr*`` (0 along broadcast dims): key blocks outside it are skipped);
    ``HAS_SINKS``: SINKS (Hq,) logits joining each row's denominator in the epilogue."""
    HOST: tl.constexpr = USE_TMA and not WS and (VHOST or not VARLEN)
    if SCHED == 2:
        nprog = tl.num_programs(0)
        pid = tl.program_id(0)
        if VARLEN:
            n_tiles = (Lq // BLOCK_M + NSEQ) * Hq
        else:
            n_tiles = tl.cdiv(Lq, BLOCK_M) * NSEQ * Hq
        for rnd in tl.range(0, tl.cdiv(n_tiles, nprog), disable_licm=True):
            t = rnd * nprog + tl.where(rnd % 2 == 0, pid, nprog - 1 - pid)
            if t < n_tiles:
                bh, b, start_m = _fwd_sched(t, CU_Q, ORDER, Hq, Lq, NSEQ, GH, VARLEN, BLOCK_M)
                if VARLEN:
                    q0 = tl.load(CU_Q + b)
                    seq_q = tl.load(CU_Q + b + 1) - q0
                    if start_m < seq_q:  # else an unused virtual block
                        k0 = tl.load(CU_K + b)
                        _fwd_tile(Q, K, V, O, LSE, MASK, SEED, SINKS, SLOPES, BIAS, AMASK, KR, QD, KD, VD, OD,
                                  stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                                  stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_slb,
                                  stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am,
                                  stride_an, stride_krb, stride_krh, D, win_left, win_right, scale, dropout_p,
                                  softcap, b, 0, bh, bh // GROUPS, b * Hq + bh, start_m, q0, k0, seq_q,
                                  tl.load(CU_K + b + 1) - k0, LSE + bh.to(tl.int64) * Lq + q0,
                                  IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_SINKS, HAS_ALIBI,
                                  HAS_BIAS, HAS_AMASK, USE_TMA, HOST, IEEE, EVEN_D, BLOCK_D, BLOCK_M, BLOCK_N, WS,
                                  INTERPRET)
                else:
                    h = bh - b * Hq
                    _fwd_tile(Q, K, V, O, LSE, MASK, SEED, SINKS, SLOPES, BIAS, AMASK, KR, QD, KD, VD, OD,
                              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                              stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_slb,
                              stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am,
                              stride_an, stride_krb, stride_krh, D, win_left, win_right, scale, dropout_p,
                              softcap, b, b, h, h // GROUPS, bh, start_m, 0, 0, Lq, Lk, LSE,
                              IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_SINKS, HAS_ALIBI,
                              HAS_BIAS, HAS_AMASK, USE_TMA, HOST, IEEE, EVEN_D, BLOCK_D, BLOCK_M, BLOCK_N, WS,
                              INTERPRET)
    else:
        if SCHED == 1:
            bh, b, start_m = _fwd_sched(tl.program_id(0), CU_Q, ORDER, Hq, Lq, NSEQ, GH, VARLEN, BLOCK_M)
            if VARLEN:
                h = bh
                q0 = tl.load(CU_Q + b)
                seq_q = tl.load(CU_Q + b + 1) - q0
                if start_m >= seq_q:
                    return  # an unused virtual block
                k0 = tl.load(CU_K + b)
                lse_base = LSE + h.to(tl.int64) * Lq + q0
                Lq = seq_q
                Lk = tl.load(CU_K + b + 1) - k0
                bh = b * Hq + h
            else:
                h = bh - b * Hq
            hk = h // GROUPS
        # The query blocks of a head in reverse order: under a causal mask the last ones do the
        # most work. TMA: unsigned divisions (every operand is positive), shorter than signed
        # ones; the pointer build keeps these (with the others ptxas spills 8 B on sm_80 at D64
        # 128x128 with causality and padding).
        elif VARLEN:
            pid = tl.program_id(0)
            n_virtual = Lq // BLOCK_M + NSEQ
            h = pid // n_virtual
            b, first = _find_seq(CU_Q, NSEQ, n_virtual - 1 - pid % n_virtual, BLOCK_M)
            q0 = tl.load(CU_Q + b)
            seq_q = tl.load(CU_Q + b + 1) - q0
            start_m = (n_virtual - 1 - pid % n_virtual - first) * BLOCK_M
            if start_m >= seq_q:
                return  # an unused virtual block
            k0 = tl.load(CU_K + b)
            lse_base = LSE + h.to(tl.int64) * Lq + q0
            Lq = seq_q
            Lk = tl.load(CU_K + b + 1) - k0
            bh = b * Hq + h
            hk = h // GROUPS
        elif USE_TMA:
            pid_u = tl.program_id(0).to(tl.uint32)
            num_m_u = tl.cdiv(Lq, BLOCK_M).to(tl.uint32)
            bh_u = pid_u // num_m_u
            start_m = ((num_m_u - 1 - (pid_u - bh_u * num_m_u)) * BLOCK_M).to(tl.int32)
            b_u = bh_u // Hq.to(tl.uint32)
            h_u = bh_u - b_u * Hq.to(tl.uint32)
            bh, b, h = bh_u.to(tl.int32), b_u.to(tl.int32), h_u.to(tl.int32)
            hk = (h_u // GROUPS.to(tl.uint32)).to(tl.int32)
        else:
            pid = tl.program_id(0)
            num_m_blocks = tl.cdiv(Lq, BLOCK_M)
            bh = pid // num_m_blocks
            start_m = (num_m_blocks - 1 - pid % num_m_blocks) * BLOCK_M
            b = bh // Hq
            h = bh % Hq
            hk = h // GROUPS
        if VARLEN:
            _fwd_tile(Q, K, V, O, LSE, MASK, SEED, SINKS, SLOPES, BIAS, AMASK, KR, QD, KD, VD, OD,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_slb,
                      stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                      stride_krb, stride_krh, D, win_left, win_right, scale, dropout_p, softcap,
                      b, 0, h, hk, bh, start_m, q0, k0, Lq, Lk, lse_base,
                      IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_SINKS, HAS_ALIBI,
                      HAS_BIAS, HAS_AMASK, USE_TMA, HOST, IEEE, EVEN_D, BLOCK_D, BLOCK_M, BLOCK_N, WS, INTERPRET)
        else:
            _fwd_tile(Q, K, V, O, LSE, MASK, SEED, SINKS, SLOPES, BIAS, AMASK, KR, QD, KD, VD, OD,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_slb,
                      stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                      stride_krb, stride_krh, D, win_left, win_right, scale, dropout_p, softcap,
                      b, b, h, hk, bh, start_m, 0, 0, Lq, Lk, LSE,
                      IS_CAUSAL, WINDOW, VARLEN, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_SINKS, HAS_ALIBI,
                      HAS_BIAS, HAS_AMASK, USE_TMA, HOST, IEEE, EVEN_D, BLOCK_D, BLOCK_M, BLOCK_N, WS, INTERPRET)


@triton.jit
def _fwd_tile(Q, K, V, O, LSE, MASK, SEED, SINKS, SLOPES, BIAS, AMASK, KR, QD, KD, VD, OD,
              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_slb,
              stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
              stride_krb, stride_krh, D, win_left, win_right, scale, dropout_p, softcap,
              b, bd, h, hk, bh, start_m, q0, k0, Lq, Lk, lse_base,
              IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr, HOST: tl.constexpr,
              IEEE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, WS: tl.constexpr, INTERPRET: tl.constexpr):
    """One query block: rows [start_m, start_m + BLOCK_M) of head ``h`` (kv head ``hk``, flat
    ``bh`` = b * Hq + h) of batch ``b`` (``VARLEN``: of sequence ``b``, its queries and keys
    from tokens ``q0`` and ``k0``, ``Lq`` and ``Lk`` its lengths, ``lse_base`` its LSE row).
    ``bd``: the batch index of the host descriptors (0 for packed sequences)."""
    pad_base = MASK + b.to(tl.int64) * stride_mb
    if HOST:
        if VARLEN:
            # The packed tensors' host descriptors: rows from the sequence's first token (rows
            # past its end belong to the next sequence: masked out of the scores, not stored).
            q_base = Q + q0.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
            o_base = O + q0.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
            k_base, v_base = K, V  # unused
        else:
            q_base, k_base, v_base, o_base = Q, K, V, O  # unused
        q_desc, k_desc, v_desc, o_desc = QD, KD, VD, OD
        q = _tile(q_desc, bd, h, q0 + start_m, BLOCK_M, BLOCK_D)
        if BLOCK_D <= 128 and BLOCK_N <= 64:
            # An arithmetic op (value-preserving x + 0.0) takes Q out of shared memory into
            # registers, the A operand of an RS wgmma: no per-trip shared-memory descriptors for
            # Q, which frees the uniform registers ptxas otherwise spills in the loop (the host
            # descriptors' addresses live in vector registers). 64 registers/thread at 128 x 128.
            q = q + 0.0
    else:
        if VARLEN:
            q_base = Q + q0.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
            k_base = K + k0.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
            v_base = V + k0.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
            o_base = O + q0.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
            Lk_desc = tl.maximum(Lk, 1)  # an empty key sequence: no load, a valid descriptor
        else:
            q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
            k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
            v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
            o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
            Lk_desc = Lk
        q_desc = _desc(q_base, Lq, D, stride_qm, BLOCK_M, BLOCK_D, USE_TMA)
        k_desc = _desc(k_base, Lk_desc, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
        v_desc = _desc(v_base, Lk_desc, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
        o_desc = _desc(o_base, Lq, D, stride_om, BLOCK_M, BLOCK_D, USE_TMA)
        q = _load(q_desc, q_base, start_m, Lq, stride_qm, D, BLOCK_M, BLOCK_D, True, EVEN_D, USE_TMA)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax with exp2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diag_hi = Lk - Lq + win_right
    diag_lo = Lk - Lq - win_left
    cap_in = 0.0
    cap_out = 0.0
    if SOFTCAP:
        cap_in = scale / softcap
        cap_out = softcap * 1.4426950408889634
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * stride_slb + h) * 1.4426950408889634
    bias_base = BIAS
    if HAS_BIAS:
        bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    amask_base = AMASK
    if HAS_AMASK:
        amask_base = AMASK + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah
    lo, full_lo, full_hi, hi = _key_ranges(start_m, Lk, diag_hi, diag_lo, BLOCK_N, BLOCK_M, IS_CAUSAL, WINDOW)
    if HAS_AMASK:
        kr = KR + b.to(tl.int64) * stride_krb + h.to(tl.int64) * stride_krh + (start_m // BLOCK_M) * 2
        lo, full_lo, full_hi, hi = _clamp_ranges(lo, full_lo, full_hi, hi, tl.load(kr), tl.load(kr + 1))
    if WS:
        # Triton 3.6's Hopper warp specialization (a TMA producer, Q's rows split between two
        # consumer warpgroups) partitions a kernel with one K/V loop only (a second loop after
        # it fails to compile, one before it gets no partitions): every block in one loop,
        # masked under causality; without it the launcher guarantees Lk % BLOCK_N == 0 (and
        # runs no window on it).
        for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, bd, hk, start_m,
                                      start_n, offs_m, diag_hi, diag_lo, Lq, Lk, D, stride_kn, stride_vn, qk_scale,
                                      seed,
                                      bh, dropout_p, cap_in, cap_out, slope2, bias_base, stride_bm, stride_bn,
                                      amask_base, stride_am, stride_an, IS_CAUSAL, IS_CAUSAL, False, HAS_PAD,
                                      HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, HOST,
                                      IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET, k_row0=k0)
    else:
        # Unmasked blocks first, then the masked ones after them and (with a window) before
        # them: the online softmax takes key blocks in any order.
        for start_n in tl.range(full_lo, full_hi, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, bd, hk, start_m,
                                      start_n, offs_m, diag_hi, diag_lo, Lq, Lk, D, stride_kn, stride_vn, qk_scale,
                                      seed,
                                      bh, dropout_p, cap_in, cap_out, slope2, bias_base, stride_bm, stride_bn,
                                      amask_base, stride_am, stride_an, False, IS_CAUSAL, WINDOW, HAS_PAD,
                                      HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, HOST,
                                      IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET, k_row0=k0)
        for start_n in tl.range(full_hi, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, bd, hk, start_m,
                                      start_n, offs_m, diag_hi, diag_lo, Lq, Lk, D, stride_kn, stride_vn, qk_scale,
                                      seed,
                                      bh, dropout_p, cap_in, cap_out, slope2, bias_base, stride_bm, stride_bn,
                                      amask_base, stride_am, stride_an, True, IS_CAUSAL, WINDOW, HAS_PAD,
                                      HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK, USE_TMA, HOST,
                                      IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET, k_row0=k0)
        if WINDOW:
            for start_n in tl.range(lo, full_lo, BLOCK_N):
                acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, bd, hk,
                                          start_m, start_n, offs_m, diag_hi, diag_lo, Lq, Lk, D, stride_kn,
                                          stride_vn, qk_scale, seed, bh, dropout_p, cap_in, cap_out, slope2,
                                          bias_base, stride_bm, stride_bn, amask_base, stride_am, stride_an, True,
                                          IS_CAUSAL, WINDOW, HAS_PAD, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_BIAS,
                                          HAS_AMASK, USE_TMA, HOST, IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D,
                                          INTERPRET, k_row0=k0)

    if HAS_SINKS:
        # The sink's logit joins the denominator (no value): one more online-softmax step.
        sink2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink2)
        m_use = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.math.exp2(m_i - m_use)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.math.exp2(sink2 - m_use)
        m_i = m_fin
    empty = l_i == 0.0  # no visible key: output 0, LSE -inf
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = common.cast(acc * inv_l[:, None], q.dtype, INTERPRET)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if HOST and not VARLEN:
        o_desc.store([b, h, start_m, 0], out.reshape([1, 1, BLOCK_M, BLOCK_D]))
    elif HOST:
        if start_m + BLOCK_M <= Lq:
            o_desc.store([0, h, q0 + start_m, 0], out.reshape([1, 1, BLOCK_M, BLOCK_D]))
        else:  # the sequence's last block: its rows past the end are the next sequence's
            _store(o_desc, o_base, start_m, Lq, stride_om, D, out, BLOCK_M, BLOCK_D, False)
    else:
        _store(o_desc, o_base, start_m, Lq, stride_om, D, out, BLOCK_M, BLOCK_D, USE_TMA)
    if VARLEN:
        tl.store(lse_base + offs_m, lse, mask=offs_m < Lq)
    else:
        tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=offs_m < Lq)

