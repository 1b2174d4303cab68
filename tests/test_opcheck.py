"""``torch.library.opcheck`` over every op registered with ``fused_block._library.op``, on the
arguments the public functions pass them.

Each case runs a public function (forward and backward) with the ops' Python entry points
wrapped to record their arguments, checks that exactly the expected ops ran (the kernel path,
and every op of the family), then runs opcheck's default checks on each recorded call:
``test_schema`` (no undeclared mutation, no output aliasing an input or another output),
``test_autograd_registration``, ``test_faketensor`` (the fake implementation's outputs: count,
shapes, strides, dtypes, aliasing, against the kernels') and ``test_aot_dispatch_dynamic``.
The recorded tensors are detached: the ops run inside ``torch.autograd.Function``s (or
without autograd), never differentiated through the dispatcher.

Shapes are tiny (opcheck runs each op about six times in the interpreter); every case names
the layouts and flags it is there for. Each test function is a sweep over case x dtype: its
cases come diagonal first (case i with ``DTYPES[i % 3]``), which is its gpu_quick selection, so
the default CPU run takes every case once and every dtype, and a GPU (or ``FUSED_BLOCK_HEAVY=1``)
the whole product. ``test_every_op_is_covered`` ties the expected sets to the registered ops.
The ops' own opcheck tests in their files (hand-built arguments: tests/test_norm.py,
test_rope.py, test_linear.py, test_lora.py, test_gated_mlp.py, test_loss.py, the attention
files) stay beside these.
"""
import importlib
import pathlib
import re

import pytest
import torch

import fused_block
from fused_block.kernels import loss as loss_kernels
from numerics import DTYPES, randn

_MODULES = {name: importlib.import_module(f"fused_block.{name}")
            for name in ("norm", "rope", "linear", "attention", "loss")}
# Each op's dispatching function (``_library.op``'s return), by the module-level name the
# public functions and autograd Functions call it through.
ENTRY_POINTS = {
    "norm": ("_add_norm_fwd", "_add_norm_bwd"),
    "rope": ("_rope_op", "_rope_packed_op", "_rope_qknorm_op", "_rope_qknorm_bwd_op"),
    "linear": ("_linear_fwd", "_linear_lora_fwd", "_linear_bwd", "_linear_lora_bwd", "_gated_fwd", "_gated_bwd",
               "_ffn_fwd", "_ffn_bwd"),
    "attention": ("attention_fwd", "attention_bwd", "attention_packed_fwd", "attention_packed_bwd",
                  "attention_varlen_fwd", "attention_varlen_bwd", "attention_varlen_packed_fwd",
                  "attention_varlen_packed_bwd"),
    "loss": ("_lce_fwd", "_lce_bwd", "_lce_scale"),
}


@pytest.fixture
def recorded(monkeypatch):
    """The list of ``(op name, OpOverload, args)`` of every op call made while the test runs."""
    calls = []
    for module, names in ENTRY_POINTS.items():
        mod = _MODULES[module]
        for name in names:
            fn = getattr(mod, name)

            def record(*args, _fn=fn):
                calls.append((_fn.__name__, _fn.default,
                              tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)))
                return _fn(*args)

            monkeypatch.setattr(mod, name, record)
    return calls


def _opcheck(calls, expected):
    assert {name for name, _, _ in calls} == set(expected), "the ops that ran"
    for _, op, args in calls:
        torch.library.opcheck(op, args)


def _grid(cases, heavy=()):
    """``(case, dtype)`` params, case i with ``DTYPES[i % 3]`` first (the gpu_quick selection: every
    case and every dtype), then the rest of the product; the ``heavy`` cases (overlapping
    another file's opcheck test) with every dtype, all heavy."""
    first = [(c, DTYPES[i % len(DTYPES)]) for i, c in enumerate(cases)]
    rest = [(c, d) for c in cases for d in DTYPES if (c, d) not in first]

    def param(c, d, marks=()):
        return pytest.param(c, d, id=f"{c}-{str(d).removeprefix('torch.')}", marks=marks)

    return ([param(c, d) for c, d in first + rest]
            + [param(c, d, pytest.mark.heavy) for c in heavy for d in DTYPES])


def _leaf(t):
    return t.detach().requires_grad_(True)


# ---------------------------------------------------------------------------------------------
# add + norm
# ---------------------------------------------------------------------------------------------

N = 16  # hidden size of the norm and linear cases: one block


def _norm_ln_residual_dropout(dtype, device):
    # Rank-3 contiguous rows, residual, weight and bias, dropout (the seed); both outputs used.
    x, r = randn(2, 3, N, dtype=dtype, device=device, requires_grad=True), randn(2, 3, N, dtype=dtype, device=device)
    w, b = randn(N, dtype=dtype, device=device, requires_grad=True), randn(N, dtype=dtype, device=device)
    out, rout = fused_block.add_layer_norm(x, _leaf(r), w, _leaf(b), dropout_p=0.1)
    (out.float().pow(2).sum() + rout.float().sum()).backward()


def _norm_rms_fp32_stream_unit_offset(dtype, device):
    # Rank-2 x with a row stride (a column slice), an fp32 residual stream, Gemma's unit offset;
    # only out used (residual_out's gradient absent).
    x = _leaf(randn(5, 2 * N, dtype=dtype, device=device))[:, :N]
    r = randn(5, N, dtype=torch.float32, device=device, requires_grad=True)
    w = randn(N, dtype=dtype, device=device, requires_grad=True)
    out, _ = fused_block.add_rms_norm(x, r, w, eps=1e-6, unit_offset=True)
    out.float().pow(2).sum().backward()


def _norm_ln_no_residual_fp32_out(dtype, device):
    # A transposed rank-3 x (its (rows, hidden) copy), no residual, residual_in_fp32 (stored
    # residual_out of another dtype), weight without bias; only residual_out used (dout None).
    x = _leaf(randn(3, 2, N, dtype=dtype, device=device)).transpose(0, 1)
    w = randn(N, dtype=dtype, device=device, requires_grad=True)
    _, rout = fused_block.add_layer_norm(x, None, w, None, residual_in_fp32=True)
    rout.pow(2).sum().backward()


def _norm_rms_out_is_residual(dtype, device):
    # Post-LN: out is also the residual stream (dout2), no weight; gradients from .sum() (expanded).
    x, r = randn(2, 3, N, dtype=dtype, device=device, requires_grad=True), randn(2, 3, N, dtype=dtype, device=device)
    out, rout = fused_block.add_rms_norm(x, _leaf(r), None, out_is_residual=True)
    (out.sum() + rout.float().pow(2).sum()).backward()


NORM = {"ln-residual-dropout": _norm_ln_residual_dropout,
        "rms-fp32-stream-unit-offset": _norm_rms_fp32_stream_unit_offset,
        "ln-no-residual-fp32-out": _norm_ln_no_residual_fp32_out,
        "rms-out-is-residual": _norm_rms_out_is_residual}


@pytest.mark.sweep
@pytest.mark.parametrize("case, dtype", _grid(list(NORM)))
def test_norm_ops(case, dtype, device, recorded):
    NORM[case](dtype, device)
    _opcheck(recorded, ("add_norm_fwd", "add_norm_bwd"))


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

B, L, HQ, HK, D = 2, 3, 2, 1, 16  # GQA heads, one head dim block


def _inv_freq(rot, device):
    return 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))


def _rope_positions(dtype, device):
    # q and k strided views of one QKV projection; per-sequence int32 positions; both used.
    qkv = randn(B, L, (HQ + 2 * HK) * D, dtype=dtype, device=device, requires_grad=True)
    q, k = qkv[..., :HQ * D].unflatten(-1, (HQ, D)), qkv[..., HQ * D:(HQ + HK) * D].unflatten(-1, (HK, D))
    positions = torch.arange(3, 3 + L, dtype=torch.int32, device=device).expand(B, L).contiguous()
    qo, ko = fused_block.rope(q, k, positions, _inv_freq(D, device), scale=0.5)
    (qo.float().pow(2).sum() + ko.float().sum()).backward()


def _rope_table_interleaved_partial(dtype, device):
    # float64 cos/sin tables (rounded to fp32 before the op), interleaved pairs, partial rotary
    # (D / 2); only q used (k's gradient comes as zero heads).
    q = randn(B, L, HQ, D, dtype=dtype, device=device, requires_grad=True)
    k = randn(B, L, HK, D, dtype=dtype, device=device, requires_grad=True)
    f = torch.arange(L, device=device, dtype=torch.float64)[None, :, None] * _inv_freq(D // 2, device).double()
    emb = f.repeat_interleave(2, -1)
    qo, _ = fused_block.rope(q, k, cos=emb.cos(), sin=emb.sin(), interleaved=True)
    qo.float().pow(2).sum().backward()


def _rope_packed_seq_first(dtype, device):
    # (L, B, ...) packed QKV, a column slice of a wider buffer (row strides), positions 0..L-1.
    base = randn(L, B, (HQ + 2 * HK) * D + 16, dtype=dtype, device=device, requires_grad=True)
    out = fused_block.rope_qkvpacked(base[..., 16:], HQ, HK, None, _inv_freq(D, device), batch_first=False)
    out.float().pow(2).sum().backward()


def _rope_packed_qknorm(dtype, device):
    # Qwen3/Gemma 3 per-head q/k RMSNorm in the same launch (unit offset), weights' gradients.
    qkv = randn(B, L, (HQ + 2 * HK) * D, dtype=dtype, device=device, requires_grad=True)
    wq, wk = (randn(D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    positions = torch.arange(L, device=device)[None]
    out = fused_block.rope_qkvpacked(qkv, HQ, HK, positions, _inv_freq(D, device), q_norm_weight=wq,
                                     k_norm_weight=wk, norm_unit_offset=True)
    out.float().pow(2).sum().backward()


ROPE = {"rope-positions": (_rope_positions, ("rope",)),
        "rope-table-interleaved-partial": (_rope_table_interleaved_partial, ("rope",)),
        "packed-seq-first": (_rope_packed_seq_first, ("rope_qkvpacked",)),
        "packed-qknorm": (_rope_packed_qknorm, ("rope_qkvpacked_qknorm", "rope_qkvpacked_qknorm_bwd"))}


@pytest.mark.sweep
@pytest.mark.parametrize("case, dtype", _grid(list(ROPE)))
def test_rope_ops(case, dtype, device, recorded):
    run, ops = ROPE[case]
    run(dtype, device)
    _opcheck(recorded, ops)


# ---------------------------------------------------------------------------------------------
# linear, LoRA, the gated layer
# ---------------------------------------------------------------------------------------------

K, NOUT, F = 16, 32, 32  # in, out and hidden features: one GEMM tile


def _linear_bias_rank2(dtype, device):
    # The plain layer: rank-2 x, bias, no epilogue; every gradient.
    x, w, b = (randn(*s, dtype=dtype, device=device, requires_grad=True) for s in ((5, K), (NOUT, K), (NOUT,)))
    fused_block.linear(x, w, b).float().pow(2).sum().backward()


def _linear_epilogue_fp32_residual(dtype, device):
    # Rank-3 x, tanh GELU, dropout (seed), an fp32 residual (promoted output, the gradient cast
    # back), the incoming gradient expanded (.sum()); bias frozen (no dB).
    x, w = randn(2, 3, K, dtype=dtype, device=device, requires_grad=True), randn(NOUT, K, dtype=dtype, device=device,
                                                                                 requires_grad=True)
    b, r = randn(NOUT, dtype=dtype, device=device), randn(2, 3, NOUT, dtype=torch.float32, device=device)
    fused_block.linear(x, w, b, "gelu_tanh", r, 0.1).sum().backward()


def _linear_lora_transposed(dtype, device):
    # LoRA (rank 4, padded to 16) on a frozen weight, x with a transposed (non-unit last) stride,
    # ReLU; gradients for x, U and B only.
    x = _leaf(randn(K, 5, dtype=dtype, device=device)).t()
    w, b = randn(NOUT, K, dtype=dtype, device=device), randn(NOUT, dtype=dtype, device=device)
    u, lb = randn(5, 4, dtype=dtype, device=device, requires_grad=True), randn(NOUT, 4, dtype=dtype, device=device,
                                                                               requires_grad=True)
    fused_block.linear(x, w, b, "relu", lora=(u, lb)).float().pow(2).sum().backward()


def _gated_swiglu(dtype, device):
    # gated_linear (SwiGLU) with both biases, rank-2 x; every gradient.
    x, wg, wu = (randn(*s, dtype=dtype, device=device, requires_grad=True) for s in ((5, K), (F, K), (F, K)))
    bg, bu = (randn(F, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    _MODULES["linear"].gated_linear(x, wg, wu, bg, bu).float().pow(2).sum().backward()


def _gated_geglu_lora_dropout(dtype, device):
    # GeGLU, rank-3 x, LoRA on both projections, dropout, no biases; weights frozen.
    x = randn(2, 3, K, dtype=dtype, device=device, requires_grad=True)
    wg, wu = randn(F, K, dtype=dtype, device=device), randn(F, K, dtype=dtype, device=device)
    lora = (randn(2, 3, 4, dtype=dtype, device=device, requires_grad=True),
            randn(F, 4, dtype=dtype, device=device, requires_grad=True),
            randn(F, 4, dtype=dtype, device=device, requires_grad=True))
    _MODULES["linear"].gated_linear(x, wg, wu, dropout_p=0.1, lora=lora, activation="geglu").float().pow(2).sum() \
        .backward()


LINEAR = {"linear-bias-rank2": (_linear_bias_rank2, ("linear_fwd", "linear_bwd")),
          "linear-epilogue-fp32-residual": (_linear_epilogue_fp32_residual, ("linear_fwd", "linear_bwd")),
          "linear-lora-transposed": (_linear_lora_transposed, ("linear_lora_fwd", "linear_lora_bwd")),
          "gated-swiglu": (_gated_swiglu, ("gated_fwd", "gated_bwd")),
          "gated-geglu-lora-dropout": (_gated_geglu_lora_dropout, ("gated_fwd", "gated_bwd"))}


@pytest.mark.sweep
@pytest.mark.parametrize("case, dtype", _grid(list(LINEAR)))
def test_linear_ops(case, dtype, device, recorded):
    run, ops = LINEAR[case]
    run(dtype, device)
    _opcheck(recorded, ops)


# ---------------------------------------------------------------------------------------------
# the FFN (mlp, swiglu, geglu)
# ---------------------------------------------------------------------------------------------

def _ffn_mlp_dropouts_residual(dtype, device):
    # GELU MLP on rank-3 x, both biases, residual, both dropouts (two seeds); every gradient
    # (the pre-activation saved).
    x = randn(2, 3, K, dtype=dtype, device=device, requires_grad=True)
    w1, b1 = randn(F, K, dtype=dtype, device=device, requires_grad=True), randn(F, dtype=dtype, device=device,
                                                                                requires_grad=True)
    w2, b2 = randn(K, F, dtype=dtype, device=device, requires_grad=True), randn(K, dtype=dtype, device=device,
                                                                                requires_grad=True)
    r = randn(2, 3, K, dtype=dtype, device=device)
    fused_block.mlp(x, w1, b1, w2, b2, "gelu", r, 0.1, 0.1).float().pow(2).sum().backward()


def _ffn_swiglu_no_biases(dtype, device):
    # SwiGLU with separate gate/up weights and no biases: neither bias gradient is asked for, so
    # ffn_bwd returns two empty stand-ins (which must be distinct tensors: outputs of one op
    # may not alias each other).
    x = randn(2, 3, K, dtype=dtype, device=device, requires_grad=True)
    wg, wu = (randn(F, K, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    wd = randn(K, F, dtype=dtype, device=device, requires_grad=True)
    fused_block.swiglu(x, wg, wu, wd).float().pow(2).sum().backward()


def _ffn_w2_only_permuted(dtype, device):
    # No activation, x a permuted rank-3 tensor (its rows copied), hidden dropout, only w2
    # trained: the hidden activation saved instead of the pre-activation.
    x = randn(3, 2, K, dtype=dtype, device=device).transpose(0, 1)
    w1, b1 = randn(F, K, dtype=dtype, device=device), randn(F, dtype=dtype, device=device)
    w2 = randn(K, F, dtype=dtype, device=device, requires_grad=True)
    fused_block.mlp(x, w1, b1, w2, None, None, dropout_p=0.1).float().pow(2).sum().backward()


def _ffn_geglu_b2_only(dtype, device):
    # mlp's GeGLU (w1 (2F, D) read as gate and up views), output dropout, only the last bias
    # trained: the backward's gradient goes through dropout straight into dB2.
    x = randn(5, K, dtype=dtype, device=device)
    w1, b1 = randn(2 * F, K, dtype=dtype, device=device), randn(2 * F, dtype=dtype, device=device)
    w2, b2 = randn(K, F, dtype=dtype, device=device), randn(K, dtype=dtype, device=device, requires_grad=True)
    fused_block.mlp(x, w1, b1, w2, b2, "geglu", output_dropout_p=0.2).sum().backward()


FFN = {"swiglu-no-biases": _ffn_swiglu_no_biases,
       "mlp-dropouts-residual": _ffn_mlp_dropouts_residual,
       "mlp-w2-only-permuted": _ffn_w2_only_permuted,
       "geglu-b2-only": _ffn_geglu_b2_only}


@pytest.mark.sweep
@pytest.mark.parametrize("case, dtype", _grid(list(FFN)))
def test_ffn_ops(case, dtype, device, recorded):
    FFN[case](dtype, device)
    _opcheck(recorded, ("ffn_fwd", "ffn_bwd"))


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

LQ, LK, AD = 8, 12, 16  # query and key lengths (cross-attention), head dim: one block each


def _attn_blhd_causal_padding_dropout_lse(dtype, device):
    # (B, L, H, D)-ordered views (outputs and gradients in that memory order), GQA 2:1, causal
    # with Lq < Lk (bottom-right), key padding, dropout, the LSE returned and differentiated.
    q = _leaf(randn(2, LQ, HQ, AD, dtype=dtype, device=device)).transpose(1, 2)
    k, v = (_leaf(randn(2, LK, HK, AD, dtype=dtype, device=device)).transpose(1, 2) for _ in range(2))
    mask = torch.zeros(2, LK, dtype=torch.bool, device=device)
    mask[1, -3:] = True
    out, lse = fused_block.attention(q, k, v, True, key_padding_mask=mask, dropout_p=0.2, return_lse=True)
    (out.float().pow(2).sum() + lse[torch.isfinite(lse)].sum()).backward()


def _attn_scores(dtype, device):
    # The score options together: softcap, sinks (fp32, differentiable), ALiBi, a sliding
    # window, an additive bias broadcast over heads (differentiable) and a bool mask.
    q = randn(1, HQ, LQ, AD, dtype=dtype, device=device, requires_grad=True)
    k, v = (randn(1, HK, LK, AD, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    sinks = randn(HQ, dtype=torch.float32, device=device, requires_grad=True)
    bias = randn(1, 1, LQ, LK, dtype=dtype, device=device, requires_grad=True)
    mask = torch.rand(LQ, LK, device=device) > 0.2
    out = fused_block.attention(q, k, v, softcap=5.0, sinks=sinks, alibi_slopes=torch.rand(HQ, device=device),
                                window=(4, 2), bias=bias, mask=mask)
    out.float().pow(2).sum().backward()


def _attn_packed_seq_first(dtype, device):
    # attention_qkvpacked on (L, B, ...) QKV, a column slice of a wider buffer, GQA, causal with
    # a window, dropout.
    base = randn(LQ, 2, (HQ + 2 * HK) * AD + 16, dtype=dtype, device=device, requires_grad=True)
    out = fused_block.attention_qkvpacked(base[..., 16:], HQ, HK, True, dropout_p=0.1, window=(3, -1),
                                          batch_first=False)
    out.float().pow(2).sum().backward()


def _attn_varlen_sinks_dropout(dtype, device):
    # Packed sequences (one empty) with different query and key lengths, q a head slice of a
    # wider tensor, sinks in q's dtype, dropout, softcap.
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5, 6, 12], dtype=torch.int32, device=device)
    q = _leaf(randn(8, HQ + 2, AD, dtype=dtype, device=device))[:, 1:HQ + 1]
    k, v = (randn(12, HK, AD, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    sinks = randn(HQ, dtype=dtype, device=device, requires_grad=True)
    out = fused_block.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, dropout_p=0.1, sinks=sinks, softcap=3.0)
    out.float().pow(2).sum().backward()


def _attn_varlen_packed_causal_lse(dtype, device):
    # attention_varlen_qkvpacked, causal, GQA, the LSE differentiated, out's gradient expanded.
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    qkv = randn(8, (HQ + 2 * HK) * AD, dtype=dtype, device=device, requires_grad=True)
    out, lse = fused_block.attention_varlen_qkvpacked(qkv, cu, 5, HQ, HK, causal=True, return_lse=True)
    (out.sum() + lse.sum()).backward()


# fp32 (the first of the diagonal) on the cheapest case: the interpreter's IEEE fp32 products
# are its slowest.
ATTENTION = {"varlen-packed-causal-lse": (_attn_varlen_packed_causal_lse,
                                          ("attention_varlen_packed_fwd", "attention_varlen_packed_bwd")),
             "blhd-causal-padding-dropout-lse": (_attn_blhd_causal_padding_dropout_lse,
                                                 ("attention_fwd", "attention_bwd")),
             "packed-seq-first": (_attn_packed_seq_first, ("attention_packed_fwd", "attention_packed_bwd")),
             "varlen-sinks-dropout": (_attn_varlen_sinks_dropout, ("attention_varlen_fwd", "attention_varlen_bwd")),
             # heavy: tests/test_attention_scores.py's test_scores_opcheck checks these options
             "scores": (_attn_scores, ("attention_fwd", "attention_bwd"))}


@pytest.mark.sweep
@pytest.mark.parametrize("case, dtype", _grid(list(ATTENTION)[:-1], heavy=list(ATTENTION)[-1:]))
def test_attention_ops(case, dtype, device, recorded):
    run, ops = ATTENTION[case]
    run(dtype, device)
    _opcheck(recorded, ops)


# ---------------------------------------------------------------------------------------------
# the LM head's loss
# ---------------------------------------------------------------------------------------------

H, V = 16, 40  # hidden size, vocabulary: one chunk


def _target(shape, device, ignore_index=-100):
    t = torch.randint(0, V, shape, device=device)
    t.view(-1)[0] = ignore_index  # one ignored token
    return t


def _lce_mean_token_loop(dtype, device, monkeypatch):
    # "mean" on the token-chunk loop: the gradients in the forward (lce_fwd), scaled by the
    # incoming gradient in the backward (lce_scale); bias; rank-3 hidden.
    x = randn(2, 3, H, dtype=dtype, device=device, requires_grad=True)
    w, b = randn(V, H, dtype=dtype, device=device, requires_grad=True), randn(V, dtype=dtype, device=device,
                                                                              requires_grad=True)
    (2 * fused_block.linear_cross_entropy(x, w, _target((2, 3), device), b)).backward()


def _lce_none_options(dtype, device, monkeypatch):
    # "none" (the gradients recomputed in lce_bwd from the saved LSE), label smoothing, z-loss,
    # softcap, another ignore_index; no bias.
    x = randn(6, H, dtype=dtype, device=device, requires_grad=True)
    w = randn(V, H, dtype=dtype, device=device, requires_grad=True)
    loss = fused_block.linear_cross_entropy(x, w, _target((6,), device, 3), ignore_index=3, label_smoothing=0.1,
                                            z_loss=1e-3, softcap=5.0, reduction="none")
    loss.pow(2).sum().backward()


def _lce_vocab_schedule_sum(dtype, device, monkeypatch):
    # The vocabulary-outer schedule (forced): "sum" with the gradients in lce_bwd; hidden with a
    # row stride (a column slice); the weight frozen.
    monkeypatch.setattr(loss_kernels, "FORCE_SCHEDULE", "vocab")
    x = _leaf(randn(6, H + 8, dtype=dtype, device=device))[:, :H]
    w, b = randn(V, H, dtype=dtype, device=device), randn(V, dtype=dtype, device=device, requires_grad=True)
    fused_block.linear_cross_entropy(x, w, _target((6,), device), b, reduction="sum").backward()


LOSS = {"mean-token-loop": (_lce_mean_token_loop, ("lce_fwd", "lce_scale")),
        "none-options": (_lce_none_options, ("lce_fwd", "lce_bwd")),
        "vocab-schedule-sum": (_lce_vocab_schedule_sum, ("lce_fwd", "lce_bwd"))}


@pytest.mark.sweep
@pytest.mark.parametrize("case, dtype", _grid(list(LOSS)))
def test_loss_ops(case, dtype, device, recorded, monkeypatch):
    run, ops = LOSS[case]
    run(dtype, device, monkeypatch)
    _opcheck(recorded, ops)


# ---------------------------------------------------------------------------------------------
# coverage
# ---------------------------------------------------------------------------------------------

def test_every_op_is_covered():
    """Every ``_library.op`` registration in fused_block/ is an expected op of some case above,
    and every entry point recorded here dispatches to a registered op."""
    root = pathlib.Path(fused_block.__file__).parent
    registered = {m.group(1) for path in root.rglob("*.py")
                  for m in re.finditer(r'_library\.op\("(\w+)"', path.read_text())}
    expected = {"add_norm_fwd", "add_norm_bwd", "ffn_fwd", "ffn_bwd"}
    for table in (ROPE, LINEAR, ATTENTION, LOSS):
        expected.update(op for _, ops in table.values() for op in ops)
    assert registered == expected
    entry = {getattr(_MODULES[m], name).__name__ for m, names in ENTRY_POINTS.items() for name in names}
    assert entry == registered
    for name in registered:
        assert getattr(torch.ops.fused_block, name).default is not None
