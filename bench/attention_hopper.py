"""The opt-in Gluon Hopper attention forward (``kernels/attention/hopper.py``) against our Triton
forward, SDPA's cuDNN and SDPA's flash (FA2) backends, bf16, on the shapes of the attention
issue; one short run on an sm_90 GPU (under a minute on an H200, compiles included):

    python -m bench.attention_hopper [--json PATH]

Per shape: TFLOP/s of each forward (``triton.testing.do_bench``, median, inputs reused: the
working sets are far larger than L2 at these shapes), and the Gluon output's largest
difference from our Triton forward's and its LSE's (a sanity check; the tests hold both to
the float64 reference). A backend the shape or machine lacks shows "-".
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

# (name, B, Hq, Hkv, L, D, causal): the table, D64 and the GQA shape also non-causal.
SHAPES = (
    ("B4 H16 L4096 D128 causal", 4, 16, 16, 4096, 128, True),
    ("B4 H16 L4096 D128", 4, 16, 16, 4096, 128, False),
    ("B1 H16 L16384 D128 causal", 1, 16, 16, 16384, 128, True),
    ("B8 H32 L2048 D64 causal", 8, 32, 32, 2048, 64, True),
    ("B8 H32 L2048 D64", 8, 32, 32, 2048, 64, False),
    ("B4 H32/8 L4096 D128 causal", 4, 32, 8, 4096, 128, True),
)
PROVIDERS = ("gluon", "triton", "sdpa_cudnn", "sdpa_flash")


def _fn(provider, causal, gqa):
    import fused_block
    from fused_block.kernels.attention import hopper

    if provider in ("gluon", "triton"):
        on = provider == "gluon"

        def run(q, k, v):
            hopper.ENABLED = on
            return fused_block.attention(q, k, v, causal=causal, return_lse=True)
        return run
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if provider == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return sdpa


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--rep", type=int, default=60, help="do_bench's rep (ms) per measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    import triton
    from fused_block.kernels import common
    from fused_block.kernels.attention import hopper

    rows = []
    print(f"{'shape':<28}" + "".join(f"{p:>12}" for p in PROVIDERS) + f"{'max|dO|':>10}{'max|dLSE|':>11}")
    for name, B, Hq, Hkv, L, D, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        flops = 4 * B * Hq * L * L * D // (2 if causal else 1)
        row = {"shape": name, "tflops": {}}
        outs = {}
        for p in PROVIDERS:
            fn = _fn(p, causal, Hq != Hkv)
            try:
                before = common.LAUNCHES["attention_fwd_hopper"]
                with torch.no_grad():
                    outs[p] = fn(q, k, v)
                    if p == "gluon" and common.LAUNCHES["attention_fwd_hopper"] == before:
                        raise RuntimeError("the Gluon forward did not run")
                    ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=10, rep=args.rep)
                row["tflops"][p] = round(flops / ms * 1e-9, 1)
            except Exception as e:  # a backend this shape or machine lacks
                row["tflops"][p] = None
                row.setdefault("errors", {})[p] = f"{type(e).__name__}: {str(e)[:200]}"
        hopper.ENABLED = False
        if "gluon" in outs and "triton" in outs:
            (og, lg), (ot, lt) = outs["gluon"], outs["triton"]
            row["max_abs_diff_out"] = (og.float() - ot.float()).abs().max().item()
            fin = torch.isfinite(lt)
            row["max_abs_diff_lse"] = (lg[fin] - lt[fin]).abs().max().item() if fin.any() else 0.0
            row["lse_inf_agree"] = bool(torch.equal(torch.isfinite(lg), fin))
        cells = "".join(f"{'-' if row['tflops'][p] is None else row['tflops'][p]:>12}" for p in PROVIDERS)
        diffs = (f"{row.get('max_abs_diff_out', float('nan')):>10.2e}"
                 f"{row.get('max_abs_diff_lse', float('nan')):>11.2e}")
        print(f"{name:<28}{cells}{diffs}", flush=True)
        rows.append(row)
        del q, k, v, outs
    for row in rows:
        for p, err in row.get("errors", {}).items():
            print(f"{row['shape']}: {p}: {err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
