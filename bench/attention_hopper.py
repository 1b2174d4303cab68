"""The opt-in Gluon Hopper attention forwards (``kernels/attention/hopper.py``: the
single-partition kernel "gluon" (its candidates timed, the persistent form among them), its
persistent form alone "gluon_persistent", the warp-specialized "gluon_ws" and its ping-pong
schedule "gluon_pingpong", each of whose candidates are timed, "gluon_pp_overlap": the
ping-pong consumers one score block deeper alone, and "gluon_pp_persistent": the ping-pong
kernel's persistent form alone) against our
Triton forward, SDPA's cuDNN and SDPA's flash (FA2) backends, bf16, on the shapes of the
attention issue; one short run on an sm_90 GPU:

    python -m bench.attention_hopper [--providers P1,P2,...] [--shapes S1,S2,...] [--json PATH]

(providers: gluon, gluon_persistent, triton, sdpa_cudnn, sdpa_flash, gluon_ws, gluon_pingpong,
gluon_pp_overlap, gluon_pp_persistent; all by default)

Per shape: TFLOP/s of each forward (``triton.testing.do_bench``, median, inputs reused: the
working sets are far larger than L2 at these shapes), and each Gluon output's largest
difference from our Triton forward's and its LSE's (a sanity check; the tests hold both to
the float64 reference). A backend the shape or machine lacks shows "-". "gluon_ws",
"gluon_pingpong", "gluon_pp_overlap" and "gluon_pp_persistent" run in passes of their own
after every other provider (a kernel that has never run could deadlock).
The first call of each shape class times the Gluon candidates (``FUSED_BLOCK_PRINT_TUNING=1``
prints them); compiles dominate the run time.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from bench import harness

# (name, B, Hq, Hkv, L, D, causal): the table, D64 also non-causal, and D256.
SHAPES = (
    ("B4 H16 L4096 D128 causal", 4, 16, 16, 4096, 128, True),
    ("B4 H16 L4096 D128", 4, 16, 16, 4096, 128, False),
    ("B1 H16 L16384 D128 causal", 1, 16, 16, 16384, 128, True),
    ("B8 H32 L2048 D64 causal", 8, 32, 32, 2048, 64, True),
    ("B8 H32 L2048 D64", 8, 32, 32, 2048, 64, False),
    ("B4 H32/8 L4096 D128 causal", 4, 32, 8, 4096, 128, True),
    ("B2 H16 L4096 D256 causal", 2, 16, 16, 4096, 256, True),  # the D256 kernel (Gemma's head dim)
)
PROVIDERS = ("gluon", "gluon_persistent", "triton", "sdpa_cudnn", "sdpa_flash", "gluon_ws", "gluon_pingpong",
             "gluon_pp_overlap", "gluon_pp_persistent")
# the switch's 1, persistent, ws, pingpong, pingpong_overlap, pingpong_persistent
GLUON = ("gluon", "gluon_persistent", "gluon_ws", "gluon_pingpong", "gluon_pp_overlap", "gluon_pp_persistent")
APART = ("gluon_ws", "gluon_pingpong", "gluon_pp_overlap", "gluon_pp_persistent")  # each in a pass of its own, last


def _fn(provider, causal, gqa):
    import fused_block
    from fused_block.kernels.attention import hopper

    if provider in (*GLUON, "triton"):
        on, ws, persistent = provider != "triton", provider == "gluon_ws", provider == "gluon_persistent"
        pingpong = provider in ("gluon_pingpong", "gluon_pp_overlap", "gluon_pp_persistent")
        overlap, pp_persistent = provider == "gluon_pp_overlap", provider == "gluon_pp_persistent"

        def run(q, k, v):
            hopper.ENABLED, hopper.WS, hopper.PERSISTENT, hopper.PINGPONG = on, ws, persistent, pingpong
            hopper.PP_OVERLAP, hopper.PP_PERSISTENT = overlap, pp_persistent
            return fused_block.attention(q, k, v, causal=causal, return_lse=True)
        return run
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if provider == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return sdpa


def _measure(shape, providers, rep):
    """One shape's row: TFLOP/s per provider and the Gluon outputs' differences from ours."""
    import triton
    from fused_block.kernels import common
    from fused_block.kernels.attention import hopper

    name, B, Hq, Hkv, L, D, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 4 * B * Hq * L * L * D // (2 if causal else 1)
    row = {"shape": name, "tflops": {}}
    outs = {}
    for p in providers:
        fn = _fn(p, causal, Hq != Hkv)
        try:
            before = common.LAUNCHES["attention_fwd_hopper"]
            with torch.no_grad():
                outs[p] = fn(q, k, v)
                if p.startswith("gluon") and common.LAUNCHES["attention_fwd_hopper"] == before:
                    raise RuntimeError("the Gluon forward did not run")
                ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=10, rep=rep)
            row["tflops"][p] = round(flops / ms * 1e-9, 1)
        except Exception as e:  # a backend this shape or machine lacks
            row["tflops"][p] = None
            row.setdefault("errors", {})[p] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            hopper.ENABLED, hopper.WS, hopper.PERSISTENT, hopper.PINGPONG = False, False, False, False
            hopper.PP_OVERLAP, hopper.PP_PERSISTENT = False, False
    if "triton" not in outs and any(p.startswith("gluon") for p in outs):
        with torch.no_grad():
            outs["triton"] = _fn("triton", causal, Hq != Hkv)(q, k, v)
    for p in GLUON:
        if p in outs:
            (og, lg), (ot, lt) = outs[p], outs["triton"]
            fin = torch.isfinite(lt)
            row[f"{p}_max_abs_diff_out"] = (og.float() - ot.float()).abs().max().item()
            row[f"{p}_max_abs_diff_lse"] = (lg[fin] - lt[fin]).abs().max().item() if fin.any() else 0.0
            row[f"{p}_lse_inf_agree"] = bool(torch.equal(torch.isfinite(lg), fin))
    return row


def _header(providers):
    print(f"{'shape':<28}" + "".join(f"{p:>12}" for p in providers)
          + "".join(f"{p + ' |dO|':>18}{p + ' |dLSE|':>20}" for p in GLUON if p in providers))


def _line(row, providers):
    cells = "".join(f"{'-' if row['tflops'].get(p) is None else row['tflops'][p]:>12}" for p in providers)
    diffs = "".join(f"{row.get(p + '_max_abs_diff_out', float('nan')):>18.2e}"
                    f"{row.get(p + '_max_abs_diff_lse', float('nan')):>20.2e}"
                    for p in GLUON if p in providers)
    print(f"{row['shape']:<28}{cells}{diffs}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default=",".join(PROVIDERS),
                        help=f"comma-separated, of {', '.join(PROVIDERS)}")
    parser.add_argument("--shapes", default="",
                        help="comma-separated substrings: only the shapes whose names hold one (e.g. 'D128,D64')")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--rep", type=int, default=60, help="do_bench's rep (ms) per measurement")
    args = parser.parse_args(argv)
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        parser.error(f"unknown providers {unknown}; choose from {PROVIDERS}")
    wanted = [w for w in args.shapes.split(",") if w]
    shapes = [s for s in SHAPES if not wanted or any(w in s[0] for w in wanted)]
    if not shapes:
        parser.error(f"no shape matches {args.shapes!r}; the shapes: {[s[0] for s in SHAPES]}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    first = [p for p in providers if p not in APART]
    passes = [first] * bool(first) + [[p] for p in APART if p in providers]
    rows = []
    for i, group in enumerate(passes):
        print(f"pass {i + 1}: {', '.join(group)} (TFLOP/s; Gluon vs Triton forward max |diff|)", flush=True)
        _header(group)
        part = []
        for shape in shapes:  # each row printed as it is measured
            part.append(_measure(shape, group, args.rep))
            _line(part[-1], group)
        rows.append(part)
        for row in part:
            for p, err in row.get("errors", {}).items():
                print(f"{row['shape']}: {p}: {err}")
        if args.json:
            harness.write_gpu_json(args.json, passes=passes, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
