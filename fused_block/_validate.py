"""Argument checks shared by every public op: clear errors that name the argument.

Everything here runs before any kernel launch, so bad input never reaches Triton.
"""
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


def probability(name, p):
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")


def positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
