"""Linear + cross-entropy without the (N, V) logits: the kernels of ``fused_block.linear_cross_entropy``.

The rows (tokens) are processed in chunks of ``C`` rows (:func:`chunk_rows`); per chunk:

1. ``logits = hidden[chunk] @ W.T + b`` on cuBLAS (``torch.mm``/``torch.addmm`` with ``out=``:
   the products have no epilogue worth fusing, so they run at torch's GEMM speed and
   precision, TF32 included, by construction) into one (C, V) buffer of the hidden dtype,
   reused by every chunk (its row stride padded to 16 elements: aligned rows for the CE
   kernel's vector loads; cuBLAS takes the strided view as its output, no copy);
2. ``_ce_kernel``, one program per row: an online log-sum-exp over V in ``BLOCK_V`` tiles
   (fp32; the optional softcap ``c * tanh(x / c)`` applied on load), the target logit, the mean
   logit (label smoothing) and the row's loss ``(1 - eps) (lse - y_t) + eps (lse - mean_j y_j)
   + z * lse^2`` (0 for an ignored token, NaN for a target outside [0, V)); with gradients a
   second pass over the row overwrites the logits with ``dlogits = g * (softmax * (1 + 2 z lse)
   - (1 - eps) onehot - eps / V) * softcap'`` in place, rounded to the buffer's dtype, ``g``
   the row's weight (1 / n_valid for a mean, 1 for a sum, the incoming per-token gradient for
   reduction "none");
3. ``dhidden[chunk] = dlogits @ W`` (``torch.mm`` into dhidden's rows; complete over V,
   written once);
4. ``dW (+)= dlogits.T @ hidden[chunk]`` (:func:`_product`, ``torch.addmm`` in place): fp32
   accumulation across chunks in a fixed order (deterministic, no atomics) in an fp32 (V, H)
   accumulator for 16-bit weights (cuBLAS's ``out_dtype=torch.float32``: 16-bit operands, fp32
   output and accumulation; the CPU, which lacks it, upcasts the chunk's operands), the output
   itself for fp32 ones; the last chunk adds and the accumulator is rounded into the weight's
   dtype (a single chunk needs no accumulator);
5. ``db (+)= colsum(dlogits)`` (``_colsum_kernel``, with a bias gradient), the same way.

Where that loop's fp32 (V, H) dW accumulator would break the memory rule (:func:`schedule`:
16-bit weights, several chunks, N < 8 H, H <= V / 8), the vocabulary-outer schedule
(``_vocab_outer``) runs instead, over vocabulary chunks of :func:`chunk_cols` columns and all N
rows: pass 1, the chunk's logits GEMM and ``_lse_chunk_kernel`` (the online log-sum-exp state
(m, s, smoothing sum, target logit) of each row carried across chunks in a (4, N) fp32 buffer,
merged in vocabulary order; the last chunk writes loss and lse); pass 2, the logits GEMM again,
``_grad_chunk_kernel`` (dlogits in place, ``_ce_kernel``'s formula), then
dW[chunk] = dlogits.T @ hidden over all N rows once (``torch.mm``, no accumulator),
``_colsum_kernel`` db[chunk], and dlogits @ W[chunk] added into an fp32 (N, H) accumulator
(dh itself for fp32; for 16-bit hidden states dW's last 2 N rows, whose chunks write their dW
after the loop from their dlogits recomputed: :func:`deferred_start`; :func:`_product`), the
last chunk writing dh. 8 N V H FLOPs with gradients (and the deferred rows' 2 N / 4 V more)
against the loop's 6 N V H: the loop is the faster where its accumulator fits.

Chunk sizes come from a memory budget: the chunk buffer at most ``CHUNK_BUDGET_BYTES`` (the
token loop) or ``VOCAB_CHUNK_BUDGET_BYTES`` (the vocabulary-outer schedule) and at most
1/MAX_LOGITS_FRACTION of the fp32 (N, V) logits (:func:`chunk_rows`, :func:`chunk_cols`).

The products count themselves in ``common.LAUNCHES`` (``lce_logits``, ``lce_dh``, ``lce_dw``)
like the Triton launches, so that tests see them run.

Before the chunks, ``_count_kernel`` counts the non-ignored tokens (on the device: no
synchronization), which a mean's gradient weight and the final ``_sum_kernel`` read.
``_scale_kernel`` multiplies gradients produced in the forward by the incoming gradient.

The accumulating launch (``_colsum_kernel``) and the in-place CE kernel are not idempotent,
so each has one config (never timed by ``common.ConfigCache``, which times candidates by
running them repeatedly).

Offsets: row and vocabulary origins are int64, so more than 2^31 logits elements in all (many
chunks) and (V, H) weights past 2^31 elements work.
"""
import os

import torch
import triton
import triton.language as tl

from fused_block.kernels import common

# Rows per chunk (see chunk_rows): the chunk buffer at most 1/MAX_LOGITS_FRACTION of the fp32
# (N, V) logits from SMALL_N tokens up; below, MIN_CHUNK_ROWS (the GEMMs' 128-row tiles would
# go mostly empty).
MAX_LOGITS_FRACTION = 8
MIN_CHUNK_ROWS = 64
SMALL_N = 512
# The dW product reads and writes the fp32 accumulator (8 bytes per weight element) once per
# chunk for 2 C FLOPs per weight element: at C = 1024, 256 FLOP per byte, above H100/H200's
# ~206 (989 TFLOP/s bf16 over 4.8 TB/s), so the accumulation stays compute-bound.
TARGET_CHUNK_ROWS = 1024
# The token loop's chunk buffer's size limit in bytes: LLaMA-3's head (vocabulary 128,256) in
# bf16 at 1,024 rows is 263 MB, within it.
CHUNK_BUDGET_BYTES = 256 << 20
# The vocabulary-outer schedule's (N, Vc) buffer, the memory-first schedule's: at most 32 MiB
# (2,048 columns at 8,192 tokens, 63 chunks of LLaMA-3's head: its peak beside the inputs is
# dW, dhidden and this buffer, 1.07 GiB, where Liger-Kernel measured 1.10) unless that leaves
# fewer than 1,024 columns (the products' N and K stay whole tiles many times over). Each chunk
# adds dlogits @ W[chunk] into dhidden's fp32 accumulator: K = Vc, 2 Vc FLOPs per 8 bytes of
# the accumulator read and written, compute-bound from Vc = 1,024 on H100/H200 (~206 FLOP/B).
VOCAB_CHUNK_BUDGET_BYTES = 32 << 20
MIN_VOCAB_CHUNK_COLS = 1024


def _env_schedule():
    """``FUSED_BLOCK_LCE_SCHEDULE``: "auto" (or unset: :func:`schedule`'s memory rule), "rows"
    (time first: the token loop everywhere, 6 N V H FLOPs with gradients, its fp32 (V, H) dW
    accumulator where there are several chunks) or "vocab" (memory first: the vocabulary-outer
    schedule wherever the token loop would keep that accumulator)."""
    value = os.environ.get("FUSED_BLOCK_LCE_SCHEDULE", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("rows", "vocab"):
        raise ValueError(f"FUSED_BLOCK_LCE_SCHEDULE must be 'auto', 'rows' or 'vocab', got {value!r}")
    return value


PREFER = _env_schedule()
# Tests set these to force a chunk size (several chunks on interpreter-sized inputs) and a
# schedule ("rows" or "vocab", see schedule()) on every call.
FORCE_CHUNK_ROWS = None
FORCE_CHUNK_COLS = None
FORCE_SCHEDULE = None
# Widest vocabulary tile of the CE kernel's loops (fp32 registers: 16 per thread at 8 warps).
CE_BLOCK_MAX = 4096
CE_BLOCK_MIN = 1024
REDUCE_BLOCK = 1024
COLSUM_BLOCK = (16, 256)  # (rows, vocabulary entries) per step
REDUCTIONS = {"sum": 0, "mean": 1, "none": 2}
SCALE_CONST, SCALE_ROW, SCALE_MEAN = 0, 1, 2  # where a row's gradient weight g comes from


def chunk_rows(n: int, v: int, h: int, elem: int) -> int:
    """Rows per chunk for n tokens, vocabulary v, hidden size h, elem-byte logits.

    Liger-Kernel's rule (the chunk's logits about the size of the hidden states: n h / v rows)
    raised to TARGET_CHUNK_ROWS, and capped so that the chunk buffer (C, padded_stride(v)) in
    the hidden dtype is at most CHUNK_BUDGET_BYTES and 1/MAX_LOGITS_FRACTION of the fp32
    (n, v) logits: about n / 4 rows for 16-bit inputs, n / 8 for fp32. The cap holds from
    SMALL_N tokens up; below, where the logits are small anyway, chunks keep MIN_CHUNK_ROWS
    rows. A multiple of 64 (whole tiles of the GEMMs' M and K) from 128 rows up.
    """
    if FORCE_CHUNK_ROWS is not None:
        return max(1, min(n, FORCE_CHUNK_ROWS))
    row_bytes = elem * padded_stride(v, elem)
    cap = max(1, min(4 * n * v // (MAX_LOGITS_FRACTION * row_bytes), CHUNK_BUDGET_BYTES // row_bytes))
    if n < SMALL_N:
        cap = max(cap, MIN_CHUNK_ROWS)
    c = min(n, cap, max(TARGET_CHUNK_ROWS, common.cdiv(n * h, max(v, 1))))
    return c - c % 64 if c >= 128 else c


def chunk_cols(n: int, v: int, elem: int) -> int:
    """Vocabulary entries per chunk of the vocabulary-outer schedule (:func:`schedule`): the
    (n, padded_stride(Vc)) chunk buffer in the hidden dtype at most 1/MAX_LOGITS_FRACTION of
    the fp32 (n, v) logits whatever n (Vc <= v / 4 for 16-bit logits, v / 8 for fp32) and at
    most VOCAB_CHUNK_BUDGET_BYTES unless that leaves fewer than MIN_VOCAB_CHUNK_COLS columns,
    a multiple of 64 (whole 16-byte rows) where v allows."""
    if FORCE_CHUNK_COLS is not None:
        return max(1, min(v, FORCE_CHUNK_COLS))
    c = min(4 * v // (MAX_LOGITS_FRACTION * elem),
            max(VOCAB_CHUNK_BUDGET_BYTES // (max(n, 1) * elem), MIN_VOCAB_CHUNK_COLS))
    return max(1, min(v, c - c % 64 if c >= 64 else c - c % 16 if c >= 16 else c))


def schedule(n: int, v: int, h: int, elem: int, weight_fp32: bool, need_dh: bool, need_dw: bool,
             weight_unit_cols: bool = True) -> str:
    """``"rows"`` (the token-chunk loop, 6 N V H FLOPs with gradients) or ``"vocab"`` (the
    vocabulary-outer schedule, 8 N V H: the logits GEMM twice).

    "rows" keeps an fp32 (V, H) dW accumulator (4 V H bytes) when the weight is 16-bit and the
    tokens take more than one chunk; "vocab" is taken exactly when that accumulator would break
    the memory rule (more than 1/MAX_LOGITS_FRACTION of the fp32 (N, V) logits, i.e. N < 8 H)
    and its own extra allocations keep it: its fp32 (N, H) dhidden accumulator (4 N H bytes,
    16-bit hidden states only) within the same bound, i.e. H <= V / 8 (LLaMA-3's 4,096 <= 16,032,
    GPT-2's 768 <= 6,282), and a weight with unit column stride (its vocabulary chunks are row
    slices).
    fp32 weights accumulate dW in dW itself (no accumulator): always "rows".
    ``FUSED_BLOCK_LCE_SCHEDULE`` (:data:`PREFER`) sets the policy instead of the memory rule:
    "rows" always, or "vocab" wherever the token loop would keep its dW accumulator."""
    if not need_dw or weight_fp32 or chunk_rows(n, v, h, elem) >= n or PREFER == "rows":
        return "rows"
    if PREFER == "vocab":
        return "vocab" if weight_unit_cols else "rows"
    acc_ok = MAX_LOGITS_FRACTION * 4 * v * h <= 4 * n * v
    dh_acc_ok = not need_dh or MAX_LOGITS_FRACTION * 4 * n * h <= 4 * n * v
    return "vocab" if not acc_ok and dh_acc_ok and weight_unit_cols else "rows"


def padded_stride(v: int, elem: int) -> int:
    """The chunk buffer's row stride: v rounded up to 16 elements (aligned rows, a stride
    Triton specializes as divisible by 16: the CE kernel's vector loads)."""
    return common.cdiv(v, 16) * 16


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _softcap(x, cap, HAS_SOFTCAP: tl.constexpr):
    """(cap * tanh(x / cap), tanh(x / cap)) on an fp32 tile (:func:`common.tanh`; x times the
    reciprocal of the scalar cap, one multiply per element instead of a division)."""
    if HAS_SOFTCAP:
        t = common.tanh(x * (1.0 / cap))
        return cap * t, t
    else:
        return x, x


_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_tile(row, c, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(row + c, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.load(row + c).to(tl.float32)


@triton.jit
def _lse_tile(row, c, mask, m, s, y_sum, cap, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
              MASKED: tl.constexpr):
    """Pass 1 over one tile: the running max m, s = sum exp(y - m) (as exp2 of one FMA per
    element) and the sum of y, for y = softcap(x)."""
    y, _ = _softcap(_load_tile(row, c, mask, MASKED), cap, HAS_SOFTCAP)
    if MASKED:
        y = tl.where(mask, y, float("-inf"))
    m_new = tl.maximum(m, tl.max(y, axis=0))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp2(y * _LOG2E - m_new * _LOG2E), axis=0)
    if HAS_SMOOTHING:
        if MASKED:
            y_sum += tl.sum(tl.where(mask, y, 0.0), axis=0)
        else:
            y_sum += tl.sum(y, axis=0)
    return m_new, s, y_sum


@triton.jit
def _grad_tile(row, c, mask, t, lse, coef, hit, flat, cap, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Pass 2 over one tile: dlogits = (softmax * coef - hit [at t] - flat) * softcap',
    written over the logits."""
    y, th = _softcap(_load_tile(row, c, mask, MASKED), cap, HAS_SOFTCAP)
    d = tl.exp2(y * _LOG2E - lse * _LOG2E) * coef - tl.where(c == t, hit, 0.0) - flat
    if HAS_SOFTCAP:
        d = d * (1.0 - th * th)
    d = common.cast(d, row.dtype.element_ty, INTERPRET)
    if MASKED:
        tl.store(row + c, d, mask=mask)
    else:
        tl.store(row + c, d)


@triton.jit
def _lse_row(row, n, m, s, y_sum, cap, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
             BLOCK_V: tl.constexpr):
    """Pass 1 over a row's first n logits: whole tiles unmasked, the last partial one masked."""
    cols = tl.arange(0, BLOCK_V)
    n_full = n - n % BLOCK_V
    for v0 in range(0, n_full, BLOCK_V):
        m, s, y_sum = _lse_tile(row, v0 + cols, cols, m, s, y_sum, cap, HAS_SOFTCAP, HAS_SMOOTHING, False)
    if n_full < n:
        m, s, y_sum = _lse_tile(row, n_full + cols, n_full + cols < n, m, s, y_sum, cap, HAS_SOFTCAP,
                                HAS_SMOOTHING, True)
    return m, s, y_sum


@triton.jit
def _grad_row(row, n, t, lse, coef, hit, flat, cap, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Pass 2 over a row's first n logits (t the target's column in them), as :func:`_lse_row`."""
    cols = tl.arange(0, BLOCK_V)
    n_full = n - n % BLOCK_V
    for v0 in range(0, n_full, BLOCK_V):
        _grad_tile(row, v0 + cols, cols, t, lse, coef, hit, flat, cap, HAS_SOFTCAP, False, INTERPRET)
    if n_full < n:
        _grad_tile(row, n_full + cols, n_full + cols < n, t, lse, coef, hit, flat, cap, HAS_SOFTCAP, True,
                   INTERPRET)


@triton.jit
def _ce_kernel(
    LOGITS, TARGET, LOSS, LSE, SCALE, V, ld, ignore_index, smoothing, z_loss, cap, scale,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, GRAD: tl.constexpr, SCALE_MODE: tl.constexpr,
    BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Row ``pid`` of a chunk: LOGITS (rows, V) with row stride ``ld`` (the GEMM's output:
    x @ W.T + b); TARGET, LOSS, LSE the chunk's slices (int64, fp32, fp32).

    LOSS = (1 - eps) (lse - y_t) + eps (lse - sum_j y_j / V) + z lse^2, y = softcap(x); 0 for
    an ignored token; NaN for a target outside [0, V) (no out-of-bounds read). LSE = lse.
    ``GRAD``: the row is overwritten with d(g * LOSS)/dx, g from ``SCALE_MODE``: ``scale``
    (SCALE_CONST), SCALE[pid] (SCALE_ROW: reduction "none"), 1 / max(SCALE[0], 1) (SCALE_MEAN,
    SCALE[0] the count of non-ignored tokens); 0 on ignored rows. Whole tiles run unmasked,
    the last partial one masked.
    """
    pid = tl.program_id(0)
    row = LOGITS + pid.to(tl.int64) * ld
    t = tl.load(TARGET + pid)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    # Pass 1: running max m and sum s of exp(y - m), per tile (one exp per element).
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    y_sum = tl.full([], 0.0, tl.float32)
    m, s, y_sum = _lse_row(row, V, m, s, y_sum, cap, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK_V)
    lse = m + tl.log(s)
    x_t = tl.load(row + tl.minimum(tl.maximum(t, 0), V - 1)).to(tl.float32)
    y_t, _ = _softcap(x_t, cap, HAS_SOFTCAP)
    loss = lse - y_t
    if HAS_SMOOTHING:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - y_sum / V)
    loss += z_loss * lse * lse
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(LOSS + pid, tl.where(valid, loss, 0.0))
    tl.store(LSE + pid, lse)
    if GRAD:
        if SCALE_MODE == 1:
            g = tl.load(SCALE + pid).to(tl.float32)
        elif SCALE_MODE == 2:
            g = 1.0 / tl.maximum(tl.load(SCALE).to(tl.float32), 1.0)
        else:
            g = scale
        g = tl.where(valid, tl.where(in_range, g, float("nan")), 0.0)
        coef = g * (1.0 + 2.0 * z_loss * lse)
        hit = g * (1.0 - smoothing)
        flat = g * smoothing / V
        # Pass 2 (the row again, mostly from L2): the gradient, written over the logits.
        _grad_row(row, V, t, lse, coef, hit, flat, cap, HAS_SOFTCAP, BLOCK_V, INTERPRET)


@triton.jit
def _row_grad_coefs(SCALE, pid, t, V, ignore_index, smoothing, z_loss, lse, scale, SCALE_MODE: tl.constexpr):
    """The gradient pass's per-row factors (coef, hit, flat) for target t and log-sum-exp lse:
    dlogits = (softmax * coef - hit [at t] - flat) * softcap'; g (the row's weight) from
    SCALE_MODE as in ``_ce_kernel``, 0 on an ignored row, NaN for a target outside [0, V)."""
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    if SCALE_MODE == 1:
        g = tl.load(SCALE + pid).to(tl.float32)
    elif SCALE_MODE == 2:
        g = 1.0 / tl.maximum(tl.load(SCALE).to(tl.float32), 1.0)
    else:
        g = scale
    g = tl.where(valid, tl.where(in_range, g, float("nan")), 0.0)
    return g * (1.0 + 2.0 * z_loss * lse), g * (1.0 - smoothing), g * smoothing / V


@triton.jit
def _lse_chunk_kernel(
    LOGITS, TARGET, STATE, LOSS, LSE, N, V0, VC, V, ld, ignore_index, smoothing, z_loss, cap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 1 of the vocabulary-outer schedule, row ``pid`` of vocabulary columns [V0, V0 + VC):
    LOGITS (N, VC) that chunk's logits (row stride ``ld``). STATE (4, N) fp32 carries each
    row's running max m, s = sum exp(y - m), the sum of y (label smoothing) and the target's y
    (0 until its chunk) from chunk to chunk, in vocabulary order (deterministic); FIRST starts
    them, LAST (the last chunk) turns them into LOSS and LSE exactly as ``_ce_kernel`` does
    (STATE is then neither read nor written past this chunk's update)."""
    pid = tl.program_id(0)
    row = LOGITS + pid.to(tl.int64) * ld
    st = STATE + pid.to(tl.int64)
    t = tl.load(TARGET + pid)
    if FIRST:
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        y_sum = tl.full([], 0.0, tl.float32)
        y_t = tl.full([], 0.0, tl.float32)
    else:
        m = tl.load(st)
        s = tl.load(st + N)
        y_sum = tl.load(st + 2 * N)
        y_t = tl.load(st + 3 * N)
    m, s, y_sum = _lse_row(row, VC, m, s, y_sum, cap, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK_V)
    t_local = t - V0
    here = (t_local >= 0) & (t_local < VC)
    x_t = tl.load(row + tl.minimum(tl.maximum(t_local, 0), VC - 1)).to(tl.float32)
    y_here, _ = _softcap(x_t, cap, HAS_SOFTCAP)
    y_t = tl.where(here, y_here, y_t)
    if LAST:
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        lse = m + tl.log(s)
        loss = lse - y_t
        if HAS_SMOOTHING:
            loss = (1.0 - smoothing) * loss + smoothing * (lse - y_sum / V)
        loss += z_loss * lse * lse
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(LOSS + pid, tl.where(valid, loss, 0.0))
        tl.store(LSE + pid, lse)
    else:
        tl.store(st, m)
        tl.store(st + N, s)
        tl.store(st + 2 * N, y_sum)
        tl.store(st + 3 * N, y_t)


@triton.jit
def _grad_chunk_kernel(
    LOGITS, TARGET, LSE, SCALE, V0, VC, V, ld, ignore_index, smoothing, z_loss, cap, scale,
    HAS_SOFTCAP: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Pass 2 of the vocabulary-outer schedule, row ``pid`` of vocabulary columns [V0, V0 + VC):
    the chunk's logits (N, VC) overwritten with d(g * LOSS)/dx (``_ce_kernel``'s gradient
    pass, the row's lse read from LSE)."""
    pid = tl.program_id(0)
    row = LOGITS + pid.to(tl.int64) * ld
    t = tl.load(TARGET + pid)
    lse = tl.load(LSE + pid)
    coef, hit, flat = _row_grad_coefs(SCALE, pid, t, V, ignore_index, smoothing, z_loss, lse, scale, SCALE_MODE)
    t_local = t - V0
    _grad_row(row, VC, t_local, lse, coef, hit, flat, cap, HAS_SOFTCAP, BLOCK_V, INTERPRET)


@triton.jit
def _colsum_kernel(A, ACC, OUT, K, V, lda, LOAD_ACC: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr):
    """OUT[v] = (ACC[v] if LOAD_ACC) + sum_k A[k, v] for A (K, V) (row stride lda), rows in a
    fixed order, fp32 (the bias gradient, accumulated over chunks like dW)."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
    for k in range(0, K, BLOCK_K):
        rows = k + rk
        acc += tl.load(A + rows.to(tl.int64)[:, None] * lda + cols[None, :],
                       mask=(rows < K)[:, None] & (cols < V)[None, :], other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if LOAD_ACC:
        total += tl.load(ACC + cols, mask=cols < V, other=0.0)
    tl.store(OUT + cols, common.cast(total, OUT.dtype.element_ty, INTERPRET), mask=cols < V)


@triton.jit
def _count_kernel(TARGET, OUT, N, ignore_index, BLOCK: tl.constexpr):
    """OUT[0] = the number of targets that are not ``ignore_index`` (fp32; one program)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, N, BLOCK):
        idx = i + offs.to(tl.int64)
        t = tl.load(TARGET + idx, mask=idx < N, other=ignore_index)
        acc += tl.where(t != ignore_index, 1.0, 0.0)
    tl.store(OUT, tl.sum(acc, axis=0))


@triton.jit
def _sum_kernel(LOSS, COUNT, OUT, N, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[0] = sum(LOSS[:N]) in a fixed order (fp32; one program), / max(COUNT[0], 1) if MEAN."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, N, BLOCK):
        idx = i + offs.to(tl.int64)
        acc += tl.load(LOSS + idx, mask=idx < N, other=0.0)
    total = tl.sum(acc, axis=0)
    if MEAN:
        total = total / tl.maximum(tl.load(COUNT), 1.0)
    tl.store(OUT, total)


@triton.jit
def _scale_seg(G, X, Y, n, blk, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Y + offs, common.cast(x * tl.load(G).to(tl.float32), Y.dtype.element_ty, INTERPRET), mask=offs < n)


@triton.jit
def _scale_kernel(G, X1, Y1, n1, X2, Y2, n2, X3, Y3, n3, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Y_i = G[0] * X_i for up to three flat tensors in one launch (programs in order: X1's
    blocks, X2's, X3's)."""
    pid = tl.program_id(0)
    nb1 = tl.cdiv(n1, BLOCK)
    nb2 = tl.cdiv(n2, BLOCK)
    if pid < nb1:
        _scale_seg(G, X1, Y1, n1, pid, BLOCK, INTERPRET)
    elif pid < nb1 + nb2:
        _scale_seg(G, X2, Y2, n2, pid - nb1, BLOCK, INTERPRET)
    else:
        _scale_seg(G, X3, Y3, n3, pid - nb1 - nb2, BLOCK, INTERPRET)


# ---------------------------------------------------------------------------------------------
# configs: one per vocabulary width (the in-place and accumulating launches are never timed)
# ---------------------------------------------------------------------------------------------

_ELEMENTWISE = common.Config.of(num_warps=4)


def ce_config(v: int) -> common.Config:
    """The CE kernel's vocabulary tile and warps: one tile up to CE_BLOCK_MIN entries (4 warps),
    CE_BLOCK_MAX-wide tiles beyond (8 warps)."""
    if v <= CE_BLOCK_MIN:
        return common.Config.of(num_warps=4, BLOCK_V=CE_BLOCK_MIN)
    return common.Config.of(num_warps=8, BLOCK_V=CE_BLOCK_MAX)


def grad_chunk_config(v: int) -> common.Config:
    """The vocabulary-outer gradient pass's tile: ce_config's, with 16 warps at the wide tile
    (at 8 warps its softcap variant spilled 8 bytes on sm_80)."""
    cfg = ce_config(v)
    return cfg if v <= CE_BLOCK_MIN else common.Config.of(num_warps=16, BLOCK_V=CE_BLOCK_MAX)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------

def count_valid(target, ignore_index, out):
    """out (1,) fp32 = the number of entries of target (N,) int64 that are not ignore_index."""
    common.launch("lce_count", _count_kernel, (1,), (target, out, target.shape[0], ignore_index),
                  dict(BLOCK=REDUCE_BLOCK), _ELEMENTWISE)


def reduce_loss(loss_rows, count, mean, out):
    """out (0-d fp32) = loss_rows.sum() (/ max(count, 1) if mean), in a fixed order."""
    common.launch("lce_sum", _sum_kernel, (1,),
                  (loss_rows, count if count is not None else loss_rows, out, loss_rows.shape[0]),
                  dict(MEAN=mean, BLOCK=REDUCE_BLOCK), _ELEMENTWISE)


def ce_rows(logits, target, loss, lse, *, ignore_index, smoothing, z_loss, softcap, grad, scale_mode=SCALE_CONST,
            scale=1.0, scale_t=None):
    """The CE kernel over a chunk: logits (rows, V) view of the buffer (unit column stride);
    target, loss, lse (rows,) slices. With ``grad`` the logits become their gradient."""
    rows, V = logits.shape
    cfg = ce_config(V)
    common.launch("lce_ce", _ce_kernel, (rows,),
                  (logits, target, loss, lse, scale_t if scale_t is not None else lse, V, logits.stride(0),
                   ignore_index, float(smoothing), float(z_loss), float(softcap or 1.0), float(scale)),
                  dict(HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=smoothing > 0, GRAD=grad, SCALE_MODE=scale_mode,
                       INTERPRET=common.arch(logits.device) == 0), cfg)


def logits_product(h, weight, bias, out):
    """out = h @ weight.T (+ bias) on cuBLAS into the chunk buffer's view ``out`` (row stride
    padded, unit column stride: cuBLAS writes it in place), torch's precision for fp32."""
    common.count_launch("lce_logits")
    if bias is None:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.addmm(bias, h, weight.t(), out=out)


_OUT_DTYPE = {}  # (device, dtype) -> whether torch's addmm takes out_dtype=float32 there


def _has_out_dtype(acc, a) -> bool:
    """Whether this torch's ``addmm`` computes 16-bit x 16-bit -> fp32 on ``acc``'s device (its
    ``out_dtype`` overload: CUDA only, and not in every torch the package declares), in place
    as :func:`_addmm_fp32` calls it: tried once per device and dtype on 2 x 2 operands, both
    ways it is used (``beta=1`` adds to the fp32 output it writes, ``beta=0`` ignores it, NaNs
    included, as ``addmm`` documents); an overload that does either otherwise is not used."""
    key = (acc.device, a.dtype)
    ok = _OUT_DTYPE.get(key)
    if ok is None:
        # CUDA: tried; the CPU has no such product; meta / fake tensors (the memory tests,
        # torch.compile's tracing) model the CUDA op
        ok = acc.device.type != "cpu"
        if acc.device.type == "cuda":
            m = torch.ones(2, 2, dtype=a.dtype, device=a.device)
            added = torch.ones(2, 2, dtype=torch.float32, device=acc.device)
            ignored = torch.full((2, 2), float("nan"), dtype=torch.float32, device=acc.device)
            try:
                torch.addmm(added, m, m, beta=1, out_dtype=torch.float32, out=added)
                torch.addmm(ignored, m, m, beta=0, out_dtype=torch.float32, out=ignored)
                ok = bool((added == 3).all()) and bool((ignored == 2).all())
            except (RuntimeError, TypeError):
                ok = False
        _OUT_DTYPE[key] = ok
    return ok


def _addmm_fp32(acc, a, b, beta):
    """acc (fp32) = beta * acc + a @ b in place for 16-bit a, b: cuBLAS with fp32 output and
    accumulation (``out_dtype``). Where torch has no such product (the CPU, a torch without the
    overload: :func:`_has_out_dtype`) it upcasts b and a half of a's rows at a time
    (temporaries no larger than a itself, so within the memory rule; the same sums in fp32)."""
    if _has_out_dtype(acc, a):
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
        return
    b32 = b.float()
    step = max(1, common.cdiv(a.shape[0], 2))
    for r0 in range(0, a.shape[0], step):
        acc[r0:r0 + step].addmm_(a[r0:r0 + step].float(), b32, beta=beta)


def _product(name, a, b, acc, out, load_acc):
    """out = (acc if load_acc) + a @ b, fp32-accumulated across calls: a (R, K), b (K, H) views
    with a unit stride; acc fp32 (R, H) (the output itself for fp32 operands, or when one call
    is all there is) and out (R, H) contiguous, possibly the same tensor. A 16-bit out that is
    not acc is the last call: acc is completed, then rounded into out once."""
    common.count_launch(name)
    beta = 1 if load_acc else 0
    if acc.dtype == a.dtype:
        if load_acc:
            torch.addmm(acc, a, b, out=out)
        else:
            torch.mm(a, b, out=out)
        return
    _addmm_fp32(acc, a, b, beta)
    if out is not acc:
        out.copy_(acc)


def dw_accumulate(dlogits, hidden, acc, out, load_acc):
    """out = (acc if load_acc) + dlogits.T @ hidden: dlogits (K, V) and hidden (K, H) with unit
    column strides; acc fp32 (or out) and out (V, H) contiguous (possibly the same tensor)."""
    _product("lce_dw", dlogits.t(), hidden, acc, out, load_acc)


def dh_accumulate(dlogits, w_chunk, acc, out, load_acc):
    """out = (acc if load_acc) + dlogits @ w_chunk: dlogits (M, K) and w_chunk (K, H) with unit
    column strides; acc fp32 (or out) and out (M, H) contiguous (possibly the same tensor)."""
    _product("lce_dh", dlogits, w_chunk, acc, out, load_acc)


def lse_chunk(logits, target, state, loss, lse, v0, V, *, ignore_index, smoothing, z_loss, softcap, first,
              last):
    """Pass 1 of the vocabulary-outer schedule on one vocabulary chunk: logits (N, Vc) the
    chunk's columns [v0, v0 + Vc) (unit column stride); state (4, N) fp32 (None with one chunk);
    on the last chunk loss and lse (N,) fp32."""
    N, VC = logits.shape
    cfg = ce_config(VC)
    common.launch("lce_lse", _lse_chunk_kernel, (N,),
                  (logits, target, state if state is not None else lse, loss, lse, N, v0, VC, V, logits.stride(0),
                   ignore_index, float(smoothing), float(z_loss), float(softcap or 1.0)),
                  dict(HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=smoothing > 0, FIRST=first, LAST=last), cfg)


def grad_chunk(logits, target, lse, v0, V, *, ignore_index, smoothing, z_loss, softcap, scale_mode, scale_t=None,
               scale=1.0):
    """Pass 2 of the vocabulary-outer schedule: the chunk's logits (N, Vc) become d(g loss)/dx."""
    N, VC = logits.shape
    cfg = grad_chunk_config(VC)
    common.launch("lce_grad", _grad_chunk_kernel, (N,),
                  (logits, target, lse, scale_t if scale_t is not None else lse, v0, VC, V, logits.stride(0),
                   ignore_index, float(smoothing), float(z_loss), float(softcap or 1.0), float(scale)),
                  dict(HAS_SOFTCAP=softcap is not None, SCALE_MODE=scale_mode,
                       INTERPRET=common.arch(logits.device) == 0), cfg)


def colsum_accumulate(dlogits, acc, out, load_acc):
    """out (V,) = (acc if load_acc) + dlogits.sum(0), fp32, rows in order."""
    K, V = dlogits.shape
    bk, bv = COLSUM_BLOCK
    common.launch("lce_colsum", _colsum_kernel, (common.cdiv(V, bv),),
                  (dlogits, acc, out, K, V, dlogits.stride(0)),
                  dict(LOAD_ACC=load_acc, BLOCK_K=bk, BLOCK_V=bv, INTERPRET=common.arch(dlogits.device) == 0),
                  _ELEMENTWISE)


def scale(g, *tensors):
    """``g * t`` for each contiguous tensor (new tensors, each in its own dtype), one launch;
    g a one-element tensor read on the device."""
    outs = [common.empty(t.shape, t.dtype, t.device) for t in tensors]
    segs = [(t, o, t.numel()) for t, o in zip(tensors, outs) if t.numel()]
    if segs:
        blocks = sum(common.cdiv(n, REDUCE_BLOCK) for _, _, n in segs)
        while len(segs) < 3:
            segs.append((segs[0][0], segs[0][1], 0))
        args = (g,) + tuple(x for seg in segs for x in seg)
        common.launch("lce_scale", _scale_kernel, (blocks,), args,
                      dict(BLOCK=REDUCE_BLOCK, INTERPRET=common.arch(g.device) == 0), _ELEMENTWISE)
    return outs


def chunked(hidden, weight, bias, target, loss_rows, lse, *, ignore_index, smoothing, z_loss, softcap,
            need_dh, need_dw, need_db, scale_mode, scale_t=None, scale_value=1.0, lse_known=False):
    """The chunk loop (module doc): hidden (N, H) and weight (V, H) with unit column strides,
    bias (V,) or None, target (N,) int64; writes loss_rows and lse (N,) fp32. Returns (dh, dw,
    db), each None unless asked for; their rows are weighted as ``_ce_kernel``'s SCALE_MODE.
    ``lse_known`` (the gradients of reduction "none", in the backward): ``lse`` holds the
    forward's log-sum-exps and only the gradient pass runs (``_grad_chunk_kernel``: no pass 1
    over the logits; the vocabulary-outer schedule skips its whole pass 1, a logits GEMM);
    ``loss_rows`` is not written (None)."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    grad = need_dh or need_dw or need_db
    dh = common.empty((N, H), dt, dev) if need_dh else None
    dw = common.empty((V, H), weight.dtype, dev) if need_dw else None
    db = common.empty((V,), bias.dtype, dev) if need_db else None
    if N == 0:
        for t in (dw, db):
            if t is not None:
                t.zero_()
        return dh, dw, db
    # The loss alone (eval, reduction "none"'s forward, the forward of gradients deferred to the
    # backward) takes the schedule of a training call at this shape: its pass 1 (one logits GEMM
    # either way), with the same chunk buffer as the gradient pass that may follow.
    sched = FORCE_SCHEDULE or schedule(N, V, H, hidden.element_size(), weight.dtype == torch.float32,
                                       need_dh or not grad, need_dw or not grad, weight.stride(1) == 1)
    if sched == "vocab":
        _vocab_outer(hidden, weight, bias, target, loss_rows, lse, dh, dw, db, ignore_index=ignore_index,
                     smoothing=smoothing, z_loss=z_loss, softcap=softcap, grad=grad, scale_mode=scale_mode,
                     scale_t=scale_t, scale_value=scale_value, lse_known=lse_known)
        return dh, dw, db
    C = chunk_rows(N, V, H, hidden.element_size())
    chunks = common.cdiv(N, C)
    buf = common.empty((C, padded_stride(V, hidden.element_size())), dt, dev)
    # Accumulators: the outputs themselves for fp32, and whenever one chunk is all there is.
    dw_acc = dw if dw is None or dw.dtype == torch.float32 or chunks == 1 else common.empty((V, H), torch.float32, dev)
    db_acc = db if db is None or db.dtype == torch.float32 or chunks == 1 else common.empty((V,), torch.float32, dev)
    for i in range(chunks):
        r0 = i * C
        r1 = min(N, r0 + C)
        logits = buf[:r1 - r0, :V]
        h = hidden[r0:r1]
        logits_product(h, weight, bias, logits)
        rows_scale = scale_t[r0:r1] if scale_mode == SCALE_ROW else scale_t
        if lse_known:
            grad_chunk(logits, target[r0:r1], lse[r0:r1], 0, V, ignore_index=ignore_index, smoothing=smoothing,
                       z_loss=z_loss, softcap=softcap, scale_mode=scale_mode, scale_t=rows_scale, scale=scale_value)
        else:
            ce_rows(logits, target[r0:r1], loss_rows[r0:r1], lse[r0:r1], ignore_index=ignore_index,
                    smoothing=smoothing, z_loss=z_loss, softcap=softcap, grad=grad, scale_mode=scale_mode,
                    scale_t=rows_scale, scale=scale_value)
        last = i == chunks - 1
        if need_dh:
            dh_accumulate(logits, weight, dh[r0:r1], dh[r0:r1], False)
        if need_dw:
            dw_accumulate(logits, h, dw_acc, dw if last else dw_acc, i > 0)
        if need_db:
            colsum_accumulate(logits, db_acc, db if last else db_acc, i > 0)
    return dh, dw, db


def _vocab_outer(hidden, weight, bias, target, loss_rows, lse, dh, dw, db, *, ignore_index, smoothing, z_loss,
                 softcap, grad, scale_mode, scale_t, scale_value, lse_known):
    """The vocabulary-outer schedule (:func:`schedule`), N > 0: pass 1 over the vocabulary
    chunks (the chunk's logits GEMM, then ``_lse_chunk_kernel`` merging each row's online
    log-sum-exp state, in vocabulary order) gives every row's loss and lse; with gradients,
    pass 2 per chunk recomputes the logits, overwrites them with dlogits
    (``_grad_chunk_kernel``), writes dW[chunk] = dlogits.T @ hidden (cuBLAS over all N
    rows, once, in the weight's dtype: no accumulator), db[chunk] = colsum(dlogits), and
    accumulates dh += dlogits @ W[chunk] (:func:`_product`) in fp32, the last chunk writing dh.
    The fp32 accumulator: dh itself for fp32 hidden states; for 16-bit ones the rows of dW
    from :func:`deferred_start` on, whose chunks write their dW after the loop, from their
    dlogits recomputed (their logits GEMM and gradient pass twice), or where there are none
    an (N, H) buffer."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    elem = hidden.element_size()
    VC = chunk_cols(N, V, elem)
    chunks = common.cdiv(V, VC)
    buf = common.empty((N, padded_stride(VC, elem)), dt, dev)
    opts = dict(ignore_index=ignore_index, smoothing=smoothing, z_loss=z_loss, softcap=softcap)
    bounds = _bounds(0, V, VC)
    if not lse_known:
        state = common.empty((4, N), torch.float32, dev) if chunks > 1 else None
        for i, (c0, c1) in enumerate(bounds):
            logits = buf[:, :c1 - c0]
            logits_product(hidden, weight[c0:c1], bias[c0:c1] if bias is not None else None, logits)
            lse_chunk(logits, target, state, loss_rows, lse, c0, V, first=i == 0, last=i == chunks - 1, **opts)
    if not grad:
        return
    # dhidden's fp32 accumulator (16-bit hidden states, several chunks): in dW's storage, in the
    # rows of its last chunks, whose dW is written after dhidden from their dlogits recomputed
    # (:func:`deferred_start`), else an (N, H) buffer of its own.
    dh_acc, deferred = dh, chunks
    if dh is not None and dh.dtype != torch.float32 and chunks > 1:
        t = deferred_start(V, N, H, dw)
        if t is None:
            dh_acc = common.empty((N, H), torch.float32, dev)
        else:
            bounds = _bounds(0, t, VC) + _bounds(t, V, VC)
            deferred, chunks = len(_bounds(0, t, VC)), len(bounds)
            dh_acc = dw.view(-1)[t * H:(t + 2 * N) * H].view(torch.float32).view(N, H)
    for i, (c0, c1) in enumerate(bounds):
        logits = buf[:, :c1 - c0]
        w = weight[c0:c1]
        _dlogits(hidden, w, bias, target, lse, c0, c1, V, logits, scale_mode, scale_t, scale_value, opts)
        if dw is not None and i < deferred:
            dw_accumulate(logits, hidden, dw[c0:c1], dw[c0:c1], False)
        if db is not None:
            colsum_accumulate(logits, db[c0:c1], db[c0:c1], False)
        if dh is not None:
            dh_accumulate(logits, w, dh_acc, dh if i == chunks - 1 else dh_acc, i > 0)
    for c0, c1 in bounds[deferred:]:  # dhidden is complete: its accumulator's rows are free
        logits = buf[:, :c1 - c0]
        _dlogits(hidden, weight[c0:c1], bias, target, lse, c0, c1, V, logits, scale_mode, scale_t, scale_value, opts)
        dw_accumulate(logits, hidden, dw[c0:c1], dw[c0:c1], False)


def _dlogits(hidden, w, bias, target, lse, c0, c1, V, logits, scale_mode, scale_t, scale_value, opts):
    """Pass 2's dlogits of the vocabulary chunk [c0, c1) into ``logits``: its logits GEMM, then
    ``_grad_chunk_kernel`` in place."""
    logits_product(hidden, w, bias[c0:c1] if bias is not None else None, logits)
    grad_chunk(logits, target, lse, c0, V, scale_mode=scale_mode, scale_t=scale_t, scale=scale_value, **opts)


def _bounds(v0: int, v1: int, vc: int) -> list:
    """[v0, v1) in chunks of vc columns: (c0, c1) pairs."""
    return [(c0, min(v1, c0 + vc)) for c0 in range(v0, v1, vc)]


# What :func:`deferred_start` may spend: dhidden's accumulator takes 2 N rows of dW, whose
# logits GEMM and gradient pass then run twice, 2 N / (4 V) of the schedule's 8 N V H FLOPs
# (3.2% at LLaMA-3's head and 8,192 tokens), taken where 2 N <= V / MAX_DEFERRED_FRACTION_INV.
MAX_DEFERRED_FRACTION_INV = 4


def deferred_start(v: int, n: int, h: int, dw):
    """The first vocabulary row whose dW the vocabulary-outer schedule writes after dhidden, so
    that dW's rows from there hold dhidden's fp32 (n, h) accumulator meanwhile (2 n rows of a
    16-bit (v, h) dW), a multiple of 64 below v - 2 n; None where there is none: no dW, not a
    contiguous 16-bit one, 2 n above v / MAX_DEFERRED_FRACTION_INV (the recomputation's
    price), or v - 2 n below 64. The saving: the accumulator, 4 n h bytes (128 MiB at 8,192
    tokens of 4,096)."""
    if dw is None or dw.element_size() != 2 or not dw.is_contiguous() or 2 * n * MAX_DEFERRED_FRACTION_INV > v:
        return None
    t = v - 2 * n
    return t - t % 64 if t >= 64 else None


# ---------------------------------------------------------------------------------------------
# ahead-of-time compile specs
# ---------------------------------------------------------------------------------------------

_CE_FLAGS = (  # (HAS_SOFTCAP, HAS_SMOOTHING, GRAD, SCALE_MODE): the heaviest gradient pass, the
    (True, True, True, SCALE_MEAN),  # loss alone, per-row weights (reduction "none"), no options
    (True, True, False, SCALE_CONST),
    (False, False, True, SCALE_ROW),
    (False, False, True, SCALE_CONST),
)


def aot_specs():
    """Every shipped config: the CE kernel at both vocabulary tiles with the flag combinations
    above (bf16 and fp32 logits); the vocabulary-outer schedule's row kernels; the bias column
    sums and the small reductions (the products are cuBLAS's)."""
    from fused_block.kernels import aot

    specs = []
    for xt in ("bf16", "fp32"):
        for v in (CE_BLOCK_MIN, CE_BLOCK_MAX + 1):
            cfg = ce_config(v)
            for soft, smooth, grad, mode in _CE_FLAGS:
                sig = {"LOGITS": f"*{xt}", "TARGET": "*i64", "LOSS": "*fp32", "LSE": "*fp32", "SCALE": "*fp32",
                       "V": "i32", "ld": "i32", "ignore_index": "i64", "smoothing": "fp32", "z_loss": "fp32",
                       "cap": "fp32", "scale": "fp32"}
                consts = dict(HAS_SOFTCAP=soft, HAS_SMOOTHING=smooth, GRAD=grad, SCALE_MODE=mode, INTERPRET=False,
                              **cfg.meta())
                sig.update({k: "constexpr" for k in consts})
                tag = f"{xt} BLOCK_V={cfg['BLOCK_V']}{' softcap' if soft else ''}{' smooth' if smooth else ''}" \
                      f"{' grad' if grad else ''} scale={mode}"
                specs.append(aot.KernelSpec(f"lce_ce[{tag}]", _ce_kernel, sig, consts, num_warps=cfg.num_warps,
                                            aligned=("ld",)))
    # The vocabulary-outer schedule's row kernels: pass 1 starting (FIRST), merging and
    # finishing (LAST) the row state with every option, and the plain merge; pass 2 with each
    # gradient weight (softcap on the heaviest).
    for xt in ("bf16", "fp32"):
        for v in (CE_BLOCK_MIN, CE_BLOCK_MAX + 1):
            cfg = ce_config(v)
            for soft, smooth, first, last in ((True, True, True, False), (True, True, False, True),
                                              (False, False, False, False), (True, True, True, True)):
                sig = {"LOGITS": f"*{xt}", "TARGET": "*i64", "STATE": "*fp32", "LOSS": "*fp32", "LSE": "*fp32",
                       "N": "i32", "V0": "i32", "VC": "i32", "V": "i32", "ld": "i32", "ignore_index": "i64",
                       "smoothing": "fp32", "z_loss": "fp32", "cap": "fp32"}
                consts = dict(HAS_SOFTCAP=soft, HAS_SMOOTHING=smooth, FIRST=first, LAST=last, **cfg.meta())
                sig.update({k: "constexpr" for k in consts})
                tag = f"{xt} BLOCK_V={cfg['BLOCK_V']}{' softcap smooth' if soft else ''}" \
                      f"{' first' if first else ''}{' last' if last else ''}"
                specs.append(aot.KernelSpec(f"lce_lse[{tag}]", _lse_chunk_kernel, sig, consts,
                                            num_warps=cfg.num_warps, aligned=("ld",)))
            cfg = grad_chunk_config(v)
            for soft, mode in ((True, SCALE_MEAN), (False, SCALE_ROW), (False, SCALE_CONST)):
                sig = {"LOGITS": f"*{xt}", "TARGET": "*i64", "LSE": "*fp32", "SCALE": "*fp32", "V0": "i32",
                       "VC": "i32", "V": "i32", "ld": "i32", "ignore_index": "i64", "smoothing": "fp32",
                       "z_loss": "fp32", "cap": "fp32", "scale": "fp32"}
                consts = dict(HAS_SOFTCAP=soft, SCALE_MODE=mode, INTERPRET=False, **cfg.meta())
                sig.update({k: "constexpr" for k in consts})
                tag = f"{xt} BLOCK_V={cfg['BLOCK_V']}{' softcap' if soft else ''} scale={mode}"
                specs.append(aot.KernelSpec(f"lce_grad[{tag}]", _grad_chunk_kernel, sig, consts,
                                            num_warps=cfg.num_warps, aligned=("ld",)))
    for load_acc in (False, True):
        sig = {"A": "*bf16", "ACC": "*fp32", "OUT": "*bf16", "K": "i32", "V": "i32", "lda": "i32"}
        consts = dict(LOAD_ACC=load_acc, BLOCK_K=COLSUM_BLOCK[0], BLOCK_V=COLSUM_BLOCK[1], INTERPRET=False)
        sig.update({k: "constexpr" for k in consts})
        specs.append(aot.KernelSpec(f"lce_colsum[{'acc+' if load_acc else ''}]", _colsum_kernel, sig, consts,
                                    num_warps=4, aligned=("lda",)))
    specs.append(aot.KernelSpec(
        "lce_count", _count_kernel, {"TARGET": "*i64", "OUT": "*fp32", "N": "i32", "ignore_index": "i64",
                                     "BLOCK": "constexpr"}, dict(BLOCK=REDUCE_BLOCK), num_warps=4))
    specs.append(aot.KernelSpec(
        "lce_sum[mean]", _sum_kernel, {"LOSS": "*fp32", "COUNT": "*fp32", "OUT": "*fp32", "N": "i32",
                                       "MEAN": "constexpr", "BLOCK": "constexpr"},
        dict(MEAN=True, BLOCK=REDUCE_BLOCK), num_warps=4))
    sig = {"G": "*fp32"}
    for i in (1, 2, 3):
        sig.update({f"X{i}": "*bf16", f"Y{i}": "*bf16", f"n{i}": "i32"})
    sig.update(BLOCK="constexpr", INTERPRET="constexpr")
    specs.append(aot.KernelSpec("lce_scale", _scale_kernel, sig, dict(BLOCK=REDUCE_BLOCK, INTERPRET=False),
                                num_warps=4))
    return specs
