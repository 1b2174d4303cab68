"""The gated FFNs, forward and every gradient: ``fused_block.swiglu`` (LLaMA's SiLU gate) and
``fused_block.geglu`` (Gemma's tanh-GELU gate), and ``mlp(activation="swiglu" | "geglu")``.

One kernel family with the gate's activation switched: the gate and up projections run as one
GEMM with two accumulators (``act(gate) * up`` in its epilogue), reading both weights in place;
the backward computes dGate and dUp in the epilogue of dH = dY @ W_down (or, for
``gated_linear``, in the elementwise act_grad pass). Compared with the float64 reference under
the "twice PyTorch's own error" rule, in every dtype and fp32 precision mode. The cases each
activation runs are listed per test: both run the shared paths; option combinations that do
not depend on the activation run once, with SwiGLU.
"""
import pytest
import torch
import torch.nn.functional as F

import fused_block
import fused_block.kernels.matmul as kmatmul
from fused_block import reference
from fused_block.linear import MLP, gated_linear, geglu, mlp, swiglu

from gemm_testing import DTYPE_MODES, check, kernel_masks, saved_numels, seeded
from numerics import randn

# activation -> (public function, reference, the gate weights' scale, torch's activation). The
# GeGLU gate weights are scaled x2 so the gate spans the tanh GELU's curved region (|gate| up
# to ~4), not only its near-linear middle.
GATED = {
    "swiglu": (swiglu, reference.swiglu, 1.0, F.silu),
    "geglu": (geglu, reference.geglu, 2.0, lambda t: F.gelu(t, approximate="tanh")),
}
BOTH = list(GATED)


def _inputs(act, M, D, F_, has_bias, has_res, dtype, device, lead=()):
    x = randn(*lead, M, D, dtype=dtype, device=device, requires_grad=True)
    wg = randn(F_, D, dtype=dtype, device=device, scale=max(D, 1) ** -0.5 * GATED[act][2], requires_grad=True)
    wu = randn(F_, D, dtype=dtype, device=device, scale=max(D, 1) ** -0.5, requires_grad=True)
    wd = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    r = randn(*lead, M, D, dtype=dtype, device=device, requires_grad=True) if has_res else None
    biases = [randn(n, dtype=dtype, device=device, requires_grad=True) if has_bias else None for n in (F_, F_, D)]
    return (x, wg, wu, wd, r, *biases)


def _ours(act):
    def ours(x, wg, wu, wd, r, bg, bu, bd):
        return GATED[act][0](x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd)
    return ours


def _ref(act):
    def ref(x, wg, wu, wd, r, bg, bu, bd, compute_dtype=None):
        return GATED[act][1](x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd, compute_dtype=compute_dtype)
    return ref


def _stacked(act, D, F_, dtype, device):
    """mlp's stacked [gate; up] weight (and w2)."""
    w1 = randn(2 * F_, D, dtype=dtype, device=device, scale=D ** -0.5 * GATED[act][2], requires_grad=True)
    w2 = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    return w1, w2


# (M, D, F): d_model and the hidden size.
SHAPES = {
    "37x8x100": (37, 8, 100),  # odd M; tiny d_model (masked K), hidden not a tile multiple (pointer path)
    "1x24x40": (1, 24, 40),    # one row (decoding)
    "37x64x48": (37, 64, 48),  # 16-byte aligned rows everywhere: descriptor loads and stores, both halves
}
# The one-row case is the activation-independent decode shape: SwiGLU only.
CASES = [(act, s) for act in BOTH for s in SHAPES if act == "swiglu" or s != "1x24x40"]


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("bias_res", [(True, True), (False, False)], ids=["bias_res", "plain"])
@pytest.mark.parametrize("act,shape", CASES, ids=[f"{a}-{s}" for a, s in CASES])
@pytest.mark.sweep
def test_gated(act, shape, bias_res, dtype_mode, device, launches):
    dtype, mode = dtype_mode
    check(act, _ours(act), _ref(act), _inputs(act, *SHAPES[shape], *bias_res, dtype, device), dtype, device, mode)
    # forward: gate+up (one GEMM), down; backward: dH with dGate/dUp in its epilogue, dW_down
    # (dB_down's partials), [dW_gate; dW_up] in one GEMM, dX reading both weights in place.
    assert launches["matmul"] == 6
    assert launches["act_grad"] == 0
    assert launches["bias_grad_reduce"] == (1 if bias_res[0] else 0)


@pytest.mark.parametrize("act", BOTH)
@pytest.mark.parametrize("path", ["tma", "pointer"])
def test_gated_paths(path, act, device, launches, monkeypatch):
    monkeypatch.setattr(kmatmul, "FORCE_PATH", path)
    check(f"{act} path", _ours(act), _ref(act), _inputs(act, 37, 64, 48, True, True, torch.bfloat16, device),
          torch.bfloat16, device)
    assert launches["matmul"] == 6


TILES = {"64x64": (64, 64, 32, 4, 1, 1), "128x128x2": (128, 128, 64, 8, 1, 2)}
TILE_CASES = [("swiglu", "64x64"), ("swiglu", "128x128x2"), ("geglu", "128x128x2")]


@pytest.mark.parametrize("act,tile", TILE_CASES, ids=[f"{a}-{t}" for a, t in TILE_CASES])
def test_gated_other_tiles(act, tile, device, monkeypatch):
    # Several row and hidden-column tiles walked by persistent programs; both accumulators
    # sliced into two column halves in the epilogue.
    monkeypatch.setattr(kmatmul, "INTERPRETER_CONFIG", TILES[tile])
    check(f"{act} tiles", _ours(act), _ref(act), _inputs(act, 200, 48, 136, True, False, torch.bfloat16, device),
          torch.bfloat16, device)


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_swiglu_strided_weights_and_leading_dims(dtype_mode, device, launches):
    # Weights as transposed views (a checkpoint stored (in, out)) and x with two leading dims:
    # read through their strides, no copy; one bias only (the other is zero).
    dtype, mode = dtype_mode
    x, wg, wu, wd, r, bg, _, bd = _inputs("swiglu", 6, 24, 40, True, True, dtype, device, lead=(2,))
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
    x, wg, wu, wd, r, bg, bu, bd = _inputs("swiglu", 37, 24, 40, True, True, torch.bfloat16, device)
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


MLP_CASES = [pytest.param(act, DTYPE_MODES[i].values[0], id=f"{act}-{DTYPE_MODES[i].id}")
             for act, modes in (("swiglu", range(len(DTYPE_MODES))), ("geglu", (0, 3))) for i in modes]


@pytest.mark.parametrize("act,dtype_mode", MLP_CASES)
def test_mlp_gated(act, dtype_mode, device, launches):
    dtype, mode = dtype_mode
    M, D, F_ = 37, 24, 40
    x = randn(M, D, dtype=dtype, device=device, requires_grad=True)
    w1, w2 = _stacked(act, D, F_, dtype, device)
    b1 = randn(2 * F_, dtype=dtype, device=device, requires_grad=True)
    b2 = randn(D, dtype=dtype, device=device, requires_grad=True)

    def ours(x, w1, b1, w2, b2):
        return mlp(x, w1, b1, w2, b2, act)

    def ref(x, w1, b1, w2, b2, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, act, compute_dtype=compute_dtype)

    check(f"mlp {act}", ours, ref, (x, w1, b1, w2, b2), dtype, device, mode)
    assert launches["matmul"] == 6


DROPOUT_CASES = [("swiglu", (0.3, 0.2)), ("swiglu", (0.25, 0.0)), ("geglu", (0.3, 0.2))]


@pytest.mark.parametrize("act,dropouts", DROPOUT_CASES,
                         ids=[f"{a}-{'both' if p2 else 'hidden'}" for a, (_, p2) in DROPOUT_CASES])
def test_mlp_gated_dropout_matches_reference_with_kernel_masks(act, dropouts, device, launches):
    # The hidden dropout in the gate/up epilogue, its mask regenerated in dGate/dUp's.
    M, D, F_ = 37, 24, 40
    p1, p2 = dropouts
    x = randn(M, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    w1 = randn(2 * F_, D, dtype=torch.bfloat16, device=device, scale=D ** -0.5, requires_grad=True)
    w2 = randn(D, F_, dtype=torch.bfloat16, device=device, scale=F_ ** -0.5, requires_grad=True)
    r = randn(M, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    m1, m2 = kernel_masks(9, device, (M, F_, p1), (M, D, p2))

    def ours(x, w1, w2, r):
        return mlp(x, w1, None, w2, None, act, r, p1, p2)

    def ref(x, w1, w2, r, compute_dtype=None):
        return reference.mlp(x, w1, None, w2, None, act, r, p1, p2, dropout_mask=m1,
                             output_dropout_mask=m2 if p2 else None, compute_dtype=compute_dtype)

    check(f"mlp {act} dropout", seeded(ours, 9), ref, (x, w1, w2, r), torch.bfloat16, device)


def test_geglu_dropouts_match_reference_with_kernel_masks(device, launches):
    # geglu's own dropout_p / output_dropout_p (T5 v1.1's FFN dropout and its residual's; swiglu
    # takes the same arguments), the gate and up weights read in place: the same kernels and
    # masks as mlp's above.
    M, D, F_ = 37, 24, 40
    p1, p2 = 0.3, 0.2
    x, wg, wu, wd, r, _, _, _ = _inputs("geglu", M, D, F_, False, True, torch.bfloat16, device)
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
    # elementwise act_grad kernel, the dropout mask regenerated there (SwiGLU's: tests/test_lora.py).
    dtype, mode = dtype_mode
    M, D, F_, p = 37, 24, 40, 0.25
    x, wg, wu, _, _, bg, bu, _ = _inputs("geglu", M, D, F_, True, False, dtype, device)
    (mask,) = kernel_masks(5, device, (M, F_, p))

    def ours(x, wg, wu, bg, bu):
        return gated_linear(x, wg, wu, bg, bu, dropout_p=p, activation="geglu")

    def ref(x, wg, wu, bg, bu, compute_dtype=None):
        return reference.gated(x, wg, wu, bg, bu, dropout_p=p, dropout_mask=mask, activation="geglu",
                               compute_dtype=compute_dtype)

    check("gated geglu", seeded(ours, 5), ref, (x, wg, wu, bg, bu), dtype, device, mode)
    assert launches["act_grad"] == 1


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0]])
@pytest.mark.parametrize("given", ["b_gate", "b_up"])
def test_gated_linear_with_one_bias(given, dtype_mode, device, launches):
    """One of the two biases given: the other is zero (the kernel adds both or neither), output
    and every gradient against the reference; the kernel refuses one bias without the other."""
    dtype, mode = dtype_mode
    x, wg, wu, _, _, bg, bu, _ = _inputs("swiglu", 9, 24, 40, True, False, dtype, device)
    bg, bu = (bg, None) if given == "b_gate" else (None, bu)

    def ours(x, wg, wu, b):
        return gated_linear(x, wg, wu, *((b, None) if given == "b_gate" else (None, b)))

    def ref(x, wg, wu, b, compute_dtype=None):
        return reference.gated(x, wg, wu, *((b, None) if given == "b_gate" else (None, b)),
                               compute_dtype=compute_dtype)

    check("gated one bias", ours, ref, (x, wg, wu, bg if given == "b_gate" else bu), dtype, device, mode)
    assert launches["matmul"] >= 1
    c = torch.empty(9, 40, dtype=dtype, device=device)
    with pytest.raises(ValueError, match="bias2"):
        kmatmul.gemm(x.detach(), wg.detach(), c, b2=wu.detach(), bias=torch.zeros(40, dtype=dtype, device=device),
                     activation=kmatmul.SWIGLU, transpose_b=True)


@pytest.mark.parametrize("shape", [(0, 8, 16), (3, 0, 16)], ids=["no_rows", "no_in_features"])
def test_swiglu_zero_sizes(shape, device):
    inputs = _inputs("swiglu", *shape, True, True, torch.float32, device)
    out, ref = _ours("swiglu")(*inputs), _ref("swiglu")(*inputs)
    torch.testing.assert_close(out, ref)
    diff = [t for t in inputs if t is not None]
    for a, e in zip(torch.autograd.grad(out.sum(), diff), torch.autograd.grad(ref.sum(), diff)):
        torch.testing.assert_close(a, e)


def test_swiglu_saves_gate_and_up_only(device):
    # Less than eager (gate, up, silu(gate) and the hidden activation): x, the three weights
    # and the [gate | up] pre-activations; h is recomputed in backward.
    M, D, F_ = 37, 24, 40
    x, wg, wu, wd, r, bg, bu, bd = _inputs("swiglu", M, D, F_, True, True, torch.float32, device)
    saved = saved_numels(lambda: swiglu(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd))
    assert saved == sorted([M * D, F_ * D, F_ * D, D * F_, M * 2 * F_])


@pytest.mark.parametrize("act", BOTH)
def test_gated_no_grad_and_mlp_module(act, device, launches):
    torch.manual_seed(0)
    ours = MLP(24, 40, activation=act, bias=False, device=device)
    assert ours.linear1.weight.shape == (80, 24) and ours.linear2.weight.shape == (24, 40)
    assert ours.linear1.bias is None
    x = randn(5, 24, dtype=torch.float32, device=device)
    with torch.no_grad():
        out = ours(x, residual=x)
        w1 = ours.linear1.weight
        expected = F.linear(GATED[act][3](F.linear(x, w1[:40])) * F.linear(x, w1[40:]), ours.linear2.weight) + x
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
        (lambda: geglu("x", wg, wu, wd), TypeError, "^x"),
        (lambda: geglu(x, wg, torch.randn(12, 8, device=device), wd), ValueError, "^w_up"),
        (lambda: geglu(x, wg, wu, torch.randn(8, 15, device=device)), ValueError, "^w_down"),
        (lambda: geglu(x, wg, wu.half(), wd), TypeError, "^w_up"),
        (lambda: mlp(x, torch.randn(15, 8, device=device), None, wd, None, "geglu"), ValueError, "^w1"),
        (lambda: gated_linear(x, wg, wu, activation="gelu"), ValueError, "^activation"),
        (lambda: gated_linear(x, wg, wu, activation=5), TypeError, "^activation"),
        (lambda: geglu(x, wg, wu, wd, dropout_p=1.5), ValueError, "^dropout_p"),
        (lambda: geglu(x, wg, wu, wd, output_dropout_p=-0.1), ValueError, "^output_dropout_p"),
        (lambda: swiglu(x, wg, wu, wd, dropout_p=-0.5), ValueError, "^dropout_p"),
    ]


@pytest.mark.parametrize("case", range(26))
def test_gated_bad_input(case, device, launches):
    fn, error, name = _bad_cases(device)[case]
    with pytest.raises(error, match=name):
        fn()
    assert launches["matmul"] == 0


@pytest.mark.parametrize("act,saves", [("swiglu", (0, 1, 2)), ("geglu", (1,))], ids=BOTH)
def test_opcheck(act, saves, device):
    dt = torch.float16
    ops = torch.ops.fused_block
    x, wg, wu, wd, r, bg, bu, bd = (t.detach() for t in _inputs(act, 37, 24, 40, True, True, dt, device))
    seed = torch.tensor([7], dtype=torch.int64, device=device)
    for save in saves:
        torch.library.opcheck(ops.ffn_fwd.default, (x, wg, wu, bg, bu, wd, bd, r, act, save, seed, 0.2, seed + 1,
                                                    0.1))
    g = randn(37, 24, dtype=dt, device=device)
    pre = randn(37, 80, dtype=dt, device=device)
    torch.library.opcheck(ops.ffn_bwd.default, (g, x, wg, wu, wd, pre, seed, seed + 1, act, 0.2, 0.1, 1, 24,
                                                True, True, True, True, True))


def test_torch_compile_fullgraph(device, launches):
    inputs = _inputs("swiglu", 37, 24, 40, True, True, torch.float32, device)
    compiled = torch.compile(_ours("swiglu"), fullgraph=True)
    out = compiled(*inputs)
    grads = torch.autograd.grad(out.sum(), [t for t in inputs if t is not None])
    eager = _ours("swiglu")(*inputs)
    eager_grads = torch.autograd.grad(eager.sum(), [t for t in inputs if t is not None])
    torch.testing.assert_close(out, eager)
    for a, e in zip(grads, eager_grads):
        torch.testing.assert_close(a, e)
    assert launches["matmul"] == 12


def test_public_names():
    assert fused_block.swiglu is swiglu and hasattr(fused_block.reference, "swiglu")
    assert fused_block.geglu is geglu and hasattr(fused_block.reference, "geglu")
