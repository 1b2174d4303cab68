"""fused_block.geglu and mlp(activation="geglu"): Gemma's tanh-GELU-gated FFN, forward and every gradient.

The same kernels as SwiGLU (tests/test_swiglu.py) with the gate's activation switched: gate and
up in one GEMM with two accumulators and ``gelu_tanh(gate) * up`` in its epilogue; dGate and
dUp in the epilogue of dH = dY @ W_down (or, for ``gated_linear``, the elementwise act_grad
pass). Compared with the float64 reference under the "twice PyTorch's own error" rule, in every
dtype and fp32 precision mode.
"""
import pytest
import torch
import torch.nn.functional as F

import fused_block
import fused_block.kernels.matmul as kmatmul
from fused_block import reference
from fused_block.linear import MLP, gated_linear, geglu, mlp

from gemm_testing import DTYPE_MODES, check, kernel_masks, seeded
from numerics import randn


def _inputs(M, D, F_, has_bias, has_res, dtype, device):
    x = randn(M, D, dtype=dtype, device=device, requires_grad=True)
    wg = randn(F_, D, dtype=dtype, device=device, scale=max(D, 1) ** -0.5 * 2.0, requires_grad=True)
    wu = randn(F_, D, dtype=dtype, device=device, scale=max(D, 1) ** -0.5, requires_grad=True)
    wd = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    r = randn(M, D, dtype=dtype, device=device, requires_grad=True) if has_res else None
    biases = [randn(n, dtype=dtype, device=device, requires_grad=True) if has_bias else None for n in (F_, F_, D)]
    return (x, wg, wu, wd, r, *biases)


def _ours(x, wg, wu, wd, r, bg, bu, bd):
    return geglu(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd)


def _ref(x, wg, wu, wd, r, bg, bu, bd, compute_dtype=None):
    return reference.geglu(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd, compute_dtype=compute_dtype)


# (M, D, F): d_model and the hidden size. The gate weights are scaled x2 so the gate spans the
# tanh GELU's curved region (|gate| up to ~4), not only its near-linear middle.
SHAPES = [
    (37, 8, 100),   # odd M; tiny d_model (masked K), hidden not a tile multiple (pointer path)
    (37, 64, 48),   # 16-byte aligned rows everywhere: descriptor loads and stores, both halves
]


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("bias_res", [(True, True), (False, False)], ids=["bias_res", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_geglu(shape, bias_res, dtype_mode, device, launches):
    dtype, mode = dtype_mode
    check("geglu", _ours, _ref, _inputs(*shape, *bias_res, dtype, device), dtype, device, mode)
    # forward: gate+up (one GEMM), down; backward: dH with dGate/dUp in its epilogue, dW_down,
    # [dW_gate; dW_up] in one GEMM, dX reading both weights in place.
    assert launches["matmul"] == 6
    assert launches["act_grad"] == 0
    assert launches["bias_grad_reduce"] == (1 if bias_res[0] else 0)


@pytest.mark.parametrize("path", ["tma", "pointer"])
def test_geglu_paths(path, device, launches, monkeypatch):
    monkeypatch.setattr(kmatmul, "FORCE_PATH", path)
    check("geglu path", _ours, _ref, _inputs(37, 64, 48, True, True, torch.bfloat16, device), torch.bfloat16,
          device)
    assert launches["matmul"] == 6


def test_geglu_sliced_epilogue(device, monkeypatch):
    # Several row and hidden-column tiles walked by persistent programs; both accumulators
    # sliced into two column halves in the epilogue.
    monkeypatch.setattr(kmatmul, "INTERPRETER_CONFIG", (128, 128, 64, 8, 1, 2))
    check("geglu tiles", _ours, _ref, _inputs(200, 48, 136, True, False, torch.bfloat16, device), torch.bfloat16,
          device)


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_mlp_geglu(dtype_mode, device, launches):
    # mlp's stacked [gate; up] weight, read as views.
    dtype, mode = dtype_mode
    M, D, F_ = 37, 24, 40
    x = randn(M, D, dtype=dtype, device=device, requires_grad=True)
    w1 = randn(2 * F_, D, dtype=dtype, device=device, scale=D ** -0.5 * 2.0, requires_grad=True)
    b1 = randn(2 * F_, dtype=dtype, device=device, requires_grad=True)
    w2 = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    b2 = randn(D, dtype=dtype, device=device, requires_grad=True)

    def ours(x, w1, b1, w2, b2):
        return mlp(x, w1, b1, w2, b2, "geglu")

    def ref(x, w1, b1, w2, b2, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, "geglu", compute_dtype=compute_dtype)

    check("mlp geglu", ours, ref, (x, w1, b1, w2, b2), dtype, device, mode)
    assert launches["matmul"] == 6


def test_mlp_geglu_dropout_matches_reference_with_kernel_masks(device, launches):
    # The hidden dropout in the gate/up epilogue, its mask regenerated in dGate/dUp's.
    M, D, F_ = 37, 24, 40
    p1, p2 = 0.3, 0.2
    x = randn(M, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    w1 = randn(2 * F_, D, dtype=torch.bfloat16, device=device, scale=D ** -0.5, requires_grad=True)
    w2 = randn(D, F_, dtype=torch.bfloat16, device=device, scale=F_ ** -0.5, requires_grad=True)
    r = randn(M, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    m1, m2 = kernel_masks(9, device, (M, F_, p1), (M, D, p2))

    def ours(x, w1, w2, r):
        return mlp(x, w1, None, w2, None, "geglu", r, p1, p2)

    def ref(x, w1, w2, r, compute_dtype=None):
        return reference.mlp(x, w1, None, w2, None, "geglu", r, p1, p2, dropout_mask=m1, output_dropout_mask=m2,
                             compute_dtype=compute_dtype)

    check("mlp geglu dropout", seeded(ours, 9), ref, (x, w1, w2, r), torch.bfloat16, device)


def test_geglu_dropouts_match_reference_with_kernel_masks(device, launches):
    # geglu's own dropout_p / output_dropout_p (T5 v1.1's FFN dropout and its residual's), the
    # gate and up weights read in place: the same kernels and masks as mlp's above.
    M, D, F_ = 37, 24, 40
    p1, p2 = 0.3, 0.2
    x, wg, wu, wd, r, _, _, _ = _inputs(M, D, F_, False, True, torch.bfloat16, device)
    m1, m2 = kernel_masks(9, device, (M, F_, p1), (M, D, p2))

    def ours(x, wg, wu, wd, r):
        return geglu(x, wg, wu, wd, r, dropout_p=p1, output_dropout_p=p2)

    def ref(x, wg, wu, wd, r, compute_dtype=None):
        return reference.geglu(x, wg, wu, wd, r, dropout_p=p1, output_dropout_p=p2, dropout_mask=m1,
                               output_dropout_mask=m2, compute_dtype=compute_dtype)

    check("geglu dropouts", seeded(ours, 9), ref, (x, wg, wu, wd, r), torch.bfloat16, device)
    assert launches["matmul"] == 6  # forward 2, backward 4


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[2]])
def test_gated_linear_geglu_with_dropout(dtype_mode, device, launches):
    # The first half alone (the path of PEFT LoRA on down_proj): dGate and dUp from the
    # elementwise act_grad kernel, the dropout mask regenerated there.
    dtype, mode = dtype_mode
    M, D, F_, p = 37, 24, 40, 0.25
    x, wg, wu, _, _, bg, bu, _ = _inputs(M, D, F_, True, False, dtype, device)
    (mask,) = kernel_masks(5, device, (M, F_, p))

    def ours(x, wg, wu, bg, bu):
        return gated_linear(x, wg, wu, bg, bu, dropout_p=p, activation="geglu")

    def ref(x, wg, wu, bg, bu, compute_dtype=None):
        return reference.gated(x, wg, wu, bg, bu, dropout_p=p, dropout_mask=mask, activation="geglu",
                               compute_dtype=compute_dtype)

    check("gated geglu", seeded(ours, 5), ref, (x, wg, wu, bg, bu), dtype, device, mode)
    assert launches["act_grad"] == 1


def test_geglu_no_grad_and_mlp_module(device, launches):
    torch.manual_seed(0)
    ours = MLP(24, 40, activation="geglu", bias=False, device=device)
    assert ours.linear1.weight.shape == (80, 24)
    x = randn(5, 24, dtype=torch.float32, device=device)
    with torch.no_grad():
        out = ours(x, residual=x)
        w1 = ours.linear1.weight
        expected = F.linear(F.gelu(F.linear(x, w1[:40]), approximate="tanh") * F.linear(x, w1[40:]),
                            ours.linear2.weight) + x
    assert out.grad_fn is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert launches["matmul"] == 2


def _bad_cases(device):
    x = torch.randn(4, 8, device=device)
    wg, wu, wd = torch.randn(16, 8, device=device), torch.randn(16, 8, device=device), torch.randn(8, 16, device=device)
    return [
        (lambda: geglu("x", wg, wu, wd), TypeError, "^x"),
        (lambda: geglu(x, wg, torch.randn(12, 8, device=device), wd), ValueError, "^w_up"),
        (lambda: geglu(x, wg, wu, torch.randn(8, 15, device=device)), ValueError, "^w_down"),
        (lambda: geglu(x, wg, wu.half(), wd), TypeError, "^w_up"),
        (lambda: mlp(x, torch.randn(15, 8, device=device), None, wd, None, "geglu"), ValueError, "^w1"),
        (lambda: gated_linear(x, wg, wu, activation="gelu"), ValueError, "^activation"),
        (lambda: gated_linear(x, wg, wu, activation=5), TypeError, "^activation"),
        (lambda: geglu(x, wg, wu, wd, dropout_p=1.0), ValueError, "^dropout_p"),
        (lambda: geglu(x, wg, wu, wd, output_dropout_p=-0.1), ValueError, "^output_dropout_p"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_geglu_bad_input(case, device, launches):
    fn, error, name = _bad_cases(device)[case]
    with pytest.raises(error, match=name):
        fn()
    assert launches["matmul"] == 0


def test_opcheck(device):
    dt = torch.float16
    ops = torch.ops.fused_block
    x, wg, wu, wd, r, bg, bu, bd = (t.detach() for t in _inputs(37, 24, 40, True, True, dt, device))
    seed = torch.tensor([7], dtype=torch.int64, device=device)
    torch.library.opcheck(ops.ffn_fwd.default, (x, wg, wu, bg, bu, wd, bd, r, "geglu", 1, seed, 0.2, seed + 1, 0.1))
    g = randn(37, 24, dtype=dt, device=device)
    pre = randn(37, 80, dtype=dt, device=device)
    torch.library.opcheck(ops.ffn_bwd.default, (g, x, wg, wu, wd, pre, seed, seed + 1, "geglu", 0.2, 0.1, 1, 24,
                                                True, True, True, True, True))


def test_public_names():
    assert fused_block.geglu is geglu and hasattr(fused_block.reference, "geglu")
