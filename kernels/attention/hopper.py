"""Opt-in Hopper attention forwards in Gluon (``triton.experimental.gluon``): explicit wgmma,
TMA and mbarriers, with FlashAttention-3's intra-warpgroup overlap; ``_attn_fwd_hopper`` in
one partition, ``_attn_fwd_hopper_ws`` with FA3's partitions (a TMA loader warp and two
consumer warpgroups, ``gl.warp_specialize``), ``_attn_fwd_hopper_pp`` the same partitions (two
or three consumers) under FA3's ping-pong schedule of the consumers' products (with
``OVERLAP``, its consumers one score block deeper: ``_pp_consumer_overlap``).

Taken only when ``FUSED_BLOCK_HOPPER_ATTN=1`` (the first), ``=ws`` (the second) or
``=pingpong`` (the third; ``=pingpong_overlap`` its OVERLAP candidates alone,
``=pingpong_persistent`` its persistent form ``_attn_fwd_hopper_pp_persistent`` alone) is set, on
sm_90 CUDA, for the cases they support (:func:`supports`): 16-bit q/k/v, head dim 64, 128 or 256
(96 and 192 through the 128 and 256 kernels, zero columns: :data:`PADDED`),
no dropout, padding mask, window, varlen, softcap, sinks, ALiBi, bias or bool mask; causal
(bottom-right, as the other kernels) or not; GQA/MQA; 16-byte aligned layouts (TMA).
Everything else, and every call without the switch, runs the Triton kernels of
``forward.py``, which stay the default and the interpreter's path (the interpreter cannot
run Gluon). These kernels have not yet run on a GPU: ``docs/attention-hopper.md`` says how
to check them, and they stay opt-in until a committed GPU run of
``tests/test_attention_hopper.py`` and ``bench/attention_hopper.py`` verifies them.

Structure of ``_attn_fwd_hopper`` (one program per (query block, batch * head), query blocks
in reverse order: under a causal mask the last blocks are the heaviest and start first; its
persistent form ``_attn_fwd_hopper_persistent`` runs the same tile, ``_fwd_tile``, for tile
after tile of a program per SM, ``FUSED_BLOCK_HOPPER_ATTN=persistent`` or a timed candidate;
the warp-specialized kernel differs as its docstring says):

- 8 warps = two consumer warpgroups of 64 query rows each (BLOCK_M = 128); the wgmma
  accumulators S (128 x BLOCK_N) and O (128 x D) are in registers, P goes to the PV product
  from registers (no shared-memory round trip).
- Q is loaded once by TMA; K and V each through a ring of ``STAGES`` shared-memory slots with
  one mbarrier per slot, refilled by TMA as soon as the products that read a slot finished
  (a CTA barrier first, as both warpgroups read every slot), one step ahead of their use.
- Step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} asynchronously, waits for S_j only
  (wgmma groups retire in order), runs the online softmax of S_j while the PV product runs
  on the tensor cores, then waits for it and rescales O (FA3's intra-warpgroup overlap).
- Key blocks that every row of the query block sees in bounds run without masks; only the
  blocks on the causal diagonal or past the last key are masked.
- The epilogue writes O through Q's shared memory and a TMA store (rows past Lq are clipped by
  the descriptor) and the fp32 natural-log LSE, -inf (and O = 0) for rows with no visible key.

Descriptors are host-side, over the whole (B, H, L, D) views with block (1, 1, rows, HEAD_D): rows
past a head's L (and columns past D < HEAD_D) read as zero and are not written, and any strides TMA accepts work without
a copy (the launchers' ``_strides`` / ``_aligned``).
"""
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fused_block.kernels import common
from fused_block.kernels.attention.configs import _bucket

ENV = "FUSED_BLOCK_HOPPER_ATTN"
# The head dims the kernels are compiled for (HEAD_D)...
HEAD_DIMS = (64, 128, 256)
# ...and the head dims they take, each with the kernel's: 96 and 192 run the 128 and 256
# kernels with the columns past D zero (the descriptors' blocks are HEAD_D wide over D-wide
# tensors: TMA reads zeros there and clips the store), which add nothing to Q K^T; O's extra
# columns are zero and never written. The same numbers as a D-wide kernel, not a copy.
PADDED = {64: 64, 96: 128, 128: 128, 192: 256, 256: 256}
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_M = 128
NUM_WARPS = 8
# Per head dim, the candidates (BLOCK_N, STAGES), timed once per key on the GPU (``ConfigCache``;
# the first with FUSED_BLOCK_TUNE=0). All compile without spills (the compile check): at
# BLOCK_N 128 about 196-236 registers, at 64 about 120-171 (D256: 187-225). Shared memory at BLOCK_M 128,
# 16-bit: Q (O leaves through Q's buffer) + STAGES x (K + V) tiles, 80-160 KB of 227 at D64
# and D128. D256 (FA3: 128 x 80; tiles here are powers of two): the O accumulator alone takes
# 128 of each thread's registers and a K + V stage 32 KB per 32 keys, so 64 keys x 2 stages
# (192 KB) or 32 x 4 (192 KB).
CONFIGS = {64: ((128, 3), (128, 2), (64, 4)), 128: ((128, 2), (64, 3), (64, 4)), 256: ((64, 2), (32, 4))}
# The single-partition kernel's persistent form (``_attn_fwd_hopper_persistent``: a program per
# SM, tiles in FA3's LPT order), on each head dim's first tile: last among the candidates, so
# it is taken only where the GPU timed it faster (or with FUSED_BLOCK_HOPPER_ATTN=persistent).
PERSISTENT_CONFIGS = {64: ((128, 3),), 128: ((128, 2),), 256: ((64, 2),)}
# The warp-specialized variant's (``_attn_fwd_hopper_ws``): consumers at 240 registers.
WS_CONFIGS = {64: ((128, 2), (128, 3)), 128: ((128, 2), (64, 3)), 256: ((64, 2),)}
_CANDIDATES = {(d, ws): [common.Config.of(num_warps=4 if ws else NUM_WARPS, BLOCK_M=BLOCK_M, BLOCK_N=n, STAGES=st,
                                          WS=ws, PERSISTENT=persistent, PINGPONG=False)
                         for table, persistent in (((WS_CONFIGS, False),) if ws else
                                                   ((CONFIGS, False), (PERSISTENT_CONFIGS, True)))
                         for n, st in table[d]]
               for d in HEAD_DIMS for ws in (False, True)}
# The ping-pong variant's (``_attn_fwd_hopper_pp``), (BLOCK_M, BLOCK_N, STAGES): BLOCK_M // 64
# consumer warpgroups. One K/V ring for all consumers (FA3's): a ring per consumer would double
# the shared memory, 2 x 2 x 64 KB of K + V stages at D128 and 128 keys (+ 32 KB of Q) > 227 KB.
# The warp-specialized kernel's tiles; at D64 also FA3's three consumers (192 query rows) with
# 64 keys a step (at 128 keys, FA3's, the consumers' 160 registers spill: 192 bytes of stack).
# D256 has the ws kernel's tile (FA3 takes no scheduler barrier there: its consumers' softmax
# is short beside D256's products; here for the same supports() as the ws kernel).
PINGPONG_CONFIGS = {64: ((128, 128, 2), (128, 128, 3), (192, 64, 3)), 128: ((128, 128, 2), (128, 64, 3)),
                    256: ((128, 64, 2),)}
# The ping-pong kernel with its consumers one score block deeper (``OVERLAP``:
# ``_pp_consumer_overlap``, two S accumulators), (BLOCK_M, BLOCK_N, STAGES): the tiles whose
# consumers compile without spills (the compile check; at 128 keys a step, D64 and D128, and
# at D256's 64 the second S accumulator spills: 64-256 bytes of stack), so 64 keys a step
# (D256: 32, with four slots). Timed after ``PINGPONG_CONFIGS``' under =pingpong (the first
# candidate stays the existing kernel's); =pingpong_overlap takes them alone.
PP_OVERLAP_CONFIGS = {64: ((192, 64, 3), (128, 64, 3)), 128: ((128, 64, 3),), 256: ((128, 32, 4),)}
# The ping-pong kernel's persistent form (``_attn_fwd_hopper_pp_persistent``: a program per SM,
# the persistent kernel's LPT tile order), on the ping-pong kernel's first tile of each head dim
# (and FA3's D64 three-consumer tile): timed last under =pingpong; =pingpong_persistent takes
# them alone.
PP_PERSISTENT_CONFIGS = {64: ((128, 128, 2), (192, 64, 3)), 128: ((128, 128, 2),), 256: ((128, 64, 2),)}
_PP_CANDIDATES = {d: [common.Config.of(num_warps=4, BLOCK_M=m, BLOCK_N=n, STAGES=st, WS=True, PERSISTENT=persistent,
                                       PINGPONG=True, OVERLAP=overlap)
                      for table, overlap, persistent in ((PINGPONG_CONFIGS, False, False),
                                                         (PP_OVERLAP_CONFIGS, True, False),
                                                         (PP_PERSISTENT_CONFIGS, False, True))
                      for m, n, st in table[d]] for d in HEAD_DIMS}
# FA3's L2 sections: as many heads a section as keep their K and V (at most this much) in L2.
L2_KV_BYTES = 32 << 20
_CACHE = common.ConfigCache("attention_fwd_hopper")
_LOG2E = 1.4426950408889634

# The opt-in switch, read once at import (no environment lookup per call; tests set these):
# "1" the single-partition kernel (its persistent form a timed candidate), "ws" the
# warp-specialized one, "persistent" the single-partition kernel in its persistent form only,
# "pingpong" the warp-specialized kernel with FA3's ping-pong schedule (its candidates timed
# among themselves; not among ``ws``'s, whose runs it would otherwise join untested),
# "pingpong_overlap" the ping-pong kernel with its consumers one score block deeper only,
# "pingpong_persistent" the ping-pong kernel's persistent form only.
ENABLED = os.environ.get(ENV, "0") in ("1", "ws", "persistent", "pingpong", "pingpong_overlap",
                                       "pingpong_persistent")
WS = os.environ.get(ENV, "0") == "ws"
PERSISTENT = os.environ.get(ENV, "0") == "persistent"
PINGPONG = os.environ.get(ENV, "0") in ("pingpong", "pingpong_overlap", "pingpong_persistent")
PP_OVERLAP = os.environ.get(ENV, "0") == "pingpong_overlap"
PP_PERSISTENT = os.environ.get(ENV, "0") == "pingpong_persistent"


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    """The wgmma accumulator layout of a (block_m, block_n) tile: warps stacked along M (one
    warpgroup per 64 rows), one instruction as wide as the tile."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 16])


@gluon.jit
def _softmax_step(s, m_i, l_i, col0, row, Lk, off, qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One online-softmax step on the raw scores ``s`` of the key block starting at ``col0``:
    the new running max (log2 units), the rescale factor of the old accumulator, P (fp32) and
    the new running sum. The scale is positive (validated), so max(s) * scale = max(s * scale)
    and it rides in exp2's FMA, as in ``forward.py``. Only masked blocks can hold rows that
    have seen no key yet: they keep max -inf, and P = 0 there (0 subtracted, not -inf)."""
    if MASKED:
        col = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(col < Lk, 0)
        if IS_CAUSAL:
            keep = keep & (gl.expand_dims(col, 0) <= gl.expand_dims(row + off, 1))
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return m_new, alpha, p, l_i


@gluon.jit
def _fwd_tile(QD, KD, VD, OD, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, b, h, hkv, m0, Hq, Lq, Lk, qk_scale,
              it, q_phase, IS_CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """One tile, the query rows [m0, m0 + BLOCK_M) of head ``h`` of batch ``b`` (the module
    docstring's structure), in the program's shared memory (Q, then O; the K and V rings) and
    mbarriers. ``it``: the key blocks the program's earlier tiles took through the rings (block j
    of this tile takes ring position it + j: slot (it + j) % STAGES, phase ((it + j) // STAGES) & 1);
    ``q_phase``: the phase of Q's mbarrier. Returns it + this tile's key blocks. The caller
    makes sure no warp still reads the buffers an earlier tile used (a CTA barrier)."""
    BLOCK_M: gl.constexpr = q_smem.shape[2]
    HEAD_D: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = QD.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    o_layout: gl.constexpr = _mma_layout(BLOCK_M, HEAD_D, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    off = Lk - Lq  # bottom-right causal alignment: row i sees keys j <= i + off

    # Key range: [0, hi) visible to some row, [0, full) to every row of the block, in bounds.
    if IS_CAUSAL:
        hi = gl.minimum(Lk, m0 + BLOCK_M + off)
        full = gl.maximum(gl.minimum(Lk, m0 + off + 1), 0)
    else:
        hi = Lk
        full = Lk
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)  # at least one (all masked: rows see nothing)
    n_full = full // BLOCK_N

    kv_bytes: gl.constexpr = KD.block_type.nbytes
    mbarrier.expect(q_bar, QD.block_type.nbytes)
    tma.async_copy_global_to_shared(QD, [b, h, m0, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        pred = i < n_blocks
        si = (it + i) % STAGES
        mbarrier.expect(k_bar.index(si), kv_bytes, pred=pred)
        tma.async_copy_global_to_shared(KD, [b, hkv, i * BLOCK_N, 0], k_bar.index(si), k_smem.index(si), pred=pred)
        mbarrier.expect(v_bar.index(si), kv_bytes, pred=pred)
        tma.async_copy_global_to_shared(VD, [b, hkv, i * BLOCK_N, 0], v_bar.index(si), v_smem.index(si), pred=pred)

    q2 = q_smem.reshape([BLOCK_M, HEAD_D])
    row = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    o = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # Step 0: S_0, its softmax; then K slot 0 takes K_STAGES.
    s0 = it % STAGES
    mbarrier.wait(q_bar, q_phase)
    mbarrier.wait(k_bar.index(s0), (it // STAGES) & 1)
    k2 = k_smem.index(s0).reshape([BLOCK_N, HEAD_D])
    s = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False)
    if n_full > 0:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, 0, row, Lk, off, qk_scale, False, IS_CAUSAL, BLOCK_N,
                                           s_layout)
    else:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, 0, row, Lk, off, qk_scale, True, IS_CAUSAL, BLOCK_N,
                                           s_layout)
    p_prev = gl.convert_layout(p.to(dtype), p_layout)
    gl.thread_barrier()
    nxt = STAGES < n_blocks
    mbarrier.expect(k_bar.index(s0), kv_bytes, pred=nxt)
    tma.async_copy_global_to_shared(KD, [b, hkv, STAGES * BLOCK_N, 0], k_bar.index(s0), k_smem.index(s0), pred=nxt)

    for j in range(1, n_blocks):
        slot = (it + j) % STAGES
        prev = (it + j - 1) % STAGES
        mbarrier.wait(k_bar.index(slot), ((it + j) // STAGES) & 1)
        mbarrier.wait(v_bar.index(prev), ((it + j - 1) // STAGES) & 1)
        k2 = k_smem.index(slot).reshape([BLOCK_N, HEAD_D])
        v2 = v_smem.index(prev).reshape([BLOCK_N, HEAD_D])
        # The last step's S registers are dead: S_j overwrites them (use_acc=False).
        s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        if j < n_full:
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, off, qk_scale, False,
                                               IS_CAUSAL, BLOCK_N, s_layout)
        else:
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, off, qk_scale, True,
                                               IS_CAUSAL, BLOCK_N, s_layout)
        o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        # Both warpgroups are past K_j and V_{j-1}: refill their slots with K_{j+STAGES} and
        # V_{j-1+STAGES}, needed a step from now.
        gl.thread_barrier()
        nk = j + STAGES
        pk = nk < n_blocks
        mbarrier.expect(k_bar.index(slot), kv_bytes, pred=pk)
        tma.async_copy_global_to_shared(KD, [b, hkv, nk * BLOCK_N, 0], k_bar.index(slot), k_smem.index(slot),
                                        pred=pk)
        nv = j - 1 + STAGES
        pv = nv < n_blocks
        mbarrier.expect(v_bar.index(prev), kv_bytes, pred=pv)
        tma.async_copy_global_to_shared(VD, [b, hkv, nv * BLOCK_N, 0], v_bar.index(prev), v_smem.index(prev),
                                        pred=pv)

    # The last block's PV product.
    last = it + n_blocks - 1
    mbarrier.wait(v_bar.index(last % STAGES), (last // STAGES) & 1)
    v2 = v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_D])
    o = warpgroup_mma(p_prev, v2, o)

    # Epilogue: O / l (0 where no key was visible), LSE = (m + log2 l) ln 2 (-inf there).
    empty = l_i == 0.0
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), orow_layout)
    o = o / gl.expand_dims(l_o, 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    lse_ptr = LSE + (b * Hq + h).to(gl.int64) * Lq + row
    gl.store(lse_ptr, lse, mask=row < Lq)
    # O leaves through Q's buffer (D256 has no room for its own), once no product reads Q.
    gl.thread_barrier()
    q_smem.reshape([BLOCK_M, HEAD_D]).store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(OD, [b, h, m0, 0], q_smem)
    tma.store_wait(pendings=0)
    return it + n_blocks


@gluon.jit
def _fwd_smem(QD, KD, VD, STAGES: gl.constexpr):
    """A program's shared memory: Q (then O), the K and V rings of ``STAGES`` slots; one mbarrier
    for Q and one per K and V slot, initialized."""
    dtype: gl.constexpr = QD.dtype
    q_smem = gl.allocate_shared_memory(dtype, QD.block_type.shape, QD.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + KD.block_type.shape, KD.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + VD.block_type.shape, VD.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()
    return q_smem, k_smem, v_smem, q_bar, k_bar, v_bar


@gluon.jit
def _fwd_smem_release(q_bar, k_bar, v_bar, STAGES: gl.constexpr):
    """The mbarriers of :func:`_fwd_smem` invalidated (the program's last tile is done)."""
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))


# Shape arguments are not specialized (as forward.py's): the compile check builds exactly
# what runs, whatever the head counts and lengths.
@gluon.jit(do_not_specialize=("Hq", "GROUP", "Lq", "Lk"))
def _attn_fwd_hopper(QD, KD, VD, OD, LSE, Hq, GROUP, Lq, Lk, qk_scale,
                     IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The single-partition forward (the module docstring's structure), one program a tile:
    ``QD``..``OD`` host-side (B, H, L, D) descriptors, ``LSE`` (B, Hq, Lq) fp32, ``qk_scale`` =
    scale * log2(e)."""
    n_m = gl.cdiv(Lq, BLOCK_M)
    pid = gl.program_id(0)
    mblk = n_m - 1 - pid % n_m
    bh = pid // n_m
    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar = _fwd_smem(QD, KD, VD, STAGES)
    _fwd_tile(QD, KD, VD, OD, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, bh // Hq, bh % Hq,
              (bh % Hq) // GROUP, mblk * BLOCK_M, Hq, Lq, Lk, qk_scale, 0, 0, IS_CAUSAL, num_warps)
    _fwd_smem_release(q_bar, k_bar, v_bar, STAGES)


@gluon.jit(do_not_specialize=("Hq", "GROUP", "Lq", "Lk", "BH", "SECTION"))
def _attn_fwd_hopper_persistent(QD, KD, VD, OD, LSE, Hq, GROUP, Lq, Lk, qk_scale, BH, SECTION,
                                IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                HEAD_D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """``_attn_fwd_hopper`` persistent (FA3's tile scheduler, static): a program per SM walks
    the tiles pid, pid + grid, ...; ``BH`` = batch x query heads. Tiles are ordered as FA3's
    ``DynamicPersistentTileScheduler`` orders them: sections of ``SECTION`` consecutive heads
    (as many as keep their K and V in L2, the last section narrower), and in a section the
    query blocks last to first (under a causal mask the heaviest first: longest processing
    time first), every head of the section at one block before the next block. Shared memory
    and mbarriers live across tiles: the rings' positions continue (``_fwd_tile``'s ``it``)."""
    n_m = gl.cdiv(Lq, BLOCK_M)
    n_tiles = n_m * BH
    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar = _fwd_smem(QD, KD, VD, STAGES)
    it = 0
    done = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        sec = tile // (SECTION * n_m)
        r = tile - sec * SECTION * n_m
        width = gl.minimum(SECTION, BH - sec * SECTION)
        blk = r // width
        bh = sec * SECTION + r - blk * width
        h = bh % Hq
        it = _fwd_tile(QD, KD, VD, OD, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, bh // Hq, h, h // GROUP,
                       (n_m - 1 - blk) * BLOCK_M, Hq, Lq, Lk, qk_scale, it, done & 1, IS_CAUSAL, num_warps)
        done += 1
        # Every warp is past this tile's reads of Q, K and V (and O's store left Q's buffer)
        # before the next tile's loads overwrite them.
        gl.thread_barrier()
    _fwd_smem_release(q_bar, k_bar, v_bar, STAGES)


# ---------------------------------------------------------------------------------------------
# warp-specialized variant: a TMA loader warp and two consumer warpgroups (FA3's partitions)
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _ws_consumer(q_s, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, OD, LSE, b, h, r0, Hq, Lq, Lk,
                 cdiag, n_blocks, n_full, qk_scale):
    """One consumer warpgroup: query rows [r0, r0 + 64) (Q in ``q_s``, then O out through it)
    against every key block the loader streams (both consumers take every block: each
    releases each slot). The step is the single-partition kernel's; a slot is released by an
    arrive on its empty barrier (count 2, one per consumer) instead of a CTA barrier, so the
    two warpgroups drift apart and one's softmax runs under the other's products. Partitions
    take no constexpr arguments: tile sizes come from the buffers' shapes, and the causal
    bound is ``cdiag`` (Lk - Lq; Lk without causality: every in-bounds key passes)."""
    HALF_M: gl.constexpr = q_s.shape[2]
    HEAD_D: gl.constexpr = q_s.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = OD.dtype
    s_layout: gl.constexpr = _mma_layout(HALF_M, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(HALF_M, HEAD_D, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    row = r0 + gl.arange(0, HALF_M, layout=row_layout)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
    o = gl.zeros([HALF_M, HEAD_D], gl.float32, layout=o_layout)
    s = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q2 = q_s.reshape([HALF_M, HEAD_D])

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    k2 = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
    s = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False)
    mbarrier.arrive(k_empty.index(0))
    if n_full > 0:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, 0, row, Lk, cdiag, qk_scale, False, True, BLOCK_N,
                                           s_layout)
    else:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, 0, row, Lk, cdiag, qk_scale, True, True, BLOCK_N,
                                           s_layout)
    p_prev = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        k2 = k_smem.index(slot).reshape([BLOCK_N, HEAD_D])
        v2 = v_smem.index(prev).reshape([BLOCK_N, HEAD_D])
        s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot))
        if j < n_full:
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, cdiag, qk_scale, False, True,
                                               BLOCK_N, s_layout)
        else:
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, cdiag, qk_scale, True, True,
                                               BLOCK_N, s_layout)
        o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(prev))
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)

    last = n_blocks - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    v2 = v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_D])
    o = warpgroup_mma(p_prev, v2, o)
    mbarrier.arrive(v_empty.index(last % STAGES))

    empty = l_i == 0.0
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), orow_layout)
    o = o / gl.expand_dims(l_o, 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    gl.store(LSE + (b * Hq + h).to(gl.int64) * Lq + row, lse, mask=row < Lq)
    q_s.reshape([HALF_M, HEAD_D]).store(o.to(dtype))  # its own products are done with Q
    fence_async_shared()
    tma.async_copy_shared_to_global(OD, [b, h, r0, 0], q_s)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_loader(QD, KD, VD, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, b, h, hkv, m0,
               n_blocks):
    """The TMA warp: each consumer's 64 rows of Q (``q_smem``'s leading dim: 2, or 3 in the
    ping-pong kernel's D64 form), then K_j and V_j into slot j % STAGES once every consumer
    released the slot's previous block (its empty barrier's previous phase)."""
    HALF_M: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    for i in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(i), QD.block_type.nbytes)
        tma.async_copy_global_to_shared(QD, [b, h, m0 + i * HALF_M, 0], q_bar.index(i), q_smem.index(i))
    kv_bytes: gl.constexpr = KD.block_type.nbytes
    for j in range(n_blocks):
        slot = j % STAGES
        # Round r = j // STAGES of a slot waits for every consumer's release of round r - 1.
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(KD, [b, hkv, j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase, pred=j >= STAGES)
        mbarrier.expect(v_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(VD, [b, hkv, j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit(do_not_specialize=("Hq", "GROUP", "Lq", "Lk"))
def _attn_fwd_hopper_ws(QD, KD, VD, OD, LSE, Hq, GROUP, Lq, Lk, qk_scale,
                        IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """``_attn_fwd_hopper`` with FA3's partitions: the default partition (4 warps) and a 4-warp
    worker are the two consumer warpgroups (64 query rows each, 240 registers asked), a 1-warp
    worker the TMA loader (24). Q and O descriptors have 64-row blocks."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = QD.dtype
    n_m = gl.cdiv(Lq, BLOCK_M)
    pid = gl.program_id(0)
    mblk = n_m - 1 - pid % n_m
    bh = pid // n_m
    b = bh // Hq
    h = bh % Hq
    hkv = h // GROUP
    m0 = mblk * BLOCK_M
    off = Lk - Lq
    if IS_CAUSAL:
        hi = gl.minimum(Lk, m0 + BLOCK_M + off)
        full = gl.maximum(gl.minimum(Lk, m0 + off + 1), 0)
        cdiag = off
    else:
        hi = Lk
        full = Lk
        cdiag = Lk
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
    n_full = full // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2] + QD.block_type.shape, QD.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + KD.block_type.shape, KD.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + VD.block_type.shape, VD.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_ws_consumer, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty,
                        v_empty, OD, LSE, b, h, m0, Hq, Lq, Lk, cdiag, n_blocks, n_full, qk_scale)),
        (_ws_consumer, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty,
                        v_empty, OD, LSE, b, h, m0 + HALF_M, Hq, Lq, Lk, cdiag, n_blocks, n_full, qk_scale)),
        (_ws_loader, (QD, KD, VD, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, b, h, hkv, m0,
                      n_blocks)),
    ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------------------
# ping-pong variant: FA3's schedule of the consumer warpgroups' products
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _pp_consumer(q_s, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, turn_next, OD, LSE, b, h, r0,
                 Hq, Lq, Lk, cdiag, n_blocks, n_full, qk_scale):
    """One consumer warpgroup of ``_attn_fwd_hopper_pp``: query rows [r0, r0 + 64), the
    warp-specialized consumer's step in FA3's order (``mainloop_fwd_sm90_tma_gmma_ws.hpp``,
    IntraWGOverlap) under FA3's warp-scheduler barriers: before issuing a step's products the
    warpgroup waits for its turn (``turn``, count 1: its k-th turn is phase k), and right
    after issuing them it hands the turn to the next consumer (an arrive on ``turn_next``),
    then waits for S and runs the softmax while the next warpgroup's products occupy the
    tensor cores. The products of a step: S_j = Q K_j^T, then O rescaled by step j-1's factor
    (O is no product's accumulator then), then O += P_{j-1} V_{j-1}. A consumer takes
    n_blocks + 1 turns (step 0's QK^T, steps 1..n-1, the last PV), every consumer the same
    number (one n_blocks for the CTA's rows), so the ring of turns closes."""
    HALF_M: gl.constexpr = q_s.shape[2]
    HEAD_D: gl.constexpr = q_s.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = OD.dtype
    s_layout: gl.constexpr = _mma_layout(HALF_M, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(HALF_M, HEAD_D, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    row = r0 + gl.arange(0, HALF_M, layout=row_layout)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
    o = gl.zeros([HALF_M, HEAD_D], gl.float32, layout=o_layout)
    s = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q2 = q_s.reshape([HALF_M, HEAD_D])

    # Turn 0: S_0 alone.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    k2 = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
    mbarrier.wait(turn, 0)
    s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.arrive(turn_next)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0))
    if n_full > 0:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, 0, row, Lk, cdiag, qk_scale, False, True, BLOCK_N,
                                           s_layout)
    else:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, 0, row, Lk, cdiag, qk_scale, True, True, BLOCK_N,
                                           s_layout)
    p_prev = gl.convert_layout(p.to(dtype), p_layout)

    # Turn j: S_j, O *= alpha_{j-1}, O += P_{j-1} V_{j-1}. (Step 0's alpha is 0 on O = 0.)
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        k2 = k_smem.index(slot).reshape([BLOCK_N, HEAD_D])
        v2 = v_smem.index(prev).reshape([BLOCK_N, HEAD_D])
        mbarrier.wait(turn, j & 1)
        s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False, is_async=True)
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
        mbarrier.arrive(turn_next)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot))
        if j < n_full:
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, cdiag, qk_scale, False, True,
                                               BLOCK_N, s_layout)
        else:
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, cdiag, qk_scale, True, True,
                                               BLOCK_N, s_layout)
        o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(prev))
        p_prev = gl.convert_layout(p.to(dtype), p_layout)

    # Turn n_blocks: the last block's PV product.
    last = n_blocks - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    v2 = v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_D])
    mbarrier.wait(turn, n_blocks & 1)
    o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
    mbarrier.arrive(turn_next)
    o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
    mbarrier.arrive(v_empty.index(last % STAGES))

    empty = l_i == 0.0
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), orow_layout)
    o = o / gl.expand_dims(l_o, 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    gl.store(LSE + (b * Hq + h).to(gl.int64) * Lq + row, lse, mask=row < Lq)
    q_s.reshape([HALF_M, HEAD_D]).store(o.to(dtype))  # its own products are done with Q
    fence_async_shared()
    tma.async_copy_shared_to_global(OD, [b, h, r0, 0], q_s)
    tma.store_wait(pendings=0)


@gluon.jit
def _pp_softmax(s, m_i, l_i, j, n_full, row, Lk, cdiag, qk_scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """:func:`_softmax_step` on key block ``j`` of a warp-specialized consumer: unmasked where
    every row sees the whole block (``j < n_full``), masked otherwise."""
    if j < n_full:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, cdiag, qk_scale, False, True, BLOCK_N,
                                           s_layout)
    else:
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, j * BLOCK_N, row, Lk, cdiag, qk_scale, True, True, BLOCK_N,
                                           s_layout)
    return m_i, alpha, p, l_i


@gluon.jit
def _pp_consumer_overlap(q_s, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, turn_next, OD, LSE, b,
                         h, r0, Hq, Lq, Lk, cdiag, n_blocks, n_full, qk_scale):
    """``_pp_consumer`` one score block deeper (``OVERLAP``): the softmax of S_{j-1} runs under
    both of the warpgroup's own products of turn j, S_j = Q K_j^T and O += P_{j-2} V_{j-2}
    (besides the other consumers' turns), where ``_pp_consumer`` waits for S_j before its
    softmax and overlaps only the PV product. Two S accumulators take turns (S_j is written
    while S_{j-1} is read); a turn still issues both products back to back. Turns: 0 S_0
    (waited at once: nothing to overlap yet), 1 S_1 (under the softmax of S_0), j = 2..n-1
    S_j and PV_{j-2}, n PV_{n-2} (under the softmax of S_{n-1}), n + 1 PV_{n-1}: n + 2 in all,
    2 for a single key block (S_0, PV_0); every consumer the same (one n_blocks a CTA)."""
    HALF_M: gl.constexpr = q_s.shape[2]
    HEAD_D: gl.constexpr = q_s.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    gl.static_assert(STAGES >= 2, "turn 1 reads K_1 from slot 1, its first fill")
    dtype: gl.constexpr = OD.dtype
    s_layout: gl.constexpr = _mma_layout(HALF_M, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(HALF_M, HEAD_D, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    row = r0 + gl.arange(0, HALF_M, layout=row_layout)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
    o = gl.zeros([HALF_M, HEAD_D], gl.float32, layout=o_layout)
    s_a = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    s_b = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q2 = q_s.reshape([HALF_M, HEAD_D])

    # Turn 0: S_0, waited at once.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    k2 = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
    mbarrier.wait(turn, 0)
    s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s_a, use_acc=False, is_async=True)
    mbarrier.arrive(turn_next)
    s_a = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0))
    if n_blocks > 1:
        # Turn 1: S_1 under the softmax of S_0 (O is 0: nothing to rescale). STAGES >= 2:
        # K_1 is slot 1's first fill.
        mbarrier.wait(k_ready.index(1), 0)
        k2 = k_smem.index(1).reshape([BLOCK_N, HEAD_D])
        mbarrier.wait(turn, 1)
        s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s_b, use_acc=False, is_async=True)
        mbarrier.arrive(turn_next)
        m_i, alpha, p, l_i = _pp_softmax(s_a, m_i, l_i, 0, n_full, row, Lk, cdiag, qk_scale, BLOCK_N, s_layout)
        s_b = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(1))
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        # Turn j: S_j into the buffer S_{j-2} left (s_a), O += P_{j-2} V_{j-2}; the softmax of
        # S_{j-1} (s_b) under both; then O *= alpha_{j-1} and the buffers swap.
        for j in range(2, n_blocks):
            slot = j % STAGES
            vs = (j - 2) % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(vs), ((j - 2) // STAGES) & 1)
            k2 = k_smem.index(slot).reshape([BLOCK_N, HEAD_D])
            v2 = v_smem.index(vs).reshape([BLOCK_N, HEAD_D])
            mbarrier.wait(turn, j & 1)
            s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s_a, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
            mbarrier.arrive(turn_next)
            m_i, alpha, p, l_i = _pp_softmax(s_b, m_i, l_i, j - 1, n_full, row, Lk, cdiag, qk_scale, BLOCK_N,
                                             s_layout)
            s_a, o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, o_tok, p_prev))
            mbarrier.arrive(k_empty.index(slot))
            mbarrier.arrive(v_empty.index(vs))
            o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
            p_prev = gl.convert_layout(p.to(dtype), p_layout)
            s_a, s_b = s_b, s_a
        # Turn n: PV_{n-2} under the softmax of S_{n-1}.
        vs = (n_blocks - 2) % STAGES
        mbarrier.wait(v_ready.index(vs), ((n_blocks - 2) // STAGES) & 1)
        v2 = v_smem.index(vs).reshape([BLOCK_N, HEAD_D])
        mbarrier.wait(turn, n_blocks & 1)
        o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
        mbarrier.arrive(turn_next)
        m_i, alpha, p, l_i = _pp_softmax(s_b, m_i, l_i, n_blocks - 1, n_full, row, Lk, cdiag, qk_scale, BLOCK_N,
                                         s_layout)
        o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(vs))
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        t_last = n_blocks + 1
    else:
        m_i, alpha, p, l_i = _pp_softmax(s_a, m_i, l_i, 0, n_full, row, Lk, cdiag, qk_scale, BLOCK_N, s_layout)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        t_last = 1

    # The last turn: PV_{n-1}.
    last = n_blocks - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    v2 = v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_D])
    mbarrier.wait(turn, t_last & 1)
    o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
    mbarrier.arrive(turn_next)
    o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
    mbarrier.arrive(v_empty.index(last % STAGES))

    empty = l_i == 0.0
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), orow_layout)
    o = o / gl.expand_dims(l_o, 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    gl.store(LSE + (b * Hq + h).to(gl.int64) * Lq + row, lse, mask=row < Lq)
    q_s.reshape([HALF_M, HEAD_D]).store(o.to(dtype))  # its own products are done with Q
    fence_async_shared()
    tma.async_copy_shared_to_global(OD, [b, h, r0, 0], q_s)
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=("Hq", "GROUP", "Lq", "Lk"))
def _attn_fwd_hopper_pp(QD, KD, VD, OD, LSE, Hq, GROUP, Lq, Lk, qk_scale,
                        IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                        OVERLAP: gl.constexpr = False):
    """``_attn_fwd_hopper_ws`` with FA3's ping-pong schedule: BLOCK_M // 64 consumer warpgroups
    (2, or 3 at D64 as FA3's 192-row tile) of 64 query rows each, the default partition (4
    warps) the first, and the TMA loader warp feeding one K/V ring that every consumer reads
    (a slot's empty barrier counts one arrive per consumer). The consumers issue their products
    in turn, consumer c after consumer c - 1 (mod their number), through one mbarrier each
    (``turn``; FA3 uses named barriers, which Gluon does not expose): consumer 0's barrier
    completes its first phase here, before the partitions start, so it goes first. Registers
    (``setmaxnreg``): two consumers 240 each and the loader 24 (FA3's); three: the workers 160
    and the loader 24 (FA3: 160, and 32 for its 4-warp producer), the default partition what
    is left (168: 128 x 168 + 2 x 128 x 160 + 128 x 24 = the register file's 64K, the loader
    warp's group counted whole)."""
    CONSUMERS: gl.constexpr = BLOCK_M // 64
    dtype: gl.constexpr = QD.dtype
    n_m = gl.cdiv(Lq, BLOCK_M)
    pid = gl.program_id(0)
    mblk = n_m - 1 - pid % n_m
    bh = pid // n_m
    b = bh // Hq
    h = bh % Hq
    hkv = h // GROUP
    m0 = mblk * BLOCK_M
    off = Lk - Lq
    if IS_CAUSAL:
        hi = gl.minimum(Lk, m0 + BLOCK_M + off)
        full = gl.maximum(gl.minimum(Lk, m0 + off + 1), 0)
        cdiag = off
    else:
        hi = Lk
        full = Lk
        cdiag = Lk
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
    n_full = full // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + QD.block_type.shape, QD.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + KD.block_type.shape, KD.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + VD.block_type.shape, VD.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    mbarrier.arrive(turn.index(0))  # consumer 0 takes the first turn

    if OVERLAP:  # the consumers one score block deeper (_pp_consumer_overlap), two or three
        if CONSUMERS == 3:
            gl.warp_specialize([
                (_pp_consumer_overlap, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty,
                                        v_empty, turn.index(0), turn.index(1), OD, LSE, b, h, m0, Hq, Lq, Lk, cdiag,
                                        n_blocks, n_full, qk_scale)),
                (_pp_consumer_overlap, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty,
                                        v_empty, turn.index(1), turn.index(2), OD, LSE, b, h, m0 + 64, Hq, Lq, Lk,
                                        cdiag, n_blocks, n_full, qk_scale)),
                (_pp_consumer_overlap, (q_smem.index(2), k_smem, v_smem, q_bar.index(2), k_ready, v_ready, k_empty,
                                        v_empty, turn.index(2), turn.index(0), OD, LSE, b, h, m0 + 128, Hq, Lq, Lk,
                                        cdiag, n_blocks, n_full, qk_scale)),
                (_ws_loader, (QD, KD, VD, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, b, h,
                              hkv, m0, n_blocks)),
            ], [4, 4, 1], [160, 160, 24])
        else:
            gl.warp_specialize([
                (_pp_consumer_overlap, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty,
                                        v_empty, turn.index(0), turn.index(1), OD, LSE, b, h, m0, Hq, Lq, Lk, cdiag,
                                        n_blocks, n_full, qk_scale)),
                (_pp_consumer_overlap, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty,
                                        v_empty, turn.index(1), turn.index(0), OD, LSE, b, h, m0 + 64, Hq, Lq, Lk,
                                        cdiag, n_blocks, n_full, qk_scale)),
                (_ws_loader, (QD, KD, VD, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, b, h,
                              hkv, m0, n_blocks)),
            ], [4, 1], [240, 24])
    elif CONSUMERS == 3:
        gl.warp_specialize([
            (_pp_consumer, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty, v_empty,
                            turn.index(0), turn.index(1), OD, LSE, b, h, m0, Hq, Lq, Lk, cdiag, n_blocks, n_full,
                            qk_scale)),
            (_pp_consumer, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty, v_empty,
                            turn.index(1), turn.index(2), OD, LSE, b, h, m0 + 64, Hq, Lq, Lk, cdiag, n_blocks,
                            n_full, qk_scale)),
            (_pp_consumer, (q_smem.index(2), k_smem, v_smem, q_bar.index(2), k_ready, v_ready, k_empty, v_empty,
                            turn.index(2), turn.index(0), OD, LSE, b, h, m0 + 128, Hq, Lq, Lk, cdiag, n_blocks,
                            n_full, qk_scale)),
            (_ws_loader, (QD, KD, VD, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, b, h, hkv,
                          m0, n_blocks)),
        ], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([
            (_pp_consumer, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty, v_empty,
                            turn.index(0), turn.index(1), OD, LSE, b, h, m0, Hq, Lq, Lk, cdiag, n_blocks, n_full,
                            qk_scale)),
            (_pp_consumer, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty, v_empty,
                            turn.index(1), turn.index(0), OD, LSE, b, h, m0 + 64, Hq, Lq, Lk, cdiag, n_blocks,
                            n_full, qk_scale)),
            (_ws_loader, (QD, KD, VD, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, b, h, hkv,
                          m0, n_blocks)),
        ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------------------
# the ping-pong kernel persistent: a program per SM, tiles in FA3's LPT order
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _pp_tile(tile, n_m, BH, SECTION, Hq, GROUP, Lk, cdiag, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile ``tile`` of ``_attn_fwd_hopper_pp_persistent``'s order (the persistent kernel's:
    sections of ``SECTION`` heads, in a section the query blocks last to first, every head of
    the section at one block before the next block): (b, h, hkv, m0, n_blocks, n_full). The
    key bounds as the ping-pong kernel's, ``cdiag`` Lk - Lq under causality and Lk without (then
    every in-bounds key is visible: the same formulas give Lk)."""
    sec = tile // (SECTION * n_m)
    r = tile - sec * SECTION * n_m
    width = gl.minimum(SECTION, BH - sec * SECTION)
    blk = r // width
    bh = sec * SECTION + r - blk * width
    h = bh % Hq
    m0 = (n_m - 1 - blk) * BLOCK_M
    hi = gl.minimum(Lk, m0 + BLOCK_M + cdiag)
    full = gl.maximum(gl.minimum(Lk, m0 + cdiag + 1), 0)
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
    return bh // Hq, h, h // GROUP, m0, n_blocks, full // BLOCK_N


@gluon.jit
def _ppp_consumer(q_s, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn, turn_next, OD, LSE,
                  ci, Hq, GROUP, Lq, Lk, cdiag, qk_scale, BH, SECTION):
    """Consumer ``ci`` (rows [m0 + 64 ci, m0 + 64 ci + 64) of each tile) of
    ``_attn_fwd_hopper_pp_persistent``: ``_pp_consumer``'s turns and step for every tile of the
    program, in the loader's order. What carries from tile to tile: the ring position ``it``
    (block j of a tile is position it + j: slot (it + j) % STAGES, phase ((it + j) // STAGES) & 1),
    the turn count ``t`` (a tile takes n_blocks + 1 turns: turn k of the tile is phase
    (t + k) & 1) and the tile count ``done`` (Q's barrier's phase). After its O left Q's buffer
    (the TMA store waited for), the consumer releases the buffer to the loader (``q_empty``)."""
    HALF_M: gl.constexpr = q_s.shape[3]
    HEAD_D: gl.constexpr = q_s.shape[4]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    CONSUMERS: gl.constexpr = q_bar.shape[0]
    dtype: gl.constexpr = OD.dtype
    s_layout: gl.constexpr = _mma_layout(HALF_M, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(HALF_M, HEAD_D, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q2 = q_s.index(ci).reshape([HALF_M, HEAD_D])
    n_m = gl.cdiv(Lq, CONSUMERS * HALF_M)
    it = 0
    t = 0
    done = 0
    for tile in range(gl.program_id(0), n_m * BH, gl.num_programs(0)):
        b, h, hkv, m0, n_blocks, n_full = _pp_tile(tile, n_m, BH, SECTION, Hq, GROUP, Lk, cdiag, CONSUMERS * HALF_M,
                                                   BLOCK_N)
        r0 = m0 + ci * HALF_M
        row = r0 + gl.arange(0, HALF_M, layout=row_layout)
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
        o = gl.zeros([HALF_M, HEAD_D], gl.float32, layout=o_layout)
        s = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)

        # Turn 0: S_0 alone.
        s0 = it % STAGES
        mbarrier.wait(q_bar.index(ci), done & 1)
        mbarrier.wait(k_ready.index(s0), (it // STAGES) & 1)
        k2 = k_smem.index(s0).reshape([BLOCK_N, HEAD_D])
        mbarrier.wait(turn, t & 1)
        s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False, is_async=True)
        mbarrier.arrive(turn_next)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(s0))
        m_i, alpha, p, l_i = _pp_softmax(s, m_i, l_i, 0, n_full, row, Lk, cdiag, qk_scale, BLOCK_N, s_layout)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)

        # Turn j: S_j, O *= alpha_{j-1}, O += P_{j-1} V_{j-1}.
        for j in range(1, n_blocks):
            slot = (it + j) % STAGES
            prev = (it + j - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), ((it + j) // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
            k2 = k_smem.index(slot).reshape([BLOCK_N, HEAD_D])
            v2 = v_smem.index(prev).reshape([BLOCK_N, HEAD_D])
            mbarrier.wait(turn, (t + j) & 1)
            s_tok = warpgroup_mma(q2, k2.permute((1, 0)), s, use_acc=False, is_async=True)
            o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
            o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
            mbarrier.arrive(turn_next)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(slot))
            m_i, alpha, p, l_i = _pp_softmax(s, m_i, l_i, j, n_full, row, Lk, cdiag, qk_scale, BLOCK_N, s_layout)
            o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
            mbarrier.arrive(v_empty.index(prev))
            p_prev = gl.convert_layout(p.to(dtype), p_layout)

        # Turn n_blocks: the last block's PV product.
        last = (it + n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((it + n_blocks - 1) // STAGES) & 1)
        v2 = v_smem.index(last).reshape([BLOCK_N, HEAD_D])
        mbarrier.wait(turn, (t + n_blocks) & 1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        o_tok = warpgroup_mma(p_prev, v2, o, is_async=True)
        mbarrier.arrive(turn_next)
        o, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(last))

        empty = l_i == 0.0
        l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), orow_layout)
        o = o / gl.expand_dims(l_o, 1)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        gl.store(LSE + (b * Hq + h).to(gl.int64) * Lq + row, lse, mask=row < Lq)
        q2.store(o.to(dtype))  # its own products are done with Q
        fence_async_shared()
        tma.async_copy_shared_to_global(OD, [b, h, r0, 0], q_s.index(ci))
        tma.store_wait(pendings=0)
        mbarrier.arrive(q_empty.index(ci))  # O left the buffer: the loader may fill the next Q
        it += n_blocks
        t += n_blocks + 1
        done += 1


@gluon.jit
def _ppp_load_kv(KD, VD, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hkv, it, j0, j1):
    """K_j and V_j, j in [j0, j1), of a tile whose block 0 is ring position ``it``: position p
    waits for the consumers' release of position p - STAGES (the slot's empty barrier's phase
    ((p // STAGES) & 1) ^ 1)."""
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    kv_bytes: gl.constexpr = KD.block_type.nbytes
    for j in range(j0, j1):
        pos = it + j
        slot = pos % STAGES
        phase = ((pos // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase, pred=pos >= STAGES)
        mbarrier.expect(k_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(KD, [b, hkv, j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase, pred=pos >= STAGES)
        mbarrier.expect(v_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(VD, [b, hkv, j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ppp_loader(QD, KD, VD, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, Hq, GROUP,
                Lq, Lk, cdiag, BH, SECTION):
    """The TMA warp of ``_attn_fwd_hopper_pp_persistent``: ``_ws_loader`` for every tile of the
    program in the consumers' order, the ring position ``it`` continuing from tile to tile. A
    tile's first STAGES key blocks go first: their slots wait only for the tile before's
    releases, so they stream in under that tile's last steps and epilogue; then each
    consumer's Q tile, once the consumer released its buffer (``q_empty``: O of the tile before
    left it; the k-th tile waits for phase (k - 1) & 1); then the rest of the key blocks (their
    slots wait for this tile's consumers, who need their Q)."""
    HALF_M: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = k_smem.shape[0]
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    n_m = gl.cdiv(Lq, CONSUMERS * HALF_M)
    it = 0
    done = 0
    for tile in range(gl.program_id(0), n_m * BH, gl.num_programs(0)):
        b, h, hkv, m0, n_blocks, n_full = _pp_tile(tile, n_m, BH, SECTION, Hq, GROUP, Lk, cdiag, CONSUMERS * HALF_M,
                                                   BLOCK_N)
        first = gl.minimum(n_blocks, STAGES)
        _ppp_load_kv(KD, VD, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hkv, it, 0, first)
        for i in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(i), (done - 1) & 1, pred=done > 0)
            mbarrier.expect(q_bar.index(i), QD.block_type.nbytes)
            tma.async_copy_global_to_shared(QD, [b, h, m0 + i * HALF_M, 0], q_bar.index(i), q_smem.index(i))
        _ppp_load_kv(KD, VD, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hkv, it, first, n_blocks)
        it += n_blocks
        done += 1


@gluon.jit(do_not_specialize=("Hq", "GROUP", "Lq", "Lk", "BH", "SECTION"))
def _attn_fwd_hopper_pp_persistent(QD, KD, VD, OD, LSE, Hq, GROUP, Lq, Lk, qk_scale, BH, SECTION,
                                   IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                   HEAD_D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """``_attn_fwd_hopper_pp`` persistent: a program per SM (at most one per tile), each
    partition walking the program's tiles pid, pid + grid, ... in the persistent kernel's
    order (FA3's LPT order, L2 sections of ``SECTION`` heads; ``BH`` = batch x query heads).
    Shared memory and mbarriers live across tiles: the K/V ring's positions, the turns and
    Q's phases continue (``_ppp_consumer``, ``_ppp_loader``); a consumer's Q buffer, which O
    leaves through, is handed back to the loader by one more mbarrier per consumer
    (``q_empty``), so the next tile's K and V stream in under the current tile's last steps
    and epilogue. Partitions and registers as the ping-pong kernel's."""
    CONSUMERS: gl.constexpr = BLOCK_M // 64
    dtype: gl.constexpr = QD.dtype
    if IS_CAUSAL:
        cdiag = Lk - Lq
    else:
        cdiag = Lk
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + QD.block_type.shape, QD.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + KD.block_type.shape, KD.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + VD.block_type.shape, VD.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    mbarrier.arrive(turn.index(0))  # consumer 0 takes the first turn

    if CONSUMERS == 3:
        gl.warp_specialize([
            (_ppp_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn.index(0), turn.index(1), OD, LSE, 0, Hq, GROUP, Lq, Lk, cdiag, qk_scale, BH,
                             SECTION)),
            (_ppp_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn.index(1), turn.index(2), OD, LSE, 1, Hq, GROUP, Lq, Lk, cdiag, qk_scale, BH,
                             SECTION)),
            (_ppp_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn.index(2), turn.index(0), OD, LSE, 2, Hq, GROUP, Lq, Lk, cdiag, qk_scale, BH,
                             SECTION)),
            (_ppp_loader, (QD, KD, VD, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                           Hq, GROUP, Lq, Lk, cdiag, BH, SECTION)),
        ], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([
            (_ppp_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn.index(0), turn.index(1), OD, LSE, 0, Hq, GROUP, Lq, Lk, cdiag, qk_scale, BH,
                             SECTION)),
            (_ppp_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn.index(1), turn.index(0), OD, LSE, 1, Hq, GROUP, Lq, Lk, cdiag, qk_scale, BH,
                             SECTION)),
            (_ppp_loader, (QD, KD, VD, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                           Hq, GROUP, Lq, Lk, cdiag, BH, SECTION)),
        ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

def _layout(rows: int, d: int, dtype):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], dtype)


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def supports(q, *, arch: int, dropout_p: float, key_padding_mask, window, varlen, softcap, sinks, alibi, bias,
             mask, aligned: bool) -> bool:
    """Whether this kernel takes the call (``launchers.forward``'s arguments; the rest run
    ``forward.py``): sm_90, 16-bit, D in :data:`PADDED`, causal or not (+ GQA), TMA-able
    layouts (``aligned``), no other feature."""
    return (arch == 90 and q.dtype in DTYPES and q.shape[3] in PADDED and aligned and dropout_p == 0.0
            and key_padding_mask is None and tuple(window) == (-1, -1) and varlen is None and not softcap
            and sinks is None and alibi is None and bias is None and mask is None)


def forward(q, k, v, out, lse, causal: bool, scale: float, strides) -> None:
    """Writes ``out`` and ``lse`` (as ``launchers.forward``) for a call :func:`supports` took:
    ``strides`` are the launchers' ``_strides`` of q, k, v and out."""
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    launch = (q, k, v, out, lse, bool(causal), float(scale) * _LOG2E, strides)
    # The tile count's bucket: whether a program per tile or per SM wins depends on it.
    key = (D, WS, PERSISTENT, PINGPONG, PP_OVERLAP, PP_PERSISTENT, bool(causal), _bucket(Lq), _bucket(Lk),
           _bucket(B * Hq * common.cdiv(Lq, BLOCK_M)))
    if PINGPONG:
        cands = _PP_CANDIDATES[PADDED[D]]
        if PP_OVERLAP:
            cands = [c for c in cands if c["OVERLAP"]]
        elif PP_PERSISTENT:
            cands = [c for c in cands if c["PERSISTENT"]]
    else:
        cands = _CANDIDATES[PADDED[D], WS]
        if PERSISTENT and not WS:
            cands = [c for c in cands if c["PERSISTENT"]]
    cfg = _CACHE.get(key, cands, lambda c: _launch(c, launch))
    _launch(cfg, launch)


def _launch(cfg, launch) -> None:
    q, k, v, out, lse, causal, qk_scale, strides = launch
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    head_d = PADDED[D]  # blocks HEAD_D wide over the D-wide tensors (zeros past D)
    block_m, block_n, ws = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["WS"]
    q_rows = 64 if ws else block_m  # the WS kernels' consumers load and store 64 rows each
    gdt = _GL_DTYPES[q.dtype]
    descs = []
    for t, s, rows in ((q, strides[0], q_rows), (k, strides[1], block_n), (v, strides[2], block_n),
                       (out, strides[3], q_rows)):
        descs.append(TensorDescriptor(t, list(t.shape), [*s, 1], [1, 1, rows, head_d], _layout(rows, head_d, gdt)))
    tiles = common.cdiv(Lq, block_m) * B * Hq
    args = (*descs, lse, Hq, Hq // Hkv, Lq, Lk, qk_scale)
    if cfg["PERSISTENT"]:
        kernel = _attn_fwd_hopper_pp_persistent if cfg["PINGPONG"] else _attn_fwd_hopper_persistent
        grid = (min(tiles, common.sm_count(q.device)),)
        args += (B * Hq, _section(Lk, head_d, q.element_size(), Hq // Hkv))
    elif cfg["PINGPONG"]:
        kernel, grid = _attn_fwd_hopper_pp, (tiles,)
    else:
        kernel, grid = (_attn_fwd_hopper_ws if ws else _attn_fwd_hopper), (tiles,)
    common.count_launch("attention_fwd_hopper")
    if common.STUB_LAUNCHES:
        return
    if cfg["PINGPONG"] and not cfg["PERSISTENT"]:
        kernel[grid](*args, IS_CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=head_d,
                     STAGES=cfg["STAGES"], num_warps=cfg.num_warps, OVERLAP=cfg["OVERLAP"])
        return
    kernel[grid](*args, IS_CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=head_d, STAGES=cfg["STAGES"],
                 num_warps=cfg.num_warps)


def _section(Lk: int, head_d: int, elem: int, group: int) -> int:
    """Heads per L2 section of the persistent kernel (FA3's ``DynamicPersistentTileScheduler``):
    the largest power of two of KV heads whose K and V fit :data:`L2_KV_BYTES` (at least one),
    times the query heads per KV head."""
    kv_head = Lk * 2 * head_d * elem
    return (1 << (max(L2_KV_BYTES // kv_head, 1).bit_length() - 1)) * group


def aot_spec_args(dtype: str, head_d: int, causal: bool, block_n: int, stages: int, ws: bool = False,
                  persistent: bool = False, block_m: int = BLOCK_M, overlap=None) -> tuple:
    """(signature, constexprs) of one compiled variant, for ``specs.aot_specs`` (``ws`` for both
    warp-specialized kernels; ``block_m`` the ping-pong kernel's 128 or 192 rows, ``overlap``
    its ``OVERLAP``: False or True for the ping-pong kernel, None for the others)."""
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype]
    q_rows = 64 if ws else block_m
    sig = {}
    for name, rows in (("QD", q_rows), ("KD", block_n), ("VD", block_n), ("OD", q_rows)):
        sig[name] = f"tensordesc<{dtype}[1, 1, {rows}, {head_d}],{_layout(rows, head_d, gdt)!r}>"
    sig.update(LSE="*fp32", Hq="i32", GROUP="i32", Lq="i32", Lk="i32", qk_scale="fp32")
    if persistent:
        sig.update(BH="i32", SECTION="i32")
    constexprs = dict(IS_CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=head_d, STAGES=stages,
                      num_warps=4 if ws else NUM_WARPS)
    if overlap is not None:
        constexprs["OVERLAP"] = bool(overlap)
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, constexprs
