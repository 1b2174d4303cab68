"""fused-block: Triton kernels for the Transformer block, and their PyTorch layer."""
