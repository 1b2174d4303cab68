"""The plain-PyTorch path (CPU tensors without TRITON_INTERPRET: ``fused_block.reference``)
keeps the ops' documented contracts, as the kernels do: ``residual_out`` is x itself where
nothing changed it, attention's output is laid out in q's memory order, the loss takes any
integer target dtype and returns an LSE without gradient. CPU tensors on every machine."""
import pytest
import torch

import fused_block
from fused_block import _backend
from numerics import randn


@pytest.fixture
def plain(monkeypatch, launches):
    monkeypatch.setattr(_backend, "INTERPRET", False)
    yield
    for name in ("add_norm_fwd", "attention_fwd", "lce_ce"):
        assert launches[name] == 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_residual_out_is_x_itself(plain, dtype, norm):
    x = randn(3, 8, dtype=dtype, device="cpu")
    op = fused_block.add_layer_norm if norm == "layer" else fused_block.add_rms_norm
    _, rout = op(x, None, None)
    assert rout is x
    _, rout = op(x, None, None, residual_in_fp32=True)  # a dtype change for 16-bit x: a tensor of its own
    assert (rout is x) == (dtype == torch.float32) and rout.dtype == torch.float32


def test_attention_output_in_q_memory_order(plain):
    qkv = randn(2, 6, 3, 2, 16, dtype=torch.float32, device="cpu", requires_grad=True)  # (B, L, 3, H, D)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    out = fused_block.attention(q, k, v, True)
    assert out.transpose(1, 2).is_contiguous()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, qkv, g)[0], torch.autograd.grad(want, qkv, g)[0])


@pytest.mark.parametrize("tdtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8], ids=str)
def test_loss_takes_any_integer_target_and_returns_an_lse_without_gradient(plain, tdtype):
    h = randn(6, 16, dtype=torch.float32, device="cpu", requires_grad=True)
    w = randn(10, 16, dtype=torch.float32, device="cpu")
    t = torch.randint(0, 10, (6,))
    loss, lse = fused_block.linear_cross_entropy(h, w, t.to(tdtype), return_lse=True)
    logits = h @ w.T
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, t))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    assert not lse.requires_grad and loss.requires_grad


def test_fp32_head_dims_beyond_the_kernels_are_refused_on_every_path(plain):
    """fp32 attention with a head dim above the kernels' limit raises the kernels' TypeError on
    this path too: a call valid on a CPU is valid on a GPU (the layers fall back before it)."""
    from fused_block.attention import MAX_FP32_HEAD_DIM, attention_qkvpacked, attention_varlen

    D = MAX_FP32_HEAD_DIM + 8
    q = randn(1, 2, 4, D, dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="head dims up to"):
        fused_block.attention(q, q, q)
    with pytest.raises(TypeError, match="head dims up to"):
        attention_qkvpacked(randn(1, 4, 3 * 2 * D, dtype=torch.float32, device="cpu"), 2)
    t = randn(4, 2, D, dtype=torch.float32, device="cpu")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="head dims up to"):
        attention_varlen(t, t, t, cu, cu, 4, 4)
    assert fused_block.attention(q.bfloat16(), q.bfloat16(), q.bfloat16()).shape == q.shape  # 16-bit: any
