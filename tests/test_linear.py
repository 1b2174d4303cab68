"""fused_block.linear / mlp: GEMM + bias + activation + dropout + residual epilogues, forward and
backward, both main-loop paths (TMA descriptors and pointers), fp32 in both precision modes.

Every result and every gradient is compared with the float64 reference under the "twice
PyTorch's own error" rule (numerics.assert_close), PyTorch's error measured in the same dtype
and fp32 precision mode (tests/gemm_testing.py). Shapes are small: the interpreter's cost is per
program and per op, and its default tile (256x256x128) covers most of them in one program;
tests that need several tiles, persistent programs or the sliced epilogue swap in smaller
tiles (``INTERPRETER_CONFIG``).
"""

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import fused_block
import fused_block.kernels.matmul as kmatmul
from fused_block import reference
from fused_block.kernels import common
from fused_block.linear import MLP, Linear, gated_linear, geglu, linear, mlp, swiglu

from gemm_testing import (DTYPE_MODES, MODES, baseline_mode, check, fp32_mode, kernel_masks, leaves, round_to_tf32,
                          saved_numels, seeded)
from numerics import ATOL, assert_close, randn

ACTS = (None, "gelu", "gelu_tanh", "relu")


def _linear_inputs(M, K, N, has_bias, has_res, dtype, device, lead=()):
    x = randn(*lead, M, K, dtype=dtype, device=device, requires_grad=True)
    w = randn(N, K, dtype=dtype, device=device, scale=max(K, 1) ** -0.5, requires_grad=True)
    b = randn(N, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    r = randn(*lead, M, N, dtype=dtype, device=device, requires_grad=True) if has_res else None
    return x, w, b, r


def test_tf32_rounding_emulation():
    # The TF32 baseline's operand rounding: 10 mantissa bits, nearest, specials kept.
    x = torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -(1.0 + 2.0**-11), float("inf"), float("nan")])
    r = round_to_tf32(x)
    assert r[:3].tolist() == [1.0 + 2.0**-10, 1.0 + 2 * 2.0**-10, -(1.0 + 2.0**-10)]
    assert r[3] == float("inf") and r[4].isnan()


@triton.jit
def _to_tf32_probe(X, Y, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, common.to_tf32(x, INTERPRET), mask=offs < n)


def test_to_tf32_rounds_as_the_baseline(device):
    # common.to_tf32 (cvt.rna.tf32.f32 on the GPU, bit arithmetic in the interpreter) rounds
    # exactly as the TF32 baseline's operands: random magnitudes over the whole fp32 range,
    # ties (1 + 2^-11), the largest finite value (rounds to inf), subnormals, zeros, specials.
    tiny = torch.finfo(torch.float32).tiny
    special = [1.0 + 2.0**-11, -(1.0 + 3 * 2.0**-11), torch.finfo(torch.float32).max, tiny, tiny / 3, -tiny / 7,
               0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    x = torch.cat([torch.randn(4000) * 2.0 ** torch.randint(-140, 120, (4000,)).float(), torch.tensor(special)])
    x = x.to(device)
    y = torch.empty_like(x)
    block = 1024
    common.launch("to_tf32_probe", _to_tf32_probe, (common.cdiv(x.numel(), block),), (x, y, x.numel()),
                  dict(BLOCK=block, INTERPRET=common.interpreting()), common.Config.of(num_warps=4))
    expected = round_to_tf32(x)
    assert torch.equal(y.isnan(), expected.isnan())
    same = (y.view(torch.int32) == expected.view(torch.int32)) | y.isnan()
    assert same.all(), f"{x[~same][:8].tolist()} -> {y[~same][:8].tolist()}, expected {expected[~same][:8].tolist()}"


def test_tf32_products_round_their_operands(device, launches):
    # TF32 tensor cores read an fp32 operand's upper 19 bits: fed raw fp32 they truncate it
    # toward zero (the tests' interpreter does the same: tests/interpreter_hardware.py), a bias
    # that positive operands add up over K (-6e-4 of every output here, 10x torch's error,
    # whose cuBLAS rounds to nearest). common.dot rounds them to nearest TF32 first.
    x = (torch.rand(64, 64) + 1.0).to(device).requires_grad_()
    w = (torch.rand(48, 64) + 1.0).to(device).requires_grad_()

    def ref(x, w, compute_dtype=None):
        return reference.linear(x, w, compute_dtype=compute_dtype)

    check("tf32 linear", lambda x, w: linear(x, w), ref, (x, w), torch.float32, device, "tf32")
    assert launches["matmul"] == 3


def test_ieee_accumulation_error(device, launches, monkeypatch, fma_chains):
    # IEEE fp32 products run on the FMA units (the interpreter here does the same, one FMA per
    # k in k order: the fma_chains fixture) on the GPU's IEEE tile (64x64, BLOCK_K 16). A weight
    # gradient reduces over the rows: as one FMA chain over 1024 rows its error grew like K
    # (4.5x torch's here; 2.7x on an H200 over 512 rows); summed per K block (common.dot_step)
    # it is torch's.
    monkeypatch.setattr(kmatmul, "INTERPRETER_CONFIG", kmatmul.CONFIGS[(90, "ieee", False)][0])
    x = randn(1024, 32, dtype=torch.float32, device=device)
    w = randn(64, 32, dtype=torch.float32, device=device, scale=32 ** -0.5, requires_grad=True)

    def ref(x, w, compute_dtype=None):
        return reference.linear(x, w, compute_dtype=compute_dtype)

    check("ieee linear", lambda x, w: linear(x, w), ref, (x, w), torch.float32, device, "ieee")
    assert launches["matmul"] == 2  # the forward and dW


@pytest.mark.parametrize("mode", MODES)
def test_fp32_precision_follows_torch_at_call_time(mode, device, monkeypatch):
    # The kernels read torch's switch on every call (no import-time global): the products'
    # precision is a constexpr of the launch; fp16/bf16 launches are unaffected.
    seen = []
    launch = common.launch

    def spy(name, kernel, grid, args, constexprs, config):
        seen.append(constexprs.get("PRECISION"))
        return launch(name, kernel, grid, args, constexprs, config)

    monkeypatch.setattr(common, "launch", spy)
    x, w, _, _ = _linear_inputs(4, 8, 8, False, False, torch.float32, device)
    with fp32_mode(mode):
        linear(x.detach(), w.detach())
        linear(x.detach().half(), w.detach().half())
    assert seen == [mode, "tf32"]


# ---------------------------------------------------------------------------------------------
# the epilogues' activations against float64
# ---------------------------------------------------------------------------------------------

@triton.jit
def _activation_probe(X, Y, D, n, ACTIVATION: tl.constexpr, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    if ACTIVATION == kmatmul.SWIGLU:
        d, y = kmatmul._gate_grad(x, ACTIVATION, FAST)  # the gate's SiLU
    else:
        d, y = kmatmul._act_grad(x, ACTIVATION, FAST)
    tl.store(Y + offs, y, mask=offs < n)
    tl.store(D + offs, d, mask=offs < n)


def _probe(x, activation, fast):
    """(act(x), act'(x)) in fp32 from the epilogues' code (``FAST``: their 16-bit-output forms)."""
    y, d = torch.empty_like(x), torch.empty_like(x)
    block = 4096
    common.launch("activation_probe", _activation_probe, (common.cdiv(x.numel(), block),), (x, y, d, x.numel()),
                  dict(ACTIVATION=activation, FAST=fast, BLOCK=block), common.Config.of(num_warps=4))
    return y, d


def _act64(x, kind):
    """The activation and its derivative in float64: the GELU as x * Phi(x) (erf) or
    x * sigmoid(2u) (tanh), SiLU as x * sigmoid(x)."""
    x = x.double()
    if kind == "silu":
        s = torch.sigmoid(x)
        return x * s, s + x * s * (1 - s)
    if kind == "tanh":
        k0, k1 = (2 / torch.pi) ** 0.5, 0.044715
        s = torch.sigmoid(2 * k0 * (x + k1 * x**3))
        return x * s, s + 2 * x * s * (1 - s) * k0 * (1 + 3 * k1 * x * x)
    cdf = 0.5 * torch.special.erfc(-x / 2**0.5)
    return x * cdf, cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5


# fp32 inputs over the whole range: a fine grid where the activations bend (spacing 2^-12) and
# 200 magnitudes per decade out to 1e18 both ways (past that the tanh form's x^3 overflows, in
# the fp32 path as in the reference's fp32 rounding).
_GRID = torch.cat([torch.arange(-2**17, 2**17 + 1) * 2.0**-12,
                   torch.logspace(-30, 18, 9601), -torch.logspace(-30, 18, 9601), torch.zeros(1)])


# kind: (activation code, bounds (activation, derivative) of the fast form, then of the full one)
_FAST_FORMS = {"erf": (kmatmul.ACTIVATIONS["gelu"], (1e-6, 1e-6), (3e-7, 3e-7)),
               "tanh": (kmatmul.ACTIVATIONS["gelu_tanh"], (1e-6, 1e-5), (3e-7, 3e-7)),
               "silu": (kmatmul.SWIGLU, (1e-6, 5e-6), (3e-7, 2e-6))}


@pytest.mark.parametrize("kind", list(_FAST_FORMS))
def test_fast_gelu_against_float64(kind, device):
    # The short forms 16-bit outputs get (fp32 FMAs, one or two MUFU ops): the erf GELU from a
    # degree-5 fit of log2 Phi (measured: 7.0e-7 in the GELU, 7.5e-7 in its derivative), the
    # tanh GELU's sigmoid as rsqrt(1 + 2^-z)^2 (2.7e-7; the derivative's s (1 - s) 5.4e-6 where
    # x^3 scales it), SwiGLU's gate SiLU with the same sigmoid (2.6e-7; its derivative 2.6e-6
    # at x ~ 16, where s (1 - s) ~ 1e-7 is an ulp of 1). Errors of the activation relative to
    # max(1, |x|), as the numerics rule measures them against the largest output: a 500th
    # (derivatives: a 90th) of the rounding that rule allows a 16-bit output at 1.0 (half an
    # ulp: fp16 4.9e-4, bf16 3.9e-3). The fp32 outputs' full-accuracy forms: 1e-7 to 1.7e-7
    # (SiLU's derivative s (1 + x (1 - s)): 9.8e-7, the same ulp of 1 in 1 - s).
    act, fast_bounds, full_bounds = _FAST_FORMS[kind]
    x = _GRID.to(device)
    ref_y, ref_d = _act64(x, kind)
    scale = x.double().abs().clamp(min=1.0)
    for fast, (bound_y, bound_d) in ((True, fast_bounds), (False, full_bounds)):
        y, d = _probe(x, act, fast)
        err_y = ((y.double() - ref_y).abs() / scale).max().item()
        err_d = (d.double() - ref_d).abs().max().item()
        assert err_y < bound_y and err_d < bound_d, (fast, err_y, err_d)
    # Non-finite inputs: NaN stays NaN, +inf gives inf (as float64), -inf NaN (-inf * 0).
    special = torch.tensor([float("nan"), float("inf"), float("-inf")], device=device)
    y, _ = _probe(special, act, True)
    assert y[0].isnan() and y[1] == float("inf") and y[2].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemm_gelu_form_follows_the_output_dtype(dtype, device):
    # c = gelu(x @ 1) with K = 1 (exact products): fp32 outputs keep libdevice's erf, 16-bit
    # ones take the fast form, whatever the operands (bf16 operands with an fp32 output: the
    # fp32 residual stream of autocast).
    x = torch.linspace(-4, 4, 256, device=device).to(torch.bfloat16).float()
    out = common.empty((256, 8), dtype, device)
    kmatmul.gemm(x.to(torch.bfloat16)[:, None], torch.ones(1, 8, dtype=torch.bfloat16, device=device), out,
                 activation=kmatmul.ACTIVATIONS["gelu"])
    fast, precise = _probe(x, 1, True)[0], _probe(x, 1, False)[0]
    expect = precise if dtype == torch.float32 else fast.to(dtype)
    assert torch.equal(out, expect[:, None].expand(256, 8))


# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------

# Cheap shapes (M, K, N), run with every activation, with and without bias + residual:
SMALL = [
    (1, 8, 100),    # one row (decoding); K below one BLOCK_K; N not a tile multiple
    (37, 100, 8),   # odd M; masked K loop (pointer path: 200-byte bf16 rows are not 16-aligned)
    (37, 64, 40),   # TMA-aligned rows (x, W and out): descriptor loads and stores, edges clipped
]


# (bias + residual, dtype and fp32 mode): fp32's tf32 mode once, with bias and residual (the
# products are the same kernels with another constexpr).
BIAS_MODES = [pytest.param(((has, has), dm.values[0]), id=f"{'bias_res' if has else 'plain'}-{dm.id}")
              for has in (True, False) for dm in DTYPE_MODES if has or dm.id != "fp32-tf32"]


@pytest.mark.parametrize("bias_mode", BIAS_MODES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.sweep
def test_linear(shape, activation, bias_mode, device, launches):
    bias_res, (dtype, mode) = bias_mode
    x, w, b, r = _linear_inputs(*shape, *bias_res, dtype, device)

    def ours(x, w, b, r):
        return linear(x, w, b, activation, r)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, activation, r, compute_dtype=compute_dtype)

    check("linear", ours, ref, (x, w, b, r), dtype, device, mode)
    assert launches["matmul"] == 3  # forward, dX, dW
    # act' in one elementwise pass (which also sums dB); without an activation dB's partial
    # sums come from the dW GEMM; one reduction writes dB in the bias's dtype.
    assert launches["act_grad"] == (1 if activation else 0)
    assert launches["bias_grad_reduce"] == (1 if bias_res[0] else 0)


# Larger shapes, once each with the full epilogue (the interpreter is slow on big GEMMs):
LARGE = [
    (512, 3072, 100),  # long K reduction (d_ff -> d); M a tile multiple; 24 K steps
    (512, 104, 768),   # M and N tile multiples (unclipped epilogue), several row/column tiles
]


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "x".join(map(str, s)))
def test_linear_large(shape, dtype_mode, device, launches):
    dtype, mode = dtype_mode
    x, w, b, r = _linear_inputs(*shape, True, True, dtype, device)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, "gelu", r, compute_dtype=compute_dtype)

    check("linear", lambda x, w, b, r: linear(x, w, b, "gelu", r), ref, (x, w, b, r), dtype, device, mode)
    assert launches["matmul"] == 3


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
def test_linear_leading_dims_strided_weight_and_partial_grads(dtype_mode, device, launches):
    # x with two leading dims; weight a transposed view (no copy: the kernel takes strides);
    # only some inputs require grad, so backward computes (and forward saves) only those.
    dtype, mode = dtype_mode
    x = randn(2, 3, 40, dtype=dtype, device=device)
    w = randn(40, 24, dtype=dtype, device=device, scale=40 ** -0.5).t().requires_grad_()
    b = randn(24, dtype=dtype, device=device)
    r = randn(2, 3, 24, dtype=dtype, device=device, requires_grad=True)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, "gelu_tanh", r, compute_dtype=compute_dtype)

    check("linear", lambda x, w, b, r: linear(x, w, b, "gelu_tanh", r), ref, (x, w, b, r), dtype, device, mode)
    assert launches["matmul"] == 2  # forward and dW only


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[1], DTYPE_MODES[3]])
def test_linear_warp_specialized_tile_loop(dtype_mode, device, launches, monkeypatch):
    # sm_90's warp-specialized candidates (WS_CONFIGS, opt-in: FUSED_BLOCK_WS=1) run the
    # unflattened tile loop with tl.range(warp_specialize=True) on one of their tiles: 300x136
    # outputs make 6 tiles of 128x128 for the interpreter's 4 persistent programs (on sm_90
    # the first eligible WS candidate, FUSED_BLOCK_TUNE=0). Eligible: simple epilogues on one K
    # loop, here the backward's GEMMs (dx, dW with its row sums for dB) and a forward that
    # saves nothing; TF32 only with x @ W.T's K-major operands. Without the switch: none.
    dtype, mode = dtype_mode
    if device.type == "cuda" and common.arch(device) != 90:
        pytest.skip("warp specialization is an sm_90 candidate")
    monkeypatch.setattr(kmatmul, "INTERPRETER_CONFIG", kmatmul.WS_CONFIGS[(90, "16")][1][:4] + (1, 1))
    monkeypatch.setattr(common, "WARP_SPECIALIZE", True)
    monkeypatch.setattr(common, "TUNE", False)
    monkeypatch.setattr(kmatmul, "_CACHE", common.ConfigCache("matmul"))
    seen = []
    launch = common.launch

    def spy(name, kernel, grid, args, constexprs, config):
        if name == "matmul":
            seen.append((config["WARP_SPECIALIZE"], constexprs["FLATTEN"]))
        return launch(name, kernel, grid, args, constexprs, config)

    monkeypatch.setattr(common, "launch", spy)
    x, w, b, _ = _linear_inputs(300, 48, 136, True, False, dtype, device)

    def ref(x, w, b, compute_dtype=None):
        return reference.linear(x, w, b, "gelu", compute_dtype=compute_dtype)

    check("linear ws", lambda x, w, b: linear(x, w, b, "gelu"), ref, (x, w, b), dtype, device, mode)
    with fp32_mode(mode), torch.no_grad():
        out = linear(x, w, b, "gelu")
    with baseline_mode(dtype, mode):
        base = ref(*leaves((x, w, b)), compute_dtype=dtype)
    assert_close("linear ws no grad", out, ref(*leaves((x, w, b), torch.float64)), base)
    # forward saving pre, dx = dPre @ W, dW = dPre.T @ x, forward without grad
    fp32 = dtype == torch.float32
    assert [ws for ws, _ in seen] == [False, not fp32, not fp32, True]
    assert all(not (ws and flatten) for ws, flatten in seen)
    assert launches["matmul"] == 4
    monkeypatch.setattr(common, "WARP_SPECIALIZE", False)
    monkeypatch.setattr(kmatmul, "_CACHE", common.ConfigCache("matmul"))
    with fp32_mode(mode), torch.no_grad():
        out = linear(x, w, b, "gelu")
    assert_close("linear without ws", out, ref(*leaves((x, w, b), torch.float64)), base)
    assert [ws for ws, _ in seen[4:]] == [False]


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_non_contiguous_activations(dtype_mode, device, launches):
    # The ops read a contiguous (batch, sequence, features) activation in place as rows; one
    # with other strides (here the sequence-first layout's transpose) takes a (rows, features)
    # view or copy first, and its gradient comes back in its own shape.
    dtype, mode = dtype_mode
    x = randn(3, 2, 40, dtype=dtype, device=device).transpose(0, 1).requires_grad_()
    r = randn(3, 2, 24, dtype=dtype, device=device).transpose(0, 1).requires_grad_()
    w = randn(24, 40, dtype=dtype, device=device, scale=40 ** -0.5, requires_grad=True)
    w1 = randn(32, 40, dtype=dtype, device=device, scale=40 ** -0.5, requires_grad=True)
    w2 = randn(24, 32, dtype=dtype, device=device, scale=32 ** -0.5, requires_grad=True)
    b1, b2 = randn(32, dtype=dtype, device=device), randn(24, dtype=dtype, device=device)

    def ref_linear(x, w, r, compute_dtype=None):
        return reference.linear(x, w, None, "gelu", r, compute_dtype=compute_dtype)

    def ref_mlp(x, w1, w2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, "gelu", r, compute_dtype=compute_dtype)

    check("linear", lambda x, w, r: linear(x, w, None, "gelu", r), ref_linear, (x, w, r), dtype, device, mode)
    check("mlp", lambda x, w1, w2, r: mlp(x, w1, b1, w2, b2, "gelu", r), ref_mlp, (x, w1, w2, r), dtype, device,
          mode)
    assert launches["matmul"] == 3 + 6


def test_linear_one_dim_input_and_no_grad(device, launches):
    x = randn(40, dtype=torch.float16, device=device)
    w = randn(24, 40, dtype=torch.float16, device=device, scale=40 ** -0.5, requires_grad=True)
    with torch.no_grad():
        out = linear(x, w, None, "relu")
    assert out.shape == (24,) and out.grad_fn is None
    ref = reference.linear(x.double(), w.double(), None, "relu")
    assert_close("linear 1-D", out, ref, reference.linear(x, w, None, "relu", compute_dtype=torch.float16))
    assert launches["matmul"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["linear", "mlp"])
def test_dropout_of_a_non_finite_value_is_not_finite(op, dtype, device, launches):
    """torch's dropout multiplies by its mask: a dropped inf or NaN is NaN (inf * 0), forward and
    backward, so non-finite values stay non-finite whatever the mask. The epilogues selected 0
    for dropped elements. An infinite bias (column 2 of the product, of the hidden layer for
    mlp): that column non-finite on every row (mlp: every output, through the second GEMM);
    an infinite incoming gradient on column 2: dx non-finite on every row. Half the elements
    dropped: among 8 rows some are, whatever the draw. Small shapes: 8 x 16 -> 24 (-> 16)."""
    M, K, N = 8, 16, 24
    x = randn(M, K, dtype=dtype, device=device, requires_grad=True)
    w1 = randn(N, K, dtype=dtype, device=device, scale=K ** -0.5, requires_grad=True)
    b1 = randn(N, dtype=dtype, device=device)
    w2 = randn(K, N, dtype=dtype, device=device, scale=N ** -0.5)
    b1_inf = b1.clone()
    b1_inf[2] = float("inf")
    if op == "linear":
        out = linear(x, w1, b1_inf, "gelu", dropout_p=0.5)
        assert not torch.isfinite(out[:, 2]).any() and torch.isfinite(out[:, 3:]).all()
        out = linear(x, w1, b1, "gelu", dropout_p=0.5)
    else:
        out = mlp(x, w1, b1_inf, w2, None, activation="gelu", dropout_p=0.5)
        assert not torch.isfinite(out).any()
        out = mlp(x, w1, b1, w2, None, activation="gelu", output_dropout_p=0.5)
    g = torch.zeros_like(out)
    g[:, 2] = float("inf")
    dx, = torch.autograd.grad(out, x, g)
    assert not torch.isfinite(dx).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["linear", "mlp"])
def test_relu_blocks_a_non_finite_gradient_at_inactive_units(op, dtype, device, launches):
    """ReLU's backward is torch's threshold_backward, where(x <= 0, 0, grad): an infinite or NaN
    gradient reaching a unit whose pre-activation is negative gives 0 there, and the gradients
    behind it stay finite where they are in torch's composition. The kernels multiplied by the
    derivative 0 (inf * 0 = NaN). linear: the gradient of its output (the act_grad kernel); mlp:
    dO @ W2 (the GEMM's epilogue), whose row is infinite where dO's is. Column 2's bias of -100
    keeps that unit inactive on every row. Small shapes: 8 x 16 -> 24 (-> 16)."""
    M, K, N = 8, 16, 24
    x = randn(M, K, dtype=dtype, device=device, requires_grad=True)
    w1 = randn(N, K, dtype=dtype, device=device, scale=K ** -0.5, requires_grad=True)
    b1 = randn(N, dtype=dtype, device=device, requires_grad=True)
    w2 = randn(K, N, dtype=dtype, device=device, scale=N ** -0.5, requires_grad=True)
    b2 = randn(K, dtype=dtype, device=device, requires_grad=True)
    with torch.no_grad():
        b1[2] = -100.0
    params = (x, w1, b1) if op == "linear" else (x, w1, b1, w2, b2)
    if op == "linear":
        out = linear(x, w1, b1, "relu")
        want = F.relu(F.linear(x, w1, b1))
    else:
        out = mlp(x, w1, b1, w2, b2, activation="relu")
        want = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
    dout = randn(*out.shape, dtype=dtype, device=device)
    dout[1, 2] = float("inf")
    dout[3, 2] = float("nan")
    got = torch.autograd.grad(out, params, dout)
    wanted = torch.autograd.grad(want, params, dout)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
    for name, g, w in zip(("dx", "dw1", "db1", "dw2", "db2"), got, wanted):
        finite = torch.isfinite(w)
        assert torch.equal(torch.isfinite(g), finite), name
        torch.testing.assert_close(g[finite].float(), w[finite].float(), atol=tol, rtol=tol, msg=name)
    if op == "linear":
        assert torch.isfinite(got[0]).all()  # column 2 is the only one the non-finite values reach
    assert launches["matmul"] >= 1


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[2], DTYPE_MODES[3]])
@pytest.mark.parametrize("shape", [(4, 0, 8), (0, 5, 8), (3, 5, 0)], ids=["no_in_features", "no_rows", "no_out"])
def test_linear_zero_sizes(shape, dtype_mode, device):
    # Empty products: out = act(bias) + residual without features; empty results and
    # gradients of the right shapes (zeros where a sum has no terms) otherwise. The output and
    # every input's gradient against plain torch math on float64 copies (as
    # test_no_in_features_rank3), not fused_block.reference.
    dtype, mode = dtype_mode
    x, w, b, r = _linear_inputs(*shape, True, True, dtype, device)
    check("linear " + "x".join(map(str, shape)), lambda x, w, b, r: linear(x, w, b, "gelu", r),
          lambda x, w, b, r, compute_dtype=None: F.gelu(x @ w.T + b) + r, (x, w, b, r), dtype, device, mode)


# x of rank 3 with no input features (K = 0): the product over an empty K is 0, so the output is
# act(bias) (+ the LoRA term, + residual) in each of the 2 * 3 rows; dx and dW are empty, the
# biases' gradients the column sums of dY through act'(bias). The leading dims (2, 3) make the
# op read x as a contiguous rank-3 operand (its rows counted from its shape, not from
# numel() // K); N = 8, the hidden width F = 8, the output width 4 and the LoRA rank 4 keep one
# tile. The float64 math below is plain torch on float64 copies (not fused_block.reference).

def _k0_act(name, t):
    return {"gelu": F.gelu, "gelu_tanh": lambda u: F.gelu(u, approximate="tanh"), "relu": F.relu,
            "swiglu": F.silu, "geglu": lambda u: F.gelu(u, approximate="tanh")}[name](t)


def _k0_gated(x, wg, wu, bg, bu, act, u=None, lbg=None, lbu=None):
    gate, up = x @ wg.T + bg, x @ wu.T + bu
    if u is not None:
        gate, up = gate + u @ lbg.T, up + u @ lbu.T
    return _k0_act(act, gate) * up


def _k0_case(case, dtype, device):
    """(ours, float64 math, inputs) of one op on x (2, 3, 0)."""
    def t(*shape, scale=1.0):
        return randn(*shape, dtype=dtype, device=device, scale=scale, requires_grad=True)

    lead, N, F_, D2, R = (2, 3), 8, 8, 4, 4
    x = t(*lead, 0)
    if case == "linear_act_residual":
        inputs = (x, t(N, 0), t(N), t(*lead, N))
        return (lambda x, w, b, r: linear(x, w, b, "gelu", r),
                lambda x, w, b, r, compute_dtype=None: _k0_act("gelu", x @ w.T + b) + r, inputs)
    if case == "linear_lora":
        inputs = (x, t(N, 0), t(N), t(*lead, R), t(N, R, scale=R ** -0.5))
        return (lambda x, w, b, u, lb: linear(x, w, b, "gelu_tanh", lora=(u, lb)),
                lambda x, w, b, u, lb, compute_dtype=None: _k0_act("gelu_tanh", x @ w.T + u @ lb.T + b), inputs)
    if case in ("mlp_gelu", "mlp_swiglu"):
        act = case[4:]
        F1 = 2 * F_ if act == "swiglu" else F_
        inputs = (x, t(F1, 0), t(F1), t(D2, F_, scale=F_ ** -0.5), t(D2), t(*lead, D2))

        def math(x, w1, b1, w2, b2, r, compute_dtype=None):
            h = (_k0_gated(x, w1[:F_], w1[F_:], b1[:F_], b1[F_:], act) if act == "swiglu"
                 else _k0_act(act, x @ w1.T + b1))
            return h @ w2.T + b2 + r
        return lambda x, w1, b1, w2, b2, r: mlp(x, w1, b1, w2, b2, act, r), math, inputs
    if case in ("swiglu", "geglu"):
        op = getattr(fused_block, case)
        inputs = (x, t(F_, 0), t(F_, 0), t(D2, F_, scale=F_ ** -0.5), t(F_), t(F_), t(D2), t(*lead, D2))
        return (lambda x, wg, wu, wd, bg, bu, bd, r: op(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd),
                lambda x, wg, wu, wd, bg, bu, bd, r, compute_dtype=None:
                    _k0_gated(x, wg, wu, bg, bu, case) @ wd.T + bd + r, inputs)
    if case == "gated_linear_lora":
        from fused_block.linear import gated_linear
        inputs = (x, t(F_, 0), t(F_, 0), t(F_), t(F_), t(*lead, R), t(F_, R, scale=R ** -0.5),
                  t(F_, R, scale=R ** -0.5))
        return (lambda x, wg, wu, bg, bu, u, lbg, lbu: gated_linear(x, wg, wu, bg, bu, lora=(u, lbg, lbu)),
                lambda x, wg, wu, bg, bu, u, lbg, lbu, compute_dtype=None:
                    _k0_gated(x, wg, wu, bg, bu, "swiglu", u, lbg, lbu), inputs)
    raise AssertionError(case)


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[2], DTYPE_MODES[3]])
@pytest.mark.parametrize("case", ["linear_act_residual", "linear_lora", "mlp_gelu", "mlp_swiglu", "swiglu",
                                  "geglu", "gated_linear_lora"])
def test_no_in_features_rank3(case, dtype_mode, device, launches):
    # The output and every input's gradient against the float64 math. Before the row count of a
    # rank-3 operand with an empty last dim was its leading dims' product, the ops saw 0 rows:
    # linear's output was unwritten memory (NaN here), its bias gradient read partial sums of
    # the wrong size, and mlp/swiglu's backward read out of bounds (a segfault).
    dtype, mode = dtype_mode
    ours, math, inputs = _k0_case(case, dtype, device)
    check(case, ours, math, inputs, dtype, device, mode)
    # The Triton kernels ran: the forward GEMM (a launch with 6 rows: none with 0 rows) and the
    # backward's bias-gradient reduction.
    assert launches["matmul"] >= 1 and launches["bias_grad_reduce"] >= 1


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[2], DTYPE_MODES[3]])
def test_no_out_features_rank3(dtype_mode, device, launches):
    # x (2, 3, 5), weight (0, 5), a bias and no activation: an empty output, dx zeros (a product
    # over an empty N, the one GEMM that runs), an empty dW and dB. The empty product's bias
    # gradient is the sum of dY (2, 3, 0) viewed as rows: a (-1, 0) view of it is ambiguous, so
    # the backward raised before its rows were counted.
    dtype, mode = dtype_mode
    x, w, b, _ = _linear_inputs(3, 5, 0, True, False, dtype, device, lead=(2,))
    check("linear N=0", lambda x, w, b: linear(x, w, b), lambda x, w, b, compute_dtype=None: x @ w.T + b,
          (x, w, b), dtype, device, mode)
    assert launches["matmul"] >= 1  # dx's GEMM (zeros over an empty N) ran in Triton


def test_linear_saves_only_what_backward_needs(device):
    x, w, b, r = _linear_inputs(37, 24, 40, True, True, torch.float32, device)
    # Every gradient: x (dW), weight (dX) and the pre-activation (act').
    assert saved_numels(lambda: linear(x, w, b, "gelu", r)) == sorted([37 * 24, 40 * 24, 37 * 40])
    # Only the bias: the pre-activation alone; without an activation, nothing.
    x2, w2 = x.detach(), w.detach()
    assert saved_numels(lambda: linear(x2, w2, b, "gelu")) == [37 * 40]
    assert saved_numels(lambda: linear(x2, w2, b, None, r)) == []


# ---------------------------------------------------------------------------------------------
# both main-loop paths, forced
# ---------------------------------------------------------------------------------------------

# TMA-aligned (rows of 16-byte multiples for every operand and output) but not tile-aligned:
# the same call runs the descriptor path and the pointer path.
PATH_SHAPE = (37, 64, 48)


@pytest.mark.parametrize("path", ["tma", "pointer"])
@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_linear_paths(path, dtype_mode, device, launches, monkeypatch):
    monkeypatch.setattr(kmatmul, "FORCE_PATH", path)
    dtype, mode = dtype_mode
    x, w, b, r = _linear_inputs(*PATH_SHAPE, True, True, dtype, device)
    (mask,) = kernel_masks(5, device, (PATH_SHAPE[0], PATH_SHAPE[2], 0.2))

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, "gelu", r, 0.2, dropout_mask=mask, compute_dtype=compute_dtype)

    ours = seeded(lambda x, w, b, r: linear(x, w, b, "gelu", r, dropout_p=0.2), 5)
    check("linear path", ours, ref, (x, w, b, r), dtype, device, mode)
    assert launches["matmul"] == 3


@pytest.mark.parametrize("path", ["tma", "pointer"])
@pytest.mark.parametrize("activation", ["gelu", None])
def test_mlp_paths(path, activation, device, launches, monkeypatch):
    # None: the hidden activation is saved; gelu: the pre-activation, h recomputed in backward.
    monkeypatch.setattr(kmatmul, "FORCE_PATH", path)
    M, D, F_ = PATH_SHAPE
    inputs = _mlp_inputs(M, D, F_, True, True, torch.bfloat16, device)
    m1, m2 = kernel_masks(6, device, (M, F_, 0.3), (M, D, 0.1))

    def ref(x, w1, b1, w2, b2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, activation, r, 0.3, 0.1, dropout_mask=m1,
                             output_dropout_mask=m2, compute_dtype=compute_dtype)

    ours = seeded(lambda x, w1, b1, w2, b2, r: mlp(x, w1, b1, w2, b2, activation, r, 0.3, 0.1), 6)
    check("mlp path", ours, ref, inputs, torch.bfloat16, device)
    assert launches["matmul"] == 6


def test_forced_tma_path_rejects_unaligned_operands(device, monkeypatch):
    monkeypatch.setattr(kmatmul, "FORCE_PATH", "tma")
    x, w, _, _ = _linear_inputs(5, 100, 8, False, False, torch.bfloat16, device)
    with pytest.raises(ValueError, match="FORCE_PATH"):
        linear(x.detach(), w.detach())


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
MLP_LARGE = (512, 104, 768)


def _mlp_inputs(M, D, F_, has_bias, has_res, dtype, device):
    x = randn(M, D, dtype=dtype, device=device, requires_grad=True)
    w1 = randn(F_, D, dtype=dtype, device=device, scale=D ** -0.5, requires_grad=True)
    w2 = randn(D, F_, dtype=dtype, device=device, scale=F_ ** -0.5, requires_grad=True)
    b1 = randn(F_, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    b2 = randn(D, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    r = randn(M, D, dtype=dtype, device=device, requires_grad=True) if has_res else None
    return x, w1, b1, w2, b2, r


def _run_mlp(shape, activation, bias_res, dtype, device, mode="ieee"):
    inputs = _mlp_inputs(*shape, *bias_res, dtype, device)

    def ours(x, w1, b1, w2, b2, r):
        return mlp(x, w1, b1, w2, b2, activation, r)

    def ref(x, w1, b1, w2, b2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, activation, r, compute_dtype=compute_dtype)

    check("mlp", ours, ref, inputs, dtype, device, mode)


@pytest.mark.parametrize("bias_mode", BIAS_MODES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", MLP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.sweep
def test_mlp(shape, activation, bias_mode, device, launches):
    bias_res, (dtype, mode) = bias_mode
    _run_mlp(shape, activation, bias_res, dtype, device, mode)
    # forward 2; backward dH (act' and dB1's partials in its epilogue), dW2 (dB2's partials),
    # dW1, dX; one reduction for both biases; no elementwise pass.
    assert launches["matmul"] == 6
    assert launches["act_grad"] == 0
    assert launches["bias_grad_reduce"] == (1 if bias_res[0] else 0)


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_mlp_large(dtype_mode, device, launches):
    dtype, mode = dtype_mode
    _run_mlp(MLP_LARGE, "gelu", (True, True), dtype, device, mode)
    assert launches["matmul"] == 6


def test_mlp_saves_the_pre_activation_only(device):
    # Peak memory at or below eager's: the forward keeps x, the weights and pre (M x F); the
    # hidden activation is recomputed in backward. With only w2 trainable: h instead of pre,
    # and not w2 (read only for the hidden's gradient; torch's linear does not save it either).
    M, D, F_ = 37, 24, 40
    x, w1, b1, w2, b2, r = _mlp_inputs(M, D, F_, True, True, torch.float32, device)
    assert saved_numels(lambda: mlp(x, w1, b1, w2, b2, "gelu", r)) == sorted([M * D, F_ * D, D * F_, M * F_])
    x0, w10, b10 = x.detach(), w1.detach(), b1.detach()
    assert saved_numels(lambda: mlp(x0, w10, b10, w2, b2, "gelu")) == [M * F_]


# Interpreter tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, EPI_SPLIT) besides the default
# large one: many small tiles in both directions, partial groups and persistent programs
# walking several tiles (4 programs on the interpreter); the epilogue on two and on four
# column slices (the Hopper configs').
TILES = [(64, 64, 32, 4, 1, 1), (128, 128, 64, 4, 1, 2), (128, 256, 64, 8, 1, 4)]


@pytest.mark.parametrize("path", ["tma", "pointer"])
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
def test_mlp_other_tiles(tile, path, device, monkeypatch):
    monkeypatch.setattr(kmatmul, "INTERPRETER_CONFIG", tile)
    monkeypatch.setattr(kmatmul, "FORCE_PATH", path)
    # With 64x64 tiles: 4 row tiles (a partial GROUP_M group), 3 hidden column tiles, edges.
    _run_mlp((200, 48, 136), "gelu", (True, True), torch.bfloat16, device)


def test_mlp_bias_gradient_is_deterministic(device):
    x, w1, b1, w2, b2, _ = _mlp_inputs(200, 16, 64, True, False, torch.bfloat16, device)
    g = randn(200, 16, dtype=torch.bfloat16, device=device)
    first = torch.autograd.grad(mlp(x, w1, b1, w2, b2), (b1, b2), g)
    second = torch.autograd.grad(mlp(x, w1, b1, w2, b2), (b1, b2), g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------------
# dropout fused into the epilogues
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_fraction_and_scaling(p, device, launches):
    # 128 x 192 outputs (a few tiles' worth, K tiny so the GEMM is cheap): the kept fraction
    # is within 6 standard deviations of 1 - p, rows and columns are not correlated (each
    # row's and column's fraction is sane), and kept values are exactly scaled by 1 / (1 - p).
    M, K, N = 128, 8, 192
    x = randn(M, K, dtype=torch.float32, device=device)
    w = randn(N, K, dtype=torch.float32, device=device)
    b = randn(N, dtype=torch.float32, device=device)
    full = linear(x, w, b, "gelu")
    torch.manual_seed(0)
    out = linear(x, w, b, "gelu", dropout_p=p)
    (mask,) = kernel_masks(0, device, (M, N, p))
    n = M * N
    kept = mask.float().mean().item()
    assert abs(kept - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5, kept
    for frac in (mask.float().mean(0), mask.float().mean(1)):  # no all-kept / all-dropped lines
        assert frac.min() > 0 and frac.max() < 1
    assert torch.equal(out == 0, ~mask | (full == 0))
    torch.testing.assert_close(out[mask], full[mask] / (1 - p), rtol=1e-6, atol=0)
    # The four Philox words of one call serve different 16-column groups: no repeats.
    for q in range(1, 4):
        assert not torch.equal(mask[:, :16], mask[:, 16 * q:16 * q + 16])
    assert not torch.equal(mask[:, :64], mask[:, 64:128])
    assert launches["dropout_mask"] == 1


def test_dropout_same_seed_same_result(device):
    x, w1, b1, w2, b2, r = _mlp_inputs(37, 8, 100, True, True, torch.float16, device)
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        out = mlp(x, w1, b1, w2, b2, "gelu", r, dropout_p=0.3, output_dropout_p=0.3)
        outs.append((out, torch.autograd.grad(out.sum(), (x, w1))))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    assert not torch.equal(outs[0][0], outs[2][0])


# (M, D, F) with every gradient, each dtype: odd M, tiny d_model, hidden not a tile multiple.
DROPOUT_SHAPE = (37, 8, 100)


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("dropouts", [(0.3, 0.2), (0.25, 0.0), (0.0, 0.4)], ids=["both", "hidden", "output"])
def test_mlp_dropout_matches_reference_with_kernel_masks(dropouts, dtype_mode, device, launches):
    dtype, mode = dtype_mode
    M, D, F_ = DROPOUT_SHAPE
    p1, p2 = dropouts
    inputs = _mlp_inputs(M, D, F_, True, True, dtype, device)
    m1, m2 = kernel_masks(7, device, (M, F_, p1), (M, D, p2))

    def ours(x, w1, b1, w2, b2, r):
        return mlp(x, w1, b1, w2, b2, "gelu", r, p1, p2)

    def ref(x, w1, b1, w2, b2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, "gelu", r, p1, p2, dropout_mask=m1 if p1 else None,
                             output_dropout_mask=m2 if p2 else None, compute_dtype=compute_dtype)

    check("mlp dropout", seeded(ours, 7), ref, inputs, dtype, device, mode)
    assert launches["matmul"] == 6
    # dY * keep2 / (1 - p2) and dB2's sums in one pass when there is an output dropout.
    assert launches["act_grad"] == (1 if p2 else 0)


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("activation", [None, "relu"])
def test_linear_dropout_matches_reference_with_kernel_masks(activation, dtype_mode, device, launches):
    dtype, mode = dtype_mode
    M, K, N = 37, 100, 8  # odd M, masked K loop, N below a tile
    inputs = _linear_inputs(M, K, N, True, True, dtype, device)
    (mask,) = kernel_masks(11, device, (M, N, 0.3))

    def ours(x, w, b, r):
        return linear(x, w, b, activation, r, dropout_p=0.3)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, activation, r, 0.3, dropout_mask=mask, compute_dtype=compute_dtype)

    check("linear dropout", seeded(ours, 11), ref, inputs, dtype, device, mode)
    assert launches["act_grad"] == 1  # keep / (1 - p), act' and dB in one elementwise pass


@pytest.mark.parametrize("tile", [TILES[0], TILES[2]], ids=lambda t: "x".join(map(str, t)))
def test_mlp_dropout_other_tiles(tile, device, monkeypatch):
    # Masks depend on absolute rows and columns only: several tiles (64x64: 3 row tiles, 2
    # hidden column tiles; 128x256: 2 row tiles) give the same masks as the mask kernel.
    monkeypatch.setattr(kmatmul, "INTERPRETER_CONFIG", tile)
    M, D, F_ = 136, 40, 72
    inputs = _mlp_inputs(M, D, F_, True, True, torch.bfloat16, device)
    m1, m2 = kernel_masks(5, device, (M, F_, 0.3), (M, D, 0.2))

    def ref(x, w1, b1, w2, b2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, "gelu_tanh", r, 0.3, 0.2, dropout_mask=m1,
                             output_dropout_mask=m2, compute_dtype=compute_dtype)

    ours = seeded(lambda x, w1, b1, w2, b2, r: mlp(x, w1, b1, w2, b2, "gelu_tanh", r, 0.3, 0.2), 5)
    check("mlp dropout tiles", ours, ref, inputs, torch.bfloat16, device)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_ln", "post_ln"])
def test_transformer_layer_ffn_dropouts_are_fused(norm_first, device, monkeypatch):
    # The layers' FFN: Pre-LN is one mlp with both dropouts and the residual; Post-LN's mlp
    # has the inner dropout only, dropout2 being the next norm's (applied once, not twice).
    # F.dropout must not run at all. Tiny dims: only the call pattern matters here.
    blocks = fused_block.blocks
    calls = []

    def record(name, fn):
        def wrapped(*args):
            calls.append((name, args))
            return fn(*args)
        return wrapped

    monkeypatch.setattr(blocks._FUSED, "mlp", record("mlp", blocks._FUSED.mlp))
    monkeypatch.setattr(blocks._FUSED, "add_layer_norm", record("norm", blocks._FUSED.add_layer_norm))
    monkeypatch.setattr(F, "dropout", lambda *a, **k: pytest.fail("unfused F.dropout"))
    layer = fused_block.TransformerEncoderLayer(16, 2, 32, dropout=0.3, activation="gelu", batch_first=True,
                                                norm_first=norm_first).to(device)
    with torch.no_grad():
        layer(randn(2, 5, 16, dtype=torch.float32, device=device))
    (mlp_args,) = [a for n, a in calls if n == "mlp"]
    assert mlp_args[7:] == ((0.3, 0.3) if norm_first else (0.3, 0.0))
    assert (mlp_args[6] is not None) == norm_first  # Pre-LN: the residual add in the epilogue
    if not norm_first:
        assert calls[-1][0] == "norm" and calls[-1][1][5] == 0.3  # dropout2 in the norm kernel


def test_mlp_module_dropout_train_and_eval(device, launches, monkeypatch):
    torch.manual_seed(0)
    ours = MLP(16, 48, dropout=0.25, device=device)
    assert "dropout=0.25" in repr(ours)
    x = randn(9, 16, dtype=torch.float32, device=device)
    args = (x, ours.linear1.weight, ours.linear1.bias, ours.linear2.weight, ours.linear2.bias, "gelu", x)
    with torch.no_grad():
        torch.manual_seed(4)
        train = ours(x, residual=x)
        torch.manual_seed(4)
        torch.testing.assert_close(train, mlp(*args, dropout_p=0.25, output_dropout_p=0.25), atol=0, rtol=0)
        ours.eval()
        evaluated = ours(x, residual=x)
        torch.testing.assert_close(evaluated, mlp(*args), atol=0, rtol=0)
        assert not torch.allclose(train, evaluated)
        # Without the Triton path (CPU without the interpreter) the reference runs F.dropout.
        monkeypatch.setattr(fused_block._backend, "use_triton", lambda t: False)
        ours.train()
        before = launches["matmul"]
        ref = ours(x)
        assert launches["matmul"] == before
        h = F.gelu(ours.linear1(x))
        assert ref.shape == (9, 16) and not torch.allclose(ref, ours.linear2(h))


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
    with pytest.raises(ValueError, match="activation"):
        Linear(4, 4, activation="swiglu")  # a gated FFN, not an elementwise activation


def test_modules_run_float64_as_torch_does(device, launches):
    """float64 (which the kernels do not take) runs the plain PyTorch computation, gradients
    included, without a launch; torch's Linear accepts it, so ours does too."""
    theirs = torch.nn.Linear(40, 24, device=device, dtype=torch.float64)
    ours = Linear(40, 24, device=device, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 40, dtype=torch.float64, device=device, requires_grad=True)
    got, want = ours(x), theirs(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    block = MLP(40, 24, activation="gelu", device=device, dtype=torch.float64)
    want = block.linear2(F.gelu(block.linear1(x)))
    torch.testing.assert_close(block(x), want)
    assert launches["matmul"] == 0


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
        (dict(x=x, weight=w, activation="swiglu"), ValueError, "activation"),
    ]


@pytest.mark.parametrize("case", range(12))
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


# Each case: the op at dropout probability p on the inputs t (by name), written once for ours
# (``_Fused``) and the reference (same names); the inputs it takes; those whose gradients the
# dropout zeroes. Hidden width 24.
_P1_CASES = {
    "linear": (lambda ops, t, p: ops.linear(t["x"], t["w1"], t["b1"], "gelu", t["r24"], p),
               "x w1 b1 r24", "x w1 b1"),
    "linear_lora": (lambda ops, t, p: ops.linear(t["x"], t["w1"], t["b1"], None, None, p, lora=(t["u"], t["lb"])),
                    "x w1 b1 u lb", "x w1 b1 u lb"),
    "gated_linear": (lambda ops, t, p: ops.gated(t["x"], t["wg"], t["wu"], t["bg"], t["bu"], dropout_p=p),
                     "x wg wu bg bu", "x wg wu bg bu"),
    "mlp_hidden": (lambda ops, t, p: ops.mlp(t["x"], t["w1"], t["b1"], t["w2"], t["b2"], "gelu", t["r"], p),
                   "x w1 b1 w2 b2 r", "x w1 b1 w2"),
    "mlp_output": (lambda ops, t, p: ops.mlp(t["x"], t["w1"], t["b1"], t["w2"], t["b2"], "relu", t["r"], 0.0, p),
                   "x w1 b1 w2 b2 r", "x w1 b1 w2 b2"),
    "mlp_swiglu_hidden": (lambda ops, t, p: ops.mlp(t["x"], t["w12"], t["b12"], t["w2"], t["b2"], "swiglu", t["r"], p),
                          "x w12 b12 w2 b2 r", "x w12 b12 w2"),
    "swiglu_hidden": (lambda ops, t, p: ops.gated_ffn(t["x"], t["wg"], t["wu"], t["w2"], t["r"], b_gate=t["bg"],
                                                      b_down=t["b2"], activation="swiglu", dropout_p=p),
                      "x wg wu bg w2 b2 r", "x wg wu bg w2"),
    "geglu_output": (lambda ops, t, p: ops.gated_ffn(t["x"], t["wg"], t["wu"], t["w2"], t["r"], b_up=t["bu"],
                                                     activation="geglu", output_dropout_p=p),
                     "x wg wu bu w2 r", "x wg wu bu w2"),
}
_P1_SIZES = dict(x=(2, 5, 16), w1=(24, 16), b1=(24,), w12=(48, 16), b12=(48,), wg=(24, 16), wu=(24, 16), bg=(24,),
                 bu=(24,), w2=(16, 24), b2=(16,), r=(2, 5, 16), r24=(2, 5, 24), u=(2, 5, 4), lb=(24, 4))


class _Fused:
    """The public ops under the reference's names."""
    linear, mlp = staticmethod(linear), staticmethod(mlp)
    gated = staticmethod(gated_linear)

    @staticmethod
    def gated_ffn(x, wg, wu, wd, residual, *, activation, **kw):
        return {"swiglu": swiglu, "geglu": geglu}[activation](x, wg, wu, wd, residual, **kw)


@pytest.mark.parametrize("case", sorted(_P1_CASES))
def test_dropout_one_is_torchs_dropout(case, device, launches):
    """Every GEMM op takes a dropout probability of 1, as torch's dropout: what it drops is
    ``F.dropout(t, 1.0)`` (zeros; zero gradients for what made t), the rest as at p = 0, on our
    kernels; against the float64 reference (whose dropout is torch's) under the error rule. At
    the hidden activation the GEMMs run apart: the second sees zeros (out = b2 + residual)."""
    fn, names, dropped = _P1_CASES[case]
    names, dropped = names.split(), dropped.split()
    t = {k: randn(*_P1_SIZES[k], dtype=torch.float32, device=device, scale=0.5, requires_grad=True) for k in names}
    before = launches["matmul"]
    out = fn(_Fused, t, 1.0)
    assert launches["matmul"] > before
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, [t[k] for k in names], dy)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        tt = {k: v.detach().to(dtype).requires_grad_() for k, v in t.items()}
        ref = fn(reference, tt, 1.0)
        refs[dtype] = (ref, torch.autograd.grad(ref, [tt[k] for k in names], dy.to(dtype)))
    (ref64, g64), (ref32, g32) = refs[torch.float64], refs[torch.float32]
    assert_close(f"{case} out", out, ref64, ref32)
    for k, g, r64, r32 in zip(names, grads, g64, g32):
        assert_close(f"{case} d{k}", g, r64, r32)
        assert (g == 0).all() if k in dropped else g.abs().sum() > 0, f"{case}: d{k}"


def test_dropout_bad_input(device, launches):
    x = torch.randn(4, 8, device=device)
    w1, b1 = torch.randn(16, 8, device=device), torch.randn(16, device=device)
    w2, b2 = torch.randn(8, 16, device=device), torch.randn(8, device=device)
    cases = [
        (lambda: linear(x, w1, dropout_p=1.01), ValueError, r"^dropout_p must be in \[0, 1\]"),
        (lambda: linear(x, w1, dropout_p=-0.1), ValueError, "^dropout_p"),
        (lambda: linear(x, w1, dropout_p="0.1"), TypeError, "^dropout_p"),
        (lambda: mlp(x, w1, b1, w2, b2, dropout_p=1.5), ValueError, "^dropout_p"),
        (lambda: mlp(x, w1, b1, w2, b2, output_dropout_p=1.5), ValueError, "output_dropout_p"),
        (lambda: mlp(x, w1, b1, w2, b2, output_dropout_p=True), TypeError, "output_dropout_p"),
        (lambda: MLP(8, 16, dropout=2.0), ValueError, "^dropout"),
        (lambda: MLP(8, 16, dropout=None), TypeError, "^dropout"),
    ]
    for fn, error, name in cases:
        with pytest.raises(error, match=name):
            fn()
    assert launches["matmul"] == 0


# ---------------------------------------------------------------------------------------------
# torch.library, torch.compile, autocast
# ---------------------------------------------------------------------------------------------

def test_opcheck(device):
    dt = torch.float16
    ops = torch.ops.fused_block
    seed = torch.tensor([12345], dtype=torch.int64, device=device)
    x, w, b, r = (t.detach() for t in _linear_inputs(37, 24, 40, True, True, dt, device))
    torch.library.opcheck(ops.linear_fwd.default, (x, w, b, r, "gelu", True, seed, 0.25))
    torch.library.opcheck(ops.linear_fwd.default, (x, w, None, None, "none", False, None, 0.0))
    g = randn(37, 40, dtype=dt, device=device)
    pre = randn(37, 40, dtype=dt, device=device)
    torch.library.opcheck(ops.linear_bwd.default, (g, x, w, pre, seed, "gelu", 0.3, True, True, True))
    torch.library.opcheck(ops.linear_bwd.default, (g, x, None, None, None, "none", 0.0, False, True, True))
    torch.library.opcheck(ops.linear_bwd.default, (g, None, None, None, None, "none", 0.0, False, False, True))
    x, w1, b1, w2, b2, r = (t.detach() for t in _mlp_inputs(37, 24, 40, True, True, dt, device))
    for save in (0, 1, 2):
        torch.library.opcheck(ops.ffn_fwd.default, (x, w1, None, b1, None, w2, b2, r, "gelu", save, seed, 0.3,
                                                    seed + 1, 0.2))
    torch.library.opcheck(ops.ffn_fwd.default, (x, w1, None, None, None, w2, None, None, "relu", 0, None, 0.0,
                                                None, 0.0))
    gy = randn(37, 24, dtype=dt, device=device)
    h = randn(37, 40, dtype=dt, device=device)
    torch.library.opcheck(ops.ffn_bwd.default, (gy, x, w1, None, w2, pre, seed, seed + 1, "gelu", 0.3, 0.2, 1,
                                                24, True, True, True, True, True))
    torch.library.opcheck(ops.ffn_bwd.default, (gy, None, None, None, w2, h, None, None, "none", 0.0, 0.0, 2,
                                                24, False, False, False, True, True))
    # Activations of another rank, contiguous: read in place as rows, outputs in their leading dims.
    x3, r3, g3 = x[None], r[None], randn(1, 37, 40, dtype=dt, device=device)
    torch.library.opcheck(ops.linear_fwd.default, (x3, w1, b1, g3.detach(), "gelu", True, seed, 0.25))
    torch.library.opcheck(ops.linear_bwd.default, (g3, x3, w1, g3, seed, "gelu", 0.3, True, True, True))
    torch.library.opcheck(ops.ffn_fwd.default, (x3, w1, None, b1, None, w2, b2, r3, "gelu", 1, seed, 0.3,
                                                seed + 1, 0.2))
    torch.library.opcheck(ops.ffn_bwd.default, (gy[None], x3, w1, None, w2, pre, seed, seed + 1, "gelu", 0.3, 0.2,
                                                1, 24, True, True, True, True, True))
    # A non-contiguous one is refused, not read as if contiguous.
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.linear_fwd(torch.cat([x3, x3]).transpose(0, 1), w1, b1, None, "gelu", False, None, 0.0)


def test_torch_compile_fullgraph(device, launches):
    # With dropout: the seeds are drawn with torch.randint inside the graph; fallback_random
    # makes the compiled graph draw them as eager does, so both see the same masks. (Patched
    # with the config's own context manager: monkeypatch's undo left the option deleted.)
    with torch._inductor.config.patch(fallback_random=True):
        _compile_matches_eager(device, launches)


def _compile_matches_eager(device, launches):
    x, w1, b1, w2, b2, r = _mlp_inputs(37, 24, 40, True, True, torch.float32, device)

    def block(x, w1, b1, w2, b2, r):
        h = mlp(x, w1, b1, w2, b2, "gelu", r, dropout_p=0.25, output_dropout_p=0.1)
        return linear(h, w2.t(), b1, "relu", dropout_p=0.2)

    compiled = torch.compile(block, fullgraph=True)
    torch.manual_seed(3)
    out = compiled(x, w1, b1, w2, b2, r)
    grads = torch.autograd.grad(out.sum(), (x, w1, b1, w2, b2, r))
    torch.manual_seed(3)
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
    ref = reference.linear(*leaves((x, w, b), torch.float64), "gelu")
    x64, w64, b64, r64 = leaves((x, w, b, r), torch.float64)
    ref_res = reference.linear(x64, w64, b64, "gelu", r64)
    base = reference.linear(*leaves((x, w, b), lowp), "gelu", compute_dtype=lowp)
    assert_close("autocast out", out, ref, base)
    assert_close("autocast out + fp32 residual", out_res, ref_res, base.float() + r.detach(),
                 atol=ATOL[lowp])
    grads = torch.autograd.grad(out_res.sum(), (x, w, b, r))
    assert [t.dtype for t in grads] == [torch.float32] * 4
    assert launches["matmul"] == 4  # two forwards, dX and dW
    # float64 is left as it is, as autocast leaves it for F.linear (which then computes in
    # float64): the same TypeError as outside autocast (the op takes no float64), not a bf16
    # product; a float64 weight beside cast x, the weight's dtype error.
    x64, w64, b64 = (t.detach().double() for t in (x, w, b))
    with torch.autocast(device.type, dtype=lowp):
        assert F.linear(x64, w64, b64).dtype == torch.float64
        with pytest.raises(TypeError, match="x must have dtype"):
            linear(x64, w64, b64, "gelu")
        with pytest.raises(TypeError, match="weight"):
            linear(x.detach(), w64, b64)
    assert launches["matmul"] == 4


def test_public_names():
    for name in ("linear", "mlp", "swiglu", "Linear", "MLP"):
        assert hasattr(fused_block, name)


def test_bias_gradient_of_empty_products(device, launches):
    """A product with nothing to multiply (in_features 0, or an MLP's hidden width 0) still has
    its bias gradient, the column sums of dY (it came from the weight-gradient product, which an
    empty product skipped: unwritten memory)."""
    x = torch.randn(3, 0, device=device, requires_grad=True)
    w = torch.randn(5, 0, device=device, requires_grad=True)
    b = torch.randn(5, device=device, requires_grad=True)
    g = torch.randn(3, 5, device=device)
    linear(x, w, b).backward(g)
    torch.testing.assert_close(b.grad, g.sum(0), atol=1e-6, rtol=0)
    x = torch.randn(3, 4, device=device, requires_grad=True)
    w1, b1 = torch.randn(0, 4, device=device, requires_grad=True), torch.randn(0, device=device, requires_grad=True)
    w2, b2 = torch.randn(5, 0, device=device, requires_grad=True), torch.randn(5, device=device, requires_grad=True)
    mlp(x, w1, b1, w2, b2, "gelu").backward(g)
    torch.testing.assert_close(b2.grad, g.sum(0), atol=1e-6, rtol=0)
    assert x.grad.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bias_gradient_is_rounded_to_nearest(dtype, device, launches):
    """The bias gradient (fp32 column sums of dY from per-64-row partials, reduced by
    ``bias_grad_reduce``) is rounded to nearest in the bias's dtype, as torch's is: no farther
    from the exact sum than its correctly rounded value (but the fp32 sums' own error), also in
    the interpreter, whose bf16 conversion truncates (up to a whole ulp). 200 rows: several
    partials; 96 columns."""
    x = randn(200, 16, dtype=dtype, device=device, requires_grad=True)
    w = randn(96, 16, dtype=dtype, device=device, requires_grad=True)
    b = randn(96, dtype=dtype, device=device, requires_grad=True)
    g = randn(200, 96, dtype=dtype, device=device) * 4
    linear(x, w, b).backward(g)
    assert launches["bias_grad_reduce"] == 1
    exact = g.double().sum(0)
    nearest = (exact.to(dtype).double() - exact).abs()
    assert b.grad.dtype == dtype
    fp32_sums = 200 * 2.0**-24 * g.double().abs().sum(0)  # the fp32 accumulation's bound
    assert ((b.grad.double() - exact).abs() <= nearest + fp32_sums).all()


def test_output_dropout_with_only_the_second_bias_training(device, launches):
    """mlp with output dropout where only b2 takes a gradient (everything else frozen): dB2 is the
    kept gradient's column sums (the backward used the dropout pass's dY, which it did not store)."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, device=device)
    w1, b1, w2 = torch.randn(12, 8, device=device), torch.randn(12, device=device), torch.randn(4, 12, device=device)
    b2 = torch.randn(4, device=device, requires_grad=True)
    g = torch.randn(6, 4, device=device)
    torch.manual_seed(1)
    out = mlp(x, w1, b1, w2, b2, "gelu", output_dropout_p=0.5)
    (db2,) = torch.autograd.grad(out, b2, g)
    keep = out != 0  # dropout2 acts on linear2's output, its bias included: a dropped element is 0
    torch.testing.assert_close(db2, (g * keep / 0.5).sum(0), atol=1e-5, rtol=1e-5)

