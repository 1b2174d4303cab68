"""Residual add + dropout + LayerNorm/RMSNorm in one pass over memory, forward and backward.

Forward, per row (one program per row)::

    h            = dropout(x) + residual        # fp32 in registers, rounded to the residual dtype
    residual_out = h                            # stored in the residual dtype (optional)
    out          = (h - mean) * rstd * w + b    # RMSNorm: h * rstd * w

Mean and rstd are stored in fp32. The dropout mask is never stored: it is ``tl.rand(seed,
row * N + col) >= p``, regenerated in backward.

Backward: one kernel computes dx and dresidual (adding the gradient that arrives on
``residual_out``), with each program walking a strided set of rows and keeping fp32 partial
sums of dweight/dbias; the partials (``num_programs x N``, bounded by a multiple of the SM
count) are then summed in a second, deterministic step. No atomics.

A row that fits the register budget (``N <= SINGLE_PASS_MAX``) is held in registers; wider
rows (up to ``MAX_HIDDEN``) are processed in chunks: the forward merges per-chunk mean and M2
(Chan et al.) and re-reads the row, mostly from L2, to normalize; the backward takes two
passes: the per-row reductions first, then column chunk by column chunk over all its rows,
so the dweight/dbias partials of a chunk stay in registers.
"""
import torch
import triton
import triton.language as tl

from fused_block.kernels import common

MAX_HIDDEN = 65536
# Widest row kept entirely in registers, forward and backward (checked for spills on sm_80/90).
FWD_SINGLE_PASS_MAX = 8192
BWD_SINGLE_PASS_MAX = 4096
# Chunk widths of the wide-row path.
FWD_CHUNK = 4096
BWD_CHUNK = 2048


def _num_warps(block_n: int) -> int:
    # About 8 elements of a row per thread, up to 32 warps: the backward keeps six row-sized
    # fp32 arrays live (xhat, dy, w*dy, dh and the dweight/dbias partials).
    return min(max(block_n // 256, 1), 32)


@triton.jit
def _load_h(X, R, ROUT, SEED, row, cols, mask, N, dropout_p,
            HAS_RES: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_ROUT: tl.constexpr,
            INTERPRET: tl.constexpr):
    """dropout(x) + residual for one row (chunk), in fp32; 0 outside ``mask``.

    The sum is rounded to residual_out's dtype before it is normalized, so the backward, which
    reads the stored residual_out, recomputes exactly the xhat the forward used.
    """
    h = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = tl.rand(tl.load(SEED) + row, cols) >= dropout_p
        h = tl.where(keep, h / (1.0 - dropout_p), 0.0)
    if HAS_RES:
        h += tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_ROUT:
        h = common.cast(h, ROUT.dtype.element_ty, INTERPRET).to(tl.float32)
    return h


@triton.jit
def _add_norm_fwd_kernel(
    X, R, W, B, OUT, ROUT, MEAN, RSTD, SEED,
    stride_x, stride_r, stride_out, stride_rout,
    N, eps, dropout_p,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_ROUT: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    R += row * stride_r
    OUT += row * stride_out
    ROUT += row * stride_rout
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        h = _load_h(X, R, ROUT, SEED, row, cols, mask, N, dropout_p, HAS_RES, HAS_DROPOUT, STORE_ROUT, INTERPRET)
        if STORE_ROUT:
            tl.store(ROUT + cols, common.cast(h, ROUT.dtype.element_ty, INTERPRET), mask=mask)
        if IS_RMS:
            mean = 0.0
            var = tl.sum(h * h, axis=0) / N
        else:
            mean = tl.sum(h, axis=0) / N
            d = tl.where(mask, h - mean, 0.0)
            var = tl.sum(d * d, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        y = (h - mean) * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask).to(tl.float32)
        tl.store(OUT + cols, common.cast(y, OUT.dtype.element_ty, INTERPRET), mask=mask)
    else:
        # Pass 1: residual_out and the statistics, merging chunk (mean, M2) pairs.
        mean = tl.zeros((), tl.float32)
        m2 = tl.zeros((), tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = _load_h(X, R, ROUT, SEED, row, cols, mask, N, dropout_p, HAS_RES, HAS_DROPOUT, STORE_ROUT, INTERPRET)
            if STORE_ROUT:
                tl.store(ROUT + cols, common.cast(h, ROUT.dtype.element_ty, INTERPRET), mask=mask)
            if IS_RMS:
                m2 += tl.sum(h * h, axis=0)
            else:
                n_b = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                mean_b = tl.sum(h, axis=0) / n_b
                d = tl.where(mask, h - mean_b, 0.0)
                total = start + n_b
                delta = mean_b - mean
                mean += delta * (n_b / total)
                m2 += tl.sum(d * d, axis=0) + delta * delta * (start * n_b / total)
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        if IS_RMS:
            mean = 0.0
        # Pass 2: recompute h exactly (same loads, same dropout mask) and normalize.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = _load_h(X, R, ROUT, SEED, row, cols, mask, N, dropout_p, HAS_RES, HAS_DROPOUT, STORE_ROUT, INTERPRET)
            y = (h - mean) * rstd
            if HAS_W:
                y = y * tl.load(W + cols, mask=mask).to(tl.float32)
            if HAS_B:
                y = y + tl.load(B + cols, mask=mask).to(tl.float32)
            tl.store(OUT + cols, common.cast(y, OUT.dtype.element_ty, INTERPRET), mask=mask)
    if not IS_RMS:
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _bwd_row_chunk(H, W, DOUT, cols, mask, mean, rstd, IS_RMS: tl.constexpr, HAS_W: tl.constexpr):
    """xhat, dout and w * dout of one row (chunk), fp32, 0 outside ``mask``."""
    h = tl.load(H + cols, mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (h - mean) * rstd, 0.0)
    dy = tl.load(DOUT + cols, mask=mask, other=0.0).to(tl.float32)
    wdy = dy
    if HAS_W:
        wdy = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    return xhat, dy, wdy


@triton.jit
def _row_stats(MEAN, RSTD, row, IS_RMS: tl.constexpr):
    """The forward's saved (mean, rstd) of ``row`` (mean 0 for RMSNorm)."""
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(MEAN + row)
    return mean, tl.load(RSTD + row)


@triton.jit
def _dh(xhat, wdy, c1, c2, rstd, IS_RMS: tl.constexpr):
    """Gradient reaching residual_out through the norm: (w*dy - xhat*c1 - c2) * rstd."""
    if IS_RMS:
        return (wdy - xhat * c1) * rstd
    else:
        return (wdy - (xhat * c1 + c2)) * rstd


@triton.jit
def _bwd_store_grads(DX, DRES, DROUT, SEED, row, cols, mask, N, dropout_p, dh,
                     HAS_DROUT: tl.constexpr, STORE_DRES: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """dh (+ incoming grad on residual_out) -> dresidual, and through dropout -> dx."""
    if HAS_DROUT:
        dh += tl.load(DROUT + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_DRES:
        tl.store(DRES + cols, common.cast(dh, DRES.dtype.element_ty, INTERPRET), mask=mask)
    if HAS_DROPOUT:
        keep = tl.rand(tl.load(SEED) + row, cols) >= dropout_p
        dh = tl.where(keep, dh / (1.0 - dropout_p), 0.0)
    tl.store(DX + cols, common.cast(dh, DX.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _add_norm_bwd_kernel(
    H, W, DOUT, DROUT, MEAN, RSTD, SEED, DX, DRES, DW_PART, DB_PART, C1, C2,
    stride_h, stride_dout, stride_drout, stride_dx, stride_dres,
    M, N, dropout_p, rows_per_program,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DROUT: tl.constexpr,
    STORE_DRES: tl.constexpr, HAS_DROPOUT: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    DW_PART += pid.to(tl.int64) * N
    DB_PART += pid.to(tl.int64) * N
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        dw = tl.zeros((BLOCK_N,), tl.float32)
        db = tl.zeros((BLOCK_N,), tl.float32)
        for row in range(row_start, row_end):
            mean, rstd = _row_stats(MEAN, RSTD, row, IS_RMS)
            xhat, dy, wdy = _bwd_row_chunk(H + row * stride_h, W, DOUT + row * stride_dout, cols, mask,
                                           mean, rstd, IS_RMS, HAS_W)
            if HAS_W:
                dw += dy * xhat
            if HAS_B:
                db += dy
            c2 = 0.0
            if not IS_RMS:
                c2 = tl.sum(wdy, axis=0) / N
            dh = _dh(xhat, wdy, tl.sum(xhat * wdy, axis=0) / N, c2, rstd, IS_RMS)
            _bwd_store_grads(DX + row * stride_dx, DRES + row * stride_dres, DROUT + row * stride_drout,
                             SEED, row, cols, mask, N, dropout_p, dh, HAS_DROUT, STORE_DRES, HAS_DROPOUT, INTERPRET)
        if HAS_W:
            tl.store(DW_PART + cols, dw, mask=mask)
        if HAS_B:
            tl.store(DB_PART + cols, db, mask=mask)
    else:
        # Wide rows. Phase 1: the row reductions c1 = mean(xhat * w * dy), c2 = mean(w * dy),
        # kept in the C1/C2 scratch. Phase 2: column chunk by column chunk, every row's dx and
        # the chunk's dweight/dbias partials in registers (no read-modify-write of partials).
        for row in range(row_start, row_end):
            mean, rstd = _row_stats(MEAN, RSTD, row, IS_RMS)
            s1 = tl.zeros((), tl.float32)
            s2 = tl.zeros((), tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < N
                xhat, dy, wdy = _bwd_row_chunk(H + row * stride_h, W, DOUT + row * stride_dout, cols, mask,
                                               mean, rstd, IS_RMS, HAS_W)
                s1 += tl.sum(xhat * wdy, axis=0)
                s2 += tl.sum(wdy, axis=0)
            tl.store(C1 + row, s1 / N)
            tl.store(C2 + row, s2 / N)
        tl.debug_barrier()
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            dw = tl.zeros((BLOCK_N,), tl.float32)
            db = tl.zeros((BLOCK_N,), tl.float32)
            for row in range(row_start, row_end):
                mean, rstd = _row_stats(MEAN, RSTD, row, IS_RMS)
                xhat, dy, wdy = _bwd_row_chunk(H + row * stride_h, W, DOUT + row * stride_dout, cols, mask,
                                               mean, rstd, IS_RMS, HAS_W)
                if HAS_W:
                    dw += dy * xhat
                if HAS_B:
                    db += dy
                dh = _dh(xhat, wdy, tl.load(C1 + row), tl.load(C2 + row), rstd, IS_RMS)
                _bwd_store_grads(DX + row * stride_dx, DRES + row * stride_dres, DROUT + row * stride_drout,
                                 SEED, row, cols, mask, N, dropout_p, dh, HAS_DROUT, STORE_DRES, HAS_DROPOUT, INTERPRET)
            if HAS_W:
                tl.store(DW_PART + cols, dw, mask=mask)
            if HAS_B:
                tl.store(DB_PART + cols, db, mask=mask)


def _block(n: int, single_max: int, chunk: int):
    """(BLOCK_N, SINGLE_PASS) for a row of ``n`` elements."""
    block = triton.next_power_of_2(n)
    if block <= single_max:
        return block, True
    return chunk, False


def add_norm_fwd(x, residual, weight, bias, seed, eps, dropout_p, is_rms, residual_dtype, store_residual):
    """Launch the forward on 2-D row-major-in-the-last-dim inputs (M, N).

    Returns ``(out, residual_out, mean, rstd)``: out in x's dtype, residual_out (M, N) in
    ``residual_dtype`` (an empty tensor when not ``store_residual``), mean (M,) fp32 (empty
    for RMSNorm), rstd (M,) fp32.
    """
    M, N = x.shape
    dev = x.device
    out = common.empty((M, N), x.dtype, dev)
    rout = common.empty((M, N) if store_residual else (0,), residual_dtype, dev)
    mean = common.empty((0,) if is_rms else (M,), torch.float32, dev)
    rstd = common.empty((M,), torch.float32, dev)
    if M == 0:
        return out, rout, mean, rstd
    block, single = _block(N, FWD_SINGLE_PASS_MAX, FWD_CHUNK)
    dummy = out  # stands in for absent pointers; never dereferenced (constexpr-guarded)
    common.count_launch("add_norm_fwd")
    _add_norm_fwd_kernel[(M,)](
        x, residual if residual is not None else dummy, weight if weight is not None else dummy,
        bias if bias is not None else dummy, out, rout if store_residual else dummy,
        mean if not is_rms else rstd, rstd, seed if dropout_p > 0 else dummy,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        rout.stride(0) if store_residual else 0,
        N, eps, dropout_p,
        IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None,
        HAS_B=bias is not None, HAS_DROPOUT=dropout_p > 0, STORE_ROUT=store_residual,
        SINGLE_PASS=single, BLOCK_N=block, INTERPRET=common.interpreting(), num_warps=_num_warps(block),
    )
    return out, rout, mean, rstd


def add_norm_bwd(dout, dresidual_out, h, weight, has_bias, mean, rstd, seed, dropout_p, is_rms,
                 x_dtype, residual_dtype, store_dresidual):
    """Launch the backward. ``h`` is the saved residual_out (or x when it was not stored).

    Returns ``(dx, dresidual, dweight, dbias)``; dresidual is empty unless
    ``store_dresidual``; dweight/dbias are fp32 sums of the per-program partials (empty when
    absent).
    """
    M, N = h.shape
    dev = h.device
    dx = common.empty((M, N), x_dtype, dev)
    dres = common.empty((M, N) if store_dresidual else (0,), residual_dtype, dev)
    has_w = weight is not None
    n_prog = max(1, min(M, 4 * common.sm_count(dev)))
    rows_per_program = triton.cdiv(M, n_prog) if M else 0
    n_prog = triton.cdiv(M, rows_per_program) if M else 0
    dw_part = common.empty((n_prog, N) if has_w else (0,), torch.float32, dev)
    db_part = common.empty((n_prog, N) if has_bias else (0,), torch.float32, dev)
    if M > 0:
        block, single = _block(N, BWD_SINGLE_PASS_MAX, BWD_CHUNK)
        dummy = dx
        c1, c2 = (dummy, dummy) if single else torch.empty((2, M), dtype=torch.float32, device=dev).unbind(0)
        common.count_launch("add_norm_bwd")
        _add_norm_bwd_kernel[(n_prog,)](
            h, weight if has_w else dummy, dout, dresidual_out if dresidual_out is not None else dummy,
            mean if not is_rms else rstd, rstd, seed if dropout_p > 0 else dummy, dx,
            dres if store_dresidual else dummy, dw_part if has_w else dummy, db_part if has_bias else dummy,
            c1, c2,
            h.stride(0), dout.stride(0), dresidual_out.stride(0) if dresidual_out is not None else 0,
            dx.stride(0), dres.stride(0) if store_dresidual else 0,
            M, N, dropout_p, rows_per_program,
            IS_RMS=is_rms, HAS_W=has_w, HAS_B=has_bias, HAS_DROUT=dresidual_out is not None,
            STORE_DRES=store_dresidual, HAS_DROPOUT=dropout_p > 0, SINGLE_PASS=single,
            BLOCK_N=block, INTERPRET=common.interpreting(), num_warps=_num_warps(block),
        )
    dw = dw_part.sum(0) if has_w else dw_part
    db = db_part.sum(0) if has_bias else db_part
    if M == 0:
        dw = torch.zeros((N,), dtype=torch.float32, device=dev) if has_w else dw
        db = torch.zeros((N,), dtype=torch.float32, device=dev) if has_bias else db
    return dx, dres, dw, db


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile specs: every BLOCK_N the launchers can pick, both passes, LayerNorm and
# RMSNorm, with every feature on; fp32 and a mixed bf16-activation / fp32-residual-and-weight
# variant (the autocast case).
# ---------------------------------------------------------------------------------------------

def _fwd_sig(xt, rt, wt):
    return {"X": f"*{xt}", "R": f"*{rt}", "W": f"*{wt}", "B": f"*{wt}", "OUT": f"*{xt}",
            "ROUT": f"*{rt}", "MEAN": "*fp32", "RSTD": "*fp32", "SEED": "*i64",
            "stride_x": "i64", "stride_r": "i64", "stride_out": "i64", "stride_rout": "i64",
            "N": "i32", "eps": "fp32", "dropout_p": "fp32",
            "IS_RMS": "constexpr", "HAS_RES": "constexpr", "HAS_W": "constexpr", "HAS_B": "constexpr",
            "HAS_DROPOUT": "constexpr", "STORE_ROUT": "constexpr", "SINGLE_PASS": "constexpr",
            "BLOCK_N": "constexpr", "INTERPRET": "constexpr"}


def _bwd_sig(xt, rt, wt):
    return {"H": f"*{rt}", "W": f"*{wt}", "DOUT": f"*{xt}", "DROUT": f"*{rt}", "MEAN": "*fp32",
            "RSTD": "*fp32", "SEED": "*i64", "DX": f"*{xt}", "DRES": f"*{rt}", "DW_PART": "*fp32",
            "DB_PART": "*fp32", "C1": "*fp32", "C2": "*fp32", "stride_h": "i64", "stride_dout": "i64", "stride_drout": "i64",
            "stride_dx": "i64", "stride_dres": "i64", "M": "i32", "N": "i32", "dropout_p": "fp32",
            "rows_per_program": "i32",
            "IS_RMS": "constexpr", "HAS_W": "constexpr", "HAS_B": "constexpr", "HAS_DROUT": "constexpr",
            "STORE_DRES": "constexpr", "HAS_DROPOUT": "constexpr", "SINGLE_PASS": "constexpr",
            "BLOCK_N": "constexpr", "INTERPRET": "constexpr"}


def aot_specs():
    from fused_block.kernels import aot  # only the compile check needs it

    specs = []
    blocks = [(1 << i, True) for i in range(0, 14)] + [(FWD_CHUNK, False), (BWD_CHUNK, False)]
    for xt, rt, wt in (("fp32", "fp32", "fp32"), ("bf16", "fp32", "fp32")):
        for is_rms in (False, True):
            flags = {"IS_RMS": is_rms, "HAS_B": not is_rms, "HAS_W": True, "HAS_DROPOUT": True}
            norm = "rms" if is_rms else "ln"
            for block, single in blocks:
                tag = f"BLOCK_N={block},{'single' if single else 'chunked'},{norm},x={xt},res={rt},w={wt}"
                if block <= FWD_SINGLE_PASS_MAX if single else block == FWD_CHUNK:
                    specs.append(aot.KernelSpec(
                        f"add_norm_fwd[{tag}]", _add_norm_fwd_kernel, _fwd_sig(xt, rt, wt),
                        dict(flags, HAS_RES=True, STORE_ROUT=True, SINGLE_PASS=single, BLOCK_N=block, INTERPRET=False),
                        num_warps=_num_warps(block), aligned=("stride_x", "stride_r", "stride_out", "stride_rout")))
                if block <= BWD_SINGLE_PASS_MAX if single else block == BWD_CHUNK:
                    specs.append(aot.KernelSpec(
                        f"add_norm_bwd[{tag}]", _add_norm_bwd_kernel, _bwd_sig(xt, rt, wt),
                        dict(flags, HAS_DROUT=True, STORE_DRES=True, SINGLE_PASS=single, BLOCK_N=block, INTERPRET=False),
                        num_warps=_num_warps(block),
                        aligned=("stride_h", "stride_dout", "stride_drout", "stride_dx", "stride_dres")))
    return specs
