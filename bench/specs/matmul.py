"""GEMMs with fused epilogues: ``fused_block.linear`` (+ bias + GELU), the FFN ``fused_block.mlp``
(with a residual, with and without dropout) and the SwiGLU FFN ``fused_block.swiglu``.

Ops and providers:
- ``linear_gelu``: ``gelu(x @ W1.T + b1)``, the FFN's first layer; x (T, d), W1 (d_ff, d).
  ``fused_block``; ``cublas``: the bare ``F.linear(x, W1)`` (no bias, no GELU), the ceiling a
  fused epilogue should approach (issue 11: >= 90% of its TFLOP/s); ``eager`` (``F.linear`` then
  ``F.gelu``); ``torch.compile`` of eager (default mode under ``--quick``, max-autotune in the
  full run); ``addmm_gelu``: cuBLASLt's bias + GELU epilogue (``torch._addmm_activation``; its
  GELU is the tanh approximation).
- ``ffn``: ``gelu(x @ W1.T + b1) @ W2.T + b2 + x`` (forward + backward: the training step's
  FFN). ``fused_block``, ``eager``, ``torch.compile``, and ``cublas``: the same six matmuls bare
  (no bias, activation or residual). Peak memory is reported per provider (issue 11: at or below
  eager's).
- ``ffn_dropout``: the FFN with dropout 0.1 on the hidden activation and on the output
  (``fused_block``, ``eager``, ``torch.compile``) and ``fused_block_p0``, ours without dropout:
  its speedup column is dropout's cost (issue 11: at most 10%).
- ``swiglu``: LLaMA's ``(silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T + x`` (no biases): ``fused_block``,
  ``eager`` (Hugging Face's ``LlamaMLP`` arithmetic), ``torch.compile``.
- ``lora_swiglu``: the SwiGLU FFN with PEFT-style LoRA (rank 16, scale 2) on gate, up and down,
  the base weights frozen (LoRA fine-tuning: gradients of x and the adapters only).
  ``fused_block``: ``gated_linear`` + ``linear`` with the low-rank updates inside the GEMMs;
  ``peft_eager``: PEFT's ``base(x) + lora_B(lora_A(x)) * scale`` per projection, eager;
  ``torch.compile`` of it. FLOPs count the base GEMMs only (3 forward, 3 more backward: no dW).

Shapes: GPT-2 small, medium, large and XL FFNs (d = 768, 1024, 1280, 1600; d_ff = 4d) and
LLaMA-7B's (d = 4096, d_ff = 11008; GELU for the non-gated ops), with 8k and 16k tokens. bf16
and fp16 in the full run; ``--quick``: GPT-2 XL (the issue's 8192 x 1600 -> 6400) for the
GELU ops and LLaMA-7B for SwiGLU, 8k tokens, bf16.

FLOPs (T tokens, d, F = d_ff), counting only the matmuls (2 per multiply-add): one GEMM is
``2 T d F``; linear_gelu fwd 1, fwd+bwd 3 GEMMs; ffn fwd 2, fwd+bwd 6; swiglu fwd 3, fwd+bwd 9.
No bytes: these cases are compute bound, so TFLOP/s and % of the measured cuBLAS ceiling are
the figures to read.
"""
import torch
import torch.nn.functional as F

from bench import harness
from bench.harness import Case

MODELS = {"gpt2-s": (768, 3072), "gpt2-m": (1024, 4096), "gpt2-l": (1280, 5120),
          "gpt2-xl": (1600, 6400), "llama-7b": (4096, 11008)}
TOKENS = (8192, 16384)
DTYPES = (torch.bfloat16, torch.float16)
QUICK = {"linear_gelu": ("gpt2-xl",), "ffn": ("gpt2-xl",), "ffn_dropout": ("gpt2-xl",), "swiglu": ("llama-7b",),
         "lora_swiglu": ("llama-7b",)}
QUICK_TOKENS = (8192,)
QUICK_DTYPES = (torch.bfloat16,)
OP_MODES = {"linear_gelu": ("fwd", "fwd+bwd"), "ffn": ("fwd", "fwd+bwd"), "ffn_dropout": ("fwd+bwd",),
            "swiglu": ("fwd", "fwd+bwd"), "lora_swiglu": ("fwd+bwd",)}
QUICK_MODES = {"linear_gelu": ("fwd",), "ffn": ("fwd+bwd",), "ffn_dropout": ("fwd+bwd",), "swiglu": ("fwd+bwd",),
               "lora_swiglu": ("fwd+bwd",)}
DROPOUT = 0.1
LORA_RANK, LORA_SCALE = 16, 2.0
GEMMS = {"linear_gelu": 1, "ffn": 2, "ffn_dropout": 2, "swiglu": 3, "lora_swiglu": 3}  # forward GEMMs of 2 T d F


def flops(op: str, mode: str, tokens: int, d: int, f: int) -> int:
    backward = 1 if op == "lora_swiglu" else 2  # frozen base weights: no dW GEMMs
    return GEMMS[op] * (1 if mode == "fwd" else 1 + backward) * 2 * tokens * d * f


# ---------------------------------------------------------------------------------------------
# implementations: each takes the op's weights then x: (x, w1, b1) / (x, w1, b1, w2, b2) /
# (x, wg, wu, wd)
# ---------------------------------------------------------------------------------------------

def _lora_eager(x, wg, wu, wd, ag, bg, au, bu, ad, bd):
    """PEFT's arithmetic per projection: base(x) + lora_B(lora_A(x)) * scale."""
    def proj(t, w, a, b):
        return F.linear(t, w) + F.linear(F.linear(t, a), b) * LORA_SCALE
    h = F.silu(proj(x, wg, ag, bg)) * proj(x, wu, au, bu)
    return proj(h, wd, ad, bd) + x


def _lora_ours(x, wg, wu, wd, ag, bg, au, bu, ad, bd):
    import fused_block
    from fused_block.linear import gated_linear

    r = ag.shape[0]
    u = torch.cat([F.linear(x, ag), F.linear(x, au)], dim=-1) * LORA_SCALE
    h = gated_linear(x, wg, wu, lora=(u, F.pad(bg, (0, r)), F.pad(bu, (r, 0))))
    return fused_block.linear(h, wd, None, None, x, lora=(F.linear(h, ad) * LORA_SCALE, bd))


def _eager(op):
    if op == "lora_swiglu":
        return _lora_eager
    if op == "linear_gelu":
        return lambda x, w1, b1: F.gelu(F.linear(x, w1, b1))
    if op == "swiglu":
        return lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd) + x
    if op == "ffn_dropout":
        p = DROPOUT
        return lambda x, w1, b1, w2, b2: F.dropout(F.linear(F.dropout(F.gelu(F.linear(x, w1, b1)), p), w2, b2), p) + x
    return lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + x


def _ours(op, dropout=True):
    import fused_block

    if op == "linear_gelu":
        return lambda x, w1, b1: fused_block.linear(x, w1, b1, "gelu")
    if op == "lora_swiglu":
        return _lora_ours
    if op == "swiglu":
        return lambda x, wg, wu, wd: fused_block.swiglu(x, wg, wu, wd, x)
    p = DROPOUT if op == "ffn_dropout" and dropout else 0.0
    return lambda x, w1, b1, w2, b2: fused_block.mlp(x, w1, b1, w2, b2, "gelu", x, p, p)


def _compiled(op, quick):
    return harness.compiled(_eager(op), **({} if quick else {"mode": "max-autotune"}))


def _addmm_gelu(op):
    if op != "linear_gelu":
        raise NotImplementedError("cuBLASLt's bias + GELU epilogue is a single-GEMM op")
    return lambda x, w1, b1: torch._addmm_activation(b1, x, w1.t(), use_gelu=True)


def _cublas(op):
    if op == "linear_gelu":
        return lambda x, w1, b1: F.linear(x, w1)
    if op == "ffn":
        return lambda x, w1, b1, w2, b2: F.linear(F.linear(x, w1), w2)
    raise NotImplementedError("the bare-matmul ceiling is reported for linear_gelu and ffn")


def _providers(op, quick):
    out = {"fused_block": lambda: _ours(op)}
    if op == "ffn_dropout":
        out["fused_block_p0"] = lambda: _ours(op, dropout=False)
    out.update({"peft_eager" if op == "lora_swiglu" else "eager": lambda: _eager(op),
                "torch.compile": lambda: _compiled(op, quick)})
    if op == "linear_gelu":
        out["addmm_gelu"] = lambda: _addmm_gelu(op)
    if op in ("linear_gelu", "ffn"):
        out["cublas"] = lambda: _cublas(op)
    return out


# ---------------------------------------------------------------------------------------------
# timing cases
# ---------------------------------------------------------------------------------------------

def _make_inputs(op, tokens, d, f, dtype, requires_grad, device=None):
    """The op's arguments and the incoming gradient of its output."""
    x = harness.randn(tokens, d, dtype=dtype, device=device, requires_grad=requires_grad)
    if op == "lora_swiglu":  # frozen base weights; the adapters and x take gradients
        ws = [harness.randn(f, d, dtype=dtype, device=device, scale=d ** -0.5) for _ in range(2)]
        wd = harness.randn(d, f, dtype=dtype, device=device, scale=f ** -0.5)
        r = LORA_RANK
        adapters = []
        for n_in, n_out in ((d, f), (d, f), (f, d)):
            adapters += [harness.randn(r, n_in, dtype=dtype, device=device, scale=n_in ** -0.5,
                                       requires_grad=requires_grad),
                         harness.randn(n_out, r, dtype=dtype, device=device, scale=0.1, requires_grad=requires_grad)]
        return (x, *ws, wd, *adapters), harness.randn(tokens, d, dtype=dtype, device=device)
    if op == "swiglu":
        ws = [harness.randn(f, d, dtype=dtype, device=device, scale=d ** -0.5, requires_grad=requires_grad)
              for _ in range(2)]
        wd = harness.randn(d, f, dtype=dtype, device=device, scale=f ** -0.5, requires_grad=requires_grad)
        return (x, *ws, wd), harness.randn(tokens, d, dtype=dtype, device=device)
    w1 = harness.randn(f, d, dtype=dtype, device=device, scale=d ** -0.5, requires_grad=requires_grad)
    b1 = harness.randn(f, dtype=dtype, device=device, scale=0.1, requires_grad=requires_grad)
    if op == "linear_gelu":
        return (x, w1, b1), harness.randn(tokens, f, dtype=dtype, device=device)
    w2 = harness.randn(d, f, dtype=dtype, device=device, scale=f ** -0.5, requires_grad=requires_grad)
    b2 = harness.randn(d, dtype=dtype, device=device, scale=0.1, requires_grad=requires_grad)
    return (x, w1, b1, w2, b2), harness.randn(tokens, d, dtype=dtype, device=device)


def _set_bytes(op, tokens, d, f, dtype):
    elem = torch.empty((), dtype=dtype).element_size()
    weights = {"linear_gelu": 1, "swiglu": 3, "lora_swiglu": 3}.get(op, 2) * f * d
    return (tokens * d + weights + tokens * (f if op == "linear_gelu" else d)) * elem


def _factory(make_impl, op, tokens, d, f, dtype, mode):
    def factory():
        impl = make_impl()
        set_bytes = _set_bytes(op, tokens, d, f, dtype)
        if mode == "fwd":
            return harness.rotating(lambda: _make_inputs(op, tokens, d, f, dtype, False)[0],
                                    lambda args: impl(*args), set_bytes)

        def run(inputs):
            args, grad = inputs
            return torch.autograd.grad(impl(*args), [a for a in args if a.requires_grad], grad)
        return harness.rotating(lambda: _make_inputs(op, tokens, d, f, dtype, True), run, set_bytes)
    return factory


def cases(quick: bool) -> list:
    out = []
    for op in GEMMS:
        models = QUICK[op] if quick else tuple(MODELS)
        for dtype in (QUICK_DTYPES if quick else DTYPES):
            for mode in (QUICK_MODES if quick else OP_MODES)[op]:
                for model in models:
                    d, f = MODELS[model]
                    for tokens in (QUICK_TOKENS if quick else TOKENS):
                        providers = {name: _factory(make, op, tokens, d, f, dtype, mode)
                                     for name, make in _providers(op, quick).items()}
                        out.append(Case(op=op, shape={"model": model, "tokens": tokens, "d": d, "d_ff": f},
                                        dtype=dtype, mode=mode, providers=providers,
                                        flops=flops(op, mode, tokens, d, f)))
    return out


# ---------------------------------------------------------------------------------------------
# numerics: ours and torch same-dtype against the float64 reference
# ---------------------------------------------------------------------------------------------

# 37 tokens (odd: clipped rows), d = 96, d_ff = 200 (not tile multiples): cheap in the interpreter.
NUMERICS_SHAPE = (37, 96, 200)
NUMERICS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAMES = {"linear_gelu": ("out", "dx", "dw1", "db1"), "ffn": ("out", "dx", "dw1", "db1", "dw2", "db2"),
          "swiglu": ("out", "dx", "dwg", "dwu", "dwd"),
          "lora_swiglu": ("out", "dx", "dA_gate", "dB_gate", "dA_up", "dB_up", "dA_down", "dB_down")}


def _run(fn, args, grad):
    leaves = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
    out = fn(*leaves)
    return (out,) + torch.autograd.grad(out, [a for a in leaves if a.requires_grad], grad)


def _refs():
    from fused_block import reference

    def lora_ref(x, wg, wu, wd, ag, bg, au, bu, ad, bd, **kw):
        def u_of(t, a):
            return reference.linear(t, a, **kw) * LORA_SCALE
        r = ag.shape[0]
        u = torch.cat([u_of(x, ag), u_of(x, au)], dim=-1)
        h = reference.gated(x, wg, wu, lora=(u, F.pad(bg, (0, r)), F.pad(bu, (r, 0))), **kw)
        return reference.linear(h, wd, None, None, x, lora=(u_of(h, ad), bd), **kw)

    return {"lora_swiglu": lora_ref,
            "linear_gelu": lambda x, w1, b1, **kw: reference.linear(x, w1, b1, "gelu", **kw),
            "ffn": lambda x, w1, b1, w2, b2, **kw: reference.mlp(x, w1, b1, w2, b2, "gelu", x, **kw),
            "swiglu": lambda x, wg, wu, wd, **kw: reference.swiglu(x, wg, wu, wd, x, **kw)}


def numerics() -> list:
    """fp32 runs in torch's default precision (IEEE products), which the kernels follow."""
    rows = []
    tokens, d, f = NUMERICS_SHAPE
    case = f"{tokens}x{d}x{f}"
    for op in _NAMES:
        try:
            ours, refs = _ours(op), _refs()
        except Exception as exc:  # noqa: BLE001 - the op may not be written yet
            rows.append(harness.unavailable_row(op, harness.describe_error(exc), case))
            continue
        for dtype in NUMERICS_DTYPES:
            torch.manual_seed(0)
            args, grad = _make_inputs(op, tokens, d, f, dtype, op == "lora_swiglu", device=harness.DEVICE)
            if op != "lora_swiglu":  # every input differentiable; LoRA: the adapters and x
                args = tuple(a.detach().requires_grad_(True) for a in args)
            try:
                got = _run(ours, args, grad)
            except Exception as exc:  # noqa: BLE001
                rows.append(harness.unavailable_row(op, harness.describe_error(exc), case))
                continue
            want = _run(refs[op], tuple(a.detach().double().requires_grad_(a.requires_grad) for a in args),
                        grad.double())
            base = _run(lambda *a: refs[op](*a, compute_dtype=dtype), args, grad)
            for name, a, r, b in zip(_NAMES[op], got, want, base):
                rows.append(harness.compare(op, case, name, a, r, b))
    return rows
