"""``attn_implementation="fused_block"`` (fused_block/hf/interface.py) in transformers' own models.

Per family (tests/hf_testing.py's INTERFACE_MODELS: tiny random models, hidden 64, head dim
16, 2 layers, 9 tokens, one row padded): fp32 logits and every parameter's gradient and bf16
logits against the model in float64 with the rule of tests/test_hf.py (4 x the original's
same-dtype error), the original being the ``sdpa`` implementation (``eager`` for the models
without one), and 16 greedy tokens with the KV cache, token for token the original's. The
launches show which layers ran the kernel; the models whose attention the kernel cannot take
through its eager attention only (soft-capping, sinks) are compared with ``eager``. Sliding
windows that cut keys, soft-capping and sinks run the kernel.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fused_block  # noqa: E402
import fused_block.hf  # noqa: E402
from fused_block.hf import interface  # noqa: E402
from hf_testing import EAGER_ONLY, ENCODERS, INTERFACE_MODELS, SEQ2SEQ, TARGET_LEN, V  # noqa: E402
from hf_testing import assert_close, interface_inputs, interface_model, no_fallback  # noqa: E402
from hf_testing import seq2seq_inputs, seq2seq_model  # noqa: E402

# name -> (layers of 2 whose attention runs the kernel, the fallback warning or None)
EXPECT = {name: (2, None) for name in INTERFACE_MODELS}
NAMES = list(INTERFACE_MODELS)
CAUSAL = [n for n in NAMES if n not in ENCODERS]


def _original(name):
    return "eager" if name in EAGER_ONLY else "sdpa"


def _ours(model):
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("fused_block")
    return ours


def _expecting(name):
    """The model's fallback warning (pytest.warns), or no fused_block warning at all."""
    match = EXPECT[name][1]
    return no_fallback() if match is None else pytest.warns(UserWarning, match=match)


def _masked(logits, mask):
    return logits.masked_fill(mask[..., None] == 0, 0.0)


def test_registered_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fused_block.hf.register()  # idempotent
    assert AttentionInterface._global_mapping["fused_block"] is interface.attention
    assert AttentionMaskInterface._global_mapping["fused_block"] is interface.mask


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_gradients_match_the_original(name, device, launches):
    """fp32: the loss, every parameter's gradient (the padding's labels ignored) and the
    logits; the kernel's forward and backward ran in the layers it covers."""
    model = interface_model(name, device, _original(name)).train()
    ref, ours = copy.deepcopy(model).double(), _ours(model)
    ids, mask = interface_inputs(name, device)
    labels = ids.masked_fill(mask == 0, -100)
    outs = {}
    for key, m in (("ref", ref), ("base", model), ("ours", ours)):
        with _expecting(name) if key == "ours" else no_fallback():
            out = m(ids, attention_mask=mask, labels=labels)
            out.loss.backward()
        outs[key] = (out, dict(m.named_parameters()))
    assert_close("loss", outs["ours"][0].loss, outs["ref"][0].loss, outs["base"][0].loss, torch.float32, device)
    for pname, p in outs["ref"][1].items():
        if p.grad is None:  # e.g. ModernBERT's padding embedding row
            continue
        got = outs["ours"][1][pname].grad
        assert got is not None, pname
        assert_close(f"{pname}.grad", got, p.grad, outs["base"][1][pname].grad, torch.float32, device)
    kernel_layers = EXPECT[name][0]
    assert launches["attention_fwd"] == launches["attention_bwd"] == kernel_layers
    with torch.no_grad():
        logits = [_masked(m(ids, attention_mask=mask).logits, mask) for m in (ref, model, ours)]
    assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)
    assert launches["attention_fwd"] == 2 * kernel_layers


@pytest.mark.parametrize("name", NAMES)
def test_bf16_logits(name, device, launches):
    model = interface_model(name, device, _original(name)).eval()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model).to(torch.bfloat16)
    ours = _ours(base)
    ids, mask = interface_inputs(name, device)
    with torch.no_grad():
        want, base_logits = (_masked(m(ids, attention_mask=mask).logits, mask) for m in (ref, base))
        with _expecting(name):
            got = _masked(ours(ids, attention_mask=mask).logits, mask)
    assert got.dtype == torch.bfloat16
    assert_close("logits", got, want, base_logits, torch.bfloat16, device)
    assert launches["attention_fwd"] == EXPECT[name][0]


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_autocast_training_runs_the_kernel(name, device, launches):
    """An fp32 model trained under autocast (bf16): RoPE's fp32 cos/sin make the queries and keys
    fp32 beside bf16 values; the kernel takes them in autocast's dtype as SDPA (and the eager
    attention's products) do, forward and backward, without falling back. Loss and every
    parameter's gradient against the float64 model, the original under autocast as baseline."""
    model = interface_model(name, device, _original(name)).train()
    ref, ours = copy.deepcopy(model).double(), _ours(model)
    ids, mask = interface_inputs(name, device)
    labels = ids.masked_fill(mask == 0, -100)
    outs = {}
    for key, m in (("ref", ref), ("base", model), ("ours", ours)):
        with no_fallback(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=key != "ref"):
            out = m(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs[key] = (out.loss, dict(m.named_parameters()))
    assert launches["attention_fwd"] == launches["attention_bwd"] == 2
    assert_close("loss", outs["ours"][0], outs["ref"][0], outs["base"][0], torch.bfloat16, device)
    for pname, p in outs["ref"][1].items():
        if p.grad is None:
            continue
        got = outs["ours"][1][pname].grad
        assert got is not None and got.dtype == torch.float32, pname
        assert_close(f"{pname}.grad", got, p.grad, outs["base"][1][pname].grad, torch.bfloat16, device)


@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_generation_matches(name, device, launches):
    """16 greedy tokens for a batch with a left-padded row, with the KV cache: the prefill and
    every decoding step (one query against the cached keys, the padding as a (B, Lk) mask).
    One layer; weights of std 0.5 and an untied LM head, with which every model's greedy
    sequence varies (tied Gemma embeddings of std 0.2 repeat the last token)."""
    model = interface_model(name, device, _original(name), num_hidden_layers=1, initializer_range=0.5,
                            tie_word_embeddings=False).eval()
    ours = _ours(model)
    ids, mask = interface_inputs(name, device, generating=True)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=V - 1)
    want = model.generate(ids, **kw)
    got = ours.generate(ids, **kw)
    assert want.shape[1] == ids.shape[1] + 16 and len(set(want[0, ids.shape[1]:].tolist())) > 3
    assert torch.equal(got, want)
    kernel_layers, warning = EXPECT[name]
    # one layer: the prefill and the 15 decoding steps; a window cuts keys only in the prefill
    # (the sliding cache keeps window - 1 keys, so a step's window cuts none)
    runs = 16 if kernel_layers == 2 else 15 if "window" in name else 0
    assert launches["attention_fwd"] == runs


def test_static_cache_with_a_sliding_window_matches(device, launches):
    """Greedy decoding with a static cache on a model whose every layer slides (Mistral, window
    4 < the prompt): generate prepares each step's mask ahead and the forward builds it again
    from that light mask, which must come back as it is (read as a 2-D padding mask at the
    sliding cache's absolute key positions it hid every key: repeated tokens, found by
    fuzzing). The tokens are the sdpa original's, for one row and a left-padded batch."""
    model = interface_model("mistral", device, "sdpa", num_hidden_layers=1, initializer_range=0.5,
                            tie_word_embeddings=False, sliding_window=4).eval()
    ours = _ours(model)
    ids, mask = interface_inputs("mistral", device, generating=True)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=V - 1, cache_implementation="static")
    for call in (dict(input_ids=ids[:1]), dict(input_ids=ids, attention_mask=mask)):
        want = model.generate(**call, **kw)
        assert len(set(want[0, ids.shape[1]:].tolist())) > 3  # a real sequence
        with no_fallback():
            assert torch.equal(ours.generate(**call, **kw), want)
    assert launches["attention_fwd"] > 0


def _chunked_prefill(model, ids, mask, chunk):
    """generate(cache_implementation="static", prefill_chunk_size=chunk)'s prefill by hand: per
    chunk the masks prepared ahead as generate prepares them (prepare_inputs_for_generation,
    which makes them contiguous) and one forward; the logits of every position."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate makes them
    logits = []
    for start in range(0, ids.shape[1], chunk):
        end = start + chunk
        inputs = model.prepare_inputs_for_generation(ids[:, start:end], cache=cache, attention_mask=mask[:, :end],
                                                     position_ids=positions[:, start:end], use_cache=True)
        logits.append(model(**inputs).logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("name", ["gemma3-window", "gemma2"])
def test_chunked_prefill_on_a_static_cache_keeps_the_window(name, device, launches):
    """A prefill in chunks of 2 into a static cache, a sliding layer (window 4) beside a full
    one: once the sliding layer's cache is full its keys start at kv_offset > 0, the light mask
    is a strided slice of the padding, and generate's .contiguous() used to copy it without its
    window (the queries saw a key the window cuts: scores off by 0.6, found by fuzzing). The
    logits of every chunk are the original's (float64 rule); the kernel ran in both layers."""
    model = interface_model(name, device, _original(name)).eval()
    ref, ours = copy.deepcopy(model).double(), _ours(model)
    ids, mask = interface_inputs(name, device)
    with torch.no_grad():
        want, base = (_masked(_chunked_prefill(m, ids, mask, 2), mask) for m in (ref, model))
        with no_fallback():
            got = _masked(_chunked_prefill(ours, ids, mask, 2), mask)
    assert_close("logits", got, want, base, torch.float32, device)
    assert launches["attention_fwd"] == 2 * len(range(0, ids.shape[1], 2))


def _layers_get_copied_masks(model):
    """Each decoder layer gets a copy of its attention mask, as accelerate's hooks give a layer
    on another device (``.to(device)``: a new tensor, without the attributes the interface
    attached)."""
    def copy_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            kwargs["attention_mask"] = mask.clone()
        return args, kwargs

    for layer in model.model.layers:
        layer.register_forward_pre_hook(copy_mask, with_kwargs=True)


# modernbert-window: a bidirectional window (ModernBERT's local layers), which was dropped.
@pytest.mark.parametrize("name", ["gemma3-window", "gemma2", "modernbert-window"])
def test_a_copied_light_mask_keeps_the_layer_s_window(name, device, launches):
    """A light mask that lost its window attribute on its way to the layer (a device move)
    runs the layer's own sliding window (flash-attention's reading of ``sliding_window``):
    the logits of a padded batch longer than the window are still the original's (float64
    rule); without it the sliding layers attended to every earlier (or later) key."""
    model = interface_model(name, device, _original(name)).eval()
    ref, ours = copy.deepcopy(model).double(), _ours(model)
    _layers_get_copied_masks(ours)
    ids, mask = interface_inputs(name, device)
    with torch.no_grad():
        want, base = (_masked(m(ids, attention_mask=mask).logits, mask) for m in (ref, model))
        with no_fallback():
            got = _masked(ours(ids, attention_mask=mask).logits, mask)
    assert_close("logits", got, want, base, torch.float32, device)
    assert launches["attention_fwd"] == 2


# Phi-3 reads its window from the config (Phi3Attention passes config.sliding_window to the
# attention function: Phi-3-mini-4k's 2047); Mistral, the LLaMA family's reading, beside it.
@pytest.mark.parametrize("name", ["phi3", "mistral"])
def test_converted_layers_given_a_copied_light_mask_keep_the_window(name, device, launches):
    """convert() on a model running attn_implementation="fused_block" whose layers get copies
    of the interface's light mask (accelerate's device hooks): the converted layer applies the
    model's sliding window itself (4 of 9 tokens: it cuts keys), as the original's attention
    does; the logits of a padded batch are the original's (float64 rule). Phi-3's converted
    layer dropped its window (every earlier key attended)."""
    model = interface_model(name, device, "sdpa", num_hidden_layers=1, sliding_window=4).eval()
    with no_fallback():
        ours = fused_block.convert(_ours(model))
    _layers_get_copied_masks(ours)
    _assert_padded_logits_as_the_original(name, model, ours, device)
    assert launches["rope_qkvpacked"] == 1 and launches["attention_fwd"] == 1


def _assert_padded_logits_as_the_original(name, model, ours, device):
    """``ours``' logits of a padded batch are ``model``'s, under the float64 rule."""
    ids, mask = interface_inputs(name, device)
    with torch.no_grad():
        want, base = (_masked(m(ids, attention_mask=mask).logits, mask) for m in (copy.deepcopy(model).double(), model))
        with no_fallback():
            got = _masked(ours(ids, attention_mask=mask).logits, mask)
    assert_close("logits", got, want, base, torch.float32, device)


def test_converted_llama_ignores_a_window_its_config_carries(device, launches):
    """A LLaMA config with a ``sliding_window`` (a llamafied Mistral's or Qwen's config.json
    keeps it; LlamaConfig stores unknown fields): LlamaAttention never reads it, so neither
    does the converted layer under attn_implementation="fused_block", whose light mask
    carries no window. The logits of a padded batch longer than the window (4 of 9 tokens)
    are the original's (float64 rule); the converted layer cut keys (logits off by ~6)."""
    model = interface_model("llama", device, "sdpa", num_hidden_layers=1, sliding_window=4).eval()
    with no_fallback():
        ours = fused_block.convert(_ours(model))
    _assert_padded_logits_as_the_original("llama", model, ours, device)
    assert launches["rope_qkvpacked"] == 1 and launches["attention_fwd"] == 1


# LLaMA passes output_attentions to the attention function; GPT-2's model pops it (its
# attentions are recorded from the attention modules' outputs only); BERT: an encoder.
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_output_attentions_gives_eager_s_weights(name, device, launches):
    """output_attentions=True under attn_implementation="fused_block": the attention runs the
    model's eager attention (one warning), so the attentions and logits are eager's; they were
    silently left out (the kernel forms no weights). A call without it runs the kernel again."""
    model = interface_model(name, device, "eager").eval()
    ours = _ours(model)
    ids, mask = interface_inputs(name, device)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, output_attentions=True)
        with pytest.warns(UserWarning, match="output_attentions"):
            got = ours(ids, attention_mask=mask, output_attentions=True)
        assert launches["attention_fwd"] == 0
        assert len(got.attentions) == len(want.attentions) == 2
        for a, b in zip(got.attentions, want.attentions):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        with no_fallback():
            ours(ids, attention_mask=mask)
    assert launches["attention_fwd"] == 2


def test_models_outside_the_interface_run_their_eager_attention(device, launches):
    """BLOOM's attention (ALiBi) does not go through AttentionInterface: built with
    attn_implementation="fused_block", its masks are eager's (one warning) and so is its
    answer; set_attn_implementation("fused_block") is refused by transformers itself."""
    cfg = transformers.BloomConfig(vocab_size=V, n_embed=64, n_layer=2, n_head=4, initializer_range=0.2)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager = eager.to(device).eval()
    with pytest.warns(UserWarning, match="do not declare that all their attention goes through"):
        ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="fused_block").to(device)
        ours.load_state_dict(eager.state_dict())
        ours.eval()
        ids, mask = interface_inputs("llama", device)
        with torch.no_grad():
            got = ours(ids, attention_mask=mask).logits
    with torch.no_grad():
        torch.testing.assert_close(got, eager(ids, attention_mask=mask).logits, atol=0, rtol=0)
    refused = copy.deepcopy(eager)
    refused.set_attn_implementation("fused_block")
    assert refused.config._attn_implementation == "eager"
    assert launches["attention_fwd"] == 0


@pytest.mark.parametrize("name,converted,flash_kwargs", [
    ("llama", False, False), ("llama", False, True), ("llama", True, False), ("llama", True, True),
    ("mistral", False, False), ("mistral", True, False)],
    ids=["position_ids", "cu_seq_lens", "converted-position_ids", "converted-cu_seq_lens", "window-position_ids",
         "window-converted-position_ids"])
def test_packed_batch_matches_the_sequences_one_by_one(name, converted, flash_kwargs, device, launches):
    """DataCollatorWithFlattening's batch (one row, restarting position_ids, and with
    return_flash_attn_kwargs its cu_seq_lens_q/k): the loss and every gradient of the
    sequences run one by one (the sum of their losses over the batch's token count), within the
    rule against those in float64. The varlen kernel runs them (no padding), the sequences kept
    apart by cu_seq_lens or else by the restarting position_ids (transformers' own packed mask
    is not built when the model makes a cache, as in training with use_cache); so do the
    layers ``convert`` fuses on the interface, and layers whose sliding window cuts keys (Mistral
    with a window of 3: the light mask made to carry the window has no padding, so the
    position_ids are still read)."""
    model = interface_model(name, device, "sdpa", **({"sliding_window": 3} if name == "mistral" else {})).train()
    ref, ours = copy.deepcopy(model).double(), _ours(model)
    if converted:
        with no_fallback():
            fused_block.convert(ours)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (4, 7, 3)]  # no padding anywhere
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": s} for s in seqs], return_tensors="pt")
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    n_items = sum(len(s) - 1 for s in seqs)
    with no_fallback():
        packed = ours(**batch, num_items_in_batch=n_items).loss
        packed.backward()
    one_by_one = []
    for m in (ref, model):
        total = 0.0
        for s in seqs:
            ids = torch.tensor([s], device=device)
            loss = m(ids, labels=ids, num_items_in_batch=n_items).loss
            loss.backward()
            total = total + loss.detach()
        one_by_one.append(total)
    assert_close("loss", packed, *one_by_one, torch.float32, device)
    for (pname, p), base, got in zip(ref.named_parameters(), model.parameters(), ours.parameters()):
        assert_close(f"{pname}.grad", got.grad, p.grad, base.grad, torch.float32, device)
    assert launches["attention_fwd"] == launches["attention_bwd"] == 2  # one varlen launch per layer


@pytest.mark.parametrize("converted", [False, True], ids=["interface", "converted"])
def test_attention_dropout_one_as_sdpa(converted, device, launches):
    """attention_dropout=1.0 in training (SDPA takes dropout_p=1.0: zeros, zero gradients): the
    sdpa model's logits and every parameter's gradient, on the interface and with the layers
    ``convert`` fuses. It raised "dropout_p must be in [0, 1)" from the attention functions."""
    model = interface_model("llama", device, "sdpa", attention_dropout=1.0).train()
    ours = _ours(model)
    if converted:
        with no_fallback():
            fused_block.convert(ours)
    ids, _ = interface_inputs("llama", device)
    out = []
    for m in (model, ours):
        logits = m(ids).logits
        logits.square().mean().backward()
        out.append(logits)
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert launches["attention_fwd"] == 2


def test_packed_position_ids_are_read_once_per_forward(device, launches):
    """A packed row told apart by its restarting position_ids only, through four layers: one
    bincount and two host reads per forward (whether the positions restart, and the longest
    sequence), none on a second forward with the same tensor, one again after an in-place change
    (another split), each forward's logits those of its sequences run one by one. Every layer
    built a new sequence-index tensor from the position_ids, so the lengths' cache (on that
    tensor) never hit: a bincount and a host read (a GPU sync) per layer. Under inference mode
    (no version counter) the tensor is read every time, with the same answer. (Four layers: a
    per-layer read shows as 4; lengths 4, 7, 3 then 7, 4, 3, the batch of the packed tests.)"""
    from fused_block import profiling
    model = interface_model("llama", device, "sdpa", num_hidden_layers=4).eval()
    ours = _ours(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (1, 14), generator=g).to(device)

    def positions(lens):
        return torch.cat([torch.arange(n, device=device) for n in lens])[None]

    def one_by_one(lens):
        parts, start = [], 0
        for n in lens:
            parts.append(model(ids[:, start:start + n]).logits)
            start += n
        return torch.cat(parts, 1)

    pos = positions((4, 7, 3))
    got = []
    with torch.no_grad(), no_fallback():
        first = profiling.count_kernels(lambda: got.append(ours(ids, position_ids=pos).logits))
        again = profiling.count_kernels(lambda: got.append(ours(ids, position_ids=pos).logits))
        pos.copy_(positions((7, 4, 3)))  # in place: another split
        changed = profiling.count_kernels(lambda: got.append(ours(ids, position_ids=pos).logits))
        for logits, lens in zip(got, ((4, 7, 3), (4, 7, 3), (7, 4, 3))):
            torch.testing.assert_close(logits, one_by_one(lens), atol=1e-5, rtol=1e-5)
    for counts, reads in ((first, 2), (again, 0), (changed, 2)):
        assert counts.torch.get("bincount", 0) == reads // 2, counts.torch
        assert counts.syncs == ({"_local_scalar_dense": reads} if reads else {}), counts.syncs
    with torch.inference_mode():
        frozen = positions((3, 4, 7))
        torch.testing.assert_close(ours(ids, position_ids=frozen).logits, one_by_one((3, 4, 7)), atol=1e-5,
                                   rtol=1e-5)
    assert launches["attention_fwd"] == 4 * 4


@pytest.mark.parametrize("positions", [None, [0, 1, 2, 3, 4, 0, 1, 2, 3]], ids=["model-made", "restarting"])
def test_one_row_under_inference_mode(positions, device, launches):
    """A one-row call under torch.inference_mode (a pipeline's batch of one): the position_ids
    the model makes there, or the caller's restarting ones (a packed row), are inference tensors,
    which have no version counter: read on every call (not cached per version as other
    tensors), the original's logits (they crashed reading the counter)."""
    model = interface_model("llama", device, "sdpa").eval()
    ref, ours = copy.deepcopy(model).double(), _ours(model)
    ids, _ = interface_inputs("llama", device)
    with torch.inference_mode():
        kw = dict(use_cache=False)
        if positions is not None:
            kw["position_ids"] = torch.tensor([positions], device=device)
        logits = [m(ids[:1], **kw).logits for m in (ref, model, ours)]
    assert_close("logits", logits[2], logits[0], logits[1], torch.float32, device)
    assert launches["attention_fwd"] == 2


def test_torch_compile_fullgraph(device, launches):
    """torch.compile(fullgraph=True) of a model on the interface (aot_eager: dynamo, the ops'
    fake implementations and AOT autograd): a training step with a padding mask runs the
    kernel's forward and backward and gives the eager step's loss and gradients."""
    model = interface_model("llama", device, "fused_block").train()
    ids, mask = interface_inputs("llama", device)
    labels = ids.masked_fill(mask == 0, -100)
    with no_fallback():
        loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    before = launches["attention_bwd"]
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(ids, attention_mask=mask, labels=labels).loss
    got.backward()
    assert launches["attention_bwd"] - before == 2
    torch.testing.assert_close(got, loss, atol=1e-6, rtol=0)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_converted_layers_read_the_interface_masks(name, device, launches):
    """convert() on a model running attn_implementation="fused_block": the whole layer is
    fused (RoPE, GEMMs, norms) and reads the interface's masks, padding included (gpt-oss:
    the sliding layer's window from the interface's mask, the sinks); the original's answer,
    no warning."""
    model = interface_model(name, device, _original(name)).eval()
    with no_fallback():
        ours = fused_block.convert(_ours(model))
        ids, mask = interface_inputs(name, device)
        with torch.no_grad():
            got = _masked(ours(ids, attention_mask=mask).logits, mask)
    with torch.no_grad():
        want, base = (_masked(m(ids, attention_mask=mask).logits, mask) for m in (copy.deepcopy(model).double(), model))
    assert_close("logits", got, want, base, torch.float32, device)
    assert launches["rope_qkvpacked"] == 2 and launches["attention_fwd"] == 2


@pytest.mark.parametrize("case", ["head_dim", "float64"])
def test_calls_the_kernel_cannot_take_run_sdpa(case, device, launches):
    """A head dim below the kernel's 16, and float64: one warning, transformers' own
    sdpa_attention_forward, so sdpa's answer exactly."""
    overrides = dict(hidden_size=32, head_dim=8) if case == "head_dim" else {}
    model = interface_model("llama", device, "sdpa", **overrides).eval()
    if case == "float64":
        model = model.double()
    ours = _ours(model)
    ids, mask = interface_inputs("llama", device)
    with torch.no_grad(), pytest.warns(UserWarning, match="head dim 8" if case == "head_dim" else "dtype"):
        got = ours(ids, attention_mask=mask).logits
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids, attention_mask=mask).logits, atol=0, rtol=0)
    assert launches["attention_fwd"] == 0


@pytest.mark.parametrize("packed", [False, True], ids=["kernel-bias", "packed-falls-back"])
def test_position_bias_is_the_kernels_bias_with_its_gradient(packed, device, launches):
    """T5's position_bias (1, H, Lq, Lk) beside a causal + padding light mask: the kernel's bias
    input, the answer and the bias's gradient SDPA's (transformers' sdpa_attention_forward); in
    a packed batch (cu_seq_lens), which the varlen kernel cannot bias, sdpa_attention_forward
    after a warning. 2 x 4 heads x 6 tokens of head dim 16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, L, D = 2, 4, 6, 16
    q, k, v = (torch.randn(B, H, L, D, device=device, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, H, L, L, device=device, requires_grad=True)
    if packed:
        B = 1
        q, k, v = (t[:1].detach().requires_grad_() for t in (q, k, v))
        mask, extra = None, dict(cu_seq_lens_q=torch.tensor([0, 3, 6], device=device), max_length_q=3)
    else:
        mask, extra = _padding([L, L - 2], L, False, device), {}  # (B, Lk): causal, right padding (no empty row)
    module = _Module(True, 1)
    with pytest.warns(UserWarning, match="position bias in a packed batch") if packed else no_fallback():
        got, _ = interface.attention(module, q, k, v, mask, scaling=1.0, position_bias=bias, **extra)
    grads = torch.autograd.grad(got.sum(), (q, k, v, bias))
    if packed:
        seq = torch.tensor([0, 0, 0, 1, 1, 1], device=device)
        dense = (seq[:, None] == seq[None, :]) & torch.ones(L, L, dtype=torch.bool, device=device).tril()
    else:
        dense = mask[:, None, None, :] & torch.ones(L, L, dtype=torch.bool, device=device).tril()
    want, _ = sdpa_attention_forward(module, q, k, v, dense.expand(B, 1, L, L), scaling=1.0, position_bias=bias)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v, bias))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    for name, a, b in zip(("q", "k", "v", "position_bias"), grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}.grad: {m}")
    assert launches["attention_fwd"] == launches["attention_bwd"] == (0 if packed else 1)


class _Module(torch.nn.Module):
    """What attention functions read from transformers' attention modules."""

    def __init__(self, is_causal, groups):
        super().__init__()
        self.is_causal, self.num_key_value_groups = is_causal, groups


def _padding(lengths, total, left, device):
    """(B, total) bool, True for the n tokens of each row (at the end with left padding)."""
    keep = torch.zeros(len(lengths), total, dtype=torch.bool, device=device)
    for b, n in enumerate(lengths):
        keep[b, slice(total - n, None) if left else slice(None, n)] = True
    return keep


# (mask function, q_length, kv_length, q_offset, kv_offset, 2-D padding or None, is the form light)
_W = 4  # a sliding window of 4 keys (the causal overlay keeps q - kv < 4)
MASK_CASES = {
    "causal": ("causal", 6, 6, 0, 0, None, True),
    "causal-padded": ("causal", 6, 6, 0, 0, "left", True),
    "causal-prefix-cached": ("causal", 2, 6, 4, 0, None, True),  # chunked prefill on a cache
    "causal-decoding-padded": ("causal", 1, 6, 5, 0, "left", True),
    "bidirectional": ("bidirectional", 6, 6, 0, 0, None, True),
    "bidirectional-padded": ("bidirectional", 6, 6, 0, 0, "right", True),
    "window-cuts-nothing": ("window", 4, 4, 0, 0, "left", True),
    "window-cuts": ("window", 6, 6, 0, 0, "left", True),  # the window rides on the light mask
    # a sliding cache's decoding step: window - 1 cached keys from position 5 on, the query at 8
    "window-cache-decoding": ("window", 1, 4, 8, 5, "left", True),
    "bidirectional-window-cuts": ("bidirectional-window", 6, 6, 0, 0, None, True),
    "packed": ("packed", 6, 6, 0, 0, None, False),  # an and-mask of another structure: sdpa_mask's
    "packed-remapped": ("packed-remapped", 6, 6, 0, 0, None, True),  # as create_causal_mask builds it
    "static-cache": ("causal", 2, 8, "tensor", 0, "right", False),  # a tensor offset: not read
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_mask_forms_give_sdpas_answer_without_reading_values(case, device, launches, monkeypatch):
    """interface.mask gives the light forms (None, (B, Lk), (B, 1, 1, Lk)) for the patterns the
    kernel takes and transformers' sdpa_mask otherwise; interface.attention on either gives
    SDPA's answer with sdpa_mask's mask. The light forms are built and read without a value
    read (Tensor.any/all/item/equal fail here)."""
    from transformers import masking_utils as mu

    kind, Lq, Lk, q_offset, kv_offset, pad, light = MASK_CASES[case]
    B, H, Hkv, D = 2, 4, 2, 16
    total = kv_offset + Lk
    padding = None if pad is None else _padding([total, total - 2], total, pad == "left", device)
    functions = {"causal": mu.causal_mask_function, "bidirectional": mu.bidirectional_mask_function,
                 "window": mu.sliding_window_causal_mask_function(_W),
                 "bidirectional-window": mu.sliding_window_bidirectional_mask_function(1),
                 "packed": mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(
                     torch.tensor([[0, 0, 0, 1, 1, 1]] * B, device=device))),
                 "packed-remapped": mu.and_masks(
                     mu.remap_positions_for_packed_sequence(mu.causal_mask_function,
                                                            torch.tensor([[0, 1, 2, 0, 1, 2]] * B, device=device)),
                     mu.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 1]] * B, device=device)))}
    fn = functions[kind]
    offset = torch.tensor(0, device=device) if q_offset == "tensor" else q_offset  # a StaticCache's prefill
    args = dict(batch_size=B, q_length=Lq, kv_length=Lk, q_offset=offset, kv_offset=kv_offset, mask_function=fn,
                attention_mask=padding, device=device, local_size=_W if "window" in kind else None,
                allow_is_causal_skip="packed" not in kind)  # as create_causal_mask passes them
    want_mask = mu.sdpa_mask(**{**args, "allow_is_causal_skip": False})
    if light:
        for name in ("any", "all", "item", "equal"):
            monkeypatch.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("a mask value was read"))
    got_mask = interface.mask(**args)
    form = got_mask is None or got_mask.dim() == 2 or tuple(got_mask.shape[1:3]) == (1, 1)
    assert form == light
    q = torch.randn(B, H, Lq, D, device=device)
    k, v = (torch.randn(B, Hkv, Lk, D, device=device) for _ in range(2))
    causal = kind in ("causal", "window", "packed", "packed-remapped")
    with no_fallback():  # the other forms: the kernel reads sdpa_mask's 4-D mask
        got, _ = interface.attention(_Module(causal, H // Hkv), q, k, v, got_mask, scaling=0.3)
    monkeypatch.undo()
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=want_mask, scale=0.3).transpose(1, 2)
    seen = want_mask.any(-1).transpose(1, 2)[..., None]  # rows with no key: SDPA NaN, the kernel 0
    torch.testing.assert_close(got.masked_fill(~seen, 0), want.masked_fill(~seen, 0), atol=2e-6, rtol=0)
    assert launches["attention_fwd"] == 1


def test_mask_for_models_outside_the_interface_is_eagers():
    cfg = transformers.BloomConfig(vocab_size=V, n_embed=64, n_layer=1, n_head=4)
    from transformers import masking_utils as mu

    args = dict(batch_size=1, q_length=3, kv_length=3, dtype=torch.float32, config=cfg)
    with pytest.warns(UserWarning, match="BloomConfig"):
        got = interface.mask(**args)
    torch.testing.assert_close(got, mu.eager_mask(**args), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# encoder-decoders: the encoder's self-attention, the decoder's causal self-attention and its
# cross-attention to the encoder's (padded) output, all through the interface
# ---------------------------------------------------------------------------------------------

# name -> (kernel launches per forward of 2 + 2 layers, the fallback warning or None)
SEQ2SEQ_EXPECT = {"bart": (6, None), "whisper": (6, None), "t5": (6, None)}


def _seq2seq_expecting(name):
    match = SEQ2SEQ_EXPECT[name][1]
    return no_fallback() if match is None else pytest.warns(UserWarning, match=match)


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoder_logits_and_gradients_match_sdpa(name, device, launches):
    model = seq2seq_model(name, device, "sdpa").train()
    ref, ours = copy.deepcopy(model).double(), _ours(model)
    enc, targets = seq2seq_inputs(name, device)
    outs = {}
    for key, m in (("ref", ref), ("base", model), ("ours", ours)):
        args = {k: v.double() if v.is_floating_point() and key == "ref" else v for k, v in enc.items()}
        with _seq2seq_expecting(name) if key == "ours" else no_fallback():
            out = m(**args, labels=targets)
            out.loss.backward()
        outs[key] = (out, dict(m.named_parameters()))
    assert_close("loss", outs["ours"][0].loss, outs["ref"][0].loss, outs["base"][0].loss, torch.float32, device)
    assert_close("logits", outs["ours"][0].logits, outs["ref"][0].logits, outs["base"][0].logits, torch.float32,
                 device)
    for pname, p in outs["ref"][1].items():
        if p.grad is None:  # the padding token's embedding row
            continue
        assert_close(f"{pname}.grad", outs["ours"][1][pname].grad, p.grad, outs["base"][1][pname].grad,
                     torch.float32, device)
    assert launches["attention_fwd"] == launches["attention_bwd"] == SEQ2SEQ_EXPECT[name][0]


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoder_bf16_logits(name, device, launches):
    model = seq2seq_model(name, device, "sdpa").eval()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model).to(torch.bfloat16)
    ours = _ours(base)
    enc, targets = seq2seq_inputs(name, device)
    with torch.no_grad():
        want = ref(**{k: v.double() if v.is_floating_point() else v for k, v in enc.items()}, labels=targets).logits
        base_logits = base(**{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in enc.items()},
                           labels=targets).logits
        with _seq2seq_expecting(name):
            got = ours(**{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in enc.items()},
                       labels=targets).logits
    assert_close("logits", got, want, base_logits, torch.bfloat16, device)
    assert launches["attention_fwd"] == SEQ2SEQ_EXPECT[name][0]


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoder_greedy_generation_matches(name, device, launches):
    """generate() with the encoder's outputs and both caches (the decoder's self-attention
    keys growing, the cross-attention keys computed once): 16 greedy tokens, the original's.
    One layer each; weights of std 0.5, as the decoders' generation test."""
    std = dict(init_std=0.5) if name != "t5" else dict(initializer_factor=3.0)
    model = seq2seq_model(name, device, "sdpa", layers=1, **std).eval()
    ours = _ours(model)
    enc, _ = seq2seq_inputs(name, device)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    want = model.generate(**enc, **kw)
    with _seq2seq_expecting(name):
        got = ours.generate(**enc, **kw)
    assert len(set(want[0, -16:].tolist())) > 3
    assert torch.equal(got, want)
    if SEQ2SEQ_EXPECT[name][0]:  # the encoder once, then per token the self- and cross-attention
        assert launches["attention_fwd"] == 1 + 2 * 16
