"""A converted ``TransformerEncoderLayer``'s training step as two autograd Functions.

The layer's fused forward (``blocks.TransformerEncoderLayer._fused_forward``) calls five ops:
two add+norms, the QKV and output projections around the attention, and the FFN. Each op is
an autograd Function of its own (the projections on cuBLAS are torch's ``F.linear``), with
its own validation, dispatch and bookkeeping in the forward, and its own node for the
autograd engine to call in the backward. For the layers of small and medium models that
Python is the step's cost on the host (``python -m bench --only host``).

:func:`run` runs the same ops, in the same order, with the same arguments, as two Functions:
each one's forward calls the ops' forward implementations (``norm._forward``,
``attention_packed_fwd``, ``linear._ffn_fwd``, the projections' ``F.linear`` or
``linear._linear_fwd``) and keeps what their backwards read; its backward calls their backward
implementations in reverse order and hands the gradients on between them, as the engine did.
The device runs the same kernels, launched with the same arguments, so the values are the same
to the bit (``tests/test_step.py`` compares the two paths).

Two Functions, not one, for memory: a Function's saved tensors live until its whole backward
has run, the ops' until their own has. The split puts the step's peak (the FFN's backward) where
the ops' is, holding what the ops hold then: Pre-LN, the attention block (the first norm, the
projections, the attention) and the FFN block (the second norm, the FFN); Post-LN, everything up
to the FFN's output, and the second norm, whose saved sum is freed before the FFN's backward.
The peak is then the ops' (``tests/test_step.py`` records every allocation of both). Where a
tensor feeds both Functions (Pre-LN's x: the first norm and, as the residual, the second;
Post-LN's h: the FFN and the second norm's residual) the first returns it again as a second
output, so its two gradients arrive apart and the first norm's backward kernel sums them, as
the ops' first norm does.

:func:`plan` decides per call whether the step applies: where it does not, the layer runs its
ops one by one as before. It applies to the common configurations, training or not (with
nothing to differentiate, the Functions' forwards alone run, as the ops then run without
theirs): the kernels' path on a kernel dtype; no autocast, ``torch.compile``, tracing,
tensor parallelism, RoPE, LoRA, torch's extra keys, custom activation callables, dropout of 1,
or masks other than causal and key padding), and only where every op's choice of candidate
is known and names the path the step runs (our norm kernels, our packed attention kernels;
a projection on torch's ``F.linear`` or on ``linear``'s own Function): a choice still to be
timed is timed by the op-by-op path on that call.
"""
import math
import os

import torch
import torch.nn.functional as F

from fused_block import _backend, _library, dispatch
from fused_block import norm as _norm
from fused_block.attention import MAX_FP32_HEAD_DIM, MAX_HEAD_DIM, MIN_HEAD_DIM, _dropout_p
from fused_block.attention import attention_packed_bwd, attention_packed_fwd, packed_kernel_chosen
from fused_block.kernels import common
from fused_block.linear import GATED, SAVE_H, SAVE_NONE, SAVE_PRE, _ffn_bwd, _ffn_fwd, _gate_up_views
from fused_block.linear import _linear_bwd, _linear_fwd
from fused_block.linear import _rows as _linear_rows

# FUSED_BLOCK_LAYER_STEP=0 runs every layer's ops one by one (the tests compare the two paths).
ENABLED = os.environ.get("FUSED_BLOCK_LAYER_STEP", "1") != "0"
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # plain tensors: no subclass (DTensor, ...) takes the step
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The parameters in the Function's order (after x), as (submodule, parameter) names.
PARAMS = (("norm1", "weight"), ("norm1", "bias"), ("self_attn", "in_proj_weight"), ("self_attn", "in_proj_bias"),
          ("out_proj", "weight"), ("out_proj", "bias"), ("norm2", "weight"), ("norm2", "bias"),
          ("linear1", "weight"), ("linear1", "bias"), ("linear2", "weight"), ("linear2", "bias"))
_compiling = torch.compiler.is_compiling
_tracing = torch._C._get_tracing_state
_transforms_active = torch._C._are_functorch_transforms_active
_any_autocast = torch._C._is_any_autocast_enabled


class _Plan:
    """What a step needs besides its tensors (built by :func:`plan`, read by the Function)."""

    __slots__ = ("norm_first", "is_rms", "eps1", "eps2", "heads", "kv_heads", "batch_first", "causal", "scale",
                 "p_attn", "p1", "p_ff", "p2", "activation", "gated", "torch_in", "torch_out", "grad", "head_dim",
                 "qkv_grad")


def _param(module, name):
    reg = module._parameters
    return reg[name] if name in reg else getattr(module, name)


def _plain(t, dtype, device, shape) -> bool:
    return type(t) in _TENSOR_TYPES and t.dtype is dtype and t.shape == shape and t.device == device


def plan(layer, attn, x, p_attn, p1, p_ff, p2):
    """``(params, plan)`` where :func:`run` may apply to this call of ``layer`` (a converted
    ``TransformerEncoderLayer``, with ``attn`` its ``self_attn``) on the batched input ``x`` with
    these dropout probabilities (0 where off), else None (the ops run one by one); then
    :func:`takes` decides with the call's resolved masks."""
    if _compiling() or _tracing() is not None or _transforms_active() or _any_autocast():
        return None
    dtype, device = x.dtype, x.device
    if dtype not in _KERNEL_DTYPES or not _backend.use_triton(x) or not x.is_contiguous() or x.dim() != 3:
        return None
    if not (p_attn < 1 and p1 < 1 and p_ff < 1 and p2 < 1):
        return None
    if not attn._qkv_same_embed_dim or attn.bias_k is not None or attn.add_zero_attn or attn.rope:
        return None
    mods = layer._modules
    name = layer._activation()
    if name is None:
        return None
    n1, n2, l1, l2, out = mods["norm1"], mods["norm2"], mods["linear1"], mods["linear2"], attn._modules["out_proj"]
    if type(l1) is not torch.nn.Linear or type(l2) is not torch.nn.Linear:
        return None  # LoRA and other wrappers: the op-by-op path handles them
    is_rms = layer.norm != "layer"
    eps1, eps2 = n1.eps, n2.eps
    if type(eps1) is not float or type(eps2) is not float:
        return None
    E = x.shape[-1]
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if D * H != E or (dtype is torch.float32 and D > MAX_FP32_HEAD_DIM) or not (
            MIN_HEAD_DIM <= D <= MAX_HEAD_DIM and D % 8 == 0):
        return None
    gated = name in GATED
    F1 = l1.out_features
    Fh = F1 // 2 if gated else F1
    shapes = ((E,), (E,), ((H + 2 * Hkv) * D, E), ((H + 2 * Hkv) * D,), (E, E), (E,), (E,), (E,), (F1, E), (F1,),
              (E, Fh), (E,))
    modules = (n1, n1, attn, attn, out, out, n2, n2, l1, l1, l2, l2)
    params = []
    for (_, pname), module, shape in zip(PARAMS, modules, shapes):
        t = None if is_rms and pname == "bias" and (module is n1 or module is n2) else _param(module, pname)
        if t is not None and not _plain(t, dtype, device, shape):
            return None
        params.append(t)
    if gated and F1 % 2:
        return None
    grad = torch.is_grad_enabled()
    rg = [grad and x.requires_grad] + [grad and t is not None and t.requires_grad for t in params]
    grad = any(rg)  # else the ops run without their Functions, as here the step's forward alone
    pre = layer.norm_first
    # Which inputs of each op require a gradient on the op-by-op path.
    if pre:
        n1_grad = rg[0] or rg[1] or rg[2]
        qkv_grad = n1_grad or rg[3] or rg[4]
        a_grad = qkv_grad or rg[5] or rg[6]
        norm_grads = (n1_grad, a_grad or rg[0] or rg[7] or rg[8])
        in_x_grad = n1_grad
    else:
        qkv_grad = rg[0] or rg[3] or rg[4]
        a_grad = qkv_grad or rg[5] or rg[6]
        h_grad = a_grad or rg[0] or rg[1] or rg[2]
        f_grad = h_grad or any(rg[9:13])
        norm_grads = (h_grad, f_grad or h_grad or rg[7] or rg[8])
        in_x_grad = rg[0]
    # Every op's candidate: our norm kernels (the attention's: takes()), the projections on torch or ours.
    n1b, n2b = params[1], params[7]
    res1, res2 = (None, x) if pre else (x, x)
    if not (_norm.kernel_chosen(x, res1, params[0], n1b, 0.0 if pre else p1, is_rms, not pre, norm_grads[0])
            and _norm.kernel_chosen(x, res2, params[6], n2b, p1 if pre else p2, is_rms, False, norm_grads[1])):
        return None
    p = _Plan()
    p.qkv_grad = qkv_grad
    p.torch_in = dispatch.projection_on_torch(x, params[2], params[3], in_x_grad, rg[3])
    p.torch_out = dispatch.projection_on_torch(x, params[4], params[5], qkv_grad, rg[5])
    p.norm_first, p.is_rms, p.eps1, p.eps2 = pre, is_rms, eps1, eps2
    p.heads, p.kv_heads, p.batch_first, p.head_dim = H, Hkv, attn.batch_first, D
    p.scale = 1.0 / math.sqrt(D)  # as attention_qkvpacked's default
    p.p_attn, p.p1, p.p_ff, p.p2 = _dropout_p(p_attn), float(p1), float(p_ff), float(p2)
    p.activation, p.gated, p.grad = name, gated, grad
    return params, p


def takes(p, masks, x) -> bool:
    """Whether the step runs the call :func:`plan` made ``p`` for, with its resolved masks
    (``blocks._Masks``): causal and key padding only (a bool (B, L) mask on x's device), and
    our packed attention the attention's choice for them (sets ``p.causal``)."""
    kpm = masks.key_padding
    if masks.general is not None or masks.hidden is not None or (
            kpm is not None and not (kpm.dtype is torch.bool and kpm.dim() == 2 and kpm.device == x.device)):
        return False
    B, L = (x.shape[0], x.shape[1]) if p.batch_first else (x.shape[1], x.shape[0])
    if not packed_kernel_chosen(x.device, x.dtype, B, L, p.heads, p.kv_heads, p.head_dim, masks.causal, kpm, p.p_attn,
                                p.qkv_grad):
        return False
    p.causal = bool(masks.causal)
    return True


def run(x, params, key_padding_mask, p):
    """The layer's output for ``x``: the seeds of its dropouts drawn in the op-by-op path's order
    (inside the layer's seed block: the attention's, drop1's (Pre-LN: norm2's; Post-LN:
    norm1's), the FFN hidden activation's, drop2's (Pre-LN: the FFN output's; Post-LN:
    norm2's)), then the two blocks; with nothing to differentiate their forwards alone (the
    ops then run without their Functions too)."""
    device = x.device
    s_attn, s1, s_ff, s2 = [_backend.dropout_seed(q, device) if q > 0 else None
                            for q in (p.p_attn, p.p1, p.p_ff, p.p2)]
    n1w, n1b, inw, inb, ow, ob, n2w, n2b, w1, b1, w2, b2 = params
    if p.norm_first:
        if not p.grad:
            a = _pre_attention(None, _NO_GRADS, x, n1w, n1b, inw, inb, ow, ob, key_padding_mask, s_attn, p)
            return _pre_ffn(None, _NO_GRADS, a, x, n2w, n2b, w1, b1, w2, b2, s1, s_ff, s2, p)
        out = _PreAttention_apply(x, n1w, n1b, inw, inb, ow, ob, key_padding_mask, s_attn, p)
        a, x_res = out if x.requires_grad else (out, x)  # x, where it needs a gradient, as a second output
        return _PreFFN_apply(a, x_res, n2w, n2b, w1, b1, w2, b2, s1, s_ff, s2, p)
    main = (x, inw, inb, ow, ob, n1w, n1b, w1, b1, w2, b2, key_padding_mask, s_attn, s1, s_ff, p)
    if not p.grad:
        f, h = _post_main(None, _NO_GRADS, *main)
        return _post_norm2(None, _NO_GRADS, f, h, n2w, n2b, s2, p)
    f, h_res = _PostMain_apply(*main)
    return _PostNorm2_apply(f, h_res, n2w, n2b, s2, p)


_NO_GRADS = (False,) * 16


def _project(x, weight, bias, on_torch):
    """A projection's forward as ``linear`` runs it: torch's ``F.linear``, or our op."""
    if on_torch:
        return F.linear(x, weight, bias)
    x2 = _linear_rows(x)
    out = _linear_fwd(x2, weight, bias, None, "none", False, None, 0.0)[0]
    return out if x2 is x else out.view(*x.shape[:-1], weight.shape[0])


def _project_bwd(g, x, weight, on_torch, need_x, need_w, need_b):
    """``(dx, dw, db)`` of a projection (None where not needed), as its forward's path
    computes them: ``F.linear``'s autograd (``mm`` for dX and dW, ``sum`` for dB, on the
    gradient's rows) or ``linear``'s Function (``linear._linear_bwd``)."""
    n = g.shape[-1]
    if on_torch:
        g2 = g.reshape(-1, n)
        dx = torch.mm(g2, weight).view(*g.shape[:-1], weight.shape[1]) if need_x else None
        dw = torch.mm(g2.t(), x.reshape(-1, x.shape[-1])) if need_w else None
        db = torch.sum(g2, 0) if need_b else None
        return dx, dw, db
    g2 = _linear_rows(g)
    dx, dw, db = _linear_bwd(g2, _linear_rows(x) if need_w else None, weight if need_x else None, None, None,
                             "none", 0.0, need_x, need_w, need_b)
    if need_x and dx.dim() != g.dim():
        dx = dx.view(*g.shape[:-1], weight.shape[1])
    return dx if need_x else None, dw if need_w else None, db if need_b else None


def _mean_rstd(outs, is_rms):
    return (None if is_rms else outs[-2]), outs[-1]


def _attention(x_in, inw, inb, ow, ob, kpm, s_attn, p):
    """The attention sublayer's forward: ``(qkv, o, lse, a)`` (a: the output projection's)."""
    qkv = _project(x_in, inw, inb, p.torch_in)
    o, lse = attention_packed_fwd(common.unit(qkv), p.heads, p.kv_heads, p.batch_first, kpm, s_attn, p.causal,
                                  p.scale, p.p_attn, -1, -1)
    return qkv, o, lse, _project(o, ow, ob, p.torch_out)


def _attention_bwd(grads, slots, held, proj_in, qkv, o, lse, kpm, s_attn, inw, ow, p, need_qkv, need_in,
                   needs):
    """Through the output projection, the attention and the QKV projection, from ``held[0]``
    (the sublayer's output gradient, taken from the list: freed once read, unless the caller
    keeps it), as their ops compute it; the projections' parameter gradients into ``grads`` at
    ``slots`` (in_w, in_b, out_w, out_b), as ``needs`` (theirs, same order) asks. Returns the
    QKV projection's input gradient where ``need_in``, else None."""
    do, grads[slots[2]], grads[slots[3]] = _project_bwd(held.pop(), o, ow, p.torch_out, need_qkv, needs[2],
                                                        needs[3])
    if not need_qkv:
        return None
    dqkv = attention_packed_bwd(common.unit(do), qkv, o, lse, None, p.heads, p.kv_heads, p.batch_first, kpm,
                                s_attn, p.causal, p.scale, p.p_attn, -1, -1)
    del do  # each gradient freed once read, as the autograd engine frees them between the ops
    din, grads[slots[0]], grads[slots[1]] = _project_bwd(dqkv, proj_in, inw, p.torch_in, need_in, needs[0],
                                                         needs[1])
    return din


def _norm_bwd(grads, slot, dout, dout2, drout, h, weight, mean, rstd, seed, dropout_p, is_rms, need_res, need_w,
              need_b):
    """An add+norm's backward as its op runs it, from the gradients of out (``dout``, a second
    one ``dout2``) and of residual_out (``drout``): ``(dx, dresidual)``, dresidual x's own
    gradient unless dropout lies between them, None where the residual needs none; the weight's
    and bias's gradients into ``grads[slot]`` and ``grads[slot + 1]``."""
    dtype = h.dtype
    separate = need_res and dropout_p > 0
    outs = _norm._add_norm_bwd(_norm._rows(dout), _norm._rows(dout2), _norm._rows(drout), h, weight, mean, rstd, seed,
                               dropout_p, is_rms, dtype, dtype if separate else None, dtype if need_w else None,
                               dtype if need_b else None)
    i = 2 if separate else 1
    if need_w:
        grads[slot], i = outs[i], i + 1
    if need_b:
        grads[slot + 1] = outs[i]
    return outs[0], (outs[1] if separate else outs[0]) if need_res else None


def _ffn(x, w1, b1, w2, b2, residual, s_ff, s2, p2, p, need_x, need_w1, need_b1, need_w2):
    """The FFN's forward as ``mlp``'s Function runs it: ``(out, saved, save)``."""
    need_hidden = need_x or need_w1 or need_b1
    save = SAVE_PRE if need_hidden else (SAVE_H if need_w2 else SAVE_NONE)
    w1g, w1u, b1g, b1u = _gate_up_views(w1, b1) if p.gated else (w1, None, b1, None)
    out, saved = _ffn_fwd(x, w1g, w1u, b1g, b1u, w2, b2, residual, p.activation, save, s_ff, p.p_ff, s2, p2)
    return out, saved, save


def _ffn_grads(g, x, w1, w2, saved, seed, output_seed, p, output_p, save, d_in, need_x, need_w1, need_b1, need_w2,
               need_b2):
    """``(dx, dw1, db1, dw2, db2)`` of the FFN (None where not needed), as ``mlp``'s Function
    computes them (the gated layer's w1 as [gate; up], its gradients stacked likewise)."""
    if not (need_x or need_w1 or need_b1 or need_w2 or need_b2):
        return None, None, None, None, None
    w1g, w1u = (w1[:w1.shape[0] // 2], w1[w1.shape[0] // 2:]) if p.gated and w1 is not None else (w1, None)
    dx, dw1, db1, dw2, db2 = _ffn_bwd(g, x, w1g, w1u, w2, saved, seed, output_seed, p.activation, p.p_ff, output_p,
                                      save, d_in, need_x, need_w1, need_b1, need_w2, need_b2)
    return (dx if need_x else None, dw1 if need_w1 else None, db1 if need_b1 else None, dw2 if need_w2 else None,
            db2 if need_b2 else None)


# ---------------------------------------------------------------------------------------------
# Pre-LN: a = out_proj(attn(in_proj(LN1(x)))); y = h + FFN(LN2(h)), h = x + drop1(a)
# ---------------------------------------------------------------------------------------------

def _pre_attention(ctx, ni, x, n1w, n1b, inw, inb, ow, ob, kpm, s_attn, p):
    """``a``, and with ``ctx`` (the Function's forward) x again where it needs a gradient (its
    second use, the FFN block's residual, then sends its gradient to the first norm's kernel)."""
    n1w, n1b = common.unit(n1w), common.unit(n1b)
    n1, _, outs1 = _norm._forward(x, None, (n1w, n1b, None, p.eps1, 0.0, p.is_rms, x.dtype, False, False))
    qkv, o, lse, a = _attention(n1, inw, inb, ow, ob, kpm, s_attn, p)
    if ctx is None:
        return a
    need_n1 = ni[0] or ni[1] or ni[2]
    need_qkv = need_n1 or ni[3] or ni[4]
    ctx.set_materialize_grads(False)
    mean1, rstd1 = _mean_rstd(outs1, p.is_rms)
    # What each op's backward reads (each weight only where a gradient reads it, as the ops save them).
    ctx.save_for_backward(x, n1w, mean1, rstd1, n1 if ni[3] else None, inw if need_n1 else None,
                          qkv if need_qkv else None, o if need_qkv or ni[5] else None, lse if need_qkv else None,
                          kpm if need_qkv else None, s_attn if need_qkv else None, ow if need_qkv else None)
    ctx.p = p
    return (a, x) if ni[0] else a


class _PreAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        return _pre_attention(ctx, ctx.needs_input_grad, *args)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, da, dx2=None):
        grads = [None] * 10
        ni, p = ctx.needs_input_grad, ctx.p
        x, n1w, mean1, rstd1, n1, inw, qkv, o, lse, kpm, s_attn, ow = ctx.saved_tensors
        need_n1 = ni[0] or ni[1] or ni[2]
        need_qkv = need_n1 or ni[3] or ni[4]
        dn1 = None
        if da is not None:
            held, da = [da], None
            dn1 = _attention_bwd(grads, (3, 4, 5, 6), held, n1, qkv, o, lse, kpm, s_attn, inw, ow, p, need_qkv,
                                 need_n1, ni[3:7])
        drout = dx2 if ni[0] else None  # x's gradient as the FFN block's residual
        if need_n1 and (dn1 is not None or drout is not None):
            with_dout = dn1 is not None  # (the weight's and bias's gradients need out's)
            dx, _ = _norm_bwd(grads, 1, dn1, None, drout, x, n1w, mean1, rstd1, None, 0.0, p.is_rms, False,
                              ni[1] and with_dout, ni[2] and with_dout)
            grads[0] = dx if ni[0] else None
        return tuple(grads)


def _pre_ffn(ctx, ni, a, x_res, n2w, n2b, w1, b1, w2, b2, s1, s_ff, s2, p):
    """``y = h + drop2(FFN(LN2(h)))``, ``h = x + drop1(a)`` stored by the norm for its backward."""
    n2w, n2b = common.unit(n2w), common.unit(n2b)
    n2, h, outs2 = _norm._forward(a, x_res, (n2w, n2b, s1, p.eps2, p.p1, p.is_rms, a.dtype, True, False))
    need_n2 = ni[0] or ni[1] or ni[2] or ni[3]  # the second norm's output needs a gradient
    y, saved, save = _ffn(n2, w1, b1, w2, b2, h, s_ff, s2, p.p2, p, need_n2, ni[4], ni[5], ni[6])
    if ctx is None:
        return y
    need_hidden = need_n2 or ni[4] or ni[5]
    ctx.set_materialize_grads(False)
    mean2, rstd2 = _mean_rstd(outs2, p.is_rms)
    ctx.save_for_backward(outs2[1], n2w, mean2, rstd2, s1, n2 if ni[4] else None, w1 if need_n2 else None,
                          w2 if need_hidden else None, saved if save != SAVE_NONE else None,
                          s_ff if need_hidden else None, s2)
    ctx.p, ctx.save, ctx.d_in = p, save, a.shape[-1]
    return y


class _PreFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        return _pre_ffn(ctx, ctx.needs_input_grad, *args)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dy):
        grads = [None] * 12
        if dy is None:
            return tuple(grads)
        ni, p = ctx.needs_input_grad, ctx.p
        h, n2w, mean2, rstd2, s1, n2, w1, w2, saved, s_ff, s2 = ctx.saved_tensors
        need_n2 = ni[0] or ni[1] or ni[2] or ni[3]
        dn2, grads[4], grads[5], grads[6], grads[7] = _ffn_grads(
            _linear_rows(dy), n2, w1, w2, saved, s_ff, s2, p, p.p2, ctx.save, ctx.d_in, need_n2, ni[4], ni[5], ni[6],
            ni[7])
        if need_n2:
            # out's gradient from the FFN; residual_out's (h, the FFN's residual) is dy itself
            da, grads[1] = _norm_bwd(grads, 2, dn2.view(dy.shape), None, dy, h, n2w, mean2, rstd2, s1, p.p1, p.is_rms,
                                     ni[1], ni[2], ni[3])
            grads[0] = da if ni[0] else None
        return tuple(grads)


# ---------------------------------------------------------------------------------------------
# Post-LN: h = LN1(x + drop1(out_proj(attn(in_proj(x))))); y = LN2(h + drop2(FFN(h)))
# The blocks: everything up to the FFN's output, then the second norm (whose saved tensors its
# backward frees before the FFN's backward, the step's peak, as the ops' second norm does).
# ---------------------------------------------------------------------------------------------

def _post_main(ctx, ni, x, inw, inb, ow, ob, n1w, n1b, w1, b1, w2, b2, kpm, s_attn, s1, s_ff, p):
    """``(f, h)``: the FFN's output and its input h = LN1(x + drop1(a)), the second norm's
    residual (with ``ctx``: an alias of h, a second output, which needs a gradient where h's
    own ops would give it one)."""
    n1w, n1b = common.unit(n1w), common.unit(n1b)
    qkv, o, lse, a = _attention(x, inw, inb, ow, ob, kpm, s_attn, p)
    h, _, outs1 = _norm._forward(a, x, (n1w, n1b, s1, p.eps1, p.p1, p.is_rms, x.dtype, True, False))
    del a  # (the ops' lifetimes: nothing reads it past its norm)
    need_qkv = ni[0] or ni[1] or ni[2]
    need_h = need_qkv or ni[0] or ni[3] or ni[4] or ni[5] or ni[6]  # the first norm's output needs a gradient
    f, saved, save = _ffn(h, w1, b1, w2, b2, None, s_ff, None, 0.0, p, need_h, ni[7], ni[8], ni[9])
    if ctx is None:
        return f, h
    need_hidden = need_h or ni[7] or ni[8]
    ctx.set_materialize_grads(False)
    mean1, rstd1 = _mean_rstd(outs1, p.is_rms)
    ctx.save_for_backward(outs1[1], n1w, mean1, rstd1, s1, x if ni[1] else None, inw if ni[0] else None,
                          qkv if need_qkv else None, o if need_qkv or ni[3] else None, lse if need_qkv else None,
                          kpm if need_qkv else None, s_attn if need_qkv else None, ow if need_qkv else None,
                          h if ni[7] else None, w1 if need_h else None, w2 if need_hidden else None,
                          saved if save != SAVE_NONE else None, s_ff if need_hidden else None)
    ctx.p, ctx.save, ctx.d_in = p, save, x.shape[-1]
    h_res = h.view_as(h)  # a view: the same tensor twice would have autograd sum the two
    if not need_h:
        ctx.mark_non_differentiable(h_res)  # as the ops' first norm output, which nothing differentiates
    return f, h_res


class _PostMain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        return _post_main(ctx, ctx.needs_input_grad, *args)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, df, dh2):
        grads = [None] * 17
        ni, p = ctx.needs_input_grad, ctx.p
        (h1, n1w, mean1, rstd1, s1, x, inw, qkv, o, lse, kpm, s_attn, ow, h, w1, w2, saved,
         s_ff) = ctx.saved_tensors
        need_qkv = ni[0] or ni[1] or ni[2]
        need_a = need_qkv or ni[3] or ni[4]
        need_h = need_a or ni[0] or ni[5] or ni[6]
        dh = None
        if df is not None:
            dh, grads[7], grads[8], grads[9], grads[10] = _ffn_grads(
                _linear_rows(df), h, w1, w2, saved, s_ff, None, p, 0.0, ctx.save, ctx.d_in, need_h, ni[7], ni[8],
                ni[9], ni[10])
            df = None
        if dh is None:  # the first norm: out's gradient from the FFN and from its alias, the second norm's residual
            dh, dh2 = dh2, None
        if not need_h or dh is None:
            return tuple(grads)
        da, dres = _norm_bwd(grads, 5, dh.view(h1.shape), dh2, None, h1, n1w, mean1, rstd1, s1, p.p1, p.is_rms,
                             ni[0], ni[5], ni[6])
        dh = dh2 = None
        if need_a:
            held, da = [da], None
            dx = _attention_bwd(grads, (1, 2, 3, 4), held, x, qkv, o, lse, kpm, s_attn, inw, ow, p, need_qkv, ni[0],
                                ni[1:5])
            if ni[0]:
                grads[0] = dx + dres
        return tuple(grads)


def _post_norm2(ctx, ni, f, h_res, n2w, n2b, s2, p):
    """``y = LN2(h + drop2(f))``, the sum stored by the norm for its backward."""
    n2w, n2b = common.unit(n2w), common.unit(n2b)
    y, _, outs2 = _norm._forward(f, h_res, (n2w, n2b, s2, p.eps2, p.p2, p.is_rms, f.dtype, True, False))
    if ctx is None:
        return y
    ctx.set_materialize_grads(False)
    mean2, rstd2 = _mean_rstd(outs2, p.is_rms)
    ctx.save_for_backward(outs2[1], n2w, mean2, rstd2, s2)
    ctx.p = p
    return y


class _PostNorm2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        return _post_norm2(ctx, ctx.needs_input_grad, *args)

    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dy):
        grads = [None] * 6
        if dy is None:
            return tuple(grads)
        ni, p = ctx.needs_input_grad, ctx.p
        r2, n2w, mean2, rstd2, s2 = ctx.saved_tensors
        df, grads[1] = _norm_bwd(grads, 2, dy, None, None, r2, n2w, mean2, rstd2, s2, p.p2, p.is_rms, ni[1], ni[2],
                                 ni[3])
        grads[0] = df if ni[0] else None
        return tuple(grads)


_PreAttention_apply = _library.fast_apply(_PreAttention)
_PreFFN_apply = _library.fast_apply(_PreFFN)
_PostMain_apply = _library.fast_apply(_PostMain)
_PostNorm2_apply = _library.fast_apply(_PostNorm2)
