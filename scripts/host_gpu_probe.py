"""Host time per training step on a GPU machine: the figure ``python -m bench --only host``
estimates on a CPU without one (issue 29, item 1: a Pre-LN step <= 1.2x nn eager's host time).

For the host benchmark's tiny layer (``bench.specs.host.SHAPE``: d_model 32, 2 heads, d_ff 128,
2 x 8 tokens; every kernel a few microseconds, so the GPU waits on the host) in bf16, Pre-LN
and Post-LN, dropout 0 and 0.1: torch's ``nn.TransformerEncoderLayer`` and its
``fused_block.convert``-ed copy (same weights), one training step each (forward, then
``autograd.grad`` of the input and every parameter), timed in alternating rounds after a
warm-up (the first steps time configs and the dispatch's choices):

- ``cpu_us``: this thread's CPU time per step (``time.thread_time``), no synchronization inside
  a round: the host work itself, real CUDA launches and cuBLAS calls included (what the CPU
  benchmark cannot count);
- ``wall_us``: wall time per step of the same rounds, synchronized at each round's end;
- ``graph_us``: wall time per replay of the converted layer's step captured whole
  (``fused_block.graphs.capture``), the host-bound case's answer;
- ``ops_*``: the converted layer with its ops one by one (``fused_block._step`` off, as
  ``FUSED_BLOCK_LAYER_STEP=0``), in the same rounds: what the layer step saves on this host.

Each figure is the best round's mean (the machine's least disturbed run). Prints a table and
writes ``--json``. Run on a GPU: ``python scripts/host_gpu_probe.py --json host-gpu.json``
(about half a minute); ``--device cpu`` runs the plumbing without one (the reference path:
its figures mean nothing).
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench, run as a script
import fused_block  # noqa: E402
from bench.specs import host  # noqa: E402
from fused_block import _step as layer_step  # noqa: E402
from fused_block import graphs  # noqa: E402


def _step(layer, x, dy):
    inputs = (x, *layer.parameters())
    return lambda: torch.autograd.grad(layer(x), inputs, dy)


def _ops_one_by_one(fn):
    """``fn`` with the layer step off (the converted layer's ops one by one)."""
    def run():
        enabled, layer_step.ENABLED = layer_step.ENABLED, False
        try:
            return fn()
        finally:
            layer_step.ENABLED = enabled
    return run


def _rounds(fns, device, rounds, per_round):
    """Best-of-rounds (cpu_us, wall_us) per step of each function, in alternating rounds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = {name: [float("inf"), float("inf")] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            sync()
            c0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(per_round):
                fn()
            c1 = time.thread_time()
            sync()
            w1 = time.perf_counter()
            best[name][0] = min(best[name][0], (c1 - c0) / per_round * 1e6)
            best[name][1] = min(best[name][1], (w1 - w0) / per_round * 1e6)
    return best


def measure(device, rounds=20, per_round=20):
    s = host.SHAPE
    rows = []
    for norm_first, p in host.CONFIGS:
        torch.manual_seed(0)
        ref = torch.nn.TransformerEncoderLayer(s["d_model"], s["nhead"], s["d_ff"], dropout=p, activation="gelu",
                                               batch_first=True, norm_first=norm_first).to(device, torch.bfloat16)
        ours = fused_block.convert(copy.deepcopy(ref))
        x = torch.randn(s["batch"], s["seq"], s["d_model"], device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        fns = {"torch": _step(ref, x, dy), "ours": _step(ours, x, dy), "ops": _ops_one_by_one(_step(ours, x, dy))}
        for fn in fns.values():
            for _ in range(5):  # configs, the dispatch's timed choices, the guard's verdict
                fn()
        best = _rounds(fns, device, rounds, per_round)
        row = dict(config=host._name(norm_first, p), **{f"{k}_cpu_us": v[0] for k, v in best.items()},
                   **{f"{k}_wall_us": v[1] for k, v in best.items()})
        row["cpu_ratio"] = row["ours_cpu_us"] / row["torch_cpu_us"]
        row["ops_cpu_ratio"] = row["ops_cpu_us"] / row["torch_cpu_us"]
        if device.type == "cuda":
            try:
                step = graphs.capture(lambda t: torch.autograd.grad(ours(t), (t, *ours.parameters()), dy), x)
            except RuntimeError as exc:  # reported, the other figures stand
                row["graph_error"] = str(exc)[:300]
            else:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                w0 = time.perf_counter()
                for _ in range(rounds * per_round):
                    step()
                torch.cuda.synchronize()
                row["graph_wall_us"] = (time.perf_counter() - w0) / (rounds * per_round) * 1e6
        rows.append(row)
    return rows


def format_rows(rows) -> str:
    head = (f"{'config':<22} {'ours cpu':>9} {'torch cpu':>10} {'ratio':>6} {'target':>7} {'ours wall':>10} "
            f"{'torch wall':>11} {'graph wall':>11} {'ops cpu':>8} {'ratio':>6}")
    lines = ["host us per training step on this machine (bf16, the host benchmark's tiny layer): CPU time of the "
             "enqueuing thread, wall time per step, a CUDA-graph replay's wall time, and the converted layer with "
             "its ops one by one (the layer step off)", head, "-" * len(head)]
    for r in rows:
        graph = f"{r['graph_wall_us']:>11.0f}" if "graph_wall_us" in r else f"{'-':>11}"
        lines.append(f"{r['config']:<22} {r['ours_cpu_us']:>9.0f} {r['torch_cpu_us']:>10.0f} {r['cpu_ratio']:>6.2f} "
                     f"{'<= ' + format(host.TARGET_RATIO, 'g'):>7} {r['ours_wall_us']:>10.0f} "
                     f"{r['torch_wall_us']:>11.0f} {graph} {r['ops_cpu_us']:>8.0f} {r['ops_cpu_ratio']:>6.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = measure(device, rounds=args.rounds)
    print(format_rows(rows))
    if args.json:
        meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
