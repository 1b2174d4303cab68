"""Which PyTorch (aten) ops a piece of code runs, outside the Triton kernels.

Launch counts prove that the kernels ran; this proves what ran beside them: e.g. that a
SwiGLU FFN did not compute ``silu(gate) * up`` with PyTorch ops, or that the QKV gradient was
not rebuilt with ``cat`` and copies. Kernel launches run with Python dispatch disabled, so
the interpreter's own tensor traffic (``TRITON_INTERPRET=1`` copies arguments to and from
NumPy) is not counted, and the counts are the ones a GPU run would see.
"""
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused_block.kernels import common

# Ops that would mean a fused op was computed (or its gradient rebuilt) in PyTorch.
UNFUSED = frozenset({"cat", "stack", "split", "split_with_sizes", "copy_", "_to_copy", "clone", "contiguous",
                     "silu", "silu_backward", "mul", "sigmoid", "mm", "addmm", "bmm", "linear", "matmul",
                     "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_flash_attention", "_softmax", "repeat_interleave", "index_select"})


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def aten_ops(monkeypatch):
    """``with aten_ops(monkeypatch) as ops:`` counts the aten ops run inside (a Counter by name)."""
    launch = common.launch

    def quiet_launch(*args, **kwargs):
        with torch._C._DisableTorchDispatch():
            return launch(*args, **kwargs)

    monkeypatch.setattr(common, "launch", quiet_launch)
    counter = _Counter()
    with counter:
        yield counter.ops
    monkeypatch.setattr(common, "launch", launch)


def unfused(ops):
    """The ops of ``UNFUSED`` that ran, with their counts."""
    return {name: n for name, n in ops.items() if name in UNFUSED}
