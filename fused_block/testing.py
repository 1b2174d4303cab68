"""The numerics rule every kernel is held to (tests and the benchmark's numerics report).

A result is compared with the float64 reference. Its max error may be at most ``FACTOR``
times the max error of PyTorch's own computation in the same dtype (the reference called with
low-precision arithmetic), plus a small per-dtype ``ATOL``. PyTorch's error is taken where its
result is finite and is floored at half an ulp of the output dtype at the largest reference
magnitude (the error of rounding the exact result, which no implementation beats on a large
sample). NaN/Inf must appear exactly where the reference has them.
"""
from dataclasses import dataclass

import torch

FACTOR = 2.0
# Absolute slack on top of the rule; about a few ulps of 1.0 in each dtype.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}


def max_err(a, ref) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - ref.detach().double()).abs().max().item()


def rounding_floor(ref, dtype) -> float:
    """Half an ulp of ``dtype`` at the largest magnitude of ``ref``."""
    if ref.numel() == 0:
        return 0.0
    return 0.5 * torch.finfo(dtype).eps * ref.detach().abs().max().item()


@dataclass
class Verdict:
    ok: bool
    same_nonfinite: bool
    err: float
    torch_err: float
    atol: float
    factor: float

    def message(self, name, dtype) -> str:
        if not self.same_nonfinite:
            return f"{name}: NaN/Inf where the reference is finite (or the reverse)"
        return (f"{name} ({dtype}): max error {self.err:.3e} > {self.factor} * torch's "
                f"{self.torch_err:.3e} + atol {self.atol:.1e}")


def check(actual, ref64, baseline, *, atol=None, factor=FACTOR, dtype=None) -> Verdict:
    """Apply the rule. ``dtype`` is the lowest precision the computation ran in (default:
    actual's dtype) and picks the atol, e.g. an fp32 weight gradient summed from fp16
    activation gradients."""
    actual, ref64, baseline = actual.detach(), ref64.detach(), baseline.detach()
    finite = torch.isfinite(ref64)
    same_nonfinite = torch.equal(torch.isfinite(actual), finite)
    atol = ATOL[dtype or actual.dtype] if atol is None else atol
    ref = ref64[finite]
    err = max_err(actual[finite], ref) if same_nonfinite else float("nan")
    b = baseline[finite]
    b_ok = torch.isfinite(b)
    base = max(max_err(b[b_ok], ref[b_ok]), rounding_floor(ref, actual.dtype))
    return Verdict(same_nonfinite and err <= factor * base + atol, same_nonfinite, err, base, atol, factor)
