"""Split-KV ("flash-decoding") forward for decode-shaped calls: the key range cut into `splits`
chunks, each attended by CTAs of its own, the partial results merged by their log-sum-exp.

Why. The forward grid has one CTA per (batch, query head, 128-row query tile), and a CTA streams
every key its rows see, tile after tile, at the pace of its own copy/compute pipeline. A decode
call has one query tile: batch 16, 32 query heads over 8 kv heads (packed, `gqa_pack`: one CTA
per kv head), head_dim 128 and 32768 keys run 128 CTAs, each streaming 256 K/V tiles of 128
keys. K and V are 2.15 GB; measured on an H200 0.767 ms (2.8 TB/s) against cuDNN's 0.500 ms
(4.3 TB/s). With fewer CTAs than SMs, SMs and their share of the bandwidth sit idle (batch 1:
8 CTAs on 132 SMs), and each CTA's bandwidth is capped by its pipeline. Cutting the keys into
chunks multiplies the CTAs, and the chunks of one row combine exactly:

  lse = logsumexp_i lse_i,   out = sum_i exp(lse_i - lse) * out_i

(out_i normalized over chunk i, lse_i its natural-log log-sum-exp). A chunk that holds no key a
row sees has lse_i = +inf (the kernels' empty-row mark) and weight 0; a row that no chunk gives a
key comes out as the unsplit forward returns it: out 0, lse +inf.

What, without touching the kernels: k, v [B, S, Hkv, D] are padded to `splits` whole chunks and
viewed as [B * splits, S / splits, Hkv, D] (a free reshape when no padding is needed: the keys
of batch b's chunk i are contiguous), q and the query lengths are repeated per chunk (a decode
call has few queries), chunk i's key length is clip(kv_length - i * chunk, 0, chunk), and the
usual forward (GQA packing included) runs on that batch of B * splits. The kernels write each
chunk's out in the input dtype, so the merged out is rounded once more than the unsplit one
(bf16, 1537 keys in 4 chunks: relative error 2.3e-3 against 2.2e-3 unsplit; lse unchanged).

It is exact only where a row's visible keys do not depend on where its chunk starts: no causal
band or window that hides a key (the MaskSpec offsets count from key 0), and no modifier that
reads positions or heads (segment ids, ALiBi, dropout, bias, masks, mask/score functions): the
soft-cap is elementwise and stays. `ops.attention` checks that (`exact`); the backward pass is
unchanged, it takes the combined out and lse, which are the unsplit ones up to rounding.

How many chunks: `num_splits`, a pure function of the shapes, per device shard. Caveat for the
shape above: a forward CTA holds 160 KiB of shared memory (head_dim 128) and, through
setmaxnreg, the whole register file, so an SM runs one at a time; 128 CTAs already occupy 128
of 132 SMs, and their chunks run as 2 waves of the same per-SM pipeline. Whether that reads
faster is what the benchmark decides (benchmarks/NOTES.md, "Session 4: split-KV decode").
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import gqa_pack

# SMs of an H100 / H200 SXM (the target of the table in `config`).
NUM_SMS = config_lib.NUM_SMS
# Split until the forward grid has this many waves of CTAs. An SM runs one forward CTA at a
# time (160 KiB of shared memory at head_dim 128; setmaxnreg gives the warpgroups the whole
# register file), so a grid below one wave leaves SMs idle; the second wave evens out the SMs'
# shares (132 divides few grids) and absorbs the chunks that end early (short key lengths).
WAVES = 2
# Keys per chunk, in whole tiles of the call (`kv_block`): a CTA pays a fixed cost (launch, q
# load, filling the two-stage ring, the epilogue: estimated at a few microseconds, about one K/V
# tile's worth at decode, not measured) that a chunk of 8 tiles keeps near a tenth of its time.
MIN_BLOCKS_PER_SPLIT = 8


def exact(spec: mask_lib.MaskSpec, q_len: int, kv_len: int, position_free_mods: bool) -> bool:
  """Whether the keys may be split: the visible keys of every row ignore the positions (the
  mask as `gqa_pack.positional_mask` simplifies it), and the modifiers are position free."""
  return position_free_mods and gqa_pack.positional_mask(spec, q_len, kv_len) is not None


def num_splits(q_shape, kv_shape, *, pack_gqa: bool, rows_per_cta: int, kv_block: int,
               num_sms: int = NUM_SMS, waves: int = WAVES,
               min_blocks: int = MIN_BLOCKS_PER_SPLIT) -> int:
  """The number of key chunks of a forward call (1: no split), from the shapes of one device's
  q [B, T, Hq, D] and k [B, S, Hkv, D].

  The forward grid has B * heads * ceil(rows / rows_per_cta) CTAs (heads and rows per head as
  `gqa_pack` lays them out when `pack_gqa`). Split until there are `waves` waves of `num_sms`
  CTAs, keeping at least `min_blocks` tiles of `kv_block` keys per chunk. Keys that are whole
  tiles already are split only into counts that divide the tiles: padding them would copy K and
  V (the bytes the split is meant to read faster) just to reshape them; keys that are padded
  anyway take any count."""
  batch, q_len, heads_q, _ = q_shape
  _, kv_len, heads_kv, _ = kv_shape
  heads, rows = heads_q, q_len
  if pack_gqa:
    heads, rows = heads_kv, q_len * (heads_q // heads_kv)
  ctas = batch * heads * -(-rows // rows_per_cta)
  blocks = -(-kv_len // kv_block)
  most = min(-(-(waves * num_sms) // ctas), blocks // min_blocks)
  if most <= 1:
    return 1
  if kv_len % kv_block:
    return most
  return max(s for s in range(1, most + 1) if blocks % s == 0)


def forward(forward_pass: Callable, splits: int, kv_block: int, q, k, v, q_lengths, kv_lengths,
            *mod_arrays):
  """`forward_pass(q, k, v, q_lengths, kv_lengths) -> (out, lse)` over `splits` key chunks of
  whole `kv_block` tiles, combined. q [B, T, Hq, D], k, v [B, S, Hkv, D], lengths int32 [B] or
  None; `mod_arrays` must all be None (see `exact`). Returns out [B, T, Hq, D] (q.dtype) and
  lse [B, Hq, T] float32 (+inf on rows that saw no key)."""
  if any(x is not None for x in mod_arrays):
    raise ValueError("split-KV takes no modifier arrays (they read positions or heads)")
  batch, kv_len = k.shape[:2]
  chunk = mask_lib.round_up(-(-kv_len // splits), kv_block)
  k, v = (_chunks(x, splits, chunk) for x in (k, v))
  kv_lengths = (jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None
                else jnp.clip(kv_lengths, 0, kv_len))
  starts = jnp.arange(splits, dtype=jnp.int32) * chunk
  chunk_lengths = jnp.clip(kv_lengths[:, None] - starts, 0, chunk).reshape(batch * splits)
  q = jnp.repeat(q, splits, axis=0)  # row b * splits + i: batch b's chunk i, as in `_chunks`
  q_lengths = None if q_lengths is None else jnp.repeat(q_lengths, splits)
  out, lse = forward_pass(q, k, v, q_lengths, chunk_lengths)
  return combine(out.reshape(batch, splits, *out.shape[1:]),
                 lse.reshape(batch, splits, *lse.shape[1:]))


def _chunks(x, splits: int, chunk: int):
  """[B, S, H, D] -> [B * splits, chunk, H, D], zero-padded past S (hidden by the lengths)."""
  batch, kv_len = x.shape[:2]
  if splits * chunk > kv_len:
    x = jnp.pad(x, ((0, 0), (0, splits * chunk - kv_len), (0, 0), (0, 0)))
  return x.reshape(batch * splits, chunk, *x.shape[2:])


def combine(out_parts, lse_parts):
  """Merge the chunks' results: out_parts [B, splits, T, H, D] (each normalized over its chunk),
  lse_parts [B, splits, H, T] float32 (+inf: the chunk gave the row no key). Returns out
  [B, T, H, D] in out_parts' dtype and lse [B, H, T], in float32 throughout; a row that no chunk
  gave a key gets out 0 and lse +inf, as from the unsplit forward."""
  empty = lse_parts == numerics.EMPTY_LSE
  lse_seen = jnp.where(empty, -jnp.inf, lse_parts)
  m = lse_seen.max(axis=1)  # [B, H, T]
  no_keys = m == -jnp.inf
  m = jnp.where(no_keys, 0.0, m)
  w = jnp.exp(lse_seen - m[:, None])  # [B, splits, H, T]; 0 for empty chunks, 1 at the max
  total = jnp.where(no_keys, 1.0, w.sum(axis=1))
  lse = jnp.where(no_keys, numerics.EMPTY_LSE, m + jnp.log(total))
  weights = jnp.swapaxes(w / total[:, None], 2, 3)[..., None]  # [B, splits, T, H, 1]
  out = (out_parts.astype(jnp.float32) * weights).sum(axis=1)
  return out.astype(out_parts.dtype), lse
