"""The static cost of the compiled kernels on sm_90, from their SASS, without a GPU.

Per kernel: registers and spills (the cubin's resource usage), and per region (the whole
kernel, then every loop) the instructions, the HGMMA (wgmma) instructions and the
issue/tensor ratio of one trip:

- **Loops** are the ranges [target, branch] of the backward branches (``BRA`` to a lower
  address) before the kernel's last ``EXIT`` (the mbarrier retry stubs after it jump back
  into the body: they are not loops), several branches to one target being one loop; a
  range of 4 instructions or fewer is a wait (an mbarrier spin), not a loop. Nested loops are
  listed each, an outer loop's counts including its inner loops. A loop with HGMMA whose
  trips mostly branch over an HGMMA-free block (a persistent GEMM's flattened tile loop: each
  K step skips the tile's epilogue but the last) is also given as its ``K step`` (the loop
  without that block: what most trips run) and its ``epilogue`` (once per tile).
- **Instructions** are counted without ``NOP``s.
- **issue / tensor** = (instructions x warps / 4 schedulers) / (the region's HGMMA FLOPs for
  the whole CTA / 4096), 4096 being H100/H200's dense bf16/fp16 FLOP per clock per SM (989
  TFLOP/s / (132 SMs x 1.83 GHz); tf32 runs at half that rate, fp8 at twice), with one
  instruction issued per scheduler per clock and every warpgroup issuing the region's HGMMAs
  (a 64xNxK HGMMA is 2 * 64 * N * K FLOPs per warpgroup). Near or above 1, the warps cannot
  issue the region's other instructions in the time the tensor cores take for its MMAs. A
  static proxy, not a timing: it ignores latencies, stalls, memory and how often each loop
  runs.

Two users: ``python -m fused_block.kernels.aot`` (``make compile-report``) adds these figures
for every shipped sm_90 config, and this module's CLI measures *the kernels of the benchmark
shapes* (:data:`WORKLOADS`: what the ops launch at the benchmark's shapes on sm_90, recorded
through ``fake_driver``, then compiled for real) and holds them to ``kernels/budgets.json``::

    python -m fused_block.kernels.sass                   # the table
    python -m fused_block.kernels.sass --check           # exit 1 where a kernel exceeds its budget
    python -m fused_block.kernels.sass --update-budgets  # today's figures + 2%, written to budgets.json

``tests/test_sass_budgets.py`` runs ``--check``'s comparison. Figures are for Triton 3.6.0 and
the ptxas/cuobjdump in its wheel (the pinned versions): another version gives other SASS.
"""
import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import triton

FLOP_PER_CLK_SM = {"BF16": 4096, "F16": 4096, "TF32": 2048, "E4M3": 8192, "E5M2": 8192}  # H100/H200, dense
SCHEDULERS = 4
WAIT_LOOP_MAX = 4  # instructions: a backward branch this short spins on a barrier
# The fp32 arithmetic of the softmax and the epilogues (exp2 is MUFU): a loop with none issues
# loads or waits (a TMA producer's loop), a loop with some is a kernel's hot loop.
FP_OPS = ("FFMA", "FADD", "FMUL", "FMNMX", "MUFU")
MARGIN = 0.02  # budgets: today's figures plus this
BUDGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "budgets.json")
ARCH = 90

# /*address*/ [@predicate] OPCODE operands ;
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_FUNCTION = re.compile(r"Function\s*:\s*(\S+)")
_HEX = re.compile(r"0x[0-9a-f]+")
_SHAPE = re.compile(r"\.(\d+)x(\d+)x(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Instr:
    addr: int
    op: str  # the opcode with its modifiers, e.g. HGMMA.64x128x16.F32.BF16
    args: str


@dataclasses.dataclass(frozen=True)
class Region:
    """One region of a kernel's SASS: ``name`` is ``kernel`` or ``loop <i>`` (address order)."""

    name: str
    start: int
    end: int
    depth: int  # enclosing loops
    instructions: int
    hgmma: int
    issue_tensor: float = None  # None without HGMMA
    fp: int = 0  # floating-point arithmetic instructions (:data:`FP_OPS`)


@dataclasses.dataclass(frozen=True)
class KernelCost:
    label: str  # what launched it (a workload) and the kernel function
    kernel: str
    num_warps: int
    num_stages: int
    registers: int
    spills: int  # local + stack bytes
    regions: tuple


def _bin(tool: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def disassemble(cubin: bytes) -> dict:
    """``{function: [Instr, ...]}`` from ``cuobjdump -sass`` (in Triton's wheel)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return _parse(text)


def _parse(text: str) -> dict:
    functions, current = {}, None
    for line in text.splitlines():
        m = _FUNCTION.search(line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = _LINE.search(line)
        if m and current is not None:
            current.append(Instr(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return functions


def _loops(ins):
    """[(first index, last index), ...] of the loops (see the module docstring), by address."""
    exits = [i for i, x in enumerate(ins) if x.op == "EXIT"]
    if not exits:
        return []
    index = {x.addr: i for i, x in enumerate(ins)}
    ends = {}
    for i, x in enumerate(ins[:exits[-1]]):
        if x.op.split(".")[0] != "BRA":
            continue
        targets = _HEX.findall(x.args)
        target = int(targets[-1], 16) if targets else None
        if target is not None and target < x.addr and target in index:
            ends[index[target]] = max(ends.get(index[target], i), i)
    return sorted((a, b) for a, b in ends.items()
                  if sum(ins[k].op != "NOP" for k in range(a, b + 1)) > WAIT_LOOP_MAX)


def _tensor_cycles(seq, num_warps: int) -> float:
    """Clock cycles the SM's tensor cores need for the region's HGMMAs, every warpgroup's."""
    cycles = 0.0
    for x in seq:
        if x.op.startswith("HGMMA"):
            m, n, k = (int(v) for v in _SHAPE.search(x.op + ".").groups())
            rate = next(FLOP_PER_CLK_SM[t] for t in reversed(x.op.split(".")) if t in FLOP_PER_CLK_SM)
            cycles += 2 * m * n * k * (num_warps / 4) / rate
    return cycles


def _region(name, seq, depth, num_warps) -> Region:
    instructions = sum(x.op != "NOP" for x in seq)
    hgmma = sum(x.op.startswith("HGMMA") for x in seq)
    tensor = _tensor_cycles(seq, num_warps)
    ratio = round(instructions * num_warps / SCHEDULERS / tensor, 3) if tensor else None
    return Region(name, seq[0].addr, seq[-1].addr, depth, instructions, hgmma, ratio, _fp_count(seq))


def _fp_count(seq) -> int:
    """The floating-point arithmetic (:data:`FP_OPS`) of ``seq``, less the reciprocal estimates
    of integer divisions by runtime values (``MUFU.RCP`` of an ``I2F.RP``'s result: the
    compiler's unsigned division, e.g. a persistent loader's tile index into head and block)."""
    from_int, n = set(), 0
    for x in seq:
        regs = [a.strip() for a in x.args.split(",")]
        if x.op.startswith("I2F.RP"):
            from_int.add(regs[0])
            continue
        if x.op.startswith("MUFU.RCP") and len(regs) > 1 and regs[1] in from_int:
            from_int.discard(regs[1])
            continue
        n += x.op.split(".")[0] in FP_OPS
        from_int.discard(regs[0])
    return n


def hot_loops_on_wgmma(rs) -> bool:
    """Whether a kernel's hot loops run their products on wgmma: among its :func:`regions`,
    at least one loop holds HGMMA and every loop with floating-point arithmetic
    (:data:`FP_OPS`) does (a warp-specialized kernel's TMA loader loop has none; a loop's
    ``K step`` / ``epilogue`` parts are not loops of their own)."""
    loops = [r for r in rs if r.name.startswith("loop") and not r.name.endswith(("K step", "epilogue"))]
    return any(r.hgmma for r in loops) and all(r.hgmma for r in loops if r.fp)


def _skipped_block(ins, a, b):
    """(first, last) index of the largest HGMMA-free block that a forward branch inside the
    loop [a, b] jumps over, when it holds most of the loop's instructions (else None): the
    tile epilogue that a persistent GEMM's flattened loop runs once per tile, its K steps
    branching over it."""
    index = {ins[k].addr: k for k in range(a, b + 1)}
    best = None
    for i in range(a, b + 1):
        x = ins[i]
        targets = _HEX.findall(x.args) if x.op.split(".")[0] == "BRA" else ()
        t = index.get(int(targets[-1], 16)) if targets else None
        if t is None or t <= i + 1:
            continue
        block = ins[i + 1:t]
        if not any(y.op.startswith("HGMMA") for y in block) and (best is None or t - i > best[1] - best[0] + 2):
            best = (i + 1, t - 1)
    if best is None:
        return None
    size = sum(ins[k].op != "NOP" for k in range(best[0], best[1] + 1))
    return best if 2 * size > sum(ins[k].op != "NOP" for k in range(a, b + 1)) else None


def regions(ins, num_warps: int) -> tuple:
    """The whole kernel, then its loops in address order (see the module docstring); a loop
    with HGMMA whose trips mostly branch over an HGMMA-free block (:func:`_skipped_block`)
    also gives ``loop <i> K step`` (the loop without that block) and ``loop <i> epilogue``."""
    loops = _loops(ins)
    out = [_region("kernel", ins, 0, num_warps)]
    for i, (a, b) in enumerate(loops):
        depth = sum(1 for c, d in loops if c <= a and b <= d and (c, d) != (a, b))
        loop = _region(f"loop {i}", ins[a:b + 1], depth, num_warps)
        out.append(loop)
        block = _skipped_block(ins, a, b) if loop.hgmma else None
        if block is not None:
            c, d = block
            step = _region(f"loop {i} K step", ins[a:c] + ins[d + 1:b + 1], depth + 1, num_warps)
            out.append(dataclasses.replace(step, start=loop.start, end=loop.end))
            out.append(_region(f"loop {i} epilogue", ins[c:d + 1], depth + 1, num_warps))
    return tuple(out)


def cost(compiled, label: str) -> KernelCost:
    """The :class:`KernelCost` of a compiled kernel (``triton.compile``'s result)."""
    from fused_block.kernels import aot

    name = compiled.metadata.name
    usage = aot._resource_usage(compiled.asm["cubin"], name)
    warps = compiled.metadata.num_warps
    return KernelCost(label, name, warps, compiled.metadata.num_stages, usage.get("REG", 0),
                      usage.get("LOCAL", 0) + usage.get("STACK", 0),
                      regions(disassemble(compiled.asm["cubin"])[name], warps))


def format_regions(rs, indent="  ") -> str:
    """One line per region: instructions, HGMMA, issue/tensor."""
    lines = []
    for r in rs:
        ratio = f"{r.issue_tensor:.2f}" if r.issue_tensor is not None else "-"
        where = r.name if r.name == "kernel" else f"{'  ' * r.depth}{r.name} 0x{r.start:x}-0x{r.end:x}"
        if r.name.endswith("K step"):
            where = f"{'  ' * r.depth}{r.name}"
        lines.append(f"{indent}{where:<34} {r.instructions:>6} {r.hgmma:>6} {ratio:>6}")
    return "\n".join(lines)


def format_costs(costs) -> str:
    head = f"{'kernel / region':<36} {'instr':>6} {'HGMMA':>6} {'i/tc':>6}"
    lines = [head, "-" * len(head)]
    for c in costs:
        lines.append(f"{c.label} (sm_{ARCH}, {c.num_warps} warps, {c.num_stages} stages): "
                     f"{c.registers} registers, {c.spills} B spilled")
        lines.append(format_regions(c.regions))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the kernels of the benchmark shapes
# ---------------------------------------------------------------------------------------------

def _empty(*shape, grad=False, dtype=None):
    import torch

    return torch.empty(shape, dtype=dtype or torch.bfloat16, requires_grad=grad)


def _attention(B, H, L, D, causal):
    import torch

    import fused_block

    q, k, v = (_empty(B, H, L, D, grad=True) for _ in range(3))
    out = fused_block.attention(q, k, v, causal=causal)
    torch.autograd.grad(out, (q, k, v), torch.empty_like(out))


@contextlib.contextmanager
def _opt_in(module, **switches):
    """An opt-in kernel's switches (module attributes, as the tests set them) on inside the block."""
    saved = {name: getattr(module, name) for name in switches}
    for name, value in switches.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _attention_gluon(B, H, L, D, causal, variant):
    """The opt-in Gluon Hopper forward (``FUSED_BLOCK_HOPPER_ATTN=1``, or the ``variant`` "ws",
    "persistent", "pingpong", "pingpong_overlap" or "pingpong_persistent":
    ``kernels/attention/hopper.py``); forward only, its backward being the Triton one."""
    import fused_block
    from fused_block.kernels.attention import hopper

    with _opt_in(hopper, ENABLED=True, WS=variant == "ws", PERSISTENT=variant == "persistent",
                 PINGPONG=variant.startswith("pingpong"), PP_OVERLAP=variant == "pingpong_overlap",
                 PP_PERSISTENT=variant == "pingpong_persistent"):
        fused_block.attention(*(_empty(B, H, L, D) for _ in range(3)), causal=causal)


def _attention_dq_atomic(B, H, L, D, causal):
    """The opt-in atomic-dQ backward (``FUSED_BLOCK_ATTN_DQ_ATOMIC=1``: ``backward_atomic.py``)."""
    from fused_block.kernels.attention import backward_atomic

    with _opt_in(backward_atomic, ENABLED=True):
        _attention(B, H, L, D, causal)


def _attention_gluon_bwd(B, H, L, D, causal, variant):
    """The opt-in Gluon Hopper backward (``FUSED_BLOCK_HOPPER_ATTN_BWD=1``, or "ws": its
    warp-specialized form, D64 only, or "persistent": its persistent form, D64 only:
    ``kernels/attention/hopper_bwd.py``) after the Triton forward."""
    from fused_block.kernels.attention import hopper_bwd

    with _opt_in(hopper_bwd, ENABLED=True, WS=variant == "ws", PERSISTENT=variant == "persistent"):
        _attention(B, H, L, D, causal)


def _attention_bwd_host_desc(B, H, L, D, causal, mode=1):
    """The backward's host-side descriptor candidates (configs' ``HOST_DESC`` ``mode`` 1 or 2:
    timed after the first config, never first until a GPU run) in place of the first config."""
    from fused_block.kernels import common
    from fused_block.kernels.attention import configs, launchers

    first = launchers._bwd_candidates
    with _opt_in(launchers, _BWD_CACHE=common.ConfigCache("attention_bwd"),
                 _bwd_candidates=lambda *a: [configs._host_desc_twin(first(*a)[0], mode)]):
        _attention(B, H, L, D, causal)


def _attention_window(B, H, L, D, left):
    import torch

    import fused_block

    q, k, v = (_empty(B, H, L, D, grad=True) for _ in range(3))
    out = fused_block.attention(q, k, v, causal=True, window=(left, -1))
    torch.autograd.grad(out, (q, k, v), torch.empty_like(out))


def _attention_varlen(lengths, H, D):
    import torch

    import fused_block

    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(lengths)
    q, k, v = (_empty(T, H, D, grad=True) for _ in range(3))
    out = fused_block.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    torch.autograd.grad(out, (q, k, v), torch.empty_like(out))


def _attention_scores(B, H, L, D, softcap, bias):
    """Softcap with sinks (Gemma 2 / gpt-oss), or a T5 relative-position bias with its gradient."""
    import torch

    import fused_block

    q, k, v = (_empty(B, H, L, D, grad=True) for _ in range(3))
    if bias:
        b = _empty(1, H, L, L, grad=True)
        out = fused_block.attention(q, k, v, bias=b)
        torch.autograd.grad(out, (q, k, v, b), torch.empty_like(out))
    else:
        sinks = torch.zeros(H, requires_grad=True)
        out = fused_block.attention(q, k, v, causal=True, softcap=softcap, sinks=sinks)
        torch.autograd.grad(out, (q, k, v, sinks), torch.empty_like(out))


def _attention_decode(B, Hq, Hkv, Lk, D):
    import fused_block

    fused_block.attention(_empty(B, Hq, 1, D), _empty(B, Hkv, Lk, D), _empty(B, Hkv, Lk, D))


def _linear(T, d, f, activation):
    import fused_block

    fused_block.linear(_empty(T, d), _empty(f, d), _empty(f) if activation else None, activation)


def _swiglu(T, d, f):
    import fused_block

    x = _empty(T, d)
    fused_block.swiglu(x, _empty(f, d), _empty(f, d), _empty(d, f), x)


def _geglu(T, d, f):
    """Gemma's FFN, a training step: gate/up with GeGLU, down; dGate/dUp in dH's epilogue."""
    import torch

    import fused_block

    x = _empty(T, d, grad=True)
    ws = (_empty(f, d, grad=True), _empty(f, d, grad=True), _empty(d, f, grad=True))
    out = fused_block.geglu(x, *ws, x)
    torch.autograd.grad(out, (x, *ws), torch.empty_like(out))


def _gemma_rms_norm(rows, hidden):
    """Gemma's (1 + w) RMSNorm with the residual add, forward and backward."""
    import torch

    import fused_block

    x, r, w = _empty(rows, hidden, grad=True), _empty(rows, hidden, grad=True), _empty(hidden, grad=True)
    out, res = fused_block.add_rms_norm(x, r, w, 1e-6, unit_offset=True)
    torch.autograd.grad((out, res), (x, r, w), (torch.empty_like(out), torch.empty_like(res)))


def _add_layer_norm(rows, hidden):
    import torch

    import fused_block

    x, r = _empty(rows, hidden, grad=True), _empty(rows, hidden, grad=True)
    w, b = _empty(hidden, grad=True), _empty(hidden, grad=True)
    out, res = fused_block.add_layer_norm(x, r, w, b)
    torch.autograd.grad((out, res), (x, r, w, b), (torch.empty_like(out), torch.empty_like(res)))


def _rope(B, L, H, D):
    import torch

    import fused_block

    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    fused_block.rope(_empty(B, L, H, D), _empty(B, L, H, D), torch.arange(L)[None], inv_freq)


# What ``python -m bench`` times (bench/specs: attention, matmul, norm; RoPE at LLaMA-7B's
# shape), bf16: (name, function, arguments). Each kernel a workload launches on sm_90 is
# measured once, under the first workload that launched that specialization.
WORKLOADS = (
    ("attention D64 causal", _attention, (8, 32, 2048, 64, True)),
    ("attention D64", _attention, (8, 32, 2048, 64, False)),
    ("attention D128 causal", _attention, (4, 16, 4096, 128, True)),
    ("attention D128", _attention, (4, 16, 4096, 128, False)),
    # The opt-in Hopper kernels at the same shapes (issue 30; not the default until a GPU run
    # verifies them): the Gluon forwards (single-partition, warp-specialized, persistent,
    # ping-pong, ping-pong one score block deeper, ping-pong persistent), and the atomic-dQ
    # backward with its dQ conversion.
    *((f"attention D{d}{' causal' if c else ''} gluon{' ' + v if v else ''}", _attention_gluon, (*s, c, v))
      for v in ("", "ws", "persistent", "pingpong", "pingpong_overlap", "pingpong_persistent")
      for d, s in ((64, (8, 32, 2048, 64)), (128, (4, 16, 4096, 128))) for c in (True, False)),
    *((f"attention D{d}{' causal' if c else ''} dq atomic", _attention_dq_atomic, (*s, c))
      for d, s in ((64, (8, 32, 2048, 64)), (128, (4, 16, 4096, 128))) for c in (True, False)),
    # The Gluon backward (one build serves causal and not: causality is a runtime bound).
    *((f"attention D{d} gluon bwd{' ' + v if v else ''}", _attention_gluon_bwd, (*s, False, v))
      for d, s, variants in ((64, (8, 32, 2048, 64), ("", "ws", "persistent")),
                             (128, (4, 16, 4096, 128), ("",)))
      for v in variants),
    # The backward's host-side descriptor candidates (docs/attention-scheduling.md): every
    # tile (1), the tiles read or written once (2, "edges").
    *((f"attention D{d}{' causal' if c else ''} bwd hostdesc{' edges' if m == 2 else ''}", _attention_bwd_host_desc,
       (*s, c, m))
      for m in (1, 2) for d, s in ((64, (8, 32, 2048, 64)), (128, (4, 16, 4096, 128))) for c in (True, False)),
    # Issue 17's features at the bench's shapes: Mistral's 4096-key window over 16k tokens
    # (a band block costs a plain one), packed sequences, softcap + sinks, a T5 bias, and a
    # decode step (split-KV) over a 16k cache with GQA 32:8.
    ("attention D128 causal window", _attention_window, (1, 16, 16384, 128, 4096)),
    ("attention D128 varlen causal", _attention_varlen, ((4096, 1000, 3000, 8192), 16, 128)),
    ("attention D128 causal softcap sinks", _attention_scores, (4, 16, 4096, 128, 50.0, False)),
    ("attention D64 t5 bias", _attention_scores, (8, 32, 2048, 64, None, True)),
    ("attention decode D128", _attention_decode, (8, 32, 8, 16384, 128)),
    ("linear gpt2-xl", _linear, (8192, 1600, 6400, None)),
    ("linear+bias+gelu gpt2-xl", _linear, (8192, 1600, 6400, "gelu")),
    ("swiglu llama-7b", _swiglu, (8192, 4096, 11008)),
    ("geglu gemma-2b", _geglu, (8192, 2048, 16384)),
    ("add_rms_norm 1+w gemma-2b", _gemma_rms_norm, (8192, 2048)),
    ("add_layer_norm 16384x4096", _add_layer_norm, (16384, 4096)),
    ("rope llama-7b", _rope, (2, 2048, 32, 128)),
)


@dataclasses.dataclass(frozen=True)
class Launched:
    """A kernel specialization a workload launched, as ``triton.compile`` takes it (picklable)."""

    label: str
    module: str
    fn: str
    signature: dict
    constants: dict
    attrs: dict
    num_warps: int
    num_stages: int

    def compile(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from triton.experimental.gluon._runtime import GluonASTSource

        fn = getattr(importlib.import_module(self.module), self.fn)
        source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource  # as aot.compile_spec
        src = source(fn=fn, signature=self.signature, constexprs=self.constants, attrs=self.attrs)
        return triton.compile(src, target=GPUTarget("cuda", ARCH, 32),
                              options={"num_warps": self.num_warps, "num_stages": self.num_stages})


@contextlib.contextmanager
def _products_not_computed():
    """torch's matrix products (the dispatch's cuBLAS candidate: ``torch.mm``, ``addmm``,
    ``_addmm_activation``, ``Tensor.addmm_``) return their output without computing it: while
    recording, no value is ever read (the kernels do not run), and on a CPU without fast bf16
    products one of the benchmark shapes' products takes minutes."""
    import torch

    def product(*args, out=None, **_):
        a, b = args[-2], args[-1]
        return out if out is not None else a.new_empty(a.shape[0], b.shape[1])

    def product_(self, *_, **__):
        return self

    saved = [(torch, "mm", torch.mm), (torch, "addmm", torch.addmm),
             (torch, "_addmm_activation", torch._addmm_activation), (torch.Tensor, "addmm_", torch.Tensor.addmm_)]
    try:
        for owner, name, _ in saved:
            setattr(owner, name, product_ if name == "addmm_" else product)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def launched(workloads=WORKLOADS) -> list:
    """What each workload launches on sm_90: the ops run on CPU tensors (never read: the
    launches are recorded by ``fake_driver``, not run; torch's products are not computed
    either) with the launchers' sm_90 branches and each config table's first config
    (``FUSED_BLOCK_TUNE=0``'s choice)."""
    from fused_block import _backend
    from fused_block.kernels import common, fake_driver

    tune, common.TUNE = common.TUNE, False
    out, seen = [], set()
    try:
        with fake_driver.installed(ARCH, record=True, check=False) as fake, \
                fake_driver.launcher_branches(ARCH), _backend.host_only(stub=False), _products_not_computed():
            for name, fn, args in workloads:
                fake.launches.clear()
                fn(*args)
                for rec in fake.launches:
                    src = rec.compiled.src
                    key = (src.fn.__module__, src.fn.__name__, repr(src.signature), repr(sorted(src.constants.items())),
                           repr(sorted(src.attrs.items())), rec.compiled.options["num_warps"],
                           rec.compiled.options["num_stages"])
                    if key in seen:
                        continue
                    seen.add(key)
                    label = f"{name}: {src.fn.__name__}"
                    repeat = sum(o.label == label or o.label.startswith(label + " #") for o in out)
                    out.append(Launched(label + (f" #{repeat + 1}" if repeat else ""), src.fn.__module__, src.fn.__name__,
                                        dict(src.signature), dict(src.constants), dict(src.attrs),
                                        rec.compiled.options["num_warps"], rec.compiled.options["num_stages"]))
    finally:
        common.TUNE = tune
    return out


def _cost_of(job: Launched) -> KernelCost:
    return cost(job.compile(), job.label)


def benchmark_costs(jobs=None) -> list:
    """Compile and measure every kernel of :data:`WORKLOADS` (in worker processes)."""
    work = launched()
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return [_cost_of(w) for w in work]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_cost_of, work))


# ---------------------------------------------------------------------------------------------
# budgets
# ---------------------------------------------------------------------------------------------

UPDATE = ("If the change is intended, refresh the budgets with `python -m fused_block.kernels.sass "
          "--update-budgets` (today's figures + 2%) and commit kernels/budgets.json with it (CONTRIBUTING.md).")


def budgets_of(costs, margin=MARGIN) -> dict:
    """Budgets from measured costs: each figure plus ``margin`` (rounded up), HGMMA counts and
    spills as they are, for the Triton version in use."""
    def up(v, digits=0):
        scale = 10 ** digits
        return math.ceil(v * (1 + margin) * scale - 1e-9) / scale if digits else math.ceil(v * (1 + margin) - 1e-9)

    kernels = {}
    for c in costs:
        kernels[c.label] = {
            "registers": up(c.registers), "spills": c.spills,
            "regions": {r.name: {"instructions": up(r.instructions), "hgmma": r.hgmma,
                                 **({"issue_tensor": up(r.issue_tensor, 3)} if r.issue_tensor is not None else {})}
                        for r in c.regions}}
    return {"about": "Static SASS budgets of the benchmark shapes' kernels on sm_90 (kernels/sass.py): "
                     "today's figures + 2%. " + UPDATE,
            "triton": triton.__version__, "margin": margin, "kernels": kernels}


def check(costs, budgets) -> list:
    """Every figure over its budget, as a message (empty: within budget)."""
    problems = []
    if budgets.get("triton") != triton.__version__:
        problems.append(f"budgets measured with Triton {budgets.get('triton')}, this is {triton.__version__}")
    limits = budgets["kernels"]
    for c in costs:
        b = limits.get(c.label)
        if b is None:
            problems.append(f"{c.label}: no budget (a new kernel or specialization)")
            continue
        if c.registers > b["registers"]:
            problems.append(f"{c.label}: {c.registers} registers > budget {b['registers']}")
        if c.spills > b["spills"]:
            problems.append(f"{c.label}: {c.spills} B spilled > budget {b['spills']} B")
        names = [r.name for r in c.regions]
        if names != list(b["regions"]):
            problems.append(f"{c.label}: regions {names}, budgeted {list(b['regions'])} (the loops changed)")
            continue
        for r in c.regions:
            rb = b["regions"][r.name]
            if r.instructions > rb["instructions"]:
                problems.append(f"{c.label}: {r.name}: {r.instructions} instructions > budget {rb['instructions']}")
            if r.hgmma != rb["hgmma"]:
                problems.append(f"{c.label}: {r.name}: {r.hgmma} HGMMA, budgeted {rb['hgmma']}")
            if r.issue_tensor is not None and r.issue_tensor > rb.get("issue_tensor", math.inf):
                problems.append(f"{c.label}: {r.name}: issue/tensor {r.issue_tensor:.3f} > budget "
                                f"{rb['issue_tensor']:.3f}")
    gone = sorted(set(limits) - {c.label for c in costs})
    problems += [f"{label}: budgeted, no longer launched by the benchmark shapes" for label in gone]
    return problems


def load_budgets(path=BUDGETS) -> dict:
    with open(path) as f:
        return json.load(f)


def write_budgets(costs, path=BUDGETS) -> None:
    with open(path, "w") as f:
        json.dump(budgets_of(costs), f, indent=1)
        f.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with kernels/budgets.json; exit 1 if over")
    parser.add_argument("--update-budgets", action="store_true", help="write today's figures + 2%% as the budgets")
    parser.add_argument("--json", help="also write the costs to this JSON file")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    from fused_block.kernels import common

    if common.interpreting():
        parser.error("run without TRITON_INTERPRET=1: the interpreter's kernels cannot be compiled")
    costs = benchmark_costs(args.jobs)
    print(format_costs(costs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(c) for c in costs], f)
    if args.update_budgets:
        write_budgets(costs)
        print(f"\nwrote {BUDGETS}")
    if args.check:
        problems = check(costs, load_budgets())
        if problems:
            print("\nover budget:\n  " + "\n  ".join(problems) + "\n" + UPDATE)
            return 1
        print(f"\n{len(costs)} kernels within budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
