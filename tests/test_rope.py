"""fused_block.rope against the float64 reference: both layouts, both angle sources, every dtype.

Shapes: head dim 32 (rotary over all of it) and 40 with a rotary dim of 24 (partial rotary:
the last 16 dims are copied; 12 pairs are not a power of two, so the pair mask runs); 3 query
heads and 2 key heads (GQA, and head blocks that do not divide); L = 5 tokens. q and k are
views of one packed QKV projection output, as the converted models pass them.
"""
import numpy as np
import pytest
import torch

import fused_block
from fused_block import reference
from numerics import DTYPES, assert_close, randn

B, L, HQ, HK = 2, 5, 3, 2


def _inv_freq(rot, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))


def _qkv(D, dtype, device):
    """q (B, L, HQ, D) and k (B, L, HK, D) as strided views of one (B, L, (HQ + 2 HK) * D) buffer."""
    qkv = randn(B, L, (HQ + 2 * HK) * D, dtype=dtype, device=device)
    q = qkv[..., :HQ * D].unflatten(-1, (HQ, D))
    k = qkv[..., HQ * D:(HQ + HK) * D].unflatten(-1, (HK, D))
    return q, k


def _tables(positions, inv_freq, scale, interleaved, dtype):
    """Hugging Face's cos/sin layout: cat((f, f)) half-split, repeat_interleave(f, 2) interleaved."""
    c, s = reference.rope_cos_sin(positions, inv_freq, scale=scale, dtype=torch.float32)
    if interleaved:
        return c.repeat_interleave(2, -1).to(dtype), s.repeat_interleave(2, -1).to(dtype)
    return torch.cat((c, c), -1).to(dtype), torch.cat((s, s), -1).to(dtype)


def _check(q, k, kw, dtype):
    """Forward and both gradients against float64, with PyTorch's same-dtype error as baseline."""
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    qo, ko = fused_block.rope(q, k, **kw)
    assert qo.is_contiguous() and ko.is_contiguous() and qo.dtype == dtype
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    r64 = reference.rope(q64, k64, **kw)
    qb, kb = (t.detach().clone().requires_grad_() for t in (q, k))
    base = reference.rope(qb, kb, **kw, compute_dtype=dtype)
    for name, a, r, b in zip(("q_out", "k_out"), (qo, ko), r64, base):
        assert_close(name, a, r, b)
    gq, gk = randn(*qo.shape, dtype=dtype, device=q.device), randn(*ko.shape, dtype=dtype, device=q.device)
    got = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    want = torch.autograd.grad(r64, (q64, k64), (gq.double(), gk.double()))
    base_g = torch.autograd.grad(base, (qb, kb), (gq, gk))
    for name, a, r, b in zip(("dq", "dk"), got, want, base_g):
        assert_close(name, a, r, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", ["positions", "table"])
@pytest.mark.parametrize("D, rot", [(32, 32), (40, 24)])
def test_rope_matches_float64(dtype, interleaved, source, D, rot, device, launches):
    q, k = _qkv(D, dtype, device)
    # Per-sequence positions with a cache offset (as when decoding after a prefix).
    positions = (torch.arange(L)[None] + torch.tensor([[3], [40]])).to(device)
    inv_freq, scale = _inv_freq(rot).to(device), 1.25  # scale: HF's attention_scaling (YaRN)
    if source == "positions":
        kw = dict(positions=positions, inv_freq=inv_freq, scale=scale)
    else:
        cos, sin = _tables(positions, inv_freq, scale, interleaved, dtype)
        kw = dict(cos=cos, sin=sin)
    _check(q, k, dict(kw, interleaved=interleaved), dtype)
    assert launches["rope"] == 2  # forward, and one backward launch for dq and dk together


def _tables64(positions, rot, interleaved):
    """Hugging Face's cos/sin layout computed in float64 (angles and cos/sin), as code that
    precomputes its tables in float64 passes them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    f = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
    f = f.repeat_interleave(2, -1) if interleaved else torch.cat((f, f), -1)
    return f.cos(), f.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_float64_tables(dtype, interleaved, device, launches):
    # cos/sin of any float dtype are read in fp32: float64 tables are accepted (rounded to fp32
    # for the kernel) and give the float64 rotation within the dtype's rule. D 40 with a rotary
    # dim of 24 (the partial rotary of test_rope_matches_float64).
    q, k = _qkv(40, dtype, device)
    positions = (torch.arange(L)[None] + torch.tensor([[3], [40]])).to(device)
    cos, sin = _tables64(positions, 24, interleaved)
    _check(q, k, dict(cos=cos, sin=sin, interleaved=interleaved), dtype)
    assert launches["rope"] == 2  # forward, and one backward launch for dq and dk together


def test_broadcast_positions_and_large_offsets(device):
    """(1, L) positions shared by the batch; positions ~ 8k, where fp32 angles lose digits
    exactly as Hugging Face's do (the reference rounds them to fp32 too)."""
    q, k = _qkv(32, torch.float32, device)
    positions = (torch.arange(L)[None] + 8190).to(device)
    _check(q, k, dict(positions=positions, inv_freq=_inv_freq(32).to(device)), torch.float32)


def test_rotation_is_the_identity_at_position_zero_and_preserves_norms(device):
    q, k = _qkv(32, torch.float32, device)
    zero = torch.zeros(1, L, dtype=torch.int64, device=device)
    qo, ko = fused_block.rope(q, k, zero, _inv_freq(32).to(device))
    torch.testing.assert_close(qo, q, atol=0, rtol=0)
    pos = torch.arange(L, device=device)[None] * 7
    qo, ko = fused_block.rope(q, k, pos, _inv_freq(32).to(device), interleaved=True)
    torch.testing.assert_close(qo.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_gradient_of_one_output_only(device, launches):
    """Only k_out used: q gets no gradient (None), k's is right; no zero tensor is materialized."""
    q, k = (t.detach().requires_grad_() for t in _qkv(32, torch.float32, device))
    pos, inv = torch.arange(L, device=device)[None], _inv_freq(32).to(device)
    _, ko = fused_block.rope(q, k, pos, inv)
    g = torch.randn_like(ko)
    ko.backward(g)
    assert q.grad is None
    k64 = k.detach().double().requires_grad_()
    _, r = reference.rope(q.detach().double(), k64, pos, inv)
    r.backward(g.double())
    torch.testing.assert_close(k.grad.double(), k64.grad, atol=1e-5, rtol=0)


def test_opcheck(device):
    q, k = (t.contiguous() for t in _qkv(32, torch.float32, device))
    pos, inv = torch.arange(L, device=device)[None], _inv_freq(32).to(device)
    torch.library.opcheck(torch.ops.fused_block.rope.default, (q, k, pos, inv, None, None, 1.0, 32, False, False))
    cos, sin = _tables(pos, inv, 1.0, True, torch.float32)
    torch.library.opcheck(torch.ops.fused_block.rope.default, (q, k, None, None, cos, sin, 1.0, 32, True, True))


def test_torch_compile_fullgraph(device, launches):
    q, k = (t.detach().requires_grad_() for t in _qkv(32, torch.float32, device))
    pos, inv = torch.arange(L, device=device)[None], _inv_freq(32).to(device)

    def step(q, k):
        qo, ko = fused_block.rope(q, k, pos, inv)
        return qo.square().sum() + ko.sum()

    eager = torch.autograd.grad(step(q, k), (q, k))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k), (q, k))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)
    assert launches["rope"] >= 4


@pytest.mark.parametrize("op", ["rope", "rope_qkvpacked"])
def test_torch_compile_dynamic_fullgraph(device, launches, op):
    """torch.compile(dynamic=True, fullgraph=True) over two batch and sequence sizes, equal to
    eager. The scale checks used math.isfinite, which Dynamo cannot trace under dynamic=True
    even for the constant default scale: an Unsupported error with fullgraph=True (a graph
    break without it). Head dim 16 (qkvpacked: 4 query and 2 KV heads), the smallest."""
    inv = _inv_freq(16).to(device)

    def step(x, pos):
        if op == "rope":
            qo, ko = fused_block.rope(x[:, :, :4], x[:, :, 4:6], pos, inv)
            return qo.square().sum() + ko.sum()
        return fused_block.rope_qkvpacked(x.flatten(2), 4, 2, pos, inv).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=True, fullgraph=True, backend="aot_eager")
    for b, n in ((2, 5), (3, 7)):
        x = torch.randn(b, n, 8, 16, device=device, requires_grad=True)
        pos = torch.arange(n, device=device).expand(b, n).contiguous()
        got = torch.autograd.grad(compiled(x, pos), x)[0]
        torch.testing.assert_close(got, torch.autograd.grad(step(x, pos), x)[0])
    assert launches[op] >= 4  # forward and backward, compiled and eager, at each size


def test_bad_inputs_name_the_argument(device, launches):
    q, k = _qkv(32, torch.float32, device)
    pos, inv = torch.arange(L, device=device)[None], _inv_freq(32).to(device)
    cos, sin = _tables(pos, inv, 1.0, False, torch.float32)
    cases = [
        (dict(q=q[0]), ValueError, "q must be 4-D"),
        (dict(k=k.to(torch.bfloat16)), TypeError, "k must have q's dtype"),
        (dict(k=k[:, :3]), ValueError, "k must have shape"),
        (dict(positions=pos.float()), TypeError, "positions must have dtype"),
        (dict(positions=pos[:, :3]), ValueError, "positions must have shape"),
        (dict(inv_freq=inv.double()), TypeError, "inv_freq must have dtype"),
        (dict(inv_freq=torch.cat((inv, inv))), ValueError, "inv_freq must have between"),
        (dict(cos=cos, sin=sin), ValueError, "exactly one pair"),
        (dict(positions=None, inv_freq=None), ValueError, "exactly one pair"),
        (dict(positions=None, inv_freq=None, cos=cos[..., :5], sin=sin[..., :5]), ValueError, "cos: the rotary dim"),
        (dict(positions=None, inv_freq=None, cos=cos, sin=sin[:, :2]), ValueError, "sin must have shape"),
        (dict(positions=None, inv_freq=None, cos=cos, sin=sin, scale=0.5), ValueError, "scale applies to angles"),
        (dict(scale=0.0), ValueError, "scale must be > 0"),
        (dict(interleaved=1), TypeError, "interleaved must be a bool"),
        (dict(inv_freq=inv.clone().requires_grad_()), ValueError, "inv_freq: no gradient"),
    ]
    for override, exc, match in cases:
        kw = dict(q=q, k=k, positions=pos, inv_freq=inv)
        kw.update(override)
        with pytest.raises(exc, match=match):
            fused_block.rope(kw.pop("q"), kw.pop("k"), **kw)
    assert launches["rope"] == 0


# ---------------------------------------------------------------------------------------------
# rope_qkvpacked: the packed QKV projection output in, one packed tensor out
# ---------------------------------------------------------------------------------------------

def _packed(D, dtype, device, layout):
    """qkv (B, L, (HQ + 2 HK) * D) in one of the layouts the layers hand over: "batch_first"
    (a projection's contiguous output), "seq_first" ((L, B, ...), batch_first=False), or
    "strided" (batch-first rows of a wider buffer: batch and sequence strides that are not
    the row length)."""
    width = (HQ + 2 * HK) * D
    if layout == "seq_first":
        return randn(L, B, width, dtype=dtype, device=device), False
    if layout == "strided":
        return randn(L, B, width + 8, dtype=dtype, device=device).transpose(0, 1)[..., 4:4 + width], True
    return randn(B, L, width, dtype=dtype, device=device), True


def _angle_kwargs(source, rot, interleaved, dtype, device):
    inv_freq, scale = _inv_freq(rot).to(device), 1.25
    positions = (torch.arange(L)[None] + torch.tensor([[3], [40]])).to(device)
    if source == "index":  # positions 0..L-1, as the layers' own RoPE
        return dict(inv_freq=inv_freq, scale=scale)
    if source == "positions":
        return dict(positions=positions, inv_freq=inv_freq, scale=scale)
    cos, sin = _tables(positions, inv_freq, scale, interleaved, dtype)
    return dict(cos=cos, sin=sin)


# Every dtype meets every angle source and every layout; the interleaved layout and the
# partial rotary (D 40, rotary 24: 16 copied dims, 12 pairs, not a power of two) alternate
# so that each meets every source and layout too.
PACKED_CASES = [(dtype, source, layout, (i % 2 == 1), ((40, 24) if i % 3 == 0 else (32, 32)))
                for i, (dtype, source, layout) in enumerate(
                    (d, s, lay) for d in DTYPES for s in ("index", "positions", "table")
                    for lay in ("batch_first", "seq_first", "strided"))]


@pytest.mark.parametrize("dtype, source, layout, interleaved, dims", PACKED_CASES)
def test_rope_qkvpacked_matches_float64(dtype, source, layout, interleaved, dims, device, launches):
    D, rot = dims
    qkv, batch_first = _packed(D, dtype, device, layout)
    qkv = qkv.detach().requires_grad_()
    kw = dict(_angle_kwargs(source, rot, interleaved, dtype, device), interleaved=interleaved,
              batch_first=batch_first)
    out = fused_block.rope_qkvpacked(qkv, HQ, HK, **kw)
    assert out.shape == qkv.shape and out.is_contiguous() and out.dtype == dtype
    x64 = qkv.detach().double().requires_grad_()
    r64 = reference.rope_qkvpacked(x64, HQ, HK, **kw)
    xb = qkv.detach().clone().requires_grad_()
    base = reference.rope_qkvpacked(xb, HQ, HK, **kw, compute_dtype=dtype)
    assert_close("out", out, r64, base)
    v = slice((HQ + HK) * D, None)
    assert torch.equal(out[..., v], qkv[..., v])  # v is copied bit for bit
    g = randn(*out.shape, dtype=dtype, device=device)
    (got,) = torch.autograd.grad(out, qkv, g)
    (want,) = torch.autograd.grad(r64, x64, g.double())
    (base_g,) = torch.autograd.grad(base, xb, g)
    assert_close("dqkv", got, want, base_g)
    assert torch.equal(got[..., v], g[..., v])
    assert launches["rope_qkvpacked"] == 2 and launches["rope"] == 0  # one launch each way


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkvpacked_float64_tables(dtype, device, launches):
    # rope_qkvpacked's tables as rope's: float64 accepted, read in fp32 (the batch-first layout,
    # D 40 with a rotary dim of 24, half-split).
    qkv, batch_first = _packed(40, dtype, device, "batch_first")
    qkv = qkv.detach().requires_grad_()
    positions = (torch.arange(L)[None] + torch.tensor([[3], [40]])).to(device)
    cos, sin = _tables64(positions, 24, False)
    out = fused_block.rope_qkvpacked(qkv, HQ, HK, cos=cos, sin=sin)
    x64 = qkv.detach().double().requires_grad_()
    r64 = reference.rope_qkvpacked(x64, HQ, HK, cos=cos, sin=sin)
    xb = qkv.detach().clone().requires_grad_()
    base = reference.rope_qkvpacked(xb, HQ, HK, cos=cos, sin=sin, compute_dtype=dtype)
    assert_close("out", out, r64, base)
    g = randn(*out.shape, dtype=dtype, device=device)
    (got,) = torch.autograd.grad(out, qkv, g)
    (want,) = torch.autograd.grad(r64, x64, g.double())
    (base_g,) = torch.autograd.grad(base, xb, g)
    assert_close("dqkv", got, want, base_g)
    assert launches["rope_qkvpacked"] == 2  # one launch each way


def test_rope_qkvpacked_equals_rope_on_views(device):
    """The packed kernel and the split one rotate q and k alike (GQA heads, partial rotary), so
    either path gives the attention kernel the same inputs: the copied dims are equal, and each
    rotated pair (x1 cos - x2 sin, x2 cos + x1 sin) agrees to within fp32 rounding of its terms,
    4 eps (|x1| + |x2|). Not bit for bit on every device: the interpreter's numpy rounds each
    product, a GPU compile contracts one product and the sum into an FMA wherever its
    instruction selection finds one (an ulp apart in 9% of the elements on an H200)."""
    rot = 24
    qkv, _ = _packed(40, torch.float32, device, "batch_first")
    pos, inv = (torch.arange(L)[None] + 7).to(device), _inv_freq(rot).to(device)
    out = fused_block.rope_qkvpacked(qkv, HQ, HK, pos, inv).unflatten(-1, (HQ + 2 * HK, 40))
    q, k = fused_block.rope(qkv[..., :HQ * 40].unflatten(-1, (HQ, 40)),
                            qkv[..., HQ * 40:(HQ + HK) * 40].unflatten(-1, (HK, 40)), pos, inv)
    x = qkv.unflatten(-1, (HQ + 2 * HK, 40))[:, :, :HQ + HK]
    half = rot // 2
    pair = x[..., :half].abs() + x[..., half:rot].abs()  # |x1| + |x2| of each rotated pair
    bound = 4 * torch.finfo(torch.float32).eps * torch.cat((pair, pair), -1)
    for got, want, b in ((out[:, :, :HQ], q, bound[:, :, :HQ]), (out[:, :, HQ:HQ + HK], k, bound[:, :, HQ:])):
        assert torch.equal(got[..., rot:], want[..., rot:])  # the partial rotary's copied dims
        excess = (got[..., :rot] - want[..., :rot]).abs() - b
        assert excess.max() <= 0, f"a rotated element differs by {excess.max().item():.3e} beyond its bound"
    assert torch.equal(out[:, :, HQ + HK:], qkv.unflatten(-1, (HQ + 2 * HK, 40))[:, :, HQ + HK:])  # v


def test_rope_qkvpacked_opcheck_and_compile(device, launches):
    qkv, _ = _packed(32, torch.float32, device, "batch_first")
    inv = _inv_freq(32).to(device)
    op = torch.ops.fused_block.rope_qkvpacked.default
    torch.library.opcheck(op, (qkv, None, inv, None, None, HQ + HK, HQ + 2 * HK, True, 1.0, 32, False, False))
    cos, sin = _tables(torch.arange(L, device=device)[None], inv, 1.0, True, torch.float32)
    torch.library.opcheck(op, (qkv.transpose(0, 1).contiguous(), None, None, cos, sin, HQ + HK, HQ + 2 * HK, False,
                               1.0, 32, True, True))
    x = qkv.detach().requires_grad_()

    def step(x):
        return fused_block.rope_qkvpacked(x, HQ, HK, inv_freq=inv).square().sum()

    eager = torch.autograd.grad(step(x), x)[0]
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(x), x)[0]
    torch.testing.assert_close(compiled, eager)
    assert launches["rope_qkvpacked"] >= 4


def test_rope_qkvpacked_bad_inputs_name_the_argument(device, launches):
    qkv, _ = _packed(32, torch.float32, device, "batch_first")
    inv = _inv_freq(32).to(device)
    pos = torch.arange(L, device=device)[None]
    cases = [
        (dict(qkv=qkv[0]), ValueError, "qkv must be 3-D"),
        (dict(qkv=qkv.double()), TypeError, "qkv must have dtype"),
        (dict(qkv=qkv[..., :-1]), ValueError, r"qkv's last dim \(223\)"),
        (dict(num_heads=2.0), TypeError, "num_heads must be an int"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be positive"),
        (dict(batch_first=1), TypeError, "batch_first must be a bool"),
        (dict(positions=pos[:, :3]), ValueError, "positions must have shape"),
        (dict(batch_first=False, positions=pos), ValueError, r"positions must have shape \(5 or 1, 2\)"),
        (dict(inv_freq=None), ValueError, "pass either inv_freq"),
        (dict(inv_freq=torch.cat((inv, inv))), ValueError, "inv_freq must have between"),
        (dict(scale=float("inf")), ValueError, "scale must be finite"),
        (dict(inv_freq=None, cos=torch.ones(1, L, 32, device=device), sin=torch.zeros(1, L, 32, device=device),
              scale=2.0), ValueError, "scale applies to angles"),
    ]
    for override, exc, match in cases:
        kw = dict(qkv=qkv, num_heads=HQ, num_kv_heads=HK, inv_freq=inv)
        kw.update(override)
        with pytest.raises(exc, match=match):
            fused_block.rope_qkvpacked(kw.pop("qkv"), kw.pop("num_heads"), kw.pop("num_kv_heads"), **kw)
    assert launches["rope_qkvpacked"] == 0


# ---------------------------------------------------------------------------------------------
# rope_qkvpacked with per-head RMSNorm of q and k first (Qwen3's q_norm / k_norm)
# ---------------------------------------------------------------------------------------------

# Each dtype meets each angle source; the layouts and the partial rotary alternate. The last
# case has 12 + 8 heads of 256: BLOCK_H is 16 there, so the first head block holds q and k
# heads and the second k heads and 12 masked ones (the weight gradient's per-block rows).
QKNORM_CASES = [(dtype, source, layout, (40, 24) if i % 2 else (32, 32), (HQ, HK))
                for i, (dtype, source, layout) in enumerate(
                    (d, s, lay) for d in DTYPES for s, lay in (("index", "batch_first"), ("positions", "strided"),
                                                               ("table", "seq_first")))]
QKNORM_CASES.append((torch.float32, "positions", "batch_first", (256, 256), (12, 8)))


# Gemma 3's q_norm / k_norm: the weights are offsets from 1 (scaled by 1 + w); one case per
# dtype (the first three: index, positions and table angles), weights near 0.
QKNORM_CASES_OFFSET = [c + (True,) for c in QKNORM_CASES[:3]]


@pytest.mark.parametrize("dtype, source, layout, dims, heads, offset",
                         [c + (False,) for c in QKNORM_CASES] + QKNORM_CASES_OFFSET)
def test_rope_qkvpacked_qk_norm_matches_float64(dtype, source, layout, dims, heads, offset, device, launches):
    """The output and the gradients of qkv and both norm weights against float64."""
    D, rot = dims
    hq, hk = heads
    width = (hq + 2 * hk) * D
    if heads == (HQ, HK):
        qkv, batch_first = _packed(D, dtype, device, layout)
    else:
        qkv, batch_first = randn(1, 2, width, dtype=dtype, device=device), True
    qkv = qkv.detach().requires_grad_()
    wq, wk = ((randn(D, dtype=dtype, device=device) * 0.3 + (0 if offset else 1)).requires_grad_() for _ in range(2))
    kw = dict(_angle_kwargs(source, rot, False, dtype, device), batch_first=batch_first, norm_eps=1e-6,
              norm_unit_offset=offset)
    if heads != (HQ, HK):
        kw.pop("positions")  # (B, L) = (1, 2): the token index
    out = fused_block.rope_qkvpacked(qkv, hq, hk, q_norm_weight=wq, k_norm_weight=wk, **kw)
    assert out.shape == qkv.shape and out.is_contiguous() and out.dtype == dtype
    inputs64 = [t.detach().double().requires_grad_() for t in (qkv, wq, wk)]
    inputs = [t.detach().clone().requires_grad_() for t in (qkv, wq, wk)]
    r64 = reference.rope_qkvpacked(inputs64[0], hq, hk, q_norm_weight=inputs64[1], k_norm_weight=inputs64[2], **kw)
    base = reference.rope_qkvpacked(inputs[0], hq, hk, q_norm_weight=inputs[1], k_norm_weight=inputs[2], **kw,
                                    compute_dtype=dtype)
    assert_close("out", out, r64, base)
    v = slice((hq + hk) * D, None)
    assert torch.equal(out[..., v], qkv[..., v])
    g = randn(*out.shape, dtype=dtype, device=device)
    got = torch.autograd.grad(out, (qkv, wq, wk), g)
    want = torch.autograd.grad(r64, inputs64, g.double())
    base_g = torch.autograd.grad(base, inputs, g)
    for name, a, r, b in zip(("dqkv", "dq_norm_weight", "dk_norm_weight"), got, want, base_g):
        assert a.dtype == dtype
        assert_close(name, a, r, b)
    assert launches["rope_qknorm"] == 2 and launches["rope_qkvpacked"] == 0  # one launch each way


def test_rope_qkvpacked_qk_norm_opcheck_and_compile(device, launches):
    qkv, _ = _packed(32, torch.float32, device, "batch_first")
    inv = _inv_freq(32).to(device)
    wq, wk = (randn(32, dtype=torch.float32, device=device) + 1 for _ in range(2))
    args = (None, inv, None, None, HQ, HQ + HK, HQ + 2 * HK, True, 1.0, 32, False, 1e-6, True)
    torch.library.opcheck(torch.ops.fused_block.rope_qkvpacked_qknorm.default, (qkv, wq, wk) + args)
    grad = randn(*qkv.shape, dtype=torch.float32, device=device)
    torch.library.opcheck(torch.ops.fused_block.rope_qkvpacked_qknorm_bwd.default, (grad, qkv, wq, wk) + args)
    x, wq, wk = (t.detach().requires_grad_() for t in (qkv, wq, wk))

    def step(x, wq, wk):
        return fused_block.rope_qkvpacked(x, HQ, HK, inv_freq=inv, q_norm_weight=wq, k_norm_weight=wk).square().sum()

    eager = torch.autograd.grad(step(x, wq, wk), (x, wq, wk))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(x, wq, wk), (x, wq, wk))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    assert launches["rope_qknorm"] >= 4


def test_rope_qkvpacked_qk_norm_bad_inputs_name_the_argument(device, launches):
    qkv, _ = _packed(32, torch.float32, device, "batch_first")
    inv = _inv_freq(32).to(device)
    w = torch.ones(32, device=device)
    cases = [
        (dict(q_norm_weight=w), ValueError, "pass both q_norm_weight and k_norm_weight"),
        (dict(q_norm_weight=w, k_norm_weight=w[:16]), ValueError, r"k_norm_weight must have shape \(32,\)"),
        (dict(q_norm_weight=w[None], k_norm_weight=w), ValueError, "q_norm_weight must be 1-D"),
        (dict(q_norm_weight=w.long(), k_norm_weight=w), TypeError, "q_norm_weight must have dtype"),
        # 0 too (torch's rms_norm takes it): the kernel's padding heads would put NaN in the weights' gradients
        (dict(q_norm_weight=w, k_norm_weight=w, norm_eps=0.0), ValueError, "norm_eps must be > 0"),
        (dict(q_norm_weight=w, k_norm_weight=w, norm_eps=float("nan")), ValueError, "norm_eps must be > 0"),
        (dict(q_norm_weight=w, k_norm_weight=w, norm_eps=np.bool_(True)), TypeError,
         "norm_eps must be a number, got numpy.bool"),
        (dict(q_norm_weight=w, k_norm_weight=w, norm_eps=float("inf")), ValueError, "norm_eps must be finite"),
    ]
    for override, exc, match in cases:
        with pytest.raises(exc, match=match):
            fused_block.rope_qkvpacked(qkv, HQ, HK, inv_freq=inv, **override)
    assert launches["rope_qknorm"] == 0
