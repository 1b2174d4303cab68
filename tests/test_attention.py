"""fused_block.attention / attention_qkvpacked against the float64 reference (interpreter on CPU,
unchanged on CUDA).

Shapes are a covering set, not a cross product: the interpreter runs every program in Python,
so long sequences and D = 256 appear in a few cases with B * H small. Interpreter blocks are
64 x 32 (forward), 32 x 64 (dK/dV: queries per step x keys per program) and 64 x 32 (dQ), so
17, 128, 200 and 1000 cross them in every way. Both data paths run: the TMA path (tensor
descriptors; the interpreter's default wherever the layout is 16-byte aligned, as on Hopper)
and the pointer path (``FORCE_PATH = "pointer"``, Ampere's and unaligned layouts').
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_block
from fused_block import _backend, reference
from fused_block.attention import attention, attention_qkvpacked
from fused_block.kernels import attention as kernels
from fused_block.kernels.attention import configs, launchers
from fused_block.kernels import common
import attention_testing
from attention_testing import path  # noqa: F401 - the fixture
from gemm_testing import baseline_mode, fp32_mode
from numerics import ATOL, DTYPES, assert_close, assert_compiled_matches_eager, randn

ON_CUDA, HOPPER = attention_testing.ON_CUDA, attention_testing.HOPPER


@pytest.mark.parametrize("mode", [None, "ieee", "tf32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_path_check_agrees_with_the_kernels_on_hopper(dtype, mode, monkeypatch):
    """The ``path`` fixture's expectation on Hopper is the launcher's own choice for aligned
    inputs at the test's fp32 precision (its ``mode`` parameter, else torch's default): TMA,
    except IEEE fp32 on pointers."""
    monkeypatch.setattr(attention_testing, "HOPPER", True)
    params = {"dtype": dtype} if mode is None else {"dtype": dtype, "mode": mode}
    node = type("Item", (), {"callspec": type("CallSpec", (), {"params": params})()})()
    with fp32_mode(mode or "ieee"):
        kind = configs._kind(dtype)
    assert attention_testing.expects_tma("tma", node) == launchers._use_tma(90, kind, ())
    assert not attention_testing.expects_tma("pointer", node)


def _padding(B, Lk, device, full_row=True, generator=None):
    """Random padding (True = pad); batch 0 fully padded when ``full_row`` (rows with no key)."""
    mask = torch.rand(B, Lk, generator=generator) < 0.3
    if full_row:
        mask[0] = True
    return mask.to(device)


def _leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]


def _compare(q, k, v, causal=False, mask=None, dropout_p=0.0, dropout_mask=None, scale=None, out=None, lse=None,
             grads=True, mode="ieee", **features):
    """Check ``attention(q, k, v, ...)`` (or the given ``out``/``lse``) and its gradients against
    the float64 reference, with PyTorch's own error in q's dtype as the baseline; fp32 runs
    the kernels and the baseline in torch's fp32 matmul ``mode`` ("ieee" or "tf32"); ``features``
    (keyword options such as ``window``) go to both."""
    dtype = q.dtype
    dout = randn(*q.shape[:3], v.shape[3], dtype=dtype, device=q.device)
    with fp32_mode(mode):
        if out is None:
            out, lse = attention(q, k, v, causal, scale, mask, dropout_p, return_lse=True, **features)
        got = torch.autograd.grad(out, (q, k, v), dout) if grads else None
    ref_kw = dict(dropout_mask=dropout_mask, return_lse=True, **features)
    leaves64 = _leaves((q, k, v), torch.float64)
    ref64, lse64 = reference.attention(*leaves64, causal, scale, mask, dropout_p, **ref_kw)
    leaves_lp = _leaves((q, k, v))
    with baseline_mode(dtype, mode):
        base, base_lse = reference.attention(*leaves_lp, causal, scale, mask, dropout_p, compute_dtype=dtype,
                                             **ref_kw)
        want_lp = torch.autograd.grad(base, leaves_lp, dout) if grads else None
    assert out.dtype == dtype
    assert_close("out", out, ref64, base)
    if lse is not None:
        assert lse.dtype == torch.float32
        assert_close("lse", lse, lse64, base_lse, atol=ATOL[dtype])
    if not grads:
        return
    for name, g, g64, gb in zip(("dq", "dk", "dv"), got, torch.autograd.grad(ref64, leaves64, dout.double()),
                                want_lp):
        assert g.dtype == dtype
        assert_close(name, g, g64, gb)


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device):
    return (randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True))


def _launched_once(launches):
    assert launches["attention_fwd"] == 1 and launches["attention_bwd_preprocess"] == 1
    assert launches["attention_bwd"] == 1  # dK/dV and dQ in one kernel


# (B, Hq, Hkv, Lq, Lk, D, causal, padding), each with its reason.
CASES = [
    # Lq = Lk = 128: whole blocks; causal diagonal blocks, and blocks skipped above it.
    pytest.param(1, 2, 2, 128, 128, 64, True, False, id="self-128-causal-d64"),
    # Lq = 17 < Lk = 200: cross-attention, partial blocks, bottom-right causal offset 183
    # (not a block multiple); D = 80 padded to 128 (TMA zero-pads the columns); MQA 4:1.
    pytest.param(1, 4, 1, 17, 200, 80, True, False, id="cross-17x200-causal-d80-mqa"),
    # Lq = 200 > Lk = 17: under causal the first 183 queries see no key (output 0);
    # D = 16, the smallest head dim; GQA 8:2.
    pytest.param(1, 8, 2, 200, 17, 16, True, False, id="cross-200x17-causal-d16-gqa"),
    # Lq = 1: one decoding step against a 200-key cache, with padding.
    pytest.param(2, 2, 1, 1, 200, 64, True, True, id="decode-1x200-causal-pad"),
    # Lk = 1: a single key; bidirectional with padding, so batch 0 has no key at all.
    pytest.param(2, 2, 2, 17, 1, 32, False, True, id="17x1-pad"),
    # Lq = Lk = 140 non-causal: partial last blocks in both grids; padding including a
    # fully padded batch row; D = 128, MQA 2:1.
    pytest.param(2, 2, 1, 140, 140, 128, False, True, id="self-140-pad-d128"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding", CASES)
@pytest.mark.sweep
def test_attention_matches_reference(B, Hq, Hkv, Lq, Lk, D, causal, padding, dtype, device, launches):
    """Every case and dtype on the default path (TMA in the interpreter and on Hopper)."""
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    mask = _padding(B, Lk, device) if padding else None
    _compare(q, k, v, causal, mask)
    _launched_once(launches)


@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding", CASES)
def test_attention_pointer_path(B, Hq, Hkv, Lq, Lk, D, causal, padding, device, launches, monkeypatch):
    """The same cases on the pointer path (row and head-dim masks instead of descriptors), in
    fp16 (the path's loads and stores do not depend on the dtype)."""
    monkeypatch.setattr(launchers, "FORCE_PATH", "pointer")
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, torch.float16, device)
    mask = _padding(B, Lk, device) if padding else None
    _compare(q, k, v, causal, mask)
    _launched_once(launches)
    assert launches["attention_tma"] == 0


# The warp-specialized forward (Hopper WS candidates, opt-in: FUSED_BLOCK_WS=1; device-side
# descriptors, one K/V loop, every block masked under causality): (B, Hq, Hkv, Lq, Lk, D,
# causal, padding).
WS_CASES = [
    # Non-causal over whole key blocks (Lk = 128: four of the interpreter's 32, two of the sm_90
    # WS candidates' 64; WS candidates need them), a ragged query block (Lq = 70), GQA 2:1,
    # padding with a fully padded row.
    pytest.param(2, 2, 1, 70, 128, 64, False, True, id="full-pad-gqa"),
    # Causal with a ragged key end (Lk = 50) and offset diagonal; D = 80 (zero-padded columns).
    pytest.param(1, 2, 2, 40, 50, 80, True, False, id="causal-ragged-d80"),
]



# The scheduled kernels (configs' timed candidates): the longest-first order (1) and its
# persistent grid (2: four programs in the interpreter, several tiles each, the snake order's
# reversed rounds), forward and backward (dK/dV and dQ programs). Cases: whole causal blocks
# with a head per L2 group; non-causal partial blocks with padding (a fully padded batch) and
# MQA, 4 (batch, head) pairs in groups of 3 and 1 (a partial last group); a causal window
# over cross-attention (dense band class).
SCHED_CASES = [
    pytest.param(1, 2, 2, 128, 128, 64, True, False, (-1, -1), 1, id="self-128-causal-d64"),
    pytest.param(2, 2, 1, 140, 140, 128, False, True, (-1, -1), 3, id="self-140-pad-d128-groups-3-1"),
    pytest.param(1, 2, 2, 90, 120, 32, True, False, (40, -1), 2, id="cross-90x120-causal-window"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sched", (1, 2))
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding,window,group", SCHED_CASES)
@pytest.mark.sweep
def test_scheduled_forward(B, Hq, Hkv, Lq, Lk, D, causal, padding, window, group, sched, dtype, device, launches,
                           monkeypatch):
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    per_head = 2 * Lk * D * k.element_size() * Hkv // Hq  # launchers._l2_heads: K/V bytes per query head
    seen = attention_testing.forced_schedule(monkeypatch, sched, l2_budget=group * per_head)
    assert launchers._l2_heads(k, Lk, Hq, B) == group
    mask = _padding(B, Lk, device) if padding else None
    _compare(q, k, v, causal, mask, window=window)
    _launched_once(launches)
    assert [s[:2] for s in seen] == [("attention_fwd", sched), ("attention_bwd", sched)]
    tiles = -(-Lq // configs.INTERPRET_FWD["BLOCK_M"]) * B * Hq
    if device.type == "cpu":
        assert seen[0][3] == ((min(tiles, common.sm_count(device)) if sched == 2 else tiles),)
        assert sched == 1 or seen[1][3][0] <= common.sm_count(device)


# The backward's host-side descriptors (configs' ``HOST_DESC`` candidates, forced): every tile
# of Q, K, V, dO, the statistics, dQ, dK and dV through the launcher's (B, H, L, D)
# descriptors (mode 1), or those a program reads or writes once (2). Cases: causal whole
# blocks; two batches (the batch coordinate), GQA 2:1, padding with a fully padded batch and
# partial blocks (rows past Lq and Lk read as zero, stores clipped); a causal window over
# cross-attention (the band class) with D = 32 (BLOCK_D 64: zero columns); softcap with MQA
# 2:1 (the score class's steps).
HOST_DESC_CASES = [
    pytest.param(1, 2, 2, 128, 128, 64, True, False, {}, id="self-128-causal-d64"),
    pytest.param(2, 4, 2, 140, 140, 128, False, True, {}, id="self-140-pad-d128-gqa"),
    pytest.param(1, 2, 2, 90, 120, 32, True, False, dict(window=(40, -1)), id="cross-90x120-causal-window"),
    pytest.param(1, 2, 1, 70, 70, 64, True, False, dict(softcap=30.0), id="self-70-causal-softcap-mqa"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", (1, 2))
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding,features", HOST_DESC_CASES)
@pytest.mark.sweep
def test_host_descriptor_backward(B, Hq, Hkv, Lq, Lk, D, causal, padding, features, mode, dtype, device, launches,
                                  monkeypatch):
    if device.type == "cuda" and not attention_testing.HOPPER:
        pytest.skip("host-side TMA descriptors are a Hopper candidate")
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    seen = attention_testing.forced_host_desc(monkeypatch, mode)
    mask = _padding(B, Lk, device) if padding else None
    before = common.LAUNCHES["attention_tma"]
    _compare(q, k, v, causal, mask, **features)
    _launched_once(launches)
    if device.type == "cuda" and dtype == torch.float32:
        # Hopper runs IEEE fp32 on pointers (launchers._use_tma): the descriptors are not built.
        assert seen == [(mode, 0)]
    else:
        assert common.LAUNCHES["attention_tma"] > before
        # backward._attn_bwd's 12 host-side descriptors, or (2) the 7 of the tiles read or written once
        assert seen == [(mode, 12 if mode == 1 else 7)]


@pytest.mark.parametrize("mode", (1, 2))
def test_host_descriptor_backward_strided(mode, device, launches, monkeypatch):
    """The host-side descriptors over (B, L, H, D) buffers viewed as (B, H, L, D) (a model's
    projections transposed: head stride D, row stride H * D), gradients in the same layout;
    bf16, causal GQA 2:1 with partial blocks (L = 100)."""
    if device.type == "cuda" and not attention_testing.HOPPER:
        pytest.skip("host-side TMA descriptors are a Hopper candidate")
    B, Hq, Hkv, L, D = 2, 4, 2, 100, 64
    q, k, v = (randn(B, L, h, D, dtype=torch.bfloat16, device=device).transpose(1, 2).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    seen = attention_testing.forced_host_desc(monkeypatch, mode)
    _compare(q, k, v, True)
    _launched_once(launches)
    assert seen == [(mode, 12 if mode == 1 else 7)]


def _ws_forward(monkeypatch, switch=True):
    """Sets FUSED_BLOCK_WS's switch (``switch``) for this test, with a fresh forward config
    cache and on CUDA each key's first candidate taken (FUSED_BLOCK_TUNE=0: with the switch, a
    WS candidate where the launch can run it); returns the list the forward's launches append
    their config's ``WS`` to."""
    if ON_CUDA and not HOPPER:
        pytest.skip("warp specialization is a Hopper candidate")
    monkeypatch.setattr(common, "WARP_SPECIALIZE", switch)
    monkeypatch.setattr(common, "TUNE", False)
    monkeypatch.setattr(launchers, "_FWD_CACHE", common.ConfigCache("attention_fwd"))
    ws = []
    launch = common.launch

    def record(name, kernel, grid, args, constexprs, config):
        if name == "attention_fwd":
            ws.append(config["WS"])
        return launch(name, kernel, grid, args, constexprs, config)

    monkeypatch.setattr(common, "launch", record)
    return ws


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding", WS_CASES)
def test_warp_specialized_forward(B, Hq, Hkv, Lq, Lk, D, causal, padding, dtype, device, launches, monkeypatch):
    """The WS forward's code path (the interpreter ignores ``warp_specialize`` but runs the
    body it marks) against the reference, with gradients through the regular backward."""
    ws = _ws_forward(monkeypatch)
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    mask = _padding(B, Lk, device) if padding else None
    _compare(q, k, v, causal, mask)
    assert ws and all(ws)
    _launched_once(launches)


def test_warp_specialized_forward_needs_whole_key_blocks(device, launches, monkeypatch):
    """Without causality a ragged key end (Lk = 50) would need a masked block: the WS
    candidate is not run there (its single loop is unmasked), the regular forward is."""
    ws = _ws_forward(monkeypatch)
    q, k, v = _qkv(1, 2, 2, 33, 50, 64, torch.bfloat16, device)
    _compare(q, k, v, False, grads=False)
    assert ws and not any(ws)


def test_warp_specialized_forward_is_opt_in(device, monkeypatch):
    """Without FUSED_BLOCK_WS=1 no WS candidate is run (nor timed), also where one could run
    (whole key blocks); with it, the sm_90 tables' WS candidates come first."""
    ws = _ws_forward(monkeypatch, switch=False)
    q, k, v = _qkv(1, 2, 2, 33, 64, 64, torch.bfloat16, device)
    _compare(q, k, v, False, grads=False)
    assert ws and not any(ws)
    key = configs._table_key(64, "16", False)
    assert not any(c["WS"] for c in launchers._fwd_candidates(90, key, True, False, 128))
    monkeypatch.setattr(common, "WARP_SPECIALIZE", True)
    cands = launchers._fwd_candidates(90, key, True, False, 128)
    assert cands[0]["WS"] and [c for c in cands if not c["WS"]] == [c for c in configs.FWD_CONFIGS[90][key]
                                                                     if not c["WS"]]
    # A ragged key end without causality: no WS candidate; the pointer path: its first config.
    assert not any(c["WS"] for c in launchers._fwd_candidates(90, key, True, False, 100))
    assert launchers._fwd_candidates(90, key, False, True, 128) == configs.FWD_CONFIGS[90][key][:1]


def test_ws_candidates_follow_the_first():
    """Every table's first candidate is the proven non-WS config; WS candidates only on
    sm_90, for 16-bit classes without dropout, with 128-row query blocks (Q split between two
    consumer warpgroups) and 4 warps."""
    for arch, table in configs.FWD_CONFIGS.items():
        for (block_d, kind, dropout, cls), cfgs in table.items():
            assert not cfgs[0]["WS"]
            for c in cfgs:
                if c["WS"]:
                    assert (arch, kind, dropout, cls, c["BLOCK_M"], c.num_warps) == (90, "16", False, "plain", 128, 4)


# Long and wide shapes, one dtype each (interpreter time): they add block-count and width.
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,padding,dtype", [
    # Lq = Lk = 520: 9 x 17 blocks, the online softmax rescales across many key blocks.
    pytest.param(1, 1, 1, 520, 520, 64, True, False, torch.bfloat16, id="self-520-causal-bf16"),
    # Lq = 128 queries over Lk = 1000 keys, non-causal with padding.
    pytest.param(1, 1, 1, 128, 1000, 64, False, True, torch.float16, id="cross-128x1000-pad-fp16"),
    # D = 256, the widest head dim: dV and dK in programs of their own (split_kv).
    pytest.param(1, 2, 1, 128, 17, 256, False, False, torch.float16, id="d256-fp16"),
    pytest.param(1, 1, 1, 200, 128, 256, True, False, torch.bfloat16, id="d256-causal-bf16"),
    # fp32 at D = 128, its widest.
    pytest.param(1, 2, 1, 70, 50, 128, True, False, torch.float32, id="d128-fp32"),
])
def test_attention_large(B, Hq, Hkv, Lq, Lk, D, causal, padding, dtype, device, launches):
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    mask = _padding(B, Lk, device, full_row=False) if padding else None
    _compare(q, k, v, causal, mask)
    _launched_once(launches)


def test_d256_pointer_path(device, launches, monkeypatch):
    """split_kv's dV and dK programs on the pointer path too (GQA 2:1, causal, padding)."""
    monkeypatch.setattr(launchers, "FORCE_PATH", "pointer")
    q, k, v = _qkv(1, 2, 1, 40, 70, 256, torch.bfloat16, device)
    _compare(q, k, v, True, _padding(1, 70, device, full_row=False))
    _launched_once(launches)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views_of_fused_qkv(dtype, device, path, launches):
    """q, k, v as views of one (B, L, 3, H, D) projection: no copy, same result; the output is
    laid out (B, L, H, D) like q, so merging its heads is a view."""
    B, L, H, D = 2, 33, 2, 32
    qkv = randn(B, L, 3, H, D, dtype=dtype, device=device, requires_grad=True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, L, D), strided
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = attention(q, k, v, True, 0.3)
    assert out.transpose(1, 2).is_contiguous()
    _compare(q, k, v, causal=True, scale=0.3)
    assert launches["attention_fwd"] == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lse_gradient(dtype, device, path, launches):
    """The LSE output is differentiable: d lse_i / d s_ij = P_ij (folded into delta)."""
    q, k, v = _qkv(1, 2, 1, 40, 70, 32, dtype, device)
    mask = _padding(1, 70, device, full_row=False)
    out, lse = attention(q, k, v, True, None, mask, return_lse=True)
    leaves64, leaves_lp = _leaves((q, k, v), torch.float64), _leaves((q, k, v))
    ref64, lse64 = reference.attention(*leaves64, True, None, mask, return_lse=True)
    base, base_lse = reference.attention(*leaves_lp, True, None, mask, return_lse=True, compute_dtype=dtype)
    w = randn(*lse.shape, dtype=torch.float32, device=device)

    def loss(o, l):
        return o.float().sum() + (l.float() * w).sum()

    g = torch.autograd.grad(loss(out, lse), (q, k, v))
    g64 = torch.autograd.grad(loss(ref64, lse64), leaves64)
    gb = torch.autograd.grad(loss(base, base_lse), leaves_lp)
    for name, a, r, b in zip(("dq", "dk", "dv"), g, g64, gb):
        assert_close(name, a, r, b)
    _launched_once(launches)


def test_only_lse_used(device, launches):
    """A loss on the LSE alone: the output's gradient is None (not a materialized zero)."""
    q, k, v = _qkv(1, 2, 2, 20, 30, 16, torch.float32, device)
    _, lse = attention(q, k, v, return_lse=True)
    g = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    leaves64 = _leaves((q, k, v), torch.float64)
    g64 = torch.autograd.grad(reference.attention(*leaves64, return_lse=True)[1].sum(), leaves64,
                              allow_unused=True)
    torch.testing.assert_close(g[0].double(), g64[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g[1].double(), g64[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(g[2], torch.zeros_like(g[2]))  # the LSE does not depend on v


def test_fully_masked_rows_are_zero_with_finite_grads(device, path, launches):
    """No visible key (padding + Lq > Lk causal): out 0, LSE -inf, grads 0 and finite."""
    q, k, v = _qkv(2, 2, 1, 40, 9, 16, torch.bfloat16, device)
    mask = torch.zeros(2, 9, dtype=torch.bool, device=device)
    mask[1] = True
    out, lse = attention(q, k, v, True, None, mask, return_lse=True)
    assert torch.all(out[1] == 0) and torch.all(out[0, :, :31] == 0)
    assert torch.all(lse[1] == float("-inf")) and torch.all(torch.isfinite(lse[0, :, 31:]))
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    for g in (dq, dk, dv):
        assert torch.all(torch.isfinite(g))
    assert torch.all(dq[1] == 0) and torch.all(dk[1] == 0) and torch.all(dv[1] == 0)
    assert torch.all(dq[0, :, :31] == 0)


@pytest.mark.parametrize("shape", [(0, 2, 5, 16), (2, 2, 0, 16)], ids=["B0", "L0"])
def test_empty_inputs(shape, device, launches):
    """No query or no key: empty or zero outputs and gradients, no kernel launch."""
    q = randn(*shape, dtype=torch.float16, device=device, requires_grad=True)
    k = randn(shape[0], 2, 7 if shape[2] == 0 else 0, 16, dtype=torch.float16, device=device, requires_grad=True)
    v = randn(*k.shape, dtype=torch.float16, device=device, requires_grad=True)
    out = attention(q, k, v)
    assert out.shape == q.shape and torch.all(out == 0)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    for t, g in zip((q, k, v), grads):
        assert g.shape == t.shape and torch.all(g == 0)
    assert launches["attention_fwd"] == 0 and launches["attention_bwd"] == 0


# ---------------------------------------------------------------------------------------------
# fp32 precision: the kernels follow torch's matmul setting at call time
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["ieee", "tf32"])
def test_fp32_follows_torch_matmul_precision(mode, device, launches, monkeypatch):
    """fp32 runs IEEE products under torch's default and TF32 once torch allows TF32 for
    matmuls (the mode is in the config key); each is held to PyTorch's error in that mode
    (TF32: products of TF32-rounded operands, as cuBLAS would on every shape)."""
    monkeypatch.setattr(launchers, "_FWD_CACHE", common.ConfigCache("attention_fwd"))
    monkeypatch.setattr(launchers, "_BWD_CACHE", common.ConfigCache("attention_bwd"))
    q, k, v = _qkv(1, 2, 1, 40, 50, 64, torch.float32, device)
    with fp32_mode(mode):
        assert common.fp32_precision() == mode
    _compare(q, k, v, True, _padding(1, 50, device, full_row=False), mode=mode)
    for cache in (launchers._FWD_CACHE, launchers._BWD_CACHE):
        assert [key[1][1] for key in cache.chosen] == [mode]
    _launched_once(launches)


# ---------------------------------------------------------------------------------------------
# the packed self-attention entry point
# ---------------------------------------------------------------------------------------------

class _AtenOps(TorchDispatchMode):
    """Records the aten ops that run (to prove the packed path copies nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _packed_reference(qkv, H, Hkv, batch_first, causal, mask, scale=None, dropout_p=0.0, dropout_mask=None,
                      compute_dtype=None):
    t = qkv.unflatten(-1, (H + 2 * Hkv, -1))
    t = t.transpose(1, 2) if batch_first else t.permute(1, 2, 0, 3)
    o = reference.attention(t[:, :H], t[:, H:H + Hkv], t[:, H + Hkv:], causal, scale, mask, dropout_p,
                            dropout_mask=dropout_mask, compute_dtype=compute_dtype)
    return (o.transpose(1, 2) if batch_first else o.permute(2, 0, 1, 3)).flatten(2)


# (B, L, H, Hkv, D, batch_first, causal, padding, dtype), each with its reason.
PACKED_CASES = [
    # batch_first (B, L, E): causal + padding, GQA 4:2, L = 70 crosses both block grids.
    pytest.param(2, 70, 4, 2, 32, True, True, True, torch.bfloat16, id="bf-gqa-causal-pad-bf16"),
    # (L, B, E) layout (nn.MultiheadAttention's default): MHA, non-causal, D = 24 (padded to 32).
    pytest.param(3, 33, 2, 2, 24, False, False, False, torch.float16, id="lbe-mha-d24-fp16"),
    # MQA in fp32 (IEEE products), sequence-first with padding.
    pytest.param(2, 40, 2, 1, 16, False, True, True, torch.float32, id="lbe-mqa-causal-pad-fp32"),
]


# Host-side ops that would mean a copy, a concatenation, a gradient accumulation or a
# materialized zero gradient.
COPY_OPS = {"cat", "stack", "copy_", "clone", "_to_copy", "add", "add_", "sum", "zeros", "zeros_like", "zero_",
            "new_zeros", "index", "index_put_", "split_with_sizes_copy"}


@pytest.mark.parametrize("B,L,H,Hkv,D,batch_first,causal,padding,dtype", PACKED_CASES)
def test_qkvpacked_matches_reference(B, L, H, Hkv, D, batch_first, causal, padding, dtype, device, path, launches,
                                     monkeypatch):
    """Output (B, L, H*D) / (L, B, H*D) contiguous; the gradient of qkv (written by the kernel
    into one buffer) against the reference on the split views; besides the kernels only
    allocations and views run (no copy, cat or merge), checked with the launches stubbed."""
    E = (H + 2 * Hkv) * D
    qkv = randn(*((B, L, E) if batch_first else (L, B, E)), dtype=dtype, device=device, requires_grad=True)
    mask = _padding(B, L, device) if padding else None
    out = attention_qkvpacked(qkv, H, Hkv, causal, None, mask, batch_first=batch_first)
    assert out.shape == ((B, L, H * D) if batch_first else (L, B, H * D)) and out.is_contiguous()
    dout = randn(*out.shape, dtype=dtype, device=device)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.is_contiguous()

    leaf64, leaf_lp = _leaves((qkv,), torch.float64)[0], _leaves((qkv,))[0]
    ref64 = _packed_reference(leaf64, H, Hkv, batch_first, causal, mask)
    base = _packed_reference(leaf_lp, H, Hkv, batch_first, causal, mask, compute_dtype=dtype)
    assert_close("out", out, ref64, base)
    (g64,) = torch.autograd.grad(ref64, leaf64, dout.double())
    (gb,) = torch.autograd.grad(base, leaf_lp, dout)
    assert_close("dqkv", dqkv, g64, gb)
    _launched_once(launches)

    monkeypatch.setattr(common, "STUB_LAUNCHES", True)
    recorder = _AtenOps()
    with recorder:
        torch.autograd.grad(attention_qkvpacked(qkv, H, Hkv, causal, None, mask, batch_first=batch_first), qkv,
                            dout)
    copies = [op for op in recorder.ops if op in COPY_OPS]
    assert not copies, f"the packed path ran {copies} (all ops: {recorder.ops})"


def test_qkvpacked_strided_and_lse(device, launches):
    """A row-padded qkv view (row stride > E) and the differentiable LSE of the packed call."""
    B, L, H, D = 2, 20, 2, 16
    buf = randn(B, L, 3 * H * D + 8, dtype=torch.float16, device=device)
    qkv = buf[..., :3 * H * D].requires_grad_()
    out, lse = attention_qkvpacked(qkv, H, causal=True, return_lse=True)
    assert lse.shape == (B, H, L)
    w = randn(*lse.shape, dtype=torch.float32, device=device)
    (g,) = torch.autograd.grad(out.float().sum() + (lse * w).sum(), qkv)
    leaf64 = _leaves((qkv,), torch.float64)[0]
    t = leaf64.unflatten(-1, (3 * H, D)).transpose(1, 2)
    o64, lse64 = reference.attention(t[:, :H], t[:, H:2 * H], t[:, 2 * H:], True, return_lse=True)
    (g64,) = torch.autograd.grad(o64.sum() + (lse64 * w.double()).sum(), leaf64)
    torch.testing.assert_close(out.double(), o64.transpose(1, 2).flatten(2), atol=4e-3, rtol=0)
    torch.testing.assert_close(g.double(), g64, atol=2e-2, rtol=2e-2)
    _launched_once(launches)


def test_qkvpacked_dropout_matches_unpacked(device, launches):
    """Dropout on the packed path uses the same mask as on q, k, v views (same seed)."""
    B, L, H, D, p = 1, 40, 2, 32, 0.3
    qkv = randn(B, L, 3 * H * D, dtype=torch.float16, device=device, requires_grad=True)
    torch.manual_seed(5)
    packed = attention_qkvpacked(qkv, H, causal=True, dropout_p=p)
    (g_packed,) = torch.autograd.grad(packed.float().sum(), qkv)
    t = qkv.unflatten(-1, (3 * H, D)).transpose(1, 2)
    torch.manual_seed(5)
    views = attention(t[:, :H], t[:, H:2 * H], t[:, 2 * H:], True, dropout_p=p)
    (g_views,) = torch.autograd.grad(views.float().sum(), qkv)
    assert torch.equal(packed, views.transpose(1, 2).flatten(2))
    assert torch.equal(g_packed, g_views)


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------

def _seeded(seed_value, dropout_p, device):
    """The seed tensor ``attention`` draws after ``torch.manual_seed(seed_value)``."""
    torch.manual_seed(seed_value)
    return _backend.dropout_seed(dropout_p, device)


def test_dropout_keep_statistics(device, launches):
    """Keep rate 1 - p overall, per head and per row/column; heads and seeds differ."""
    p = 0.3
    seed = _seeded(1, p, device)
    keep = kernels.dropout_keep_mask(seed, 2, 3, 64, 200, p, device).float()
    n = keep.numel()
    assert abs(keep.mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    per_head = keep.mean(dim=(2, 3))
    assert torch.all((per_head - (1 - p)).abs() < 4 * math.sqrt(p * (1 - p) / (64 * 200)))
    # Rows and columns are not copies of each other (counters include both indices).
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert not torch.equal(keep[0, 0, :, 0], keep[0, 0, :, 1])
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    other = kernels.dropout_keep_mask(_seeded(2, p, device), 2, 3, 64, 200, p, device).float()
    assert (keep != other).float().mean().item() > 0.3
    assert launches["attention_dropout_mask"] == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_reference_with_the_same_mask(dtype, device, path, launches):
    """Forward and backward equal the reference given the kernels' own keep mask: the
    backward regenerates exactly the forward's mask. GQA 2:1, causal, padding."""
    p, B, Hq, Hkv, Lq, Lk, D = 0.25, 2, 2, 1, 40, 70, 32
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    mask = _padding(B, Lk, device, full_row=False)
    keep = kernels.dropout_keep_mask(_seeded(7, p, device), B, Hq, Lq, Lk, p, device)
    torch.manual_seed(7)
    out, lse = attention(q, k, v, True, None, mask, p, return_lse=True)
    _compare(q, k, v, True, mask, p, dropout_mask=keep, out=out, lse=lse)
    _launched_once(launches)


def test_dropout_d256_split_programs(device, launches):
    """Dropout through split_kv's separate dV and dK programs (D = 256) keeps one mask."""
    p, B, Hq, Hkv, Lq, Lk, D = 0.2, 1, 2, 1, 24, 40, 256
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, torch.bfloat16, device)
    keep = kernels.dropout_keep_mask(_seeded(3, p, device), B, Hq, Lq, Lk, p, device)
    torch.manual_seed(3)
    out = attention(q, k, v, False, None, None, p)
    _compare(q, k, v, False, None, p, dropout_mask=keep, out=out)


def test_dropout_same_seed_same_result(device, launches):
    p = 0.5
    q, k, v = _qkv(1, 2, 2, 33, 65, 16, torch.float16, device)
    torch.manual_seed(3)
    a = attention(q, k, v, dropout_p=p)
    ga = torch.autograd.grad(a.float().sum(), (q, k, v))
    torch.manual_seed(3)
    b = attention(q, k, v, dropout_p=p)
    gb = torch.autograd.grad(b.float().sum(), (q, k, v))
    torch.manual_seed(4)
    c = attention(q, k, v, dropout_p=p)
    assert torch.equal(a, b)
    for x, y in zip(ga, gb):
        assert torch.equal(x, y)
    assert not torch.equal(a, c)
    assert launches["attention_fwd"] == 3


def test_dropout_is_unbiased(device, launches):
    """Averaged over seeds, dropout's output approaches the output without dropout."""
    q, k, v = _qkv(1, 1, 1, 8, 64, 16, torch.float32, device)
    plain = attention(q, k, v)
    mean = torch.stack([attention(q, k, v, dropout_p=0.5) for _ in range(40)]).mean(0)
    # Each entry averages 40 x 64 Bernoulli-weighted terms; the spread is about 0.06.
    assert (mean - plain).abs().mean().item() < 0.05


@pytest.mark.parametrize("api", ["attention", "qkvpacked", "varlen"])
def test_dropout_p_that_rounds_to_one_in_fp32_drops_everything(api, device, launches):
    """A dropout_p below 1 that fp32 rounds to 1.0 (here 1 - 1e-8; the kernels take p in fp32)
    keeps an element with probability below 1e-7: the output is zeros (no keep in these 2,048
    draws for this seed) and so are the gradients, as torch's dropout gives almost surely. It
    was every element kept, scaled by 1 / (1 - p) = 1e8 (NaN where the scale is fp32's inf)."""
    p, B, H, L, D = 1 - 1e-8, 1, 2, 32, 16
    q, k, v = _qkv(B, H, H, L, L, D, torch.float32, device)
    torch.manual_seed(5)
    if api == "attention":
        out = attention(q, k, v, True, None, None, p)
    elif api == "qkvpacked":
        qkv = torch.cat([t.detach().transpose(1, 2).flatten(2) for t in (q, k, v)], -1).requires_grad_()
        q = k = v = qkv
        out = attention_qkvpacked(qkv, H, causal=True, dropout_p=p)
    else:
        q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, 12, L], dtype=torch.int32, device=device)
        out = fused_block.attention_varlen(q, k, v, cu, cu, 20, 20, causal=True, dropout_p=p)
    assert torch.equal(out, torch.zeros_like(out))
    for g in torch.autograd.grad(out.sum(), tuple({id(t): t for t in (q, k, v)}.values())):
        assert torch.equal(g, torch.zeros_like(g))
    assert launches["attention_fwd"] == 1 and launches["attention_bwd"] == 1


@pytest.mark.parametrize("api", ["attention", "qkvpacked", "varlen", "varlen_qkvpacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dropout_p_one_gives_zeros_with_zero_gradients(api, dtype, device, launches):
    """dropout_p = 1.0 is what SDPA takes and gives (every probability dropped: out zeros, q, k
    and v zero gradients), and what torch's layers with dropout=1.0 reach; it raised
    "dropout_p must be in [0, 1)". The LSE (return_lse) is the dropout-free one, with its
    gradient. (B, H, L, D) small: one block per head.)"""
    B, H, L, D = 1, 2, 24, 16
    q, k, v = _qkv(B, H, H, L, L, D, dtype, device)
    if api in ("attention", "qkvpacked"):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=1.0)
        assert torch.equal(sdpa, torch.zeros_like(sdpa))  # torch's answer
    cu = torch.tensor([0, 10, L], dtype=torch.int32, device=device)
    if api == "attention":
        inputs = (q, k, v)
        run = lambda p, lse: attention(q, k, v, True, None, None, p, return_lse=lse)  # noqa: E731
    elif api == "qkvpacked":
        qkv = torch.cat([t.detach().transpose(1, 2).flatten(2) for t in (q, k, v)], -1).requires_grad_()
        inputs = (qkv,)
        run = lambda p, lse: attention_qkvpacked(qkv, H, causal=True, dropout_p=p, return_lse=lse)  # noqa: E731
    elif api == "varlen":
        inputs = tuple(t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        run = lambda p, lse: fused_block.attention_varlen(*inputs, cu, cu, 14, 14, causal=True,  # noqa: E731
                                                          dropout_p=p, return_lse=lse)
    else:
        qkv = torch.cat([t.detach()[0].transpose(0, 1).flatten(1) for t in (q, k, v)], -1).requires_grad_()
        inputs = (qkv,)
        run = lambda p, lse: fused_block.attention_varlen_qkvpacked(qkv, cu, 14, H, causal=True,  # noqa: E731
                                                                    dropout_p=p, return_lse=lse)
    out = run(1.0, False)
    assert out.dtype == dtype and torch.equal(out, torch.zeros_like(out))
    for g in torch.autograd.grad(out.float().sum(), inputs):
        assert torch.equal(g, torch.zeros_like(g))
    # The LSE and its gradient are dropout's-free ones.
    (out1, lse1), (_, lse0) = run(1.0, True), run(0.0, True)
    assert torch.equal(out1, torch.zeros_like(out1)) and torch.equal(lse1, lse0)
    g1 = torch.autograd.grad(lse1.sum(), inputs)
    g0 = torch.autograd.grad(lse0.sum(), inputs)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert launches["attention_fwd"] >= 1 and launches["attention_bwd"] >= 1
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got 1.5"):
        run(1.5, False)


def test_no_dropout_draws_no_seed(device, launches):
    """dropout_p = 0 consumes no random number (and allocates no seed tensor)."""
    q, k, v = _qkv(1, 1, 1, 8, 8, 16, torch.float16, device)
    torch.manual_seed(11)
    attention(q, k, v)
    after = torch.rand(1)
    torch.manual_seed(11)
    assert torch.equal(after, torch.rand(1))


def test_backward_is_deterministic(device, path, launches):
    """No atomics: two backward passes are bitwise equal (GQA sums over heads in-kernel)."""
    q, k, v = _qkv(1, 4, 1, 70, 70, 32, torch.bfloat16, device)
    out = attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["dense", "qkvpacked", "varlen"])
def test_autocast(device, launches, form):
    """Like SDPA: under autocast fp32 q, k, v are cast to its dtype (the output in it, gradients
    back in fp32), so head dims past fp32's limit run too."""
    lowp, B, H, L, D = torch.bfloat16, 2, 2, 8, 160  # D > 128: fp32 kernels would refuse it
    qkv = randn(B, L, 3 * H * D, dtype=torch.float32, device=device, requires_grad=True)

    def views(t):  # q, k, v (B, H, L, D) of the packed tensor
        return [u.transpose(1, 2) for u in t.view(B, L, 3 * H, D).split(H, 2)]

    def run(t):
        if form == "dense":
            return attention(*views(t), causal=True)
        if form == "qkvpacked":
            return attention_qkvpacked(t, H, causal=True).view(B, L, H, D).transpose(1, 2)
        cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=device)
        q, k, v = (u.transpose(1, 2).reshape(B * L, H, D) for u in views(t))
        return fused_block.attention_varlen(q, k, v, cu, cu, L, L, causal=True).view(B, L, H, D).transpose(1, 2)

    with torch.autocast(device.type, dtype=lowp):
        out = run(qkv)
    assert out.dtype == lowp
    g = randn(*out.shape, dtype=lowp, device=device)
    (grad,) = torch.autograd.grad(out, qkv, g)
    assert grad.dtype == torch.float32
    q64 = qkv.detach().double().requires_grad_()
    ref = reference.attention(*views(q64), causal=True)
    (ref_grad,) = torch.autograd.grad(ref, q64, g.double())
    qb = qkv.detach().to(lowp).requires_grad_()
    base = reference.attention(*views(qb), causal=True, compute_dtype=lowp)
    (base_grad,) = torch.autograd.grad(base, qb, g)
    assert_close("autocast out", out, ref, base)
    assert_close("autocast grad", grad, ref_grad, base_grad.float(), atol=ATOL[lowp])
    assert launches["attention_fwd"] == 1 and launches["attention_bwd"] == 1


def test_opcheck(device):
    """Every op: schema and fake tensors (the fakes' strides must match the kernels' outputs);
    the full check (autograd registration, AOT dispatch) on one call of each forward op."""
    q, k, v = _qkv(1, 2, 1, 17, 33, 16, torch.float16, device)
    q, k, v = q.detach(), k.detach(), v.detach()
    mask = _padding(1, 33, device, full_row=False)
    seed = _seeded(0, 0.2, device)
    ops = torch.ops.fused_block
    fake = dict(test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.attention_fwd.default, (q, k, v, mask, seed, True, 0.25, 0.2))
    torch.library.opcheck(ops.attention_fwd.default, (q, k, v, None, None, False, 0.25, 0.0), **fake)
    out, lse = ops.attention_fwd(q, k, v, mask, seed, True, 0.25, 0.2)
    torch.library.opcheck(ops.attention_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), mask, seed, True, 0.25,
                           0.2), **fake)
    # Strided views of one fused QKV buffer (B, L, 3, H, D): outputs and gradients follow q's
    # memory order, in the fakes too.
    qkv = torch.randn(1, 17, 3, 2, 16, device=device).to(torch.float16)
    qs, ks, vs = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    torch.library.opcheck(ops.attention_fwd.default, (qs, ks, vs, None, None, False, 0.25, 0.0), **fake)
    out, lse = ops.attention_fwd(qs, ks, vs, None, None, False, 0.25, 0.0)
    torch.library.opcheck(ops.attention_bwd.default,
                          (torch.randn_like(out), qs, ks, vs, out, lse, None, None, None, False, 0.25, 0.0), **fake)
    # The packed ops, both layouts (H = 2, Hkv = 1, D = 16).
    for batch_first in (True, False):
        packed = torch.randn(17, 2, 4 * 16, device=device).to(torch.float16)
        pmask = _padding(17 if batch_first else 2, 2 if batch_first else 17, device, full_row=False)
        args = (2, 1, batch_first, pmask, seed, True, 0.25, 0.2)
        torch.library.opcheck(ops.attention_packed_fwd.default, (packed, *args), **({} if batch_first else fake))
        out, lse = ops.attention_packed_fwd(packed, *args)
        torch.library.opcheck(ops.attention_packed_bwd.default,
                              (torch.randn_like(out), packed, out, lse, torch.randn_like(lse), *args), **fake)


def test_torch_compile_fullgraph(device, launches):
    q, k, v = _qkv(1, 2, 1, 17, 33, 16, torch.bfloat16, device)
    mask = _padding(1, 33, device, full_row=False)

    def f(q, k, v, mask):
        out, lse = attention(q, k, v, True, None, mask, return_lse=True)
        return out.float().sum() + lse[torch.isfinite(lse)].sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, mask)
    g_got = torch.autograd.grad(got, (q, k, v))
    want = f(q, k, v, mask)
    g_want = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


def test_torch_compile_fullgraph_with_one_tensor_as_q_k_and_v(device, launches):
    """``attention(x, x, x)`` (self-attention without projections) traces: Dynamo refuses an
    autograd Function given the same tensor twice, so the op hands it a view; the gradient is
    the sum of the three, as in eager mode."""
    x = randn(1, 2, 17, 16, dtype=torch.float32, device=device, requires_grad=True)  # the sum's order may differ

    def f(x):
        return attention(x, x, x, True).pow(2).sum()

    assert_compiled_matches_eager(f, x)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


def test_torch_compile_fullgraph_qkvpacked(device, launches):
    qkv = randn(2, 17, 4 * 16, dtype=torch.float16, device=device, requires_grad=True)

    def f(qkv):
        return attention_qkvpacked(qkv, 2, 1, True, dropout_p=0.1).float().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(0)
    got = compiled(qkv)
    (g_got,) = torch.autograd.grad(got, qkv)
    torch.manual_seed(0)
    want = f(qkv)
    (g_want,) = torch.autograd.grad(want, qkv)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def _bad_cases(device):
    def t(*shape, dtype=torch.float16):
        return torch.zeros(*shape, dtype=dtype, device=device)

    q, k, v = t(2, 4, 8, 64), t(2, 2, 16, 64), t(2, 2, 16, 64)
    qkv = t(2, 8, 4 * 16)
    return [
        (attention, (q, k[:1], v[:1]), {}, ValueError, "k must have shape"),
        (attention, (q, t(2, 2, 16, 32), v), {}, ValueError, "k must have shape"),
        (attention, (q, k, t(2, 2, 15, 64)), {}, ValueError, "v must have shape"),
        (attention, (t(2, 4, 8, 60), t(2, 2, 16, 60), t(2, 2, 16, 60)), {}, ValueError, "head dim"),
        (attention, (t(2, 4, 8, 264), t(2, 2, 16, 264), t(2, 2, 16, 264)), {}, ValueError, "head dim"),
        (attention, (t(2, 4, 8, 8), t(2, 2, 16, 8), t(2, 2, 16, 8)), {}, ValueError, "head dim"),
        (attention, (q, t(2, 3, 16, 64), t(2, 3, 16, 64)), {}, ValueError, "multiple of k's heads"),
        (attention, (q[0], k, v), {}, ValueError, "q must be 4-D"),
        (attention, (q, k.float(), v), {}, TypeError, "k must have q's dtype"),
        (attention, (q.double(), k.double(), v.double()), {}, TypeError, "q must have dtype"),
        (attention, (q, k, v), {"key_padding_mask": t(2, 16, dtype=torch.uint8)}, TypeError,
         "key_padding_mask must have dtype"),
        (attention, (q, k, v), {"key_padding_mask": t(2, 15, dtype=torch.bool)}, ValueError,
         "key_padding_mask must have shape"),
        (attention, (q, k, v), {"key_padding_mask": t(16, dtype=torch.bool)}, ValueError,
         "key_padding_mask must be 2-D"),
        (attention, (q, k, v), {"dropout_p": 1.5}, ValueError, "dropout_p"),
        (attention, (q, k, v), {"dropout_p": -0.1}, ValueError, "dropout_p"),
        (attention, (q, k, v), {"scale": 0.0}, ValueError, "scale"),
        (attention, (q, k, v), {"causal": 1}, TypeError, "causal"),
        (attention, (q.float()[..., :0], k.float(), v.float()), {}, ValueError, "head dim"),
        (attention, ([1.0], k, v), {}, TypeError, "q must be a torch.Tensor"),
        (attention, (t(2, 4, 8, 136, dtype=torch.float32), t(2, 2, 16, 136, dtype=torch.float32),
                     t(2, 2, 16, 136, dtype=torch.float32)), {}, TypeError, "q: fp32 attention kernels"),
        (attention_qkvpacked, (qkv, 2, 1), {"key_padding_mask": t(2, 7, dtype=torch.bool)}, ValueError,
         "key_padding_mask must have shape"),
        (attention_qkvpacked, (qkv, 3, 1), {}, ValueError, r"\(num_heads \+ 2 \* num_kv_heads\)"),
        (attention_qkvpacked, (qkv, 2, 2), {}, ValueError, r"\(num_heads \+ 2 \* num_kv_heads\)"),
        (attention_qkvpacked, (t(2, 8, 4 * 12), 2, 1), {}, ValueError, "qkv's head dim"),
        (attention_qkvpacked, (qkv, 3, 2), {}, ValueError, "num_heads"),
        (attention_qkvpacked, (qkv, 0, 1), {}, ValueError, "num_heads must be positive"),
        (attention_qkvpacked, (qkv, 2, 1.0), {}, TypeError, "num_kv_heads must be an int"),
        (attention_qkvpacked, (qkv[0], 2, 1), {}, ValueError, "qkv must be 3-D"),
        (attention_qkvpacked, (qkv.int(), 2, 1), {}, TypeError, "qkv must have dtype"),
        (attention_qkvpacked, (qkv, 2, 1), {"batch_first": 1}, TypeError, "batch_first"),
        (attention_qkvpacked, (qkv, 2, 1), {"causal": None}, TypeError, "causal"),
        (attention_qkvpacked, (qkv, 2, 1), {"dropout_p": 2.0}, ValueError, "dropout_p"),
        (attention_qkvpacked, (t(2, 8, 4 * 136, dtype=torch.float32), 2, 1), {}, TypeError,
         "qkv: fp32 attention kernels"),
    ]


@pytest.mark.parametrize("index", range(33))
def test_bad_input(index, device, launches):
    fn, args, kwargs, exc, match = _bad_cases(device)[index]
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    assert launches["attention_fwd"] == 0


def test_bad_input_catalogue_is_complete(device):
    assert len(_bad_cases(device)) == 33


def test_bad_input_device(device, launches):
    if device.type != "cuda":
        pytest.skip("needs a second device type")
    q = torch.zeros(1, 1, 8, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="k is on"):
        attention(q, q.cpu(), q)


def test_public_names():
    assert fused_block.attention is attention and fused_block.attention_qkvpacked is attention_qkvpacked


# ---------------------------------------------------------------------------------------------
# every shipped config, on the GPU (the interpreter runs one config per kernel)
# ---------------------------------------------------------------------------------------------

# What a feature class's configs are tested with (on top of causality and padding).
CLASS_FEATURES = {"plain": {}, "band": {"window": (100, -1)}}


def _shipped_configs():
    """(kernel, class key, index, path) of every config this GPU's tables can launch: the
    warp-specialized forwards only with FUSED_BLOCK_WS=1 (opt-in: on the first H200 run the one
    at D64 gave NaN in the last rows of this test's case, L = 300 with causality and padding)."""
    if not ON_CUDA:
        return []
    arch = common.arch(torch.device("cuda"))
    out = []
    for kname, tables in (("fwd", configs.FWD_CONFIGS), ("bwd", configs.BWD_CONFIGS)):
        for key, cfgs in tables[arch].items():
            for i in range(len(cfgs)):
                if cfgs[i].meta().get("WS") and not common.WARP_SPECIALIZE:
                    continue
                tma_paths = ("tma", "pointer") if i == 0 else ("tma",)
                for path in tma_paths if arch == 90 and key[1] != "ieee" else ("pointer",):
                    out.append(pytest.param(kname, key, i, path, id=f"{kname}-D{key[0]}-{key[1]}"
                                            f"{'-dropout' if key[2] else ''}-{key[3]}-{i}-{path}"))
    return out


@pytest.mark.parametrize("kname,key,index,path_", _shipped_configs())
def test_every_shipped_config(kname, key, index, path_, device, launches, monkeypatch):
    """Each config of this GPU's tables (forced as the only candidate), on each path it ships
    for: causal with padding, GQA 2:1, L = 300 (partial blocks), dropout where its class has it,
    and its feature class's features (``CLASS_FEATURES``)."""
    arch = common.arch(device)
    tables = configs.FWD_CONFIGS if kname == "fwd" else configs.BWD_CONFIGS
    monkeypatch.setitem(tables[arch], key, [tables[arch][key][index]])
    monkeypatch.setattr(launchers, "_FWD_CACHE", common.ConfigCache("attention_fwd"))
    monkeypatch.setattr(launchers, "_BWD_CACHE", common.ConfigCache("attention_bwd"))
    monkeypatch.setattr(launchers, "FORCE_PATH", "pointer" if path_ == "pointer" else None)
    block_d, kind, dropout, cls = key
    features = CLASS_FEATURES[cls]
    dtype = torch.bfloat16 if kind == "16" else torch.float32
    mode = "tf32" if kind == "tf32" else "ieee"
    B, Hq, Hkv, L, p = 2, 4, 2, 300, 0.2 if dropout else 0.0
    q, k, v = _qkv(B, Hq, Hkv, L, L, block_d, dtype, device)
    mask = _padding(B, L, device, full_row=False)
    keep = kernels.dropout_keep_mask(_seeded(9, p, device), B, Hq, L, L, p, device) if dropout else None
    torch.manual_seed(9)
    with fp32_mode(mode):
        out, lse = attention(q, k, v, True, None, mask, p, return_lse=True, **features)
    _compare(q, k, v, True, mask, p, dropout_mask=keep, out=out, lse=lse, mode=mode, **features)
    assert (launches["attention_tma"] > 0) == (path_ == "tma")


def test_backward_order_puts_heavy_programs_first(device):
    """The scheduled backward's program order (``launchers._bwd_order``), causal L = 128 in
    64-key dK/dV and 64-query dQ blocks: key block 0 (all 128 queries, 4 products), the last
    query block (128 keys, 3 products), key block 1 (64 queries), query block 0 (64 keys)."""
    cfg = configs._bwd_cfg(32, 64, 64, 32, 1, 1)
    constexprs = dict(IS_CAUSAL=True, WINDOW=False)
    order = launchers._bwd_order(cfg, None, 128, 128, 2, 2, 1, constexprs, 0, 0, device)
    assert order.tolist() == [0, 2, 1, 3]
    # split dV (2 products) and dK (3): dK 0, dQ 1, dV 0, dK 1, dQ 0, dV 1
    split = configs._bwd_cfg(32, 64, 64, 32, 1, 1, True)
    order = launchers._bwd_order(split, None, 128, 128, 2, 2, 1, constexprs, 0, 0, device)
    assert order.tolist() == [2, 4, 0, 3, 5, 1]
