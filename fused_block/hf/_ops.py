"""The fused ops as the converted layers call them: each dropout probability in [0, 1].

Hugging Face's layers run torch's dropouts, which take p = 1 (the input times 0: zero outputs,
zero gradients upstream); the fused ops' dropouts stop below 1 (``dropout_p must be in [0,
1)``). Here a dropout at p = 1 runs as torch's ``F.dropout(t, 1.0)`` on the tensor it drops,
with the fused op at p = 0, as the drop-in layers do (``fused_block.blocks._LayerMixin``); any
other probability goes to the fused op unchanged. The families import the ops from here.
"""
import torch.nn.functional as F

from fused_block import norm as _norm
from fused_block.linear import GATED as _GATED
from fused_block.linear import gated_linear as _gated_linear
from fused_block.linear import geglu as _geglu
from fused_block.linear import linear as _linear
from fused_block.linear import mlp as _mlp
from fused_block.linear import swiglu as _swiglu


def _dropped(t):
    """torch's dropout at p = 1: ``t`` times 0 (zero gradients for whatever made ``t``)."""
    return F.dropout(t, 1.0, training=True)


def _plus(y, residual):
    return y if residual is None else y + residual  # (the fused ops' promotion: x's dtype with residual's)


def linear(x, weight, bias=None, activation=None, residual=None, dropout_p=0.0, *, lora=None):
    if dropout_p >= 1.0:
        return _plus(_dropped(_linear(x, weight, bias, activation, lora=lora)), residual)
    return _linear(x, weight, bias, activation, residual, dropout_p, lora=lora)


def gated_linear(x, w_gate, w_up, b_gate=None, b_up=None, *, dropout_p=0.0, lora=None, activation="swiglu"):
    if dropout_p >= 1.0:
        return _dropped(_gated_linear(x, w_gate, w_up, b_gate, b_up, lora=lora, activation=activation))
    return _gated_linear(x, w_gate, w_up, b_gate, b_up, dropout_p=dropout_p, lora=lora, activation=activation)


def mlp(x, w1, b1, w2, b2, activation="gelu", residual=None, dropout_p=0.0, output_dropout_p=0.0):
    if output_dropout_p >= 1.0:
        return _plus(_dropped(mlp(x, w1, b1, w2, b2, activation, None, dropout_p)), residual)
    if dropout_p >= 1.0:  # the hidden activation dropped: the two GEMMs apart, torch's dropout between
        if activation in _GATED:
            f = w1.shape[0] // 2  # the gate rows, then the up rows
            hid = gated_linear(x, w1[:f], w1[f:], None if b1 is None else b1[:f], None if b1 is None else b1[f:],
                               dropout_p=1.0, activation=activation)
        else:
            hid = linear(x, w1, b1, activation, None, 1.0)
        return linear(hid, w2, b2, None, residual, output_dropout_p)
    return _mlp(x, w1, b1, w2, b2, activation, residual, dropout_p, output_dropout_p)


def _gated_ffn(fused, name):

    def ffn(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None, dropout_p=0.0,
            output_dropout_p=0.0):
        if output_dropout_p >= 1.0:
            y = ffn(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, dropout_p=dropout_p)
            return _plus(_dropped(y), residual)
        if dropout_p >= 1.0:
            hid = gated_linear(x, w_gate, w_up, b_gate, b_up, dropout_p=1.0, activation=name)
            return linear(hid, w_down, b_down, None, residual, output_dropout_p)
        return fused(x, w_gate, w_up, w_down, residual, b_gate=b_gate, b_up=b_up, b_down=b_down,
                     dropout_p=dropout_p, output_dropout_p=output_dropout_p)

    ffn.__name__ = ffn.__qualname__ = name
    ffn.__doc__ = fused.__doc__
    return ffn


swiglu, geglu = _gated_ffn(_swiglu, "swiglu"), _gated_ffn(_geglu, "geglu")


def add_layer_norm(x, residual=None, weight=None, bias=None, eps=1e-5, dropout_p=0.0, **kwargs):
    if dropout_p >= 1.0:
        x, dropout_p = _dropped(x), 0.0
    return _norm.add_layer_norm(x, residual, weight, bias, eps, dropout_p, **kwargs)


def add_layer_norm_as_torch(x, residual, weight, bias, eps, dropout_p=0.0):
    if dropout_p >= 1.0:
        x, dropout_p = _dropped(x), 0.0
    return _norm.add_layer_norm_as_torch(x, residual, weight, bias, eps, dropout_p)


def add_rms_norm(x, residual=None, weight=None, eps=None, dropout_p=0.0, **kwargs):
    if dropout_p >= 1.0:
        x, dropout_p = _dropped(x), 0.0
    return _norm.add_rms_norm(x, residual, weight, eps, dropout_p, **kwargs)
