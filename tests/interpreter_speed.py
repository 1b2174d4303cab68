"""Two pure overheads of Triton 3.6's interpreter removed for the test suite.

One patch of triton.language per interpreted launch instead of one per device-function call.

Triton 3.6's interpreter maps the language onto numpy by patching ``triton.language`` (its
builtins, ``tensor``, ``math``, ``core``) when a kernel starts, and restores it when the kernel
ends; but every call of a ``@triton.jit`` helper inside the kernel patches it again
(``InterpretedFunction.__call__``), which walks every member of those modules with
``inspect.getmembers``: about a millisecond per helper call, a quarter of the time of an
interpreted model forward here. The repeated patch installs the same wrappers over the same
builder, so this skips it when the running kernel's patch already covers the helper's modules
(a helper that sees a module the kernel did not, such as ``triton.language.core`` imported by
name, is patched as before). Nothing else of the interpreter changes: the kernels run the
same interpreted code.

And ``_get_np_dtype`` (Triton type -> numpy storage type), which builds a dict of twenty types
on each of its calls (tens of thousands per test), remembers its answers: a pure function.
And ``tuple_type`` (the type of every tensor's shape tuple, built for each interpreted op)
writes its name string when first read rather than when built: its equality compares types
and fields, not the name.

And ``tl.reduce`` with a combine function (the LayerNorm forward's ``(sum d, sum d^2)``
pair): the interpreter calls the combine function once per element, on scalars (about half of
the time of an interpreted LayerNorm model); this calls it once per level of a pairwise tree,
on whole arrays: adjacent elements combined, left operand first, so each partial stays a
contiguous run in order and only the associativity that ``tl.reduce`` requires of a combine
function is used (the GPU's reduction is a tree too; the interpreter's is a left fold, so float
sums may differ from its answer in the last bits).

And the interpreter's check of signed and unsigned integer arithmetic for overflow, which
builds the operation again in int64 and compares it with the type's range (a fifth of the time
of an interpreted model's backward), then hands the result to ``device_assert``, which drops
it unless the builder's ``debug`` option is set (the interpreter's never is): skipped where it
would be dropped. Compiling for a GPU runs the check as before.

``tests/test_test_helpers.py`` checks that a helper-heavy kernel gives the same answer with
and without these, and that the tree reduction gives the fold's answer for an exact,
non-commutative combine function.
"""
import numpy as np
import inspect

import triton.language as tl
from triton.language import semantic
from triton.runtime import interpreter

_original_patch_lang = interpreter._patch_lang
_original_grid_call = interpreter.GridExecutor.__call__
_original_np_dtype = interpreter._get_np_dtype
_original_tuple_type_init = tl.core.tuple_type.__init__
_original_generic_reduce = interpreter.ReduceOps.generic_reduce
_original_sanitize_overflow = semantic.TritonSemantic.binary_op_sanitize_overflow_impl
_patched = None  # ids of the language modules the running kernel patched; None outside a kernel
_langs = {}  # function -> ids of the language modules its globals see
_np_dtypes = {}  # Triton type -> numpy type


def _languages(fn) -> set:
    langs = _langs.get(fn)
    if langs is None:
        langs = _langs[fn] = {id(v) for v in fn.__globals__.values()
                              if inspect.ismodule(v) and (v is tl or v is tl.core)}
    return langs


def _get_np_dtype(tt_dtype):
    if isinstance(tt_dtype, tl.block_type):  # a block's storage is its element's (unhashable)
        tt_dtype = tt_dtype.element_ty
    try:
        return _np_dtypes[tt_dtype]
    except KeyError:
        out = _np_dtypes[tt_dtype] = _original_np_dtype(tt_dtype)
        return out
    except TypeError:  # another unhashable type
        return _original_np_dtype(tt_dtype)


def _patch_lang(fn):
    global _patched
    if _patched is None:
        return _original_patch_lang(fn)
    langs = _languages(fn)
    if langs <= _patched:
        return interpreter._LangPatchScope()  # nothing patched, nothing to restore
    scope = _original_patch_lang(fn)
    _patched |= langs
    return scope


def _tuple_type_init(self, types, fields=None):
    self.types = types
    self.fields = fields or [""] * len(types)


def _tuple_type_name(self, attr):
    if attr != "name":
        raise AttributeError(attr)
    self.name = "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"  # as tuple_type's
    return self.name


def _generic_reduce(self, input):
    """``ReduceOps.generic_reduce`` as a pairwise tree over the reduced axis (see the module)."""
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    data = [arg.handle.data for arg in input]
    n = data[0].shape[axis]  # a power of two here (Triton's block shapes); the odd case is kept
    index = [slice(None)] * data[0].ndim

    def part(start, stop, step=1):
        index[axis] = slice(start, stop, step)
        return tuple(index)

    while n > 1:
        even = n - n % 2
        left = [self.to_tensor(d[part(0, even, 2)], t) for d, t in zip(data, dtypes)]
        right = [self.to_tensor(d[part(1, even, 2)], t) for d, t in zip(data, dtypes)]
        out = self.combine_fn.fn(*left, *right)
        out = out if isinstance(out, tuple) else (out,)
        shape = left[0].handle.data.shape
        # each result in its input's storage type, as the fold's assignment into its output stores it
        merged = [np.broadcast_to(o.handle.data if isinstance(o, tl.core.tensor) else tl.core._unwrap_if_constexpr(o),
                                  shape).astype(d.dtype) for o, d in zip(out, data)]
        if n % 2:
            merged = [np.concatenate([m, d[part(n - 1, n)]], axis=axis) for m, d in zip(merged, data)]
        data, n = merged, merged[0].shape[axis]
    ret = []
    for d, t in zip(data, dtypes):
        d = d[part(0, 1)]  # the reduced axis kept, as keep_dims keeps it (axis None: the flattened one)
        if not self.keep_dims:
            d = d.item() if original_axis is None else np.squeeze(d, axis)
        ret.append(self.to_tensor(d, t))
    return ret


def _sanitize_overflow(self, lhs, rhs, binary_op):
    """The overflow check, skipped where ``device_assert`` would drop its condition: the
    interpreter's builder without ``debug`` (see the module)."""
    if isinstance(self.builder, interpreter.InterpreterBuilder) and not self.builder.options.debug:
        return
    _original_sanitize_overflow(self, lhs, rhs, binary_op)


def _grid_call(self, *args, **kwargs):
    global _patched
    outer, _patched = _patched, set()
    try:
        return _original_grid_call(self, *args, **kwargs)
    finally:
        _patched = outer


def install() -> None:
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = _grid_call
    interpreter._get_np_dtype = _get_np_dtype
    tl.core.tuple_type.__init__ = _tuple_type_init
    tl.core.tuple_type.__getattr__ = _tuple_type_name
    interpreter.ReduceOps.generic_reduce = _generic_reduce
    semantic.TritonSemantic.binary_op_sanitize_overflow_impl = _sanitize_overflow


def uninstall() -> None:
    interpreter._patch_lang = _original_patch_lang
    interpreter.GridExecutor.__call__ = _original_grid_call
    interpreter._get_np_dtype = _original_np_dtype
    tl.core.tuple_type.__init__ = _original_tuple_type_init
    interpreter.ReduceOps.generic_reduce = _original_generic_reduce
    semantic.TritonSemantic.binary_op_sanitize_overflow_impl = _original_sanitize_overflow
    if "__getattr__" in vars(tl.core.tuple_type):
        del tl.core.tuple_type.__getattr__
