"""`varlen_attention`: FlashAttention's variable-length API (`flash_attn_varlen_func`) on top of
`attention`'s segment ids.

Sequences of different lengths packed end to end along one token axis, `cu_seqlens` their
cumulative boundaries, as FlashAttention takes them. Each token gets its sequence's index as a
segment id, so a query sees only its own sequence's keys, and the kernels skip every tile where
two sequences meet nowhere (the block tables of `mosaic_gpu/block_table.py`; `blocked_jax` skips
them too): the work is that of the sequences, not of the packed length squared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import api


def _segment_ids(name: str, cu_seqlens, total: int, pad_id: int) -> tuple[jax.Array, jax.Array]:
  """(segment id of each of `total` tokens [total] int32, tokens in sequences [1] int32): token t
  is in sequence i where cu_seqlens[i] <= t < cu_seqlens[i + 1]; tokens from cu_seqlens[-1] on
  are padding (`pad_id`)."""
  cu_seqlens = jnp.asarray(cu_seqlens)
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError(f"{name} must be [num_seqs + 1] (0, then each sequence's end), got shape "
                     f"{cu_seqlens.shape}")
  if cu_seqlens.dtype != jnp.int32:
    raise TypeError(f"{name} must be int32 (as FlashAttention's), got {cu_seqlens.dtype}")
  if not isinstance(cu_seqlens, jax.core.Tracer):  # (under jit the values are not known)
    bounds = np.asarray(cu_seqlens)
    if bounds[0] != 0 or np.any(np.diff(bounds) < 0) or bounds[-1] > total:
      raise ValueError(f"{name} must start at 0, never decrease and end at most at the "
                       f"{total} packed tokens; got {bounds.tolist()}")
  positions = jnp.arange(total, dtype=jnp.int32)
  ids = jnp.searchsorted(cu_seqlens, positions, side="right").astype(jnp.int32) - 1
  used = cu_seqlens[-1]
  return jnp.where(positions < used, ids, pad_id), used[None]


def varlen_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                     cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array | None = None, *,
                     scale: float | None = None, is_causal: bool = False,
                     local_window_size: int | tuple[int, int] | None = None,
                     implementation: api.Implementation | None = None,
                     return_residual: bool = False, interpret: bool = False,
                     logits_soft_cap: float | None = None,
                     deterministic_backward: bool = False):
  """Attention over sequences packed along one token axis (FlashAttention's varlen layout).

  Args:
    query: [total_q, heads_q, head_dim]: the sequences' queries end to end.
    key, value: [total_k, heads_kv, head_dim]; heads_q % heads_kv == 0 (GQA/MQA).
    cu_seqlens_q: int32 [num_seqs + 1]: 0, then the cumulative query lengths (sequence i's
      queries are rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1). Rows from cu_seqlens_q[-1]
      to total_q are padding: zero in the output, no gradient.
    cu_seqlens_k: the same for the keys; None: cu_seqlens_q (self-attention, key and query the
      same tokens). A query sequence whose key sequence is empty gets zeros (FlashAttention's
      output there).
    is_causal, local_window_size: within each sequence, query position p sees key positions
      p - left .. p + right (causal: up to p). They need the queries and keys packed alike
      (cu_seqlens_k None): then a sequence's positions are the packed positions shifted by the
      same amount on both sides, and the packed diagonal is each sequence's.
    scale, implementation, return_residual, interpret, logits_soft_cap,
    deterministic_backward: as in `attention`.

  Returns:
    out [total_q, heads_q, head_dim] in the input dtype; with return_residual, (out, lse
    [total_q, heads_q] float32).
  """
  for name, x in (("query", query), ("key", key), ("value", value)):
    if jnp.ndim(x) != 3:
      raise ValueError(f"varlen_attention takes {name} [total_tokens, heads, head_dim], got shape "
                       f"{jnp.shape(x)}")
  if cu_seqlens_k is not None and (is_causal or local_window_size is not None):
    raise ValueError("is_causal / local_window_size in varlen_attention need the queries and "
                     "keys packed alike (cu_seqlens_k=None): with separate boundaries a "
                     "sequence's diagonal is not the packed one")
  if cu_seqlens_k is None and key.shape[0] != query.shape[0]:
    raise ValueError(f"cu_seqlens_k=None packs keys as the queries: key's total_k "
                     f"({key.shape[0]}) must equal query's total_q ({query.shape[0]})")
  if cu_seqlens_k is not None and jnp.shape(cu_seqlens_k) != jnp.shape(cu_seqlens_q):
    raise ValueError(f"cu_seqlens_q and cu_seqlens_k must list as many sequences, got shapes "
                     f"{jnp.shape(cu_seqlens_q)} and {jnp.shape(cu_seqlens_k)}")
  q_ids, q_used = _segment_ids("cu_seqlens_q", cu_seqlens_q, query.shape[0], pad_id=-1)
  if cu_seqlens_k is None:
    kv_ids, kv_used = q_ids, q_used
  else:
    # (-2: padding keys meet neither sequences nor padding queries.)
    kv_ids, kv_used = _segment_ids("cu_seqlens_k", cu_seqlens_k, key.shape[0], pad_id=-2)
  result = api.attention(
      query[None], key[None], value[None], scale=scale, is_causal=is_causal,
      query_seq_lengths=q_used, key_value_seq_lengths=kv_used,
      local_window_size=local_window_size, implementation=implementation,
      return_residual=return_residual, interpret=interpret,
      segment_ids=(q_ids[None], kv_ids[None]), logits_soft_cap=logits_soft_cap,
      deterministic_backward=deterministic_backward)
  out, lse = (result[0][0], result[1][0]) if return_residual else (result[0], None)
  if cu_seqlens_k is not None:
    # A query sequence whose key sequence is empty sees no key: zeros, as FlashAttention gives
    # (attention's jax.nn rule, the mean of every value, would mix in the other sequences).
    key_counts = jnp.diff(jnp.asarray(cu_seqlens_k))
    sees_keys = (q_ids >= 0) & (key_counts[jnp.clip(q_ids, 0, None)] > 0)
    out = jnp.where(sees_keys[:, None, None], out, jnp.zeros((), out.dtype))
  return (out, lse) if return_residual else out
