"""How much of the score matrix a masked shape leaves visible, and how many tiles pallas_attn skips.

Both numbers are exact and computed on the host from the shape alone:
- `visible_fraction`: visible (query, key) pairs / (seq_q x seq_kv), counted row by row (each
  query sees one contiguous run of keys: the window, cut to its document).
- `skipped_block_fraction`: the tiles of a [seq_q / block_q, seq_kv / block_kv] grid that a kernel
  never computes / all tiles. Tiles outside `mask.kv_block_range` (causal, window) are skipped by
  every pallas_attn path; tiles whose documents cannot meet (`mask.segment_blocks_meet`) by both
  pallas_attn paths (blocked_jax in its loops; the Mosaic GPU kernels through their block tables,
  `mosaic_gpu.block_table`, per warpgroup tile of block_q rows; tests/test_mosaic_gpu_skip.py
  checks that the two counts agree).
The FLOPs a row is credited with stay the dense causal count (timing.attention_flops), so the
skipped work shows up as a higher TFLOP/s; these fractions say how much of it is skipping.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from pallas_attn import blocked_jax
from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import config as mosaic_config
from benchmarks.shapes import Shape


def mask_spec(shape: Shape) -> mask_lib.MaskSpec:
  """The shape's causal flag and window as pallas_attn sees them (top-left alignment)."""
  window = None if shape.window is None else (shape.window, 0)
  return mask_lib.MaskSpec(is_causal=shape.causal, local_window=window)


def segment_ids(shape: Shape) -> np.ndarray | None:
  """int32 [batch, seq]: document ids 0, 0, ..., 1, 1, ... (segment_len tokens each), or None."""
  if shape.segment_len is None:
    return None
  ids = np.arange(shape.seq_q, dtype=np.int32) // shape.segment_len
  return np.broadcast_to(ids, (shape.batch, shape.seq_q))


@functools.cache
def visible_fraction(shape: Shape) -> float:
  """Visible (query, key) pairs / all pairs (the same in every batch element and head)."""
  spec = mask_spec(shape)
  q = np.arange(shape.seq_q, dtype=np.int64)
  lo = np.zeros_like(q) if spec.reach_back is None else np.maximum(q - spec.reach_back, 0)
  hi = (np.full_like(q, shape.seq_kv - 1) if spec.reach_ahead is None
        else np.minimum(q + spec.reach_ahead, shape.seq_kv - 1))
  if shape.segment_len is not None:  # cut to the query's own document
    start = q // shape.segment_len * shape.segment_len
    lo = np.maximum(lo, start)
    hi = np.minimum(hi, start + shape.segment_len - 1)
  return float(np.maximum(hi - lo + 1, 0).sum() / (shape.seq_q * shape.seq_kv))


@functools.cache
def skipped_block_fraction(shape: Shape, block_q: int, block_kv: int,
                           skip_segments: bool) -> float:
  """Tiles of the block_q x block_kv grid left out by the block ranges (and, with
  `skip_segments`, by the documents' block bounds) / all tiles."""
  num_q, num_kv = -(-shape.seq_q // block_q), -(-shape.seq_kv // block_kv)
  q_starts = jnp.arange(num_q) * block_q
  lo, hi = mask_lib.kv_block_range(mask_spec(shape), q_starts, block_q, block_kv, num_kv,
                                   shape.seq_kv)
  lo, hi = (np.broadcast_to(np.asarray(b), (num_q,))[:, None] for b in (lo, hi))  # may be scalars
  kv_blocks = np.arange(num_kv)[None, :]
  computed = (kv_blocks >= lo) & (kv_blocks < hi)
  ids = segment_ids(shape)
  if skip_segments and ids is not None:
    ids = jnp.asarray(ids[:1])  # the same documents in every batch element
    computed &= np.asarray(mask_lib.segment_blocks_meet(ids, ids, block_q, block_kv, num_q, num_kv))
  return float(1.0 - computed.sum() / computed.size)


def implementation_tiles(name: str, shape: Shape) -> tuple[int, int, bool] | None:
  """(block_q, block_kv, skips by segment) of a pallas_attn path's forward tiles; None for the
  other implementations (their tiling is not ours to know)."""
  if name in ("pallas_attn:mosaic_gpu", "pallas_attn:mosaic_gpu_mask_fn"):
    cfg = mosaic_config.forward_config(shape.head_dim)
    return cfg.block_q, cfg.block_kv, True
  if name == "pallas_attn:blocked_jax":
    return (*blocked_jax.default_blocks(shape.seq_q, shape.seq_kv), True)
  return None


def masking_fields(name: str, shape: Shape) -> dict:
  """The masked-path columns of a row: `visible_fraction`, `skipped_block_fraction` (pallas_attn's
  forward tiles; null for other implementations) and `dense_mask` (the masking is a boolean
  [1, 1, T, S] array: jax.nn and tokamax get packed documents that way, having no segment ids)."""
  tiles = implementation_tiles(name, shape)
  return {"visible_fraction": visible_fraction(shape),
          "skipped_block_fraction": (None if tiles is None
                                     else skipped_block_fraction(shape, *tiles)),
          "dense_mask": shape.segment_len is not None and not name.startswith("pallas_attn:")}
