"""What a query may see: the static mask description and the block ranges it implies.

Every implementation (reference, portable blocked path, Mosaic GPU kernels) asks the same two
questions of a `MaskSpec`: is key `j` visible from query `i` (`visible`), and which key blocks can hold
a visible key for a given query block (`kv_block_range`). Answering both here keeps the three paths
from drifting apart.

Semantics follow `jax.nn.dot_product_attention` (jax 0.11.2) exactly, plus an alignment offset:
- `offset`: query i sits on the diagonal at key i + offset. 0 is jax.nn's top-left alignment (no
  shift when the query and key lengths differ); kv_len - q_len is FlashAttention's bottom-right
  alignment (the last query sits on the last key), see `alignment_offset`.
- `is_causal`: query i sees key j iff j <= i + offset.
- `local_window = (left, right)`: query i sees key j iff
  i + offset - left <= j <= i + offset + right.
- `q_lengths[b]` / `kv_lengths[b]`: queries at or past q_lengths[b] and keys at or past
  kv_lengths[b] take no part. (The offset comes from the array lengths, not from these.)

Also here: per-block bounds of segment ids (packed sequences), which let the blocked path skip
tiles whose query and key segments cannot meet.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

CausalAlignment = Literal["top_left", "bottom_right"]
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def alignment_offset(alignment: CausalAlignment, q_len: int, kv_len: int) -> int:
  """The `MaskSpec.offset` of a causal alignment: 0 for "top_left" (jax.nn), kv_len - q_len for
  "bottom_right" (FlashAttention: query i sees key j iff j <= i + kv_len - q_len)."""
  if alignment not in CAUSAL_ALIGNMENTS:
    raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}; got {alignment!r}")
  return 0 if alignment == "top_left" else kv_len - q_len


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the mask (the per-batch lengths are traced arrays, passed separately)."""

  is_causal: bool = False
  local_window: tuple[int, int] | None = None
  offset: int = 0  # query i sits on the diagonal at key i + offset (see the module doc)

  def __post_init__(self):
    if self.local_window is not None:
      left, right = self.local_window
      if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative, got {self.local_window}")

  @property
  def left(self) -> int | None:
    """How far back a query sees (None: unbounded)."""
    return None if self.local_window is None else self.local_window[0]

  @property
  def right(self) -> int | None:
    """How far ahead a query sees (None: unbounded); causal caps it at 0."""
    right = None if self.local_window is None else self.local_window[1]
    if self.is_causal:
      right = 0 if right is None else min(right, 0)
    return right

  @property
  def is_banded(self) -> bool:
    """True when position alone (not lengths) can hide a key."""
    return self.left is not None or self.right is not None

  @property
  def reach_back(self) -> int | None:
    """Query i sees no key before i - reach_back (None: unbounded); the offset folded in."""
    return None if self.left is None else self.left - self.offset

  @property
  def reach_ahead(self) -> int | None:
    """Query i sees no key after i + reach_ahead (None: unbounded); the offset folded in."""
    return None if self.right is None else self.right + self.offset


def every_row_sees_a_key(spec: MaskSpec, q_len: int, kv_len: int) -> bool:
  """Whether the positional mask alone leaves every one of q_len query rows some key of kv_len.

  Row i sees the keys [i - reach_back, i + reach_ahead] within [0, kv_len): it is empty only
  when the band ends before key 0 (worst at i = 0) or starts after the last key (worst at
  i = q_len - 1); the band itself is never inverted (left, right >= 0)."""
  if kv_len < 1:
    return False
  ahead_ok = spec.reach_ahead is None or spec.reach_ahead >= 0
  back_ok = spec.reach_back is None or q_len - 1 - spec.reach_back <= kv_len - 1
  return ahead_ok and back_ok


def visible(spec: MaskSpec, q_pos: jax.Array, kv_pos: jax.Array,
            q_length=None, kv_length=None) -> jax.Array:
  """Whether the query at `q_pos` sees the key at `kv_pos` (broadcasting).

  `q_length` / `kv_length` are scalars or arrays broadcastable against the positions; None means
  no limit. Written with plain comparisons so it traces inside Pallas kernels too.
  """
  ok = None

  def both(a, b):
    return b if a is None else a & b

  if spec.reach_ahead is not None:
    ok = both(ok, kv_pos <= q_pos + spec.reach_ahead)
  if spec.reach_back is not None:
    ok = both(ok, kv_pos >= q_pos - spec.reach_back)
  if kv_length is not None:
    ok = both(ok, kv_pos < kv_length)
  if q_length is not None:
    ok = both(ok, q_pos < q_length)
  shape = jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(kv_pos), jnp.shape(ok) if ok is not None else ())
  if ok is None:
    return jnp.ones(shape, bool)
  # Inside kernels the positions are full tiles already, so no broadcast is emitted there.
  return ok if jnp.shape(ok) == shape else jnp.broadcast_to(ok, shape)


def _cdiv(x, m):
  return -((-x) // m)


def _block_range(own_start, own_block: int, other_block: int, num_other_blocks, reach_back,
                 reach_ahead, other_limit):
  """Blocks of the other axis that may hold a position visible from own positions
  [own_start, own_start + own_block), where other position o is visible from own position w iff
  w - reach_back <= o <= w + reach_ahead (None: unbounded) and o < other_limit."""
  lo, hi = 0, num_other_blocks
  if reach_back is not None:
    lo = jnp.maximum(own_start - reach_back, 0) // other_block
  if reach_ahead is not None:
    last = own_start + own_block - 1 + reach_ahead
    hi = jnp.minimum(hi, last // other_block + 1)
  if other_limit is not None:
    hi = jnp.minimum(hi, _cdiv(other_limit, other_block))
  return lo, jnp.maximum(hi, lo)


def _full_range(own_start, own_block: int, other_block: int, lo, hi, reach_back, reach_ahead,
                other_limit):
  """The sub-range [full_lo, full_hi) of [lo, hi) whose tiles need no element mask: every
  position in them is visible from every own position. Masked tiles sit only at the two ends."""
  full_lo, full_hi = lo, hi
  if reach_back is not None:
    # o >= w - reach_back for the largest w = own_start + own_block - 1.
    full_lo = jnp.maximum(full_lo, _cdiv(own_start + own_block - 1 - reach_back, other_block))
  if reach_ahead is not None:
    # o + other_block - 1 <= w + reach_ahead for the smallest w = own_start.
    full_hi = jnp.minimum(full_hi, (own_start + reach_ahead + 1) // other_block)
  if other_limit is not None:
    full_hi = jnp.minimum(full_hi, other_limit // other_block)
  full_lo = jnp.minimum(full_lo, hi)
  return full_lo, jnp.maximum(full_hi, full_lo)


def kv_block_range(spec: MaskSpec, q_start, block_q: int, block_kv: int, num_kv_blocks,
                   kv_length=None):
  """The half-open range [lo, hi) of key blocks that may hold a key visible from queries
  [q_start, q_start + block_q). Blocks outside it are skipped entirely (never loaded, never
  multiplied), forward and backward. Works on Python ints and traced int32 scalars alike.
  """
  return _block_range(q_start, block_q, block_kv, num_kv_blocks, spec.reach_back,
                      spec.reach_ahead, kv_length)


def kv_full_range(spec: MaskSpec, q_start, block_q: int, block_kv: int, lo, hi,
                  kv_length=None):
  """Within [lo, hi) from `kv_block_range`, the key blocks that need no element mask."""
  return _full_range(q_start, block_q, block_kv, lo, hi, spec.reach_back, spec.reach_ahead,
                     kv_length)


def q_block_range(spec: MaskSpec, kv_start, block_kv: int, block_q: int, num_q_blocks,
                  q_length=None):
  """The half-open range [lo, hi) of query blocks that may see a key in
  [kv_start, kv_start + block_kv): the transpose of `kv_block_range`, used by the dK/dV pass.
  (Query i sees key j iff j - reach_ahead <= i <= j + reach_back.)"""
  return _block_range(kv_start, block_kv, block_q, num_q_blocks, spec.reach_ahead,
                      spec.reach_back, q_length)


def q_full_range(spec: MaskSpec, kv_start, block_kv: int, block_q: int, lo, hi):
  """Within [lo, hi) from `q_block_range`, the query blocks whose tile with this key block needs
  no positional mask (key lengths are the caller's business: they concern the key tile itself)."""
  return _full_range(kv_start, block_kv, block_q, lo, hi, spec.reach_ahead, spec.reach_back,
                     None)


def blocks_visited(block_range, spec: MaskSpec, num_tiles: int, tile: int, other_block: int,
                   num_other_blocks: int) -> list[int]:
  """Blocks of the other axis each of `num_tiles` tiles of `tile` positions visits at full
  lengths (the positional mask alone), as Python ints: `block_range` is `kv_block_range` for
  query tiles, `q_block_range` for key tiles. (Callable while a caller is traced.)"""
  with jax.ensure_compile_time_eval():
    lo, hi = block_range(spec, np.arange(num_tiles) * tile, tile, other_block, num_other_blocks)
  return [int(n) for n in np.broadcast_to(np.asarray(hi) - np.asarray(lo), (num_tiles,))]


def round_up(x: int, multiple: int) -> int:
  return (x + multiple - 1) // multiple * multiple


def pad_to_tiles(query, key, value, q_lengths, kv_lengths, q_multiple: int, kv_multiple: int,
                 min_kv_len: int = 0):
  """Pad the sequence axes of [batch, seq, heads, head_dim] inputs to whole tiles (the keys to at
  least `min_kv_len`).

  Returns the padded query, key and value and int32 [batch] lengths, defaulted to and clamped at
  the real lengths, so that the length test of `visible` hides the padded rows and keys.
  """
  batch, q_len = query.shape[:2]
  kv_len = key.shape[1]
  q_lengths = jnp.full((batch,), q_len, jnp.int32) if q_lengths is None else q_lengths
  kv_lengths = jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else kv_lengths

  pad = lambda x, multiple, least=0: _pad_axis(x, 1, multiple, least=least)
  return (pad(query, q_multiple), pad(key, kv_multiple, min_kv_len),
          pad(value, kv_multiple, min_kv_len),
          jnp.clip(q_lengths, 0, q_len), jnp.clip(kv_lengths, 0, kv_len))


def pad_row_inputs(d_out, lse, delta, q_multiple: int):
  """Pad the backward pass's per-query-row inputs to whole tiles, as `pad_to_tiles` pads the query:
  d_out [batch, q_len, heads, head_dim] with zeros, lse and delta [batch, heads, q_len] with +inf
  and zeros, so that a padded row's recomputed probabilities exp(s - lse) are exactly 0."""
  return (_pad_axis(d_out, 1, q_multiple), _pad_axis(lse, 2, q_multiple, float("inf")),
          _pad_axis(delta, 2, q_multiple))


def _pad_axis(x, axis: int, multiple: int, value=0, least: int = 0):
  extra = max(round_up(x.shape[axis], multiple), least) - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def segment_block_bounds(segment_ids: jax.Array, block: int, num_blocks: int):
  """Per-block (min, max) of int32 [batch, seq] segment ids, each [batch, num_blocks].

  Tiles past `seq` repeat the last id, which widens no block's range (those positions are hidden
  by the length test anyway)."""
  extra = num_blocks * block - segment_ids.shape[1]
  ids = jnp.pad(segment_ids, ((0, 0), (0, extra)), mode="edge") if extra else segment_ids
  ids = ids.reshape(ids.shape[0], num_blocks, block)
  return ids.min(axis=-1), ids.max(axis=-1)


def segment_blocks_meet(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, block_q: int,
                        block_kv: int, num_q_blocks: int, num_kv_blocks: int) -> jax.Array:
  """[num_q_blocks, num_kv_blocks] bool: False when, in every batch element, the query block's
  id range and the key block's id range are disjoint, so no query of the one shares a segment
  with a key of the other and the whole tile is hidden. O(seq) work and memory.

  Exact for sorted ids (packed sequences: each block holds a run of consecutive segments);
  unsorted ids stay correct, the ranges just overlap more often and fewer tiles are skipped."""
  meet, _ = segment_block_pairs(q_segment_ids, kv_segment_ids, block_q, block_kv, num_q_blocks,
                                num_kv_blocks)
  return meet.any(axis=0)


def segment_block_pairs(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, block_q: int,
                        block_kv: int, num_q_blocks: int, num_kv_blocks: int):
  """(meet, same), bool [batch, num_q_blocks, num_kv_blocks], from the per-block id bounds:
  `meet` False where the query block's and the key block's id ranges are disjoint (no pair of
  the tile shares a segment); `same` True where both blocks hold one and the same id (every pair
  of the tile does)."""
  q_min, q_max = segment_block_bounds(q_segment_ids, block_q, num_q_blocks)
  kv_min, kv_max = segment_block_bounds(kv_segment_ids, block_kv, num_kv_blocks)
  meet = ((q_min[:, :, None] <= kv_max[:, None, :])  # [batch, num_q_blocks, num_kv_blocks]
          & (kv_min[:, None, :] <= q_max[:, :, None]))
  same = (((q_min == q_max)[:, :, None] & (kv_min == kv_max)[:, None, :])
          & (q_min[:, :, None] == kv_min[:, None, :]))
  return meet, same
