"""Numerics helpers: fresh random inputs and the "twice PyTorch's own error" rule.

A kernel's result is compared with the float64 reference. Its error may be at most
``FACTOR`` times the error of PyTorch's own computation in the same dtype (same reference
function, low-precision arithmetic), plus a small per-dtype ``ATOL``. PyTorch's error is
taken where its result is finite and is floored at the error of rounding the exact result to
the output dtype (no implementation can beat that).
"""
import torch

FACTOR = 2.0
# Absolute slack on top of the rule; about a few ulps of 1.0 in each dtype.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOWP_DTYPES = (torch.float16, torch.bfloat16)


def randn(*shape, dtype, device, scale=1.0, requires_grad=False, generator=None):
    t = torch.randn(*shape, dtype=torch.float32, generator=generator) * scale
    t = t.to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def max_err(a, ref):
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - ref.detach().double()).abs().max().item()


def assert_close(name, actual, ref64, baseline, *, atol=None, factor=FACTOR, dtype=None):
    """``|actual - ref64| <= factor * |baseline - ref64| + atol`` elementwise-max; no NaN/Inf.

    ``dtype`` is the lowest precision the computation ran in (default: actual's dtype); it
    picks the atol, e.g. an fp32 weight gradient summed from fp16 activation gradients.
    """
    assert actual.shape == ref64.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(actual.detach()), finite), f"{name}: NaN/Inf where reference is finite (or the reverse)"
    atol = ATOL[dtype or actual.dtype] if atol is None else atol
    ref = ref64[finite]
    err = max_err(actual[finite], ref)
    # PyTorch's own error, where its result is finite (fp16 overflows where fp32 does not),
    # and never below the error of rounding the exact result to the output dtype.
    b = baseline.detach()[finite]
    ok = torch.isfinite(b)
    base = max(max_err(b[ok], ref[ok]), max_err(ref.to(actual.dtype), ref))
    assert err <= factor * base + atol, (
        f"{name} ({actual.dtype}): max error {err:.3e} > {factor} * torch's {base:.3e} + atol {atol:.1e}")
