"""Tiny random Hugging Face models for the tests (no download).

Hidden 64 with 4 heads gives head dim 16, the attention kernel's smallest; 2 layers so that
the residual stream crosses a layer boundary; vocabulary 96; sequences of 9 tokens (not a
multiple of any block size). The LLaMA family uses 2 KV heads (GQA). Weights are drawn with
std 0.2 (HF's 0.02 makes tiny models' logits nearly flat, so greedy tokens would tie).
"""
import contextlib
import copy
import re
import warnings

import torch
import transformers

import numerics

V, B, L = 96, 2, 9
GEMMAS = ("gemma", "gemma2", "gemma3")
# The rule for whole models (as tests/test_blocks.py): err <= 4 x err(original, same dtype)
# + atol x max(1, |ref|), against the original model in float64.
BLOCK_FACTOR = 4.0
TF32_ATOL = 5e-3


def atol(dtype, device):
    return TF32_ATOL if dtype == torch.float32 and device.type == "cuda" else numerics.ATOL[dtype]


def assert_close(name, actual, ref64, baseline, dtype, device):
    scale = max(1.0, ref64.detach().abs().max().item())
    numerics.assert_close(name, actual, ref64, baseline, atol=atol(dtype, device) * scale, factor=BLOCK_FACTOR)


def dropout_modes(model, groups, model_train, on=None):
    """``model`` in train or eval mode, every nn.Dropout and every module of ``groups`` (regexes)
    in eval but those whose path matches the regex ``on`` in train."""
    model.train(model_train)
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout) or any(re.fullmatch(g, path) for g in groups):
            m.train(on is not None and re.fullmatch(on, path) is not None)


def check_dropout_flags(ref, model, fused, logits, groups, every, device):
    """The tests that each dropout follows the flag the original reads (``logits(m)``: one
    forward with a fixed seed). Model in train mode with every deciding submodule (``every``) in
    eval: the original's no-dropout logits (float64 rule) and the fused eval logits exactly;
    model in eval mode with one of ``groups`` in train: the original drops, the fused model too
    (masks differ: an ON state differs from the no-dropout logits). Returns the no-dropout
    logits of the original and of the fused model."""
    dropout_modes(model, every, False)
    dropout_modes(fused, every, False)
    plain, fused_plain = logits(model), logits(fused)
    for m in (ref, model, fused):
        dropout_modes(m, every, True)
    out = logits(fused)
    assert_close("logits", out, logits(ref), logits(model), torch.float32, device)
    torch.testing.assert_close(out, fused_plain, atol=0, rtol=0)
    for group in groups:
        for m in (model, fused):
            dropout_modes(m, every, False, on=group)
        assert not torch.allclose(logits(model), plain), group  # the original drops here
        assert not torch.allclose(logits(fused), fused_plain), group
    return plain, fused_plain


@contextlib.contextmanager
def no_fallback():
    """Nothing falls back (no fused_block warning) in the covered configurations."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fused_block:")
        yield


def as_cuda_autocast_computes(module, device):
    """{label: module}: a copy of ``module`` whose ``torch.nn.LayerNorm``s compute as CUDA's
    autocast runs them (input, weight and bias cast to fp32, an fp32 output), the baseline on
    every device; on CUDA also ``module`` itself, for the caller's ``torch.autocast('cuda')``."""
    emulated = copy.deepcopy(module)
    for m in emulated.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.forward = lambda x, m=m: torch.nn.functional.layer_norm(x.float(), m.normalized_shape,
                                                                      m.weight.float(), m.bias.float(), m.eps)
    originals = {"as CUDA's autocast computes": emulated}
    if device.type == "cuda":
        originals["torch's module under torch.autocast('cuda')"] = module
    return originals


def check_post_ln_layer_under_cuda_autocast(layer, original, x, g, device, launches, call=lambda lay, inp: lay(inp)):
    """A converted Post-LN layer ``layer`` given ``x`` (16-bit, or fp32) under autocast whose
    policy runs layer_norm in fp32 (CUDA's, emulated on the CPU by the caller's fixture): its
    output is fp32, as ``original``'s, with both norms fused; the output and x's gradient (``g``
    the output's) against the float64 layer, :func:`as_cuda_autocast_computes`' the baselines."""
    originals = as_cuda_autocast_computes(original, device)
    ref = copy.deepcopy(original).double()
    dtype = x.dtype
    lowp = torch.bfloat16 if dtype == torch.float32 else dtype

    def run(lay, inp, autocast=True):
        inp = inp.detach().requires_grad_()
        with torch.autocast(device.type, dtype=lowp, enabled=autocast):
            out = call(lay, inp)
        out = out[0] if isinstance(out, tuple) else out
        return out, torch.autograd.grad((out.double() * g).sum(), inp)[0]

    with no_fallback():
        got, dx = run(layer, x)
    assert got.dtype == torch.float32 and launches["add_norm_fwd"] == 2
    out64, dx64 = run(ref, x.double(), autocast=False)
    for label, orig in originals.items():
        base, dbase = run(orig, x)
        assert base.dtype == got.dtype and dbase.dtype == dx.dtype == dtype, label
        assert_close(f"output vs {label}", got, out64, base, lowp, device)
        assert_close(f"dx vs {label}", dx, dx64, dbase, lowp, device)


def config(arch, layers=2, **overrides):
    common = dict(vocab_size=V, initializer_range=0.2)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_positions=64, n_embd=64, n_layer=layers, n_head=4, bos_token_id=0,
                                      eos_token_id=V - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    elif arch == "bert":
        cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                      intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, **common)
    elif arch in GEMMAS:
        # head_dim 16 (their configs default to 256); query_pre_attn_scalar 24: a scaling other
        # than head_dim ** -0.5 reaches the kernel. Gemma 2: no attention softcap (the fused
        # standard config; its default 50 falls back), the final logit softcap (30) in the loss;
        # Gemma 3: one sliding and one full layer, each with its own RoPE base (10^4, 10^6). The
        # windows (4096, 512) cut nothing in these sequences.
        cls = {"gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config,
               "gemma3": transformers.Gemma3TextConfig}[arch]
        extra = {}
        if arch == "gemma2":
            extra = dict(attn_logit_softcapping=None, final_logit_softcapping=30.0, query_pre_attn_scalar=24,
                         layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
        elif arch == "gemma3":
            extra = dict(query_pre_attn_scalar=24, sliding_window=512,
                         layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
        # Tied embeddings (their default) make the tiny models' greedy decoding repeat one token:
        # the generation test unties them (a constructor argument, not an attribute to set later).
        extra["tie_word_embeddings"] = overrides.pop("tie_word_embeddings", True)
        cfg = cls(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=0, eos_token_id=V - 1,
                  pad_token_id=None, **extra, **common)
    elif arch == "bloom":
        # ALiBi (4 heads: slopes 1/4, 1/16, 1/64, 1/256), Pre-LN, the fused per-head [q, k, v] GEMM
        cfg = transformers.BloomConfig(hidden_size=64, n_layer=layers, n_head=4, hidden_dropout=0.0,
                                       attention_dropout=0.0, bos_token_id=0, eos_token_id=V - 1,
                                       tie_word_embeddings=overrides.pop("tie_word_embeddings", True), **common)
    elif arch == "gpt_oss":
        # A sliding layer and a full one (its default alternation); the window (4) cuts keys in
        # 9 tokens and while generating. YaRN RoPE (its default type; factor 4 over 16 original
        # positions: attention_scaling 1.14); 4 experts, top 2; the experts' loop
        # (transformers' default grouped_mm takes no float64 reference).
        cfg = transformers.GptOssConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
            layer_types=(["sliding_attention", "full_attention"] * layers)[:layers], num_local_experts=4, num_experts_per_tok=2,
            rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                 original_max_position_embeddings=16, rope_theta=150000.0),
            experts_implementation="eager", bos_token_id=0, eos_token_id=V - 1, pad_token_id=None, **common)
    else:
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "phi3": transformers.Phi3Config}[arch]
        if arch == "phi3":  # RoPE on half of each head (dims 8..15 pass through)
            common["partial_rotary_factor"] = 0.5
        if arch == "qwen3":  # its config's head_dim is 128 whatever the hidden size
            common["head_dim"] = 16
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
           "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "phi3": transformers.Phi3ForCausalLM, "gemma": transformers.GemmaForCausalLM,
           "gemma2": transformers.Gemma2ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM,
           "gpt_oss": transformers.GptOssForCausalLM, "bloom": transformers.BloomForCausalLM}[arch]
    model = cls(config(arch, **overrides)).to(device)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    one = 0.0 if arch in GEMMAS else 1.0  # Gemma's norm weights are offsets from 1 (HF initializes them to 0)
    # Non-trivial norm weights and biases (HF initializes them to 1 and 0), drawn on the CPU like
    # the rest: the same model on every device (the GPU's generator draws other numbers).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, dtype=p.dtype) * 0.3 + (one if name.endswith("weight") else 0.0))
    return model


def inputs(arch, device):
    """Token ids and a padding mask: left padding for decoders (as batched generation pads),
    two tokens inside the second row for "bloom-middle" (BLOOM's ALiBi positions over the mask),
    right padding for BERT and for Gemma 2, whose model runs eager attention (in float64 a
    fully masked query row gives NaN there: see interface_inputs)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, L), generator=g).to(device)
    mask = torch.ones(B, L, dtype=torch.long, device=device)
    if arch in ("bert", "gemma2"):
        mask[1, L - 3:] = 0  # right padding
    elif arch == "bloom-middle":  # padding inside the row: BLOOM's ALiBi counts positions over the mask
        mask[1, 3:5] = 0
    else:
        mask[1, :3] = 0  # left padding, as batched generation pads
    return ids, mask


# ---------------------------------------------------------------------------------------------
# attn_implementation="fused_block": tiny models of every family the interface tests cover
# ---------------------------------------------------------------------------------------------

_TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2, bos_token_id=0,
             eos_token_id=V - 1, pad_token_id=None)
# name -> (model_type, config overrides): each the family's own features at the tiny shape.
INTERFACE_MODELS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),  # sliding_window 4096: the mask's window cuts no key
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),  # q/k RMSNorm
    "gemma": ("gemma", {}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5)),  # partial rotary
    "starcoder2": ("starcoder2", {}),
    "gemma3": ("gemma3_text", dict(layer_types=["sliding_attention", "full_attention"])),  # window 512
    # a window of 4 over 9 tokens cuts keys: the sliding layers run the kernel's window
    "gemma3-window": ("gemma3_text", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "gemma2": ("gemma2", dict(sliding_window=4)),  # softcap 50 and a window that cuts keys: the kernel's
    "gpt_oss": ("gpt_oss", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                num_local_experts=4, num_experts_per_tok=2)),  # sinks and windows: the kernel's
    # layer 0 global, layer 1 local (window 64 of 128: cuts nothing in 9 tokens)
    "modernbert": ("modernbert", dict(global_attn_every_n_layers=2, pad_token_id=V - 2, bos_token_id=None,
                                      eos_token_id=None, cls_token_id=1, sep_token_id=2)),
    "modernbert-window": ("modernbert", dict(global_attn_every_n_layers=2, local_attention=4, pad_token_id=V - 2,
                                             bos_token_id=None, eos_token_id=None, cls_token_id=1, sep_token_id=2)),
    "gpt2": ("gpt2", {}),  # the configs of config() above
    "bert": ("bert", {}),
}
# Those whose transformers code has no SDPA path (softcap, sinks): their original is eager.
EAGER_ONLY = ("gemma2", "gpt_oss")
ENCODERS = ("modernbert", "modernbert-window", "bert")


def interface_model(name, device, attn_implementation, **overrides):
    """A tiny random model of ``INTERFACE_MODELS[name]`` with ``attn_implementation``; norm
    weights and biases randomized as :func:`model` does."""
    model_type, extra = INTERFACE_MODELS[name]
    if model_type in ("gpt2", "bert"):
        cfg = config(model_type, layers=overrides.pop("num_hidden_layers", 2), **overrides)
    else:
        kw = {**_TINY, **extra, **overrides}
        if "layer_types" in kw:  # the first layers' types when there are fewer layers
            kw["layer_types"] = kw["layer_types"][:kw["num_hidden_layers"]]
        cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cls = transformers.AutoModelForMaskedLM if name in ENCODERS else transformers.AutoModelForCausalLM
    # gpt-oss's experts: the loop (transformers' default grouped_mm takes no float64 reference)
    experts = dict(experts_implementation="eager") if model_type == "gpt_oss" else {}
    torch.manual_seed(0)
    model = cls.from_config(cfg, attn_implementation=attn_implementation, **experts).to(device)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if pname.endswith("weight") else 0.0))
    return model


def interface_inputs(name, device, generating=False):
    """Token ids (B, L) and a padding mask: left padding for decoders (as batched generation
    pads), right padding for encoders and for the eager-only models' numerics (their eager
    attention in float64 gives NaN for a fully masked query row, which then leaks through the
    values: softmax in fp32 of a float64 mask of finfo(float64).min, -inf there)."""
    right = name in ENCODERS or (name in EAGER_ONLY and not generating)
    return inputs("bert" if right else "llama", device)


# Encoder-decoders: BART (Post-LN, learned positions), Whisper (Pre-LN, a conv front end on
# 8 mel bins x 16 frames, 8 encoder positions), T5 (relative position bias, gated GELU: v1.1 /
# Flan-T5; "t5-v1.0": the ReLU FFN). d_model 64 with 4 heads (head dim 16), 2 + 2 layers, 9
# source tokens (one row right-padded), 5 targets.
SEQ2SEQ = ("bart", "whisper", "t5")
TARGET_LEN = 5


def seq2seq_model(name, device, attn_implementation, layers=2, encoder_only=False, **overrides):
    """``encoder_only``: T5's ``T5EncoderModel``."""
    if name == "bart":
        cfg = transformers.BartConfig(vocab_size=V, d_model=64, encoder_layers=layers, decoder_layers=layers,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                                      decoder_ffn_dim=96, max_position_embeddings=64, init_std=0.2, pad_token_id=1,
                                      bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                      forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0)
    elif name == "whisper":
        cfg = transformers.WhisperConfig(vocab_size=V, d_model=64, encoder_layers=layers, decoder_layers=layers,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                                         decoder_ffn_dim=96, num_mel_bins=8, max_source_positions=8,
                                         max_target_positions=64, init_std=0.2, pad_token_id=1, bos_token_id=0,
                                         eos_token_id=2, decoder_start_token_id=0, suppress_tokens=None,
                                         begin_suppress_tokens=None, dropout=0.0)
    else:
        cfg = transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96, num_layers=layers, num_heads=4,
                                    relative_attention_num_buckets=8,
                                    feed_forward_proj="relu" if name == "t5-v1.0" else "gated-gelu",
                                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cls = transformers.AutoModelForSpeechSeq2Seq if name == "whisper" else transformers.AutoModelForSeq2SeqLM
    if encoder_only:
        cls = transformers.T5EncoderModel
    torch.manual_seed(0)
    make = cls._from_config if encoder_only else cls.from_config
    model = make(cfg, attn_implementation=attn_implementation).to(device)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if pname.endswith("weight") else 0.0))
    return model


def seq2seq_inputs(name, device):
    """The encoder's inputs (token ids and a right-padded mask; Whisper: features, no mask) and
    target ids (B, TARGET_LEN) for the labels."""
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(3, V, (B, TARGET_LEN), generator=g).to(device)
    if name == "whisper":
        return dict(input_features=torch.randn(B, 8, 16, generator=g).to(device)), targets
    ids, mask = inputs("bert", device)
    return dict(input_ids=ids.clamp(min=3), attention_mask=mask), targets
