"""Recording what a computation allocates, on any device (CPU and meta tensors included).

:class:`Allocations` is a ``TorchDispatchMode``: every ATen op's output that aliases none of
its inputs (by the op's schema: not a view, not an in-place or ``out=`` result) is a new
allocation, recorded with its shape, dtype and storage bytes. Storage weak references give the
bytes still alive after each op, hence the peak. Kernel launches allocate nothing themselves
(their outputs come from ``common.empty``, i.e. ``aten.empty``), so this is everything an op
of the library allocates, also inside ``_backend.host_only()`` on meta tensors, where model
sizes cost nothing.

On a GPU, Triton's launcher also allocates through ``triton.set_allocator`` the global scratch
of kernels that build tensor descriptors on the device (``common._scratch``: 1-D int8, a
128-byte descriptor per program and descriptor, tens of KiB); each such record says
``scratch=True``, and ``buffers()`` leaves them out: what a test says of an op's tensors
(a gradient's size, no (L, L) buffer) is about the others.
"""
import dataclasses
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fused_block.kernels import common

_SCRATCH = common._scratch.__code__


@dataclasses.dataclass
class Allocation:
    op: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    scratch: bool = False  # the descriptor scratch Triton's launcher asked common._scratch for


def _from_scratch_allocator() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _SCRATCH:
            return True
        frame = frame.f_back
    return False


class Allocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.records = []
        self.peak = 0
        self._live = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(outs):
            aliased = i < len(returns) and returns[i].alias_info is not None
            if isinstance(t, torch.Tensor) and not aliased:
                storage = t.untyped_storage()
                self.records.append(Allocation(str(func), tuple(t.shape), t.dtype, storage.nbytes(),
                                               _from_scratch_allocator()))
                self._live.append((StorageWeakRef(storage), storage.nbytes()))
        self._live = [(ref, n) for ref, n in self._live if not ref.expired()]
        self.peak = max(self.peak, sum(n for _, n in self._live))
        return out

    def largest(self, exclude_shapes=()):
        """The largest allocation whose shape is not one of ``exclude_shapes`` (None if none)."""
        rest = [a for a in self.records if a.shape not in {tuple(s) for s in exclude_shapes}]
        return max(rest, key=lambda a: a.nbytes, default=None)

    def buffers(self):
        """The allocations but Triton's descriptor scratch."""
        return [a for a in self.records if not a.scratch]

    def with_numel_at_least(self, numel):
        """The allocations of ``numel`` elements or more, Triton's descriptor scratch included."""
        return [a for a in self.records if torch.Size(a.shape).numel() >= numel]

