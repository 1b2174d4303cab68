"""Residual add + LayerNorm / RMSNorm: ``fused_block.add_layer_norm`` and ``add_rms_norm``.

Providers: ``fused_block`` (ours), ``eager`` (``h = x + residual`` then ``F.layer_norm`` /
``F.rms_norm``), ``torch.compile`` of the same eager function (default mode under ``--quick``,
``max-autotune`` in the full run), and ``liger`` when Liger-Kernel is installed (RMSNorm: its fused
add + RMSNorm; LayerNorm: the add, then its LayerNorm). Each returns ``(out, residual_out)``.
16384 rows (a batch of 16 x 1024 tokens), hidden 768 (GPT-2) to 16384; weight and bias have the
activations' dtype; no dropout. Targets (issue 12, H200, bf16, hidden 1024-16384): forward >=
90% of the copy ceiling, fwd+bwd >= 70% by these counted bytes, >= 1.1x torch.compile.

Minimum bytes moved, with N rows, H hidden, e bytes per element, P parameter vectors (LayerNorm:
weight and bias, P = 2; RMSNorm: weight, P = 1) and S fp32 statistics per row (LayerNorm: mean
and rstd, S = 2; RMSNorm: rstd, S = 1):

- fwd: read x and residual, write out and residual_out (4 N H e), read the parameters (P H e).
  Inference needs no statistics, so none are counted.
- bwd: read dout, the gradient arriving on residual_out and residual_out itself (3 N H e),
  write one N x H gradient (N H e): without dropout, dx and dresidual are the same tensor (as
  in eager PyTorch, whose AddBackward passes one gradient to both inputs); read the weight
  (H e), write dweight (and dbias) (P H e), read the statistics (4 S N).
- fwd+bwd: fwd + bwd + writing the statistics (4 S N).
"""
import torch
import torch.nn.functional as F

from bench import harness
from bench.harness import Case

OPS = ("add_layer_norm", "add_rms_norm")
ROWS = 16384
HIDDEN = (768, 1024, 2048, 4096, 8192, 16384)  # the targets' range, and GPT-2's 768
DTYPES = (torch.bfloat16, torch.float16)
# --quick: two widths (one that the targets cover from 1024 up, one typical model
# width), bf16 only, so torch.compile's compile time stays within the GPU script's budget.
QUICK_HIDDEN = (1024, 4096)
QUICK_DTYPES = (torch.bfloat16,)
EPS = 1e-5


def _is_ln(op):
    return op == "add_layer_norm"


def min_bytes(op: str, mode: str, rows: int, hidden: int, elem: int) -> int:
    """The minimum bytes moved, as counted in the module docstring."""
    p = 2 if _is_ln(op) else 1
    s = 2 if _is_ln(op) else 1
    fwd = 4 * rows * hidden * elem + p * hidden * elem
    bwd = 4 * rows * hidden * elem + (1 + p) * hidden * elem + 4 * s * rows
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return bwd
    return fwd + bwd + 4 * s * rows


# ---------------------------------------------------------------------------------------------
# implementations: each takes (x, residual, weight, bias) and returns (out, residual_out)
# ---------------------------------------------------------------------------------------------

def _eager(op):
    if _is_ln(op):
        def fn(x, residual, weight, bias):
            h = x + residual
            return F.layer_norm(h, h.shape[-1:], weight, bias, EPS), h
    else:
        def fn(x, residual, weight, bias):
            h = x + residual
            return F.rms_norm(h, h.shape[-1:], weight, EPS), h
    return fn


def _ours(op):
    import fused_block

    if _is_ln(op):
        f = fused_block.add_layer_norm
        return lambda x, residual, weight, bias: f(x, residual, weight, bias, eps=EPS)
    f = fused_block.add_rms_norm
    return lambda x, residual, weight, bias: f(x, residual, weight, eps=EPS)


def _compiled(op):
    # harness.compiled drops the mode under --quick (torch.compile's default mode there).
    return harness.compiled(_eager(op), mode="max-autotune")


def _liger(op):
    from liger_kernel.transformers import functional as liger

    if _is_ln(op):
        def fn(x, residual, weight, bias):
            h = x + residual
            return liger.liger_layer_norm(h, weight, bias, EPS), h
    elif hasattr(liger, "liger_fused_add_rms_norm"):
        def fn(x, residual, weight, bias):
            # in_place=False: Liger would otherwise overwrite the incoming gradient with dx.
            return liger.liger_fused_add_rms_norm(x, residual, weight, EPS, in_place=False)
    else:  # Liger releases before the fused add
        def fn(x, residual, weight, bias):
            h = x + residual
            return liger.liger_rms_norm(h, weight, EPS, in_place=False), h
    return fn


def _ours_only(op):
    """Ours on our kernels whatever the timed choice (torch's path is a candidate of the op:
    ``fused_block.norm``); the choice is made in the forward, which the backward follows."""
    f = _ours(op)

    def fn(x, residual, weight, bias):
        with harness.provider_scope("fused_block" + harness.TRITON_ONLY):
            return f(x, residual, weight, bias)
    return fn


IMPLS = {"fused_block": _ours, "fused_block" + harness.TRITON_ONLY: _ours_only, "eager": _eager,
         "torch.compile": _compiled, "liger": _liger}


# ---------------------------------------------------------------------------------------------
# timing cases
# ---------------------------------------------------------------------------------------------

def _make_inputs(op, rows, hidden, dtype, requires_grad, device=None):
    """x, residual, weight, bias (bias None for RMSNorm), and the two incoming gradients."""
    x = harness.randn(rows, hidden, dtype=dtype, device=device, requires_grad=requires_grad)
    residual = harness.randn(rows, hidden, dtype=dtype, device=device, requires_grad=requires_grad)
    weight = (1.0 + 0.1 * harness.randn(hidden, dtype=torch.float32, device=device)).to(dtype)
    weight.requires_grad_(requires_grad)
    bias = None
    if _is_ln(op):
        bias = harness.randn(hidden, dtype=dtype, device=device, scale=0.1, requires_grad=requires_grad)
    dout = harness.randn(rows, hidden, dtype=dtype, device=device)
    dresidual_out = harness.randn(rows, hidden, dtype=dtype, device=device)
    return (x, residual, weight, bias), (dout, dresidual_out)


def _params(args):
    return tuple(a for a in args if a is not None)


def _factory(provider, op, rows, hidden, dtype, mode):
    def factory():
        impl = IMPLS[provider](op)
        tensor_bytes = rows * hidden * torch.empty((), dtype=dtype).element_size()
        if mode == "fwd":
            def make():
                return _make_inputs(op, rows, hidden, dtype, False)[0]
            return harness.rotating(make, lambda args: impl(*args), 2 * tensor_bytes)
        if mode == "fwd+bwd":
            def make():
                return _make_inputs(op, rows, hidden, dtype, True)

            def run(inputs):
                args, grads = inputs
                return torch.autograd.grad(impl(*args), _params(args), grads)
            return harness.rotating(make, run, 4 * tensor_bytes)

        def make_bwd():  # the forward graph is built once; only the backward is timed
            args, grads = _make_inputs(op, rows, hidden, dtype, True)
            return harness.backward_fn(impl(*args), grads, _params(args))
        return harness.rotating(make_bwd, lambda bwd: bwd(), 6 * tensor_bytes)
    return factory


def cases(quick: bool) -> list:
    out = []
    for op in OPS:
        for dtype in (QUICK_DTYPES if quick else DTYPES):
            for mode in harness.MODES:
                for hidden in (QUICK_HIDDEN if quick else HIDDEN):
                    elem = torch.empty((), dtype=dtype).element_size()
                    providers = {p: _factory(p, op, ROWS, hidden, dtype, mode) for p in IMPLS}
                    out.append(Case(op=op, shape={"rows": ROWS, "hidden": hidden}, dtype=dtype, mode=mode,
                                    providers=providers, bytes=min_bytes(op, mode, ROWS, hidden, elem)))
    return out


# ---------------------------------------------------------------------------------------------
# numerics: ours and torch same-dtype against the float64 reference
# ---------------------------------------------------------------------------------------------

# 19 rows (odd: the last forward program has a masked row; ten backward programs of two rows)
# x 1000 (not a power of two: masked tail), small enough for the interpreter on a CPU.
NUMERICS_SHAPE = (19, 1000)
NUMERICS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _run(fn, args, grads):
    """Outputs and gradients of every differentiable input of ``fn(*args)``."""
    leaves = tuple(None if a is None else a.detach().clone().requires_grad_(True) for a in args)
    outs = fn(*leaves)
    params = _params(leaves)
    return tuple(outs) + torch.autograd.grad(outs, params, grads)


def numerics() -> list:
    from fused_block import reference

    rows = []
    rows_n, hidden = NUMERICS_SHAPE
    case = f"{rows_n}x{hidden}"
    for op in OPS:
        try:
            ours = getattr(__import__("fused_block"), op)
        except Exception as exc:  # noqa: BLE001 - the op may not be written yet
            rows.append(harness.unavailable_row(op, harness.describe_error(exc), case))
            continue
        ref = getattr(reference, op)
        names = ("out", "residual_out", "dx", "dresidual", "dweight") + (("dbias",) if _is_ln(op) else ())
        if _is_ln(op):
            def call(f, **kw):
                return lambda x, r, w, b: f(x, r, w, b, 1e-5, **kw)
        else:
            def call(f, **kw):
                return lambda x, r, w, b: f(x, r, w, None, **kw)
        for dtype in NUMERICS_DTYPES:
            torch.manual_seed(0)
            args, grads = _make_inputs(op, rows_n, hidden, dtype, False, device=harness.DEVICE)
            try:
                got = _run(call(ours), args, grads)
            except Exception as exc:  # noqa: BLE001
                rows.append(harness.unavailable_row(op, harness.describe_error(exc), case))
                continue
            args64 = tuple(None if a is None else a.double() for a in args)
            want = _run(call(ref), args64, tuple(g.double() for g in grads))
            base = _run(call(ref, compute_dtype=dtype), args, grads)
            for name, a, r, b in zip(names, got, want, base):
                rows.append(harness.compare(op, case, name, a, r, b))
    return rows
