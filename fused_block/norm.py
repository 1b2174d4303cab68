"""Fused residual add + dropout + LayerNorm/RMSNorm: torch.library ops, autograd, modules.

``add_layer_norm`` / ``add_rms_norm`` return ``(out, residual_out)``: the Pre-LN block passes
``residual_out`` (the residual stream) on to the next block, so the add fuses into the norm.
"""
import math

import torch
from torch import Tensor

from fused_block import _backend, _validate, reference
from fused_block.kernels import norm as _k

MAX_HIDDEN = _k.MAX_HIDDEN


# ---------------------------------------------------------------------------------------------
# torch.library ops on 2-D (rows, hidden) tensors
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("fused_block::add_norm_fwd", mutates_args=())
def _add_norm_fwd(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
                  seed: Tensor, eps: float, dropout_p: float, is_rms: bool,
                  residual_dtype: torch.dtype, store_residual: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with _backend.device_guard(x):
        return _k.add_norm_fwd(x, residual, weight, bias, seed, eps, dropout_p, is_rms,
                               residual_dtype, store_residual)


@_add_norm_fwd.register_fake
def _(x, residual, weight, bias, seed, eps, dropout_p, is_rms, residual_dtype, store_residual):
    M, N = x.shape
    return (x.new_empty((M, N)), x.new_empty((M, N) if store_residual else (0,), dtype=residual_dtype),
            x.new_empty((0,) if is_rms else (M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32))


@torch.library.custom_op("fused_block::add_norm_bwd", mutates_args=())
def _add_norm_bwd(dout: Tensor, dresidual_out: Tensor | None, h: Tensor, weight: Tensor | None,
                  has_bias: bool, mean: Tensor, rstd: Tensor, seed: Tensor, dropout_p: float,
                  is_rms: bool, x_dtype: torch.dtype, residual_dtype: torch.dtype,
                  store_dresidual: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with _backend.device_guard(h):
        return _k.add_norm_bwd(dout, dresidual_out, h, weight, has_bias, mean, rstd, seed, dropout_p,
                               is_rms, x_dtype, residual_dtype, store_dresidual)


@_add_norm_bwd.register_fake
def _(dout, dresidual_out, h, weight, has_bias, mean, rstd, seed, dropout_p, is_rms, x_dtype,
      residual_dtype, store_dresidual):
    M, N = h.shape
    return (h.new_empty((M, N), dtype=x_dtype),
            h.new_empty((M, N) if store_dresidual else (0,), dtype=residual_dtype),
            h.new_empty((N,) if weight is not None else (0,), dtype=torch.float32),
            h.new_empty((N,) if has_bias else (0,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, seed, eps, dropout_p, is_rms, residual_dtype, store_residual = inputs
    _, rout, mean, rstd = output
    ctx.save_for_backward(rout if store_residual else x, weight, mean, rstd, seed)
    ctx.has_residual = residual is not None
    ctx.has_bias = bias is not None
    ctx.dropout_p, ctx.is_rms = dropout_p, is_rms
    ctx.x_dtype, ctx.residual_dtype, ctx.store_residual = x.dtype, residual_dtype, store_residual
    ctx.weight_dtype = None if weight is None else weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dout, drout, dmean, drstd):
    h, weight, mean, rstd, seed = ctx.saved_tensors
    # dresidual equals the gradient reaching residual_out; store it separately only when it
    # cannot share dx's buffer (dropout between them, or different dtypes).
    separate = ctx.has_residual and (ctx.dropout_p > 0 or ctx.residual_dtype != ctx.x_dtype)
    dx, dres, dw, db = _add_norm_bwd(
        dout.contiguous(), drout.contiguous() if ctx.store_residual and drout is not None else None,
        h, weight, ctx.has_bias, mean, rstd, seed, ctx.dropout_p, ctx.is_rms, ctx.x_dtype,
        ctx.residual_dtype, separate)
    dresidual = (dres if separate else dx) if ctx.has_residual else None
    dweight = dw.to(ctx.weight_dtype) if weight is not None else None
    dbias = db.to(ctx.bias_dtype) if ctx.has_bias else None
    return dx, dresidual, dweight, dbias, None, None, None, None, None, None


_add_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------

def _check(x, residual, weight, bias, eps, dropout_p, residual_in_fp32):
    _validate.tensor("x", x, min_ndim=1)
    _validate.tensor("residual", residual, optional=True)
    _validate.tensor("weight", weight, optional=True)
    _validate.tensor("bias", bias, optional=True)
    N = x.shape[-1]
    if N == 0 or N > MAX_HIDDEN:
        raise ValueError(f"x: hidden size (last dim) must be in [1, {MAX_HIDDEN}], got {N}")
    _validate.same_device("x", x, residual=residual, weight=weight, bias=bias)
    _validate.shape("residual", residual, x.shape)
    _validate.shape("weight", weight, (N,))
    _validate.shape("bias", bias, (N,))
    _validate.positive("eps", eps)
    _validate.probability("dropout_p", dropout_p)
    if not isinstance(residual_in_fp32, bool):
        raise TypeError(f"residual_in_fp32 must be a bool, got {type(residual_in_fp32).__name__}")


def _rows(t):
    """(rows, hidden) view (copy only when the leading dims cannot be flattened), unit last stride."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _add_norm(x, residual, weight, bias, eps, dropout_p, residual_in_fp32, is_rms):
    if residual is not None:
        residual_dtype = residual.dtype
    else:
        residual_dtype = torch.float32 if residual_in_fp32 else x.dtype
    # Without a residual, dropout or dtype change, residual_out is x itself: nothing to store.
    store_residual = residual is not None or dropout_p > 0 or residual_dtype != x.dtype
    seed = _backend.dropout_seed(dropout_p, x.device)
    out, rout, _, _ = _add_norm_fwd(_rows(x), None if residual is None else _rows(residual), weight, bias,
                                    seed, float(eps), float(dropout_p), is_rms, residual_dtype, store_residual)
    return out.view(x.shape), (rout.view(x.shape) if store_residual else x)


def add_layer_norm(x: Tensor, residual: Tensor | None = None, weight: Tensor | None = None,
                   bias: Tensor | None = None, eps: float = 1e-5, dropout_p: float = 0.0,
                   residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """``residual_out = dropout(x) + residual``; ``out = layer_norm(residual_out) * weight + bias``.

    Args:
        x: (..., N) fp32/fp16/bf16, any strides; N in [1, 65536].
        residual: same shape as x, any float dtype, or None (then residual_out = dropout(x)).
        weight, bias: (N,) or None; may be fp32 while x is fp16/bf16 (autocast).
        eps: added to the variance. dropout_p: dropout on x before the add, in [0, 1).
        residual_in_fp32: with residual None, keep residual_out in fp32.
    Returns:
        ``(out, residual_out)``: out in x's dtype; residual_out in residual's dtype (fp32 when
        ``residual_in_fp32``, else x's). ``out`` normalizes residual_out as stored.
        Backward saves residual_out (or x) and the fp32 mean and rstd; the dropout mask is
        regenerated from its seed.
    """
    _check(x, residual, weight, bias, eps, dropout_p, residual_in_fp32)
    if not _backend.use_triton(x):
        return reference.add_layer_norm(x, residual, weight, bias, eps, dropout_p, residual_in_fp32)
    return _add_norm(x, residual, weight, bias, eps, dropout_p, residual_in_fp32, is_rms=False)


def add_rms_norm(x: Tensor, residual: Tensor | None = None, weight: Tensor | None = None,
                 eps: float | None = None, dropout_p: float = 0.0,
                 residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """As :func:`add_layer_norm` with RMSNorm: ``out = residual_out * rsqrt(mean(residual_out^2) + eps) * weight``.

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as ``torch.nn.RMSNorm``.
    """
    if eps is None and isinstance(x, Tensor) and x.is_floating_point():
        eps = torch.finfo(x.dtype).eps
    _check(x, residual, weight, None, eps, dropout_p, residual_in_fp32)
    if not _backend.use_triton(x):
        return reference.add_rms_norm(x, residual, weight, eps, dropout_p, residual_in_fp32)
    return _add_norm(x, residual, weight, None, eps, dropout_p, residual_in_fp32, is_rms=True)


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------

def _flatten_normalized(module, x, residual):
    """Flatten the normalized dims (LayerNorm's normalized_shape may span several) into one."""
    shape = tuple(module.normalized_shape)
    if x.shape[x.dim() - len(shape):] != shape:
        raise ValueError(f"x: expected trailing dims {shape}, got shape {tuple(x.shape)}")
    if len(shape) == 1:
        return x, residual, module.weight, getattr(module, "bias", None)
    lead = x.shape[:x.dim() - len(shape)]
    n = math.prod(shape)
    flat = lambda t: None if t is None else t.reshape(*lead, n)  # noqa: E731
    w = None if module.weight is None else module.weight.reshape(n)
    b = getattr(module, "bias", None)
    return flat(x), flat(residual), w, None if b is None else b.reshape(n)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` on the fused kernel; same constructor, defaults and state dict.

    ``forward(x)`` returns the normalized tensor; ``forward(x, residual)`` returns
    ``(out, residual_out)`` with ``residual_out = x + residual``.
    """

    def forward(self, x: Tensor, residual: Tensor | None = None):
        xf, rf, w, b = _flatten_normalized(self, x, residual)
        out, rout = add_layer_norm(xf, rf, w, b, self.eps)
        if residual is None:
            return out.view(x.shape)
        return out.view(x.shape), rout.view(x.shape)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` on the fused kernel; same constructor, defaults and state dict.

    ``forward(x)`` returns the normalized tensor; ``forward(x, residual)`` returns
    ``(out, residual_out)`` with ``residual_out = x + residual``.
    """

    def forward(self, x: Tensor, residual: Tensor | None = None):
        xf, rf, w, _ = _flatten_normalized(self, x, residual)
        out, rout = add_rms_norm(xf, rf, w, self.eps)
        if residual is None:
            return out.view(x.shape)
        return out.view(x.shape), rout.view(x.shape)
