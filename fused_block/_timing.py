"""The choices made once per shape bucket between our kernels and torch's paths (the GEMMs'
cuBLAS, ``fused_block.dispatch``; attention's SDPA backends, ``fused_block._attn_sdpa``; the
norms' eager ops, ``fused_block.norm``): a forced candidate's switches, and the timing of the
candidates on a call's own tensors (CUDA only: ``triton.testing.do_bench``)."""
import os
import warnings

import torch

from fused_block.kernels import common


def forced_by_env(variable, candidates):
    """The candidate environment ``variable`` forces (None when unset, empty or "auto")."""
    value = os.environ.get(variable, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in candidates:
        raise ValueError(f"{variable} must be 'auto' or one of {', '.join(candidates)}, got {value!r}")
    return value


def check_candidate(candidate, candidates):
    """A candidate to force: one of ``candidates``, or None for the timed choice."""
    if candidate is not None and candidate not in candidates:
        raise ValueError(f"candidate must be one of {', '.join(candidates)} or None, got {candidate!r}")


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def untimeable() -> bool:
    """Whether candidates must not be timed here: under saved-tensor hooks (non-reentrant
    activation checkpointing, offloading), which would see the timing's own saved tensors (a
    checkpoint's recomputation would then save fewer than its forward did and raise); the
    caller runs its static rule without remembering a verdict."""
    return _TOP_HOOKS is None or _TOP_HOOKS(False) is not None


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


def _random_like(o):
    """Standard normal values in ``o``'s shape, dtype and device from a generator of their own:
    the timing happens inside the caller's forward (its first call of a bucket), and drawing
    from torch's generator there would move every dropout seed drawn after it (a reentrant
    checkpoint's recomputation, which times what its no-grad forward did not, would then drop
    other elements than the forward did; a rerun with the choices already made, others again)."""
    generator = torch.Generator(device=o.device).manual_seed(0)
    return torch.randn(o.shape, dtype=o.dtype, device=o.device, generator=generator)


def time_candidates(grad, leaves, fns, ours):
    """Milliseconds per candidate (``{name: fn(*leaves) -> tensor or tuple}``) that runs this
    case: the forward, and with ``grad`` the backward of every output that requires a gradient
    (random gradients, drawn once per candidate from a generator of their own: torch's is left
    as it was) into every leaf that requires one. A candidate
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
                    douts[name] = [_random_like(o) for o in outs]
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
