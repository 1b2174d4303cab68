"""The benchmark harness every op uses: specs, timing on CUDA, numerics on any device, reports.

Writing a spec (``bench/specs/<op>.py``)
=======================================
A spec module defines two functions; ``python -m bench`` discovers every module in
``bench/specs/`` and calls them. A spec must import cleanly even when the op it measures does
not exist yet: import ``fused_block`` (and anything optional) inside the factories and inside
``numerics()``, never at module level. Errors raised there are caught and reported.

``cases(quick: bool) -> list[Case]``
    GPU timing cases. ``quick=True`` is the small set used by ``--quick``, by
    ``scripts/gpu_check.sh`` and by ``pytest bench --benchmark-only``: a few shapes, so that
    every spec together stays within a couple of minutes (torch.compile's compile time counts;
    :func:`compiled` uses torch.compile's default mode there). The GPU check also passes
    ``--spec-budget``: cases of a spec not started within it (plus what earlier specs left
    unused) are recorded as not run.
    Building the list must not touch CUDA: the work happens in the factories.

``numerics() -> list[dict]``
    Rows of the numerics report: each op against the float64 reference on small shapes, on
    ``DEVICE`` (CUDA when present, else CPU through the Triton interpreter; ``python -m bench``
    sets ``TRITON_INTERPRET=1`` before Triton is imported when there is no GPU). Build the rows
    with :func:`compare` (the tests' rule: ``err(ours) <= 2 * err(torch same-dtype) + atol``)
    or :func:`unavailable_row` (op missing, with the reason). Without a GPU this is the main
    job's answer: keep each spec within ``NUMERICS_BUDGET_S`` (``python -m bench`` prints each
    spec's time and names those over it).

``Case`` (fields)
    ``op``        str, the op's name, e.g. ``"add_layer_norm"``; one table section and one plot
                  per op.
    ``shape``     dict of the sizes (and flags), e.g. ``{"rows": 16384, "hidden": 4096}``;
                  its values, joined with "x", label the case in tables and plots.
    ``dtype``     torch.dtype of the activations.
    ``mode``      ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"`` (``MODES``).
    ``providers`` dict ``{name: factory}``, ours first by convention. A factory takes no
                  argument, builds its CUDA inputs (and, for ``"bwd"``, runs the forward once
                  so the graph exists) and returns a zero-argument callable: the thing timed.
                  Backward callables use ``torch.autograd.grad(..., retain_graph=True)`` (see
                  :func:`backward_fn`) so gradients don't accumulate between calls. A factory
                  or callable that raises (an SDPA backend missing, a package not installed,
                  an op not written yet) is recorded as unavailable with the reason.
    ``bytes``     int or None: the minimum bytes a perfect implementation moves to and from
                  global memory for this mode (document the count in the spec). Gives GB/s.
    ``flops``     int or None: the FLOP count. Gives TFLOP/s. With neither, only time, peak
                  memory and speedup are reported.
    ``ours``      the provider whose speedup over each peer is reported (default
                  ``"fused_block"``).

Helpers for factories: :func:`rotating` (cycle among several input sets whose total exceeds
the L2 cache), :func:`backward_fn`, :func:`compiled` (``torch.compile`` that doesn't hit the
recompile limit), :func:`randn`.

What a run measures (CUDA only)
===============================
- Ceilings in the same run: device-to-device copy bandwidth (a large tensor copy, bytes read
  plus written) and cuBLAS bf16 matmul TFLOP/s at 8192^3.
- Per provider: ``triton.testing.do_bench`` median time (warm-up, L2 flushed between calls
  by do_bench, inputs rotated by the spec), GB/s from ``bytes``, TFLOP/s from ``flops``,
  % of ceiling = max(GB/s / copy GB/s, TFLOP/s / matmul TFLOP/s) over those available,
  peak memory = ``torch.cuda.max_memory_allocated()`` during one call minus what was
  allocated before it (the inputs, and for "bwd" the saved forward graph), or the callable's
  own ``peak_mem_bytes`` attribute when it has one (a replayed CUDA graph allocates nothing
  per call: its factory measures the capture), and ours' speedup
  over it (its time / ours' time).
- Output, under ``--out`` (default ``bench/results/``): ``<gpu-slug>-<date>[-quick].json``
  (environment: GPU, driver, CUDA, torch, triton, date, torch.compile mode, seconds per part;
  ceilings, measurements, numerics), ``.md`` (tables) and one PNG per op.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import subprocess
import time
from typing import Callable

import torch

# The numerics rule the tests use (python -m bench sets TRITON_INTERPRET before importing this).
from fused_block.testing import ATOL, FACTOR, check, max_err  # noqa: F401

MODES = ("fwd", "bwd", "fwd+bwd")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Set by ``python -m bench --quick`` and by ``pytest bench``: :func:`compiled` then uses
# torch.compile's default mode whatever a spec asks for (max-autotune's tuning would take
# most of the GPU check's minutes).
QUICK = False
# Seconds one spec's ``numerics()`` may take without a GPU (the interpreter, 2 cores): four
# specs within it keep the main job's answer under 3 minutes, start-up included.
# ``python -m bench`` names the specs over it.
NUMERICS_BUDGET_S = 40.0


@dataclasses.dataclass
class Case:
    op: str
    shape: dict
    dtype: torch.dtype
    mode: str
    providers: dict
    bytes: int | None = None
    flops: int | None = None
    ours: str = "fused_block"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def label(self) -> str:
        return "x".join(str(v) for v in self.shape.values())


@dataclasses.dataclass
class Measurement:
    """One provider on one case. ``ms`` is None when the provider was unavailable."""

    op: str
    shape: dict
    dtype: str
    mode: str
    provider: str
    ms: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    pct_of_ceiling: float | None = None
    peak_mem_bytes: int | None = None
    speedup_of_ours: float | None = None  # this provider's time / ours' time
    unavailable: str | None = None

    @property
    def label(self) -> str:
        return "x".join(str(v) for v in self.shape.values())


# ---------------------------------------------------------------------------------------------
# helpers for specs
# ---------------------------------------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def randn(*shape, dtype, device=None, scale=1.0, requires_grad=False):
    t = torch.randn(*shape, dtype=torch.float32, device=device or DEVICE) * scale
    return t.to(dtype).requires_grad_(requires_grad)


def l2_bytes() -> int:
    """The L2 cache size of the current GPU (64 MiB when unknown)."""
    if torch.cuda.is_available():
        size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        if size:
            return int(size)
    return 64 << 20


def rotating(make_inputs: Callable[[], object], run: Callable[[object], object], set_bytes: int,
             *, max_sets: int = 8) -> Callable[[], object]:
    """A zero-argument callable that runs ``run(inputs)`` on the next of several input sets.

    ``make_inputs()`` builds one set and ``set_bytes`` is its size; enough sets are built that
    together they exceed twice the L2 cache (at most ``max_sets``), so no call finds its inputs
    left in L2 by the previous one. Large problems get a single set.
    """
    n = max(1, min(max_sets, math.ceil(2 * l2_bytes() / max(1, set_bytes))))
    sets = [make_inputs() for _ in range(n)]
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % n
        return run(sets[i])

    return call


def backward_fn(outputs, grads, inputs) -> Callable[[], object]:
    """A callable running only the backward of an already-built graph, repeatably.

    ``torch.autograd.grad`` with ``retain_graph=True`` returns fresh gradients each call, so
    nothing accumulates into ``.grad`` between timed calls.
    """
    outputs, grads, inputs = tuple(outputs), tuple(grads), tuple(inputs)
    return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)


_DYNAMO_LIMITS_RAISED = False


def compiled(fn, **kwargs):
    """``torch.compile(fn, dynamic=False, **kwargs)`` with dynamo's recompile limits raised.

    A benchmark compiles the same function for many shapes and dtypes; past dynamo's default
    recompile limit it would silently fall back to eager and the "torch.compile" numbers
    would be eager ones. Under :data:`QUICK` the ``mode`` is dropped (torch.compile's default).
    """
    if QUICK:
        kwargs.pop("mode", None)
    global _DYNAMO_LIMITS_RAISED
    if not _DYNAMO_LIMITS_RAISED:
        import torch._dynamo as dynamo  # not "import torch._dynamo": that makes torch local here

        cfg = dynamo.config
        for name in ("recompile_limit", "cache_size_limit",
                     "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, 4096)
        _DYNAMO_LIMITS_RAISED = True
    kwargs.setdefault("dynamic", False)
    return torch.compile(fn, **kwargs)


def compare(op: str, case: str, tensor: str, actual, ref64, baseline, *, atol=None, factor=FACTOR,
            dtype=None) -> dict:
    """A numerics row: ours (``actual``) and torch same-dtype (``baseline``) vs the float64 oracle,
    judged by the tests' rule (``fused_block.testing.check``). ``dtype``: the case's dtype, where
    the tensor has another (a bf16 case's fp32 loss); the row is labelled with it."""
    v = check(actual, ref64, baseline, atol=atol, factor=factor)
    return {"op": op, "case": case, "dtype": dtype_name(dtype or actual.dtype), "tensor": tensor,
            "err": v.err, "torch_err": v.torch_err, "atol": v.atol, "ok": v.ok}


def unavailable_row(op: str, reason: str, case: str = "-") -> dict:
    return {"op": op, "case": case, "dtype": "-", "tensor": "-", "unavailable": reason}


# A provider named ``<ours>[triton]``: ours with every op on our kernels (the GEMMs on our fused
# kernel, ``fused_block.dispatch.force("triton")``; the norms and attention without torch's path
# as a candidate), beside ours with the per-key choices; one named
# ``<ours>[rows]`` (HF training steps): ours with the loss on its time-first token loop
# (``FUSED_BLOCK_LCE_SCHEDULE=rows``: 6 N V H FLOPs and an fp32 (V, H) dW accumulator), beside
# ours with the memory rule's schedule.
TRITON_ONLY = "[triton]"
LOSS_ROWS = "[rows]"


@contextlib.contextmanager
def provider_scope(provider: str):
    """The context a provider's step runs in: every op forced onto our kernels for a
    ``...[triton]`` provider, the loss's token loop for a ``...[rows]`` one, nothing otherwise."""
    if provider.endswith(TRITON_ONLY):
        from fused_block import _attn_sdpa, dispatch, norm

        norms, attention = norm.force(norm.TRITON), _attn_sdpa.force(_attn_sdpa.TRITON)
        try:
            with dispatch.force("triton"):
                yield
        finally:
            norm.force(norms)
            _attn_sdpa.force(attention)
    elif provider.endswith(LOSS_ROWS):
        from fused_block.kernels import loss

        before, loss.PREFER = loss.PREFER, "rows"
        try:
            yield
        finally:
            loss.PREFER = before
    else:
        yield


def describe_error(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:200]


# ---------------------------------------------------------------------------------------------
# measuring (CUDA)
# ---------------------------------------------------------------------------------------------

def measure_ceilings() -> dict:
    """Copy bandwidth (GB/s, bytes read + written) and cuBLAS bf16 TFLOP/s at 8192^3."""
    from triton.testing import do_bench

    n = 1 << 30  # 1 GiB each way, far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    copy_gbps = 2 * n / ms * 1e-6
    del src, dst

    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: torch.matmul(a, b), warmup=25, rep=100, return_mode="median")
    matmul_tflops = 2 * m**3 / ms * 1e-9
    del a, b
    _free()
    return {"copy_gbps": copy_gbps, "matmul_bf16_tflops": matmul_tflops, "matmul_shape": [m, m, m]}


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_provider(case: Case, name: str, factory, ceilings: dict, *, warmup=25, rep=100) -> Measurement:
    """Build and time one provider of one case; any error makes it unavailable, with the reason."""
    from triton.testing import do_bench

    m = Measurement(case.op, dict(case.shape), dtype_name(case.dtype), case.mode, name)
    fn = None
    try:
        fn = factory()
        fn()  # first call: compiles, autotunes, allocates workspaces
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        # A callable may carry its own peak (a CUDA graph allocates its pool at capture).
        m.peak_mem_bytes = getattr(fn, "peak_mem_bytes", max(0, torch.cuda.max_memory_allocated() - base))
        m.ms = float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except Exception as exc:  # noqa: BLE001 - any failure makes the provider unavailable
        m.unavailable = describe_error(exc)
        m.ms = m.peak_mem_bytes = None
    finally:
        del fn
        _free()
    fill_rates(m, case, ceilings)
    return m


def fill_rates(m: Measurement, case: Case, ceilings: dict) -> None:
    """GB/s, TFLOP/s and % of ceiling from ``m.ms`` and the case's counts."""
    if m.ms is None or m.ms <= 0:
        return
    fractions = []
    if case.bytes is not None:
        m.gbps = case.bytes / m.ms * 1e-6
        if ceilings.get("copy_gbps"):
            fractions.append(m.gbps / ceilings["copy_gbps"])
    if case.flops is not None:
        m.tflops = case.flops / m.ms * 1e-9
        if ceilings.get("matmul_bf16_tflops"):
            fractions.append(m.tflops / ceilings["matmul_bf16_tflops"])
    if fractions:
        m.pct_of_ceiling = 100.0 * max(fractions)


def fill_speedups(measurements: list, ours: str) -> None:
    """For one case's measurements: each provider's time divided by ours' time."""
    mine = next((m for m in measurements if m.provider == ours and m.ms), None)
    for m in measurements:
        if mine is not None and m.ms:
            m.speedup_of_ours = m.ms / mine.ms


def run_case(case: Case, ceilings: dict, **kw) -> list:
    out = [time_provider(case, name, factory, ceilings, **kw) for name, factory in case.providers.items()]
    fill_speedups(out, case.ours)
    return out


def not_run(case: Case, reason: str) -> list:
    """A case left out (e.g. its spec's time budget was used up): every provider unavailable."""
    return [Measurement(case.op, dict(case.shape), dtype_name(case.dtype), case.mode, name, unavailable=reason)
            for name in case.providers]


def timed_numerics(found: dict) -> tuple:
    """Every spec's numerics rows and the seconds each spec took: ``(rows, {spec: seconds})``.

    A spec whose module failed to import (a string in ``found``) or whose ``numerics()``
    raises gives one unavailable row with the reason; the others still run.
    """
    rows, seconds = [], {}
    for name, mod in found.items():
        if isinstance(mod, str):
            rows.append(unavailable_row(name, f"spec import failed: {mod}"))
            continue
        start = time.monotonic()
        try:
            rows += mod.numerics()
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            rows.append(unavailable_row(name, f"numerics() failed: {describe_error(exc)}"))
        seconds[name] = time.monotonic() - start
    return rows, seconds


def format_numerics_times(seconds: dict, budget: float = None) -> str:
    """``numerics time: norm 4.2 s, ...``, then a line naming each spec over ``budget``."""
    line = "numerics time: " + ", ".join(f"{n} {s:.1f} s" for n, s in seconds.items())
    slow = [n for n, s in seconds.items() if budget is not None and s > budget]
    if slow:
        line += (f"\nover the {budget:.0f} s budget of one spec: {', '.join(slow)} (make its numerics() "
                 "shapes smaller: the interpreter runs every program in Python)")
    return line


# ---------------------------------------------------------------------------------------------
# kernel profiles of one step (python -m bench --profile SPEC)
# ---------------------------------------------------------------------------------------------

# Kernel name -> category, the first pattern that matches (case-insensitive): the summary that
# puts providers side by side. Our Triton kernels, cuBLAS/CUTLASS/cuDNN, SDPA's flash and
# inductor's generated kernels (triton_tem_fused_mm... templates are GEMMs).
PROFILE_CATEGORIES = (
    ("attention", r"attn|flash|fmha|sdpa|scaled_dot"),
    ("gemm", r"gemm|matmul|_mm_|_mm$|addmm|bmm|cutlass|cublas|nvjet|xmma|wgmma|splitk"),
    ("norm", r"norm"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|_lce|linear_ce"),
    ("copy/fill", r"memcpy|memset|copy|fill|cat_|catarray"),
)


def kernel_category(name: str) -> str:
    for cat, pattern in PROFILE_CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "elementwise/other"


def kernel_rows(events) -> list:
    """``[{kernel, category, calls, us, share}]`` from ``(name, microseconds)`` events, one row
    per kernel name, the longest first; ``share`` is its fraction of all the events' time."""
    by_name = {}
    for name, us in events:
        row = by_name.setdefault(name, {"kernel": name, "category": kernel_category(name), "calls": 0, "us": 0.0})
        row["calls"] += 1
        row["us"] += float(us)
    total = sum(r["us"] for r in by_name.values())
    rows = sorted(by_name.values(), key=lambda r: -r["us"])
    for r in rows:
        r["share"] = r["us"] / total if total else 0.0
    return rows


def summarize_profile(provider: str, rows: list, step_ms: float | None) -> dict:
    """One provider's profile: its kernel rows, the totals and the time per category."""
    cats = {}
    for r in rows:
        c = cats.setdefault(r["category"], {"calls": 0, "us": 0.0})
        c["calls"] += r["calls"]
        c["us"] += r["us"]
    return {"provider": provider, "step_ms": step_ms, "kernel_ms": sum(r["us"] for r in rows) / 1e3,
            "launches": sum(r["calls"] for r in rows), "distinct": len(rows), "categories": cats, "kernels": rows}


def profile_events(prof, device_type: str) -> list:
    """``(name, us)`` of a ``torch.profiler`` run's device activity: every kernel, memcpy and
    memset on CUDA (their durations; they do not nest), or on the CPU every op's self time
    (ops nest there: self time counts each microsecond once)."""
    from torch.autograd import DeviceType

    if device_type == "cuda":
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type == DeviceType.CPU]


def profile_step(provider: str, fn, *, warmup: int = 3) -> dict:
    """Run ``fn`` (one step) ``warmup`` times, then once under ``torch.profiler`` (CUDA activity
    on a GPU, CPU ops otherwise): :func:`summarize_profile` of that one step, with its wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) * 1e3
    return summarize_profile(provider, kernel_rows(profile_events(prof, "cuda" if cuda else "cpu")), step_ms)


def format_profiles(title: str, profiles: list, top: int = 40) -> str:
    """A case's profiles: the providers side by side (step wall time, kernel time, launches,
    time per category), then each provider's kernels (calls, us, share of the step's kernel
    time), the longest ``top`` (the rest summed in one line)."""
    names = [p["provider"] for p in profiles]
    width = max([22] + [len(n) + 2 for n in names])
    lines = [f"== profile: {title} ==", f"{'':<26}" + "".join(f"{n:>{width}}" for n in names)]

    def row(label, values):
        lines.append(f"{label:<26}" + "".join(f"{v:>{width}}" for v in values))

    row("step wall ms", [_fmt(p["step_ms"], ".3f") for p in profiles])
    row("GPU kernels ms", [f"{p['kernel_ms']:.3f}" for p in profiles])
    row("launches", [str(p["launches"]) for p in profiles])
    row("distinct kernels", [str(p["distinct"]) for p in profiles])
    cats = list(dict.fromkeys(c for p in profiles
                              for c in sorted(p["categories"], key=lambda c: -p["categories"][c]["us"])))
    for c in cats:
        row(f"{c} ms (n)", [f"{p['categories'][c]['us'] / 1e3:.3f} ({p['categories'][c]['calls']})"
                            if c in p["categories"] else "-" for p in profiles])
    for p in profiles:
        lines += ["", f"-- {p['provider']}: {p['launches']} launches, {p['kernel_ms']:.3f} ms of kernels --",
                  f"{'calls':>6} {'us':>10} {'share':>6}  {'category':<17} kernel"]
        for r in p["kernels"][:top]:
            lines.append(f"{r['calls']:>6} {r['us']:>10.1f} {100 * r['share']:>5.1f}%  {r['category']:<17} "
                         f"{r['kernel'][:160]}")
        rest = p["kernels"][top:]
        if rest:
            lines.append(f"{sum(r['calls'] for r in rest):>6} {sum(r['us'] for r in rest):>10.1f} "
                         f"{100 * sum(r['share'] for r in rest):>5.1f}%  {'':<17} ({len(rest)} more kernels)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# environment and results files
# ---------------------------------------------------------------------------------------------

def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def environment() -> dict:
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "gpu": None,
        "driver": None,
        "torch_compile_mode": "default (--quick)" if QUICK else "each spec's",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, driver=_driver_version(), sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", memory_bytes=props.total_memory,
                   l2_bytes=l2_bytes())
    return env


def write_gpu_json(path: str, **payload) -> None:
    """The standalone GPU benchmarks' JSON file (``python -m bench.attention_hopper --json``, ...):
    ``{"device": the current GPU's name, **payload}``."""
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **payload}, f, indent=1)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (text or "cpu").lower()).strip("-") or "cpu"


def results_stem(env: dict, quick: bool) -> str:
    """``<gpu-slug>-<YYYY-MM-DD>[-quick]``."""
    return f"{slug(env.get('gpu'))}-{env['date'][:10]}" + ("-quick" if quick else "")


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_markdown(env: dict, ceilings: dict, measurements: list, numerics: list = ()) -> str:
    lines = [f"# Benchmark: {env.get('gpu') or 'no GPU'}", ""]
    lines.append(f"{env['date']}; driver {env.get('driver')}, CUDA {env.get('cuda')}, "
                 f"torch {env['torch']}, triton {env['triton']}.")
    if ceilings:
        lines.append(f"Ceilings measured in this run: copy {ceilings['copy_gbps']:.0f} GB/s "
                     f"(read + write), cuBLAS bf16 matmul {ceilings['matmul_bf16_tflops']:.0f} TFLOP/s.")
    lines.append("")
    lines.append("% of ceiling: of the copy bandwidth for GB/s, of the cuBLAS rate for TFLOP/s. "
                 "Ours' speedup: the row's time / ours' time (above 1: ours is faster).")
    for op in dict.fromkeys(m.op for m in measurements):
        lines += ["", f"## {op}", "",
                  "| shape | dtype | mode | provider | ms | GB/s | TFLOP/s | % of ceiling | peak MiB | ours' speedup |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for m in (m for m in measurements if m.op == op):
            if m.unavailable:
                lines.append(f"| {m.label} | {m.dtype} | {m.mode} | {m.provider} | "
                             f"unavailable: {m.unavailable.replace('|', '/')} | | | | | |")
                continue
            mib = None if m.peak_mem_bytes is None else m.peak_mem_bytes / 2**20
            lines.append(f"| {m.label} | {m.dtype} | {m.mode} | {m.provider} | {_fmt(m.ms, '.4f')} | "
                         f"{_fmt(m.gbps, '.0f')} | {_fmt(m.tflops, '.1f')} | {_fmt(m.pct_of_ceiling, '.1f')} | "
                         f"{_fmt(mib, '.1f')} | {_fmt(m.speedup_of_ours, '.2f')} |")
    if numerics:
        lines += ["", "## numerics", "", "```", format_numerics(numerics), "```"]
    return "\n".join(lines) + "\n"


def format_numerics(rows) -> str:
    w = max([16] + [len(r["op"]) for r in rows])  # the op column fits the longest name
    head = f"{'op':<{w}} {'case':<28} {'dtype':<9} {'tensor':<14} {'ours err':>10} {'torch err':>10} {'atol':>8}  result"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"{r['op']:<{w}} {r['case']:<28} {'-':<9} {'-':<14} {'':>10} {'':>10} {'':>8}  "
                         f"unavailable: {r['unavailable']}")
            continue
        lines.append(f"{r['op']:<{w}} {r['case']:<28} {r['dtype']:<9} {r['tensor']:<14} {r['err']:>10.2e} "
                     f"{r['torch_err']:>10.2e} {r['atol']:>8.1e}  {'pass' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


def write_results(out_dir: str, env: dict, ceilings: dict, measurements: list, numerics: list = (),
                  *, quick: bool = False, plots: bool = True, profiles: list = (), suffix: str = "") -> list:
    """Write the JSON, the markdown table and the plots; returns the paths written. ``profiles``
    (``python -m bench --profile``): one dict per profiled case, ``{"op", "shape", "profiles":
    [summarize_profile(...) per provider], "dispatch": fused_block.dispatch_table(), "choices": the norms' and
    attention's verdicts}``, kept
    under the JSON's ``"profiles"``; ``suffix`` goes after the file stem."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, results_stem(env, quick) + suffix)
    data = {"environment": env, "quick": quick, "ceilings": ceilings,
            "measurements": [dataclasses.asdict(m) for m in measurements], "numerics": list(numerics)}
    if profiles:
        data["profiles"] = list(profiles)
    paths = [stem + ".json", stem + ".md"]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(format_markdown(env, ceilings, measurements, numerics))
    if plots:
        from bench import plot
        paths += plot.plot_results(data, stem)
    return paths


def load_measurements(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return [Measurement(**m) for m in data["measurements"]]
