"""The direct launch path (``fused_block.kernels.launch``) against Triton's own launch.

Both go through ``fused_block.kernels.fake_driver``: Triton's real ``JITFunction.run``
(binding, specialization, its kernel cache) and the direct path run on CPU tensors up to a
fake C launcher, which records each launch and checks every argument against the
specialization of the kernel it goes to. Tests here launch small ``JITFunction``s made in this
file (the suite's ``triton.jit`` makes interpreted functions) and compare what either path
launches: the same compiled kernel, grid, device, stream and arguments.
``test_replayed_training_steps_launch_what_triton_launches`` does the same for every launch of
real training steps, in a child process where the shipped kernels are ``JITFunction``s.
"""
import json
import pathlib

import pytest
import torch
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

import fuzzing
from fused_block.kernels import common, fake_driver, launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _scale(x_ptr, y_ptr, n, stride, scale, flag, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + i * stride, mask=i < n) * scale
    tl.store(y_ptr + i, y + flag if FLAG else y, mask=i < n)


def _scale_dns(x_ptr, y_ptr, n, stride, scale, flag, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i * stride, mask=i < n) * scale + flag, mask=i < n)


def _pair(ptrs, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(ptrs[1] + i, tl.load(ptrs[0] + i, mask=i < n), mask=i < n)


def _copy_tile(desc, y_ptr, BLOCK: tl.constexpr):
    tl.store(y_ptr + tl.arange(0, BLOCK), desc.load([0]))


SCALE = JITFunction(_scale)
COPY_TILE = JITFunction(_copy_tile)
SCALE_DNS = JITFunction(_scale_dns, do_not_specialize=["n", "stride"])  # the attention kernels' shape args
PAIR = JITFunction(_pair)
CFG = common.Config.of(num_warps=4, BLOCK=32)


@pytest.fixture
def fake():
    with fake_driver.installed() as f:
        yield f


def _args(x=None, n=64, stride=1, scale=2.0, flag=0):
    x = torch.randn(80) if x is None else x
    return (x, torch.empty(80), n, stride, scale, flag)


def _both(fake, kernel, args, constexprs=None, grid=(2,), config=CFG):
    """Launch through the direct path, then through Triton's ``kernel[grid]``: the two records."""
    constexprs = {"FLAG": True} if constexprs is None else constexprs
    first = len(fake.launches)
    launch.launch(kernel, grid, args, constexprs, config)
    kernel[grid](*args, **constexprs, **config.meta(), num_warps=config.num_warps, num_stages=config.num_stages)
    ours, theirs = fake.launches[first:]
    return ours, theirs


def _same(ours, theirs):
    assert ours.compiled is theirs.compiled
    assert (ours.grid, ours.device, ours.stream) == (theirs.grid, theirs.device, theirs.stream)
    assert len(ours.args) == len(theirs.args)
    for a, b in zip(ours.args, theirs.args):
        assert a is b if isinstance(a, torch.Tensor) else (type(a) is type(b) and a == b)


def _fallbacks():
    return launch.STATS["fallback"]


def test_direct_launch_launches_what_triton_launches(fake):
    args = _args()
    before = _fallbacks()
    first = _both(fake, SCALE, args)
    assert _fallbacks() == before + 1  # the first launch of a key is Triton's, remembered
    _same(*first)
    ours, theirs = _both(fake, SCALE, args)
    assert _fallbacks() == before + 1  # then direct
    _same(ours, theirs)
    assert ours.compiled is first[0].compiled and ours.grid == (2, 1, 1)
    # The C launcher receives every parameter, constexprs included (FLAG, BLOCK).
    assert ours.args[:6] == args and ours.args[6:] == (True, 32)


def test_a_misaligned_pointer_takes_another_kernel(fake):
    base = torch.randn(80)
    aligned, shifted = _both(fake, SCALE, _args(base))[0], _both(fake, SCALE, _args(base[1:]))[0]
    assert base.data_ptr() % 16 == 0 and base[1:].data_ptr() % 16 == 4
    assert aligned.compiled is not shifted.compiled
    divisible = ["tt.divisibility", 16]
    assert divisible in aligned.compiled.src.attrs[(0,)] and divisible not in shifted.compiled.src.attrs.get((0,), [])
    before = _fallbacks()
    for x, expect in ((base[1:], shifted), (base, aligned), (base[4:], aligned)):  # 16 bytes in: aligned
        _same(*_both(fake, SCALE, _args(x)))
        assert fake.launches[-1].compiled is expect.compiled
    assert _fallbacks() == before  # all direct: base[4:] is 16 bytes in, aligned as base


def test_a_repeated_tensor_that_stops_repeating_is_keyed_in_full(fake):
    """A layout made with one tensor in two places (a launcher's placeholder) keys that tensor
    once while it repeats; two tensors there, one misaligned, take the kernel for them."""
    base = torch.randn(80)
    together = _both(fake, SCALE, (base, base, 64, 1, 2.0, 0))[0]
    apart = _both(fake, SCALE, (base, base[1:], 64, 1, 2.0, 0))[0]
    assert together.compiled is not apart.compiled
    before = _fallbacks()
    for y, expect in ((base, together), (base[1:], apart), (torch.empty(80), together), (torch.empty(80), together)):
        _same(*_both(fake, SCALE, (base, y, 64, 1, 2.0, 0)))
        assert fake.launches[-1].compiled is expect.compiled
    assert _fallbacks() == before + 1  # the aligned pair's full key, once (the forms never equal)


def test_an_int_equal_to_one_takes_another_kernel(fake):
    kernels = {}
    for n in (64, 1, 5, 48, 1, 5):
        ours, theirs = _both(fake, SCALE, _args(n=n))
        _same(ours, theirs)
        kernels.setdefault(n, ours.compiled)
        assert ours.compiled is kernels[n]
    assert kernels[1].src.constants[(2,)] == 1 and kernels[1].src.signature["n"] == "constexpr"
    assert len({id(k) for k in kernels.values()}) == 4 - 1  # 64 and 48: one 16-divisible kernel
    assert kernels[64] is kernels[48] and kernels[5].src.signature["n"] == "i32"
    # do_not_specialize: Triton compiles n == 1 as any i32; the direct path runs that kernel.
    one, other = _both(fake, SCALE_DNS, _args(n=1))[0], _both(fake, SCALE_DNS, _args(n=5))[0]
    assert one.compiled is other.compiled and one.compiled.src.signature["n"] == "i32"


def test_host_tensor_descriptors_are_keyed_by_dtype_and_block(fake):
    """A host-side TensorDescriptor (the attention forward's TMA path) specializes on its dtype
    and block shape ("tensordesc<fp32[32]>"): another block shape is another kernel, another
    base tensor of the same kind the same one, launched directly."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [block])

    x, y = torch.randn(64), torch.empty(64)
    cfg = common.Config.of(num_warps=4)
    first = _both(fake, COPY_TILE, (desc(x, 32), y), {"BLOCK": 32}, config=cfg)[0]
    before = _fallbacks()
    ours, theirs = _both(fake, COPY_TILE, (desc(torch.randn(64), 32), y), {"BLOCK": 32}, config=cfg)
    assert _fallbacks() == before and ours.compiled is first.compiled is theirs.compiled
    other = _both(fake, COPY_TILE, (desc(x, 16), y), {"BLOCK": 16}, config=cfg)[0]
    assert other.compiled is not first.compiled
    halfs = _both(fake, COPY_TILE, (desc(x.half(), 32), y), {"BLOCK": 32}, config=cfg)[0]
    assert halfs.compiled is not first.compiled


def test_a_bool_where_an_int_was_is_another_kernel(fake):
    as_int, as_bool = _both(fake, SCALE, _args(flag=1))[0], _both(fake, SCALE, _args(flag=True))[0]
    assert as_int.compiled is not as_bool.compiled  # constexpr 1 vs u1, though True == 1
    assert as_bool.compiled.src.signature["flag"] == "u1"
    _same(*_both(fake, SCALE, _args(flag=True)))
    _same(*_both(fake, SCALE, _args(flag=1)))


def test_a_reused_constexpr_dict_with_other_argument_types(fake):
    """A launcher's constexpr dict finds its layout by identity (no look at the argument types
    first): arguments of other types through the same dict (the flag an int, a bool or a float;
    a Parameter or a misaligned view where a tensor was) still run the kernel Triton runs."""
    constexprs = {"FLAG": True}
    base = torch.randn(80)
    kernels = set()
    for flag in (1, True, 2.5, 1, False, 0, 2.5):
        ours, theirs = _both(fake, SCALE, _args(base, flag=flag), constexprs)
        _same(ours, theirs)
        kernels.add(id(ours.compiled))
    assert len(kernels) == 4  # 1: the constant 1; True and False: u1; 2.5: fp32; 0: i32
    for x in (torch.nn.Parameter(torch.randn(80)), base[1:], base):
        _same(*_both(fake, SCALE, _args(x), constexprs))


INTS = st.sampled_from([1, 17, 16, 0, 2, 33, 48, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, -2**31 - 1, 2**40])
# One field of the previous launch's arguments changed at a time: n, stride, the pointer's
# offset (elements), its dtype, the flag (an int, a bool or a float), the constexpr.
CHANGES = st.lists(st.one_of(st.tuples(st.just(0), INTS), st.tuples(st.just(1), INTS),
                             st.tuples(st.just(2), st.sampled_from([0, 1, 2, 4, 8])),
                             st.tuples(st.just(3), st.sampled_from([torch.float32, torch.bfloat16])),
                             st.tuples(st.just(4), st.sampled_from([0, 1, 3, 16, True, False, 2.5])),
                             st.tuples(st.just(5), st.booleans())), min_size=4, max_size=16)


@fuzzing.settings_for(60)
@given(changes=CHANGES, exact_keys=st.sampled_from([1, 2, 16]), dns=st.booleans())
def test_fuzz_direct_launch_never_runs_another_specialization(changes, exact_keys, dns, monkeypatch):
    """Launches whose arguments change one at a time (ints around 1, 16-divisibility and the
    i32 range, pointer offsets, dtypes, an int, bool or float flag, a constexpr), with the
    exact-value keys and, after ``exact_keys`` of them, the class keys: each direct launch
    runs the kernel Triton runs for the same arguments, and the fake launcher finds every
    argument specialized as that kernel assumes."""
    monkeypatch.setattr(launch, "EXACT_KEYS", exact_keys)
    kernel = SCALE_DNS if dns else SCALE
    call = [64, 1, 0, torch.float32, 0, True]
    dicts = {flag: {"FLAG": flag} for flag in (True, False)}  # one per value, as the launchers keep them
    with fake_driver.installed() as fake:
        for field, value in changes:
            call[field] = value
            n, stride, offset, dtype, flag, constexpr = call
            x = torch.randn(80).to(dtype)[offset:]
            _same(*_both(fake, kernel, _args(x, n, stride, 0.5, flag), dicts[constexpr]))


def test_class_keys_after_many_exact_ones(fake, monkeypatch):
    monkeypatch.setattr(launch, "EXACT_KEYS", 2)
    for n in (64, 80, 96):  # the third key switches the layout to int classes
        _same(*_both(fake, SCALE, _args(n=n)))
    before = _fallbacks()
    for n in (112, 128, 17, 33, 19):  # 16-divisible as 64; 17 and 33: low bits 1 (not 1 itself)
        _same(*_both(fake, SCALE, _args(n=n)))
    assert _fallbacks() == before + 2  # Triton's lookups: one for 17 (33 shares its class), one for 19
    ones = _both(fake, SCALE, _args(n=1))
    _same(*ones)
    assert ones[0].compiled.src.constants[(2,)] == 1


def test_the_current_device_and_stream(fake):
    args = _args()
    fake.set_stream(0x51)
    first = _both(fake, SCALE, args)
    assert first[0].stream == 0x51
    fake.set_stream(0x77)
    ours, theirs = _both(fake, SCALE, args)
    _same(ours, theirs)
    assert ours.stream == 0x77 and ours.compiled is first[0].compiled
    fake.set_device(1)  # Triton compiles per device; the direct path keys on it
    on_1 = _both(fake, SCALE, args)
    _same(*on_1)
    assert on_1[0].device == "fake1" and on_1[0].compiled is not ours.compiled and on_1[0].stream == 0
    fake.set_device(0)
    back = _both(fake, SCALE, args)
    _same(*back)
    assert back[0].compiled is ours.compiled and back[0].stream == 0x77


def _unkeyed_launch(fake, kernel, args, constexprs=None, grid=(2,)):
    before = launch.STATS["unkeyed"]
    launch.launch(kernel, grid, args, {"FLAG": True} if constexprs is None else constexprs, CFG)
    assert launch.STATS["unkeyed"] == before + 1
    return fake.launches[-1]


def test_hooks_and_debug_take_tritons_path(fake, monkeypatch):
    args = _args()
    _both(fake, SCALE, args)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        record = _unkeyed_launch(fake, SCALE, args)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert len(seen) == 1 and seen[0].get()["name"] == "_scale"  # Triton's launch metadata, to the hook
    monkeypatch.setattr(knobs.runtime, "debug", True)
    debug = _unkeyed_launch(fake, SCALE, args)
    assert debug.compiled.options["debug"] and not record.compiled.options["debug"]
    monkeypatch.setattr(knobs.runtime, "debug", False)
    ours, theirs = _both(fake, SCALE, args)
    assert ours.compiled is record.compiled  # the non-debug kernel again, directly
    hooked = JITFunction(_scale)
    hooked.add_pre_run_hook(lambda *a, **k: seen.append("pre-run"))
    _unkeyed_launch(fake, hooked, args)
    assert seen[-1] == "pre-run"


def test_calls_the_key_cannot_describe_take_tritons_path(fake):
    args = _args()
    by_function = _unkeyed_launch(fake, SCALE, args, grid=lambda meta: (2,))  # a callable grid
    assert by_function.grid == (2, 1, 1) and by_function.compiled is _both(fake, SCALE, args)[1].compiled
    x, y = torch.randn(32), torch.empty(32)
    record = _unkeyed_launch(fake, PAIR, ((x, y), 32), {})  # a tuple argument
    assert record.compiled.src.signature["ptrs"] == ("*fp32", "*fp32")
    record = _unkeyed_launch(fake, SCALE, args[:5], {"flag": 0, "FLAG": True})  # a runtime argument by keyword
    assert record.args[5] == 0


def test_the_fake_launcher_rejects_arguments_of_another_specialization(fake, monkeypatch):
    """The double's check is what the tests above rely on: a key without the address bits
    launches the aligned kernel with a misaligned pointer, and the fake launcher says so."""
    base = torch.randn(80)
    monkeypatch.setattr(launch, "_key_function", lambda types, exact_ints, same=(): lambda args, device: (device,))
    launch.launch(SCALE, (2,), _args(base), {"FLAG": True}, CFG)
    with pytest.raises(fake_driver.SpecializationMismatch, match="x_ptr is not 16-divisible"):
        launch.launch(SCALE, (2,), _args(base[1:]), {"FLAG": True}, CFG)
    compiled = SCALE[(2,)](*_args(n=1), FLAG=True, BLOCK=32)  # n specialized as the constant 1
    with pytest.raises(fake_driver.SpecializationMismatch, match="n=5, compiled for 1"):
        compiled[(2, 1, 1)](*_args(n=5), True, 32)


def test_common_launch_takes_the_direct_path_unless_disabled(fake, monkeypatch):
    monkeypatch.setattr(common, "_INTERPRET", False)
    args = _args()
    before = _fallbacks()
    common.launch("scale", SCALE, (2,), args, {"FLAG": True}, CFG)
    common.launch("scale", SCALE, (2,), args, {"FLAG": True}, CFG)
    assert _fallbacks() == before + 1 and len(fake.launches) == 2
    monkeypatch.setattr(launch, "ENABLED", False)  # FUSED_BLOCK_DIRECT_LAUNCH=0
    monkeypatch.setattr(launch, "launch", None)
    common.launch("scale", SCALE, (2,), args, {"FLAG": True}, CFG)
    assert len(fake.launches) == 3 and fake.launches[-1].compiled is fake.launches[0].compiled


@pytest.mark.skipif(not common.interpreting(), reason="the interpreter runs only without a GPU")
def test_the_interpreter_does_not_take_the_direct_path(monkeypatch):
    import fused_block

    monkeypatch.setattr(launch, "launch", None)  # would raise if called
    x = torch.randn(4, 32)
    out, _ = fused_block.add_layer_norm(x, None, torch.ones(32), torch.zeros(32))
    assert torch.isfinite(out).all()


def test_installed_restores_triton():
    before = driver._active, JITFunction._do_compile
    with fake_driver.installed() as fake:
        _both(fake, SCALE, _args())
        assert driver.active is fake and "fake0" in SCALE.device_caches and launch._LAYOUTS
    assert (driver._active, JITFunction._do_compile) == before
    assert not any(isinstance(d, str) for d in SCALE.device_caches) and not launch._LAYOUTS


def test_replayed_training_steps_launch_what_triton_launches(tmp_path):
    """Every launch of Pre-LN, Post-LN, LLaMA and decoder training steps, on the launchers'
    interpreter configs and on their sm_90 branches, made both ways (``tests/launch_replay.py``)."""
    out = tmp_path / "replay.json"
    proc = fake_driver.run_without_interpreter([str(ROOT / "tests" / "launch_replay.py"), str(out)], cwd=ROOT,
                                               env={"FUSED_BLOCK_TUNE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    kernels = {"_gemm_kernel", "_act_grad_kernel", "_reduce_kernel", "_add_norm_fwd_kernel", "_add_norm_bwd_kernel",
               "_reduce_partials_kernel", "_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd", "_rope_packed_kernel"}
    for arch, r in result.items():
        assert set(r["compared"]) == kernels, (arch, r["compared"])
        assert r["mismatches"] == [], (arch, r["mismatches"])
        assert r["not_direct"] == {}, (arch, r["not_direct"])  # later steps: all direct
        assert r["specializations"] > len(kernels)
