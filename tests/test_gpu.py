"""Checks that only a real GPU can make: determinism, >2^31-element tensors, grid limits,
streams and devices, CUDA graph capture, and attention's memory growth.

They run in ``scripts/gpu_check.sh`` (the whole suite on CUDA) whenever a task has a GPU;
on a CPU-only machine they are reported as skipped, never as passed.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import fused_block
from fused_block import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only checks need a CUDA device")

DEV = "cuda"
BF16 = torch.bfloat16


def _rand(*shape, dtype=BF16, scale=1.0, grad=False):
    return (torch.randn(*shape, device=DEV, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


def _grads_twice(make_loss, inputs):
    out = []
    for _ in range(2):
        loss = make_loss()
        out.append(torch.autograd.grad(loss, inputs))
    return out


def _bitwise_equal(a, b):
    return all(torch.equal(x.flatten().view(torch.uint8), y.flatten().view(torch.uint8)) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# determinism: every backward, run twice on the same inputs, gives bitwise-identical gradients
# ---------------------------------------------------------------------------------------------

def _norm_case(norm):
    x, r = _rand(4096, 1024, grad=True), _rand(4096, 1024, grad=True)
    w, b = _rand(1024, dtype=torch.float32, grad=True), _rand(1024, dtype=torch.float32, grad=True)
    g = _rand(4096, 1024)
    if norm == "layer":
        return (lambda: (fused_block.add_layer_norm(x, r, w, b)[0].float() * g).sum()), [x, r, w, b]
    return (lambda: (fused_block.add_rms_norm(x, r, w)[0].float() * g).sum()), [x, r, w]


def _attention_case():
    q = _rand(2, 8, 1000, 128, grad=True)
    k, v = _rand(2, 2, 1000, 128, grad=True), _rand(2, 2, 1000, 128, grad=True)
    g = _rand(2, 8, 1000, 128)
    return (lambda: (fused_block.attention(q, k, v, causal=True).float() * g).sum()), [q, k, v]


def _mlp_case():
    x = _rand(4096, 768, grad=True)
    w1, b1 = _rand(3072, 768, scale=0.02, grad=True), _rand(3072, scale=0.02, grad=True)
    w2, b2 = _rand(768, 3072, scale=0.02, grad=True), _rand(768, scale=0.02, grad=True)
    res, g = _rand(4096, 768, grad=True), _rand(4096, 768)
    return (lambda: (fused_block.mlp(x, w1, b1, w2, b2, "gelu", residual=res).float() * g).sum()), [x, w1, b1, w2, b2, res]


def _block_case():
    layer = fused_block.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True, norm_first=True).to(DEV, BF16)
    x = _rand(4, 256, 512, grad=True)
    params = [x, *layer.parameters()]
    return (lambda: layer(x, is_causal=True, src_mask=torch.nn.Transformer.generate_square_subsequent_mask(256, device=DEV)
                          ).float().square().sum()), params


def _loss_case():
    # 8 chunks of 1024 tokens: the dW / db accumulation over chunks in its fixed order.
    x, w, b = _rand(8192, 1024, grad=True), _rand(32000, 1024, scale=0.03, grad=True), _rand(32000, grad=True)
    target = torch.randint(0, 32000, (8192,), device=DEV)
    return (lambda: fused_block.linear_cross_entropy(x, w, target, b, label_smoothing=0.1)), [x, w, b]


@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "attention", "mlp", "block", "linear_cross_entropy"])
def test_backward_is_deterministic(case):
    torch.manual_seed(0)
    make_loss, inputs = {"layer_norm": lambda: _norm_case("layer"), "rms_norm": lambda: _norm_case("rms"),
                         "attention": _attention_case, "mlp": _mlp_case, "block": _block_case,
                         "linear_cross_entropy": _loss_case}[case]()
    first, second = _grads_twice(make_loss, inputs)
    assert _bitwise_equal(first, second)


# ---------------------------------------------------------------------------------------------
# tensors with more than 2^31 elements (64-bit offsets), checked on sampled rows
# ---------------------------------------------------------------------------------------------

def _sample_rows(n_rows):
    return torch.tensor([0, 1, n_rows // 2, n_rows - 2, n_rows - 1], device=DEV)


def test_add_layer_norm_over_2_31_elements():
    n = 1024
    rows = (2**31 + 1024) // n  # 2^31 + 1024 elements
    x = _rand(rows, n)
    w, b = _rand(n, dtype=torch.float32), _rand(n, dtype=torch.float32)
    out, _ = fused_block.add_layer_norm(x, None, w, b)
    idx = _sample_rows(rows)
    ref, _ = reference.add_layer_norm(x[idx].double(), None, w.double(), b.double())
    torch.testing.assert_close(out[idx].double(), ref, atol=3e-2, rtol=2e-2)
    del out
    g = _rand(rows, n)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(fused_block.add_layer_norm(x, None, w, b)[0], x, g)
    xs = x[idx].detach().double().requires_grad_()
    (dref,) = torch.autograd.grad(reference.add_layer_norm(xs, None, w.double(), b.double())[0], xs, g[idx].double())
    torch.testing.assert_close(dx[idx].double(), dref, atol=5e-2, rtol=3e-2)


def test_linear_over_2_31_elements():
    m, k, n = (2**31 + 4096) // 1024, 1024, 256
    x = _rand(m, k)
    w, b = _rand(n, k, scale=0.03), _rand(n, scale=0.1)
    out = fused_block.linear(x, w, b, activation="gelu")
    idx = _sample_rows(m)
    ref = reference.linear(x[idx].double(), w.double(), b.double(), "gelu")
    torch.testing.assert_close(out[idx].double(), ref, atol=3e-2, rtol=2e-2)


def _chunked_reference(x, w, target, rows=1024):
    """The mean loss, dW and the per-token dhidden of F.cross_entropy(F.linear(x, w).float()),
    a chunk of rows at a time (the logits rounded to bf16, as F.linear's; fp32 from there)."""
    total, dw, dx = torch.zeros((), device=DEV, dtype=torch.float64), torch.zeros(w.shape, device=DEV), []
    n = (target != -100).sum()
    for r0 in range(0, x.shape[0], rows):
        logits = F.linear(x[r0:r0 + rows], w).float().requires_grad_()
        loss = F.cross_entropy(logits, target[r0:r0 + rows], reduction="sum") / n
        (g,) = torch.autograd.grad(loss, logits)
        total += loss.double()
        dw += g.to(x.dtype).float().T @ x[r0:r0 + rows].float()
        dx.append(g.to(x.dtype).float() @ w.float())
    return total, dw, torch.cat(dx)


def test_linear_cross_entropy_over_2_31_logits():
    # 17,000 tokens x LLaMA-3's 128,256 vocabulary: 2.18e9 logits (64-bit offsets across the
    # chunks), hidden 64 so everything else stays small.
    n, v, h = 17000, 128256, 64
    x, w = _rand(n, h, grad=True), _rand(v, h, scale=h ** -0.5, grad=True)
    target = torch.randint(0, v, (n,), device=DEV)
    target[::7] = -100
    loss = fused_block.linear_cross_entropy(x, w, target)
    dx, dw = torch.autograd.grad(loss, (x, w))
    want, want_dw, want_dx = _chunked_reference(x.detach(), w.detach(), target)
    torch.testing.assert_close(loss.double(), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dw.float(), want_dw, atol=2e-4, rtol=2e-2)
    torch.testing.assert_close(dx.float(), want_dx, atol=2e-4, rtol=2e-2)


def test_linear_cross_entropy_extra_memory():
    """LLaMA-3's head on 16K tokens: what a training step's loss allocates beyond its inputs
    (the chunk buffer, dhidden, dW and its fp32 accumulator) against the fp32 logits' 8.4 GB."""
    n, v, h = 16384, 128256, 1024
    x, w = _rand(n, h, grad=True), _rand(v, h, scale=h ** -0.5, grad=True)
    target = torch.randint(0, v, (n,), device=DEV)
    torch.autograd.grad(fused_block.linear_cross_entropy(x, w, target), (x, w))  # configs chosen, caches warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(fused_block.linear_cross_entropy(x, w, target), (x, w))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    del grads
    assert extra <= n * v * 4 / 8 + (2 + 4) * v * h + 2 * 2 * n * h + (64 << 20), extra


def test_attention_over_2_31_elements():
    b, h, lq, d = 1, 64, 2**17 + 64, 256  # q, k, v, out each hold 2^31 + 2^20 elements
    q, k, v = (_rand(b, h, lq, d) for _ in range(3))
    out = fused_block.attention(q, k, v, causal=True)
    for head, row in ((0, 0), (h - 1, lq - 1), (h // 2, lq // 2)):
        s = (q[0, head, row].double() @ k[0, head, :row + 1].double().T) / math.sqrt(d)
        ref = torch.softmax(s, -1) @ v[0, head, :row + 1].double()
        torch.testing.assert_close(out[0, head, row].double(), ref, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# grid limits: B x H beyond 65,535
# ---------------------------------------------------------------------------------------------

def test_attention_large_batch_times_heads():
    b, h, l, d = 4096, 32, 16, 64  # B*H = 131072 > 65535
    q, k, v = (_rand(b, h, l, d, grad=True) for _ in range(3))
    out = fused_block.attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g = _rand(b, h, l, d)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g.float())
    for a, r in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(a.float(), r.float(), atol=5e-2, rtol=5e-2)


# ---------------------------------------------------------------------------------------------
# streams and devices
# ---------------------------------------------------------------------------------------------

def _ops(x):
    w = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
    q = x.view(2, 4, -1, 64)
    return (fused_block.add_layer_norm(x, x, w, None)[0], fused_block.add_rms_norm(x, None, w)[0],
            fused_block.linear(x, torch.eye(x.shape[-1], device=x.device, dtype=x.dtype), None, "gelu"),
            fused_block.attention(q, q, q, causal=True))


def test_kernels_run_on_the_current_stream():
    x = _rand(256, 256)
    expected = _ops(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = _ops(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernels_run_on_the_tensors_device():
    x0 = _rand(256, 256)
    x1 = x0.to("cuda:1")
    with torch.cuda.device(0):
        got = _ops(x1)
    for a, b in zip(got, _ops(x0)):
        assert a.device == x1.device
        assert torch.equal(a.cpu(), b.cpu())


def test_cuda_graph_capture_of_a_converted_block():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True), 2,
        enable_nested_tensor=False).to(DEV, BF16).eval()
    fused_block.convert(model)
    static_in = _rand(4, 128, 256)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm up: autotuning must not run in capture
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = model(static_in)
    for _ in range(2):
        new = _rand(4, 128, 256)
        static_in.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert torch.equal(static_out, model(new))


# ---------------------------------------------------------------------------------------------
# memory: attention's extra memory grows linearly with sequence length
# ---------------------------------------------------------------------------------------------

def _attention_extra_memory(seq):
    q, k, v = (_rand(1, 16, seq, 128, grad=True) for _ in range(3))
    g = _rand(1, 16, seq, 128)
    # A first call of a shape may time config candidates (do_bench allocates a 256 MB L2-flush
    # buffer): not the attention's memory, so it happens before the measurement.
    torch.autograd.grad(fused_block.attention(q, k, v, causal=True), (q, k, v), g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fused_block.attention(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_attention_memory_is_linear_in_sequence_length():
    small, large = _attention_extra_memory(4096), _attention_extra_memory(16384)
    # 4x the length: linear growth gives 4x the memory, quadratic 16x.
    assert large <= 5 * small, f"extra memory {small} B at 4096 -> {large} B at 16384"
