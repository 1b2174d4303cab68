"""fused_block.dispatch: every GEMM of the layers on its cuBLAS candidate (torch.mm / addmm /
_addmm_activation, then the Triton elementwise epilogue or act_grad pass), forward and every
gradient, against the float64 reference under the "twice PyTorch's own error" rule; and the
per-key choice, its cache and its table.

The interpreter's default is our fused kernel (the rest of the suite proves it); here
``dispatch.force("cublas")`` takes the other candidate, and the launch counts prove that no
fused GEMM ran and that the elementwise Triton kernels did. Shapes are small: odd M (masked
rows of the elementwise tiles) and N below or across one 64-column tile.
"""
import pytest
import torch

import fused_block
import fused_block.kernels.matmul as kmatmul
from fused_block.kernels import common
from fused_block import dispatch, reference
from fused_block.linear import gated_linear, geglu, linear, mlp, swiglu

from gemm_testing import DTYPE_MODES, baseline_mode, check, fp32_mode, kernel_masks, leaves, seeded
from numerics import assert_close, randn

M, K, N = 37, 24, 72  # odd rows; N spans two 64-column tiles of the elementwise kernels


@pytest.fixture
def cublas():
    with dispatch.force("cublas"):
        yield


def _t(*shape, dtype, device, scale=1.0):
    return randn(*shape, dtype=dtype, device=device, scale=scale, requires_grad=True)


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("activation,bias", [(None, True), (None, False), ("gelu", True), ("gelu_tanh", True),
                                             ("relu", True)])
def test_linear_on_cublas(activation, bias, dtype_mode, device, launches, cublas):
    # forward: addmm into the saved pre-activation, then the epilogue kernel (activation +
    # residual); without an activation the residual is cuBLAS's C input (addmm(residual, x,
    # W^T): one rounding), the bias added by torch, no Triton pass; backward: act_grad (act',
    # dB's partials), dX and dW on cuBLAS; without an activation dB is torch.sum's (no
    # elementwise pass).
    dtype, mode = dtype_mode
    x, w = _t(M, K, dtype=dtype, device=device), _t(N, K, dtype=dtype, device=device, scale=K ** -0.5)
    b, r = _t(N, dtype=dtype, device=device) if bias else None, _t(M, N, dtype=dtype, device=device)

    def ours(x, w, b, r):
        return linear(x, w, b, activation, r)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, activation, r, compute_dtype=compute_dtype)

    check("linear cublas", ours, ref, (x, w, b, r), dtype, device, mode)
    assert launches["matmul"] == 0
    assert (launches["epilogue"] >= 1) == (activation is not None)
    assert launches["act_grad"] == (1 if activation else 0)


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
def test_linear_plain_and_bias_rowsum_on_cublas(dtype_mode, device, launches, cublas):
    # No epilogue: addmm (bias) straight into the output; dW on cuBLAS, dB = torch.sum of dY's
    # columns (eager's bias gradient: one reduction, no Triton pass), x with leading dims.
    dtype, mode = dtype_mode
    x, w = _t(2, 5, K, dtype=dtype, device=device), _t(N, K, dtype=dtype, device=device, scale=K ** -0.5)
    b = _t(N, dtype=dtype, device=device)

    def ref(x, w, b, compute_dtype=None):
        return reference.linear(x, w, b, None, None, compute_dtype=compute_dtype)

    check("linear plain cublas", lambda x, w, b: linear(x, w, b), ref, (x, w, b), dtype, device, mode)
    assert launches["matmul"] == 0 and launches["epilogue"] == 0
    assert launches["act_grad"] == 0 and launches["bias_grad_reduce"] == 0


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_addmm_activation_forward(activation, dtype_mode, device, launches, cublas):
    # bias + tanh GELU / ReLU without grad, residual or dropout: cuBLASLt's activation epilogue
    # (torch._addmm_activation), nothing left for a second pass; torch's CPU use_gelu is the erf
    # GELU, so there the tanh GELU takes the epilogue kernel.
    dtype, mode = dtype_mode
    x, w = randn(M, K, dtype=dtype, device=device), randn(N, K, dtype=dtype, device=device, scale=K ** -0.5)
    b = randn(N, dtype=dtype, device=device)
    with fp32_mode(mode):
        out = linear(x, w, b, activation)
    with baseline_mode(dtype, mode):
        base = reference.linear(x, w, b, activation, compute_dtype=dtype)
    assert_close("addmm_activation", out, reference.linear(*leaves((x, w, b), torch.float64), activation), base)
    assert launches["matmul"] == 0
    assert launches["epilogue"] == (1 if activation == "gelu_tanh" and device.type == "cpu" else 0)


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("activation", [None, "relu"])
def test_linear_dropout_on_cublas(activation, dtype_mode, device, launches, cublas):
    # The epilogue kernel draws the fused kernel's mask (kernel_masks), act_grad regenerates it.
    dtype, mode = dtype_mode
    x, w = _t(M, K, dtype=dtype, device=device), _t(N, K, dtype=dtype, device=device, scale=K ** -0.5)
    b, r = _t(N, dtype=dtype, device=device), _t(M, N, dtype=dtype, device=device)
    (mask,) = kernel_masks(11, device, (M, N, 0.3))

    def ours(x, w, b, r):
        return linear(x, w, b, activation, r, dropout_p=0.3)

    def ref(x, w, b, r, compute_dtype=None):
        return reference.linear(x, w, b, activation, r, 0.3, dropout_mask=mask, compute_dtype=compute_dtype)

    check("linear dropout cublas", seeded(ours, 11), ref, (x, w, b, r), dtype, device, mode)
    assert launches["matmul"] == 0 and launches["epilogue"] >= 1


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("dropouts", [(0.0, 0.0), (0.3, 0.2), (0.25, 0.0)], ids=["none", "both", "hidden"])
def test_mlp_on_cublas(dropouts, dtype_mode, device, launches, cublas):
    # fc1: addmm into the saved pre-activation + epilogue (GELU, dropout); fc2: addmm + epilogue
    # (dropout, residual), or without output dropout addmm(residual, ...) and the bias by torch
    # (no Triton pass); backward dH on cuBLAS then act_grad (act', mask, dB1's partials and
    # the hidden activation recomputed for dW2); dW2 with dB2's partials, dW1, dX.
    dtype, mode = dtype_mode
    p1, p2 = dropouts
    F_ = 40
    x = _t(M, K, dtype=dtype, device=device)
    w1, b1 = _t(F_, K, dtype=dtype, device=device, scale=K ** -0.5), _t(F_, dtype=dtype, device=device)
    w2, b2 = _t(K, F_, dtype=dtype, device=device, scale=F_ ** -0.5), _t(K, dtype=dtype, device=device)
    r = _t(M, K, dtype=dtype, device=device)
    m1, m2 = kernel_masks(7, device, (M, F_, p1), (M, K, p2))

    def ours(x, w1, b1, w2, b2, r):
        return mlp(x, w1, b1, w2, b2, "gelu", r, p1, p2)

    def ref(x, w1, b1, w2, b2, r, compute_dtype=None):
        return reference.mlp(x, w1, b1, w2, b2, "gelu", r, p1, p2, dropout_mask=m1 if p1 else None,
                             output_dropout_mask=m2 if p2 else None, compute_dtype=compute_dtype)

    check("mlp cublas", seeded(ours, 7), ref, (x, w1, b1, w2, b2, r), dtype, device, mode)
    assert launches["matmul"] == 0 and launches["epilogue"] == 1 + (p2 > 0) and launches["act_grad"] >= 1


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_gated_ffn_on_cublas(act, dtype_mode, device, launches, cublas):
    # Separate gate and up weights: two addmm into the halves of the saved [gate | up], the
    # gated epilogue; backward dGate/dUp from act_grad into the halves of one buffer, dX as
    # mm + addmm_ (weights not adjacent), [dWg; dWu] in one product. Hidden and output dropout.
    dtype, mode = dtype_mode
    fn, ref_fn = (swiglu, reference.swiglu) if act == "swiglu" else (geglu, reference.geglu)
    F_, p1, p2 = 40, 0.3, 0.2
    x, r = _t(M, K, dtype=dtype, device=device), _t(M, K, dtype=dtype, device=device)
    wg, wu = (_t(F_, K, dtype=dtype, device=device, scale=K ** -0.5) for _ in range(2))
    wd = _t(K, F_, dtype=dtype, device=device, scale=F_ ** -0.5)
    bg, bu, bd = _t(F_, dtype=dtype, device=device), _t(F_, dtype=dtype, device=device), _t(K, dtype=dtype,
                                                                                              device=device)
    m1, m2 = kernel_masks(9, device, (M, F_, p1), (M, K, p2))

    def ours(x, wg, wu, wd, r, bg, bu, bd):
        return fn(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd, dropout_p=p1, output_dropout_p=p2)

    def ref(x, wg, wu, wd, r, bg, bu, bd, compute_dtype=None):
        return ref_fn(x, wg, wu, wd, r, b_gate=bg, b_up=bu, b_down=bd, dropout_p=p1, output_dropout_p=p2,
                      dropout_mask=m1, output_dropout_mask=m2, compute_dtype=compute_dtype)

    check(f"{act} cublas", seeded(ours, 9), ref, (x, wg, wu, wd, r, bg, bu, bd), dtype, device, mode)
    assert launches["matmul"] == 0 and launches["epilogue"] == 2


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[3]])
def test_mlp_swiglu_stacked_on_cublas(dtype_mode, device, launches, cublas):
    # mlp's stacked [gate; up] weight: the dual-K dX = dGate @ Wg + dUp @ Wu is one product
    # over the joined halves (views, no copy); no biases, no residual.
    dtype, mode = dtype_mode
    F_ = 40
    x = _t(M, K, dtype=dtype, device=device)
    w1 = _t(2 * F_, K, dtype=dtype, device=device, scale=K ** -0.5)
    w2 = _t(K, F_, dtype=dtype, device=device, scale=F_ ** -0.5)
    a = x.detach()[:, :1].expand(M, F_).contiguous()  # a (M, F) [dGate | dUp]-like pair
    pair = torch.cat([a, a], 1)
    assert dispatch._joined(pair[:, :F_], pair[:, F_:], 1) is not None
    assert dispatch._joined(w1[:F_].detach(), w1[F_:].detach(), 0) is not None
    assert dispatch._joined(pair[:, F_:], pair[:, :F_], 1) is None

    def ref(x, w1, w2, compute_dtype=None):
        return reference.mlp(x, w1, None, w2, None, "swiglu", compute_dtype=compute_dtype)

    check("mlp swiglu cublas", lambda x, w1, w2: mlp(x, w1, None, w2, None, "swiglu"), ref, (x, w1, w2), dtype,
          device, mode)
    assert launches["matmul"] == 0


def _back_to_back(*shapes, dtype, device, scale):
    """Tensors of ``shapes`` lying back to back in one buffer, each with a storage of its own (as
    two blocks of one CUDA caching-allocator segment: separately allocated parameters), random
    leaves; and the buffer (kept alive by the caller)."""
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None:
        pytest.skip("this torch cannot make a storage over given memory")
    numels = [torch.Size(s).numel() for s in shapes]
    buf = torch.empty(sum(numels), dtype=dtype, device=device)
    out, offset = [], 0
    for shape, n in zip(shapes, numels):
        size = n * buf.element_size()
        t = torch.empty(0, dtype=dtype, device=device).set_(
            construct(buf.data_ptr() + offset * buf.element_size(), buf.device, size), 0, shape)
        t.copy_(randn(*shape, dtype=dtype, device=device, scale=scale))
        out.append(t.requires_grad_())
        offset += n
    return out, buf


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
def test_gated_weights_back_to_back_in_separate_storages_on_cublas(dtype_mode, device, launches, cublas):
    # swiglu's gate and up weights (and gated_linear's LoRA B pair) adjacent in memory but two
    # storages: the dual-K dX (dU) may not join them into one view (out of the first's storage:
    # setStorage raised), so it runs mm + addmm_; the halves of dPre still join.
    dtype, mode = dtype_mode
    F_, R = 40, 16
    x = _t(M, K, dtype=dtype, device=device)
    (wg, wu), buf = _back_to_back((F_, K), (F_, K), dtype=dtype, device=device, scale=K ** -0.5)
    assert wu.data_ptr() == wg.data_ptr() + wg.numel() * wg.element_size()
    wd = _t(K, F_, dtype=dtype, device=device, scale=F_ ** -0.5)

    def ref(x, wg, wu, wd, compute_dtype=None):
        return reference.swiglu(x, wg, wu, wd, compute_dtype=compute_dtype)

    check("swiglu back-to-back cublas", lambda x, wg, wu, wd: swiglu(x, wg, wu, wd), ref, (x, wg, wu, wd), dtype,
          device, mode)
    u = _t(M, R, dtype=dtype, device=device)
    (lbg, lbu), lbuf = _back_to_back((F_, R), (F_, R), dtype=dtype, device=device, scale=0.3)

    def ours_g(x, wg, wu, u, lbg, lbu):
        return gated_linear(x, wg, wu, lora=(u, lbg, lbu))

    def ref_g(x, wg, wu, u, lbg, lbu, compute_dtype=None):
        return reference.gated(x, wg, wu, None, None, lora=(u, lbg, lbu), compute_dtype=compute_dtype)

    check("gated+lora back-to-back cublas", ours_g, ref_g, (x, wg, wu, u, lbg, lbu), dtype, device, mode)
    assert launches["matmul"] == 0
    del buf, lbuf


@pytest.mark.parametrize("dtype_mode", [DTYPE_MODES[0], DTYPE_MODES[2], DTYPE_MODES[3]])
def test_lora_on_cublas(dtype_mode, device, launches, cublas):
    # LoRA in the reduction: addmm then addmm_ of the low-rank pair (PEFT's two roundings);
    # dU and dB on cuBLAS; the gated first layer with both projections' pairs and dropout.
    dtype, mode = dtype_mode
    R, F_ = 16, 24
    x, w = _t(M, K, dtype=dtype, device=device), _t(N, K, dtype=dtype, device=device, scale=K ** -0.5)
    b, u = _t(N, dtype=dtype, device=device), _t(M, R, dtype=dtype, device=device)
    lb = _t(N, R, dtype=dtype, device=device, scale=0.3)

    def ours(x, w, b, u, lb):
        return linear(x, w, b, "gelu", lora=(u, lb))

    def ref(x, w, b, u, lb, compute_dtype=None):
        return reference.linear(x, w, b, "gelu", lora=(u, lb), compute_dtype=compute_dtype)

    check("linear+lora cublas", ours, ref, (x, w, b, u, lb), dtype, device, mode)
    wg, wu = (_t(F_, K, dtype=dtype, device=device, scale=K ** -0.5) for _ in range(2))
    bg, bu = _t(F_, dtype=dtype, device=device), _t(F_, dtype=dtype, device=device)
    lbg, lbu = (_t(F_, R, dtype=dtype, device=device, scale=0.3) for _ in range(2))
    (mask,) = kernel_masks(5, device, (M, F_, 0.25))

    def ours_g(x, wg, wu, bg, bu, u, lbg, lbu):
        return gated_linear(x, wg, wu, bg, bu, dropout_p=0.25, lora=(u, lbg, lbu))

    def ref_g(x, wg, wu, bg, bu, u, lbg, lbu, compute_dtype=None):
        return reference.gated(x, wg, wu, bg, bu, dropout_p=0.25, dropout_mask=mask, lora=(u, lbg, lbu),
                               compute_dtype=compute_dtype)

    check("gated+lora cublas", seeded(ours_g, 5), ref_g, (x, wg, wu, bg, bu, u, lbg, lbu), dtype, device, mode)
    assert launches["matmul"] == 0 and launches["epilogue"] >= 2


def test_choice_is_cached_per_key_and_listed(device, launches, monkeypatch):
    # One choice per key (op, dtypes, M bucket, N, K, epilogue): a second call of the same
    # shapes (and another M in the same power-of-two bucket) is a lookup; the table lists each
    # op once with the candidate that ran. The interpreter's static choice is our kernel.
    monkeypatch.setattr(dispatch, "_RAN", {})
    monkeypatch.setattr(dispatch._CACHE, "chosen", {})
    calls = []
    get = dispatch._CACHE.get
    monkeypatch.setattr(dispatch._CACHE, "get", lambda key, cands, run: calls.append(key) or get(key, cands, run))
    dtype = torch.bfloat16
    w = _t(N, K, dtype=dtype, device=device, scale=K ** -0.5)
    b = _t(N, dtype=dtype, device=device)
    with dispatch.force(None):  # the per-key choice (the suite's default is our kernel)
        for rows in (37, 37, 33):  # 33 and 37 share the bucket 64 (M); dW's K is the rows, exact
            linear(_t(rows, K, dtype=dtype, device=device), w, b, "gelu").sum().backward()
    assert len(calls) == 4  # forward, dX, dW chosen once each, dW once more for K = 33
    table = fused_block.dispatch_table()
    assert sorted(r["op"] for r in table) == ["linear.dw", "linear.dw", "linear.dx", "linear.fwd"]
    # The static rule: the interpreter's is ours; CUDA's (FUSED_BLOCK_TUNE=0) ours for the fused
    # forward only (timed otherwise: either).
    static = {"linear.fwd": "triton", "linear.dx": "cublas", "linear.dw": "cublas"}
    for r in table:
        assert r["M"] == (64 if r["op"] != "linear.dw" else 128) and r["dtype"] == "bfloat16"
        assert r["candidate"] in dispatch.CANDIDATES
        if device.type == "cpu":
            assert r["candidate"] == "triton" and r["device"] == "interpreter"
        elif not common.TUNE:
            assert r["candidate"] == static[r["op"]]
    fwd = next(r for r in table if r["op"] == "linear.fwd")
    assert fwd["activation"] == 1 and fwd["epilogue"] == ["bias", "store_pre", "transpose_b"]
    assert "linear.fwd" in dispatch.format_table(table)
    # A forced candidate runs and is listed, without touching the cached choice.
    with dispatch.force("cublas"):
        linear(_t(37, K, dtype=dtype, device=device), w, b, "gelu").sum().backward()
    assert len(calls) == 4
    ran = {(r["op"], r["K"]): r["candidate"] for r in fused_block.dispatch_table()}
    assert ran == {("linear.fwd", K): "cublas", ("linear.dx", N): "cublas", ("linear.dw", 37): "cublas",
                   ("linear.dw", 33): ran[("linear.dw", 33)]}
    if device.type == "cpu":
        assert launches["matmul"] == 9  # the three unforced steps: the interpreter's choice is ours


def test_call_signature_memo_gives_each_call_its_own_key(device, monkeypatch):
    # gemm derives a call's key once per signature (shapes, dtypes, device, the keywords and
    # their scalar values / presence): calls differing in any field of the key get their own,
    # equal to the key derived afresh; the fp32 precision switch is read on every call.
    monkeypatch.setattr(dispatch, "_KEYS", {})
    monkeypatch.setattr(dispatch, "_RAN", {})
    ran = []
    monkeypatch.setattr(dispatch, "_run", lambda *args: None)
    monkeypatch.setattr(dispatch, "_cublas", lambda *args, **kw: None)
    monkeypatch.setattr(dispatch._k, "gemm", lambda *args, **kw: None)
    a = torch.randn(M, K, device=device)
    w = torch.randn(N, K, device=device)
    bias = torch.randn(N, device=device)
    c = torch.empty(M, N, device=device)
    calls = [dict(transpose_b=True), dict(transpose_b=True, bias=bias), dict(transpose_b=True, bias=None),
             dict(transpose_b=True, bias=bias, activation=1), dict(transpose_b=True, bias=bias, activation=2),
             dict(transpose_b=True, bias=bias, dropout_p=0.1, seed=3), dict(transpose_b=True, bias=bias, dropout_p=0.1,
                                                                            seed=4)]
    before = torch._C._get_cublas_allow_tf32()
    try:
        for tf32 in (False, True):
            torch._C._set_cublas_allow_tf32(tf32)
            for kw in calls:
                for _ in range(2):  # derived, then from the memo
                    dispatch.gemm("linear.fwd", a, w, c, **kw)
                    key = list(dispatch._RAN)[-1]
                    assert key == dispatch._key("linear.fwd", a, w, c, kw)
                    dispatch._RAN.pop(key)
                    ran.append(key)
    finally:
        torch._C._set_cublas_allow_tf32(before)
    # bias None and absent share a key, as do two seeds; TF32 is a key field for fp32
    assert len(set(ran)) == 2 * (len(calls) - 2)
    # one signature per call but for the seed (a new seed each step is no new signature)
    assert len(dispatch._KEYS) == 2 * (len(calls) - 1)


def test_timed_candidates_finish_the_bias_gradient(device, launches):
    # What the timed choice runs per candidate of a weight gradient with its bias gradient
    # (dispatch._run): both end with the finished bias sums, so the timings compare like with
    # like: cuBLAS's product and torch.sum; our kernel's product with the partial sums and
    # their reduction launch.
    dtype = torch.bfloat16
    dy = randn(M, N, dtype=dtype, device=device)
    x = randn(M, K, dtype=dtype, device=device)
    kw = dict(rowsum=True, transpose_a=True)
    ref = dy.double().t() @ x.double()
    baseline = (dy.t() @ x).double()  # PyTorch's own product in bf16
    for cand, matmuls, reductions in ((dispatch.TRITON, 1, 1), (dispatch.CUBLAS, 0, 0)):
        dw = torch.full((N, K), float("nan"), dtype=dtype, device=device)
        before = launches["matmul"], launches["bias_grad_reduce"]
        dispatch._run(cand, dy, x, dw, kw)
        assert (launches["matmul"] - before[0], launches["bias_grad_reduce"] - before[1]) == (matmuls, reductions)
        assert_close(f"dW ({cand})", dw, ref, baseline)


def test_plain_projection_on_cublas_runs_as_torchs_linear(device, monkeypatch):
    # A plain projection (bias alone) whose forward product is chosen for cuBLAS runs as torch's
    # F.linear with torch's autograd: eager's very ops (addmm; mm, mm, sum), so its output and
    # every gradient equal eager's bit for bit, and no Triton kernel runs. Chosen for ours (the
    # interpreter's rule), or forced, or with anything to fuse, linear's own path runs.
    monkeypatch.setattr(dispatch, "_RAN", {})
    monkeypatch.setattr(dispatch, "_PLAIN_KEYS", {})
    monkeypatch.setattr(dispatch._CACHE, "chosen", {})
    dtype = torch.bfloat16
    x = _t(3, 5, K, dtype=dtype, device=device)
    w = _t(N, K, dtype=dtype, device=device, scale=K ** -0.5)
    b = _t(N, dtype=dtype, device=device)
    dy = randn(3, 5, N, dtype=dtype, device=device)
    inputs = (x, w, b)
    eager = torch.nn.functional.linear(x, w, b)
    want = torch.autograd.grad(eager, inputs, dy)
    keys = dispatch._plain_keys(x, w, b)
    key = keys[0]
    with dispatch.force(None):
        # Nothing chosen yet: the interpreter's rule is ours, a GPU's first call times the choice
        # on linear's path, and FUSED_BLOCK_TUNE=0 on a GPU rules cuBLAS statically.
        static = common.arch(device) != 0 and not common.TUNE
        assert dispatch.linear_on_torch(x, w, b) == static
        for k in keys:  # ours chosen: linear's own path, its products under exactly these keys
            dispatch._CACHE.chosen[k] = dispatch.TRITON
        dispatch._RAN.clear()
        torch.autograd.grad(linear(x, w, b), inputs, dy)
        assert dispatch._RAN == dict.fromkeys(keys, dispatch.TRITON)
        for cand, on_torch in ((dispatch.CUBLAS, True), (dispatch.TRITON, False)):
            for k in keys:
                dispatch._CACHE.chosen[k] = cand
            before = common.LAUNCHES.copy()
            y = linear(x, w, b)
            grads = torch.autograd.grad(y, inputs, dy)
            ran = sum((common.LAUNCHES - before).values())
            assert (ran == 0) == on_torch
            assert dispatch._RAN[key] == (dispatch.TORCH if on_torch else cand)
            if on_torch:
                assert torch.equal(y, eager) and all(torch.equal(g, e) for g, e in zip(grads, want))
            else:
                assert_close("y", y, x.double() @ w.double().t() + b.double(), eager)
        for k in keys:
            dispatch._CACHE.chosen[k] = dispatch.CUBLAS
        dispatch._CACHE.chosen[keys[2]] = dispatch.TRITON  # dW on ours: linear's path, but not
        assert not dispatch.linear_on_torch(x, w, b)
        with torch.no_grad():  # ... where no gradient is computed
            assert dispatch.linear_on_torch(x, w, b)
        dispatch._CACHE.chosen[keys[2]] = dispatch.CUBLAS
        assert dispatch.linear_on_torch(x[:, :2], w, b) == static  # another shape: its own keys, unchosen
        with dispatch.force("cublas"):
            assert not dispatch.linear_on_torch(x, w, b)  # a forced candidate runs linear's path
        linear(x, w, b, "gelu")  # an epilogue to fuse: linear's path, its product dispatched
        assert dispatch._RAN[list(dispatch._RAN)[-1]] in dispatch.CANDIDATES


def test_bad_switches(monkeypatch):
    with pytest.raises(ValueError, match="candidate"):
        with dispatch.force("cudnn"):
            pass
    monkeypatch.setenv("FUSED_BLOCK_GEMM", "fastest")
    with pytest.raises(ValueError, match="FUSED_BLOCK_GEMM"):
        dispatch._env_force()
    monkeypatch.setenv("FUSED_BLOCK_GEMM", "cuBLAS")
    assert dispatch._env_force() == "cublas"


def test_act_grad_hidden_output_needs_an_activation(device, launches):
    g = randn(8, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="hout"):
        kmatmul.act_grad(g, None, 0, hout=torch.empty_like(g))
    assert launches["act_grad"] == 0


def test_deterministic_algorithms_take_our_kernel(device, launches, monkeypatch):
    # Nothing timed or remembered: the per-key choice is ours while determinism is asked for.
    monkeypatch.setattr(dispatch, "_RAN", {})
    monkeypatch.setattr(dispatch._CACHE, "chosen", {})
    monkeypatch.setattr(dispatch, "_deterministic", lambda: True)
    x, w = _t(M, K, dtype=torch.float32, device=device), _t(N, K, dtype=torch.float32, device=device)
    with dispatch.force(None):
        linear(x, w).sum().backward()
    assert dispatch._CACHE.chosen == {} and {r["candidate"] for r in dispatch.table()} == {"triton"}
    assert launches["matmul"] == 3


def test_unverified_epilogues_are_not_offered_by_default(monkeypatch):
    """Until a GPU run verifies them, the per-key choice on a GPU offers cuBLAS only where its
    call runs no new elementwise pass (the forward's epilogue kernel, act_grad's STORE_H):
    bias-only and plain products, cuBLASLt's GELU/ReLU epilogue, a residual of the output's
    dtype (cuBLAS's C input; a bias then by torch), the backward's act_grad without the hidden
    output. FUSED_BLOCK_GEMM_NEW_EPILOGUES=1 offers it everywhere."""
    a = torch.empty(4, 8, dtype=torch.bfloat16)
    c = torch.empty(4, 8, dtype=torch.bfloat16)
    bias = torch.empty(8, dtype=torch.bfloat16)
    verified = [dict(), dict(bias=bias), dict(act_grad=True, activation=1), dict(bias=bias, activation=3),
                dict(a2=a, b2=a), dict(rowsum=True), dict(residual=c), dict(residual=c, bias=bias)]
    unverified = [dict(activation=1), dict(residual=c, dropout_p=0.1), dict(dropout_p=0.1), dict(store_pre=True),
                  dict(b2=a), dict(act_grad=True, activation=1, hout=c), dict(bias=bias, activation=3, residual=c),
                  dict(residual=c.float())]
    assert not any(dispatch.unverified_epilogue(a, c, kw) for kw in verified)
    assert all(dispatch.unverified_epilogue(a, c, kw) for kw in unverified)
    seen = []
    monkeypatch.setattr(dispatch._CACHE, "get", lambda key, cands, run: seen.append(tuple(cands)) or cands[0])
    key = ("linear.fwd", 90, torch.bfloat16, torch.bfloat16, "", 64, 8, 8, 1, False, False, False, True, False,
           False, False, False, False, False, False, False, False)
    dispatch._choose(key, a, a, c, dict(activation=1, store_pre=True))
    monkeypatch.setattr(dispatch, "NEW_EPILOGUES", True)
    dispatch._choose(key, a, a, c, dict(activation=1, store_pre=True))
    assert seen == [("triton",), ("triton", "cublas")]


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float16])
def test_residual_dtype_is_part_of_the_key(residual_dtype, device, launches, monkeypatch):
    """The cuBLAS candidate's route depends on the residual's dtype (cuBLAS's C input where it is
    the output's, else the epilogue pass): fp32 x with a 16-bit residual (an fp32 output) gets a
    key (and call signature) of its own, so a verdict remembered for an fp32 residual (cuBLAS,
    offered there on a GPU) is not reused for a call whose cuBLAS candidate runs an unverified
    pass; the call itself is right on either candidate, against float64."""
    monkeypatch.setattr(dispatch, "_KEYS", {})
    monkeypatch.setattr(dispatch, "_RAN", {})
    monkeypatch.setattr(dispatch._CACHE, "chosen", {})
    x, w = _t(M, K, dtype=torch.float32, device=device), _t(N, K, dtype=torch.float32, device=device)
    r32, r16 = _t(M, N, dtype=torch.float32, device=device), _t(M, N, dtype=residual_dtype, device=device)
    out = torch.empty(M, N, device=device)
    kw32, kw16 = dict(residual=r32, transpose_b=True), dict(residual=r16, transpose_b=True)
    assert not dispatch.unverified_epilogue(x, out, kw32) and dispatch.unverified_epilogue(x, out, kw16)
    assert dispatch._key("linear.fwd", x, w, out, kw32) != dispatch._key("linear.fwd", x, w, out, kw16)
    with dispatch.force(None):
        linear(x.detach(), w.detach(), None, None, r32.detach())  # chooses (the interpreter: ours) for its key
        dispatch._CACHE.chosen.update(dict.fromkeys(dispatch._CACHE.chosen, dispatch.CUBLAS))  # a GPU's verdict
        before = launches["epilogue"]
        y = linear(x.detach(), w.detach(), None, None, r16.detach())
        assert launches["epilogue"] == before  # its own key: no cuBLAS verdict, so no epilogue pass
    assert y.dtype == torch.float32
    assert [r["epilogue"] for r in dispatch.table()] == [["residual", "transpose_b"]] * 2

    def ref(x, w, r, compute_dtype=None):
        return reference.linear(x, w, None, None, r, compute_dtype=compute_dtype)

    for cand in dispatch.CANDIDATES:
        with dispatch.force(cand):
            check(f"linear fp32 + {residual_dtype} residual ({cand})", lambda x, w, r: linear(x, w, None, None, r),
                  ref, (x, w, r16), torch.float32, device)
