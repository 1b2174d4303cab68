"""Fused softmax attention (FlashAttention-style): validation, ``torch.library`` ops, public API.

``attention(q, k, v, causal=False, scale=None, key_padding_mask=None, dropout_p=0.0)`` takes the
layout of ``torch.nn.functional.scaled_dot_product_attention``: q (B, Hq, Lq, D), k and v
(B, Hkv, Lk, D). The Lq x Lk score matrix is never materialized; the forward saves only
``out`` and the fp32 log-sum-exp (B, Hq, Lq) for backward, and dropout is regenerated from a
seed rather than stored.

The ops ``fused_block::attention_fwd`` / ``fused_block::attention_bwd`` are registered with
fake (meta) implementations and autograd, so ``torch.compile(fullgraph=True)`` traces through.
"""
import math
from typing import Optional

import torch

from fused_block import _backend, _validate, reference
from fused_block.kernels import attention as _kernels

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# fp32 tiles (TF32 products) are twice as wide: the kernels take fp32 up to this head dim.
MAX_FP32_HEAD_DIM = 128


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("fused_block::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                  seed: torch.Tensor, causal: bool, scale: float,
                  dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out, lse)``: out (B, Hq, Lq, D) in q's dtype, lse (B, Hq, Lq) fp32."""
    return _kernels.attention_forward(q, k, v, key_padding_mask, seed, causal, scale, dropout_p)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, key_padding_mask, seed, causal, scale, dropout_p):
    B, Hq, Lq, D = q.shape
    return q.new_empty((B, Hq, Lq, D)), q.new_empty((B, Hq, Lq), dtype=torch.float32)


@torch.library.custom_op("fused_block::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                  seed: torch.Tensor, causal: bool, scale: float,
                  dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv)``; ``dlse`` (or None) is the gradient of the LSE output."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    return _kernels.attention_backward(dout, q, k, v, out, lse, dlse, key_padding_mask, seed, causal, scale,
                                       dropout_p)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, dlse, key_padding_mask, seed, causal, scale, dropout_p):
    # The kernels write contiguous gradients whatever the inputs' strides (views of a QKV buffer).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, seed, causal, scale, dropout_p = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed)
    ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, key_padding_mask, seed = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, dlse, key_padding_mask, seed, ctx.causal, ctx.scale,
                               ctx.dropout_p)
    return dq, dk, dv, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------

def _check(q, k, v, causal, scale, key_padding_mask, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(name, t, ndim=4)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    _validate.same_device("q", q, k=k, v=v, key_padding_mask=key_padding_mask)
    B, Hq, Lq, D = q.shape
    if D % 8 != 0 or not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q's head dim (last dim) must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], "
                         f"got {D}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have shape (B={B}, Hkv, Lk, D={D}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    _validate.shape("v", v, k.shape)
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of k's heads ({Hkv})")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        _validate.positive("scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if key_padding_mask is not None:
        _validate.tensor("key_padding_mask", key_padding_mask, dtypes=(torch.bool,), ndim=2)
        _validate.shape("key_padding_mask", key_padding_mask, (B, k.shape[2]))
    _validate.probability("dropout_p", dropout_p)


def attention(q, k, v, causal=False, scale=None, key_padding_mask=None, dropout_p=0.0, *, return_lse=False):
    """Softmax attention ``softmax(q @ k^T * scale + mask) @ v`` without the score matrix.

    - ``q``: (B, Hq, Lq, D); ``k``, ``v``: (B, Hkv, Lk, D), SDPA's layout. Any strides with a
      contiguous last dim (views of one fused QKV projection need no copy); other strides are
      copied. GQA/MQA: ``Hq % Hkv == 0`` and query head h uses K/V head ``h // (Hq // Hkv)``.
      Lq and Lk are independent (cross-attention).
    - D: every multiple of 8 in [16, 256] (padded to a power of two inside the kernels).
    - dtypes: fp16 and bf16 (fp32 accumulation and softmax). fp32 inputs with D <= 128 are
      accepted; on the GPU their products run in TF32, so expect fp16-like error (the tests
      bound it by twice the error of the reference computed in fp16); in the interpreter
      they are exact fp32. fp32 with D > 128 raises TypeError on the kernel path (cast to
      bf16/fp16); the CPU fallback (reference) takes any D.
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

    Returns ``out`` (B, Hq, Lq, D) in q's dtype, or ``(out, lse)``. Saved for backward: q, k,
    v, out, lse (and the mask and seed). CUDA tensors (and CPU tensors under
    ``TRITON_INTERPRET=1``) run the Triton kernels, other CPU tensors
    ``fused_block.reference.attention``.
    """
    _check(q, k, v, causal, scale, key_padding_mask, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if not _backend.use_triton(q):
        return reference.attention(q, k, v, causal, scale, key_padding_mask, dropout_p, return_lse=return_lse)
    if q.dtype == torch.float32 and q.shape[-1] > MAX_FP32_HEAD_DIM:
        raise TypeError(f"q: fp32 attention kernels take head dims up to {MAX_FP32_HEAD_DIM}, got "
                        f"{q.shape[-1]}; use bf16 or fp16")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    seed = _backend.dropout_seed(dropout_p, q.device)
    out, lse = attention_fwd(q, k, v, key_padding_mask, seed, causal, scale, dropout_p)
    return (out, lse) if return_lse else out
