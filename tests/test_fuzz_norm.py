"""Property-based fuzzing of add_layer_norm / add_rms_norm against the float64 reference.

Shapes (edge sizes: 1, primes, around the register/chunked boundaries), dtypes, flags (among
them out_is_residual: out returned twice, its two gradients summed in the kernel),
strides and value regimes (large magnitudes, tiny variances, constant rows) are drawn by
hypothesis; forward and backward must satisfy the per-dtype tolerance rule. The CI profile
is bounded; ``FUSED_BLOCK_FUZZ=long`` selects the long one (see tests/fuzzing.py).
"""
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fused_block
from fused_block import reference
from fuzzing import DTYPE, LAYOUTS, layout, settings_for
from numerics import assert_close

HIDDEN = st.one_of(
    # Edge sizes, and each side of the register/chunked boundaries (backward 8192; forward 8192
    # with 32-bit data, 16384 with 16-bit data).
    st.sampled_from([1, 2, 3, 7, 31, 127, 128, 129, 1000, 4095, 4096, 4097, 8191, 8192, 8193, 16384, 16385]),
    st.integers(1, 3000),
)
REGIMES = ("normal", "large", "tiny_variance", "constant")


def _case(**kw):
    """An explicit example: contiguous layouts, parameters in x's dtype, residual_out returned
    (not out twice), unless given."""
    return example(**{"x_layout": "contiguous", "r_layout": "contiguous", "fp32_params": False,
                      "out_is_residual": False, **kw})


def _values(regime, shape, dtype, device, gen):
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    if regime == "large":
        z = 300.0 * z + 1000.0
    elif regime == "tiny_variance":
        z = 3.0 + 1e-2 * z
    elif regime == "constant":
        z = torch.full(shape, 0.75, dtype=torch.float64) + 0 * z
    return z.to(dtype).to(device)


@settings_for(examples=40)
@given(norm=st.sampled_from(("layer", "rms")), rows=st.integers(0, 5), n=HIDDEN, dtype=DTYPE,
       has_res=st.booleans(), has_w=st.booleans(), has_b=st.booleans(), fp32_params=st.booleans(),
       x_layout=LAYOUTS, r_layout=LAYOUTS, regime=st.sampled_from(REGIMES), seed=st.integers(0, 2**31),
       out_is_residual=st.booleans())
@_case(norm="layer", rows=3, n=1, dtype=torch.bfloat16, has_res=True, has_w=True, has_b=True,
       regime="normal", seed=0)
# Found by the long profile: fp16 RMSNorm of values ~1e3 overflows in PyTorch's own fp16
# computation (the baseline is then taken where it is finite, floored at rounding error).
@_case(norm="rms", rows=1, n=4096, dtype=torch.float16, has_res=False, has_w=False, has_b=False,
       regime="large", seed=0)
# Found by the long profile: an fp32 bias gradient of a single element summed from fp16
# output gradients; its error is set by fp16 rounding, so the atol is fp16's.
@_case(norm="layer", rows=5, n=1, dtype=torch.float16, has_res=True, has_w=True, has_b=True,
       fp32_params=True, regime="normal", seed=1)
# Found by the long profile: a constant fp16 row of three: dx ~ 300 (rstd = 1/sqrt(eps)), so
# output rounding dominates and three elements can round luckily for PyTorch.
@_case(norm="layer", rows=1, n=3, dtype=torch.float16, has_res=False, has_w=False, has_b=True,
       regime="constant", seed=2)
# Found by the CI profile: an fp32 row of 7 values 3 +- 0.01: the rounding error of the sum for
# the mean (~N ulps of 3) is large against the spread (the forward now corrects the mean with
# the sum of the deviations).
@_case(norm="layer", rows=1, n=7, dtype=torch.float32, has_res=False, has_w=False, has_b=False,
       regime="tiny_variance", seed=15)
# Rows that amplify the rounding of the statistics (issue 9, section 3): a constant fp32 row has
# rstd = 1/sqrt(eps) ~ 316, so 1 ulp of error in the mean (or in the backward's row means) is
# 2e-5 against fp32's 1e-5 atol where PyTorch may be exact. The GPU rounds Triton's plain
# division and square root approximately (the interpreter exactly): the kernels round the means
# correctly and rstd nearly so on both (kernels/norm.py, _div_n and _rstd). A short row (large
# row means in the backward), and the chunked paths (fp32 rows wider than 8192), constant and
# tiny-variance; the last with out's second gradient.
@_case(norm="layer", rows=4, n=3, dtype=torch.float32, has_res=False, has_w=True, has_b=True,
       regime="constant", seed=3)
@_case(norm="layer", rows=2, n=8193, dtype=torch.float32, has_res=False, has_w=True, has_b=True,
       regime="constant", seed=4)
@_case(norm="layer", rows=2, n=8193, dtype=torch.float32, has_res=True, has_w=True, has_b=False,
       regime="tiny_variance", seed=5, out_is_residual=True)
def test_add_norm_fuzz(device, norm, rows, n, dtype, has_res, has_w, has_b, fp32_params,
                       x_layout, r_layout, regime, seed, out_is_residual):
    gen = torch.Generator().manual_seed(seed)
    pdtype = torch.float32 if fp32_params else dtype
    x = layout(_values(regime, (rows, n), dtype, device, gen), x_layout).requires_grad_()
    residual = layout(_values("normal", (rows, n), dtype, device, gen), r_layout).requires_grad_() if has_res else None
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, pdtype).requires_grad_() if has_w else None
    bias = (0.1 * torch.randn(n, generator=gen)).to(device, pdtype).requires_grad_() if has_b and norm == "layer" else None
    if norm == "layer":
        args, op, ref = (x, residual, weight, bias), fused_block.add_layer_norm, reference.add_layer_norm
    else:
        args, op, ref = (x, residual, weight), fused_block.add_rms_norm, reference.add_rms_norm
    kw = {"out_is_residual": out_is_residual}
    out, rout = op(*args, **kw)
    as64 = [None if t is None else t.detach().double().requires_grad_() for t in args]
    ref_out, ref_rout = ref(*as64, **kw)
    base_out, base_rout = ref(*args, compute_dtype=dtype, **kw)
    assert_close("out", out, ref_out, base_out)
    assert_close("residual_out", rout, ref_rout, base_rout)

    g = torch.randn((rows, n), generator=gen, dtype=torch.float64).to(device)
    present = [t for t in args if t is not None]
    loss = lambda o, r: (o.double() * g).sum() + (r.double() * g.flip(-1)).sum()  # noqa: E731
    got = torch.autograd.grad(loss(out, rout), present)
    want = torch.autograd.grad(loss(ref_out, ref_rout), [t for t in as64 if t is not None])
    base = torch.autograd.grad(loss(base_out, base_rout), present)
    for i, (a, w, b) in enumerate(zip(got, want, base)):
        assert_close(f"grad[{i}]", a, w, b, dtype=dtype)
