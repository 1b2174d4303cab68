"""The model-level norms beside the converted layers: the final norm (LLaMA's ``model.norm``,
GPT-2's ``ln_f``, T5's ``final_layer_norm``, ...) and the embeddings' norms (BERT's
``embeddings.LayerNorm``, BLOOM's ``word_embeddings_layernorm``, BART's
``layernorm_embedding``).

A converted layer runs its norms on the fused kernel, but these modules sit outside every layer
and ran Hugging Face's own code: for an RMSNorm six fp32 PyTorch kernels forward and about ten
backward over the (tokens, hidden) activations, a training step's largest unfused elementwise
work in a LLaMA model (Liger-Kernel's patches replace it). :func:`convert` gives each such module
an instance-level ``forward`` that runs the norm its layers run (``add_rms_norm`` /
``add_layer_norm`` without a residual: one launch forward, one and its partial sums' reduction
backward). Which modules: those of a norm class of :data:`KINDS` that a converted layer holds
(so a model none of whose layers is converted keeps every norm), outside every layer: the
families' (whose own forward, converted or not, calls its norms) and any other module held in
an ``nn.ModuleList`` (another stack's layers, e.g. a vision tower's beside a converted text
model). Parameters, state dict and the module's hooks are untouched.

Per call, the original forward runs (after a one-time warning) where the fused norm would not
give the original's answer: an input that is not a plain fp32/fp16/bf16 tensor of the weight's
width and device (a DTensor, float64), or an original output dtype (which some classes take
from the weight: LLaMA's ``weight * x.to(dtype)``, T5's half weights) other than the input's,
unless the input is fp32 (the fused norm's fp32 result is then cast: one rounding);
``nn.LayerNorm`` with a weight or bias in another dtype than the input's, except under autocast
where the device type's autocast runs ``layer_norm`` in fp32 (CUDA's): there input, weight and
bias are cast to fp32 and the output is fp32, as torch's module gives. The
Hugging Face RMSNorm classes are Python code autocast does not cast. The fused norm rounds
once where LLaMA's rounds the normalized value and then its product with the weight: the
converted layers' norms compute the same way.
"""

import torch

from fused_block.hf._core import KERNEL_DTYPES, bind_forward, warn_once
from fused_block.hf.gemma import NORMS as _UNIT_OFFSET
from fused_block.hf.llama import rms_eps
from fused_block import norm as _norm
from fused_block.norm import _TENSOR_TYPES, MAX_HIDDEN, add_layer_norm, add_rms_norm, as_autocast


def _rms(norm, x):
    return add_rms_norm(x, None, norm.weight, rms_eps(norm))[0]


def _rms_unit_offset(norm, x):
    return add_rms_norm(x, None, norm.weight, rms_eps(norm), unit_offset=True)[0]


def _layer(norm, x):
    if _norm.autocast_runs_fp32(x, False):  # torch.nn.LayerNorm computes in fp32 there
        return as_autocast(add_layer_norm, x, None, (norm.weight, norm.bias), norm.eps)[0]
    return add_layer_norm(x, None, norm.weight, norm.bias, norm.eps)[0]


# The original's output dtype for an input x (None: a mix of dtypes the fused norm does not take).
def _promoted(norm, x):  # weight * x.to(dtype): LLaMA's
    return torch.promote_types(norm.weight.dtype, x.dtype)


def _t5(norm, x):  # the weight's dtype when it is half, else the fp32 statistics'
    return norm.weight.dtype if norm.weight.dtype in (torch.float16, torch.bfloat16) else torch.float32


def _input(norm, x):  # cast back to the input's dtype
    return x.dtype


def _same(norm, x):  # torch.nn.LayerNorm: its weight and bias in the input's dtype; fp32 under autocast (CUDA's)
    if _norm.autocast_runs_fp32(x, False):
        return torch.float32
    return x.dtype if all(t is None or t.dtype == x.dtype for t in (norm.weight, norm.bias)) else None


# Hugging Face's norm class name -> (the fused norm, the original's output dtype).
KINDS = {
    **dict.fromkeys(("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"),
                    (_rms, _promoted)),
    **dict.fromkeys(("T5LayerNorm", "MT5LayerNorm"), (_rms, _t5)),
    "GptOssRMSNorm": (_rms, _input),  # (weight * x).to(input dtype)
    **dict.fromkeys(_UNIT_OFFSET, (_rms_unit_offset, _input)),  # (x * (1 + w.float())).type_as(x)
}
_LAYER_NORM = (_layer, _same)  # torch.nn.LayerNorm itself


def _kind(module):
    """``(fused norm, output dtype)`` of Hugging Face's norm classes (:data:`KINDS`) and of
    ``torch.nn.LayerNorm`` itself over one dim; None for any other module."""
    cls = type(module)
    if cls is torch.nn.LayerNorm:
        return _LAYER_NORM if len(module.normalized_shape) == 1 else None
    return KINDS.get(cls.__name__) if cls.__module__.startswith("transformers.models.") else None


def _check(norm):
    """Why ``norm`` cannot take the fused forward (None if it can), at conversion."""
    w = getattr(norm, "weight", None)
    if type(norm) is torch.nn.LayerNorm:
        if not isinstance(norm.eps, float):
            return "eps is not a float"
        return None if w is None or w.dim() == 1 else "a weight that is not 1-D"
    if w is None or w.dim() != 1 or rms_eps(norm) is None:
        return "not an RMSNorm with a 1-D weight and a float eps"
    return None


class _State:
    def __init__(self, original, run, out_dtype):
        self.original, self.run, self.out_dtype = original, run, out_dtype


def convert(model, families, layers) -> list:
    """Patch the model-level norms of ``model`` (see the module's docstring) whose class is that
    of a norm inside one of the converted ``layers``; ``families``: the layer class names whose
    subtrees are left alone. Returns the patched norms."""
    classes = {type(s) for layer in layers for s in layer.modules() if _kind(s) is not None}
    if not classes:
        return []
    # Not inside a layer: the families' (their forward calls their norms) or any other stack's
    # (an element of a ModuleList: a vision tower's layers beside a converted text model).
    layer_like = [m for m in model.modules() if type(m).__name__ in families]
    layer_like += [e for m in model.modules() if isinstance(m, torch.nn.ModuleList) for e in m]
    inside = {id(s) for m in layer_like for s in m.modules()}
    patched = []
    for m in model.modules():
        if type(m) not in classes or id(m) in inside or "_fused_block" in m.__dict__:
            continue
        reason = _check(m)
        if reason is None and ("forward" in m.__dict__ or hasattr(m, "_hf_hook")):
            reason = "its forward is already wrapped (accelerate's device hooks or another patch)"
        if reason is not None:
            warn_once(("convert", type(m).__name__, reason), f"{type(m).__name__} is left unconverted: {reason}")
            continue
        m.__dict__["_fused_block"] = _State(type(m).forward, *_kind(m))
        bind_forward(m, _forward)
        patched.append(m)
    return patched


def _plan(norm, x, out_dtype):
    """``(reason, dtype)``: why this call runs the original forward (None: the fused norm gives
    its answer), and the original's output dtype: the fused norm's (x's), or one it is cast to
    from fp32 (a single rounding, as the original's last)."""
    if type(x) is not torch.Tensor:
        return f"an input of type {type(x).__name__} (the fused norm takes plain tensors)", None
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (the kernels take fp32, fp16 and bf16)", None
    if x.dim() == 0:
        return "a 0-dim input", None
    width = getattr(norm, "normalized_shape", None)  # torch.nn.LayerNorm's, with or without a weight
    if width is not None and tuple(x.shape[-1:]) != tuple(width):
        return f"an input of shape {tuple(x.shape)} for a normalized shape {tuple(width)}", None
    if width is None and getattr(norm, "weight", None) is None:
        return "an RMSNorm without its weight", None
    for name in ("weight", "bias"):
        t = getattr(norm, name, None)
        if t is None:
            continue
        if type(t) not in _TENSOR_TYPES:
            return f"a {name} of type {type(t).__name__}", None
        if t.shape != x.shape[-1:] or t.device != x.device:
            return (f"an input of shape {tuple(x.shape)} on {x.device} for a {name} of shape {tuple(t.shape)} on "
                    f"{t.device}"), None
    if x.shape[-1] > MAX_HIDDEN:
        return f"rows of {x.shape[-1]} elements (the kernels take up to {MAX_HIDDEN})", None
    dtype = out_dtype(norm, x)
    if dtype != x.dtype and (dtype is None or x.dtype != torch.float32) and not (
            out_dtype is _same and dtype is torch.float32):  # torch.nn.LayerNorm under (CUDA's) autocast
        params = ", ".join(f"a {t.dtype} {name}" for name in ("weight", "bias")
                           if (t := getattr(norm, name, None)) is not None)
        return (f"{params} with a {x.dtype} input (the original's output: "
                f"{'a mix it does not take' if dtype is None else dtype})"), None
    return None, dtype


def _forward(self, *args, **kwargs):
    state = self._fused_block
    x = args[0] if len(args) == 1 and not kwargs else next(iter(kwargs.values())) if len(kwargs) == 1 and not args \
        else None
    reason, dtype = _plan(self, x, state.out_dtype) if x is not None else ("an unexpected signature", None)
    if reason is not None:
        warn_once((type(self).__name__, reason), f"{type(self).__name__} runs its original forward: {reason}")
        return state.original(self, *args, **kwargs)
    out = state.run(self, x)
    return out if out.dtype == dtype else out.to(dtype)
