"""Drop-in ``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` on the fused kernels.

The layers subclass torch's and keep their constructors, defaults, parameter names,
initialization and state dicts (``self_attn.in_proj_weight``, ``self_attn.out_proj``,
``linear1``, ``linear2``, ``norm1``..``norm3``, ``multihead_attn``), so either loads the
other's weights. Added keywords: ``norm="layer" | "rms"``, ``num_kv_heads`` (GQA), ``rope``
(rotary embeddings in self-attention, with ``rope_base`` and ``rope_interleaved``), and
``activation="swiglu"`` (``linear1`` holds [gate; up], 2 x dim_feedforward rows, and the FFN
is ``mlp(..., activation="swiglu")``: SiLU-multiply in the first GEMM's epilogue): with
``norm="rms"``, ``bias=False`` and ``norm_first=True`` that is a LLaMA layer.

Data flow of one encoder layer (x: (B, L, E) with ``batch_first``, else (L, B, E))::

    Pre-LN  (norm_first=True)                      Post-LN (norm_first=False)
    n1     = LN1(x)                                a      = Attn(x)
    a      = Attn(n1)                              h      = LN1(x + drop1(a))      add fused in the norm
    n2, h  = LN2(x + drop1(a)), x + drop1(a)       f      = FFN(h)
    y      = h + drop2(FFN(n2))                    y      = LN2(h + drop2(f))      add fused in the norm

In Pre-LN, ``add_layer_norm`` returns the residual stream ``h`` beside ``LN2(h)``, and the
FFN's residual add rides in the epilogue of its second matmul (``mlp(..., residual=h)``).
Where one tensor feeds two places (Pre-LN's x: LN1 and, as the residual, LN2; Post-LN's h: the
next sublayer and the next norm's residual) a norm hands it on as its second output, and the
backward kernel of that norm sums its two gradients (no separate PyTorch add).
The FFN's dropouts are fused too: the inner one (``dropout``) in the first matmul's epilogue,
drop2 in the second's (Pre-LN) or in the norm kernel on the FFN output (Post-LN).
Attention is one QKV matmul whose (..., (H + 2 Hkv) * D) output is viewed, without copies,
as q (B, H, L, D) and k, v (B, Hkv, L, D) for the attention kernel (with ``rope=True`` one
kernel first rotates q and k into a new packed tensor, copying v beside them).

Tensor parallelism (``fused_block.distributed.LayerParallel``): the same forward runs on the
rank's shards; ``MultiheadAttention._attend`` and ``_LayerMixin._ffn`` take their inputs whole
and reduce their partial sums, the norms run on the layer's layout.

Masks: ``is_causal`` and a causal ``src_mask`` (``nn.Transformer.generate_square_subsequent_mask``
or its bool form) run the causal kernel, a bool or 0/-inf float key padding mask runs the
padding mask. Any other bool ``src_mask``/``tgt_mask``/``memory_mask`` (2-D or per-head 3-D;
a float one of only 0 and -inf, which requires no gradient, too) is the kernel's bool
``mask`` beside the padding flag: summarized per launch, the blocks it hides whole are
skipped. The rest (other float masks, a float padding mask with other values, a causal mask
with L != S) is merged into one additive float mask, as torch's MultiheadAttention builds
it, and the kernel reads it as its ``bias`` (gradient included when the mask requires one).
Only head dims outside the kernel's range run attention through
``torch.nn.functional.scaled_dot_product_attention``, after a one-time warning: slower, never
a wrong answer. A query whose keys are all masked gives 0 here (torch's layers give NaN).
"""
import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from fused_block import _backend, _guard, _step, _validate, lora, reference
from fused_block.attention import MAX_FP32_HEAD_DIM, MAX_HEAD_DIM, MIN_HEAD_DIM
from fused_block.attention import attention as _attention
from fused_block.attention import attention_qkvpacked as _attention_qkvpacked
from fused_block.attention import attention_varlen_qkvpacked as _attention_varlen_qkvpacked
from fused_block.kernels import matmul as _kmatmul
from fused_block.linear import gated_linear as _gated_linear
from fused_block.linear import linear as _linear
from fused_block.linear import lora_ffn as _lora_ffn
from fused_block.linear import mlp as _mlp
from fused_block import norm as _norm
from fused_block.norm import LayerNorm, RMSNorm, add_layer_norm, add_rms_norm
from fused_block.rope import rope_qkvpacked as _rope_qkvpacked

NORMS = ("layer", "rms")
# Head dims the attention kernel takes: multiples of 8 in [16, 256] (fp32: up to 128).
_KERNEL_HEAD_DIMS = range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, 8)


class ShapeError(ValueError, AssertionError):
    """Bad shapes: a ``ValueError`` (this library's convention) that is also the
    ``AssertionError`` torch's layers raise in the same situation."""


class MaskError(ValueError, RuntimeError):
    """Bad mask shapes: a ``ValueError`` that is also the ``RuntimeError`` torch raises."""


class MaskTypeError(TypeError, AssertionError):
    """Unsupported mask dtype: a ``TypeError`` that is also torch's ``AssertionError``."""


class _Ops:
    """The ops a layer calls, called positionally (the reference's names differ)."""

    def __init__(self, add_layer_norm, add_rms_norm, attention, linear, mlp, gated):
        self.add_layer_norm, self.add_rms_norm = add_layer_norm, add_rms_norm
        self.attention, self.linear, self.mlp, self.gated = attention, linear, mlp, gated


_FUSED = _Ops(add_layer_norm, add_rms_norm, _attention, _linear, _mlp, _gated_linear)
# float64 (which torch's layers accept and the kernels do not) runs the plain-PyTorch reference.
_REFERENCE = _Ops(reference.add_layer_norm, reference.add_rms_norm, reference.attention,
                  reference.linear, reference.mlp, reference.gated)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ops(x):
    return _FUSED if x.dtype in _KERNEL_DTYPES else _REFERENCE


# The fused forwards read the submodules and parameters of a layer's step from the registries
# (``_modules``, ``_parameters``), where nn.Module.__getattr__ finds them after the instance
# lookup fails: the same objects, without that failed lookup and its AttributeError on every
# access (the guard, _guard.reason, holds the modules to the classes whose attributes these are).
# A parameter that is not in the registry (torch.nn.utils.parametrize moves it into
# ``parametrizations`` and serves it through a property) is read as an attribute.


def _params(module, *names):
    """``module``'s parameters ``names`` as attribute access gives them."""
    reg = module._parameters
    return [reg[n] if n in reg else getattr(module, n) for n in names]


def _warn_once(key, message):
    _backend.warn_once(key, message, stacklevel=4)


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------

def _is_causal_mask(mask, L):
    """True when ``mask`` (L, L) is exactly the causal mask: float 0 / -inf above the diagonal
    (``generate_square_subsequent_mask``) or bool True above the diagonal. Reads the mask (a
    host-device sync on CUDA): called through :func:`_verdict` only."""
    if mask.dim() != 2 or mask.shape != (L, L):
        return False
    upper = torch.ones(L, L, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, upper))
    expected = torch.zeros(L, L, dtype=mask.dtype, device=mask.device).masked_fill(upper, float("-inf"))
    return bool(torch.equal(mask, expected))


def _is_zero_mask(mask):
    return not bool(mask.any())


def _is_additive_bool_mask(mask):
    """Only 0 and -inf: the additive form of a bool mask."""
    return bool(((mask == 0) | torch.isneginf(mask)).all())


# Verdicts on masks' values, by (check, id(mask)): (weak reference, version counter, verdict).
# A model hands the same mask tensors to each of its layers, every step: the values are read
# (a host-device sync) once, not once per layer and step. An in-place change bumps the
# tensor's version, so it is read again; a new tensor with a reused id fails the identity check.
_VERDICTS = {}
_MAX_VERDICTS = 64


def _verdict(check, mask, *args):
    """``check(mask, *args)``, cached per mask tensor and version; None when the values cannot
    be read here: under ``torch.compile`` (no data-dependent branches), while ``torch.jit.trace``
    records (a verdict would be baked into the trace, which then gives wrong answers for every
    other mask passed to it) or during CUDA graph capture (no syncs) without an earlier verdict
    on the same tensor."""
    if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
        return None
    if mask.is_inference():  # no version counter: read every time
        return None if _capturing(mask) else check(mask, *args)
    key = (check, id(mask), args)
    hit = _VERDICTS.get(key)
    version = mask._version
    if hit is not None and hit[0]() is mask and hit[1] == version:
        return hit[2]
    if _capturing(mask):
        return None
    verdict = check(mask, *args)
    if len(_VERDICTS) >= _MAX_VERDICTS:
        _VERDICTS.clear()
    _VERDICTS[key] = (weakref.ref(mask), version, verdict)
    return verdict


def _capturing(t):
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_mask_type(name, mask):
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise MaskTypeError(f"only bool and floating types of {name} are supported, got {mask.dtype}")


def _check_mask(name, mask, B, H, L, S):
    """Shape and dtype checks with torch's exception types and this library's argument names."""
    if mask is None:
        return
    _check_mask_type(name, mask)
    if mask.dim() == 2:
        if tuple(mask.shape) != (L, S):
            raise MaskError(f"{name}: the shape of the 2D mask is {tuple(mask.shape)}, but should be ({L}, {S})")
    elif mask.dim() == 3:
        if tuple(mask.shape) != (B * H, L, S):
            raise MaskError(f"{name}: the shape of the 3D mask is {tuple(mask.shape)}, "
                            f"but should be ({B * H}, {L}, {S})")
    else:
        raise MaskError(f"{name} must be 2-D (L, S) or 3-D (batch * nhead, L, S), got shape {tuple(mask.shape)}")


def _check_padding_mask(name, mask, B, S, batched):
    if mask is None:
        return
    _check_mask_type(name, mask)
    expected = (B, S) if batched else (S,)
    if tuple(mask.shape) != expected:
        raise ShapeError(f"{name} must have shape {expected}, got {tuple(mask.shape)}")


class _Masks:
    """What the attention kernel gets: ``causal``, a bool ``key_padding`` (B, S) and a bool
    ``hidden`` mask (torch's convention, True = masked; (L, S) or (B, H, L, S)), or else a
    ``general`` additive float mask broadcastable to (B, H, L, S) (the kernel's bias, and the
    SDPA fallback's mask)."""

    __slots__ = ("causal", "key_padding", "hidden", "general", "reason")

    def __init__(self, causal=False, key_padding=None, hidden=None, general=None, reason=None):
        self.causal, self.key_padding, self.hidden, self.general = causal, key_padding, hidden, general
        self.reason = reason


def _resolve_masks(attn_mask, key_padding_mask, is_causal, B, H, L, S, dtype, names):
    """Turn torch's mask arguments into a kernel mask, or a merged additive mask with the reason.

    Values decide only where they can be read (see :func:`_verdict`): under ``torch.compile``,
    ``torch.jit.trace`` or in a CUDA graph capture without a verdict from the warm-up, an unhinted causal mask or
    a float padding mask is general, which is slower, never wrong. A float mask that requires
    a gradient (a learned bias) is never read as a pattern: it stays the kernel's additive
    bias, whatever its values (zeros, causal), and gets its gradient.
    """
    if attn_mask is None and key_padding_mask is None and not (is_causal and L != S):
        return _Masks(causal=bool(is_causal))
    mask_name, kpm_name = names
    causal = bool(is_causal)
    unread = " whose values cannot be read under torch.compile, torch.jit.trace or CUDA graph capture"
    mask_reason = f"a general (non-causal) {mask_name}"
    if attn_mask is not None and not causal and not attn_mask.requires_grad:
        if attn_mask.dim() == 2 and L == S:
            is_causal_mask = _verdict(_is_causal_mask, attn_mask, L)
            if is_causal_mask is None:
                mask_reason = f"a {mask_name}{unread} (pass is_causal=True with a causal mask)"
            elif is_causal_mask:
                causal, attn_mask = True, None
        if attn_mask is not None and attn_mask.dim() == 2 and attn_mask.dtype != torch.bool:
            if _verdict(_is_zero_mask, attn_mask):
                attn_mask = None  # an all-zero float mask masks nothing
    elif causal:
        attn_mask = None  # torch trusts the is_causal hint as well
    kpm = key_padding_mask
    if kpm is not None and kpm.dtype != torch.bool:
        is_padding = False if kpm.requires_grad else _verdict(_is_additive_bool_mask, kpm)
        if is_padding:
            kpm = torch.isneginf(kpm)
        else:
            reason = (f"a float {kpm_name} that requires a gradient" if kpm.requires_grad
                      else f"a float {kpm_name} with values other than 0 and -inf" if is_padding is not None
                      else f"a float {kpm_name}{unread} (pass a bool mask)")
            return _Masks(general=_merge_masks(attn_mask, kpm, causal, B, H, L, S, dtype), reason=reason)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.requires_grad:
            if _verdict(_is_additive_bool_mask, attn_mask):
                attn_mask = torch.isneginf(attn_mask)
        if attn_mask.dtype == torch.bool:
            # The kernel's bool mask (causal is False here): read per tile, blocks it hides skipped.
            return _Masks(key_padding=kpm, hidden=attn_mask if attn_mask.dim() == 2 else attn_mask.view(B, H, L, S))
        return _Masks(general=_merge_masks(attn_mask, kpm, causal, B, H, L, S, dtype), reason=mask_reason)
    if causal and L != S:
        # torch's hinted causal mask is top-left aligned; the kernel's is bottom-right.
        return _Masks(general=_merge_masks(None, kpm, True, B, H, L, S, dtype),
                      reason=f"a causal mask with query length {L} != key length {S}")
    return _Masks(causal=causal, key_padding=kpm)


# The attention op takes a bias below reference.SATURATED_BIAS as -inf (the kernels add it in
# the log2 domain, in fp32, where it overflows). torch's softmax sees ``score + bias`` instead,
# which for such a bias rounds to the bias itself (its ulp, ~2e31, swamps any score): a row whose
# largest bias is that low weighs its keys by the bias alone. Half that value bounds the masks
# worth a closer look: two such masks add up below it.
def _saturates(mask):
    """Whether a float mask holds a finite value low enough, alone or added to another, to
    saturate the kernel's scores (see :func:`_saturated_rows`)."""
    return bool(((mask < reference.SATURATED_BIAS / 2) & (mask > float("-inf"))).any())


def _may_saturate(attn_mask, key_padding_mask):
    """Whether the masks (before merging) may give rows :func:`_saturated_rows` must set; read
    once per mask and version (:func:`_verdict`), and True where they cannot be read."""
    for m in (attn_mask, key_padding_mask):
        if m is not None and m.dtype != torch.bool and _verdict(_saturates, m) is not False:
            return True
    return False


def _saturated_rows(o, bias, v):
    """``o`` (B, H, L, D), the kernel's attention under the additive ``bias`` (broadcastable to
    (B, H, L, S)), with torch's value in the rows whose largest bias is finite and below
    ``reference.SATURATED_BIAS`` (a Hugging Face-style ``finfo.min`` mask hiding every key of
    the row): the mean of V over the keys of that largest bias, where the kernel, which takes
    such a bias as -inf, gives 0. The gradient is that mean's (dV); torch's autograd also passes those rows'
    gradients to q and k through the absorbed scores, terms of a function that does not depend
    on them. No attention dropout on these rows (the same expectation as torch's)."""
    # fp32, or float64 where the layer runs in it (its finfo.min, ~-1.8e308, is -inf in fp32)
    b = bias.to(torch.promote_types(bias.dtype, torch.float32))
    top = b.amax(-1, keepdim=True)
    dead = (top < reference.SATURATED_BIAS) & (top > float("-inf"))  # (B|1, H|1, L, 1)
    H, Hkv = o.shape[1], v.shape[1]
    vf = v.to(torch.promote_types(v.dtype, torch.float32))
    vf = vf if H == Hkv else vf.repeat_interleave(H // Hkv, dim=1)
    w = ((b == top) & dead).to(vf.dtype)
    mean = (w @ vf) / w.sum(-1, keepdim=True).clamp_min(1.0)
    return torch.where(dead, mean.to(o.dtype), o)


def _merge_masks(attn_mask, kpm, causal, B, H, L, S, dtype):
    """One additive float mask broadcastable to (B, H, L, S), as torch's MultiheadAttention builds."""
    dev = (attn_mask if attn_mask is not None else kpm).device if (attn_mask is not None or kpm is not None) else None
    m = torch.zeros(1, 1, L, S, dtype=dtype, device=dev)
    if causal:
        m = m.masked_fill(torch.ones(L, S, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    if attn_mask is not None:
        am = attn_mask if attn_mask.dim() == 2 else attn_mask.view(B, H, L, S)
        m = m.masked_fill(am, float("-inf")) if am.dtype == torch.bool else m + am.to(dtype)
    if kpm is not None:
        km = kpm.view(B, 1, 1, S)
        m = m.masked_fill(km, float("-inf")) if km.dtype == torch.bool else m + km.to(dtype)
    return m


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

def _split_heads(t, n_heads, batch_first):
    """(B, L, n*D) or (L, B, n*D) with unit last stride -> (B, n, L, D), a view (no copy)."""
    t = t.unflatten(-1, (n_heads, -1))
    return t.transpose(1, 2) if batch_first else t.permute(1, 2, 0, 3)


def _merge_heads(o, batch_first):
    """(B, H, L, D) -> (B, L, H*D) or (L, B, H*D); a view when o's memory is (B, L, H, D)- or
    (L, B, H, D)-ordered (the attention kernel's output for q from ``_split_heads``)."""
    o = o.transpose(1, 2) if batch_first else o.permute(2, 0, 1, 3)
    return o.reshape(*o.shape[:2], o.shape[2] * o.shape[3])  # not -1: ambiguous for an empty batch or query


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` with fused projections and attention kernel.

    Same constructor (every option: ``kdim``/``vdim``, ``add_bias_kv``, ``add_zero_attn``),
    parameters and state dict. ``num_kv_heads`` (keyword, default ``num_heads``) makes it
    grouped-query attention: ``in_proj_weight`` is then ((num_heads + 2 * num_kv_heads) *
    head_dim, embed_dim), rows [q; k; v]. ``rope=True`` applies rotary embeddings (positions
    0..L-1, ``inv_freq = rope_base ** (-2i / head_dim)``, half-split pairs or
    ``rope_interleaved``) to q and k of self-attention with :func:`fused_block.rope_qkvpacked`
    on the packed QKV projection, which then goes to :func:`fused_block.attention_qkvpacked`
    like any other; ``inv_freq`` is a non-persistent buffer (no state-dict entry). GQA and RoPE
    go without ``kdim``/``vdim``/``add_bias_kv``/``add_zero_attn`` (torch has neither).

    ``forward`` runs the kernels for self-attention (query, key and value one tensor: one packed
    QKV GEMM) and any other query/key/value (one GEMM each, one for key and value when they are
    the same tensor); ``add_bias_kv``/``add_zero_attn`` append their key/value rows to the
    projections and pad the masks as torch does. ``need_weights=True`` (torch's default) and
    nested inputs run torch's implementation (not available with GQA or RoPE).
    """

    __prepare_scriptable__ = _backend.not_scriptable

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None, *, num_kv_heads=None, rope=False, rope_base=10000.0, rope_interleaved=False):
        embed_dim, num_heads, num_kv_heads = _check_heads(embed_dim, num_heads, num_kv_heads)
        dropout, batch_first = _validate.scalar(dropout), _validate.scalar(batch_first)  # numpy's: Python's
        torch_options = add_bias_kv or add_zero_attn or kdim not in (None, embed_dim) or vdim not in (None, embed_dim)
        if torch_options and (num_kv_heads not in (None, num_heads) or rope):
            raise ValueError("add_bias_kv, add_zero_attn, kdim and vdim need num_kv_heads == num_heads and rope=False")
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                         add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                         device=device, dtype=dtype)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self._built_heads = (self.num_heads, self.head_dim)  # see _heads_reason
        if self.num_kv_heads != num_heads:
            rows = (num_heads + 2 * self.num_kv_heads) * self.head_dim
            factory = {"device": device, "dtype": dtype}
            self.in_proj_weight = nn.Parameter(torch.empty(rows, embed_dim, **factory))
            nn.init.xavier_uniform_(self.in_proj_weight)
            if bias:
                self.in_proj_bias = nn.Parameter(torch.zeros(rows, **factory))
        self.rope, self.rope_interleaved = bool(rope), bool(rope_interleaved)
        if self.rope:
            self.rope_base = float(rope_base)
            if not (_validate.finite(self.rope_base) and self.rope_base > 0):
                raise ValueError(f"rope_base must be finite and > 0, got {rope_base}")
            self.register_buffer("inv_freq", _inv_freq(self.head_dim, self.rope_base, device), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        """``to``/``half``/``cuda``/``to_empty`` also reach the frequencies buffer: it moves to the
        new device as it was, in fp32 (cast frequencies would shift every angle), so a table the
        user set (position interpolation's ``inv_freq / s``, a loaded one) is kept; one on the
        meta device (which holds no values) is computed from ``rope_base`` there, once per move
        rather than per call."""
        before = self.inv_freq if self.rope else None
        out = super()._apply(fn, *args, **kwargs)
        if self.rope:
            device = self.inv_freq.device
            self.inv_freq = (_inv_freq(self.head_dim, self.rope_base, device) if before.is_meta
                             else before.to(device=device, dtype=torch.float32))
        return out

    def _rotate(self, qkv, ops):
        """RoPE at positions 0..L-1 on the packed QKV projection (x's layout): one packed tensor,
        q and k rotated, v copied."""
        fn = _rope_qkvpacked if ops is _FUSED else reference.rope_qkvpacked
        return fn(qkv, self.num_heads, self.num_kv_heads, inv_freq=self.inv_freq, interleaved=self.rope_interleaved,
                  batch_first=self.batch_first)

    def extra_repr(self):
        return f"num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""

    def _extended(self):
        """GQA or RoPE: what torch's MultiheadAttention cannot compute (as built: ``num_heads``
        set since does not make a module GQA, see :func:`_heads_reason`)."""
        return self.num_kv_heads != self.__dict__.get("_built_heads", (self.num_heads,))[0] or self.rope

    # -- the fused path ------------------------------------------------------------------------
    def _project(self, x, key, value, ops):
        """q, k, v projections in x's layout, (.., H * D) and (.., Hkv * D): one GEMM for the
        key and value when they are one tensor with the packed weight."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.split([H * D, Hkv * D, Hkv * D])
        if not self._qkv_same_embed_dim:
            return (ops.linear(x, self.q_proj_weight, bq), ops.linear(key, self.k_proj_weight, bk),
                    ops.linear(value, self.v_proj_weight, bv))
        w = self.in_proj_weight
        q = ops.linear(x, w[:H * D], bq)
        if key is value:
            kv = ops.linear(key, w[H * D:], None if b is None else b[H * D:])  # one GEMM for k and v
            k, v = kv.split([Hkv * D, Hkv * D], dim=-1)
            return q, k, v
        return q, ops.linear(key, w[H * D:(H + Hkv) * D], bk), ops.linear(value, w[(H + Hkv) * D:], bv)

    def _extra_keys(self, k, v, attn_mask, key_padding_mask, is_causal, L, S):
        """torch's ``add_bias_kv`` (the learned bias_k/bias_v row) and ``add_zero_attn`` (a zero
        row) appended to the keys and values, and the masks padded with a visible column each."""
        bf = self.batch_first
        seq = 1 if bf else 0
        B = k.shape[1 - seq]
        n = 0
        if self.bias_k is not None:
            shape = (B, 1, -1) if bf else (1, B, -1)
            k = torch.cat([k, self.bias_k.reshape(1, 1, -1).expand(shape).to(k.dtype)], dim=seq)
            v = torch.cat([v, self.bias_v.reshape(1, 1, -1).expand(shape).to(v.dtype)], dim=seq)
            n += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(k.shape[:seq] + (1,) + k.shape[seq + 1:])], dim=seq)
            v = torch.cat([v, v.new_zeros(v.shape[:seq] + (1,) + v.shape[seq + 1:])], dim=seq)
            n += 1
        if is_causal and attn_mask is None:  # the hint's mask (top-left, as torch's), before padding
            attn_mask = torch.ones(L, S, dtype=torch.bool, device=k.device).triu(1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, n), value=False if attn_mask.dtype == torch.bool else 0.0)
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, n),
                                     value=False if key_padding_mask.dtype == torch.bool else 0.0)
        return k, v, attn_mask, key_padding_mask, S + n

    def _attend(self, x, key, value, attn_mask, key_padding_mask, is_causal, dropout_p, names, ops=None,
                masks=None):
        """Projected attention output (before out_proj dropout) in x's layout (:meth:`_attend_local`).

        Inside a tensor-parallel layer's forward this module holds its rank's heads: x (and the
        keys' source) enter the rank's computation whole (all-gathered along the sequence under
        sequence parallelism), and the out-projection's partial sums leave reduced (all-reduced,
        or reduce-scattered along the sequence): ``fused_block.distributed``.
        """
        run = self.__dict__.get(_TP_RUN)
        if run is None:
            return self._attend_local(x, key, value, attn_mask, key_padding_mask, is_causal, dropout_p, names, ops,
                                      masks)
        x = run.enter(x)
        if key is not None:
            memory = run.enter(key, memory=True)
            key, value = memory, memory if value is key else run.enter(value, memory=True)
        with run.seeds([run.rank] if dropout_p > 0 else []):  # each rank's heads draw their own masks
            out = self._attend_local(x, key, value, attn_mask, key_padding_mask, is_causal, dropout_p, names, ops)
        return run.leave(out)

    def _attend_local(self, x, key, value, attn_mask, key_padding_mask, is_causal, dropout_p, names, ops=None,
                      masks=None):
        """Projected attention output (before out_proj dropout) in x's layout.

        x: (B, L, E) if batch_first else (L, B, E); key, value: the same layout with S for L
        (kdim/vdim for E), or None for self-attention. Masks as torch's (already shape-checked).
        On the kernel path self-attention hands the packed QKV projection to
        ``attention_qkvpacked`` (q, k, v read in place; its output is the out-projection's
        input; one packed gradient; RoPE layers rotate that packed tensor first, in one launch),
        and other attention gets q and k/v as views whose output's head merge is a view too.
        """
        bf = self.batch_first
        B, L = (x.shape[0], x.shape[1]) if bf else (x.shape[1], x.shape[0])
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        ops = _ops(x) if ops is None else ops
        extra = self.bias_k is not None or self.add_zero_attn
        packed = key is None and self._qkv_same_embed_dim
        if packed:
            S = L
            qkv = ops.linear(x, *_params(self, "in_proj_weight", "in_proj_bias"))  # (.., (H + 2 Hkv) * D): one matmul
            if self.rope:
                qkv = self._rotate(qkv, ops)
            dtype = qkv.dtype
        else:
            key, value = (x, x) if key is None else (key, value)
            S = key.shape[1 if bf else 0]
            q, k, v = self._project(x, key, value, ops)
            dtype = q.dtype
        if extra:
            if packed:
                q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
                packed = False
            k, v, attn_mask, key_padding_mask, S = self._extra_keys(k, v, attn_mask, key_padding_mask, is_causal, L, S)
            is_causal = False  # now in attn_mask
        if masks is None or extra:  # (masks: these arguments' own, resolved by the layer's step check)
            masks = _resolve_masks(attn_mask, key_padding_mask, is_causal, B, H, L, S, dtype, names)
        reason = None
        bias = None
        if D not in _KERNEL_HEAD_DIMS or (dtype == torch.float32 and D > MAX_FP32_HEAD_DIM):
            reason = (f"head dim {D} in {dtype} (the kernel takes multiples of 8 in [{MIN_HEAD_DIM}, "
                      f"{MAX_HEAD_DIM}], up to {MAX_FP32_HEAD_DIM} in fp32)")
            if masks.general is None and (masks.key_padding is not None or masks.causal or masks.hidden is not None):
                masks.general = _merge_masks(masks.hidden, masks.key_padding, masks.causal, B, H, L, S, dtype)
        elif masks.general is not None:
            # A mask the causal/padding flags cannot express: the kernel's additive bias.
            bias = masks.general
        varlen = _VARLEN.get(threading.get_ident()) if _VARLEN else None
        if varlen is not None:  # a jagged batch as one row of packed tokens (_forward_nested)
            if not (packed and reason is None and bias is None and ops is _FUSED and not self.rope
                    and masks.key_padding is None and masks.hidden is None):
                raise RuntimeError("fused_block: packed (varlen) tokens reached an attention that cannot take them")
            cu, longest = varlen
            o = _attention_varlen_qkvpacked(qkv[0] if bf else qkv[:, 0], cu, longest, H, Hkv, causal=masks.causal,
                                            dropout_p=dropout_p)
            return ops.linear(o[None] if bf else o[:, None], self.out_proj.weight, self.out_proj.bias)
        if packed:
            if reason is None and bias is None and masks.hidden is None and ops is _FUSED:
                o = _attention_qkvpacked(qkv, H, Hkv, masks.causal, None, masks.key_padding, dropout_p,
                                         batch_first=bf)
                return ops.linear(o, *_params(self._modules["out_proj"], "weight", "bias"))
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = (_split_heads(t, n, bf) for t, n in ((q, H), (k, Hkv), (v, Hkv)))  # (B, n, L|S, D)
        if reason is None and bias is not None:
            o = ops.attention(q, k, v, False, None, None, dropout_p, bias=bias)
            if _may_saturate(attn_mask, key_padding_mask):
                o = _saturated_rows(o, bias, v)
        elif reason is None:
            keep = None if masks.hidden is None else ~masks.hidden  # the kernel's mask: True = attend
            o = ops.attention(q, k, v, masks.causal, None, masks.key_padding, dropout_p, mask=keep)
        else:
            _warn_once(reason, f"fused_block: {reason}; attention runs through "
                       "torch.nn.functional.scaled_dot_product_attention (slower, same result)")
            if Hkv != H:
                k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.general, dropout_p=dropout_p)
        return ops.linear(_merge_heads(o, bf), self.out_proj.weight, self.out_proj.bias)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """As ``torch.nn.MultiheadAttention.forward``. Fused without ``need_weights`` (for any
        query, key and value); otherwise torch's implementation runs (not available with GQA or
        RoPE)."""
        if need_weights or any(isinstance(t, Tensor) and t.is_nested for t in (query, key, value)):
            if self._extended():
                raise ValueError("need_weights=True or nested inputs: not supported with num_kv_heads != num_heads "
                                 "or rope=True")
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        ops = None
        reason = _guard.reason(self, _describe_mha) or _heads_reason(self)
        if reason is not None:
            if not self._extended():
                _warn_once(("MultiheadAttention", reason), f"fused_block: MultiheadAttention runs torch's "
                           f"forward: {reason}")
                return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                       average_attn_weights, is_causal)
            _warn_once(("MultiheadAttention", reason), f"fused_block: MultiheadAttention (GQA or RoPE) runs "
                       f"plain PyTorch ops on its tensors: {reason}")
            ops = _REFERENCE
        _check_input("query", query, self.embed_dim, self)
        _check_input("key", key, self.kdim, self)
        _check_input("value", value, self.vdim, self)
        _check_flag("is_causal", is_causal)
        for name, t in (("key", key), ("value", value)):
            if t.dim() != query.dim():
                raise ShapeError(f"{name} must be {query.dim()}-D like query, got shape {tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ShapeError(f"key and value must have the same leading dims, got {tuple(key.shape)} and "
                             f"{tuple(value.shape)}")
        q_in, batched = _batch(query, self.batch_first)
        k_in, _ = _batch(key, self.batch_first)
        v_in, _ = _batch(value, self.batch_first)
        B, L = _dims(q_in, self.batch_first)
        Bk, S = _dims(k_in, self.batch_first)
        if Bk != B:
            raise ShapeError(f"key: batch size {Bk} does not match query's {B}")
        _check_mask("attn_mask", attn_mask, B, self.num_heads, L, S)
        _check_padding_mask("key_padding_mask", key_padding_mask, B, S, batched)
        if not batched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]
        self_attention = query is key and key is value
        out = self._attend(q_in, None if self_attention else k_in, None if self_attention else v_in, attn_mask,
                           key_padding_mask, is_causal, self.dropout if self.training else 0.0,
                           ("attn_mask", "key_padding_mask"), ops)
        return _unbatch(out, batched, self.batch_first), None


# ---------------------------------------------------------------------------------------------
# helpers shared by the layers
# ---------------------------------------------------------------------------------------------

def _positive_int(name, v):
    v = _validate.scalar(v)  # numpy integers, as torch's layers take them
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ShapeError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _check_heads(d_model, nhead, num_kv_heads):
    """``(d_model, nhead, num_kv_heads)`` as Python ints (num_kv_heads may be None), after checking them."""
    d_model, nhead = _positive_int("d_model", d_model), _positive_int("nhead", nhead)
    if d_model % nhead:
        raise ShapeError(f"nhead ({nhead}) must divide d_model ({d_model}): embed_dim must be divisible by num_heads")
    if num_kv_heads is not None:
        num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        if nhead % num_kv_heads:
            raise ShapeError(f"num_kv_heads ({num_kv_heads}) must divide nhead ({nhead})")
    return d_model, nhead, num_kv_heads


def _check_input(name, t, d_model, mha):
    """A layer's tensor input ``name``: floating point, 2-D or 3-D with ``d_model`` features, on the
    device of ``mha``'s parameters, in their dtype (or float64: the reference path; or any
    floating dtype under autocast)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {str(t.dtype).replace('torch.', '')}")
    if t.dim() not in (2, 3):
        raise ShapeError(f"{name} must be 3-D (batched) or 2-D (unbatched), got shape {tuple(t.shape)}")
    if t.shape[-1] != d_model:
        raise ShapeError(f"{name}: was expecting embedding dimension of {d_model}, but got {t.shape[-1]}")
    w = _dtype_device_source(mha._modules["out_proj"])
    if t.dtype is not w.dtype or t.device != w.device:
        _check_like(name, t, w)


def _dtype_device_source(linear):
    """``linear.weight`` for its dtype and device, without evaluating a parametrization on it:
    its original (each evaluation of spectral_norm's runs a power iteration in training, which
    updates its state; torch's attention evaluates out_proj's weight once per call)."""
    w = linear._parameters.get("weight")
    if w is None and parametrize.is_parametrized(linear, "weight"):
        originals = linear.parametrizations["weight"]._parameters
        w = originals.get("original", originals.get("original0"))
    return linear.weight if w is None else w


def _check_like(name, t, w):
    if t.device != w.device:
        raise ValueError(f"{name} is on {t.device} but the layer's parameters are on {w.device}")
    if t.dtype is not torch.float64 and not torch.is_autocast_enabled(t.device.type):
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')} but the layer's parameters have "
                        f"{str(w.dtype).replace('torch.', '')}: cast one to the other, or run under torch.autocast")


def _hidden_dropout(hid, p):
    """Dropout of an FFN's hidden activation between its GEMMs (where a custom activation
    callable runs). Where the kernels run: the keep-mask the GEMM epilogues draw, from a seed of
    ``_backend.dropout_seed`` (``torch.manual_seed`` fixes it; a tensor-parallel rank's is
    shifted by its rank, so each rank's FFN columns get a mask of their own); elsewhere torch's."""
    if p >= 1.0 or not _backend.use_triton(hid) or hid.numel() == 0:
        return F.dropout(hid, p, training=True)  # (p = 1: every unit dropped, torch's product with 0)
    n = hid.shape[-1]
    keep = _kmatmul.dropout_mask(_backend.dropout_seed(p, hid.device), hid.numel() // n, n, p, hid.device)
    return hid * keep.view(hid.shape) * (1.0 / (1.0 - p))


def _check_flag(name, value):
    if not isinstance(value, bool):  # numpy's bool too, as torch's layers (SDPA) refuse it
        raise TypeError(f"{name} must be a bool, got {_validate.type_name(value)}")


def _activation_name(activation):
    """The fused epilogue's name for torch's activation argument, or None for other callables."""
    if isinstance(activation, str):
        if activation not in ("relu", "gelu", "gelu_tanh", "swiglu"):
            raise RuntimeError(f"activation should be relu/gelu/gelu_tanh/swiglu, not {activation}")
        return activation
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    return None


def _torch_activation(name):
    """The callable torch's layers store for ``name``; SwiGLU is no elementwise function (it
    gates linear1's two halves) and stays the name, which ``_ffn`` hands to ``mlp``."""
    return {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": nn.GELU(approximate="tanh"), "swiglu": "swiglu"}[name]


def _ffn_width(activation, dim_feedforward):
    """linear1's width: SwiGLU's gate and up projections are its two halves."""
    return 2 * dim_feedforward if activation == "swiglu" else dim_feedforward


def _inv_freq(head_dim, base, device):
    """RoPE's fp32 frequencies ``base ** (-2i / head_dim)``."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


class _LayerMixin:
    """Norm, FFN and input plumbing shared by the encoder and decoder layers."""

    __prepare_scriptable__ = _backend.not_scriptable

    def _setup(self, d_model, activation, layer_norm_eps, bias, norm, norm_names, factory):
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.norm = norm
        for name in norm_names:
            if norm == "layer":
                setattr(self, name, nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory))
            else:
                setattr(self, name, nn.RMSNorm(d_model, eps=layer_norm_eps, **factory))
        if isinstance(activation, str):
            _activation_name(activation)  # torch's error for unknown names
            activation = _torch_activation(activation)
        self.activation = activation
        # torch's fast-path flags; a value of 0 keeps nn.TransformerEncoder from handing this
        # layer nested tensors when its math is not torch's (RMSNorm, GQA).
        name = _activation_name(activation)
        torch_compatible = (norm == "layer" and self.self_attn.num_kv_heads == self.self_attn.num_heads
                            and not self.self_attn.rope and name != "swiglu")
        self.activation_relu_or_gelu = {"relu": 1, "gelu": 2}.get(name, 0) if torch_compatible else 0

    def _add_norm(self, module, x, residual=None, dropout_p=0.0, out_is_residual=False):
        """``(norm(dropout(x) + residual), dropout(x) + residual)`` in one kernel; with
        ``out_is_residual`` (Post-LN) the second is the norm's output again, for the next add.

        The outputs take x's and residual's dtypes. Under autocast x (a matmul's output) is
        low precision while the residual stream stays fp32, as in torch's layers; where the
        norm's output is the residual stream itself (Post-LN) it must stay fp32 too.

        Post-LN follows torch's autocast policy for the norms (``norm.autocast_upcasts``): where
        the device type's autocast runs the norm in fp32 (CUDA), a 16-bit x (a 16-bit input
        stream) is normalized in fp32 and the output, the next residual stream and the layer's
        output, is fp32, as torch's layer gives. Pre-LN's norm outputs only feed the sublayers'
        GEMMs, which autocast rounds to its dtype: the kernel's 16-bit output (rounded to
        nearest from fp32) is that same value, so Pre-LN keeps the cheaper 16-bit path.
        """
        ops = _ops(x)
        rms = self.norm != "layer"
        params = _params(module, "weight") if rms else _params(module, "weight", "bias")
        upcast = not self.norm_first and _norm.autocast_upcasts(x, rms)
        run = self.__dict__.get(_TP_RUN)
        # Tensor parallel: the residual stream is replicated (one mask on every rank), or split
        # along the sequence (each rank's tokens draw their own).
        with _NO_SEED_BLOCK if run is None or dropout_p == 0 else run.seeds([run.rank if run.sequence_parallel else 0]):
            fn = ops.add_rms_norm if rms else ops.add_layer_norm
            if upcast:
                return _norm.as_autocast(fn, x, residual, params, module.eps, dropout_p, False, out_is_residual)
            return fn(x, residual, *params, module.eps, dropout_p, False, out_is_residual)

    def _ffn(self, x, p_in, p_out, residual=None):
        """``residual + dropout2(linear2(dropout(act(linear1(x)))))``: one ``mlp`` with both
        dropouts (probabilities ``p_in`` and ``p_out``, 0 where the dropout is off) and the
        residual add fused into the GEMM epilogues. Post-LN passes ``p_out=0`` (it fuses dropout2,
        with the add, into the next norm's kernel).

        Tensor parallel: this rank's FFN columns on the whole input; the partial sums are
        reduced, then the residual is added (in the epilogue it would be counted once per rank).
        The hidden dropout draws a mask per rank, the output dropout one for all (it drops the
        partial sums alike, so it drops their sum)."""
        run = self.__dict__.get(_TP_RUN)
        if run is None:
            return self._ffn_local(x, residual, p_in, p_out)
        # The seeds the FFN's dropouts draw (_backend.dropout_seed), in order; where the kernels
        # do not run (CPU tensors without the interpreter) the references draw none.
        seeded = _backend.use_triton(x)  # (p = 1 runs torch's dropout, which draws no seed)
        with run.seeds([run.rank] * (seeded and 0 < p_in < 1) + [0] * (seeded and 0 < p_out < 1)):
            y = run.leave(self._ffn_local(run.enter(x), None, p_in, p_out))
        return y if residual is None else y + residual

    def _ffn_local(self, x, residual, p_in, p_out):
        mods = self._modules
        name = self._activation()
        l1, l2 = mods["linear1"], mods["linear2"]
        ops = _ops(x)
        if lora.is_lora(l1) or lora.is_lora(l2):
            return self._ffn_lora(x, residual, p_in, p_out, name, ops)
        if name is not None:
            return ops.mlp(x, *_params(l1, "weight", "bias"), *_params(l2, "weight", "bias"), name, residual, p_in,
                           p_out)
        # A custom activation callable runs between the GEMMs, so its dropout does too.
        hid = self._activate(ops.linear(x, *_params(l1, "weight", "bias")))
        hid = _hidden_dropout(hid, p_in) if p_in > 0 else hid
        return ops.linear(hid, l2.weight, l2.bias, None, residual, p_out)

    def _ffn_lora(self, x, residual, p_in, p_out, name, ops):
        """The FFN with PEFT LoRA on linear1 and/or linear2: ``fused_block.linear.lora_ffn``, as
        :class:`fused_block.MLP` runs it; a custom activation callable (``name`` None) and its
        dropout run between the GEMMs."""
        def hidden(pre):
            hid = self._activate(pre)
            return _hidden_dropout(hid, p_in) if p_in > 0 else hid

        return _lora_ffn(x, self.linear1, self.linear2, name, residual, p_in, p_out, ops.linear, ops.gated,
                         hidden if name is None else None)

    def _activate(self, pre):
        """The activation on linear1's output between the GEMMs; SwiGLU gates its halves."""
        if isinstance(self.activation, str):  # "swiglu"
            gate, up = pre.chunk(2, dim=-1)
            return F.silu(gate) * up
        return self.activation(pre)

    def _activation(self):
        """The fused epilogue's name for ``self.activation``, looked up once per activation
        object and ``nn.GELU`` form (the attribute may be reassigned, a GELU module's
        ``approximate`` set in place; the name follows both)."""
        act = self.activation
        form = act.approximate if type(act) is nn.GELU else None
        cached = self.__dict__.get("_activation_cache")
        if cached is None or cached[0] is not act or cached[1] != form:
            cached = self.__dict__["_activation_cache"] = (act, form, _activation_name(act))
        return cached[2]

    def _seed_block(self, x, *ps):
        """The seeds of the layer's dropouts that are on (probabilities ``ps``, 0 for those
        off) drawn in one kernel, see ``_backend.seed_block``."""
        n = 0
        for p in ps:
            n += 0 < p < 1  # (p = 1 runs torch's dropout, which draws nothing)
        if n < 2 or _ops(x) is not _FUSED or not _backend.use_triton(x):
            return _NO_SEED_BLOCK  # the reference's dropouts draw from torch's generator themselves
        return _backend.seed_block(n, x.device)

    def _attn_dropout(self, attn):
        """The attention's dropout probability, on by the attention module's own training flag
        (torch's ``MultiheadAttention`` reads its own, whatever the layer's)."""
        return attn.dropout if attn.training else 0.0

    def _ff_block(self, x):
        """torch's FFN block, calling the submodules (the unfused path); SwiGLU gates linear1's halves."""
        hid = self._activate(self.linear1(x))
        return self._ffn_dropout()(self.linear2(self.dropout(hid)))

    def _unfused(self, reason, forward, *args):
        """torch's forward (its submodules called: hooks, adapters and subclasses act as in torch's
        layer), after a one-time warning naming the reason."""
        name = type(self).__name__
        if _TP in self.__dict__:
            raise RuntimeError(f"fused_block: {name} is tensor parallel (fused_block.distributed.LayerParallel): it "
                               f"runs on its shards fused only, and cannot run torch's forward: {reason}")
        _warn_once((name, reason), f"fused_block: {name} runs torch's forward, calling its submodules "
                   f"(slower, same answer as torch's layer): {reason}")
        return forward(self, *args)


_NO_SEED_BLOCK = contextlib.nullcontext()
# A tensor-parallel layer's plan (set by fused_block.distributed.LayerParallel), and the state of
# one of its calls, set on the layer and its attention modules for the call's duration.
_TP, _TP_RUN = "_fused_block_tp", "_fused_block_tp_run"
# A nested batch's (cu_seqlens int32, longest length) while its tokens run as one row
# (TransformerEncoderLayer._forward_nested), by thread: that thread's self-attention runs the
# varlen kernel, another thread's calls meanwhile are theirs. A dict (dynamo guards its
# contents; a threading.local's attributes it does not), empty outside such a call.
_VARLEN = {}


@contextlib.contextmanager
def _varlen_tokens(cu_seqlens, longest):
    me = threading.get_ident()
    saved = _VARLEN.get(me)
    _VARLEN[me] = (cu_seqlens, longest)
    try:
        yield
    finally:
        if saved is None:
            del _VARLEN[me]
        else:
            _VARLEN[me] = saved


def _tp_length(layer, n, memory=False, masks=()):
    """The whole sequence's length where a sequence-parallel layer holds ``n`` of its tokens.
    Tensor parallel, a per-head (3-D) mask among ``masks`` (name, mask) raises: the layer's
    attention modules hold only their rank's heads."""
    run = layer.__dict__.get(_TP_RUN)
    if run is None:
        return n
    for name, mask in masks:
        if isinstance(mask, Tensor) and mask.dim() == 3:
            raise ValueError(f"{name}: per-head (3-D) masks are not supported under tensor parallelism")
    return run.length(n, memory)


def _like(a, x):
    """Post-LN under autocast: the sublayer output (low precision) joins the fp32 residual
    stream, and the norm's output, which becomes the stream, keeps the stream's dtype as torch's
    fp32 ``layer_norm`` does. A no-op outside autocast."""
    return a if a.dtype == x.dtype else a.to(torch.promote_types(a.dtype, x.dtype))


def _batch(src, batch_first):
    """Batched view in the layer's layout: unbatched (L, E) gets a batch dim of 1."""
    if src.dim() == 3:
        return src, True
    return (src.unsqueeze(0) if batch_first else src.unsqueeze(1)), False


def _unbatch(y, batched, batch_first):
    return y if batched else (y.squeeze(0) if batch_first else y.squeeze(1))


def _dims(x, batch_first):
    return (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------

class TransformerEncoderLayer(_LayerMixin, nn.TransformerEncoderLayer):
    """``torch.nn.TransformerEncoderLayer`` on the fused kernels.

    Same constructor, defaults, parameters, initialization (same values for the same seed)
    and state dict; numpy scalars where torch's takes them (sizes, dropout, ``layer_norm_eps``,
    flags), kept as Python numbers. Added keywords: ``norm="layer" | "rms"`` (``norm1``/
    ``norm2`` become ``nn.RMSNorm(d_model, eps=layer_norm_eps)``) and ``num_kv_heads``
    (grouped-query attention; changes ``self_attn.in_proj_weight``'s shape, see
    :class:`MultiheadAttention`).

    ``forward(src, src_mask=None, src_key_padding_mask=None, is_causal=False)``: src is
    (B, L, E) with ``batch_first``, else (L, B, E), or unbatched (L, E); fp32, fp16 or bf16.
    Unlike torch, ``is_causal=True`` also works without a ``src_mask``. A nested src (strided,
    as ``nn.TransformerEncoder``'s inference fast path creates from a padding mask, or jagged)
    runs the kernels on the padded batch with its lengths as key padding and returns a nested
    tensor of the same layout, as torch's fast path does (``batch_first=True``).
    """

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu,
                 layer_norm_eps=1e-5, batch_first=False, norm_first=False, bias=True, device=None,
                 dtype=None, *, norm="layer", num_kv_heads=None, rope=False, rope_base=10000.0,
                 rope_interleaved=False):
        d_model, nhead, num_kv_heads = _check_heads(d_model, nhead, num_kv_heads)
        # numpy scalars (torch's layers take them) as Python's, once: the modules built here keep them
        dim_feedforward, dropout, layer_norm_eps, batch_first, norm_first = map(
            _validate.scalar, (dim_feedforward, dropout, layer_norm_eps, batch_first, norm_first))
        factory = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)
        # Construction order as torch's, so a seed gives the same initial values.
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first,
                                            num_kv_heads=num_kv_heads, rope=rope, rope_base=rope_base,
                                            rope_interleaved=rope_interleaved, **factory)
        self.linear1 = nn.Linear(d_model, _ffn_width(activation, dim_feedforward), bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self._setup(d_model, activation, layer_norm_eps, bias, norm, ("norm1", "norm2"), factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    _ATTENTIONS, _NORMS, _DROPOUTS = ("self_attn",), ("norm1", "norm2"), ("dropout", "dropout1", "dropout2")

    def _ffn_dropout(self):
        return self._modules["dropout2"]

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        nested = isinstance(src, Tensor) and src.is_nested
        reason = _guard.reason(self, _describe_layer) or _layer_heads_reason(self)
        if reason is not None:
            if is_causal and src_mask is None and isinstance(src, Tensor) and not nested:  # torch's MHA wants it
                src_mask = _causal_mask(src.shape[1 if src.dim() == 3 and self.self_attn.batch_first else 0], src)
            return self._unfused(reason, nn.TransformerEncoderLayer.forward, src, src_mask, src_key_padding_mask,
                                 is_causal)
        if nested:
            return self._forward_nested(src, src_mask, src_key_padding_mask, is_causal)
        tp = self.__dict__.get(_TP)
        if tp is not None:  # tensor parallel: the same forward on this rank's shards (fused_block.distributed)
            return tp.call(self, self._fused_forward, src, src_mask, src_key_padding_mask, is_causal)
        return self._fused_forward(src, src_mask, src_key_padding_mask, is_causal)

    def _fused_forward(self, src, src_mask, src_key_padding_mask, is_causal):
        mods = self._modules
        attn = mods["self_attn"]
        _check_input("src", src, attn.embed_dim, attn)
        _check_flag("is_causal", is_causal)
        x, batched = _batch(src, attn.batch_first)
        B, L = _dims(x, attn.batch_first)
        L = _tp_length(self, L, masks=(("src_mask", src_mask),))  # SP: x holds this rank's part of the sequence
        _check_mask("src_mask", src_mask, B, attn.num_heads, L, L)
        _check_padding_mask("src_key_padding_mask", src_key_padding_mask, B, L, batched)
        kpm = src_key_padding_mask if batched or src_key_padding_mask is None else src_key_padding_mask[None]
        names = ("src_mask", "src_key_padding_mask")
        # Each dropout is on by its own module's training flag (torch's layer calls dropout1,
        # dropout2 and dropout, and its attention reads its own flag), not by the layer's.
        d1, d2, d = mods["dropout1"], mods["dropout2"], mods["dropout"]
        p1 = d1.p if d1.training else 0.0
        p2 = d2.p if d2.training else 0.0
        p_ff = d.p if d.training else 0.0
        p_attn = self._attn_dropout(attn)
        if not self.training and (p1 or p2 or p_ff or p_attn) and self._torch_fast_path(src):
            p1 = p2 = p_ff = p_attn = 0.0  # torch's layer runs its inference fast path: no dropout at all

        masks = None

        def sa(inp):
            return attn._attend(inp, None, None, src_mask, kpm, is_causal, p_attn, names, masks=masks)

        with self._seed_block(x, p1, p2, p_ff, p_attn):
            if _step.ENABLED and not _VARLEN and _TP_RUN not in self.__dict__:
                # The step as two autograd Functions where it applies (fused_block._step); the masks
                # resolved once, for it or for the ops one by one.
                planned = _step.plan(self, attn, x, p_attn, p1, p_ff, p2)
                if planned is not None:
                    masks = _resolve_masks(src_mask, kpm, is_causal, B, attn.num_heads, L, L, x.dtype, names)
                    if _step.takes(planned[1], masks, x):
                        return _unbatch(_step.run(x, planned[0], masks.key_padding, planned[1]), batched,
                                        attn.batch_first)
            if self.norm_first:
                n1, x = self._add_norm(mods["norm1"], x)              # x's two gradients summed in norm1's kernel
                n2, h = self._add_norm(mods["norm2"], sa(n1), x, p1)  # h = x + drop1(attn)
                y = self._ffn(n2, p_ff, p2, residual=h)               # h + drop2(ffn), add in the epilogue
            else:
                h, r = self._add_norm(mods["norm1"], _like(sa(x), x), x, p1, True)  # r: h for the next add
                f = self._ffn(h, p_ff, 0.0)  # dropout2 rides in the norm kernel
                y, _ = self._add_norm(mods["norm2"], _like(f, h), r, p2)
        return _unbatch(y, batched, attn.batch_first)

    def _torch_fast_path(self, src):
        """Whether torch's layer runs its inference fast path (``torch._transformer_encoder_layer_fwd``,
        no dropout at all, whatever the dropout submodules' flags) on this call: its conditions,
        checked only where the layer is in eval mode and one of its dropouts in training mode."""
        attn, n1, n2 = self.self_attn, self.norm1, self.norm2
        if not (self.activation_relu_or_gelu and torch.backends.mha.get_fastpath_enabled() and src.dim() == 3
                and attn.batch_first and attn.in_proj_bias is not None and attn._qkv_same_embed_dim
                and n1.eps == n2.eps and attn.num_heads % 2 == 0 and not torch.is_autocast_enabled()):
            return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.modules()):
            return False
        tensors = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias,
                   n1.weight, n1.bias, n2.weight, n2.bias, self.linear1.weight, self.linear1.bias,
                   self.linear2.weight, self.linear2.bias)
        devices = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
        if torch.overrides.has_torch_function(tensors) or any(t.device.type not in devices for t in tensors):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))

    def _forward_nested(self, src, src_mask, src_key_padding_mask, is_causal):
        """A nested (B, ragged L, E) src, as ``nn.TransformerEncoder``'s inference fast path hands
        its layers (strided) or a user builds it (jagged): its tokens back to back as one row,
        the attention as the varlen kernel over the sequences (no padding computed), the other
        ops token by token; the output a nested tensor of src's layout (what torch's fast path
        returns; the encoder then pads with zeros). With a ``src_mask``, RoPE, or attention the
        varlen kernel does not take (see :meth:`_varlen_ok`): the kernels on the padded batch
        with the lengths as key padding."""
        if not self.self_attn.batch_first:
            raise ValueError("src: nested tensors need batch_first=True (as torch's layers)")
        if src_key_padding_mask is not None:
            raise ValueError("src_key_padding_mask: not supported with a nested src (its lengths are the padding)")
        if src.layout == torch.jagged:
            tokens, offsets = src.values(), src.offsets()
        else:
            parts = src.unbind()
            tokens = torch.cat(parts)
            offsets = F.pad(torch.tensor([t.shape[0] for t in parts], device=tokens.device).cumsum(0), (1, 0))
        lengths = offsets.diff()
        if src_mask is None and self._varlen_ok(tokens):
            longest = int(lengths.max()) if lengths.numel() else 0
            with _varlen_tokens(offsets.to(torch.int32), longest):
                y = self.forward(tokens[None], None, None, is_causal)[0]
            if src.layout == torch.jagged:
                return torch.nested.nested_tensor_from_jagged(y, offsets)
            return torch.nested.as_nested_tensor(list(y.split(lengths.tolist())), layout=torch.strided)
        padded = torch.nested.to_padded_tensor(src, 0.0)
        valid = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None]
        y = self.forward(padded, src_mask, ~valid, is_causal)
        if src.layout == torch.jagged:
            return torch.nested.nested_tensor_from_jagged(y[valid], offsets)
        return torch._nested_tensor_from_mask(y, valid, mask_check=False)

    def _varlen_ok(self, tokens):
        """Whether the varlen kernel takes this layer's attention: the kernel path, packed
        self-attention of a kernel head dim and dtype, no RoPE (its positions would need to
        restart per sequence), no added keys, not tensor parallel."""
        attn = self.self_attn
        return (_backend.use_triton(tokens) and attn._qkv_same_embed_dim and not attn.rope and attn.bias_k is None
                and not attn.add_zero_attn and _TP not in self.__dict__
                and attn.head_dim in _KERNEL_HEAD_DIMS and tokens.dtype in (torch.float16, torch.bfloat16, torch.float32)
                and not (tokens.dtype == torch.float32 and attn.head_dim > MAX_FP32_HEAD_DIM))

    @classmethod
    def from_torch(cls, layer, attentions=None):
        """A fused layer sharing ``layer``'s parameter tensors, modules and train/eval mode.
        ``attentions``: the attention modules converted so far (``convert`` passes one dict for
        the whole model), so that one shared by several layers becomes one fused module."""
        return _from_torch(cls, layer, ("self_attn", "linear1", "dropout", "linear2", "norm1", "norm2",
                                        "dropout1", "dropout2"), attentions)


class TransformerDecoderLayer(_LayerMixin, nn.TransformerDecoderLayer):
    """``torch.nn.TransformerDecoderLayer`` on the fused kernels: masked self-attention,
    cross-attention over ``memory``, FFN; Pre-LN or Post-LN. Same relation to torch's layer
    as :class:`TransformerEncoderLayer` (``norm`` and ``num_kv_heads`` keywords; ``norm3``).

    ``forward(tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
    memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False)``.
    """

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu,
                 layer_norm_eps=1e-5, batch_first=False, norm_first=False, bias=True, device=None,
                 dtype=None, *, norm="layer", num_kv_heads=None, rope=False, rope_base=10000.0,
                 rope_interleaved=False):
        d_model, nhead, num_kv_heads = _check_heads(d_model, nhead, num_kv_heads)
        # numpy scalars (torch's layers take them) as Python's, once: the modules built here keep them
        dim_feedforward, dropout, layer_norm_eps, batch_first, norm_first = map(
            _validate.scalar, (dim_feedforward, dropout, layer_norm_eps, batch_first, norm_first))
        factory = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)
        mha = dict(dropout=dropout, batch_first=batch_first, bias=bias, num_kv_heads=num_kv_heads, **factory)
        self.self_attn = MultiheadAttention(d_model, nhead, rope=rope, rope_base=rope_base,
                                            rope_interleaved=rope_interleaved, **mha)
        self.multihead_attn = MultiheadAttention(d_model, nhead, **mha)
        self.linear1 = nn.Linear(d_model, _ffn_width(activation, dim_feedforward), bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self._setup(d_model, activation, layer_norm_eps, bias, norm, ("norm1", "norm2", "norm3"), factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    _ATTENTIONS = ("self_attn", "multihead_attn")
    _NORMS = ("norm1", "norm2", "norm3")
    _DROPOUTS = ("dropout", "dropout1", "dropout2", "dropout3")

    def _ffn_dropout(self):
        return self.dropout3

    def __setstate__(self, state):
        # torch's decoder layer sets activation = F.relu when the state holds no "activation"
        # entry, which is the case for a module activation (a submodule, in _modules: the
        # tanh GELU, a callable module): the attribute would hide it in a copy or a load.
        nn.Module.__setstate__(self, state)
        if not hasattr(self, "activation"):
            self.activation = F.relu

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        reason = _guard.reason(self, _describe_layer) or _layer_heads_reason(self)
        if reason is not None:
            if tgt_is_causal and tgt_mask is None and isinstance(tgt, Tensor):  # torch's MHA wants the mask
                tgt_mask = _causal_mask(tgt.shape[1 if tgt.dim() == 3 and self.self_attn.batch_first else 0], tgt)
            return self._unfused(reason, nn.TransformerDecoderLayer.forward, tgt, memory, tgt_mask, memory_mask,
                                 tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        tp = self.__dict__.get(_TP)
        if tp is not None:  # tensor parallel: the same forward on this rank's shards (fused_block.distributed)
            return tp.call(self, self._fused_forward, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                           memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        return self._fused_forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                                   tgt_is_causal, memory_is_causal)

    def _fused_forward(self, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                       tgt_is_causal, memory_is_causal):
        sa_mod, ca_mod = self.self_attn, self.multihead_attn
        # Each attention reads its inputs by its own batch_first, as torch's layer calls them:
        # where a user set the two flags apart, cross-attention reads the self-attention block's
        # output (tgt's layout) and memory by multihead_attn's flag, batch and sequence swapped
        # (torch's answer); the norms and the FFN run per token, in any layout. Unbatched inputs
        # are one sequence to both (torch's MultiheadAttention adds the batch dim by its flag).
        bf, bf_ca = sa_mod.batch_first, ca_mod.batch_first
        _check_input("tgt", tgt, sa_mod.embed_dim, sa_mod)
        _check_input("memory", memory, sa_mod.embed_dim, sa_mod)
        _check_flag("tgt_is_causal", tgt_is_causal)
        _check_flag("memory_is_causal", memory_is_causal)
        if memory.dim() != tgt.dim():
            raise ShapeError(f"memory must be {tgt.dim()}-D like tgt, got shape {tuple(memory.shape)}")
        if bf != bf_ca and self.__dict__.get(_TP_RUN) is not None:
            raise ValueError("self_attn.batch_first and multihead_attn.batch_first differ: not supported under "
                             "tensor parallelism (fused_block.distributed shards one layout)")
        x, batched = _batch(tgt, bf)
        mem, _ = _batch(memory, bf_ca)
        B, L = _dims(x, bf)
        Bm, S = _dims(mem, bf_ca)
        L, S = _tp_length(self, L, masks=(("tgt_mask", tgt_mask), ("memory_mask", memory_mask))), \
            _tp_length(self, S, memory=True)
        swapped = batched and bf != bf_ca  # cross-attention reads tgt's batch as its sequence
        turned = not batched and bf != bf_ca  # the unit batch dim moved to multihead_attn's place
        Bc, Lc = (L, B) if swapped else (B, L)  # the queries as cross-attention reads them
        if Bm != Bc:
            raise ShapeError(f"memory: batch size {Bm} does not match tgt's {Bc}")
        _check_mask("tgt_mask", tgt_mask, B, sa_mod.num_heads, L, L)
        _check_mask("memory_mask", memory_mask, Bc, ca_mod.num_heads, Lc, S)
        _check_padding_mask("tgt_key_padding_mask", tgt_key_padding_mask, B, L, batched)
        _check_padding_mask("memory_key_padding_mask", memory_key_padding_mask, Bc, S, batched)
        if not batched:
            tgt_key_padding_mask = None if tgt_key_padding_mask is None else tgt_key_padding_mask[None]
            memory_key_padding_mask = None if memory_key_padding_mask is None else memory_key_padding_mask[None]
        # Each dropout is on by its own module's training flag, as torch's layer calls them.
        p = (lambda d: d.p if d.training else 0.0)  # noqa: E731
        mods = self._modules
        p1, p2, p3, p_ff = p(mods["dropout1"]), p(mods["dropout2"]), p(mods["dropout3"]), p(mods["dropout"])
        p_sa, p_ca = self._attn_dropout(sa_mod), self._attn_dropout(ca_mod)

        def sa(inp):
            return sa_mod._attend(inp, None, None, tgt_mask, tgt_key_padding_mask, tgt_is_causal,
                                  p_sa, ("tgt_mask", "tgt_key_padding_mask"))

        def ca(inp):
            out = ca_mod._attend(inp.transpose(0, 1) if turned else inp, mem, mem, memory_mask,
                                 memory_key_padding_mask, memory_is_causal, p_ca,
                                 ("memory_mask", "memory_key_padding_mask"))
            return out.transpose(0, 1) if turned else out

        with self._seed_block(x, p1, p2, p3, p_ff, p_sa, p_ca):
            if self.norm_first:
                n1, x = self._add_norm(self.norm1, x)
                n2, h = self._add_norm(self.norm2, sa(n1), x, p1)
                n3, h = self._add_norm(self.norm3, ca(n2), h, p2)
                y = self._ffn(n3, p_ff, p3, residual=h)
            else:
                h, r = self._add_norm(self.norm1, _like(sa(x), x), x, p1, True)
                h, r = self._add_norm(self.norm2, _like(ca(h), h), r, p2, True)
                f = self._ffn(h, p_ff, 0.0)  # dropout3 rides in the norm kernel
                y, _ = self._add_norm(self.norm3, _like(f, h), r, p3)
        return _unbatch(y, batched, bf)

    @classmethod
    def from_torch(cls, layer, attentions=None):
        """A fused layer sharing ``layer``'s parameter tensors, modules and train/eval mode
        (``attentions``: as :meth:`TransformerEncoderLayer.from_torch`)."""
        return _from_torch(cls, layer, ("self_attn", "multihead_attn", "linear1", "dropout", "linear2",
                                        "norm1", "norm2", "norm3", "dropout1", "dropout2", "dropout3"), attentions)


# ---------------------------------------------------------------------------------------------
# the call-time guard (fused_block._guard): what the fused forward bypasses
# ---------------------------------------------------------------------------------------------

_LINEAR, _DROPOUT, _ACTIVATION_MODULES = (nn.Linear,), (nn.Dropout,), (nn.ReLU, nn.GELU)
_NORM_CLASSES = {"layer": (nn.LayerNorm, LayerNorm), "rms": (nn.RMSNorm, RMSNorm)}


def _describe_mha(mha):
    """The fused MultiheadAttention calls no submodule (neither does torch's: it reads
    out_proj's weight too); it only needs plain tensors."""
    why = (_guard.tensors_reason("", mha, ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                                           "v_proj_weight", "bias_k", "bias_v"))
           or _guard.tensors_reason("out_proj", mha.out_proj, ("weight", "bias")))
    return why, (), None


def _heads_reason(mha, path=""):
    """Why ``mha``'s heads are not those the fused path reads, or None. torch's attention takes
    them from ``num_heads`` on every call (``head_dim = embed_dim // num_heads``); the fused path
    reads ``num_heads``, ``head_dim`` and ``num_kv_heads`` as built. ``num_heads`` (or
    ``head_dim``) set since: torch's forward runs (raises for GQA/RoPE, which it cannot compute).
    Checked per call (a plain attribute: no registration announces it). A tensor-parallel call
    sets this rank's head counts for its duration (``_TP_RUN``)."""
    built = mha.__dict__.get("_built_heads")
    if built is None or (built[0] == mha.num_heads and built[1] == mha.head_dim) or _TP_RUN in mha.__dict__:
        return None
    if mha.num_kv_heads != built[0] or mha.rope:
        raise ValueError(f"{path or 'MultiheadAttention'}: num_heads/head_dim set to ({mha.num_heads}, "
                         f"{mha.head_dim}) after construction with ({built[0]}, {built[1]}): not supported with "
                         "num_kv_heads != num_heads or rope=True")
    return (f"{path + '.' if path else ''}num_heads/head_dim set to ({mha.num_heads}, {mha.head_dim}) after "
            f"construction with ({built[0]}, {built[1]})")


def _layer_heads_reason(layer):
    for name in layer._ATTENTIONS:
        why = _heads_reason(layer._modules[name], name)
        if why is not None:
            return why
    return None


def _describe_layer(layer):
    """Every submodule torch's forward calls and the fused one reads instead: linear1/2, the
    norms, the dropouts, the attention modules (whose out_proj torch's attention reads as well)
    and a ReLU/GELU activation module."""
    norms = _NORM_CLASSES[layer.norm]
    spec, skip = {}, []
    wrapped = []
    for name in ("linear1", "linear2"):
        entries, called = lora.spec(name, getattr(layer, name), _LINEAR)
        spec.update(entries)
        skip.extend(called)
        if lora.is_lora(getattr(layer, name)):
            wrapped.append(name)
    spec.update((name, _DROPOUT) for name in layer._DROPOUTS)
    spec.update((name, norms) for name in layer._NORMS)
    for name in layer._ATTENTIONS:
        spec[name] = (MultiheadAttention,)
        skip.append(name + ".out_proj")
    if isinstance(layer.activation, nn.Module):
        if _activation_name(layer.activation) is None:
            skip.append("activation")  # a custom activation module: the fused path calls it too
        else:
            spec["activation"] = _ACTIVATION_MODULES
    tp = layer.__dict__.get(_TP)
    accept = None if tp is None else tp.accepts
    why, watched = _guard.scan(layer, spec, skip, accept=accept)
    for name in layer._ATTENTIONS:
        why = why or _guard.tensors_reason(name + ".out_proj", getattr(layer, name).out_proj, ("weight", "bias"),
                                           accept)
    return why, watched, lora.live(layer, wrapped) if wrapped else None


def _causal_mask(L, like):
    return nn.Transformer.generate_square_subsequent_mask(L, device=like.device, dtype=like.dtype)


def _from_torch(cls, layer, children, attentions=None):
    """Build ``cls`` around ``layer``'s own submodules: the same Parameter objects (so an
    optimizer created before conversion keeps working), device, dtype and mode.

    Everything else ``nn.Module`` keeps on the layer object carries over too: its hook dicts
    (forward, forward-pre, backward, backward-pre, state-dict and load-state-dict hooks) are
    the layer's very dict objects, so they fire on the fused layer and handles made before the
    conversion still remove them; parameters, buffers and submodules the user registered on
    the layer, and its plain attributes, stay, in the same order (the state dict's keys and
    their order are torch's layer's). The containers of parameters, buffers and submodules are
    the fused layer's own (same entries, the attention modules converted): torch's layer is not
    changed. An instance-level ``forward`` (bound to torch's layer) does not carry over:
    ``convert`` leaves such a layer unconverted. An ``nn.MultiheadAttention`` in several slots
    (a decoder's tied self- and cross-attention; with ``attentions``, a dict kept across the
    calls, one shared by several layers) becomes one fused module in all of them, as torch's
    module is one: one mode, one set of attributes, one parameter when one is assigned."""
    attentions = {} if attentions is None else attentions  # id(torch's module) -> (it, the fused one)
    new = cls.__new__(cls)
    state = dict(layer.__dict__)
    state.pop("forward", None)
    for key in ("_parameters", "_buffers", "_modules"):
        state[key] = type(state[key])(state[key])
    state["_non_persistent_buffers_set"] = set(state["_non_persistent_buffers_set"])
    new.__dict__.update(state)
    for name in children:
        child = getattr(layer, name)
        if isinstance(child, nn.MultiheadAttention) and not isinstance(child, MultiheadAttention):
            if id(child) not in attentions:
                attentions[id(child)] = (child, _convert_mha(child))
            new._modules[name] = attentions[id(child)][1]  # its slot: the state dict's order stays torch's
    new.norm_first = layer.norm_first
    new.norm = "rms" if isinstance(layer.norm1, nn.RMSNorm) else "layer"
    new.activation = getattr(layer, "activation", F.relu)
    new.activation_relu_or_gelu = getattr(layer, "activation_relu_or_gelu", 0)
    new.training = layer.training  # the layer's own flag: each submodule keeps its own (its dropouts')
    return new


def _convert_mha(mha):
    cls = MultiheadAttention
    if parametrize.is_parametrized(mha):
        # parametrize swapped in a subclass holding a property per parametrized tensor: the
        # same subclass of ours (type_before_parametrizations then names ours)
        kind = type(mha)
        cls = type(kind.__name__, (MultiheadAttention,),
                   {k: v for k, v in kind.__dict__.items() if k not in ("__dict__", "__weakref__")})
    new = cls.__new__(cls)
    new.__dict__.update(mha.__dict__)
    # Its own containers of parameters, buffers and submodules (torch's module stays as it
    # was); the hook dicts (forward, backward, state-dict ones) are torch's module's very dict
    # objects: a handle made before the conversion removes its hook from the converted module
    # too (and the guard then lets the fused path run again).
    for key in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        if key in mha.__dict__:
            new.__dict__[key] = type(mha.__dict__[key])(mha.__dict__[key])
    new.num_kv_heads = mha.num_heads
    # torch's head dim (its head_dim attribute is stale where num_heads was set since: the
    # guard's check then sends the calls to torch's forward)
    new._built_heads = (mha.num_heads, mha.embed_dim // mha.num_heads)
    new.rope, new.rope_interleaved = False, False
    return new
