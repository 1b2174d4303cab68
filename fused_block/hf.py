"""Hugging Face ``transformers`` models converted in place by :func:`fused_block.convert`.

Covered layer classes (their model classes, e.g. ``LlamaForCausalLM``, ``GPT2LMHeadModel``,
``BertForMaskedLM``, need nothing else): ``LlamaDecoderLayer``, ``MistralDecoderLayer``,
``Qwen2DecoderLayer`` (the LLaMA family: Pre-RMSNorm, RoPE, GQA, gated MLP), ``GPT2Block``
(Pre-LN, Conv1D weights, fused ``c_attn``, tanh GELU) and ``BertLayer`` (Post-LN encoder).

How: each recognised layer keeps its class, submodules, parameters (so state dicts,
``save_pretrained``/``from_pretrained``, optimizers and train/eval mode are untouched) and
gets an instance-level ``forward`` that runs the fused ops:

- LLaMA family: ``add_rms_norm`` for both norms (the attention's residual add fused into the
  second), one QKV GEMM (q/k/v weights concatenated, the copy cached while the weights do not
  change and no gradient is taken), ``rope_qkvpacked`` on the packed QKV output (q and k
  rotated, v copied, one launch; angles in fp32 from ``position_ids`` and the model's rotary
  ``inv_freq``/``attention_scaling``, else from the layer's ``position_embeddings``), the KV
  cache's ``update``, the attention kernel (GQA, bottom-right causal for decoding with a cache,
  key padding), the output GEMM, and the SiLU-gated MLP as ``swiglu`` (gate and up in one GEMM
  with the SiLU-multiply in its epilogue, the weights read in place; the residual add in the
  down projection's epilogue). An MLP with another ``hidden_act`` runs Hugging Face's module.
- GPT-2: ``add_layer_norm`` for ``ln_1`` and ``ln_2`` (attention residual and its dropout
  fused), ``linear`` on the Conv1D weights as transposed views (no copies), the attention
  kernel, ``mlp`` with tanh GELU, output dropout and the residual in its epilogues.
- BERT: one QKV GEMM, the attention kernel with the padding mask, then the two Post-LN
  ``add_layer_norm`` with the dense outputs' dropout fused, and ``mlp`` for the FFN.

Self-attention reads the packed QKV output in place (``attention_qkvpacked``: the output in the
out-projection's layout, one packed gradient, no split, merge, copy or cat) whenever the keys
are this call's own: no cache, or a cache that held nothing before (training, prefill). With
cached keys (decoding) q, k and v are views of the packed tensor and the cache returns the
keys to attend.

Masks: the layer reads the mask the model built for its attention implementation (None, a
4-D bool or additive mask, or flash-attention's 2-D padding mask), checks once per mask
object that it is causal (bottom-right) and/or key padding, and hands the kernel ``causal``
and a (B, Lk) padding mask. Any other 4-D mask of the known convention (sliding windows that
cut keys, packed sequences, other custom patterns, a 4-D mask under ``torch.compile`` or CUDA
graph capture where its values cannot be read) goes to the kernel as it is, as its bool
``mask`` or additive ``bias`` (read tile by tile). Only masks of an unknown shape convention,
a top-left causal mask with more queries than keys and head dims outside the kernel's range
run ``scaled_dot_product_attention`` with that very mask after a one-time warning. Inputs the
fused path does not express (output_attentions, head masks, cross-attention, hooks on the
skipped submodules, unknown activations or signatures, float64) run the layer's original
forward, with a one-time warning. Never a different answer, only a slower one.

This module never imports ``transformers``: it is only reached for models that already did.
A converted model object cannot be pickled whole (``torch.save(model)``); save its state dict
or use ``save_pretrained``.
"""
import functools
import inspect
import sys
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from fused_block import _backend, _guard, reference
from fused_block.attention import MAX_FP32_HEAD_DIM, MAX_HEAD_DIM, MIN_HEAD_DIM
from fused_block.attention import attention as _attention
from fused_block.attention import attention_qkvpacked
from fused_block.blocks import _capturing, _like
from fused_block.linear import linear, mlp, swiglu
from fused_block.loss import linear_cross_entropy
from fused_block.norm import add_layer_norm, add_rms_norm
from fused_block.rope import rope_qkvpacked

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Hugging Face activation names (ACT2FN keys) and the GEMM epilogue's equivalent.
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_LLAMA_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
_ROTARY_CLASSES = ("LlamaRotaryEmbedding", "MistralRotaryEmbedding", "Qwen2RotaryEmbedding")
# Their MLPs: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; SwiGLU when act_fn is SiLU.
_GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
_SILU = ("silu", "swish")
_CAPTURE_MODULE = "transformers.utils.output_capturing"
def _warn_once(key, message):
    _backend.warn_once(key, f"fused_block: {message}", stacklevel=3)


def is_transformers_model(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


# ---------------------------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------------------------

def convert_modules(model: nn.Module) -> list:
    """Patch every recognised layer of ``model`` in place; returns the converted modules."""
    rotaries = [m for m in model.modules() if type(m).__name__ in _ROTARY_CLASSES
                and hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
    rotary = rotaries[0] if len(rotaries) == 1 else None
    converted = []
    for m in model.modules():
        family = _FAMILIES.get(type(m).__name__)
        if family is None or not type(m).__module__.startswith("transformers.models.") or "_fused_block" in m.__dict__:
            continue
        reason = family.check(m)
        if reason is None and ("forward" in m.__dict__ or any(hasattr(s, "_hf_hook") for s in m.modules())):
            reason = "its forward is already wrapped (accelerate's device hooks or another patch)"
        if reason is None and _returns_tensor(type(m).forward) is None:
            reason = f"the return type of {type(m).__name__}.forward is not recognised (transformers version?)"
        if reason is not None:
            _warn_once(("convert", type(m).__name__, reason),
                       f"{type(m).__name__} is left unconverted: {reason}")
            continue
        _patch(m, family, rotary)
        family.prepare(m)
        reason = _tree_reason(m, family)  # the MLP may have joined the tree
        if reason is not None:
            _unpatch(m)
            _warn_once(("convert", type(m).__name__, reason), f"{type(m).__name__} is left unconverted: {reason}")
            continue
        m._fused_block.spec = _spec(m, family)
        converted.append(m)
    for m in model.modules():
        if type(m).__name__ in _CAUSAL_LMS and type(m).__module__.startswith("transformers.models.") \
                and "_fused_block" not in m.__dict__:
            reason = _lm_check(m)
            if reason is not None:
                _warn_once(("convert", type(m).__name__, reason),
                           f"{type(m).__name__}'s loss runs Hugging Face's code (the logits are built): {reason}")
                continue
            _patch_lm(m)
            converted.append(m)
    return converted


# In a family's tree: the submodule's class as found at conversion (checked by the family).
SAME = "same"


class _Family:
    """A layer class's conversion: ``check(layer)`` at conversion and ``check_call(layer, call)``
    per call return a reason to keep the original forward (or None); ``prepare(layer)`` records
    what the layer's conversion decided; ``run(layer, call, x)`` computes the output;
    ``tree(layer)`` maps the path of every submodule the original forward calls and ``run``
    does not to its allowed classes (a tuple, or ``SAME``: its class at conversion); ``called``
    lists the paths of the submodules ``run`` calls itself (their subtrees are not checked).
    The tree is the call-time guard's spec (:mod:`fused_block._guard`): a submodule outside it,
    of another class, wrapped (PEFT, quantization), hooked or with its own ``forward`` makes the
    layer run its original forward."""

    def __init__(self, check, check_call, run, tree, called=lambda layer: (), prepare=lambda layer: None):
        self.check, self.check_call, self.run, self.called = check, check_call, run, called
        self.tree, self.prepare = tree, prepare


def _tree_reason(layer, family):
    """At conversion: a submodule the family does not know, or of a class it does not fuse."""
    tree, skip = family.tree(layer), tuple(family.called(layer))
    found = {}
    for path, m in layer.named_modules():
        if not path or path in skip or path.startswith(tuple(p + "." for p in skip)):
            continue
        allowed = tree.get(path)
        if allowed is None:
            return f"{path} ({type(m).__name__}) is a submodule the fused path does not know"
        if allowed is not SAME and type(m) not in allowed:
            return f"{path} is a {type(m).__module__}.{type(m).__qualname__}, not one of {[c.__name__ for c in allowed]}"
        found[path] = allowed
    missing = [p for p in tree if p not in found]
    return f"{missing[0]} is missing" if missing else None


def _spec(layer, family):
    """The guard's spec: the tree with ``SAME`` resolved to the classes found now (at conversion)."""
    return {path: (type(layer.get_submodule(path)),) if allowed is SAME else allowed
            for path, allowed in family.tree(layer).items()}


def _is_capture_hook(fn):
    """transformers' output-capturing hooks: installed once, inert unless a collector asks."""
    return getattr(fn, "__module__", None) == _CAPTURE_MODULE


def _capture_reason():
    collector = sys.modules[_CAPTURE_MODULE]._active_collector.get()
    if collector and any(k != "hidden_states" and not k.startswith("_") for k in collector):
        return "output capturing of attention weights (output_attentions=True)"
    return None


def _describe(layer):
    """For :func:`fused_block._guard.reason`: the layer's spec checked against its submodules."""
    state = layer._fused_block
    why, watched = _guard.scan(layer, state.spec, state.family.called(layer), _is_capture_hook)
    capture = any(_is_capture_hook(getattr(h, "func", h)) for m in watched for h in m._forward_hooks.values())
    return why, watched, _capture_reason if capture else None


class _State:
    """What a converted layer keeps beside its modules: how its forward was called and returns."""

    def __init__(self, family, original, positional, returns_tensor, rotary):
        self.family, self.original, self.positional = family, original, positional
        self.returns_tensor = returns_tensor
        self.rotary = rotary  # the model's rotary module (LLaMA family), not a submodule
        self.packed = {}  # name -> (key, value) cache of _cached
        self.fused_mlp = False  # LLaMA family: the MLP runs as swiglu
        self.spec = {}  # the call-time guard's spec (_spec), set once the family prepared the layer


def _patch(module, family, rotary):
    forward = type(module).forward
    params = list(inspect.signature(forward).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    state = _State(family, forward, positional, _returns_tensor(forward), rotary)
    module.__dict__["_fused_block"] = state  # a plain attribute: no submodule, no state-dict entry
    module.forward = types.MethodType(_fused_forward, module)


def _unpatch(module):
    del module.__dict__["_fused_block"], module.__dict__["forward"]


def _returns_tensor(forward):
    """True if the layer returns a tensor, False for a 1-tuple (older transformers), None if unknown."""
    ann = inspect.signature(forward).return_annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    if ann is torch.Tensor or text in ("torch.Tensor", "Tensor", "torch.FloatTensor"):
        return True
    if "tuple" in str(ann).lower():
        return False
    return None


def _fused_forward(self, *args, **kwargs):
    state = self._fused_block
    call = dict(zip(state.positional, args))
    call.update(kwargs)
    hidden = call.get("hidden_states")
    reason = _common_reason(call, hidden) or _guard.reason(self, _describe) or state.family.check_call(self, call)
    if reason is not None:
        _warn_once((type(self).__name__, reason), f"{type(self).__name__} runs its original forward: {reason}")
        return state.original(self, *args, **kwargs)
    run = functools.partial(state.family.run, self, call)
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled() \
            and hasattr(self, "_gradient_checkpointing_func"):
        out = self._gradient_checkpointing_func(run, hidden)
    else:
        out = run(hidden)
    if state.returns_tensor:
        return out
    # Older transformers: a tuple, whose models read the updated cache after the hidden states
    # (when use_cache) or ignore what follows them.
    return (out, _cache(call)) if call.get("use_cache") and _cache(call) is not None else (out,)


def _common_reason(call, hidden):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return "hidden_states is not a (batch, length, hidden) tensor"
    mask = call.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() in (2, 4)):
        return f"an attention mask of type {type(mask).__name__} (e.g. flex attention's BlockMask)"
    if hidden.dtype not in _KERNEL_DTYPES:
        return f"dtype {hidden.dtype} (the kernels take fp32, fp16 and bf16)"
    if call.get("output_attentions"):
        return "output_attentions=True (the fused attention never forms the attention weights)"
    if call.get("head_mask") is not None:
        return "a head_mask"
    if call.get("encoder_hidden_states") is not None:
        return "cross-attention (encoder_hidden_states)"
    for name in ("past_key_value", "past_key_values", "layer_past", "cache"):
        cache = call.get(name)
        if cache is not None and not hasattr(cache, "update"):
            return f"a legacy (tuple) {name}"
    return None


def _cache(call):
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if call.get(name) is not None:
            return call[name]
    return None


def _cached(state, name, tensors, make):
    """``make(tensors)``; cached across calls while the tensors are unchanged and no gradient
    flows through them (generation; buffers), recomputed otherwise (training, compile)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return make(tensors)
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
    hit = state.packed.get(name)
    if hit is None or hit[0] != key:
        hit = state.packed[name] = (key, make(tensors))
    return hit[1]


def _packed(state, name, tensors):
    """``torch.cat(tensors)`` (None for absent biases), cached as :func:`_cached`."""
    return None if tensors[0] is None else _cached(state, name, tensors, torch.cat)


# ---------------------------------------------------------------------------------------------
# masks and attention
# ---------------------------------------------------------------------------------------------

class _Plan:
    """How attention runs: the kernel (``causal``, ``key_padding`` (B, Lk) or None, the first
    ``n_keys`` keys) or SDPA with the model's own ``sdpa_mask`` / ``sdpa_causal`` and a reason."""

    __slots__ = ("kernel", "causal", "key_padding", "n_keys", "sdpa_mask", "sdpa_causal", "reason", "as_mask")

    def __init__(self, kernel, causal=False, key_padding=None, n_keys=None, sdpa_mask=None, sdpa_causal=False,
                 reason=None, as_mask=False):
        self.kernel, self.causal, self.key_padding, self.n_keys = kernel, causal, key_padding, n_keys
        self.sdpa_mask, self.sdpa_causal, self.reason = sdpa_mask, sdpa_causal, reason
        # A 4-D (B or 1, 1, Lq or 1, Lk) mask of the known convention the kernel takes as it is.
        self.as_mask = as_mask


_LAST_MASK = [None, None]  # (weakref to the last 4-D mask read, what it was read as)


def _mask_reason(mask, L, causal, flash):
    """Masks whose convention the fused path knows: None, flash-attention's 2-D padding mask,
    or a 4-D (B or 1, 1, Lq, Lk) mask; (B, 1, 1, Lk) only for bidirectional attention (older
    transformers pass causal layers a padding-only mask and apply causality inside)."""
    if mask is None or (mask.dim() == 2 and flash):
        return None
    if mask.dim() == 4 and mask.shape[1] == 1 and (mask.shape[2] == L or (mask.shape[2] == 1 and not causal)):
        return None
    return f"an attention mask of shape {tuple(mask.shape)} for a {'causal' if causal else 'bidirectional'} layer"


def _plan(mask, B, Lq, Lk, causal, flash):
    """Read a Hugging Face attention mask. ``causal``: the module is causal; ``flash``: the
    model runs a flash-attention implementation (2-D masks, bottom-right causal when None)."""
    if mask is None:
        if not causal or Lq == 1:
            return _Plan(True, causal=False)
        if Lq == Lk or flash:
            return _Plan(True, causal=True)
        if Lq < Lk:
            # SDPA's is_causal is top-left: query i sees keys j <= i, i.e. the first Lq keys bottom-right.
            return _Plan(True, causal=True, n_keys=Lq)
        return _Plan(False, sdpa_causal=True, reason=f"a top-left causal mask with more queries ({Lq}) than keys")
    if mask.dim() == 2:  # flash-attention's (B, seen + L) padding mask, 1 = token
        key_padding = ~mask[:, -Lk:].bool()
        # Under CUDA graph capture no value is read (a sync would invalidate the capture): the
        # kernels take the padding mask as it is, all-False or not.
        return _Plan(True, causal=causal, key_padding=_padding(key_padding, B, read=not _capturing(mask)))
    if torch.compiler.is_compiling():
        return _Plan(False, sdpa_mask=mask, as_mask=True, reason="a 4-D attention mask under torch.compile (its "
                     "values cannot be read while tracing; pass attention_mask=None when there is no padding)")
    last_ref, last = _LAST_MASK
    if last_ref is not None and last_ref() is mask and last[0] == (B, Lq, Lk, causal):
        return last[1]
    if _capturing(mask):  # a mask already read above is reused during capture
        return _Plan(False, sdpa_mask=mask, as_mask=True, reason="a 4-D attention mask first seen during CUDA "
                     "graph capture (its values cannot be read without a sync; run the model once before capturing)")
    plan = _read_mask(mask, B, Lq, Lk, causal)
    _LAST_MASK[:] = [weakref.ref(mask), ((B, Lq, Lk, causal), plan)]
    return plan


def _read_mask(mask, B, Lq, Lk, causal):
    general = _Plan(False, sdpa_mask=mask, as_mask=True, reason="an attention mask that is not causal plus key "
                    "padding (a sliding window that cuts keys, packed sequences, a custom pattern)")
    if mask.shape[-1] != Lk or mask.shape[0] not in (1, B):
        return general
    if mask.dtype == torch.bool:
        keep = mask
    else:
        keep = mask == 0
        if not bool((keep | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return general
    key_padding = ~keep[:, 0, -1, :]  # the last query sees every key that is not padding
    visible = reference.visible_keys(Lq, Lk, causal, key_padding, mask.device)
    if not torch.equal(visible, keep.expand(visible.shape)):
        return general
    return _Plan(True, causal=causal, key_padding=_padding(key_padding, B))


def _padding(key_padding, B, read=True):
    if read and not bool(key_padding.any()):
        return None
    return key_padding.expand(B, -1) if key_padding.shape[0] != B else key_padding


def _kernel_head_dim(D, dtype):
    return D % 8 == 0 and MIN_HEAD_DIM <= D <= (MAX_FP32_HEAD_DIM if dtype == torch.float32 else MAX_HEAD_DIM)


def _self_attention(qkv, H, Hkv, cache, layer_idx, mask, causal, flash, scale, dropout_p, name):
    """qkv (B, L, (H + 2 Hkv) * D), the packed [q; k; v] projection -> (B, L, H * D), the
    out-projection's input. The cache (if any) stores k and v (views) and returns the keys to
    attend; when those are this call's own (L of them: nothing was cached before, as in
    training and prefill; every cache layer of transformers returns past + new keys, or its
    whole static buffer), the packed kernel reads qkv in place and writes one packed gradient."""
    B, L, _ = qkv.shape
    D = qkv.shape[2] // (H + 2 * Hkv)
    heads = qkv.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2)  # (B, H + 2 Hkv, L, D) view
    q, k, v = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)
    plan = _plan(mask, B, L, k.shape[2], causal, flash)
    if plan.kernel and plan.n_keys is None and k.shape[2] == L and _kernel_head_dim(D, qkv.dtype):
        return attention_qkvpacked(qkv, H, Hkv, plan.causal, scale, plan.key_padding, dropout_p)
    return _attend(q, k, v, plan, scale, dropout_p, name).transpose(1, 2).reshape(B, L, H * D)


def _attend(q, k, v, plan, scale, dropout_p, name):
    """q (B, H, Lq, D), k and v (B, Hkv, Lk, D) -> (B, H, Lq, D)."""
    D = q.shape[-1]
    if plan.kernel and not _kernel_head_dim(D, q.dtype):
        plan = _Plan(False, sdpa_mask=_dense(plan, q.shape[2], k.shape[2], q.device),
                     reason=f"head dim {D} in {q.dtype} (outside the attention kernel's range)")
    if plan.kernel:
        if plan.n_keys is not None:
            k, v = k[:, :, :plan.n_keys], v[:, :, :plan.n_keys]
        return _attention(q, k, v, plan.causal, scale, plan.key_padding, dropout_p)
    m = plan.sdpa_mask
    if (plan.as_mask and _kernel_head_dim(D, q.dtype) and m.dim() == 4 and m.shape[1] == 1
            and m.shape[0] in (1, q.shape[0]) and m.shape[2] in (1, q.shape[2]) and m.shape[3] == k.shape[2]
            and m.dtype in (torch.bool, torch.float32, q.dtype)):
        # The model's own mask, read tile by tile: bool (True = attend) or additive.
        kw = {"mask": m} if m.dtype == torch.bool else {"bias": m}
        return _attention(q, k, v, False, scale, None, dropout_p, **kw)
    _warn_once((name, plan.reason), f"{name}: {plan.reason}; attention runs through "
               "torch.nn.functional.scaled_dot_product_attention with the model's mask (slower, same result)")
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.sdpa_mask, dropout_p=dropout_p,
                                          is_causal=plan.sdpa_causal, scale=scale)


def _dense(plan, Lq, Lk, device):
    """The kernel plan as SDPA's bool mask (True = attend)."""
    n = plan.n_keys or Lk
    vis = reference.visible_keys(Lq, n, plan.causal, None if plan.key_padding is None else plan.key_padding[:, :n],
                                 device)
    return F.pad(vis, (0, Lk - n), value=False)


def _is_flash(config):
    return str(getattr(config, "_attn_implementation", "")).startswith("flash")


def _implementation_reason(config):
    impl = getattr(config, "_attn_implementation", None)
    if impl in (None, "eager", "sdpa") or _is_flash(config):
        return None
    return f"attention implementation {impl!r} (its masks are not read by the fused path)"


# ---------------------------------------------------------------------------------------------
# LLaMA family: LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer
# ---------------------------------------------------------------------------------------------

def _llama_check(layer):
    attn = getattr(layer, "self_attn", None)
    parts = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or not all(type(getattr(attn, p, None)) is nn.Linear for p in parts):
        return "self_attn's q_proj/k_proj/v_proj/o_proj are not all torch.nn.Linear"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        n = getattr(layer, norm, None)
        if n is None or not hasattr(n, "weight") or _rms_eps(n) is None:
            return f"{norm} is not an RMSNorm with weight and eps"
    if not hasattr(layer, "mlp") or not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
        return "missing mlp, head_dim or scaling"
    return None


def _rms_eps(norm):
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    return None


def _llama_check_call(layer, call):
    attn = layer.self_attn
    hidden = call["hidden_states"]
    if call.get("position_embeddings") is None and _rotary_positions(layer, call, *hidden.shape[:2]) is None:
        return "no position_embeddings (and no model-level rotary module with position_ids)"
    window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
    if window is not None and _is_flash(attn.config):
        return "a sliding window with flash-attention masks"
    return (_implementation_reason(attn.config)
            or _mask_reason(call.get("attention_mask"), call["hidden_states"].shape[1], True,
                            _is_flash(attn.config)))


def _rotary_positions(layer, call, B, L):
    """position_ids (B or 1, L) when the model has one standard rotary module, else None."""
    positions = call.get("position_ids")
    if layer._fused_block.rotary is not None and isinstance(positions, torch.Tensor) and positions.dim() == 2 \
            and positions.shape[0] in (1, B) and positions.shape[1] == L:
        return positions
    return None


def _llama_rope(layer, qkv, H, Hkv, call):
    """RoPE on the packed QKV output: fp32 angles from position_ids and the rotary module's
    inv_freq when the model has one standard rotary module, else HF's cos/sin tables."""
    B, L = qkv.shape[:2]
    positions = _rotary_positions(layer, call, B, L)
    if positions is not None:
        state = layer._fused_block
        # The model's frequencies as its rotary module uses them (rounded if the model was cast),
        # in fp32 on qkv's device: a conversion kernel once, not per call.
        inv_freq = _cached(state, ("inv_freq", qkv.device), (state.rotary.inv_freq,),
                           lambda t: t[0].to(device=qkv.device, dtype=torch.float32))
        return rope_qkvpacked(qkv, H, Hkv, positions, inv_freq, scale=float(state.rotary.attention_scaling))
    cos, sin = call["position_embeddings"]
    return rope_qkvpacked(qkv, H, Hkv, cos=cos.expand(B, -1, -1) if cos.shape[0] != B else cos,
                          sin=sin.expand(B, -1, -1) if sin.shape[0] != B else sin)


def _swiglu_reason(mlp_mod):
    """Why the layer's MLP cannot run as ``swiglu`` (None if it can)."""
    kind = type(mlp_mod)
    if kind.__name__ not in _GATED_MLPS or not kind.__module__.startswith("transformers.models."):
        return f"{kind.__name__} is not one of the gated MLPs {_GATED_MLPS}"
    act = getattr(getattr(mlp_mod, "config", None), "hidden_act", None)
    if act not in _SILU or type(getattr(mlp_mod, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return f"hidden_act {act!r} (the fused SwiGLU gates with SiLU)"
    if not all(type(getattr(mlp_mod, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")):
        return "gate_proj, up_proj and down_proj are not all torch.nn.Linear"
    return None


def _llama_prepare(layer):
    reason = _swiglu_reason(layer.mlp)
    layer._fused_block.fused_mlp = reason is None
    if reason is not None:
        _warn_once(("mlp", type(layer).__name__, reason),
                   f"{type(layer).__name__}'s MLP runs Hugging Face's module (unfused): {reason}")


def _llama_run(layer, call, x):
    attn, state = layer.self_attn, layer._fused_block
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    D = attn.head_dim
    H = attn.q_proj.out_features // D
    Hkv = attn.k_proj.out_features // D
    n1, _ = add_rms_norm(x, None, ln1.weight, _rms_eps(ln1))
    w = _packed(state, "qkv_weight", (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    b = _packed(state, "qkv_bias", (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
    qkv = linear(n1, w, b)  # (B, L, (H + 2 Hkv) D): one GEMM
    qkv = _llama_rope(layer, qkv, H, Hkv, call)  # q, k rotated and v copied into one packed tensor
    p = attn.attention_dropout if attn.training else 0.0
    o = _self_attention(qkv, H, Hkv, _cache(call), attn.layer_idx, call.get("attention_mask"), True,
                        _is_flash(attn.config), attn.scaling, p, type(layer).__name__)
    o = linear(o, attn.o_proj.weight, attn.o_proj.bias)
    n2, h = add_rms_norm(_like(o, x), x, ln2.weight, _rms_eps(ln2))
    if not state.fused_mlp:
        return h + layer.mlp(n2)
    m = layer.mlp
    return swiglu(n2, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, h, b_gate=m.gate_proj.bias,
                  b_up=m.up_proj.bias, b_down=m.down_proj.bias)


# ---------------------------------------------------------------------------------------------
# GPT-2: GPT2Block
# ---------------------------------------------------------------------------------------------

def _gpt2_check(block):
    attn, mlp_mod = getattr(block, "attn", None), getattr(block, "mlp", None)
    if attn is None or mlp_mod is None or getattr(attn, "is_cross_attention", False):
        return "not a GPT-2 self-attention block"
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        try:
            conv = block.get_submodule(name)
        except AttributeError:
            conv = None
        if type(conv).__name__ != "Conv1D" or type(conv).__module__ != "transformers.pytorch_utils":
            return f"{name} is not transformers' Conv1D"
    act = getattr(attn.config, "activation_function", None)
    if act not in _ACTIVATIONS:
        return f"activation_function {act!r} has no fused epilogue"
    return None


def _gpt2_scale(attn):
    scaling = getattr(attn, "scaling", None)
    if scaling is not None:
        return float(scaling)
    scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
    return scale / (attn.layer_idx + 1) if attn.scale_attn_by_inverse_layer_idx else scale


def _gpt2_check_call(block, call):
    cfg = block.attn.config
    return (_implementation_reason(cfg)
            or _mask_reason(call.get("attention_mask"), call["hidden_states"].shape[1], True, _is_flash(cfg)))


def _gpt2_run(block, call, x):
    attn, m = block.attn, block.mlp
    H = attn.num_heads
    p_resid = attn.resid_dropout.p if block.training else 0.0
    n1, _ = add_layer_norm(x, None, block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
    # Conv1D stores (in, out): its transpose is nn.Linear's layout as a view, no copy.
    qkv = linear(n1, attn.c_attn.weight.t(), attn.c_attn.bias)  # [q; k; v], H heads each
    o = _self_attention(qkv, H, H, _cache(call), attn.layer_idx, call.get("attention_mask"), True,
                        _is_flash(attn.config), _gpt2_scale(attn), attn.attn_dropout.p if block.training else 0.0,
                        "GPT2Block")
    o = linear(o, attn.c_proj.weight.t(), attn.c_proj.bias)
    n2, h = add_layer_norm(_like(o, x), x, block.ln_2.weight, block.ln_2.bias, block.ln_2.eps, p_resid)
    act = _ACTIVATIONS[attn.config.activation_function]
    p_mlp = m.dropout.p if block.training else 0.0
    return mlp(n2, m.c_fc.weight.t(), m.c_fc.bias, m.c_proj.weight.t(), m.c_proj.bias, act, h, 0.0, p_mlp)


# ---------------------------------------------------------------------------------------------
# BERT: BertLayer (encoder)
# ---------------------------------------------------------------------------------------------

def _bert_check(layer):
    attn = getattr(getattr(layer, "attention", None), "self", None)
    if attn is None or not all(type(getattr(attn, p, None)) is nn.Linear for p in ("query", "key", "value")):
        return "attention.self's query/key/value are not all torch.nn.Linear"
    if getattr(layer, "is_decoder", False) or getattr(layer, "add_cross_attention", False):
        return "BERT as a decoder (causal self-attention, cross-attention) is not converted"
    act = getattr(attn.config, "hidden_act", None)
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        return f"hidden_act {act!r} has no fused epilogue"
    if getattr(attn, "position_embedding_type", "absolute") != "absolute":
        return "relative position embeddings in the attention scores"
    return None


def _bert_check_call(layer, call):
    s = layer.attention.self
    return (_implementation_reason(s.config)
            or _mask_reason(call.get("attention_mask"), call["hidden_states"].shape[1], False, _is_flash(s.config)))


def _bert_run(layer, call, x):
    s, so, inter, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
    H = s.num_attention_heads
    D = s.attention_head_size
    state = layer._fused_block
    w = _packed(state, "qkv_weight", (s.query.weight, s.key.weight, s.value.weight))
    b = _packed(state, "qkv_bias", (s.query.bias, s.key.bias, s.value.bias))
    scale = float(getattr(s, "scaling", D ** -0.5))
    o = _self_attention(linear(x, w, b), H, H, None, None, call.get("attention_mask"), False, _is_flash(s.config),
                        scale, s.dropout.p if layer.training else 0.0, "BertLayer")
    a = linear(o, so.dense.weight, so.dense.bias)
    p1 = so.dropout.p if layer.training else 0.0
    h, _ = add_layer_norm(_like(a, x), x, so.LayerNorm.weight, so.LayerNorm.bias, so.LayerNorm.eps, p1)
    f = mlp(h, inter.dense.weight, inter.dense.bias, out.dense.weight, out.dense.bias,
            _ACTIVATIONS[s.config.hidden_act])
    p2 = out.dropout.p if layer.training else 0.0
    y, _ = add_layer_norm(_like(f, h), h, out.LayerNorm.weight, out.LayerNorm.bias, out.LayerNorm.eps, p2)
    return y


# ---------------------------------------------------------------------------------------------
# what each family's fused forward reads instead of calling (the call-time guard's spec)
# ---------------------------------------------------------------------------------------------

_LINEAR, _DROPOUT, _LAYER_NORM = (nn.Linear,), (nn.Dropout,), (nn.LayerNorm,)


def _llama_tree(layer):
    tree = {"self_attn": SAME, "input_layernorm": SAME, "post_attention_layernorm": SAME}
    tree.update((f"self_attn.{p}_proj", _LINEAR) for p in "qkvo")
    if layer._fused_block.fused_mlp:
        tree.update({"mlp": SAME, "mlp.act_fn": SAME})
        tree.update((f"mlp.{p}_proj", _LINEAR) for p in ("gate", "up", "down"))
    return tree


def _gpt2_tree(block):
    return {"ln_1": _LAYER_NORM, "ln_2": _LAYER_NORM, "attn": SAME, "attn.c_attn": SAME, "attn.c_proj": SAME,
            "attn.attn_dropout": _DROPOUT, "attn.resid_dropout": _DROPOUT, "mlp": SAME, "mlp.c_fc": SAME,
            "mlp.c_proj": SAME, "mlp.act": SAME, "mlp.dropout": _DROPOUT}


def _bert_tree(layer):
    tree = {"attention": SAME, "attention.self": SAME, "attention.self.dropout": _DROPOUT,
            "attention.output": SAME, "intermediate": SAME, "intermediate.intermediate_act_fn": SAME,
            "output": SAME}
    tree.update((f"attention.self.{p}", _LINEAR) for p in ("query", "key", "value"))
    for part in ("attention.output", "output"):
        tree.update({f"{part}.dense": _LINEAR, f"{part}.LayerNorm": _LAYER_NORM, f"{part}.dropout": _DROPOUT})
    tree["intermediate.dense"] = _LINEAR
    return tree


# ---------------------------------------------------------------------------------------------
# causal LM heads: model(input_ids, labels=...)'s loss without the logits
# ---------------------------------------------------------------------------------------------

_CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
_LOSS_MODULE = "transformers.loss.loss_utils"
_QUIET = "quiet"  # the call asks for Hugging Face's own path (no warning)


class _LMState:
    """A converted causal LM: its class's forward and how it was called and returns."""

    def __init__(self, original, positional, prefix, output):
        self.original, self.positional, self.prefix, self.output = original, positional, prefix, output


def _lm_check(model):
    """At conversion: why ``model``'s forward cannot be replaced by the fused loss path (or None).

    The path mirrors ``*ForCausalLM.forward`` of these families (transformers 5): the base model
    called with every argument but ``labels`` and ``logits_to_keep``, ``lm_head`` on its last
    hidden state, ``self.loss_function`` (ForCausalLMLoss), an output dataclass with ``loss``
    and ``logits``."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        return "lm_head is not a torch.nn.Linear"
    if "forward" in model.__dict__ or hasattr(model, "_hf_hook"):
        return "its forward is already wrapped (accelerate's device hooks or another patch)"
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module):
        return "no base model under its base_model_prefix"
    sig = inspect.signature(type(model).forward)
    params = list(sig.parameters.values())[1:]
    names = [p.name for p in params]
    fields = getattr(sig.return_annotation, "__dataclass_fields__", {})
    base_params = inspect.signature(type(base).forward).parameters
    if not ({"labels", "logits_to_keep"} <= set(names) and params[-1].kind is inspect.Parameter.VAR_KEYWORD
            and {"loss", "logits"} <= set(fields)
            and all(n in base_params for n in names[:-1] if n not in ("labels", "logits_to_keep"))):
        return f"the signature of {type(model).__name__}.forward is not recognised (transformers version?)"
    if head.out_features != getattr(model.config, "vocab_size", None):
        return "lm_head's out_features differ from config.vocab_size"
    return None


def _patch_lm(model):
    original = type(model).forward
    params = list(inspect.signature(original).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    model.__dict__["_fused_block"] = _LMState(original, positional, model.base_model_prefix,
                                              inspect.signature(original).return_annotation)

    @functools.wraps(original)  # the original's signature: generate() and Trainer inspect it
    def forward(self, *args, **kwargs):
        return _lm_forward(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)


def _describe_lm(model):
    why, watched = _guard.scan(model, {"lm_head": (nn.Linear,)}, (model._fused_block.prefix,))
    return why, watched, None


def _lm_reason(model, call, return_logits):
    """Why this call runs Hugging Face's forward: _QUIET when that is what the call asks for
    (no labels, eval mode, return_logits=True), a reason to warn about, or None."""
    if call.get("labels") is None or not model.training or return_logits:
        return _QUIET
    if not isinstance(call["labels"], torch.Tensor):
        return "labels that are not a tensor"
    keep = call.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep != 0:
        return "logits_to_keep other than 0 with labels"
    if model.lm_head.weight.dtype not in _KERNEL_DTYPES:
        return f"an lm_head in {model.lm_head.weight.dtype} (the kernels take fp32, fp16 and bf16)"
    if model.loss_function is not getattr(sys.modules.get(_LOSS_MODULE), "ForCausalLMLoss", None):
        return "a loss_function other than transformers' ForCausalLMLoss"
    return _guard.reason(model, _describe_lm)


def _lm_forward(self, *args, **kwargs):
    state = self._fused_block
    return_logits = kwargs.pop("return_logits", False)
    call = dict(zip(state.positional, args))
    call.update(kwargs)
    reason = _lm_reason(self, call, return_logits)
    if reason is not None:
        if reason is not _QUIET:
            _warn_once(("lm", type(self).__name__, reason), f"{type(self).__name__} computes its loss from the "
                       f"logits (Hugging Face's forward): {reason}")
        return state.original(self, *args, **kwargs)
    return_dict = getattr(self.config, "return_dict", True)
    passed = call.pop("return_dict", return_dict)  # can_return_tuple's rule
    return_dict = return_dict if passed is None else passed
    labels = call.pop("labels")
    call.pop("logits_to_keep", None)
    outputs = getattr(self, state.prefix)(**call)
    loss = causal_lm_loss(self.lm_head, outputs.last_hidden_state, labels, num_items_in_batch=call.get(
        "num_items_in_batch"), ignore_index=call.get("ignore_index", -100), shift_labels=call.get("shift_labels"))
    fields = state.output.__dataclass_fields__
    out = state.output(loss=loss, logits=None,
                       **{f: getattr(outputs, f, None) for f in fields if f not in ("loss", "logits")})
    return out if return_dict else out.to_tuple()


def causal_lm_loss(head, hidden, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """transformers' ``ForCausalLMLoss`` on ``head(hidden)`` through the fused linear +
    cross-entropy: labels (B, L) shifted left by one (the last position ignored) unless
    ``shift_labels`` is given; the mean over the non-ignored tokens (0 / 0 = NaN when there is
    none, as ``F.cross_entropy``), or with ``num_items_in_batch`` the sum divided by it."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.to(hidden.device)
    if target.numel() == hidden.shape[:-1].numel():
        target = target.reshape(hidden.shape[:-1])
    total = linear_cross_entropy(hidden, head.weight, target, head.bias, ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


_LLAMA = _Family(_llama_check, _llama_check_call, _llama_run, _llama_tree, prepare=_llama_prepare,
                 called=lambda layer: () if layer._fused_block.fused_mlp else ("mlp",))
_FAMILIES = {name: _LLAMA for name in _LLAMA_LAYERS}
_FAMILIES["GPT2Block"] = _Family(_gpt2_check, _gpt2_check_call, _gpt2_run, _gpt2_tree)
_FAMILIES["BertLayer"] = _Family(_bert_check, _bert_check_call, _bert_run, _bert_tree)
