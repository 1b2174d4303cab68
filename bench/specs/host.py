"""Host time and kernels per training step of a converted layer, measured without a GPU.

``python -m bench --only host`` prints, for Pre-LN and Post-LN ``TransformerEncoderLayer``
with dropout 0 and 0.1, one training step's host time (forward, then ``autograd.grad`` of the
input and every parameter) on this machine's CPU, for a ``fused_block.convert``-ed layer
launched three ways and for torch's layer, the ratios (target: ours with the direct launch
<= 1.2x torch's), the kernels each step launches, and where our time goes (cProfile's own
time per component: each of our files, torch's and Triton's subpackages, C builtins, which
include the autograd engine and the CPU ops). These are CPU figures: a GPU machine's host
is another CPU.

Method (the same for both layers, on CPU tensors, one CPU thread):

- Ours runs with the kernel path forced for CPU tensors (``fused_block._backend.host_only``),
  so everything else runs: validation, config lookup, allocation, op dispatch, autograd, and
  every PyTorch op (sums, casts, zero-fills) on real CPU tensors. The launches:
  - ``stubbed``: ``common.launch`` counts each launch and returns: no Triton at all;
  - ``triton``: ``kernel[grid](...)``, Triton's ``JITFunction.run`` (binding, specialization,
    cache key and lookup, the global-value check, ``launch_metadata``), up to the C launcher,
    which a fake CUDA driver (``fused_block.kernels.fake_driver``) turns into a no-op;
  - ``direct``: the library's launch path (``fused_block.kernels.launch``: the compiled
    kernel cached per config and specialization key), through the same fake driver.
  Not counted in any: the C launcher itself (argument parsing, ``cuLaunchKernelEx``), the
  same for both launch paths. The launchers take their sm_90 branches, as on an H100 or
  H200 (``fake_driver.launcher_branches``: config tables, TMA descriptors, persistent GEMM
  grids; each table's first config, nothing is timed), not the interpreter's configs, which
  no GPU runs (``run(arch=0)`` measures those: a few percent more, the interpreter branches
  building their configs on every call).
- Torch's layer runs its CPU kernels for real, on shapes so small (2 x 8 tokens, d_model 32)
  that the step is mostly dispatch: at d_model 16 it is within about 10% of this. It runs in
  fp32, where the CPU kernels do the least work (bf16 on CPU adds conversions a GPU does not
  make), so its time is the lower bound of its host cost and the ratio errs against us. Ours
  runs in bf16, the benchmarked configuration (its gradient casts run; fp32 would skip them).
- All four are timed in alternating rounds of ten steps after two untimed ones, in this
  thread's CPU time (``time.thread_time``: time the OS gives other processes is not counted);
  each one's time is its fastest round's mean step time: the run the rest of the machine
  disturbed least (on a shared machine medians drift with the load; the minimum estimates the
  code's own cost). The untimed steps refill the caches the other modes' rounds evicted: with
  rounds of three timed steps and none untimed (until 2026-12-05) each round's first, cold step
  weighed a third, torch's step measured 426-543 us from one process to the next (its warm
  steps: ~375), and the ratios flattered ours (Pre-LN dropout 0: 1.11-1.32 then, ~1.4 warm).
- Kernels: ``fused_block.profiling.count_kernels`` (Triton launches plus PyTorch ops that
  launch a device kernel; views and bare allocations excluded).

The measurement runs in a child process without the Triton interpreter (``python -m
bench.specs.host --json FILE``), where the kernels are ``JITFunction``s that the fake driver
can launch; ``python -m bench`` without a GPU runs the interpreter.

A kernel that a launcher starts without ``common.launch`` is listed under the table: it takes
Triton's launch path in every column (it is not stubbable), and its launcher needs converting.
"""
import argparse
import collections
import contextlib
import copy
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time

import torch

from bench import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(d_model=32, nhead=2, d_ff=128, batch=2, seq=8)  # head dim 16: the kernel's smallest
CONFIGS = [(norm_first, p) for norm_first in (True, False) for p in (0.0, 0.1)]
OURS_DTYPE, TORCH_DTYPE = torch.bfloat16, torch.float32
# Ours with the direct launch path, against torch's step (issue 16 item 7).
TARGET_RATIO = 1.2
MODES = ("stubbed", "triton", "direct", "torch")


def cases(quick: bool) -> list:
    """Nothing to time on the GPU: this spec's measurement is :func:`report`."""
    return []


def numerics() -> list:
    return []


def _name(norm_first, p):
    return f"{'pre' if norm_first else 'post'}-LN dropout {p:g}"


def _steps(norm_first, p):
    """Training steps of torch's layer and of its converted copy (same weights), then their
    forwards alone (with autograd recording)."""
    import fused_block

    s = SHAPE
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(s["d_model"], s["nhead"], s["d_ff"], dropout=p, activation="gelu",
                                           batch_first=True, norm_first=norm_first)
    ours = fused_block.convert(copy.deepcopy(ref).to(OURS_DTYPE))

    def step_of(layer, dtype):
        x = torch.randn(s["batch"], s["seq"], s["d_model"], dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        inputs = (x, *layer.parameters())
        return (lambda: torch.autograd.grad(layer(x), inputs, dy)), (lambda: layer(x))

    (ours, ours_fwd), (theirs, theirs_fwd) = step_of(ours, OURS_DTYPE), step_of(ref, TORCH_DTYPE)
    return ours, theirs, ours_fwd, theirs_fwd


@contextlib.contextmanager
def _mode(name):
    """The launch path of ``name`` (one of ``MODES`` but torch) for our step."""
    from fused_block import _backend
    from fused_block.kernels import launch

    enabled = launch.ENABLED
    launch.ENABLED = name != "triton"
    try:
        with _backend.host_only(stub=name == "stubbed"):
            yield
    finally:
        launch.ENABLED = enabled


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no thread-pool hand-offs: the CPU kernels' dispatch, not their parallelism
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _best(fn, rounds, per_round=10) -> float:
    """Best-of-rounds CPU time (us) of ``fn``, each round's first two calls untimed."""
    best = float("inf")
    for _ in range(rounds):
        for _ in range(2):
            fn()
        t0 = time.thread_time()
        for _ in range(per_round):
            fn()
        best = min(best, (time.thread_time() - t0) / per_round * 1e6)
    return best


def _no_grad(fn):
    def run():
        with torch.no_grad():
            fn()
    return run


def _rounds(ours, theirs, rounds, per_round):
    """Best-of-rounds CPU time per step (us) of each mode, measured in alternating rounds."""
    runs = [(m, ours if m != "torch" else theirs) for m in MODES]
    for m, fn in runs:
        with _mode(m) if m != "torch" else contextlib.nullcontext():
            for _ in range(3):
                fn()
    best = dict.fromkeys(MODES, float("inf"))
    for _ in range(rounds):
        for m, fn in runs:
            with _mode(m) if m != "torch" else contextlib.nullcontext():
                for _ in range(2):  # the round's first steps refill caches the other modes evicted
                    fn()
                t0 = time.thread_time()
                for _ in range(per_round):
                    fn()
                best[m] = min(best[m], (time.thread_time() - t0) / per_round * 1e6)
    return best


# The products our step hands to cuBLAS (the dispatch's "cublas" candidate) run as real CPU
# matrix products here: torch.mm / addmm / _addmm_activation and Tensor.addmm_, the bias
# gradients' torch.sum beside them, and F.linear (a plain projection on cuBLAS runs as torch's
# own, dispatch.linear_on_torch), whose backward (mm, mm, sum) torch's autograd runs in C++, out
# of a Python recorder's sight: a recorded F.linear is replayed with its backward (the
# gradients its arguments required while autograd recorded it; inside the layer step's Function,
# fused_block._step, it records nothing, and the step's backward products are torch.mm and
# torch.sum calls of its own, recorded as they run).
_PRODUCT_FNS = ((torch, "mm"), (torch, "addmm"), (torch, "_addmm_activation"), (torch.Tensor, "addmm_"),
                (torch, "sum"), (torch.nn.functional, "linear"))


def _spec(t, grad):
    """A recorded argument: a tensor's shape, strides and whether autograd records the call
    for it (a projection inside an autograd Function's forward records nothing: its backward
    products are the Function's own calls, recorded as they run), or the value itself."""
    if isinstance(t, torch.Tensor):
        return ("t", tuple(t.shape), t.stride(), grad and t.requires_grad)
    return ("v", t)


def _recorded_products(step) -> list:
    """The product calls one run of ``step`` makes: (owner, name, argument specs, keyword specs)."""
    calls, originals = [], [(owner, name, getattr(owner, name)) for owner, name in _PRODUCT_FNS]

    def recorder(owner, name, fn):
        def record(*args, **kwargs):
            grad = torch.is_grad_enabled()
            calls.append((owner, name, [_spec(a, grad) for a in args], {k: _spec(v, grad) for k, v in kwargs.items()}))
            return fn(*args, **kwargs)
        return record

    try:
        for owner, name, fn in originals:
            setattr(owner, name, recorder(owner, name, fn))
        step()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return calls


def _replay_us(calls, dtypes, reps, rounds=9) -> tuple:
    """CPU time (us) of one replay of ``calls`` on fresh tensors of the recorded shapes and
    strides, in each of ``dtypes``: best of ``rounds`` rounds of ``reps`` replays, the dtypes
    taking turns within each round, so a spell of load on the machine slows them alike (timed
    one dtype after the other, the difference varied 94-254 us between runs of this CPU)."""
    def make(spec, dtype, grad=False):
        if spec[0] == "v":
            return spec[1]
        shape, stride = spec[1], spec[2]
        return torch.empty_strided(shape, stride, dtype=dtype).normal_().requires_grad_(grad and spec[3])

    def with_backward(fn):  # F.linear: forward and the backward torch's autograd runs for it
        def run(*args):
            out = fn(*args)
            need = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if need:
                torch.autograd.grad(out, need, torch.ones_like(out))
        return run

    def bound(dtype):
        return [(with_backward(getattr(owner, name)) if name == "linear" else getattr(owner, name),
                 [make(a, dtype, name == "linear") for a in args], {k: make(v, dtype) for k, v in kw.items()})
                for owner, name, args, kw in calls]

    replays = [bound(dtype) for dtype in dtypes]
    best = [float("inf")] * len(dtypes)
    for _ in range(rounds):
        for i, replay in enumerate(replays):
            t0 = time.thread_time()
            for _ in range(reps):
                for fn, args, kw in replay:
                    fn(*args, **kw)
            best[i] = min(best[i], (time.thread_time() - t0) / reps * 1e6)
    return tuple(best)


def product_surcharge(step, reps=20) -> tuple:
    """``(products, surcharge_us)``: how many matrix products ``step`` (ours, in bf16) makes on
    the CPU and what they cost this CPU beyond the same calls in fp32. On a GPU a cuBLAS call's
    host cost does not depend on the dtype; here bf16 products compute several times slower
    than fp32 ones (no bf16 BLAS), a cost torch's step, which runs in fp32, does not pay."""
    calls = _recorded_products(step)
    if not calls:
        return 0, 0.0
    ours, theirs = _replay_us(calls, (OURS_DTYPE, TORCH_DTYPE), reps)
    return len(calls), max(0.0, ours - theirs)


def _measure_here(quick, arch) -> dict:
    """The measurement itself (the child process): rows and profiles as plain data."""
    from fused_block import profiling
    from fused_block.kernels import common, fake_driver, launch

    if common.interpreting() or common.TUNE:
        raise RuntimeError("the host measurement runs with TRITON_INTERPRET=0 and FUSED_BLOCK_TUNE=0 (see run())")
    rows, profs = [], {}
    branches = fake_driver.launcher_branches(arch) if arch else contextlib.nullcontext()
    with _one_thread(), fake_driver.installed(record=False, check=False), branches:
        for norm_first, p in CONFIGS:
            ours, theirs, ours_fwd, theirs_fwd = _steps(norm_first, p)
            times = _rounds(ours, theirs, rounds=8 if quick else 30, per_round=10)
            n = 4 if quick else 15
            forward = dict(torch_fwd_us=_best(theirs_fwd, n))
            with _mode("direct"):
                forward.update(fwd_us=_best(ours_fwd, n), fwd_nograd_us=_best(_no_grad(ours_fwd), n))
                ours()  # warm: the counts are a steady step's
                before, stats = common.LAUNCHES.copy(), launch.STATS.copy()
                counts = profiling.count_kernels(ours)
                launched = common.LAUNCHES - before
                outside = sorted(n for n in counts.triton if not launched[n])
                paths = dict(launch.STATS - stats)
                paths["direct"] = sum(v for n, v in counts.triton.items() if n not in outside) - sum(paths.values())
                profs[_name(norm_first, p)] = dataclasses.asdict(
                    profiling.host_profile(ours, rounds=2 if quick else 7))
                products, surcharge = product_surcharge(ours, reps=5 if quick else 20)
            rows.append(dict(config=_name(norm_first, p), **{f"{m}_us": times[m] for m in MODES},
                             kernels=dataclasses.asdict(counts),
                             torch_kernels=dataclasses.asdict(profiling.count_kernels(theirs)),
                             launch_paths=paths, products=products, surcharge_us=surcharge,
                             outside_launch=outside, **forward))
            gc.collect()
    return {"rows": rows, "profiles": profs}


def run(quick=False, arch=90):
    """``(rows, profiles)``: one row per configuration (host us per step in each mode, kernels
    per step, how a steady step's launches went: direct, fallback, unkeyed), and
    ``{config: fused_block.profiling.HostProfile}`` of our step with the direct launch path.
    Measured in a child process without the interpreter."""
    from fused_block import profiling
    from fused_block.kernels import fake_driver

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "host.json")
        argv = ["-m", "bench.specs.host", "--json", path, "--arch", str(arch)] + (["--quick"] if quick else [])
        # No config is timed (no GPU): each launcher's first candidate, as with stubbed launches.
        proc = fake_driver.run_without_interpreter(argv, cwd=ROOT, env={"FUSED_BLOCK_TUNE": "0"})
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"host measurement failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
        with open(path) as f:
            data = json.load(f)
    rows = data["rows"]
    for r in rows:
        r["kernels"] = profiling.KernelCount(**r["kernels"])
        r["torch_kernels"] = profiling.KernelCount(**r["torch_kernels"])
        for m in MODES[:-1]:
            r[f"{m}_ratio"] = r[f"{m}_us"] / r["torch_us"]
        # The target's figure: the direct path with the products at torch's (fp32) CPU cost.
        r["target_ratio"] = (r["direct_us"] - r["surcharge_us"]) / r["torch_us"]
    profs = {name: profiling.HostProfile(**p) for name, p in data["profiles"].items()}
    return rows, profs


def format_profiles(profs, rows=14) -> str:
    """Own time per component (us per step, under cProfile), one column per configuration."""
    names = list(profs)
    groups = collections.Counter()
    for prof in profs.values():
        groups.update(prof.groups)
    width = max(len(n) for n in names) + 1
    lines = [f"{'component':<28}" + "".join(f"{n:>{width}}" for n in names)]
    shown = [g for g, _ in groups.most_common(rows)]
    for g in shown:
        lines.append(f"{g:<28}" + "".join(f"{profs[n].groups.get(g, 0.0):>{width}.0f}" for n in names))
    rest = [sum(v for g, v in profs[n].groups.items() if g not in shown) for n in names]
    lines.append(f"{'(the rest)':<28}" + "".join(f"{v:>{width}.0f}" for v in rest))
    lines.append(f"{'total (profiled)':<28}" + "".join(f"{profs[n].total_us:>{width}.0f}" for n in names))
    return "\n".join(lines)


def format_forward(rows) -> str:
    """The forward alone: ours (direct path) with autograd recording and under ``no_grad`` (the
    difference: what recording costs our forward, the ops' autograd Functions and what they
    save), torch's with autograd."""
    head = f"{'config':<22} {'ours':>8} {'no_grad':>8} {'autograd':>9} {'torch':>8}"
    lines = ["forward host us: ours with autograd recording, ours under no_grad, the difference (what "
             "recording costs our forward: the ops' autograd Functions and what they save), torch's "
             "forward with autograd", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:<22} {r['fwd_us']:>8.0f} {r['fwd_nograd_us']:>8.0f} "
                     f"{r['fwd_us'] - r['fwd_nograd_us']:>9.0f} {r['torch_fwd_us']:>8.0f}")
    return "\n".join(lines)


def format_rows(rows) -> str:
    head = (f"{'config':<22} {'stubbed':>8} {'triton':>8} {'direct':>8} {'torch':>8} {'ratio':>20} "
            f"{'bf16 mm':>8} {'direct*':>8} {'target':>7} {'kernels':>8} {'torch':>6}  launches (steady step)")
    lines = ["host us per step; ratio = ours / torch's with launches stubbed, Triton's, direct; bf16 mm = what "
             "our step's cuBLAS products (with their bias sums) cost this CPU beyond the same calls in fp32 (torch's dtype here; on a "
             "GPU a product's host cost does not depend on it); direct* = (direct - bf16 mm) / torch, the "
             "target's figure", head, "-" * len(head)]
    for r in rows:
        ratios = " ".join(f"{r[m + '_ratio']:.2f}" for m in MODES[:-1])
        paths = ", ".join(f"{n} {k}" for k, n in sorted(r["launch_paths"].items()))
        lines.append(f"{r['config']:<22} {r['stubbed_us']:>8.0f} {r['triton_us']:>8.0f} {r['direct_us']:>8.0f} "
                     f"{r['torch_us']:>8.0f} {ratios:>20} {r['surcharge_us']:>8.0f} {r['target_ratio']:>8.2f} "
                     f"{'<= ' + format(TARGET_RATIO, 'g'):>7} "
                     f"{r['kernels'].total:>8} {r['torch_kernels'].total:>6}  {paths}")
    outside = sorted({n for r in rows for n in r["outside_launch"]})
    if outside:
        lines.append("launched without common.launch (Triton's path in every column, not stubbable yet): "
                     + ", ".join(outside))
    return "\n".join(lines)


def report(quick: bool = False) -> str:
    """The host table, the forward alone, the kernels of a Pre-LN step with dropout 0, and a
    profile of it."""
    try:
        rows, profs = run(quick)
    except Exception as exc:  # noqa: BLE001 - reported in the output, the run goes on
        return f"host time unavailable: {harness.describe_error(exc)}"
    first = rows[0]["config"]
    return "\n".join([
        f"== host time per training step (this CPU, no GPU; sm_90 launcher branches; {SHAPE}) ==",
        format_rows(rows), "", format_forward(rows), "",
        f"== kernels per step: {first} ==", rows[0]["kernels"].table(), "",
        "== where our host time goes (direct launch path): own time per component, us per step under "
        "cProfile (which inflates short calls: read the shares) ==", format_profiles(profs), "",
        f"== the functions with the most own time: {first} ==", profs[first].top()])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="the host measurement (the child process of report())")
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--arch", type=int, choices=(0, 80, 90), default=90,
                        help="the launchers' branches: sm_90 (default), sm_80, or 0 (the interpreter's)")
    args = parser.parse_args(argv)
    data = _measure_here(args.quick, args.arch)
    with open(args.json, "w") as f:
        json.dump(data, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
