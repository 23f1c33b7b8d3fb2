"""Forward FlashAttention kernel for Hopper in Pallas Mosaic GPU.

One CTA owns 2 * block_q query rows of one (batch, head): two compute warpgroups take block_q rows
each (three with `compute_warpgroups=3`, the table's head_dim 64 forward), one more (the
producer) streams K and V tiles through a `stages`-deep shared-memory ring with
TMA copies that complete on barriers. Each compute warpgroup keeps the online-softmax state in
registers (running max m, running sum l, unnormalized accumulator), multiplies with wgmma, and
works in base 2 (scale * log2(e) folded into one multiply, exp2 on the SFU).

Only key blocks that can hold a visible key are loaded (`mask.kv_block_range`: causal, window and
key-length skipping); element masks are applied only to the tiles at the two ends of that range
(`mask.kv_full_range`). The producer loads the union of both warpgroups' ranges; a warpgroup
releases the slots outside its own range without computing on them. With segment ids the CTA
walks its list in a block table instead (`block_table`, built outside the kernel: blocks whose
segments cannot meet are skipped too), each entry telling each warpgroup to release, compute
masked or compute unmasked; both warpgroups walk the whole list, so the ping-pong meetings stay
paired (two per entry, whatever the mode). Soft-cap and ALiBi (`mods`) change the logits of every
tile when given; with dropout, the probabilities that multiply V are masked by the regenerated
keep-mask and scaled by 1 / (1 - rate). `cfg.overlap_qk` applies to the range loops; a block
table is walked one tile at a time.

Options of `cfg` (config.KernelConfig) beyond the tile sizes: `ping_pong` (the two warpgroups
take turns at the tensor cores, FlashAttention-3), `overlap_qk` (each warpgroup issues tile j's
QK^T and tile j - 1's P V together and runs tile j's softmax while P V is on the tensor cores; on
in the table at head_dim 128 and 256, without the ping-pong), `reverse_q_tiles` (the CTA at grid
index i owns the i-th query tile from the end: causal CTAs with the most keys start first) and
`grid_order` (launch order), `fold_scale` (scale * log2(e) folded into exp2's fused multiply-add
on unmodified, unmasked tiles), `read_only_store_wait` (the epilogue waits for its TMA stores
to read shared memory only), `exp2_fma_cols` (that many columns of each score tile take their
exp2 from a polynomial on the FMA pipe, `exp2.exp2_tile`; off: slower on the H200) and
`persistent` (one CTA per SM walks a static share of the (batch, head, query tile) items:
`_persistent`; every feature above works there, each item's walk being the one-item CTA's, with
the ring's slots and the q loads carried across items; `persistent_max_blocks(_skewed)` choose
it from the static shape, where the tiles see few key blocks, and `pair_q_tiles` makes each unit
of a causal call two tiles of one head whose weights add up to the same). `compute_warpgroups=3`
gives a CTA 3 * block_q rows; the rows are padded to whole block_q tiles only, so the warpgroups
of a last tile past the array load, compute and store nothing (`in_rows`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn.mosaic_gpu import block_table
from pallas_attn.mosaic_gpu import common
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import exp2 as exp2_lib
from pallas_attn.mosaic_gpu import mods as mods_lib


# The persistent grid's one axis (`KernelConfig.persistent`).
_SM_AXIS = "sm"
# CTAs of a persistent forward in the interpreter: few, so that each walks several work items (of
# different batches and heads) and the tests stay fast; 3 divides few grids, so some CTAs get one
# item fewer.
INTERPRET_CTAS = 3


def num_sms() -> int:
  """The SMs of the first GPU (a persistent forward's CTAs); config.NUM_SMS (H100 / H200 SXM)
  without one (lowering for CUDA on a CPU)."""
  try:
    return jax.devices("gpu")[0].core_count
  except (RuntimeError, AttributeError, IndexError):
    return config_lib.NUM_SMS


class _Work(NamedTuple):
  """One (batch, head, query tile) work item of a CTA and the key blocks it needs."""
  batch: Any
  head: Any
  kv_head: Any
  q_length: Any
  kv_length: Any
  cta_start: Any  # first query row of the tile (2 * block_q rows)
  cta_lo: Any  # key blocks [cta_lo, cta_hi): the union of the two warpgroups' ranges
  cta_hi: Any
  cta_list: block_table.CtaList | None  # segment ids: the block table's list instead

  def num_blocks(self):
    """Ring slots this item takes."""
    return self.cta_hi - self.cta_lo if self.cta_list is None else self.cta_list.count

  def block_of(self, i):
    """The key block of the item's i-th ring slot."""
    return self.cta_lo + i if self.cta_list is None else self.cta_list.block(i)


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """The persistent grid's static schedule: `num_ctas` CTAs, CTA c takes work units c,
  c + num_ctas, ... of the (batch, head, query tile) units numbered in `order` (fastest axis
  first, `KernelConfig.grid_order`'s names). A unit is one item, or with `paired_tiles` = T
  (`KernelConfig.pair_q_tiles`) the two query tiles T - 1 - t and t of one (batch, head),
  walked in that order: under a causal mask every such unit sees T + 1 tiles' worth of key
  blocks (tiles of rows_per_cta rows), so a static schedule of them is as balanced as a
  non-causal one (strided single tiles are not: 132 CTAs over 8 tiles a head give some CTAs
  mostly the heaviest tiles). With `snake` (`KernelConfig.snake_max_kv_heads`: the units are
  single tiles numbered heaviest first), round r's units go to the CTAs in reverse order where r
  is odd."""
  sizes: tuple[tuple[str, int], ...]  # (axis, size) of the units in `order`
  num_ctas: int
  paired_tiles: int = 0  # T when units are tile pairs (the q_tiles axis then counts T / 2)
  snake: bool = False

  @property
  def total(self) -> int:
    """Work units (items, or tile pairs)."""
    return math.prod(size for _, size in self.sizes)

  @property
  def items_per_unit(self) -> int:
    return 2 if self.paired_tiles else 1

  def count(self, cta):
    """Items of CTA `cta` (at least 1: there are at most as many CTAs as units)."""
    if self.snake:  # the last, partial round's units go to CTAs 0.. or C - 1.. as it runs
      rounds, rest = divmod(self.total, self.num_ctas)
      return jnp.where(self._in_round(rounds, cta) < rest, rounds + 1, rounds)
    return (lax.div(self.total - 1 - cta, self.num_ctas) + 1) * self.items_per_unit

  def _in_round(self, round_, cta):
    """CTA `cta`'s unit in round `round_`, counted from the round's first."""
    if not self.snake:
      return cta
    return jnp.where((round_ & 1) == 0, cta, self.num_ctas - 1 - cta)

  def item(self, cta, step) -> dict:
    """{axis: index} of CTA `cta`'s item number `step`."""
    unit_step = lax.div(step, 2) if self.paired_tiles else step
    index, coords = unit_step * self.num_ctas + self._in_round(unit_step, cta), {}
    for axis, size in self.sizes:
      coords[axis] = lax.rem(index, size)
      index = lax.div(index, size)
    if self.paired_tiles:  # the heavier tile of the pair first
      pair = coords["q_tiles"]
      coords["q_tiles"] = jnp.where(lax.rem(step, 2) == 0, self.paired_tiles - 1 - pair, pair)
    return coords


def _kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, mod_refs, table_refs, out_ref, lse_ref,
            qo_smem, k_smem, v_smem, lse_smem, o_smem, p_staging, q_full, k_full, v_full, k_free,
            v_free, schedule, turns, *,
            spec: mask_lib.MaskSpec, scale: float, cfg: config_lib.KernelConfig,
            num_q_tiles: int, num_kv_blocks: int, groups: int, mods: mods_lib.KernelMods,
            work_schedule: _Schedule | None = None):
  block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype

  def work_item(batch, head, q_tile_of) -> _Work:
    """The key blocks of query tile q_tile_of() of (batch, head): the union of its two
    warpgroups' ranges, or its list in the block table (segment ids)."""
    kv_head = lax.div(head, groups)
    q_length = q_len_ref[batch]
    kv_length = kv_len_ref[batch]
    q_tile = q_tile_of()
    cta_start = q_tile * cfg.rows_per_cta
    cta_lo = cta_hi = cta_list = None
    if table_refs is None:
      cta_lo, cta_hi = mask_lib.kv_block_range(spec, cta_start, cfg.rows_per_cta, block_kv,
                                               num_kv_blocks, kv_length)
      cta_hi = jnp.where(cta_start >= q_length, cta_lo, cta_hi)  # every row is padding
    else:
      cta_list = block_table.CtaList.read(table_refs, batch=batch, head=head, tile=q_tile)
    return _Work(batch, head, kv_head, q_length, kv_length, cta_start, cta_lo, cta_hi, cta_list)

  # overlap_qk's ping-pong (see `consume`) on the range walks: the turns alternate over the
  # whole CTA, a persistent one's items included (each warpgroup takes as many turns an item as
  # the other), so warpgroup 1 hands the first turn over once and warpgroup 0 takes the last
  # one once, where a CTA's work begins and ends.
  taking_turns = cfg.overlap_qk and cfg.ping_pong and table_refs is None
  # The producer refills K and V on their own releases where the overlapped walk frees them a
  # step apart (a block table is walked without the overlap).
  split_kv_refills = cfg.overlap_qk and table_refs is None

  def first_turn(wg):
    if taking_turns:
      pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turns[0].at[0]))

  def last_turn(wg):
    if taking_turns:
      pl.when(wg == 0)(lambda: plgpu.barrier_wait(turns[0].at[0]))

  def in_rows(q_start):
    """Whether a warpgroup's q tile lies in the array (with 3 warpgroups a CTA's last tile may
    not: the rows are padded to whole tiles of block_q, not of the CTA's rows_per_cta)."""
    return q_start < q_ref.shape[1]

  def q_copy(wg, batch, head, q_start):
    """This warpgroup's q tile from global memory into its part of `qo_smem`."""
    @pl.when(in_rows(q_start))
    def _():
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, block_q), head], qo_smem.at[wg],
                              q_full.at[wg])

  def consume(wg, work: _Work, slot_base=None, next_q=None):
    """Compute warpgroup wg's rows of one work item, from loading its q (non-persistent) to
    storing its output and lse.

    Persistent (`slot_base` given: the ring's running count before this item): q was loaded
    before; `next_q()` loads the next item's q into this warpgroup's q tile, which happens right
    after the item's last QK^T (`cfg.next_q_after_walk`: after the walk's loops) when the output
    has its own shared memory, else once the output store has read the q tile; the store is
    waited for before the output buffers are rewritten, not here."""
    persistent = slot_base is not None
    batch, head, kv_length, q_length = work.batch, work.head, work.kv_length, work.q_length
    cta_lo, cta_hi, cta_list = work.cta_lo, work.cta_hi, work.cta_list
    q_start = work.cta_start + wg * block_q
    q_smem = qo_smem.at[wg]
    out_smem = o_smem[0].at[wg] if o_smem else q_smem
    # The q tile QK^T reads at every step; with cfg.tile_descriptors_in_step its wgmma
    # descriptors are built there (`common.same_tile_index`) instead of held across the walk.
    q_tile = lambda: qo_smem.at[common.same_tile_index(wg, cfg.tile_descriptors_in_step)]
    if not persistent:
      q_copy(wg, batch, head, q_start)
    # The next item's q, as soon as this one's is free (after the last QK^T of a range walk).
    q_after_last_qk = persistent and bool(o_smem) and cta_list is None
    # cfg.next_q_after_walk: the same load once the walk's loops are done (no branch in them).
    q_after_walk = q_after_last_qk and cfg.next_q_after_walk
    q_after_last_qk = q_after_last_qk and not q_after_walk

    def ring_count(n):
      """The ring's running count at this item's n-th block (no add in a one-item CTA)."""
      return slot_base + n if persistent else n

    if cta_list is None:
      lo, hi = mask_lib.kv_block_range(spec, q_start, block_q, block_kv, num_kv_blocks,
                                       kv_length)
      hi = jnp.where(q_start >= q_length, lo, hi)
      lo = jnp.clip(lo, cta_lo, cta_hi)
      hi = jnp.clip(hi, lo, cta_hi)
      full_lo, full_hi = mask_lib.kv_full_range(spec, q_start, block_q, block_kv, lo, hi,
                                                kv_length)
      slot_of = lambda j: common.ring_slot(ring_count(j - cta_lo), stages)
    scores = mods_lib.TileScorer.create(mods, spec, scale, mod_refs, batch=batch, head=head,
                                        row_start=q_start, rows=block_q, kv_length=kv_length)
    # cfg.fold_scale applies where an unmasked tile's base-2 logits are q.k^T * scale * log2(e)
    # alone (what `scores` computes without a soft-cap, bias, ALiBi or score_fn).
    fold_scale = cfg.fold_scale and (mods.soft_cap is None and mods.bias is None
                                     and not mods.alibi and mods.element_fns is None)

    # The ping-pong meetings of the plain walk. A block table walk of an overlap_qk config meets
    # whatever `cfg.ping_pong` says: it is the plain walk, which is fastest with the meetings
    # (the table turns them off only for the overlapped range walk).
    meetings = cfg.ping_pong or (cfg.overlap_qk and cta_list is not None)

    def meet():
      """One ping-pong meeting of the two compute warpgroups (no-op without ping-pong)."""
      if meetings:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def release(slot, carry):
      """A slot another warpgroup needs: observe its fill, then free it. Keeps the ping-pong
      meetings in step with the other warpgroup (two per key block)."""
      common.release_kv(slot, k_full, v_full, k_free, v_free)
      meet()
      meet()
      return carry

    def qk(j, slot, masked: bool):
      """Tile j's logits S = q k^T with its modifiers and masks; frees the K slot. Returns
      (s, cols, c): the base-2 logits are s * c (c = 1.0 unless `cfg.fold_scale` left the
      scaling of this tile to `online_softmax`)."""
      cols = scores.columns(j, block_kv, masked=masked)
      plgpu.barrier_wait(k_full.at[slot])
      # The first meeting lets the other warpgroup's softmax start once this QK^T is issued.
      s = common.matmul(q_tile(), k_smem.at[slot].T, (block_q, block_kv),  # [block_q, block_kv]
                        while_running=meet)
      s, c = after_qk(j, slot, s, cols, masked)
      return s, cols, c

    def after_qk(j, slot, s, cols, masked: bool):
      """Once tile j's S is made: its K slot freed, then (s, c), the base-2 logits being s * c."""
      plgpu.barrier_arrive(k_free.at[slot])
      if q_after_last_qk:  # q_smem is read for the last time: the next q may come in
        pl.when(j == hi - 1)(next_q)
      if fold_scale and not masked:  # the raw tile: online_softmax scales its max instead
        return s, scale * common.LOG2E
      s, _ = scores(s, cols, masked=masked)
      return s, 1.0

    def online_softmax(s, m_i, l_i, c=1.0):
      """Online softmax in base 2 of the logits s * c: (p, m_new, l_new, alpha), the old state
      to be rescaled by alpha = 2^(m_old - m_new). c > 0, so max(s * c) = max(s) * c, and
      s * c - m is one fused multiply-add."""
      if c == 1.0:
        m_new = jnp.maximum(m_i, s.max(axis=1))
      else:
        m_new = jnp.maximum(m_i, s.max(axis=1) * c)
      alpha = jnp.exp2(m_i - m_new)
      if c == 1.0:
        p = s - common.broadcast_rows(m_new, s.shape)
      else:
        p = s * c - common.broadcast_rows(m_new, s.shape)
      p = exp2_lib.exp2_tile(p, cfg.exp2_fma_cols)
      l_i = l_i * alpha + p.sum(axis=1)  # the undropped row sum: lse ignores dropout
      return p, m_new, l_i, alpha

    def tensor_core_turn(slot):
      """Before P V: the V slot is filled and (ping-pong) the second meeting says the tensor
      cores are ours."""
      if meetings:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_full.at[slot])
        plgpu.barrier_wait(schedule)
      else:
        plgpu.barrier_wait(v_full.at[slot])

    staging = p_staging[0].at[wg] if p_staging else None

    def step(slot, j, carry, *, masked: bool):
      """Key block j, in ring slot `slot`."""
      acc, m_i, l_i = carry
      s, cols, c = qk(j, slot, masked)
      p, m_new, l_i, alpha = online_softmax(s, m_i, l_i, c)
      acc = acc * common.broadcast_rows(alpha, acc.shape)
      p = scores.dropped(p, scores.dropout_keep(p, cols))  # kept weights / (1 - rate)
      tensor_core_turn(slot)  # the second meeting: softmax done
      acc = common.matmul_acc(acc, p.astype(dtype), v_smem.at[slot], staging)
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l_i

    # cfg.overlap_qk (FlashAttention-3's intra-warpgroup overlap) on the range walk: the step
    # of tile j issues S(j) = q K(j)^T and then acc += P(j - 1) V(j - 1) back to back, and runs
    # tile j's softmax while the second is on the tensor cores; P(j - 1) and the rescale factor
    # that goes with it ride in the carry. The accumulator is added to in place, so what is live
    # is acc, S(j) and P(j - 1) (FA3's 64 + 64 + 32 registers a thread at head_dim 128). K slot j
    # is freed as soon as S(j) is made, V slot j - 1 after the step's second wgmma, and the
    # producer refills each part of a slot on its own release (`common.kv_copies`' split). The
    # ping-pong is FA3's too: a warpgroup waits for its turn (its `turns` barrier) before it
    # issues a step's two wgmmas, and hands the turn over right after, so the only blocking
    # point of a step is the turn itself.
    def my_turn():
      if taking_turns:
        plgpu.barrier_wait(turns[0].at[wg])

    def your_turn():
      if taking_turns:
        plgpu.barrier_arrive(turns[0].at[1 - wg])

    def release_in_turn(slot, carry):
      """A slot the other warpgroup computes on: this warpgroup's turn passes, then the release."""
      my_turn()
      your_turn()
      common.release_kv(slot, k_full, v_full, k_free, v_free)
      return carry

    def softmax_after_qk(j, slot, cols, masked: bool, m_i, l_i):
      """Tile j's softmax, from its S: (the dropped weights P in float32, m, l, alpha)."""

      def run(s):
        s, c = after_qk(j, slot, s, cols, masked)
        p, m_new, l_new, alpha = online_softmax(s, m_i, l_i, c)
        return scores.dropped(p, scores.dropout_keep(p, cols)), m_new, l_new, alpha

      return run

    def first_step(carry):
      """Tile lo: S and its softmax; no P V yet (acc is zero: alpha rescales nothing)."""
      acc, m_i, l_i, _, _ = carry
      slot = slot_of(lo)
      cols = scores.columns(lo, block_kv, masked=True)  # (masking a tile that needs none is exact)
      plgpu.barrier_wait(k_full.at[slot])
      my_turn()
      s = common.matmul(q_tile(), k_smem.at[slot].T, (block_q, block_kv), while_running=your_turn)
      p, m_new, l_i, alpha = softmax_after_qk(lo, slot, cols, True, m_i, l_i)(s)
      return acc, m_new, l_i, p.astype(dtype), alpha

    def overlapped_step(j, carry, *, masked: bool):
      acc, m_i, l_i, p_prev, alpha_prev = carry
      slot, prev = slot_of(j), slot_of(j - 1)
      cols = scores.columns(j, block_kv, masked=masked)
      plgpu.barrier_wait(k_full.at[slot])
      plgpu.barrier_wait(v_full.at[prev])
      my_turn()
      p_init = plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32), common.WGMMA)
      acc, (p, m_new, l_i, alpha) = common.matmul_then_rescaled_acc(
          (q_tile(), k_smem.at[slot].T, (block_q, block_kv)), acc, alpha_prev, p_prev,
          v_smem.at[prev], after_issue=your_turn,
          between=softmax_after_qk(j, slot, cols, masked, m_i, l_i),
          between_init=(p_init, m_i, l_i, alpha_prev), staging=staging)
      plgpu.barrier_arrive(v_free.at[prev])
      return acc, m_new, l_i, p.astype(dtype), alpha

    def last_pv(carry):
      acc, m_i, l_i, p, alpha = carry
      last = slot_of(hi - 1)
      plgpu.barrier_wait(v_full.at[last])
      acc = common.matmul_acc(acc * common.broadcast_rows(alpha, acc.shape), p, v_smem.at[last],
                              staging)
      plgpu.barrier_arrive(v_free.at[last])
      return acc, m_i, l_i, p, alpha

    pl.when(in_rows(q_start))(lambda: plgpu.barrier_wait(q_full.at[wg]))
    carry = (
        plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), common.WGMMA),
        plgpu.layout_cast(jnp.full((block_q,), numerics.M_INIT, jnp.float32), common.WGMMA_ROW),
        plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), common.WGMMA_ROW),
    )
    overlapped = cfg.overlap_qk and cta_list is None
    if not overlapped:
      pl.when(wg == 1)(meet)  # offsets the two warpgroups by one meeting
    elif not persistent:
      first_turn(wg)
    if cta_list is not None:  # both warpgroups walk the whole list: two meetings per entry
      carry = cta_list.visit(wg, carry, slot_of=lambda i: common.ring_slot(ring_count(i), stages),
                             release=release, step=step)
      if persistent and o_smem:  # (which entry is this warpgroup's last QK^T is not known)
        next_q()
    else:
      release_block = lambda j, c: (release_in_turn if overlapped else release)(slot_of(j), c)
      lax.fori_loop(cta_lo, lo, release_block, None)
      if overlapped:
        carry += (plgpu.layout_cast(jnp.zeros((block_q, block_kv), dtype), common.WGMMA),
                  plgpu.layout_cast(jnp.ones((block_q,), jnp.float32), common.WGMMA_ROW))
        keep = lambda c: c
        carry = lax.cond(lo < hi, first_step, keep, carry)
        start = lo + 1  # (past hi when there is no tile: the loops below run zero times)
        carry = common.masked_loops(start, jnp.maximum(full_lo, start),
                                    jnp.maximum(full_hi, jnp.maximum(full_lo, start)), hi,
                                    overlapped_step, carry)
        if q_after_walk:  # every QK^T of the item is done (its softmax read it)
          next_q()
        carry = lax.cond(lo < hi, last_pv, keep, carry)[:3]
      else:
        carry = common.masked_loops(lo, full_lo, full_hi, hi,
                                    lambda j, c, masked: step(slot_of(j), j, c, masked=masked),
                                    carry)
        if q_after_walk:
          next_q()
      if q_after_last_qk:  # no QK^T at all (rows past the length, or no visible key)
        pl.when(hi <= lo)(next_q)
      lax.fori_loop(hi, cta_hi, release_block, None)
    if not overlapped:
      pl.when(wg == 0)(meet)
    elif not persistent:
      last_turn(wg)
    acc, m_i, l_i = carry

    rows = q_start + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0, layout=common.WGMMA_ROW)
    no_keys = l_i == 0.0
    safe_l = jnp.where(no_keys, 1.0, l_i)
    out = acc * common.broadcast_rows(1.0 / safe_l, acc.shape)
    # Natural-log lse; +inf marks rows that saw no key (see numerics).
    lse = jnp.where(no_keys | (rows >= q_length), numerics.EMPTY_LSE,
                    (m_i + jnp.log2(safe_l)) * common.LN2)
    out = out.astype(dtype)
    rows_out = (batch, pl.ds(q_start, block_q), head)
    out_columns = out_smem.shape[-1]  # (a persistent head_dim 256 forward: two halves in turn)
    for part in range(head_dim // out_columns):
      if persistent or part:  # the previous stores (this item's, or the last's) read the tile
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      columns = pl.ds(part * out_columns, out_columns)
      out_smem[...] = out[:, part * out_columns:(part + 1) * out_columns]
      if not part:
        lse_smem.at[wg][...] = lse
      plgpu.commit_smem()

      @pl.when(in_rows(q_start))
      def _store():
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[(*rows_out, columns)])
        if not part:
          plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                  lse_ref.at[batch, head, pl.ds(q_start, block_q)])
    if persistent:
      if not o_smem:  # the output went through the q tile: the next q waits for the store
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        next_q()
    elif cfg.read_only_store_wait:  # the stores have read q_smem / lse_smem: the CTA may retire
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    else:
      plgpu.wait_smem_to_gmem(0)

  if work_schedule is not None:
    _persistent(work_schedule, work_item, q_copy, consume, (first_turn, last_turn), cfg=cfg,
                num_q_tiles=num_q_tiles,
                produce=functools.partial(common.kv_copies, k_ref, v_ref, k_smem, v_smem, k_full,
                                          v_full, k_free, v_free, block_kv=block_kv,
                                          split=split_kv_refills))
    return

  batch = lax.axis_index("batch")
  head = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  work = work_item(batch, head,
                   lambda: common.tile_index("q_tiles", num_q_tiles, cfg.reverse_q_tiles))

  @pl.when(wg == cfg.compute_warpgroups)
  def _producer():
    common.produce_kv(k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free,
                      batch=batch, kv_head=work.kv_head, block_of=work.block_of,
                      num_blocks=work.num_blocks(), block_kv=block_kv, stages=stages,
                      registers=cfg.producer_registers, split=split_kv_refills)

  @pl.when(wg < cfg.compute_warpgroups)
  def _consumer():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")
    consume(wg, work)


def _persistent(work_schedule: _Schedule, work_item, q_copy, consume, turn_ends, *, produce,
                cfg: config_lib.KernelConfig, num_q_tiles: int):
  """The persistent grid's CTA (`cfg.persistent`): every warpgroup walks the CTA's work items
  (`work_schedule`) in the same order. The producer keeps one K/V ring across them (slot = its
  running count % stages, drained once at the end); each compute warpgroup carries the same
  count to find the slots, loads its first q before the walk and each next one from `consume`,
  and waits for its last output store at the end. The ping-pong meetings pair up within each
  item exactly as in a one-item CTA (warpgroup 1's offset meeting first, warpgroup 0's closing
  one last), and overlap_qk's turns alternate across the items (`turn_ends`: where the CTA's
  first turn is handed over and its last one taken)."""
  cta = lax.axis_index(_SM_AXIS)
  wg = lax.axis_index("wg")
  num_items = work_schedule.count(cta)

  def coords(step):
    """(batch, head, query tile) of this CTA's item `step`."""
    c = work_schedule.item(cta, step)
    q_tile = c["q_tiles"]
    if cfg.reverse_q_tiles:
      q_tile = num_q_tiles - 1 - q_tile
    return c["batch"], c["heads"], q_tile

  def item(step) -> _Work:
    batch, head, q_tile = coords(step)
    return work_item(batch, head, lambda: q_tile)

  @pl.when(wg == cfg.compute_warpgroups)
  def _producer():
    plgpu.set_max_registers(cfg.producer_registers, action="decrease")

    def produce_item(step, count):
      work = item(step)
      issue, wait_free = produce(batch=work.batch, kv_head=work.kv_head,
                                 block_of=work.block_of)
      return common.produce_ring(work.num_blocks(), cfg.stages, issue, wait_free, start=count)

    total = lax.fori_loop(0, num_items, produce_item, jnp.int32(0))
    _, wait_free = produce(batch=None, kv_head=None, block_of=None)  # (waits need no item)
    common.drain_ring(total, cfg.stages, wait_free)

  @pl.when(wg < cfg.compute_warpgroups)
  def _consumer():
    plgpu.set_max_registers(cfg.compute_registers, action="increase")

    def load_q(step):
      batch, head, q_tile = coords(step)
      q_copy(wg, batch, head, q_tile * cfg.rows_per_cta + wg * cfg.block_q)

    load_q(0)

    def consume_item(step, slot_base):
      work = item(step)
      next_q = lambda: pl.when(step + 1 < num_items)(lambda: load_q(step + 1))
      consume(wg, work, slot_base=slot_base, next_q=next_q)
      return slot_base + work.num_blocks()

    first_turn, last_turn = turn_ends
    first_turn(wg)
    lax.fori_loop(0, num_items, consume_item, jnp.int32(0))
    last_turn(wg)
    plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.read_only_store_wait)


def forward(q, k, v, q_lengths, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
            cfg: config_lib.KernelConfig, interpret: bool,
            mods: mods_lib.KernelMods = mods_lib.KernelMods(),
            mod_arrays: mods_lib.ModArrays = mods_lib.ModArrays(),
            table: block_table.BlockTable | None = None, kv_len: int | None = None):
  """q [B, T, Hq, D] with T a multiple of block_q; k, v [B, S, Hkv, D], S at least block_kv;
  `kv_len`: the keys' padded length, a multiple of block_kv from S (None: S), which the masks,
  the table and `mod_arrays` are padded to. A last key block that reaches past S is read as
  zeros there (TMA copies fill what lies past an array), keys that the lengths must hide.
  Lengths int32 [B] (clamped to the unpadded lengths); `mod_arrays` as `mods` says (segment ids
  padded like q and to kv_len). `table`: the key blocks each CTA visits
  (`block_table.query_major` at (cfg.block_q, cfg.block_kv)); None: the positional ranges.

  Returns out [B, T, Hq, D] (q.dtype) and lse [B, Hq, T] float32 (+inf on empty rows).
  """
  batch, q_len, heads_q, head_dim = q.shape
  heads_kv = k.shape[2]
  kv_len = k.shape[1] if kv_len is None else kv_len
  if kv_len % cfg.block_kv or not cfg.block_kv <= k.shape[1] <= kv_len:
    raise ValueError(f"the forward's padded key length ({kv_len}) must be a multiple of block_kv "
                     f"({cfg.block_kv}), and K's length ({k.shape[1]}) between block_kv and it")
  if table is not None and cfg.compute_warpgroups != config_lib.COMPUTE_WARPGROUPS:
    raise ValueError(f"a block table's entries are per CTA of {config_lib.COMPUTE_WARPGROUPS} "
                     f"query blocks; the forward was given compute_warpgroups="
                     f"{cfg.compute_warpgroups} (`KernelConfig.two_warpgroups`)")
  num_q_tiles = -(-q_len // cfg.rows_per_cta)  # (3 warpgroups: the last may be partly past)
  tile_blocks = _tile_blocks(spec, num_q_tiles, cfg, kv_len)
  cfg = cfg.for_tiles(tile_blocks)
  persistent = cfg.runs_persistent(tile_blocks)
  snake = persistent and cfg.snakes(tile_blocks, batch * heads_kv)
  if snake:  # heaviest first: a causal mask's later tiles see more keys
    cfg = dataclasses.replace(cfg, reverse_q_tiles=True, grid_order=(
        *(axis for axis in cfg.grid_order if axis != "tiles"), "tiles"))
  grid, grid_names = cfg.grid(heads=heads_q, tiles=num_q_tiles, batch=batch, tile_axis="q_tiles")
  work_schedule = None
  if persistent:
    # One CTA per SM walks the items of that grid (`_Schedule`).
    cfg = dataclasses.replace(cfg, persistent=True)
    paired = cfg.pair_q_tiles and num_q_tiles % 2 == 0 and not snake  # (odd: single tiles)
    units = tuple((name, size // 2 if paired and name == "q_tiles" else size)
                  for name, size in zip(grid_names, grid))
    num_ctas = INTERPRET_CTAS if interpret else num_sms()
    total = math.prod(size for _, size in units)
    work_schedule = _Schedule(units, min(num_ctas, total), num_q_tiles if paired else 0, snake)
    grid, grid_names = (work_schedule.num_ctas,), (_SM_AXIS,)
  kernel = functools.partial(_kernel, spec=spec, scale=scale, cfg=cfg, num_q_tiles=num_q_tiles,
                             num_kv_blocks=kv_len // cfg.block_kv, groups=heads_q // heads_kv,
                             mods=mods, work_schedule=work_schedule)
  # (The row max and row sum of the online softmax are its reductions.)
  return common.warp_specialized(
      kernel, lambda interp: scratch_types(cfg, head_dim, q.dtype, interp),
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((batch, heads_q, q_len), jnp.float32)),
      grid=grid, grid_names=grid_names, what=f"the forward kernel with {cfg}", reduces=True,
      interpret=interpret, compute_warpgroups=cfg.compute_warpgroups)(
          q, k, v, q_lengths, kv_lengths, mod_arrays, table)


def _tile_blocks(spec: mask_lib.MaskSpec, num_q_tiles: int, cfg: config_lib.KernelConfig,
                 kv_len: int) -> list[int]:
  """Key blocks each query tile visits at full lengths (the positional mask alone)."""
  return mask_lib.blocks_visited(mask_lib.kv_block_range, spec, num_q_tiles, cfg.rows_per_cta,
                                 cfg.block_kv, kv_len // cfg.block_kv)


def out_tile_columns(cfg: config_lib.KernelConfig, head_dim: int, dtype) -> int:
  """Columns of a persistent forward's own output tile in shared memory, so that the next q can
  load while this output is stored: head_dim where a whole [block_q, head_dim] tile a warpgroup
  fits beside the rest, else head_dim / 2 where a half does (head_dim 256: 64 KiB of q tiles
  and 128 KiB of K/V ring leave 32 KiB, and the output is stored in two column halves, the
  second written once the first's store has read the tile); 0 where neither fits, or not
  persistent: the output goes through the q tile."""
  if not cfg.persistent:
    return 0
  without = scratch_types(dataclasses.replace(cfg, persistent=False), head_dim, dtype, False)
  # (A half is a whole number of 64-column tiles: 128-byte swizzled rows of 2-byte elements.)
  for columns in (head_dim, head_dim // 2) if head_dim >= 128 else (head_dim,):
    if common.smem_bytes([*without, _out_tile(cfg, columns, dtype)]) <= config_lib.SMEM_BYTES:
      return columns
  return 0


def _out_tile(cfg: config_lib.KernelConfig, columns: int, dtype):
  return plgpu.SMEM((cfg.compute_warpgroups, cfg.block_q, columns), dtype,
                    transforms=common.TILE_TRANSFORMS)


def scratch_types(cfg: config_lib.KernelConfig, head_dim: int, dtype, interpret: bool) -> list:
  """The forward kernel's shared memory and barriers (the order `_kernel` takes them in)."""
  wgs = cfg.compute_warpgroups
  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=common.TILE_TRANSFORMS)
  out_columns = out_tile_columns(cfg, head_dim, dtype)
  return [
      tile(wgs, cfg.block_q, head_dim),  # q in, then o out (unless the next), per warpgroup
      tile(cfg.stages, cfg.block_kv, head_dim),  # k ring
      tile(cfg.stages, cfg.block_kv, head_dim),  # v ring
      plgpu.SMEM((wgs, cfg.block_q), jnp.float32),  # lse out
      # o out (persistent, when it fits: `out_tile_columns`)
      (_out_tile(cfg, out_columns, dtype),) if out_columns else (),
      common.staging_scratch(interpret, (wgs, cfg.block_q, cfg.block_kv), dtype),
      plgpu.Barrier(num_barriers=wgs),  # q loaded
      plgpu.Barrier(num_barriers=cfg.stages),  # k slot filled
      plgpu.Barrier(num_barriers=cfg.stages),  # v slot filled
      plgpu.Barrier(num_arrivals=wgs, num_barriers=cfg.stages),  # k slot free
      plgpu.Barrier(num_arrivals=wgs, num_barriers=cfg.stages),  # v slot free
      plgpu.Barrier(num_arrivals=wgs),  # ping-pong meetings
      # overlap_qk's ping-pong: each warpgroup's turn at the tensor cores
      (plgpu.Barrier(num_barriers=wgs),) if cfg.overlap_qk and cfg.ping_pong else (),
  ]
