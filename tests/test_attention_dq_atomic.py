"""The opt-in backward with dQ reduce-added in fp32 (``kernels/attention/backward_atomic.py``,
``FUSED_BLOCK_ATTN_DQ_ATOMIC=1``).

Numerics (the interpreter on the CPU, with masked ``tl.atomic_add`` in place of the
descriptor's reduce-add; the compiled kernel with TMA reduce-adds on an sm_90 GPU): dq, dk, dv
(and the LSE's and sinks' gradients, which reach it through the row statistics) against the
float64 reference with PyTorch's own error as the baseline (``numerics.assert_close``'s 2x
rule), causal and not, GQA/MQA, ragged and cross lengths. Dispatch: only with the switch,
never in deterministic mode, only on sm_90 or the interpreter, only the cases it supports;
everything else runs the atomic-free backward (launch counts).
"""
import pytest
import torch

from attention_testing import check, unsupported_features
from attention_testing import qkv as _qkv
from fused_block import reference
from fused_block.attention import attention
from fused_block.kernels import common
from fused_block.kernels.attention import backward_atomic, launchers
from numerics import randn

ON_CUDA = torch.cuda.is_available()
SM90 = ON_CUDA and torch.cuda.get_device_capability() == (9, 0)


def _runs_here():
    if ON_CUDA and not SM90:
        pytest.skip("the atomic-dQ backward runs on sm_90 and in the interpreter only")


# (B, Hq, Hkv, Lq, Lk, D), each with its reason. The interpreter's blocks are 32 queries x 64
# keys; sm_90's 32-64 x 128.
CASES = [
    # Several key and query blocks, partial last ones; GQA 2:1 (dK/dV summed over the group,
    # each head's dQ reduce-added by every key block).
    pytest.param(1, 4, 2, 70, 70, 64, id="70-gqa"),
    # Lq < Lk: bottom-right causal offset 57, not a block multiple; MQA; D 48 in the 64 class.
    pytest.param(1, 2, 1, 33, 90, 48, id="cross-33x90-mqa-d48"),
    # Lq > Lk: under causal the first 60 queries see no key (dQ = 0 there); D128.
    pytest.param(2, 2, 2, 100, 40, 128, id="cross-100x40-d128"),
]
# sm_90 only (too slow for the interpreter): many blocks, the reduce-adds of many programs
# per dQ tile, at the benchmark's head dims.
GPU_CASES = [
    pytest.param(2, 8, 2, 1000, 1000, 64, id="1000-gqa-d64"),
    pytest.param(1, 4, 4, 777, 1500, 128, id="cross-777x1500-d128"),
    pytest.param(1, 4, 1, 2048, 2048, 128, id="2048-mqa-d128"),
]


def _check_atomic(B, Hq, Hkv, Lq, Lk, D, causal, dtype, device, launches, monkeypatch, **features):
    monkeypatch.setattr(backward_atomic, "ENABLED", True)
    tensors = _qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device)
    names = ["q", "k", "v"]
    sinks = features.pop("sinks", None)
    if sinks is not None:
        tensors, names = (*tensors, sinks), names + ["sinks"]

    def run(q, k, v, *s):
        return attention(q, k, v, causal, sinks=s[0] if s else None, return_lse=True)

    def ref(q, k, v, *s, compute_dtype=None):
        return reference.attention(q, k, v, causal, sinks=s[0] if s else None, return_lse=True,
                                   compute_dtype=compute_dtype)

    check(run, ref, tensors, names, **features)
    assert launches["attention_bwd_dq_atomic"] == 1 and launches["attention_dq_convert"] == 1
    assert launches["attention_bwd"] == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D", CASES)
def test_atomic_backward_matches_reference(B, Hq, Hkv, Lq, Lk, D, causal, device, launches, monkeypatch):
    _runs_here()
    _check_atomic(B, Hq, Hkv, Lq, Lk, D, causal, torch.bfloat16, device, launches, monkeypatch)


def test_atomic_backward_fp16_lse_gradient_and_sinks(device, launches, monkeypatch):
    """fp16; the LSE's gradient (delta - dLSE) and the sinks' (the preprocess) reach the atomic
    kernel through the row statistics."""
    _runs_here()
    sinks = randn(2, dtype=torch.float32, device=device, requires_grad=True)
    _check_atomic(1, 2, 1, 50, 70, 64, True, torch.float16, device, launches, monkeypatch, sinks=sinks,
                  lse_weight=True)


def test_atomic_backward_strided_views(device, launches, monkeypatch):
    """q, k, v as (B, L, H, D) tensors seen as (B, H, L, D) (a packed projection's layout): the
    kernels read them through their strides and dq, dk, dv come back in that memory order."""
    _runs_here()
    monkeypatch.setattr(backward_atomic, "ENABLED", True)
    B, Hq, Hkv, L, D = 2, 4, 2, 45, 64
    q, k, v = (randn(B, L, h, D, dtype=torch.bfloat16, device=device).transpose(1, 2).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    check(lambda *t: attention(*t, True, return_lse=True),
          lambda *t, compute_dtype=None: reference.attention(*t, True, return_lse=True, compute_dtype=compute_dtype),
          (q, k, v), ["q", "k", "v"])
    assert launches["attention_bwd_dq_atomic"] == 1 and launches["attention_bwd"] == 0


@pytest.mark.skipif(not SM90, reason="the TMA reduce-add runs on sm_90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lk,D", GPU_CASES)
def test_atomic_backward_matches_reference_gpu(B, Hq, Hkv, Lq, Lk, D, causal, dtype, launches, monkeypatch):
    _check_atomic(B, Hq, Hkv, Lq, Lk, D, causal, dtype, "cuda", launches, monkeypatch)


_ALL_CONFIGS = [pytest.param(d, i, id=f"d{d}-cfg{i}") for d, c in backward_atomic.CONFIGS.items()
                for i in range(len(c))]


@pytest.mark.skipif(not SM90, reason="the TMA reduce-add runs on sm_90 only")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,index", _ALL_CONFIGS)
def test_every_candidate_config_gpu(D, index, causal, launches, monkeypatch):
    """Each candidate alone (the tuner keeps one per shape; the others must be right too):
    ragged lengths, GQA."""
    monkeypatch.setattr(backward_atomic, "CONFIGS", {**backward_atomic.CONFIGS, D: [backward_atomic.CONFIGS[D][index]]})
    monkeypatch.setattr(backward_atomic._CACHE, "chosen", {})
    _check_atomic(1, 4, 2, 300, 333, D, causal, torch.bfloat16, "cuda", launches, monkeypatch)


# ---------------------------------------------------------------------------------------------
# dispatch (CPU, launches stubbed: the counts say which backward each call takes)
# ---------------------------------------------------------------------------------------------

_L = 40


def _bwd_call(q, k, v, causal=True, **features):
    """``launchers.backward`` on q, k, v with ``features`` (its keyword arguments, and
    ``dropout_p`` / ``key_padding_mask``)."""
    B, Hq, Lq, D = q.shape
    do, out = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(B, Hq, Lq, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    seed = torch.zeros(1, dtype=torch.int64)
    dropout_p, pad = features.pop("dropout_p", 0.0), features.pop("key_padding_mask", None)
    launchers.backward(do, q, k, v, out, lse, None, dq, dk, dv, pad, seed, causal, D ** -0.5, dropout_p, **features)


def _route(monkeypatch, enabled=True, arch=0):
    monkeypatch.setattr(backward_atomic, "ENABLED", enabled)
    monkeypatch.setattr(common, "STUB_LAUNCHES", True)
    monkeypatch.setattr(common, "arch", lambda device: arch)


def _taken(launches):
    atomic, free = launches["attention_bwd_dq_atomic"], launches["attention_bwd"]
    assert atomic + free == 1
    return "atomic" if atomic else "atomic-free"


@pytest.mark.parametrize("arch", [0, 90], ids=["interpreter", "sm90"])
@pytest.mark.parametrize("causal", [False, True])
def test_switch_takes_the_atomic_backward(arch, causal, launches, monkeypatch):
    _route(monkeypatch, arch=arch)
    _bwd_call(*_qkv(1, 4, 2, _L, _L + 7, 64, torch.bfloat16, "cpu", grad=False), causal)
    assert _taken(launches) == "atomic"


@pytest.mark.parametrize("arch,enabled", [(0, False), (90, False), (80, True)], ids=["off", "off-sm90", "sm80"])
def test_the_switch_and_sm90_are_required(arch, enabled, launches, monkeypatch):
    _route(monkeypatch, enabled=enabled, arch=arch)
    _bwd_call(*_qkv(1, 2, 2, _L, _L, 64, torch.bfloat16, "cpu", grad=False))
    assert _taken(launches) == "atomic-free"


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_deterministic_mode_takes_the_atomic_free_backward(deterministic, launches, monkeypatch):
    _route(monkeypatch)
    _bwd_call(*_qkv(1, 2, 2, _L, _L, 64, torch.bfloat16, "cpu", grad=False))
    assert _taken(launches) == "atomic-free"


def test_deterministic_mode_numerics(deterministic, device, launches, monkeypatch):
    """With the switch on and deterministic algorithms requested, gradients come from the
    atomic-free backward and match the reference."""
    if ON_CUDA and not SM90:
        pytest.skip("the switch matters on sm_90 and in the interpreter only")
    monkeypatch.setattr(backward_atomic, "ENABLED", True)
    q, k, v = _qkv(1, 2, 1, 40, 40, 64, torch.bfloat16, device)
    check(lambda *t: attention(*t, True, return_lse=True),
          lambda *t, compute_dtype=None: reference.attention(*t, True, return_lse=True, compute_dtype=compute_dtype),
          (q, k, v), ["q", "k", "v"])
    assert launches["attention_bwd"] == 1 and launches["attention_bwd_dq_atomic"] == 0


def _unsupported():
    """(name, tensors, features) of calls the atomic backward does not take."""
    bf = torch.bfloat16
    return [
        ("d256", _qkv(1, 2, 2, _L, _L, 256, bf, "cpu", grad=False), {}),
        ("d32", _qkv(1, 2, 2, _L, _L, 32, bf, "cpu", grad=False), {}),
        ("fp32", _qkv(1, 2, 2, _L, _L, 64, torch.float32, "cpu", grad=False), {}),
    ] + unsupported_features(_L)


@pytest.mark.parametrize("name,tensors,features", _unsupported(), ids=[c[0] for c in _unsupported()])
def test_unsupported_calls_take_the_atomic_free_backward(name, tensors, features, launches, monkeypatch):
    _route(monkeypatch, arch=90)
    _bwd_call(*tensors, **features)
    assert _taken(launches) == "atomic-free", name


def test_non_causal_right_window_takes_the_atomic_free_backward(launches, monkeypatch):
    """A right bound that is not the causal diagonal (window (-1, 5) without causality)."""
    _route(monkeypatch, arch=90)
    _bwd_call(*_qkv(1, 2, 2, _L, _L, 64, torch.bfloat16, "cpu", grad=False), False, window=(-1, 5))
    assert _taken(launches) == "atomic-free"


def test_supports_names_every_feature():
    base = dict(arch=90, dtype=torch.bfloat16, block_d=64, use_tma=True, dropout_p=0.0, key_padding_mask=None,
                has_window=False, varlen=None, score_mod=False, dbias=None)
    assert backward_atomic.supports(**base)
    t = torch.empty(1)
    changes = dict(arch=80, dtype=torch.float32, block_d=256, use_tma=False, dropout_p=0.5, key_padding_mask=t,
                   has_window=True, varlen=(t, t, 1, 1), score_mod=True, dbias=t)
    for name, value in changes.items():
        assert not backward_atomic.supports(**{**base, name: value}), name
