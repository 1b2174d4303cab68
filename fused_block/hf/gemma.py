"""Gemma family: ``GemmaDecoderLayer``, ``Gemma2DecoderLayer``, ``Gemma3DecoderLayer``.

The LLaMA family's layer (:mod:`fused_block.hf.llama`: one QKV GEMM, ``rope_qkvpacked`` on the
packed output, the KV cache, the attention kernel, GQA) with Gemma's parts:

- (1 + w) RMSNorm (``GemmaRMSNorm``: ``x * rsqrt(mean(x^2) + eps) * (1 + w.float())`` in fp32,
  then cast) through ``add_rms_norm(..., unit_offset=True)``; the residual adds fused into the
  norms as far as the layer's order allows.
- Gemma 1: Pre-RMSNorm, ``n2, h = add_rms_norm(o, x)`` then the MLP with the residual add in
  its down projection's epilogue.
- Gemma 2 and 3: sandwich norms, ``h = x + post_attention_layernorm(o)``,
  ``out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``: the post-attention
  norm alone, then ``add_rms_norm(p, x)`` gives h and the pre-feedforward norm in one launch;
  the post-feedforward norm alone and one add.
- The MLP (``down(gelu_tanh(gate(x)) * up(x))``) as ``geglu``: gate and up in one GEMM with
  the tanh-GELU-multiply in its epilogue. An MLP with another activation runs Hugging Face's module.
- Gemma 3's ``q_norm``/``k_norm`` ((1 + w) per head, before RoPE) inside the RoPE launch
  (``rope_qkvpacked``'s ``norm_unit_offset``). Its local and global layers' RoPE bases: the
  model passes each layer its layer type's cos/sin tables (``position_embeddings``), which the
  RoPE kernel reads (Gemma 1/2: fp32 angles from the rotary module's ``inv_freq``).
- Attention: Gemma 2/3's scaling ``query_pre_attn_scalar ** -0.5``, Gemma 2's
  ``attn_logit_softcapping`` (the kernel's ``softcap``; Gemma 3 keeps the config's value
  without applying it, and so does the fused layer: :func:`softcap`) and sliding windows (the kernel's
  ``window``, local layers skipping the key blocks outside it), through the shared attention
  dispatch (:func:`fused_block.hf._attention.self_attention`).

The embedding scale (``sqrt(hidden_size)``) is the model's, outside the layers; Gemma 2/3's
final logit softcapping is in the causal-LM loss (:mod:`fused_block.hf._lm`).
"""
import inspect
import re

from torch import nn

from fused_block import lora
from fused_block.blocks import _like
from fused_block.hf import llama
from fused_block.hf._attention import (implementation_reason, kernel_head_dim, mask_convention, mask_reason,
                                       self_attention)
from fused_block.hf._core import SAME, Family, kv_cache, packed_bias, packed_linear, warn_once
from fused_block.linear import gated_linear, geglu, linear
from fused_block.norm import add_rms_norm

CAUSAL_LMS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Gemma 3's rotary module keeps one inv_freq per layer type (no ``inv_freq``): not found, so its
# layers read the tables the model passes them.
ROTARIES = ("GemmaRotaryEmbedding", "Gemma2RotaryEmbedding")
# (1 + w) RMSNorms, the layers' and Gemma 3's per-head q/k norms.
NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")
MLPS = ("GemmaMLP", "Gemma2MLP", "Gemma3MLP")
# Hugging Face's tanh-approximated GELUs (``gelu_pytorch_tanh``, ``gelu_new``): the GeGLU epilogue's.
_TANH_GELUS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation")
_SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _norm_reason(name, n):
    if type(n).__name__ not in NORMS or getattr(n, "weight", None) is None or llama.rms_eps(n) is None:
        return f"{name} is not a (1 + w) RMSNorm of {NORMS} with weight and eps"
    return None


def _sandwich(layer):
    return all(getattr(layer, n, None) is not None for n in _SANDWICH)


def check(layer):
    attn = getattr(layer, "self_attn", None)
    parts = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or not all(type(lora.base(getattr(attn, p, None))) is nn.Linear for p in parts):
        return "self_attn's q_proj/k_proj/v_proj/o_proj are not all torch.nn.Linear"
    norms = ("input_layernorm", "post_attention_layernorm")
    if any(hasattr(layer, n) for n in _SANDWICH):
        norms += _SANDWICH
    for name in norms:
        why = _norm_reason(name, getattr(layer, name, None))
        if why is not None:
            return why
    if not hasattr(layer, "mlp") or not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
        return "missing mlp, head_dim or scaling"
    if getattr(attn, "is_causal", True) is not True:
        return "bidirectional attention (use_bidirectional_attention)"
    qk = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    if any(n is not None for n in qk):
        for name, n in zip(("self_attn.q_norm", "self_attn.k_norm"), qk):
            why = _norm_reason(name, n)
            if why is not None or tuple(n.weight.shape) != (attn.head_dim,):
                return why or f"{name} is not a per-head norm of head_dim {attn.head_dim}"
        if llama.rms_eps(qk[0]) != llama.rms_eps(qk[1]):
            return "q_norm and k_norm have different eps"
    return None


def softcap(attn):
    """The attention logits' softcap the original applies: ``attn_logit_softcapping`` where the
    attention's forward passes it to the attention function (Gemma 2's), None where it does not
    (Gemma 3 keeps the config's value without using it), ``False`` where its source cannot be
    read to tell (the layer then runs its original forward)."""
    value = getattr(attn, "attn_logit_softcapping", None)
    if value is None:
        return None
    kind = type(attn)
    used = _SOFTCAP_USED.get(kind)
    if used is None:
        try:
            src = inspect.getsource(kind.forward)
        except (OSError, TypeError):
            return False
        used = _SOFTCAP_USED[kind] = re.search(r"softcap\s*=\s*self\.attn_logit_softcapping", src) is not None
    return value if used else None


_SOFTCAP_USED = {}  # attention class -> whether its forward passes attn_logit_softcapping on


def check_call(layer, call):
    attn = layer.self_attn
    hidden = call["hidden_states"]
    if call.get("position_embeddings") is None and llama.rotary_positions(layer, call, *hidden.shape[:2]) is None:
        return "no position_embeddings (and no model-level rotary module with position_ids)"
    cap = softcap(attn)
    if cap is False:
        return "attn_logit_softcapping set, and the attention's source, which tells whether it applies it, unreadable"
    if cap is not None and not kernel_head_dim(attn.head_dim, hidden.dtype):
        return f"head dim {attn.head_dim} in {hidden.dtype} (outside the attention kernel's range; the softcap needs it)"
    return (implementation_reason(attn.config)
            or mask_reason(call.get("attention_mask"), hidden.shape[1], True, mask_convention(attn.config)))


def geglu_reason(mlp_mod):
    """Why the layer's MLP cannot run as ``geglu`` (None if it can)."""
    kind = type(mlp_mod)
    if kind.__name__ not in MLPS or not kind.__module__.startswith("transformers.models."):
        return f"{kind.__name__} is not one of the gated MLPs {MLPS}"
    act = type(getattr(mlp_mod, "act_fn", None)).__name__
    if act not in _TANH_GELUS:
        return f"act_fn {act} (the fused GeGLU gates with the tanh GELU)"
    if not all(type(lora.base(getattr(mlp_mod, n, None))) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")):
        return "gate_proj, up_proj and down_proj are not all torch.nn.Linear"
    return None


def _returns_hidden_states(forward):
    """The forward's last statement is ``return hidden_states`` (a tensor)."""
    try:
        src = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return re.search(r"\n\s*return hidden_states\s*$", src.rstrip()) is not None


def prepare(layer):
    state = layer._fused_block
    if state.returns_tensor is False and _returns_hidden_states(state.original):
        # transformers 5's Gemma3DecoderLayer is annotated "-> tuple[...]" but returns the tensor.
        state.returns_tensor = True
    reason = geglu_reason(layer.mlp)
    layer._fused_block.fused_mlp = reason is None
    if reason is not None:
        warn_once(("mlp", type(layer).__name__, reason),
                  f"{type(layer).__name__}'s MLP runs Hugging Face's module (unfused): {reason}")


def _norm(x, residual, norm):
    return add_rms_norm(x, residual, norm.weight, llama.rms_eps(norm), unit_offset=True)


def _mlp(layer, x, residual):
    """The MLP of ``x`` (+ ``residual`` in the down projection's epilogue)."""
    m = layer.mlp
    if not layer._fused_block.fused_mlp:
        out = m(x)
        return out if residual is None else residual + out
    if any(lora.is_lora(t) for t in (m.gate_proj, m.up_proj, m.down_proj)):
        # Two GEMMs, the hidden activation between them (down_proj's adapters read it).
        hid = gated_linear(x, m.gate_proj.weight, m.up_proj.weight, m.gate_proj.bias, m.up_proj.bias,
                           lora=lora.gate_up(m.gate_proj, m.up_proj, x), activation="geglu")
        return linear(hid, m.down_proj.weight, m.down_proj.bias, None, residual, lora=lora.terms(m.down_proj, hid))
    return geglu(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, residual, b_gate=m.gate_proj.bias,
                 b_up=m.up_proj.bias, b_down=m.down_proj.bias)


def run(layer, call, x):
    attn, state = layer.self_attn, layer._fused_block
    D = attn.head_dim
    H = attn.q_proj.out_features // D
    Hkv = attn.k_proj.out_features // D
    n1, _ = _norm(x, None, layer.input_layernorm)
    b = packed_bias(state, "qkv_bias", (attn.q_proj, attn.k_proj, attn.v_proj))
    qkv_lora = lora.stacked([(attn.q_proj, H * D), (attn.k_proj, Hkv * D), (attn.v_proj, Hkv * D)], n1)
    qkv = packed_linear(state, "qkv_weight", n1, (attn.q_proj, attn.k_proj, attn.v_proj), b,
                        lora=qkv_lora)  # (B, L, (H + 2 Hkv) D): one GEMM
    qkv = llama.rope(layer, qkv, H, Hkv, call, unit_offset=True)  # Gemma 3: (1 + w) q/k norms in the launch
    p = attn.attention_dropout if attn.training else 0.0
    o = self_attention(qkv, H, Hkv, kv_cache(call), attn.layer_idx, call.get("attention_mask"), True,
                       mask_convention(attn.config), attn.scaling, p, type(layer).__name__, softcap=softcap(attn),
                       sliding_window=getattr(attn, "sliding_window", None), packing=call)
    o = linear(o, attn.o_proj.weight, attn.o_proj.bias, lora=lora.terms(attn.o_proj, o))
    if not _sandwich(layer):  # Gemma 1: h = x + o, normalized in the same launch
        n2, h = _norm(_like(o, x), x, layer.post_attention_layernorm)
        return _mlp(layer, n2, h)
    post, _ = _norm(o, None, layer.post_attention_layernorm)
    n2, h = _norm(_like(post, x), x, layer.pre_feedforward_layernorm)  # h = x + post_attention_layernorm(o)
    f, _ = _norm(_mlp(layer, n2, None), None, layer.post_feedforward_layernorm)
    return h + f


def tree(layer):
    """The LLaMA family's tree, with Gemma 2/3's sandwich norms."""
    tree = llama.tree(layer)
    if _sandwich(layer):
        tree.update((n, SAME) for n in _SANDWICH)
    return tree


FAMILY = Family(check, check_call, run, tree, prepare=prepare, rotaries=ROTARIES, lora_paths=llama.lora_paths,
                called=lambda layer: () if layer._fused_block.fused_mlp else ("mlp",))
