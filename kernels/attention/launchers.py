"""Host side of the attention kernels: data-path choice (TMA or pointers), tensor descriptors,
config lookup and the launches. Inputs are validated by ``fused_block.attention``; every last
dim is contiguous."""
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_block.kernels import common
from fused_block.kernels.attention.backward import _attn_bwd, _attn_bwd_preprocess
from fused_block.kernels.attention import backward_atomic
from fused_block.kernels.attention import configs
from fused_block.kernels.attention.configs import (BWD_CONFIGS, DBIAS_CONFIGS, DECODE_CONFIGS, FWD_CONFIGS,
                                                   PRE_BLOCK_M, STAT_ALIGN, _bucket, _bwd_cfg, _block_d, _class,
                                                   _decode_block_m, _fwd_cfg, _kind, _table_key)
from fused_block.kernels.attention.dbias import _attn_dbias
from fused_block.kernels.attention.decode import _attn_decode_combine, _attn_decode_split, _kv_cache_append
from fused_block.kernels.attention.forward import _attn_fwd
from fused_block.kernels.attention import hopper, hopper_bwd
from fused_block.kernels.attention.helpers import _dropout_mask_kernel

# Tests set this to "pointer" to run the pointer path where TMA would be taken (the interpreter
# runs the TMA path by default wherever the layout allows it, as Hopper does).
FORCE_PATH = None

# ---------------------------------------------------------------------------------------------
# launchers (inputs validated by fused_block.attention; every last dim contiguous)
# ---------------------------------------------------------------------------------------------

_FWD_CACHE = common.ConfigCache("attention_fwd")
_DECODE_CACHE = common.ConfigCache("attention_decode")
# Split-KV decoding: at most this many query rows, at least this many keys (tests lower it).
DECODE_MAX_LQ = 16
DECODE_MIN_KEYS = 1024
_BWD_CACHE = common.ConfigCache("attention_bwd")


def _strides(t):
    """(batch, head, row) strides of a (B, H, L, D) view. A size-1 dim's stride is never used to
    move, so it gets a stand-in that never blocks TMA: an aligned nonzero value (the next
    inner dim's extent; descriptor strides)."""
    B, H, L, _ = t.shape
    sb, sh, sl, _ = t.stride()
    sl = sl if L > 1 else 16
    sh = sh if H > 1 else sl * L
    return (sb if B > 1 else sh * H, sh, sl)


_FOUR_WARPS = common.Config.of(num_warps=4)
_new_object = object.__new__
_DESC_BLOCKS = set()  # (block, block_d) pairs whose descriptor block shape Triton has validated


def _tma_desc(t, strides, block: int, block_d: int):
    """Host-side TMA descriptor over the (B, H, L, D) view ``t`` (``strides`` from
    :func:`_strides`), block (1, 1, block, block_d): rows past L and columns past D read as
    zero and are not written.

    ``TensorDescriptor``'s own checks run once per block shape; later descriptors are built
    without them (its ``__post_init__`` costs a few microseconds a call): what they check of
    ``t`` holds wherever the launchers build one, as :func:`_use_tma` checked the 16-byte
    aligned base and strides, the launchers returned before any launch on an empty ``t``, and
    its last stride is 1 (the ops' validation)."""
    shape, desc_strides, block_shape = list(t.shape), [*strides, 1], [1, 1, block, block_d]
    if (block, block_d) not in _DESC_BLOCKS:
        desc = TensorDescriptor(t, shape, desc_strides, block_shape)
        _DESC_BLOCKS.add((block, block_d))
        return desc
    desc = _new_object(TensorDescriptor)
    desc.__dict__ = {"base": t, "shape": shape, "strides": desc_strides, "block_shape": block_shape, "padding": "zero"}
    return desc


def _aligned(t, strides) -> bool:
    """TMA-able: 16-byte aligned base and strides, and no broadcast (zero-stride) head or row."""
    es = t.element_size()
    sb, sh, sl = strides
    return (t.data_ptr() % 16 == 0 and sb * es % 16 == 0 and sh * es % 16 == 0 and sl * es % 16 == 0
            and sh != 0 and sl != 0)


def _use_tma(arch: int, kind: str, pairs) -> bool:
    """TMA on Hopper and in the interpreter, for layouts whose bases and strides are 16-byte
    aligned (descriptors require it); ``pairs`` are (tensor, strides). Hopper's IEEE fp32
    products run on FMA units from registers: pointer loads there (TMA staging spills)."""
    if FORCE_PATH == "pointer" or arch not in (0, 90) or (arch == 90 and kind == "ieee"):
        return False
    for t, s in pairs:
        if not _aligned(t, s):
            return False
    return True


def _grid_size(n_programs: int) -> int:
    if n_programs > 2**31 - 1:
        raise ValueError(f"attention: {n_programs} programs exceed CUDA's grid limit; split the batch")
    return n_programs


def _candidates(tables, interpret_cfg, arch, key, use_tma):
    if arch == 0:
        if "SPLIT_KV" in interpret_cfg.meta():
            # Split dK/dV programs where the GPU tables split them, so the interpreter runs them.
            # (the scheduling candidates' own split persistent configs aside: tests force them)
            split = any(c["SPLIT_KV"] and not c["SCHED"] for t in tables.values() for c in t[key])
            interpret_cfg = _bwd_cfg(*(interpret_cfg[n] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")),
                                     interpret_cfg.num_warps, interpret_cfg.num_stages, split)
        return [interpret_cfg]
    cands = tables[arch][key]
    # sm_90's pointer path (unaligned layouts only) runs the first candidate, compiled as such.
    return cands if use_tma or arch != 90 else cands[:1]


def _fwd_candidates(arch, key, use_tma, causal, Lk):
    """The forward's candidates. Warp-specialized ones (the tables' ``WS`` entries) only with
    FUSED_BLOCK_WS=1 (common.WARP_SPECIALIZE; they have not yet run on a GPU), then first,
    and only where their single unmasked K/V loop is exact (causal, or whole key blocks):
    the interpreter then runs its one config warp-specialized there, on the TMA path under
    the keys a GPU table has WS candidates for, and without otherwise."""
    cands = _candidates(FWD_CONFIGS, configs.INTERPRET_FWD, arch, key, use_tma)
    if not common.WARP_SPECIALIZE:
        return [c for c in cands if not c["WS"]]
    if arch == 0 and use_tma and any(c["WS"] for t in FWD_CONFIGS.values() for c in t.get(key, ())):
        c = cands[0]
        cands = [_fwd_cfg(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages, True)]
    else:
        cands = sorted(cands, key=lambda c: not c["WS"])  # stable: WS first, then the table's order
    ok = [c for c in cands if not c["WS"] or causal or Lk % c["BLOCK_N"] == 0]
    if ok:
        return ok
    return [_fwd_cfg(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages, False, c["SCHED"], c["VHOST"])
            for c in cands]


def _band(causal: bool, window) -> tuple:
    """``(IS_CAUSAL, WINDOW, win_left, win_right)`` of ``window = (left, right)`` (-1 =
    unlimited; ``causal`` sets right to 0): the kernels' right bound (causal, or a window's
    right side) and left bound."""
    left, right = window
    if causal:
        right = 0
    return right >= 0, left >= 0, max(left, 0), max(right, 0)


def _score_args(shape, softcap, alibi, bias, mask, dummy):
    """Kernel arguments of the score modifications: pointers (SLOPES, BIAS, AMASK), strides
    (stride_slb; bias's and mask's 4 over ``shape`` (B, Hq, Lq, Lk), zero along broadcast dims)
    and the flags. ``alibi``: (Hq,) or (B, Hq) fp32; ``bias``: float, ``mask``: bool (True =
    attend), both broadcastable to ``shape``."""
    alibi = common.unit(alibi)  # heads at unit stride
    slopes, stride_slb = (dummy, 0) if alibi is None else (alibi, alibi.stride(0) if alibi.dim() == 2 else 0)
    if bias is None:
        bias_t, sb = dummy, (0, 0, 0, 0)
    else:
        bias_t = bias.expand(shape)
        sb = bias_t.stride()
    if mask is None:
        mask_t, sa = dummy, (0, 0, 0, 0)
    else:
        mask_t = mask.expand(shape).view(torch.uint8)
        sa = mask_t.stride()
    flags = dict(SOFTCAP=bool(softcap), HAS_ALIBI=alibi is not None, HAS_BIAS=bias is not None,
                 HAS_AMASK=mask is not None)
    return (slopes, bias_t, mask_t), (stride_slb, *sb, *sa), flags


_NO_SCORE_STRIDES = (0,) * 9  # stride_slb, the bias's and the mask's 4
_NO_SCORE_FLAGS = (False, False, False, False)  # SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_AMASK


_CONSTEXPRS = {}  # (kernel, flags...) -> the constexpr dict: one object per distinct set (launch.py)


def _attn_constexprs(extra, is_causal, window, varlen, has_pad, dropout, score_flags, use_tma, ieee, even_d,
                     block_d, interpret):
    """The forward's or the backward's constexpr dict: ``score_flags`` are SOFTCAP, HAS_ALIBI,
    HAS_BIAS and HAS_AMASK, ``extra`` the kernel's own (name, value) pairs (the forward's
    HAS_SINKS, the backward's STAT_ALIGN), which also tell the two kernels' keys apart."""
    key = (extra, is_causal, window, varlen, has_pad, dropout, score_flags, use_tma, ieee, even_d, block_d, interpret)
    out = _CONSTEXPRS.get(key)
    if out is None:
        softcap, alibi, bias, amask = score_flags
        out = _CONSTEXPRS[key] = dict(
            IS_CAUSAL=is_causal, WINDOW=window, VARLEN=varlen, HAS_PAD=has_pad, HAS_DROPOUT=dropout,
            SOFTCAP=softcap, HAS_ALIBI=alibi, HAS_BIAS=bias, HAS_AMASK=amask, USE_TMA=use_tma, IEEE=ieee,
            EVEN_D=even_d, BLOCK_D=block_d, INTERPRET=interpret, **dict(extra))
    return out


_FWD_EXTRA = ((("HAS_SINKS", False),), (("HAS_SINKS", True),))  # by whether sinks are given
_BWD_EXTRA = (("STAT_ALIGN", STAT_ALIGN),)


def _pre_constexprs(has_dlse, varlen, has_sinks, block_d, tf32):
    """The backward preprocess's constexpr dict."""
    key = ("pre", has_dlse, varlen, has_sinks, block_d, tf32)
    out = _CONSTEXPRS.get(key)
    if out is None:
        out = _CONSTEXPRS[key] = dict(HAS_DLSE=has_dlse, VARLEN=varlen, HAS_SINKS=has_sinks, BLOCK_D=block_d,
                                      BLOCK_M=PRE_BLOCK_M, STAT_ALIGN=STAT_ALIGN, TF32=tf32,
                                      INTERPRET=common.interpreting())
    return out


def _mask_ranges(mask, shape, block_rows: int, block_cols: int, by_keys: bool = False, groups: int = 1):
    """Per (batch, head, row block) the range [r0, r1) of column blocks in which the bool
    ``mask`` (broadcastable to ``shape`` = (B, Hq, Lq, Lk)) has any True element, as int32
    pairs (Bm, Hm, row blocks, 2), positions in elements (r0 = r1 = 0: none), with the
    batch and head strides (0 where the mask broadcasts). Rows are query blocks of
    ``block_rows`` and columns key blocks of ``block_cols``; ``by_keys``: rows are key blocks
    (``block_cols``) and columns query blocks (``block_rows``). ``groups`` > 1: the heads
    merged per GQA group of ``groups`` (the head axis is then the kv head's). The kernels skip
    the blocks outside the range (block-diagonal, chunked and padding-like masks cost their
    visible blocks). Torch reductions on the device: no sync."""
    B, Hq, Lq, Lk = shape
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    n_m, n_n = common.cdiv(Lq, block_rows), common.cdiv(Lk, block_cols)
    tm = block_rows if m.shape[2] > 1 else 1
    tn = block_cols if m.shape[3] > 1 else 1
    padded = torch.nn.functional.pad(m.to(torch.uint8), (0, n_n * tn - m.shape[3], 0, n_m * tm - m.shape[2])
                                     if m.shape[2] > 1 else (0, n_n * tn - m.shape[3]))
    tiles = padded.view(m.shape[0], m.shape[1], -1, tm, n_n, tn).amax((3, 5))  # (Bm, Hm, n_m or 1, n_n)
    tiles = tiles.expand(m.shape[0], m.shape[1], n_m, n_n)
    if by_keys:
        tiles = tiles.transpose(2, 3)
    if m.shape[1] > 1 and groups > 1:
        tiles = tiles.unflatten(1, (m.shape[1] // groups, groups)).amax(2)
    blk = block_rows if by_keys else block_cols
    n = tiles.shape[3]
    idx = torch.arange(n, device=mask.device, dtype=torch.int32)
    seen = tiles != 0
    first = torch.where(seen, idx, n).amin(3)
    last = torch.where(seen, idx, -1).amax(3)
    r1 = (last + 1) * blk
    r0 = torch.minimum(first * blk, r1)
    ranges = torch.stack((r0, r1), -1).to(torch.int32).contiguous()
    return ranges, tuple(0 if ranges.shape[i] == 1 else ranges.stride(i) for i in (0, 1))


def _mask_arg(key_padding_mask, dummy):
    if key_padding_mask is None:
        return dummy, 0
    m = key_padding_mask if key_padding_mask.is_contiguous() else key_padding_mask.contiguous()
    return m.view(torch.uint8), m.stride(0)


def _varlen(varlen, q, Lq: int, Lk: int) -> tuple:
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, the offsets at unit stride
    (their kernels index them so); q and the lengths as stand-ins for a dense batch."""
    if varlen is None:
        return q, q, Lq, Lk
    cu_q, cu_k, max_q, max_k = varlen
    return common.unit(cu_q), common.unit(cu_k), max_q, max_k


def forward(q, k, v, out, lse, key_padding_mask, seed, causal: bool, scale: float, dropout_p: float, *,
            window=(-1, -1), varlen=None, softcap=0.0, sinks=None, alibi=None, bias=None, mask=None) -> None:
    """Writes ``out`` (a (B, Hq, Lq, D) view in q's dtype, any strides) and ``lse`` ((B, Hq, Lq)
    contiguous fp32, natural log). ``seed``: 1-element int64 tensor, read when dropout_p > 0.
    ``window``: (left, right) keys around the bottom-right diagonal, -1 = unlimited.
    ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` (int32 on q's
    device) for packed sequences, q, k, v and out then (1, H, total tokens, D) views, lse
    (1, Hq, total). ``softcap`` (0 = none), ``sinks`` ((Hq,) logits), ``alibi`` ((Hq,) or
    (B, Hq) fp32 slopes), ``bias`` / ``mask`` (float / bool, broadcastable to (B, Hq, Lq, Lk);
    dense batches only): the score modifications of ``_attn_fwd``."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if out.numel() == 0:
        return
    if Lk == 0:
        out.zero_()
        if sinks is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(sinks.float()[None, :, None].expand(lse.shape))
        return
    arch = common.arch(q.device)
    sq, sk, sv, so = _strides(q), _strides(k), _strides(v), _strides(out)
    block_d = _block_d(D)
    kind = _kind(q.dtype)
    use_tma = _use_tma(arch, kind, ((q, sq), (k, sk), (v, sv), (out, so)))
    dropout = dropout_p > 0.0
    mask_pad, stride_mb = _mask_arg(key_padding_mask, q)
    is_causal, has_window, win_left, win_right = _band(causal, window)
    cu_q, cu_k, max_q, max_k = _varlen(varlen, q, Lq, Lk)
    sinks = common.unit(sinks)
    nseq = cu_q.numel() - 1 if varlen is not None else B
    if varlen is None and not dropout and Lq <= DECODE_MAX_LQ and Lk >= DECODE_MIN_KEYS:
        if _decode(q, k, v, out, lse, mask_pad, stride_mb, sinks, alibi, bias, mask, softcap, scale, is_causal,
                   has_window, win_left, win_right, arch, kind, use_tma, block_d):
            return
    if hopper.ENABLED and hopper.supports(q, arch=arch, dropout_p=dropout_p, key_padding_mask=key_padding_mask,
                                          window=window, varlen=varlen, softcap=softcap, sinks=sinks,
                                          alibi=alibi, bias=bias, mask=mask, aligned=use_tma):
        hopper.forward(q, k, v, out, lse, is_causal, scale, (sq, sk, sv, so))  # opt-in (hopper.py)
        return
    score_mod = _score_mod(softcap, alibi, bias, mask)
    if score_mod:
        ptrs, strides, flags = _score_args((B, Hq, Lq, Lk), softcap, alibi, bias, mask, q)
        flags = tuple(flags.values())
    else:
        ptrs, strides, flags = (q, q, q), _NO_SCORE_STRIDES, _NO_SCORE_FLAGS
    tail_strides = (*sq, *sk, *sv, *so, stride_mb, *strides)
    tail = (Hq, Hq // Hkv, Lq, Lk, D, nseq, win_left, win_right, float(scale), float(dropout_p), float(softcap))
    head = (q, k, v, out, lse, mask_pad, seed if dropout else q, cu_q, cu_k, q if sinks is None else sinks, *ptrs)
    constexprs = _attn_constexprs(_FWD_EXTRA[sinks is not None], is_causal, has_window, varlen is not None,
                                  key_padding_mask is not None, dropout, flags, use_tma, kind == "ieee", D == block_d,
                                  block_d, arch == 0)
    # Lk's power-of-two factor (up to 128) is part of the key: it decides which warp-specialized
    # candidates (whole key blocks only, without causality) may run.
    cls = _class(has_window, varlen is not None, score_mod)
    key = (arch, _table_key(block_d, kind, dropout, cls), is_causal, key_padding_mask is not None, use_tma,
           _bucket(max_q), _bucket(max_k), min(Lk & -Lk, 128))
    # What the launch takes besides the config (a tuple, not a closure: no cells per call).
    launch = (q, k, v, out, sq, sk, sv, so, block_d, use_tma, mask, (B, Hq, Lq, Lk), head, tail_strides, tail,
              varlen, nseq, constexprs)
    cfg = _FWD_CACHE.chosen.get(key)
    if cfg is None:
        cands = _fwd_candidates(arch, key[1], use_tma, is_causal, Lk)
        if use_tma and arch and any(_device_descs(c, varlen) for c in cands):
            common.scratch_allocator()  # device-side descriptors' scratch, for the candidates' timing
        cfg = _choose(_FWD_CACHE, key, cands, _fwd_launch, launch)
    if use_tma and arch and _device_descs(cfg, varlen):
        common.scratch_allocator()  # device-side descriptors' scratch
    if use_tma:
        common.count_launch("attention_tma")
    _fwd_launch(cfg, launch)


def _device_descs(cfg, varlen) -> bool:
    """Whether the forward's TMA path builds descriptors on the device with ``cfg``: warp
    specialization, and packed sequences without ``VHOST`` (per-sequence descriptors)."""
    return cfg["WS"] or (varlen is not None and not cfg["VHOST"])


def _choose(cache, key, candidates, launch_fn, launch):
    """``cache``'s config for ``key``, timing ``candidates`` through ``launch_fn(cfg, launch)``."""
    return cache.get(key, candidates, lambda c: launch_fn(c, launch))


def _fwd_launch(cfg, launch):
    """The forward's launch with ``cfg``: its descriptors (host-side TMA), tile order and grid."""
    (q, k, v, out, sq, sk, sv, so, block_d, use_tma, mask, shape, head, tail_strides, tail, varlen, nseq,
     constexprs) = launch
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if use_tma and not cfg["WS"] and (varlen is None or cfg["VHOST"]):
        descs = (_tma_desc(q, sq, bm, block_d), _tma_desc(k, sk, bn, block_d), _tma_desc(v, sv, bn, block_d),
                 _tma_desc(out, so, bm, block_d))
    else:
        descs = (q, k, v, out)  # unused
    kr, skr = (q, (0, 0)) if mask is None else _mask_ranges(mask, shape, bm, bn)
    B, Hq, Lq, Lk = shape
    if varlen is not None:  # the virtual query blocks of every sequence (helpers._find_seq)
        tiles = (Lq // bm + nseq) * Hq
    else:
        tiles = -(-Lq // bm) * B * Hq
    sched = cfg["SCHED"]
    order, gh = q, 1  # unused without SCHED
    if sched:
        gh = _l2_heads(k, Lk, Hq, B)
        if varlen is not None:
            is_causal, window, win_left, win_right = (constexprs["IS_CAUSAL"], constexprs["WINDOW"], tail[6],
                                                      tail[7])
            order = _varlen_order(varlen[0], varlen[1], Lq // bm + nseq, bm, is_causal, window, win_left, win_right)
    grid = (_grid_size(min(tiles, common.sm_count(q.device)) if sched == 2 else tiles),)
    args = (*head[:9], order, *head[9:], kr, *descs, *tail_strides, *skr, *tail[:6], gh, *tail[6:])
    common.launch("attention_fwd", _attn_fwd, grid, args, constexprs, cfg)


# The L2 cache share the longest-first orders give each group of heads' K and V (half of the
# H100/H200's 50 MB: the group's blocks run together, their K/V read once from memory).
L2_BUDGET = 24 << 20


def _l2_heads(k, Lk: int, Hq: int, B: int) -> int:
    """Heads (flat batch * query head) per group of the ``SCHED`` orders: as many as share
    :data:`L2_BUDGET` bytes of K and V (a GQA group's query heads read one kv head's)."""
    per_head = 2 * Lk * k.shape[-1] * k.element_size() * k.shape[1] // max(Hq, 1)
    return max(1, min(B * Hq, L2_BUDGET // max(per_head, 1)))


def _varlen_order(cu_q, cu_k, n_virtual: int, bm: int, is_causal: bool, window: bool, win_left: int,
                  win_right: int) -> torch.Tensor:
    """The virtual query blocks of packed sequences (``helpers._find_seq``) by the keys each
    sees, most first (a stable sort: ties in block order), the unused ones last: the
    ``SCHED`` orders' ``ORDER`` (int32, on the device; torch ops, no synchronization)."""
    dev = cu_q.device
    nseq = cu_q.numel() - 1
    lq, lk = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    first = cu_q[:-1].long() // bm + torch.arange(nseq, device=dev)
    virt = torch.arange(n_virtual, device=dev)
    seq = torch.searchsorted(first, virt, right=True) - 1
    start = (virt - first[seq]) * bm
    sq, sk = lq[seq], lk[seq]
    hi = (start + bm + sk - sq + win_right).clamp(min=0).minimum(sk) if is_causal else sk
    lo = (start + sk - sq - win_left).clamp(min=0).minimum(sk) if window else torch.zeros_like(sk)
    work = torch.where(start < sq, (hi - lo).clamp(min=0) + 1, -1)
    return torch.sort(work, descending=True, stable=True).indices.to(torch.int32)


def _decode_splits(B, Hkv, n_rb, Lk, block_n, device) -> int:
    """Key chunks per (batch, kv head, row block): enough programs for two waves over the SMs,
    each chunk at least two key blocks; 1 = no split (the forward kernel is as good)."""
    programs = B * Hkv * n_rb
    target = 2 * common.sm_count(device)
    if programs >= target:
        return 1
    return max(1, min(common.cdiv(Lk, 2 * block_n), common.cdiv(target, programs)))


def _decode(q, k, v, out, lse, mask_pad, stride_mb, sinks, alibi, bias, mask, softcap, scale, is_causal,
            has_window, win_left, win_right, arch, kind, use_tma, block_d) -> bool:
    """Split-KV decoding (``decode.py``) where it pays: few query rows, a long cache, too few
    programs otherwise. Returns False (nothing launched) where the forward kernel should run.
    ``bias`` / ``mask``: the forward's score modifications (the mask summarized per (batch,
    kv head) over the group's Lq queries at the decode's key blocks: :func:`_mask_ranges`)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    groups = Hq // Hkv
    block_m = _decode_block_m(groups * Lq, block_d, kind)
    table_key = (*_table_key(block_d, kind, False)[:2], "plain" if bias is None and mask is None else "bias")
    cfg = _DECODE_CACHE.get((arch, table_key, use_tma, block_m), _candidates_decode(arch, table_key),
                            lambda c: None)
    block_n = cfg["BLOCK_N"]
    n_rb = common.cdiv(groups * Lq, block_m)
    n_splits = _decode_splits(B, Hkv, n_rb, Lk, block_n, q.device)
    if n_splits == 1:
        return False
    split_len = common.cdiv(common.cdiv(Lk, n_splits), block_n) * block_n
    n_splits = common.cdiv(Lk, split_len)
    sq, sk, sv, so = _strides(q), _strides(k), _strides(v), _strides(out)
    parts = common.empty((B * Hq, n_splits, Lq, block_d), torch.float32, q.device)
    lse_parts = common.empty((B * Hq, n_splits, Lq), torch.float32, q.device)
    ptrs, strides, flags = _score_args((B, Hq, Lq, Lk), softcap, alibi, bias, mask, q)
    kr, skr = (q, (0, 0)) if mask is None else _mask_ranges(mask, (B, Hq, Lq, Lk), Lq, block_n, groups=groups)
    if use_tma and arch:
        common.scratch_allocator()
    if use_tma:
        common.count_launch("attention_tma")
    common.launch("attention_decode", _attn_decode_split, (_grid_size(B * Hkv * n_rb * n_splits),),
                  (q, k, v, parts, lse_parts, mask_pad, *ptrs, kr, *sq, *sk, *sv, stride_mb, *strides, *skr, Hq, Hkv,
                   groups, Lq, Lk, D, win_left, win_right, n_splits, split_len, float(scale), float(softcap)),
                  common.constexprs(IS_CAUSAL=is_causal, WINDOW=has_window, HAS_PAD=mask_pad is not q, **flags,
                                    USE_TMA=use_tma, IEEE=kind == "ieee", EVEN_D=D == block_d, BLOCK_D=block_d,
                                    BLOCK_M=block_m, INTERPRET=arch == 0),
                  cfg)
    common.launch("attention_decode_combine", _attn_decode_combine, (_grid_size(B * Hq * common.cdiv(Lq, 16)),),
                  (parts, lse_parts, out, lse, q if sinks is None else sinks, *so, Hq, Lq, D, n_splits),
                  dict(HAS_SINKS=sinks is not None, BLOCK_D=block_d, BLOCK_M=16, INTERPRET=arch == 0),
                  common.Config.of(num_warps=4))
    return True


def _candidates_decode(arch, key):
    if arch == 0:
        return [configs.INTERPRET_DECODE]
    return DECODE_CONFIGS[arch][key]


def _score_mod(softcap, alibi, bias, mask) -> bool:
    return bool(softcap) or alibi is not None or bias is not None or mask is not None


def backward(do, q, k, v, out, lse, dlse, dq, dk, dv, key_padding_mask, seed, causal: bool, scale: float,
             dropout_p: float, *, window=(-1, -1), varlen=None, softcap=0.0, sinks=None, dsinks=None, alibi=None,
             bias=None, dbias=None, mask=None) -> None:
    """Writes the gradients into ``dq``, ``dk``, ``dv`` (views of q's, k's, v's shapes and dtypes;
    dk and dv with equal strides), dK/dV summed over each GQA group.

    ``do`` has out's shape (any strides, contiguous last dim); ``lse`` is the forward's;
    ``dlse`` ((B, Hq, Lq) fp32) or None is the gradient of the LSE output. ``window`` and
    ``varlen`` as in :func:`forward`, and the score modifications; ``dsinks`` ((Hq,) fp32) receives
    the sinks' gradient, ``dbias`` (contiguous, the bias's dtype and shape with leading 1s to
    4 dims) the bias's: dS summed over its broadcast dims (:func:`_dbias`).
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Lq == 0 or Lk == 0 or B == 0:
        # No query (nothing to differentiate) or no key (every row outputs the constant 0; the
        # LSE is the sink: d sink = sum of dLSE).
        for t in (dq, dk, dv) if dbias is None else (dq, dk, dv, dbias):
            t.zero_()
        if dsinks is not None:
            if dlse is None or Lq == 0 or B == 0:
                dsinks.zero_()
            else:
                dsinks.copy_(dlse.float().sum((0, 2)))
        return
    arch = common.arch(q.device)
    block_d = _block_d(D)
    cu_q, cu_k, max_q, max_k = _varlen(varlen, q, Lq, Lk)
    sinks = common.unit(sinks)
    nseq = cu_q.numel() - 1 if varlen is not None else B
    # Row statistics padded to a multiple of every backward query block (unmasked loads);
    # varlen: each sequence's rows (helpers._find_seq's virtual blocks of STAT_ALIGN rows).
    if varlen is not None:
        stride_stat = (Lq // STAT_ALIGN + nseq) * STAT_ALIGN
    else:
        stride_stat = common.cdiv(Lq, STAT_ALIGN) * STAT_ALIGN
    # A spare (batch, head) slab, never written: the dK/dV loops' loads a step past a group's
    # last head read it (backward._bwd_dkdv_program).
    stats = common.empty((B * Hq + 1, 2, stride_stat), torch.float32, q.device)
    n_pre = stride_stat // PRE_BLOCK_M
    # Per preprocess program, its part of the sinks' gradient (summed below: deterministic).
    dsink_parts = common.empty((B, Hq, n_pre), torch.float32, q.device) if sinks is not None else stats
    so, sdo = _strides(out), _strides(do)
    if dlse is not None and not dlse.is_contiguous():
        dlse = dlse.contiguous()  # e.g. the expanded gradient of lse.sum()
    common.launch("attention_bwd_preprocess", _attn_bwd_preprocess, (_grid_size(n_pre * B * Hq),),
                  (out, do, lse, dlse if dlse is not None else lse, stats, cu_q, lse if sinks is None else sinks,
                   dsink_parts, *so, *sdo, Hq, Lq, D, nseq, n_pre, stride_stat),
                  _pre_constexprs(dlse is not None, varlen is not None, sinks is not None, block_d,
                                  _kind(q.dtype) == "tf32"), _FOUR_WARPS)
    if sinks is not None:
        torch.sum(dsink_parts, (0, 2), out=dsinks)

    sq, sk, sv, sdq, sdk = _strides(q), _strides(k), _strides(v), _strides(dq), _strides(dk)
    kind = _kind(q.dtype)
    use_tma = _use_tma(arch, kind, ((q, sq), (k, sk), (v, sv), (do, sdo), (dq, sdq), (dk, sdk), (dv, sdk)))
    dropout = dropout_p > 0.0
    mask_pad, stride_mb = _mask_arg(key_padding_mask, q)
    groups = Hq // Hkv
    is_causal, has_window, win_left, win_right = _band(causal, window)
    score_mod = _score_mod(softcap, alibi, bias, mask)
    if score_mod:
        ptrs, strides, flags = _score_args((B, Hq, Lq, Lk), softcap, alibi, bias, mask, q)
        score_flags = tuple(flags.values())
    else:
        ptrs, strides, flags, score_flags = (q, q, q), _NO_SCORE_STRIDES, None, _NO_SCORE_FLAGS
    if hopper_bwd.ENABLED and hopper_bwd.taken(
            q, arch=arch, dropout_p=dropout_p, key_padding_mask=key_padding_mask,
            has_window=has_window or win_right > 0, varlen=varlen, score_mod=score_mod, dbias=dbias, aligned=use_tma):
        # Opt-in, never in deterministic mode (hopper_bwd.py): the Gluon backward, dQ reduce-added.
        common.count_launch("attention_tma")
        hopper_bwd.backward(q, k, v, do, dq, dk, dv, stats, stride_stat, is_causal, scale,
                            (sq, sk, sv, sdo, sdq, sdk))
        return
    if backward_atomic.ENABLED and backward_atomic.taken(
            arch=arch, dtype=q.dtype, block_d=block_d, use_tma=use_tma, dropout_p=dropout_p,
            key_padding_mask=key_padding_mask, has_window=has_window or win_right > 0, varlen=varlen,
            score_mod=score_mod, dbias=dbias):
        # Opt-in, never in deterministic mode (backward_atomic.py): dQ reduce-added in fp32.
        common.count_launch("attention_tma")
        backward_atomic.backward(q, k, v, do, dq, dk, dv, stats, stride_stat, is_causal, scale,
                                 (sq, sk, sv, sdo, sdq, sdk), arch, block_d)
        return
    constexprs = _attn_constexprs(_BWD_EXTRA, is_causal, has_window, varlen is not None, key_padding_mask is not None,
                                  dropout, score_flags, use_tma, kind == "ieee", D == block_d, block_d, arch == 0)
    if use_tma and arch:
        common.scratch_allocator()  # device-side descriptors' scratch
    # The launch's arguments but the mask ranges, and what its grid and ranges take (no closure).
    launch = ((q, k, v, do, dq, dk, dv, stats, mask_pad, seed if dropout else q, cu_q, cu_k, *ptrs),
              (*sq, *sk, *sv, *sdo, *sdq, *sdk, stride_mb, stride_stat, *strides),
              (Hq, Hkv, groups, Lq, Lk, D, nseq, win_left, win_right, float(scale), float(dropout_p), float(softcap)),
              mask, (B, Hq, Lq, Lk), groups, varlen, nseq, Hkv, constexprs)
    cls = _class(has_window, varlen is not None, score_mod)
    key = (arch, _table_key(block_d, kind, dropout, cls), is_causal,
           key_padding_mask is not None, use_tma, _bucket(max_q), _bucket(max_k))
    cfg = _BWD_CACHE.chosen.get(key)
    if cfg is None:
        cfg = _choose(_BWD_CACHE, key, _bwd_candidates(arch, key[1], use_tma), _bwd_launch, launch)
    if use_tma:
        common.count_launch("attention_tma")
    _bwd_launch(cfg, launch)
    if dbias is not None:
        _dbias(do, q, k, v, stats, stride_stat, mask_pad, stride_mb, seed, dropout_p, ptrs, strides, flags, dbias,
               mask, is_causal, has_window, win_left, win_right, scale, softcap, arch, kind, block_d, use_tma)


def _bwd_candidates(arch, key, use_tma):
    return _candidates(BWD_CONFIGS, configs.INTERPRET_BWD, arch, key, use_tma)


def _bwd_launch(cfg, launch):
    """The backward's launch with ``cfg``: its mask ranges (with a general mask), program
    order and grid (``SCHED`` 2: one program per SM, persistent)."""
    ptrs, strides, tail, mask, shape, groups, varlen, nseq, Hkv, constexprs = launch
    q = ptrs[0]
    if mask is None:
        kr, skr, qr, sqr = q, (0, 0), q, (0, 0)
    else:
        kr, skr = _mask_ranges(mask, shape, cfg["BLOCK_M2"], cfg["BLOCK_N2"])
        qr, sqr = _mask_ranges(mask, shape, cfg["BLOCK_M1"], cfg["BLOCK_N1"], by_keys=True, groups=groups)
    B, _, Lq, Lk = shape
    if varlen is not None:  # virtual key and query blocks (helpers._find_seq)
        n_kv, n_q = Lk // cfg["BLOCK_N1"] + nseq, Lq // cfg["BLOCK_M2"] + nseq
    else:
        n_kv, n_q = -(-Lk // cfg["BLOCK_N1"]), -(-Lq // cfg["BLOCK_M2"])
    per_head = n_kv * (2 if cfg["SPLIT_KV"] else 1) + n_q * groups
    order, gh = q, 1  # unused without SCHED
    if cfg["SCHED"]:
        gh = _l2_heads(ptrs[1], Lk, Hkv, B)  # kv heads per group
        order = _bwd_order(cfg, varlen, Lq, Lk, n_kv, n_q, groups, constexprs, tail[7], tail[8], q.device)
    programs = per_head * B * Hkv
    grid = (_grid_size(min(programs, common.sm_count(q.device)) if cfg["SCHED"] == 2 else programs),)
    if cfg["HOST_DESC"] and constexprs["USE_TMA"] and varlen is None:
        descs = _bwd_descs(cfg, ptrs, strides, constexprs["BLOCK_D"])
    else:
        descs = (q,) * 12  # unused
    common.launch("attention_bwd", _attn_bwd, grid,
                  (*ptrs[:12], order, *ptrs[12:], kr, qr, *descs, *strides, *skr, *sqr, *tail[:7], gh, *tail[7:]),
                  constexprs, cfg)


def _bwd_descs(cfg, ptrs, strides, block_d: int) -> tuple:
    """The backward's host-side descriptors (``HOST_DESC``; ``backward._attn_bwd``'s QD1 ..
    DQD): Q, dO, K, V, dK, dV and STATS at the dK/dV programs' blocks, Q, dO, K, V and dQ at
    the dQ programs'; with ``HOST_DESC`` 2 only those of the tiles a program reads or writes
    once (the loops' are unused: the tensor in their place). ``strides``: the launch's (q, k,
    v, do, dq, dk strides first)."""
    q, k, v, do, dq, dk, dv, stats = ptrs[:8]
    sq, sk, sv, sdo, sdq, sdk = (tuple(strides[3 * i:3 * i + 3]) for i in range(6))
    m1, n1, m2, n2 = cfg["BLOCK_M1"], cfg["BLOCK_N1"], cfg["BLOCK_M2"], cfg["BLOCK_N2"]
    edges = (_tma_desc(k, sk, n1, block_d), _tma_desc(v, sv, n1, block_d), _tma_desc(dk, sdk, n1, block_d),
             _tma_desc(dv, sdk, n1, block_d), _tma_desc(q, sq, m2, block_d), _tma_desc(do, sdo, m2, block_d),
             _tma_desc(dq, sdq, m2, block_d))
    if cfg["HOST_DESC"] == 2:
        return (q, q, *edges[:2], q, *edges[2:6], q, q, edges[6])
    loops = (_tma_desc(q, sq, m1, block_d), _tma_desc(do, sdo, m1, block_d), _stats_desc(stats, stats.shape[2], m1),
             _tma_desc(k, sk, n2, block_d), _tma_desc(v, sv, n2, block_d))
    return (*loops[:2], *edges[:2], loops[2], *edges[2:6], *loops[3:], edges[6])


def _stats_desc(stats, stride_stat: int, block_m: int):
    """Host-side descriptor over the backward's row statistics ``stats`` ((B * Hq + 1, 2,
    stride_stat) fp32, contiguous), block (1, 2, block_m): a query block's LSE and delta rows
    (``_tma_desc``'s fast path after the first of a block shape)."""
    shape, desc_strides, block_shape = list(stats.shape), [2 * stride_stat, stride_stat, 1], [1, 2, block_m]
    if ("stats", block_m) not in _DESC_BLOCKS:
        desc = TensorDescriptor(stats, shape, desc_strides, block_shape)
        _DESC_BLOCKS.add(("stats", block_m))
        return desc
    desc = _new_object(TensorDescriptor)
    desc.__dict__ = {"base": stats, "shape": shape, "strides": desc_strides, "block_shape": block_shape,
                     "padding": "zero"}
    return desc


_BWD_ORDERS = {}  # dense batches' program orders, by shape, config and band


def _bwd_order(cfg, varlen, Lq: int, Lk: int, n_kv: int, n_q: int, groups: int, constexprs, win_left: int,
               win_right: int, device) -> torch.Tensor:
    """A kv head's backward programs (``backward._attn_bwd``'s numbering: dK/dV, or dV then dK
    with ``SPLIT_KV``, then the group's dQ) by their work, most first (a stable sort), the
    unused virtual blocks of packed sequences last: int32 on the device. Work: score elements
    times the products per element (dK and dV together 4, dV alone 2, dK alone 3, dQ 3).
    Dense batches: cached per shape; packed sequences: torch ops on the device (no sync)."""
    causal, window = constexprs["IS_CAUSAL"], constexprs["WINDOW"]
    key = (device, Lq, Lk, groups, cfg, causal, window, win_left, win_right)
    if varlen is None and key in _BWD_ORDERS:
        return _BWD_ORDERS[key]
    if varlen is None:
        # [0, n] by a device op (no host copy: a first call under CUDA graph capture works)
        cu_q, cu_k = (torch.arange(2, device=device) * n for n in (Lq, Lk))
    else:
        cu_q, cu_k = varlen[0].long(), varlen[1].long()
    nseq = cu_q.numel() - 1
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    seqs = torch.arange(nseq, device=device)

    def blocks(cu, lens, n, bm, reverse):
        # per virtual block (helpers._find_seq): its sequence, first row within it, and use
        first = cu[:-1] // bm + seqs
        v = torch.arange(n, device=device)
        v = n - 1 - v if reverse else v
        seq = torch.searchsorted(first, v, right=True) - 1
        start = (v - first[seq]) * bm
        return seq, start, start < lens[seq]

    bn1, bm2 = cfg["BLOCK_N1"], cfg["BLOCK_M2"]
    seq, start, used = blocks(cu_k, lk, n_kv, bn1, False)
    sq, sk = lq[seq], lk[seq]
    lo = (start - (sk - sq + win_right)).clamp(min=0).minimum(sq) if causal else torch.zeros_like(sq)
    hi = (start + bn1 - (sk - sq - win_left)).clamp(min=0).minimum(sq) if window else sq
    kv = torch.where(used, (hi - lo).clamp(min=0) * groups * bn1 + 1, -1)
    seq, start, used = blocks(cu_q, lq, n_q, bm2, True)
    sq, sk = lq[seq], lk[seq]
    hi = (start + bm2 + sk - sq + win_right).clamp(min=0).minimum(sk) if causal else sk
    lo = (start + sk - sq - win_left).clamp(min=0).minimum(sk) if window else torch.zeros_like(sk)
    dq = torch.where(used, (hi - lo).clamp(min=0) * bm2 * 3 + 1, -1).repeat(groups)
    if cfg["SPLIT_KV"]:
        work = torch.cat((torch.where(kv > 0, kv * 2, kv), torch.where(kv > 0, kv * 3, kv), dq))
    else:
        work = torch.cat((torch.where(kv > 0, kv * 4, kv), dq))
    order = torch.sort(work, descending=True, stable=True).indices.to(torch.int32)
    if varlen is None:
        if len(_BWD_ORDERS) > 256:
            _BWD_ORDERS.clear()
        _BWD_ORDERS[key] = order
    return order


def _dbias(do, q, k, v, stats, stride_stat, mask_pad, stride_mb, seed, dropout_p, ptrs, strides, flags, dbias,
           mask, is_causal, has_window, win_left, win_right, scale, softcap, arch, kind, block_d, use_tma) -> None:
    """The bias's gradient into ``dbias`` (``dbias._attn_dbias``): one program per tile of
    it, each summing the dS tiles of the batches, heads, query and key blocks that broadcast
    into it (in a fixed order). ``stats``: the backward's row statistics."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    cfg = DBIAS_CONFIGS[arch][_table_key(block_d, kind, False)[:2]] if arch else configs.INTERPRET_DBIAS
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    nm, nn = common.cdiv(Lq, bm), common.cdiv(Lk, bn)
    walk_b, walk_h = dbias.shape[0] == 1 and B > 1, dbias.shape[1] == 1 and Hq > 1
    sum_m, sum_n = dbias.shape[2] == 1 and Lq > 1, dbias.shape[3] == 1 and Lk > 1
    out = (1 if walk_b else B, 1 if walk_h else Hq, 1 if sum_m else nm, 1 if sum_n else nn)
    walk = (B if walk_b else 1, Hq if walk_h else 1, nm if sum_m else 1, nn if sum_n else 1)
    sdb = (0 if walk_b else dbias.stride(0), 0 if walk_h else dbias.stride(1), dbias.stride(2))
    slopes, bias_t, mask_t = ptrs
    sq, sk, sv, sdo = _strides(q), _strides(k), _strides(v), _strides(do)
    if use_tma:
        descs = (_tma_desc(q, sq, bm, block_d), _tma_desc(k, sk, bn, block_d), _tma_desc(v, sv, bn, block_d),
                 _tma_desc(do, sdo, bm, block_d))
    else:
        descs = (q, k, v, do)  # unused
    kr, skr = (q, (0, 0)) if mask is None else _mask_ranges(mask, (B, Hq, Lq, Lk), bm, bn)
    common.launch("attention_dbias", _attn_dbias, (_grid_size(out[0] * out[1] * out[2] * out[3]),),
                  (q, k, v, do, *descs, stats, mask_pad, seed if dropout_p > 0 else q, slopes, bias_t, mask_t, kr,
                   dbias, *sq, *sk, *sv, *sdo, stride_mb, stride_stat, *strides, *sdb, *skr,
                   Hq, Hq // Hkv, Lq, Lk, D, win_left, win_right, float(scale), float(dropout_p), float(softcap),
                   *walk, *out[1:]),
                  dict(IS_CAUSAL=is_causal, WINDOW=has_window, HAS_PAD=mask_pad is not q, HAS_DROPOUT=dropout_p > 0,
                       SOFTCAP=flags["SOFTCAP"], HAS_ALIBI=flags["HAS_ALIBI"], HAS_AMASK=flags["HAS_AMASK"],
                       SUM_M=sum_m, SUM_N=sum_n, USE_TMA=use_tma, IEEE=kind == "ieee", BLOCK_D=block_d,
                       INTERPRET=arch == 0),
                  cfg)


def dropout_keep_mask(seed, B: int, Hq: int, Lq: int, Lk: int, dropout_p: float, device) -> torch.Tensor:
    """The bool keep mask (B, Hq, Lq, Lk) the kernels use for ``seed`` (a test helper)."""
    out = torch.empty((B, Hq, Lq, Lk), dtype=torch.uint8, device=device)
    if out.numel() == 0:
        return out.bool()
    bm = bn = 32
    nm, nn = common.cdiv(Lq, bm), common.cdiv(Lk, bn)
    common.launch("attention_dropout_mask", _dropout_mask_kernel, (_grid_size(nm * nn * B * Hq),),
                  (seed, out, Hq, Lq, Lk, nm, nn, float(dropout_p)), dict(BLOCK_M=bm, BLOCK_N=bn),
                  common.Config.of(num_warps=4))
    return out.bool()




def kv_cache_append(k_cache, v_cache, k, v, cache_seqlens) -> None:
    """Writes k, v ((B, Hkv, L_new, D), any strides with a contiguous last dim) into the caches
    ((B, Hkv, L_cache, D)) at rows cache_seqlens[b] + i, in place (``decode._kv_cache_append``)."""
    B, Hkv, L_new, D = k.shape
    if k.numel() == 0:
        return
    block_m = 16
    n_rb = common.cdiv(L_new, block_m)
    cache_seqlens = common.unit(cache_seqlens)
    common.launch("attention_kv_append", _kv_cache_append, (_grid_size(B * Hkv * n_rb),),
                  (k_cache, v_cache, k, v, cache_seqlens, *k_cache.stride()[:3], *v_cache.stride()[:3],
                   *k.stride()[:3], *v.stride()[:3], Hkv, L_new, k_cache.shape[2], D),
                  dict(BLOCK_D=_block_d(D), BLOCK_M=block_m), common.Config.of(num_warps=4))
