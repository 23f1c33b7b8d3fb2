"""pallas_attn: exact FlashAttention for JAX, as Pallas Mosaic GPU kernels with a portable path."""

from pallas_attn import zigzag
from pallas_attn.api import attention
from pallas_attn.flax_adapter import flax_attention_fn
from pallas_attn.mask import MaskSpec
from pallas_attn.reference import reference_attention
from pallas_attn.ring import ring_attention
from pallas_attn.score_mods import ScoreArrays
from pallas_attn.score_mods import ScoreMods
from pallas_attn.varlen import varlen_attention

__all__ = ["attention", "flax_attention_fn", "MaskSpec", "reference_attention", "ring_attention",
           "ScoreArrays", "ScoreMods", "varlen_attention", "zigzag"]
__version__ = "0.1.0"
