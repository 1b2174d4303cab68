"""gpt-oss: ``GptOssDecoderLayer``.

The LLaMA family's attention sublayer (:func:`fused_block.hf.llama.attention_sublayer`: one QKV
GEMM with the q/k/v biases, ``rope_qkvpacked`` on the packed output, the KV cache, the attention
kernel with GQA, o_proj with its bias) with gpt-oss's parts:

- RoPE: ``GptOssRotaryEmbedding`` (YaRN by default) keeps ``inv_freq`` and
  ``attention_scaling`` as LLaMA's does; the kernel takes fp32 angles from ``position_ids`` and
  those, the rotation of the two halves of each head (``_apply_rotary_emb``). Without a
  standard rotary module the layer's ``position_embeddings`` tables are read (gpt-oss's hold
  each frequency once, (B, L, D / 2)).
- Attention sinks: the learnable logit per head (``self_attn.sinks``) joins each row's
  softmax denominator in the kernel (``sinks=``), which computes its gradient.
- Alternating layers: ``layer_types`` "sliding_attention" layers (``self_attn.sliding_window``
  = w: a query sees itself and the w - 1 keys before it, ``masking_utils``'s
  ``kv_idx > q_idx - w``) run the kernel's ``window=(w - 1, 0)``; "full_attention" layers no
  window.
- Both RMSNorms (``GptOssRMSNorm``: fp32 statistics, ``(weight * x).to(dtype)``, the weights
  kept in fp32 by ``from_pretrained``) through ``add_rms_norm``, the attention's residual add
  fused into the second norm.
- The MoE MLP (``GptOssMLP``: the top-k router and the experts) is Hugging Face's module,
  called as the original calls it (its hooks, output recorders and expert implementation
  included); only its residual add is a plain add.

Sinks have no SDPA fallback: a head dim outside the kernel's range, or a mask the kernel does
not read, runs the layer's original forward (a one-time warning).
"""
import torch

from fused_block.blocks import _like
from fused_block.hf import llama
from fused_block.hf._attention import kernel_head_dim
from fused_block.hf._core import Family
from fused_block.norm import add_rms_norm

CAUSAL_LMS = ("GptOssForCausalLM",)
ROTARIES = ("GptOssRotaryEmbedding",)


def check(layer):
    why = llama.check(layer)
    if why is not None:
        return why
    attn = layer.self_attn
    sinks = getattr(attn, "sinks", None)
    H = attn.q_proj.out_features // attn.head_dim
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (H,):
        return f"self_attn.sinks is not a ({H},) tensor (one sink per head)"
    if getattr(attn, "is_causal", True) is not True:
        return "bidirectional attention"
    return None


def check_call(layer, call):
    why = llama.check_call(layer, call)
    if why is not None:
        return why
    attn, hidden = layer.self_attn, call["hidden_states"]
    if not kernel_head_dim(attn.head_dim, hidden.dtype):
        return f"head dim {attn.head_dim} in {hidden.dtype} (outside the attention kernel's range; sinks need it)"
    if attn.sinks.dtype not in (torch.float32, hidden.dtype):
        return f"sinks in {attn.sinks.dtype} with hidden states in {hidden.dtype}"
    mask = call.get("attention_mask")
    if mask is not None and mask.dim() == 4 and mask.shape[0] not in (1, hidden.shape[0]):
        return f"an attention mask of shape {tuple(mask.shape)} for a batch of {hidden.shape[0]}"
    return None


def run(layer, call, x):
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    n1, _ = add_rms_norm(x, None, ln1.weight, llama.rms_eps(ln1))
    o = llama.attention_sublayer(layer, call, n1, sinks=layer.self_attn.sinks, half_tables=True)
    n2, h = add_rms_norm(_like(o, x), x, ln2.weight, llama.rms_eps(ln2))  # h = x + o, normalized in one launch
    f, _ = layer.mlp(n2)  # Hugging Face's MoE MLP: (hidden states, router scores)
    return h + f


# The LLaMA family's tree and LoRA paths: the attention's linears and both norms (``fused_mlp``
# stays False, so neither lists the MLP, which ``run`` calls).
FAMILY = Family(check, check_call, run, llama.tree, rotaries=ROTARIES, lora_paths=llama.lora_paths,
                called=lambda layer: ("mlp",))
