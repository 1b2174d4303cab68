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
from typing import Optional

import torch
from torch import Tensor

from fused_block import _backend, _library, _validate, reference
from fused_block.kernels import attention as _kernels
from fused_block.kernels import common

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# fp32 tiles are twice as wide: the kernels take fp32 up to this head dim.
MAX_FP32_HEAD_DIM = _kernels.MAX_FP32_BLOCK_D


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------

def _like(t: Tensor, shape, dtype, alloc) -> Tensor:
    """A new (B, H, L, D) tensor of ``shape`` whose dims 0..2 are laid out in ``t``'s memory
    order (stable by decreasing stride), last dim contiguous: (B, L, H, D)-ordered q gives a
    (B, L, H, D)-ordered output. ``alloc(shape, dtype)`` allocates a contiguous buffer."""
    order = sorted(range(3), key=lambda i: -t.stride(i))
    buf = alloc([shape[i] for i in order] + [shape[3]], dtype)
    return buf.permute(*[order.index(i) for i in range(3)], 3)


def _heads(t: Tensor, n_heads: int, batch_first: bool) -> Tensor:
    """(B, L, n * D) or (L, B, n * D) with a contiguous last dim -> the (B, n, L, D) view."""
    t = t.unflatten(-1, (n_heads, -1))
    return t.transpose(1, 2) if batch_first else t.permute(1, 2, 0, 3)


def _split_packed(qkv: Tensor, num_heads: int, num_kv_heads: int, batch_first: bool):
    """Views q (B, H, L, D), k and v (B, Hkv, L, D) of a packed QKV projection."""
    t = _heads(qkv, num_heads + 2 * num_kv_heads, batch_first)
    return t[:, :num_heads], t[:, num_heads:num_heads + num_kv_heads], t[:, num_heads + num_kv_heads:]


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------

def _fwd_fake(q, k, v, key_padding_mask, seed, causal, scale, dropout_p):
    out = _like(q, q.shape, q.dtype, lambda s, dt: q.new_empty(s, dtype=dt))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@_library.op("attention_fwd", fake=_fwd_fake)
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], seed: Optional[Tensor],
                  causal: bool, scale: float, dropout_p: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: out (B, Hq, Lq, D) in q's dtype and memory order, lse (B, Hq, Lq) fp32."""
    with _backend.device_guard(q):
        out = _like(q, q.shape, q.dtype, lambda s, dt: common.empty(s, dt, q.device))
        lse = common.empty(q.shape[:3], torch.float32, q.device)
        _kernels.forward(q, k, v, out, lse, key_padding_mask, seed, causal, scale, dropout_p)
    return out, lse


def _bwd_fake(dout, q, k, v, out, lse, dlse, key_padding_mask, seed, causal, scale, dropout_p):
    def alloc(s, dt):
        return q.new_empty(s, dtype=dt)
    return _like(q, q.shape, q.dtype, alloc), _like(k, k.shape, k.dtype, alloc), _like(k, v.shape, v.dtype, alloc)


@_library.op("attention_bwd", fake=_bwd_fake)
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                  key_padding_mask: Optional[Tensor], seed: Optional[Tensor], causal: bool, scale: float,
                  dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in q's / k's memory order (dv like dk); ``dlse`` or None is the LSE's gradient."""
    with _backend.device_guard(q):
        def alloc(s, dt):
            return common.empty(s, dt, q.device)
        dq, dk, dv = _like(q, q.shape, q.dtype, alloc), _like(k, k.shape, k.dtype, alloc), \
            _like(k, v.shape, v.dtype, alloc)
        _kernels.backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, key_padding_mask, seed, causal, scale,
                          dropout_p)
    return dq, dk, dv


def _packed_shapes(qkv, num_heads, num_kv_heads, batch_first):
    B, L = (qkv.shape[0], qkv.shape[1]) if batch_first else (qkv.shape[1], qkv.shape[0])
    D = qkv.shape[2] // (num_heads + 2 * num_kv_heads)
    out_shape = (B, L, num_heads * D) if batch_first else (L, B, num_heads * D)
    return out_shape, (B, num_heads, L)


def _packed_fwd_fake(qkv, num_heads, num_kv_heads, batch_first, key_padding_mask, seed, causal, scale, dropout_p):
    out_shape, lse_shape = _packed_shapes(qkv, num_heads, num_kv_heads, batch_first)
    return qkv.new_empty(out_shape), qkv.new_empty(lse_shape, dtype=torch.float32)


@_library.op("attention_packed_fwd", fake=_packed_fwd_fake)
def attention_packed_fwd(qkv: Tensor, num_heads: int, num_kv_heads: int, batch_first: bool,
                         key_padding_mask: Optional[Tensor], seed: Optional[Tensor], causal: bool, scale: float,
                         dropout_p: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: out (B, L, H * D) (or (L, B, H * D)) contiguous, lse (B, H, L) fp32."""
    with _backend.device_guard(qkv):
        out_shape, lse_shape = _packed_shapes(qkv, num_heads, num_kv_heads, batch_first)
        out = common.empty(out_shape, qkv.dtype, qkv.device)
        lse = common.empty(lse_shape, torch.float32, qkv.device)
        q, k, v = _split_packed(qkv, num_heads, num_kv_heads, batch_first)
        _kernels.forward(q, k, v, _heads(out, num_heads, batch_first), lse, key_padding_mask, seed, causal, scale,
                         dropout_p)
    return out, lse


def _packed_bwd_fake(dout, qkv, out, lse, dlse, num_heads, num_kv_heads, batch_first, key_padding_mask, seed,
                     causal, scale, dropout_p):
    return qkv.new_empty(qkv.shape)


@_library.op("attention_packed_bwd", fake=_packed_bwd_fake)
def attention_packed_bwd(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                         num_heads: int, num_kv_heads: int, batch_first: bool, key_padding_mask: Optional[Tensor],
                         seed: Optional[Tensor], causal: bool, scale: float, dropout_p: float) -> Tensor:
    """dqkv, contiguous with qkv's shape: the kernel writes dQ, dK, dV into their slices."""
    with _backend.device_guard(qkv):
        dqkv = common.empty(qkv.shape, qkv.dtype, qkv.device)
        q, k, v = _split_packed(qkv, num_heads, num_kv_heads, batch_first)
        dq, dk, dv = _split_packed(dqkv, num_heads, num_kv_heads, batch_first)
        _kernels.backward(_heads(dout, num_heads, batch_first), q, k, v, _heads(out, num_heads, batch_first), lse,
                          dlse, dq, dk, dv, key_padding_mask, seed, causal, scale, dropout_p)
    return dqkv


def _unit_last_stride(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, seed, causal, scale, dropout_p):
        out, lse = attention_fwd(q, k, v, key_padding_mask, seed, causal, scale, dropout_p)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed)
        ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, key_padding_mask, seed = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _unit_last_stride(dout)
        dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, dlse, key_padding_mask, seed, ctx.causal, ctx.scale,
                                   ctx.dropout_p)
        return dq, dk, dv, None, None, None, None, None


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, num_heads, num_kv_heads, batch_first, key_padding_mask, seed, causal, scale, dropout_p):
        out, lse = attention_packed_fwd(qkv, num_heads, num_kv_heads, batch_first, key_padding_mask, seed, causal,
                                        scale, dropout_p)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(qkv, out, lse, key_padding_mask, seed)
        ctx.args = (num_heads, num_kv_heads, batch_first)
        ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        qkv, out, lse, key_padding_mask, seed = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _unit_last_stride(dout)
        dqkv = attention_packed_bwd(dout, qkv, out, lse, dlse, *ctx.args, key_padding_mask, seed, ctx.causal,
                                    ctx.scale, ctx.dropout_p)
        return dqkv, None, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------

def _check_head_dim(name, D):
    if D % 8 != 0 or not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}'s head dim must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {D}")


def _check_options(causal, scale, key_padding_mask, dropout_p, B, Lk, ref_name, ref):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        _validate.positive("scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if key_padding_mask is not None:
        _validate.tensor("key_padding_mask", key_padding_mask, dtypes=(torch.bool,), ndim=2)
        _validate.shape("key_padding_mask", key_padding_mask, (B, Lk))
        _validate.same_device(ref_name, ref, key_padding_mask=key_padding_mask)
    _validate.probability("dropout_p", dropout_p)


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


def _check_fp32_width(name, t, D):
    if t.dtype == torch.float32 and D > MAX_FP32_HEAD_DIM:
        raise TypeError(f"{name}: fp32 attention kernels take head dims up to {MAX_FP32_HEAD_DIM}, got {D}; "
                        "use bf16 or fp16")


def _seed(dropout_p, device):
    # No seed tensor (and no random number drawn) without dropout.
    return _backend.dropout_seed(dropout_p, device) if dropout_p > 0.0 else None


def attention(q, k, v, causal=False, scale=None, key_padding_mask=None, dropout_p=0.0, *, return_lse=False):
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
    - ``scale`` defaults to 1/sqrt(D).
    - ``dropout_p``: dropout on the attention probabilities (applied whenever > 0, as in SDPA).
      The mask is drawn from a seed taken from torch's generator (``torch.manual_seed`` fixes
      it) and regenerated in backward, never stored.
    - ``return_lse=True`` also returns the fp32 natural-log log-sum-exp of the scaled, masked
      scores, (B, Hq, Lq); it is differentiable.

    Returns ``out`` (B, Hq, Lq, D) in q's dtype, laid out in q's memory order (for q a view of a
    (B, L, H, D)-ordered projection, ``out.transpose(1, 2)`` is contiguous), or ``(out, lse)``.
    Saved for backward: q, k, v, out, lse (and the mask and seed). CUDA tensors (and CPU
    tensors under ``TRITON_INTERPRET=1``) run the Triton kernels, other CPU tensors
    ``fused_block.reference.attention``.
    """
    _check(q, k, v, causal, scale, key_padding_mask, dropout_p)
    _backend.no_dtensor("attention", q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if not _backend.use_triton(q):
        return reference.attention(q, k, v, causal, scale, key_padding_mask, dropout_p, return_lse=return_lse)
    _check_fp32_width("q", q, q.shape[-1])
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    seed = _seed(dropout_p, q.device)
    if _backend.needs_autograd(q, k, v):
        out, lse = _Attention.apply(q, k, v, key_padding_mask, seed, causal, scale, dropout_p)
    else:
        out, lse = attention_fwd(q, k, v, key_padding_mask, seed, causal, scale, dropout_p)
    return (out, lse) if return_lse else out


def _check_heads(num_heads, num_kv_heads):
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n <= 0:
            raise ValueError(f"{name} must be positive, got {n}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def attention_qkvpacked(qkv, num_heads, num_kv_heads=None, causal=False, scale=None, key_padding_mask=None,
                        dropout_p=0.0, *, batch_first=True, return_lse=False):
    """Self-attention on a packed QKV projection, in the projection's own layout.

    ``qkv``: (B, L, (H + 2 Hkv) * D) with ``batch_first`` (else (L, B, ...)), the output of one
    matmul with rows [q; k; v] (``nn.MultiheadAttention.in_proj_weight``'s order, heads
    contiguous within each), any strides with a contiguous last dim. ``num_heads`` = H,
    ``num_kv_heads`` = Hkv (default H; GQA/MQA when smaller). Other arguments as
    :func:`attention` (``key_padding_mask`` (B, L)).

    Returns ``out`` (B, L, H * D) (or (L, B, H * D)), contiguous: the out-projection's input
    with no head merge; ``return_lse=True`` adds the LSE (B, H, L). The backward writes the
    gradients of q, k and v into one buffer of qkv's shape (no split, copy or cat).
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_heads(num_heads, num_kv_heads)
    if not isinstance(batch_first, bool):
        raise TypeError(f"batch_first must be a bool, got {type(batch_first).__name__}")
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
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if not _backend.use_triton(qkv):
        q, k, v = _split_packed(qkv, num_heads, num_kv_heads, batch_first)
        out, lse = reference.attention(q, k, v, causal, scale, key_padding_mask, dropout_p, return_lse=True)
        out = (out.transpose(1, 2) if batch_first else out.permute(2, 0, 1, 3)).flatten(2)
        return (out, lse) if return_lse else out
    _check_fp32_width("qkv", qkv, D)
    args = (_unit_last_stride(qkv), num_heads, num_kv_heads, batch_first, key_padding_mask,
            _seed(dropout_p, qkv.device), causal, scale, dropout_p)
    if _backend.needs_autograd(qkv):
        out, lse = _PackedAttention.apply(*args)
    else:
        out, lse = attention_packed_fwd(*args)
    return (out, lse) if return_lse else out
