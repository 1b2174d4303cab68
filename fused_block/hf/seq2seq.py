"""Encoder-decoders: BART (``BartEncoderLayer``, ``BartDecoderLayer``: Post-LN) and Whisper
(``WhisperEncoderLayer``, ``WhisperDecoderLayer``: Pre-LN).

Per layer: one QKV GEMM on the concatenated q/k/v weights (Whisper's k_proj has no bias: zeros
in its slot), the attention kernel on the packed output (the encoder's padding; the decoder's
causal self-attention with its KV cache, bottom-right while decoding), the output GEMM, the
residual adds with their dropouts inside ``add_layer_norm`` (Post-LN: the norm of the sum is
the stream; Pre-LN: the next sublayer's input), and the FFN as ``mlp`` (the activation and its
dropout in the first GEMM's epilogue; Pre-LN: the output dropout and the residual in the
second's). Cross-attention: the query GEMM, the keys and values of the encoder's output in one
GEMM (``k_proj`` and ``v_proj`` concatenated), computed once per generation and kept in the
cross-attention cache as transformers does, the kernel with the encoder's padding as key
padding. The embeddings (learned positions, Whisper's convolutions) are the model's own.
fp16 outputs are clamped as the originals clamp them (BART's encoder when a value is not
finite: a check that synchronizes, in fp16 only).
"""
import torch
from torch import nn

from fused_block.blocks import _like
from fused_block.hf._attention import (attend, cross_keys, implementation_reason, kv_heads, mask_convention,
                                       mask_reason, plan, self_attention)
from fused_block.hf._core import ACTIVATIONS, SAME, Family, kv_cache, packed_bias, packed_linear
from fused_block.linear import linear, mlp
from fused_block.norm import add_layer_norm, add_layer_norm_as_torch

_LINEAR, _LAYER_NORM = (nn.Linear,), (nn.LayerNorm,)
_PROJ = ("q_proj", "k_proj", "v_proj", "out_proj")


def _pre_ln(layer):
    return type(layer).__name__.startswith("Whisper")


def _decoder(layer):
    return type(layer).__name__.endswith("DecoderLayer")


def check(layer):
    attentions = ("self_attn", "encoder_attn") if _decoder(layer) else ("self_attn",)
    for a in attentions:
        attn = getattr(layer, a, None)
        if attn is None or not all(type(getattr(attn, p, None)) is nn.Linear for p in _PROJ):
            return f"{a}'s q_proj/k_proj/v_proj/out_proj are not all torch.nn.Linear"
        if not all(hasattr(attn, n) for n in ("num_heads", "head_dim", "scaling", "dropout")):
            return f"{a} has no num_heads, head_dim, scaling or dropout"
    norms = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm") if _decoder(layer) else (
        "self_attn_layer_norm", "final_layer_norm")
    if not all(type(getattr(layer, n, None)) is nn.LayerNorm for n in norms):
        return f"{', '.join(norms)} are not all torch.nn.LayerNorm"
    if not all(type(getattr(layer, n, None)) is nn.Linear for n in ("fc1", "fc2")):
        return "fc1/fc2 are not both torch.nn.Linear"
    act = getattr(layer.self_attn.config, "activation_function", None)
    if act not in ACTIVATIONS:
        return f"activation_function {act!r} has no fused epilogue"
    return None


def check_call(layer, call):
    cfg = layer.self_attn.config
    L = call["hidden_states"].shape[1]
    convention = mask_convention(cfg)
    reason = implementation_reason(cfg) or mask_reason(call.get("attention_mask"), L, _decoder(layer), convention)
    if reason is None and call.get("encoder_hidden_states") is not None:
        reason = mask_reason(call.get("encoder_attention_mask"), L, False, convention)
    return reason


def _qkv(layer, attn, x, prefix):
    """The packed [q; k; v] projection of x (one GEMM)."""
    state = layer._fused_block
    return packed_linear(state, prefix + "qkv_weight", x, (attn.q_proj, attn.k_proj, attn.v_proj),
                         packed_bias(state, prefix + "qkv_bias", (attn.q_proj, attn.k_proj, attn.v_proj)))


def _self_attention(layer, call, x, causal):
    attn = layer.self_attn
    cache = kv_cache(call)
    cache = getattr(cache, "self_attention_cache", cache)  # an EncoderDecoderCache's self-attention half
    o = self_attention(_qkv(layer, attn, x, ""), attn.num_heads, attn.num_heads, cache, attn.layer_idx,
                       call.get("attention_mask"), causal, mask_convention(attn.config), attn.scaling,
                       attn.dropout if attn.training else 0.0, type(layer).__name__, packing=call)  # its own flag
    return linear(o, attn.out_proj.weight, attn.out_proj.bias)


def _cross_attention(layer, call, x):
    """x (B, Lq, d) attending to the encoder's output, whose keys and values are projected once
    and kept in the cross-attention cache (as transformers' attention does)."""
    attn, state = layer.encoder_attn, layer._fused_block
    enc = call["encoder_hidden_states"]
    B, Lq, _ = x.shape
    H, D = attn.num_heads, attn.head_dim
    q = linear(x, attn.q_proj.weight, attn.q_proj.bias).unflatten(-1, (H, D)).transpose(1, 2)
    k, v = cross_keys(kv_cache(call), attn.layer_idx, lambda: kv_heads(
        packed_linear(state, "kv_weight", enc, (attn.k_proj, attn.v_proj),
                      packed_bias(state, "kv_bias", (attn.k_proj, attn.v_proj))), H))
    p = plan(call.get("encoder_attention_mask"), B, Lq, k.shape[2], False, mask_convention(attn.config))
    o = attend(q, k, v, p, attn.scaling, attn.dropout if attn.training else 0.0, type(layer).__name__)
    return linear(o.transpose(1, 2).reshape(B, Lq, H * D), attn.out_proj.weight, attn.out_proj.bias)


def _norm(ln):
    return ln.weight, ln.bias, ln.eps


def run(layer, call, x):
    decoder, cross = _decoder(layer), call.get("encoder_hidden_states") is not None
    p = layer.dropout if layer.training else 0.0
    p_act = layer.activation_dropout if layer.training else 0.0
    act = ACTIVATIONS[layer.self_attn.config.activation_function]
    ln1, ln_f = layer.self_attn_layer_norm, layer.final_layer_norm
    ln2 = layer.encoder_attn_layer_norm if decoder and cross else ln_f  # the norm after self-attention
    if _pre_ln(layer):
        n, _ = add_layer_norm(x, None, *_norm(ln1))
        n, h = add_layer_norm(_like(_self_attention(layer, call, n, decoder), x), x, *_norm(ln2), p)
        if decoder and cross:
            n, h = add_layer_norm(_like(_cross_attention(layer, call, n), h), h, *_norm(ln_f), p)
        y = mlp(n, layer.fc1.weight, layer.fc1.bias, layer.fc2.weight, layer.fc2.bias, act, h, p_act, p)
        if y.dtype == torch.float16 and not decoder:  # WhisperEncoderLayer clamps unconditionally
            clamp = torch.finfo(y.dtype).max - 1000
            y = torch.clamp(y, min=-clamp, max=clamp)
        return y
    # Post-LN: the norms' outputs are the stream, fp32 under CUDA's autocast as torch's LayerNorm gives
    h, _ = add_layer_norm_as_torch(_like(_self_attention(layer, call, x, decoder), x), x, *_norm(ln1), p)
    if decoder and cross:
        h, _ = add_layer_norm_as_torch(_like(_cross_attention(layer, call, h), h), h,
                                       *_norm(layer.encoder_attn_layer_norm), p)
    f = mlp(h, layer.fc1.weight, layer.fc1.bias, layer.fc2.weight, layer.fc2.bias, act, None, p_act)
    y, _ = add_layer_norm_as_torch(_like(f, h), h, *_norm(ln_f), p)
    if y.dtype == torch.float16 and not decoder and not torch.isfinite(y).all():  # as BartEncoderLayer
        clamp = torch.finfo(y.dtype).max - 1000
        y = torch.clamp(y, min=-clamp, max=clamp)
    return y


def tree(layer):
    tree = {"self_attn": SAME, "self_attn_layer_norm": _LAYER_NORM, "final_layer_norm": _LAYER_NORM,
            "fc1": _LINEAR, "fc2": _LINEAR, "activation_fn": SAME}
    tree.update((f"self_attn.{p}", _LINEAR) for p in _PROJ)
    if _decoder(layer):
        tree.update({"encoder_attn": SAME, "encoder_attn_layer_norm": _LAYER_NORM})
        tree.update((f"encoder_attn.{p}", _LINEAR) for p in _PROJ)
    return tree


FAMILY = Family(check, check_call, run, tree, cross_attention=True)
