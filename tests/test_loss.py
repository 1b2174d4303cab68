"""fused_block.linear_cross_entropy: the LM head's loss without the (N, V) logits.

Every loss and gradient (hidden, weight, bias) is compared with the float64 reference under
the "twice PyTorch's own error" rule (numerics.assert_close, PyTorch's error from the
reference run in the same dtype and fp32 precision mode), for every option and dtype. The
interpreter shapes are small: 37 tokens (odd, not a multiple of any chunk), vocabulary 101
(prime: no tile multiple), hidden 32; chunks are forced small (``FORCE_CHUNK_ROWS``) so that
the first, middle and last chunks of the dW/db accumulation all run. Memory: every allocation
of a forward and backward is recorded (tests/memory_testing.py), with the kernels on 512
tokens and, with launches stubbed on meta tensors, at GPT-2 and LLaMA-3 sizes.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import fused_block
from fused_block import _backend, reference
from fused_block import loss as lce
from fused_block.kernels import loss as kloss

from gemm_testing import DTYPE_MODES, baseline_mode, fp32_mode
from memory_testing import Allocations
from numerics import DTYPES, assert_close, randn

N, V, H = 37, 101, 32


def _inputs(n, v, h, dtype, device, *, bias=True, lead=(), ignore=5, seed=0, ignore_index=-100):
    """hidden (lead..., n, h) and weight scaled so the logits are O(1-3); bias; targets with
    ``ignore`` tokens set to ``ignore_index``."""
    g = torch.Generator().manual_seed(seed)
    hidden = randn(*lead, n, h, dtype=dtype, device=device, requires_grad=True, generator=g)
    weight = randn(v, h, dtype=dtype, device=device, scale=2.0 * h ** -0.5, requires_grad=True, generator=g)
    b = randn(v, dtype=dtype, device=device, scale=0.5, requires_grad=True, generator=g) if bias else None
    target = torch.randint(0, v, (*lead, n), generator=g)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:ignore]] = ignore_index
    return hidden, weight, b, target.to(device)


def _check(dtype, mode, hidden, weight, bias, target, device, **options):
    """Loss and every gradient against the float64 reference, PyTorch's error in ``dtype``."""
    diff = [t for t in (hidden, weight, bias) if t is not None]
    with fp32_mode(mode):
        out = fused_block.linear_cross_entropy(hidden, weight, target, bias, **options)
        g = randn(*out.shape, dtype=torch.float32, device=device) if out.dim() else torch.tensor(1.3, device=device)
        grads = torch.autograd.grad(out, diff, g)
    assert out.dtype == torch.float32

    def ref(ins, compute_dtype=None):
        h, w, b = ins
        return reference.linear_cross_entropy(h, w, target, b, compute_dtype=compute_dtype, **options)

    ins64 = [None if t is None else t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    want = ref(ins64)
    want_grads = torch.autograd.grad(want, [t for t in ins64 if t is not None], g.double())
    insb = [None if t is None else t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    with baseline_mode(dtype, mode):
        base = ref(insb, compute_dtype=dtype)
        base_grads = torch.autograd.grad(base, [t for t in insb if t is not None], g)
    assert_close("loss", out, want, base, dtype=dtype)
    for name, a, r, b in zip(("hidden", "weight", "bias"), grads, want_grads, base_grads):
        assert a.dtype == dtype and a.shape == r.shape
        assert_close(f"grad {name}", a, r, b)
    return out


# (id, options, bias, forced rows per chunk): every option, each reduction; one chunk (the
# rule's choice for 37 tokens: no accumulator) and several (5 chunks of 8: first, middle and a
# 5-row last chunk; 16: two full chunks and a last one).
CASES = [
    ("mean-one-chunk", dict(), False, None),
    ("mean-all-options", dict(label_smoothing=0.1, z_loss=0.05, softcap=4.0), True, 8),
    ("sum-smoothing", dict(label_smoothing=0.2, reduction="sum"), True, 16),
    ("none-zloss-softcap", dict(z_loss=0.02, softcap=3.0, reduction="none"), True, 8),
]


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_linear_cross_entropy(case, dtype_mode, device, launches, monkeypatch):
    _, options, has_bias, rows = case
    dtype, mode = dtype_mode
    monkeypatch.setattr(kloss, "FORCE_CHUNK_ROWS", rows)
    hidden, weight, bias, target = _inputs(N, V, H, dtype, device, bias=has_bias)
    _check(dtype, mode, hidden, weight, bias, target, device, **options)
    chunks = -(-N // rows) if rows else 1
    none = options.get("reduction") == "none"
    passes = 2 if none else 1  # "none" recomputes the chunks' logits in the backward
    # the loss (and, but for "none", the gradient) pass per chunk; "none"'s backward: the
    # gradient pass alone, from the forward's saved LSE
    assert launches["lce_ce"] == chunks and launches["lce_grad"] == (chunks if none else 0)
    # per chunk the logits product and dhidden = dlogits @ W on cuBLAS (no Triton GEMM), dW
    # accumulated on cuBLAS, db in its own kernel
    assert launches["lce_logits"] == passes * chunks and launches["lce_dh"] == chunks and launches["matmul"] == 0
    assert launches["lce_dw"] == chunks and launches["lce_colsum"] == (chunks if has_bias else 0)
    assert launches["lce_count"] == (1 if options.get("reduction", "mean") == "mean" else 0)
    assert launches["lce_sum"] == (0 if none else 1) and launches["lce_scale"] == (0 if none else 1)


# The vocabulary-outer schedule (kloss.schedule: 16-bit weights on few tokens; forced here for
# every dtype): every option and reduction, with and without bias, in vocabulary chunks of 32
# (101 = 3 x 32 + 5: the first chunk starting the row state, middle ones merging it, a masked
# 5-column last chunk; target logits in every chunk), all 37 rows per chunk.
VOCAB_CASES = [
    ("mean-plain", dict(), False),
    ("mean-all-options", dict(label_smoothing=0.1, z_loss=0.05, softcap=4.0), True),
    ("sum-smoothing", dict(label_smoothing=0.2, reduction="sum"), True),
    ("none-zloss-softcap", dict(z_loss=0.02, softcap=3.0, reduction="none"), True),
]


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("case", VOCAB_CASES, ids=[c[0] for c in VOCAB_CASES])
@pytest.mark.parametrize("n,cols", [(N, 32), (9, 16)], ids=["37-tokens", "9-tokens"])
@pytest.mark.sweep
def test_vocabulary_outer_schedule(case, dtype_mode, n, cols, device, launches, monkeypatch):
    # 9 tokens in chunks of 16, 16-bit: dhidden's fp32 (9, H) accumulator takes 2 x 9 rows of dW
    # from row 64 (the multiple of 64 below 101 - 18), so the chunks [64, 80), [80, 96) and
    # [96, 101) write their dW after dhidden, from their dlogits recomputed, and no (9, H) fp32
    # tensor is allocated. 37 tokens: 2 x 37 rows are too many (kloss.deferred_start), fp32:
    # dhidden accumulates in itself.
    _, options, has_bias = case
    dtype, mode = dtype_mode
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", "vocab")
    monkeypatch.setattr(kloss, "FORCE_CHUNK_COLS", cols)
    hidden, weight, bias, target = _inputs(n, V, H, dtype, device, bias=has_bias, ignore=5 if n == N else 2)
    with Allocations() as rec:
        _check(dtype, mode, hidden, weight, bias, target, device, **options)
    chunks = -(-V // cols)
    start = kloss.deferred_start(V, n, H, weight.detach()) if dtype != torch.float32 else None
    assert start == (64 if n == 9 and dtype != torch.float32 else None)
    deferred = 0 if start is None else len(range(start, V, cols))
    if dtype != torch.float32:  # dhidden's accumulator: a buffer of its own unless in dW's rows
        assert any(a.shape == (n, H) and a.dtype == torch.float32 for a in rec.records) == (not deferred)
    # pass 1: logits GEMM + lse merge per chunk; pass 2: logits GEMM again, dlogits, dW, dh (db),
    # and for the deferred chunks the logits GEMM and dlogits again before their dW
    # ("none": pass 1 in the forward, pass 2 in the backward from the saved LSE)
    assert launches["lce_lse"] == chunks and launches["lce_grad"] == chunks + deferred
    assert launches["lce_logits"] == 2 * chunks + deferred and launches["matmul"] == 0
    assert launches["lce_dw"] == launches["lce_dh"] == chunks
    assert launches["lce_colsum"] == (chunks if has_bias else 0) and launches["lce_ce"] == 0
    # every reduction: pass 2 in the backward, dloss folded into dlogits, no scaled copies
    assert launches["lce_scale"] == 0


def test_vocabulary_outer_gradients_in_the_backward(device, launches, monkeypatch):
    # mean/sum on the vocabulary-outer schedule: the forward runs pass 1 only (no gradient
    # product); each backward runs pass 2 with its incoming gradient (a retained graph's second
    # backward, another gradient: the same answer scaled).
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", "vocab")
    monkeypatch.setattr(kloss, "FORCE_CHUNK_COLS", 32)
    chunks = -(-V // 32)
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, device, ignore=5)
    names = ("lce_logits", "lce_dw", "lce_dh", "lce_scale")
    for reduction in ("mean", "sum"):
        base = [launches[n] for n in names]

        def count():
            return tuple(launches[n] - b for n, b in zip(names, base))

        loss = fused_block.linear_cross_entropy(hidden, weight, target, bias, reduction=reduction)
        assert count() == (chunks, 0, 0, 0)
        one = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
        three = torch.autograd.grad(loss, (hidden, weight, bias), torch.tensor(3.0, device=device))
        assert count() == (3 * chunks, 2 * chunks, 2 * chunks, 0)
        want = torch.autograd.grad(reference.linear_cross_entropy(hidden.double(), weight.double(), target,
                                                                  bias.double(), reduction=reduction),
                                   (hidden, weight, bias))
        for a, b, w in zip(one, three, want):
            torch.testing.assert_close(a.double(), w.double(), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(b, 3 * a, atol=1e-6, rtol=1e-5)


def test_vocabulary_outer_frozen_head(device, monkeypatch):
    # No dW (a frozen head): dhidden's accumulator cannot live in dW's rows, so it is a buffer
    # of its own and no chunk is recomputed; dhidden the same as with dW's rows holding it.
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", "vocab")
    monkeypatch.setattr(kloss, "FORCE_CHUNK_COLS", 16)
    hidden, weight, bias, target = _inputs(9, V, H, torch.bfloat16, device, ignore=2, seed=4)
    (want,) = torch.autograd.grad(fused_block.linear_cross_entropy(hidden, weight, target, bias), (hidden,))
    h = hidden.detach().requires_grad_()
    with Allocations() as rec:
        (dh,) = torch.autograd.grad(fused_block.linear_cross_entropy(h, weight.detach(), target, bias.detach()),
                                    (h,))
    assert any(a.shape == (9, H) and a.dtype == torch.float32 for a in rec.records)
    assert torch.equal(dh, want)


def test_schedule_policy_switch(monkeypatch):
    # FUSED_BLOCK_LCE_SCHEDULE: "rows" (time first) everywhere, "vocab" (memory first) wherever
    # the token loop would keep its fp32 dW accumulator, "auto" the memory rule; anything else
    # is refused, naming the variable.
    sched = kloss.schedule
    for value, want in (("", None), ("auto", None), ("Rows", "rows"), (" vocab ", "vocab")):
        monkeypatch.setenv("FUSED_BLOCK_LCE_SCHEDULE", value)
        assert kloss._env_schedule() == want
    monkeypatch.setenv("FUSED_BLOCK_LCE_SCHEDULE", "fastest")
    with pytest.raises(ValueError, match="FUSED_BLOCK_LCE_SCHEDULE"):
        kloss._env_schedule()
    monkeypatch.setattr(kloss, "PREFER", "rows")
    assert sched(8192, 128256, 4096, 2, False, True, True) == "rows"  # the rule's "vocab"
    monkeypatch.setattr(kloss, "PREFER", "vocab")
    assert sched(8192, 50257, 768, 2, False, True, True) == "vocab"  # the rule's "rows" (N >= 8 H)
    assert sched(512, 20000, 4096, 2, False, True, True) == "vocab"  # dhidden's accumulator too
    assert sched(64, 128256, 4096, 2, False, True, True) == "rows"  # one chunk: no accumulator to spare
    assert sched(512, 128256, 4096, 4, True, True, True) == "rows"  # fp32: dW accumulates in itself
    assert sched(512, 128256, 4096, 2, False, True, True, weight_unit_cols=False) == "rows"


def test_deferred_rows_rule():
    bf16 = torch.empty(128256, 8, dtype=torch.bfloat16, device="meta")
    # LLaMA-3's head at 8,192 tokens: 2 N = 16,384 rows from 111,872 - 111,872 % 64 on
    assert kloss.deferred_start(128256, 8192, 4096, bf16) == 111872 - 111872 % 64
    assert kloss.deferred_start(128256, 8192, 4096, None) is None  # no dW to hold it
    assert kloss.deferred_start(128256, 8192, 4096, bf16.float()) is None  # fp32: dW is no 16-bit buffer
    assert kloss.deferred_start(128256, 8192, 4096, bf16[:, ::2]) is None  # not contiguous
    assert kloss.deferred_start(128256, 16033, 4096, bf16) is None  # 2 N > V / 4: the recompute too dear
    assert kloss.deferred_start(80, 9, 16, bf16[:80]) is None  # fewer than 64 rows before the accumulator


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_outer_wide_chunks_and_one_chunk(dtype, device, launches, monkeypatch):
    # 4099 (prime) in chunks of 4097: a chunk wider than the row kernels' 4096-entry tile (one
    # whole tile and a masked one) and a 2-column last chunk; then a single chunk (no row state,
    # dh written at once). dhidden's accumulator in a buffer of its own (no deferred rows), so
    # that pass 2 keeps the 4,097-wide chunk too.
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", "vocab")
    monkeypatch.setattr(kloss, "FORCE_CHUNK_COLS", 4097)
    monkeypatch.setattr(kloss, "MAX_DEFERRED_FRACTION_INV", 1 << 30)
    hidden, weight, bias, target = _inputs(9, 4099, 16, dtype, device, ignore=2)
    _check(dtype, "ieee", hidden, weight, bias, target, device, label_smoothing=0.1, z_loss=0.01)
    assert launches["lce_lse"] == launches["lce_grad"] == launches["lce_dh"] == 2
    monkeypatch.setattr(kloss, "FORCE_CHUNK_COLS", V)
    hidden, weight, bias, target = _inputs(N, V, H, dtype, device, seed=1)
    _check(dtype, "ieee", hidden, weight, bias, target, device, softcap=5.0)
    assert launches["lce_lse"] == launches["lce_grad"] == launches["lce_dh"] == 3


def test_schedule_rule():
    # 16-bit LM heads: the vocabulary-outer schedule exactly where the fp32 (V, H) dW
    # accumulator (4 V H bytes) would exceed 1/8 of the fp32 logits (N < 8 H) and the fp32
    # (N, H) dhidden accumulator does not (H <= V / 8).
    sched = kloss.schedule
    for n in (512, 8192, 32767):
        assert sched(n, 128256, 4096, 2, False, True, True) == "vocab"  # LLaMA-3: 8 H = 32,768
    assert sched(32768, 128256, 4096, 2, False, True, True) == "rows"
    assert sched(512, 50257, 768, 2, False, True, True) == "vocab"  # GPT-2: 8 H = 6,144
    assert sched(8192, 50257, 768, 2, False, True, True) == "rows"
    assert sched(512, 128256, 4096, 4, True, True, True) == "rows"  # fp32: dW accumulates in itself
    assert sched(512, 128256, 4096, 2, False, True, False) == "rows"  # no dW: no accumulator
    assert sched(512, 20000, 4096, 2, False, True, True) == "rows"  # H > V / 8: dh's would break it
    assert sched(512, 20000, 4096, 2, False, False, True) == "vocab"  # ... unless dh is not needed
    assert sched(64, 128256, 4096, 2, False, True, True) == "rows"  # one chunk of rows
    assert sched(512, 128256, 4096, 2, False, True, True, weight_unit_cols=False) == "rows"
    for n, v, elem in ((512, 128256, 2), (512, 50257, 2), (512, 128256, 4), (37, 101, 2), (8192, 128256, 2)):
        vc = kloss.chunk_cols(n, v, elem)
        assert n * kloss.padded_stride(vc, elem) * elem <= min(n * v * 4 / 8, kloss.VOCAB_CHUNK_BUDGET_BYTES)
    # the memory budgets: LLaMA-3's head at 8,192 tokens takes 2,048-column vocabulary chunks
    # (63 chunks of 32 MiB), at 65,536 the 1,024-column floor; 1,024-row token chunks (263 MB)
    # however many tokens
    assert kloss.chunk_cols(8192, 128256, 2) == 2048 and kloss.chunk_cols(65536, 128256, 2) == 1024
    for n in (8192, 65536):
        rows = kloss.chunk_rows(n, 128256, 4096, 2)
        assert rows == 1024 and rows * kloss.padded_stride(128256, 2) * 2 <= kloss.CHUNK_BUDGET_BYTES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_wider_than_one_tile(dtype, device, launches, monkeypatch):
    # 4099 (prime) > the CE kernel's 4096-wide tile: two tiles of the online log-sum-exp and of
    # the gradient pass; 9 tokens in chunks of 4 (the rows schedule forced: bf16 on 9 tokens
    # would take the vocabulary-outer one, tested with this vocabulary above).
    monkeypatch.setattr(kloss, "FORCE_CHUNK_ROWS", 4)
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", "rows")
    hidden, weight, bias, target = _inputs(9, 4099, 16, dtype, device, ignore=2)
    _check(dtype, "ieee", hidden, weight, bias, target, device, label_smoothing=0.1, z_loss=0.01)
    assert launches["lce_ce"] == 3


@pytest.mark.parametrize("schedule", ["rows", "vocab"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_tokens_ignored_give_zero_loss_and_zero_gradients(reduction, schedule, device, monkeypatch):
    monkeypatch.setattr(kloss, "FORCE_CHUNK_ROWS", 16)
    monkeypatch.setattr(kloss, "FORCE_CHUNK_COLS", 32)
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", schedule)
    hidden, weight, bias, target = _inputs(N, V, H, torch.bfloat16, device, ignore=N)
    loss = fused_block.linear_cross_entropy(hidden, weight, target, bias, reduction=reduction, z_loss=0.1,
                                            label_smoothing=0.1)
    assert torch.equal(loss, torch.zeros_like(loss))  # F.cross_entropy's mean would be NaN
    for g in torch.autograd.grad(loss.sum(), (hidden, weight, bias)):
        assert torch.equal(g, torch.zeros_like(g))


def test_custom_ignore_index_and_int32_targets(device):
    # ignore_index may be a valid class id; int32 targets are read as int64.
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, device, ignore_index=7)
    got = fused_block.linear_cross_entropy(hidden, weight, target.int(), bias, ignore_index=7)
    want = reference.linear_cross_entropy(hidden.double(), weight.double(), target, bias.double(), ignore_index=7)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_target_out_of_range(device, launches):
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, device)
    target[3] = V
    if device.type == "cpu":  # no synchronization needed to look: checked, before any launch
        with pytest.raises(ValueError, match="target holds class index 101 outside"):
            fused_block.linear_cross_entropy(hidden, weight, target, bias)
        assert launches["lce_ce"] == 0
    # What CUDA gets (unchecked there): that token's loss and gradient rows are NaN, no other.
    h, w = hidden.detach(), weight.detach()
    loss, _, dh, dw, _ = lce._lce_fwd(h, w, None, target, -100, 0.0, 0.0, 0.0, "none", True, True, False)
    assert torch.isnan(loss[3]) and torch.isfinite(loss[torch.arange(N) != 3]).all()
    assert torch.isnan(dh[3]).all() and torch.isfinite(dh[torch.arange(N) != 3]).all()
    assert torch.isnan(dw).any()


# (target dtype, ignore_index, a stray value that is neither a class nor ignore_index): compared
# in the target's own dtype, ignore_index wraps onto the stray value (uint8: -1 is 255; int32:
# 2^32 - 100 is -100; int8: 156 is -100), which passed the check and gave NaN.
NARROW_TARGETS = [(torch.uint8, -1, 255), (torch.int32, 2 ** 32 - 100, -100), (torch.int8, 156, -100)]


@pytest.mark.parametrize("tdtype,ignore_index,stray", NARROW_TARGETS, ids=["uint8", "int32", "int8"])
@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_narrow_target_dtypes_are_checked_in_int64(tdtype, ignore_index, stray, path, device, launches,
                                                   monkeypatch):
    # The check (CPU tensors: on a GPU machine too) reads the target in int64, as the kernels
    # and the reference do: the stray value raises before any launch on both paths.
    if path == "reference":
        monkeypatch.setattr(_backend, "INTERPRET", False)
    cpu = torch.device("cpu")
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, cpu, ignore=0)
    target = target.to(tdtype)
    target[4] = stray
    with pytest.raises(ValueError, match=f"target holds class index {stray} outside"):
        fused_block.linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index)
    assert launches["lce_ce"] == launches["lce_logits"] == 0
    # A target equal to ignore_index in int64 is ignored (uint8's 255 with ignore_index 255).
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, device, ignore=0)
    target = target.to(torch.uint8)
    target[4] = 255
    got = fused_block.linear_cross_entropy(hidden, weight, target, bias, ignore_index=255)
    want = F.cross_entropy(F.linear(hidden.double(), weight.double(), bias.double()), target.long(),
                           ignore_index=255)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    assert launches["lce_ce"] == (1 if _backend.use_triton(hidden) else 0)  # CUDA tensors: the kernels on both paths
    assert path == "reference" or launches["lce_ce"] == 1


def test_leading_dims_return_lse_and_no_grad(device, launches):
    hidden, weight, bias, target = _inputs(5, V, H, torch.float32, device, lead=(2,))
    loss, lse = fused_block.linear_cross_entropy(hidden, weight, target, bias, reduction="none", softcap=2.5,
                                                 return_lse=True)
    assert loss.shape == lse.shape == (2, 5) and not lse.requires_grad and lse.dtype == torch.float32
    want_loss, want_lse = reference.linear_cross_entropy(hidden.double(), weight.double(), target, bias.double(),
                                                         reduction="none", softcap=2.5, return_lse=True)
    torch.testing.assert_close(loss.double(), want_loss, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=0)
    with torch.no_grad():  # the loss only: one product and one CE pass per chunk, no gradient
        before = launches["lce_logits"], launches["lce_ce"]
        fused_block.linear_cross_entropy(hidden, weight, target, bias)
        assert (launches["lce_logits"] - before[0], launches["lce_ce"] - before[1]) == (1, 1)
    assert launches["lce_dw"] == launches["lce_dh"] == 0




@pytest.mark.parametrize("schedule", ["rows", "vocab"])
def test_return_lse_over_several_chunks(schedule, device, launches, monkeypatch):
    # The LSE beside a training call's loss where it is assembled from several chunks: 5 row
    # chunks of 8 (rows), or 4 vocabulary chunks of 32 whose online state pass 1 merges
    # (vocab); ignored tokens keep their LSE, softcap and z_loss on.
    monkeypatch.setattr(kloss, "FORCE_CHUNK_ROWS", 8)
    monkeypatch.setattr(kloss, "FORCE_CHUNK_COLS", 32)
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", schedule)
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, device)
    loss, lse = fused_block.linear_cross_entropy(hidden, weight, target, bias, softcap=2.5, z_loss=0.01,
                                                 return_lse=True)
    assert lse.shape == (N,) and not lse.requires_grad and loss.requires_grad
    want_loss, want_lse = reference.linear_cross_entropy(hidden.double(), weight.double(), target, bias.double(),
                                                         softcap=2.5, z_loss=0.01, return_lse=True)
    torch.testing.assert_close(loss.double(), want_loss, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=0)
    assert launches["lce_lse" if schedule == "vocab" else "lce_ce"] == (4 if schedule == "vocab" else 5)
def test_strided_inputs(device, monkeypatch):
    # hidden with a non-unit column stride (a transposed view), a strided bias and target: read
    # (or copied) as such; the weight a slice with a longer row stride (the GEMMs take strides).
    monkeypatch.setattr(kloss, "FORCE_CHUNK_ROWS", 16)
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, device)
    h_t = hidden.detach().t().contiguous().t().requires_grad_()  # (N, H) with strides (1, N)
    w_wide = torch.cat((weight.detach(), weight.detach()), 1)[:, :H].requires_grad_()  # row stride 2H
    b_strided = torch.stack((bias.detach(), bias.detach()), 1)[:, 0].requires_grad_()
    t_strided = torch.stack((target, target), 1)[:, 0]
    loss = fused_block.linear_cross_entropy(h_t, w_wide, t_strided, b_strided)
    grads = torch.autograd.grad(loss, (h_t, w_wide, b_strided))
    want = reference.linear_cross_entropy(hidden.double(), weight.double(), target, bias.double())
    want_grads = torch.autograd.grad(want, (hidden, weight, bias))
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=0)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)


def test_backward_twice_and_partial_gradients(device, launches, monkeypatch):
    # The forward's gradients are scaled into new tensors: a retained graph's second backward
    # gets the same answer. Frozen parameters are not differentiated (no dW, db kernels).
    monkeypatch.setattr(kloss, "FORCE_CHUNK_ROWS", 16)
    hidden, weight, bias, target = _inputs(N, V, H, torch.bfloat16, device)
    loss = fused_block.linear_cross_entropy(hidden, weight, target, bias)
    two = torch.tensor(2.0, device=device)
    first = torch.autograd.grad(loss, (hidden, weight, bias), two, retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, bias), two)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    before = launches["lce_dw"], launches["lce_colsum"], launches["lce_logits"], launches["lce_dh"]
    h = hidden.detach().requires_grad_()
    (dh,) = torch.autograd.grad(fused_block.linear_cross_entropy(h, weight.detach(), target, bias.detach()), (h,))
    assert (launches["lce_dw"], launches["lce_colsum"]) == before[:2]
    assert (launches["lce_logits"] - before[2], launches["lce_dh"] - before[3]) == (3, 3)  # 3 chunks
    torch.testing.assert_close(dh, first[0] / 2)


# (input changed in place, inputs taking a gradient, whether torch's F.linear + F.cross_entropy
# raise: they save hidden for dW, the weight for dhidden, the target, never the bias)
INPLACE = [("hidden", "hwb", True), ("weight", "hwb", True), ("target", "hwb", True), ("bias", "hwb", False),
           ("weight", "w", False), ("hidden", "h", False)]


@pytest.mark.parametrize("changed,trained,raises", INPLACE, ids=[f"{c}-{t}" for c, t, _ in INPLACE])
def test_inplace_change_between_forward_and_backward(changed, trained, raises, device, launches, monkeypatch):
    # An input changed in place between forward and backward (an optimizer.step() before the
    # backward): torch raises "modified by an inplace operation" where its backward reads it.
    # The rows schedule computes the gradients in the forward and its backward only scaled
    # them: it raised nothing and returned the gradients of the old values. Where torch
    # answers, so does it (the forward's gradients: the old values', as torch's). The version
    # bump is the misuse (mul_(1): the target stays valid). 9 tokens: small.
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", "rows")
    hidden, weight, bias, target = _inputs(9, V, H, torch.float32, device, ignore=2)
    for t, c in ((hidden, "h"), (weight, "w"), (bias, "b")):
        t.requires_grad_(c in trained)
    inputs = dict(hidden=hidden, weight=weight, bias=bias, target=target)
    loss = fused_block.linear_cross_entropy(hidden, weight, target, bias)
    assert launches["lce_logits"] > 0
    diff = [t for t in (hidden, weight, bias) if t.requires_grad]
    want = torch.autograd.grad(reference.linear_cross_entropy(hidden.double(), weight.double(), target,
                                                              bias.double()), diff)
    with torch.no_grad():
        inputs[changed].mul_(1)
    if raises:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(loss, diff)
    else:
        for a, r in zip(torch.autograd.grad(loss, diff), want):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(reduction, device):
    hidden, weight, bias, _ = _inputs(0, V, H, torch.float32, device, ignore=0)
    target = torch.zeros(0, dtype=torch.int64, device=device)
    loss = fused_block.linear_cross_entropy(hidden, weight, target, bias, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert torch.equal(loss.sum(), torch.zeros((), device=device))
    grads = torch.autograd.grad(loss.sum(), (hidden, weight, bias))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads) and grads[1].shape == weight.shape


def test_module_and_autocast(device):
    hidden, _, _, target = _inputs(N, V, H, torch.float32, device)
    head = fused_block.LinearCrossEntropy(H, V, device=device, label_smoothing=0.1)
    plain = torch.nn.Linear(H, V, device=device)
    plain.load_state_dict(head.state_dict())
    assert isinstance(head, torch.nn.Linear) and head.state_dict().keys() == plain.state_dict().keys()
    torch.testing.assert_close(head(hidden), plain(hidden))  # no target: the logits
    want = F.cross_entropy(plain(hidden), target, label_smoothing=0.1)
    torch.testing.assert_close(head(hidden, target), want, atol=1e-5, rtol=0)
    shared = fused_block.LinearCrossEntropy.from_linear(plain, softcap=30.0)
    assert shared.weight is plain.weight and shared.bias is plain.bias and shared.softcap == 30.0
    assert "softcap=30.0" in repr(copy.deepcopy(shared))
    # Autocast: bf16 GEMMs from fp32 parameters (as F.linear), an fp32 loss, fp32 gradients.
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = head(hidden, target)
    assert loss.dtype == torch.float32
    loss.backward()
    assert head.weight.grad.dtype == torch.float32 and head.bias.grad is not None
    want = reference.linear_cross_entropy(hidden.double(), head.weight.double(), target, head.bias.double(),
                                          label_smoothing=0.1)
    assert abs(loss.item() - want.item()) < 2e-2


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_module_in_float64_runs_torchs_math(reduction, device, launches):
    """A head after ``.double()`` given float64 hidden states: torch's F.linear + F.cross_entropy
    in float64 (the loss and every gradient), as the other modules run float64; no launch (the
    kernels take no float64: the function raised its TypeError)."""
    hidden, _, _, target = _inputs(N, V, H, torch.float32, device)
    hidden = hidden.detach().double().requires_grad_()
    head = fused_block.LinearCrossEntropy(H, V, device=device, label_smoothing=0.1, reduction=reduction).double()
    plain = copy.deepcopy(head)
    got = head(hidden, target)
    want = F.cross_entropy(torch.nn.functional.linear(hidden, plain.weight, plain.bias), target,
                           label_smoothing=0.1, reduction=reduction)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (hidden, head.weight, head.bias), g),
                    torch.autograd.grad(want, (hidden, plain.weight, plain.bias), g)):
        torch.testing.assert_close(a, b)
    assert launches["lce_ce"] == launches["lce_logits"] == 0


def test_module_in_float64_target_out_of_range_raises_as_torch():
    """The float64 head (torch's math) with a target of -100 under another ignore_index: an
    IndexError as F.cross_entropy gives, where the reference's inner F.cross_entropy ignored it
    by its default ignore_index (a silently lower mean, the token counted). CPU tensors (on
    CUDA both would hit a device-side assert)."""
    device = torch.device("cpu")
    hidden, _, _, target = _inputs(N, V, H, torch.float32, device, ignore=0)
    hidden = hidden.detach().double()
    target[3] = -100
    head = fused_block.LinearCrossEntropy(H, V, device=device, ignore_index=0).double()
    with pytest.raises(IndexError):
        F.cross_entropy(F.linear(hidden, head.weight, head.bias), target, ignore_index=0)
    with pytest.raises(IndexError):
        head(hidden, target)


def test_torch_compile_fullgraph_and_opcheck(device, launches):
    hidden, weight, bias, target = _inputs(N, V, H, torch.float32, device)
    eager = fused_block.linear_cross_entropy(hidden, weight, target, bias, z_loss=0.01)
    want = torch.autograd.grad(eager, (hidden, weight, bias))
    torch._dynamo.reset()
    # aot_eager: dynamo, the ops' fake implementations and AOT autograd (inductor's CPU codegen
    # would add tens of seconds of compile time to the interpreter suite).
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    fn = torch.compile(lambda h, w, b, t: fused_block.linear_cross_entropy(h, w, t, b, z_loss=0.01), fullgraph=True,
                       backend=backend)
    loss = fn(hidden, weight, bias, target)
    got = torch.autograd.grad(loss, (hidden, weight, bias))
    torch.testing.assert_close(loss, eager)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    h, w, b = hidden.detach(), weight.detach(), bias.detach()
    torch.library.opcheck(lce._lce_fwd.default, (h, w, b, target, -100, 0.1, 0.01, 0.0, "mean", True, True, True))
    lse = lce._lce_fwd(h, w, b, target, -100, 0.0, 0.0, 3.0, "none", False, False, False)[1]
    torch.library.opcheck(lce._lce_bwd.default, (torch.rand(N, device=device), h, w, b, target, lse, -100, 0.0, 0.0,
                                                 3.0, "none", True, True, True))
    torch.library.opcheck(lce._lce_bwd.default, (torch.tensor(0.5, device=device), h, w, b, target, lse, -100, 0.0,
                                                 0.0, 3.0, "mean", True, True, True))
    torch.library.opcheck(lce._lce_scale.default, (torch.tensor(0.5, device=device), h, w, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_op_takes_strided_gradients(dtype, device, launches):
    """The scaling op (the backward of the gradients-in-the-forward schedule) called directly on
    a transposed and a strided tensor: g times each, contiguous outputs as its fake's (it read
    them as contiguous: wrong values, and a fake whose strides differed)."""
    g = torch.rand((), device=device) + 0.5
    dh = randn(H, N, dtype=dtype, device=device).t()
    dw = randn(V, 2 * H, dtype=dtype, device=device)[:, ::2]
    db = randn(V, dtype=dtype, device=device)
    out = lce._lce_scale(g, dh, dw, db)
    assert launches["lce_scale"] == 1
    for got, t in zip(out, (dh, dw, db)):
        assert got.is_contiguous() and got.dtype == dtype
        torch.testing.assert_close(got, (g.double() * t.double()).to(dtype))  # one rounding: dtype's tolerance
    torch.library.opcheck(lce._lce_scale.default, (g, dh, dw, db))


# ---------------------------------------------------------------------------------------------
# memory: no (N, V) tensor, no allocation above 1/8 of the fp32 logits
# ---------------------------------------------------------------------------------------------

def _record(hidden, weight, bias, target):
    with Allocations() as rec:
        loss = fused_block.linear_cross_entropy(hidden, weight, target, bias)
        torch.autograd.grad(loss, [t for t in (hidden, weight, bias) if t is not None])
    return rec, loss


def _assert_rule(rec, n, v, h, dtype):
    """No allocation above 1/8 of the fp32 (n, v) logits but the results (by shape and dtype:
    dhidden (n, h) and dW (v, h) in the inputs' dtype, db (v,), the per-token loss and lse (n,)
    fp32, and the backward's scaled copies of them), and no logits-sized tensor at all: fp32
    accumulators (dW's (v, h), dhidden's (n, h)) count. Returns the largest other one."""
    results = {((n, h), dtype), ((v, h), dtype), ((v,), dtype), ((n,), torch.float32)}
    others = [a for a in rec.records if (a.shape, a.dtype) not in results]
    largest = max(others, key=lambda a: a.nbytes)
    assert largest.nbytes <= n * v * 4 / 8, largest
    assert not [a for a in others if torch.Size(a.shape).numel() >= n * v]
    return largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_rule_with_the_kernels(dtype, device):
    # 512 tokens (where the rule starts): the chunk rule's own choice (5 chunks of 127 rows in
    # bf16, 9 of 63 in fp32: masked K steps), the kernels running, the loss right.
    n, v, h = 512, 1000, 32
    hidden, weight, bias, target = _inputs(n, v, h, dtype, device)
    rec, loss = _record(hidden, weight, bias, target)
    largest = _assert_rule(rec, n, v, h, dtype)
    rows = kloss.chunk_rows(n, v, h, hidden.element_size())
    assert largest.shape == (rows, kloss.padded_stride(v, hidden.element_size())) and rows < n // 4
    want = reference.linear_cross_entropy(hidden.double(), weight.double(), target, bias.double())
    assert abs(loss.item() - want.item()) < 1e-2


def test_memory_rule_vocabulary_outer_with_the_kernels(device):
    # bf16 with H = 24 > N / 8: the rows schedule's fp32 dW accumulator would be 1.5x the
    # rule's bound, so the rule picks the vocabulary-outer schedule (its own choice of 4
    # vocabulary chunks of 64), the kernels running, the loss right. 128 tokens, not 512: the
    # interpreter runs the row kernels one program per row and chunk (512 tokens took 30 s); the
    # model sizes from 512 tokens up are recorded below with the launches stubbed.
    n, v, h = 128, 256, 24
    assert kloss.schedule(n, v, h, 2, False, True, True) == "vocab"
    hidden, weight, bias, target = _inputs(n, v, h, torch.bfloat16, device)
    rec, loss = _record(hidden, weight, bias, target)
    largest = _assert_rule(rec, n, v, h, torch.bfloat16)
    vc = kloss.chunk_cols(n, v, 2)
    assert vc == 64 and largest.shape == (n, vc)
    assert not [a for a in rec.records if a.shape == (v, h) and a.dtype == torch.float32]
    want = reference.linear_cross_entropy(hidden.double(), weight.double(), target, bias.double())
    assert abs(loss.item() - want.item()) < 1e-2


# Model sizes on meta tensors with the launches stubbed (host_only): only the allocations run.
MODEL_SHAPES = [pytest.param(n, v, h, id=f"{name}-{n}") for name, v, h in (("gpt2", 50257, 768),
                                                                           ("llama3", 128256, 4096))
                for n in (512, 8192, 32768)]


def _record_meta(n, v, h):
    meta = torch.device("meta")
    hidden = torch.empty(n, h, dtype=torch.bfloat16, device=meta, requires_grad=True)
    weight = torch.empty(v, h, dtype=torch.bfloat16, device=meta, requires_grad=True)
    with _backend.host_only():
        rec, _ = _record(hidden, weight, None, torch.zeros(n, dtype=torch.int64, device=meta))
    return rec


@pytest.mark.parametrize("n,v,h", MODEL_SHAPES)
def test_memory_rule_at_model_sizes(n, v, h):
    rec = _record_meta(n, v, h)
    largest = _assert_rule(rec, n, v, h, torch.bfloat16)
    # Alive at once, at most: in the forward the chunk buffer, dhidden, dW and the schedule's
    # fp32 accumulator (rows: dW's with several chunks; vocab: dhidden's, and the (4, n) row
    # state); in the backward the forward's gradients and their scaled copies. (The fp32
    # logits alone are n v 4 bytes, twice with their gradient.)
    if kloss.schedule(n, v, h, 2, False, True, True) == "vocab":
        vc = kloss.chunk_cols(n, v, 2)
        assert largest.shape == (n, kloss.padded_stride(vc, 2))
        accumulator = 16 * n
        # The gradients are computed in the backward (no scaled copies): at most the chunk
        # buffer, dhidden, dW and a few (n,) vectors at once; dhidden's fp32 accumulator lives
        # in dW's last rows (their dW written after it), never allocated.
        assert not [a for a in rec.records if a.shape == (n, h) and a.dtype == torch.float32]
        assert rec.peak <= largest.nbytes + 2 * n * h + 2 * v * h + 32 * n + 64
    else:
        rows = kloss.chunk_rows(n, v, h, 2)
        accumulator = 4 * v * h if n > rows else 0  # within the rule here (n >= 8 h)
        assert largest.nbytes == max(rows * kloss.padded_stride(v, 2) * 2, accumulator)
    forward = largest.nbytes + 2 * n * h + 2 * v * h + accumulator
    assert rec.peak <= max(forward, 4 * n * h + 4 * v * h) + 8 * n + 64


def test_peak_at_the_probe_shape_is_within_ligers():
    # Issue 29's loss target: the step's peak beside the inputs at the H200 probe's shape (8,192
    # tokens, hidden 4,096, LLaMA-3's vocabulary, bf16) at most Liger-Kernel's measured there
    # (1,129 MiB, ../shared/gpu-results/2026-12-04-h200), with fp32 accumulation: dW and
    # dhidden (the results), the 32 MiB chunk buffer and (n,) vectors.
    n, v, h = 8192, 128256, 4096
    rec = _record_meta(n, v, h)
    assert rec.peak <= 2 * v * h + 2 * n * h + kloss.VOCAB_CHUNK_BUDGET_BYTES + 64 * n
    assert rec.peak / 2**20 <= 1129


@pytest.mark.parametrize("n,v,h", [pytest.param(512, 128256, 4096, id="llama3-512"),
                                   pytest.param(512, 50257, 768, id="gpt2-512")])
def test_rows_schedule_breaks_the_rule_where_vocab_is_chosen(n, v, h, monkeypatch):
    # What the vocabulary-outer schedule removes: the rows schedule forced at these shapes
    # allocates the fp32 (V, H) dW accumulator, above 1/8 of the fp32 logits.
    monkeypatch.setattr(kloss, "FORCE_SCHEDULE", "rows")
    rec = _record_meta(n, v, h)
    acc = [a for a in rec.records if a.shape == (v, h) and a.dtype == torch.float32]
    assert acc and acc[0].nbytes == 4 * v * h > n * v * 4 / 8
    with pytest.raises(AssertionError):
        _assert_rule(rec, n, v, h, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# the benchmark spec
# ---------------------------------------------------------------------------------------------

def test_bench_spec_cases_and_numerics():
    """bench/specs/loss.py builds its cases without CUDA and its CPU numerics pass."""
    import sys
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench.specs import loss as spec

    quick, full = spec.cases(True), spec.cases(False)
    assert {c.shape["model"] for c in full} == {"gpt2", "llama3"} and {c.shape["tokens"] for c in full} >= {8192, 32768}
    assert all(set(c.providers) >= {"fused_block", "eager", "torch.compile", "liger"} for c in full)
    assert len(quick) < len(full)
    llama = next(c for c in full if c.shape["model"] == "llama3" and c.mode == "fwd+bwd")
    assert llama.flops == 6 * llama.shape["tokens"] * 128256 * 4096
    rows = spec.numerics()
    assert rows and all(r.get("ok") for r in rows), rows



def test_fp32_accumulating_product(device):
    """The loss's fp32-accumulating product in place, both ways it is called: ``beta=1`` adds to
    the fp32 accumulator, ``beta=0`` ignores what it holds (NaNs included). On CUDA through
    torch's 16-bit -> fp32 ``addmm`` overload where the once-per-device probe found it working;
    on the CPU (no such product) by upcasting: the same sums either way."""
    from fused_block.kernels import loss as kloss

    a = torch.randn(5, 7, dtype=torch.bfloat16, device=device)
    b = torch.randn(7, 3, dtype=torch.bfloat16, device=device)
    product = a.double().matmul(b.double())
    acc = torch.randn(5, 3, device=device)
    want = (acc.double() + product).float()
    if device.type == "cpu":
        assert not kloss._has_out_dtype(acc, a)  # no 16-bit -> fp32 product on the CPU: the upcast
    kloss._addmm_fp32(acc, a, b, 1)
    torch.testing.assert_close(acc, want)
    acc.fill_(float("nan"))
    kloss._addmm_fp32(acc, a, b, 0)
    torch.testing.assert_close(acc, product.float())
