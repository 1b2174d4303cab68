"""Sliding-window attention (``window=(left, right)``) against the float64 reference, and the
block ranges the kernels iterate (only blocks that meet the band; masks only on its edges).

Interpreter blocks are 64 x 32 (forward), 32 x 64 / 64 x 32 (backward dK/dV, dQ): the windows
below are narrower and wider than those blocks, so bands start and end inside blocks, cover
whole blocks and leave whole blocks out on both sides.
"""
import pytest
import torch
import triton
import triton.language as tl

from attention_testing import check, path  # noqa: F401 - the fixture
from fused_block import reference
from fused_block.attention import attention, attention_qkvpacked
from fused_block.kernels.attention.helpers import _key_ranges, _query_ranges
from numerics import DTYPES, randn


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device):
    return (randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True))


def _run(causal, window, mask=None, dropout_p=0.0):
    def run(q, k, v):
        return attention(q, k, v, causal, None, mask, dropout_p, window=window, return_lse=True)
    return run


def _ref(causal, window, mask=None):
    def ref(q, k, v, compute_dtype=None):
        return reference.attention(q, k, v, causal, None, mask, window=window, return_lse=True,
                                   compute_dtype=compute_dtype)
    return ref


def _launched_once(launches):
    assert launches["attention_fwd"] == 1 and launches["attention_bwd_preprocess"] == 1
    assert launches["attention_bwd"] == 1


# (B, Hq, Hkv, Lq, Lk, D, causal, window), each with its reason.
CASES = [
    # Mistral/Gemma local attention: causal with a 16-key left window over 100 tokens; the band
    # (17 keys) is narrower than a block, so each query block has masked blocks on both edges.
    pytest.param(1, 2, 1, 100, 100, 32, True, (16, -1), id="causal-left16-gqa"),
    # Both sides bounded without causality, (20, 7); D = 24 (column padding), MHA.
    pytest.param(1, 2, 2, 90, 90, 24, False, (20, 7), id="two-sided-20-7"),
    # Cross-attention 40 x 130 (bottom-right offset 90), causal with a 50-key window: query
    # blocks skip the first key blocks entirely.
    pytest.param(2, 2, 2, 40, 130, 16, True, (50, -1), id="cross-40x130-causal-left50"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,window", CASES)
@pytest.mark.sweep
def test_window_matches_reference(B, Hq, Hkv, Lq, Lk, D, causal, window, dtype, device, path, launches):
    tensors = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    check(_run(causal, window), _ref(causal, window), tensors, ("q", "k", "v"), lse_weight=True)
    _launched_once(launches)


# Edge windows, fp16 (one dtype: the band logic does not depend on it): (Lq, Lk, causal, window).
EDGES = [
    # Width 0: every query sees exactly its diagonal key (bottom-right).
    pytest.param(70, 70, False, (0, 0), id="zero-width"),
    # Wider than the sequence on both sides: full attention.
    pytest.param(50, 50, False, (500, 500), id="wider-than-L"),
    # Right side only (non-causal): a shifted causal diagonal.
    pytest.param(60, 60, False, (-1, 3), id="right-only"),
    # Lq > Lk, causal with a left window: the first 80 queries see no key (output 0, grads 0).
    pytest.param(120, 40, True, (10, -1), id="more-queries-than-keys"),
    # causal=True overrides a right side (FlashAttention's rule): (8, 5) acts as (8, 0).
    pytest.param(45, 45, True, (8, 5), id="causal-overrides-right"),
]


@pytest.mark.parametrize("Lq,Lk,causal,window", EDGES)
def test_window_edges(Lq, Lk, causal, window, device, path, launches):
    tensors = _qkv(1, 2, 1, Lq, Lk, 16, torch.float16, device)
    check(_run(causal, window), _ref(causal, window), tensors, ("q", "k", "v"))
    _launched_once(launches)


def test_window_with_padding_and_dropout(device, launches):
    """The window combines with key padding and dropout (the kernels' own keep mask)."""
    from fused_block import _backend
    from fused_block.kernels import attention as kernels

    B, H, L, p = 2, 2, 80, 0.2
    q, k, v = _qkv(B, H, H, L, L, 32, torch.bfloat16, device)
    mask = torch.rand(B, L, generator=torch.Generator().manual_seed(1)) < 0.2
    mask = mask.to(device)
    torch.manual_seed(4)
    keep = kernels.dropout_keep_mask(_backend.dropout_seed(p, device), B, H, L, L, p, device)

    def ref(q, k, v, compute_dtype=None):
        return reference.attention(q, k, v, True, None, mask, p, window=(24, -1), dropout_mask=keep,
                                   return_lse=True, compute_dtype=compute_dtype)

    def run(q, k, v):
        torch.manual_seed(4)
        return attention(q, k, v, True, None, mask, p, window=(24, -1), return_lse=True)

    check(run, ref, (q, k, v), ("q", "k", "v"))
    _launched_once(launches)


def test_window_qkvpacked(device, launches):
    """The packed entry point takes the window too (its gradient lands in one buffer)."""
    B, L, H, D = 2, 50, 2, 16
    qkv = randn(B, L, 3 * H * D, dtype=torch.float16, device=device, requires_grad=True)

    def run(qkv):
        out, lse = attention_qkvpacked(qkv, H, causal=True, window=(12, -1), return_lse=True)
        return out, lse

    def ref(qkv, compute_dtype=None):
        t = qkv.unflatten(-1, (3 * H, D)).transpose(1, 2)
        out, lse = reference.attention(t[:, :H], t[:, H:2 * H], t[:, 2 * H:], True, window=(12, -1),
                                       return_lse=True, compute_dtype=compute_dtype)
        return out.transpose(1, 2).flatten(2), lse

    check(run, ref, (qkv,), ("qkv",))
    _launched_once(launches)


# ---------------------------------------------------------------------------------------------
# the block ranges: every visible (query, key) pair is visited, no block outside the band is,
# and the unmasked ranges hold only blocks every row sees whole
# ---------------------------------------------------------------------------------------------

@triton.jit
def _ranges_kernel(OUT, Lq, Lk, diag_hi, diag_lo, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, USE_TMA: tl.constexpr):
    pid = tl.program_id(0)
    nm = tl.cdiv(Lq, BLOCK_M)
    if pid < nm:
        lo, full_lo, full_hi, hi = _key_ranges(pid * BLOCK_M, Lk, diag_hi, diag_lo, BLOCK_N, BLOCK_M, IS_CAUSAL,
                                               WINDOW)
    else:
        lo, full_lo, full_hi, hi = _query_ranges((pid - nm) * BLOCK_N, Lq, diag_hi, diag_lo, BLOCK_M, BLOCK_N,
                                                 IS_CAUSAL, WINDOW, USE_TMA)
    tl.store(OUT + pid * 4, lo)
    tl.store(OUT + pid * 4 + 1, full_lo)
    tl.store(OUT + pid * 4 + 2, full_hi)
    tl.store(OUT + pid * 4 + 3, hi)


def _band(rows, cols, Lq, Lk, causal, window):
    """Visibility of queries ``rows`` x keys ``cols`` (ranges; may run past Lq, Lk)."""
    left, right = window
    right = 0 if causal else right
    i = torch.arange(rows)[:, None] + (Lk - Lq)
    j = torch.arange(cols)[None, :]
    vis = torch.ones(rows, cols, dtype=torch.bool)
    if right >= 0:
        vis &= j <= i + right
    if left >= 0:
        vis &= j >= i - left
    return vis


def _blocks(a, b, step):
    return set(range(a, max(a, b), step))


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("Lq,Lk", [(100, 100), (40, 130), (130, 40), (1, 200), (64, 64)])
@pytest.mark.parametrize("causal,window", [(True, (16, -1)), (False, (20, 7)), (False, (0, 0)),
                                           (True, (300, -1)), (False, (-1, 3)), (True, (-1, -1)),
                                           (False, (5, -1))])
def test_block_ranges_cover_the_band_and_nothing_else(Lq, Lk, causal, window, use_tma, device):
    """``_key_ranges`` (forward, dQ: per query block) and ``_query_ranges`` (dK/dV: per key
    block) against brute force: the masked and unmasked ranges are disjoint, visit every block
    holding a visible pair and no block whose pairs are all invisible (counting the rows and
    keys of a partial last block past Lq or Lk, which the kernels compute and never store):
    the work is L x band, not L^2. Unmasked blocks are wholly visible and in bounds (the
    partial last query block of the dK/dV steps on TMA only: its rows read as zero)."""
    BM, BN = 32, 16
    left, right = window
    right = 0 if causal else right
    is_causal, has_window = right >= 0, left >= 0
    diag_hi, diag_lo = Lk - Lq + max(right, 0), Lk - Lq - max(left, 0)
    nm, nn = -(-Lq // BM), -(-Lk // BN)
    out = torch.zeros((nm + nn) * 4, dtype=torch.int32, device=device)  # compiled on a GPU, interpreted here
    _ranges_kernel[(nm + nn,)](out, Lq, Lk, diag_hi, diag_lo, BM, BN, is_causal, has_window, use_tma)
    r = out.view(-1, 4).tolist()
    ext = _band(nm * BM, nn * BN, Lq, Lk, causal, window)  # with the partial blocks' extra rows and keys
    real = ext.clone()
    real[Lq:] = False
    real[:, Lk:] = False
    for m in range(nm):  # key blocks of query block m: rows past Lq computed, keys past Lk masked
        lo, full_lo, full_hi, hi = r[m]
        masked, unmasked = _blocks(lo, full_lo, BN) | _blocks(full_hi, hi, BN), _blocks(full_lo, full_hi, BN)
        assert not masked & unmasked
        for n in range(nn):
            tile = ext[m * BM:(m + 1) * BM, n * BN:min((n + 1) * BN, Lk)]
            visited = n * BN in masked | unmasked
            if real[m * BM:(m + 1) * BM, n * BN:(n + 1) * BN].any():
                assert visited, (m, n, r[m])
            if visited:
                assert tile.any(), (m, n, r[m])
            if n * BN in unmasked:
                assert (n + 1) * BN <= Lk and tile.all(), (m, n, r[m])
    for n in range(nn):  # query blocks of key block n: keys past Lk computed, never stored
        m_lo, head_end, full_end, m_end = r[nm + n]
        masked, unmasked = _blocks(m_lo, head_end, BM) | _blocks(full_end, m_end, BM), _blocks(head_end, full_end, BM)
        assert not masked & unmasked
        for m in range(nm):
            visited = m * BM in masked | unmasked
            if real[m * BM:(m + 1) * BM, n * BN:(n + 1) * BN].any():
                assert visited, (n, m, r[nm + n])
            if visited:
                assert ext[m * BM:min((m + 1) * BM, Lq), n * BN:(n + 1) * BN].any(), (n, m, r[nm + n])
            if m * BM in unmasked:
                assert ext[m * BM:min((m + 1) * BM, Lq), n * BN:min((n + 1) * BN, Lk)].all(), (n, m, r[nm + n])
                assert use_tma or (m + 1) * BM <= Lq, (n, m, r[nm + n])


def test_bad_window(device, launches):
    q = torch.zeros(1, 1, 8, 16, dtype=torch.float16, device=device)
    for window, exc, match in [((-2, 0), ValueError, "window's left size"),
                               ((0, -5), ValueError, "window's right"),
                               ((1,), TypeError, "window must be"),
                               ((1.0, 2), TypeError, "window's left size must be an int"),
                               (3, TypeError, "window must be")]:
        with pytest.raises(exc, match=match):
            attention(q, q, q, window=window)
    assert launches["attention_fwd"] == 0
