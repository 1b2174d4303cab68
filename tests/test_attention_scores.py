"""Score modifications: logit softcapping, attention sinks, ALiBi, an additive bias and a bool
mask, alone and combined, against the float64 reference (forward, LSE and every gradient:
q, k, v, sinks, bias), on both data paths.

Interpreter blocks are 64 x 32 (forward), 32 x 64 / 64 x 32 (backward dK/dV, dQ): the lengths
below (40 to 100) leave partial blocks on both axes, so bias and mask tiles are read with their
bounds checked and unchecked.
"""
import pytest
import torch
import triton
import triton.language as tl

from attention_testing import check, path  # noqa: F401 - the fixture
from fused_block import reference
from fused_block.attention import attention, attention_qkvpacked
from fused_block.kernels import common
from numerics import DTYPES, randn


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device, scale=1.0):
    return (randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True, scale=scale),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True))


def _launched_once(launches):
    assert launches["attention_fwd"] == 1 and launches["attention_bwd_preprocess"] == 1
    assert launches["attention_bwd"] == 1


def _check(shape, dtype, device, *, causal=False, window=(-1, -1), softcap=None, sinks=False, alibi=None,
           bias=None, bias_grad=False, mask=None, q_scale=1.0, lse_weight=True):
    """``alibi``: None, "head" ((Hq,)) or "batch" ((B, Hq)); ``bias``/``mask``: the broadcast
    shape (sizes of 1 broadcast) or None."""
    B, Hq, Hkv, Lq, Lk, D = shape
    tensors = list(_qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device, q_scale))
    names = ["q", "k", "v"]
    extra = {}
    if sinks:
        extra["sinks"] = randn(Hq, dtype=torch.float32, device=device, requires_grad=True)
    if alibi is not None:
        # Slopes as BLOOM's for 8 heads (2^-1 ... 2^-8), scaled down: a bias comparable to the scores.
        slopes = 2.0 ** -torch.arange(1, Hq + 1, dtype=torch.float32) * 4
        if alibi == "batch":
            slopes = slopes[None] * torch.rand(B, 1) * 2
        extra["alibi_slopes"] = slopes.to(device)
    if bias is not None:
        b = randn(*bias, dtype=dtype, device=device)
        extra["bias"] = b.requires_grad_(bias_grad)
    if mask is not None:
        extra["mask"] = mask.to(device) if isinstance(mask, torch.Tensor) else torch.rand(*mask, device=device) > 0.3
    keys = list(extra)
    tensors += [extra[k] for k in keys]
    names += keys

    def run(q, k, v, *rest):
        return attention(q, k, v, causal, None, window=window, softcap=softcap, return_lse=True,
                         **dict(zip(keys, rest)))

    def ref(q, k, v, *rest, compute_dtype=None):
        return reference.attention(q, k, v, causal, None, window=window, softcap=softcap, return_lse=True,
                                   compute_dtype=compute_dtype, **dict(zip(keys, rest)))

    return check(run, ref, tensors, names, lse_weight=lse_weight)


# (B, Hq, Hkv, Lq, Lk, D) shapes: GQA 4:2 self-attention over 70 tokens (a partial block on
# each axis); cross-attention 40 x 100 (Lq != Lk: causal is bottom-right).
SELF = (1, 4, 2, 70, 70, 32)
CROSS = (2, 2, 1, 40, 100, 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.sweep
def test_softcap(causal, dtype, device, path, launches):
    # q scaled by 4: scores up to about +-8 against a cap of 3, so tanh saturates (the derivative
    # 1 - tanh^2 matters) on many entries.
    _check(SELF, dtype, device, causal=causal, softcap=3.0, q_scale=4.0)
    _launched_once(launches)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_far_above_the_scores(dtype, device, path, launches):
    # A cap 1000 times the scores: softcap(s) = s (1 - s^2 / (3 c^2) ...) with s / c ~ 1e-3, so
    # the scores reach exp2 through tanh's values near 0, scaled back up by c. A tanh with an
    # absolute error of 1e-7 there (2 sigmoid(2x) - 1) gave every score an error of 1e-4, ten
    # times fp32's atol in the output; a relative one keeps it at the scores' own rounding.
    _check(SELF, dtype, device, causal=True, softcap=1000.0)
    _launched_once(launches)


@triton.jit
def _tanh_probe(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, common.tanh(tl.load(X + offs, mask=offs < n)), mask=offs < n)


def _tanh(x):
    y = torch.empty_like(x)
    common.launch("tanh_probe", _tanh_probe, (common.cdiv(x.numel(), 4096),), (x, y, x.numel()),
                  dict(BLOCK=4096), common.Config.of(num_warps=4))
    return y


def test_tanh_against_float64(device):
    # common.tanh (the softcap's, attention and loss) over the fp32 range: a fine grid where it
    # bends (|x| < 32, spacing 2^-12) and 200 magnitudes per decade from 1e-37 to 1e38 both
    # ways, then infinities. Relative error (measured: 3.2e-7 in the interpreter's arithmetic;
    # sm_90's rsqrt approximation, 2^-22.9, adds at most 1.3e-7): a few ulps everywhere, also
    # near 0 where tanh(x) ~ x.
    x = torch.cat([torch.arange(-2**17, 2**17 + 1) * 2.0**-12, torch.logspace(-37, 38, 15001),
                   -torch.logspace(-37, 38, 15001), torch.tensor([float("inf"), float("-inf")])]).to(device)
    x = x[x != 0]
    ref = torch.tanh(x.double())
    err = (_tanh(x).double() / ref - 1).abs().max().item()
    assert err < 5e-7, err
    # Odd at 0 (the sign of -0 kept); NaN stays NaN.
    y = _tanh(torch.tensor([0.0, -0.0, float("nan")], device=device))
    assert y[0] == 0 and not y[0].signbit() and y[1] == 0 and y[1].signbit() and y[2].isnan()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.sweep
def test_sinks(causal, dtype, device, path, launches):
    # Cross 40 x 100 with GQA: under causality every query sees keys; the sinks' gradient sums
    # over both batches and every row.
    _check(CROSS, dtype, device, causal=causal, sinks=True)
    _launched_once(launches)


def test_sinks_rows_without_keys(device, launches):
    """Lq > Lk under causality: the first 60 queries see no key; with a sink they output 0,
    their LSE is the sink's logit, and their gradients reach only the sinks (through dLSE)."""
    out, lse = _check((1, 2, 2, 100, 40, 16), torch.float16, device, causal=True, sinks=True)
    assert (out[:, :, :60] == 0).all()
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alibi,causal", [("head", True), ("batch", False)])
@pytest.mark.sweep
def test_alibi(alibi, causal, dtype, device, path, launches):
    _check(CROSS if alibi == "batch" else SELF, dtype, device, causal=causal, alibi=alibi)
    _launched_once(launches)


# Bias broadcast shapes over (B, Hq, Lq, Lk) = (2, 2, 40, 100): T5's per-head relative bias
# (1, Hq, Lq, Lk); a per-batch key bias (B, 1, 1, Lk); the full shape; a 2-D (Lq, Lk) one.
BIASES = [pytest.param((1, 2, 40, 100), id="t5"), pytest.param((2, 1, 1, 100), id="keys"),
          pytest.param((2, 2, 40, 100), id="full"), pytest.param((40, 100), id="2d")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.sweep
def test_bias(bias, dtype, device, path, launches):
    _check(CROSS, dtype, device, causal=bias == (2, 1, 1, 100), bias=bias, bias_grad=True)
    _launched_once(launches)
    assert launches["attention_dbias"] == 1


# The bias gradient's broadcast cases over (B, Hq, Hkv, Lq, Lk) = (2, 4, 2, 70, 70), GQA and
# causal (70: a partial block on each axis and blocks outside the band): the owner of a strip
# walks the batches (T5's (1, Hq, L, L)), the heads across both kv heads ((B, 1, L, L)), both
# ((1, 1, L, L), and the 3-D (Hq, L, L) with its leading 1), none (the full shape); a per-query
# bias (B, 1, Lq, 1) sums over keys within the kernel (per key block), a per-head scalar
# (1, Hq, 1, 1) over both axes.
BROADCAST_BIASES = [pytest.param((1, 4, 70, 70), id="t5"), pytest.param((2, 1, 70, 70), id="batch-heads"),
                    pytest.param((1, 1, 70, 70), id="shared"), pytest.param((2, 4, 70, 70), id="full"),
                    pytest.param((4, 70, 70), id="3d"), pytest.param((2, 1, 70, 1), id="per-query"),
                    pytest.param((1, 4, 1, 1), id="per-head")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", BROADCAST_BIASES)
@pytest.mark.sweep
def test_bias_grad_broadcast(bias, dtype, device, launches):
    _check((2, 4, 2, 70, 70, 16), dtype, device, causal=True, bias=bias, bias_grad=True)
    _launched_once(launches)
    assert launches["attention_dbias"] == 1


# T5's (1, Hq, L, L) at B = 8, and a per-key bias (B, 1, 1, Lk) (summed over heads and queries).
@pytest.mark.parametrize("bias", [pytest.param((1, 2, 64, 64), id="t5"), pytest.param((8, 1, 1, 64), id="keys")])
def test_bias_grad_buffer_is_bias_sized(bias, device, launches):
    """The backward allocates the bias gradient in the bias's own size and dtype, not a (B, Hq,
    Lq, Lk) dS: with B = 8, no buffer of B * Hq * Lq * Lk / 2 elements or more is allocated, and
    the 4-D allocations besides dq, dk and dv (of q's shape) are that gradient alone. On a GPU
    the TMA path's launches also allocate Triton's descriptor scratch (1-D int8, 45,056 bytes
    on an H200 here: a descriptor per program, not a buffer of the op): memory_testing tells it
    by its allocator and it counts for neither rule."""
    from memory_testing import Allocations
    B, H, L, D = 8, 2, 64, 16
    q, k, v = _qkv(B, H, H, L, L, D, torch.float16, device)
    b = randn(*bias, dtype=torch.float16, device=device, requires_grad=True)
    out = attention(q, k, v, bias=b)
    dout = torch.randn_like(out)
    with Allocations() as rec:
        db, = torch.autograd.grad(out, (b,), dout)
    assert db.shape == b.shape and db.dtype == b.dtype
    buffers = rec.buffers()
    assert not [a for a in buffers if torch.Size(a.shape).numel() >= B * H * L * L // 2], buffers
    others = [a for a in buffers if len(a.shape) == 4 and a.shape != q.shape]
    assert [(a.shape, a.dtype) for a in others] == [(bias, torch.float16)], others
    assert launches["attention_dbias"] == 1


def test_bias_without_grad(device, launches):
    """A bias that requires no gradient gets none (no dS buffer), q, k, v still do."""
    _check(CROSS, torch.bfloat16, device, bias=(1, 2, 40, 100), bias_grad=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", [pytest.param((2, 1, 40, 100), id="per-batch"), pytest.param((40, 100), id="2d")])
def test_mask(mask, dtype, device, path, launches):
    _check(CROSS, dtype, device, mask=mask)
    _launched_once(launches)


def _chunked(L, chunk):
    """Chunked causal attention (Llama 4's local layers): query i sees keys j <= i of its chunk."""
    i = torch.arange(L)
    return (i[:, None] // chunk == i[None, :] // chunk) & (i[None, :] <= i[:, None])


# A block-sparse mask over 96 tokens in chunks of 40, with GQA and a bias with its gradient:
# with the interpreter's 64 x 32 / 32 x 64 / 64 x 32 blocks some tiles are hidden whole (and
# skipped), some partly, and chunk borders cross blocks.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_sparse_mask(dtype, device, path, launches):
    _check((1, 4, 2, 96, 96, 16), dtype, device, mask=_chunked(96, 40), bias=(1, 4, 96, 96), bias_grad=True)
    _launched_once(launches)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_tiles_are_skipped(dtype, device, path, launches):
    """Key blocks a bool mask hides from every query of a block are never read: with NaN in
    keys 64..95 (hidden from all queries; 64 is a multiple of every block) the output, LSE and
    gradients are finite and equal those of the keys 0..63 alone, dK and dV of the hidden keys
    exactly 0. A read would poison them (0 * NaN in P V, dS^T Q, dP). Causal chunks of 48 add
    tiles hidden by the pattern itself (queries 48..63 against keys 0..31)."""
    B, H, L, D = 1, 2, 96, 16
    q, k, v = _qkv(B, H, H, L, L, D, dtype, device)
    mask = _chunked(L, 48).to(device)
    mask[:, 64:] = False
    with torch.no_grad():
        k[:, :, 64:] = float("nan")
        v[:, :, 64:] = float("nan")
    out, lse = attention(q, k, v, mask=mask, return_lse=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad((out * dout).sum() + lse.nan_to_num(posinf=0, neginf=0).sum(), (q, k, v))
    k0, v0 = (t.detach()[:, :, :64].clone().requires_grad_() for t in (k, v))
    q0 = q.detach().clone().requires_grad_()
    want_out, want_lse = attention(q0, k0, v0, mask=mask[:, :64], return_lse=True)
    want = torch.autograd.grad((want_out * dout).sum() + want_lse.nan_to_num(posinf=0, neginf=0).sum(), (q0, k0, v0))
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g[:, :, :64], w)
        assert (g[:, :, 64:] == 0).all()
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


def test_all_masked_rows(device, launches):
    """Rows whose mask is all False (and a bias of -inf on a whole row) output 0 with LSE -inf
    and zero gradients; the other rows are unaffected."""
    B, Hq, Lq, Lk, D = 1, 2, 40, 100, 16
    q, k, v = _qkv(B, Hq, Hq, Lq, Lk, D, torch.float16, device)
    mask = torch.rand(B, Hq, Lq, Lk, device=device) > 0.5
    mask[:, 0, 5] = False
    bias = torch.zeros(Lq, Lk, dtype=torch.float16, device=device)
    bias[7] = float("-inf")
    out, lse = attention(q, k, v, mask=mask, bias=bias, return_lse=True)
    assert (out[0, 0, 5] == 0).all() and (out[:, :, 7] == 0).all()
    assert lse[0, 0, 5] == float("-inf") and (lse[:, :, 7] == float("-inf")).all()
    dq, = torch.autograd.grad(out.float().sum(), (q,))
    assert (dq[0, 0, 5] == 0).all() and (dq[:, :, 7] == 0).all() and torch.isfinite(dq).all()
    assert launches["attention_fwd"] == 1 and launches["attention_bwd"] == 1


# Output tolerances of rows computed two ways (the same kernel under a bias and a bool mask, or
# the mean of V in fp32): a few of the output dtype's ulps.
ROW_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # fp16's range ends at 65504
def test_a_bias_below_the_saturation_point_masks_its_key(dtype, device, launches):
    """A bias below ``reference.SATURATED_BIAS`` (~-2.36e38: fp32's and bf16's ``finfo.min``)
    masks its key as -inf does, on the kernels and in the reference alike: a row of such keys
    gives 0, a row of some gives the attention over the others; a bias above it (-1e38 on every
    key) is an ordinary one, the mean of V (the reference normalizes by the row's own sum: its
    LSE rounds to -1e38 itself, which weighed every key 1)."""
    L, D = 6, 16
    q, k, v = _qkv(1, 2, 2, L, L, D, dtype, device)
    low = float(torch.finfo(torch.float32).min)
    bias = torch.zeros(L, L, device=device)
    bias[0] = low
    bias[1] = -1e38
    bias[2, :3] = low
    bias[3, :2] = -2.5e38
    bias[4, :2] = float("-inf")
    bias[4, 2:] = low
    keep = torch.ones(L, L, dtype=torch.bool, device=device)
    keep[2, :3] = keep[3, :2] = False
    want = attention(q, k, v, mask=keep).float()
    mean = v.float().mean(2)
    for fn in (attention, reference.attention):
        out = fn(q, k, v, bias=bias.to(dtype)).float()
        assert (out[:, :, 0] == 0).all() and (out[:, :, 4] == 0).all()
        torch.testing.assert_close(out[:, :, 1], mean, **ROW_TOL[dtype])
        torch.testing.assert_close(out[:, :, 2:4], want[:, :, 2:4], **ROW_TOL[dtype])
        torch.testing.assert_close(out[:, :, 5:], want[:, :, 5:], **ROW_TOL[dtype])
    assert launches["attention_fwd"] == 2


# Everything at once: causal + a left window + softcap + sinks + ALiBi + bias + mask with GQA.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.sweep
def test_everything_combined(dtype, device, path, launches):
    _check(SELF, dtype, device, causal=True, window=(30, -1), softcap=5.0, sinks=True, alibi="head",
           bias=(1, 4, 70, 70), bias_grad=True, mask=(70, 70))
    _launched_once(launches)


# Packed sequences: softcap, sinks and per-sequence ALiBi slopes (B, Hq) together, causal with
# a left window; an empty sequence, one of length 1 and one crossing the 64-row blocks.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.sweep
def test_varlen_softcap_sinks_alibi(dtype, device, path, launches):
    from fused_block.attention import attention_varlen
    lens = [5, 0, 70, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    T, Hq, Hkv, D = sum(lens), 4, 2, 16
    q = randn(T, Hq, D, dtype=dtype, device=device, requires_grad=True, scale=3.0)
    k, v = (randn(T, Hkv, D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    sinks = randn(Hq, dtype=torch.float32, device=device, requires_grad=True)
    slopes = (torch.rand(len(lens), Hq) * 0.5).to(device)
    options = dict(causal=True, window=(20, -1), softcap=4.0)

    def run(q, k, v, sinks):
        return attention_varlen(q, k, v, cu, cu, 70, 70, sinks=sinks, alibi_slopes=slopes, return_lse=True,
                                **options)

    def ref(q, k, v, sinks, compute_dtype=None):
        return reference.attention_varlen(q, k, v, cu, cu, options["causal"], None, window=options["window"],
                                          softcap=options["softcap"], sinks=sinks, alibi_slopes=slopes,
                                          return_lse=True, compute_dtype=compute_dtype)

    check(run, ref, (q, k, v, sinks), ("q", "k", "v", "sinks"), lse_weight=True)
    _launched_once(launches)


# The packed-QKV forms take the score options too (through the unpacked functions on views of
# qkv): softcap, sinks and ALiBi on a (B, L, (H + 2 Hkv) D) projection and on packed tokens.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkvpacked_softcap_sinks_alibi(dtype, device, launches):
    from fused_block.attention import attention_varlen_qkvpacked
    B, L, H, Hkv, D = 2, 40, 4, 2, 16
    qkv = randn(B, L, (H + 2 * Hkv) * D, dtype=dtype, device=device, requires_grad=True)
    sinks = randn(H, dtype=torch.float32, device=device, requires_grad=True)
    slopes = (torch.rand(H) * 0.5).to(device)
    options = dict(window=(12, -1), softcap=4.0)

    def split(t):  # (B, L, (H + 2 Hkv) D) -> q (B, H, L, D), k, v (B, Hkv, L, D)
        t = t.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2)
        return t[:, :H], t[:, H:H + Hkv], t[:, H + Hkv:]

    def run(qkv, sinks):
        out, lse = attention_qkvpacked(qkv, H, Hkv, True, sinks=sinks, alibi_slopes=slopes, return_lse=True,
                                       **options)
        assert out.shape == (B, L, H * D)
        return out.unflatten(-1, (H, D)).transpose(1, 2), lse

    def ref(qkv, sinks, compute_dtype=None):
        return reference.attention(*split(qkv), True, None, sinks=sinks, alibi_slopes=slopes, return_lse=True,
                                   compute_dtype=compute_dtype, **options)

    check(run, ref, (qkv, sinks), ("qkv", "sinks"), lse_weight=True)
    _launched_once(launches)

    lens = [7, 0, 33]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    tokens = randn(sum(lens), (H + 2 * Hkv) * D, dtype=dtype, device=device, requires_grad=True)

    def run_varlen(tokens, sinks):
        out, lse = attention_varlen_qkvpacked(tokens, cu, 33, H, Hkv, causal=True, sinks=sinks,
                                              alibi_slopes=slopes, return_lse=True, **options)
        assert out.shape == (sum(lens), H * D)
        return out.unflatten(-1, (H, D)), lse

    def ref_varlen(tokens, sinks, compute_dtype=None):
        t = tokens.unflatten(-1, (H + 2 * Hkv, D))
        return reference.attention_varlen(t[:, :H], t[:, H:H + Hkv], t[:, H + Hkv:], cu, cu, True, None,
                                          sinks=sinks, alibi_slopes=slopes, return_lse=True,
                                          compute_dtype=compute_dtype, **options)

    check(run_varlen, ref_varlen, (tokens, sinks), ("tokens", "sinks"), lse_weight=True)
    assert launches["attention_fwd"] == launches["attention_bwd"] == 2


# ---------------------------------------------------------------------------------------------
# torch.library, torch.compile, bad input
# ---------------------------------------------------------------------------------------------

def test_scores_opcheck(device):
    B, H, Lq, Lk, D = 1, 2, 20, 30, 16
    q = torch.randn(B, H, Lq, D, device=device).half()
    k, v = (torch.randn(B, H, Lk, D, device=device).half() for _ in range(2))
    sinks, slopes = torch.randn(H, device=device), torch.rand(H, device=device)
    bias = torch.randn(1, H, Lq, Lk, device=device).half()
    mask = torch.rand(Lq, Lk, device=device) > 0.2
    ops = torch.ops.fused_block
    args = (None, None, True, 0.25, 0.0, 10, -1, 5.0, sinks, slopes, bias, mask)
    torch.library.opcheck(ops.attention_fwd.default, (q, k, v, *args))
    out, lse = ops.attention_fwd(q, k, v, *args)
    torch.library.opcheck(ops.attention_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), *args, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_scores_torch_compile_fullgraph(device, launches):
    B, H, L, D = 1, 2, 40, 16
    q, k, v = _qkv(B, H, H, L, L, D, torch.bfloat16, device)
    sinks = torch.randn(H, device=device, requires_grad=True)
    bias = torch.randn(1, H, L, L, device=device, dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.rand(H, device=device)

    def f(q, k, v, sinks, bias):
        out, lse = attention(q, k, v, True, softcap=4.0, sinks=sinks, alibi_slopes=slopes, bias=bias,
                             return_lse=True)
        return out.float().sum() + lse.sum()

    inputs = (q, k, v, sinks, bias)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs)
    g_got = torch.autograd.grad(got, inputs)
    want = f(*inputs)
    g_want = torch.autograd.grad(want, inputs)
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


# A per-key bias (rows summed per query block, then by torch) and T5's (1, Hq, L, L) summed by
# the strips' owners over the batch.
@pytest.mark.parametrize("bias_shape", [pytest.param((1, 2, 1, 70), id="keys"), pytest.param((1, 2, 70, 70), id="t5")])
def test_backward_is_deterministic(bias_shape, device):
    """Bias and sinks gradients (summed over broadcast dims and programs) are bitwise
    reproducible, as q's, k's and v's."""
    q, k, v = _qkv(2, 2, 1, 70, 70, 16, torch.float16, device)
    sinks = torch.randn(2, device=device, requires_grad=True)
    bias = torch.randn(*bias_shape, device=device, dtype=torch.float16, requires_grad=True)
    runs = []
    for _ in range(2):
        out = attention(q, k, v, True, sinks=sinks, bias=bias, softcap=3.0)
        runs.append(torch.autograd.grad(out.float().square().sum(), (q, k, v, sinks, bias)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _bad_scores(device):
    q = torch.zeros(2, 4, 10, 16, dtype=torch.float16, device=device)
    k = torch.zeros(2, 2, 12, 16, dtype=torch.float16, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    return [
        (dict(softcap=0.0), ValueError, "softcap must be > 0"),
        (dict(softcap=-1.0), ValueError, "softcap must be > 0"),
        (dict(softcap=True), TypeError, "softcap must be a number"),
        (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
        (dict(sinks=torch.zeros(3, **f32)), ValueError, r"sinks must have shape \(4,\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int32, device=device)), TypeError, "sinks must have dtype"),
        (dict(sinks=torch.zeros(1, 4, **f32)), ValueError, "sinks must be 1-D"),
        (dict(alibi_slopes=torch.zeros(3, **f32)), ValueError, r"alibi_slopes must have shape \(Hq,\)"),
        (dict(alibi_slopes=torch.zeros(4, dtype=torch.float16, device=device)), TypeError,
         "alibi_slopes must have dtype"),
        (dict(alibi_slopes=torch.zeros(3, 4, **f32)), ValueError, "alibi_slopes must have shape"),
        (dict(bias=torch.zeros(10, 13, **f32)), ValueError, "bias of shape .* does not broadcast"),
        (dict(bias=torch.zeros(1, 1, 1, 10, 12, **f32)), ValueError, "bias must have at most 4 dims"),
        (dict(bias=torch.zeros(10, 12, dtype=torch.bfloat16, device=device)), TypeError, "bias must have dtype"),
        (dict(mask=torch.zeros(10, 12, **f32)), TypeError, "mask must have dtype"),
        (dict(mask=torch.zeros(3, 1, 10, 12, dtype=torch.bool, device=device)), ValueError,
         "mask of shape .* does not broadcast"),
    ], q, k


@pytest.mark.parametrize("index", range(15))
def test_scores_bad_input(index, device, launches):
    cases, q, k = _bad_scores(device)
    kwargs, exc, match = cases[index]
    with pytest.raises(exc, match=match):
        attention(q, k, k, **kwargs)
    assert launches["attention_fwd"] == 0


def test_scores_bad_input_catalogue_is_complete(device):
    assert len(_bad_scores(device)[0]) == 15


def test_varlen_refuses_bias_and_mask(device, launches):
    from fused_block.attention import attention_varlen
    q = torch.zeros(10, 2, 16, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(Hq,\) = \(2,\) or \(B, Hq\) = \(2, 2\)"):
        attention_varlen(q, q, q, cu, cu, 6, 6, alibi_slopes=torch.zeros(3, 2, device=device))
    with pytest.raises(TypeError, match="unexpected keyword argument 'bias'"):
        attention_varlen(q, q, q, cu, cu, 6, 6, bias=torch.zeros(1, device=device))
    assert launches["attention_fwd"] == 0
