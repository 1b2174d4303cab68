"""Helpers of the attention feature tests: one comparison of a kernel call (output, LSE and the
gradient of every input that requires one) with the float64 reference and PyTorch's own error
in the inputs' dtype (``numerics.assert_close``'s rule).

``run(*tensors)`` calls the kernels and ``ref(*tensors, compute_dtype=...)`` the reference;
both return ``(out, lse)``. ``tensors`` are the kernel's inputs: floating-point tensors that
require a gradient get one in all three computations; other tensors (masks, lengths) pass
unchanged. The reference runs on float64 copies, the baseline on copies in the inputs' dtype.
"""
import pytest
import torch

from fused_block.kernels import common
from fused_block.kernels.attention import launchers
from gemm_testing import baseline_mode, fp32_mode
from numerics import ATOL, assert_close, randn

ON_CUDA = torch.cuda.is_available()
HOPPER = ON_CUDA and torch.cuda.get_device_capability()[0] >= 9
PATHS = ("tma", "pointer")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Runs the test on one data path and checks afterwards that it was the one taken (import
    it into a test module to use it)."""
    if request.param == "tma" and ON_CUDA and not HOPPER:
        pytest.skip("TMA needs Hopper")
    monkeypatch.setattr(launchers, "FORCE_PATH", "pointer" if request.param == "pointer" else None)
    before = common.LAUNCHES["attention_tma"]
    yield request.param
    took_tma = common.LAUNCHES["attention_tma"] > before
    assert took_tma == expects_tma(request.param, request.node), f"the {request.param} path did not run"


def expects_tma(path, node):
    """Whether the kernels take TMA on ``path``. Hopper runs IEEE fp32 (torch's default
    precision) from registers, on the pointer path (``launchers._use_tma``); a test whose
    ``mode`` parameter is "tf32" runs its fp32 products in TF32, on TMA."""
    params = getattr(getattr(node, "callspec", None), "params", {})
    ieee = params.get("dtype") == torch.float32 and params.get("mode", "ieee") == "ieee"
    return path == "tma" and not (HOPPER and ieee)


def _copies(tensors, dtype=None):
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            c = t.detach().to(dtype or t.dtype).clone()
            out.append(c.requires_grad_(t.requires_grad))
        else:
            out.append(t)
    return out


def _grad_inputs(tensors):
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]


def check(run, ref, tensors, names, *, mode="ieee", lse_weight=False, grads=True, out_dtype=None):
    """Compare ``run(*tensors)`` with ``ref`` (see the module docstring); ``names`` name the
    tensors (for messages). ``lse_weight``: the loss also weighs the LSE (its gradient flows
    into every input). Returns the kernel's ``(out, lse)``."""
    dtype = out_dtype or next(t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())
    wanted = [n for n, t in zip(names, tensors) if isinstance(t, torch.Tensor) and t.requires_grad] if grads else []

    def loss(out, lse, dout, w):
        total = (out.float() * dout.float()).sum() if out.dtype != torch.float64 else (out * dout.double()).sum()
        if w is not None:
            finite = torch.isfinite(lse)
            total = total + (torch.where(finite, lse, 0.0) * w.to(lse.dtype)).sum()
        return total

    with fp32_mode(mode):
        out, lse = run(*tensors)
        dout = randn(*out.shape, dtype=dtype, device=out.device)
        w = randn(*lse.shape, dtype=torch.float32, device=lse.device) if lse_weight else None
        got = torch.autograd.grad(loss(out, lse, dout, w), _grad_inputs(tensors)) if wanted else ()
    t64 = _copies(tensors, torch.float64)
    out64, lse64 = ref(*t64)
    want64 = torch.autograd.grad(loss(out64, lse64, dout, w), _grad_inputs(t64)) if wanted else ()
    tlp = _copies(tensors)
    with baseline_mode(dtype, mode):
        base, base_lse = ref(*tlp, compute_dtype=dtype)
        want_lp = torch.autograd.grad(loss(base, base_lse, dout, w), _grad_inputs(tlp)) if wanted else ()
    assert out.dtype == dtype
    assert_close("out", out, out64, base)
    assert lse.dtype == torch.float32
    assert_close("lse", lse, lse64, base_lse, atol=ATOL[dtype])
    for name, g, g64, gb in zip(wanted, got, want64, want_lp):
        # An fp32 leaf of a low-precision computation (sinks): its gradient carries the inputs'
        # rounding (delta = rowsum(dO * O) from the rounded O), so the inputs' dtype's atol.
        assert_close(f"d{name}", g, g64, gb, atol=ATOL[dtype] if g.dtype != dtype else None)
    return out, lse


def forced_schedule(monkeypatch, sched: int, vhost: bool = False, l2_budget: int = 1):
    """Runs the forward with its first candidate changed to the tile order ``sched`` (and
    ``vhost``: packed sequences through the host-side descriptors) and the backward's first
    candidate to the same order (its ``SCHED`` 1 or 2), with fresh config caches and
    ``launchers.L2_BUDGET`` set to ``l2_budget`` bytes (1: a head per group, so the group
    arithmetic runs). Returns the list the launches append (kernel, SCHED, VHOST, grid) to."""
    from fused_block.kernels.attention import configs

    monkeypatch.setattr(launchers, "_FWD_CACHE", common.ConfigCache("attention_fwd"))
    monkeypatch.setattr(launchers, "_BWD_CACHE", common.ConfigCache("attention_bwd"))
    monkeypatch.setattr(launchers, "L2_BUDGET", l2_budget)
    candidates = launchers._fwd_candidates

    def forced(*args):
        c = candidates(*args)[0]
        return [configs._fwd_cfg(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages, False, sched, vhost)]

    monkeypatch.setattr(launchers, "_fwd_candidates", forced)
    bwd_candidates = launchers._bwd_candidates

    def forced_bwd(*args):
        c = bwd_candidates(*args)[0]
        # persistent: dV and dK in programs of their own, as the tables' persistent configs
        return [configs._bwd_cfg(*(c[n] for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")), c.num_warps,
                                 c.num_stages, c["SPLIT_KV"] or sched == 2, sched)]

    monkeypatch.setattr(launchers, "_bwd_candidates", forced_bwd)
    seen = []
    launch = common.launch

    def record(name, kernel, grid, args, constexprs, config):
        if name == "attention_fwd":
            seen.append((name, config["SCHED"], config["VHOST"], grid))
        elif name == "attention_bwd":
            seen.append((name, config["SCHED"], None, grid))
        return launch(name, kernel, grid, args, constexprs, config)

    monkeypatch.setattr(common, "launch", record)
    return seen


def forced_host_desc(monkeypatch, mode: int = 1):
    """Runs the backward with its first candidate's ``HOST_DESC`` twin of ``mode`` (1: every
    tile through the host-side descriptors, 2: the tiles read or written once; timed
    candidates of sm_90's tables) and a fresh config cache. Returns the list its launches
    append (HOST_DESC, the number of host-side descriptor arguments) to."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fused_block.kernels.attention import configs

    monkeypatch.setattr(launchers, "_BWD_CACHE", common.ConfigCache("attention_bwd"))
    bwd_candidates = launchers._bwd_candidates

    def forced_bwd(*args):
        return [configs._host_desc_twin(bwd_candidates(*args)[0], mode)]

    monkeypatch.setattr(launchers, "_bwd_candidates", forced_bwd)
    seen = []
    launch = common.launch

    def record(name, kernel, grid, args, constexprs, config):
        if name == "attention_bwd":
            seen.append((config["HOST_DESC"], sum(isinstance(a, TensorDescriptor) for a in args)))
        return launch(name, kernel, grid, args, constexprs, config)

    monkeypatch.setattr(common, "launch", record)
    return seen


def qkv(B, Hq, Hkv, Lq, Lk, D, dtype, device, grad=True):
    """Fresh random (q, k, v) in (B, H, L, D), k and v with Hkv heads."""
    return (randn(B, Hq, Lq, D, dtype=dtype, device=device, requires_grad=grad),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=grad),
            randn(B, Hkv, Lk, D, dtype=dtype, device=device, requires_grad=grad))


def unsupported_features(L: int) -> list:
    """(name, tensors, features) of bf16 D64 calls (B 1, 2 heads, L tokens, CPU) whose score
    features or layout the opt-in Hopper backwards do not take: dropout, padding, a window,
    softcap, ALiBi, a bias (with its gradient), a bool mask, rows TMA cannot read."""
    bf = torch.bfloat16
    tensors = qkv(1, 2, 2, L, L, 64, bf, "cpu", grad=False)
    _, k, v = tensors
    # A row stride TMA cannot take (an odd number of elements: 2-byte misaligned rows).
    odd = torch.randn(1, 2, L, 65).to(bf)[..., :64]
    bias = torch.zeros(L, L, dtype=bf)
    return [
        ("dropout", tensors, dict(dropout_p=0.1)),
        ("padding", tensors, dict(key_padding_mask=torch.zeros(1, L, dtype=torch.bool))),
        ("window", tensors, dict(window=(8, 0))),
        ("softcap", tensors, dict(softcap=30.0)),
        ("alibi", tensors, dict(alibi=torch.ones(2))),
        ("bias", tensors, dict(bias=bias)),
        ("bias-grad", tensors, dict(bias=bias, dbias=torch.empty(1, 1, L, L, dtype=bf))),
        ("mask", tensors, dict(mask=torch.ones(L, L, dtype=torch.bool))),
        ("unaligned", (odd, k, v), {}),
    ]
