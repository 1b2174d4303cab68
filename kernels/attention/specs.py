"""Ahead-of-time compile specs of the attention kernels: every shipped config on its own arch
(``kernels/aot.py`` compiles them; ``tests/test_compile.py`` holds them spill-free)."""
import os

from fused_block.kernels.attention.backward import _attn_bwd, _attn_bwd_preprocess
from fused_block.kernels.attention.configs import BWD_CONFIGS, FWD_CONFIGS, PRE_BLOCK_M
from fused_block.kernels.attention.forward import _attn_fwd
from fused_block.kernels.attention.helpers import _dropout_mask_kernel

# ---------------------------------------------------------------------------------------------
# ahead-of-time compile specs
# ---------------------------------------------------------------------------------------------

def _signature(fn, ptr_types: dict, floats=("scale", "dropout_p")) -> dict:
    sig = {}
    for param in fn.params:
        if param.is_constexpr:
            sig[param.name] = "constexpr"
        elif param.name in ptr_types:
            sig[param.name] = ptr_types[param.name]
        else:
            sig[param.name] = "fp32" if param.name in floats else "i32"
    return sig


def _aligned_args(fn):
    return tuple(n for n in fn.arg_names if n.startswith("stride_") and n != "stride_mb") + ("D",)


def _data_ptrs(fn, dt, meta=None, block_d=None, tma=False):
    """Argument types: data pointers, and the forward's descriptor arguments (host-side
    descriptors on its TMA path without warp specialization, else the tensors)."""
    ptrs = {p: f"*{dt}" for p in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "QD", "KD", "VD", "OD")
            if p in fn.arg_names}
    if tma and meta is not None and "WS" in meta and not meta["WS"]:
        for p, block in (("QD", "BLOCK_M"), ("KD", "BLOCK_N"), ("VD", "BLOCK_N"), ("OD", "BLOCK_M")):
            ptrs[p] = f"tensordesc<{dt}[1, 1, {meta[block]}, {block_d}]>"
    ptrs.update({p: "*fp32" for p in ("LSE", "STATS") if p in fn.arg_names})
    ptrs.update(MASK="*u8", SEED="*i64")
    return ptrs


def _aot_combos(block_d_class: int, tma: bool, exhaustive: bool):
    """The runtime combinations of one table entry the compile check builds, as (IS_CAUSAL,
    HAS_PAD, BLOCK_D, EVEN_D). Near 255 registers ptxas is not monotonic in them (configs
    spilled with causal and padding off and not on, or only with D == BLOCK_D), so
    ``exhaustive`` builds their product: causal x padding x every BLOCK_D of the class (16
    and 32 run the 64 class's tiles) x EVEN_D (D == BLOCK_D, or a smaller multiple of 16 with
    column masks; the TMA path has no column masks, so EVEN_D does not reach its code). The
    default check builds, at the class's BLOCK_D, causal x padding with EVEN_D alternating on
    the pointer path (every pair of the three flags in all four states) and causal + padding
    and neither on the TMA path (where every spill of the product showed).

    Strides and D carry the 16-divisibility hint in both: head dims that are odd multiples of
    8 (24, 40, 72, ...) give the pointer path neither, and it spills there (see README)."""
    if not exhaustive:
        for causal, pad in ((True, True), (False, False)) if tma else ((True, True), (False, False), (True, False),
                                                                      (False, True)):
            yield causal, pad, block_d_class, tma or causal != pad
        return
    for causal, pad in ((True, True), (False, False), (True, False), (False, True)):
        for bd in (16, 32, 64) if block_d_class == 64 else (block_d_class,):
            for even in (True,) if tma or bd < 64 else (True, False):
                yield causal, pad, bd, even


def aot_specs(exhaustive=None) -> list:
    """Every shipped config on its own arch (bf16 for the "16" kind, fp32 for tf32/ieee; ieee
    products are not wgmma) in the runtime combinations of :func:`_aot_combos`, with dropout as
    its list says. sm_90: TMA (asserted), plus pointer loads for each list's first config (IEEE
    fp32: pointers only); sm_80: pointers. ``exhaustive`` (default: ``FUSED_BLOCK_AOT_ALL=1``)
    builds every combination and compiles a config in both a class's dropout and no-dropout
    lists both ways; the default check compiles such a config once, with dropout."""
    from fused_block.kernels import aot  # only the compile check needs it

    if exhaustive is None:
        exhaustive = os.environ.get("FUSED_BLOCK_AOT_ALL", "0") == "1"

    def paths(arch, kind, cfgs):
        # sm_90 runs a list on TMA (except IEEE fp32) and its first config on pointers too.
        for i, cfg in enumerate(cfgs):
            for tma in ((True, False) if i == 0 else (True,)) if arch == 90 and kind != "ieee" else (False,):
                yield cfg, tma

    specs = []
    for kname, fn, tables in (("fwd", _attn_fwd, FWD_CONFIGS), ("bwd", _attn_bwd, BWD_CONFIGS)):
        for arch, table in tables.items():
            for (block_d, kind, dropout), cfgs in table.items():
                dt = "bf16" if kind == "16" else "fp32"
                with_dropout = set(paths(arch, kind, table.get((block_d, kind, True), ())))
                for cfg, tma in paths(arch, kind, cfgs):
                    if not dropout and not exhaustive and (cfg, tma) in with_dropout:
                        continue
                    m = cfg.meta()
                    blocks = (f"{m['BLOCK_M']}x{m['BLOCK_N']}" if kname == "fwd" else
                              f"{m['BLOCK_M1']}x{m['BLOCK_N1']}/{m['BLOCK_M2']}x{m['BLOCK_N2']}"
                              f"{' split' if m['SPLIT_KV'] else ''}")
                    blocks += " ws" if m.get("WS") else ""
                    for causal, pad, bd, even in _aot_combos(block_d, tma, exhaustive):
                        specs.append(aot.KernelSpec(
                            name=(f"attention_{kname} D{block_d} {kind}{' dropout' if dropout else ''} {blocks} "
                                  f"{'tma' if tma else 'ptr'}: {'causal' if causal else 'full'}"
                                  f"{' pad' if pad else ''}{f' D{bd}' if bd != block_d else ''}"
                                  f"{'' if even else ' ragged'}"),
                            fn=fn, signature=_signature(fn, _data_ptrs(fn, dt, m, bd, tma)),
                            constexprs=dict(IS_CAUSAL=causal, HAS_PAD=pad, HAS_DROPOUT=dropout, USE_TMA=tma,
                                            IEEE=kind == "ieee", EVEN_D=even, BLOCK_D=bd, INTERPRET=False, **m),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=_aligned_args(fn),
                            wgmma=kind != "ieee", tma=tma, archs=(arch,)))
    specs.append(aot.KernelSpec(
        name="attention_bwd_preprocess D128 bf16", fn=_attn_bwd_preprocess,
        signature=_signature(_attn_bwd_preprocess, {"O": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DLSE": "*fp32",
                                                    "STATS": "*fp32"}),
        constexprs=dict(HAS_DLSE=True, BLOCK_D=128, BLOCK_M=PRE_BLOCK_M), num_warps=4,
        aligned=_aligned_args(_attn_bwd_preprocess)))
    specs.append(aot.KernelSpec(
        name="attention_dropout_mask", fn=_dropout_mask_kernel,
        signature=_signature(_dropout_mask_kernel, {"SEED": "*i64", "OUT": "*u8"}),
        constexprs=dict(BLOCK_M=32, BLOCK_N=32), num_warps=4))
    return specs
