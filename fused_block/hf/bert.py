"""BERT: ``BertLayer`` (the Post-LN encoder).

One QKV GEMM, the attention kernel with the padding mask, then the two Post-LN
``add_layer_norm`` with the dense outputs' dropout fused, and ``mlp`` for the FFN.
"""
from torch import nn

from fused_block import lora
from fused_block.blocks import _like
from fused_block.hf._attention import implementation_reason, mask_convention, mask_reason, self_attention
from fused_block.hf._core import ACTIVATIONS, SAME, Family, packed_bias, packed_linear
from fused_block.linear import linear, mlp
from fused_block.norm import add_layer_norm_as_torch

_LINEAR, _DROPOUT, _LAYER_NORM = (nn.Linear,), (nn.Dropout,), (nn.LayerNorm,)


def check(layer):
    attn = getattr(getattr(layer, "attention", None), "self", None)
    if attn is None or not all(type(lora.base(getattr(attn, p, None))) is nn.Linear for p in ("query", "key", "value")):
        return "attention.self's query/key/value are not all torch.nn.Linear"
    if getattr(layer, "is_decoder", False) or getattr(layer, "add_cross_attention", False):
        return "BERT as a decoder (causal self-attention, cross-attention) is not converted"
    act = getattr(attn.config, "hidden_act", None)
    if not isinstance(act, str) or act not in ACTIVATIONS:
        return f"hidden_act {act!r} has no fused epilogue"
    if getattr(attn, "position_embedding_type", "absolute") != "absolute":
        return "relative position embeddings in the attention scores"
    return None


def check_call(layer, call):
    s = layer.attention.self
    L = call["hidden_states"].shape[1]
    return (implementation_reason(s.config)
            or mask_reason(call.get("attention_mask"), L, False, mask_convention(s.config)))


def run(layer, call, x):
    s, so, inter, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
    H = s.num_attention_heads
    D = s.attention_head_size
    state = layer._fused_block
    b = packed_bias(state, "qkv_bias", (s.query, s.key, s.value))
    scale = float(getattr(s, "scaling", D ** -0.5))
    qkv_lora = lora.stacked([(s.query, s.query.out_features), (s.key, s.key.out_features),
                             (s.value, s.value.out_features)], x)  # PEFT LoRA: fused_block.lora
    qkv = packed_linear(state, "qkv_weight", x, (s.query, s.key, s.value), b, lora=qkv_lora)
    # Each dropout on by the flag the original reads: the attention module's own for the
    # attention's (BertSelfAttention: ``0.0 if not self.training else self.dropout.p``), the
    # output nn.Dropout modules' own.
    o = self_attention(qkv, H, H, None, None, call.get("attention_mask"), False,
                       mask_convention(s.config), scale, s.dropout.p if s.training else 0.0, "BertLayer",
                       packing=call)
    a = linear(o, so.dense.weight, so.dense.bias, lora=lora.terms(so.dense, o))
    p1 = so.dropout.p if so.dropout.training else 0.0
    # Post-LN: the norms' outputs are the stream, fp32 under CUDA's autocast as torch's LayerNorm gives
    h, _ = add_layer_norm_as_torch(_like(a, x), x, so.LayerNorm.weight, so.LayerNorm.bias, so.LayerNorm.eps, p1)
    act = ACTIVATIONS[s.config.hidden_act]
    if lora.is_lora(inter.dense) or lora.is_lora(out.dense):  # two GEMMs, the hidden activation between
        hid = linear(h, inter.dense.weight, inter.dense.bias, act, lora=lora.terms(inter.dense, h))
        f = linear(hid, out.dense.weight, out.dense.bias, lora=lora.terms(out.dense, hid))
    else:
        f = mlp(h, inter.dense.weight, inter.dense.bias, out.dense.weight, out.dense.bias, act)
    p2 = out.dropout.p if out.dropout.training else 0.0
    y, _ = add_layer_norm_as_torch(_like(f, h), h, out.LayerNorm.weight, out.LayerNorm.bias, out.LayerNorm.eps, p2)
    return y


def tree(layer):
    tree = {"attention": SAME, "attention.self": SAME, "attention.self.dropout": _DROPOUT,
            "attention.output": SAME, "intermediate": SAME, "intermediate.intermediate_act_fn": SAME,
            "output": SAME}
    tree.update((f"attention.self.{p}", _LINEAR) for p in ("query", "key", "value"))
    for part in ("attention.output", "output"):
        tree.update({f"{part}.dense": _LINEAR, f"{part}.LayerNorm": _LAYER_NORM, f"{part}.dropout": _DROPOUT})
    tree["intermediate.dense"] = _LINEAR
    return tree


FAMILY = Family(check, check_call, run, tree, lora_paths=lambda layer: (
    "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
    "intermediate.dense", "output.dense"))
