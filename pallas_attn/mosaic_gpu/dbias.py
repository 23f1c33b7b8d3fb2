"""The bias gradient kernel for Hopper in Pallas Mosaic GPU.

dbias[b', h', i', j'] sums dS over every (batch, query head, query, key) that the broadcast bias
element (b', h', i', j') is added to; dS = P * (dP - delta) (times the soft-cap's derivative) is
the gradient of the natural-log logit, the same dS the dQ kernel forms. Without atomics (and the
interpreter has no `reduction_op`), each CTA owns one output tile of the bias's own shape and
loops over everything that maps onto it, recomputing S, P, dP and dS there:

- grid (bias heads, bias q tiles x bias kv tiles, bias batch); a full q (kv) axis is cut into
  block_q (block_kv) tiles, a broadcast one is a single tile that loops over every q (kv) block;
- the CTA's loop: the batch elements and query heads of its group, then the query blocks, then
  the visible key blocks of each (`mask.kv_block_range`: causal / window / length skipping);
- the sum stays in registers: a [block_q, block_kv] float32 tile with a kv axis, a [block_q] row
  sum without. A broadcast q axis is summed only down to block_q partial rows here: the kernel
  writes [block_q, ...] partial sums, and `dbias` adds those block_q rows outside (an O(kv_len)
  array, not a reduction across warps in the kernel).

One compute warpgroup per CTA with synchronous TMA loads (no producer, no ring): the simple
first version. It is launched only when the bias is differentiated (`ops`), and costs about one
more recomputation of S and dP over the visible tiles for every bias tile's group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import common
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import mods as mods_lib


def _kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref, mod_refs,
            dbias_ref, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, out_smem, loaded, *,
            spec: mask_lib.MaskSpec, scale: float, cfg: config_lib.KernelConfig,
            mods: mods_lib.KernelMods, num_q_blocks: int, num_kv_blocks: int, heads_q: int,
            groups: int, batch_size: int):
  axes = mods.bias
  block_q, block_kv = cfg.block_q, cfg.block_kv
  bias_head = lax.axis_index("heads")
  bias_batch = lax.axis_index("batch")
  tile = lax.axis_index("tiles")
  kv_tiles = num_kv_blocks if axes.kv else 1
  q_tile, kv_tile = lax.div(tile, kv_tiles), lax.rem(tile, kv_tiles)
  # The (batch, head) pairs, query blocks and key blocks this bias tile collects from.
  batch_lo, num_batches = (bias_batch, 1) if axes.batch else (0, batch_size)
  head_lo, num_heads = (bias_head, 1) if axes.heads else (0, heads_q)
  q_lo, q_hi = (q_tile, q_tile + 1) if axes.q else (0, num_q_blocks)
  kv_lo, kv_hi = (kv_tile, kv_tile + 1) if axes.kv else (0, num_kv_blocks)

  def copy(src, dst, i):
    plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])

  def wait(*indices):
    for i in indices:
      plgpu.barrier_wait(loaded.at[i])

  def one_pair(g, acc):
    batch = batch_lo + lax.div(g, num_heads)
    head = head_lo + lax.rem(g, num_heads)
    kv_head = lax.div(head, groups)
    q_length = q_len_ref[batch]
    kv_length = kv_len_ref[batch]

    def one_q_block(qi, acc):
      q_start = qi * block_q
      rows = (batch, pl.ds(q_start, block_q), head)
      stats = (batch, head, pl.ds(q_start, block_q))
      lo, hi = mask_lib.kv_block_range(spec, q_start, block_q, block_kv, num_kv_blocks,
                                       kv_length)
      hi = jnp.where(q_start >= q_length, lo, hi)
      lo = jnp.clip(lo, kv_lo, kv_hi)
      hi = jnp.clip(hi, lo, kv_hi)
      scores = mods_lib.TileScorer.create(mods, spec, scale, mod_refs, batch=batch, head=head,
                                          row_start=q_start, rows=block_q, kv_length=kv_length,
                                          backward=True)
      # The previous block's generic reads of these buffers are done before TMA overwrites them.
      plgpu.commit_smem()
      copy(q_ref.at[rows], q_smem, 0)
      copy(do_ref.at[rows], do_smem, 1)
      copy(lse_ref.at[stats], lse_smem, 2)
      copy(delta_ref.at[stats], delta_smem, 3)
      wait(0, 1, 2, 3)
      lse2 = plgpu.load(lse_smem, (), layout=common.WGMMA_ROW) * common.LOG2E
      delta = plgpu.load(delta_smem, (), layout=common.WGMMA_ROW)

      def one_kv_block(j, acc):
        cols = scores.columns(j, block_kv)
        keys = (batch, pl.ds(j * block_kv, block_kv), kv_head)
        plgpu.commit_smem()
        copy(k_ref.at[keys], k_smem, 4)
        copy(v_ref.at[keys], v_smem, 5)
        wait(4)
        s = common.matmul(q_smem, k_smem.T, (block_q, block_kv))  # [block_q, block_kv]
        s, chain = scores(s, cols, masked=True)
        p = jnp.exp2(s - common.broadcast_rows(lse2, s.shape))
        wait(5)
        dp = common.matmul(do_smem, v_smem.T, (block_q, block_kv))
        dp = scores.dropped(dp, scores.dropout_keep(dp, cols))
        ds = mods_lib.logit_grad(p * (dp - common.broadcast_rows(delta, dp.shape)), chain)
        return acc + ds if axes.kv else acc + ds.sum(axis=1)

      return lax.fori_loop(lo, hi, one_kv_block, acc)

    return lax.fori_loop(q_lo, q_hi, one_q_block, acc)

  if axes.kv:
    acc = plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32), common.WGMMA)
  else:
    acc = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), common.WGMMA_ROW)
  acc = lax.fori_loop(0, num_batches * num_heads, one_pair, acc)

  out_rows = pl.ds(q_tile * block_q if axes.q else 0, block_q)
  out_smem[...] = acc
  plgpu.commit_smem()
  if axes.kv:
    plgpu.copy_smem_to_gmem(out_smem, dbias_ref.at[bias_batch, bias_head, out_rows,
                                                   pl.ds(kv_tile * block_kv, block_kv)])
  else:
    plgpu.copy_smem_to_gmem(out_smem, dbias_ref.at[bias_batch, bias_head, out_rows])
  plgpu.wait_smem_to_gmem(0)


def dbias(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, *, bias_shape, scale: float,
          spec: mask_lib.MaskSpec, cfg: config_lib.KernelConfig, interpret: bool,
          mods: mods_lib.KernelMods, mod_arrays: mods_lib.ModArrays):
  """The bias gradient, float32, of the padded bias's shape `bias_shape` ([B|1, Hq|1, T|1,
  S|1], T and S padded like q and k). Inputs padded as for `bwd.dq`; `mods.bias` is set."""
  axes = mods.bias
  batch, q_len, heads_q, head_dim = q.shape
  kv_len, heads_kv = k.shape[1], k.shape[2]
  bias_batch, bias_heads = bias_shape[:2]
  num_q_blocks, num_kv_blocks = q_len // cfg.block_q, kv_len // cfg.block_kv
  out_rows = q_len if axes.q else cfg.block_q  # a broadcast q axis: block_q partial sums
  if axes.kv:
    out_type = jax.ShapeDtypeStruct((bias_batch, bias_heads, out_rows, kv_len), jnp.float32)
    out_tile = plgpu.SMEM((cfg.block_q, cfg.block_kv), jnp.float32)
  else:
    out_type = jax.ShapeDtypeStruct((bias_batch, bias_heads, out_rows), jnp.float32)
    out_tile = plgpu.SMEM((cfg.block_q,), jnp.float32)
  kernel = functools.partial(
      _kernel, spec=spec, scale=scale, cfg=cfg, mods=mods, num_q_blocks=num_q_blocks,
      num_kv_blocks=num_kv_blocks, heads_q=heads_q, groups=heads_q // heads_kv,
      batch_size=batch)
  tile = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=common.TILE_TRANSFORMS)
  partial = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=[
          tile(cfg.block_q, head_dim),  # q
          tile(cfg.block_q, head_dim),  # dO
          plgpu.SMEM((cfg.block_q,), jnp.float32),  # lse
          plgpu.SMEM((cfg.block_q,), jnp.float32),  # delta
          tile(cfg.block_kv, head_dim),  # k
          tile(cfg.block_kv, head_dim),  # v
          out_tile,  # dbias out
          plgpu.Barrier(num_barriers=6),  # q, dO, lse, delta, k, v loaded
      ],
      grid=(bias_heads, (num_q_blocks if axes.q else 1) * (num_kv_blocks if axes.kv else 1),
            bias_batch),
      grid_names=("heads", "tiles", "batch"),
      compiler_params=common.compiler_params(),
      interpret=common.interpret_params(interpret),
  )(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, mod_arrays)
  if not axes.kv:
    partial = partial[..., None]
  if not axes.q:
    partial = partial.sum(axis=2, keepdims=True)
  return partial
