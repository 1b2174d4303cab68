"""The attention scheduling candidates (docs/attention-scheduling.md) one by one: each config
of the forward's and the backward's table for a shape, forced as the only candidate, bf16 D128
causal (D64 for "dense64"); one short run on an sm_90 GPU:

    python -m bench.attention_sched [--shapes varlen,dense,dense64] [--kernels fwd,bwd] [--json PATH]

Shapes: "varlen", 16 packed sequences of 258-1935 tokens (16,080 tokens and 11.73 M visible
pairs per head: the token and pair counts of the 2026-12-04 probe's draw of 64-2048, whose
lengths were not recorded), H16; "dense", B4 H16 L4096; "dense64", B8 H32 L2048 at D64 (the
backward's ``HOST_DESC`` candidate's main target). Per candidate (its table index, tiles,
``SCHED``, ``VHOST``, ``HOST_DESC``): the forward's TFLOP/s (the default backward not run), or the backward's
alone (the default forward run once), counting the visible pairs only (the backward 2.5x the
forward's products), ``do_bench``'s median. Each forced config compiles once (about 10-30 s).
"""
import argparse
import sys

import torch

from bench import harness

LENGTHS = (258, 259, 302, 367, 392, 462, 594, 610, 790, 1122, 1386, 1886, 1887, 1896, 1934, 1935)
SHAPES = ("varlen", "dense", "dense64")
KERNELS = ("fwd", "bwd")
DIMS = {"varlen": (16, 128), "dense": (16, 128), "dense64": (32, 64)}  # (heads, head dim)


def _inputs(shape):
    H, D = DIMS[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    if shape == "varlen":
        T = sum(LENGTHS)
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        pairs = sum(n * (n + 1) // 2 for n in LENGTHS)
        return (rand(T, H, D), rand(T, H, D), rand(T, H, D)), dict(cu=cu, max_len=max(LENGTHS)), pairs
    B, L = (8, 2048) if shape == "dense64" else (4, 4096)
    return (rand(B, H, L, D), rand(B, H, L, D), rand(B, H, L, D)), {}, B * L * (L + 1) // 2


def _call(shape, q, k, v, extra):
    import fused_block

    if shape == "varlen":
        cu, n = extra["cu"], extra["max_len"]
        return fused_block.attention_varlen(q, k, v, cu, cu, n, n, causal=True)
    # return_lse: always our kernels (never a timed SDPA candidate, docs/attention.md)
    return fused_block.attention(q, k, v, causal=True, return_lse=True)[0]


def _measure(shape, kname, rep):
    import triton

    from fused_block.kernels import common
    from fused_block.kernels.attention import configs, launchers

    H, D = DIMS[shape]
    key = (D, "16", False, "band" if shape == "varlen" else "plain")
    tables = configs.FWD_CONFIGS if kname == "fwd" else configs.BWD_CONFIGS
    (q, k, v), extra, pairs = _inputs(shape)
    fwd_flops = 4 * pairs * H * D
    rows = []
    table = tables[90][key]
    for index, cfg in enumerate(list(table)):
        if cfg.meta().get("WS"):
            continue  # opt-in (FUSED_BLOCK_WS=1), not a scheduling candidate
        m = cfg.meta()
        row = {"shape": shape, "kernel": kname, "index": index, "num_warps": cfg.num_warps,
               "num_stages": cfg.num_stages, **m}
        tables[90][key] = [cfg]
        launchers._FWD_CACHE = common.ConfigCache("attention_fwd")
        launchers._BWD_CACHE = common.ConfigCache("attention_bwd")
        try:
            if kname == "fwd":
                with torch.no_grad():
                    _call(shape, q, k, v, extra)
                    ms = triton.testing.do_bench(lambda: _call(shape, q, k, v, extra), warmup=10, rep=rep)
                row["tflops"] = round(fwd_flops / ms * 1e-9, 1)
            else:
                out = _call(shape, q, k, v, extra)
                dout = torch.randn_like(out)
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                             warmup=10, rep=rep)
                row["tflops"] = round(2.5 * fwd_flops / ms * 1e-9, 1)
            row["ms"] = round(ms, 4)
        except Exception as e:  # report and go on: one failing candidate must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            tables[90][key] = table
        rows.append(row)
        print(f"{shape:<7} {kname:<4} #{index} {m.get('BLOCK_M', m.get('BLOCK_M1'))}x"
              f"{m.get('BLOCK_N', m.get('BLOCK_N1'))} w{cfg.num_warps}/s{cfg.num_stages} SCHED={m.get('SCHED')} "
              f"VHOST={m.get('VHOST', '-')} HOST_DESC={m.get('HOST_DESC', '-')} SPLIT={m.get('SPLIT_KV', '-')}: "
              f"{row.get('tflops', '-')} TFLOP/s {row.get('ms', '')} ms {row.get('error', '')}", flush=True)
    launchers._FWD_CACHE = common.ConfigCache("attention_fwd")
    launchers._BWD_CACHE = common.ConfigCache("attention_bwd")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--rep", type=int, default=25, help="do_bench's rep (ms) per measurement")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    kernels = [k for k in args.kernels.split(",") if k]
    if set(shapes) - set(SHAPES) or set(kernels) - set(KERNELS):
        parser.error(f"shapes from {SHAPES}, kernels from {KERNELS}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    rows = [row for shape in shapes for kname in kernels for row in _measure(shape, kname, args.rep)]
    if args.json:
        harness.write_gpu_json(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
