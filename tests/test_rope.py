"""fused_block.rope against the float64 reference: both layouts, both angle sources, every dtype.

Shapes: head dim 32 (rotary over all of it) and 40 with a rotary dim of 24 (partial rotary:
the last 16 dims are copied; 12 pairs are not a power of two, so the pair mask runs); 3 query
heads and 2 key heads (GQA, and head blocks that do not divide); L = 5 tokens. q and k are
views of one packed QKV projection output, as the converted models pass them.
"""
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
