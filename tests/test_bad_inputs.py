"""The bad-input catalogue and special values, for every public function and module.

Each bad input must raise ValueError or TypeError naming the argument, before any kernel
launch: nothing raises from inside Triton, nothing returns a silently wrong result.
"""
import numpy as np
import pytest
import torch

import fused_block
from fused_block import reference
from fused_block.kernels import common

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, BF16 = torch.float32, torch.bfloat16


def r(*shape, dtype=F32, device=DEV):
    return torch.randn(*shape, dtype=F32).to(device=device, dtype=dtype)


def _norm(**kw):
    args = dict(x=r(4, 16), residual=None, weight=r(16), bias=None, eps=1e-5)
    args.update(kw)
    return fused_block.add_layer_norm(**args)


def _rms(**kw):
    args = dict(x=r(4, 16), residual=None, weight=r(16), eps=None)
    args.update(kw)
    return fused_block.add_rms_norm(**args)


def _attn(**kw):
    args = dict(q=r(2, 4, 8, 16, dtype=BF16), k=r(2, 2, 8, 16, dtype=BF16), v=r(2, 2, 8, 16, dtype=BF16))
    args.update(kw)
    return fused_block.attention(**args)


def _linear(**kw):
    args = dict(x=r(4, 16), weight=r(8, 16), bias=r(8))
    args.update(kw)
    return fused_block.linear(**args)


def _mlp(**kw):
    args = dict(x=r(4, 16), w1=r(32, 16), b1=r(32), w2=r(16, 32), b2=r(16))
    args.update(kw)
    return fused_block.mlp(**args)


def _lce(**kw):
    args = dict(hidden=r(4, 16), weight=r(10, 16), target=torch.zeros(4, dtype=torch.int64, device=DEV))
    args.update(kw)
    return fused_block.linear_cross_entropy(**args)


def _module(make, *inputs, **kw):
    return lambda: make()(*inputs, **kw)


def _enc():
    return fused_block.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).to(DEV)


def _dec():
    return fused_block.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True).to(DEV)


def _mha():
    return fused_block.MultiheadAttention(16, 4, batch_first=True).to(DEV)


def _kv(**kw):
    args = dict(k_cache=torch.zeros(2, 2, 8, 16, dtype=BF16, device=DEV),
                v_cache=torch.zeros(2, 2, 8, 16, dtype=BF16, device=DEV),
                k=r(2, 2, 3, 16, dtype=BF16), v=r(2, 2, 3, 16, dtype=BF16),
                cache_seqlens=torch.zeros(2, dtype=torch.int32, device=DEV))
    args.update(kw)
    return fused_block.kv_cache_append(**args)


def _kv_one_cache():
    cache = torch.zeros(2, 2, 8, 16, dtype=BF16, device=DEV)
    return _kv(k_cache=cache, v_cache=cache)


def _kv_overlapping_caches():
    """Two views of one buffer, one element apart: the caches' writes would overwrite each other."""
    buf = torch.zeros(2, 2, 8, 17, dtype=BF16, device=DEV)
    return _kv(k_cache=buf[..., :16], v_cache=buf[..., 1:])


def _kv_new_rows_from_the_cache():
    """New rows read from the cache rows being written (torch's ``k_cache[:, :, 2:5] =
    k_cache[:, :, 0:3]`` refuses): the kernel's reads would race with its writes."""
    k_cache = torch.randn(2, 2, 8, 16, dtype=BF16, device=DEV)
    return _kv(k_cache=k_cache, k=k_cache[:, :, 0:3], cache_seqlens=torch.full((2,), 2, dtype=torch.int32, device=DEV))


def _lce_head_logits_after_option_change():
    head = fused_block.LinearCrossEntropy(16, 10).to(DEV)
    head.softcap = 0.0
    return head(r(4, 16))


def _models():
    from fused_block import models
    return models


META = torch.device("meta")

# (id, callable, exception type, the argument the message must name)
CATALOGUE = [
    # add_layer_norm / add_rms_norm
    ("ln-int-x", lambda: _norm(x=torch.ones(4, 16, dtype=torch.int32, device=DEV)), TypeError, "x"),
    ("ln-list-x", lambda: _norm(x=[[1.0]]), TypeError, "x"),
    ("ln-0-d-x", lambda: _norm(x=torch.tensor(1.0, device=DEV), weight=None), ValueError, "x"),
    ("ln-empty-hidden", lambda: _norm(x=r(4, 0), weight=None), ValueError, "x"),
    ("ln-hidden-too-large", lambda: _norm(x=torch.empty(1, fused_block.norm.MAX_HIDDEN + 1, device=DEV), weight=None),
     ValueError, "x"),
    ("ln-residual-shape", lambda: _norm(residual=r(4, 8)), ValueError, "residual"),
    ("ln-residual-int", lambda: _norm(residual=torch.ones(4, 16, dtype=torch.int64, device=DEV)), TypeError, "residual"),
    ("ln-weight-shape", lambda: _norm(weight=r(8)), ValueError, "weight"),
    ("ln-bias-shape", lambda: _norm(bias=r(16, 1)), ValueError, "bias"),
    ("ln-weight-device", lambda: _norm(weight=r(16, device=META)), ValueError, "weight"),
    ("ln-eps-negative", lambda: _norm(eps=-1e-5), ValueError, "eps must be >= 0"),
    ("ln-eps-nan", lambda: _norm(eps=float("nan")), ValueError, "eps must be >= 0"),
    ("ln-eps-numpy-negative", lambda: _norm(eps=np.float32(-1e-5)), ValueError, "eps must be >= 0"),
    ("ln-eps-bool", lambda: _norm(eps=True), TypeError, "eps must be a number, got bool"),
    ("ln-eps-numpy-bool", lambda: _norm(eps=np.bool_(True)), TypeError, "eps must be a number, got numpy.bool"),
    ("ln-eps-str", lambda: _norm(eps="1e-5"), TypeError, "eps must be a number, got str"),
    ("ln-dropout-above-one", lambda: _norm(dropout_p=1.0 + 2 ** -52), ValueError, "dropout_p"),
    ("ln-dropout-negative", lambda: _norm(dropout_p=-0.1), ValueError, "dropout_p"),
    ("ln-residual-in-fp32-type", lambda: _norm(residual_in_fp32=1), TypeError, "residual_in_fp32"),
    # numpy's bool is refused where a flag is required (as SDPA's is_causal refuses it), by its full name
    ("ln-residual-in-fp32-numpy-bool", lambda: _norm(residual_in_fp32=np.bool_(True)), TypeError,
     "residual_in_fp32 must be a bool, got numpy.bool"),
    ("rms-unit-offset-numpy-bool", lambda: _rms(unit_offset=np.bool_(True)), TypeError,
     "unit_offset must be a bool, got numpy.bool"),
    ("rms-eps-zero-dim-array", lambda: _rms(eps=np.array(1e-5)), TypeError, "eps must be a number, got numpy.ndarray"),
    ("rms-dropout-numpy", lambda: _rms(dropout_p=np.float32(1.5)), ValueError, "dropout_p must be in"),
    ("rms-int-x", lambda: _rms(x=torch.ones(4, 16, dtype=torch.int32, device=DEV)), TypeError, "x"),
    ("rms-weight-shape", lambda: _rms(weight=r(17)), ValueError, "weight"),
    ("rms-dropout", lambda: _rms(dropout_p=1.5), ValueError, "dropout_p"),
    # attention
    ("attn-rank", lambda: _attn(q=r(4, 8, 16, dtype=BF16)), ValueError, "q"),
    ("attn-int", lambda: _attn(q=torch.ones(2, 4, 8, 16, dtype=torch.int32, device=DEV)), TypeError, "q"),
    ("attn-dtype-mismatch", lambda: _attn(k=r(2, 2, 8, 16, dtype=torch.float16)), TypeError, "k"),
    ("attn-device", lambda: _attn(v=r(2, 2, 8, 16, dtype=BF16, device=META)), ValueError, "v"),
    ("attn-batch", lambda: _attn(k=r(3, 2, 8, 16, dtype=BF16), v=r(3, 2, 8, 16, dtype=BF16)), ValueError, "k"),
    ("attn-head-dim-mismatch", lambda: _attn(k=r(2, 2, 8, 24, dtype=BF16), v=r(2, 2, 8, 24, dtype=BF16)), ValueError, "k"),
    ("attn-head-dim-not-8", lambda: _attn(q=r(2, 4, 8, 20, dtype=BF16), k=r(2, 2, 8, 20, dtype=BF16),
                                          v=r(2, 2, 8, 20, dtype=BF16)), ValueError, "head dim"),
    ("attn-head-dim-too-large", lambda: _attn(q=r(1, 1, 8, 264, dtype=BF16), k=r(1, 1, 8, 264, dtype=BF16),
                                              v=r(1, 1, 8, 264, dtype=BF16)), ValueError, "head dim"),
    ("attn-head-dim-too-small", lambda: _attn(q=r(1, 1, 8, 8, dtype=BF16), k=r(1, 1, 8, 8, dtype=BF16),
                                              v=r(1, 1, 8, 8, dtype=BF16)), ValueError, "head dim"),
    ("attn-heads-not-divisible", lambda: _attn(k=r(2, 3, 8, 16, dtype=BF16), v=r(2, 3, 8, 16, dtype=BF16)), ValueError, "heads"),
    ("attn-v-shape", lambda: _attn(v=r(2, 2, 9, 16, dtype=BF16)), ValueError, "v"),
    ("attn-mask-shape", lambda: _attn(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool, device=DEV)), ValueError, "key_padding_mask"),
    ("attn-mask-dtype", lambda: _attn(key_padding_mask=torch.zeros(2, 8, device=DEV)), TypeError, "key_padding_mask"),
    ("attn-dropout", lambda: _attn(dropout_p=1.5), ValueError, "dropout_p"),
    ("attn-causal-type", lambda: _attn(causal="yes"), TypeError, "causal"),
    ("attn-causal-numpy-bool", lambda: _attn(causal=np.bool_(True)), TypeError, "causal must be a bool, got numpy.bool"),
    ("attn-window-float", lambda: _attn(window=(np.float64(2.0), -1)), TypeError,
     "window's left size must be an int, got numpy.float64"),
    ("attn-window-numpy-bool", lambda: _attn(window=(-1, np.bool_(False))), TypeError,
     "window's right size must be an int, got numpy.bool"),
    ("attn-window-numpy-below", lambda: _attn(window=(np.int64(-2), -1)), ValueError, "window's left size"),
    ("attn-scale-numpy-inf", lambda: _attn(scale=np.float32("inf")), ValueError, "scale must be finite"),
    ("attn-softcap-numpy-zero", lambda: _attn(softcap=np.float16(0)), ValueError, "softcap must be > 0"),
    ("attn-dropout-bool", lambda: _attn(dropout_p=True), TypeError, "dropout_p must be a float, got bool"),
    ("attn-packed-heads-float", lambda: fused_block.attention_qkvpacked(r(2, 8, 48, dtype=BF16), np.float64(1)),
     TypeError, "num_heads must be an int, got numpy.float64"),
    ("attn-scale", lambda: _attn(scale=-1.0), ValueError, "scale"),
    ("attn-return-lse-type", lambda: _attn(return_lse="no"), TypeError, "return_lse"),
    ("attn-alibi-requires-grad", lambda: _attn(alibi_slopes=torch.ones(4, device=DEV, requires_grad=True)), ValueError,
     "alibi_slopes"),
    # kv_cache_append: the caches are written in place
    ("kv-cache-expanded", lambda: _kv(k_cache=torch.zeros(1, 2, 8, 16, dtype=BF16, device=DEV).expand(2, 2, 8, 16)),
     ValueError, "k_cache"),
    ("kv-caches-share-memory", _kv_one_cache, ValueError, "v_cache"),
    ("kv-caches-overlap", _kv_overlapping_caches, ValueError, "v_cache"),
    ("kv-new-rows-share-the-cache", _kv_new_rows_from_the_cache, ValueError, "k must not share memory"),
    ("kv-new-keys-require-grad", lambda: _kv(k=r(2, 2, 3, 16, dtype=BF16).requires_grad_()), ValueError, "k"),
    # linear / mlp
    ("linear-inner-dims", lambda: _linear(weight=r(8, 12)), ValueError, "weight"),
    ("linear-bias-length", lambda: _linear(bias=r(7)), ValueError, "bias"),
    ("linear-activation", lambda: _linear(activation="swish"), ValueError, "activation"),
    ("linear-activation-type", lambda: _linear(activation=1), TypeError, "activation"),
    ("linear-dtype-mismatch", lambda: _linear(weight=r(8, 16, dtype=BF16)), TypeError, "weight"),
    ("linear-int-x", lambda: _linear(x=torch.ones(4, 16, dtype=torch.int64, device=DEV)), TypeError, "x"),
    ("linear-weight-rank", lambda: _linear(weight=r(16)), ValueError, "weight"),
    ("linear-residual-shape", lambda: _linear(residual=r(4, 16)), ValueError, "residual"),
    ("linear-device", lambda: _linear(bias=r(8, device=META)), ValueError, "bias"),
    ("linear-lora-type", lambda: _linear(lora=3), TypeError, "lora"),
    ("linear-lora-member-type", lambda: _linear(lora=(r(4, 16), 3)), TypeError, "lora B0"),
    ("mlp-w2-inner", lambda: _mlp(w2=r(16, 31)), ValueError, "w2"),
    ("mlp-b2-length", lambda: _mlp(b2=r(15)), ValueError, "b2"),
    ("mlp-w1-inner", lambda: _mlp(w1=r(32, 15)), ValueError, "w1"),
    ("mlp-activation", lambda: _mlp(activation="tanh"), ValueError, "activation"),
    # linear_cross_entropy
    ("lce-shapes-do-not-chain", lambda: _lce(weight=r(10, 12)), ValueError, "weight"),
    ("lce-weight-rank", lambda: _lce(weight=r(16)), ValueError, "weight"),
    ("lce-bias-length", lambda: _lce(bias=r(9)), ValueError, "bias"),
    ("lce-target-float", lambda: _lce(target=torch.zeros(4, device=DEV)), TypeError, "target"),
    ("lce-target-bool", lambda: _lce(target=torch.zeros(4, dtype=torch.bool, device=DEV)), TypeError, "target"),
    ("lce-target-list", lambda: _lce(target=[0, 1, 2, 3]), TypeError, "target"),
    ("lce-target-shape", lambda: _lce(target=torch.zeros(5, dtype=torch.int64, device=DEV)), ValueError, "target"),
    ("lce-dtype-mismatch", lambda: _lce(weight=r(10, 16, dtype=BF16)), TypeError, "weight"),
    ("lce-int-hidden", lambda: _lce(hidden=torch.ones(4, 16, dtype=torch.int64, device=DEV)), TypeError, "hidden"),
    ("lce-device", lambda: _lce(weight=r(10, 16, device=META)), ValueError, "weight"),
    ("lce-target-device", lambda: _lce(target=torch.zeros(4, dtype=torch.int64, device=META)), ValueError, "target"),
    ("lce-negative-label-smoothing", lambda: _lce(label_smoothing=-0.1), ValueError, "label_smoothing"),
    ("lce-label-smoothing-above-one", lambda: _lce(label_smoothing=1.5), ValueError, "label_smoothing"),
    ("lce-negative-z-loss", lambda: _lce(z_loss=-1e-4), ValueError, "z_loss"),
    ("lce-softcap-zero", lambda: _lce(softcap=0.0), ValueError, "softcap"),
    ("lce-softcap-inf", lambda: _lce(softcap=float("inf")), ValueError, "softcap"),
    ("lce-z-loss-inf", lambda: _lce(z_loss=float("inf")), ValueError, "z_loss"),
    ("lce-ignore-index-overflow", lambda: _lce(ignore_index=2 ** 64), ValueError, "ignore_index"),
    ("lce-reduction", lambda: _lce(reduction="avg"), ValueError, "reduction"),
    ("lce-ignore-index-type", lambda: _lce(ignore_index=-100.0), TypeError, "ignore_index"),
    # as F.cross_entropy: numpy integers are class indices, numpy floats and bools are not
    ("lce-ignore-index-numpy-float", lambda: _lce(ignore_index=np.float64(-100)), TypeError,
     "ignore_index must be an int, got numpy.float64"),
    ("lce-ignore-index-numpy-bool", lambda: _lce(ignore_index=np.bool_(True)), TypeError,
     "ignore_index must be an int, got numpy.bool"),
    ("lce-z-loss-numpy-negative", lambda: _lce(z_loss=np.float32(-1)), ValueError, "z_loss"),
    ("lce-return-lse-numpy-bool", lambda: _lce(return_lse=np.bool_(True)), TypeError,
     "return_lse must be a bool, got numpy.bool"),
    ("lce-empty-vocabulary", lambda: _lce(weight=r(0, 16)), ValueError, "weight"),
    # values are checked where that needs no synchronization: CPU tensors (CUDA: NaN for the token)
    *([("lce-target-out-of-range", lambda: _lce(target=torch.tensor([0, 1, 10, 2])), ValueError, "target")]
      if DEV.type == "cpu" else []),
    ("LinearCrossEntropy-in-features", _module(lambda: fused_block.LinearCrossEntropy(16, 10).to(DEV), r(4, 12),
                                               torch.zeros(4, dtype=torch.int64, device=DEV)), ValueError, "weight"),
    ("LinearCrossEntropy-softcap", lambda: fused_block.LinearCrossEntropy(16, 10, softcap=0.0), ValueError, "softcap"),
    ("LinearCrossEntropy-label-smoothing", lambda: fused_block.LinearCrossEntropy(16, 10, label_smoothing=2.0),
     ValueError, "label_smoothing"),
    ("LinearCrossEntropy-logits-options", _lce_head_logits_after_option_change, ValueError, "softcap"),
    # modules
    ("LayerNorm-2d-residual-shape", _module(lambda: fused_block.LayerNorm((4, 5)).to(DEV), r(2, 3, 4, 5), r(2, 3, 5, 4)),
     ValueError, "residual"),
    ("RMSNorm-2d-residual-shape", _module(lambda: fused_block.RMSNorm((4, 5)).to(DEV), r(2, 3, 4, 5), r(2, 3, 5, 4)),
     ValueError, "residual"),
    ("Encoder-int-src", _module(_enc, torch.ones(2, 6, 16, dtype=torch.int64, device=DEV)), TypeError, "src"),
    ("Encoder-src-dtype", _module(_enc, r(2, 6, 16, dtype=BF16)), TypeError, "src"),
    ("Encoder-src-device", _module(_enc, r(2, 6, 16, device=META)), ValueError, "src"),
    ("Encoder-is-causal-type", _module(_enc, r(2, 6, 16), is_causal="yes"), TypeError, "is_causal"),
    ("Encoder-is-causal-numpy-bool", _module(_enc, r(2, 6, 16), is_causal=np.bool_(True)), TypeError,
     "is_causal must be a bool, got numpy.bool"),
    ("Encoder-nhead-float", lambda: fused_block.TransformerEncoderLayer(16, np.float64(4), 32), ValueError, "nhead"),
    ("Encoder-rope-base", lambda: fused_block.TransformerEncoderLayer(16, 4, 32, rope=True, rope_base=0.0), ValueError,
     "rope_base"),
    ("Decoder-memory-dtype", _module(_dec, r(2, 6, 16), r(2, 5, 16, dtype=torch.float16)), TypeError, "memory"),
    ("Decoder-tgt-is-causal-type", _module(_dec, r(2, 6, 16), r(2, 5, 16), tgt_is_causal=1), TypeError,
     "tgt_is_causal"),
    ("MHA-key-dtype", lambda: _mha()(r(2, 6, 16), r(2, 5, 16, dtype=torch.float16), r(2, 5, 16), need_weights=False),
     TypeError, "key"),
    ("MHA-int-query", lambda: _mha()(*(torch.ones(2, 6, 16, dtype=torch.int64, device=DEV),) * 3, need_weights=False),
     TypeError, "query"),
    ("EncoderOnly-too-long", lambda: _models().EncoderOnly(_models().EncoderOnlyConfig(
        vocab_size=50, max_len=8, n_layer=1, n_head=2, d_model=32, dim_feedforward=64, dropout=0.0)).to(DEV)(
        torch.zeros(2, 10, dtype=torch.int64, device=DEV)), ValueError, "max_len"),
    ("EncoderDecoder-src-too-long", lambda: _models().EncoderDecoder(_models().EncoderDecoderConfig(
        vocab_size=50, max_len=8, n_encoder_layers=1, n_decoder_layers=1, n_head=2, d_model=32, dim_feedforward=64,
        dropout=0.0)).to(DEV)(torch.zeros(2, 10, dtype=torch.int64, device=DEV),
                              torch.zeros(2, 4, dtype=torch.int64, device=DEV)), ValueError, "src"),
    ("LayerNorm-shape", _module(lambda: fused_block.LayerNorm(16).to(DEV), r(4, 8)), ValueError, "x"),
    ("RMSNorm-shape", _module(lambda: fused_block.RMSNorm(16).to(DEV), r(4, 8)), ValueError, "x"),
    ("Linear-in-features", _module(lambda: fused_block.Linear(16, 8).to(DEV), r(4, 12)), ValueError, "weight"),
    ("MLP-d-model", _module(lambda: fused_block.MLP(16, 32).to(DEV), r(4, 12)), ValueError, "w1"),
    ("Encoder-nhead", lambda: fused_block.TransformerEncoderLayer(16, 5, 32), ValueError, "nhead"),
    ("Encoder-d-model", _module(_enc, r(2, 6, 12)), ValueError, "src"),
    ("Encoder-padding-shape", _module(_enc, r(2, 6, 16), src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device=DEV)),
     ValueError, "src_key_padding_mask"),
    ("Encoder-mask-shape", _module(_enc, r(2, 6, 16), src_mask=torch.zeros(5, 5, device=DEV)), ValueError, "src_mask"),
    ("Decoder-memory-d-model", _module(_dec, r(2, 6, 16), r(2, 5, 12)), ValueError, "memory"),
    ("Decoder-memory-padding", _module(_dec, r(2, 6, 16), r(2, 5, 16),
                                       memory_key_padding_mask=torch.zeros(2, 6, dtype=torch.bool, device=DEV)),
     ValueError, "memory_key_padding_mask"),
]


@pytest.mark.parametrize("name,call,exc,arg", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_is_rejected_before_any_launch(name, call, exc, arg):
    before = sum(common.LAUNCHES.values())
    with pytest.raises(exc, match=arg):
        call()
    assert sum(common.LAUNCHES.values()) == before, "a kernel was launched before the error"


# ---------------------------------------------------------------------------------------------
# special values
# ---------------------------------------------------------------------------------------------

def test_nan_and_inf_propagate_like_the_reference():
    x = r(3, 32)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    w = r(32)
    for op, ref in ((fused_block.add_layer_norm, reference.add_layer_norm),
                    (fused_block.add_rms_norm, reference.add_rms_norm)):
        out, _ = op(x, None, w)
        want, _ = ref(x.double(), None, w.double())
        assert torch.equal(torch.isnan(out), torch.isnan(want))
        torch.testing.assert_close(out[2].double(), want[2], atol=1e-5, rtol=1e-5)  # the clean row
    w, b = r(8, 32), r(8)
    y = fused_block.linear(x, w, b, "gelu")
    want = reference.linear(x.double(), w.double(), b.double(), "gelu")
    assert torch.equal(torch.isnan(y), torch.isnan(want)) and torch.equal(torch.isinf(y), torch.isinf(want))
    q = r(1, 1, 4, 16, dtype=BF16)
    k = r(1, 1, 4, 16, dtype=BF16)
    k[0, 0, 1, 0] = float("nan")  # a NaN score poisons every row that sees it
    out = fused_block.attention(q, k, k)
    want = reference.attention(q.double(), k.double(), k.double())
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out).all()
    v = r(1, 1, 4, 16, dtype=BF16)
    v[0, 0, 2, 3] = float("inf")  # an infinite value reaches every output that weighs it
    out = fused_block.attention(q, q, v)
    want = reference.attention(q.double(), q.double(), v.double())
    assert torch.equal(torch.isinf(out), torch.isinf(want)) and torch.equal(torch.isnan(out), torch.isnan(want))


def test_fully_masked_attention_rows_give_zero_and_finite_grads():
    q = r(2, 2, 5, 16, dtype=BF16).requires_grad_()
    k, v = (r(2, 2, 7, 16, dtype=BF16).requires_grad_() for _ in range(2))
    mask = torch.zeros(2, 7, dtype=torch.bool, device=DEV)
    mask[1] = True  # the second sequence is all padding
    out = fused_block.attention(q, k, v, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "attention", "linear", "mlp"])
def test_empty_inputs_give_empty_results_and_gradients(op):
    if op == "attention":
        args = [r(2, 2, 0, 16, dtype=BF16).requires_grad_(), r(2, 2, 5, 16, dtype=BF16).requires_grad_(),
                r(2, 2, 5, 16, dtype=BF16).requires_grad_()]
        out = fused_block.attention(*args)
    elif op in ("layer_norm", "rms_norm"):
        args = [r(0, 16).requires_grad_(), r(16).requires_grad_()]
        fn = fused_block.add_layer_norm if op == "layer_norm" else fused_block.add_rms_norm
        out = fn(args[0], None, args[1])[0]
    elif op == "linear":
        args = [r(0, 16).requires_grad_(), r(8, 16).requires_grad_(), r(8).requires_grad_()]
        out = fused_block.linear(*args, activation="gelu")
    else:
        args = [r(0, 16).requires_grad_(), r(32, 16).requires_grad_(), r(32).requires_grad_(),
                r(16, 32).requires_grad_(), r(16).requires_grad_()]
        out = fused_block.mlp(*args)
    assert out.numel() == 0
    grads = torch.autograd.grad(out.sum(), args, allow_unused=False)
    for a, g in zip(args, grads):
        assert g.shape == a.shape
        assert torch.equal(g, torch.zeros_like(g))
