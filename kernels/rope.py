"""Rotary position embeddings (RoPE) applied to q and k in one kernel, forward and backward.

Two kernels:
- ``_rope_kernel``: q (B, L, Hq, D) and k (B, L, Hk, D) with any strides and a unit last
  stride (e.g. views of one fused QKV projection output); the outputs are new contiguous
  (B, L, H, D) tensors.
- ``_rope_packed_kernel``: one packed QKV projection output, a token's row holding
  (Hq + 2 Hk) heads [q; k; v] of D contiguous elements (token rows at any batch and sequence
  strides, e.g. (B, L, ...) or (L, B, ...)), into a new packed tensor of the same layout:
  the first Hq + Hk heads (q and k) rotated, v's heads copied in the same launch. The
  attention kernel reads that tensor in place (``attention_qkvpacked``) and its one packed
  gradient comes back through the same kernel (the inverse rotation; dv copied).
- ``_rope_qknorm_packed_kernel``: the same with each q and k head RMS-normalized over its D
  elements and scaled by the q or k weight first (Qwen3's ``q_norm``/``k_norm``, OLMo-style
  per-head norms), statistics in fp32 and one rounding per element; its backward reads the
  forward's input again (the statistics are recomputed) and writes the weights' gradients as
  per-program fp32 rows, summed in a fixed order (no atomics).

One program rotates BLOCK_H heads of one token: the angles of the token's D_rot / 2 frequency
pairs are computed (or loaded) once in fp32 and applied to every head of the block, so q and
k of a token share them.

Pairs (the two layouts of the literature, named as flash-attn's ``apply_rotary_emb``):
- half-split (``INTERLEAVED=False``): element i rotates with element i + D_rot / 2. GPT-NeoX's
  ``rotate_half``, which Hugging Face uses for LLaMA, Mistral, Qwen2 and GPT-NeoX.
- interleaved (``INTERLEAVED=True``): element 2i rotates with element 2i + 1. GPT-J's
  ``rotate_every_two`` and Meta's original LLaMA code (``torch.view_as_complex``).

Rotation of a pair (x1, x2) by angle t: (x1 cos t - x2 sin t, x2 cos t + x1 sin t). Its
transpose (``CONJ``, sin -> -sin) is the backward: the gradient of an orthogonal map.
Dimensions past D_rot (partial rotary, GPT-NeoX's ``rotary_pct``) are copied unchanged.

Angles, in fp32:
- from positions (``FROM_TABLE=False``; the token's index in its sequence when there is no
  positions tensor, ``HAS_POS=False``): t = pos * inv_freq[p] rounded to fp32, then
  ``cos(t) * scale`` and ``sin(t) * scale``: exactly Hugging Face's rotary modules
  (``position_ids.float() * inv_freq`` in fp32; ``attention_scaling`` as ``scale``);
- from cos/sin tables (``FROM_TABLE=True``), (B or 1, L, D_rot) in any float dtype, read at
  the pair's first element (index p in half-split, 2p interleaved), as Hugging Face lays them
  out (``cat((freqs, freqs))`` or ``repeat_interleave(freqs, 2)``).
"""
import torch
import triton
import triton.language as tl

from fused_block.kernels import common
from fused_block.kernels.norm import _div_n, _rstd


# Cephes' single-precision minimax polynomials for sin and cos on [-pi/4, pi/4] (about 1 ulp).
_S1, _S2, _S3 = tl.constexpr(-1.9515295891e-4), tl.constexpr(8.3321608736e-3), tl.constexpr(-1.6666654611e-1)
_C1, _C2 = tl.constexpr(2.443315711809948e-5), tl.constexpr(-1.388731625493765e-3)
_C3 = tl.constexpr(4.166664568298827e-2)


@triton.jit
def _sincos(angle):
    """fp32 (sin, cos) of fp32 ``angle``, within about 1 ulp for |angle| < 2^24.

    ``tl.sin``/``tl.cos`` compile to libdevice's ``__nv_sinf``/``__nv_cosf``, whose
    Payne-Hanek path for |x| > 105615 (reached at 128k positions) keeps an array on the stack:
    local memory. Here the reduction by pi/2 runs in fp64 instead (the fp32 angle is exact
    there, and the error of k * pi/2 stays below 1e-9 for every fp32 angle below 2^24), then
    the polynomials run in fp32 on [-pi/4, pi/4] and the quadrant picks sign and function.
    """
    a = angle.to(tl.float64)
    k = tl.floor(a * 0.6366197723675814 + 0.5)  # nearest multiple of pi/2
    r = (a - k * 1.5707963267948966).to(tl.float32)
    z = r * r
    s = ((_S1 * z + _S2) * z + _S3) * z * r + r
    c = ((_C1 * z + _C2) * z + _C3) * z * z - 0.5 * z + 1.0
    quadrant = k.to(tl.int64) & 3
    sin = tl.where((quadrant & 1) == 0, s, c)
    cos = tl.where((quadrant & 1) == 0, c, s)
    sin = tl.where(quadrant >= 2, -sin, sin)
    cos = tl.where((quadrant == 1) | (quadrant == 2), -cos, cos)
    return sin, cos


@triton.jit
def _angles(POS, FREQ, COS, SIN, b, t, stride_pb, stride_pl, stride_cb, stride_cl, scale, pairs, pair_ok,
            INTERLEAVED: tl.constexpr, FROM_TABLE: tl.constexpr, HAS_POS: tl.constexpr, CONJ: tl.constexpr):
    """fp32 (cos, sin) of token (b, t)'s frequency pairs; sin negated for the inverse rotation."""
    if FROM_TABLE:
        first = 2 * pairs if INTERLEAVED else pairs
        row = b * stride_cb + t * stride_cl
        cos = tl.load(COS + row + first, mask=pair_ok, other=0.0).to(tl.float32)
        sin = tl.load(SIN + row + first, mask=pair_ok, other=0.0).to(tl.float32)
    else:
        if HAS_POS:
            pos = tl.load(POS + b * stride_pb + t * stride_pl).to(tl.float32)
        else:
            pos = t.to(tl.float32)
        freq = tl.load(FREQ + pairs, mask=pair_ok, other=0.0)
        sin, cos = _sincos(pos * freq)
        cos = cos * scale
        sin = sin * scale
    if CONJ:
        sin = -sin
    return cos, sin


@triton.jit
def _rotate_heads(X, O, h0, H, stride_xh, stride_oh, cos, sin, pairs, pair_ok, rest, rest_ok,
                  ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_REST: tl.constexpr,
                  BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """Rotate heads [h0, h0 + BLOCK_H) of one token. X, O point at the token's head 0."""
    heads = h0 + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    x_rows = X + heads.to(tl.int64)[:, None] * stride_xh
    o_rows = O + heads.to(tl.int64)[:, None] * stride_oh
    if INTERLEAVED:
        c1 = 2 * pairs
        c2 = 2 * pairs + 1
    else:
        c1 = pairs
        c2 = pairs + ROT_HALF
    ok = head_ok[:, None] & pair_ok[None, :]
    x1 = tl.load(x_rows + c1[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + c2[None, :], mask=ok, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dtype = O.dtype.element_ty
    tl.store(o_rows + c1[None, :], common.cast(o1, dtype, INTERPRET), mask=ok)
    tl.store(o_rows + c2[None, :], common.cast(o2, dtype, INTERPRET), mask=ok)
    if HAS_REST:
        rok = head_ok[:, None] & rest_ok[None, :]
        xr = tl.load(x_rows + rest[None, :], mask=rok, other=0.0)
        tl.store(o_rows + rest[None, :], xr, mask=rok)


@triton.jit
def _rope_kernel(Q, K, QO, KO, POS, FREQ, COS, SIN,
                 L, HQ, HK, D, head_blocks_q,
                 stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh,
                 stride_qob, stride_qol, stride_qoh, stride_kob, stride_kol, stride_koh,
                 stride_pb, stride_pl, stride_cb, stride_cl, scale,
                 ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, FROM_TABLE: tl.constexpr,
                 CONJ: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_P: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """grid = (B * L, cdiv(HQ, BLOCK_H) + cdiv(HK, BLOCK_H)): one token, BLOCK_H heads of q or k."""
    token = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    b = token // L
    t = token % L
    pairs = tl.arange(0, BLOCK_P)
    pair_ok = pairs < ROT_HALF
    cos, sin = _angles(POS, FREQ, COS, SIN, b, t, stride_pb, stride_pl, stride_cb, stride_cl, scale, pairs,
                       pair_ok, INTERLEAVED, FROM_TABLE, True, CONJ)
    rest = 2 * ROT_HALF + tl.arange(0, BLOCK_R)
    rest_ok = rest < D
    if hb < head_blocks_q:
        _rotate_heads(Q + b * stride_qb + t * stride_ql, QO + b * stride_qob + t * stride_qol,
                      hb * BLOCK_H, HQ, stride_qh, stride_qoh, cos, sin, pairs, pair_ok, rest, rest_ok,
                      ROT_HALF, INTERLEAVED, HAS_REST, BLOCK_H, INTERPRET)
    else:
        _rotate_heads(K + b * stride_kb + t * stride_kl, KO + b * stride_kob + t * stride_kol,
                      (hb - head_blocks_q) * BLOCK_H, HK, stride_kh, stride_koh, cos, sin, pairs, pair_ok,
                      rest, rest_ok, ROT_HALF, INTERLEAVED, HAS_REST, BLOCK_H, INTERPRET)


@triton.jit
def _packed_token(X, O, L, stride_xb, stride_xl, stride_ob, stride_ol):
    """A packed-QKV program's token (int64), head block, batch, position, and its rows of X and O."""
    token = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    b = token // L
    t = token % L
    return token, hb, b, t, X + b * stride_xb + t * stride_xl, O + b * stride_ob + t * stride_ol


@triton.jit
def _copy_tail(x, o, block, first, copy_len, BLOCK_C: tl.constexpr):
    """Copy chunk ``block`` of the ``copy_len`` elements after a token's first ``first`` (v's
    heads, unchanged); within one token's row, int32 offsets suffice."""
    offs = block * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < copy_len
    tl.store(o + first + offs, tl.load(x + first + offs, mask=ok), mask=ok)


@triton.jit
def _rope_packed_kernel(X, O, POS, FREQ, COS, SIN,
                        L, NROT, D, rot_blocks, copy_len,
                        stride_xb, stride_xl, stride_ob, stride_ol,
                        stride_pb, stride_pl, stride_cb, stride_cl, scale,
                        ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, FROM_TABLE: tl.constexpr,
                        HAS_POS: tl.constexpr, CONJ: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """grid = (B * L, rot_blocks + cdiv(copy_len, BLOCK_C)). Per token: programs below
    ``rot_blocks`` rotate BLOCK_H of the first NROT heads (q, then k), the others copy a
    BLOCK_C chunk of the ``copy_len`` elements after them (v's heads) unchanged."""
    token, hb, b, t, x, o = _packed_token(X, O, L, stride_xb, stride_xl, stride_ob, stride_ol)
    if hb < rot_blocks:
        pairs = tl.arange(0, BLOCK_P)
        pair_ok = pairs < ROT_HALF
        cos, sin = _angles(POS, FREQ, COS, SIN, b, t, stride_pb, stride_pl, stride_cb, stride_cl, scale, pairs,
                           pair_ok, INTERLEAVED, FROM_TABLE, HAS_POS, CONJ)
        rest = 2 * ROT_HALF + tl.arange(0, BLOCK_R)
        _rotate_heads(x, o, hb * BLOCK_H, NROT, D, D, cos, sin, pairs, pair_ok, rest, rest < D,
                      ROT_HALF, INTERLEAVED, HAS_REST, BLOCK_H, INTERPRET)
    else:
        _copy_tail(x, o, hb - rot_blocks, NROT * D, copy_len, BLOCK_C)


@triton.jit
def _norm_rotate_heads(X, XIN, O, DWQ, DWK, WQ, WK, h0, NQ, H, D, inv_d, eps, cos, sin, pairs, pair_ok, rest,
                       rest_ok, ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_REST: tl.constexpr,
                       CONJ: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, W_OFFSET: tl.constexpr):
    """Heads [h0, h0 + BLOCK_H) of one token (X, XIN, O at its head 0, heads D apart; the
    first NQ of the H heads are q's): y = R(w * x / rms(x)), the RMS over the head's D elements
    in fp32 and w the q or k weight (D,), or 1 + that weight with W_OFFSET (Gemma 3). With CONJ, X is dy and XIN the forward's x: O = dx,
    and this block's weight gradient sum(R^T dy * x / rms(x)) over its q heads and over its k
    heads goes to the (D,) rows DWQ and DWK (zero where it has none)."""
    heads = h0 + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    is_q = (heads < NQ)[:, None]
    if INTERLEAVED:
        c1 = 2 * pairs
        c2 = 2 * pairs + 1
    else:
        c1 = pairs
        c2 = pairs + ROT_HALF
    ok = head_ok[:, None] & pair_ok[None, :]
    x_rows = (XIN if CONJ else X) + heads.to(tl.int64)[:, None] * D
    x1 = tl.load(x_rows + c1[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + c2[None, :], mask=ok, other=0.0).to(tl.float32)
    w1 = tl.where(is_q, tl.load(WQ + c1, mask=pair_ok, other=0.0).to(tl.float32)[None, :],
                  tl.load(WK + c1, mask=pair_ok, other=0.0).to(tl.float32)[None, :])
    w2 = tl.where(is_q, tl.load(WQ + c2, mask=pair_ok, other=0.0).to(tl.float32)[None, :],
                  tl.load(WK + c2, mask=pair_ok, other=0.0).to(tl.float32)[None, :])
    if W_OFFSET:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if HAS_REST:
        rok = head_ok[:, None] & rest_ok[None, :]
        xr = tl.load(x_rows + rest[None, :], mask=rok, other=0.0).to(tl.float32)
        wr = tl.where(is_q, tl.load(WQ + rest, mask=rest_ok, other=0.0).to(tl.float32)[None, :],
                      tl.load(WK + rest, mask=rest_ok, other=0.0).to(tl.float32)[None, :])
        if W_OFFSET:
            wr = wr + 1.0
        ss += tl.sum(xr * xr, axis=1)
    rstd = _rstd(_div_n(ss, D, inv_d, INTERPRET), eps, INTERPRET)[:, None]
    n1 = x1 * rstd
    n2 = x2 * rstd
    o_rows = O + heads.to(tl.int64)[:, None] * D
    dtype = O.dtype.element_ty
    if not CONJ:
        y1 = n1 * w1
        y2 = n2 * w2
        tl.store(o_rows + c1[None, :], common.cast(y1 * cos[None, :] - y2 * sin[None, :], dtype, INTERPRET), mask=ok)
        tl.store(o_rows + c2[None, :], common.cast(y2 * cos[None, :] + y1 * sin[None, :], dtype, INTERPRET), mask=ok)
        if HAS_REST:
            tl.store(o_rows + rest[None, :], common.cast(xr * rstd * wr, dtype, INTERPRET), mask=rok)
    else:
        g_rows = X + heads.to(tl.int64)[:, None] * D
        g1 = tl.load(g_rows + c1[None, :], mask=ok, other=0.0).to(tl.float32)
        g2 = tl.load(g_rows + c2[None, :], mask=ok, other=0.0).to(tl.float32)
        u1 = g1 * cos[None, :] - g2 * sin[None, :]  # R^T dy: sin is negated for CONJ
        u2 = g2 * cos[None, :] + g1 * sin[None, :]
        dot = tl.sum(u1 * w1 * n1, axis=1) + tl.sum(u2 * w2 * n2, axis=1)
        if HAS_REST:
            ur = tl.load(g_rows + rest[None, :], mask=rok, other=0.0).to(tl.float32)
            nr = xr * rstd
            dot += tl.sum(ur * wr * nr, axis=1)
        mean = _div_n(dot, D, inv_d, INTERPRET)[:, None]
        tl.store(o_rows + c1[None, :], common.cast(rstd * (u1 * w1 - n1 * mean), dtype, INTERPRET), mask=ok)
        tl.store(o_rows + c2[None, :], common.cast(rstd * (u2 * w2 - n2 * mean), dtype, INTERPRET), mask=ok)
        tl.store(DWQ + c1, tl.sum(tl.where(is_q, u1 * n1, 0.0), axis=0), mask=pair_ok)
        tl.store(DWQ + c2, tl.sum(tl.where(is_q, u2 * n2, 0.0), axis=0), mask=pair_ok)
        tl.store(DWK + c1, tl.sum(tl.where(is_q, 0.0, u1 * n1), axis=0), mask=pair_ok)
        tl.store(DWK + c2, tl.sum(tl.where(is_q, 0.0, u2 * n2), axis=0), mask=pair_ok)
        if HAS_REST:
            tl.store(o_rows + rest[None, :], common.cast(rstd * (ur * wr - nr * mean), dtype, INTERPRET), mask=rok)
            tl.store(DWQ + rest, tl.sum(tl.where(is_q, ur * nr, 0.0), axis=0), mask=rest_ok)
            tl.store(DWK + rest, tl.sum(tl.where(is_q, 0.0, ur * nr), axis=0), mask=rest_ok)


@triton.jit
def _rope_qknorm_packed_kernel(X, XIN, O, WQ, WK, DWQ, DWK, POS, FREQ, COS, SIN,
                               L, NQ, NROT, D, rot_blocks, copy_len,
                               stride_xb, stride_xl, stride_ib, stride_il, stride_ob, stride_ol,
                               stride_pb, stride_pl, stride_cb, stride_cl, scale, inv_d, eps,
                               ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, FROM_TABLE: tl.constexpr,
                               HAS_POS: tl.constexpr, CONJ: tl.constexpr, HAS_REST: tl.constexpr,
                               BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr, W_OFFSET: tl.constexpr):
    """``_rope_packed_kernel`` with q's and k's heads RMS-normalized first (Qwen3's q_norm and
    k_norm): grid = (B * L, rot_blocks + cdiv(copy_len, BLOCK_C)). The backward (CONJ) reads
    the gradient X and the forward's input XIN and writes, per rotating program, one (D,) fp32
    row of the q weight's gradient and one of k's (DWQ, DWK: (B * L * rot_blocks, D)), summed
    on the host in a fixed order."""
    token, hb, b, t, x, o = _packed_token(X, O, L, stride_xb, stride_xl, stride_ob, stride_ol)
    if hb < rot_blocks:
        pairs = tl.arange(0, BLOCK_P)
        pair_ok = pairs < ROT_HALF
        cos, sin = _angles(POS, FREQ, COS, SIN, b, t, stride_pb, stride_pl, stride_cb, stride_cl, scale, pairs,
                           pair_ok, INTERLEAVED, FROM_TABLE, HAS_POS, CONJ)
        rest = 2 * ROT_HALF + tl.arange(0, BLOCK_R)
        row = (token * rot_blocks + hb) * D
        _norm_rotate_heads(x, XIN + b * stride_ib + t * stride_il, o, DWQ + row, DWK + row, WQ, WK, hb * BLOCK_H,
                           NQ, NROT, D, inv_d, eps, cos, sin, pairs, pair_ok, rest, rest < D, ROT_HALF, INTERLEAVED,
                           HAS_REST, CONJ, BLOCK_H, INTERPRET, W_OFFSET)
    else:
        _copy_tail(x, o, hb - rot_blocks, NROT * D, copy_len, BLOCK_C)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------

# Elements of q/k one program moves: BLOCK_H heads x D. 4096 (e.g. 32 heads of 128) keeps a
# token's angles amortized over many heads while a program's tile stays in registers.
_TILE = 4096
_CONFIGS = common.ConfigCache("rope")


def _config(D, H):
    block_h = max(1, min(common.next_pow2(H), _TILE // common.next_pow2(D)))
    warps = 4 if block_h * D >= 2048 else (2 if block_h * D >= 512 else 1)
    return common.Config.of(num_warps=warps, BLOCK_H=block_h)


def _packed_config(D, n_rot, n_copy):
    """BLOCK_H of the rotated heads as ``_config``; the copy programs move up to one tile of
    v's elements each, with the warps the rotating programs use."""
    cfg = _config(D, n_rot)
    block_c = min(common.next_pow2(max(n_copy * D, 1)), _TILE)
    return common.Config.of(num_warps=cfg.num_warps, BLOCK_H=cfg["BLOCK_H"], BLOCK_C=block_c)


def _tables(inv_freq, cos, sin):
    """The angle sources as the kernels read them: ``inv_freq`` at unit stride, ``cos`` and
    ``sin`` at unit last stride and with one set of strides for both (the kernels take cos's)."""
    if cos is None:
        return common.unit(inv_freq), None, None
    cos, sin = common.unit(cos), common.unit(sin)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return inv_freq, cos, sin


def rope(q, k, positions, inv_freq, cos, sin, scale, rot_dim, interleaved, conj):
    """Rotate q (B, L, Hq, D) and k (B, L, Hk, D); returns contiguous ``(q_out, k_out)``.

    Angles from ``positions`` (B or 1, L) int and ``inv_freq`` (rot_dim / 2,) fp32 times
    ``scale``, or from ``cos``/``sin`` (B or 1, L, >= rot_dim) when ``positions`` is None.
    ``conj`` applies the inverse rotation (the backward). Inputs are checked by the caller.
    """
    B, L, HQ, D = q.shape
    HK = k.shape[2]
    dev = q.device
    qo = common.empty((B, L, HQ, D), q.dtype, dev)
    ko = common.empty((B, L, HK, D), k.dtype, dev)
    if B * L == 0:
        return qo, ko
    from_table = positions is None
    inv_freq, cos, sin = _tables(inv_freq, cos, sin)
    cfg = _CONFIGS.get((common.next_pow2(D), min(common.next_pow2(max(HQ, HK)), 64)), [_config(D, max(HQ, HK))],
                       None)
    block_h = cfg["BLOCK_H"]
    hbq = common.cdiv(HQ, block_h)
    grid = (B * L, hbq + common.cdiv(HK, block_h))
    table = cos if from_table else q  # unused pointers stand in for the absent inputs
    pos = positions if not from_table else q
    freq = inv_freq if not from_table else q
    stride_pb, stride_pl = (0, 0) if from_table else (positions.stride(0) if positions.shape[0] > 1 else 0,
                                                       positions.stride(1))
    stride_cb, stride_cl = (table.stride(0) if table.shape[0] > 1 else 0, table.stride(1)) if from_table else (0, 0)
    rot_half = rot_dim // 2
    args = (q, k, qo, ko, pos, freq, table, sin if from_table else q,
            L, HQ, HK, D, hbq,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            stride_pb, stride_pl, stride_cb, stride_cl, float(scale))
    constexprs = dict(ROT_HALF=rot_half, INTERLEAVED=interleaved, FROM_TABLE=from_table, CONJ=conj,
                      HAS_REST=rot_dim < D, BLOCK_P=common.next_pow2(rot_half),
                      BLOCK_R=common.next_pow2(max(D - rot_dim, 1)), INTERPRET=common.interpreting())
    common.launch("rope", _rope_kernel, grid, args, constexprs, cfg)
    return qo, ko


_PACKED_CONFIGS = common.ConfigCache("rope_qkvpacked")


def rope_packed(x, rows, n_rot, n_heads, positions, inv_freq, cos, sin, scale, rot_dim, interleaved, conj):
    """Rotate the first ``n_rot`` of the ``n_heads`` heads of every token of the packed ``x``
    (3-D, unit last stride, last dim ``n_heads * D``), copy the rest; returns a new contiguous
    tensor of x's shape. ``rows = (B, L)`` names x's batch and sequence dims: (0, 1) when
    batch-first, (1, 0) sequence-first; positions (B or 1, L) index the sequence dim (None:
    0..L-1). Angles and ``conj`` as :func:`rope`. Inputs are checked by the caller.
    """
    dim_b, dim_l = rows
    B, L = x.shape[dim_b], x.shape[dim_l]
    D = x.shape[2] // n_heads
    out = common.empty(x.shape, x.dtype, x.device)
    if B * L == 0:
        return out
    from_table = cos is not None
    inv_freq, cos, sin = _tables(inv_freq, cos, sin)
    n_copy = n_heads - n_rot
    cfg = _PACKED_CONFIGS.get((common.next_pow2(D), min(common.next_pow2(n_rot), 64),
                               min(common.next_pow2(max(n_copy * D, 1)), _TILE)),
                              [_packed_config(D, n_rot, n_copy)], None)
    rot_blocks = common.cdiv(n_rot, cfg["BLOCK_H"])
    grid = (B * L, rot_blocks + common.cdiv(n_copy * D, cfg["BLOCK_C"]))
    stride_pb, stride_pl = (0, 0) if positions is None else (positions.stride(0) if positions.shape[0] > 1 else 0,
                                                              positions.stride(1))
    stride_cb, stride_cl = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1)) if from_table else (0, 0)
    rot_half = rot_dim // 2
    args = (x, out, positions if positions is not None else x, inv_freq if inv_freq is not None else x,
            cos if from_table else x, sin if from_table else x,
            L, n_rot, D, rot_blocks, n_copy * D,
            x.stride(dim_b), x.stride(dim_l), out.stride(dim_b), out.stride(dim_l),
            stride_pb, stride_pl, stride_cb, stride_cl, float(scale))
    constexprs = dict(ROT_HALF=rot_half, INTERLEAVED=interleaved, FROM_TABLE=from_table,
                      HAS_POS=positions is not None, CONJ=conj, HAS_REST=rot_dim < D,
                      BLOCK_P=common.next_pow2(rot_half), BLOCK_R=common.next_pow2(max(D - rot_dim, 1)),
                      INTERPRET=common.interpreting())
    common.launch("rope_qkvpacked", _rope_packed_kernel, grid, args, constexprs, cfg)
    return out


_QKNORM_CONFIGS = common.ConfigCache("rope_qknorm")


def rope_packed_qknorm(x, x_in, wq, wk, rows, n_q, n_rot, n_heads, positions, inv_freq, cos, sin, scale, rot_dim,
                       interleaved, eps, conj, unit_offset=False):
    """:func:`rope_packed` with the first ``n_rot`` heads (q's ``n_q``, then k's) RMS-normalized
    over their D elements and scaled by ``wq`` / ``wk`` (D,) before the rotation. Forward
    (``conj=False``): returns the new packed tensor. Backward (``conj=True``): ``x`` is the
    output's gradient, ``x_in`` the forward's input; returns ``(dx, dwq, dwk)``, the weight
    gradients as fp32 (rows, D) partials to sum over dim 0. ``unit_offset``: the heads scaled by
    ``1 + w`` (Gemma 3's q_norm/k_norm). Inputs are checked by the caller."""
    dim_b, dim_l = rows
    B, L = x.shape[dim_b], x.shape[dim_l]
    D = x.shape[2] // n_heads
    out = common.empty(x.shape, x.dtype, x.device)
    n_copy = n_heads - n_rot
    cfg = _QKNORM_CONFIGS.get((common.next_pow2(D), min(common.next_pow2(n_rot), 64),
                               min(common.next_pow2(max(n_copy * D, 1)), _TILE)),
                              [_packed_config(D, n_rot, n_copy)], None)
    rot_blocks = common.cdiv(n_rot, cfg["BLOCK_H"])
    if conj:
        dwq, dwk = (common.empty((B * L * rot_blocks, D), torch.float32, x.device) for _ in range(2))
    if B * L == 0:
        return (out, dwq, dwk) if conj else out
    from_table = cos is not None
    inv_freq, cos, sin = _tables(inv_freq, cos, sin)
    wq, wk = common.unit(wq), common.unit(wk)
    grid = (B * L, rot_blocks + common.cdiv(n_copy * D, cfg["BLOCK_C"]))
    stride_pb, stride_pl = (0, 0) if positions is None else (positions.stride(0) if positions.shape[0] > 1 else 0,
                                                              positions.stride(1))
    stride_cb, stride_cl = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1)) if from_table else (0, 0)
    rot_half = rot_dim // 2
    args = (x, x_in, out, wq, wk, dwq if conj else x, dwk if conj else x,
            positions if positions is not None else x, inv_freq if inv_freq is not None else x,
            cos if from_table else x, sin if from_table else x,
            L, n_q, n_rot, D, rot_blocks, n_copy * D,
            x.stride(dim_b), x.stride(dim_l), x_in.stride(dim_b), x_in.stride(dim_l), out.stride(dim_b),
            out.stride(dim_l), stride_pb, stride_pl, stride_cb, stride_cl, float(scale), 1.0 / D, float(eps))
    constexprs = dict(ROT_HALF=rot_half, INTERLEAVED=interleaved, FROM_TABLE=from_table,
                      HAS_POS=positions is not None, CONJ=conj, HAS_REST=rot_dim < D,
                      BLOCK_P=common.next_pow2(rot_half), BLOCK_R=common.next_pow2(max(D - rot_dim, 1)),
                      INTERPRET=common.interpreting(), W_OFFSET=unit_offset)
    common.launch("rope_qknorm", _rope_qknorm_packed_kernel, grid, args, constexprs, cfg)
    return (out, dwq, dwk) if conj else out


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile specs: the head dims of the models we convert (64, 80 with a partial
# rotary of 64 as in GPT-NeoX's rotary_pct, 128, 256), both layouts, both angle sources,
# forward and backward, bf16 and fp32. The packed kernel: the same head dims at their models'
# head counts (LLaMA-7B 32 + 32 KV heads of 128, TinyLlama 32 + 4 of 64, GPT-NeoX 32 of 80,
# an MQA model 8 + 1 of 256), each angle source (the token index, positions, tables).
# ---------------------------------------------------------------------------------------------

def _sig(xt, table_t):
    sig = {"Q": f"*{xt}", "K": f"*{xt}", "QO": f"*{xt}", "KO": f"*{xt}", "POS": "*i64", "FREQ": "*fp32",
           "COS": f"*{table_t}", "SIN": f"*{table_t}"}
    sig.update({n: "i32" for n in ("L", "HQ", "HK", "D", "head_blocks_q")})
    sig.update({n: "i64" for n in ("stride_qb", "stride_ql", "stride_qh", "stride_kb", "stride_kl", "stride_kh",
                                   "stride_qob", "stride_qol", "stride_qoh", "stride_kob", "stride_kol", "stride_koh",
                                   "stride_pb", "stride_pl", "stride_cb", "stride_cl")})
    sig["scale"] = "fp32"
    sig.update({n: "constexpr" for n in ("ROT_HALF", "INTERLEAVED", "FROM_TABLE", "CONJ", "HAS_REST", "BLOCK_P",
                                         "BLOCK_R", "BLOCK_H", "INTERPRET")})
    return sig


def aot_specs():
    from fused_block.kernels import aot  # only the compile check needs it

    specs = []
    for xt in ("bf16", "fp32"):
        for D, rot, H in ((64, 64, 16), (80, 64, 32), (128, 128, 32), (256, 256, 8)):
            cfg = _config(D, H)
            for interleaved in (False, True):
                for from_table in (False, True):
                    for conj in (False, True):
                        tag = (f"D={D},rot={rot},{xt},{'interleaved' if interleaved else 'half'},"
                               f"{'table' if from_table else 'positions'}{',bwd' if conj else ''}")
                        consts = dict(ROT_HALF=rot // 2, INTERLEAVED=interleaved, FROM_TABLE=from_table, CONJ=conj,
                                      HAS_REST=rot < D, BLOCK_P=triton.next_power_of_2(rot // 2),
                                      BLOCK_R=triton.next_power_of_2(max(D - rot, 1)), INTERPRET=False,
                                      **cfg.meta())
                        specs.append(aot.KernelSpec(f"rope[{tag}]", _rope_kernel, _sig(xt, xt), consts,
                                                    num_warps=cfg.num_warps))
    # The default test suite builds each config (dtype, head dim) with the flag combinations in
    # turn (aot.take_turns); each function's specs run config by config, its combinations inside.
    parts = (("rope", specs, 8), ("packed", _packed_specs(aot), 12), ("qknorm", _qknorm_specs(aot), 4))
    every, groups = [], {}
    for name, part, combos in parts:
        groups[name] = [list(range(len(every) + i, len(every) + i + combos)) for i in range(0, len(part), combos)]
        every += part
    return aot.take_turns(every, groups)


def _packed_sig(xt):
    sig = {"X": f"*{xt}", "O": f"*{xt}", "POS": "*i64", "FREQ": "*fp32", "COS": f"*{xt}", "SIN": f"*{xt}"}
    sig.update({n: "i32" for n in ("L", "NROT", "D", "rot_blocks", "copy_len")})
    sig.update({n: "i64" for n in ("stride_xb", "stride_xl", "stride_ob", "stride_ol", "stride_pb", "stride_pl",
                                   "stride_cb", "stride_cl")})
    sig["scale"] = "fp32"
    sig.update({n: "constexpr" for n in ("ROT_HALF", "INTERLEAVED", "FROM_TABLE", "HAS_POS", "CONJ", "HAS_REST",
                                         "BLOCK_P", "BLOCK_R", "BLOCK_H", "BLOCK_C", "INTERPRET")})
    return sig


# Integers these models' shapes make multiples of 16, which the launcher's JIT specializes as
# such (so v's copy moves 16-byte vectors): the head dim, v's width and the row strides.
_PACKED_ALIGNED = ("D", "copy_len", "stride_xb", "stride_xl", "stride_ob", "stride_ol")


def _packed_specs(aot):
    specs = []
    for xt in ("bf16", "fp32"):
        for D, rot, H, HKV in ((64, 64, 32, 4), (80, 64, 32, 32), (128, 128, 32, 32), (256, 256, 8, 1)):
            cfg = _packed_config(D, H + HKV, HKV)
            for interleaved in (False, True):
                for source in ("index", "positions", "table"):
                    for conj in (False, True):
                        tag = (f"D={D},rot={rot},H={H},Hkv={HKV},{xt},{'interleaved' if interleaved else 'half'},"
                               f"{source}{',bwd' if conj else ''}")
                        consts = dict(ROT_HALF=rot // 2, INTERLEAVED=interleaved, FROM_TABLE=source == "table",
                                      HAS_POS=source == "positions", CONJ=conj, HAS_REST=rot < D,
                                      BLOCK_P=triton.next_power_of_2(rot // 2),
                                      BLOCK_R=triton.next_power_of_2(max(D - rot, 1)), INTERPRET=False, **cfg.meta())
                        specs.append(aot.KernelSpec(f"rope_qkvpacked[{tag}]", _rope_packed_kernel, _packed_sig(xt),
                                                    consts, num_warps=cfg.num_warps, aligned=_PACKED_ALIGNED))
    return specs



def _qknorm_sig(xt):
    sig = {"X": f"*{xt}", "XIN": f"*{xt}", "O": f"*{xt}", "WQ": f"*{xt}", "WK": f"*{xt}", "DWQ": "*fp32",
           "DWK": "*fp32", "POS": "*i64", "FREQ": "*fp32", "COS": f"*{xt}", "SIN": f"*{xt}"}
    sig.update({n: "i32" for n in ("L", "NQ", "NROT", "D", "rot_blocks", "copy_len")})
    sig.update({n: "i64" for n in ("stride_xb", "stride_xl", "stride_ib", "stride_il", "stride_ob", "stride_ol",
                                   "stride_pb", "stride_pl", "stride_cb", "stride_cl")})
    sig.update({n: "fp32" for n in ("scale", "inv_d", "eps")})
    sig.update({n: "constexpr" for n in ("ROT_HALF", "INTERLEAVED", "FROM_TABLE", "HAS_POS", "CONJ", "HAS_REST",
                                         "BLOCK_P", "BLOCK_R", "BLOCK_H", "BLOCK_C", "INTERPRET", "W_OFFSET")})
    return sig


def _qknorm_specs(aot):
    """The per-head-norm kernel at Qwen3's shapes (head dim 128; 8B: 32 + 8 KV heads, 0.6B:
    16 + 8) and Gemma 3's (head dim 256, the weights as 1 + w; 4B: 8 + 4 KV heads, 27B: 32 +
    16), half-split pairs from positions or tables, forward and backward."""
    specs = []
    for xt in ("bf16", "fp32"):
        for D, H, HKV, offset in ((128, 32, 8, False), (128, 16, 8, False), (256, 8, 4, True), (256, 32, 16, True)):
            cfg = _packed_config(D, H + HKV, HKV)
            for source in ("positions", "table"):
                for conj in (False, True):
                    tag = f"D={D},H={H},Hkv={HKV},{xt},{source}{',1+w' if offset else ''}{',bwd' if conj else ''}"
                    consts = dict(ROT_HALF=D // 2, INTERLEAVED=False, FROM_TABLE=source == "table",
                                  HAS_POS=source == "positions", CONJ=conj, HAS_REST=False, BLOCK_P=D // 2, BLOCK_R=1,
                                  INTERPRET=False, W_OFFSET=offset, **cfg.meta())
                    specs.append(aot.KernelSpec(f"rope_qknorm[{tag}]", _rope_qknorm_packed_kernel, _qknorm_sig(xt),
                                                consts, num_warps=cfg.num_warps, aligned=_PACKED_ALIGNED))
    return specs
