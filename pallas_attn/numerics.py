"""The one numerics convention every implementation shares.

- Scores are float32 `s = scale * q.k`. The log-sum-exp `lse` is natural-log, float32, over the
  scores of the keys a query sees.
- Inside the blocked paths a hidden score is -inf and the running max starts at `M_INIT`, a finite
  very negative number, so `exp(m_old - m_new)` never meets inf - inf.
- A row that sees no key at all (fully masked, or at/after its query length) leaves the blocked
  paths with `lse = +inf` ("empty row") and a zero output; with that lse every recomputed
  probability `exp(s - lse)` is 0, so the backward pass gives it no gradient.
- `finalize_empty_rows` then gives such rows jax.nn's values: jax.nn replaces hidden scores by
  `MASK_VALUE` (finite), so a fully masked row's softmax is uniform over all keys: the output is
  the mean of every value row and the lse is `MASK_VALUE` (+ log(kv_len), lost to rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# jax.nn's large negative for float32 scores: -0.7 * finfo(float32).max.
MASK_VALUE = float(-0.7 * np.finfo(np.float32).max)
# Initial running max of the online softmax: finite, below every real score.
M_INIT = float(np.finfo(np.float32).min)
EMPTY_LSE = float("inf")


def online_softmax_step(m_prev, l_prev, acc_prev, s, v_block, probs_dtype, dropout_keep=None,
                        keep_scale: float = 1.0):
  """One step of the FlashAttention recurrence over a [rows, block] tile of scores.

  m: running max [rows]; l: running sum of exp(s - m) [rows]; acc: unnormalized output
  [rows, head_dim]. When the max grows, the old statistics are rescaled by exp(m_prev - m_new).
  Probabilities are cast to `probs_dtype` before the second matmul, as the kernels and jax.nn do.
  dropout_keep: optional bool [rows, block]; the running sum (hence the lse) covers every
  probability, but only the kept ones, times `keep_scale` (1 / (1 - rate)), reach the output.
  """
  m_new = jnp.maximum(m_prev, s.max(axis=-1))
  alpha = jnp.exp(m_prev - m_new)
  p = jnp.exp(s - m_new[..., None])
  l_new = l_prev * alpha + p.sum(axis=-1)
  if dropout_keep is not None:
    p = jnp.where(dropout_keep, p * keep_scale, 0.0)
  pv = jnp.einsum("...qk,...kd->...qd", p.astype(probs_dtype), v_block,
                  preferred_element_type=jnp.float32)
  acc_new = acc_prev * alpha[..., None] + pv
  return m_new, l_new, acc_new


def finish(m, l, acc, out_dtype):
  """Normalize the accumulator and form the lse; rows with l == 0 are empty (lse = +inf)."""
  empty = l == 0.0
  out = acc / jnp.where(empty, 1.0, l)[..., None]
  lse = jnp.where(empty, EMPTY_LSE, m + jnp.log(jnp.where(empty, 1.0, l)))
  return out.astype(out_dtype), lse


def finalize_empty_rows(out: jax.Array, lse: jax.Array, value: jax.Array,
                        q_lengths: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """Give rows that saw no key jax.nn's values, and zero rows at or past `q_lengths`.

  out: [batch, q_len, heads_q, head_dim]; lse: [batch, heads_q, q_len] (+inf marks empty rows);
  value: [batch, kv_len, heads_kv, head_dim]. Differentiable: the mean of `value` carries the
  gradient jax.nn gives a fully masked row (dv = do / kv_len on every key, no dq, no dk).
  """
  batch, q_len, heads_q, _ = out.shape
  heads_kv = value.shape[2]
  empty = jax.lax.stop_gradient(lse == EMPTY_LSE)  # [batch, heads_q, q_len]
  mean_v = value.astype(jnp.float32).mean(axis=1)  # [batch, heads_kv, head_dim]
  # [batch, 1, heads_q, head_dim]: query head h reads kv head h // group.
  mean_v = jnp.repeat(mean_v, heads_q // heads_kv, axis=1)[:, None]
  # Selected in float32 and only then cast (one fused elementwise pass; the output's values
  # round-trip exactly): the transpose of the broadcast over the rows, dv's share of the empty
  # rows (a sum of d_out over every such row), then adds in float32. Summed in the output's bf16 /
  # f16, its rounding exceeded the whole backward's where most rows are empty. (The broadcast
  # stays implicit in the select: an explicit [batch, q_len, ...] one is replicated under
  # explicit sharding, and its cotangent was all-gathered on a sequence-sharded ring.)
  out = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], mean_v,
                  out.astype(jnp.float32)).astype(out.dtype)
  lse = jnp.where(empty, MASK_VALUE, lse)
  if q_lengths is not None:
    row_valid = jnp.arange(q_len)[None, :] < q_lengths[:, None]
    out = out * row_valid[:, :, None, None].astype(out.dtype)
  return out, lse


def delta(d_out: jax.Array, out: jax.Array) -> jax.Array:
  """delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij, the softmax Jacobian's correction term of the
  backward pass (dS = P * (dP - delta)). d_out, out: [batch, q_len, heads, head_dim]; returns
  [batch, heads, q_len] float32. Pass the float32 output where there is one: from a bf16/f16 output,
  the rounding of delta is amplified in dS when the softmax is peaked."""
  return jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))


def merge_partials(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array,
                   lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Attention over the union of two disjoint key sets, from the attention over each.

  out: [batch, q_len, heads, head_dim] float32; lse: [batch, heads, q_len] float32, +inf on rows
  that saw no key of that set. Each output is weighted by its share of the softmax mass,
  exp(lse_x - lse), with lse = log(exp(lse_a) + exp(lse_b)). A row empty in both sets stays
  empty (zero output, lse +inf) instead of becoming 0/0.
  """
  neg_a = jnp.where(lse_a == EMPTY_LSE, -jnp.inf, lse_a)  # an empty set adds exp(-inf) = 0
  neg_b = jnp.where(lse_b == EMPTY_LSE, -jnp.inf, lse_b)
  m = jnp.maximum(neg_a, neg_b)
  empty = m == -jnp.inf
  m = jnp.where(empty, 0.0, m)
  w_a, w_b = jnp.exp(neg_a - m), jnp.exp(neg_b - m)
  total = jnp.where(empty, 1.0, w_a + w_b)
  lse = jnp.where(empty, EMPTY_LSE, m + jnp.log(total))
  row = lambda w: jnp.swapaxes(w / total, 1, 2)[..., None]  # [B, H, T] -> [B, T, H, 1]
  return out_a * row(w_a) + out_b * row(w_b), lse
