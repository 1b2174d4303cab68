"""What every converted layer's attention shares: the mask plan (how a Hugging Face mask reaches
the kernel), the KV cache's update, and the kernel / SDPA dispatch.

Masks: the layer reads the mask the model built for its attention implementation, in that
implementation's convention (:func:`mask_convention`): eager's and sdpa's None or 4-D bool /
additive masks, flash-attention's 2-D padding mask, or the light masks of the
``"fused_block"`` mask interface (:mod:`fused_block.hf.interface`: None, (B, Lk) causal +
padding, (B, 1, 1, Lk) padding), which are taken as they are. A 4-D mask is checked once per
mask object for being causal (bottom-right) and/or key padding, with the layer's sliding
window; the kernel gets ``causal``, a (B, Lk) padding mask and the window. Anything else
(packed sequences, other custom patterns, a 4-D mask under ``torch.compile`` where its values
cannot be read) the kernel reads tile by tile (its ``mask`` / ``bias``); a mask of a shape it
does not broadcast runs ``scaled_dot_product_attention`` with that very mask after a one-time
warning. Query rows that an additive mask hides every key from (eager's left padding) get the
original's output there, the mean of V (:func:`dead_rows`), not the kernel's 0.
"""
import weakref

import torch
import torch.nn.functional as F

from fused_block import reference
from fused_block.attention import MAX_FP32_HEAD_DIM, MAX_HEAD_DIM, MIN_HEAD_DIM
from fused_block.attention import attention as _attention
from fused_block.attention import attention_qkvpacked, attention_varlen_qkvpacked
from fused_block.blocks import _capturing
from fused_block.hf._core import warn_once


_UNREAD = "unread"  # a general bool mask's rows of no visible key: found where a position bias needs them


class Plan:
    """How attention runs: the kernel (``causal``, ``key_padding`` (B, Lk) or None, the first
    ``n_keys`` keys, a ``window`` (left, right), or a general 4-D ``mask`` (bool) / ``bias``
    (additive float) read tile by tile) or SDPA with the model's own ``sdpa_mask`` /
    ``sdpa_causal`` and a reason; ``dead``: the query rows an additive mask hides every key
    from, whose output the original's softmax makes the mean of V (:func:`dead_rows`);
    ``empty``: a bool mask's rows with no visible key (:func:`dead_rows`)."""

    __slots__ = ("kernel", "causal", "key_padding", "n_keys", "window", "mask", "bias", "sdpa_mask", "sdpa_causal",
                 "reason", "dead", "empty")

    def __init__(self, kernel, causal=False, key_padding=None, n_keys=None, window=(-1, -1), mask=None, bias=None,
                 sdpa_mask=None, sdpa_causal=False, reason=None, dead=None, empty=None):
        self.kernel, self.causal, self.key_padding, self.n_keys = kernel, causal, key_padding, n_keys
        self.window, self.mask, self.bias = window, mask, bias
        self.sdpa_mask, self.sdpa_causal, self.reason = sdpa_mask, sdpa_causal, reason
        # (B or 1, 1 or H, Lq) bool or None: an additive mask's dead rows (:func:`dead_rows`), a bool
        # mask's rows with no visible key, which only a position bias merged into it as SDPA's
        # float mask makes dead (transformers' sdpa path for T5).
        self.dead, self.empty = dead, empty

    def rows_of_mean(self, biased):
        """The query rows whose output is the mean of V in the original, or None: an additive
        mask's dead rows, and with a position bias (``biased``: SDPA's float mask, where transformers
        merges the bias with ``finfo.min`` for hidden keys) a bool mask's rows of no visible key."""
        if self.dead is not None or not biased:
            return self.dead
        return dead_rows(self.mask) if self.empty is _UNREAD else self.empty

    @property
    def light(self):
        """No general mask: the packed kernel and the varlen kernel can run it."""
        return self.mask is None and self.bias is None


# The 4-D masks read lately: (weakref to the mask, (B, Lq, Lk, causal, window, mask version),
# what it was read as), newest last. A model builds a mask per attention kind per forward (Gemma
# 2/3 and gpt-oss alternate a sliding and a full one layer by layer): each is read once.
_READ_MASKS = []
_READ_MASKS_KEPT = 8


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


def window_of(sliding_window, causal):
    """Hugging Face's ``sliding_window`` (query i sees keys i - j < sliding_window) as the
    kernel's ``window=(left, right)`` for flash-attention's 2-D masks (transformers' flash path
    passes ``(w - 1, w - 1)``, causality cutting the right side)."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def plan(mask, B, Lq, Lk, causal, convention, window=(-1, -1)):
    """Read a Hugging Face attention mask. ``causal``: the module is causal; ``convention``:
    :func:`mask_convention` of the model (flash: 2-D masks, bottom-right causal when None);
    ``window``: the layer's sliding window as the kernel's ``(left, right)``, which
    flash-attention's 2-D masks leave to the attention and eager's / sdpa's 4-D masks hold (a
    4-D mask that is causal + padding + this window runs the kernel's window; any other runs
    the kernel with the mask itself)."""
    if convention == "fused_block":
        light = light_plan(mask, B, Lq, Lk, causal, window if causal else (-1, -1))
        if light is not None:
            return light
    if mask is None:
        # sdpa's None: no window cuts a key (transformers materializes the mask otherwise).
        if not causal or Lq == 1:
            return Plan(True, causal=False, window=window if convention == "flash" else (-1, -1))
        if Lq == Lk or convention == "flash":
            return Plan(True, causal=True, window=window if convention == "flash" else (-1, -1))
        if Lq < Lk:
            # SDPA's is_causal is top-left: query i sees keys j <= i, i.e. the first Lq keys bottom-right.
            return Plan(True, causal=True, n_keys=Lq)
        return Plan(False, sdpa_causal=True, reason=f"a top-left causal mask with more queries ({Lq}) than keys")
    if mask.dim() == 2:  # flash-attention's (B, seen + L) padding mask, 1 = token
        key_padding = ~mask[:, -Lk:].bool()
        # Under CUDA graph capture no value is read (a sync would invalidate the capture): the
        # kernels take the padding mask as it is, all-False or not.
        return Plan(True, causal=causal, key_padding=_padding(key_padding, B, read=not _unreadable(mask)),
                    window=window)
    if torch.compiler.is_compiling() or _unreadable(mask):
        return general_plan(mask, B, Lq, Lk)  # no value read: the kernel reads the mask itself
    if mask.is_inference():  # no version counter to tell an in-place change: read every time
        return _read_mask(mask, B, Lq, Lk, causal, window)
    key = (B, Lq, Lk, causal, window, mask._version)
    for ref, seen, read in _READ_MASKS:
        if ref() is mask and seen == key:
            return read
    read = _read_mask(mask, B, Lq, Lk, causal, window)
    _READ_MASKS[:] = [e for e in _READ_MASKS[1 - _READ_MASKS_KEPT:] if e[0]() is not None]
    _READ_MASKS.append((weakref.ref(mask), key, read))
    return read


def _unreadable(t):
    """Whether ``t``'s values must not decide here: during CUDA graph capture (a sync would
    invalidate it) or while ``torch.jit.trace`` records (the decision would be baked into the
    trace, wrong for every other mask passed to it)."""
    return _capturing(t) or torch._C._get_tracing_state() is not None


def general_plan(mask, B, Lq, Lk, dead=None, read=False):
    """A 4-D (B or 1, 1 or H, Lq, Lk) mask for the kernel as it is: bool (True = attend) as its
    ``mask``, float as its additive ``bias``, with its rows of no visible key (:func:`dead_rows`:
    ``dead`` when ``read``, already read and None where there are none); SDPA for a shape it
    does not broadcast."""
    if mask.dim() == 4 and mask.shape[0] in (1, B) and tuple(mask.shape[2:]) == (Lq, Lk):
        if mask.dtype == torch.bool:
            return Plan(True, mask=mask, empty=dead if read else _UNREAD)
        if mask.is_floating_point():
            return Plan(True, bias=mask, dead=dead if read else dead_rows(mask))
    return Plan(False, sdpa_mask=mask, reason=f"an attention mask of shape {tuple(mask.shape)} and dtype "
                f"{mask.dtype} for {Lq} queries and {Lk} keys")


def light_plan(mask, B, Lq, Lk, causal, window=(-1, -1)):
    """The plan of a mask from the ``"fused_block"`` mask interface, no value read; None for a
    mask of another form (a general 4-D mask). The forms: None (SDPA's convention: ``causal``
    from the module, top-left), (B, Lk) bool: causal (bottom-right) with the keys marked False
    as padding, (B or 1, 1, 1, Lk) bool: every query sees the keys marked True; either with
    the sliding window the interface found in the model's mask function
    (:func:`fused_block.hf.interface.window_of_mask`).

    ``window``: the layer's own window (:func:`window_of` of its ``sliding_window``,
    flash-attention's reading), taken by a (B, Lk) mask that carries none, or by a (B or 1, 1,
    1, Lk) one of a bidirectional layer's self-attention (ModernBERT's local layers): the
    interface attaches the window whenever it cuts a key, and a mask copied on its way to the
    layer (moved to another device by accelerate's hooks, made contiguous) has lost its
    attributes. Where the window cuts no key, taking it changes nothing."""
    if mask is None:
        return plan(None, B, Lq, Lk, causal, "sdpa")
    if mask.dtype != torch.bool:
        return None
    layer_window = window
    window = getattr(mask, WINDOW_ATTR, None)
    if window is None:
        window = layer_window if mask.dim() == 2 or (not causal and Lq == Lk) else (-1, -1)
    packed = getattr(mask, PACKED_ATTR, None) is not None
    unpadded = getattr(mask, UNPADDED_ATTR, False)  # ones, made to carry the window: no padding to read
    if mask.dim() == 2 and tuple(mask.shape) == (B, Lk):
        if packed:  # (the interface runs these through the varlen kernel itself)
            return Plan(True, mask=light_dense(mask, Lq, Lk))
        return Plan(True, causal=True, key_padding=None if unpadded else ~mask, window=window)
    if mask.dim() == 4 and tuple(mask.shape[1:]) == (1, 1, Lk) and mask.shape[0] in (1, B) and not packed:
        return Plan(True, causal=False, key_padding=None if unpadded else _padding(~mask[:, 0, 0], B, read=False),
                    window=window)
    return None


def light_dense(mask, Lq, Lk):
    """A light mask (``(B, Lk)`` causal + padding or ``(B, 1, 1, Lk)``, with its window and
    packed sequences) as the (B, 1, Lq, Lk) bool mask (True = attend) it stands for; built on
    the device, no value read."""
    i = torch.arange(Lq, device=mask.device)[:, None] + (Lk - Lq)
    j = torch.arange(Lk, device=mask.device)[None, :]
    dense = ((j <= i) & mask[:, None, None, :]) if mask.dim() == 2 else mask.expand(-1, -1, Lq, -1)
    window = getattr(mask, WINDOW_ATTR, None)
    if window is not None:
        left, right = window
        dense = dense & (j >= i - left) if left >= 0 else dense
        dense = dense & (j <= i + right) if right >= 0 else dense
    ids = getattr(mask, PACKED_ATTR, None)
    if ids is not None:  # (B, L) sequence indices, queries and keys alike (no cache)
        dense = dense & (ids[:, None, :, None] == ids[:, None, None, :])
    return dense


# The light masks' extras (set by fused_block.hf.interface.mask on the mask tensor it returns):
# the sliding window (left, right), a packed batch's sequence indices (B, L), and whether the
# mask holds no padding (made of ones: the model got no attention_mask).
WINDOW_ATTR, PACKED_ATTR, UNPADDED_ATTR = "_fused_block_window", "_fused_block_packed", "_fused_block_unpadded"


def _read_mask(mask, B, Lq, Lk, causal, window):
    """Whether a 4-D mask is causal (bottom-right, as the layer) and/or key padding, with the
    layer's window or none: the kernel's flags, else :func:`general_plan`; and, for an additive
    mask, whether it has :func:`dead_rows`. Every test runs on the device and one
    synchronization reads them all."""
    if mask.shape[-1] != Lk or mask.shape[0] not in (1, B) or mask.shape[1] != 1:
        return general_plan(mask, B, Lq, Lk)
    dead = dead_rows(mask)
    if mask.dtype == torch.bool:
        keep, valid = mask, mask.new_ones((), dtype=torch.bool)
    else:
        keep = mask == 0
        valid = (keep | (mask <= torch.finfo(mask.dtype).min / 2)).all()  # only 0 and "minus infinity"
    # The keys no query sees: the padding (and, under a sliding window, keys before every
    # query's window, which the window hides anyway); the comparisons below decide.
    key_padding = ~keep[:, 0].any(dim=-2)
    windows = [window] if window == (-1, -1) else [window, (-1, -1)]  # the layer's, or the mask holds none
    matches = [(reference.visible_keys(Lq, Lk, causal, key_padding, mask.device, window=w) == keep).all()
               for w in windows]
    bits = torch.stack([valid, key_padding.any(), dead.any(), *matches]).to(torch.int32)
    code = int((bits << torch.arange(len(bits), device=bits.device, dtype=torch.int32)).sum().item())
    valid, padded, has_dead, *matches = (code >> i & 1 for i in range(len(bits)))
    dead = dead if has_dead else None
    matched = [w for w, ok in zip(windows, matches) if ok]
    if not valid or not matched:
        return general_plan(mask, B, Lq, Lk, dead=dead, read=True)
    rows = dict(empty=dead) if mask.dtype == torch.bool else dict(dead=dead)
    return Plan(True, causal=causal, key_padding=_padding(key_padding, B, read=False) if padded else None,
                window=matched[0], **rows)


def dead_rows(mask):
    """The query rows of an additive 4-D mask (B or 1, 1 or H, Lq, Lk) that hide every key with
    the mask dtype's ``finfo.min`` (Hugging Face's eager masks), or of a bool mask that show
    none: (B or 1, 1 or H, Lq) bool.

    There the original's softmax sees ``score + finfo.min``, which rounds to ``finfo.min`` for
    every key (its ulp, ~2e31 in fp32 and bf16, swamps any score): equal logits, so the row's
    output is the mean of V over all keys, where the kernel, which takes such a bias as
    -inf, gives 0 (a row with no visible key). :func:`average_dead` sets those rows to the
    original's value. Left-padded positions of a causal model under eager attention, and
    every query of an all-zero ``attention_mask`` row, are such rows. (Transformers' sdpa
    masks unmask them instead, so they are rows of visible keys there, except where transformers
    merges T5's position bias into a float mask with ``finfo.min`` for the hidden keys: the
    plan's ``empty`` rows, averaged when a position bias is given.)"""
    if mask.dtype == torch.bool:
        return ~mask.any(-1)
    return (mask == torch.finfo(mask.dtype).min).all(-1)


def average_dead(out, v, dead, dropout_p, packed=False):
    """``out`` (B, H, Lq, D), or (B, Lq, H * D) when ``packed``, with the rows ``dead`` (a plan's
    :func:`dead_rows`) set to the mean of ``v`` (B, Hkv, Lk, D) over its keys (its head group's
    under GQA): the original's output there, summed in fp32 and rounded once. The gradient is
    that mean's (dV gets each such row's dO / Lk; the kernel's rows get none). Not eager's own
    autograd, which differentiates ``score + finfo.min`` as if the score were not absorbed and
    so also passes those rows' gradients to q and k (to the bias and softcap with them): terms
    of a function whose value does not depend on them. No attention dropout on these rows at
    ``dropout_p`` < 1 (the original drops some of the uniform weights; the same expectation);
    at ``dropout_p`` = 1 the original drops them all: ``out`` (the attention's zeros) as it is."""
    if dropout_p >= 1.0:
        return out
    B, Hkv, Lk, D = v.shape
    mean = (v.sum(2, dtype=torch.float32) / Lk).to(v.dtype)  # (B, Hkv, D)
    if packed:
        H = out.shape[-1] // D
        if H != Hkv:
            mean = mean.repeat_interleave(H // Hkv, dim=1)
        rows = dead.transpose(1, 2)[..., None]  # (B or 1, Lq, 1 or H, 1)
        return torch.where(rows, mean[:, None], out.view(*out.shape[:2], H, D)).view(out.shape)
    H = out.shape[1]
    if H != Hkv:
        mean = mean.repeat_interleave(H // Hkv, dim=1)
    return torch.where(dead[..., None], mean[:, :, None], out)


def _padding(key_padding, B, read=True):
    if read and not bool(key_padding.any()):
        return None
    return key_padding.expand(B, -1) if key_padding.shape[0] != B else key_padding


def unpadded(attention_mask):
    """No mask, or a light mask of ones (:func:`mask` without the model's attention_mask, made
    to carry a sliding window): the model got no padding, so restarting ``position_ids`` say
    whether the row packs sequences."""
    return attention_mask is None or getattr(attention_mask, UNPADDED_ATTR, False)


def packed_lengths(attention_mask, kwargs, B, Lq, Lk):
    """``(cu_seqlens_q, cu_seqlens_k, max_q, max_k)`` of a packed one-row batch, or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        cu_q = cu_k if cu_q is None else cu_q
        cu_k = cu_q if cu_k is None else cu_k
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = max_k if max_q is None else max_q
        max_k = max_q if max_k is None else max_k
        if max_q is None:  # read once per tensor (one sync per forward)
            max_q = max_k = _max_length(cu_q)
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    if B != 1 or Lq != Lk:
        return None
    ids = getattr(attention_mask, PACKED_ATTR, None) if isinstance(attention_mask, torch.Tensor) else None
    if ids is None and unpadded(attention_mask) and restarting(kwargs.get("position_ids"), Lq, Lk):
        return _cached(_LAST_POSITION_LENGTHS, kwargs["position_ids"], _position_lengths)
    if ids is None:
        return None
    return _cached(_LAST_IDS, ids, _read_lengths)


# (weakref to the last tensor read, (its version, its lengths)): a packed mask's sequence-index
# tensor, and restarting position_ids (whose sequence indices are a new tensor in every layer:
# the cache is on the position_ids, which every layer of a forward gets).
_LAST_IDS = [None, None]
_LAST_POSITION_LENGTHS = [None, None]


def _cached(cache, t, read):
    """``read(t)``, once per tensor and version (every layer of a forward gets the same one: one
    sync per forward); tensors made under inference mode, which have no version counter to tell
    an in-place change, are read every time."""
    ref, last = cache
    inference = t.is_inference()
    if not inference and ref is not None and ref() is t and last[0] == t._version:
        return last[1]
    found = read(t)
    if not inference:
        cache[:] = [weakref.ref(t), (t._version, found)]
    return found


def _position_lengths(positions):
    step = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)
    return _read_lengths((step != 1).cumsum(-1))  # transformers' find_packed_sequence_indices


def _read_lengths(ids):
    """cu_seqlens (int32) and the longest length of a (1, L) sequence-index tensor (a host read)."""
    lengths = torch.bincount(ids[0].to(torch.int64))
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    return cu, cu, longest, longest


def _max_length(cu):
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


_LAST_POSITIONS = [None, None]  # (weakref to the last position_ids read, (version, restarting))


def restarting(position_ids, Lq, Lk):
    """Whether the (1, L) ``position_ids`` of a one-row call without cached keys restart (a
    packed batch, as DataCollatorWithFlattening makes; transformers' own test: a step other
    than 1), read once per tensor: one sync per forward, for one-row batches only, as
    flash-attention's packed check. Not read while torch.compile traces or a CUDA graph
    captures (then only cu_seq_lens_q/k or a packed mask from transformers say so)."""
    if not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != (1, Lq) or Lq != Lk or Lq < 2 \
            or torch.compiler.is_compiling() or _unreadable(position_ids):
        return False
    if position_ids.is_inference():  # no version counter (made under torch.inference_mode): read every time
        return bool((position_ids.diff(dim=-1) != 1).any())
    ref, last = _LAST_POSITIONS
    if ref is not None and ref() is position_ids and last[0] == position_ids._version:
        return last[1]
    found = bool((position_ids.diff(dim=-1) != 1).any())
    _LAST_POSITIONS[:] = [weakref.ref(position_ids), (position_ids._version, found)]
    return found


def kernel_head_dim(D, dtype):
    return D % 8 == 0 and MIN_HEAD_DIM <= D <= (MAX_FP32_HEAD_DIM if dtype == torch.float32 else MAX_HEAD_DIM)


def self_attention(qkv, H, Hkv, cache, layer_idx, mask, causal, convention, scale, dropout_p, name, softcap=None,
                   sliding_window=None, sinks=None, position_bias=None, packing=None, merged=False):
    """qkv (B, L, (H + 2 Hkv) * D), the packed [q; k; v] projection -> (B, L, H * D), the
    out-projection's input. The cache (if any) stores k and v (views) and returns the keys to
    attend; when those are this call's own (L of them: nothing was cached before, as in
    training and prefill; every cache layer of transformers returns past + new keys, or its
    whole static buffer), the packed kernel reads qkv in place and writes one packed gradient.
    ``softcap`` (Gemma 2's ``attn_logit_softcapping``), ``sliding_window`` (Hugging Face's
    convention, :func:`window_of`) and ``sinks`` (gpt-oss's, (H,)) go to the kernel.
    ``position_bias``: an additive bias broadcastable to (B, H, L, Lk) (T5's relative position
    bias), or a function of Lk, the number of keys after the cache's update, returning it; it
    goes to the kernel's ``bias`` input with its gradient (:func:`attend`). ``packing``: the
    layer's call (its ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``position_ids``): under the
    conventions whose attention reads packed batches from them (flash-attention's and the
    ``"fused_block"`` interface's; transformers gives eager and sdpa a mask that holds the
    packing), a one-row batch of packed sequences runs the varlen kernel, each sequence
    attending only to itself, as the original's attention does. ``merged``: as :func:`attend`'s."""
    B, L, _ = qkv.shape
    D = qkv.shape[2] // (H + 2 * Hkv)
    heads = qkv.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2)  # (B, H + 2 Hkv, L, D) view
    q, k, v = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)
    if callable(position_bias):
        position_bias = position_bias(k.shape[2])
    p = plan(mask, B, L, k.shape[2], causal, convention, window_of(sliding_window, causal))
    if packing is not None and convention != "sdpa" and B == 1 and k.shape[2] == L and p.kernel and p.light \
            and p.key_padding is None and p.n_keys is None:
        found = packed_lengths(mask, packing, B, L, L)
        if found is not None:
            cu, _, longest, _ = found
            if position_bias is None and kernel_head_dim(D, qkv.dtype):
                out = attention_varlen_qkvpacked(qkv[0], cu, longest, H, Hkv, causal=p.causal, scale=scale,
                                                 dropout_p=dropout_p, window=p.window, softcap=softcap, sinks=sinks)
                return out[None]
            # What the varlen kernel does not take: the sequences' block-diagonal mask, dense.
            seq = torch.searchsorted(cu[1:], torch.arange(L, device=qkv.device, dtype=cu.dtype), right=True)
            same = (seq[:, None] == seq[None, :])[None, None]
            p = Plan(True, mask=reference.visible_keys(L, L, p.causal, None, qkv.device, window=p.window) & same)
    if p.kernel and p.light and p.n_keys is None and k.shape[2] == L and softcap is None and position_bias is None \
            and kernel_head_dim(D, qkv.dtype):
        out = attention_qkvpacked(qkv, H, Hkv, p.causal, scale, p.key_padding, dropout_p, window=p.window,
                                  sinks=sinks)
        rows = p.rows_of_mean(merged)
        return out if rows is None or sinks is not None else average_dead(out, v, rows, dropout_p, packed=True)
    out = attend(q, k, v, p, scale, dropout_p, name, softcap, sinks, position_bias, merged)
    return out.transpose(1, 2).reshape(B, L, H * D)


def cross_keys(cache, layer_idx, project):
    """The keys and values (B, H, Lk, D) of a cross-attention: from the cross-attention half of
    an ``EncoderDecoderCache`` once it holds this layer's (every decoding step after the
    first), else ``project()`` (the encoder's output through the k and v projections), kept in
    that cache as transformers' attention keeps them."""
    cross = getattr(cache, "cross_attention_cache", None)
    if cross is not None and cache.is_updated.get(layer_idx):
        return cross.layers[layer_idx].keys, cross.layers[layer_idx].values
    k, v = project()
    if cross is not None:
        k, v = cross.update(k, v, layer_idx)
        cache.is_updated[layer_idx] = True
    return k, v


def kv_heads(kv, H):
    """The packed [k; v] projection (B, Lk, 2 H D) of a cross-attention as (k, v) views
    (B, H, Lk, D)."""
    kv = kv.unflatten(-1, (2 * H, kv.shape[-1] // (2 * H))).transpose(1, 2)
    return kv[:, :H], kv[:, H:]


def attend(q, k, v, p, scale, dropout_p, name, softcap=None, sinks=None, position_bias=None, merged=False):
    """q (B, H, Lq, D), k and v (B, Hkv, Lk, D) -> (B, H, Lq, D) as plan ``p`` says, with
    ``position_bias`` (an additive float bias broadcastable to (B, H, Lq, Lk), T5's relative
    position bias, BLOOM's ALiBi; its gradient flows) added to the scaled scores: the kernel's ``bias``
    input beside its causal / padding / mask, or the bias inside SDPA's float mask. ``merged``:
    the original merges a bool mask into its position bias (zeros included) as SDPA's float mask,
    ``finfo.min`` at hidden keys (transformers' sdpa path for T5), so that its rows of no visible
    key average V (:meth:`Plan.rows_of_mean`)."""
    D = q.shape[-1]
    if p.kernel and not kernel_head_dim(D, q.dtype):
        dense = _dense(p, q.shape[2], k.shape[2], q.device)
        p = Plan(False, sdpa_mask=dense, reason=f"head dim {D} in {q.dtype} (outside the attention kernel's range)",
                 dead=p.dead if dense.dtype == torch.bool else None)  # SDPA averages a float mask's itself
    if p.kernel:
        if p.n_keys is not None:
            k, v = k[:, :, :p.n_keys], v[:, :, :p.n_keys]
            position_bias = None if position_bias is None else position_bias[..., :p.n_keys]
        bias = p.bias if position_bias is None else position_bias if p.bias is None else p.bias + position_bias
        out = _attention(q, k, v, p.causal, scale, p.key_padding, dropout_p, window=p.window, softcap=softcap,
                         sinks=sinks, mask=p.mask, bias=bias)
        # Sinks: the original's softmax gives such a row's weight to the sink, an output of 0, as the kernel.
        rows = p.rows_of_mean(merged or position_bias is not None)
        return out if rows is None or sinks is not None else average_dead(out, v, rows, dropout_p)
    if softcap is not None or sinks is not None:
        raise NotImplementedError(f"{name}: {p.reason}, with a softcap or sinks, which SDPA does not compute")
    warn_once((name, p.reason), f"{name}: {p.reason}; attention runs through "
              "torch.nn.functional.scaled_dot_product_attention with the model's mask (slower, same result)")
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    mask, causal = p.sdpa_mask, p.sdpa_causal
    if position_bias is not None:  # one float mask: the bias where the mask lets a key through
        if causal:
            mask, causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(), False
        bias = position_bias.to(q.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, torch.finfo(q.dtype).min)
        else:
            mask = (mask + bias).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale)
    # A float mask's dead rows SDPA averages itself; those of a kernel plan made a bool mask, not.
    return out if p.dead is None or mask.dtype != torch.bool else average_dead(out, v, p.dead, dropout_p)


def _dense(p, Lq, Lk, device):
    """The kernel plan as SDPA's bool mask (True = attend)."""
    if p.mask is not None or p.bias is not None:
        return p.mask if p.mask is not None else p.bias
    n = p.n_keys or Lk
    vis = reference.visible_keys(Lq, n, p.causal, None if p.key_padding is None else p.key_padding[:, :n], device,
                                 window=p.window)
    return F.pad(vis, (0, Lk - n), value=False)


def is_flash(config):
    return str(getattr(config, "_attn_implementation", "")).startswith("flash")


def implementation_reason(config):
    impl = getattr(config, "_attn_implementation", None)
    if impl in (None, "eager", "sdpa", "fused_block") or is_flash(config):
        return None
    return f"attention implementation {impl!r} (its masks are not read by the fused path)"
