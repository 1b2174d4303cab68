"""Converted models pickle whole: ``torch.save(model)`` and ``torch.load(f, weights_only=False)``
(and multiprocessing's spawn, which pickles modules too).

Each Hugging Face family of ``fused_block.hf.FAMILIES`` (one tiny model of tests/hf_testing.py
per family module, one layer where a layer is the slow part in the interpreter) and torch's
layers converted by ``fused_block.convert``: the model is run before it is saved (its caches of
packed weights and the guard's marks exist), then the loaded model runs the fused path (the
launch counters), gives the converted model's loss, gradients and logits exactly and the
unconverted model's logits within the rule of tests/test_hf.py, and owns its state (its
parameters are others; a write to them leaves the original alone). A fresh process that
imports fused_block loads the file too (module-level lookups by name: the families, the
forwards). The caches do not travel: a loaded layer starts with none.
"""
import copy
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import fused_block  # noqa: E402
from fused_block import hf  # noqa: E402
from fused_block.hf import _core  # noqa: E402

import hf_testing  # noqa: E402
from hf_testing import no_fallback  # noqa: E402

# One model per family module (llama: LLaMA's code stands for Mistral's and Qwen2's; qwen3 adds
# the q/k norms; the encoder-decoders' three) and its layers' count: one each (the interpreter's
# time is the layers'; what is pickled is per layer).
HF_CASES = {"llama": 1, "qwen3": 1, "phi3": 1, "gemma3": 1, "gpt_oss": 1, "gpt2": 1, "bloom": 1, "bert": 1,
            "bart": 1, "whisper": 1, "t5": 1}
SEQ2SEQ = ("bart", "whisper", "t5")


def _make(name, device, layers):
    if name in SEQ2SEQ:
        return hf_testing.seq2seq_model(name, device, "sdpa", layers=layers)
    return hf_testing.model(name, device, layers=layers)


def _call(name, device):
    """The model's inputs (keyword arguments) and its training labels."""
    if name in SEQ2SEQ:
        enc, targets = hf_testing.seq2seq_inputs(name, device)
        return enc, targets
    ids, mask = hf_testing.inputs(name, device)
    return dict(input_ids=ids, attention_mask=mask), ids.masked_fill(mask == 0, -100)


def _round_trip(model, tmp_path):
    path = tmp_path / "model.pt"
    torch.save(model, path)
    return torch.load(path, weights_only=False)


def _same(actual, expected, device, msg=None):
    """The same bits in the interpreter (the same kernels on the same weights); on a GPU within
    fp32 rounding (another process may time and pick another config of a kernel)."""
    tol = dict(atol=0, rtol=0) if device.type == "cpu" else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual, expected, msg=msg, **tol)


def _converted_layers(model):
    return [m for m in model.modules() if type(m).__name__ in hf.FAMILIES and "_fused_block" in m.__dict__]


def _check_bound(model):
    """Every converted module's forward is bound to that module (not to the one it was loaded from)."""
    patched = [m for m in model.modules() if "_fused_block" in m.__dict__]
    assert patched
    for m in patched:
        for name in ("forward", "_replicate_for_data_parallel"):
            assert m.__dict__[name].__self__ is m and m.__dict__[name].args == (m,), (type(m).__name__, name)
    return patched


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hugging_face_model_round_trips_through_torch_save(name, device, launches, tmp_path):
    model = _make(name, device, HF_CASES[name]).train()
    with no_fallback():
        fused = fused_block.convert(copy.deepcopy(model))
    kwargs, labels = _call(name, device)
    with torch.no_grad(), no_fallback():
        fused(**kwargs, labels=labels)  # the packed-weight caches and the guard's verdicts and marks exist now
    assert any(len(m._fused_block.packed) for m in _converted_layers(fused)) or name in ("gpt2", "bert", "bloom")

    loaded = _round_trip(fused, tmp_path)
    assert type(loaded) is type(fused) and list(loaded.state_dict()) == list(fused.state_dict())
    _check_bound(loaded)
    layers = _converted_layers(loaded)
    assert len(layers) == len(_converted_layers(fused))
    for layer in layers:
        state = layer._fused_block
        assert state.family is hf.FAMILIES[type(layer).__name__]  # the table's object, not a copy
        assert len(state.packed) == 0  # no stale cache: made again from the loaded weights
        if state.rotary is not None:  # the loaded model's rotary module, at the loaded owner
            assert state.rotary.current() is loaded.get_submodule(
                next(p for p, m in loaded.named_modules() if type(m).__name__ in state.family.rotaries))

    # training: the loss and every gradient are the converted model's, through the same kernels
    outs, ran = {}, {}
    for label, m in (("fused", fused), ("loaded", loaded)):
        before = {k: launches[k] for k in ("attention_fwd", "attention_bwd", "matmul")}
        with no_fallback():
            loss = m(**kwargs, labels=labels).loss
        loss.backward()
        outs[label] = loss, {k: p.grad for k, p in m.named_parameters()}
        ran[label] = {k: launches[k] - n for k, n in before.items()}
    assert ran["loaded"] == ran["fused"] and min(ran["loaded"].values()) >= len(layers), ran
    _same(outs["loaded"][0], outs["fused"][0], device)
    assert sum(g is not None for g in outs["loaded"][1].values()) >= len(outs["loaded"][1]) - 1  # but a padding row
    for k, g in outs["fused"][1].items():
        assert (g is None) == (outs["loaded"][1][k] is None), k
        if g is not None:
            _same(outs["loaded"][1][k], g, device, msg=k)

    # evaluation: the converted model's logits, and the unconverted model's within the rule
    ref = copy.deepcopy(model).double().eval()
    logits = {}
    for label, m in (("ref", ref), ("base", model), ("fused", fused), ("loaded", loaded)):
        m.eval()
        call = {k: v.double() if label == "ref" and v.is_floating_point() else v for k, v in kwargs.items()}
        with torch.no_grad(), no_fallback():
            logits[label] = m(**call, labels=labels).logits
    _same(logits["loaded"], logits["fused"], device)
    mask = kwargs.get("attention_mask")
    if name not in SEQ2SEQ:  # padded positions (the decoder's targets are never padded)
        logits = {k: v.masked_fill(mask[..., None] == 0, 0.0) for k, v in logits.items()}
    hf_testing.assert_close("logits", logits["loaded"], logits["ref"], logits["base"], torch.float32, device)

    # the loaded model's state is its own
    params = dict(fused.named_parameters())
    for k, p in loaded.named_parameters():
        assert p.untyped_storage().data_ptr() != params[k].untyped_storage().data_ptr(), k
    want = dict((k, p.detach().clone()) for k, p in params.items())
    with torch.no_grad():
        for p in loaded.parameters():
            p.add_(1.0)
    assert all(torch.equal(p, want[k]) for k, p in fused.named_parameters())


def _nn_model(kind):
    # d_model 64 with 4 heads: head dim 16, the attention kernel's smallest; 2 encoder layers and
    # the final norm (the residual stream crosses a layer); a Pre-LN decoder layer
    if kind == "encoder":
        layer = nn.TransformerEncoderLayer(64, 4, 96, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(64), enable_nested_tensor=False)
    return nn.TransformerDecoderLayer(64, 4, 96, dropout=0.0, batch_first=True, norm_first=True)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_torch_layers_round_trip_through_torch_save(kind, device, launches, tmp_path):
    """torch's layers converted (fused_block.TransformerEncoderLayer, TransformerDecoderLayer,
    the encoder's final norm as fused_block.LayerNorm), run once before the save (the guard's
    marks and hook dicts): the loaded model runs the kernels, gives the same output and
    gradients, and owns its parameters."""
    torch.manual_seed(0)
    model = _nn_model(kind).to(device)
    fused = fused_block.convert(copy.deepcopy(model))
    x = torch.randn(2, 9, 64, device=device)  # 9 tokens: no block multiple
    args = (x,) if kind == "encoder" else (x, torch.randn(2, 7, 64, device=device))
    with torch.no_grad():
        fused(*args)
    loaded = _round_trip(fused, tmp_path)
    before = launches["attention_fwd"]
    outs = []
    for m in (fused, loaded):
        y = m(*args)
        y.square().sum().backward()
        outs.append((y, [p.grad for p in m.parameters()]))
    assert launches["attention_fwd"] - before == 2 * (2 if kind == "encoder" else 2)
    assert launches["attention_bwd"] > 0
    _same(outs[1][0], outs[0][0], device)
    for g1, g0 in zip(outs[1][1], outs[0][1]):
        _same(g1, g0, device)
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(*(a.double() for a in args))
        base = model(*args)
    hf_testing.assert_close("output", outs[1][0], ref, base, torch.float32, device)
    with torch.no_grad():
        for p in loaded.parameters():
            p.add_(1.0)
    _same(fused(*args), outs[0][0], device)


_FRESH = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
import torch
if not torch.cuda.is_available():
    import interpreter_hardware, interpreter_numpy, interpreter_speed
    interpreter_speed.install(); interpreter_numpy.install(); interpreter_hardware.install()
import fused_block
from fused_block.hf import FAMILIES, _core
from fused_block.kernels import common
model = torch.load(sys.argv[1], weights_only=False).eval()
ids, mask = torch.load(sys.argv[2], weights_only=False)
before = common.LAUNCHES.copy()
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
layers = [m for m in model.modules() if "_fused_block" in m.__dict__ and type(m).__name__ in FAMILIES]
torch.save(logits, sys.argv[2])
print(json.dumps(dict(
    attention=common.LAUNCHES["attention_fwd"] - before["attention_fwd"], layers=len(layers),
    families=all(m._fused_block.family is FAMILIES[type(m).__name__] for m in layers),
    forwards=all(m.forward.func is _core._fused_forward and m.forward.args[0] is m for m in layers),
    rotary=all(m._fused_block.rotary.current() is model.model.rotary_emb for m in layers))))
"""


def test_a_fresh_process_loads_a_converted_model(device, tmp_path):
    """A process that imports fused_block (and nothing of the test's) loads the file: the
    families and forwards are found by name there, and its logits are this process's."""
    model = hf_testing.model("llama", device, layers=1).eval()
    fused = fused_block.convert(model)
    ids, mask = hf_testing.inputs("llama", device)
    with torch.no_grad():
        want = fused(input_ids=ids, attention_mask=mask).logits
    torch.save(fused, tmp_path / "model.pt")
    torch.save((ids, mask), tmp_path / "io.pt")
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / "model.pt"), str(tmp_path / "io.pt"), tests],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == dict(attention=1, layers=1, families=True, forwards=True, rotary=True)
    _same(torch.load(tmp_path / "io.pt", weights_only=False), want, device)


def test_a_layer_pickled_alone_leaves_the_model_behind(device, launches, tmp_path):
    """A LLaMA layer saved alone does not carry its model (the rotary module's owner is held
    weakly): loaded, it reads the position_embeddings it is given, as the original layer."""
    model = fused_block.convert(hf_testing.model("llama", device, layers=1).eval())
    layer = model.model.layers[0]
    torch.save(model, tmp_path / "whole.pt")
    loaded = _round_trip(layer, tmp_path)
    embeddings = model.model.embed_tokens.weight.numel() * 4
    assert (tmp_path / "model.pt").stat().st_size < (tmp_path / "whole.pt").stat().st_size - embeddings
    assert loaded._fused_block.rotary.current() is None
    _check_bound(loaded)
    x = torch.randn(1, 5, 64, device=device)
    positions = torch.arange(5, device=device)[None]
    pe = model.model.rotary_emb(x, positions)
    before = launches["attention_fwd"]
    with torch.no_grad():  # the same tables for the original (with position_ids it reads inv_freq)
        got = loaded(x, position_embeddings=pe, position_ids=positions)
        want = layer(x, position_embeddings=pe)
    assert launches["attention_fwd"] - before == 2
    got, want = (t[0] if isinstance(t, tuple) else t for t in (got, want))
    _same(got, want, device)


def test_a_family_outside_the_table_says_why_it_does_not_pickle():
    family = _core.Family(None, None, None, None)
    with pytest.raises(pickle.PicklingError, match="not in fused_block.hf.FAMILIES"):
        pickle.dumps(family)
    assert pickle.loads(pickle.dumps(hf.FAMILIES["GPT2Block"])) is hf.FAMILIES["GPT2Block"]


def test_a_tensor_parallel_plan_says_why_it_does_not_pickle():
    """A LayerParallel layer's plan (which its hooks hold) names what cannot be pickled; copies
    of it are made as before."""
    from fused_block import distributed

    with pytest.raises(pickle.PicklingError, match="tensor-parallel layer"):
        pickle.dumps(distributed._Plan.__new__(distributed._Plan))
    plan = distributed._Plan.__new__(distributed._Plan)
    plan.params = [torch.zeros(2)]
    assert copy.copy(plan).params is plan.params and copy.deepcopy(plan).params[0] is not plan.params[0]
