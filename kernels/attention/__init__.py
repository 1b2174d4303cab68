"""FlashAttention-style fused softmax attention: forward, backward, and the dropout keep-mask.

Every tensor is a strided (B, H, L, D) view with a contiguous last dim: SDPA's layout, views of
a packed QKV projection (B, L, (H + 2 Hkv) * D) or (L, B, ...), and outputs written straight
into such layouts all look alike to the kernels (three strides per tensor). GQA/MQA: query head
h reads K/V head h // (Hq // Hkv). Causal alignment is bottom-right: query i sees keys
j <= i + Lk - Lq. ``MASK`` is the (B, Lk) key padding mask as uint8 (1 = padding). A query row
with no visible key outputs 0 and has LSE = -inf; its gradients are 0.

Two data paths, one kernel body each (constexpr ``USE_TMA``):

- **TMA** (Hopper, and the interpreter): tensor descriptors, so ragged L and D < BLOCK_D are
  zero-padded by the hardware and strided views need no copy. The forward takes host-side
  descriptors over the whole (B, H, L, D) tensors (``TensorDescriptor``, built per launch:
  no descriptor work in the kernel); its warp-specialized candidates and the backward build
  device-side ones (``tl.make_tensor_descriptor``) over their (batch, head)'s (L, D)
  matrices (the dK/dV programs: over the batch's (H, L, D) queries and statistics, to walk
  the group's heads in one loop), with ``triton.set_allocator`` for the scratch (per thread,
  so forward and backward both set it). Needs 16-byte aligned bases and strides (true for
  every head dim multiple of 8 in a dense or packed buffer). Hopper's IEEE fp32 products
  (FMA units, operands from registers) take the pointer path.
- **pointers** (Ampere, and unaligned layouts anywhere): masked ``tl.load``; loads inside the
  unmasked part of a loop carry only the head-dim mask, and none when D is a power of two.

Kernels:

- ``_attn_fwd``: one program per (query block, batch * head), query blocks of a head in
  reverse order (under a causal mask the last blocks do the most work: heaviest first).
  Online softmax in fp32 with ``exp2`` and the scale folded into one FMA. Key blocks every
  row of the query block sees, in bounds, run without masks; only the blocks straddling the
  causal diagonal or the end of the keys pay for masking, and blocks above the diagonal are
  never visited. K/V loops are software pipelined (``tl.range``, the config's stages).
  Saves only O and the fp32 natural-log LSE (B, Hq, Lq).
- ``_attn_bwd_preprocess``: the backward's row statistics, (B * Hq + 1, 2, Lq rounded up to
  ``STAT_ALIGN``) fp32 (the last slab a spare, never written): LSE * log2(e) (+inf where P
  must be 0: rows with no visible key, padding rows) and delta = rowsum(dO * O) - dLSE (0 on
  padding rows). The dLSE term makes the LSE output differentiable: d lse_i / d s_ij = P_ij.
  Padded and pre-scaled, they load unmasked, vectorized and without selects in the
  backward's loops (on Hopper's TMA path with 16-bit operands and query blocks of at most
  32 rows, the dK/dV loops load each step's one step ahead, into registers, the loads past
  the last head reading the spare slab; elsewhere a TMA tile or pointer loads in the step).
- ``_attn_bwd``: one kernel for dK/dV and dQ (flex_attention's split): per (batch, kv head),
  programs [0, kv_blocks) accumulate dK/dV of one key block over the group's query heads
  and query blocks, in one flat loop per mask kind over (head, block) pairs walked with
  counters, no division per step (GQA reduced in registers: deterministic, no atomics);
  programs [kv_blocks, kv_blocks + q_blocks * group) compute dQ of one query block.
  Causally invisible blocks are skipped and only the diagonal ones masked, in both halves
  (on the TMA path the partial last query block needs no mask: its rows read as zero).
  Where dK's and dV's fp32 accumulators cannot share the registers (``SPLIT_KV`` configs:
  D = 256, some fp32 and dropout classes), each key block gets a dV program and a dK
  program (which recomputes P).
- Tile orders (``SCHED``, timed candidates only, docs/attention-scheduling.md): 1, both
  kernels' programs in longest-first order over all heads (heads in L2-sized groups); 2, the
  same order on a persistent grid. ``VHOST``: packed sequences through the host-side
  descriptors of the packed tensors (the default builds four tensor maps per program).
- Score modifications (``helpers._score_mod``: softcap, ALiBi, an additive bias, a bool mask)
  in every K/V step of the forward and both backward halves; attention sinks in the forward's
  epilogue and the preprocess (their gradient). Feature classes "band" (window, varlen) and
  "score" have config entries of their own (``configs.py``).
- ``_attn_dbias`` (``dbias.py``): the bias's gradient, when the bias requires one, after the
  backward: one program per tile of the gradient (in the bias's own shape and dtype), which
  recomputes and sums, in a fixed order and in registers, the dS tiles of every batch, head,
  query and key block that broadcast into it (deterministic, no atomics, no (B, Hq, Lq, Lk)
  buffer; two extra products per dS tile).
- ``_dropout_keep``: keep = uniform(seed, (j, i, batch * Hq + h)) >= p: Philox counters are the
  key index, query index and flattened head, so every kernel (and ``dropout_keep_mask``, a test
  helper) regenerates the same mask without storing it.

All grids are 1-D (axis 0 allows 2^31 - 1 programs), the block index fastest so that
consecutive programs share one head's K/V in L2. Offsets of heads and rows are int64.

fp32 inputs follow torch's matmul precision at call time (``common.fp32_precision()``): IEEE
fp32 products by default, TF32 when torch allows TF32 for matmuls (torch has no attention
switch of its own). The mode is a constexpr of the kernels and part of the config key.

Reading order (the data flow from ``fused_block.attention`` down to each kernel):

- ``launchers.py``: ``forward`` / ``backward`` / ``dropout_keep_mask``, called by the ops of
  ``fused_block/attention.py``: data path, descriptors, config lookup, grids, launches.
- ``configs.py``: the per-architecture config tables and the keys that index them.
- ``forward.py``: ``_attn_fwd`` (and its key-block step).
- ``backward.py``: ``_attn_bwd_preprocess``, then ``_attn_bwd`` (dK/dV and dQ programs).
- ``backward_atomic.py``: the opt-in backward with dQ reduce-added in fp32 (FA3's design,
  ``FUSED_BLOCK_ATTN_DQ_ATOMIC=1``, never in deterministic mode), taken by
  ``launchers.backward`` for the calls its ``supports`` names.
- ``dbias.py``: ``_attn_dbias``, the bias's gradient (launched by ``launchers.backward``).
- ``decode.py``: split-KV decoding (``_attn_decode_split``, ``_attn_decode_combine``), chosen by
  ``launchers.forward`` for few query rows over long caches, and the KV-cache append kernel.
- ``helpers.py``: the device helpers the kernels share (tile loads and stores, descriptors,
  the dropout keep-mask, visible key ranges) and the keep-mask kernel of the tests.
- ``specs.py``: ``aot_specs()``, every shipped config for the compile check.
"""
from fused_block.kernels.attention.configs import MAX_FP32_BLOCK_D
from fused_block.kernels.attention.launchers import backward, dropout_keep_mask, forward, kv_cache_append
from fused_block.kernels.attention.specs import aot_specs

__all__ = ["MAX_FP32_BLOCK_D", "aot_specs", "backward", "dropout_keep_mask", "forward", "kv_cache_append"]
