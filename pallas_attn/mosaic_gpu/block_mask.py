"""Block masks of the element masks (the boolean `mask` operand and `mask_fn`), computed outside
the kernels so that the block tables skip the tiles they hide and leave unmasked the tiles they
keep whole.

Without them every tile of the positional range is loaded, multiplied and masked element by
element, whatever the mask hides: a sliding window or a document mask written as mask_fn costs as
much as dense attention. Here each FINE x FINE tile of the padded [q_len, kv_len] grid is
classified once per pass, as FlexAttention's block masks are:

- `visible`: some pair of the tile passes the mask (the tile is computed), and
- `full`: every pair passes (the kernel applies neither the mask nor mask_fn to it);

then `coarsen` merges the fine tiles into each kernel's (block_q, block_kv) tiles and
`block_table.block_visibility` ands them with the positional and segment ranges.

Cost, outside the kernels: a mask is read once (its own size). mask_fn is evaluated on every
position pair of the grid that it can distinguish, rows of FINE queries at a time, in chunks of
about _CHUNK_ELEMENTS pairs, so memory stays O(chunk + number of tiles), never q_len x kv_len:
- when it ignores the batch and head indices (found from its jaxpr), on [q_len, kv_len] once,
  while the call is traced (`position_tiles`): the tiles enter the program as an operand of
  O(tiles) bytes, nothing runs per call;
- otherwise per batch element and/or head, in the program (the indices are traced: a sharded
  call's shard holds its own).
The positions it sees are clipped into the unpadded lengths, as in the kernels
(`mods.user_indices`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import partial_eval as pe

from pallas_attn.mosaic_gpu import block_table
from pallas_attn.mosaic_gpu import mods as mods_lib

# The classification tile: every kernel block size is a multiple of it.
FINE = 64
# Position pairs mask_fn is evaluated on per step of the loop (bools, reduced as they are made).
_CHUNK_ELEMENTS = 1 << 25


def fine_visibility(mods: mods_lib.KernelMods, arrays: mods_lib.ModArrays, q_len: int,
                    kv_len: int, mask_fn_tiles: block_table.BlockVisibility | None = None
                    ) -> block_table.BlockVisibility | None:
  """FINE x FINE tiles of the padded grid that the mask and mask_fn leave visible / full:
  bool [batch | 1, heads_q | 1, q_len // FINE, kv_len // FINE]; None when the call has
  neither. `arrays`: padded to (q_len, kv_len) (`ModArrays.padded`); the mask is int8.
  `mask_fn_tiles`: mask_fn's, when already known (`position_tiles`); else evaluated here."""
  parts = []
  if mods.mask is not None:
    parts.append(_mask_tiles(arrays.mask))
  fns = mods.element_fns
  if mask_fn_tiles is not None:
    parts.append(mask_fn_tiles)
  elif fns is not None and fns.mask_fn is not None:
    parts.append(_mask_fn_tiles(fns, arrays.batch_index, arrays.head_index, q_len, kv_len))
  if not parts:
    return None
  # Conservative for `visible` (a tile both let through may still hide every pair of the and),
  # exact for `full`.
  visible, full = parts[0]
  for other in parts[1:]:
    visible, full = visible & other.visible, full & other.full
  return block_table.BlockVisibility(visible, full)


def coarsen(fine: block_table.BlockVisibility, block_q: int,
            block_kv: int) -> block_table.BlockVisibility:
  """The (block_q, block_kv) tiles made of FINE ones: visible if any part is, full if all are."""
  rq, rk = block_q // FINE, block_kv // FINE
  if rq * FINE != block_q or rk * FINE != block_kv:
    raise ValueError(f"block sizes ({block_q}, {block_kv}) must be multiples of {FINE}")

  def merge(x, reduce):
    batch, heads, nq, nk = x.shape
    # A size-1 (broadcast) axis stays 1.
    rows = (1, 1) if nq == 1 else (nq // rq, rq)
    cols = (1, 1) if nk == 1 else (nk // rk, rk)
    return reduce(x.reshape(batch, heads, *rows, *cols), axis=(3, 5))

  return block_table.BlockVisibility(merge(fine.visible, jnp.any), merge(fine.full, jnp.all))


def group_union(visibility: block_table.BlockVisibility,
                groups: int) -> block_table.BlockVisibility:
  """Per kv head: the dK/dV kernel walks one list for all `groups` query heads of a kv head, so a
  tile is visited if any of them sees it and unmasked only if it is full for all of them."""
  visible, full = visibility
  batch, heads, nq, nk = visible.shape
  if heads == 1 or groups == 1:
    return visibility
  shape = (batch, heads // groups, groups, nq, nk)
  return block_table.BlockVisibility(visible.reshape(shape).any(axis=2),
                                     full.reshape(shape).all(axis=2))


def _mask_tiles(mask):
  """A [B|1, H|1, T|1, S|1] int8 mask (padded) per FINE tile; broadcast axes stay size 1."""
  batch, heads, rows, cols = mask.shape
  keep = mask != 0
  nq = rows // FINE if rows > 1 else 1
  nk = cols // FINE if cols > 1 else 1
  keep = keep.reshape(batch, heads, nq, rows // nq, nk, cols // nk)
  return block_table.BlockVisibility(keep.any(axis=(3, 5)), keep.all(axis=(3, 5)))


def index_dependence(mask_fn) -> tuple[bool, bool]:
  """Whether mask_fn(batch, head, q_idx, kv_idx) reads its batch and its head index (from its
  jaxpr: an unused argument is dead code). A mask the same for every head is classified once."""
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  tile = jax.ShapeDtypeStruct((FINE, FINE), jnp.int32)
  closed = jax.make_jaxpr(mask_fn)(scalar, scalar, tile, tile)
  _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  return bool(used[0]), bool(used[1])


def position_tiles(mods: mods_lib.KernelMods, q_len: int,
                   kv_len: int) -> block_table.BlockVisibility | None:
  """mask_fn's FINE tiles of the padded grid, [1, 1, q_len // FINE, kv_len // FINE], computed
  now (concrete arrays), when mask_fn ignores its batch and head arguments (a window, documents,
  a prefix); None otherwise or without mask_fn.

  Such tiles depend on static values only: classified once while the call is traced, they cost
  nothing per call (on the H200 the evaluation took ~0.6 ms at 16384 x 16384, twice a windowed
  forward). The caller passes them to `fine_visibility` as operands: a constant captured inside
  the sharded passes (custom_partitioning) is refused."""
  fns = mods.element_fns
  if fns is None or fns.mask_fn is None or any(index_dependence(fns.mask_fn)):
    return None
  with jax.ensure_compile_time_eval():
    zero = jnp.zeros((1,), jnp.int32)
    return _classify(fns, zero, zero, q_len, kv_len)


def _mask_fn_tiles(fns: mods_lib.ElementFns, batch_index, head_index, q_len: int, kv_len: int):
  uses_batch, uses_head = index_dependence(fns.mask_fn)
  return _classify(fns, batch_index if uses_batch else batch_index[:1],
                   head_index if uses_head else head_index[:1], q_len, kv_len)


def _classify(fns: mods_lib.ElementFns, batches, heads, q_len: int, kv_len: int):
  """mask_fn's (visible, full) FINE tiles for every (batch, head) pair of `batches` x `heads`
  (the global indices it gets)."""
  nq, nk = q_len // FINE, kv_len // FINE
  kv_idx = jnp.clip(jnp.arange(kv_len, dtype=jnp.int32), 0, fns.kv_len - 1)
  kv_idx = jnp.broadcast_to(kv_idx, (FINE, kv_len))
  row = jnp.arange(FINE, dtype=jnp.int32)[:, None]

  def row_of_tiles(args):  # one (batch, head, query block): [nk] visible, [nk] full
    b, h, qi = args
    q_idx = jnp.broadcast_to(jnp.clip(qi * FINE + row, 0, fns.q_len - 1), (FINE, kv_len))
    keep = jnp.broadcast_to(fns.mask_fn(b, h, q_idx, kv_idx), (FINE, kv_len)).astype(jnp.bool_)
    keep = keep.reshape(FINE, nk, FINE)
    return keep.any(axis=(0, 2)), keep.all(axis=(0, 2))

  b, h, qi = (x.ravel() for x in jnp.meshgrid(batches, heads, jnp.arange(nq, dtype=jnp.int32),
                                                indexing="ij"))
  steps = b.shape[0]
  per_step = max(1, min(steps, _CHUNK_ELEMENTS // (FINE * kv_len)))
  visible, full = lax.map(row_of_tiles, (b, h, qi), batch_size=per_step)
  shape = (batches.shape[0], heads.shape[0], nq, nk)
  return block_table.BlockVisibility(visible.reshape(shape), full.reshape(shape))
