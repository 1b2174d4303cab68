"""Fused residual add + dropout + LayerNorm/RMSNorm against the float64 reference.

Every kernel path runs through the interpreter on small shapes: the register path (several
rows per program for small hiddens, one row for wide ones), the chunked forward and backward
(at their real widths once, and with the thresholds lowered so that small shapes take them),
the backward's multi-row programs and the dweight/dbias reduction kernel.
"""
import collections

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

import fused_block
from fused_block import _backend, reference
from fused_block.kernels import common
from fused_block.kernels import norm as knorm
from numerics import DTYPES, assert_close, assert_compiled_matches_eager, randn

NORMS = ("layer", "rms")


def _ref(norm):
    return reference.add_layer_norm if norm == "layer" else reference.add_rms_norm


def _op(norm):
    return fused_block.add_layer_norm if norm == "layer" else fused_block.add_rms_norm


def _call(fn, norm, x, residual, weight, bias, **kw):
    if norm == "layer":
        return fn(x, residual, weight, bias, **kw)
    return fn(x, residual, weight, **kw)


def _inputs(shape, dtype, device, has_res=True, has_w=True, has_b=True, param_dtype=None):
    n = shape[-1]
    pdtype = param_dtype or dtype
    x = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    residual = randn(*shape, dtype=dtype, device=device, requires_grad=True) if has_res else None
    weight = (1 + 0.1 * randn(n, dtype=pdtype, device=device)).requires_grad_() if has_w else None
    bias = randn(n, dtype=pdtype, device=device, scale=0.1, requires_grad=True) if has_b else None
    return [x, residual, weight, bias]


def _grads(outs, inputs, gouts):
    loss = sum((o.double() * g).sum() for o, g in zip(outs, gouts))
    return torch.autograd.grad(loss, [t for t in inputs if t is not None])


def _check_fwd_bwd(norm, inputs, dtype, device, **kw):
    """Forward and the gradient of every present input against the float64 reference, with
    gradients arriving on both outputs (the Pre-LN residual stream is used downstream)."""
    out, rout = _call(_op(norm), norm, *inputs, **kw)
    as64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_rout = _call(_ref(norm), norm, *as64, **kw)
    base_out, base_rout = _call(_ref(norm), norm, *inputs, compute_dtype=dtype, **kw)
    assert_close("out", out, ref_out, base_out)
    assert_close("residual_out", rout, ref_rout, base_rout)
    gouts = [torch.randn(out.shape, dtype=torch.float64, device=device) for _ in range(2)]
    got = _grads((out, rout), inputs, gouts)
    want = _grads((ref_out, ref_rout), as64, gouts)
    base = _grads((base_out, base_rout), inputs, gouts)
    names = [nm for nm, t in zip(("dx", "dresidual", "dweight", "dbias"), inputs) if t is not None]
    for name, g, w, b, t in zip(names, got, want, base, [t for t in inputs if t is not None]):
        assert g.dtype == t.dtype, name
        assert_close(name, g, w, b, dtype=dtype)
    return out, rout


# (leading shape, hidden, has_residual, has_weight, has_bias, why)
CASES = [
    ((37,), 768, True, True, True, "GPT-2 hidden, odd row count: two rows per forward program (the last "
                                   "masked), several rows per backward program"),
    ((1,), 1, True, True, True, "hidden of one: zero variance"),
    ((37,), 7, False, True, False, "tiny hidden, no residual: 64 rows per forward program and groups of "
                                   "16 rows in backward, mostly masked"),
    ((0,), 768, True, True, True, "no rows: dweight/dbias are zeros written by the reduction kernel"),
    ((5,), 1000, True, False, False, "non-power-of-two hidden without affine parameters: no reduction"),
    ((2, 5), 300, True, True, True, "3-D input; 4 rows per forward program, 2 per backward group"),
    ((3,), 4099, True, True, True, "just above a power of two: masked tail of an 8192-wide register row"),
    ((2,), 9000, True, True, True, "chunked backward (wider than BWD_REG_MAX); register forward in 16-bit, "
                                   "chunked in fp32 (wider than FWD_REG_MAX_HEAVY)"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("lead,n,has_res,has_w,has_b,why", CASES, ids=[c[-1].split(":")[0] for c in CASES])
@pytest.mark.sweep
def test_matches_reference(device, launches, dtype, norm, lead, n, has_res, has_w, has_b, why):
    inputs = _inputs((*lead, n), dtype, device, has_res, has_w, has_b and norm == "layer")
    out, rout = _check_fwd_bwd(norm, inputs, dtype, device)
    assert out.dtype == dtype and rout.dtype == dtype and out.shape == (*lead, n)
    rows = out.numel() // n
    assert launches["add_norm_fwd"] == (1 if rows else 0)
    assert launches["add_norm_bwd"] == (1 if rows else 0)
    assert launches["add_norm_bwd_reduce"] == (1 if has_w or (has_b and norm == "layer") else 0)


@pytest.mark.parametrize("norm,dtype", [("layer", torch.bfloat16), ("rms", torch.float32)], ids=str)
def test_wide_hidden(device, launches, norm, dtype):
    """70001 (past 65536, prime, so every chunk loop ends ragged): the chunked forward and
    backward at their shipped widths (one row: the interpreter is slow)."""
    _check_fwd_bwd(norm, _inputs((1, 70001), dtype, device, has_b=norm == "layer"), dtype, device)
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunked paths on small rows: 64-wide register limit, 32-wide chunks, three backward
    programs (so each walks several groups of rows and accumulates its partial row)."""
    monkeypatch.setattr(knorm, "FWD_REG_MAX", 64)
    monkeypatch.setattr(knorm, "BWD_REG_MAX", 64)
    monkeypatch.setattr(knorm, "FWD_CHUNK", 32)
    monkeypatch.setattr(knorm, "BWD_CHUNK", 32)
    monkeypatch.setattr(knorm, "bwd_programs", lambda n, sms: 3)


@pytest.mark.parametrize("out_is_residual", [False, True], ids=["residual_out", "out_twice"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_chunked_paths(device, launches, small_chunks, norm, dtype, out_is_residual):
    # 13 rows: 4 groups of 4 (the last masked) over 3 programs of 2, 2 and 1 groups; 100 = 3 full
    # chunks of 32 and a masked one. out_twice: out's second gradient read in both passes.
    inputs = _inputs((13, 100), dtype, device, has_b=norm == "layer", param_dtype=torch.float32)
    _check_fwd_bwd(norm, inputs, dtype, device, out_is_residual=out_is_residual)
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1
    assert launches["add_norm_bwd_reduce"] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_of_a_value_near_the_dtype_max(device, launches, dtype):
    """A row holding one element near the dtype's max (0.9 finfo.max: its square overflows fp32
    for fp32 and bf16) has an infinite fp32 variance: torch's layer_norm gives that row rstd = 0,
    so out = bias there, and finite dweight/dbias. The kernels subtracted the mean's correction
    squared, itself overflowing there (|dm| ~ ulp(3e38) = 2e31), from the infinite E[d^2]: inf -
    inf = NaN rstd, a NaN row and NaN dweight/dbias over the whole batch. 4 rows of 40: the
    register path, several rows per program. (The chunked path, rows wider than 8192 in fp32,
    still gives NaN there: its sum of the rows' shifted values overflows too.)"""
    n = 40
    x, residual, weight, bias = _inputs((4, n), dtype, device)
    with torch.no_grad():
        x[1, 7] = 0.9 * torch.finfo(dtype).max
        residual[1, 7] = 0.0
    out, rout = fused_block.add_layer_norm(x, residual, weight, bias)
    g = randn(4, n, dtype=dtype, device=device)
    dx, dw, db = torch.autograd.grad((out * g).sum(), (x, weight, bias))
    tx, tw, tb = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    t_out = torch.nn.functional.layer_norm(tx + residual.detach(), (n,), tw, tb, 1e-5)
    t_dx, t_dw, t_db = torch.autograd.grad((t_out * g).sum(), (tx, tw, tb))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, ours, theirs in (("out", out, t_out), ("dweight", dw, t_dw), ("dbias", db, t_db)):
        assert torch.isfinite(theirs).all(), name  # torch's answer is finite here ...
        torch.testing.assert_close(ours, theirs, **tol, msg=name)  # ... and so is ours
    # dx of the other rows; the huge row's is NaN in torch's backward (rstd 0 times an
    # infinite term) where the float64 answer is ~1e-38: ours is 0 there.
    rows = [0, 2, 3]
    torch.testing.assert_close(dx[rows], t_dx[rows], **tol)
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_fp32_weight_and_residual_stream(device, launches, dtype, norm):
    """Autocast layout: low-precision activations, fp32 parameters, fp32 residual stream."""
    x, _, weight, bias = _inputs((37, 1000), dtype, device, has_b=norm == "layer", param_dtype=torch.float32)
    out, rout = _call(_op(norm), norm, x, None, weight, bias, residual_in_fp32=True)
    assert out.dtype == dtype and rout.dtype == torch.float32
    residual = randn(37, 1000, dtype=torch.float32, device=device, requires_grad=True)
    inputs = [x, residual, weight, bias]
    out2, rout2 = _call(_op(norm), norm, *inputs)
    assert rout2.dtype == torch.float32
    as64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_rout = _call(_ref(norm), norm, *as64)
    base_out = _call(_ref(norm), norm, *inputs, compute_dtype=dtype)[0]
    assert_close("out", out2, ref_out, base_out)
    assert_close("residual_out", rout2, ref_rout, ref_rout.float())
    g = torch.randn(37, 1000, dtype=torch.float64, device=device)
    got = _grads((out2,), inputs, (g,))
    want = _grads((ref_out,), as64, (g,))
    base = _grads((base_out,), inputs, (g,))
    for name, a, w, b in zip(("dx", "dresidual", "dweight", "dbias"), got, want, base):
        assert a.dtype == (dtype if name == "dx" else torch.float32)
        assert_close(name, a, w, b, dtype=dtype)
    assert launches["add_norm_fwd"] == 2 and launches["add_norm_bwd"] == 1
    assert launches["add_norm_bwd_reduce"] == 1


@pytest.mark.parametrize("norm", NORMS)
def test_non_contiguous_inputs(device, launches, norm):
    base = randn(12, 2 * 768, dtype=torch.float32, device=device)
    x = base[:, ::2].detach().requires_grad_()  # last-dim stride 2: copied
    residual = randn(768, 12, dtype=torch.float32, device=device).t().detach().requires_grad_()  # transposed
    weight = randn(2 * 768, dtype=torch.float32, device=device)[::2].detach().requires_grad_()  # strided
    out, rout = _call(_op(norm), norm, x, residual, weight, None)
    ref_out, ref_rout = _call(_ref(norm), norm, x.double(), residual.double(), weight.double(), None)
    assert_close("out", out, ref_out, _call(_ref(norm), norm, x, residual, weight, None, compute_dtype=torch.float32)[0])
    (out.sum() + rout.sum()).backward()
    assert x.grad.shape == x.shape and residual.grad.shape == residual.shape and weight.grad.shape == weight.shape
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1


@pytest.mark.parametrize("norm", NORMS)
def test_row_strided_views_run_in_place(device, launches, norm):
    """Rows of a wider buffer (row stride > hidden) are read and their gradients computed
    without a copy; the incoming gradients may be row-padded views too."""
    buf = randn(9, 800, dtype=torch.bfloat16, device=device)
    inputs = [buf[:, :768].detach().requires_grad_(), buf[:, 16:784].detach().requires_grad_(),
              None, None]
    _check_fwd_bwd(norm, inputs, torch.bfloat16, device)
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1


def _kept_mask(norm, x, p, seed):
    """The kernel's dropout mask for ``seed``: residual_out of dropout(x) alone is 0 where dropped."""
    torch.manual_seed(seed)
    with torch.no_grad():
        _, rout = _call(_op(norm), norm, x, None, None, None, dropout_p=p)
    return rout != 0


@pytest.mark.parametrize("has_res", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_dropout_one_is_torchs_dropout(device, launches, norm, has_res):
    """``dropout_p=1.0`` as torch's dropout: x times 0 (zero gradient for x), then the op at p = 0
    on our kernels: the norm of the residual (of zeros without one: LayerNorm gives the bias),
    every output and gradient under the error rule against the float64 reference."""
    inputs = _inputs((6, 40), torch.bfloat16, device, has_res=has_res)
    if norm == "rms":
        inputs[3] = None
    before = launches["add_norm_fwd"]
    _check_fwd_bwd(norm, inputs, torch.bfloat16, device, dropout_p=1.0)
    assert launches["add_norm_fwd"] > before
    out, _ = _call(_op(norm), norm, *inputs, dropout_p=1.0)
    (dx,) = torch.autograd.grad(out.float().sum(), inputs[0])
    assert (dx == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_dropout(device, launches, dtype, norm):
    p, shape = 0.3, (16, 1000)
    x, residual, weight, _ = _inputs(shape, dtype, device, has_b=False)
    kept = _kept_mask(norm, x, p, 7)
    frac = kept.double().mean().item()
    sigma = (p * (1 - p) / kept.numel()) ** 0.5
    assert abs(frac - (1 - p)) < 5 * sigma, f"kept fraction {frac} vs {1 - p}"
    torch.manual_seed(7)
    _, rout_a = _call(_op(norm), norm, x, None, weight, None, dropout_p=p)
    # Kept values are scaled by 1/(1-p).
    torch.testing.assert_close(rout_a[kept].double(), (x.detach()[kept].double() / (1 - p)).to(dtype).double())

    # Same seed, same mask; the residual does not change which elements are dropped.
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
    assert launches["add_norm_fwd"] == 5 and launches["add_norm_bwd"] == 1


@pytest.mark.parametrize("norm", NORMS)
def test_dropout_chunked(device, launches, small_chunks, norm):
    """The chunked paths regenerate the same mask in both passes and in backward."""
    p, shape = 0.2, (13, 100)
    x, residual, weight, _ = _inputs(shape, torch.float32, device, has_b=False)
    kept = _kept_mask(norm, x, p, 3)
    torch.manual_seed(3)
    out, rout = _call(_op(norm), norm, x, residual, weight, None, dropout_p=p)
    inputs = [x, residual, weight]
    as64 = [t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_rout = _call(_ref(norm), norm, *as64, None, dropout_p=p, dropout_mask=kept)
    base_out, base_rout = _call(_ref(norm), norm, *inputs, None, dropout_p=p, dropout_mask=kept,
                                compute_dtype=torch.float32)
    assert_close("out", out, ref_out, base_out)
    gouts = [torch.randn(shape, dtype=torch.float64, device=device) for _ in range(2)]
    for name, g, w, b in zip(("dx", "dresidual", "dweight"), _grads((out, rout), inputs, gouts),
                             _grads((ref_out, ref_rout), as64, gouts), _grads((base_out, base_rout), inputs, gouts)):
        assert_close(name, g, w, b)
    assert launches["add_norm_bwd"] == 1


@pytest.mark.parametrize("norm", NORMS)
def test_gradient_of_one_output(device, launches, norm):
    """A gradient on only one output: the other is not materialized (no zeros), and with only
    residual_out used the kernel passes its gradient through dropout alone."""
    p = 0.25
    x, residual, weight, bias = _inputs((11, 96), torch.float32, device, has_b=norm == "layer")
    kept = _kept_mask(norm, x, p, 5)
    torch.manual_seed(5)
    out, rout = _call(_op(norm), norm, x, residual, weight, bias, dropout_p=p)
    g = torch.randn_like(rout)
    rout.backward(g)
    torch.testing.assert_close(residual.grad, g)
    torch.testing.assert_close(x.grad, torch.where(kept, g / (1 - p), 0.0))
    assert weight.grad is None and (bias is None or bias.grad is None)  # as in eager: out's branch never ran
    assert launches["add_norm_bwd"] == 1 and launches["add_norm_bwd_reduce"] == 0

    x.grad = residual.grad = None
    inputs = [x, residual, weight, bias]
    out, rout = _call(_op(norm), norm, *inputs)
    as64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, _ = _call(_ref(norm), norm, *as64)
    base_out, _ = _call(_ref(norm), norm, *inputs, compute_dtype=torch.float32)
    g = torch.randn(out.shape, dtype=torch.float64, device=device)
    for name, a, w, b in zip(("dx", "dresidual", "dweight", "dbias"), _grads((out,), inputs, (g,)),
                             _grads((ref_out,), as64, (g,)), _grads((base_out,), inputs, (g,))):
        assert_close(name, a, w, b)
    assert launches["add_norm_bwd"] == 2 and launches["add_norm_bwd_reduce"] == 1


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("second", ["x", "out", "out_fp32_residual"])
def test_one_tensor_feeding_two_places(device, launches, monkeypatch, norm, second):
    """The residual stream feeds the next sublayer and the next add: both results of the norm
    are outputs of its autograd Function, and the backward kernel sums their gradients (no
    PyTorch add). ``x``: without a residual, residual_out is x itself (Pre-LN's first norm);
    ``out``: ``out_is_residual`` returns out twice (Post-LN, here with a residual and dropout);
    ``out_fp32_residual``: the same with a wider residual, whose two gradients PyTorch sums
    (the kernel variant would spill; the layers never ask for it)."""
    dtype = torch.bfloat16
    has_res = second != "x"
    inputs = _inputs((7, 96), dtype, device, has_res=has_res, has_b=norm == "layer")
    if second == "out_fp32_residual":
        inputs[1] = inputs[1].detach().float().requires_grad_()
    kw = {"out_is_residual": True} if has_res else {}
    p = 0.2 if has_res else 0.0
    x = inputs[0]
    kept = _kept_mask(norm, x, p, 3) if p else None
    torch.manual_seed(3)
    out, rout = _call(_op(norm), norm, *inputs, dropout_p=p, **kw)
    assert rout.data_ptr() == (x if second == "x" else out).data_ptr() and rout.grad_fn is not None
    as64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_rout = _call(_ref(norm), norm, *as64, dropout_p=p, dropout_mask=kept, **kw)
    base_out, base_rout = _call(_ref(norm), norm, *inputs, dropout_p=p, dropout_mask=kept, compute_dtype=dtype, **kw)
    assert_close("out", out, ref_out, base_out)
    gouts = [torch.randn(out.shape, dtype=torch.float64, device=device) for _ in range(2)]
    names = [nm for nm, t in zip(("dx", "dresidual", "dweight", "dbias"), inputs) if t is not None]
    for name, g, w, b in zip(names, _grads((out, rout), inputs, gouts), _grads((ref_out, ref_rout), as64, gouts),
                             _grads((base_out, base_rout), inputs, gouts)):
        assert_close(name, g, w, b, dtype=dtype)
    assert launches["add_norm_bwd"] == 1

    monkeypatch.setattr(common, "POISON_OUTPUTS", False)  # the poison is a fill_
    monkeypatch.setattr(common, "STUB_LAUNCHES", True)
    out, rout = _call(_op(norm), norm, *inputs, dropout_p=p, **kw)
    g = [torch.randn_like(out) for _ in range(2)]
    with _AtenOps() as bwd:
        torch.autograd.grad((out, rout), [t for t in inputs if t is not None], g)
    assert sum(n for op, n in bwd.ops.items() if "add" in op) == (second == "out_fp32_residual"), bwd.ops


def test_batched_inputs_add_no_view_nodes(device, launches):
    """(B, L, N) inputs are flattened inside the autograd Function: the graph holds its node
    alone, not a view node (host time, forward and backward) per input and output."""
    x, residual, weight, _ = _inputs((2, 3, 64), torch.bfloat16, device, has_b=False)
    for res in (residual, None):
        out, rout = fused_block.add_rms_norm(x, res, weight)
        assert out.grad_fn.name() == rout.grad_fn.name() == "_AddNormBackward"
        assert {f.name() for f, _ in out.grad_fn.next_functions if f is not None} == {"torch::autograd::AccumulateGrad"}


def test_residual_out_of_a_frozen_x_is_x(device, launches):
    """x that needs no gradient is returned as it is (not through the autograd Function)."""
    x, _, weight, bias = _inputs((5, 64), torch.float32, device)
    x.requires_grad_(False)
    out, rout = fused_block.add_layer_norm(x, None, weight, bias)
    assert rout is x and out.requires_grad
    with torch.no_grad():
        out, rout = fused_block.add_rms_norm(x, None, weight, out_is_residual=True)
    assert rout is out


def test_frozen_parameters_skip_the_reduction(device, launches):
    x, residual, weight, bias = _inputs((9, 128), torch.float32, device)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    out, rout = fused_block.add_layer_norm(x, residual, weight, bias)
    (out.sum() + rout.sum()).backward()
    assert x.grad is not None and residual.grad is not None
    assert launches["add_norm_bwd"] == 1 and launches["add_norm_bwd_reduce"] == 0


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norm", NORMS)
def test_no_torch_kernels_besides_allocations(device, launches, monkeypatch, norm):
    """Forward: one Triton kernel; backward: the kernel and the reduction. PyTorch only
    allocates the outputs (and the partials): no zero-fills, sums, casts, copies or an empty
    dropout seed. The kernels are stubbed: the interpreter's own tensor copies are not counted."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", False)  # the poison is a fill_
    monkeypatch.setattr(common, "STUB_LAUNCHES", True)
    x, residual, weight, bias = _inputs((6, 64), torch.bfloat16, device, has_b=norm == "layer",
                                        param_dtype=torch.float32)
    g = torch.randn(6, 64, dtype=torch.bfloat16, device=device)
    with _AtenOps() as fwd:
        out, rout = _call(_op(norm), norm, x, residual, weight, bias)
    with _AtenOps() as bwd:
        torch.autograd.grad((out, rout), [t for t in (x, residual, weight, bias) if t is not None], (g, g))
    allocs = "aten.empty_strided.default"  # common.empty's allocation
    no_kernel = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.detach.default"}
    assert set(fwd.ops) - no_kernel == {allocs}, fwd.ops
    assert fwd.ops[allocs] == (4 if norm == "layer" else 3)  # out, residual_out, (mean,) rstd
    # dx (also dresidual), dweight (+ dbias) and a buffer for each one's fp32 partials (no views).
    assert set(bwd.ops) - no_kernel == {allocs}, bwd.ops
    assert bwd.ops[allocs] == (5 if norm == "layer" else 3)
    assert launches["add_norm_fwd"] == 1 and launches["add_norm_bwd"] == 1
    assert launches["add_norm_bwd_reduce"] == 1


def test_host_path_has_no_triton_helpers(device, monkeypatch):
    """Host integer math is plain Python: Triton's cdiv/next_power_of_2 (~4 us each) are not called."""
    def forbidden(*args):
        raise AssertionError("Triton host helper on the hot path")

    monkeypatch.setattr(triton, "cdiv", forbidden)
    monkeypatch.setattr(triton, "next_power_of_2", forbidden)
    x, residual, weight, bias = _inputs((5, 1000), torch.float32, device)
    out, rout = fused_block.add_layer_norm(x, residual, weight, bias, dropout_p=0.1)
    (out.sum() + rout.sum()).backward()


def test_backward_is_deterministic(device):
    x, residual, weight, bias = _inputs((37, 300), torch.float32, device)
    out, rout = fused_block.add_layer_norm(x, residual, weight, bias)
    g = torch.randn_like(out)
    first = torch.autograd.grad((out, rout), (x, weight, bias), (g, g), retain_graph=True)
    second = torch.autograd.grad((out, rout), (x, weight, bias), (g, g))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_config_tables_cover_every_hidden():
    for arch in common.ARCHS + (0,):
        for block in [1 << i for i in range(17)]:
            for light in (False, True):
                if block <= knorm.FWD_REG_MAX:
                    assert knorm.fwd_candidates(arch, block, True, light)
            if block <= knorm.BWD_REG_MAX:
                assert knorm.bwd_candidates(arch, block, True)
        assert knorm.fwd_candidates(arch, knorm.FWD_CHUNK, False, False)
        assert knorm.bwd_candidates(arch, knorm.BWD_CHUNK, False)
    # quack's Hopper grid table up to 8192: a multiple of the SM count falling with the hidden
    # size; then two programs per SM for the chunked path.
    assert [knorm.bwd_programs(n, 132) for n in (256, 1024, 2048, 4096, 8192, 16384)] == \
        [2112, 1056, 528, 264, 132, 264]
    # Wider rows: fewer programs, so the (programs, N) fp32 partials stay within MAX_PARTIALS.
    for n in (131072, 262144, 1 << 20, knorm.MAX_HIDDEN):
        assert 1 <= knorm.bwd_programs(n, 132) * n <= knorm.MAX_PARTIALS


@pytest.mark.parametrize("norm,dropout,rout", [("layer", 0.1, True), ("rms", 0.0, True), ("layer", 0.0, False)])
def test_opcheck(device, norm, dropout, rout):
    x = randn(9, 40, dtype=torch.bfloat16, device=device)
    residual = randn(9, 40, dtype=torch.float32, device=device) if rout else None
    weight = randn(40, dtype=torch.float32, device=device)
    bias = None if norm == "rms" else randn(40, dtype=torch.float32, device=device)
    seed = torch.tensor([3], dtype=torch.int64, device=device) if dropout else None
    rdtype = torch.float32 if rout else torch.bfloat16
    args = (x, residual, weight, bias, seed, 1e-5, dropout, norm == "rms", rdtype, rout)
    torch.library.opcheck(torch.ops.fused_block.add_norm_fwd.default, args)
    outs = torch.ops.fused_block.add_norm_fwd(*args)
    h = outs[1] if rout else x
    mean = None if norm == "rms" else outs[-2]
    dout2 = None if rout else torch.randn_like(x)  # a second gradient of out (never with residual_out's)
    bwd_args = (torch.randn_like(x), dout2, torch.randn_like(h) if rout else None, h, weight, mean, outs[-1], seed,
                dropout, norm == "rms", torch.bfloat16, rdtype if rout else None, torch.float32,
                None if bias is None else torch.float32)
    torch.library.opcheck(torch.ops.fused_block.add_norm_bwd.default, bwd_args)
    # Contiguous tensors of another rank: their rows read in place, outputs in x's shape.
    rows3 = [t.view(3, 3, 40) if isinstance(t, torch.Tensor) and t.dim() == 2 else t for t in args]
    torch.library.opcheck(torch.ops.fused_block.add_norm_fwd.default, tuple(rows3))
    assert torch.ops.fused_block.add_norm_fwd(*rows3)[0].shape == (3, 3, 40)
    bwd3 = [t.view(3, 3, 40) if isinstance(t, torch.Tensor) and t.dim() == 2 else t for t in bwd_args]
    torch.library.opcheck(torch.ops.fused_block.add_norm_bwd.default, tuple(bwd3))
    # A non-contiguous one of another rank is refused, not read as if contiguous.
    strided = (x.view(3, 3, 40).transpose(0, 1),) + args[1:]
    with pytest.raises(ValueError, match="must be contiguous"):
        torch.ops.fused_block.add_norm_fwd(*strided)


@pytest.mark.parametrize("second", ["residual_out", "x", "out"])
@pytest.mark.parametrize("norm", NORMS)
def test_torch_compile_fullgraph(device, launches, norm, second):
    """Each kind of second output (residual_out, x returned as itself, out twice) traces."""
    x = randn(6, 64, dtype=torch.float32, device=device, requires_grad=True)
    residual = None if second == "x" else randn(6, 64, dtype=torch.float32, device=device)
    weight = randn(64, dtype=torch.float32, device=device, requires_grad=True)

    def step(x, residual, weight):
        out, rout = _call(_op(norm), norm, x, residual, weight, None, out_is_residual=second == "out")
        return (out * rout.flip(-1)).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(x, residual, weight)
    gx, gw = torch.autograd.grad(loss, (x, weight))
    assert launches["add_norm_fwd"] >= 1 and launches["add_norm_bwd"] >= 1
    ref_loss = step(x, residual, weight)
    rx, rw = torch.autograd.grad(ref_loss, (x, weight))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("norm", NORMS)
def test_torch_compile_fullgraph_with_x_as_its_own_residual(device, launches, norm):
    """``add_norm(x, x)`` traces (Dynamo refuses an autograd Function given the same tensor
    twice: the op hands it a view), with eager's gradient, the sum of both uses."""
    x = randn(6, 64, dtype=torch.float32, device=device, requires_grad=True)

    def step(x):
        out, rout = _call(_op(norm), norm, x, x, None, None)
        return (out * rout.flip(-1)).sum()

    assert_compiled_matches_eager(step, x)
    assert launches["add_norm_fwd"] >= 2 and launches["add_norm_bwd"] >= 2


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


@pytest.mark.parametrize("cls,torch_cls", [(fused_block.LayerNorm, torch.nn.LayerNorm),
                                           (fused_block.RMSNorm, torch.nn.RMSNorm)], ids=["layer", "rms"])
def test_modules_take_what_torch_takes(device, launches, monkeypatch, cls, torch_cls):
    """float64 runs torch's module (no launch, no warning); rows wider than the kernels take
    (MAX_HIDDEN lowered to 64 here: the real limit, 2^24 - 1, would need 64 MB rows) too, after
    a one-time warning; integer input gets torch's own error."""
    ours, theirs = cls(96).to(device), torch_cls(96).to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    x = randn(3, 96, dtype=torch.float64, device=device)
    torch.testing.assert_close(ours.double()(x), theirs.double()(x))
    out, rout = ours(x, x)
    torch.testing.assert_close(out, theirs(2 * x))
    assert launches["add_norm_fwd"] == 0
    monkeypatch.setattr(fused_block.norm, "MAX_HIDDEN", 64)
    x = randn(3, 96, dtype=torch.float32, device=device, requires_grad=True)
    with pytest.warns(UserWarning, match="more than the kernels' 64"):
        got = ours.float()(x)
    want = theirs.float()(x)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
    assert launches["add_norm_fwd"] == 0
    with pytest.raises(RuntimeError):
        ours(torch.ones(3, 96, dtype=torch.int64, device=device))


@pytest.mark.parametrize("cls,torch_cls", [(fused_block.LayerNorm, torch.nn.LayerNorm),
                                           (fused_block.RMSNorm, torch.nn.RMSNorm)], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's rms_norm, unfused
def test_float64_parameters_run_torchs_module(device, launches, cls, torch_cls, dtype):
    """A module in float64 (``.double()``) given fp32/fp16/bf16 input: torch's module decides,
    as for a float64 input (the kernels take no float64 weight): torch's RMSNorm answers (the
    same output and gradients), its LayerNorm raises its own error; no launch."""
    ours, theirs = cls(96).to(device).double(), torch_cls(96).to(device).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    x = randn(3, 96, dtype=dtype, device=device, requires_grad=True)
    try:
        want = theirs(x)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            ours(x)
    else:
        got = ours(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        g = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, (x, ours.weight), g), torch.autograd.grad(want, (x, theirs.weight), g)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert launches["add_norm_fwd"] == 0


def test_reference_fallback_without_interpreter(monkeypatch, launches):
    """CPU tensors without TRITON_INTERPRET run the plain-PyTorch reference."""
    monkeypatch.setattr(_backend, "INTERPRET", False)
    x = randn(4, 32, dtype=torch.float32, device="cpu")
    out, rout = fused_block.add_layer_norm(x, x, None, None)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(2 * x, (32,)))
    assert launches["add_norm_fwd"] == 0


def test_autocast(device, launches):
    """Under autocast the fp32 parameters stay fp32 and the kernel reads them as they are; the
    output's dtype is torch's module's under the same autocast (bf16 on the CPU, whose autocast
    leaves layer_norm alone; fp32 on CUDA)."""
    ln = fused_block.LayerNorm(64).to(device)
    x = randn(8, 64, dtype=torch.bfloat16, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = ln(x)
        want = torch.nn.LayerNorm(64).to(device)(x)
    assert out.dtype == want.dtype == (torch.float32 if device.type == "cuda" else torch.bfloat16)
    torch.testing.assert_close(out.float(), torch.nn.functional.layer_norm(x.float(), (64,)), atol=2e-2, rtol=1e-2)
    assert launches["add_norm_fwd"] == 1


def test_autocast_norm_predicate_is_torchs():
    """Whether a device type's autocast runs the norms in fp32 is torch's registration: a
    kernel of aten::layer_norm / aten::rms_norm for "Autocast" + the device type (CUDA's: yes;
    the CPU's: no; a device type without an autocast key of its own: no)."""
    from fused_block import norm as fnorm

    for is_rms, op in ((False, "aten::layer_norm"), (True, "aten::rms_norm")):
        assert fnorm.autocast_norm_fp32("cpu", is_rms) is False
        assert fnorm.autocast_norm_fp32("cuda", is_rms) is torch._C._dispatch_has_kernel_for_dispatch_key(
            op, "AutocastCUDA")
        assert fnorm.autocast_norm_fp32("no_such_device", is_rms) is False


def _as_cuda_autocast(norm, x, weight, bias, eps, residual=None):
    """torch's module on ``x (+ residual)`` as CUDA's autocast computes it: the sum in its own
    dtype, then input, weight and bias cast to fp32 (an fp32 output)."""
    h = x if residual is None else x + residual
    cast = lambda t: None if t is None else t.float()  # noqa: E731
    if norm == "layer":
        return torch.nn.functional.layer_norm(h.float(), h.shape[-1:], cast(weight), cast(bias), eps)
    return torch.nn.functional.rms_norm(h.float(), h.shape[-1:], cast(weight), eps)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("params", ["fp32", "input"], ids=["fp32-params", "params-in-input-dtype"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["x", "x+residual"])
def test_modules_follow_cuda_autocast(device, launches, cuda_autocast_norms, dtype, norm, params, with_residual):
    """Under autocast whose policy runs the norms in fp32 (CUDA's; emulated on the CPU), the
    modules give torch's module's answer: a 16-bit input normalized in fp32 with fp32 weight and
    bias, an fp32 output, gradients in the input's and the parameters' dtypes (fp32 parameters:
    an fp32 model; 16-bit: a cast one). ``forward(x, residual)``: residual_out = x + residual in
    their dtype, normalized as rounded. fp32 input: unchanged (fp32 already)."""
    cls, torch_cls = (fused_block.LayerNorm, torch.nn.LayerNorm) if norm == "layer" else (
        fused_block.RMSNorm, torch.nn.RMSNorm)
    ours = cls(96).to(device)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p))
    if params == "input":
        ours.to(dtype)
    x = randn(5, 96, dtype=dtype, device=device, requires_grad=True)
    residual = randn(5, 96, dtype=dtype, device=device, requires_grad=True) if with_residual else None
    leaves = [t for t in (x, residual, *ours.parameters()) if t is not None]
    names = ["dx"] + (["dresidual"] if with_residual else []) + [f"d{n}" for n, _ in ours.named_parameters()]
    with torch.autocast(device.type, dtype=torch.bfloat16 if dtype == torch.float32 else dtype):
        got = ours(x) if residual is None else ours(x, residual)
    out, rout = (got, None) if residual is None else got
    assert out.dtype == torch.float32
    assert launches["add_norm_fwd"] == 1
    w, b = ours.weight, getattr(ours, "bias", None)
    eps = torch.finfo(torch.float32).eps if ours.eps is None else ours.eps  # RMSNorm's default: fp32's
    base = _as_cuda_autocast(norm, x, w, b, eps, residual)
    as64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, r64 = as64[0], as64[1] if with_residual else None
    w64, b64 = as64[1 + with_residual], as64[2 + with_residual] if norm == "layer" else None
    # The float64 oracle normalizes the sum rounded to its dtype, as torch and the kernel do.
    h64 = x64 if r64 is None else x64 + r64 + ((x + residual).double() - (x.double() + residual.double())).detach()
    if norm == "layer":
        ref = torch.nn.functional.layer_norm(h64, (96,), w64, b64, eps)
    else:
        ref = torch.nn.functional.rms_norm(h64, (96,), w64, eps)
    baselines = [("as CUDA's autocast computes", base)]
    if device.type == "cuda":  # torch's own module under CUDA's autocast
        theirs = torch_cls(96).to(device=device, dtype=w.dtype)
        theirs.load_state_dict(ours.state_dict())
        with torch.autocast("cuda", dtype=torch.bfloat16 if dtype == torch.float32 else dtype):
            want = theirs(x if residual is None else x + residual)
        assert want.dtype == out.dtype
        baselines.append(("torch's module under torch.autocast('cuda')", want))
        leaves_theirs = [x] + ([residual] if with_residual else []) + list(theirs.parameters())
    if with_residual:
        assert rout.dtype == dtype
        torch.testing.assert_close(rout, x + residual, atol=0, rtol=0)
    g = torch.randn(out.shape, dtype=torch.float64, device=device)
    grads = torch.autograd.grad((out.double() * g).sum(), leaves)
    grads64 = torch.autograd.grad((ref * g).sum(), as64)
    for label, baseline in baselines:
        assert_close(f"out vs {label}", out, ref, baseline)
        base_leaves = leaves if baseline is base else leaves_theirs
        base_grads = torch.autograd.grad((baseline.double() * g).sum(), base_leaves)
        for name, got_g, want_g, base_g, t in zip(names, grads, grads64, base_grads, leaves):
            assert got_g.dtype == base_g.dtype == t.dtype, name
            assert_close(f"{name} vs {label}", got_g, want_g, base_g)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_modules_follow_cuda_autocast_under_torch_compile(device, launches, cuda_autocast_norms, dtype, norm):
    """torch.compile (fullgraph, aot_eager) traces the autocast policy without a graph break (the
    device type's answer is a constant of the trace) and gives eager's output, fp32 under
    (emulated) CUDA autocast, and eager's input gradient."""
    m = (fused_block.LayerNorm if norm == "layer" else fused_block.RMSNorm)(64).to(device)
    x = randn(4, 64, dtype=dtype, device=device, requires_grad=True)
    lowp = torch.bfloat16 if dtype == torch.float32 else dtype
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with torch.autocast(device.type, dtype=lowp):
        got, want = compiled(x), m(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])


def test_backward_launcher_takes_one_extra_gradient(device):
    """A second gradient of out and the gradient of residual_out never go to one launch (the
    compile check covers each alone; the autograd Function passes at most one)."""
    h = randn(3, 16, dtype=torch.float32, device=device)
    rstd = torch.ones(3, device=device)
    with pytest.raises(ValueError, match="exclusive"):
        knorm.add_norm_bwd(h, h, h, h, None, None, rstd, None, 0.0, True, torch.float32, None, None, None)


# Gemma's RMSNorm: the row scaled by (1 + w) in fp32, w stored as an offset from 1 (near 0).
# Shapes: a register row of several rows per program, and the chunked paths (thresholds
# lowered) with an fp32 residual stream; dtypes as parameters (each reaches the GPU check).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["register", "chunked"])
def test_rms_norm_unit_offset(device, launches, monkeypatch, dtype, chunked):
    if chunked:
        for name, value in (("FWD_REG_MAX", 64), ("FWD_REG_MAX_HEAVY", 64), ("BWD_REG_MAX", 64),
                            ("FWD_CHUNK", 32), ("BWD_CHUNK", 32)):
            monkeypatch.setattr(knorm, name, value)
    n = 100 if chunked else 48
    x, residual, _, _ = _inputs((7, n), dtype, device, has_b=False)
    weight = randn(n, dtype=dtype, device=device, scale=0.3, requires_grad=True)
    out, rout = _check_fwd_bwd("rms", [x, residual, weight, None], dtype, device, unit_offset=True)
    # The flag reaches the kernels: no (1 + w) tensor, one launch each way.
    assert launches["add_norm_fwd"] == launches["add_norm_bwd"] == launches["add_norm_bwd_reduce"] == 1
    with torch.no_grad():  # Gemma's own formula, in fp32 then cast
        h = (x + residual).to(dtype).float()
        gemma = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + torch.finfo(dtype).eps)
                 * (1.0 + weight.float())).to(dtype)
    torch.testing.assert_close(out, gemma, atol=numerics_atol(dtype), rtol=0)


def numerics_atol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def test_rms_norm_unit_offset_bad_flag(device, launches):
    x = randn(3, 8, dtype=torch.float32, device=device)
    with pytest.raises(TypeError, match="^unit_offset"):
        fused_block.add_rms_norm(x, None, torch.zeros(8, device=device), unit_offset=1)
    assert launches["add_norm_fwd"] == 0


# ---------------------------------------------------------------------------------------------
# torch's path as a candidate (fused_block.norm: eager's add + F.layer_norm / F.rms_norm)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def norm_candidate():
    """Runs the test with a forced candidate (``fused_block.norm.force``), restored after."""
    from fused_block import norm as fnorm

    before = fnorm.force(None)
    yield fnorm
    fnorm.force(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("has_res,out_is_residual", [(True, False), (False, False), (True, True)],
                         ids=["residual", "no-residual", "post-ln"])
def test_torch_candidate_matches_reference(device, launches, norm_candidate, dtype, norm, has_res, out_is_residual):
    """Where torch's path is chosen it gives the op's outputs (dtypes, the second output as the
    op's: residual_out, x itself, or out again) and every gradient, within the block rule
    against float64; no kernel of ours runs."""
    norm_candidate.force(norm_candidate.TORCH)
    inputs = _inputs((5, 3, 96), dtype, device, has_res=has_res, has_b=norm == "layer")
    out, rout = _check_fwd_bwd(norm, inputs, dtype, device, out_is_residual=out_is_residual)
    assert out.dtype == rout.dtype == dtype
    if out_is_residual:
        assert rout is out
    elif not has_res:
        assert rout is inputs[0]
    assert launches["add_norm_fwd"] == launches["add_norm_bwd"] == launches["add_norm_bwd_reduce"] == 0


@pytest.mark.parametrize("case", ["dropout", "unit_offset", "fp32_residual", "fp32_weight", "residual_in_fp32",
                                  "autocast"])
def test_torch_candidate_only_where_it_computes_the_op(device, launches, norm_candidate, case):
    """What eager's single-call path does not compute as the op does (dropout, whose mask is our
    seed's; Gemma's unit offset; a residual stream or parameters in another dtype than x;
    autocast, which runs torch's norms in fp32) runs our kernels even with torch's path forced."""
    norm_candidate.force(norm_candidate.TORCH)
    x = randn(4, 64, dtype=torch.bfloat16, device=device)
    residual = randn(4, 64, dtype=torch.float32 if case == "fp32_residual" else torch.bfloat16, device=device)
    weight = randn(64, dtype=torch.float32 if case == "fp32_weight" else torch.bfloat16, device=device)
    kw = {"dropout": dict(dropout_p=0.1), "unit_offset": dict(unit_offset=True),
          "residual_in_fp32": dict(residual_in_fp32=True)}.get(case, {})
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=case == "autocast"):
        out, _ = fused_block.add_rms_norm(x, None if case == "residual_in_fp32" else residual, weight, **kw)
    assert launches["add_norm_fwd"] == 1 and out.dtype == torch.bfloat16


def test_norm_choice_is_timed_once_per_bucket_and_listed(device, monkeypatch, norm_candidate):
    """The first call of a bucket times both candidates (here a stand-in timing) and keeps the
    faster; later calls of the bucket (rows rounded up to a power of two) reuse it untimed;
    ``fused_block.norm_choices()`` lists it. Untimed, the static rule (our kernels): with
    FUSED_BLOCK_TUNE=0, in the interpreter, under deterministic algorithms, torch.compile and
    saved-tensor hooks."""
    fnorm = norm_candidate
    monkeypatch.setattr(fnorm, "_CHOSEN", {})
    monkeypatch.setattr(fnorm, "_KEYS", {})  # the signatures' buckets hold the arch, patched below
    monkeypatch.setattr(common, "TUNE", True)
    calls = []

    def fake_time(grad, leaves, fns, ours):
        calls.append((grad, sorted(fns), [t is not None and t.requires_grad for t in leaves]))
        return {fnorm.TRITON: 2.0, fnorm.TORCH: 1.0}

    monkeypatch.setattr(fnorm._timing, "time_candidates", fake_time)
    x = randn(100, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = randn(64, dtype=torch.bfloat16, device=device)  # frozen: not a leaf that takes a gradient
    args = (None, w, None, 1e-6, True, False, True)
    monkeypatch.setattr(common, "arch", lambda dev: 0)
    assert fnorm._choose(x, *args) == fnorm.TRITON  # the interpreter: untimed
    monkeypatch.setattr(common, "arch", lambda dev: 90)
    fnorm._KEYS.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # e.g. non-reentrant checkpointing:
        assert fnorm._choose(x, *args) == fnorm.TRITON  # the timing's saves would be seen; untimed, unkept
    assert fnorm._choose(x, *args) == fnorm.TORCH
    assert fnorm._choose(x[:70], *args) == fnorm.TORCH  # the same bucket (128 rows)
    assert calls == [(True, [fnorm.TORCH, fnorm.TRITON], [True, False, False, False])]
    (bucket, (best, times)), = fused_block.norm_choices().items()
    assert best == fnorm.TORCH and times[fnorm.TRITON] == 2.0 and bucket[:3] == (90, True, torch.bfloat16)
    torch.use_deterministic_algorithms(True)
    try:
        assert fnorm._choose(x, *args) == fnorm.TRITON
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(fnorm, "_compiling", lambda: True)
    assert fnorm._choose(x, *args) == fnorm.TRITON
    monkeypatch.setattr(fnorm, "_compiling", torch.compiler.is_compiling)
    monkeypatch.setattr(common, "TUNE", False)
    assert fnorm._choose(x[:20], *args) == fnorm.TRITON  # a new bucket, untimed
    assert len(calls) == 1
    with pytest.raises(ValueError, match="candidate"):
        fnorm.force("eager")


def test_norm_candidates_timing_runs_each_backward(device, monkeypatch):
    """The timing (``_timing.time_candidates``, with a stand-in for ``do_bench``) runs each
    candidate's forward and its backward into the leaves that take a gradient (x and the
    weight here; not the frozen residual), for Post-LN's output returned twice too; the
    launches it makes are not the caller's."""
    import triton.testing

    from fused_block import _timing
    from fused_block import norm as fnorm

    ran = collections.Counter()
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.5)[1])
    x = randn(6, 32, dtype=torch.float32, device=device, requires_grad=True)
    residual = randn(6, 32, dtype=torch.float32, device=device)
    w = randn(32, dtype=torch.float32, device=device, requires_grad=True)
    before = common.LAUNCHES.copy()
    for out_is_residual in (False, True):
        leaves = _timing.leaves_of(x, residual, w, None, grad=[True, False, True, False])
        for t, name in ((leaves[0], "x"), (leaves[2], "w")):
            t.register_hook(lambda g, name=name: ran.update([name]))
        fns = {fnorm.TRITON: lambda *t: fnorm._kernels(*t, 1e-6, 0.0, torch.float32, out_is_residual, True,
                                                         False, True),
               fnorm.TORCH: lambda *t: fnorm._torch_add_norm(*t, 1e-6, True, out_is_residual)}
        times = _timing.time_candidates(True, leaves, fns, ours=fnorm.TRITON)
        assert times == {fnorm.TRITON: 1.5, fnorm.TORCH: 1.5}
    assert ran == {"x": 8, "w": 8}  # 2 candidates x (first call + do_bench's) x 2 layouts
    assert common.LAUNCHES == before


def test_candidates_timing_leaves_torchs_generator_alone(device, monkeypatch):
    """The timing runs inside the caller's forward (the first call of a bucket, with a gradient:
    random output gradients for the backward); it must not draw from torch's generator, or every
    dropout seed drawn after it moves: a reentrant checkpoint's recomputation (which times what
    its no-grad forward did not) would drop other elements than its forward did, silently wrong
    gradients. The seed drawn after a timing is the one drawn without it."""
    import triton.testing

    from fused_block import _backend, _timing
    from fused_block import norm as fnorm

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.5)[1])
    x = randn(6, 32, dtype=torch.float32, device=device, requires_grad=True)
    w = randn(32, dtype=torch.float32, device=device, requires_grad=True)
    fns = {fnorm.TRITON: lambda *t: fnorm._kernels(*t, 1e-6, 0.0, torch.float32, False, True, False, True),
           fnorm.TORCH: lambda *t: fnorm._torch_add_norm(*t, 1e-6, True, False)}
    seeds = []
    for timed in (False, True):
        torch.manual_seed(5)
        if timed:
            leaves = _timing.leaves_of(x, None, w, None, grad=[True, False, True, False])
            _timing.time_candidates(True, leaves, fns, ours=fnorm.TRITON)
        seeds.append(_backend.dropout_seed(0.1, device).item())
    assert seeds[0] == seeds[1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_default_eps_is_torchs(device, launches, dtype):
    """``eps=None`` as torch's rms_norm takes it (``torch.nn.RMSNorm``'s default): the machine
    epsilon of fp32, the type it computes 16-bit x in, not of x's dtype (bf16's is 0.0078, which
    would swamp rows whose mean square is 1e-6)."""
    x = randn(5, 16, dtype=dtype, device=device, scale=1e-3)
    theirs = torch.nn.RMSNorm(16, device=device, dtype=dtype)
    ours = fused_block.RMSNorm(16, device=device, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
    with torch.no_grad():
        assert_close("RMSNorm", ours(x), want, theirs(x))
        out, _ = fused_block.add_rms_norm(x)
        assert_close("add_rms_norm", out, want, torch.nn.functional.rms_norm(x, (16,)))
    assert launches["add_norm_fwd"] == 2
