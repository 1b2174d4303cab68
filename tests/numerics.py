"""Numerics helpers for the tests: fresh random inputs and the rule of ``fused_block.testing``."""
import contextlib

import torch

from fused_block.testing import ATOL, FACTOR, check

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# torch's fp32 matmul precisions the kernels follow: "highest" (torch's default) -> IEEE fp32
# products, "high" -> TF32 ("medium" is TF32 too for the kernels).
FP32_PRECISIONS = ("highest", "high")
__all__ = ["ATOL", "DTYPES", "FP32_PRECISIONS", "assert_close", "fp32_matmul_precision", "randn"]


def randn(*shape, dtype, device, scale=1.0, requires_grad=False, generator=None):
    t = torch.randn(*shape, dtype=torch.float32, generator=generator) * scale
    t = t.to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def assert_close(name, actual, ref64, baseline, *, atol=None, factor=FACTOR, dtype=None):
    """Assert ``fused_block.testing``'s rule: error <= factor x PyTorch's same-dtype error + atol."""
    assert actual.shape == ref64.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    verdict = check(actual, ref64, baseline, atol=atol, factor=factor, dtype=dtype)
    assert verdict.ok, verdict.message(name, actual.dtype)


def assert_compiled_matches_eager(fn, x):
    """``torch.compile(fn, fullgraph=True)`` (aot_eager) traces and gives eager's scalar ``fn(x)``
    and gradient of x."""
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    g_got, = torch.autograd.grad(got, (x,))
    want = fn(x)
    g_want, = torch.autograd.grad(want, (x,))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)


@contextlib.contextmanager
def fp32_matmul_precision(precision):
    """``torch.set_float32_matmul_precision(precision)`` inside the block, restored after.

    The kernels read torch's setting at call time (``fused_block.kernels.common.fp32_precision``)
    as torch's own matmuls do, so wrap both the kernel call (forward and backward) and the
    PyTorch baseline in the same block: both then run fp32 products in the same mode. Only
    torch's ``set/get_float32_matmul_precision`` API is used (torch refuses to read a precision
    set through a mix of its old and new APIs).
    """
    if precision not in ("highest", "high", "medium"):
        raise ValueError(f"precision must be 'highest', 'high' or 'medium', got {precision!r}")
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
