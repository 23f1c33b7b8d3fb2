"""Backward FlashAttention kernels for Hopper in Pallas Mosaic GPU.

Both kernels recompute the probabilities of each tile from q, k and the saved lse,
P = exp2(S * scale * log2(e) - lse * log2(e)), so no [q_len, kv_len] array is ever stored.
With delta = rowsum(dO * O) precomputed, dS = P * (dP - delta) where dP = dO V^T.

- `dq`: one CTA per 2 * block_q query rows of a (batch, head); a producer warpgroup streams K/V
  tiles of the visible key range; each compute warpgroup accumulates dQ = scale * dS K.
- `dkv`: one CTA per 2 * block_kv key rows of a (batch, kv head); the producer streams q, dO,
  lse and delta tiles for every query head of the GQA group and every visible query block; each
  compute warpgroup accumulates dV = P^T dO and dK = scale * dS^T Q for its key rows, summed over
  the group in registers (no per-query-head copy of dK/dV; with `group_parts`, over each part's
  share of the group, the parts' dK/dV added after the kernel).
Block skipping and end-of-range masking follow `mask` (with segment ids, a boolean mask or a
mask_fn: a block table per CTA, `block_table.query_major` for dQ, `key_major` for dK/dV, one
list per kv head for every query head of its group), and the score modifiers `mods`, exactly as
in the forward kernel; with a soft-cap and a score_fn, dS is multiplied by their derivatives (`mods.logit_grad`; score_fn's by `jax.jvp` in the
kernel). With dropout, dP is masked and scaled by the regenerated keep-mask,
dS = P * (dP_dropped - delta), and dV takes the dropped, scaled P. Rows whose lse is +inf (no
visible key, or past their query length) get P = 0 and no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import block_table
from pallas_attn.mosaic_gpu import common
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import head_split
from pallas_attn.mosaic_gpu import mods as mods_lib

_WGS = config_lib.COMPUTE_WARPGROUPS


# ---------------------------------------------------------------------------------------------
# dQ


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_len_ref, mod_refs, table_refs,
               dq_ref,
               q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem,
               q_full, k_full, v_full, k_free, v_free, *,
               spec: mask_lib.MaskSpec, scale: float, cfg: config_lib.KernelConfig,
               num_q_tiles: int, num_kv_blocks: int, groups: int, mods: mods_lib.KernelMods,
               interpret: bool):
  block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  batch, head, kv_head, wg = common.query_head_position(groups)
  kv_length = kv_len_ref[batch]

  q_tile = common.tile_index("q_tiles", num_q_tiles, cfg.reverse_q_tiles)
  cta_start = q_tile * (_WGS * block_q)
  cta_list = None
  if table_refs is None:
    cta_lo, cta_hi = mask_lib.kv_block_range(spec, cta_start, _WGS * block_q, block_kv,
                                             num_kv_blocks, kv_length)
  else:
    cta_list = block_table.CtaList.read(table_refs, batch=batch, head=head, tile=q_tile)

  @pl.when(wg == _WGS)
  def _producer():
    if cta_list is None:
      block_of, num_blocks = (lambda i: cta_lo + i), cta_hi - cta_lo
    else:
      block_of, num_blocks = cta_list.block, cta_list.count
    common.produce_kv(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free,
                      batch=batch, kv_head=kv_head, block_of=block_of,
                      num_blocks=num_blocks, block_kv=block_kv, stages=stages,
                      registers=cfg.producer_registers)

  @pl.when(wg < _WGS)
  def _consumer():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")
    q_start = cta_start + wg * block_q
    rows = (batch, pl.ds(q_start, block_q), head)
    stats = (batch, head, pl.ds(q_start, block_q))
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], q_full.at[wg * 4 + 0])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[wg], q_full.at[wg * 4 + 1])
    plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[wg], q_full.at[wg * 4 + 2])
    plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[wg], q_full.at[wg * 4 + 3])

    if cta_list is None:
      lo, hi = mask_lib.kv_block_range(spec, q_start, block_q, block_kv, num_kv_blocks,
                                       kv_length)
      lo = jnp.clip(lo, cta_lo, cta_hi)
      hi = jnp.clip(hi, lo, cta_hi)
      full_lo, full_hi = mask_lib.kv_full_range(spec, q_start, block_q, block_kv, lo, hi,
                                                kv_length)
      slot_of = lambda j: lax.rem(j - cta_lo, stages)
    scores = mods_lib.TileScorer.create(mods, spec, scale, mod_refs, batch=batch, head=head,
                                        row_start=q_start, rows=block_q, kv_length=kv_length,
                                        backward=True)
    for i in range(4):
      plgpu.barrier_wait(q_full.at[wg * 4 + i])
    lse2 = plgpu.load(lse_smem.at[wg], (), layout=common.WGMMA_ROW) * common.LOG2E
    delta = plgpu.load(delta_smem.at[wg], (), layout=common.WGMMA_ROW)
    # The A operands of S's and dP's wgmmas: q and dO from registers (`dq_lhs_in_registers`),
    # or from shared memory.
    q_lhs, do_lhs = q_smem.at[wg], do_smem.at[wg]
    if cfg.dq_lhs_in_registers and not interpret:
      q_lhs, do_lhs = (plgpu.load(ref, (), layout=common.WGMMA) for ref in (q_lhs, do_lhs))

    def release(slot, carry):
      common.release_kv(slot, k_full, v_full, k_free, v_free)
      return carry

    def probabilities(s, cols, *, masked: bool):
      """P of a [block_q, block_kv] score tile (and the score modifiers' chain)."""
      s, chain = scores(s, cols, masked=masked)
      return jnp.exp2(s - common.broadcast_rows(lse2, s.shape)), chain

    def scores_grad_of(p, chain, dp, cols):
      """dS in the input dtype, from P and dP (dP of the dropped weights under dropout)."""
      dp = scores.dropped(dp, scores.dropout_keep(dp, cols))
      ds = mods_lib.logit_grad(p * (dp - common.broadcast_rows(delta, dp.shape)), chain)
      return ds.astype(dtype)

    def scores_grad(slot, j, *, masked: bool, after_s=lambda: None):
      """dS of key block j (ring slot `slot`) in the input dtype, V's slot released;
      `after_s` runs once S's wgmma (and every wgmma issued before it) is done."""
      cols = scores.columns(j, block_kv, masked=masked)

      def probabilities_after_s(s):
        after_s()
        return probabilities(s, cols, masked=masked)

      tile = (block_q, block_kv)
      plgpu.barrier_wait(k_full.at[slot])
      if cfg.co_issue_dp:
        plgpu.barrier_wait(v_full.at[slot])
        (p, chain), dp = common.matmul_pair((q_lhs, k_smem.at[slot].T, tile),
                                            (do_lhs, v_smem.at[slot].T, tile),
                                            probabilities_after_s)
      else:
        p, chain = probabilities_after_s(common.matmul(q_lhs, k_smem.at[slot].T, tile))
        plgpu.barrier_wait(v_full.at[slot])
        dp = common.matmul(do_lhs, v_smem.at[slot].T, tile)
      plgpu.barrier_arrive(v_free.at[slot])
      return scores_grad_of(p, chain, dp, cols)

    def step(slot, j, dq, *, masked: bool):
      """Key block j, in ring slot `slot`: dQ += dS K, awaited."""
      dq = common.matmul_acc(dq, scores_grad(slot, j, masked=masked), k_smem.at[slot],
                             ds_smem[0].at[wg] if ds_smem else None)
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    def release_pending_k(carry):
      """dq_in_flight: free the K slot of the dQ wgmma last issued, if any (it has finished)."""
      prev_slot, _, pending = carry

      @pl.when(pending != 0)
      def _():
        plgpu.barrier_arrive(k_free.at[prev_slot])

    def step_in_flight(dq_acc, slot, j, carry, *, masked: bool):
      """Key block j with `cfg.dq_in_flight`: dQ += dS K is issued and left running; the next
      step's first wait covers it, and only then is this K slot released. carry: (the slot of
      the dQ wgmma in flight, steps taken, whether one is in flight)."""
      count = carry[1]
      ds = scores_grad(slot, j, masked=masked, after_s=lambda: release_pending_k(carry))
      ds_tile = ds_smem[0].at[wg, lax.rem(count, 2)]  # (the one dQ(count - 2) read: done)
      ds_tile[...] = ds
      plgpu.commit_smem()
      plgpu.wgmma(dq_acc, ds_tile, k_smem.at[slot])
      return slot, count + 1, jnp.int32(1)

    def release_in_flight(slot, carry):
      """A skipped block's slot with `cfg.dq_in_flight`: the dQ wgmma in flight is awaited and
      its K slot freed first, since the producer may need that slot refilled before it fills
      this one (a warpgroup can skip several blocks after its last one: a ring of 2 would
      deadlock)."""
      plgpu.wgmma_wait(0)
      release_pending_k(carry)
      release(slot, None)
      return carry[0], carry[1], jnp.int32(0)

    # overlap_dq: the dQ wgmma of the step before, dQ += dS(j - 1) K(j - 1), issued behind step
    # j's S and dP, so that step j's softmax and dS run on the CUDA cores while it is on the
    # tensor cores. dQ is one accumulator for the walk; carry: (dS of the step before, in
    # registers, its ring slot, steps since the last flush).
    staging = ds_smem[0].at[wg] if ds_smem else None
    no_ds = (plgpu.layout_cast(jnp.zeros((block_q, block_kv), dtype), common.WGMMA)
             if cfg.overlap_dq else None)

    def step_overlapped(dq_acc, slot, j, carry, *, masked: bool):
      """Key block j with `cfg.overlap_dq`; K(j - 1)'s slot is released once its dQ wgmma is
      done (at this step's end), so the producer refills it a step later than without."""
      ds_prev, prev_slot, count = carry
      cols = scores.columns(j, block_kv, masked=masked)
      plgpu.barrier_wait(k_full.at[slot])
      plgpu.barrier_wait(v_full.at[slot])

      def scores_grad_under_dq(s_ref, dp_ref):
        plgpu.wgmma(s_ref, q_lhs, k_smem.at[slot].T)
        plgpu.wgmma(dp_ref, do_lhs, v_smem.at[slot].T)
        # (After a flush there is no dS before: zeros times this step's K, which is loaded, so
        # that every step issues three wgmmas and the waits below count them.)
        common.issue_acc(dq_acc, ds_prev, k_smem.at[jnp.where(count > 0, prev_slot, slot)],
                         staging)
        p, chain = probabilities(plgpu.wgmma_accumulator_load(s_ref, wait_n=2), cols,
                                 masked=masked)
        dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)
        plgpu.barrier_arrive(v_free.at[slot])
        return scores_grad_of(p, chain, dp, cols)

      ds = common.step_under_pending(scores_grad_under_dq, (block_q, block_kv), count,
                                     lambda: plgpu.barrier_arrive(k_free.at[prev_slot]))
      return ds, slot, count + 1

    def flush(dq_acc, carry):
      """overlap_dq: the pending dQ wgmma, if any, made and its K slot released."""
      ds_prev, prev_slot, count = carry

      @pl.when(count > 0)
      def _():
        common.issue_acc(dq_acc, ds_prev, k_smem.at[prev_slot], staging)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(k_free.at[prev_slot])

      return no_ds, prev_slot, jnp.zeros_like(count)

    def release_overlapped(dq_acc, slot, carry):
      """A skipped block with `cfg.overlap_dq`: the pending dQ wgmma is made first, so that its
      K slot (which the producer may need for a later block) is not held across the skip."""
      carry = flush(dq_acc, carry)
      release(slot, None)
      return carry

    def walk(step, release, carry):
      """`step` over the CTA's key blocks, `release` for the skipped ones."""
      if cta_list is None:
        release_block = lambda j, c: release(slot_of(j), c)
        carry = lax.fori_loop(cta_lo, lo, release_block, carry)
        carry = common.masked_loops(lo, full_lo, full_hi, hi,
                                    lambda j, c, masked: step(slot_of(j), j, c, masked=masked),
                                    carry)
        return lax.fori_loop(hi, cta_hi, release_block, carry)
      return cta_list.visit(wg, carry, slot_of=lambda i: lax.rem(i, stages), release=release,
                            step=step)

    if cfg.overlap_dq:
      def accumulate(dq_acc):
        carry = walk(functools.partial(step_overlapped, dq_acc),
                     functools.partial(release_overlapped, dq_acc),
                     (no_ds, jnp.int32(0), jnp.int32(0)))
        flush(dq_acc, carry)
        return dq_acc[...]

      dq = pl.run_scoped(accumulate, plgpu.ACC((block_q, head_dim), jnp.float32))
    elif cfg.dq_in_flight:
      def accumulate(dq_acc):
        carry = walk(functools.partial(step_in_flight, dq_acc), release_in_flight,
                     (jnp.int32(0), jnp.int32(0), jnp.int32(0)))
        plgpu.wgmma_wait(0)
        release_pending_k(carry)
        return dq_acc[...]

      dq = pl.run_scoped(accumulate, plgpu.ACC((block_q, head_dim), jnp.float32))
    else:
      dq = walk(step, release, plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32),
                                                 common.WGMMA))

    q_smem.at[wg][...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)


def dq(q, k, v, d_out, lse, delta, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
       cfg: config_lib.KernelConfig, interpret: bool,
       mods: mods_lib.KernelMods = mods_lib.KernelMods(),
       mod_arrays: mods_lib.ModArrays = mods_lib.ModArrays(),
       table: block_table.BlockTable | None = None):
  """dQ [B, T, Hq, D] in q.dtype. Shapes as in `fwd.forward`; lse, delta [B, Hq, T] float32.
  `table`: `block_table.query_major` at (cfg.block_q, cfg.block_kv) (`rows_per_cta=1` with
  `cfg.head_split`), or None (positions)."""
  if cfg.head_split:
    return head_split.dq(q, k, v, d_out, lse, delta, kv_lengths, scale=scale, spec=spec, cfg=cfg,
                         interpret=interpret, mods=mods, mod_arrays=mod_arrays, table=table)
  batch, q_len, heads_q, head_dim = q.shape
  kv_len, heads_kv = k.shape[1], k.shape[2]
  num_q_tiles = q_len // (_WGS * cfg.block_q)
  kernel = functools.partial(_dq_kernel, spec=spec, scale=scale, cfg=cfg, num_q_tiles=num_q_tiles,
                             num_kv_blocks=kv_len // cfg.block_kv, groups=heads_q // heads_kv,
                             mods=mods, interpret=interpret)
  grid, grid_names = cfg.grid(heads=heads_q, tiles=num_q_tiles, batch=batch, tile_axis="q_tiles")
  return common.warp_specialized(
      kernel, lambda interp: dq_scratch_types(cfg, head_dim, q.dtype, interp),
      out_type=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=grid, grid_names=grid_names,
      what=f"the dQ kernel with {cfg}", reduces=False,
      interpret=interpret)(q, k, v, d_out, lse, delta, kv_lengths, mod_arrays, table)


def dq_scratch_types(cfg: config_lib.KernelConfig, head_dim: int, dtype, interpret: bool) -> list:
  """The dQ kernel's shared memory and barriers (the order `_dq_kernel` takes them in;
  `head_split.dq_scratch_types` with cfg.head_split)."""
  if cfg.head_split:
    return head_split.dq_scratch_types(cfg, head_dim, dtype, interpret)
  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=common.TILE_TRANSFORMS)
  return [
      tile(_WGS, cfg.block_q, head_dim),  # q, then dq out
      tile(_WGS, cfg.block_q, head_dim),  # dO
      plgpu.SMEM((_WGS, cfg.block_q), jnp.float32),  # lse
      plgpu.SMEM((_WGS, cfg.block_q), jnp.float32),  # delta
      tile(cfg.stages, cfg.block_kv, head_dim),  # k ring
      tile(cfg.stages, cfg.block_kv, head_dim),  # v ring
      # dS for dQ's wgmma: two per warpgroup with dq_in_flight (one is read while the next is
      # written), else the interpreter's staging (compiled, dS stays in registers)
      (tile(_WGS, 2, cfg.block_q, cfg.block_kv),) if cfg.dq_in_flight
      else common.staging_scratch(interpret, (_WGS, cfg.block_q, cfg.block_kv), dtype),
      plgpu.Barrier(num_barriers=_WGS * 4),  # q, dO, lse, delta loaded (per warpgroup)
      plgpu.Barrier(num_barriers=cfg.stages),  # k slot filled
      plgpu.Barrier(num_barriers=cfg.stages),  # v slot filled
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=cfg.stages),  # k slot free
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=cfg.stages),  # v slot free
  ]


# ---------------------------------------------------------------------------------------------
# dK / dV


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref, mod_refs,
                table_refs, dq_acc_ref, *refs, spec: mask_lib.MaskSpec, scale: float,
                cfg: config_lib.KernelConfig,
                num_q_blocks: int, groups: int, group_parts: int, outputs: tuple[str, ...],
                mods: mods_lib.KernelMods, dq_partials: bool):
  out_refs = dict(zip(outputs, refs[:len(outputs)]))
  (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, staging,
   kv_full, q_full, do_full, lse_full, delta_full, slot_free, *dq_smem) = refs[len(outputs):]
  block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  batch = lax.axis_index("batch")
  kv_head, head_part, first_head = common.key_tile_heads(groups, group_parts)
  wg = lax.axis_index("wg")
  q_length = q_len_ref[batch]
  kv_length = kv_len_ref[batch]

  # (Causal: the first key tiles see the most queries; the launch order is heaviest first already.)
  cta_start = lax.axis_index("kv_tiles") * (_WGS * block_kv)
  cta_list = None
  if table_refs is None:
    cta_lo, cta_hi = mask_lib.q_block_range(spec, cta_start, _WGS * block_kv, block_q,
                                            num_q_blocks, q_length)
    cta_hi = jnp.where(cta_start >= kv_length, cta_lo, cta_hi)  # every key is padding
    per_head = cta_hi - cta_lo  # steps per query head of the group
    block_of = lambda e: cta_lo + e  # the query block of the e-th step of a head
  else:  # (the table's heads axis: 1 or the kv heads, `dkv` checks)
    cta_list = block_table.CtaList.read(table_refs, batch=batch, head=kv_head,
                                        tile=lax.axis_index("kv_tiles"))
    per_head, block_of = cta_list.count, cta_list.block

  common.produce_query_rows(
      wg, (q_ref, do_ref, lse_ref, delta_ref), (q_smem, do_smem, lse_smem, delta_smem),
      (q_full, do_full, lse_full, delta_full), slot_free, batch=batch, first_head=first_head,
      groups=groups, per_head=per_head, block_of=block_of, block_q=block_q, stages=stages,
      registers=cfg.producer_registers)

  @pl.when(wg < _WGS)
  def _consumer():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")
    kv_start = cta_start + wg * block_kv
    rows = (batch, pl.ds(kv_start, block_kv), kv_head)
    out_rows = (batch, pl.ds(kv_start, block_kv), head_part)  # (head_part = kv_head: parts 1)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[wg], kv_full.at[wg * 2 + 0])
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[wg], kv_full.at[wg * 2 + 1])

    if cta_list is None:
      lo, full_lo, full_hi, hi = common.key_tile_query_ranges(
          spec, kv_start, block_kv, block_q, num_q_blocks, q_length, kv_length,
          within=(cta_lo, cta_hi))
      if cfg.dq_halves:  # both warpgroups step the CTA's whole range (masked outside ours)
        lo, hi = cta_lo, cta_hi
    key_scores = mods_lib.TileScorer.create(mods, spec, scale, mod_refs, batch=batch,
                                            row_start=kv_start, rows=block_kv,
                                            kv_length=kv_length, transposed=True,
                                            backward=True)
    plgpu.barrier_wait(kv_full.at[wg * 2 + 0])
    plgpu.barrier_wait(kv_full.at[wg * 2 + 1])

    same_tile = functools.partial(common.same_tile_index, in_step=cfg.tile_descriptors_in_step)

    def wait_filled(slot):
      plgpu.barrier_wait(q_full.at[slot])
      plgpu.barrier_wait(do_full.at[slot])
      plgpu.barrier_wait(lse_full.at[slot])
      plgpu.barrier_wait(delta_full.at[slot])

    if dq_acc_ref is not None:
      # (dq_halves: `halves_met` holds the two meetings: dS^T tiles ready, per ring slot;
      # both warpgroups past their last dQ wgmma, before the K tiles carry dK out.)
      ds_smem, dq_out_smem, *halves_met = dq_smem
      # dq_step_late: per slot of the dS^T ring, both warpgroups' dQ wgmmas that read it done.
      ds_read = halves_met.pop() if cfg.dq_step_late else None
      # Interpreted, each (key tile, warpgroup) writes its own partial dQ (the interpreter has
      # no TMA reduction); compiled, every CTA adds into the one zeroed dQ.
      dq_dest = (dq_acc_ref.at[lax.axis_index("kv_tiles") * _WGS + wg] if dq_partials
                 else dq_acc_ref)
      # This warpgroup's dQ part, [dq_rows, dq_width]: with dq_row_halves the query block's rows
      # `dq_row_slice`, with dq_column_halves its columns `dq_columns`; plain fused_dq, all.
      dq_part = cfg.dq_part_shape(head_dim)
      dq_rows, dq_width = dq_part
      dq_row_slice = pl.ds(wg * dq_rows, dq_rows)  # (dq_row_halves only)
      dq_columns = pl.ds(wg * dq_width, dq_width)  # (dq_column_halves only)

    def dq_operands(dst, slot):
      """Writes this warpgroup's dS^T to shared memory, where the dQ wgmma reads it transposed,
      and returns that wgmma's (lhs, rhs) pairs: plain fused_dq, dS times this warpgroup's K
      tile, every column; dq_column_halves, both warpgroups' dS (they meet at `halves_met[0]`)
      times the matching half of the columns of both K tiles; dq_row_halves, this warpgroup's
      half of the rows of both warpgroups' dS times both K tiles. (Ring slot `slot`'s dS^T tiles
      are rewritten only after both warpgroups released the slot, so after both read them.)
      (dK's wgmma keeps reading dS^T from registers: reading it from here instead spilled more
      and was 5-9% slower on the H200, benchmarks/NOTES.md session 6.)"""
      own_ds = ds_smem.at[slot, wg] if cfg.dq_halves else ds_smem.at[wg]
      own_ds[...] = dst
      plgpu.commit_smem()
      if not cfg.dq_halves:
        return [(own_ds.T, k_smem.at[same_tile(wg)])]
      plgpu.barrier_arrive(halves_met[0].at[slot])
      return halves_pairs(slot)

    def halves_pairs(slot):
      """dq_halves: the dQ wgmma pairs of the dS^T tiles in slot `slot`, once both warpgroups
      have written theirs."""
      plgpu.barrier_wait(halves_met[0].at[slot])
      if cfg.dq_row_halves:  # (dS^T's columns are the query rows)
        return [(ds_smem.at[slot, w, :, dq_row_slice].T, k_smem.at[same_tile(w)])
                for w in range(_WGS)]
      return [(ds_smem.at[slot, w].T, k_smem.at[same_tile(w), :, dq_columns])
              for w in range(_WGS)]

    def late_dq_operands(dst, count):
      """dq_step_late: writes this warpgroup's dS^T of its step `count` to slot count % 2 of the
      dS^T ring (once both warpgroups' dQ wgmmas of step count - 2 have read that slot) and
      returns the dQ wgmma pairs of step count - 1, whose tiles were written a step ago: the
      warpgroups meet for tiles that are (nearly always) there already, not for this step's."""
      slot = lax.rem(count, 2)
      plgpu.barrier_wait(ds_read.at[slot])
      ds_smem.at[slot, wg][...] = dst
      plgpu.commit_smem()
      plgpu.barrier_arrive(halves_met[0].at[slot])
      return halves_pairs(1 - slot)

    def reduce_late_dq(part, pending):
      """dq_step_late: the reduce-add of the dQ part of the step before (`pending`: (this
      warpgroup's steps so far, that step's query head and block); none before the first)."""
      count, head, qi = pending

      @pl.when(count > 0)
      def _():
        reduce_dq(part, head, qi)

    def reduce_dq(part, head, qi):
      """dQ[qi block (, this warpgroup's half)] += part, by a TMA reduce-add from shared memory."""
      rows_start = qi * block_q
      if cfg.dq_row_halves:
        rows_start += dq_row_slice.start
      rows_out = (batch, pl.ds(rows_start, dq_rows), head)
      if cfg.dq_column_halves:
        rows_out = (*rows_out, dq_columns)
      common.reduce_add(part, dq_out_smem.at[wg], dq_dest.at[rows_out], dq_partials)

    # The interpreter's staging tile for register A operands (`common.matmul_acc`); compiled,
    # none.
    stage = staging[0].at[wg] if staging else None

    def one_head(g, carry, dkv_accs=None):
      # (The query head only matters to ALiBi, dropout and the user's functions: don't compute
      # it otherwise.)
      scores = key_scores.for_head(first_head + g) if mods.per_head else key_scores

      def observe_and_free(slot, c):
        """A skipped block's ring slot: its fill observed, then freed."""
        wait_filled(slot)
        plgpu.barrier_arrive(slot_free.at[slot])
        return c

      def probabilities_of(slot, cols, *, masked: bool):
        """P^T [block_kv, block_q] from S^T of ring slot `slot`'s query block, the score
        modifiers' chain, and the dropout keep-mask (transposed like the tile)."""

        def probabilities(st):
          st, chain = scores(st, cols, masked=masked)
          lse2 = plgpu.load(lse_smem.at[slot], (), layout=common.WGMMA_COL) * common.LOG2E
          pt = jnp.exp2(st - common.broadcast_cols(lse2, st.shape))
          return pt, chain, scores.dropout_keep(pt, cols)

        return probabilities

      def scores_grad_t(pt, chain, dpt, keep, slot):
        """dS^T in the input dtype, from P^T and dP^T (dropped under dropout)."""
        dpt = scores.dropped(dpt, keep)
        delta = plgpu.load(delta_smem.at[slot], (), layout=common.WGMMA_COL)
        dst = mods_lib.logit_grad(pt * (dpt - common.broadcast_cols(delta, dpt.shape)), chain)
        return dst.astype(dtype)

      def step(slot, qi, acc, *, masked: bool):
        """Query block qi, in ring slot `slot`."""
        acc = dict(acc)
        cols = scores.columns(qi, block_q, masked=masked)
        wait_filled(slot)
        probabilities = probabilities_of(slot, cols, masked=masked)

        tile, kv = (block_kv, block_q), same_tile(wg)
        st_operands = (k_smem.at[kv], q_smem.at[slot].T, tile)  # S^T
        dpt_operands = (v_smem.at[kv], do_smem.at[slot].T, tile)  # dP^T
        dpt = None
        if cfg.co_issue_dp and "dk" in outputs:
          (pt, chain, keep), dpt = common.matmul_pair(st_operands, dpt_operands, probabilities)
        else:
          pt, chain, keep = probabilities(common.matmul(*st_operands))
        pairs = cfg.co_issue_dkv and outputs == ("dk", "dv")
        if "dv" in outputs:
          dv_operands = (scores.dropped(pt, keep).astype(dtype), do_smem.at[slot])
          if not pairs:
            acc["dv"] = common.matmul_acc(acc["dv"], *dv_operands, stage)
        if "dk" in outputs:
          if dpt is None:
            dpt = common.matmul(*dpt_operands)
          dst = scores_grad_t(pt, chain, dpt, keep, slot)
          # The accumulators this step's wgmmas add into here (dV's went in above without pairs).
          accumulating = {"dk": (acc["dk"], dst, q_smem.at[slot])}
          if pairs:
            accumulating = {"dv": (acc["dv"], *dv_operands), **accumulating}
          dq_head = first_head + g
          if dq_acc_ref is not None and cfg.dq_step_late:
            count = acc["late_dq"][0]
            accs, part = common.matmul_accs_then_product(
                tuple(accumulating.values()), lambda: late_dq_operands(dst, count),
                dq_part, stage)
            acc.update(zip(accumulating, accs))
            plgpu.barrier_arrive(ds_read.at[1 - lax.rem(count, 2)])  # (read: done)
            reduce_late_dq(part, acc["late_dq"])
            acc["late_dq"] = (count + 1, dq_head, qi)
          elif dq_acc_ref is not None and cfg.co_issue_dq:
            accs, part = common.matmul_accs_then_product(
                tuple(accumulating.values()), lambda: dq_operands(dst, slot),
                dq_part, stage)
            acc.update(zip(accumulating, accs))
            reduce_dq(part, dq_head, qi)
          else:
            if pairs:
              acc["dv"], acc["dk"] = common.matmul_acc_pair(*accumulating.values(), stage)
            else:
              acc["dk"] = common.matmul_acc(*accumulating["dk"], stage)
            if dq_acc_ref is not None:
              reduce_dq(common.matmul_sum(dq_operands(dst, slot), dq_part),
                        dq_head, qi)
        plgpu.barrier_arrive(slot_free.at[slot])
        return acc

      def step_overlapped(slot, qi, carry, *, masked: bool):
        """Query block qi, in ring slot `slot`, with `cfg.overlap_dkv`: S^T and dP^T issued,
        then the step before's dK wgmma (its dS^T kept in registers); P^T made and this step's
        dV wgmma issued; then dS^T made while both are on the tensor cores. The step before's
        ring slot (its q) is released once its dK wgmma is done, at this step's end."""
        dst_prev, prev_slot, count = carry
        cols = scores.columns(qi, block_q, masked=masked)
        wait_filled(slot)
        probabilities = probabilities_of(slot, cols, masked=masked)

        def grads_under_dkv(st_ref, dpt_ref):
          kv = same_tile(wg)
          plgpu.wgmma(st_ref, k_smem.at[kv], q_smem.at[slot].T)
          plgpu.wgmma(dpt_ref, v_smem.at[kv], do_smem.at[slot].T)
          # (After a flush there is no step before: zeros times this step's q, which is
          # loaded, so that every step issues four wgmmas and the waits below count them.)
          common.issue_acc(dkv_accs["dk"], dst_prev,
                           q_smem.at[jnp.where(count > 0, prev_slot, slot)], stage)
          pt, chain, keep = probabilities(plgpu.wgmma_accumulator_load(st_ref, wait_n=2))
          common.issue_acc(dkv_accs["dv"], scores.dropped(pt, keep).astype(dtype),
                           do_smem.at[slot], stage)
          dpt = plgpu.wgmma_accumulator_load(dpt_ref, wait_n=2)  # (behind it: dK's, dV's)
          return scores_grad_t(pt, chain, dpt, keep, slot)

        dst = common.step_under_pending(grads_under_dkv, (block_kv, block_q), count,
                                        lambda: plgpu.barrier_arrive(slot_free.at[prev_slot]))
        return dst, slot, count + 1

      def release_overlapped(slot, carry):
        """A skipped block with `cfg.overlap_dkv`: the pending dK wgmma is made first, so that
        its ring slot (which the producer may need for a later block) is not held across the
        skip."""
        return observe_and_free(slot, flush_dkv(dkv_accs, carry))

      release = observe_and_free
      if cfg.overlap_dkv:
        step, release = step_overlapped, release_overlapped
      if cta_list is not None:  # entry i of this head is ring step g * per_head + i
        return cta_list.visit(wg, carry, slot_of=lambda i: lax.rem(g * per_head + i, stages),
                              release=release, step=step, step_every=cfg.dq_halves)
      step_base = g * per_head - cta_lo  # ring step of query block qi is step_base + qi
      slot_of = lambda qi: lax.rem(step_base + qi, stages)
      release_block = lambda qi, c: release(slot_of(qi), c)
      # (overlap_dkv: a skip may flush, so the releases take the carry; else none they change.)
      carry_releases = cfg.overlap_dkv
      released = lax.fori_loop(cta_lo, lo, release_block, carry if carry_releases else None)
      carry = released if carry_releases else carry
      carry = common.masked_loops(lo, full_lo, full_hi, hi,
                                  lambda qi, c, masked: step(slot_of(qi), qi, c, masked=masked),
                                  carry)
      released = lax.fori_loop(hi, cta_hi, release_block, carry if carry_releases else None)
      return released if carry_releases else carry

    # overlap_dkv: dV and dK are accumulators held across the walk (`dkv_accs`: {"dv", "dk"}
    # -> plgpu.ACC), which each step's wgmmas add into (dK the step before's product).
    no_tile = (plgpu.layout_cast(jnp.zeros((block_kv, block_q), dtype), common.WGMMA)
               if cfg.overlap_dkv else None)

    def flush_dkv(dkv_accs, carry):
      """overlap_dkv: the pending dK wgmma, if any, made and its ring slot released."""
      dst_prev, prev_slot, count = carry

      @pl.when(count > 0)
      def _():
        common.issue_acc(dkv_accs["dk"], dst_prev, q_smem.at[prev_slot], stage)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(slot_free.at[prev_slot])

      return no_tile, prev_slot, jnp.zeros_like(count)

    zeros = plgpu.layout_cast(jnp.zeros((block_kv, head_dim), jnp.float32), common.WGMMA)
    acc = {name: zeros for name in outputs}
    late = dq_acc_ref is not None and cfg.dq_step_late
    if late:
      # The first step's dQ wgmmas take slot 1 as "the step before": zeros there, met, and
      # slot 0 free.
      ds_smem.at[1, wg][...] = plgpu.layout_cast(jnp.zeros((block_kv, block_q), dtype),
                                                 common.WGMMA)
      plgpu.commit_smem()
      plgpu.barrier_arrive(halves_met[0].at[1])
      plgpu.barrier_arrive(ds_read.at[0])
      acc["late_dq"] = (jnp.int32(0),) * 3
    if cfg.overlap_dkv:
      def accumulate(dv_acc, dk_acc):
        dkv_accs = {"dv": dv_acc, "dk": dk_acc}
        flush_dkv(dkv_accs, lax.fori_loop(0, groups,
                                          functools.partial(one_head, dkv_accs=dkv_accs),
                                          (no_tile, jnp.int32(0), jnp.int32(0))))
        return {"dv": dv_acc[...], "dk": dk_acc[...]}

      full_tile = plgpu.ACC((block_kv, head_dim), jnp.float32)
      acc = pl.run_scoped(accumulate, full_tile, full_tile)
    else:
      acc = lax.fori_loop(0, groups, one_head, acc)
    if late:  # the last step's dQ, then the last phase of the slots' free barrier observed
      count = acc["late_dq"][0]
      reduce_late_dq(common.matmul_sum(halves_pairs(1 - lax.rem(count, 2)),
                                       dq_part), acc["late_dq"])
      plgpu.barrier_wait(ds_read.at[lax.rem(count, 2)])
    if dq_acc_ref is not None and cfg.dq_halves:
      # The other warpgroup's dQ wgmmas read this warpgroup's K tile, which is about to be
      # overwritten with dK: wait until both are past their last one.
      plgpu.barrier_arrive(halves_met[1])
      plgpu.barrier_wait(halves_met[1])

    # The K and V tiles are done with: their shared memory carries dK and dV out.
    out_smem = {"dk": k_smem.at[wg], "dv": v_smem.at[wg]}
    for name in outputs:
      out_smem[name][...] = (acc[name] * (scale if name == "dk" else 1.0)).astype(dtype)
    plgpu.commit_smem()
    for name in outputs:
      plgpu.copy_smem_to_gmem(out_smem[name], out_refs[name].at[out_rows])
    plgpu.wait_smem_to_gmem(0)


def dkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, *, scale: float,
        spec: mask_lib.MaskSpec, cfg: config_lib.KernelConfig, interpret: bool,
        mods: mods_lib.KernelMods = mods_lib.KernelMods(),
        mod_arrays: mods_lib.ModArrays = mods_lib.ModArrays(),
        table: block_table.BlockTable | None = None):
  """(dK, dV) [B, S, Hkv, D] in k.dtype, summed over each kv head's query-head group.

  `table`: `block_table.key_major` at (cfg.block_q, cfg.block_kv) (`rows_per_cta=1` with
  `cfg.head_split`), with a heads axis of 1 or heads_kv (one list per kv head, shared by its
  query-head group), or None (the positional ranges).
  A bias / mask in `mod_arrays` is transposed here (one XLA transpose: a copy of its size) for
  the kernel to read [keys, queries] tiles.

  When one warpgroup cannot hold both accumulators in registers (`cfg.split_dkv`: head_dim 256,
  2 x 64 x 256 float32 = 256 registers per thread), dV and dK come from two launches, each
  recomputing P.
  """
  if table is not None and table.counts.shape[1] not in (1, k.shape[2]):
    raise ValueError(f"the dK/dV kernel's block table needs a heads axis of 1 or the kv heads "
                     f"({k.shape[2]}), got {table.counts.shape[1]} (`block_mask.group_union`)")
  if cfg.reverse_q_tiles:
    raise ValueError("reverse_q_tiles is a forward / dQ option: the dK/dV kernel's grid runs over "
                     "key tiles")
  # The kernel's tiles are [keys, queries]: it reads bias and mask transposed.
  mod_arrays = mod_arrays.transposed_pairs()
  if cfg.head_split:
    return head_split.dkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, mod_arrays, table,
                          scale=scale, spec=spec, cfg=cfg, interpret=interpret, mods=mods,
                          group_parts=group_parts(cfg, spec, q.shape, k.shape))
  passes = (("dv",), ("dk",)) if cfg.split_dkv else (("dk", "dv"),)
  grads = {}
  for outputs in passes:
    grads.update(zip(outputs, _dkv_call(q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                                        mod_arrays, table, None, scale=scale, spec=spec,
                                        cfg=cfg, interpret=interpret, outputs=outputs,
                                        mods=mods)))
  return grads["dk"], grads["dv"]


def dqkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, *, scale: float,
         spec: mask_lib.MaskSpec, cfg: config_lib.KernelConfig, interpret: bool,
         mods: mods_lib.KernelMods = mods_lib.KernelMods(),
         mod_arrays: mods_lib.ModArrays = mods_lib.ModArrays(),
         table: block_table.BlockTable | None = None):
  """(dQ [B, T, Hq, D] in q.dtype, dK, dV) from one dK/dV launch that also makes dQ
  (`cfg.fused_dq`): arguments as in `dkv`.

  dQ is accumulated in float32 in a zeroed array the kernel adds into (TMA reduce-add), then
  scaled and cast. The interpreter has no TMA reduction: there every (key tile, warpgroup) writes
  its own partial dQ (zero where it has no visible key) and the partials are summed after, which
  checks the same products and destinations. (Those partials take 2 * kv_len / (2 * block_kv)
  copies of dQ in float32: fine for the interpreter's short tests, not an O(N) path.)
  """
  if not cfg.fused_dq or cfg.split_dkv:
    raise ValueError(f"dqkv needs fused_dq=True and split_dkv=False, got {cfg}")
  if cfg.dq_column_halves and q.shape[-1] < 128:
    raise ValueError(f"dq_column_halves needs head_dim >= 128 (each half a whole 64-column "
                     f"tile of K), got head_dim {q.shape[-1]}")
  # (One partial per key tile and warpgroup; with head_split both warpgroups' column halves
  # share their key tile's.)
  num_partials = (k.shape[1] // cfg.block_kv if cfg.head_split
                  else k.shape[1] // (_WGS * cfg.block_kv) * _WGS)
  dq_acc = jax.new_ref(jnp.zeros(((num_partials,) if interpret else ()) + q.shape, jnp.float32))
  if cfg.head_split:
    dk, dv = head_split.dkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                            mod_arrays.transposed_pairs(), table, scale=scale, spec=spec,
                            cfg=cfg, interpret=interpret, mods=mods, dq_acc=dq_acc,
                            group_parts=group_parts(cfg, spec, q.shape, k.shape))
  else:
    dk, dv = _dkv_call(q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                       mod_arrays.transposed_pairs(), table, dq_acc, scale=scale, spec=spec,
                       cfg=cfg, interpret=interpret, outputs=("dk", "dv"), mods=mods)
  dq = dq_acc[...]
  if interpret:
    dq = dq.sum(axis=0)
  return (dq * scale).astype(q.dtype), dk, dv


def _dkv_call(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, mod_arrays, table, dq_acc, *,
              scale, spec, cfg, interpret, outputs, mods):
  batch, q_len, heads_q, head_dim = q.shape
  kv_len, heads_kv = k.shape[1], k.shape[2]
  fused_dq = dq_acc is not None
  parts = group_parts(cfg, spec, q.shape, k.shape)
  kernel = functools.partial(_dkv_kernel, spec=spec, scale=scale, cfg=cfg,
                             num_q_blocks=q_len // cfg.block_q,
                             groups=heads_q // heads_kv // parts, group_parts=parts,
                             outputs=outputs, mods=mods, dq_partials=interpret)
  grid, grid_names = cfg.grid(heads=heads_kv * parts, tiles=kv_len // (_WGS * cfg.block_kv),
                              batch=batch, tile_axis="kv_tiles")
  # (group_parts: each part's own dK / dV [B, S, Hkv * parts, D], kv head h's at h * parts + p.)
  part_sums = jax.ShapeDtypeStruct((batch, kv_len, heads_kv * parts, head_dim), k.dtype)
  grads = common.warp_specialized(
      kernel, lambda interp: dkv_scratch_types(cfg, head_dim, q.dtype, interp, fused_dq=fused_dq),
      out_type=tuple(part_sums for _ in outputs), grid=grid,
      grid_names=grid_names, what=f"the dK/dV kernel with {cfg}", reduces=False,
      interpret=interpret)(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, mod_arrays, table,
                           dq_acc)
  return tuple(common.sum_group_parts(g, parts) for g in grads)


def group_parts(cfg: config_lib.KernelConfig, spec: mask_lib.MaskSpec, q_shape, k_shape) -> int:
  """The CTAs the dK/dV kernel splits each kv head's query-head group over at these [B, T, Hq,
  D] / [B, S, Hkv, D] shapes (`KernelConfig.group_parts_for` at the grid's key tiles)."""
  (_, q_len, heads_q, _), (_, kv_len, heads_kv, _) = q_shape, k_shape
  return cfg.group_parts_for(heads_q // heads_kv, key_tile_blocks(spec, q_len, kv_len, cfg))


def key_tile_blocks(spec: mask_lib.MaskSpec, q_len: int, kv_len: int,
                    cfg: config_lib.KernelConfig) -> list[int]:
  """Query blocks each key tile of the dK/dV kernel's grid visits at full lengths (the
  positional mask alone): what `config.backward_configs` decides by."""
  keys = cfg.block_kv * (1 if cfg.head_split else _WGS)
  return mask_lib.blocks_visited(mask_lib.q_block_range, spec, kv_len // keys, keys,
                                 cfg.block_q, q_len // cfg.block_q)


def dkv_scratch_types(cfg: config_lib.KernelConfig, head_dim: int, dtype, interpret: bool,
                      fused_dq: bool | None = None) -> list:
  """The dK/dV kernel's shared memory and barriers (the order `_dkv_kernel` takes them in;
  `head_split.dkv_scratch_types` with cfg.head_split); `fused_dq` (default: cfg.fused_dq) adds
  the dS^T and float32 dQ tiles of `dqkv`."""
  if cfg.head_split:
    return head_split.dkv_scratch_types(cfg, head_dim, dtype, interpret)
  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=common.TILE_TRANSFORMS)
  ring = lambda: plgpu.Barrier(num_barriers=cfg.stages)
  fused_dq = cfg.fused_dq if fused_dq is None else fused_dq
  halves = cfg.dq_halves
  # (dq_step_late: a dS^T ring of its own, two slots, the step before's read while this one's
  # is written; else the dS^T tiles follow the q ring's slots.)
  ds_slots = 2 if cfg.dq_step_late else cfg.stages
  dq_tiles = [
      # dS^T, read transposed by the dQ wgmma (dq_halves: one per ring slot, read by both
      # warpgroups)
      tile(*((ds_slots,) if halves else ()), _WGS, cfg.block_kv, cfg.block_q),
      # dQ part, out by reduce-add
      common.f32_tile((_WGS, *cfg.dq_part_shape(head_dim)), cfg.swizzle_f32),
      # dq_halves: both warpgroups' dS^T of a ring slot are in shared memory; both are
      # past their last dQ wgmma (which reads both K tiles)
      *([plgpu.Barrier(num_arrivals=_WGS, num_barriers=ds_slots),
         plgpu.Barrier(num_arrivals=_WGS)] if halves else []),
      # dq_step_late: both warpgroups' dQ wgmmas have read a slot of the dS^T ring
      *([plgpu.Barrier(num_arrivals=_WGS, num_barriers=2)] if cfg.dq_step_late else []),
  ] if fused_dq else []
  return [
      tile(_WGS, cfg.block_kv, head_dim),  # k, then dk out
      tile(_WGS, cfg.block_kv, head_dim),  # v, then dv out
      tile(cfg.stages, cfg.block_q, head_dim),  # q ring
      tile(cfg.stages, cfg.block_q, head_dim),  # dO ring
      plgpu.SMEM((cfg.stages, cfg.block_q), jnp.float32),  # lse ring
      plgpu.SMEM((cfg.stages, cfg.block_q), jnp.float32),  # delta ring
      common.staging_scratch(interpret, (_WGS, cfg.block_kv, cfg.block_q), dtype),
      plgpu.Barrier(num_barriers=_WGS * 2),  # k, v loaded (per warpgroup)
      ring(), ring(), ring(), ring(),  # q, dO, lse, delta slot filled
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=cfg.stages),  # slot free
      *dq_tiles,
  ]
