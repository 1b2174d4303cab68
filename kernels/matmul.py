"""GEMMs with fused epilogues for linear layers and feed-forward blocks, forward and backward.

One kernel body, ``_gemm_kernel``, computes ``C = epilogue(A @ B)`` with A (M, K) and B (K, N)
given by strides (``x @ W.T``, ``dPre @ W`` and ``dY.T @ X`` run without copies), fp32
accumulation, and constexpr switches for everything else:

- Main loop. ``USE_TMA``: tensor-descriptor (TMA) loads, for operands with one unit stride and
  16-byte aligned base and leading stride; otherwise pointer loads (``cp.async`` pipelining on
  sm_80, and the fallback for unaligned views on sm_90, on a small tile of its own). Persistent
  grid on sm_90 (``min(SMs,
  tiles)`` programs, twice as many for tiles below 128x128, walking the tiles in grouped order,
  GROUP_M row tiles per group for L2 reuse; each program builds its descriptors once) with the
  TMA path's tile loop flattened into the K loop so the next tile's loads overlap this tile's
  epilogue (Triton's 09-persistent-matmul); one program per tile on sm_80. ``WARP_SPECIALIZE``
  (sm_90 candidates, WS_CONFIGS, opt-in: FUSED_BLOCK_WS=1): the tile loop unflattened and
  warp-specialized instead.
  ``DUAL == 1``: a second B operand and a second accumulator over the same A tiles (SwiGLU's
  gate and up projections, read from two weight tensors with no concatenation). ``DUAL == 2``:
  a second (A, B) pair continuing the K reduction (``dGate @ W_gate + dUp @ W_up``).
- Epilogue, on the fp32 tile in registers, in column slices (``EPI_SPLIT``, see _epi_split;
  32 columns with dropout) so its temporaries do not cut into the pipeline's registers. With
  16-bit outputs the activations take short fp32 forms (``FAST``, see _phi). Stores (and the
  residual / pre-activation loads) use tensor descriptors when ``TMA_EPI``.
  Forward: ``+ bias``; the pre-activation rounded to the input dtype (``ROUND_PRE``: an
  FFN's first layer, as eager PyTorch rounds a linear's output before its activation) and
  stored when ``STORE_PRE``; activation
  (none, erf GELU, tanh GELU, ReLU, or SwiGLU ``silu(gate) * up``); dropout; ``+ residual``.
  Gradient (``ACT_GRAD``, cuBLASLt's DGELU): ``dPre = (A @ B) * keep / (1 - p) * act'(pre)``
  (SwiGLU: ``dGate`` and ``dUp`` from the saved gate and up), the bias gradient's column sums
  per ``PARTIAL_ROWS`` rows (``HAS_DBIAS``), and with ``STORE_H`` the hidden activation
  recomputed from pre (the forward saves pre only; the weight gradient of the next layer reads
  this). ``ROWSUM``: row sums of A per ``PARTIAL_ROWS`` columns, so the weight-gradient GEMM
  ``dY.T @ X`` also yields the bias gradient ``colsum(dY)``'s partials. Partial sums are
  reduced in a fixed order by ``_reduce_kernel``: deterministic, no atomics.
- Dropout: element (row, col) of an (M, N) output is kept when word ``(col % 64) // 16`` of
  ``philox(seed, counter=(col // 64) * 16 + col % 16, row)`` is at least ``p * 2^32``; one
  Philox call thus serves four elements, and the mask is a function of (seed, row, col) only,
  so every tile shape and kernel regenerates the same mask. Kept values are scaled by
  ``1 / (1 - p)``. The mask is never stored: gradients regenerate it, and
  :func:`dropout_mask` materializes it for tests.
- Products: fp16/bf16 on tensor cores (wgmma on sm_90); fp32 follows ``PRECISION``: "ieee"
  (torch's default: full fp32 products, each K block summed apart: ``common.dot_step``) or
  "tf32" (torch's ``allow_tf32``; operands rounded to nearest TF32 first: ``common.dot``).
  The interpreter computes every product of its (rounded) operands exactly in fp32.
- Offsets: tile origins are int64, in-tile offsets int32, so tensors past 2^31 elements work.
"""
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from fused_block.kernels import common

ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "swiglu": 4, "geglu": 5}
SWIGLU = 4
# GeGLU (Gemma's MLP): ``gelu_tanh(gate) * up``, the tanh GELU of code 2 on the gate.
GEGLU = 5
# The gated activations (two accumulators forward, dGate and dUp backward): codes >= SWIGLU.
GATED = (SWIGLU, GEGLU)
# Rows of dPre (columns of A for ROWSUM) summed into one row of a bias-gradient partial buffer.
# Every BLOCK_M is a multiple of it, so the buffer's layout does not depend on the tile chosen.
PARTIAL_ROWS = 64
GROUP_M = 8

_SQRT_1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_LOG2E = tl.constexpr(1.4426950408889634)
_TANH_K0 = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_TANH_K1 = tl.constexpr(0.044715)
# -2u log2(e) = x (E0 + E1 x^2): the exponent of 2 in sigmoid(2u) = 1 / (1 + 2^(-2u log2 e)).
_TANH_E0 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634)
_TANH_E1 = tl.constexpr(-2.0 * 0.7978845608028654 * 0.044715 * 1.4426950408889634)
# Phi(-a) = 0.5 * erfc(a / sqrt(2)) ~ 2^-T(a) for a >= 0, T(a) = 1 + c1 a + ... + c5 a^5: the
# weighted minimax fit (linear program on [0, 5]; weight max(1, a) * Phi(-a), i.e. the absolute
# error of Phi and of the GELU x * Phi(x)), coefficients rounded to fp32. T(0) = 1 keeps Phi
# continuous at 0; T increases past the fit's range, so 2^-T keeps falling to 0. Measured
# against float64 (tests/test_linear.py::test_fast_gelu_against_float64): |error| < 1e-6 in
# Phi, the GELU and its derivative over all fp32 inputs.
_PHI_T1 = tl.constexpr(1.1510708332061768)
_PHI_T2 = tl.constexpr(0.4593662917613983)
_PHI_T3 = tl.constexpr(0.05238773301243782)
_PHI_T4 = tl.constexpr(-0.007299393881112337)
_PHI_T5 = tl.constexpr(0.0005025395657867193)


# ---------------------------------------------------------------------------------------------
# elementwise pieces of the epilogues
# ---------------------------------------------------------------------------------------------
# FAST (the epilogue's outputs are fp16/bf16): shorter forms whose fp32 error (below 1e-6; the
# tanh GELU's derivative 5.4e-6) vanishes in the output's rounding (half an ulp: 4.9e-4 at 1.0
# in fp16, 3.9e-3 in bf16), each a few FFMAs and one or two MUFU ops (tl.exp2, tl.math.rsqrt:
# one instruction each). fp32 outputs keep libdevice's erf and tl.sigmoid.

@triton.jit
def _phi(x, FAST: tl.constexpr):
    """The standard normal CDF 0.5 * (1 + erf(x / sqrt(2))) on an fp32 tile (NaN stays NaN)."""
    if FAST:
        a = tl.abs(x)
        t = ((((_PHI_T5 * a + _PHI_T4) * a + _PHI_T3) * a + _PHI_T2) * a + _PHI_T1) * a + 1.0
        h = tl.exp2(-t)  # Phi(-|x|)
        return tl.where(x >= 0.0, 1.0 - h, h)
    else:
        return 0.5 * (1.0 + tl.erf(x * _SQRT_1_2))


@triton.jit
def _sigmoid(z, FAST: tl.constexpr):
    """1 / (1 + exp(-z)) on an fp32 tile; FAST as rsqrt(1 + 2^(-z log2 e))^2 (relative error
    ~3e-7; 0 where the exponential overflows)."""
    if FAST:
        r = tl.math.rsqrt(1.0 + tl.exp2(z * -_LOG2E))
        return r * r
    else:
        return tl.sigmoid(z)


@triton.jit
def _act(x, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """The activation on an fp32 tile: 0 none, 1 erf GELU, 2 tanh GELU, 3 ReLU. The forward's
    and the backward's recomputed one are the same code (_act_grad's, its derivative unused)."""
    return _act_grad(x, ACTIVATION, FAST)[1]


@triton.jit
def _act_grad(x, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """``(d act(x) / dx, act(x))`` on an fp32 tile (ReLU: 0 at x == 0, like torch), sharing
    their intermediates (an unused act(x) costs nothing)."""
    d = tl.full(x.shape, 1.0, tl.float32)
    y = x
    if ACTIVATION == 1:
        if FAST:
            pdf = tl.exp2(x * x * (-0.5 * _LOG2E))
        else:
            pdf = tl.exp(-0.5 * x * x)
        cdf = _phi(x, FAST)
        d = cdf + x * _INV_SQRT_2PI * pdf
        y = x * cdf
    elif ACTIVATION == 2:
        # With s = sigmoid(2u): 0.5 * (1 + tanh(u)) = s and 1 - tanh(u)^2 = 4 s sigmoid(-2u),
        # which does not cancel where tanh(u) is near +-1 (FAST: 1 - s, whose absolute error
        # there is an ulp of 1).
        x2 = x * x
        if FAST:
            # exp(-2u) as 2^(x (c0 + c1 x^2)), log2(e) folded into the constants; s (1 - s)
            # as one FMA, s - s^2.
            r = tl.math.rsqrt(1.0 + tl.exp2(x * (_TANH_E0 + _TANH_E1 * x2)))
            s = r * r
            q = s - s * s
        else:
            u2 = x * (2.0 * _TANH_K0 + (2.0 * _TANH_K0 * _TANH_K1) * x2)
            s = tl.sigmoid(u2)
            q = s * tl.sigmoid(-u2)
        # d = s + s sigmoid(-2u) x d(2u)/dx, with d(2u)/dx = 2 K0 (1 + 3 K1 x^2), multiplied
        # left to right: for large |x| q is 0 while x^3 overflows.
        du2 = 2.0 * _TANH_K0 + (6.0 * _TANH_K0 * _TANH_K1) * x2
        d = s + q * x * du2
        y = x * s
    elif ACTIVATION == 3:
        d = tl.where(x > 0.0, 1.0, 0.0)
        y = tl.where(x < 0.0, 0.0, x)
    return d, y


@triton.jit
def _chain(g, d, x, ACTIVATION: tl.constexpr):
    """``g * d act(x) / dx`` for ``(d, _) = _act_grad(x)``. ReLU selects, as torch's
    threshold_backward (``where(x <= 0, 0, g)``): an infinite or NaN incoming gradient at an
    inactive unit gives 0 there, not inf * 0 = NaN."""
    if ACTIVATION == 3:
        return tl.where(x <= 0.0, 0.0, g)
    else:
        return g * d


@triton.jit
def _gate_grad(g, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """``(d act(g) / dg, act(g))`` of a gated FFN's gate on an fp32 tile: SiLU for SwiGLU (4),
    the tanh GELU for GeGLU (5)."""
    if ACTIVATION == 4:
        s = _sigmoid(g, FAST)
        if FAST:
            d = s + g * (s - s * s)
        else:
            d = s * (1.0 + g * (1.0 - s))
        return d, g * s
    else:
        return _act_grad(g, 2, FAST)


@triton.jit
def _drop_words(seed, rows64, c64):
    """Four uint32 Philox words for rows ``rows64`` (int64) and the 64 columns from ``c64`` (a
    multiple of 64): word q serves columns ``c64 + 16 q + j``, j < 16 (see the module doc)."""
    BM: tl.constexpr = rows64.shape[0]
    cnt = c64 // 4 + tl.arange(0, 16)
    c0 = tl.broadcast_to(cnt[None, :], (BM, 16))
    c1 = tl.broadcast_to(rows64.to(tl.int32)[:, None], (BM, 16))  # low 32 bits of the row
    c2 = tl.broadcast_to((rows64 >> 32).to(tl.int32)[:, None], (BM, 16))
    return tl.philox(seed, c0, c1, c2, tl.zeros((BM, 16), tl.int32))


@triton.jit
def _keep(word, drop_thresh):
    """Keep-mask from a Philox word: ``word >= p * 2^32`` compared on 31 bits (int32)."""
    return (word >> 1).to(tl.int32) >= drop_thresh


@triton.jit
def _keep32(word_lo, word_hi, drop_thresh):
    """The (rows, 32) keep-mask of two of :func:`_drop_words`'s words: ``word_lo`` on the first
    16 columns, ``word_hi`` on the next 16 (the inverse of splitting a tile in halves)."""
    k = tl.join(_keep(word_lo, drop_thresh), _keep(word_hi, drop_thresh))
    return tl.reshape(tl.permute(k, (0, 2, 1)), (word_lo.shape[0], 32))


@triton.jit
def _halves(acc):
    """The left and right column halves of a 2-D tile (registers only; no data movement)."""
    BM: tl.constexpr = acc.shape[0]
    HALF: tl.constexpr = acc.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(acc, (BM, 2, HALF)), (0, 2, 1)))


@triton.jit
def _pieces(acc, SPLIT: tl.constexpr):
    """``acc``'s columns as a tuple of SPLIT (1, 2 or 4) equal slices, left to right."""
    tl.static_assert(SPLIT == 1 or SPLIT == 2 or SPLIT == 4 or SPLIT == 8)
    if SPLIT == 1:
        res = (acc,)
    else:
        lo, hi = _halves(acc)
        if SPLIT == 2:
            res = (lo, hi)
        else:
            q0, q1 = _halves(lo)
            q2, q3 = _halves(hi)
            if SPLIT == 4:
                res = (q0, q1, q2, q3)
            else:
                e0, e1 = _halves(q0)
                e2, e3 = _halves(q1)
                e4, e5 = _halves(q2)
                e6, e7 = _halves(q3)
                res = (e0, e1, e2, e3, e4, e5, e6, e7)
    return res


@triton.jit
def _io_load(src, row0, rm, rn, mask, stride_m, stride_n, EVEN: tl.constexpr):
    """The fp32 (rm, rn) piece at row row0 of ``src`` (a pointer). Epilogue inputs use pointer
    loads even when the outputs use descriptors: a descriptor load waits for its data where it
    is issued, one round trip per slice, while pointer loads of later slices are in flight
    while earlier ones compute."""
    ptrs = src + row0.to(tl.int64) * stride_m + (rm[:, None] * stride_m + rn[None, :] * stride_n)
    if EVEN:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _io_store(dst, val, row0, col, rm, rn, mask, stride_m, TMA: tl.constexpr, EVEN: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Store the fp32 piece ``val`` at (row0, col), rounded to the destination's dtype (unit
    column stride), through a tensor descriptor (clipped at the edges; asynchronous) or a
    pointer with masks."""
    if TMA:
        dst.store([row0, col], common.cast(val, dst.dtype, INTERPRET))
    else:
        ptrs = dst + row0.to(tl.int64) * stride_m + (rm[:, None] * stride_m + rn[None, :])
        v = common.cast(val, dst.dtype.element_ty, INTERPRET)
        if EVEN:
            tl.store(ptrs, v)
        else:
            tl.store(ptrs, v, mask=mask)


@triton.jit
def _col_partials(d, PART, col_off, pid_m, rn, mask_m, mask_n, M, stride_p, PARTIAL_ROWS: tl.constexpr):
    """Column sums of the fp32 piece d per PARTIAL_ROWS rows into PART[pid_m * SLICES + s,
    col_off + rn] (rows past M excluded)."""
    BM: tl.constexpr = d.shape[0]
    SLICES: tl.constexpr = BM // PARTIAL_ROWS
    dd = tl.where(mask_m[:, None], d, 0.0)
    part = tl.sum(tl.reshape(dd, (SLICES, PARTIAL_ROWS, d.shape[1])), axis=1)
    rp = pid_m * SLICES + tl.arange(0, SLICES)
    p_mask = (rp < tl.cdiv(M, PARTIAL_ROWS))[:, None] & mask_n[None, :]
    tl.store(PART + rp.to(tl.int64)[:, None] * stride_p + (col_off + rn)[None, :], part, mask=p_mask)


@triton.jit
def _leaf(acc, acc2, keep, row0, col, M, N, pid_m,
          C, C2, BIAS, BIAS2, RES, AUX, AUX2, AUX_OUT, AUX2_OUT, HOUT, PART,
          stride_cm, stride_rm, stride_rn, stride_xm, stride_p, drop_scale,
          IN_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr, ACT_GRAD: tl.constexpr,
          HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_PRE: tl.constexpr,
          ROUND_PRE: tl.constexpr, STORE_H: tl.constexpr, HAS_DBIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
          TMA_EPI: tl.constexpr, EVEN_MN: tl.constexpr, PARTIAL_ROWS: tl.constexpr, FAST: tl.constexpr,
          INTERPRET: tl.constexpr):
    """The epilogue on one column slice ``acc`` (rows row0.., columns col..) of the tile;
    ``acc2`` is the up projection's slice for SwiGLU, ``keep`` the slice's dropout mask. Inputs
    (RES, AUX, AUX2 in backward) are pointers; outputs (C, C2, AUX_OUT, AUX2_OUT, HOUT) are
    descriptors when ``TMA_EPI``. ``FAST``: the activations' short forms (16-bit outputs)."""
    BM: tl.constexpr = acc.shape[0]
    W: tl.constexpr = acc.shape[1]
    rm = tl.arange(0, BM)
    rn = col + tl.arange(0, W)
    mask_m = rm < M - row0
    mask_n = rn < N
    mask = mask_m[:, None] & mask_n[None, :]
    if ACT_GRAD:
        if HAS_DROPOUT:
            acc = acc * tl.where(keep, drop_scale, 0.0)
        if ACTIVATION >= 4:
            g = _io_load(AUX, row0, rm, rn, mask, stride_xm, 1, EVEN_MN)
            u = _io_load(AUX2, row0, rm, rn, mask, stride_xm, 1, EVEN_MN)
            dact, silu = _gate_grad(g, ACTIVATION, FAST)
            dg = acc * u * dact
            du = acc * silu
            _io_store(C, dg, row0, col, rm, rn, mask, stride_cm, TMA_EPI, EVEN_MN, INTERPRET)
            _io_store(C2, du, row0, col, rm, rn, mask, stride_cm, TMA_EPI, EVEN_MN, INTERPRET)
            if HAS_DBIAS:
                _col_partials(dg, PART, 0, pid_m, rn, mask_m, mask_n, M, stride_p, PARTIAL_ROWS)
                _col_partials(du, PART, N, pid_m, rn, mask_m, mask_n, M, stride_p, PARTIAL_ROWS)
            if STORE_H:
                h = silu * u
                if HAS_DROPOUT:
                    h = h * tl.where(keep, drop_scale, 0.0)
                _io_store(HOUT, h, row0, col, rm, rn, mask, N, TMA_EPI, EVEN_MN, INTERPRET)
        else:
            if ACTIVATION != 0:
                pre = _io_load(AUX, row0, rm, rn, mask, stride_xm, 1, EVEN_MN)
                d, h = _act_grad(pre, ACTIVATION, FAST)
                acc = _chain(acc, d, pre, ACTIVATION)
                if STORE_H:
                    if HAS_DROPOUT:
                        h = h * tl.where(keep, drop_scale, 0.0)
                    _io_store(HOUT, h, row0, col, rm, rn, mask, N, TMA_EPI, EVEN_MN, INTERPRET)
            _io_store(C, acc, row0, col, rm, rn, mask, stride_cm, TMA_EPI, EVEN_MN, INTERPRET)
            if HAS_DBIAS:
                _col_partials(acc, PART, 0, pid_m, rn, mask_m, mask_n, M, stride_p, PARTIAL_ROWS)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if ACTIVATION >= 4:
                acc2 += tl.load(BIAS2 + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if ROUND_PRE:
            # An FFN's hidden activation, recomputed in backward from the stored (rounded)
            # pre-activation, must be the forward's: rounded as eager rounds a linear's output.
            acc = common.cast(acc, IN_DTYPE, INTERPRET).to(tl.float32)
            if ACTIVATION >= 4:
                acc2 = common.cast(acc2, IN_DTYPE, INTERPRET).to(tl.float32)
        if STORE_PRE:
            _io_store(AUX_OUT, acc, row0, col, rm, rn, mask, stride_xm, TMA_EPI, EVEN_MN, INTERPRET)
            if ACTIVATION >= 4:
                _io_store(AUX2_OUT, acc2, row0, col, rm, rn, mask, stride_xm, TMA_EPI, EVEN_MN, INTERPRET)
        if ACTIVATION == 4:
            y = acc * _sigmoid(acc, FAST) * acc2
        elif ACTIVATION == 5:
            y = _act(acc, 2, FAST) * acc2
        else:
            y = _act(acc, ACTIVATION, FAST)
        if HAS_DROPOUT:
            y = y * tl.where(keep, drop_scale, 0.0)
        if HAS_RESIDUAL:
            y += _io_load(RES, row0, rm, rn, mask, stride_rm, stride_rn, EVEN_MN)
        _io_store(C, y, row0, col, rm, rn, mask, stride_cm, TMA_EPI, EVEN_MN, INTERPRET)


# ---------------------------------------------------------------------------------------------
# main loops
# ---------------------------------------------------------------------------------------------

@triton.jit
def _loop_ptr(acc, acc2, A, B, B2, row0, col0, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
              DUAL_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += A[row0:, :K] @ B[:K, col0:] (and acc2 with B2 when DUAL_N), pointer loads.

    Rows/columns past the edge wrap around to the tile's first ones: loads need no masks along
    M and N (what those rows/columns produce is never stored), and the modulo keeps the
    compiler's contiguity facts, so loads stay vectorized and pipelined. Only K is masked,
    and not even K when it is a multiple of BLOCK_K.
    """
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ram = rm % (M - row0)
    rbn = rn % (N - col0)
    a_ptrs = A + row0.to(tl.int64) * stride_am + (ram[:, None] * stride_am + rk[None, :] * stride_ak)
    b_off = col0.to(tl.int64) * stride_bn + (rk[:, None] * stride_bk + rbn[None, :] * stride_bn)
    b_ptrs = B + b_off
    b2_ptrs = B2 + b_off
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = common.dot_step(a, b, acc, INTERPRET, PRECISION)
        if DUAL_N:
            if EVEN_K:
                b2 = tl.load(b2_ptrs)
            else:
                b2 = tl.load(b2_ptrs, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)
            acc2 = common.dot_step(a, b2, acc2, INTERPRET, PRECISION)
            b2_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, acc2


@triton.jit
def _loop_tma(acc, acc2, a_desc, b_desc, b2_desc, row0, col0, K, A_T: tl.constexpr, B_T: tl.constexpr,
              DUAL_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
              INTERPRET: tl.constexpr):
    """acc += A[row0:, :K] @ B[:K, col0:] (and acc2 with B2 when DUAL_N), TMA loads (zero
    padding past every edge). ``A_T``/``B_T``: the operand is stored transposed (its first
    stride is 1), so its descriptor covers the transpose and the tile is transposed back.

    At least one step, whatever K (the launcher sends no empty K here; a step past the edge
    reads zeros): Triton versions a flattened loop nest on whether its inner loop can be
    empty, and a trip count it could not prove positive compiled a second, wgmma-free copy of
    the tile loop (the epilogue alone, 4,536 instructions with bias + GELU) that never ran."""
    for k in range(0, tl.maximum(K, 1), BLOCK_K):
        if A_T:
            a = a_desc.load([k, row0]).T
        else:
            a = a_desc.load([row0, k])
        if B_T:
            b = b_desc.load([col0, k]).T
        else:
            b = b_desc.load([k, col0])
        acc = common.dot_step(a, b, acc, INTERPRET, PRECISION)
        if DUAL_N:
            if B_T:
                b2 = b2_desc.load([col0, k]).T
            else:
                b2 = b2_desc.load([k, col0])
            acc2 = common.dot_step(a, b2, acc2, INTERPRET, PRECISION)
    return acc, acc2


@triton.jit
def _operand_desc(X, rows, cols, stride_r, stride_c, TRANSPOSED: tl.constexpr, BR: tl.constexpr,
                  BC: tl.constexpr):
    """Descriptor of the (rows, cols) operand with (BR, BC) blocks, or of its transpose when
    it is stored transposed (stride_r == 1)."""
    if TRANSPOSED:
        return tl.make_tensor_descriptor(X, [cols, rows], [stride_c, 1], [BC, BR])
    else:
        return tl.make_tensor_descriptor(X, [rows, cols], [stride_r, 1], [BR, BC])


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles walk the column tiles together, so B's tiles stay in L2."""
    width = GROUP_M * num_pid_n
    first_m = (tile_id // width) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % width) % group_size
    pid_n = (tile_id % width) // group_size
    return pid_m, pid_n


# num_progs is 1 for a one-tile problem: Triton would specialize it as the constant 1, which
# compiles the persistent tile loop differently (spilling up to 1352 B at 64x128 / 4 warps on
# sm_90); kept a plain i32, as the compile check builds it.
@triton.jit(do_not_specialize=["num_progs"])
def _gemm_kernel(
    A, A2, B, B2, C, C2, BIAS, BIAS2, RES, AUX, AUX2, HOUT, PART, SEED, LA, LB, LB2,
    M, N, K, K1, R, num_progs,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_rm, stride_rn, stride_xm, stride_p,
    stride_lam, stride_lak, stride_lbk, stride_lbn,
    drop_thresh, drop_scale,
    ACTIVATION: tl.constexpr, ACT_GRAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, ROUND_PRE: tl.constexpr, STORE_H: tl.constexpr, HAS_DBIAS: tl.constexpr,
    ROWSUM: tl.constexpr, HAS_DROPOUT: tl.constexpr, DUAL: tl.constexpr, LORA: tl.constexpr,
    USE_TMA: tl.constexpr, TMA_EPI: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr, EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPI_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, PARTIAL_ROWS: tl.constexpr, PRECISION: tl.constexpr, FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Tiles of C = epilogue(A @ B) (+ A2 @ B2 when DUAL == 2), ``num_progs`` programs walking
    the tiles (persistent when fewer than the tiles).

    Shapes: A (M, K1), B (K1, N) and, DUAL == 2, A2 (M, K - K1), B2 (K - K1, N); DUAL == 1:
    B2 (K, N) into the second accumulator. LORA: a low-rank pair continuing the reduction
    before the epilogue, ``+ LA @ LB`` with LA (M, R), LB (R, N) (and ``LA @ LB2`` into the
    second accumulator when DUAL == 1), laid out as A and B (A_T, B_T) with strides of their own. C, C2, AUX, AUX2, RES (M, N), C/AUX/AUX2 with unit
    column stride (C2/AUX2: SwiGLU's up half, the row strides of C/AUX); HOUT (M, N)
    contiguous; PART: fp32 bias-gradient partials (``HAS_DBIAS``: (cdiv(M, PARTIAL_ROWS), N or
    2N); ``ROWSUM``: (cdiv(K, PARTIAL_ROWS), M)), row stride stride_p. See the module doc.
    """
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    DUAL_N: tl.constexpr = DUAL == 1
    if DUAL == 2:
        k_main = K1
    else:
        k_main = K
    if USE_TMA:
        a_desc = _operand_desc(A, M, k_main, stride_am, stride_ak, A_T, BLOCK_M, BLOCK_K)
        b_desc = _operand_desc(B, k_main, N, stride_bk, stride_bn, B_T, BLOCK_K, BLOCK_N)
        b2_desc = b_desc
        if DUAL == 1:
            b2_desc = _operand_desc(B2, K, N, stride_bk, stride_bn, B_T, BLOCK_K, BLOCK_N)
        if DUAL == 2:
            a2_desc = _operand_desc(A2, M, K - K1, stride_am, stride_ak, A_T, BLOCK_M, BLOCK_K)
            b2_desc = _operand_desc(B2, K - K1, N, stride_bk, stride_bn, B_T, BLOCK_K, BLOCK_N)
        if LORA:
            la_desc = _operand_desc(LA, M, R, stride_lam, stride_lak, A_T, BLOCK_M, BLOCK_K)
            lb_desc = _operand_desc(LB, R, N, stride_lbk, stride_lbn, B_T, BLOCK_K, BLOCK_N)
            lb2_desc = lb_desc
            if DUAL == 1:
                lb2_desc = _operand_desc(LB2, R, N, stride_lbk, stride_lbn, B_T, BLOCK_K, BLOCK_N)

    # The epilogue's slices: with dropout 32 columns (half of one Philox call's 64 columns:
    # its words and mask stay live beside the slice), else EPI_SPLIT of the tile.
    if HAS_DROPOUT:
        LEAF_W: tl.constexpr = 32
    else:
        LEAF_W: tl.constexpr = BLOCK_N // EPI_SPLIT
    c_out = C
    c2_out = C2
    aux_out = AUX
    aux2_out = AUX2
    hout = HOUT
    if TMA_EPI:
        c_out = tl.make_tensor_descriptor(C, [M, N], [stride_cm, 1], [BLOCK_M, LEAF_W])
        if ACT_GRAD and ACTIVATION >= 4:
            c2_out = tl.make_tensor_descriptor(C2, [M, N], [stride_cm, 1], [BLOCK_M, LEAF_W])
        if STORE_PRE:
            aux_out = tl.make_tensor_descriptor(AUX, [M, N], [stride_xm, 1], [BLOCK_M, LEAF_W])
            if ACTIVATION >= 4:
                aux2_out = tl.make_tensor_descriptor(AUX2, [M, N], [stride_xm, 1], [BLOCK_M, LEAF_W])
        if STORE_H:
            hout = tl.make_tensor_descriptor(HOUT, [M, N], [N, 1], [BLOCK_M, LEAF_W])
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    in_dtype = A.dtype.element_ty
    FAST: tl.constexpr = C.dtype.element_ty != tl.float32

    # The epilogue recomputes its tile from its own counter: no value lives from the
    # prologue to the epilogue of the flattened loop (as in Triton's persistent tutorial).
    tile_c = start - num_progs
    for tile_id in tl.range(start, num_tiles, num_progs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if DUAL_N:
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc2 = acc
        if USE_TMA:
            acc, acc2 = _loop_tma(acc, acc2, a_desc, b_desc, b2_desc, row0, col0, k_main, A_T, B_T,
                                  DUAL_N, BLOCK_K, PRECISION, INTERPRET)
            if DUAL == 2:
                acc, acc2 = _loop_tma(acc, acc2, a2_desc, b2_desc, b2_desc, row0, col0, K - K1, A_T,
                                      B_T, False, BLOCK_K, PRECISION, INTERPRET)
            if LORA:
                acc, acc2 = _loop_tma(acc, acc2, la_desc, lb_desc, lb2_desc, row0, col0, R, A_T, B_T,
                                      DUAL_N, BLOCK_K, PRECISION, INTERPRET)
        else:
            acc, acc2 = _loop_ptr(acc, acc2, A, B, B2, row0, col0, M, N, k_main, stride_am, stride_ak,
                                  stride_bk, stride_bn, DUAL_N, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
                                  PRECISION, INTERPRET)
            if DUAL == 2:
                acc, acc2 = _loop_ptr(acc, acc2, A2, B2, B2, row0, col0, M, N, K - K1, stride_am,
                                      stride_ak, stride_bk, stride_bn, False, EVEN_K, BLOCK_M, BLOCK_N,
                                      BLOCK_K, PRECISION, INTERPRET)
            if LORA:  # R is padded to 16, not to BLOCK_K: masked K
                acc, acc2 = _loop_ptr(acc, acc2, LA, LB, LB2, row0, col0, M, N, R, stride_lam, stride_lak,
                                      stride_lbk, stride_lbn, DUAL_N, False, BLOCK_M, BLOCK_N, BLOCK_K,
                                      PRECISION, INTERPRET)

        # ---- epilogue, on the fp32 tile in registers ----------------------------------------
        tile_c += num_progs
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        if HAS_DROPOUT:
            GROUPS: tl.constexpr = BLOCK_N // 64
            pieces = _pieces(acc, GROUPS)
            pieces2 = _pieces(acc2, GROUPS)
            rows64 = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
            for i in tl.static_range(GROUPS):
                c64 = col0 + i * 64
                words = _drop_words(seed, rows64, c64)
                halves = _pieces(pieces[i], 2)
                halves2 = _pieces(pieces2[i], 2)
                for j in tl.static_range(2):
                    _leaf(halves[j], halves2[j], _keep32(words[2 * j], words[2 * j + 1], drop_thresh),
                          row0, c64 + 32 * j, M, N, pid_m,
                          c_out, c2_out, BIAS, BIAS2, RES, AUX, AUX2, aux_out, aux2_out, hout, PART,
                          stride_cm, stride_rm, stride_rn, stride_xm, stride_p, drop_scale,
                          in_dtype, ACTIVATION, ACT_GRAD, HAS_BIAS, HAS_RESIDUAL, STORE_PRE, ROUND_PRE, STORE_H,
                          HAS_DBIAS, HAS_DROPOUT, TMA_EPI, EVEN_MN, PARTIAL_ROWS, FAST, INTERPRET)
        else:
            pieces = _pieces(acc, EPI_SPLIT)
            pieces2 = _pieces(acc2, EPI_SPLIT)
            for i in tl.static_range(EPI_SPLIT):
                _leaf(pieces[i], pieces2[i], 0, row0, col0 + i * LEAF_W, M, N, pid_m,
                      c_out, c2_out, BIAS, BIAS2, RES, AUX, AUX2, aux_out, aux2_out, hout, PART,
                      stride_cm, stride_rm, stride_rn, stride_xm, stride_p, drop_scale,
                      in_dtype, ACTIVATION, ACT_GRAD, HAS_BIAS, HAS_RESIDUAL, STORE_PRE, ROUND_PRE, STORE_H,
                      HAS_DBIAS, HAS_DROPOUT, TMA_EPI, EVEN_MN, PARTIAL_ROWS, FAST, INTERPRET)
        if ROWSUM:
            # Row sums of A per PARTIAL_ROWS columns (the bias gradient of dW = dY.T @ X): the
            # tiles of one row block share its column chunks, one in num_pid_n each.
            rm = tl.arange(0, BLOCK_M)
            rk = tl.arange(0, PARTIAL_ROWS)
            mask_m = rm < M - row0
            a_rows = A + row0.to(tl.int64) * stride_am + rm[:, None] * stride_am
            p_row = PART + pid_n.to(tl.int64) * stride_p + row0
            for c in range(pid_n, tl.cdiv(K, PARTIAL_ROWS), num_pid_n):
                kk = c * PARTIAL_ROWS + rk
                blk = tl.load(a_rows + kk.to(tl.int64)[None, :] * stride_ak,
                              mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
                tl.store(p_row + rm, tl.sum(blk.to(tl.float32), axis=1), mask=mask_m)
                p_row += num_pid_n * stride_p


# ---------------------------------------------------------------------------------------------
# elementwise kernels: activation gradient, bias-gradient reduction, dropout mask (tests)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _act_grad_kernel(
    G, PRE, PRE2, DPRE, DPRE2, PART, HOUT, SEED,
    M, N, stride_gm, stride_gn, stride_pm, stride_pn, stride_dm, drop_thresh, drop_scale,
    ACTIVATION: tl.constexpr, STORE_DPRE: tl.constexpr, HAS_DBIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_H: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dPre = G * keep / (1 - p) * act'(PRE) on (BLOCK_M, 64) tiles (the keep factor, the GEMM
    epilogue's regenerated dropout mask, only with ``HAS_DROPOUT``); PART row pid_m gets its
    column sums. With ``ACTIVATION == 0`` and ``STORE_DPRE`` off this is the bias gradient of
    G alone. BLOCK_M equals PARTIAL_ROWS, so PART has the GEMM epilogue's layout.

    SwiGLU and GeGLU (``ACTIVATION >= 4``; G the gradient of act(gate) * up): PRE and PRE2 are the gate
    and up pre-activations (PRE's strides), DPRE and DPRE2 get dGate and dUp (row stride
    stride_dm, as dPre: the halves of one (M, 2N) buffer), PART
    (cdiv(M, BLOCK_M), 2N) their column sums side by side, as the GEMM epilogue lays them out.

    ``STORE_H``: HOUT ((M, N) contiguous) gets the hidden activation recomputed from PRE (and
    PRE2), with the forward's dropout: the GEMM epilogue's STORE_H, for a product computed
    elsewhere (``fused_block.dispatch``'s cuBLAS candidate of an FFN's dH GEMM).
    """
    pid_m = tl.program_id(0)
    c64 = tl.program_id(1) * 64
    rm = tl.arange(0, BLOCK_M)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    mask_m = rm < M - row0
    G += row0 * stride_gm
    PRE += row0 * stride_pm
    PRE2 += row0 * stride_pm
    DPRE += row0 * stride_dm
    DPRE2 += row0 * stride_dm
    HOUT += row0 * N
    FAST: tl.constexpr = DPRE.dtype.element_ty != tl.float32
    if ACTIVATION >= 4:
        PART_W = 2 * N
    else:
        PART_W = N
    if HAS_DROPOUT:
        words = _drop_words(tl.load(SEED), row0 + rm, c64)
    for j in tl.static_range(4):
        rn = c64 + 16 * j + tl.arange(0, 16)
        mask = mask_m[:, None] & (rn < N)[None, :]
        d = tl.load(G + rm[:, None] * stride_gm + rn[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = _keep(words[j], drop_thresh)
            d = d * tl.where(keep, drop_scale, 0.0)
        offs = rm[:, None] * stride_pm + rn[None, :] * stride_pn
        if ACTIVATION >= 4:
            g = tl.load(PRE + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(PRE2 + offs, mask=mask, other=0.0).to(tl.float32)
            dact, act = _gate_grad(g, ACTIVATION, FAST)
            du = d * act
            d = d * u * dact
            h = act * u
            tl.store(DPRE2 + rm[:, None] * stride_dm + rn[None, :], common.cast(du, DPRE2.dtype.element_ty,
                                                                                  INTERPRET), mask=mask)
            if HAS_DBIAS:
                tl.store(PART + pid_m.to(tl.int64) * PART_W + N + rn, tl.sum(du, axis=0), mask=rn < N)
        elif ACTIVATION != 0:
            pre = tl.load(PRE + offs, mask=mask, other=0.0)
            dact, h = _act_grad(pre.to(tl.float32), ACTIVATION, FAST)
            d = _chain(d, dact, pre.to(tl.float32), ACTIVATION)
        if STORE_H:
            if HAS_DROPOUT:
                h = h * tl.where(keep, drop_scale, 0.0)
            tl.store(HOUT + rm[:, None] * N + rn[None, :], common.cast(h, HOUT.dtype.element_ty, INTERPRET),
                     mask=mask)
        if STORE_DPRE:
            tl.store(DPRE + rm[:, None] * stride_dm + rn[None, :], common.cast(d, DPRE.dtype.element_ty, INTERPRET),
                     mask=mask)
        if HAS_DBIAS:
            tl.store(PART + pid_m.to(tl.int64) * PART_W + rn, tl.sum(d, axis=0), mask=rn < N)


@triton.jit
def _epilogue_kernel(
    PRE, PRE2, RES, C, SEED,
    M, N, stride_pm, stride_rm, stride_rn, stride_cm, drop_thresh, drop_scale,
    ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``C = dropout(act(PRE)) + RES`` on (BLOCK_M, 64) tiles: the forward epilogue of a product
    computed elsewhere (cuBLAS, ``fused_block.dispatch``), PRE its output in the input dtype.
    Gated (``ACTIVATION >= 4``): ``act(PRE) * PRE2`` (SwiGLU's SiLU, GeGLU's tanh GELU of the
    gate; PRE2 with PRE's strides). The dropout mask is the GEMM epilogue's (the same Philox
    words per (seed, row, column)), so the backward regenerates it either way."""
    pid_m = tl.program_id(0)
    c64 = tl.program_id(1) * 64
    rm = tl.arange(0, BLOCK_M)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    mask_m = rm < M - row0
    PRE += row0 * stride_pm
    PRE2 += row0 * stride_pm
    RES += row0 * stride_rm
    C += row0 * stride_cm
    FAST: tl.constexpr = C.dtype.element_ty != tl.float32
    if HAS_DROPOUT:
        words = _drop_words(tl.load(SEED), row0 + rm, c64)
    for j in tl.static_range(4):
        rn = c64 + 16 * j + tl.arange(0, 16)
        mask = mask_m[:, None] & (rn < N)[None, :]
        offs = rm[:, None] * stride_pm + rn[None, :]
        x = tl.load(PRE + offs, mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION == 4:
            y = x * _sigmoid(x, FAST) * tl.load(PRE2 + offs, mask=mask, other=0.0).to(tl.float32)
        elif ACTIVATION == 5:
            y = _act(x, 2, FAST) * tl.load(PRE2 + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            y = _act(x, ACTIVATION, FAST)
        if HAS_DROPOUT:
            y = tl.where(_keep(words[j], drop_thresh), y * drop_scale, 0.0)
        if HAS_RESIDUAL:
            y += tl.load(RES + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=mask,
                         other=0.0).to(tl.float32)
        tl.store(C + rm[:, None] * stride_cm + rn[None, :], common.cast(y, C.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _reduce_cols(P, O, R, N, blk, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """O[cols] = sum over the R rows of P (R, N) fp32, in a fixed order, rounded to O's dtype."""
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for r in range(0, R, BLOCK_R):
        rows = r + rr
        acc += tl.load(P + rows.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(rows < R)[:, None] & (cols < N)[None, :], other=0.0)
    tl.store(O + cols, common.cast(tl.sum(acc, axis=0), O.dtype.element_ty, INTERPRET), mask=cols < N)


@triton.jit
def _reduce_kernel(P1, O1, R1, N1, P2, O2, R2, N2, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Bias gradients from fp32 partials: O1 = colsum(P1) and O2 = colsum(P2) (when N2 > 0),
    one launch for both of an FFN's biases."""
    pid = tl.program_id(0)
    nb1 = tl.cdiv(N1, BLOCK_N)
    if pid < nb1:
        _reduce_cols(P1, O1, R1, N1, pid, BLOCK_R, BLOCK_N, INTERPRET)
    else:
        _reduce_cols(P2, O2, R2, N2, pid - nb1, BLOCK_R, BLOCK_N, INTERPRET)


@triton.jit
def _dropout_mask_kernel(SEED, OUT, M, N, drop_thresh, BLOCK_M: tl.constexpr):
    """The keep-mask (int8, (M, N) contiguous) the epilogues use, on (BLOCK_M, 64) tiles."""
    rm = tl.arange(0, BLOCK_M)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    c64 = tl.program_id(1) * 64
    words = _drop_words(tl.load(SEED), row0 + rm, c64)
    for j in tl.static_range(4):
        rn = c64 + 16 * j + tl.arange(0, 16)
        mask = (rm < M - row0)[:, None] & (rn < N)[None, :]
        tl.store(OUT + (row0 + rm)[:, None] * N + rn[None, :], _keep(words[j], drop_thresh).to(tl.int8),
                 mask=mask)


# ---------------------------------------------------------------------------------------------
# config tables: one per architecture, dtype class and main-loop shape
# ---------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, EPI_SPLIT), in the order they are tried; the
# first is taken without timing when FUSED_BLOCK_TUNE=0.
#
# sm_90, fp16/bf16: Triton's 09-persistent-matmul and inductor's persistent TMA configs
# (128x256x64 / 8 warps / 3-4 stages, 128x128x64-128 / 8 warps / 3-5 stages); 64-row tiles for
# small M (decoding). EPI_SPLIT is the split of epilogues with inputs or several outputs: 64-
# column slices of the 128x256 accumulator (128x128: halves) keep their temporaries next to the
# accumulator's 128 registers per thread (the residual + saved pre-activation forward: 178-215
# registers; 128-column slices reach 252-255). A simple epilogue (see _epi_split) takes
# 128-column slices, as the tutorial's EPILOGUE_SUBTILE.
# SwiGLU's gate + up (two accumulators) doubles the accumulator: 128x128 per projection is the
# 128x256 footprint.
# fp32 "tf32": half the K of the 16-bit configs (4-byte elements, same shared memory per stage);
# sm_90's 64x64 tile on 8 warps: the operands' rounding to TF32 (common.to_tf32) passes them
# through registers, and at 4 warps the unaligned LoRA forward spilled 16 B (255 registers).
# fp32 "ieee": FMA products (no tensor cores): 64x64 tiles over 8 warps, BLOCK_K 16, to stay
# spill-free (4 warps spill with dropout).
# sm_80: the same tiles within 164 KB of shared memory, one program per tile, cp.async
# pipelining of pointer loads.
CONFIGS = {
    (90, "16", False): ((128, 256, 64, 8, 3, 4), (128, 256, 64, 8, 4, 4), (128, 128, 64, 8, 4, 2),
                        (128, 128, 128, 8, 3, 2), (128, 128, 64, 8, 5, 2), (64, 128, 64, 4, 4, 2),
                        (64, 64, 64, 4, 4, 1)),
    (90, "16", True): ((128, 128, 64, 8, 3, 2), (128, 128, 64, 8, 4, 2), (64, 128, 64, 4, 4, 1),
                       (64, 64, 64, 4, 4, 1)),
    (90, "tf32", False): ((128, 128, 32, 8, 3, 2), (128, 128, 32, 8, 4, 2), (64, 64, 32, 8, 4, 1)),
    (90, "tf32", True): ((128, 64, 32, 8, 3, 1), (64, 64, 32, 4, 3, 1)),
    (90, "ieee", False): ((64, 64, 16, 8, 2, 1),),
    (90, "ieee", True): ((64, 64, 16, 8, 2, 1),),
    (80, "16", False): ((128, 256, 64, 8, 3, 4), (128, 128, 64, 8, 3, 2), (64, 128, 64, 4, 4, 2),
                        (64, 64, 64, 4, 4, 1)),
    (80, "16", True): ((128, 128, 32, 8, 3, 2), (64, 128, 32, 4, 3, 1), (64, 64, 64, 4, 3, 1)),
    (80, "tf32", False): ((128, 128, 32, 8, 3, 2), (64, 64, 32, 4, 3, 1)),
    (80, "tf32", True): ((128, 64, 32, 8, 3, 1), (64, 64, 32, 4, 3, 1)),
    (80, "ieee", False): ((64, 64, 16, 8, 2, 1),),
    (80, "ieee", True): ((64, 64, 16, 8, 2, 1),),
}
# sm_90 warp-specialized candidates, opt-in (FUSED_BLOCK_WS=1, common.WARP_SPECIALIZE: they
# have not yet run on a GPU): then tried first where a launch can run them (the CUDA tuner
# keeps them where they time faster; FUSED_BLOCK_TUNE=0 takes them). The
# unflattened tile loop with ``tl.range(..., warp_specialize=True)`` on device descriptors, as
# Triton 3.6's 09-persistent-matmul pairs them on Hopper. Its Hopper pass applies at 4 warps
# (one warpgroup, 8 warps compile unspecialized): a producer warpgroup issues the TMA loads,
# two consumer warpgroups split the tile's rows. Its data partition rejects the epilogue's
# column slices (EPI_SPLIT 1), the bias-gradient sums, a second K loop, and spilled the residual
# + pre-activation forward (544 B), so only simple epilogues with one K loop take them
# (_ws_eligible). Shared memory: stages + the unsliced output tile (128x256x64: 3 stages fit).
WS_CONFIGS = {(90, "16"): ((128, 256, 64, 4, 3, 1), (128, 128, 64, 4, 4, 1)),
              (90, "tf32"): ((128, 128, 32, 4, 3, 1),)}
# The interpreter runs one config. Its cost is per program and per op (nested jit calls
# included) rather than per element, so a large tile with an unsliced epilogue is quickest;
# tests swap in other tiles to cover the sliced epilogue and multi-tile persistent grids.
INTERPRETER_CONFIG = (256, 256, 128, 4, 1, 1)
# Tests set this to "tma" or "pointer" to force the main loop and epilogue path (the
# interpreter runs tensor descriptors); None chooses by architecture and alignment.
FORCE_PATH = None
ACT_GRAD_BLOCK_M = PARTIAL_ROWS
REDUCE_BLOCK = (8, 256)
# sm_90's pointer main loop, for operands a descriptor cannot read (rows not 16-byte aligned),
# per dtype class: element-wise loads hold a 64-bit address per element, and the 16-bit
# table's tiles spilled 56-1560 B there (all of them, unaligned sizes and strides). One tile
# per loop trip (no flattened loop, which spilled even these tiles); 16-bit BLOCK_K 32
# (BLOCK_K 16 spilled dact 80 B); tf32 8 warps (4 warps spilled dropout 32 B).
_FALLBACK_90_CFGS = {"16": (64, 64, 32, 4, 3, 1), "tf32": (64, 64, 32, 8, 3, 1), "ieee": (64, 64, 16, 8, 2, 1)}  # (rows, columns) per step of the partial-sum reduction

_CACHE = common.ConfigCache("matmul")
_SMEM = {}


def _simple_epilogue(act_grad, residual, store_pre, dropout, dual):
    """An epilogue that reads nothing but the bias and stores one output: bias, activation,
    the plain GEMMs (ROWSUM's row sums run after it)."""
    return not (act_grad or residual or store_pre or dropout or dual == 1)


def _epi_split(cfg, simple, tma_epi):
    """The epilogue's column slices for a table config: the table's EPI_SPLIT, or for a simple
    epilogue stored through descriptors slices of up to 128 columns (the slices' TMA stores
    and barriers are serialized: a 128x256 tile stores twice, as Triton's persistent tutorial
    does, instead of 4 or 8 times; a split it has already is kept)."""
    bm, bn, bk, warps, stages, split = cfg
    return min(split, max(1, bn // 128)) if simple and tma_epi else split


def _ws_eligible(simple, dual, use_tma, tma_epi, fp32, a_t, b_t):
    """Launches the warp-specialized candidates can run (see WS_CONFIGS); fp32 (TF32) only with
    both operands K-major (x @ W.T): other layouts compiled to a wgmma ptxas rejects."""
    return simple and dual == 0 and use_tma and tma_epi and (not fp32 or (not a_t and b_t))


def _config(cfg, simple=False, tma_epi=False, ws=False):
    bm, bn, bk, warps, stages, _ = cfg
    return common.Config.of(num_warps=warps, num_stages=stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                            EPI_SPLIT=_epi_split(cfg, simple, tma_epi), WARP_SPECIALIZE=ws)


# (key, simple epilogue, descriptor stores) -> the table's Configs.
_TABLES = {(key, simple, tma_epi): tuple(_config(c, simple, tma_epi) for c in cfgs)
           for key, cfgs in CONFIGS.items() for simple in (False, True) for tma_epi in (False, True)}
_WS_TABLES = {kind: tuple(_config(c, True, True, ws=True) for c in cfgs) for (_, kind), cfgs in WS_CONFIGS.items()}
_FALLBACK_90 = {kind: _config(c) for kind, c in _FALLBACK_90_CFGS.items()}


def smem_bytes(cfg, arch, elem_size, dual_n=False, outputs=1, simple=False):
    """Shared memory a config needs, as the compile check reports it: sm_90 keeps ``stages``
    operand buffers (TMA) plus the staging of the epilogue's ``outputs`` TMA stores (one slice
    each, see _epi_split; 1 KB of barriers), sm_80 ``stages - 1`` (cp.async)."""
    bm, bn, bk, _, stages, _ = cfg
    per_stage = (bm * bk + (2 if dual_n else 1) * bk * bn) * elem_size
    if arch != 90:
        return (stages - 1) * per_stage
    staging = outputs * bm * (bn // _epi_split(cfg, simple, True)) * elem_size
    return stages * per_stage + staging + 1024


def _smem_limit(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMEM:
        props = torch.cuda.get_device_properties(index)
        _SMEM[index] = getattr(props, "shared_memory_per_block_optin", 99 * 1024)
    return _SMEM[index]


def _acc_regs(cfg):
    bm, bn, _, warps, _, _ = cfg
    return bm * bn // (32 * warps)


def _light(cfg):
    """At most 64 accumulator registers per thread: room for a heavy epilogue."""
    return _acc_regs(cfg) <= 64


def _heavy(act_grad, activation, dropout):
    """Epilogues whose live values do not fit beside a 128-register accumulator: dropout's
    Philox words and masks (the 128x256 sm_90 forward spilled 64-240 B with STORE_PRE and an
    activation), and SwiGLU's backward (two loads and three stores)."""
    return dropout or act_grad and activation in GATED


def _lora_configs(arch, dual_n, n):
    """The indices in a table of n configs a LoRA launch may take (see _LORA_VARIANTS)."""
    return (n - 1,) if arch == 80 and dual_n else (0, n - 1)


def _candidates(arch, dtype, precision, dual_n, heavy, M, N, device, use_tma=True, tma_epi=True, simple=False,
                outputs=1, ws=False, lora=False):
    """The table's configs this launch can use: light ones for a heavy epilogue, those that fit
    the device's shared memory, no 128-row tiles for M <= 64 (decoding) nor 256-column tiles
    for N <= 128. Tables end with their smallest tile, the fallback. ``simple``: the epilogue's
    slices (_epi_split); ``outputs``: its TMA stores per slice; ``ws``: the launch may run the
    warp-specialized candidates (first, with FUSED_BLOCK_WS=1 only); ``lora``: a LoRA
    launch, which takes the table's first and last configs only (what the compile check builds).

    sm_90 with a tensor a descriptor cannot read (rows not 16-byte aligned): pointer loads
    run their own tile (_FALLBACK_90_CFGS), TMA loads with pointer stores the table's
    smallest. The pointer epilogue's element-wise stores spilled the larger tiles (128x128
    dact 40 B, 64x128 dswiglu 72 B, 128x256 forward 8 B with N unaligned)."""
    kind = precision if dtype == torch.float32 else "16"
    key = (arch, kind, dual_n)
    if arch == 90 and not (use_tma and tma_epi):
        return [_FALLBACK_90[kind] if not use_tma else _TABLES[(key, simple, False)][-1]]
    table = _TABLES[(key, simple, tma_epi)]
    raw = CONFIGS[key]
    limit = _smem_limit(device)
    elem = 4 if dtype == torch.float32 else 2

    def fits(c):
        return smem_bytes(c, arch, elem, dual_n, outputs, simple) <= limit

    def sized(c):
        return not (M <= 64 and c[0] > 64) and not (N <= 128 and c[1] > 128)

    usable = [i for i, c in enumerate(raw) if (not heavy or _light(c)) and fits(c)
              and (not lora or i in _lora_configs(arch, dual_n, len(raw)))] or [len(raw) - 1]
    chosen = [table[i] for i in ([i for i in usable if sized(raw[i])] or usable[-1:])]
    if ws and common.WARP_SPECIALIZE and (arch, kind) in WS_CONFIGS:
        chosen[:0] = [cfg for c, cfg in zip(WS_CONFIGS[(arch, kind)], _WS_TABLES[kind]) if fits(c) and sized(c)]
    return chosen


# ---------------------------------------------------------------------------------------------
# host side: the launch path
# ---------------------------------------------------------------------------------------------

def _desc_ok(t, strides=None):
    """Can ``t`` (2-D) be read through a TMA descriptor: one unit stride, 16-byte aligned base
    and other stride. Returns (ok, transposed), transposed meaning its first stride is 1.
    ``strides``: ``t.stride()`` where the caller has read it."""
    s0, s1 = t.stride() if strides is None else strides
    if s1 == 1:
        lead, transposed = s0, False
    elif s0 == 1:
        lead, transposed = s1, True
    else:
        return False, False
    return lead > 0 and t.data_ptr() % 16 == 0 and (lead * t.element_size()) % 16 == 0, transposed


def _mat(t):
    """``(rows, cols), (row stride, col stride)`` of a GEMM operand (:func:`common.rows`)."""
    return common.rows(t, "a GEMM operand")


def _rows_ok(t, strides=None):
    """Epilogue tensors: unit column stride, 16-byte aligned base and row stride."""
    s0, s1 = t.stride() if strides is None else strides
    return s1 == 1 and t.data_ptr() % 16 == 0 and (s0 * t.element_size()) % 16 == 0


def _laid_out(t, transposed):
    """``t`` (2-D) stored as a descriptor reads it: its first stride 1 when ``transposed``,
    else its second; 16-byte aligned. A copy where it is not (the small LoRA operands)."""
    ok, t_t = _desc_ok(t)
    if ok and t_t == transposed:
        return t
    return t.t().contiguous().t() if transposed else t.contiguous()


def drop_params(dropout_p):
    """The kernels' dropout arguments: the 31-bit keep threshold and the 1 / (1 - p) scale."""
    return min(int(dropout_p * 2.0**31), 2**31 - 1), 1.0 / (1.0 - dropout_p)


def _has_dropout(seed, dropout_p):
    if not dropout_p:
        return False
    if seed is None or seed.numel() != 1 or seed.dtype != torch.int64:
        raise ValueError("dropout needs a one-element int64 seed tensor")
    return True


_STRIDE_LIMIT = 2**31 // 256  # strides from 2^23 elements: int32 in-tile offsets could overflow
_FP32 = torch.float32


def gemm(a, b, c, *, a2=None, b2=None, c2=None, bias=None, bias2=None, residual=None, aux=None,
         aux2=None, hout=None, part=None, seed=None, dropout_p=0.0, activation=0, act_grad=False,
         store_pre=False, round_pre=False, rowsum=False, lora_a=None, lora_b=None, lora_b2=None, transpose_a=False,
         transpose_b=False):
    """Launch ``c = epilogue(a @ b)``; see ``_gemm_kernel`` for the roles of the arguments.

    ``transpose_a`` / ``transpose_b``: ``a`` is given as (K, M) (``a2`` must be None) / ``b``
    (and ``b2``) as (N, K), and their transposes are the operands: the launch reads the tensor
    with its strides swapped, as it would read the ``.t()`` view (the same pointer, dtype and
    alignment), without making the view (a linear's ``x @ W.T``, a weight gradient's
    ``dY.T @ X``). a, b, c, residual and aux may also be contiguous tensors of another rank than
    2, read as the (rows, last dim) matrix of their rows (:func:`_mat`): a linear's activations
    in the caller's shape, with no flattening view.

    ``lora_a`` (M, R) with ``lora_b`` (R, N) (and ``lora_b2`` for SwiGLU's up half): a LoRA
    update ``lora_a @ lora_b`` joining the reduction before the epilogue (R a multiple of 16;
    laid out as a and b here, copies of these small operands where they are not).

    ``b2`` with ``a2``: the dual-K product ``a @ b + a2 @ b2``; ``b2`` alone: SwiGLU's up
    projection (``activation == SWIGLU``, forward). Strides: a, b, a2, b2, residual any
    (a2/b2 with a/b's strides); c, c2, aux, aux2 unit column stride, c2/aux2 with c/aux's row
    stride; hout contiguous. ``round_pre``: the pre-activation rounded to a's dtype before the
    activation (an FFN's first layer, whose backward recomputes the hidden activation from the
    stored pre-activation). ``part`` (fp32): with ``act_grad`` the column sums of the gradient
    per PARTIAL_ROWS rows, with ``rowsum`` the row sums of a per PARTIAL_ROWS columns. Sizes
    past 2^23 in a stride are rejected (int32 in-tile offsets).
    """
    shape = a.shape  # 2-D, or rows of another rank (_mat, inline for 2-D: a call per operand shows)
    (M, K1), sa = (shape, a.stride()) if len(shape) == 2 else _mat(a)
    if transpose_a:
        if a2 is not None:
            raise ValueError("matmul: transpose_a takes no a2")
        M, K1, sa = K1, M, sa[::-1]
    shape = b.shape
    (b_rows, N), sb = (shape, b.stride()) if len(shape) == 2 else _mat(b)
    if transpose_b:
        N, sb = b_rows, sb[::-1]
    if M == 0 or N == 0:
        return
    if bias is not None:  # read at unit stride (common.unit)
        bias, bias2 = common.unit(bias), common.unit(bias2)
    if a2 is None and b2 is None:
        K, dual = K1, 0
    else:
        K = K1 + (a2.shape[1] if a2 is not None else 0)
        dual = 2 if a2 is not None else 1
        if dual == 1 and (bias is None) != (bias2 is None):  # the kernel would read c as the missing one
            raise ValueError("matmul: the up projection (b2) takes bias2 exactly when bias is given")
        # The second operands are read with the first ones' strides: equal layouts (the two
        # weights of a SwiGLU stored differently are the rare case that pays for a copy).
        if b2.stride() != b.stride():
            b, b2 = b.contiguous(), b2.contiguous()
            sb = b.stride()[::-1] if transpose_b else b.stride()
        if dual == 2 and a2.stride() != a.stride():
            a, a2 = a.contiguous(), a2.contiguous()
            sa = a.stride()
    has_dropout = bool(dropout_p) and _has_dropout(seed, dropout_p)
    lora = lora_a is not None
    R = lora_a.shape[1] if lora else 0
    sr = (0, 0) if residual is None else residual.stride() if residual.dim() == 2 else _mat(residual)[1]
    sc = c.stride() if c.dim() == 2 else _mat(c)[1]
    sam, sak = sa
    sbk, sbn = sb
    srm, srn = sr
    if (max(sam, sak, sbk, sbn, srm, srn, sc[0]) >= _STRIDE_LIMIT
            or min(sam, sak, sbk, sbn, srm, srn) <= -_STRIDE_LIMIT):
        raise ValueError("matmul: a stride exceeds 2^23 elements; make the operand contiguous")
    device = a.device
    arch = common.arch(device)
    dtype = a.dtype
    precision = common.fp32_precision() if dtype is _FP32 else "tf32"

    use_tma = tma_epi = False
    a_t = b_t = False
    if (FORCE_PATH != "pointer" and (arch == 90 or arch == 0) and K1 > 0
            and (dual != 2 or K > K1)):
        ok_a, a_t = _desc_ok(a, sa)
        ok_b, b_t = _desc_ok(b, sb)
        use_tma = ok_a and ok_b
        if dual:
            ok_a2, a2_t = _desc_ok(a2) if a2 is not None else (True, a_t)
            ok_b2, b2_t = _desc_ok(b2, b2.stride()[::-1] if transpose_b else None)
            use_tma = use_tma and ok_a2 and ok_b2 and a2_t == a_t and b2_t == b_t
        if lora and use_tma:  # the low-rank pair in a's and b's layouts, for descriptors
            lora_a = _laid_out(lora_a, a_t)
            lora_b, lora_b2 = _laid_out(lora_b, b_t), None if lora_b2 is None else _laid_out(lora_b2, b_t)
        tma_epi = _rows_ok(c, sc) and (residual is None or _rows_ok(residual, sr))
        for t in (c2, aux, aux2, hout):  # every other epilogue tensor (a loop: no list per call)
            if tma_epi and t is not None:
                tma_epi = _rows_ok(t, _mat(t)[1])
        if FORCE_PATH == "tma" and not (use_tma and tma_epi):
            raise ValueError("matmul: FORCE_PATH='tma' with operands a descriptor cannot read")
    if lora and lora_b2 is not None and lora_b2.stride() != lora_b.stride():
        lora_b, lora_b2 = lora_b.contiguous(), lora_b2.contiguous()
    # The launch's flags as bits (_constexprs reads them back): activation code (3 bits), then ACT_GRAD,
    # HAS_BIAS, HAS_RESIDUAL, STORE_PRE, ROUND_PRE, STORE_H, HAS_DBIAS, ROWSUM, HAS_DROPOUT (bits 3-11), DUAL
    # (2 bits at 12), LORA, USE_TMA, TMA_EPI, A_T, B_T (bits 14-18).
    flags = (activation | act_grad << 3 | (bias is not None) << 4 | (residual is not None) << 5 | store_pre << 6
             | round_pre << 7 | (hout is not None) << 8 | (part is not None and act_grad) << 9 | rowsum << 10
             | has_dropout << 11 | dual << 12 | lora << 14 | use_tma << 15 | tma_epi << 16 | a_t << 17 | b_t << 18)
    key = (arch, dtype, c.dtype, precision, min(common.next_pow2(M), 65536), N, K, flags)  # flat: cheap to hash
    dummy = c
    args = (a, a2 if a2 is not None else a, b, b2 if b2 is not None else b, c, c2 if c2 is not None else c,
            bias if bias is not None else dummy, bias2 if bias2 is not None else dummy,
            residual if residual is not None else dummy, aux if aux is not None else dummy,
            aux2 if aux2 is not None else dummy, hout if hout is not None else dummy,
            part if part is not None else dummy, seed if has_dropout else dummy,
            lora_a if lora else a, lora_b if lora else b, lora_b2 if lora_b2 is not None else (lora_b if lora else b),
            M, N, K, K1, R)
    tail = (sam, sak, sbk, sbn, sc[0], srm, srn,
            _mat(aux)[1][0] if aux is not None else 0, part.stride(0) if part is not None else 0,
            *(lora_a.stride() if lora else (0, 0)), *(lora_b.stride() if lora else (0, 0)),
            *(drop_params(dropout_p) if has_dropout else (0, 1.0)))
    n_sm = common.sm_count(device)
    if use_tma or tma_epi:
        common.scratch_allocator()  # device-side descriptors' scratch
    if arch == 0:
        simple = _simple_epilogue(act_grad, residual is not None, store_pre, has_dropout, dual)
        ws = not lora and _ws_eligible(simple, dual, use_tma, tma_epi, dtype is _FP32, a_t, b_t)
        _run(_config(INTERPRETER_CONFIG, simple, tma_epi, common.WARP_SPECIALIZE and ws), key, args, tail, M, N, K,
             K1, n_sm)
        return
    cfg = _CACHE.chosen.get(key)  # the hot path: a dict lookup
    if cfg is None:
        simple = _simple_epilogue(act_grad, residual is not None, store_pre, has_dropout, dual)
        ws = not lora and _ws_eligible(simple, dual, use_tma, tma_epi, dtype is _FP32, a_t, b_t)
        heavy = _heavy(act_grad, activation, has_dropout)
        outputs = 1 + sum(t is not None for t in (c2, hout)) + (store_pre and (2 if dual == 1 else 1))
        cfg = _choose(key, _candidates(arch, dtype, precision, dual == 1, heavy, M, N, device, use_tma, tma_epi,
                                       simple, outputs, ws, lora), (args, tail, M, N, K, K1, n_sm))
    _run(cfg, key, args, tail, M, N, K, K1, n_sm)


def _choose(key, candidates, launch):
    """The config cache's choice for ``key``, timing ``candidates`` with ``launch``'s arguments
    (a function of its own: the closure's cells would otherwise be made on every gemm call)."""
    return _CACHE.get(key, candidates, lambda c: _run(c, key, *launch))


def _run(cfg, key, args, tail, M, N, K, K1, n_sm):
    """Launch ``cfg`` for the launch ``key`` describes (gemm's arguments and their tail)."""
    plan = _PLANS.get(key)
    if plan is None or plan[0] is not cfg:
        plan = _plan(key, cfg)
    _, bm, bn, bk, per_sm, dual, by_evenness = plan
    tiles = -(-M // bm) * -(-N // bn)
    progs = tiles if per_sm == 0 or tiles < n_sm * per_sm else n_sm * per_sm
    even_k, even_mn = K % bk == 0 and (dual != 2 or K1 % bk == 0), M % bm == 0 and N % bn == 0
    constexprs = by_evenness[even_k << 1 | even_mn]
    if constexprs is None:
        constexprs = by_evenness[even_k << 1 | even_mn] = _constexprs(key, cfg, even_k, even_mn)
    common.launch("matmul", _gemm_kernel, (progs,), (*args, progs, *tail), constexprs, cfg)


# launch key -> (config, BLOCK_M, BLOCK_N, BLOCK_K, programs per SM (0: one per tile), dual,
# [constexprs by even_k * 2 + even_mn]): what _run derives from the key and its config, once.
_PLANS = {}


def _plan(key, cfg):
    arch = key[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    # sm_80: a program per tile; otherwise persistent, tiles below 128x128 fit two programs per SM
    per_sm = 0 if arch == 80 else (1 if bm * bn >= 128 * 128 else 2)
    if len(_PLANS) > 4096:
        _PLANS.clear()
    plan = _PLANS[key] = (cfg, bm, bn, bk, per_sm, key[-1] >> 12 & 3, [None] * 4)
    return plan


_CONSTEXPRS = {}


def _constexprs(key, cfg, even_k, even_mn):
    """The launch's constexpr dict, built once per (launch key, config, evenness)."""
    ck = (key, cfg, even_k, even_mn)
    out = _CONSTEXPRS.get(ck)
    if out is None:
        arch, precision, flags = key[0], key[3], key[-1]
        activation, dual = flags & 7, flags >> 12 & 3
        (act_grad, has_bias, has_residual, store_pre, round_pre, store_h, has_dbias, rowsum, has_dropout, lora, use_tma,
         tma_epi, a_t, b_t) = (bool(flags >> i & 1) for i in (*range(3, 12), *range(14, 19)))
        # Hopper warp specialization needs the tile loop unflattened (09-persistent-matmul); a
        # second K loop (dual-K, LoRA) keeps it unflattened too.
        flatten = arch == 90 and use_tma and dual != 2 and not lora and not rowsum and not cfg["WARP_SPECIALIZE"]
        out = dict(
            ACTIVATION=activation, ACT_GRAD=act_grad, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual,
            STORE_PRE=store_pre, ROUND_PRE=round_pre, STORE_H=store_h, HAS_DBIAS=has_dbias, ROWSUM=rowsum,
            HAS_DROPOUT=has_dropout, DUAL=dual, LORA=lora, USE_TMA=use_tma, TMA_EPI=tma_epi, A_T=a_t, B_T=b_t,
            GROUP_M=GROUP_M, PARTIAL_ROWS=PARTIAL_ROWS, PRECISION=precision, INTERPRET=arch == 0,
            EVEN_K=use_tma or even_k,  # descriptors zero-pad: no K masks
            EVEN_MN=even_mn, FLATTEN=flatten)
        if len(_CONSTEXPRS) > 4096:
            _CONSTEXPRS.clear()
        _CONSTEXPRS[ck] = out
    return out


def act_grad(g, pre, activation, *, dbias=False, store_dpre=True, seed=None, dropout_p=0.0, pre2=None, out=None,
             part=None, hout=None):
    """``dPre = g * keep / (1 - p) * act'(pre)`` (elementwise) and, if ``dbias``, its fp32
    partial column sums (cdiv(M, PARTIAL_ROWS), N). The keep factor (``dropout_p > 0``) is
    the mask the GEMM epilogue drew from ``seed``. SwiGLU (``activation == SWIGLU``): ``pre``
    and ``pre2`` are the gate and up pre-activations (same strides); returns dGate and dUp
    side by side, (M, 2N), with (cdiv(M, PARTIAL_ROWS), 2N) partials.

    g and pre (M, N), any strides, or contiguous of another rank (their rows: :func:`_mat`; pre
    unused when ``activation`` is 0). Returns ``(dpre, part)``: dpre (M, width) contiguous in g's
    dtype (None unless ``store_dpre``), part or None. ``out`` (M, width) with a unit column stride
    and ``part`` (fp32, (cdiv(M, PARTIAL_ROWS), width) contiguous): buffers to write instead of
    new ones (a GEMM's outputs, when cuBLAS computed the product: ``fused_block.dispatch``);
    ``hout`` ((M, N) contiguous, with an activation): the hidden activation recomputed from
    pre, the forward's dropout applied (the GEMM's ``hout``).
    """
    (M, N), sg = _mat(g)
    if hout is not None and not activation:
        raise ValueError("act_grad: hout (the recomputed hidden activation) needs an activation")
    swiglu = activation in GATED
    width = 2 * N if swiglu else N
    if out is not None:
        dpre = out if out.dim() == 2 else out.view(M, width)
    else:
        dpre = common.empty((M, width), g.dtype, g.device) if store_dpre or swiglu else None
    if dbias and part is None:
        part = common.empty((common.cdiv(M, PARTIAL_ROWS), width), torch.float32, g.device)
    elif not dbias:
        part = None
    if M == 0 or N == 0:
        return dpre, part
    pre_t = pre if pre is not None else g
    has_dropout = _has_dropout(seed, dropout_p)
    drop_thresh, drop_scale = drop_params(dropout_p) if has_dropout else (0, 1.0)
    grid = (common.cdiv(M, ACT_GRAD_BLOCK_M), common.cdiv(N, 64))
    out = dpre if dpre is not None else g
    # dGate and dUp: the halves of one (M, 2N) buffer, each read as (M, N) with row stride 2N.
    d1, d2 = (out[:, :N], out[:, N:]) if swiglu else (out, out)
    common.launch("act_grad", _act_grad_kernel, grid,
                  (g, pre_t, pre2 if swiglu else pre_t, d1, d2, part if part is not None else g,
                   hout if hout is not None else g, seed if has_dropout else g, M, N, *sg,
                   *(sg if pre is None else _mat(pre_t)[1]), dpre.stride(0) if dpre is not None else width,
                   drop_thresh, drop_scale),
                  _act_grad_constexprs(activation, store_dpre or swiglu, dbias, has_dropout, hout is not None,
                                       common.arch(g.device) == 0),
                  _ELEMENTWISE)
    return dpre, part


@functools.lru_cache(maxsize=None, typed=True)  # typed: 1 and True are other constexprs
def _act_grad_constexprs(activation, store_dpre, dbias, dropout, store_h, interpret):
    return dict(ACTIVATION=activation, STORE_DPRE=store_dpre, HAS_DBIAS=dbias, HAS_DROPOUT=dropout, STORE_H=store_h,
                BLOCK_M=ACT_GRAD_BLOCK_M, INTERPRET=interpret)


_ELEMENTWISE = common.Config.of(num_warps=4)


_REDUCE_CONSTEXPRS = dict(BLOCK_R=REDUCE_BLOCK[0], BLOCK_N=REDUCE_BLOCK[1], INTERPRET=common.interpreting())


def epilogue(pre, c, activation, *, pre2=None, residual=None, seed=None, dropout_p=0.0):
    """``c = dropout(act(pre)) + residual`` elementwise (gated: ``act(pre) * pre2``), the
    dropout mask the GEMM epilogue draws from ``seed``: what remains of a fused GEMM's forward
    epilogue once another library computed the product (and added the bias) into ``pre``.

    pre, pre2 (M, N) with a unit column stride (pre2 with pre's strides); c (M, N) with a unit
    column stride, or contiguous of another rank (its rows); residual (M, N) rows, any strides.
    """
    (M, N), sp = _mat(pre)
    if M == 0 or N == 0:
        return c
    sc = _mat(c)[1]
    sr = (0, 0) if residual is None else _mat(residual)[1]
    has_dropout = _has_dropout(seed, dropout_p)
    drop_thresh, drop_scale = drop_params(dropout_p) if has_dropout else (0, 1.0)
    grid = (common.cdiv(M, ACT_GRAD_BLOCK_M), common.cdiv(N, 64))
    common.launch("epilogue", _epilogue_kernel, grid,
                  (pre, pre2 if pre2 is not None else pre, residual if residual is not None else pre, c,
                   seed if has_dropout else pre, M, N, sp[0], *sr, sc[0], drop_thresh, drop_scale),
                  _epilogue_constexprs(activation, residual is not None, has_dropout, common.arch(pre.device) == 0),
                  _ELEMENTWISE)
    return c


@functools.lru_cache(maxsize=None, typed=True)
def _epilogue_constexprs(activation, residual, dropout, interpret):
    return dict(ACTIVATION=activation, HAS_RESIDUAL=residual, HAS_DROPOUT=dropout, BLOCK_M=ACT_GRAD_BLOCK_M,
                INTERPRET=interpret)


def reduce_partials(part1, dtype, part2=None):
    """Column sums of fp32 partial buffers (rows, N), in a fixed order, cast to ``dtype``: one
    launch for one or two buffers. Returns (sum1, sum2 or None)."""
    out1 = common.empty((part1.shape[1],), dtype, part1.device)
    out2 = common.empty((part2.shape[1],), dtype, part2.device) if part2 is not None else None
    n1 = part1.shape[1] if part1.shape[0] else 0
    n2 = part2.shape[1] if part2 is not None and part2.shape[0] else 0
    if part1.shape[0] == 0:
        out1.zero_()
    if part2 is not None and part2.shape[0] == 0:
        out2.zero_()
    br, bn = REDUCE_BLOCK
    blocks = common.cdiv(n1, bn) + common.cdiv(n2, bn)
    if blocks:
        p2 = part2 if n2 else part1
        common.launch("bias_grad_reduce", _reduce_kernel, (blocks,),
                      (part1, out1, part1.shape[0], n1, p2, out2 if n2 else out1, p2.shape[0], n2),
                      _REDUCE_CONSTEXPRS, _ELEMENTWISE)
    return out1, out2


def dropout_mask(seed, M, N, dropout_p, device):
    """The bool keep-mask (M, N) that the GEMM epilogues and :func:`act_grad` use for ``seed``
    and ``dropout_p``: for tests (the references take it as ``dropout_mask=``), and for a
    layer's dropout between its FFN's GEMMs around a custom activation callable
    (``blocks._hidden_dropout``, which then draws its seed as the fused dropouts do)."""
    if not _has_dropout(seed, dropout_p):
        return torch.ones((M, N), dtype=torch.bool, device=device)
    out = common.empty((M, N), torch.int8, device)
    if M and N:
        common.launch("dropout_mask", _dropout_mask_kernel, (common.cdiv(M, 64), common.cdiv(N, 64)),
                      (seed, out, M, N, drop_params(dropout_p)[0]), dict(BLOCK_M=64), _ELEMENTWISE)
    return out.bool()


# ---------------------------------------------------------------------------------------------
# ahead-of-time compile specs
# ---------------------------------------------------------------------------------------------

# Operand layouts the layers launch, as which strides are 1: forward x @ W.T ("NT"), input and
# hidden gradients dPre @ W ("NN"), weight gradients dY.T @ X ("TN"); (A_T, B_T) for TMA.
_LAYOUTS = {"NT": (("stride_ak", "stride_bk"), (False, True)),
            "NN": (("stride_ak", "stride_bn"), (False, False)),
            "TN": (("stride_am", "stride_bn"), (True, False))}
_NO_FLAGS = dict(ACTIVATION=0, ACT_GRAD=False, HAS_BIAS=False, HAS_RESIDUAL=False, STORE_PRE=False,
                 ROUND_PRE=False, STORE_H=False, HAS_DBIAS=False, ROWSUM=False, HAS_DROPOUT=False, DUAL=0,
                 LORA=False)
# name -> (layout, flags): the fused variants the layers launch, each the heaviest of its
# family (a variant without dropout or without an output has fewer live registers).
_VARIANTS = {
    "fwd": ("NT", dict(HAS_BIAS=True, ACTIVATION=1, HAS_RESIDUAL=True, STORE_PRE=True, ROUND_PRE=True)),
    # Simple epilogues (_epi_split: wider slices): bias + erf GELU (the most instructions) and
    # bias + tanh GELU (the most registers: 231 at 128x256 against 170).
    "fwd_act": ("NT", dict(HAS_BIAS=True, ACTIVATION=1)),
    "fwd_act_tanh": ("NT", dict(HAS_BIAS=True, ACTIVATION=2)),
    "fwd_drop": ("NT", dict(HAS_BIAS=True, ACTIVATION=1, HAS_RESIDUAL=True, STORE_PRE=True, ROUND_PRE=True,
                            HAS_DROPOUT=True)),
    # tanh GELU: its gradient and recomputed activation are the heaviest (255 registers at
    # 128x256, erf GELU 213).
    "dact": ("NN", dict(ACT_GRAD=True, ACTIVATION=2, HAS_DBIAS=True, STORE_H=True)),
    "dact_drop": ("NN", dict(ACT_GRAD=True, ACTIVATION=1, HAS_DBIAS=True, STORE_H=True, HAS_DROPOUT=True)),
    "dswiglu_drop": ("NN", dict(ACT_GRAD=True, ACTIVATION=SWIGLU, HAS_DBIAS=True, STORE_H=True,
                                HAS_DROPOUT=True)),
    # GeGLU's (Gemma) tanh GELU of the gate: more live values than SwiGLU's SiLU.
    "dgeglu_drop": ("NN", dict(ACT_GRAD=True, ACTIVATION=GEGLU, HAS_DBIAS=True, STORE_H=True, HAS_DROPOUT=True)),
    "wgrad_rowsum": ("TN", dict(ROWSUM=True)),
    "wgrad": ("TN", {}),
    "dgrad": ("NN", {}),
    "dgrad_dual": ("NN", dict(DUAL=2)),
    "swiglu_drop": ("NT", dict(DUAL=1, ACTIVATION=SWIGLU, HAS_BIAS=True, STORE_PRE=True, ROUND_PRE=True,
                               HAS_DROPOUT=True)),
    "geglu_drop": ("NT", dict(DUAL=1, ACTIVATION=GEGLU, HAS_BIAS=True, STORE_PRE=True, ROUND_PRE=True,
                              HAS_DROPOUT=True)),
    # PEFT LoRA's low-rank pair as a second K loop (forwards only: the backward's dU and dB are
    # plain GEMMs).
    "fwd_lora": ("NT", dict(HAS_BIAS=True, ACTIVATION=1, HAS_RESIDUAL=True, STORE_PRE=True, LORA=True)),
    "fwd_drop_lora": ("NT", dict(HAS_BIAS=True, ACTIVATION=1, HAS_RESIDUAL=True, STORE_PRE=True, HAS_DROPOUT=True,
                                 LORA=True)),
    "swiglu_drop_lora": ("NT", dict(DUAL=1, ACTIVATION=SWIGLU, HAS_BIAS=True, STORE_PRE=True, ROUND_PRE=True,
                                    HAS_DROPOUT=True, LORA=True)),
    "geglu_drop_lora": ("NT", dict(DUAL=1, ACTIVATION=GEGLU, HAS_BIAS=True, STORE_PRE=True, ROUND_PRE=True,
                                   HAS_DROPOUT=True, LORA=True)),
}
# Per table kind (dtype class, dual): the variants compiled for every config of the table.
# Heavy variants (see _heavy) are compiled, like launched, only on light configs.
_TABLE_VARIANTS = {
    ("16", False): ("fwd_drop", "dact", "dact_drop", "dswiglu_drop", "dgeglu_drop", "wgrad_rowsum", "dgrad_dual"),
    ("16", True): ("swiglu_drop", "geglu_drop"),
    ("tf32", False): ("fwd_drop", "dact", "dact_drop", "wgrad_rowsum"),
    ("tf32", True): ("swiglu_drop", "geglu_drop"),
    ("ieee", False): ("fwd_drop", "dact_drop"),
    ("ieee", True): ("swiglu_drop", "geglu_drop"),
}
# LoRA launches choose among a table's first and last configs only (_candidates): the proven
# tile and the fallback, so the compile check builds its variants for those two; sm_80's
# SwiGLU + LoRA the last one only (the first, 128x128x32 with dropout, spilled 16 B).
_LORA_VARIANTS = {(kind, dual): (("swiglu_drop_lora", "geglu_drop_lora") if dual else ("fwd_lora", "fwd_drop_lora"))
                  for kind, dual in _TABLE_VARIANTS}


def _even_mn_matters(flags, tma_epi):
    """Whether EVEN_MN changes the code: pointer stores, or pointer loads of the residual or
    the saved pre-activation (descriptor stores clip by themselves)."""
    return not tma_epi or flags.get("HAS_RESIDUAL", False) or (flags.get("ACT_GRAD", False)
                                                               and flags.get("ACTIVATION", 0) != 0)


def _gemm_spec(arch, kind, cfg, variant, tma=True, tma_epi=None, even_k=True, even_mn=False, unaligned=(), ws=False):
    """``unaligned``: integer arguments without the 16-divisibility hint ("all" or names);
    ``ws``: warp-specialized (WS_CONFIGS)."""
    from fused_block.kernels import aot  # only the compile check needs it

    bm, bn, bk, warps, stages, split = cfg
    layout, flags = _VARIANTS[variant]
    ones, (a_t, b_t) = _LAYOUTS[layout]
    tma = tma and arch == 90
    dtype = {"16": "bf16", "tf32": "fp32", "ieee": "fp32"}[kind]
    ptr = f"*{dtype}"
    sig = {name: ptr for name in ("A", "A2", "B", "B2", "C", "C2", "BIAS", "BIAS2", "RES", "AUX", "AUX2", "HOUT",
                                  "LA", "LB", "LB2")}
    sig.update(PART="*fp32", SEED="*i64", M="i32", N="i32", K="i32", K1="i32", R="i32", num_progs="i32")
    constexprs = {}
    lora_ones = {"stride_am": "stride_lam", "stride_ak": "stride_lak", "stride_bk": "stride_lbk",
                 "stride_bn": "stride_lbn"}  # LA and LB are laid out as A and B
    ones = tuple(ones) + tuple(lora_ones[o] for o in ones if o in lora_ones and flags.get("LORA", False))
    for s in ("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_rm", "stride_rn",
              "stride_xm", "stride_p", "stride_lam", "stride_lak", "stride_lbk", "stride_lbn"):
        if s in ones or s == "stride_rn":
            sig[s], constexprs[s] = "constexpr", 1
        else:
            sig[s] = "i32"
    sig.update(drop_thresh="i32", drop_scale="fp32")
    dual = flags.get("DUAL", 0)
    constexprs.update(_NO_FLAGS, **flags)
    tma_epi = tma if tma_epi is None else tma_epi and arch == 90
    split = _epi_split(cfg, _simple_epilogue(constexprs["ACT_GRAD"], constexprs["HAS_RESIDUAL"],
                                             constexprs["STORE_PRE"], constexprs["HAS_DROPOUT"], dual), tma_epi)
    constexprs.update(USE_TMA=tma, TMA_EPI=tma_epi, A_T=a_t, B_T=b_t, EVEN_K=even_k, EVEN_MN=even_mn, BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, EPI_SPLIT=split, GROUP_M=GROUP_M, PARTIAL_ROWS=PARTIAL_ROWS,
                      PRECISION="ieee" if kind == "ieee" else "tf32",
                      FLATTEN=(arch == 90 and tma and dual != 2 and not flags.get("ROWSUM", False) and not ws
                               and not flags.get("LORA", False)),
                      WARP_SPECIALIZE=ws, INTERPRET=False)
    for name in _gemm_kernel.arg_names:
        if name not in sig:
            sig[name] = "constexpr"
    aligned = tuple(s for s, t in sig.items() if t == "i32" and s not in ("num_progs", "drop_thresh")
                    and unaligned != "all" and s not in unaligned)
    path = ("tma" if tma else "ptr") + ("" if tma_epi == tma else "/ptr_epi") + (" ws" if ws else "")
    tags = ("" if even_k else " mask_k") + (" even_mn" if even_mn else "") + (" unaligned" if unaligned else "")
    return aot.KernelSpec(
        name=f"matmul[{variant} {bm}x{bn}x{bk}/{split} {path}{tags} {kind}]",
        fn=_gemm_kernel, signature=sig, constexprs=constexprs, num_warps=warps, num_stages=stages,
        aligned=aligned, wgmma=kind != "ieee", tma=tma, archs=(arch,))


# Integer arguments of a launch with epilogue tensors a descriptor cannot read: N odd, say.
_EPI_UNALIGNED = ("N", "stride_cm", "stride_rm", "stride_xm", "stride_p")


def aot_specs():
    """Every shipped GEMM config on its own architecture with its table's fused variants (sm_90:
    TMA loads and stores; heavy epilogues on light configs only, as launched), with EVEN_MN
    (whole tiles) and without wherever it changes the code; sm_80's pointer path with a masked
    K loop on each 16-bit config's forward. sm_90's tiles for views a descriptor cannot read:
    pointer loads (_FALLBACK_90_CFGS) with every size and stride unaligned, and TMA loads with
    a pointer epilogue (the table's smallest tile) with N and the epilogue's strides unaligned. The
    elementwise kernels (activation gradient with and without dropout, the bias-gradient
    reduction, the test-only dropout mask). The default test suite (``KernelSpec.ci``) builds a
    table's first config with every variant and its whole-tile twins, the later configs with the
    table's variants in turn (each at least one) and no twins; the heavy check the rest."""
    from fused_block.kernels import aot

    def add(arch, kind, cfg, variant, ci=True, twin_ci=True, **kw):
        # ci: the default test suite builds it, twin_ci: also its whole-tile twin (else the
        # heavy check). Returns how many specs it added.
        flags = _VARIANTS[variant][1]
        heavy = _heavy(flags.get("ACT_GRAD", False), flags.get("ACTIVATION", 0), flags.get("HAS_DROPOUT", False))
        if heavy and not _light(cfg):
            return 0
        tma = kw.get("tma", True) and arch == 90
        tma_epi = kw.get("tma_epi", tma) and tma
        # LoRA variants: masked edges only (whole tiles only drop masks; the non-LoRA variants
        # build EVEN_MN on every config).
        both = _even_mn_matters(flags, tma_epi) and not flags.get("LORA", False)
        for even_mn in (False, True) if both else (False,):
            spec = _gemm_spec(arch, kind, cfg, variant, even_mn=even_mn, **kw)
            built = ci and (twin_ci or not even_mn)
            specs.append(spec if built else dataclasses.replace(spec, ci=False))
        return 2 if both else 1

    specs = []
    for (arch, kind, dual), cfgs in CONFIGS.items():
        variants = _TABLE_VARIANTS[(kind, dual)]
        for i, cfg in enumerate(cfgs):
            # The default check: the table's first config with every variant, the others (the
            # tuner's candidates) with the variants in turn, at least one each.
            start = len(specs)
            for j, v in enumerate(variants + (_LORA_VARIANTS[(kind, dual)]
                                              if i in _lora_configs(arch, dual, len(cfgs)) else ())):
                add(arch, kind, cfg, v, ci=i == 0 or j % (len(cfgs) - 1) == i - 1, twin_ci=i == 0)
            if len(specs) > start and not any(spec.ci for spec in specs[start:]):
                specs[start] = dataclasses.replace(specs[start], ci=True)
            if kind == "16" and not dual and arch == 80:
                # Pointer loads with a masked K loop (sm_80's path for K not a multiple of BLOCK_K).
                add(arch, kind, cfg, "fwd", even_k=False)
            if kind == "16" and not dual and arch == 90:
                add(arch, kind, cfg, "fwd")  # dropout-free forward: fwd_drop is heavy here
            if arch == 90 and not dual and _epi_split(cfg, True, True) != cfg[5]:
                for v in ("fwd_act", "fwd_act_tanh"):  # a simple epilogue's wider slices
                    add(arch, kind, cfg, v)
        if arch == 90:
            smallest = cfgs[-1]
            lora = _LORA_VARIANTS[(kind, dual)]
            for v in variants + lora + (("fwd",) if kind == "16" and not dual else ()):
                add(arch, kind, smallest, v, tma_epi=False, unaligned=_EPI_UNALIGNED)
            if kind != "16":
                for v in variants + lora:
                    add(arch, kind, _FALLBACK_90_CFGS[kind], v, tma=False, even_k=False, unaligned="all")
    # The warp-specialized candidates with the variants they run (_ws_eligible): the simple
    # epilogues on one K loop, i.e. the bias + GELU forwards, the input gradient, the weight
    # gradient with and without its row sums; TF32 the forwards (x @ W.T) only.
    for (arch, kind), cfgs in WS_CONFIGS.items():
        for cfg in cfgs:
            for v in ("fwd_act", "fwd_act_tanh") + (("dgrad", "wgrad_rowsum", "wgrad") if kind == "16" else ()):
                add(arch, kind, cfg, v, ws=True)
    # sm_90's 16-bit pointer fallback: every 16-bit variant and the plain weight gradient (dW =
    # dY.T @ X without a bias, whose flattened loop spilled), masked K; the forward also with
    # aligned sizes (FORCE_PATH, an empty first K part).
    for variant in (_TABLE_VARIANTS[("16", False)] + _LORA_VARIANTS[("16", False)]
                    + ("fwd", "wgrad", "swiglu_drop", "swiglu_drop_lora", "geglu_drop", "geglu_drop_lora")):
        add(90, "16", _FALLBACK_90_CFGS["16"], variant, tma=False, even_k=False, unaligned="all")
    add(90, "16", _FALLBACK_90_CFGS["16"], "fwd", tma=False, even_k=False)
    for act, drop, store_h in ((2, False, False), (2, True, False), (0, True, False), (SWIGLU, True, False),
                               (GEGLU, True, False), (1, True, True), (SWIGLU, True, True), (GEGLU, False, True)):
        specs.append(aot.KernelSpec(
            name=f"act_grad[act={act} dbias{' dropout' if drop else ''}{' store_h' if store_h else ''}]",
            fn=_act_grad_kernel,
            signature={"G": "*bf16", "PRE": "*bf16", "PRE2": "*bf16", "DPRE": "*bf16", "DPRE2": "*bf16",
                       "PART": "*fp32", "HOUT": "*bf16", "SEED": "*i64",
                       "M": "i32", "N": "i32", "stride_gm": "i32", "stride_gn": "constexpr",
                       "stride_pm": "i32", "stride_pn": "constexpr", "stride_dm": "i32", "drop_thresh": "i32",
                       "drop_scale": "fp32",
                       "ACTIVATION": "constexpr", "STORE_DPRE": "constexpr", "HAS_DBIAS": "constexpr",
                       "HAS_DROPOUT": "constexpr", "STORE_H": "constexpr", "BLOCK_M": "constexpr",
                       "INTERPRET": "constexpr"},
            constexprs=dict(stride_gn=1, stride_pn=1, ACTIVATION=act, STORE_DPRE=True, HAS_DBIAS=True,
                            HAS_DROPOUT=drop, STORE_H=store_h, BLOCK_M=ACT_GRAD_BLOCK_M, INTERPRET=False),
            num_warps=4, aligned=("N", "stride_gm", "stride_pm", "stride_dm")))
    for act, res, drop in ((1, True, False), (2, False, True), (0, True, True), (SWIGLU, False, True),
                           (GEGLU, False, False)):
        specs.append(aot.KernelSpec(
            name=f"epilogue[act={act}{' residual' if res else ''}{' dropout' if drop else ''}]",
            fn=_epilogue_kernel,
            signature={"PRE": "*bf16", "PRE2": "*bf16", "RES": "*bf16", "C": "*bf16", "SEED": "*i64",
                       "M": "i32", "N": "i32", "stride_pm": "i32", "stride_rm": "i32", "stride_rn": "constexpr",
                       "stride_cm": "i32", "drop_thresh": "i32", "drop_scale": "fp32",
                       "ACTIVATION": "constexpr", "HAS_RESIDUAL": "constexpr", "HAS_DROPOUT": "constexpr",
                       "BLOCK_M": "constexpr", "INTERPRET": "constexpr"},
            constexprs=dict(stride_rn=1, ACTIVATION=act, HAS_RESIDUAL=res, HAS_DROPOUT=drop,
                            BLOCK_M=ACT_GRAD_BLOCK_M, INTERPRET=False),
            num_warps=4, aligned=("N", "stride_pm", "stride_rm", "stride_cm")))
    specs.append(aot.KernelSpec(
        name="bias_grad_reduce", fn=_reduce_kernel,
        signature={"P1": "*fp32", "O1": "*bf16", "R1": "i32", "N1": "i32", "P2": "*fp32", "O2": "*bf16",
                   "R2": "i32", "N2": "i32", "BLOCK_R": "constexpr", "BLOCK_N": "constexpr",
                   "INTERPRET": "constexpr"},
        constexprs=dict(BLOCK_R=REDUCE_BLOCK[0], BLOCK_N=REDUCE_BLOCK[1], INTERPRET=False), num_warps=4,
        aligned=("N1", "N2")))
    specs.append(aot.KernelSpec(
        name="dropout_mask", fn=_dropout_mask_kernel,
        signature={"SEED": "*i64", "OUT": "*i8", "M": "i32", "N": "i32", "drop_thresh": "i32",
                   "BLOCK_M": "constexpr"},
        constexprs=dict(BLOCK_M=64), num_warps=4, aligned=("N",)))
    return specs
