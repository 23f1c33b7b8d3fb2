"""Score modifiers inside the Mosaic GPU kernels: logit soft-capping, packed-sequence segment ids,
ALiBi and the FlexAttention-style `mask_fn` / `score_fn`. One place turns a raw q.k^T tile into
the logits every kernel (forward, dQ, dK/dV) feeds to its softmax.

Order on the natural-log logits of a tile (the semantics issue #5 sets for every path):
  s = scale * q.k  ->  + ALiBi  ->  score_fn  ->  soft-cap  ->  masks (causal / window /
  lengths, segment ids, mask_fn)  ->  softmax.
- ALiBi adds -slope[h] * |i + offset - j|, offset being the mask's causal alignment offset
  (`getattr(spec, "offset", 0)`: 0 while `MaskSpec` has no offset). The kernels treat the slopes
  as constants: `attention` in ops.py refuses to differentiate them (`constant_slopes`).
- The soft-cap maps a logit x to cap * tanh(x / cap); the backward kernels recompute tanh from
  the recomputed scores and multiply dS by its derivative 1 - tanh^2 (`logit_grad`).
- Dropout (attention weights, as the portable path): the keep-mask of `pallas_attn.dropout`,
  the hash of (seed, batch, head, q_idx, kv_idx) (batch and head 0 with `broadcast_dropout`), is
  regenerated per tile from the tile's positions, never stored. The hash state after (seed,
  batch, head) is computed outside the kernels (`ModArrays.dropout_prefix`, uint32
  [batch, heads_q]), so that a batch- or head-sharded call hashes global indices; the kernels
  absorb the positions. The lse and the row sum l are of the undropped softmax; the forward
  multiplies the kept probabilities by 1 / (1 - rate) before P.V; the backward masks and scales
  dP the same way (dS = P * (dP_dropped - delta), delta of the dropped output) and
  dV = (P * keep / (1 - rate))^T dO.
- mask_fn / score_fn (`ElementFns`): the user's functions are traced into the kernels, called on
  the tile with q_idx, kv_idx int32 [rows, cols] in the WGMMA layout (positions in the unpadded
  sequences, clipped into them as on the portable path; transposed on dK/dV tiles, like the tile)
  and batch, head int32 scalars: the global batch index and query head, read from
  `ModArrays.batch_index` / `head_index` so that a sharded call passes global indices.
  mask_fn is and-ed into the keep mask of the tiles the block table marks masked
  (`block_mask`: tiles it hides entirely are skipped, tiles it keeps whole are not masked).
  The backward kernels get d score_fn / d s by `jax.jvp` traced in the kernel and chain it into
  dS after the soft-cap's derivative (`LogitGrad`). Functions that close over arrays, or use primitives the
  Mosaic GPU lowering lacks, cannot be traced: `element_fns_problem` says why (the dispatcher
  then picks the portable path).
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
  with segment ids runs the kernels over block tables (`block_table`, built outside the kernels
  from per-block min/max ids): tiles whose segments cannot meet are skipped, and only the tiles
  the table marks MASKED are element-masked (position and segment); a FULL tile holds one
  segment on both sides and every pair is visible, so it gets no mask at all.

The kernels' softmax runs in base 2. Without a soft-cap, scale * log2(e) is one multiply and the
ALiBi slope is scaled by log2(e) too; with one, the capped natural-log logit is formed first
(x / cap folded into the scale and slope, cap * log2(e) into one multiply after tanh). With a
score_fn the natural-log logit is formed first (scale, then ALiBi), score_fn applied, then the
soft-cap or the log2(e) multiply. The lse stays natural-log.

`KernelMods` is static: it decides what a kernel is traced with, so with no modifier the kernels
are exactly the plain ones (no extra load, no extra arithmetic). `ModArrays` carries the dynamic
operands, and inside a kernel their GMEM refs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import dropout as dropout_lib
from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import common


@dataclasses.dataclass(frozen=True)
class ElementFns:
  """FlexAttention-style user functions traced into the kernels (`attention`'s mask_fn and
  score_fn; either may be None). q_len, kv_len: the unpadded sequence lengths, into which the
  positions the functions see are clipped (padded rows and keys are hidden anyway)."""

  mask_fn: Callable | None
  score_fn: Callable | None
  q_len: int
  kv_len: int


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
  element_fns: ElementFns | None = None

  def __post_init__(self):
    if self.soft_cap is not None and not (math.isfinite(self.soft_cap) and self.soft_cap > 0):
      raise ValueError(f"logits_soft_cap must be a positive finite float, got {self.soft_cap}")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")

  @property
  def per_head(self) -> bool:
    """A scorer reads something per query head (ALiBi's slope, dropout's hash prefix, the head
    index the user's functions get, a bias or mask with a head axis)."""
    return (self.alibi or self.dropout_rate > 0.0 or self.element_fns is not None or any(
        axes is not None and axes.heads for axes in (self.bias, self.mask)))


class ModArrays(NamedTuple):
  """The dynamic operands of the modifiers, None where absent. Passed to the kernels as one
  operand; a kernel body receives the same tuple holding GMEM refs."""

  q_segment_ids: Any = None  # int32 [batch, q_len]
  kv_segment_ids: Any = None  # int32 [batch, kv_len]
  alibi_slopes: Any = None  # float32 [heads_q]
  dropout_prefix: Any = None  # uint32 [batch, heads_q]: see `dropout_lib.row_prefix`
  # int32 [batch] and [heads_q]: the global batch and query-head indices mask_fn / score_fn get
  # (arange before sharding: a shard's kernels see their own slice).
  batch_index: Any = None
  head_index: Any = None
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


# The Mosaic GPU lowering's rules for this package's kernels (lane semantics, warpgroup threads):
# a primitive without one makes the lowering fail. A private table of jax; checked only to refuse
# early and clearly (jax 0.11.2).
def _lowering_rules():
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu import lowering
  return lowering.mosaic_lowering_rules[gpu_core.LANExWG_SEMANTICS]


# Calls whose bodies the kernels trace inline (`_inlined`): the Mosaic GPU lowering has no rule
# for custom_jvp_call (jax.nn.relu, softplus, ...), and a jit in the user's function may hold one.
# The name of the parameter holding each body.
_INLINED_CALLS = {"custom_jvp_call": "call_jaxpr", "jit": "jaxpr", "pjit": "jaxpr",
                  "closed_call": "call_jaxpr"}


def _eval_inlined(jaxpr, consts, args):
  env = {}
  read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    body = _INLINED_CALLS.get(eqn.primitive.name)
    if body is not None:
      closed = eqn.params[body]
      outs = _eval_inlined(closed.jaxpr, closed.consts, invals)
    else:
      outs = eqn.primitive.bind(*invals, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _inlined(fn, *args):
  """fn(*args), traced with the calls of `_INLINED_CALLS` replaced by their bodies. Derivatives
  are taken before (`jax.jvp` of the user's function), so custom rules still apply."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  outs = _eval_inlined(closed.jaxpr, closed.consts, jax.tree.leaves(args))
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _unlowerable_primitives(jaxpr) -> set[str]:
  rules = _lowering_rules()
  missing = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive not in rules and eqn.primitive.name not in _INLINED_CALLS:
      missing.add(eqn.primitive.name)
    for sub in jax_core.jaxprs_in_params(eqn.params):
      missing |= _unlowerable_primitives(sub)
  return missing


# The abstract arguments of the user's functions in a kernel: a float32 score tile, int32 scalar
# batch and head, int32 tiles of positions (one tile side of every kernel is 64).
_PROBE_TILE = (64, 64)


def _probes(name: str, fn):
  """(function, abstract arguments) pairs: what the kernels trace of `fn`."""
  index = jax.ShapeDtypeStruct(_PROBE_TILE, jnp.int32)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  if name == "mask_fn":
    return [(fn, (scalar, scalar, index, index))]

  def value_and_slope(s, *indices):  # the backward kernels
    return jax.jvp(lambda x: fn(x, *indices), (s,), (jnp.ones_like(s),))

  args = (jax.ShapeDtypeStruct(_PROBE_TILE, jnp.float32), scalar, scalar, index, index)
  return [(fn, args), (value_and_slope, args)]  # the forward kernel, the backward kernels


def _broadcasts_to_tile(shape) -> bool:
  try:
    return jnp.broadcast_shapes(shape, _PROBE_TILE) == _PROBE_TILE
  except ValueError:
    return False


def element_fns_problem(mask_fn, score_fn) -> str | None:
  """Why mask_fn / score_fn cannot be traced into the Mosaic GPU kernels, or None when they can
  (or are None). Traced abstractly with the kernels' argument kinds: a function that closes over
  arrays (constants or traced values: the kernels take no such operand), fails to trace on
  scalar batch/head indices, or uses a primitive the Mosaic GPU lowering lacks, is refused
  (custom_jvp calls such as jax.nn.relu are fine: the kernels trace their bodies inline)."""
  for name, fn in (("mask_fn", mask_fn), ("score_fn", score_fn)):
    if fn is None:
      continue
    for traced, args in _probes(name, fn):
      try:
        closed = jax.make_jaxpr(traced)(*args)
      except Exception as e:  # any failure: the function cannot run on a kernel's tile
        return (f"{name} cannot be traced on a kernel tile (batch, head: int32 scalars; q_idx, "
                f"kv_idx: int32 [rows, cols]): {type(e).__name__}: {e}")
      if closed.consts:
        shapes = ", ".join(f"{jnp.result_type(c)}{list(jnp.shape(c))}" for c in closed.consts)
        return (f"{name} closes over arrays ({shapes}), which cannot be passed into the "
                f"kernels; pass them as bias / mask, or compute them from the indices")
      shape = tuple(closed.out_avals[0].shape)
      if not _broadcasts_to_tile(shape):
        return (f"{name} returned shape {shape} on a {list(_PROBE_TILE)} tile of indices; the "
                f"kernels need a result that broadcasts to the tile (elementwise functions)")
      missing = _unlowerable_primitives(closed.jaxpr)
      if missing:
        return (f"{name} uses {', '.join(sorted(missing))}, which the Mosaic GPU lowering "
                f"does not implement")
  return None


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
                   dropout_rate=0.0, dropout_seed=None, broadcast_dropout=False, *,
                   mask_fn=None, score_fn=None, bias=None, mask=None):
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
  element_fns = batch_index = head_index = None
  if mask_fn is not None or score_fn is not None:
    problem = element_fns_problem(mask_fn, score_fn)
    if problem is not None:
      raise NotImplementedError(f"the Mosaic GPU kernels cannot take this mask_fn / score_fn: "
                                f"{problem}; implementation='blocked_jax' serves it")
    element_fns = ElementFns(mask_fn, score_fn, q_len, kv_len)
    batch_index = jnp.arange(batch, dtype=jnp.int32)
    head_index = jnp.arange(heads_q, dtype=jnp.int32)
  mods = KernelMods(soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                    segment_ids=q_segment_ids is not None, alibi=alibi_slopes is not None,
                    dropout_rate=dropout_rate,
                    broadcast_dropout=bool(broadcast_dropout) and dropout_rate > 0.0,
                    element_fns=element_fns,
                    bias=None if bias is None else BroadcastAxes.of(bias.shape),
                    mask=None if mask is None else BroadcastAxes.of(mask.shape))
  return mods, ModArrays(q_segment_ids, kv_segment_ids, alibi_slopes, prefix, batch_index,
                         head_index, bias, mask)


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


def user_indices(fns: ElementFns, positions):
  """(q_idx, kv_idx) for the user's functions: tile positions clipped into the unpadded
  sequences, as `score_mods.Grid.user_indices` does on the portable path."""
  q_pos, kv_pos = positions
  return jnp.clip(q_pos, 0, fns.q_len - 1), jnp.clip(kv_pos, 0, fns.kv_len - 1)


def element_keep(fns: ElementFns, batch, head, positions):
  """mask_fn on a tile: bool in the tile's shape and layout (positions from
  `common.tile_positions`), True = attend; None without a mask_fn. Pure: a block table (which
  blocks mask_fn hides entirely) can call it on any tile of positions."""
  if fns.mask_fn is None:
    return None
  q_idx, kv_idx = user_indices(fns, positions)
  keep = _inlined(fns.mask_fn, batch, head, q_idx, kv_idx)
  return jnp.broadcast_to(jnp.asarray(keep).astype(jnp.bool_), q_idx.shape)


def element_scores(fns: ElementFns, s, batch, head, positions, *, with_slope: bool):
  """score_fn on the natural-log logit tile `s`: (score_fn(s, ...), d score_fn / d s or None).
  The slope (for the backward kernels) comes from `jax.jvp` traced in the kernel."""
  q_idx, kv_idx = user_indices(fns, positions)
  fn = lambda x: jnp.broadcast_to(fns.score_fn(x, batch, head, q_idx, kv_idx),
                                  s.shape).astype(jnp.float32)
  if not with_slope:
    return _inlined(fn, s), None
  return _inlined(lambda x: jax.jvp(fn, (x,), (jnp.ones_like(x),)), s)


class LogitGrad(NamedTuple):
  """What the backward kernels need to take dS back from the kernel's logit to the raw scaled
  score: the soft-cap's tanh of the tile and score_fn's slope (None where absent)."""

  tanh_s: Any = None
  score_fn_slope: Any = None


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
  backward: bool = False  # the backward kernels: also return score_fn's slope
  row_segment_ids: Any = None  # int32 [rows], WGMMA row layout
  slope: Any = None  # float32 scalar: the ALiBi slope of the current head
  dropout_prefix: Any = None  # uint32 scalar: the dropout hash prefix of (batch, current head)
  user_batch: Any = None  # int32 scalar: the global batch index mask_fn / score_fn get
  user_head: Any = None  # int32 scalar: the global query head mask_fn / score_fn get
  rows: int = 0
  head: Any = None  # the current query head (indexes a bias or mask with a head axis)

  @classmethod
  def create(cls, mods: KernelMods, spec: mask_lib.MaskSpec, scale: float, refs: ModArrays, *,
             batch, row_start, rows: int, kv_length, head=None, transposed: bool = False,
             backward: bool = False) -> TileScorer:
    """`head` None: the head changes per step group (dK/dV over a GQA group): see `for_head`."""
    row_ids = None
    if mods.segment_ids:
      row_ref = refs.kv_segment_ids if transposed else refs.q_segment_ids
      row_ids = _load_ids(row_ref, batch, row_start, rows, common.WGMMA_ROW)
    user_batch = None if mods.element_fns is None else refs.batch_index[batch]
    scorer = cls(mods=mods, spec=spec, scale=scale, refs=refs, batch=batch, row_start=row_start,
                 kv_length=kv_length, transposed=transposed, backward=backward, rows=rows,
                 row_segment_ids=row_ids, user_batch=user_batch)
    return scorer if head is None else scorer.for_head(head)

  def for_head(self, head) -> TileScorer:
    """This scorer for query head `head` (reads its ALiBi slope, dropout hash prefix, global
    index; bias and mask tiles are read per tile, at this head)."""
    scorer = dataclasses.replace(self, head=head)
    if self.mods.alibi:
      scorer = dataclasses.replace(scorer, slope=self.refs.alibi_slopes[head])
    if self.mods.dropout_rate > 0.0:
      scorer = dataclasses.replace(scorer,
                                   dropout_prefix=self.refs.dropout_prefix[self.batch, head])
    if self.mods.element_fns is not None:
      scorer = dataclasses.replace(scorer, user_head=self.refs.head_index[head])
    return scorer

  def columns(self, block, size: int, *, masked: bool = True) -> Columns:
    """The columns of the next tile: block `block` of `size` positions. Call it before waiting
    for the tile's data, so that loading the segment ids overlaps the wait. An unmasked tile
    needs no segment ids nor mask (see `__call__`)."""
    cols = Columns(block, size)
    if self.mods.segment_ids and masked:
      col_ref = self.refs.q_segment_ids if self.transposed else self.refs.kv_segment_ids
      cols = cols._replace(
          segment_ids=_load_ids(col_ref, self.batch, cols.start, size, common.WGMMA_COL))
    if self.mods.bias is not None:
      cols = cols._replace(bias=self._load_pair(self.refs.bias, self.mods.bias, cols))
    if self.mods.mask is not None and masked:
      cols = cols._replace(mask=self._load_pair(self.refs.mask, self.mods.mask, cols))
    return cols

  def _load_pair(self, ref, axes: BroadcastAxes, cols: Columns) -> PairOperand:
    if self.transposed:  # the array is transposed too (`ModArrays.transposed_pairs`)
      axes = dataclasses.replace(axes, q=axes.kv, kv=axes.q)
    return _load_pair(ref, axes, self.batch, self.head, self.row_start, self.rows, cols.start,
                      cols.size)

  def __call__(self, s, cols: Columns, *, masked: bool):
    """Base-2 logits of the raw float32 tile `s` (WGMMA layout), -inf where hidden.

    masked: apply the positional mask (causal / window / key length), the segment mask, the
    boolean mask and mask_fn. The positional range ends need it, the tiles in between do not;
    with segment ids, a mask or a mask_fn the block table decides (`ops._visibility`: an
    unmasked tile holds one segment on both sides and passes the mask and mask_fn everywhere).
    Returns (logits, LogitGrad): for `logit_grad` in the backward kernels.
    """
    mods = self.mods
    fns = mods.element_fns
    positions = None
    if mods.alibi or fns is not None:
      positions = self._positions(s, cols)
    if mods.alibi:
      distance = self._alibi_distance(positions)
    tanh_s = score_fn_slope = None
    if fns is not None and fns.score_fn is not None:
      # score_fn takes the natural-log logit: form it, apply score_fn, then cap or go to base 2.
      x = s * self.scale
      if mods.bias is not None:
        x = x + cols.bias.expand(x.shape)
      if mods.alibi:
        x = x - self.slope * distance
      x, score_fn_slope = element_scores(fns, x, self.user_batch, self.user_head, positions,
                                         with_slope=self.backward)
      if mods.soft_cap is None:
        s = x * common.LOG2E
      else:
        tanh_s = jnp.tanh(x * (1.0 / mods.soft_cap))
        s = tanh_s * (mods.soft_cap * common.LOG2E)
    elif mods.soft_cap is None:
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
    if mods.segment_ids and masked:
      same = (common.broadcast_rows(self.row_segment_ids, s.shape)
              == common.broadcast_cols(cols.segment_ids, s.shape))
      keep = same if keep is None else keep & same
    if mods.mask is not None and masked:
      allowed = cols.mask.expand(s.shape) != 0.0
      keep = allowed if keep is None else keep & allowed
    if fns is not None and fns.mask_fn is not None and masked:
      allowed = element_keep(fns, self.user_batch, self.user_head, positions)
      keep = allowed if keep is None else keep & allowed
    if keep is not None:
      s = jnp.where(keep, s, -jnp.inf)
    return s, LogitGrad(tanh_s, score_fn_slope)

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


def logit_grad(ds, grad: LogitGrad):
  """dS with respect to the raw scaled score (before score_fn and the soft-cap): times the
  cap's derivative d(cap * tanh(x / cap))/dx = 1 - tanh^2, then score_fn's slope."""
  if grad.tanh_s is not None:
    ds = ds * (1.0 - grad.tanh_s * grad.tanh_s)
  if grad.score_fn_slope is not None:
    ds = ds * grad.score_fn_slope
  return ds
