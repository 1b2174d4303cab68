"""Fused softmax attention: ``fused_block.attention`` vs SDPA's backends and eager math attention.

Providers (same bf16 q, k, v of shape (B, H, L, D), self-attention, no dropout):

- ``fused_block``: ``fused_block.attention`` (the Triton FlashAttention-style kernels) on
  contiguous (B, H, L, D) tensors.
- ``fused_block_qkvpacked``: ``fused_block.attention_qkvpacked`` on the (B, L, 3 * H * D)
  output of a QKV projection, returning (B, L, H * D): the layers' path (no split, merge or
  gradient concatenation).
- ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``:
  ``torch.nn.functional.scaled_dot_product_attention`` restricted to one backend with
  ``torch.nn.attention.sdpa_kernel``; a backend the machine or shape lacks is reported
  unavailable with torch's reason.
- ``eager``: ``softmax(q k^T * scale + causal mask) v`` written out in eager PyTorch (the
  L x L score matrix materialized).

Shapes (causal and not): the issue's B=4 H=16 L=4096 D=128 and B=8 H=32 L=2048 D=64, a long
sequence (L=8192), and short ones (L=512, 1024 at 16k tokens), where launch and tail effects
matter. ``--quick``: B=4 H=16 L=4096 D=128 and B=8 H=32 L=2048 D=64. Modes: forward,
backward (of a forward built once, gradients of q, k, v) and forward+backward.

FLOPs: ``4 * B * H * L^2 * D`` for the forward (QK^T and PV, 2 FLOPs per multiply-add),
halved for causal; backward is 2.5x the forward (five products instead of two; our kernel
recomputes QK^T and dO V^T in its dQ programs, seven in all, and is still credited five), so
``fwd+bwd`` counts 3.5x. No ``bytes``: attention at these sizes is compute bound; the harness
reports % of the measured cuBLAS bf16 matmul rate.

Targets on an H200 in bf16 (issue 10; a benchmark, not a test): at D=128 and L >= 4096
forward >= 450 TFLOP/s causal and non-causal, backward >= 300, forward+backward at least SDPA
flash's and within 0.8x of SDPA's default (cuDNN); at D=64 forward+backward >= SDPA flash; no
regression against SDPA flash at L = 512, 1024.
"""
import math

import torch

from bench import harness
from bench.harness import Case

# (batch, heads, seq, head_dim)
SHAPES = ((4, 16, 4096, 128), (8, 32, 2048, 64), (2, 16, 8192, 128), (16, 16, 1024, 128), (32, 16, 512, 128),
          (16, 32, 1024, 64), (32, 32, 512, 64))
QUICK_SHAPES = ((4, 16, 4096, 128), (8, 32, 2048, 64))
DTYPE = torch.bfloat16
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
PROVIDERS = ("fused_block", "fused_block_qkvpacked") + tuple(SDPA_BACKENDS) + ("eager",)
BWD_FACTOR = 2.5


def flops(batch, heads, seq, head_dim, causal, mode):
    fwd = 4 * batch * heads * seq * seq * head_dim
    if causal:
        fwd //= 2
    return {"fwd": fwd, "bwd": int(BWD_FACTOR * fwd), "fwd+bwd": int((1 + BWD_FACTOR) * fwd)}[mode]


def eager_attention(q, k, v, causal):
    """Math attention in eager PyTorch: materializes the (B, H, Lq, Lk) scores."""
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        lq, lk = s.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def _attention_fn(provider, causal, heads):
    """``fn(*inputs)`` for the provider; inputs are (q, k, v), or (qkv,) for the packed one."""
    if provider == "fused_block":
        import fused_block

        return lambda q, k, v: fused_block.attention(q, k, v, causal=causal)
    if provider == "fused_block_qkvpacked":
        import fused_block

        return lambda qkv: fused_block.attention_qkvpacked(qkv, heads, causal=causal)
    if provider == "eager":
        return lambda q, k, v: eager_attention(q, k, v, causal)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[provider])

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


def _factory(provider, shape, mode):
    def factory():
        fn = _attention_fn(provider, shape["causal"], shape["heads"])
        B, H, L, D = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
        packed = provider == "fused_block_qkvpacked"
        in_shapes = [(B, L, 3 * H * D)] if packed else [(B, H, L, D)] * 3
        out_shape = (B, L, H * D) if packed else (B, H, L, D)
        set_bytes = 4 * B * H * L * D * 2

        def make(grad):
            ins = tuple(harness.randn(*s, dtype=DTYPE, device="cuda", requires_grad=grad) for s in in_shapes)
            return ins + ((harness.randn(*out_shape, dtype=DTYPE, device="cuda"),) if grad else ())

        if mode == "fwd":
            def run(inputs):
                with torch.no_grad():
                    return fn(*inputs)
            return harness.rotating(lambda: make(False), run, set_bytes)
        if mode == "bwd":
            *ins, dout = make(True)
            return harness.backward_fn((fn(*ins),), (dout,), ins)

        def step(inputs):
            *ins, dout = inputs
            return torch.autograd.grad(fn(*ins), ins, dout)
        return harness.rotating(lambda: make(True), step, set_bytes)
    return factory


def cases(quick: bool) -> list:
    out = []
    for batch, heads, seq, head_dim in QUICK_SHAPES if quick else SHAPES:
        for causal in (False, True):
            shape = dict(batch=batch, heads=heads, seq=seq, head_dim=head_dim, causal=causal)
            for mode in harness.MODES:
                out.append(Case(op="attention", shape=shape, dtype=DTYPE, mode=mode,
                                providers={p: _factory(p, shape, mode) for p in PROVIDERS},
                                flops=flops(mode=mode, **shape)))
    return out


# ---------------------------------------------------------------------------------------------
# numerics: fused_block.attention and the same-dtype reference against the float64 reference
# ---------------------------------------------------------------------------------------------

# Small enough for the interpreter: self-attention over 64 tokens (whole blocks), and a causal
# cross-attention 17 x 100 with GQA 4:2 and padding (partial blocks, bottom-right diagonal).
NUMERICS_CASES = (
    dict(B=2, Hq=2, Hkv=2, Lq=64, Lk=64, D=64, causal=False, padding=False),
    dict(B=2, Hq=4, Hkv=2, Lq=17, Lk=100, D=64, causal=True, padding=True),
)
NUMERICS_DTYPES = (torch.float16, torch.bfloat16)


def numerics() -> list:
    try:
        from fused_block import reference
        from fused_block.attention import attention
    except Exception as exc:  # noqa: BLE001 - the op may not exist yet
        return [harness.unavailable_row("attention", harness.describe_error(exc))]
    dev = harness.DEVICE
    rows = []
    for c in NUMERICS_CASES:
        label = f"{c['B']}x{c['Hq']}:{c['Hkv']}x{c['Lq']}x{c['Lk']}x{c['D']}{' causal' if c['causal'] else ''}"
        for dtype in NUMERICS_DTYPES:
            torch.manual_seed(0)
            q = harness.randn(c["B"], c["Hq"], c["Lq"], c["D"], dtype=dtype, device=dev, requires_grad=True)
            k = harness.randn(c["B"], c["Hkv"], c["Lk"], c["D"], dtype=dtype, device=dev, requires_grad=True)
            v = harness.randn(c["B"], c["Hkv"], c["Lk"], c["D"], dtype=dtype, device=dev, requires_grad=True)
            mask = None
            if c["padding"]:
                mask = torch.zeros(c["B"], c["Lk"], dtype=torch.bool, device=dev)
                mask[0, -30:] = True
            dout = harness.randn(c["B"], c["Hq"], c["Lq"], c["D"], dtype=dtype, device=dev)
            results = []
            for fn, dt in ((attention, dtype), (reference.attention, torch.float64), (reference.attention, dtype)):
                leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
                kw = {"compute_dtype": dtype} if fn is reference.attention and dt == dtype else {}
                out = fn(*leaves, c["causal"], None, mask, **kw)
                results.append((out,) + torch.autograd.grad(out, leaves, dout.to(dt)))
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                rows.append(harness.compare("attention", label, name, results[0][i], results[1][i], results[2][i]))
    return rows
