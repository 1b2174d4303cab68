"""Host side of the attention kernels: data-path choice (TMA or pointers), tensor descriptors,
config lookup and the launches. Inputs are validated by ``fused_block.attention``; every last
dim is contiguous."""
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_block.kernels import common
from fused_block.kernels.attention.backward import _attn_bwd, _attn_bwd_preprocess
from fused_block.kernels.attention import configs
from fused_block.kernels.attention.configs import (BWD_CONFIGS, FWD_CONFIGS, PRE_BLOCK_M, STAT_ALIGN, _bucket, _bwd_cfg,
                                                   _block_d, _fwd_cfg, _kind, _table_key)
from fused_block.kernels.attention.forward import _attn_fwd
from fused_block.kernels.attention.helpers import _dropout_mask_kernel

# Tests set this to "pointer" to run the pointer path where TMA would be taken (the interpreter
# runs the TMA path by default wherever the layout allows it, as Hopper does).
FORCE_PATH = None

# ---------------------------------------------------------------------------------------------
# launchers (inputs validated by fused_block.attention; every last dim contiguous)
# ---------------------------------------------------------------------------------------------

_FWD_CACHE = common.ConfigCache("attention_fwd")
_BWD_CACHE = common.ConfigCache("attention_bwd")
_ALLOCATORS = {}


def _allocator(device):
    """``triton.set_allocator`` callback: descriptor scratch on ``device``'s caching allocator."""
    alloc = _ALLOCATORS.get(device)
    if alloc is None:
        def alloc(size, alignment, stream):
            return torch.empty(size, dtype=torch.int8, device=device)
        _ALLOCATORS[device] = alloc
    return alloc


def _strides(t):
    """(batch, head, row) strides of a (B, H, L, D) view. A size-1 dim's stride is never used to
    move, so it gets a stand-in that never blocks TMA: an aligned nonzero value (the next
    inner dim's extent; descriptor strides)."""
    B, H, L = t.shape[:3]
    sb, sh, sl = t.stride()[:3]
    sl = sl if L > 1 else 16
    sh = sh if H > 1 else sl * L
    return (sb if B > 1 else sh * H, sh, sl)


def _tma_desc(t, strides, block: int, block_d: int):
    """Host-side TMA descriptor over the (B, H, L, D) view ``t`` (``strides`` from
    :func:`_strides`), block (1, 1, block, block_d): rows past L and columns past D read as
    zero and are not written."""
    return TensorDescriptor(t, list(t.shape), [*strides, 1], [1, 1, block, block_d])


def _aligned(t, strides) -> bool:
    """TMA-able: 16-byte aligned base and strides, and no broadcast (zero-stride) head or row."""
    es = t.element_size()
    return (t.data_ptr() % 16 == 0 and all(s * es % 16 == 0 for s in strides)
            and strides[1] != 0 and strides[2] != 0)


def _use_tma(arch: int, kind: str, pairs) -> bool:
    """TMA on Hopper and in the interpreter, for layouts whose bases and strides are 16-byte
    aligned (descriptors require it); ``pairs`` are (tensor, strides). Hopper's IEEE fp32
    products run on FMA units from registers: pointer loads there (TMA staging spills)."""
    if FORCE_PATH == "pointer" or arch not in (0, 90) or (arch == 90 and kind == "ieee"):
        return False
    return all(_aligned(t, s) for t, s in pairs)


def _grid_size(n_programs: int) -> int:
    if n_programs > 2**31 - 1:
        raise ValueError(f"attention: {n_programs} programs exceed CUDA's grid limit; split the batch")
    return n_programs


def _candidates(tables, interpret_cfg, arch, key, use_tma):
    if arch == 0:
        if "SPLIT_KV" in interpret_cfg.meta():
            # Split dK/dV programs where the GPU tables split them, so the interpreter runs them.
            split = any(c["SPLIT_KV"] for t in tables.values() for c in t[key])
            interpret_cfg = _bwd_cfg(*(interpret_cfg[n] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")),
                                     interpret_cfg.num_warps, interpret_cfg.num_stages, split)
        return [interpret_cfg]
    cands = tables[arch][key]
    # sm_90's pointer path (unaligned layouts only) runs the first candidate, compiled as such.
    return cands if use_tma or arch != 90 else cands[:1]


def _fwd_candidates(arch, key, use_tma, causal, Lk):
    """The forward's candidates; warp-specialized ones only where their single unmasked K/V
    loop is exact (causal, or whole key blocks). The interpreter's one config runs without
    warp specialization otherwise."""
    cands = _candidates(FWD_CONFIGS, configs.INTERPRET_FWD, arch, key, use_tma)
    ok = [c for c in cands if not c["WS"] or causal or Lk % c["BLOCK_N"] == 0]
    if ok:
        return ok
    return [_fwd_cfg(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages) for c in cands]


def _mask_arg(key_padding_mask, dummy):
    if key_padding_mask is None:
        return dummy, 0
    m = key_padding_mask if key_padding_mask.is_contiguous() else key_padding_mask.contiguous()
    return m.view(torch.uint8), m.stride(0)


def forward(q, k, v, out, lse, key_padding_mask, seed, causal: bool, scale: float, dropout_p: float) -> None:
    """Writes ``out`` (a (B, Hq, Lq, D) view in q's dtype, any strides) and ``lse`` ((B, Hq, Lq)
    contiguous fp32, natural log). ``seed``: 1-element int64 tensor, read when dropout_p > 0."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if out.numel() == 0:
        return
    if Lk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    arch = common.arch(q.device)
    sq, sk, sv, so = _strides(q), _strides(k), _strides(v), _strides(out)
    block_d = _block_d(D)
    kind = _kind(q.dtype)
    use_tma = _use_tma(arch, kind, ((q, sq), (k, sk), (v, sv), (out, so)))
    dropout = dropout_p > 0.0
    mask, stride_mb = _mask_arg(key_padding_mask, q)
    tail = (*sq, *sk, *sv, *so, stride_mb, Hq, Hq // Hkv, Lq, Lk, D, float(scale), float(dropout_p))
    head = (q, k, v, out, lse, mask, seed if dropout else q)
    constexprs = dict(IS_CAUSAL=bool(causal), HAS_PAD=key_padding_mask is not None, HAS_DROPOUT=dropout,
                      USE_TMA=use_tma, IEEE=kind == "ieee", EVEN_D=D == block_d, BLOCK_D=block_d,
                      INTERPRET=arch == 0)
    # Lk's power-of-two factor (up to 128) is part of the key: it decides which warp-specialized
    # candidates (whole key blocks only, without causality) may run.
    key = (arch, _table_key(block_d, kind, dropout), bool(causal), key_padding_mask is not None, use_tma,
           _bucket(Lq), _bucket(Lk), min(Lk & -Lk, 128))
    cands = _fwd_candidates(arch, key[1], use_tma, bool(causal), Lk)
    if use_tma and arch and any(c["WS"] for c in cands):
        triton.set_allocator(_allocator(q.device))  # WS configs build their descriptors on the device

    def args(cfg):
        if use_tma and not cfg["WS"]:
            bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
            descs = (_tma_desc(q, sq, bm, block_d), _tma_desc(k, sk, bn, block_d), _tma_desc(v, sv, bn, block_d),
                     _tma_desc(out, so, bm, block_d))
        else:
            descs = (q, k, v, out)  # unused
        return head + descs + tail

    def grid(cfg):
        return (_grid_size(common.cdiv(Lq, cfg["BLOCK_M"]) * B * Hq),)

    cfg = _FWD_CACHE.get(key, cands,
                         lambda c: common.launch("attention_fwd", _attn_fwd, grid(c), args(c), constexprs, c))
    if use_tma:
        common.count_launch("attention_tma")
    common.launch("attention_fwd", _attn_fwd, grid(cfg), args(cfg), constexprs, cfg)


def backward(do, q, k, v, out, lse, dlse, dq, dk, dv, key_padding_mask, seed, causal: bool, scale: float,
             dropout_p: float) -> None:
    """Writes the gradients into ``dq``, ``dk``, ``dv`` (views of q's, k's, v's shapes and dtypes;
    dk and dv with equal strides), dK/dV summed over each GQA group.

    ``do`` has out's shape (any strides, contiguous last dim); ``lse`` is the forward's;
    ``dlse`` ((B, Hq, Lq) fp32) or None is the gradient of the LSE output.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Lq == 0 or Lk == 0 or B == 0:
        # No query (nothing to differentiate) or no key (every row outputs the constant 0).
        for t in (dq, dk, dv):
            t.zero_()
        return
    arch = common.arch(q.device)
    block_d = _block_d(D)
    # Row statistics padded to a multiple of every backward query block (unmasked loads).
    stride_stat = common.cdiv(Lq, STAT_ALIGN) * STAT_ALIGN
    stats = common.empty((B * Hq, 2, stride_stat), torch.float32, q.device)
    n_pre = stride_stat // PRE_BLOCK_M
    so, sdo = _strides(out), _strides(do)
    if dlse is not None and not dlse.is_contiguous():
        dlse = dlse.contiguous()  # e.g. the expanded gradient of lse.sum()
    common.launch("attention_bwd_preprocess", _attn_bwd_preprocess, (_grid_size(n_pre * B * Hq),),
                  (out, do, lse, dlse if dlse is not None else lse, stats, *so, *sdo, Hq, Lq, D, n_pre,
                   stride_stat),
                  dict(HAS_DLSE=dlse is not None, BLOCK_D=block_d, BLOCK_M=PRE_BLOCK_M),
                  common.Config.of(num_warps=4))

    sq, sk, sv, sdq, sdk = _strides(q), _strides(k), _strides(v), _strides(dq), _strides(dk)
    kind = _kind(q.dtype)
    use_tma = _use_tma(arch, kind, ((q, sq), (k, sk), (v, sv), (do, sdo), (dq, sdq), (dk, sdk), (dv, sdk)))
    dropout = dropout_p > 0.0
    mask, stride_mb = _mask_arg(key_padding_mask, q)
    groups = Hq // Hkv
    args = (q, k, v, do, dq, dk, dv, stats, mask, seed if dropout else q,
            *sq, *sk, *sv, *sdo, *sdq, *sdk, stride_mb, stride_stat, Hq, Hkv, groups, Lq, Lk, D, float(scale),
            float(dropout_p))
    constexprs = dict(IS_CAUSAL=bool(causal), HAS_PAD=key_padding_mask is not None, HAS_DROPOUT=dropout,
                      USE_TMA=use_tma, IEEE=kind == "ieee", EVEN_D=D == block_d, BLOCK_D=block_d,
                      INTERPRET=arch == 0)
    if use_tma and arch:
        triton.set_allocator(_allocator(q.device))

    def grid(cfg):
        kv_programs = common.cdiv(Lk, cfg["BLOCK_N1"]) * (2 if cfg["SPLIT_KV"] else 1)
        per_head = kv_programs + common.cdiv(Lq, cfg["BLOCK_M2"]) * groups
        return (_grid_size(per_head * B * Hkv),)

    key = (arch, _table_key(block_d, kind, dropout), bool(causal), key_padding_mask is not None, use_tma,
           _bucket(Lq), _bucket(Lk))
    cfg = _BWD_CACHE.get(key, _candidates(BWD_CONFIGS, configs.INTERPRET_BWD, arch, key[1], use_tma),
                         lambda c: common.launch("attention_bwd", _attn_bwd, grid(c), args, constexprs, c))
    if use_tma:
        common.count_launch("attention_tma")
    common.launch("attention_bwd", _attn_bwd, grid(cfg), args, constexprs, cfg)


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


