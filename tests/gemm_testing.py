"""Shared by the GEMM (and attention) tests: fp32 precision modes and the float64 comparison of
every gradient.

fp32 precision: the kernels follow torch's setting at call time (``common.fp32_precision()``):
"ieee" products under torch's default "highest", "tf32" under "high". A test runs the op inside
:func:`fp32_mode` and measures PyTorch's own error under :func:`baseline_mode`, which in "tf32"
mode also rounds every fp32 product's operands to TF32 (:func:`round_to_tf32`): TF32's error
on every shape and device, where cuBLAS itself skips TF32 on some shapes (e.g. a one-row GEMV)
and would hold the kernels to IEEE accuracy there.
"""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_block
import fused_block.kernels.matmul as kmatmul
from numerics import assert_close, fp32_matmul_precision, randn

# The kernels' fp32 modes (``common.fp32_precision()``) and torch's precision setting for each.
MODES = ("ieee", "tf32")
_TORCH_PRECISION = {"ieee": "highest", "tf32": "high"}
# (dtype, fp32 mode) pairs for parametrized tests; the mode is irrelevant to fp16/bf16.
DTYPE_MODES = [pytest.param((torch.float32, "ieee"), id="fp32"),
               pytest.param((torch.float32, "tf32"), id="fp32-tf32"),
               pytest.param((torch.float16, "ieee"), id="fp16"),
               pytest.param((torch.bfloat16, "ieee"), id="bf16")]


def fp32_mode(mode):
    """Inside the block, torch's fp32 matmul precision selects the kernels' ``mode``."""
    return fp32_matmul_precision(_TORCH_PRECISION[mode])


def round_to_tf32(t):
    """fp32 ``t`` rounded to TF32's 10-bit mantissa (nearest, ties away from zero, as
    ``cvt.rna.tf32.f32``); NaN and Inf unchanged. Products of TF32 values are exact in fp32."""
    bits = t.contiguous().view(torch.int32)
    # Sign and magnitude: adding half of the 13 dropped bits rounds the magnitude, ties away.
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32).view(t.shape)
    return torch.where(torch.isfinite(t), rounded, t)


_aten = torch.ops.aten
# Product ops and the positions of their two matrix operands.
_PRODUCTS = {_aten.mm.default: (0, 1), _aten.bmm.default: (0, 1), _aten.addmm.default: (1, 2),
             _aten.baddbmm.default: (1, 2)}


class _TF32Products(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        operands = _PRODUCTS.get(func)
        if operands is not None:
            args = list(args)
            for i in operands:
                if args[i].dtype == torch.float32:
                    args[i] = round_to_tf32(args[i])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def baseline_mode(dtype, mode):
    """PyTorch's same-dtype baseline in fp32 ``mode``: products in TF32 for "tf32"."""
    with fp32_mode(mode):
        if dtype != torch.float32 or mode == "ieee":
            yield
        else:
            with _TF32Products():
                yield


# ---------------------------------------------------------------------------------------------
# comparison with the float64 reference
# ---------------------------------------------------------------------------------------------

def leaves(tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad)
            for t in tensors]


def check(name, ours, ref_fn, inputs, dtype, device, mode="ieee"):
    """Run ``ours(*inputs)`` forward and backward in fp32 ``mode``; compare output and every
    input's gradient with ``ref_fn`` in float64, against PyTorch's own error in ``dtype`` and
    ``mode``. The incoming gradient must not be modified."""
    with fp32_mode(mode):
        out = ours(*inputs)
        g = randn(*out.shape, dtype=out.dtype, device=device)
        g_before = g.clone()
        diff = [t for t in inputs if t is not None and t.requires_grad]
        grads = torch.autograd.grad(out, diff, g)
    assert torch.equal(g, g_before), "the incoming gradient was modified"

    ins64 = leaves(inputs, torch.float64)
    ref = ref_fn(*ins64)
    grads64 = torch.autograd.grad(ref, [t for t in ins64 if t is not None and t.requires_grad], g.double())

    insb = leaves(inputs)
    with baseline_mode(dtype, mode):
        base = ref_fn(*insb, compute_dtype=dtype)
        gradsb = torch.autograd.grad(base, [t for t in insb if t is not None and t.requires_grad], g)

    assert out.dtype == base.dtype
    assert_close(f"{name} out", out, ref, base)
    names = [n for n, t in zip("abcdefghij", inputs) if t is not None and t.requires_grad]
    for n, a, r, b in zip(names, grads, grads64, gradsb):
        assert a.dtype == b.dtype, f"{name} grad {n}: dtype {a.dtype} != {b.dtype}"
        assert_close(f"{name} grad of input {n}", a, r, b)


def kernel_masks(seed, device, *specs):
    """The keep-masks the kernels draw after ``torch.manual_seed(seed)``: one per (rows, cols,
    p) in ``specs``, in the order the op draws its seeds (mlp: hidden first, then output)."""
    torch.manual_seed(seed)
    seeds = [fused_block._backend.dropout_seed(p, device) for _, _, p in specs]
    return [kmatmul.dropout_mask(s, m, n, p, device) for s, (m, n, p) in zip(seeds, specs)]


def seeded(fn, seed):
    def run(*args, **kwargs):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)
    return run


def saved_numels(fn):
    """Numels of the tensors autograd saves while ``fn`` runs (parameters included)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sorted(sizes)
