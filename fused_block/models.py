"""Small nanoGPT-style models built from the fused blocks: the three Transformer families and
a LLaMA-like decoder.

- :class:`EncoderOnly` (BERT-like): bidirectional self-attention, Post-LN, masked-LM head.
- :class:`DecoderOnly` (GPT-like): causal self-attention, Pre-LN, tied embeddings.
- :class:`EncoderDecoder` (the original Transformer): Post-LN encoder and decoder with
  cross-attention, sinusoidal positions, shared and tied embeddings.
- :class:`LlamaLike` (the architecture most open models now share): Pre-RMSNorm blocks with
  rotary position embeddings, grouped-query attention and a SwiGLU FFN, no biases, untied
  LM head. Built from the fused layers only (torch's layers have no RoPE).

Each takes a config dataclass and ``fused=True``; ``fused=False`` builds the same model on
``torch.nn``'s layers (same parameter names), which :func:`fused_block.convert` turns into the
fused one.

Training loss: ``model(..., targets=targets)`` returns ``(logits, loss)``, the mean
cross-entropy over the tokens whose target is not -100 (when every target is -100: 0 on fused
layers, as :func:`fused_block.linear_cross_entropy` gives; NaN on torch's, as
``F.cross_entropy`` gives). On fused layers the head and the loss
are :func:`fused_block.linear_cross_entropy` (the (N, V) logits are never built) and
``logits`` is None unless ``return_logits=True`` asks for them (then the head also runs as a
plain ``nn.Linear``); on torch's layers it is ``F.linear`` + ``F.cross_entropy`` (logits
likewise returned only when asked for), and so it is for a head the fused loss would bypass
(hooked, or of another class than ``nn.Linear``).

:func:`param_count` splits the parameters per block into attention (about
``4 d^2``) and FFN (about ``8 d^2``), and checks them against the estimate ``12 N d^2`` plus
embeddings: GPT-2 small (d=768, N=12) has about 85M parameters in blocks, 124M in all; the
LLaMA-like default (TinyLlama-1.1B's shape) has 1.10B.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fused_block import _backend, _guard, blocks


def _layer_classes(fused):
    if fused:
        return blocks.TransformerEncoderLayer, blocks.TransformerDecoderLayer
    return nn.TransformerEncoderLayer, nn.TransformerDecoderLayer


_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")


def _activation(name, fused):
    """The layers' ``activation`` for the config's name. torch's layers take only "relu"/"gelu"
    as strings; GELU-tanh goes in as a module, and SwiGLU (linear1 of twice the width) has no
    torch layer: a ValueError, as for the other fused-only options."""
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, _ACTIVATIONS))}, got {name!r}")
    if fused or name in ("relu", "gelu"):
        return name
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    raise ValueError("activation='swiglu' needs fused=True (torch's layers have no SwiGLU)")


def _layer_kwargs(cfg, fused):
    kw = dict(dim_feedforward=cfg.dim_feedforward or 4 * cfg.d_model, dropout=cfg.dropout,
              activation=_activation(cfg.activation, fused), layer_norm_eps=cfg.layer_norm_eps,
              batch_first=True, bias=cfg.bias)
    extra = {k: getattr(cfg, k) for k in ("norm", "num_kv_heads") if hasattr(cfg, k)}
    if fused:
        kw.update(extra)
    elif extra.get("norm", "layer") != "layer" or extra.get("num_kv_heads") not in (None, cfg.n_head):
        raise ValueError("norm='rms' and num_kv_heads need fused=True")
    return kw


def _final_norm(cfg, fused):
    import fused_block
    if getattr(cfg, "norm", "layer") == "rms":
        return (fused_block.RMSNorm if fused else nn.RMSNorm)(cfg.d_model, eps=cfg.layer_norm_eps)
    return (fused_block.LayerNorm if fused else nn.LayerNorm)(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)


def _causal_mask(T, device):
    """Torch's layers need the causal mask itself beside ``is_causal``; the fused ones only the hint."""
    return nn.Transformer.generate_square_subsequent_mask(T, device=device)


def _uses_hint_only(layer):
    return isinstance(layer, (blocks.TransformerEncoderLayer, blocks.TransformerDecoderLayer))


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _head_fusable(head):
    """Whether the fused loss, which reads ``head.weight`` and ``head.bias`` instead of calling
    the head, gives the head's answer: a plain ``nn.Linear`` (parametrizations read through)
    without hooks or an instance-level ``forward`` (:func:`fused_block._guard.module_reason`),
    and no global module hook. Otherwise (a hook that rescales or replaces the logits, a PEFT
    LoRA wrapper, a quantized linear) the head is called and the loss is ``F.cross_entropy``
    on its logits, after a one-time warning."""
    why = _guard._global_hook_reason() or _guard.module_reason("head", head, (nn.Linear,))
    if why is None:
        return True
    _backend.warn_once(("models head", why), "fused_block: the LM head's loss runs F.linear and F.cross_entropy "
                       f"(the logits are built), calling the head: {why}", stacklevel=3)
    return False


def _head_and_loss(layers, head, x, targets, return_logits):
    """``(logits or None, loss)`` of the LM head ``head`` on x (B, T, d) for targets (B, T).

    Fused layers: the fused linear + cross-entropy (no logits unless ``return_logits``);
    torch's layers, a model in a dtype the kernels do not take (float64, which the fused
    layers run as PyTorch's math), and a head the fused loss would bypass (hooked, wrapped:
    :func:`_head_fusable`): the head called, ``F.cross_entropy`` on fp32 (or wider) logits."""
    if x.dtype in _KERNEL_DTYPES and all(_uses_hint_only(layer) for layer in layers) and _head_fusable(head):
        import fused_block

        loss = fused_block.linear_cross_entropy(x, head.weight, targets, head.bias, ignore_index=-100)
        return (head(x) if return_logits else None), loss
    logits = head(x)  # (B, T, vocab)
    wide = logits if logits.dtype == torch.float64 else logits.float()
    loss = F.cross_entropy(wide.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return (logits if return_logits else None), loss


# ---------------------------------------------------------------------------------------------
# decoder-only (GPT-like)
# ---------------------------------------------------------------------------------------------

@dataclass
class DecoderOnlyConfig:
    """GPT-2 small by default (124M parameters with the 50257-token vocabulary)."""
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    dim_feedforward: int | None = None  # None: 4 * d_model
    dropout: float = 0.0
    bias: bool = True
    activation: str = "gelu_tanh"  # GPT-2's GELU
    layer_norm_eps: float = 1e-5
    norm: str = "layer"
    num_kv_heads: int | None = None


class DecoderOnly(nn.Module):
    """GPT-like language model: token + learned position embeddings, Pre-LN causal blocks,
    a final norm, and an LM head tied to the token embedding."""

    def __init__(self, config: DecoderOnlyConfig, fused: bool = True):
        super().__init__()
        self.config = c = config
        Enc, _ = _layer_classes(fused)
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.block_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Enc(c.d_model, c.n_head, norm_first=True, **_layer_kwargs(c, fused))
                                    for _ in range(c.n_layer))
        self.ln_f = _final_norm(c, fused)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(_gpt_init)
        for blk in self.blocks:  # GPT-2: residual projections scaled by 1/sqrt(2 N)
            for lin in (blk.self_attn.out_proj, blk.linear2):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * c.n_layer))

    def forward(self, idx, targets=None, return_logits=False):
        """idx (B, T) int64 -> logits (B, T, vocab); with targets (B, T) ``(logits, loss)``
        (logits None unless ``return_logits`` on fused layers: see the module doc)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"idx: sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d)
        mask = None
        for blk in self.blocks:
            if mask is None and not _uses_hint_only(blk):
                mask = _causal_mask(T, idx.device)
            x = blk(x, src_mask=None if _uses_hint_only(blk) else mask, is_causal=True)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)  # (B, T, vocab)
        return _head_and_loss(self.blocks, self.lm_head, x, targets, return_logits)


def _gpt_init(m):
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.MultiheadAttention):
        nn.init.normal_(m.in_proj_weight, std=0.02)
        if m.in_proj_bias is not None:
            nn.init.zeros_(m.in_proj_bias)


# ---------------------------------------------------------------------------------------------
# encoder-only (BERT-like)
# ---------------------------------------------------------------------------------------------

@dataclass
class EncoderOnlyConfig:
    """BERT-base by default (about 110M parameters)."""
    vocab_size: int = 30522
    max_len: int = 512
    type_vocab_size: int = 2
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    dim_feedforward: int | None = None
    dropout: float = 0.1
    bias: bool = True
    activation: str = "gelu"
    layer_norm_eps: float = 1e-12
    norm: str = "layer"
    num_kv_heads: int | None = None


class EncoderOnly(nn.Module):
    """BERT-like encoder: token + position + segment embeddings with a norm, Post-LN
    bidirectional blocks, and a masked-LM head whose decoder is tied to the token embedding."""

    def __init__(self, config: EncoderOnlyConfig, fused: bool = True):
        super().__init__()
        self.config = c = config
        Enc, _ = _layer_classes(fused)
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.seg = nn.Embedding(c.type_vocab_size, c.d_model)
        self.emb_norm = _final_norm(c, fused)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(Enc(c.d_model, c.n_head, norm_first=False, **_layer_kwargs(c, fused))
                                    for _ in range(c.n_layer))
        self.mlm_dense = nn.Linear(c.d_model, c.d_model)
        self.mlm_norm = _final_norm(c, fused)
        self.mlm_decoder = nn.Linear(c.d_model, c.vocab_size)
        self.mlm_decoder.weight = self.tok.weight  # tied
        self.apply(_gpt_init)

    def forward(self, idx, key_padding_mask=None, token_type_ids=None, targets=None, return_logits=False):
        """idx (B, T) -> MLM logits (B, T, vocab); key_padding_mask (B, T) bool, True = padding;
        targets (B, T) with -100 where no loss is taken: ``(logits, loss)`` (module doc)."""
        B, T = idx.shape
        if T > self.config.max_len:
            raise ValueError(f"idx: sequence length {T} exceeds max_len {self.config.max_len}")
        pos = torch.arange(T, device=idx.device)
        seg = self.seg(token_type_ids) if token_type_ids is not None else self.seg.weight[0]
        x = self.drop(self.emb_norm(self.tok(idx) + self.pos(pos) + seg))  # (B, T, d)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=key_padding_mask)
        x = self.mlm_norm(F.gelu(self.mlm_dense(x)))
        if targets is None:
            return self.mlm_decoder(x)
        return _head_and_loss(self.layers, self.mlm_decoder, x, targets, return_logits)


# ---------------------------------------------------------------------------------------------
# encoder-decoder (original Transformer)
# ---------------------------------------------------------------------------------------------

@dataclass
class EncoderDecoderConfig:
    """Transformer base of "Attention Is All You Need" by default (about 63M parameters with
    a shared 37000-token vocabulary; the paper reports 65M)."""
    vocab_size: int = 37000  # shared source/target vocabulary
    max_len: int = 512
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    n_head: int = 8
    d_model: int = 512
    dim_feedforward: int | None = 2048
    dropout: float = 0.1
    bias: bool = True
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    norm: str = "layer"
    num_kv_heads: int | None = None


class EncoderDecoder(nn.Module):
    """Original Transformer: scaled shared embeddings + sinusoidal positions, Post-LN encoder
    and decoder (causal self-attention, cross-attention over the encoder output), and an
    output projection tied to the embedding."""

    def __init__(self, config: EncoderDecoderConfig, fused: bool = True):
        super().__init__()
        self.config = c = config
        Enc, Dec = _layer_classes(fused)
        kw = _layer_kwargs(c, fused)
        self.emb = nn.Embedding(c.vocab_size, c.d_model)
        self.register_buffer("pe", _sinusoidal(c.max_len, c.d_model), persistent=False)
        self.drop = nn.Dropout(c.dropout)
        self.encoder = nn.ModuleList(Enc(c.d_model, c.n_head, norm_first=False, **kw)
                                     for _ in range(c.n_encoder_layers))
        self.decoder = nn.ModuleList(Dec(c.d_model, c.n_head, norm_first=False, **kw)
                                     for _ in range(c.n_decoder_layers))
        self.generator = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.generator.weight = self.emb.weight  # tied
        nn.init.normal_(self.emb.weight, std=c.d_model ** -0.5)

    def _embed(self, idx, name):
        if idx.shape[1] > self.config.max_len:
            raise ValueError(f"{name}: sequence length {idx.shape[1]} exceeds max_len {self.config.max_len}")
        return self.drop(self.emb(idx) * math.sqrt(self.config.d_model) + self.pe[:idx.shape[1]])

    def encode(self, src, src_key_padding_mask=None):
        """src (B, S) -> memory (B, S, d)."""
        x = self._embed(src, "src")
        for layer in self.encoder:
            x = layer(x, src_key_padding_mask=src_key_padding_mask)
        return x

    def decode(self, tgt, memory, tgt_key_padding_mask=None, memory_key_padding_mask=None):
        """tgt (B, T), memory (B, S, d) -> logits (B, T, vocab); causal over tgt."""
        return self.generator(self._decode_hidden(tgt, memory, tgt_key_padding_mask, memory_key_padding_mask))

    def _decode_hidden(self, tgt, memory, tgt_key_padding_mask, memory_key_padding_mask):
        x = self._embed(tgt, "tgt")
        T = tgt.shape[1]
        for layer in self.decoder:
            mask = None if _uses_hint_only(layer) else _causal_mask(T, tgt.device)
            x = layer(x, memory, tgt_mask=mask, tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=True)
        return x

    def forward(self, src, tgt, src_key_padding_mask=None, tgt_key_padding_mask=None, targets=None,
                return_logits=False):
        """Logits (B, T, vocab) of tgt given src; with targets ``(logits, loss)`` (module doc)."""
        memory = self.encode(src, src_key_padding_mask)
        x = self._decode_hidden(tgt, memory, tgt_key_padding_mask, src_key_padding_mask)
        if targets is None:
            return self.generator(x)
        return _head_and_loss(self.decoder, self.generator, x, targets, return_logits)


def _sinusoidal(n, d):
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


# ---------------------------------------------------------------------------------------------
# parameter counts
# ---------------------------------------------------------------------------------------------

@dataclass
class BlockCount:
    attention: int  # self_attn (+ multihead_attn): in_proj and out_proj, ~4 d^2 each
    ffn: int        # linear1 + linear2, ~2 d d_ff = 8 d^2 at d_ff = 4d
    norm: int
    total: int
    estimate: int   # 4 d^2 per attention (2 d^2 + 2 d d_kv with GQA) + the FFN's matrices
    #                 (2 d d_ff; 3 d d_ff for SwiGLU), the seeds' rule without biases and norms


@dataclass
class ParamCount:
    blocks: list       # one BlockCount per Transformer layer, in module order
    in_blocks: int     # sum over blocks
    embeddings: int    # nn.Embedding parameters (a tied output projection counted once)
    other: int         # everything else: final norms, heads
    total: int         # unique parameters
    estimate: int      # sum of the blocks' estimates + embeddings: 12 N d^2 + embeddings for GPT

    def __str__(self):
        kinds = {}
        for b in self.blocks:  # encoder and decoder blocks differ: one line per kind
            kinds.setdefault((b.attention, b.ffn, b.norm, b.total), []).append(b)
        lines = []
        for (attn, ffn, norm, tot), bs in kinds.items():
            lines.append(f"{len(bs):>3} blocks of: attention {attn:,}  ffn {ffn:,}  norm {norm:,}  total {tot:,}")
        lines += [f"{'in blocks':>12}: {self.in_blocks:,}", f"{'embeddings':>12}: {self.embeddings:,}",
                  f"{'other':>12}: {self.other:,}", f"{'total':>12}: {self.total:,}",
                  f"{'estimate':>12}: {self.estimate:,}  (4d^2 per attention + the FFN's matrices + embeddings)"]
        return "\n".join(lines)


_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _numel(params):
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def param_count(model: nn.Module) -> ParamCount:
    """Parameter counts of a model built from torch's or the fused Transformer layers.

    Works on meta tensors, so counting GPT-2 allocates nothing:
    ``with torch.device("meta"): print(param_count(DecoderOnly(DecoderOnlyConfig())))``.
    """
    per_block, in_block_ids = [], set()
    for m in model.modules():
        if not isinstance(m, _LAYERS):
            continue
        attns = [m.self_attn] + ([m.multihead_attn] if hasattr(m, "multihead_attn") else [])
        norms = [getattr(m, n) for n in ("norm1", "norm2", "norm3") if hasattr(m, n)]
        attention = _numel(p for a in attns for p in a.parameters())
        ffn = _numel(list(m.linear1.parameters()) + list(m.linear2.parameters()))
        norm = _numel(p for n in norms for p in n.parameters())
        d = m.linear1.in_features
        d_kv = sum(a.head_dim * getattr(a, "num_kv_heads", a.num_heads) for a in attns)
        per_block.append(BlockCount(attention, ffn, norm, _numel(m.parameters()),
                                    2 * d * d * len(attns) + 2 * d * d_kv
                                    + d * (m.linear1.out_features + m.linear2.in_features)))
        in_block_ids.update(id(p) for p in m.parameters())
    unique = {id(p): p for p in model.parameters()}
    emb_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    in_blocks = sum(b.total for b in per_block)
    embeddings = sum(p.numel() for i, p in unique.items() if i in emb_ids)
    total = sum(p.numel() for p in unique.values())
    return ParamCount(per_block, in_blocks, embeddings, total - in_blocks - embeddings, total,
                      sum(b.estimate for b in per_block) + embeddings)


# ---------------------------------------------------------------------------------------------
# LLaMA-like (decoder-only with RoPE, GQA, SwiGLU)
# ---------------------------------------------------------------------------------------------

@dataclass
class LlamaLikeConfig:
    """TinyLlama-1.1B's shape by default (1,100,048,384 parameters): LLaMA 2's architecture at
    d_model 2048, 22 layers, 32 query heads sharing 4 KV heads, SwiGLU width 5632."""
    vocab_size: int = 32000
    block_size: int = 2048
    n_layer: int = 22
    n_head: int = 32
    num_kv_heads: int | None = 4
    d_model: int = 2048
    dim_feedforward: int = 5632  # SwiGLU's F: gate and up are (F, d), down is (d, F)
    rope_base: float = 10000.0
    rope_interleaved: bool = False  # Hugging Face's half-split layout
    norm_eps: float = 1e-5
    dropout: float = 0.0


class LlamaLike(nn.Module):
    """LLaMA-style language model: token embedding, Pre-RMSNorm blocks (RoPE self-attention with
    GQA, SwiGLU FFN, no biases), a final RMSNorm and an untied LM head."""

    def __init__(self, config: LlamaLikeConfig):
        super().__init__()
        self.config = c = config
        import fused_block
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.blocks = nn.ModuleList(
            blocks.TransformerEncoderLayer(c.d_model, c.n_head, c.dim_feedforward, dropout=c.dropout,
                                           activation="swiglu", layer_norm_eps=c.norm_eps, batch_first=True,
                                           norm_first=True, bias=False, norm="rms", num_kv_heads=c.num_kv_heads,
                                           rope=True, rope_base=c.rope_base, rope_interleaved=c.rope_interleaved)
            for _ in range(c.n_layer))
        self.norm = fused_block.RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(_gpt_init)
        for blk in self.blocks:
            for lin in (blk.self_attn.out_proj, blk.linear2):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * c.n_layer))

    def forward(self, idx, targets=None, return_logits=False):
        """idx (B, T) int64 -> logits (B, T, vocab); with targets (B, T) ``(logits, loss)``,
        the loss by the fused linear + cross-entropy (logits None unless ``return_logits``)."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"idx: sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.embed(idx)  # (B, T, d); positions enter through RoPE in every block
        for blk in self.blocks:
            x = blk(x, is_causal=True)
        x = self.norm(x)
        if targets is None:
            return self.lm_head(x)
        return _head_and_loss(self.blocks, self.lm_head, x, targets, return_logits)


def estimate_params(d_model: int, n_layer: int, vocab_size: int = 0, n_positions: int = 0) -> int:
    """The seeds' rule of thumb: ``12 * n_layer * d_model^2`` plus the embedding tables."""
    return 12 * n_layer * d_model ** 2 + (vocab_size + n_positions) * d_model

