"""The forward kernel: online softmax over the visible key blocks of one query block."""
import triton
import triton.language as tl

from fused_block.kernels import common
from fused_block.kernels.attention.helpers import _causal_ranges, _desc, _dropout_keep, _load, _store, _tile


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, start_m, start_n, offs_m,
              Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              USE_TMA: tl.constexpr, HOST: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block of the online softmax; ``MASKED`` blocks check bounds and causality.
    ``HOST``: ``k_desc``/``v_desc`` are host-side (B, Hkv, Lk, D) descriptors."""
    PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"  # for fp32 operands
    if HOST:
        k = _tile(k_desc, b, hk, start_n, BLOCK_N, BLOCK_D)
    else:
        k = _load(k_desc, k_base, start_n, Lk, stride_kn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
    qk = common.dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        visible = (offs_n < Lk)[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Lk - Lq))
        qk = tl.where(visible, qk, float("-inf"))
    if HAS_PAD:
        pad = tl.load(pad_base + offs_n, mask=offs_n < Lk, other=1)
        qk = tl.where((pad == 0)[None, :], qk, float("-inf"))
    # scale > 0, so max(qk) * scale = max(qk * scale): the scale rides in exp2's FMA below.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED or HAS_PAD:
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (no NaN).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_ij = tl.sum(p, 1)
    if HAS_DROPOUT:
        # Before the rescale of acc: ptxas serializes the wgmma when the Philox rounds sit
        # between the rescale and the product (acc written by non-wgmma code in the stage).
        p = tl.where(_dropout_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False, IEEE), p, 0.0)
    acc = acc * alpha[:, None]
    if HOST:
        v = _tile(v_desc, b, hk, start_n, BLOCK_N, BLOCK_D)
    else:
        v = _load(v_desc, v_base, start_n, Lk, stride_vn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
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
_SHAPE_ARGS = ("Hq", "Hkv", "GROUPS", "Lq", "Lk", "stride_mb")


@triton.jit(do_not_specialize=[a for a in _SHAPE_ARGS if a != "Hkv"])
def _attn_fwd(Q, K, V, O, LSE, MASK, SEED, QD, KD, VD, OD,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_ob, stride_oh, stride_om,
              stride_mb,
              Hq, GROUPS, Lq, Lk, D,
              scale, dropout_p,
              IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
              INTERPRET: tl.constexpr):
    """TMA without ``WS``: ``QD``..``OD`` are the host's (B, H, L, D) descriptors of Q, K, V, O.
    ``WS`` (warp-specialized K/V loops, Hopper): per-head descriptors built here (Triton's
    Hopper warp specialization partitions device-side descriptors only)."""
    HOST: tl.constexpr = USE_TMA if not WS else False
    # The query blocks of a head in reverse order: under a causal mask the last ones do the
    # most work. TMA: unsigned divisions (every operand is positive), shorter than signed
    # ones; the pointer build keeps these (with the others ptxas spills 8 B on sm_80 at D64
    # 128x128 with causality and padding).
    if USE_TMA:
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
    pad_base = MASK + b.to(tl.int64) * stride_mb
    if HOST:
        q_base, k_base, v_base, o_base = Q, K, V, O  # unused
        q_desc, k_desc, v_desc, o_desc = QD, KD, VD, OD
        q = _tile(q_desc, b, h, start_m, BLOCK_M, BLOCK_D)
        if BLOCK_D <= 128 and BLOCK_N <= 64:
            # An arithmetic op (value-preserving x + 0.0) takes Q out of shared memory into
            # registers, the A operand of an RS wgmma: no per-trip shared-memory descriptors for
            # Q, which frees the uniform registers ptxas otherwise spills in the loop (the host
            # descriptors' addresses live in vector registers). 64 registers/thread at 128 x 128.
            q = q + 0.0
    else:
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
        o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        q_desc = _desc(q_base, Lq, D, stride_qm, BLOCK_M, BLOCK_D, USE_TMA)
        k_desc = _desc(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
        v_desc = _desc(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
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

    full_end, hi = _causal_ranges(start_m, Lq, Lk, BLOCK_N, BLOCK_M, IS_CAUSAL)
    if WS:
        # Triton 3.6's Hopper warp specialization (a TMA producer, Q's rows split between two
        # consumer warpgroups) partitions a kernel with one K/V loop only (a second loop after
        # it fails to compile, one before it gets no partitions): every block in one loop,
        # masked under causality; without it the launcher guarantees Lk % BLOCK_N == 0.
        for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, start_m,
                                      start_n, offs_m, Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p,
                                      IS_CAUSAL, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, HOST, IEEE, EVEN_D,
                                      BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)
    else:
        for start_n in tl.range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, start_m,
                                      start_n, offs_m, Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p,
                                      False, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, HOST, IEEE, EVEN_D,
                                      BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)
        for start_n in tl.range(full_end, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, pad_base, b, hk, start_m,
                                      start_n, offs_m, Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p,
                                      True, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, HOST, IEEE, EVEN_D,
                                      BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)

    empty = l_i == 0.0  # no visible key: output 0, LSE -inf
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = common.cast(acc * inv_l[:, None], q.dtype, INTERPRET)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if HOST:
        o_desc.store([b, h, start_m, 0], out.reshape([1, 1, BLOCK_M, BLOCK_D]))
    else:
        _store(o_desc, o_base, start_m, Lq, stride_om, D, out, BLOCK_M, BLOCK_D, USE_TMA)
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=offs_m < Lq)

