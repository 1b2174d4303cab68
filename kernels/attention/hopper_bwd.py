"""Opt-in Hopper attention backward in Gluon (``triton.experimental.gluon``) with
FlashAttention-3's structure: one program per key block, dK and dV accumulated in registers by
wgmma, Q, dO and the row statistics streamed through a TMA ring, and dQ reduce-added in fp32
global memory by TMA bulk reduce-adds (``cp.reduce.async.bulk.tensor.add``), converted to q's
dtype by the atomic backward's small kernel (``backward_atomic._dq_convert``).

``_attn_bwd_hopper`` runs in one partition; ``_attn_bwd_hopper_ws`` (D64) has FA3's partitions
(a TMA loader warp, two MMA warpgroups, a dQ writer warp; its docstring);
``_attn_bwd_hopper_persistent`` (D64) runs the first's tile (``_bwd_tile``) for tile after
tile of a program per SM, key blocks heaviest first (its docstring).

Taken only when ``FUSED_BLOCK_HOPPER_ATTN_BWD=1`` (the single-partition kernel, its persistent
form a timed candidate), ``=ws`` (the warp-specialized one at D64, the single-partition one at
D128) or ``=persistent`` (the persistent form at D64, the single-partition kernel at D128) is
set, never while ``torch.are_deterministic_algorithms_enabled()`` (the reduce-adds land in a
different order from run to run, so dQ's last bits vary), on sm_90 CUDA, for the cases
:func:`supports` names: 16-bit q/k/v, head dim 64, 128 or 256, or 96 and 192 (the 128 and 256
kernels on zero columns: :data:`PADDED`), causal (bottom-right, as the other kernels) or not, GQA/MQA,
TMA-able layouts, with the LSE's gradient or sinks (both live in the row statistics of
``_attn_bwd_preprocess``, which this backward shares). Dropout, padding masks, windows, varlen,
softcap, ALiBi, biases and bool masks, and every call without the switch, run the atomic-free
backward (``backward.py``), which stays the default, the deterministic path and the
interpreter's (the interpreter cannot run Gluon). This kernel has not yet run on a GPU:
``docs/attention-hopper.md`` says how to check it; it stays opt-in until a committed GPU run
of ``tests/test_attention_hopper_bwd.py`` and ``bench/attention_dq_atomic.py`` verifies it.
Its numerics and schedule have a float64 CPU twin in the tests (line for line).

Structure of ``_attn_bwd_hopper`` (one program per (key block of BLOCK_N = 128 keys, 64 at
D256, batch, kv head); key blocks in order: under a causal mask the first see the most
queries, so the heaviest start first):

- 8 warps = two warpgroups; the products with the keys as rows (S^T, dP^T, dV, dK: 128 rows)
  split the key rows between them (64 each, FA3's "SdP_swapAB"), dK and dV (128 x D fp32) stay
  in their registers for the whole program, dQ's product (BLOCK_M x D) splits its rows
  (128 query rows a step: D64's first tile) or its columns (64 rows: FA3's D128 tile). At
  D256 (64 keys, 64 query rows) every product splits its columns between the warpgroups.
- K and V are loaded once by TMA; Q, dO and the statistics rows (LSE * log2 e, delta) of each
  (group head, query block) step through a ring of ``STAGES`` shared-memory slots with one
  mbarrier per slot, refilled by TMA as soon as the step that read a slot finished, so the
  next ``STAGES - 1`` steps' loads are in flight during a step.
- A step: S^T = K Q^T and dP^T = V dO^T issued together (asynchronous wgmma), their
  accumulators starting at -LSE / (scale log2 e) and -delta (no statistics registers beside
  the tiles); P^T = exp2(S^T * scale * log2 e) (the causal mask only on blocks that straddle
  the diagonal) while dP^T runs; dV += P^T dO from registers (asynchronous) while dS^T =
  P^T (dP^T - delta) is formed; dS^T goes to shared memory, the operand of dK += dS^T Q and of
  dQ_part = dS K; dQ_part leaves through shared memory (two buffers) and a TMA reduce-add into
  the (B, Hq, Lq, D) fp32 accumulator, whose completion is awaited only before its buffer is
  written again, two steps later.
- Rows past Lq read as zero (TMA) with LSE = +inf in the statistics (P = 0); keys past Lk are
  zero rows of K and V (their dK, dV rows are clipped on store, their dQ part is zero).
- The epilogue writes dK * scale and dV through the K and V tiles' shared memory and TMA
  stores (rows past Lk clipped).

Descriptors are host-side, over the whole (B, H, L, D) views, and over the statistics as
(B * Hq + 1, 2, stride_stat): any strides TMA accepts work without a copy.

Not (yet) in it, compared with FA3's backward: warp specialization at D128 (the MMA
warpgroups' 240 registers do not hold its tiles here: it spilled) and FA3's tile at D64 in the
warp-specialized kernel (64 query rows a step, not 128), the persistent form at D128 (it
spilled in the step loop), dQ tiles of 80 rows at D128 (Gluon tiles are powers of two), a
ring of two stages at D256 (two stages of 64 query rows, K, V and a dQ tile exceed 227 KB of
shared memory: one stage, :data:`TILE_N`), and the score features above.
"""
import os

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fused_block.kernels import common
from fused_block.kernels.attention.backward_atomic import CONVERT_BLOCK_M, _dq_convert
from fused_block.kernels.attention.configs import _bucket

ENV = "FUSED_BLOCK_HOPPER_ATTN_BWD"
# The head dims the kernels are compiled for (HEAD_D)...
HEAD_DIMS = (64, 128, 256)
# ...and the head dims they take, each with the kernel's: 96 and 192 run the 128 and 256
# kernels with the columns past D zero (as the forward's ``hopper.PADDED``: the descriptors'
# blocks are HEAD_D wide over D-wide tensors, TMA reads zeros there and clips the stores and
# reduce-adds), which add nothing to any product; the dQ accumulator stays D wide.
PADDED = {64: 64, 96: 128, 128: 128, 192: 256, 256: 256}
DTYPES = (torch.float16, torch.bfloat16)
NUM_WARPS = 8
# Per head dim, the key block (BLOCK_N keys a program) and the dQ tiles in shared memory
# (DQ_BUFS: a step's reduce-add awaited DQ_BUFS - 1 steps later). D256 (FA3's 64 x 64 tile):
# K + V 64 KB, a ring stage of Q + dO 64 KB, a 64 x 256 fp32 dQ tile 64 KB, dS^T 8 KB: one
# stage and one dQ tile (209 KB) fit in 227 KB, two stages (275 KB) or two dQ tiles do not;
# registers: dK + dV 128 a thread, S^T + dP^T 32, the dQ tile 64 (250 used, no spill).
TILE_N = {64: (128, 2), 128: (128, 2), 256: (64, 1)}
# Per head dim, the candidates (BLOCK_M query rows a step, STAGES ring slots), timed once per
# key on the GPU (``ConfigCache``; the first with FUSED_BLOCK_TUNE=0). FA3's tiles: 128 x 128
# at D64, 64 x 128 at D128 (80 x 128 non-causal: not a power of two), Q and dO double
# buffered. Shared memory, 16-bit: K + V + STAGES x (Q + dO) + dS^T + DQ_BUFS fp32 dQ tiles.
# D256: 64 x 64, one stage (:data:`TILE_N`: no step's loads overlap the step before).
CONFIGS = {64: ((128, 2), (64, 3)), 128: ((64, 2), ), 256: ((64, 1), )}
# The persistent form (``_attn_bwd_hopper_persistent``: a program per SM, key blocks heaviest
# first), on the head dim's first tile: last among the candidates, so it is taken only where
# the GPU timed it faster (or with FUSED_BLOCK_HOPPER_ATTN_BWD=persistent). D64 only: at D128
# the tile loop around the step loop spilled 184-224 bytes in the step loop (255 registers,
# ptxas, whatever the walk's form: the one-program-a-tile build has no register to spare
# either), so D128 runs the one-program-a-tile kernel under the "persistent" switch.
PERSISTENT_CONFIGS = {64: ((128, 2), )}
_CANDIDATES = {d: [common.Config.of(num_warps=NUM_WARPS, BLOCK_M=m, STAGES=st, WS=False, PERSISTENT=persistent)
                   for table, persistent in ((CONFIGS, False), (PERSISTENT_CONFIGS, True))
                   for m, st in table.get(d, ())]
               for d in HEAD_DIMS}
_CACHE = common.ConfigCache("attention_bwd_hopper")
_LOG2E = 1.4426950408889634

# The warp-specialized variant's (``_attn_bwd_hopper_ws``), D64 only: its MMA warpgroups get
# 240 registers (the register file's share beside the loader and dQ warps), where D64 at 64
# query rows a step fits without spills; D128 (dK and dV alone take 128 of them) spilled at
# 32 rows too, and runs the single-partition kernel under the "ws" switch.
WS_CONFIGS = {64: ((64, 2), (64, 3))}
_WS_CANDIDATES = {d: [common.Config.of(num_warps=4, BLOCK_M=m, STAGES=st, WS=True, PERSISTENT=False) for m, st in c]
                  for d, c in WS_CONFIGS.items()}

# The persistent form's L2 sections: as many kv heads a section as keep their query heads' Q and
# dO (the operands every key block of the head streams) in L2, at most this much.
L2_QDO_BYTES = 32 << 20

# The opt-in switch, read once at import (no environment lookup per call; tests set these):
# "1" the single-partition kernel (its persistent form a timed candidate), "ws" the
# warp-specialized one, "persistent" the single-partition kernel in its persistent form only
# (where it has configs: D64; D128 runs the one-program-a-tile kernel).
ENABLED = os.environ.get(ENV, "0") in ("1", "ws", "persistent")
WS = os.environ.get(ENV, "0") == "ws"
PERSISTENT = os.environ.get(ENV, "0") == "persistent"


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``tensor_desc``'s block at ``coord`` += the shared-memory tile ``src`` (a TMA bulk
    reduce-add, ``cp.reduce.async.bulk.tensor ... .add``; completion as a TMA store's:
    ``tma.store_wait``). Triton 3.6's Gluon builds the op but does not export a wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    """The wgmma accumulator layout of a (block_m, block_n) tile: warpgroups stacked along M
    where there are 64 rows per warpgroup, else side by side along N."""
    warps_m = min(num_warps, block_m // 16)
    warps_n = num_warps // warps_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n],
                                     instr_shape=[16, block_n // warps_n, 16])


@gluon.jit
def _step(k2, v2, q2, do2, st, ds_smem, dq_smem, DQD, dk, dv, b, h, n0, start_m, off, qk_scale,
          MASKED: gl.constexpr, s_layout: gl.constexpr, dkv_layout: gl.constexpr, dq_layout: gl.constexpr):
    """One (head, query block) step on the key block [n0, n0 + BLOCK_N): dK, dV (returned)
    and the block's dQ part reduce-added into ``DQD`` from ``dq_smem`` (a free buffer: the
    caller waited). ``st``: the block's statistics rows in shared memory (LSE * log2 e, delta).
    ``MASKED``: the block straddles the causal diagonal (key j visible to query i iff
    j <= i + off)."""
    BLOCK_N: gl.constexpr = k2.shape[0]
    BLOCK_M: gl.constexpr = q2.shape[0]
    dtype: gl.constexpr = q2.dtype
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dkv_layout, k_width=2)
    HEAD_D: gl.constexpr = k2.shape[1]
    # The statistics as rows of the plain row-major tile (the descriptor's layout has no
    # swizzle): each thread reads its own columns. They enter the products' accumulators
    # (S^T starts at -LSE / (scale log2 e), dP^T at -delta), so that no statistics registers
    # stay live beside the tiles: the dK and dV accumulators leave little room.
    st1 = st._reinterpret(gl.float32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    # LSE = +inf (P = 0: padding rows, rows with no visible key) enters as -1e20 / (scale
    # log2 e): P is still exp2(-1e20) = 0, and no infinity meets the tensor cores.
    lse2 = gl.minimum(st1.index(0).load(col_layout), 1e20)
    s_acc = zero - gl.expand_dims(lse2 / qk_scale, 0)
    s_tok = warpgroup_mma(k2, q2.permute((1, 0)), s_acc, is_async=True)
    dp_acc = zero - gl.expand_dims(st1.index(1).load(col_layout), 0)
    dp_tok = warpgroup_mma(v2, do2.permute((1, 0)), dp_acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    p = gl.exp2(s * qk_scale)  # exp2(S^T scale log2 e - LSE log2 e)
    if MASKED:
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        cols = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        p = gl.where(gl.expand_dims(rows, 1) <= gl.expand_dims(cols + off, 0), p, 0.0)
    # P's softmax runs under dP^T's product, dV's product under dS's arithmetic.
    p16 = gl.convert_layout(p.to(dtype), op_layout)
    dv_tok = warpgroup_mma(p16, do2, dv, is_async=True)
    dpd = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, ))  # dP^T - delta
    ds = (p * dpd).to(dtype)
    ds_smem.store(ds)
    fence_async_shared()
    gl.thread_barrier()  # every thread's rows of dS^T are in shared memory
    # dK's operand dS^T from shared memory too (each warpgroup reads its own key rows; in
    # registers it would cost the ones the tiles lack), dQ's all of it, transposed.
    dk_tok = warpgroup_mma(ds_smem, q2, dk, is_async=True)
    dq_acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=dq_layout)
    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k2, dq_acc, use_acc=False, is_async=True)
    dv, dk, dq, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, p16))
    dq_smem.store(dq)
    fence_async_shared()
    gl.thread_barrier()  # every thread's dQ rows stored (and every read of the ring slot done)
    _tma_reduce_add(DQD, [b, h, start_m, 0], dq_smem.reshape(DQD.block_type.shape))
    return dk, dv


@gluon.jit
def _bwd_smem(QD, KD, VD, DOD, SD, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, DQ_BUFS: gl.constexpr):
    """A program's shared memory: K, V, the ring of ``STAGES`` (Q, dO, statistics) slots, dS^T,
    the ``DQ_BUFS`` fp32 dQ tiles; one mbarrier for K + V and one per ring slot, initialized."""
    dtype: gl.constexpr = QD.dtype
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    k_smem = gl.allocate_shared_memory(dtype, KD.block_type.shape, KD.layout)
    v_smem = gl.allocate_shared_memory(dtype, VD.block_type.shape, VD.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + QD.block_type.shape, QD.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + DOD.block_type.shape, DOD.layout)
    st_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + SD.block_type.shape, SD.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, HEAD_D], dq_smem_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    return k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, dq_smem, kv_bar, bars


@gluon.jit
def _bwd_tile(QD, KD, VD, DOD, DQD, DKD, DVD, SD, k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, dq_smem, kv_bar,
              bars, b, hkv, nblk, Hq, GROUP, Lq, cdiag, qk_scale, scale, it, kv_phase, num_warps: gl.constexpr):
    """One tile: the key block ``nblk`` of (batch ``b``, kv head ``hkv``), its dK and dV stored.
    ``it``: the ring's position (steps of earlier tiles of the program: slot and mbarrier phase
    continue from there), ``kv_phase``: the K + V mbarrier's phase; returns the position after
    the tile. Every load the tile issues it consumes, and its last TMA store is awaited: the
    ring is empty and the dQ buffers free when it returns."""
    dtype: gl.constexpr = QD.dtype
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    HEAD_D: gl.constexpr = k_smem.shape[3]
    STAGES: gl.constexpr = q_smem.shape[0]
    DQ_BUFS: gl.constexpr = dq_smem.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)
    dkv_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_D, num_warps)
    dq_layout: gl.constexpr = _mma_layout(BLOCK_M, HEAD_D, num_warps)
    n0 = nblk * BLOCK_N

    # Query blocks: [m_first, m_end) see some key of the block; from m_full on, every one.
    m_end = gl.cdiv(Lq, BLOCK_M) * BLOCK_M
    m_first = gl.maximum(n0 - cdiag, 0) // BLOCK_M * BLOCK_M
    m_full = n0 + BLOCK_N - 1 - cdiag  # a block starting at or past this row is unmasked
    n_m = (m_end - m_first) // BLOCK_M
    n_steps = GROUP * n_m  # (group head, query block) pairs, head-major
    h0 = hkv * GROUP

    mbarrier.expect(kv_bar, 2 * KD.block_type.nbytes)
    tma.async_copy_global_to_shared(KD, [b, hkv, n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(VD, [b, hkv, n0, 0], kv_bar, v_smem)
    step_bytes: gl.constexpr = QD.block_type.nbytes + DOD.block_type.nbytes + SD.block_type.nbytes
    for i in gl.static_range(STAGES):
        pred = i < n_steps
        g = i // n_m
        sm = m_first + (i - g * n_m) * BLOCK_M
        j = (it + i) % STAGES
        mbarrier.expect(bars.index(j), step_bytes, pred=pred)
        tma.async_copy_global_to_shared(QD, [b, h0 + g, sm, 0], bars.index(j), q_smem.index(j), pred=pred)
        tma.async_copy_global_to_shared(DOD, [b, h0 + g, sm, 0], bars.index(j), do_smem.index(j), pred=pred)
        tma.async_copy_global_to_shared(SD, [b * Hq + h0 + g, 0, sm], bars.index(j), st_smem.index(j), pred=pred)

    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=dkv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=dkv_layout)
    k2 = k_smem.reshape([BLOCK_N, HEAD_D])
    v2 = v_smem.reshape([BLOCK_N, HEAD_D])
    mbarrier.wait(kv_bar, kv_phase)

    # The step's (head, query block) and the refill's, STAGES steps ahead, advanced by
    # counters (no division per step): the block moves on and past m_end wraps to the next head.
    h = h0
    start_m = m_first
    h_nx = h0 + STAGES // n_m
    m_nx = m_first + STAGES % n_m * BLOCK_M
    for i in range(n_steps):
        slot = (it + i) % STAGES
        mbarrier.wait(bars.index(slot), ((it + i) // STAGES) & 1)
        q2 = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
        do2 = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])
        st = st_smem.index(slot).reshape([2, BLOCK_M])
        # The dQ buffer of DQ_BUFS steps ago is free once its reduce-add read it (the issuing
        # thread waits; the barrier in the step orders every other thread's store after it).
        buf = i % DQ_BUFS
        tma.store_wait(pendings=DQ_BUFS - 1)
        if start_m < m_full:
            dk, dv = _step(k2, v2, q2, do2, st, ds_smem, dq_smem.index(buf), DQD, dk, dv, b, h, n0,
                           start_m, cdiag, qk_scale, True, s_layout, dkv_layout, dq_layout)
        else:
            dk, dv = _step(k2, v2, q2, do2, st, ds_smem, dq_smem.index(buf), DQD, dk, dv, b, h, n0,
                           start_m, cdiag, qk_scale, False, s_layout, dkv_layout, dq_layout)
        # Every thread is past the step's reads of the slot (the barrier before the
        # reduce-add): refill it with step i + STAGES.
        pred = i + STAGES < n_steps
        mbarrier.expect(bars.index(slot), step_bytes, pred=pred)
        tma.async_copy_global_to_shared(QD, [b, h_nx, m_nx, 0], bars.index(slot), q_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(DOD, [b, h_nx, m_nx, 0], bars.index(slot), do_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(SD, [b * Hq + h_nx, 0, m_nx], bars.index(slot), st_smem.index(slot),
                                        pred=pred)
        start_m += BLOCK_M
        wrap = start_m >= m_end
        start_m = gl.where(wrap, m_first, start_m)
        h += wrap.to(gl.int32)
        m_nx += BLOCK_M
        wrap = m_nx >= m_end
        m_nx = gl.where(wrap, m_first, m_nx)
        h_nx += wrap.to(gl.int32)

    # Epilogue: dK * scale and dV through the K and V tiles (every product that read them
    # finished in the last step) and TMA stores; rows past Lk are clipped.
    k_smem.reshape([BLOCK_N, HEAD_D]).store((dk * scale).to(dtype))
    v_smem.reshape([BLOCK_N, HEAD_D]).store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(DKD, [b, hkv, n0, 0], k_smem)
    tma.async_copy_shared_to_global(DVD, [b, hkv, n0, 0], v_smem)
    tma.store_wait(pendings=0)
    return it + n_steps


@gluon.jit
def _bwd_smem_release(kv_bar, bars, STAGES: gl.constexpr):
    """The mbarriers of :func:`_bwd_smem` invalidated (the program's last tile is done)."""
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


# Shape arguments are not specialized (as the other attention kernels'): the compile check
# builds exactly what runs, whatever the head counts and lengths.
@gluon.jit(do_not_specialize=("Hq", "Hkv", "GROUP", "Lq", "Lk", "cdiag"))
def _attn_bwd_hopper(QD, KD, VD, DOD, DQD, DKD, DVD, SD, Hq, Hkv, GROUP, Lq, Lk, cdiag, qk_scale, scale,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_D: gl.constexpr, STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, num_warps: gl.constexpr):
    """The backward (the module docstring's structure), one program a tile (``_bwd_tile``):
    ``QD``, ``KD``, ``VD``, ``DOD`` (B, H, L, D) descriptors of the inputs, ``DQD`` of the fp32
    accumulator (zeroed, summed unscaled), ``DKD``/``DVD`` of the outputs, ``SD`` of the
    statistics (B * Hq + 1, 2, stride_stat); ``qk_scale`` = scale * log2(e), ``scale`` for dK.
    Causality is the runtime bound ``cdiag``: query i sees key j iff j <= i + cdiag (Lk - Lq,
    bottom-right; without causality Lk + BLOCK_N, which no key block reaches: no block is masked
    or skipped). One build serves both (ptxas allocated the build without the masked path
    worse: it spilled)."""
    n_n = gl.cdiv(Lk, BLOCK_N)
    pid = gl.program_id(0)
    bh = pid // n_n
    k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, dq_smem, kv_bar, bars = _bwd_smem(
        QD, KD, VD, DOD, SD, BLOCK_M, BLOCK_N, HEAD_D, STAGES, DQ_BUFS)
    _bwd_tile(QD, KD, VD, DOD, DQD, DKD, DVD, SD, k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, dq_smem, kv_bar,
              bars, bh // Hkv, bh % Hkv, pid % n_n, Hq, GROUP, Lq, cdiag, qk_scale, scale, 0, 0, num_warps)
    _bwd_smem_release(kv_bar, bars, STAGES)


@gluon.jit(do_not_specialize=("Hq", "Hkv", "GROUP", "Lq", "Lk", "cdiag", "BH", "SECTION"))
def _attn_bwd_hopper_persistent(QD, KD, VD, DOD, DQD, DKD, DVD, SD, Hq, Hkv, GROUP, Lq, Lk, cdiag, qk_scale, scale,
                                BH, SECTION, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                                STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, num_warps: gl.constexpr):
    """``_attn_bwd_hopper`` persistent (the forward's ``_attn_fwd_hopper_persistent`` schedule,
    FA3's static form): a program per SM walks the tiles pid, pid + grid, ...; ``BH`` = batch x
    kv heads. Tiles (key block, batch x kv head) in sections of ``SECTION`` consecutive kv heads
    (as many as keep their groups' Q and dO in L2, the last section narrower); in a section the
    key blocks first to last (under a causal mask the first key blocks see the most query rows:
    the heaviest first, longest processing time first), every head of the section at one block
    before the next block (:func:`tile_order` is the same walk on the host). Shared memory and
    mbarriers live across tiles: the ring's position and the K + V mbarrier's phase continue."""
    n_n = gl.cdiv(Lk, BLOCK_N)
    n_tiles = n_n * BH
    k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, dq_smem, kv_bar, bars = _bwd_smem(
        QD, KD, VD, DOD, SD, BLOCK_M, BLOCK_N, HEAD_D, STAGES, DQ_BUFS)
    it = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        sec = tile // (SECTION * n_n)
        r = tile - sec * SECTION * n_n
        width = gl.minimum(SECTION, BH - sec * SECTION)
        blk = r // width
        bh = sec * SECTION + r - blk * width
        it = _bwd_tile(QD, KD, VD, DOD, DQD, DKD, DVD, SD, k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem,
                       dq_smem, kv_bar, bars, bh // Hkv, bh % Hkv, blk, Hq, GROUP, Lq, cdiag, qk_scale, scale, it,
                       (tile // gl.num_programs(0)) & 1, num_warps)
        # Every warp is past this tile's epilogue (dK and dV left K's and V's buffers) before
        # the next tile's loads overwrite them.
        gl.thread_barrier()
    _bwd_smem_release(kv_bar, bars, STAGES)


# ---------------------------------------------------------------------------------------------
# warp-specialized variant: a TMA loader warp, two MMA warpgroups, a dQ writer warp (FA3's)
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _ws_consumer(k_w, v_w, k_out, v_out, ds_w, kt_a, ds_b, dq_w0, dq_w1, q_smem, do_smem, st_smem, ready, empty,
                 ds_ready, ds_free,
                 dq_full, dq_empty, kv_bar, k_done, DKD, DVD, b, hkv, n0w, m_first, m_end, n_steps, cdiag, qk_scale,
                 scale):
    """One MMA warpgroup: the key rows [n0w, n0w + 64) of the program's key block (its K and V
    rows ``k_w``, ``v_w``, as (1, 1, 64, D) ``k_out``, ``v_out`` for the stores; its dS^T rows
    ``ds_w``), dK and dV of those rows in registers, and
    its part of each step's dQ^T = K^T dS^T: ``kt_a`` x ``ds_b`` into ``dq_w0`` or ``dq_w1``
    (transposed views of the two dQ buffers). Partitions take no constexpr arguments: tile sizes
    come from the buffers' shapes.

    Synchronization, all by mbarriers: ``ready``/``empty`` (count 2: both warpgroups release
    a slot) with the loader; ``ds_ready`` (count 2: both halves of dS^T stored, before either
    dQ product) and ``ds_free`` (count 2: both dQ products of the step done, before dS^T is
    stored again) between the warpgroups; ``dq_full`` (count 2) and ``dq_empty`` (count 1)
    with the dQ writer; ``k_done`` (count 2) before the K tile takes dK for the store."""
    HALF_N: gl.constexpr = k_w.shape[0]
    HEAD_D: gl.constexpr = k_w.shape[1]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    STAGES: gl.constexpr = q_smem.shape[0]
    DQ_BUFS: gl.constexpr = 2
    dtype: gl.constexpr = k_w.dtype
    s_layout: gl.constexpr = _mma_layout(HALF_N, BLOCK_M, 4)
    dkv_layout: gl.constexpr = _mma_layout(HALF_N, HEAD_D, 4)
    DQ_M: gl.constexpr = dq_w0.shape[0]
    DQ_N: gl.constexpr = dq_w0.shape[1]
    dq_layout: gl.constexpr = _mma_layout(DQ_M, DQ_N, 4)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dkv_layout, k_width=2)
    m_full = n0w + HALF_N - 1 - cdiag  # a query block starting at or past this row sees all our keys

    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=dkv_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=dkv_layout)
    mbarrier.wait(kv_bar, 0)
    start_m = m_first
    for i in range(n_steps):
        slot = i % STAGES
        buf = i % DQ_BUFS
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        q2 = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
        do2 = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])
        st1 = st_smem.index(slot).reshape([2, BLOCK_M])._reinterpret(gl.float32, [2, BLOCK_M],
                                                                      gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        # As ``_step``: the statistics start the accumulators (LSE = +inf enters as -1e20).
        zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
        s_acc = zero - gl.expand_dims(gl.minimum(st1.index(0).load(col_layout), 1e20) / qk_scale, 0)
        dp_acc = zero - gl.expand_dims(st1.index(1).load(col_layout), 0)
        s_tok = warpgroup_mma(k_w, q2.permute((1, 0)), s_acc, is_async=True)
        dp_tok = warpgroup_mma(v_w, do2.permute((1, 0)), dp_acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        p = gl.exp2(s * qk_scale)
        if start_m < m_full:
            rows = n0w + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
            cols = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
            p = gl.where(gl.expand_dims(rows, 1) <= gl.expand_dims(cols + cdiag, 0), p, 0.0)
        p16 = gl.convert_layout(p.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p16, do2, dv, is_async=True)
        dpd = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, ))
        ds = (p * dpd).to(dtype)
        # dS^T: our rows once both dQ products of the last step are done with the tile.
        mbarrier.wait(ds_free, (i & 1) ^ 1, pred=i > 0)
        ds_w.store(ds)
        fence_async_shared()
        gl.thread_barrier()  # the warpgroup's four warps stored their rows
        mbarrier.arrive(ds_ready)
        dk_tok = warpgroup_mma(ds_w, q2, dk, is_async=True)
        mbarrier.wait(ds_ready, i & 1)  # the other warpgroup's rows too
        mbarrier.wait(dq_empty.index(buf), ((i // DQ_BUFS) & 1) ^ 1, pred=i >= DQ_BUFS)
        dq_acc = gl.zeros([DQ_M, DQ_N], gl.float32, layout=dq_layout)
        dq_tok = warpgroup_mma(kt_a, ds_b, dq_acc, use_acc=False, is_async=True)
        dv, dk, dq, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, p16))
        mbarrier.arrive(ds_free)
        mbarrier.arrive(empty.index(slot))  # Q, dO and the statistics of the slot are read
        if buf == 0:
            dq_w0.store(dq)
        else:
            dq_w1.store(dq)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(dq_full.index(buf))
        start_m += BLOCK_M
        start_m = gl.where(start_m >= m_end, m_first, start_m)

    # Epilogue: once both warpgroups' last dQ products are done with K, our rows of the K and
    # V tiles take dK * scale and dV, stored by TMA (rows past Lk clipped).
    mbarrier.arrive(k_done)
    mbarrier.wait(k_done, 0)
    k_w.store((dk * scale).to(dtype))
    v_w.store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(DKD, [b, hkv, n0w, 0], k_out)
    tma.async_copy_shared_to_global(DVD, [b, hkv, n0w, 0], v_out)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_loader(QD, KD, VD, DOD, SD, k_smem, v_smem, q_smem, do_smem, st_smem, kv_bar, ready, empty, b, hkv, Hq, h0,
               n0, m_first, m_end, n_steps):
    """The TMA warp: K and V once, then step j's Q, dO and statistics rows into slot
    j % STAGES once both warpgroups released the slot's previous step."""
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    STAGES: gl.constexpr = q_smem.shape[0]
    mbarrier.expect(kv_bar, 2 * KD.block_type.nbytes)
    tma.async_copy_global_to_shared(KD, [b, hkv, n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(VD, [b, hkv, n0, 0], kv_bar, v_smem)
    step_bytes: gl.constexpr = QD.block_type.nbytes + DOD.block_type.nbytes + SD.block_type.nbytes
    h = h0
    start_m = m_first
    for j in range(n_steps):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        mbarrier.expect(ready.index(slot), step_bytes)
        tma.async_copy_global_to_shared(QD, [b, h, start_m, 0], ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(DOD, [b, h, start_m, 0], ready.index(slot), do_smem.index(slot))
        tma.async_copy_global_to_shared(SD, [b * Hq + h, 0, start_m], ready.index(slot), st_smem.index(slot))
        start_m += BLOCK_M
        wrap = start_m >= m_end
        start_m = gl.where(wrap, m_first, start_m)
        h += wrap.to(gl.int32)


@gluon.jit
def _ws_dq_writer(DQD, dq_smem, dq_full, dq_empty, b, h0, m_first, m_end, n_steps):
    """The dQ warp: step i's dQ tile (both warpgroups' parts) reduce-added by TMA into the fp32
    accumulator, its buffer released once the reduce-add read it."""
    BLOCK_M: gl.constexpr = dq_smem.shape[1]
    DQ_BUFS: gl.constexpr = dq_smem.shape[0]
    h = h0
    start_m = m_first
    for i in range(n_steps):
        buf = i % DQ_BUFS
        mbarrier.wait(dq_full.index(buf), (i // DQ_BUFS) & 1)
        _tma_reduce_add(DQD, [b, h, start_m, 0], dq_smem.index(buf).reshape(DQD.block_type.shape))
        tma.store_wait(pendings=0)
        mbarrier.arrive(dq_empty.index(buf))
        start_m += BLOCK_M
        wrap = start_m >= m_end
        start_m = gl.where(wrap, m_first, start_m)
        h += wrap.to(gl.int32)


@gluon.jit(do_not_specialize=("Hq", "Hkv", "GROUP", "Lq", "Lk", "cdiag"))
def _attn_bwd_hopper_ws(QD, KD, VD, DOD, DQD, DKD, DVD, SD, Hq, Hkv, GROUP, Lq, Lk, cdiag, qk_scale, scale,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                        DQ_BUFS: gl.constexpr, num_warps: gl.constexpr):
    """``_attn_bwd_hopper`` with FA3's partitions: the default partition (4 warps) and a 4-warp
    worker are the two MMA warpgroups (64 key rows each), a 1-warp worker the TMA loader, a
    1-warp worker the dQ writer (``_ws_consumer``'s synchronization). dQ's product splits its
    query rows between the warpgroups at BLOCK_M 128, its head-dim columns at BLOCK_M 64 (both
    at 64: whole swizzle atoms). ``DKD``/``DVD`` have 64-row blocks (each warpgroup stores its
    rows)."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    dtype: gl.constexpr = QD.dtype
    gl.static_assert(DQ_BUFS == 2, "the warpgroups take the two dQ buffers as two views")
    n_n = gl.cdiv(Lk, BLOCK_N)
    pid = gl.program_id(0)
    nblk = pid % n_n
    bh = pid // n_n
    b = bh // Hkv
    hkv = bh % Hkv
    n0 = nblk * BLOCK_N
    m_end = gl.cdiv(Lq, BLOCK_M) * BLOCK_M
    m_first = gl.maximum(n0 - cdiag, 0) // BLOCK_M * BLOCK_M
    n_steps = GROUP * ((m_end - m_first) // BLOCK_M)
    h0 = hkv * GROUP

    k_smem = gl.allocate_shared_memory(dtype, KD.block_type.shape, KD.layout)
    v_smem = gl.allocate_shared_memory(dtype, VD.block_type.shape, VD.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + QD.block_type.shape, QD.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + DOD.block_type.shape, DOD.layout)
    st_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + SD.block_type.shape, SD.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, HEAD_D],
                                        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    k_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(ds_ready, count=2)
    mbarrier.init(ds_free, count=2)
    for i in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_full.index(i), count=2)
        mbarrier.init(dq_empty.index(i), count=1)
    mbarrier.init(k_done, count=2)
    fence_async_shared()

    k2 = k_smem.reshape([BLOCK_N, HEAD_D])
    v2 = v_smem.reshape([BLOCK_N, HEAD_D])
    # dQ^T = K^T dS^T: the warpgroups split its head-dim rows at D128 (64 each, all query
    # columns), its query columns at D64 (all 64 rows): 64-row products, slices on whole
    # swizzle atoms, a (64, BLOCK_M or BLOCK_M / 2) fp32 tile each.
    kt = k2.permute((1, 0))
    dqt0 = dq_smem.index(0).permute((1, 0))
    dqt1 = dq_smem.index(1).permute((1, 0))
    if HEAD_D >= 128:
        QH: gl.constexpr = 64
        kt_a0 = kt.slice(0, QH, dim=0)
        kt_a1 = kt.slice(QH, QH, dim=0)
        ds_b0 = ds_smem
        ds_b1 = ds_smem
        dq_00 = dqt0.slice(0, QH, dim=0)
        dq_01 = dqt1.slice(0, QH, dim=0)
        dq_10 = dqt0.slice(QH, QH, dim=0)
        dq_11 = dqt1.slice(QH, QH, dim=0)
    else:
        QH: gl.constexpr = BLOCK_M // 2
        kt_a0 = kt
        kt_a1 = kt
        ds_b0 = ds_smem.slice(0, QH, dim=1)
        ds_b1 = ds_smem.slice(QH, QH, dim=1)
        dq_00 = dqt0.slice(0, QH, dim=1)
        dq_01 = dqt1.slice(0, QH, dim=1)
        dq_10 = dqt0.slice(QH, QH, dim=1)
        dq_11 = dqt1.slice(QH, QH, dim=1)
    gl.warp_specialize([
        (_ws_consumer, (k2.slice(0, HALF_N, dim=0), v2.slice(0, HALF_N, dim=0), k_smem.slice(0, HALF_N, dim=2),
                        v_smem.slice(0, HALF_N, dim=2), ds_smem.slice(0, HALF_N, dim=0), kt_a0, ds_b0, dq_00, dq_01,
                        q_smem, do_smem, st_smem, ready, empty, ds_ready, ds_free, dq_full, dq_empty, kv_bar, k_done,
                        DKD, DVD, b, hkv, n0, m_first, m_end, n_steps, cdiag, qk_scale, scale)),
        (_ws_consumer, (k2.slice(HALF_N, HALF_N, dim=0), v2.slice(HALF_N, HALF_N, dim=0),
                        k_smem.slice(HALF_N, HALF_N, dim=2), v_smem.slice(HALF_N, HALF_N, dim=2),
                        ds_smem.slice(HALF_N, HALF_N, dim=0), kt_a1, ds_b1, dq_10, dq_11, q_smem, do_smem, st_smem,
                        ready, empty, ds_ready, ds_free, dq_full, dq_empty, kv_bar, k_done, DKD, DVD, b, hkv,
                        n0 + HALF_N, m_first, m_end, n_steps, cdiag, qk_scale, scale)),
        (_ws_loader, (QD, KD, VD, DOD, SD, k_smem, v_smem, q_smem, do_smem, st_smem, kv_bar, ready, empty, b, hkv, Hq,
                      h0, n0, m_first, m_end, n_steps)),
        (_ws_dq_writer, (DQD, dq_smem, dq_full, dq_empty, b, h0, m_first, m_end, n_steps)),
    ], [4, 1, 1], [240, 24, 24])


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def _layout(rows: int, d: int, dtype):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], dtype)


def _plain(rank: int):
    """An unswizzled fp32 TMA layout: the statistics rows (each read whole into registers) and
    the dQ tiles (the threads' stores at fixed offsets from one address each)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=rank)


def supports(q, *, arch: int, dropout_p: float, key_padding_mask, has_window: bool, varlen, score_mod: bool, dbias,
             aligned: bool) -> bool:
    """Whether this kernel takes the call (the switch and determinism aside; ``launchers.backward``'s
    arguments: the rest run ``backward.py``): sm_90, 16-bit, D in :data:`PADDED`, causal or not
    (+ GQA), TMA-able layouts (``aligned``), no other feature. ``has_window``: a window, or a
    right bound other than the causal diagonal's."""
    return (arch == 90 and q.dtype in DTYPES and q.shape[3] in PADDED and aligned and dropout_p == 0.0
            and key_padding_mask is None and not has_window and varlen is None and not score_mod and dbias is None)


def taken(q, **features) -> bool:
    """The switch, deterministic mode and :func:`supports`: whether this call runs here."""
    return ENABLED and not torch.are_deterministic_algorithms_enabled() and supports(q, **features)


def backward(q, k, v, do, dq, dk, dv, stats, stride_stat: int, causal: bool, scale: float, strides) -> None:
    """dQ, dK, dV into ``dq``, ``dk``, ``dv`` (``launchers.backward``'s, after its preprocess wrote
    ``stats``, (B * Hq + 1, 2, stride_stat) fp32); ``strides``: the launchers' ``_strides`` of
    q, k, v, do, dq, dk (dv shares dk's)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    sq, sk, sv, sdo, sdq, sdk = strides
    acc = common.empty((B, Hq, Lq, D), torch.float32, q.device)
    launch = (q, k, v, do, dk, dv, acc, stats, stride_stat, bool(causal), float(scale), (sq, sk, sv, sdo, sdk))
    head_d = PADDED[D]
    ws = WS and head_d in WS_CONFIGS
    persistent = PERSISTENT and head_d in PERSISTENT_CONFIGS
    # The tile count's bucket: whether a program per tile or per SM wins depends on it.
    key = (D, ws, persistent, bool(causal), Hq // Hkv > 1, _bucket(Lq), _bucket(Lk),
           _bucket(B * Hkv * common.cdiv(Lk, TILE_N[head_d][0])))
    if ws:
        cands = _WS_CANDIDATES[head_d]
    else:
        cands = [c for c in _CANDIDATES[head_d] if c["PERSISTENT"] or not persistent]
    cfg = _CACHE.get(key, cands, lambda c: _launch(c, launch))
    _launch(cfg, launch)
    common.launch("attention_dq_convert", _dq_convert, (B * Hq * common.cdiv(Lq, CONVERT_BLOCK_M),),
                  (acc, dq, *sdq, Hq, Lq, D, float(scale)),
                  dict(BLOCK_M=CONVERT_BLOCK_M, BLOCK_D=head_d, INTERPRET=False), common.Config.of(num_warps=4))


def _launch(cfg, launch) -> None:
    q, k, v, do, dk, dv, acc, stats, stride_stat, causal, scale, strides = launch
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    head_d = PADDED[D]  # blocks HEAD_D wide over the D-wide tensors (zeros past D)
    block_m, ws = cfg["BLOCK_M"], cfg["WS"]
    block_n, dq_bufs = TILE_N[head_d]
    out_rows = block_n // 2 if ws else block_n  # its warpgroups store 64 rows of dK and dV each
    gdt = _GL_DTYPES[q.dtype]
    descs = []
    for t, s, rows in ((q, strides[0], block_m), (k, strides[1], block_n), (v, strides[2], block_n),
                       (do, strides[3], block_m)):
        descs.append(TensorDescriptor(t, list(t.shape), [*s, 1], [1, 1, rows, head_d], _layout(rows, head_d, gdt)))
    descs.append(TensorDescriptor(acc, list(acc.shape), [Hq * Lq * D, Lq * D, D, 1], [1, 1, block_m, head_d],
                                  _plain(4)))
    for t in (dk, dv):
        descs.append(TensorDescriptor(t, list(t.shape), [*strides[4], 1], [1, 1, out_rows, head_d],
                                      _layout(out_rows, head_d, gdt)))
    descs.append(TensorDescriptor(stats, list(stats.shape), [2 * stride_stat, stride_stat, 1], [1, 2, block_m],
                                  _plain(3)))
    tiles = common.cdiv(Lk, block_n) * B * Hkv
    cdiag = Lk - Lq if causal else Lk + block_n
    args = (*descs, Hq, Hkv, Hq // Hkv, Lq, Lk, cdiag, scale * _LOG2E, scale)
    if cfg["PERSISTENT"]:
        kernel, grid = _attn_bwd_hopper_persistent, (min(tiles, common.sm_count(q.device)),)
        args += (B * Hkv, section(Lq, head_d, q.element_size(), Hq // Hkv))
    else:
        kernel, grid = (_attn_bwd_hopper_ws if ws else _attn_bwd_hopper), (tiles,)
    common.count_launch("attention_bwd_hopper")
    if common.STUB_LAUNCHES:
        return
    acc.zero_()  # idempotent for the tuner's timing: the kernel accumulates
    kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=head_d, STAGES=cfg["STAGES"], DQ_BUFS=dq_bufs,
                 num_warps=cfg.num_warps)


def section(Lq: int, head_d: int, elem: int, group: int) -> int:
    """KV heads per L2 section of the persistent kernel (the forward's ``hopper._section`` with
    the backward's streamed operands): the largest power of two of kv heads whose query heads'
    Q and dO fit :data:`L2_QDO_BYTES` (at least one)."""
    kv_head = group * Lq * 2 * head_d * elem
    return 1 << (max(L2_QDO_BYTES // kv_head, 1).bit_length() - 1)


def aot_spec_args(dtype: str, head_d: int, block_m: int, stages: int, ws: bool = False,
                  persistent: bool = False) -> tuple:
    """(signature, constexprs) of one compiled variant, for ``specs.aot_specs``."""
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype]
    sig = {}
    block_n, dq_bufs = TILE_N[head_d]
    for name, rows in (("QD", block_m), ("KD", block_n), ("VD", block_n), ("DOD", block_m)):
        sig[name] = f"tensordesc<{dtype}[1, 1, {rows}, {head_d}],{_layout(rows, head_d, gdt)!r}>"
    sig["DQD"] = f"tensordesc<fp32[1, 1, {block_m}, {head_d}],{_plain(4)!r}>"
    out_rows = block_n // 2 if ws else block_n
    for name in ("DKD", "DVD"):
        sig[name] = f"tensordesc<{dtype}[1, 1, {out_rows}, {head_d}],{_layout(out_rows, head_d, gdt)!r}>"
    sig["SD"] = f"tensordesc<fp32[1, 2, {block_m}],{_plain(3)!r}>"
    sig.update(Hq="i32", Hkv="i32", GROUP="i32", Lq="i32", Lk="i32", cdiag="i32", qk_scale="fp32", scale="fp32")
    if persistent:
        sig.update(BH="i32", SECTION="i32")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=head_d, STAGES=stages,
                      DQ_BUFS=dq_bufs, num_warps=4 if ws else NUM_WARPS)
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, constexprs
