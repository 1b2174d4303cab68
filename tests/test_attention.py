"""fused_block.attention against the float64 reference (interpreter on CPU, unchanged on CUDA).

Shapes are a covering set, not a cross product: the interpreter runs every program in
Python, so long sequences and D=256 appear in a few cases with B*H small. Interpreter blocks
are 64x32 (forward, dQ) and 32x64 (dK/dV), so 17, 128, 200 and 1000 cross them in every way.
"""
import math

import pytest
import torch

from fused_block import _backend, reference
from fused_block.attention import attention
from fused_block.kernels import attention as kernels
from numerics import ATOL, DTYPES, assert_close, randn

ON_CUDA = torch.cuda.is_available()


def _baseline_dtype(dtype):
    # fp32 runs its products in TF32 on the GPU (documented): bound it by the fp16 reference.
    return torch.float16 if dtype == torch.float32 and ON_CUDA else dtype


def _atol(dtype):
    return ATOL[torch.float16] if dtype == torch.float32 and ON_CUDA else ATOL[dtype]


def _padding(B, Lk, device, full_row=True, generator=None):
    """Random padding (True = pad); batch 0 fully padded when ``full_row`` (rows with no key)."""
    mask = torch.rand(B, Lk, generator=generator) < 0.3
    if full_row:
        mask[0] = True
    return mask.to(device)


def _compare(q, k, v, causal=False, mask=None, dropout_p=0.0, dropout_mask=None, scale=None, out=None,
             grads=True, lse=None):
    """Check ``attention(q, k, v, ...)`` (or the given ``out``/``lse``) and its gradients."""
    dtype = q.dtype
    if out is None:
        out, lse = attention(q, k, v, causal, scale, mask, dropout_p, return_lse=True)
    ref_kw = dict(dropout_mask=dropout_mask, return_lse=True)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref64, lse64 = reference.attention(*leaves64, causal, scale, mask, dropout_p, **ref_kw)
    leaves_lp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base, base_lse = reference.attention(*leaves_lp, causal, scale, mask, dropout_p,
                                         compute_dtype=_baseline_dtype(dtype), **ref_kw)
    atol = _atol(dtype)
    assert_close("out", out, ref64, base, atol=atol)
    if lse is not None:
        assert lse.dtype == torch.float32
        assert_close("lse", lse, lse64, base_lse, atol=atol)
    if not grads:
        return
    dout = randn(*out.shape, dtype=dtype, device=out.device)
    grads_k = torch.autograd.grad(out, (q, k, v), dout)
    grads_64 = torch.autograd.grad(ref64, leaves64, dout.double())
    grads_lp = torch.autograd.grad(base, leaves_lp, dout)
    for name, g, g64, gb in zip(("dq", "dk", "dv"), grads_k, grads_64, grads_lp):
        assert g.dtype == dtype
        assert_close(name, g, g64, gb, atol=atol)


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device):
    return (randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True))


# (B, Hq, Hkv, Lq, Lk, D, causal, padding), each with its reason.
CASES = [
    # Lq = Lk = 128: whole blocks; causal diagonal blocks, and blocks skipped above it.
    pytest.param(1, 2, 2, 128, 128, 64, True, False, id="self-128-causal-d64"),
    # Lq = 17 < Lk = 200: cross-attention, partial blocks, bottom-right causal offset 183
    # (not a block multiple); D = 80 padded to 128; MQA 4:1.
    pytest.param(1, 4, 1, 17, 200, 80, True, False, id="cross-17x200-causal-d80-mqa"),
    # Lq = 200 > Lk = 17: under causal the first 183 queries see no key (output 0);
    # D = 16, the smallest head dim; GQA 8:2.
    pytest.param(1, 8, 2, 200, 17, 16, True, False, id="cross-200x17-causal-d16-gqa"),
    # Lq = 1: one decoding step against a 200-key cache, with padding.
    pytest.param(2, 2, 1, 1, 200, 64, True, True, id="decode-1x200-causal-pad"),
    # Lk = 1: a single key; bidirectional with padding, so batch 0 has no key at all.
    pytest.param(2, 2, 2, 17, 1, 32, False, True, id="17x1-pad"),
    # Lq = Lk = 200 non-causal: partial last blocks in both grids; padding including a
    # fully padded batch row; D = 128, MQA 2:1.
    pytest.param(2, 2, 1, 200, 200, 128, False, True, id="self-200-pad-d128"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding", CASES)
def test_attention_matches_reference(B, Hq, Hkv, Lq, Lk, D, causal, padding, dtype, device, launches):
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    mask = _padding(B, Lk, device) if padding else None
    _compare(q, k, v, causal, mask)
    assert launches["attention_fwd"] == 1 and launches["attention_bwd_preprocess"] == 1
    # Wide fp32 rows run dK/dV and dQ in column chunks (more than one launch).
    assert launches["attention_bwd_dkdv"] >= 1 and launches["attention_bwd_dq"] >= 1


# Long and wide shapes, one dtype each (interpreter time): they add block-count and width.
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding,dtype", [
    # Lq = Lk = 1000: 16 x 32 blocks, the online softmax rescales across many key blocks.
    pytest.param(1, 1, 1, 1000, 1000, 64, True, False, torch.bfloat16, id="self-1000-causal-bf16"),
    # Lq = 128 queries over Lk = 1000 keys, non-causal with padding.
    pytest.param(1, 1, 1, 128, 1000, 64, False, True, torch.float16, id="cross-128x1000-pad-fp16"),
    # D = 256, the widest head dim (backward in two column chunks, dK and dV in two passes).
    pytest.param(1, 2, 1, 128, 17, 256, False, False, torch.float16, id="d256-fp16"),
    pytest.param(1, 1, 1, 200, 128, 256, True, False, torch.bfloat16, id="d256-causal-bf16"),
    # fp32 at D = 128, its widest (backward in two 64-column chunks).
    pytest.param(1, 2, 1, 70, 50, 128, True, False, torch.float32, id="d128-fp32"),
])
def test_attention_large(B, Hq, Hkv, Lq, Lk, D, causal, padding, dtype, device, launches):
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    mask = _padding(B, Lk, device, full_row=False) if padding else None
    _compare(q, k, v, causal, mask)
    assert launches["attention_fwd"] == 1 and launches["attention_bwd_dkdv"] >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views_of_fused_qkv(dtype, device, launches):
    """q, k, v as views of one (B, L, 3, H, D) projection: no copy, same result."""
    B, L, H, D = 2, 33, 2, 32
    qkv = randn(B, L, 3, H, D, dtype=dtype, device=device, requires_grad=True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, L, D), strided
    assert not q.is_contiguous() and q.stride(-1) == 1
    _compare(q, k, v, causal=True, scale=0.3)
    assert launches["attention_fwd"] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lse_gradient(dtype, device, launches):
    """The LSE output is differentiable: d lse_i / d s_ij = P_ij (folded into delta)."""
    q, k, v = _qkv(1, 2, 1, 40, 70, 32, dtype, device)
    mask = _padding(1, 70, device, full_row=False)
    out, lse = attention(q, k, v, True, None, mask, return_lse=True)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    leaves_lp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref64, lse64 = reference.attention(*leaves64, True, None, mask, return_lse=True)
    base, base_lse = reference.attention(*leaves_lp, True, None, mask, return_lse=True,
                                         compute_dtype=_baseline_dtype(dtype))
    w = randn(*lse.shape, dtype=torch.float32, device=device)

    def loss(o, l):
        return o.float().sum() + (l.float() * w).sum()

    g = torch.autograd.grad(loss(out, lse), (q, k, v))
    g64 = torch.autograd.grad(loss(ref64, lse64), leaves64)
    gb = torch.autograd.grad(loss(base, base_lse), leaves_lp)
    for name, a, r, b in zip(("dq", "dk", "dv"), g, g64, gb):
        assert_close(name, a, r, b, atol=_atol(dtype))
    assert launches["attention_bwd_preprocess"] == 1


def test_fully_masked_rows_are_zero_with_finite_grads(device, launches):
    """No visible key (padding + Lq > Lk causal): out 0, LSE -inf, grads 0 and finite."""
    q, k, v = _qkv(2, 2, 1, 40, 9, 16, torch.bfloat16, device)
    mask = torch.zeros(2, 9, dtype=torch.bool, device=device)
    mask[1] = True
    out, lse = attention(q, k, v, True, None, mask, return_lse=True)
    assert torch.all(out[1] == 0) and torch.all(out[0, :, :31] == 0)
    assert torch.all(lse[1] == float("-inf")) and torch.all(torch.isfinite(lse[0, :, 31:]))
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    for g in (dq, dk, dv):
        assert torch.all(torch.isfinite(g))
    assert torch.all(dq[1] == 0) and torch.all(dk[1] == 0) and torch.all(dv[1] == 0)
    assert torch.all(dq[0, :, :31] == 0)


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------

def _seeded(seed_value, dropout_p, device):
    """The seed tensor ``attention`` draws after ``torch.manual_seed(seed_value)``."""
    torch.manual_seed(seed_value)
    return _backend.dropout_seed(dropout_p, device)


def test_dropout_keep_statistics(device, launches):
    """Keep rate 1 - p overall, per head and per row/column; heads and seeds differ."""
    p = 0.3
    seed = _seeded(1, p, device)
    keep = kernels.dropout_keep_mask(seed, 2, 3, 64, 200, p, device).float()
    n = keep.numel()
    assert abs(keep.mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    per_head = keep.mean(dim=(2, 3))
    assert torch.all((per_head - (1 - p)).abs() < 4 * math.sqrt(p * (1 - p) / (64 * 200)))
    # Rows and columns are not copies of each other (counters include both indices).
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert not torch.equal(keep[0, 0, :, 0], keep[0, 0, :, 1])
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    other = kernels.dropout_keep_mask(_seeded(2, p, device), 2, 3, 64, 200, p, device).float()
    assert (keep != other).float().mean().item() > 0.3
    assert launches["attention_dropout_mask"] == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_reference_with_the_same_mask(dtype, device, launches):
    """Forward and backward equal the reference given the kernels' own keep mask: the
    backward regenerates exactly the forward's mask. GQA 4:2, causal, padding."""
    p, B, Hq, Hkv, Lq, Lk, D = 0.25, 2, 4, 2, 40, 70, 32
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    mask = _padding(B, Lk, device, full_row=False)
    seed = _seeded(7, p, device)
    keep = kernels.dropout_keep_mask(seed, B, Hq, Lq, Lk, p, device)
    torch.manual_seed(7)
    out, lse = attention(q, k, v, True, None, mask, p, return_lse=True)
    _compare(q, k, v, True, mask, p, dropout_mask=keep, out=out, lse=lse)
    assert launches["attention_fwd"] == 1 and launches["attention_bwd_dkdv"] >= 1


def test_dropout_same_seed_same_result(device, launches):
    p = 0.5
    q, k, v = _qkv(1, 2, 2, 33, 65, 16, torch.float16, device)
    torch.manual_seed(3)
    a = attention(q, k, v, dropout_p=p)
    ga = torch.autograd.grad(a.float().sum(), (q, k, v))
    torch.manual_seed(3)
    b = attention(q, k, v, dropout_p=p)
    gb = torch.autograd.grad(b.float().sum(), (q, k, v))
    torch.manual_seed(4)
    c = attention(q, k, v, dropout_p=p)
    assert torch.equal(a, b)
    for x, y in zip(ga, gb):
        assert torch.equal(x, y)
    assert not torch.equal(a, c)
    assert launches["attention_fwd"] == 3


def test_dropout_is_unbiased(device, launches):
    """Averaged over seeds, dropout's output approaches the output without dropout."""
    q, k, v = _qkv(1, 1, 1, 8, 64, 16, torch.float32, device)
    plain = attention(q, k, v)
    mean = torch.stack([attention(q, k, v, dropout_p=0.5) for _ in range(40)]).mean(0)
    # Each entry averages 40 x 64 Bernoulli-weighted terms; the spread is about 0.06.
    assert (mean - plain).abs().mean().item() < 0.05


def test_backward_is_deterministic(device, launches):
    """No atomics: two backward passes are bitwise equal (GQA sums over heads in-kernel)."""
    q, k, v = _qkv(1, 4, 1, 70, 70, 32, torch.bfloat16, device)
    out = attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ---------------------------------------------------------------------------------------------

def test_opcheck(device):
    q, k, v = _qkv(1, 2, 1, 17, 33, 16, torch.float16, device)
    mask = _padding(1, 33, device, full_row=False)
    seed = _seeded(0, 0.2, device)
    # Autograd registration is checked with dropout; fake tensors also without it.
    torch.library.opcheck(torch.ops.fused_block.attention_fwd.default, (q, k, v, mask, seed, True, 0.25, 0.2))
    torch.library.opcheck(torch.ops.fused_block.attention_fwd.default, (q, k, v, None, seed[:0], False, 0.25, 0.0),
                          test_utils=("test_schema", "test_faketensor"))
    with torch.no_grad():
        out, lse = torch.ops.fused_block.attention_fwd(q, k, v, mask, seed, True, 0.25, 0.2)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fused_block.attention_bwd.default,
                          (dout, q, k, v, out, lse, None, mask, seed, True, 0.25, 0.2),
                          test_utils=("test_schema", "test_faketensor"))
    # Strided views of one fused QKV buffer (B, L, 3, H, D): the fake gradients' strides must
    # match the kernels' (contiguous) ones, or compiled backward graphs break.
    qkv = torch.randn(1, 17, 3, 2, 16, device=device).to(torch.float16)
    qs, ks, vs = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    with torch.no_grad():
        out, lse = torch.ops.fused_block.attention_fwd(qs, ks, vs, None, seed[:0], False, 0.25, 0.0)
    torch.library.opcheck(torch.ops.fused_block.attention_bwd.default,
                          (torch.randn_like(out), qs, ks, vs, out, lse, None, None, seed[:0], False, 0.25, 0.0),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph(device, launches):
    q, k, v = _qkv(1, 2, 1, 17, 33, 16, torch.bfloat16, device)
    mask = _padding(1, 33, device, full_row=False)

    def f(q, k, v, mask):
        out, lse = attention(q, k, v, True, None, mask, return_lse=True)
        return out.float().sum() + lse[torch.isfinite(lse)].sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, mask)
    g_got = torch.autograd.grad(got, (q, k, v))
    want = f(q, k, v, mask)
    g_want = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd_dq"] == 2  # D = 16: one chunk


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def _bad_cases(device):
    def t(*shape, dtype=torch.float16):
        return torch.zeros(*shape, dtype=dtype, device=device)

    q, k, v = t(2, 4, 8, 64), t(2, 2, 16, 64), t(2, 2, 16, 64)
    return [
        ((q, k[:1], v[:1]), {}, ValueError, "k must have shape"),
        ((q, t(2, 2, 16, 32), v), {}, ValueError, "k must have shape"),
        ((q, k, t(2, 2, 15, 64)), {}, ValueError, "v must have shape"),
        ((t(2, 4, 8, 60), t(2, 2, 16, 60), t(2, 2, 16, 60)), {}, ValueError, "head dim"),
        ((t(2, 4, 8, 264), t(2, 2, 16, 264), t(2, 2, 16, 264)), {}, ValueError, "head dim"),
        ((t(2, 4, 8, 8), t(2, 2, 16, 8), t(2, 2, 16, 8)), {}, ValueError, "head dim"),
        ((q, t(2, 3, 16, 64), t(2, 3, 16, 64)), {}, ValueError, "multiple of k's heads"),
        ((q[0], k, v), {}, ValueError, "q must be 4-D"),
        ((q, k.float(), v), {}, TypeError, "k must have q's dtype"),
        ((q.double(), k.double(), v.double()), {}, TypeError, "q must have dtype"),
        ((q, k, v), {"key_padding_mask": t(2, 16, dtype=torch.uint8)}, TypeError, "key_padding_mask must have dtype"),
        ((q, k, v), {"key_padding_mask": t(2, 15, dtype=torch.bool)}, ValueError, "key_padding_mask must have shape"),
        ((q, k, v), {"key_padding_mask": t(16, dtype=torch.bool)}, ValueError, "key_padding_mask must be 2-D"),
        ((q, k, v), {"dropout_p": 1.0}, ValueError, "dropout_p"),
        ((q, k, v), {"dropout_p": -0.1}, ValueError, "dropout_p"),
        ((q, k, v), {"scale": 0.0}, ValueError, "scale"),
        ((q, k, v), {"causal": 1}, TypeError, "causal"),
        ((q.float()[..., :0], k.float(), v.float()), {}, ValueError, "head dim"),
        (([1.0], k, v), {}, TypeError, "q must be a torch.Tensor"),
    ]


@pytest.mark.parametrize("index", range(19))
def test_bad_input(index, device, launches):
    args, kwargs, exc, match = _bad_cases(device)[index]
    with pytest.raises(exc, match=match):
        attention(*args, **kwargs)
    assert launches["attention_fwd"] == 0


def test_fp32_wide_heads_are_refused(device, launches):
    q = torch.zeros(1, 1, 8, 136, dtype=torch.float32, device=device)
    with pytest.raises(TypeError, match="q: fp32 attention kernels take head dims up to 128"):
        attention(q, q, q)
    assert launches["attention_fwd"] == 0


def test_bad_input_device(device, launches):
    if device.type != "cuda":
        pytest.skip("needs a second device type")
    q = torch.zeros(1, 1, 8, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="k is on"):
        attention(q, q.cpu(), q)
