"""GPT-2: ``GPT2Block``.

Pre-LN, Conv1D weights, fused ``c_attn``, tanh GELU. ``add_layer_norm`` for ``ln_1`` and
``ln_2`` (the attention residual and its dropout fused), ``linear`` on the Conv1D weights as
transposed views (no copies), the attention kernel, ``mlp`` with tanh GELU, the output dropout
and the residual in its epilogues.
"""
from torch import nn

from fused_block import lora
from fused_block.blocks import _like
from fused_block.hf._attention import implementation_reason, mask_convention, mask_reason, self_attention
from fused_block.hf._core import ACTIVATIONS, SAME, Family, kv_cache
from fused_block.linear import linear, mlp
from fused_block.norm import add_layer_norm

CAUSAL_LMS = ("GPT2LMHeadModel",)


def check(block):
    attn, mlp_mod = getattr(block, "attn", None), getattr(block, "mlp", None)
    if attn is None or mlp_mod is None or getattr(attn, "is_cross_attention", False):
        return "not a GPT-2 self-attention block"
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        try:
            conv = lora.base(block.get_submodule(name))
        except AttributeError:
            conv = None
        if type(conv).__name__ != "Conv1D" or type(conv).__module__ != "transformers.pytorch_utils":
            return f"{name} is not transformers' Conv1D"
    act = getattr(attn.config, "activation_function", None)
    if act not in ACTIVATIONS:
        return f"activation_function {act!r} has no fused epilogue"
    return None


def _scale(attn):
    scaling = getattr(attn, "scaling", None)
    if scaling is not None:
        return float(scaling)
    scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
    return scale / (attn.layer_idx + 1) if attn.scale_attn_by_inverse_layer_idx else scale


def check_call(block, call):
    cfg = block.attn.config
    return (implementation_reason(cfg)
            or mask_reason(call.get("attention_mask"), call["hidden_states"].shape[1], True, mask_convention(cfg)))


def _attn_dropout(attn):
    """GPT2Attention's dropout probability: on by the attention module's own training flag (the
    attention interface's and eager's), or by ``attn_dropout``'s where eager's
    ``reorder_and_upcast_attn`` calls that module."""
    d = attn.attn_dropout
    on = d.training if attn.reorder_and_upcast_attn and attn.config._attn_implementation == "eager" else attn.training
    return d.p if on else 0.0


def run(block, call, x):
    attn, m = block.attn, block.mlp
    H = attn.num_heads
    # Each dropout on by the flag the original reads: the nn.Dropout modules' own, the attention's.
    d = attn.resid_dropout
    p_resid = d.p if d.training else 0.0
    n1, _ = add_layer_norm(x, None, block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
    # Conv1D stores (in, out): its transpose is nn.Linear's layout as a view, no copy.
    # (PEFT LoRA wrappers of the Conv1Ds: their .weight and .bias are the base layer's; the
    # adapters' updates go into the same GEMMs, fused_block.lora.)
    qkv = linear(n1, attn.c_attn.weight.t(), attn.c_attn.bias, lora=lora.terms(attn.c_attn, n1))  # [q; k; v]
    o = self_attention(qkv, H, H, kv_cache(call), attn.layer_idx, call.get("attention_mask"), True,
                       mask_convention(attn.config), _scale(attn), _attn_dropout(attn),
                       "GPT2Block", packing=call)
    o = linear(o, attn.c_proj.weight.t(), attn.c_proj.bias, lora=lora.terms(attn.c_proj, o))
    n2, h = add_layer_norm(_like(o, x), x, block.ln_2.weight, block.ln_2.bias, block.ln_2.eps, p_resid)
    act = ACTIVATIONS[attn.config.activation_function]
    p_mlp = m.dropout.p if m.dropout.training else 0.0
    if lora.is_lora(m.c_fc) or lora.is_lora(m.c_proj):  # two GEMMs, the hidden activation between
        hid = linear(n2, m.c_fc.weight.t(), m.c_fc.bias, act, lora=lora.terms(m.c_fc, n2))
        return linear(hid, m.c_proj.weight.t(), m.c_proj.bias, None, h, p_mlp, lora=lora.terms(m.c_proj, hid))
    return mlp(n2, m.c_fc.weight.t(), m.c_fc.bias, m.c_proj.weight.t(), m.c_proj.bias, act, h, 0.0, p_mlp)


def tree(block):
    return {"ln_1": (nn.LayerNorm,), "ln_2": (nn.LayerNorm,), "attn": SAME, "attn.c_attn": SAME,
            "attn.c_proj": SAME, "attn.attn_dropout": (nn.Dropout,), "attn.resid_dropout": (nn.Dropout,),
            "mlp": SAME, "mlp.c_fc": SAME, "mlp.c_proj": SAME, "mlp.act": SAME, "mlp.dropout": (nn.Dropout,)}


FAMILY = Family(check, check_call, run, tree,
                lora_paths=lambda block: ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
