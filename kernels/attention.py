"""FlashAttention-style fused softmax attention: forward, backward, and the dropout keep-mask.

Every tensor is a strided (B, H, L, D) view with a contiguous last dim: SDPA's layout, views of
a packed QKV projection (B, L, (H + 2 Hkv) * D) or (L, B, ...), and outputs written straight
into such layouts all look alike to the kernels (three strides per tensor). GQA/MQA: query head
h reads K/V head h // (Hq // Hkv). Causal alignment is bottom-right: query i sees keys
j <= i + Lk - Lq. ``MASK`` is the (B, Lk) key padding mask as uint8 (1 = padding). A query row
with no visible key outputs 0 and has LSE = -inf; its gradients are 0.

Two data paths, one kernel body each (constexpr ``USE_TMA``):

- **TMA** (Hopper, and the interpreter): tensor descriptors, so ragged L and D < BLOCK_D are
  zero-padded by the hardware and strided views need no copy. The forward takes host-side
  descriptors over the whole (B, H, L, D) tensors (``TensorDescriptor``, built per launch:
  no descriptor work in the kernel); its warp-specialized candidates and the backward build
  device-side ones (``tl.make_tensor_descriptor``) over their (batch, head)'s (L, D)
  matrices (the dK/dV programs: over the batch's (H, L, D) queries and statistics, to walk
  the group's heads in one loop), with ``triton.set_allocator`` for the scratch (per thread,
  so forward and backward both set it). Needs 16-byte aligned bases and strides (true for
  every head dim multiple of 8 in a dense or packed buffer). Hopper's IEEE fp32 products
  (FMA units, operands from registers) take the pointer path.
- **pointers** (Ampere, and unaligned layouts anywhere): masked ``tl.load``; loads inside the
  unmasked part of a loop carry only the head-dim mask, and none when D is a power of two.

Kernels:

- ``_attn_fwd``: one program per (query block, batch * head), query blocks of a head in
  reverse order (under a causal mask the last blocks do the most work: heaviest first).
  Online softmax in fp32 with ``exp2`` and the scale folded into one FMA. Key blocks every
  row of the query block sees, in bounds, run without masks; only the blocks straddling the
  causal diagonal or the end of the keys pay for masking, and blocks above the diagonal are
  never visited. K/V loops are software pipelined (``tl.range``, the config's stages).
  Saves only O and the fp32 natural-log LSE (B, Hq, Lq).
- ``_attn_bwd_preprocess``: the backward's row statistics, (B * Hq, 2, Lq rounded up to
  ``STAT_ALIGN``) fp32: LSE * log2(e) (+inf where P must be 0: rows with no visible key,
  padding rows) and delta = rowsum(dO * O) - dLSE (0 on padding rows). The dLSE term makes
  the LSE output differentiable: d lse_i / d s_ij = P_ij. Padded and pre-scaled, they load
  unmasked, vectorized (TMA on Hopper) and without selects in the backward's loops.
- ``_attn_bwd``: one kernel for dK/dV and dQ (flex_attention's split): per (batch, kv head),
  programs [0, kv_blocks) accumulate dK/dV of one key block over the group's query heads
  and query blocks, in one flat loop per mask kind over (head, block) pairs walked with
  counters, no division per step (GQA reduced in registers: deterministic, no atomics);
  programs [kv_blocks, kv_blocks + q_blocks * group) compute dQ of one query block.
  Causally invisible blocks are skipped and only the diagonal ones masked, in both halves
  (on the TMA path the partial last query block needs no mask: its rows read as zero).
  Where dK's and dV's fp32 accumulators cannot share the registers (``SPLIT_KV`` configs:
  D = 256, some fp32 and dropout classes), each key block gets a dV program and a dK
  program (which recomputes P).
- ``_dropout_keep``: keep = uniform(seed, (j, i, batch * Hq + h)) >= p: Philox counters are the
  key index, query index and flattened head, so every kernel (and ``dropout_keep_mask``, a test
  helper) regenerates the same mask without storing it.

All grids are 1-D (axis 0 allows 2^31 - 1 programs), the block index fastest so that
consecutive programs share one head's K/V in L2. Offsets of heads and rows are int64.

fp32 inputs follow torch's matmul precision at call time (``common.fp32_precision()``): IEEE
fp32 products by default, TF32 when torch allows TF32 for matmuls (torch has no attention
switch of its own). The mode is a constexpr of the kernels and part of the config key.
"""
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_block.kernels import common

# Tests set this to "pointer" to run the pointer path where TMA would be taken (the interpreter
# runs the TMA path by default wherever the layout allows it, as Hopper does).
FORCE_PATH = None


# ---------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------

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
def _causal_ranges(start, Lq, Lk, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For the rows [start, start + BLOCK_OTHER) of the score matrix (queries), the key range
    in BLOCK steps: ``(full_end, hi)``: [0, full_end) is visible to every row and in bounds
    (no masks), [full_end, hi) needs masks, keys from hi on are invisible to every row."""
    full_end = (Lk // BLOCK) * BLOCK
    hi = Lk
    if IS_CAUSAL:
        full_end = tl.minimum(full_end, (tl.maximum(start + Lk - Lq + 1, 0) // BLOCK) * BLOCK)
        hi = tl.minimum(Lk, tl.maximum(start + BLOCK_OTHER + Lk - Lq, 0))
    return full_end, hi


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_preprocess(O, DO, LSE, DLSE, STATS,
                         stride_ob, stride_oh, stride_om,
                         stride_dob, stride_doh, stride_dom,
                         Hq, Lq, D, num_m_blocks, stride_stat,
                         HAS_DLSE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The backward's per-row statistics ``STATS`` (B * Hq, 2, stride_stat) fp32, rows padded
    to ``stride_stat`` (a multiple of every backward query block, so the backward loads them
    unmasked): [:, 0] = LSE * log2(e) (+inf for rows with no visible key and for padding
    rows: P = 0 there without a select in the backward's loops), [:, 1] = delta =
    rowsum(dO * O) - dLSE (0 for padding rows)."""
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
    lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    stats = STATS + bh.to(tl.int64) * (2 * stride_stat)
    tl.store(stats + offs_m, lse2)
    tl.store(stats + stride_stat + offs_m, delta)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_desc, do_desc, Q_b, DO_b, stats_desc, stats_h, stride_stat, bh, h, start_m, start_n,
               offs_n, Lq, Lk, D, stride_qh, stride_qm, stride_doh, stride_dom, qk_scale, seed, dropout_p, inv_keep,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
               IEEE: tl.constexpr, EVEN_D: tl.constexpr, PART: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """Query block [start_m, start_m + BLOCK_M) of head ``h`` (flat ``bh``, statistics at
    ``stats_h``: the head's rows of STATS): its contribution to a key block's dK and dV (scores
    computed transposed); ``PART`` 1 / 2: only dV / only dK. ``q_desc``/``do_desc`` are
    (H, L, D) descriptors of the batch (TMA), ``Q_b``/``DO_b`` the batch's base pointers.

    Keys past Lk need no mask: their rows of dK/dV are never stored. Queries past Lq (zero
    rows of Q and dO) and rows with no visible key have LSE * log2(e) = +inf, hence P = 0: the
    statistics need neither masks nor selects.
    """
    PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"  # for fp32 operands
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if USE_TMA:
        q = q_desc.load([h, start_m, 0]).reshape([BLOCK_M, BLOCK_D])
        do = do_desc.load([h, start_m, 0]).reshape([BLOCK_M, BLOCK_D])
    else:
        q = _load(q_desc, Q_b + h.to(tl.int64) * stride_qh, start_m, Lq, stride_qm, D, BLOCK_M, BLOCK_D, MASKED,
                  EVEN_D, False)
        do = _load(do_desc, DO_b + h.to(tl.int64) * stride_doh, start_m, Lq, stride_dom, D, BLOCK_M, BLOCK_D,
                   MASKED, EVEN_D, False)
    if USE_TMA:
        # One (2, BLOCK_M) tile: this block's LSE * log2(e) and delta rows.
        lse2, delta = tl.split(tl.trans(stats_desc.load([h, 0, start_m]).reshape([2, BLOCK_M])))
    else:
        # A scalar address + arange: constant offsets, no 64-bit add per element.
        stats = stats_h + start_m + tl.arange(0, BLOCK_M)
        lse2 = tl.load(stats)
    qkT = common.dot(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET, PRECISION)
    pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
    if MASKED and IS_CAUSAL:
        pT = tl.where(offs_n[:, None] <= offs_m[None, :] + (Lk - Lq), pT, 0.0)
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
        if not USE_TMA:
            delta = tl.load(stats + stride_stat)
        dsT = pT * (dpT - delta[None, :])
        dk = common.dot(common.cast(dsT, q.dtype, INTERPRET), q, dk, INTERPRET, PRECISION)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, pad_base, start_m, start_n, offs_m,
             Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p, inv_keep,
             MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block's contribution to a query block's dQ."""
    PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"  # for fp32 operands
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(k_desc, k_base, start_n, Lk, stride_kn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
    qk = common.dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASKED:
        visible = (offs_n < Lk)[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Lk - Lq))
        p = tl.where(visible, p, 0.0)
    if HAS_PAD:
        pad = tl.load(pad_base + offs_n, mask=offs_n < Lk, other=1)
        p = tl.where((pad == 0)[None, :], p, 0.0)
    v = _load(v_desc, v_base, start_n, Lk, stride_vn, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
    dp = common.dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, PRECISION)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False, IEEE)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    dq = common.dot(common.cast(ds, k.dtype, INTERPRET), k, dq, INTERPRET, PRECISION)
    return dq


@triton.jit
def _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk, start_n,
                      stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                      stride_dkb, stride_dkh, stride_dkn, stride_stat,
                      Hq, GROUPS, Lq, Lk, D, scale, qk_scale, seed, dropout_p, inv_keep,
                      IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                      USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, PART: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """dK, dV of keys [start_n, start_n + BLOCK_N), summed over the group's query heads
    (``PART`` 1: only dV, 2: only dK, 0: both)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_desc = _desc(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
    v_desc = _desc(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
    k = _load(k_desc, k_base, start_n, Lk, stride_kn, D, BLOCK_N, BLOCK_D, True, EVEN_D, USE_TMA)
    v = _load(v_desc, v_base, start_n, Lk, stride_vn, D, BLOCK_N, BLOCK_D, True, EVEN_D, USE_TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Query blocks: [m_lo, head_end) straddle the causal diagonal (masked), [head_end,
    # full_end) see every key of the block (unmasked); queries before m_lo see none of these
    # keys. The partial last block [mid_end, m_ceil) needs no mask on the TMA path (zero rows,
    # LSE = +inf: P = 0), so full_end = m_ceil there; the pointer path masks its rows
    # (full_end = mid_end, the block joins the masked loop).
    m_ceil = tl.cdiv(Lq, BLOCK_M) * BLOCK_M
    m_lo = 0
    head_end = 0
    if IS_CAUSAL:
        m_lo = (tl.maximum(start_n - (Lk - Lq), 0) // BLOCK_M) * BLOCK_M
        head_end = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - (Lk - Lq), 0), BLOCK_M) * BLOCK_M
        head_end = tl.minimum(tl.maximum(head_end, m_lo), m_ceil)
    if USE_TMA:
        full_end = m_ceil
    else:
        full_end = tl.maximum(head_end, (Lq // BLOCK_M) * BLOCK_M)
    n_head = (head_end - m_lo) // BLOCK_M
    n_full = (full_end - head_end) // BLOCK_M
    Q_b = Q + b.to(tl.int64) * stride_qb
    DO_b = DO + b.to(tl.int64) * stride_dob
    q_desc = _desc3(Q_b, Hq, Lq, D, stride_qh, stride_qm, BLOCK_M, BLOCK_D, USE_TMA)
    do_desc = _desc3(DO_b, Hq, Lq, D, stride_doh, stride_dom, BLOCK_M, BLOCK_D, USE_TMA)
    stats_desc = _desc3(STATS + (b * Hq).to(tl.int64) * (2 * stride_stat), Hq, 2, stride_stat, 2 * stride_stat,
                        stride_stat, 2, BLOCK_M, USE_TMA)
    # Each loop walks the (group head, query block) pairs with counters (no division per
    # step): the block advances, and past its segment's end moves on to the next segment or
    # wraps to the next head. One flat loop, not a nest: the pipeline runs across heads.
    # The unmasked loop comes first (ptxas allocates the first loop's registers better).
    h0 = hk * GROUPS
    stats0 = STATS + (b * Hq + h0).to(tl.int64) * (2 * stride_stat)  # the group's first head
    h = h0
    stats_h = stats0
    start_m = head_end
    for _ in tl.range(0, GROUPS * n_full):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        dk, dv = _dkdv_step(dk, dv, k, v, q_desc, do_desc, Q_b, DO_b, stats_desc, stats_h, stride_stat, b * Hq + h,
                            h, start_m, start_n, offs_n, Lq, Lk, D, stride_qh, stride_qm, stride_doh, stride_dom,
                            qk_scale, seed, dropout_p, inv_keep, False, IS_CAUSAL, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D,
                            PART, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)
        start_m += BLOCK_M
        wrap = start_m >= full_end
        start_m = tl.where(wrap, head_end, start_m)
        h += wrap.to(tl.int32)
        stats_h += tl.where(wrap, 2 * stride_stat, 0)
    if IS_CAUSAL or not USE_TMA:
        # The masked blocks of each head: [m_lo, head_end), then [full_end, m_ceil).
        n_masked = n_head + (m_ceil - full_end) // BLOCK_M
        first = tl.where(n_head > 0, m_lo, full_end)
        h = h0
        stats_h = stats0
        start_m = first
        for _ in tl.range(0, GROUPS * n_masked):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _dkdv_step(dk, dv, k, v, q_desc, do_desc, Q_b, DO_b, stats_desc, stats_h, stride_stat,
                                b * Hq + h, h, start_m, start_n, offs_n, Lq, Lk, D, stride_qh, stride_qm, stride_doh,
                                stride_dom, qk_scale, seed, dropout_p, inv_keep, True, IS_CAUSAL, HAS_DROPOUT,
                                USE_TMA, IEEE, EVEN_D, PART, BLOCK_M, BLOCK_N, BLOCK_D, INTERPRET)
            start_m += BLOCK_M
            start_m = tl.where(start_m == head_end, full_end, start_m)
            wrap = start_m >= m_ceil
            start_m = tl.where(wrap, first, start_m)
            h += wrap.to(tl.int32)
            stats_h += tl.where(wrap, 2 * stride_stat, 0)
    dk = dk * scale
    if HAS_PAD:
        # A padded key is invisible to every query: its dK and dV are exactly 0.
        pad = tl.load(pad_base + offs_n, mask=offs_n < Lk, other=1)
        dk = tl.where((pad == 0)[:, None], dk, 0.0)
        dv = tl.where((pad == 0)[:, None], dv, 0.0)
    dk_base = DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    dv_base = DV + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    if PART != 1:
        dk_desc = _desc(dk_base, Lk, D, stride_dkn, BLOCK_N, BLOCK_D, USE_TMA)
        _store(dk_desc, dk_base, start_n, Lk, stride_dkn, D, common.cast(dk, DK.dtype.element_ty, INTERPRET),
               BLOCK_N, BLOCK_D, USE_TMA)
    if PART != 2:
        dv_desc = _desc(dv_base, Lk, D, stride_dkn, BLOCK_N, BLOCK_D, USE_TMA)
        _store(dv_desc, dv_base, start_n, Lk, stride_dkn, D, common.cast(dv, DV.dtype.element_ty, INTERPRET),
               BLOCK_N, BLOCK_D, USE_TMA)


@triton.jit
def _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, pad_base, b, h, start_m,
                    stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                    stride_dqb, stride_dqh, stride_dqm, stride_stat,
                    Hq, Lq, Lk, D, scale, qk_scale, seed, dropout_p, inv_keep,
                    IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """dQ of queries [start_m, start_m + BLOCK_M) of head ``h``."""
    bh = b * Hq + h
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    dq_base = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    q_desc = _desc(q_base, Lq, D, stride_qm, BLOCK_M, BLOCK_D, USE_TMA)
    do_desc = _desc(do_base, Lq, D, stride_dom, BLOCK_M, BLOCK_D, USE_TMA)
    k_desc = _desc(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, USE_TMA)
    v_desc = _desc(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, USE_TMA)
    q = _load(q_desc, q_base, start_m, Lq, stride_qm, D, BLOCK_M, BLOCK_D, True, EVEN_D, USE_TMA)
    do = _load(do_desc, do_base, start_m, Lq, stride_dom, D, BLOCK_M, BLOCK_D, True, EVEN_D, USE_TMA)
    stats = STATS + bh.to(tl.int64) * (2 * stride_stat) + start_m
    lse2 = tl.load(stats + tl.arange(0, BLOCK_M))
    delta = tl.load(stats + stride_stat + tl.arange(0, BLOCK_M))
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end, hi = _causal_ranges(start_m, Lq, Lk, BLOCK_N, BLOCK_M, IS_CAUSAL)
    for start_n in tl.range(0, full_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, pad_base, start_m, start_n, offs_m,
                      Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p, inv_keep,
                      False, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D,
                      INTERPRET)
    for start_n in tl.range(full_end, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, pad_base, start_m, start_n, offs_m,
                      Lq, Lk, D, stride_kn, stride_vn, qk_scale, seed, bh, dropout_p, inv_keep,
                      True, IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D,
                      INTERPRET)
    dq_desc = _desc(dq_base, Lq, D, stride_dqm, BLOCK_M, BLOCK_D, USE_TMA)
    _store(dq_desc, dq_base, start_m, Lq, stride_dqm, D, common.cast(dq * scale, DQ.dtype.element_ty, INTERPRET),
           BLOCK_M, BLOCK_D, USE_TMA)


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _attn_bwd(Q, K, V, DO, DQ, DK, DV, STATS, MASK, SEED,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_dob, stride_doh, stride_dom,
              stride_dqb, stride_dqh, stride_dqm,
              stride_dkb, stride_dkh, stride_dkn,
              stride_mb, stride_stat,
              Hq, Hkv, GROUPS, Lq, Lk, D,
              scale, dropout_p,
              IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              USE_TMA: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
              SPLIT_KV: tl.constexpr, INTERPRET: tl.constexpr):
    """Per (batch, kv head): programs [0, kv_blocks) compute dK/dV (BLOCK_N1 keys, BLOCK_M1
    queries per step), the next q_blocks * GROUPS programs dQ (BLOCK_M2 queries, BLOCK_N2 keys
    per step), each head's query blocks heaviest first. DK and DV share strides."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(Lk, BLOCK_N1)
    num_m_blocks = tl.cdiv(Lq, BLOCK_M2)
    per_head = num_n_blocks * (2 if SPLIT_KV else 1) + num_m_blocks * GROUPS
    bhk = pid // per_head
    r = pid % per_head
    b = bhk // Hkv
    hk = bhk % Hkv
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    pad_base = MASK + b.to(tl.int64) * stride_mb
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    inv_keep = 1.0 / (1.0 - dropout_p)
    qk_scale = scale * 1.4426950408889634
    # One call per (SPLIT_KV, role): folding the calls into fewer (a computed key block, a
    # constexpr part) moved several configs sitting at 255 registers into spills.
    if SPLIT_KV:
        # dK and dV accumulators do not fit in registers together: a dV program and a dK
        # program per key block (the dK one recomputes P).
        if r < num_n_blocks:
            _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk, r * BLOCK_N1,
                              stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                              stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_stat,
                              Hq, GROUPS, Lq, Lk, D, scale, qk_scale, seed, dropout_p, inv_keep,
                              IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D, 1, BLOCK_D, BLOCK_M1, BLOCK_N1,
                              INTERPRET)
        elif r < 2 * num_n_blocks:
            _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk,
                              (r - num_n_blocks) * BLOCK_N1,
                              stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh,
                              stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_stat,
                              Hq, GROUPS, Lq, Lk, D, scale, qk_scale, seed, dropout_p, inv_keep,
                              IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D, 2, BLOCK_D, BLOCK_M1, BLOCK_N1,
                              INTERPRET)
        else:
            r2 = r - 2 * num_n_blocks
            _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, pad_base, b, hk * GROUPS + r2 // num_m_blocks,
                            (num_m_blocks - 1 - r2 % num_m_blocks) * BLOCK_M2,
                            stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                            stride_dqb, stride_dqh, stride_dqm, stride_stat,
                            Hq, Lq, Lk, D, scale, qk_scale, seed, dropout_p, inv_keep,
                            IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D, BLOCK_D, BLOCK_M2, BLOCK_N2,
                            INTERPRET)
    elif r < num_n_blocks:
        _bwd_dkdv_program(Q, K, V, DO, DK, DV, STATS, MASK, k_base, v_base, pad_base, b, hk, r * BLOCK_N1,
                          stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                          stride_dkb, stride_dkh, stride_dkn, stride_stat,
                          Hq, GROUPS, Lq, Lk, D, scale, qk_scale, seed, dropout_p, inv_keep,
                          IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D, 0, BLOCK_D, BLOCK_M1, BLOCK_N1,
                          INTERPRET)
    else:
        r2 = r - num_n_blocks
        _bwd_dq_program(Q, DO, DQ, STATS, k_base, v_base, pad_base, b, hk * GROUPS + r2 // num_m_blocks,
                        (num_m_blocks - 1 - r2 % num_m_blocks) * BLOCK_M2,
                        stride_qb, stride_qh, stride_qm, stride_kn, stride_vn, stride_dob, stride_doh, stride_dom,
                        stride_dqb, stride_dqh, stride_dqm, stride_stat,
                        Hq, Lq, Lk, D, scale, qk_scale, seed, dropout_p, inv_keep,
                        IS_CAUSAL, HAS_PAD, HAS_DROPOUT, USE_TMA, IEEE, EVEN_D, BLOCK_D, BLOCK_M2, BLOCK_N2,
                        INTERPRET)


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


# ---------------------------------------------------------------------------------------------
# configs, per architecture: candidates by (head-dim class, operand kind, dropout)
#
# Head-dim classes are BLOCK_D <= 64, 128, 256 (16/32 run the 64 class's tiles); operand kinds
# "16" (fp16/bf16), "tf32" and "ieee" (fp32 under torch's TF32 / full-precision matmul setting).
# On CUDA with several candidates, common.ConfigCache times them once per key and keeps the
# fastest. Every candidate compiles without spills on its own arch (tests/test_compile.py);
# sm_90 candidates compile with TMA, and the first candidate also with pointer loads (the
# pointer path there, for unaligned layouts, takes only the first).
#
# Sources: flex_attention's H100/A100 defaults (torch/_inductor/template_heuristics/triton.py:
# D64 128x128/3 stages/4 warps, D128 128x64/3/8, D256 64x32/3/4 forward; sm90 backward
# 64/128/128/64, 3 stages, 8 warps), Triton's 06-fused-attention tutorial (Hopper forward
# 128x{64,128} with 8 warps only from 128x128; backward 32/128/128/32, 5 stages, 4 warps).
# sm_90 forward: flex's D64 128x128 with 4 warps is not shipped (one warpgroup over 128 rows
# serializes its wgmma: 24 waits per trip, 255 registers, 8 B of stack with host descriptors).
# Warp-specialized candidates (``ws``, Triton's Hopper WS: a TMA producer and Q's rows split
# between two consumer warpgroups, 4 warps requested) come after the proven first candidate,
# for the timing to pick where faster; 128x128 WS tiles fail to compile with causality or
# padding (Triton 3.6), so 128x64 only.
# sm_80 (sass_loops --arch 80; non-MMA instructions per mma.sync in the unmasked K/V loop):
# D64 128x128/8 warps first (3.9, against 5.4 at 128x32/4 warps). FlashAttention-2's A100
# tiles do not fit Triton's register budget: D128 128x64/4 warps spills 6.4 KB, 128x64/8
# warps (3.1 against 4.2 at 128x32/8 warps) 24-64 B with causality or ragged heads, D256
# 128x64/8 warps 312-520 B, the D128 backward's 64/128/128/64 64-128 B; those stay.
# Dropout (one Philox call per 4 elements, in the MMA layouts' own groups: _dropout_keep)
# runs the no-dropout tiles first on sm_90 (the former smaller tiles follow), except where a
# flag combination spills: the D128 backward's dK/dV steps stay at 16 rows (32 rows: 16-56 B
# with causality and padding; split dV/dK programs cost more), the D256 backward's 32x64
# split tile is a TMA-only later candidate (its pointer build spills 24-64 B). The FMA-unit
# IEEE kernels draw one call per element (no MMA groups); on sm_80 the IEEE forwards take 8
# warps (D64 without dropout 32x32/4 warps spilled 16 B already; with dropout 1 stage), the
# D64 IEEE dropout backward 8 warps and the D256 dropout backward 16x32 split steps, to stay
# spill-free with it.
# ---------------------------------------------------------------------------------------------

def _fwd_cfg(bm, bn, warps, stages, ws=False):
    return common.Config.of(num_warps=warps, num_stages=stages, BLOCK_M=bm, BLOCK_N=bn, WS=ws)


def _bwd_cfg(m1, n1, m2, n2, warps, stages, split_kv=False):
    return common.Config.of(num_warps=warps, num_stages=stages, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2,
                            BLOCK_N2=n2, SPLIT_KV=split_kv)


F, B = _fwd_cfg, _bwd_cfg
FWD_CONFIGS = {
    90: {
        (64, "16", False): [F(128, 128, 8, 3), F(128, 64, 4, 3), F(128, 64, 4, 3, True)],
        (64, "16", True): [F(128, 128, 8, 3), F(128, 64, 8, 3)],
        (128, "16", False): [F(128, 64, 8, 3), F(128, 128, 8, 2), F(128, 64, 4, 3, True)],
        (128, "16", True): [F(128, 64, 8, 3), F(128, 32, 8, 3)],
        (256, "16", False): [F(64, 32, 8, 3), F(64, 32, 4, 3), F(128, 64, 8, 2)],
        (256, "16", True): [F(64, 32, 8, 3), F(64, 32, 8, 2), F(128, 32, 8, 2)],
        (64, "tf32", False): [F(128, 32, 4, 3), F(128, 32, 8, 3)],
        (64, "tf32", True): [F(128, 32, 8, 3), F(64, 32, 4, 3)],
        (128, "tf32", False): [F(128, 32, 8, 3), F(64, 64, 4, 3)],
        (128, "tf32", True): [F(128, 32, 8, 3), F(64, 32, 4, 3)],
        (64, "ieee", False): [F(32, 32, 8, 2)],
        (64, "ieee", True): [F(32, 32, 8, 2)],
        (128, "ieee", False): [F(16, 16, 4, 2)],
        (128, "ieee", True): [F(16, 16, 8, 2)],
    },
    80: {
        (64, "16", False): [F(128, 128, 8, 3), F(128, 32, 4, 3)],
        (64, "16", True): [F(128, 64, 8, 3)],
        (128, "16", False): [F(128, 32, 8, 3)],
        (128, "16", True): [F(128, 32, 8, 3)],
        (256, "16", False): [F(64, 32, 8, 3)],
        (256, "16", True): [F(32, 32, 4, 2)],
        (64, "tf32", False): [F(128, 32, 8, 3)],
        (64, "tf32", True): [F(128, 32, 8, 3)],
        (128, "tf32", False): [F(128, 32, 8, 3)],
        (128, "tf32", True): [F(128, 32, 8, 3)],
        (64, "ieee", False): [F(32, 32, 8, 2)],
        (64, "ieee", True): [F(32, 32, 8, 1)],
        (128, "ieee", False): [F(16, 16, 4, 2)],
        (128, "ieee", True): [F(16, 16, 8, 2)],
    },
}
# Backward: BLOCK_M1 x BLOCK_N1 (dK/dV: queries per step x keys per program), BLOCK_M2 x
# BLOCK_N2 (dQ). dK and dV accumulate in registers together, BLOCK_N1 x BLOCK_D fp32 each:
# with 8 warps BLOCK_N1 = 128 is two warpgroups of 64 rows (wgmma's M), and BLOCK_M1 = 32 (the
# tutorial's 32/128) leaves room for the score tiles; flex's 64/128 spills at D = 128 here.
# Where both accumulators cannot fit (D = 256, some fp32 and dropout classes) ``split_kv``
# gives dV and dK programs of their own (the dK one recomputes P).
BWD_CONFIGS = {
    90: {
        (64, "16", False): [B(64, 128, 128, 64, 8, 3), B(32, 128, 128, 64, 8, 3)],
        (64, "16", True): [B(64, 128, 128, 64, 8, 3), B(32, 128, 128, 32, 8, 2)],
        (128, "16", False): [B(32, 128, 128, 64, 8, 3), B(32, 128, 128, 64, 8, 2)],
        (128, "16", True): [B(16, 128, 128, 64, 8, 3), B(16, 128, 128, 32, 8, 2)],
        (256, "16", False): [B(32, 64, 64, 32, 8, 2, True), B(64, 64, 64, 64, 8, 2, True)],
        (256, "16", True): [B(16, 64, 64, 16, 8, 3, True), B(16, 64, 64, 16, 8, 2, True),
                            B(32, 64, 64, 32, 8, 2, True)],
        (64, "tf32", False): [B(32, 128, 128, 64, 8, 3)],
        (64, "tf32", True): [B(32, 128, 128, 64, 8, 3), B(16, 128, 128, 32, 8, 2)],
        (128, "tf32", False): [B(16, 128, 128, 16, 8, 2, True), B(16, 128, 128, 32, 8, 2)],
        (128, "tf32", True): [B(16, 128, 128, 16, 8, 2, True), B(16, 64, 64, 16, 8, 2, True)],
        (64, "ieee", False): [B(16, 32, 32, 16, 4, 2)],
        (64, "ieee", True): [B(16, 32, 32, 16, 4, 2)],
        (128, "ieee", False): [B(16, 16, 16, 16, 4, 2)],
        (128, "ieee", True): [B(16, 16, 16, 16, 4, 3)],
    },
    80: {
        (64, "16", False): [B(32, 128, 128, 32, 8, 2), B(32, 64, 64, 32, 4, 2)],
        (64, "16", True): [B(16, 64, 64, 16, 4, 2)],
        (128, "16", False): [B(32, 64, 64, 32, 8, 2)],
        (128, "16", True): [B(32, 64, 64, 32, 8, 2)],
        (256, "16", False): [B(32, 64, 64, 32, 8, 2, True)],
        (256, "16", True): [B(16, 32, 32, 16, 8, 2, True)],
        (64, "tf32", False): [B(16, 64, 64, 16, 8, 2)],
        (64, "tf32", True): [B(16, 64, 64, 16, 8, 2)],
        (128, "tf32", False): [B(16, 64, 64, 16, 8, 2, True)],
        (128, "tf32", True): [B(16, 32, 32, 16, 8, 2, True)],
        (64, "ieee", False): [B(16, 32, 32, 16, 4, 2)],
        (64, "ieee", True): [B(16, 32, 32, 16, 8, 2)],
        (128, "ieee", False): [B(16, 32, 32, 16, 4, 2)],
        (128, "ieee", True): [B(16, 16, 16, 16, 4, 2)],
    },
}
del F, B
# The interpreter runs one config: query and key blocks of different sizes (and different in
# the two backward halves), so the tests cross both block grids and every masked/unmasked split.
INTERPRET_FWD = _fwd_cfg(64, 32, 1, 1)
INTERPRET_BWD = _bwd_cfg(32, 64, 64, 32, 1, 1)
PRE_BLOCK_M = 64
# The backward's row statistics (STATS) are padded to a multiple of this: every query
# block of the backward tables (BLOCK_M1, BLOCK_M2) and PRE_BLOCK_M divide it.
STAT_ALIGN = 128
MAX_FP32_BLOCK_D = 128  # fp32 tiles are twice as wide; wider fp32 heads are refused upstream


def _block_d(d: int) -> int:
    return max(16, common.next_pow2(d))


def _kind(dtype) -> str:
    if dtype == torch.float32:
        return "tf32" if common.fp32_precision() == "tf32" else "ieee"
    return "16"


def _table_key(block_d: int, kind: str, dropout: bool):
    return (64 if block_d <= 64 else block_d, kind, dropout)


def _bucket(n: int) -> int:
    """Config-key bucket of a sequence length: the next power of two in [64, 16384]."""
    return min(max(64, common.next_pow2(n)), 16384)


# ---------------------------------------------------------------------------------------------
# launchers (inputs validated by fused_block.attention; every last dim contiguous)
# ---------------------------------------------------------------------------------------------

_FWD_CACHE = common.ConfigCache("attention_fwd")
_BWD_CACHE = common.ConfigCache("attention_bwd")
_ALLOCATORS = {}


def _allocator(device):
    """``triton.set_allocator`` callback: descriptor scratch on ``device``'s caching allocator."""
    alloc = _ALLOCATORS.get(device)
    if alloc is None:
        def alloc(size, alignment, stream):
            return torch.empty(size, dtype=torch.int8, device=device)
        _ALLOCATORS[device] = alloc
    return alloc


def _strides(t):
    """(batch, head, row) strides of a (B, H, L, D) view. A size-1 dim's stride is never used to
    move, so it gets a stand-in that never blocks TMA: an aligned nonzero value (the next
    inner dim's extent; descriptor strides)."""
    B, H, L = t.shape[:3]
    sb, sh, sl = t.stride()[:3]
    sl = sl if L > 1 else 16
    sh = sh if H > 1 else sl * L
    return (sb if B > 1 else sh * H, sh, sl)


def _tma_desc(t, strides, block: int, block_d: int):
    """Host-side TMA descriptor over the (B, H, L, D) view ``t`` (``strides`` from
    :func:`_strides`), block (1, 1, block, block_d): rows past L and columns past D read as
    zero and are not written."""
    return TensorDescriptor(t, list(t.shape), [*strides, 1], [1, 1, block, block_d])


def _aligned(t, strides) -> bool:
    """TMA-able: 16-byte aligned base and strides, and no broadcast (zero-stride) head or row."""
    es = t.element_size()
    return (t.data_ptr() % 16 == 0 and all(s * es % 16 == 0 for s in strides)
            and strides[1] != 0 and strides[2] != 0)


def _use_tma(arch: int, kind: str, pairs) -> bool:
    """TMA on Hopper and in the interpreter, for layouts whose bases and strides are 16-byte
    aligned (descriptors require it); ``pairs`` are (tensor, strides). Hopper's IEEE fp32
    products run on FMA units from registers: pointer loads there (TMA staging spills)."""
    if FORCE_PATH == "pointer" or arch not in (0, 90) or (arch == 90 and kind == "ieee"):
        return False
    return all(_aligned(t, s) for t, s in pairs)


def _grid_size(n_programs: int) -> int:
    if n_programs > 2**31 - 1:
        raise ValueError(f"attention: {n_programs} programs exceed CUDA's grid limit; split the batch")
    return n_programs


def _candidates(tables, interpret_cfg, arch, key, use_tma):
    if arch == 0:
        if "SPLIT_KV" in interpret_cfg.meta():
            # Split dK/dV programs where the GPU tables split them, so the interpreter runs them.
            split = any(c["SPLIT_KV"] for t in tables.values() for c in t[key])
            interpret_cfg = _bwd_cfg(*(interpret_cfg[n] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")),
                                     interpret_cfg.num_warps, interpret_cfg.num_stages, split)
        return [interpret_cfg]
    cands = tables[arch][key]
    # sm_90's pointer path (unaligned layouts only) runs the first candidate, compiled as such.
    return cands if use_tma or arch != 90 else cands[:1]


def _fwd_candidates(arch, key, use_tma, causal, Lk):
    """The forward's candidates; warp-specialized ones only where their single unmasked K/V
    loop is exact (causal, or whole key blocks). The interpreter's one config runs without
    warp specialization otherwise."""
    cands = _candidates(FWD_CONFIGS, INTERPRET_FWD, arch, key, use_tma)
    ok = [c for c in cands if not c["WS"] or causal or Lk % c["BLOCK_N"] == 0]
    if ok:
        return ok
    return [_fwd_cfg(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages) for c in cands]


def _mask_arg(key_padding_mask, dummy):
    if key_padding_mask is None:
        return dummy, 0
    m = key_padding_mask if key_padding_mask.is_contiguous() else key_padding_mask.contiguous()
    return m.view(torch.uint8), m.stride(0)


def forward(q, k, v, out, lse, key_padding_mask, seed, causal: bool, scale: float, dropout_p: float) -> None:
    """Writes ``out`` (a (B, Hq, Lq, D) view in q's dtype, any strides) and ``lse`` ((B, Hq, Lq)
    contiguous fp32, natural log). ``seed``: 1-element int64 tensor, read when dropout_p > 0."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if out.numel() == 0:
        return
    if Lk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    arch = common.arch(q.device)
    sq, sk, sv, so = _strides(q), _strides(k), _strides(v), _strides(out)
    block_d = _block_d(D)
    kind = _kind(q.dtype)
    use_tma = _use_tma(arch, kind, ((q, sq), (k, sk), (v, sv), (out, so)))
    dropout = dropout_p > 0.0
    mask, stride_mb = _mask_arg(key_padding_mask, q)
    tail = (*sq, *sk, *sv, *so, stride_mb, Hq, Hq // Hkv, Lq, Lk, D, float(scale), float(dropout_p))
    head = (q, k, v, out, lse, mask, seed if dropout else q)
    constexprs = dict(IS_CAUSAL=bool(causal), HAS_PAD=key_padding_mask is not None, HAS_DROPOUT=dropout,
                      USE_TMA=use_tma, IEEE=kind == "ieee", EVEN_D=D == block_d, BLOCK_D=block_d,
                      INTERPRET=arch == 0)
    # Lk's power-of-two factor (up to 128) is part of the key: it decides which warp-specialized
    # candidates (whole key blocks only, without causality) may run.
    key = (arch, _table_key(block_d, kind, dropout), bool(causal), key_padding_mask is not None, use_tma,
           _bucket(Lq), _bucket(Lk), min(Lk & -Lk, 128))
    cands = _fwd_candidates(arch, key[1], use_tma, bool(causal), Lk)
    if use_tma and arch and any(c["WS"] for c in cands):
        triton.set_allocator(_allocator(q.device))  # WS configs build their descriptors on the device

    def args(cfg):
        if use_tma and not cfg["WS"]:
            bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
            descs = (_tma_desc(q, sq, bm, block_d), _tma_desc(k, sk, bn, block_d), _tma_desc(v, sv, bn, block_d),
                     _tma_desc(out, so, bm, block_d))
        else:
            descs = (q, k, v, out)  # unused
        return head + descs + tail

    def grid(cfg):
        return (_grid_size(common.cdiv(Lq, cfg["BLOCK_M"]) * B * Hq),)

    cfg = _FWD_CACHE.get(key, cands,
                         lambda c: common.launch("attention_fwd", _attn_fwd, grid(c), args(c), constexprs, c))
    if use_tma:
        common.count_launch("attention_tma")
    common.launch("attention_fwd", _attn_fwd, grid(cfg), args(cfg), constexprs, cfg)


def backward(do, q, k, v, out, lse, dlse, dq, dk, dv, key_padding_mask, seed, causal: bool, scale: float,
             dropout_p: float) -> None:
    """Writes the gradients into ``dq``, ``dk``, ``dv`` (views of q's, k's, v's shapes and dtypes;
    dk and dv with equal strides), dK/dV summed over each GQA group.

    ``do`` has out's shape (any strides, contiguous last dim); ``lse`` is the forward's;
    ``dlse`` ((B, Hq, Lq) fp32) or None is the gradient of the LSE output.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Lq == 0 or Lk == 0 or B == 0:
        # No query (nothing to differentiate) or no key (every row outputs the constant 0).
        for t in (dq, dk, dv):
            t.zero_()
        return
    arch = common.arch(q.device)
    block_d = _block_d(D)
    # Row statistics padded to a multiple of every backward query block (unmasked loads).
    stride_stat = common.cdiv(Lq, STAT_ALIGN) * STAT_ALIGN
    stats = common.empty((B * Hq, 2, stride_stat), torch.float32, q.device)
    n_pre = stride_stat // PRE_BLOCK_M
    so, sdo = _strides(out), _strides(do)
    if dlse is not None and not dlse.is_contiguous():
        dlse = dlse.contiguous()  # e.g. the expanded gradient of lse.sum()
    common.launch("attention_bwd_preprocess", _attn_bwd_preprocess, (_grid_size(n_pre * B * Hq),),
                  (out, do, lse, dlse if dlse is not None else lse, stats, *so, *sdo, Hq, Lq, D, n_pre,
                   stride_stat),
                  dict(HAS_DLSE=dlse is not None, BLOCK_D=block_d, BLOCK_M=PRE_BLOCK_M),
                  common.Config.of(num_warps=4))

    sq, sk, sv, sdq, sdk = _strides(q), _strides(k), _strides(v), _strides(dq), _strides(dk)
    kind = _kind(q.dtype)
    use_tma = _use_tma(arch, kind, ((q, sq), (k, sk), (v, sv), (do, sdo), (dq, sdq), (dk, sdk), (dv, sdk)))
    dropout = dropout_p > 0.0
    mask, stride_mb = _mask_arg(key_padding_mask, q)
    groups = Hq // Hkv
    args = (q, k, v, do, dq, dk, dv, stats, mask, seed if dropout else q,
            *sq, *sk, *sv, *sdo, *sdq, *sdk, stride_mb, stride_stat, Hq, Hkv, groups, Lq, Lk, D, float(scale),
            float(dropout_p))
    constexprs = dict(IS_CAUSAL=bool(causal), HAS_PAD=key_padding_mask is not None, HAS_DROPOUT=dropout,
                      USE_TMA=use_tma, IEEE=kind == "ieee", EVEN_D=D == block_d, BLOCK_D=block_d,
                      INTERPRET=arch == 0)
    if use_tma and arch:
        triton.set_allocator(_allocator(q.device))

    def grid(cfg):
        kv_programs = common.cdiv(Lk, cfg["BLOCK_N1"]) * (2 if cfg["SPLIT_KV"] else 1)
        per_head = kv_programs + common.cdiv(Lq, cfg["BLOCK_M2"]) * groups
        return (_grid_size(per_head * B * Hkv),)

    key = (arch, _table_key(block_d, kind, dropout), bool(causal), key_padding_mask is not None, use_tma,
           _bucket(Lq), _bucket(Lk))
    cfg = _BWD_CACHE.get(key, _candidates(BWD_CONFIGS, INTERPRET_BWD, arch, key[1], use_tma),
                         lambda c: common.launch("attention_bwd", _attn_bwd, grid(c), args, constexprs, c))
    if use_tma:
        common.count_launch("attention_tma")
    common.launch("attention_bwd", _attn_bwd, grid(cfg), args, constexprs, cfg)


def dropout_keep_mask(seed, B: int, Hq: int, Lq: int, Lk: int, dropout_p: float, device) -> torch.Tensor:
    """The bool keep mask (B, Hq, Lq, Lk) the kernels use for ``seed`` (a test helper)."""
    out = torch.empty((B, Hq, Lq, Lk), dtype=torch.uint8, device=device)
    if out.numel() == 0:
        return out.bool()
    bm = bn = 32
    nm, nn = common.cdiv(Lq, bm), common.cdiv(Lk, bn)
    common.launch("attention_dropout_mask", _dropout_mask_kernel, (_grid_size(nm * nn * B * Hq),),
                  (seed, out, Hq, Lq, Lk, nm, nn, float(dropout_p)), dict(BLOCK_M=bm, BLOCK_N=bn),
                  common.Config.of(num_warps=4))
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


def _aligned_args(fn):
    return tuple(n for n in fn.arg_names if n.startswith("stride_") and n != "stride_mb") + ("D",)


def _data_ptrs(fn, dt, meta=None, block_d=None, tma=False):
    """Argument types: data pointers, and the forward's descriptor arguments (host-side
    descriptors on its TMA path without warp specialization, else the tensors)."""
    ptrs = {p: f"*{dt}" for p in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "QD", "KD", "VD", "OD")
            if p in fn.arg_names}
    if tma and meta is not None and "WS" in meta and not meta["WS"]:
        for p, block in (("QD", "BLOCK_M"), ("KD", "BLOCK_N"), ("VD", "BLOCK_N"), ("OD", "BLOCK_M")):
            ptrs[p] = f"tensordesc<{dt}[1, 1, {meta[block]}, {block_d}]>"
    ptrs.update({p: "*fp32" for p in ("LSE", "STATS") if p in fn.arg_names})
    ptrs.update(MASK="*u8", SEED="*i64")
    return ptrs


def _aot_combos(block_d_class: int, tma: bool, exhaustive: bool):
    """The runtime combinations of one table entry the compile check builds, as (IS_CAUSAL,
    HAS_PAD, BLOCK_D, EVEN_D). Near 255 registers ptxas is not monotonic in them (configs
    spilled with causal and padding off and not on, or only with D == BLOCK_D), so
    ``exhaustive`` builds their product: causal x padding x every BLOCK_D of the class (16
    and 32 run the 64 class's tiles) x EVEN_D (D == BLOCK_D, or a smaller multiple of 16 with
    column masks; the TMA path has no column masks, so EVEN_D does not reach its code). The
    default check builds, at the class's BLOCK_D, causal x padding with EVEN_D alternating on
    the pointer path (every pair of the three flags in all four states) and causal + padding
    and neither on the TMA path (where every spill of the product showed).

    Strides and D carry the 16-divisibility hint in both: head dims that are odd multiples of
    8 (24, 40, 72, ...) give the pointer path neither, and it spills there (see README)."""
    if not exhaustive:
        for causal, pad in ((True, True), (False, False)) if tma else ((True, True), (False, False), (True, False),
                                                                      (False, True)):
            yield causal, pad, block_d_class, tma or causal != pad
        return
    for causal, pad in ((True, True), (False, False), (True, False), (False, True)):
        for bd in (16, 32, 64) if block_d_class == 64 else (block_d_class,):
            for even in (True,) if tma or bd < 64 else (True, False):
                yield causal, pad, bd, even


def aot_specs(exhaustive=None) -> list:
    """Every shipped config on its own arch (bf16 for the "16" kind, fp32 for tf32/ieee; ieee
    products are not wgmma) in the runtime combinations of :func:`_aot_combos`, with dropout as
    its list says. sm_90: TMA (asserted), plus pointer loads for each list's first config (IEEE
    fp32: pointers only); sm_80: pointers. ``exhaustive`` (default: ``FUSED_BLOCK_AOT_ALL=1``)
    builds every combination and compiles a config in both a class's dropout and no-dropout
    lists both ways; the default check compiles such a config once, with dropout."""
    from fused_block.kernels import aot  # only the compile check needs it

    if exhaustive is None:
        exhaustive = os.environ.get("FUSED_BLOCK_AOT_ALL", "0") == "1"

    def paths(arch, kind, cfgs):
        # sm_90 runs a list on TMA (except IEEE fp32) and its first config on pointers too.
        for i, cfg in enumerate(cfgs):
            for tma in ((True, False) if i == 0 else (True,)) if arch == 90 and kind != "ieee" else (False,):
                yield cfg, tma

    specs = []
    for kname, fn, tables in (("fwd", _attn_fwd, FWD_CONFIGS), ("bwd", _attn_bwd, BWD_CONFIGS)):
        for arch, table in tables.items():
            for (block_d, kind, dropout), cfgs in table.items():
                dt = "bf16" if kind == "16" else "fp32"
                with_dropout = set(paths(arch, kind, table.get((block_d, kind, True), ())))
                for cfg, tma in paths(arch, kind, cfgs):
                    if not dropout and not exhaustive and (cfg, tma) in with_dropout:
                        continue
                    m = cfg.meta()
                    blocks = (f"{m['BLOCK_M']}x{m['BLOCK_N']}" if kname == "fwd" else
                              f"{m['BLOCK_M1']}x{m['BLOCK_N1']}/{m['BLOCK_M2']}x{m['BLOCK_N2']}"
                              f"{' split' if m['SPLIT_KV'] else ''}")
                    blocks += " ws" if m.get("WS") else ""
                    for causal, pad, bd, even in _aot_combos(block_d, tma, exhaustive):
                        specs.append(aot.KernelSpec(
                            name=(f"attention_{kname} D{block_d} {kind}{' dropout' if dropout else ''} {blocks} "
                                  f"{'tma' if tma else 'ptr'}: {'causal' if causal else 'full'}"
                                  f"{' pad' if pad else ''}{f' D{bd}' if bd != block_d else ''}"
                                  f"{'' if even else ' ragged'}"),
                            fn=fn, signature=_signature(fn, _data_ptrs(fn, dt, m, bd, tma)),
                            constexprs=dict(IS_CAUSAL=causal, HAS_PAD=pad, HAS_DROPOUT=dropout, USE_TMA=tma,
                                            IEEE=kind == "ieee", EVEN_D=even, BLOCK_D=bd, INTERPRET=False, **m),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=_aligned_args(fn),
                            wgmma=kind != "ieee", tma=tma, archs=(arch,)))
    specs.append(aot.KernelSpec(
        name="attention_bwd_preprocess D128 bf16", fn=_attn_bwd_preprocess,
        signature=_signature(_attn_bwd_preprocess, {"O": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DLSE": "*fp32",
                                                    "STATS": "*fp32"}),
        constexprs=dict(HAS_DLSE=True, BLOCK_D=128, BLOCK_M=PRE_BLOCK_M), num_warps=4,
        aligned=_aligned_args(_attn_bwd_preprocess)))
    specs.append(aot.KernelSpec(
        name="attention_dropout_mask", fn=_dropout_mask_kernel,
        signature=_signature(_dropout_mask_kernel, {"SEED": "*i64", "OUT": "*u8"}),
        constexprs=dict(BLOCK_M=32, BLOCK_N=32), num_warps=4))
    return specs
