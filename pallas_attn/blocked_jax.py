"""The portable path: FlashAttention in pure JAX, for every backend the Mosaic GPU kernels don't
serve (CPU, TPU, older GPUs).

The same algorithm as the kernels, written with `lax` loops: the outer loop walks query blocks,
the inner loop walks only the key blocks that `mask.kv_block_range` allows (causal and windowed
blocks are skipped, not masked), keeping the running max, running sum and unnormalized accumulator.
The backward pass (a `jax.custom_vjp`) recomputes each score tile from q, k and the saved lse:
one loop for dQ over key blocks, one for dK/dV over query blocks. The largest intermediate is a
[heads, block_q, block_kv] tile, so memory is O(N).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn import mask as mask_lib
from pallas_attn import numerics


@dataclasses.dataclass(frozen=True)
class BlockedConfig:
  """Static values of one blocked call (hashable: it is a custom_vjp non-diff argument)."""

  scale: float
  spec: mask_lib.MaskSpec
  block_q: int
  block_kv: int
  q_len: int  # unpadded lengths
  kv_len: int


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Blocks of 128 (or the whole, 8-aligned sequence when shorter): large enough for matmul units,
  small enough that one [heads, block_q, block_kv] tile stays in cache."""
  return min(128, mask_lib.round_up(q_len, 8)), min(128, mask_lib.round_up(kv_len, 8))


def attention(query, key, value, q_lengths, kv_lengths, *, scale: float,
              spec: mask_lib.MaskSpec, block_q: int | None = None,
              block_kv: int | None = None):
  """query [B, T, Hq, D], key/value [B, S, Hkv, D], lengths int32 [B] or None.

  Returns (out [B, T, Hq, D] in the input dtype, lse [B, Hq, T] float32, +inf on empty rows).
  """
  cfg = _config(query, key, scale, spec, block_q, block_kv)
  return _attention(cfg, query, key, value, q_lengths, kv_lengths)


def forward(query, key, value, q_lengths, kv_lengths, *, scale: float,
            spec: mask_lib.MaskSpec, block_q: int | None = None, block_kv: int | None = None):
  """The forward pass alone (not differentiable), for callers that merge partial attentions over
  key chunks by their lse (`pallas_attn.ring`). Arguments as `attention`.

  Returns (out [B, T, Hq, D] float32, lse [B, Hq, T] float32, +inf on empty rows).
  """
  return _forward_pass(_config(query, key, scale, spec, block_q, block_kv), query, key, value,
                       q_lengths, kv_lengths)


def backward(query, key, value, d_out, lse, delta, q_lengths, kv_lengths, *, scale: float,
             spec: mask_lib.MaskSpec, block_q: int | None = None, block_kv: int | None = None):
  """The backward pass alone (not differentiable), from the caller's lse and delta.

  lse [B, Hq, T] float32 is the log-sum-exp of each query row's whole softmax, which may span keys
  outside `key` (exp(s - lse) are then these keys' exact probabilities); +inf marks rows that see
  no key. delta [B, Hq, T] float32 is `numerics.delta(d_out, out)` of the whole output.
  Other arguments as `attention`; d_out like query.

  Returns (dq [B, T, Hq, D], dk, dv [B, S, Hkv, D]) in the input dtype, dk/dv summed over each
  kv head's group of query heads.
  """
  return _backward_pass(_config(query, key, scale, spec, block_q, block_kv), query, key, value,
                        d_out, lse, delta, q_lengths, kv_lengths)


def _config(query, key, scale, spec, block_q, block_kv) -> BlockedConfig:
  q_len, kv_len = query.shape[1], key.shape[1]
  default_q, default_kv = default_blocks(q_len, kv_len)
  return BlockedConfig(scale=scale, spec=spec, block_q=block_q or default_q,
                       block_kv=block_kv or default_kv, q_len=q_len, kv_len=kv_len)


def _forward_pass(cfg: BlockedConfig, query, key, value, q_lengths, kv_lengths):
  """`_forward` on inputs padded to whole blocks; the padding is cut from the results."""
  qp, kp, vp, q_lengths, kv_lengths = mask_lib.pad_to_tiles(
      query, key, value, q_lengths, kv_lengths, cfg.block_q, cfg.block_kv)
  out, lse = _forward(cfg, qp, kp, vp, q_lengths, kv_lengths)
  return out[:, :cfg.q_len], lse[:, :, :cfg.q_len]


def _backward_pass(cfg: BlockedConfig, query, key, value, d_out, lse, delta, q_lengths,
                   kv_lengths):
  """`_backward` on inputs padded to whole blocks; the padding is cut from the gradients."""
  qp, kp, vp, q_lengths, kv_lengths = mask_lib.pad_to_tiles(
      query, key, value, q_lengths, kv_lengths, cfg.block_q, cfg.block_kv)
  d_out, lse, delta = mask_lib.pad_row_inputs(d_out, lse, delta, cfg.block_q)
  dq, dk, dv = _backward(cfg, qp, kp, vp, d_out, lse, delta, q_lengths, kv_lengths)
  return dq[:, :cfg.q_len], dk[:, :cfg.kv_len], dv[:, :cfg.kv_len]


# ---------------------------------------------------------------------------------------------
# Tiles. Query heads are viewed as [heads_kv, groups] so that GQA needs no copy of k and v.


def _split_heads(x, heads_kv):  # [B, H, ...] -> [B, Hkv, G, ...]
  return x.reshape(x.shape[0], heads_kv, x.shape[1] // heads_kv, *x.shape[2:])


def _rows(x, start, block, heads_kv):
  """[B, T, Hq, D] rows [start, start+block) as [B, Hkv, G, block, D]."""
  tile = lax.dynamic_slice_in_dim(x, start, block, axis=1).transpose(0, 2, 1, 3)
  return _split_heads(tile, heads_kv)


def _keys(x, start, block):
  """[B, S, Hkv, D] keys [start, start+block) as [B, Hkv, block, D]."""
  return lax.dynamic_slice_in_dim(x, start, block, axis=1).transpose(0, 2, 1, 3)


def _stat(x, start, block, heads_kv):
  """[B, Hq, T] entries [start, start+block) as [B, Hkv, G, block]."""
  return _split_heads(lax.dynamic_slice_in_dim(x, start, block, axis=2), heads_kv)


def _scores(cfg, q_tile, k_tile, q_start, kv_start, q_lengths, kv_lengths):
  """scale * q.k for one tile, hidden entries -inf. [B, Hkv, G, bq, bk] float32."""
  s = jnp.einsum("bhgqd,bhkd->bhgqk", q_tile, k_tile, preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST) * cfg.scale
  q_pos = q_start + jnp.arange(cfg.block_q)[:, None]
  kv_pos = kv_start + jnp.arange(cfg.block_kv)[None, :]
  lim = lambda x: x[:, None, None, None, None]
  keep = mask_lib.visible(cfg.spec, q_pos, kv_pos, lim(q_lengths), lim(kv_lengths))
  return jnp.where(keep, s, -jnp.inf)


def _kv_range(cfg, q_start, num_kv_blocks, kv_lengths):
  return mask_lib.kv_block_range(cfg.spec, q_start, cfg.block_q, cfg.block_kv, num_kv_blocks,
                                 kv_lengths.max())


def _q_range(cfg, kv_start, num_q_blocks, q_lengths):
  return mask_lib.q_block_range(cfg.spec, kv_start, cfg.block_kv, cfg.block_q, num_q_blocks,
                                q_lengths.max())


# ---------------------------------------------------------------------------------------------
# Forward.


def _forward(cfg: BlockedConfig, q, k, v, q_lengths, kv_lengths):
  """(out [B, T, Hq, D] float32, lse [B, Hq, T]); the caller casts out to the input dtype."""
  batch, t_pad, heads_q, head_dim = q.shape
  heads_kv = k.shape[2]
  groups = heads_q // heads_kv
  num_q_blocks = t_pad // cfg.block_q
  num_kv_blocks = k.shape[1] // cfg.block_kv

  def one_q_block(qi):
    q_start = qi * cfg.block_q
    q_tile = _rows(q, q_start, cfg.block_q, heads_kv)
    lo, hi = _kv_range(cfg, q_start, num_kv_blocks, kv_lengths)

    def step(kj, carry):
      m, l, acc = carry
      kv_start = kj * cfg.block_kv
      s = _scores(cfg, q_tile, _keys(k, kv_start, cfg.block_kv), q_start, kv_start,
                  q_lengths, kv_lengths)
      v_tile = _keys(v, kv_start, cfg.block_kv)[:, :, None]  # [B, Hkv, 1, bk, D]
      return numerics.online_softmax_step(m, l, acc, s, v_tile, v.dtype)

    stats_shape = (batch, heads_kv, groups, cfg.block_q)
    init = (jnp.full(stats_shape, numerics.M_INIT, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(lo, hi, step, init)
    out, lse = numerics.finish(m, l, acc, jnp.float32)
    # [B, Hkv, G, bq, D] -> [B, bq, Hq, D]; lse -> [B, Hq, bq]
    out = out.reshape(batch, heads_q, cfg.block_q, head_dim).transpose(0, 2, 1, 3)
    return out, lse.reshape(batch, heads_q, cfg.block_q)

  outs, lses = lax.map(one_q_block, jnp.arange(num_q_blocks))
  out = outs.transpose(1, 0, 2, 3, 4).reshape(batch, t_pad, heads_q, head_dim)
  lse = lses.transpose(1, 2, 0, 3).reshape(batch, heads_q, t_pad)
  return out, lse


# ---------------------------------------------------------------------------------------------
# Backward: recompute P = exp(S - lse) tile by tile.


def _probs_and_ds(cfg, q_tile, k_tile, v_tile, do_tile, lse_tile, delta_tile, q_start,
                  kv_start, q_lengths, kv_lengths):
  """P and dS = P * (dO.v^T - delta) for one tile, both [B, Hkv, G, bq, bk] float32."""
  s = _scores(cfg, q_tile, k_tile, q_start, kv_start, q_lengths, kv_lengths)
  p = jnp.exp(s - lse_tile[..., None])  # hidden (-inf) and empty rows (lse=+inf) give 0
  dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile, preferred_element_type=jnp.float32,
                  precision=lax.Precision.HIGHEST)
  ds = p * (dp - delta_tile[..., None])
  return p, ds


def _backward(cfg: BlockedConfig, q, k, v, d_out, lse, delta, q_lengths, kv_lengths):
  batch, t_pad, heads_q, head_dim = q.shape
  s_pad, heads_kv = k.shape[1], k.shape[2]
  num_q_blocks = t_pad // cfg.block_q
  num_kv_blocks = s_pad // cfg.block_kv
  hi_prec = dict(preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)

  def dq_block(qi):
    q_start = qi * cfg.block_q
    q_tile = _rows(q, q_start, cfg.block_q, heads_kv)
    do_tile = _rows(d_out, q_start, cfg.block_q, heads_kv)
    lse_tile = _stat(lse, q_start, cfg.block_q, heads_kv)
    delta_tile = _stat(delta, q_start, cfg.block_q, heads_kv)
    lo, hi = _kv_range(cfg, q_start, num_kv_blocks, kv_lengths)

    def step(kj, dq):
      kv_start = kj * cfg.block_kv
      k_tile = _keys(k, kv_start, cfg.block_kv)
      _, ds = _probs_and_ds(cfg, q_tile, k_tile, _keys(v, kv_start, cfg.block_kv), do_tile,
                            lse_tile, delta_tile, q_start, kv_start, q_lengths, kv_lengths)
      return dq + jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k_tile, **hi_prec)

    dq = lax.fori_loop(lo, hi, step, jnp.zeros(q_tile.shape, jnp.float32)) * cfg.scale
    return dq.reshape(batch, heads_q, cfg.block_q, head_dim).transpose(0, 2, 1, 3)

  def dkv_block(kj):
    kv_start = kj * cfg.block_kv
    k_tile = _keys(k, kv_start, cfg.block_kv)
    v_tile = _keys(v, kv_start, cfg.block_kv)
    lo, hi = _q_range(cfg, kv_start, num_q_blocks, q_lengths)

    def step(qi, carry):
      dk, dv = carry
      q_start = qi * cfg.block_q
      q_tile = _rows(q, q_start, cfg.block_q, heads_kv)
      do_tile = _rows(d_out, q_start, cfg.block_q, heads_kv)
      p, ds = _probs_and_ds(cfg, q_tile, k_tile, v_tile, do_tile,
                            _stat(lse, q_start, cfg.block_q, heads_kv),
                            _stat(delta, q_start, cfg.block_q, heads_kv),
                            q_start, kv_start, q_lengths, kv_lengths)
      # Sum over the query heads of each kv head's group (GQA) as well as over rows.
      dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(v.dtype), do_tile, **hi_prec)
      dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q_tile, **hi_prec)
      return dk, dv

    zeros = jnp.zeros(k_tile.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, step, (zeros, zeros))
    return (dk * cfg.scale).transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)

  dq = lax.map(dq_block, jnp.arange(num_q_blocks))
  dq = dq.transpose(1, 0, 2, 3, 4).reshape(q.shape)
  dk, dv = lax.map(dkv_block, jnp.arange(num_kv_blocks))
  dk = dk.transpose(1, 0, 2, 3, 4).reshape(k.shape)
  dv = dv.transpose(1, 0, 2, 3, 4).reshape(v.shape)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, q_lengths, kv_lengths):
  out, lse = _forward_pass(cfg, q, k, v, q_lengths, kv_lengths)
  return out.astype(q.dtype), lse


def _attention_fwd(cfg, q, k, v, q_lengths, kv_lengths):
  out, lse = _forward_pass(cfg, q, k, v, q_lengths, kv_lengths)
  # The float32 output is kept for delta = rowsum(dO * O): from the bf16/f16 output, delta's
  # rounding error is amplified in dS = P (dP - delta) when the softmax is peaked (dq then misses
  # the 2x-of-reference bound). O(N) memory, like the output itself.
  return (out.astype(q.dtype), lse), (q, k, v, out, lse, q_lengths, kv_lengths)


def _attention_bwd(cfg, res, cotangents):
  q, k, v, out, lse, q_lengths, kv_lengths = res
  d_out, _ = cotangents  # the lse is returned under stop_gradient
  dq, dk, dv = _backward_pass(cfg, q, k, v, d_out, lse, numerics.delta(d_out, out), q_lengths,
                              kv_lengths)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
