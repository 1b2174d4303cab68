"""A whole Transformer encoder block: ``fused_block.TransformerEncoderLayer`` vs torch's.

Providers (each one builds the layer with the same configuration on the GPU in bf16):

- ``fused_block``: the fused layer (add+norm kernels, QKV/FFN GEMMs with epilogues, fused
  attention).
- ``eager``: ``torch.nn.TransformerEncoderLayer``, with torch's inference fast path switched
  off (``torch.backends.mha.set_fastpath_enabled(False)``) so it is the plain module.
- ``torch.compile``: ``torch.compile`` of that module.
- ``fast_path`` (``fwd`` only): torch's native inference path
  (``torch._transformer_encoder_layer_fwd``), which ``nn.TransformerEncoderLayer`` takes in
  eval mode under ``no_grad``.

Modes: ``fwd`` is inference (eval, ``no_grad``); ``fwd+bwd`` is a training step's forward and
backward (train mode, dropout 0 so every provider does the same arithmetic), gradients of the
input and every parameter. ``op`` is ``block_pre_ln`` (``norm_first=True``) or
``block_post_ln``. GELU activation, bias, batch_first.

Shapes: GPT-2-medium-sized (d 1024, 16 heads, d_ff 4096, seq 2048, batch 8) and LLaMA-7B-sized
(d 4096, 32 heads, seq 2048, batch 2, d_ff 11008, LLaMA's FFN width, here with a plain GELU
FFN since torch's layer has no gated one). bf16.

FLOPs (no ``bytes``: a block is compute bound): the matmuls, ``2 T (4 d^2 + 2 d d_ff)`` with
T = batch * seq tokens, plus attention ``4 B L^2 d`` (QK^T and PV); backward is twice the
forward, so ``fwd+bwd`` counts 3x. Norms, bias and activations are not counted.

Targets on an H200 (from the issue; a benchmark, not a test): training step at least 1.3x
faster than eager and 1.05x faster than torch.compile, peak memory at most 0.8x eager's.
"""
import contextlib

import torch

from bench import harness
from bench.harness import Case

SHAPES = {
    "gpt2-medium": dict(d_model=1024, nhead=16, d_ff=4096, seq=2048, batch=8),
    "llama-7b": dict(d_model=4096, nhead=32, d_ff=11008, seq=2048, batch=2),
}
QUICK_SHAPES = ("gpt2-medium",)
DTYPE = torch.bfloat16
MODES = ("fwd", "fwd+bwd")
OPS = {"block_pre_ln": True, "block_post_ln": False}


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


def _layer(provider, norm_first, d_model, nhead, d_ff, device, dtype):
    import fused_block

    cls = fused_block.TransformerEncoderLayer if provider == "fused_block" else torch.nn.TransformerEncoderLayer
    torch.manual_seed(0)
    return cls(d_model, nhead, d_ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first,
               device=device, dtype=dtype)


def _factory(provider, norm_first, shape, mode):
    def factory():
        layer = _layer(provider, norm_first, shape["d_model"], shape["nhead"], shape["d_ff"], "cuda", DTYPE)
        layer.train(mode != "fwd")
        fn = harness.compiled(layer) if provider == "torch.compile" else layer
        dims = (shape["batch"], shape["seq"], shape["d_model"])
        params = tuple(layer.parameters())
        act_bytes = shape["batch"] * shape["seq"] * shape["d_model"] * 2
        if mode == "fwd":
            fast = provider == "fast_path"

            def run(x):
                with torch.no_grad(), _fastpath(fast):
                    return fn(x)
            return harness.rotating(lambda: harness.randn(*dims, dtype=DTYPE, device="cuda"), run, act_bytes)

        def make():
            x = harness.randn(*dims, dtype=DTYPE, device="cuda", requires_grad=True)
            return x, harness.randn(*dims, dtype=DTYPE, device="cuda")

        def step(inputs):
            x, dy = inputs
            with _fastpath(False):
                return torch.autograd.grad(fn(x), (x,) + params, dy)
        return harness.rotating(make, step, 2 * act_bytes)
    return factory


def cases(quick: bool) -> list:
    out = []
    for op, norm_first in OPS.items():
        for name in (QUICK_SHAPES if quick else SHAPES):
            shape = SHAPES[name]
            for mode in MODES:
                providers = {p: _factory(p, norm_first, shape, mode) for p in ("fused_block", "eager", "torch.compile")}
                if mode == "fwd":
                    providers["fast_path"] = _factory("fast_path", norm_first, shape, mode)
                out.append(Case(op=op, shape={"model": name, **shape}, dtype=DTYPE, mode=mode, providers=providers,
                                flops=flops(mode=mode, **shape)))
    return out


# ---------------------------------------------------------------------------------------------
# numerics: the fused layer and torch's same-dtype layer against torch's layer in float64
# ---------------------------------------------------------------------------------------------

# d_model 64 with 4 heads (head dim 16, the kernel's smallest), 2 x 24 tokens with a padded
# tail and a causal mask: small enough for the interpreter, and every masked edge runs.
NUMERICS = dict(d_model=64, nhead=4, d_ff=128, seq=24, batch=2)
NUMERICS_DTYPES = (torch.float32, torch.bfloat16)
# A block chains about ten ops whose rounding points differ from torch's (see tests/test_blocks.py).
BLOCK_FACTOR = 4.0


def numerics() -> list:
    import copy

    try:
        import fused_block
        fused_block.TransformerEncoderLayer  # noqa: B018 - the op may not exist yet
    except Exception as exc:  # noqa: BLE001
        return [harness.unavailable_row(op, harness.describe_error(exc)) for op in OPS]
    n = NUMERICS
    dev = harness.DEVICE
    case = f"{n['batch']}x{n['seq']}x{n['d_model']}"
    rows = []
    for op, norm_first in OPS.items():
        for dtype in NUMERICS_DTYPES:
            torch.manual_seed(0)
            ref = _layer("eager", norm_first, n["d_model"], n["nhead"], n["d_ff"], dev, torch.float64)
            with torch.no_grad():
                for p in ref.parameters():
                    p.add_(0.1 * torch.randn_like(p))
            base = copy.deepcopy(ref).to(dtype)
            ours = _layer("fused_block", norm_first, n["d_model"], n["nhead"], n["d_ff"], dev, dtype)
            ours.load_state_dict(base.state_dict())
            x = torch.randn(n["batch"], n["seq"], n["d_model"], device=dev, dtype=torch.float64)
            dy = torch.randn_like(x)
            kpm = torch.zeros(n["batch"], n["seq"], dtype=torch.bool, device=dev)
            kpm[0, -5:] = True
            mask = torch.ones(n["seq"], n["seq"], dtype=torch.bool, device=dev).triu(1)  # causal, bool like kpm
            results = []
            for layer, dt in ((ours, dtype), (ref, torch.float64), (base, dtype)):
                xi = x.to(dt).requires_grad_(True)
                y = layer(xi, src_mask=mask, src_key_padding_mask=kpm, is_causal=True)
                (dx,) = torch.autograd.grad(y, (xi,), dy.to(dt))
                results.append((y, dx))
            for i, name in enumerate(("out", "dx")):
                rows.append(harness.compare(op, case, name, results[0][i], results[1][i], results[2][i],
                                            factor=BLOCK_FACTOR))
    return rows
