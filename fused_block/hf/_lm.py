"""Causal LM heads: ``model(input_ids, labels=...)``'s loss without the logits.

A converted ``*ForCausalLM`` (the families' ``CAUSAL_LMS``) gets an instance-level ``forward``
that runs the base model, then transformers' ``ForCausalLM`` loss through the fused linear +
cross-entropy on the last hidden state and ``lm_head``'s weight: no (tokens, vocabulary)
logits. Calls that ask for the logits (no labels, eval mode, ``return_logits=True``) run
Hugging Face's forward; anything the path does not reproduce warns once and does the same.
"""
import inspect
import sys
import typing

import torch
import torch.nn.functional as F
from torch import nn

from fused_block import _guard
from fused_block.hf._core import KERNEL_DTYPES, bind_forward, warn_once
from fused_block.loss import linear_cross_entropy

_LOSS_MODULE = "transformers.loss.loss_utils"
# Causal LMs whose forward softcaps the logits, ``c * tanh(logits / c)`` with c =
# ``config.final_logit_softcapping`` (None: no softcap), before the loss: the fused loss applies it too.
FINAL_SOFTCAP = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Mixture-of-experts causal LMs whose forward adds ``router_aux_loss_coef * aux_loss`` to the
# loss when ``output_router_logits`` (the call's, else the config's), where ``aux_loss`` is its
# module's ``load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok,
# attention_mask)``: the fused loss adds the same, computed by that very function.
ROUTER_AUX = ("GptOssForCausalLM",)
_ROUTER_ATTRS = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
_QUIET = "quiet"  # the call asks for Hugging Face's own path (no warning)


class _State:
    """A converted causal LM: its class's forward and how it was called and returns."""

    def __init__(self, original, positional, prefix, output):
        self.original, self.positional, self.prefix, self.output = original, positional, prefix, output


def check(model):
    """At conversion: why ``model``'s forward cannot be replaced by the fused loss path (or None).

    The path mirrors ``*ForCausalLM.forward`` of these families (transformers 5): the base model
    called with every argument but ``labels`` and ``logits_to_keep``, ``lm_head`` on its last
    hidden state, ``self.loss_function`` (ForCausalLMLoss), an output dataclass with ``loss``
    and ``logits`` (:data:`ROUTER_AUX`: plus the router's auxiliary loss)."""
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
    fields = getattr(_output_class(sig.return_annotation), "__dataclass_fields__", {})
    base_params = inspect.signature(type(base).forward).parameters
    own = ("labels", "logits_to_keep")
    if type(model).__name__ in ROUTER_AUX:
        if not (callable(getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None))
                and all(hasattr(model, a) for a in _ROUTER_ATTRS) and "output_router_logits" in names
                and {"aux_loss", "router_logits"} <= set(fields)):
            return (f"{type(model).__name__}'s router auxiliary loss is not recognised (load_balancing_loss_func, "
                    "router_aux_loss_coef, output_router_logits: transformers version?)")
        own += ("output_router_logits",)  # passed on to the base model's **kwargs
    if not ({"labels", "logits_to_keep"} <= set(names) and params[-1].kind is inspect.Parameter.VAR_KEYWORD
            and {"loss", "logits"} <= set(fields)
            and all(n in base_params for n in names[:-1] if n not in own)):
        return f"the signature of {type(model).__name__}.forward is not recognised (transformers version?)"
    if head.out_features != getattr(model.config, "vocab_size", None):
        return "lm_head's out_features differ from config.vocab_size"
    return None


def _output_class(annotation):
    """The output dataclass of a forward annotated with it, or with ``tuple | it`` (BLOOM's)."""
    if hasattr(annotation, "__dataclass_fields__"):
        return annotation
    found = [a for a in typing.get_args(annotation) if hasattr(a, "__dataclass_fields__")]
    return found[0] if len(found) == 1 else None


def patch(model):
    original = type(model).forward
    params = list(inspect.signature(original).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    model.__dict__["_fused_block"] = _State(original, positional, model.base_model_prefix,
                                            _output_class(inspect.signature(original).return_annotation))

    bind_forward(model, _Forward(original))


class _Forward:
    """A converted causal LM's forward (unbound: :func:`fused_block.hf._core.bind_forward` binds
    it) with the original's signature (``__wrapped__``: generate() and Trainer inspect it); an
    object, not a closure, so that the model pickles (the original by its qualified name)."""

    def __init__(self, original):
        self.__wrapped__ = original

    def __call__(self, model, *args, **kwargs):
        return _forward(model, *args, **kwargs)


def _describe(model):
    why, watched = _guard.scan(model, {"lm_head": (nn.Linear,)}, (model._fused_block.prefix,))
    return why, watched, None


def _reason(model, call, return_logits):
    """Why this call runs Hugging Face's forward: _QUIET when that is what the call asks for
    (no labels, eval mode, return_logits=True), a reason to warn about, or None."""
    if call.get("labels") is None or not model.training or return_logits:
        return _QUIET
    if not isinstance(call["labels"], torch.Tensor):
        return "labels that are not a tensor"
    keep = call.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep != 0:
        return "logits_to_keep other than 0 with labels"
    if model.lm_head.weight.dtype not in KERNEL_DTYPES:
        return f"an lm_head in {model.lm_head.weight.dtype} (the kernels take fp32, fp16 and bf16)"
    if model.loss_function is not getattr(sys.modules.get(_LOSS_MODULE), "ForCausalLMLoss", None):
        return "a loss_function other than transformers' ForCausalLMLoss"
    return _guard.reason(model, _describe)


def _forward(self, *args, **kwargs):
    state = self._fused_block
    return_logits = kwargs.pop("return_logits", False)
    call = dict(zip(state.positional, args))
    call.update(kwargs)
    reason = _reason(self, call, return_logits)
    if reason is not None:
        if reason is not _QUIET:
            warn_once(("lm", type(self).__name__, reason), f"{type(self).__name__} computes its loss from the "
                      f"logits (Hugging Face's forward): {reason}")
        return state.original(self, *args, **kwargs)
    return_dict = getattr(self.config, "return_dict", True)
    passed = call.pop("return_dict", return_dict)  # can_return_tuple's rule
    return_dict = return_dict if passed is None else passed
    labels = call.pop("labels")
    call.pop("logits_to_keep", None)
    router_aux = type(self).__name__ in ROUTER_AUX
    if router_aux:  # the original's rule: the call's flag, else the config's, passed to the base model
        flag = call.get("output_router_logits")
        call["output_router_logits"] = router_aux = self.config.output_router_logits if flag is None else flag
    outputs = getattr(self, state.prefix)(**call)
    softcap = getattr(self.config, "final_logit_softcapping", None) if type(self).__name__ in FINAL_SOFTCAP else None
    loss = causal_lm_loss(self.lm_head, outputs.last_hidden_state, labels, num_items_in_batch=call.get(
        "num_items_in_batch"), ignore_index=call.get("ignore_index", -100), shift_labels=call.get("shift_labels"),
        softcap=softcap)
    fields = state.output.__dataclass_fields__
    extra = {f: getattr(outputs, f, None) for f in fields if f not in ("loss", "logits")}
    if router_aux:
        extra["aux_loss"] = sys.modules[type(self).__module__].load_balancing_loss_func(
            outputs.router_logits, self.num_experts, self.num_experts_per_tok, call.get("attention_mask"))
        loss = loss + self.router_aux_loss_coef * extra["aux_loss"].to(loss.device)
    out = state.output(loss=loss, logits=None, **extra)
    if return_dict:
        return out
    # The original's tuple (to_tuple: the fields that are not None) has the logits second: the
    # slot stays, holding None, so that the fields after it keep their positions.
    return tuple(getattr(out, f) for f in fields if f == "logits" or getattr(out, f) is not None)


def causal_lm_loss(head, hidden, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   softcap=None):
    """transformers' ``ForCausalLMLoss`` on ``head(hidden)`` through the fused linear +
    cross-entropy: labels (B, L) shifted left by one (the last position ignored) unless
    ``shift_labels`` is given; the mean over the non-ignored tokens (0 / 0 = NaN when there is
    none, as ``F.cross_entropy``), or with ``num_items_in_batch`` the sum divided by it.
    ``softcap``: the logits softcapped first (Gemma 2/3's ``final_logit_softcapping``)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.to(hidden.device)
    if target.numel() == hidden.shape[:-1].numel():
        target = target.reshape(hidden.shape[:-1])
    total = linear_cross_entropy(hidden, head.weight, target, head.bias, ignore_index=ignore_index, reduction="sum",
                                 softcap=softcap)
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


