"""Pieces every Mosaic GPU kernel here uses: shared-memory layouts, the in-kernel mask, the
producer side of a TMA ring, and the interpret switch."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import config as config_lib

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# wgmma operands in shared memory: 8x64-element tiles with a 128-byte swizzle (64 bf16/f16
# columns), so head_dim 64, 128 and 256 are whole numbers of tiles.
TILE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# float32 tiles that registers in the WGMMA layout are written to (and read back from): 8x32
# tiles with the 128-byte swizzle. Unswizzled, a warp's 8 rows of a [rows, 64 or more] float32
# tile start in the same bank (rows are a multiple of 128 bytes apart): 8-way conflicts.
F32_TILE_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def f32_tile(shape, swizzled: bool):
  """A float32 shared-memory tile for WGMMA-layout stores (swizzled: `F32_TILE_TRANSFORMS`)."""
  return plgpu.SMEM(shape, jnp.float32, transforms=F32_TILE_TRANSFORMS if swizzled else ())

WGMMA = plgpu.Layout.WGMMA
WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [rows, cols] WGMMA tile
WGMMA_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


# Mosaic GPU starts every scratch buffer at a multiple of 1 KiB; barriers (8 bytes each) follow.
SMEM_ALIGNMENT = 1024
BARRIER_BYTES = 8
# Pallas reserves this much shared memory in a kernel that reduces (`CompilerParams.
# reduction_scratch_bytes`), for reductions across warps. Ours reduce a WGMMA tile over its
# columns, which one warp holds, and never use it: a kernel that fits only without it drops it.
REDUCTION_SCRATCH_BYTES = plgpu.CompilerParams().reduction_scratch_bytes


def _align(nbytes: int) -> int:
  return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def smem_bytes(scratch_types, reduction_scratch: bool = False) -> int:
  """Shared memory a kernel with `scratch_types` (nested tuples allowed) takes, as Mosaic GPU
  counts it: the buffers, each from a 1 KiB boundary; the reduction scratch when reserved; then
  the barriers."""
  buffers = barriers = 0
  for item in jax.tree.leaves(scratch_types, is_leaf=lambda x: not isinstance(x, (tuple, list))):
    if isinstance(item, plgpu.Barrier):
      count = item.num_barriers  # an int, or the barrier array's shape
      barriers += math.prod(count if isinstance(count, tuple) else (count,)) * BARRIER_BYTES
    else:
      buffers = _align(buffers) + math.prod(item.shape) * jnp.dtype(item.dtype).itemsize
  reserved = REDUCTION_SCRATCH_BYTES if reduction_scratch else 0
  return _align(buffers + reserved) + barriers


def compiler_params_within_smem(scratch_types, what: str, reduces: bool):
  """The kernel's compiler params, after checking that `scratch_types` fit the shared memory of
  one CTA (227 KiB; ValueError if not). A kernel that `reduces` keeps Pallas's reduction scratch
  when it fits beside the buffers, and goes without it otherwise (see REDUCTION_SCRATCH_BYTES)."""
  if reduces and smem_bytes(scratch_types, reduction_scratch=True) <= config_lib.SMEM_BYTES:
    return compiler_params()
  need = smem_bytes(scratch_types)
  if need > config_lib.SMEM_BYTES:
    raise ValueError(f"{what} needs {need / 1024:.1f} KiB of shared memory, more than the "
                     f"{config_lib.SMEM_BYTES // 1024} KiB of a Hopper CTA")
  return compiler_params(reduction_scratch=not reduces)


def warp_specialized(kernel, scratch_types, *, out_type, grid, grid_names, what: str,
                     reduces: bool, interpret: bool,
                     compute_warpgroups: int = config_lib.COMPUTE_WARPGROUPS):
  """`plgpu.kernel` of `kernel` run by `compute_warpgroups` compute warpgroups and a producer
  warpgroup (the thread axis "wg"), once `scratch_types(interpret)` (the kernel's shared memory
  and barriers) is checked to fit (`compiler_params_within_smem`; `what` names the kernel in the
  error)."""
  params = compiler_params_within_smem(scratch_types(False), what, reduces)
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=scratch_types(interpret),
      grid=grid,
      grid_names=grid_names,
      num_threads=compute_warpgroups + 1,
      thread_name="wg",
      compiler_params=params,
      interpret=interpret_params(interpret),
  )


def interpret_params(interpret: bool):
  """`interpret=True` runs the kernel in the Mosaic GPU interpreter (CPU), checking for races."""
  return plgpu.InterpretGPUParams(detect_races=True) if interpret else None


def compiler_params(reduction_scratch: bool = True):
  """`reduction_scratch=False`: no shared memory reserved for cross-warp reductions."""
  if reduction_scratch:
    return plgpu.CompilerParams(approx_math=True)
  return plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def per_step_index(index):
  """`index` (an int32 scalar) through an optimization barrier: the same value, which LLVM can
  no longer prove the same at every step of a loop it is taken in. The shared-memory tile that
  a wgmma reads at `ref.at[per_step_index(i)]` then has its descriptors (one 64-bit value per
  16 columns of the contraction) built where the wgmma is issued: indexed by a plain
  loop-invariant `i`, LLVM hoists them out of the loop, and ptxas keeps them live across it,
  spilling where registers are short (`KernelConfig.tile_descriptors_in_step`)."""
  return lax.optimization_barrier(jnp.asarray(index, jnp.int32))


def same_tile_index(index, in_step: bool):
  """The index of a tile that every step of a loop reads the same (K, V of a key tile; q, dO of
  a query tile): through `per_step_index` where `in_step` (`KernelConfig.tile_descriptors_in_step`,
  taken inside the step), else `index` itself."""
  return per_step_index(index) if in_step else index


def matmul(lhs, rhs, shape, while_running=None) -> jax.Array:
  """lhs @ rhs into a fresh float32 [M, N] wgmma accumulator; lhs is a shared-memory ref (or,
  compiled, a register array in the WGMMA layout), rhs a shared-memory ref (possibly
  transposed). `while_running` runs after the wgmma is issued and before it is awaited."""
  return matmul_sum([(lhs, rhs)], shape, while_running)


def matmul_sum(pairs, shape, while_running=None) -> jax.Array:
  """sum(lhs @ rhs for lhs, rhs in pairs), operands as in `matmul`: the wgmmas chain on one
  fresh accumulator and are awaited once."""

  def body(acc_ref):
    for lhs, rhs in pairs:
      plgpu.wgmma(acc_ref, lhs, rhs)
    if while_running is not None:
      while_running()
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def matmul_pair(first, second, between):
  """Two wgmmas issued back to back, `first` and `second` each (lhs, rhs, [M, N]) into a fresh
  float32 accumulator (operands as in `matmul`). Only the first is awaited before
  `between(first_product)` runs, so it runs on the CUDA cores while the second product is still
  on the tensor cores. Returns (between's result, the second product)."""

  def body(first_ref, second_ref):
    plgpu.wgmma(first_ref, first[0], first[1])
    plgpu.wgmma(second_ref, second[0], second[1])
    result = between(plgpu.wgmma_accumulator_load(first_ref, wait_n=1))
    return result, second_ref[...]

  return pl.run_scoped(body, plgpu.ACC(first[2], jnp.float32),
                       plgpu.ACC(second[2], jnp.float32))


def matmul_acc(acc, lhs, rhs, staging=None) -> jax.Array:
  """acc + lhs @ rhs with lhs a register array.

  Compiled (`staging` None), the wgmma reads lhs from registers and accumulates in place
  (`pl.run_state` over the accumulator). The interpreter (jax 0.11.2) runs neither register
  operands nor `run_state`, so there lhs is staged through the shared-memory ref `staging` and the
  product, made in a fresh accumulator, is added in registers: the same arithmetic.
  """
  if staging is not None:
    staging[...] = lhs
    plgpu.commit_smem()
    return acc + matmul(staging, rhs, acc.shape)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, lhs, rhs)

  return pl.run_state(body)(plgpu.ACC.init(acc))


def issue_acc(acc_ref, lhs, rhs, staging=None):
  """acc_ref (a `plgpu.ACC` that outlives this step) += lhs @ rhs with lhs a register array,
  issued and not awaited: the caller waits (`plgpu.wgmma_wait`) before lhs's registers or rhs's
  shared memory change. The interpreter (`staging`, as in `matmul_acc`) stages lhs through
  shared memory."""
  if staging is not None:
    staging[...] = lhs
    plgpu.commit_smem()
    lhs = staging
  plgpu.wgmma(acc_ref, lhs, rhs)


def step_under_pending(body, shape, count, release_prev):
  """A step of the backward's overlapped walks (`KernelConfig.overlap_dq`, `overlap_dkv`):
  `body(first_ref, second_ref)` gets two fresh float32 [M, N] = `shape` accumulators, issues
  the step's two wgmmas into them and the step before's pending one (`issue_acc`), and makes
  its result on the CUDA cores while that one runs; every wgmma is awaited at its end. Then,
  when there was a step before (count > 0), `release_prev()` frees that step's ring slot, which
  the pending wgmma read. Returns body's result."""

  def scoped(first_ref, second_ref):
    result = body(first_ref, second_ref)
    plgpu.wgmma_wait(0)  # (the pending wgmma: its register operand and its slot are free)
    return result

  result = pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
  pl.when(count > 0)(release_prev)
  return result


def matmul_acc_pair(first, second, staging=None) -> tuple[jax.Array, jax.Array]:
  """`matmul_acc` of `first` and `second`, each (acc, lhs, rhs), their wgmmas issued back to
  back and awaited once (the second starts as soon as the first leaves the tensor cores)."""
  if staging is not None:
    return matmul_acc(*first, staging), matmul_acc(*second, staging)

  def body(acc_refs):
    for acc_ref, (_, lhs, rhs) in zip(acc_refs, (first, second)):
      plgpu.wgmma(acc_ref, lhs, rhs)

  return pl.run_state(body)((plgpu.ACC.init(first[0]), plgpu.ACC.init(second[0])))


def matmul_accs_then_product(accumulating, between, shape, staging=None):
  """`matmul_acc` of each (acc, lhs, rhs) in `accumulating`, their wgmmas issued back to back;
  then `between()` runs while they are on the tensor cores and returns (lhs, rhs) pairs in
  shared memory whose sum of products goes into a fresh float32 `shape` accumulator, issued
  behind them; all are awaited once. Returns (the new accs, the product). The interpreter
  (`staging` given, see `matmul_acc`) runs the same arithmetic one step after the other."""
  if staging is not None:
    accs = tuple(matmul_acc(*operands, staging) for operands in accumulating)
    return accs, matmul_sum(between(), shape)

  def body(product_ref):
    def issue(acc_refs):
      for acc_ref, (_, lhs, rhs) in zip(acc_refs, accumulating):
        plgpu.wgmma(acc_ref, lhs, rhs)
      for lhs, rhs in between():
        plgpu.wgmma(product_ref, lhs, rhs)

    # (run_state's end awaits the wgmmas in flight; the product is read after an explicit
    # wait, as in `matmul_sum`, so that its read does not rest on that.)
    accs = pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc, _, _ in accumulating))
    plgpu.wgmma_wait(0)
    return accs, product_ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def matmul_acc_smem(acc, lhs, rhs, interpret: bool) -> jax.Array:
  """acc + lhs @ rhs with lhs a shared-memory ref: in place compiled (`matmul_acc`), a fresh
  product added in registers in the interpreter (which runs no `run_state`)."""
  if interpret:
    return acc + matmul(lhs, rhs, acc.shape)
  return matmul_acc(acc, lhs, rhs)


def matmul_then_rescaled_acc(first, acc, acc_scale, lhs, rhs, *, after_issue, between,
                             between_init, staging=None):
  """FlashAttention-3's step inside a warpgroup: `first` = (lhs, rhs, [M, N]) into a fresh
  float32 accumulator (shared-memory operands, as in `matmul`), then acc * acc_scale (one value
  per row) + lhs @ rhs in place (lhs a register array, as in `matmul_acc`), the two wgmmas
  issued back to back (the rescale runs while the first is on the tensor cores); then
  `after_issue()`; then the first product alone is awaited and `between(first_product)` runs on
  the CUDA cores while the second wgmma is still on the tensor cores.

  Returns (the new acc, between's result). `between_init`: a pytree of arrays shaped like
  between's result, whose values are not used: compiled, the result leaves `pl.run_state` (whose
  end awaits the second wgmma) through refs that start from it. The interpreter (`staging`
  given, see `matmul_acc`) runs the same arithmetic one step after the other."""
  if staging is not None:
    product = matmul(first[0], first[1], first[2])
    after_issue()
    result = between(product)
    return matmul_acc(acc * broadcast_rows(acc_scale, acc.shape), lhs, rhs, staging), result

  def issue(first_ref):
    plgpu.wgmma(first_ref, first[0], first[1])
    scaled = acc * broadcast_rows(acc_scale, acc.shape)

    def second(refs):
      acc_ref, result_refs = refs
      plgpu.wgmma(acc_ref, lhs, rhs)
      after_issue()
      result = between(plgpu.wgmma_accumulator_load(first_ref, wait_n=1))
      for ref, value in zip(jax.tree.leaves(result_refs), jax.tree.leaves(result)):
        ref[...] = value

    return pl.run_state(second)((plgpu.ACC.init(scaled), between_init))

  return pl.run_scoped(issue, plgpu.ACC(first[2], jnp.float32))


def sum_group_parts(part_sums: jax.Array, parts: int) -> jax.Array:
  """[B, S, Hkv * parts, D] dK or dV partials of a dK/dV kernel whose query-head groups ran in
  `parts` CTAs (kv head h's at h * parts + p) -> [B, S, Hkv, D], added in float32."""
  if parts == 1:
    return part_sums
  batch, seq, heads, head_dim = part_sums.shape
  return (part_sums.reshape(batch, seq, heads // parts, parts, head_dim)
          .sum(3, dtype=jnp.float32).astype(part_sums.dtype))


def reduce_add(part, smem, dest, partials: bool, pending: int = 0):
  """dest (a float32 global-memory ref) += part, by a TMA reduce-add from the shared-memory tile
  `smem` once the last reduce-add from it has read it: once at most `pending` of this thread's
  copies are still reading (those from the caller's other tiles, which it cycles through in
  turn). With `partials` (the interpreter, which has no TMA reduction) a plain copy into a
  destination of the caller's own, summed after."""
  plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
  smem[...] = part
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dest, reduction_op=None if partials else "add")


def staging_scratch(interpret: bool, shape, dtype):
  """The shared-memory staging buffer `matmul_acc` needs in the interpreter (none compiled)."""
  return (plgpu.SMEM(shape, dtype, transforms=TILE_TRANSFORMS),) if interpret else ()


def tile_positions(rows: int, cols: int, row_start, col_start, transposed: bool = False):
  """(query positions, key positions), int32 [rows, cols] in the WGMMA register layout, of a
  score tile whose first row and column are `row_start` and `col_start`. Forward/dQ tiles are
  [queries, keys]; dK/dV tiles are transposed ([keys, queries])."""
  row_ids = row_start + plgpu.broadcasted_iota(jnp.int32, (rows, cols), 0, layout=WGMMA)
  col_ids = col_start + plgpu.broadcasted_iota(jnp.int32, (rows, cols), 1, layout=WGMMA)
  return (col_ids, row_ids) if transposed else (row_ids, col_ids)


def tile_mask(spec: mask_lib.MaskSpec, positions, kv_length):
  """Visibility of a score tile at `positions` (from `tile_positions`).

  Queries past their length need no mask here: their lse is +inf, so their probabilities are 0
  anyway.
  """
  q_pos, kv_pos = positions
  return mask_lib.visible(spec, q_pos, kv_pos, None, kv_length)


def query_head_position(groups: int):
  """(batch, query head, its kv head, warpgroup) of this thread of a kernel whose grid runs over
  query heads (forward, dQ), `groups` query heads to a kv head."""
  head = lax.axis_index("heads")
  return lax.axis_index("batch"), head, lax.div(head, groups), lax.axis_index("wg")


def key_tile_heads(groups: int, group_parts: int):
  """(kv head, place on the grid's heads axis, first query head) of this thread of a dK/dV
  kernel whose grid runs over (kv head, part of its group) with `group_parts` parts, each CTA
  walking `groups` query heads (its dK / dV partials go to the heads-axis place)."""
  head_part = lax.axis_index("heads")
  kv_head = head_part if group_parts == 1 else lax.div(head_part, group_parts)
  return kv_head, head_part, head_part * groups


def key_tile_query_ranges(spec: mask_lib.MaskSpec, kv_start, block_kv: int, block_q: int,
                          num_q_blocks: int, q_length, kv_length, within=None):
  """(lo, full_lo, full_hi, hi): the query blocks [lo, hi) that may see a key of the tile
  [kv_start, kv_start + block_kv), and among them [full_lo, full_hi), those that need no mask
  (`common.masked_loops`' ranges of a dK/dV key tile). A tile wholly past the key length sees
  nothing; one that straddles it needs the mask on every block. `within`: (cta_lo, cta_hi), the
  CTA's range, to clip to."""
  lo, hi = mask_lib.q_block_range(spec, kv_start, block_kv, block_q, num_q_blocks, q_length)
  hi = jnp.where(kv_start >= kv_length, lo, hi)  # every key is padding
  if within is not None:
    lo = jnp.clip(lo, *within)
    hi = jnp.clip(hi, lo, within[1])
  full_lo, full_hi = mask_lib.q_full_range(spec, kv_start, block_kv, block_q, lo, hi)
  straddles = kv_start + block_kv > kv_length
  return lo, jnp.where(straddles, hi, full_lo), jnp.where(straddles, hi, full_hi), hi


def tile_index(axis: str, num_tiles: int, reverse: bool):
  """The tile this CTA owns along grid axis `axis`; `reverse` visits them last first."""
  index = lax.axis_index(axis)
  return num_tiles - 1 - index if reverse else index


def broadcast_rows(x, shape):
  """A per-row vector [rows] broadcast over a [rows, cols] tile."""
  return lax.broadcast_in_dim(x, shape, [0])


def broadcast_cols(x, shape):
  """A per-column vector [cols] broadcast over a [rows, cols] tile."""
  return lax.broadcast_in_dim(x, shape, [1])


def ring_slot(count, stages: int):
  """count % stages for a ring's non-negative running count: a mask where stages is a power of
  two (the remainder of a signed count costs a sign fix-up on the uniform datapath, and live
  uniform registers that a persistent forward's wgmma descriptors need)."""
  if stages & (stages - 1) == 0:
    return lax.bitwise_and(count, stages - 1)
  return lax.rem(count, stages)


def masked_loops(lo, full_lo, full_hi, hi, step, carry):
  """Run `step(j, carry, masked=...)` over [lo, hi): masked tiles at both ends, unmasked ones in
  between (the positional ranges of `mask`)."""
  carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def produce_ring(num_steps, stages, issue_copies, wait_slot_free, start=None):
  """The producer warpgroup's loop over a ring of `stages` shared-memory slots.

  Step i (0 <= i < num_steps) goes to slot i % stages; before reusing a slot the producer waits
  until the consumers released it. Afterwards it waits for the consumers' last releases, so every
  barrier phase is observed by every waiter (the interpreter requires it, and it keeps the CTA
  alive until the last reads of shared memory are done).

  `issue_copies` and `wait_slot_free` may be tuples of the same length: a slot of several parts
  (K and V) that the consumers release one by one, each part refilled as soon as its own release
  came (part 0's wait and copy, then part 1's, ...). `stages` may then be a tuple too, each
  part's own ring depth (`KernelConfig.one_do_slot`: q, lse and delta in `stages` slots, dO in
  one): part p's step i goes to its slot i % stages[p].

  `start` (a persistent kernel, whose ring runs on across work items): the ring's running count
  before these steps. Step i then goes to slot (start + i) % stages, waiting for it when
  start + i >= stages; there is no drain (`drain_ring` once, after the last item), and the
  function returns start + num_steps.
  """
  parts = _ring_parts(issue_copies, wait_slot_free, stages)

  def step(i, carry):
    count = i if start is None else start + i  # (no add in the one-item kernels' jaxpr)
    slots = {}  # depth -> this step's slot
    for issue, wait, depth in parts:
      if depth not in slots:
        slots[depth] = lax.rem(count, depth)
      slot = slots[depth]
      pl.when(count >= depth)(lambda: wait(slot))
      issue(i, slot)
    return carry

  lax.fori_loop(0, num_steps, step, None)
  if start is not None:
    return start + num_steps
  drain_ring(num_steps, stages, wait_slot_free)


def _ring_parts(issue_copies, wait_slot_free, stages):
  """[(issue, wait, stages)] of each part of a ring slot (`produce_ring`)."""
  if not isinstance(issue_copies, tuple):
    return [(issue_copies, wait_slot_free, stages)]
  if not isinstance(wait_slot_free, tuple) or len(wait_slot_free) != len(issue_copies):
    raise ValueError("a ring of several parts needs one wait per copy")
  depths = stages if isinstance(stages, tuple) else (stages,) * len(issue_copies)
  if len(depths) != len(issue_copies):
    raise ValueError("a ring of parts of their own depths needs one depth per part")
  return list(zip(issue_copies, wait_slot_free, depths))


def drain_ring(num_steps, stages, wait_slot_free):
  """Wait for the consumers' releases of the last `stages` of `num_steps` ring steps (of every
  part of a slot when `wait_slot_free` is a tuple, as in `produce_ring`; parts of their own
  depths, `stages` a tuple, each drained in turn)."""
  waits = wait_slot_free if isinstance(wait_slot_free, tuple) else (wait_slot_free,)
  depths = stages if isinstance(stages, tuple) else (stages,) * len(waits)
  # Parts of one depth drain in one loop, in part order.
  for depth in dict.fromkeys(depths):

    def drain(i, carry, depth=depth):
      for wait, part_depth in zip(waits, depths):
        if part_depth == depth:
          wait(lax.rem(i, depth))
      return carry

    lax.fori_loop(jnp.maximum(num_steps - depth, 0), num_steps, drain, None)


def kv_copies(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free, *, batch, kv_head,
              block_of, block_kv: int, split: bool = False):
  """(issue_copies, wait_slot_free) of `produce_ring` for key blocks block_of(i) of K and V
  ([batch, seq, heads_kv, head_dim]), each slot's K and V completing on their own barriers.
  `split`: K and V are the slot's two parts, each refilled once its own release came (consumers
  that free a block's K slot a step before its V slot: `KernelConfig.overlap_qk`); else the slot
  is refilled once both K and V are free."""

  def rows(i):
    return (batch, pl.ds(block_of(i) * block_kv, block_kv), kv_head)

  def issue_k(i, slot, index=None):
    plgpu.copy_gmem_to_smem(k_ref.at[index or rows(i)], k_smem.at[slot], k_full.at[slot])

  def issue_v(i, slot, index=None):
    plgpu.copy_gmem_to_smem(v_ref.at[index or rows(i)], v_smem.at[slot], v_full.at[slot])

  wait_k = lambda slot: plgpu.barrier_wait(k_free.at[slot])
  wait_v = lambda slot: plgpu.barrier_wait(v_free.at[slot])
  if split:
    return (issue_k, issue_v), (wait_k, wait_v)

  def issue(i, slot):
    index = rows(i)
    issue_k(i, slot, index)
    issue_v(i, slot, index)

  def wait_free(slot):
    wait_k(slot)
    wait_v(slot)

  return issue, wait_free


def produce_kv(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free, *, batch, kv_head,
               block_of, num_blocks, block_kv: int, stages: int, registers: int,
               split: bool = False):
  """The producer warpgroup of the forward and dQ kernels: key blocks block_of(i),
  0 <= i < num_blocks, of K and V ([batch, seq, heads_kv, head_dim]) into the ring, each slot's K
  and V completing on their own barriers (`split`: see `kv_copies`). `registers`: the producer's
  share (`KernelConfig.producer_registers`)."""
  plgpu.set_max_registers(registers, action="decrease")
  issue, wait_free = kv_copies(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free,
                               batch=batch, kv_head=kv_head, block_of=block_of,
                               block_kv=block_kv, split=split)
  produce_ring(num_blocks, stages, issue, wait_free)


def produce_query_rows(wg, refs, smems, fulls, slot_free, *, batch, first_head, groups: int,
                       per_head, block_of, block_q: int, stages: int, registers: int,
                       do_free=None):
  """The producer warpgroup (wg == COMPUTE_WARPGROUPS) of the dK/dV kernels: for query head
  first_head + g (g < groups: the CTA's heads of the kv head's group) and its e-th visited query
  block block_of(e) (e < per_head), ring step g * per_head + e loads that block's q and dO rows
  and its lse and delta into the ring.
  `refs`, `smems`, `fulls`: (q, dO, lse, delta) in global memory ([B, T, Hq, D] and [B, Hq, T]),
  their rings, and their slot-filled barriers; `slot_free`: the consumers' releases;
  `registers`: the producer's share (`KernelConfig.producer_registers`). `do_free`
  (`KernelConfig.one_do_slot`): dO has a ring of one slot of its own, refilled once the
  consumers free it there (mid-step), after the step's q, lse and delta."""

  def issue(i, slot, parts=(0, 1, 2, 3)):
    head = first_head + lax.div(i, per_head)
    q_start = block_of(lax.rem(i, per_head)) * block_q
    rows = (batch, pl.ds(q_start, block_q), head)
    stats = (batch, head, pl.ds(q_start, block_q))
    for part in parts:
      index = (rows, rows, stats, stats)[part]
      plgpu.copy_gmem_to_smem(refs[part].at[index], smems[part].at[slot], fulls[part].at[slot])

  wait_free = lambda slot: plgpu.barrier_wait(slot_free.at[slot])

  @pl.when(wg == config_lib.COMPUTE_WARPGROUPS)
  def _():
    plgpu.set_max_registers(registers, action="decrease")
    if do_free is None:
      produce_ring(groups * per_head, stages, issue, wait_free)
    else:  # q, lse and delta in `stages` slots, then dO in its one
      issue_rows = functools.partial(issue, parts=(0, 2, 3))
      issue_do = functools.partial(issue, parts=(1,))
      wait_do_free = lambda slot: plgpu.barrier_wait(do_free.at[slot])
      produce_ring(groups * per_head, (stages, 1), (issue_rows, issue_do),
                   (wait_free, wait_do_free))


def release_kv(slot, k_full, v_full, k_free, v_free):
  """A consumer's turn at a K/V slot it does not compute on (the other warpgroup does): observe
  the fill, then free the slot."""
  plgpu.barrier_wait(k_full.at[slot])
  plgpu.barrier_arrive(k_free.at[slot])
  plgpu.barrier_wait(v_full.at[slot])
  plgpu.barrier_arrive(v_free.at[slot])
