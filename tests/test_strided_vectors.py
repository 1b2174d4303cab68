"""Vectors and tables that the kernels index at unit stride (``kernels.common.unit``): a bias,
a norm weight, a frequency table, cos/sin tables or sequence offsets given as a strided view
(``base[::2]``) or an expanded one (stride 0) are read as the tensors they are, not as the
memory under their pointers. Each op against the float64 reference, every gradient included.
"""
import pytest
import torch

import fused_block
from fused_block import reference
from fused_block.linear import gated_linear

from gemm_testing import check
from numerics import assert_close, randn

F32 = torch.float32
KINDS = ("step", "expanded")


def _vector(n, device, kind, scale=1.0):
    """A leaf (n,) vector requiring grad, laid out as ``kind``: every other element of a
    longer vector, or one element expanded along n (stride 0)."""
    if kind == "step":
        t = randn(2 * n, dtype=F32, device=device, scale=scale)[::2]
    else:
        t = randn(1, dtype=F32, device=device, scale=scale).expand(n)
    assert t.stride(0) != 1
    return t.requires_grad_()


def _w(n, k, device):
    return randn(n, k, dtype=F32, device=device, scale=k ** -0.5, requires_grad=True)


@pytest.mark.parametrize("kind", KINDS)
def test_strided_biases_of_the_gemm_ops(kind, device, launches):
    x = randn(5, 16, dtype=F32, device=device, requires_grad=True)
    w, w1, w2 = _w(8, 16, device), _w(24, 16, device), _w(16, 24, device)
    wg, wu, wd = _w(24, 16, device), _w(24, 16, device), _w(16, 24, device)
    b8, b24, b16 = _vector(8, device, kind), _vector(24, device, kind), _vector(16, device, kind)
    b24u = _vector(24, device, kind)

    check("linear", lambda x, w, b: fused_block.linear(x, w, b, "gelu"),
          lambda x, w, b, compute_dtype=None: reference.linear(x, w, b, "gelu", compute_dtype=compute_dtype),
          (x, w, b8), F32, device)
    check("mlp", lambda x, w1, b1, w2, b2: fused_block.mlp(x, w1, b1, w2, b2, "gelu"),
          lambda x, w1, b1, w2, b2, compute_dtype=None: reference.mlp(x, w1, b1, w2, b2, "gelu",
                                                                      compute_dtype=compute_dtype),
          (x, w1, b24, w2, b16), F32, device)
    check("swiglu", lambda x, wg, wu, wd, bg, bu, bd: fused_block.swiglu(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd),
          lambda x, wg, wu, wd, bg, bu, bd, compute_dtype=None: reference.swiglu(
              x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, compute_dtype=compute_dtype),
          (x, wg, wu, wd, b24, b24u, b16), F32, device)
    check("gated_linear", lambda x, wg, wu, bg, bu: gated_linear(x, wg, wu, bg, bu),
          lambda x, wg, wu, bg, bu, compute_dtype=None: reference.gated(x, wg, wu, bg, bu, compute_dtype=compute_dtype),
          (x, wg, wu, b24, b24u), F32, device)
    assert launches["matmul"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_rope_qkvpacked_strided_frequencies_and_norm_weights(kind, device, launches):
    B, L, D, H, Hkv = 2, 5, 16, 2, 1
    qkv = randn(B, L, (H + 2 * Hkv) * D, dtype=F32, device=device, requires_grad=True)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=F32, device=device) / D)
    inv_strided = torch.stack([inv, torch.zeros_like(inv)], 1).flatten()[::2]  # inv's values, stride 2
    qw, kw = _vector(D, device, kind, scale=0.5), _vector(D, device, kind, scale=0.5)

    def ours(qkv, qw, kw):
        return fused_block.rope_qkvpacked(qkv, H, Hkv, None, inv_strided, q_norm_weight=qw, k_norm_weight=kw)

    def ref(qkv, qw, kw, compute_dtype=None):
        return reference.rope_qkvpacked(qkv, H, Hkv, None, inv.to(F32), q_norm_weight=qw, k_norm_weight=kw,
                                        compute_dtype=compute_dtype)

    check("rope_qkvpacked", ours, ref, (qkv, qw, kw), F32, device)
    assert launches["rope_qknorm"] > 0


def test_rope_tables_with_different_strides(device, launches):
    # cos contiguous, sin a column slice of a wider table: the kernel takes one set of table
    # strides, so the launcher lays both out alike.
    B, L, H, D = 2, 6, 2, 16
    q = randn(B, L, H, D, dtype=F32, device=device, requires_grad=True)
    k = randn(B, L, 1, D, dtype=F32, device=device, requires_grad=True)
    angles = torch.arange(L, dtype=F32, device=device)[:, None] * torch.linspace(0.1, 1.0, D // 2, device=device)
    angles = torch.cat([angles, angles], -1)[None]  # (1, L, D), half-split pairs
    cos = angles.cos()
    sin = torch.cat([angles.sin(), torch.zeros_like(angles)], -1)[..., :D]  # stride (L*2D, 2D, 1)
    assert cos.stride() != sin.stride()

    q1, k1 = fused_block.rope(q, k, cos=cos, sin=sin)
    g1, g2 = torch.randn_like(q1), torch.randn_like(k1)
    dq, dk = torch.autograd.grad((q1, k1), (q, k), (g1, g2))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    r1, r2 = reference.rope(q64, k64, cos=cos.double(), sin=sin.double())
    rq, rk = torch.autograd.grad((r1, r2), (q64, k64), (g1.double(), g2.double()))
    qb, kb = q.detach().requires_grad_(), k.detach().requires_grad_()
    b1, b2 = reference.rope(qb, kb, cos=cos, sin=sin)
    bq, bk = torch.autograd.grad((b1, b2), (qb, kb), (g1, g2))
    for name, a, r, b in (("q", q1, r1, b1), ("k", k1, r2, b2), ("dq", dq, rq, bq), ("dk", dk, rk, bk)):
        assert_close(f"rope {name}", a, r, b)
    assert launches["rope"] == 2


@pytest.mark.parametrize("packed", [False, True], ids=["q-k-v", "qkvpacked"])
def test_varlen_attention_with_strided_cu_seqlens(packed, device, launches):
    # Values [0, 3, 3, 10] (an empty sequence in the middle) at stride 2 over garbage: the
    # kernel must read the offsets, not the memory under the pointer ([0, 99, 3, 99]).
    T, H, D = 10, 2, 16
    cu = torch.tensor([0, 99, 3, 99, 3, 99, 10], dtype=torch.int32, device=device)[::2]
    assert cu.stride(0) == 2
    q, k, v = (randn(T, H, D, dtype=F32, device=device, requires_grad=True) for _ in range(3))
    if packed:
        qkv = torch.cat([q, k, v], 1).reshape(T, 3 * H * D).detach().requires_grad_()  # heads q, k, v
        out = fused_block.attention_varlen_qkvpacked(qkv, cu, 7, H, causal=True).view(T, H, D)
        inputs = (qkv,)
    else:
        out = fused_block.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True)
        inputs = (q, k, v)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, g)
    ins64 = [t.detach().double().requires_grad_() for t in inputs]
    insb = [t.detach().requires_grad_() for t in inputs]

    def ref(ins, compute_dtype=None):
        qq, kk, vv = ins[0].view(T, 3 * H, D).split(H, 1) if packed else ins
        return reference.attention_varlen(qq, kk, vv, cu, cu, causal=True, compute_dtype=compute_dtype)

    r, b = ref(ins64), ref(insb, F32)
    rg, bg = torch.autograd.grad(r, ins64, g.double()), torch.autograd.grad(b, insb, g)
    assert_close("varlen out", out, r, b)
    for i, (a, x, y) in enumerate(zip(grads, rg, bg)):
        assert_close(f"varlen grad {i}", a, x, y)
    assert launches["attention_fwd"] == 1 and launches["attention_bwd"] == 1


def test_kv_cache_append_with_strided_cache_seqlens(device, launches):
    B, H, L, D, n = 3, 2, 8, 16, 2
    k_cache = torch.zeros(B, H, L, D, device=device)
    v_cache = torch.zeros(B, H, L, D, device=device)
    k, v = randn(B, H, n, D, dtype=F32, device=device), randn(B, H, n, D, dtype=F32, device=device)
    seqlens = torch.tensor([1, 99, 5, 99, 0], dtype=torch.int32, device=device)[::2]  # [1, 5, 0]
    fused_block.kv_cache_append(k_cache, v_cache, k, v, seqlens)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for b, start in enumerate(seqlens.tolist()):
        want_k[b, :, start:start + n], want_v[b, :, start:start + n] = k[b], v[b]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert launches["attention_kv_append"] == 1
