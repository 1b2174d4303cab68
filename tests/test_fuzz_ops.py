"""Property-based fuzzing of attention / linear / mlp against the float64 reference.

Shapes (edge sizes: 1, primes, just below and above the interpreter's tiles), dtypes, flags
(causal, padding incl. fully padded rows, GQA ratios, activations, bias/residual present or
not, a wider residual), strides (views of fused projections, transposed and sliced views) and
value regimes (large magnitudes, tiny values) are drawn by hypothesis; forward and the
gradient of every differentiable input must satisfy the per-dtype tolerance rule. The CI
profile is bounded; ``FUSED_BLOCK_FUZZ=long`` selects the long one (see tests/fuzzing.py).

Interpreter tiles: attention blocks are 64x32 (forward, dQ) and 32x64 (dK/dV), the GEMM tile
is 256x256x128, so the edge sizes below sit on both sides of 16/32/64/128 (attention) and of
128/256 (GEMM K and M/N). Sizes stay small: the interpreter runs every program in Python.
"""
import math

import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from fused_block import reference
from fused_block.attention import MAX_FP32_HEAD_DIM, attention
from fused_block.kernels.attention import launchers as attention_kernels
from fused_block.kernels import common
from fused_block.linear import linear, mlp
from fuzzing import DTYPE, LAYOUTS, layout, settings_for
from gemm_testing import baseline_mode, fp32_mode
from numerics import ATOL, assert_close

ON_CUDA = torch.cuda.is_available()
HOPPER = ON_CUDA and torch.cuda.get_device_capability()[0] >= 9
ACTS = st.sampled_from((None, "gelu", "gelu_tanh", "relu"))
REGIMES = st.sampled_from(("normal", "large", "tiny"))


def _values(regime, shape, gen, large=300.0, tiny=1e-3):
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    if regime == "large":
        return large * z
    if regime == "tiny":
        return tiny * z
    return z


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

SEQ = st.one_of(st.sampled_from([1, 2, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129]),
                st.integers(1, 130))
# Head dims: padded to a power of two inside the kernels (24 -> 32, 40 -> 64, 72/80 -> 128);
# 256 (the widest, backward in column chunks) rarely, it is the slowest in the interpreter.
HEAD_DIM = st.one_of(st.sampled_from([16, 24, 40, 64, 72, 80, 128]), st.sampled_from([16, 32, 256]))
# q/k/v memory layouts (each a leaf view; the op takes any strides with a unit last dim and
# copies the others):
# - "contiguous": (B, H, L, D);
# - "bshd": (B, L, H, D).transpose(1, 2), the projection's natural layout;
# - "fused": slices of one fused projection buffer, (B, L, 3, H, D) / (B, L, 2, Hkv, D);
# - "row_padded": (B, H, L, D + 8)[..., :D], a row stride that is not D;
# - "strided_d": last-dim stride 2 (copied by the op).
QKV_LAYOUTS = st.sampled_from(("contiguous", "bshd", "fused", "row_padded", "strided_d"))
# (B, Hkv, Hq // Hkv): GQA ratios 1, 2 and 4 (MQA at Hkv = 1), B * Hq <= 4 (interpreter time
# grows with the number of heads).
HEADS = st.sampled_from([(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2),
                         (1, 1, 4)])
PADDING = st.sampled_from(("none", "random", "full_row"))


def _attn_view(vals, kind, slot, slots):
    """``vals`` (B, H, L, D) in layout ``kind``; ``slot`` of ``slots`` for the fused buffer."""
    B, H, L, D = vals.shape
    if kind == "contiguous":
        return vals.clone()
    if kind == "bshd":
        return vals.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "fused":
        buf = torch.zeros(B, L, slots, H, D, dtype=vals.dtype, device=vals.device)
        buf[:, :, slot] = vals.transpose(1, 2)
        return buf[:, :, slot].transpose(1, 2)
    if kind == "row_padded":
        buf = torch.zeros(B, H, L, D + 8, dtype=vals.dtype, device=vals.device)
        buf[..., :D] = vals
        return buf[..., :D]
    if kind == "strided_d":
        buf = torch.zeros(B, H, L, 2 * D, dtype=vals.dtype, device=vals.device)
        buf[..., ::2] = vals
        return buf[..., ::2]
    raise ValueError(kind)


@settings_for(examples=16)
@given(heads=HEADS, Lq=SEQ, Lk=SEQ, D=HEAD_DIM, dtype=DTYPE, causal=st.booleans(), padding=PADDING,
       q_layout=QKV_LAYOUTS, kv_layout=QKV_LAYOUTS, regime=REGIMES, explicit_scale=st.booleans(),
       path=st.sampled_from(("tma", "pointer")), tf32=st.booleans(), seed=st.integers(0, 2**31))
@example(heads=(2, 1, 2), Lq=1, Lk=1, D=16, dtype=torch.bfloat16, causal=True, padding="full_row",
         q_layout="fused", kv_layout="fused", regime="normal", explicit_scale=False, path="tma", tf32=False, seed=0)
# One key under TF32 (P = 1, so dS = 0): delta must see dO rounded as dP does (backward preprocess).
@example(heads=(1, 1, 1), Lq=1, Lk=1, D=16, dtype=torch.float32, causal=False, padding="none",
         q_layout="contiguous", kv_layout="contiguous", regime="normal", explicit_scale=False, path="tma", tf32=True,
         seed=0)
def test_attention_fuzz(device, monkeypatch, heads, Lq, Lk, D, dtype, causal, padding, q_layout,
                        kv_layout, regime, explicit_scale, path, tf32, seed):
    """``path``: the TMA path (the default where layouts allow, Hopper and the interpreter) or
    the pointer path forced; ``tf32``: fp32 under torch's TF32 matmul setting (else IEEE),
    held to PyTorch's error in the same mode."""
    assume(dtype != torch.float32 or D <= MAX_FP32_HEAD_DIM)  # fp32 kernels stop at D = 128
    monkeypatch.setattr(attention_kernels, "FORCE_PATH", "pointer" if path == "pointer" else None)
    B, Hkv, group = heads
    Hq = Hkv * group
    gen = torch.Generator().manual_seed(seed)
    # "large": scores of std ~16 (peaked softmax, online rescaling matters) and V ~ 100;
    # "tiny": almost uniform softmax over V ~ 1e-3.
    qk_scale, v_scale = {"normal": (1.0, 1.0), "large": (4.0, 100.0), "tiny": (1e-2, 1e-3)}[regime]
    q = _attn_view((qk_scale * _values("normal", (B, Hq, Lq, D), gen)).to(device, dtype), q_layout, 0, 3)
    k = _attn_view((qk_scale * _values("normal", (B, Hkv, Lk, D), gen)).to(device, dtype), kv_layout, 0, 2)
    v = _attn_view((v_scale * _values("normal", (B, Hkv, Lk, D), gen)).to(device, dtype), kv_layout, 1, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = None
    if padding != "none":
        mask = torch.rand(B, Lk, generator=gen) < 0.3
        if padding == "full_row":
            mask[0] = True  # batch 0 has no visible key: out 0, LSE -inf, zero gradients
        mask = mask.to(device)
    scale = 0.3 / math.sqrt(D) if explicit_scale else None
    dout = (v_scale ** -1 * _values("normal", (B, Hq, Lq, D), gen)).to(device, dtype)
    dlse = _values("normal", (B, Hq, Lq), gen).to(device, torch.float32)

    mode = "tf32" if tf32 and dtype == torch.float32 else "ieee"
    before = common.LAUNCHES.copy()  # the fixture counts over all examples of the test
    with fp32_mode(mode):
        out, lse = attention(q, k, v, causal, scale, mask, return_lse=True)
        # Gradients of out and of the LSE (dLSE is nonzero on fully masked rows too).
        got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    leaves_lp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with baseline_mode(dtype, mode):
        base, base_lse = reference.attention(*leaves_lp, causal, scale, mask, return_lse=True, compute_dtype=dtype)
        base_g = torch.autograd.grad((base, base_lse), leaves_lp, (dout, dlse.to(base_lse.dtype)))
    ran = {name: common.LAUNCHES[name] - before[name] for name in ("attention_fwd", "attention_bwd", "attention_tma")}
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref64, lse64 = reference.attention(*leaves64, causal, scale, mask, return_lse=True)
    want = torch.autograd.grad((ref64, lse64), leaves64, (dout.double(), dlse.double()))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, ref64, base)
    assert_close("lse", lse, lse64, base_lse, atol=ATOL[dtype])
    for name, a, w, b in zip(("dq", "dk", "dv"), got, want, base_g):
        assert a.dtype == dtype
        assert_close(name, a, w, b)
    assert ran["attention_fwd"] == 1 and ran["attention_bwd"] == 1
    # The TMA path runs wherever the layout allows it ("strided_d" is copied, then aligned too):
    # in the interpreter and on Hopper, where IEEE fp32 (FMA products) takes pointers.
    ieee = dtype == torch.float32 and mode == "ieee"
    assert (ran["attention_tma"] > 0) == (path == "tma" and (not ON_CUDA or (HOPPER and not ieee)))


# ---------------------------------------------------------------------------------------------
# linear / mlp
# ---------------------------------------------------------------------------------------------

SIZE = st.one_of(st.sampled_from([1, 2, 7, 8, 15, 16, 17, 31, 33, 63, 65, 100, 127, 129, 255, 257]),
                 st.integers(1, 300))


def _gemm_atol(ref, dtype):
    """The atol of the lowest precision in the computation (an fp32 residual promotes the
    output to fp32, but the product ran in ``dtype``). fp32 adds 32 ulps of the largest
    result: a K-term fp32 dot product's rounding error depends on its summation order (about
    sqrt(K) ulps for K <= 300), PyTorch's CPU GEMM often sums more accurately than the
    kernel's tile order, and the fixed atol is negligible next to large-magnitude results.
    Through an activation's derivative, a cancelling pre-activation's rounding error (as
    accurate in the kernel as in PyTorch, but another realization) is summed again, weighted by
    large inputs: the weight gradient's error then varies by more than 2x between equally
    accurate computations (a long-profile case below needed 16.3 ulps)."""
    atol = ATOL[dtype]
    if dtype == torch.float32 and ref.numel():
        atol += 32 * torch.finfo(torch.float32).eps * ref.detach().abs().max().item()
    return atol


def _representable(ref, dtype):
    """The float64 reference as ``dtype`` can hold it: values past its range are the infinity
    any ``dtype`` result of them is (e.g. an fp16 weight gradient of large inputs)."""
    overflow = torch.isfinite(ref) & ~torch.isfinite(ref.detach().to(dtype))
    return torch.where(overflow, torch.sign(ref) * float("inf"), ref)


def _check(ours, ref_fn, inputs, dtype, device, gen, g_scale=1.0):
    """Forward and the gradient of every input that requires it, against the float64
    reference and PyTorch's own error in ``dtype``; the incoming gradient is not modified."""
    out = ours(*inputs)
    g = (g_scale * _values("normal", tuple(out.shape), gen)).to(device, out.dtype)
    g_before = g.clone()
    diff = [t for t in inputs if t is not None]
    got = torch.autograd.grad(out, diff, g)
    assert torch.equal(g, g_before), "the incoming gradient was modified"

    ins64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref = ref_fn(*ins64)
    want = torch.autograd.grad(ref, [t for t in ins64 if t is not None], g.double())
    # fp32: the kernels follow torch's default precision (IEEE products), as this baseline does.
    insb = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    base = ref_fn(*insb, compute_dtype=dtype)
    base_g = torch.autograd.grad(base, [t for t in insb if t is not None], g)
    # Where PyTorch's own computation in ``dtype`` overflows on the way (e.g. SwiGLU's product of
    # two fp16 projections of inputs ~300), the problem is outside the dtype's range: not a case.
    for w, b in zip((ref, *want), (base, *base_g)):
        assume(torch.equal(torch.isfinite(_representable(w, b.dtype)), torch.isfinite(b)))
    assert out.dtype == base.dtype
    assert_close("out", out, _representable(ref, out.dtype), base, atol=_gemm_atol(ref, dtype))
    for i, (a, w, b) in enumerate(zip(got, want, base_g)):
        assert a.dtype == b.dtype
        assert_close(f"grad[{i}]", a, _representable(w, a.dtype), b, atol=_gemm_atol(w, dtype))


@settings_for(examples=20)
@given(M=SIZE, K=SIZE, N=SIZE, dtype=DTYPE, activation=ACTS, has_bias=st.booleans(),
       residual=st.sampled_from(("none", "same", "fp32")), x_layout=LAYOUTS, w_layout=LAYOUTS,
       r_layout=LAYOUTS, lead=st.booleans(), regime=REGIMES, seed=st.integers(0, 2**31))
@example(M=1, K=1, N=1, dtype=torch.float16, activation="gelu", has_bias=True, residual="same",
         x_layout="transposed", w_layout="strided", r_layout="row_padded", lead=False, regime="normal", seed=0)
# Found by the long profile: fp32 tanh-GELU with inputs ~300, dW off by ~2 ulps of its largest
# entry (8 ulps at pre ~3.8, where the kernel's tanh-as-sigmoid and 1 - t*t lose a bit more than
# torch's tanh); rounding-level, within the fp32 GEMM slack of ``_gemm_atol``.
@example(M=1, K=1, N=100, dtype=torch.float32, activation="gelu_tanh", has_bias=False, residual="none",
         x_layout="contiguous", w_layout="contiguous", r_layout="contiguous", lead=False, regime="large",
         seed=0)
# Found by the long profile: bf16 ReLU output ~300 cancelling against an fp32 residual: the
# kernel rounded the pre-activation to bf16 before the activation (an FFN layer's rounding);
# linear keeps it in fp32 now, as it did before.
@example(M=1, K=2, N=1, dtype=torch.bfloat16, activation="relu", has_bias=True, residual="fp32",
         x_layout="contiguous", w_layout="contiguous", r_layout="contiguous", lead=False, regime="large", seed=1)
# Found by the long profile: fp32 tanh-GELU, inputs ~300, K = 284: dW's error 2.2x PyTorch's from
# pre's cancellation error (the kernel's pre as accurate as PyTorch's, mean error 4.5e-5 vs
# 4.8e-5), the case behind ``_gemm_atol``'s 32 ulps.
@example(M=74, K=284, N=238, dtype=torch.float32, activation="gelu_tanh", has_bias=False, residual="same",
         x_layout="contiguous", w_layout="contiguous", r_layout="contiguous", lead=False, regime="large",
         seed=8643)
def test_linear_fuzz(device, launches, M, K, N, dtype, activation, has_bias, residual, x_layout, w_layout,
                     r_layout, lead, regime, seed):
    gen = torch.Generator().manual_seed(seed)
    x = layout(_values(regime, (M, K), gen).to(device, dtype), x_layout).requires_grad_()
    w = layout((K ** -0.5 * _values("normal", (N, K), gen)).to(device, dtype), w_layout).requires_grad_()
    b = _values("normal", (N,), gen).to(device, dtype).requires_grad_() if has_bias else None
    r = None
    if residual != "none":
        rdtype = torch.float32 if residual == "fp32" else dtype
        r = layout(_values(regime, (M, N), gen).to(device, rdtype), r_layout).requires_grad_()
    split = lead and M % 2 == 0  # x (2, M/2, K): leading dims flattened by the op

    def ours(x, w, b, r):
        if split:
            out = linear(x.unflatten(0, (2, M // 2)), w, b, activation,
                         None if r is None else r.unflatten(0, (2, M // 2)))
            return out.flatten(0, 1)
        return linear(x, w, b, activation, r)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, activation, r, compute_dtype=compute_dtype)

    _check(ours, ref, (x, w, b, r), dtype, device, gen)
    assert launches["matmul"] >= 3  # forward, dX, dW


@settings_for(examples=12)
@given(M=SIZE, D=SIZE, F=SIZE, dtype=DTYPE, activation=st.sampled_from((None, "gelu", "gelu_tanh", "relu", "swiglu")),
       has_b1=st.booleans(), has_b2=st.booleans(),
       has_res=st.booleans(), x_layout=LAYOUTS, w_layout=LAYOUTS, regime=REGIMES, seed=st.integers(0, 2**31))
@example(M=1, D=1, F=1, dtype=torch.bfloat16, activation="relu", has_b1=True, has_b2=False, has_res=True,
         x_layout="strided", w_layout="transposed", regime="normal", seed=0)
# Found by the long profile: fp32, hidden values ~300, out a 257-term dot product off by ~5
# ulps (summation order; PyTorch's CPU dot was at its rounding floor): a rule artifact,
# covered by the fp32 GEMM slack of ``_gemm_atol``.
@example(M=1, D=1, F=257, dtype=torch.float32, activation="gelu", has_b1=False, has_b2=False, has_res=False,
         x_layout="contiguous", w_layout="contiguous", regime="large", seed=1999)
# Found by the long profile: fp16 inputs ~300, dW1's exact entries up to 87,527, past fp16's range
# (PyTorch's fp16 result overflows too): the reference is compared as fp16 can hold it.
@example(M=63, D=100, F=1, dtype=torch.float16, activation=None, has_b1=False, has_b2=False, has_res=False,
         x_layout="contiguous", w_layout="contiguous", regime="large", seed=0)
# Found by the long profile: fp16 SwiGLU of inputs ~300, whose hidden activation (~9e4) overflows in
# every fp16 computation: rejected, not compared.
@example(M=1, D=1, F=16, dtype=torch.float16, activation="swiglu", has_b1=False, has_b2=False, has_res=False,
         x_layout="contiguous", w_layout="contiguous", regime="large", seed=0)
def test_mlp_fuzz(device, launches, M, D, F, dtype, activation, has_b1, has_b2, has_res, x_layout, w_layout,
                  regime, seed):
    gen = torch.Generator().manual_seed(seed)
    F1 = 2 * F if activation == "swiglu" else F  # swiglu: w1 holds the gate rows, then the up rows
    x = layout(_values(regime, (M, D), gen).to(device, dtype), x_layout).requires_grad_()
    w1 = layout((D ** -0.5 * _values("normal", (F1, D), gen)).to(device, dtype), w_layout).requires_grad_()
    w2 = layout((F ** -0.5 * _values("normal", (D, F), gen)).to(device, dtype), w_layout).requires_grad_()
    b1 = _values("normal", (F1,), gen).to(device, dtype).requires_grad_() if has_b1 else None
    b2 = _values("normal", (D,), gen).to(device, dtype).requires_grad_() if has_b2 else None
    r = layout(_values(regime, (M, D), gen).to(device, dtype), x_layout).requires_grad_() if has_res else None

    def ours(x, w1, b1, w2, b2, r):
        return mlp(x, w1, b1, w2, b2, activation, r)

    def ref(x, w1, b1, w2, b2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, activation, r, compute_dtype=compute_dtype)

    _check(ours, ref, (x, w1, b1, w2, b2, r), dtype, device, gen)
    assert launches["matmul"] >= 6  # forward 2; backward dW2, dH, dW1, dX
