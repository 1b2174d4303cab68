"""What every converted layer's attention shares: the mask plan (how a Hugging Face mask reaches
the kernel), the KV cache's update, and the kernel / SDPA dispatch.

Masks: the layer reads the mask the model built for its attention implementation, in that
implementation's convention (:func:`mask_convention`): eager's and sdpa's None or 4-D bool /
additive masks, flash-attention's 2-D padding mask, or the light masks of the
``"fused_block"`` mask interface (:mod:`fused_block.hf.interface`: None, (B, Lk) causal +
padding, (B, 1, 1, Lk) padding), which are taken as they are. A 4-D mask is checked once per
mask object for being causal (bottom-right) and/or key padding; the kernel gets ``causal``
and a (B, Lk) padding mask. Anything else (sliding windows that cut keys, packed sequences,
other custom patterns, a 4-D mask under ``torch.compile`` where its values cannot be read)
runs ``scaled_dot_product_attention`` with that very mask after a one-time warning.
"""
import weakref

import torch
import torch.nn.functional as F

from fused_block import reference
from fused_block.attention import MAX_FP32_HEAD_DIM, MAX_HEAD_DIM, MIN_HEAD_DIM
from fused_block.attention import attention as _attention
from fused_block.attention import attention_qkvpacked
from fused_block.blocks import _capturing
from fused_block.hf._core import warn_once


class Plan:
    """How attention runs: the kernel (``causal``, ``key_padding`` (B, Lk) or None, the first
    ``n_keys`` keys) or SDPA with the model's own ``sdpa_mask`` / ``sdpa_causal`` and a reason."""

    __slots__ = ("kernel", "causal", "key_padding", "n_keys", "sdpa_mask", "sdpa_causal", "reason")

    def __init__(self, kernel, causal=False, key_padding=None, n_keys=None, sdpa_mask=None, sdpa_causal=False,
                 reason=None):
        self.kernel, self.causal, self.key_padding, self.n_keys = kernel, causal, key_padding, n_keys
        self.sdpa_mask, self.sdpa_causal, self.reason = sdpa_mask, sdpa_causal, reason


_LAST_MASK = [None, None]  # (weakref to the last 4-D mask read, what it was read as)


def mask_convention(config):
    """How the model's masks read: ``"flash"`` (a 2-D padding mask or None, causality from the
    module), ``"fused_block"`` (the light masks of :mod:`fused_block.hf.interface`) or
    ``"sdpa"`` (eager's and sdpa's None or 4-D masks)."""
    impl = str(getattr(config, "_attn_implementation", ""))
    return "flash" if impl.startswith("flash") else "fused_block" if impl == "fused_block" else "sdpa"


def mask_reason(mask, L, causal, convention):
    """Masks whose convention the fused path knows: None, flash-attention's and the fused_block
    interface's 2-D masks, or a 4-D (B or 1, 1, Lq, Lk) mask; (B, 1, 1, Lk) only for
    bidirectional attention or from the fused_block interface (older transformers pass causal
    layers a padding-only mask and apply causality inside)."""
    if mask is None or (mask.dim() == 2 and convention != "sdpa"):
        return None
    if mask.dim() == 4 and mask.shape[1] == 1 and (
            mask.shape[2] == L or (mask.shape[2] == 1 and (not causal or convention == "fused_block"))):
        return None
    return f"an attention mask of shape {tuple(mask.shape)} for a {'causal' if causal else 'bidirectional'} layer"


def plan(mask, B, Lq, Lk, causal, convention):
    """Read a Hugging Face attention mask. ``causal``: the module is causal; ``convention``:
    :func:`mask_convention` of the model (flash: 2-D masks, bottom-right causal when None)."""
    if convention == "fused_block":
        light = light_plan(mask, B, Lq, Lk, causal)
        if light is not None:
            return light
    if mask is None:
        if not causal or Lq == 1:
            return Plan(True, causal=False)
        if Lq == Lk or convention == "flash":
            return Plan(True, causal=True)
        if Lq < Lk:
            # SDPA's is_causal is top-left: query i sees keys j <= i, i.e. the first Lq keys bottom-right.
            return Plan(True, causal=True, n_keys=Lq)
        return Plan(False, sdpa_causal=True, reason=f"a top-left causal mask with more queries ({Lq}) than keys")
    if mask.dim() == 2:  # flash-attention's (B, seen + L) padding mask, 1 = token
        key_padding = ~mask[:, -Lk:].bool()
        # Under CUDA graph capture no value is read (a sync would invalidate the capture): the
        # kernels take the padding mask as it is, all-False or not.
        return Plan(True, causal=causal, key_padding=_padding(key_padding, B, read=not _capturing(mask)))
    if torch.compiler.is_compiling():
        return Plan(False, sdpa_mask=mask, reason="a 4-D attention mask under torch.compile (its values "
                    "cannot be read while tracing; pass attention_mask=None when there is no padding)")
    last_ref, last = _LAST_MASK
    if last_ref is not None and last_ref() is mask and last[0] == (B, Lq, Lk, causal):
        return last[1]
    if _capturing(mask):  # a mask already read above is reused during capture
        return Plan(False, sdpa_mask=mask, reason="a 4-D attention mask first seen during CUDA graph capture "
                    "(its values cannot be read without a sync; run the model once before capturing)")
    read = _read_mask(mask, B, Lq, Lk, causal)
    _LAST_MASK[:] = [weakref.ref(mask), ((B, Lq, Lk, causal), read)]
    return read


def light_plan(mask, B, Lq, Lk, causal):
    """The plan of a mask from the ``"fused_block"`` mask interface, no value read; None for a
    mask of another form (a general 4-D mask). The forms: None (SDPA's convention: ``causal``
    from the module, top-left), (B, Lk) bool: causal (bottom-right) with the keys marked False
    as padding, (B or 1, 1, 1, Lk) bool: every query sees the keys marked True."""
    if mask is None:
        return plan(None, B, Lq, Lk, causal, "sdpa")
    if mask.dtype != torch.bool:
        return None
    if mask.dim() == 2 and tuple(mask.shape) == (B, Lk):
        return Plan(True, causal=True, key_padding=~mask)
    if mask.dim() == 4 and tuple(mask.shape[1:]) == (1, 1, Lk) and mask.shape[0] in (1, B):
        return Plan(True, causal=False, key_padding=_padding(~mask[:, 0, 0], B, read=False))
    return None


def _read_mask(mask, B, Lq, Lk, causal):
    general = Plan(False, sdpa_mask=mask, reason="an attention mask that is not causal plus key padding "
                   "(a sliding window that cuts keys, packed sequences, a custom pattern)")
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
    return Plan(True, causal=causal, key_padding=_padding(key_padding, B))


def _padding(key_padding, B, read=True):
    if read and not bool(key_padding.any()):
        return None
    return key_padding.expand(B, -1) if key_padding.shape[0] != B else key_padding


def kernel_head_dim(D, dtype):
    return D % 8 == 0 and MIN_HEAD_DIM <= D <= (MAX_FP32_HEAD_DIM if dtype == torch.float32 else MAX_HEAD_DIM)


def features_reason(softcap, sliding_window, n_keys):
    """Why the attention kernel cannot run a layer's attention features now (None if it can):
    ``softcap`` (attention logits ``softcap * tanh(s / softcap)``, Gemma 2's
    ``attn_logit_softcapping``) and ``sliding_window`` (Hugging Face's convention: query i sees
    keys j with i - j < sliding_window) over ``n_keys`` keys in all (cached ones included). A
    window of at least ``n_keys`` cuts no key: plain causal attention.

    The one place that decides it, before the layer runs anything (so a fallback runs the
    whole original forward, the cache updated once). The kernel on main has neither feature
    yet; once ``fused_block.attention`` takes ``softcap=`` and ``window=(left, right)``, this
    returns None for them and :func:`self_attention` passes them on (``window=(sliding_window
    - 1, 0)``)."""
    if softcap is not None:
        return f"attention logit softcapping ({softcap}; the attention kernel has no softcap yet)"
    if sliding_window is not None and n_keys > sliding_window:
        return (f"a sliding window of {sliding_window} keys over {n_keys} (the attention kernel has no "
                "windows yet)")
    return None


def self_attention(qkv, H, Hkv, cache, layer_idx, mask, causal, convention, scale, dropout_p, name, softcap=None,
                   sliding_window=None):
    """qkv (B, L, (H + 2 Hkv) * D), the packed [q; k; v] projection -> (B, L, H * D), the
    out-projection's input. The cache (if any) stores k and v (views) and returns the keys to
    attend; when those are this call's own (L of them: nothing was cached before, as in
    training and prefill; every cache layer of transformers returns past + new keys, or its
    whole static buffer), the packed kernel reads qkv in place and writes one packed gradient.
    ``softcap`` and ``sliding_window``: the layer's attention features, which the layer has
    checked with :func:`features_reason` (a window that cuts no key is dropped here)."""
    B, L, _ = qkv.shape
    D = qkv.shape[2] // (H + 2 * Hkv)
    heads = qkv.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2)  # (B, H + 2 Hkv, L, D) view
    q, k, v = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)
    # The features reach the kernel here once it has them; until then the layer's check_call
    # kept calls that need them off this path.
    why = features_reason(softcap, sliding_window, max(k.shape[2], L))
    if why is not None:
        raise RuntimeError(f"{name}: {why} reached the fused attention (the layer's check_call must catch it)")
    p = plan(mask, B, L, k.shape[2], causal, convention)
    if p.kernel and p.n_keys is None and k.shape[2] == L and kernel_head_dim(D, qkv.dtype):
        return attention_qkvpacked(qkv, H, Hkv, p.causal, scale, p.key_padding, dropout_p)
    return attend(q, k, v, p, scale, dropout_p, name).transpose(1, 2).reshape(B, L, H * D)


def attend(q, k, v, p, scale, dropout_p, name):
    """q (B, H, Lq, D), k and v (B, Hkv, Lk, D) -> (B, H, Lq, D) as plan ``p`` says."""
    D = q.shape[-1]
    if p.kernel and not kernel_head_dim(D, q.dtype):
        p = Plan(False, sdpa_mask=_dense(p, q.shape[2], k.shape[2], q.device),
                 reason=f"head dim {D} in {q.dtype} (outside the attention kernel's range)")
    if p.kernel:
        if p.n_keys is not None:
            k, v = k[:, :, :p.n_keys], v[:, :, :p.n_keys]
        return _attention(q, k, v, p.causal, scale, p.key_padding, dropout_p)
    warn_once((name, p.reason), f"{name}: {p.reason}; attention runs through "
              "torch.nn.functional.scaled_dot_product_attention with the model's mask (slower, same result)")
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=p.sdpa_mask, dropout_p=dropout_p,
                                          is_causal=p.sdpa_causal, scale=scale)


def _dense(p, Lq, Lk, device):
    """The kernel plan as SDPA's bool mask (True = attend)."""
    n = p.n_keys or Lk
    vis = reference.visible_keys(Lq, n, p.causal, None if p.key_padding is None else p.key_padding[:, :n], device)
    return F.pad(vis, (0, Lk - n), value=False)


def is_flash(config):
    return str(getattr(config, "_attn_implementation", "")).startswith("flash")


def implementation_reason(config):
    impl = getattr(config, "_attn_implementation", None)
    if impl in (None, "eager", "sdpa", "fused_block") or is_flash(config):
        return None
    return f"attention implementation {impl!r} (its masks are not read by the fused path)"
