"""pallas_attn: exact FlashAttention for JAX, as Pallas Mosaic GPU kernels with a portable path."""

from pallas_attn.api import attention
from pallas_attn.flax_adapter import flax_attention_fn
from pallas_attn.mask import MaskSpec
from pallas_attn.reference import reference_attention

__all__ = ["attention", "flax_attention_fn", "MaskSpec", "reference_attention"]
__version__ = "0.1.0"
