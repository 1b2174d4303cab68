"""How every op is registered: ``torch.library`` define + impl + fake, autograd outside the op.

Host cost per call, measured on the CPU (torch 2.13, a 4-argument op returning two tensors;
``python -m bench --only host`` re-measures the layers' totals):

- ``torch.library.custom_op``: ~14 us; with ``register_autograd``: ~30 us;
- ``torch.library.define`` + ``impl``, called through the ``OpOverload``: ~5.4 us;
- the same Python function called directly: ~2.6 us (the body's own cost).

So each op is defined with an explicit schema (inferred from the type hints, as ``custom_op``
does), implemented for every backend, given a fake (meta) implementation, and wrapped in a
``torch.autograd.Function`` by the caller. :func:`op` returns a function that calls the
registered ``OpOverload`` while ``torch.compile`` traces (so the graph holds one opaque op
with its fake implementation, and ``fullgraph=True`` works) or ``torch.jit.trace`` records
(the trace holds the op, whose implementation then sees sizes as ints, not traced tensors),
and the Python implementation directly otherwise (eager mode pays neither the dispatcher nor argument parsing). Its
``.default`` attribute is the ``OpOverload``, for ``torch.library.opcheck``.
"""
import torch

_LIB = torch.library.Library("fused_block", "FRAGMENT")  # noqa: TOR901 - ops are defined below


def op(name: str, fake):
    """Register ``fn`` as ``fused_block::<name>`` (no mutated arguments) with ``fake``.

    Use as a decorator: ``@op("add_norm_fwd", fake=_fwd_fake)`` over a function with type hints.
    The returned function dispatches as described in the module docstring.
    """
    def register(fn):
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIB.define(name + schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"fused_block::{name}", fake, lib=_LIB)
        # The ops are differentiated by the autograd Functions around them, never through the
        # dispatcher; a graph that holds the ops themselves (a torch.jit.trace) has no
        # gradients: backward through it raises instead of leaving every .grad None.
        torch.library.register_autograd(f"fused_block::{name}", _no_backward(name), setup_context=_no_context,
                                        lib=_LIB)
        overload = getattr(torch.ops.fused_block, name).default
        is_compiling = torch.compiler.is_compiling
        tracing = torch._C._get_tracing_state

        def call(*args):
            if is_compiling() or tracing():
                return overload(*args)
            return fn(*args)

        call.default = overload
        call.__name__ = call.__qualname__ = name
        call.__doc__ = fn.__doc__
        call.__wrapped__ = fn
        return call

    return register


def _no_context(ctx, inputs, output):
    pass


def _no_backward(name):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"fused_block::{name} has no gradient through the dispatcher: a torch.jit.trace of fused_block's "
            "layers is an inference graph. Train the module itself (or torch.compile it) and trace it for "
            "inference.")
    return backward


def _distinct(args):
    """``args`` with each repeated tensor after its first occurrence replaced by a view of it
    (``attention(q, q, q)``, ``add_rms_norm(x, x)``): Dynamo refuses an ``autograd.Function``
    given the same tensor twice, and autograd sums the view's gradient into the tensor's."""
    seen = set()
    out = list(args)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if id(a) in seen:
                out[i] = a.view_as(a)
            seen.add(id(a))
    return out


def fast_apply(fn_cls):
    """``fn_cls.apply`` (a ``torch.autograd.Function`` without ``setup_context``) minus the
    host cost of torch's Python wrapper around it where that wrapper does nothing.

    ``Function.apply`` checks for functorch transforms, then rebuilds the argument tuple
    through ``unwrap_dead_wrappers`` (a generator over every argument: ~2 us of a ~7 us apply
    on the CPU) before the C++ apply. Here the C++ apply is called directly unless Dynamo
    traces the call (it must see ``fn_cls.apply``), a functorch transform is active, or an
    argument is a functorch wrapper (which ``unwrap_dead_wrappers`` might unwrap): those take
    ``fn_cls.apply`` itself, so the result is the same in every case. Under Dynamo a tensor
    passed twice goes in as itself and a view (:func:`_distinct`).
    """
    if torch.autograd.function._is_setup_context_defined(fn_cls.setup_context):
        raise TypeError(f"{fn_cls.__name__}: fast_apply takes Functions without setup_context")
    c_apply = super(torch.autograd.Function, fn_cls).apply  # the C++ THPFunction_apply, bound to fn_cls
    is_compiling = torch.compiler.is_compiling
    transforms_active = torch._C._are_functorch_transforms_active
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    tensor = torch.Tensor

    def apply(*args):
        if is_compiling():
            return fn_cls.apply(*_distinct(args))
        if transforms_active():
            return fn_cls.apply(*args)
        for a in args:
            if isinstance(a, tensor) and is_wrapped(a):
                return fn_cls.apply(*args)
        return c_apply(*args)

    apply.__name__ = apply.__qualname__ = f"{fn_cls.__name__}_apply"
    return apply
