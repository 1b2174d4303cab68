"""Per-architecture config tables of the attention kernels, and the keys that index them.

Candidates by (head-dim class, operand kind, dropout, feature class); see the notes above each
table for the provenance of every entry (the anchors it follows, or the measurement that chose
it).
"""
import torch

from fused_block.kernels import common

# ---------------------------------------------------------------------------------------------
# configs, per architecture: candidates by (head-dim class, operand kind, dropout)
#
# Head-dim classes are BLOCK_D <= 64, 128, 256 (16/32 run the 64 class's tiles); operand kinds
# "16" (fp16/bf16), "tf32" and "ieee" (fp32 under torch's TF32 / full-precision matmul setting).
# On CUDA with several candidates, common.ConfigCache times them once per key and keeps the
# fastest. Every candidate compiles without spills on its own arch (tests/test_compile.py);
# sm_90 candidates compile with TMA, and the first candidate also with pointer loads (the
# pointer path there, for unaligned layouts, takes only the first).
#
# Sources: flex_attention's H100/A100 defaults (torch/_inductor/template_heuristics/triton.py:
# D64 128x128/3 stages/4 warps, D128 128x64/3/8, D256 64x32/3/4 forward; sm90 backward
# 64/128/128/64, 3 stages, 8 warps), Triton's 06-fused-attention tutorial (Hopper forward
# 128x{64,128} with 8 warps only from 128x128; backward 32/128/128/32, 5 stages, 4 warps).
# sm_90 forward: flex's D64 128x128 with 4 warps is not shipped (one warpgroup over 128 rows
# serializes its wgmma: 24 waits per trip, 255 registers, 8 B of stack with host descriptors).
# Warp-specialized candidates (``ws``, Triton's Hopper WS: a TMA producer and Q's rows split
# between two consumer warpgroups, 4 warps requested) come after the proven first candidate;
# they are opt-in (FUSED_BLOCK_WS=1, common.WARP_SPECIALIZE: not yet run on a GPU), and then
# tried first (launchers._fwd_candidates) for the timing to pick where faster; 128x128 WS
# tiles fail to compile with causality or padding (Triton 3.6), so 128x64 only.
# sm_80 (sass_loops --arch 80; non-MMA instructions per mma.sync in the unmasked K/V loop):
# D64 128x128/8 warps first (3.9, against 5.4 at 128x32/4 warps). FlashAttention-2's A100
# tiles do not fit Triton's register budget: D128 128x64/4 warps spills 6.4 KB, 128x64/8
# warps (3.1 against 4.2 at 128x32/8 warps) 24-64 B with causality or ragged heads, D256
# 128x64/8 warps 312-520 B, the D128 backward's 64/128/128/64 64-128 B; those stay.
# Dropout (one Philox call per 4 elements, in the MMA layouts' own groups: _dropout_keep)
# runs the no-dropout tiles first on sm_90 (the former smaller tiles follow), except where a
# flag combination spills: the D128 backward's dK/dV steps stay at 16 rows (32 rows: 16-56 B
# with causality and padding; split dV/dK programs cost more), the D256 backward's 32x64
# split tile is a TMA-only later candidate (its pointer build spills 24-64 B). The FMA-unit
# IEEE kernels draw one call per element (no MMA groups); on sm_80 the IEEE forwards take 8
# warps (D64 without dropout 32x32/4 warps spilled 16 B already; with dropout 1 stage), the
# D64 IEEE dropout backward 8 warps and the D256 dropout backward 16x32 split steps, to stay
# spill-free with it.
# ---------------------------------------------------------------------------------------------

def _fwd_cfg(bm, bn, warps, stages, ws=False, sched=0, vhost=False):
    return common.Config.of(num_warps=warps, num_stages=stages, BLOCK_M=bm, BLOCK_N=bn, WS=ws, SCHED=sched,
                            VHOST=vhost)


def _bwd_cfg(m1, n1, m2, n2, warps, stages, split_kv=False, sched=0, host_desc=0):
    return common.Config.of(num_warps=warps, num_stages=stages, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2,
                            BLOCK_N2=n2, SPLIT_KV=split_kv, SCHED=sched, HOST_DESC=host_desc)


F, B = _fwd_cfg, _bwd_cfg
FWD_CONFIGS = {
    90: {
        (64, "16", False): [F(128, 128, 8, 3), F(128, 64, 4, 3), F(128, 64, 4, 3, True)],
        (64, "16", True): [F(128, 128, 8, 3), F(128, 64, 8, 3)],
        (128, "16", False): [F(128, 64, 8, 3), F(128, 128, 8, 2), F(128, 64, 4, 3, True)],
        (128, "16", True): [F(128, 64, 8, 3), F(128, 32, 8, 3)],
        (256, "16", False): [F(64, 32, 8, 3), F(64, 32, 4, 3), F(128, 64, 8, 2)],
        (256, "16", True): [F(64, 32, 8, 3), F(64, 32, 8, 2), F(128, 32, 8, 2)],
        (64, "tf32", False): [F(128, 32, 4, 3), F(128, 32, 8, 3)],
        (64, "tf32", True): [F(128, 32, 8, 3), F(64, 32, 4, 3)],
        (128, "tf32", False): [F(128, 32, 8, 3), F(64, 64, 4, 3)],
        (128, "tf32", True): [F(128, 32, 8, 3), F(64, 32, 4, 3)],
        (64, "ieee", False): [F(32, 32, 8, 2)],
        (64, "ieee", True): [F(32, 32, 8, 2)],
        (128, "ieee", False): [F(16, 16, 4, 2)],
        (128, "ieee", True): [F(16, 16, 8, 2)],
    },
    80: {
        (64, "16", False): [F(128, 128, 8, 3), F(128, 32, 4, 3)],
        (64, "16", True): [F(128, 64, 8, 3)],
        (128, "16", False): [F(128, 32, 8, 3)],
        (128, "16", True): [F(128, 32, 8, 3)],
        (256, "16", False): [F(64, 32, 8, 3)],
        (256, "16", True): [F(32, 32, 4, 2)],
        (64, "tf32", False): [F(128, 32, 8, 3)],
        (64, "tf32", True): [F(128, 32, 8, 3)],
        (128, "tf32", False): [F(128, 32, 8, 3)],
        (128, "tf32", True): [F(128, 32, 8, 3)],
        (64, "ieee", False): [F(32, 32, 8, 2)],
        (64, "ieee", True): [F(32, 32, 8, 1)],
        (128, "ieee", False): [F(16, 16, 4, 2)],
        (128, "ieee", True): [F(16, 16, 8, 2)],
    },
}
# Backward: BLOCK_M1 x BLOCK_N1 (dK/dV: queries per step x keys per program), BLOCK_M2 x
# BLOCK_N2 (dQ). dK and dV accumulate in registers together, BLOCK_N1 x BLOCK_D fp32 each:
# with 8 warps BLOCK_N1 = 128 is two warpgroups of 64 rows (wgmma's M), and BLOCK_M1 = 32 (the
# tutorial's 32/128) leaves room for the score tiles; flex's 64/128 spills at D = 128 here.
# Where both accumulators cannot fit (D = 256, some fp32 and dropout classes) ``split_kv``
# gives dV and dK programs of their own (the dK one recomputes P).
BWD_CONFIGS = {
    90: {
        (64, "16", False): [B(64, 128, 128, 64, 8, 3), B(32, 128, 128, 64, 8, 3)],
        (64, "16", True): [B(64, 128, 128, 64, 8, 3), B(32, 128, 128, 32, 8, 2)],
        (128, "16", False): [B(32, 128, 128, 64, 8, 3), B(32, 128, 128, 64, 8, 2)],
        (128, "16", True): [B(16, 128, 128, 64, 8, 3), B(16, 128, 128, 32, 8, 2)],
        (256, "16", False): [B(32, 64, 64, 32, 8, 2, True), B(64, 64, 64, 64, 8, 2, True)],
        (256, "16", True): [B(16, 64, 64, 16, 8, 3, True), B(16, 64, 64, 16, 8, 2, True),
                            B(32, 64, 64, 32, 8, 2, True)],
        (64, "tf32", False): [B(32, 128, 128, 64, 8, 3)],
        (64, "tf32", True): [B(32, 128, 128, 64, 8, 3), B(16, 128, 128, 32, 8, 2)],
        (128, "tf32", False): [B(16, 128, 128, 16, 8, 2, True), B(16, 128, 128, 32, 8, 2)],
        (128, "tf32", True): [B(16, 128, 128, 16, 8, 2, True), B(16, 64, 64, 16, 8, 2, True)],
        (64, "ieee", False): [B(16, 32, 32, 16, 4, 2)],
        (64, "ieee", True): [B(16, 32, 32, 16, 4, 2)],
        (128, "ieee", False): [B(16, 16, 16, 16, 4, 2)],
        (128, "ieee", True): [B(16, 16, 16, 16, 4, 3)],
    },
    80: {
        (64, "16", False): [B(32, 128, 128, 32, 8, 2), B(32, 64, 64, 32, 4, 2)],
        (64, "16", True): [B(16, 64, 64, 16, 4, 2)],
        (128, "16", False): [B(32, 64, 64, 32, 8, 2)],
        (128, "16", True): [B(32, 64, 64, 32, 8, 2)],
        (256, "16", False): [B(32, 64, 64, 32, 8, 2, True)],
        (256, "16", True): [B(16, 32, 32, 16, 8, 2, True)],
        (64, "tf32", False): [B(16, 64, 64, 16, 8, 2)],
        (64, "tf32", True): [B(16, 64, 64, 16, 8, 2)],
        (128, "tf32", False): [B(16, 64, 64, 16, 8, 2, True)],
        (128, "tf32", True): [B(16, 32, 32, 16, 8, 2, True)],
        (64, "ieee", False): [B(16, 32, 32, 16, 4, 2)],
        (64, "ieee", True): [B(16, 32, 32, 16, 8, 2)],
        (128, "ieee", False): [B(16, 32, 32, 16, 4, 2)],
        (128, "ieee", True): [B(16, 16, 16, 16, 4, 2)],
    },
}
del F, B

# Feature classes. Beyond causality, padding and dropout, a kernel's flags change what its
# K/V steps cost, so each class has its own entries under the same (head-dim class, operand
# kind, dropout) keys: "plain" (the tables above), and
# - "band": a sliding window (a second masked edge: blocks before the band's left edge are
#   masked too; the unmasked steps are the plain ones) or packed sequences (per-sequence
#   bounds, device-side descriptors on the TMA path, a binary search in the prologue). Its
#   candidates start as the plain first candidates without warp specialization (Triton 3.6
#   partitions only a kernel with one K/V loop); entries that compiled differently are
#   overridden below.
# - "score": score modifications (softcap, ALiBi, an additive bias, a bool mask): per-element
#   work (tanh, the distance, tile loads) in every K/V step; candidates derived as "band"'s.
#   Sinks change only the forward's epilogue and the preprocess: no class of their own.
CLASSES = ("plain", "band", "score")


def _derived(tables, overrides):
    """Per arch, the plain tables' first non-WS candidate under every key, with ``overrides``
    ({arch: {key: [configs]}}) replacing entries."""
    return {arch: {key: overrides.get(arch, {}).get(key, [next(c for c in cfgs if not c.meta().get("WS"))])
                   for key, cfgs in table.items()}
            for arch, table in tables.items()}


def _with_classes(plain, classes):
    """One table per arch keyed (head-dim class, kind, dropout, feature class)."""
    return {arch: {**{(*key, "plain"): cfgs for key, cfgs in table.items()},
                   **{(*key, cls): cfgs for cls, derived in classes.items() for key, cfgs in derived[arch].items()}}
            for arch, table in plain.items()}


# "band" entries that spilled as the plain first candidates (a second masked loop, the
# window's bounds; tests/test_compile.py): 4 warps for IEEE fp32 (FMA-unit products from
# registers), 8 for the 256-wide dropout forward on sm_80, dV/dK split or narrower query steps
# for the 16-bit D128 and TF32 dropout backward on sm_90.
_F, _B = _fwd_cfg, _bwd_cfg
_BAND_FWD = {
    90: {(128, "ieee", True): [_F(16, 16, 4, 2)]},
    80: {(256, "16", True): [_F(32, 32, 8, 2)], (128, "ieee", False): [_F(16, 16, 4, 2)],
         (128, "ieee", True): [_F(16, 16, 4, 2)]},
}
_BAND_BWD = {
    90: {(128, "16", True): [_B(16, 128, 128, 32, 8, 2, True)], (64, "tf32", True): [_B(16, 128, 128, 32, 8, 2)],
         (64, "ieee", True): [_B(16, 32, 32, 16, 4, 2, True)], (128, "ieee", True): [_B(16, 16, 16, 16, 8, 1, True)]},
}
# "score": every K/V step carries tanh, the ALiBi distance and bias/mask tiles, so the plain
# 128-row tiles spill with all of them at once: 64-row forward tiles (32 at D = 256, 16 on
# FMA-unit IEEE fp32), 16-query backward steps over 64 keys with dV and dK in programs of
# their own where both accumulators would not fit. sm_90 D64 16-bit with dropout: 32-key
# forward steps (64 x 64 spilled 8 B on the pointer path once the bool mask's key range was
# loaded in the prologue).
_SCORE_FWD = {
    90: {(64, "16", False): [_F(64, 64, 4, 2)], (64, "16", True): [_F(64, 32, 4, 2)],
         (128, "16", False): [_F(64, 32, 4, 2)], (128, "16", True): [_F(64, 32, 4, 2)],
         (64, "tf32", False): [_F(64, 32, 4, 2)], (64, "tf32", True): [_F(64, 32, 4, 2)],
         (128, "tf32", False): [_F(64, 32, 8, 2)], (128, "tf32", True): [_F(64, 32, 8, 2)],
         (64, "ieee", False): [_F(16, 16, 4, 2)], (64, "ieee", True): [_F(16, 16, 4, 2)],
         (128, "ieee", False): [_F(16, 16, 4, 2)], (128, "ieee", True): [_F(16, 16, 4, 2)]},
    80: {(64, "16", False): [_F(64, 32, 8, 2)], (64, "16", True): [_F(64, 32, 8, 2)],
         (128, "16", False): [_F(64, 32, 8, 2)], (128, "16", True): [_F(64, 32, 8, 2)],
         (256, "16", False): [_F(32, 32, 8, 2)], (256, "16", True): [_F(32, 32, 8, 2)],
         (64, "tf32", False): [_F(64, 32, 8, 2)], (64, "tf32", True): [_F(64, 32, 8, 2)],
         (128, "tf32", False): [_F(64, 32, 8, 2)], (128, "tf32", True): [_F(32, 32, 8, 1)],
         (64, "ieee", False): [_F(16, 16, 8, 1)], (64, "ieee", True): [_F(16, 16, 8, 1)],
         (128, "ieee", False): [_F(16, 16, 4, 2)], (128, "ieee", True): [_F(16, 16, 4, 1)]},
}
_SCORE_BWD = {arch: {
    (64, "16", False): [_B(16, 64, 64, 16, 8, 2)], (64, "16", True): [_B(16, 64, 64, 16, 8, 2)],
    (128, "16", False): [_B(16, 64, 64, 16, 8, 2, True)], (128, "16", True): [_B(16, 64, 64, 16, 8, 2, True)],
    (64, "tf32", False): [_B(16, 64, 64, 16, 8, 2, True)], (64, "tf32", True): [_B(16, 64, 64, 16, 8, 2, True)],
    (64, "ieee", False): [_B(16, 16, 16, 16, 4, 1, True)], (64, "ieee", True): [_B(16, 16, 16, 16, 4, 1, True)],
    (128, "ieee", False): [_B(16, 16, 16, 16, 8, 1, True)], (128, "ieee", True): [_B(16, 16, 16, 16, 8, 1, True)],
} for arch in (90, 80)}
# sm_90 D = 256: the dropout list's (plain) config for both (spill-free in every combination
# of the check; with dropout, ALiBi, a bias and a mask on the pointer path since the backward
# knows its kv head index is non-negative: 8 B spilled before).
_SCORE_BWD[90][(256, "16", False)] = [_B(16, 64, 64, 16, 8, 3, True)]

# Scheduling candidates (docs/attention-scheduling.md), timed after the proven first config and
# never first (they have not run on a GPU yet): ``sched`` 1 = one program per query block in
# longest-first order over all heads (head groups sized to the L2 cache), 2 = the same order
# on a persistent grid (one program per SM, snake order); for packed sequences ("band") also
# with the packed tensors' host-side descriptors (``vhost``, sm_90), and 64-row blocks with 4 warps
# (two programs per SM: one's prologue and epilogue under the other's K/V loop; a sequence's
# partial last block and its diagonal blocks are half as large). The backward's: the first
# config in longest-first order (``sched`` 1) and persistent (2, with 2 stages), plain and
# "band".
for _arch in (90, 80):
    for _bd in (64, 128):
        _first = FWD_CONFIGS[_arch][(_bd, "16", False)][0]
        _bm, _bn, _w, _s = _first["BLOCK_M"], _first["BLOCK_N"], _first.num_warps, _first.num_stages
        # persistent: the tile loop around the K/V loops holds more registers (the first
        # configs spilled 8-96 B): 2 stages (1 on sm_80 at D128), 64-key blocks on sm_80
        _p = (_bm, min(_bn, 64) if _arch == 80 else _bn, _w)
        _ps = 1 if (_arch, _bd) == (80, 128) else 2
        FWD_CONFIGS[_arch][(_bd, "16", False)] += [_F(_bm, _bn, _w, _s, sched=1), _F(*_p, _ps, sched=2)]
        _BAND_FWD.setdefault(_arch, {})[(_bd, "16", False)] = [
            _first, _F(_bm, _bn, _w, _s, sched=1, vhost=_arch == 90), _F(*_p, _ps, sched=2, vhost=_arch == 90),
            *([_F(64, 64, 4, 2, sched=1, vhost=True)] if _bd == 128 and _arch == 90 else [])]
        # The backward: its first config's programs (dK/dV and dQ) in longest-first order.
        _b = BWD_CONFIGS[_arch][(_bd, "16", False)][0]
        _blocks = tuple(_b[n] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))
        # persistent: dV and dK in programs of their own, 2 stages (with both accumulators the
        # first config spilled 24-232 B around the tile loop, 8-32 B with half its steps);
        # sm_90 D128 also with the band dropout list's 16-row dK/dV and 32-key dQ steps (its
        # own blocks spilled 16-104 B split)
        _lpt = (_B(*_blocks, _b.num_warps, _b.num_stages, _b["SPLIT_KV"], 1),
                _B(*((16, 128, 128, 32) if (_arch, _bd) == (90, 128) else _blocks), _b.num_warps, 2, True, 2))
        BWD_CONFIGS[_arch][(_bd, "16", False)] = [*BWD_CONFIGS[_arch][(_bd, "16", False)], *_lpt]
        _BAND_BWD.setdefault(_arch, {})[(_bd, "16", False)] = [_b, *_lpt]
del _arch, _bd, _first, _bm, _bn, _p, _ps, _w, _s, _b, _blocks, _lpt
del _F, _B
FWD_CONFIGS = _with_classes(FWD_CONFIGS, {"band": _derived(FWD_CONFIGS, _BAND_FWD),
                                          "score": _derived(FWD_CONFIGS, _SCORE_FWD)})
BWD_CONFIGS = _with_classes(BWD_CONFIGS, {"band": _derived(BWD_CONFIGS, _BAND_BWD),
                                          "score": _derived(BWD_CONFIGS, _SCORE_BWD)})


def _host_desc_twin(cfg, mode=1):
    m = cfg.meta()
    return _bwd_cfg(m["BLOCK_M1"], m["BLOCK_N1"], m["BLOCK_M2"], m["BLOCK_N2"], cfg.num_warps, cfg.num_stages,
                    m["SPLIT_KV"], m["SCHED"], mode)


# The backward's host-side descriptors (``HOST_DESC``, docs/attention-scheduling.md): sm_90's
# 16-bit first configs, every head dim, dropout and class, with Q, K, V, dO, dQ, dK, dV and the
# row statistics read and written through descriptors the launcher builds (1), instead of the
# 7 (dK/dV) or 5 (dQ) tensor maps each program writes to global memory around its loop; in
# the plain class also with only the tiles a program reads or writes once through them (2:
# the loops keep their maps and their length, 4 and 3 maps fewer). Dense batches only: packed
# sequences keep their per-sequence device descriptors (the twins run as the first config
# there). Timed after the first config and never first: not yet run on a GPU
# (FUSED_BLOCK_TUNE=0 and the pointer path take the first).
BWD_CONFIGS[90] = {key: [cfgs[0], _host_desc_twin(cfgs[0]), *([_host_desc_twin(cfgs[0], 2)] if key[3] == "plain" else []),
                         *cfgs[1:]] if key[1] == "16" else cfgs
                   for key, cfgs in BWD_CONFIGS[90].items()}

# Split-KV decoding (decode.py): BLOCK_N keys per step, by (head-dim class, operand kind,
# class); the query rows (the GQA group's GROUPS * Lq <= 16 * GROUPS) take BLOCK_M = 16 .. 64
# (:func:`_decode_block_m`). Every dtype, precision and head dim of the forward splits.
# Classes: "plain" (causal, window, key padding, softcap, ALiBi: nothing read per score but K
# and V) and "bias" (an additive bias or a bool mask too: a tile of each per step).
# Memory-bound: 4 warps, 64-key blocks at D64 (flash-decoding's), 32 where the compile check
# found spills with more; 8 warps at D256, for TF32 D128 (4 spilled 8 B on sm_90's pointer
# path) and for IEEE fp32 (FMA-unit products from registers: 4 warps spilled 24-32 B), whose
# rows stop at 32 at D64 and 16 at D128 (32 spilled 24-464 B with a bias and a mask).
# "bias" entries that spilled as the plain ones (8-128 B):
# 8 warps at D128 16-bit (64 rows on sm_80, 16 rows on sm_90's pointer path), 32-key blocks
# at D64 16-bit on sm_80 (64 rows), 16-key blocks for IEEE fp32. sm_90 at D64 (since the
# softcap's rational tanh, ptxas held the 16-row builds to 128 registers and spilled 8-16 B
# there): 8 warps for 16-bit (4 spilled with 64-key blocks at any stage count) and for TF32
# with one stage (4 warps spilled at every stage count and block size), 4 warps for IEEE fp32
# (8 spilled 16 B at 32 rows with 16-key blocks).
_D = common.Config.of
_DECODE_PLAIN = {
    (64, "16"): [_D(num_warps=4, num_stages=3, BLOCK_N=64)],
    (128, "16"): [_D(num_warps=4, num_stages=2, BLOCK_N=32)],
    (256, "16"): [_D(num_warps=8, num_stages=2, BLOCK_N=32)],
    (64, "tf32"): [_D(num_warps=4, num_stages=2, BLOCK_N=32)],
    (128, "tf32"): [_D(num_warps=8, num_stages=2, BLOCK_N=32)],
    (64, "ieee"): [_D(num_warps=8, num_stages=2, BLOCK_N=32)],
    (128, "ieee"): [_D(num_warps=8, num_stages=2, BLOCK_N=32)],
}
_IEEE_BIAS = {(64, "ieee"): [_D(num_warps=8, num_stages=2, BLOCK_N=16)],
              (128, "ieee"): [_D(num_warps=8, num_stages=2, BLOCK_N=16)]}
_DECODE_BIAS = {
    90: {(64, "16"): [_D(num_warps=8, num_stages=3, BLOCK_N=64)],
         (128, "16"): [_D(num_warps=8, num_stages=2, BLOCK_N=32)],
         (64, "tf32"): [_D(num_warps=8, num_stages=1, BLOCK_N=32)], **_IEEE_BIAS,
         (64, "ieee"): [_D(num_warps=4, num_stages=2, BLOCK_N=16)]},
    80: {(64, "16"): [_D(num_warps=4, num_stages=3, BLOCK_N=32)],
         (128, "16"): [_D(num_warps=8, num_stages=2, BLOCK_N=32)], **_IEEE_BIAS},
}
DECODE_CONFIGS = {
    arch: {**{(*key, "plain"): cfgs for key, cfgs in _DECODE_PLAIN.items()},
           **{(*key, "bias"): _DECODE_BIAS[arch].get(key, cfgs) for key, cfgs in _DECODE_PLAIN.items()}}
    for arch in (90, 80)
}
del _D, _IEEE_BIAS, _DECODE_PLAIN, _DECODE_BIAS
DECODE_BLOCK_MS = (16, 32, 64)


def _decode_block_m(rows: int, block_d: int, kind: str = "16") -> int:
    """Decode row block for ``rows`` = GROUPS * Lq query rows: the next power of two from 16,
    at most 64 (32 at D = 256, for TF32 and for IEEE fp32 at D <= 64, 16 for IEEE fp32 at
    D = 128: the fp32 tiles' registers)."""
    if kind == "ieee" and block_d > 64:
        cap = 16
    else:
        cap = 32 if block_d > 128 or kind != "16" else 64
    return min(max(16, common.next_pow2(rows)), cap)


# The bias's gradient (dbias._attn_dbias): a (BLOCK_M, BLOCK_N) dS tile per step, recomputed
# from Q, K, V and dO (two products per tile, no accumulator besides the tile), by (head-dim
# class, operand kind); one config each, spill-free on its arch (the compile check), not
# timed. sm_90: 64-row tiles (one warpgroup's wgmma M) with 64 keys at D <= 128 in 16 bits (4
# warps; 8 at D = 128, and for TF32 at D = 64: 8 B of stack with 4), 32 keys where the four
# operand tiles are wider; IEEE fp32 32 x 32 with 4 warps (8 spilled 16 B at D = 128 with the
# mask's key ranges and a sum over queries). sm_80 holds mma.sync operands in registers:
# 64 x 64 spilled 64-272 B there, so 32 x 32 tiles (64 x 32 at D = 64 in 16 bits; 16 x 32 at D = 256 and for TF32 at
# D = 128, where 32 x 32 spilled 160-264 B).
def _dbias_cfg(bm, bn, warps):
    return common.Config.of(num_warps=warps, num_stages=1, BLOCK_M=bm, BLOCK_N=bn)


DBIAS_CONFIGS = {
    90: {(64, "16"): _dbias_cfg(64, 64, 4), (128, "16"): _dbias_cfg(64, 64, 8), (256, "16"): _dbias_cfg(64, 32, 8),
         (64, "tf32"): _dbias_cfg(64, 64, 8), (128, "tf32"): _dbias_cfg(64, 32, 8),
         (64, "ieee"): _dbias_cfg(32, 32, 4), (128, "ieee"): _dbias_cfg(32, 32, 4)},
    80: {(64, "16"): _dbias_cfg(64, 32, 4), (128, "16"): _dbias_cfg(32, 32, 4), (256, "16"): _dbias_cfg(16, 32, 4),
         (64, "tf32"): _dbias_cfg(32, 32, 4), (128, "tf32"): _dbias_cfg(16, 32, 4),
         (64, "ieee"): _dbias_cfg(32, 32, 4), (128, "ieee"): _dbias_cfg(32, 32, 8)},
}

# The interpreter runs one config: query and key blocks of different sizes (and different in
# the two backward halves), so the tests cross both block grids and every masked/unmasked split.
INTERPRET_FWD = _fwd_cfg(64, 32, 1, 1)
INTERPRET_BWD = _bwd_cfg(32, 64, 64, 32, 1, 1)
INTERPRET_DECODE = common.Config.of(num_warps=1, num_stages=1, BLOCK_N=32)
INTERPRET_DBIAS = _dbias_cfg(32, 64, 1)
PRE_BLOCK_M = 64
# The backward's row statistics (STATS) are padded to a multiple of this: every query
# block of the backward tables (BLOCK_M1, BLOCK_M2) and PRE_BLOCK_M divide it.
STAT_ALIGN = 128
MAX_FP32_BLOCK_D = 128  # fp32 tiles are twice as wide; wider fp32 heads are refused upstream


def _block_d(d: int) -> int:
    return max(16, common.next_pow2(d))


def _kind(dtype) -> str:
    if dtype == torch.float32:
        return "tf32" if common.fp32_precision() == "tf32" else "ieee"
    return "16"


def _table_key(block_d: int, kind: str, dropout: bool, cls: str = "plain"):
    return (64 if block_d <= 64 else block_d, kind, dropout, cls)


def _class(window: bool, varlen: bool, score_mod: bool = False) -> str:
    """The feature class of a launch (see ``CLASSES``)."""
    return "score" if score_mod else "band" if window or varlen else "plain"


def _bucket(n: int) -> int:
    """Config-key bucket of a sequence length: the next power of two in [64, 16384]."""
    return min(max(64, common.next_pow2(n)), 16384)


