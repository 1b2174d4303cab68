"""Fused softmax attention (FlashAttention-style): validation, ``torch.library`` ops, public API.

- ``attention(q, k, v, ...)`` takes the layout of ``torch.nn.functional.scaled_dot_product_attention``:
  q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D), any strides with a contiguous last dim.
- ``attention_qkvpacked(qkv, num_heads, num_kv_heads, ...)`` takes a self-attention QKV
  projection as it comes out of the matmul, (B, L, (H + 2 Hkv) * D) (or (L, B, ...) with
  ``batch_first=False``), reads q, k, v from it in place, returns the output in the layout the
  out-projection reads, (B, L, H * D) / (L, B, H * D), and its backward writes dQ, dK and dV
  straight into one gradient buffer of qkv's shape: no split, merge, copy or cat.

The Lq x Lk score matrix is never materialized; the forward saves only ``out`` and the fp32
log-sum-exp (B, Hq, Lq), and dropout is regenerated from a seed rather than stored.

Ops (registered with ``fused_block._library.op``, autograd in ``torch.autograd.Function``s
around them, so eager calls skip the dispatcher and ``torch.compile(fullgraph=True)`` sees
opaque ops with fake implementations): ``attention_fwd`` / ``attention_bwd`` (SDPA layout;
outputs and gradients in their inputs' memory order, so a (B, L, H, D)-ordered q gives an
output whose head merge is a view) and ``attention_packed_fwd`` / ``attention_packed_bwd``.
"""
import math
import weakref
from typing import Optional

import torch
from torch import Tensor

from fused_block import _attn_sdpa, _backend, _library, _timing, _validate, reference
from fused_block.kernels import attention as _kernels
from fused_block.kernels import common

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# fp32 tiles are twice as wide: the kernels take fp32 up to this head dim.
MAX_FP32_HEAD_DIM = _kernels.MAX_FP32_BLOCK_D


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------

def _memory_order(t: Tensor) -> list:
    """Dims 0..2 of a (B, H, L, D) tensor from the outermost in memory (stable by decreasing stride)."""
    return sorted(range(3), key=lambda i: -t.stride(i))


def _like(t: Tensor, shape, dtype, alloc) -> Tensor:
    """A new (B, H, L, D) tensor of ``shape`` whose dims 0..2 are laid out in ``t``'s memory
    order (stable by decreasing stride), last dim contiguous: (B, L, H, D)-ordered q gives a
    (B, L, H, D)-ordered output. ``alloc(shape, dtype)`` allocates a contiguous buffer."""
    order = _memory_order(t)
    buf = alloc([shape[i] for i in order] + [shape[3]], dtype)
    return buf.permute(*[order.index(i) for i in range(3)], 3)


def _in_order_of(t: Tensor, out: Tensor) -> Tensor:
    """``out`` (B, H, L, D) with dims 0..2 laid out in ``t``'s memory order, as :func:`_like`
    lays out the kernels' outputs (a copy where it is not already; no in-place write, so
    torch.func transforms take it)."""
    order = _memory_order(t)
    return out.permute(*order, 3).contiguous().permute(*[order.index(i) for i in range(3)], 3)


def _heads(t: Tensor, n_heads: int, batch_first: bool) -> Tensor:
    """(B, L, n * D) or (L, B, n * D) with a contiguous last dim -> the (B, n, L, D) view."""
    t = t.unflatten(-1, (n_heads, -1))
    return t.transpose(1, 2) if batch_first else t.permute(1, 2, 0, 3)


def _split_packed(qkv: Tensor, num_heads: int, num_kv_heads: int, batch_first: bool):
    """Views q (B, H, L, D), k and v (B, Hkv, L, D) of a packed QKV projection."""
    t = _heads(qkv, num_heads + 2 * num_kv_heads, batch_first)
    return t[:, :num_heads], t[:, num_heads:num_heads + num_kv_heads], t[:, num_heads + num_kv_heads:]


def _head_views(t: Tensor, counts, batch_first: bool):
    """For the ops' implementations (the kernels' arguments, outside autograd): the (B, n, L, D)
    views of consecutive head groups of ``n`` heads each (``counts``) of (B, L, sum(n) * D) or
    (L, B, sum(n) * D) ``t``, as :func:`_heads` and :func:`_split_packed` give them, one
    ``as_strided`` each (their unflatten, transpose and slices cost about twice the host time)."""
    E = t.shape[-1]
    D = E // sum(counts)
    if D * sum(counts) != E:
        raise ValueError(f"a packed tensor's last dim {E} is not a multiple of its {sum(counts)} heads")
    s0, s1, s2 = t.stride()
    B, L, sb, sl = (t.shape[0], t.shape[1], s0, s1) if batch_first else (t.shape[1], t.shape[0], s1, s0)
    strides, offset, views = (sb, D * s2, sl, s2), t.storage_offset(), []
    for n in counts:
        views.append(t.as_strided((B, n, L, D), strides, offset))
        offset += n * D * s2
    return views


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------

def _fwd_fake(q, k, v, key_padding_mask, seed, causal, scale, dropout_p, window_left=-1, window_right=-1, softcap=0.0,
              sinks=None, alibi_slopes=None, bias=None, mask=None):
    out = _like(q, q.shape, q.dtype, lambda s, dt: q.new_empty(s, dtype=dt))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@_library.op("attention_fwd", fake=_fwd_fake)
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], seed: Optional[Tensor],
                  causal: bool, scale: float, dropout_p: float, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0, sinks: Optional[Tensor] = None,
                  alibi_slopes: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                  mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: out (B, Hq, Lq, D) in q's dtype and memory order, lse (B, Hq, Lq) fp32.
    ``softcap`` 0 = none; ``bias`` / ``mask`` broadcastable to (B, Hq, Lq, Lk)."""
    with _backend.device_guard(q):
        out = _like(q, q.shape, q.dtype, lambda s, dt: common.empty(s, dt, q.device))
        lse = common.empty(q.shape[:3], torch.float32, q.device)
        _kernels.forward(q, k, v, out, lse, key_padding_mask, seed, causal, scale, dropout_p,
                         window=(window_left, window_right), softcap=softcap, sinks=sinks, alibi=alibi_slopes,
                         bias=bias, mask=mask)
    return out, lse


def _bwd_fake(dout, q, k, v, out, lse, dlse, key_padding_mask, seed, causal, scale, dropout_p, window_left=-1,
              window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None, bias=None, mask=None, bias_grad=False):
    def alloc(s, dt):
        return q.new_empty(s, dtype=dt)
    return (_like(q, q.shape, q.dtype, alloc), _like(k, k.shape, k.dtype, alloc), _like(k, v.shape, v.dtype, alloc),
            *_extra_grads_fake(q, sinks, bias, bias_grad))


def _extra_grads_fake(q, sinks, bias, bias_grad):
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    dbias = q.new_empty((0,)) if bias is None or not bias_grad else bias.new_empty(bias.shape)
    return dsinks, dbias


def _extra_grads(q, sinks, bias, bias_grad):
    """Buffers of the sinks' and the bias's gradients: dsinks (Hq,) fp32 (or None) and dbias in
    the bias's own size and dtype (its shape with leading 1s to 4 dims: the kernel sums dS
    over the broadcast dims into it), or None."""
    dsinks = torch.empty(q.shape[1], dtype=torch.float32, device=q.device) if sinks is not None else None
    dbias = None
    if bias is not None and bias_grad:
        dbias = common.empty((1,) * (4 - bias.dim()) + tuple(bias.shape), bias.dtype, q.device)
    return dsinks, dbias


def _finish_extra_grads(q, dsinks, dbias, sinks, bias):
    """The gradients in the inputs' shapes and dtypes, empty stand-ins where there is none."""
    ds = q.new_empty((0,)) if dsinks is None else dsinks.to(sinks.dtype)
    db = q.new_empty((0,)) if dbias is None else dbias.view(bias.shape)
    return ds, db


@_library.op("attention_bwd", fake=_bwd_fake)
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                  key_padding_mask: Optional[Tensor], seed: Optional[Tensor], causal: bool, scale: float,
                  dropout_p: float, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  sinks: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                  bias: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                  bias_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks, dbias)``: dq, dk, dv in q's / k's memory order (dv like dk); dsinks
    in sinks' shape and dtype, dbias (with ``bias_grad``) in bias's, else empty (0,) tensors.
    ``dlse`` or None is the LSE's gradient."""
    with _backend.device_guard(q):
        def alloc(s, dt):
            return common.empty(s, dt, q.device)
        dq, dk, dv = _like(q, q.shape, q.dtype, alloc), _like(k, k.shape, k.dtype, alloc), \
            _like(k, v.shape, v.dtype, alloc)
        dsinks, dbias = _extra_grads(q, sinks, bias, bias_grad)
        _kernels.backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, key_padding_mask, seed, causal, scale,
                          dropout_p, window=(window_left, window_right), softcap=softcap, sinks=sinks, dsinks=dsinks,
                          alibi=alibi_slopes, bias=bias, dbias=dbias, mask=mask)
        dsinks, dbias = _finish_extra_grads(q, dsinks, dbias, sinks, bias)
    return dq, dk, dv, dsinks, dbias


def _packed_shapes(qkv, num_heads, num_kv_heads, batch_first):
    B, L = (qkv.shape[0], qkv.shape[1]) if batch_first else (qkv.shape[1], qkv.shape[0])
    D = qkv.shape[2] // (num_heads + 2 * num_kv_heads)
    out_shape = (B, L, num_heads * D) if batch_first else (L, B, num_heads * D)
    return out_shape, (B, num_heads, L)


def _packed_fwd_fake(qkv, num_heads, num_kv_heads, batch_first, key_padding_mask, seed, causal, scale, dropout_p,
                     window_left=-1, window_right=-1):
    out_shape, lse_shape = _packed_shapes(qkv, num_heads, num_kv_heads, batch_first)
    return qkv.new_empty(out_shape), qkv.new_empty(lse_shape, dtype=torch.float32)


@_library.op("attention_packed_fwd", fake=_packed_fwd_fake)
def attention_packed_fwd(qkv: Tensor, num_heads: int, num_kv_heads: int, batch_first: bool,
                         key_padding_mask: Optional[Tensor], seed: Optional[Tensor], causal: bool, scale: float,
                         dropout_p: float, window_left: int = -1, window_right: int = -1) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: out (B, L, H * D) (or (L, B, H * D)) contiguous, lse (B, H, L) fp32."""
    with _backend.device_guard(qkv):
        out_shape, lse_shape = _packed_shapes(qkv, num_heads, num_kv_heads, batch_first)
        out = common.empty(out_shape, qkv.dtype, qkv.device)
        lse = common.empty(lse_shape, torch.float32, qkv.device)
        q, k, v = _head_views(qkv, (num_heads, num_kv_heads, num_kv_heads), batch_first)
        (o,) = _head_views(out, (num_heads,), batch_first)
        _kernels.forward(q, k, v, o, lse, key_padding_mask, seed, causal, scale, dropout_p,
                         window=(window_left, window_right))
    return out, lse


def _packed_bwd_fake(dout, qkv, out, lse, dlse, num_heads, num_kv_heads, batch_first, key_padding_mask, seed,
                     causal, scale, dropout_p, window_left=-1, window_right=-1):
    return qkv.new_empty(qkv.shape)


@_library.op("attention_packed_bwd", fake=_packed_bwd_fake)
def attention_packed_bwd(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                         num_heads: int, num_kv_heads: int, batch_first: bool, key_padding_mask: Optional[Tensor],
                         seed: Optional[Tensor], causal: bool, scale: float, dropout_p: float, window_left: int = -1,
                         window_right: int = -1) -> Tensor:
    """dqkv, contiguous with qkv's shape: the kernel writes dQ, dK, dV into their slices."""
    with _backend.device_guard(qkv):
        dqkv = common.empty(qkv.shape, qkv.dtype, qkv.device)
        counts = (num_heads, num_kv_heads, num_kv_heads)
        q, k, v = _head_views(qkv, counts, batch_first)
        dq, dk, dv = _head_views(dqkv, counts, batch_first)
        (do,), (o,) = _head_views(dout, counts[:1], batch_first), _head_views(out, counts[:1], batch_first)
        _kernels.backward(do, q, k, v, o, lse, dlse, dq, dk, dv, key_padding_mask, seed, causal, scale, dropout_p,
                          window=(window_left, window_right))
    return dqkv


# Packed (varlen) sequences: q (Tq, Hq, D), k and v (Tk, Hkv, D), int32 cu_seqlens (B + 1,).
# The kernels see (1, H, T, D) views; out is (Tq, Hq, D) contiguous, lse (Hq, Tq).

def _tokens(t: Tensor) -> Tensor:
    """(T, H, D) -> the kernels' (1, H, T, D) view."""
    return t.permute(1, 0, 2)[None]


def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, causal, scale,
                     dropout_p, window_left, window_right, softcap=0.0, sinks=None, alibi_slopes=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@_library.op("attention_varlen_fwd", fake=_varlen_fwd_fake)
def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, seed: Optional[Tensor], causal: bool, scale: float,
                         dropout_p: float, window_left: int, window_right: int, softcap: float = 0.0,
                         sinks: Optional[Tensor] = None,
                         alibi_slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: out (Tq, Hq, D) contiguous in q's dtype, lse (Hq, Tq) fp32."""
    with _backend.device_guard(q):
        out = common.empty(q.shape, q.dtype, q.device)
        lse = common.empty((q.shape[1], q.shape[0]), torch.float32, q.device)
        _kernels.forward(_tokens(q), _tokens(k), _tokens(v), _tokens(out), lse[None], None, seed, causal, scale,
                         dropout_p, window=(window_left, window_right),
                         varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), softcap=softcap,
                         sinks=sinks, alibi=alibi_slopes)
    return out, lse


def _varlen_bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed,
                     causal, scale, dropout_p, window_left, window_right, softcap=0.0, sinks=None, alibi_slopes=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            _extra_grads_fake(q, sinks, None, False)[0])


@_library.op("attention_varlen_bwd", fake=_varlen_bwd_fake)
def attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, seed: Optional[Tensor], causal: bool, scale: float, dropout_p: float,
                         window_left: int, window_right: int, softcap: float = 0.0, sinks: Optional[Tensor] = None,
                         alibi_slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)``, contiguous, of q's, k's, v's and sinks' shapes (dsinks: an empty
    (0,) tensor without sinks)."""
    with _backend.device_guard(q):
        dq = common.empty(q.shape, q.dtype, q.device)
        dk = common.empty(k.shape, k.dtype, k.device)
        dv = common.empty(v.shape, v.dtype, v.device)
        dsinks, _ = _extra_grads(q[None].transpose(1, 2), sinks, None, False)
        _kernels.backward(_tokens(dout), _tokens(q), _tokens(k), _tokens(v), _tokens(out), lse[None],
                          None if dlse is None else dlse[None], _tokens(dq), _tokens(dk), _tokens(dv), None, seed,
                          causal, scale, dropout_p, window=(window_left, window_right),
                          varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), softcap=softcap,
                          sinks=sinks, dsinks=dsinks, alibi=alibi_slopes)
        dsinks, _ = _finish_extra_grads(q, dsinks, None, sinks, None)
    return dq, dk, dv, dsinks


def _split_tokens(qkv: Tensor, num_heads: int, num_kv_heads: int):
    """Views q (T, H, D), k and v (T, Hkv, D) of a packed (T, (H + 2 Hkv) * D) projection."""
    t = qkv.unflatten(-1, (num_heads + 2 * num_kv_heads, -1))
    return t[:, :num_heads], t[:, num_heads:num_heads + num_kv_heads], t[:, num_heads + num_kv_heads:]


def _varlen_packed_fwd_fake(qkv, cu_seqlens, max_seqlen, num_heads, num_kv_heads, seed, causal, scale, dropout_p,
                            window_left, window_right):
    D = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    return (qkv.new_empty((qkv.shape[0], num_heads * D)),
            qkv.new_empty((num_heads, qkv.shape[0]), dtype=torch.float32))


@_library.op("attention_varlen_packed_fwd", fake=_varlen_packed_fwd_fake)
def attention_varlen_packed_fwd(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, num_kv_heads: int,
                                seed: Optional[Tensor], causal: bool, scale: float, dropout_p: float, window_left: int,
                                window_right: int) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: out (T, H * D) contiguous (the out-projection's input), lse (H, T)."""
    with _backend.device_guard(qkv):
        q, k, v = _split_tokens(qkv, num_heads, num_kv_heads)
        out = common.empty((qkv.shape[0], num_heads * q.shape[2]), qkv.dtype, qkv.device)
        lse = common.empty((num_heads, qkv.shape[0]), torch.float32, qkv.device)
        _kernels.forward(_tokens(q), _tokens(k), _tokens(v), _tokens(out.view(q.shape)), lse[None], None, seed,
                         causal, scale, dropout_p, window=(window_left, window_right),
                         varlen=(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen))
    return out, lse


def _varlen_packed_bwd_fake(dout, qkv, out, lse, dlse, cu_seqlens, max_seqlen, num_heads, num_kv_heads, seed,
                            causal, scale, dropout_p, window_left, window_right):
    return qkv.new_empty(qkv.shape)


@_library.op("attention_varlen_packed_bwd", fake=_varlen_packed_bwd_fake)
def attention_varlen_packed_bwd(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                                cu_seqlens: Tensor, max_seqlen: int, num_heads: int, num_kv_heads: int,
                                seed: Optional[Tensor], causal: bool, scale: float, dropout_p: float, window_left: int,
                                window_right: int) -> Tensor:
    """dqkv, contiguous with qkv's shape: the kernel writes dQ, dK, dV into their slices."""
    with _backend.device_guard(qkv):
        dqkv = common.empty(qkv.shape, qkv.dtype, qkv.device)
        q, k, v = _split_tokens(qkv, num_heads, num_kv_heads)
        dq, dk, dv = _split_tokens(dqkv, num_heads, num_kv_heads)
        _kernels.backward(_tokens(dout.view(q.shape)), _tokens(q), _tokens(k), _tokens(v), _tokens(out.view(q.shape)),
                          lse[None], None if dlse is None else dlse[None], _tokens(dq), _tokens(dk), _tokens(dv), None,
                          seed, causal, scale, dropout_p, window=(window_left, window_right),
                          varlen=(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen))
    return dqkv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, seed, causal, scale, dropout_p, window_left, window_right, softcap,
                sinks, alibi_slopes, bias, mask):
        out, lse = attention_fwd(q, k, v, key_padding_mask, seed, causal, scale, dropout_p, window_left,
                                 window_right, softcap, sinks, alibi_slopes, bias, mask)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed, sinks, alibi_slopes, bias, mask)
        ctx.options = (causal, scale, dropout_p, window_left, window_right, softcap)
        return out, lse

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, key_padding_mask, seed, sinks, alibi_slopes, bias, mask = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else common.unit(dout)
        bias_grad = bias is not None and ctx.needs_input_grad[13]
        dq, dk, dv, dsinks, dbias = attention_bwd(dout, q, k, v, out, lse, dlse, key_padding_mask, seed,
                                                  *ctx.options, sinks, alibi_slopes, bias, mask, bias_grad)
        return (dq, dk, dv, None, None, None, None, None, None, None, None,
                dsinks if sinks is not None and ctx.needs_input_grad[11] else None, None,
                dbias if bias_grad else None, None)


_Attention_apply = _library.fast_apply(_Attention)


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, num_heads, num_kv_heads, batch_first, key_padding_mask, seed, causal, scale, dropout_p,
                window_left, window_right):
        out, lse = attention_packed_fwd(qkv, num_heads, num_kv_heads, batch_first, key_padding_mask, seed, causal,
                                        scale, dropout_p, window_left, window_right)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(qkv, out, lse, key_padding_mask, seed)
        ctx.args = (num_heads, num_kv_heads, batch_first)
        ctx.options = (causal, scale, dropout_p, window_left, window_right)
        return out, lse

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dout, dlse):
        qkv, out, lse, key_padding_mask, seed = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else common.unit(dout)
        dqkv = attention_packed_bwd(dout, qkv, out, lse, dlse, *ctx.args, key_padding_mask, seed, *ctx.options)
        return dqkv, None, None, None, None, None, None, None, None, None, None


_PackedAttention_apply = _library.fast_apply(_PackedAttention)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, causal, scale,
                dropout_p, window_left, window_right, softcap, sinks, alibi_slopes):
        # cu_seqlens_k None: the queries' (Dynamo traces no apply that takes one tensor twice).
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, causal, scale, dropout_p,
                window_left, window_right, softcap, sinks, alibi_slopes)
        out, lse = attention_varlen_fwd(q, k, v, *args)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, sinks, alibi_slopes)
        ctx.options = (max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, window_left, window_right, softcap)
        return out, lse

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k, seed, sinks, alibi_slopes = ctx.saved_tensors
        max_q, max_k, *options = ctx.options
        dout = torch.zeros_like(out) if dout is None else common.unit(dout)
        dq, dk, dv, dsinks = attention_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, seed,
                                                  *options, sinks, alibi_slopes)
        return (dq, dk, dv) + (None,) * 11 + (dsinks if sinks is not None else None, None)


_VarlenAttention_apply = _library.fast_apply(_VarlenAttention)


class _VarlenPackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, num_heads, num_kv_heads, seed, causal, scale, dropout_p,
                window_left, window_right):
        out, lse = attention_varlen_packed_fwd(qkv, cu_seqlens, max_seqlen, num_heads, num_kv_heads, seed, causal,
                                               scale, dropout_p, window_left, window_right)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(qkv, out, lse, cu_seqlens, seed)
        ctx.options = (max_seqlen, num_heads, num_kv_heads)
        ctx.flags = (causal, scale, dropout_p, window_left, window_right)
        return out, lse

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dout, dlse):
        qkv, out, lse, cu_seqlens, seed = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dqkv = attention_varlen_packed_bwd(dout, qkv, out, lse, dlse, cu_seqlens, *ctx.options, seed, *ctx.flags)
        return (dqkv,) + (None,) * 10


_VarlenPackedAttention_apply = _library.fast_apply(_VarlenPackedAttention)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------

def _check_head_dim(name, D):
    if D % 8 != 0 or not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}'s head dim must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {D}")


def _check_window(window):
    """``window`` as a (left, right) pair of ints, each -1 (unlimited) or >= 0."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    for side, n in zip(("left", "right"), window):
        if type(n) is not int:
            n = _validate.integer(f"window's {side} size", n)  # (numpy integers too)
        if n < -1:
            raise ValueError(f"window's {side} size must be -1 (unlimited) or >= 0, got {n}")
    return int(window[0]), int(window[1])


def _check_options(causal, scale, key_padding_mask, dropout_p, B, Lk, ref_name, ref):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_validate.type_name(causal)}")
    if scale is not None:
        scale = _validate.positive("scale", scale)
        if not _validate.finite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if key_padding_mask is not None:
        _validate.tensor("key_padding_mask", key_padding_mask, dtypes=(torch.bool,), ndim=2)
        _validate.shape("key_padding_mask", key_padding_mask, (B, Lk))
        _validate.same_device(ref_name, ref, key_padding_mask=key_padding_mask)
    _validate.probability("dropout_p", dropout_p)  # 1.0: see _all_dropped


def _check(q, k, v, causal, scale, key_padding_mask, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(name, t, ndim=4)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    _validate.same_device("q", q, k=k, v=v)
    B, Hq, Lq, D = q.shape
    _check_head_dim("q", D)
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have shape (B={B}, Hkv, Lk, D={D}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    _validate.shape("v", v, k.shape)
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of k's heads ({Hkv})")
    _check_options(causal, scale, key_padding_mask, dropout_p, B, k.shape[2], "q", q)


def _autocast(*tensors):
    """Under ``torch.autocast``, q, k and v (or qkv) in its dtype, as SDPA (one of autocast's
    lower-precision ops) takes them; float64 as given, as autocast leaves it. The score
    modifications keep their dtypes (sinks and slopes fp32; a bias fp32 or q's dtype)."""
    if not torch._C._is_any_autocast_enabled() or not isinstance(tensors[0], Tensor):
        return tensors  # (a non-tensor q: the checks' TypeError)
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


def _check_return_lse(return_lse):
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {_validate.type_name(return_lse)}")


def _check_softcap(softcap):
    """``softcap`` as the kernels' float (0.0 = none)."""
    if softcap is None:
        return 0.0
    softcap = _validate.positive("softcap", softcap)
    if not _validate.finite(softcap):
        raise ValueError(f"softcap must be finite, got {softcap}")
    return float(softcap)


def _broadcastable(name, t, shape):
    if t.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dims (broadcastable to (B, Hq, Lq, Lk) = {tuple(shape)}), "
                         f"got shape {tuple(t.shape)}")
    for n, want in zip(reversed(t.shape), reversed(shape)):
        if n != want and n != 1:
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to (B, Hq, Lq, Lk) = "
                             f"{tuple(shape)}")


def _check_scores(q, B, Hq, Lq, Lk, sinks, alibi_slopes, bias=None, mask=None, dense=True):
    """Shapes, dtypes and devices of the score modifications (``dense``: bias and mask allowed).
    Returns sinks and slopes as given (the launchers read them at unit stride: common.unit)."""
    if sinks is not None:
        _validate.tensor("sinks", sinks, dtypes=(torch.float32, q.dtype), ndim=1)
        _validate.shape("sinks", sinks, (Hq,))
        _validate.same_device("q", q, sinks=sinks)
    if alibi_slopes is not None:
        _validate.tensor("alibi_slopes", alibi_slopes, dtypes=(torch.float32,))
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes must have shape (Hq,) = ({Hq},) or (B, Hq) = ({B}, {Hq}), "
                             f"got {tuple(alibi_slopes.shape)}")
        _validate.same_device("q", q, alibi_slopes=alibi_slopes)
        if alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise ValueError("alibi_slopes: no gradient flows to the slopes; pass alibi_slopes.detach()")
    for name, t, dtypes in (("bias", bias, (torch.float32, q.dtype)), ("mask", mask, (torch.bool,))):
        if t is None:
            continue
        if not dense:
            raise ValueError(f"{name} is not supported with packed (varlen) sequences")
        _validate.tensor(name, t, dtypes=dtypes)
        _broadcastable(name, t, (B, Hq, Lq, Lk))
        _validate.same_device("q", q, **{name: t})
    return sinks, alibi_slopes


def _check_fp32_width(name, t, D):
    if t.dtype == torch.float32 and D > MAX_FP32_HEAD_DIM:
        raise TypeError(f"{name}: fp32 attention kernels take head dims up to {MAX_FP32_HEAD_DIM}, got {D}; "
                        "use bf16 or fp16")


# The kernels take dropout_p in fp32, where a p above 1 - 2**-25 is 1.0: their keep threshold
# (p * 2**32 as uint32) would overflow and their 1 / (1 - p) scale be infinite, an output of
# huge values or NaN instead of dropout's near-certain zeros. Such a p runs as fp32's largest
# probability below 1 (the kernels' keep rate is 1 - fp32(p) with the matching scale, unbiased):
# the rate moves by less than fp32's spacing there, as every p's does when rounded to fp32.
_MAX_KERNEL_P = 1.0 - 2.0 ** -24


def _all_dropped(result, return_lse):
    """What ``dropout_p == 1.0`` gives, as SDPA (and dropout with p = 1) gives it: every
    probability dropped, so ``out`` is zero, with zero gradients for q, k, v (and the
    differentiable options). ``result``: the ``(out, lse)`` of the same call with
    ``dropout_p=0.0``; the LSE does not depend on dropout. The output is ``out * 0`` (torch's
    dropout with p = 1 is that product): its layout, and NaN where out is NaN, as SDPA's."""
    out, lse = result
    out = out * 0.0
    return (out, lse) if return_lse else out


def _dropout_p(dropout_p):
    """A validated ``dropout_p`` as the float the kernels can take (see ``_MAX_KERNEL_P``)."""
    p = float(dropout_p)
    return _MAX_KERNEL_P if p > _MAX_KERNEL_P else p


def _seed(dropout_p, device):
    # No seed tensor (and no random number drawn) without dropout.
    return _backend.dropout_seed(dropout_p, device) if dropout_p > 0.0 else None


def attention(q, k, v, causal=False, scale=None, key_padding_mask=None, dropout_p=0.0, *, window=(-1, -1),
              softcap=None, sinks=None, alibi_slopes=None, bias=None, mask=None, return_lse=False):
    """Softmax attention ``softmax(q @ k^T * scale + mask) @ v`` without the score matrix.

    - ``q``: (B, Hq, Lq, D); ``k``, ``v``: (B, Hkv, Lk, D), SDPA's layout. Any strides with a
      contiguous last dim (views of one fused QKV projection need no copy); other strides are
      copied. GQA/MQA: ``Hq % Hkv == 0`` and query head h uses K/V head ``h // (Hq // Hkv)``.
      Lq and Lk are independent (cross-attention).
    - D: every multiple of 8 in [16, 256] (padded to a power of two inside the kernels).
    - dtypes: fp16 and bf16 (fp32 accumulation and softmax); fp32 with D <= 128, whose products
      follow torch's fp32 matmul precision at call time (torch has no attention switch: the
      matmul one decides): IEEE fp32 by default, TF32 after
      ``torch.set_float32_matmul_precision("high")`` or ``torch.backends.cuda.matmul.allow_tf32
      = True``. fp32 with D > 128 raises TypeError on the kernel path (cast to bf16/fp16); the
      CPU fallback (reference) takes any D.
    - ``causal``: bottom-right alignment, query i sees keys j <= i + Lk - Lq (top-left when
      Lq == Lk; what decoding with a KV cache needs). With Lq > Lk the first Lq - Lk queries
      see no key.
    - ``key_padding_mask``: (B, Lk) bool, True marks padding (``nn.MultiheadAttention``'s
      convention). A query row with no visible key outputs 0 (LSE -inf) with zero, finite
      gradients.
    - ``window=(left, right)``: sliding-window (local) attention, FlashAttention's
      ``window_size``: query i sees keys i + Lk - Lq - left <= j <= i + Lk - Lq + right, -1
      meaning unlimited on that side; ``causal`` sets right to 0 (``causal=True, window=(w,
      -1)`` is Mistral's and Gemma's local attention). Key blocks outside the band are skipped.
    - ``softcap=c`` (> 0): logit softcapping, s <- c * tanh(s / c) on the scaled scores before
      everything below (Gemma 2, Grok), with its gradient.
    - ``alibi_slopes``: (Hq,) or (B, Hq) fp32, ALiBi's bias -slope * |i + Lk - Lq - j|
      (bottom-right; under causality slope * (j - i - (Lk - Lq))), generated in the kernels;
      no gradient (the slopes are fixed).
    - ``bias``: an additive float bias broadcastable to (B, Hq, Lq, Lk) (q's dtype or fp32; T5's
      relative position bias, a float mask with -inf), read tile by tile with zero strides along
      broadcast dims; its gradient (when it requires one) is summed over the broadcast dims.
    - ``mask``: a bool mask broadcastable to (B, Hq, Lq, Lk), True = attend (SDPA's rule).
    - ``sinks``: (Hq,) attention sinks (gpt-oss): a learnable logit per head that joins each
      row's softmax denominator and takes no value; differentiable. A row with no visible key
      then outputs 0 with LSE = its sink.
    - ``scale`` defaults to 1/sqrt(D).
    - Scalars as SDPA takes them: ``scale``, ``softcap`` and ``dropout_p`` Python or numpy
      numbers, the window's sides Python or numpy integers (converted to Python's here);
      ``causal`` and ``return_lse`` Python bools (numpy's bool raises TypeError).
    - ``dropout_p``: dropout on the attention probabilities (applied whenever > 0, as in SDPA),
      in [0, 1]: 1.0 (SDPA's answer) drops every probability, a zero output with zero
      gradients (the LSE is unchanged).
      The mask is drawn from a seed taken from torch's generator (``torch.manual_seed`` fixes
      it) and regenerated in backward, never stored.
    - ``return_lse=True`` also returns the fp32 natural-log log-sum-exp of the scaled, masked
      scores, (B, Hq, Lq); it is differentiable.

    Returns ``out`` (B, Hq, Lq, D) in q's dtype, laid out in q's memory order (for q a view of a
    (B, L, H, D)-ordered projection, ``out.transpose(1, 2)`` is contiguous), or ``(out, lse)``.
    Saved for backward: q, k, v, out, lse (and the mask and seed). CUDA tensors (and CPU
    tensors under ``TRITON_INTERPRET=1``) run the Triton kernels, other CPU tensors
    ``fused_block.reference.attention``. Where SDPA computes exactly this function (16-bit,
    none of the options above but ``causal`` with Lq == Lk, GQA and ``scale``), its cuDNN and
    flash backends are candidates beside our kernels, timed once per shape bucket on CUDA and the
    fastest kept (``fused_block._attn_sdpa``: ``choices()`` lists the verdicts,
    ``FUSED_BLOCK_ATTENTION=triton|sdpa_cudnn|sdpa_flash`` forces one; our kernels under
    ``torch.use_deterministic_algorithms(True)`` and ``FUSED_BLOCK_TUNE=0``).
    """
    q, k, v = _autocast(q, k, v)
    _check(q, k, v, causal, scale, key_padding_mask, dropout_p)
    _check_return_lse(return_lse)
    _backend.no_dtensor("attention", q, k, v)
    window = _check_window(window)
    cap = _check_softcap(softcap)
    B, Hq, Lq = q.shape[:3]
    sinks, alibi_slopes = _check_scores(q, B, Hq, Lq, k.shape[2], sinks, alibi_slopes, bias, mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if float(dropout_p) == 1.0:
        return _all_dropped(attention(q, k, v, causal, scale, key_padding_mask, 0.0, window=window, softcap=softcap,
                                      sinks=sinks, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                                      return_lse=True), return_lse)
    dropout_p = _dropout_p(dropout_p)
    _check_fp32_width("q", q, q.shape[-1])  # on every path: a call valid here is valid on a GPU
    if not _backend.use_triton(q):
        out, lse = reference.attention(q, k, v, causal, scale, key_padding_mask, dropout_p, window=window,
                                       softcap=cap or None, sinks=sinks, alibi_slopes=alibi_slopes, bias=bias,
                                       mask=mask, return_lse=True)
        out = _in_order_of(q, out)  # the kernels' layout, which callers may view (merging heads)
        return (out, lse) if return_lse else out
    q, k, v = common.unit(q), common.unit(k), common.unit(v)
    grad = _backend.needs_autograd(q, k, v, sinks, bias)
    if (q.is_cuda or _attn_sdpa.forced_sdpa()) and _attn_sdpa.expresses(
            q, k, v, causal, key_padding_mask, dropout_p, window, cap, sinks, alibi_slopes, bias, mask, return_lse):
        def timed():
            fns = {_attn_sdpa.TRITON: lambda q, k, v: _Attention_apply(q, k, v, None, None, causal, scale, 0.0, -1,
                                                                        -1, 0.0, None, None, None, None)[0]}
            for c in (_attn_sdpa.CUDNN, _attn_sdpa.FLASH):
                fns[c] = lambda q, k, v, c=c: _attn_sdpa.run(c, q, k, v, causal, scale)
            return _timing.leaves_of(q, k, v, grad=grad), fns

        choice = _attn_sdpa.choose(q, k, causal, grad, timed)
        if choice != _attn_sdpa.TRITON:
            out = _attn_sdpa.run_or_none(choice, q, k, v, causal, scale)
            if out is not None:
                # The contract's layout, whatever the backend's (flash and cuDNN usually give
                # it already: then no view is recorded).
                return out if _memory_order(out) == _memory_order(q) else _in_order_of(q, out)
    seed = _seed(dropout_p, q.device)
    args = (key_padding_mask, seed, causal, scale, dropout_p, *window, cap, sinks, alibi_slopes, bias, mask)
    if grad:
        out, lse = _Attention_apply(q, k, v, *args)
    else:
        out, lse = attention_fwd(q, k, v, *args)
    return (out, lse) if return_lse else out


def _check_heads(num_heads, num_kv_heads):
    """``(num_heads, num_kv_heads)`` as Python ints (numpy integers converted), after checking them."""
    if type(num_heads) is not int or type(num_kv_heads) is not int:
        num_heads, num_kv_heads = (_validate.integer("num_heads", num_heads),
                                   _validate.integer("num_kv_heads", num_kv_heads))
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if n <= 0:
            raise ValueError(f"{name} must be positive, got {n}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads, num_kv_heads


def attention_qkvpacked(qkv, num_heads, num_kv_heads=None, causal=False, scale=None, key_padding_mask=None,
                        dropout_p=0.0, *, window=(-1, -1), softcap=None, sinks=None, alibi_slopes=None,
                        batch_first=True, return_lse=False):
    """Self-attention on a packed QKV projection, in the projection's own layout.

    ``qkv``: (B, L, (H + 2 Hkv) * D) with ``batch_first`` (else (L, B, ...)), the output of one
    matmul with rows [q; k; v] (``nn.MultiheadAttention.in_proj_weight``'s order, heads
    contiguous within each), any strides with a contiguous last dim. ``num_heads`` = H,
    ``num_kv_heads`` = Hkv (default H; GQA/MQA when smaller). Other arguments as
    :func:`attention` (``key_padding_mask`` (B, L)).

    Returns ``out`` (B, L, H * D) (or (L, B, H * D)), contiguous: the out-projection's input
    with no head merge; ``return_lse=True`` adds the LSE (B, H, L). The backward writes the
    gradients of q, k and v into one buffer of qkv's shape (no split, copy or cat).
    ``softcap``, ``sinks`` and ``alibi_slopes`` (as :func:`attention`) run :func:`attention` on
    q, k and v views of qkv instead: the same kernels, plus the output's head merge (a copy)
    and the gradient's assembly into qkv's shape by autograd.
    """
    (qkv,) = _autocast(qkv)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    num_heads, num_kv_heads = _check_heads(num_heads, num_kv_heads)
    if not isinstance(batch_first, bool):
        raise TypeError(f"batch_first must be a bool, got {_validate.type_name(batch_first)}")
    _validate.tensor("qkv", qkv, ndim=3)
    _backend.no_dtensor("attention_qkvpacked", qkv)
    heads = num_heads + 2 * num_kv_heads
    if qkv.shape[2] % heads != 0:
        raise ValueError(f"qkv's last dim ({qkv.shape[2]}) must be (num_heads + 2 * num_kv_heads) = {heads} "
                         "times the head dim")
    D = qkv.shape[2] // heads
    _check_head_dim("qkv", D)
    B, L = (qkv.shape[0], qkv.shape[1]) if batch_first else (qkv.shape[1], qkv.shape[0])
    _check_options(causal, scale, key_padding_mask, dropout_p, B, L, "qkv", qkv)
    _check_return_lse(return_lse)
    window = _check_window(window)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if float(dropout_p) == 1.0:
        return _all_dropped(attention_qkvpacked(qkv, num_heads, num_kv_heads, causal, scale, key_padding_mask, 0.0,
                                                window=window, softcap=softcap, sinks=sinks,
                                                alibi_slopes=alibi_slopes, batch_first=batch_first,
                                                return_lse=True), return_lse)
    dropout_p = _dropout_p(dropout_p)
    if softcap is not None or sinks is not None or alibi_slopes is not None:
        q, k, v = _split_packed(qkv, num_heads, num_kv_heads, batch_first)
        out, lse = attention(q, k, v, causal, scale, key_padding_mask, dropout_p, window=window, softcap=softcap,
                             sinks=sinks, alibi_slopes=alibi_slopes, return_lse=True)
        out = (out.transpose(1, 2) if batch_first else out.permute(2, 0, 1, 3)).flatten(2)
        return (out, lse) if return_lse else out
    _check_fp32_width("qkv", qkv, D)
    if not _backend.use_triton(qkv):
        q, k, v = _split_packed(qkv, num_heads, num_kv_heads, batch_first)
        out, lse = reference.attention(q, k, v, causal, scale, key_padding_mask, dropout_p, window=window,
                                       return_lse=True)
        out = (out.transpose(1, 2) if batch_first else out.permute(2, 0, 1, 3)).flatten(2)
        return (out, lse) if return_lse else out
    choice = _packed_choice(qkv, num_heads, num_kv_heads, causal, scale, key_padding_mask, dropout_p, window,
                            batch_first, return_lse)
    if choice != _attn_sdpa.TRITON:
        out = _packed_sdpa(choice, qkv, num_heads, num_kv_heads, causal, scale, batch_first, or_none=True)
        if out is not None:
            return out
    args = (common.unit(qkv), num_heads, num_kv_heads, batch_first, key_padding_mask,
            _seed(dropout_p, qkv.device), causal, scale, dropout_p, *window)
    if _backend.needs_autograd(qkv):
        out, lse = _PackedAttention_apply(*args)
    else:
        out, lse = attention_packed_fwd(*args)
    return (out, lse) if return_lse else out


def _packed_ours_only(device, dtype, num_heads, num_kv_heads, key_padding_mask, dropout_p, window, return_lse):
    """Whether a packed self-attention call has our kernels as its only candidate: off CUDA
    (unless an SDPA backend is forced), or a call SDPA does not compute (``_attn_sdpa.expresses``
    for packed self-attention: q, k and v of one dtype, their lengths equal)."""
    return (not (device.type == "cuda" or _attn_sdpa.forced_sdpa()) or return_lse or key_padding_mask is not None
            or bool(dropout_p) or tuple(window) != (-1, -1) or dtype not in (torch.float16, torch.bfloat16)
            or (num_kv_heads != num_heads and not _attn_sdpa._SDPA_GQA))


def packed_kernel_chosen(device, dtype, B, L, num_heads, num_kv_heads, head_dim, causal, key_padding_mask,
                         dropout_p, grad) -> bool:
    """Whether :func:`attention_qkvpacked` on a (B, L) batch of ``dtype`` packed projections on
    ``device`` (no window, softcap, sinks or ALiBi, no LSE asked) runs our packed kernels
    without timing anything: :func:`_packed_choice`'s decision by the static rule or a verdict
    made earlier. False where SDPA won the bucket, or where that call would time the candidates
    first (the call itself then does)."""
    if _packed_ours_only(device, dtype, num_heads, num_kv_heads, key_padding_mask, dropout_p, (-1, -1), False):
        return True
    return _attn_sdpa.known(device, dtype, causal, grad, B, num_heads, num_kv_heads, L, L,
                            head_dim) == _attn_sdpa.TRITON


def _packed_sdpa(choice, qkv, num_heads, num_kv_heads, causal, scale, batch_first, or_none=False):
    """:func:`attention_qkvpacked` through SDPA's backend ``choice`` (views of qkv; autograd
    assembles their gradients); with ``or_none``, None where the backend refuses the tensors
    (``_attn_sdpa.run_or_none``), else its error (the timing's)."""
    q, k, v = _split_packed(qkv, num_heads, num_kv_heads, batch_first)
    out = (_attn_sdpa.run_or_none if or_none else _attn_sdpa.run)(choice, q, k, v, causal, scale)
    if out is None:
        return None
    return (out.transpose(1, 2) if batch_first else out.permute(2, 0, 1, 3)).flatten(2)


def _packed_choice(qkv, num_heads, num_kv_heads, causal, scale, key_padding_mask, dropout_p, window, batch_first,
                   return_lse):
    """The packed call's candidate (``_attn_sdpa``): our packed kernels unless SDPA expresses the
    case and wins (or is forced)."""
    if _packed_ours_only(qkv.device, qkv.dtype, num_heads, num_kv_heads, key_padding_mask, dropout_p, window,
                         return_lse):
        return _attn_sdpa.TRITON
    q, k, v = _split_packed(qkv, num_heads, num_kv_heads, batch_first)
    grad = _backend.needs_autograd(qkv)

    def timed():
        fns = {_attn_sdpa.TRITON: lambda t: _PackedAttention_apply(t, num_heads, num_kv_heads, batch_first, None,
                                                                   None, causal, scale, 0.0, -1, -1)[0]}
        for c in (_attn_sdpa.CUDNN, _attn_sdpa.FLASH):
            fns[c] = lambda t, c=c: _packed_sdpa(c, t, num_heads, num_kv_heads, causal, scale, batch_first)
        return _timing.leaves_of(common.unit(qkv), grad=grad), fns

    return _attn_sdpa.choose(q, k, causal, grad, timed)


# ---------------------------------------------------------------------------------------------
# packed (variable-length) sequences
# ---------------------------------------------------------------------------------------------

# cu_seqlens values by id: (weak reference, version counter, values). A model hands the same
# cu_seqlens to every layer: the values are read (a host-device sync) once per tensor and
# version, not once per layer. Under torch.compile or CUDA graph capture (no syncs) they are
# checked only where read earlier.
_SEQLENS = {}
_MAX_SEQLENS = 64


def _seqlen_values(cu):
    if torch.compiler.is_compiling():
        return None
    capturing = cu.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if cu.is_inference():  # no version counter
        return None if capturing else cu.tolist()
    hit = _SEQLENS.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == cu._version:
        return hit[2]
    if capturing:
        return None
    values = cu.tolist()
    if len(_SEQLENS) >= _MAX_SEQLENS:
        _SEQLENS.clear()
    _SEQLENS[id(cu)] = (weakref.ref(cu), cu._version, values)
    return values


def _check_max_seqlen(name, m):
    if type(m) is not int:
        m = _validate.integer(name, m)  # (numpy integers too: the callers take int(max_seqlen))
    if m < 0:
        raise ValueError(f"{name} must be >= 0, got {m}")


def _check_cu_seqlens(name, cu, total, max_name, max_seqlen, ref_name, ref):
    """int32, 1-D, on ref's device; starting at 0, nondecreasing, ending at the token count,
    no length above ``max_seqlen`` (values checked where they can be read: see _seqlen_values)."""
    _validate.tensor(name, cu, dtypes=(torch.int32,), ndim=1)
    _validate.same_device(ref_name, ref, **{name: cu})
    if cu.numel() < 1:
        raise ValueError(f"{name} must hold B + 1 offsets (at least the leading 0), got none")
    _check_max_seqlen(max_name, max_seqlen)
    values = _seqlen_values(cu)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must be nondecreasing, got {values[i]} then {values[i + 1]} at {i}")
    if values[-1] != total:
        raise ValueError(f"{name}'s last entry ({values[-1]}) must be the token count of {ref_name} ({total})")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) is smaller than the longest sequence of {name} "
                         f"({max(lengths)})")


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(name, t, ndim=3)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    _validate.same_device("q", q, k=k, v=v)
    Tq, Hq, D = q.shape
    _check_head_dim("q", D)
    if k.shape[2] != D:
        raise ValueError(f"k must have shape (Tk, Hkv, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    _validate.shape("v", v, k.shape)
    if k.shape[1] == 0 or Hq % k.shape[1] != 0:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of k's heads ({k.shape[1]})")
    _check_options(causal, scale, None, dropout_p, 1, k.shape[0], "q", q)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, Tq, "max_seqlen_q", max_seqlen_q, "q", q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k, "k", k)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have cu_seqlens_q's shape {tuple(cu_seqlens_q.shape)} (one entry per "
                         f"sequence and one more), got {tuple(cu_seqlens_k.shape)}")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     dropout_p=0.0, window=(-1, -1), softcap=None, sinks=None, alibi_slopes=None, return_lse=False):
    """Attention over packed sequences (``flash_attn_varlen_func``'s convention): no padding.

    - ``q``: (Tq, Hq, D), ``k``, ``v``: (Tk, Hkv, D): the tokens of B sequences back to back,
      any strides with a contiguous last dim (views of a packed projection need no copy).
    - ``cu_seqlens_q``, ``cu_seqlens_k``: (B + 1,) int32 on q's device, cumulative lengths
      starting at 0: sequence b is queries [cu_seqlens_q[b], cu_seqlens_q[b + 1]) against keys
      [cu_seqlens_k[b], cu_seqlens_k[b + 1]). Empty sequences are allowed.
    - ``max_seqlen_q``, ``max_seqlen_k``: ints at least the longest lengths (the kernels' config
      key; they do not size the grid).
    - Every option as :func:`attention`, per sequence: ``causal`` and ``window`` are
      bottom-right aligned within each sequence; GQA; ``dropout_p``; ``softcap``, ``sinks``
      (Hq,) and ``alibi_slopes`` (Hq,) or (B, Hq) (row b for sequence b). No ``bias``/``mask``
      (their (B, Hq, Lq, Lk) layout has no packed form).

    Values of cu_seqlens are checked (a host-device sync, once per tensor and version) except
    under ``torch.compile`` and CUDA graph capture, where they cannot be read. The programs run
    over the real query blocks of every sequence only: the cost follows the sum of the squared
    lengths, not B x max^2. Returns ``out`` (Tq, Hq, D) contiguous, or ``(out, lse)`` with the
    differentiable fp32 LSE (Hq, Tq).
    """
    q, k, v = _autocast(q, k, v)
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p)
    _check_return_lse(return_lse)
    window = _check_window(window)
    cap = _check_softcap(softcap)
    sinks, alibi_slopes = _check_scores(q, cu_seqlens_q.numel() - 1, q.shape[1], 0, 0, sinks, alibi_slopes,
                                        dense=False)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if float(dropout_p) == 1.0:
        return _all_dropped(attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks,
                                             alibi_slopes=alibi_slopes, return_lse=True), return_lse)
    dropout_p = _dropout_p(dropout_p)
    _check_fp32_width("q", q, q.shape[-1])
    if not _backend.use_triton(q):
        return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p,
                                          window=window, softcap=cap or None, sinks=sinks,
                                          alibi_slopes=alibi_slopes, return_lse=return_lse)
    q, k, v = common.unit(q), common.unit(k), common.unit(v)
    args = (int(max_seqlen_q), int(max_seqlen_k), _seed(dropout_p, q.device), causal, scale, dropout_p, *window,
            cap, sinks, alibi_slopes)
    if _backend.needs_autograd(q, k, v, sinks):
        same = cu_seqlens_k is cu_seqlens_q
        out, lse = _VarlenAttention_apply(q, k, v, cu_seqlens_q, None if same else cu_seqlens_k, *args)
    else:
        out, lse = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
    return (out, lse) if return_lse else out


def attention_varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, num_heads, num_kv_heads=None, *, causal=False,
                               scale=None, dropout_p=0.0, window=(-1, -1), softcap=None, sinks=None,
                               alibi_slopes=None, return_lse=False):
    """Self-attention over packed sequences on a QKV projection in its own layout.

    ``qkv``: (T, (H + 2 Hkv) * D), rows [q; k; v] as :func:`attention_qkvpacked`'s; sequence b
    is tokens [cu_seqlens[b], cu_seqlens[b + 1]) (int32, (B + 1,)). Options as
    :func:`attention_varlen`. Returns ``out`` (T, H * D) contiguous (the out-projection's
    input), or ``(out, lse)`` with lse (H, T); the backward writes dQ, dK and dV into one
    gradient buffer of qkv's shape. ``softcap``, ``sinks`` and ``alibi_slopes`` run
    :func:`attention_varlen` on q, k and v views of qkv instead (the head merge a copy, the
    gradient assembled by autograd).
    """
    (qkv,) = _autocast(qkv)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    num_heads, num_kv_heads = _check_heads(num_heads, num_kv_heads)
    _validate.tensor("qkv", qkv, ndim=2)
    heads = num_heads + 2 * num_kv_heads
    if qkv.shape[1] % heads != 0:
        raise ValueError(f"qkv's last dim ({qkv.shape[1]}) must be (num_heads + 2 * num_kv_heads) = {heads} "
                         "times the head dim")
    D = qkv.shape[1] // heads
    _check_head_dim("qkv", D)
    _check_options(causal, scale, None, dropout_p, 1, qkv.shape[0], "qkv", qkv)
    _check_return_lse(return_lse)
    _check_cu_seqlens("cu_seqlens", cu_seqlens, qkv.shape[0], "max_seqlen", max_seqlen, "qkv", qkv)
    window = _check_window(window)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if float(dropout_p) == 1.0:
        return _all_dropped(attention_varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, num_heads, num_kv_heads,
                                                       causal=causal, scale=scale, window=window, softcap=softcap,
                                                       sinks=sinks, alibi_slopes=alibi_slopes, return_lse=True),
                            return_lse)
    dropout_p = _dropout_p(dropout_p)
    if softcap is not None or sinks is not None or alibi_slopes is not None:
        q, k, v = _split_tokens(qkv, num_heads, num_kv_heads)
        out, lse = attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal,
                                    scale=scale, dropout_p=dropout_p, window=window, softcap=softcap, sinks=sinks,
                                    alibi_slopes=alibi_slopes, return_lse=True)
        out = out.flatten(1)
        return (out, lse) if return_lse else out
    _check_fp32_width("qkv", qkv, D)
    if not _backend.use_triton(qkv):
        q, k, v = _split_tokens(qkv, num_heads, num_kv_heads)
        out, lse = reference.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, causal, scale, dropout_p,
                                              window=window, return_lse=True)
        out = out.flatten(1)
        return (out, lse) if return_lse else out
    args = (common.unit(qkv), cu_seqlens, int(max_seqlen), num_heads, num_kv_heads,
            _seed(dropout_p, qkv.device), causal, scale, dropout_p, *window)
    if _backend.needs_autograd(qkv):
        out, lse = _VarlenPackedAttention_apply(*args)
    else:
        out, lse = attention_varlen_packed_fwd(*args)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("fused_block::attention_kv_cache_append", mutates_args=("k_cache", "v_cache"))
def _kv_cache_append_op(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, cache_seqlens: Tensor) -> None:
    with _backend.device_guard(k_cache):
        _kernels.kv_cache_append(k_cache, v_cache, k, v, cache_seqlens)


@_kv_cache_append_op.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens):
    return None


def _share_memory(a, b) -> bool:
    """Whether ``a`` and ``b`` may share elements of one storage: their memory spans (first to
    last element) intersect, as torch's overlap check for copies reads them, except for views of
    one shape and strides whose offset apart is no element's offset in them (interleaved
    buffers: a (B, H, L, 2, D) packed KV cache's k and v halves). False while ``torch.compile``
    traces (pointers are not traceable)."""
    if torch.compiler.is_compiling() or not a.numel() or not b.numel():
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.data_ptr()
        return start, start + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    if not (a0 < b1 and b0 < a1):
        return False
    if a.shape != b.shape or a.stride() != b.stride() or a.element_size() != b.element_size() \
            or abs(a0 - b0) % a.element_size():
        return True
    # Elements a[i] and b[j] coincide where the offset apart is sum((i_k - j_k) * stride_k), each
    # i_k - j_k within +-(n_k - 1): searched largest stride first, each digit narrowed to those
    # the smaller strides can still make up (one or two for nested strides, as slices of a dense
    # buffer have); a search past its budget counts as sharing.
    dims = sorted(((n, st) for n, st in zip(a.shape, a.stride()) if n > 1), key=lambda e: -e[1])
    reach = [0] * (len(dims) + 1)
    for k in range(len(dims) - 1, -1, -1):
        reach[k] = reach[k + 1] + (dims[k][0] - 1) * dims[k][1]
    budget = [4096]

    def makes(d, k):
        if k == len(dims):
            return d == 0
        budget[0] -= 1
        if budget[0] < 0:
            return True
        n, st = dims[k]
        if st == 0:
            return makes(d, k + 1)
        rest = reach[k + 1]
        lo, hi = max(-(n - 1), -((rest - d) // st)), min(n - 1, (d + rest) // st)
        return any(makes(d - q * st, k + 1) for q in range(lo, hi + 1))

    return makes(abs(a0 - b0) // a.element_size(), 0)


def kv_cache_append(k_cache, v_cache, k, v, cache_seqlens):
    """Write new keys and values into preallocated caches, in place (one launch for both).

    ``k_cache``, ``v_cache``: (B, Hkv, L_cache, D); ``k``, ``v``: (B, Hkv, L_new, D) of the
    caches' dtype (any strides with a contiguous last dim); ``cache_seqlens``: (B,) int32, the
    rows already filled: batch b's new rows go to [cache_seqlens[b], cache_seqlens[b] + L_new).
    Rows that would land outside [0, L_cache) are dropped (the values are not read on the host:
    no sync), a negative ``cache_seqlens[b]`` included. Attend to the filled prefix afterwards with ``attention(q, k_cache[:, :, :n],
    ...)`` or a key padding mask; decode steps (Lq <= 16) over long caches take the split-KV
    kernels. Returns None.
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        _validate.tensor(name, t, ndim=4)
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} must have k_cache's dtype {k_cache.dtype}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    _validate.shape("v_cache", v_cache, k_cache.shape)
    _validate.shape("v", v, k.shape)
    B, Hkv, _, D = k_cache.shape
    if k.shape[0] != B or k.shape[1] != Hkv or k.shape[3] != D:
        raise ValueError(f"k must have shape (B={B}, Hkv={Hkv}, L_new, D={D}) to match k_cache, got {tuple(k.shape)}")
    _validate.tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    _validate.shape("cache_seqlens", cache_seqlens, (B,))
    _validate.same_device("k_cache", k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if 0 in t.stride() and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"{name} is written in place and must not be an expanded view (stride 0 along a dim "
                             f"of size > 1: several of its elements share memory), got strides {t.stride()}")
    if k_cache is v_cache or _share_memory(k_cache, v_cache):
        raise ValueError("v_cache must not share k_cache's memory (both are written in place)")
    for name, t in (("k", k), ("v", v)):
        if t is k_cache or t is v_cache or _share_memory(t, k_cache) or _share_memory(t, v_cache):
            raise ValueError(f"{name} must not share memory with k_cache or v_cache (read while they are written in "
                             f"place, as torch's copy into an overlapping slice refuses): clone() it first")
    if torch.is_grad_enabled():
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
            if t.requires_grad:
                raise ValueError(f"{name} requires grad: kv_cache_append writes the caches in place and has no "
                                 f"gradient; call it under torch.no_grad() or with detached tensors")
    if not _backend.use_triton(k_cache):
        L = k_cache.shape[2]
        for b, start in enumerate(cache_seqlens.tolist()):
            first, end = max(0, -start), min(k.shape[2], L - start)  # the new rows landing in [0, L)
            if end > first:
                k_cache[b, :, start + first:start + end] = k[b, :, first:end]
                v_cache[b, :, start + first:start + end] = v[b, :, first:end]
        return None
    _kv_cache_append_op(k_cache, v_cache, k, v, cache_seqlens)
    return None
