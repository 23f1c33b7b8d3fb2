"""Everything that changes a score besides its position: the one per-element implementation.

`ScoreMods` is the static description (soft-cap, `score_fn`, `mask_fn`, dropout rate), a frozen,
hashable dataclass; `ScoreArrays` holds the dynamic arrays (bias, boolean mask, segment ids,
ALiBi slopes, dropout seed), a pytree passed explicitly through every implementation. Both the
dense reference (on the full [batch, heads, q_len, kv_len] grid) and the blocked path (on each
[batch, heads, block_q, block_kv] tile) call the same three functions, so they cannot drift:

  modified_scores: s = scale * q.k  ->  + bias  ->  + ALiBi  ->  score_fn  ->  soft-cap
  kept:            causal / window / lengths (mask.visible) & mask & segment ids & mask_fn
  dropout_keep:    the counter-based keep-mask of `dropout.py`

A `Grid` names the block of the score matrix being worked on (broadcastable int32 index arrays);
`tile_arrays` cuts the matching block out of each array (no copy on the full grid), and
`add_grad_tiles` adds a tile's bias/slope gradient back into buffers of the arrays' shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_attn import dropout
from pallas_attn import mask as mask_lib

# score_fn(score, batch, head, q_idx, kv_idx) -> score;  mask_fn(batch, head, q_idx, kv_idx) -> bool
ScoreFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
MaskFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ScoreMods:
  """The static score modifications of one call (hashable: part of a custom_vjp static config).

  logits_soft_cap: s -> cap * tanh(s / cap), after bias, ALiBi and score_fn.
  score_fn / mask_fn: FlexAttention-style element functions (see `attention`'s docstring).
  dropout_rate: probability of dropping a weight (kept weights are scaled by 1 / (1 - rate)).
  broadcast_dropout: one keep-mask shared by every batch element and head (Flax's default).
  """

  logits_soft_cap: float | None = None
  score_fn: ScoreFn | None = None
  mask_fn: MaskFn | None = None
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False

  def __post_init__(self):
    if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
      raise ValueError(f"logits_soft_cap must be a positive float or None; "
                       f"got {self.logits_soft_cap}")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1); got {self.dropout_rate}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreArrays:
  """The dynamic inputs of the score modifications (None: absent). Shapes as `attention`
  normalizes them: bias/mask [batch|1, heads_q|1, q_len|1, kv_len|1]; segment ids int32
  [batch, q_len] and [batch, kv_len]; alibi_slopes float32 [batch|1, heads_q]; dropout_seed
  uint32 [2]. Only bias and alibi_slopes are differentiable."""

  bias: jax.Array | None = None
  mask: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  alibi_slopes: jax.Array | None = None
  dropout_seed: jax.Array | None = None

  def replace(self, **kw) -> "ScoreArrays":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class Grid:
  """A [batch, heads_q, rows, cols] block of the score matrix, as broadcastable int32 indices.

  q / kv are absolute positions and may run past q_len / kv_len in a padded tile (the length test
  hides those); `user_indices` clips them for the user's functions and the array lookups.
  """

  batch: jax.Array  # [batch, 1, 1, 1]
  head: jax.Array  # [1, heads_q, 1, 1], query heads
  q: jax.Array  # [1, 1, rows, 1]
  kv: jax.Array  # [1, 1, 1, cols]
  q_len: int
  kv_len: int
  full: bool = False  # the whole matrix: array lookups are the arrays themselves

  @classmethod
  def block(cls, batch: int, heads_q: int, q_start, rows: int, kv_start, cols: int, q_len: int,
            kv_len: int) -> "Grid":
    iota = lambda n, axis: jax.lax.broadcasted_iota(jnp.int32, tuple(
        n if a == axis else 1 for a in range(4)), axis)
    return cls(batch=iota(batch, 0), head=iota(heads_q, 1), q=q_start + iota(rows, 2),
               kv=kv_start + iota(cols, 3), q_len=q_len, kv_len=kv_len)

  @classmethod
  def whole(cls, batch: int, heads_q: int, q_len: int, kv_len: int) -> "Grid":
    grid = cls.block(batch, heads_q, 0, q_len, 0, kv_len, q_len, kv_len)
    return dataclasses.replace(grid, full=True)

  def user_indices(self):
    """(batch, head, q_idx, kv_idx), positions clipped into the arrays."""
    return (self.batch, self.head, jnp.clip(self.q, 0, self.q_len - 1),
            jnp.clip(self.kv, 0, self.kv_len - 1))


def _block_index(shape, q_idx, kv_idx):
  """The index of the [rows|1, cols|1] block at positions q_idx [rows], kv_idx [cols] of a
  [B|1, H|1, T|1, S|1] array (an axis of size 1 stays 1): one gather or scatter of the block's
  size, never a [rows, S] slab."""
  rows = q_idx if shape[2] > 1 else jnp.zeros((1,), jnp.int32)
  cols = kv_idx if shape[3] > 1 else jnp.zeros((1,), jnp.int32)
  return slice(None), slice(None), rows[:, None], cols[None, :]


def tile_arrays(arrays: ScoreArrays, grid: Grid) -> ScoreArrays:
  """The block of each array that `grid` covers, shaped to broadcast against
  [batch, heads_q, rows, cols] scores."""
  _, _, q_idx, kv_idx = grid.user_indices()
  q_idx, kv_idx = q_idx.reshape(-1), kv_idx.reshape(-1)

  def pair(x):  # [B|1, H|1, T|1, S|1] -> [B|1, H|1, rows|1, cols|1]
    return x if x is None or grid.full else x[_block_index(x.shape, q_idx, kv_idx)]

  def ids(x, positions, shape):  # [batch, seq] -> [batch, 1, rows, 1] or [batch, 1, 1, cols]
    return None if x is None else (x if grid.full else x[:, positions]).reshape(shape)

  batch = grid.batch.shape[0]
  slopes = arrays.alibi_slopes
  return ScoreArrays(
      bias=pair(arrays.bias), mask=pair(arrays.mask),
      q_segment_ids=ids(arrays.q_segment_ids, q_idx, (batch, 1, -1, 1)),
      kv_segment_ids=ids(arrays.kv_segment_ids, kv_idx, (batch, 1, 1, -1)),
      alibi_slopes=None if slopes is None else slopes[:, :, None, None],
      dropout_seed=arrays.dropout_seed)


def zero_grads(arrays: ScoreArrays) -> ScoreArrays:
  """float32 gradient buffers shaped like the differentiable arrays (bias, alibi_slopes)."""
  zeros = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)
  return ScoreArrays(bias=zeros(arrays.bias), alibi_slopes=zeros(arrays.alibi_slopes))


def add_grad_tiles(grads: ScoreArrays, tile_grads: ScoreArrays, grid: Grid) -> ScoreArrays:
  """Add one tile's gradients (the cotangents of `tile_arrays`' bias and slopes, broadcast axes
  already summed) into the buffers of `zero_grads`. The bias tile is scattered into its place
  [.., rows|1, cols|1]; positions past the arrays (padded tiles) are dropped, their gradient
  is zero anyway. Memory: the bias's own shape, never more."""
  bias = grads.bias
  if bias is not None:
    index = _block_index(bias.shape, grid.q.reshape(-1), grid.kv.reshape(-1))
    bias = bias.at[index].add(tile_grads.bias, mode="drop")
  slopes = grads.alibi_slopes
  if slopes is not None:
    slopes = slopes + tile_grads.alibi_slopes.reshape(slopes.shape)  # [B|1, H, 1, 1] summed
  return ScoreArrays(bias=bias, alibi_slopes=slopes)


def cast_grads(grads: ScoreArrays, arrays: ScoreArrays) -> ScoreArrays:
  """The accumulated gradients in the dtypes of the arrays they belong to."""
  cast = lambda g, x: None if g is None else g.astype(x.dtype)
  return ScoreArrays(bias=cast(grads.bias, arrays.bias),
                     alibi_slopes=cast(grads.alibi_slopes, arrays.alibi_slopes))


def modified_scores(mods: ScoreMods, spec: mask_lib.MaskSpec, s: jax.Array, grid: Grid,
                    tiles: ScoreArrays) -> jax.Array:
  """s = scale * q.k ([batch, heads_q, rows, cols], float32) with, in this order: + bias,
  + ALiBi (-slope * |i + offset - j|, aligned like the causal mask), score_fn, soft-cap.

  The soft-cap comes last so that it bounds every logit the softmax sees (bias and ALiBi
  included), as tokamax and Gemma do; masking is not done here (see `kept`).
  """
  if tiles.bias is not None:
    s = s + tiles.bias.astype(s.dtype)
  if tiles.alibi_slopes is not None:
    distance = jnp.abs(grid.q + spec.offset - grid.kv).astype(s.dtype)  # [1, 1, rows, cols]
    s = s - tiles.alibi_slopes.astype(s.dtype) * distance
  if mods.score_fn is not None:
    s = jnp.broadcast_to(mods.score_fn(s, *grid.user_indices()), s.shape).astype(s.dtype)
  if mods.logits_soft_cap is not None:
    cap = mods.logits_soft_cap
    s = cap * jnp.tanh(s / cap)
  return s


def kept(mods: ScoreMods, spec: mask_lib.MaskSpec, grid: Grid, tiles: ScoreArrays,
         q_lengths: jax.Array | None, kv_lengths: jax.Array | None) -> jax.Array:
  """bool, broadcastable to [batch, heads_q, rows, cols]: the score takes part in the softmax.
  Causal / window / lengths (`mask.visible`), the boolean mask, equal segment ids, mask_fn."""
  per_batch = lambda x: None if x is None else x[:, None, None, None]
  keep = mask_lib.visible(spec, grid.q, grid.kv, per_batch(q_lengths), per_batch(kv_lengths))
  if tiles.mask is not None:
    keep = keep & tiles.mask
  if tiles.q_segment_ids is not None:
    keep = keep & (tiles.q_segment_ids == tiles.kv_segment_ids)
  if mods.mask_fn is not None:
    keep = keep & mods.mask_fn(*grid.user_indices()).astype(bool)
  return keep


def dropout_keep(mods: ScoreMods, grid: Grid, tiles: ScoreArrays) -> jax.Array:
  """bool, broadcastable to [batch, heads_q, rows, cols]: the weight survives dropout. Indexed by
  absolute positions, so every path regenerates the same mask for the same element."""
  batch, head = (0, 0) if mods.broadcast_dropout else (grid.batch, grid.head)
  return dropout.keep_mask(tiles.dropout_seed, jnp.asarray(batch), jnp.asarray(head), grid.q,
                           grid.kv, mods.dropout_rate)
