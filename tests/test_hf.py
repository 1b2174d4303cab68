"""Hugging Face models converted in place: logits, gradients, greedy generation, state dicts.

Each architecture is a tiny random model built from its config (no download): hidden 64 with
4 heads gives head dim 16, the attention kernel's smallest; 2 layers so that the residual
stream crosses a layer boundary; vocabulary 96; sequences of 9 tokens (not a multiple of any
block size). The LLaMA family uses 2 KV heads (GQA). Weights are drawn with std 0.2 (HF's
0.02 makes tiny models' logits nearly flat, so greedy tokens would tie). Comparison rule as in
tests/test_blocks.py: err(converted) <= 4 x err(original, same dtype) + atol x max(1, |ref|)
against the original model run in float64.
"""
import copy
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fused_block  # noqa: E402
from fused_block import profiling  # noqa: E402
from fused_block.attention import attention_qkvpacked  # noqa: E402
import numerics  # noqa: E402
import op_counting  # noqa: E402
from fused_block import hf  # noqa: E402

import hf_testing  # noqa: E402
from hf_testing import B, L, V  # noqa: E402
from hf_testing import as_cuda_autocast_computes, check_post_ln_layer_under_cuda_autocast  # noqa: E402
from hf_testing import check_dropout_flags, dropout_modes  # noqa: E402
from hf_testing import assert_close as _assert_close  # noqa: E402
from hf_testing import inputs as _inputs  # noqa: E402
from hf_testing import model as _model  # noqa: E402
from hf_testing import no_fallback as _no_fallback  # noqa: E402


def _converted(model):
    with _no_fallback():
        return fused_block.convert(copy.deepcopy(model))


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "bert"]


CAUSAL = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2")


def _bounded(values, default):
    """``values`` as parameters: those in ``default`` in the default run, the others behind the
    heavy marker (cases whose code another default case runs: Mistral's and Qwen2's conversion
    is LLaMA's, the causal LM loss head is every family's)."""
    return [v if v in default else pytest.param(v, marks=pytest.mark.heavy) for v in values]


def _training_steps(models, ids, mask):
    """One training step's forward (labels: the tokens, padding ignored) and backward of each
    model of ``models`` (name -> model): name -> (its output, its parameters by name)."""
    labels = ids.masked_fill(mask == 0, -100)
    outs = {}
    for name, m in models.items():
        with _no_fallback():
            out = m(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs[name] = (out, dict(m.named_parameters()))
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_gradients_match_the_original(arch, device, launches):
    """fp32 logits, the loss and the gradient of every parameter (one training step's loss,
    padding included) against the original in float64; the kernels ran. The causal LMs'
    training loss is the fused linear + cross-entropy: no logits in its output; the logits are
    compared on a separate no-grad call."""
    model = _model(arch, device).train()
    fused = _converted(model)
    assert fused.training and all(m.training for m in fused.modules())
    ref = copy.deepcopy(model).double()
    ids, mask = _inputs(arch, device)
    outs = _training_steps(dict(ref=ref, base=model, fused=fused), ids, mask)
    _assert_close("loss", outs["fused"][0].loss, outs["ref"][0].loss, outs["base"][0].loss, torch.float32, device)
    for pname, p in outs["ref"][1].items():
        g = outs["fused"][1][pname].grad
        assert g is not None, pname
        _assert_close(f"{pname}.grad", g, p.grad, outs["base"][1][pname].grad, torch.float32, device)
    assert launches["attention_fwd"] == launches["attention_bwd"] == 2 and launches["add_norm_bwd"] >= 4
    assert launches["add_norm_fwd"] >= 4  # per layer: attention 1, norms 2
    # RoPE on the packed QKV output, forward and backward per layer (Qwen3: with its q/k norms)
    rope = "rope_qknorm" if arch == "qwen3" else "rope_qkvpacked"
    assert launches[rope] == (4 if arch not in ("gpt2", "bert") else 0) and launches["rope"] == 0
    # per layer: QKV and out projections 1 GEMM forward and 2 backward each; the FFN (SwiGLU in
    # the LLaMA family) 2 forward and 4 backward: the MLP runs fused in every architecture. The
    # causal LMs' head: one chunk (18 tokens), its products (logits, dhidden, dW) on cuBLAS.
    causal = arch in CAUSAL
    assert launches["matmul"] == 2 * 12 and launches["act_grad"] == 0
    assert launches["lce_ce"] == launches["lce_logits"] == launches["lce_dw"] == (1 if causal else 0)
    assert (outs["fused"][0].logits is None) == causal
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
                  for m in (ref, model, fused)]
    _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)


# Per family: the dropout probabilities (0.5: every dropout discriminates), the groups of
# submodules whose own training flag turns a dropout on in the original's forward (regexes on
# the module paths: the attention modules, whose flag gates the attention dropout; the
# nn.Dropout modules the original calls; BLOOM's attention and MLP modules, whose flag gates
# their dropout_add), and the submodules whose flag the original does not read for it (GPT-2's
# attn_dropout and BERT's attention.self.dropout: only their p is read; under GPT-2's eager
# reorder_and_upcast_attn the attention module's, attn_dropout being called).
DROPOUT_FLAGS = {
    "gpt2": (dict(resid_pdrop=0.5, attn_pdrop=0.5),
             [r".*\.h\.\d+\.attn", r".*\.attn\.resid_dropout", r".*\.mlp\.dropout"], r".*\.attn\.attn_dropout"),
    "gpt2-reorder": (dict(resid_pdrop=0.5, attn_pdrop=0.5, reorder_and_upcast_attn=True),
                     [r".*\.attn\.attn_dropout", r".*\.attn\.resid_dropout", r".*\.mlp\.dropout"],
                     r".*\.h\.\d+\.attn"),
    "bert": (dict(hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5),
             [r".*\.attention\.self", r".*\.attention\.output\.dropout", r".*\.\d+\.output\.dropout"],
             r".*\.attention\.self\.dropout"),
    "llama": (dict(attention_dropout=0.5), [r".*\.self_attn"], None),
    "phi3": (dict(attention_dropout=0.5, resid_pdrop=0.5),
             [r".*\.self_attn", r".*\.resid_attn_dropout", r".*\.resid_mlp_dropout"], None),
    "bloom": (dict(hidden_dropout=0.5, attention_dropout=0.5),
              [r".*\.self_attention", r".*\.self_attention\.attention_dropout", r".*\.h\.\d+\.mlp"], None),
}


@pytest.mark.parametrize("arch", list(DROPOUT_FLAGS))
def test_each_dropout_follows_the_flag_the_original_reads(arch, device, launches):
    """Dropout p = 0.5, grad enabled, one layer. Model in train mode with every dropout's
    deciding submodule in eval: the original's no-dropout logits (float64 rule), and the fused
    eval logits exactly. Model in eval mode with one group of deciding submodules in train: the
    original drops, the fused model too (masks differ: an ON state is checked by differing from
    the no-dropout logits). A submodule whose flag the original ignores, alone in train: no
    dropout."""
    probs, groups, ignored = DROPOUT_FLAGS[arch]
    every = groups + ([ignored] if ignored else [])
    if arch == "gpt2-reorder":  # eager only: sdpa ignores the flag
        model = _model("gpt2", device, "eager", layers=1, **probs)
    else:
        model = _model(arch, device, layers=1, **probs)
    fused = _converted(model)
    ref = copy.deepcopy(model).double()
    for m in ref.modules():  # the reorder refuses float64; without it, the same function
        if getattr(m, "reorder_and_upcast_attn", False):
            m.reorder_and_upcast_attn = False
    ids, mask = _inputs(model.config.model_type, device)

    def logits(m):
        torch.manual_seed(5)
        with _no_fallback():
            return m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)

    plain, fused_plain = check_dropout_flags(ref, model, fused, logits, groups, every, device)
    if ignored is not None:
        for m in (model, fused):
            dropout_modes(m, every, True, on=ignored)
        torch.testing.assert_close(logits(model), plain, atol=1e-5, rtol=1e-5)  # the original does not drop
        torch.testing.assert_close(logits(fused), fused_plain, atol=0, rtol=0)
    assert launches["attention_fwd"] == 2 + len(groups) + (ignored is not None)


# A dropout field of each family's fused forwards at 1.0 (torch's dropout takes p = 1: its input
# times 0, zero gradients upstream; the fused ops' dropouts stop below 1): the residual, hidden
# and output dropouts of the fused linear / MLP / add-norm ops in each family that has them
# (BART Post-LN, Whisper Pre-LN, T5 gated and ReLU). The attention dropout: under eager's masks,
# whose rows that see no key (the left-padded ones) give V's mean, dropped too at p = 1 (LLaMA's
# and BLOOM's; the kernel's p = 1 is tests/test_hf_interface.py's). The model's default
# implementation (sdpa) or, for some, attn_implementation="fused_block". (The embedding
# dropouts, gpt2's embd_pdrop and phi3's, run torch's module unconverted: checked once by hand.)
DROPOUT_ONE = [("gpt2", "resid_pdrop", "fused_block"), ("bert", "hidden_dropout_prob", None),
               ("phi3", "resid_pdrop", "fused_block"), ("llama", "attention_dropout", "eager"),
               ("bloom", "hidden_dropout", None), ("bloom", "attention_dropout", None),
               ("bart", "dropout", "fused_block"), ("whisper", "dropout", None),
               ("whisper", "activation_dropout", None), ("t5", "dropout_rate", None),
               ("t5-v1.0", "dropout_rate", "fused_block")]


@pytest.mark.parametrize("arch, field, implementation", DROPOUT_ONE)
def test_dropout_one_drops_as_the_original(arch, field, implementation, device, launches):
    """One layer (per stack) in training mode with ``field`` = 1.0, converted: the loss and every
    parameter's gradient the original's (float64 rule), the fused kernels ran, nothing fell
    back. Before: ``ValueError: dropout_p must be in [0, 1)`` from the fused linear / MLP /
    add-norm ops, and under eager's masks the rows that see no key kept V's mean at an
    attention dropout of 1 (loss 5.94 for the original's 5.75 in LLaMA)."""
    seq2seq = arch in ("bart", "whisper", "t5", "t5-v1.0")
    eager = "eager" if implementation == "eager" else "sdpa"  # the float64 reference's (the interface takes no float64)
    if seq2seq:
        model = hf_testing.seq2seq_model(arch, device, eager, layers=1, **{field: 1.0})
        enc, targets = hf_testing.seq2seq_inputs(arch, device)
        inputs = dict(**enc, labels=targets)
    else:
        model = _model(arch, device, eager, layers=1, **{field: 1.0})
        ids, mask = _inputs("llama" if eager == "eager" else arch, device)  # eager: left padding, rows of no key
        inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    model.train()
    ref = copy.deepcopy(model).double()
    if implementation == "fused_block":
        model.set_attn_implementation(implementation)
    fused = _converted(model)
    outs = {}
    for name, m in (("ref", ref), ("base", model), ("fused", fused)):
        dtype = torch.float64 if name == "ref" else torch.float32
        with _no_fallback():
            out = m(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()})
        out.loss.backward()
        outs[name] = (out.loss, {k: p.grad for k, p in m.named_parameters()})
    if not torch.isfinite(outs["ref"][0]):  # eager's rows of no key in float64: finfo(float64).min, -inf in
        outs["ref"] = outs["base"]  # its fp32 softmax, NaN; the original's fp32 values the reference
    _assert_close("loss", outs["fused"][0], outs["ref"][0].double(), outs["base"][0], torch.float32, device)
    for pname, g64 in outs["ref"][1].items():
        g = outs["fused"][1][pname]
        assert (g is None) == (g64 is None), pname  # (None: the padding token's embedding row)
        if g is not None:
            _assert_close(f"{pname}.grad", g, g64.double(), outs["base"][1][pname], torch.float32, device)
    assert launches["matmul"] > 0 and launches["add_norm_fwd"] > 0 and launches["add_norm_bwd"] > 0


@pytest.mark.parametrize("arch", _bounded(ARCHS, ("llama", "qwen3", "phi3", "gpt2", "bert")))
def test_bf16_logits(arch, device, launches):
    model = _model(arch, device).eval()
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model).to(torch.bfloat16)
    fused = _converted(base)
    ids, mask = _inputs(arch, device)
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0) for m in (ref, base, fused)]
    assert logits[2].dtype == torch.bfloat16
    _assert_close("logits", logits[2], logits[0], logits[1], torch.bfloat16, device)
    assert launches["attention_fwd"] == 2


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_loss_and_gradients(arch, device, launches):
    """A bf16 training step (padding included): the loss (the fused linear + cross-entropy) and
    every parameter's gradient within the rule against the float64 original, beside the
    original's own bf16 error; every gradient in bf16, our kernels forward and backward."""
    model = _model(arch, device).train()
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model).to(torch.bfloat16)
    fused = _converted(base)
    ids, mask = _inputs(arch, device)
    outs = _training_steps(dict(ref=ref, base=base, fused=fused), ids, mask)
    _assert_close("loss", outs["fused"][0].loss, outs["ref"][0].loss, outs["base"][0].loss, torch.bfloat16, device)
    for pname, p in outs["ref"][1].items():
        g = outs["fused"][1][pname].grad
        assert (g is None) == (p.grad is None), pname
        if g is not None:
            assert g.dtype == torch.bfloat16, pname
            _assert_close(f"{pname}.grad", g, p.grad, outs["base"][1][pname].grad, torch.bfloat16, device)
    assert launches["attention_bwd"] == 2 and launches["add_norm_bwd"] >= 4 and launches["lce_ce"] == 1


@pytest.mark.parametrize("arch, eps", [("gpt2", "layer_norm_epsilon"), ("llama", "rms_norm_eps")])
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the norm kernels' padding rows (masked)
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_norm_eps_zero(arch, eps, device, launches):
    """A config whose norms' eps is 0 (torch's LayerNorm and RMSNorm take it): the converted
    model's fused norms run at eps = 0 (no layer left unconverted: no fused_block warning), its
    fp32 logits as the original's."""
    model = _model(arch, device, **{eps: 0.0}).eval()
    ref = copy.deepcopy(model).double()
    fused = _converted(model)
    ids, mask = _inputs(arch, device)
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
                  for m in (ref, model, fused)]
    _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)
    assert launches["add_norm_fwd"] >= 4  # per layer: 2


def _first_parting(want, got, steps):
    """Greedy tokens (``generate``'s sequences and scores, new tokens only) agree until the first
    step where the original's own logits nearly tie between its token and the converted
    model's (their gap within fp32 noise, 1e-4 of the logits' size: not a wrong answer, a coin
    a device's rounding may flip); the logits agree to that size at every step with the same
    prefix."""
    w, g = want.sequences[0, -steps:], got.sequences[0, -steps:]
    parted = (w != g).nonzero()
    n = parted[0].item() if len(parted) else steps
    for i in range(min(n + 1, steps)):  # the same prefix: the same logits, within fp32 noise
        a, b = got.scores[i][0], want.scores[i][0]
        finite = b.isfinite()
        assert torch.equal(finite, a.isfinite()) and torch.equal(a[~finite], b[~finite]), i
        tol = 1e-4 * max(1.0, b[finite].abs().max().item())
        assert (a[finite] - b[finite]).abs().max().item() <= tol, (i, (a[finite] - b[finite]).abs().max().item())
        if i == n:
            lead = (b[w[n]] - b[g[n]]).item()
            assert lead <= tol, f"step {n}: token {g[n].item()}, the original's {w[n].item()} leads by {lead:.3e}"


def test_generations_part_only_at_a_near_tie():
    """_first_parting's rule on made-up steps: the same tokens pass; a parting where the logits
    nearly tie passes (later steps, after different prefixes, are not compared); a parting
    where the original's token leads clearly fails, as do logits apart before any parting."""
    from types import SimpleNamespace

    def run(tokens, scores):
        return SimpleNamespace(sequences=torch.tensor([tokens]), scores=[torch.tensor([s]) for s in scores])

    want = run([1, 0, 2], [[0.0, 5.0, 1.0], [3.0, 3.0 - 2e-4, float("-inf")], [0.0, 0.0, 9.0]])
    _first_parting(want, run([1, 0, 2], [[0.0, 5.0 + 2e-4, 1.0], [3.0, 3.0 - 2e-4, float("-inf")], [0, 0, 9.0]]), 3)
    _first_parting(want, run([1, 1, 0], [[0.0, 5.0, 1.0], [3.0 - 2e-4, 3.0, float("-inf")], [7.0, 0, 0]]), 3)
    with pytest.raises(AssertionError, match="leads by"):
        clear = run([1, 0, 2], [[0.0, 5.0, 1.0], [3.0, 2.0, float("-inf")], [0.0, 0.0, 9.0]])
        _first_parting(clear, run([1, 1, 0], [[0.0, 5.0, 1.0], [3.0, 2.0, float("-inf")], [7.0, 0, 0]]), 3)
    with pytest.raises(AssertionError):
        _first_parting(want, run([1, 0, 2], [[0.0, 5.01, 1.0], [3.0, 3.0 - 2e-4, float("-inf")], [0, 0, 9.0]]), 3)


@pytest.mark.parametrize("arch", _bounded(CAUSAL, ("llama", "qwen3", "phi3", "gpt2")))
def test_greedy_generation_matches(arch, device, launches, monkeypatch):
    """16 greedy tokens with the KV cache (prefill, then one query against the cached keys).
    One layer: each token is a full interpreted forward. GPT-2's one layer needs larger
    weights than std 0.2 not to repeat one token. The end-of-sequence token is held back
    (min_new_tokens) so that both run 16 steps whatever the weights (on the H200 the original
    Phi-3 ended after 9). The tokens agree up to a near tie of the original's logits, and the
    logits to fp32 noise until then (``_first_parting``)."""
    model = _model(arch, device, layers=1, initializer_range=1.0 if arch == "gpt2" else 0.2).eval()
    fused = _converted(model)
    ids, _ = _inputs(arch, device)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=V - 1, output_scores=True,
              return_dict_in_generate=True)
    want = model.generate(ids[:1], **kw)
    packed = []
    monkeypatch.setattr(hf._attention, "attention_qkvpacked",
                        lambda *a, **k: packed.append(1) or attention_qkvpacked(*a, **k))
    got = fused.generate(ids[:1], **kw)
    assert want.sequences.shape == got.sequences.shape == (1, L + 16)
    assert len(set(want.sequences[0, L:].tolist())) > 3  # a real sequence, not one token
    _first_parting(want, got, 16)
    assert launches["attention_fwd"] == 16
    assert len(packed) == 1  # the prefill reads the packed QKV tensor; decoding attends to the cache
    assert launches["rope_qknorm" if arch == "qwen3" else "rope_qkvpacked"] == (16 if arch != "gpt2" else 0)
    assert launches["matmul"] == 16 * 4  # QKV, out, and the MLP's two GEMMs per forward


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_batched_generation_with_left_padding(implementation, device, launches):
    """Left padding in both mask forms (SDPA's bool mask, eager's additive float mask): the
    padding reaches the kernel as a key padding mask, also while decoding from the cache."""
    model = _model("llama", device, attn_implementation=implementation, layers=1).eval()
    fused = _converted(model)
    ids, mask = _inputs("llama", device)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=V - 1)
    with _no_fallback():
        got = fused.generate(ids, **kw)
    assert torch.equal(got, model.generate(ids, **kw))
    assert launches["attention_fwd"] == 3


def test_continuous_batching_runs_the_original_layers(device, launches):
    """generate_batch (transformers' continuous batching, sdpa): its PagedAttentionCache's update
    takes the attention's kwargs (read / write indices; it leaves cu_seq_lens_k there), which
    the fused layers' update(k, v, layer_idx) does not pass: it raised inside the manager and
    every request came back failed and empty. Such a cache runs the layers' original forward
    (one warning); the tokens are the original's, the final norm still fused. No flash
    switch, no CUDA graphs: the same path on every device."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    model = _model("llama", device, layers=1, tie_word_embeddings=False, initializer_range=0.5).eval()
    fused = _converted(model)
    ids, _ = _inputs("llama", device)
    prompts = [ids[0].tolist(), ids[1, 3:].tolist()]  # two lengths in one ragged batch
    gen = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=V - 1)
    cb = dict(generation_config=gen, warmup=False)

    def tokens(m):
        out = m.generate_batch(inputs=prompts, continuous_batching_config=ContinuousBatchingConfig(
            auto_switch_to_flash=False, use_cuda_graph=False, page_size=16, num_blocks=4, max_batch_tokens=32,
            max_blocks_per_request=0), **cb)  # a small cache: no allocation sized by the free memory
        return [out[k].generated_tokens for k in sorted(out)]

    want = tokens(model)
    assert [len(t) for t in want] == [3, 3]
    with pytest.warns(UserWarning, match="PagedAttentionCache"):
        assert tokens(fused) == want
    assert launches["attention_fwd"] == 0 and launches["add_norm_fwd"] > 0


# Query rows that see no key: the left-padded positions of a causal model and every position of
# an all-zero attention_mask row. Eager's additive masks (and BLOOM's, always eager) give them
# the mean of V (score + finfo.min rounds to finfo.min for every key: equal logits); with
# sinks (gpt-oss) the sink takes the whole weight and they give 0.
@pytest.mark.parametrize("arch,implementation", [("llama", "eager"), ("gemma2", "eager"), ("bert", "eager"),
                                                 ("bloom", None), ("gpt_oss", None)])
def test_rows_that_see_no_key_match_the_original(arch, implementation, device, launches):
    """Every logit, padded positions included, and a loss that counts the padded positions'
    labels are the original's (fp32, the original's own answer: in float64 its fp32 softmax of
    a float64 ``finfo.min`` gives NaN there), with the kernels run (no fallback)."""
    model = _model(arch, device, attn_implementation=implementation, layers=1).eval()
    fused = _converted(model)
    ids, _ = _inputs("llama", device)
    left = torch.ones_like(ids)
    left[1, :3] = 0  # left padding
    empty = torch.ones_like(ids)
    empty[1] = 0  # a row of no token at all
    for mask in (left, empty):
        with torch.no_grad(), _no_fallback():
            got, want = fused(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    if arch != "bert":
        with _no_fallback():
            got, want = (m(ids, attention_mask=left, labels=ids).loss for m in (fused, model))
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    assert launches["attention_fwd"] == 3 - (arch == "bert")


def test_dead_rows_are_read_with_the_mask(device):
    """Eager's additive 4-D mask of a left-padded causal batch is read once (one
    synchronization) into causal + key padding for the kernel and the rows of no visible key;
    a bool mask's (sdpa's) rows of no visible key are kept apart, and a mask that has none
    gives no rows (nothing added to the kernel's output)."""
    B_, L_ = 2, 6
    pad = torch.ones(B_, L_, dtype=torch.bool, device=device)
    pad[1, :2] = False
    keep = torch.ones(L_, L_, dtype=torch.bool, device=device).tril()[None, None] & pad[:, None, None, :]
    additive = torch.zeros(B_, 1, L_, L_, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
    p = hf._attention.plan(additive, B_, L_, L_, True, "sdpa")
    assert p.kernel and p.causal and p.key_padding is not None and p.empty is None
    assert p.dead.tolist() == [[[False] * L_], [[True, True] + [False] * (L_ - 2)]]
    assert p.rows_of_mean(False) is p.dead
    q = hf._attention.plan(keep, B_, L_, L_, True, "sdpa")
    assert q.dead is None and q.rows_of_mean(False) is None and q.rows_of_mean(True).equal(p.dead)
    unpadded = torch.zeros(1, 1, L_, L_, device=device).masked_fill(~keep[:1], torch.finfo(torch.float32).min)
    assert hf._attention.plan(unpadded, 1, L_, L_, True, "sdpa").dead is None


# The families with their own layer code (LLaMA's stands for Mistral and Qwen2); one layer
# where a layer is the slow part in the interpreter.
@pytest.mark.parametrize("arch,layers", [("llama", 2), ("qwen3", 2), ("phi3", 2), ("gpt2", 2), ("gemma3", 1),
                                         ("gpt_oss", 2), ("bloom", 1)])
def test_state_dict_and_save_pretrained_round_trip(arch, layers, device):
    model = _model(arch, device, layers=layers).eval()
    keys = list(model.state_dict())
    fused = copy.deepcopy(model)
    params = list(fused.parameters())
    assert fused_block.convert(fused) is fused
    assert list(fused.state_dict()) == keys
    assert all(a is b for a, b in zip(fused.parameters(), params))  # the same Parameter objects
    ids, mask = _inputs(arch, device)
    # from_pretrained would pick gpt-oss's grouped_mm experts (another summation order than the
    # constructor's eager ones: 2e-6 apart without any conversion); load with the original's.
    load = dict(experts_implementation=model.config._experts_implementation) if arch == "gpt_oss" else {}
    with tempfile.TemporaryDirectory() as tmp:
        fused.save_pretrained(tmp)
        reloaded = type(model).from_pretrained(tmp, **load).to(device).eval()  # loads into the plain model
        again = fused_block.convert(type(model).from_pretrained(tmp, **load).to(device).eval())
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, want, atol=0, rtol=0)
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, fused(ids, attention_mask=mask).logits,
                                   atol=0, rtol=0)


def test_unfusable_inputs_run_the_original_code(device, launches):
    """output_attentions, a head dim below the kernel's range, a user hook on a skipped
    submodule: one-time warnings, the original's answers. A sliding window that cuts keys
    (eager's 4-D mask, causal + padding + the window) runs the kernel's window, without a warning."""
    model = _model("mistral", device, attn_implementation="eager", sliding_window=4).eval()
    fused = fused_block.convert(copy.deepcopy(model))
    ids, mask = _inputs("mistral", device)
    with torch.no_grad():
        want = model(ids, attention_mask=mask)
        before = launches["attention_fwd"]
        with _no_fallback():
            got = fused(ids, attention_mask=mask)
        assert launches["attention_fwd"] > before
        keep = mask[..., None] == 1  # padding queries: every key masked (HF's finite minimum)
        torch.testing.assert_close(got.logits.masked_fill(~keep, 0), want.logits.masked_fill(~keep, 0),
                                   atol=1e-5, rtol=0)
        with pytest.warns(UserWarning, match="output_attentions|attention weights"):
            got = fused(ids, output_attentions=True)
        want = model(ids, output_attentions=True)
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b)
    small = _model("llama", device, layers=1, hidden_size=32, head_dim=8).eval()  # below the kernel's 16
    with torch.no_grad(), pytest.warns(UserWarning, match="head dim 8"):
        got = fused_block.convert(copy.deepcopy(small))(ids, attention_mask=mask).logits
        want = small(ids, attention_mask=mask).logits
    keep = mask[..., None] == 1
    torch.testing.assert_close(got.masked_fill(~keep, 0), want.masked_fill(~keep, 0), atol=1e-5, rtol=0)
    seen = []
    fused.model.layers[0].input_layernorm.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad(), pytest.warns(UserWarning, match="forward hook"):
        got = fused(ids)
    assert len(seen) == 1  # a user's hook on a submodule the fused path skips still runs
    torch.testing.assert_close(got.logits, model(ids).logits)


def test_importing_fused_block_does_not_import_transformers():
    code = "import sys, fused_block; fused_block.convert(__import__('torch').nn.Linear(2, 2)); " \
           "assert 'transformers' not in sys.modules, 'transformers was imported'"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_bench_spec_cases_and_numerics():
    """bench/specs/hf.py: the cases build without CUDA (meta models for the counts). Its CPU
    numerics rows repeat test_bf16_logits and run in the bench job."""
    from bench.specs import hf as spec

    quick, full = spec.cases(True), spec.cases(False)
    assert {(c.op, c.shape["model"]) for c in quick} == {(c.op, c.shape["model"]) for c in full}
    assert all(set(c.providers) - {"fused_block[rows]"} == {"fused_block", "eager", "torch.compile"} for c in full)
    # the token-loop loss beside the memory rule's vocabulary-outer one: training steps whose
    # loss takes the latter (llama-1b, gemma-2b)
    assert {(c.op, c.shape["model"]) for c in full if "fused_block[rows]" in c.providers} == {
        ("hf_train", "llama-1b"), ("hf_train", "gemma-2b")}
    train = {c.shape["model"]: c for c in full if c.op == "hf_train"}
    # 2 T P with P ~ 124M matmul weights (GPT-2 small, LM head included), times 3 for the backward
    assert abs(train["gpt2-small"].flops / (3 * 2 * 8 * 1024 * 123.5e6) - 1) < 0.2
    gen = {c.shape["model"]: c for c in full if c.op == "hf_generate"}
    assert gen["llama-1b"].bytes == 1_100_048_384 * 2 * 32  # every bf16 weight once per generated token
    # T5 at Flan-T5-base's shape: the decoder's matmul weights (but the cross-attention's k and v)
    # and the untied LM head, per generated token; its step's linears on 8 x (512 + 128) tokens
    d, f, layers, vocab = 768, 2048, 12, 32128
    decoder = layers * (6 * d * d + 3 * d * f)  # self q/k/v/o, cross q/o, wi_0/wi_1/wo
    assert gen["t5-base"].bytes == (decoder + vocab * d) * 2 * 32
    encoder = layers * (4 * d * d + 3 * d * f)
    linears = 2 * 8 * (512 * (encoder + layers * 2 * d * d) + 128 * (decoder + vocab * d))
    assert abs(train["t5-base"].flops / (3 * linears) - 1) < 0.1  # the score products: ~9%


def test_gradient_checkpointing_and_torch_compile(device, launches):
    """The converted layer keeps transformers' activation checkpointing (the forward is
    recomputed in backward) and traces under torch.compile (aot_eager: dynamo, the ops' fake
    implementations and AOT autograd; inductor's CPU codegen would add minutes here)."""
    model = _converted(_model("llama", device, layers=1).train())
    ids, _ = _inputs("llama", device)
    loss = model(ids, labels=ids).loss
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    before = launches["attention_fwd"]
    model(ids, labels=ids).loss.backward()
    assert launches["attention_fwd"] - before == 2  # forward, and its recomputation in backward
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, atol=0, rtol=0)
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    model.zero_grad()
    torch._dynamo.reset()
    before = launches["rope_qkvpacked"]
    compiled_loss = torch.compile(model, backend="aot_eager")(ids, labels=ids).loss
    compiled_loss.backward()
    assert launches["rope_qkvpacked"] - before == 2
    torch.testing.assert_close(compiled_loss, loss, atol=1e-6, rtol=0)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


def test_rope_tables_and_unknown_mask_conventions(device, launches):
    """Without a model-level rotary module the fused RoPE reads the layer's cos/sin tables (any
    rope scaling the model computed); a causal layer handed a padding-only (B, 1, 1, L) mask (the
    convention of older transformers, causality applied inside) runs its original forward."""
    model = _model("llama", device, layers=1).eval()
    fused = _converted(model)
    fused.model.layers[0]._fused_block.rotary = None
    ids, mask = _inputs("llama", device)
    with torch.no_grad(), _no_fallback():
        got = fused(ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
    keep = mask[..., None] == 1
    torch.testing.assert_close(got.masked_fill(~keep, 0), want.masked_fill(~keep, 0), atol=2e-5, rtol=0)
    assert launches["rope_qkvpacked"] == 1
    layer, plain = fused.model.layers[0], model.model.layers[0]
    x = numerics.randn(B, L, 64, dtype=torch.float32, device=device)
    pos = torch.arange(L, device=device)[None]
    emb = model.model.rotary_emb(x, pos)
    padding_only = torch.zeros(B, 1, 1, L, device=device)
    padding_only[1, ..., :3] = torch.finfo(torch.float32).min
    with torch.no_grad(), pytest.warns(UserWarning, match=r"attention mask of shape \(2, 1, 1, 9\)"):
        out = layer(x, attention_mask=padding_only, position_ids=pos, position_embeddings=emb)
        ref = plain(x, attention_mask=padding_only, position_ids=pos, position_embeddings=emb)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_llama_layer_step_runs_no_unfused_pytorch_ops(device, launches):
    """A converted LlamaDecoderLayer's training step: no PyTorch matmul, SiLU or multiply (the
    MLP is the fused SwiGLU, its residual add in the down projection's epilogue) and no split,
    copy or cat of activations or their gradients (RoPE and attention on the packed QKV
    tensor). The two cats are the q/k/v weights' concatenation for the QKV GEMM, which the
    converted model must redo while the weights train (they stay separate Parameters), in the
    forward and again in the backward (the copy is not kept between them)."""
    model = _converted(_model("llama", device, layers=1).train())
    layer = model.model.layers[0]
    x = numerics.randn(B, L, 64, dtype=torch.float32, device=device, requires_grad=True)
    pos = torch.arange(L, device=device)[None]
    emb = model.model.rotary_emb(x, pos)
    grad = numerics.randn(B, L, 64, dtype=torch.float32, device=device)
    unfused, counts = op_counting.unfused(
        lambda: layer(x, attention_mask=None, position_ids=pos, position_embeddings=emb).backward(grad))
    assert unfused == {"cat": 2}, counts.table()
    assert counts.triton["matmul"] == 12 and counts.triton["rope_qkvpacked"] == 2, counts.table()
    assert launches["attention_bwd"] == 1
    assert all(p.grad is not None for p in layer.parameters())


def test_packed_qkv_weight_lives_for_its_gemm_only(device, launches, monkeypatch):
    """The QKV GEMM's weight, the concatenation of q/k/v's, is not kept for the backward (a
    copy of the three weights per layer through the step: 1.6 GB at LLaMA-3-8B's 32 layers):
    autograd saves the parts and the backward concatenates them again; every gradient is
    bitwise the one with the copy kept (saved tensors left as they are under an outer hook);
    a part changed in place before the backward raises, as for a saved tensor."""
    import gc
    import weakref

    from fused_block.hf import _core

    model = _converted(_model("llama", device, layers=1).train())
    made, packed = [], _core.packed

    def recording(state, name, tensors, stamp=(), held=()):
        out = packed(state, name, tensors, stamp, held)
        if name == "qkv_weight":
            made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(_core, "packed", recording)
    ids, mask = _inputs("llama", device)

    def loss():
        return model(ids, attention_mask=mask, labels=ids).loss

    out = loss()
    gc.collect()
    assert len(made) == 1 and made[0]() is None  # the copy is gone once the forward returns
    out.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # ours stand aside
        out = loss()
    assert made[1]() is not None  # kept by the outer hooks' saved tensors
    out.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=0, rtol=0)
    out = loss()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    # torch's own F.linear (a plain projection on cuBLAS: dispatch.linear_on_torch) saves a view
    # of the weight (its transpose): kept as the parts too.
    parts = [numerics.randn(n, 8, dtype=torch.float32, device=device, requires_grad=True) for n in (5, 3)]
    x = numerics.randn(4, 8, dtype=torch.float32, device=device, requires_grad=True)
    w = torch.cat(parts)
    with _core.saved_as_parts(w, parts):
        y = torch.nn.functional.linear(x, w)
    gone = weakref.ref(w)
    del w
    gc.collect()
    assert gone() is None
    grads = torch.autograd.grad(y, [x, *parts], torch.ones_like(y))
    want = torch.autograd.grad(torch.nn.functional.linear(x, torch.cat(parts)), [x, *parts], torch.ones_like(y))
    for g, r in zip(grads, want):
        torch.testing.assert_close(g, r, atol=0, rtol=0)


@pytest.mark.parametrize("arch, path, unfused", [("llama", "model.norm", {"pow", "mean", "rsqrt"}),
                                                  ("gpt2", "transformer.ln_f", {"native_layer_norm"})])
def test_model_level_norms_run_fused(arch, path, unfused, device, launches):
    """The norms outside the layers (LLaMA's final norm, GPT-2's ln_f) run the fused norm their
    layers run: a converted model's training step runs none of Hugging Face's RMSNorm ops or
    torch's layer_norm; the state dict is the original's. (Their answers and their weights'
    gradients: the whole models' tests above.)"""
    model = _model(arch, device).train()
    fused = _converted(model)
    assert "_fused_block" in fused.get_submodule(path).__dict__
    assert list(fused.state_dict()) == list(model.state_dict())
    ids, mask = _inputs(arch, device)
    counts = profiling.count_kernels(lambda: fused(ids, attention_mask=mask, labels=ids).loss.backward())
    assert not unfused & set(counts.torch), counts.table()
    assert counts.triton["add_norm_fwd"] == counts.triton["add_norm_bwd"] == 5, counts.table()  # 2 a layer, 1


def test_model_level_norm_runs_the_original_where_its_answer_differs(device, launches):
    """LLaMA's final norm with an fp32 weight and a bf16 input returns fp32 (``weight *
    x.to(bf16)``) where the fused norm returns bf16: the original forward runs, after one
    warning (a float64 input too, and one of another width: the original's error); with the
    input's dtype, the fused norm runs. A model none of whose layers converts keeps its final
    norm as it is."""
    fused = _converted(_model("llama", device).eval())
    norm = fused.model.norm
    x = numerics.randn(B, L, 64, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for inp, reason in ((x, "a torch.float32 weight with a torch.bfloat16 input"),
                            (x.double(), "dtype torch.float64")):
            before = launches["add_norm_fwd"]
            with pytest.warns(UserWarning, match=f"LlamaRMSNorm runs its original forward: {reason}"):
                got = norm(inp)
            assert launches["add_norm_fwd"] == before and got.dtype == torch.promote_types(inp.dtype, torch.float32)
            torch.testing.assert_close(got, type(norm).forward(norm, inp), atol=0, rtol=0)
        with pytest.warns(UserWarning, match=r"an input of shape \(2, 9, 32\)"), pytest.raises(RuntimeError):
            norm(x[..., :32].float())  # the original's own error
        ref64 = type(norm).forward(copy.deepcopy(norm).double(), x.double())
        norm.to(torch.bfloat16)
        base = type(norm).forward(norm, x)
        with _no_fallback():
            got = norm(hidden_states=x)
    assert launches["add_norm_fwd"] == before + 1 and got.dtype == torch.bfloat16
    _assert_close("norm", got, ref64, base, torch.bfloat16, device)

    class Linear(torch.nn.Linear):  # a subclass: the layers' conversion refuses it
        pass

    plain = _model("llama", device).eval()
    for layer in plain.model.layers:
        layer.self_attn.q_proj.__class__ = Linear
    with pytest.warns(UserWarning, match="left unconverted"):
        fused_block.convert(plain)
    assert not any("_fused_block" in m.__dict__ or "forward" in m.__dict__ for m in plain.model.modules())
    # Another stack's layers (a ModuleList's elements) keep their norms, the model's own convert.
    bert = _model("bert", device).eval()
    bert.tower = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.LayerNorm(64))])
    fused_block.convert(bert)
    assert "_fused_block" in bert.bert.embeddings.LayerNorm.__dict__
    assert "_fused_block" not in bert.tower[0][0].__dict__


@pytest.mark.parametrize("dtype", numerics.DTYPES, ids=str)
@pytest.mark.parametrize("params", ["fp32", "input", "bf16"],
                         ids=["fp32-params", "params-in-input-dtype", "bf16-params"])
@pytest.mark.sweep
def test_model_level_layer_norm_follows_cuda_autocast(dtype, params, device, launches, cuda_autocast_norms):
    """GPT-2's final ln_f (a torch.nn.LayerNorm: its output is last_hidden_state) under autocast
    whose policy runs layer_norm in fp32 (CUDA's; emulated on the CPU): a 16-bit input is
    normalized in fp32 with fp32 weight and bias on the fused norm, and the output is fp32, as
    torch's module gives (with fp32 parameters too, where the original forward ran before);
    gradients in the input's and parameters' dtypes. bf16 parameters with an fp32 input: torch
    casts them to fp32 too (the original forward ran there before, with a warning). Against
    float64, torch's module computed the CUDA way (and on CUDA under torch.autocast('cuda')) the
    baseline."""
    fused = _converted(_model("gpt2", device))
    norm = fused.transformer.ln_f
    if params != "fp32":
        norm.to(dtype if params == "input" else torch.bfloat16)
    x = numerics.randn(B, L, 64, dtype=dtype, device=device, requires_grad=True)
    lowp = torch.bfloat16 if dtype == torch.float32 else dtype
    with _no_fallback(), torch.autocast(device.type, dtype=lowp):
        got = norm(x)
    assert got.dtype == torch.float32 and launches["add_norm_fwd"] == 1
    leaves = [x, norm.weight, norm.bias]
    as64 = [t.detach().double().requires_grad_() for t in leaves]
    ref64 = torch.nn.functional.layer_norm(as64[0], (64,), as64[1], as64[2], norm.eps)
    baselines = {"as CUDA's autocast computes": torch.nn.functional.layer_norm(
        x.float(), (64,), norm.weight.float(), norm.bias.float(), norm.eps)}
    if device.type == "cuda":
        with torch.autocast("cuda", dtype=lowp):
            baselines["torch's module under torch.autocast('cuda')"] = torch.nn.LayerNorm.forward(norm, x)
    g = numerics.randn(*got.shape, dtype=torch.float64, device=device)
    grads = torch.autograd.grad((got.double() * g).sum(), leaves)
    grads64 = torch.autograd.grad((ref64 * g).sum(), as64)
    for label, base in baselines.items():
        assert base.dtype == got.dtype, label
        _assert_close(f"out vs {label}", got, ref64, base, torch.float32, device)
        for name, a, w, b, t in zip(("dx", "dweight", "dbias"), grads, grads64,
                                    torch.autograd.grad((base.double() * g).sum(), leaves), leaves):
            assert a.dtype == b.dtype == t.dtype, (label, name)
            _assert_close(f"{name} vs {label}", a, w, b, t.dtype, device)


@pytest.mark.parametrize("dtype", numerics.DTYPES, ids=str)
def test_post_ln_layer_follows_cuda_autocast(dtype, device, launches, cuda_autocast_norms):
    """A converted BertLayer (Post-LN) given 16-bit hidden states under autocast whose policy
    runs layer_norm in fp32 (CUDA's; emulated on the CPU): its norms' outputs, the stream and the
    layer's output, are fp32 as the original layer's (fp32 input: fp32 already). Output and the
    input's gradient against the float64 layer, the original computed the CUDA way (and on CUDA
    under torch.autocast('cuda')) the baseline."""
    model = _model("bert", device).train()
    fused = _converted(model)
    layer = fused.bert.encoder.layer[0]
    assert "_fused_block" in layer.__dict__
    x = numerics.randn(B, L, 64, dtype=dtype, device=device)
    g = numerics.randn(B, L, 64, dtype=torch.float64, device=device)
    check_post_ln_layer_under_cuda_autocast(layer, model.bert.encoder.layer[0], x, g, device, launches)


@pytest.mark.parametrize("dtype", numerics.DTYPES, ids=str)
def test_bloom_post_layernorm_follows_cuda_autocast(dtype, device, launches, cuda_autocast_norms):
    """BLOOM with ``apply_residual_connection_post_layernorm`` (the residuals are the norms'
    outputs) given a 16-bit stream (its embedding norm taken out: that norm alone already makes
    the stream fp32) under autocast whose policy runs layer_norm in fp32 (CUDA's; emulated on
    the CPU): the residuals are fp32, so is the layer's output, as the original's. Logits
    against the float64 model, the original computed the CUDA way (on CUDA also under
    torch.autocast('cuda')) the baseline."""
    model = _model("bloom", device, apply_residual_connection_post_layernorm=True).eval().to(dtype)
    model.transformer.word_embeddings_layernorm = torch.nn.Identity()
    fused = _converted(model)
    originals = as_cuda_autocast_computes(model, device)
    ids, mask = _inputs("bloom", device)
    mask = torch.ones_like(mask)  # no padding: the float64 model's fully masked rows would be NaN
    lowp = torch.bfloat16 if dtype == torch.float32 else dtype
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(ids, attention_mask=mask).logits
        with _no_fallback(), torch.autocast(device.type, dtype=lowp):
            got = fused(ids, attention_mask=mask, output_hidden_states=True)
        assert launches["add_norm_fwd"] == 5  # 2 a layer, ln_f
        for label, orig in originals.items():
            with torch.autocast(device.type, dtype=lowp):
                want = orig(ids, attention_mask=mask, output_hidden_states=True)
            assert got.hidden_states[1].dtype == want.hidden_states[1].dtype == torch.float32, label  # layer 0's
            _assert_close(f"logits vs {label}", got.logits.float(), ref, want.logits.float(), lowp, device)


def test_mlp_without_silu_runs_hugging_faces_module(device, launches):
    """hidden_act other than SiLU (the fused op is SiLU-gated): one warning at conversion, the
    MLP runs Hugging Face's module, everything else stays fused, the answer is the original's."""
    model = _model("llama", device, layers=1, hidden_act="gelu").eval()
    with pytest.warns(UserWarning, match="MLP runs Hugging Face's module.*hidden_act 'gelu'"):
        fused = fused_block.convert(copy.deepcopy(model))
    ids, mask = _inputs("llama", device)
    with torch.no_grad():
        got = fused(ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
    keep = mask[..., None] == 1
    torch.testing.assert_close(got.masked_fill(~keep, 0), want.masked_fill(~keep, 0), atol=2e-5, rtol=0)
    assert launches["matmul"] == 2 and launches["attention_fwd"] == 1  # QKV and out only


def test_cast_model_rotary_frequencies_are_converted_once(device, launches):
    """A model cast to bf16 has bf16 rotary frequencies, which the fused RoPE uses as the
    model's rotary module does (in fp32): converted on the first call, reused while unchanged."""
    model = _converted(_model("llama", device, layers=1).eval().to(torch.bfloat16))
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    ids, _ = _inputs("llama", device)
    pos = torch.arange(L, device=device)[None]
    with torch.no_grad():
        model(ids)
        x = model.model.embed_tokens(ids)
        emb = model.model.rotary_emb(x, pos)
        unfused, counts = op_counting.unfused(model.model.layers[0], x, position_ids=pos, position_embeddings=emb)
    assert unfused == {} and "_to_copy" not in counts.torch, counts.table()  # frequencies, QKV weights cached
    assert launches["rope_qkvpacked"] == 2


def test_model_built_under_inference_mode(device, launches):
    """A model built under torch.inference_mode (its weights and buffers inference tensors,
    which have no version counter): the packed QKV weights and rotary frequencies are made on
    every call instead of cached per version (reading the counter crashed), so a weight changed
    in place there shows in the next call; the original's logits."""
    with torch.inference_mode():
        model = _model("llama", device, layers=1).eval()
        ref = copy.deepcopy(model).double()
        fused = _converted(model)
        ids, mask = _inputs("llama", device)
        for step in range(2):
            if step:  # in place: no version bump to see
                for m in (model, ref, fused):
                    m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
                      for m in (ref, model, fused)]
            _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)
    assert launches["attention_fwd"] == 2


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_frozen_model_trains_after_an_inference_mode_call(arch, device, launches):
    """A frozen body (only the token embeddings train, as with adapters or prompt tuning)
    evaluated under torch.inference_mode first, then trained: the packed QKV weights (and
    LLaMA's rotary frequencies) cached by the inference call were inference tensors, which the
    training call's GEMM saved for the input's gradient ("Inference tensors cannot be saved for
    backward", where the original trains); they are made again outside inference mode, and the
    gradients are the original's."""
    model = _model(arch, device, layers=1).eval()
    ref = copy.deepcopy(model).double()
    fused = _converted(model)
    ids, mask = _inputs(arch, device)
    grads = []
    for m in (ref, model, fused):
        emb = m.get_input_embeddings().weight
        for p in m.parameters():
            p.requires_grad_(p is emb)
        with torch.inference_mode():
            m(ids, attention_mask=mask)
        keep = (mask[..., None] == 1).to(emb.dtype)
        (m(ids, attention_mask=mask).logits * keep).square().mean().backward()
        grads.append(emb.grad)
    _assert_close("embedding grad", grads[2], grads[0], grads[1], torch.float32, device)
    assert launches["attention_bwd"] == 1 and launches["matmul"] > 0


def _eval_logits(models, ids, mask):
    """No-grad logits of ``models`` (the packed QKV weights cached), padding positions zeroed."""
    with torch.no_grad():
        return [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0) for m in models]


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_evaluation_after_a_fused_optimizer_step(arch, device, launches):
    """Training with an evaluation between the steps (as Trainer's evaluation loop) under a
    fused optimizer (``fused=True``: Trainer's default adamw_torch_fused), which writes the
    weights in place without bumping their version counters: the packed q/k/v weight (and
    bias) the no-grad evaluation cached was reused after the step (LLaMA's logits off by 3.2);
    the original's logits with the trained weights."""
    model = _model(arch, device, layers=1).eval()  # eval: no dropout in the training step
    fused = _converted(model)
    opt = torch.optim.AdamW(fused.parameters(), lr=1e-2, fused=True)
    ids, mask = _inputs(arch, device)
    for step in range(2):
        if step:
            _eval_logits([fused], ids, mask)  # the evaluation before the step: caches the packed weights
            logits = fused(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
            logits.square().mean().backward()
            opt.step()
        model.load_state_dict(fused.state_dict())  # the trained weights
        logits = _eval_logits([copy.deepcopy(model).double(), model, fused], ids, mask)
        _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)
    assert launches["attention_bwd"] == 1


def test_packed_weights_follow_new_tensors_at_reused_addresses(device, launches):
    """A weight given a new tensor at the address of a freed one (the allocator reuses it: a
    parametrized weight, recomputed per call, lands where the last call's was; ``param.data =
    ...`` after the old tensor was freed; ``.half().float()``): the packed q/k/v weight was
    keyed by address and version counter, both the same, and reused (the old weight's
    logits). Here the reuse is made certain: numpy's memory, freed by torch and written before
    torch's new tensor takes it. Then weight_norm on k_proj updated in place between
    evaluations, where the allocator decides, and a copy of the converted model: the original's
    logits each time."""
    numpy = pytest.importorskip("numpy")
    if device.type != "cpu":
        pytest.skip("numpy's memory is the CPU's")
    model = _model("llama", device, layers=1).eval()
    fused = _converted(model)
    ids, mask = _inputs("llama", device)
    memory = numpy.empty((64, 64), dtype=numpy.float32)
    q = fused.model.layers[0].self_attn.q_proj
    memory[...] = q.weight.detach().numpy()
    q.weight.data = torch.from_numpy(memory)
    logits = _eval_logits([model, fused], ids, mask)  # cached: q_proj's weight at memory's address
    torch.testing.assert_close(logits[1], logits[0], atol=2e-5, rtol=0)
    q.weight.data = torch.empty(0)  # the tensor on memory is freed
    memory *= 1.5  # ... and the memory given a new tensor with other values
    q.weight.data = torch.from_numpy(memory)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    logits = _eval_logits([copy.deepcopy(model).double(), model, fused], ids, mask)
    _assert_close("logits after a new tensor at the old address", logits[2], logits[0], logits[1], torch.float32,
                  device)
    for m in (model, fused):
        torch.nn.utils.parametrizations.weight_norm(m.model.layers[0].self_attn.k_proj)
    for step in range(4):
        for m in (model, fused):
            with torch.no_grad():
                m.model.layers[0].self_attn.k_proj.parametrizations.weight.original0.mul_(1.25)
        logits = _eval_logits([copy.deepcopy(model).double(), model, fused], ids, mask)
        _assert_close(f"logits, weight_norm step {step}", logits[2], logits[0], logits[1], torch.float32, device)
    clone = copy.deepcopy(fused)  # a copy starts without the cache (weak references are not copied)
    assert not clone.model.layers[0]._fused_block.packed
    del fused
    logits = _eval_logits([model, clone], ids, mask)
    torch.testing.assert_close(logits[1], logits[0], atol=2e-5, rtol=0)
    assert launches["attention_fwd"] == 7


def test_packed_weights_follow_a_weight_viewed_anew(device, launches):
    """A weight given another view of its own storage (``param.data = param.data.t()`` on a
    square q_proj, as a checkpoint converter fixing a layout does; then a view of another
    offset): storage, address of the first element and version are unchanged, so the packed
    q/k/v weight, keyed by those alone, was reused. The key includes shape and strides: the
    original's logits each time."""
    model = _model("llama", device, layers=1).eval()
    fused = _converted(model)
    ids, mask = _inputs("llama", device)
    q = [m.model.layers[0].self_attn.q_proj for m in (model, fused)]
    assert q[0].weight.shape[0] == q[0].weight.shape[1]
    _eval_logits([model, fused], ids, mask)  # cached
    for m in q:
        m.weight.data = m.weight.data.t()
    logits = _eval_logits([copy.deepcopy(model).double(), model, fused], ids, mask)
    _assert_close("logits after q_proj's weight transposed", logits[2], logits[0], logits[1], torch.float32, device)
    assert launches["attention_fwd"] == 2


@pytest.mark.parametrize("change", ["replaced", "hooked"])
def test_a_replaced_or_hooked_rotary_module_gives_its_tables(change, device, launches):
    """The model's rotary module replaced after conversion (another ``rope_parameters``, as for
    a context extension) or given a forward hook that changes its tables: the fused layers
    kept reading the frequencies of the module found at conversion (logits off by 3.8 and 4.0);
    now, where it is no longer at its place, of its class, unhooked and without an instance
    forward (checked per call), they read the tables the model passes them. A copy of the
    converted model reads its own module's frequencies."""
    model = _model("llama", device, layers=1).eval()
    fused = _converted(model)
    clone = copy.deepcopy(fused)
    assert clone.model.layers[0]._fused_block.rotary.current() is clone.model.rotary_emb
    ids, mask = _inputs("llama", device)
    _eval_logits([fused], ids, mask)  # the frequencies read (and cached)
    for m in (model, fused):
        if change == "replaced":
            config = copy.deepcopy(m.config)
            config.rope_parameters = dict(config.rope_parameters, rope_theta=100.0)
            m.model.rotary_emb = type(m.model.rotary_emb)(config=config).to(device)
        else:
            m.model.rotary_emb.register_forward_hook(lambda mod, args, out: (out[0] * 0.5, out[1] * 0.5))
    logits = _eval_logits([copy.deepcopy(model).double(), model, fused], ids, mask)
    _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)
    assert launches["rope_qkvpacked"] == 2


def test_masks_are_not_read_during_cuda_graph_capture(monkeypatch):
    """During capture a sync would invalidate the graph: a 2-D padding mask goes to the kernels
    unread (all-False included), a 4-D mask not seen before goes to the kernel as its bias,
    unread, its rows of no visible key a device tensor; outside capture the same masks are
    read (no padding -> no padding mask; causal 4-D -> the kernels' causal flag)."""
    B, L = 2, 5
    pad = torch.ones(B, L, dtype=torch.long)
    causal4d = torch.full((B, 1, L, L), torch.finfo(torch.float32).min).triu(1)

    def read(*a, **k):
        pytest.fail("a mask value was read")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):  # what synchronizes
        monkeypatch.setattr(torch.Tensor, name, read)
    monkeypatch.setattr(torch, "equal", read)
    monkeypatch.setattr(hf._attention, "_capturing", lambda t: True)
    plan = hf._attention.plan(pad, B, L, L, True, "sdpa")
    assert plan.kernel and plan.causal and plan.key_padding is not None
    plan = hf._attention.plan(causal4d, B, L, L, True, "sdpa")
    assert plan.kernel and plan.bias is causal4d and plan.mask is None and not plan.causal
    assert isinstance(plan.dead, torch.Tensor)
    monkeypatch.undo()
    assert hf._attention.plan(pad, B, L, L, True, "sdpa").key_padding is None
    read = hf._attention.plan(causal4d, B, L, L, True, "sdpa")
    assert read.kernel and read.causal and read.key_padding is None


# ---------------------------------------------------------------------------------------------
# causal LMs: the training loss through the fused linear + cross-entropy
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", _bounded(CAUSAL, ("llama", "gpt2")))  # the loss head is the families' one
def test_causal_lm_loss_semantics(arch, device, launches):
    """transformers' label shift, ignore_index, num_items_in_batch (a tensor and an int),
    shift_labels and return_dict=False, against the original model's loss and gradients; the
    logits when asked for (return_logits=True, or eval mode: Hugging Face's forward)."""
    model = _model(arch, device, layers=1).train()
    fused = _converted(model)
    ids, mask = _inputs(arch, device)
    labels = ids.masked_fill(mask == 0, -100)
    shifted = torch.roll(ids, -1, dims=1)
    for kw in (dict(labels=labels, num_items_in_batch=torch.tensor(11, device=device)),
               dict(labels=labels, num_items_in_batch=5), dict(labels=ids, shift_labels=shifted)):
        want = model(ids, attention_mask=mask, **kw)
        got = fused(ids, attention_mask=mask, **kw)
        assert got.logits is None
        torch.testing.assert_close(got.loss, want.loss, atol=2e-5, rtol=0)
        gw = torch.autograd.grad(want.loss, model.lm_head.weight)[0]
        gf = torch.autograd.grad(got.loss, fused.lm_head.weight)[0]
        torch.testing.assert_close(gf, gw, atol=2e-5, rtol=1e-4)
    ce = launches["lce_ce"]
    assert ce == 3
    # The original's tuple layout, the logits' slot holding None: later fields keep their positions.
    loss, logits, *rest = fused(ids, labels=ids, return_dict=False)
    theirs = model(ids, labels=ids, return_dict=False)
    assert loss.dim() == 0 and logits is None and len(rest) == len(theirs) - 2
    assert [type(r) for r in rest] == [type(t) for t in theirs[2:]]
    with _no_fallback():
        asked = fused(ids, labels=ids, return_logits=True)
        fused.eval()
        evaluated = fused(ids, labels=ids)
    assert asked.logits.shape == evaluated.logits.shape == (B, L, V)
    torch.testing.assert_close(asked.loss, model(ids, labels=ids).loss, atol=2e-5, rtol=0)
    assert launches["lce_ce"] == ce + 1  # only the tuple call: the two asking for logits ran HF's loss


def test_all_labels_ignored_gives_nan_like_transformers(device):
    model = _model("llama", device, layers=1).train()
    fused = _converted(model)
    ids, _ = _inputs("llama", device)
    labels = torch.full_like(ids, -100)
    assert torch.isnan(model(ids, labels=labels).loss) and torch.isnan(fused(ids, labels=labels).loss)


def test_converted_llama_training_step_never_allocates_the_logits(device, launches, monkeypatch):
    """A converted LlamaForCausalLM's training step (the loss from model(input_ids, labels=...)
    and its backward): no logits-wide tensor but one chunk of rows (chunks of 4 of the 18
    tokens, as the chunk rule does from 512 tokens up); the fused kernels ran."""
    from fused_block.kernels import loss as kloss
    from memory_testing import Allocations

    monkeypatch.setattr(kloss, "FORCE_CHUNK_ROWS", 4)
    model = _converted(_model("llama", device, layers=1, vocab_size=101).train())  # 101: no other width
    ids, _ = _inputs("llama", device)
    with _no_fallback(), Allocations() as rec:
        out = model(ids, labels=ids)
        out.loss.backward()
    assert out.logits is None
    wide = [a.shape for a in rec.records if a.shape and a.shape[-1] in (101, kloss.padded_stride(101, 4))]
    assert wide == [(4, kloss.padded_stride(101, 4))]
    assert launches["lce_ce"] == 5 and launches["lce_dw"] == 5 and launches["attention_bwd"] == 1


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_data_parallel_replicas_run_their_own_weights(arch, device, launches, monkeypatch):
    """torch.nn.DataParallel (the Trainer's wrapper on a machine with several GPUs and one
    process) runs replicas made by torch.nn.parallel.replicate: a shallow copy of each module's
    __dict__, the parameters set to broadcast copies. The converted forwards (layers, final
    norm, loss head) are instance attributes: each replica's runs the replica, on its copies
    (the original's were another GPU's weights, and gradients bypassed the copies). The
    broadcast is emulated on one device, replica 1's parameters 1.5x the original's: its loss
    is the scaled model's, its gradients reach the original's parameters through the copies."""
    import importlib

    rep = importlib.import_module("torch.nn.parallel.replicate")

    def broadcast(tensors, devices, detach):  # parameters (detach False in training) scaled on replica 1
        return [[t.detach() if detach else t * (1.5 if i else 1.0) for t in tensors] for i in range(len(devices))]

    monkeypatch.setattr(rep, "_broadcast_coalesced_reshape", broadcast)
    model = _converted(_model(arch, device, layers=1).train())
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for p in scaled.parameters():
            p.mul_(1.5)
    ids, mask = _inputs(arch, device)
    replica = rep.replicate(model, [0, 1])[1]
    with _no_fallback():
        loss = replica(input_ids=ids, attention_mask=mask, labels=ids).loss
        expected = scaled(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert launches["lce_ce"] == 2 and launches["add_norm_fwd"] == 2 * 3  # two norms per layer, the final one
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), scaled.parameters()):
        torch.testing.assert_close(p.grad, 1.5 * q.grad, msg=name)


class _TrainerData(torch.utils.data.Dataset):
    """8 sequences of 9, 8 and 7 tokens (a batch of 2 right-padded by the collator below: the
    micro-batches hold different token counts, so the gradient accumulation's normalization
    by num_items_in_batch shows)."""

    def __init__(self, n):
        ids = torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(3))
        self.rows = [ids[i, :L - i % 3].tolist() for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}

    @staticmethod
    def collate(rows):
        n = max(len(r["input_ids"]) for r in rows)
        pad = [n - len(r["input_ids"]) for r in rows]
        return {"input_ids": torch.tensor([r["input_ids"] + [0] * p for r, p in zip(rows, pad)]),
                "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * p for r, p in zip(rows, pad)]),
                "labels": torch.tensor([r["input_ids"] + [-100] * p for r, p in zip(rows, pad)])}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_trainer_with_gradient_accumulation_matches_the_original(arch, device, launches, tmp_path):
    """transformers.Trainer, 2 optimizer steps of 2 accumulated micro-batches (SGD: the weights
    follow the gradients without Adam's amplification of near-zero ones), then an evaluation
    with logits (compute_metrics): the converted model's forward is seen as taking the loss
    kwargs (num_items_in_batch) as the original's, its fused loss normalizes by them, the logged
    losses, eval loss and metric and the final weights are the original's under the rule
    against the float64 original trained the same way."""
    pytest.importorskip("accelerate")
    model = _model(arch, device, layers=1)

    def train(m):
        logs = []

        class Record(transformers.TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                record.append(logs)

        record = logs
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=device.type == "cpu", report_to=[], per_device_train_batch_size=2,
            per_device_eval_batch_size=2, gradient_accumulation_steps=2, max_steps=2, logging_steps=1, optim="sgd",
            learning_rate=0.5, lr_scheduler_type="constant", seed=0, save_strategy="no", disable_tqdm=True,
            prediction_loss_only=False)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=_TrainerData(8), eval_dataset=_TrainerData(4),
                                       data_collator=_TrainerData.collate, callbacks=[Record()],
                                       compute_metrics=lambda p: {"m": float(abs(p.predictions).mean())})
        assert trainer.model_accepts_loss_kwargs
        trainer.train()
        trainer.evaluate()  # logs its metrics
        losses = [(k, torch.tensor(float(v), dtype=torch.float64)) for log in logs for k, v in log.items()
                  if k in ("loss", "grad_norm", "eval_loss", "eval_m")]
        return losses, m

    ref_logs, ref = train(copy.deepcopy(model).double())
    base_logs, base = train(copy.deepcopy(model))
    with _no_fallback():
        logs, fused = train(_converted(model))
    assert launches["lce_ce"] == 4  # the 4 training micro-batches; the evaluation wants the logits
    assert [k for k, _ in logs] == [k for k, _ in ref_logs] == ["loss", "grad_norm"] * 2 + ["eval_loss", "eval_m"]
    for (k, got), (_, want), (_, orig) in zip(logs, ref_logs, base_logs):
        _assert_close(k, got, want, orig, torch.float32, device)
    for (name, p), q, r in zip(fused.named_parameters(), base.parameters(), ref.parameters()):
        _assert_close(name, p.detach(), r.detach(), q.detach(), torch.float32, device)


def test_causal_lm_falls_back_with_a_warning(device, launches):
    """A hook on lm_head, logits_to_keep, or a custom loss_function: one warning each, the
    original's loss (from the logits); nothing wrong is returned."""
    model = _model("gpt2", device, layers=1).train()
    fused = _converted(model)
    ids, _ = _inputs("gpt2", device)
    want = model(ids, labels=ids).loss
    handle = fused.lm_head.register_forward_hook(lambda m, i, o: None)
    with pytest.warns(UserWarning, match="lm_head has a forward hook"):
        torch.testing.assert_close(fused(ids, labels=ids).loss, want, atol=2e-5, rtol=0)
    handle.remove()
    with pytest.warns(UserWarning, match="logits_to_keep"):  # positions as a tensor: all of them here
        got = fused(ids, labels=ids, logits_to_keep=torch.arange(L, device=device))
    torch.testing.assert_close(got.loss, want, atol=2e-5, rtol=0)
    fused.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().square().mean()
    with pytest.warns(UserWarning, match="loss_function other than"):
        assert fused(ids, labels=ids).logits is not None
    del fused._loss_function  # the property's storage: back to transformers' default
    before = launches["lce_ce"]
    torch.testing.assert_close(fused(ids, labels=ids).loss, want, atol=2e-5, rtol=0)
    assert launches["lce_ce"] == before + 1


# ---------------------------------------------------------------------------------------------
# Gemma 1/2/3: (1 + w) RMSNorms, GeGLU MLP, sandwich norms (2/3), q/k norms and local/global
# RoPE bases (3), the final logit softcap in the loss (2); see hf_testing.config
# ---------------------------------------------------------------------------------------------

GEMMAS = ["gemma", "gemma2", "gemma3"]
# One layer for Gemma 1/2 (each layer is a full interpreted forward and backward); Gemma 3's two:
# a sliding layer (RoPE base 10^4) and a full one (10^6), the residual stream crossing them.
GEMMA_LAYERS = {"gemma": 1, "gemma2": 1, "gemma3": 2}


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_logits_and_gradients_match_the_original(arch, device, launches):
    """As test_logits_and_gradients_match_the_original: the training loss (Gemma 2's with its
    final logit softcap, in the fused linear + cross-entropy) and every parameter's gradient,
    then fp32 logits, against the original in float64; fully fused, no warning."""
    n = GEMMA_LAYERS[arch]
    model = _model(arch, device, layers=n).train()
    fused = _converted(model)
    ref = copy.deepcopy(model).double()
    ids, mask = _inputs(arch, device)
    outs = _training_steps(dict(ref=ref, base=model, fused=fused), ids, mask)
    _assert_close("loss", outs["fused"][0].loss, outs["ref"][0].loss, outs["base"][0].loss, torch.float32, device)
    for pname, p in outs["ref"][1].items():
        g = outs["fused"][1][pname].grad
        assert g is not None, pname
        _assert_close(f"{pname}.grad", g, p.grad, outs["base"][1][pname].grad, torch.float32, device)
    assert outs["fused"][0].logits is None
    assert launches["attention_fwd"] == launches["attention_bwd"] == n
    sandwich = arch != "gemma"
    # per layer: 2 norms (Gemma 1), 4 (sandwich: post-attention alone, pre-feedforward with the add);
    # the model's final norm
    assert launches["add_norm_fwd"] == n * (4 if sandwich else 2) + 1
    assert launches["add_norm_bwd"] == launches["add_norm_fwd"]
    assert launches["rope_qknorm" if arch == "gemma3" else "rope_qkvpacked"] == 2 * n
    assert launches["matmul"] == n * 12 and launches["act_grad"] == 0  # the MLP as geglu
    assert launches["lce_ce"] == launches["lce_logits"] == launches["lce_dw"] == 1
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
                  for m in (ref, model, fused)]
    _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_bf16_logits(arch, device, launches):
    model = _model(arch, device, layers=GEMMA_LAYERS[arch]).eval()
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model).to(torch.bfloat16)
    fused = _converted(base)
    ids, mask = _inputs(arch, device)
    with torch.no_grad(), _no_fallback():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0) for m in (ref, base, fused)]
    assert logits[2].dtype == torch.bfloat16
    _assert_close("logits", logits[2], logits[0], logits[1], torch.bfloat16, device)
    assert launches["attention_fwd"] == GEMMA_LAYERS[arch]


@pytest.mark.parametrize("arch", ["gemma3"])
def test_gemma_greedy_generation_matches(arch, device, launches):
    """16 greedy tokens with the KV cache: Gemma 3 (sandwich norms and (1 + w) q/k norms through
    decoding, the sliding layer's cache; its window cuts nothing in 25 tokens). One layer: each
    token is a full interpreted forward (about 30 s here), so Gemma 1 and 2, whose layers are
    this one's parts, are not repeated. Untied embeddings: with the tied ones these tiny models
    repeat one token."""
    layers = 1
    model = _model(arch, device, layers=layers, tie_word_embeddings=False).eval()
    fused = _converted(model)
    ids, _ = _inputs(arch, device)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=V - 1)
    want = model.generate(ids[:1], **kw)
    with _no_fallback():
        got = fused.generate(ids[:1], **kw)
    assert want.shape[1] == L + 16 and len(set(want[0, L:].tolist())) > 3
    assert torch.equal(got, want)
    assert launches["attention_fwd"] == 16 * layers
    assert launches["matmul"] == 16 * 4 * layers


def _matches_unpadded(model, arch, device, expect=None):
    """The converted copy of ``model`` gives its logits on ``arch``'s padded inputs (the padding's
    positions not compared), with no fallback warning, or the one ``expect`` matches; returns
    the converted model."""
    ids, mask = _inputs(arch, device)
    keep = mask[..., None] == 1
    fused = fused_block.convert(copy.deepcopy(model))
    with torch.no_grad(), _no_fallback() if expect is None else pytest.warns(UserWarning, match=expect):
        got = fused(ids, attention_mask=mask).logits
    want = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got.masked_fill(~keep, 0), want.masked_fill(~keep, 0), atol=2e-5, rtol=0)
    return fused


def test_gemma_softcap_and_windows_run_fused(device, launches):
    """Gemma 2's attention softcap (its default 50) and a sliding window that cuts keys (Gemma
    3's sliding layer, window 4 over 9 tokens) run the kernel (softcap=, window=), no warning,
    the original's answer (Gemma 2's with eager attention, which applies the softcap); the
    padding's logits are not compared."""
    capped = _model("gemma2", device, layers=1, attn_logit_softcapping=50.0, attn_implementation="eager").eval()
    _matches_unpadded(capped, "gemma2", device)
    assert launches["attention_fwd"] == 1
    _matches_unpadded(_model("gemma3", device, sliding_window=4).eval(), "gemma3", device)
    assert launches["attention_fwd"] == 3  # both layers


def test_gemma_softcap_only_where_the_original_applies_it(device, launches):
    """Gemma 3 keeps ``attn_logit_softcapping`` from its config without applying it (its
    attention passes no softcap on): the fused layer does not apply it either (the original's
    answer, no warning, the kernel ran). Gemma 2 applies it, which needs the kernel: with a head
    dim outside the kernel's range the layer runs its original forward after a warning (SDPA
    has no softcap)."""
    model = _model("gemma3", device, layers=1, attn_logit_softcapping=5.0, attn_implementation="eager").eval()
    fused = _matches_unpadded(model, "gemma3", device)
    assert launches["attention_fwd"] == 1
    assert hf.gemma.softcap(fused.model.layers[0].self_attn) is None
    odd = _model("gemma2", device, layers=1, head_dim=20, attn_logit_softcapping=50.0,
                 attn_implementation="eager").eval()
    _matches_unpadded(odd, "gemma2", device, expect="head dim 20.*softcap")
    assert launches["attention_fwd"] == 1  # no more


# ---------------------------------------------------------------------------------------------
# gpt-oss: attention sinks, alternating sliding / full layers (window 4: cuts keys), YaRN RoPE,
# q/k/v/o biases, GQA; the MoE MLP is Hugging Face's (see hf_testing.config)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("router_aux", [False, True])
def test_gpt_oss_logits_and_gradients_match_the_original(router_aux, device, launches, monkeypatch):
    """As test_logits_and_gradients_match_the_original, on a left-padded batch: the training
    loss (fused linear + cross-entropy; with ``output_router_logits`` plus the router's
    auxiliary loss, which the original adds), every parameter's gradient (the sinks', the
    router's and the experts' included), then fp32 logits, against the original in float64;
    both layers fused, no warning; the packed kernel got each layer's sinks and window (the
    sliding layer's (3, 0): a query sees itself and 3 keys before it)."""
    model = _model("gpt_oss", device).train()
    fused = _converted(model)
    seen = []
    monkeypatch.setattr(hf._attention, "attention_qkvpacked", lambda *a, **k: seen.append(
        (k["window"], k["sinks"] is not None)) or attention_qkvpacked(*a, **k))
    ref = copy.deepcopy(model).double()
    ids, mask = _inputs("gpt_oss", device)
    labels = ids.masked_fill(mask == 0, -100)
    outs = {}
    for name, m in (("ref", ref), ("base", model), ("fused", fused)):
        with _no_fallback():
            out = m(ids, attention_mask=mask, labels=labels, output_router_logits=router_aux)
        out.loss.backward()
        outs[name] = (out, dict(m.named_parameters()))
    _assert_close("loss", outs["fused"][0].loss, outs["ref"][0].loss, outs["base"][0].loss, torch.float32, device)
    if router_aux:
        assert outs["fused"][0].aux_loss is not None
        _assert_close("aux_loss", outs["fused"][0].aux_loss, outs["ref"][0].aux_loss, outs["base"][0].aux_loss,
                      torch.float32, device)
    else:
        assert outs["fused"][0].aux_loss is None
    for pname, p in outs["ref"][1].items():
        g = outs["fused"][1][pname].grad
        assert g is not None, pname
        _assert_close(f"{pname}.grad", g, p.grad, outs["base"][1][pname].grad, torch.float32, device)
    assert outs["fused"][0].logits is None
    assert seen == [((3, 0), True), ((-1, -1), True)]
    assert launches["attention_fwd"] == launches["attention_bwd"] == 2
    assert launches["add_norm_fwd"] == launches["add_norm_bwd"] == 5  # 2 a layer, the final norm
    assert launches["rope_qkvpacked"] == 4
    # per layer: the QKV and out projections, 1 GEMM forward and 2 backward each (the experts
    # are Hugging Face's); the head's products (one chunk) on cuBLAS
    assert launches["matmul"] == 2 * 6 and launches["lce_ce"] == launches["lce_logits"] == launches["lce_dw"] == 1
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
                  for m in (ref, model, fused)]
    _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)


def test_gpt_oss_bf16_logits(device, launches):
    model = _model("gpt_oss", device).eval()
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model).to(torch.bfloat16)
    fused = _converted(base)
    ids, mask = _inputs("gpt_oss", device)
    with torch.no_grad(), _no_fallback():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0) for m in (ref, base, fused)]
    assert logits[2].dtype == torch.bfloat16
    _assert_close("logits", logits[2], logits[0], logits[1], torch.bfloat16, device)
    assert launches["attention_fwd"] == 2


def test_gpt_oss_fp32_norms_of_from_pretrained(device, launches):
    """``from_pretrained(dtype=fp16)`` keeps the RMSNorms' weights in fp32
    (``_keep_in_fp32_modules``): the fused norms read them as they are, the original's answer."""
    model = _model("gpt_oss", device).eval()
    ids, mask = _inputs("gpt_oss", device)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        base = type(model).from_pretrained(tmp, dtype=torch.float16).to(device).eval()
    layer = base.model.layers[0]
    assert layer.input_layernorm.weight.dtype == torch.float32 and layer.self_attn.q_proj.weight.dtype == torch.float16
    fused = _converted(base)
    ref = copy.deepcopy(model).double()
    with torch.no_grad(), _no_fallback():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0) for m in (ref, base, fused)]
    _assert_close("logits", logits[2], logits[0], logits[1], torch.float16, device)
    assert launches["attention_fwd"] == 2 and launches["add_norm_fwd"] == 5  # the fp32 final norm too


def test_gpt_oss_greedy_generation_matches(device, launches):
    """16 greedy tokens with the KV cache, both layer types: the sliding layer's cache
    (transformers' sliding-window cache layer) and window (4 of up to 25 keys), the sinks
    through decoding."""
    model = _model("gpt_oss", device).eval()
    fused = _converted(model)
    ids, _ = _inputs("gpt_oss", device)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=V - 1)
    want = model.generate(ids[:1], **kw)
    with _no_fallback():
        got = fused.generate(ids[:1], **kw)
    assert want.shape[1] == L + 16 and len(set(want[0, L:].tolist())) > 3  # a real sequence, not one token
    assert torch.equal(got, want)
    assert launches["attention_fwd"] == 16 * 2 and launches["rope_qkvpacked"] == 16 * 2
    assert launches["matmul"] == 16 * 2 * 2  # QKV and out per layer and token (the experts are HF's)


def test_gpt_oss_batched_generation_with_left_padding(device, launches):
    """A left-padded batch through prefill and decoding: eager's additive 4-D masks (the
    sliding layer's with the window) read as causal + key padding (+ window) for the kernel."""
    model = _model("gpt_oss", device).eval()
    fused = _converted(model)
    ids, mask = _inputs("gpt_oss", device)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=V - 1)
    with _no_fallback():
        got = fused.generate(ids, **kw)
    assert torch.equal(got, model.generate(ids, **kw))
    assert launches["attention_fwd"] == 3 * 2


def test_alternating_4d_masks_are_read_once_each_per_forward(device, launches):
    """Gemma 3 with four layers alternating sliding (window 4: cuts keys) and full attention on a
    left-padded batch: the model's two 4-D masks, built once per forward, are read once each (one
    synchronization apiece, not one per layer), into causal + padding (+ the window) for the
    kernel; the answer is the original's. A mask changed in place is read again; one that is
    not causal + padding goes to the kernel as it is."""
    model = _model("gemma3", device, layers=4, sliding_window=4).eval()  # sliding, full, sliding, full
    fused = _converted(model)
    ids, mask = _inputs("gemma3", device)
    keep = mask[..., None] == 1
    with torch.no_grad(), _no_fallback():
        got = fused(ids, attention_mask=mask).logits
        counts = profiling.count_kernels(lambda: fused(ids, attention_mask=mask))
        want = model(ids, attention_mask=mask).logits
        theirs = profiling.count_kernels(lambda: model(ids, attention_mask=mask))  # the mask builder's own
    ours = {k: counts.syncs.get(k, 0) - theirs.syncs.get(k, 0) for k in counts.syncs.keys() | theirs.syncs.keys()}
    assert {k: n for k, n in ours.items() if n} == {"_local_scalar_dense": 2}, (counts.syncs, theirs.syncs)
    assert launches["attention_fwd"] == 2 * 4
    torch.testing.assert_close(got.masked_fill(~keep, 0), want.masked_fill(~keep, 0), atol=1e-5, rtol=0)

    Lk = 6
    causal4d = torch.full((2, 1, Lk, Lk), torch.finfo(torch.float32).min, device=device).triu(1)
    causal4d[1, ..., :2] = torch.finfo(torch.float32).min  # the second row's first two keys: padding
    window4d = causal4d.clone().masked_fill_(torch.ones(Lk, Lk, dtype=torch.bool, device=device).tril(-2),
                                              torch.finfo(torch.float32).min)  # a window of (1, 0)
    plan = hf._attention.plan
    for _ in range(2):  # alternating, as the layers: each mask read on its first use only
        counts = profiling.count_kernels(lambda: (plan(causal4d, 2, Lk, Lk, True, "sdpa"),
                                                  plan(window4d, 2, Lk, Lk, True, "sdpa", window=(1, 0))))
        assert counts.syncs == ({"_local_scalar_dense": 2} if _ == 0 else {}), counts.syncs
    full, sliding = plan(causal4d, 2, Lk, Lk, True, "sdpa"), plan(window4d, 2, Lk, Lk, True, "sdpa", window=(1, 0))
    assert full.causal and full.window == (-1, -1) and full.key_padding.tolist() == [[False] * Lk, [True] * 2 + [False] * 4]
    assert sliding.causal and sliding.window == (1, 0) and sliding.light
    assert plan(causal4d, 2, Lk, Lk, True, "sdpa", window=(1, 0)).window == (-1, -1)  # the mask holds no window
    causal4d[0, 0, 1, 3] = 0.0  # in place: a key the causal mask hid is seen -> the mask itself
    changed = plan(causal4d, 2, Lk, Lk, True, "sdpa")
    assert changed.bias is causal4d and not changed.causal
    with torch.inference_mode():  # no version counter to tell an in-place change: read on every use
        frozen = window4d.clone()
    counts = profiling.count_kernels(lambda: [plan(frozen, 2, Lk, Lk, True, "sdpa", window=(1, 0)) for _ in range(2)])
    assert counts.syncs == {"_local_scalar_dense": 2}, counts.syncs


def test_gpt_oss_called_mlp_hooks_tables_and_fallbacks(device, launches):
    """The MoE MLP is called, not bypassed: a hook on its experts runs and the layer stays
    fused, and the router logits are recorded (``output_router_logits``). Without the model's
    rotary module the layer reads its (B, L, D / 2) cos/sin tables. A hook on a bypassed
    submodule (q_proj) and ``output_attentions`` run the original forward with a warning."""
    model = _model("gpt_oss", device, layers=1).eval()
    fused = _converted(model)
    ids, mask = _inputs("gpt_oss", device)
    keep = mask[..., None] == 1
    with torch.no_grad():
        want = model(ids, attention_mask=mask, output_router_logits=True)
        seen = []
        fused.model.layers[0].mlp.experts.register_forward_hook(lambda m, i, o: seen.append(o))
        with _no_fallback():
            got = fused(ids, attention_mask=mask, output_router_logits=True)
        assert len(seen) == 1 and launches["attention_fwd"] == 1
        torch.testing.assert_close(got.logits.masked_fill(~keep, 0), want.logits.masked_fill(~keep, 0),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(got.router_logits[0], want.router_logits[0], atol=1e-5, rtol=0)
        fused.model.layers[0]._fused_block.rotary = None  # as with no single standard rotary module
        with _no_fallback():
            got = fused(ids, attention_mask=mask).logits
        assert launches["attention_fwd"] == 2
        torch.testing.assert_close(got.masked_fill(~keep, 0), want.logits.masked_fill(~keep, 0), atol=1e-5, rtol=0)
        with pytest.warns(UserWarning, match="output_attentions"):
            got = fused(ids, attention_mask=mask, output_attentions=True)
        want = model(ids, attention_mask=mask, output_attentions=True)
        torch.testing.assert_close(got.attentions[0], want.attentions[0])
        fused.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: None)
        before = launches["attention_fwd"]
        with pytest.warns(UserWarning, match="forward hook"):
            got = fused(ids, attention_mask=mask).logits
        assert launches["attention_fwd"] == before
        torch.testing.assert_close(got, model(ids, attention_mask=mask).logits)


# ---------------------------------------------------------------------------------------------
# BLOOM: ALiBi (the model's tensor as the kernel's bias), Pre-LN LayerNorms, the per-head
# interleaved query_key_value, bloom_gelu (see hf_testing.config)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("padding", ["right", "middle"])
def test_bloom_logits_and_gradients_match_the_original(padding, device, launches):
    """As test_logits_and_gradients_match_the_original: the training loss (fused linear +
    cross-entropy) and every parameter's gradient, then fp32 logits, against the original in
    float64, both layers fused, no warning. Right padding and padding inside a row, where
    BLOOM's ALiBi positions (cumsum of the mask) are not the key indices: the kernel adds the
    model's ALiBi tensor itself, so both are BLOOM's. (Not left padding: BLOOM's eager softmax
    in fp32 of a float64 mask gives NaN for the fully masked padding queries, which then leaks
    through the values; the generation tests run it.)"""
    model = _model("bloom", device).train()
    fused = _converted(model)
    ref = copy.deepcopy(model).double()
    ids, mask = _inputs("bert" if padding == "right" else "bloom-middle", device)
    labels = ids.masked_fill(mask == 0, -100)
    outs = {}
    for name, m in (("ref", ref), ("base", model), ("fused", fused)):
        with _no_fallback():
            out = m(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs[name] = (out, dict(m.named_parameters()))
    _assert_close("loss", outs["fused"][0].loss, outs["ref"][0].loss, outs["base"][0].loss, torch.float32, device)
    for pname, p in outs["ref"][1].items():
        g = outs["fused"][1][pname].grad
        assert g is not None, pname
        _assert_close(f"{pname}.grad", g, p.grad, outs["base"][1][pname].grad, torch.float32, device)
    assert outs["fused"][0].logits is None
    assert launches["attention_fwd"] == launches["attention_bwd"] == 2
    # 2 a layer, the embeddings' word_embeddings_layernorm and the final ln_f
    assert launches["add_norm_fwd"] == launches["add_norm_bwd"] == 6
    # per layer: query_key_value and dense 1 GEMM forward and 2 backward each, the MLP 2 and 4;
    # the head's products (one chunk) on cuBLAS
    assert launches["matmul"] == 2 * 12 and launches["act_grad"] == 0
    assert launches["lce_ce"] == launches["lce_logits"] == launches["lce_dw"] == 1
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0)
                  for m in (ref, model, fused)]
    _assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)


def test_bloom_bf16_logits(device, launches):
    model = _model("bloom", device).eval()
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model).to(torch.bfloat16)
    fused = _converted(base)
    ids, mask = _inputs("bert", device)  # right padding (see test_bloom_logits_and_gradients_match_the_original)
    with torch.no_grad(), _no_fallback():
        logits = [m(ids, attention_mask=mask).logits.masked_fill(mask[..., None] == 0, 0.0) for m in (ref, base, fused)]
    assert logits[2].dtype == torch.bfloat16
    _assert_close("logits", logits[2], logits[0], logits[1], torch.bfloat16, device)
    assert launches["attention_fwd"] == 2


def test_bloom_greedy_generation_matches(device, launches):
    """8 greedy tokens with the KV cache (ALiBi over the cached keys). One layer (each token is
    a full interpreted forward), untied embeddings, weights of std 0.5 and the second prompt:
    with the tied embeddings, std 0.2 or the first prompt this tiny model repeats one token."""
    model = _model("bloom", device, layers=1, tie_word_embeddings=False, initializer_range=0.5).eval()
    fused = _converted(model)
    ids, _ = _inputs("bloom", device)
    n = 8
    kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=V - 1)
    want = model.generate(ids[1:], **kw)
    with _no_fallback():
        got = fused.generate(ids[1:], **kw)
    assert want.shape[1] == L + n and len(set(want[0, L:].tolist())) > 3
    assert torch.equal(got, want)
    assert launches["attention_fwd"] == n and launches["matmul"] == n * 4


def test_bloom_batched_generation_with_left_padding(device, launches):
    """A left-padded batch through prefill and decoding: ALiBi's positions counted over the
    growing mask, the padding as key padding."""
    model = _model("bloom", device, layers=1, tie_word_embeddings=False).eval()
    fused = _converted(model)
    ids, mask = _inputs("bloom", device)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=V - 1)
    with _no_fallback():
        got = fused.generate(ids, **kw)
    assert torch.equal(got, model.generate(ids, **kw))
    assert launches["attention_fwd"] == 3


def test_bloom_post_layernorm_residuals_and_fallbacks(device, launches):
    """``apply_residual_connection_post_layernorm`` (the residuals are the norms' outputs) runs
    fused, the original's answer; ``pretraining_tp`` 2 with ``slow_but_exact`` is left
    unconverted and ``output_attentions`` runs the original forward, each with a warning."""
    ids, mask = _inputs("bloom", device)
    keep = mask[..., None] == 1
    post = _model("bloom", device, layers=1, apply_residual_connection_post_layernorm=True).eval()
    fused = _converted(post)
    assert fused.transformer.h[0].apply_residual_connection_post_layernorm
    with torch.no_grad(), _no_fallback():
        got = fused(ids, attention_mask=mask).logits
    want = post(ids, attention_mask=mask).logits
    torch.testing.assert_close(got.masked_fill(~keep, 0), want.masked_fill(~keep, 0), atol=2e-5, rtol=0)
    assert launches["attention_fwd"] == 1
    with torch.no_grad(), pytest.warns(UserWarning, match="output_attentions"):
        got = fused(ids, attention_mask=mask, output_attentions=True)
    assert launches["attention_fwd"] == 1
    torch.testing.assert_close(got.attentions[0], post(ids, attention_mask=mask, output_attentions=True).attentions[0])
    sliced = _model("bloom", device, layers=1, pretraining_tp=2, slow_but_exact=True).eval()
    with pytest.warns(UserWarning, match="slow_but_exact"):
        fused = fused_block.convert(copy.deepcopy(sliced))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, attention_mask=mask).logits, sliced(ids, attention_mask=mask).logits)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False, return_dict=False)[0]


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
def test_jit_trace_of_a_converted_model_reads_no_mask_values(arch, device, launches):
    """torch.jit.trace of a converted model traced without padding (an all-ones mask), then run
    with a padded mask: the trace once held the eager reading of the first mask (no padding)
    and silently ignored the padding (GPT-2, BERT); the LLaMA layers' head counts came from
    traced sizes (tensors) and rope refused them. Compared with the original model's logits."""
    model = _model(arch, device).eval()
    fused = fused_block.convert(copy.deepcopy(model)).eval()
    ids, mask = _inputs(arch, device)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings: shape checks read sizes
        traced = torch.jit.trace(_Logits(fused), (ids, torch.ones_like(mask)), check_trace=False)
        for m in (torch.ones_like(mask), mask):
            torch.testing.assert_close(traced(ids, m), _Logits(model)(ids, m), atol=1e-4, rtol=1e-4)
    assert launches["attention_fwd"] > 0
