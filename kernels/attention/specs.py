"""Ahead-of-time compile specs of the attention kernels: every shipped config on its own arch
(``kernels/aot.py`` compiles them; ``tests/test_compile.py`` holds them spill-free)."""
import dataclasses
import os

from fused_block.kernels.attention.backward import _attn_bwd, _attn_bwd_preprocess
from fused_block.kernels.attention import backward_atomic
from fused_block.kernels.attention.configs import (BWD_CONFIGS, DBIAS_CONFIGS, DECODE_BLOCK_MS, DECODE_CONFIGS,
                                                   FWD_CONFIGS, PRE_BLOCK_M, STAT_ALIGN, _decode_block_m)
from fused_block.kernels.attention.dbias import _attn_dbias
from fused_block.kernels.attention.decode import _attn_decode_combine, _attn_decode_split, _kv_cache_append
from fused_block.kernels.attention import hopper, hopper_bwd
from fused_block.kernels.attention.forward import _attn_fwd
from fused_block.kernels.attention.helpers import _dropout_mask_kernel

# ---------------------------------------------------------------------------------------------
# ahead-of-time compile specs
# ---------------------------------------------------------------------------------------------

def _signature(fn, ptr_types: dict, floats=("scale", "dropout_p", "softcap")) -> dict:
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
    # Bias, mask and bias-gradient strides are 0 along broadcast dims and 1 along a contiguous
    # Lk (the gradient's rows are the bias's), the mask's block ranges' 0 or 2 x blocks: no hint.
    return tuple(n for n in fn.arg_names if n.startswith("stride_") and n != "stride_mb" and n != "stride_slb"
                 and not n.startswith(("stride_b", "stride_a", "stride_db", "stride_kr", "stride_qr"))) + ("D",)


# The backward's host-side descriptors (``HOST_DESC``) and the block each one's rows take.
_BWD_DESCS = {"QD1": "BLOCK_M1", "DOD1": "BLOCK_M1", "KD1": "BLOCK_N1", "VD1": "BLOCK_N1", "DKD": "BLOCK_N1",
              "DVD": "BLOCK_N1", "QD2": "BLOCK_M2", "DOD2": "BLOCK_M2", "KD2": "BLOCK_N2", "VD2": "BLOCK_N2",
              "DQD": "BLOCK_M2"}


def _data_ptrs(fn, dt, meta=None, block_d=None, tma=False):
    """Argument types: data pointers, and the forward's and the backward's descriptor arguments
    (host-side descriptors on the forward's TMA path without warp specialization and with the
    backward's ``HOST_DESC`` on dense batches, else the tensors)."""
    ptrs = {p: f"*{dt}" for p in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "QD", "KD", "VD", "OD", "DOD",
                                  *_BWD_DESCS) if p in fn.arg_names}
    if tma and meta is not None and "WS" in meta and not meta["WS"]:
        for p, block in (("QD", "BLOCK_M"), ("KD", "BLOCK_N"), ("VD", "BLOCK_N"), ("OD", "BLOCK_M")):
            ptrs[p] = f"tensordesc<{dt}[1, 1, {meta[block]}, {block_d}]>"
    if "STD" in fn.arg_names:
        ptrs["STD"] = "*fp32"
    if tma and meta is not None and meta.get("HOST_DESC"):
        # 2: the loops' descriptors unused (the tensors in their place)
        for p, block in _BWD_DESCS.items():
            if meta["HOST_DESC"] == 1 or p not in ("QD1", "DOD1", "KD2", "VD2"):
                ptrs[p] = f"tensordesc<{dt}[1, 1, {meta[block]}, {block_d}]>"
        if meta["HOST_DESC"] == 1:
            ptrs["STD"] = f"tensordesc<fp32[1, 2, {meta['BLOCK_M1']}]>"
    ptrs.update({p: "*fp32" for p in ("LSE", "STATS", "SINKS", "SLOPES", "DBIAS", "DSINK") if p in fn.arg_names})
    ptrs.update({p: t for p, t in (("MASK", "*u8"), ("SEED", "*i64"), ("CU_Q", "*i32"), ("CU_K", "*i32"),
                                   ("ORDER", "*i32"),
                                   ("KR", "*i32"), ("QR", "*i32"),
                                   ("BIAS", f"*{dt}"), ("AMASK", "*u8")) if p in fn.arg_names})
    return ptrs


def _aot_combos(cls: str, block_d_class: int, tma: bool, exhaustive: bool):
    """The runtime combinations of one table entry the compile check builds, as (flags, name):
    the constexprs IS_CAUSAL, WINDOW, HAS_PAD, BLOCK_D and EVEN_D, and the spec name's tail.

    "plain": near 255 registers ptxas is not monotonic in them (configs spilled with causal
    and padding off and not on, or only with D == BLOCK_D), so ``exhaustive`` builds their
    product: causal x padding x every BLOCK_D of the class (16 and 32 run the 64 class's
    tiles) x EVEN_D (D == BLOCK_D, or a smaller multiple of 16 with column masks; the TMA path
    has no column masks, so EVEN_D does not reach its code). The default check builds, at the
    class's BLOCK_D, causal x padding with EVEN_D alternating on the pointer path (every pair
    of the three flags in all four states) and causal + padding and neither on the TMA path
    (where every spill of the product showed). Feature classes build their own flags with
    causality on (and padding, where the class takes it): the heaviest combinations;
    ``exhaustive`` also without causality.

    Strides and D carry the 16-divisibility hint in both: head dims that are odd multiples of
    8 (24, 40, 72, ...) give the pointer path neither, and it spills there (see docs/attention.md)."""
    def combo(causal, pad, bd, even, window=False, varlen=False, score=()):
        name = (f"{'varlen ' if varlen else ''}{'causal' if causal else 'full'}{' window' if window else ''}"
                f"{' pad' if pad else ''}{f' D{bd}' if bd != block_d_class else ''}{'' if even else ' ragged'}"
                f"{''.join(' ' + m for m in score)}")
        mods = dict(SOFTCAP="softcap" in score, HAS_SINKS="sinks" in score, HAS_ALIBI="alibi" in score,
                    HAS_BIAS="bias" in score, HAS_AMASK="mask" in score)
        return dict(IS_CAUSAL=causal, WINDOW=window, VARLEN=varlen, HAS_PAD=pad, BLOCK_D=bd, EVEN_D=even,
                    **mods), name

    if cls == "score":
        # The models' combinations: causal softcap + sinks (Gemma 2, gpt-oss), a bias with its
        # gradient + a bool mask + ALiBi (T5, BLOOM, the layers' merged masks), and packed
        # sequences with a window, softcap, ALiBi and sinks. ``exhaustive`` adds every
        # modification at once (not shipped spill-free: see docs/attention.md).
        yield combo(True, False, block_d_class, True, score=("softcap", "sinks"))
        yield combo(False, False, block_d_class, True, score=("alibi", "bias", "mask"))
        yield combo(True, False, block_d_class, True, window=True, varlen=True, score=("softcap", "alibi", "sinks"))
        if exhaustive:
            yield combo(True, False, block_d_class, True, score=("softcap", "alibi", "sinks", "bias", "mask"))
        return
    if cls == "band":
        # A window on dense batches (host-side descriptors in the forward, padding possible),
        # and packed sequences (device-side descriptors; no padding mask) with a window.
        for causal in (True, False) if exhaustive else (True,):
            yield combo(causal, causal, block_d_class, True, window=True)
            yield combo(causal, False, block_d_class, True, window=True, varlen=True)
        return
    if not exhaustive:
        for causal, pad in ((True, True), (False, False)) if tma else ((True, True), (False, False), (True, False),
                                                                      (False, True)):
            yield combo(causal, pad, block_d_class, tma or causal != pad)
        return
    for causal, pad in ((True, True), (False, False), (True, False), (False, True)):
        for bd in (16, 32, 64) if block_d_class == 64 else (block_d_class,):
            for even in (True,) if tma or bd < 64 else (True, False):
                yield combo(causal, pad, bd, even)


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

    specs, items = [], {}
    for kname, fn, tables in (("fwd", _attn_fwd, FWD_CONFIGS), ("bwd", _attn_bwd, BWD_CONFIGS)):
        for arch, table in tables.items():
            for (block_d, kind, dropout, cls), cfgs in table.items():
                dt = "bf16" if kind == "16" else "fp32"
                with_dropout = set(paths(arch, kind, table.get((block_d, kind, True, cls), ())))
                built = [(cfg, tma) for cfg, tma in paths(arch, kind, cfgs)
                         if dropout or exhaustive or (cfg, tma) not in with_dropout]
                for cfg, tma in built:
                    m = cfg.meta()
                    blocks = (f"{m['BLOCK_M']}x{m['BLOCK_N']}" if kname == "fwd" else
                              f"{m['BLOCK_M1']}x{m['BLOCK_N1']}/{m['BLOCK_M2']}x{m['BLOCK_N2']}"
                              f"{' split' if m['SPLIT_KV'] else ''}")
                    blocks += " ws" if m.get("WS") else ""
                    blocks += {0: "", 1: " lpt", 2: " persistent"}[m.get("SCHED", 0)]
                    blocks += " vhost" if m.get("VHOST") else ""
                    blocks += {0: "", 1: " hostdesc", 2: " hostdesc edges"}[m.get("HOST_DESC", 0)]
                    tag = "" if cls == "plain" else f" {cls}"
                    items.setdefault((kname, arch, cls, tma), []).append([])
                    for flags, combo_name in _aot_combos(cls, block_d, tma, exhaustive):
                        items[kname, arch, cls, tma][-1].append(len(specs))
                        if kname == "bwd":
                            flags = dict(flags, STAT_ALIGN=STAT_ALIGN)
                        flags = {n: v for n, v in flags.items() if n in fn.arg_names}
                        # the forward's host-side descriptors, the backward's (dense batches)
                        if kname == "fwd":
                            host = tma and (not flags["VARLEN"] or m.get("VHOST", False))
                        else:
                            host = tma and not flags["VARLEN"]
                        specs.append(aot.KernelSpec(
                            name=(f"attention_{kname} D{block_d} {kind}{' dropout' if dropout else ''}{tag} {blocks} "
                                  f"{'tma' if tma else 'ptr'}: {combo_name}"),
                            fn=fn, signature=_signature(fn, _data_ptrs(fn, dt, m, flags["BLOCK_D"], host)),
                            constexprs=dict(HAS_DROPOUT=dropout, USE_TMA=tma, IEEE=kind == "ieee", INTERPRET=False,
                                            **flags, **m),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=_aligned_args(fn),
                            wgmma=kind != "ieee", tma=tma, archs=(arch,)))
    # The bias's gradient: every table entry with every flag it takes (the heaviest tile), its
    # tile stored whole and summed over queries (a broadcast query axis).
    # TMA (host-side descriptors) and pointers on sm_90 (IEEE fp32: pointers), pointers on sm_80.
    for arch, table in DBIAS_CONFIGS.items():
        for (block_d, kind), cfg in table.items():
            dt = "bf16" if kind == "16" else "fp32"
            for tma in (True, False) if arch == 90 and kind != "ieee" else (False,):
                ptrs = {**_data_ptrs(_attn_dbias, dt), "DBIAS": f"*{dt}"}
                if tma:
                    for p, block in (("QD", "BLOCK_M"), ("KD", "BLOCK_N"), ("VD", "BLOCK_N"), ("DOD", "BLOCK_M")):
                        ptrs[p] = f"tensordesc<{dt}[1, 1, {cfg[block]}, {block_d}]>"
                items.setdefault(("dbias", arch, tma), []).append([])
                for sum_m in (False, True):
                    items["dbias", arch, tma][-1].append(len(specs))
                    specs.append(aot.KernelSpec(
                        name=(f"attention_dbias D{block_d} {kind} {cfg['BLOCK_M']}x{cfg['BLOCK_N']} "
                              f"{'tma' if tma else 'ptr'}: causal window pad dropout softcap alibi mask"
                              f"{' sum-queries' if sum_m else ''}"),
                        fn=_attn_dbias, signature=_signature(_attn_dbias, ptrs),
                        constexprs=dict(IS_CAUSAL=True, WINDOW=True, HAS_PAD=True, HAS_DROPOUT=True, SOFTCAP=True,
                                        HAS_ALIBI=True, HAS_AMASK=True, SUM_M=sum_m, SUM_N=False, USE_TMA=tma,
                                        IEEE=kind == "ieee", BLOCK_D=block_d, INTERPRET=False, **cfg.meta()),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=_aligned_args(_attn_dbias),
                        wgmma=kind != "ieee", tma=tma, archs=(arch,)))
    # bf16 with every flag combination; fp32 under TF32 (dO rounded for delta) with all of them.
    for varlen, sinks, tf32 in ((False, False, False), (True, False, False), (False, True, False),
                                (True, True, False), (True, True, True)):
        dt = "*fp32" if tf32 else "*bf16"
        specs.append(aot.KernelSpec(
            name=(f"attention_bwd_preprocess D128 {'tf32' if tf32 else 'bf16'}{' varlen' if varlen else ''}"
                  f"{' sinks' if sinks else ''}"),
            fn=_attn_bwd_preprocess,
            signature=_signature(_attn_bwd_preprocess, {"O": dt, "DO": dt, "LSE": "*fp32",
                                                        "DLSE": "*fp32", "STATS": "*fp32", "CU_Q": "*i32",
                                                        "SINKS": "*fp32", "DSINK": "*fp32"}),
            constexprs=dict(HAS_DLSE=True, VARLEN=varlen, HAS_SINKS=sinks, BLOCK_D=128, BLOCK_M=PRE_BLOCK_M,
                            STAT_ALIGN=STAT_ALIGN, TF32=tf32, INTERPRET=False),
            num_warps=4, aligned=_aligned_args(_attn_bwd_preprocess)))
    # Split-KV decoding: every table entry at its smallest and largest row block, with every
    # flag its class takes (causal, window, padding, softcap, ALiBi; "bias": a bias and a bool
    # mask too: the heaviest step);
    # TMA (device-side descriptors) and pointers on sm_90 (except IEEE fp32), pointers on sm_80.
    for arch, table in DECODE_CONFIGS.items():
        for (block_d, kind, cls), cfgs in table.items():
            dt = "bf16" if kind == "16" else "fp32"
            block_ms = [m for m in DECODE_BLOCK_MS if m <= _decode_block_m(1 << 20, block_d, kind)]
            for cfg in cfgs:
                for tma in (True, False) if arch == 90 and kind != "ieee" else (False,):
                    items.setdefault(("decode", arch, tma), []).append([])
                    for block_m in sorted({block_ms[0], block_ms[-1]}):
                        items["decode", arch, tma][-1].append(len(specs))
                        specs.append(aot.KernelSpec(
                            name=(f"attention_decode D{block_d} {kind} {cls} {block_m}x{cfg['BLOCK_N']} "
                                  f"{'tma' if tma else 'ptr'}: causal window pad softcap alibi"
                                  f"{' bias mask' if cls == 'bias' else ''}"),
                            fn=_attn_decode_split,
                            signature=_signature(_attn_decode_split, {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}",
                                                                      "OP": "*fp32", "LSEP": "*fp32", "MASK": "*u8",
                                                                      "SLOPES": "*fp32", "BIAS": f"*{dt}",
                                                                      "AMASK": "*u8", "KR": "*i32"}),
                            constexprs=dict(IS_CAUSAL=True, WINDOW=True, HAS_PAD=True, SOFTCAP=True, HAS_ALIBI=True,
                                            HAS_BIAS=cls == "bias", HAS_AMASK=cls == "bias", USE_TMA=tma,
                                            IEEE=kind == "ieee",
                                            EVEN_D=True, BLOCK_D=block_d, BLOCK_M=block_m, INTERPRET=False,
                                            **cfg.meta()),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            aligned=_aligned_args(_attn_decode_split), wgmma=False, tma=tma, archs=(arch,)))
    specs.append(aot.KernelSpec(
        name="attention_decode_combine D128 bf16 sinks", fn=_attn_decode_combine,
        signature=_signature(_attn_decode_combine, {"OP": "*fp32", "LSEP": "*fp32", "O": "*bf16", "LSE": "*fp32",
                                                    "SINKS": "*fp32"}),
        constexprs=dict(HAS_SINKS=True, BLOCK_D=128, BLOCK_M=16, INTERPRET=False), num_warps=4,
        aligned=_aligned_args(_attn_decode_combine)))
    specs.append(aot.KernelSpec(
        name="attention_kv_cache_append D128 bf16", fn=_kv_cache_append,
        signature=_signature(_kv_cache_append, {"KC": "*bf16", "VC": "*bf16", "KN": "*bf16", "VN": "*bf16",
                                                "SEQLENS": "*i32"}),
        constexprs=dict(BLOCK_D=128, BLOCK_M=16), num_warps=4, aligned=_aligned_args(_kv_cache_append)))
    specs.append(aot.KernelSpec(
        name="attention_dropout_mask", fn=_dropout_mask_kernel,
        signature=_signature(_dropout_mask_kernel, {"SEED": "*i64", "OUT": "*u8"}),
        constexprs=dict(BLOCK_M=32, BLOCK_N=32), num_warps=4))
    # The opt-in Gluon Hopper forward (hopper.py), single-partition, warp-specialized and persistent: sm_90
    # only, every candidate causal and not (in turn in the default check), bf16 (fp16 is the
    # same code with another element type); disassembled: every loop with arithmetic on wgmma.
    for variant, table, ws, persistent in (("", hopper.CONFIGS, False, False), ("_ws", hopper.WS_CONFIGS, True, False),
                                           ("_persistent", hopper.PERSISTENT_CONFIGS, False, True)):
        for block_d, cands in table.items():
            for block_n, stages in cands:
                items.setdefault(("hopper", variant, block_d), []).append([])
                for causal in (True, False):
                    items["hopper", variant, block_d][-1].append(len(specs))
                    sig, constexprs = hopper.aot_spec_args("bf16", block_d, causal, block_n, stages, ws, persistent)
                    specs.append(aot.KernelSpec(
                        name=(f"attention_fwd_hopper{variant} (Gluon) D{block_d} 16 "
                              f"{hopper.BLOCK_M}x{block_n}/{stages}: {'causal' if causal else 'full'}"),
                        fn=getattr(hopper, f"_attn_fwd_hopper{variant}"), signature=sig,
                        constexprs=constexprs, num_warps=constexprs["num_warps"], num_stages=stages, wgmma=True,
                        tma=True, hot_loops=True, archs=(90,)))
    # The ping-pong variant (hopper.PINGPONG_CONFIGS: 2 consumers, or 3 at 192 rows), its consumers
    # one score block deeper (PP_OVERLAP_CONFIGS, OVERLAP) and its persistent form
    # (PP_PERSISTENT_CONFIGS), the same way.
    for variant, table, overlap, persistent in (("_pp", hopper.PINGPONG_CONFIGS, False, False),
                                                ("_pp overlap", hopper.PP_OVERLAP_CONFIGS, True, False),
                                                ("_pp_persistent", hopper.PP_PERSISTENT_CONFIGS, False, True)):
        for block_d, cands in table.items():
            for block_m, block_n, stages in cands:
                items.setdefault(("hopper", variant, block_d), []).append([])
                for causal in (True, False):
                    items["hopper", variant, block_d][-1].append(len(specs))
                    sig, constexprs = hopper.aot_spec_args("bf16", block_d, causal, block_n, stages, ws=True,
                                                           persistent=persistent, block_m=block_m,
                                                           overlap=None if persistent else overlap)
                    specs.append(aot.KernelSpec(
                        name=(f"attention_fwd_hopper{variant} (Gluon) D{block_d} 16 {block_m}x{block_n}/{stages}: "
                              f"{'causal' if causal else 'full'}"),
                        fn=hopper._attn_fwd_hopper_pp_persistent if persistent else hopper._attn_fwd_hopper_pp,
                        signature=sig, constexprs=constexprs, num_warps=constexprs["num_warps"], num_stages=stages,
                        wgmma=True, tma=True, hot_loops=True, archs=(90,)))
    # The opt-in Gluon Hopper backward (hopper_bwd.py), single-partition, warp-specialized and
    # persistent: sm_90 only, every candidate (one build serves causal and not: causality is a
    # runtime bound), bf16.
    for ws, persistent, table in ((False, False, hopper_bwd.CONFIGS), (True, False, hopper_bwd.WS_CONFIGS),
                                  (False, True, hopper_bwd.PERSISTENT_CONFIGS)):
        for block_d, cands in table.items():
            for block_m, stages in cands:
                sig, constexprs = hopper_bwd.aot_spec_args("bf16", block_d, block_m, stages, ws, persistent)
                fn = (hopper_bwd._attn_bwd_hopper_ws if ws else
                      hopper_bwd._attn_bwd_hopper_persistent if persistent else hopper_bwd._attn_bwd_hopper)
                specs.append(aot.KernelSpec(
                    name=(f"attention_bwd_hopper{'_ws' if ws else '_persistent' if persistent else ''} (Gluon) "
                          f"D{block_d} 16 {block_m}x{hopper_bwd.TILE_N[block_d][0]}/{stages}"),
                    fn=fn, signature=sig,
                    constexprs=constexprs, num_warps=constexprs["num_warps"], num_stages=stages, wgmma=True,
                    tma=True, hot_loops=True, archs=(90,)))
    # The opt-in atomic-dQ backward (backward_atomic.py): sm_90 only (TMA reduce-adds), every
    # candidate causal and not (in turn in the default check), bf16, hot loops on wgmma as the
    # Gluon forwards'; its dQ conversion.
    for block_d, cands in backward_atomic.CONFIGS.items():
        for cfg in cands:
            m = cfg.meta()
            items.setdefault(("bwd_dq_atomic", block_d), []).append([])
            for causal in (True, False):
                items["bwd_dq_atomic", block_d][-1].append(len(specs))
                fn = backward_atomic._attn_bwd_dq_atomic
                specs.append(aot.KernelSpec(
                    name=(f"attention_bwd_dq_atomic D{block_d} 16 {m['BLOCK_M']}x{m['BLOCK_N']} tma: "
                          f"{'causal' if causal else 'full'}"),
                    fn=fn, signature=_signature(fn, {**_data_ptrs(fn, "bf16"), "DQ_ACC": "*fp32"}),
                    constexprs=dict(IS_CAUSAL=causal, BLOCK_D=block_d, INTERPRET=False, **m),
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=_aligned_args(fn), wgmma=True,
                    tma=True, hot_loops=True, archs=(90,)))
    fn = backward_atomic._dq_convert
    for block_d in (128, 256):  # 256: the Gluon backward's D192 and D256
        specs.append(aot.KernelSpec(
            name=f"attention_dq_convert D{block_d} bf16", fn=fn,
            signature=_signature(fn, {"DQ_ACC": "*fp32", "DQ": "*bf16"}),
            constexprs=dict(BLOCK_M=backward_atomic.CONVERT_BLOCK_M, BLOCK_D=block_d, INTERPRET=False), num_warps=4,
            aligned=_aligned_args(fn), archs=(90,)))
    specs = [dataclasses.replace(s, spills_ok=TF32_SPILLS) if " tf32" in s.name else s for s in specs]
    return aot.take_turns(specs, items)


# fp32 attention under TF32: the operands are rounded to nearest TF32 before every product
# (common.to_tf32; the tensor cores would truncate them, 2-7x torch's error on the H200), which
# takes each K/V (and Q, dO) tile through registers beside the fp32 accumulators: 14 of the
# default check's builds (D128 forward, backward and dbias; both archs) spill 8-408 B of stack,
# and 23 of the heavy check's (D128 and D64: feature-heavy forward, backward, dbias and decode
# variants) 8-520 B. Accuracy first in this mode; the way back to no spills is rounding the
# inputs once per call outside the kernels (only the register-made operands, P and dS, inside),
# not done yet.
TF32_SPILLS = "TF32 operand rounding (cvt.rna) of the fp32 tiles"
