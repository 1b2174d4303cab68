"""Pure Triton kernels and their launchers (no autograd), installed as ``fused_block.kernels``.

- ``norm``: residual add + dropout + LayerNorm/RMSNorm, forward and backward.
- ``attention``: FlashAttention-style fused softmax attention, forward and backward.
- ``matmul``: GEMM with a fused bias + activation + residual epilogue.
- ``rope``: rotary position embeddings, forward and backward.
- ``loss``: the chunked linear + cross-entropy (online log-sum-exp, dW/db accumulation).
- ``common``: the interpreter switch, the dot helper and launch accounting.
- ``aot``: ahead-of-time compilation of every shipped config for sm_80/sm_90.
"""
