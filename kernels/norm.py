"""Residual add + dropout + LayerNorm/RMSNorm in one pass over memory, forward and backward.

Forward, per row (``ROWS`` rows per program; one when the row is wide)::

    h            = dropout(x) + residual        # fp32 in registers, rounded to the residual dtype
    residual_out = h                            # stored in the residual dtype (optional)
    out          = (h - mean) * rstd * w + b    # RMSNorm: h * rstd * w

x and residual are read once, out and residual_out written once; mean and rstd are stored in
fp32. The dropout mask is never stored: it is ``tl.rand(seed, row * N + col) >= p``,
regenerated in backward.

Backward (after flash-attention's and quack's): a grid of a multiple of the SM count chosen by
the hidden size; each program walks a contiguous run of rows (a runtime count, never a
constexpr) with the next rows prefetched (``tl.range(num_stages=...)``: cp.async into shared
memory), computes dx and dresidual (the gradient arriving on ``residual_out`` is added in the
same pass, and so is a second gradient of ``out`` where out is also the next residual stream,
as in Post-LN: no separate PyTorch add of two gradients) and keeps fp32 partial sums of
dweight/dbias, one row of partials per program. A second small kernel sums the partials in a
fixed order (deterministic, no atomics) and writes dweight/dbias in the parameters' dtype.

The row means are correctly rounded on the GPU as in the interpreter, and rstd nearly so (see
``_div_n`` and ``_rstd``): rstd, up to 1/sqrt(eps), multiplies every error of the means.

A row that fits the register budget (``next_pow2(N) <= FWD_REG_MAX`` / ``BWD_REG_MAX``) is
held in registers; wider rows (up to ``MAX_HIDDEN``) go through the chunked path: the forward
sums h - shift and its square (shift: the first chunk's mean) and re-reads the row, from L2, to
normalize; the backward takes two passes over each group of ``ROWS`` rows (the row reductions,
then dx and the dweight/dbias partials chunk by chunk; the second pass re-reads the group from
L2) and accumulates the partials in the program's own partial row (L2-resident).
"""
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from fused_block.kernels import common

# The widest row: the means' correctly rounded division (_div_n) needs N < 2^24. The chunked
# paths loop over any width; the backward caps its programs so the partials stay bounded.
MAX_HIDDEN = (1 << 24) - 1
# The backward's (programs, N) fp32 partial sums stay within this many elements (256 MB).
MAX_PARTIALS = 1 << 26
# Widest row (as a power of two) held in registers: the forward keeps h, w and b per element,
# the backward h, dy, w, the incoming residual gradient and the two partial accumulators.
# Both are held to "no spills" on sm_80 and sm_90 by the compile check.
FWD_REG_MAX = 16384
BWD_REG_MAX = 8192
# Dropout's random numbers and 32-bit x or residual_out need more registers: such rows stay in
# registers up to 8192 only.
FWD_REG_MAX_HEAVY = 8192
# Chunk widths of the wide-row paths.
FWD_CHUNK = 4096
BWD_CHUNK = 1024

_INTERPRET = common.interpreting()


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _div_n(s, N, inv_n, INTERPRET: tl.constexpr):
    """``s / N`` correctly rounded, for a vector of row sums; ``inv_n`` is RN(1 / N) from the host.

    The statistics are where rounding is amplified: rstd reaches 1/sqrt(eps) ~ 316 on constant
    rows and nearly that on tiny-variance ones, and multiplies every error of the mean or of
    the backward's row means (1 ulp of 0.75 times 316 is 2e-5, twice fp32's atol, where
    PyTorch may be exact). On the GPU Triton's fp32 ``/`` is ``div.full.f32`` (up to 2 ulps
    off), and ``tl.math.div_rn`` has a slow path that ptxas calls as a subroutine: at the
    backward's register budget that call spills. So the GPU divides by Markstein's correction
    (P. Markstein, IBM J. Res. Dev. 34(1), 1990; Muller et al., Handbook of Floating-Point
    Arithmetic): q = RN(s * inv_n), r = s - q * N (exact in an fma), RN(q + r * inv_n) is
    RN(s / N) when inv_n = RN(1 / N) and N < 2^24 (checked against numpy's division, the fma
    emulated in exact rational arithmetic, on 200000 random (N <= 65536, s) pairs and 20000 with
    65536 < N < 2^24). Three
    fp32 operations and a select a row, no branch; an infinite sum (overflowing squares) keeps
    q, where the correction would be NaN. The interpreter divides: numpy's division rounds correctly, its fma
    rounds twice.
    """
    if INTERPRET:
        return s / N
    q = s * inv_n
    d = tl.fma(tl.fma(-q, tl.zeros_like(s) + N, s), inv_n, q)
    return tl.where(d == d, d, q)


@triton.jit
def _rstd(var, eps, INTERPRET: tl.constexpr):
    """``1 / sqrt(var + eps)``: on the GPU the nearest float but for about 1 in 10^6 (then 1 ulp off).

    rstd's own error is relative (it scales a row), so it is not amplified like the mean's;
    still, the GPU's ``tl.sqrt`` (``sqrt.approx``) and ``/`` give ~3 ulps, and
    ``tl.math.sqrt_rn`` costs the forward 12-16 registers (its slow path: 40 -> 52 at hidden
    1024, 48 -> 63 at 4096, sm_90 bf16), one fewer 8-warp program per SM. One Newton step,
    r + r/2 (1 - v r^2), with the residual 1 - v r^2 formed exactly (r^2 split into p + p_lo by
    an fma), brings the approximation to 0.5 ulp (checked in exact emulation on 2e6 random v
    from 1e-6 to 1e6: no result off by more, 1 in 10^6 not the nearest float) in 5 fp32
    operations and no extra registers; where the step is NaN (v infinite, or 0 after the GPU
    flushed a denormal) r stays as it was (0 or inf, as before the step). The interpreter's
    square root and division round correctly (within 1 ulp together) and its fma rounds twice,
    so it stops there.
    """
    v = var + eps
    r = 1.0 / tl.sqrt(v)
    if not INTERPRET:
        p = r * r
        p_lo = tl.fma(r, r, -p)
        e = tl.fma(-v, p_lo, tl.fma(-v, p, 1.0))
        refined = tl.fma(0.5 * r, e, r)
        r = tl.where(refined == refined, refined, r)
    return r


@triton.jit
def _dropout_seed(SEED, HAS_DROPOUT: tl.constexpr):
    """The dropout mask's seed; 0 without dropout. (Its scale 1 / (1 - p) comes from the host,
    correctly rounded: a ``div.rn`` here made ptxas give some sm_80 configs a stack frame.)"""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    return seed


@triton.jit
def _sum_in(X, R, ROUT, x_offs, r_offs, mask, rand_offs, seed, keep_scale, dropout_p,
            HAS_RES: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_ROUT: tl.constexpr,
            INTERPRET: tl.constexpr):
    """dropout(x) + residual of a tile, in fp32; 0 outside ``mask``.

    The sum is rounded to residual_out's dtype before it is normalized, so the backward, which
    reads the stored residual_out, recomputes exactly the xhat the forward used.
    """
    h = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = tl.rand(seed, rand_offs) >= dropout_p
        h = tl.where(keep, h * keep_scale, 0.0)
    if HAS_RES:
        h += tl.load(R + r_offs, mask=mask, other=0.0).to(tl.float32)
    if STORE_ROUT:
        h = common.cast(h, ROUT.dtype.element_ty, INTERPRET).to(tl.float32)
    return h


@triton.jit
def _load_w(W, cols, mask, W_OFFSET: tl.constexpr):
    """The norm's weight as it scales the row, fp32: ``w``, or ``1 + w`` with ``W_OFFSET``
    (Gemma's RMSNorm, whose weight is stored as an offset from 1: ``(1 + w.float())``)."""
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if W_OFFSET:
        w = w + 1.0
    return w


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add_norm_fwd_kernel(
    X, R, W, B, OUT, ROUT, MEAN, RSTD, SEED,
    stride_x, stride_r, M, N, inv_n, eps, dropout_p, keep_scale,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_ROUT: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, INTERPRET: tl.constexpr, W_OFFSET: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    r2 = rows[:, None]
    seed = _dropout_seed(SEED, HAS_DROPOUT)
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        c2 = cols[None, :]
        mask = row_mask[:, None] & (c2 < N)
        # Tiles up to 8192 elements load the parameters first, so that their latency overlaps the
        # row's; wider ones load them after the reductions, when they are needed, so that only h
        # is live across the reductions (quack's delay_w_load): no spills at 16384.
        if ROWS * BLOCK_N <= 8192:
            if HAS_W:
                w = _load_w(W, cols, col_mask, W_OFFSET)
            if HAS_B:
                b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        h = _sum_in(X, R, ROUT, r2 * stride_x + c2, r2 * stride_r + c2, mask, r2 * N + c2, seed,
                    keep_scale, dropout_p, HAS_RES, HAS_DROPOUT, STORE_ROUT, INTERPRET)
        if STORE_ROUT:
            tl.store(ROUT + r2 * N + c2, common.cast(h, ROUT.dtype.element_ty, INTERPRET), mask=mask)
        if IS_RMS:
            xc = h
            var = _div_n(tl.sum(h * h, axis=1), N, inv_n, INTERPRET)
        else:
            # Corrected two-pass: the rounding error of the first mean (~N ulps of |mean|, large
            # against a tiny spread) comes back exactly in sum(d), in the same reduction as sum(d^2).
            mean = _div_n(tl.sum(h, axis=1), N, inv_n, INTERPRET)
            d = tl.where(mask, h - mean[:, None], 0.0)
            sd, sdd = tl.reduce((d, d * d), 1, _add_pair)
            dm = _div_n(sd, N, inv_n, INTERPRET)
            mean += dm
            xc = d - dm[:, None]
            # An overflowed E[d^2] is the variance (inf, rstd 0): a mean correction dm whose
            # square overflows too (|h| near fp32's max) would make it inf - inf = NaN.
            edd = _div_n(sdd, N, inv_n, INTERPRET)
            var = tl.where(edd == float("inf"), edd, tl.maximum(edd - dm * dm, 0.0))
        rstd = _rstd(var, eps, INTERPRET)
        y = xc * rstd[:, None]
        if ROWS * BLOCK_N > 8192:
            if HAS_W:
                w = _load_w(W, cols, col_mask, W_OFFSET)
            if HAS_B:
                b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * w[None, :]
        if HAS_B:
            y = y + b[None, :]
        tl.store(OUT + r2 * N + c2, common.cast(y, OUT.dtype.element_ty, INTERPRET), mask=mask)
    else:
        # Pass 1: residual_out and the statistics: sums of (h - shift) and its square, the shift
        # being the mean of the first chunk (always full here: N > FWD_REG_MAX >= BLOCK_N). Its
        # distance to the row mean is at most sqrt(N / BLOCK_N) standard deviations, so the
        # subtraction var = E[d^2] - E[d]^2 loses at most ~N / BLOCK_N ulps; and the loop has no
        # division (on sm_80 a division in this loop made ptxas use a stack frame).
        shift = tl.zeros((ROWS,), tl.float32)
        s1 = tl.zeros((ROWS,), tl.float32)
        s2 = tl.zeros((ROWS,), tl.float32)
        for start in range(0, N, BLOCK_N):
            c2 = start + tl.arange(0, BLOCK_N)[None, :]
            mask = row_mask[:, None] & (c2 < N)
            h = _sum_in(X, R, ROUT, r2 * stride_x + c2, r2 * stride_r + c2, mask, r2 * N + c2, seed,
                        keep_scale, dropout_p, HAS_RES, HAS_DROPOUT, STORE_ROUT, INTERPRET)
            if STORE_ROUT:
                tl.store(ROUT + r2 * N + c2, common.cast(h, ROUT.dtype.element_ty, INTERPRET), mask=mask)
            if IS_RMS:
                s2 += tl.sum(h * h, axis=1)
            else:
                if start == 0:
                    shift = tl.sum(h, axis=1) * (1.0 / BLOCK_N)
                d = tl.where(mask, h - shift[:, None], 0.0)
                s1 += tl.sum(d, axis=1)
                s2 += tl.sum(d * d, axis=1)
        if IS_RMS:
            rstd = _rstd(_div_n(s2, N, inv_n, INTERPRET), eps, INTERPRET)
        else:
            d_mean = _div_n(s1, N, inv_n, INTERPRET)
            mean = shift + d_mean
            rstd = _rstd(tl.maximum(_div_n(s2, N, inv_n, INTERPRET) - d_mean * d_mean, 0.0), eps, INTERPRET)
        # Pass 2: recompute h exactly (same loads, same dropout mask; mostly L2 hits), normalize.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            c2 = cols[None, :]
            mask = row_mask[:, None] & (c2 < N)
            h = _sum_in(X, R, ROUT, r2 * stride_x + c2, r2 * stride_r + c2, mask, r2 * N + c2, seed,
                        keep_scale, dropout_p, HAS_RES, HAS_DROPOUT, STORE_ROUT, INTERPRET)
            if IS_RMS:
                y = h * rstd[:, None]
            else:
                y = (h - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * _load_w(W, cols, cols < N, W_OFFSET)[None, :]
            if HAS_B:
                y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + r2 * N + c2, common.cast(y, OUT.dtype.element_ty, INTERPRET), mask=mask)
    if not IS_RMS:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _xhat_dy(H, DOUT, DOUT2, h_offs, dout_offs, dout2_offs, mask, mean, rstd, w, IS_RMS: tl.constexpr,
             HAS_W: tl.constexpr, HAS_DOUT2: tl.constexpr):
    """xhat, dy and w * dy of a tile, fp32, 0 outside ``mask``; dy sums out's two gradients with HAS_DOUT2."""
    h = tl.load(H + h_offs, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xhat = h * rstd[:, None]
    else:
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    dy = tl.load(DOUT + dout_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DOUT2:
        dy += tl.load(DOUT2 + dout2_offs, mask=mask, other=0.0).to(tl.float32)
    wdy = dy
    if HAS_W:
        wdy = dy * w[None, :]
    return xhat, dy, wdy


@triton.jit
def _row_stats(MEAN, RSTD, rows, row_mask, IS_RMS: tl.constexpr):
    """The forward's saved (mean, rstd) of ``rows`` (mean 0 for RMSNorm)."""
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mean = rstd * 0.0
    if not IS_RMS:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    return mean, rstd


@triton.jit
def _dh(xhat, wdy, c1, c2, rstd, IS_RMS: tl.constexpr):
    """Gradient reaching residual_out through the norm: (w*dy - xhat*c1 - c2) * rstd."""
    if IS_RMS:
        return (wdy - xhat * c1[:, None]) * rstd[:, None]
    else:
        return (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def _store_grads(DX, DRES, offs, mask, seed, keep_scale, dropout_p, dh,
                 STORE_DRES: tl.constexpr, HAS_DROPOUT: tl.constexpr, INTERPRET: tl.constexpr):
    """dh (the gradient of residual_out, incoming part included) -> dresidual, and through dropout -> dx.

    ``offs`` = row * N + col: the offset in the (contiguous) outputs and the dropout counter.
    """
    if STORE_DRES:
        tl.store(DRES + offs, common.cast(dh, DRES.dtype.element_ty, INTERPRET), mask=mask)
    if HAS_DROPOUT:
        keep = tl.rand(seed, offs) >= dropout_p
        dh = tl.where(keep, dh * keep_scale, 0.0)
    tl.store(DX + offs, common.cast(dh, DX.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _add_norm_bwd_kernel(
    H, W, DOUT, DOUT2, DROUT, MEAN, RSTD, SEED, DX, DRES, DW_PART, DB_PART,
    stride_h, stride_dout, stride_dout2, stride_drout, M, N, inv_n, dropout_p, keep_scale,
    rows_per_program,
    IS_RMS: tl.constexpr, HAS_DOUT: tl.constexpr, HAS_DOUT2: tl.constexpr, HAS_W: tl.constexpr,
    HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, HAS_DROUT: tl.constexpr, STORE_DRES: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SINGLE_PASS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, NUM_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr, W_OFFSET: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    DW_PART += pid * N
    DB_PART += pid * N
    seed = _dropout_seed(SEED, HAS_DROPOUT)
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        c2 = cols[None, :]
        w = 0.0
        if HAS_W:
            w = _load_w(W, cols, col_mask, W_OFFSET)
        dw = tl.zeros((ROWS, BLOCK_N), tl.float32)
        db = tl.zeros((ROWS, BLOCK_N), tl.float32)
        # num_stages > 1: the loads of the next rows are issued (cp.async) before this row's math.
        for r0 in tl.range(row_start, row_end, ROWS, num_stages=NUM_STAGES):
            rows = r0 + tl.arange(0, ROWS)
            row_mask = rows < row_end
            r2 = rows[:, None]
            mask = row_mask[:, None] & (c2 < N)
            dh = tl.zeros((ROWS, BLOCK_N), tl.float32)
            if HAS_DROUT:
                dh = tl.load(DROUT + r2 * stride_drout + c2, mask=mask, other=0.0).to(tl.float32)
            if HAS_DOUT:
                mean, rstd = _row_stats(MEAN, RSTD, rows, row_mask, IS_RMS)
                xhat, dy, wdy = _xhat_dy(H, DOUT, DOUT2, r2 * stride_h + c2, r2 * stride_dout + c2,
                                         r2 * stride_dout2 + c2, mask, mean, rstd, w, IS_RMS, HAS_W, HAS_DOUT2)
                if HAS_DW:
                    dw += dy * xhat
                if HAS_DB:
                    db += dy
                m1 = _div_n(tl.sum(xhat * wdy, axis=1), N, inv_n, INTERPRET)
                m2 = m1
                if not IS_RMS:
                    m2 = _div_n(tl.sum(wdy, axis=1), N, inv_n, INTERPRET)
                dh += _dh(xhat, wdy, m1, m2, rstd, IS_RMS)
            _store_grads(DX, DRES, r2 * N + c2, mask, seed,
                         keep_scale, dropout_p, dh, STORE_DRES, HAS_DROPOUT, INTERPRET)
        if HAS_DW:
            tl.store(DW_PART + cols, tl.sum(dw, axis=0), mask=col_mask)
        if HAS_DB:
            tl.store(DB_PART + cols, tl.sum(db, axis=0), mask=col_mask)
    else:
        # Wide rows, a group of ROWS rows at a time. Pass 1: the row reductions
        # m1 = mean(xhat * w * dy), m2 = mean(w * dy). Pass 2 (the group re-read from L2): dx,
        # and the chunk's dweight/dbias partials added into this program's partial row (the
        # first group writes it, so it needs no zero-fill). Both passes prefetch the next chunk
        # when NUM_STAGES > 1.
        for r0 in range(row_start, row_end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            row_mask = rows < row_end
            r2 = rows[:, None]
            mean, rstd = _row_stats(MEAN, RSTD, rows, row_mask, IS_RMS)
            s1 = tl.zeros((ROWS,), tl.float32)
            s2 = tl.zeros((ROWS,), tl.float32)
            if HAS_DOUT:
                for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
                    cols = start + tl.arange(0, BLOCK_N)
                    c2 = cols[None, :]
                    mask = row_mask[:, None] & (c2 < N)
                    wc = 0.0
                    if HAS_W:
                        wc = _load_w(W, cols, cols < N, W_OFFSET)
                    xhat, dy, wdy = _xhat_dy(H, DOUT, DOUT2, r2 * stride_h + c2, r2 * stride_dout + c2,
                                             r2 * stride_dout2 + c2, mask, mean, rstd, wc, IS_RMS, HAS_W,
                                             HAS_DOUT2)
                    s1 += tl.sum(xhat * wdy, axis=1)
                    s2 += tl.sum(wdy, axis=1)
            m1 = _div_n(s1, N, inv_n, INTERPRET)
            m2 = _div_n(s2, N, inv_n, INTERPRET)
            not_first = r0 > row_start
            for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                c2 = cols[None, :]
                mask = row_mask[:, None] & (c2 < N)
                dh = tl.zeros((ROWS, BLOCK_N), tl.float32)
                if HAS_DROUT:
                    dh = tl.load(DROUT + r2 * stride_drout + c2, mask=mask, other=0.0).to(tl.float32)
                if HAS_DOUT:
                    wc = 0.0
                    if HAS_W:
                        wc = _load_w(W, cols, col_mask, W_OFFSET)
                    xhat, dy, wdy = _xhat_dy(H, DOUT, DOUT2, r2 * stride_h + c2, r2 * stride_dout + c2,
                                             r2 * stride_dout2 + c2, mask, mean, rstd, wc, IS_RMS, HAS_W,
                                             HAS_DOUT2)
                    dh += _dh(xhat, wdy, m1, m2, rstd, IS_RMS)
                    if HAS_DW:
                        dw = tl.sum(dy * xhat, axis=0)
                        dw += tl.load(DW_PART + cols, mask=col_mask & not_first, other=0.0)
                        tl.store(DW_PART + cols, dw, mask=col_mask)
                    if HAS_DB:
                        db = tl.sum(dy, axis=0)
                        db += tl.load(DB_PART + cols, mask=col_mask & not_first, other=0.0)
                        tl.store(DB_PART + cols, db, mask=col_mask)
                _store_grads(DX, DRES, r2 * N + c2, mask, seed,
                             keep_scale, dropout_p, dh, STORE_DRES, HAS_DROPOUT, INTERPRET)
            # The next group reads the partials this one wrote, possibly from other threads
            # (a reduced vector is replicated across the threads of the row dimension).
            tl.debug_barrier()


@triton.jit
def _reduce_partials_kernel(
    DW_PART, DB_PART, DW, DB, n_part, N,
    HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dweight/dbias = column sums of the (n_part, N) fp32 partials, in a fixed order.

    Written in the parameters' dtype; with no partial rows (no rows at all) they are zeros.
    """
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    dw = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    db = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for r0 in tl.range(0, n_part, BLOCK_R, num_stages=NUM_STAGES):
        rows = r0 + tl.arange(0, BLOCK_R)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = (rows < n_part)[:, None] & col_mask[None, :]
        if HAS_DW:
            dw += tl.load(DW_PART + offs, mask=mask, other=0.0)
        if HAS_DB:
            db += tl.load(DB_PART + offs, mask=mask, other=0.0)
    if HAS_DW:
        tl.store(DW + cols, common.cast(tl.sum(dw, axis=0), DW.dtype.element_ty, INTERPRET), mask=col_mask)
    if HAS_DB:
        tl.store(DB + cols, common.cast(tl.sum(db, axis=0), DB.dtype.element_ty, INTERPRET), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# config tables, per architecture
#
# Each entry: (largest BLOCK_N it covers, ((ROWS, num_warps[, NUM_STAGES]), ...)); the first
# candidate is the default (taken with FUSED_BLOCK_TUNE=0 and on the interpreter), the others
# are timed once per key by common.ConfigCache on CUDA. None of these has been timed on a GPU
# yet (no GPU was available when they were written): the defaults follow the anchors below.
# A forward candidate marked LIGHT is offered only to 16-bit x and residual_out without dropout:
# in the heavier variants it spills (the compile check holds every offered config to no spills).
# ---------------------------------------------------------------------------------------------

LIGHT = "light"

# sm_90, forward. quack's Hopper forward (rmsnorm_config._for_hopper_fwd) gives each thread
# 16-64 elements of a row (threads_per_row 32 for N <= 3K, 64 <= 6K, 128 <= 16K) and packs several
# rows into a block for small N; here each thread gets about 16 elements (two 16-byte vectors of
# bf16 per tensor) and a program about 2048 elements or one row.
_FWD_SM90 = (
    (512, ((None, 4), (None, 2), (None, 8))),  # ROWS None: 2048 // BLOCK_N rows (at most 64)
    (1024, ((2, 4), (1, 4), (4, 8))),
    (2048, ((1, 4), (1, 8), (2, 8))),
    (4096, ((1, 8), (1, 16), (1, 4))),
    (8192, ((1, 16), (1, 8))),
    (16384, ((1, 16), (1, 32, LIGHT))),
    (MAX_HIDDEN, ((1, 8), (1, 16, LIGHT))),  # chunked (FWD_CHUNK wide)
)
# sm_80, forward. One row per program from 1024 up with Liger's warp ladder (calculate_settings:
# 4 warps, 8 from 2048, 16 from 8192, 32 from 32768), several rows below (its RMSNorm block
# kernel packs 16 rows of BLOCK <= 256).
_FWD_SM80 = (
    (512, ((None, 4), (None, 8))),
    (1024, ((1, 4), (2, 4), (1, 8))),
    (2048, ((1, 8), (1, 4))),
    (4096, ((1, 8), (1, 16))),
    (8192, ((1, 16), (1, 8))),
    (16384, ((1, 16), (1, 32, LIGHT))),
    (MAX_HIDDEN, ((1, 16), (1, 8))),
)
# sm_90, backward (ROWS, num_warps, NUM_STAGES). quack's Hopper backward
# (rmsnorm_config._for_hopper_bwd): 128 threads for N <= 4096 and 256 above, threads_per_row
# 8/16/32/64 for N <= 64/128/256/512 (so 16/8/4/2 rows per block), one row of 128 threads up
# to 4096, the next row double-buffered (2 smem stages). Warp counts from 1 for the tuner
# (flash-attention tunes 1..32).
_BWD_SM90 = (
    (64, ((16, 4, 2), (16, 2, 2), (16, 1, 2))),
    (128, ((8, 4, 2), (8, 2, 2), (8, 1, 2))),
    (256, ((4, 4, 2), (4, 2, 2), (4, 1, 2))),
    (512, ((2, 4, 2), (2, 2, 2), (1, 1, 2))),
    (1024, ((1, 4, 2), (1, 2, 2), (1, 8, 2))),
    (2048, ((1, 4, 2), (1, 8, 2))),
    (4096, ((1, 4, 2), (1, 8, 2), (1, 16, 2))),
    (8192, ((1, 8, 2),)),
    (MAX_HIDDEN, ((4, 8, 2), (4, 8, 1), (2, 8, 2))),  # chunked (BWD_CHUNK wide), group of ROWS rows
)
# sm_80, backward. flash-attention's kernel (one row at a time, BLOCK_N = next_pow2(N)) with
# Liger's warp ladder, plus quack's row packing for small N and a 2-stage prefetch.
_BWD_SM80 = (
    (64, ((16, 4, 2), (16, 2, 2), (16, 1, 2))),
    (128, ((8, 4, 2), (8, 2, 2), (8, 1, 2))),
    (256, ((4, 4, 2), (4, 2, 2), (4, 1, 2))),
    (512, ((2, 4, 2), (2, 2, 2), (1, 1, 2))),
    (1024, ((1, 4, 2), (1, 2, 2), (1, 8, 2))),
    (2048, ((1, 8, 2), (1, 4, 2))),
    (4096, ((1, 8, 2), (1, 16, 2), (1, 4, 2))),
    (8192, ((1, 8, 2),)),
    (MAX_HIDDEN, ((4, 8, 1), (2, 8, 2))),  # 4 rows with prefetch spill on sm_80
)
_FWD_TABLES = {80: _FWD_SM80, 90: _FWD_SM90}
_BWD_TABLES = {80: _BWD_SM80, 90: _BWD_SM90}
# The partials reduction: a (BLOCK_R, BLOCK_C) tile of fp32 per step (16-byte loads along a
# 128-byte row segment), 4 warps, 3 stages of prefetch; BLOCK_C = 32 gives N / 32 programs.
# The interpreter runs programs one after another (tens of ms each), so it takes wide columns.
_REDUCE_CONFIGS = {80: common.Config.of(num_warps=4, BLOCK_R=64, BLOCK_C=32, NUM_STAGES=3),
                   90: common.Config.of(num_warps=4, BLOCK_R=64, BLOCK_C=32, NUM_STAGES=3),
                   0: common.Config.of(num_warps=4, BLOCK_R=16, BLOCK_C=1024, NUM_STAGES=3)}


def bwd_programs(n: int, sms: int) -> int:
    """Backward grid size for hidden ``n`` (before clipping to the row count).

    quack's Hopper table (rmsnorm_config._get_sm_count_hopper) up to 8192: more programs than
    SMs hide the latency of the row loads when rows are short (flash-attention uses 8 x SMs for
    every N, commit 2afa43cd); for wide rows fewer programs keep the (programs x N) partials
    small. Above 8192 quack splits each row over a cluster of CTAs (SMs / 2 clusters of two at
    16K, 2 x SMs beyond); our chunked path runs one program per row group, so it takes 2 x SMs
    (two programs per SM) there, fewer for rows so wide that the (programs, N) fp32 partials
    would pass ``MAX_PARTIALS`` (N > 131072 on 132 SMs). The same table serves sm_80 (not
    separately measured).
    """
    if n <= 256:
        return 16 * sms
    if n <= 1024:
        return 8 * sms
    if n <= 2048:
        return 4 * sms
    if n <= 4096:
        return 2 * sms
    if n <= 8192:
        return sms
    return max(1, min(2 * sms, MAX_PARTIALS // n))


def _block(n: int, reg_max: int, chunk: int):
    """(BLOCK_N, SINGLE_PASS) for a row of ``n`` elements."""
    block = common.next_pow2(n)
    if block <= reg_max:
        return block, True
    return chunk, False


def _table_arch(arch: int) -> int:
    # The interpreter (arch 0) runs the sm_90 defaults, so the tests exercise shipped configs.
    return arch if arch in _FWD_TABLES else 90


@functools.lru_cache(maxsize=None)
def fwd_candidates(arch: int, block_n: int, single: bool, light: bool) -> tuple:
    """The forward configs to choose from for a row of ``block_n`` (a power of two or the chunk).

    ``light``: 16-bit x and residual_out and no dropout (fewer registers than the other variants).
    """
    n = block_n if single else MAX_HIDDEN
    for limit, cands in _FWD_TABLES[_table_arch(arch)]:
        if n <= limit:
            return tuple(common.Config.of(num_warps=c[1], ROWS=c[0] if c[0] is not None else min(64, 2048 // block_n))
                         for c in cands if light or LIGHT not in c)
    raise AssertionError(block_n)


@functools.lru_cache(maxsize=None)
def bwd_candidates(arch: int, block_n: int, single: bool) -> tuple:
    """The backward configs to choose from for a row of ``block_n``."""
    n = block_n if single else MAX_HIDDEN
    for limit, cands in _BWD_TABLES[_table_arch(arch)]:
        if n <= limit:
            return tuple(common.Config.of(num_warps=w, ROWS=r, NUM_STAGES=s) for r, w, s in cands)
    raise AssertionError(block_n)


_FWD_CACHE = common.ConfigCache("add_norm_fwd")
_BWD_CACHE = common.ConfigCache("add_norm_bwd")


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------

def _keep_scale(dropout_p):
    """1 / (1 - p), rounded once (to fp32, as the launcher passes it)."""
    return 1.0 / (1.0 - dropout_p)


def _rows(t):
    """(rows, row stride) of a launcher's row tensor: (M, N) with any row stride (its last
    stride is 1), or contiguous of another rank (..., N)."""
    (m, _), (stride, _) = common.rows(t, "a norm operand")
    return m, stride


def add_norm_fwd(x, residual, weight, bias, seed, eps, dropout_p, is_rms, residual_dtype, store_residual,
                 weight_offset=False):
    """Launch the forward on x and residual of one shape (..., N): each (M, N) with any row stride
    and a unit last stride, or contiguous of any other rank (its M rows: every dim but the last).
    ``weight_offset``: the row is scaled by ``1 + weight`` (Gemma's RMSNorm) instead of
    ``weight``.

    ``seed`` is an int64 tensor of one element, or None when ``dropout_p == 0``. Returns a list:
    ``out`` (x's shape and dtype, contiguous), then ``residual_out`` (x's shape,
    ``residual_dtype``) when ``store_residual``, then ``mean`` ((M,) fp32) unless ``is_rms``,
    then ``rstd`` ((M,) fp32).
    """
    N = x.shape[-1]
    M, stride_x = _rows(x)
    dev = x.device
    shape = x.shape
    out = common.empty(shape, x.dtype, dev)
    outs = [out]
    rout = mean = None
    if store_residual:
        rout = common.empty(shape, residual_dtype, dev)
        outs.append(rout)
    if not is_rms:
        mean = common.empty((M,), torch.float32, dev)
        outs.append(mean)
    rstd = common.empty((M,), torch.float32, dev)
    outs.append(rstd)
    if M == 0:
        return outs
    has_res, has_w, has_b, has_drop = residual is not None, weight is not None, bias is not None, dropout_p > 0
    light = not has_drop and x.element_size() == 2 and (residual_dtype.itemsize == 2 or not store_residual)
    block, single = _block(N, FWD_REG_MAX if light else FWD_REG_MAX_HEAVY, FWD_CHUNK)
    arch = common.arch(dev)
    key = (arch, block, single, is_rms, has_res, has_w, has_b, has_drop, store_residual,
           x.dtype, residual_dtype, None if weight is None else weight.dtype, has_w and weight_offset)
    # Absent pointers get x (never dereferenced: their use is constexpr-guarded).
    args = (x, residual if has_res else x, weight if has_w else x, bias if has_b else x, out,
            rout if store_residual else x, mean if mean is not None else rstd, rstd, seed if has_drop else x,
            stride_x, _rows(residual)[1] if has_res else 0, M, N, 1.0 / N, eps, dropout_p,
            _keep_scale(dropout_p))
    cfg = _FWD_CACHE.chosen.get(key)
    if cfg is None:
        cfg = _FWD_CACHE.get(key, fwd_candidates(arch, block, single, light),
                             lambda c: _fwd_launch(c, M, args, key))
    _fwd_launch(cfg, M, args, key)
    return outs


@functools.lru_cache(maxsize=None)
def _fwd_constexprs(key):
    _, block, single, is_rms, has_res, has_w, has_b, has_drop, store_residual = key[:9]
    return dict(IS_RMS=is_rms, HAS_RES=has_res, HAS_W=has_w, HAS_B=has_b, HAS_DROPOUT=has_drop,
                STORE_ROUT=store_residual, SINGLE_PASS=single, BLOCK_N=block, INTERPRET=_INTERPRET,
                W_OFFSET=key[-1])


def _fwd_launch(cfg, M, args, key):
    rows = cfg["ROWS"]
    common.launch("add_norm_fwd", _add_norm_fwd_kernel, (-(-M // rows),), args, _fwd_constexprs(key), cfg)


def add_norm_bwd(dout, dout2, dresidual_out, h, weight, mean, rstd, seed, dropout_p, is_rms, x_dtype,
                 dres_dtype, dw_dtype, db_dtype, weight_offset=False):
    """Launch the backward. ``h`` is the saved residual_out (or x when it was not stored);
    ``weight_offset`` as the forward's (the weight's gradient is the same either way).

    ``dout`` (the gradient of out), ``dout2`` (a second gradient of out, summed with the first in
    the kernel; only with ``dout``, never with ``dresidual_out``: the compile check covers each
    alone) and ``dresidual_out`` may each be None; h and these are each (M, N) with any row
    stride and a unit last stride, or contiguous of another rank (rows as the forward's).
    Returns a list: ``dx`` (``x_dtype``, h's shape), then ``dresidual`` when ``dres_dtype`` is not
    None (a separate tensor: dropout or a dtype change between them; else dresidual is dx), then
    ``dweight`` in ``dw_dtype`` and ``dbias`` in ``db_dtype`` when those are not None (they need
    ``dout``).
    """
    N = h.shape[-1]
    M, stride_h = _rows(h)
    dev = h.device
    has_dout = dout is not None
    has_dw, has_db = dw_dtype is not None, db_dtype is not None
    if (has_dw or has_db or dout2 is not None) and not has_dout:
        raise ValueError("add_norm_bwd: dweight/dbias and dout2 need the gradient of out")
    if dout2 is not None and dresidual_out is not None:
        raise ValueError("add_norm_bwd: dout2 and dresidual_out are exclusive")
    dx = common.empty(h.shape, x_dtype, dev)
    outs = [dx]
    dres = dw = db = None
    if dres_dtype is not None:
        dres = common.empty(h.shape, dres_dtype, dev)
        outs.append(dres)
    if has_dw:
        dw = common.empty((N,), dw_dtype, dev)
        outs.append(dw)
    if has_db:
        db = common.empty((N,), db_dtype, dev)
        outs.append(db)
    arch = common.arch(dev)
    n_part, part_w, part_b = 0, dx, dx  # stand-ins, never dereferenced without HAS_DW / HAS_DB
    if M > 0:
        block, single = _block(N, BWD_REG_MAX, BWD_CHUNK)
        has_dout2, has_drout, has_drop = dout2 is not None, dresidual_out is not None, dropout_p > 0
        has_w = weight is not None and has_dout
        key = (arch, block, single, is_rms, has_dout, has_w, has_dw, has_db, has_drout, dres is not None,
               has_drop, has_dout2, x_dtype, h.dtype, None if weight is None else weight.dtype,
               has_w and weight_offset)
        # Absent pointers get h (never dereferenced: their use is constexpr-guarded).
        ptrs = (h, weight if has_w else h, dout if has_dout else h, dout2 if has_dout2 else h,
                dresidual_out if has_drout else h, mean if mean is not None else rstd, rstd,
                seed if has_drop else h, dx, dres if dres is not None else dx)
        strides = (stride_h, _rows(dout)[1] if has_dout else 0, _rows(dout2)[1] if has_dout2 else 0,
                   _rows(dresidual_out)[1] if has_drout else 0, M, N, 1.0 / N, dropout_p,
                   _keep_scale(dropout_p))
        target = bwd_programs(N, common.sm_count(dev))
        cfg = _BWD_CACHE.chosen.get(key)
        if cfg is None:
            cfg = _BWD_CACHE.get(key, bwd_candidates(arch, block, single),
                                 lambda c: _bwd_launch(c, M, N, target, ptrs, strides, key, dev))
        n_part, part_w, part_b = _bwd_launch(cfg, M, N, target, ptrs, strides, key, dev)
    if has_dw or has_db:
        cfg = _REDUCE_CONFIGS[arch if arch in _REDUCE_CONFIGS else 90]
        common.launch("add_norm_bwd_reduce", _reduce_partials_kernel, (-(-N // cfg["BLOCK_C"]),),
                      (part_w, part_b, dw if has_dw else dx, db if has_db else dx, n_part, N),
                      _reduce_constexprs(has_dw, has_db), cfg)
    return outs


@functools.lru_cache(maxsize=None)
def _bwd_constexprs(key):
    _, block, single, is_rms, has_dout, has_w, has_dw, has_db, has_drout, store_dres, has_drop, has_dout2 = \
        key[:12]
    return dict(IS_RMS=is_rms, HAS_DOUT=has_dout, HAS_DOUT2=has_dout2, HAS_W=has_w, HAS_DW=has_dw,
                HAS_DB=has_db, HAS_DROUT=has_drout, STORE_DRES=store_dres, HAS_DROPOUT=has_drop, SINGLE_PASS=single,
                BLOCK_N=block, INTERPRET=_INTERPRET, W_OFFSET=key[-1])


@functools.lru_cache(maxsize=None)
def _reduce_constexprs(has_dw, has_db):
    return dict(HAS_DW=has_dw, HAS_DB=has_db, INTERPRET=_INTERPRET)


def _bwd_launch(cfg, M, N, target, ptrs, strides, key, dev):
    """Launch the backward with ``cfg``; returns (number of partial rows, dweight partials, dbias partials).

    The grid is about ``target`` programs of ``rows_per_program`` rows (a multiple of ROWS),
    each with at least one row, so each writes its row of partials (sized for this grid).
    """
    rows = cfg["ROWS"]
    groups = -(-M // rows)
    per_program = -(-groups // min(target, groups)) * rows
    n_prog = -(-M // per_program)
    has_dw, has_db = key[6], key[7]
    # The (n_prog, N) partials, an allocation each (cheaper on the host than two views of one);
    # every row is written by its program (poisoned in the tests).
    part_w = part_b = ptrs[8]  # dx
    if has_dw:
        part_w = common.empty((n_prog, N), torch.float32, dev)
    if has_db:
        part_b = common.empty((n_prog, N), torch.float32, dev)
    common.launch("add_norm_bwd", _add_norm_bwd_kernel, (n_prog,), ptrs + (part_w, part_b) + strides + (per_program,),
                  _bwd_constexprs(key), cfg)
    return n_prog, part_w, part_b


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile specs: every config of both architectures' tables on its own
# architecture, at every BLOCK_N the launchers can pick. Every candidate compiles in the
# heaviest variants (LayerNorm, all fp32, every feature on: dropout, residual, bias, and one
# extra incoming gradient: residual_out's, or in the backward a second one of out, never both),
# and the LIGHT-only ones in the light LayerNorm variant; the default candidates also in the
# autocast variant (bf16 activations, fp32 residual stream and parameters, every feature) and
# in the benchmarked bf16 variants (Pre-LN's LayerNorm and RMSNorm with a residual and
# residual_out's gradient, no dropout; the backward of Post-LN's LayerNorm with dropout and out's
# second gradient), whose register counts are the ones that matter for speed.
# ---------------------------------------------------------------------------------------------

def _fwd_sig(xt, rt, wt):
    return {"X": f"*{xt}", "R": f"*{rt}", "W": f"*{wt}", "B": f"*{wt}", "OUT": f"*{xt}",
            "ROUT": f"*{rt}", "MEAN": "*fp32", "RSTD": "*fp32", "SEED": "*i64",
            "stride_x": "i64", "stride_r": "i64", "M": "i32", "N": "i32", "inv_n": "fp32", "eps": "fp32",
            "dropout_p": "fp32", "keep_scale": "fp32",
            "IS_RMS": "constexpr", "HAS_RES": "constexpr", "HAS_W": "constexpr", "HAS_B": "constexpr",
            "HAS_DROPOUT": "constexpr", "STORE_ROUT": "constexpr", "SINGLE_PASS": "constexpr",
            "BLOCK_N": "constexpr", "ROWS": "constexpr", "INTERPRET": "constexpr", "W_OFFSET": "constexpr"}


def _bwd_sig(xt, rt, wt):
    return {"H": f"*{rt}", "W": f"*{wt}", "DOUT": f"*{xt}", "DOUT2": f"*{xt}", "DROUT": f"*{rt}",
            "MEAN": "*fp32", "RSTD": "*fp32", "SEED": "*i64", "DX": f"*{xt}", "DRES": f"*{rt}",
            "DW_PART": "*fp32", "DB_PART": "*fp32",
            "stride_h": "i64", "stride_dout": "i64", "stride_dout2": "i64", "stride_drout": "i64",
            "M": "i32", "N": "i32", "inv_n": "fp32", "dropout_p": "fp32", "keep_scale": "fp32",
            "rows_per_program": "i32",
            "IS_RMS": "constexpr", "HAS_DOUT": "constexpr", "HAS_DOUT2": "constexpr", "HAS_W": "constexpr",
            "HAS_DW": "constexpr", "HAS_DB": "constexpr", "HAS_DROUT": "constexpr", "STORE_DRES": "constexpr",
            "HAS_DROPOUT": "constexpr", "SINGLE_PASS": "constexpr", "BLOCK_N": "constexpr",
            "ROWS": "constexpr", "NUM_STAGES": "constexpr", "INTERPRET": "constexpr", "W_OFFSET": "constexpr"}


def _reduce_sig(wt):
    return {"DW_PART": "*fp32", "DB_PART": "*fp32", "DW": f"*{wt}", "DB": f"*{wt}", "n_part": "i32", "N": "i32",
            "HAS_DW": "constexpr", "HAS_DB": "constexpr", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr",
            "NUM_STAGES": "constexpr", "INTERPRET": "constexpr"}


def _blocks(reg_max, chunk):
    return [(1 << i, True) for i in range(0, reg_max.bit_length())] + [(chunk, False)]


def _thin(specs, families) -> list:
    """The default test suite's share (``KernelSpec.ci``): ``families`` maps (arch, kernel) to its
    configs, each a list of (variant, index in ``specs``); the configs take the variants in
    turn, one each, and a variant the turn missed is built on its first config, so every config
    and every variant is compiled on each arch. The heavy check builds the rest."""
    ci, grouped = set(), set()
    for configs in families.values():
        seen = set()
        for turn, members in enumerate(configs.values()):
            variant, index = members[turn % len(members)]
            ci.add(index)
            seen.add(variant)
            grouped.update(i for _, i in members)
        for members in configs.values():
            for variant, index in members:
                if variant not in seen:
                    ci.add(index)
                    seen.add(variant)
    return [dataclasses.replace(s, ci=False) if i in grouped - ci else s for i, s in enumerate(specs)]


def aot_specs():
    from fused_block.kernels import aot  # only the compile check needs it

    fwd_aligned = ("stride_x", "stride_r", "N")
    bwd_aligned = ("stride_h", "stride_dout", "stride_dout2", "stride_drout", "N")
    # (x, residual, params, RMSNorm, dropout, every candidate, forward too, the backward's
    # incoming gradient: "drout" of residual_out, "dout2" a second one of out; the kernel never
    # gets both: see add_norm_bwd; the weight as 1 + w: Gemma's RMSNorm)
    variants = (("fp32", "fp32", "fp32", False, True, True, True, "drout", False),
                ("fp32", "fp32", "fp32", False, True, True, False, "dout2", False),
                ("bf16", "fp32", "fp32", False, True, False, True, "drout", False),
                ("bf16", "bf16", "bf16", False, False, False, True, "drout", False),
                ("bf16", "bf16", "bf16", True, False, False, True, "drout", False),
                ("bf16", "bf16", "bf16", True, False, False, True, "drout", True),
                ("bf16", "bf16", "bf16", False, True, False, False, "dout2", False),
                # a Post-LN layer's norm under CUDA's autocast (norm.as_autocast): x cast to fp32,
                # the 16-bit stream as residual, fp32 parameters, the output also the next stream
                ("fp32", "bf16", "fp32", False, True, False, True, "dout2", False))
    specs, families = [], {}

    def member(arch, kernel, cfg_key, variant):
        families.setdefault((arch, kernel), {}).setdefault(cfg_key, []).append((variant, len(specs)))

    for arch in common.ARCHS:
        for xt, rt, wt, is_rms, dropout, every, fwd, incoming, offset in variants:
            norm = ("rms" if is_rms else "ln") + (",dropout" if dropout else "") + (",1+w" if offset else "")
            flags = {"IS_RMS": is_rms, "HAS_W": True, "HAS_DROPOUT": dropout, "W_OFFSET": offset}
            light = xt == rt == "bf16" and not dropout
            for block, single in _blocks(FWD_REG_MAX if light else FWD_REG_MAX_HEAVY, FWD_CHUNK) if fwd else ():
                cands = fwd_candidates(arch, block, single, light)
                if not every:
                    heavy = fwd_candidates(arch, block, single, False) if block <= FWD_REG_MAX_HEAVY or not single else ()
                    only_light = [c for c in cands[1:] if c not in heavy] if light and not is_rms else []
                    cands = cands[:1] + tuple(only_light)
                for cfg in cands:
                    tag = f"sm{arch},N={block},{'reg' if single else 'chunked'},rows={cfg['ROWS']},{norm},{xt}/{rt}/{wt}"
                    member(arch, "fwd", (block, single, cfg.num_warps, *sorted(cfg.meta().items())), (norm, xt, rt, wt))
                    specs.append(aot.KernelSpec(
                        f"add_norm_fwd[{tag}]", _add_norm_fwd_kernel, _fwd_sig(xt, rt, wt),
                        dict(flags, HAS_B=not is_rms, HAS_RES=True, STORE_ROUT=True, SINGLE_PASS=single, BLOCK_N=block,
                             INTERPRET=False, **cfg.meta()),
                        num_warps=cfg.num_warps, aligned=fwd_aligned, archs=(arch,)))
            for block, single in _blocks(BWD_REG_MAX, BWD_CHUNK):
                cands = bwd_candidates(arch, block, single)
                for cfg in cands if every else cands[:1]:
                    tag = (f"sm{arch},N={block},{'reg' if single else 'chunked'},rows={cfg['ROWS']},"
                           f"stages={cfg['NUM_STAGES']},{norm},{incoming},{xt}/{rt}/{wt}")
                    member(arch, "bwd", (block, single, cfg.num_warps, *sorted(cfg.meta().items())),
                           (norm, incoming, xt, rt, wt))
                    specs.append(aot.KernelSpec(
                        f"add_norm_bwd[{tag}]", _add_norm_bwd_kernel, _bwd_sig(xt, rt, wt),
                        dict(flags, HAS_DOUT=True, HAS_DOUT2=incoming == "dout2", HAS_DW=True, HAS_DB=not is_rms,
                             HAS_DROUT=incoming == "drout", STORE_DRES=True, SINGLE_PASS=single, BLOCK_N=block,
                             INTERPRET=False, **cfg.meta()),
                        num_warps=cfg.num_warps, aligned=bwd_aligned, archs=(arch,)))
        for wt in ("fp32", "bf16"):
            cfg = _REDUCE_CONFIGS[arch]
            specs.append(aot.KernelSpec(
                f"add_norm_bwd_reduce[sm{arch},{wt}]", _reduce_partials_kernel, _reduce_sig(wt),
                dict(HAS_DW=True, HAS_DB=True, INTERPRET=False, **cfg.meta()),
                num_warps=cfg.num_warps, aligned=("N",), archs=(arch,)))
    return _thin(specs, families)
