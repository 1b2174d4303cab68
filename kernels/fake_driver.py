"""A test double of Triton's CUDA driver: ``JITFunction.run`` on a machine without a GPU.

Inside :func:`installed`, Triton's active driver is a :class:`FakeDriver` and a kernel's
compile step makes a :class:`FakeCompiledKernel` instead of compiling. So
``kernel[grid](...)`` on a ``JITFunction`` runs everything of Triton's launch path on CPU
tensors (binding, specialization, the cache key and lookup, the global-value check,
``launch_metadata``, the compiled kernel's lazy handles) up to the C launcher, which the fake
replaces: it records the launch (``record=True``) and checks each argument against the
specialization the kernel was compiled for (``check=True``), or does nothing (both off: the
host benchmark). The direct path (``fused_block.kernels.launch``) goes through the same
driver, so tests compare what either would launch, and the benchmark times both.

Not the library's code path: the tests and ``bench/specs/host.py`` use it, on CPU tensors, in
a process where ``TRITON_INTERPRET`` is off (the kernels are ``JITFunction``s; see
:func:`run_without_interpreter`) or on ``JITFunction``s made by the test itself.
Fake devices are named ``"fake0"``, ``"fake1"``: the compiled kernels Triton caches for them
never mix with a real device's, and they are dropped on exit.
"""
import contextlib
import dataclasses
import os
import subprocess
import sys

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel, make_backend
from triton.runtime import driver as _driver_config
from triton.runtime.jit import JITFunction


class SpecializationMismatch(AssertionError):
    """A launch passed an argument the compiled kernel was not specialized for."""


@dataclasses.dataclass
class Launch:
    """One launch as the C launcher would receive it."""

    compiled: "FakeCompiledKernel"
    grid: tuple  # (x, y, z)
    device: str
    stream: int
    args: tuple  # every kernel parameter in order, constexprs included


class FakeCompiledKernel(CompiledKernel):
    """What ``triton.compile`` would have returned, without compiling: Triton's own
    ``CompiledKernel`` methods (``run``, ``launch_metadata``, ``__getitem__``, the lazy handle
    initialization) on made-up metadata. ``src`` (signature, constants, attrs) and ``options``
    say what it was compiled for."""

    def __init__(self, src, target, options):  # noqa: D107 - no files to read, unlike the base
        self.src = src
        self.options = dict(options)
        self.name = src.fn.__name__
        self.hash = src.hash()  # as triton.compile does first (fills the kernel's used globals)
        fields = dict(name=self.name, target=target, num_warps=options["num_warps"],
                      num_stages=options["num_stages"], num_ctas=options.get("num_ctas", 1), shared=0,
                      global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                      profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False)
        self.metadata = _Metadata(**fields)
        self.packed_metadata = make_backend(target).pack_metadata(self.metadata)
        self.asm = {}
        self.metadata_group = {}
        self.kernel = self  # the "binary" load_binary receives: the launch record's identity
        self.module = self.function = self._run = None


@dataclasses.dataclass(frozen=True)
class _Metadata:
    name: str
    target: GPUTarget
    num_warps: int
    num_stages: int
    num_ctas: int
    shared: int
    global_scratch_size: int
    global_scratch_align: int
    profile_scratch_size: int
    profile_scratch_align: int
    launch_cooperative_grid: bool
    launch_pdl: bool


@dataclasses.dataclass(frozen=True)
class _Function:
    """The handle ``load_binary`` returns: which compiled kernel, loaded on which device."""

    compiled: FakeCompiledKernel
    device: str


_MODULE = object()  # the loaded module handle (not None: Triton loads a kernel once)


class _Utils:
    def __init__(self, fake):
        self.fake = fake

    def load_binary(self, name, binary, shared, device):
        return _MODULE, _Function(binary, device), 32, 0, 1024  # module, function, regs, spills, threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "max_num_regs": 65536, "multiprocessor_count": 132,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}


class _Launcher:
    """Stands in for ``CudaLauncher``: the same call, no GPU."""

    def __init__(self, fake, src, metadata):
        self.fake, self.src = fake, src

    def __call__(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
                 *args):
        fake = self.fake
        if fake.check:
            fake.check_args(function.compiled, args)
        if enter_hook is not None:  # as the C launcher does, around the launch
            enter_hook(launch_metadata)
        if fake.record:
            fake.launches.append(Launch(function.compiled, (gx, gy, gz), function.device, stream, args))
        if exit_hook is not None:
            exit_hook(launch_metadata)


class FakeDriver:
    """Triton's driver interface for :func:`installed`: an sm_``arch`` target, devices
    ``fake<i>`` (``set_device``), a current stream per device (``set_stream``), and a launcher
    that records (``launches``) and checks launches instead of running them."""

    def __init__(self, arch=90, record=True, check=True):
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.record, self.check = record, check
        self.launches = []
        self.compiled = []  # every FakeCompiledKernel made, in order
        self.device = "fake0"
        self.streams = {}
        self.utils = _Utils(self)

    # -- the driver interface Triton's runtime calls --------------------------------------------
    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.streams.get(device, 0)

    def get_current_target(self):
        return self.target

    def launcher_cls(self, src, metadata):
        return _Launcher(self, src, metadata)

    def get_device_capability(self, device):
        return divmod(self.target.arch, 10)

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("the fake driver builds no C launcher")

    # -- test controls --------------------------------------------------------------------------
    def set_device(self, index: int) -> None:
        self.device = f"fake{index}"

    def set_stream(self, handle: int) -> None:
        self.streams[self.device] = handle

    def check_args(self, compiled, args):
        """Raise :class:`SpecializationMismatch` unless every argument is one ``compiled`` was
        specialized for: its Triton type, 16-divisibility where the kernel assumes it, and the
        value of every constexpr (ints equal to 1 included)."""
        src = compiled.src
        names = src.fn.arg_names
        if len(args) != len(names):
            raise SpecializationMismatch(f"{compiled.name}: {len(args)} arguments for {len(names)} parameters")
        for i, (name, arg) in enumerate(zip(names, args)):
            ty = src.signature[name]
            if ty == "constexpr":
                if (i,) in src.constants and not _same(src.constants[(i,)], arg):
                    raise SpecializationMismatch(f"{compiled.name}: {name}={arg!r}, compiled for "
                                                 f"{src.constants[(i,)]!r}")
                continue
            param = src.fn.params[i]
            got, attr = native_specialize_impl(self.backend, arg, param.is_const, True, True)
            if got == "constexpr":  # an int equal to 1, where the kernel was not specialized on it
                got = native_specialize_impl(self.backend, arg, param.is_const, False, True)[0]
            if param.annotation_type:  # a typed parameter: the binder takes the annotation's type
                got = param.annotation_type
            if got != ty:
                raise SpecializationMismatch(f"{compiled.name}: {name} is {got}, compiled as {ty}")
            if ["tt.divisibility", 16] in src.attrs.get((i,), []) and attr != "D":
                raise SpecializationMismatch(f"{compiled.name}: {name} is not 16-divisible, compiled as if it were")


def _same(expected, arg) -> bool:
    value = getattr(expected, "value", expected)  # tl.constexpr
    return type(value) is type(arg) and value == arg if isinstance(arg, (bool, int)) else value == arg


@contextlib.contextmanager
def installed(arch=90, record=True, check=True):
    """Make a :class:`FakeDriver` Triton's active driver inside the block, with compilation
    faked (``JITFunction._do_compile`` makes a :class:`FakeCompiledKernel` and caches it where
    Triton caches compiled kernels).

    On exit the previous driver and compile step come back, and every ``JITFunction`` that
    compiled for a fake device loses its launch cache for it, as does the direct launch path.
    """
    from fused_block.kernels import launch

    fake = FakeDriver(arch, record, check)
    touched = []
    real_do_compile = JITFunction._do_compile

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = FakeCompiledKernel(self.ASTSource(self, signature, constexprs, attrs), fake.target,
                                    options.__dict__)
        self.device_caches[device][0][key] = kernel  # Triton's kernel cache for this device
        touched.append(self)
        fake.compiled.append(kernel)
        return kernel

    previous = _driver_config._active
    launch.clear()
    _driver_config.set_active(fake)
    JITFunction._do_compile = do_compile
    try:
        yield fake
    finally:
        _driver_config._active = previous
        JITFunction._do_compile = real_do_compile
        for fn in touched:
            for device in [d for d in fn.device_caches if isinstance(d, str) and d.startswith("fake")]:
                del fn.device_caches[device]
        launch.clear()


@contextlib.contextmanager
def launcher_branches(arch=90):
    """The library's launchers take their sm_``arch`` branches on CPU tensors (config tables,
    TMA descriptors, persistent GEMM grids), as they would on an H100: ``common.arch`` says
    ``arch``, ``common.sm_count`` 132 and the GEMM's shared-memory limit 227 KB. Nothing is
    timed where ``FUSED_BLOCK_TUNE=0`` (there is no GPU to time on)."""
    from fused_block.kernels import common, matmul

    saved = common.arch, common.sm_count, matmul._smem_limit
    common.arch = lambda device: arch
    common.sm_count = lambda device: 132
    matmul._smem_limit = lambda device: 232448
    try:
        yield
    finally:
        common.arch, common.sm_count, matmul._smem_limit = saved


def run_without_interpreter(argv, cwd, env=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python *argv`` in ``cwd`` with ``TRITON_INTERPRET=0`` (and ``env``'s variables), ``cwd``
    on ``sys.path``: where the shipped kernels are ``JITFunction``s, which :func:`installed`
    can launch. (The test suite and ``python -m bench`` without a GPU run the interpreter,
    whose ``triton.jit`` makes interpreted functions instead.)"""
    env = dict(os.environ, **(env or {}), TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
