"""The bias's gradient: dS = P * (dP - delta) summed over the bias's broadcast dimensions, by a
kernel of its own whose programs each own one tile of the gradient and walk, in a fixed order,
every (batch, head, query block, key block) tile of dS that sums into it."""
import triton
import triton.language as tl

from fused_block.kernels import common
from fused_block.kernels.attention.helpers import _dropout_keep, _score_mod, _tile


@triton.jit
def _dbias_tile(acc, Q, K, V, DO, QD, KD, VD, DOD, STATS, MASK, SEED, SLOPES, BIAS, AMASK, b, h, start_m, start_n,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom, stride_mb, stride_stat, stride_slb,
                stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, qk_scale, cap_in, cap_out, dropout_p, inv_keep,
                IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_AMASK: tl.constexpr, USE_TMA: tl.constexpr,
                IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                INTERPRET: tl.constexpr):
    """``acc`` + the dS tile of queries [start_m, start_m + BLOCK_M) x keys [start_n, start_n +
    BLOCK_N) of head ``h`` of batch ``b``: P recomputed from the scores (with every score
    modification, as the backward's) and the row statistics, dP = dO V^T (dropout's keep mask
    applied), dS = P * (dP - delta); 0 outside the band, past Lq and Lk, and at padded keys.
    ``USE_TMA``: Q, K, V, dO tiles through the host-side (B, H, L, D) descriptors ``*D``."""
    PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"  # for fp32 operands
    bh = b * Hq + h
    hk = h // GROUPS
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    n_ok = offs_n < Lk
    d_ok = offs_d < D
    if USE_TMA:
        q = _tile(QD, b, h, start_m, BLOCK_M, BLOCK_D)
        do = _tile(DOD, b, h, start_m, BLOCK_M, BLOCK_D)
        k = _tile(KD, b, hk, start_n, BLOCK_N, BLOCK_D)
        v = _tile(VD, b, hk, start_n, BLOCK_N, BLOCK_D)
    else:
        rows = offs_m[:, None].to(tl.int64)
        keys = offs_n[:, None].to(tl.int64)
        q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows * stride_qm
                    + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dom
                     + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        k = tl.load(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + keys * stride_kn
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + keys * stride_vn
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    stats = STATS + bh.to(tl.int64) * (2 * stride_stat) + offs_m
    lse2 = tl.load(stats, mask=m_ok, other=float("inf"))  # +inf: P = 0 (rows past Lq, rows with no key)
    delta = tl.load(stats + stride_stat, mask=m_ok, other=0.0)
    qk = common.dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * stride_slb + h) * 1.4426950408889634
    s, _ = _score_mod(qk, offs_m, offs_n, Lq, Lk, qk_scale, cap_in, cap_out, slope2, Lk - Lq,
                      BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh, stride_bm, stride_bn,
                      AMASK + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah, stride_am, stride_an,
                      True, True, False, SOFTCAP, HAS_ALIBI, True, HAS_AMASK)
    visible = n_ok[None, :]
    if IS_CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_hi)
    if WINDOW:
        visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_lo)
    if HAS_PAD:
        pad = tl.load(MASK + b.to(tl.int64) * stride_mb + offs_n, mask=n_ok, other=1)
        visible = visible & (pad == 0)[None, :]
    p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
    dp = common.dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    if HAS_DROPOUT:
        keep = _dropout_keep(tl.load(SEED), bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False, IEEE)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    return acc + p * (dp - delta[:, None])


@triton.jit(do_not_specialize=("Hq", "GROUPS", "Lq", "Lk", "stride_mb", "win_left", "win_right", "n_b", "n_h",
                               "n_m", "n_n", "out_h", "out_m", "out_n"))
def _attn_dbias(Q, K, V, DO, QD, KD, VD, DOD, STATS, MASK, SEED, SLOPES, BIAS, AMASK, KR, DBIAS,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom, stride_mb, stride_stat, stride_slb,
                stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                stride_dbb, stride_dbh, stride_dbm, stride_krb, stride_krh,
                Hq, GROUPS, Lq, Lk, D, win_left, win_right, scale, dropout_p, softcap,
                n_b, n_h, n_m, n_n, out_h, out_m, out_n,
                IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_AMASK: tl.constexpr, SUM_M: tl.constexpr,
                SUM_N: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """DBIAS (the bias's shape with leading 1s to 4 dims, contiguous, the bias's dtype; strides
    ``stride_db*``, unit column stride) = dS summed over the bias's broadcast dims.

    Program ``pid`` owns one tile of DBIAS over the grid (batches, out_h, out_m, out_n): a batch
    (or all of them, where the bias broadcasts over the batch: ``n_b`` = B), a head (or all:
    ``n_h`` = Hq), a BLOCK_M x BLOCK_N block (``SUM_M``: every query block, the bias
    broadcasting over queries, ``n_m`` of them; ``SUM_N``: every key block, ``n_n``). It walks
    those n_b x n_h x n_m x n_n dS tiles in a fixed order, summing them in registers (no
    atomics, no partial buffers: deterministic), skips the tiles outside the band (their dS is
    0) and those the bool mask hides whole (``KR``: the forward's key-block ranges at these
    blocks), and stores the tile once (its column, row or total sum with ``SUM_M``/``SUM_N``).
    Statistics as the backward's (``STATS``: LSE * log2(e), delta). ``USE_TMA``: ``QD``, ``KD``,
    ``VD``, ``DOD`` are host-side descriptors (blocks (1, 1, BLOCK_M or BLOCK_N, BLOCK_D)); the
    pointer path reads Q, K, V, DO."""
    pid = tl.program_id(0)
    tn = pid % out_n
    tm = (pid // out_n) % out_m
    th = (pid // (out_n * out_m)) % out_h
    tb = pid // (out_n * out_m * out_h)
    qk_scale = scale * 1.4426950408889634
    cap_in = 0.0
    cap_out = 0.0
    if SOFTCAP:
        cap_in = scale / softcap
        cap_out = softcap * 1.4426950408889634
    inv_keep = 1.0 / (1.0 - dropout_p)
    diag_hi = Lk - Lq + win_right
    diag_lo = Lk - Lq - win_left
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Walked dims: the tile's own index (0 where walked) plus the walk's counters (0 where not),
    # advanced as an odometer (key block fastest): no division per step.
    wn = 0
    wm = 0
    wh = 0
    wb = 0
    for _ in range(0, n_b * n_h * n_m * n_n):
        start_n = (tn + wn) * BLOCK_N
        start_m = (tm + wm) * BLOCK_M
        h = th + wh
        b = tb + wb
        wn += 1
        carry = wn == n_n
        wn = tl.where(carry, 0, wn)
        wm += carry.to(tl.int32)
        carry = wm == n_m
        wm = tl.where(carry, 0, wm)
        wh += carry.to(tl.int32)
        carry = wh == n_h
        wh = tl.where(carry, 0, wh)
        wb += carry.to(tl.int32)
        inside = True
        if IS_CAUSAL:
            inside = start_n <= start_m + BLOCK_M - 1 + diag_hi
        if WINDOW:
            inside = inside & (start_n + BLOCK_N - 1 >= start_m + diag_lo)
        if HAS_AMASK:
            kr = KR + b.to(tl.int64) * stride_krb + h.to(tl.int64) * stride_krh + (start_m // BLOCK_M) * 2
            inside = inside & (start_n >= tl.load(kr)) & (start_n < tl.load(kr + 1))
        if inside:
            acc = _dbias_tile(acc, Q, K, V, DO, QD, KD, VD, DOD, STATS, MASK, SEED, SLOPES, BIAS, AMASK, b, h,
                              start_m, start_n, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_mb,
                              stride_stat, stride_slb, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab,
                              stride_ah, stride_am, stride_an, Hq, GROUPS, Lq, Lk, D, diag_hi, diag_lo, qk_scale,
                              cap_in, cap_out, dropout_p, inv_keep, IS_CAUSAL, WINDOW, HAS_PAD, HAS_DROPOUT,
                              SOFTCAP, HAS_ALIBI, HAS_AMASK, USE_TMA, IEEE, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)
    base = DBIAS + tb.to(tl.int64) * stride_dbb + th.to(tl.int64) * stride_dbh
    offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    ty = DBIAS.dtype.element_ty
    if SUM_M and SUM_N:
        tl.store(base, common.cast(tl.sum(tl.sum(acc, 1), 0), ty, INTERPRET))
    elif SUM_M:
        tl.store(base + offs_n, common.cast(tl.sum(acc, 0), ty, INTERPRET), mask=offs_n < Lk)
    elif SUM_N:
        tl.store(base + offs_m.to(tl.int64) * stride_dbm, common.cast(tl.sum(acc, 1), ty, INTERPRET),
                 mask=offs_m < Lq)
    else:
        ptrs = base + offs_m[:, None].to(tl.int64) * stride_dbm + offs_n[None, :]
        tl.store(ptrs, common.cast(acc, ty, INTERPRET), mask=(offs_m < Lq)[:, None] & (offs_n < Lk)[None, :])
