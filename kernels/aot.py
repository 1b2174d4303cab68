"""Ahead-of-time compilation of every shipped kernel config for sm_80 and sm_90, without a GPU.

The Triton interpreter is permissive where the GPU compiler is not, so every kernel module
lists the configurations it can launch on CUDA (``aot_specs()``), and this module compiles
each of them with ``triton.compile(..., target=GPUTarget("cuda", cap, 32))``. ``ptxas`` and
``cuobjdump`` ship in Triton's wheel; the resource usage (registers, shared memory, local
memory and stack, i.e. spills) is read from the cubin.

``python -m fused_block.kernels.aot`` prints the table of every kernel and config, then, per
sm_90 config, the static cost of its SASS (``sass.py``: per loop, instructions, HGMMA and the
issue/tensor ratio); ``--resources-only`` skips that (the test suite's compile check).
"""
import argparse
import dataclasses
import functools
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from fused_block.kernels import sass

# Kernel modules that ship configs; each defines aot_specs() -> list[KernelSpec].
MODULES = ("norm", "attention", "matmul", "rope", "loss")
ARCHS = (80, 90)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel at one shipped configuration.

    ``signature`` maps every argument to a Triton type string (``"*bf16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``); ``constexprs`` gives the constexpr values. Pointer arguments
    and the integer arguments named in ``aligned`` are specialized as 16-divisible, as the
    runtime does for aligned tensors and strides.
    """

    name: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int = 1
    aligned: tuple = ()
    wgmma: bool = False  # on sm_90 the products must compile to wgmma
    tma: bool = False  # on sm_90 the loads must compile to TMA (cp.async.bulk.tensor)
    # On sm_90 its hot loops must hold wgmma (``sass.hot_loops_on_wgmma`` on its SASS: every loop
    # with floating-point arithmetic holds HGMMA); the compile check disassembles these builds.
    hot_loops: bool = False
    # The architectures this config ships for: each arch's config table is compiled (and held
    # to "no spills") on its own architecture only.
    archs: tuple = (80, 90)
    # The default test suite's compile check builds it (every shipped config is built there at
    # least once per arch and data path); False: a further flag combination of a config, built
    # by the heavy check (tests/test_compile.py, FUSED_BLOCK_HEAVY=1) and `make compile-report`.
    ci: bool = True
    # Why this config may spill (empty: a spill fails the compile check). Set only for a known
    # class with its reason (tests/test_compile.py lists them and checks the class).
    spills_ok: str = ""


@dataclasses.dataclass(frozen=True)
class CompileReport:
    module: str
    name: str
    arch: int
    num_warps: int
    num_stages: int
    registers: int
    shared: int
    local: int
    stack: int
    wgmma_required: bool
    wgmma_found: bool
    tma_required: bool = False
    tma_found: bool = False
    regions: tuple = ()  # sass.Region of the whole kernel and each loop (sm_90, when asked for)
    spills_ok: str = ""  # the spec's (KernelSpec.spills_ok)
    hot_loops_required: bool = False  # KernelSpec.hot_loops, on sm_90
    hot_loops_found: bool = False  # sass.hot_loops_on_wgmma of its regions

    @property
    def spills(self) -> bool:
        return self.local > 0 or self.stack > 0


def _bin(tool: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def take_turns(specs: list, items: dict) -> list:
    """``specs`` with the default test suite's share marked (``KernelSpec.ci``).

    ``items`` maps each group (say a kernel, arch, class and data path) to its configs in table
    order, each as the indices of its specs in ``specs``, one per flag combination in the same
    order for every config (the heaviest first). The configs take the combinations in turn,
    one each, continuing from config to config, so every config is compiled, and every
    combination of the group at least once (a group with fewer configs than combinations
    builds the rest on its last config). The heavy check builds the remaining product; specs
    outside ``items`` stay in the default check."""
    ci, grouped = set(), set()
    for group in items.values():
        for turn, indices in enumerate(group):
            ci.add(indices[turn % len(indices)])
            grouped.update(indices)
        last = group[-1]
        ci.update(last[k] for k in range(len(group), len(last)))
    return [dataclasses.replace(s, ci=False) if i in grouped - ci else s for i, s in enumerate(specs)]


def _resource_usage(cubin: bytes, kernel_name: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    match = re.search(r"Function " + re.escape(kernel_name) + r":\s*\n\s*(.*)", out)
    if match is None:
        raise RuntimeError(f"no resource usage for {kernel_name} in:\n{out}")
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", match.group(1))}


def compile_spec(spec: KernelSpec, arch: int, module: str = "", sass_costs: bool = False) -> CompileReport:
    args = list(spec.signature)
    attrs = {}
    for i, a in enumerate(args):
        if spec.signature[a].startswith("*") or a in spec.aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    # Gluon kernels (``gluon.jit``) build through their own source class (layouts are explicit).
    source = GluonASTSource if getattr(spec.fn, "is_gluon", lambda: False)() else ASTSource
    src = source(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    usage = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
    regions = ()
    hot_loops = spec.hot_loops and arch >= 90
    if (sass_costs or hot_loops) and arch == sass.ARCH:
        regions = sass.regions(sass.disassemble(compiled.asm["cubin"])[compiled.metadata.name], spec.num_warps)
    return CompileReport(
        module=module, name=spec.name, arch=arch, num_warps=spec.num_warps, num_stages=spec.num_stages,
        registers=usage.get("REG", 0), shared=compiled.metadata.shared,
        local=usage.get("LOCAL", 0), stack=usage.get("STACK", 0),
        wgmma_required=spec.wgmma and arch >= 90,
        wgmma_found="wgmma" in compiled.asm["ptx"],
        tma_required=spec.tma and arch >= 90,
        tma_found="cp.async.bulk.tensor" in compiled.asm["ptx"],
        regions=regions,
        spills_ok=spec.spills_ok,
        hot_loops_required=hot_loops,
        hot_loops_found=bool(regions) and sass.hot_loops_on_wgmma(regions),
    )


SUBSETS = ("all", "ci", "rest")  # every spec; the default check's (spec.ci); the heavy check's


@functools.lru_cache(maxsize=None)
def specs_of(module: str) -> list:
    return importlib.import_module(f"fused_block.kernels.{module}").aot_specs()


def _compile_one(job):
    module, index, arch, sass_costs = job
    return compile_spec(specs_of(module)[index], arch, module, sass_costs)


def compile_all(modules=MODULES, archs=ARCHS, jobs=None, sass_costs=False, subset="all") -> list:
    """Compile every spec of ``modules`` in ``subset`` (:data:`SUBSETS`) for every arch, in
    parallel worker processes; with ``sass_costs``, each sm_90 report carries its SASS regions."""
    if subset not in SUBSETS:
        raise ValueError(f"subset must be one of {SUBSETS}, got {subset!r}")
    work = [(m, i, a, sass_costs) for m in modules for i, spec in enumerate(specs_of(m)) for a in archs
            if a in spec.archs and (subset == "all" or spec.ci == (subset == "ci"))]
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return [_compile_one(w) for w in work]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_compile_one, work))


def format_table(reports) -> str:
    head = (f"{'kernel / config':<64} {'sm':>3} {'warps':>5} {'stages':>6} {'regs':>5} {'smem':>7} "
            f"{'spill':>6} {'wgmma':>6} {'tma':>4}")
    lines = [head, "-" * len(head)]
    for r in reports:
        spill = f"{r.local + r.stack}B" if r.spills else "0"
        wg = ("yes" if r.wgmma_found else "NO") if r.wgmma_required else ("yes" if r.wgmma_found else "-")
        tma = ("yes" if r.tma_found else "NO") if r.tma_required else ("yes" if r.tma_found else "-")
        lines.append(f"{r.name:<64} {r.arch:>3} {r.num_warps:>5} {r.num_stages:>6} {r.registers:>5} "
                     f"{r.shared:>7} {spill:>6} {wg:>6} {tma:>4}")
    return "\n".join(lines)


def format_costs(reports) -> str:
    """Per sm_90 report with SASS regions: registers, spills, then instructions, HGMMA and
    issue/tensor of the whole kernel and of each loop."""
    head = f"{'kernel / config, then its regions (sm_90)':<66} {'instr':>6} {'HGMMA':>6} {'i/tc':>6}"
    lines = [head, "-" * len(head)]
    for r in reports:
        if r.regions:
            lines.append(f"{r.name} (warps {r.num_warps}, stages {r.num_stages}): {r.registers} registers, "
                         f"{r.local + r.stack} B spilled")
            lines.append(sass.format_regions(r.regions, indent="    "))
    return "\n".join(lines)


def compile_all_subprocess(modules=MODULES, jobs=None, subset="all", path=None) -> list:
    """:func:`compile_all` in a fresh interpreter with ``TRITON_INTERPRET`` off; with ``path``,
    the reports stay in that JSON file (:func:`load_reports`).

    Under the interpreter ``triton.jit`` makes interpreted functions, which cannot be compiled
    for a GPU; the test suite (which runs with ``TRITON_INTERPRET=1``) uses this.
    """
    # No line tables: the same code and resources (checked on attention and GEMM configs),
    # about a tenth less compile time.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DISABLE_LINE_INFO="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(path or os.path.join(tmp, "reports.json"))
        cmd = [sys.executable, "-m", "fused_block.kernels.aot", "--json", out, "--quiet", "--resources-only"]
        cmd += [f"--module={m}" for m in modules] + ([f"--jobs={jobs}"] if jobs else []) + [f"--subset={subset}"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if not os.path.exists(out):
            raise RuntimeError(f"compile run failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return load_reports(out)


def load_reports(path) -> list:
    """The reports a ``--json`` run wrote."""
    with open(path) as f:
        return [CompileReport(**{**r, "regions": tuple(sass.Region(**x) for x in r["regions"])})
                for r in json.load(f)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", choices=MODULES, help="only these kernel modules")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--subset", choices=SUBSETS, default="all",
                        help="ci: the default test suite's specs; rest: the heavy check's (default: all)")
    parser.add_argument("--json", help="also write the reports to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="print only the summary line")
    parser.add_argument("--resources-only", action="store_true",
                        help="no SASS costs (disassembling every sm_90 config takes about a second each)")
    args = parser.parse_args(argv)
    reports = compile_all(tuple(args.module or MODULES), jobs=args.jobs, sass_costs=not args.resources_only,
                          subset=args.subset)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in reports], f)
    if not args.quiet:
        print(format_table(reports))
        if not args.resources_only:
            print("\n" + format_costs(reports))
    bad = [r for r in reports if r.spills or (r.wgmma_required and not r.wgmma_found)
           or (r.tma_required and not r.tma_found) or (r.hot_loops_required and not r.hot_loops_found)]
    print(f"\n{len(reports)} compiled, {len(bad)} with spills or missing wgmma/TMA (hot loops included)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
