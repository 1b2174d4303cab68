"""A converted ``TransformerEncoderLayer``'s training step as one autograd Function.

The layer's fused forward (``blocks.TransformerEncoderLayer._fused_forward``) calls five ops:
two add+norms, the QKV and output projections around the attention, and the FFN. Each op is
an autograd Function of its own (the projections on cuBLAS are torch's ``F.linear``), with
its own validation, dispatch and bookkeeping in the forward, and its own node for the
autograd engine to call in the backward. For the layers of small and medium models that
Python is the step's cost on the host (``python -m bench --only host``).

:class:`_LayerStep` runs the same ops, in the same order, with the same arguments, as one
Function: its forward calls the ops' forward implementations (``norm._forward``,
``attention_packed_fwd``, ``linear._ffn_fwd``, the projections' ``F.linear`` or
``linear._linear_fwd``) and keeps what their backwards read; its backward calls their backward
implementations in reverse order and hands the gradients on between them, as the engine did.
The device runs the same kernels, launched with the same arguments, so the values are the
same to the bit (``tests/test_step.py`` compares the two paths).

:func:`plan` decides per call whether the step applies: where it does not, the layer runs its
ops one by one as before. It applies to the common training configuration (autograd
recording; the kernels' path on a kernel dtype; no autocast, ``torch.compile``, tracing,
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
                 "p_attn", "p1", "p_ff", "p2", "activation", "gated", "torch_in", "torch_out", "grad")


def _param(module, name):
    reg = module._parameters
    return reg[name] if name in reg else getattr(module, name)


def _plain(t, dtype, device, shape) -> bool:
    return type(t) in _TENSOR_TYPES and t.dtype is dtype and t.shape == shape and t.device == device


def plan(layer, attn, x, key_padding_mask, causal, p_attn, p1, p_ff, p2):
    """``(params, plan)`` where :func:`run` applies to this call of ``layer`` (a converted
    ``TransformerEncoderLayer``, with ``attn`` its ``self_attn``) on the batched input ``x`` with
    these resolved masks (``causal``; ``key_padding_mask`` bool (B, L) or None) and dropout
    probabilities (0 where off), else None (the ops run one by one)."""
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
    B, L = (x.shape[0], x.shape[1]) if attn.batch_first else (x.shape[1], x.shape[0])
    if key_padding_mask is not None and not (key_padding_mask.dtype is torch.bool and key_padding_mask.dim() == 2
                                             and key_padding_mask.device == device):
        return None
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
    # Every op's candidate: our norm kernels, our packed attention, the projections on torch or ours.
    n1b, n2b = params[1], params[7]
    res1, res2 = (None, x) if pre else (x, x)
    if not (_norm.kernel_chosen(x, res1, params[0], n1b, 0.0 if pre else p1, is_rms, not pre, norm_grads[0])
            and _norm.kernel_chosen(x, res2, params[6], n2b, p1 if pre else p2, is_rms, False, norm_grads[1])
            and packed_kernel_chosen(device, dtype, B, L, H, Hkv, D, causal, key_padding_mask, p_attn, qkv_grad)):
        return None
    p = _Plan()
    p.torch_in = dispatch.projection_on_torch(x, params[2], params[3], in_x_grad, rg[3])
    p.torch_out = dispatch.projection_on_torch(x, params[4], params[5], qkv_grad, rg[5])
    p.norm_first, p.is_rms, p.eps1, p.eps2 = pre, is_rms, eps1, eps2
    p.heads, p.kv_heads, p.batch_first, p.causal = H, Hkv, attn.batch_first, bool(causal)
    p.scale = 1.0 / math.sqrt(D)  # as attention_qkvpacked's default
    p.p_attn, p.p1, p.p_ff, p.p2 = _dropout_p(p_attn), float(p1), float(p_ff), float(p2)
    p.activation, p.gated, p.grad = name, gated, grad
    return params, p


def run(x, params, key_padding_mask, p):
    """The layer's output for ``x`` (its step's Function), the seeds of its dropouts drawn in the
    op-by-op path's order (inside the layer's seed block): the attention's, drop1's (Pre-LN:
    norm2's; Post-LN: norm1's), the FFN hidden activation's, drop2's (Pre-LN: the FFN output's;
    Post-LN: norm2's)."""
    device = x.device
    seeds = [_backend.dropout_seed(q, device) if q > 0 else None for q in (p.p_attn, p.p1, p.p_ff, p.p2)]
    if p.grad:
        return _LayerStep_apply(x, *params, key_padding_mask, *seeds, p)
    return _forward(None, _NO_GRADS, x, *params, key_padding_mask, *seeds, p)  # nothing to differentiate


_NO_GRADS = (False,) * 19


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


class _LayerStep(torch.autograd.Function):
    """Inputs: x, the 12 parameters of :data:`PARAMS` (None where absent), the key padding
    mask, the dropouts' seeds (attention, drop1, FFN hidden, drop2; None where off) and the
    :class:`_Plan`. Returns the layer's output in x's shape."""

    @staticmethod
    def forward(ctx, *args):
        return _forward(ctx, ctx.needs_input_grad, *args)


    @staticmethod
    @_backend.once_differentiable
    def backward(ctx, dy):
        grads = [None] * 19
        if dy is None:
            return tuple(grads)
        (norm1_h, n1w, mean1, rstd1, s1, proj_in, inw, qkv, o, lse, kpm, s_attn, ow, norm2_h, n2w, mean2, rstd2, s2,
         ffn_in, w1, w2, saved, s_ff) = ctx.saved_tensors
        p, ni = ctx.p, ctx.needs_input_grad
        dtype = norm1_h.dtype
        E = ctx.shape[-1]
        w1g, w1u = (w1[:w1.shape[0] // 2], w1[w1.shape[0] // 2:]) if p.gated and w1 is not None else (w1, None)
        need_w1, need_b1, need_w2, need_b2 = ni[9], ni[10], ni[11], ni[12]
        if p.norm_first:
            need_n1 = ni[0] or ni[1] or ni[2]
            need_qkv = need_n1 or ni[3] or ni[4]
            need_a = need_qkv or ni[5] or ni[6]
            ffn_need_x = need_a or ni[0] or ni[7] or ni[8]
            g = _linear_rows(dy)
            dn2, grads[9], grads[10], grads[11], grads[12] = _ffn_grads(
                g, ffn_in, w1g, w1u, w2, saved, s_ff, s2, p, p.p2, ctx.save, E, ffn_need_x, need_w1, need_b1, need_w2,
                need_b2)
            if not ffn_need_x:
                return tuple(grads)
            # norm2: out's gradient from the FFN, residual_out's (h, the FFN's residual) dy itself
            separate = ni[0] and p.p1 > 0  # x's gradient through drop1 differs from a's
            outs = _norm._add_norm_bwd(_norm._rows(dn2.view(dy.shape)), None, _norm._rows(dy), norm2_h, n2w, mean2,
                                       rstd2, s1, p.p1, p.is_rms, dtype, dtype if separate else None,
                                       dtype if ni[7] else None, dtype if ni[8] else None)
            da, dres = outs[0], outs[1] if separate else outs[0]
            _norm_param_grads(grads, outs, 2 if separate else 1, ni[7], ni[8], 7)
            if not need_a:  # (x's gradient needs the attention's: need_a holds when x needs one)
                return tuple(grads)
            dn1 = _attention_grads(grads, da, proj_in, qkv, o, lse, kpm, s_attn, inw, ow, p, need_qkv, need_n1, ni)
            if need_n1:
                outs = _norm._add_norm_bwd(_norm._rows(dn1), None, _norm._rows(dres) if ni[0] else None, norm1_h,
                                           n1w, mean1, rstd1, None, 0.0, p.is_rms, dtype, None,
                                           dtype if ni[1] else None, dtype if ni[2] else None)
                _norm_param_grads(grads, outs, 1, ni[1], ni[2], 1)
                grads[0] = outs[0].view(ctx.shape) if ni[0] else None
            return tuple(grads)
        # Post-LN: y = LN2(h + drop2(f)), f = FFN(h), h = LN1(x + drop1(a))
        need_qkv = ni[0] or ni[3] or ni[4]
        need_a = need_qkv or ni[5] or ni[6]
        need_h = need_a or ni[0] or ni[1] or ni[2]
        separate2 = need_h and p.p2 > 0
        outs = _norm._add_norm_bwd(_norm._rows(dy), None, None, norm2_h, n2w, mean2, rstd2, s2, p.p2, p.is_rms,
                                   dtype, dtype if separate2 else None, dtype if ni[7] else None,
                                   dtype if ni[8] else None)
        df, dr = outs[0], outs[1] if separate2 else outs[0]
        _norm_param_grads(grads, outs, 2 if separate2 else 1, ni[7], ni[8], 7)
        dh, grads[9], grads[10], grads[11], grads[12] = _ffn_grads(
            _linear_rows(df), ffn_in, w1g, w1u, w2, saved, s_ff, None, p, 0.0, ctx.save, E, need_h, need_w1, need_b1,
            need_w2, need_b2)
        if not need_h:
            return tuple(grads)
        # norm1: out's gradient from the FFN, and from its alias, the residual of norm2
        separate1 = ni[0] and p.p1 > 0
        outs = _norm._add_norm_bwd(_norm._rows(dh.view(dy.shape)), _norm._rows(dr), None, norm1_h, n1w, mean1, rstd1,
                                   s1, p.p1, p.is_rms, dtype, dtype if separate1 else None, dtype if ni[1] else None,
                                   dtype if ni[2] else None)
        da, dres = outs[0], outs[1] if separate1 else outs[0]
        _norm_param_grads(grads, outs, 2 if separate1 else 1, ni[1], ni[2], 1)
        if need_a:
            dx = _attention_grads(grads, da, proj_in, qkv, o, lse, kpm, s_attn, inw, ow, p, need_qkv, ni[0], ni)
            if ni[0]:
                grads[0] = dx + dres
        elif ni[0]:
            grads[0] = dres
        return tuple(grads)


def _forward(ctx, ni, x, n1w, n1b, inw, inb, ow, ob, n2w, n2b, w1, b1, w2, b2, kpm, s_attn, s1, s_ff, s2, p):
    """The step's forward (``ni``: which inputs need a gradient); with ``ctx`` it keeps what the
    backward reads, without (nothing to differentiate: autograd off, or no input that requires
    a gradient) it is the ops' forwards alone, as the ops run without their Functions."""
    dtype = x.dtype
    unit = common.unit
    n1w, n1b, n2w, n2b = unit(n1w), unit(n1b), unit(n2w), unit(n2b)
    gated = p.gated
    w1g, w1u, b1g, b1u = _gate_up_views(w1, b1) if gated else (w1, None, b1, None)
    if p.norm_first:
        need_n1 = ni[0] or ni[1] or ni[2]
        need_qkv = need_n1 or ni[3] or ni[4]
        need_a = need_qkv or ni[5] or ni[6]
        need_n2 = need_a or ni[0] or ni[7] or ni[8]  # FFN's input (the gradient reaching norm2)
        n1, _, outs1 = _norm._forward(x, None, (n1w, n1b, None, p.eps1, 0.0, p.is_rms, dtype, False, False))
        qkv = _project(n1, inw, inb, p.torch_in)
        o, lse = attention_packed_fwd(unit(qkv), p.heads, p.kv_heads, p.batch_first, kpm, s_attn, p.causal,
                                      p.scale, p.p_attn, -1, -1)
        a = _project(o, ow, ob, p.torch_out)
        n2, h, outs2 = _norm._forward(a, x, (n2w, n2b, s1, p.eps2, p.p1, p.is_rms, dtype, True, False))
        ffn_in, ffn_res, ffn_need_x, need_in = n2, h, need_n2, need_n1
        norm1_h, norm2_h = x, outs2[1]
    else:
        need_qkv = ni[0] or ni[3] or ni[4]
        need_a = need_qkv or ni[5] or ni[6]
        need_h = need_a or ni[0] or ni[1] or ni[2]  # FFN's input (norm1's output)
        n1 = None
        qkv = _project(x, inw, inb, p.torch_in)
        o, lse = attention_packed_fwd(unit(qkv), p.heads, p.kv_heads, p.batch_first, kpm, s_attn, p.causal,
                                      p.scale, p.p_attn, -1, -1)
        a = _project(o, ow, ob, p.torch_out)
        h, _, outs1 = _norm._forward(a, x, (n1w, n1b, s1, p.eps1, p.p1, p.is_rms, dtype, True, False))
        ffn_in, ffn_res, ffn_need_x, need_in = h, None, need_h, ni[0]
        norm1_h = outs1[1]
    need_w1, need_b1, need_w2, need_b2 = ni[9], ni[10], ni[11], ni[12]
    need_hidden = ffn_need_x or need_w1 or need_b1
    save = SAVE_PRE if need_hidden else (SAVE_H if need_w2 else SAVE_NONE)
    f, saved = _ffn_fwd(ffn_in, w1g, w1u, b1g, b1u, w2, b2, ffn_res, p.activation, save, s_ff, p.p_ff,
                        s2 if p.norm_first else None, p.p2 if p.norm_first else 0.0)
    if p.norm_first:
        y = f
    else:
        y, _, outs2 = _norm._forward(f, h, (n2w, n2b, s2, p.eps2, p.p2, p.is_rms, dtype, True, False))
        norm2_h = outs2[1]
    if ctx is None:
        return y
    ctx.set_materialize_grads(False)
    mean1, rstd1 = _mean_rstd(outs1, p.is_rms)
    mean2, rstd2 = _mean_rstd(outs2, p.is_rms)
    # What each op's backward reads (each weight only where a gradient reads it, as the ops save them).
    proj_in = n1 if p.norm_first else x
    ctx.save_for_backward(
        norm1_h, n1w, mean1, rstd1, s1,
        proj_in if ni[3] else None, inw if need_in else None,
        qkv if need_qkv else None, o if need_qkv or ni[5] else None, lse if need_qkv else None,
        kpm if need_qkv else None, s_attn if need_qkv else None, ow if need_qkv else None,
        norm2_h, n2w, mean2, rstd2, s2,
        ffn_in if need_w1 else None, w1 if ffn_need_x else None, w2 if need_hidden else None,
        saved if save != SAVE_NONE else None, s_ff if need_hidden else None)
    ctx.p, ctx.save, ctx.shape = p, save, x.shape
    return y


_LayerStep_apply = _library.fast_apply(_LayerStep)


def _norm_param_grads(grads, outs, i, need_w, need_b, slot):
    """Place a norm's weight and bias gradients (``outs`` from ``i`` on) in ``grads[slot]`` and
    ``grads[slot + 1]``."""
    if need_w:
        grads[slot], i = outs[i], i + 1
    if need_b:
        grads[slot + 1] = outs[i]


def _ffn_grads(g, x, w1, w1_up, w2, saved, seed, output_seed, p, output_p, save, d_in, need_x, need_w1, need_b1,
               need_w2, need_b2):
    """``(dx, dw1, db1, dw2, db2)`` of the FFN (None where not needed), as ``mlp``'s Function
    computes them (the gated layer's w1 as [gate; up], its gradients stacked likewise)."""
    if not (need_x or need_w1 or need_b1 or need_w2 or need_b2):
        return None, None, None, None, None
    dx, dw1, db1, dw2, db2 = _ffn_bwd(g, x, w1, w1_up, w2, saved, seed, output_seed, p.activation, p.p_ff, output_p,
                                      save, d_in, need_x, need_w1, need_b1, need_w2, need_b2)
    return (dx if need_x else None, dw1 if need_w1 else None, db1 if need_b1 else None, dw2 if need_w2 else None,
            db2 if need_b2 else None)


def _attention_grads(grads, da, proj_in, qkv, o, lse, kpm, s_attn, inw, ow, p, need_qkv, need_in, ni):
    """Through the output projection, the attention and the QKV projection, from ``da`` (the
    attention block's output gradient), as their ops compute it; the projections' parameter
    gradients into ``grads[3:7]``. Returns the QKV projection's input gradient where
    ``need_in``, else None."""
    do, grads[5], grads[6] = _project_bwd(da, o, ow, p.torch_out, need_qkv, ni[5], ni[6])
    if not need_qkv:
        return None
    dqkv = attention_packed_bwd(common.unit(do), qkv, o, lse, None, p.heads, p.kv_heads, p.batch_first, kpm,
                                      s_attn, p.causal, p.scale, p.p_attn, -1, -1)
    din, grads[3], grads[4] = _project_bwd(dqkv, proj_in, inw, p.torch_in, need_in, ni[3], ni[4])
    return din
