"""dQ and dK/dV with the accumulators split by columns (`KernelConfig.head_split`, head_dim 256).

At head_dim 256 one warpgroup cannot hold a key tile's dK and dV ([64, 256] float32 each: 256
registers per thread), so the plain dK/dV kernel runs twice (`split_dkv`: dV, then dK, each
recomputing S^T) and spills. Here the two compute warpgroups share ONE key tile of `block_kv`
rows and split the work of each query block by kind:

- warpgroup 0 (the score warpgroup) computes S^T = K Q^T, applies the score modifiers and the
  mask, and makes P^T; it writes P^T (dropout applied, input dtype) to shared memory;
- warpgroup 1 computes dP^T = V dO^T and writes it (float32) to shared memory;
- each warpgroup adds its half of dV's columns, dV[:, half] += P^T dO[:, half] (warpgroup 0
  from registers, warpgroup 1 from shared memory), warpgroup 1's while warpgroup 0 reads dP^T,
  makes dS^T = P^T * (dP^T - delta) (times the modifiers' derivative) and writes it to shared
  memory;
- then its half of dK's: dK[:, half] += dS^T Q[:, half];
- with `fused_dq` (FlashAttention-3's head_dim 256 backward, no dQ kernel), behind it its half
  of the query block's dQ, dS K[:, half] (dS^T's tile read transposed, K's columns of this
  half, which no other warpgroup rewrites), reduce-added in float32 into a zeroed dQ
  (`bwd.dqkv`): five matmuls per tile pair in all, the dQ kernel's three (S, dP, dQ) saved but
  one. With `one_do_slot` (the table's from N 1024) q in two stages beside one dO slot, which
  both warpgroups free after their dV wgmma, so the next block's rows load under the step
  (one stage of both, all that fits beside two float32 dQ tiles a warpgroup, ran 0.71-0.83x the
  separate kernels; this 1.08-1.14x: benchmarks/NOTES.md session 21). With
  `defer_last_dq_part` each warpgroup's last part of a step goes out under the next step's first
  wgmma, where its write's wait for the tile (the part before it still being read out) is
  hidden (1.03-1.06x; session 26).

Four matmuls per tile pair, two per warpgroup, once (the two launches of `split_dkv` make five,
S^T twice), with [64, 128] float32 accumulators: 64 + 64 registers, as at head_dim 128.

Warpgroup 0 stores dK, warpgroup 1 dV, once both halves are in. The two warpgroups meet through
five barriers per query block: dP^T written, dP^T read, P^T written, dS^T written, both read
(each buffer is rewritten at the next block only after the other warpgroup is done with it).
The producer warpgroup streams q, dO, lse and delta through a ring, as in `bwd._dkv_kernel`.

The dQ kernel (`dq`) mirrors it on one query tile: warpgroup 0 makes S, P and dS, warpgroup 1
dP, and each accumulates a column half of dQ (dS K[:, half]); four barriers per key block. Block
skipping follows `mask` positions or the block table (entries per key
tile: `block_table.key_major(..., rows_per_cta=1)`).
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
from pallas_attn.mosaic_gpu import mods as mods_lib

_WGS = config_lib.COMPUTE_WARPGROUPS
_SCORES, _DP = 0, 1  # the two compute warpgroups' jobs


def _one_tile(cfg: config_lib.KernelConfig):
  """The index (0) of a scratch-of-one tile that every step's wgmmas read the same (dK/dV: K and
  V; dQ: q and dO): with cfg.tile_descriptors_in_step through `common.same_tile_index`, so that
  their descriptors are built in the step instead of held across the walk."""
  return common.same_tile_index(0, cfg.tile_descriptors_in_step)


# ---------------------------------------------------------------------------------------------
# dK / dV


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref, mod_refs,
                table_refs, dq_acc_ref, dk_ref, dv_ref,
                k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, dst_smem,
                dpt_smem, staging, kv_full, q_full, do_full, lse_full, delta_full, slot_free,
                dpt_full, dpt_free, pt_full, ds_full, ds_free, halves_written, *dq_smem,
                spec: mask_lib.MaskSpec, scale: float, cfg: config_lib.KernelConfig,
                num_q_blocks: int, groups: int, group_parts: int, mods: mods_lib.KernelMods,
                dq_partials: bool):
  block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  batch = lax.axis_index("batch")
  kv_head, head_part, first_head = common.key_tile_heads(groups, group_parts)
  wg = lax.axis_index("wg")
  q_length = q_len_ref[batch]
  kv_length = kv_len_ref[batch]

  kv_start = lax.axis_index("kv_tiles") * block_kv
  cta_list = ranges = None
  if table_refs is None:
    ranges = common.key_tile_query_ranges(spec, kv_start, block_kv, block_q, num_q_blocks,
                                          q_length, kv_length)
    lo, hi = ranges[0], ranges[3]
    per_head, block_of = hi - lo, (lambda e: lo + e)
  else:
    cta_list = block_table.CtaList.read(table_refs, batch=batch, head=kv_head,
                                        tile=lax.axis_index("kv_tiles"))
    per_head, block_of = cta_list.count, cta_list.block

  # cfg.one_do_slot: dO's one slot and its own release (mid-step), behind the dQ tiles.
  do_free = dq_smem[1] if cfg.one_do_slot else None
  # (A traced 0: a constant index into the barriers inside the walk fails to lower, jax 0.11.2.)
  do_slot = lambda slot: lax.rem(slot, 1) if cfg.one_do_slot else slot

  def release_do(slot):
    """This warpgroup's last read of the step's dO is done (its dV wgmma's)."""
    if cfg.one_do_slot:
      plgpu.barrier_arrive(do_free.at[do_slot(slot)])

  common.produce_query_rows(
      wg, (q_ref, do_ref, lse_ref, delta_ref), (q_smem, do_smem, lse_smem, delta_smem),
      (q_full, do_full, lse_full, delta_full), slot_free, batch=batch,
      first_head=first_head, groups=groups, per_head=per_head, block_of=block_of,
      block_q=block_q, stages=stages, registers=cfg.producer_registers, do_free=do_free)

  rows = (batch, pl.ds(kv_start, block_kv), kv_head)
  out_rows = (batch, pl.ds(kv_start, block_kv), head_part)  # (head_part = kv_head: parts 1)
  acc_shape = (block_kv, head_dim // 2)
  stage = staging[0].at[wg] if staging else None  # (the interpreter's register operands)
  if dq_acc_ref is not None:  # cfg.fused_dq
    dq_out_smem = dq_smem[0]
    # Interpreted, each key tile writes its own partial dQ (see `bwd.dqkv`).
    dq_dest = dq_acc_ref.at[lax.axis_index("kv_tiles")] if dq_partials else dq_acc_ref

  def dk_and_dq(dk, dst, slot, qi, g, half, *, dst_in_smem: bool):
    """dK[:, half] += dS^T Q[:, half] (dst: dS^T in registers, or its shared-memory tile), and
    with fused_dq this warpgroup's half of the block's dQ part, dS K[:, half] (dS^T's tile read
    transposed), in parts of [block_q, head_dim / 4] where those are whole 64-column tiles
    (`_dq_parts`; a whole [64, 128] float32 half spilled as much, benchmarks/NOTES.md session
    16): the first issued behind dK's wgmma and awaited with it, each reduce-added while the
    next runs. Returns (dK, the last part, not yet sent: None without fused_dq), for warpgroup
    1 to send once it has released the dS^T tile (`send_last_part`)."""
    accumulating = (dk, dst, q_smem.at[slot, :, half])
    if dq_acc_ref is None:
      if dst_in_smem:
        return common.matmul_acc_smem(*accumulating, stage is not None), None
      return common.matmul_acc(*accumulating, stage), None
    parts = _dq_parts(half)
    dq_pairs = lambda cols: [(dst_smem.T, k_smem.at[_one_tile(cfg), :, cols])]
    dq_shape = (block_q, parts[0].size)
    if stage is not None and dst_in_smem:  # (interpreted: no staging of a smem operand)
      dk, part = (common.matmul_acc_smem(*accumulating, True),
                  common.matmul_sum(dq_pairs(parts[0]), dq_shape))
    else:
      (dk,), part = common.matmul_accs_then_product(
          (accumulating,), lambda: dq_pairs(parts[0]), dq_shape, stage)
    for i in range(1, len(parts)):
      reduce_dq(part, qi, g, parts, i - 1)
      part = common.matmul_sum(dq_pairs(parts[i]), dq_shape)
    return dk, part

  def reduce_last_part(part, qi, g, half):
    parts = _dq_parts(half)
    reduce_dq(part, qi, g, parts, len(parts) - 1)

  def send_last_part(part, qi, g, half):
    """The step's last dQ part (from `dk_and_dq`; None: no fused dQ) reduce-added now, or with
    cfg.defer_last_dq_part carried to the next step, whose first wgmma covers its write
    (`send_deferred`): () or ((part, qi, g),), the walk's extra carry."""
    if part is None:
      return ()
    if cfg.defer_last_dq_part:
      return ((part, qi, g),)
    reduce_last_part(part, qi, g, half)
    return ()

  def send_deferred(deferred, count, half):
    """Reduce-add the last step's carried dQ part (`send_last_part`; nothing before the first
    step, or with nothing carried). Run as the step's first matmul's `while_running`
    (`deferred_sender`), its write waits for the read of the part sent before it (the one
    tile's) under that wgmma, not behind one [block_q, 64] dQ part's."""
    for part, qi, g in deferred:
      @pl.when(count > 0)
      def _():
        reduce_last_part(part, qi, g, half)

  def deferred_sender(deferred, count, half):
    """`send_deferred` as a thunk for `common.matmul`'s while_running (None: nothing carried)."""
    return functools.partial(send_deferred, deferred, count, half) if deferred else None

  def reduce_dq(part, qi, g, parts, i):
    """dQ[qi block, query head g of the group, parts[i]] += part, through this warpgroup's
    shared-memory tile i (a reduce-add still reading is from the other tile, if any), or its
    one tile (cfg.one_do_slot: once the last reduce-add from it has read it)."""
    dest = dq_dest.at[batch, pl.ds(qi * block_q, block_q), first_head + g, parts[i]]
    tiles = dq_out_smem.shape[1]
    common.reduce_add(part, dq_out_smem.at[wg, i % tiles], dest, dq_partials,
                      pending=tiles - 1)

  def wait_filled(slot):
    plgpu.barrier_wait(q_full.at[slot])
    plgpu.barrier_wait(do_full.at[do_slot(slot)])
    plgpu.barrier_wait(lse_full.at[slot])
    plgpu.barrier_wait(delta_full.at[slot])

  def walk(step, half):
    """Run `step(slot, qi, g, (dk, dv, *deferred), count, masked=...)` over every visible query
    block qi of every query head g of the group, in ring order (both warpgroups walk the same
    blocks); `deferred` is cfg.defer_last_dq_part's carry (`send_last_part`). Returns (dk, dv,
    *deferred, steps taken)."""
    zeros = plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), common.WGMMA)
    accs = (zeros, zeros)
    if dq_acc_ref is not None and cfg.defer_last_dq_part:
      part_shape = (block_q, _dq_parts(half)[-1].size)
      accs += ((plgpu.layout_cast(jnp.zeros(part_shape, jnp.float32), common.WGMMA),
                jnp.int32(0), jnp.int32(0)),)

    def release(slot):
      # (With one_do_slot a skipped table entry would leave dO's slot unfreed: the head split's
      # tables make every entry a step, `_walk_blocks`.)
      plgpu.barrier_arrive(slot_free.at[slot])

    return _walk_blocks(step, accs, groups=groups, per_head=per_head, stages=stages,
                        cta_list=cta_list, ranges=ranges, wait_filled=wait_filled,
                        release=release)

  def load_kv():
    """Both tiles in, for both warpgroups (each one's epilogue overwrites half of both)."""
    @pl.when(wg == _SCORES)
    def _():
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[0], kv_full.at[0])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[0], kv_full.at[1])

    plgpu.barrier_wait(kv_full.at[0])
    plgpu.barrier_wait(kv_full.at[1])

  @pl.when(wg == _SCORES)
  def _scores_warpgroup():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")
    load_kv()
    half = _half(_SCORES, head_dim)
    key_scores = mods_lib.TileScorer.create(mods, spec, scale, mod_refs, batch=batch,
                                            row_start=kv_start, rows=block_kv,
                                            kv_length=kv_length, transposed=True,
                                            backward=True)

    def step(slot, qi, g, acc, count, *, masked):
      dk, dv, *deferred = acc
      scores = key_scores.for_head(first_head + g) if mods.per_head else key_scores
      cols = scores.columns(qi, block_q, masked=masked)
      wait_filled(slot)
      st = common.matmul(k_smem.at[_one_tile(cfg)], q_smem.at[slot].T,  # S^T
                         (block_kv, block_q), deferred_sender(deferred, count, half))
      st, chain = scores(st, cols, masked=masked)
      lse2 = plgpu.load(lse_smem.at[slot], (), layout=common.WGMMA_COL) * common.LOG2E
      pt = jnp.exp2(st - common.broadcast_cols(lse2, st.shape))  # P^T [block_kv, block_q]
      keep = scores.dropout_keep(pt, cols)
      pt_dropped = scores.dropped(pt, keep).astype(dtype)

      _wait_unless_first(count, ds_free)  # warpgroup 1 is done with the last P^T and dS^T
      pt_smem[...] = pt_dropped
      plgpu.commit_smem()  # for warpgroup 1's dV wgmma
      plgpu.barrier_arrive(pt_full)
      # dV before dP^T is read: P^T's low-precision copy is dead before dP^T's registers are live.
      dv = common.matmul_acc(dv, pt_dropped, do_smem.at[do_slot(slot), :, half], stage)
      release_do(slot)
      plgpu.barrier_wait(dpt_full)
      dpt = plgpu.load(dpt_smem, (), layout=common.WGMMA)
      plgpu.barrier_arrive(dpt_free)
      dpt = scores.dropped(dpt, keep)
      delta = plgpu.load(delta_smem.at[slot], (), layout=common.WGMMA_COL)
      dst = mods_lib.logit_grad(pt * (dpt - common.broadcast_cols(delta, dpt.shape)), chain)
      dst = dst.astype(dtype)
      dst_smem[...] = dst
      plgpu.commit_smem()  # for warpgroup 1's dK wgmma (and both dQ wgmmas)
      plgpu.barrier_arrive(ds_full)
      dk, last_part = dk_and_dq(dk, dst, slot, qi, g, half, dst_in_smem=False)
      return dk, dv, *send_last_part(last_part, qi, g, half)

    dk, dv, *deferred, count = walk(step, half)
    send_deferred(deferred, count, half)
    _wait_unless_first(count, ds_free)  # warpgroup 1's last release (every phase has a waiter)

    _store_halves(dk * scale, dv, k_smem.at[0], v_smem.at[0], (k_smem.at[0], dk_ref), out_rows, half,
                  dtype, halves_written)

  @pl.when(wg == _DP)
  def _dp_warpgroup():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")
    load_kv()
    half = _half(_DP, head_dim)

    def step(slot, qi, g, acc, count, *, masked):
      del masked  # (warpgroup 0 applies the mask and the modifiers)
      dk, dv, *deferred = acc
      wait_filled(slot)
      dpt = common.matmul(v_smem.at[_one_tile(cfg)], do_smem.at[do_slot(slot)].T,  # dP^T
                          (block_kv, block_q), deferred_sender(deferred, count, half))

      _wait_unless_first(count, dpt_free)  # warpgroup 0 has read the last dP^T
      dpt_smem[...] = dpt
      plgpu.barrier_arrive(dpt_full)
      plgpu.barrier_wait(pt_full)  # dV's wgmma runs while warpgroup 0 makes dS^T
      dv = common.matmul_acc_smem(dv, pt_smem, do_smem.at[do_slot(slot), :, half],
                                  stage is not None)
      release_do(slot)
      plgpu.barrier_wait(ds_full)
      dk, last_part = dk_and_dq(dk, dst_smem, slot, qi, g, half, dst_in_smem=True)
      plgpu.barrier_arrive(ds_free)
      return dk, dv, *send_last_part(last_part, qi, g, half)

    def dpt_of(slot):
      plgpu.barrier_wait(do_full.at[slot])
      return common.matmul(v_smem.at[_one_tile(cfg)], do_smem.at[slot].T, (block_kv, block_q))

    def step_ahead(slot, count, dpt, next_dpt, acc):
      """Step `count` with its dP^T made the step before; the next step's dP^T is computed after
      this step's dV wgmma, under warpgroup 0's dS^T (`cfg.dp_ahead`)."""
      dk, dv = acc
      _wait_unless_first(count, dpt_free)  # warpgroup 0 has read the last dP^T
      dpt_smem[...] = dpt
      plgpu.barrier_arrive(dpt_full)
      plgpu.barrier_wait(pt_full)
      dv = common.matmul_acc_smem(dv, pt_smem, do_smem.at[slot, :, half], stage is not None)
      dpt = next_dpt()
      plgpu.barrier_wait(q_full.at[slot])
      plgpu.barrier_wait(ds_full)
      dk = common.matmul_acc_smem(dk, dst_smem, q_smem.at[slot, :, half], stage is not None)
      plgpu.barrier_arrive(ds_free)
      plgpu.barrier_arrive(slot_free.at[slot])
      return (dk, dv), dpt

    if cfg.dp_ahead:
      zeros = plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), common.WGMMA)
      dk, dv, count = _walk_dp_ahead(groups * per_head, stages, dpt_of, (block_kv, block_q),
                                     step_ahead, (zeros, zeros))
    else:
      dk, dv, *deferred, count = walk(step, half)
      send_deferred(deferred, count, half)
    _wait_unless_first(count, dpt_free)  # warpgroup 0's last read of dP^T

    _store_halves(dk * scale, dv, k_smem.at[0], v_smem.at[0], (v_smem.at[0], dv_ref), out_rows, half,
                  dtype, halves_written)


# ---------------------------------------------------------------------------------------------
# Shared by both kernels


def _walk_blocks(step, accs, *, groups, per_head, stages: int, cta_list, ranges, wait_filled,
                 release):
  """The compute warpgroups' loop over a CTA's blocks: `groups` heads of `per_head` blocks each,
  ring step g * per_head + e in slot (g * per_head + e) % stages. `step(slot, block, g, accs,
  count, masked=...)` -> accs, where `count` is the number of steps before (the first step waits
  for no exchange buffer to be free); `release(slot)` after each step. The blocks: the CTA's
  block table list (`cta_list`: one table row per CTA, so every entry is a step and the SKIP
  branch, which must still trace, is never taken), or the positional ranges (lo, full_lo,
  full_hi, hi) of `common.masked_loops`. Returns (*accs, steps taken)."""

  def one_head(g, carry):
    def counted(slot, block, carry, *, masked):
      accs, count = carry
      accs = step(slot, block, g, accs, count, masked=masked)
      release(slot)
      return accs, count + 1

    if cta_list is not None:
      def skip(slot, carry):
        wait_filled(slot)
        release(slot)
        return carry

      return cta_list.visit(0, carry, slot_of=lambda i: lax.rem(g * per_head + i, stages),
                            release=skip, step=counted, step_every=True)
    lo = ranges[0]
    return common.masked_loops(
        *ranges,
        lambda b, c, masked: counted(lax.rem(g * per_head + b - lo, stages), b, c,
                                     masked=masked), carry)

  accs, count = lax.fori_loop(0, groups, one_head, (accs, jnp.int32(0)))
  return (*accs, count)


def _walk_dp_ahead(total, stages: int, dp_of, dp_shape, step, accs):
  """Warpgroup 1's loop with `cfg.dp_ahead`: the `total` steps of the CTA in ring order (slot
  c % stages; warpgroup 1 needs no block index: warpgroup 0 applies the masks), each step's dP
  (`dp_of(slot)`, which waits for the slot) made during the step before, so that it runs while
  warpgroup 0 is on the CUDA cores. `step(slot, count, dp, next_dp, accs)` -> (accs, next dP),
  calling the thunk `next_dp` where the next dP should be made (zeros past the last step).
  Needs stages >= 2 (the next slot is read before this one is released). Returns (*accs,
  total)."""
  zeros = plgpu.layout_cast(jnp.zeros(dp_shape, jnp.float32), common.WGMMA)

  def dp_if(present, slot):
    return lax.cond(present, lambda: dp_of(slot), lambda: zeros)

  def body(c, carry):
    accs, dp = carry
    next_dp = lambda: dp_if(c + 1 < total, lax.rem(c + 1, stages))
    return step(lax.rem(c, stages), c, dp, next_dp, accs)

  accs, _ = lax.fori_loop(0, total, body, (accs, dp_if(total > 0, 0)))
  return (*accs, total)


def _wait_unless_first(count, barrier):
  """Wait for `barrier` unless no step was taken before (its first phase is still to come)."""
  @pl.when(count > 0)
  def _():
    plgpu.barrier_wait(barrier)


def _half(warpgroup: int, head_dim: int):
  """The columns of the accumulators (dK and dV, or dQ) that `warpgroup` makes."""
  return pl.ds(warpgroup * (head_dim // 2), head_dim // 2)


def _dq_parts(half):
  """The column ranges a warpgroup makes its `half` of the fused dQ in (a pl.ds of static
  bounds): two quarters of dQ where each is a whole number of 64-column tiles of K (head_dim
  256), else the half."""
  if half.size % 128:
    return [half]
  return [pl.ds(half.start + i * (half.size // 2), half.size // 2) for i in range(2)]


def _store_halves(dk, dv, k_smem, v_smem, out_ref, rows, half, dtype, written):
  """This warpgroup's column halves of dK and dV into the K and V tiles (the other warpgroup's
  last read of them is behind the last meeting: warpgroup 0 reads K before it signals dS^T,
  warpgroup 1 reads V before it signals dP^T); once both halves are in (`written`), the tile in
  `out_ref`'s smem ref goes out whole (a TMA copy needs contiguous shared memory, and a column
  half of a tiled buffer is not)."""
  k_smem.at[:, half][...] = dk.astype(dtype)
  v_smem.at[:, half][...] = dv.astype(dtype)
  plgpu.commit_smem()
  plgpu.barrier_arrive(written)
  plgpu.barrier_wait(written)
  smem, gmem = out_ref
  plgpu.copy_smem_to_gmem(smem, gmem.at[rows])
  plgpu.wait_smem_to_gmem(0)


def dkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, mod_arrays, table, *, scale: float,
        spec: mask_lib.MaskSpec, cfg: config_lib.KernelConfig, interpret: bool,
        mods: mods_lib.KernelMods, dq_acc=None, group_parts: int = 1):
  """(dK, dV) [B, S, Hkv, D] in k.dtype, summed over each kv head's query-head group; arguments
  as in `bwd.dkv`, `mod_arrays` already transposed to [keys, queries], `table` from
  `block_table.key_major(..., rows_per_cta=1)` at (cfg.block_q, cfg.block_kv) or None.
  `dq_acc` (with cfg.fused_dq): the float32 ref the kernel adds the unscaled dQ into
  (`bwd.dqkv`): [B, T, Hq, D], or interpreted one partial per key tile, [S / block_kv, B, T,
  Hq, D]. `group_parts` (dividing the group): the CTAs each group is split over, as in
  `bwd._dkv_call`."""
  if cfg.fused_dq != (dq_acc is not None):
    given = "given" if dq_acc is not None else "None"
    raise ValueError(f"the head-split dK/dV kernel takes dq_acc exactly when cfg.fused_dq, got "
                     f"fused_dq={cfg.fused_dq} and dq_acc {given}")
  batch, q_len, heads_q, head_dim = q.shape
  kv_len, heads_kv = k.shape[1], k.shape[2]
  _check_head_dim(head_dim)
  kernel = functools.partial(_dkv_kernel, spec=spec, scale=scale, cfg=cfg,
                             num_q_blocks=q_len // cfg.block_q,
                             groups=heads_q // heads_kv // group_parts, group_parts=group_parts,
                             mods=mods, dq_partials=interpret)
  grid, grid_names = cfg.grid(heads=heads_kv * group_parts, tiles=kv_len // cfg.block_kv,
                              batch=batch, tile_axis="kv_tiles")
  part_sums = jax.ShapeDtypeStruct((batch, kv_len, heads_kv * group_parts, head_dim), k.dtype)
  grads = common.warp_specialized(
      kernel, lambda interp: dkv_scratch_types(cfg, head_dim, q.dtype, interp),
      out_type=(part_sums,) * 2, grid=grid, grid_names=grid_names,
      what=f"the head-split dK/dV kernel with {cfg}", reduces=False,
      interpret=interpret)(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, mod_arrays, table,
                           dq_acc)
  return tuple(common.sum_group_parts(g, group_parts) for g in grads)


def dkv_scratch_types(cfg: config_lib.KernelConfig, head_dim: int, dtype, interpret: bool) -> list:
  """The dK/dV kernel's shared memory and barriers (the order `_dkv_kernel` takes them in).
  head_dim 256, blocks of 64, 2 stages: K, V 64 KiB; q, dO ring 128 KiB; P^T, dS^T 16 KiB; dP^T
  16 KiB; lse and delta 2 KiB: 226 KiB. With fused_dq the two float32 dQ halves, 64 KiB at
  head_dim 256: one stage, 226 KiB; or with one_do_slot two q stages, one dO slot and one 16
  KiB float32 tile a warpgroup: 225 KiB."""
  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=common.TILE_TRANSFORMS)
  ring = lambda: plgpu.Barrier(num_barriers=cfg.stages)
  meeting = plgpu.Barrier  # one warpgroup arrives, the other waits
  parts = _dq_parts(_half(0, head_dim))  # (fused_dq)
  do_stages = 1 if cfg.one_do_slot else cfg.stages
  return [
      tile(1, cfg.block_kv, head_dim),  # k, then dk out (a leading 1: `_one_tile`)
      tile(1, cfg.block_kv, head_dim),  # v, then dv out
      tile(cfg.stages, cfg.block_q, head_dim),  # q ring
      tile(do_stages, cfg.block_q, head_dim),  # dO ring
      plgpu.SMEM((cfg.stages, cfg.block_q), jnp.float32),  # lse ring
      plgpu.SMEM((cfg.stages, cfg.block_q), jnp.float32),  # delta ring
      tile(cfg.block_kv, cfg.block_q),  # P^T (dropped), warpgroup 0 -> 1
      tile(cfg.block_kv, cfg.block_q),  # dS^T, warpgroup 0 -> 1
      common.f32_tile((cfg.block_kv, cfg.block_q), cfg.swizzle_f32),  # dP^T, warpgroup 1 -> 0
      common.staging_scratch(interpret, (_WGS, cfg.block_kv, cfg.block_q), dtype),
      plgpu.Barrier(num_barriers=2),  # k, v loaded
      ring(), plgpu.Barrier(num_barriers=do_stages), ring(), ring(),  # q, dO, lse, delta filled
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=cfg.stages),  # slot free
      meeting(), meeting(),  # dP^T written, read
      meeting(), meeting(), meeting(),  # P^T written, dS^T written, both read
      plgpu.Barrier(num_arrivals=_WGS),  # both halves of dK and dV written
      # fused_dq: each warpgroup's parts of the dQ part, out by reduce-add (one_do_slot: all
      # through one tile)
      *([common.f32_tile((_WGS, 1 if cfg.one_do_slot else len(parts), cfg.block_q,
                          parts[0].size), cfg.swizzle_f32)] if cfg.fused_dq else []),
      # one_do_slot: dO's slot free (both warpgroups' dV wgmmas done)
      *([plgpu.Barrier(num_arrivals=_WGS, num_barriers=1)] if cfg.one_do_slot else []),
  ]


# ---------------------------------------------------------------------------------------------
# dQ


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_len_ref, mod_refs, table_refs,
               dq_ref,
               q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dp_smem, staging,
               q_full, k_full, v_full, k_free, v_free, dp_full, dp_free, ds_full, ds_free,
               halves_written, *,
               spec: mask_lib.MaskSpec, scale: float, cfg: config_lib.KernelConfig,
               num_q_tiles: int, num_kv_blocks: int, groups: int, mods: mods_lib.KernelMods):
  block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  batch, head, kv_head, wg = common.query_head_position(groups)
  kv_length = kv_len_ref[batch]

  q_tile = common.tile_index("q_tiles", num_q_tiles, cfg.reverse_q_tiles)
  q_start = q_tile * block_q
  cta_list = ranges = None
  if table_refs is None:
    lo, hi = mask_lib.kv_block_range(spec, q_start, block_q, block_kv, num_kv_blocks, kv_length)
    full_lo, full_hi = mask_lib.kv_full_range(spec, q_start, block_q, block_kv, lo, hi,
                                              kv_length)
    ranges = (lo, full_lo, full_hi, hi)
    block_of, num_blocks = (lambda i: lo + i), hi - lo
  else:
    cta_list = block_table.CtaList.read(table_refs, batch=batch, head=head, tile=q_tile)
    block_of, num_blocks = cta_list.block, cta_list.count

  @pl.when(wg == _WGS)
  def _producer():
    common.produce_kv(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free,
                      batch=batch, kv_head=kv_head, block_of=block_of,
                      num_blocks=num_blocks, block_kv=block_kv, stages=stages,
                      registers=cfg.producer_registers)

  rows = (batch, pl.ds(q_start, block_q), head)
  stats = (batch, head, pl.ds(q_start, block_q))
  stage = staging[0] if staging else None  # (the interpreter's register operand, warpgroup 0)

  def load_rows():
    """q, dO, lse and delta in, for both warpgroups (each one's epilogue overwrites half of
    the q tile)."""
    @pl.when(wg == _SCORES)
    def _():
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[0], q_full.at[0])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[0], q_full.at[1])
      plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem, q_full.at[2])
      plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem, q_full.at[3])

    for i in range(4):
      plgpu.barrier_wait(q_full.at[i])

  def wait_filled(slot):
    plgpu.barrier_wait(k_full.at[slot])
    plgpu.barrier_wait(v_full.at[slot])

  def release(slot):
    plgpu.barrier_arrive(k_free.at[slot])
    plgpu.barrier_arrive(v_free.at[slot])

  def walk(step):
    """Run `step(slot, j, 0, (dq,), count, masked=...)` over every visible key block j.
    Returns (dq, steps taken)."""
    zeros = plgpu.layout_cast(jnp.zeros((block_q, head_dim // 2), jnp.float32), common.WGMMA)
    return _walk_blocks(step, (zeros,), groups=1, per_head=num_blocks, stages=stages,
                        cta_list=cta_list, ranges=ranges, wait_filled=wait_filled,
                        release=release)

  def store(dq, half):
    """This warpgroup's half of dQ into the q tile (warpgroup 0's last read of it is behind its
    last dS signal, which warpgroup 1 waited for); warpgroup 0 stores the tile once both halves
    are in."""
    q_smem.at[0, :, half][...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(halves_written)
    plgpu.barrier_wait(halves_written)

  @pl.when(wg == _SCORES)
  def _scores_warpgroup():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")
    load_rows()
    half = _half(_SCORES, head_dim)
    scores = mods_lib.TileScorer.create(mods, spec, scale, mod_refs, batch=batch, head=head,
                                        row_start=q_start, rows=block_q, kv_length=kv_length,
                                        backward=True)
    lse2 = plgpu.load(lse_smem, (), layout=common.WGMMA_ROW) * common.LOG2E
    delta = plgpu.load(delta_smem, (), layout=common.WGMMA_ROW)

    def step(slot, j, g, acc, count, *, masked):
      del g
      (dq,) = acc
      cols = scores.columns(j, block_kv, masked=masked)
      wait_filled(slot)
      s = common.matmul(q_smem.at[_one_tile(cfg)], k_smem.at[slot].T, (block_q, block_kv))
      s, chain = scores(s, cols, masked=masked)
      p = jnp.exp2(s - common.broadcast_rows(lse2, s.shape))  # [block_q, block_kv]
      plgpu.barrier_wait(dp_full)
      dp = plgpu.load(dp_smem, (), layout=common.WGMMA)
      plgpu.barrier_arrive(dp_free)
      dp = scores.dropped(dp, scores.dropout_keep(dp, cols))  # dP of the dropped weights
      ds = mods_lib.logit_grad(p * (dp - common.broadcast_rows(delta, dp.shape)), chain)
      ds = ds.astype(dtype)
      _wait_unless_first(count, ds_free)  # warpgroup 1 is done with the last dS
      ds_smem[...] = ds
      plgpu.commit_smem()  # for warpgroup 1's dQ wgmma
      plgpu.barrier_arrive(ds_full)
      return (common.matmul_acc(dq, ds, k_smem.at[slot, :, half], stage),)

    dq, count = walk(step)
    _wait_unless_first(count, ds_free)  # warpgroup 1's last read of dS
    store(dq, half)
    plgpu.copy_smem_to_gmem(q_smem.at[0], dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _DP)
  def _dp_warpgroup():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")
    load_rows()
    half = _half(_DP, head_dim)

    def step(slot, j, g, acc, count, *, masked):
      del j, g, masked  # (warpgroup 0 applies the mask and the modifiers)
      (dq,) = acc
      wait_filled(slot)
      dp = common.matmul(do_smem.at[_one_tile(cfg)], v_smem.at[slot].T, (block_q, block_kv))
      _wait_unless_first(count, dp_free)  # warpgroup 0 has read the last dP
      dp_smem[...] = dp
      plgpu.barrier_arrive(dp_full)
      plgpu.barrier_wait(ds_full)
      dq = common.matmul_acc_smem(dq, ds_smem, k_smem.at[slot, :, half], stage is not None)
      plgpu.barrier_arrive(ds_free)
      return (dq,)

    def dp_of(slot):
      plgpu.barrier_wait(v_full.at[slot])
      return common.matmul(do_smem.at[_one_tile(cfg)], v_smem.at[slot].T, (block_q, block_kv))

    def step_ahead(slot, count, dp, next_dp, acc):
      """Step `count` with its dP made the step before; the next block's dP is computed before
      this step's wait for dS, under warpgroup 0's softmax (`cfg.dp_ahead`)."""
      (dq,) = acc
      _wait_unless_first(count, dp_free)  # warpgroup 0 has read the last dP
      dp_smem[...] = dp
      plgpu.barrier_arrive(dp_full)
      dp = next_dp()
      plgpu.barrier_wait(k_full.at[slot])
      plgpu.barrier_wait(ds_full)
      dq = common.matmul_acc_smem(dq, ds_smem, k_smem.at[slot, :, half], stage is not None)
      plgpu.barrier_arrive(ds_free)
      release(slot)
      return (dq,), dp

    if cfg.dp_ahead:
      zeros = plgpu.layout_cast(jnp.zeros((block_q, head_dim // 2), jnp.float32), common.WGMMA)
      dq, count = _walk_dp_ahead(num_blocks, stages, dp_of, (block_q, block_kv), step_ahead,
                                 (zeros,))
    else:
      dq, count = walk(step)
    _wait_unless_first(count, dp_free)  # warpgroup 0's last read of dP
    store(dq, half)


def dq(q, k, v, d_out, lse, delta, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
       cfg: config_lib.KernelConfig, interpret: bool, mods: mods_lib.KernelMods,
       mod_arrays: mods_lib.ModArrays, table: block_table.BlockTable | None):
  """dQ [B, T, Hq, D] in q.dtype; arguments as in `bwd.dq`, `table` from
  `block_table.query_major(..., rows_per_cta=1)` at (cfg.block_q, cfg.block_kv) or None."""
  batch, q_len, heads_q, head_dim = q.shape
  kv_len, heads_kv = k.shape[1], k.shape[2]
  _check_head_dim(head_dim)
  num_q_tiles = q_len // cfg.block_q
  kernel = functools.partial(_dq_kernel, spec=spec, scale=scale, cfg=cfg,
                             num_q_tiles=num_q_tiles, num_kv_blocks=kv_len // cfg.block_kv,
                             groups=heads_q // heads_kv, mods=mods)
  grid, grid_names = cfg.grid(heads=heads_q, tiles=num_q_tiles, batch=batch, tile_axis="q_tiles")
  return common.warp_specialized(
      kernel, lambda interp: dq_scratch_types(cfg, head_dim, q.dtype, interp),
      out_type=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=grid, grid_names=grid_names,
      what=f"the head-split dQ kernel with {cfg}", reduces=False,
      interpret=interpret)(q, k, v, d_out, lse, delta, kv_lengths, mod_arrays, table)


def dq_scratch_types(cfg: config_lib.KernelConfig, head_dim: int, dtype, interpret: bool) -> list:
  """The dQ kernel's shared memory and barriers (the order `_dq_kernel` takes them in).
  head_dim 256, blocks of 64, 2 stages: q, dO 64 KiB; K, V ring 128 KiB; dS 8 KiB; dP 16 KiB;
  lse, delta 2 KiB: 218 KiB."""
  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=common.TILE_TRANSFORMS)
  ring = lambda: plgpu.Barrier(num_barriers=cfg.stages)
  freed = lambda: plgpu.Barrier(num_arrivals=_WGS, num_barriers=cfg.stages)
  return [
      tile(1, cfg.block_q, head_dim),  # q, then dq out (a leading 1: `_one_tile`)
      tile(1, cfg.block_q, head_dim),  # dO
      plgpu.SMEM((cfg.block_q,), jnp.float32),  # lse
      plgpu.SMEM((cfg.block_q,), jnp.float32),  # delta
      tile(cfg.stages, cfg.block_kv, head_dim),  # k ring
      tile(cfg.stages, cfg.block_kv, head_dim),  # v ring
      tile(cfg.block_q, cfg.block_kv),  # dS, warpgroup 0 -> 1
      common.f32_tile((cfg.block_q, cfg.block_kv), cfg.swizzle_f32),  # dP, warpgroup 1 -> 0
      common.staging_scratch(interpret, (cfg.block_q, cfg.block_kv), dtype),
      plgpu.Barrier(num_barriers=4),  # q, dO, lse, delta loaded
      ring(), ring(),  # k, v slot filled
      freed(), freed(),  # k, v slot free
      plgpu.Barrier(), plgpu.Barrier(),  # dP written, read
      plgpu.Barrier(), plgpu.Barrier(),  # dS written, read
      plgpu.Barrier(num_arrivals=_WGS),  # both halves of dQ written
  ]


def _check_head_dim(head_dim: int):
  if head_dim % 128:
    raise ValueError(f"head_split needs head_dim a multiple of 128 (each half whole 64-column "
                     f"tiles), got head_dim {head_dim}")
