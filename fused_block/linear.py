"""Linear layers with fused epilogues: ``linear`` (GEMM + bias + activation + residual) and ``mlp``.

Shapes: x (..., K); weight (N, K) in ``torch.nn.Linear`` layout; bias (N,); residual (..., N).
x, weight and bias share one dtype (fp32, fp16 or bf16); the residual may be wider (the output
then has the promoted dtype, as ``residual + F.linear(...)`` would), e.g. an fp32 residual
stream under autocast.

Precision: fp32 accumulation everywhere. fp32 inputs run the products in TF32 on the GPU
(10-bit mantissa, relative error about 1e-3 of the dot products' magnitude, like torch with
``torch.backends.cuda.matmul.allow_tf32 = True``); the CPU interpreter computes them in IEEE fp32.

Saved for backward (only what ``ctx.needs_input_grad`` asks for): the inputs the gradient
formulas read, and the pre-activation ``x @ W.T + b`` (in x's dtype) when there is an
activation; the public functions store it only when a gradient will be needed, and the
backward recomputes it if it was not stored. ``mlp`` writes the hidden activation once (the
second GEMM reads it; its weight gradient reuses it) and the pre-activation only for backward.

Backward of ``mlp`` (Triton GEMMs): dB2 from deterministic column sums of dY; dW2 = dY^T H;
dPre = (dY @ W2) * act'(pre) in the GEMM's epilogue, which also emits dB1's partial sums;
dW1 = dPre^T X; dX = dPre @ W1. Incoming gradients are never written to.

Dropout is fused into the epilogues: ``mlp``'s ``dropout_p`` on the hidden activation (the
first GEMM's epilogue, after the activation), ``output_dropout_p`` on the second GEMM's output
before the residual add; ``linear``'s ``dropout_p`` after the activation, before the residual.
Each dropout draws one int64 seed from torch's generator (``_backend.dropout_seed``; for
``mlp`` the hidden one first), saved for backward; the masks are never stored but regenerated
from the seeds: the output dropout's gradient ``dY * keep / (1 - p)`` (with dB2's partial sums)
is one elementwise pass, the hidden dropout's mask rides in the DGELU epilogue, and the stored
hidden activation (read by dW2) is the dropped one.
"""
from typing import Optional

import torch
from torch import Tensor

from fused_block import _backend, _validate, reference
from fused_block.kernels import matmul as _k

ACTIVATIONS = reference.ACTIVATIONS


def _act(name: str):
    """Op-schema activation string ("none" for None) to the kernels' name."""
    return None if name == "none" else name


def _empty_like_none(x: Tensor) -> Tensor:
    return x.new_empty(0)


# ---------------------------------------------------------------------------------------------
# torch.library ops: forward ops with autograd, and the backward's building blocks
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("fused_block::linear_fwd", mutates_args=())
def _linear_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                activation: str, save_pre: bool, seed: Tensor, dropout_p: float) -> tuple[Tensor, Tensor]:
    """x (M, K), weight (N, K) -> (out (M, N), pre (M, N) or empty). seed: int64 (1,) when
    ``dropout_p > 0`` (else unused, may be empty)."""
    store = save_pre and activation != "none"
    out_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out, pre = _k.matmul(x, weight.t(), bias, _act(activation), residual, store_pre=store,
                         out_dtype=out_dtype, dropout_p=dropout_p, seed=seed)
    return out, (pre if pre is not None else _empty_like_none(x))


@_linear_fwd.register_fake
def _(x, weight, bias, residual, activation, save_pre, seed, dropout_p):
    out_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out = x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)
    pre = x.new_empty((x.shape[0], weight.shape[0])) if save_pre and activation != "none" else x.new_empty(0)
    return out, pre


@torch.library.custom_op("fused_block::mlp_fwd", mutates_args=())
def _mlp_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
             residual: Optional[Tensor], activation: str, save_pre: bool, seed: Tensor,
             dropout_p: float, output_seed: Tensor,
             output_dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, D), w1 (F, D), w2 (D', F) -> (out (M, D'), pre (M, F) or empty, hidden (M, F)).

    hidden is dropout(act(pre)) with ``seed``; out = dropout(hidden @ w2.T + b2) with
    ``output_seed``, + residual."""
    store = save_pre and activation != "none"
    h, pre = _k.matmul(x, w1.t(), b1, _act(activation), None, store_pre=store,
                       dropout_p=dropout_p, seed=seed)
    out_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out, _ = _k.matmul(h, w2.t(), b2, None, residual, out_dtype=out_dtype,
                       dropout_p=output_dropout_p, seed=output_seed)
    return out, (pre if pre is not None else _empty_like_none(x)), h


@_mlp_fwd.register_fake
def _(x, w1, b1, w2, b2, residual, activation, save_pre, seed, dropout_p, output_seed, output_dropout_p):
    M, F = x.shape[0], w1.shape[0]
    out_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out = x.new_empty((M, w2.shape[0]), dtype=out_dtype)
    pre = x.new_empty((M, F)) if save_pre and activation != "none" else x.new_empty(0)
    return out, pre, x.new_empty((M, F))


@torch.library.custom_op("fused_block::matmul", mutates_args=())
def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) @ b (K, N), any strides (transposed views need no copy)."""
    return _k.matmul(a, b)[0]


@_matmul.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("fused_block::matmul_act_grad", mutates_args=())
def _matmul_act_grad(a: Tensor, b: Tensor, pre: Tensor, activation: str, want_dbias: bool,
                     seed: Tensor, dropout_p: float) -> tuple[Tensor, Tensor]:
    """dPre = (a @ b) * keep / (1 - p) * act'(pre) and its column sums (empty unless
    ``want_dbias``); the keep factor only when ``dropout_p > 0``."""
    dpre, db = _k.matmul_act_grad(a, b, pre, _act(activation), dbias=want_dbias,
                                  dropout_p=dropout_p, seed=seed)
    return dpre, (db if db is not None else _empty_like_none(a))


@_matmul_act_grad.register_fake
def _(a, b, pre, activation, want_dbias, seed, dropout_p):
    n = b.shape[1]
    return a.new_empty((a.shape[0], n)), (a.new_empty(n) if want_dbias else a.new_empty(0))


@torch.library.custom_op("fused_block::act_grad", mutates_args=())
def _act_grad(g: Tensor, pre: Tensor, activation: str, want_dbias: bool, seed: Tensor,
              dropout_p: float) -> tuple[Tensor, Tensor]:
    """dPre = g * keep / (1 - p) * act'(pre) (elementwise) and its column sums (empty unless
    ``want_dbias``); the keep factor only when ``dropout_p > 0``."""
    dpre, db = _k.act_grad(g, pre, _act(activation), dbias=want_dbias, dropout_p=dropout_p, seed=seed)
    return dpre, (db if db is not None else _empty_like_none(g))


@_act_grad.register_fake
def _(g, pre, activation, want_dbias, seed, dropout_p):
    return g.new_empty(g.shape), (g.new_empty(g.shape[1]) if want_dbias else g.new_empty(0))


@torch.library.custom_op("fused_block::bias_grad", mutates_args=())
def _bias_grad(g: Tensor) -> Tensor:
    """Column sums of g (M, N), reduced deterministically in fp32."""
    return _k.bias_grad(g)


@_bias_grad.register_fake
def _(g):
    return g.new_empty(g.shape[1])


def _none_if_empty(t):
    return t if t is not None and t.numel() > 0 else None


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, residual, activation, save_pre, seed, dropout_p = inputs
    _, pre = output
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    has_act = activation != "none"
    need_pre = has_act and (need_x or need_w or need_b)
    recompute = need_pre and pre.numel() == 0
    ctx.activation = activation
    ctx.x_dtype = x.dtype
    ctx.dropout_p = dropout_p
    ctx.save_for_backward(
        x if need_w or recompute else None,
        weight if need_x or recompute else None,
        bias if recompute else None,
        pre if need_pre and not recompute else None,
        seed if dropout_p > 0 and (need_x or need_w or need_b) else None,
    )
    ctx.recompute = recompute


def _linear_backward(ctx, dout, _dpre):
    x, weight, bias, pre, seed = ctx.saved_tensors
    need_x, need_w, need_b, need_r = ctx.needs_input_grad[:4]
    dres = dout if need_r else None
    g = dout if dout.dtype == ctx.x_dtype else dout.to(ctx.x_dtype)  # residual promoted out
    dx = dw = db = None
    if need_x or need_w or need_b:
        if ctx.activation != "none" or ctx.dropout_p > 0:
            # One elementwise pass: dropout's regenerated mask, act'(pre), dB's partial sums.
            if ctx.recompute:
                pre = _linear_fwd(x, weight, bias, None, "none", False, _no_seed(x), 0.0)[0]
            if seed is None:
                seed = _no_seed(g)
            g, db = _act_grad(g, pre if pre is not None else g, ctx.activation, need_b, seed,
                              ctx.dropout_p)
            db = db if need_b else None
        elif need_b:
            db = _bias_grad(g)
        if need_x:
            dx = _matmul(g, weight)
        if need_w:
            dw = _matmul(g.t(), x)
    return dx, dw, db, dres, None, None, None, None


_linear_fwd.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def _mlp_setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2, residual, activation, save_pre, seed, dropout_p, output_seed, output_dropout_p = inputs
    _, pre, h = output
    need_x, need_w1, need_b1, need_w2 = ctx.needs_input_grad[:4]
    need_hidden = need_x or need_w1 or need_b1  # the gradient through the second GEMM
    need_pre = need_hidden and activation != "none"
    recompute = need_pre and pre.numel() == 0
    need_b2 = ctx.needs_input_grad[4]
    need_g = need_hidden or need_w2 or need_b2  # anything through the second GEMM's output
    ctx.activation = activation
    ctx.x_dtype = x.dtype
    ctx.dropout_p, ctx.output_dropout_p = dropout_p, output_dropout_p
    ctx.save_for_backward(
        x if need_w1 or recompute else None,
        w1 if need_x or recompute else None,
        b1 if recompute else None,
        w2 if need_hidden else None,
        pre if need_pre and not recompute else None,
        h if need_w2 else None,
        seed if dropout_p > 0 and need_hidden else None,
        output_seed if output_dropout_p > 0 and need_g else None,
    )
    ctx.recompute = recompute


def _no_seed(t):
    return t.new_empty(0, dtype=torch.int64)


def _mlp_backward(ctx, dout, _dpre, _dh):
    x, w1, b1, w2, pre, h, seed, output_seed = ctx.saved_tensors
    need_x, need_w1, need_b1, need_w2, need_b2, need_r = ctx.needs_input_grad[:6]
    dres = dout if need_r else None
    g = dout if dout.dtype == ctx.x_dtype else dout.to(ctx.x_dtype)
    dx = dw1 = db1 = dw2 = db2 = None
    if output_seed is not None:
        # Through the output dropout: g * keep / (1 - p) and dB2's partial sums in one pass.
        g, db2 = _act_grad(g, g, "none", need_b2, output_seed, ctx.output_dropout_p)
        db2 = db2 if need_b2 else None
    elif need_b2:
        db2 = _bias_grad(g)
    if need_w2:
        dw2 = _matmul(g.t(), h)
    if need_x or need_w1 or need_b1:
        if ctx.recompute:
            pre = _linear_fwd(x, w1, b1, None, "none", False, _no_seed(x), 0.0)[0]
        if pre is None:  # no activation: act' = 1 and pre is not read
            pre = g.new_empty((g.shape[0], w2.shape[1]))
        dpre, db1 = _matmul_act_grad(g, w2, pre, ctx.activation, need_b1,
                                     seed if seed is not None else _no_seed(g), ctx.dropout_p)
        db1 = db1 if need_b1 else None
        if need_w1:
            dw1 = _matmul(dpre.t(), x)
        if need_x:
            dx = _matmul(dpre, w1)
    return dx, dw1, db1, dw2, db2, dres, None, None, None, None, None, None


_mlp_fwd.register_autograd(_mlp_backward, setup_context=_mlp_setup_context)


# ---------------------------------------------------------------------------------------------
# validation, autocast, public functions
# ---------------------------------------------------------------------------------------------

def _check_activation(activation):
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be None or a str, got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_layer(x_name, x, w_name, weight, b_name, bias):
    """weight (N, K) matches x (..., K) in dtype, device and K; bias is (N,)."""
    _validate.tensor(w_name, weight, ndim=2)
    _validate.tensor(b_name, bias, ndim=1, optional=True)
    _validate.same_device(x_name, x, **{w_name: weight, b_name: bias})
    for name, t in ((w_name, weight), (b_name, bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {x_name} has dtype {x.dtype}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{w_name} has in_features {weight.shape[1]} (shape {tuple(weight.shape)}) "
                         f"but {x_name}.shape[-1] is {x.shape[-1]}")
    _validate.shape(b_name, bias, (weight.shape[0],))


def _check_residual(x, residual, n):
    _validate.tensor("residual", residual, optional=True)
    _validate.same_device("x", x, residual=residual)
    _validate.shape("residual", residual, (*x.shape[:-1], n))


def _autocast(x, *tensors):
    """Under autocast, cast x and the layer's parameters as ``F.linear`` would (not the residual)."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in (x, *tensors))


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
           residual: Optional[Tensor] = None, dropout_p: float = 0.0) -> Tensor:
    """``dropout(act(x @ weight.T + bias)) + residual`` in one GEMM with a fused epilogue.

    x (..., K); weight (N, K); bias (N,) or None; activation None, "gelu" (erf), "gelu_tanh" or
    "relu"; residual (..., N) or None, added after the activation and the dropout; dropout_p in
    [0, 1) (always applied when > 0: pass 0 in eval). Returns (..., N) in x's dtype (promoted
    with residual's). Under autocast x, weight and bias are cast like F.linear.
    """
    _validate.tensor("x", x, min_ndim=1)
    _check_activation(activation)
    _validate.probability("dropout_p", dropout_p)
    x, weight, bias = _autocast(x, weight, bias)
    _check_layer("x", x, "weight", weight, "bias", bias)
    n = weight.shape[0]
    _check_residual(x, residual, n)
    if not _backend.use_triton(x):
        return reference.linear(x, weight, bias, activation, residual, dropout_p)
    lead = x.shape[:-1]
    save_pre = activation is not None and _needs_grad(x, weight, bias)
    seed = _backend.dropout_seed(dropout_p, x.device)
    out, _ = _linear_fwd(x.reshape(-1, x.shape[-1]), weight, bias,
                         None if residual is None else residual.reshape(-1, n),
                         activation or "none", save_pre, seed, float(dropout_p))
    return out.reshape(*lead, n)


def mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        activation: Optional[str] = "gelu", residual: Optional[Tensor] = None, dropout_p: float = 0.0,
        output_dropout_p: float = 0.0) -> Tensor:
    """``dropout2(linear2(dropout(act(linear1(x))))) + residual``: two GEMMs, bias + activation
    + dropout in the first's epilogue, bias + dropout + residual in the second's.

    x (..., D); w1 (F, D); b1 (F,) or None; w2 (D', F); b2 (D',) or None; residual (..., D').
    dropout_p: on the hidden activation (torch's ``dropout`` in ``_ff_block``);
    output_dropout_p: on the second GEMM's output before the residual add (torch's
    ``dropout2``); both in [0, 1), always applied when > 0 (pass 0 in eval). The hidden
    activation is rounded to x's dtype, as in eager PyTorch. Returns (..., D').
    """
    _validate.tensor("x", x, min_ndim=1)
    _check_activation(activation)
    _validate.probability("dropout_p", dropout_p)
    _validate.probability("output_dropout_p", output_dropout_p)
    x, w1, b1, w2, b2 = _autocast(x, w1, b1, w2, b2)
    _check_layer("x", x, "w1", w1, "b1", b1)
    _validate.tensor("w2", w2, ndim=2)
    if w2.shape[1] != w1.shape[0]:
        raise ValueError(f"w2 has in_features {w2.shape[1]} (shape {tuple(w2.shape)}) but w1 has "
                         f"out_features {w1.shape[0]}")
    _validate.tensor("b2", b2, ndim=1, optional=True)
    _validate.same_device("x", x, w2=w2, b2=b2)
    for name, t in (("w2", w2), ("b2", b2)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has dtype {x.dtype}")
    _validate.shape("b2", b2, (w2.shape[0],))
    n = w2.shape[0]
    _check_residual(x, residual, n)
    if not _backend.use_triton(x):
        return reference.mlp(x, w1, b1, w2, b2, activation, residual, dropout_p, output_dropout_p)
    lead = x.shape[:-1]
    save_pre = activation is not None and _needs_grad(x, w1, b1)
    seed = _backend.dropout_seed(dropout_p, x.device)  # the hidden dropout's seed is drawn first
    output_seed = _backend.dropout_seed(output_dropout_p, x.device)
    out, _, _ = _mlp_fwd(x.reshape(-1, x.shape[-1]), w1, b1, w2, b2,
                         None if residual is None else residual.reshape(-1, n),
                         activation or "none", save_pre, seed, float(dropout_p), output_seed,
                         float(output_dropout_p))
    return out.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------

class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with a fused activation (and an optional residual in ``forward``).

    Same constructor (plus ``activation``), parameters and state dict as ``torch.nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, activation: Optional[str] = None):
        _check_activation(activation)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, input: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        return linear(input, self.weight, self.bias, self.activation, residual)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


class MLP(torch.nn.Module):
    """The feed-forward block ``linear2(act(linear1(x)))`` (+ residual) of a Transformer layer.

    Parameters are named like ``torch.nn.TransformerEncoderLayer``'s: ``linear1`` (d_model ->
    dim_feedforward) and ``linear2`` (dim_feedforward -> d_model), so their state dict keys
    match. ``dropout`` is applied, as in torch's layer, to the hidden activation and to the
    block's output (before the residual add), both fused into the GEMM epilogues; only in
    training mode.
    """

    def __init__(self, d_model: int, dim_feedforward: int, activation: Optional[str] = "gelu",
                 bias: bool = True, dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        _check_activation(activation)
        _validate.probability("dropout", dropout)
        self.linear1 = torch.nn.Linear(d_model, dim_feedforward, bias, device=device, dtype=dtype)
        self.linear2 = torch.nn.Linear(dim_feedforward, d_model, bias, device=device, dtype=dtype)
        self.activation = activation
        self.dropout = dropout

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        p = self.dropout if self.training else 0.0
        return mlp(x, self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias,
                   self.activation, residual, p, p)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}"
