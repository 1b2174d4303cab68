"""fused_block.linear / mlp: GEMM + bias + activation + residual epilogues, forward and backward.

Every result and every gradient is compared with the float64 reference under the "twice
PyTorch's own error" rule (numerics.assert_close). fp32 products run in TF32 on the GPU, so
there PyTorch's fp32 baseline is measured with TF32 enabled too.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import fused_block
import fused_block.kernels.matmul
from fused_block import reference
from fused_block.linear import MLP, Linear, linear, mlp

from numerics import ATOL, DTYPES, assert_close, randn

ACTS = (None, "gelu", "gelu_tanh", "relu")


@contextlib.contextmanager
def _torch_precision_of_kernels(dtype, device):
    """Our fp32 GEMMs use TF32 on the GPU: measure PyTorch's fp32 error with TF32 as well."""
    if dtype != torch.float32 or device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _leaves(tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad)
            for t in tensors]


def _check(name, ours, ref_fn, inputs, dtype, device):
    """Run ``ours(*inputs)`` forward and backward; compare output and every input's gradient
    with ``ref_fn`` in float64, against PyTorch's own error in ``dtype``."""
    out = ours(*inputs)
    g = randn(*out.shape, dtype=out.dtype, device=device)
    g_before = g.clone()
    diff = [t for t in inputs if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, diff, g)
    assert torch.equal(g, g_before), "the incoming gradient was modified"

    ins64 = _leaves(inputs, torch.float64)
    ref = ref_fn(*ins64)
    grads64 = torch.autograd.grad(ref, [t for t in ins64 if t is not None and t.requires_grad], g.double())

    insb = _leaves(inputs)
    with _torch_precision_of_kernels(dtype, device):
        base = ref_fn(*insb, compute_dtype=dtype)
        gradsb = torch.autograd.grad(base, [t for t in insb if t is not None and t.requires_grad], g)

    assert out.dtype == base.dtype
    assert_close(f"{name} out", out, ref, base)
    names = [n for n, t in zip("abcdefgh", inputs) if t is not None and t.requires_grad]
    for n, a, r, b in zip(names, grads, grads64, gradsb):
        assert a.dtype == b.dtype, f"{name} grad {n}: dtype {a.dtype} != {b.dtype}"
        assert_close(f"{name} grad of input {n}", a, r, b)


def _linear_inputs(M, K, N, has_bias, has_res, dtype, device, lead=()):
    x = randn(*lead, M, K, dtype=dtype, device=device, requires_grad=True)
    w = randn(N, K, dtype=dtype, device=device, scale=K ** -0.5, requires_grad=True)
    b = randn(N, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    r = randn(*lead, M, N, dtype=dtype, device=device, requires_grad=True) if has_res else None
    return x, w, b, r


# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------

# Cheap shapes (M, K, N), run with every activation, with and without bias + residual:
SMALL = [
    (1, 8, 100),    # one row (decoding); K below one BLOCK_K; N not a tile multiple
    (37, 100, 8),   # odd M; masked K loop; N smaller than a tile
    (37, 768, 100), # K a multiple of BLOCK_K (unmasked K loop); M and N edges
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_res", [(True, True), (False, False)], ids=["bias_res", "plain"])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "x".join(map(str, s)))
def test_linear(shape, activation, bias_res, dtype, device, launches):
    x, w, b, r = _linear_inputs(*shape, *bias_res, dtype, device)

    def ours(x, w, b, r):
        return linear(x, w, b, activation, r)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, activation, r, compute_dtype=compute_dtype)

    _check("linear", ours, ref, (x, w, b, r), dtype, device)
    assert launches["matmul"] == 3  # forward, dX, dW
    assert launches["act_grad"] == (1 if activation or bias_res[0] else 0)


# Larger shapes, once each with the full epilogue (the interpreter is slow on big GEMMs):
LARGE = [
    (512, 3072, 100),  # long K reduction (d_ff -> d); M a tile multiple; 48 K steps
    (512, 100, 768),   # M and N tile multiples (unmasked epilogue), many tiles and groups
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "x".join(map(str, s)))
def test_linear_large(shape, dtype, device, launches):
    x, w, b, r = _linear_inputs(*shape, True, True, dtype, device)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, "gelu", r, compute_dtype=compute_dtype)

    _check("linear", lambda x, w, b, r: linear(x, w, b, "gelu", r), ref, (x, w, b, r), dtype, device)
    assert launches["matmul"] == 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_leading_dims_strided_weight_and_partial_grads(dtype, device, launches):
    # x with two leading dims; weight a transposed view (no copy: the kernel takes strides);
    # only some inputs require grad, so backward computes (and forward saves) only those.
    x = randn(2, 3, 40, dtype=dtype, device=device)
    w = randn(40, 24, dtype=dtype, device=device, scale=40 ** -0.5).t().requires_grad_()
    b = randn(24, dtype=dtype, device=device)
    r = randn(2, 3, 24, dtype=dtype, device=device, requires_grad=True)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, "gelu_tanh", r, compute_dtype=compute_dtype)

    _check("linear", lambda x, w, b, r: linear(x, w, b, "gelu_tanh", r), ref, (x, w, b, r), dtype, device)
    assert launches["matmul"] == 2  # forward and dW only


def test_linear_one_dim_input_and_no_grad(device, launches):
    x = randn(40, dtype=torch.float16, device=device)
    w = randn(24, 40, dtype=torch.float16, device=device, scale=40 ** -0.5)
    out = linear(x, w, None, "relu")
    assert out.shape == (24,)
    ref = reference.linear(x.double(), w.double(), None, "relu")
    assert_close("linear 1-D", out, ref, reference.linear(x, w, None, "relu", compute_dtype=torch.float16))
    assert launches["matmul"] == 1


def test_linear_recomputes_pre_activation_when_not_saved(device):
    # The op may run with save_pre=False and still be differentiated: backward recomputes pre.
    x, w, b, _ = _linear_inputs(37, 100, 8, True, False, torch.float32, device)
    out, pre = torch.ops.fused_block.linear_fwd(x, w, b, None, "gelu", False)
    assert pre.numel() == 0
    grads = torch.autograd.grad(out, (x, w, b), torch.ones_like(out))
    x64, w64, b64 = _leaves((x, w, b), torch.float64)
    ref = reference.linear(x64, w64, b64, "gelu")
    refs = torch.autograd.grad(ref, (x64, w64, b64), torch.ones_like(ref))
    for a, r in zip(grads, refs):
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# mlp
# ---------------------------------------------------------------------------------------------

# (M, D, F): d_model and dim_feedforward, each shape once with every activation.
MLP_SHAPES = [
    (37, 8, 100),   # odd M; tiny d_model (K of the first GEMM below BLOCK_K), hidden edge
    (1, 100, 8),    # one row; F smaller than a tile (the DGELU epilogue's edges)
]
# One larger shape with the full epilogue: tile multiples along M and F, many tiles, several
# 64-row slices of the bias-gradient partial sums.
MLP_LARGE = (512, 100, 768)


def _mlp_inputs(M, D, F_, has_bias, has_res, dtype, device):
    x = randn(M, D, dtype=dtype, device=device, requires_grad=True)
    w1 = randn(F_, D, dtype=dtype, device=device, scale=D ** -0.5, requires_grad=True)
    w2 = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    b1 = randn(F_, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    b2 = randn(D, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    r = randn(M, D, dtype=dtype, device=device, requires_grad=True) if has_res else None
    return x, w1, b1, w2, b2, r


def _run_mlp(shape, activation, bias_res, dtype, device):
    inputs = _mlp_inputs(*shape, *bias_res, dtype, device)

    def ours(x, w1, b1, w2, b2, r):
        return mlp(x, w1, b1, w2, b2, activation, r)

    def ref(x, w1, b1, w2, b2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, activation, r, compute_dtype=compute_dtype)

    _check("mlp", ours, ref, inputs, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_res", [(True, True), (False, False)], ids=["bias_res", "plain"])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", MLP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mlp(shape, activation, bias_res, dtype, device, launches):
    _run_mlp(shape, activation, bias_res, dtype, device)
    # forward 2; backward dW2, dH with the fused act-gradient epilogue, dW1, dX
    assert launches["matmul"] == 6
    assert launches["act_grad"] == (1 if bias_res[0] else 0)  # only dB2's column sums


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_large(dtype, device, launches):
    _run_mlp(MLP_LARGE, "gelu", (True, True), dtype, device)
    assert launches["matmul"] == 6


# Interpreter tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, EPI_SPLIT) besides the default
# large one: many small tiles in both directions and partial groups; the epilogue on two and on
# four column slices (the Hopper configs'). On CUDA the autotuner picks; the test still holds.
TILES = [(64, 64, 32, 4, 1, 1), (128, 128, 64, 4, 1, 2), (128, 256, 64, 8, 1, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
def test_mlp_other_tiles(tile, dtype, device, monkeypatch):
    monkeypatch.setattr(fused_block.kernels.matmul, "INTERPRETER_CONFIG", tile)
    # With 64x64 tiles: 4 row tiles (a partial GROUP_M group), 3 hidden column tiles, edges.
    _run_mlp((200, 40, 136), "gelu", (True, True), dtype, device)


def test_mlp_bias_gradient_is_deterministic(device):
    x, w1, b1, w2, b2, _ = _mlp_inputs(200, 16, 64, True, False, torch.bfloat16, device)
    g = randn(200, 16, dtype=torch.bfloat16, device=device)
    first = torch.autograd.grad(mlp(x, w1, b1, w2, b2), (b1, b2), g)
    second = torch.autograd.grad(mlp(x, w1, b1, w2, b2), (b1, b2), g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------

def test_linear_module_is_a_drop_in_nn_linear(device, launches):
    torch.manual_seed(0)
    theirs = torch.nn.Linear(40, 24, device=device)
    ours = Linear(40, 24, device=device, activation="gelu")
    assert isinstance(ours, torch.nn.Linear)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = randn(3, 40, dtype=torch.float32, device=device)
    torch.testing.assert_close(ours(x), F.gelu(theirs(x)), rtol=1e-5, atol=1e-5)
    assert launches["matmul"] == 1
    assert "activation='gelu'" in repr(ours)
    with pytest.raises(ValueError, match="activation"):
        Linear(4, 4, activation="swish")


def test_mlp_module_matches_transformer_layer_names(device):
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, activation="gelu",
                                             device=device)
    ours = MLP(32, 64, device=device)
    ffn = {k: v for k, v in layer.state_dict().items() if k.startswith(("linear1.", "linear2."))}
    assert ours.state_dict().keys() == ffn.keys()
    ours.load_state_dict(ffn)
    x = randn(5, 32, dtype=torch.float32, device=device)
    expected = layer.linear2(F.gelu(layer.linear1(x))) + x
    torch.testing.assert_close(ours(x, residual=x), expected, rtol=1e-5, atol=1e-5)
    assert MLP(32, 64, bias=False).linear1.bias is None
    with pytest.raises(ValueError, match="dropout"):
        MLP(32, 64, dropout=0.1)


# ---------------------------------------------------------------------------------------------
# bad input: clear errors naming the argument, before any launch
# ---------------------------------------------------------------------------------------------

def _bad_linear_cases(device):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(6, 8, device=device)
    return [
        (dict(x=x, weight=torch.randn(6, 7, device=device)), ValueError, "weight"),
        (dict(x=x, weight=w, bias=torch.randn(5, device=device)), ValueError, "bias"),
        (dict(x=x, weight=w, activation="swish"), ValueError, "activation"),
        (dict(x=x, weight=w, activation=1), TypeError, "activation"),
        (dict(x=x, weight=w.half()), TypeError, "weight"),
        (dict(x=x, weight=w, bias=torch.randn(6, device=device, dtype=torch.float64)), TypeError, "bias"),
        (dict(x=x.long(), weight=w), TypeError, "x"),
        (dict(x=x, weight=w.to("meta")), ValueError, "weight"),
        (dict(x=x, weight=w, residual=torch.randn(4, 5, device=device)), ValueError, "residual"),
        (dict(x=x, weight=w[0]), ValueError, "weight"),
        (dict(x="x", weight=w), TypeError, "x"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_linear_bad_input(case, device, launches):
    kwargs, error, name = _bad_linear_cases(device)[case]
    with pytest.raises(error, match=name):
        linear(**kwargs)
    assert launches["matmul"] == 0


def test_mlp_bad_input(device, launches):
    x = torch.randn(4, 8, device=device)
    w1, b1 = torch.randn(16, 8, device=device), torch.randn(16, device=device)
    w2, b2 = torch.randn(8, 16, device=device), torch.randn(8, device=device)
    with pytest.raises(ValueError, match="w1"):
        mlp(x, torch.randn(16, 9, device=device), b1, w2, b2)
    with pytest.raises(ValueError, match="w2"):
        mlp(x, w1, b1, torch.randn(8, 15, device=device), b2)
    with pytest.raises(ValueError, match="b1"):
        mlp(x, w1, torch.randn(15, device=device), w2, b2)
    with pytest.raises(ValueError, match="b2"):
        mlp(x, w1, b1, w2, torch.randn(9, device=device))
    with pytest.raises(TypeError, match="w2"):
        mlp(x, w1, b1, w2.half(), b2)
    with pytest.raises(ValueError, match="activation"):
        mlp(x, w1, b1, w2, b2, activation="silu")
    with pytest.raises(ValueError, match="residual"):
        mlp(x, w1, b1, w2, b2, residual=torch.randn(4, 16, device=device))
    assert launches["matmul"] == 0


# ---------------------------------------------------------------------------------------------
# torch.library, torch.compile, autocast
# ---------------------------------------------------------------------------------------------

def test_opcheck(device):
    dt = torch.float16
    x, w, b, r = _linear_inputs(37, 24, 40, True, True, dt, device)
    ops = torch.ops.fused_block
    torch.library.opcheck(ops.linear_fwd.default, (x, w, b, r, "gelu", True))
    x, w1, b1, w2, b2, r = _mlp_inputs(37, 24, 40, True, True, dt, device)
    torch.library.opcheck(ops.mlp_fwd.default, (x, w1, None, w2, None, None, "gelu_tanh", False))
    # The backward's building blocks (not differentiable themselves: no double backward).
    x, w2 = x.detach(), w2.detach()
    g = randn(37, 24, dtype=dt, device=device)
    pre = randn(37, 40, dtype=dt, device=device)
    torch.library.opcheck(ops.matmul.default, (g.t(), x))
    torch.library.opcheck(ops.matmul_act_grad.default, (g, w2, pre, "gelu", True))
    torch.library.opcheck(ops.act_grad.default, (pre, pre, "relu", True))
    torch.library.opcheck(ops.bias_grad.default, (g,))


def test_torch_compile_fullgraph(device, launches):
    x, w1, b1, w2, b2, r = _mlp_inputs(37, 24, 40, True, True, torch.float32, device)

    def block(x, w1, b1, w2, b2, r):
        return linear(mlp(x, w1, b1, w2, b2, "gelu", r), w2.t(), b1, "relu")

    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, w1, b1, w2, b2, r)
    grads = torch.autograd.grad(out.sum(), (x, w1, b1, w2, b2, r))
    eager = block(x, w1, b1, w2, b2, r)
    eager_grads = torch.autograd.grad(eager.sum(), (x, w1, b1, w2, b2, r))
    torch.testing.assert_close(out, eager)
    for a, e in zip(grads, eager_grads):
        torch.testing.assert_close(a, e)
    assert launches["matmul"] > 0


def test_autocast(device, launches):
    # Like F.linear: x, weight and bias are cast to the autocast dtype; an fp32 residual keeps
    # the output in fp32 (as residual + F.linear(...) would be); gradients come back in fp32.
    x, w, b, r = _linear_inputs(37, 40, 24, True, True, torch.float32, device)
    lowp = torch.bfloat16
    with torch.autocast(device.type, dtype=lowp):
        out = linear(x, w, b, "gelu")
        out_res = linear(x, w, b, "gelu", r)
        expected = F.gelu(F.linear(x, w, b))
    assert out.dtype == expected.dtype == lowp
    assert out_res.dtype == torch.float32
    ref = reference.linear(*_leaves((x, w, b), torch.float64), "gelu")
    x64, w64, b64, r64 = _leaves((x, w, b, r), torch.float64)
    ref_res = reference.linear(x64, w64, b64, "gelu", r64)
    base = reference.linear(*_leaves((x, w, b), lowp), "gelu", compute_dtype=lowp)
    assert_close("autocast out", out, ref, base)
    assert_close("autocast out + fp32 residual", out_res, ref_res, base.float() + r.detach(),
                 atol=ATOL[lowp])
    grads = torch.autograd.grad(out_res.sum(), (x, w, b, r))
    assert [t.dtype for t in grads] == [torch.float32] * 4
    assert launches["matmul"] == 4  # two forwards, dX and dW


def test_public_names():
    for name in ("linear", "mlp", "Linear", "MLP"):
        assert hasattr(fused_block, name)
