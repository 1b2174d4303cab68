"""LLaMA family: ``LlamaDecoderLayer``, ``MistralDecoderLayer``, ``Qwen2DecoderLayer``,
``Qwen3DecoderLayer``.

Pre-RMSNorm, RoPE, GQA, gated MLP; Qwen3 adds an RMSNorm of each q and k head before RoPE
(``q_norm``/``k_norm``), which runs inside the RoPE launch (``rope_qkvpacked``'s
``q_norm_weight``/``k_norm_weight``: fp32 statistics, one rounding per element).
``add_rms_norm`` for both norms (the attention's residual add fused into the second), one QKV
GEMM (q/k/v weights concatenated, the copy cached while the weights do not change and no
gradient is taken), ``rope_qkvpacked`` on the packed QKV output (q and k rotated, v copied, one
launch; angles in fp32 from ``position_ids`` and the model's rotary
``inv_freq``/``attention_scaling``, else from the layer's ``position_embeddings``), the KV
cache's ``update``, the attention kernel (GQA, bottom-right causal for decoding with a cache,
key padding), the output GEMM, and the SiLU-gated MLP as ``swiglu`` (gate and up in one GEMM
with the SiLU-multiply in its epilogue, the weights read in place; the residual add in the down
projection's epilogue). An MLP with another ``hidden_act`` runs Hugging Face's module.
"""
import contextlib

import torch
from torch import nn

from fused_block import lora
from fused_block.blocks import _TP, _TP_RUN, _like
from fused_block.hf._attention import (implementation_reason, mask_convention, mask_reason,
                                       self_attention)
from fused_block.hf._core import SAME, Family, cached, kv_cache, packed_bias, packed_linear, warn_once
from fused_block.linear import gated_linear, linear, swiglu
from fused_block.norm import add_rms_norm
from fused_block.rope import rope_qkvpacked

CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROTARIES = ("LlamaRotaryEmbedding", "MistralRotaryEmbedding", "Qwen2RotaryEmbedding", "Qwen3RotaryEmbedding")
# Their MLPs: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; SwiGLU when act_fn is SiLU.
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
# Per-head norms of q and k (over head_dim, before RoPE): x / sqrt(mean(x^2) + eps) * weight.
QK_NORMS = ("Qwen3RMSNorm",)
_SILU = ("silu", "swish")
_LINEAR = (nn.Linear,)


def rms_eps(norm):
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    return None


def check(layer):
    attn = getattr(layer, "self_attn", None)
    parts = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or not all(type(lora.base(getattr(attn, p, None))) is nn.Linear for p in parts):
        return "self_attn's q_proj/k_proj/v_proj/o_proj are not all torch.nn.Linear"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        n = getattr(layer, norm, None)
        if n is None or not hasattr(n, "weight") or rms_eps(n) is None:
            return f"{norm} is not an RMSNorm with weight and eps"
    if not hasattr(layer, "mlp") or not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
        return "missing mlp, head_dim or scaling"
    norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    if any(n is not None for n in norms):
        if not all(type(n).__name__ in QK_NORMS and rms_eps(n) is not None and getattr(n, "weight", None) is not None
                   and tuple(n.weight.shape) == (attn.head_dim,) for n in norms):
            return f"self_attn's q_norm/k_norm are not both a per-head RMSNorm of {QK_NORMS}"
        if rms_eps(norms[0]) != rms_eps(norms[1]):
            return "q_norm and k_norm have different eps"
    return None


# Attention classes whose forward passes ``config.sliding_window`` to the attention function.
CONFIG_WINDOWS = ("MistralAttention", "Phi3Attention")


def sliding_window(attn):
    """The window the original attention applies: Qwen2/Qwen3's per-layer ``sliding_window``
    (None on full layers), Mistral's and Phi-3's ``config.sliding_window``; LLaMA's none (its
    attention never reads a ``sliding_window`` its config may carry, e.g. a llamafied Qwen's)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(attn.config, "sliding_window", None) if type(attn).__name__ in CONFIG_WINDOWS else None


def check_call(layer, call):
    attn = layer.self_attn
    hidden = call["hidden_states"]
    B, L = hidden.shape[:2]
    plan = layer.__dict__.get(_TP)
    if plan is not None:  # sequence parallel: hidden holds this rank's part of the sequence
        L = plan.whole_length(L)
    if call.get("position_embeddings") is None and rotary_positions(layer, call, B, L) is None:
        return "no position_embeddings (and no model-level rotary module with position_ids)"
    return implementation_reason(attn.config) or mask_reason(call.get("attention_mask"), L, True,
                                                             mask_convention(attn.config))


def rotary_positions(layer, call, B, L):
    """``(position_ids (B or 1, L), the rotary module)`` when the model has one standard rotary
    module that is what the model calls (``_core._Rotary.current``), else None."""
    positions = call.get("position_ids")
    rotary = layer._fused_block.rotary
    if rotary is not None and isinstance(positions, torch.Tensor) and positions.dim() == 2 \
            and positions.shape[0] in (1, B) and positions.shape[1] == L:
        module = rotary.current()
        if module is not None:
            return positions, module
    return None


def rope(layer, qkv, H, Hkv, call, unit_offset=False, half_tables=False):
    """RoPE on the packed QKV output: fp32 angles from position_ids and the rotary module's
    inv_freq when the model has one standard rotary module, else HF's cos/sin tables; with
    the attention's q_norm/k_norm (Qwen3; Gemma 3's with ``unit_offset``: 1 + w) each q and k
    head normalized first, in the launch. ``half_tables``: the model's tables hold each
    frequency once, (B, L, D_rot / 2) (gpt-oss's), not twice as LLaMA's."""
    B, L = qkv.shape[:2]
    attn = layer.self_attn
    norms = {}
    if getattr(attn, "q_norm", None) is not None:
        norms = dict(q_norm_weight=attn.q_norm.weight, k_norm_weight=attn.k_norm.weight, norm_eps=rms_eps(attn.q_norm),
                     norm_unit_offset=unit_offset)
    found = rotary_positions(layer, call, B, L)
    if found is not None:
        positions, rotary = found
        state = layer._fused_block
        # The model's frequencies as its rotary module uses them (rounded if the model was cast),
        # in fp32 on qkv's device: a conversion kernel once, not per call.
        inv_freq = cached(state, ("inv_freq", qkv.device), (rotary.inv_freq,),
                          lambda t: t[0].to(device=qkv.device, dtype=torch.float32))
        return rope_qkvpacked(qkv, H, Hkv, positions, inv_freq, scale=float(rotary.attention_scaling), **norms)
    cos, sin = call["position_embeddings"]
    if half_tables:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return rope_qkvpacked(qkv, H, Hkv, cos=cos.expand(B, -1, -1) if cos.shape[0] != B else cos,
                          sin=sin.expand(B, -1, -1) if sin.shape[0] != B else sin, **norms)


def swiglu_reason(mlp_mod):
    """Why the layer's MLP cannot run as ``swiglu`` (None if it can)."""
    kind = type(mlp_mod)
    if kind.__name__ not in GATED_MLPS or not kind.__module__.startswith("transformers.models."):
        return f"{kind.__name__} is not one of the gated MLPs {GATED_MLPS}"
    act = getattr(getattr(mlp_mod, "config", None), "hidden_act", None)
    if act not in _SILU or type(getattr(mlp_mod, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return f"hidden_act {act!r} (the fused SwiGLU gates with SiLU)"
    if not all(type(lora.base(getattr(mlp_mod, n, None))) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")):
        return "gate_proj, up_proj and down_proj are not all torch.nn.Linear"
    return None


def prepare(layer):
    reason = swiglu_reason(layer.mlp)
    layer._fused_block.fused_mlp = reason is None
    if reason is not None:
        warn_once(("mlp", type(layer).__name__, reason),
                  f"{type(layer).__name__}'s MLP runs Hugging Face's module (unfused): {reason}")


_NO_SHIFT = contextlib.nullcontext()


def attention_sublayer(layer, call, n1, tp=None, sinks=None, half_tables=False):
    """``self_attn`` on its normalized input ``n1``: one QKV GEMM, ``rope_qkvpacked``, the KV
    cache, the attention kernel (the layer's sliding window; ``sinks``: gpt-oss's), o_proj;
    returns o_proj's output (this rank's partial sums when tensor parallel: ``tp``)."""
    attn, state = layer.self_attn, layer._fused_block
    D = attn.head_dim
    # int(): torch.jit.trace records sizes as tensors; these are the weights' (fixed) shapes.
    H = int(attn.q_proj.weight.shape[0]) // D  # this rank's heads when tensor parallel
    Hkv = int(attn.k_proj.weight.shape[0]) // D
    b = packed_bias(state, "qkv_bias", (attn.q_proj, attn.k_proj, attn.v_proj))
    # PEFT LoRA wrappers (their .weight/.bias are the base layer's): the adapters' updates go
    # into the same GEMMs (fused_block.lora), q/k/v's stacked into the QKV GEMM's.
    qkv_lora = lora.stacked([(attn.q_proj, H * D), (attn.k_proj, Hkv * D), (attn.v_proj, Hkv * D)], n1)
    qkv = packed_linear(state, "qkv_weight", n1 if tp is None else tp.enter(n1),  # (B, L, (H + 2 Hkv) D): one GEMM
                        (attn.q_proj, attn.k_proj, attn.v_proj), b, lora=qkv_lora)
    qkv = rope(layer, qkv, H, Hkv, call, half_tables=half_tables)  # q, k rotated and v copied: one packed tensor
    p = attn.attention_dropout if attn.training else 0.0
    with _NO_SHIFT if tp is None or p == 0 else tp.seeds([tp.rank]):  # each rank's heads, their own masks
        o = self_attention(qkv, H, Hkv, kv_cache(call), attn.layer_idx, call.get("attention_mask"), True,
                           mask_convention(attn.config), attn.scaling, p, type(layer).__name__,
                           sliding_window=sliding_window(attn), sinks=sinks, packing=call)
    return linear(o, attn.o_proj.weight, attn.o_proj.bias, lora=lora.terms(attn.o_proj, o))


def run(layer, call, x):
    """The fused layer. Tensor parallel (``fused_block.distributed``), the projections hold this
    rank's heads and MLP columns: the norms' outputs enter whole (all-gathered along the
    sequence under sequence parallelism), o_proj's and down_proj's partial sums leave reduced,
    and the residual is added after the MLP's reduction (no LoRA there: LayerParallel refuses it)."""
    state = layer._fused_block
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    tp = layer.__dict__.get(_TP_RUN)
    n1, _ = add_rms_norm(x, None, ln1.weight, rms_eps(ln1))
    o = attention_sublayer(layer, call, n1, tp)
    n2, h = add_rms_norm(_like(o if tp is None else tp.leave(o), x), x, ln2.weight, rms_eps(ln2))
    m = layer.mlp
    if tp is not None:
        f = layer.mlp(tp.enter(n2)) if not state.fused_mlp else \
            swiglu(tp.enter(n2), m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, b_gate=m.gate_proj.bias,
                   b_up=m.up_proj.bias, b_down=m.down_proj.bias)
        return tp.leave(f) + h
    if not state.fused_mlp:
        return h + layer.mlp(n2)
    if any(lora.is_lora(t) for t in (m.gate_proj, m.up_proj, m.down_proj)):
        # Two GEMMs, the hidden activation between them (down_proj's adapters read it).
        hid = gated_linear(n2, m.gate_proj.weight, m.up_proj.weight, m.gate_proj.bias, m.up_proj.bias,
                           lora=lora.gate_up(m.gate_proj, m.up_proj, n2))
        return linear(hid, m.down_proj.weight, m.down_proj.bias, None, h, lora=lora.terms(m.down_proj, hid))
    return swiglu(n2, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, h, b_gate=m.gate_proj.bias,
                  b_up=m.up_proj.bias, b_down=m.down_proj.bias)


def tree(layer):
    tree = {"self_attn": SAME, "input_layernorm": SAME, "post_attention_layernorm": SAME}
    tree.update((f"self_attn.{p}_proj", _LINEAR) for p in "qkvo")
    if getattr(layer.self_attn, "q_norm", None) is not None:
        tree.update({"self_attn.q_norm": SAME, "self_attn.k_norm": SAME})
    if layer._fused_block.fused_mlp:
        tree.update({"mlp": SAME, "mlp.act_fn": SAME})
        tree.update((f"mlp.{p}_proj", _LINEAR) for p in ("gate", "up", "down"))
    return tree


def lora_paths(layer):
    attn = tuple(f"self_attn.{p}_proj" for p in "qkvo")
    return attn + (tuple(f"mlp.{p}_proj" for p in ("gate", "up", "down")) if layer._fused_block.fused_mlp else ())


FAMILY = Family(check, check_call, run, tree, prepare=prepare, rotaries=ROTARIES, lora_paths=lora_paths,
                called=lambda layer: () if layer._fused_block.fused_mlp else ("mlp",))
