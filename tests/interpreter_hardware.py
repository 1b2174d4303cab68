"""The GPU's fp32 products, emulated by the test suite's Triton interpreter.

Triton 3.6's interpreter computes every ``tl.dot`` with numpy's fp32 matmul, whatever its
``input_precision``: a CPU run could not see two things the GPU does with fp32 operands, which
put the kernels at 2-10x torch's error on an H200 while the CPU suite passed.

- TF32 (``input_precision="tf32"``): the tensor cores read an fp32 operand's upper 19 bits,
  i.e. truncate it to TF32 toward zero. Installed for the whole suite (a mask on each
  operand): a kernel that feeds raw fp32 to a TF32 product fails the 2x-torch rule on the CPU
  as it did on the GPU; ``common.dot`` rounds its operands to nearest TF32 first, which the
  truncation then leaves as they are.
- IEEE fp32 (``input_precision="ieee"``) on the FMA units: one FMA per k into the
  accumulator passed in, in k order (Triton's FMA lowering). Opt-in (``FMA_CHAINS``, the
  ``fma_chains`` fixture of the tests that state accumulation accuracy): a numpy operation per
  k costs too much for every interpreted product, and 16-bit products (upcast to fp32 and
  computed as "ieee" in the interpreter, on tensor cores on the GPU) would be emulated wrongly.
"""
import numpy as np
from triton._C.libtriton import ir
from triton.runtime import interpreter

import triton.language as tl

_original_create_dot = interpreter.InterpreterBuilder.create_dot
# Emulate IEEE fp32 products as the FMA units' per-k chains (see the module doc).
FMA_CHAINS = False


def truncate_to_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 ``x`` with the 13 low mantissa bits cleared (toward zero), NaN kept."""
    out = (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isnan(x), x, out)


def fma_chain(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``c + a @ b`` (fp32, batched or not) as one FMA per k in k order, each rounded to fp32
    (products of fp32 values are exact in float64; the sum is rounded once to float64 first)."""
    acc = c.astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for k in range(a.shape[-1]):
        acc = (acc + a64[..., :, k, None] * b64[..., k, None, :]).astype(np.float32)
    return acc


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    fp32 = a.dtype == tl.float32 and b.dtype == tl.float32 and d.dtype == tl.float32
    if fp32 and input_precision == ir.INPUT_PRECISION.TF32:
        a = interpreter.TensorHandle(truncate_to_tf32(a.data), a.dtype)
        b = interpreter.TensorHandle(truncate_to_tf32(b.data), b.dtype)
    elif fp32 and FMA_CHAINS and input_precision == ir.INPUT_PRECISION.IEEE:
        return interpreter.TensorHandle(fma_chain(a.data, b.data, d.data), d.dtype)
    return _original_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def install() -> None:
    interpreter.InterpreterBuilder.create_dot = _create_dot


def uninstall() -> None:
    interpreter.InterpreterBuilder.create_dot = _original_create_dot
