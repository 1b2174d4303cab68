"""PyTorch's SDPA backends as candidates beside the Triton attention kernels.

Where ``torch.nn.functional.scaled_dot_product_attention`` computes exactly the same function
(:func:`expresses`: CUDA, fp16/bf16, no key padding, mask, bias, window, softcap, sinks, ALiBi
or dropout, causal only with Lq == Lk since SDPA's causal mask is top-left aligned and ours
bottom-right, no LSE asked for), ``fused_block.attention`` and ``attention_qkvpacked`` choose
once per shape bucket (:func:`choose`) among the Triton kernels and SDPA's cuDNN and flash
backends, timing forward (+ backward when a gradient is needed) on the call's own tensors like
the kernels' configs (``kernels.common.ConfigCache``). The Triton kernels stay the path

- on the interpreter, with ``FUSED_BLOCK_TUNE=0`` (no timing; the documented static rule: our
  kernels, since which SDPA backend takes a case is only known by trying it), during CUDA graph
  capture or ``torch.compile`` tracing when the bucket has no verdict yet (no timing there);
- under ``torch.use_deterministic_algorithms(True)`` (our backward is atomic-free);
- with ``FUSED_BLOCK_ATTENTION=triton`` (``=sdpa_cudnn`` / ``=sdpa_flash`` force that backend
  where it expresses the case; tests use this to check each candidate's numerics).

A verdict holds for its bucket, which does not record everything a backend checks (strides,
pointer alignment, the exact lengths): a call the chosen backend refuses runs the Triton
kernels (:func:`run_or_none`). SDPA's output is returned in the layout the ops document (q's
memory order), a copy only where the backend's differs.

:func:`choices` returns every verdict (bucket -> candidate, with the timings); set
``FUSED_BLOCK_PRINT_TUNING=1`` to print each as it is made.
"""
import os

import torch
import torch.nn.functional as F

from fused_block._timing import check_candidate, forced_by_env, time_candidates, untimeable
from fused_block.kernels import common

TRITON, CUDNN, FLASH = "triton", "sdpa_cudnn", "sdpa_flash"
CANDIDATES = (TRITON, CUDNN, FLASH)
_FORCED = forced_by_env("FUSED_BLOCK_ATTENTION", CANDIDATES)
_CHOSEN = {}  # bucket -> (candidate, {candidate: ms})
# SDPA takes grouped K/V heads (``enable_gqa``) from torch 2.5; before it, GQA is ours alone.
_SDPA_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def force(candidate):
    """Forces ``candidate`` (one of :data:`CANDIDATES`, or None for the timed choice) for every
    call SDPA expresses; returns the previous setting (tests; ``FUSED_BLOCK_ATTENTION``)."""
    global _FORCED
    check_candidate(candidate, CANDIDATES)
    before, _FORCED = _FORCED, candidate
    return before


def forced_sdpa():
    """Whether an SDPA backend is forced (then it runs on any device, CPU tensors too)."""
    return _FORCED is not None and _FORCED != TRITON


def choices():
    """Every verdict made in this process: {bucket: (candidate, {candidate: milliseconds})}."""
    return dict(_CHOSEN)


def expresses(q, k, v, causal, key_padding_mask, dropout_p, window, softcap, sinks, alibi_slopes, bias, mask,
              return_lse):
    """Whether SDPA computes this call's function exactly (see the module's docstring; the
    callers check that the tensors are on CUDA)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and not return_lse and key_padding_mask is None and mask is None and bias is None and not dropout_p
            and tuple(window) == (-1, -1) and not softcap and sinks is None and alibi_slopes is None
            and (not causal or q.shape[2] == k.shape[2]) and (k.shape[1] == q.shape[1] or _SDPA_GQA))


def _bucket(q, k, causal, grad):
    B, Hq, Lq, D = q.shape
    return _bucket_of(q.device, q.dtype, causal, grad, B, Hq, k.shape[1], Lq, k.shape[2], D)


def _bucket_of(device, dtype, causal, grad, B, Hq, Hkv, Lq, Lk, D):
    return (common.arch(device), dtype, bool(causal), bool(grad), D, Hq // Hkv, common.next_pow2(B * Hq),
            common.next_pow2(Lq), common.next_pow2(Lk))


def backend_of(candidate):
    """torch's ``SDPBackend`` for a candidate (tests on the CPU substitute the math backend)."""
    from torch.nn.attention import SDPBackend

    return SDPBackend.CUDNN_ATTENTION if candidate == CUDNN else SDPBackend.FLASH_ATTENTION


def run(candidate, q, k, v, causal, scale):
    """SDPA through ``candidate``'s backend (q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D)); raises
    torch's ``RuntimeError`` where the backend refuses the tensors (the timing leaves such a
    candidate out)."""
    from torch.nn.attention import sdpa_kernel

    backend = backend_of(candidate)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale, **gqa)


# torch's messages when no enabled backend takes the tensors (CUDA's, then the CPU's).
_REFUSALS = ("No available kernel", "No viable backend")


def run_or_none(candidate, q, k, v, causal, scale):
    """:func:`run`, or None where the backend refuses these tensors, for the caller to run our
    kernel instead. A verdict holds for a bucket, which does not record everything a backend
    checks (strides and pointer alignment, the exact lengths): a call the timed winner refuses
    must still get its answer, not an error (torch's own warnings say why it refused). Under
    ``torch.compile`` the call is traced as it is (no refusal at trace time)."""
    if torch.compiler.is_compiling():
        return run(candidate, q, k, v, causal, scale)
    try:
        return run(candidate, q, k, v, causal, scale)
    except RuntimeError as exc:
        if not any(m in str(exc) for m in _REFUSALS):
            raise
        return None


def known(device, dtype, causal, grad, B, Hq, Hkv, Lq, Lk, D):
    """What :func:`choose` returns for a call of these sizes without timing anything: the
    forced candidate, the static rule, or the bucket's verdict; None where it would time the
    candidates (the call's own path then times them)."""
    if _FORCED is not None:
        return _FORCED
    if common.interpreting() or torch.are_deterministic_algorithms_enabled():
        return TRITON
    hit = _CHOSEN.get(_bucket_of(device, dtype, causal, grad, B, Hq, Hkv, Lq, Lk, D))
    if hit is not None:
        return hit[0]
    if (not common.TUNE or torch.compiler.is_compiling()
            or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()) or untimeable()):
        return TRITON
    return None


def choose(q, k, causal, grad, timed):
    """The candidate for a call with queries ``q`` and keys ``k`` (SDPA's layout): forced,
    remembered for its bucket, or timed now. ``timed()`` returns ``(leaves, {candidate:
    fn(*leaves) -> out})``: the call's tensors as fresh leaves and each candidate's forward."""
    B, Hq, Lq, D = q.shape
    hit = known(q.device, q.dtype, causal, grad, B, Hq, k.shape[1], Lq, k.shape[2], D)
    if hit is not None:
        return hit
    key = _bucket(q, k, causal, grad)
    times = time_candidates(grad, *timed(), ours=TRITON)
    best = min(times, key=times.get)
    _CHOSEN[key] = (best, times)
    if os.environ.get("FUSED_BLOCK_PRINT_TUNING"):
        print(f"[fused_block] attention {key}: " + ", ".join(f"{c}={t:.4f}ms" for c, t in sorted(
            times.items(), key=lambda ct: ct[1])))
    return best
