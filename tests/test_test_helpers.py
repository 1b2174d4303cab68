"""The tests' own helpers: the fp32 precision context, the fuzz profiles, the interpreter's
speed-ups and its emulation of the GPU's fp32 products."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import fuzzing
import interpreter_hardware
import interpreter_speed
from fused_block.kernels import common
from numerics import FP32_PRECISIONS, fp32_matmul_precision

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fp32_matmul_precision_sets_what_the_kernels_read_and_restores_it():
    before = torch.get_float32_matmul_precision()
    with fp32_matmul_precision("high"):
        assert torch.get_float32_matmul_precision() == "high" and common.fp32_precision() == "tf32"
        with fp32_matmul_precision("highest"):
            assert common.fp32_precision() == "ieee"
        assert common.fp32_precision() == "tf32"
    assert torch.get_float32_matmul_precision() == before


def test_fp32_matmul_precision_restores_after_an_error():
    before = torch.get_float32_matmul_precision()
    with pytest.raises(RuntimeError, match="inside"):
        with fp32_matmul_precision("high"):
            raise RuntimeError("inside")
    assert torch.get_float32_matmul_precision() == before


def test_fp32_matmul_precision_rejects_unknown_modes():
    assert FP32_PRECISIONS == ("highest", "high")
    with pytest.raises(ValueError, match="precision"):
        with fp32_matmul_precision("tf32"):
            pass


@pytest.mark.parametrize("profile, counts", [("ci", {16: 16, 12: 12}), ("long", {16: 400}),
                                             ("quick", {16: 4, 12: 3, 40: 10, 2: 3})])
def test_fuzz_profiles_scale_the_example_counts(monkeypatch, profile, counts):
    monkeypatch.setattr(fuzzing, "PROFILE", profile)
    monkeypatch.setattr(fuzzing, "LONG", profile == "long")
    assert {n: fuzzing.examples_for(n) for n in counts} == counts
    s = fuzzing.settings_for(16)
    assert s.deadline is None and s.print_blob and s.derandomize == (profile != "long")


def test_unknown_fuzz_profile_is_refused():
    env = dict(os.environ, FUSED_BLOCK_FUZZ="longer",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", "import fuzzing"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "FUSED_BLOCK_FUZZ must be" in proc.stderr



@triton.jit
def _scaled_bits(x, k):
    return (x * k).to(tl.bfloat16).to(tl.uint16, bitcast=True)


@triton.jit
def _helper_heavy_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.uint32)
    for k in range(3):
        acc += _scaled_bits(x, k + 1.5).to(tl.uint32)
    tl.store(OUT + offs, acc.to(tl.int32), mask=offs < n)


@pytest.mark.skipif(not common.interpreting(), reason="the speed-ups are the interpreter's")
def test_interpreter_speedups_give_the_interpreters_answers():
    from triton.runtime import interpreter

    x = torch.randn(100)
    outs = []
    try:
        for install in (False, True):
            (interpreter_speed.install if install else interpreter_speed.uninstall)()
            out = torch.full((100,), -1, dtype=torch.int32)
            _helper_heavy_kernel[(4,)](x, out, 100, BLOCK=32)
            outs.append(out)
    finally:
        interpreter_speed.install()
    assert torch.equal(outs[0], outs[1]) and (outs[1] > 0).any()
    types = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.int64, tl.uint8, tl.pointer_type(tl.float32),
             tl.block_type(tl.bfloat16, [4, 8]), tl.block_type(tl.pointer_type(tl.int32), [8])]
    assert [interpreter._get_np_dtype(t) for t in types] == [interpreter_speed._original_np_dtype(t) for t in types]
    assert interpreter._get_np_dtype is interpreter_speed._get_np_dtype  # installed (the suite's state)
    assert (tl.semantic.TritonSemantic.binary_op_sanitize_overflow_impl  # the kernel's uint32 sums: checked, then not
            is interpreter_speed._sanitize_overflow)
    shape = tl.core.tuple_type([tl.float32, tl.core.constexpr_type(4)], ["a", "b"])
    assert shape.name == str(shape) == "[a:fp32,b:constexpr_type[4]]"
    assert shape == tl.core.tuple_type([tl.float32, tl.core.constexpr_type(4)], ["a", "b"])


@triton.jit
def _compose(a0, b0, a1, b1):  # x -> a0 x + b0 after x -> a1 x + b1's left neighbour: associative, not commutative
    return a0 * a1, a0 * b1 + b0


@triton.jit
def _reduce_kernel(A, B, OUT_A, OUT_B, R: tl.constexpr, C: tl.constexpr, N: tl.constexpr, AXIS: tl.constexpr,
                   KEEP: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    a, b = tl.reduce((tl.load(A + offs), tl.load(B + offs)), AXIS, _compose, keep_dims=KEEP)
    tl.store(OUT_A + tl.arange(0, N), tl.reshape(a, [N]))
    tl.store(OUT_B + tl.arange(0, N), tl.reshape(b, [N]))


@pytest.mark.skipif(not common.interpreting(), reason="the speed-ups are the interpreter's")
@pytest.mark.parametrize("axis, keep", [(0, False), (0, True), (1, False), (1, True)])
def test_tree_reduction_gives_the_folds_answer(axis, keep):
    """The tree ``tl.reduce`` against the interpreter's own left fold, on a combine function
    whose answer is exact and depends on the order (composition of integer affine maps):
    equal; and both are the composition computed here."""
    from triton.runtime import interpreter

    R, C = 8, 16
    a = torch.randint(0, 2, (R, C), dtype=torch.int32) * 2 - 1  # +-1: no overflow
    b = torch.randint(-3, 4, (R, C), dtype=torch.int32)
    n = C if axis == 0 else R
    outs = []
    try:
        for install in (False, True):
            (interpreter_speed.install if install else interpreter_speed.uninstall)()
            out = [torch.full((n,), -99, dtype=torch.int32) for _ in range(2)]
            _reduce_kernel[(1,)](a, b, *out, R=R, C=C, N=n, AXIS=axis, KEEP=keep)
            outs.append(out)
    finally:
        interpreter_speed.install()
    assert interpreter.ReduceOps.generic_reduce is interpreter_speed._generic_reduce  # installed (the suite's state)

    def fold(pa, pb):
        ca, cb = pa[0], pb[0]
        for x, y in zip(pa[1:], pb[1:]):
            ca, cb = ca * x, ca * y + cb
        return ca, cb

    seqs = [(a[:, j], b[:, j]) for j in range(C)] if axis == 0 else [(a[i], b[i]) for i in range(R)]
    expected = [torch.stack([torch.as_tensor(fold(pa.tolist(), pb.tolist())[k]) for pa, pb in seqs]).int() for k in (0, 1)]
    for out in outs:
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


_NUMPY_SCALARS = """
import sys, warnings
import torch, triton, triton.language as tl
from triton.runtime.errors import InterpreterError
import interpreter_numpy

@triton.jit
def strided_sums(X, OUT, n, step):  # runtime loop bounds: the interpreter reads them as Python ints
    pid = tl.program_id(0)
    acc = 0.0
    for i in tl.range(pid, n, step):
        acc += tl.load(X + i)
    tl.store(OUT + pid, acc)

x = torch.randn(10, dtype=torch.float64)
out = torch.full((3,), float("nan"), dtype=torch.float64)
interpreter_numpy.strict()
interpreter_numpy.uninstall()
try:
    strided_sums[(3,)](x, out, 10, 3)
    raised = ""
except InterpreterError as e:
    raised = str(e)
interpreter_numpy.install()
strided_sums[(3,)](x, out, 10, 3)
assert torch.equal(out, torch.stack([x[i::3].sum() for i in range(3)])), (out, x)
print(raised)
"""


def test_interpreter_reads_scalar_loop_bounds_on_every_numpy():
    """Triton 3.6's interpreter converts a scalar loop bound (a one-element 1-d array) with
    int(), which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"; numpy 1.25-2.3 warn, an error under interpreter_numpy.strict()): the distributed
    tests' ranks failed so on the GPU machine (numpy 2.5). With interpreter_numpy installed the
    loop runs, on this machine's numpy (a fresh interpreted process, also on a GPU machine)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _NUMPY_SCALARS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    # without it, the same loop fails: what the ranks hit
    assert "0-dimensional arrays" in proc.stdout or "Conversion of an array with ndim > 0" in proc.stdout


def test_allocations_tell_descriptor_scratch_from_buffers(monkeypatch):
    """Triton's launcher allocates the scratch of device-side descriptors through
    common._scratch (on a GPU only): Allocations marks those records, buffers() leaves them
    out, and every other allocation, however large, stays in."""
    from memory_testing import Allocations

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # common._scratch's device, here
    with Allocations() as rec:
        common._scratch(45056, 128, None)
        big = torch.empty(8, 2, 64, 64, dtype=torch.float16)
    assert [(a.shape, a.dtype, a.scratch) for a in rec.records] == [
        ((45056,), torch.int8, True), (tuple(big.shape), torch.float16, False)]
    assert rec.buffers() == rec.records[1:]
    assert len(rec.with_numel_at_least(45056)) == 2


def test_tf32_truncation_and_fma_chain_emulations():
    x = np.array([1.0 + 3 * 2.0**-11, -(1.0 + 2.0**-11), 2.0**-130 * 3, np.inf, np.nan], dtype=np.float32)
    t = interpreter_hardware.truncate_to_tf32(x)
    assert t[:2].tolist() == [1.0 + 2.0**-10, -1.0] and t[2] == np.float32(2.0**-130 * 3) and t[3] == np.inf
    assert np.isnan(t[4])
    # One rounding per k, in k order: 1e8 + 1 rounds back to 1e8 in fp32, so the chain ends at 0.
    a = np.array([[1e8, 1.0, -1e8]], dtype=np.float32)
    b = np.ones((3, 2), dtype=np.float32)
    assert interpreter_hardware.fma_chain(a, b, np.zeros((1, 2), np.float32)).tolist() == [[0.0, 0.0]]
    reordered = np.array([[1e8, -1e8, 1.0]], dtype=np.float32)
    assert interpreter_hardware.fma_chain(reordered, b, np.zeros((1, 2), np.float32)).tolist() == [[1.0, 1.0]]
    batched = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    ref = np.matmul(batched.astype(np.float64), batched.transpose(0, 2, 1).astype(np.float64))
    out = interpreter_hardware.fma_chain(batched, batched.transpose(0, 2, 1).copy(), np.zeros((2, 4, 4), np.float32))
    assert out.dtype == np.float32 and np.abs(out - ref).max() < 1e-5


@triton.jit
def _raw_tf32_dot(X, Y, OUT, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm = tl.arange(0, M)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    x = tl.load(X + rm[:, None] * K + rk[None, :])
    y = tl.load(Y + rk[:, None] * N + rn[None, :])
    tl.store(OUT + rm[:, None] * N + rn[None, :], tl.dot(x, y, input_precision="tf32"))


def test_raw_fp32_operands_of_a_tf32_product_are_truncated(device):
    # What tests/interpreter_hardware.py emulates, and what common.to_tf32 corrects: a TF32
    # product fed raw fp32 operands uses them truncated toward zero. The operands' kept parts
    # (1 + j/8) make every product and sum exact in fp32; each operand also carries 0.75 of a
    # TF32 ulp (2^-10), which rounding would carry up and truncation drops. 64x64 outputs: a
    # wgmma on sm_90, as the GEMMs' tiles.
    g = torch.Generator().manual_seed(0)
    kept_x = 1.0 + torch.randint(0, 8, (64, 16), generator=g) / 8.0
    kept_y = 1.0 + torch.randint(0, 8, (16, 64), generator=g) / 8.0
    sign = torch.where(torch.rand(64, 16, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * (kept_x + 0.75 * 2.0**-10)).float().to(device)
    y = (kept_y + 0.75 * 2.0**-10).float().to(device)
    out = torch.empty(64, 64, device=device)
    _raw_tf32_dot[(1,)](x, y, out, M=64, K=16, N=64)
    assert torch.equal(out.cpu(), ((sign * kept_x) @ kept_y).float())
