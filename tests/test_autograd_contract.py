"""The ops' autograd contract against torch's own functions: what a backward saves.

An input the backward does not read (a frozen weight's partner, x when only x's gradient is
wanted) may change in place between forward and backward (an ``optimizer.step()`` on the
trained parameters, an in-place update of a frozen one): torch's linears save each operand
only for the other's gradient, so torch answers with the gradients of the forward's values.
The fused FFN saved w2 for every backward and ``gated_linear`` saved x and both weights, so
the same misuse raised "modified by an inplace operation" (and kept the unread tensors alive).
Here torch's composition (the float64 reference, with the same change) and ours answer, alike.
"""
import pytest
import torch

import fused_block
from fused_block import reference
from fused_block.linear import gated_linear
from numerics import randn

F32 = torch.float32

# (id, our call, the reference's, the arguments' shapes, the arguments that take a gradient,
# the argument changed in place after the forward, a kernel the backward launches). Rows
# 2 x 5 (not a tile multiple), D 16, F 24: small, a few interpreted launches each.
CASES = [
    ("mlp-w2-only", lambda x, w1, b1, w2, b2: fused_block.mlp(x, w1, b1, w2, b2),
     lambda x, w1, b1, w2, b2: reference.mlp(x, w1, b1, w2, b2),
     [(2, 5, 16), (24, 16), (24,), (16, 24), (16,)], (3, 4), 3, "matmul"),
    ("mlp-b2-only", lambda x, w1, b1, w2, b2: fused_block.mlp(x, w1, b1, w2, b2),
     lambda x, w1, b1, w2, b2: reference.mlp(x, w1, b1, w2, b2),
     [(2, 5, 16), (24, 16), (24,), (16, 24), (16,)], (4,), 3, "act_grad"),
    ("swiglu-down-only", lambda x, wg, wu, wd: fused_block.swiglu(x, wg, wu, wd),
     lambda x, wg, wu, wd: reference.swiglu(x, wg, wu, wd), [(2, 5, 16), (24, 16), (24, 16), (16, 24)], (3,), 3,
     "matmul"),
    ("gated-up-only", lambda x, wg, wu: gated_linear(x, wg, wu), lambda x, wg, wu: reference.gated(x, wg, wu),
     [(2, 5, 16), (24, 16), (24, 16)], (2,), 1, "matmul"),
    ("gated-x-only", lambda x, wg, wu: gated_linear(x, wg, wu), lambda x, wg, wu: reference.gated(x, wg, wu),
     [(2, 5, 16), (24, 16), (24, 16)], (0,), 0, "matmul"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_an_input_the_backward_does_not_read_may_change_in_place(case, device, launches):
    _, ours, ref, shapes, trained, changed, kernel = case
    args = [randn(*s, dtype=F32, device=device, scale=s[-1] ** -0.5 if len(s) == 2 else 1.0) for s in shapes]
    mine = [a.clone().requires_grad_(i in trained) for i, a in enumerate(args)]
    theirs = [a.double().requires_grad_(i in trained) for i, a in enumerate(args)]
    y, want = ours(*mine), ref(*theirs)
    before = launches[kernel]
    with torch.no_grad():
        mine[changed].add_(1.0)
        theirs[changed].add_(1.0)
    g = randn(*y.shape, dtype=F32, device=device)
    grads = torch.autograd.grad(y, [mine[i] for i in trained], g)
    wanted = torch.autograd.grad(want, [theirs[i] for i in trained], g.double())  # torch answers
    assert launches[kernel] > before  # the backward's kernels ran
    for a, r in zip(grads, wanted):
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-4)
