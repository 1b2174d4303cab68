"""BLOOM: ``BloomBlock``.

Pre-LN (``apply_residual_connection_post_layernorm``: the residuals are the norms' outputs),
``add_layer_norm`` for both LayerNorms (the attention's residual add and its dropout fused into
the second), the fused ``query_key_value`` GEMM, whose output holds each head's q, k and v in
turn ([h0: q, k, v; h1: q, k, v; ...]): q, k and v are views of it, as BLOOM's ``_reshape``
takes them (no reorder, no copy), the KV cache's ``update``, the attention kernel with ALiBi,
the ``dense`` GEMM, and the MLP as ``mlp`` (``bloom_gelu``, the tanh approximation: the
``gelu_tanh`` epilogue, whose sqrt(2/pi) BLOOM rounds to 0.79788456, 1e-9 apart; the output
dropout and the residual add in the second GEMM's epilogue).

ALiBi: the model's ``alibi`` tensor (B * H, 1, Lk), ``slope * (position of key j)`` with the
positions counted over the attention mask (``cumsum(mask) - 1``), goes to the kernel's additive
``bias`` input as it is (B, H, 1, Lk), broadcast over the queries: BLOOM's scores exactly,
padding of any layout included, in the model's dtype as BLOOM rounds it.
``pretraining_tp > 1`` with ``slow_but_exact`` (a sliced summation order) runs the original.
"""
from torch import nn

from fused_block import lora
from fused_block.blocks import _like
from fused_block.hf._attention import attend, kernel_head_dim, mask_reason, plan
from fused_block.hf._core import SAME, Family, kv_cache
from fused_block.linear import linear, mlp
from fused_block.norm import add_layer_norm, add_layer_norm_as_torch

CAUSAL_LMS = ("BloomForCausalLM",)
_LINEAR, _NORM, _DROPOUT = (nn.Linear,), (nn.LayerNorm,), (nn.Dropout,)
# BLOOM's attention is its own (eager) code on the model's 4-D masks (its modules hold no config).
_CONVENTION = "sdpa"
_LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def check(block):
    attn, m = getattr(block, "self_attention", None), getattr(block, "mlp", None)
    if attn is None or m is None:
        return "not a BLOOM block (self_attention, mlp)"
    for path in _LINEARS:
        try:
            linear_mod = lora.base(block.get_submodule(path))
        except AttributeError:
            linear_mod = None
        if type(linear_mod) is not nn.Linear:
            return f"{path} is not a torch.nn.Linear"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if type(getattr(block, name, None)) is not nn.LayerNorm:
            return f"{name} is not a torch.nn.LayerNorm"
    if type(getattr(attn, "attention_dropout", None)) is not nn.Dropout:
        return "self_attention.attention_dropout is not a torch.nn.Dropout"
    if type(getattr(m, "gelu_impl", None)).__name__ != "BloomGelu":
        return "mlp.gelu_impl is not BloomGelu (the tanh GELU)"
    if not all(hasattr(attn, a) for a in ("num_heads", "head_dim", "inv_norm_factor", "beta", "hidden_dropout")):
        return "self_attention lacks num_heads, head_dim, inv_norm_factor, beta or hidden_dropout"
    if attn.beta != 1.0:
        return f"self_attention.beta {attn.beta} (the ALiBi tensor scaled)"
    if getattr(attn, "pretraining_tp", 1) > 1 and getattr(attn, "slow_but_exact", False):
        return "pretraining_tp > 1 with slow_but_exact (a sliced summation of the projections)"
    return None


def check_call(block, call):
    attn, hidden = block.self_attention, call["hidden_states"]
    B, L = hidden.shape[:2]
    alibi, mask = call.get("alibi"), call.get("attention_mask")
    if not (hasattr(alibi, "dim") and alibi.dim() == 3 and alibi.shape[:2] == (B * attn.num_heads, 1)
            and alibi.is_floating_point()):
        return "an alibi tensor that is not (batch * heads, 1, keys) floats"
    if not kernel_head_dim(attn.head_dim, hidden.dtype):
        return f"head dim {attn.head_dim} in {hidden.dtype} (outside the attention kernel's range; ALiBi needs it)"
    if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (1, B)):
        return f"an attention mask of shape {tuple(mask.shape)} for a batch of {B}"
    return mask_reason(mask, L, True, _CONVENTION)


def run(block, call, x):
    attn, m = block.self_attention, block.mlp
    ln1, ln2 = block.input_layernorm, block.post_attention_layernorm
    post = block.apply_residual_connection_post_layernorm
    B, L, _ = x.shape
    H, D = attn.num_heads, attn.head_dim
    # With post, the norms' outputs are the residuals: torch's LayerNorm's (fp32 under CUDA's autocast).
    norm = add_layer_norm_as_torch if post else add_layer_norm
    n1, _ = norm(x, None, ln1.weight, ln1.bias, ln1.eps)
    qkv = linear(n1, attn.query_key_value.weight, attn.query_key_value.bias,
                 lora=lora.terms(attn.query_key_value, n1))  # (B, L, H * 3 * D): each head's q, k, v
    heads = qkv.view(B, L, H, 3, D)
    q, k, v = (heads[:, :, :, i].transpose(1, 2) for i in range(3))  # (B, H, L, D) views
    cache = kv_cache(call)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    Lk = k.shape[2]
    alibi = call["alibi"].view(B, H, 1, -1)  # slope * key position, broadcast over the queries
    p = plan(call.get("attention_mask"), B, L, Lk, True, _CONVENTION)
    # Each dropout on by the flag the original reads: the attention_dropout module's own, and
    # BloomAttention's and BloomMLP's for their dropout_add.
    d = attn.attention_dropout
    o = attend(q, k, v, p, attn.inv_norm_factor, d.p if d.training else 0.0, "BloomBlock",
               position_bias=alibi)
    o = o.transpose(1, 2).reshape(B, L, H * D)
    o = linear(o, attn.dense.weight, attn.dense.bias, lora=lora.terms(attn.dense, o))
    p_attn = attn.hidden_dropout if attn.training else 0.0
    # h = residual + dropout(o), normalized in the same launch
    n2, h = norm(_like(o, x), n1 if post else x, ln2.weight, ln2.bias, ln2.eps, p_attn)
    residual = n2 if post else h
    p_mlp = m.hidden_dropout if m.training else 0.0
    up, down = m.dense_h_to_4h, m.dense_4h_to_h
    if lora.is_lora(up) or lora.is_lora(down):  # two GEMMs, the hidden activation between
        hid = linear(n2, up.weight, up.bias, "gelu_tanh", lora=lora.terms(up, n2))
        return linear(hid, down.weight, down.bias, None, residual, p_mlp, lora=lora.terms(down, hid))
    return mlp(n2, up.weight, up.bias, down.weight, down.bias, "gelu_tanh", residual, 0.0, p_mlp)


def tree(block):
    tree = {"input_layernorm": _NORM, "post_attention_layernorm": _NORM, "self_attention": SAME,
            "self_attention.attention_dropout": _DROPOUT, "mlp": SAME, "mlp.gelu_impl": SAME}
    tree.update((path, _LINEAR) for path in _LINEARS)
    return tree


FAMILY = Family(check, check_call, run, tree, lora_paths=lambda block: _LINEARS, returns_tensor=False)
