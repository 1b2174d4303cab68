"""Helpers shared by every kernel: the interpreter switch, the dot helper, launch accounting.

The Triton interpreter (``TRITON_INTERPRET=1``, used on CPU-only machines) keeps bf16 as raw
uint16 bits, so bf16 arithmetic and ``tl.dot`` on bf16 operands give garbage there, while
bf16 <-> fp32 conversions are exact. Kernels therefore do their arithmetic in fp32 after
loading, and every matrix product goes through :func:`dot`, which upcasts low-precision
operands only when ``INTERPRET`` (a constexpr computed by the launcher) is set. On the GPU
the operands stay in fp16/bf16 and the product runs on tensor cores (wgmma on sm_90).
"""
import collections
import os

import torch
import triton
import triton.language as tl

# Launch counts per kernel name. Tests read it to prove the Triton path ran.
LAUNCHES = collections.Counter()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def count_launch(name: str) -> None:
    LAUNCHES[name] += 1


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
def dot(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation; upcasts fp16/bf16 operands only in the interpreter."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# Tests set this so that every buffer a launcher allocates starts as NaN: a kernel that
# leaves any element unwritten then fails the comparison with the reference.
POISON_OUTPUTS = False


def empty(shape, dtype, device):
    """Allocate a launcher's output (NaN-filled while ``POISON_OUTPUTS`` is set)."""
    t = torch.empty(shape, dtype=dtype, device=device)
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
