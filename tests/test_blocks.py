"""Parity of the fused Transformer layers with torch's on the same weights.

Each case runs the same weights three ways: torch's layer in float64 (the oracle), torch's
layer in the test dtype (PyTorch's own error), and the fused layer in the test dtype. A block
chains about ten ops whose rounding points differ from torch's (fused adds, fp32 epilogues),
so the rule is ``err(fused) <= BLOCK_FACTOR * err(torch) + atol * max(1, |ref|)`` with the
per-dtype atol of ``tests/numerics.py``, checked on the output, the input gradients and every
parameter gradient. On CUDA fp32 runs the kernels in TF32 (about 1e-3 relative per product),
so fp32 then gets TF32's atol.

Shapes: d_model 32 with 2 heads gives head dim 16, the kernel's smallest; L = 9 and S = 7 are
not multiples of any block size, so every masked edge runs; batch 2 so that padding differs
per sequence. Everything is tiny because the suite runs through the Triton interpreter.
"""
import contextlib
import copy
import warnings
import zlib

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import fused_block
from fused_block import _backend, blocks
from fused_block.kernels import common
import numerics
import op_counting

BLOCK_FACTOR = 4.0
TF32_ATOL = 5e-3
D, H, FF, B, L, S = 32, 2, 64, 2, 9, 7


@pytest.fixture(autouse=True)
def seed(request):
    """Each test draws the same random weights and inputs whichever tests ran before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _atol(dtype, device):
    if dtype == torch.float32 and device.type == "cuda":
        return TF32_ATOL
    return numerics.ATOL[dtype]


def _assert_close(name, actual, ref64, baseline, dtype, device):
    scale = max(1.0, ref64.detach().abs().max().item())
    numerics.assert_close(name, actual, ref64, baseline, atol=_atol(dtype, device) * scale, factor=BLOCK_FACTOR)


def _padding(batch, n, device):
    """Bool (batch, n), True = padding: the first sequence loses its last 3 keys, the second none."""
    m = torch.zeros(batch, n, dtype=torch.bool, device=device)
    m[0, n - 3:] = True
    return m


def _causal(n, device, dtype=torch.float32):
    return nn.Transformer.generate_square_subsequent_mask(n, device=device, dtype=dtype)


def _run(layer, inputs, kwargs, grad_out):
    """Output and the gradients of every floating input and parameter (name -> tensor)."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    layer.zero_grad(set_to_none=True)
    out = layer(*inputs, **kwargs)
    out.backward(grad_out.to(out.dtype))
    grads = {f"input{i}.grad": t.grad for i, t in enumerate(inputs)}
    grads.update({f"{n}.grad": p.grad for n, p in layer.named_parameters()})
    return out, grads


def _three_ways(torch_layer, fused_layer, inputs, kwargs, dtype, device, mode="train"):
    """Compare fused (dtype) with torch (float64 oracle, dtype baseline) on the same weights."""
    torch_layer = torch_layer.to(device)
    fused_layer = fused_layer.to(device=device, dtype=dtype)
    fused_layer.load_state_dict(torch_layer.state_dict())
    ref = copy.deepcopy(torch_layer).double()
    base = copy.deepcopy(torch_layer).to(dtype)
    for m in (ref, base, fused_layer):
        m.train(mode == "train")
    cast = lambda d: {k: (v.to(d) if torch.is_tensor(v) and v.is_floating_point() else v)  # noqa: E731
                      for k, v in kwargs.items()}
    grad_out = numerics.randn(*inputs[0].shape, dtype=torch.float64, device=device)  # output: input0's shape
    out64, g64 = _run(ref, [t.double() for t in inputs], cast(torch.float64), grad_out)
    out_b, g_b = _run(base, [t.to(dtype) for t in inputs], cast(dtype), grad_out)
    out_f, g_f = _run(fused_layer, [t.to(dtype) for t in inputs], cast(dtype), grad_out)
    assert out_f.dtype == dtype
    _assert_close("output", out_f, out64, out_b, dtype, device)
    assert g_f.keys() == g64.keys()
    for name in g64:
        assert g_f[name] is not None, f"{name} is None"
        _assert_close(name, g_f[name], g64[name], g_b[name], dtype, device)


def _layers(kind, **kw):
    """A torch layer with fresh random weights and a fused layer of the same configuration."""
    kw.setdefault("dropout", 0.0)
    if kind == "encoder":
        t = nn.TransformerEncoderLayer(D, H, FF, **kw)
        f = fused_block.TransformerEncoderLayer(D, H, FF, **kw)
    else:
        t = nn.TransformerDecoderLayer(D, H, FF, **kw)
        f = fused_block.TransformerDecoderLayer(D, H, FF, **kw)
    _randomize(t)
    return t, f


def _randomize(layer):
    """Non-trivial norm weights and biases (torch initializes them to 1 and 0)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))


def _x(batch_first, n, device, width=D, batch=B):
    shape = (batch, n, width) if batch_first else (n, batch, width)
    return numerics.randn(*shape, dtype=torch.float32, device=device)


ENCODER_MASKS = {
    "none": lambda dev: {},
    "padding": lambda dev: {"src_key_padding_mask": _padding(B, L, dev)},
    "causal_hint": lambda dev: {"src_mask": _causal(L, dev), "is_causal": True},
    "causal_mask_and_padding": lambda dev: {"src_mask": _causal(L, dev), "src_key_padding_mask": _padding(B, L, dev)},
}


# ---------------------------------------------------------------------------------------------
# construction, parameters, state dicts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_same_parameters_initialization_and_state_dict_as_torch(kind):
    cls_t = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    cls_f = fused_block.TransformerEncoderLayer if kind == "encoder" else fused_block.TransformerDecoderLayer
    torch.manual_seed(0)
    t = cls_t(D, H)
    torch.manual_seed(0)
    f = cls_f(D, H)
    assert isinstance(f, cls_t)
    st, sf = t.state_dict(), f.state_dict()
    assert list(st) == list(sf)
    for k in st:  # same names, shapes and (same seed) values: torch's init, in torch's order
        assert torch.equal(st[k], sf[k]), k
    defaults = (f.linear1.out_features, f.dropout.p, f.norm1.eps, f.norm_first, f.self_attn.batch_first)
    assert defaults == (2048, 0.1, 1e-5, False, False)
    # state dicts load both ways
    _randomize(t)
    f.load_state_dict(t.state_dict())
    t2 = cls_t(D, H)
    t2.load_state_dict(f.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(t.state_dict().values(), t2.state_dict().values()))


def test_constructor_keywords_norm_and_num_kv_heads():
    f = fused_block.TransformerEncoderLayer(64, 4, 128, norm="rms", num_kv_heads=2, bias=False)
    assert isinstance(f.norm1, nn.RMSNorm) and isinstance(f.norm2, nn.RMSNorm)
    assert f.self_attn.in_proj_weight.shape == ((4 + 2 * 2) * 16, 64)
    assert f.self_attn.in_proj_bias is None and f.linear1.bias is None
    d = fused_block.TransformerDecoderLayer(64, 4, 128, num_kv_heads=1)
    assert d.multihead_attn.in_proj_weight.shape == ((4 + 2) * 16, 64)


# ---------------------------------------------------------------------------------------------
# parity with torch's layers
# ---------------------------------------------------------------------------------------------

# Pairwise coverage of norm_first x batch_first x mask x mode: every pair of values of any
# two axes appears in some case (the full product is 32 cases, too slow for the interpreter).
ENCODER_CASES = [
    (True, True, "padding", "train"),
    (True, False, "causal_hint", "eval"),
    (True, True, "causal_mask_and_padding", "eval"),
    (True, False, "none", "train"),
    (False, True, "none", "eval"),
    (False, False, "padding", "eval"),
    (False, True, "causal_hint", "train"),
    (False, False, "causal_mask_and_padding", "train"),
]


@pytest.mark.parametrize("norm_first, batch_first, mask, mode", ENCODER_CASES)
def test_encoder_matches_torch_fp32(norm_first, batch_first, mask, mode, device, launches):
    t, f = _layers("encoder", norm_first=norm_first, batch_first=batch_first)
    _three_ways(t, f, [_x(batch_first, L, device)], ENCODER_MASKS[mask](device), torch.float32, device, mode)
    # one attention forward and backward, two fused add+norms, QKV / out / FFN on the GEMM
    assert launches["attention_fwd"] == 1 and launches["attention_bwd"] == 1
    assert launches["add_norm_fwd"] == 2 and launches["add_norm_bwd"] == 2 and launches["matmul"] >= 4


@pytest.mark.parametrize("norm_first, dtype", [(True, torch.bfloat16), (False, torch.float16)])
def test_encoder_matches_torch_low_precision(norm_first, dtype, device, launches):
    t, f = _layers("encoder", norm_first=norm_first, batch_first=True, activation="gelu")
    kwargs = {"src_mask": _causal(L, device), "is_causal": True, "src_key_padding_mask": _padding(B, L, device)}
    _three_ways(t, f, [_x(True, L, device)], kwargs, dtype, device)
    assert launches["attention_fwd"] == 1


DECODER_MASKS = {
    "none": lambda dev: {},
    "causal_and_padding": lambda dev: {"tgt_mask": _causal(L, dev), "tgt_is_causal": True,
                                       "tgt_key_padding_mask": _padding(B, L, dev),
                                       "memory_key_padding_mask": _padding(B, S, dev)},
}


@pytest.mark.parametrize("norm_first, batch_first, mask, mode", [
    (True, True, "causal_and_padding", "train"),
    (True, False, "none", "eval"),
    (False, True, "none", "train"),
    (False, False, "causal_and_padding", "eval"),
])
def test_decoder_matches_torch_fp32(norm_first, batch_first, mask, mode, device, launches):
    t, f = _layers("decoder", norm_first=norm_first, batch_first=batch_first)
    inputs = [_x(batch_first, L, device), _x(batch_first, S, device)]
    _three_ways(t, f, inputs, DECODER_MASKS[mask](device), torch.float32, device, mode)
    assert launches["attention_fwd"] == 2 and launches["add_norm_fwd"] == 3


def test_decoder_general_masks_run_the_kernel(device, launches):
    """A random bool tgt_mask (every query keeps its own key) and a float memory_mask (cross
    attention, L != S) reach the kernels, as the bool mask and as a bias: both attentions
    launch, no SDPA."""
    t, f = _layers("decoder", norm_first=True, batch_first=True)
    tgt = torch.rand(L, L, device=device) < 0.3
    tgt[torch.arange(L), torch.arange(L)] = False  # torch's bool masks: True = masked out
    mem = torch.randn(L, S, device=device)
    inputs = [_x(True, L, device), _x(True, S, device)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _three_ways(t, f, inputs, {"tgt_mask": tgt, "memory_mask": mem}, torch.float32, device)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


def _hidden(n, m, device):
    """A random bool (n, m) attention mask (True = masked) that leaves every query its first key."""
    mask = torch.rand(n, m, device=device) < 0.3
    mask[:, 0] = False
    return mask


@pytest.mark.parametrize("self_bf, cross_bf, norm_first, batched, dtype", [
    (True, False, True, True, torch.float32),
    (False, True, False, True, torch.bfloat16),
    (True, False, False, True, torch.float16),
    (False, True, True, False, torch.float32),  # unbatched: one sequence to both attentions
])
def test_converted_decoder_with_two_batch_first_flags(self_bf, cross_bf, norm_first, batched, dtype, device,
                                                      launches):
    """A converted torch decoder layer whose multihead_attn.batch_first a user set apart from
    self_attn's: each attention reads its inputs by its own flag, as in torch's layer, so
    cross-attention takes tgt's batch as its sequence and memory in its own layout (here
    (S, L, E) or (L, S, E): its batch is tgt's L). GELU: see test_decoder_matches_torch_bf16."""
    t = nn.TransformerDecoderLayer(D, H, FF, 0.0, "gelu", batch_first=self_bf, norm_first=norm_first)
    t.multihead_attn.batch_first = cross_bf
    _randomize(t)
    f = fused_block.convert(copy.deepcopy(t))
    assert f.self_attn.batch_first is self_bf and f.multihead_attn.batch_first is cross_bf
    if batched:
        tgt = _x(self_bf, L, device)  # to cross-attention: a batch of L, B queries each
        memory = _x(cross_bf, S, device, batch=L)
        kwargs = {"tgt_key_padding_mask": _padding(B, L, device), "memory_key_padding_mask": _padding(L, S, device),
                  "memory_mask": _hidden(B, S, device)}
    else:
        tgt, memory = (numerics.randn(n, D, dtype=torch.float32, device=device) for n in (L, S))
        kwargs = {"memory_key_padding_mask": _padding(1, S, device)[0], "memory_mask": _hidden(L, S, device)}
    _three_ways(t, f, [tgt, memory], kwargs, dtype, device)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


def test_decoder_matches_torch_bf16(device):
    # GELU, not ReLU: a bf16 pre-activation within rounding of 0 may take the other side of
    # ReLU's kink than the float64 oracle's (unrounded weights), moving a whole token's share
    # of linear1's gradient; that is rounding, not the layer.
    t, f = _layers("decoder", norm_first=False, batch_first=True, activation="gelu")
    inputs = [_x(True, L, device), _x(True, S, device)]
    _three_ways(t, f, inputs, DECODER_MASKS["causal_and_padding"](device), torch.bfloat16, device)


def test_causal_mask_without_hint_is_detected(device, launches):
    """A float causal src_mask with is_causal=False (bool too) runs the causal kernel, no fallback."""
    t, f = _layers("encoder", norm_first=True, batch_first=True)
    bool_causal = torch.ones(L, L, dtype=torch.bool, device=device).triu(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _three_ways(t, f, [_x(True, L, device)], {"src_mask": bool_causal}, torch.float32, device)
    assert launches["attention_fwd"] == 1


def test_is_causal_without_mask(device):
    """Unlike torch (which needs the mask beside the hint), is_causal=True alone is enough."""
    t, f = _layers("encoder", norm_first=False, batch_first=True)
    f = f.to(device)
    f.load_state_dict(t.state_dict())
    x = _x(True, L, device)
    with torch.no_grad():
        expected = t.to(device)(x, src_mask=_causal(L, device), is_causal=True)
        torch.testing.assert_close(f(x, is_causal=True), expected, atol=_atol(torch.float32, device) * 4, rtol=0)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_is_causal_alone_in_the_unfused_forward_with_sequence_first_inputs(kind, device, launches):
    """A layer running torch's forward (a hook on linear1) with (L, B, E) inputs and the causal
    hint alone: the causal mask torch's attention wants is (L, L), not (B, B); the fused path's
    answer, after the fallback's warning."""
    f = _layers(kind, batch_first=False)[1].to(device)
    x, mem = _x(False, L, device, batch=B + 1), _x(False, L + 2, device, batch=B + 1)
    args, kw = ((x,), {"is_causal": True}) if kind == "encoder" else ((x, mem), {"tgt_is_causal": True})
    with torch.no_grad():
        want = f(*args, **kw)
        f.linear1.register_forward_hook(lambda m, i, o: None)
        with pytest.warns(UserWarning, match="hook"):
            got = f(*args, **kw)
    torch.testing.assert_close(got, want, atol=_atol(torch.float32, device) * 4, rtol=0)


def test_module_activation_survives_copy_and_load(device, launches):
    """A decoder layer whose activation is a submodule (the tanh GELU of activation="gelu_tanh")
    keeps it through deepcopy and torch.save/load (torch's decoder layer's __setstate__ would
    set F.relu over it)."""
    import io

    f = fused_block.TransformerDecoderLayer(D, H, FF, dropout=0.0, activation="gelu_tanh", batch_first=True)
    f = f.to(device)
    x, mem = _x(True, L, device), _x(True, L + 2, device)
    buffer = io.BytesIO()
    torch.save(f, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        want = f(x, mem)
        for other in (copy.deepcopy(f), loaded):
            assert isinstance(other.activation, nn.GELU)
            torch.testing.assert_close(other(x, mem), want, atol=0, rtol=0)


def test_a_gelu_module_changed_in_place_is_followed(device, launches):
    """An ``nn.GELU`` activation whose ``approximate`` is set in place after a forward: the
    fused layer runs the new form, as torch's layer does (the epilogue's name was cached by
    the module's identity alone and kept erf's)."""
    t, f = _layers("encoder", norm_first=True, batch_first=True, activation=nn.GELU())
    with torch.no_grad():  # every pre-activation 2.7, where the forms differ most (4.7e-4), summed FF times
        t.linear1.weight.zero_()
        t.linear1.bias.fill_(2.7)
        t.linear2.weight.fill_(1.0)
    t, f = t.to(device), f.to(device)
    f.load_state_dict(t.state_dict())
    x = _x(True, L, device)
    with torch.no_grad():
        erf = f(x)
        t.activation.approximate = f.activation.approximate = "tanh"
        got, want = f(x), t(x)
    diff, err = float((want - erf).abs().max()), float((got - want).abs().max())
    assert diff > 0.01 and err < 0.1 * diff, (diff, err)
    assert launches["attention_fwd"] == 2


@pytest.mark.parametrize("L_q,S", [(3, 9), (7, 1)])
def test_is_causal_alone_with_other_key_length_is_torchs_causal_mask(L_q, S, device, launches):
    """MultiheadAttention(is_causal=True) without masks where the keys outnumber the queries or
    the other way round: torch's meaning of the hinted causal mask (``ones(L, S).triu(1)``,
    top-left), not the kernel's bottom-right alignment (which would hide every key from the
    first L - S queries)."""
    torch.manual_seed(0)
    t = nn.MultiheadAttention(32, 2, device=device)
    f = fused_block.MultiheadAttention(32, 2, device=device)
    f.load_state_dict(t.state_dict())
    q, kv = torch.randn(L_q, 2, 32, device=device), torch.randn(S, 2, 32, device=device)
    causal = torch.ones(L_q, S, dtype=torch.bool, device=device).triu(1)
    with torch.no_grad():
        want, _ = t(q, kv, kv, need_weights=False, attn_mask=causal, is_causal=True)
        got, _ = f(q, kv, kv, need_weights=False, is_causal=True)
    torch.testing.assert_close(got, want, atol=_atol(torch.float32, device) * 4, rtol=0)
    assert launches["attention_fwd"] == 1


@pytest.mark.parametrize("kind", ["random_float", "per_head_3d_bool", "float_padding"])
def test_general_masks_run_the_kernel_with_a_bias(kind, device, launches, monkeypatch):
    """Masks the causal and padding flags cannot express reach the kernel, a bool mask as its
    bool ``mask``, the others as one merged additive bias (torch's own merge): no SDPA
    fallback, no warning."""
    monkeypatch.setattr(_backend, "WARNED", set())
    t, f = _layers("encoder", norm_first=True, batch_first=True)
    if kind == "random_float":
        kwargs = {"src_mask": torch.randn(L, L, device=device)}
    elif kind == "per_head_3d_bool":
        m = torch.rand(B * H, L, L, device=device) < 0.3
        m[:, torch.arange(L), torch.arange(L)] = False  # every query keeps a key (no NaN rows in torch)
        kwargs = {"src_mask": m}
    else:
        kpm = torch.zeros(B, L, device=device)
        kpm[0, -2:] = -1.5  # finite additive values are not padding
        kwargs = {"src_key_padding_mask": kpm}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _three_ways(t, f, [_x(True, L, device)], kwargs, torch.float32, device)
    assert launches["attention_fwd"] >= 1


# Every dtype with the bool mask; its float form and the per-head one once each (interpreter time).
@pytest.mark.parametrize("kind,dtype", [
    pytest.param("bool", torch.float32, id="bool-fp32"), pytest.param("bool", torch.float16, id="bool-fp16"),
    pytest.param("bool", torch.bfloat16, id="bool-bf16"),
    pytest.param("float_0_neg_inf", torch.float32, id="float-fp32"),
    pytest.param("per_head_3d_bool", torch.bfloat16, id="per-head-bf16")])
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the NaN tokens' own rows
def test_block_diagonal_src_mask_skips_hidden_blocks(kind, dtype, device, launches):
    """A block-diagonal src_mask (tokens 0..63 and 64..95 in chunks of their own; bool, its 0 /
    -inf float form, or per head) reaches the kernel as its bool mask, whose summary skips the
    key (and, backward, query) blocks it hides: with NaN inputs at tokens 64..95 the outputs of
    tokens 0..63 and their input gradients are finite and equal those of the layer on tokens
    0..63 alone. As a merged float bias the hidden tiles were read (probability 0 times NaN)."""
    n, chunk = 96, 64  # 64: a multiple of every interpreter block
    f = fused_block.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True, norm_first=True)
    f = f.to(device=device, dtype=dtype)
    i = torch.arange(n, device=device)
    hidden = i[:, None] // chunk != i[None, :] // chunk  # torch's convention: True = masked out
    masks = {"bool": hidden, "per_head_3d_bool": hidden.expand(H, n, n),  # batch 1: (B * H, L, L)
             "float_0_neg_inf": torch.zeros(n, n, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))}
    mask = masks[kind]
    x = numerics.randn(1, n, D, dtype=dtype, device=device)
    x[:, chunk:] = float("nan")
    x.requires_grad_(True)
    dout = numerics.randn(1, chunk, D, dtype=dtype, device=device)
    out = f(x, src_mask=mask)
    dx, = torch.autograd.grad(out[:, :chunk], (x,), dout)
    x0 = x.detach()[:, :chunk].clone().requires_grad_(True)
    out0 = f(x0, src_mask=mask[..., :chunk, :chunk])
    dx0, = torch.autograd.grad(out0, (x0,), dout)
    torch.testing.assert_close(out[:, :chunk], out0)
    torch.testing.assert_close(dx[:, :chunk], dx0)
    assert launches["attention_fwd"] == 2 and launches["attention_bwd"] == 2


@pytest.mark.parametrize("init", ["zeros", "causal"])
def test_a_learned_mask_gets_its_gradient_whatever_its_values(init, device, launches):
    """A float mask that requires a gradient (a learned attention bias, zero-initialized as
    usual, or at the causal pattern) is the kernel's additive bias, never read as "masks
    nothing" / "causal" and dropped: its gradient is torch's (src_mask, a float key padding
    mask, a decoder's memory_mask)."""
    t, f = _layers("decoder", norm_first=True, batch_first=True)
    f.load_state_dict(t.state_dict())
    f = f.to(device)
    t = t.to(device)
    ref = copy.deepcopy(t).double()
    tgt, mem = _x(True, L, device), _x(True, S, device)
    grad_out = numerics.randn(*tgt.shape, dtype=torch.float64, device=device)
    masks = dict(tgt_mask=torch.zeros(L, L, device=device) if init == "zeros" else _causal(L, device),
                 memory_mask=torch.zeros(L, S, device=device),
                 tgt_key_padding_mask=torch.zeros(B, L, device=device))
    grads = {}
    for name, layer, dtype in (("ref", ref, torch.float64), ("base", t, torch.float32), ("fused", f, torch.float32)):
        kw = {k: m.to(dtype).requires_grad_() for k, m in masks.items()}
        out = layer(tgt.to(dtype), mem.to(dtype), **kw)
        grads[name] = torch.autograd.grad(out, list(kw.values()), grad_out.to(dtype))
    for k, g64, gb, gf in zip(masks, *grads.values()):
        seen = torch.isfinite(g64)  # (torch's gradient at a -inf entry: 0, or NaN)
        assert gf is not None and bool(torch.isfinite(gf).all()), k
        _assert_close(k, gf[seen], g64[seen], gb[seen], torch.float32, device)
        assert float(g64[seen].abs().max()) > 0, k  # the test discriminates
    assert launches["attention_bwd"] == 2 and launches["attention_dbias"] == 2


def _saturating_masks(kind, device):
    """Float masks at fp32's ``finfo.min`` (Hugging Face's masking value) hiding every key of
    some query rows: ``(kwargs, rows)``, rows (B, L) True where a query sees no key."""
    low = torch.finfo(torch.float32).min
    rows = torch.zeros(B, L, dtype=torch.bool, device=device)
    kw = {}
    if kind in ("src_mask", "both", "decoder"):
        m = torch.zeros(L, S if kind == "decoder" else L, device=device)
        m[2] = low          # query 2 sees no key
        m[4, :3] = low      # query 4 sees some: an ordinary row
        m[5, :2] = float("-inf")
        m[5, 2:] = low      # query 5: its finfo.min keys share the weight, the -inf ones get none
        rows[:, [2, 5]] = True
        kw["memory_mask" if kind == "decoder" else "src_mask"] = m
    if kind in ("padding", "both"):
        kpm = torch.zeros(B, L, device=device)
        kpm[1] = low        # the second sequence has no key at all
        rows[1] = True
        kw["src_key_padding_mask"] = kpm  # with src_mask: summed, torch's merge (finfo.min twice: -inf)
    return kw, rows


@pytest.mark.parametrize("kind", ["src_mask", "padding", "both", "decoder"])
def test_rows_that_see_no_key_through_finfo_min_match_torch(kind, device, launches):
    """A float mask at ``finfo.min`` (not -inf) hiding every key of a query row: torch's
    softmax sees equal scores there (``score + finfo.min`` rounds to ``finfo.min``) and gives the
    mean of V over those keys, where the kernel, which takes such a bias as -inf, gives 0; the
    layers set those rows to torch's value. With the rows' output gradient zero every gradient
    is torch's; with only theirs, V's (its projection's rows and the out-projection) is that of
    torch's softmax (SDPA's math backend: the CPU flash kernel's backward rebuilds each weight
    from a log-sum-exp that rounds to ``finfo.min`` itself, weighing every such key 1, not
    1 / count), and torch's autograd also differentiates the absorbed scores (q and k): those
    terms are documented, not reproduced."""
    t, f = _layers(kind if kind == "decoder" else "encoder", norm_first=kind != "padding", batch_first=True)
    t, f = t.to(device), f.to(device)
    f.load_state_dict(t.state_dict())
    kw, rows = _saturating_masks(kind, device)
    inputs = [_x(True, L, device)] + ([_x(True, S, device)] if kind == "decoder" else [])
    ref, base = copy.deepcopy(t).double(), t
    ref_kw = {k: m.double() for k, m in kw.items()}
    if kind == "both":  # torch's merge in fp32 (finfo.min twice: -inf), for the float64 oracle too
        merged = kw["src_mask"] + kw["src_key_padding_mask"][:, None, :]
        ref_kw = {"src_mask": merged.repeat_interleave(H, 0).double()}
    g = numerics.randn(B, L, D, dtype=torch.float64, device=device)
    attn = "multihead_attn." if kind == "decoder" else "self_attn."  # the masked attention
    for grad_out, every in ((g.masked_fill(rows[..., None], 0), True), (g.masked_fill(~rows[..., None], 0), False)):
        with sdpa_kernel(SDPBackend.MATH):
            ref_out, g64 = _run(ref, [x.double() for x in inputs], ref_kw, grad_out)
            base_out, g_b = _run(base, inputs, kw, grad_out)
        out, g_f = _run(f, inputs, kw, grad_out)
        _assert_close("output", out, ref_out, base_out, torch.float32, device)
        # The test discriminates: the rows are torch's mean of V (not 0), and the oracle is torch's.
        assert float((ref_out - ref_out.masked_fill(rows[..., None], 0)).abs().max()) > 0.1
        assert float((base_out - ref_out).abs().max()) < 1e-4
        for name in g64:
            if every or name.startswith(attn + "out_proj"):
                _assert_close(name, g_f[name], g64[name], g_b[name], torch.float32, device)
            elif name.startswith(attn + "in_proj"):  # V's rows
                _assert_close(name, g_f[name][2 * D:], g64[name][2 * D:], g_b[name][2 * D:], torch.float32, device)
    assert launches["attention_fwd"] >= 2


@pytest.mark.parametrize("kind", ["src_mask", "padding"])
def test_float64_rows_that_see_no_key_through_its_finfo_min_match_torch(kind, device):
    """A float64 layer (the reference path) with float64's ``finfo.min`` (~-1.8e308) hiding
    every key of some rows: torch's rows are the mean of V there, as in fp32. The rows were 0:
    their bias, cast to fp32 to find them, was -inf (below fp32's range). The rows' output
    gradient zero: every gradient is torch's; only theirs: V's and the out-projection's."""
    t, f = _layers("encoder", batch_first=True)
    t, f = t.to(device).double(), f.to(device).double()
    f.load_state_dict(t.state_dict())
    kw, rows = _saturating_masks(kind, device)
    kw = {k: m.double().masked_fill(m == torch.finfo(torch.float32).min, torch.finfo(torch.float64).min)
          for k, m in kw.items()}
    x = _x(True, L, device).double()
    g = numerics.randn(B, L, D, dtype=torch.float64, device=device)
    for grad_out, every in ((g.masked_fill(rows[..., None], 0), True), (g.masked_fill(~rows[..., None], 0), False)):
        with sdpa_kernel(SDPBackend.MATH):
            want, g_t = _run(t, [x], kw, grad_out)
        got, g_f = _run(f, [x], kw, grad_out)
        assert float((want - want.masked_fill(rows[..., None], 0)).abs().max()) > 0.1  # torch's rows are not 0
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        for name in g_t:
            if every or name.startswith("self_attn.out_proj"):
                torch.testing.assert_close(g_f[name], g_t[name], rtol=1e-9, atol=1e-9, msg=name)
            elif name.startswith("self_attn.in_proj"):  # V's rows
                torch.testing.assert_close(g_f[name][2 * D:], g_t[name][2 * D:], rtol=1e-9, atol=1e-9, msg=name)


def test_float_padding_mask_of_zeros_and_neg_inf_uses_kernel(device, launches):
    """nn.TransformerEncoder hands its layers float (0 / -inf) padding masks."""
    t, f = _layers("encoder", norm_first=False, batch_first=True)
    kpm = torch.zeros(B, L, device=device).masked_fill(_padding(B, L, device), float("-inf"))
    _three_ways(t, f, [_x(True, L, device)], {"src_key_padding_mask": kpm}, torch.float32, device)
    assert launches["attention_fwd"] == 1


def test_head_dim_outside_kernel_range_falls_back(device, launches, monkeypatch):
    monkeypatch.setattr(_backend, "WARNED", set())
    t = nn.TransformerEncoderLayer(D, 4, FF, 0.0, batch_first=True)  # head dim 8
    f = fused_block.TransformerEncoderLayer(D, 4, FF, 0.0, batch_first=True)
    with pytest.warns(UserWarning, match="head dim 8"):
        _three_ways(t, f, [_x(True, L, device)], {"src_key_padding_mask": _padding(B, L, device)},
                    torch.float32, device)
    assert launches["attention_fwd"] == 0 and launches["matmul"] > 0


def test_fp32_head_dim_beyond_the_fp32_kernels_falls_back(device, launches, monkeypatch):
    """fp32 attention kernels take head dims up to 128: a 136-wide fp32 head runs SDPA."""
    monkeypatch.setattr(_backend, "WARNED", set())
    t = nn.TransformerEncoderLayer(136, 1, FF, 0.0, batch_first=True)
    f = fused_block.TransformerEncoderLayer(136, 1, FF, 0.0, batch_first=True)
    x = numerics.randn(B, L, 136, dtype=torch.float32, device=device)
    with pytest.warns(UserWarning, match="head dim 136"):
        _three_ways(t, f, [x], {}, torch.float32, device)
    assert launches["attention_fwd"] == 0 and launches["matmul"] > 0


def test_eval_inference_matches_torch_fast_path(device):
    """torch's eval/no-grad fast path (fused native kernel) against the fused layer."""
    t, f = _layers("encoder", norm_first=False, batch_first=True)
    t, f = t.to(device).eval(), f.to(device).eval()
    f.load_state_dict(t.state_dict())
    x = _x(True, L, device)
    with torch.inference_mode():
        expected = t(x)
        actual = f(x)
    torch.testing.assert_close(actual, expected, atol=_atol(torch.float32, device) * 4, rtol=0)


def test_unbatched_input(device):
    t, f = _layers("decoder", norm_first=True, batch_first=False)
    t, f = t.to(device), f.to(device)
    f.load_state_dict(t.state_dict())
    x = numerics.randn(L, D, dtype=torch.float32, device=device)
    mem = numerics.randn(S, D, dtype=torch.float32, device=device)
    kpm = torch.zeros(S, dtype=torch.bool, device=device)
    kpm[-2:] = True
    with torch.no_grad():
        torch.testing.assert_close(f(x, mem, memory_key_padding_mask=kpm), t(x, mem, memory_key_padding_mask=kpm),
                                   atol=_atol(torch.float32, device) * 4, rtol=0)


def test_float64_runs_the_reference(device):
    t, f = _layers("encoder", norm_first=True, batch_first=True)
    t, f = t.double().to(device), f.double().to(device)
    f.load_state_dict(t.state_dict())
    x = _x(True, L, device).double()
    kpm = _padding(B, L, device)
    torch.testing.assert_close(f(x, src_key_padding_mask=kpm), t(x, src_key_padding_mask=kpm), atol=1e-12, rtol=0)


def _norms_as_cuda_autocast(layer):
    """torch's layer as CUDA's autocast runs it on any device: each LayerNorm in fp32 (input,
    weight and bias cast: the CPU's autocast leaves layer_norm in the input's dtype)."""
    for m in layer.modules():
        if isinstance(m, nn.LayerNorm):
            m.forward = lambda x, m=m: torch.nn.functional.layer_norm(x.float(), m.normalized_shape, m.weight.float(),
                                                                      m.bias.float(), m.eps)
    return layer


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", numerics.DTYPES, ids=str)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-ln", "pre-ln"])
def test_converted_layer_follows_cuda_autocast_norms(norm_first, dtype, device, launches, cuda_autocast_norms):
    """A converted nn.TransformerEncoderLayer under autocast whose policy runs the norms in fp32
    (CUDA's; emulated on the CPU) against the unconverted layer computed the CUDA way, and on
    CUDA against torch's layer under torch.autocast('cuda') itself: Post-LN with a 16-bit input
    (src) makes the residual stream fp32 after norm1 and returns fp32, as torch's does (the
    norm's output is the stream); Pre-LN's norm outputs only feed GEMMs, which autocast rounds
    to its dtype, so it is unchanged (16-bit output for a 16-bit src). Output and every gradient
    against the float64 layer, the torch layer the baseline; gradients in its dtypes."""
    lowp = torch.bfloat16 if dtype == torch.float32 else dtype
    t, _ = _layers("encoder", norm_first=norm_first, batch_first=True, activation="gelu")
    t = t.to(device)
    f = fused_block.convert(copy.deepcopy(t))
    assert isinstance(f, blocks.TransformerEncoderLayer)
    ref = copy.deepcopy(t).double()
    baselines = {"as CUDA's autocast computes": _norms_as_cuda_autocast(copy.deepcopy(t))}
    if device.type == "cuda":
        baselines["torch's layer under torch.autocast('cuda')"] = copy.deepcopy(t)
    src = _x(True, L, device).to(dtype)
    grad_out = numerics.randn(*src.shape, dtype=torch.float64, device=device)
    out64, g64 = _run(ref, [src.double()], {}, grad_out)
    with torch.autocast(device.type, dtype=lowp):
        out_f, g_f = _run(f, [src], {}, grad_out)
    assert out_f.dtype == (dtype if norm_first else torch.float32)
    assert launches["add_norm_fwd"] == 2
    for label, layer in baselines.items():
        with torch.autocast(device.type, dtype=lowp):
            out_b, g_b = _run(layer, [src], {}, grad_out)
        assert out_b.dtype == out_f.dtype, label
        _assert_close(f"output vs {label}", out_f, out64, out_b, lowp, device)
        assert g_f.keys() == g64.keys()
        for name in g64:
            assert g_f[name].dtype == g_b[name].dtype, (label, name)
            _assert_close(f"{name} vs {label}", g_f[name], g64[name], g_b[name], lowp, device)


# ---------------------------------------------------------------------------------------------
# scalar arguments as torch's layers take them: numpy scalars, layer_norm_eps = 0
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, dtype", [("encoder", torch.float32), ("decoder", torch.bfloat16),
                                         ("encoder", torch.float16)])
def test_numpy_constructor_arguments(kind, dtype, device, launches):
    """Sizes (numpy int64, int32), dropout (float64), layer_norm_eps (float32) and flags (numpy's
    bool), as torch's layers take them: the fused layer keeps Python scalars (its kernels never
    see numpy's) and matches torch's layer built from the Python values."""
    eps, norm_first = np.float32(1e-5), kind == "encoder"
    t, _ = _layers(kind, batch_first=True, norm_first=norm_first, layer_norm_eps=float(eps))
    cls = fused_block.TransformerEncoderLayer if kind == "encoder" else fused_block.TransformerDecoderLayer
    f = cls(np.int64(D), np.int32(H), np.int64(FF), dropout=np.float64(0.0), layer_norm_eps=eps,
            batch_first=np.bool_(True), norm_first=np.bool_(norm_first))
    attn = f.self_attn
    assert [type(v) for v in (attn.embed_dim, attn.num_heads, attn.num_kv_heads, attn.dropout, f.norm1.eps,
                              f.dropout1.p, f.linear2.in_features)] == [int, int, int, float, float, float, int]
    assert attn.batch_first is True and f.norm_first is norm_first
    inputs = [_x(True, L, device)] + ([_x(True, S, device)] if kind == "decoder" else [])
    _three_ways(t, f, inputs, {}, dtype, device)
    norms = 2 if kind == "encoder" else 3
    assert launches["add_norm_fwd"] == norms and launches["add_norm_bwd"] == norms
    assert launches["attention_fwd"] == norms - 1


@pytest.mark.parametrize("norm, dtype", [("layer", torch.float32), ("rms", torch.bfloat16), ("layer", torch.float16)])
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the norm kernels' padding rows (masked)
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_convert_with_layer_norm_eps_zero(norm, dtype, device, launches):
    """convert() of torch's layer whose norms have eps = 0 (torch takes it; LayerNorm from
    ``layer_norm_eps=0``, or RMSNorm) matches torch's layer: the fused norms run at eps = 0.
    (GELU as in the low-precision tests above: at ReLU's kink a 16-bit pre-activation rounded
    to the other side of 0 flips a hidden unit's gradient, in either implementation.)"""
    t = nn.TransformerEncoderLayer(D, H, FF, 0.0, "gelu", layer_norm_eps=0, batch_first=True, norm_first=True)
    if norm == "rms":
        t.norm1, t.norm2 = nn.RMSNorm(D, eps=0.0), nn.RMSNorm(D, eps=0.0)
    _randomize(t)
    f = fused_block.convert(copy.deepcopy(t))
    assert type(f) is fused_block.TransformerEncoderLayer and f.norm1.eps == 0
    _three_ways(t, f, [_x(True, L, device)], {"src_key_padding_mask": _padding(B, L, device)}, dtype, device)
    assert launches["add_norm_fwd"] == 2 and launches["add_norm_bwd"] == 2


# ---------------------------------------------------------------------------------------------
# added features: RMSNorm, GQA, dropout
# ---------------------------------------------------------------------------------------------

def test_rms_norm_matches_torch_layer_with_rms_norms(device):
    t = nn.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True, norm_first=True)
    t.norm1, t.norm2 = nn.RMSNorm(D, eps=1e-5), nn.RMSNorm(D, eps=1e-5)  # torch's forward calls norm1(x)
    _randomize(t)
    f = fused_block.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True, norm_first=True, norm="rms")
    _three_ways(t, f, [_x(True, L, device)], {"src_key_padding_mask": _padding(B, L, device)}, torch.float32, device)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_gqa_equals_mha_with_repeated_kv_weights(kind, device, launches):
    """num_kv_heads=1 with 2 query heads equals torch's MHA whose k/v rows are repeated per group."""
    kw = dict(dropout=0.0, batch_first=True, norm_first=(kind == "encoder"))
    cls_t, cls_f = ((nn.TransformerEncoderLayer, fused_block.TransformerEncoderLayer) if kind == "encoder"
                    else (nn.TransformerDecoderLayer, fused_block.TransformerDecoderLayer))
    f = cls_f(D, H, FF, num_kv_heads=1, **kw)
    t = cls_t(D, H, FF, **kw)
    _randomize(f)
    state = dict(f.state_dict())
    hd = D // H
    for prefix in ("self_attn", "multihead_attn") if kind == "decoder" else ("self_attn",):
        for suffix in ("weight", "bias"):
            w = state[f"{prefix}.in_proj_{suffix}"]
            q, k, v = w[:D], w[D:D + hd], w[D + hd:]
            state[f"{prefix}.in_proj_{suffix}"] = torch.cat([q, k.repeat(H, *[1] * (k.dim() - 1)),
                                                             v.repeat(H, *[1] * (v.dim() - 1))])
    t.load_state_dict(state)
    t, f = t.to(device), f.to(device)
    x = [_x(True, L, device)] + ([_x(True, S, device)] if kind == "decoder" else [])
    kwargs = {"src_key_padding_mask": _padding(B, L, device)} if kind == "encoder" else {}
    with torch.no_grad():
        torch.testing.assert_close(f(*x, **kwargs), t(*x, **kwargs), atol=_atol(torch.float32, device) * 4, rtol=0)
    assert launches["attention_fwd"] >= 1


# ---------------------------------------------------------------------------------------------
# LLaMA-style layers: RMSNorm, RoPE, GQA, SwiGLU, no biases (torch has no such layer: the oracle
# is the same layer in float64, which runs fused_block.reference; PyTorch's own error is that
# reference run in the test dtype)
# ---------------------------------------------------------------------------------------------

def _llama_layer(kind, batch_first, interleaved=False):
    cls = fused_block.TransformerEncoderLayer if kind == "encoder" else fused_block.TransformerDecoderLayer
    torch.manual_seed(0)
    layer = cls(D, H, FF, dropout=0.0, activation="swiglu", batch_first=batch_first, norm_first=True, bias=False,
                norm="rms", num_kv_heads=1, rope=True, rope_interleaved=interleaved)
    _randomize(layer)
    return layer


def _against_reference(layer, inputs, kwargs, dtype, device, monkeypatch):
    """The layer (dtype) against itself in float64 on the reference ops, with the reference
    ops in dtype as the baseline: output, input gradients and every parameter gradient."""
    layer = layer.to(device)
    grad_out = numerics.randn(*inputs[0].shape, dtype=torch.float64, device=device)
    out64, g64 = _run(copy.deepcopy(layer).double(), [t.double() for t in inputs], kwargs, grad_out)
    out_f, g_f = _run(copy.deepcopy(layer).to(dtype), [t.to(dtype) for t in inputs], kwargs, grad_out)
    with monkeypatch.context() as m:
        m.setattr(blocks, "_ops", lambda x: blocks._REFERENCE)
        out_b, g_b = _run(copy.deepcopy(layer).to(dtype), [t.to(dtype) for t in inputs], kwargs, grad_out)
    assert out_f.dtype == dtype
    _assert_close("output", out_f, out64, out_b, dtype, device)
    assert g_f.keys() == g64.keys()
    for name in g64:
        _assert_close(name, g_f[name], g64[name], g_b[name], dtype, device)


def test_llama_layer_dropout_one_keeps_only_the_residual_stream(device, launches):
    """A Pre-LN SwiGLU layer with dropout=1.0 in training (the hidden dropout then runs
    between the GEMMs, after the gated activation): both sublayers add exact zeros, so the
    output is the input, its gradient the incoming one, and every parameter's gradient zero."""
    torch.manual_seed(0)
    layer = fused_block.TransformerEncoderLayer(D, H, FF, dropout=1.0, activation="swiglu", batch_first=True,
                                                norm_first=True, bias=False, norm="rms", num_kv_heads=1,
                                                rope=True).to(device)
    _randomize(layer)
    x = _x(True, L, device).requires_grad_()
    y = layer(x)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *layer.parameters()], dy)
    assert torch.equal(y, x) and torch.equal(grads[0], dy)
    for (name, _), g in zip(layer.named_parameters(), grads[1:]):
        assert torch.equal(g, torch.zeros_like(g)), name
    assert launches["attention_fwd"] == 1 and launches["add_norm_fwd"] == 2


# Each kind in both layouts; fp32 and bf16 each meet both kinds and both RoPE layouts.
LLAMA_CASES = [("encoder", True, torch.float32, False), ("encoder", False, torch.bfloat16, True),
               ("decoder", False, torch.float32, True), ("decoder", True, torch.bfloat16, False)]


@pytest.mark.parametrize("kind, batch_first, dtype, interleaved", LLAMA_CASES)
def test_llama_layer_matches_float64(kind, batch_first, dtype, interleaved, device, launches, monkeypatch):
    """Causal self-attention with key padding: RoPE on the packed projection (sequence-first
    too), the packed attention kernel, SwiGLU in the FFN's GEMMs; gradients of everything."""
    layer = _llama_layer(kind, batch_first, interleaved)
    x = _x(batch_first, L, device)
    if kind == "encoder":
        inputs, kwargs = [x], {"src_key_padding_mask": _padding(B, L, device), "is_causal": True}
    else:
        inputs = [x, _x(batch_first, S, device)]
        kwargs = {"tgt_key_padding_mask": _padding(B, L, device), "tgt_is_causal": True,
                  "memory_key_padding_mask": _padding(B, S, device)}
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    _against_reference(layer, inputs, kwargs, dtype, device, monkeypatch)
    # Self-attention only is rotated (forward, backward); the decoder adds cross-attention.
    n_attn = 1 if kind == "encoder" else 2
    assert launches["rope_qkvpacked"] == 2 and launches["rope"] == 0
    assert launches["attention_fwd"] == launches["attention_bwd"] == n_attn
    # Each linear: 1 GEMM forward, 2 backward (dX, dW): QKV and out, plus the decoder's
    # cross-attention q, kv and out; SwiGLU: 2 forward, 4 backward.
    assert launches["matmul"] == 3 * (2 if kind == "encoder" else 5) + 6


# Kernels per bf16 training step of the LLaMA-style layer (no biases, dropout 0, key padding):
# 21 Triton (12 GEMMs: QKV and out 3 each, SwiGLU 6; 2 + 2 norm; 2 RoPE; 3 attention) and 7
# PyTorch: the norm op's weight-gradient sums and casts and the zero-filled gradients of its
# mean/rstd outputs (2 each, the norm branch's work), and one gradient add for x, which feeds
# norm1 and, as the residual, norm2. RoPE adds 2 kernels to a layer without it, SwiGLU none.
MAX_LLAMA_KERNELS = 28


def test_llama_layer_step_runs_no_unfused_pytorch_ops(device, monkeypatch):
    """A training step of the LLaMA-style encoder layer runs no PyTorch matmul, SiLU or
    multiply (SwiGLU is in the GEMM epilogues) and no cat or copy (RoPE and attention read and
    write the packed QKV tensor and its one packed gradient); its kernels are counted."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", False)  # the suite's NaN fills are not the step's
    layer = _llama_layer("encoder", True).to(device=device, dtype=torch.bfloat16)
    x = _x(True, L, device).to(torch.bfloat16).requires_grad_(True)
    dy = numerics.randn(B, L, D, dtype=torch.bfloat16, device=device)  # not sum()'s stride-0 gradient
    inputs, padding = (x, *layer.parameters()), _padding(B, L, device)

    def step():
        return torch.autograd.grad(layer(x, src_key_padding_mask=padding, is_causal=True), inputs, dy)

    if device.type == "cuda":
        step()  # a first call may time config candidates: count a steady step
    with _backend.host_only() if device.type == "cpu" else contextlib.nullcontext():
        unfused, counts = op_counting.unfused(step)
    assert unfused == {}, counts.table()
    assert counts.total <= MAX_LLAMA_KERNELS and counts.syncs == {}, counts.table()
    assert counts.triton["rope_qkvpacked"] == 2 and counts.triton["matmul"] == 12, counts.table()


def test_rope_layer_with_a_general_mask_runs_the_kernel_rotated(device, launches, monkeypatch):
    """A general mask sends a RoPE layer to the kernel's bias form on views of the rotated
    packed tensor (not the packed-QKV form): still rotated, still right, no warning."""
    monkeypatch.setattr(_backend, "WARNED", set())
    layer = _llama_layer("encoder", False)
    mask = numerics.randn(L, L, dtype=torch.float32, device=device)  # a general additive mask
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _against_reference(layer, [_x(False, L, device)], {"src_mask": mask}, torch.float32, device, monkeypatch)
    assert launches["rope_qkvpacked"] == 2 and launches["attention_fwd"] >= 1


def test_swiglu_layer_keywords_and_rope_frequencies_after_moves(device):
    """activation="swiglu" doubles linear1 (gate rows, then up rows) and stores the name (no
    PyTorch SiLU-multiply callable). RoPE's frequencies stay fp32 and exact through a cast to
    bf16 (rounded ones would shift every angle) and through meta-device construction plus
    to_empty (which leaves buffers uninitialized)."""
    layer = _llama_layer("encoder", True)
    assert layer.linear1.weight.shape == (2 * FF, D) and layer.activation == "swiglu"
    assert layer.activation_relu_or_gelu == 0  # never torch's nested-tensor fast path
    assert not hasattr(blocks, "swiglu")
    hd = D // H
    exact = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    half = copy.deepcopy(layer).to(device=device, dtype=torch.bfloat16)
    with torch.device("meta"):
        meta = _llama_layer("encoder", True)
    for m in (half, meta.to_empty(device=device)):
        assert m.self_attn.inv_freq.dtype == torch.float32
        torch.testing.assert_close(m.self_attn.inv_freq.cpu(), exact, atol=0, rtol=0)
    # A table the user set (position interpolation) moves and casts as it is, in fp32: moves
    # recomputed it from rope_base (found by fuzzing: a no-op .to() undid the interpolation).
    scaled = copy.deepcopy(layer)
    scaled.self_attn.inv_freq = exact / 4
    for move in (lambda m: m.to("cpu"), lambda m: m.to(device), lambda m: m.bfloat16(), lambda m: m.float()):
        move(scaled)
        assert scaled.self_attn.inv_freq.dtype == torch.float32
        torch.testing.assert_close(scaled.self_attn.inv_freq.cpu(), exact / 4, atol=0, rtol=0)
    x = _x(True, L, device)
    with torch.no_grad():
        got = half(x.to(torch.bfloat16), is_causal=True).float()
        want = layer.to(device)(x, is_causal=True)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_dropout_in_training_is_seeded_and_differentiable(device):
    f = fused_block.TransformerEncoderLayer(D, H, FF, dropout=0.3, batch_first=True, norm_first=True).to(device)
    x = _x(True, L, device).requires_grad_(True)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(f(x))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)  # same seed, same masks
    f.eval()
    with torch.no_grad():
        assert not torch.allclose(outs[0], f(x))  # dropout was active in training
    outs[0].sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in f.parameters())


# Each dropout of torch's layers is on by its own module's training flag (dropout, dropout1..3
# are called; MultiheadAttention reads its own flag), whatever the layer's.
DROPOUT_SUBMODULES = ([("encoder", s) for s in ("dropout", "dropout1", "dropout2", "self_attn")]
                      + [("decoder", s) for s in ("dropout", "dropout1", "dropout2", "dropout3", "self_attn",
                                                  "multihead_attn")])
_DROPPING = (nn.Dropout, nn.MultiheadAttention)


def _set_modes(layer, layer_train, on=None):
    """``layer`` in train or eval mode, every dropout submodule (and attention) in eval but ``on``
    (a submodule name) in train."""
    layer.train(layer_train)
    for name, m in layer.named_children():
        if isinstance(m, _DROPPING):
            m.train(name == on)


def _set_dropout(layer, sub, p):
    """The probability of ``layer``'s dropout submodule ``sub`` (an attention's is its ``dropout``)."""
    mod = getattr(layer, sub)
    if isinstance(mod, nn.MultiheadAttention):
        mod.dropout = p
    else:
        mod.p = p


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("kind, sub", DROPOUT_SUBMODULES)
@pytest.mark.sweep
def test_each_dropout_follows_its_own_modules_training_flag(kind, sub, norm_first, device, launches):
    """One dropout submodule (p = 0.5, the others 0) flipped against the layer's mode, grad
    enabled (torch's slow path): layer train + submodule eval is torch's no-dropout output
    (float64 rule) and the fused all-eval output exactly; layer eval + submodule train drops,
    in torch's layer and the fused one. Masks differ (other RNGs): an ON state is checked by
    differing from the no-dropout output."""
    t, f = _layers(kind, batch_first=True, norm_first=norm_first)
    t, f = t.to(device), f.to(device)
    f.load_state_dict(t.state_dict())
    for m in (t, f):
        _set_dropout(m, sub, 0.5)
    ref = copy.deepcopy(t).double()
    inputs = [_x(True, L, device)] + ([_x(True, S, device)] if kind == "decoder" else [])

    def run(m, dtype=torch.float32):
        torch.manual_seed(7)
        return m(*[x.to(dtype) for x in inputs])

    _set_modes(f, False)
    fused_eval = run(f)
    _set_modes(t, False)
    torch_eval = run(t)
    # layer train, the submodule eval: no dropout anywhere
    for m in (t, f, ref):
        _set_modes(m, True)
    out = run(f)
    numerics.assert_close("output", out, run(ref, torch.float64), run(t), atol=_atol(torch.float32, device),
                          factor=BLOCK_FACTOR)
    torch.testing.assert_close(out, fused_eval, atol=0, rtol=0)
    # layer eval, the submodule train: its dropout is on
    for m in (t, f):
        _set_modes(m, False, on=sub)
    assert not torch.allclose(run(t), torch_eval)  # torch's layer drops here
    assert not torch.allclose(run(f), fused_eval)
    assert launches["attention_fwd"] == 3 * (1 + (kind == "decoder"))
    assert launches["add_norm_fwd"] == 3 * (2 + (kind == "decoder"))  # one per norm


@pytest.mark.parametrize("dtype", numerics.DTYPES, ids=str)
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_dropout_one_drops_as_torchs_layer(kind, norm_first, dtype, device, launches):
    """dropout=1.0, which torch's layers take (every dropout drops everything: the sublayers
    add zeros, the upstream parameters get zero gradients), in training mode: torch's output
    and the gradient of every input and parameter. It raised "dropout_p must be in [0, 1)"
    (the attention's and the fused ops' dropouts stop below 1); now the attention takes
    p = 1 (SDPA's zeros) and the FFN's and norms' dropouts at p = 1 run as torch's."""
    t, f = _layers(kind, batch_first=True, norm_first=norm_first, dropout=1.0)
    inputs = [_x(True, L, device)] + ([_x(True, S, device)] if kind == "decoder" else [])
    _three_ways(t, f, inputs, {}, dtype, device)
    assert launches["attention_fwd"] == 1 + (kind == "decoder")  # the attention kernel ran
    assert launches["add_norm_fwd"] == 2 + (kind == "decoder")


@pytest.mark.parametrize("activation", ["relu", "callable"])
@pytest.mark.parametrize("kind, sub", DROPOUT_SUBMODULES)
@pytest.mark.sweep
def test_one_dropout_at_one_drops_as_torchs_layer(kind, sub, activation, device, launches):
    """One dropout submodule (or attention) at p = 1, the others at 0, training mode, Post-LN
    (where drop2/drop3 ride in the norm kernel): torch's output and gradients. A callable
    activation runs the hidden dropout between the GEMMs."""
    act = torch.nn.functional.silu if activation == "callable" else "relu"
    t, f = _layers(kind, batch_first=True, activation=act)
    for m in (t, f):
        _set_dropout(m, sub, 1.0)
    inputs = [_x(True, L, device)] + ([_x(True, S, device)] if kind == "decoder" else [])
    _three_ways(t, f, inputs, {}, torch.float32, device)
    assert launches["attention_fwd"] == 1 + (kind == "decoder")


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_dropout_one_as_torchs(need_weights, device, launches):
    """MultiheadAttention(dropout=1.0) in training: torch's output (out_proj's bias: the
    attention is all dropped) and gradients (zero for the projections), fused path
    (need_weights=False) and torch's (True); eval mode attends."""
    t = nn.MultiheadAttention(D, H, dropout=1.0, batch_first=True).to(device)
    _randomize(t)
    f = fused_block.MultiheadAttention(D, H, dropout=1.0, batch_first=True).to(device)
    f.load_state_dict(t.state_dict())
    x, mem = _x(True, L, device), _x(True, S, device)
    for mode in (True, False):
        outs = []
        for m in (t, f):
            m.train(mode)
            m.zero_grad(set_to_none=True)
            out = m(x, mem, mem, need_weights=need_weights)[0]
            out.square().sum().backward()
            outs.append((out, {n: p.grad for n, p in m.named_parameters()}))
        (want, g_want), (got, g_got) = outs
        torch.testing.assert_close(got, want, atol=_atol(torch.float32, device), rtol=1e-4)
        assert g_got.keys() == g_want.keys()
        for n in g_want:
            torch.testing.assert_close(g_got[n], g_want[n], atol=_atol(torch.float32, device), rtol=1e-4, msg=n)
        if mode:
            assert torch.equal(g_got["in_proj_weight"], torch.zeros_like(g_got["in_proj_weight"]))
    assert launches["attention_fwd"] == (0 if need_weights else 2)


@pytest.mark.parametrize("batch_first", [True, False])
def test_eval_layer_with_training_dropouts_without_grad_follows_torchs_fast_path(batch_first, device, launches):
    """An eval encoder layer whose dropouts are in train mode, without grad: torch's layer takes
    its inference fast path where it can (batch_first=True here: no dropout at all) and drops by
    each submodule's flag where it cannot (batch_first=False); the fused layer does the same."""
    t, f = _layers("encoder", dropout=0.5, batch_first=batch_first, norm_first=False)
    t, f = t.to(device), f.to(device)
    f.load_state_dict(t.state_dict())
    x = _x(batch_first, L, device)
    with torch.no_grad():
        for m in (t, f):
            m.eval()
        torch_eval, fused_eval = t(x), f(x)
        for m in (t, f):
            for s in m.children():
                if isinstance(s, _DROPPING):
                    s.train()
        y_t, y_f = t(x), f(x)
    if batch_first:
        torch.testing.assert_close(y_t, torch_eval, atol=0, rtol=0)
        torch.testing.assert_close(y_f, fused_eval, atol=0, rtol=0)
        torch.testing.assert_close(y_f, y_t, atol=_atol(torch.float32, device) * 4, rtol=0)
    else:
        assert not torch.allclose(y_t, torch_eval) and not torch.allclose(y_f, fused_eval)
    assert launches["attention_fwd"] == 2


def test_conversion_keeps_each_submodules_mode():
    """``convert`` keeps the layer's mode and each submodule's own (the modules are shared)."""
    t = nn.TransformerDecoderLayer(D, H, FF, dropout=0.5)
    t.train()
    t.dropout2.eval()
    t.multihead_attn.eval()
    modes = {n: m.training for n, m in t.named_modules()}
    f = fused_block.convert(t)
    assert isinstance(f, fused_block.TransformerDecoderLayer)
    assert {n: m.training for n, m in f.named_modules()} == modes
    assert {n: m.training for n, m in t.named_modules()} == modes


def test_multihead_attention_module(device):
    """The MultiheadAttention subclass alone: fused without weights, torch's with them."""
    torch.manual_seed(0)
    t = nn.MultiheadAttention(D, H, batch_first=True).to(device)
    f = blocks.MultiheadAttention(D, H, batch_first=True).to(device)
    f.load_state_dict(t.state_dict())
    x, mem = _x(True, L, device), _x(True, S, device)
    kpm = _padding(B, S, device)
    with torch.no_grad():
        got, w = f(x, mem, mem, key_padding_mask=kpm, need_weights=False)
        assert w is None
        want = t(x, mem, mem, key_padding_mask=kpm, need_weights=False)[0]
        torch.testing.assert_close(got, want, atol=_atol(torch.float32, device) * 4, rtol=0)
        torch.testing.assert_close(f(x, x, x)[1], t(x, x, x)[1])  # need_weights: torch's path


@pytest.mark.parametrize("bias_kv,zero_attn,kdim,inputs,batch_first", [
    (True, True, None, "self", True),
    (True, False, None, "cross", False),
    (False, True, None, "distinct", True),
    (False, False, 24, "distinct", False),  # kdim = vdim = 24: separate q/k/v projection weights
    (True, True, 24, "cross", True),
    (False, False, None, "distinct", True),  # key is not value, torch's standard layout
], ids=str)
def test_multihead_attention_torch_options(device, launches, bias_kv, zero_attn, kdim, inputs, batch_first):
    """torch's MultiheadAttention options through the kernel: add_bias_kv and add_zero_attn
    (rows appended to k and v, masks padded), kdim/vdim, key and value different tensors;
    output and every gradient against torch's module on the same weights (fp32)."""
    kw = dict(add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=kdim, batch_first=batch_first)
    t = nn.MultiheadAttention(D, H, device=device, **kw)
    f = blocks.MultiheadAttention(D, H, device=device, **kw)
    f.load_state_dict(t.state_dict())
    x = _x(batch_first, L, device).requires_grad_()
    k = _x(batch_first, S, device, kdim or D) if inputs != "self" else x
    v = k if inputs != "distinct" else torch.randn_like(k)
    kpm = _padding(B, S if inputs != "self" else L, device)
    got = f(x, k, v, key_padding_mask=kpm, need_weights=False)[0]
    want = t(x, k, v, key_padding_mask=kpm, need_weights=False)[0]
    tol = dict(atol=_atol(torch.float32, device) * 4, rtol=0)
    torch.testing.assert_close(got, want, **tol)
    assert launches["attention_fwd"] == 1
    g = torch.randn_like(got)
    ours = torch.autograd.grad(got, (x, *f.parameters()), g, allow_unused=True)
    theirs = torch.autograd.grad(want, (x, *t.parameters()), g, allow_unused=True)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("empty", ["batch", "query"])
def test_empty_batch_or_query_in_cross_attention(empty, batch_first, device):
    """An empty batch (B = 0) or query (L = 0) with keys that are not the query (the separate
    projections, and every decoder layer's cross-attention) gives torch's empty output and
    gradients: the heads' merge reshaped to (.., -1), ambiguous for 0 elements, and raised."""
    b, n = (0, L) if empty == "batch" else (B, 0)
    t = nn.MultiheadAttention(D, H, batch_first=batch_first).to(device)
    f = blocks.MultiheadAttention(D, H, batch_first=batch_first).to(device)
    f.load_state_dict(t.state_dict())
    x = _x(batch_first, n, device, batch=b).requires_grad_()
    mem = _x(batch_first, S, device, batch=b)
    for k, v in ((mem, mem), (mem, torch.randn_like(mem))):
        got = f(x, k, v, need_weights=False)[0]
        want = t(x, k, v, need_weights=False)[0]
        assert got.shape == want.shape
        got.sum().backward()
        assert x.grad.shape == x.shape
    tl, fl = _layers("decoder", batch_first=batch_first)
    fl = fl.to(device)
    fl.load_state_dict(tl.state_dict())
    tgt = _x(batch_first, n, device, batch=b)
    assert fl(tgt, mem).shape == tl.to(device)(tgt, mem).shape


def test_multihead_attention_options_need_standard_heads():
    with pytest.raises(ValueError, match="add_bias_kv"):
        blocks.MultiheadAttention(D, H, add_bias_kv=True, num_kv_heads=1)
    with pytest.raises(ValueError, match="kdim"):
        blocks.MultiheadAttention(D, H, kdim=24, rope=True)
    assert fused_block.MultiheadAttention is blocks.MultiheadAttention


# ---------------------------------------------------------------------------------------------
# bad input: the errors torch gives, as ValueError/TypeError naming the argument
# ---------------------------------------------------------------------------------------------

def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="nhead") as e:
        fused_block.TransformerEncoderLayer(30, 4)
    assert isinstance(e.value, AssertionError)  # what torch raises
    with pytest.raises(AssertionError):
        nn.TransformerEncoderLayer(30, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        fused_block.TransformerDecoderLayer(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="norm"):
        fused_block.TransformerEncoderLayer(32, 4, norm="batch")
    with pytest.raises(RuntimeError, match="activation"):
        fused_block.TransformerEncoderLayer(32, 4, activation="swish")


@pytest.mark.parametrize("case", ["d_model", "src_mask_shape", "padding_shape", "padding_dtype", "rank"])
def test_bad_forward_arguments_raise_like_torch(case):
    t = nn.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True)
    f = fused_block.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True)
    x = torch.randn(B, L, D)
    args, kwargs, torch_exc, our_exc, name = {
        "d_model": ((torch.randn(B, L, D + 8),), {}, AssertionError, ValueError, "src"),
        "src_mask_shape": ((x,), {"src_mask": torch.zeros(L - 1, L - 1)}, RuntimeError, ValueError, "src_mask"),
        "padding_shape": ((x,), {"src_key_padding_mask": torch.zeros(B, L - 1, dtype=torch.bool)},
                          AssertionError, ValueError, "src_key_padding_mask"),
        "padding_dtype": ((x,), {"src_key_padding_mask": torch.zeros(B, L, dtype=torch.int64)},
                          AssertionError, TypeError, "src_key_padding_mask"),
        "rank": ((torch.randn(1, B, L, D),), {}, AssertionError, ValueError, "src"),
    }[case]
    with pytest.raises(torch_exc):
        t(*args, **kwargs)
    with pytest.raises(our_exc, match=name) as e:
        f(*args, **kwargs)
    assert isinstance(e.value, torch_exc)


def test_bad_decoder_memory():
    f = fused_block.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True)
    with pytest.raises(ValueError, match="memory"):
        f(torch.randn(B, L, D), torch.randn(B, S, D + 8))
    with pytest.raises(ValueError, match="memory"):
        f(torch.randn(B, L, D), torch.randn(B + 1, S, D))
    with pytest.raises(ValueError, match="memory_mask"):
        f(torch.randn(B, L, D), torch.randn(B, S, D), memory_mask=torch.zeros(L, L))
