"""Packed (variable-length) sequences: ``attention_varlen`` and ``attention_varlen_qkvpacked``
against the float64 reference (each sequence on its own), with every option that combines.

Interpreter blocks are 64 x 32 (forward), 32 x 64 / 64 x 32 (backward): the lengths below put
sequence starts inside blocks, make sequences shorter and longer than a block, empty, and of
length 1.
"""
import pytest
import torch

import fused_block
from attention_testing import check, forced_schedule, path  # noqa: F401 - the fixture
from fused_block import _backend, reference
from fused_block.attention import attention_varlen, attention_varlen_qkvpacked
from fused_block.kernels import attention as kernels
from fused_block.kernels import common
from fused_block.kernels.attention import configs
from numerics import DTYPES, randn


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _tokens(lq, lk, Hq, Hkv, D, dtype, device):
    Tq, Tk = sum(lq), sum(lk)
    return (randn(Tq, Hq, D, dtype=dtype, device=device, requires_grad=True),
            randn(Tk, Hkv, D, dtype=dtype, device=device, requires_grad=True),
            randn(Tk, Hkv, D, dtype=dtype, device=device, requires_grad=True))


def _launched_once(launches):
    assert launches["attention_fwd"] == 1 and launches["attention_bwd_preprocess"] == 1
    assert launches["attention_bwd"] == 1


def _check(lq, lk, Hq, Hkv, D, dtype, device, **options):
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)

    def run(q, k, v):
        return attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, **options)

    def ref(q, k, v, compute_dtype=None):
        return reference.attention_varlen(q, k, v, cu_q, cu_k, options.get("causal", False), None,
                                          window=options.get("window", (-1, -1)), return_lse=True,
                                          compute_dtype=compute_dtype)

    check(run, ref, _tokens(lq, lk, Hq, Hkv, D, dtype, device), ("q", "k", "v"),
          lse_weight=not options.get("causal"))


# (query lengths, key lengths, Hq, Hkv, D, options), each with its reason.
CASES = [
    # Self-attention, causal, GQA 4:2: an empty sequence and one of length 1 between longer
    # ones; 70 crosses the forward's 64-row blocks, every sequence start is mid-block.
    pytest.param([5, 0, 70, 1, 33], [5, 0, 70, 1, 33], 4, 2, 32, dict(causal=True), id="self-causal-empty-len1"),
    # Cross-attention per sequence, non-causal, MQA: Lq != Lk in each, one without keys
    # (output 0, LSE -inf, zero gradients).
    pytest.param([17, 40, 3], [50, 0, 64], 2, 1, 16, dict(), id="cross-no-keys"),
    # Causal with Lq != Lk (bottom-right per sequence: the second one's first queries see no
    # key) and a 24-key window; D = 24 (column padding).
    pytest.param([30, 90], [60, 45], 2, 2, 24, dict(causal=True, window=(24, -1)), id="cross-causal-window"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lq,lk,Hq,Hkv,D,options", CASES)
@pytest.mark.sweep
def test_varlen_matches_reference(lq, lk, Hq, Hkv, D, options, dtype, device, path, launches):
    _check(lq, lk, Hq, Hkv, D, dtype, device, **options)
    _launched_once(launches)


def test_varlen_dropout(device, launches):
    """Dropout per sequence regenerates the dense kernels' mask at (sequence, head, query,
    key) within the sequence: the reference with that mask agrees, gradients included."""
    p, lq, H = 0.25, [40, 7, 66], 2
    cu = _cu(lq, device)
    q, k, v = _tokens(lq, lq, H, H, 16, torch.float16, device)
    torch.manual_seed(3)
    keep = kernels.dropout_keep_mask(_backend.dropout_seed(p, device), len(lq), H, max(lq), max(lq), p, device)

    def run(q, k, v):
        torch.manual_seed(3)
        return attention_varlen(q, k, v, cu, cu, max(lq), max(lq), causal=True, dropout_p=p, return_lse=True)

    def ref(q, k, v, compute_dtype=None):
        return reference.attention_varlen(q, k, v, cu, cu, True, None, p, dropout_mask=keep, return_lse=True,
                                          compute_dtype=compute_dtype)

    check(run, ref, (q, k, v), ("q", "k", "v"))
    _launched_once(launches)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_qkvpacked(dtype, device, path, launches):
    """The packed projection (T, (H + 2 Hkv) * D): output (T, H * D), one gradient buffer."""
    lens, H, Hkv, D = [20, 1, 45], 4, 2, 16
    cu = _cu(lens, device)
    qkv = randn(sum(lens), (H + 2 * Hkv) * D, dtype=dtype, device=device, requires_grad=True)

    def run(qkv):
        out, lse = attention_varlen_qkvpacked(qkv, cu, max(lens), H, Hkv, causal=True, return_lse=True)
        assert out.shape == (sum(lens), H * D) and out.is_contiguous()
        return out, lse

    def ref(qkv, compute_dtype=None):
        t = qkv.unflatten(-1, (H + 2 * Hkv, D))
        out, lse = reference.attention_varlen(t[:, :H], t[:, H:H + Hkv], t[:, H + Hkv:], cu, cu, True,
                                              return_lse=True, compute_dtype=compute_dtype)
        return out.flatten(1), lse

    check(run, ref, (qkv,), ("qkv",))
    _launched_once(launches)


def test_varlen_strided_views(device, launches):
    """q, k, v as views of one (T, 3, H, D) projection (strided token rows): no copy."""
    lens, H, D = [33, 12], 2, 16
    cu = _cu(lens, device)
    buf = randn(sum(lens), 3, H, D, dtype=torch.bfloat16, device=device, requires_grad=True)

    def run(buf):
        q, k, v = buf[:, 0], buf[:, 1], buf[:, 2]
        assert not q.is_contiguous()
        return attention_varlen(q, k, v, cu, cu, 33, 33, causal=True, return_lse=True)

    def ref(buf, compute_dtype=None):
        return reference.attention_varlen(buf[:, 0], buf[:, 1], buf[:, 2], cu, cu, True, return_lse=True,
                                          compute_dtype=compute_dtype)

    check(run, ref, (buf,), ("buf",))
    _launched_once(launches)


def test_varlen_grid_follows_the_real_blocks(device, monkeypatch):
    """No padding compute: the forward launches (Tq // BLOCK_M + B) * Hq programs, one per
    real query block plus at most one unused number per sequence (which returns at once),
    whatever max_seqlen says; B x max^2 would be 8 x 4 blocks here, we run 1 x 8 + 8."""
    grids = {}
    launch = common.launch

    def record(name, kernel, grid, args, constexprs, config):
        grids[name] = grid
        return launch(name, kernel, grid, args, constexprs, config)

    monkeypatch.setattr(common, "launch", record)
    lens = [200] + [1] * 7
    cu = _cu(lens, device)
    q, k, v = (t.detach() for t in _tokens(lens, lens, 1, 1, 16, torch.float16, device))
    attention_varlen(q, k, v, cu, cu, 200, 200)
    bm = configs.INTERPRET_FWD["BLOCK_M"] if device.type == "cpu" else None
    if bm is not None:
        assert grids["attention_fwd"] == (sum(lens) // bm + len(lens),)


def test_varlen_backward_is_deterministic(device, path, launches):
    lens = [50, 3, 77]
    cu = _cu(lens, device)
    q, k, v = _tokens(lens, lens, 4, 1, 16, torch.bfloat16, device)
    out = attention_varlen(q, k, v, cu, cu, 77, 77, causal=True)
    dout = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_varlen_equals_dense_for_equal_lengths(device, launches):
    """Equal lengths: the same numbers as the dense (B, H, L, D) call (up to the order of
    floating-point operations, which block boundaries fix: L = 64 keeps them aligned)."""
    B, L, H = 3, 64, 2
    cu = _cu([L] * B, device)
    q, k, v = _tokens([L] * B, [L] * B, H, H, 16, torch.float32, device)
    out = attention_varlen(q, k, v, cu, cu, L, L, causal=True)
    dense = fused_block.attention(*(t.view(B, L, H, 16).transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out, dense.transpose(1, 2).reshape(B * L, H, 16), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ---------------------------------------------------------------------------------------------

def test_varlen_opcheck(device):
    lens = [9, 0, 20]
    cu = _cu(lens, device)
    q, k, v = (t.detach() for t in _tokens(lens, lens, 2, 1, 16, torch.float16, device))
    ops = torch.ops.fused_block
    fake = dict(test_utils=("test_schema", "test_faketensor"))
    args = (cu, cu, 20, 20, None, True, 0.25, 0.0, -1, -1)
    torch.library.opcheck(ops.attention_varlen_fwd.default, (q, k, v, *args))
    out, lse = ops.attention_varlen_fwd(q, k, v, *args)
    torch.library.opcheck(ops.attention_varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), *args), **fake)
    qkv = torch.randn(29, 4 * 16, device=device).to(torch.float16)
    pargs = (cu, 20, 2, 1, None, True, 0.25, 0.0, 5, -1)
    torch.library.opcheck(ops.attention_varlen_packed_fwd.default, (qkv, *pargs), **fake)
    out, lse = ops.attention_varlen_packed_fwd(qkv, *pargs)
    torch.library.opcheck(ops.attention_varlen_packed_bwd.default,
                          (torch.randn_like(out), qkv, out, lse, None, *pargs), **fake)


def test_varlen_torch_compile_fullgraph(device, launches):
    lens = [9, 30]
    cu = _cu(lens, device)
    q, k, v = _tokens(lens, lens, 2, 1, 16, torch.bfloat16, device)

    def f(q, k, v, cu):
        out, lse = attention_varlen(q, k, v, cu, cu, 30, 30, causal=True, window=(8, -1), return_lse=True)
        return out.float().sum() + lse.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, cu)
    g_got = torch.autograd.grad(got, (q, k, v))
    want = f(q, k, v, cu)
    g_want = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def _bad_varlen(device):
    def t(*shape, dtype=torch.float16):
        return torch.zeros(*shape, dtype=dtype, device=device)

    def cu(*values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    q, k, v = t(10, 4, 16), t(10, 2, 16), t(10, 2, 16)
    good = cu(0, 4, 10)
    return [
        ((q, k, v, cu(0, 4, 10, dtype=torch.int64), good, 6, 6), TypeError, "cu_seqlens_q must have dtype"),
        ((q, k, v, good, good.float(), 6, 6), TypeError, "cu_seqlens_k must have dtype"),
        ((q, k, v, good[None], good, 6, 6), ValueError, "cu_seqlens_q must be 1-D"),
        ((q, k, v, cu(1, 4, 10), good, 6, 6), ValueError, "cu_seqlens_q must start at 0"),
        ((q, k, v, good, cu(0, 7, 4, 10), 6, 6), ValueError, "cu_seqlens_k must be nondecreasing"),
        ((q, k, v, cu(0, 4, 9), good, 6, 6), ValueError, r"cu_seqlens_q's last entry \(9\) must be the token count"),
        ((q, k, v, good, cu(0, 4, 11), 6, 6), ValueError, r"cu_seqlens_k's last entry \(11\)"),
        ((q, k, v, good, good, 5, 6), ValueError, r"max_seqlen_q \(5\) is smaller than the longest sequence"),
        ((q, k, v, good, good, 6, 3), ValueError, r"max_seqlen_k \(3\)"),
        ((q, k, v, good, good, 6.0, 6), TypeError, "max_seqlen_q must be an int"),
        ((q, k, v, good, good, -1, 6), ValueError, "max_seqlen_q must be >= 0"),
        ((q, k, v, cu(0, 10), good, 10, 10), ValueError, "cu_seqlens_k must have cu_seqlens_q's shape"),
        ((q, k, v, cu(), cu(), 6, 6), ValueError, "cu_seqlens_q must hold B \\+ 1 offsets"),
        ((q[None], k, v, good, good, 6, 6), ValueError, "q must be 3-D"),
        ((q, t(10, 3, 16), t(10, 3, 16), good, good, 6, 6), ValueError, "multiple of k's heads"),
        ((q, t(10, 2, 32), t(10, 2, 32), good, good, 6, 6), ValueError, "k must have shape"),
    ]


@pytest.mark.parametrize("index", range(16))
def test_varlen_bad_input(index, device, launches):
    args, exc, match = _bad_varlen(device)[index]
    with pytest.raises(exc, match=match):
        attention_varlen(*args)
    assert launches["attention_fwd"] == 0


def test_varlen_bad_input_catalogue_is_complete(device):
    assert len(_bad_varlen(device)) == 16


def test_varlen_qkvpacked_bad_input(device, launches):
    qkv = torch.zeros(10, 4 * 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="cu_seqlens's last entry"):
        attention_varlen_qkvpacked(qkv, torch.tensor([0, 4, 9], dtype=torch.int32, device=device), 6, 2, 1)
    with pytest.raises(ValueError, match="max_seqlen"):
        attention_varlen_qkvpacked(qkv, torch.tensor([0, 4, 10], dtype=torch.int32, device=device), 4, 2, 1)
    with pytest.raises(ValueError, match=r"\(num_heads \+ 2 \* num_kv_heads\)"):
        attention_varlen_qkvpacked(qkv, torch.tensor([0, 10], dtype=torch.int32, device=device), 10, 3, 1)
    assert launches["attention_fwd"] == 0


def test_public_names():
    assert fused_block.attention_varlen is attention_varlen
    assert fused_block.attention_varlen_qkvpacked is attention_varlen_qkvpacked


# The scheduled kernels (kernels/attention/configs.py's timed candidates): the longest-first
# order (1) and its persistent grid (2, four programs in the interpreter: several tiles each,
# unused virtual blocks among them), forward and backward, the forward through the packed
# tensors' host-side descriptors on the TMA path (rows past a sequence's end read the next
# sequence's: masked, not stored), a head per L2 group. Cases: the empty / length-1 /
# mid-block sequences with GQA, and the cross-attention window (a sequence whose first
# queries see no key).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sched", (1, 2))
@pytest.mark.parametrize("lq,lk,Hq,Hkv,D,options", [CASES[0], CASES[2]])
@pytest.mark.sweep
def test_varlen_scheduled_forward(lq, lk, Hq, Hkv, D, options, sched, dtype, device, path, launches, monkeypatch):
    seen = forced_schedule(monkeypatch, sched, vhost=True)
    _check(lq, lk, Hq, Hkv, D, dtype, device, **options)
    _launched_once(launches)
    n_tiles = (sum(lq) // configs.INTERPRET_FWD["BLOCK_M"] + len(lq)) * Hq
    assert [s[:3] for s in seen] == [("attention_fwd", sched, True), ("attention_bwd", sched, None)]
    if device.type == "cpu":
        assert seen[0][3] == ((min(n_tiles, common.sm_count(device)) if sched == 2 else n_tiles),)
        assert sched == 1 or seen[1][3][0] <= common.sm_count(device)


def test_varlen_order_puts_heavy_blocks_first(device):
    """The scheduled forwards' block order: most keys first (ties in block order), the unused
    virtual blocks last."""
    lens = [5, 0, 130, 64]  # 64-row blocks: virtual numbers 0 | 1 (unused) | 2, 3, 4 | 5, 6 (unused)
    cu = _cu(lens, device)
    order = kernels.launchers._varlen_order(cu, cu, sum(lens) // 64 + len(lens), 64, True, False, 0, 0)
    # causal: the 130's blocks see 130, 128 and 64 keys, the 64's one 64, the 5's one 5.
    assert order.tolist() == [4, 3, 2, 5, 0, 1, 6]
    # without causality every block of a sequence sees all its keys
    order = kernels.launchers._varlen_order(cu, cu, sum(lens) // 64 + len(lens), 64, False, False, 0, 0)
    assert order.tolist() == [2, 3, 4, 5, 0, 1, 6]
