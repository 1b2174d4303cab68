"""fused-block: Triton kernels for the Transformer block, and their PyTorch layer."""
from fused_block.norm import LayerNorm, RMSNorm, add_layer_norm, add_rms_norm  # noqa: F401
from fused_block.linear import MLP, Linear, geglu, linear, mlp, swiglu  # noqa: F401
from fused_block.convert import TransformerDecoderLayer, TransformerEncoderLayer, convert  # noqa: F401
from fused_block.blocks import MultiheadAttention  # noqa: F401
from fused_block.attention import (attention, attention_qkvpacked, attention_varlen,  # noqa: F401
                                   attention_varlen_qkvpacked, kv_cache_append)
from fused_block.rope import rope, rope_qkvpacked  # noqa: F401
from fused_block.loss import LinearCrossEntropy, linear_cross_entropy  # noqa: F401
from fused_block._attn_sdpa import choices as attention_choices  # noqa: F401
from fused_block.norm import choices as norm_choices  # noqa: F401
from fused_block.dispatch import table as dispatch_table  # noqa: F401
