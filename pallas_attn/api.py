"""`attention`: the drop-in for `jax.nn.dot_product_attention`.

This layer checks the arguments (raising before anything is traced into a kernel), normalizes them
(rank-3 inputs, default scale, window as a pair, default lengths; the score modifications through
`score_args`), asks `dispatch` for an implementation, and gives fully masked and padded rows
jax.nn's values.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import dispatch
from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn import score_args
from pallas_attn import score_mods

Implementation = Literal["mosaic_gpu", "blocked_jax", "reference"]

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def _shape_of(name: str, x) -> tuple[int, ...]:
  return tuple(score_args.checked_array(name, x).shape)


def _check_broadcast_4d(name: str, x, full_shape: tuple[int, int, int, int]):
  """bias/mask (already given leading axes up to rank 4) must broadcast to
  [batch, heads_q, q_len, kv_len] (jax.nn: head axis 1 or heads_q)."""
  shape = _shape_of(name, x)
  if len(shape) != 4:
    raise ValueError(f"{name} must have rank <= 4, broadcastable to [batch, heads, q_len, kv_len] = "
                     f"{full_shape}; got shape {shape}")
  for axis, (got, want) in enumerate(zip(shape, full_shape)):
    if got not in (1, want):
      raise ValueError(f"{name} shape {shape} does not broadcast to [batch, heads, q_len, kv_len]"
                       f" = {full_shape} (axis {axis}: {got} vs {want})")


def _leading_ones_to_4d(name: str, x):
  if x is None:
    return None
  shape = _shape_of(name, x)
  return jnp.reshape(x, (1,) * (4 - len(shape)) + shape) if len(shape) < 4 else x


def _check_lengths(name: str, lengths, batch: int):
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {lengths.shape}")
  if lengths.dtype != jnp.int32:
    raise TypeError(f"{name} must be int32 (as in jax.nn), got {lengths.dtype}")
  return lengths


def attention(query: jax.Array, key: jax.Array, value: jax.Array,
              bias: jax.Array | None = None, mask: jax.Array | None = None, *,
              scale: float | None = None, is_causal: bool = False,
              query_seq_lengths: jax.Array | None = None,
              key_value_seq_lengths: jax.Array | None = None,
              local_window_size: int | tuple[int, int] | None = None,
              implementation: Implementation | None = None,
              return_residual: bool = False,
              interpret: bool = False,
              segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
              causal_alignment: mask_lib.CausalAlignment = "top_left",
              logits_soft_cap: float | None = None,
              alibi_slopes: jax.Array | None = None,
              dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None,
              broadcast_dropout: bool = False,
              mask_fn: score_mods.MaskFn | None = None,
              score_fn: score_mods.ScoreFn | None = None,
              deterministic_backward: bool = False):
  """Exact attention `softmax(q.k^T * scale + bias, masked) v`, blocked so that no
  [q_len, kv_len] array reaches device memory (except on the `"reference"` path).

  Same signature and semantics as `jax.nn.dot_product_attention` (jax 0.11.2), plus `interpret`
  and the keyword-only score modifications after it.

  Order of operations, per score element (b, h, i, j), the same on every implementation:
    1. s = scale * q_i . k_j (float32)
    2. s += bias[b, h, i, j]
    3. s -= alibi_slopes[b, h] * |i + offset - j|   (offset: see causal_alignment)
    4. s = score_fn(s, b, h, i, j)
    5. s = logits_soft_cap * tanh(s / logits_soft_cap)
    6. hide s unless: mask, is_causal / local_window_size, the seq lengths, equal segment ids
       and mask_fn all allow it
    7. p = softmax over j (the returned lse is this softmax's log-sum-exp, float32)
    8. dropout: p *= keep(b, h, i, j) / (1 - dropout_rate)
    9. out = p . v
  The soft-cap comes after bias and ALiBi so that it bounds every logit the softmax sees (as
  tokamax does); a large negative bias is then capped to -logits_soft_cap instead of removing the
  key, so mask with `mask`/`mask_fn`, not with bias, when soft-capping. A row that no key passes in
  step 6 gets jax.nn's uniform weights over all keys (the mean of value; lse = -0.7 *
  finfo(float32).max), without dropout.

  Args:
    query: [batch, q_len, heads_q, head_dim] (or rank 3 without batch).
    key, value: [batch, kv_len, heads_kv, head_dim]; heads_q % heads_kv == 0 (GQA/MQA).
    bias: optional, broadcastable to [batch, heads_q, q_len, kv_len] (rank < 4: leading axes
      of 1 are added, as in jax.nn); added after scaling. Differentiable: its gradient has the
      bias's own shape (summed over broadcast axes).
    mask: optional boolean, broadcastable like bias; True = attend.
    scale: defaults to 1/sqrt(head_dim).
    is_causal: query i sees key j iff j <= i + offset (offset 0 by default: top-left, jax.nn).
    query_seq_lengths: int32 [batch]; rows at or past it are zeroed (and get no gradient).
    key_value_seq_lengths: int32 [batch]; keys at or past it are ignored.
    local_window_size: int or (left, right); query i sees keys i+offset-left..i+offset+right.
    implementation: "mosaic_gpu" (Hopper Pallas kernels), "blocked_jax" (portable pure-JAX
      FlashAttention), "reference" (materialized), or None for the fastest that supports the call.
      An implementation asked for a feature it lacks raises NotImplementedError.
    return_residual: also return the log-sum-exp, [batch, q_len, heads_q], kept in float32
      (jax.nn casts it to the input dtype).
    interpret: run the Mosaic GPU kernels in the Pallas Mosaic GPU interpreter (CPU).
    segment_ids: packed sequences: int32 [batch, seq] (when q_len == kv_len) or a pair
      (q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len]); query i sees key j only if
      their ids are equal. The blocked path skips tiles whose id ranges cannot meet.
    causal_alignment: "top_left" (jax.nn; offset 0) or "bottom_right" (FlashAttention; offset
      kv_len - q_len: the last query sits on the last key). Moves the causal diagonal, the
      local window and ALiBi's zero. The offset comes from the array lengths, not from the
      seq-lengths arguments.
    logits_soft_cap: optional positive float: s -> cap * tanh(s / cap) (step 5).
    alibi_slopes: optional float32 [heads_q] or [batch, heads_q]: adds -slope * |i + offset - j|,
      computed per tile, never stored (step 3). Differentiable.
    dropout_rate: probability in [0, 1) of dropping an attention weight (step 8). The keep-mask
      is a counter-based hash of (seed, b, h, i, j) (`pallas_attn.dropout`), regenerated in the
      backward pass: deterministic for a key, never stored.
    dropout_rng: a PRNG key (jax.random.key or a raw uint32 [2] key); needed when
      dropout_rate > 0.
    broadcast_dropout: one keep-mask for every batch element and head (Flax's
      broadcast_dropout); default False, a mask per (b, h).
    mask_fn: FlexAttention-style mask_mod, mask_fn(b, h, q_idx, kv_idx) -> bool (True = attend),
      called on int32 index arrays of shapes [B, 1, 1, 1], [1, H, 1, 1], [1, 1, T, 1],
      [1, 1, 1, S] (T and S a tile's extent on the blocked path); must broadcast elementwise.
      The blocked path evaluates it on every tile once before each pass to skip empty tiles.
    score_fn: FlexAttention-style score_mod, score_fn(score, b, h, q_idx, kv_idx) -> score, on
      float32 scores [B, H, T, S] and the same index arrays; elementwise; differentiated
      through (step 4). On the blocked path (a custom_vjp) mask_fn and score_fn may close over
      constants and jit arguments, but differentiating with respect to a value they close over
      is an error (JAX's UnexpectedTracerError): pass a learned bias as `bias` instead.
      The Mosaic GPU kernels trace both functions in, with b and h int32 scalars (global batch
      index, query head) and q_idx, kv_idx int32 tiles; functions that close over arrays or use
      primitives the kernels cannot lower are served by the blocked path (see README).
    deterministic_backward: gradients equal to the bit from run to run (FlashAttention's
      `deterministic`). The Mosaic GPU backward by default makes dQ inside its dK/dV kernel,
      every key tile adding its part into a float32 dQ with TMA reduce-adds in whatever order
      the CTAs reach it, so dQ's rounding varies between runs; with this flag dQ comes from a
      kernel of its own that sums each query tile's key blocks in a fixed order (slower: see
      README). The portable and reference paths sum in a fixed order already (as
      deterministic as XLA's own ops; on a GPU, XLA_FLAGS=--xla_gpu_deterministic_ops=true).
      Not to be confused with Flax's `deterministic`, which turns dropout off.

  Returns:
    out [batch, q_len, heads_q, head_dim] in the input dtype; with return_residual,
    (out, lse).
  """
  q_shape = _shape_of("query", query)
  k_shape = _shape_of("key", key)
  v_shape = _shape_of("value", value)
  if len(q_shape) not in (3, 4):
    raise ValueError(f"query must be [batch, q_len, heads, head_dim] (or rank 3 without batch); "
                     f"got shape {q_shape}")
  if len(k_shape) != len(q_shape) or len(v_shape) != len(q_shape):
    raise ValueError(f"query, key and value must have the same rank; got query {q_shape}, "
                     f"key {k_shape}, value {v_shape}")
  unbatched = len(q_shape) == 3
  if unbatched:  # jax.nn adds a batch axis of 1 (lengths then have shape (1,))
    query, key, value = query[None], key[None], value[None]
  # jax.nn gives bias and mask of rank < 4 leading axes of size 1.
  bias = _leading_ones_to_4d("bias", bias)
  mask = _leading_ones_to_4d("mask", mask)

  batch, q_len, heads_q, head_dim = query.shape
  if key.shape[0] != batch or value.shape[0] != batch:
    raise ValueError(f"batch mismatch: query {q_shape}, key {k_shape}, value {v_shape}")
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape; got key {k_shape}, "
                     f"value {v_shape}")
  kv_len, heads_kv, kv_head_dim = key.shape[1:]
  if kv_head_dim != head_dim:
    raise ValueError(f"key head_dim {kv_head_dim} != query head_dim {head_dim} "
                     f"(query {q_shape}, key {k_shape})")
  if heads_q % heads_kv:
    raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads "
                     f"({heads_kv}) for GQA/MQA; query {q_shape}, key {k_shape}")
  dtype = jnp.dtype(query.dtype)
  if dtype not in map(jnp.dtype, _FLOAT_DTYPES):
    raise TypeError(f"query dtype must be one of float16, bfloat16, float32, float64; "
                    f"got {dtype}")
  if key.dtype != dtype or value.dtype != dtype:
    raise TypeError(f"query, key and value must share a dtype; got query {dtype}, "
                    f"key {key.dtype}, value {value.dtype}")
  full_shape = (batch, heads_q, q_len, kv_len)
  if bias is not None:
    _check_broadcast_4d("bias", bias, full_shape)
  if mask is not None:
    _check_broadcast_4d("mask", mask, full_shape)
    if jnp.dtype(mask.dtype) != jnp.dtype(bool):
      raise TypeError(f"mask must be boolean (use bias for additive masks); got {mask.dtype}")
  q_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  if isinstance(local_window_size, (int, np.integer)):
    local_window_size = (int(local_window_size), int(local_window_size))
  if local_window_size is not None:
    if len(local_window_size) != 2:
      raise ValueError(f"local_window_size must be an int or (left, right); "
                       f"got {local_window_size}")
    local_window_size = tuple(int(w) for w in local_window_size)
  spec = mask_lib.MaskSpec(is_causal=bool(is_causal), local_window=local_window_size,
                           offset=mask_lib.alignment_offset(causal_alignment, q_len, kv_len))
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim)
  mods, arrays = score_args.score_modifications(
      batch=batch, q_len=q_len, kv_len=kv_len, heads_q=heads_q, unbatched=unbatched, bias=bias,
      mask=mask, segment_ids=segment_ids, logits_soft_cap=logits_soft_cap,
      alibi_slopes=alibi_slopes, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      broadcast_dropout=broadcast_dropout, mask_fn=mask_fn, score_fn=score_fn)

  call = dispatch.AttentionCall(
      batch=batch, q_len=q_len, kv_len=kv_len, heads_q=heads_q, heads_kv=heads_kv,
      head_dim=head_dim, dtype=dtype, has_bias=bias is not None, has_mask=mask is not None,
      interpret=interpret, has_segment_ids=arrays.q_segment_ids is not None,
      bottom_right=spec.offset != 0 and spec.is_banded,
      has_alibi=arrays.alibi_slopes is not None,
      alibi_per_batch=arrays.alibi_slopes is not None and arrays.alibi_slopes.shape[0] > 1,
      has_soft_cap=mods.logits_soft_cap is not None,
      has_dropout=mods.dropout_rate > 0.0, has_mask_fn=mask_fn is not None,
      has_score_fn=score_fn is not None,
      element_fns_problem=(None if implementation in ("blocked_jax", "reference")
                           else dispatch.element_fns_problem(mask_fn, score_fn)))
  impl = dispatch.choose(call, implementation)
  out, lse = impl(query, key, value, arrays, scale=float(scale), spec=spec, mods=mods,
                  q_lengths=q_lengths, kv_lengths=kv_lengths, interpret=interpret,
                  deterministic_backward=bool(deterministic_backward))
  # Rows that see no key get jax.nn's values, and rows past their query length zeros: a pass
  # over the whole output (and a mean of V), which costs ~5% of a 4096-long forward on an H200.
  # Skipped where no row can be empty: only lengths, masks, segment ids, the user's functions,
  # a bias (-inf entries) or a band that misses the keys empty a row.
  rows_may_be_empty = (
      q_lengths is not None or kv_lengths is not None or mask is not None
      or mask_fn is not None or score_fn is not None or bias is not None
      or arrays.q_segment_ids is not None
      or not mask_lib.every_row_sees_a_key(spec, q_len, kv_len))
  if rows_may_be_empty:
    out, lse = numerics.finalize_empty_rows(out, lse, value, q_lengths)
  if unbatched:
    out, lse = out[0], lse[0]
  if return_residual:
    return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2))
  return out
