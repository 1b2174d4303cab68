"""The PyTorch kernels that would mean a fused op ran unfused, in ``fused_block.profiling``'s counts.

Launch counts prove that the kernels ran; these prove what did not run beside them: that a
SwiGLU FFN did not compute ``silu(gate) * up`` or its products with PyTorch ops, and that the
QKV tensor and its gradient were not split, copied or concatenated (RoPE and attention read
and write the packed tensor in place).
"""
from fused_block import profiling

UNFUSED = frozenset({"cat", "stack", "copy_", "clone", "silu", "silu_backward", "mul", "sigmoid",
                     "mm", "addmm", "bmm", "_softmax", "repeat_interleave", "index_select",
                     "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_flash_attention"})


def unfused(fn, *args, **kwargs):
    """Run ``fn`` once; the PyTorch kernels of ``UNFUSED`` it launched, by name, and all counts."""
    counts = profiling.count_kernels(fn, *args, **kwargs)
    return {name: n for name, n in counts.torch.items() if name in UNFUSED}, counts
