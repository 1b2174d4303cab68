"""Encoder-decoders converted by ``fused_block.convert``: BART (Post-LN), Whisper (Pre-LN) and
T5 (Pre-RMSNorm, the relative position bias through the kernel's bias input; v1.1's gated GELU
and v1.0's ReLU FFN).

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
from hf_testing import assert_close, check_dropout_flags, no_fallback, seq2seq_inputs, seq2seq_model  # noqa: E402
from hf_testing import check_post_ln_layer_under_cuda_autocast  # noqa: E402

NAMES = ["bart", "whisper", "t5", "t5-v1.0"]
# Per forward of 2 + 2 layers: the encoder's QKV, out, fc1, fc2 GEMMs; the decoder's QKV, out,
# cross q, cross kv, cross out, fc1, fc2; attention: 2 encoder + 2 x 2 decoder; norms 2 + 3 each
# and one model-level norm per stack (BART's layernorm_embedding, Whisper's final layer_norm,
# T5's final_layer_norm; T5: the same counts, its FFN's wi (wi_0 and wi_1) and wo as fc1 and fc2).
GEMMS, ATTENTIONS, NORMS = 2 * 4 + 2 * 7, 2 + 2 * 2, 2 * 2 + 2 * 3 + 2


def _converted(model, layers=4, stacks=2):
    with no_fallback():
        fused = fused_block.convert(copy.deepcopy(model))
    converted = [m for m in fused.modules() if "_fused_block" in m.__dict__]
    assert len([m for m in converted if type(m).__name__ in fused_block.hf.FAMILIES]) == layers  # every layer
    assert len(converted) == layers + stacks  # and each stack's model-level norm
    return fused


_GENERATION_STD = {"t5": dict(initializer_factor=3.0)}


def _cast(enc, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in enc.items()}


# The three mask conventions the layers read: sdpa's bool masks, eager's additive ones, the
# fused_block interface's light ones (BART's padded encoder: (B, 1, 1, Lk)).
@pytest.mark.parametrize("name, implementation", [("bart", "sdpa"), ("bart", "fused_block"), ("whisper", "eager"),
                                                  ("t5", "sdpa"), ("t5-v1.0", "fused_block")])
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


# An all-zero encoder attention_mask row: the encoder's queries of that row and the decoder's
# cross-attention queries see no key. Eager's additive masks give them the mean of V, and so
# does T5's sdpa path, which merges the bool mask into its position bias as a float mask.
@pytest.mark.parametrize("name, implementation", [("bart", "eager"), ("t5", "sdpa"), ("t5", "eager")])
def test_a_source_row_of_no_token_matches_the_original(name, implementation, device, launches):
    model = seq2seq_model(name, device, implementation).eval()
    fused = _converted(model)
    enc, targets = seq2seq_inputs(name, device)
    enc["attention_mask"] = enc["attention_mask"].clone()
    enc["attention_mask"][1] = 0
    with torch.no_grad(), no_fallback():
        got, want = (m(**enc, labels=targets).logits for m in (fused, model))
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    assert launches["attention_fwd"] == ATTENTIONS


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


# (T5 v1.0's tiny model decodes one token over and over: its FFN is the only difference)
@pytest.mark.parametrize("name", ["bart", "whisper", "t5"])
def test_greedy_generation_with_both_caches_matches(name, device, launches):
    """generate(): the encoder once, then 16 decoder steps, each attending to its growing
    self-attention cache and to the cross-attention keys projected at the first step only.
    One layer each; weights of std 0.5 (as tests/test_hf_interface.py's generation; T5's
    initializer_factor 3)."""
    model = seq2seq_model(name, device, "sdpa", layers=1, **_GENERATION_STD.get(name, dict(init_std=0.5))).eval()
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


@pytest.mark.parametrize("name", ["bart", "whisper", "t5"])
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


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_activation_checkpointing_keeps_the_gradients(name, device, launches):
    """transformers' gradient checkpointing: the converted layers recompute in backward and the
    gradients are the plain step's, the encoder's included (it reaches the decoder's
    cross-attention as a checkpointed input; T5's position bias too). One layer each."""
    model = _converted(seq2seq_model(name, device, "sdpa", layers=1).train(), layers=2)
    enc, targets = seq2seq_inputs(name, device)
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


# ---------------------------------------------------------------------------------------------
# T5: its encoder alone, wo kept in fp32, the fp16 clamps, converted and original layers mixed
# ---------------------------------------------------------------------------------------------

def test_t5_encoder_model_matches_the_original(device, launches):
    """T5EncoderModel (2 layers, the padded batch): the last hidden state and every parameter's
    gradient, relative_attention_bias.weight's included, against float64."""
    model = seq2seq_model("t5", device, "sdpa", encoder_only=True).train()
    ref = copy.deepcopy(model).double()
    fused = _converted(model, layers=2, stacks=1)
    enc, _ = seq2seq_inputs("t5", device)
    outs = {}
    for key, m in (("ref", ref), ("base", model), ("fused", fused)):
        with no_fallback():
            out = m(**enc).last_hidden_state
        weights = torch.linspace(-1, 1, out.numel(), device=device, dtype=out.dtype).view_as(out)
        (out * weights).sum().backward()
        outs[key] = (out, dict(m.named_parameters()))
    assert_close("last_hidden_state", outs["fused"][0], outs["ref"][0], outs["base"][0], torch.float32, device)
    for pname, p in outs["ref"][1].items():
        if p.grad is None:
            continue
        assert_close(f"{pname}.grad", outs["fused"][1][pname].grad, p.grad, outs["base"][1][pname].grad,
                     torch.float32, device)
    assert outs["fused"][1]["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].grad.abs().sum() > 0
    assert launches["attention_fwd"] == launches["attention_bwd"] == 2
    assert launches["add_norm_fwd"] == 5  # 2 a layer, the final norm


def test_t5_bf16_with_wo_kept_in_fp32(device, launches):
    """from_pretrained(dtype=bfloat16) keeps the FFN's wo in fp32 (T5's _keep_in_fp32_modules):
    the hidden activation is cast to fp32 for wo and the stream turns fp32 after the first FFN,
    as in the original; no fallback."""
    model = seq2seq_model("t5", device, "sdpa").eval()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model).to(torch.bfloat16)
    for m in base.modules():
        if type(m).__name__ == "T5DenseGatedActDense":
            m.wo.float()
    fused = _converted(base)
    enc, targets = seq2seq_inputs("t5", device)
    with torch.no_grad():
        want = ref(**enc, labels=targets).logits
        base_logits = base(**enc, labels=targets).logits
        with no_fallback():
            got = fused(**enc, labels=targets).logits
    assert got.dtype == base_logits.dtype
    assert_close("logits", got, want, base_logits, torch.bfloat16, device)
    assert launches["attention_fwd"] == 6


def test_t5_fp16_clamps_as_the_original(device, launches):
    """An fp16 FFN output that overflows: T5Block clamps the stream to +-(max - 1000) where a
    value is infinite; the converted layer too (the answer is the original fp16 model's)."""
    model = seq2seq_model("t5", device, "sdpa").eval().half()
    with torch.no_grad():
        model.encoder.block[0].layer[-1].DenseReluDense.wo.weight.mul_(3e4)
    fused = _converted(model)
    enc, targets = seq2seq_inputs("t5", device)
    with torch.no_grad():
        h = model.encoder(**enc).last_hidden_state
        want = model(**enc, labels=targets).logits
        with no_fallback():
            got_h = fused.encoder(**enc).last_hidden_state
            got = fused(**enc, labels=targets).logits
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    assert torch.isfinite(h).all() and torch.isfinite(got_h).all()
    torch.testing.assert_close(got_h, h, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, atol=5e-2 * want.abs().max().item(), rtol=0)


def test_t5_converted_and_original_layers_mix(device, launches):
    """Forward hooks make the encoder's second layer and the decoder's first run Hugging Face's
    forward: the first takes the position bias a converted layer 0 computed, the second computes
    its own biases (and the zeros of its cross-attention) for the converted layer after it. The
    logits and the relative position bias's gradients are the original's."""
    model = seq2seq_model("t5", device, "sdpa").train()
    fused = _converted(model)
    fused.encoder.block[1].layer[0].SelfAttention.q.register_forward_hook(lambda m, i, o: None)
    fused.decoder.block[0].layer[1].EncDecAttention.k.register_forward_hook(lambda m, i, o: None)
    enc, targets = seq2seq_inputs("t5", device)
    want = model(**enc, labels=targets)
    want.loss.backward()
    with pytest.warns(UserWarning, match="has a forward hook"):
        got = fused(**enc, labels=targets)
    got.loss.backward()
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    for stack in ("encoder", "decoder"):
        path = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        torch.testing.assert_close(fused.get_parameter(path).grad, model.get_parameter(path).grad, atol=1e-5,
                                   rtol=1e-4)
    assert launches["attention_fwd"] == 6 - 3  # the two hooked layers' attentions ran HF's code


def test_mt5_is_converted(device, launches):
    """MT5Block is T5Block's code: converted, the logits the original's."""
    t5 = seq2seq_model("t5", device, "sdpa").eval()
    model = transformers.MT5ForConditionalGeneration(transformers.MT5Config(**t5.config.to_dict())).to(device).eval()
    model.load_state_dict(t5.state_dict())
    fused = _converted(model)
    enc, targets = seq2seq_inputs("t5", device)
    with torch.no_grad():
        want = model(**enc, labels=targets).logits
        with no_fallback():
            got = fused(**enc, labels=targets).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert launches["attention_fwd"] == 6


def test_t5_with_peft_lora_runs_the_original(device, launches):
    """PEFT LoRA on T5's q and v (its usual targets) is not fused into T5's GEMMs: a model
    wrapped before convert keeps its layers unconverted (and its norms), one wrapped after runs
    each layer's original forward (the call-time guard); both after a warning, both PEFT's answer
    (the second's final norms fused: the same function, rounded once)."""
    peft = pytest.importorskip("peft")
    model = seq2seq_model("t5", device, "sdpa").eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], init_lora_weights=False)
    torch.manual_seed(0)
    want_model = peft.get_peft_model(copy.deepcopy(model), cfg)
    with pytest.warns(UserWarning, match="T5Block is left unconverted: layer.0.SelfAttention's q/k/v/o"):
        before = fused_block.convert(peft.get_peft_model(copy.deepcopy(model), cfg))
    after = peft.get_peft_model(_converted(copy.deepcopy(model)), cfg)
    enc, targets = seq2seq_inputs("t5", device)
    with torch.no_grad():
        want = want_model(**enc, labels=targets).logits
        for m in (before, after):
            m.load_state_dict(want_model.state_dict())
        got_before = before(**enc, labels=targets).logits
        with pytest.warns(UserWarning, match="runs its original forward"):
            got_after = after(**enc, labels=targets).logits
    torch.testing.assert_close(got_before, want, atol=0, rtol=0)
    # The layers' original forwards; the stacks' final norms (outside the layers) stay fused.
    torch.testing.assert_close(got_after, want, atol=1e-5, rtol=1e-5)
    assert launches["attention_fwd"] == 0 and launches["add_norm_fwd"] == 2


def test_t5_dropouts_run_fused_and_deterministic(device, launches):
    """T5's dropouts (dropout_rate 0.1: the attention probabilities, each sublayer's output
    before its residual add, the FFN's hidden activation) run inside the fused ops, without a
    fallback: a training step under one seed gives the same loss and gradients twice (no
    atomics), another than without dropout; in eval mode the original's answer. One layer each."""
    model = seq2seq_model("t5", device, "sdpa", layers=1, dropout_rate=0.1)
    fused = _converted(model, layers=2).train()
    enc, targets = seq2seq_inputs("t5", device)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        fused.zero_grad()
        with no_fallback():
            loss = fused(**enc, labels=targets).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in fused.parameters() if p.grad is not None]))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=0, rtol=0)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with torch.no_grad():
        plain = fused.eval()(**enc, labels=targets).loss
        torch.testing.assert_close(plain, model.eval()(**enc, labels=targets).loss, atol=1e-5, rtol=1e-5)
    assert (runs[0][0] - plain).abs() > 1e-4


# Per model: dropout probabilities (only those whose flag this checks, 0.5), the groups of
# submodules whose own training flag turns a dropout on in the original (regexes on the module
# paths): the attention modules (their flag gates the attention dropout), T5's nn.Dropout
# modules (called). BART's layer-level dropouts read the layer's flag (as the fused layer
# does); its attention_dropout alone is on here, so the layers' flag must not decide it.
SEQ2SEQ_DROPOUT_FLAGS = {
    "bart": (dict(attention_dropout=0.5), [r".*\.self_attn", r".*\.encoder_attn"]),
    "t5": (dict(dropout_rate=0.5), [r".*\.SelfAttention", r".*\.EncDecAttention", r".*\.layer\.\d+\.dropout",
                                    r".*\.DenseReluDense\.dropout"]),
}


@pytest.mark.parametrize("name", list(SEQ2SEQ_DROPOUT_FLAGS))
def test_each_dropout_follows_the_flag_the_original_reads(name, device, launches):
    """Grad enabled, one layer each. Model in train mode with every dropout's deciding submodule
    in eval: the original's no-dropout logits (float64 rule) and the fused eval logits exactly.
    Model in eval mode with one group of deciding submodules in train: the original drops, the
    fused model too (masks differ: an ON state is checked by differing from the no-dropout
    logits)."""
    probs, groups = SEQ2SEQ_DROPOUT_FLAGS[name]
    model = seq2seq_model(name, device, "sdpa", layers=1, **probs)
    fused = _converted(model, layers=2)
    ref = copy.deepcopy(model).double()
    enc, targets = seq2seq_inputs(name, device)

    def logits(m):
        torch.manual_seed(5)
        with no_fallback():
            return m(**enc, labels=targets).logits

    check_dropout_flags(ref, model, fused, logits, groups, groups, device)
    assert launches["attention_fwd"] == 3 * (2 + len(groups))  # encoder, decoder self and cross per forward


def test_t5_traces_under_torch_compile(device, launches, monkeypatch):
    """A converted T5's training step under torch.compile(fullgraph=True) (aot_eager: dynamo,
    the ops' fake implementations, AOT autograd): no graph break (the 4-D masks are read by
    the kernel as masks while tracing, the position bias reaches its bias input), the eager
    step's loss. One layer each.

    On every torch the package takes: the traced step calls no copy.deepcopy, which Dynamo
    before torch 2.13 cannot trace (a graph break: what torch 2.11 raised on the H200), so here
    copy.deepcopy is made such a break too. Given labels, transformers' T5 still builds a KV
    cache unless told use_cache=False, and that cache's config lookup deep-copies T5's config
    (transformers' code, converted or not): the training step passes use_cache=False
    (docs/torch-compile.md)."""
    model = _converted(seq2seq_model("t5", device, "sdpa", layers=1).train(), layers=2)
    enc, targets = seq2seq_inputs("t5", device)
    want = model(**enc, labels=targets, use_cache=False).loss
    torch._dynamo.reset()
    before = launches["attention_fwd"]
    monkeypatch.setattr(copy, "deepcopy", torch.compiler.disable(copy.deepcopy))  # as Dynamo < 2.13 sees it
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(**enc, labels=targets, use_cache=False).loss
    got.backward()
    assert launches["attention_fwd"] - before == 3
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_t5_head_dim_outside_the_kernel_runs_sdpa_with_the_bias(device, launches):
    """d_kv 8 (below the kernel's 16): the converted layers' attention runs SDPA after a warning,
    the position bias inside its float mask (the padding and causality as finfo.min there),
    its gradient reaching relative_attention_bias; the loss and that gradient the original's."""
    model = seq2seq_model("t5", device, "sdpa", d_kv=8).train()
    fused = _converted(model)
    enc, targets = seq2seq_inputs("t5", device)
    want = model(**enc, labels=targets).loss
    want.backward()
    with pytest.warns(UserWarning, match="head dim 8"):
        got = fused(**enc, labels=targets).loss
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for stack in ("encoder", "decoder"):
        path = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        torch.testing.assert_close(fused.get_parameter(path).grad, model.get_parameter(path).grad, atol=1e-5,
                                   rtol=1e-4)
    assert launches["attention_fwd"] == 0 and launches["add_norm_fwd"] == NORMS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_bart_post_ln_layer_follows_cuda_autocast(dtype, device, launches, cuda_autocast_norms):
    """A converted BartEncoderLayer (Post-LN) given 16-bit hidden states under autocast whose
    policy runs layer_norm in fp32 (CUDA's; emulated on the CPU): its norms' outputs, the stream
    and the layer's output, are fp32 as the original layer's (fp32 input: fp32 already). Output
    and the input's gradient against the float64 layer, the original computed the CUDA way (and
    on CUDA under torch.autocast('cuda')) the baseline."""
    model = seq2seq_model("bart", device, "sdpa").eval()
    fused = _converted(model)
    layer, original = fused.model.encoder.layers[0], model.model.encoder.layers[0]
    x = torch.randn(2, 9, 64).to(device=device, dtype=dtype)
    g = torch.randn(2, 9, 64, dtype=torch.float64).to(device)
    check_post_ln_layer_under_cuda_autocast(layer, original, x, g, device, launches,
                                            call=lambda lay, inp: lay(inp, attention_mask=None))
