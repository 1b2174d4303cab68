"""Autograd beyond one backward (found by fuzzing).

- Second derivatives: every op's backward runs Triton kernels and has no derivative of its
  own. Under ``create_graph=True`` (a gradient penalty, double backward,
  ``torch.autograd.functional.hvp``) the first gradients come back, and differentiating them
  again raises a RuntimeError naming the op, instead of a gradient whose graph is silently
  missing (a gradient penalty through a converted layer was dropped). Without
  ``create_graph`` nothing changes (every other test).
- torch.func transforms (``grad``, ``vmap``): the ops run the PyTorch reference under them and
  a converted layer its original forward, so the transform's answer is torch's (they raised
  torch's internal errors); batched gradients through a kernel's backward (``jacobian`` with
  ``vectorize=True``) are a RuntimeError naming the op.
"""
import copy

import pytest
import torch
from torch import nn

import fused_block
from fused_block import reference
from fused_block.linear import gated_linear
from numerics import randn

F32 = torch.float32
MESSAGE = "has no derivative of its own"


def _w(n, k, device):
    return randn(n, k, dtype=F32, device=device, scale=k ** -0.5, requires_grad=True)


def _ops(device):
    """(Function, a kernel its backward launches, call, leaves) for each autograd Function of the ops."""
    x = randn(2, 4, 16, dtype=F32, device=device, requires_grad=True)
    r = randn(2, 4, 16, dtype=F32, device=device, requires_grad=True)
    w16, b16 = randn(16, dtype=F32, device=device, requires_grad=True), randn(16, dtype=F32, device=device,
                                                                               requires_grad=True)
    w, w1, w2 = _w(8, 16, device), _w(24, 16, device), _w(16, 24, device)
    q, k, v = (randn(1, 2, 8, 16, dtype=F32, device=device, requires_grad=True) for _ in range(3))
    qkv = randn(1, 8, 64, dtype=F32, device=device, requires_grad=True)
    rq, rk = randn(1, 8, 2, 16, dtype=F32, device=device, requires_grad=True), randn(1, 8, 2, 16, dtype=F32,
                                                                                     device=device, requires_grad=True)
    positions = torch.arange(8, device=device)[None]
    inv_freq = 10000.0 ** -(torch.arange(0, 16, 2, device=device, dtype=F32) / 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    tq, tk, tv = (randn(8, 2, 16, dtype=F32, device=device, requires_grad=True) for _ in range(3))
    tqkv = randn(8, 64, dtype=F32, device=device, requires_grad=True)
    target = torch.randint(0, 8, (8,), device=device)
    h = randn(8, 16, dtype=F32, device=device, requires_grad=True)
    qn, kn = (randn(16, dtype=F32, device=device, requires_grad=True) for _ in range(2))
    return [
        ("_AddNorm", "add_norm_bwd", lambda: fused_block.add_layer_norm(x, r, w16, b16)[0], (x, r, w16, b16)),
        ("_LinearFn", "matmul", lambda: fused_block.linear(x, w, None, "gelu"), (x, w)),
        ("_GatedFn", "matmul", lambda: gated_linear(x, w1, w1.detach().clone().requires_grad_()), (x, w1)),
        ("_FFNFn", "matmul", lambda: fused_block.mlp(x, w1, None, w2, None), (x, w1, w2)),
        ("_Attention", "attention_bwd", lambda: fused_block.attention(q, k, v, causal=True), (q, k, v)),
        ("_PackedAttention", "attention_bwd", lambda: fused_block.attention_qkvpacked(qkv, 2, 1, causal=True), (qkv,)),
        ("_VarlenAttention", "attention_bwd", lambda: fused_block.attention_varlen(tq, tk, tv, cu, cu, 5, 5, causal=True),
         (tq, tk, tv)),
        ("_VarlenPackedAttention", "attention_bwd", lambda: fused_block.attention_varlen_qkvpacked(tqkv, cu, 5, 2, 1), (tqkv,)),
        ("_RoPE", "rope", lambda: fused_block.rope(rq, rk, positions, inv_freq)[0], (rq,)),
        ("_RoPEPacked", "rope_qkvpacked", lambda: fused_block.rope_qkvpacked(qkv, 2, 1, None, inv_freq), (qkv,)),
        ("_RoPEPackedQKNorm", "rope_qknorm", lambda: fused_block.rope_qkvpacked(qkv, 2, 1, None, inv_freq, q_norm_weight=qn,
                                                                 k_norm_weight=kn), (qkv, qn, kn)),
        ("_LCEFn", "lce_ce", lambda: fused_block.linear_cross_entropy(h, w, target), (h, w)),
    ]


@pytest.mark.parametrize("index", range(12))
def test_a_second_derivative_through_an_op_raises(index, device, launches):
    name, kernel, fn, leaves = _ops(device)[index]
    out = fn()
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out), create_graph=True)
    assert all(g is not None and g.requires_grad for g in grads)
    penalty = sum((g ** 2).sum() for g in grads)
    with pytest.raises(RuntimeError, match=f"backward of {name} .*{MESSAGE}"):
        penalty.backward()
    # the same call without create_graph: plain gradients, no graph
    out = fn()
    assert not any(g.requires_grad for g in torch.autograd.grad(out, leaves, torch.ones_like(out)))
    assert launches[kernel] >= 2  # the kernels ran, both times


def test_a_gradient_penalty_through_a_converted_layer_raises(device, launches):
    layer = fused_block.convert(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)).to(device)
    x = randn(2, 8, 32, dtype=F32, device=device, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=MESSAGE):
        (gx ** 2).sum().backward()
    # float64 runs the PyTorch reference: there the penalty's gradient exists
    ref = copy.deepcopy(layer).double()
    x64 = x.detach().double().requires_grad_()
    (gx,) = torch.autograd.grad(ref(x64).sum(), x64, create_graph=True)
    (gx ** 2).sum().backward()
    assert ref.linear1.weight.grad is not None and float(ref.linear1.weight.grad.abs().max()) > 0
    assert launches["attention_fwd"] == 1


def test_torch_func_transforms_get_torchs_answer(device, launches):
    """torch.func.grad of a converted layer through functional_call, and vmap of a layer and
    of an op, equal the torch layer's and F.linear's (the reference path and the original
    forward run under the transform: no kernel launch)."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    base = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True).to(device).eval()
    layer = fused_block.convert(copy.deepcopy(base))
    x = randn(2, 8, 32, dtype=F32, device=device)

    def loss(params, m):
        return functional_call(m, params, (x,)).pow(2).sum()

    with pytest.warns(UserWarning, match="torch.func transform"):
        got = grad(loss)(dict(layer.named_parameters()), layer)
    want = grad(loss)(dict(base.named_parameters()), base)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5)
    xs = randn(3, 2, 8, 32, dtype=F32, device=device)
    torch.testing.assert_close(vmap(layer)(xs), vmap(base)(xs), atol=1e-5, rtol=1e-5)
    w = _w(16, 32, device).detach()
    torch.testing.assert_close(vmap(lambda a: fused_block.linear(a, w, None, "gelu"))(xs),
                               vmap(lambda a: reference.linear(a, w, None, "gelu"))(xs), atol=0, rtol=0)
    assert launches["attention_fwd"] == 0 and launches["matmul"] == 0


def test_batched_gradients_through_a_kernel_raise(device, launches):
    w = _w(16, 32, device)
    x = randn(4, 32, dtype=F32, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="backward of _LinearFn .*no batched gradients"):
        torch.autograd.functional.jacobian(lambda a: fused_block.linear(a, w, None, "gelu"), x, vectorize=True)
    jac = torch.autograd.functional.jacobian(lambda a: fused_block.linear(a, w, None, "gelu"), x)
    want = torch.autograd.functional.jacobian(lambda a: reference.linear(a, w.double(), None, "gelu"),
                                              x.detach().double())
    torch.testing.assert_close(jac.double(), want, atol=1e-4, rtol=1e-4)
    assert launches["matmul"] > 0
