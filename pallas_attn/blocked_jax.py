"""The portable path: FlashAttention in pure JAX, for every backend the Mosaic GPU kernels don't
serve (CPU, TPU, older GPUs).

The same algorithm as the kernels, written with `lax` loops: the outer loop walks query blocks,
the inner loop walks only the key blocks that `mask.kv_block_range` allows (causal and windowed
blocks are skipped, not masked), keeping the running max, running sum and unnormalized accumulator.
The backward pass (a `jax.custom_vjp`) recomputes each score tile from q, k and the saved lse:
one loop for dQ over key blocks, one for dK/dV over query blocks. The largest intermediate is a
[heads, block_q, block_kv] tile, so memory is O(N).

Score modifications (`score_mods`: bias, boolean mask, segment ids, ALiBi, soft-cap, score_fn,
mask_fn, dropout) are applied to each tile by the same element functions the reference uses; the
arrays are looked up tile by tile, and the bias gradient is scattered tile by tile into a buffer of
the bias's own shape (summed over its broadcast axes). Tiles inside the block range that the
segment ids, the boolean mask or mask_fn hide entirely are skipped too (`_live_blocks`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn import score_mods


@dataclasses.dataclass(frozen=True)
class BlockedConfig:
  """Static values of one blocked call (hashable: it is a custom_vjp non-diff argument)."""

  scale: float
  spec: mask_lib.MaskSpec
  block_q: int
  block_kv: int
  q_len: int  # unpadded lengths
  kv_len: int
  mods: score_mods.ScoreMods = score_mods.ScoreMods()


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
  """Blocks of 128 (or the whole, 8-aligned sequence when shorter): large enough for matmul units,
  small enough that one [heads, block_q, block_kv] tile stays in cache."""
  return min(128, mask_lib.round_up(q_len, 8)), min(128, mask_lib.round_up(kv_len, 8))


def attention(query, key, value, q_lengths, kv_lengths,
              arrays: score_mods.ScoreArrays = score_mods.ScoreArrays(), *, scale: float,
              spec: mask_lib.MaskSpec, mods: score_mods.ScoreMods = score_mods.ScoreMods(),
              block_q: int | None = None, block_kv: int | None = None):
  """query [B, T, Hq, D], key/value [B, S, Hkv, D], lengths int32 [B] or None; `arrays` and
  `mods` as `score_mods` describes them (arrays unpadded: tile lookups clip, lengths hide).

  Returns (out [B, T, Hq, D] in the input dtype, lse [B, Hq, T] float32, +inf on empty rows).
  Differentiable in query, key, value and arrays.bias / arrays.alibi_slopes.
  """
  cfg = _config(query, key, scale, spec, mods, block_q, block_kv)
  return _attention(cfg, query, key, value, q_lengths, kv_lengths, arrays)


def forward(query, key, value, q_lengths, kv_lengths, *, scale: float,
            spec: mask_lib.MaskSpec, block_q: int | None = None, block_kv: int | None = None):
  """The forward pass alone (not differentiable), for callers that merge partial attentions over
  key chunks by their lse (`pallas_attn.ring`). Arguments as `attention`, without score
  modifications.

  Returns (out [B, T, Hq, D] float32, lse [B, Hq, T] float32, +inf on empty rows).
  """
  return _forward_pass(_config(query, key, scale, spec, score_mods.ScoreMods(), block_q, block_kv),
                       query, key, value, q_lengths, kv_lengths, score_mods.ScoreArrays())


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
  cfg = _config(query, key, scale, spec, score_mods.ScoreMods(), block_q, block_kv)
  dq, dk, dv, _ = _backward_pass(cfg, query, key, value, d_out, lse, delta, q_lengths, kv_lengths,
                                 score_mods.ScoreArrays())
  return dq, dk, dv


def _config(query, key, scale, spec, mods, block_q, block_kv) -> BlockedConfig:
  q_len, kv_len = query.shape[1], key.shape[1]
  default_q, default_kv = default_blocks(q_len, kv_len)
  return BlockedConfig(scale=scale, spec=spec, block_q=block_q or default_q,
                       block_kv=block_kv or default_kv, q_len=q_len, kv_len=kv_len, mods=mods)


def _forward_pass(cfg: BlockedConfig, query, key, value, q_lengths, kv_lengths,
                  arrays: score_mods.ScoreArrays):
  """`_forward` on inputs padded to whole blocks; the padding is cut from the results. (The score
  arrays stay unpadded: tile lookups clip, and the length test hides padded positions.)"""
  qp, kp, vp, q_lengths, kv_lengths = mask_lib.pad_to_tiles(
      query, key, value, q_lengths, kv_lengths, cfg.block_q, cfg.block_kv)
  out, lse = _forward(cfg, qp, kp, vp, q_lengths, kv_lengths, arrays)
  return out[:, :cfg.q_len], lse[:, :, :cfg.q_len]


def _backward_pass(cfg: BlockedConfig, query, key, value, d_out, lse, delta, q_lengths,
                   kv_lengths, arrays: score_mods.ScoreArrays):
  """`_backward` on inputs padded to whole blocks; the padding is cut from the gradients."""
  qp, kp, vp, q_lengths, kv_lengths = mask_lib.pad_to_tiles(
      query, key, value, q_lengths, kv_lengths, cfg.block_q, cfg.block_kv)
  d_out, lse, delta = mask_lib.pad_row_inputs(d_out, lse, delta, cfg.block_q)
  dq, dk, dv, d_arrays = _backward(cfg, qp, kp, vp, d_out, lse, delta, q_lengths, kv_lengths,
                                   arrays)
  return dq[:, :cfg.q_len], dk[:, :cfg.kv_len], dv[:, :cfg.kv_len], d_arrays


# ---------------------------------------------------------------------------------------------
# Tiles. Query heads are viewed as [heads_kv, groups] so that GQA needs no copy of k and v.


def _split_heads(x, heads_kv):  # [B, H, ...] -> [B, Hkv, G, ...]
  return x.reshape(x.shape[0], heads_kv, x.shape[1] // heads_kv, *x.shape[2:])


def _merge_heads(x):  # [B, Hkv, G, ...] -> [B, Hq, ...]: query head h = kv head * G + g
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


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


def _grid(cfg, batch, heads_q, q_start, kv_start):
  """The [B, Hq, bq, bk] block of the score matrix that tile (q_start, kv_start) covers."""
  return score_mods.Grid.block(batch, heads_q, q_start, cfg.block_q, kv_start, cfg.block_kv,
                               cfg.q_len, cfg.kv_len)


def _raw_scores(cfg, q_tile, k_tile):
  """scale * q.k for one tile, [B, Hq, bq, bk] float32 (the element functions see query heads)."""
  s = jnp.einsum("bhgqd,bhkd->bhgqk", q_tile, k_tile, preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST) * cfg.scale
  return _merge_heads(s)


def _hide(cfg, s, grid, tiles, q_lengths, kv_lengths):
  """-inf where the score takes no part in the softmax (`score_mods.kept`)."""
  keep = score_mods.kept(cfg.mods, cfg.spec, grid, tiles, q_lengths, kv_lengths)
  return jnp.where(keep, s, -jnp.inf)


def _scores(cfg, q_tile, k_tile, grid, tiles, q_lengths, kv_lengths):
  """The modified scores of one tile, hidden entries -inf. [B, Hq, bq, bk] float32."""
  s = score_mods.modified_scores(cfg.mods, cfg.spec, _raw_scores(cfg, q_tile, k_tile), grid,
                                 tiles)
  return _hide(cfg, s, grid, tiles, q_lengths, kv_lengths)


def _dropout_keep(cfg, grid, tiles, heads_kv):
  """The tile's dropout keep-mask, [B, Hkv, G, bq, bk] bool (None without dropout)."""
  if cfg.mods.dropout_rate == 0.0:
    return None
  keep = score_mods.dropout_keep(cfg.mods, grid, tiles)
  shape = (grid.batch.shape[0], grid.head.shape[1], cfg.block_q, cfg.block_kv)
  return _split_heads(jnp.broadcast_to(keep, shape), heads_kv)


def _live_blocks(cfg, arrays, q_lengths, kv_lengths, batch, heads_q, num_q_blocks,
                 num_kv_blocks):
  """[num_q_blocks, num_kv_blocks] bool: False for tiles that hold no visible score for a reason
  the block ranges do not see; None when positions and lengths are all that hide scores.

  With a boolean mask or mask_fn, the tile's whole keep predicate (`score_mods.kept`) is
  evaluated tile by tile, here, outside the attention loops: exact, at the cost of one more
  evaluation of the mask lookups and mask_fn per score element and pass (forward, backward), no
  matmul and no exp, and O(num_q_blocks * num_kv_blocks) memory. With segment ids alone, the
  per-block min/max ids decide (`mask.segment_blocks_meet`): O(seq) work.
  """
  if arrays.mask is not None or cfg.mods.mask_fn is not None:
    def tile_live(qi, kj):
      grid = _grid(cfg, batch, heads_q, qi * cfg.block_q, kj * cfg.block_kv)
      tiles = score_mods.tile_arrays(arrays, grid)
      return score_mods.kept(cfg.mods, cfg.spec, grid, tiles, q_lengths, kv_lengths).any()

    kv_blocks = jnp.arange(num_kv_blocks)
    return lax.map(lambda qi: lax.map(lambda kj: tile_live(qi, kj), kv_blocks),
                   jnp.arange(num_q_blocks))
  if arrays.q_segment_ids is not None:
    return mask_lib.segment_blocks_meet(arrays.q_segment_ids, arrays.kv_segment_ids,
                                        cfg.block_q, cfg.block_kv, num_q_blocks, num_kv_blocks)
  return None


def _if_live(live, qi, kj, body):
  """`body(carry)` on a live tile; on a dead one, the carry unchanged (a lax.cond: the tile's
  matmuls and exps are not run)."""
  if live is None:
    return body
  return lambda carry: lax.cond(live[qi, kj], body, lambda c: c, carry)


def _kv_range(cfg, q_start, num_kv_blocks, kv_lengths):
  return mask_lib.kv_block_range(cfg.spec, q_start, cfg.block_q, cfg.block_kv, num_kv_blocks,
                                 kv_lengths.max())


def _q_range(cfg, kv_start, num_q_blocks, q_lengths):
  return mask_lib.q_block_range(cfg.spec, kv_start, cfg.block_kv, cfg.block_q, num_q_blocks,
                                q_lengths.max())


# ---------------------------------------------------------------------------------------------
# Forward.


def _forward(cfg: BlockedConfig, q, k, v, q_lengths, kv_lengths, arrays):
  """(out [B, T, Hq, D] float32, lse [B, Hq, T]); the caller casts out to the input dtype."""
  batch, t_pad, heads_q, head_dim = q.shape
  heads_kv = k.shape[2]
  groups = heads_q // heads_kv
  num_q_blocks = t_pad // cfg.block_q
  num_kv_blocks = k.shape[1] // cfg.block_kv
  live = _live_blocks(cfg, arrays, q_lengths, kv_lengths, batch, heads_q, num_q_blocks,
                      num_kv_blocks)
  keep_scale = 1.0 / (1.0 - cfg.mods.dropout_rate)

  def one_q_block(qi):
    q_start = qi * cfg.block_q
    q_tile = _rows(q, q_start, cfg.block_q, heads_kv)
    lo, hi = _kv_range(cfg, q_start, num_kv_blocks, kv_lengths)

    def step(kj, carry):
      kv_start = kj * cfg.block_kv

      def tile(carry):
        m, l, acc = carry
        grid = _grid(cfg, batch, heads_q, q_start, kv_start)
        tiles = score_mods.tile_arrays(arrays, grid)
        s = _scores(cfg, q_tile, _keys(k, kv_start, cfg.block_kv), grid, tiles, q_lengths,
                    kv_lengths)
        v_tile = _keys(v, kv_start, cfg.block_kv)[:, :, None]  # [B, Hkv, 1, bk, D]
        return numerics.online_softmax_step(m, l, acc, _split_heads(s, heads_kv), v_tile,
                                            v.dtype, _dropout_keep(cfg, grid, tiles, heads_kv),
                                            keep_scale)

      return _if_live(live, qi, kj, tile)(carry)

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


def _probs_and_ds(cfg, q_tile, k_tile, v_tile, do_tile, lse_tile, delta_tile, grid, tiles,
                  q_lengths, kv_lengths):
  """One tile's P (as it multiplied V: dropped entries 0, kept ones / (1 - rate)) and
  dS = P * (dP - delta) taken back through the score modifications to the raw scores
  scale * q.k, both [B, Hkv, G, bq, bk] float32; and the tile's bias / ALiBi-slope gradients
  (a `ScoreArrays`, broadcast axes summed), from the vjp of `score_mods.modified_scores`."""
  heads_kv = q_tile.shape[1]

  def modify(raw, bias, slopes):
    return score_mods.modified_scores(cfg.mods, cfg.spec, raw, grid,
                                      tiles.replace(bias=bias, alibi_slopes=slopes))

  s, modify_vjp = jax.vjp(modify, _raw_scores(cfg, q_tile, k_tile), tiles.bias,
                          tiles.alibi_slopes)
  s = _split_heads(_hide(cfg, s, grid, tiles, q_lengths, kv_lengths), heads_kv)
  p = jnp.exp(s - lse_tile[..., None])  # hidden (-inf) and empty rows (lse=+inf) give 0
  dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile, preferred_element_type=jnp.float32,
                  precision=lax.Precision.HIGHEST)
  keep = _dropout_keep(cfg, grid, tiles, heads_kv)
  if keep is not None:
    # O = (P * Z / (1 - rate)) V: dropped weights get no gradient; delta = rowsum(dO * O) is
    # still sum_j P_ij dP_ij with the dropped dP below.
    keep_scale = 1.0 / (1.0 - cfg.mods.dropout_rate)
    dp = jnp.where(keep, dp * keep_scale, 0.0)
    p_v = jnp.where(keep, p * keep_scale, 0.0)
  else:
    p_v = p
  ds = p * (dp - delta_tile[..., None])
  ds_raw, d_bias, d_slopes = modify_vjp(_merge_heads(ds))
  return p_v, _split_heads(ds_raw, heads_kv), score_mods.ScoreArrays(bias=d_bias,
                                                                     alibi_slopes=d_slopes)


def _backward(cfg: BlockedConfig, q, k, v, d_out, lse, delta, q_lengths, kv_lengths, arrays):
  """(dq, dk, dv, d_arrays): d_arrays holds the bias and ALiBi-slope gradients (else None).
  delta = `numerics.delta(d_out, out)` of the whole output (see `backward`)."""
  batch, t_pad, heads_q, head_dim = q.shape
  s_pad, heads_kv = k.shape[1], k.shape[2]
  num_q_blocks = t_pad // cfg.block_q
  num_kv_blocks = s_pad // cfg.block_kv
  live = _live_blocks(cfg, arrays, q_lengths, kv_lengths, batch, heads_q, num_q_blocks,
                      num_kv_blocks)
  hi_prec = dict(preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)

  # The dQ loop also carries the bias / slope gradient buffers (shaped like those arrays).
  def dq_block(d_arrays, qi):
    q_start = qi * cfg.block_q
    q_tile = _rows(q, q_start, cfg.block_q, heads_kv)
    do_tile = _rows(d_out, q_start, cfg.block_q, heads_kv)
    lse_tile = _stat(lse, q_start, cfg.block_q, heads_kv)
    delta_tile = _stat(delta, q_start, cfg.block_q, heads_kv)
    lo, hi = _kv_range(cfg, q_start, num_kv_blocks, kv_lengths)

    def step(kj, carry):
      kv_start = kj * cfg.block_kv

      def tile(carry):
        dq, d_arrays = carry
        grid = _grid(cfg, batch, heads_q, q_start, kv_start)
        k_tile = _keys(k, kv_start, cfg.block_kv)
        _, ds, d_tiles = _probs_and_ds(cfg, q_tile, k_tile, _keys(v, kv_start, cfg.block_kv),
                                       do_tile, lse_tile, delta_tile, grid,
                                       score_mods.tile_arrays(arrays, grid), q_lengths,
                                       kv_lengths)
        dq = dq + jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k_tile, **hi_prec)
        return dq, score_mods.add_grad_tiles(d_arrays, d_tiles, grid)

      return _if_live(live, qi, kj, tile)(carry)

    dq, d_arrays = lax.fori_loop(lo, hi, step, (jnp.zeros(q_tile.shape, jnp.float32), d_arrays))
    dq = dq * cfg.scale
    return d_arrays, dq.reshape(batch, heads_q, cfg.block_q, head_dim).transpose(0, 2, 1, 3)

  def dkv_block(kj):
    kv_start = kj * cfg.block_kv
    k_tile = _keys(k, kv_start, cfg.block_kv)
    v_tile = _keys(v, kv_start, cfg.block_kv)
    lo, hi = _q_range(cfg, kv_start, num_q_blocks, q_lengths)

    def step(qi, carry):
      q_start = qi * cfg.block_q

      def tile(carry):
        dk, dv = carry
        q_tile = _rows(q, q_start, cfg.block_q, heads_kv)
        do_tile = _rows(d_out, q_start, cfg.block_q, heads_kv)
        grid = _grid(cfg, batch, heads_q, q_start, kv_start)
        p, ds, _ = _probs_and_ds(cfg, q_tile, k_tile, v_tile, do_tile,
                                 _stat(lse, q_start, cfg.block_q, heads_kv),
                                 _stat(delta, q_start, cfg.block_q, heads_kv),
                                 grid, score_mods.tile_arrays(arrays, grid), q_lengths,
                                 kv_lengths)
        # Sum over the query heads of each kv head's group (GQA) as well as over rows.
        dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(v.dtype), do_tile, **hi_prec)
        dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q_tile, **hi_prec)
        return dk, dv

      return _if_live(live, qi, kj, tile)(carry)

    zeros = jnp.zeros(k_tile.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, step, (zeros, zeros))
    return (dk * cfg.scale).transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)

  d_arrays, dq = lax.scan(dq_block, score_mods.zero_grads(arrays), jnp.arange(num_q_blocks))
  dq = dq.transpose(1, 0, 2, 3, 4).reshape(q.shape)
  dk, dv = lax.map(dkv_block, jnp.arange(num_kv_blocks))
  dk = dk.transpose(1, 0, 2, 3, 4).reshape(k.shape)
  dv = dv.transpose(1, 0, 2, 3, 4).reshape(v.shape)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          score_mods.cast_grads(d_arrays, arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, q_lengths, kv_lengths, arrays):
  out, lse = _forward_pass(cfg, q, k, v, q_lengths, kv_lengths, arrays)
  return out.astype(q.dtype), lse


def _attention_fwd(cfg, q, k, v, q_lengths, kv_lengths, arrays):
  out, lse = _forward_pass(cfg, q, k, v, q_lengths, kv_lengths, arrays)
  # The float32 output is kept for delta = rowsum(dO * O): from the bf16/f16 output, delta's
  # rounding error is amplified in dS = P (dP - delta) when the softmax is peaked (dq then misses
  # the 2x-of-reference bound). O(N) memory, like the output itself.
  return (out.astype(q.dtype), lse), (q, k, v, out, lse, q_lengths, kv_lengths, arrays)


def _attention_bwd(cfg, res, cotangents):
  q, k, v, out, lse, q_lengths, kv_lengths, arrays = res
  d_out, _ = cotangents  # the lse is returned under stop_gradient
  dq, dk, dv, d_arrays = _backward_pass(cfg, q, k, v, d_out, lse, numerics.delta(d_out, out),
                                        q_lengths, kv_lengths, arrays)
  # Lengths, the mask, segment ids and the dropout seed are not differentiable (None: zero).
  return dq, dk, dv, None, None, d_arrays


_attention.defvjp(_attention_fwd, _attention_bwd)
