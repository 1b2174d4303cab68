"""torch's own module catalogue (``torch.testing._internal.common_modules.module_db``) run
through the library: every sample torch tests its Linear, LayerNorm, RMSNorm,
MultiheadAttention, TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder and
Transformer with (constructor options, unbatched and batched inputs, masks, batch_first,
norm_first, bias, train and eval) gives the same output and gradients from the library's
module (its class, or ``fused_block.convert`` of torch's module) as from torch's, on the
same weights and inputs.

The attention modules' samples have head dims of 1 and 2, below the kernel's 16: their embed
dims are scaled to ``num_heads * 16`` (inputs of that width drawn afresh, masks kept), so the
kernels run. fp32, compared with torch's fp32 on the CPU (the same math up to summation
order). Eval samples also run under ``no_grad``, where torch takes its fast paths (the
encoder's nested tensors among them).

The catalogue holds ~570 samples (about 25 minutes through the interpreter): CI runs a subset
that meets every module class, mode and option value at least once (``_cover``); the rest is
marked ``heavy`` and runs with ``FUSED_BLOCK_HEAVY=1`` (or ``-m heavy``), see tests/conftest.py.
"""
import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import fused_block

common_modules = pytest.importorskip("torch.testing._internal.common_modules")

HEAD_DIM = 16
OURS = {"Linear": fused_block.Linear, "LayerNorm": fused_block.LayerNorm, "RMSNorm": fused_block.RMSNorm,
        "MultiheadAttention": fused_block.MultiheadAttention}
CONVERTED = ("TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "Transformer")
ATTENTION = ("MultiheadAttention",) + CONVERTED
TOL = dict(atol=1e-4, rtol=1e-4)


@functools.lru_cache(maxsize=None)
def _samples(name, training):
    info = next(i for i in common_modules.module_db if i.module_cls.__name__ == name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                       training=training)


def _features(name, training, sample):
    """What a sample exercises, for the CI subset: constructor options, input ranks, which masks."""
    c, f = sample.constructor_input, sample.forward_input
    feats = {("training", training)}
    for i, a in enumerate(c.args):
        feats.add(("ctor", i, repr(a) if not isinstance(a, nn.Module) else type(a).__name__))
    feats.update(("ctor", k, repr(v)) for k, v in c.kwargs.items())
    feats.update(("rank", i, a.dim()) for i, a in enumerate(f.args) if isinstance(a, torch.Tensor))
    feats.update(("kw", k, v is None) for k, v in f.kwargs.items())
    return {(name,) + x for x in feats}


def _cases():
    """(name, training, index) of every sample, the subset first: a sample is in it when it
    brings a feature value no earlier sample of its class brought."""
    cases, seen = [], set()
    for name in ("Linear", "LayerNorm", "RMSNorm") + ATTENTION:
        for training in (True, False):
            for i, sample in enumerate(_samples(name, training)):
                feats = _features(name, training, sample)
                marks = () if not feats <= seen else (pytest.mark.heavy,)
                seen |= feats
                cases.append(pytest.param(name, training, i, marks=marks,
                                          id=f"{name}-{'train' if training else 'eval'}-{i}"))
    return cases


def _scaled(name, sample):
    """Constructor args/kwargs and forward args/kwargs, attention embed dims scaled to heads x 16."""
    c, f = sample.constructor_input, sample.forward_input
    args, kwargs = list(c.args), dict(c.kwargs)
    fargs, fkwargs = list(f.args), dict(f.kwargs)
    if name not in ATTENTION:
        return args, kwargs, fargs, fkwargs
    if name == "TransformerEncoder":  # (layer, num_layers): rebuild the layer at the new width
        layer, E = args[0], args[0].self_attn.embed_dim
        heads = layer.self_attn.num_heads
        args[0] = nn.TransformerEncoderLayer(heads * HEAD_DIM, heads, layer.linear1.out_features, layer.dropout.p,
                                             layer.activation, layer.norm1.eps, layer.self_attn.batch_first,
                                             layer.norm_first, layer.linear1.bias is not None)
    else:
        e_key, h_key = ("embed_dim", "num_heads") if name == "MultiheadAttention" else ("d_model", "nhead")
        if e_key in kwargs:
            E, heads = kwargs[e_key], kwargs[h_key]
            kwargs[e_key] = heads * HEAD_DIM
        else:
            E, heads = args[0], args[1]
            args[0] = heads * HEAD_DIM
    fargs = [torch.randn(*a.shape[:-1], heads * HEAD_DIM, requires_grad=a.requires_grad)
             if isinstance(a, torch.Tensor) and a.shape[-1] == E else a for a in fargs]
    return args, kwargs, fargs, fkwargs


def _modules(name, args, kwargs):
    torch.manual_seed(0)
    theirs = getattr(nn, name)(*copy.deepcopy(args), **kwargs)
    if name in CONVERTED:
        ours = fused_block.convert(copy.deepcopy(theirs))
    else:
        ours = OURS[name](*args, **kwargs)
        ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _leaves(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _compare(theirs, ours, fargs, fkwargs):
    """Outputs, then the gradients of every input and parameter, of torch's and our module."""
    t_args, o_args = _leaves(fargs), _leaves(fargs)
    want, got = theirs(*t_args, **fkwargs), ours(*o_args, **fkwargs)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, **TOL)
    if not torch.is_grad_enabled() or not _first(want).requires_grad:
        return
    g = torch.randn_like(_first(want))
    t_in = [a for a in t_args if isinstance(a, torch.Tensor) and a.requires_grad] + list(theirs.parameters())
    o_in = [a for a in o_args if isinstance(a, torch.Tensor) and a.requires_grad] + list(ours.parameters())
    for a, b in zip(torch.autograd.grad(_first(want), t_in, g, allow_unused=True),
                    torch.autograd.grad(_first(got), o_in, g, allow_unused=True)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, **TOL)


def _kernel_launches(launches):
    return launches["matmul"] + launches["add_norm_fwd"] + launches["attention_fwd"]


@pytest.mark.parametrize("name,training,index", _cases())
def test_torch_module_catalogue(name, training, index, launches):
    args, kwargs, fargs, fkwargs = _scaled(name, _samples(name, training)[index])
    theirs, ours = _modules(name, args, kwargs)
    theirs.train(training)
    ours.train(training)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fused_block: .*scaled_dot_product_attention")  # general masks
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
        _compare(theirs, ours, fargs, fkwargs)
        if name == "MultiheadAttention":  # the sample's default need_weights=True is torch's path
            _compare(theirs, ours, fargs, dict(fkwargs, need_weights=False))
        if not training:  # torch's inference fast paths
            with torch.no_grad():
                _compare(theirs, ours, fargs, fkwargs)
    if all(a.numel() for a in fargs if isinstance(a, torch.Tensor)):  # empty inputs launch nothing
        assert _kernel_launches(launches) > 0
