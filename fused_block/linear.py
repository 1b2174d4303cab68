"""Linear layers with fused epilogues: ``linear``, ``mlp`` and ``swiglu``, and their modules.

Shapes: x (..., K); weight (N, K) in ``torch.nn.Linear`` layout; bias (N,); residual (..., N).
x, weights and biases share one dtype (fp32, fp16 or bf16); the residual may be wider (the
output then has the promoted dtype, as ``residual + F.linear(...)`` would), e.g. an fp32
residual stream under autocast.

Precision: fp32 accumulation everywhere. fp32 inputs follow torch's matmul precision at call
time: IEEE fp32 products by default (torch's "highest"), TF32 after
``torch.set_float32_matmul_precision("high")`` or ``torch.backends.cuda.matmul.allow_tf32 =
True``.

Each op is a ``torch.library`` op (``fused_block._library``) inside a ``torch.autograd.Function``
that saves only what ``ctx.needs_input_grad`` asks for and never materializes gradients
nobody uses:
- ``linear`` saves x (for dW), the weight (for dX) and, with an activation, the
  pre-activation. Backward: one elementwise pass for the activation and dropout gradient (with
  the bias gradient's partial sums), the dX and dW GEMMs; without an activation the bias
  gradient comes with the dW GEMM: our kernel's partials (it reads dY anyway), or on cuBLAS
  ``torch.sum`` of dY's columns. One small kernel reduces partials into the bias's dtype
  (deterministic, no atomics).
- ``mlp`` / ``swiglu`` save x and the pre-activation only (for SwiGLU the gate and up
  projections); the hidden activation is recomputed in the backward's first GEMM. Backward:
  ``dPre = (dY @ W2) * act'(pre)`` (SwiGLU: dGate and dUp) in one GEMM epilogue that also
  emits the first bias's partial sums and the recomputed hidden activation; ``dW2 = dY^T H``
  with the second bias's gradient (partials, or ``torch.sum`` on cuBLAS); ``dW1 = dPre^T X``;
  ``dX = dPre @ W1`` (SwiGLU: the gate and up weights read in place); one reduction for both
  biases' partials.

Dropout is fused into the epilogues: ``mlp``'s ``dropout_p`` on the hidden activation (the
first GEMM's epilogue, after the activation), ``output_dropout_p`` on the second GEMM's output
before the residual add; ``linear``'s ``dropout_p`` after the activation, before the residual.
Each dropout draws one int64 seed from torch's generator (``_backend.dropout_seed``; for
``mlp`` the hidden one first); the masks are never stored but regenerated from the seeds.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fused_block import _backend, _guard, _library, _validate, lora, reference
from fused_block import dispatch as _dispatch
from fused_block.dispatch import gemm as _gemm
from fused_block.kernels import common
from fused_block.kernels import matmul as _k

ACTIVATIONS = reference.ACTIVATIONS
MLP_ACTIVATIONS = reference.MLP_ACTIVATIONS
GATED = reference.GATED_ACTIVATIONS  # "swiglu", "geglu": two projections, act(gate) * up
# What the FFN's forward keeps for backward: nothing, the pre-activation, or the hidden
# activation (when only the second layer's weight needs a gradient, or there is no activation).
SAVE_NONE, SAVE_PRE, SAVE_H = 0, 1, 2


def _code(activation: str) -> int:
    """Op-schema activation string ("none" for None) to the kernels' code."""
    return _k.ACTIVATIONS[None if activation == "none" else activation]


def _out_dtype(x, residual):
    return torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype


def _empty(shape, dtype, device, needed):
    return common.empty(shape if needed else (0,), dtype, device)


# ---------------------------------------------------------------------------------------------
# torch.library ops on rows: an activation (x, residual, their gradients) is a 2-D (rows, features)
# tensor with any strides, or a contiguous one of another rank whose rows are all its dims but the
# last (the caller's (batch, sequence, features), read in place: kernels.matmul._mat); outputs take
# its leading dims
# ---------------------------------------------------------------------------------------------

def _linear_fwd_fake(x, weight, bias, residual, activation, save_pre, seed, dropout_p):
    shape = (*x.shape[:-1], weight.shape[0])
    return (x.new_empty(shape, dtype=_out_dtype(x, residual)),
            x.new_empty(shape if save_pre and activation != "none" else (0,)))


def _linear_forward(x, weight, bias, residual, lora_u, lora_b, activation, save_pre, seed, dropout_p):
    store = save_pre and activation != "none"
    out = common.empty((*x.shape[:-1], weight.shape[0]), _out_dtype(x, residual), x.device)
    pre = _empty(out.shape, x.dtype, x.device, store)
    with _backend.device_guard(x):
        _gemm("linear.fwd", x, weight, out, bias=bias, residual=residual, aux=pre if store else None,
                store_pre=store, activation=_code(activation), seed=seed, dropout_p=dropout_p,
                lora_a=lora_u, lora_b=None if lora_b is None else lora_b.t(), transpose_b=True)
    return out, pre


@_library.op("linear_fwd", fake=_linear_fwd_fake)
def _linear_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                activation: str, save_pre: bool, seed: Optional[Tensor], dropout_p: float) -> tuple[Tensor, Tensor]:
    """x (..., K) rows, weight (N, K) -> (out (..., N), pre (..., N), or empty unless saved), in
    x's leading dims. seed: int64 (1,) when ``dropout_p > 0``, else None."""
    return _linear_forward(x, weight, bias, residual, None, None, activation, save_pre, seed, dropout_p)


def _linear_lora_fwd_fake(x, weight, bias, residual, lora_u, lora_b, activation, save_pre, seed, dropout_p):
    return _linear_fwd_fake(x, weight, bias, residual, activation, save_pre, seed, dropout_p)


@_library.op("linear_lora_fwd", fake=_linear_lora_fwd_fake)
def _linear_lora_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                     lora_u: Tensor, lora_b: Tensor, activation: str, save_pre: bool, seed: Optional[Tensor],
                     dropout_p: float) -> tuple[Tensor, Tensor]:
    """As ``linear_fwd`` with a LoRA update inside the GEMM: ``x @ weight.T + lora_u @
    lora_b.T`` before the epilogue; lora_u (M, R) (a row per row of x), lora_b (N, R), R a
    multiple of 16."""
    return _linear_forward(x, weight, bias, residual, lora_u, lora_b, activation, save_pre, seed, dropout_p)


def _linear_bwd_fake(g, x, weight, pre, seed, activation, dropout_p, need_x, need_w, need_b):
    N = g.shape[-1]
    K = weight.shape[1] if weight is not None else (x.shape[-1] if x is not None else 0)
    return (g.new_empty((*g.shape[:-1], K) if need_x else (0,)), g.new_empty((N, K) if need_w else (0,)),
            g.new_empty((N,) if need_b else (0,)))


def _linear_backward(g, x, weight, pre, seed, lora_u, lora_b, activation, dropout_p, need_x, need_w, need_b,
                     need_u, need_lb):
    N = g.shape[-1]
    K = weight.shape[1] if weight is not None else (x.shape[-1] if x is not None else 0)
    act = _code(activation)
    dx = _empty((*g.shape[:-1], K), g.dtype, g.device, need_x)
    dw = _empty((N, K), g.dtype, g.device, need_w)
    du = dlb = db = None
    with _backend.device_guard(g):
        dpre, part = g, None
        if act or dropout_p > 0:
            # One pass: dropout's regenerated mask, act'(pre), dB's partial sums.
            dpre, part = _k.act_grad(g, pre, act, dbias=need_b, store_dpre=need_x or need_w or need_u or need_lb,
                                     seed=seed, dropout_p=dropout_p)
        if need_x:
            _gemm("linear.dx", dpre, weight, dx)
        if need_w:
            if need_b and part is None:  # dB = colsum(dY) with the dW GEMM: partials or the sums
                part = _gemm("linear.dw", dpre, x, dw, rowsum=True, transpose_a=True)
            else:
                _gemm("linear.dw", dpre, x, dw, transpose_a=True)
        elif need_b and part is None:
            part = _k.act_grad(g, None, 0, dbias=True, store_dpre=False)[1]
        if need_b:
            db = part if part.dim() == 1 else _k.reduce_partials(part, g.dtype)[0]
        if need_u:  # the low-rank pair's gradients: dU = dPre @ B, dB = dPre.T @ U (small GEMMs)
            du = common.empty(lora_u.shape, g.dtype, g.device)
            _gemm("lora.du", dpre, lora_b, du)
        if need_lb:
            dlb = common.empty(lora_b.shape, g.dtype, g.device)
            _gemm("lora.dB", dpre, lora_u, dlb, transpose_a=True)
    db = db if need_b else g.new_empty(0)
    if lora_u is None:  # linear_bwd's three outputs
        return dx, dw, db
    return dx, dw, db, du if need_u else g.new_empty(0), dlb if need_lb else g.new_empty(0)


@_library.op("linear_bwd", fake=_linear_bwd_fake)
def _linear_bwd(g: Tensor, x: Optional[Tensor], weight: Optional[Tensor], pre: Optional[Tensor],
                seed: Optional[Tensor], activation: str, dropout_p: float, need_x: bool, need_w: bool,
                need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``linear`` from g = dOut (..., N) rows in x's dtype: (dx (..., K) in g's
    leading dims, dw (N, K), db (N,)), each empty unless needed. x (rows) is needed for dw,
    weight for dx, pre when there is an activation, seed when ``dropout_p > 0``."""
    return _linear_backward(g, x, weight, pre, seed, None, None, activation, dropout_p, need_x, need_w, need_b,
                            False, False)


def _linear_lora_bwd_fake(g, x, weight, pre, seed, lora_u, lora_b, activation, dropout_p, need_x, need_w,
                          need_b, need_u, need_lb):
    return (*_linear_bwd_fake(g, x, weight, pre, seed, activation, dropout_p, need_x, need_w, need_b),
            g.new_empty(lora_u.shape if need_u else (0,)), g.new_empty(lora_b.shape if need_lb else (0,)))


@_library.op("linear_lora_bwd", fake=_linear_lora_bwd_fake)
def _linear_lora_bwd(g: Tensor, x: Optional[Tensor], weight: Optional[Tensor], pre: Optional[Tensor],
                     seed: Optional[Tensor], lora_u: Tensor, lora_b: Tensor, activation: str, dropout_p: float,
                     need_x: bool, need_w: bool, need_b: bool, need_u: bool,
                     need_lb: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``linear_bwd`` plus the LoRA pair's gradients (dU (M, R), dB (N, R)), each empty unless
    needed. The input's gradient through the low-rank path is autograd's (dU into lora_A)."""
    return _linear_backward(g, x, weight, pre, seed, lora_u, lora_b, activation, dropout_p, need_x, need_w,
                            need_b, need_u, need_lb)


# ---------------------------------------------------------------------------------------------
# the gated (SwiGLU) first layer on its own: hidden = dropout(silu(x Wg^T + bg) * (x Wu^T + bu))
# ---------------------------------------------------------------------------------------------

def _gated_fwd_fake(x, w_gate, w_up, b_gate, b_up, lora_u, lora_b_gate, lora_b_up, activation, save_pre, seed,
                    dropout_p):
    M, F = x.shape[0], w_gate.shape[0]
    return x.new_empty((M, F)), x.new_empty((M, 2 * F) if save_pre else (0,))


@_library.op("gated_fwd", fake=_gated_fwd_fake)
def _gated_fwd(x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Optional[Tensor], b_up: Optional[Tensor],
               lora_u: Optional[Tensor], lora_b_gate: Optional[Tensor], lora_b_up: Optional[Tensor],
               activation: str, save_pre: bool, seed: Optional[Tensor], dropout_p: float) -> tuple[Tensor, Tensor]:
    """x (M, D), w_gate/w_up (F, D) -> (hidden (M, F), [gate | up] pre-activations (M, 2F) or
    empty): one GEMM with two accumulators (SwiGLU or GeGLU, ``activation``, in its epilogue),
    the LoRA pairs (lora_u (M, R), lora_b_gate/lora_b_up (F, R), or None) in its reduction."""
    M, F = x.shape[0], w_gate.shape[0]
    h = common.empty((M, F), x.dtype, x.device)
    pre = common.empty((M, 2 * F), x.dtype, x.device) if save_pre else None
    lora = lora_u is not None
    with _backend.device_guard(x):
        _gemm("gated.fwd", x, w_gate, h, b2=w_up, bias=b_gate, bias2=b_up, aux=pre,
                aux2=pre[:, F:] if pre is not None else None, store_pre=save_pre, round_pre=True,
                activation=_code(activation),
                seed=seed, dropout_p=dropout_p, lora_a=lora_u, lora_b=lora_b_gate.t() if lora else None,
                lora_b2=lora_b_up.t() if lora else None, transpose_b=True)
    return h, pre if save_pre else x.new_empty(0)


def _gated_bwd_fake(g, x, w_gate, w_up, pre, seed, lora_u, lora_b_gate, lora_b_up, activation, dropout_p, need_x,
                    need_w, need_b, need_u, need_lb):
    M, F = g.shape
    D = x.shape[1] if x is not None else w_gate.shape[1] if w_gate is not None else 0  # neither: no dx, dW
    R = lora_u.shape[1] if lora_u is not None else 0
    return (g.new_empty((M, D) if need_x else (0,)), g.new_empty((2 * F, D) if need_w else (0,)),
            g.new_empty((2 * F,) if need_b else (0,)), g.new_empty((M, R) if need_u else (0,)),
            g.new_empty((2 * F, R) if need_lb else (0,)))


@_library.op("gated_bwd", fake=_gated_bwd_fake)
def _gated_bwd(g: Tensor, x: Optional[Tensor], w_gate: Optional[Tensor], w_up: Optional[Tensor], pre: Tensor,
               seed: Optional[Tensor], lora_u: Optional[Tensor], lora_b_gate: Optional[Tensor],
               lora_b_up: Optional[Tensor], activation: str, dropout_p: float, need_x: bool, need_w: bool,
               need_b: bool, need_u: bool, need_lb: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``gated_fwd`` from g = dHidden (M, F): (dx (M, D), [dWg; dWu] (2F, D), [dbg;
    dbu] (2F,), dU (M, R), [dBg; dBu] (2F, R)), each empty unless needed. One elementwise pass
    gives dGate and dUp (dropout's mask, the gate activation's derivative, the biases' partial sums); dx =
    dGate @ Wg + dUp @ Wu is one GEMM continuing its reduction over both (and dU likewise)."""
    M, F = g.shape
    dt, dev = g.dtype, g.device
    D = x.shape[1] if x is not None else w_gate.shape[1] if w_gate is not None else 0  # neither: no dx, dW
    dx = _empty((M, D), dt, dev, need_x)
    dw = _empty((2 * F, D), dt, dev, need_w)
    du = _empty(lora_u.shape if lora_u is not None else (0,), dt, dev, need_u)
    dlb = _empty((2 * F, lora_u.shape[1]) if lora_u is not None else (0,), dt, dev, need_lb)
    db = None
    with _backend.device_guard(g):
        dpre, part = _k.act_grad(g, pre[:, :F], _code(activation), pre2=pre[:, F:], dbias=need_b, seed=seed,
                                 dropout_p=dropout_p)
        if need_x:
            _gemm("gated.dx", dpre[:, :F], w_gate, dx, a2=dpre[:, F:], b2=w_up)
        if need_w:
            _gemm("gated.dw", dpre, x, dw, transpose_a=True)  # [dWg; dWu] = [dGate | dUp].T @ x: one GEMM
        if need_b:
            db = _k.reduce_partials(part, dt)[0]
        if need_u:
            _gemm("gated.lora.du", dpre[:, :F], lora_b_gate, du, a2=dpre[:, F:], b2=lora_b_up)
        if need_lb:
            _gemm("gated.lora.dB", dpre, lora_u, dlb, transpose_a=True)
    return dx, dw, db if need_b else g.new_empty(0), du, dlb


def _ffn_fwd_fake(x, w1, w1_up, b1, b1_up, w2, b2, residual, activation, save, seed, dropout_p,
                  output_seed, output_dropout_p):
    M, F = common.n_rows(x), w1.shape[0]
    width = 2 * F if activation in GATED else F
    saved = (M, width) if save == SAVE_PRE else ((M, F) if save == SAVE_H else (0,))
    return x.new_empty((*x.shape[:-1], w2.shape[0]), dtype=_out_dtype(x, residual)), x.new_empty(saved)


@_library.op("ffn_fwd", fake=_ffn_fwd_fake)
def _ffn_fwd(x: Tensor, w1: Tensor, w1_up: Optional[Tensor], b1: Optional[Tensor], b1_up: Optional[Tensor],
             w2: Tensor, b2: Optional[Tensor], residual: Optional[Tensor], activation: str, save: int,
             seed: Optional[Tensor], dropout_p: float, output_seed: Optional[Tensor],
             output_dropout_p: float) -> tuple[Tensor, Tensor]:
    """x (..., D) rows (M of them), w1 (F, D), w2 (D', F) -> (out (..., D') in x's leading dims,
    saved).

    hidden = dropout(act(x @ w1.T + b1)) with ``seed``, or for SwiGLU dropout(silu(x @ w1.T +
    b1) * (x @ w1_up.T + b1_up)) (one GEMM, two accumulators); out = dropout(hidden @ w2.T +
    b2) with ``output_seed``, + residual. saved: the pre-activation (M, F), for SwiGLU [gate |
    up] (M, 2F) (``save == SAVE_PRE``), the hidden activation (``SAVE_H``), or empty.
    """
    M, F = common.n_rows(x), w1.shape[0]
    swiglu = activation in GATED
    h = common.empty((M, F), x.dtype, x.device)
    pre = common.empty((M, 2 * F if swiglu else F), x.dtype, x.device) if save == SAVE_PRE else None
    out = common.empty((*x.shape[:-1], w2.shape[0]), _out_dtype(x, residual), x.device)
    with _backend.device_guard(x):
        _gemm("ffn.fc1", x, w1, h, b2=w1_up if swiglu else None, bias=b1, bias2=b1_up if swiglu else None,
                aux=pre, aux2=pre[:, F:] if swiglu and pre is not None else None, store_pre=pre is not None,
                round_pre=activation != "none", activation=_code(activation), seed=seed, dropout_p=dropout_p,
                transpose_b=True)
        _gemm("ffn.fc2", h, w2, out, bias=b2, residual=residual, seed=output_seed, dropout_p=output_dropout_p,
                transpose_b=True)
    if save == SAVE_PRE:
        return out, pre
    return out, (h if save == SAVE_H else x.new_empty(0))


def _ffn_bwd_fake(g, x, w1, w1_up, w2, saved, seed, output_seed, activation, dropout_p, output_dropout_p,
                  save, d_in, need_x, need_w1, need_b1, need_w2, need_b2):
    D2 = g.shape[-1]
    F = _ffn_width(w2, saved, save, activation)
    F1 = 2 * F if activation in GATED else F
    return (g.new_empty((*g.shape[:-1], d_in) if need_x else (0,)), g.new_empty((F1, d_in) if need_w1 else (0,)),
            g.new_empty((F1,) if need_b1 else (0,)), g.new_empty((D2, F) if need_w2 else (0,)),
            g.new_empty((D2,) if need_b2 else (0,)))


def _ffn_width(w2, saved, save, activation):
    """The hidden width F: w2's (D', F), which the backward reads only for the hidden's
    gradient (dx, dW1, db1), else the saved h (rows, F) or pre-activations (rows, F or 2F for
    the gated ones); 0 with neither (only dB2 wanted: F unused)."""
    if w2 is not None:
        return w2.shape[1]
    if saved is None or save == SAVE_NONE:
        return 0
    return saved.shape[-1] // (2 if save == SAVE_PRE and activation in GATED else 1)


@_library.op("ffn_bwd", fake=_ffn_bwd_fake)
def _ffn_bwd(g: Tensor, x: Optional[Tensor], w1: Optional[Tensor], w1_up: Optional[Tensor], w2: Optional[Tensor],
             saved: Optional[Tensor], seed: Optional[Tensor], output_seed: Optional[Tensor], activation: str,
             dropout_p: float, output_dropout_p: float, save: int, d_in: int, need_x: bool, need_w1: bool,
             need_b1: bool, need_w2: bool, need_b2: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``_ffn_fwd`` from g = dOut (..., D') rows in x's dtype: (dx (..., d_in) in g's
    leading dims, dw1 (F1, d_in), db1 (F1,), dw2 (D', F), db2 (D',)), each empty unless needed;
    F1 = 2F for SwiGLU (gate rows, then up rows)."""
    D2 = g.shape[-1]
    M = common.n_rows(g)
    F = _ffn_width(w2, saved, save, activation)
    swiglu = activation in GATED
    F1 = 2 * F if swiglu else F
    need_hidden = need_x or need_w1 or need_b1
    dt, dev = g.dtype, g.device
    dx = _empty((*g.shape[:-1], d_in), dt, dev, need_x)
    dw1 = _empty((F1, d_in), dt, dev, need_w1)
    dw2 = _empty((D2, F), dt, dev, need_w2)
    part1 = part2 = None
    h = saved if save == SAVE_H else None
    with _backend.device_guard(g):
        if output_dropout_p > 0:
            # Through the output dropout: g * keep / (1 - p) and dB2's partial sums in one pass.
            g, part2 = _k.act_grad(g, None, 0, dbias=need_b2, store_dpre=need_hidden or need_w2,
                                   seed=output_seed, dropout_p=output_dropout_p)
        if need_hidden:
            dpre = common.empty((M, F1), dt, dev)
            pre = saved if save == SAVE_PRE else None
            if need_w2 and h is None:
                h = common.empty((M, F), dt, dev)  # recomputed from pre in the epilogue
            if need_b1:
                part1 = common.empty((common.cdiv(M, _k.PARTIAL_ROWS), F1), torch.float32, dev)
            _gemm("ffn.dh", g, w2, dpre, c2=dpre[:, F:] if swiglu else None, aux=pre,
                    aux2=pre[:, F:] if swiglu else None, hout=h if save == SAVE_PRE and need_w2 else None,
                    part=part1, seed=seed, dropout_p=dropout_p, activation=_code(activation), act_grad=True)
        if need_w2:
            if need_b2 and part2 is None:  # dB2 = colsum(dY) with the dW2 GEMM: partials or the sums
                part2 = _gemm("ffn.dw2", g, h, dw2, rowsum=True, transpose_a=True)
            else:
                _gemm("ffn.dw2", g, h, dw2, transpose_a=True)
        elif need_b2 and part2 is None:
            part2 = _k.act_grad(g, None, 0, dbias=True, store_dpre=False)[1]
        if need_w1:
            _gemm("ffn.dw1", dpre, x, dw1, transpose_a=True)
        if need_x:
            if swiglu:
                _gemm("ffn.dx", dpre[:, :F], w1, dx, a2=dpre[:, F:], b2=w1_up)
            else:
                _gemm("ffn.dx", dpre, w1, dx)
        db1 = db2 = None
        if need_b2 and part2.dim() == 1:  # the cuBLAS candidate's finished sums
            db2, part2 = part2, None
        if need_b1 and part2 is not None:
            db1, db2 = _k.reduce_partials(part1, dt, part2)
        elif need_b1:
            db1 = _k.reduce_partials(part1, dt)[0]
        elif part2 is not None:
            db2 = _k.reduce_partials(part2, dt)[0]
    # Empty stand-ins, one each: outputs of an op must not alias one another (not g.new_empty:
    # g is None when only dB2 was wanted past dropout).
    return (dx, dw1, db1 if need_b1 else _empty((), dt, dev, False), dw2,
            db2 if need_b2 else _empty((), dt, dev, False))


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------

def _output(out, lead):
    """An op's (rows, N) output in the caller's leading dims, inside a Function's forward: a
    tensor of its own over the same memory, not an autograd view of the 2-D buffer (FSDP2
    warns when a module returns a view: an in-place change of one would bypass the hook FSDP
    puts on the module's output)."""
    return out if out.dim() == len(lead) + 1 and out.shape[:-1] == lead else out.view(*lead, out.shape[-1]).detach()


class _LinearFn(torch.autograd.Function):
    """x (..., K) and residual (..., N) keep their shapes: the ops read them in place as rows
    (:func:`_rows`; a (rows, K) view, taken in here and in the backward where autograd does not
    record it, only for a tensor that is neither 2-D nor contiguous), and the output comes back
    in x's leading dims (the op's own, or :func:`_output` of the view's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, lora_u, lora_b, activation, seed, dropout_p):
        need_x, need_w, need_b, _, need_u, need_lb = ctx.needs_input_grad[:6]
        need = need_x or need_w or need_b or need_u or need_lb
        save_pre = need and activation != "none"
        x2, residual = _rows(x), _rows(residual)
        if lora_u is None:
            out, pre = _linear_fwd(x2, weight, bias, residual, activation, save_pre, seed, dropout_p)
        else:
            out, pre = _linear_lora_fwd(x2, weight, bias, residual, lora_u, lora_b, activation, save_pre, seed,
                                        dropout_p)
        ctx.set_materialize_grads(False)
        # The low-rank pair whole (U is (rows, R), B a parameter): their gradients' shapes and the
        # backward's outputs come from them, whichever of the two takes a gradient.
        ctx.save_for_backward(x2 if need_w else None, weight if need_x else None, pre if save_pre else None,
                              seed if need and dropout_p > 0 else None, lora_u, lora_b)
        ctx.activation, ctx.dropout_p, ctx.x_dtype, ctx.x_shape = activation, dropout_p, x.dtype, x.shape
        ctx.lora = lora_u is not None
        return out if x2 is x else _output(out, x.shape[:-1])

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dout):
        need_x, need_w, need_b, need_r, need_u, need_lb = ctx.needs_input_grad[:6]
        dx = dw = db = du = dlb = None
        if dout is not None and (need_x or need_w or need_b or need_u or need_lb):
            x, weight, pre, seed, lora_u, lora_b = ctx.saved_tensors
            g = _rows(dout if dout.dtype == ctx.x_dtype else dout.to(ctx.x_dtype))  # residual promoted out
            if ctx.lora:
                dx, dw, db, du, dlb = _linear_lora_bwd(g, x, weight, pre, seed, lora_u, lora_b, ctx.activation,
                                                       ctx.dropout_p, need_x, need_w, need_b, need_u, need_lb)
            else:
                dx, dw, db = _linear_bwd(g, x, weight, pre, seed, ctx.activation, ctx.dropout_p,
                                         need_x, need_w, need_b)
            if need_x and dx.dim() != len(ctx.x_shape):  # from a (rows, N) view of dout
                dx = dx.view(*ctx.x_shape)
            elif not need_x:
                dx = None
        return (dx, dw if need_w else None, db if need_b else None,
                dout if need_r else None, du if need_u else None, dlb if need_lb else None, None, None, None)


_LinearFn_apply = _library.fast_apply(_LinearFn)


class _GatedFn(torch.autograd.Function):
    """``gated_fwd``/``gated_bwd``; the weights' and LoRA B's gradients come as one stacked
    tensor each, split here into the gate and up parts."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, b_gate, b_up, lora_u, lora_b_gate, lora_b_up, activation, seed, dropout_p):
        h, pre = _gated_fwd(x, w_gate, w_up, b_gate, b_up, lora_u, lora_b_gate, lora_b_up, activation, True, seed,
                            dropout_p)
        ctx.set_materialize_grads(False)
        # x for the weights' gradients, the weights for x's, as torch's two linears save them:
        # an input the backward does not read may change in place (frozen weights), and
        # nothing unread is kept alive.
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if need_w else None, w_gate if need_x else None, w_up if need_x else None, pre,
                              seed, lora_u, lora_b_gate, lora_b_up)
        ctx.dropout_p, ctx.activation = dropout_p, activation
        return h

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dh):
        need = ctx.needs_input_grad
        if dh is None:
            return (None,) * 11
        x, w_gate, w_up, pre, seed, lora_u, lbg, lbu = ctx.saved_tensors
        need_w, need_b, need_lb = need[1] or need[2], need[3] or need[4], need[6] or need[7]
        dx, dw, db, du, dlb = _gated_bwd(dh, x, w_gate, w_up, pre, seed, lora_u, lbg, lbu, ctx.activation,
                                         ctx.dropout_p, need[0], need_w, need_b, need[5], need_lb)
        F = dh.shape[1]
        split = (lambda t: (t[:F], t[F:]))  # noqa: E731
        dwg, dwu = split(dw) if need_w else (None, None)
        dbg, dbu = split(db) if need_b else (None, None)
        dlbg, dlbu = split(dlb) if need_lb else (None, None)
        return (dx if need[0] else None, dwg if need[1] else None, dwu if need[2] else None,
                dbg if need[3] else None, dbu if need[4] else None, du if need[5] else None,
                dlbg if need[6] else None, dlbu if need[7] else None, None, None, None)


_GatedFn_apply = _library.fast_apply(_GatedFn)


def _gate_up_views(w1, b1):
    """mlp's SwiGLU layer: w1 (2F, D) and b1 (2F,) as gate and up views (no copy)."""
    f = w1.shape[0] // 2
    return w1[:f], w1[f:], *((None, None) if b1 is None else (b1[:f], b1[f:]))


class _FFNFn(torch.autograd.Function):
    """Inputs (x, w1, w1_up, b1, b1_up, w2, b2, residual, ...). ``split_w1``: SwiGLU with w1
    (2F, D) and b1 (2F,) holding gate then up rows (mlp's layout), passed to the ops as views;
    otherwise SwiGLU's gate and up come as separate tensors and get views of one gradient.
    x (..., D) and residual keep their shapes, as in :class:`_LinearFn`."""

    @staticmethod
    def forward(ctx, x, w1, w1_up, b1, b1_up, w2, b2, residual, activation, seed, dropout_p, output_seed,
                output_dropout_p, split_w1):
        ni = ctx.needs_input_grad
        need_x, need_w1, need_b1, need_w2, need_b2 = ni[0], ni[1] or ni[2], ni[3] or ni[4], ni[5], ni[6]
        need_hidden = need_x or need_w1 or need_b1
        if activation != "none" and need_hidden:
            save = SAVE_PRE
        else:
            save = SAVE_H if need_w2 else SAVE_NONE
        if split_w1:
            w1, w1_up, b1, b1_up = _gate_up_views(w1, b1)
        lead, x_in, x = x.shape[:-1], x, _rows(x)
        out, saved = _ffn_fwd(x, w1, w1_up, b1, b1_up, w2, b2, _rows(residual), activation, save,
                              seed, dropout_p, output_seed, output_dropout_p)
        ctx.set_materialize_grads(False)
        # Each weight only where a gradient reads it, as torch's linears save them (w2 for the
        # hidden's gradient): an input the backward does not read may change in place.
        ctx.save_for_backward(x if need_w1 else None, w1 if need_x else None, w1_up if need_x else None,
                              w2 if need_hidden else None,
                              saved if save != SAVE_NONE else None,
                              seed if need_hidden and dropout_p > 0 else None,
                              output_seed if output_dropout_p > 0 and (need_hidden or need_w2 or need_b2)
                              else None)
        ctx.activation, ctx.save, ctx.split_w1 = activation, save, split_w1
        ctx.dropout_p, ctx.output_dropout_p = dropout_p, output_dropout_p
        ctx.x_dtype, ctx.d_in, ctx.lead = x.dtype, x.shape[-1], lead
        return out if x is x_in else _output(out, lead)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dout):
        ni = ctx.needs_input_grad
        need_x, need_w1, need_b1, need_w2, need_b2 = ni[0], ni[1] or ni[2], ni[3] or ni[4], ni[5], ni[6]
        grads = [None] * 14
        if dout is None:
            return tuple(grads)
        if need_x or need_w1 or need_b1 or need_w2 or need_b2:
            x, w1, w1_up, w2, saved, seed, output_seed = ctx.saved_tensors
            g = _rows(dout if dout.dtype == ctx.x_dtype else dout.to(ctx.x_dtype))
            dx, dw1, db1, dw2, db2 = _ffn_bwd(g, x, w1, w1_up, w2, saved, seed, output_seed, ctx.activation,
                                              ctx.dropout_p, ctx.output_dropout_p, ctx.save, ctx.d_in,
                                              need_x, need_w1, need_b1, need_w2, need_b2)
            if need_x and dx.dim() != len(ctx.lead) + 1:  # from a (rows, D') view of dout
                dx = dx.view(*ctx.lead, ctx.d_in)
            grads[0], grads[5], grads[6] = dx if need_x else None, dw2, db2
            if ctx.activation in GATED and not ctx.split_w1:
                if need_w1 or need_b1:  # w2 saved: the hidden's gradient
                    f = w2.shape[1]
                    grads[1], grads[2] = (dw1[:f], dw1[f:]) if need_w1 else (None, None)
                    grads[3], grads[4] = (db1[:f], db1[f:]) if need_b1 else (None, None)
            else:
                grads[1], grads[3] = dw1, db1
        grads[7] = dout if ni[7] else None
        return tuple(t if t is not None and ni[i] else None for i, t in enumerate(grads))


_FFNFn_apply = _library.fast_apply(_FFNFn)


# ---------------------------------------------------------------------------------------------
# validation, autocast, public functions
# ---------------------------------------------------------------------------------------------

def _check_activation(activation, allowed=ACTIVATIONS):
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be None or a str, got {type(activation).__name__}")
    if activation not in allowed:
        raise ValueError(f"activation must be one of {allowed}, got {activation!r}")


_TENSOR_TYPES = (Tensor, torch.nn.Parameter)  # the plain types: no subclass to look at


def _layer_ok(x, weight, bias, k) -> bool:
    """The common case of the layer checks in one expression: weight (N, k) and bias (N,) or None,
    plain tensors of x's dtype and device (False: run the checks, which raise the error)."""
    dtype, device = x.dtype, x.device
    return (dtype in _validate.FLOAT_DTYPES and type(weight) in _TENSOR_TYPES and weight.dtype is dtype
            and weight.dim() == 2
            and weight.shape[1] == k and weight.device == device
            and (bias is None or (type(bias) in _TENSOR_TYPES and bias.dtype is dtype and bias.dim() == 1
                                  and bias.shape[0] == weight.shape[0] and bias.device == device)))


def _check_layer(x_name, x, w_name, weight, b_name, bias):
    """weight (N, K) matches x (..., K) in dtype, device and K; bias is (N,)."""
    if _layer_ok(x, weight, bias, x.shape[-1]):
        return
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


def _check_second_layer(x, w_name, weight, b_name, bias, hidden, hidden_name):
    """The FFN's second layer: weight (D', hidden) on x's dtype and device, bias (D',)."""
    if _layer_ok(x, weight, bias, hidden):
        return
    _validate.tensor(w_name, weight, ndim=2)
    if weight.shape[1] != hidden:
        raise ValueError(f"{w_name} has in_features {weight.shape[1]} (shape {tuple(weight.shape)}) but "
                         f"{hidden_name} is {hidden}")
    _validate.tensor(b_name, bias, ndim=1, optional=True)
    _validate.same_device("x", x, **{w_name: weight, b_name: bias})
    for name, t in ((w_name, weight), (b_name, bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has dtype {x.dtype}")
    _validate.shape(b_name, bias, (weight.shape[0],))


def _check_residual(x, residual, n):
    if residual is None:
        return
    if (type(residual) in _TENSOR_TYPES and residual.dtype in _validate.FLOAT_DTYPES and residual.dim() == x.dim()
            and residual.shape[-1] == n and residual.shape[:-1] == x.shape[:-1] and residual.device == x.device):
        return  # the common case of the checks below
    _validate.tensor("residual", residual, optional=True)
    _validate.same_device("x", x, residual=residual)
    _validate.shape("residual", residual, (*x.shape[:-1], n))


def _autocast(x, *tensors):
    """Under autocast, cast x and the layer's parameters as ``F.linear`` would (not the residual):
    floating tensors to its dtype, float64 as given (autocast leaves it, so float64 stays float64
    and a float64 operand beside a cast one is a dtype mismatch, as in ``F.linear``)."""
    if not torch._C._is_any_autocast_enabled():  # the common case, without reading x's device
        return (x, *tensors)
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (x, *tensors))


def _flat(t):
    """(rows, n) view of (..., n) ``t`` (also when n or the rows are 0). No Python arithmetic
    on the sizes, so a ``torch.jit.trace`` of it follows the input's shape."""
    if t is None:
        return None
    return t.unsqueeze(0) if t.dim() == 1 else t.flatten(0, -2)


def _rows(t):
    """``t`` as the ops read activations: itself when 2-D or contiguous (rows read in place), else
    its (rows, n) view (:func:`_flat`)."""
    if t is None or t.dim() == 2 or t.is_contiguous():
        return t
    return _flat(t)


# LoRA ranks are padded to a multiple of this (zero columns): aligned rows for the GEMM's
# tensor descriptors.
LORA_RANK_ALIGN = 16


def _lora_form(lora, outs):
    """``lora`` itself, checked to be a tuple (U, B_1, ..., B_k) for ``len(outs)`` outputs."""
    if not isinstance(lora, (tuple, list)) or len(lora) != 1 + len(outs):
        raise TypeError(f"lora must be a tuple (U, {', '.join(f'B{i}' for i in range(len(outs)))}), got {lora!r}")
    for i, t in enumerate(lora):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lora {'U' if i == 0 else f'B{i - 1}'} must be a torch.Tensor, got {type(t).__name__}")
    return lora


def _check_lora(x, lora, outs):
    """``lora`` = (U, B_1, ..., B_k) with U (..., R) on x's leading dims and each B (n_i, R),
    x's dtype and device; returns them as 2-D rows with R padded to LORA_RANK_ALIGN."""
    u, bs = lora[0], lora[1:]
    _validate.tensor("lora U", u, min_ndim=1)
    if u.dtype != x.dtype:
        raise TypeError(f"lora U must have x's dtype {x.dtype}, got {u.dtype}")
    R = u.shape[-1]
    if tuple(u.shape[:-1]) != tuple(x.shape[:-1]) or R == 0:
        raise ValueError(f"lora U must have shape (*{tuple(x.shape[:-1])}, R > 0), got {tuple(u.shape)}")
    for i, (b, n) in enumerate(zip(bs, outs)):
        _validate.tensor(f"lora B{i}", b, ndim=2)
        if b.dtype != x.dtype:
            raise TypeError(f"lora B{i} must have x's dtype {x.dtype}, got {b.dtype}")
        _validate.shape(f"lora B{i}", b, (n, R))
    _validate.same_device("x", x, lora_U=u, **{f"lora_B{i}": b for i, b in enumerate(bs)})
    pad = -R % LORA_RANK_ALIGN
    u = _flat(u)
    if pad:
        u, bs = F.pad(u, (0, pad)), tuple(F.pad(b, (0, pad)) for b in bs)
    return (u, *bs)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
           residual: Optional[Tensor] = None, dropout_p: float = 0.0, *, lora=None) -> Tensor:
    """``dropout(act(x @ weight.T + bias)) + residual`` in one GEMM with a fused epilogue.

    x (..., K); weight (N, K); bias (N,) or None; activation None, "gelu" (erf), "gelu_tanh" or
    "relu"; residual (..., N) or None, added after the activation and the dropout; dropout_p in
    [0, 1] (always applied when > 0: pass 0 in eval; at 1 torch's ``F.dropout(y, 1.0)``, zero
    gradients for x, weight, bias and the LoRA terms). Returns (..., N) in x's dtype (promoted
    with residual's). Under autocast x, weight and bias are cast like F.linear.

    ``lora`` = (U (..., R), B (N, R)): a low-rank update ``U @ B.T`` (PEFT LoRA's ``scale *
    lora_B(lora_A(dropout(x)))`` with U = scale * lora_A(dropout(x))) added inside the GEMM,
    before the bias and activation (see :mod:`fused_block.lora`); U and B get gradients.
    """
    _validate.tensor("x", x, min_ndim=1)
    _backend.no_dtensor("linear", x, weight)
    _check_activation(activation)
    dropout_p = _validate.probability("dropout_p", dropout_p)
    x, weight, bias = _autocast(x, weight, bias)
    _check_layer("x", x, "weight", weight, "bias", bias)
    n = weight.shape[0]
    _check_residual(x, residual, n)
    u = lb = None
    if lora is not None:
        lora = _autocast(*_lora_form(lora, (n,)))
        u, lb = _check_lora(x, lora, (n,))
    if dropout_p == 1.0:
        return _plus(_backend.drop_all(linear(x, weight, bias, activation, lora=lora)), residual)
    if not _backend.use_triton(x):
        return reference.linear(x, weight, bias, activation, residual, dropout_p, lora=lora)
    if (activation is None and residual is None and u is None and dropout_p == 0
            and _dispatch.linear_on_torch(x, weight, bias)):
        return F.linear(x, weight, bias)  # its products all on cuBLAS: torch's own op and autograd
    seed = _backend.dropout_seed(dropout_p, x.device) if dropout_p > 0 else None
    act = activation or "none"
    if _backend.needs_autograd(x, weight, bias, residual, u, lb):
        return _LinearFn_apply(x, weight, bias, residual, u, lb, act, seed, float(dropout_p))
    x2 = _rows(x)
    args = (x2, weight, bias, _rows(residual))
    if u is None:
        out = _linear_fwd(*args, act, False, seed, float(dropout_p))[0]
    else:
        out = _linear_lora_fwd(*args, u, lb, act, False, seed, float(dropout_p))[0]
    return out if x2 is x else out.view(*x.shape[:-1], n)


def gated_linear(x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Optional[Tensor] = None,
                 b_up: Optional[Tensor] = None, *, dropout_p: float = 0.0, lora=None,
                 activation: str = "swiglu") -> Tensor:
    """A gated FFN's first layer on its own, ``dropout(act(x @ w_gate.T + b_gate) * (x @ w_up.T +
    b_up))`` with act SiLU (``activation="swiglu"``) or the tanh GELU (``"geglu"``, Gemma's):
    one GEMM with two accumulators and the activation-multiply in its epilogue (the gate and
    up pre-activations rounded to x's dtype first, as eager PyTorch computes them). x (..., D),
    w_gate/w_up (F, D). ``lora`` = (U (..., R), B_gate (F, R), B_up (F, R)): LoRA updates of
    both projections inside the GEMM (one U for both: stack the adapters' columns). Returns
    (..., F). Saved for backward: x (for the weights' gradients), the weights (for x's), the
    pre-activations (M, 2F), U and the B's.
    ``swiglu`` / ``geglu`` fuse the whole FFN; this is its first half, for FFNs whose down
    projection must see the hidden activation (PEFT LoRA with dropout on it).
    """
    _validate.tensor("x", x, min_ndim=1)
    _check_activation(activation, GATED)
    _backend.no_dtensor("gated_linear", x, w_gate, w_up)
    dropout_p = _validate.probability("dropout_p", dropout_p)
    x, w_gate, w_up, b_gate, b_up = _autocast(x, w_gate, w_up, b_gate, b_up)
    _check_layer("x", x, "w_gate", w_gate, "b_gate", b_gate)
    _check_layer("x", x, "w_up", w_up, "b_up", b_up)
    f = w_gate.shape[0]
    _validate.shape("w_up", w_up, w_gate.shape)
    u = lbg = lbu = None
    if lora is not None:
        lora = _autocast(*_lora_form(lora, (f, f)))
        u, lbg, lbu = _check_lora(x, lora, (f, f))
    if dropout_p == 1.0:
        return _backend.drop_all(gated_linear(x, w_gate, w_up, b_gate, b_up, lora=lora, activation=activation))
    if not _backend.use_triton(x):
        return reference.gated(x, w_gate, w_up, b_gate, b_up, dropout_p=dropout_p, lora=lora, activation=activation)
    b_gate, b_up = _both_biases(b_gate, b_up)
    seed = _backend.dropout_seed(dropout_p, x.device) if dropout_p > 0 else None
    x2 = _flat(x)
    if _backend.needs_autograd(x, w_gate, w_up, b_gate, b_up, u, lbg, lbu):
        h = _GatedFn_apply(x2, w_gate, w_up, b_gate, b_up, u, lbg, lbu, activation, seed, float(dropout_p))
    else:
        h = _gated_fwd(x2, w_gate, w_up, b_gate, b_up, u, lbg, lbu, activation, False, seed, float(dropout_p))[0]
    return h.view(*x.shape[:-1], f)


def _ffn(x, w1, w1_up, b1, b1_up, w2, b2, residual, activation, dropout_p, output_dropout_p, split_w1):
    n = w2.shape[0]
    # The hidden dropout's seed is drawn first; no seed (no random number, no tensor) at p = 0.
    seed = _backend.dropout_seed(dropout_p, x.device) if dropout_p > 0 else None
    output_seed = _backend.dropout_seed(output_dropout_p, x.device) if output_dropout_p > 0 else None
    activation = activation or "none"
    if _backend.needs_autograd(x, w1, w1_up, b1, b1_up, w2, b2, residual):
        return _FFNFn_apply(x, w1, w1_up, b1, b1_up, w2, b2, residual, activation, seed, float(dropout_p),
                            output_seed, float(output_dropout_p), split_w1)
    if split_w1:
        w1, w1_up, b1, b1_up = _gate_up_views(w1, b1)
    x2 = _rows(x)
    out = _ffn_fwd(x2, w1, w1_up, b1, b1_up, w2, b2, _rows(residual), activation, SAVE_NONE,
                   seed, float(dropout_p), output_seed, float(output_dropout_p))[0]
    return out if x2 is x else out.view(*x.shape[:-1], n)


def mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        activation: Optional[str] = "gelu", residual: Optional[Tensor] = None, dropout_p: float = 0.0,
        output_dropout_p: float = 0.0) -> Tensor:
    """``dropout2(linear2(dropout(act(linear1(x))))) + residual``: two GEMMs, bias + activation
    + dropout in the first's epilogue, bias + dropout + residual in the second's.

    x (..., D); w1 (F, D); b1 (F,) or None; w2 (D', F); b2 (D',) or None; residual (..., D').
    activation None, "gelu", "gelu_tanh", "relu", "swiglu" or "geglu"; with the gated ones
    ("swiglu", "geglu") w1 is (2F, D) and b1 (2F,): the gate rows then the up rows, used in place
    (see :func:`swiglu`, :func:`geglu`).
    dropout_p: on the hidden activation (torch's ``dropout`` in ``_ff_block``);
    output_dropout_p: on the second GEMM's output before the residual add (torch's
    ``dropout2``); both in [0, 1], always applied when > 0 (pass 0 in eval); at 1, torch's
    ``F.dropout(t, 1.0)`` on what it drops (the GEMMs apart for the hidden activation: linear2
    then sees zeros). The hidden activation is rounded to x's dtype, as in eager PyTorch.
    Returns (..., D').
    """
    _validate.tensor("x", x, min_ndim=1)
    _backend.no_dtensor("mlp", x, w1, w2)
    _check_activation(activation, MLP_ACTIVATIONS)
    dropout_p = _validate.probability("dropout_p", dropout_p)
    output_dropout_p = _validate.probability("output_dropout_p", output_dropout_p)
    x, w1, b1, w2, b2 = _autocast(x, w1, b1, w2, b2)
    _check_layer("x", x, "w1", w1, "b1", b1)
    hidden = w1.shape[0]
    if activation in GATED:
        if hidden % 2:
            raise ValueError(f"w1 must have an even out_features (gate rows, then up rows) for {activation}, "
                             f"got shape {tuple(w1.shape)}")
        hidden //= 2
    _check_second_layer(x, "w2", w2, "b2", b2, hidden,
                        f"w1's out_features / 2 ({activation})" if activation in GATED else "w1's out_features")
    _check_residual(x, residual, w2.shape[0])
    if output_dropout_p == 1.0:
        return _plus(_backend.drop_all(mlp(x, w1, b1, w2, b2, activation, None, dropout_p)), residual)
    if dropout_p == 1.0:  # the hidden activation dropped: the GEMMs apart, torch's dropout between
        if activation in GATED:
            hid = gated_linear(x, *_gate_up_views(w1, b1), dropout_p=1.0, activation=activation)
        else:
            hid = linear(x, w1, b1, activation, None, 1.0)
        return linear(hid, w2, b2, None, residual, output_dropout_p)
    if not _backend.use_triton(x):
        return reference.mlp(x, w1, b1, w2, b2, activation, residual, dropout_p, output_dropout_p)
    return _ffn(x, w1, None, b1, None, w2, b2, residual, activation, dropout_p, output_dropout_p,
                activation in GATED)


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, residual: Optional[Tensor] = None, *,
           b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None, b_down: Optional[Tensor] = None,
           dropout_p: float = 0.0, output_dropout_p: float = 0.0) -> Tensor:
    """LLaMA's FFN ``(silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)) @ w_down.T + b_down +
    residual`` in two GEMMs.

    x (..., D); w_gate, w_up (F, D) (Hugging Face's gate_proj / up_proj weights, read in place:
    the gate and up products are one GEMM with two accumulators and the SiLU-multiply in its
    epilogue); w_down (D', F); biases (F,), (F,), (D',) or None; residual (..., D') or None.
    The gate and up projections are rounded to x's dtype before the SiLU-multiply, as eager
    PyTorch computes them. Backward: dGate and dUp in the epilogue of ``dH = dY @ w_down``,
    then dW_gate/dW_up in one GEMM and dX reading both weights in place. ``dropout_p`` (on the
    hidden activation) and ``output_dropout_p`` (on the down projection's output, before the
    residual add) as :func:`mlp`'s, in the same epilogues. Returns (..., D').
    """
    return _gated_ffn(x, w_gate, w_up, w_down, residual, b_gate, b_up, b_down, "swiglu", dropout_p, output_dropout_p)


def geglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, residual: Optional[Tensor] = None, *,
          b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None, b_down: Optional[Tensor] = None,
          dropout_p: float = 0.0, output_dropout_p: float = 0.0) -> Tensor:
    """Gemma's FFN ``(gelu_tanh(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)) @ w_down.T + b_down
    + residual`` (Hugging Face's ``GemmaMLP`` with ``gelu_pytorch_tanh``) in two GEMMs: as
    :func:`swiglu` with the tanh GELU of the gate instead of its SiLU, in the same epilogues
    (T5 v1.1's ``T5DenseGatedActDense`` with ``gelu_new``; its dropouts ``dropout_p``, ``output_dropout_p``).
    """
    return _gated_ffn(x, w_gate, w_up, w_down, residual, b_gate, b_up, b_down, "geglu", dropout_p, output_dropout_p)


def _plus(y, residual):
    """``y + residual`` (the fused ops' promotion: y's dtype with residual's), or y."""
    return y if residual is None else y + residual


def _both_biases(b_gate, b_up):
    """One kernel adds both biases of a gated layer or neither: a missing one (with the other
    given) is a zero vector."""
    if (b_gate is None) == (b_up is None):
        return b_gate, b_up
    return (b_gate if b_gate is not None else torch.zeros_like(b_up),
            b_up if b_up is not None else torch.zeros_like(b_gate))


def _gated_ffn(x, w_gate, w_up, w_down, residual, b_gate, b_up, b_down, activation, dropout_p, output_dropout_p):
    _validate.tensor("x", x, min_ndim=1)
    _backend.no_dtensor(activation, x, w_gate, w_up, w_down)
    dropout_p = _validate.probability("dropout_p", dropout_p)
    output_dropout_p = _validate.probability("output_dropout_p", output_dropout_p)
    x, w_gate, w_up, w_down, b_gate, b_up, b_down = _autocast(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    _check_layer("x", x, "w_gate", w_gate, "b_gate", b_gate)
    _check_layer("x", x, "w_up", w_up, "b_up", b_up)
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    _check_second_layer(x, "w_down", w_down, "b_down", b_down, w_gate.shape[0], "w_gate's out_features")
    _check_residual(x, residual, w_down.shape[0])
    if output_dropout_p == 1.0:
        y = _gated_ffn(x, w_gate, w_up, w_down, None, b_gate, b_up, b_down, activation, dropout_p, 0.0)
        return _plus(_backend.drop_all(y), residual)
    if dropout_p == 1.0:  # the hidden activation dropped: the GEMMs apart, torch's dropout between
        hid = gated_linear(x, w_gate, w_up, b_gate, b_up, dropout_p=1.0, activation=activation)
        return linear(hid, w_down, b_down, None, residual, output_dropout_p)
    if not _backend.use_triton(x):
        return reference.gated_ffn(x, w_gate, w_up, w_down, residual, b_gate=b_gate, b_up=b_up, b_down=b_down,
                                   activation=activation, dropout_p=dropout_p, output_dropout_p=output_dropout_p)
    b_gate, b_up = _both_biases(b_gate, b_up)
    return _ffn(x, w_gate, w_up, b_gate, b_up, w_down, b_down, residual, activation, dropout_p, output_dropout_p,
                False)


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------

def _torch_dtype(x) -> bool:
    """A floating-point dtype the kernels do not take (float64): the modules run the plain
    PyTorch reference, as torch's modules would compute it."""
    return isinstance(x, Tensor) and x.is_floating_point() and x.dtype not in _validate.FLOAT_DTYPES


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with a fused activation (and an optional residual in ``forward``).

    Same constructor (plus ``activation``), parameters and state dict as ``torch.nn.Linear``.
    """

    __prepare_scriptable__ = _backend.not_scriptable

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, activation: Optional[str] = None):
        _check_activation(activation)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, input: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        if _torch_dtype(input):
            return reference.linear(input, self.weight, self.bias, self.activation, residual)
        return linear(input, self.weight, self.bias, self.activation, residual)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


def lora_ffn(x, linear1, linear2, activation, residual, p_in, p_out, lin, gated, hidden=None):
    """``dropout(linear2(dropout(act(linear1(x))))) + residual`` with PEFT LoRA on linear1
    and/or linear2 (:mod:`fused_block.lora`), for :class:`MLP` and the Transformer layers' FFN
    (``blocks._LayerMixin._ffn_lora``): each GEMM takes its adapters' low-rank update in its
    reduction; the hidden activation is materialized between them, since linear2's adapters
    (and their dropout) read it.

    ``activation``: the first GEMM's epilogue (a name, or None), a gated one (:data:`GATED`)
    on linear1's [gate; up] rows; or, with ``hidden`` (a layer's custom activation callable
    and its dropout, which run between the GEMMs), ``hidden(linear1(x))`` instead. ``lin`` and
    ``gated``: :func:`linear` and :func:`gated_linear`, or the reference's (float64)."""
    base1, base2 = lora.base(linear1), lora.base(linear2)
    t1 = lora.terms(linear1, x)
    w1, b1 = base1.weight, base1.bias
    if hidden is not None:
        hid = hidden(lin(x, w1, b1, lora=t1))
    elif activation in GATED:
        hid = gated(x, *_gate_up_views(w1, b1), dropout_p=p_in, lora=lora.split_rows(t1, w1.shape[0] // 2),
                    activation=activation)
    else:
        hid = lin(x, w1, b1, activation, None, p_in, lora=t1)
    return lin(hid, base2.weight, base2.bias, None, residual, p_out, lora=lora.terms(linear2, hid))


class MLP(torch.nn.Module):
    """The feed-forward block ``linear2(act(linear1(x)))`` (+ residual) of a Transformer layer.

    Parameters are named like ``torch.nn.TransformerEncoderLayer``'s: ``linear1`` (d_model ->
    dim_feedforward; 2 * dim_feedforward for ``activation="swiglu"``: gate rows then up rows)
    and ``linear2`` (dim_feedforward -> d_model), so their state dict keys match (``"geglu"``
    as ``"swiglu"``). ``dropout``
    is applied, as in torch's layer, to the hidden activation and to the block's output
    (before the residual add), both fused into the GEMM epilogues; only in training mode.
    PEFT's LoRA wrappers on linear1/linear2 run in the GEMMs (:mod:`fused_block.lora`); what
    the fused forward does not reproduce (LoRA variants, hooks, other linear classes: the
    guard, :func:`fused_block._guard.reason`) makes it call linear1 and linear2, warning once.
    """

    __prepare_scriptable__ = _backend.not_scriptable

    def __init__(self, d_model: int, dim_feedforward: int, activation: Optional[str] = "gelu",
                 bias: bool = True, dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        _check_activation(activation, MLP_ACTIVATIONS)
        dropout = _validate.probability("dropout", dropout)
        width = 2 * dim_feedforward if activation in GATED else dim_feedforward
        self.linear1 = torch.nn.Linear(d_model, width, bias, device=device, dtype=dtype)
        self.linear2 = torch.nn.Linear(dim_feedforward, d_model, bias, device=device, dtype=dtype)
        self.activation = activation
        self.dropout = dropout

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        p = self.dropout if self.training else 0.0
        reason = _guard.reason(self, _describe_mlp)
        if reason is not None:
            _backend.warn_once(("MLP", reason), "fused_block: MLP runs its unfused forward, calling linear1 and "
                               f"linear2 (slower, the same answer as those modules give): {reason}")
            return self._unfused(x, residual, p)
        l1, l2 = self._modules["linear1"], self._modules["linear2"]
        if lora.is_lora(l1) or lora.is_lora(l2):
            return self._lora_forward(x, residual, p)
        fn = reference.mlp if _torch_dtype(x) else mlp
        return fn(x, l1.weight, l1.bias, l2.weight, l2.bias, self.activation, residual, p, p)

    def _lora_forward(self, x, residual, p):
        """PEFT LoRA on linear1 and/or linear2: :func:`lora_ffn`, as the layers' FFN."""
        ref = _torch_dtype(x)
        return lora_ffn(x, self._modules["linear1"], self._modules["linear2"], self.activation, residual, p, p,
                        reference.linear if ref else linear, reference.gated if ref else gated_linear)

    def _unfused(self, x, residual, p):
        """``linear2(act(linear1(x)))`` calling the submodules (their hooks, adapters and
        subclasses act), with the dropouts and residual of the fused forward."""
        h = self.linear1(x)
        if self.activation in GATED:
            gate, up = h.chunk(2, dim=-1)
            h = reference.gate_activation(gate, self.activation) * up
        else:
            h = reference.activation(h, self.activation)
        y = self.linear2(F.dropout(h, p, training=True) if p > 0 else h)
        return _plus(F.dropout(y, p, training=True) if p > 0 else y, residual)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}"


def _describe_mlp(block):
    """The guard's spec (:func:`fused_block._guard.reason`) of an :class:`MLP`: the fused forward
    reads linear1's and linear2's weights (a PEFT LoRA wrapper's parts through
    :func:`fused_block.lora.spec`) instead of calling them."""
    spec, skip, wrapped = {}, [], []
    for name in ("linear1", "linear2"):
        entries, called = lora.spec(name, getattr(block, name), (torch.nn.Linear,))
        spec.update(entries)
        skip.extend(called)
        if lora.is_lora(getattr(block, name)):
            wrapped.append(name)
    why, watched = _guard.scan(block, spec, skip)
    return why, watched, lora.live(block, wrapped) if wrapped else None
