"""T5: ``T5Block`` and ``MT5Block`` (the same code), the encoder's and the decoder's layers.

Pre-norm sublayers ``h = h + dropout(sublayer(T5LayerNorm(h)))``: self-attention, the
decoder's cross-attention, the FFN. Per layer:

- ``T5LayerNorm`` (RMSNorm without mean subtraction or bias, fp32 statistics) through
  ``add_rms_norm``: each sublayer's residual add and its dropout inside the next sublayer's
  norm (one launch gives the stream and the next sublayer's input).
- Self-attention: one QKV GEMM on the concatenated q/k/v weights, the KV cache's update (an
  ``EncoderDecoderCache``'s self-attention half), the attention kernel without scaling (the
  module's ``scaling``, 1.0) with the relative position bias as its ``bias`` input (with its
  gradient: ``relative_attention_bias.weight`` trains) beside the mask's causality (the
  decoder's, bottom-right while decoding) and key padding, the output GEMM. The bias is the
  model's own: the layer with ``has_relative_attention_bias`` computes it (``compute_bias``,
  after the cache's update, as T5Attention does) and returns it; the others take the one
  T5Stack passes them.
- Cross-attention: the query GEMM, the keys and values of the encoder's output in one GEMM,
  computed once per generation and kept in the cross-attention cache as transformers does, the
  kernel with the encoder's padding. T5 gives it no position bias (zeros: none reaches the
  kernel) unless one is passed.
- FFN: ``T5DenseActDense`` (relu, v1.0) as ``mlp``, ``T5DenseGatedActDense`` (gated-gelu with
  ``gelu_new``, v1.1 / Flan-T5) as ``geglu`` (the tanh-GELU-multiply in the gate/up GEMM's
  epilogue, Gemma's), gated-silu as ``swiglu``: the hidden dropout in the first GEMM's
  epilogue, the output dropout and the residual add in the second's. ``wo`` kept in fp32 while
  the rest is half (``from_pretrained``'s ``_keep_in_fp32_modules``): the hidden activation is
  cast to fp32 and ``wo`` runs in fp32 (the stream turns fp32, as in the original).
- fp16: the stream is clamped after each sublayer as T5Block clamps it (when a value is
  infinite; no synchronization), the residual add then apart from the next norm.

The return value is T5Block's: ``(hidden_states, self_attn_position_bias,
cross_attn_position_bias)``, the position biases meaning what T5's mean (its biases hold no
mask), so converted and unconverted layers mix. The zeros T5 returns for a cross-attention
without a bias are a zero-stride view marked as such (:data:`ZERO_BIAS`): a converted
neighbour skips them, an unconverted one adds zeros.
"""
import torch
import torch.nn.functional as F
from torch import nn

from fused_block.hf._attention import (attend, cross_keys, implementation_reason, kv_heads, mask_convention,
                                       mask_reason, plan, self_attention)
from fused_block.hf._core import ACTIVATIONS, SAME, Family, kv_cache, packed, packed_linear
from fused_block.linear import gated_linear, geglu, linear, mlp, swiglu
from fused_block.norm import add_rms_norm

_LINEAR, _DROPOUT, _LIST = (nn.Linear,), (nn.Dropout,), (nn.ModuleList,)
NORMS = ("T5LayerNorm", "MT5LayerNorm")
# T5DenseGatedActDense's dense_act_fn -> the gated FFN that fuses it.
GATED = {"gelu_new": geglu, "gelu_pytorch_tanh": geglu, "silu": swiglu, "swish": swiglu}
_GATED_NAME = {geglu: "geglu", swiglu: "swiglu"}
# An attribute set on the zero position bias a converted layer returns for a bias-less attention.
ZERO_BIAS = "_fused_block_zero_bias"
_HALF = (torch.float16, torch.bfloat16)


def _decoder(layer):
    return bool(getattr(layer, "is_decoder", False))


def _attentions(layer):
    return [("layer.0.SelfAttention", layer.layer[0].SelfAttention)] + (
        [("layer.1.EncDecAttention", layer.layer[1].EncDecAttention)] if _decoder(layer) else [])


def _gated(ffn):
    return hasattr(ffn, "wi_0")


def check(layer):
    sublayers = getattr(layer, "layer", None)
    if not isinstance(sublayers, nn.ModuleList) or len(sublayers) != (3 if _decoder(layer) else 2):
        return "layer is not the ModuleList of 2 (encoder) or 3 (decoder) sublayers"
    if not hasattr(sublayers[0], "SelfAttention") or (_decoder(layer) and not hasattr(sublayers[1], "EncDecAttention")):
        return "the sublayers are not T5's self-attention (and cross-attention)"
    for path, attn in _attentions(layer):
        if not all(type(getattr(attn, p, None)) is nn.Linear for p in "qkvo"):
            return f"{path}'s q/k/v/o are not all torch.nn.Linear"
        if not all(hasattr(attn, n) for n in ("n_heads", "key_value_proj_dim", "dropout", "scaling", "layer_idx",
                                              "has_relative_attention_bias", "compute_bias")):
            return f"{path} has no n_heads, key_value_proj_dim, dropout, scaling, layer_idx or compute_bias"
        relative = getattr(attn, "relative_attention_bias", None)
        if attn.has_relative_attention_bias and type(relative) is not nn.Embedding:
            return f"{path}.relative_attention_bias is not a torch.nn.Embedding"
    for sub in sublayers:
        norm = getattr(sub, "layer_norm", None)
        if type(norm).__name__ not in NORMS or not isinstance(getattr(norm, "variance_epsilon", None), float):
            return f"a sublayer's layer_norm is not one of {NORMS}"
        if type(getattr(sub, "dropout", None)) is not nn.Dropout:
            return "a sublayer's dropout is not torch.nn.Dropout"
    ffn = getattr(sublayers[-1], "DenseReluDense", None)
    linears = ("wi_0", "wi_1", "wo") if _gated(ffn) else ("wi", "wo")
    if ffn is None or not all(type(getattr(ffn, n, None)) is nn.Linear for n in linears):
        return f"the FFN's {'/'.join(linears)} are not all torch.nn.Linear"
    if type(getattr(ffn, "dropout", None)) is not nn.Dropout:
        return "the FFN's dropout is not torch.nn.Dropout"
    act = getattr(layer.layer[0].SelfAttention.config, "dense_act_fn", None)
    if act not in (GATED if _gated(ffn) else ACTIVATIONS):
        return f"dense_act_fn {act!r}{' (gated)' if _gated(ffn) else ''} has no fused epilogue"
    return None


def check_call(layer, call):
    cfg = layer.layer[0].SelfAttention.config
    hidden = call["hidden_states"]
    B, L, _ = hidden.shape
    convention = mask_convention(cfg)
    reason = implementation_reason(cfg) or mask_reason(call.get("attention_mask"), L, _decoder(layer), convention)
    if reason is None and call.get("encoder_hidden_states") is not None:
        reason = mask_reason(call.get("encoder_attention_mask"), L, False, convention)
    for name, (_, attn) in zip(("position_bias", "encoder_decoder_position_bias"), _attentions(layer)):
        bias = call.get(name)
        if bias is not None and not (isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dim() == 4
                                     and bias.shape[0] in (1, B) and bias.shape[1] in (1, attn.n_heads)):
            reason = reason or f"a {name} that is not a (B or 1, H or 1, Lq, Lk) float tensor"
    return reason or _dtype_reason(layer, hidden)


def _dtype_reason(layer, hidden):
    """One parameter dtype, but for the FFN's ``wo`` which may be fp32 (``_keep_in_fp32_modules``);
    fp32 parameters take fp32 hidden states only."""
    wo = layer.layer[-1].DenseReluDense.wo
    skip = {id(p) for p in wo.parameters()}
    dtypes = {p.dtype for p in layer.parameters() if id(p) not in skip}
    if len(dtypes) != 1:
        return f"parameters of several dtypes {sorted(map(str, dtypes))} (the FFN's wo aside)"
    dtype = dtypes.pop()
    if wo.weight.dtype not in (dtype, torch.float32):
        return f"the FFN's wo in {wo.weight.dtype}, the rest in {dtype}"
    if dtype not in _HALF and hidden.dtype != dtype:
        return f"hidden states in {hidden.dtype} with {dtype} parameters"
    return None


def _dropout_p(module):
    """An nn.Dropout's probability where it is on (by its own training flag: the original calls it)."""
    return module.p if module.training else 0.0


def _clamp(h):
    """T5Block's fp16 clamp: to +-(max - 1000) where a value is infinite, else a no-op."""
    if h.dtype != torch.float16:
        return h
    big = torch.finfo(torch.float16).max
    value = torch.where(torch.isinf(h).any(), big - 1000, big)
    return torch.clamp(h, min=-value, max=value)


def _norm_out(n, norm):
    """T5LayerNorm's output dtype: the weight's when it is half, else fp32 (the statistics'),
    the fused norm's being x's."""
    dtype = norm.weight.dtype if norm.weight.dtype in _HALF else torch.float32
    return n if n.dtype == dtype else n.to(dtype)


def _add_norm(o, residual, norm, p):
    """``h = residual + dropout(o)`` (clamped in fp16) and the next sublayer's input ``norm(h)``."""
    if residual is not None and residual.dtype == torch.float16:
        h = _clamp(residual + (F.dropout(o, p) if p > 0 else o))
        n, _ = add_rms_norm(h, None, norm.weight, norm.variance_epsilon)
        return _norm_out(n, norm), h
    if residual is None:
        n, _ = add_rms_norm(o, None, norm.weight, norm.variance_epsilon)
        return _norm_out(n, norm), o
    n, h = add_rms_norm(o, residual, norm.weight, norm.variance_epsilon, p)  # h in the residual's dtype
    return _norm_out(n, norm), h


def _zeros(like, H, Lq, Lk):
    """T5's zero position bias (1, H, Lq, Lk) as a marked zero-stride view."""
    z = like.new_zeros(()).expand(1, H, Lq, Lk)
    setattr(z, ZERO_BIAS, True)
    return z


def _live(bias):
    """The bias the kernel needs: None for a converted layer's zeros."""
    return None if bias is None or getattr(bias, ZERO_BIAS, False) else bias


class _Bias:
    """The self-attention's position bias as a function of the keys' count after the cache's
    update (:func:`fused_block.hf._attention.self_attention`); ``value`` is what T5Attention
    returns: the bias passed in, the layer's ``compute_bias`` or zeros."""

    def __init__(self, attn, given, x, past):
        self.attn, self.value, self.x, self.past = attn, given, x, past

    def __call__(self, Lk):
        attn, L = self.attn, self.x.shape[1]
        if self.value is None:
            if attn.has_relative_attention_bias:
                self.value = attn.compute_bias(L, Lk, device=self.x.device, past_seen_tokens=self.past)
            else:
                self.value = _zeros(self.x, attn.n_heads, L, Lk)
        return _live(self.value)


def _self_attention(layer, call, x):
    attn = layer.layer[0].SelfAttention
    state = layer._fused_block
    cache = kv_cache(call)
    cache = getattr(cache, "self_attention_cache", cache)  # an EncoderDecoderCache's self-attention half
    past = cache.get_seq_length(attn.layer_idx) if cache is not None else 0
    past = past.clone() if isinstance(past, torch.Tensor) else past  # as T5Attention (static caches)
    qkv = packed_linear(state, "qkv_weight", x, (attn.q, attn.k, attn.v),
                        packed(state, "qkv_bias", (attn.q.bias, attn.k.bias, attn.v.bias)))
    bias = _Bias(attn, call.get("position_bias"), x, past)
    o = self_attention(qkv, attn.n_heads, attn.n_heads, cache, attn.layer_idx, call.get("attention_mask"),
                       _decoder(layer), mask_convention(attn.config), attn.scaling,
                       attn.dropout if attn.training else 0.0, type(layer).__name__, position_bias=bias,
                       packing=call, merged=True)
    return linear(o, attn.o.weight, attn.o.bias), bias.value


def _cross_attention(layer, call, x):
    attn, state = layer.layer[1].EncDecAttention, layer._fused_block
    enc = call["encoder_hidden_states"]
    B, Lq, _ = x.shape
    H, D = attn.n_heads, attn.key_value_proj_dim
    q = linear(x, attn.q.weight, attn.q.bias).unflatten(-1, (H, D)).transpose(1, 2)
    k, v = cross_keys(kv_cache(call), attn.layer_idx, lambda: kv_heads(
        packed_linear(state, "kv_weight", enc, (attn.k, attn.v),
                      packed(state, "kv_bias", (attn.k.bias, attn.v.bias))), H))
    bias = call.get("encoder_decoder_position_bias")
    if bias is None:  # T5Attention: zeros (the cross-attention has no relative bias)
        bias = attn.compute_bias(Lq, k.shape[2], device=x.device) if attn.has_relative_attention_bias else \
            _zeros(x, H, Lq, k.shape[2])
    p = plan(call.get("encoder_attention_mask"), B, Lq, k.shape[2], False, mask_convention(attn.config))
    o = attend(q, k, v, p, attn.scaling, attn.dropout if attn.training else 0.0, type(layer).__name__,
               position_bias=_live(bias), merged=True)
    return linear(o.transpose(1, 2).reshape(B, Lq, H * D), attn.o.weight, attn.o.bias), bias


def _ffn(layer, x, residual):
    """``residual + dropout(FFN(x))`` (the FFN's hidden dropout and activation fused)."""
    ff = layer.layer[-1]
    ffn = ff.DenseReluDense
    act = layer.layer[0].SelfAttention.config.dense_act_fn
    p_hid, p_out = _dropout_p(ffn.dropout), _dropout_p(ff.dropout)
    wo = ffn.wo
    if wo.weight.dtype == x.dtype:  # the whole FFN in two GEMMs
        if _gated(ffn):
            return GATED[act](x, ffn.wi_0.weight, ffn.wi_1.weight, wo.weight, residual,
                              b_gate=ffn.wi_0.bias, b_up=ffn.wi_1.bias, b_down=wo.bias, dropout_p=p_hid,
                              output_dropout_p=p_out)
        return mlp(x, ffn.wi.weight, ffn.wi.bias, wo.weight, wo.bias, ACTIVATIONS[act], residual,
                   p_hid, p_out)
    # wo in fp32 (_keep_in_fp32_modules): the hidden activation cast to it, as T5's FFN does.
    if _gated(ffn):
        hid = gated_linear(x, ffn.wi_0.weight, ffn.wi_1.weight, ffn.wi_0.bias, ffn.wi_1.bias, dropout_p=p_hid,
                           activation=_GATED_NAME[GATED[act]])
    else:
        hid = linear(x, ffn.wi.weight, ffn.wi.bias, ACTIVATIONS[act], dropout_p=p_hid)
    return linear(hid.to(wo.weight.dtype), wo.weight, wo.bias, None, residual, p_out)


def run(layer, call, x):
    decoder = _decoder(layer)
    cross = decoder and call.get("encoder_hidden_states") is not None
    subs = layer.layer
    n, _ = _add_norm(x, None, subs[0].layer_norm, 0.0)
    o, self_bias = _self_attention(layer, call, n)
    nxt = subs[1] if cross else subs[-1]
    n, h = _add_norm(o, x, nxt.layer_norm, _dropout_p(subs[0].dropout))
    cross_bias = None
    if cross:
        o, cross_bias = _cross_attention(layer, call, n)
        n, h = _add_norm(o, h, subs[-1].layer_norm, _dropout_p(subs[1].dropout))
    return _clamp(_ffn(layer, n, h)), self_bias, cross_bias


def tree(layer):
    """Every submodule T5Block's forward calls (the relative-position embedding aside: :func:`called`)."""
    tree = {"layer": _LIST}
    for path, _ in _attentions(layer):
        sub = path.rsplit(".", 1)[0]  # the sublayer: its norm, the attention, its dropout
        tree.update({sub: SAME, f"{sub}.layer_norm": SAME, f"{sub}.dropout": _DROPOUT, path: SAME})
        tree.update((f"{path}.{p}", _LINEAR) for p in "qkvo")
    ff = f"layer.{len(layer.layer) - 1}"
    ffn = layer.layer[-1].DenseReluDense
    tree.update({ff: SAME, f"{ff}.layer_norm": SAME, f"{ff}.dropout": _DROPOUT, f"{ff}.DenseReluDense": SAME,
                 f"{ff}.DenseReluDense.dropout": _DROPOUT, f"{ff}.DenseReluDense.act": SAME})
    linears = ("wi_0", "wi_1", "wo") if _gated(ffn) else ("wi", "wo")
    tree.update((f"{ff}.DenseReluDense.{n}", _LINEAR) for n in linears)
    return tree


def called(layer):
    """``compute_bias`` calls the relative-position embedding itself."""
    return tuple(f"{path}.relative_attention_bias" for path, attn in _attentions(layer)
                 if attn.has_relative_attention_bias)


FAMILY = Family(check, check_call, run, tree, called=called, cross_attention=True, own_output=True)
