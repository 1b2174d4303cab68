"""fused_block.swiglu and mlp(activation="swiglu"): LLaMA's gated FFN, forward and every gradient.

The gate and up projections run as one GEMM with two accumulators (the SiLU-multiply in its
epilogue), reading both weights in place; the backward computes dGate and dUp in the epilogue
of dH = dY @ W_down. Compared with the float64 reference under the "twice PyTorch's own error"
rule, in every dtype and fp32 precision mode.
"""
import pytest
import torch
import torch.nn.functional as F

import fused_block
import fused_block.kernels.matmul as kmatmul
from fused_block import reference
from fused_block.linear import MLP, mlp, swiglu

from gemm_testing import DTYPE_MODES, check, kernel_masks, saved_numels, seeded
from numerics import randn


def _inputs(M, D, F_, has_bias, has_res, dtype, device, lead=()):
    x = randn(*lead, M, D, dtype=dtype, device=device, requires_grad=True)
    wg = randn(F_, D, dtype=dtype, device=device, scale=D ** -0.5, requires_grad=True)
    wu = randn(F_, D, dtype=dtype, device=device, scale=D ** -0.5, requires_grad=True)
    wd = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    r = randn(*lead, M, D, dtype=dtype, device=device, requires_grad=True) if has_res else None
    biases = [randn(n, dtype=dtype, device=device, requires_grad=True) if has_bias else None for n in (F_, F_, D)]
    return (x, wg, wu, wd, r, *biases)


def _ours(x, wg, wu, wd, r, bg, bu, bd):
    return swiglu(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd)


def _ref(x, wg, wu, wd, r, bg, bu, bd, compute_dtype=None):
    return reference.swiglu(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd, compute_dtype=compute_dtype)


# (M, D, F): d_model and the hidden size.
SHAPES = [
    (37, 8, 100),   # odd M; tiny d_model (masked K), hidden not a tile multiple (pointer path)
    (1, 24, 40),    # one row (decoding)
    (37, 64, 48),   # 16-byte aligned rows everywhere: descriptor loads and stores, both halves
]


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("bias_res", [(True, True), (False, False)], ids=["bias_res", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_swiglu(shape, bias_res, dtype_mode, device, launches):
    dtype, mode = dtype_mode
    check("swiglu", _ours, _ref, _inputs(*shape, *bias_res, dtype, device), dtype, device, mode)
    # forward: gate+up (one GEMM), down; backward: dH with dGate/dUp in its epilogue, dW_down
    # (dB_down's partials), [dW_gate; dW_up] in one GEMM, dX reading both weights in place.
    assert launches["matmul"] == 6
    assert launches["act_grad"] == 0
    assert launches["bias_grad_reduce"] == (1 if bias_res[0] else 0)


@pytest.mark.parametrize("path", ["tma", "pointer"])
def test_swiglu_paths(path, device, launches, monkeypatch):
    monkeypatch.setattr(kmatmul, "FORCE_PATH", path)
    check("swiglu path", _ours, _ref, _inputs(37, 64, 48, True, True, torch.bfloat16, device), torch.bfloat16,
          device)
    assert launches["matmul"] == 6


@pytest.mark.parametrize("tile", [(64, 64, 32, 4, 1, 1), (128, 128, 64, 8, 1, 2)], ids=["64x64", "128x128x2"])
def test_swiglu_other_tiles(tile, device, monkeypatch):
    # Several row and hidden-column tiles walked by persistent programs; both accumulators
    # sliced into two column halves in the epilogue.
    monkeypatch.setattr(kmatmul, "INTERPRETER_CONFIG", tile)
    check("swiglu tiles", _ours, _ref, _inputs(200, 48, 136, True, False, torch.bfloat16, device), torch.bfloat16,
          device)


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_swiglu_strided_weights_and_leading_dims(dtype_mode, device, launches):
    # Weights as transposed views (a checkpoint stored (in, out)) and x with two leading dims:
    # read through their strides, no copy; one bias only (the other is zero).
    dtype, mode = dtype_mode
    x, wg, wu, wd, r, bg, _, bd = _inputs(6, 24, 40, True, True, dtype, device, lead=(2,))
    wg = wg.detach().t().contiguous().t().requires_grad_()
    wd = wd.detach().t().contiguous().t().requires_grad_()

    def ours(x, wg, wu, wd, r, bg, bd):
        return swiglu(x, wg, wu, wd, r, b_gate=bg, b_down=bd)

    def ref(x, wg, wu, wd, r, bg, bd, compute_dtype=None):
        return reference.swiglu(x, wg, wu, wd, r, b_gate=bg, b_down=bd, compute_dtype=compute_dtype)

    check("swiglu strided", ours, ref, (x, wg, wu, wd, r, bg, bd), dtype, device, mode)


def test_mlp_swiglu_is_swiglu_on_stacked_weights(device, launches):
    # mlp(activation="swiglu") with w1 = [gate rows; up rows] runs the same kernels on views
    # of w1: the same output, and w1's gradient is [dW_gate; dW_up] (one buffer, no copies).
    x, wg, wu, wd, r, bg, bu, bd = _inputs(37, 24, 40, True, True, torch.bfloat16, device)
    w1 = torch.cat([wg, wu]).detach().requires_grad_()
    b1 = torch.cat([bg, bu]).detach().requires_grad_()
    g = randn(37, 24, dtype=torch.bfloat16, device=device)
    out = swiglu(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd)
    grads = torch.autograd.grad(out, (x, wg, wu, bg, bu, wd, bd, r), g)
    out_mlp = mlp(x, w1, b1, wd, bd, "swiglu", r)
    grads_mlp = torch.autograd.grad(out_mlp, (x, w1, b1, wd, bd, r), g)
    assert torch.equal(out, out_mlp)
    assert torch.equal(grads_mlp[1], torch.cat(grads[1:3])) and torch.equal(grads_mlp[2], torch.cat(grads[3:5]))
    for a, b in zip((grads[0], *grads[5:]), (grads_mlp[0], *grads_mlp[3:])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
def test_mlp_swiglu(dtype_mode, device, launches):
    dtype, mode = dtype_mode
    M, D, F_ = 37, 24, 40
    x = randn(M, D, dtype=dtype, device=device, requires_grad=True)
    w1 = randn(2 * F_, D, dtype=dtype, device=device, scale=D ** -0.5, requires_grad=True)
    b1 = randn(2 * F_, dtype=dtype, device=device, requires_grad=True)
    w2 = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    b2 = randn(D, dtype=dtype, device=device, requires_grad=True)

    def ours(x, w1, b1, w2, b2):
        return mlp(x, w1, b1, w2, b2, "swiglu")

    def ref(x, w1, b1, w2, b2, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, "swiglu", compute_dtype=compute_dtype)

    check("mlp swiglu", ours, ref, (x, w1, b1, w2, b2), dtype, device, mode)
    assert launches["matmul"] == 6


@pytest.mark.parametrize("dropouts", [(0.3, 0.2), (0.25, 0.0)], ids=["both", "hidden"])
def test_mlp_swiglu_dropout_matches_reference_with_kernel_masks(dropouts, device, launches):
    # The hidden dropout in the gate/up epilogue, its mask regenerated in dGate/dUp's.
    M, D, F_ = 37, 24, 40
    p1, p2 = dropouts
    x = randn(M, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    w1 = randn(2 * F_, D, dtype=torch.bfloat16, device=device, scale=D ** -0.5, requires_grad=True)
    w2 = randn(D, F_, dtype=torch.bfloat16, device=device, scale=F_ ** -0.5, requires_grad=True)
    r = randn(M, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    m1, m2 = kernel_masks(9, device, (M, F_, p1), (M, D, p2))

    def ours(x, w1, w2, r):
        return mlp(x, w1, None, w2, None, "swiglu", r, p1, p2)

    def ref(x, w1, w2, r, compute_dtype=None):
        return reference.mlp(x, w1, None, w2, None, "swiglu", r, p1, p2, dropout_mask=m1,
                             output_dropout_mask=m2 if p2 else None, compute_dtype=compute_dtype)

    check("mlp swiglu dropout", seeded(ours, 9), ref, (x, w1, w2, r), torch.bfloat16, device)


def test_swiglu_saves_gate_and_up_only(device):
    # Less than eager (gate, up, silu(gate) and the hidden activation): x, the three weights
    # and the [gate | up] pre-activations; h is recomputed in backward.
    M, D, F_ = 37, 24, 40
    x, wg, wu, wd, r, bg, bu, bd = _inputs(M, D, F_, True, True, torch.float32, device)
    saved = saved_numels(lambda: swiglu(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd))
    assert saved == sorted([M * D, F_ * D, F_ * D, D * F_, M * 2 * F_])


def test_swiglu_no_grad_and_mlp_module(device, launches):
    torch.manual_seed(0)
    ours = MLP(24, 40, activation="swiglu", bias=False, device=device)
    assert ours.linear1.weight.shape == (80, 24) and ours.linear2.weight.shape == (24, 40)
    assert ours.linear1.bias is None
    x = randn(5, 24, dtype=torch.float32, device=device)
    with torch.no_grad():
        out = ours(x, residual=x)
        w1 = ours.linear1.weight
        expected = F.linear(F.silu(F.linear(x, w1[:40])) * F.linear(x, w1[40:]), ours.linear2.weight) + x
    assert out.grad_fn is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert launches["matmul"] == 2


def _bad_cases(device):
    x = torch.randn(4, 8, device=device)
    wg, wu, wd = torch.randn(16, 8, device=device), torch.randn(16, 8, device=device), torch.randn(8, 16, device=device)
    b16, b8 = torch.randn(16, device=device), torch.randn(8, device=device)
    return [
        (lambda: swiglu("x", wg, wu, wd), TypeError, "^x"),
        (lambda: swiglu(x, torch.randn(16, 9, device=device), wu, wd), ValueError, "^w_gate"),
        (lambda: swiglu(x, wg, torch.randn(16, 9, device=device), wd), ValueError, "^w_up"),
        (lambda: swiglu(x, wg, torch.randn(12, 8, device=device), wd), ValueError, "^w_up"),
        (lambda: swiglu(x, wg, wu, torch.randn(8, 15, device=device)), ValueError, "^w_down"),
        (lambda: swiglu(x, wg, wu, wd[0]), ValueError, "^w_down"),
        (lambda: swiglu(x, wg, wu.half(), wd), TypeError, "^w_up"),
        (lambda: swiglu(x, wg, wu, wd.half()), TypeError, "^w_down"),
        (lambda: swiglu(x, wg, wu, wd, b_gate=b8), ValueError, "^b_gate"),
        (lambda: swiglu(x, wg, wu, wd, b_up=b8), ValueError, "^b_up"),
        (lambda: swiglu(x, wg, wu, wd, b_down=b16), ValueError, "^b_down"),
        (lambda: swiglu(x, wg, wu, wd, b_up=b16.double()), TypeError, "^b_up"),
        (lambda: swiglu(x, wg, wu, wd, residual=torch.randn(4, 16, device=device)), ValueError, "^residual"),
        (lambda: swiglu(x, wg, wu.to("meta"), wd), ValueError, "^w_up"),
        (lambda: mlp(x, torch.randn(15, 8, device=device), None, wd, None, "swiglu"), ValueError, "^w1"),
        (lambda: mlp(x, torch.randn(32, 8, device=device), None, torch.randn(8, 32, device=device), None, "swiglu"),
         ValueError, "^w2"),
    ]


@pytest.mark.parametrize("case", range(16))
def test_swiglu_bad_input(case, device, launches):
    fn, error, name = _bad_cases(device)[case]
    with pytest.raises(error, match=name):
        fn()
    assert launches["matmul"] == 0


def test_opcheck(device):
    dt = torch.float16
    ops = torch.ops.fused_block
    x, wg, wu, wd, r, bg, bu, bd = (t.detach() for t in _inputs(37, 24, 40, True, True, dt, device))
    seed = torch.tensor([7], dtype=torch.int64, device=device)
    for save in (0, 1, 2):
        torch.library.opcheck(ops.ffn_fwd.default, (x, wg, wu, bg, bu, wd, bd, r, "swiglu", save, seed, 0.2,
                                                    seed + 1, 0.1))
    g = randn(37, 24, dtype=dt, device=device)
    pre = randn(37, 80, dtype=dt, device=device)
    torch.library.opcheck(ops.ffn_bwd.default, (g, x, wg, wu, wd, pre, seed, seed + 1, "swiglu", 0.2, 0.1, 1, 24,
                                                True, True, True, True, True))


def test_torch_compile_fullgraph(device, launches):
    inputs = _inputs(37, 24, 40, True, True, torch.float32, device)
    compiled = torch.compile(_ours, fullgraph=True)
    out = compiled(*inputs)
    grads = torch.autograd.grad(out.sum(), [t for t in inputs if t is not None])
    eager = _ours(*inputs)
    eager_grads = torch.autograd.grad(eager.sum(), [t for t in inputs if t is not None])
    torch.testing.assert_close(out, eager)
    for a, e in zip(grads, eager_grads):
        torch.testing.assert_close(a, e)
    assert launches["matmul"] == 12


def test_public_names():
    assert fused_block.swiglu is swiglu and hasattr(fused_block.reference, "swiglu")
