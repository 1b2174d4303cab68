"""Argument checks shared by every public op: clear errors that name the argument.

Everything here runs before any kernel launch, so bad input never reaches Triton.
"""
import math
import sys

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tensor(name, t, *, dtypes=FLOAT_DTYPES, ndim=None, min_ndim=None, optional=False):
    """Check that ``t`` is a tensor of one of ``dtypes`` and the given rank."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")


def same_device(ref_name, ref, **others):
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def shape(name, t, expected):
    # torch.Size equals a tuple of the same sizes: the common (matching) case builds no tuples.
    if t is not None and t.shape != expected and tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def type_name(value) -> str:
    """The type of ``value`` for an error message: builtins by name (``float``), others with their
    module (``numpy.bool``, ``numpy.float32``, ``torch.Tensor``), so that numpy's ``bool`` does not
    read as Python's."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _from_numpy(value, integer_only):
    """A numpy integer (and, unless ``integer_only``, floating) scalar as the Python int (float)
    torch's argument parser reads from it; None for anything else (numpy's bool included). No
    numpy scalar exists while numpy is not imported: it is never imported here."""
    np = sys.modules.get("numpy")
    if np is None:
        return None
    if isinstance(value, np.integer):
        return int(value)
    if not integer_only and isinstance(value, np.floating):
        return float(value)
    return None


def scalar(value):
    """``value`` with numpy's integer, floating and bool scalars made Python ints, floats and
    bools; anything else as given. For the constructor arguments the layers hand to torch's
    (which takes numpy's scalars and checks them itself), kept as Python's: the kernels, their
    caches and compiled graphs then never see a numpy scalar."""
    t = type(value)
    if t is float or t is int or t is bool or t.__module__ != "numpy":
        return value
    n = _from_numpy(value, False)
    if n is None and isinstance(value, sys.modules["numpy"].bool_):
        return bool(value)
    return value if n is None else n


def _python(name, value, integer_only, what):
    """``value`` as a Python int (or float unless ``integer_only``): Python's (subclasses
    converted) and numpy's scalars; bools and anything else raise TypeError naming ``name``."""
    t = type(value)
    if t is int or (t is float and not integer_only):
        return value
    if isinstance(value, int) and t is not bool:
        return int(value)
    if isinstance(value, float) and not integer_only:
        return float(value)
    n = _from_numpy(value, integer_only)
    if n is None:
        raise TypeError(f"{name} must be {what}, got {type_name(value)}")
    return n


def number(name, value, what="a number"):
    """``value`` as a Python int or float: ints and floats (subclasses such as ``numpy.float64``
    converted), and numpy integer and floating scalars, as torch's ops take them for a float
    argument. Bools (Python's and numpy's) raise TypeError naming ``name``: a flag is no number."""
    return _python(name, value, False, what)


def integer(name, value):
    """``value`` as a Python int: ints (subclasses converted) and numpy integer scalars, as torch's
    ops take them for an int argument; floats and bools raise TypeError naming ``name``."""
    return _python(name, value, True, "an int")


def probability(name, p):
    """``p`` (see :func:`number`) in [0, 1], as a Python number (a dropout probability: 1 drops
    everything, as torch's dropouts take it)."""
    if type(p) is not float:
        p = number(name, p, "a float")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    return p


def finite(value):
    """``math.isfinite(value)`` for a Python number, written as comparisons: Dynamo under
    ``torch.compile(dynamic=True)`` cannot trace ``math.isfinite`` even of a constant (a graph
    break; an error with ``fullgraph=True``), and folds these."""
    return -math.inf < value < math.inf


def positive(name, value):
    """``value`` (see :func:`number`) > 0, as a Python number."""
    if type(value) is not float:
        value = number(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def non_negative(name, value):
    """``value`` (see :func:`number`) >= 0 (not NaN), as a Python number: a norm's eps, which torch
    takes down to 0."""
    if type(value) is not float:
        value = number(name, value)
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
