"""``attn_implementation="fused_block"``: the attention kernel behind transformers' own
``AttentionInterface``, for every model whose attention goes through it.

:func:`register` (run when :mod:`fused_block.hf` is imported) adds two entries named
``"fused_block"``:

- ``AttentionMaskInterface``: :func:`mask` builds the mask in the form the kernel takes,
  without reading a value: None (no padding; causality from the module, SDPA's convention),
  a (B, Lk) bool mask (causal, bottom-right, with the keys marked False as padding) or a
  (B or 1, 1, 1, Lk) bool mask (every query sees the keys marked True). That covers the
  causal and bidirectional masks transformers builds, with padding, a KV cache whose last key
  is the last query's position, sliding windows (a window that cuts keys rides on the mask
  tensor as an attribute, ``_attention.WINDOW_ATTR``) and packed batches (transformers'
  packed mask function: the sequence indices ride along, ``PACKED_ATTR``). Any other pattern
  (chunked or custom masks, static caches) gets transformers' own ``sdpa_mask``, a 4-D mask,
  which the kernel reads tile by tile (its ``mask`` / ``bias`` inputs).
  Models not declared to run all their attention through the interface (their classes do not
  set ``_supports_attention_backend`` and the family is not one verified here, ``_VERIFIED``:
  BART, Whisper, T5 and mT5 are; BLOOM is not) get ``eager_mask``, which any attention code
  reads correctly, after a one-time warning.
- ``AttentionInterface``: :func:`attention` runs ``fused_block.attention`` (GQA, key
  padding, causal bottom-right, sliding windows, ``softcap``, sinks (``s_aux``), dropout,
  ``scaling``, general masks, T5's ``position_bias`` as the kernel's ``bias`` input with its
  gradient) on what the model passes, and ``fused_block.attention_varlen`` for packed
  one-row batches (``cu_seq_lens_q/k``, a packed mask, or restarting ``position_ids``), and
  returns the (B, Lq, H, D) output as ``sdpa_attention_forward`` does. What the kernel does
  not take (a position bias in a packed batch, head dims or dtypes outside its range) runs
  transformers' ``sdpa_attention_forward`` with the equivalent mask, after a one-time warning
  naming the reason (:func:`kernel_reason`); a call that asks for the attention weights
  (``output_attentions``) runs the model's ``eager_attention_forward``, which forms them.

Nothing reads a mask value. What synchronizes: the packed lengths (the longest sequence, once
per forward: ``max_length_q/k`` when the collator passes them avoid it) and the restarting
check of a one-row batch without a mask (its ``position_ids``, once per forward), so
``torch.compile(fullgraph=True)`` traces the model; while tracing, transformers builds
sliding-window masks as a 4-D mask (their window cannot be read from the traced mask
function), which the kernel reads as a mask.

``import fused_block`` never imports transformers; importing ``fused_block.hf`` does.
"""
import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (AttentionMaskInterface, and_masks, bidirectional_mask_function,
                                        causal_mask_function, eager_mask, packed_sequence_mask_function,
                                        prepare_padding_mask, remap_positions_for_packed_sequence, sdpa_mask,
                                        sliding_window_bidirectional_overlay, sliding_window_overlay)

from fused_block.attention import _autocast, attention_varlen
from fused_block.hf._attention import (PACKED_ATTR, UNPADDED_ATTR, WINDOW_ATTR, attend, general_plan,
                                       kernel_head_dim, light_dense, light_plan, packed_lengths, restarting,
                                       unpadded, window_of)
from fused_block.hf._core import KERNEL_DTYPES, warn_once

NAME = "fused_block"
_AND_MASK = and_masks(causal_mask_function).__code__
_CAUSAL_WINDOW = sliding_window_overlay(1).__code__
_BIDIRECTIONAL_WINDOW = sliding_window_bidirectional_overlay(1).__code__
_PACKED = packed_sequence_mask_function(torch.zeros(1, 1)).__code__
_REMAP = remap_positions_for_packed_sequence(causal_mask_function, torch.zeros(1, 1)).__code__


def register():
    """Register :func:`attention` and :func:`mask` as ``"fused_block"`` with transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent). Then
    ``from_pretrained(..., attn_implementation="fused_block")`` or
    ``model.set_attn_implementation("fused_block")`` selects them."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)


# ---------------------------------------------------------------------------------------------
# the mask interface
# ---------------------------------------------------------------------------------------------

def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
         attention_mask=None, allow_is_causal_skip=True, allow_is_bidirectional_skip=False, config=None, **kwargs):
    """``AttentionMaskInterface``'s function (the arguments of ``sdpa_mask``): the light mask
    described in the module docstring, or ``sdpa_mask``'s / ``eager_mask``'s 4-D mask."""
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                allow_is_causal_skip=allow_is_causal_skip, allow_is_bidirectional_skip=allow_is_bidirectional_skip,
                config=config, **kwargs)
    if config is not None and not _uses_interface(type(config)):
        warn_once(("interface", type(config).__name__),
                  f"{type(config).__name__}: its model classes do not declare that all their attention goes "
                  "through transformers' AttentionInterface (_supports_attention_backend), so they get eager's "
                  "masks, which any attention code reads correctly: the model's own eager attention, or SDPA where "
                  "it calls the interface (the answer of attn_implementation='eager' / 'sdpa')")
        return eager_mask(**args)
    kind = _mask_kind(mask_function)
    if kind is None or not (isinstance(q_offset, int) and isinstance(kv_offset, int)):
        return sdpa_mask(**args)  # a pattern the kernel's forms do not express; static caches
    causal, window, packed = kind
    q_last, kv_end = q_offset + q_length - 1, kv_offset + kv_length
    if causal and q_last + 1 != kv_end:
        return sdpa_mask(**args)  # bottom-right alignment needs the last key at the last query
    cuts = False
    if window is not None:
        cuts = (q_last - kv_offset >= window if causal else max(q_last - kv_offset, kv_end - 1 - q_offset) > window)
        if cuts and not causal and (q_offset != kv_offset or q_length != kv_length):
            return sdpa_mask(**args)  # a bidirectional window is centred on its own query only
    if packed is not None and (attention_mask is not None or q_offset or kv_offset or q_length != kv_length):
        return sdpa_mask(**args)
    padding = None
    if attention_mask is not None:
        if attention_mask.shape[-1] == kv_length < kv_end:
            # Already this call's keys (kv_offset on), not the absolute positions a 2-D mask
            # covers: our own light mask, which generate makes ahead for a static sliding cache
            # and the forward hands back here. Read at absolute positions, it would hide every key.
            padding = attention_mask
        else:
            padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_end]
    extras = {}
    if cuts:  # causal: j > i - w (left w - 1); bidirectional: |i - j| <= w
        extras[WINDOW_ATTR] = (window - 1, 0) if causal else (window, window)
    if packed is not None:
        extras[PACKED_ATTR] = packed
    if padding is None:
        if not extras and (allow_is_causal_skip and q_length in (1, kv_length) if causal
                           else allow_is_bidirectional_skip):
            return None  # causal: top-left = bottom-right, SDPA's None
        padding = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
        extras[UNPADDED_ATTR] = True  # restarting position_ids may still pack sequences (attention reads them)
    return _with(padding if causal else padding[:, None, None, :], extras)


def _with(mask, extras):
    """The light mask with its extras (the window, a packed batch's sequence indices) as
    attributes :func:`attention` and the converted layers read (``_attention.light_plan``).
    Contiguous: ``generate`` makes the masks it prepares ahead (static caches) contiguous, and
    a copy of a strided slice (a full sliding cache's keys, ``kv_offset`` on) would lose them."""
    mask = mask.contiguous()
    for name, value in extras.items():
        setattr(mask, name, value)
    return mask


def _mask_kind(fn):
    """``(causal, window, packed)`` for the mask functions transformers builds for plain causal
    and bidirectional masks, with or without a sliding window (``sliding_window_causal_mask_function``
    and its bidirectional twin), and for a packed batch (the causal function on positions
    remapped per sequence, and-ed with the same-sequence test: ``packed`` is its (B, L)
    sequence-index tensor); None for any other (chunks, custom overlays). While torch.compile
    traces, closures cannot be read: only the two plain functions count."""
    if fn is causal_mask_function:
        return True, None, None
    if fn is bidirectional_mask_function:
        return False, None, None
    if torch.compiler.is_compiling() or getattr(fn, "__code__", None) is not _AND_MASK:
        return None
    parts = _closure(fn).get("mask_functions", ())
    if len(parts) == 2 and getattr(parts[1], "__code__", None) is _PACKED and \
            getattr(parts[0], "__code__", None) is _REMAP:
        inner = _mask_kind(_closure(parts[0]).get("mask_function"))
        packed = _closure(parts[1]).get("packed_sequence_mask")
        if inner is None or not inner[0] or inner[2] is not None or not isinstance(packed, torch.Tensor):
            return None
        return inner[0], inner[1], packed
    if len(parts) != 2 or parts[1] not in (causal_mask_function, bidirectional_mask_function):
        return None
    causal = parts[1] is causal_mask_function
    overlay = getattr(parts[0], "__code__", None)
    window = _closure(parts[0]).get("sliding_window")
    if overlay is not (_CAUSAL_WINDOW if causal else _BIDIRECTIONAL_WINDOW) or not isinstance(window, int):
        return None
    return causal, window, None


def _closure(fn):
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


_USES_INTERFACE = {}
# Families whose every attention goes through the interface although their classes do not set
# _supports_attention_backend (tests/test_hf_interface.py runs them).
_VERIFIED = ("bart", "whisper", "t5", "mt5")


@torch.compiler.assume_constant_result  # a class attribute lookup, constant while tracing
def _uses_interface(config_class):
    """Whether the models of ``config_class`` run attention through ``AttentionInterface``:
    every model class of its modeling module built from it sets ``_supports_attention_backend``
    (or the family is one of ``_VERIFIED``). A model that does not could read the light masks
    itself, as BLOOM and Falcon add their masks to the scores."""
    known = _USES_INTERFACE.get(config_class)
    if known is None:
        module = sys.modules.get(config_class.__module__.replace(".configuration_", ".modeling_"))
        models = [c for c in vars(module).values() if isinstance(c, type) and getattr(c, "config_class", None)
                  is config_class] if module is not None else []
        known = _USES_INTERFACE[config_class] = getattr(config_class, "model_type", None) in _VERIFIED or (
            bool(models) and all(getattr(c, "_supports_attention_backend", False) for c in models))
    return known


# ---------------------------------------------------------------------------------------------
# the attention interface
# ---------------------------------------------------------------------------------------------

def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
              sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """``AttentionInterface``'s function: query (B, H, Lq, D), key and value (B, Hkv, Lk, D)
    (the cache's keys when decoding), the mask from :func:`mask` -> ``(out (B, Lq, H, D), None)``.

    - The mask's window (a light mask from :func:`mask` carries the sliding window it found in
      the model's mask function when the window cuts keys; else transformers' 4-D mask holds
      it), so ``sliding_window`` is not applied again; except to a light mask that carries no
      window (causal, or a bidirectional self-attention's: ModernBERT's local layers), which
      may be a copy that lost it on its way (a device move under
      accelerate's hooks): the layer's window then applies, cutting nothing where the
      interface attached none.
    - Packed batches (one row): ``cu_seq_lens_q/k`` with ``max_length_q/k`` (what
      ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` passes), the sequence
      indices of a packed mask from :func:`mask`, or restarting ``position_ids`` run the varlen
      kernel (causal and the window within each sequence).
    - ``softcap`` and sinks (``s_aux``, (H,)) go to the kernel; a general 4-D mask (any other
      pattern: chunks, custom overlays, static caches) is read by the kernel tile by tile as
      its ``mask`` (bool) or ``bias`` (float).
    - ``is_causal`` (else ``module.is_causal``) applies when the mask is None, as in SDPA.
    - ``position_bias`` (T5's relative position bias, (1, H, Lq, Lk); T5 keeps the mask apart
      from it) is added to the scaled scores as the kernel's ``bias`` input, its gradient
      reaching ``relative_attention_bias``; the mask stays the kernel's causality / padding.
    """
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    B, _, Lq, _ = query.shape
    Lk = key.shape[2]
    # Under autocast, q, k and v in its dtype, as SDPA takes them: RoPE's fp32 cos/sin turn the
    # low-precision projections of an fp32 model into fp32 queries and keys beside bf16 values.
    query, key, value = _autocast(query, key, value)
    if _weights_asked(kwargs):  # the weights the caller asked for: eager's, which forms them
        return _fallback(module, query, key, value, attention_mask, "output_attentions=True (the kernel never "
                         "forms the attention weights)", dropout, scaling, causal, softcap, s_aux, kwargs, eager=True)
    reason = kernel_reason(query, key, value, kwargs)
    if reason is None:
        packed = packed_lengths(attention_mask, kwargs, B, Lq, Lk)
        if packed is not None and kwargs.get("position_bias") is not None:
            reason = "a position bias in a packed batch (the varlen kernel takes no bias)"
        elif packed is not None:
            return _varlen(query, key, value, attention_mask, packed, causal, dropout, scaling, softcap, s_aux)
        else:
            plan = light_plan(attention_mask, B, Lq, Lk, causal, window_of(sliding_window, causal))
            if plan is None:
                plan = general_plan(attention_mask, B, Lq, Lk)
            if not plan.kernel:
                reason = plan.reason
    if reason is not None:
        return _fallback(module, query, key, value, attention_mask, reason, dropout, scaling, causal, softcap,
                         s_aux, kwargs)
    out = attend(query, key, value, plan, scaling, float(dropout), type(module).__name__, softcap=softcap,
                 sinks=s_aux, position_bias=kwargs.get("position_bias"))
    return out.transpose(1, 2).contiguous(), None


def _weights_asked(kwargs):
    """Whether the caller asked for the attention weights: ``output_attentions`` among the
    kwargs, or transformers' active output collector recording attentions (GPT-2's model pops
    the flag before its layers; the collector records each attention module's weights)."""
    if kwargs.get("output_attentions"):
        return True
    collector = getattr(sys.modules.get("transformers.utils.output_capturing"), "_active_collector", None)
    keys = collector.get() if collector is not None else None
    return any(isinstance(k, str) and k.endswith("attentions") for k in keys or ())


def kernel_reason(query, key, value, kwargs):
    """Why the kernel cannot run this call (None if it can)."""
    D = query.shape[-1]
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return f"query, key and value in {query.dtype}, {key.dtype} and {value.dtype} (the kernel takes one dtype)"
    if query.dtype not in KERNEL_DTYPES:
        return f"dtype {query.dtype} (the kernel takes fp32, fp16 and bf16)"
    if key.shape[-1] != D or value.shape[-1] != D:
        return "keys or values with another head dim than the queries"
    if not kernel_head_dim(D, query.dtype):
        return f"head dim {D} in {query.dtype} (outside the attention kernel's range)"
    if key.shape[0] != query.shape[0] or query.shape[1] % key.shape[1] != 0:
        return "queries and keys of other batch sizes or head counts that do not divide"
    bias = kwargs.get("position_bias")
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dim() == 4):
        return "a position bias that is not a 4-D float tensor"
    return None


def _varlen(query, key, value, attention_mask, packed, causal, dropout, scaling, softcap, sinks):
    """A packed one-row batch through the varlen kernel: (1, H, T, D) -> (1, T, H, D)."""
    cu_q, cu_k, max_q, max_k = packed
    window = getattr(attention_mask, WINDOW_ATTR, (-1, -1)) if isinstance(attention_mask, torch.Tensor) else (-1, -1)
    out = attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k,
                           max_q, max_k, causal=causal, scale=scaling, dropout_p=float(dropout), window=window,
                           softcap=softcap, sinks=sinks)
    return out[None], None


def _fallback(module, query, key, value, attention_mask, reason, dropout, scaling, causal, softcap, s_aux,
              kwargs, eager=False):
    """transformers' ``sdpa_attention_forward``, or the model's ``eager_attention_forward``
    where SDPA cannot express the call (soft-capping, sinks) or ``eager`` (the attention weights
    asked for: ``output_attentions``), with the mask's meaning as 4-D."""
    eager = eager or softcap is not None or s_aux is not None
    path = "the model's eager_attention_forward" if eager else "transformers' sdpa_attention_forward"
    warn_once(("attention", type(module).__name__, reason),
              f"{type(module).__name__}: {reason}; attention runs {path} (slower, the same result)")
    B, _, Lq, _ = query.shape
    Lk = key.shape[2]
    dense = _dense(attention_mask, B, Lq, Lk, query.device)
    packed = _packed_visibility(kwargs, Lq, Lk, query.device, unpadded(attention_mask))
    if packed is not None:  # the sequences of a packed batch see only themselves
        if dense is None:
            dense = _top_left(Lq, Lk, query.device) if causal and Lq > 1 else None
        dense = packed if dense is None else _and(dense, packed)
    if not eager:
        return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout, scaling=scaling,
                                      is_causal=causal, **kwargs)
    forward = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if forward is None:
        raise NotImplementedError(f"fused_block: {type(module).__name__} passes {reason}, which neither the "
                                  "kernel nor SDPA computes, and its module has no eager_attention_forward; "
                                  "use attn_implementation='eager'")
    if dense is None and causal and Lq > 1:
        dense = _top_left(Lq, Lk, query.device)
    if dense is not None and dense.dtype == torch.bool:
        dense = torch.where(dense, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    return forward(module, query, key, value, dense, dropout=dropout, scaling=scaling, softcap=softcap,
                   s_aux=s_aux, **kwargs)


def _dense(attention_mask, B, Lq, Lk, device):
    """The mask as SDPA reads it: a light form (with its window and packing) as a (B, 1, Lq,
    Lk) bool mask, any other as it is (None: SDPA's is_causal)."""
    if attention_mask is None:
        return None
    if light_plan(attention_mask, B, Lq, Lk, True) is None:
        return attention_mask
    return light_dense(attention_mask, Lq, Lk)


def _top_left(Lq, Lk, device):
    """SDPA's ``is_causal=True``: query i sees keys j <= i."""
    return torch.ones(Lq, Lk, dtype=torch.bool, device=device).tril()[None, None]


def _packed_visibility(kwargs, Lq, Lk, device, from_positions):
    """(B or 1, 1, Lq, Lk) bool: the queries and keys of the same sequence of a packed batch
    (``cu_seq_lens_q/k``, the cumulative lengths, or else, with ``from_positions``, restarting
    ``position_ids``), or None; computed on the device."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        positions = kwargs.get("position_ids")
        if not (from_positions and restarting(positions, Lq, Lk)):
            return None
        step = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)
        seq = (step != 1).cumsum(-1).to(device)  # transformers' find_packed_sequence_indices
        return (seq[:, :, None] == seq[:, None, :])[:, None]
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    seq_q = torch.searchsorted(cu_q[1:].to(device), torch.arange(Lq, device=device), right=True)
    seq_k = torch.searchsorted(cu_k[1:].to(device), torch.arange(Lk, device=device), right=True)
    return (seq_q[:, None] == seq_k[None, :])[None, None]


def _and(mask, visible):
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, torch.finfo(mask.dtype).min)
