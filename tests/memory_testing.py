"""Recording what a computation allocates, on any device (CPU and meta tensors included).

:class:`Allocations` is a ``TorchDispatchMode``: every ATen op's output that aliases none of
its inputs (by the op's schema: not a view, not an in-place or ``out=`` result) is a new
allocation, recorded with its shape, dtype and storage bytes. Storage weak references give the
bytes still alive after each op, hence the peak. Kernel launches allocate nothing themselves
(their outputs come from ``common.empty``, i.e. ``aten.empty``), so this is everything an op
of the library allocates, also inside ``_backend.host_only()`` on meta tensors, where model
sizes cost nothing.
"""
import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


@dataclasses.dataclass
class Allocation:
    op: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int


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
                self.records.append(Allocation(str(func), tuple(t.shape), t.dtype, storage.nbytes()))
                self._live.append((StorageWeakRef(storage), storage.nbytes()))
        self._live = [(ref, n) for ref, n in self._live if not ref.expired()]
        self.peak = max(self.peak, sum(n for _, n in self._live))
        return out

    def largest(self, exclude_shapes=()):
        """The largest allocation whose shape is not one of ``exclude_shapes`` (None if none)."""
        rest = [a for a in self.records if a.shape not in {tuple(s) for s in exclude_shapes}]
        return max(rest, key=lambda a: a.nbytes, default=None)

    def with_numel_at_least(self, numel):
        return [a for a in self.records if torch.Size(a.shape).numel() >= numel]

