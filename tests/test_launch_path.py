"""The launch path of the layers: kernels per training step, host-only runs, seeds, mask reads.

Kernel counts come from ``fused_block.profiling.count_kernels`` (Triton launches plus PyTorch
ops that launch a device kernel) over one training step: forward, then the gradients of the
input and of every parameter. The steps run inside ``_backend.host_only()`` (kernels skipped:
the count does not depend on the kernels' results) on CPU, except where a test compares that
with a real run; on CUDA the steps run for real. Shapes are tiny (head dim 16, the kernel's smallest) because nothing here depends on
them and real runs go through the interpreter.
"""
import contextlib

import pytest
import torch
from torch import nn

import fused_block
from fused_block import _backend, blocks, profiling
from fused_block.kernels import common

D, H, FF, B, L = 32, 2, 128, 2, 8

# Kernels per training step (bf16, GELU, no mask) measured on this branch; the target
# is 26 for Pre-LN (Triton + PyTorch). Pre-LN at dropout 0 is 24, all Triton: 12 GEMMs, 3 bias
# gradient reductions, 2 norm forwards, 2 norm backwards and their 2 dweight/dbias reductions,
# 3 attention kernels. x feeds norm1 and, as the residual, norm2: norm1 returns it as its
# second output and sums its two gradients in the kernel that writes dx (no PyTorch add).
# Dropout adds one draw of all the layer's seeds and, in Pre-LN, the FFN output dropout's
# gradient pass. Post-LN keeps one PyTorch add: the layer input x feeds the QKV GEMM and
# norm1's residual, and no norm backward sees both gradients (the other shared tensor, h, is
# norm1's output returned twice, its gradients summed in norm1's backward kernel).
MAX_KERNELS = {
    (True, 0.0): 24,
    (True, 0.1): 26,
    (False, 0.0): 25,
    (False, 0.1): 26,
}


@pytest.fixture(autouse=True)
def no_poison(monkeypatch):
    """The suite's NaN-filled outputs are fill kernels a real step does not launch."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", False)


def _step(norm_first, p, device, dtype=torch.bfloat16, **kwargs):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(D, H, FF, dropout=p, activation="gelu", batch_first=True,
                                     norm_first=norm_first)
    layer = fused_block.convert(ref).to(device=device, dtype=dtype)
    x = torch.randn(B, L, D, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    inputs = (x, *layer.parameters())
    return lambda: torch.autograd.grad(layer(x, **kwargs), inputs, dy)


def _stubbed(device):
    """Kernels skipped on CPU; real on CUDA, where host_only would leave untimed configs in
    the config caches for the rest of the process."""
    return _backend.host_only() if device.type == "cpu" else contextlib.nullcontext()


def _count(step, device, *, stub=True):
    if device.type == "cuda":
        step()  # a first call on CUDA times config candidates: count a steady step
    with _stubbed(device) if stub else contextlib.nullcontext():
        return profiling.count_kernels(step)


@pytest.mark.parametrize("norm_first, p", list(MAX_KERNELS))
def test_kernels_per_training_step(norm_first, p, device):
    counts = _count(_step(norm_first, p, device), device)
    assert counts.total <= MAX_KERNELS[norm_first, p], counts.table()
    assert counts.syncs == {}, counts.table()  # nothing in a step waits for the GPU
    assert counts.torch.get("randint", 0) == (p > 0), counts.table()  # the layer's seeds: one draw
    assert counts.triton["attention_fwd"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="host_only is the CPU measurement (kernels through the "
                    "interpreter otherwise); the CUDA run of test_kernels_per_training_step counts real steps")
def test_host_only_count_equals_real_count(device):
    """Stubbing the launches changes nothing but the kernels: same launches, same PyTorch ops."""
    stubbed = _count(_step(True, 0.1, device), device)
    real = _count(_step(True, 0.1, device), device, stub=False)
    assert (stubbed.triton, stubbed.torch) == (real.triton, real.torch)


def test_host_only_forces_the_kernel_path_and_restores():
    cpu = torch.empty(1)
    before = (_backend.use_triton(cpu), common.STUB_LAUNCHES)
    with pytest.raises(RuntimeError, match="inside"):
        with _backend.host_only():
            assert _backend.use_triton(cpu) and common.STUB_LAUNCHES
            raise RuntimeError("inside")
    assert (_backend.use_triton(cpu), common.STUB_LAUNCHES) == before


# ---------------------------------------------------------------------------------------------
# dropout seeds
# ---------------------------------------------------------------------------------------------

def test_dropout_seed_at_zero_draws_and_allocates_nothing(device):
    state = torch.random.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    a, b = _backend.dropout_seed(0.0, device), _backend.dropout_seed(0.0, device)
    after = torch.random.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    assert a is b and a.numel() == 0 and a.dtype == torch.int64 and a.device.type == device.type
    assert torch.equal(state, after)  # no random number consumed


def test_dropout_seed_at_zero_is_usable_after_inference_mode():
    """The cached empty seed is saved for backward: it must not be an inference tensor."""
    dev = torch.device("cpu")
    _backend._NO_SEED.pop(dev, None)
    with torch.inference_mode():
        seed = _backend.dropout_seed(0.0, dev)
    assert not seed.is_inference()


def test_seed_block_draws_once_and_hands_out_in_order(device):
    torch.manual_seed(3)
    with _backend.seed_block(3, device):
        seeds = [_backend.dropout_seed(0.1, device) for _ in range(3)]
        extra = _backend.dropout_seed(0.1, device)  # past the block: a draw of its own
    torch.manual_seed(3)
    drawn = torch.randint(0, 2**62, (3,), dtype=torch.int64, device=device)
    assert torch.equal(torch.cat(seeds), drawn) and all(t.shape == (1,) for t in seeds)
    assert extra.shape == (1,) and not any(torch.equal(extra, t) for t in seeds)
    counts = profiling.count_kernels(lambda: [_backend.dropout_seed(0.1, device) for _ in range(2)])
    assert counts.torch == {"randint": 2}  # outside a block, each seed is drawn


def test_seed_block_serves_a_device_named_without_its_index(monkeypatch):
    """A block drawn on cuda:0 (a tensor's device) serves ``dropout_seed(p, "cuda")``: they are
    one device, though ``torch.device("cuda") != torch.device("cuda:0")``. (CPU stand-ins for
    the values; the block is served without touching CUDA.)"""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    values = torch.arange(2, dtype=torch.int64).split(1)
    monkeypatch.setattr(_backend._LOCAL, "seeds", [values, 0, torch.device("cuda", 0)], raising=False)
    assert _backend.dropout_seed(0.1, torch.device("cuda")) is values[0]
    assert _backend.dropout_seed(0.1, "cuda:0") is values[1]


def test_seed_block_is_per_thread(device):
    import threading

    seen = []
    with _backend.seed_block(2, device):
        mine = _backend.dropout_seed(0.1, device)
        thread = threading.Thread(target=lambda: seen.append(_backend.dropout_seed(0.1, device)))
        thread.start()
        thread.join()
        second = _backend.dropout_seed(0.1, device)
    assert mine.data_ptr() + 8 == second.data_ptr()  # this thread got both values of its draw
    assert seen[0].shape == (1,) and seen[0].untyped_storage().data_ptr() != mine.untyped_storage().data_ptr()


def test_dropout_seed_is_drawn_from_torchs_generator(device):
    torch.manual_seed(1)
    a = _backend.dropout_seed(0.1, device)
    b = _backend.dropout_seed(0.1, device)
    torch.manual_seed(1)
    assert torch.equal(_backend.dropout_seed(0.1, device), a) and not torch.equal(a, b)
    assert a.shape == (1,) and a.dtype == torch.int64 and a.device.type == device.type


# ---------------------------------------------------------------------------------------------
# the counting rule
# ---------------------------------------------------------------------------------------------

def test_count_kernels_counts_compute_not_views_or_allocations():
    x = torch.randn(4, 6)

    def fn():
        v = x.t().reshape(-1).view(6, 4)  # views (reshape of a non-contiguous tensor: a copy)
        v.split(2)
        torch.empty(3)
        y = torch.zeros(3)  # a fill kernel
        y.add_(1)
        return (y.sum() + v.sum()).item()  # two sums, an add, and a sync

    c = profiling.count_kernels(fn)
    assert c.torch == {"clone": 1, "zeros": 1, "add_": 1, "sum": 2, "add": 1, "_local_scalar_dense": 1}, c.torch
    assert c.syncs == {"_local_scalar_dense": 1} and c.triton == {}
    assert c.total == 7 and "7 kernels" in c.table()


def test_copies_to_the_host_count_as_syncs():
    """A copy from device memory into host memory that waits for it (``.cpu()``, ``.tolist()``,
    ``copy_`` into a CPU tensor) is a synchronization; a ``non_blocking`` one, a copy to the
    device and a host-to-host copy are not. (A tensor that says it is on CUDA stands in for a
    device tensor on any machine.)"""
    class OnDevice(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    aten = torch.ops.aten
    dev = torch.Tensor._make_subclass(OnDevice, torch.zeros(3))
    host = torch.zeros(3)
    assert profiling._reads_to_host(aten._to_copy.default, (dev,), {"device": "cpu"}, host)
    assert not profiling._reads_to_host(aten._to_copy.default, (dev,), {"non_blocking": True}, host)
    assert not profiling._reads_to_host(aten._to_copy.default, (host,), {}, dev)  # to the device
    assert not profiling._reads_to_host(aten._to_copy.default, (host,), {}, host)
    assert profiling._reads_to_host(aten.copy_.default, (host, dev), {}, host)
    assert not profiling._reads_to_host(aten.copy_.default, (host, dev, True), {}, host)  # non_blocking
    assert not profiling._reads_to_host(aten.copy_.default, (dev, host), {}, dev)
    assert not profiling._reads_to_host(aten.add.Tensor, (dev, host), {}, host)


def test_count_kernels_counts_launches_not_markers():
    """A stubbed common.launch is a kernel of a real step; a name bumped in common.LAUNCHES
    without a launch (a launcher's path marker) is not."""
    def fn():
        common.launch("some_kernel", None, (1,), (), {}, common.Config.of())
        common.count_launch("some_path_marker")

    with _backend.host_only():
        c = profiling.count_kernels(fn)
    assert c.triton == {"some_kernel": 1} and c.torch == {}


# ---------------------------------------------------------------------------------------------
# masks: values read once per tensor, never inside a step that could be captured
# ---------------------------------------------------------------------------------------------

def test_causal_mask_values_are_read_once_per_tensor(device):
    torch.manual_seed(0)
    layer = fused_block.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True).to(device)
    x = torch.randn(B, L, D, device=device)
    mask = nn.Transformer.generate_square_subsequent_mask(L, device=device)
    with torch.no_grad(), _stubbed(device):
        layer(x, is_causal=True)  # on CUDA, config timing happens here
        blocks._VERDICTS.clear()
        first = profiling.count_kernels(layer, x, src_mask=mask)
        second = profiling.count_kernels(layer, x, src_mask=mask)  # same tensor: verdict cached
        mask.add_(0)  # an in-place change: read again
        third = profiling.count_kernels(layer, x, src_mask=mask)
        other = profiling.count_kernels(layer, x, src_mask=mask.clone())
    assert first.syncs == {"equal": 1} and second.syncs == {} and third.syncs == {"equal": 1}
    assert other.syncs == {"equal": 1}
    assert first.triton == second.triton == other.triton  # the causal kernel each time
    assert second.total < first.total


def test_mask_verdicts_are_not_read_during_capture(device, monkeypatch):
    """Where a CUDA graph is being captured no value may be read (a sync): unknown masks are
    general (the SDPA fallback, after its warning), known ones keep their verdict."""
    mask = nn.Transformer.generate_square_subsequent_mask(L, device=device)
    blocks._VERDICTS.clear()
    monkeypatch.setattr(blocks, "_capturing", lambda t: True)
    masks = blocks._resolve_masks(mask, None, False, B, H, L, L, torch.float32, ("src_mask", "kpm"))
    assert not masks.causal and masks.general is not None and "graph capture" in masks.reason
    kpm = torch.zeros(B, L, device=device)
    masks = blocks._resolve_masks(None, kpm, False, B, H, L, L, torch.float32, ("src_mask", "kpm"))
    assert masks.general is not None and "bool mask" in masks.reason
    monkeypatch.undo()
    blocks._resolve_masks(mask, kpm, False, B, H, L, L, torch.float32, ("src_mask", "kpm"))  # warm-up reads
    monkeypatch.setattr(blocks, "_capturing", lambda t: True)
    masks = blocks._resolve_masks(mask, kpm, False, B, H, L, L, torch.float32, ("src_mask", "kpm"))
    assert masks.causal and masks.general is None and masks.key_padding.dtype == torch.bool


# ---------------------------------------------------------------------------------------------
# config choice on CUDA (common.ConfigCache's timing branch, run on CPU with a stand-in do_bench)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def cuda_tuning(monkeypatch):
    """ConfigCache as on CUDA (timing on, no interpreter); ``times`` is what the stand-in
    ``do_bench`` reports per config, ``runs`` the configs it launched."""
    import triton.testing

    monkeypatch.setattr(common, "_INTERPRET", False)
    monkeypatch.setattr(common, "TUNE", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    state = {"times": {}, "runs": []}

    def do_bench(fn, warmup, rep):
        fn()
        cfg = state["runs"][-1]
        if isinstance(state["times"][cfg], Exception):
            raise state["times"][cfg]
        return state["times"][cfg]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    return state


def test_config_cache_times_candidates_once_and_keeps_the_fastest(cuda_tuning):
    from triton.runtime.errors import OutOfResources

    a, b, c = (common.Config.of(num_warps=w, BLOCK=64) for w in (4, 8, 2))
    cuda_tuning["times"] = {a: 2.0, b: 1.0, c: OutOfResources(300000, 232448, "shared memory")}
    cache = common.ConfigCache("test")

    def run(cfg):
        cuda_tuning["runs"].append(cfg)
        common.count_launch("test_kernel")

    before = common.LAUNCHES["test_kernel"]
    assert cache.get("k", [a, b, c], run) is b  # c does not fit: skipped
    assert common.LAUNCHES["test_kernel"] == before  # timing launches are not the caller's
    assert cache.get("k", [a, b, c], run) is b and len(cuda_tuning["runs"]) == 3  # chosen once


def test_config_cache_does_not_time_during_graph_capture(cuda_tuning, monkeypatch):
    """Timing synchronizes the device, which would invalidate a CUDA graph being captured: the
    first candidate serves the captured call, and the next eager call times them."""
    a, b = common.Config.of(num_warps=4), common.Config.of(num_warps=8)
    cuda_tuning["times"] = {a: 2.0, b: 1.0}
    cache = common.ConfigCache("test")
    run = cuda_tuning["runs"].append
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cache.get("k", [a, b], run) is a
    assert cuda_tuning["runs"] == [] and "k" not in cache.chosen
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert cache.get("k", [a, b], run) is b


def _cuda_branch_calls(dtype):
    """Every op forward and backward, on shapes that take each launcher's aligned (TMA on
    sm_90) and unaligned paths, with dropout, GQA and padding."""
    def r(*shape):
        return torch.randn(*shape).to(dtype).requires_grad_(True)

    def grads(out, *inputs):
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad([o.float().sum() for o in outs], inputs)

    for M, K, N in ((70, 64, 48), (5, 100, 36)):  # 16-byte aligned rows, and not
        x, w, b = r(M, K), r(N, K), r(N)
        grads(fused_block.linear(x, w, b, "gelu", residual=r(M, N), dropout_p=0.1), x, w, b)
        w1, b1, w2, b2 = r(2 * N, K), r(2 * N), r(K, 2 * N), r(K)
        grads(fused_block.mlp(x, w1, b1, w2, b2, "gelu", x, 0.1, 0.1), x, w1, b1, w2, b2)
        grads(fused_block.swiglu(x, w1, r(2 * N, K), w2, x), x, w1, w2)
        grads(fused_block.add_layer_norm(x, r(M, K), w[0], r(K), dropout_p=0.1), x)
        grads(fused_block.add_rms_norm(x, r(M, K), w[0]), x)
    if dtype != torch.float32:
        q, k, v = r(2, 4, 40, 256), r(2, 2, 70, 256), r(2, 2, 70, 256)
        grads(fused_block.attention(q, k, v, True, None, torch.rand(2, 70) < 0.3, 0.1), q, k, v)
    for D in (16, 72):
        q, k, v = r(2, 4, 40, D), r(2, 2, 70, D), r(2, 2, 70, D)
        grads(fused_block.attention(q, k, v, True, None, torch.rand(2, 70) < 0.3, 0.1), q, k, v)
        qkv = r(2, 33, 8 * D)
        grads(fused_block.attention_qkvpacked(qkv, 4, 2, True), qkv)
        q, k, inv_freq = r(2, 33, 4, D), r(2, 33, 2, D), 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
        grads(fused_block.rope(q, k, torch.arange(33)[None], inv_freq), q, k)
        grads(fused_block.rope_qkvpacked(qkv, 4, 2, None, inv_freq), qkv)
    # linear + cross-entropy: 2100 tokens (several chunks), vocabularies of one CE tile and of
    # two (1031 > 1024: the 4096-wide tile), with a bias; mean, and "none" (recomputed backward).
    for vocab, reduction in ((1000, "mean"), (1031, "none")):
        x, w, b = r(2100, 64), r(vocab, 64), r(vocab)
        target = torch.randint(0, vocab, (2100,))
        grads(fused_block.linear_cross_entropy(x, w, target, b, label_smoothing=0.1, softcap=5.0, reduction=reduction),
              x, w, b)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_branches_launch_with_every_argument(arch, dtype, monkeypatch):
    """The launchers' CUDA branches (this arch's config tables, every candidate, TMA choices,
    persistent grids; the warp-specialized candidates switched on, FUSED_BLOCK_WS=1) run on
    CPU tensors with the launches recorded: each one binds every parameter of its kernel
    exactly once and its grid is within CUDA's limits. (The interpreter's runs check only the
    arch-0 branches.)"""
    from triton.runtime import _allocation

    from fused_block.kernels import matmul, norm
    from fused_block.kernels.attention import launchers as attention

    launched = []
    gemms = []

    def record(name, kernel, grid, args, constexprs, config):
        names = kernel.arg_names
        keywords = {**constexprs, **config.meta()}
        positional = [n for n in names if n not in keywords]
        assert set(keywords) <= set(names), (name, set(keywords) - set(names))
        assert len(args) == len(positional), (name, len(args), positional)
        assert 0 < grid[0] < 2**31 and all(0 < g <= 65535 for g in grid[1:]), (name, grid)
        launched.append((name, keywords.get("USE_TMA")))
        if name == "matmul":
            gemms.append((keywords, config.num_warps, config.num_stages))

    def time_every_candidate(self, key, candidates, run):
        for cfg in candidates:
            run(cfg)
        return candidates[0]

    monkeypatch.setattr(_backend, "FORCE_TRITON", True)
    monkeypatch.setattr(common, "launch", record)
    monkeypatch.setattr(common, "arch", lambda device: arch)
    monkeypatch.setattr(common, "sm_count", lambda device: 132)
    monkeypatch.setattr(common, "_INTERPRET", False)
    monkeypatch.setattr(common, "TUNE", True)
    monkeypatch.setattr(common, "WARP_SPECIALIZE", True)
    monkeypatch.setattr(common.ConfigCache, "_fastest", time_every_candidate)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(matmul, "_smem_limit", lambda device: 232448 if arch == 90 else 166912)
    for cache in (matmul._CACHE, attention._FWD_CACHE, attention._BWD_CACHE, norm._FWD_CACHE, norm._BWD_CACHE):
        monkeypatch.setattr(cache, "chosen", {})
    allocator = _allocation._allocator.get()  # the CUDA branches set one for the descriptors
    try:
        _cuda_branch_calls(dtype)
    finally:
        _allocation._allocator.set(allocator)
    assert {"matmul", "act_grad", "bias_grad_reduce", "add_norm_fwd", "add_norm_bwd", "attention_fwd",
            "attention_bwd", "rope", "rope_qkvpacked", "lce_count", "lce_ce", "lce_colsum", "lce_sum",
            "lce_scale"} <= {name for name, _ in launched}
    # sm_90: descriptors where aligned (GEMMs: also pointers, for the unaligned rows; attention:
    # pointers for IEEE fp32); sm_80: pointers only.
    tma = {name: {t for n, t in launched if n == name} for name in ("matmul", "attention_fwd")}
    assert tma == ({"matmul": {True, False}, "attention_fwd": {dtype != torch.float32}} if arch == 90 else
                   {"matmul": {False}, "attention_fwd": {False}})
    # sm_90 GEMMs over unaligned rows run the tiles the compile check holds spill-free there:
    # pointer loads the fallback tile, one tile per loop trip; pointer stores the smallest tile.
    if arch == 90:
        kind = "16" if dtype != torch.float32 else common.fp32_precision()
        for kw, warps, stages in gemms:
            tile = (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], warps, stages, kw["EPI_SPLIT"])
            if not kw["USE_TMA"]:
                assert tile == matmul._FALLBACK_90_CFGS[kind] and not kw["FLATTEN"], (tile, kw)
            elif not kw["TMA_EPI"]:
                assert tile == matmul.CONFIGS[(90, kind, kw["DUAL"] == 1)][-1], (tile, kw)
            if kw["WARP_SPECIALIZE"]:  # its own tiles, on the unflattened tile loop
                assert tile in matmul.WS_CONFIGS[(90, kind)] and not kw["FLATTEN"], (tile, kw)
        # The warp-specialized candidates are timed for the eligible launches (16-bit here;
        # the default fp32 mode, IEEE, has none).
        assert any(kw["WARP_SPECIALIZE"] for kw, _, _ in gemms) == (dtype != torch.float32)


# ---------------------------------------------------------------------------------------------
# the host-time benchmark
# ---------------------------------------------------------------------------------------------

def test_host_benchmark_replays_products_with_their_backward():
    # The bf16 surcharge's recorder sees the products a step hands to cuBLAS, F.linear included
    # (a plain projection on cuBLAS runs as torch's own: dispatch.linear_on_torch), and replays
    # an F.linear with the backward its arguments' gradients ask for.
    from bench.specs import host

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)

    def step():
        torch.autograd.grad(torch.nn.functional.linear(torch.mm(x, w.t()) @ w, w).sum(), (x, w))
        with torch.no_grad():  # as inside an autograd Function's forward (the layer step's projections)
            torch.nn.functional.linear(x, w)

    calls = host._recorded_products(step)
    assert [name for _, name, _, _ in calls] == ["mm", "linear", "linear"]
    assert calls[1][2][0] == ("t", (4, 8), (8, 1), True)  # shape, strides, requires_grad
    assert [a[3] for a in calls[2][2]] == [False, False]  # recorded without autograd: no backward replayed
    calls = calls[:2]
    backward = []
    grad = torch.autograd.grad
    try:
        torch.autograd.grad = lambda out, need, g: backward.append(len(need)) or grad(out, need, g)
        assert all(us > 0 for us in host._replay_us(calls, (torch.float32,), reps=1, rounds=1))
    finally:
        torch.autograd.grad = grad
    assert backward and set(backward) == {2}  # x's and w's gradients, each replay


def test_host_gpu_probe_measures_every_configuration():
    # scripts/host_gpu_probe.py (the lease's host figure with real launches) runs end to end;
    # here on the CPU with the launches stubbed, its figures meaningless, its rows and table whole.
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "host_gpu_probe.py")
    spec = importlib.util.spec_from_file_location("host_gpu_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    with _backend.host_only():
        rows = probe.measure(torch.device("cpu"), rounds=1, per_round=1)
    from bench.specs import host

    assert [r["config"] for r in rows] == [host._name(*c) for c in host.CONFIGS]
    assert all(r["ours_cpu_us"] > 0 and r["torch_cpu_us"] > 0 and r["cpu_ratio"] > 0 for r in rows)
    assert all(r["ops_cpu_us"] > 0 and r["ops_cpu_ratio"] > 0 for r in rows)  # the layer step off, same rounds
    table = probe.format_rows(rows)
    assert all(r["config"] in table for r in rows)


def test_host_benchmark_reports_every_configuration():
    from bench.specs import host

    rows, profs = host.run(quick=True)
    assert [r["config"] for r in rows] == [host._name(*c) for c in host.CONFIGS]
    for r in rows:
        assert all(r[f"{m}_us"] > 0 for m in host.MODES) and r["kernels"].total > 0
        # A steady step: every Triton launch through the direct path, none left to Triton's.
        assert r["launch_paths"] == {"direct": sum(r["kernels"].triton.values())}, r["launch_paths"]
        assert r["outside_launch"] == []
    table = host.format_rows(rows)
    assert all(r["config"] in table for r in rows)
    assert all(r["fwd_us"] > 0 and r["fwd_nograd_us"] > 0 and r["torch_fwd_us"] > 0 for r in rows)
    forward = host.format_forward(rows)
    assert all(r["config"] in forward for r in rows)
    assert list(profs) == [r["config"] for r in rows]
    assert all(p.groups.get("fused_block/blocks.py", 0) > 0 for p in profs.values())
    breakdown = host.format_profiles(profs)
    assert "fused_block/blocks.py" in breakdown and "total (profiled)" in breakdown
