"""FFN matmuls with fused epilogues: ``fused_block.linear`` (+ bias + GELU) and ``fused_block.mlp``.

Ops:
- ``linear_gelu``: ``gelu(x @ W1.T + b1)``, the FFN's first layer; x (T, d), W1 (4d, d).
- ``mlp``: the whole FFN ``gelu(x @ W1.T + b1) @ W2.T + b2``.

Providers: ``fused_block`` (ours); ``eager`` (``F.linear`` then ``F.gelu``); ``torch.compile``
(max-autotune) of the eager function; ``addmm_gelu`` (``linear_gelu`` only: PyTorch's
cuBLASLt bias + GELU epilogue, ``torch._addmm_activation``; its GELU is the tanh
approximation); ``cublas``: the bare matmul(s) of the same shapes without any epilogue, the
ceiling a fused epilogue should approach.

Shapes: GPT-2 small, medium, large and XL FFNs (d = 768, 1024, 1280, 1600; d_ff = 4d) and a
LLaMA-7B-sized FFN (d = 4096, d_ff = 11008, here with GELU), with 8k and 16k tokens.

FLOPs (T tokens, d, F = d_ff), counting only the matmuls (2 per multiply-add):
- linear_gelu: fwd 2 T d F; bwd 4 T d F (dX and dW1); fwd+bwd 6 T d F.
- mlp: fwd 4 T d F; bwd 8 T d F (dX, dW1, dH, dW2); fwd+bwd 12 T d F.
Bytes are not given: these cases are compute-bound, so TFLOP/s and % of the cuBLAS ceiling
are the figures to read.
"""
import torch
import torch.nn.functional as F

from bench import harness
from bench.harness import Case

OPS = ("linear_gelu", "mlp")
MODELS = {"gpt2-s": (768, 3072), "gpt2-m": (1024, 4096), "gpt2-l": (1280, 5120),
          "gpt2-xl": (1600, 6400), "llama-7b": (4096, 11008)}
TOKENS = (8192, 16384)
DTYPES = (torch.bfloat16, torch.float16)
# --quick: the smallest and the largest FFN, 8k tokens, bf16 (torch.compile max-autotune's
# compile time dominates otherwise).
QUICK_MODELS = ("gpt2-s", "llama-7b")
QUICK_TOKENS = (8192,)
QUICK_DTYPES = (torch.bfloat16,)


def flops(op: str, mode: str, tokens: int, d: int, f: int) -> int:
    per_gemm = 2 * tokens * d * f
    gemms = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[mode] * (2 if op == "mlp" else 1)
    return gemms * per_gemm


# ---------------------------------------------------------------------------------------------
# implementations: linear_gelu takes (x, w1, b1); mlp takes (x, w1, b1, w2, b2)
# ---------------------------------------------------------------------------------------------

def _eager(op):
    if op == "linear_gelu":
        return lambda x, w1, b1: F.gelu(F.linear(x, w1, b1))
    return lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _ours(op):
    import fused_block

    if op == "linear_gelu":
        return lambda x, w1, b1: fused_block.linear(x, w1, b1, "gelu")
    return lambda x, w1, b1, w2, b2: fused_block.mlp(x, w1, b1, w2, b2, "gelu")


def _compiled(op):
    return harness.compiled(_eager(op), mode="max-autotune")


def _addmm_gelu(op):
    if op != "linear_gelu":
        raise NotImplementedError("cuBLASLt's bias + GELU epilogue is a single-GEMM op")
    return lambda x, w1, b1: torch._addmm_activation(b1, x, w1.t(), use_gelu=True)


def _cublas(op):
    if op == "linear_gelu":
        return lambda x, w1, b1: torch.matmul(x, w1.t())
    return lambda x, w1, b1, w2, b2: torch.matmul(torch.matmul(x, w1.t()), w2.t())


IMPLS = {"fused_block": _ours, "eager": _eager, "torch.compile": _compiled, "addmm_gelu": _addmm_gelu,
         "cublas": _cublas}


# ---------------------------------------------------------------------------------------------
# timing cases
# ---------------------------------------------------------------------------------------------

def _make_inputs(op, tokens, d, f, dtype, requires_grad, device=None):
    """The op's arguments and the incoming gradient of its output."""
    x = harness.randn(tokens, d, dtype=dtype, device=device, requires_grad=requires_grad)
    w1 = harness.randn(f, d, dtype=dtype, device=device, scale=d ** -0.5, requires_grad=requires_grad)
    b1 = harness.randn(f, dtype=dtype, device=device, scale=0.1, requires_grad=requires_grad)
    if op == "linear_gelu":
        return (x, w1, b1), harness.randn(tokens, f, dtype=dtype, device=device)
    w2 = harness.randn(d, f, dtype=dtype, device=device, scale=f ** -0.5, requires_grad=requires_grad)
    b2 = harness.randn(d, dtype=dtype, device=device, scale=0.1, requires_grad=requires_grad)
    return (x, w1, b1, w2, b2), harness.randn(tokens, d, dtype=dtype, device=device)


def _set_bytes(op, tokens, d, f, dtype):
    elem = torch.empty((), dtype=dtype).element_size()
    n = tokens * d + f * d + (tokens * f if op == "linear_gelu" else d * f)
    return n * elem


def _factory(provider, op, tokens, d, f, dtype, mode):
    def factory():
        impl = IMPLS[provider](op)
        set_bytes = _set_bytes(op, tokens, d, f, dtype)
        if mode == "fwd":
            def make():
                return _make_inputs(op, tokens, d, f, dtype, False)[0]
            return harness.rotating(make, lambda args: impl(*args), set_bytes)
        if mode == "fwd+bwd":
            def make():
                return _make_inputs(op, tokens, d, f, dtype, True)

            def run(inputs):
                args, grad = inputs
                return torch.autograd.grad(impl(*args), args, grad)
            return harness.rotating(make, run, set_bytes)

        def make_bwd():  # the forward graph is built once; only the backward is timed
            args, grad = _make_inputs(op, tokens, d, f, dtype, True)
            return harness.backward_fn((impl(*args),), (grad,), args)
        return harness.rotating(make_bwd, lambda bwd: bwd(), 2 * set_bytes)
    return factory


def cases(quick: bool) -> list:
    out = []
    models = QUICK_MODELS if quick else tuple(MODELS)
    for op in OPS:
        for dtype in (QUICK_DTYPES if quick else DTYPES):
            for mode in harness.MODES:
                for model in models:
                    d, f = MODELS[model]
                    for tokens in (QUICK_TOKENS if quick else TOKENS):
                        providers = {p: _factory(p, op, tokens, d, f, dtype, mode) for p in IMPLS}
                        out.append(Case(op=op, shape={"model": model, "tokens": tokens, "d": d, "d_ff": f},
                                        dtype=dtype, mode=mode, providers=providers,
                                        flops=flops(op, mode, tokens, d, f)))
    return out


# ---------------------------------------------------------------------------------------------
# numerics: ours and torch same-dtype against the float64 reference
# ---------------------------------------------------------------------------------------------

# 37 tokens (odd: masked rows), d = 96, d_ff = 200 (not tile multiples): cheap in the interpreter.
NUMERICS_SHAPE = (37, 96, 200)
NUMERICS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _run(fn, args, grad):
    leaves = tuple(a.detach().clone().requires_grad_(True) for a in args)
    out = fn(*leaves)
    return (out,) + torch.autograd.grad(out, leaves, grad)


def numerics() -> list:
    from fused_block import reference

    rows = []
    tokens, d, f = NUMERICS_SHAPE
    case = f"{tokens}x{d}x{f}"
    refs = {"linear_gelu": lambda x, w1, b1, **kw: reference.linear(x, w1, b1, "gelu", **kw),
            "mlp": lambda x, w1, b1, w2, b2, **kw: reference.mlp(x, w1, b1, w2, b2, "gelu", **kw)}
    names = {"linear_gelu": ("out", "dx", "dw1", "db1"),
             "mlp": ("out", "dx", "dw1", "db1", "dw2", "db2")}
    for op in OPS:
        try:
            ours = _ours(op)
        except Exception as exc:  # noqa: BLE001 - the op may not be written yet
            rows.append(harness.unavailable_row(op, harness.describe_error(exc), case))
            continue
        for dtype in NUMERICS_DTYPES:
            torch.manual_seed(0)
            args, grad = _make_inputs(op, tokens, d, f, dtype, False, device=harness.DEVICE)
            try:
                got = _run(ours, args, grad)
            except Exception as exc:  # noqa: BLE001
                rows.append(harness.unavailable_row(op, harness.describe_error(exc), case))
                continue
            want = _run(refs[op], tuple(a.double() for a in args), grad.double())
            # fp32: our GEMMs use TF32 on the GPU, so torch's baseline does too.
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                base = _run(lambda *a: refs[op](*a, compute_dtype=dtype), args, grad)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            for name, a, r, b in zip(names[op], got, want, base):
                rows.append(harness.compare(op, case, name, a, r, b))
    return rows
