"""GEMM with a fused epilogue (bias, activation, residual), and the activation's backward.

``C = act(A @ B + bias) + residual`` with A (M, K) and B (K, N) given by arbitrary strides, so
``x @ W.T``, ``dPre @ W`` and ``dY.T @ X`` all run without a copy. Accumulation is fp32; the
epilogue works on the fp32 tile in registers and casts once when it stores.

- Forward epilogue: ``+ bias`` (per column), optional store of the pre-activation (what the
  backward needs), activation (none, erf GELU, tanh GELU, ReLU), dropout (``HAS_DROPOUT``),
  ``+ residual``.
- Dropout: element (row, col) of the (M, N) output is kept when ``tl.rand(seed + row, col) >=
  p`` (row int64, col int32; the formula of the norm kernels) and kept values are scaled by
  ``1 / (1 - p)``. The mask is never stored: the backward regenerates it from the seed, and
  :func:`dropout_mask` materializes it for tests.
- Gradient epilogue (``ACT_GRAD``, cuBLASLt's DGELU): ``dPre = (A @ B) * keep / (1 - p) *
  act'(pre)`` (the keep factor only with ``HAS_DROPOUT``) is stored,
  and the column sums of dPre over each 64-row slice of the tile go to an fp32 buffer
  (``PARTIAL_ROWS`` rows of dPre per buffer row), which the launcher reduces; the bias
  gradient is thus deterministic, without atomics, and independent of the tile chosen.
- Program order is grouped (``GROUP_M`` row tiles share a column tile) for L2 reuse. Rows and
  columns past the edge wrap around inside the main loop (valid addresses, results never
  stored), so only K needs masks, and not even K when it is a multiple of ``BLOCK_K``.
- Row offsets are int64, so tensors past 2^31 elements work.
- fp32 operands: on the GPU ``tl.dot`` runs them in TF32 (about 1e-3 relative error per
  product, like torch with ``allow_tf32=True``); the interpreter computes them in IEEE fp32.
"""
import torch
import triton
import triton.language as tl

from fused_block.kernels import common

ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
# Rows of dPre summed into one row of the bias-gradient partial buffer. Every BLOCK_M is a
# multiple of it, so the buffer's layout does not depend on the autotuned tile.
PARTIAL_ROWS = 64
GROUP_M = 8

_SQRT_1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_TANH_K0 = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_TANH_K1 = tl.constexpr(0.044715)


@triton.jit
def _act(x, ACTIVATION: tl.constexpr):
    """The activation on an fp32 tile: 0 none, 1 erf GELU, 2 tanh GELU, 3 ReLU."""
    y = x
    if ACTIVATION == 1:
        y = 0.5 * x * (1.0 + tl.erf(x * _SQRT_1_2))
    elif ACTIVATION == 2:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation for large |u|.
        y = x * tl.sigmoid(2.0 * _TANH_K0 * (x + _TANH_K1 * x * x * x))
    elif ACTIVATION == 3:
        y = tl.where(x < 0.0, 0.0, x)  # keeps NaN, like torch.relu
    return y


@triton.jit
def _act_grad(x, ACTIVATION: tl.constexpr):
    """d act(x) / dx on an fp32 tile (ReLU: 0 at x == 0, like torch)."""
    d = tl.full(x.shape, 1.0, tl.float32)
    if ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT_1_2))
        d = cdf + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    elif ACTIVATION == 2:
        # With s = sigmoid(2u): 0.5 * (1 + tanh(u)) = s and 1 - tanh(u)^2 = 4 s sigmoid(-2u),
        # which does not cancel where tanh(u) is near +-1.
        x2 = x * x
        u2 = 2.0 * _TANH_K0 * (x + _TANH_K1 * x2 * x)
        s = tl.sigmoid(u2)
        d = s + 2.0 * x * s * tl.sigmoid(-u2) * _TANH_K0 * (1.0 + 3.0 * _TANH_K1 * x2)
    elif ACTIVATION == 3:
        d = tl.where(x > 0.0, 1.0, 0.0)
    return d


@triton.jit
def _keep(seed, rows, cols, dropout_p):
    """Dropout keep-mask of the (rows, cols) piece: ``tl.rand(seed + row, col) >= p``.

    rows int64 (absolute row index), cols int32 (absolute column index).
    """
    return tl.rand(seed + rows[:, None], cols[None, :]) >= dropout_p


@triton.jit
def _halves(acc):
    """The left and right column halves of a 2-D tile (registers only; no data movement)."""
    BM: tl.constexpr = acc.shape[0]
    HALF: tl.constexpr = acc.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(acc, (BM, 2, HALF)), (0, 2, 1)))


@triton.jit
def _epilogue(acc, rm, rn, mask_m, C, BIAS, RES, AUX, PART, M, N,
              stride_cm, stride_cn, stride_bias, stride_rm, stride_rn, stride_xm, stride_xn, pid_m,
              seed, row0, dropout_p,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              STORE_PRE: tl.constexpr, ACT_GRAD: tl.constexpr, HAS_DBIAS: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, EVEN_MN: tl.constexpr, PARTIAL_ROWS: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Finish one fp32 (rows, columns rn) piece of the tile. C, RES and AUX already point at
    the tile's first row and rm counts rows from there, so the offsets stay int32; the dropout
    mask uses the absolute row ``row0 + rm`` (int64)."""
    mask_n = rn < N
    mask = mask_m[:, None] & mask_n[None, :]
    c_ptrs = C + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    x_ptrs = AUX + rm[:, None] * stride_xm + rn[None, :] * stride_xn
    if ACT_GRAD:
        if HAS_DROPOUT:
            keep = _keep(seed, row0 + rm, rn, dropout_p)
            acc = tl.where(keep, acc * (1.0 / (1.0 - dropout_p)), 0.0)
        if ACTIVATION != 0:
            if EVEN_MN:
                pre = tl.load(x_ptrs).to(tl.float32)
            else:
                pre = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            acc = acc * _act_grad(pre, ACTIVATION)
        if EVEN_MN:
            tl.store(c_ptrs, common.cast(acc, C.dtype.element_ty, INTERPRET))
        else:
            tl.store(c_ptrs, common.cast(acc, C.dtype.element_ty, INTERPRET), mask=mask)
        if HAS_DBIAS:
            BLOCK_M: tl.constexpr = acc.shape[0]
            SLICES: tl.constexpr = BLOCK_M // PARTIAL_ROWS
            d = tl.where(mask_m[:, None], acc, 0.0)  # clamped rows past M must not count
            part = tl.sum(tl.reshape(d, (SLICES, PARTIAL_ROWS, acc.shape[1])), axis=1)
            rp = pid_m * SLICES + tl.arange(0, SLICES)
            p_mask = (rp < tl.cdiv(M, PARTIAL_ROWS))[:, None] & mask_n[None, :]
            tl.store(PART + rp.to(tl.int64)[:, None] * N + rn[None, :], part, mask=p_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if STORE_PRE:
            if EVEN_MN:
                tl.store(x_ptrs, common.cast(acc, AUX.dtype.element_ty, INTERPRET))
            else:
                tl.store(x_ptrs, common.cast(acc, AUX.dtype.element_ty, INTERPRET), mask=mask)
        if HAS_DROPOUT:  # before the activation: Philox's state dies before its temporaries live
            keep = _keep(seed, row0 + rm, rn, dropout_p)
        acc = _act(acc, ACTIVATION)
        if HAS_DROPOUT:
            acc = tl.where(keep, acc * (1.0 / (1.0 - dropout_p)), 0.0)
        if HAS_RESIDUAL:
            r_ptrs = RES + rm[:, None] * stride_rm + rn[None, :] * stride_rn
            if EVEN_MN:
                acc += tl.load(r_ptrs).to(tl.float32)
            else:
                acc += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        if EVEN_MN:
            tl.store(c_ptrs, common.cast(acc, C.dtype.element_ty, INTERPRET))
        else:
            tl.store(c_ptrs, common.cast(acc, C.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit(do_not_specialize=["M_BUCKET"])
def _matmul_kernel(
    A, B, C, BIAS, RES, AUX, PART, SEED,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_bias, stride_rm, stride_rn, stride_xm, stride_xn,
    M_BUCKET,  # autotune key only: M rounded up to a power of two
    dropout_p,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, ACT_GRAD: tl.constexpr, HAS_DBIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPI_SPLIT: tl.constexpr,
    DROP_SPLIT: tl.constexpr, GROUP_M: tl.constexpr, PARTIAL_ROWS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of C = epilogue(A @ B).

    Forward (``ACT_GRAD`` off): C = act(A @ B + BIAS) + RES; AUX receives A @ B + BIAS when
    ``STORE_PRE``. Gradient (``ACT_GRAD`` on): AUX is the saved pre-activation, C = (A @ B) *
    act'(AUX), and with ``HAS_DBIAS`` PART (cdiv(M, PARTIAL_ROWS), N) fp32 gets C's column
    sums per PARTIAL_ROWS rows. The epilogue runs on EPI_SPLIT column slices of the tile in
    turn (DROP_SPLIT with dropout, whose Philox state is four words per element), which keeps
    its temporaries small next to a 128x256 accumulator. With
    ``HAS_DROPOUT`` the int64 seed at SEED drops elements after the activation (forward) or
    scales the product by the regenerated keep / (1 - dropout_p) (gradient).
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles walk the column tiles together, so B's tiles stay in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # The tile's first row/column go in int64 into the scalar base pointers; in-tile offsets
    # are int32. Rows/columns past the edge wrap around to the tile's first ones: loads need no
    # masks along M and N (what those rows/columns produce is never stored), and the modulo
    # keeps the compiler's contiguity facts, so loads stay vectorized and pipelined.
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ram = rm % (M - row0)
    rbn = rn % (N - col0)
    a_ptrs = A + row0.to(tl.int64) * stride_am + (ram[:, None] * stride_am + rk[None, :] * stride_ak)
    b_ptrs = B + col0.to(tl.int64) * stride_bn + (rk[:, None] * stride_bk + rbn[None, :] * stride_bn)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = common.dot(a, b, acc, INTERPRET)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # ---- epilogue, on the fp32 tile in registers --------------------------------------------
    row0_64 = row0.to(tl.int64)
    C += row0_64 * stride_cm
    RES += row0_64 * stride_rm
    AUX += row0_64 * stride_xm
    mask_m = rm < M - row0
    rn = col0 + rn
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    SPLIT: tl.constexpr = DROP_SPLIT if HAS_DROPOUT else EPI_SPLIT
    if SPLIT == 1:
        _epilogue(acc, rm, rn, mask_m, C, BIAS, RES, AUX, PART, M, N, stride_cm, stride_cn,
                  stride_bias, stride_rm, stride_rn, stride_xm, stride_xn, pid_m,
                  seed, row0_64, dropout_p,
                  HAS_BIAS, ACTIVATION, HAS_RESIDUAL, STORE_PRE, ACT_GRAD, HAS_DBIAS, HAS_DROPOUT,
                  EVEN_MN, PARTIAL_ROWS, INTERPRET)
    else:
        tl.static_assert(SPLIT == 2 or SPLIT == 4 or SPLIT == 8 or SPLIT == 16)
        W: tl.constexpr = BLOCK_N // SPLIT
        acc_lo, acc_hi = _halves(acc)
        if SPLIT == 2:
            pieces = (acc_lo, acc_hi)
        else:
            acc0, acc1 = _halves(acc_lo)
            acc2, acc3 = _halves(acc_hi)
            if SPLIT == 4:
                pieces = (acc0, acc1, acc2, acc3)
            else:
                p0, p1 = _halves(acc0)
                p2, p3 = _halves(acc1)
                p4, p5 = _halves(acc2)
                p6, p7 = _halves(acc3)
                if SPLIT == 8:
                    pieces = (p0, p1, p2, p3, p4, p5, p6, p7)
                else:
                    q0, q1 = _halves(p0)
                    q2, q3 = _halves(p1)
                    q4, q5 = _halves(p2)
                    q6, q7 = _halves(p3)
                    q8, q9 = _halves(p4)
                    q10, q11 = _halves(p5)
                    q12, q13 = _halves(p6)
                    q14, q15 = _halves(p7)
                    pieces = (q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15)
        for i in tl.static_range(SPLIT):
            _epilogue(pieces[i], rm, col0 + i * W + tl.arange(0, W), mask_m, C, BIAS, RES, AUX,
                      PART, M, N, stride_cm, stride_cn, stride_bias, stride_rm, stride_rn,
                      stride_xm, stride_xn, pid_m, seed, row0_64, dropout_p, HAS_BIAS, ACTIVATION,
                      HAS_RESIDUAL, STORE_PRE, ACT_GRAD, HAS_DBIAS, HAS_DROPOUT, EVEN_MN,
                      PARTIAL_ROWS, INTERPRET)


@triton.jit
def _act_grad_kernel(
    G, PRE, DPRE, PART, SEED,
    M, N, stride_gm, stride_gn, stride_pm, stride_pn, dropout_p,
    ACTIVATION: tl.constexpr, STORE_DPRE: tl.constexpr, HAS_DBIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dPre = G * keep / (1 - p) * act'(PRE) on a (BLOCK_M, BLOCK_N) tile (the keep factor,
    the GEMM epilogue's regenerated dropout mask, only with ``HAS_DROPOUT``); PART row pid_m
    gets its column sums.

    With ``ACTIVATION == 0`` and ``STORE_DPRE`` off this is the bias gradient of G alone.
    BLOCK_M equals PARTIAL_ROWS, so PART has the layout of the GEMM's gradient epilogue.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    mask_n = rn < N
    mask = (rm < M)[:, None] & mask_n[None, :]
    g = tl.load(G + rm64[:, None] * stride_gm + rn[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _keep(tl.load(SEED), rm64, rn, dropout_p)
        g = tl.where(keep, g * (1.0 / (1.0 - dropout_p)), 0.0)
    if ACTIVATION != 0:
        pre = tl.load(PRE + rm64[:, None] * stride_pm + rn[None, :] * stride_pn, mask=mask, other=0.0)
        g = g * _act_grad(pre.to(tl.float32), ACTIVATION)
    if STORE_DPRE:
        tl.store(DPRE + rm64[:, None] * N + rn[None, :], common.cast(g, DPRE.dtype.element_ty, INTERPRET),
                 mask=mask)
    if HAS_DBIAS:
        tl.store(PART + pid_m.to(tl.int64) * N + rn, tl.sum(tl.where(mask, g, 0.0), axis=0), mask=mask_n)


@triton.jit
def _dropout_mask_kernel(SEED, OUT, M, N, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT (M, N) int8 = the keep-mask the GEMM epilogue and ``_act_grad_kernel`` use (tests only)."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _keep(tl.load(SEED), rm, rn, dropout_p)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(OUT + rm[:, None] * N + rn[None, :], keep.to(tl.int8), mask=mask)


# ---------------------------------------------------------------------------------------------
# configs and launchers
# ---------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, EPI_SPLIT). The first two are
# Hopper-sized: one 128x256 wgmma tile per two warpgroups; 4 stages need 192 KiB of shared
# memory (H100/H200). Tiles with 128 accumulator registers per thread run the epilogue on four
# column slices in turn (EPI_SPLIT=4) so that its temporaries do not spill.
CONFIGS = (
    (128, 256, 64, 8, 3, 4),
    (128, 256, 64, 8, 4, 4),
    (128, 128, 64, 8, 4, 1),
    (128, 128, 32, 4, 4, 4),
    (64, 128, 64, 4, 4, 1),
    (64, 64, 64, 4, 4, 1),
)
# The interpreter runs one config. Its cost is per program and per op (nested jit calls
# included) rather than per element, so a large tile with an unsliced epilogue is quickest;
# tests swap in other tiles to cover the sliced epilogue and multi-tile grids.
INTERPRETER_CONFIG = (256, 256, 128, 4, 1, 1)
# With dropout the epilogue's slices hold at most this many elements per thread (Philox keeps
# four 32-bit words per element), in at most 8 slices.
DROP_ELEMS_PER_THREAD = 8


def drop_split(cfg):
    """The epilogue's column-slice count with dropout for config ``cfg``."""
    bm, bn, _, warps, _, split = cfg
    per_thread = bm * bn // (32 * warps)
    return min(max(split, per_thread // DROP_ELEMS_PER_THREAD, 1), 16)
ACT_GRAD_BLOCK_N = 128
ACT_GRAD_DROP_BLOCK_N = 64  # with dropout: Philox's state per element must not spill


def _smem_bytes(cfg, elem_size):
    bm, bn, bk, _, stages, _ = cfg
    return stages * (bm * bk + bk * bn) * elem_size


def _prune(configs, named_args, **kwargs):
    """Drop configs that do not fit the device's shared memory or are far larger than M, N."""
    a = named_args["A"]
    m, n = named_args["M"], named_args["N"]
    props = torch.cuda.get_device_properties(a.device)
    smem = getattr(props, "shared_memory_per_block_optin", 99 * 1024)
    kept = []
    for c in configs:
        kw = c.kwargs
        cfg = (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], c.num_warps, c.num_stages, kw["EPI_SPLIT"])
        if _smem_bytes(cfg, a.element_size()) > smem:
            continue
        if kw["BLOCK_M"] > 64 and m <= 64:  # small M (decoding): no 128-row tiles
            continue
        if kw["BLOCK_N"] > 128 and n <= 128:
            continue
        kept.append(c)
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


_tuned_matmul_kernel = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "EPI_SPLIT": e,
                            "DROP_SPLIT": drop_split((bm, bn, bk, w, s, e))},
                           num_warps=w, num_stages=s)
             for bm, bn, bk, w, s, e in CONFIGS],
    key=["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "HAS_RESIDUAL", "STORE_PRE", "ACT_GRAD",
         "HAS_DBIAS", "HAS_DROPOUT", "stride_ak", "stride_bk"],
    prune_configs_by={"early_config_prune": _prune},
)(triton.heuristics({
    "EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
    "EVEN_MN": lambda args: args["M"] % args["BLOCK_M"] == 0 and args["N"] % args["BLOCK_N"] == 0,
})(_matmul_kernel))


def _act_code(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _has_dropout(seed, dropout_p):
    if not dropout_p:
        return False
    if seed is None or seed.numel() != 1 or seed.dtype != torch.int64:
        raise ValueError("dropout needs a one-element int64 seed tensor")
    return True


def _launch_matmul(a, b, c, *, bias=None, residual=None, aux=None, part=None, activation=None,
                   store_pre=False, act_grad=False, seed=None, dropout_p=0.0):
    M, K = a.shape
    N = b.shape[1]
    dummy = c
    bias_t = bias if bias is not None else dummy
    res_t = residual if residual is not None else dummy
    aux_t = aux if aux is not None else dummy
    part_t = part if part is not None else dummy
    has_dropout = _has_dropout(seed, dropout_p)
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
               bias_t.stride(0) if bias is not None else 0,
               res_t.stride(0), res_t.stride(1) if residual is not None else 0,
               aux_t.stride(0), aux_t.stride(1) if aux is not None else 0)
    # In-tile offsets are int32 (tile origins are int64): strides up to 2^31 / 256 elements.
    if max(abs(x) for x in strides) >= 2**31 // 256:
        raise ValueError("matmul: a stride exceeds 2^23 elements; make the operand contiguous")
    args = (a, b, c, bias_t, res_t, aux_t, part_t, seed if has_dropout else dummy, M, N, K, *strides,
            triton.next_power_of_2(M), float(dropout_p) if has_dropout else 0.0)
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=_act_code(activation),
                 HAS_RESIDUAL=residual is not None, STORE_PRE=store_pre, ACT_GRAD=act_grad,
                 HAS_DBIAS=part is not None, HAS_DROPOUT=has_dropout, GROUP_M=GROUP_M,
                 PARTIAL_ROWS=PARTIAL_ROWS)
    common.count_launch("matmul")
    if common.interpreting():
        bm, bn, bk, warps, stages, split = INTERPRETER_CONFIG
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _matmul_kernel[grid](*args, **flags, EVEN_K=K % bk == 0, EVEN_MN=M % bm == 0 and N % bn == 0,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EPI_SPLIT=split,
                             DROP_SPLIT=drop_split(INTERPRETER_CONFIG), INTERPRET=True,
                             num_warps=warps, num_stages=stages)
    else:
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _tuned_matmul_kernel[grid](*args, **flags, INTERPRET=False)


def _check_2d(name, t):
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def matmul(a, b, bias=None, activation=None, residual=None, store_pre=False, out_dtype=None,
           dropout_p=0.0, seed=None):
    """``dropout(act(a @ b + bias)) + residual`` and, if ``store_pre``, the pre-activation
    ``a @ b + bias``.

    a (M, K), b (K, N), residual (M, N): any strides; bias (N,). a, b and bias share a dtype;
    residual may be wider. Dropout (when ``dropout_p > 0``) draws its mask from ``seed``, a
    one-element int64 tensor (see :func:`dropout_mask`). Returns ``(out, pre)``: out (M, N)
    contiguous in ``out_dtype`` (default a's dtype), pre (M, N) in a's dtype, or None unless
    ``store_pre``.
    """
    _check_2d("a", a)
    _check_2d("b", b)
    M, N = a.shape[0], b.shape[1]
    c = common.empty((M, N), out_dtype or a.dtype, a.device)
    pre = common.empty((M, N), a.dtype, a.device) if store_pre else None
    if M == 0 or N == 0:
        return c, pre
    _launch_matmul(a, b, c, bias=bias, residual=residual, aux=pre, activation=activation,
                   store_pre=store_pre, seed=seed, dropout_p=dropout_p)
    return c, pre


def _reduce_partials(part, dtype):
    # Fixed-order reduction of the (cdiv(M, 64), N) fp32 partials: deterministic.
    return part.sum(0).to(dtype)


def matmul_act_grad(a, b, pre, activation, dbias=False, dropout_p=0.0, seed=None):
    """``dPre = (a @ b) * keep / (1 - p) * act'(pre)`` and, if ``dbias``, its column sums (the
    bias gradient). The keep factor (``dropout_p > 0``) is the mask :func:`matmul` drew from
    ``seed`` for the (M, N) output.

    a (M, K), b (K, N), pre (M, N): any strides. Returns ``(dpre, dbias)``: dpre (M, N) in a's
    dtype, dbias (N,) in a's dtype reduced from fp32 partial sums, or None.
    """
    _check_2d("a", a)
    _check_2d("b", b)
    M, N = a.shape[0], b.shape[1]
    dpre = common.empty((M, N), a.dtype, a.device)
    part = common.empty((triton.cdiv(M, PARTIAL_ROWS), N), torch.float32, a.device) if dbias else None
    if M == 0 or N == 0:
        return dpre, (torch.zeros(N, dtype=a.dtype, device=a.device) if dbias else None)
    _launch_matmul(a, b, dpre, aux=pre, part=part, activation=activation, act_grad=True,
                   seed=seed, dropout_p=dropout_p)
    return dpre, (_reduce_partials(part, a.dtype) if dbias else None)


def act_grad(g, pre, activation, dbias=False, store_dpre=True, dropout_p=0.0, seed=None):
    """``dPre = g * keep / (1 - p) * act'(pre)`` (elementwise) and, if ``dbias``, its column
    sums. The keep factor (``dropout_p > 0``) is the mask :func:`matmul` drew from ``seed``.

    g and pre (M, N), any strides (pre unused when ``activation`` is None). Returns
    ``(dpre, dbias)``: dpre contiguous in g's dtype or None unless ``store_dpre``; dbias (N,) in
    g's dtype or None.
    """
    _check_2d("g", g)
    M, N = g.shape
    dpre = common.empty((M, N), g.dtype, g.device) if store_dpre else None
    part = common.empty((triton.cdiv(M, PARTIAL_ROWS), N), torch.float32, g.device) if dbias else None
    if M == 0 or N == 0:
        return dpre, (torch.zeros(N, dtype=g.dtype, device=g.device) if dbias else None)
    pre_t = pre if pre is not None else g
    has_dropout = _has_dropout(seed, dropout_p)
    common.count_launch("act_grad")
    block_n = ACT_GRAD_DROP_BLOCK_N if has_dropout else ACT_GRAD_BLOCK_N
    grid = (triton.cdiv(M, PARTIAL_ROWS), triton.cdiv(N, block_n))
    _act_grad_kernel[grid](
        g, pre_t, dpre if dpre is not None else g, part if part is not None else g,
        seed if has_dropout else g,
        M, N, g.stride(0), g.stride(1), pre_t.stride(0), pre_t.stride(1),
        float(dropout_p) if has_dropout else 0.0,
        ACTIVATION=_act_code(activation), STORE_DPRE=store_dpre, HAS_DBIAS=dbias,
        HAS_DROPOUT=has_dropout, BLOCK_M=PARTIAL_ROWS, BLOCK_N=block_n, INTERPRET=common.interpreting(),
        num_warps=4)
    return dpre, (_reduce_partials(part, g.dtype) if dbias else None)


def dropout_mask(seed, M, N, dropout_p, device):
    """The bool keep-mask (M, N) that :func:`matmul` and the gradients use for ``seed`` and
    ``dropout_p`` (for tests: the references take it as ``dropout_mask=``)."""
    out = common.empty((M, N), torch.int8, device)
    if M == 0 or N == 0:
        return out.bool()
    if not _has_dropout(seed, dropout_p):
        return torch.ones((M, N), dtype=torch.bool, device=device)
    common.count_launch("dropout_mask")
    grid = (triton.cdiv(M, 64), triton.cdiv(N, 128))
    _dropout_mask_kernel[grid](seed, out, M, N, float(dropout_p), BLOCK_M=64, BLOCK_N=128, num_warps=4)
    return out.bool()


def bias_grad(g):
    """Column sums of g (M, N) in g's dtype, reduced deterministically from fp32 partials."""
    return act_grad(g, None, None, dbias=True, store_dpre=False)[1]


# ---------------------------------------------------------------------------------------------
# ahead-of-time compile specs
# ---------------------------------------------------------------------------------------------

# Operand layouts the layer launches, as which strides are 1: forward x @ W.T ("NT"), input
# and hidden gradients dPre @ W ("NN"), weight gradients dY.T @ X ("TN").
_LAYOUTS = {"NT": ("stride_ak", "stride_bk"), "NN": ("stride_ak", "stride_bn"),
            "TN": ("stride_am", "stride_bn")}

# (name, layout, flags): the fused variants the layer launches. The dropout ones: the FFN's
# first GEMM (bias, GELU, pre-activation store, hidden dropout), its second (bias, output
# dropout, residual) and the DGELU epilogue with the hidden dropout's regenerated mask.
_VARIANTS = (
    ("fwd_bias_gelu_res_pre", "NT", dict(HAS_BIAS=True, ACTIVATION=1, HAS_RESIDUAL=True, STORE_PRE=True,
                                         ACT_GRAD=False, HAS_DBIAS=False, HAS_DROPOUT=False)),
    ("dgelu_dbias", "NN", dict(HAS_BIAS=False, ACTIVATION=1, HAS_RESIDUAL=False, STORE_PRE=False,
                               ACT_GRAD=True, HAS_DBIAS=True, HAS_DROPOUT=False)),
    ("plain_wgrad", "TN", dict(HAS_BIAS=False, ACTIVATION=0, HAS_RESIDUAL=False, STORE_PRE=False,
                               ACT_GRAD=False, HAS_DBIAS=False, HAS_DROPOUT=False)),
    ("fwd_bias_gelu_pre_drop", "NT", dict(HAS_BIAS=True, ACTIVATION=1, HAS_RESIDUAL=False, STORE_PRE=True,
                                          ACT_GRAD=False, HAS_DBIAS=False, HAS_DROPOUT=True)),
    ("fwd_bias_drop_res", "NT", dict(HAS_BIAS=True, ACTIVATION=0, HAS_RESIDUAL=True, STORE_PRE=False,
                                     ACT_GRAD=False, HAS_DBIAS=False, HAS_DROPOUT=True)),
    ("dgelu_dbias_drop", "NN", dict(HAS_BIAS=False, ACTIVATION=1, HAS_RESIDUAL=False, STORE_PRE=False,
                                    ACT_GRAD=True, HAS_DBIAS=True, HAS_DROPOUT=True)),
)


def _matmul_spec(name, layout, flags, cfg, even_k, dtype="bf16"):
    from fused_block.kernels import aot  # only the compile check needs it

    bm, bn, bk, warps, stages, split = cfg
    ptr = f"*{dtype}"
    sig = {"A": ptr, "B": ptr, "C": ptr, "BIAS": ptr, "RES": ptr, "AUX": ptr, "PART": "*fp32",
           "SEED": "*i64", "M": "i32", "N": "i32", "K": "i32"}
    strides = ("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn",
               "stride_bias", "stride_rm", "stride_rn", "stride_xm", "stride_xn")
    ones = set(_LAYOUTS[layout]) | {"stride_cn", "stride_bias", "stride_rn", "stride_xn"}
    constexprs = {}
    for s in strides:
        sig[s] = "constexpr" if s in ones else "i32"
        if s in ones:
            constexprs[s] = 1
    sig["M_BUCKET"] = "i32"
    sig["dropout_p"] = "fp32"
    for f in ("HAS_BIAS", "ACTIVATION", "HAS_RESIDUAL", "STORE_PRE", "ACT_GRAD", "HAS_DBIAS", "HAS_DROPOUT",
              "EVEN_K", "EVEN_MN", "BLOCK_M", "BLOCK_N", "BLOCK_K", "EPI_SPLIT", "DROP_SPLIT", "GROUP_M",
              "PARTIAL_ROWS", "INTERPRET"):
        sig[f] = "constexpr"
    constexprs.update(flags, EVEN_K=even_k, EVEN_MN=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      EPI_SPLIT=split, DROP_SPLIT=drop_split(cfg), GROUP_M=GROUP_M,
                      PARTIAL_ROWS=PARTIAL_ROWS, INTERPRET=False)
    aligned = tuple(s for s in ("M", "N", "K", *strides) if sig[s] == "i32" and s != "stride_bias")
    return aot.KernelSpec(
        name=f"matmul[{name} {bm}x{bn}x{bk} even_k={int(even_k)} {dtype}]", fn=_matmul_kernel,
        signature=sig, constexprs=constexprs, num_warps=warps, num_stages=stages,
        aligned=aligned, wgmma=True)


def aot_specs():
    """Every shipped GEMM config with each fused variant (bf16); the masked-K path, fp16 and
    tf32 once each on the largest tiles (tf32 also with dropout); the elementwise
    activation-gradient kernel with and without dropout; the test-only dropout-mask kernel."""
    from fused_block.kernels import aot

    specs = [_matmul_spec(name, layout, flags, cfg, True)
             for cfg in CONFIGS for name, layout, flags in _VARIANTS]
    specs.append(_matmul_spec(*_VARIANTS[1], CONFIGS[0], False))
    specs.append(_matmul_spec(*_VARIANTS[0], CONFIGS[0], True, dtype="fp16"))
    specs.append(_matmul_spec(*_VARIANTS[0], CONFIGS[3], True, dtype="fp32"))
    specs.append(_matmul_spec(*_VARIANTS[3], CONFIGS[0], False))
    specs.append(_matmul_spec(*_VARIANTS[3], CONFIGS[3], True, dtype="fp32"))
    for act, drop in ((2, False), (2, True), (0, True)):
        specs.append(aot.KernelSpec(
            name=f"act_grad[act={act} dbias{' dropout' if drop else ''}]", fn=_act_grad_kernel,
            signature={"G": "*bf16", "PRE": "*bf16", "DPRE": "*bf16", "PART": "*fp32", "SEED": "*i64",
                       "M": "i32", "N": "i32", "stride_gm": "i32", "stride_gn": "constexpr",
                       "stride_pm": "i32", "stride_pn": "constexpr", "dropout_p": "fp32",
                       "ACTIVATION": "constexpr", "STORE_DPRE": "constexpr", "HAS_DBIAS": "constexpr",
                       "HAS_DROPOUT": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                       "INTERPRET": "constexpr"},
            constexprs=dict(stride_gn=1, stride_pn=1, ACTIVATION=act, STORE_DPRE=True, HAS_DBIAS=True,
                            HAS_DROPOUT=drop, BLOCK_M=PARTIAL_ROWS,
                            BLOCK_N=ACT_GRAD_DROP_BLOCK_N if drop else ACT_GRAD_BLOCK_N,
                            INTERPRET=False),
            num_warps=4, aligned=("N", "stride_gm", "stride_pm")))
    specs.append(aot.KernelSpec(
        name="dropout_mask", fn=_dropout_mask_kernel,
        signature={"SEED": "*i64", "OUT": "*i8", "M": "i32", "N": "i32", "dropout_p": "fp32",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"},
        constexprs=dict(BLOCK_M=64, BLOCK_N=128), num_warps=4, aligned=("N",)))
    return specs
