"""Numerics helpers for the tests: fresh random inputs and the rule of ``fused_block.testing``."""
import contextlib

import torch

from fused_block.testing import ATOL, FACTOR, check

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
__all__ = ["ATOL", "DTYPES", "assert_close", "randn", "torch_precision_of_kernels"]


def randn(*shape, dtype, device, scale=1.0, requires_grad=False, generator=None):
    t = torch.randn(*shape, dtype=torch.float32, generator=generator) * scale
    t = t.to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def assert_close(name, actual, ref64, baseline, *, atol=None, factor=FACTOR, dtype=None):
    """Assert ``fused_block.testing``'s rule: error <= factor x PyTorch's same-dtype error + atol."""
    assert actual.shape == ref64.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    verdict = check(actual, ref64, baseline, atol=atol, factor=factor, dtype=dtype)
    assert verdict.ok, verdict.message(name, actual.dtype)


@contextlib.contextmanager
def torch_precision_of_kernels(dtype, device):
    """Our fp32 GEMMs use TF32 on the GPU: measure PyTorch's fp32 error with TF32 as well."""
    if dtype != torch.float32 or device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
