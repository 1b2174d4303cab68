"""PEFT LoRA on the linears a fused layer reads, run in the fused path.

PEFT wraps a target ``nn.Linear`` (or transformers' ``Conv1D``) in ``peft.tuners.lora.Linear``:
``base_layer(x) + sum over active adapters of scale * lora_B(lora_A(dropout(x)))``. A fused
layer reads the wrapper's parts instead:

- ``lora_dropout[a]`` and ``lora_A[a]`` are *called* on the layer's input (their hooks fire,
  PEFT's dropout draws from torch's generator in PEFT's order), giving ``u_a = scale *
  lora_A(dropout(x))`` (N x r, small);
- ``lora_B[a].weight`` (out x r) and the base weight go into **one** GEMM: the low-rank update
  ``U @ B^T`` joins the base product's K reduction (``fused_block.linear(..., lora=(U, B))``),
  before the bias, activation, dropout and residual of the epilogue. Several adapters, or
  the q/k/v projections of one QKV GEMM, stack their columns of ``U`` and rows of ``B``.

Gradients of A, B and the input flow through autograd (``dU`` and ``dB`` from the GEMM's
backward); the base weight's only when it requires one. What this does not reproduce takes the
layer's original forward (PEFT's), with a one-time warning: LoRA variants (DoRA, aLoRA, ...),
adapters disabled while merged, mixed-adapter batches (``adapter_names=``: PEFT installs
hooks, which the guard sees), ``lora_bias``.

This module never imports peft: a wrapper is recognised by its class.
"""
import weakref

import torch
from torch import nn

_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")


def is_lora(m) -> bool:
    cls = type(m)
    return (cls.__module__, cls.__qualname__) == _LORA_LINEAR


def merged_state(linears):
    """What PEFT changes about the weights of ``linears`` without a version bump (a merge adds
    its update through ``weight.data``, an unmerge subtracts it): ``(key, held)`` for caches of
    those weights (``fused_block.hf._core.cached``'s ``stamp`` and ``held``). ``key`` has None
    for a plain linear, and for a LoRA wrapper, per merged adapter, its name, its scale and each
    of its parameters' storage (the storage object's address), data pointer and version counter
    (lora_A, lora_B, DoRA's magnitude, ...: what the merged update was made of); ``held`` lists
    those parameters, whose storages a cache entry made with ``key`` holds weakly, so that no
    other storage takes their addresses while the entry lives.

    The names alone do not change when an adapter is unmerged, updated in place (an optimizer
    step bumps its parameters' versions) or rescaled, and merged again: the packed weight a
    forward cached before then stayed in use (stale by the update). Neither does a parameter's
    identity, address and version when it is given a new tensor where its freed one was
    (``param.data = ...`` keeps the parameter and its version counter): the storage object does."""
    held = []
    return tuple(_merged(m, held) if is_lora(m) else None for m in linears), held


def _merged(m, held):
    state = []
    for a in m.merged_adapters:
        params = []
        for name in m.adapter_layer_names:
            holder = m._modules.get(name)
            if holder is None or a not in holder:
                continue
            entry = holder[a]
            for t in (entry.parameters() if isinstance(entry, nn.Module) else (entry,)):
                # an inference tensor has no version counter: a key that never matches
                params.append((t.untyped_storage()._cdata, t.data_ptr(),
                               object() if t.is_inference() else t._version))
                held.append(t)
        state.append((a, m.scaling.get(a), tuple(params)))
    return tuple(state)


def base(m):
    """The module whose weight a fused path reads: the wrapped base layer, or ``m`` itself."""
    return m.base_layer if is_lora(m) else m


def spec(path, m, base_classes):
    """The guard's spec entries (:func:`fused_block._guard.scan`) for the linear at ``path``:
    ``{path: base_classes}`` for a plain one; for a LoRA wrapper, the wrapper, its base layer
    (``base_classes``), the adapter containers and each ``lora_B[a]`` (an ``nn.Linear`` read,
    not called), and the paths of the modules the fused path calls (``lora_A[a]``,
    ``lora_dropout[a]``) to skip."""
    if not is_lora(m):
        return {path: base_classes}, ()
    entries = {path: (type(m),), f"{path}.base_layer": base_classes}
    for name in ("lora_A", "lora_B", "lora_dropout", "lora_magnitude_vector"):
        entries[f"{path}.{name}"] = (nn.ModuleDict,)
    for name in ("lora_embedding_A", "lora_embedding_B"):
        entries[f"{path}.{name}"] = (nn.ParameterDict,)
    for a in m.lora_B:
        entries[f"{path}.lora_B.{a}"] = (nn.Linear,)
    return entries, (f"{path}.lora_A", f"{path}.lora_dropout")


def reason(path, m):
    """Why the adapters of LoRA wrapper ``m`` cannot join the fused GEMM now (None if they can).
    Checked per call: PEFT changes active adapters, scales and the merged state by assignment."""
    if m.disable_adapters and m.merged:
        return f"{path}: adapters disabled while merged into the weight (PEFT unmerges them in its forward)"
    if m.disable_adapters or m.merged:
        return None
    for a in m.active_adapters:
        if a not in m.lora_A:
            continue
        if a in m.lora_variant:
            return f"{path}: LoRA variant {type(m.lora_variant[a]).__name__} of adapter {a!r} (DoRA, aLoRA, ...)"
        if m.lora_B[a].bias is not None:
            return f"{path}: lora_bias on adapter {a!r}"
        if type(m.lora_A[a]) is not nn.Linear or m.lora_A[a].bias is not None:
            return f"{path}: lora_A[{a!r}] is not a bias-free nn.Linear"
        if type(m.lora_dropout[a]) not in (nn.Dropout, nn.Identity):
            return f"{path}: lora_dropout[{a!r}] is a {type(m.lora_dropout[a]).__name__}"
    return None


def terms(m, x):
    """``(U, B)`` of LoRA wrapper ``m`` on input ``x`` (..., K): ``U`` (..., R) = the active
    adapters' ``scale * lora_A(dropout(x))`` side by side (x cast to the adapters' dtype as PEFT
    does, U then to x's), ``B`` (out, R) their ``lora_B`` weights; None when no adapter is
    active (disabled, merged or none)."""
    if not is_lora(m) or m.disable_adapters or m.merged:
        return None
    us, bs = [], []
    for a in m.active_adapters:
        if a not in m.lora_A:
            continue
        A, Bm = m.lora_A[a], m.lora_B[a]
        xa = x.to(A.weight.dtype) if m.cast_input_dtype_enabled else x
        us.append((A(m.lora_dropout[a](xa)) * m.scaling[a]).to(x.dtype))
        bs.append(Bm.weight.to(x.dtype))
    if not us:
        return None
    if len(us) == 1:
        return us[0], bs[0]
    return torch.cat(us, dim=-1), torch.cat(bs, dim=1)


def stacked(parts, x):
    """One (U, B) for a GEMM whose output stacks several linears' outputs (q, k, v of one QKV
    projection): ``parts`` lists (module, out_features); each LoRA's B goes into its own rows of
    the stacked output (zeros elsewhere). None when none has an active adapter."""
    found = [(terms(m, x), n) for m, n in parts]
    if all(t is None for t, _ in found):
        return None
    us = [t[0] for t, _ in found if t is not None]
    R = sum(u.shape[-1] for u in us)
    rows, col = [], 0
    for t, n in found:
        if t is None:
            rows.append(x.new_zeros(n, R))
            continue
        r = t[1].shape[1]
        rows.append(nn.functional.pad(t[1], (col, R - col - r)))
        col += r
    return torch.cat(us, dim=-1), torch.cat(rows, dim=0)


def gate_up(gate, up, x):
    """(U, B_gate, B_up) for a SwiGLU's separate gate and up linears on one input (each's B in
    its own columns of the shared U), or None when neither has an active adapter."""
    tg, tu = terms(gate, x), terms(up, x)
    if tg is None and tu is None:
        return None
    rg = tg[0].shape[-1] if tg is not None else 0
    ru = tu[0].shape[-1] if tu is not None else 0
    u = torch.cat([t[0] for t in (tg, tu) if t is not None], dim=-1)
    bg = nn.functional.pad(tg[1], (0, ru)) if tg is not None else x.new_zeros(gate.out_features, rg + ru)
    bu = nn.functional.pad(tu[1], (rg, 0)) if tu is not None else x.new_zeros(up.out_features, rg + ru)
    return u, bg, bu


def split_rows(t, n):
    """(U, B) of a linear whose output stacks two halves (a fused gate_up projection) as (U,
    B[:n], B[n:]) for ``gated_linear``; None stays None."""
    return None if t is None else (t[0], t[1][:n], t[1][n:])


def live(layer, paths):
    """The per-call check (for :func:`fused_block._guard.reason`) of the PEFT state no
    registration announces (active adapters, merged or disabled, variants) on the wrappers at
    ``paths``; holds the layer weakly (a cached verdict must not keep it alive)."""
    ref = weakref.ref(layer)

    def check():
        for path in paths:
            why = reason(path, ref().get_submodule(path))
            if why is not None:
                return why
        return None
    return check
