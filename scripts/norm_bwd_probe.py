"""The add+LayerNorm and add+RMSNorm backward alone, side by side, in the variants a caller can
reach (issue 29, item 3: the RMSNorm backward measured at 61% of copy where LayerNorm's was at
97%, though both run the same kernel, ``kernels/norm.py: _add_norm_bwd_kernel``, with the same
config table, grid and partial-sum reduction; statically the RMSNorm variant is the lighter one
on sm_90: 232/128/64 registers and 471/265/177 loop instructions at 4/8/16 warps, against
LayerNorm's 230/123/100 and 676/395/241).

For each op at 16384 x 4096 bf16: the gradient arriving on residual_out or not (the bench's
``(out, residual_out)`` step, or out's alone), a bf16 or fp32 weight; the backward timed alone
(``torch.autograd.grad`` with the graph retained, ``do_bench`` medians, L2 flushed) as GB/s
by counted bytes (read dout, residual_out, the incoming residual gradient when there is one;
write dx) against the copy ceiling. With ``FUSED_BLOCK_PRINT_TUNING=1`` each key's candidate
timings are printed when first tuned. Run on a GPU: ``python scripts/norm_bwd_probe.py``
(about a minute, most of it Triton compiles).

Then the forward and backward as a training step, both ways a caller writes one: with
``torch.autograd.grad`` (the bench's step), and with ``.backward()`` into ``.grad`` kept from
step to step (then torch adds an ``add_`` per input to accumulate, about two extra passes over
(M, N) bf16 at this shape, ~0.19 ms at copy speed): a probe that stepped one op each way would
see the RMSNorm backward at twice LayerNorm's, as the 2026-12-04 probe did (its script is lost;
this is the one mechanism the static analysis found that fits the gap's size).
"""
import torch
from triton.testing import do_bench

import fused_block

M, N = 16384, 4096
DT = torch.bfloat16


def _copy_gbps():
    src = torch.empty(M * N * 4, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def _case(op, with_residual_grad, weight_dtype):
    x = torch.randn(M, N, device="cuda", dtype=DT, requires_grad=True)
    r = torch.randn(M, N, device="cuda", dtype=DT, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=weight_dtype, requires_grad=True)
    if op == "layer":
        b = torch.randn(N, device="cuda", dtype=weight_dtype, requires_grad=True)
        out, res = fused_block.add_layer_norm(x, r, w, b)
        params = (x, r, w, b)
    else:
        out, res = fused_block.add_rms_norm(x, r, w, 1e-6)
        params = (x, r, w)
    g = torch.randn_like(out)
    outs, grads = ((out, res), (g, torch.randn_like(res))) if with_residual_grad else ((out,), (g,))
    ms = do_bench(lambda: torch.autograd.grad(outs, params, grads, retain_graph=True), warmup=25, rep=100,
                  return_mode="median")
    tensors = 4 if with_residual_grad else 3  # read dout, h (and the residual gradient); write dx
    return ms, tensors * M * N * 2 / ms / 1e6


def _step(op, accumulate):
    x = torch.randn(M, N, device="cuda", dtype=DT, requires_grad=True)
    r = torch.randn(M, N, device="cuda", dtype=DT, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=DT, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=DT, requires_grad=True)
    params = (x, r, w, b) if op == "layer" else (x, r, w)
    g, g2 = torch.randn_like(x), torch.randn_like(x)

    def fwd():
        if op == "layer":
            return fused_block.add_layer_norm(x, r, w, b)
        return fused_block.add_rms_norm(x, r, w, 1e-6)

    def step():
        outs = fwd()
        if accumulate:
            torch.autograd.backward(outs, (g, g2))
        else:
            torch.autograd.grad(outs, params, (g, g2))

    return do_bench(step, warmup=25, rep=100, return_mode="median")


def main():
    copy = _copy_gbps()
    print(f"copy ceiling {copy:.0f} GB/s")
    for op in ("layer", "rms"):
        for with_res in (True, False):
            for wdt in (DT, torch.float32):
                ms, gbps = _case(op, with_res, wdt)
                print(f"add_{op}_norm bwd {M}x{N} bf16 residual_grad={with_res} weight={wdt}: {ms * 1e3:.1f} us, "
                      f"{gbps:.0f} GB/s = {100 * gbps / copy:.0f}% of copy")
    for op in ("layer", "rms"):
        for accumulate in (False, True):
            how = ".backward() into kept .grad" if accumulate else "autograd.grad"
            print(f"add_{op}_norm fwd+bwd step {M}x{N} bf16, {how}: {_step(op, accumulate) * 1e3:.1f} us")


if __name__ == "__main__":
    main()
