"""Split-KV decoding (``kernels/attention/decode.py``): few query rows against a long cache,
keys split over programs and combined by their LSEs, chosen automatically; against the
float64 reference, with the options it takes (causal, window, key padding, softcap, ALiBi,
sinks, an additive bias, a bool mask, GQA), and the regular backward on its output.

The threshold (``launchers.DECODE_MIN_KEYS``) is lowered so that interpreter-sized caches
(130 to 300 keys, 32-key blocks) split into 3 to 5 chunks; the interpreter's stand-in SM count
is 4 (two waves: 8 programs). fp32 runs both IEEE (torch's default "highest") and TF32
("high"): every dtype and precision splits.
"""
import pytest
import torch

from attention_testing import ON_CUDA, check, path  # noqa: F401 - the fixture
from fused_block import reference
from fused_block.attention import attention
from fused_block.kernels import common
from fused_block.kernels.attention import configs, launchers
from numerics import DTYPES, randn

# (dtype, the kernels' fp32 mode); the mode is irrelevant to fp16/bf16.
DTYPE_MODES = [pytest.param(torch.float32, "ieee", id="fp32"), pytest.param(torch.float32, "tf32", id="fp32-tf32"),
               pytest.param(torch.float16, "ieee", id="fp16"), pytest.param(torch.bfloat16, "ieee", id="bf16")]


@pytest.fixture(autouse=True)
def _short_caches(monkeypatch):
    monkeypatch.setattr(launchers, "DECODE_MIN_KEYS", 64)


# (B, Hq, Hkv, Lq, Lk, D, causal, window, padding), each with its reason.
CASES = [
    # One decode step, GQA 4:2 (the group's 4 rows in one program), 300 keys: 4 chunks, the last
    # one partial.
    pytest.param(1, 4, 2, 1, 300, 32, True, (-1, -1), False, id="step-gqa"),
    # Speculative decoding: 5 query rows, causal bottom-right (the last keys masked per row),
    # a 100-key window, GQA 8:2 (20 rows in a 32-row block).
    pytest.param(1, 8, 2, 5, 260, 64, True, (100, -1), False, id="five-rows-window"),
    # MQA, two batches, key padding on the cache's tail, non-causal, D = 16.
    pytest.param(2, 2, 1, 3, 200, 16, False, (-1, -1), True, id="mqa-padding"),
    # D = 128 (fp32: the widest fp32 head dim, IEEE fp32's 16-row blocks), GQA 2:1, causal.
    pytest.param(1, 2, 1, 2, 180, 128, True, (-1, -1), False, id="d128"),
]


@pytest.mark.parametrize("dtype,mode", DTYPE_MODES)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D,causal,window,padding", CASES)
@pytest.mark.sweep
def test_decode_matches_reference(B, Hq, Hkv, Lq, Lk, D, causal, window, padding, dtype, mode, device, path,
                                  launches):
    q = randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True)
    k, v = (randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    kpm = None
    if padding:
        kpm = torch.zeros(B, Lk, dtype=torch.bool, device=device)
        kpm[0, -37:] = True

    def run(q, k, v):
        return attention(q, k, v, causal, None, kpm, window=window, return_lse=True)

    def ref(q, k, v, compute_dtype=None):
        return reference.attention(q, k, v, causal, None, kpm, window=window, return_lse=True,
                                   compute_dtype=compute_dtype)

    check(run, ref, (q, k, v), ("q", "k", "v"), lse_weight=True, mode=mode)
    assert launches["attention_decode"] == 1 and launches["attention_decode_combine"] == 1
    assert launches["attention_fwd"] == 0 and launches["attention_bwd"] == 1


@pytest.mark.parametrize("dtype,mode", DTYPE_MODES)
@pytest.mark.sweep
def test_decode_with_softcap_alibi_sinks(dtype, mode, device, path, launches):
    B, Hq, Hkv, Lq, Lk, D = 1, 4, 1, 2, 230, 32
    q = randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True, scale=3.0)
    k, v = (randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    sinks = randn(Hq, dtype=torch.float32, device=device, requires_grad=True)
    slopes = (torch.rand(B, Hq) * 0.1).to(device)

    def run(q, k, v, sinks):
        return attention(q, k, v, True, softcap=4.0, sinks=sinks, alibi_slopes=slopes, return_lse=True)

    def ref(q, k, v, sinks, compute_dtype=None):
        return reference.attention(q, k, v, True, softcap=4.0, sinks=sinks, alibi_slopes=slopes, return_lse=True,
                                   compute_dtype=compute_dtype)

    check(run, ref, (q, k, v, sinks), ("q", "k", "v", "sinks"), lse_weight=True, mode=mode)
    assert launches["attention_decode"] == 1 and launches["attention_fwd"] == 0


# Every key block size the split kernels can run with: the decode tables' (each architecture's)
# and the interpreter's. Keys the tests below hide from every row span whole blocks of each.
DECODE_BLOCK_NS = sorted({c["BLOCK_N"] for table in configs.DECODE_CONFIGS.values() for cfgs in table.values()
                          for c in cfgs} | {configs.INTERPRET_DECODE["BLOCK_N"]})
HIDDEN_HEAD, HIDDEN_FROM = 128, 256  # keys [0, 128) and [256, Lk) are hidden from every row


def _window_mask(B, Hq, Lq, Lk, device):
    """A bool (B, Hq, Lq, Lk) mask (True = attend): head h sees keys [128 + 8 h, 228 + 8 h)
    with a fifth of them hidden at random; keys below 128 and from 256 on are hidden from every
    row (whole key blocks of every size in ``DECODE_BLOCK_NS``, for every head of a GQA group)."""
    j = torch.arange(Lk)
    lo = HIDDEN_HEAD + 8 * torch.arange(Hq)[:, None, None]
    mask = (j >= lo) & (j < lo + 100) & (torch.rand(B, Hq, Lq, Lk) > 0.2)
    mask[..., 200] = True  # every row sees a key
    return mask.to(device)


def test_hidden_key_ranges_are_whole_blocks_of_every_shipped_config():
    """The NaN-filled ranges of ``test_decode_skips_key_blocks_the_mask_hides`` are whole key
    blocks of every decode config (the H200 ran its 64-key blocks over a range chosen for the
    interpreter's 32, read the NaN keys 64..95 beside visible ones and computed 0 * NaN)."""
    assert DECODE_BLOCK_NS and all(HIDDEN_HEAD % n == 0 and HIDDEN_FROM % n == 0 for n in DECODE_BLOCK_NS)


@pytest.mark.parametrize("dtype,mode", DTYPE_MODES)
@pytest.mark.sweep
def test_decode_with_bias_and_mask(dtype, mode, device, path, launches):
    """T5's generation (a position bias (1, Hq, Lq, Lk) with its gradient) and Hugging Face
    decoding (a 4-D bool mask, per head here) together, causal, GQA 4:2: the split kernels read
    both for the few query rows, as the forward does; the bias gradient by the dbias kernel."""
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 3, 260, 16
    q = randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True)
    k, v = (randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    bias = randn(1, Hq, Lq, Lk, dtype=dtype, device=device, requires_grad=True)
    mask = _window_mask(B, Hq, Lq, Lk, device)

    def run(q, k, v, bias):
        return attention(q, k, v, True, bias=bias, mask=mask, return_lse=True)

    def ref(q, k, v, bias, compute_dtype=None):
        return reference.attention(q, k, v, True, bias=bias, mask=mask, return_lse=True, compute_dtype=compute_dtype)

    check(run, ref, (q, k, v, bias), ("q", "k", "v", "bias"), lse_weight=True, mode=mode)
    assert launches["attention_decode"] == 1 and launches["attention_fwd"] == 0
    assert launches["attention_bwd"] == 1 and launches["attention_dbias"] == 1


# On the interpreter every shipped key block size in turn (the block the kernels skip is the
# config's); on a GPU its own tables' configs.
@pytest.mark.parametrize("block_n", [None] if ON_CUDA else DECODE_BLOCK_NS,
                         ids=lambda n: "device-config" if n is None else f"bn{n}")
@pytest.mark.parametrize("dtype,mode", DTYPE_MODES)
@pytest.mark.sweep
def test_decode_skips_key_blocks_the_mask_hides(dtype, mode, block_n, device, path, launches, monkeypatch):
    """Key blocks a bool mask hides from every row of a GQA group are never read by the split
    kernels: with NaN in keys 0..127 and 256..319 (outside every head's visible range, whole
    blocks of every shipped key block size) output, LSE and gradients are finite and match the
    reference on keys 128..255 alone; a read would poison them (0 * NaN in P V). The heads of
    each group see different ranges (the skipped range is their union)."""
    if block_n is not None:
        monkeypatch.setattr(configs, "INTERPRET_DECODE", common.Config.of(num_warps=1, num_stages=1, BLOCK_N=block_n))
    B, Hq, Hkv, Lq, Lk, D = 1, 4, 2, 2, 320, 16
    visible = HIDDEN_FROM - HIDDEN_HEAD
    q = randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=True)
    k, v = (randn(B, Hkv, visible, D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    mask = _window_mask(B, Hq, Lq, Lk, device)
    head = torch.full((B, Hkv, HIDDEN_HEAD, D), float("nan"), dtype=dtype, device=device)
    tail = torch.full((B, Hkv, Lk - HIDDEN_FROM, D), float("nan"), dtype=dtype, device=device)

    def run(q, k, v):
        full = [torch.cat((head, t, tail), 2) for t in (k, v)]
        return attention(q, *full, mask=mask, return_lse=True)

    def ref(q, k, v, compute_dtype=None):
        return reference.attention(q, k, v, mask=mask[..., HIDDEN_HEAD:HIDDEN_FROM], return_lse=True,
                                   compute_dtype=compute_dtype)

    check(run, ref, (q, k, v), ("q", "k", "v"), lse_weight=True, mode=mode)
    assert launches["attention_decode"] == 1 and launches["attention_fwd"] == 0


def test_decode_is_not_chosen_where_it_does_not_pay(device, launches):
    """Many programs already (B * Hkv row blocks fill two waves over the device's SMs), a short
    cache, more than 16 rows or dropout: the forward kernel. Two waves is the device's: B = 4
    on the interpreter's 4 stand-in SMs, 132 on an H200 (where B = 8 splits, rightly: 16
    programs on 132 SMs)."""
    from fused_block.kernels import common

    def qkv(B, H, Lq, Lk, dtype=torch.float16):
        return tuple(torch.randn(B, H, L, 16, device=device).to(dtype) for L in (Lq, Lk, Lk))
    attention(*qkv(common.cdiv(2 * common.sm_count(device), 2), 2, 1, 300))
    attention(*qkv(1, 2, 1, 40))
    attention(*qkv(1, 2, 17, 300))
    attention(*qkv(1, 2, 1, 300), dropout_p=0.1)
    assert launches["attention_decode"] == 0 and launches["attention_fwd"] == 4


@pytest.mark.parametrize("sms", [4, 132], ids=["interpreter", "h200"])
def test_decode_splits_below_two_waves_of_the_devices_sms(sms, device, monkeypatch):
    """The split count's rule on any SM count (the interpreter's stand-in 4, an H200's 132):
    programs (B * Hkv * row blocks) at two waves or more, no split; one batch fewer, a split,
    of at least two key blocks a chunk."""
    from fused_block.kernels import common

    monkeypatch.setattr(common, "sm_count", lambda d: sms)
    B = common.cdiv(2 * sms, 2)
    assert launchers._decode_splits(B, 2, 1, 300, 32, device) == 1
    assert launchers._decode_splits(B - 1, 2, 1, 300, 32, device) == min(5, common.cdiv(2 * sms, 2 * (B - 1)))
    assert launchers._decode_splits(8, 2, 1, 300, 32, device) == (1 if sms == 4 else 5)  # the H200's failing case


def test_decode_cache_without_visible_keys(device, launches):
    """Lq > visible keys: a fully padded cache row gives 0 and LSE -inf, as the forward's."""
    q, k, v = (torch.randn(1, 2, L, 16, device=device).half() for L in (2, 300, 300))
    kpm = torch.ones(1, 300, dtype=torch.bool, device=device)
    out, lse = attention(q, k, v, key_padding_mask=kpm, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    assert launches["attention_decode"] == 1


# ---------------------------------------------------------------------------------------------
# the fused KV-cache append, then a decode step on the cache
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_cache_append_then_decode(dtype, device, launches):
    """New rows land at each batch's fill level (different per batch), in place, strided new
    k/v (views of a (B, L, Hkv, D) projection); rows past the cache's end are dropped; the
    decode step over the filled cache matches the reference on the same keys."""
    import fused_block
    B, Hkv, L_cache, D, L_new = 2, 2, 300, 16, 3
    k_cache = torch.zeros(B, Hkv, L_cache, D, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    fill = torch.tensor([250, 298], dtype=torch.int32, device=device)  # batch 1: one row dropped
    k_new, v_new = (randn(B, L_new, Hkv, D, dtype=dtype, device=device).transpose(1, 2) for _ in range(2))
    fused_block.kv_cache_append(k_cache, v_cache, k_new, v_new, fill)
    assert launches["attention_kv_append"] == 1
    torch.testing.assert_close(k_cache[0, :, 250:253], k_new[0], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[1, :, 298:300], v_new[1, :, :2], atol=0, rtol=0)
    assert (k_cache[0, :, 253:] == 0).all() and (k_cache[0, :, :250] == 0).all()
    q = randn(B, 4, 1, D, dtype=dtype, device=device)
    kpm = torch.arange(L_cache, device=device)[None] >= (fill + L_new).clamp(max=L_cache)[:, None]
    out = attention(q, k_cache, v_cache, key_padding_mask=kpm)
    want = reference.attention(q.double(), k_cache.double(), v_cache.double(), key_padding_mask=kpm)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)
    assert launches["attention_decode"] == 1


def test_kv_cache_append_drops_rows_before_the_cache(device, launches):
    """A negative fill level: the new rows that would land before row 0 are dropped, as those
    past the end are (never out of bounds), the others written."""
    import fused_block
    kc = torch.zeros(1, 2, 6, 4, device=device)
    vc = torch.zeros_like(kc)
    kn = torch.arange(1.0, 4.0, device=device)[None, None, :, None].expand(1, 2, 3, 4).contiguous()
    fused_block.kv_cache_append(kc, vc, kn, kn, torch.tensor([-2], dtype=torch.int32, device=device))
    assert kc[0, :, 0].eq(3.0).all() and kc[0, :, 1:].eq(0).all() and vc[0, :, 0].eq(3.0).all()


def test_kv_cache_append_into_an_interleaved_packed_cache(device, launches):
    """k and v caches as the two halves of one (B, Hkv, L, 2, D) buffer (their memory spans
    interleave, no element shared): accepted, each written as torch's slice assignment writes it."""
    import fused_block
    kv = torch.randn(2, 2, 8, 2, 16, device=device)
    want = kv.clone()
    kn, vn = torch.randn(2, 2, 3, 16, device=device), torch.randn(2, 2, 3, 16, device=device)
    fill = torch.tensor([1, 4], dtype=torch.int32, device=device)
    fused_block.kv_cache_append(kv[..., 0, :], kv[..., 1, :], kn, vn, fill)
    for b, start in enumerate(fill.tolist()):
        want[b, :, start:start + 3, 0] = kn[b]
        want[b, :, start:start + 3, 1] = vn[b]
    torch.testing.assert_close(kv, want, atol=0, rtol=0)
    assert launches["attention_kv_append"] == 1


def test_caches_sharing_an_element_are_found_exactly(device):
    """kv_cache_append's overlap check on two views of one shape and strides (``attention.
    _share_memory``) against the sets of element offsets they cover, for random shapes, strides
    (nested as a dense buffer's slices, or not) and offsets: never "no" where an element is
    shared (the kernel would race), never "yes" for interleaved views that share none."""
    import itertools

    from fused_block.attention import _share_memory
    buf = torch.zeros(512, device=device)

    def offsets(t):
        return {t.storage_offset() + sum(i * s for i, s in zip(idx, t.stride()))
                for idx in itertools.product(*map(range, t.shape))}

    for _ in range(400):
        nd = int(torch.randint(1, 5, ()))
        shape = torch.randint(1, 5, (nd,)).tolist()
        stride = torch.randint(1, 13, (nd,)).tolist()
        o1, o2 = torch.randint(0, 80, (2,)).tolist()
        a, b = buf.as_strided(shape, stride, o1), buf.as_strided(shape, stride, o2)
        assert _share_memory(a, b) == bool(offsets(a) & offsets(b)), (shape, stride, o1, o2)
    kv = buf[:2 * 2 * 8 * 2 * 4].view(2, 2, 8, 2, 4)  # a packed cache's interleaved k and v halves
    assert not _share_memory(kv[..., 0, :], kv[..., 1, :])
    assert _share_memory(kv[..., 0, :], kv.flatten()[8:].as_strided((2, 2, 8, 4), kv[..., 0, :].stride()))


def test_kv_cache_append_bad_input(device, launches):
    import fused_block
    kc = torch.zeros(2, 2, 10, 16, device=device)
    kn = torch.zeros(2, 2, 1, 16, device=device)
    fill = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="cache_seqlens must have dtype"):
        fused_block.kv_cache_append(kc, kc.clone(), kn, kn, fill.long())
    with pytest.raises(ValueError, match="k must have shape"):
        fused_block.kv_cache_append(kc, kc.clone(), kn[:, :1], kn[:, :1], fill)
    with pytest.raises(TypeError, match="v must have k_cache's dtype"):
        fused_block.kv_cache_append(kc, kc.clone(), kn, kn.half(), fill)
    with pytest.raises(ValueError, match="cache_seqlens must have shape"):
        fused_block.kv_cache_append(kc, kc.clone(), kn, kn, fill[:1])
    assert launches["attention_kv_append"] == 0


def test_kv_cache_append_opcheck(device):
    kc, vc = torch.zeros(2, 2, 40, 16, device=device), torch.zeros(2, 2, 40, 16, device=device)
    kn, vn = torch.randn(2, 2, 3, 16, device=device), torch.randn(2, 2, 3, 16, device=device)
    fill = torch.tensor([0, 30], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.fused_block.attention_kv_cache_append.default, (kc, vc, kn, vn, fill))


def test_decode_torch_compile_fullgraph(device, launches):
    """A decode step with the append, under torch.compile(fullgraph=True): both are opaque ops."""
    import fused_block
    B, Hkv, L, D = 1, 2, 200, 16
    kc, vc = (torch.randn(B, Hkv, L, D, device=device).half() for _ in range(2))
    fill = torch.tensor([150], dtype=torch.int32, device=device)
    q, kn, vn = (torch.randn(B, n, 1, D, device=device).half() for n in (4, Hkv, Hkv))
    kpm = torch.arange(L, device=device)[None] > 150

    def step(q, kc, vc, kn, vn):
        fused_block.kv_cache_append(kc, vc, kn, vn, fill)
        return attention(q, kc, vc, key_padding_mask=kpm)

    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, kn, vn)
    want = step(q, kc2, vc2, kn, vn)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kc, kc2)
    assert launches["attention_decode"] == 2
