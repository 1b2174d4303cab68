"""SDPA's cuDNN and flash backends as candidates beside our attention kernels
(``fused_block._attn_sdpa``): which calls they may take (only where SDPA computes the same
function), each candidate's numerics through ``fused_block.attention`` and
``attention_qkvpacked`` against the float64 reference, and the once-per-bucket choice.

On a GPU the candidates run their own backends; on the CPU (no cuDNN or flash there) the same
calls run SDPA's math backend in their place, which checks the mapping of our arguments onto
SDPA's (causal alignment, GQA, scale, the packed layout)."""
import pytest
import torch

from attention_testing import ON_CUDA
from fused_block import _attn_sdpa, reference
from fused_block.attention import attention, attention_qkvpacked
from numerics import assert_close, randn

CANDIDATES = [_attn_sdpa.CUDNN, _attn_sdpa.FLASH]


@pytest.fixture
def candidate(request, monkeypatch):
    """Forces an SDPA candidate; on the CPU its calls run SDPA's math backend instead."""
    if not ON_CUDA:
        from torch.nn.attention import SDPBackend

        monkeypatch.setattr(_attn_sdpa, "backend_of", lambda c: SDPBackend.MATH)
    before = _attn_sdpa.force(request.param)
    yield request.param
    _attn_sdpa.force(before)


def _qkv(B, Hq, Hkv, L, D, dtype, device):
    return [randn(B, h, L, D, dtype=dtype, device=device, requires_grad=True) for h in (Hq, Hkv, Hkv)]


def _check(run, ref, tensors, names):
    """Output and every input's gradient against the float64 reference (torch's own error in
    the tensors' dtype as the baseline)."""
    out = run(*tensors)
    dout = randn(*out.shape, dtype=out.dtype, device=out.device)
    grads = torch.autograd.grad(out, tensors, dout)
    leaves64 = [t.detach().double().requires_grad_() for t in tensors]
    out64 = ref(*leaves64)
    grads64 = torch.autograd.grad(out64, leaves64, dout.double())
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    base = ref(*leaves, compute_dtype=tensors[0].dtype)
    base_grads = torch.autograd.grad(base, leaves, dout)
    assert_close("out", out, out64, base)
    for name, g, g64, gb in zip(names, grads, grads64, base_grads):
        assert_close(f"grad of {name}", g, g64, gb)


@pytest.mark.parametrize("causal,Hkv", [(True, 2), (False, 1)], ids=["causal-gqa", "full-mqa"])
@pytest.mark.parametrize("candidate", CANDIDATES, indirect=True)
def test_sdpa_candidate_matches_the_reference(candidate, causal, Hkv, device, launches):
    """``attention`` routed to the candidate: causal (Lq == Lk) with GQA 4:2, and full with
    MQA, at a non-default scale; none of our kernels runs."""
    q, k, v = _qkv(2, 4, Hkv, 40, 64, torch.bfloat16, device)

    def ref(q, k, v, compute_dtype=None):
        return reference.attention(q, k, v, causal, 0.3, compute_dtype=compute_dtype)

    _check(lambda q, k, v: attention(q, k, v, causal, 0.3), ref, (q, k, v), "qkv")
    assert launches["attention_fwd"] == 0 and launches["attention_bwd"] == 0


@pytest.mark.parametrize("candidate", CANDIDATES, indirect=True)
def test_sdpa_candidate_packed(candidate, device, launches):
    """``attention_qkvpacked`` routed to the candidate: q, k, v views of the packed projection
    (GQA 4:2, causal), the output in the projection's layout, one gradient for qkv."""
    B, L, H, Hkv, D = 2, 24, 4, 2, 32
    qkv = randn(B, L, (H + 2 * Hkv) * D, dtype=torch.float16, device=device, requires_grad=True)

    def ref(qkv, compute_dtype=None):
        t = qkv.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2)
        q, k, v = t[:, :H], t[:, H:H + Hkv], t[:, H + Hkv:]
        return reference.attention(q, k, v, True, compute_dtype=compute_dtype).transpose(1, 2).flatten(2)

    _check(lambda qkv: attention_qkvpacked(qkv, H, Hkv, causal=True), ref, (qkv,), ["qkv"])
    assert launches["attention_fwd"] == 0


def _args(q, k, **over):
    """``expresses``'s arguments for a plain call, with ``over`` changed."""
    a = dict(causal=False, key_padding_mask=None, dropout_p=0.0, window=(-1, -1), softcap=0.0, sinks=None,
             alibi_slopes=None, bias=None, mask=None, return_lse=False)
    a.update(over)
    return a


def test_sdpa_takes_only_what_it_computes():
    """Everything SDPA would compute differently stays ours: key padding, a mask or bias, a
    window, softcap, sinks, ALiBi, dropout (another generator's mask), the LSE, fp32 (our
    precision rule), and causal with Lq != Lk (SDPA's causal mask is top-left aligned)."""
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert _attn_sdpa.expresses(q, k, v, **_args(q, k))
    assert _attn_sdpa.expresses(q, k, v, **_args(q, k, causal=True))
    refused = [dict(key_padding_mask=torch.zeros(1, 8, dtype=torch.bool)), dict(dropout_p=0.1),
               dict(window=(4, -1)), dict(softcap=30.0), dict(sinks=torch.zeros(4)),
               dict(alibi_slopes=torch.ones(4)), dict(bias=torch.zeros(1, 1, 8, 8)),
               dict(mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)), dict(return_lse=True)]
    for over in refused:
        assert not _attn_sdpa.expresses(q, k, v, **_args(q, k, **over)), over
    k_long = v_long = torch.randn(1, 2, 12, 16, dtype=torch.bfloat16)
    assert _attn_sdpa.expresses(q, k_long, v_long, **_args(q, k_long))
    assert not _attn_sdpa.expresses(q, k_long, v_long, **_args(q, k_long, causal=True))
    q32, k32 = q.float(), k.float()
    assert not _attn_sdpa.expresses(q32, k32, k32, **_args(q32, k32))


def test_gqa_stays_ours_where_sdpa_lacks_it(monkeypatch):
    """SDPA takes grouped K/V heads from torch 2.5 (``enable_gqa``); the package allows torch
    2.4, where a GQA call is ours and the same heads' call SDPA's."""
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(_attn_sdpa, "_SDPA_GQA", False)
    assert not _attn_sdpa.expresses(q, k, k, **_args(q, k))
    assert _attn_sdpa.expresses(q, q, q, **_args(q, q))


@pytest.mark.parametrize("candidate", CANDIDATES, indirect=True)
def test_sdpa_candidate_output_in_q_memory_order(candidate, device, launches):
    """The documented layout whatever the backend returns: q, k, v (B, H, L, D) views of
    (B, L, H, D) tensors give an output laid out (B, L, H, D), which callers view to merge
    heads (SDPA's math backend returns (B, H, L, D))."""
    B, L, H, D = 2, 16, 4, 32
    tensors = [randn(B, L, H, D, dtype=torch.bfloat16, device=device).transpose(1, 2).requires_grad_()
               for _ in range(3)]
    out = attention(*tensors, causal=True)
    assert out.transpose(1, 2).is_contiguous()
    out.transpose(1, 2).view(B, L, H * D)  # no copy needed
    _check(lambda q, k, v: attention(q, k, v, causal=True),
           lambda q, k, v, compute_dtype=None: reference.attention(q, k, v, True, compute_dtype=compute_dtype),
           tensors, "qkv")
    assert launches["attention_fwd"] == 0


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("candidate", [_attn_sdpa.CUDNN], indirect=True)
def test_a_call_the_chosen_backend_refuses_runs_ours(candidate, packed, device, launches, monkeypatch):
    """A bucket's verdict does not record everything a backend checks (strides, alignment,
    exact lengths): where the chosen SDPA backend refuses the tensors (torch's "No available
    kernel"), the call runs our kernel and gets its answer; any other error is raised."""
    def refuse(*args):
        raise RuntimeError("No available kernel.  Aborting execution.")

    monkeypatch.setattr(_attn_sdpa, "run", refuse)
    B, L, H, D = 2, 16, 4, 32
    if packed:
        qkv = randn(B, L, 3 * H * D, dtype=torch.bfloat16, device=device, requires_grad=True)

        def ref(qkv, compute_dtype=None):
            q, k, v = qkv.unflatten(-1, (3 * H, D)).transpose(1, 2).split(H, dim=1)
            return reference.attention(q, k, v, True, compute_dtype=compute_dtype).transpose(1, 2).flatten(2)

        _check(lambda qkv: attention_qkvpacked(qkv, H, H, causal=True), ref, (qkv,), ["qkv"])
    else:
        _check(lambda q, k, v: attention(q, k, v, causal=True),
               lambda q, k, v, compute_dtype=None: reference.attention(q, k, v, True, compute_dtype=compute_dtype),
               _qkv(B, H, H, L, D, torch.bfloat16, device), "qkv")
    assert launches["attention_fwd"] == 1 and launches["attention_bwd"] == 1

    def fail(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(_attn_sdpa, "run", fail)
    q, k, v = _qkv(B, H, H, L, D, torch.bfloat16, device)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        attention(q, k, v, causal=True)


def test_choice_is_timed_once_per_bucket_and_listed(monkeypatch):
    """The first call of a bucket times the candidates (here a stand-in timing) and keeps the
    fastest; later calls of the bucket reuse it without timing; ``choices()`` lists it. Under
    deterministic algorithms, saved-tensor hooks, or with FUSED_BLOCK_TUNE=0, our kernels (no
    timing)."""
    from fused_block.kernels import common

    monkeypatch.setattr(_attn_sdpa, "_CHOSEN", {})
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "TUNE", True)  # timing on, whatever FUSED_BLOCK_TUNE says (GPU runs set 0)
    calls = []

    def fake_time(grad, leaves, fns, ours):
        calls.append(sorted(fns))
        return {_attn_sdpa.TRITON: 2.0, _attn_sdpa.CUDNN: 1.0, _attn_sdpa.FLASH: 3.0}

    monkeypatch.setattr(_attn_sdpa, "time_candidates", fake_time)
    before = _attn_sdpa.force(None)
    try:
        q = torch.randn(2, 4, 100, 64, dtype=torch.bfloat16)
        k = torch.randn(2, 2, 100, 64, dtype=torch.bfloat16)
        timed = lambda: ([q, k], {c: None for c in _attn_sdpa.CANDIDATES})  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # non-reentrant checkpointing
            assert _attn_sdpa.choose(q, k, True, True, timed) == _attn_sdpa.TRITON  # untimed, no verdict kept
        assert not calls
        assert _attn_sdpa.choose(q, k, True, True, timed) == _attn_sdpa.CUDNN
        q2 = torch.randn(2, 4, 120, 64, dtype=torch.bfloat16)  # the same bucket (128 rows)
        k2 = torch.randn(2, 2, 120, 64, dtype=torch.bfloat16)
        assert _attn_sdpa.choose(q2, k2, True, True, timed) == _attn_sdpa.CUDNN
        assert len(calls) == 1
        (bucket, (best, times)), = _attn_sdpa.choices().items()
        assert best == _attn_sdpa.CUDNN and times[_attn_sdpa.TRITON] == 2.0 and torch.bfloat16 in bucket
        torch.use_deterministic_algorithms(True)
        try:
            assert _attn_sdpa.choose(q, k, True, True, timed) == _attn_sdpa.TRITON
        finally:
            torch.use_deterministic_algorithms(False)
        monkeypatch.setattr(common, "TUNE", False)
        q3 = torch.randn(2, 4, 1000, 64, dtype=torch.bfloat16)  # a new bucket, untimed
        assert _attn_sdpa.choose(q3, q3, False, False, timed) == _attn_sdpa.TRITON
        assert len(calls) == 1
    finally:
        _attn_sdpa.force(before)


def test_forcing_checks_its_argument():
    with pytest.raises(ValueError, match="candidate"):
        _attn_sdpa.force("cudnn")
