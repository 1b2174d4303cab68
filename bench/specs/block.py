"""A whole Transformer encoder layer: ``fused_block.convert``-ed vs torch's, training step.

Providers (each one builds the same ``nn.TransformerEncoderLayer`` from the same seed, on the
GPU in bf16; the fused ones are ``fused_block.convert`` of it):

- ``fused_block``: the converted layer, eager.
- ``fused_block+graph``: the converted layer's whole training step captured once with
  ``fused_block.graphs.capture`` and replayed (static inputs; dropout draws new masks on
  every replay). Its peak memory is the peak of the warm-up and capture (the graph's
  memory pool), which include the graph's own copies of the inputs.
- ``eager``: ``torch.nn.TransformerEncoderLayer``, with torch's inference fast path switched
  off (``torch.backends.mha.set_fastpath_enabled(False)``) so it is the plain module.
- ``torch.compile``: ``torch.compile`` of torch's layer.
- ``torch.compile(fused_block)``: ``torch.compile`` of the converted layer (our ops are opaque
  nodes in its graph; the glue between them is compiled).
- ``fast_path`` (``fwd`` only): torch's native inference path
  (``torch._transformer_encoder_layer_fwd``), which ``nn.TransformerEncoderLayer`` takes in
  eval mode under ``no_grad``.

torch.compile runs with ``mode="max-autotune"`` (which also captures CUDA graphs) in the full
run and in its default mode under ``--quick`` (``harness.compiled`` drops the mode there).

Modes: ``fwd+bwd`` is a training step (train mode; dropout as configured): the forward and
the gradients of the input and of every parameter (``torch.autograd.grad``, so nothing
accumulates between calls). ``fwd`` (full run, dropout 0) is inference: eval, ``no_grad``.
``op`` is ``block_pre_ln`` (``norm_first=True``) or ``block_post_ln``, with the dropout in the
name (``block_pre_ln_p0.1``). GELU activation, bias, batch_first, no mask.

Shapes (bf16):

- GPT-2-medium: d_model 1024, 16 heads, d_ff 4096, batch 8, seq 1024 (the issue's shape).
- LLaMA-7B-sized: d_model 4096, 32 heads (head dim 128), d_ff 11008 (LLaMA's FFN width,
  here a plain GELU FFN and LayerNorm since torch's layer has neither SwiGLU nor RMSNorm),
  batch 2, seq 2048 (LLaMA-1's context): 4096 tokens, about 5 TFLOP per training step.

``--quick`` runs GPT-2-medium training steps only, Pre-LN with dropout 0 and Post-LN with
dropout 0.1 (every norm placement and dropout setting once; two torch.compile builds each).

FLOPs (no ``bytes``: a block is compute bound): the matmuls, ``2 T (4 d^2 + 2 d d_ff)`` with
T = batch * seq tokens, plus attention ``4 B L^2 d`` (QK^T and PV); backward is twice the
forward, so ``fwd+bwd`` counts 3x. Norms, bias, activations and dropout are not counted.

``profile_cases()`` (``python -m bench --profile block``): the Pre-LN GPT-2-medium training step,
dropout 0, for fused_block (also as ``fused_block[triton]``: every op on our kernels), eager
and torch.compile.

Targets on an H200 (from issue 12; a benchmark, not a test): a training step at least 1.3x
faster than eager and 1.05x faster than torch.compile, peak memory at most 0.8x eager's, for
Pre-LN and Post-LN with dropout 0 and 0.1. Host time per step: ``python -m bench --only host``.
"""
import contextlib

import torch

from bench import harness
from bench.harness import Case

SHAPES = {
    "gpt2-medium": dict(d_model=1024, nhead=16, d_ff=4096, seq=1024, batch=8),
    "llama-7b": dict(d_model=4096, nhead=32, d_ff=11008, seq=2048, batch=2),
}
QUICK_SHAPES = ("gpt2-medium",)
DTYPE = torch.bfloat16
NORMS = {"pre_ln": True, "post_ln": False}
DROPOUTS = (0.0, 0.1)
QUICK_CONFIGS = (("pre_ln", 0.0), ("post_ln", 0.1))
TRAIN_PROVIDERS = ("fused_block", "fused_block+graph", "eager", "torch.compile", "torch.compile(fused_block)")
INFER_PROVIDERS = ("fused_block", "eager", "torch.compile", "fast_path")


def flops(d_model, d_ff, seq, batch, mode, **_):
    tokens = batch * seq
    fwd = 2 * tokens * (4 * d_model * d_model + 2 * d_model * d_ff) + 4 * batch * seq * seq * d_model
    return fwd if mode == "fwd" else 3 * fwd


@contextlib.contextmanager
def _fastpath(enabled):
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _layer(provider, norm_first, dropout, d_model, nhead, d_ff, device, dtype):
    """torch's layer from seed 0, converted for the fused providers (same weights for all)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead, d_ff, dropout=dropout, activation="gelu",
                                             batch_first=True, norm_first=norm_first, device=device, dtype=dtype)
    if provider.startswith("fused_block") or provider == "torch.compile(fused_block)":
        import fused_block
        layer = fused_block.convert(layer)
    return layer


def _train_factory(provider, norm_first, dropout, shape):
    def factory():
        layer = _layer(provider, norm_first, dropout, shape["d_model"], shape["nhead"], shape["d_ff"], "cuda", DTYPE)
        layer.train()
        params = tuple(layer.parameters())
        dims = (shape["batch"], shape["seq"], shape["d_model"])

        def make():
            x = harness.randn(*dims, dtype=DTYPE, device="cuda", requires_grad=True)
            return x, harness.randn(*dims, dtype=DTYPE, device="cuda")

        if provider == "fused_block+graph":
            return _graphed(layer, params, make())
        fn = harness.compiled(layer, mode="max-autotune") if provider.startswith("torch.compile") else layer

        def step(inputs):
            x, dy = inputs
            with _fastpath(False), harness.provider_scope(provider):
                return torch.autograd.grad(fn(x), (x,) + params, dy)
        return harness.rotating(make, step, 2 * dims[0] * dims[1] * dims[2] * 2)
    return factory


def _graphed(layer, params, inputs):
    from fused_block import graphs

    def step(x, dy):
        return torch.autograd.grad(layer(x), (x,) + params, dy)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graphed = graphs.capture(step, *inputs)
    torch.cuda.synchronize()

    def replay():
        return graphed()
    replay.peak_mem_bytes = torch.cuda.max_memory_allocated() - base
    return replay


def _infer_factory(provider, norm_first, shape):
    def factory():
        layer = _layer(provider, norm_first, 0.0, shape["d_model"], shape["nhead"], shape["d_ff"], "cuda", DTYPE)
        layer.eval()
        fn = harness.compiled(layer, mode="max-autotune") if provider == "torch.compile" else layer
        fast = provider == "fast_path"
        dims = (shape["batch"], shape["seq"], shape["d_model"])

        def run(x):
            with torch.no_grad(), _fastpath(fast):
                return fn(x)
        return harness.rotating(lambda: harness.randn(*dims, dtype=DTYPE, device="cuda"), run,
                                dims[0] * dims[1] * dims[2] * 2)
    return factory


def _op(norm, dropout):
    return f"block_{norm}" + (f"_p{dropout:g}" if dropout else "")


PROFILE_PROVIDERS = ("fused_block", "fused_block[triton]", "eager", "torch.compile")


def profile_cases() -> list:
    """``python -m bench --profile block``: the Pre-LN GPT-2-medium training step without dropout
    (the issue's case), ours (with the per-key choices, and with every op on our kernels:
    ``[triton]``) beside eager and torch.compile."""
    shape = SHAPES["gpt2-medium"]
    providers = {p: _train_factory(p, True, 0.0, shape) for p in PROFILE_PROVIDERS}
    return [Case(op=_op("pre_ln", 0.0), shape={"model": "gpt2-medium", **shape}, dtype=DTYPE, mode="fwd+bwd",
                 providers=providers, flops=flops(mode="fwd+bwd", **shape))]


def cases(quick: bool) -> list:
    out = []
    for name in (QUICK_SHAPES if quick else SHAPES):
        shape = SHAPES[name]
        configs = QUICK_CONFIGS if quick else [(n, p) for n in NORMS for p in DROPOUTS]
        for norm, dropout in configs:
            providers = {p: _train_factory(p, NORMS[norm], dropout, shape) for p in TRAIN_PROVIDERS}
            out.append(Case(op=_op(norm, dropout), shape={"model": name, **shape}, dtype=DTYPE, mode="fwd+bwd",
                            providers=providers, flops=flops(mode="fwd+bwd", **shape)))
        if not quick:
            for norm, norm_first in NORMS.items():
                providers = {p: _infer_factory(p, norm_first, shape) for p in INFER_PROVIDERS}
                out.append(Case(op=_op(norm, 0.0), shape={"model": name, **shape}, dtype=DTYPE, mode="fwd",
                                providers=providers, flops=flops(mode="fwd", **shape)))
    return out


# ---------------------------------------------------------------------------------------------
# numerics: the fused layer and torch's same-dtype layer against torch's layer in float64
# ---------------------------------------------------------------------------------------------

# d_model 32 with 2 heads (head dim 16, the kernel's smallest), 2 x 12 tokens with a padded
# tail and a causal mask: small enough for the interpreter, and every masked edge runs.
NUMERICS = dict(d_model=32, nhead=2, d_ff=64, seq=12, batch=2)
NUMERICS_DTYPES = (torch.float32, torch.bfloat16)
# A block chains about ten ops whose rounding points differ from torch's (see tests/test_blocks.py).
BLOCK_FACTOR = 4.0


def numerics() -> list:
    import copy

    try:
        import fused_block
        fused_block.TransformerEncoderLayer  # noqa: B018 - the op may not exist yet
    except Exception as exc:  # noqa: BLE001
        return [harness.unavailable_row(_op(n, 0.0), harness.describe_error(exc)) for n in NORMS]
    n = NUMERICS
    dev = harness.DEVICE
    case = f"{n['batch']}x{n['seq']}x{n['d_model']}"
    rows = []
    for norm, norm_first in NORMS.items():
        for dtype in NUMERICS_DTYPES:
            ref = _layer("eager", norm_first, 0.0, n["d_model"], n["nhead"], n["d_ff"], dev, torch.float64)
            with torch.no_grad():
                for p in ref.parameters():
                    p.add_(0.1 * torch.randn_like(p))
            base = copy.deepcopy(ref).to(dtype)
            ours = fused_block.convert(copy.deepcopy(base))
            x = torch.randn(n["batch"], n["seq"], n["d_model"], device=dev, dtype=torch.float64)
            dy = torch.randn_like(x)
            kpm = torch.zeros(n["batch"], n["seq"], dtype=torch.bool, device=dev)
            kpm[0, -3:] = True
            mask = torch.ones(n["seq"], n["seq"], dtype=torch.bool, device=dev).triu(1)  # causal, bool like kpm
            results = []
            for layer, dt in ((ours, dtype), (ref, torch.float64), (base, dtype)):
                xi = x.to(dt).requires_grad_(True)
                y = layer(xi, src_mask=mask, src_key_padding_mask=kpm, is_causal=True)
                (dx,) = torch.autograd.grad(y, (xi,), dy.to(dt))
                results.append((y, dx))
            for i, name in enumerate(("out", "dx")):
                rows.append(harness.compare(_op(norm, 0.0), case, name, results[0][i], results[1][i], results[2][i],
                                            factor=BLOCK_FACTOR))
    return rows
