"""The LM head's loss: ``fused_block.linear_cross_entropy`` against the logits-materializing peers.

Op ``linear_cross_entropy``: ``F.cross_entropy(hidden @ W.T, target)`` (mean over the
non-ignored tokens, 1/16 of them ignored). Providers:

- ``fused_block``: the chunked op (no (N, V) logits; gradients produced in the forward): the
  products on cuBLAS, the softmax/loss/gradient pass in Triton; at LLaMA-3's head below 32K
  tokens its vocabulary-outer schedule (4 GEMMs, no fp32 (V, H) dW accumulator), at GPT-2's
  from 8K tokens the token-chunk loop (3 GEMMs);
- ``fused_block rows``: the same op with the token-chunk loop forced (3 GEMMs and an fp32
  (V, H) dW accumulator: the speed the vocabulary-outer schedule trades for memory);
- ``eager``: ``F.linear`` then ``F.cross_entropy`` on the logits upcast to fp32, as Hugging
  Face's ``ForCausalLMLoss`` computes it;
- ``torch.compile`` of the eager function (``max-autotune`` in the full run, the default mode
  under ``--quick``);
- ``liger``: Liger-Kernel's ``liger_fused_linear_cross_entropy`` when installed;
- ``torch.linear_cross_entropy``: torch's own chunked op (``F.linear_cross_entropy`` with
  ``options=torch.nn.LinearCrossEntropyOptions()``, its "auto" choices) when this torch has it
  (2.13 does).

Shapes (bf16; vocabulary V x hidden H, N tokens): GPT-2 (50,257 x 768) and LLaMA-3
(128,256 x 4,096), 8K, 16K and 32K tokens; ``--quick``: 8K tokens for both. Modes: ``fwd``
(the loss under ``torch.no_grad``: evaluation) and ``fwd+bwd`` (the loss and the gradients of
the hidden states and the weight: a training step's head).

FLOPs: the matmuls only, ``2 N V H`` per GEMM; ``fwd`` 1 GEMM, ``fwd+bwd`` 3 (logits, dhidden,
dW; recomputing the logits, as a backward-only scheme would, is not counted). Peak memory is
what the harness reports (``torch.cuda.max_memory_allocated`` during one call, above the
inputs): the point of the op. For scale: the fp32 logits alone are ``4 N V`` bytes (4.2 GB at
8K tokens x 128,256), and the eager path holds them about twice over with their gradient.

Without a GPU, ``numerics()`` checks the loss and both gradients against the float64 reference
on an interpreter-sized problem (37 tokens, a prime vocabulary of 101, hidden 32, chunks of 8
rows) for fp32, fp16 and bf16.
"""
import torch
import torch.nn.functional as F

from bench import harness
from bench.harness import Case

OP = "linear_cross_entropy"
MODELS = {"gpt2": (50257, 768), "llama3": (128256, 4096)}
TOKENS = (8192, 16384, 32768)
QUICK_TOKENS = (8192,)
DTYPE = torch.bfloat16
MODES = ("fwd", "fwd+bwd")
IGNORED = 16  # one token in 16 carries ignore_index (padding, prompt tokens)


def flops(mode: str, tokens: int, vocab: int, hidden: int) -> int:
    return (1 if mode == "fwd" else 3) * 2 * tokens * vocab * hidden


def _eager(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def _ours(hidden, weight, target):
    import fused_block

    return fused_block.linear_cross_entropy(hidden, weight, target)


def _liger():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def fn(hidden, weight, target):
        out = liger_fused_linear_cross_entropy(hidden, weight, target)
        return out if isinstance(out, torch.Tensor) else out[0]
    return fn


def _torch_chunked():
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        raise ImportError(f"torch {torch.__version__} has no F.linear_cross_entropy with chunking options")
    options = torch.nn.LinearCrossEntropyOptions()

    def fn(hidden, weight, target):
        return F.linear_cross_entropy(hidden, weight, target, options=options)
    return fn


def _ours_rows():
    from fused_block.kernels import loss as kloss

    def fn(hidden, weight, target):
        before, kloss.FORCE_SCHEDULE = kloss.FORCE_SCHEDULE, "rows"
        try:
            return _ours(hidden, weight, target)
        finally:
            kloss.FORCE_SCHEDULE = before
    return fn


IMPLS = {"fused_block": lambda: _ours, "fused_block rows": _ours_rows, "eager": lambda: _eager,
         "torch.compile": lambda: harness.compiled(_eager, mode="max-autotune"), "liger": _liger,
         "torch.linear_cross_entropy": _torch_chunked}


def _make_inputs(tokens, vocab, hidden, requires_grad, device=None, dtype=DTYPE):
    x = harness.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=requires_grad)
    w = harness.randn(vocab, hidden, dtype=dtype, device=device, scale=hidden ** -0.5, requires_grad=requires_grad)
    target = torch.randint(0, vocab, (tokens,), device=device or harness.DEVICE)
    target[::IGNORED] = -100
    return x, w, target


def _factory(provider, mode, tokens, vocab, hidden):
    def factory():
        impl = IMPLS[provider]()
        set_bytes = (tokens + vocab) * hidden * 2
        if mode == "fwd":
            def run(args):
                with torch.no_grad():
                    return impl(*args)
            return harness.rotating(lambda: _make_inputs(tokens, vocab, hidden, False), run, set_bytes)

        def step(args):
            x, w, t = args
            return torch.autograd.grad(impl(x, w, t), (x, w))
        return harness.rotating(lambda: _make_inputs(tokens, vocab, hidden, True), step, set_bytes)
    return factory


def cases(quick: bool) -> list:
    out = []
    for mode in MODES:
        for model, (vocab, hidden) in MODELS.items():
            for tokens in (QUICK_TOKENS if quick else TOKENS):
                providers = {p: _factory(p, mode, tokens, vocab, hidden) for p in IMPLS}
                out.append(Case(op=OP, shape={"model": model, "tokens": tokens, "vocab": vocab, "hidden": hidden},
                                dtype=DTYPE, mode=mode, providers=providers,
                                flops=flops(mode, tokens, vocab, hidden)))
    return out


# 37 tokens (odd), vocabulary 101 (prime: no tile multiple), hidden 32, chunks of 8 rows (the
# first, middle and last chunks of the dW accumulation): cheap in the interpreter.
NUMERICS_SHAPE = (37, 101, 32)
NUMERICS_CHUNK = 8
NUMERICS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def numerics() -> list:
    from fused_block import reference
    from fused_block.kernels import loss as kloss

    tokens, vocab, hidden = NUMERICS_SHAPE
    case = f"{tokens}x{vocab}x{hidden}"
    try:
        import fused_block
        ours = fused_block.linear_cross_entropy
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return [harness.unavailable_row(OP, harness.describe_error(exc), case)]
    opts = dict(label_smoothing=0.1, z_loss=0.01)
    rows = []
    before, kloss.FORCE_CHUNK_ROWS = kloss.FORCE_CHUNK_ROWS, NUMERICS_CHUNK
    try:
        for dtype in NUMERICS_DTYPES:
            torch.manual_seed(0)
            x, w, t = _make_inputs(tokens, vocab, hidden, False, device=harness.DEVICE, dtype=dtype)
            got = _run(lambda a, b: ours(a, b, t, **opts), x, w)
            want = _run(lambda a, b: reference.linear_cross_entropy(a, b, t, **opts), x.double(), w.double())
            base = _run(lambda a, b: reference.linear_cross_entropy(a, b, t, compute_dtype=dtype, **opts), x, w)
            for name, a, r, b in zip(("loss", "dhidden", "dweight"), got, want, base):
                rows.append(harness.compare(OP, case, name, a, r, b, atol=harness.ATOL[dtype], dtype=dtype))
    finally:
        kloss.FORCE_CHUNK_ROWS = before
    return rows


def _run(fn, x, w):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w)
    return (loss,) + torch.autograd.grad(loss, (x, w))
