"""Tiny random Hugging Face models for the tests (no download).

Hidden 64 with 4 heads gives head dim 16, the attention kernel's smallest; 2 layers so that
the residual stream crosses a layer boundary; vocabulary 96; sequences of 9 tokens (not a
multiple of any block size). The LLaMA family uses 2 KV heads (GQA). Weights are drawn with
std 0.2 (HF's 0.02 makes tiny models' logits nearly flat, so greedy tokens would tie).
"""
import torch
import transformers

V, B, L = 96, 2, 9


def config(arch, layers=2, **overrides):
    common = dict(vocab_size=V, initializer_range=0.2)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_positions=64, n_embd=64, n_layer=layers, n_head=4, bos_token_id=0,
                                      eos_token_id=V - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    elif arch == "bert":
        cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                      intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, **common)
    else:
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[arch]
        cfg = cls(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=V - 1,
                  pad_token_id=None, **common)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def model(arch, device, attn_implementation=None, **overrides):
    torch.manual_seed(0)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "bert": transformers.BertForMaskedLM,
           "llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[arch]
    model = cls(config(arch, **overrides)).to(device)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    with torch.no_grad():  # non-trivial norm weights and biases (HF initializes them to 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return model


def inputs(arch, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, L), generator=g).to(device)
    mask = torch.ones(B, L, dtype=torch.long, device=device)
    if arch == "bert":
        mask[1, L - 3:] = 0  # right padding
    else:
        mask[1, :3] = 0  # left padding, as batched generation pads
    return ids, mask
