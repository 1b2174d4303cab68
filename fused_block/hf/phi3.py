"""Phi-3: ``Phi3DecoderLayer``.

The LLaMA family's layer with the projections already fused: ``qkv_proj`` holds [q; k; v]
(one GEMM, no weight concatenation) and ``gate_up_proj`` the gate rows then the up rows, which
``mlp(..., activation="swiglu")`` reads in place. The residual dropouts (``resid_pdrop``) are
fused: the attention's into the second norm's add, the MLP's into the down projection's
epilogue. RoPE (partial rotary, LongRoPE's frequencies as the rotary module holds them for
this call) as in :mod:`fused_block.hf.llama`. The config's ``sliding_window`` (Phi3Attention
passes it to the attention function) is the kernel's window where the mask does not carry it
(flash-attention's 2-D masks, a copied light mask). An MLP that does not gate with SiLU runs
Hugging Face's module.
"""
from torch import nn

from fused_block import lora
from fused_block.blocks import _like
from fused_block.hf import llama
from fused_block.hf._attention import mask_convention, self_attention
from fused_block.hf._core import SAME, Family, kv_cache, warn_once
from fused_block.linear import gated_linear, linear, mlp
from fused_block.norm import add_rms_norm

CAUSAL_LMS = ("Phi3ForCausalLM",)
ROTARIES = ("Phi3RotaryEmbedding",)
_LINEAR, _DROPOUT = (nn.Linear,), (nn.Dropout,)


def check(layer):
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(type(lora.base(getattr(attn, p, None))) is nn.Linear for p in ("qkv_proj", "o_proj")):
        return "self_attn's qkv_proj/o_proj are not both torch.nn.Linear"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        n = getattr(layer, norm, None)
        if n is None or not hasattr(n, "weight") or llama.rms_eps(n) is None:
            return f"{norm} is not an RMSNorm with weight and eps"
    for name in ("resid_attn_dropout", "resid_mlp_dropout"):
        if type(getattr(layer, name, None)) is not nn.Dropout:
            return f"{name} is not a torch.nn.Dropout"
    if not all(hasattr(attn, a) for a in ("head_dim", "scaling", "num_key_value_heads")) or not hasattr(layer, "mlp"):
        return "missing mlp, head_dim, scaling or num_key_value_heads"
    return None


def _swiglu_reason(mlp_mod):
    """Why the layer's MLP cannot run as ``mlp(..., "swiglu")`` (None if it can)."""
    kind = type(mlp_mod)
    if kind.__name__ != "Phi3MLP" or not kind.__module__.startswith("transformers.models."):
        return f"{kind.__name__} is not Phi3MLP"
    act = getattr(getattr(mlp_mod, "config", None), "hidden_act", None)
    if act not in ("silu", "swish") or type(getattr(mlp_mod, "activation_fn", None)).__name__ not in (
            "SiLU", "SiLUActivation"):
        return f"hidden_act {act!r} (the fused SwiGLU gates with SiLU)"
    if not all(type(lora.base(getattr(mlp_mod, n, None))) is nn.Linear for n in ("gate_up_proj", "down_proj")):
        return "gate_up_proj and down_proj are not both torch.nn.Linear"
    return None


def prepare(layer):
    reason = _swiglu_reason(layer.mlp)
    layer._fused_block.fused_mlp = reason is None
    if reason is not None:
        warn_once(("mlp", type(layer).__name__, reason),
                  f"{type(layer).__name__}'s MLP runs Hugging Face's module (unfused): {reason}")


def run(layer, call, x):
    attn, state = layer.self_attn, layer._fused_block
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    D, Hkv = attn.head_dim, attn.num_key_value_heads
    H = attn.qkv_proj.out_features // D - 2 * Hkv
    n1, _ = add_rms_norm(x, None, ln1.weight, llama.rms_eps(ln1))
    # PEFT LoRA on the projections: the adapters' updates inside the same GEMMs (fused_block.lora).
    qkv = linear(n1, attn.qkv_proj.weight, attn.qkv_proj.bias, lora=lora.terms(attn.qkv_proj, n1))  # [q; k; v]
    qkv = llama.rope(layer, qkv, H, Hkv, call)
    o = self_attention(qkv, H, Hkv, kv_cache(call), attn.layer_idx, call.get("attention_mask"), True,
                       mask_convention(attn.config), attn.scaling, attn.attention_dropout if attn.training else 0.0,
                       type(layer).__name__, sliding_window=llama.sliding_window(attn), packing=call)
    o = linear(o, attn.o_proj.weight, attn.o_proj.bias, lora=lora.terms(attn.o_proj, o))
    d = layer.resid_attn_dropout  # on by its own flag, as the original calls it
    p_attn = d.p if d.training else 0.0
    n2, h = add_rms_norm(_like(o, x), x, ln2.weight, llama.rms_eps(ln2), p_attn)
    if not state.fused_mlp:
        return h + layer.resid_mlp_dropout(layer.mlp(n2))
    m = layer.mlp
    d = layer.resid_mlp_dropout
    p_mlp = d.p if d.training else 0.0
    if lora.is_lora(m.gate_up_proj) or lora.is_lora(m.down_proj):  # two GEMMs, the hidden activation between
        w, b = m.gate_up_proj.weight, m.gate_up_proj.bias
        f = w.shape[0] // 2
        hid = gated_linear(n2, w[:f], w[f:], None if b is None else b[:f], None if b is None else b[f:],
                           lora=lora.split_rows(lora.terms(m.gate_up_proj, n2), f))
        return linear(hid, m.down_proj.weight, m.down_proj.bias, None, h, p_mlp, lora=lora.terms(m.down_proj, hid))
    return mlp(n2, m.gate_up_proj.weight, m.gate_up_proj.bias, m.down_proj.weight, m.down_proj.bias, "swiglu", h,
               0.0, p_mlp)


def tree(layer):
    tree = {"self_attn": SAME, "input_layernorm": SAME, "post_attention_layernorm": SAME,
            "self_attn.qkv_proj": _LINEAR, "self_attn.o_proj": _LINEAR, "resid_attn_dropout": _DROPOUT}
    if layer._fused_block.fused_mlp:
        tree.update({"mlp": SAME, "mlp.activation_fn": SAME, "mlp.gate_up_proj": _LINEAR, "mlp.down_proj": _LINEAR,
                     "resid_mlp_dropout": _DROPOUT})
    return tree


def lora_paths(layer):
    fused_mlp = layer._fused_block.fused_mlp
    return ("self_attn.qkv_proj", "self_attn.o_proj") + (("mlp.gate_up_proj", "mlp.down_proj") if fused_mlp else ())


FAMILY = Family(check, llama.check_call, run, tree, prepare=prepare, rotaries=ROTARIES, lora_paths=lora_paths,
                called=lambda layer: () if layer._fused_block.fused_mlp else ("mlp", "resid_mlp_dropout"))
