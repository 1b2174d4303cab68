"""The opt-in atomic-dQ attention backward (``kernels/attention/backward_atomic.py``, "atomic")
and the opt-in Gluon Hopper backwards (``kernels/attention/hopper_bwd.py``: "gluon", one
partition, its persistent form a timed candidate; "gluon_persistent", the persistent form alone at
D64, the one-partition kernel at D128; "gluon_ws", warp-specialized at D64, the single-partition
kernel at D128) against our
atomic-free backward ("triton", the default) and SDPA's cuDNN backward, bf16, causal, on the
attention issue's D64 and D128 shapes; one short run on an sm_90 GPU:

    python -m bench.attention_dq_atomic [--providers atomic,triton,sdpa_cudnn] [--json PATH]
    python -m bench.attention_dq_atomic --providers triton,sdpa_cudnn,gluon,gluon_persistent,gluon_ws
    python -m bench.attention_dq_atomic --providers triton,sdpa_cudnn,gluon --shapes D256

Per shape: TFLOP/s of the backward alone (2.5x the forward's products; ``do_bench``'s median
of ``torch.autograd.grad`` on a retained graph, the forward run once), and the atomic dq, dk,
dv's largest difference from the atomic-free ones, and the Gluon ones' (a sanity check; the
tests hold all to the float64 reference). The Gluon kernels run only when named (not in the
default providers, which the GPU lease's benchmark step runs), and last in each row ("gluon",
"gluon_persistent", "gluon_ws"): a kernel that has never run could hang, and the other figures
are in by then.
The first call of each shape times the candidate configs (``FUSED_BLOCK_PRINT_TUNING=1``
prints them). A backend the machine lacks shows "-".
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from bench import harness

# (name, B, Hq, Hkv, L, D, causal)
SHAPES = (
    ("B8 H32 L2048 D64 causal", 8, 32, 32, 2048, 64, True),
    ("B4 H16 L4096 D128 causal", 4, 16, 16, 4096, 128, True),
    # The Gluon backward's D256 tile (one ring stage: docs/attention-hopper.md); only when named.
    ("B2 H16 L4096 D256 causal", 2, 16, 16, 4096, 256, True),
)
DEFAULT_SHAPES = ("D64", "D128")
PROVIDERS = ("atomic", "triton", "sdpa_cudnn", "gluon", "gluon_persistent", "gluon_ws")
DEFAULT_PROVIDERS = ("atomic", "triton", "sdpa_cudnn")
# The opt-in kernels' launch-count names.
_OPT_IN = {"atomic": "attention_bwd_dq_atomic", "gluon": "attention_bwd_hopper",
           "gluon_persistent": "attention_bwd_hopper", "gluon_ws": "attention_bwd_hopper"}
GLUON = ("gluon", "gluon_persistent", "gluon_ws")


def _switch(provider) -> None:
    """The opt-in switches for ``provider`` (all off for the others)."""
    from fused_block.kernels.attention import backward_atomic, hopper_bwd

    backward_atomic.ENABLED = provider == "atomic"
    hopper_bwd.ENABLED = provider in GLUON
    hopper_bwd.WS = provider == "gluon_ws"
    hopper_bwd.PERSISTENT = provider == "gluon_persistent"


def _diff_key(provider, grad):
    """The row's key of ``provider``'s largest difference from the atomic-free ``grad``."""
    return f"{'' if provider == 'atomic' else provider + '_'}max_abs_diff_{grad}"


def _measure(shape, providers, rep):
    import triton

    import fused_block
    from fused_block.kernels import common
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name, B, Hq, Hkv, L, D, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, L, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    dout = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 10 * B * Hq * L * L * D // (2 if causal else 1)
    row = {"shape": name, "tflops": {}}
    grads = {}
    for p in providers:
        try:
            if p == "sdpa_cudnn":
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
            else:
                # return_lse: always our kernels (never a timed SDPA candidate, docs/attention.md).
                out, _ = fused_block.attention(q, k, v, causal=causal, return_lse=True)
            _switch(p)
            launch = {"triton": "attention_bwd", **_OPT_IN}.get(p)
            before = common.LAUNCHES[launch] if launch else 0
            grads[p] = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            if launch and common.LAUNCHES[launch] == before:
                raise RuntimeError(f"{launch} did not run")
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                         warmup=10, rep=rep)
            row["tflops"][p] = round(flops / ms * 1e-9, 1)
        except Exception as e:  # a backend this machine lacks
            row["tflops"][p] = None
            row.setdefault("errors", {})[p] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            _switch(None)
    for p in _OPT_IN:
        if p in grads and "triton" in grads:
            for n, a, t in zip(("dq", "dk", "dv"), grads[p], grads["triton"]):
                row[_diff_key(p, n)] = (a.float() - t.float()).abs().max().item()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                        help=f"comma-separated, of {', '.join(PROVIDERS)} (default: {','.join(DEFAULT_PROVIDERS)})")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--rep", type=int, default=40, help="do_bench's rep (ms) per measurement")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated head dims of {', '.join(s[0].split()[3] for s in SHAPES)} "
                             f"(default: {','.join(DEFAULT_SHAPES)})")
    args = parser.parse_args(argv)
    dims = [d for d in args.shapes.split(",") if d]
    shapes = [s for s in SHAPES if s[0].split()[3] in dims]
    if len(shapes) != len(dims):
        parser.error(f"unknown shapes {dims}; choose from {[s[0].split()[3] for s in SHAPES]}")
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        parser.error(f"unknown providers {unknown}; choose from {PROVIDERS}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    gluon = [p for p in GLUON if p in providers]
    providers = [p for p in providers if p not in gluon] + gluon  # the Gluon kernels last
    print("backward TFLOP/s; atomic and the Gluon kernels vs atomic-free max |diff| of dq, dk, dv", flush=True)
    print(f"{'shape':<28}" + "".join(f"{p:>12}" for p in providers)
          + "".join(f"{p + ' |ddq|':>16}{'|ddk|':>10}{'|ddv|':>10}" for p in ("atomic", *gluon) if p in providers))
    rows = []
    for shape in shapes:
        row = _measure(shape, providers, args.rep)
        rows.append(row)
        cells = "".join(f"{'-' if row['tflops'].get(p) is None else row['tflops'][p]:>12}" for p in providers)
        diffs = "".join(f"{row.get(_diff_key(p, n), float('nan')):>{16 if n == 'dq' else 10}.2e}"
                        for p in ("atomic", *gluon) if p in providers for n in ("dq", "dk", "dv"))
        print(f"{row['shape']:<28}{cells}{diffs}", flush=True)
        for p, err in row.get("errors", {}).items():
            print(f"  {p}: {err}")
    if args.json:
        harness.write_gpu_json(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
