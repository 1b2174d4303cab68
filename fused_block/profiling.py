"""What a step costs besides the kernels' own time: kernels launched per step, and host time.

:func:`count_kernels` runs a function once and counts every device kernel it launches:
Triton launches (each ``common.launch``, and any kernel started without it) and PyTorch kernels
(a ``TorchDispatchMode`` that sees each ATen op below autograd, so the backward's ops and
autograd's own gradient additions are counted too). An ATen op counts as a kernel unless it
is a view (``OpOverload.is_view``: view, transpose, split, detach, ...), only allocates
(empty, empty_strided, new_empty, ...), or only produces empty tensors. zeros, fill_, copy_,
cat, sum, clone and dtype casts (``_to_copy``) all count; ops that return a Python value
(``_local_scalar_dense`` from ``.item()``, ``equal``) count as kernels and also as host-device
synchronizations, as do copies from device memory to the host (``.tolist()``, ``.cpu()``; on a
CPU machine ``.tolist()`` of a CPU tensor reads it without an op, which nothing sees). The functions of ``fused_block``'s own ops are entered, not counted: the
ops inside them are.

:func:`host_profile` breaks a step's host time down by function (cProfile); run the step
inside :func:`fused_block._backend.host_only` (kernels skipped) on CPU tensors, as
``bench/specs/host.py`` does to compare the layers' host time with torch's.
"""
import collections
import contextlib
import cProfile
import dataclasses
import gc
import pstats
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fused_block.kernels import common

_aten = torch.ops.aten
# Ops that allocate or re-describe memory without launching anything.
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten._unsafe_view.default,
    _aten.lift_fresh.default, _aten.set_.source_Storage_storage_offset, _aten.resize_.default,
}
_SYNCS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default}


def _reads_to_host(func, args, kwargs, out) -> bool:
    """A copy from device memory into host memory that waits for it (``.tolist()``, ``.cpu()``
    and ``.to("cpu")`` of a CUDA tensor; not a ``non_blocking`` one): a synchronization. For
    ``copy_(dst, src)`` the source is the second argument."""
    if func not in _COPIES or kwargs.get("non_blocking") or (func is _aten.copy_.default and len(args) > 2
                                                            and args[2]):
        return False
    src, dst = (args[1], args[0]) if func is _aten.copy_.default else (args[0], out)
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type != "cpu"
            and dst.device.type == "cpu" and src.device.type != "meta")


def _produces_data(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.numel() > 0
    if isinstance(out, (tuple, list)):
        return any(_produces_data(o) for o in out)
    return False


def _backend_keys(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return torch._C.DispatchKeySet(torch._C._parse_dispatch_key(a.device.type.upper()))
    raise TypeError("a fused_block op without tensor arguments")


class _AtenKernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels = collections.Counter()
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fused_block":
            # An op that went through the dispatcher (under torch.compile, or registered with
            # custom_op): run its implementation with this mode back on, to count the
            # PyTorch ops inside; the op itself launches nothing of its own.
            with self:
                return func.redispatch(_backend_keys(args), *args, **kwargs)
        out = func(*args, **kwargs)
        if func in _SYNCS or _reads_to_host(func, args, kwargs, out):
            self.syncs[func.overloadpacket.__name__] += 1
            self.kernels[func.overloadpacket.__name__] += 1
        elif not func.is_view and func not in _NO_KERNEL and _produces_data(out):
            self.kernels[func.overloadpacket.__name__] += 1
        return out


@dataclasses.dataclass
class KernelCount:
    """Kernels launched by one call: Triton launches and PyTorch kernels, by name."""

    triton: dict
    torch: dict
    syncs: dict

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.torch.values())

    def table(self) -> str:
        lines = [f"{self.total} kernels: {sum(self.triton.values())} Triton, {sum(self.torch.values())} PyTorch"
                 + (f", {sum(self.syncs.values())} host syncs" if self.syncs else "")]
        for kind, counts in (("triton", self.triton), ("torch", self.torch)):
            for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"  {kind:<7} {name:<32} {n}")
        return "\n".join(lines)


def count_kernels(fn, *args, **kwargs) -> KernelCount:
    """Run ``fn(*args, **kwargs)`` once and count the kernels it launches (see module doc).

    Run a warm-up call first on CUDA: a first call may time config candidates, launching
    kernels that later calls do not.
    """
    mode = _AtenKernels()
    triton = collections.Counter()
    with _triton_launches(triton), mode:
        fn(*args, **kwargs)
    return KernelCount(triton=dict(triton), torch=dict(mode.kernels), syncs=dict(mode.syncs))


@contextlib.contextmanager
def _triton_launches(counts):
    """Count Triton kernels: each ``common.launch`` under its name (run or stubbed), and any
    kernel started without it under its function's name. (Counting ``common.LAUNCHES`` would
    also count the path markers some launchers record there.) Where the Triton interpreter
    runs a kernel, its PyTorch ops stay unseen: on a GPU the kernel is that one launch."""
    import triton.runtime.jit as jit

    launch = common.launch
    state = {"inside": False}

    def counted_launch(name, *args, **kwargs):
        counts[name] += 1
        state["inside"] = True
        try:
            return launch(name, *args, **kwargs)
        finally:
            state["inside"] = False

    classes = [jit.JITFunction]
    if common.interpreting():
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    runs = {cls: cls.run for cls in classes}

    def hooked(run):
        def counted_run(self, *args, **kwargs):
            if not state["inside"]:
                counts[getattr(self, "__name__", None) or self.fn.__name__] += 1
            with _disable_current_modes():
                return run(self, *args, **kwargs)
        return counted_run

    common.launch = counted_launch
    for cls, run in runs.items():
        cls.run = hooked(run)
    try:
        yield
    finally:
        common.launch = launch
        for cls, run in runs.items():
            cls.run = run


@dataclasses.dataclass
class HostProfile:
    """cProfile of a function, per call in microseconds: ``groups`` maps a component (one of
    this library's files, a torch or triton subpackage, ``C`` for builtins and tensor methods)
    to the own time spent in it; ``functions`` lists (own us, cumulative us, calls, where)."""

    total_us: float
    groups: dict
    functions: list

    def top(self, n=12) -> str:
        lines = [f"  {'own us':>8} {'cum us':>8} {'calls':>6}  function (top {n} by own time)"]
        for own, cum, calls, where in sorted(self.functions, key=lambda r: -r[0])[:n]:
            lines.append(f"  {own:>8.1f} {cum:>8.1f} {calls:>6.1f}  {where}")
        return "\n".join(lines)


def host_profile(fn, *, repeat=10, rounds=5) -> HostProfile:
    """Profile ``rounds`` x ``repeat`` calls of ``fn``; each function's time is the median over
    the rounds, so a round that the OS preempted (charged to whatever function was running)
    does not decide it. cProfile's own overhead inflates short functions: read the shares,
    not the absolute times. The garbage collector is paused meanwhile, for the same reason."""
    for name, value in (("repeat", repeat), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    samples = collections.defaultdict(list)
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            prof = cProfile.Profile()
            prof.enable()
            try:
                for _ in range(repeat):
                    fn()
            finally:  # an exception in fn leaves no profiler installed
                prof.disable()
            for key, (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
                samples[key].append((own / repeat * 1e6, cum / repeat * 1e6, calls / repeat))
    finally:
        if collecting:
            gc.enable()
    groups = collections.Counter()
    functions = []
    for key, rows in samples.items():
        rows += [(0.0, 0.0, 0.0)] * (rounds - len(rows))  # not called in some rounds
        own, cum, calls = (statistics.median(col) for col in zip(*rows))
        groups[_group(key[0])] += own
        functions.append((own, cum, calls, _where(key)))
    return HostProfile(sum(groups.values()), dict(groups), functions)


_GROUP_MARKERS = ("fused_block/kernels/", "fused_block/", "/kernels/", "torch/", "triton/")


def _group(filename) -> str:
    """``fused_block/norm.py``, ``kernels/matmul.py``, ``torch/autograd``, ``triton/runtime``,
    ``C`` (builtins: tensor methods, torch ops, the autograd engine), ``other``."""
    if filename == "~":
        return "C"
    path = filename.replace("\\", "/")
    for marker in _GROUP_MARKERS:
        i = path.rfind(marker)
        if i < 0:
            continue
        rest = path[i:].lstrip("/")
        if marker in ("torch/", "triton/"):
            parts = rest.split("/")
            return "/".join(parts[:2]) if len(parts) > 2 else rest
        return rest.replace("fused_block/kernels/", "kernels/")
    return "other"


def _where(key) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    for marker in ("site-packages/", "fused_block/", "kernels/"):
        i = filename.rfind(marker)
        if i >= 0:
            filename = filename[i:]
            break
    return f"{filename}:{line} {name}"
