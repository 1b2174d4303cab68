"""The opt-in Gluon Hopper backward (``kernels/attention/hopper_bwd.py``, ``FUSED_BLOCK_HOPPER_ATTN_BWD=1``).

On the CPU (the interpreter cannot run Gluon): which backward calls the launcher hands to it
(only with the switch, never in deterministic mode, only on sm_90, only the cases it supports,
before the atomic-dQ backward when both switches are set; everything else runs the atomic-free
backward; the persistent form last among the candidates or alone under its switch), that the
interpreter keeps its own backward with the switch on, the kernels' schedule and arithmetic in a
float64 twin (the persistent walk's tiles, order and ring phases included), and (through the
fake CUDA driver) that what the launcher launches is exactly what the compile check builds.
On an sm_90 GPU: dq, dk, dv (and the LSE's gradient) against the float64 reference with
PyTorch's own error as the baseline (``numerics.assert_close``'s 2x rule); those tests are
skipped (never passed) elsewhere.
"""
import pytest
import torch

from attention_testing import check, unsupported_features
from attention_testing import qkv as _qkv
from fused_block import reference
from fused_block.attention import attention
from fused_block.kernels import common
from fused_block.kernels.attention import backward_atomic, hopper_bwd, launchers
from numerics import randn

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# ---------------------------------------------------------------------------------------------
# dispatch (CPU, launches stubbed: the counts say which backward each call takes)
# ---------------------------------------------------------------------------------------------

_L = 40


def _bwd_call(q, k, v, causal=True, **features):
    """``launchers.backward`` on q, k, v with ``features`` (its keyword arguments, and
    ``dropout_p`` / ``key_padding_mask``)."""
    B, Hq, Lq, D = q.shape
    do, out = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(B, Hq, Lq, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    seed = torch.zeros(1, dtype=torch.int64)
    dropout_p, pad = features.pop("dropout_p", 0.0), features.pop("key_padding_mask", None)
    launchers.backward(do, q, k, v, out, lse, None, dq, dk, dv, pad, seed, causal, D ** -0.5, dropout_p, **features)


def _route(monkeypatch, enabled=True, arch=90, atomic=False):
    monkeypatch.setattr(hopper_bwd, "ENABLED", enabled)
    monkeypatch.setattr(backward_atomic, "ENABLED", atomic)
    monkeypatch.setattr(common, "STUB_LAUNCHES", True)
    monkeypatch.setattr(common, "TUNE", False)
    monkeypatch.setattr(common, "arch", lambda device: arch)


def _taken(launches):
    kinds = {"gluon": launches["attention_bwd_hopper"], "atomic": launches["attention_bwd_dq_atomic"],
             "atomic-free": launches["attention_bwd"]}
    assert sum(kinds.values()) == 1, kinds
    (name,) = [k for k, n in kinds.items() if n]
    if name == "gluon":
        assert launches["attention_dq_convert"] == 1
    return name


@pytest.mark.parametrize("D", sorted(hopper_bwd.PADDED))
@pytest.mark.parametrize("dtype", hopper_bwd.DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_supported_calls_take_the_gluon_backward(D, dtype, causal, launches, monkeypatch):
    _route(monkeypatch)
    _bwd_call(*_qkv(1, 4, 2, _L, _L + 7, D, dtype, "cpu", grad=False), causal)  # GQA 2:1, cross lengths
    assert _taken(launches) == "gluon"


@pytest.mark.parametrize("ws", [False, True], ids=["wg2", "wspec"])
@pytest.mark.parametrize("D", hopper_bwd.HEAD_DIMS)
def test_the_ws_switch_takes_the_warp_specialized_kernel_at_d64(D, ws, monkeypatch):
    """``FUSED_BLOCK_HOPPER_ATTN_BWD=ws``: the warp-specialized kernel where it has configs (D64),
    the single-partition one elsewhere (D128)."""
    _route(monkeypatch)
    monkeypatch.setattr(hopper_bwd, "WS", ws)
    monkeypatch.setattr(hopper_bwd, "_CACHE", common.ConfigCache("attention_bwd_hopper"))
    chosen = []
    monkeypatch.setattr(hopper_bwd, "_launch", lambda cfg, launch: chosen.append(cfg))
    _bwd_call(*_qkv(1, 2, 2, _L, _L, D, torch.bfloat16, "cpu", grad=False))
    (cfg,) = chosen
    assert cfg["WS"] == (ws and D == 64)
    assert cfg in (hopper_bwd._WS_CANDIDATES if cfg["WS"] else hopper_bwd._CANDIDATES)[D]


def test_the_persistent_form_is_the_last_candidate():
    """The single-partition kernel's candidates end with its persistent form where it has one
    (D64; taken only where the GPU timed it faster: FUSED_BLOCK_TUNE=0 takes the first); the
    warp-specialized kernel's have none."""
    for d in hopper_bwd.HEAD_DIMS:
        flags = [c["PERSISTENT"] for c in hopper_bwd._CANDIDATES[d]]
        assert flags == [False] * len(hopper_bwd.CONFIGS[d]) + [True] * len(hopper_bwd.PERSISTENT_CONFIGS.get(d, ()))
    assert hopper_bwd.PERSISTENT_CONFIGS.keys() == {64}
    assert not any(c["PERSISTENT"] for cs in hopper_bwd._WS_CANDIDATES.values() for c in cs)


@pytest.mark.parametrize("D", hopper_bwd.HEAD_DIMS)
@pytest.mark.parametrize("switch", ["1", "persistent"])
def test_the_persistent_switch_takes_the_persistent_form_at_d64(switch, D, monkeypatch):
    """FUSED_BLOCK_HOPPER_ATTN_BWD=persistent runs the persistent form only where it has configs
    (D64; D128 the one-program-a-tile kernel); =1 times every candidate (here, untimed, the first)."""
    _route(monkeypatch)
    monkeypatch.setattr(hopper_bwd, "PERSISTENT", switch == "persistent")
    monkeypatch.setattr(hopper_bwd, "WS", False)
    monkeypatch.setattr(hopper_bwd, "_CACHE", common.ConfigCache("attention_bwd_hopper"))
    chosen = []
    monkeypatch.setattr(hopper_bwd, "_launch", lambda cfg, launch: chosen.append(cfg))
    _bwd_call(*_qkv(1, 2, 2, _L, _L, D, torch.bfloat16, "cpu", grad=False))
    persistent = switch == "persistent" and D == 64
    want = (hopper_bwd.PERSISTENT_CONFIGS if persistent else hopper_bwd.CONFIGS)[D][0]
    assert [(c["BLOCK_M"], c["STAGES"], c["PERSISTENT"], c["WS"]) for c in chosen] == [(*want, persistent, False)]


def test_persistent_sections_keep_their_q_and_do_in_l2():
    """The persistent form's L2 sections: the largest power of two of kv heads whose query
    heads' Q and dO fit 32 MB (at least one)."""
    mb = 1 << 20
    # D64 bf16 at 2048 queries: 512 KB of Q and dO a head: 64 kv heads; GQA 4:1: 16.
    assert hopper_bwd.section(2048, 64, 2, 1) == 64 and hopper_bwd.section(2048, 64, 2, 4) == 16
    # 3 MB a kv head: 10 fit, a power of two: 8. Over 32 MB a kv head: one.
    assert hopper_bwd.section(3 * mb // 256, 64, 2, 1) == 8
    assert hopper_bwd.section(65536, 64, 2, 8) == 1
    assert hopper_bwd.L2_QDO_BYTES == 32 * mb


def test_the_gluon_backward_comes_before_the_atomic_one(launches, monkeypatch):
    """Both opt-in switches set: the Gluon backward takes what it supports."""
    _route(monkeypatch, atomic=True)
    _bwd_call(*_qkv(1, 2, 2, _L, _L, 64, torch.bfloat16, "cpu", grad=False))
    assert _taken(launches) == "gluon"


@pytest.mark.parametrize("arch,enabled", [(90, False), (80, True), (0, True)], ids=["off", "sm80", "interpreter"])
def test_the_switch_and_sm90_are_required(arch, enabled, launches, monkeypatch):
    _route(monkeypatch, enabled=enabled, arch=arch)
    _bwd_call(*_qkv(1, 2, 2, _L, _L, 64, torch.bfloat16, "cpu", grad=False))
    assert _taken(launches) == "atomic-free"


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_deterministic_mode_takes_the_atomic_free_backward(deterministic, launches, monkeypatch):
    """The reduce-adds' order varies from run to run: never taken in deterministic mode."""
    _route(monkeypatch)
    _bwd_call(*_qkv(1, 2, 2, _L, _L, 64, torch.bfloat16, "cpu", grad=False))
    assert _taken(launches) == "atomic-free"


def _unsupported():
    """(name, tensors, features) of calls the Gluon backward does not take."""
    bf = torch.bfloat16
    return [
        ("d80", _qkv(1, 2, 2, _L, _L, 80, bf, "cpu", grad=False), {}),
        ("d160", _qkv(1, 2, 2, _L, _L, 160, bf, "cpu", grad=False), {}),
        ("d48", _qkv(1, 2, 2, _L, _L, 48, bf, "cpu", grad=False), {}),
        ("fp32", _qkv(1, 2, 2, _L, _L, 64, torch.float32, "cpu", grad=False), {}),
    ] + unsupported_features(_L)


@pytest.mark.parametrize("name,tensors,features", _unsupported(), ids=[c[0] for c in _unsupported()])
def test_unsupported_calls_take_the_atomic_free_backward(name, tensors, features, launches, monkeypatch):
    _route(monkeypatch)
    _bwd_call(*tensors, **features)
    assert _taken(launches) == "atomic-free", name


def test_non_causal_right_window_takes_the_atomic_free_backward(launches, monkeypatch):
    """A right bound that is not the causal diagonal (window (-1, 5) without causality)."""
    _route(monkeypatch)
    _bwd_call(*_qkv(1, 2, 2, _L, _L, 64, torch.bfloat16, "cpu", grad=False), False, window=(-1, 5))
    assert _taken(launches) == "atomic-free"


def test_supports_names_every_feature():
    q = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16)
    base = dict(arch=90, dropout_p=0.0, key_padding_mask=None, has_window=False, varlen=None, score_mod=False,
                dbias=None, aligned=True)
    assert hopper_bwd.supports(q, **base)
    changes = dict(arch=80, dropout_p=0.5, key_padding_mask=q, has_window=True, varlen=(q, q, 1, 1), score_mod=True,
                   dbias=q, aligned=False)
    for name, value in changes.items():
        assert not hopper_bwd.supports(q, **{**base, name: value}), name
    for t in (torch.empty(1, 1, 1, 64), torch.empty(1, 1, 1, 80, dtype=torch.float16)):
        assert not hopper_bwd.supports(t, **base)


def test_interpreter_keeps_the_atomic_free_backward(device, launches, monkeypatch):
    """With the switch on, the interpreter (and any non-sm_90 device) runs the atomic-free
    backward: gradients match the reference, no Gluon launch."""
    if SM90:
        pytest.skip("sm_90 takes the Gluon backward: tested below")
    monkeypatch.setattr(hopper_bwd, "ENABLED", True)
    q, k, v = _qkv(1, 2, 1, 33, 40, 64, torch.bfloat16, device)
    check(lambda *t: attention(*t, True, return_lse=True),
          lambda *t, compute_dtype=None: reference.attention(*t, True, return_lse=True, compute_dtype=compute_dtype),
          (q, k, v), ["q", "k", "v"])
    assert launches["attention_bwd"] == 1 and launches["attention_bwd_hopper"] == 0


# ---------------------------------------------------------------------------------------------
# the kernel's schedule and arithmetic, twinned on the CPU (float64): the Gluon kernel cannot
# run in the interpreter, so its index logic (which query blocks a key block visits, which are
# masked, the ring's refill coordinates, the GQA head walk) and its algebra (statistics folded
# into the accumulators, dS from P, dQ summed over key blocks) are checked here, line for line
# against ``_attn_bwd_hopper``'s scalar code; the GPU tests below check the kernel itself.
# ---------------------------------------------------------------------------------------------

def _twin_schedule(Lq, Lk, group, cdiag, block_m, stages, n0, bn):
    """``_attn_bwd_hopper``'s steps for the key block of ``bn`` keys at ``n0``: [(head offset g,
    start_m, masked)], and the refill coordinates it issues after each step (None past the end)."""
    m_end = -(-Lq // block_m) * block_m
    m_first = max(n0 - cdiag, 0) // block_m * block_m
    m_full = n0 + bn - 1 - cdiag
    n_m = (m_end - m_first) // block_m
    n_steps = group * n_m
    prologue = [(i // n_m, m_first + (i - i // n_m * n_m) * block_m) for i in range(min(stages, n_steps))]
    steps, refills = [], []
    h, start_m = 0, m_first
    h_nx, m_nx = stages // n_m, m_first + stages % n_m * block_m
    for i in range(n_steps):
        steps.append((h, start_m, start_m < m_full))
        refills.append((h_nx, m_nx) if i + stages < n_steps else None)
        start_m += block_m
        if start_m >= m_end:
            start_m, h = m_first, h + 1
        m_nx += block_m
        if m_nx >= m_end:
            m_nx, h_nx = m_first, h_nx + 1
    return steps, prologue, refills


def _twin_walk(n_n, BH, section, grid):
    """``_attn_bwd_hopper_persistent``'s tiles, per program: [(key block, batch x kv head,
    K + V mbarrier phase)] in the order it takes them."""
    programs = []
    for pid in range(grid):
        tiles = []
        for tile in range(pid, n_n * BH, grid):
            sec = tile // (section * n_n)
            r = tile - sec * section * n_n
            width = min(section, BH - sec * section)
            blk = r // width
            bh = sec * section + r - blk * width
            tiles.append((blk, bh, (tile // grid) & 1))
        programs.append(tiles)
    return programs


class _Ring:
    """A program's ring of ``stages`` slots as ``_bwd_tile`` fills and waits on it across its
    tiles: each wait must find the fill of the phase it waits for, holding the step's
    coordinates, and a tile leaves no fill unconsumed."""

    def __init__(self, stages):
        self.stages, self.it = stages, 0
        self.fills = [[] for _ in range(stages)]
        self.used = [0] * stages

    def tile(self, steps, prologue, refills):
        for i, coords in enumerate(prologue):
            self.fills[(self.it + i) % self.stages].append(coords)
        for i, step in enumerate(steps):
            slot, phase = (self.it + i) % self.stages, ((self.it + i) // self.stages) & 1
            n = self.used[slot]  # the slot's fills consumed so far: the wait is for the next one
            assert n & 1 == phase and (self.it + i) // self.stages == n
            assert len(self.fills[slot]) > n and self.fills[slot][n] == step[:2]
            self.used[slot] += 1
            if refills[i] is not None:
                self.fills[slot].append(refills[i])
        assert [len(f) for f in self.fills] == self.used, "a load left in the ring past the tile"
        self.it += len(steps)


def _twin_backward(q, k, v, out, dout, lse, causal, scale, block_m, stages, bn, grid=None, section=None):
    """dq, dk, dv as ``_attn_bwd_hopper`` + ``_dq_convert`` compute them (float64, no
    rounding), with the schedule's invariants asserted on the way; with ``grid`` (programs) and
    ``section`` (kv heads), as ``_attn_bwd_hopper_persistent`` walks the tiles, each program's
    ring carried from tile to tile."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    cdiag = Lk - Lq if causal else Lk + bn
    qk_scale = scale * 1.4426950408889634
    pad = -(-Lq // 128) * 128  # STAT_ALIGN rows of statistics: the padding rows' LSE is +inf
    lse2 = torch.full((B, Hq, pad), float("inf"), dtype=torch.float64)
    lse2[..., :Lq] = torch.where(torch.isfinite(lse), lse * 1.4426950408889634, float("inf"))
    delta = torch.zeros((B, Hq, pad), dtype=torch.float64)
    delta[..., :Lq] = (dout * out).sum(-1)

    def rows(t, start, n):  # TMA: rows past the end read as zero
        return torch.nn.functional.pad(t[start:start + n], (0, 0, 0, max(0, start + n - t.shape[0])))

    dq_acc = torch.zeros((B, Hq, Lq, D), dtype=torch.float64)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    n_n = -(-Lk // bn)
    if grid is None:
        walk = [[(n0 // bn, b * Hkv + hk, 0)] for b in range(B) for hk in range(Hkv) for n0 in range(0, Lk, bn)]
    else:
        walk = _twin_walk(n_n, B * Hkv, section, grid)
    tiles = [(blk, bh) for program in walk for blk, bh, _ in program]
    assert sorted(tiles) == sorted((blk, bh) for blk in range(n_n) for bh in range(B * Hkv)), "each tile once"
    for program in walk:
        ring = _Ring(stages)
        for done, (blk, bh, kv_phase) in enumerate(program):
            assert kv_phase == done & 1  # the K + V mbarrier's phase: the program's tiles so far
            b, hk, n0 = bh // Hkv, bh % Hkv, blk * bn
            steps, prologue, refills = _twin_schedule(Lq, Lk, group, cdiag, block_m, stages, n0, bn)
            ring.tile(steps, prologue, refills)
            assert steps, "every key block is seen by some query"
            assert prologue == [s[:2] for s in steps[:stages]]
            assert refills == [s[:2] for s in steps[stages:]] + [None] * min(stages, len(steps))
            kb, vb = rows(k[b, hk], n0, bn), rows(v[b, hk], n0, bn)
            key = torch.arange(n0, n0 + bn)[:, None]
            seen = set()
            for g, start_m, masked in steps:
                h = hk * group + g
                query = torch.arange(start_m, start_m + block_m)[None, :]
                real = (key < Lk) & (query < Lq)
                visible = key <= query + cdiag
                assert masked or bool(visible[real].all()), "an unmasked step with an invisible pair"
                seen.add((h, start_m))
                qb, dob = rows(q[b, h], start_m, block_m), rows(dout[b, h], start_m, block_m)
                s_acc = -(lse2[b, h, start_m:start_m + block_m].clamp(max=1e20) / qk_scale)[None, :]
                p = torch.exp2((s_acc + kb @ qb.T) * qk_scale)
                if masked:
                    p = torch.where(visible, p, 0.0)
                n = min(bn, Lk - n0)  # the key rows stored (TMA clips the rest)
                dv[b, hk, n0:n0 + n] += (p @ dob)[:n]
                ds = p * (vb @ dob.T - delta[b, h, start_m:start_m + block_m][None, :])
                dk[b, hk, n0:n0 + n] += (ds @ qb)[:n]
                dq_acc[b, h, start_m:start_m + block_m] += (ds.T @ kb)[:max(0, Lq - start_m)]
            # Every (head, query block) with a visible key in the block is visited, once.
            for h in range(hk * group, hk * group + group):
                for m in range(0, Lq, block_m):
                    query = torch.arange(m, min(m + block_m, Lq))[None, :]
                    keys = torch.arange(n0, min(n0 + bn, Lk))[:, None]
                    if bool((keys <= query + cdiag).any()):
                        assert (h, m) in seen
            assert len(seen) == len(steps)
    return dq_acc * scale, dk * scale, dv


@pytest.mark.parametrize("block_n,block_m,stages", sorted({(hopper_bwd.TILE_N[d][0], *c)
                                                         for table in (hopper_bwd.CONFIGS, hopper_bwd.WS_CONFIGS)
                                                         for d, cs in table.items() for c in cs}))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk", [
    # Partial last blocks, GQA 2:1 (the walk crossing heads), the ring wrapping.
    pytest.param(1, 4, 2, 300, 300, id="300-gqa"),
    # Lq < Lk: causal offset 157, key blocks that every query sees unmasked; MQA.
    pytest.param(1, 3, 1, 150, 307, id="cross-150x307-mqa"),
    # Lq > Lk: the first 320 queries see no key (LSE -inf: +inf statistics, P = 0).
    pytest.param(2, 2, 2, 390, 70, id="cross-390x70"),
])
def test_the_kernels_twin_matches_the_reference(B, Hq, Hkv, Lq, Lk, causal, block_n, block_m, stages):
    D = 64
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, torch.float64, "cpu", grad=True)
    out, lse = reference.attention(q, k, v, causal, return_lse=True)
    dout = randn(*out.shape, dtype=torch.float64, device="cpu")
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = _twin_backward(q.detach(), k.detach(), v.detach(), out.detach(), dout, lse.detach(), causal, D ** -0.5,
                         block_m, stages, block_n)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_the_persistent_walk_takes_every_tile_once_heaviest_first(causal):
    """``_attn_bwd_hopper_persistent``'s walk (twinned) for every small shape: each (key block,
    kv head) tile exactly once over the programs; in tile order, sections of ``section`` kv
    heads (the last narrower), each section's heads at one key block before the next block, and
    the key blocks first to last, whose work (steps) never grows: the heaviest tiles first
    under a causal mask (equal work without one); each program's K + V phase alternates."""
    bn, block_m, stages = hopper_bwd.TILE_N[64][0], *hopper_bwd.PERSISTENT_CONFIGS[64][0]
    for Lq, Lk in ((1000, 1000), (300, 877), (400, 70)):
        n_n = -(-Lk // bn)
        cdiag = Lk - Lq if causal else Lk + bn
        work = [len(_twin_schedule(Lq, Lk, 1, cdiag, block_m, stages, blk * bn, bn)[0]) for blk in range(n_n)]
        assert work == sorted(work, reverse=True)
        for BH in range(1, 7):
            for section in range(1, BH + 2):
                for grid in range(1, n_n * BH + 2):
                    walk = _twin_walk(n_n, BH, section, grid)
                    taken = {}
                    for pid, program in enumerate(walk):
                        assert [ph for _, _, ph in program] == [t & 1 for t in range(len(program))]
                        for t, (blk, bh, _) in enumerate(program):
                            taken[pid + t * grid] = (blk, bh)
                    assert sorted(taken.values()) == [(b, h) for b in range(n_n) for h in range(BH)]
                    order = [taken[t] for t in range(n_n * BH)]
                    want = [(blk, h) for s0 in range(0, BH, section) for blk in range(n_n)
                            for h in range(s0, min(s0 + section, BH))]
                    assert order == want
                    tile_work = [work[blk] for blk, _ in order]
                    for s0 in range(0, BH, section):  # in a section, the work never grows
                        sec = tile_work[s0 * n_n:(s0 + min(section, BH - s0)) * n_n]
                        assert sec == sorted(sec, reverse=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,grid,section", [
    # 12 tiles (3 key blocks x 2 batches x 2 kv heads) over 5 programs, sections of 3 kv heads
    # and a last one of 1; GQA 2:1, partial last blocks.
    pytest.param(2, 4, 2, 300, 300, 5, 3, id="300-gqa-5x3"),
    # Lq > Lk: the first 320 queries see no key; 2 programs over 4 tiles, one head a section.
    pytest.param(2, 2, 2, 390, 70, 2, 1, id="cross-390x70-2x1"),
])
def test_the_persistent_twin_matches_the_reference(B, Hq, Hkv, Lq, Lk, grid, section, causal):
    """The persistent walk (twinned): each program's ring carried from tile to tile (slots and
    phases continue, no load left over), every tile's dK and dV, the dQ parts summed."""
    D = 64
    block_m, stages = hopper_bwd.PERSISTENT_CONFIGS[D][0]
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, torch.float64, "cpu", grad=True)
    out, lse = reference.attention(q, k, v, causal, return_lse=True)
    dout = randn(*out.shape, dtype=torch.float64, device="cpu")
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = _twin_backward(q.detach(), k.detach(), v.detach(), out.detach(), dout, lse.detach(), causal, D ** -0.5,
                         block_m, stages, hopper_bwd.TILE_N[D][0], grid=grid, section=section)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=name)


# ---------------------------------------------------------------------------------------------
# numerics (sm_90 only)
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not SM90, reason="the Gluon backward runs on sm_90 only")
# Both kernels. The warp-specialized one's cases are heavy (deselected unless FUSED_BLOCK_HEAVY=1
# or -m heavy) and have "wspec" in their ids: a deadlock there (it has never run) must not hang
# the GPU check's run of the suite; run them apart (``FUSED_BLOCK_HEAVY=1 ... -k wspec``). It
# exists at D64 only (D128 under its switch runs the single-partition kernel).
VARIANTS = [pytest.param(False, id="wg2"), pytest.param(True, id="wspec", marks=pytest.mark.heavy)]


def _variant(ws, D, monkeypatch):
    if ws and D not in hopper_bwd.WS_CONFIGS:
        pytest.skip("the warp-specialized backward is D64 only")
    monkeypatch.setattr(hopper_bwd, "WS", ws)


# (B, Hq, Hkv, Lq, Lk), each with its reason: BLOCK_N is 128 (64 at D256), BLOCK_M 64 or 128
# (the candidates).
GPU_CASES = [
    # Whole blocks: key blocks on the causal diagonal (masked steps), query blocks skipped above it.
    pytest.param(2, 4, 4, 256, 256, id="256"),
    # 1000: partial last query and key blocks (zero rows, LSE +inf; dK/dV rows clipped), GQA 4:1
    # (dK/dV summed over the group's heads, the ring crossing heads).
    pytest.param(1, 8, 2, 1000, 1000, id="1000-gqa"),
    # Lq < Lk: bottom-right causal offset 577, not a block multiple; MQA; the ring wraps many times.
    pytest.param(1, 2, 1, 300, 877, id="cross-300x877-mqa"),
    # Lq > Lk: under causal the first 330 queries see no key (dq 0 there).
    pytest.param(1, 2, 2, 400, 70, id="cross-400x70"),
]


def _check_gluon(B, Hq, Hkv, Lq, Lk, D, causal, dtype, launches, monkeypatch, lse_weight=False):
    monkeypatch.setattr(hopper_bwd, "ENABLED", True)
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, "cuda")
    check(lambda *t: attention(*t, causal, return_lse=True),
          lambda *t, compute_dtype=None: reference.attention(*t, causal, return_lse=True,
                                                             compute_dtype=compute_dtype),
          (q, k, v), ["q", "k", "v"], lse_weight=lse_weight)
    assert launches["attention_bwd_hopper"] == 1 and launches["attention_dq_convert"] == 1
    assert launches["attention_bwd"] == 0 and launches["attention_bwd_dq_atomic"] == 0


@gpu
@pytest.mark.parametrize("D", sorted(hopper_bwd.PADDED))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", hopper_bwd.DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk", GPU_CASES)
@pytest.mark.parametrize("ws", VARIANTS)
def test_gluon_backward_matches_reference(ws, B, Hq, Hkv, Lq, Lk, D, causal, dtype, launches, monkeypatch):
    _variant(ws, D, monkeypatch)
    _check_gluon(B, Hq, Hkv, Lq, Lk, D, causal, dtype, launches, monkeypatch)


@gpu
@pytest.mark.parametrize("D", hopper_bwd.HEAD_DIMS)
@pytest.mark.parametrize("ws", VARIANTS)
def test_gluon_backward_lse_gradient(ws, D, launches, monkeypatch):
    """The LSE's gradient reaches the kernel through delta (the shared preprocess)."""
    _variant(ws, D, monkeypatch)
    _check_gluon(1, 4, 2, 333, 333, D, True, torch.bfloat16, launches, monkeypatch, lse_weight=True)


@gpu
@pytest.mark.parametrize("D", hopper_bwd.HEAD_DIMS)
@pytest.mark.parametrize("ws", VARIANTS)
def test_gluon_backward_on_strided_views(ws, D, launches, monkeypatch):
    """q, k, v as views of one (B, L, 3 H, D) projection (SDPA's transposed layout): the
    descriptors take the strides, no copy; dq, dk, dv come back in that memory order."""
    _variant(ws, D, monkeypatch)
    monkeypatch.setattr(hopper_bwd, "ENABLED", True)
    B, L, H = 2, 333, 4
    qkv = randn(B, L, 3 * H, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    check(lambda t: attention(*(x.transpose(1, 2) for x in t.split(H, dim=2)), True, return_lse=True),
          lambda t, compute_dtype=None: reference.attention(*(x.transpose(1, 2) for x in t.split(H, dim=2)), True,
                                                            return_lse=True, compute_dtype=compute_dtype),
          (qkv, ), ["qkv"])
    assert launches["attention_bwd_hopper"] == 1


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ws,D,cand", [
    pytest.param(ws, d, i, id=f"{'wspec' if ws else 'wg2'}-D{d}-{i}", marks=[pytest.mark.heavy] if ws else [])
    for ws in (False, True) for d, c in (hopper_bwd.WS_CONFIGS if ws else hopper_bwd.CONFIGS).items()
    for i in range(len(c))])
def test_every_gluon_candidate_matches_reference(ws, D, cand, causal, launches, monkeypatch):
    """Each tile/ring-depth candidate the launcher may time and keep (1000 x 1000: ragged
    blocks, the ring wrapping many times; GQA 2:1)."""
    _variant(ws, D, monkeypatch)
    name = "_WS_CANDIDATES" if ws else "_CANDIDATES"
    monkeypatch.setattr(hopper_bwd, name, {D: [getattr(hopper_bwd, name)[D][cand]]})
    monkeypatch.setattr(hopper_bwd, "_CACHE", common.ConfigCache("attention_bwd_hopper"))
    _check_gluon(1, 4, 2, 1000, 1000, D, causal, torch.bfloat16, launches, monkeypatch)


# The persistent form (D64), heavy with "persist" in its ids as the forward's: its ring's phases
# continue from tile to tile (a new way to wait forever, never run yet). 3 programs (the SM
# count faked) so that each walks several tiles; L2 sections of one kv head (the budget faked).
@gpu
@pytest.mark.heavy
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", hopper_bwd.DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk", GPU_CASES)
def test_persist_gluon_backward_matches_reference(B, Hq, Hkv, Lq, Lk, causal, dtype, launches, monkeypatch):
    monkeypatch.setattr(hopper_bwd, "WS", False)
    monkeypatch.setattr(hopper_bwd, "PERSISTENT", True)
    monkeypatch.setattr(common, "sm_count", lambda device: 3)
    monkeypatch.setattr(hopper_bwd, "L2_QDO_BYTES", 1)
    _check_gluon(B, Hq, Hkv, Lq, Lk, 64, causal, dtype, launches, monkeypatch)


@gpu
@pytest.mark.heavy
@pytest.mark.parametrize("causal", [False, True])
def test_persist_gluon_backward_walks_many_tiles(causal, launches, monkeypatch):
    """40 tiles (8 key blocks x 5 kv heads) over 3 programs (13-14 tiles each), L2 sections of
    2 kv heads, the last one narrower; GQA 2:1; Lq > Lk (under causal the first 100 queries see
    no key). The outputs start poisoned: every tile must be written."""
    monkeypatch.setattr(hopper_bwd, "WS", False)
    monkeypatch.setattr(hopper_bwd, "PERSISTENT", True)
    monkeypatch.setattr(common, "sm_count", lambda device: 3)
    Lq, Lk, D = 1000, 900, 64
    monkeypatch.setattr(hopper_bwd, "L2_QDO_BYTES", 2 * 2 * Lq * 2 * D * 2)
    assert hopper_bwd.section(Lq, D, 2, 2) == 2
    _check_gluon(1, 10, 5, Lq, Lk, D, causal, torch.bfloat16, launches, monkeypatch)


# ---------------------------------------------------------------------------------------------
# the launch path (CPU, through the fake CUDA driver): what runs is what the compile check built
# ---------------------------------------------------------------------------------------------

_LAUNCH_SCRIPT = """
import json, sys, torch
import fused_block
from fused_block import _backend
from fused_block.kernels import common, fake_driver
from fused_block.kernels.attention import hopper_bwd

common.TUNE = False  # the first candidate of each (nothing to time on)
out = []
with fake_driver.installed(90, record=True, check=True) as fake, fake_driver.launcher_branches(90), \\
        _backend.host_only(stub=False):
    common.sm_count = lambda device: 4  # fewer programs than tiles for the persistent form
    hopper_bwd.ENABLED = True
    for ws, persistent, D, causal in ((ws, p, D, causal) for ws, p in ((False, False), (True, False), (False, True))
                                      for D in sorted(hopper_bwd.PADDED) for causal in (False, True)):
        hopper_bwd.WS, hopper_bwd.PERSISTENT = ws, persistent
        # GQA 4:2, Lq 300, Lk 333 (3 key blocks); q a strided view (a packed projection).
        qkv = torch.randn(1, 300, 3 * 4, D, dtype=torch.bfloat16)
        q = qkv[:, :, :4].transpose(1, 2).requires_grad_()
        k = torch.randn(1, 2, 333, D, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 2, 333, D, dtype=torch.bfloat16, requires_grad=True)
        o = fused_block.attention(q, k, v, causal=causal)
        fake.launches.clear()
        torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
        (rec,) = [r for r in fake.launches if r.compiled.name.startswith("_attn_bwd_hopper")]
        src = rec.compiled.src
        out.append(dict(ws=ws, persistent=persistent, D=D, causal=causal, names=[r.compiled.name for r in fake.launches],
                        grid=list(rec.grid), ints=list(rec.args[8:18]), signature=src.signature,
                        constants={src.fn.arg_names[i[0]]: getattr(c, "value", c) for i, c in src.constants.items()},
                        num_warps=rec.compiled.options["num_warps"]))
json.dump(out, sys.stdout)
"""


def test_gluon_launches_match_the_compiled_specs():
    """The Gluon backwards launched through Triton's own launch path on CPU tensors (the fake
    driver checks every argument against the specialization): the preprocess, one Gluon launch
    over 3 key blocks (6 of 64 keys at D256) x 2 kv heads at D64, 96 (the D128 build: blocks
    128 wide), 128, 192 (the D256 build) and 256 (the warp-specialized kernel at D64 under
    "ws", the persistent one at D64 under "persistent":
    min(6 tiles, 4 SMs: the count faked) programs, with B x Hkv and its L2 section) and the dQ
    conversion, with exactly the signature and constexprs the compile check builds
    (``aot_spec_args``: 16-byte aligned descriptors, unspecialized shape arguments)."""
    import json
    import pathlib

    from fused_block.kernels import fake_driver

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = fake_driver.run_without_interpreter(["-c", _LAUNCH_SCRIPT], cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launches = json.loads(proc.stdout)
    assert len(launches) == 30
    for rec in launches:
        D = hopper_bwd.PADDED[rec["D"]]  # D96, D192: the D128, D256 builds
        ws = rec["ws"] and D in hopper_bwd.WS_CONFIGS
        persistent = rec["persistent"] and D in hopper_bwd.PERSISTENT_CONFIGS
        table = hopper_bwd.WS_CONFIGS if ws else hopper_bwd.PERSISTENT_CONFIGS if persistent else hopper_bwd.CONFIGS
        block_m, stages = table[D][0]
        sig, constexprs = hopper_bwd.aot_spec_args("bf16", D, block_m, stages, ws, persistent)
        kernel = "_attn_bwd_hopper" + ("_ws" if ws else "_persistent" if persistent else "")
        assert rec["names"] == ["_attn_bwd_preprocess", kernel, "_dq_convert"]
        bn = hopper_bwd.TILE_N[D][0]
        assert rec["grid"] == [4 if persistent else -(-333 // bn) * 2, 1, 1]
        # Hq, Hkv, GROUP, Lq, Lk, cdiag; the persistent form's B x Hkv and L2 section (kv heads)
        cdiag = 333 - 300 if rec["causal"] else 333 + bn
        assert rec["ints"][:6] == [4, 2, 2, 300, 333, cdiag]
        if persistent:
            assert rec["ints"][8:] == [2, hopper_bwd.section(300, D, 2, 2)]
        assert rec["signature"] == sig
        assert {k: v for k, v in rec["constants"].items() if k in constexprs} == constexprs
        assert rec["num_warps"] == constexprs["num_warps"]
