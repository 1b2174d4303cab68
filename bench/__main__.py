"""python -m bench: the main job, GPU timings or (without a GPU) the numerics report.

On a CUDA GPU: measures the ceilings, times every spec's cases (a progress line per spec with
its estimated time), checks numerics, writes ``<gpu-slug>-<date>[-quick].json`` (with the
commit it ran at), ``.md`` and PNG plots under ``--out``, and ends with a summary sorted by op,
ours' speedup over each peer marked above or below 1, and where the files went
(``python -m bench.report`` turns a committed results file into the README's table). Without one: says
that timings need an NVIDIA GPU and prints the numerics report (the kernels run through the
Triton interpreter), with each spec's time; ``--compile-report`` adds the compiled-kernel
resource table (it compiles every config for sm_80 and sm_90: minutes). Exits 1 if a numerics
row fails.
"""
import argparse
import importlib.util
import os
import subprocess
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # The interpreter must be chosen before Triton is imported (fused_block imports it).
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set")
    os.environ["TRITON_INTERPRET"] = "1"

from bench import harness, specs  # noqa: E402

# A rough cost of one provider's timing when no earlier run of the spec recorded its time: the
# first call (a Triton autotune or a torch.compile compile can take far longer), then do_bench's
# warm-up and repetitions.
EST_S_PER_PROVIDER = 1.5
COLOR = {"faster": "\033[32m", "slower": "\033[31m", "end": "\033[0m"}

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Spec name -> the kernel module whose compiled configs belong to it.
KERNEL_MODULES = {"norm": "norm", "attention": "attention", "matmul": "matmul", "loss": "loss"}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a few shapes per op and torch.compile's default mode (the GPU check script)")
    p.add_argument("--only", default=None, help="comma-separated specs, e.g. norm,attention "
                   f"(available: {','.join(specs.names())})")
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder (default: bench/results)")
    p.add_argument("--compile-report", action="store_true",
                   help="without a GPU: add the compiled-kernel resource table (compiles every config "
                        "for sm_80 and sm_90; the same as make compile-report)")
    p.add_argument("--spec-budget", type=float, default=None, metavar="SECONDS",
                   help="on a GPU: start no further case of a spec after this many seconds in it "
                        "(those cases are recorded as not run), so every spec gets its turn; what a "
                        "spec leaves unused goes to the next")
    p.add_argument("--profile", default=None, metavar="SPEC[,SPEC]",
                   help="on a GPU: one training step of each named spec's profile case (block, hf) under "
                        "torch.profiler, for ours, eager and torch.compile (and Liger where installed): every "
                        "kernel with calls, time and share of the step, printed and written to the results "
                        "JSON; alone it runs only the profiles (<stem>-profile.json), with --only after the "
                        "timings")
    args = p.parse_args(argv)
    for opt in ("only", "profile"):
        value = getattr(args, opt)
        if value is not None:
            value = [s.strip() for s in value.split(",") if s.strip()]
            if not value:
                p.error(f"--{opt}: no spec named (available: {', '.join(specs.names())})")
        setattr(args, opt, value)
        unknown = [s for s in value or () if s not in specs.names()]
        if unknown:
            p.error(f"--{opt}: no spec named {', '.join(unknown)} (available: {', '.join(specs.names())})")
    if args.spec_budget is not None and not 0 < args.spec_budget < float("inf"):
        p.error(f"--spec-budget: a number of seconds > 0, got {args.spec_budget}")
    return args


def profile_cases(mod) -> list:
    """A spec's cases to profile: its ``profile_cases()``, or its first quick training-step case."""
    if hasattr(mod, "profile_cases"):
        return mod.profile_cases()
    return [c for c in mod.cases(True) if c.mode == "fwd+bwd"][:1]


def timed_choices() -> list:
    """The norms' and attention's verdicts so far (``fused_block.norm_choices()``,
    ``attention_choices()``) as JSON rows: op, bucket (its fields as strings), candidate,
    milliseconds per candidate."""
    import fused_block

    return [{"op": op, "bucket": [str(v) for v in bucket], "candidate": best, "ms": dict(times)}
            for op, found in (("norm", fused_block.norm_choices()), ("attention", fused_block.attention_choices()))
            for bucket, (best, times) in found.items()]


def run_profiles(names) -> list:
    """Profile one step of each provider of each named spec's profile cases (CUDA), printing the
    tables; returns the records for the results JSON (with the GEMM dispatch table)."""
    import fused_block

    records = []
    for name, mod in specs.discover(names).items():
        if isinstance(mod, str):
            print(f"profile {name}: spec unavailable ({mod})", flush=True)
            continue
        for case in profile_cases(mod):
            profiles, failed, dispatch, verdicts = [], {}, [], []
            for provider, factory in case.providers.items():
                fn = None
                try:
                    fn = factory()
                    profiles.append(harness.profile_step(provider, fn))
                    if provider == case.ours:  # the candidates ours' steps ran (before any forced run)
                        dispatch, verdicts = fused_block.dispatch_table(), timed_choices()
                except Exception as exc:  # noqa: BLE001 - reported, the others still run
                    failed[provider] = harness.describe_error(exc)
                finally:
                    del fn
                    harness._free()
            title = f"{case.op} {case.label} {harness.dtype_name(case.dtype)} {case.mode}"
            print("\n" + harness.format_profiles(title, profiles), flush=True)
            for provider, reason in failed.items():
                print(f"  {provider}: unavailable ({reason})", flush=True)
            print("\nGEMM dispatch (fused_block.dispatch_table()):\n" + fused_block.dispatch.format_table(dispatch),
                  flush=True)
            print("\nnorm and attention choices (fused_block.norm_choices(), attention_choices()):\n"
                  + "\n".join(f"  {v['op']:<9} {v['candidate']:<10} {v['bucket']}  "
                               + ", ".join(f"{c}={t:.4f}ms" for c, t in v["ms"].items()) for v in verdicts),
                  flush=True)
            records.append({"spec": name, "op": case.op, "shape": dict(case.shape),
                            "dtype": harness.dtype_name(case.dtype), "mode": case.mode, "profiles": profiles,
                            "unavailable": failed, "dispatch": dispatch, "choices": verdicts})
    return records


def print_reports(found: dict, quick: bool) -> None:
    """Specs that measure something other than GPU timings (e.g. ``host``) print it here."""
    for name, mod in found.items():
        if not isinstance(mod, str) and hasattr(mod, "report"):
            print(f"\n{mod.report(quick)}", flush=True)


def compile_table(only) -> str:
    """``python -m fused_block.kernels.aot`` in a subprocess without ``TRITON_INTERPRET``.

    Under the interpreter ``@triton.jit`` yields interpreted functions that cannot be compiled,
    and this process had to import Triton with the interpreter on.
    """
    from fused_block.kernels import aot

    modules = [m for m in aot.MODULES if importlib.util.find_spec(f"fused_block.kernels.{m}") is not None]
    if only:
        modules = [m for m in modules if m in {KERNEL_MODULES.get(s) for s in only}]
    if not modules:
        return "(no kernel modules to compile yet)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "fused_block.kernels.aot"] + [a for m in modules for a in ("--module", m)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    text = proc.stdout.strip()
    if proc.returncode not in (0, 1) or not text:  # aot exits 1 when a config spills
        text += f"\n(exit {proc.returncode}) " + proc.stderr.strip()[-2000:]
    return text


def commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files), or
    ``$FUSED_BLOCK_COMMIT`` where there is no git checkout (a copy of the tree), else None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("FUSED_BLOCK_COMMIT") or None


def previous_seconds(out_dir: str, quick: bool) -> dict:
    """Seconds per spec of the newest earlier results file in ``out_dir`` of the same kind
    (quick or full), from its ``environment.seconds.specs``: the estimates' first source."""
    import glob
    import json

    best = (None, {})
    for path in glob.glob(os.path.join(out_dir, "*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            env = data["environment"]
            if bool(data.get("quick")) != quick:
                continue
            date = env.get("date") or ""
            if best[0] is None or date > best[0]:
                best = (date, dict((env.get("seconds") or {}).get("specs") or {}))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return best[1]


def estimate_line(name: str, cases: list, previous: dict, budget) -> str:
    """``spec norm: 6 cases, 24 provider timings, about 40 s (the last run's time)``."""
    timings = sum(len(c.providers) for c in cases)
    if name in previous:
        est = f"about {previous[name]:.0f} s (its time in the last results file here)"
    else:
        est = (f"roughly {timings * EST_S_PER_PROVIDER:.0f} s ({EST_S_PER_PROVIDER:g} s per timing; "
               "torch.compile's compiles and autotuning add to it)")
    line = f"spec {name}: {len(cases)} cases, {timings} provider timings, {est}"
    if budget is not None:
        line += f"; budget {budget:.0f} s"
    return line


def _speedup_text(x: float, color: bool) -> str:
    text = f"{x:.2f}x " + ("\u25b2" if x >= 1 else "\u25bc")
    if color:
        text = COLOR["faster" if x >= 1 else "slower"] + text + COLOR["end"]
    return text


def format_summary(measurements: list, ours: dict = None, color: bool = False) -> str:
    """The final table a person reads: ops sorted by name, one line per case with ours' time, rate
    and % of ceiling, then ours' speedup over each peer that ran (the peer's time / ours':
    \u25b2 above 1, ours faster; \u25bc below 1, ours slower; green / red with ``color``).
    ``ours`` maps ``(op, label, dtype, mode)`` to the case's ``ours`` provider (default
    ``"fused_block"``)."""
    groups = {}
    for m in measurements:
        groups.setdefault((m.op, m.label, m.dtype, m.mode), {})[m.provider] = m
    lines = ["== speedups: the peer's time / ours' (\u25b2 ours faster, \u25bc ours slower) =="]
    for op in sorted({k[0] for k in groups}):
        lines.append(op)
        for (o, label, dtype, mode), by in groups.items():
            if o != op:
                continue
            mine = (ours or {}).get((o, label, dtype, mode), "fused_block")
            ours_m = by.get(mine)
            if ours_m is None or not ours_m.ms:
                lines.append(f"  {label} {dtype} {mode}: ours did not run")
                continue
            rate = f"{ours_m.gbps:.0f} GB/s" if ours_m.gbps is not None else (
                f"{ours_m.tflops:.1f} TFLOP/s" if ours_m.tflops is not None else "")
            pct = "" if ours_m.pct_of_ceiling is None else f", {ours_m.pct_of_ceiling:.0f}% of ceiling"
            peers = ", ".join(f"{p} {_speedup_text(m.speedup_of_ours, color)}" for p, m in by.items()
                              if p != mine and m.speedup_of_ours)
            lines.append(f"  {label} {dtype} {mode}: {mine} {ours_m.ms:.4f} ms {rate}{pct}"
                         + (f"; {peers}" if peers else ""))
    return "\n".join(lines)


def _use_color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def run_cpu(args, found) -> int:
    print("Timings need an NVIDIA GPU: torch.cuda.is_available() is False, so nothing is timed and "
          "no results file is written.\nBelow: the numerics report (kernels through the Triton "
          "interpreter)" + (" and the compiled-kernel resource table" if args.compile_report else
                            "; --compile-report (or make compile-report) adds the compiled-kernel "
                            "resource table") + ".\n", flush=True)
    for name, mod in found.items():
        if isinstance(mod, str):
            print(f"spec {name}: unavailable ({mod})")
            continue
        try:
            full, quick = len(mod.cases(False)), len(mod.cases(True))
            print(f"spec {name}: {full} timing cases on a GPU ({quick} with --quick)")
        except Exception as exc:  # noqa: BLE001
            print(f"spec {name}: cases() failed: {harness.describe_error(exc)}")
    print("\n== numerics: max |error| vs the float64 reference; ours must be <= 2 x torch's + atol ==",
          flush=True)
    rows, seconds = [], {}
    for name, mod in found.items():
        print(f"spec {name}: numerics (budget {harness.NUMERICS_BUDGET_S:.0f} s) ...", flush=True)
        spec_rows, spec_seconds = harness.timed_numerics({name: mod})
        rows += spec_rows
        seconds.update(spec_seconds)
    print(harness.format_numerics(rows), flush=True)
    print(harness.format_numerics_times(seconds, harness.NUMERICS_BUDGET_S), flush=True)
    print_reports(found, args.quick)
    if args.compile_report:
        print("\n== compiled kernels (sm_80, sm_90) ==", flush=True)
        try:
            print(compile_table(args.only))
        except Exception as exc:  # noqa: BLE001
            print(f"compile table unavailable: {harness.describe_error(exc)}")
    if args.profile:
        print("\n--profile needs an NVIDIA GPU (torch.cuda.is_available() is False): nothing profiled.")
    failed = [r for r in rows if r.get("ok") is False]
    print(f"\nnumerics: {sum(r.get('ok') is True for r in rows)} pass, {len(failed)} fail, "
          f"{sum('unavailable' in r for r in rows)} unavailable")
    return 1 if failed else 0


def run_cuda(args, found) -> int:
    env = harness.environment()
    env["commit"] = commit()
    previous = previous_seconds(args.out, args.quick)
    print(f"{env['gpu']}: driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
          f"triton {env['triton']}", flush=True)
    rows, seconds = harness.timed_numerics(found)
    print(harness.format_numerics(rows), flush=True)
    print(harness.format_numerics_times(seconds), flush=True)
    print_reports(found, args.quick)
    # How long each part took, in the results: what the GPU check's time budget is made of.
    env["seconds"] = {"numerics": {n: round(t, 1) for n, t in seconds.items()}, "specs": {}}
    ceilings = harness.measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, cuBLAS bf16 "
          f"{ceilings['matmul_bf16_tflops']:.0f} TFLOP/s", flush=True)
    measurements, ours = [], {}
    carry = 0.0  # --spec-budget seconds earlier specs left unused: the next spec may use them
    for name, mod in found.items():
        if isinstance(mod, str):
            print(f"spec {name}: unavailable ({mod})", flush=True)
            continue
        try:
            cases = mod.cases(args.quick)
        except Exception as exc:  # noqa: BLE001
            print(f"spec {name}: cases() failed: {harness.describe_error(exc)}", flush=True)
            continue
        start = time.monotonic()
        budget = None if args.spec_budget is None else args.spec_budget + carry
        print(estimate_line(name, cases, previous, budget), flush=True)
        for case in cases:
            ours[(case.op, case.label, harness.dtype_name(case.dtype), case.mode)] = case.ours
            if budget is not None and time.monotonic() - start > budget:
                results = harness.not_run(case, f"not run: spec {name} used its {budget:.0f} s "
                                                "budget (--spec-budget and what earlier specs left)")
            else:
                results = harness.run_case(case, ceilings)
            for m in results:
                measurements.append(m)
                if m.unavailable:
                    print(f"  {m.op} {m.label} {m.dtype} {m.mode} {m.provider}: unavailable ({m.unavailable})",
                          flush=True)
                else:
                    rate = f"{m.gbps:.0f} GB/s" if m.gbps is not None else (
                        f"{m.tflops:.1f} TFLOP/s" if m.tflops is not None else "")
                    mem = "" if m.peak_mem_bytes is None else f", peak {m.peak_mem_bytes / 2**20:.0f} MiB"
                    print(f"  {m.op} {m.label} {m.dtype} {m.mode} {m.provider}: {m.ms:.4f} ms {rate}{mem}", flush=True)
            env["seconds"]["specs"][name] = round(time.monotonic() - start, 1)
            # Rewritten after each case so a run cut short still leaves what it measured.
            harness.write_results(args.out, env, ceilings, measurements, rows, quick=args.quick, plots=False)
        print(f"spec {name}: done in {env['seconds']['specs'].get(name, 0.0):.0f} s", flush=True)
        if budget is not None:
            carry = max(0.0, budget - (time.monotonic() - start))
    profiles = run_profiles(args.profile) if args.profile else ()
    try:
        paths = harness.write_results(args.out, env, ceilings, measurements, rows, quick=args.quick,
                                      profiles=profiles)
    except Exception as exc:  # noqa: BLE001 - e.g. matplotlib missing: keep the tables
        print(f"plots failed: {harness.describe_error(exc)}")
        paths = harness.write_results(args.out, env, ceilings, measurements, rows, quick=args.quick, plots=False,
                                      profiles=profiles)
    print()
    print(format_summary(measurements, ours, color=_use_color()))
    print()
    tables = [p for p in paths if not p.endswith(".png")]
    plots = [p for p in paths if p.endswith(".png")]
    print("results (every provider, the reasons of those that did not run): " + ", ".join(tables))
    print("plots: " + (", ".join(plots) if plots else "none drawn"))
    print("the README's table: commit the results file, then python -m bench.report")
    return 1 if any(r.get("ok") is False for r in rows) else 0


def run_profile_only(args) -> int:
    """``--profile`` without ``--only``: the profiles alone, in ``<stem>-profile.json``."""
    if not CUDA:
        print("--profile needs an NVIDIA GPU (torch.cuda.is_available() is False): nothing profiled.")
        return 2
    env = harness.environment()
    print(f"{env['gpu']}: driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
          f"triton {env['triton']}", flush=True)
    start = time.monotonic()
    profiles = run_profiles(args.profile)
    env["seconds"] = {"profiles": round(time.monotonic() - start, 1)}
    paths = harness.write_results(args.out, env, {}, [], quick=args.quick, plots=False, profiles=profiles,
                                  suffix="-profile")
    print("wrote " + ", ".join(paths))
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    harness.QUICK = args.quick
    if args.profile and not args.only:
        harness.QUICK = True  # profile cases compile with torch.compile's default mode
        return run_profile_only(args)
    found = specs.discover(args.only)
    return run_cuda(args, found) if CUDA else run_cpu(args, found)


if __name__ == "__main__":
    sys.exit(main())
