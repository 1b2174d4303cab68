"""Helpers shared by every kernel: the interpreter switch, the dot helper, the launch path.

The Triton interpreter (``TRITON_INTERPRET=1``, used on CPU-only machines) keeps bf16 as raw
uint16 bits, so bf16 arithmetic and ``tl.dot`` on bf16 operands give garbage there, while
bf16 <-> fp32 conversions are exact. Kernels therefore do their arithmetic in fp32 after
loading, and every matrix product goes through :func:`dot`, which upcasts low-precision
operands only when ``INTERPRET`` (a constexpr computed by the launcher) is set. On the GPU
the operands stay in fp16/bf16 and the product runs on tensor cores (wgmma on sm_90).
"""
import collections
import dataclasses
import os

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from fused_block.kernels import launch as _direct

# Launch counts per kernel name. Tests read it to prove the Triton path ran.
LAUNCHES = collections.Counter()
# Host-overhead measurement without a GPU: when set, :func:`launch` counts the launch and
# returns without running the kernel (outputs keep whatever the launcher allocated).
STUB_LAUNCHES = False
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (fixed when Triton is imported)."""
    return _INTERPRET


def count_launch(name: str) -> None:
    LAUNCHES[name] += 1


# ---------------------------------------------------------------------------------------------
# host-side integer helpers: plain Python (triton.cdiv / next_power_of_2 cost ~4 us a call)
# ---------------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# the device: architecture class for config tables, fp32 matmul precision
# ---------------------------------------------------------------------------------------------

ARCHS = (80, 90)  # config tables exist for these; any other GPU uses the nearest one below
_ARCH = {}


def arch(device) -> int:
    """The config-table architecture of ``device``: 90 for Hopper and newer, else 80.

    The interpreter (CPU tensors) reports 0: launchers use their single interpreter config.
    """
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    a = _ARCH.get(index)
    if a is None:
        major, minor = torch.cuda.get_device_capability(index)
        a = _ARCH[index] = 90 if major >= 9 else 80
    return a


def fp32_precision() -> str:
    """``"tf32"`` when torch lets fp32 matmuls use TF32, else ``"ieee"`` (torch's default).

    Read at call time, as torch's own matmuls do: ``torch.set_float32_matmul_precision("high")``
    or ``torch.backends.cuda.matmul.allow_tf32 = True`` (or the newer ``fp32_precision =
    "tf32"``) select TF32. Attention has no switch of its own in torch; it follows this one.
    """
    return "tf32" if torch._C._get_cublas_allow_tf32() else "ieee"


_SM_COUNT = {}


def sm_count(device) -> int:
    """Number of streaming multiprocessors (a fixed stand-in on the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


@triton.jit
def to_tf32(x, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to TF32's 10-bit mantissa, to nearest with ties away from zero (as
    ``cvt.rna.tf32.f32``, what cuBLAS feeds its TF32 tensor cores), still stored as fp32.

    The tensor cores read only an fp32 operand's upper 19 bits: fed raw fp32 (Triton's
    ``input_precision="tf32"`` does no conversion) they truncate toward zero, an error twice
    rounding's and biased (every product shrinks by 2^-11 on average), which measured 2-10x
    torch's TF32 error on an H200 (GEMMs, decode attention, a loss summing such logits). The
    interpreter rounds on the bits: adding half of the 13 dropped bits rounds the magnitude
    (ties away), NaN and Inf kept."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(x) < float("inf"), rounded, x)
    else:
        return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def dot(a, b, acc, INTERPRET: tl.constexpr, PRECISION: tl.constexpr = "tf32"):
    """``acc + a @ b`` with fp32 accumulation. ``PRECISION`` applies to fp32 operands: "tf32"
    (TF32 tensor cores, operands rounded to nearest TF32 first: :func:`to_tf32`) or "ieee"
    (full fp32, as torch's default "highest"); fp16/bf16 products are exact either way and
    their operands go to the tensor cores as they are. The interpreter keeps bf16 as raw bits,
    so it upcasts 16-bit operands and computes exactly; on the GPU bf16 stays bf16. fp32
    operands keep ``PRECISION`` in the interpreter too (it computes "tf32" exactly in fp32; the
    tests' interpreter truncates its operands as the tensor cores do: tests/interpreter_hardware.py)."""
    if PRECISION == "tf32" and a.dtype == tl.float32 and b.dtype == tl.float32:
        return tl.dot(to_tf32(a, INTERPRET), to_tf32(b, INTERPRET), acc, input_precision="tf32")
    elif INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def dot_step(a, b, acc, INTERPRET: tl.constexpr, PRECISION: tl.constexpr = "tf32"):
    """One step of a K loop: :func:`dot`, except that IEEE fp32 products sum the step's block
    on its own and add it to ``acc``.

    IEEE fp32 products run on the FMA units, one FMA per k into the accumulator (Triton's FMA
    lowering): one rounding chain over the whole K, whose error grows like K (a weight
    gradient's reduction over 512 rows: 2.7x torch's error on an H200). Summed per block, the
    chains are BLOCK_K long and the K / BLOCK_K partial sums add in a chain of their own: about
    sqrt(BLOCK_K) less error at long K (4x at BLOCK_K 16, K 512: tests/test_linear.py's
    test_ieee_accumulation_error), for one FADD per BLOCK_K FMAs. Tensor-core products (TF32,
    16-bit) accumulate as before."""
    if PRECISION == "ieee" and a.dtype == tl.float32 and b.dtype == tl.float32:
        return acc + dot(a, b, tl.zeros_like(acc), INTERPRET, PRECISION)
    else:
        return dot(a, b, acc, INTERPRET, PRECISION)


def _scratch(size, alignment, stream):
    """Global scratch for device-side tensor descriptors, on the current device (where Triton
    launches)."""
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def scratch_allocator() -> None:
    """``triton.set_allocator`` for the scratch of device-side tensor descriptors, where it is not
    already set: a ContextVar, so each thread (autograd's backward thread too) and context sets
    its own; a ContextVar read where it is."""
    if _allocation._allocator.get() is not _scratch:
        triton.set_allocator(_scratch)


# tanh(x) = x P(x^2) / sqrt(Q(x^2)) on |x| <= 8, P of degree 2 and Q of degree 5 (so that the
# quotient tends to a constant as tanh does): a relative minimax fit (least squares reweighted
# towards the largest error, on [0, 8] plus the clamp's tail), coefficients rounded to fp32.
# Past 8, tanh(x) = +-1 within 2.3e-7 and x is clamped there.
_TANH_X = tl.constexpr(8.0)
_TANH_P1 = tl.constexpr(0.13284260034561157)
_TANH_P2 = tl.constexpr(0.0032212932128459215)
_TANH_Q1 = tl.constexpr(0.9323533177375793)
_TANH_Q2 = tl.constexpr(0.26787659525871277)
_TANH_Q3 = tl.constexpr(0.024048147723078728)
_TANH_Q4 = tl.constexpr(0.0008562943548895419)
_TANH_Q5 = tl.constexpr(1.037469246512046e-05)


@triton.jit
def tanh(x):
    """tanh on an fp32 tile without libdevice (which the interpreter lacks): the rational form
    above, 12 instructions and one MUFU (rsqrt) on sm_90, the clamp a single FMNMX. Relative
    error below 5e-7 over all fp32 inputs (measured against float64:
    tests/test_attention_scores.py::test_tanh_against_float64), so tanh(x) ~ x keeps its
    precision near 0 (the softcap's c * tanh(x / c) with a large c); odd, NaN stays NaN."""
    xc = tl.clamp(x, -_TANH_X, _TANH_X, propagate_nan=tl.PropagateNan.ALL)
    z = xc * xc
    p = (_TANH_P2 * z + _TANH_P1) * z + 1.0
    q = ((((_TANH_Q5 * z + _TANH_Q4) * z + _TANH_Q3) * z + _TANH_Q2) * z + _TANH_Q1) * z + 1.0
    return xc * p * tl.math.rsqrt(q)


# Tests set this so that every buffer a launcher allocates starts as NaN: a kernel that
# leaves any element unwritten then fails the comparison with the reference.
POISON_OUTPUTS = False


def _contiguous_strides(shape):
    """The strides ``torch.empty(shape)`` gives (a size-0 dim counts as 1, as in torch)."""
    n = len(shape)
    if n == 2:
        return (shape[1] or 1, 1)
    if n == 1:
        return (1,)
    if n == 3:
        s1 = shape[2] or 1
        return (s1 * (shape[1] or 1), s1, 1)
    strides = [1] * n
    for i in range(n - 1, 0, -1):
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return tuple(strides)


_empty_strided = torch.empty_strided


def n_rows(t) -> int:
    """The rows of a (..., n) operand: the product of every dim but the last, also when n is 0
    (``numel() // n`` cannot say how many rows an empty last dim has: a (2, 3, 0) tensor has 6
    rows of nothing, and outputs allocated from its leading dims have 6 rows to write)."""
    if t.dim() == 2:
        return t.shape[0]
    n = t.shape[-1]
    if n:
        return t.numel() // n  # one call (the launchers' hot path)
    m = 1
    for d in t.shape[:-1]:
        m *= d
    return m


def rows(t, operand: str):
    """``(rows, cols), (row stride, col stride)`` of a launcher's operand: a 2-D tensor with any
    strides, or a contiguous one of another rank, whose rows are all its dims but the last
    (read in place, no view; :func:`n_rows` of them, also when the last dim is 0). Any other
    layout is a ValueError naming ``operand``."""
    if t.dim() == 2:
        return t.shape, t.stride()
    if not t.is_contiguous():
        raise ValueError(f"{operand} of {t.dim()} dims must be contiguous, got strides {t.stride()}")
    n = t.shape[-1]
    return (t.numel() // n if n else n_rows(t), n), (n, 1)


def unit(t):
    """``t`` where its last dim is read at unit stride (stride 1, or one element), else a
    contiguous copy: the launchers' vectors and tables (biases, norm weights, frequencies, sinks,
    slopes, sequence offsets), which their kernels index as ``ptr + i``, and the ops' operands
    whose kernels take a unit last stride (q/k/v, rows, gradients). A strided view
    (``base[::2]``) or an expanded one (stride 0) passed in place would be read as another
    tensor. None stays None."""
    if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def empty(shape, dtype, device):
    """Allocate a launcher's output, contiguous (NaN-filled while ``POISON_OUTPUTS`` is set).

    ``torch.empty_strided`` with the contiguous strides: the same tensor as ``torch.empty``'s,
    in about 60% of its host time (torch.empty's memory-format path costs ~0.5 us more a call
    on the CPU, and a training step allocates a few dozen outputs)."""
    if type(shape) is int:
        shape = (shape,)
    n = len(shape)
    if n == 2:
        strides = (shape[1] or 1, 1)
    elif n == 3:
        s1 = shape[2] or 1
        strides = (s1 * (shape[1] or 1), s1, 1)
    else:
        strides = _contiguous_strides(shape)
    t = _empty_strided(shape, strides, dtype=dtype, device=device)
    if POISON_OUTPUTS and t.is_floating_point():
        t.fill_(float("nan"))
    return t


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even, also in the interpreter.

    The interpreter's fp32 -> bf16 conversion truncates (up to one ulp of error, twice what
    the GPU's round-to-nearest-even gives), so there the rounding is done on the bits. Use
    this for every fp32 -> low-precision conversion of a result.
    """
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# the launch path: one config per key, chosen once, then a direct launch
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    """A kernel configuration: constexpr meta-parameters plus warps and pipeline stages."""

    kwargs: tuple  # sorted (name, value) pairs, hashable
    num_warps: int = 4
    num_stages: int = 1
    # The pairs as a dict, for launchers' lookups on every launch (not part of eq/hash).
    _meta: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_meta", dict(self.kwargs))

    @staticmethod
    def of(num_warps=4, num_stages=1, **kwargs) -> "Config":
        return Config(tuple(sorted(kwargs.items())), num_warps, num_stages)

    def __getitem__(self, name):
        return self._meta[name]

    def meta(self) -> dict:
        return dict(self._meta)


_CONSTEXPR_DICTS = {}


def constexprs(**values) -> dict:
    """The constexpr dict for ``values``, one object per distinct set of values: the direct
    launch path finds a launch's layout by the identity of its constexpr dict and Config (a
    dict built per call takes its slower lookup, which hashes the argument types). Callers
    must not change the dict."""
    key = (*values.items(), *map(type, values.values()))  # 1 and True differ here
    out = _CONSTEXPR_DICTS.get(key)
    if out is None:
        if len(_CONSTEXPR_DICTS) > 4096:
            _CONSTEXPR_DICTS.clear()
        out = _CONSTEXPR_DICTS[key] = values
    return out


def launch(name: str, kernel, grid, args, constexprs: dict, config: Config) -> None:
    """Count and launch ``kernel[grid](*args, **constexprs, **config)``.

    The one place every kernel goes through: tests read the counts, and the host-overhead
    benchmark sets ``STUB_LAUNCHES`` to time everything but the kernels. Compiled kernels go
    through the direct launch path (``launch.py``: the compiled kernel Triton chose for these
    argument specializations, launched without Triton's per-call binding); the interpreter
    runs ``kernel[grid]`` as it always did.
    """
    LAUNCHES[name] += 1
    if STUB_LAUNCHES:
        return
    if _direct.ENABLED and not _INTERPRET:
        _direct.launch(kernel, grid, args, constexprs, config)
        return
    kernel[grid](*args, **constexprs, **config._meta, num_warps=config.num_warps,
                 num_stages=config.num_stages)


# FUSED_BLOCK_TUNE=0 takes the first candidate of every list instead of benchmarking them
# (quicker test runs on a GPU; every candidate is still compiled by the AOT check).
TUNE = os.environ.get("FUSED_BLOCK_TUNE", "1") != "0"

# FUSED_BLOCK_WS=1 opts in to the sm_90 warp-specialized candidates (the GEMM's tile loop,
# matmul.WS_CONFIGS, and the attention forward's K/V loop, configs.FWD_CONFIGS' ``WS``
# entries; Triton's ``tl.range(..., warp_specialize=True)``): they come first among a
# launch's candidates where it can run them (so FUSED_BLOCK_TUNE=0 runs them, the tuner times
# them against the rest), and the interpreter runs their code path. Off by default: they
# compile spill-free (tests/test_compile.py) but have not yet run on a GPU, and a kernel that
# never ran on one is not the default (docs/gpu-check.md says how to verify them).
WARP_SPECIALIZE = os.environ.get("FUSED_BLOCK_WS", "0") == "1"


class ConfigCache:
    """Chooses one config per key among candidates, once, and remembers it.

    On CUDA with several candidates, each is timed with ``triton.testing.do_bench`` on the
    real arguments (so a launch must be idempotent: outputs overwritten, never accumulated),
    candidates that run out of resources (shared memory, registers) are skipped (any other
    error is raised), and the fastest is kept. Later
    calls with the same key are a dict lookup. A single candidate, the interpreter,
    ``STUB_LAUNCHES`` or ``FUSED_BLOCK_TUNE=0`` take the first candidate without timing; so
    does a call during CUDA graph capture, without remembering it.
    """

    def __init__(self, name: str):
        self.name = name
        self.chosen = {}

    def get(self, key, candidates, run) -> Config:
        """The config for ``key``; ``run(config)`` launches once with it (used for timing)."""
        cfg = self.chosen.get(key)
        if cfg is not None:
            return cfg
        if not candidates:
            raise ValueError(f"{self.name}: no config candidate for {key}")
        if len(candidates) == 1 or not TUNE or STUB_LAUNCHES or _INTERPRET:
            cfg = candidates[0]
        elif torch.cuda.is_current_stream_capturing():
            # Timing synchronizes, which would invalidate the capture: the first candidate,
            # for this call only (the next eager call times them).
            return candidates[0]
        else:
            cfg = self._fastest(key, candidates, run)
        self.chosen[key] = cfg
        return cfg

    def _fastest(self, key, candidates, run) -> Config:
        from triton.testing import do_bench

        timed = []
        counts = LAUNCHES.copy()  # timing launches are not the caller's: keep exact counts
        try:
            for cfg in candidates:
                try:
                    timed.append((do_bench(lambda: run(cfg), warmup=5, rep=25), cfg))
                except Exception as exc:  # noqa: BLE001 - out of resources etc.: not a candidate
                    if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc):
                        raise
        finally:
            LAUNCHES.clear()
            LAUNCHES.update(counts)
        if not timed:
            raise RuntimeError(f"{self.name}: no candidate config runs for {key}")
        if os.environ.get("FUSED_BLOCK_PRINT_TUNING"):
            print(f"[fused_block] {self.name} {key}: " +
                  ", ".join(f"{c}={t:.4f}ms" for t, c in sorted(timed, key=lambda x: x[0])))
        return min(timed, key=lambda tc: tc[0])[1]
