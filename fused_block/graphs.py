"""CUDA graphs for static shapes: capture a training step once, then replay it.

A replay launches every kernel of the step with one call, so the host work of the step
(Python, autograd, op dispatch: see ``python -m bench --only host``) is paid once, at capture.
Two ways to use them with the fused layers:

- :func:`capture` (below): the whole step, forward and backward (and the optimizer step if the
  function takes it), in one graph; one replay per step.
- ``torch.cuda.make_graphed_callables(module, (sample_input,))`` on converted layers (or an
  ``nn.Sequential`` of them): a forward graph and a backward graph, called from eager code,
  so the loss, the optimizer and anything dynamic around them stay eager. The module's
  ``forward`` then takes positional tensors only (no mask keywords).

What a captured step requires (PyTorch's rules, and what the layers do about them):

- Static shapes, dtypes and devices; each replay reads the captured input tensors (:func:`capture`
  copies new inputs into them) and overwrites the same output tensors: clone what you keep.
- No host-device synchronization in the step. The layers read mask values only outside a
  capture: pass ``is_causal=True`` or bool padding masks, or run the step once with the same
  mask tensors before capturing (the warm-up does), so that the verdict on an unhinted causal
  mask or a float padding mask is already known; a mask seen first during the capture runs
  the SDPA fallback (slower, correct). Whatever the layers decided from mask values at capture
  holds for every replay.
- Kernel configs are chosen (and timed) on the first call of each shape, which must not be
  captured: the warm-up runs first, on a side stream.
- Dropout: each dropout's int64 seed is drawn with ``torch.randint`` on the CUDA generator
  inside the graph, and the kernels read it from device memory. The generator is graph-safe:
  every replay advances its Philox offset, so every replay draws new seeds (new masks), the
  same ones an eager step would draw after the same ``torch.cuda.manual_seed``; the backward
  regenerates each mask from the seed its own forward drew.
- Gradients accumulated with ``.backward()`` into ``.grad``: set them to None before capture
  (``optimizer.zero_grad(set_to_none=True)`` after the warm-up, as in PyTorch's whole-network
  example): the capture then allocates them and each replay overwrites them. Steps built on
  ``torch.autograd.grad`` return fresh gradients and need nothing.
"""
import torch
from torch.utils._pytree import tree_map

from fused_block import _validate

__all__ = ["GraphedStep", "capture"]


class GraphedStep:
    """A captured step: ``graphed(*new_inputs)`` copies them into :attr:`inputs`, replays the
    graph and returns :attr:`outputs` (the same tensors every call, overwritten).

    Calling it without arguments replays with :attr:`inputs` as they are (write into them
    directly to skip the copies). Build it with :func:`capture`.
    """

    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs

    def __call__(self, *inputs):
        if inputs:
            if len(inputs) != len(self.inputs):
                raise TypeError(f"expected {len(self.inputs)} inputs (or none), got {len(inputs)}")
            for i, (static, new) in enumerate(zip(self.inputs, inputs)):
                _check_like(f"inputs[{i}]", new, static)
            with torch.no_grad():
                for static, new in zip(self.inputs, inputs):
                    static.copy_(new)
        self.graph.replay()
        return self.outputs


def capture(step, *inputs, warmup: int = 3, pool=None) -> GraphedStep:
    """Capture ``step(*inputs)`` in a CUDA graph and return a :class:`GraphedStep` replaying it.

    Args:
        step: a function of the input tensors returning a tensor or any nesting of tuples,
            lists and dicts of tensors, e.g. a training step
            ``lambda x, dy: torch.autograd.grad(model(x), (x, *model.parameters()), dy)``.
            Other tensors it uses (parameters, masks) are read in place at every replay.
        inputs: CUDA tensors on one device. They are copied into the graph's own static
            inputs (same shape, dtype, stride and ``requires_grad``), so calling the result
            never overwrites the caller's tensors.
        warmup: eager calls before the capture (at least 1), on a side stream: they choose
            and compile the kernel configs and let the layers read mask values.
        pool: a memory pool to share with other graphs (``torch.cuda.graph_pool_handle()``
            or another graph's ``pool()``).

    Raises ``TypeError``/``ValueError`` for bad arguments, before anything runs, and a
    ``RuntimeError`` saying what a graph cannot contain when the capture fails.
    """
    if not callable(step):
        raise TypeError(f"step must be callable, got {type(step).__name__}")
    warmup = _validate.integer("warmup", warmup)
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first call chooses kernel configs), got {warmup}")
    if not inputs:
        raise ValueError("capture needs at least one input tensor")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"inputs[{i}] must be a torch.Tensor, got {type(t).__name__}")
    for i, t in enumerate(inputs):
        if t.device.type != "cuda":
            raise ValueError(f"inputs[{i}] is on {t.device}: CUDA graphs capture CUDA tensors only")
        if t.device != inputs[0].device:
            raise ValueError(f"inputs[{i}] is on {t.device} but inputs[0] is on {inputs[0].device}")
    device = inputs[0].device
    static = tuple(_static_copy(t) for t in inputs)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(*static)
    torch.cuda.current_stream(device).wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool):
            outputs = step(*static)
    except RuntimeError as exc:
        raise RuntimeError(
            f"the step could not be captured in a CUDA graph ({exc}). A captured step cannot "
            "synchronize with the host (.item(), printing a tensor, a Python branch on tensor "
            "values, a mask first seen during the capture whose values must be read: pass "
            "is_causal=True or bool padding masks) nor use CPU tensors or new shapes") from exc
    tree_map(_check_output, outputs)
    return GraphedStep(graph, static, outputs)


def _static_copy(t):
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        s.copy_(t)
    return s.requires_grad_(t.requires_grad)


def _check_like(name, new, static):
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(new).__name__}")
    if new.shape != static.shape or new.dtype != static.dtype or new.device != static.device:
        raise ValueError(f"{name} must match the captured input: shape {tuple(static.shape)}, {static.dtype} on "
                         f"{static.device}; got shape {tuple(new.shape)}, {new.dtype} on {new.device}")


def _check_output(out):
    if isinstance(out, torch.Tensor) and out.device.type != "cuda":
        raise ValueError(f"step returned a tensor on {out.device}: a replay only updates CUDA tensors")
    return out
