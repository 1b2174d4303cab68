"""Hugging Face ``transformers`` models converted in place by :func:`fused_block.convert`.

Covered layer classes (their model classes, e.g. ``LlamaForCausalLM``, ``GPT2LMHeadModel``,
``BertForMaskedLM``, need nothing else) are the rows of :data:`FAMILIES`, one module per
family: ``llama`` (``LlamaDecoderLayer``, ``MistralDecoderLayer``, ``Qwen2DecoderLayer``,
``Qwen3DecoderLayer``: Pre-RMSNorm, RoPE, GQA, gated MLP; Qwen3's per-head q/k norms), ``gemma``
(``GemmaDecoderLayer``, ``Gemma2DecoderLayer``, ``Gemma3DecoderLayer``: (1 + w) RMSNorms, GeGLU MLP,
Gemma 2/3's sandwich norms, Gemma 3's q/k norms, softcapped and windowed attention in the kernel),
``phi3`` (``Phi3DecoderLayer``: the same with fused ``qkv_proj`` and ``gate_up_proj``), ``gpt_oss``
(``GptOssDecoderLayer``: LLaMA's attention with biases, attention sinks and the sliding layers'
windows in the kernel, YaRN RoPE, both RMSNorms; its MoE MLP stays Hugging Face's, called as a
submodule; ``GptOssForCausalLM``'s loss adds the router's auxiliary loss), ``gpt2``
(``GPT2Block``: Pre-LN, Conv1D weights, fused ``c_attn``, tanh GELU), ``bloom`` (``BloomBlock``:
Pre-LN, the per-head [q, k, v] ``query_key_value`` read as views, ALiBi as the kernel's bias,
tanh GELU), ``bert`` (``BertLayer``:
Post-LN encoder), ``seq2seq`` (BART's and Whisper's encoder and decoder layers: Post-LN /
Pre-LN, causal self-attention with its cache, cross-attention with the cross-attention cache)
and ``t5`` (``T5Block``, ``MT5Block``: Pre-RMSNorm, the relative position bias through the
attention kernel's bias input, ReLU or gated-GELU FFN).
Each family module says what its fused forward runs.

How: each recognised layer keeps its class, submodules, parameters (so state dicts,
``save_pretrained``/``from_pretrained``, optimizers and train/eval mode are untouched) and
gets an instance-level ``forward`` that runs the fused ops (:mod:`fused_block.hf._core`, the
shared patching core). The causal LMs of :data:`CAUSAL_LMS` compute their training loss
without the logits (:mod:`fused_block.hf._lm`).

Self-attention reads the packed QKV output in place (``attention_qkvpacked``: the output in the
out-projection's layout, one packed gradient, no split, merge, copy or cat) whenever the keys
are this call's own: no cache, or a cache that held nothing before (training, prefill). With
cached keys (decoding) q, k and v are views of the packed tensor and the cache returns the
keys to attend. Masks: :mod:`fused_block.hf._attention`. Inputs the fused path does not
express (output_attentions, head masks, cross-attention outside the encoder-decoders' layers,
hooks on the skipped submodules, unknown activations or signatures, float64) run the layer's
original forward, with a one-time warning. Never a different answer, only a slower one.

Adding a family: a module beside these with ``check``, ``check_call``, ``run`` and ``tree``
(:class:`fused_block.hf._core.Family`), and its rows in :data:`FAMILIES`.

Attention only, for any model whose attention goes through transformers' ``AttentionInterface``:
importing this package registers ``attn_implementation="fused_block"``
(:mod:`fused_block.hf.interface`; :func:`register` does it again). ``import fused_block`` never
imports ``transformers``; this package does (``fused_block.convert`` imports it only for models
built with ``transformers``). A converted model pickles whole (``torch.save(model)``; its
caches of packed weights are not pickled) but for tensor-parallel layers
(:mod:`fused_block.distributed`).
"""
try:
    import transformers  # noqa: F401
except ImportError as e:  # the hf extra is not installed
    raise ImportError("fused_block.hf needs transformers: pip install fused-block[hf]") from e

from fused_block.hf import _core, _lm, _norms, bert, bloom, gemma, gpt2, gpt_oss, llama, phi3, seq2seq, t5
from fused_block.hf.interface import register
from fused_block.hf._core import is_transformers_model  # noqa: F401
from fused_block.hf._lm import causal_lm_loss  # noqa: F401

# Layer class name -> its family. One row per layer class.
FAMILIES = {
    "LlamaDecoderLayer": llama.FAMILY,
    "MistralDecoderLayer": llama.FAMILY,
    "Qwen2DecoderLayer": llama.FAMILY,
    "Qwen3DecoderLayer": llama.FAMILY,
    "GemmaDecoderLayer": gemma.FAMILY,
    "Gemma2DecoderLayer": gemma.FAMILY,
    "Gemma3DecoderLayer": gemma.FAMILY,
    "Phi3DecoderLayer": phi3.FAMILY,
    "GptOssDecoderLayer": gpt_oss.FAMILY,
    "GPT2Block": gpt2.FAMILY,
    "BloomBlock": bloom.FAMILY,
    "BertLayer": bert.FAMILY,
    "BartEncoderLayer": seq2seq.FAMILY,
    "BartDecoderLayer": seq2seq.FAMILY,
    "WhisperEncoderLayer": seq2seq.FAMILY,
    "WhisperDecoderLayer": seq2seq.FAMILY,
    "T5Block": t5.FAMILY,
    "MT5Block": t5.FAMILY,
}
# Causal LMs whose training loss runs the fused linear + cross-entropy.
CAUSAL_LMS = (llama.CAUSAL_LMS + gemma.CAUSAL_LMS + phi3.CAUSAL_LMS + gpt_oss.CAUSAL_LMS + gpt2.CAUSAL_LMS
              + bloom.CAUSAL_LMS)


register()


def convert_modules(model) -> list:
    """Patch every recognised layer of ``model`` in place, its causal LM's loss, and the
    model-level norms beside the converted layers (:mod:`fused_block.hf._norms`); returns the
    converted modules."""
    converted = _core.convert_modules(model, FAMILIES, CAUSAL_LMS, _lm.patch, _lm.check)
    layers = [m for m in converted if type(m).__name__ in FAMILIES]
    return converted + _norms.convert(model, FAMILIES, layers)
