"""``convert(model)``: swap torch's Transformer layers for the fused ones, in place, and convert
Hugging Face ``transformers`` layers (see :mod:`fused_block.hf`)."""
import sys

from torch import nn

from fused_block.blocks import TransformerDecoderLayer, TransformerEncoderLayer
from fused_block.norm import LayerNorm

_CONVERSIONS = {
    nn.TransformerEncoderLayer: TransformerEncoderLayer,
    nn.TransformerDecoderLayer: TransformerDecoderLayer,
}
_FUSED = tuple(_CONVERSIONS.values())


def _convertible(m) -> bool:
    """Exactly torch's layer, without an instance-level ``forward`` (a patch bound to this very
    object, which the fused layer could not call)."""
    return type(m) in _CONVERSIONS and "forward" not in m.__dict__


def convert(model: nn.Module) -> nn.Module:
    """Replace every ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` in ``model``.

    Works inside ``nn.TransformerEncoder``, ``nn.TransformerDecoder``, ``nn.Transformer`` and
    any user module; the final ``norm`` (an ``nn.LayerNorm``) of an encoder or decoder whose
    layers are fused becomes :class:`fused_block.LayerNorm` (the same module object and
    parameters, the fused kernel). The fused layers reuse the original submodules, so
    parameters stay the same tensors (weights, device, dtype, ``requires_grad``, and an
    optimizer built before the conversion all keep working) and each layer keeps its train/eval
    mode. A layer used in several places (shared weights) becomes one fused layer in all of
    them. The fused layer is the layer's module state too: hooks registered on the layer before
    the conversion fire on the fused one (the same hook dicts: their handles still remove them),
    and parameters, buffers, submodules and attributes the user added to it stay (the state dict
    keeps its keys and their order). Only layers whose type is exactly torch's are converted;
    user subclasses (custom ``forward``) and layers with an instance-level ``forward`` (a patch)
    are left alone.
    Returns ``model`` (or, when ``model`` itself is such a layer, its fused replacement).

    Hugging Face ``transformers`` models (GPT-2, BERT, LLaMA, Mistral, Qwen2, Qwen3, Phi-3,
    Gemma, Gemma 2, Gemma 3, gpt-oss, BLOOM, BART, Whisper, T5 and mT5 layers:
    ``fused_block.hf.FAMILIES``, README's table) are converted in place as described in
    :mod:`fused_block.hf`: same classes, modules, parameters and state dict, a fused
    ``forward`` per layer. ``transformers`` is not imported unless it already was (a model
    built from it has imported it); for attention only in any model, see
    ``attn_implementation="fused_block"`` (:mod:`fused_block.hf.interface`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _convertible(model):
        return _CONVERSIONS[type(model)].from_torch(model)
    # Every slot, shared layers included (ALBERT-style nn.ModuleList([layer] * n), one layer under
    # two names: named_children() yields a shared child once): one fused layer per torch layer.
    # Likewise one fused attention module per torch module shared by several layers.
    fused, attentions = {}, {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if _convertible(child):
                if id(child) not in fused:
                    fused[id(child)] = _CONVERSIONS[type(child)].from_torch(child, attentions)
                setattr(parent, name, fused[id(child)])
    # A converted attention module held elsewhere too (beside the layer: model.pool = layer.self_attn)
    # is the fused one there as well: one module, as torch's was.
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if id(child) in attentions and attentions[id(child)][0] is child:
                setattr(parent, name, attentions[id(child)][1])
    # A stack's final norm (nn.Transformer always has two) runs the fused LayerNorm where the
    # stack's layers are fused: the same module, its class swapped for fused_block.LayerNorm
    # (a subclass without state of its own: parameters, hooks, mode and state dict unchanged).
    for m in model.modules():
        if (type(m) in (nn.TransformerEncoder, nn.TransformerDecoder) and type(m.norm) is nn.LayerNorm
                and any(type(layer) in _FUSED for layer in m.layers)):
            m.norm.__class__ = LayerNorm
    # nn.TransformerEncoder keeps its inference fast path: its nested tensors reach the fused
    # layers, which run them on the kernels, and the encoder pads the output with zeros as
    # torch's does (a decoder reading that memory then sees torch's values); its norm sees the
    # padded output.
    if "transformers" in sys.modules:
        from fused_block import hf

        if hf.is_transformers_model(model):
            hf.convert_modules(model)
    return model
