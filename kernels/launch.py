"""The direct launch path: the compiled kernel Triton chose, cached per configuration and
argument specialization, launched without Triton's per-call binding.

``kernel[grid](*args, **constexprs)`` (Triton 3.6's ``JITFunction.run``) binds the arguments
to the signature, specializes each one, turns that and the options into a cache key, looks up
the compiled kernel, checks the globals it used and only then calls the compiled kernel's
launcher: several microseconds of Python per launch, growing with the argument count. A
training step launches a few dozen kernels. As inductor's generated launchers do,
:func:`launch` keeps the compiled kernel and calls its launcher itself:

- **What is cached**: per (kernel, config, constexprs, tuple of argument types) a
  :class:`_Layout`: the values of the trailing constexpr parameters (the C launcher takes
  every parameter), a key function generated for those types (as Triton generates its
  binder) and, per key, the ``CompiledKernel`` that Triton's own ``run`` returned for
  arguments with that key (its launcher, handle and packed metadata). A launch finds its
  layout by the identity of its constexpr dict (the launchers keep one per launch), Config
  and kernel; the key function then checks what the layout assumes of the arguments (the
  scalars' exact types; tensors and descriptors by the attributes it reads, the count by its
  unpacking), and arguments of other types take the layout of their own types.
- **The key** is at least as fine as Triton's specialization, so a cached kernel is only ever
  launched with arguments Triton would have launched it with: the current device; the
  arguments' Python types (tensor, host tensor descriptor, int, bool, float, None: the
  layout); each tensor's dtype and the low 4 bits of its address (Triton: 16-byte aligned or
  not); each descriptor's dtype and block shape (Triton's "tensordesc<...>"); each int's value, or,
  once a layout has met ``EXACT_KEYS`` keys (sizes that change every call), its class: the
  low 4 bits, or "equals 1", inside the i32 range, the value outside it (Triton: i32, i64 or
  u64; the constant 1; 16-divisible or not). A tensor that was the same object as an earlier
  argument when the layout was made (the placeholders launchers pass for absent operands) is
  read once while it still is (``is`` tests; another object there takes the full key). The
  key ignores ``do_not_specialize``, which can only make it finer than Triton's. Knobs that change compilation or launch
  (``TRITON_DEBUG``, instrumentation, launch hooks) and a kernel's pre-run hooks send the
  launch to the fallback.
- **The fallback** is Triton's ``kernel[grid](...)`` itself: a first launch with a new key
  (which Triton compiles or finds in its own cache; its result is remembered), and every
  launch the key cannot describe (another argument type, keyword arguments that are not
  constexprs, a callable grid, a hook or debug knob set: counted as "unkeyed" in ``STATS``).
- **The stream** is the driver's current one for the current device at each launch (the
  same calls Triton makes), so ``torch.cuda.stream(...)``, device guards and CUDA graph
  capture behave as with Triton's path.

Not done on the direct path: Triton's check that the module globals a kernel read at compile
time still have their values (a development aid; inductor's launchers skip it too). Disable
the path with ``FUSED_BLOCK_DIRECT_LAUNCH=0``. ``tests/test_direct_launch.py`` compares what
either path launches through a fake CUDA driver (``fused_block.kernels.fake_driver``).
"""
import collections
import os

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

ENABLED = os.environ.get("FUSED_BLOCK_DIRECT_LAUNCH", "1") != "0"
# Launches that took Triton's path: "fallback" (the first of a key, remembered) and "unkeyed"
# (the key cannot describe the call, or a knob or hook sends it to Triton). Tests read it.
STATS = collections.Counter()
# A layout whose exact int values made this many keys switches to int classes (sizes that
# change from call to call, e.g. a growing KV cache, would otherwise make a key per value).
EXACT_KEYS = 16

_CLASSES = "int classes"  # the first element of class keys
_SAME = "same tensors"  # marks keys that read each repeated tensor argument once
_SCALARS = (int, float, bool, type(None))  # with tensors, the argument types keys describe
_OPTIONS = ("num_warps", "num_stages")


class _Layout:
    """Launches of one (kernel, config, constexprs) whose arguments have one tuple of types:
    the keyword arguments (for Triton's path), the values of the trailing constexpr
    parameters, ``key(args, device)`` and the compiled kernels (launcher, handle, packed
    metadata) by key. ``key`` is None where keys cannot describe the call (then Triton's
    launch serves every one)."""

    __slots__ = ("kernel", "kwargs", "tail", "types", "key", "exact", "same", "compiled")

    def __init__(self, kernel, args, constexprs, config):
        self.kernel = kernel  # held: its id() is part of the layout's key
        self.kwargs = {**constexprs, **config.meta(), "num_warps": config.num_warps, "num_stages": config.num_stages}
        self.tail = _tail(kernel, len(args), self.kwargs)
        self.types = tuple(map(type, args))
        keyed = self.tail is not None and all(issubclass(t, torch.Tensor) or t in _SCALARS or t is TensorDescriptor
                                              for t in self.types)
        self.exact = True
        # Tensor arguments that are the same object as an earlier one (a launcher's placeholders
        # for absent operands): the key reads each tensor once while that still holds.
        first, same = {}, []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                j = first.setdefault(id(a), i)
                if j != i:
                    same.append((i, j))
        self.same = tuple(same)
        self.key = _key_function(self.types, exact_ints=True, same=self.same) if keyed else None
        self.compiled = {}

    def remember(self, key, compiled, args, device) -> None:
        """Keep ``compiled`` (Triton's choice for ``args``) under ``key``; past ``EXACT_KEYS``
        exact keys, switch to class keys (the exact ones are forgotten: new lookups refill)."""
        if self.exact and len(self.compiled) >= EXACT_KEYS:
            self.exact = False
            self.key = _key_function(self.types, exact_ints=False, same=self.same)
            self.compiled.clear()
            key = self.key(args, device)
        self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)


def _key_function(types, exact_ints: bool, same=()):
    """``key(args, device)``, generated for these argument types (as Triton's binder is): the
    device, each tensor's dtype and the low 4 bits of its address, each host-side tensor
    descriptor's dtype and block shape (Triton's "tensordesc<dtype[block]>": its base is
    16-byte aligned by construction), and each int's value (``exact_ints``) or class: its low
    4 bits, or 16 if it equals 1, within i32 range (the value itself outside it). Floats, bools
    and None add nothing: their types decide.

    ``same``: (i, j) pairs of tensor positions that held one object when the layout was made;
    while ``args[i] is args[j]`` for all of them, the key reads only the first of each (its
    ``_SAME`` form), otherwise every tensor (the full form): either describes the
    specialization exactly, the forms never equal each other.

    The key is for arguments of these types (the layout is found by the launch's constexpr dict,
    Config and kernel, not by the types): the scalars' exact types are checked (None is returned
    for others: ``True == 1 == 1.0``), a tensor's and a descriptor's by the attributes read
    (another object raises AttributeError, another argument count ValueError); a tensor
    subclass is keyed as a tensor, as Triton specializes it."""
    names = [f"a{i}" for i in range(len(types))]
    tensors = [n for n, t in zip(names, types) if issubclass(t, torch.Tensor)]
    descs = [n for n, t in zip(names, types) if t is TensorDescriptor]
    ints = [n for n, t in zip(names, types) if t is int]
    if exact_ints:
        int_keys = ints
    else:
        int_keys = [f"(({n} & 15 if {n} != 1 else 16) if -2147483648 <= {n} <= 2147483647 else {n})" for n in ints]
    lead = [] if exact_ints else ["_CLASSES"]  # class keys never equal exact ones (16: the value or "equals 1")
    rest = [*(f"{n}.base.dtype, tuple({n}.block_shape)" for n in descs), *int_keys]

    def form(ts, marker):
        return "(" + ", ".join([*lead, *marker, "device", *(f"{n}.dtype" for n in ts),
                                *(f"{n}.data_ptr() & 15" for n in ts), *rest]) + ",)"

    unpack = f"    {', '.join(names)}, = args\n" if names else ""
    scalars = [n for n, t in zip(names, types) if t in _SCALARS]
    if scalars:
        unpack += f"    if ({', '.join(f'_type({n})' for n in scalars)},) != _SCALAR_TYPES:\n        return None\n"
    full = form(tensors, [])
    if same:
        dropped = {f"a{i}" for i, _ in same}
        test = " and ".join(f"a{i} is a{j}" for i, j in same)
        fast = form([n for n in tensors if n not in dropped], ["_SAME"])
        body = f"    if {test}:\n        return {fast}\n    return {full}\n"
    else:
        body = f"    return {full}\n"
    src = f"def key(args, device, _type=type):\n{unpack}{body}"
    scope = {"_CLASSES": _CLASSES, "_SAME": _SAME, "_SCALAR_TYPES": tuple(t for t in types if t in _SCALARS)}
    exec(src, scope)  # noqa: S102 - generated from argument positions only
    return scope["key"]


def _tail(kernel, nargs, kwargs):
    """The values of the parameters after the ``nargs`` positional ones, in order, when all
    of them are constexprs given by keyword or default and every keyword names a parameter
    or an option; otherwise None."""
    params = getattr(kernel, "params", None)
    if params is None or nargs > len(params) or any(p.is_constexpr for p in params[:nargs]):
        return None
    names = {p.name for p in params}
    if any(k not in names and k not in _OPTIONS for k in kwargs):
        return None
    tail = []
    for p in params[nargs:]:
        if not p.is_constexpr or not (p.name in kwargs or p.has_default):
            return None
        tail.append(kwargs[p.name] if p.name in kwargs else p.default)
    return tuple(tail)


_LAYOUTS = {}


def clear() -> None:
    """Forget every layout (Triton's own cache keeps the compiled kernels)."""
    _LAYOUTS.clear()
    _BY_IDENTITY.clear()


# id(constexprs) -> (constexprs, config, kernel, layout): the launchers pass the same constexpr
# dict and Config objects for the same launch (cached per key), so the layout is found by
# identity, without hashing their contents or the argument types (the layout's key function
# checks those it must: :func:`_key_function`); a launch whose dict, Config or kernel differ
# from the entry's, or whose arguments the layout's key cannot take, takes the slower lookup
# (:func:`_layout`, by the argument types) and replaces the entry. The entry holds the dict,
# Config and kernel, so their ids cannot be reused while it lives; bounded.
_BY_IDENTITY = {}
_MAX_BY_IDENTITY = 4096


def launch(kernel, grid, args: tuple, constexprs: dict, config) -> None:
    """``kernel[grid](*args, **constexprs, **config)`` on the current device and stream:
    directly once Triton's own launch has chosen the compiled kernel for this key."""
    hit = _BY_IDENTITY.get(id(constexprs))
    if hit is not None and hit[0] is constexprs and hit[1] is config and hit[2] is kernel:
        lay = hit[3]
    else:
        lay = _layout(kernel, args, constexprs, config)
    rt = knobs.runtime
    if (type(grid) is not tuple or rt.debug or knobs.compilation.instrumentation_mode
            or rt.launch_enter_hook.calls or rt.launch_exit_hook.calls or kernel.pre_run_hooks):
        STATS["unkeyed"] += 1
        kernel[grid](*args, **lay.kwargs)
        return
    drv = driver._active or driver.active  # the property's value, without the property call
    device = drv.get_current_device()
    try:
        key = lay.key(args, device) if lay.key is not None else None
    except (ValueError, AttributeError, TypeError):  # another argument structure than the layout's
        key = None
    if key is None:
        lay = _layout(kernel, args, constexprs, config)  # the layout of these argument types
        if lay.key is None:  # calls keys cannot describe
            STATS["unkeyed"] += 1
            kernel[grid](*args, **lay.kwargs)
            return
        key = lay.key(args, device)
    hit = lay.compiled.get(key)
    if hit is None:
        STATS["fallback"] += 1
        compiled = kernel[grid](*args, **lay.kwargs)
        if compiled is not None and not hasattr(compiled, "result"):  # not an async compile's future
            lay.remember(key, compiled, args, device)
        return
    run, function, packed = hit
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(device), function,
        packed, None, None, None, *args, *lay.tail)


def _layout(kernel, args, constexprs, config):
    """The layout of these argument types (made on first use), remembered by identity."""
    lay = _LAYOUTS.get((id(kernel), config.kwargs, config.num_warps, config.num_stages, tuple(constexprs),
                        tuple(constexprs.values()), tuple(map(type, args))))
    if lay is None:
        lay = _new_layout(kernel, args, constexprs, config)
    if len(_BY_IDENTITY) >= _MAX_BY_IDENTITY:
        _BY_IDENTITY.clear()
    _BY_IDENTITY[id(constexprs)] = (constexprs, config, kernel, lay)
    return lay


def _new_layout(kernel, args, constexprs, config):
    lay = _LAYOUTS[(id(kernel), config.kwargs, config.num_warps, config.num_stages, tuple(constexprs),
                    tuple(constexprs.values()), tuple(map(type, args)))] = _Layout(kernel, args, constexprs, config)
    return lay
