"""Block tables: which blocks each CTA of a Mosaic GPU kernel visits, computed outside the kernels.

Without segment ids the kernels find what to visit from positions alone (`mask.kv_block_range`:
causal, window, lengths), a contiguous range per CTA. With packed documents most tiles of that
range hide every pair (8 documents of 2048 in a 16384 sequence: ~94% of the tiles), and the ids
of one block are not known inside the kernel before it is loaded. So the tiles are classified
here, outside the kernels, in O(batch * num_q_blocks * num_kv_blocks) memory (never
q_len x kv_len), and each kernel reads a compacted list per CTA:

- `block_visibility`: per (query block, key block) tile, `visible` (some pair may be visible) and
  `full` (every pair is: no element mask needed), from the positional ranges of `mask`
  (`kv_block_range` / `kv_full_range`) and the per-block segment id bounds
  (`mask.segment_block_pairs`: two blocks can meet only if their id ranges overlap; a tile is
  full only if both blocks hold one and the same id), and-ed with an optional caller's block
  mask pair (e.g. a FlexAttention mask_fn evaluated blockwise).
- `query_major` (forward, dQ: one list of key blocks per CTA of COMPUTE_WARPGROUPS query blocks)
  and `key_major` (dK/dV: one list of query blocks per CTA of COMPUTE_WARPGROUPS key blocks):
  `BlockTable(entries, counts)`. A CTA's list is the union over its warpgroups, in increasing
  block order; each entry packs the block index and, per warpgroup, its mode: SKIP (the other
  warpgroup needs the tile: observe the ring slot and release it), MASKED or FULL.

The tables have a heads axis: size 1 while only segment ids (the same for every head) decide, the
query heads once a per-head block mask is and-ed in.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import config as config_lib

# A warpgroup's mode for one entry.
SKIP, MASKED, FULL = 0, 1, 2
_MODE_BITS = 2
# entry = block << _BLOCK_SHIFT | sum over warpgroups w of mode_w << (w * _MODE_BITS)
_BLOCK_SHIFT = _MODE_BITS * config_lib.COMPUTE_WARPGROUPS


class BlockVisibility(NamedTuple):
  """bool [batch, heads | 1, num_q_blocks, num_kv_blocks] (or transposed: see `transposed`)."""

  visible: jax.Array  # some pair of the tile may be visible: the tile is computed
  full: jax.Array  # every pair of the tile is visible: computed without element mask

  def transposed(self) -> BlockVisibility:
    """Key blocks as rows: [batch, heads | 1, num_kv_blocks, num_q_blocks]."""
    return BlockVisibility(*(jnp.swapaxes(x, -1, -2) for x in self))


class BlockTable(NamedTuple):
  """Per (batch, head or 0, CTA tile): the blocks the CTA visits (see the module doc)."""

  entries: jax.Array  # int32 [batch, heads | 1, num_tiles, num_blocks]; the first `count` used
  counts: jax.Array  # int32 [batch, heads | 1, num_tiles]


def block_visibility(spec: mask_lib.MaskSpec, q_lengths, kv_lengths, *, block_q: int,
                     block_kv: int, num_q_blocks: int, num_kv_blocks: int, q_segment_ids=None,
                     kv_segment_ids=None, block_mask: BlockVisibility | None = None
                     ) -> BlockVisibility:
  """Which tiles of the [num_q_blocks, num_kv_blocks] grid hold a visible pair, and which hold
  only visible pairs.

  q_lengths, kv_lengths: int32 [batch], at most the unpadded lengths. Queries past their length
  hide a tile only when the whole query block is past it (their rows are dropped, or get a +inf
  lse, anyway); keys past their length hide pairs, so a tile that holds one is never full.
  q_segment_ids / kv_segment_ids: int32 [batch, q_len] / [batch, kv_len] (unpadded), or None.
  block_mask: a caller's (visible, full) pair, bool, broadcastable to
  [batch, heads, num_q_blocks, num_kv_blocks], and-ed in (its heads axis becomes the result's).
  """
  batch = q_lengths.shape[0]
  q_starts = jnp.arange(num_q_blocks, dtype=jnp.int32)[None, :] * block_q  # [1, num_q_blocks]
  kv_length = kv_lengths[:, None]
  lo, hi = mask_lib.kv_block_range(spec, q_starts, block_q, block_kv, num_kv_blocks, kv_length)
  hi = jnp.where(q_starts >= q_lengths[:, None], lo, hi)  # every row past its length
  full_lo, full_hi = mask_lib.kv_full_range(spec, q_starts, block_q, block_kv, lo, hi, kv_length)
  kv_blocks = jnp.arange(num_kv_blocks, dtype=jnp.int32)

  def within(start, stop):  # [batch, 1, num_q_blocks, num_kv_blocks]
    start, stop = (jnp.broadcast_to(x, (batch, num_q_blocks))[:, None, :, None]
                   for x in (start, stop))
    return (kv_blocks >= start) & (kv_blocks < stop)

  visible, full = within(lo, hi), within(full_lo, full_hi)
  if q_segment_ids is not None:
    meet, same = mask_lib.segment_block_pairs(q_segment_ids, kv_segment_ids, block_q, block_kv,
                                              num_q_blocks, num_kv_blocks)
    visible, full = visible & meet[:, None], full & same[:, None]
  if block_mask is not None:
    visible, full = visible & block_mask.visible, full & block_mask.full
  return BlockVisibility(visible, full & visible)


def query_major(visibility: BlockVisibility, rows_per_cta: int = config_lib.COMPUTE_WARPGROUPS
                ) -> BlockTable:
  """The forward and dQ kernels' table: key blocks per CTA of COMPUTE_WARPGROUPS query blocks.
  `rows_per_cta=1` (the head-split dQ kernel, whose warpgroups share one query block): one list
  per query block, every warpgroup's mode that block's."""
  return _compact(_rows_per_cta(visibility, rows_per_cta))


def key_major(visibility: BlockVisibility, rows_per_cta: int = config_lib.COMPUTE_WARPGROUPS
              ) -> BlockTable:
  """The dK/dV kernel's table: query blocks per CTA of COMPUTE_WARPGROUPS key blocks (or one key
  block: `rows_per_cta=1`, the head-split dK/dV kernel; see `query_major`)."""
  return _compact(_rows_per_cta(visibility.transposed(), rows_per_cta))


def _rows_per_cta(visibility: BlockVisibility, rows_per_cta: int) -> BlockVisibility:
  """`visibility` with each row repeated for every warpgroup of its CTA when a CTA takes one
  row (`_compact` groups COMPUTE_WARPGROUPS rows per CTA)."""
  wgs = config_lib.COMPUTE_WARPGROUPS
  if rows_per_cta == wgs:
    return visibility
  if rows_per_cta != 1:
    raise ValueError(f"rows_per_cta must be 1 or {wgs}, got {rows_per_cta}")
  return BlockVisibility(*(jnp.repeat(x, wgs, axis=2) for x in visibility))


def _compact(visibility: BlockVisibility) -> BlockTable:
  """Rows grouped COMPUTE_WARPGROUPS at a time (one CTA); per group, the columns any of its rows
  visits, in increasing order, first."""
  wgs = config_lib.COMPUTE_WARPGROUPS
  visible, full = visibility
  batch, heads, rows, cols = visible.shape
  mode = jnp.where(full, FULL, jnp.where(visible, MASKED, SKIP)).astype(jnp.int32)
  mode = mode.reshape(batch, heads, rows // wgs, wgs, cols)
  shifts = (jnp.arange(wgs, dtype=jnp.int32) * _MODE_BITS)[:, None]
  modes = (mode << shifts).sum(axis=3)  # disjoint bits: the sum is the bitwise or
  visits = (mode != SKIP).any(axis=3)  # [batch, heads, tiles, cols]
  entries = (jnp.arange(cols, dtype=jnp.int32) << _BLOCK_SHIFT) | modes
  order = jnp.argsort(~visits, axis=-1, stable=True)  # visited columns first, in order
  return BlockTable(jnp.take_along_axis(entries, order, axis=-1),
                    visits.sum(axis=-1, dtype=jnp.int32))


def decode(entry, wg):
  """(block, mode of warpgroup `wg`) of a table entry (int32 scalars or arrays)."""
  return (lax.shift_right_logical(entry, _BLOCK_SHIFT),
          lax.shift_right_logical(entry, wg * _MODE_BITS) & ((1 << _MODE_BITS) - 1))


@dataclasses.dataclass(frozen=True)
class CtaList:
  """One CTA's list inside a kernel: reads the table's GMEM refs one scalar at a time (the
  producer ahead of the consumers, as it fills the ring)."""

  table: BlockTable  # GMEM refs
  index: tuple  # (batch, head or 0, tile)
  count: Any  # int32 scalar: entries in the list

  @classmethod
  def read(cls, table: BlockTable, *, batch, head, tile) -> CtaList:
    """`head`: the query head (ignored by a table whose heads axis has size 1)."""
    index = (batch, head if table.counts.shape[1] > 1 else 0, tile)
    return cls(table, index, table.counts[index])

  def block(self, i):
    """The block of entry i (what the producer loads)."""
    return decode(self.table.entries[(*self.index, i)], 0)[0]

  def visit(self, wg, carry, *, slot_of, release, step, step_every: bool = False):
    """The loop of compute warpgroup `wg` over the list: entry i fills ring slot `slot_of(i)`;
    SKIP: `release(slot, carry)`; MASKED / FULL: `step(slot, block, carry, masked=...)`. Every
    branch consumes the entry's ring slot, so the producer and both warpgroups stay in step.
    `step_every`: a SKIP entry is a masked step (the warpgroups must meet at every entry)."""

    def body(i, carry):
      block, mode = decode(self.table.entries[(*self.index, i)], wg)
      if step_every:
        mode = jnp.maximum(mode, MASKED)
      slot = slot_of(i)
      return lax.switch(mode, (lambda c: release(slot, c),
                               lambda c: step(slot, block, c, masked=True),
                               lambda c: step(slot, block, c, masked=False)), carry)

    return lax.fori_loop(0, self.count, body, carry)
