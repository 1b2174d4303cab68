"""Fused residual add + dropout + LayerNorm/RMSNorm against the float64 reference."""
import pytest
import torch

import fused_block
from fused_block import _backend, reference
from fused_block.kernels import norm as knorm
from numerics import DTYPES, assert_close, randn

NORMS = ("layer", "rms")


def _ref(norm):
    return reference.add_layer_norm if norm == "layer" else reference.add_rms_norm


def _op(norm):
    return fused_block.add_layer_norm if norm == "layer" else fused_block.add_rms_norm


def _call(fn, norm, x, residual, weight, bias, **kw):
    if norm == "layer":
        return fn(x, residual, weight, bias, **kw)
    return fn(x, residual, weight, **kw)


# (leading shape, hidden, has_residual, has_weight, has_bias, why)
CASES = [
    ((37,), 768, True, True, True, "GPT-2 hidden, odd row count"),
    ((1,), 1, True, True, True, "hidden of one: zero variance"),
    ((37,), 7, False, True, False, "tiny non-power-of-two hidden, no residual"),
    ((0,), 768, True, True, True, "no rows at all"),
    ((5,), 1000, True, False, False, "non-power-of-two hidden without affine parameters"),
    ((2, 5), 768, True, True, True, "3-D input"),
    ((3,), 4099, True, True, True, "just above a power of two: masked tail, chunked backward"),
    ((3,), 8192, False, True, True, "widest single-pass forward"),
    ((1,), knorm.MAX_HIDDEN, True, True, True, "largest supported hidden: chunked forward and backward"),
]


def _grads(outs, inputs, gouts):
    loss = sum((o.double() * g).sum() for o, g in zip(outs, gouts))
    return torch.autograd.grad(loss, [t for t in inputs if t is not None])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("lead,n,has_res,has_w,has_b,why", CASES, ids=[c[-1] for c in CASES])
def test_matches_reference(device, launches, dtype, norm, lead, n, has_res, has_w, has_b, why):
    has_b = has_b and norm == "layer"
    shape = (*lead, n)
    x = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    residual = randn(*shape, dtype=dtype, device=device, requires_grad=True) if has_res else None
    weight = (1 + 0.1 * randn(n, dtype=dtype, device=device)).requires_grad_() if has_w else None
    bias = randn(n, dtype=dtype, device=device, scale=0.1, requires_grad=True) if has_b else None
    inputs = [x, residual, weight, bias]

    out, rout = _call(_op(norm), norm, x, residual, weight, bias)
    assert launches["add_norm_fwd"] == (1 if x.numel() else 0)
    assert out.dtype == dtype and rout.dtype == dtype and out.shape == shape

    as64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_rout = _call(_ref(norm), norm, *as64)
    base_out, base_rout = _call(_ref(norm), norm, *inputs, compute_dtype=dtype)
    assert_close("out", out, ref_out, base_out)
    assert_close("residual_out", rout, ref_rout, base_rout)

    # Gradients arrive on both outputs (the Pre-LN residual stream is used downstream).
    gouts = [torch.randn(shape, dtype=torch.float64, device=device) for _ in range(2)]
    got = _grads((out, rout), inputs, gouts)
    want = _grads((ref_out, ref_rout), as64, gouts)
    base = _grads((base_out, base_rout), inputs, gouts)
    names = [nm for nm, t in zip(("dx", "dresidual", "dweight", "dbias"), inputs) if t is not None]
    for name, g, w, b in zip(names, got, want, base):
        # dweight/dbias sum over rows: allow the accumulation error of that many terms.
        assert_close(name, g, w, b)
    assert launches["add_norm_bwd"] == (1 if x.numel() else 0)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_fp32_weight_and_residual_stream(device, launches, dtype, norm):
    """Autocast layout: low-precision activations, fp32 parameters, fp32 residual stream."""
    x = randn(37, 1000, dtype=dtype, device=device, requires_grad=True)
    weight = (1 + 0.1 * randn(1000, dtype=torch.float32, device=device)).requires_grad_()
    bias = randn(1000, dtype=torch.float32, device=device, scale=0.1, requires_grad=True) if norm == "layer" else None
    out, rout = _call(_op(norm), norm, x, None, weight, bias, residual_in_fp32=True)
    assert out.dtype == dtype and rout.dtype == torch.float32
    residual = randn(37, 1000, dtype=torch.float32, device=device, requires_grad=True)
    out2, rout2 = _call(_op(norm), norm, x, residual, weight, bias)
    assert rout2.dtype == torch.float32
    inputs = [x, residual, weight, bias]
    as64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_rout = _call(_ref(norm), norm, *as64)
    assert_close("out", out2, ref_out, _call(_ref(norm), norm, *inputs, compute_dtype=dtype)[0])
    assert_close("residual_out", rout2, ref_rout, ref_rout.float())
    g = torch.randn(37, 1000, dtype=torch.float64, device=device)
    got = _grads((out2,), inputs, (g,))
    want = _grads((ref_out,), as64, (g,))
    base = _grads((_call(_ref(norm), norm, *inputs, compute_dtype=dtype)[0],), inputs, (g,))
    for name, a, w, b in zip(("dx", "dresidual", "dweight", "dbias"), got, want, base):
        assert a.dtype == (dtype if name == "dx" else torch.float32)
        assert_close(name, a, w, b, dtype=dtype)
    assert launches["add_norm_fwd"] == 2 and launches["add_norm_bwd"] == 1


@pytest.mark.parametrize("norm", NORMS)
def test_non_contiguous_inputs(device, launches, norm):
    base = randn(12, 2 * 768, dtype=torch.float32, device=device)
    x = base[:, ::2].detach().requires_grad_()  # last-dim stride 2: copied
    residual = randn(768, 12, dtype=torch.float32, device=device).t().detach().requires_grad_()  # transposed
    weight = randn(768, dtype=torch.float32, device=device, requires_grad=True)
    out, rout = _call(_op(norm), norm, x, residual, weight, None)
    ref_out, ref_rout = _call(_ref(norm), norm, x.double(), residual.double(), weight.double(), None)
    assert_close("out", out, ref_out, _call(_ref(norm), norm, x, residual, weight, None, compute_dtype=torch.float32)[0])
    (out.sum() + rout.sum()).backward()
    assert x.grad.shape == x.shape and residual.grad.shape == residual.shape
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_dropout(device, launches, dtype, norm):
    p, shape = 0.3, (16, 1000)
    x = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    weight = randn(1000, dtype=dtype, device=device, requires_grad=True)
    torch.manual_seed(7)
    _, rout_a = _call(_op(norm), norm, x, None, weight, None, dropout_p=p)
    kept = rout_a != 0
    frac = kept.double().mean().item()
    sigma = (p * (1 - p) / kept.numel()) ** 0.5
    assert abs(frac - (1 - p)) < 5 * sigma, f"kept fraction {frac} vs {1 - p}"
    # Kept values are scaled by 1/(1-p).
    torch.testing.assert_close(rout_a[kept].double(), (x.detach()[kept].double() / (1 - p)).to(dtype).double())

    # Same seed, same mask; the residual does not change which elements are dropped.
    residual = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    torch.manual_seed(7)
    out, rout = _call(_op(norm), norm, x, residual, weight, None, dropout_p=p)
    torch.manual_seed(7)
    out_again, _ = _call(_op(norm), norm, x, residual, weight, None, dropout_p=p)
    assert torch.equal(out, out_again)
    torch.manual_seed(8)
    assert not torch.equal(_call(_op(norm), norm, x, residual, weight, None, dropout_p=p)[0], out)

    # Forward and backward both agree with the reference given the kernel's own mask.
    inputs = [x, residual, weight]
    as64 = [t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_rout = _call(_ref(norm), norm, *as64, None, dropout_p=p, dropout_mask=kept)
    base_out, base_rout = _call(_ref(norm), norm, *inputs, None, dropout_p=p, dropout_mask=kept, compute_dtype=dtype)
    assert_close("out", out, ref_out, base_out)
    assert_close("residual_out", rout, ref_rout, base_rout)
    gouts = [torch.randn(shape, dtype=torch.float64, device=device) for _ in range(2)]
    for name, g, w, b in zip(("dx", "dresidual", "dweight"), _grads((out, rout), inputs, gouts),
                             _grads((ref_out, ref_rout), as64, gouts), _grads((base_out, base_rout), inputs, gouts)):
        assert_close(name, g, w, b)
    assert launches["add_norm_fwd"] == 4 and launches["add_norm_bwd"] == 1


@pytest.mark.parametrize("norm", NORMS)
def test_opcheck(device, norm):
    x = randn(9, 40, dtype=torch.float32, device=device, requires_grad=True)
    residual = randn(9, 40, dtype=torch.bfloat16, device=device, requires_grad=True)
    weight = randn(40, dtype=torch.float32, device=device, requires_grad=True)
    bias = None if norm == "rms" else randn(40, dtype=torch.float32, device=device, requires_grad=True)
    seed = torch.tensor([3], dtype=torch.int64, device=device)
    args = (x, residual, weight, bias, seed, 1e-5, 0.1, norm == "rms", torch.bfloat16, True)
    torch.library.opcheck(torch.ops.fused_block.add_norm_fwd.default, args)
    with torch.no_grad():
        _, rout, mean, rstd = torch.ops.fused_block.add_norm_fwd(*args)
    dout, drout = torch.randn_like(x), torch.randn_like(rout)
    bwd_args = (dout, drout, rout, weight, bias is not None, mean, rstd, seed, 0.1, norm == "rms",
                torch.float32, torch.bfloat16, True)
    torch.library.opcheck(torch.ops.fused_block.add_norm_bwd.default, bwd_args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("norm", NORMS)
def test_torch_compile_fullgraph(device, launches, norm):
    x = randn(6, 64, dtype=torch.float32, device=device, requires_grad=True)
    residual = randn(6, 64, dtype=torch.float32, device=device)
    weight = randn(64, dtype=torch.float32, device=device, requires_grad=True)

    def step(x, residual, weight):
        out, rout = _call(_op(norm), norm, x, residual, weight, None)
        return (out * rout).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(x, residual, weight)
    gx, gw = torch.autograd.grad(loss, (x, weight))
    assert launches["add_norm_fwd"] >= 1 and launches["add_norm_bwd"] >= 1
    ref_loss = step(x, residual, weight)
    rx, rw = torch.autograd.grad(ref_loss, (x, weight))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("cls,torch_cls,kw", [
    (fused_block.LayerNorm, torch.nn.LayerNorm, {}),
    (fused_block.LayerNorm, torch.nn.LayerNorm, {"bias": False}),
    (fused_block.LayerNorm, torch.nn.LayerNorm, {"elementwise_affine": False}),
    (fused_block.RMSNorm, torch.nn.RMSNorm, {}),
    (fused_block.RMSNorm, torch.nn.RMSNorm, {"eps": 1e-6}),
])
@pytest.mark.parametrize("normalized_shape", [(96,), (4, 24)], ids=["1d", "2d"])
def test_modules_are_drop_in(device, launches, cls, torch_cls, kw, normalized_shape):
    ours, theirs = cls(normalized_shape, **kw).to(device), torch_cls(normalized_shape, **kw).to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = randn(3, 5, *normalized_shape, dtype=torch.float32, device=device)
    torch.testing.assert_close(ours(x), theirs(x), atol=2e-5, rtol=1e-5)
    res = randn(3, 5, *normalized_shape, dtype=torch.float32, device=device)
    out, rout = ours(x, res)
    torch.testing.assert_close(rout, x + res)
    torch.testing.assert_close(out, theirs(x + res), atol=2e-5, rtol=1e-5)
    assert launches["add_norm_fwd"] == 2


def test_reference_fallback_without_interpreter(monkeypatch, launches):
    """CPU tensors without TRITON_INTERPRET run the plain-PyTorch reference."""
    monkeypatch.setattr(_backend, "INTERPRET", False)
    x = randn(4, 32, dtype=torch.float32, device="cpu")
    out, rout = fused_block.add_layer_norm(x, x, None, None)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(2 * x, (32,)))
    assert launches["add_norm_fwd"] == 0


def test_autocast(device, launches):
    """Under autocast the fp32 parameters stay fp32 and the kernel reads them as they are."""
    ln = fused_block.LayerNorm(64).to(device)
    x = randn(8, 64, dtype=torch.bfloat16, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = ln(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.nn.functional.layer_norm(x.float(), (64,)), atol=2e-2, rtol=1e-2)
    assert launches["add_norm_fwd"] == 1
