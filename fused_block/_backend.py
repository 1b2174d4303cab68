"""Which implementation runs: the Triton kernels or the plain-PyTorch reference.

- CUDA tensors run the compiled Triton kernels.
- CPU tensors run the same kernels through the Triton interpreter when ``TRITON_INTERPRET=1``
  was set before Triton was imported (the test suite does this on machines without a GPU).
- Other CPU tensors run the reference in ``fused_block.reference``, so modules work anywhere.
- Inside :func:`host_only`, every tensor takes the kernel path and the launches are skipped:
  the host-overhead measurement (``python -m bench --only host``) on a machine without a GPU.
"""
import contextlib
import functools
import sys
import threading
import warnings

import torch

from fused_block.kernels import common
from fused_block.kernels.common import interpreting

INTERPRET = interpreting()
# Set by host_only(): the kernel path for every device (launches stubbed, see below).
FORCE_TRITON = False


_compiling = torch.compiler.is_compiling
_transforms_active = torch._C._are_functorch_transforms_active
_is_batched, _is_legacy_batched = torch._C._functorch.is_batchedtensor, torch._C._functorch.is_legacy_batchedtensor


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs the kernels (else the PyTorch reference): CUDA tensors, CPU
    ones in the interpreter; not under a torch.func transform (``grad``, ``vmap``, ``jacrev``),
    which the kernels' autograd Functions do not take, where the reference's torch ops give the
    transform's answer (outside ``torch.compile``, which traces the ops themselves)."""
    if FORCE_TRITON:
        return True
    kind = t.device.type
    return (kind == "cuda" or (INTERPRET and kind == "cpu")) and (_compiling() or not _transforms_active())


@contextlib.contextmanager
def host_only(stub: bool = True):
    """Run everything of the kernel path but the kernels, on any device (CPU tensors included).

    Validation, config lookup, allocation, ``torch.library`` dispatch, autograd and every
    PyTorch op run as usual; ``common.launch`` counts each launch and returns without running
    it (``common.STUB_LAUNCHES``), so outputs hold whatever their buffers held. Launchers see
    ``common.arch(cpu) == 0`` and ``interpreting()`` unchanged, so they pick their interpreter
    configs and never time candidates. For measuring host time and counting kernels on CPU
    tensors only: on CUDA tensors the configs chosen untimed would stay in the config caches.

    ``stub=False`` keeps the launches: in a process without the interpreter, with
    ``fused_block.kernels.fake_driver`` installed, Triton's launch path (or the direct one)
    runs up to the fake C launcher (the host benchmark's measurement with launches included).
    """
    global FORCE_TRITON
    before = FORCE_TRITON, common.STUB_LAUNCHES
    FORCE_TRITON, common.STUB_LAUNCHES = True, stub
    try:
        yield
    finally:
        FORCE_TRITON, common.STUB_LAUNCHES = before


def needs_autograd(*tensors) -> bool:
    """Whether autograd will differentiate an op on ``tensors`` (else the op runs without its
    autograd Function, saving nothing). Never while ``torch.jit.trace`` records: a trace holds
    the ops themselves (an inference graph), not Python autograd Functions, which it could
    neither replay consistently nor save."""
    if not torch.is_grad_enabled() or torch._C._get_tracing_state() is not None:
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def is_dtensor(t) -> bool:
    """``t`` is a ``torch.distributed.tensor.DTensor`` (never imports it: without the module
    loaded there is none). Callers test ``type(t) is not torch.Tensor`` first."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# A Parameter of a DTensor is a DTensor (torch.nn.Parameter keeps a tensor subclass's type), so
# these two types are never one.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def no_dtensor(name, *tensors):
    """The fused ops take local tensors: a clear error for a DTensor (its storage is not the
    tensor's data, which the kernels would read)."""
    for t in tensors:
        if t is None or type(t) in _PLAIN_TENSORS or not is_dtensor(t):
            continue
        raise TypeError(f"fused_block.{name}: got a DTensor (placements {tuple(t.placements)}); the kernels take "
                        "local tensors. Tensor-parallel layers run their ops on their shards "
                        "(fused_block.distributed.LayerParallel); elsewhere pass DTensor.to_local() and combine the "
                        "results yourself (the norms take row-sharded DTensors)")


# Keys of the one-time warnings already given (tests reset it per test: tests/conftest.py).
WARNED = set()


def warn_once(key, message, stacklevel=2):
    """``warnings.warn(message)`` the first time ``key`` is seen (never while torch.compile
    traces: a warning there would break the graph). ``stacklevel`` as for warnings.warn, counted
    from warn_once's caller."""
    if key not in WARNED and not torch.compiler.is_compiling():
        WARNED.add(key)
        warnings.warn(message, stacklevel=stacklevel + 1)


def not_scriptable(module):
    """``__prepare_scriptable__`` of the library's modules: ``torch.jit.script`` cannot compile a
    forward that launches Triton kernels from Python; say what works instead."""
    raise TypeError(f"torch.jit.script cannot compile fused_block's {type(module).__name__}: its forward "
                    "launches Triton kernels from Python. Use torch.jit.trace(module, example_inputs) or "
                    "torch.export.export(module, example_args) instead (both record the fused ops).")


# One empty int64 tensor per device stands in for the seed when p == 0: no allocation per call.
_NO_SEED = {}


def once_differentiable(backward):
    """For a kernel Function's ``backward``: outside ``create_graph=True`` (the usual case) the
    backward itself, for the price of one grad-mode read. Under it (double backward, gradient
    penalties, ``torch.autograd.functional.hvp``) the backward runs without recording and its
    gradients come back as tensors whose own backward raises a ``RuntimeError`` naming the op,
    as torch's ``once_differentiable`` (whatever the incoming gradients require): a second
    derivative through a kernel is an error, not a gradient with a silently missing graph.
    Batched gradients (vmap over the backward) are a ``RuntimeError`` naming the op too."""
    message = (f"fused_block: the backward of {backward.__qualname__.split('.')[0]} runs Triton kernels and has no "
               "derivative of its own (double backward, create_graph=True): compute higher-order gradients with "
               "the torch module or function it replaces, or in float64 (the PyTorch reference path)").encode()
    is_grad_enabled = torch.is_grad_enabled
    batched = (f"fused_block: the backward of {backward.__qualname__.split('.')[0]} runs Triton kernels, which take "
               "no batched gradients (torch.autograd.functional.jacobian/hessian with vectorize=True, "
               "autograd.grad(is_grads_batched=True), torch.func.vmap over a backward): leave them unvectorized")

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        for g in () if _compiling() else grads:  # the first gradient that arrived tells (dynamo: none)
            if g is not None:
                if _is_legacy_batched(g) or _is_batched(g):
                    raise RuntimeError(batched)
                break
        if not is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            out = backward(ctx, *grads)
        single = not isinstance(out, tuple)
        outs = (out,) if single else out
        delayed = torch._C._functions.DelayedError(message, len(outs))(
            *[None if t is None else t.detach().requires_grad_() for t in outs])
        delayed = delayed if isinstance(delayed, tuple) else (delayed,)
        return delayed[0] if single else tuple(delayed)

    return wrapper


_LOCAL = threading.local()  # .seeds: [views of one drawn tensor, next index, device] inside seed_block


@contextlib.contextmanager
def seed_block(n: int, device):
    """Draw the seeds of the next ``n`` dropouts on this thread at once: one ``randint`` of
    ``n`` values (one kernel) instead of ``n``. A layer's forward opens one around its ops;
    :func:`dropout_seed` hands the values out in call order, and draws as usual when the block
    is used up, for another device, or absent. Under ``torch.compile`` it does nothing.
    """
    if n < 2 or torch.compiler.is_compiling():
        yield
        return
    before = getattr(_LOCAL, "seeds", None)
    drawn = torch.randint(0, 2**62, (n,), dtype=torch.int64, device=device)
    _LOCAL.seeds = [drawn.split(1), 0, drawn.device]
    try:
        yield
    finally:
        _LOCAL.seeds = before


def _indexed(device) -> torch.device:
    """``device`` as a tensor on it reports it: ``"cuda"`` is the current CUDA device, with its
    index (``torch.device("cuda") != torch.device("cuda:0")``)."""
    d = torch.device(device)
    if d.index is None and d.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return d


def drop_all(t: torch.Tensor) -> torch.Tensor:
    """A dropout at p = 1 on ``t``: torch's own ``F.dropout(t, 1.0)`` (``t`` times 0, so the
    gradients of whatever made ``t`` are zeros, as torch's layers give). The ops take p in [0, 1]
    as torch does; at 1 they drop their input or output here and run their kernels at p = 0,
    drawing no seed."""
    return torch.nn.functional.dropout(t, 1.0, training=True)


def dropout_seed(p: float, device) -> torch.Tensor:
    """A fresh int64 seed (shape (1,)) drawn from torch's generator, so ``torch.manual_seed``
    fixes it; kernels read it from device memory (``tl.load``), never on the host.

    With ``p == 0`` no random number is drawn and the result is an empty tensor, in eager mode
    the same one on every call for a device (kernels never read it; nothing is allocated).

    Inside :func:`seed_block` the seed is the next of the values drawn there (a view).

    CUDA graphs: drawn inside a captured region, ``torch.randint`` takes its Philox offset
    from the graph's generator state, which ``CUDAGraph.replay`` advances, so each replay
    draws a new seed (new dropout masks), and the backward reads the seed its forward drew.
    """
    if p == 0.0:
        if torch.compiler.is_compiling():
            # A fresh one per call: dynamo rejects a tensor passed twice to one autograd.Function
            # (an op's two seeds), and a traced allocation costs nothing at run time.
            return torch.empty(0, dtype=torch.int64, device=device)
        seed = _NO_SEED.get(device)
        if seed is None:
            # Not an inference tensor even when first made under inference_mode: ops save it
            # for backward, which inference tensors cannot be.
            with torch.inference_mode(False):
                seed = _NO_SEED[device] = torch.empty(0, dtype=torch.int64, device=device)
        return seed
    block = getattr(_LOCAL, "seeds", None)
    if (block is not None and block[1] < len(block[0]) and block[2] == _indexed(device)
            and not torch.compiler.is_compiling()):  # a traced graph draws its own seeds
        block[1] += 1
        seed = block[0][block[1] - 1]
    else:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    shift = getattr(_LOCAL, "shift", None)
    if shift is not None and shift[1] < len(shift[0]):
        shift[1] += 1
        if shift[0][shift[1] - 1]:
            seed = seed + shift[0][shift[1] - 1]
    return seed


@contextlib.contextmanager
def seed_shift(offsets):
    """Add ``offsets[i]`` to the i-th seed :func:`dropout_seed` hands out inside the block.

    Tensor parallelism: every rank of a group draws the same seeds (their generators agree); a
    dropout on a rank's own shard of a sharded tensor (its heads, its FFN columns, its part of
    the sequence) takes ``seed + rank``, a Philox stream of its own, while one on a tensor every
    rank holds whole keeps ``seed``, the same mask everywhere. The caller lists one offset per
    seed the ops inside will draw (dropouts with p > 0, in draw order).
    """
    before = getattr(_LOCAL, "shift", None)
    _LOCAL.shift = [tuple(offsets), 0]
    try:
        yield
    finally:
        _LOCAL.shift = before


_NO_GUARD = contextlib.nullcontext()  # reentrant and stateless: one for every call


@functools.cache
def _one_gpu() -> bool:
    return torch.cuda.device_count() <= 1


def device_guard(t: torch.Tensor):
    """Launch on the tensor's device (and that device's current stream), not the current one.

    Free where there is nothing to switch: CPU tensors, or a machine with one GPU.
    """
    if not t.is_cuda or _one_gpu():
        return _NO_GUARD
    return torch.cuda.device(t.device)
