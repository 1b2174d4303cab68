"""The call-time guard (fused_block._guard): a fused layer whose submodules are no longer what it
fuses (hooks, adapters, subclasses, tensor-subclass weights, patched forwards) gives the
original's answer with a one-time warning, and goes back to the kernels once they are again.

Everything is compared in fp32 with the original module on the same weights and inputs; where
the original path runs, the answer is torch's (or Hugging Face's) own, so the tolerance is the
summation-order noise of the same ops. d_model 32 with 2 heads: head dim 16, the kernel's
smallest; L = 5: tiny, for the interpreter.
"""
import contextlib
import copy
import warnings
import zlib

import pytest
import torch
from torch import nn

import fused_block
from fused_block import _guard, blocks

D, H, FF, B, L = 32, 2, 64, 2, 5
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@contextlib.contextmanager
def _no_fallback():
    """A fallback warning fails (the interpreter's own numpy DeprecationWarnings do not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=UserWarning)
        yield


def _pair(device, decoder=False, **kw):
    cls = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    ref = cls(D, H, FF, dropout=0.0, batch_first=True, device=device, **kw).train()
    return ref, fused_block.convert(copy.deepcopy(ref))


def _run(layer, x, mem=None):
    return layer(x) if mem is None else layer(x, mem)


def _kernel_launches(launches):
    return launches["add_norm_fwd"] + launches["matmul"]


class _Rounding(nn.Linear):
    """A bitsandbytes-like nn.Linear subclass: its own forward computes something else."""

    def forward(self, x):
        return super().forward(x).round()


def _swap(layer, name, cls=_Rounding):
    old = layer.get_submodule(name)
    new = cls(old.in_features, old.out_features, bias=old.bias is not None, device=old.weight.device)
    new.load_state_dict(old.state_dict())
    parent, _, leaf = name.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, leaf, new)


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_hooks_on_sublayers_run_torchs_forward(device, launches, decoder):
    """The issue's case: a hook doubling linear1's output and one adding 1 to norm1's, added
    after the layer already ran fused (so the cached verdict must notice them)."""
    ref, fused = _pair(device, decoder)
    x = torch.randn(B, L, D, device=device)
    mem = torch.randn(B, L + 2, D, device=device) if decoder else None
    torch.testing.assert_close(_run(fused, x, mem), _run(ref, x, mem), **TOL)
    handles = []
    for layer in (ref, fused):
        handles.append(layer.linear1.register_forward_hook(lambda m, i, o: o * 2))
        handles.append(layer.norm1.register_forward_pre_hook(lambda m, i: (i[0] + 1,)))
    with pytest.warns(UserWarning, match="linear1 has a forward hook"):
        got = _run(fused, x, mem)
    torch.testing.assert_close(got, _run(ref, x, mem), **TOL)
    for h in handles:
        h.remove()
    before = _kernel_launches(launches)
    with _no_fallback():
        torch.testing.assert_close(_run(fused, x, mem), _run(ref, x, mem), **TOL)
    assert _kernel_launches(launches) > before  # fused again once the hooks are gone


@pytest.mark.parametrize("where", ["linear1", "linear2", "self_attn", "norm2"])
def test_hook_kinds_and_places(device, where):
    """Forward, pre and backward hooks on every kind of bypassed submodule are seen."""
    ref, fused = _pair(device)
    x = torch.randn(B, L, D, device=device, requires_grad=True)
    fused(x)
    seen = []
    fused.get_submodule(where).register_full_backward_hook(lambda m, gi, go: seen.append(1))
    with pytest.warns(UserWarning, match=f"{where} has a backward hook"):
        fused(x).sum().backward()
    assert seen


def test_subclass_swapped_in_after_construction(device):
    """The issue's case: an nn.Linear subclass with its own forward put into linear1."""
    ref, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    fused(x)
    for layer in (ref, fused):
        _swap(layer, "linear1")
    with pytest.warns(UserWarning, match="linear1 is a .*_Rounding, not torch.nn.modules.linear.Linear"):
        got = fused(x)
    torch.testing.assert_close(got, ref(x), **TOL)


def test_instance_forward_and_global_hooks(device):
    """What torch announces nowhere: a patched instance forward (accelerate's hooks do this)
    and a global module hook are checked on every call."""
    ref, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    fused(x)
    for layer in (ref, fused):
        lin = layer.linear2
        lin.forward = lambda t, lin=lin: nn.Linear.forward(lin, t) * 3
    with pytest.warns(UserWarning, match="linear2 has an instance-level forward"):
        got = fused(x)
    torch.testing.assert_close(got, ref(x), **TOL)
    for layer in (ref, fused):
        del layer.linear2.forward
    torch.testing.assert_close(fused(x), ref(x), **TOL)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o + 1 if isinstance(m, nn.Dropout) else None)
    try:
        with pytest.warns(UserWarning, match="global module hook"):
            got = fused(x)
        torch.testing.assert_close(got, ref(x), **TOL)
    finally:
        handle.remove()


class _Tagged(torch.Tensor):
    """A tensor subclass standing in for torchao's quantized weights or a DTensor."""


def test_tensor_subclass_weight(device):
    ref, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    fused(x)
    fused.linear1.weight = nn.Parameter(fused.linear1.weight.detach().clone().as_subclass(_Tagged))
    with pytest.warns(UserWarning, match="linear1.weight is a _Tagged"):
        got = fused(x)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), ref(x), **TOL)


def test_swiglu_rms_gqa_layer_falls_back_to_its_own_math(device):
    """Layers torch's forward cannot compute (SwiGLU, RMSNorm, GQA, RoPE) still run it, with the
    FFN block written for SwiGLU; a hook then sees the same tensor the fused math computes."""
    torch.manual_seed(0)
    layer = fused_block.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation="swiglu", batch_first=True,
                                                norm_first=True, bias=False, norm="rms", num_kv_heads=1,
                                                rope=True, device=device)
    x = torch.randn(B, L, D, device=device)
    want = layer(x)
    seen = []
    handle = layer.linear2.register_forward_hook(lambda m, i, o: seen.append(o))
    with pytest.warns(UserWarning, match="linear2 has a forward hook"):
        got = layer(x)
    handle.remove()
    assert len(seen) == 1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_verdict_is_cached_until_something_changes(device, monkeypatch):
    """The full check runs once, not per call; a registration anywhere, a hook on a watched
    submodule or an assignment makes it run again."""
    _, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    calls = []
    real = blocks._describe_layer
    monkeypatch.setattr(blocks, "_describe_layer", lambda layer: calls.append(1) or real(layer))
    with torch.no_grad():
        fused(x)
        fused(x)
        assert len(calls) == 1
        handle = fused.dropout1.register_forward_hook(lambda *a: None)
        with pytest.warns(UserWarning, match="dropout1 has a forward hook"):
            fused(x)
        handle.remove()
        fused(x)
        fused(x)
        n = len(calls)
        fused.norm1 = copy.deepcopy(fused.norm1)  # an assignment bumps the epoch
        fused(x)
        assert len(calls) == n + 1
        fused(x)
        assert len(calls) == n + 1


def test_copies_have_their_own_verdict(device):
    """deepcopy keeps the counting hook dicts; a hook on the copy is seen, the original stays fused."""
    _, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    fused(x)
    twin = copy.deepcopy(fused)
    twin(x)
    twin.linear1.register_forward_hook(lambda m, i, o: o * 0)
    with pytest.warns(UserWarning, match="linear1 has a forward hook"):
        twin(x)
    with _no_fallback():
        fused(x)


def test_mha_with_a_subclass_weight_runs_torchs_attention(device):
    mha = blocks.MultiheadAttention(D, H, batch_first=True, device=device)
    ref = nn.MultiheadAttention(D, H, batch_first=True, device=device)
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(B, L, D, device=device)
    mha.in_proj_weight = nn.Parameter(mha.in_proj_weight.detach().clone().as_subclass(_Tagged))
    with pytest.warns(UserWarning, match="in_proj_weight is a _Tagged"):
        got = mha(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(got.as_subclass(torch.Tensor), ref(x, x, x, need_weights=False)[0], **TOL)


def test_describe_scans_every_submodule():
    """An unknown submodule (added to a bypassed one) is a reason, not ignored."""
    layer = fused_block.TransformerEncoderLayer(D, H, FF, batch_first=True)
    layer.linear1.extra = nn.Identity()
    why, watched, _ = blocks._describe_layer(layer)
    assert why == "linear1.extra (torch.nn.modules.linear.Identity) is a submodule the fused path does not know"
    assert watched == ()
    del layer.linear1.extra
    why, watched, _ = blocks._describe_layer(layer)
    assert why is None and layer.linear1 in watched


def test_hook_dicts_keep_their_handles(device):
    """Replacing an empty hook dict keeps torch's hook machinery working: handles made after the
    swap remove their hooks, and the hook fires through torch's forward."""
    _, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    fused(x)
    assert type(fused.linear1._forward_hooks) is _guard._HookDict
    seen = []
    handle = fused.linear1.register_forward_hook(lambda m, i, o: seen.append(1), prepend=True)
    with pytest.warns(UserWarning):
        fused(x)
    assert seen == [1]
    handle.remove()
    assert not fused.linear1._forward_hooks
    fused(x)
    assert seen == [1]


# ---------------------------------------------------------------------------------------------
# Hugging Face layers converted in place
# ---------------------------------------------------------------------------------------------

def _hf_pair(arch, device):
    hf_testing = pytest.importorskip("hf_testing")
    model = hf_testing.model(arch, device).eval()
    return model, fused_block.convert(copy.deepcopy(model)), hf_testing.inputs(arch, device)[0]


@pytest.mark.parametrize("order", ["convert_then_adapt", "adapt_then_convert"])
def test_peft_dora_on_a_converted_llama(device, order):
    """The issue's case with a LoRA variant the fused path does not reproduce (DoRA on q_proj,
    v_proj, down_proj; plain LoRA is fused, tests/test_lora.py): PEFT's own logits, with a
    warning naming the wrapped submodule."""
    peft = pytest.importorskip("peft")
    model, fused, ids = _hf_pair("llama", device)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                           use_dora=True)
    torch.manual_seed(1)
    want_model = peft.get_peft_model(copy.deepcopy(model), lora)
    torch.manual_seed(1)
    if order == "convert_then_adapt":
        got_model = peft.get_peft_model(fused, lora)
        with torch.no_grad(), pytest.warns(UserWarning, match="self_attn.q_proj.lora_magnitude_vector"):
            got = got_model(ids).logits
    else:
        with pytest.warns(UserWarning, match="lora_magnitude_vector"):
            got_model = fused_block.convert(peft.get_peft_model(copy.deepcopy(model), lora))
            with torch.no_grad():
                got = got_model(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(got, want_model(ids).logits, **TOL)


@pytest.mark.parametrize("arch,where", [("llama", "self_attn.o_proj"), ("bert", "intermediate.dense")])
def test_hf_linear_subclass_after_conversion(device, arch, where):
    model, fused, ids = _hf_pair(arch, device)
    layer = fused.model.layers[0] if arch == "llama" else fused.bert.encoder.layer[0]
    with torch.no_grad():
        fused(ids)
        _swap(layer, where)
        _swap(model.model.layers[0] if arch == "llama" else model.bert.encoder.layer[0], where)
        with pytest.warns(UserWarning, match=f"{where} is a .*_Rounding"):
            got = fused(ids).logits
        torch.testing.assert_close(got, model(ids).logits, **TOL)


def test_hf_hooks_and_instance_forwards(device, launches):
    """GPT-2: a hook on attn.c_attn (a Conv1D the fused path reads as a transposed weight)
    fires, and the answer is the original's; once removed, the kernels run again."""
    model, fused, ids = _hf_pair("gpt2", device)
    block = fused.transformer.h[1]
    seen = []
    with torch.no_grad():
        want = model(ids).logits
        handle = block.attn.c_attn.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        with pytest.warns(UserWarning, match="attn.c_attn has a forward hook"):
            got = fused(ids).logits
        assert len(seen) == 1
        torch.testing.assert_close(got, want, **TOL)
        handle.remove()
        block.mlp.act.forward = lambda t: t  # an identity activation: the original's forward uses it
        model.transformer.h[1].mlp.act.forward = lambda t: t
        with pytest.warns(UserWarning, match="mlp.act has an instance-level forward"):
            got = fused(ids).logits
        torch.testing.assert_close(got, model(ids).logits, **TOL)
        del block.mlp.act.forward, model.transformer.h[1].mlp.act.forward
        before = launches["matmul"]
        torch.testing.assert_close(fused(ids).logits, want, **TOL)
        assert launches["matmul"] > before


@pytest.mark.parametrize("where,match", [("self_attn.k_proj", "left unconverted"),
                                         ("mlp.up_proj", "MLP runs Hugging Face's module")])
def test_hf_quantized_subclass_before_conversion(device, where, match):
    """A quantization library that swapped linears before ``convert`` (bitsandbytes'
    Linear8bitLt is an nn.Linear subclass): that part stays unconverted, with a warning."""
    model, _, ids = _hf_pair("llama", device)
    for layer in model.model.layers:
        _swap(layer, where)
    with pytest.warns(UserWarning, match=match):
        fused = fused_block.convert(copy.deepcopy(model))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, **TOL)


def test_parametrized_weights_are_read_through(device, launches):
    """torch.nn.utils.parametrize on linear1's, norm1's and the attention's weights: the fused
    path reads the parametrized weights (no fallback), and gives torch's layer's answer with the
    same parametrizations."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    ref, fused = _pair(device)
    for layer in (ref, fused):
        for module, name in ((layer.linear1, "weight"), (layer.norm1, "weight"), (layer.self_attn, "in_proj_weight"),
                             (layer.self_attn.out_proj, "weight")):
            parametrize.register_parametrization(module, name, Doubled())
    x = torch.randn(B, L, D, device=device, requires_grad=True)
    with _no_fallback():
        got = fused(x)
    torch.testing.assert_close(got, ref(x), **TOL)
    assert launches["matmul"] > 0
    got.sum().backward()
    ref(x).sum().backward()
    for get in (lambda m: m.linear1.parametrizations.weight, lambda m: m.norm1.parametrizations.weight,
                lambda m: m.self_attn.parametrizations.in_proj_weight,
                lambda m: m.self_attn.out_proj.parametrizations.weight):
        torch.testing.assert_close(get(fused).original.grad, get(ref).original.grad, **TOL)


def test_parametrizations_with_several_originals_and_made_before_convert(device, launches):
    """weight_norm on linear1 (a parametrization over two originals, g and v) and a
    parametrization on the attention's in_proj_weight made before ``convert`` (the converted
    MultiheadAttention keeps the parametrized property): both read through, torch's answer and
    gradients of every original."""
    from torch.nn.utils import parametrize

    class Scaled(nn.Module):
        def forward(self, w):
            return 1.1 * w

    ref = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, device=device).train()
    nn.utils.parametrizations.weight_norm(ref.linear1)
    parametrize.register_parametrization(ref.self_attn, "in_proj_weight", Scaled())
    fused = fused_block.convert(copy.deepcopy(ref))
    assert parametrize.type_before_parametrizations(fused.self_attn) is fused_block.MultiheadAttention
    x = torch.randn(B, L, D, device=device)
    with _no_fallback():
        got = fused(x)
    torch.testing.assert_close(got, ref(x), **TOL)
    assert launches["matmul"] > 0 and launches["attention_fwd"] == 1
    got.sum().backward()
    ref(x).sum().backward()
    for get in (lambda m: m.linear1.parametrizations.weight.original0, lambda m: m.linear1.parametrizations.weight.original1,
                lambda m: m.self_attn.parametrizations.in_proj_weight.original):
        torch.testing.assert_close(get(fused).grad, get(ref).grad, **TOL)


# ---------------------------------------------------------------------------------------------
# The guard costs no compiled graph and no recomputed verdict (issue 29, item 5)
# ---------------------------------------------------------------------------------------------

class _Graphs:
    """A torch.compile backend that counts the graphs dynamo hands it (each compile or
    recompile); it runs them as traced. A function, not a CompileCounter instance: transformers
    deep-copies its CompileConfig, and a copied counter would count elsewhere."""

    def __init__(self):
        self.count = 0

    def backend(self):
        def run(gm, example_inputs, **_options):
            self.count += 1
            return gm.forward
        return run


def _count_describes(monkeypatch, module, name="_describe"):
    """Count the eager full checks of ``module.<name>`` (not the traced ones: a list appended
    to while dynamo traces would be guarded on)."""
    calls = []
    real = getattr(module, name)

    def counted(layer):
        if not torch.compiler.is_compiling():
            calls.append(layer)
        return real(layer)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_registrations_elsewhere_keep_the_verdict(device, monkeypatch):
    """A registration outside the layer's tree (a new ModuleList holding the layer, as HF's
    ``self.layers[:n]`` builds on every forward; an unrelated module) leaves the cached verdict
    and the epoch alone; one on a module under the layer still bumps it."""
    _, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    calls = _count_describes(monkeypatch, blocks, "_describe_layer")
    with torch.no_grad():
        fused(x)
        epoch = _guard._EPOCH
        nn.ModuleList([fused])[:1]
        nn.Linear(2, 2).register_buffer("extra", torch.zeros(1))
        fused(x)
        assert _guard._EPOCH == epoch and len(calls) == 1
        fused.linear1.extra = nn.Identity()  # under the layer: checked again
        assert _guard._EPOCH > epoch
        with pytest.warns(UserWarning, match="linear1.extra .* is a submodule the fused path does not know"):
            fused(x)
        assert len(calls) == 2


def test_a_submodule_swapped_without_registration_is_seen(device, launches):
    """A submodule replaced through its parent's ``_modules`` dict (no registration hook fires:
    ``torch.ao.quantization``'s swaps, transformers' AWQ and HIGGS replacements) after the layer
    ran fused: the cached verdict held, so the fused path read the new module's weight and
    skipped its forward (here a rounding linear: output off by 0.55); now torch's forward runs."""
    ref, fused = _pair(device)
    x = torch.randn(B, L, D, device=device)
    with _no_fallback():
        fused(x)
    for layer in (ref, fused):
        old = layer.linear2
        new = _Rounding(old.in_features, old.out_features, device=device)
        new.load_state_dict(old.state_dict())
        layer._modules["linear2"] = new
    with pytest.warns(UserWarning, match="linear2 is a .*_Rounding"):
        got = fused(x)
    torch.testing.assert_close(got, ref(x), **TOL)



def test_a_tied_attention_swapped_in_its_second_slot_is_seen(device, launches):
    """A decoder layer whose self- and cross-attention are one module (both slots fused, one
    module) after a fused call, its cross-attention slot alone replaced through ``_modules`` by
    another torch ``MultiheadAttention``: the cached verdict watched the module's first slot
    only, so the fused path ran on and called the torch module's ``_attend`` (AttributeError);
    now torch's forward runs, calling the new module (its hook fires), as torch's layer does."""
    ref = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, device=device).train()
    ref.multihead_attn = ref.self_attn
    fused = fused_block.convert(copy.deepcopy(ref))
    x, mem = torch.randn(B, L, D, device=device), torch.randn(B, L + 3, D, device=device)
    with _no_fallback():
        before = launches["attention_fwd"]
        torch.testing.assert_close(fused(x, mem), ref(x, mem), **TOL)
        assert launches["attention_fwd"] == before + 2
    new = nn.MultiheadAttention(D, H, batch_first=True, device=device)
    calls = []
    new.register_forward_hook(lambda *_: calls.append(1))
    for layer in (ref, fused):
        layer._modules["multihead_attn"] = new
    with pytest.warns(UserWarning, match="multihead_attn is a torch.*MultiheadAttention"):
        got = fused(x, mem)
    torch.testing.assert_close(got, ref(x, mem), **TOL)
    assert len(calls) == 2

def test_hf_llama_quantized_in_place_after_a_call_runs_the_original(device, launches):
    """``torch.ao.quantization.quantize_dynamic(..., inplace=True)`` of a converted LLaMA that
    already ran: its linears swapped through ``_modules`` (no registration), the cached verdict
    held and the fused path read the quantized linears' ``weight`` (a method: AttributeError);
    now the layer runs its original forward on the quantized linears, the quantized original's
    logits."""
    hf_testing = pytest.importorskip("hf_testing")
    quantize = getattr(torch.ao.quantization, "quantize_dynamic", None)
    if quantize is None or device.type != "cpu":
        pytest.skip("torch's dynamic quantization (CPU only) is not here")
    model = hf_testing.model("llama", device, layers=1).eval()
    fused = fused_block.convert(copy.deepcopy(model))
    ids, mask = hf_testing.inputs("llama", device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # eager-mode quantization's notice
        fused(ids, attention_mask=mask)
        for m in (model, fused):
            quantize(m.model.layers[0], {nn.Linear}, dtype=torch.qint8, inplace=True)
        with pytest.warns(UserWarning, match="q_proj is a .*quantized.*Linear"):
            got = fused(ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, **TOL)


def test_hf_llama_compiles_once_beside_the_import(device, monkeypatch):
    """The issue's case: importing fused_block made torch.compile(fullgraph=True) of a plain
    HF LLaMA recompile on every call (its forward slices ``self.layers``, which registered
    modules, which bumped the guard's epoch, which the graph guarded on). Now one graph for
    five same-shape calls, with a converted model's eager calls in between."""
    hf_testing = pytest.importorskip("hf_testing")
    from fused_block.hf import _core

    model = hf_testing.model("llama", device).eval()
    fused = fused_block.convert(copy.deepcopy(model))
    ids, mask = hf_testing.inputs("llama", device)
    calls = _count_describes(monkeypatch, _core)
    graphs = _Graphs()
    compiled = torch.compile(model, backend=graphs.backend(), fullgraph=True)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        for _ in range(5):
            torch.testing.assert_close(compiled(ids, attention_mask=mask).logits, want, **TOL)
            fused(ids, attention_mask=mask)
    assert graphs.count == 1
    assert len(calls) == model.config.num_hidden_layers  # one verdict per layer over five forwards


def test_converted_hf_llama_compiles_once_and_decodes_with_a_static_cache(device, launches, monkeypatch):
    """A converted LLaMA under torch.compile(fullgraph=True): one graph over three same-shape
    forwards; generation with a static cache compiles its decoding step once over two
    generate calls (transformers' test_generate_compile_model_forward_fullgraph and
    test_static_cache_no_recompile); the eager verdicts (the prefills) are computed once per
    layer; the tokens are the original model's."""
    hf_testing = pytest.importorskip("hf_testing")
    from fused_block.hf import _core

    model = hf_testing.model("llama", device).eval()
    fused = fused_block.convert(copy.deepcopy(model))
    ids, mask = hf_testing.inputs("llama", device)
    calls = _count_describes(monkeypatch, _core)
    graphs = _Graphs()
    compiled = torch.compile(fused, backend=graphs.backend(), fullgraph=True)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        for _ in range(3):
            torch.testing.assert_close(compiled(ids, attention_mask=mask).logits, want, **TOL)
    assert graphs.count == 1 and launches["matmul"] > 0
    transformers = pytest.importorskip("transformers")
    decode = _Graphs()
    config = transformers.CompileConfig(fullgraph=True, backend=decode.backend())
    config._compile_all_devices = True  # transformers compiles the decoding step on CUDA only otherwise
    want = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    for _ in range(2):
        got = fused.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             cache_implementation="static", compile_config=config)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert decode.count == 1
    assert len(calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("kind", ["encoder", "decoder", "attention"])
def test_num_heads_set_after_construction(kind, device, launches):
    """torch's attention takes its heads from ``num_heads`` on every call (head_dim = embed_dim //
    num_heads); the fused path reads the head counts as built. ``num_heads`` set on a converted
    layer's attention (or a converted MultiheadAttention) after a fused call: torch's answer and
    gradients (torch's forward, with the warning), the kernels again once it is set back. Used
    to fail: the fused path split the projections by the stale num_kv_heads."""
    if kind == "attention":
        ref = nn.MultiheadAttention(D, H, batch_first=True, device=device)
        fused = blocks._convert_mha(copy.deepcopy(ref))
        attn = (ref, fused)

        def run(m, x):
            return m(x, x, x, need_weights=False)[0]
    else:
        ref, fused = _pair(device, decoder=kind == "decoder")
        mem = torch.randn(B, L + 1, D, device=device)
        attn = (ref.self_attn, fused.self_attn)

        def run(m, x):
            return _run(m, x, mem if kind == "decoder" else None)
    x = torch.randn(B, L, D, device=device, requires_grad=True)
    with _no_fallback():
        run(fused, x)
    for m in attn:
        m.num_heads = 1  # torch: one head of dim D (the fused path had two of D / 2)
    with pytest.warns(UserWarning, match="num_heads"):
        got = run(fused, x)
    want = run(ref, x)
    torch.testing.assert_close(got, want, **TOL)
    grads = [torch.autograd.grad(y.square().sum(), [x, *m.parameters()]) for y, m in ((got, fused), (want, ref))]
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, **TOL)
    for m in attn:
        m.num_heads = H
    before = launches["matmul"]
    with _no_fallback():
        torch.testing.assert_close(run(fused, x), run(ref, x), **TOL)
    assert launches["matmul"] > before


def test_num_heads_set_after_construction_gqa_raises(device):
    """A grouped-query attention's heads set after construction: a ValueError naming them
    (torch's attention cannot compute GQA, so there is no torch forward to run)."""
    mha = fused_block.MultiheadAttention(D, 4, num_kv_heads=2, batch_first=True, device=device)
    mha.num_heads = 2
    x = torch.randn(B, L, D, device=device)
    with pytest.raises(ValueError, match="num_heads/head_dim"):
        mha(x, x, x, need_weights=False)


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_spectral_norm_out_proj_evaluated_once_per_call_as_torch(decoder, device, launches):
    """spectral_norm on the attention's out_proj in training: each evaluation of the weight runs
    a power iteration that updates its state (``_u``, ``_v``); torch's attention evaluates it once
    per call, so must the fused path (the input checks and the guard read the original's dtype,
    device and class instead). Used to be two or three evaluations per call: ``_u`` and the
    outputs drifted from torch's."""
    ref, fused = _pair(device, decoder=decoder)
    for layer in (ref, fused):
        torch.manual_seed(0)  # the same random start vector u in both
        nn.utils.parametrizations.spectral_norm(layer.self_attn.out_proj)
    x = torch.randn(B, L, D, device=device)
    mem = torch.randn(B, L + 1, D, device=device) if decoder else None
    state = lambda m: m.self_attn.out_proj.parametrizations.weight[0]  # noqa: E731
    for _ in range(2):
        with _no_fallback():
            got = _run(fused, x, mem)
        torch.testing.assert_close(got, _run(ref, x, mem), **TOL)
        torch.testing.assert_close(state(fused)._u, state(ref)._u, **TOL)
    assert launches["matmul"] > 0


def test_num_heads_set_before_convert(device):
    """``num_heads`` set on torch's attention before ``convert`` (its ``head_dim`` attribute then
    stale; torch's forward ignores it): torch's answer. Used to crash splitting the projections."""
    ref = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, device=device)
    ref.self_attn.num_heads = 1
    fused = fused_block.convert(copy.deepcopy(ref))
    x = torch.randn(B, L, D, device=device)
    with pytest.warns(UserWarning, match="num_heads"):
        got = fused(x)
    torch.testing.assert_close(got, ref(x), **TOL)
