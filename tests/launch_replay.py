"""Every launch of real training steps made both ways, Triton's and the direct path, compared.

Run by ``tests/test_direct_launch.py`` as ``python tests/launch_replay.py OUT.json`` in a
child process without the Triton interpreter (the shipped kernels are then ``JITFunction``s)
and with ``fused_block.kernels.fake_driver`` installed, checking every argument against the
specialization of the kernel it goes to. Each ``common.launch`` of a layer's training step
runs ``kernel[grid](...)`` (Triton's ``JITFunction.run``) and then the direct path
(``launch.launch``) on the same arguments; the two records the fake C launcher receives must
be the same compiled kernel, grid, device, stream and arguments. Steps run three times on
the launchers' interpreter configs (arch 0) and three times on their sm_90 branches (config
tables, TMA descriptors, persistent GEMMs, as ``test_cuda_branches_launch_with_every_argument``
runs them), on a stream that changes between steps. Writes, per architecture, the launches
compared by kernel name, the mismatches, and the launches of the later steps that the direct
path did not serve itself (these must be none: the first step filled its cache).
"""
import collections
import contextlib
import json
import sys

import torch

import fused_block
from fused_block import _backend
from fused_block.kernels import common, fake_driver, launch

D, H, FF, B, L = 32, 2, 64, 2, 8  # head dim 16, the kernel's smallest: nothing depends on sizes


def _layers():
    """Layers whose steps launch every kernel family: LayerNorm, GELU FFN and packed attention
    with dropout (Pre-LN and Post-LN), the LLaMA layer (RMSNorm, SwiGLU, RoPE, GQA, no bias),
    and a decoder's cross-attention (q, k, v views)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    yield "pre-LN dropout", fused_block.TransformerEncoderLayer(
        D, H, FF, 0.1, "gelu", batch_first=True, norm_first=True, dtype=dtype), False
    yield "post-LN", fused_block.TransformerEncoderLayer(
        D, H, FF, 0.0, "gelu", batch_first=True, norm_first=False, dtype=dtype), False
    yield "llama", fused_block.TransformerEncoderLayer(
        D, H, FF, 0.0, "swiglu", batch_first=True, norm_first=True, bias=False, norm="rms", num_kv_heads=1,
        rope=True, dtype=dtype), False
    yield "decoder", fused_block.TransformerDecoderLayer(D, H, FF, 0.1, "gelu", batch_first=True, dtype=dtype), True


def _step(layer, decoder):
    x = torch.randn(B, L, D, dtype=torch.bfloat16, requires_grad=True)
    mem = torch.randn(B, L + 3, D, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x, mem, tgt_is_causal=True, tgt_mask=None) if decoder else layer(x, is_causal=True)
    torch.autograd.grad(out, (x, *layer.parameters()), torch.randn_like(out))


def _same_args(a, b) -> bool:
    return len(a) == len(b) and all(
        x is y if isinstance(x, torch.Tensor) else (type(x) is type(y) and x == y) for x, y in zip(a, b))


def replay(fake, arch) -> dict:
    compared, mismatches, undirect = collections.Counter(), [], collections.Counter()
    direct_launch = launch.launch
    state = {"late": False}

    def both(kernel, grid, args, constexprs, config):
        first = len(fake.launches)
        kernel[grid](*args, **constexprs, **config.meta(), num_warps=config.num_warps,
                     num_stages=config.num_stages)
        stats = launch.STATS.copy()
        direct_launch(kernel, grid, args, constexprs, config)
        theirs, ours = fake.launches[first:]
        name = kernel.__name__
        compared[name] += 1
        if state["late"] and launch.STATS != stats:
            undirect[name] += 1
        problems = [what for what, same in (
            ("compiled kernel", ours.compiled is theirs.compiled), ("grid", ours.grid == theirs.grid),
            ("device", ours.device == theirs.device == fake.device),
            ("stream", ours.stream == theirs.stream == fake.get_current_stream(fake.device)),
            ("arguments", _same_args(ours.args, theirs.args))) if not same]
        if problems:
            mismatches.append(f"{name}: {', '.join(problems)} differ")
        fake.launches.clear()

    launch.launch = both
    try:
        branches = fake_driver.launcher_branches(arch) if arch else contextlib.nullcontext()
        with _backend.host_only(stub=False), branches:
            for _, layer, decoder in _layers():
                for i in range(3):
                    state["late"] = i > 0
                    fake.set_stream(0x7000 + i)  # a new current stream each step
                    _step(layer, decoder)
    finally:
        launch.launch = direct_launch
    return {"compared": dict(compared), "mismatches": mismatches, "not_direct": dict(undirect),
            "specializations": len(fake.compiled)}


def main(path) -> int:
    if common.interpreting() or common.TUNE:
        raise RuntimeError("run with TRITON_INTERPRET=0 and FUSED_BLOCK_TUNE=0")
    out = {}
    for arch in (0, 90):
        with fake_driver.installed(record=True, check=True) as fake:
            out[arch] = replay(fake, arch)
    with open(path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
