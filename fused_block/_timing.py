"""Timing a call's candidates on its own tensors, for the choices made once per shape bucket
between our kernels and torch's path: attention's SDPA backends (``fused_block._attn_sdpa``)
and the norms' eager ops (``fused_block.norm``). CUDA only (``triton.testing.do_bench``)."""
import warnings

import torch

from fused_block.kernels import common


def leaves_of(*tensors, grad):
    """Fresh leaves (same strides and values) of the call's tensors, for timing: each requires
    a gradient where ``grad`` says so (a bool for all, or one per tensor); None stays None."""
    grads = grad if isinstance(grad, (tuple, list)) else [grad] * len(tensors)
    return [None if t is None else t.detach().requires_grad_(bool(g)) for t, g in zip(tensors, grads)]


def _outputs(out):
    """The outputs a backward starts from: each distinct tensor that requires a gradient."""
    outs = []
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, torch.Tensor) and o.requires_grad and not any(o is p for p in outs):
            outs.append(o)
    return outs


def time_candidates(grad, leaves, fns, ours):
    """Milliseconds per candidate (``{name: fn(*leaves) -> tensor or tuple}``) that runs this
    case: the forward, and with ``grad`` the backward of every output that requires a gradient
    (random gradients, drawn once per candidate) into every leaf that requires one. A candidate
    that raises is left out (a backend refusing the case), except ``ours``. The launches the
    timing makes are not counted as the caller's (``common.LAUNCHES``)."""
    from triton.testing import do_bench

    inputs = [t for t in leaves if t is not None and t.requires_grad]
    douts = {}

    def step(name, fn):
        def go():
            out = fn(*leaves)
            if grad and inputs:
                outs = _outputs(out)
                if name not in douts:
                    douts[name] = [torch.randn_like(o) for o in outs]
                torch.autograd.grad(outs, inputs, douts[name], allow_unused=True)
        return go

    times = {}
    counts = common.LAUNCHES.copy()
    try:
        for name, fn in fns.items():
            go = step(name, fn)
            try:
                with warnings.catch_warnings():  # a backend's reasons for refusing the case
                    warnings.simplefilter("ignore")
                    go()  # first call: compiles, and raises if the backend refuses the case
                times[name] = do_bench(go, warmup=5, rep=25)
            except Exception:  # noqa: BLE001 - a backend refusing the case: not a candidate
                if name == ours:
                    raise
    finally:
        common.LAUNCHES.clear()
        common.LAUNCHES.update(counts)
    return times
