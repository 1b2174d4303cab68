"""Plain-PyTorch reference implementations: the oracle of the tests and the CPU fallback.

Every function is differentiable with torch autograd and dtype-generic: given float64
tensors it is the float64 oracle the tests compare the kernels with. ``compute_dtype``
(default: the input dtype promoted to at least float32) is the precision of the arithmetic;
results are returned in the input dtype, as the kernels do. Tests measure PyTorch's own
error by calling these with ``compute_dtype`` equal to the low-precision input dtype.
"""
import math

import torch
import torch.nn.functional as F


def _compute_dtype(dtype, compute_dtype):
    return compute_dtype if compute_dtype is not None else torch.promote_types(dtype, torch.float32)


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


# ---------------------------------------------------------------------------------------------
# residual add + dropout + LayerNorm / RMSNorm
# ---------------------------------------------------------------------------------------------

def _residual_add(x, residual, dropout_p, dropout_mask, residual_in_fp32, cdt):
    """``residual_out = dropout(x) + residual`` in ``cdt``; also returns residual_out's dtype."""
    if residual is not None:
        residual_dtype = residual.dtype
    else:
        residual_dtype = torch.float32 if residual_in_fp32 and x.dtype != torch.float64 else x.dtype
    h = x.to(cdt)
    if dropout_p > 0.0:
        if dropout_mask is None:
            h = F.dropout(h, dropout_p, training=True)
        else:
            h = h * dropout_mask.to(cdt) / (1.0 - dropout_p)
    if residual is not None:
        h = h + residual.to(cdt)
    # The sum is rounded to residual_out's dtype, then normalized (as torch's add-then-norm).
    return h.to(residual_dtype).to(cdt), residual_dtype


def add_layer_norm(x, residual=None, weight=None, bias=None, eps=1e-5, dropout_p=0.0,
                   residual_in_fp32=False, out_is_residual=False, *, dropout_mask=None, compute_dtype=None):
    """``residual_out = dropout(x) + residual``; ``out = layer_norm(residual_out) * weight + bias``.

    Returns ``(out, residual_out)``; ``out`` has x's dtype, ``residual_out`` has residual's
    dtype (fp32 when ``residual_in_fp32`` and residual is None, else x's). ``out`` normalizes
    residual_out (the sum rounded to its dtype). ``dropout_mask`` (bool, x's shape) replaces
    the random mask. ``out_is_residual``: return ``(out, out)`` (Post-LN's residual stream).
    """
    cdt = _compute_dtype(x.dtype, compute_dtype)
    h, residual_dtype = _residual_add(x, residual, dropout_p, dropout_mask, residual_in_fp32, cdt)
    out = F.layer_norm(h, h.shape[-1:], _cast(weight, cdt), _cast(bias, cdt), eps).to(x.dtype)
    return out, out if out_is_residual else _residual_out(x, residual, dropout_p, h, residual_dtype)


def _residual_out(x, residual, dropout_p, h, residual_dtype):
    """``h`` in ``residual_dtype``; x itself where nothing changed it (no residual, dropout or
    dtype change), as the kernels return it (no copy)."""
    if residual is None and not dropout_p and residual_dtype == x.dtype:
        return x
    return h.to(residual_dtype)


def default_rms_eps(dtype) -> float:
    """RMSNorm's eps when none is given, as torch's ``rms_norm`` takes it: the machine epsilon
    of the type it computes in (fp32 for fp16, bf16 and fp32; float64's for float64)."""
    return _EPS_F64 if dtype == torch.float64 else _EPS_F32


_EPS_F32, _EPS_F64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps


def add_rms_norm(x, residual=None, weight=None, eps=None, dropout_p=0.0,
                 residual_in_fp32=False, out_is_residual=False, *, dropout_mask=None, compute_dtype=None,
                 unit_offset=False):
    """As :func:`add_layer_norm` with RMSNorm; ``eps=None`` means :func:`default_rms_eps` of x's
    dtype. ``unit_offset``: scaled by ``1 + weight`` (Gemma's), formed in the compute dtype."""
    if eps is None:
        eps = default_rms_eps(x.dtype)
    cdt = _compute_dtype(x.dtype, compute_dtype)
    h, residual_dtype = _residual_add(x, residual, dropout_p, dropout_mask, residual_in_fp32, cdt)
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * (1.0 + weight.to(cdt) if unit_offset else weight.to(cdt))
    out = out.to(x.dtype)
    return out, out if out_is_residual else _residual_out(x, residual, dropout_p, h, residual_dtype)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

def visible_keys(lq, lk, causal, key_padding_mask, device, window=(-1, -1)):
    """Bool (B or 1, 1, Lq, Lk): which keys each query sees.

    Alignment is bottom-right: with ``causal`` query i sees keys j <= i + Lk - Lq.
    ``window = (left, right)`` (FlashAttention's ``window_size``; -1 = unlimited) keeps keys
    i + Lk - Lq - left <= j <= i + Lk - Lq + right; ``causal`` sets right to 0.
    ``key_padding_mask`` is (B, Lk) bool with True marking padding.
    """
    left, right = window
    if causal:
        right = 0
    vis = torch.ones(1, 1, lq, lk, dtype=torch.bool, device=device)
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    if right >= 0:
        vis = vis & (j <= i + right)
    if left >= 0:
        vis = vis & (j >= i - left)
    if key_padding_mask is not None:
        vis = vis & ~key_padding_mask[:, None, None, :]
    return vis


def alibi_bias(slopes, B, Hq, lq, lk, device, dtype):
    """ALiBi's additive bias (B, Hq, Lq, Lk): -slope * |i + Lk - Lq - j| (bottom-right aligned:
    under causality, slope * (j - i - (Lk - Lq)) on the visible keys). ``slopes``: (Hq,) or (B, Hq)."""
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    dist = (i - j).abs().to(dtype)
    return -slopes.to(dtype).expand(B, Hq)[:, :, None, None] * dist


# The kernels add an additive bias in the log2 domain, in fp32 (bias * log2(e)): a bias below
# -finfo(fp32).max / log2(e) (about -2.36e38: fp32's and bf16's finfo.min, Hugging Face's
# masking value) becomes -inf there, masking its key as -inf does.
SATURATED_BIAS = -torch.finfo(torch.float32).max / 1.4426950408889634


def attention(q, k, v, causal=False, scale=None, key_padding_mask=None, dropout_p=0.0,
              *, window=(-1, -1), softcap=None, sinks=None, alibi_slopes=None, bias=None, mask=None,
              dropout_mask=None, return_lse=False, compute_dtype=None):
    """Softmax attention, SDPA layout: q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D), Hq % Hkv == 0.

    Scores: ``s = q k^T * scale``; ``softcap`` c: s <- c * tanh(s / c); then + ALiBi's bias
    (:func:`alibi_bias`, ``alibi_slopes`` (Hq,) or (B, Hq)) + ``bias`` (broadcastable to
    (B, Hq, Lq, Lk); below ``SATURATED_BIAS`` it is -inf, as in the kernels); keys invisible
    under ``window`` (:func:`visible_keys`), causality, ``key_padding_mask`` or the bool
    ``mask`` (broadcastable, True = attend, SDPA's rule) get -inf. ``sinks`` (Hq,): one more logit per head in each row's softmax denominator, with no
    value. A query row with no visible key outputs 0 (and its LSE is -inf, or the sink's
    logit). ``dropout_mask`` (bool, (B, Hq, Lq, Lk), True = kept) replaces the random mask on
    the probabilities. Returns ``out`` (q's dtype), or ``(out, lse)`` with the fp32-or-wider
    LSE (B, Hq, Lq).
    """
    cdt = _compute_dtype(q.dtype, compute_dtype)
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    groups = Hq // k.shape[1]
    k = k.to(cdt).repeat_interleave(groups, dim=1)  # (B, Hq, Lk, D)
    v = v.to(cdt).repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.matmul(q.to(cdt), k.transpose(-1, -2)) * scale  # (B, Hq, Lq, Lk)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, B, Hq, Lq, Lk, q.device, cdt)
    if bias is not None:
        s = s + bias.to(cdt).masked_fill(bias < SATURATED_BIAS, float("-inf"))
    vis = visible_keys(Lq, Lk, causal, key_padding_mask, q.device, window)
    if mask is not None:
        vis = vis & mask
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        # The sink joins every row's denominator: the LSE is finite, P = exp(s - lse).
        sink = sinks.to(cdt)[None, :, None, None].expand(B, Hq, Lq, 1)
        logits = torch.cat([s, sink], -1)
        lse = torch.logsumexp(logits, dim=-1)
        e = torch.exp(logits - logits.amax(-1, keepdim=True).detach())
        p = (e / e.sum(-1, keepdim=True))[..., :Lk]
    else:
        has_key = (s != float("-inf")).any(-1, keepdim=True)  # NaN scores propagate, as in SDPA
        # (B, Hq, Lq); -inf on rows with no visible key (computed on zeros there: a finite gradient)
        s0 = s.masked_fill(~has_key, 0.0)
        lse = torch.logsumexp(s0, dim=-1).masked_fill(~has_key[..., 0], float("-inf"))
        # Normalized by the row's own sum, not exp(s - lse): at scores near -1e38 the LSE rounds
        # to the row's largest score (log(Lk) is below its ulp), which would weigh each key 1.
        top = s0.amax(-1, keepdim=True) if Lk else s0.sum(-1, keepdim=True)  # (no key: an empty row)
        e = torch.exp(s0 - top.detach())
        p = torch.where(has_key, e / e.sum(-1, keepdim=True), 0.0)
    if dropout_p > 0.0:
        if dropout_mask is None:
            p = F.dropout(p, dropout_p, training=True)
        else:
            p = p * dropout_mask.to(cdt) / (1.0 - dropout_p)
    out = torch.matmul(p, v).to(q.dtype)
    return (out, lse.to(torch.promote_types(cdt, torch.float32))) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, dropout_p=0.0, *,
                     window=(-1, -1), softcap=None, sinks=None, alibi_slopes=None, dropout_mask=None,
                     return_lse=False, compute_dtype=None):
    """Packed sequences: q (Tq, Hq, D), k and v (Tk, Hkv, D); sequence b is tokens
    [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q against [cu_seqlens_k[b], cu_seqlens_k[b + 1])
    of k and v, each as :func:`attention` (bottom-right causal and window per sequence;
    ``alibi_slopes`` (Hq,) or (B, Hq), row b for sequence b).
    ``dropout_mask``: (B, Hq, max_q, max_k) bool, sequence b taking [b, :, :Lq_b, :Lk_b].
    Returns ``out`` (Tq, Hq, D), or ``(out, lse)`` with the LSE (Hq, Tq)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        kb, vb = (t[ck[b]:ck[b + 1]].transpose(0, 1)[None] for t in (k, v))
        mb = None if dropout_mask is None else dropout_mask[b:b + 1, :, :qb.shape[2], :kb.shape[2]]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        o, lse = attention(qb, kb, vb, causal, scale, None, dropout_p, window=window, softcap=softcap, sinks=sinks,
                           alibi_slopes=slopes, dropout_mask=mb, return_lse=True, compute_dtype=compute_dtype)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, 0) if outs else q[:0]
    lse = torch.cat(lses, 1) if lses else q.new_empty(q.shape[1], 0, dtype=torch.float32)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# linear layers with fused epilogues
# ---------------------------------------------------------------------------------------------

ACTIVATIONS = (None, "gelu", "gelu_tanh", "relu")
# swiglu (silu(gate) * up) and geglu (gelu_tanh(gate) * up, Gemma's): gated FFNs, not elementwise functions
GATED_ACTIVATIONS = ("swiglu", "geglu")
MLP_ACTIVATIONS = ACTIVATIONS + GATED_ACTIVATIONS


def gate_activation(gate, name):
    """The gated FFN's activation of its gate: SiLU (``"swiglu"``) or the tanh GELU (``"geglu"``)."""
    if name == "swiglu":
        return F.silu(gate)
    if name == "geglu":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"gated activation must be one of {GATED_ACTIVATIONS}, got {name!r}")


def activation(x, name):
    if name is None:
        return x
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def _dropout(y, p, mask, cdt):
    """Dropout in ``cdt``: the random mask of F.dropout, or ``mask`` (bool, True = kept)."""
    if p <= 0.0:
        return y
    if mask is None:
        return F.dropout(y, p, training=True)
    return y * mask.to(cdt) / (1.0 - p)


def linear(x, weight, bias=None, activation_name=None, residual=None, dropout_p=0.0, *,
           dropout_mask=None, compute_dtype=None, lora=None):
    """``dropout(act(x @ weight.T + bias + U @ B.T)) + residual``; weight in ``torch.nn.Linear``
    layout (out, in); ``lora`` = (U (..., R), B (out, R)) or None. ``dropout_mask`` (bool, the
    output's shape, True = kept) replaces the random mask.

    Returns x's dtype, promoted with residual's (an fp32 residual stream keeps fp32).
    """
    cdt = _compute_dtype(x.dtype, compute_dtype)
    y = F.linear(x.to(cdt), weight.to(cdt), _cast(bias, cdt))
    if lora is not None:
        y = y + F.linear(lora[0].to(cdt), lora[1].to(cdt))
    y = activation(y, activation_name)
    y = _dropout(y, dropout_p, dropout_mask, cdt)
    if residual is not None:
        y = y + residual.to(cdt)
        return y.to(torch.promote_types(x.dtype, residual.dtype))
    return y.to(x.dtype)


def mlp(x, w1, b1, w2, b2, activation_name="gelu", residual=None, dropout_p=0.0, output_dropout_p=0.0,
        *, dropout_mask=None, output_dropout_mask=None, compute_dtype=None):
    """``dropout2(linear2(dropout(act(linear1(x))))) + residual``; the hidden activation (after
    its dropout) is rounded to x's dtype. ``dropout_mask`` (hidden's shape) and
    ``output_dropout_mask`` (the output's shape), bool with True = kept, replace the random masks.
    ``activation_name="swiglu"`` or ``"geglu"``: w1 (2F, D) and b1 (2F,) hold the gate rows then
    the up rows (see :func:`swiglu`, :func:`geglu`).
    """
    if activation_name in GATED_ACTIVATIONS:
        f = w1.shape[0] // 2
        return gated_ffn(x, w1[:f], w1[f:], w2, residual, b_gate=None if b1 is None else b1[:f],
                         b_up=None if b1 is None else b1[f:], b_down=b2, dropout_p=dropout_p,
                         output_dropout_p=output_dropout_p, dropout_mask=dropout_mask,
                         output_dropout_mask=output_dropout_mask, compute_dtype=compute_dtype,
                         activation=activation_name)
    h = linear(x, w1, b1, activation_name, None, dropout_p, dropout_mask=dropout_mask,
               compute_dtype=compute_dtype)
    return linear(h, w2, b2, None, residual, output_dropout_p, dropout_mask=output_dropout_mask,
                  compute_dtype=compute_dtype)


def swiglu(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None, dropout_p=0.0,
           output_dropout_p=0.0, dropout_mask=None, output_dropout_mask=None, compute_dtype=None):
    """LLaMA's FFN: ``dropout2((dropout(silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up))) @
    w_down.T + b_down) + residual``; weights in ``torch.nn.Linear`` layout.

    The gate and up projections are rounded to x's dtype before the SiLU-multiply, and the
    hidden activation after it, as eager PyTorch (Hugging Face's ``LlamaMLP``) computes them.
    Masks as in :func:`mlp`.
    """
    return gated_ffn(x, w_gate, w_up, w_down, residual, b_gate=b_gate, b_up=b_up, b_down=b_down,
                     dropout_p=dropout_p, output_dropout_p=output_dropout_p, dropout_mask=dropout_mask,
                     output_dropout_mask=output_dropout_mask, compute_dtype=compute_dtype, activation="swiglu")


def geglu(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None, dropout_p=0.0,
          output_dropout_p=0.0, dropout_mask=None, output_dropout_mask=None, compute_dtype=None):
    """Gemma's FFN: :func:`swiglu` with the tanh GELU of the gate instead of its SiLU (Hugging
    Face's ``GemmaMLP`` with ``hidden_act="gelu_pytorch_tanh"``)."""
    return gated_ffn(x, w_gate, w_up, w_down, residual, b_gate=b_gate, b_up=b_up, b_down=b_down,
                     dropout_p=dropout_p, output_dropout_p=output_dropout_p, dropout_mask=dropout_mask,
                     output_dropout_mask=output_dropout_mask, compute_dtype=compute_dtype, activation="geglu")


def gated_ffn(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None, dropout_p=0.0,
              output_dropout_p=0.0, dropout_mask=None, output_dropout_mask=None, compute_dtype=None,
              activation="swiglu"):
    """:func:`swiglu` (``activation="swiglu"``) or :func:`geglu` (``"geglu"``)."""
    cdt = _compute_dtype(x.dtype, compute_dtype)
    xc = x.to(cdt)
    gate = F.linear(xc, w_gate.to(cdt), _cast(b_gate, cdt)).to(x.dtype).to(cdt)
    up = F.linear(xc, w_up.to(cdt), _cast(b_up, cdt)).to(x.dtype).to(cdt)
    h = _dropout(gate_activation(gate, activation) * up, dropout_p, dropout_mask, cdt).to(x.dtype)
    return linear(h, w_down, b_down, None, residual, output_dropout_p, dropout_mask=output_dropout_mask,
                  compute_dtype=compute_dtype)


def gated(x, w_gate, w_up, b_gate=None, b_up=None, *, dropout_p=0.0, dropout_mask=None, lora=None,
          compute_dtype=None, activation="swiglu"):
    """A gated FFN's first layer alone: ``dropout(act(x @ w_gate.T + b_gate + U @ Bg.T) * (x @
    w_up.T + b_up + U @ Bu.T))`` with act SiLU (``activation="swiglu"``) or the tanh GELU
    (``"geglu"``), gate and up rounded to x's dtype first (as :func:`swiglu`); ``lora`` = (U
    (..., R), Bg (F, R), Bu (F, R)) or None. Returns x's dtype."""
    cdt = _compute_dtype(x.dtype, compute_dtype)
    xc = x.to(cdt)
    gate = F.linear(xc, w_gate.to(cdt), _cast(b_gate, cdt))
    up = F.linear(xc, w_up.to(cdt), _cast(b_up, cdt))
    if lora is not None:
        u = lora[0].to(cdt)
        gate, up = gate + F.linear(u, lora[1].to(cdt)), up + F.linear(u, lora[2].to(cdt))
    gate, up = gate.to(x.dtype).to(cdt), up.to(x.dtype).to(cdt)
    return _dropout(gate_activation(gate, activation) * up, dropout_p, dropout_mask, cdt).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# rotary position embeddings
# ---------------------------------------------------------------------------------------------

def rope_cos_sin(positions=None, inv_freq=None, cos=None, sin=None, scale=1.0, interleaved=False, *,
                 dtype=torch.float32):
    """Per-pair ``(cos, sin)`` of shape (B or 1, L, D_rot / 2) in ``dtype``.

    From positions: angles ``positions * inv_freq`` rounded to fp32 (Hugging Face's rotary
    modules compute them so; it is part of the definition), cos/sin in ``dtype`` promoted to at
    least fp32, times ``scale``, then rounded to ``dtype``. From tables: the pair's first entry.
    """
    if positions is not None:
        angle = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
        wide = torch.promote_types(dtype, torch.float32)
        angle = angle.to(wide)
        return (torch.cos(angle) * scale).to(dtype), (torch.sin(angle) * scale).to(dtype)
    first = slice(0, None, 2) if interleaved else slice(0, cos.shape[-1] // 2)
    return cos[..., first].to(dtype), sin[..., first].to(dtype)


def rope(q, k, positions=None, inv_freq=None, *, cos=None, sin=None, scale=1.0, interleaved=False,
         compute_dtype=None):
    """Rotary embeddings on q (B, L, Hq, D) and k (B, L, Hk, D); see :func:`fused_block.rope`.

    Pairs are (i, i + D_rot/2) (half-split) or (2i, 2i + 1) (interleaved); dims past D_rot are
    copied. Returns ``(q_out, k_out)`` in the inputs' dtype.
    """
    cdt = _compute_dtype(q.dtype, compute_dtype)
    c, s = rope_cos_sin(positions, inv_freq, cos, sin, scale, interleaved, dtype=cdt)
    c, s = c[:, :, None, :], s[:, :, None, :]  # (B or 1, L, 1, D_rot / 2): broadcast over heads
    rot = 2 * c.shape[-1]

    def rotate(x):
        xr, rest = x.to(cdt)[..., :rot], x.to(cdt)[..., rot:]
        x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :rot // 2], xr[..., rot // 2:])
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
        return torch.cat((out, rest), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rope_qkvpacked(qkv, num_heads, num_kv_heads, positions=None, inv_freq=None, *, cos=None, sin=None, scale=1.0,
                   interleaved=False, batch_first=True, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6,
                   norm_unit_offset=False, compute_dtype=None):
    """RoPE on a packed QKV projection (B, L, (H + 2 Hkv) * D) (or (L, B, ...)); see
    :func:`fused_block.rope_qkvpacked`. q and k rotated, v unchanged, in qkv's layout;
    ``positions=None`` with ``inv_freq`` means 0..L-1. With the norm weights, each q (k) head
    is first RMS-normalized over its D elements and scaled (in the compute dtype, unrounded; by 1 +
    the weight with ``norm_unit_offset``)."""
    t = qkv if batch_first else qkv.transpose(0, 1)
    t = t.unflatten(-1, (num_heads + 2 * num_kv_heads, -1))
    if positions is None and inv_freq is not None:
        positions = torch.arange(t.shape[1], device=qkv.device)[None]
    q, k = t[:, :, :num_heads], t[:, :, num_heads:num_heads + num_kv_heads]
    if q_norm_weight is not None:
        cdt = _compute_dtype(qkv.dtype, compute_dtype)
        off = 1.0 if norm_unit_offset else 0.0
        q, k = ((x.to(cdt) * torch.rsqrt(x.to(cdt).pow(2).mean(-1, keepdim=True) + norm_eps) * (w.to(cdt) + off))
                for x, w in ((q, q_norm_weight), (k, k_norm_weight)))
    q, k = rope(q, k, positions, inv_freq, cos=cos, sin=sin, scale=scale, interleaved=interleaved,
                compute_dtype=compute_dtype)
    out = torch.cat((q.to(qkv.dtype), k.to(qkv.dtype), t[:, :, num_heads + num_kv_heads:]), dim=2).flatten(2)
    return out if batch_first else out.transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# linear + cross-entropy (the LM head's loss)
# ---------------------------------------------------------------------------------------------

def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                         softcap=None, reduction="mean", return_lse=False, compute_dtype=None):
    """``F.cross_entropy(softcap(hidden @ weight.T + bias), target)`` plus ``z_loss * lse^2``
    per token; see :func:`fused_block.linear_cross_entropy`.

    The logits are rounded to hidden's dtype (the kernels' chunk buffer, as eager ``F.linear``
    rounds its output), then everything runs in ``compute_dtype``. A mean divides by the number
    of non-ignored tokens, and is 0 when there is none. Returns the loss in fp32 (or wider) and,
    with ``return_lse``, the per-token log-sum-exp of the softcapped logits.
    """
    cdt = _compute_dtype(hidden.dtype, compute_dtype)
    out_dtype = torch.promote_types(cdt, torch.float32)
    logits = F.linear(hidden.to(cdt), weight.to(cdt), _cast(bias, cdt)).to(hidden.dtype).to(cdt)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1).long()  # any integer dtype, as the kernels take it (F.cross_entropy: int64)
    valid = t != ignore_index
    lse = torch.logsumexp(flat, dim=-1)
    # ignore_index passed on: a valid row never holds it, and a target of -100 under another
    # ignore_index is out of range (IndexError, as torch's), not ignored by the default
    rows = F.cross_entropy(flat, torch.where(valid, t, 0), reduction="none", label_smoothing=label_smoothing,
                           ignore_index=ignore_index)
    rows = torch.where(valid, rows + z_loss * lse * lse, 0.0).to(out_dtype)
    if reduction == "none":
        loss = rows.reshape(target.shape)
    else:
        loss = rows.sum()
        if reduction == "mean":
            loss = loss / valid.sum().clamp(min=1)
    return (loss, lse.detach().to(out_dtype).reshape(target.shape)) if return_lse else loss  # the LSE: no gradient
