"""pallas_attn: exact FlashAttention for JAX, as Pallas Mosaic GPU kernels with a portable path."""

from pallas_attn.api import attention
from pallas_attn.mask import MaskSpec
from pallas_attn.reference import reference_attention

__all__ = ["attention", "MaskSpec", "reference_attention"]
__version__ = "0.1.0"
