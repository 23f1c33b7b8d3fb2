"""Checks of `attention`'s score-modification arguments, and their normal form.

Turns segment_ids, logits_soft_cap, alibi_slopes, dropout_*, mask_fn and score_fn (with the
already checked bias and mask) into the static `score_mods.ScoreMods` and the dynamic
`score_mods.ScoreArrays` every implementation takes. Every error names the argument and the
shapes, and is raised before anything is traced into an implementation.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from pallas_attn import dropout
from pallas_attn import score_mods


def checked_array(name: str, x) -> jax.Array:
  """`x`, or a TypeError naming the argument when it is not an array (every array argument of
  `attention` goes through here)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  return x


def _segment_ids(name: str, ids, batch: int, length: int, unbatched: bool):
  ids = checked_array(name, ids)
  if unbatched and ids.ndim == 1:  # rank-3 inputs: jax.nn-style missing batch axis
    ids = ids[None]
  if tuple(ids.shape) != (batch, length):
    want = f"({length},) or (1, {length})" if unbatched else f"(batch, seq) = ({batch}, {length})"
    raise ValueError(f"{name} must have shape {want}; got {tuple(ids.shape)}")
  if jnp.dtype(ids.dtype) != jnp.dtype(jnp.int32):
    raise TypeError(f"{name} must be int32; got {ids.dtype}")
  return ids


def segment_id_pair(segment_ids, batch: int, q_len: int, kv_len: int, unbatched: bool):
  """(q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len]) int32, or (None, None)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"segment_ids must be one array or a pair (q_segment_ids, "
                       f"kv_segment_ids); got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
    return (_segment_ids("q_segment_ids", q_ids, batch, q_len, unbatched),
            _segment_ids("kv_segment_ids", kv_ids, batch, kv_len, unbatched))
  if q_len != kv_len:
    raise ValueError(f"a single segment_ids array needs q_len == kv_len (got {q_len} and "
                     f"{kv_len}); pass a pair (q_segment_ids [batch, {q_len}], kv_segment_ids "
                     f"[batch, {kv_len}])")
  ids = _segment_ids("segment_ids", segment_ids, batch, q_len, unbatched)
  return ids, ids


def _alibi_slopes(slopes, batch: int, heads_q: int):
  if slopes is None:
    return None
  slopes = checked_array("alibi_slopes", slopes)
  if not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must be floating point (float32); got {slopes.dtype}")
  shape = tuple(slopes.shape)
  if shape == (heads_q,):
    slopes = slopes[None]
  elif shape != (batch, heads_q):
    raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or "
                     f"(batch, heads_q) = ({batch}, {heads_q}); got {shape}")
  return slopes.astype(jnp.float32)


def _soft_cap(cap):
  if cap is None:
    return None
  if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
    raise TypeError(f"logits_soft_cap must be a Python float (a static value) or None; "
                    f"got {type(cap).__name__}")
  if not cap > 0:
    raise ValueError(f"logits_soft_cap must be positive; got {cap}")
  return float(cap)


def _dropout_seed(rate, rng, broadcast):
  if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
    raise TypeError(f"dropout_rate must be a Python float (a static value); got "
                    f"{type(rate).__name__}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1); got {rate}")
  if not isinstance(broadcast, bool):
    raise TypeError(f"broadcast_dropout must be a bool; got {type(broadcast).__name__}")
  if rate == 0.0:
    return None  # rate 0 is no dropout, whatever the key
  if rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng (a jax.random.key)")
  rng = checked_array("dropout_rng", rng)
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  raw = not typed and rng.dtype == jnp.uint32 and tuple(rng.shape) == (2,)
  if not ((typed and rng.shape == ()) or raw):
    raise TypeError(f"dropout_rng must be one PRNG key (jax.random.key(...), or a raw uint32 "
                    f"(2,) key); got dtype {rng.dtype}, shape {tuple(rng.shape)}")
  return dropout.seed_from_key(rng)


def _check_element_fn(name: str, fn, args, want_bool: bool, full_shape):
  """Trace `fn` abstractly on the index arrays of the whole grid: right arity, result dtype and
  a shape that broadcasts to [batch, heads_q, q_len, kv_len]."""
  if fn is None:
    return
  if not callable(fn):
    raise TypeError(f"{name} must be callable; got {type(fn).__name__}")
  result = jax.eval_shape(fn, *args)
  if not hasattr(result, "shape") or not hasattr(result, "dtype"):
    raise TypeError(f"{name} must return an array; got {type(result).__name__}")
  if want_bool and jnp.dtype(result.dtype) != jnp.dtype(bool):
    raise TypeError(f"mask_fn must return booleans (True = attend); got {result.dtype}")
  if not want_bool and not jnp.issubdtype(result.dtype, jnp.floating):
    raise TypeError(f"score_fn must return floating scores; got {result.dtype}")
  try:
    if jnp.broadcast_shapes(tuple(result.shape), full_shape) != full_shape:
      raise ValueError
  except ValueError:
    raise ValueError(f"{name} returned shape {tuple(result.shape)}, which does not broadcast to "
                     f"[batch, heads, q_len, kv_len] = {full_shape}") from None


def score_modifications(*, batch: int, q_len: int, kv_len: int, heads_q: int, unbatched: bool,
                        bias, mask, segment_ids, logits_soft_cap, alibi_slopes, dropout_rate,
                        dropout_rng, broadcast_dropout, mask_fn, score_fn
                        ) -> tuple[score_mods.ScoreMods, score_mods.ScoreArrays]:
  """Check the arguments and return (ScoreMods, ScoreArrays). bias and mask arrive checked."""
  q_ids, kv_ids = segment_id_pair(segment_ids, batch, q_len, kv_len, unbatched)
  seed = _dropout_seed(dropout_rate, dropout_rng, broadcast_dropout)
  full_shape = (batch, heads_q, q_len, kv_len)
  index = lambda axis, n: jax.ShapeDtypeStruct(tuple(n if a == axis else 1 for a in range(4)),
                                               jnp.int32)
  indices = [index(axis, n) for axis, n in enumerate(full_shape)]
  _check_element_fn("mask_fn", mask_fn, indices, True, full_shape)
  _check_element_fn("score_fn", score_fn,
                    [jax.ShapeDtypeStruct(full_shape, jnp.float32), *indices], False, full_shape)
  mods = score_mods.ScoreMods(logits_soft_cap=_soft_cap(logits_soft_cap), score_fn=score_fn,
                              mask_fn=mask_fn, dropout_rate=float(dropout_rate),
                              broadcast_dropout=broadcast_dropout)
  arrays = score_mods.ScoreArrays(bias=bias, mask=mask, q_segment_ids=q_ids,
                                  kv_segment_ids=kv_ids,
                                  alibi_slopes=_alibi_slopes(alibi_slopes, batch, heads_q),
                                  dropout_seed=seed)
  return mods, arrays
