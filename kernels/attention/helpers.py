"""Device helpers shared by the attention kernels: tile loads and stores on both data paths
(TMA descriptors, masked pointers), the dropout keep-mask, the visible key range of a block of
queries, and the kernel that materializes the keep mask for tests."""
import triton
import triton.language as tl

from fused_block.kernels import common


@triton.jit
def _load(desc, base, row0, L, stride, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
          CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [row0, row0 + BLOCK) x columns [0, BLOCK_D) of an (L, D) matrix, zero outside.

    TMA: ``desc`` (bounds by its shape). Pointers: ``base`` with row stride ``stride``; rows
    are checked only when ``CHECK_ROWS``, columns unless ``EVEN_D`` (D == BLOCK_D).
    """
    if USE_TMA:
        return desc.load([row0, 0])
    else:
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK_D)
        ptrs = base + tl.cast(row0, tl.int64) * stride + rows[:, None].to(tl.int64) * stride + cols[None, :]
        if CHECK_ROWS:
            if EVEN_D:
                return tl.load(ptrs, mask=(row0 + rows < L)[:, None], other=0.0)
            else:
                return tl.load(ptrs, mask=(row0 + rows < L)[:, None] & (cols < D)[None, :], other=0.0)
        elif EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(cols < D)[None, :], other=0.0)


@triton.jit
def _store(desc, base, row0, L, stride, D, x, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
           USE_TMA: tl.constexpr):
    """Store ``x`` (BLOCK, BLOCK_D) at rows [row0, row0 + BLOCK) of an (L, D) matrix, in bounds."""
    if USE_TMA:
        desc.store([row0, 0], x)
    else:
        rows = row0 + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK_D)
        ptrs = base + rows[:, None].to(tl.int64) * stride + cols[None, :]
        tl.store(ptrs, x, mask=(rows < L)[:, None] & (cols < D)[None, :])


@triton.jit
def _desc(base, L, D, stride, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """A (BLOCK, BLOCK_D) tensor descriptor over the (L, D) matrix at ``base``; the pointer path
    gets ``base`` back (unused: a jit function cannot return None)."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, [L, D], [stride, 1], [BLOCK, BLOCK_D])
    else:
        return base


@triton.jit
def _desc3(base, H, L, D, stride_h, stride, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """A (1, BLOCK, BLOCK_D) descriptor over the (H, L, D) heads of one batch at ``base`` (or
    ``base`` on the pointer path). The backward's statistics use it with (L, D) = (2, rows)."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, [H, L, D], [stride_h, stride, 1], [1, BLOCK, BLOCK_D])
    else:
        return base


@triton.jit
def _tile(desc, b, h, row0, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [row0, row0 + BLOCK) of head ``h`` of batch ``b`` through a host-side
    (B, H, L, D) descriptor with block (1, 1, BLOCK, BLOCK_D): zero outside the tensor."""
    return desc.load([b, h, row0, 0]).reshape([BLOCK, BLOCK_D])


@triton.jit
def _interleave8(a, b, AXIS: tl.constexpr):
    """Tiles ``a`` and ``b`` of equal shape merged along ``AXIS`` (0 or 1) in blocks of 8: the
    result's index 16 * i + j along it is ``a``'s 8 * i + j for j < 8, ``b``'s 8 * i + j - 8
    for j >= 8 (the split of an MMA tile's rows or columns between r and r + 8)."""
    R: tl.constexpr = a.shape[0]
    C: tl.constexpr = a.shape[1]
    if AXIS == 0:
        ab = tl.join(a.reshape([R // 8, 8, C]), b.reshape([R // 8, 8, C]))
        return tl.permute(ab, (0, 3, 1, 2)).reshape([2 * R, C])
    else:
        ab = tl.join(a.reshape([R, C // 8, 8]), b.reshape([R, C // 8, 8]))
        return tl.permute(ab, (0, 1, 3, 2)).reshape([R, 2 * C])


@triton.jit
def _dropout_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TRANSPOSED: tl.constexpr, PER_ELEMENT: tl.constexpr):
    """Bool tile: True where the probability of (query start_m + i, key start_n + j) is kept,
    (BLOCK_M, BLOCK_N), or (BLOCK_N, BLOCK_M) indexed [j, i] when ``TRANSPOSED``; ``bh`` =
    batch * Hq + head, ``start_m`` and ``start_n`` multiples of 16.

    One Philox call covers the 4 (query, key) pairs {q, q + 8} x {k, k + 8} (q and k with
    index mod 16 below 8; counters (key group, query group, bh, 0)): a group every thread of
    a Hopper or Ampere MMA accumulator holds whole, in either orientation (rows r and r + 8,
    columns c + 8j), so the mask needs no layout conversion. An element is kept where its
    32-bit draw is >= p * 2^32 (an integer compare). ``PER_ELEMENT`` (the FMA-unit IEEE fp32
    kernels, whose layouts have no such groups): one call per element, picking its draw.
    """
    thresh = tl.cast(dropout_p * 4294967296.0, tl.uint32)
    if PER_ELEMENT:
        q = start_m + tl.arange(0, BLOCK_M)
        k = start_n + tl.arange(0, BLOCK_N)
        gq, uq = ((q // 16) * 8 + q % 8).to(tl.uint32), (q % 16) >= 8  # group, upper half
        gk, uk = ((k // 16) * 8 + k % 8).to(tl.uint32), (k % 16) >= 8
        if TRANSPOSED:
            zeros = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.uint32)
            c0, c1, uq, uk = gk[:, None] + zeros, gq[None, :] + zeros, uq[None, :], uk[:, None]
        else:
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.uint32)
            c0, c1, uq, uk = gk[None, :] + zeros, gq[:, None] + zeros, uq[:, None], uk[None, :]
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, zeros + bh.to(tl.uint32), zeros)
        return tl.where(uq, tl.where(uk, r3, r2), tl.where(uk, r1, r0)) >= thresh
    gm = start_m // 2 + tl.arange(0, BLOCK_M // 2)  # query groups: (q // 16) * 8 + q % 8
    gn = start_n // 2 + tl.arange(0, BLOCK_N // 2)
    if TRANSPOSED:
        c0 = (gn[:, None] + tl.zeros([BLOCK_N // 2, BLOCK_M // 2], dtype=tl.int32)).to(tl.uint32)
        c1 = (gm[None, :] + tl.zeros([BLOCK_N // 2, BLOCK_M // 2], dtype=tl.int32)).to(tl.uint32)
    else:
        c0 = (gn[None, :] + tl.zeros([BLOCK_M // 2, BLOCK_N // 2], dtype=tl.int32)).to(tl.uint32)
        c1 = (gm[:, None] + tl.zeros([BLOCK_M // 2, BLOCK_N // 2], dtype=tl.int32)).to(tl.uint32)
    zero = c0 * 0
    # r0: (q, k), r1: (q, k + 8), r2: (q + 8, k), r3: (q + 8, k + 8)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + bh.to(tl.uint32), zero)
    k0, k1, k2, k3 = r0 >= thresh, r1 >= thresh, r2 >= thresh, r3 >= thresh
    if TRANSPOSED:
        return _interleave8(_interleave8(k0, k2, 1), _interleave8(k1, k3, 1), 0)
    else:
        return _interleave8(_interleave8(k0, k1, 1), _interleave8(k2, k3, 1), 0)


@triton.jit
def _score_mod(qk, offs_r, offs_c, Lr, Lc, qk_scale, cap_in, cap_out, slope2, diag0, bias_base, stride_br,
               stride_bc, amask_base, stride_ar, stride_ac, CHECK_R: tl.constexpr, CHECK_C: tl.constexpr,
               TRANSPOSED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_AMASK: tl.constexpr):
    """The modified scores of a tile in the log2 domain, and tanh's value (``SOFTCAP``; else
    ``qk``) for the backward's derivative: s = softcap(qk * scale) + ALiBi + bias, times log2(e),
    -inf where the bool mask is False.

    Rows ``offs_r`` (of Lr) and columns ``offs_c`` (of Lc) are queries and keys, keys and
    queries when ``TRANSPOSED``; ``CHECK_R``/``CHECK_C`` bound the bias and mask loads (rows past
    their end read 0 / False). ``cap_in`` = scale / softcap, ``cap_out`` = softcap * log2(e);
    ``slope2`` = the head's ALiBi slope * log2(e); query i and key j are |i + diag0 - j| apart
    (diag0 = Lk - Lq, bottom-right). Bias and mask pointers: ``*_base`` at the (batch, head),
    row and column strides (0 along broadcast dims)."""
    if SOFTCAP:
        t = common.tanh(qk * cap_in)
        s = t * cap_out
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        if TRANSPOSED:
            dist = tl.abs(offs_c[None, :] + diag0 - offs_r[:, None])
        else:
            dist = tl.abs(offs_r[:, None] + diag0 - offs_c[None, :])
        s = s - slope2 * dist.to(tl.float32)
    if HAS_BIAS or HAS_AMASK:
        if CHECK_R and CHECK_C:
            inb = (offs_r < Lr)[:, None] & (offs_c < Lc)[None, :]
        elif CHECK_R:
            inb = (offs_r < Lr)[:, None]
        else:
            inb = (offs_c < Lc)[None, :]
        r64 = offs_r[:, None].to(tl.int64)
        c64 = offs_c[None, :].to(tl.int64)
        if HAS_BIAS:
            ptrs = bias_base + r64 * stride_br + c64 * stride_bc
            if CHECK_R or CHECK_C:
                b = tl.load(ptrs, mask=inb, other=0.0)
            else:
                b = tl.load(ptrs)
            s = s + b.to(tl.float32) * 1.4426950408889634
        if HAS_AMASK:
            ptrs = amask_base + r64 * stride_ar + c64 * stride_ac
            if CHECK_R or CHECK_C:
                keep = tl.load(ptrs, mask=inb, other=0)
            else:
                keep = tl.load(ptrs)
            s = tl.where(keep != 0, s, float("-inf"))
    return s, t


@triton.jit
def _find_seq(CU, NSEQ, v, BLOCK: tl.constexpr):
    """Varlen: the sequence of virtual block ``v`` and the number of its first block.

    Sequence b (tokens [CU[b], CU[b + 1])) numbers its BLOCK-row blocks from CU[b] // BLOCK +
    b on: disjoint ranges over [0, total // BLOCK + NSEQ) with at most one unused number per
    sequence, so a grid over that range runs every real block once (no padding compute) and
    finds its sequence by a binary search over CU, with nothing prepared on the host. Returns
    the largest b with CU[b] // BLOCK + b <= v and that first number."""
    lo = 0
    hi = NSEQ
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(CU + mid) // BLOCK + mid <= v
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo, tl.load(CU + lo) // BLOCK + lo


@triton.jit
def _key_ranges(start, Lk, diag_hi, diag_lo, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr,
                IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """For the rows [start, start + BLOCK_OTHER) of the score matrix (queries), the key range
    in BLOCK steps, ``(lo, full_lo, full_hi, hi)``: [full_lo, full_hi) is visible to every row
    and in bounds (no masks), [lo, full_lo) and [full_hi, hi) need masks, keys outside [lo, hi)
    are invisible to every row. Query i sees key j when j <= i + diag_hi (``IS_CAUSAL``: a
    right bound, causal or a window's right side) and j >= i + diag_lo (``WINDOW``: a left
    bound); without them, every key below Lk."""
    full_hi = (Lk // BLOCK) * BLOCK
    hi = Lk
    if IS_CAUSAL:
        full_hi = tl.minimum(full_hi, (tl.maximum(start + diag_hi + 1, 0) // BLOCK) * BLOCK)
        hi = tl.minimum(Lk, tl.maximum(start + BLOCK_OTHER + diag_hi, 0))
    lo = 0
    full_lo = 0
    if WINDOW:
        # The first row has the lowest bound, the last row the highest.
        lo = (tl.maximum(start + diag_lo, 0) // BLOCK) * BLOCK
        full_lo = tl.cdiv(tl.maximum(start + BLOCK_OTHER - 1 + diag_lo, 0), BLOCK) * BLOCK
        full_lo = tl.minimum(full_lo, tl.cdiv(hi, BLOCK) * BLOCK)
        full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(start_n, Lq, diag_hi, diag_lo, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, USE_TMA: tl.constexpr):
    """For the keys [start_n, start_n + BLOCK_N), the query blocks, ``(m_lo, head_end,
    full_end, m_end)``: [head_end, full_end) see every key of the block (unmasked), [m_lo,
    head_end) and [full_end, m_end) need masks, queries outside [m_lo, m_end) see none of
    these keys (visibility as in :func:`_key_ranges`). The partial last query block needs no
    mask on the TMA path (zero rows, LSE = +inf: P = 0), so it may be unmasked there; the
    pointer path masks its rows (it is in a masked range)."""
    m_ceil = tl.cdiv(Lq, BLOCK_M) * BLOCK_M
    m_lo = 0
    head_end = 0
    if IS_CAUSAL:
        m_lo = (tl.maximum(start_n - diag_hi, 0) // BLOCK_M) * BLOCK_M
        head_end = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag_hi, 0), BLOCK_M) * BLOCK_M
        head_end = tl.minimum(tl.maximum(head_end, m_lo), m_ceil)
    if USE_TMA:
        full_end = m_ceil
    else:
        full_end = tl.maximum(head_end, (Lq // BLOCK_M) * BLOCK_M)
    m_end = m_ceil
    if WINDOW:
        # Query i sees some key of the block while i <= start_n + BLOCK_N - 1 - diag_lo, all
        # of them while i <= start_n - diag_lo.
        last = start_n + BLOCK_N - 1 - diag_lo
        m_end = tl.where(last >= 0, (tl.maximum(last, 0) // BLOCK_M + 1) * BLOCK_M, 0)
        m_end = tl.maximum(tl.minimum(m_end, m_ceil), m_lo)
        head_end = tl.minimum(head_end, m_end)
        full_end = tl.minimum(full_end, (tl.maximum(start_n - diag_lo + 1, 0) // BLOCK_M) * BLOCK_M)
        full_end = tl.minimum(tl.maximum(full_end, head_end), m_end)
    return m_lo, head_end, full_end, m_end


@triton.jit
def _clamp_ranges(lo, first_mid, end_mid, hi, r0, r1):
    """A block range split (``lo``, ``first_mid``, ``end_mid``, ``hi``: the outputs of
    :func:`_key_ranges` or :func:`_query_ranges`) narrowed to [r0, r1): the blocks a bool mask
    leaves any visible element in (``launchers._mask_ranges``; r0 = r1 when none). The masked
    and unmasked parts keep their order; every part is empty outside [r0, r1)."""
    lo = tl.maximum(lo, r0)
    hi = tl.maximum(tl.minimum(hi, r1), lo)
    first_mid = tl.minimum(tl.maximum(first_mid, lo), hi)
    end_mid = tl.minimum(tl.maximum(end_mid, first_mid), hi)
    return lo, first_mid, end_mid, hi


@triton.jit
def _dropout_mask_kernel(SEED, OUT, Hq, Lq, Lk, num_m_blocks, num_n_blocks, dropout_p,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Materializes the keep mask (B, Hq, Lq, Lk) as uint8 with the kernels' formula (tests)."""
    pid = tl.program_id(0)
    per_head = num_m_blocks * num_n_blocks
    bh = pid // per_head
    start_m = ((pid % per_head) // num_n_blocks) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    start_n = (pid % num_n_blocks) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(tl.load(SEED), bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False, False)
    ptrs = OUT + bh.to(tl.int64) * Lq * Lk + offs_m[:, None].to(tl.int64) * Lk + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))

