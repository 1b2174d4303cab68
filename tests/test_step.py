"""A converted encoder layer's training step as one autograd Function (``fused_block._step``).

The step runs the ops the layer runs one by one (the same kernels and products, launched with
the same arguments, in the same order), so each case compares the two paths to the bit on the
same weights, inputs, output gradient and dropout seeds: the output, the input's gradient and
every parameter's gradient, the kernels launched, and the step's own use (it must have run,
or, in the cases it does not take, not). The layers' accuracy against the float64 reference
is ``tests/test_blocks.py``'s, which now runs through the step.
"""
import collections
import contextlib

import pytest
import torch
from torch import nn

import fused_block
from fused_block import _attn_sdpa, _backend, _step, dispatch, norm
from fused_block.kernels import common

E, H, FF, B, L = 32, 2, 64, 2, 9
ON_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def our_kernels(monkeypatch):
    """The step runs where the ops' choices are our norm and packed attention kernels: on a GPU
    a bucket's timing might pick torch's norm or SDPA at these tiny sizes, so they are forced,
    and the step is taken on every device (the choices themselves: tests/test_norm.py,
    tests/test_attention_sdpa.py; a choice of torch's path: the last test here)."""
    monkeypatch.setattr(_attn_sdpa, "_FORCED", _attn_sdpa.TRITON)
    monkeypatch.setattr(norm, "_FORCED", norm.TRITON)


def _layer(norm_first, dropout, dtype, device, **kw):
    kw = {"activation": "gelu", "batch_first": True, **kw}
    return fused_block.TransformerEncoderLayer(E, H, FF, dropout=dropout, norm_first=norm_first, dtype=dtype,
                                               device=device, **kw)


def _steps(monkeypatch):
    """A counter of the calls that took the step."""
    calls = collections.Counter()
    run = _step.run

    def counted(*args):
        calls["step"] += 1
        return run(*args)

    monkeypatch.setattr(_step, "run", counted)
    return calls


def _one(layer, x, dy, kwargs, seed, enabled, monkeypatch):
    """Output, every gradient (x's, then the parameters' by name) and the launches of one step."""
    monkeypatch.setattr(_step, "ENABLED", enabled)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    layer.zero_grad(set_to_none=True)
    before = common.LAUNCHES.copy()
    torch.manual_seed(seed)
    out = layer(x, **kwargs)
    out.backward(dy)
    launched = common.LAUNCHES - before
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return out, grads, launched


def _assert_same(layer, x, kwargs, monkeypatch, taken=True):
    calls = _steps(monkeypatch)
    dy = torch.randn(x.shape, dtype=x.dtype, device=x.device)
    seed = int(torch.randint(0, 2**31, ()).item())
    ops = _one(layer, x, dy, kwargs, seed, False, monkeypatch)
    assert calls["step"] == 0
    step = _one(layer, x, dy, kwargs, seed, True, monkeypatch)
    assert calls["step"] == (1 if taken else 0)
    assert sum(step[2].values()) > 0, "no Triton kernel ran"
    assert step[2] == ops[2], f"launches differ: step {dict(step[2])}, ops {dict(ops[2])}"
    assert torch.equal(step[0], ops[0]), "outputs differ"
    assert step[1].keys() == ops[1].keys()
    for name in ops[1]:
        a, b = step[1][name], ops[1][name]
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), f"{name}: max difference {(a.float() - b.float()).abs().max().item()}"
    return step


def _x(dtype, device, batch_first=True, grad=True):
    shape = (B, L, E) if batch_first else (L, B, E)
    return torch.randn(shape, dtype=dtype, device=device, requires_grad=grad)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_step_equals_the_ops_one_by_one(norm_first, dropout, device, monkeypatch):
    layer = _layer(norm_first, dropout, torch.bfloat16, device)
    _assert_same(layer, _x(torch.bfloat16, device), {}, monkeypatch)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_step_in_other_dtypes(norm_first, dtype, device, monkeypatch):
    _assert_same(_layer(norm_first, 0.1, dtype, device), _x(dtype, device), {}, monkeypatch)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("mask", ["is_causal", "causal_mask", "padding", "float_padding"])
def test_step_with_causal_and_padding_masks(norm_first, mask, device, monkeypatch):
    layer = _layer(norm_first, 0.0, torch.bfloat16, device)
    pad = torch.zeros(B, L, dtype=torch.bool, device=device)
    pad[0, L - 3:] = True
    kwargs = {"is_causal": {"is_causal": True,
                            "src_mask": nn.Transformer.generate_square_subsequent_mask(L, device=device)},
              "causal_mask": {"src_mask": nn.Transformer.generate_square_subsequent_mask(L, device=device)},
              "padding": {"src_key_padding_mask": pad},
              "float_padding": {"src_key_padding_mask": torch.zeros(B, L, device=device).masked_fill(pad, -torch.inf)},
              }[mask]
    _assert_same(layer, _x(torch.bfloat16, device), kwargs, monkeypatch)


@pytest.mark.parametrize("norm_first", [True, False])
def test_step_of_a_llama_layer(norm_first, device, monkeypatch):
    """RMSNorm without biases, SwiGLU's [gate; up] linear1, grouped-query attention."""
    layer = _layer(norm_first, 0.1, torch.bfloat16, device, norm="rms", activation="swiglu", bias=False,
                   num_kv_heads=1)
    _assert_same(layer, _x(torch.bfloat16, device), {}, monkeypatch)


@pytest.mark.parametrize("norm_first", [True, False])
def test_step_with_sequence_first_and_unbatched_inputs(norm_first, device, monkeypatch):
    layer = _layer(norm_first, 0.1, torch.bfloat16, device, batch_first=False, activation="relu")
    _assert_same(layer, _x(torch.bfloat16, device, batch_first=False), {}, monkeypatch)
    _assert_same(layer, torch.randn(L, E, dtype=torch.bfloat16, device=device, requires_grad=True), {}, monkeypatch)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("frozen", ["x", "attention", "all_but_ffn", "all_but_norm2", "all_but_norm1"])
def test_step_computes_only_the_gradients_asked(norm_first, frozen, device, monkeypatch):
    """Frozen parameters and an input without a gradient: the same gradients (None where the
    op-by-op path gives None), kernels and products as the ops one by one."""
    layer = _layer(norm_first, 0.1, torch.bfloat16, device)
    keep = {"x": None, "attention": ("norm", "linear"), "all_but_ffn": ("linear",), "all_but_norm2": ("norm2",),
            "all_but_norm1": ("norm1",)}[frozen]
    if keep is not None:
        for name, p in layer.named_parameters():
            p.requires_grad_(name.startswith(keep))
    x = _x(torch.bfloat16, device, grad=frozen == "attention")
    _assert_same(layer, x, {}, monkeypatch)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_step_with_projections_on_torch(norm_first, dropout, device, monkeypatch):
    """Where the projections' products are chosen for cuBLAS, both paths run them as torch's
    ``F.linear`` (its autograd on the op-by-op path, the same products in the step)."""
    monkeypatch.setattr(dispatch, "projection_on_torch", lambda *args: True)
    layer = _layer(norm_first, dropout, torch.bfloat16, device)
    _assert_same(layer, _x(torch.bfloat16, device), {}, monkeypatch)


@pytest.mark.parametrize("mask", ["general", "causal", "none"])
def test_masks_are_resolved_once_a_call(mask, device, monkeypatch):
    """The step's check resolves the masks only once its other conditions hold, and the ops one
    by one reuse them when it does not take the call: a general mask is merged once, not twice."""
    from fused_block import blocks

    layer = _layer(True, 0.0, torch.bfloat16, device)
    resolved = []
    resolve = blocks._resolve_masks
    monkeypatch.setattr(blocks, "_resolve_masks", lambda *a: resolved.append(a) or resolve(*a))
    calls = _steps(monkeypatch)
    kwargs = {"general": {"src_mask": torch.randn(L, L, device=device)},
              "causal": {"src_mask": nn.Transformer.generate_square_subsequent_mask(L, device=device)},
              "none": {}}[mask]
    layer(_x(torch.bfloat16, device), **kwargs).sum().backward()
    assert len(resolved) == 1 and calls["step"] == (0 if mask == "general" else 1)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_step_under_activation_checkpointing(norm_first, reentrant, device, monkeypatch):
    """``torch.utils.checkpoint`` of the layer: the recomputation takes the step again (the same
    seeds, saved tensors through the saved-tensor hooks), the same gradients as the ops'."""
    from torch.utils.checkpoint import checkpoint

    layer = _layer(norm_first, 0.1, torch.bfloat16, device)
    x = _x(torch.bfloat16, device)
    calls = _steps(monkeypatch)
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(_step, "ENABLED", enabled)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(5)
        y = checkpoint(layer, x, use_reentrant=reentrant)
        y.float().pow(2).sum().backward()
        results.append([y, x.grad, *(p.grad for p in layer.parameters())])
    assert calls["step"] == 2  # the forward and its recomputation
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_step_without_gradients_is_the_ops_forwards(norm_first, mode, device, monkeypatch):
    """With nothing to differentiate the step is its forward alone, as the ops then run
    without their Functions: the same output and kernels, and nothing kept for a backward."""
    layer = _layer(norm_first, 0.1, torch.bfloat16, device)
    x = _x(torch.bfloat16, device, grad=False)
    if mode == "nothing_requires_grad":
        layer.requires_grad_(False)
    calls = _steps(monkeypatch)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, contextlib.nullcontext)
    outs, launched = [], []
    for enabled in (False, True):
        monkeypatch.setattr(_step, "ENABLED", enabled)
        before = common.LAUNCHES.copy()
        torch.manual_seed(7)
        with ctx():
            outs.append(layer(x))
        launched.append(common.LAUNCHES - before)
    assert calls["step"] == 1
    assert sum(launched[1].values()) > 0 and launched[0] == launched[1]
    assert torch.equal(outs[0], outs[1]) and not outs[1].requires_grad and outs[1].grad_fn is None


@pytest.mark.parametrize("case", ["general_mask", "rope", "callable_activation", "dropout_one", "float64",
                                  "autocast", "norm_on_torch", "attention_on_sdpa"])
def test_calls_the_step_does_not_take_run_the_ops(case, device, monkeypatch):
    """Outside the step's configuration, and where an op's choice is torch's path (a norm's
    verdict for eager's add + LayerNorm, the attention's for an SDPA backend), the ops run one
    by one (the same answer either way)."""
    if case == "norm_on_torch":
        monkeypatch.setattr(norm, "_FORCED", norm.TORCH)
    if case == "attention_on_sdpa":
        monkeypatch.setattr(_attn_sdpa, "_FORCED", _attn_sdpa.CUDNN)
        if not ON_CUDA:  # SDPA's math backend stands in for cuDNN on the CPU
            monkeypatch.setattr(_attn_sdpa, "backend_of", lambda c: nn.attention.SDPBackend.MATH)
    kw = {"rope": {"rope": True}, "callable_activation": {"activation": lambda t: t * torch.sigmoid(t)}}.get(case, {})
    dropout = 1.0 if case == "dropout_one" else 0.0
    dtype = torch.float64 if case == "float64" else torch.bfloat16
    layer = _layer(True, dropout, dtype, device, **kw)
    x = _x(dtype, device)
    kwargs = {}
    if case == "general_mask":
        kwargs = {"src_mask": torch.randn(L, L, device=device)}
    calls = _steps(monkeypatch)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext()
    with ctx:
        out = layer(x, **kwargs)
    if out.requires_grad:
        out.sum().backward()
    assert calls["step"] == 0
    if case == "float64":
        return
    monkeypatch.setattr(_step, "ENABLED", False)
    with ctx:
        ref = layer(x, **kwargs)
    if case != "dropout_one":
        assert torch.equal(out, ref)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_step_peak_memory_is_the_ops(norm_first, dropout, device, monkeypatch):
    """Peak memory of a training step, the step against the ops one by one, at a training
    step's proportions (tokens 8x the width, the FFN 4x: activations outweigh the weights;
    kernels skipped, ``_backend.host_only``: every allocation happens, nothing computes): the
    same. Each block's saved tensors are freed once its backward ran, the FFN's before the
    attention's (Post-LN: the second norm's before the FFN's), as the ops' are (every
    allocation recorded, ``tests/memory_testing.py``)."""
    from memory_testing import Allocations

    E_, H_, FF_, B_, L_ = 64, 2, 256, 4, 128
    layer = fused_block.TransformerEncoderLayer(E_, H_, FF_, dropout=dropout, norm_first=norm_first, batch_first=True,
                                                activation="gelu", dtype=torch.bfloat16, device=device)
    x = torch.randn(B_, L_, E_, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(x.shape, dtype=x.dtype, device=device)
    calls = _steps(monkeypatch)
    peaks = []
    for enabled in (False, True):
        monkeypatch.setattr(_step, "ENABLED", enabled)
        with _backend.host_only(), Allocations() as rec:
            torch.autograd.grad(layer(x), (x, *layer.parameters()), dy)
        peaks.append(rec.peak)
    assert calls["step"] == 1
    assert peaks[1] == peaks[0], f"step's peak {peaks[1]} bytes, the ops' {peaks[0]}"
