"""The opt-in Gluon Hopper forwards (``kernels/attention/hopper.py``, ``FUSED_BLOCK_HOPPER_ATTN=1``,
``ws``, ``persistent`` or ``pingpong``).

On the CPU (the interpreter cannot run Gluon): which calls the launcher hands to it (only with
the switch, only on sm_90, only the cases it supports; everything else runs the Triton
forward), and that the interpreter keeps its own path with the switch on. On an sm_90 GPU:
the Gluon kernel's output and LSE against the float64 reference with PyTorch's own error as
the baseline (``numerics.assert_close``'s 2x rule), and gradients through the regular
backward from its LSE; those tests are skipped (never passed) elsewhere.
"""
import pytest
import torch

from fused_block import reference
from fused_block.attention import attention
from fused_block.kernels import common
from fused_block.kernels.attention import hopper, launchers
from gemm_testing import baseline_mode
from numerics import ATOL, assert_close, randn

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device, grad=False):
    return (randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=grad),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=grad),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=grad))


# ---------------------------------------------------------------------------------------------
# dispatch (CPU): the launcher's choice, with the architecture faked and both kernels recorded
# ---------------------------------------------------------------------------------------------

def _route(monkeypatch, arch=90, enabled=True):
    """Fake ``arch`` and the switch; record which forward ``launchers.forward`` launches (neither
    runs: the outputs keep their poison, unchecked here)."""
    taken = []
    monkeypatch.setattr(hopper, "ENABLED", enabled)
    monkeypatch.setattr(common, "arch", lambda device: arch)
    monkeypatch.setattr(common, "TUNE", False)  # no candidate timing (on a GPU machine too)
    monkeypatch.setattr(hopper, "forward", lambda *a, **k: taken.append("hopper"))
    monkeypatch.setattr(launchers, "_fwd_launch", lambda cfg, launch: taken.append("triton"))
    return taken


def _call(q, k, v, causal=False, **features):
    B, Hq, Lq, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32)
    seed = torch.zeros(1, dtype=torch.int64)
    kw = dict(key_padding_mask=None, dropout_p=0.0)
    kw.update(features)
    launchers.forward(q, k, v, out, lse, kw.pop("key_padding_mask"), seed, causal, D ** -0.5, kw.pop("dropout_p"),
                      **kw)


# Lq = 40 > DECODE_MAX_LQ: never the split-KV decoding path.
_B, _H, _L = 1, 2, 40


@pytest.mark.parametrize("variant", ["wg2", "ws", "pingpong"], ids=["wg2", "wspec", "pingpong"])
@pytest.mark.parametrize("D", sorted(hopper.PADDED))
@pytest.mark.parametrize("dtype", hopper.DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_supported_calls_take_the_gluon_forward(D, dtype, causal, variant, monkeypatch):
    taken = _route(monkeypatch)
    monkeypatch.setattr(hopper, "WS", variant == "ws")
    monkeypatch.setattr(hopper, "PINGPONG", variant == "pingpong")
    _call(*_qkv(_B, 4, 2, _L, _L + 7, D, dtype, "cpu"), causal)  # GQA 2:1, cross lengths
    assert taken == ["hopper"]


@pytest.mark.parametrize("arch,enabled", [(90, False), (80, True)], ids=["switch-off", "sm80"])
def test_the_switch_and_sm90_are_required(arch, enabled, monkeypatch):
    taken = _route(monkeypatch, arch=arch, enabled=enabled)
    _call(*_qkv(_B, _H, _H, _L, _L, 64, torch.bfloat16, "cpu"), True)
    assert taken == ["triton"]


def _unsupported():
    """(name, tensors, features) of calls the Gluon forward does not take."""
    bf = torch.bfloat16
    qkv = _qkv(_B, _H, _H, _L, _L, 64, bf, "cpu")
    q, k, v = qkv
    pad = torch.zeros(_B, _L, dtype=torch.bool)
    # A head dim whose rows are 16-byte aligned but not 64/128, fp32, and a row stride that
    # TMA cannot take (an odd number of elements: 2-byte misaligned rows).
    odd = torch.randn(_B, _H, _L, 65, dtype=torch.float32).to(bf)[..., :64]
    return [
        # Head dims without a kernel (96 and 192 run the 128 and 256 kernels zero-padded).
        ("d80", _qkv(_B, _H, _H, _L, _L, 80, bf, "cpu"), {}),
        ("d160", _qkv(_B, _H, _H, _L, _L, 160, bf, "cpu"), {}),
        ("fp32", _qkv(_B, _H, _H, _L, _L, 64, torch.float32, "cpu"), {}),
        ("dropout", qkv, dict(dropout_p=0.1)),
        ("padding", qkv, dict(key_padding_mask=pad)),
        ("window", qkv, dict(window=(8, 0))),
        ("softcap", qkv, dict(softcap=30.0)),
        ("sinks", qkv, dict(sinks=torch.zeros(_H))),
        ("alibi", qkv, dict(alibi=torch.ones(_H))),
        ("bias", qkv, dict(bias=torch.zeros(_L, _L, dtype=bf))),
        ("mask", qkv, dict(mask=torch.ones(_L, _L, dtype=torch.bool))),
        ("unaligned", (odd, k, v), {}),
    ]


@pytest.mark.parametrize("name,tensors,features", _unsupported(), ids=[c[0] for c in _unsupported()])
def test_unsupported_calls_take_the_triton_forward(name, tensors, features, monkeypatch):
    taken = _route(monkeypatch)
    _call(*tensors, True, **features)
    assert taken == ["triton"], name


def test_padded_head_dims_run_the_next_kernel():
    """96 and 192 run the 128 and 256 kernels (zero columns past D), every kernel dim its own;
    each kernel dim has candidates for both variants."""
    assert hopper.PADDED == {64: 64, 96: 128, 128: 128, 192: 256, 256: 256}
    assert (set(hopper.PADDED.values()) == set(hopper.HEAD_DIMS) == set(hopper.CONFIGS) == set(hopper.WS_CONFIGS)
            == set(hopper.PINGPONG_CONFIGS) == set(hopper._PP_CANDIDATES))
    assert all(hopper._CANDIDATES[d, ws] for d in hopper.HEAD_DIMS for ws in (False, True))
    assert all(hopper._PP_CANDIDATES[d] for d in hopper.HEAD_DIMS)


def test_the_persistent_form_is_the_last_candidate():
    """The single-partition kernel's candidates end with its persistent form (taken only where
    the GPU timed it faster: FUSED_BLOCK_TUNE=0 takes the first); the warp-specialized has none."""
    for d in hopper.HEAD_DIMS:
        flags = [c["PERSISTENT"] for c in hopper._CANDIDATES[d, False]]
        assert flags == [False] * len(hopper.CONFIGS[d]) + [True] * len(hopper.PERSISTENT_CONFIGS[d])
        assert not any(c["PERSISTENT"] for c in hopper._CANDIDATES[d, True])


@pytest.mark.parametrize("switch", ["1", "persistent"])
def test_the_persistent_switch_takes_the_persistent_form(switch, monkeypatch):
    """FUSED_BLOCK_HOPPER_ATTN=persistent runs the persistent form only (its own config key);
    =1 times every candidate (here, untimed, the first)."""
    chosen = []
    monkeypatch.setattr(hopper, "PERSISTENT", switch == "persistent")
    monkeypatch.setattr(hopper, "WS", False)
    monkeypatch.setattr(hopper, "_CACHE", common.ConfigCache("attention_fwd_hopper"))
    monkeypatch.setattr(common, "TUNE", False)
    monkeypatch.setattr(hopper, "_launch", lambda cfg, launch: chosen.append(cfg))
    q, k, v = _qkv(_B, 4, 2, _L, _L, 96, torch.bfloat16, "cpu")
    hopper.forward(q, k, v, torch.empty_like(q), torch.empty(_B, 4, _L), True, 96 ** -0.5, None)
    want = hopper.PERSISTENT_CONFIGS[128][0] if switch == "persistent" else hopper.CONFIGS[128][0]
    assert [(c["BLOCK_N"], c["STAGES"], c["PERSISTENT"]) for c in chosen] == [(*want, switch == "persistent")]


@pytest.mark.parametrize("D", sorted(hopper.PADDED))
@pytest.mark.parametrize("switch", ["ws", "pingpong", "pingpong_overlap", "pingpong_persistent"])
def test_the_pingpong_switch_takes_the_pingpong_candidates(switch, D, monkeypatch):
    """FUSED_BLOCK_HOPPER_ATTN=pingpong runs the ping-pong kernel's candidates only (its own
    config key; here, untimed, the first: the consumers without OVERLAP); =pingpong_overlap
    only those with the consumers one score block deeper; =ws never does (its candidates are
    the warp-specialized kernel's alone)."""
    chosen = []
    monkeypatch.setattr(hopper, "PINGPONG", switch.startswith("pingpong"))
    monkeypatch.setattr(hopper, "PP_OVERLAP", switch == "pingpong_overlap")
    monkeypatch.setattr(hopper, "PP_PERSISTENT", switch == "pingpong_persistent")
    monkeypatch.setattr(hopper, "WS", switch == "ws")
    monkeypatch.setattr(hopper, "PERSISTENT", False)
    monkeypatch.setattr(hopper, "_CACHE", common.ConfigCache("attention_fwd_hopper"))
    monkeypatch.setattr(common, "TUNE", False)
    monkeypatch.setattr(hopper, "_launch", lambda cfg, launch: chosen.append(cfg))
    q, k, v = _qkv(_B, 4, 2, _L, _L, D, torch.bfloat16, "cpu")
    hopper.forward(q, k, v, torch.empty_like(q), torch.empty(_B, 4, _L), True, D ** -0.5, None)
    (cfg,) = chosen
    d = hopper.PADDED[D]
    if switch == "pingpong":
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"]) == hopper.PINGPONG_CONFIGS[d][0]
        assert cfg["PINGPONG"] and cfg["WS"] and not cfg["PERSISTENT"] and cfg.num_warps == 4
        assert not cfg["OVERLAP"]
    elif switch == "pingpong_overlap":
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"]) == hopper.PP_OVERLAP_CONFIGS[d][0]
        assert cfg["PINGPONG"] and cfg["OVERLAP"] and not cfg["PERSISTENT"] and cfg.num_warps == 4
    elif switch == "pingpong_persistent":
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"]) == hopper.PP_PERSISTENT_CONFIGS[d][0]
        assert cfg["PINGPONG"] and cfg["PERSISTENT"] and not cfg["OVERLAP"] and cfg.num_warps == 4
    else:
        assert (cfg["BLOCK_N"], cfg["STAGES"]) == hopper.WS_CONFIGS[d][0] and not cfg["PINGPONG"]
    assert not any(c["PINGPONG"] for ws in (False, True) for c in hopper._CANDIDATES[d, ws])
    assert all(c["PINGPONG"] for c in hopper._PP_CANDIDATES[d])


def test_the_overlap_and_persistent_candidates_follow_the_pingpong_ones():
    """=pingpong times the consumers one score block deeper, then the persistent form, after
    the existing ping-pong candidates (FUSED_BLOCK_TUNE=0 takes the first: the existing
    kernel's first tile)."""
    for d in hopper.HEAD_DIMS:
        got = [(c["BLOCK_M"], c["BLOCK_N"], c["STAGES"], c["OVERLAP"], c["PERSISTENT"])
               for c in hopper._PP_CANDIDATES[d]]
        assert got == ([(*t, False, False) for t in hopper.PINGPONG_CONFIGS[d]]
                       + [(*t, True, False) for t in hopper.PP_OVERLAP_CONFIGS[d]]
                       + [(*t, False, True) for t in hopper.PP_PERSISTENT_CONFIGS[d]])


def test_pingpong_candidates_fit_shared_memory():
    """Every ping-pong candidate's Q tiles (64 rows a consumer, O leaves through them) and one
    K/V ring shared by the consumers fit Hopper's 227 KB; a ring per consumer would not at
    D128 (FA3's choice: one ring); three consumers only at D64 (64 rows each)."""
    smem = 227 * 1024
    for d in hopper.HEAD_DIMS:
        for block_m, block_n, stages in (hopper.PINGPONG_CONFIGS[d] + hopper.PP_OVERLAP_CONFIGS[d]
                                         + hopper.PP_PERSISTENT_CONFIGS[d]):
            assert block_m in (128, 192) and (block_m == 128 or d == 64)
            q, ring = block_m * d * 2, stages * 2 * block_n * d * 2
            assert q + ring <= smem, (d, block_m, block_n, stages)
    assert 128 * 128 * 2 + 2 * (2 * 2 * 128 * 128 * 2) > smem


@pytest.mark.parametrize("value,flags", [("pingpong", [True, False, False, True, False, False]),
                                         ("pingpong_overlap", [True, False, False, True, True, False]),
                                         ("pingpong_persistent", [True, False, False, True, False, True]),
                                         ("ws", [True, True, False, False, False, False])])
def test_the_switch_is_read_at_import(value, flags):
    """FUSED_BLOCK_HOPPER_ATTN's values set (ENABLED, WS, PERSISTENT, PINGPONG, PP_OVERLAP,
    PP_PERSISTENT) at import."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("from fused_block.kernels.attention import hopper; "
            "print(hopper.ENABLED, hopper.WS, hopper.PERSISTENT, hopper.PINGPONG, hopper.PP_OVERLAP, "
            "hopper.PP_PERSISTENT)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, hopper.ENV: value})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(f) for f in flags]


class _MBarrier:
    """PTX mbarrier semantics: ``count`` arrivals complete the current phase; ``wait(parity)``
    passes once the phase of that parity completed, i.e. while the current phase's parity
    differs (two completions ahead of a waiter alias: the model blocks there, as the GPU)."""

    def __init__(self, count):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def passes(self, parity):
        return (self.completed & 1) != parity


def _pingpong_protocol(n_blocks, stages, consumers, rng, overlap=False):
    """The ping-pong kernel's mbarrier protocol, step for step as ``_pp_consumer`` (with
    ``overlap``: ``_pp_consumer_overlap``), the loader (``_ws_loader``) and the kernel's prologue
    issue their waits and arrives (TMA copies land at random later times), run under a random
    interleaving. Returns the products' issue order [(consumer, turn)]; raises on a deadlock or
    on a product reading a ring slot that does not hold its block."""
    bar = lambda count: _MBarrier(count)  # noqa: E731
    q = [bar(1) for _ in range(consumers)]
    turn = [bar(1) for _ in range(consumers)]
    k_ready, v_ready = [bar(1) for _ in range(stages)], [bar(1) for _ in range(stages)]
    k_empty, v_empty = [bar(consumers) for _ in range(stages)], [bar(consumers) for _ in range(stages)]
    k_slot, v_slot = [None] * stages, [None] * stages
    issued, copies = [], []

    def consumer(c):
        nxt = turn[(c + 1) % consumers]
        yield q[c], 0
        yield k_ready[0], 0
        yield turn[c], 0
        assert k_slot[0] == 0
        issued.append((c, 0))
        nxt.arrive()
        k_empty[0].arrive()
        for j in range(1, n_blocks):
            slot, prev = j % stages, (j - 1) % stages
            yield k_ready[slot], (j // stages) & 1
            yield v_ready[prev], ((j - 1) // stages) & 1
            yield turn[c], j & 1
            assert k_slot[slot] == j and v_slot[prev] == j - 1, (c, j, k_slot, v_slot)
            issued.append((c, j))
            nxt.arrive()
            k_empty[slot].arrive()
            v_empty[prev].arrive()
        last = (n_blocks - 1) % stages
        yield v_ready[last], ((n_blocks - 1) // stages) & 1
        yield turn[c], n_blocks & 1
        assert v_slot[last] == n_blocks - 1
        issued.append((c, n_blocks))
        nxt.arrive()
        v_empty[last].arrive()

    def consumer_overlap(c):
        # _pp_consumer_overlap: turn 0 S_0, 1 S_1, j S_j + PV_{j-2}, n PV_{n-2}, n + 1 PV_{n-1}
        # (a single block: 0 S_0, 1 PV_0). Releases follow the products' waits, with no wait
        # of a barrier between: here right after the issue.
        nxt = turn[(c + 1) % consumers]
        yield q[c], 0
        yield k_ready[0], 0
        yield turn[c], 0
        assert k_slot[0] == 0
        issued.append((c, 0))
        nxt.arrive()
        k_empty[0].arrive()
        t_last = 1
        if n_blocks > 1:
            yield k_ready[1], 0
            yield turn[c], 1
            assert k_slot[1] == 1
            issued.append((c, 1))
            nxt.arrive()
            k_empty[1].arrive()
            for j in range(2, n_blocks):
                slot, vs = j % stages, (j - 2) % stages
                yield k_ready[slot], (j // stages) & 1
                yield v_ready[vs], ((j - 2) // stages) & 1
                yield turn[c], j & 1
                assert k_slot[slot] == j and v_slot[vs] == j - 2, (c, j, k_slot, v_slot)
                issued.append((c, j))
                nxt.arrive()
                k_empty[slot].arrive()
                v_empty[vs].arrive()
            vs = (n_blocks - 2) % stages
            yield v_ready[vs], ((n_blocks - 2) // stages) & 1
            yield turn[c], n_blocks & 1
            assert v_slot[vs] == n_blocks - 2
            issued.append((c, n_blocks))
            nxt.arrive()
            v_empty[vs].arrive()
            t_last = n_blocks + 1
        last = (n_blocks - 1) % stages
        yield v_ready[last], ((n_blocks - 1) // stages) & 1
        yield turn[c], t_last & 1
        assert v_slot[last] == n_blocks - 1
        issued.append((c, t_last))
        nxt.arrive()
        v_empty[last].arrive()

    def loader():
        for i in range(consumers):
            copies.append((q[i], None, None, None))
        for j in range(n_blocks):
            slot, phase = j % stages, ((j // stages) & 1) ^ 1
            if j >= stages:
                yield k_empty[slot], phase
            copies.append((k_ready[slot], k_slot, slot, j))
            if j >= stages:
                yield v_empty[slot], phase
            copies.append((v_ready[slot], v_slot, slot, j))

    turn[0].arrive()  # the kernel's prologue: consumer 0 goes first
    procs = [(consumer_overlap if overlap else consumer)(c) for c in range(consumers)] + [loader()]
    waiting = [next(p, None) for p in procs]
    while any(w is not None for w in waiting) or copies:
        runnable = [i for i, w in enumerate(waiting) if w is not None and w[0].passes(w[1])]
        choice = rng.randrange(len(runnable) + len(copies)) if runnable or copies else None
        if choice is None:
            raise AssertionError(f"deadlock after {issued}")
        if choice >= len(runnable):
            done, ring, slot, block = copies.pop(choice - len(runnable))
            if ring is not None:
                ring[slot] = block
            done.arrive()
            continue
        i = runnable[choice]
        waiting[i] = next(procs[i], None)
    return issued


@pytest.mark.parametrize("overlap", [False, True], ids=["pp", "overlap"])
@pytest.mark.parametrize("consumers", [2, 3])
def test_pingpong_barrier_protocol_never_deadlocks(consumers, overlap):
    """The ping-pong kernel's barriers, modelled on the CPU (the interpreter cannot run Gluon):
    for 1 to 9 key blocks and rings of 2 to 4 slots, under many random interleavings of the
    partitions and the TMA copies' completions, every partition finishes, each product reads
    the block it should from the ring, and the consumers issue their products strictly in
    turn (0, 1, [2,] 0, 1, ...): n + 1 turns each, with ``overlap`` (the consumers one score
    block deeper, V released two steps after its fill) n + 2 (2 for one block)."""
    import random

    rng = random.Random(0)
    for n_blocks in range(1, 10):
        turns = (n_blocks + 2 if n_blocks > 1 else 2) if overlap else n_blocks + 1
        for stages in (2, 3, 4):
            for _ in range(30):
                issued = _pingpong_protocol(n_blocks, stages, consumers, rng, overlap)
                assert issued == [(c, t) for t in range(turns) for c in range(consumers)]


def _pp_persistent_protocol(tiles, stages, consumers, rng):
    """The persistent ping-pong kernel's mbarrier protocol (``_ppp_consumer``, ``_ppp_loader``,
    the kernel's prologue), step for step, for one program whose tiles have ``tiles`` key blocks
    each, under a random interleaving (TMA copies landing at random later times). The ring
    position, the turn count and Q's phase carry from tile to tile; the loader fills a tile's
    first ``stages`` blocks, then each consumer's Q once its buffer is released (``q_empty``),
    then the rest. Returns the products' issue order [(consumer, tile, turn)]; raises on a
    deadlock, on a product reading a slot (or a Q buffer) that does not hold its block (its
    tile's rows), or on a Q buffer refilled before its O left it."""
    bar = lambda count: _MBarrier(count)  # noqa: E731
    q, q_empty, turn = ([bar(1) for _ in range(consumers)] for _ in range(3))
    k_ready, v_ready = [bar(1) for _ in range(stages)], [bar(1) for _ in range(stages)]
    k_empty, v_empty = [bar(consumers) for _ in range(stages)], [bar(consumers) for _ in range(stages)]
    k_slot, v_slot, q_slot = [None] * stages, [None] * stages, [None] * consumers
    stored = [[] for _ in range(consumers)]  # the tiles whose O each consumer stored
    issued, copies = [], []

    def consumer(c):
        nxt = turn[(c + 1) % consumers]
        it = t = 0
        for done, n in enumerate(tiles):
            yield q[c], done & 1
            yield k_ready[it % stages], (it // stages) & 1
            yield turn[c], t & 1
            assert q_slot[c] == done and k_slot[it % stages] == (done, 0), (c, done, q_slot, k_slot)
            issued.append((c, done, 0))
            nxt.arrive()
            k_empty[it % stages].arrive()
            for j in range(1, n):
                slot, prev = (it + j) % stages, (it + j - 1) % stages
                yield k_ready[slot], ((it + j) // stages) & 1
                yield v_ready[prev], ((it + j - 1) // stages) & 1
                yield turn[c], (t + j) & 1
                assert q_slot[c] == done and k_slot[slot] == (done, j) and v_slot[prev] == (done, j - 1)
                issued.append((c, done, j))
                nxt.arrive()
                k_empty[slot].arrive()
                v_empty[prev].arrive()
            last = (it + n - 1) % stages
            yield v_ready[last], ((it + n - 1) // stages) & 1
            yield turn[c], (t + n) & 1
            assert v_slot[last] == (done, n - 1)
            issued.append((c, done, n))
            nxt.arrive()
            v_empty[last].arrive()
            assert q_slot[c] == done  # O leaves through Q's buffer (the TMA store waited for)
            stored[c].append(done)
            q_empty[c].arrive()
            it, t = it + n, t + n + 1

    def loader():
        it = 0
        for done, n in enumerate(tiles):
            def kv(j0, j1):
                for j in range(j0, j1):
                    pos = it + j
                    slot, phase = pos % stages, ((pos // stages) & 1) ^ 1
                    if pos >= stages:
                        yield k_empty[slot], phase
                    copies.append((k_ready[slot], k_slot, slot, (done, j)))
                    if pos >= stages:
                        yield v_empty[slot], phase
                    copies.append((v_ready[slot], v_slot, slot, (done, j)))
            yield from kv(0, min(n, stages))
            for i in range(consumers):
                if done > 0:
                    yield q_empty[i], (done - 1) & 1
                    assert stored[i] == list(range(done))  # the buffer's O has left
                copies.append((q[i], q_slot, i, done))
            yield from kv(min(n, stages), n)
            it += n

    turn[0].arrive()  # the kernel's prologue: consumer 0 goes first
    procs = [consumer(c) for c in range(consumers)] + [loader()]
    waiting = [next(p, None) for p in procs]
    while any(w is not None for w in waiting) or copies:
        runnable = [i for i, w in enumerate(waiting) if w is not None and w[0].passes(w[1])]
        if not runnable and not copies:
            raise AssertionError(f"deadlock after {issued}")
        choice = rng.randrange(len(runnable) + len(copies))
        if choice >= len(runnable):
            done, ring, slot, block = copies.pop(choice - len(runnable))
            ring[slot] = block
            done.arrive()
            continue
        i = runnable[choice]
        waiting[i] = next(procs[i], None)
    assert stored == [list(range(len(tiles)))] * consumers
    return issued


@pytest.mark.parametrize("consumers", [2, 3])
def test_persistent_pingpong_protocol_carries_across_tiles(consumers):
    """The persistent ping-pong kernel's barriers, modelled on the CPU: programs of 1 to 5 tiles
    of 1 to 7 key blocks each (random, as a causal LPT walk gives), rings of 2 to 4 slots, many
    random interleavings: no deadlock across tile boundaries, each product reads its own
    tile's block and Q, a Q buffer is refilled only after its O left, and the consumers issue
    strictly in turn, tile after tile (n_blocks + 1 turns each)."""
    import random

    rng = random.Random(1)
    for _ in range(150):
        tiles = [rng.randint(1, 7) for _ in range(rng.randint(1, 5))]
        for stages in (2, 3, 4):
            issued = _pp_persistent_protocol(tiles, stages, consumers, rng)
            assert issued == [(c, k, t) for k, n in enumerate(tiles) for t in range(n + 1) for c in range(consumers)]


def test_persistent_pingpong_protocol_is_not_vacuous():
    """The model's checks bite: with barriers that never block (every wait passes at once),
    the copies race the reads and the turns, and the model fails."""
    import random

    rng = random.Random(2)
    orig = _MBarrier.passes
    # Every wait passes: the copies then race the reads.
    _MBarrier.passes = lambda self, parity: True
    try:
        with pytest.raises(AssertionError):
            for _ in range(50):
                _pp_persistent_protocol([3, 1, 4], 2, 2, rng)
    finally:
        _MBarrier.passes = orig


def test_persistent_sections_keep_their_kv_in_l2():
    """FA3's L2 sections: the largest power of two of KV heads whose K and V fit 32 MB (at
    least one), times the query heads per KV head."""
    mb = 1 << 20
    # D128 bf16 at 4096 keys: 2 MB of K and V a head, 16 heads; GQA 4:1 sections 64 query heads.
    assert hopper._section(4096, 128, 2, 1) == 16 and hopper._section(4096, 128, 2, 4) == 64
    # 3 MB a head: 10 fit, a power of two: 8. Over 32 MB a head: one (its group).
    assert hopper._section(3 * mb // 512, 128, 2, 1) == 8
    assert hopper._section(65536, 256, 2, 2) == 2
    assert hopper.L2_KV_BYTES == 32 * mb


def test_supports_names_every_feature():
    q = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16)
    base = dict(arch=90, dropout_p=0.0, key_padding_mask=None, window=(-1, -1), varlen=None, softcap=0.0, sinks=None,
                alibi=None, bias=None, mask=None, aligned=True)
    assert hopper.supports(q, **base)
    changes = dict(arch=80, dropout_p=0.5, key_padding_mask=q, window=(4, -1), varlen=(q, q, 1, 1), softcap=5.0,
                   sinks=q, alibi=q, bias=q, mask=q, aligned=False)
    for name, value in changes.items():
        assert not hopper.supports(q, **{**base, name: value}), name


def test_interpreter_keeps_the_triton_forward(device, launches, monkeypatch):
    """With the switch on, the interpreter (and any non-sm_90 device) runs the Triton forward:
    same results as the reference, no Gluon launch."""
    if SM90:
        pytest.skip("sm_90 takes the Gluon forward: tested below")
    monkeypatch.setattr(hopper, "ENABLED", True)
    q, k, v = _qkv(1, 2, 2, 33, 50, 64, torch.bfloat16, device)
    out, lse = attention(q, k, v, True, return_lse=True)
    _check(q, k, v, True, out, lse)
    assert launches["attention_fwd"] == 1 and launches["attention_fwd_hopper"] == 0


# ---------------------------------------------------------------------------------------------
# numerics (sm_90 only)
# ---------------------------------------------------------------------------------------------

def _check(q, k, v, causal, out, lse, grads=None):
    """``out``/``lse`` (and ``grads``, the kernels' dq, dk, dv for ``dout``) against the float64
    reference, PyTorch's error in q's dtype the baseline."""
    dtype = q.dtype
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref64, lse64 = reference.attention(*leaves64, causal, return_lse=True)
    leaves_lp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with baseline_mode(dtype, "ieee"):
        base, base_lse = reference.attention(*leaves_lp, causal, compute_dtype=dtype, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, ref64, base)
    assert_close("lse", lse, lse64, base_lse, atol=ATOL[dtype])
    if grads is not None:
        got, dout = grads
        want64 = torch.autograd.grad(ref64, leaves64, dout.double())
        with baseline_mode(dtype, "ieee"):
            want_lp = torch.autograd.grad(base, leaves_lp, dout)
        for name, g, g64, gb in zip(("dq", "dk", "dv"), got, want64, want_lp):
            assert_close(name, g, g64, gb)


# (B, Hq, Hkv, Lq, Lk), each with its reason: BLOCK_M is 128, BLOCK_N 128 or 64 (the candidates).
GPU_CASES = [
    # Whole blocks; causal diagonal blocks and blocks skipped above them.
    pytest.param(2, 4, 4, 256, 256, id="256"),
    # 1000: partial last query and key blocks (rows past L zero-read, clipped on store); GQA 4:1.
    pytest.param(1, 8, 2, 1000, 1000, id="1000-gqa"),
    # Lq < Lk: bottom-right causal offset 577, not a block multiple; the K/V ring wraps many times.
    pytest.param(1, 2, 1, 300, 877, id="cross-300x877-mqa"),
    # Lq > Lk: under causal the first 330 queries see no key (output 0, LSE -inf).
    pytest.param(1, 2, 2, 400, 70, id="cross-400x70"),
]

gpu = pytest.mark.skipif(not SM90, reason="the Gluon forward runs on sm_90 only")
# The kernels. The warp-specialized one's cases are heavy (deselected unless FUSED_BLOCK_HEAVY=1
# or -m heavy) and have "wspec" in their ids: a deadlock there (it has never run) must not hang
# the GPU check's run of the suite; run them apart (``FUSED_BLOCK_HEAVY=1 ... -k wspec``). So
# are the persistent form's ("persist" in their names or ids: its rings' phases continue from
# tile to tile, a new way to wait forever) and the ping-pong kernel's ("pingpong": its
# consumers wait for each other's turns).
VARIANTS = [pytest.param("wg2", id="wg2"), pytest.param("ws", id="wspec", marks=pytest.mark.heavy),
            pytest.param("pingpong", id="pingpong", marks=pytest.mark.heavy),
            pytest.param("pingpong_overlap", id="pingpong-overlap", marks=pytest.mark.heavy),
            pytest.param("pingpong_persistent", id="pingpong-persist", marks=pytest.mark.heavy)]


def _switch(monkeypatch, variant):
    """The switch on for ``variant`` ("wg2": FUSED_BLOCK_HOPPER_ATTN=1, "ws", "pingpong",
    "pingpong_overlap", "pingpong_persistent")."""
    monkeypatch.setattr(hopper, "ENABLED", True)
    monkeypatch.setattr(hopper, "WS", variant == "ws")
    monkeypatch.setattr(hopper, "PINGPONG", variant.startswith("pingpong"))
    monkeypatch.setattr(hopper, "PP_OVERLAP", variant == "pingpong_overlap")
    monkeypatch.setattr(hopper, "PP_PERSISTENT", variant == "pingpong_persistent")
    monkeypatch.setattr(hopper, "PERSISTENT", False)


@gpu
@pytest.mark.parametrize("D", hopper.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", hopper.DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk", GPU_CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gluon_forward_matches_reference(variant, B, Hq, Hkv, Lq, Lk, D, causal, dtype, launches, monkeypatch):
    _switch(monkeypatch, variant)
    # Gradients (the Triton backward from the Gluon output and LSE) in bf16: the backward's
    # own dtypes are its tests'; here they check what the backward reads of the forward.
    grad = dtype == torch.bfloat16
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, "cuda", grad=grad)
    out, lse = attention(q, k, v, causal, return_lse=True)
    assert launches["attention_fwd_hopper"] == 1 and launches["attention_fwd"] == 0
    grads = None
    if grad:
        dout = randn(*out.shape, dtype=dtype, device="cuda")
        grads = (torch.autograd.grad(out, (q, k, v), dout), dout)
    _check(q, k, v, causal, out, lse, grads)


@gpu
@pytest.mark.parametrize("D", [96, 192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gluon_forward_zero_padded_head_dims(variant, causal, D, launches, monkeypatch):
    """D96 and D192 through the 128 and 256 kernels (descriptor blocks wider than the tensors:
    zeros read past D, the store clipped there): 1000 x 1000 (ragged blocks), GQA 2:1; the
    output buffer's columns past D must stay as they were (a view of a wider buffer)."""
    _switch(monkeypatch, variant)
    q, k, v = _qkv(1, 4, 2, 1000, 1000, D, torch.bfloat16, "cuda")
    out, lse = attention(q, k, v, causal, return_lse=True)
    assert launches["attention_fwd_hopper"] == 1 and launches["attention_fwd"] == 0
    _check(q, k, v, causal, out, lse)
    # Into a view whose rows continue past D (16 columns of a sentinel): the store stops at D.
    wide = torch.full((1, 4, 1000, D + 16), 7.0, dtype=torch.bfloat16, device="cuda")
    launchers.forward(q, k, v, wide[..., :D], lse, None, torch.zeros(1, dtype=torch.int64, device="cuda"), causal,
                      D ** -0.5, 0.0)
    assert launches["attention_fwd_hopper"] == 2
    assert torch.equal(wide[..., :D], out) and bool((wide[..., D:] == 7.0).all())


@gpu
@pytest.mark.parametrize("D", hopper.HEAD_DIMS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gluon_forward_on_strided_views(variant, D, launches, monkeypatch):
    """Views of one (B, L, 3 H, D) projection (SDPA's transposed layout): the descriptors take
    the strides, no copy; the output written into a (B, L, H, D) buffer's view."""
    _switch(monkeypatch, variant)
    B, L, H = 2, 333, 4
    qkv = randn(B, L, 3 * H, D, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.transpose(1, 2) for t in qkv.split(H, dim=2))
    out, lse = attention(q, k, v, True, return_lse=True)
    assert launches["attention_fwd_hopper"] == 1
    _check(q, k, v, True, out, lse)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ws,D,cand", [
    pytest.param(ws, d, i, id=f"{'wspec' if ws else 'persist' if c['PERSISTENT'] else 'wg2'}-D{d}-{i}",
                 marks=[pytest.mark.heavy] if ws or c["PERSISTENT"] else [])
    for ws in (False, True) for d in hopper.HEAD_DIMS for i, c in enumerate(hopper._CANDIDATES[d, ws])])
def test_every_gluon_candidate_matches_reference(ws, D, cand, causal, launches, monkeypatch):
    """Each tile/ring-depth candidate the launcher may time and keep, the persistent form
    included (1000 x 1000: ragged blocks, the ring wrapping many times; GQA 2:1)."""
    monkeypatch.setattr(hopper, "ENABLED", True)
    monkeypatch.setattr(hopper, "WS", ws)
    monkeypatch.setattr(hopper, "_CANDIDATES", {(D, ws): [hopper._CANDIDATES[D, ws][cand]]})
    monkeypatch.setattr(hopper, "_CACHE", common.ConfigCache("attention_fwd_hopper"))
    q, k, v = _qkv(1, 4, 2, 1000, 1000, D, torch.bfloat16, "cuda")
    out, lse = attention(q, k, v, causal, return_lse=True)
    assert launches["attention_fwd_hopper"] == 1
    _check(q, k, v, causal, out, lse)


@gpu
@pytest.mark.heavy
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,cand", [
    pytest.param(d, i, id=f"pingpong{'-overlap' if c['OVERLAP'] else '-persist' if c['PERSISTENT'] else ''}"
                          f"-D{d}-{c['BLOCK_M']}x{c['BLOCK_N']}/{c['STAGES']}")
    for d in hopper.HEAD_DIMS for i, c in enumerate(hopper._PP_CANDIDATES[d])])
def test_every_pingpong_candidate_matches_reference(D, cand, causal, launches, monkeypatch):
    """Each ping-pong candidate alone (two consumers, or three at 192 rows; the consumers one
    score block deeper: "overlap" in the ids; the persistent form: "persist", a program per
    tile here, as the SMs outnumber the tiles) on every shape of ``GPU_CASES``: whole and ragged
    blocks, GQA and MQA, causal offsets both ways (rows that see no key: O = 0, LSE -inf), one
    key block (cross-400x70, causal: the overlap consumers' two-turn path), rings and turns
    wrapping many times; fresh inputs a shape."""
    _switch(monkeypatch, "pingpong")
    monkeypatch.setattr(hopper, "_PP_CANDIDATES", {D: [hopper._PP_CANDIDATES[D][cand]]})
    monkeypatch.setattr(hopper, "_CACHE", common.ConfigCache("attention_fwd_hopper"))
    for n, case in enumerate(GPU_CASES, 1):
        q, k, v = _qkv(*case.values, D, torch.bfloat16, "cuda")
        out, lse = attention(q, k, v, causal, return_lse=True)
        assert launches["attention_fwd_hopper"] == n and launches["attention_fwd"] == 0
        _check(q, k, v, causal, out, lse)


@gpu
@pytest.mark.heavy
@pytest.mark.parametrize("D", hopper.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_forward_walks_many_tiles(D, causal, launches, monkeypatch):
    """The persistent form with 3 programs (SM count faked) over 40 tiles (8 query blocks x 5
    heads): each program takes 13-14 tiles, its K/V rings' slots and phases continuing from
    tile to tile; L2 sections of 2 heads (the budget faked), the last one narrower (5 heads).
    Every tile must be written: the output starts poisoned."""
    monkeypatch.setattr(hopper, "ENABLED", True)
    monkeypatch.setattr(hopper, "WS", False)
    monkeypatch.setattr(hopper, "PERSISTENT", True)
    monkeypatch.setattr(common, "sm_count", lambda device: 3)
    Lq, Lk = 1000, 900  # Lq > Lk: under causal the first 100 queries see no key
    monkeypatch.setattr(hopper, "L2_KV_BYTES", 2 * Lk * 2 * D * 2)
    assert hopper._section(Lk, D, 2, 1) == 2
    q, k, v = _qkv(1, 5, 5, Lq, Lk, D, torch.bfloat16, "cuda")
    out, lse = attention(q, k, v, causal, return_lse=True)
    assert launches["attention_fwd_hopper"] == 1
    _check(q, k, v, causal, out, lse)


@gpu
@pytest.mark.heavy
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,cand", [pytest.param(d, i, id=f"pingpong-persist-D{d}-{m}x{n}/{st}")
                                    for d in hopper.HEAD_DIMS
                                    for i, (m, n, st) in enumerate(hopper.PP_PERSISTENT_CONFIGS[d])])
def test_persistent_pingpong_walks_many_tiles(D, cand, causal, launches, monkeypatch):
    """The ping-pong kernel's persistent form with 3 programs (SM count faked) over 8 x 5 = 40
    tiles at 128 rows (6 x 5 = 30 at 192): 10-14 tiles a program, the ring's positions, the
    turns and Q's phases continuing from tile to tile, Q's buffers handed back after each
    O; L2 sections of 2 heads (the budget faked), the last one narrower. Lq > Lk: under
    causal the first 100 queries see no key (single-block tiles). Every tile must be written:
    the output starts poisoned."""
    _switch(monkeypatch, "pingpong_persistent")
    monkeypatch.setattr(hopper, "_PP_CANDIDATES", {
        D: [c for c in hopper._PP_CANDIDATES[D] if c["PERSISTENT"]][cand:cand + 1]})
    monkeypatch.setattr(hopper, "_CACHE", common.ConfigCache("attention_fwd_hopper"))
    monkeypatch.setattr(common, "sm_count", lambda device: 3)
    Lq, Lk = 1000, 900
    monkeypatch.setattr(hopper, "L2_KV_BYTES", 2 * Lk * 2 * D * 2)
    q, k, v = _qkv(1, 5, 5, Lq, Lk, D, torch.bfloat16, "cuda")
    out, lse = attention(q, k, v, causal, return_lse=True)
    assert launches["attention_fwd_hopper"] == 1
    _check(q, k, v, causal, out, lse)


# ---------------------------------------------------------------------------------------------
# the launch path (CPU, through the fake CUDA driver): what runs is what the compile check built
# ---------------------------------------------------------------------------------------------

_LAUNCH_SCRIPT = """
import json, sys, torch
import fused_block
from fused_block import _backend
from fused_block.kernels import common, fake_driver
from fused_block.kernels.attention import hopper

common.TUNE = False  # the first candidate of each (nothing to time on)
out = []
with fake_driver.installed(90, record=True, check=True) as fake, fake_driver.launcher_branches(90), \\
        _backend.host_only(stub=False):
    hopper.ENABLED = True
    for ws, persistent in ((False, False), (True, False), (False, True)):
        hopper.WS, hopper.PERSISTENT = ws, persistent
        for D in sorted(hopper.PADDED):
            for causal in (False, True):
                fake.launches.clear()
                # GQA 4:2, Lq 300 (3 query blocks), cross lengths; a strided q (a packed projection).
                qkv = torch.randn(1, 300, 3 * 4, D, dtype=torch.bfloat16)
                q = qkv[:, :, :4].transpose(1, 2)
                k = torch.randn(1, 2, 333, D, dtype=torch.bfloat16)
                v = torch.randn(1, 2, 333, D, dtype=torch.bfloat16)
                fused_block.attention(q, k, v, causal=causal)
                (rec,) = fake.launches
                src = rec.compiled.src
                out.append(dict(ws=ws, persistent=persistent, D=D, causal=causal, name=rec.compiled.name,
                                grid=list(rec.grid), ints=list(rec.args[5:9]) + list(rec.args[10:12] if persistent else []),
                                signature=src.signature,
                                constants={src.fn.arg_names[i[0]]: getattr(v, "value", v)
                                           for i, v in src.constants.items()},
                                num_warps=rec.compiled.options["num_warps"]))
json.dump(out, sys.stdout)
"""


def test_gluon_launches_match_the_compiled_specs():
    """The Gluon forwards launched through Triton's own launch path on CPU tensors (the fake
    driver checks every argument against the specialization): one launch each, the grid of
    3 query blocks x 4 heads (the persistent form: min(12, 132 SMs)), and exactly the
    signature and constexprs the compile check builds (``aot_spec_args``: 16-byte aligned
    descriptors, unspecialized shape arguments); the persistent form gets B x Hq and its
    L2 section."""
    import json
    import pathlib

    from fused_block.kernels import fake_driver

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = fake_driver.run_without_interpreter(["-c", _LAUNCH_SCRIPT], cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launches = json.loads(proc.stdout)
    assert len(launches) == 3 * len(hopper.PADDED) * 2
    for rec in launches:
        ws, persistent, D, causal = rec["ws"], rec["persistent"], rec["D"], rec["causal"]
        head_d = hopper.PADDED[D]  # D96 and D192: the 128 and 256 kernels' specs
        table = hopper.WS_CONFIGS if ws else hopper.PERSISTENT_CONFIGS if persistent else hopper.CONFIGS
        block_n, stages = table[head_d][0]
        sig, constexprs = hopper.aot_spec_args("bf16", head_d, causal, block_n, stages, ws, persistent)
        assert rec["name"] == "_attn_fwd_hopper" + ("_ws" if ws else "_persistent" if persistent else "")
        assert rec["grid"] == [3 * 4, 1, 1]
        # Hq, GROUP, Lq, Lk; the persistent form's B x Hq and L2 section (heads)
        assert rec["ints"] == [4, 2, 300, 333] + ([4, hopper._section(333, head_d, 2, 2)] if persistent else [])
        assert rec["signature"] == sig
        assert {k: v for k, v in rec["constants"].items() if k in constexprs} == constexprs
        assert rec["num_warps"] == constexprs["num_warps"]


_PP_LAUNCH_SCRIPT = """
import json, sys, torch
import fused_block
from fused_block import _backend
from fused_block.kernels import common, fake_driver
from fused_block.kernels.attention import hopper

common.TUNE = False
cands = hopper._PP_CANDIDATES
out = []
with fake_driver.installed(90, record=True, check=True) as fake, fake_driver.launcher_branches(90), \\
        _backend.host_only(stub=False):
    hopper.ENABLED, hopper.WS, hopper.PERSISTENT, hopper.PINGPONG = True, False, False, True
    for D in sorted(hopper.PADDED):
        for i, cfg in enumerate(cands[hopper.PADDED[D]]):
            hopper._PP_CANDIDATES = {hopper.PADDED[D]: [cfg]}
            hopper._CACHE = common.ConfigCache("attention_fwd_hopper")
            for causal in (False, True):
                fake.launches.clear()
                qkv = torch.randn(1, 300, 3 * 4, D, dtype=torch.bfloat16)
                q = qkv[:, :, :4].transpose(1, 2)
                k = torch.randn(1, 2, 333, D, dtype=torch.bfloat16)
                v = torch.randn(1, 2, 333, D, dtype=torch.bfloat16)
                fused_block.attention(q, k, v, causal=causal)
                (rec,) = fake.launches
                src = rec.compiled.src
                out.append(dict(D=D, cand=i, causal=causal, name=rec.compiled.name, grid=list(rec.grid),
                                ints=list(rec.args[5:9]) + list(rec.args[10:12] if cfg["PERSISTENT"] else []),
                                signature=src.signature,
                                constants={src.fn.arg_names[i[0]]: getattr(v, "value", v)
                                           for i, v in src.constants.items()},
                                num_warps=rec.compiled.options["num_warps"]))
json.dump(out, sys.stdout)
"""


def test_pingpong_launches_match_the_compiled_specs():
    """Every ping-pong candidate (the OVERLAP and persistent ones too) launched through Triton's
    launch path on CPU tensors (the fake driver checks the arguments): one launch of
    ``_attn_fwd_hopper_pp`` (``_persistent``) a call, a program per 128 or 192 query rows (300
    rows: 3 or 2 blocks) and head (fewer than the SMs), 64-row Q and O descriptors, and exactly
    the signature and constexprs the compile check builds."""
    import json
    import pathlib

    from fused_block.kernels import fake_driver

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = fake_driver.run_without_interpreter(["-c", _PP_LAUNCH_SCRIPT], cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launches = json.loads(proc.stdout)
    assert len(launches) == 2 * sum(len(hopper._PP_CANDIDATES[hopper.PADDED[D]]) for D in hopper.PADDED)
    for rec in launches:
        head_d = hopper.PADDED[rec["D"]]
        cfg = hopper._PP_CANDIDATES[head_d][rec["cand"]]
        block_m, block_n, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"]
        persistent = cfg["PERSISTENT"]
        sig, constexprs = hopper.aot_spec_args("bf16", head_d, rec["causal"], block_n, stages, ws=True,
                                               persistent=persistent, block_m=block_m,
                                               overlap=None if persistent else cfg["OVERLAP"])
        assert constexprs.get("OVERLAP") == (None if persistent else cfg["OVERLAP"])
        assert rec["name"] == "_attn_fwd_hopper_pp" + ("_persistent" if persistent else "")
        # The persistent form: min(tiles, 132 SMs) programs, B x Hq and its L2 section (heads).
        assert rec["grid"] == [common.cdiv(300, block_m) * 4, 1, 1]
        assert rec["ints"] == [4, 2, 300, 333] + ([4, hopper._section(333, head_d, 2, 2)] if persistent else [])
        assert rec["signature"] == sig and "[1, 1, 64, " in sig["QD"] and "[1, 1, 64, " in sig["OD"]
        assert {k: v for k, v in rec["constants"].items() if k in constexprs} == constexprs
        assert rec["num_warps"] == constexprs["num_warps"] == 4
