"""Materialized attention in plain jnp: the test oracle, and the `"reference"` implementation.

It builds the full [batch, heads, q_len, kv_len] score matrix, so it costs O(N^2) memory; use it
to check the blocked paths, never for long sequences. Numerics mirror jax.nn's xla path: scores in
float32, masked scores replaced by the same large finite negative value (so a fully masked row
averages all values), softmax in float32, probabilities cast to the input dtype before the second
matmul, and rows at or past `q_lengths` zeroed. The score modifications (bias, ALiBi, score_fn,
soft-cap, masks, dropout) are `score_mods`' element functions on the whole grid, the very code the
blocked path runs per tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn import score_mods


def reference_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                        bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                        scale: float, spec: mask_lib.MaskSpec = mask_lib.MaskSpec(),
                        q_lengths: jax.Array | None = None,
                        kv_lengths: jax.Array | None = None,
                        mods: score_mods.ScoreMods = score_mods.ScoreMods(),
                        arrays: score_mods.ScoreArrays | None = None
                        ) -> tuple[jax.Array, jax.Array]:
  """Dense attention.

  Args:
    query: [batch, q_len, heads_q, head_dim].
    key, value: [batch, kv_len, heads_kv, head_dim], heads_q a multiple of heads_kv.
    bias: broadcastable to [batch, heads_q, q_len, kv_len], added after scaling.
    mask: boolean, broadcastable to [batch, heads_q, q_len, kv_len]; True = attend.
    scale: multiplies q.k before bias and masking.
    spec: causal / local window / alignment offset.
    q_lengths, kv_lengths: int32 [batch] or None.
    mods, arrays: the other score modifications (see `score_mods`); `arrays` carries every
      dynamic array, bias and mask included, and then `bias` and `mask` must be None.

  Returns:
    (out [batch, q_len, heads_q, head_dim] in query.dtype,
     lse [batch, heads_q, q_len] float32, natural log, of the undropped softmax; a fully masked
     row gets `numerics.MASK_VALUE` as jax.nn does).
  """
  if arrays is None:
    arrays = score_mods.ScoreArrays(bias=bias, mask=mask)
  elif bias is not None or mask is not None:
    raise ValueError("pass bias and mask either directly or inside `arrays`, not both")
  batch, q_len, heads_q, head_dim = query.shape
  kv_len, heads_kv = key.shape[1], key.shape[2]
  groups = heads_q // heads_kv
  # GQA: query head h uses kv head h // groups (jax.nn's grouping).
  key = jnp.repeat(key, groups, axis=2)
  value = jnp.repeat(value, groups, axis=2)

  logits_dtype = jnp.promote_types(query.dtype, jnp.float32)
  logits = jnp.einsum("bthd,bshd->bhts", query, key, preferred_element_type=logits_dtype,
                      precision=jax.lax.Precision.HIGHEST)
  logits = logits * jnp.asarray(scale, logits_dtype)
  # The same element functions as the blocked path, evaluated on the whole [B, H, T, S] grid.
  grid = score_mods.Grid.whole(batch, heads_q, q_len, kv_len)
  tiles = score_mods.tile_arrays(arrays, grid)
  logits = score_mods.modified_scores(mods, spec, logits, grid, tiles).astype(logits_dtype)
  keep = jnp.broadcast_to(score_mods.kept(mods, spec, grid, tiles, q_lengths, kv_lengths),
                          logits.shape)
  logits = jnp.where(keep, logits, numerics.MASK_VALUE).astype(jnp.float32)

  lse = jax.nn.logsumexp(logits, axis=-1)
  # softmax, not exp(s - lse): on a fully masked row the lse rounds to MASK_VALUE and exp(s - lse)
  # would give weight 1 to every key instead of 1/kv_len.
  probs = jax.nn.softmax(logits, axis=-1)
  if mods.dropout_rate > 0.0:
    # Rows that see no key keep jax.nn's uniform weights, undropped, as the blocked paths give
    # them (`numerics.finalize_empty_rows`).
    dropped = jnp.where(score_mods.dropout_keep(mods, grid, tiles),
                        probs / (1.0 - mods.dropout_rate), 0.0)
    probs = jnp.where(keep.any(axis=-1, keepdims=True), dropped, probs)
  probs = probs.astype(value.dtype)
  out = jnp.einsum("bhts,bshd->bthd", probs, value, precision=jax.lax.Precision.HIGHEST)
  if q_lengths is not None:
    row_valid = jnp.arange(q_len)[None, :] < q_lengths[:, None]
    out = out * row_valid[:, :, None, None].astype(out.dtype)
  return out.astype(query.dtype), lse
