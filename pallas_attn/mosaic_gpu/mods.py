"""Score modifiers inside the Mosaic GPU kernels: logit soft-capping, packed-sequence segment ids
and ALiBi. One place turns a raw q.k^T tile into the logits every kernel (forward, dQ, dK/dV)
feeds to its softmax.

Order on the natural-log logits of a tile (the semantics issue #5 sets for every path):
  s = scale * q.k  ->  + ALiBi  ->  soft-cap  ->  masks (causal / window / lengths, segment ids)
  ->  softmax.
- ALiBi adds -slope[h] * |i + offset - j|, offset being the mask's causal alignment offset
  (`getattr(spec, "offset", 0)`: 0 while `MaskSpec` has no offset). The kernels treat the slopes
  as constants: `attention` in ops.py refuses to differentiate them (`constant_slopes`).
- The soft-cap maps a logit x to cap * tanh(x / cap); the backward kernels recompute tanh from
  the recomputed scores and multiply dS by its derivative 1 - tanh^2 (`soft_cap_grad`).
- Dropout (attention weights, as the portable path): the keep-mask of `pallas_attn.dropout`,
  the hash of (seed, batch, head, q_idx, kv_idx) (batch and head 0 with `broadcast_dropout`), is
  regenerated per tile from the tile's positions, never stored. The hash state after (seed,
  batch, head) is computed outside the kernels (`ModArrays.dropout_prefix`, uint32
  [batch, heads_q]), so that a batch- or head-sharded call hashes global indices; the kernels
  absorb the positions. The lse and the row sum l are of the undropped softmax; the forward
  multiplies the kept probabilities by 1 / (1 - rate) before P.V; the backward masks and scales
  dP the same way (dS = P * (dP_dropped - delta), delta of the dropped output) and
  dV = (P * keep / (1 - rate))^T dO.
- Segment ids: query i sees key j only where q_segment_ids[b, i] == kv_segment_ids[b, j]. A call
  with segment ids runs the kernels over block tables (`block_table`, built outside the kernels
  from per-block min/max ids): tiles whose segments cannot meet are skipped, and only the tiles
  the table marks MASKED are element-masked (position and segment); a FULL tile holds one
  segment on both sides and every pair is visible, so it gets no mask at all.

The kernels' softmax runs in base 2. Without a soft-cap, scale * log2(e) is one multiply and the
ALiBi slope is scaled by log2(e) too; with one, the capped natural-log logit is formed first
(x / cap folded into the scale and slope, cap * log2(e) into one multiply after tanh). The lse
stays natural-log.

`KernelMods` is static: it decides what a kernel is traced with, so with no modifier the kernels
are exactly the plain ones (no extra load, no extra arithmetic). `ModArrays` carries the dynamic
operands, and inside a kernel their GMEM refs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import dropout as dropout_lib
from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import common


@dataclasses.dataclass(frozen=True)
class KernelMods:
  """The static part of the score modifiers of one call."""

  soft_cap: float | None = None
  segment_ids: bool = False
  alibi: bool = False
  dropout_rate: float = 0.0  # > 0: dropout in the kernels
  # One keep-mask for every (batch, head). The kernels need not know (the `dropout_prefix` array
  # is then the same everywhere); kept so that the static config says what the call does.
  broadcast_dropout: bool = False

  def __post_init__(self):
    if self.soft_cap is not None and not (math.isfinite(self.soft_cap) and self.soft_cap > 0):
      raise ValueError(f"logits_soft_cap must be a positive finite float, got {self.soft_cap}")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")

  @property
  def per_head(self) -> bool:
    """A scorer reads something per query head (ALiBi's slope, dropout's hash prefix)."""
    return self.alibi or self.dropout_rate > 0.0


class ModArrays(NamedTuple):
  """The dynamic operands of the modifiers, None where absent. Passed to the kernels as one
  operand; a kernel body receives the same tuple holding GMEM refs."""

  q_segment_ids: Any = None  # int32 [batch, q_len]
  kv_segment_ids: Any = None  # int32 [batch, kv_len]
  alibi_slopes: Any = None  # float32 [heads_q]
  dropout_prefix: Any = None  # uint32 [batch, heads_q]: see `dropout_lib.row_prefix`

  def padded(self, q_len: int, kv_len: int) -> ModArrays:
    """Segment ids padded to the kernels' padded lengths. The padding value does not matter:
    padded keys fail the length test and padded rows are dropped."""

    def pad(ids, length):
      return None if ids is None else jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])))

    return self._replace(q_segment_ids=pad(self.q_segment_ids, q_len),
                         kv_segment_ids=pad(self.kv_segment_ids, kv_len))


@jax.custom_jvp
def constant_slopes(slopes):
  """The identity, refusing to be differentiated: the kernels compute no gradient for the ALiBi
  slopes, and a silent zero would be wrong. Slopes under `jax.lax.stop_gradient` (or not traced
  for differentiation at all) pass."""
  return slopes


@constant_slopes.defjvp
def _constant_slopes_jvp(primals, tangents):
  del primals, tangents
  raise TypeError(
      "the Mosaic GPU attention kernels treat alibi_slopes as constants and compute no gradient "
      "for them; pass jax.lax.stop_gradient(alibi_slopes), or use the portable path to train "
      "the slopes")


def from_arguments(q, k, logits_soft_cap, q_segment_ids, kv_segment_ids, alibi_slopes,
                   dropout_rate=0.0, dropout_seed=None, broadcast_dropout=False):
  """The static `KernelMods` and the dynamic `ModArrays` of a call to `ops.attention`,
  checked (q [B, T, Hq, D], k [B, S, Hkv, D])."""
  (batch, q_len, heads_q, _), kv_len = q.shape, k.shape[1]
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids go together: pass both or neither")
  if q_segment_ids is not None:
    for name, ids, length in (("q_segment_ids", q_segment_ids, q_len),
                              ("kv_segment_ids", kv_segment_ids, kv_len)):
      if ids.shape != (batch, length) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be integers of shape {(batch, length)}, got "
                         f"{ids.dtype}{list(ids.shape)}")
    q_segment_ids = q_segment_ids.astype(jnp.int32)
    kv_segment_ids = kv_segment_ids.astype(jnp.int32)
  if alibi_slopes is not None:
    if alibi_slopes.shape != (heads_q,):
      raise ValueError(f"alibi_slopes must have shape {(heads_q,)} (one per query head), got "
                       f"{list(alibi_slopes.shape)}")
    alibi_slopes = constant_slopes(alibi_slopes.astype(jnp.float32))
  if not isinstance(dropout_rate, (int, float)) or not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be a Python float in [0, 1), got {dropout_rate!r}")
  dropout_rate = float(dropout_rate)
  prefix = None
  if dropout_rate > 0.0:
    if dropout_seed is None:
      raise ValueError(f"dropout_rate={dropout_rate} needs dropout_seed (uint32 [2], e.g. "
                       f"pallas_attn.dropout.seed_from_key(key))")
    if dropout_seed.shape != (2,) or not jnp.issubdtype(dropout_seed.dtype, jnp.integer):
      raise ValueError(f"dropout_seed must be integers of shape (2,), got "
                       f"{dropout_seed.dtype}{list(dropout_seed.shape)}")
    seed = jax.lax.bitcast_convert_type(dropout_seed.astype(jnp.int32), jnp.uint32)
    seed = jax.lax.stop_gradient(seed)
    if broadcast_dropout:  # one mask for every (batch, head): hash batch 0, head 0
      prefix = jnp.broadcast_to(dropout_lib.row_prefix(seed, jnp.int32(0), jnp.int32(0)),
                                (batch, heads_q))
    else:
      prefix = dropout_lib.row_prefix(seed, jnp.arange(batch, dtype=jnp.int32)[:, None],
                                      jnp.arange(heads_q, dtype=jnp.int32)[None, :])
  mods = KernelMods(soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                    segment_ids=q_segment_ids is not None, alibi=alibi_slopes is not None,
                    dropout_rate=dropout_rate,
                    broadcast_dropout=bool(broadcast_dropout) and dropout_rate > 0.0)
  return mods, ModArrays(q_segment_ids, kv_segment_ids, alibi_slopes, prefix)


class Columns(NamedTuple):
  """The column positions of one tile: block `block` of `size` positions, and their segment ids
  (int32 [size] in the WGMMA column layout; None without segment ids)."""

  block: Any
  size: int
  segment_ids: Any = None

  @property
  def start(self):
    # Computed where it is used, so that a kernel without modifiers traces exactly as before.
    return self.block * self.size


def _load_ids(ids_ref, batch, start, size: int, layout):
  # A plain load from GMEM straight into the registers of `layout`: 64 int32 per tile side, too
  # few to be worth a TMA copy and a barrier. The Mosaic GPU lowering has "optimized" (vector)
  # transfers only to/from SMEM: from GMEM it requires optimized=False (the interpreter accepts
  # either; tests/test_mosaic_gpu_mods.py lowers the kernels for CUDA to catch this).
  return plgpu.load(ids_ref.at[batch, pl.ds(start, size)], layout=layout, optimized=False)


@dataclasses.dataclass(frozen=True)
class TileScorer:
  """Turns the raw q.k^T tiles of one compute warpgroup into base-2 logits.

  Forward and dQ tiles are [queries, keys]; dK/dV tiles are transposed ([keys, queries]): rows
  are this warpgroup's own positions (fixed), columns the positions each step streams.
  """

  mods: KernelMods
  spec: mask_lib.MaskSpec
  scale: float
  refs: ModArrays  # GMEM refs (None where absent)
  batch: Any
  row_start: Any
  kv_length: Any
  transposed: bool = False
  row_segment_ids: Any = None  # int32 [rows], WGMMA row layout
  slope: Any = None  # float32 scalar: the ALiBi slope of the current head
  dropout_prefix: Any = None  # uint32 scalar: the dropout hash prefix of (batch, current head)

  @classmethod
  def create(cls, mods: KernelMods, spec: mask_lib.MaskSpec, scale: float, refs: ModArrays, *,
             batch, row_start, rows: int, kv_length, head=None,
             transposed: bool = False) -> TileScorer:
    """`head` None: the head changes per step group (dK/dV over a GQA group): see `for_head`."""
    row_ids = None
    if mods.segment_ids:
      row_ref = refs.kv_segment_ids if transposed else refs.q_segment_ids
      row_ids = _load_ids(row_ref, batch, row_start, rows, common.WGMMA_ROW)
    scorer = cls(mods=mods, spec=spec, scale=scale, refs=refs, batch=batch, row_start=row_start,
                 kv_length=kv_length, transposed=transposed, row_segment_ids=row_ids)
    return scorer if head is None else scorer.for_head(head)

  def for_head(self, head) -> TileScorer:
    """This scorer for query head `head` (reads its ALiBi slope and dropout hash prefix)."""
    scorer = self
    if self.mods.alibi:
      scorer = dataclasses.replace(scorer, slope=self.refs.alibi_slopes[head])
    if self.mods.dropout_rate > 0.0:
      scorer = dataclasses.replace(scorer,
                                   dropout_prefix=self.refs.dropout_prefix[self.batch, head])
    return scorer

  def columns(self, block, size: int, *, masked: bool = True) -> Columns:
    """The columns of the next tile: block `block` of `size` positions. Call it before waiting
    for the tile's data, so that loading the segment ids overlaps the wait. An unmasked tile
    needs no segment ids (see `__call__`)."""
    cols = Columns(block, size)
    if not (self.mods.segment_ids and masked):
      return cols
    col_ref = self.refs.q_segment_ids if self.transposed else self.refs.kv_segment_ids
    return cols._replace(
        segment_ids=_load_ids(col_ref, self.batch, cols.start, size, common.WGMMA_COL))

  def __call__(self, s, cols: Columns, *, masked: bool):
    """Base-2 logits of the raw float32 tile `s` (WGMMA layout), -inf where hidden.

    masked: apply the positional mask (causal / window / key length) and, with segment ids, the
    segment mask. The positional range ends need it, the tiles in between do not; with segment
    ids the block table decides (an unmasked tile holds one segment on both sides).
    Returns (logits, tanh_s): tanh_s is the soft-cap's tanh of the tile (for `soft_cap_grad`),
    None without a soft-cap.
    """
    mods = self.mods
    positions = None
    if mods.alibi:
      positions = self._positions(s, cols)
      distance = self._alibi_distance(positions)
    tanh_s = None
    if mods.soft_cap is None:
      s = s * (self.scale * common.LOG2E)
      if mods.alibi:
        s = s - (self.slope * common.LOG2E) * distance
    else:
      x = s * (self.scale / mods.soft_cap)
      if mods.alibi:
        x = x - (self.slope / mods.soft_cap) * distance
      tanh_s = jnp.tanh(x)
      s = tanh_s * (mods.soft_cap * common.LOG2E)
    keep = None
    if masked:
      if positions is None:
        positions = self._positions(s, cols)
      keep = common.tile_mask(self.spec, positions, self.kv_length)
    if mods.segment_ids and masked:
      same = (common.broadcast_rows(self.row_segment_ids, s.shape)
              == common.broadcast_cols(cols.segment_ids, s.shape))
      keep = same if keep is None else keep & same
    if keep is not None:
      s = jnp.where(keep, s, -jnp.inf)
    return s, tanh_s

  def dropout_keep(self, s, cols: Columns):
    """bool tile (the shape and layout of `s`): the weights that survive dropout; None without
    dropout. Computed once per tile and used by `dropped` on each tile it applies to."""
    if self.mods.dropout_rate == 0.0:
      return None
    q_pos, kv_pos = self._positions(s, cols)
    return dropout_lib.keep_from_prefix(self.dropout_prefix, q_pos, kv_pos,
                                        self.mods.dropout_rate)

  def dropped(self, x, keep):
    """x where kept, scaled by 1 / (1 - rate); 0 where dropped. x itself without dropout."""
    if keep is None:
      return x
    return jnp.where(keep, x * (1.0 / (1.0 - self.mods.dropout_rate)), 0.0)

  def _positions(self, s, cols: Columns):
    return common.tile_positions(*s.shape, self.row_start, cols.start, self.transposed)

  def _alibi_distance(self, positions):
    """|i + offset - j| as float32 over the tile."""
    q_pos, kv_pos = positions
    offset = getattr(self.spec, "offset", 0)
    diff = q_pos - kv_pos
    if not (isinstance(offset, int) and offset == 0):
      diff = diff + offset
    return jnp.abs(diff).astype(jnp.float32)


def soft_cap_grad(ds, tanh_s):
  """dS with respect to the uncapped logit: d(cap * tanh(x / cap))/dx = 1 - tanh^2."""
  return ds if tanh_s is None else ds * (1.0 - tanh_s * tanh_s)
