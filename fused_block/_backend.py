"""Which implementation runs: the Triton kernels or the plain-PyTorch reference.

- CUDA tensors run the compiled Triton kernels.
- CPU tensors run the same kernels through the Triton interpreter when ``TRITON_INTERPRET=1``
  was set before Triton was imported (the test suite does this on machines without a GPU).
- Other CPU tensors run the reference in ``fused_block.reference``, so modules work anywhere.
"""
import contextlib

import torch

from fused_block.kernels.common import interpreting

INTERPRET = interpreting()


def use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (t.device.type == "cpu" and INTERPRET)


def dropout_seed(p: float, device) -> torch.Tensor:
    """A fresh int64 seed drawn from torch's generator (so ``torch.manual_seed`` fixes it).

    Returns an empty tensor when ``p == 0`` so no random number is consumed.
    """
    if p == 0.0:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def device_guard(t: torch.Tensor):
    """Launch on the tensor's device (and that device's current stream), not the current one."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
