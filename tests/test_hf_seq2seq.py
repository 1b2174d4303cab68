"""Encoder-decoders converted by ``fused_block.convert``: BART (Post-LN) and Whisper (Pre-LN).

Tiny random models of tests/hf_testing.py (d_model 64, 4 heads of 16, 2 + 2 layers; 9 source
tokens with one row right-padded, or Whisper's 8 x 16 features; 5 target tokens). Every layer
is converted: the encoder's self-attention, the decoder's causal self-attention and its
cross-attention to the encoder's output. Against the original in float64 with the block rule
of tests/test_hf.py: the training loss, the logits and the gradient of every parameter (fp32),
the logits in bf16; 16 greedy tokens with both caches, token for token the original's; the
state dict and save_pretrained round trips; activation checkpointing; the call-time guard.
"""
import copy
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fused_block  # noqa: E402
import fused_block.hf  # noqa: E402
from hf_testing import assert_close, no_fallback, seq2seq_inputs, seq2seq_model  # noqa: E402

NAMES = ["bart", "whisper"]
# Per forward of 2 + 2 layers: the encoder's QKV, out, fc1, fc2 GEMMs; the decoder's QKV, out,
# cross q, cross kv, cross out, fc1, fc2; attention: 2 encoder + 2 x 2 decoder; norms 2 + 3 each.
GEMMS, ATTENTIONS, NORMS = 2 * 4 + 2 * 7, 2 + 2 * 2, 2 * 2 + 2 * 3


def _converted(model, layers=4):
    with no_fallback():
        fused = fused_block.convert(copy.deepcopy(model))
    assert len([m for m in fused.modules() if "_fused_block" in m.__dict__]) == layers  # every layer
    return fused


def _cast(enc, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in enc.items()}


# The three mask conventions the layers read: sdpa's bool masks, eager's additive ones, the
# fused_block interface's light ones (BART's padded encoder: (B, 1, 1, Lk)).
@pytest.mark.parametrize("name, implementation", [("bart", "sdpa"), ("bart", "fused_block"), ("whisper", "eager")])
def test_training_step_matches_the_original(name, implementation, device, launches):
    """The loss (labels: the decoder's inputs shifted right by the model), the logits and every
    parameter's gradient."""
    model = seq2seq_model(name, device, "sdpa").train()
    ref = copy.deepcopy(model).double()
    if implementation != "sdpa":
        model.set_attn_implementation(implementation)
    fused = _converted(model)
    enc, targets = seq2seq_inputs(name, device)
    outs, counts = {}, {}
    for key, m in (("ref", ref), ("base", model), ("fused", fused)):
        before = {k: launches[k] for k in ("matmul", "attention_fwd", "attention_bwd", "add_norm_fwd", "add_norm_bwd")}
        with no_fallback():
            out = m(**_cast(enc, torch.float64 if key == "ref" else torch.float32), labels=targets)
            out.loss.backward()
        outs[key] = (out, dict(m.named_parameters()))
        counts[key] = {k: launches[k] - v for k, v in before.items()}
    for field in ("loss", "logits"):
        assert_close(field, getattr(outs["fused"][0], field), getattr(outs["ref"][0], field),
                     getattr(outs["base"][0], field), torch.float32, device)
    for pname, p in outs["ref"][1].items():
        if p.grad is None:  # the padding token's embedding row
            continue
        assert_close(f"{pname}.grad", outs["fused"][1][pname].grad, p.grad, outs["base"][1][pname].grad,
                     torch.float32, device)
    fused_counts = counts["fused"]
    assert fused_counts["matmul"] == 3 * GEMMS  # forward 1, backward 2 each
    assert fused_counts["attention_fwd"] == fused_counts["attention_bwd"] == ATTENTIONS
    assert fused_counts["add_norm_fwd"] == fused_counts["add_norm_bwd"] == NORMS


@pytest.mark.parametrize("name", NAMES)
def test_bf16_logits(name, device, launches):
    model = seq2seq_model(name, device, "sdpa").eval()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model).to(torch.bfloat16)
    fused = _converted(base)
    enc, targets = seq2seq_inputs(name, device)
    with torch.no_grad():
        want = ref(**_cast(enc, torch.float64), labels=targets).logits
        base_logits, got = (m(**_cast(enc, torch.bfloat16), labels=targets).logits for m in (base, fused))
    assert got.dtype == torch.bfloat16
    assert_close("logits", got, want, base_logits, torch.bfloat16, device)
    assert launches["attention_fwd"] == ATTENTIONS


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_with_both_caches_matches(name, device, launches):
    """generate(): the encoder once, then 16 decoder steps, each attending to its growing
    self-attention cache and to the cross-attention keys projected at the first step only.
    One layer each; weights of std 0.5 (as tests/test_hf_interface.py's generation)."""
    model = seq2seq_model(name, device, "sdpa", layers=1, init_std=0.5).eval()
    fused = _converted(model, layers=2)
    enc, _ = seq2seq_inputs(name, device)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    want = model.generate(**enc, **kw)
    with no_fallback():
        got = fused.generate(**enc, **kw)
    assert len(set(want[0, -16:].tolist())) > 3
    assert torch.equal(got, want)
    assert launches["attention_fwd"] == 1 + 2 * 16
    # per step the decoder's QKV, out, cross q, out, fc1, fc2; the cross kv GEMM at the first only
    assert launches["matmul"] == 4 + 16 * 6 + 1


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_and_save_pretrained_round_trip(name, device):
    model = seq2seq_model(name, device, "sdpa").eval()
    keys = list(model.state_dict())
    fused = copy.deepcopy(model)
    params = list(fused.parameters())
    assert fused_block.convert(fused) is fused
    assert list(fused.state_dict()) == keys and all(a is b for a, b in zip(fused.parameters(), params))
    enc, targets = seq2seq_inputs(name, device)
    with tempfile.TemporaryDirectory() as tmp:
        fused.save_pretrained(tmp)
        reloaded = type(model).from_pretrained(tmp).to(device).eval()
        again = fused_block.convert(type(model).from_pretrained(tmp).to(device).eval())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**enc, labels=targets).logits, model(**enc, labels=targets).logits,
                                   atol=0, rtol=0)
        torch.testing.assert_close(again(**enc, labels=targets).logits, fused(**enc, labels=targets).logits,
                                   atol=0, rtol=0)


def test_activation_checkpointing_keeps_the_gradients(device, launches):
    """transformers' gradient checkpointing: the converted layers recompute in backward and the
    gradients are the plain step's, the encoder's included (it reaches the decoder's
    cross-attention as a checkpointed input). One layer each."""
    model = _converted(seq2seq_model("bart", device, "sdpa", layers=1).train(), layers=2)
    enc, targets = seq2seq_inputs("bart", device)
    model(**enc, labels=targets).loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing_enable()
    before = launches["attention_fwd"]
    with no_fallback():
        model(**enc, labels=targets).loss.backward()
    assert launches["attention_fwd"] - before == 2 * 3  # 3 attentions, forward and again in backward
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


def test_a_hook_on_a_fused_submodule_runs_the_original(device, launches):
    """A forward hook on the cross-attention's k_proj (which the fused path reads, not calls):
    that layer runs Hugging Face's forward after one warning, the hook fires, the answer is the
    original's."""
    model = seq2seq_model("bart", device, "sdpa").eval()
    fused = _converted(model)
    seen = []
    fused.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o))
    enc, targets = seq2seq_inputs("bart", device)
    with torch.no_grad(), pytest.warns(UserWarning, match="encoder_attn.k_proj has a forward hook"):
        got = fused(**enc, labels=targets).logits
    assert len(seen) == 1
    with torch.no_grad():
        torch.testing.assert_close(got, model(**enc, labels=targets).logits, atol=2e-5, rtol=0)
    assert launches["attention_fwd"] == ATTENTIONS - 2  # the hooked layer's two attentions ran HF's code
