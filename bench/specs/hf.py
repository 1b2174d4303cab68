"""Hugging Face models converted by ``fused_block.convert``: a training step and greedy generation.

Models (random weights, bf16, the default SDPA attention implementation):

- ``gpt2-small``: ``GPT2LMHeadModel(GPT2Config())``, 124M parameters.
- ``llama-1b``: ``LlamaForCausalLM`` at TinyLlama-1.1B's shape (d 2048, 22 layers, 32 heads
  with 4 KV heads, SwiGLU width 5632, vocabulary 32000). ``--quick`` keeps 4 of its 22 layers
  (``n_layer`` in the shape says so) so that torch.compile's compile time fits the GPU check.
- ``gemma-2b``: ``GemmaForCausalLM`` at Gemma-2B's shape (d 2048, 18 layers, 8 heads of 256
  with one KV head (MQA), GeGLU width 16384, vocabulary 256000, tied embeddings); the fused
  path runs its (1 + w) RMSNorms, the GeGLU epilogue and head dim 256. ``--quick``: 4 layers.
- ``t5-base``: ``T5ForConditionalGeneration`` at Flan-T5-base's shape (d 768, 12 encoder + 12
  decoder layers, 12 heads of 64, gated-GELU FFN of width 2048, 32 relative-position buckets,
  vocabulary 32128, untied LM head); the fused path runs the relative position bias through the
  attention kernel's bias input, T5's RMSNorms and the GeGLU epilogue, with the cross-attention.
  Training: 512 source and 128 target tokens per sequence. ``--quick``: 4 + 4 layers.

Providers:

- ``fused_block``: the model after ``fused_block.convert`` (eager).
- ``eager``: the unconverted model in eager PyTorch, with transformers' default attention
  implementation for it (``sdpa`` for every model here).
- ``torch.compile``: the unconverted model under ``torch.compile`` (default mode with
  ``--quick``, ``max-autotune`` in the full run) for the training step; for generation,
  transformers' own compiled decoding (``cache_implementation="static"``, which compiles the
  decoding forward).
- ``fused_block[rows]`` (training steps whose loss the memory rule puts on the vocabulary-outer
  schedule: llama-1b's and gemma-2b's, :func:`loss_on_vocab_schedule`): the same with the fused
  loss on its time-first token loop (``FUSED_BLOCK_LCE_SCHEDULE=rows``: the logits GEMM once,
  6 N V H FLOPs, and an fp32 (V, H) weight-gradient accumulator) where the memory rule takes
  the vocabulary-outer schedule (8 N V H, no accumulator): the loss's time against memory
  trade, beside Liger's (which sums the weight gradient in bf16 across its chunks).
- ``liger`` (training steps of the models Liger-Kernel patches, LLaMA and Gemma, when
  ``liger_kernel`` is importable): the unconverted model after ``apply_liger_kernel_to_llama`` /
  ``apply_liger_kernel_to_gemma(model=model)`` with Liger's defaults (RoPE, RMSNorm, SwiGLU /
  GeGLU, fused linear cross-entropy). Liger also replaces names in transformers' modeling
  module (its RoPE function, norm and MLP classes) for every model of the family: those
  replacements are undone right after the call and put back only around each of this
  provider's steps, so the other providers run transformers' own code.

Every provider's peak memory (``torch.cuda.max_memory_allocated`` over one step, less the
model, inputs and state allocated before it) is reported beside its time.

``profile_cases()`` (``python -m bench --profile hf``): the llama-1b training step at its
``--quick`` size (4 layers), for every provider and ``fused_block[triton]`` (every op on our
kernels: what the choices between ours and torch's paths change).

Ops and modes:

- ``hf_train`` (``fwd+bwd``): forward with ``labels`` (the causal-LM loss; T5: the decoder's
  loss on ``target`` tokens) and the gradient of every parameter, batch x seq tokens. FLOPs:
  ``3 x (2 T P + 4 B S^2 d n_layer)`` with T tokens, P the parameters of the linear layers (LM
  head included) and the attention's QK^T and PV counted in full (the causal half is not
  subtracted, as nanoGPT's MFU does). T5: the encoder's linears on the source tokens, the
  decoder's on the target tokens but for the cross-attention's k and v (source tokens), the
  encoder's, the decoder's and the cross-attention's score products (d = heads x d_kv).
- ``hf_generate`` (``fwd``): greedy generation of ``new`` tokens after a ``prompt``-token
  prompt, batch 1, with the KV cache (T5: the prompt is the encoder's input; the decoder starts
  from its start token, with both caches). Bytes: the weights read once per generated token
  (the floor of memory-bound decoding; the KV cache and activations are not counted; T5: the
  decoder's matmul weights and the LM head's, not the encoder's nor the cross-attention's k and
  v, which run once), so GB/s and % of the copy ceiling say how close decoding is to reading the weights at
  full bandwidth.
"""
import torch

from bench import harness
from bench.harness import Case

DTYPE = torch.bfloat16
MODELS = {
    "gpt2-small": dict(arch="gpt2", n_layer=12, d_model=768, train_batch=8, seq=1024, prompt=128, new=32),
    "llama-1b": dict(arch="llama", n_layer=22, d_model=2048, train_batch=4, seq=2048, prompt=128, new=32),
    "gemma-2b": dict(arch="gemma", n_layer=18, d_model=2048, train_batch=4, seq=2048, prompt=128, new=32),
    "t5-base": dict(arch="t5", n_layer=12, d_model=768, train_batch=8, seq=512, target=128, prompt=128, new=32),
}
QUICK = {"gpt2-small": dict(new=16), "llama-1b": dict(n_layer=4, new=16), "gemma-2b": dict(n_layer=4, new=16),
         "t5-base": dict(n_layer=4, new=16)}


def _config(arch, n_layer):
    import transformers

    if arch == "gpt2":
        return transformers.GPT2Config(n_layer=n_layer, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if arch == "t5":  # n_layer encoder and n_layer decoder layers
        return transformers.T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=n_layer,
                                     num_heads=12, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                     dropout_rate=0.0)
    if arch == "gemma":
        return transformers.GemmaConfig(vocab_size=256000, hidden_size=2048, intermediate_size=16384,
                                        num_hidden_layers=n_layer, num_attention_heads=8, num_key_value_heads=1,
                                        head_dim=256, hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192)
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                    num_hidden_layers=n_layer, num_attention_heads=32, num_key_value_heads=4,
                                    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _model(arch, n_layer, device):
    import transformers

    torch.manual_seed(0)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "gemma": transformers.GemmaForCausalLM, "t5": transformers.T5ForConditionalGeneration}[arch]
    with torch.device(device):
        return cls(_config(arch, n_layer)).to(DTYPE)


def _linear_params(model):
    """Weights of the matmuls: nn.Linear and GPT-2's Conv1D (the LM head included, tied or not)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
               and m.weight.dim() == 2 and not isinstance(m, torch.nn.Embedding))


def train_flops(model, batch, seq, n_layer, d_model):
    tokens = batch * seq
    return 3 * (2 * tokens * _linear_params(model) + 4 * batch * seq * seq * d_model * n_layer)


def _t5_linears(model):
    """(encoder, decoder but the cross-attention's k and v, the cross-attention's k and v, LM
    head) matmul weights of a T5ForConditionalGeneration."""
    cross_kv = sum(_linear_params(layer.layer[1].EncDecAttention.k) + _linear_params(layer.layer[1].EncDecAttention.v)
                   for layer in model.decoder.block)
    return (_linear_params(model.encoder), _linear_params(model.decoder) - cross_kv, cross_kv,
            _linear_params(model.lm_head))


def seq2seq_train_flops(model, batch, src, tgt, n_layer):
    enc, dec, cross_kv, head = _t5_linears(model)
    d = model.config.num_heads * model.config.d_kv
    linears = 2 * batch * (src * (enc + cross_kv) + tgt * (dec + head))
    scores = 4 * batch * d * n_layer * (src * src + tgt * tgt + tgt * src)
    return 3 * (linears + scores)



def loss_on_vocab_schedule(spec) -> bool:
    """Whether the memory rule puts the causal LM's loss on the vocabulary-outer schedule at
    the spec's shape (8 N V H FLOPs; bf16, gradients of both): then its training step also runs
    as ``fused_block[rows]``, the loss on the token loop (6 N V H, its fp32 (V, H) dW
    accumulator), for the time and peak memory of both."""
    from fused_block.kernels import loss

    if spec["arch"] == "t5":
        return False
    cfg = _config(spec["arch"], spec["n_layer"])
    return loss.schedule(spec["train_batch"] * spec["seq"], cfg.vocab_size, spec["d_model"], DTYPE.itemsize,
                         False, True, True) == "vocab"


# Liger-Kernel's patch function per architecture (the training step's ``liger`` provider).
LIGER = {"llama": "apply_liger_kernel_to_llama", "gemma": "apply_liger_kernel_to_gemma"}


def liger_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def _liger(model, arch):
    """Apply Liger to ``model``; returns a context manager that puts Liger's replacements of
    transformers' modeling-module names back for the duration of a step (they are undone here,
    so that the other providers' models run transformers' own code)."""
    import contextlib
    import importlib

    import liger_kernel.transformers as liger

    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    before = dict(vars(module))
    getattr(liger, LIGER[arch])(model=model)
    replaced = {k: v for k, v in vars(module).items() if before.get(k, object()) is not v}
    missing = object()

    def swap(values):
        for k, v in values.items():
            if v is missing:
                delattr(module, k)
            else:
                setattr(module, k, v)

    originals = {k: before.get(k, missing) for k in replaced}
    swap(originals)

    @contextlib.contextmanager
    def patched():
        swap(replaced)
        try:
            yield
        finally:
            swap(originals)
    return patched


def _provider(provider, spec, mode, quick):
    def factory():
        import contextlib

        import fused_block

        model = _model(spec["arch"], spec["n_layer"], "cuda")
        vocab = model.config.vocab_size
        scope = contextlib.nullcontext
        if provider.startswith("fused_block"):
            fused_block.convert(model)
        elif provider == "liger":
            scope = _liger(model, spec["arch"])
        if mode == "fwd+bwd":
            model.train()
            params = tuple(model.parameters())
            fn = harness.compiled(model, mode="default" if quick else "max-autotune") \
                if provider == "torch.compile" else model

            ids = torch.randint(0, vocab, (spec["train_batch"], spec["seq"]), device="cuda")
            labels = ids if "target" not in spec else \
                torch.randint(0, vocab, (spec["train_batch"], spec["target"]), device="cuda")

            def step():  # a step reads every weight and far more activations than L2 holds
                with scope(), harness.provider_scope(provider):
                    return torch.autograd.grad(fn(ids, labels=labels).loss, params)
            return step
        model.eval()
        ids = torch.randint(0, vocab, (1, spec["prompt"]), device="cuda")
        kw = dict(max_new_tokens=spec["new"], min_new_tokens=spec["new"], do_sample=False, pad_token_id=0)
        if provider == "torch.compile":
            kw["cache_implementation"] = "static"

        def generate():
            return model.generate(ids, **kw)
        return generate
    return factory


def _train_providers(spec):
    rows = ("fused_block[rows]",) if loss_on_vocab_schedule(spec) else ()
    names = ("fused_block",) + rows + ("eager", "torch.compile")
    return names + (("liger",) if spec["arch"] in LIGER and liger_available() else ())


def cases(quick: bool) -> list:
    out = []
    for name, spec in MODELS.items():
        spec = dict(spec, **(QUICK[name] if quick else {}))
        shape = {"model": name, "n_layer": spec["n_layer"]}
        for op, mode in (("hf_train", "fwd+bwd"), ("hf_generate", "fwd")):
            names = _train_providers(spec) if mode == "fwd+bwd" else ("fused_block", "eager", "torch.compile")
            providers = {p: _provider(p, spec, mode, quick) for p in names}
            if mode == "fwd+bwd":
                case_shape = dict(shape, batch=spec["train_batch"], seq=spec["seq"])
                if "target" in spec:
                    case_shape["target"] = spec["target"]
                out.append(Case(op=op, shape=case_shape, dtype=DTYPE, mode=mode, providers=providers,
                                flops=_count_train_flops(spec)))
            else:
                case_shape = dict(shape, prompt=spec["prompt"], new=spec["new"])
                out.append(Case(op=op, shape=case_shape, dtype=DTYPE, mode=mode, providers=providers,
                                bytes=_count_weight_bytes(spec) * spec["new"]))
    return out


def profile_cases() -> list:
    """``python -m bench --profile hf``: llama-1b's training step at its ``--quick`` size, every
    provider, and ours with every op on our kernels (``fused_block[triton]``)."""
    (case,) = [c for c in cases(True) if c.op == "hf_train" and c.shape["model"] == "llama-1b"]
    spec = dict(MODELS["llama-1b"], **QUICK["llama-1b"])
    providers = dict(case.providers)
    case.providers = {"fused_block": providers.pop("fused_block"),
                      "fused_block[triton]": _provider("fused_block[triton]", spec, "fwd+bwd", True), **providers}
    return [case]


def _meta_model(spec):
    return _model(spec["arch"], spec["n_layer"], "meta")


def _count_train_flops(spec):
    if spec["arch"] == "t5":
        return seq2seq_train_flops(_meta_model(spec), spec["train_batch"], spec["seq"], spec["target"],
                                   spec["n_layer"])
    return train_flops(_meta_model(spec), spec["train_batch"], spec["seq"], spec["n_layer"], spec["d_model"])


def _count_weight_bytes(spec):
    model = _meta_model(spec)
    if spec["arch"] == "t5":  # per decoding step: the decoder's and the LM head's weights
        _, dec, _, head = _t5_linears(model)
        return (dec + head) * DTYPE.itemsize
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


# ---------------------------------------------------------------------------------------------
# numerics: converted tiny models against the originals in float64 (CPU through the interpreter)
# ---------------------------------------------------------------------------------------------

# One layer, hidden 64 with 4 heads (head dim 16, the kernel's smallest), 2 x 8 tokens with
# left padding on the second sequence: small enough for the interpreter. T5: one encoder and
# one decoder layer, the 2 x 8 tokens (padded) as the source, 2 x 5 decoder tokens.
NUMERICS_DTYPES = (torch.float32, torch.bfloat16)
BLOCK_FACTOR = 4.0  # a layer chains about ten ops whose rounding points differ (tests/test_blocks.py)


def _tiny(arch):
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=1, n_head=4,
                                      initializer_range=0.2, bos_token_id=0, eos_token_id=95)
        return transformers.GPT2LMHeadModel(cfg)
    if arch == "t5":
        cfg = transformers.T5Config(vocab_size=96, d_model=64, d_kv=16, d_ff=96, num_layers=1, num_heads=4,
                                    relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
        return transformers.T5ForConditionalGeneration(cfg)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   initializer_range=0.2)
    return transformers.LlamaForCausalLM(cfg)


def numerics() -> list:
    import copy

    try:
        import fused_block
        import transformers  # noqa: F401 - optional dependency
    except Exception as exc:  # noqa: BLE001
        return [harness.unavailable_row(op, harness.describe_error(exc)) for op in ("hf_gpt2", "hf_llama", "hf_t5")]
    dev = harness.DEVICE
    rows = []
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1)).to(dev)
    mask = torch.ones(2, 8, dtype=torch.long, device=dev)
    mask[1, :2] = 0
    targets = torch.randint(2, 96, (2, 5), generator=torch.Generator().manual_seed(2)).to(dev)
    for arch in ("gpt2", "llama", "t5"):
        for dtype in NUMERICS_DTYPES:
            model = _tiny(arch).to(dev).eval()
            ref = copy.deepcopy(model).double()
            base = copy.deepcopy(model).to(dtype)
            ours = fused_block.convert(copy.deepcopy(base))
            with torch.no_grad():
                if arch == "t5":  # every decoder position is a real token
                    logits = [m(ids, attention_mask=mask, labels=targets).logits for m in (ours, ref, base)]
                else:
                    logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
                              for m in (ours, ref, base)]
            scale = max(1.0, logits[1].abs().max().item())
            case = "2x8->2x5 (1+1 layers, d 64)" if arch == "t5" else "2x8 (1 layer, d 64)"
            rows.append(harness.compare(f"hf_{arch}", case, "logits", *logits,
                                        atol=harness.ATOL[dtype] * scale, factor=BLOCK_FACTOR))
    return rows
