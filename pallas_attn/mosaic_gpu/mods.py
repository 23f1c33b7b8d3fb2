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
- Bias and boolean mask ([batch|1, heads_q|1, q_len|1, kv_len|1], size-1 axes broadcast): the
  kernels read each tile's part straight from GMEM into registers (a row or column vector, or a
  scalar, for the broadcast axes: `PairOperand`). The bias is added to the scaled logits before
  ALiBi; the mask hides like the positional mask, after the soft-cap, on every tile. dK/dV tiles
  are transposed, so that kernel gets bias and mask transposed ([.., kv_len|1, q_len|1]:
  `ModArrays.transposed_pairs`, one XLA transpose of each): the lowering has neither a
  transposed load from GMEM nor a register transpose, and a transpose through shared memory
  defeats the dK/dV kernel's layout inference (jax 0.11.2: it fails after minutes of search). The
  bias gradient is dS itself (the gradient of the natural-log logit, after the soft-cap's
  derivative), summed over the broadcast axes by the dbias kernel (`dbias.py`).
- Segment ids: query i sees key j only where q_segment_ids[b, i] == kv_segment_ids[b, j]. A call
  with segment ids element-masks every tile. Blocks are not skipped by segment (a packed batch
  with many short documents still visits every block the positional mask allows): that would
  need per-block min/max ids computed outside the kernels.

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
class BroadcastAxes:
  """Which axes of a bias or mask [batch|1, heads_q|1, q_len|1, kv_len|1] are full (True) rather
  than broadcast (size 1)."""

  batch: bool
  heads: bool
  q: bool
  kv: bool

  @classmethod
  def of(cls, shape) -> BroadcastAxes:
    return cls(*(n > 1 for n in shape))

  def index(self, batch, head, q_start, q_size: int, kv_start, kv_size: int):
    """The index of the [q_size|., kv_size|.] part of a tile in the array (broadcast axes: 0)."""
    return (batch if self.batch else 0, head if self.heads else 0,
            pl.ds(q_start, q_size) if self.q else 0, pl.ds(kv_start, kv_size) if self.kv else 0)


@dataclasses.dataclass(frozen=True)
class KernelMods:
  """The static part of the score modifiers of one call."""

  soft_cap: float | None = None
  bias: BroadcastAxes | None = None
  mask: BroadcastAxes | None = None
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
    """A scorer reads something per query head (ALiBi's slope, dropout's hash prefix, a bias or
    mask with a head axis)."""
    return (self.alibi or self.dropout_rate > 0.0 or any(
        axes is not None and axes.heads for axes in (self.bias, self.mask)))


class ModArrays(NamedTuple):
  """The dynamic operands of the modifiers, None where absent. Passed to the kernels as one
  operand; a kernel body receives the same tuple holding GMEM refs."""

  q_segment_ids: Any = None  # int32 [batch, q_len]
  kv_segment_ids: Any = None  # int32 [batch, kv_len]
  alibi_slopes: Any = None  # float32 [heads_q]
  dropout_prefix: Any = None  # uint32 [batch, heads_q]: see `dropout_lib.row_prefix`
  bias: Any = None  # float32/bf16/f16 [batch|1, heads_q|1, q_len|1, kv_len|1]
  mask: Any = None  # int8 (1 = attend), shaped like bias

  def padded(self, q_len: int, kv_len: int) -> ModArrays:
    """Segment ids, bias and mask padded to the kernels' padded lengths. The padding value does
    not matter: padded keys fail the length test and padded rows are dropped."""

    def pad(ids, length):
      return None if ids is None else jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])))

    def pad_pair(x):  # only full q / kv axes grow
      if x is None:
        return None
      widths = [(0, 0), (0, 0)] + [(0, n - m if m > 1 else 0) for n, m in
                                   zip((q_len, kv_len), x.shape[2:])]
      return jnp.pad(x, widths)

    return self._replace(q_segment_ids=pad(self.q_segment_ids, q_len),
                         kv_segment_ids=pad(self.kv_segment_ids, kv_len),
                         bias=pad_pair(self.bias), mask=pad_pair(self.mask))

  def transposed_pairs(self) -> ModArrays:
    """Bias and mask as the dK/dV kernel reads them: [.., kv_len|1, q_len|1]."""
    swap = lambda x: None if x is None else jnp.swapaxes(x, 2, 3)
    return self._replace(bias=swap(self.bias), mask=swap(self.mask))


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


_BIAS_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pair_array(name: str, x, full_shape):
  """A bias or mask, checked to broadcast to [batch, heads_q, q_len, kv_len] = full_shape."""
  if x is None:
    return None
  if x.ndim != 4 or any(n not in (1, m) for n, m in zip(x.shape, full_shape)):
    raise ValueError(f"{name} must have shape [batch|1, heads_q|1, q_len|1, kv_len|1] with "
                     f"[batch, heads_q, q_len, kv_len] = {list(full_shape)}, got "
                     f"{list(x.shape)}")
  return x


def from_arguments(q, k, logits_soft_cap, q_segment_ids, kv_segment_ids, alibi_slopes,
                   dropout_rate=0.0, dropout_seed=None, broadcast_dropout=False, bias=None,
                   mask=None):
  """The static `KernelMods` and the dynamic `ModArrays` of a call to `ops.attention`,
  checked (q [B, T, Hq, D], k [B, S, Hkv, D])."""
  (batch, q_len, heads_q, _), kv_len = q.shape, k.shape[1]
  full_shape = (batch, heads_q, q_len, kv_len)
  bias = _pair_array("bias", bias, full_shape)
  if bias is not None:
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise ValueError(f"bias must be floating point, got {bias.dtype}")
    if jnp.dtype(bias.dtype) not in map(jnp.dtype, _BIAS_DTYPES):
      bias = bias.astype(jnp.float32)
  mask = _pair_array("mask", mask, full_shape)
  if mask is not None:
    if jnp.dtype(mask.dtype) != jnp.dtype(bool):
      raise ValueError(f"mask must be boolean (True = attend), got {mask.dtype}")
    # int8 in the kernels: the lowering loads 8-bit integers into the WGMMA layout.
    mask = mask.astype(jnp.int8)
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
                    broadcast_dropout=bool(broadcast_dropout) and dropout_rate > 0.0,
                    bias=None if bias is None else BroadcastAxes.of(bias.shape),
                    mask=None if mask is None else BroadcastAxes.of(mask.shape))
  return mods, ModArrays(q_segment_ids, kv_segment_ids, alibi_slopes, prefix, bias, mask)


class PairOperand(NamedTuple):
  """One tile's part of a bias or mask in registers: a [rows, cols] tile (WGMMA layout), a row
  or column vector (for a broadcast axis), or a scalar. `expand` broadcasts it over the tile."""

  value: Any
  kind: str  # "tile", "rows", "cols" or "scalar"

  def expand(self, shape):
    if self.kind == "rows":
      return common.broadcast_rows(self.value, shape)
    if self.kind == "cols":
      return common.broadcast_cols(self.value, shape)
    return self.value  # a tile, or a scalar that broadcasts in the arithmetic


def _load_pair(ref, axes: BroadcastAxes, batch, head, row_start, rows: int, col_start,
               cols: int) -> PairOperand:
  """The [rows, cols] part of the tile at (row_start, col_start) of `ref` (a bias or mask laid out
  as the tile: [batch|1, heads|1, rows|1, cols|1], `axes` in that order), float32. Plain loads
  from GMEM (optimized=False, as `_load_ids`)."""
  part = ref.at[axes.index(batch, head, row_start, rows, col_start, cols)]
  load = lambda layout: plgpu.load(part, layout=layout, optimized=False).astype(jnp.float32)
  if axes.q and axes.kv:
    return PairOperand(load(common.WGMMA), "tile")
  if axes.q:
    return PairOperand(load(common.WGMMA_ROW), "rows")
  if axes.kv:
    return PairOperand(load(common.WGMMA_COL), "cols")
  return PairOperand(part[...].astype(jnp.float32), "scalar")


class Columns(NamedTuple):
  """The column positions of one tile: block `block` of `size` positions, their segment ids
  (int32 [size] in the WGMMA column layout; None without segment ids), and the tile's bias and
  mask (`PairOperand`s; None without)."""

  block: Any
  size: int
  segment_ids: Any = None
  bias: PairOperand | None = None
  mask: PairOperand | None = None

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
  rows: int = 0
  row_segment_ids: Any = None  # int32 [rows], WGMMA row layout
  slope: Any = None  # float32 scalar: the ALiBi slope of the current head
  dropout_prefix: Any = None  # uint32 scalar: the dropout hash prefix of (batch, current head)
  head: Any = None  # the current query head (indexes a bias or mask with a head axis)

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
                 kv_length=kv_length, transposed=transposed, rows=rows, row_segment_ids=row_ids)
    return scorer if head is None else scorer.for_head(head)

  def for_head(self, head) -> TileScorer:
    """This scorer for query head `head` (reads its ALiBi slope and dropout hash prefix; bias
    and mask tiles are read per tile, at this head)."""
    scorer = dataclasses.replace(self, head=head)
    if self.mods.alibi:
      scorer = dataclasses.replace(scorer, slope=self.refs.alibi_slopes[head])
    if self.mods.dropout_rate > 0.0:
      scorer = dataclasses.replace(scorer,
                                   dropout_prefix=self.refs.dropout_prefix[self.batch, head])
    return scorer

  def columns(self, block, size: int) -> Columns:
    """The columns of the next tile: block `block` of `size` positions. Call it before waiting
    for the tile's data, so that loading the segment ids overlaps the wait."""
    cols = Columns(block, size)
    if self.mods.segment_ids:
      col_ref = self.refs.q_segment_ids if self.transposed else self.refs.kv_segment_ids
      cols = cols._replace(
          segment_ids=_load_ids(col_ref, self.batch, cols.start, size, common.WGMMA_COL))
    if self.mods.bias is not None:
      cols = cols._replace(bias=self._load_pair(self.refs.bias, self.mods.bias, cols))
    if self.mods.mask is not None:
      cols = cols._replace(mask=self._load_pair(self.refs.mask, self.mods.mask, cols))
    return cols

  def _load_pair(self, ref, axes: BroadcastAxes, cols: Columns) -> PairOperand:
    if self.transposed:  # the array is transposed too (`ModArrays.transposed_pairs`)
      axes = dataclasses.replace(axes, q=axes.kv, kv=axes.q)
    return _load_pair(ref, axes, self.batch, self.head, self.row_start, self.rows, cols.start,
                      cols.size)

  def __call__(self, s, cols: Columns, *, masked: bool):
    """Base-2 logits of the raw float32 tile `s` (WGMMA layout), -inf where hidden.

    masked: apply the positional mask (causal / window / key length); the range ends need it,
    the tiles in between do not. Segment ids and a boolean mask, when given, mask every tile.
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
      if mods.bias is not None:
        s = s + cols.bias.expand(s.shape) * common.LOG2E
      if mods.alibi:
        s = s - (self.slope * common.LOG2E) * distance
    else:
      x = s * (self.scale / mods.soft_cap)
      if mods.bias is not None:
        x = x + cols.bias.expand(x.shape) * (1.0 / mods.soft_cap)
      if mods.alibi:
        x = x - (self.slope / mods.soft_cap) * distance
      tanh_s = jnp.tanh(x)
      s = tanh_s * (mods.soft_cap * common.LOG2E)
    keep = None
    if masked:
      if positions is None:
        positions = self._positions(s, cols)
      keep = common.tile_mask(self.spec, positions, self.kv_length)
    if mods.segment_ids:
      same = (common.broadcast_rows(self.row_segment_ids, s.shape)
              == common.broadcast_cols(cols.segment_ids, s.shape))
      keep = same if keep is None else keep & same
    if mods.mask is not None:
      allowed = cols.mask.expand(s.shape) != 0.0
      keep = allowed if keep is None else keep & allowed
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
