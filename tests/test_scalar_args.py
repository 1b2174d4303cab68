"""Scalar arguments as torch's own ops take them: numpy scalars, and ``eps=0`` for the norms.

torch's argument parser takes numpy integer and floating scalars for a float argument
(``F.layer_norm``'s eps, SDPA's ``dropout_p`` and ``scale``), numpy integers for an int one
(``F.cross_entropy``'s ``ignore_index``), and refuses numpy's bool where a bool is required
(SDPA's ``is_causal``); its norms take ``eps=0``. The public functions follow (the refusals
are in tests/test_bad_inputs.py, the layers' constructors in tests/test_blocks.py). Each numpy
kind is exercised once per op family (norms, attention, rope, loss, linear layers) against the
float64 reference, with the kernels proven to run (``launches``) and to receive Python scalars
only (``numpy_args``: the conversion happens once, at the public boundary, so the kernels'
argument specializations and config caches never see a numpy scalar).

Shapes are tiny (the interpreter): the numerics of each op are covered by its own test file;
these cases prove that a numpy scalar means what the Python number means.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fused_block
from fused_block import _backend, reference
from fused_block.kernels import attention as kattention
from fused_block.kernels import common
from attention_testing import check as check_attention
from gemm_testing import baseline_mode, fp32_mode, kernel_masks, seeded
from gemm_testing import check as check_gemm
from numerics import DTYPES, assert_close, randn


@pytest.fixture
def numpy_args(monkeypatch):
    """(kernel, type name) of every numpy scalar that reaches a launch; the tests assert none does."""
    seen = []
    launch = common.launch

    def record(name, kernel, grid, args, constexprs, config):
        values = (*(grid if isinstance(grid, tuple) else ()), *args, *constexprs.values())
        seen.extend((name, type(a).__name__) for a in values if type(a).__module__ == "numpy")
        return launch(name, kernel, grid, args, constexprs, config)

    monkeypatch.setattr(common, "launch", record)
    return seen


def _compare(names, outs, ref, inputs, dtype):
    """``outs`` (the kernels' outputs from ``inputs``) and the gradients of every input against
    ``ref(*inputs)`` in float64, PyTorch's error from ``ref(..., compute_dtype=dtype)``."""
    as64 = [t.detach().double().requires_grad_() for t in inputs]
    low = [t.detach().clone().requires_grad_() for t in inputs]
    want, base = ref(*as64), ref(*low, compute_dtype=dtype)
    for name, a, r, b in zip(names, outs, want, base):
        assert a.dtype == dtype
        assert_close(name, a, r, b)
    gouts = [torch.randn(o.shape, dtype=torch.float64, device=o.device) for o in outs]

    def grads(os, ins):
        return torch.autograd.grad(sum((o.double() * g).sum() for o, g in zip(os, gouts)), ins)

    for i, (g, w, b) in enumerate(zip(grads(outs, inputs), grads(want, as64), grads(base, low))):
        assert_close(f"gradient of input {i}", g, w, b, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# norms: eps and dropout_p of every numpy kind, eps = 0 (functional and modules)
# ---------------------------------------------------------------------------------------------

def _norm(norm, x, residual, weight, bias, eps, **kw):
    if norm == "layer":
        return fused_block.add_layer_norm(x, residual, weight, bias, eps, **kw)
    return fused_block.add_rms_norm(x, residual, weight, eps, **kw)


def _norm_ref(norm, eps, residual=True, **kw):
    """The reference on the inputs of :func:`_norm_inputs` (as listed, without the Nones)."""
    def ref(*inputs, compute_dtype=None):
        x, *rest = inputs
        r = rest.pop(0) if residual else None
        if norm == "layer":
            return reference.add_layer_norm(x, r, *rest, eps, compute_dtype=compute_dtype, **kw)
        return reference.add_rms_norm(x, r, *rest, eps, compute_dtype=compute_dtype, **kw)
    return ref


def _norm_inputs(norm, dtype, device, n=24, residual=True):
    """x, residual (or None), weight and (LayerNorm) bias of 5 rows of ``n``: one forward program."""
    x = randn(5, n, dtype=dtype, device=device, requires_grad=True)
    r = randn(5, n, dtype=dtype, device=device, requires_grad=True) if residual else None
    w = (1 + 0.1 * randn(n, dtype=dtype, device=device)).requires_grad_()
    b = randn(n, dtype=dtype, device=device, scale=0.1, requires_grad=True) if norm == "layer" else None
    return [t for t in (x, r, w, b) if t is not None], (x, r, w, b)


# At eps = 0 the forward's padding rows (masked, never stored) get rstd = 1 / sqrt(0) = inf:
# numpy's warnings in the interpreter, nothing on the GPU.
EPS_ZERO = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
            pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]

# Each numpy kind F.layer_norm / F.rms_norm take for eps: float32, float64 (a subclass of
# Python's float), float16, an integer; and 0 (torch's norms take it: rstd = 1 / sqrt(var)).
# (By name: numpy's 0 and Python's compare equal, and the GPU check's selection keeps one case
# per parameter value.)
EPS = {"float32": np.float32(1e-5), "float64": np.float64(1e-6), "float16": np.float16(1e-3), "int64": np.int64(1),
       "zero": 0, "zero-float32": np.float32(0)}
NORM_EPS = [("layer", "float32"), ("rms", "float64"), ("layer", "float16"), ("rms", "int64"),
            pytest.param("layer", "zero", marks=EPS_ZERO), pytest.param("rms", "zero-float32", marks=EPS_ZERO)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm,kind", NORM_EPS)
def test_norm_eps(norm, kind, dtype, device, launches, numpy_args):
    eps = EPS[kind]
    inputs, args = _norm_inputs(norm, dtype, device)
    outs = _norm(norm, *args, eps)
    _compare(("out", "residual_out"), outs, _norm_ref(norm, float(eps)), inputs, dtype)
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1
    assert not numpy_args


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm,kind", [("layer", "float32"), ("rms", "float64")])
def test_norm_dropout(norm, kind, dtype, device, launches, numpy_args):
    """dropout_p of a numpy kind: the Python number's mask and scale (the same seed gives the
    same outputs), checked against the reference with the kernel's own mask."""
    p = getattr(np, kind)(0.25)
    inputs, (x, _, w, b) = _norm_inputs(norm, dtype, device, residual=False)
    torch.manual_seed(3)
    outs = _norm(norm, x, None, w, b, 1e-5, dropout_p=p)
    torch.manual_seed(3)
    again = _norm(norm, x, None, w, b, 1e-5, dropout_p=float(p))
    assert all(torch.equal(a, o) for a, o in zip(again, outs))
    kept = outs[1] != 0  # residual_out = dropout(x): 0 where dropped (x itself is never 0 here)
    assert 0 < kept.sum() < kept.numel()
    _compare(("out", "residual_out"), outs,
             _norm_ref(norm, 1e-5, residual=False, dropout_p=float(p), dropout_mask=kept), inputs, dtype)
    assert launches["add_norm_fwd"] == 2 and launches["add_norm_bwd"] == 1
    assert not numpy_args


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ("layer", "rms"))
@EPS_ZERO[0]
@EPS_ZERO[1]
def test_norm_module_eps_zero_and_numpy(norm, dtype, device, launches, numpy_args):
    """fused_block.LayerNorm / RMSNorm built with eps=0 and with a numpy eps, as torch's modules
    take them, against torch's module in float64 (its eps as given)."""
    cls, base = (fused_block.LayerNorm, torch.nn.LayerNorm) if norm == "layer" else (fused_block.RMSNorm,
                                                                                    torch.nn.RMSNorm)
    for eps in (0, np.float32(1e-5)):
        fused = cls(24, eps=eps, device=device, dtype=dtype)
        with torch.no_grad():
            for p in fused.parameters():
                p.copy_(randn(*p.shape, dtype=dtype, device=device, scale=0.1) + (1.0 if p is fused.weight else 0.0))
        x = randn(2, 3, 24, dtype=dtype, device=device, requires_grad=True)

        def ref(x, compute_dtype=None):
            m = base(24, eps=eps, device=device, dtype=compute_dtype or torch.float64)
            m.load_state_dict(fused.state_dict())
            return (m(x),)

        _compare(("out",), (fused(x),), ref, [x], dtype)
    assert launches["add_norm_fwd"] == 2 and launches["add_norm_bwd"] == 2
    assert not numpy_args


@EPS_ZERO[0]
@EPS_ZERO[1]
def test_norm_eps_zero_on_a_zero_variance_row_is_nan_as_torch(device, launches):
    """At eps = 0 a row of zero variance has rstd = inf: NaN outputs exactly where torch's norms
    (in float64) give NaN, the other rows as torch's."""
    x = randn(3, 16, dtype=torch.float32, device=device)
    x[1] = 0.5  # constant: LayerNorm's variance is 0 (its mean is exact), RMSNorm's mean square is not
    x[2] = 0.0  # both 0
    w = randn(16, dtype=torch.float32, device=device)
    w64 = w.double()
    for op, torch_norm in ((fused_block.add_layer_norm, lambda t: F.layer_norm(t, (16,), w64, None, 0)),
                           (fused_block.add_rms_norm, lambda t: F.rms_norm(t, (16,), w64, 0.0))):
        out, _ = op(x, None, w, eps=0.0)
        want = torch_norm(x.double())
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(out), nan) and nan[2].all() and not nan[0].any(), (out, want)
        torch.testing.assert_close(out[~nan].double(), want[~nan], atol=1e-5, rtol=1e-5)
    assert launches["add_norm_fwd"] == 2


# ---------------------------------------------------------------------------------------------
# attention: float and integer options of numpy kinds
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_numpy_options(dtype, device, launches, numpy_args):
    """scale (float32), softcap (float64), dropout_p (float16) and the window's sides (int64,
    int32) as numpy scalars: 24 queries and keys of head dim 16, 2 heads over 1 K/V head."""
    B, Hq, Hkv, L, D = 1, 2, 1, 24, 16
    q = randn(B, Hq, L, D, dtype=dtype, device=device, requires_grad=True)
    k, v = (randn(B, Hkv, L, D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    scale, softcap, p, window = np.float32(0.3), np.float64(5.0), np.float16(0.25), (np.int64(6), np.int32(2))
    torch.manual_seed(4)
    keep = kattention.dropout_keep_mask(_backend.dropout_seed(float(p), device), B, Hq, L, L, float(p), device)

    def run(q, k, v):
        torch.manual_seed(4)
        return fused_block.attention(q, k, v, False, scale, None, p, window=window, softcap=softcap, return_lse=True)

    def ref(q, k, v, compute_dtype=None):
        return reference.attention(q, k, v, False, float(scale), None, float(p), window=(6, 2), softcap=5.0,
                                   dropout_mask=keep, return_lse=True, compute_dtype=compute_dtype)

    check_attention(run, ref, (q, k, v), ("q", "k", "v"))
    assert launches["attention_fwd"] == 1 and launches["attention_bwd"] == 1
    assert not numpy_args


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_packed_numpy_heads(dtype, device, launches, numpy_args):
    """num_heads / num_kv_heads (int64, int32) of attention_qkvpacked and the varlen packed
    form's max_seqlen (uint16, an unsigned kind) as numpy integers: 2 sequences of 9 and 5
    tokens, 2 query heads over 1 K/V head of 16."""
    H, Hkv, D = 2, 1, 16
    qkv = randn(2, 9, (H + 2 * Hkv) * D, dtype=dtype, device=device, requires_grad=True)

    def split(t):
        t = t.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2)
        return t[:, :H], t[:, H:H + Hkv], t[:, H + Hkv:]

    def run(qkv):
        return fused_block.attention_qkvpacked(qkv, np.int64(H), np.int32(Hkv), causal=True, return_lse=True)

    def ref(qkv, compute_dtype=None):
        out, lse = reference.attention(*split(qkv), True, return_lse=True, compute_dtype=compute_dtype)
        return out.transpose(1, 2).flatten(2), lse

    check_attention(run, ref, (qkv,), ("qkv",))
    tokens = randn(14, (H + 2 * Hkv) * D, dtype=dtype, device=device, requires_grad=True)
    cu = torch.tensor([0, 9, 14], dtype=torch.int32, device=device)

    def run_varlen(t):
        return fused_block.attention_varlen_qkvpacked(t, cu, np.uint16(9), np.int64(H), np.int64(Hkv), causal=True,
                                                      return_lse=True)

    def ref_varlen(t, compute_dtype=None):
        q, k, v = t.unflatten(-1, (H + 2 * Hkv, D)).split((H, Hkv, Hkv), dim=1)
        out, lse = reference.attention_varlen(q, k, v, cu, cu, True, return_lse=True, compute_dtype=compute_dtype)
        return out.flatten(1), lse

    check_attention(run_varlen, ref_varlen, (tokens,), ("qkv",))
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2
    assert not numpy_args


# ---------------------------------------------------------------------------------------------
# rope: scale, head counts and the per-head norms' eps
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_numpy_scale(dtype, device, launches, numpy_args):
    """rope's scale (numpy float32; Hugging Face's attention_scaling) on 2 x 5 tokens, 3 q and
    2 k heads of 32."""
    q = randn(2, 5, 3, 32, dtype=dtype, device=device, requires_grad=True)
    k = randn(2, 5, 2, 32, dtype=dtype, device=device, requires_grad=True)
    positions = torch.arange(5, device=device)[None]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32, device=device) / 32))
    outs = fused_block.rope(q, k, positions, inv_freq, scale=np.float32(1.25))

    def ref(q, k, compute_dtype=None):
        return reference.rope(q, k, positions, inv_freq, scale=1.25, compute_dtype=compute_dtype)

    _compare(("q_out", "k_out"), outs, ref, [q, k], dtype)
    assert launches["rope"] == 2
    assert not numpy_args


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_qkvpacked_numpy_heads_and_norm_eps(dtype, device, launches, numpy_args):
    """rope_qkvpacked with numpy head counts (int64, int32) and Qwen3's per-head norms, their eps
    a numpy float32 (> 0: tests/test_rope.py): 2 x 5 tokens, 3 q and 2 k heads of 32."""
    norm_eps = np.float32(1e-6)
    H, Hkv, D = 3, 2, 32
    qkv = randn(2, 5, (H + 2 * Hkv) * D, dtype=dtype, device=device, requires_grad=True)
    wq, wk = ((1 + 0.3 * randn(D, dtype=dtype, device=device)).requires_grad_() for _ in range(2))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    out = fused_block.rope_qkvpacked(qkv, np.int64(H), np.int32(Hkv), inv_freq=inv_freq, q_norm_weight=wq,
                                     k_norm_weight=wk, norm_eps=norm_eps)

    def ref(qkv, wq, wk, compute_dtype=None):
        return (reference.rope_qkvpacked(qkv, H, Hkv, inv_freq=inv_freq, q_norm_weight=wq, k_norm_weight=wk,
                                         norm_eps=float(norm_eps), compute_dtype=compute_dtype),)

    _compare(("out",), (out,), ref, [qkv, wq, wk], dtype)
    assert launches["rope_qknorm"] == 2
    assert not numpy_args


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy: ignore_index (numpy integers) and the float options (numpy floats)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loss_numpy_options(dtype, device, launches, numpy_args):
    """ignore_index (int32), label_smoothing (float32), z_loss (float64) and softcap (float16) as
    numpy scalars, as F.cross_entropy takes them: 13 tokens (3 ignored), vocabulary 37, hidden 16;
    and LinearCrossEntropy keeping them as Python numbers."""
    g = torch.Generator().manual_seed(5)
    hidden = randn(13, 16, dtype=dtype, device=device, requires_grad=True, generator=g)
    weight = randn(37, 16, dtype=dtype, device=device, scale=0.5, requires_grad=True, generator=g)
    target = torch.randint(0, 37, (13,), generator=g)
    target[[2, 7, 11]] = -7
    target = target.to(device)
    options = dict(ignore_index=np.int32(-7), label_smoothing=np.float32(0.1), z_loss=np.float64(0.01),
                   softcap=np.float16(4.0))
    python = {k: v.item() for k, v in options.items()}
    with fp32_mode("ieee"):
        loss = fused_block.linear_cross_entropy(hidden, weight, target, **options)

    def ref(hidden, weight, compute_dtype=None):
        with baseline_mode(compute_dtype or torch.float64, "ieee"):
            return (reference.linear_cross_entropy(hidden, weight, target, compute_dtype=compute_dtype, **python),)

    assert loss.dtype == torch.float32
    as64 = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    low = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    (want,), (base,) = ref(*as64), ref(*low, compute_dtype=dtype)
    assert_close("loss", loss, want, base, dtype=dtype)
    for name, a, r, b in zip(("hidden", "weight"), torch.autograd.grad(loss, (hidden, weight)),
                             torch.autograd.grad(want, as64), torch.autograd.grad(base, low)):
        assert_close(f"grad {name}", a, r, b)
    head = fused_block.LinearCrossEntropy(16, 37, bias=False, **options)
    assert [type(getattr(head, k)) for k in options] == [int, float, float, float]
    assert launches["lce_ce"] == 1
    assert not numpy_args


# ---------------------------------------------------------------------------------------------
# linear layers: dropout probabilities
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_numpy_dropouts(dtype, device, launches, numpy_args):
    """mlp's hidden (numpy float32) and output (float64) dropout probabilities, against the
    reference with the kernels' own masks; the MLP module keeps a numpy dropout as a Python
    float. 13 rows, width 16, hidden 24."""
    M, D, F_ = 13, 16, 24
    x = randn(M, D, dtype=dtype, device=device, requires_grad=True)
    w1 = randn(F_, D, dtype=dtype, device=device, scale=D ** -0.5, requires_grad=True)
    w2 = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    b1, b2 = (randn(n, dtype=dtype, device=device, requires_grad=True) for n in (F_, D))
    p1, p2 = np.float32(0.25), np.float64(0.125)
    m1, m2 = kernel_masks(9, device, (M, F_, float(p1)), (M, D, float(p2)))

    def ref(x, w1, b1, w2, b2, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, "gelu", None, float(p1), float(p2), dropout_mask=m1,
                             output_dropout_mask=m2, compute_dtype=compute_dtype)

    ours = seeded(lambda x, w1, b1, w2, b2: fused_block.mlp(x, w1, b1, w2, b2, "gelu", None, p1, p2), 9)
    check_gemm("mlp", ours, ref, (x, w1, b1, w2, b2), dtype, device)
    assert launches["matmul"] == 6
    assert type(fused_block.MLP(D, F_, dropout=np.float32(0.25)).dropout) is float
    assert not numpy_args
