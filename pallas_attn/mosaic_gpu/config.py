"""Tile sizes and pipeline depth of the Mosaic GPU kernels: one table, per (head_dim, pass).

`DEFAULTS` is the table the kernels use; edit it from `benchmarks/tune.py`'s results (every
entry there is one `KernelConfig`). `ops.attention` / `forward` / `backward` take `fwd_cfg`,
`dq_cfg` and `dkv_cfg` overrides, which is how the tuner builds its variants.

Shared-memory budget on Hopper: 227 KiB per CTA (`SMEM_BYTES`). Each kernel checks its real
footprint before it is built (`common.check_smem`: every scratch buffer rounded up to the 1 KiB
Mosaic GPU aligns it to, plus the barriers), so a variant either fits or says by how much it does
not. The arithmetic, bf16/f16 (2 bytes):
- forward: q/o tiles 2 * block_q * head_dim * 2, K and V rings 2 * stages * block_kv * head_dim * 2.
  head_dim 128, block_q 64, block_kv 128, 2 stages: 32 + 64 + 64 = 160 KiB; block_kv 192: 224 KiB
  (+ 1 KiB lse, 1 KiB barriers: fits). head_dim 256, block_kv 64, 2 stages: 64 + 128 = 192 KiB.
- dQ: q and dO tiles per compute warpgroup, the same K/V ring. head_dim 256 (`head_split`: one
  q and dO tile shared by both warpgroups): 64 KiB, and a two-slot ring of 128 KiB.
- dK/dV: K and V tiles per compute warpgroup, a ring of q/dO tiles (block_q rows each).
Registers bound the accumulators (232 per thread of a compute warpgroup; 160 with three compute
warpgroups, the head_dim 64 forward's: S 64, the accumulator 32, P 32): the forward's S tile
[64, block_kv] float32 takes block_kv / 2 registers per thread, the accumulator head_dim / 2; dQ
holds S, dP (block_kv / 2 each) and dQ (head_dim / 2); dK/dV holds dK and dV (head_dim / 2
each for a 64-row key tile) plus S^T and dP^T (block_q / 2 each), which is why head_dim 256
splits dK and dV by columns between the two warpgroups (`head_split`; before it, into two
launches: `split_dkv`).
"""

from __future__ import annotations

import dataclasses
import math
import types

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SMEM_BYTES = 227 * 1024
# Two warpgroups compute (each owns `block_q` query rows, or `block_kv` key rows in dK/dV); a third
# issues the TMA copies.
COMPUTE_WARPGROUPS = 2
PASSES = ("fwd", "dq", "dkv")
# The grid axes of every kernel: "tiles" is the kernel's own (query tiles in the forward and dQ
# kernels, key tiles in dK/dV).
GRID_AXES = ("heads", "tiles", "batch")


def launch_registers(compute_warpgroups: int) -> int:
  """Registers a thread of a CTA of `compute_warpgroups` + 1 warpgroups launches with: 65536 /
  (128 threads a warpgroup), rounded down to the multiple of 8 that setmaxnreg works in (168
  with three warpgroups, 128 with four). The warpgroups then trade them (`compute_registers`)."""
  return 65536 // (128 * (compute_warpgroups + 1)) // 8 * 8


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tile sizes of one kernel launch. block_q / block_kv are per compute warpgroup."""

  block_q: int
  block_kv: int
  stages: int = 2
  # Forward only: FlashAttention-3's ping-pong. The two compute warpgroups meet at a barrier
  # twice per key block, offset by one meeting, so one's softmax runs while the other's matmuls
  # hold the tensor cores; with overlap_qk they take turns instead (one wait, one hand-over a
  # step). Off in the table where overlap_qk is on: the turns cost more than they order,
  # except on rows of few blocks (`turns_max_blocks`).
  ping_pong: bool = True
  # dK/dV only: compute dV and dK in two launches (when both accumulators don't fit registers).
  split_dkv: bool = False
  # Forward only: FlashAttention-3's intra-warpgroup overlap. Each step issues tile j's QK^T and
  # tile j - 1's P V back to back (the accumulator added to in place) and runs tile j's softmax
  # while P V is on the tensor cores; with ping_pong, a warpgroup takes its turn at the tensor
  # cores once per step (one barrier each way, FA3's scheduler barriers). K slot j is freed once
  # S(j) is made and V slot j - 1 one step later; the producer refills K and V each on its own
  # release, so 2 stages keep a step of lead. The range walks only: a block table (segment ids)
  # is walked as without it, with the ping-pong meetings whatever `ping_pong` says.
  overlap_qk: bool = False
  # Forward and dQ: visit the query tiles last first. Under a causal mask the last tile sees the
  # most keys, so the heaviest CTAs start in the first wave and the tail wave is made of light
  # ones (FA3's causal scheduling). Harmless without a mask (every tile weighs the same).
  reverse_q_tiles: bool = False
  # Launch order of the grid, fastest-varying axis first (CUDA's x, y, z): a permutation of
  # GRID_AXES. The default keeps every head of one tile index together; ("tiles", "heads",
  # "batch") runs all tiles of one head together (they share K/V, or q/dO, in L2).
  grid_order: tuple[str, ...] = GRID_AXES
  # Forward only: on tiles whose logits are just scale * q.k^T (no soft-cap, bias, ALiBi or
  # score_fn, no element mask), skip scaling the tile: the row max is scaled instead and the
  # scale * log2(e) goes into exp2's argument as one fused multiply-add (s * c - m), as tokamax
  # and JAX's attention_mgpu do. Saves one multiply per logit (64 per thread per 64 x 128 tile).
  # On in the table's forward entries (`DEFAULTS`).
  fold_scale: bool = False
  # Forward only: the epilogue waits until its output/lse TMA stores have read shared memory,
  # not until they have landed in global memory (cp.async.bulk.wait_group.read, as tokamax and
  # CUTLASS epilogues do), so the CTA retires, and the next one starts, sooner.
  read_only_store_wait: bool = False
  # dK/dV only: the dK/dV kernel also makes dQ (FlashAttention-2/3's backward), so S and dP are
  # computed once per tile pair (5 matmuls instead of 7 with the separate dQ kernel). Each
  # compute warpgroup multiplies its dS^T tile (through shared memory, transposed) by its K tile
  # and adds the [block_q, head_dim] float32 product into a zeroed dQ in global memory with a
  # TMA reduce-add. Costs 2 * block_q * head_dim * 4 + 2 * block_kv * block_q * 2 bytes of shared
  # memory and a float32 dQ pass (zero, then scale and cast) outside the kernel. With
  # head_split (FlashAttention-3's head_dim 256 backward): each warpgroup multiplies the key
  # tile's dS (the dS^T tile the two share, read transposed) by its half of K's columns, the
  # wgmma issued behind its dK wgmma, and reduce-adds that [block_q, head_dim / 2] half (in
  # two quarters at head_dim 256); the float32 parts take 2 * block_q * head_dim / 2 * 4 bytes
  # (64 KiB at head_dim 256: only one stage of the q / dO ring fits beside them). H200, d256
  # fwd+bwd: 0.64-0.71x the table's separate head-split kernels (one stage alone 0.77-0.84x;
  # ~900-1400 B of spills a thread; benchmarks/NOTES.md session 16); off.
  fused_dq: bool = False
  # dK/dV with fused_dq, head_dim >= 128: FlashAttention-3's dQ layout. Each compute warpgroup
  # makes one half of dQ's columns, [block_q, head_dim / 2], from both warpgroups' dS^T tiles
  # (which meet in shared memory: the two warpgroups wait for each other once per query block)
  # times the matching columns of both K tiles. Half the dQ registers of plain fused_dq (whose
  # [block_q, head_dim] float32 part spills at head_dim 128) and half the reduce-add bytes per
  # warpgroup. Both warpgroups step every query block of the CTA's range: where a warpgroup's
  # keys see none of a block, its dS^T is zero (the masked step), one extra step per head at a
  # causal diagonal. H200, head_dim 128 (session 6): it spills more than plain fused_dq, not
  # less, and runs 0.96-1.03x the separate dQ kernel (benchmarks/NOTES.md); in the table at
  # head_dim 128's long rows with `dq_step_late`, which takes the warpgroups out of lockstep.
  dq_column_halves: bool = False
  # dK/dV with fused_dq: dQ's part split by rows instead, for head_dims whose columns do not
  # halve into whole 64-column tiles of K (head_dim 64): each warpgroup makes half of the query
  # block's rows, [block_q / 2, head_dim], from both warpgroups' dS^T tiles (their matching
  # columns, read transposed) times both whole K tiles. What the column halves save, in the
  # other direction: half the dQ registers and half the reduce-add bytes of plain fused_dq (at
  # head_dim 64, block_q 128: a [128, 64] float32 part, 32 KiB a warpgroup a step, twice head_dim
  # 128's bytes per FLOP), and the same meetings (with `dq_step_late`, a step late). Needs
  # block_q a multiple of 128 (halves of whole 64-row wgmma tiles).
  dq_row_halves: bool = False
  # Forward only: a persistent grid. One CTA per SM (NUM_SMS; a few in the interpreter) walks
  # the (batch, head, query tile) work items in `grid_order` (fastest axis first), CTA c taking
  # items c, c + #CTAs, ... (a static schedule; with `reverse_q_tiles` under a causal mask and
  # the tiles axis last, the heaviest tiles go first). What a CTA launch paid once per tile it
  # pays once per SM: the K/V ring runs on across tiles (its slot counter carries over, so the
  # next tile's first blocks load under this tile's last ones), each compute warpgroup loads its
  # next q tile right after its last QK^T of this one (or once its loops are done:
  # `next_q_after_walk`), and the output goes through its own shared-memory tile (when it fits
  # the 227 KiB; at head_dim 256 a half-width one, through which the output goes in two column
  # halves: `fwd.out_tile_columns`). A field of this frozen dataclass like the others, so it
  # keys jax's caches and the tuner can vary it.
  persistent: bool = False
  # Forward, persistent range walks: the next item's q load issued after the walk's loops
  # (before the last P V) instead of from inside the step that makes the last QK^T, which puts
  # a branch (`pl.when(j == hi - 1)`) in every step of the loops (in the table at head_dim 128 and
  # 256).
  next_q_after_walk: bool = False
  # Forward: the persistent grid where the query tiles visit few key blocks (whatever
  # `persistent` says): at most `persistent_max_blocks` on average where the tiles visit about
  # as many (the largest within 25% of the mean: no mask, a window), at most
  # `persistent_max_blocks_skewed` where they do not (causal). A tile of few blocks cannot
  # hide what a CTA launch costs (the q and first K/V loads, the pipeline's ramp, the epilogue's
  # stores) behind its own work, and the one CTA an SM holds idles the tensor cores through it;
  # a persistent CTA overlaps it with its previous item. Skewed tiles gain at longer rows too:
  # the one-tile grid leaves its heaviest causal tiles to the last wave, where `pair_q_tiles`
  # balances the CTAs' loads (H200: benchmarks/NOTES.md session 12). 0: off.
  persistent_max_blocks: int = 0
  persistent_max_blocks_skewed: int = 0
  # Forward, persistent, where the query tiles are skewed (causal): a work unit is the query
  # tiles T - 1 - t and t of one (batch, head) (`fwd._Schedule`), so all units weigh the same
  # (T + 1 tiles' worth of key blocks) and the static schedule stays balanced. Where T is odd,
  # single tiles; without a persistent grid, nothing. Not where the tiles weigh the same
  # (`for_tiles`): there a pair walks its head's K/V twice, one tile after the other, and with
  # the heads axis fastest only two CTAs stream a head's K/V at once instead of its T tiles'
  # CTAs, so the second walk tends to miss L2 (H100, head_dim 256 N 512 / 1024: 1.12 / 1.03x
  # without the pairs, d128 N 512 1.02x, 1.00x elsewhere; benchmarks/NOTES.md session 33).
  pair_q_tiles: bool = False
  # Forward, persistent, where the query tiles are skewed (causal) and the call has at most
  # this many (batch, kv head) pairs (0: never): units are single tiles numbered heaviest first
  # (the q tiles axis slowest and reversed, the other axes in grid_order), and the rounds
  # alternate direction: CTA c takes unit r * C + c in even rounds r and r * C + C - 1 - c in
  # odd ones, so a CTA that got a heavier tile in one round gets a lighter one in the next.
  # Pairs make 1024 equal units of the sweep's shapes (batch x N = 16384, 128-row tiles), 7.76
  # rounds over 132 CTAs whose last one is three quarters full (3% of the makespan); the
  # snake's loads differ by about one tile's spread a round. The bound: a heaviest-first round
  # spreads its 132 CTAs over every (batch, kv head), so past ~32 of them each K/V is streamed
  # by too few CTAs at once to be read from L2 (H100, d128 causal b8 N 2048, 128 of them: 0.68x
  # the pairs; benchmarks/NOTES.md session 30). Overrides pair_q_tiles where it applies.
  snake_max_kv_heads: int = 0
  # Forward with overlap_qk and two compute warpgroups: the ping-pong's turns on (whatever
  # `ping_pong` says) where the query tiles visit about as many key blocks each (no mask, a
  # window: not skewed) and at most this many on average (`for_tiles`). Without turns the two
  # warpgroups start a tile together, both on a first softmax with no P V beneath it, and end
  # it together on a last P V with no softmax beside it: about one softmax of idle tensor
  # cores a tile, which a persistent item of few blocks does not amortize; the turns keep the
  # warpgroups a half step apart across items. H200, head_dim 128 not causal: 1.04-1.09x at N
  # 512-2048 (4-16 blocks), 0.98-1.00x from 4096; causal 0.97-1.01x (benchmarks/NOTES.md
  # session 32). 0: never.
  turns_max_blocks: int = 0
  # dQ and dK/dV, head_dim 256 (and 128): both compute warpgroups share one tile of block_q
  # query rows (dQ) or block_kv key rows (dK/dV); warpgroup 0 makes S, P and dS, warpgroup 1 dP,
  # the tiles meeting in shared memory, and each accumulates one half of the accumulators'
  # columns ([64, head_dim / 2] float32 each: `head_split`). dK/dV: four matmuls per tile pair in
  # one launch, where `split_dkv`'s two launches make five with [64, 256] accumulators that
  # spill; dQ: the [64, 256] dQ accumulator beside S and dP spills.
  head_split: bool = False
  # With head_split: warpgroup 1 makes the next block's dP (dP^T) during this block, before it
  # waits for warpgroup 0's dS, so its matmul runs while warpgroup 0 is on the CUDA cores
  # (softmax, dS) instead of after. 32 more registers in warpgroup 1; needs stages >= 2 (the
  # next ring slot is read before this one is freed). H200, d256: 0.91-0.97x the plain head split
  # (benchmarks/NOTES.md session 9); off.
  dp_ahead: bool = False
  # head_split with fused_dq: dO in a ring of its own of one slot, which both warpgroups free
  # once their dV wgmma read it (mid-step: the next block's dO loads under dS^T, dK and dQ), and
  # the float32 dQ parts through one tile a warpgroup instead of two: the 64 KiB that pay for a
  # second stage of the q ring (q is read first, by S^T, and last, by dK: one slot keeps the
  # next block's load from starting before both warpgroups end the step). FA3's head_dim 256
  # backward: q in two stages, dO in one. Needs stages >= 2.
  one_do_slot: bool = False
  # head_split with fused_dq: each warpgroup's last dQ part of a step goes to its float32 tile
  # and out while the next step's first wgmma (S^T, dP^T) runs, carried in registers (32 a
  # thread) until then. With one tile a warpgroup (one_do_slot), a step's second part otherwise
  # waits for the first part's reduce-add to have read the tile, behind one [64, 64] dQ wgmma:
  # ~10% of the fused kernel's stall samples, ~9% of its time (H200, benchmarks/NOTES.md
  # session 25); here that wait has the next step's first wgmma to hide in.
  defer_last_dq_part: bool = False
  # Registers per thread of each compute warpgroup (setmaxnreg); the producer warpgroup keeps
  # what they leave of the launch's (`launch_registers`): of 3 * 168, 40 at 232 (tokamax's and
  # JAX's examples' split), 24 at 240 (FlashAttention-3's for two consumer warpgroups); of 4 *
  # 128 with three compute warpgroups, 32 at 160. H200: 240 lowers the spills of the kernels
  # that spill but is within the noise in speed (session 9).
  compute_registers: int = 232
  # The tiles every step's wgmmas read the same (the forward's q tile, QK^T's A operand; dK/dV:
  # this warpgroup's K and V for S^T and dP^T, with fused_dq the K tiles dQ reads; the
  # head-split dQ kernel's q and dO; the plain dQ kernel ignores it) indexed through
  # `common.per_step_index`, so that their wgmma descriptors are built in the step instead of
  # hoisted out of the walk. Hoisted, the d128 fused dK/dV/dQ kernel holds 24 of them (64-bit
  # each) across the walk and ptxas spills them, reloading before each S^T group (228 B
  # stored, 360 B loaded a thread; the same PTX with them rebuilt at their wgmmas: 8 / 20 B).
  # H200: on in head_dim 128's fused kernel (no spills left; fwd+bwd 1.04-1.11x); the separate
  # dK/dV kernel (0.94-1.00x), head_dim 64's fused one (0.94-1.03x) and head_dim 256's head
  # split (0.97-0.99x) are slower with it; the fused head split is 1.2x faster with it but
  # still 0.71-0.83x the table; the d128 forward 1.01-1.03x non-causal, 0.95-0.99x causal
  # (it does not spill either way), and block_kv 192's spills stay (benchmarks/NOTES.md
  # sessions 20-22).
  tile_descriptors_in_step: bool = False
  # Forward only: compute warpgroups a CTA (2 or 3), each owning `block_q` query rows, over one
  # K/V ring. FlashAttention-3's head_dim 64 forward takes 3 (192-row tiles): where a tile's
  # softmax takes longer than its two matmuls, two warpgroups leave the tensor cores idle while
  # both are on the CUDA cores, and a third keeps them fed. The four warpgroups launch with 128
  # registers a thread (`compute_registers` at most 160 with 3), without the ping-pong (its
  # meetings pair two warpgroups) and without a block table (its entries are per pair); q
  # tiles past the rows of the array skip (a CTA's last tile may be partly past them).
  compute_warpgroups: int = 2
  # dK/dV with fused_dq, and the head-split kernels: the float32 tiles written from registers
  # (the dQ part before its reduce-add; dP handed between the warpgroups) get the 128-byte
  # swizzle (`common.F32_TILE_TRANSFORMS`) instead of a plain row-major layout whose rows all
  # start in the same bank. H200: no measurable effect (session 9); off.
  swizzle_f32: bool = False
  # dQ and dK/dV (not head_split): issue dP's wgmma right behind S's and wait for S alone, so the
  # mask, the modifiers and exp2 of P run on the CUDA cores while dP is on the tensor cores
  # (FlashAttention-3's overlap inside a warpgroup; the two accumulators were live together
  # already). Without it each wgmma is awaited before the next is issued. On at head_dim 128
  # (`DEFAULTS`); at 64, where dK/dV makes dQ too, the extra live tile costs more than it saves.
  co_issue_dp: bool = False
  # dK/dV (not head_split): dV's and dK's wgmmas of a step issued together after dS is made, and
  # awaited once, instead of dV's awaited before dS is computed.
  co_issue_dkv: bool = False
  # dK/dV with fused_dq: the dQ wgmma is issued right behind dK's (and dV's, with co_issue_dkv),
  # and they are awaited once. The dS^T tile is written to shared memory, and with
  # dq_column_halves (or dq_row_halves) the warpgroups meet, while dK's wgmma runs; without it
  # dK's wgmma is awaited before dS^T is written, and dQ's before the step goes on. On at
  # head_dim 64 with co_issue_dkv (H200, fwd+bwd 1.03-1.08x; benchmarks/NOTES.md session 13); at
  # 128 with the column halves and `dq_step_late` (alone, the fused kernels are no faster than the
  # separate dQ kernel there).
  co_issue_dq: bool = False
  # dK/dV with dq_column_halves (or dq_row_halves) and co_issue_dq: each step's dQ wgmmas take
  # both warpgroups' dS^T tiles of the step before, written a step ago (a two-slot dS^T ring of
  # their own), not this step's, so neither warpgroup waits at a step for the other's dS^T of
  # that step: meeting every step holds the two in lockstep, both on the CUDA cores (P^T, dS^T)
  # at once while the tensor cores idle. They may now drift apart by up to a step. The last
  # step's dQ is made after the walk.
  dq_step_late: bool = False
  # dQ (not head_split): each step's dQ += dS K wgmma (dS through one of two shared-memory tiles
  # per warpgroup) is left running into the next step, whose S (and dP) wgmmas are issued behind
  # it; the next step's first wait covers it, and only then is its K slot released. Without it
  # the warpgroup waits for dQ's wgmma before it issues the next S. Needs stages >= 2. H200,
  # d128 fwd+bwd: 0.91-0.96x (benchmarks/NOTES.md session 10); off.
  dq_in_flight: bool = False
  # dQ (not head_split): FlashAttention-3's intra-warpgroup overlap, as `overlap_qk` in the
  # forward. Step j issues its S and dP wgmmas, then the step before's dQ += dS(j - 1) K(j - 1)
  # (dS kept in registers), and runs its softmax and dS on the CUDA cores while that dQ wgmma
  # is on the tensor cores (without it, the warpgroup's own CUDA-core work waits for its dQ
  # wgmma, and only the other warpgroup's wgmmas fill the gap). S and dP are issued together
  # (as `co_issue_dp`). K(j - 1)'s slot is free only at step j's end: with 2 stages the
  # producer loads block j + 1 into it only then, 3 leave it a step of lead. H200, d128
  # fwd+bwd: 0.95-1.00x with 3 stages, 0.86-0.97x with 2 (the table's kernels already spill;
  # benchmarks/NOTES.md session 18); off.
  overlap_dq: bool = False
  # dK/dV (not fused_dq, head_split or split_dkv): the same overlap in the dK/dV kernel. Step j
  # issues its S^T and dP^T wgmmas, then the step before's dK += dS^T q (dS^T kept in
  # registers: 16 more a thread), makes P^T and issues its own dV += P^T dO, and makes dS^T
  # while those two are on the tensor cores. The step before's ring slot is free only at step
  # j's end (stages >= 2; 3 leave the producer a step of lead). H200, d128 fwd+bwd at 240
  # registers: 0.91-0.99x (it spills 284-324 bytes a thread; deferring dV too spilled 360-600:
  # 0.76-0.94x; benchmarks/NOTES.md session 18); off.
  overlap_dkv: bool = False
  # dQ (not head_split): the warpgroup's q and dO tiles, read once for all its key blocks, are
  # loaded into registers and are the A operands of S's and dP's wgmmas, which then read only
  # K and V from shared memory. Both read A and B from shared memory otherwise: at wgmma N 64
  # (block_kv 64) those operand reads alone take all of shared memory's 128 B a clock at the
  # tensor cores' rate (benchmarks/NOTES.md session 14). Costs head_dim / 2 registers a thread
  # (q and dO in bf16: 64 at head_dim 128). The interpreter runs the same products from shared
  # memory (it has no register operands). H200, head_dim 128 fwd+bwd: 1.00-1.01x, no spills
  # (those bytes are not what bounds the kernel; benchmarks/NOTES.md session 14); off.
  dq_lhs_in_registers: bool = False
  # Forward only: the last `exp2_fma_cols` columns of each [block_q, block_kv] score tile get
  # their exp2 from a polynomial on the FMA pipe (`exp2.exp2_fma`) instead of the SFU
  # (FlashAttention-4's trick), meant to relieve the SFU's 16 exponentials a clock at head_dim
  # 64. A multiple of 8 (whole registers of the WGMMA layout), at most block_kv; 0: every exp2 on
  # the SFU. H200 (session 11): 0.88-0.99x at d64 and d128, slower with every column moved; off.
  exp2_fma_cols: int = 0
  # dK/dV with fused_dq: where its key tiles visit skewed counts of query blocks (causal)
  # averaging at most this many, the backward runs the separate dQ kernel instead, with this
  # dK/dV config unfused (`backward_configs`). Such rows are short, and the fused dQ's passes
  # around its kernel (the float32 dQ zeroed, then scaled and cast: 10 bytes a dQ element
  # whatever the length) and its key tiles' few steps weigh more than the two matmuls a tile
  # pair it saves. H200, head_dim 64, causal N 512 / 1024 / 2048 (2.5 / 4.5 / 8.5 blocks on
  # average): the separate kernels 1.17 / 1.11 / 1.03x the fused one; not causal 0.89-0.99x
  # (benchmarks/NOTES.md session 14). 0: always fused. (Without fused_dq: nothing.)
  separate_dq_max_blocks_skewed: int = 0
  # The same where the key tiles visit about as many query blocks each (no mask, a window).
  # H200, head_dim 128, the fused dQ in column halves a step late (descriptors in the step)
  # over the separate kernels: 1.00x at N 512 (8 blocks), 1.04-1.11x at 1024-8192 (16-128);
  # causal 0.97x at N 512 (4.5 on average), 1.00-1.11x at 1024-8192 (benchmarks/NOTES.md
  # session 20; before the descriptors, session 15: 0.85-0.98x below N 4096).
  separate_dq_max_blocks: int = 0
  # dK/dV only: CTAs a kv head's query-head group is split over, each walking
  # groups / group_parts of the group's heads and writing its own dK / dV partial sums (in k's
  # dtype, FlashAttention-2's per-head dK / dV at group_parts = groups) that one XLA fusion adds
  # up in float32 after the kernel (gcd(group_parts, groups) where the group does not divide:
  # 1 without GQA). Meant for long GQA rows, whose backward runs ~6% slower per FLOP than MHA's
  # at N 16384 (H100, session 39). The first suspect: one CTA walking the whole group lets the
  # CTAs of a kv head drift apart by 2 steps per head walked (the causal key tiles' walks differ
  # by 2 query blocks), so the q / dO tiles and dQ lines they share leave L2 before the next CTA
  # reads them. H100, Nsight Compute at N 16384 causal, 32 / 8 heads against 16 / 16: the
  # same kernel at 60.9 against 64.9% tensor-active, L2's load hit rate 82 against 95%, 4.4x the
  # DRAM bytes a FLOP; at 4 parts (one head a CTA) fwd+bwd 1.04-1.07x the whole group in two
  # tuner calls, 1.00-1.01x at N 4096 (benchmarks/NOTES.md session 40).
  # The head split's dK/dV kernel (head_dim 256) takes the same layout: H100, causal 16 / 4 and
  # 16 / 8 heads at N 8192 / 16384, one head a CTA fwd+bwd 1.12-1.23x the whole group (session 43).
  # 1: the whole group in one CTA, summed in registers (unless `group_split_min_blocks`).
  group_parts: int = 1
  # With group_parts 1: one query head a CTA (group_parts = the group) where the key tiles'
  # walks are skewed (causal) and visit at least this many query blocks on average; the
  # partials' bytes (the group's dK / dV written, read and added) weigh less the longer the walk.
  # 0: never.
  group_split_min_blocks: int = 0

  def group_parts_for(self, groups: int, key_tile_blocks=()) -> int:
    """The CTAs each kv head's `groups` query heads are split over, its key tiles visiting
    `key_tile_blocks` query blocks each (`group_parts`, `group_split_min_blocks`)."""
    if self.group_parts == 1 and self.group_split_min_blocks:
      mean, skewed = _mean_and_skew(key_tile_blocks)
      if skewed and mean >= self.group_split_min_blocks:
        return groups
    return math.gcd(self.group_parts, groups)

  def runs_persistent(self, tile_blocks) -> bool:
    """Whether the forward takes the persistent grid, its query tiles visiting `tile_blocks`
    key blocks each (a sequence of ints)."""
    if self.persistent:
      return True
    mean, skewed = _mean_and_skew(tile_blocks)
    if mean is None:
      return False
    return mean <= (self.persistent_max_blocks_skewed if skewed else self.persistent_max_blocks)

  def for_tiles(self, tile_blocks) -> "KernelConfig":
    """This forward config for query tiles visiting `tile_blocks` key blocks each: the tile
    pairs only where the tiles are skewed (`pair_q_tiles`), the ping-pong's turns where
    `turns_max_blocks` says."""
    mean, skewed = _mean_and_skew(tile_blocks)
    cfg = self
    if cfg.pair_q_tiles and not skewed:
      cfg = dataclasses.replace(cfg, pair_q_tiles=False)
    if (not cfg.overlap_qk or cfg.ping_pong or cfg.compute_warpgroups != COMPUTE_WARPGROUPS
        or mean is None or skewed or mean > cfg.turns_max_blocks):
      return cfg
    return dataclasses.replace(cfg, ping_pong=True)

  def snakes(self, tile_blocks, kv_heads: int) -> bool:
    """Whether the persistent forward walks `tile_blocks` in `snake_max_kv_heads`'s schedule,
    its call having `kv_heads` (batch, kv head) pairs."""
    return kv_heads <= self.snake_max_kv_heads and _mean_and_skew(tile_blocks)[1]

  @property
  def dq_halves(self) -> bool:
    """Whether each warpgroup makes half of the fused dQ part from both warpgroups' dS^T tiles
    (`dq_column_halves` or `dq_row_halves`): the warpgroups meet for them."""
    return self.dq_column_halves or self.dq_row_halves

  def dq_part_shape(self, head_dim: int) -> tuple[int, int]:
    """The fused dQ part a warpgroup makes a step and sends out by reduce-add, [rows, columns]:
    half the query block's rows with `dq_row_halves`, half of head_dim with `dq_column_halves`,
    else the whole [block_q, head_dim]."""
    return (self.block_q // 2 if self.dq_row_halves else self.block_q,
            head_dim // 2 if self.dq_column_halves else head_dim)

  def fuses_dq(self, key_tile_blocks) -> bool:
    """Whether the backward makes dQ in this dK/dV config's kernel, its key tiles visiting
    `key_tile_blocks` query blocks each (`separate_dq_max_blocks_skewed`)."""
    if not self.fused_dq:
      return False
    mean, skewed = _mean_and_skew(key_tile_blocks)
    if mean is None:
      return True
    return mean > (self.separate_dq_max_blocks_skewed if skewed else self.separate_dq_max_blocks)

  @property
  def producer_registers(self) -> int:
    wgs = self.compute_warpgroups
    return (wgs + 1) * launch_registers(wgs) - wgs * self.compute_registers

  def two_warpgroups(self) -> "KernelConfig":
    """This config with two compute warpgroups (what a block-table walk takes)."""
    if self.compute_warpgroups == COMPUTE_WARPGROUPS:
      return self
    return dataclasses.replace(self, compute_warpgroups=COMPUTE_WARPGROUPS,
                               compute_registers=KernelConfig.compute_registers)

  @property
  def rows_per_cta(self) -> int:
    """Query rows a forward (or dQ) CTA owns: block_q per compute warpgroup."""
    return self.compute_warpgroups * self.block_q

  def __post_init__(self):
    if self.block_q % 64 or self.block_kv % 64 or not (self.block_q and self.block_kv):
      raise ValueError(f"block_q ({self.block_q}) and block_kv ({self.block_kv}) must be "
                       f"positive multiples of 64 (the wgmma tile height)")
    if self.group_parts < 1:
      raise ValueError(f"group_parts must be >= 1, got {self.group_parts}")
    if self.group_split_min_blocks < 0:
      raise ValueError(f"group_split_min_blocks must be >= 0, got {self.group_split_min_blocks}")
    if self.block_kv > 256:
      raise ValueError(f"block_kv ({self.block_kv}) must be at most 256 (the wgmma width)")
    if self.stages < 1:
      raise ValueError(f"stages must be >= 1, got {self.stages}")
    if self.overlap_qk and self.stages < 2:
      raise ValueError(f"overlap_qk needs stages >= 2 (V slot j - 1 is freed after tile j's K "
                       f"slot is waited for), got stages={self.stages}")
    if self.fused_dq and self.split_dkv:
      raise ValueError("fused_dq needs dK and dV from one launch (split_dkv=False)")
    if self.head_split and (self.split_dkv or self.dq_halves or self.co_issue_dq
                            or self.dq_step_late):
      raise ValueError("head_split is a layout of its own: it takes no split_dkv, "
                       "dq_column_halves, dq_row_halves, co_issue_dq or dq_step_late (its fused "
                       "dQ is made in column halves, issued behind dK's wgmma, already)")
    if self.one_do_slot and not (self.head_split and self.fused_dq and self.stages >= 2):
      raise ValueError(f"one_do_slot is an option of head_split with fused_dq and stages >= 2 "
                       f"(a second q stage beside one dO slot), got head_split={self.head_split}, "
                       f"fused_dq={self.fused_dq}, stages={self.stages}")
    if self.defer_last_dq_part and not (self.head_split and self.fused_dq):
      raise ValueError(f"defer_last_dq_part is an option of head_split with fused_dq, got "
                       f"head_split={self.head_split}, fused_dq={self.fused_dq}")
    if self.head_split and self.fused_dq and self.dp_ahead:
      raise ValueError("head_split with fused_dq takes no dp_ahead (warpgroup 1's dQ part needs "
                       "the query block and head that its dp_ahead loop does not walk)")
    if self.dp_ahead and not (self.head_split and self.stages >= 2):
      raise ValueError(f"dp_ahead is a head_split option and needs stages >= 2, got "
                       f"head_split={self.head_split}, stages={self.stages}")
    if self.dq_lhs_in_registers and self.head_split:
      raise ValueError("dq_lhs_in_registers is a layout of the plain dQ kernel, not of "
                       "head_split")
    if self.dq_in_flight and self.head_split:
      raise ValueError("dq_in_flight is a layout of the plain dQ kernel, not of head_split")
    if self.dq_in_flight and self.stages < 2:
      # (A K slot is released at the next step's first wait, which needs the next block loaded:
      # with one slot that block waits for the release.)
      raise ValueError(f"dq_in_flight needs stages >= 2, got stages={self.stages}")
    if self.overlap_dq and (self.head_split or self.dq_in_flight):
      raise ValueError("overlap_dq is a layout of the plain dQ kernel, without head_split or "
                       "dq_in_flight")
    if self.overlap_dq and self.stages < 2:
      # (Block j's K is read until step j + 1's end; with one slot, block j + 1 waits for it.)
      raise ValueError(f"overlap_dq needs stages >= 2, got stages={self.stages}")
    if self.overlap_dkv and (self.fused_dq or self.head_split or self.split_dkv):
      raise ValueError("overlap_dkv is a layout of the plain dK/dV kernel, without fused_dq, "
                       "head_split or split_dkv")
    if self.overlap_dkv and self.stages < 2:  # (as overlap_dq's, for block j's q)
      raise ValueError(f"overlap_dkv needs stages >= 2, got stages={self.stages}")
    if self.exp2_fma_cols % 8 or not 0 <= self.exp2_fma_cols <= self.block_kv:
      raise ValueError(f"exp2_fma_cols must be a multiple of 8 from 0 to block_kv "
                       f"({self.block_kv}), got {self.exp2_fma_cols}")
    if min(self.separate_dq_max_blocks, self.separate_dq_max_blocks_skewed) < 0:
      raise ValueError(f"separate_dq_max_blocks ({self.separate_dq_max_blocks}) and "
                       f"separate_dq_max_blocks_skewed ({self.separate_dq_max_blocks_skewed}) "
                       f"must be >= 0")
    if self.co_issue_dq and not self.fused_dq:
      raise ValueError("co_issue_dq issues the fused dQ's wgmma: it needs fused_dq=True")
    if self.dq_step_late and not (self.dq_halves and self.co_issue_dq):
      raise ValueError("dq_step_late is a layout of the fused dQ in halves with its wgmma "
                       "co-issued: it needs dq_column_halves=True or dq_row_halves=True, and "
                       "co_issue_dq=True")
    for halves in ("dq_column_halves", "dq_row_halves"):
      if getattr(self, halves) and not self.fused_dq:
        raise ValueError(f"{halves} is a layout of the fused dQ: it needs fused_dq=True")
    if self.dq_column_halves and self.dq_row_halves:
      raise ValueError("dq_column_halves and dq_row_halves are two layouts of the fused dQ: "
                       "take one")
    if self.dq_row_halves and self.block_q % 128:
      raise ValueError(f"dq_row_halves needs block_q a multiple of 128 (two halves of whole "
                       f"64-row tiles), got block_q {self.block_q}")
    if self.compute_warpgroups not in (2, 3):
      raise ValueError(f"compute_warpgroups must be 2 or 3, got {self.compute_warpgroups}")
    if self.compute_warpgroups == 3 and self.ping_pong:
      raise ValueError("compute_warpgroups=3 takes no ping_pong (its meetings pair two "
                       "warpgroups): set ping_pong=False")
    wgs, launch = self.compute_warpgroups, launch_registers(self.compute_warpgroups)
    if (self.compute_registers % 8 or self.compute_registers < launch
        or self.producer_registers < 24):
      raise ValueError(f"compute_registers must be a multiple of 8 from {launch} to "
                       f"{((wgs + 1) * launch - 24) // wgs // 8 * 8} with {wgs} compute "
                       f"warpgroups (the producer keeps at least 24), got "
                       f"{self.compute_registers}")
    if self.turns_max_blocks < 0:
      raise ValueError(f"turns_max_blocks must be >= 0, got {self.turns_max_blocks}")
    if self.snake_max_kv_heads < 0:
      raise ValueError(f"snake_max_kv_heads must be >= 0, got {self.snake_max_kv_heads}")
    if min(self.persistent_max_blocks, self.persistent_max_blocks_skewed) < 0:
      raise ValueError(f"persistent_max_blocks ({self.persistent_max_blocks}) and "
                       f"persistent_max_blocks_skewed ({self.persistent_max_blocks_skewed}) "
                       f"must be >= 0")
    if sorted(self.grid_order) != sorted(GRID_AXES):
      raise ValueError(f"grid_order must be a permutation of {GRID_AXES}, got "
                       f"{self.grid_order}")

  def grid(self, *, heads: int, tiles: int, batch: int, tile_axis: str):
    """plgpu.kernel's (grid, grid_names) in `grid_order`, the "tiles" axis named `tile_axis`."""
    sizes = {"heads": heads, "tiles": tiles, "batch": batch}
    names = tuple(tile_axis if axis == "tiles" else axis for axis in self.grid_order)
    return tuple(sizes[axis] for axis in self.grid_order), names


def _mean_and_skew(tile_blocks) -> tuple[float | None, bool]:
  """(mean, skewed) of the blocks each tile of a grid visits (mean None: no tiles); skewed:
  the largest is over 1.25x the mean (a causal mask; not a window, nor no mask)."""
  if not len(tile_blocks):
    return None, False
  mean = sum(tile_blocks) / len(tile_blocks)
  return mean, max(tile_blocks) > 1.25 * mean


# The dK/dV fields that make dQ in its kernel, off: what `backward_configs` changes where the
# separate dQ kernel runs (and the tuner's variants that start from the unfused kernel). The
# separate dK/dV kernel keeps its descriptors hoisted: H200, 0.94-1.00x with them in the step at
# head_dim 128 though it stops spilling, 0.97-0.99x at 256 (benchmarks/NOTES.md sessions 20, 21).
UNFUSED_DQ = types.MappingProxyType(dict(
    fused_dq=False, co_issue_dq=False, dq_column_halves=False, dq_row_halves=False,
    dq_step_late=False, one_do_slot=False, defer_last_dq_part=False,
    tile_descriptors_in_step=False,
    separate_dq_max_blocks=0, separate_dq_max_blocks_skewed=0))


def separate_dq(dq_cfg: KernelConfig, dkv_cfg: KernelConfig) -> tuple[KernelConfig, KernelConfig]:
  """(dQ config, dK/dV config) of a backward that makes dQ in the dQ kernel: the two given where
  dkv_cfg does not fuse dQ, else dkv_cfg unfused in dq_cfg's tiles and stages and with its dP
  co-issue and register split (the two kernels then share one block table).

  It is also the deterministic backward (`attention(deterministic_backward=True)`): the fused
  dQ is summed in float32 by TMA reduce-adds from every key tile's CTA, in whatever order the
  CTAs reach a query block, so its rounding (and dQ's bits) can differ from run to run. The
  separate dQ kernel sums a query tile's key blocks in registers in a fixed order, and the
  dK/dV kernel its query blocks (and a kv head's query-head group) likewise."""
  if not dkv_cfg.fused_dq:
    return dq_cfg, dkv_cfg
  return dq_cfg, dataclasses.replace(
      dkv_cfg, **UNFUSED_DQ, block_q=dq_cfg.block_q, block_kv=dq_cfg.block_kv,
      stages=dq_cfg.stages, co_issue_dp=dq_cfg.co_issue_dp,
      compute_registers=dq_cfg.compute_registers)


def backward_configs(dq_cfg: KernelConfig, dkv_cfg: KernelConfig,
                     key_tile_blocks) -> tuple[KernelConfig, KernelConfig]:
  """(dQ config, dK/dV config) of the backward, the key tiles of dkv_cfg visiting
  `key_tile_blocks` query blocks each: the two given, or where dkv_cfg is fused but
  `fuses_dq` says not here, their `separate_dq` form."""
  if not dkv_cfg.fused_dq or dkv_cfg.fuses_dq(key_tile_blocks):
    return dq_cfg, dkv_cfg
  return separate_dq(dq_cfg, dkv_cfg)


# SMs of an H100 / H200 SXM: the CTAs of a persistent forward (`KernelConfig.persistent`) when no
# GPU is present to ask (lowering for CUDA on a CPU); split_kv sizes its waves with it too.
NUM_SMS = 132


# (head_dim, pass) -> the tiles the kernels use. Forward: the largest key block whose K/V ring
# fits beside the two q tiles with 2 stages. dQ and dK/dV: 64 x 64 tiles keep S, dP and the
# accumulators of a warpgroup in registers; at head_dim 256 single-slot rings (see the module
# docstring) and dK, dV in two launches.
# Forward: fold_scale on (H200, d128, N 4096 / 16384, causal and not: 1.01-1.03x the unfolded
# kernel in one tuner run, above the default's re-run at every shape; benchmarks/NOTES.md
# session 7). The unfolded path still serves soft-caps, biases, ALiBi and score functions.
# head_dim 128 and 256 forward: FA3's intra-warpgroup overlap, each warpgroup on its own (no
# ping-pong turns: the two warpgroups' wgmma pairs interleave at the tensor cores by themselves).
# H200, one tuner run each: d128 1.06-1.10x the ping-pong forward at N 4096 / 16384, causal and
# not (653 TFLOP/s at N 16384), twice; with the turns 1.03-1.07x; d256 1.14-1.19x. At head_dim 64,
# whose tiles are softmax-bound, it is 0.87-0.93x: not used there (benchmarks/NOTES.md session 10).
# Forward, all head dims: the persistent grid (tile pairs on causal rows) where the query tiles
# visit few key blocks (H200, one tuner run over the FlashAttention sweep, N 512-16384; ratios to
# the one-tile grid): head_dim 64 1.36-1.04x up to 32 blocks of 128 keys (N 4096), 0.98-0.99 beyond;
# head_dim 128 1.22-1.04x up to 16 (N 2048), 0.94-0.99 beyond. Causal (skewed) tiles: 1.38-1.03x up
# to 32.5 blocks on average at every head dim, 1.01 at 64.5: up to 48 (benchmarks/NOTES.md session
# 12). head_dim 256, whose output goes out in two column halves through a half-width tile (a whole
# one does not fit; through the q tile, session 12's 0.87-0.97x): 1.05 / 1.03x at N 512 / 1024 (8 /
# 16 blocks of 64 keys), 0.91-0.99 beyond; causal 1.10-1.11x at N 512-2048 and 1.08 / 1.06 / 1.04x
# at 4096 / 8192 / 16384 (32.5-128.5 blocks): up to 160 (session 17). Non-causal rows walk single
# tiles there since session 33 (`pair_q_tiles`; H100, d256 N 512 1.12x).
# head_dim 128 forward: the persistent walk loads each next q after its loops
# (`next_q_after_walk`; a branch in every step otherwise), and causal rows up to 100 key blocks a
# tile on average go persistent (N 16384's 64.5; N 32768's 128.5 not measured). H200, two tuner
# runs: causal 1.03-1.05x at N 2048-8192 (already persistent) and 1.04-1.05x at N 16384 over the
# one-tile grid; non-causal rows where the table is persistent 0.98-1.00x (benchmarks/NOTES.md
# session 24). head_dim 256 likewise (its causal rows persistent already): causal 1.03-1.05x at
# N 2048-16384, 0.98x at 1024, non-causal 1.00-1.02x; head_dim 64's three warpgroups 0.99-1.01x:
# left as they were.
# head_dim 64 forward: three compute warpgroups (192-row CTAs, no ping-pong; H200, fa sweep N
# 512-16384: 1.09-1.15x the two-warpgroup ping-pong forward, causal 0.98-1.11x; 3 stages
# 1.04-1.11x; the overlap 0.96-0.99x; benchmarks/NOTES.md session 12).
_SHORT_ROWS_PERSISTENT = dict(persistent_max_blocks_skewed=48, pair_q_tiles=True)
DEFAULTS: dict[tuple[int, str], KernelConfig] = {
    (64, "fwd"): KernelConfig(block_q=64, block_kv=128, fold_scale=True, compute_warpgroups=3,
                              ping_pong=False, compute_registers=160, persistent_max_blocks=32,
                              **_SHORT_ROWS_PERSISTENT),
    # head_dim 128 and 256: causal rows of at most 32 (batch, kv head)s in the snake schedule
    # (H100, forward over the tile pairs: 1.03-1.04x at d128 / d256 N 16384 and GQA 32 / 8,
    # 1.01x at N 8192; 0.68-0.98x at 64-128 of them), and causal rows persistent up to 300 key
    # blocks a tile on average (N 32768 at both; H100, over one tile a CTA: 1.02-1.06x at d128
    # N 32768 / 65536, batch 1-4, and d256 N 32768; benchmarks/NOTES.md session 30).
    # head_dim 128: the ping-pong's turns under the overlap on non-causal rows of at most 16
    # key blocks (`turns_max_blocks`; H200, 1.04-1.09x at N 512-2048; session 32). Not at 256
    # (0.94-1.00x at N 512-2048 there).
    (128, "fwd"): KernelConfig(block_q=64, block_kv=128, fold_scale=True, overlap_qk=True,
                               ping_pong=False, persistent_max_blocks=16, turns_max_blocks=16,
                               **{**_SHORT_ROWS_PERSISTENT, "persistent_max_blocks_skewed": 300},
                               next_q_after_walk=True, snake_max_kv_heads=32),
    (256, "fwd"): KernelConfig(block_q=64, block_kv=64, fold_scale=True, overlap_qk=True,
                               ping_pong=False, persistent_max_blocks=16,
                               **{**_SHORT_ROWS_PERSISTENT, "persistent_max_blocks_skewed": 300},
                               next_q_after_walk=True, snake_max_kv_heads=32),
    # head_dim 64's dQ kernel runs only where its dK/dV does not fuse dQ (causal rows of a few
    # blocks; see below): dP's wgmma co-issued in both kernels, as at 128 (H200, fwd+bwd at N
    # 512-2048 causal: 1.02-1.05x the separate kernels without it; NOTES session 14).
    (64, "dq"): KernelConfig(block_q=64, block_kv=64, co_issue_dp=True),
    # head_dim 128: dP's wgmma issued behind S's (P made under it), and in dK/dV dV's and dK's
    # wgmmas issued together (H200, fwd+bwd 1.10-1.12x non-causal, 1.02-1.03x causal at N 4096 /
    # 16384 in one tuner run; the dP part alone 1.03-1.05x twice; benchmarks/NOTES.md session 9).
    (128, "dq"): KernelConfig(block_q=64, block_kv=64, co_issue_dp=True),
    # head_dim 256: dQ split by columns between the warpgroups of one query tile, two stages
    # (H200, fwd+bwd 1.10-1.12x the one-slot [64, 256] dQ kernel, which spills 800 B a thread;
    # one stage 0.89-0.97x; benchmarks/NOTES.md session 8).
    (256, "dq"): KernelConfig(block_q=64, block_kv=64, head_split=True),
    # head_dim 64: dQ from the dK/dV kernel, 128-row query blocks (H200, b4 s4096 h32 d64,
    # fwd+bwd: 1.09x and 1.10x the separate dQ kernel in two runs; benchmarks/NOTES.md session 5).
    # At head_dim 128 the plain fused kernel spills (dK, dV and the dQ part) and is 0.93-0.98x:
    # there the column halves (below).
    # dV's, dK's and dQ's wgmmas of a step issued together (H200, fwd+bwd at N 4096 / 16384,
    # causal and not: 1.02-1.08x the one-at-a-time kernel in three tuner calls; session 13).
    # Causal rows whose key tiles visit at most 12 query blocks on average (N <= 2048) take the
    # separate dQ kernel (H200: 1.17 / 1.11 / 1.03x at N 512 / 1024 / 2048; session 14), and
    # non-causal rows of at most 4 (N 512; H100: 1.05-1.06x in a tuner run and a sweep, 0.97-1.01x
    # at N 1024; session 35).
    # The fused dQ in row halves (each warpgroup makes 64 rows of the 128-row block's dQ: half the
    # reduce-add bytes), a step late, 240 registers (spill stores 216-268 B a thread down to 48
    # non-causal, 392-416 to 448 causal). H100, fwd+bwd over the whole-block dQ in one tuner run:
    # 1.04-1.07x at N 2048-16384 non-causal, 1.05 / 1.07 / 1.04x causal at N 4096 / 8192 / 16384
    # (benchmarks/NOTES.md session 38).
    (64, "dkv"): KernelConfig(block_q=128, block_kv=64, fused_dq=True, co_issue_dkv=True,
                              co_issue_dq=True, dq_row_halves=True, dq_step_late=True,
                              compute_registers=240, separate_dq_max_blocks_skewed=12,
                              separate_dq_max_blocks=4),
    # head_dim 128: the fused dQ in column halves, dV's, dK's and dQ's wgmmas issued together,
    # dQ's a step late, 240 registers, and the K / V tiles' descriptors built in the step (its
    # spills, 220-500 B a thread, down to 0). H200, fwd+bwd over the separate kernels: 1.04 /
    # 1.06 / 1.11 / 1.08x at N 1024 / 2048 / 4096 / 8192, causal 1.00 / 1.05 / 1.11 / 1.10x; at
    # N 16384 1.04 / 1.06x the same layout without the descriptors in the step; GQA 32 / 8
    # causal N 4096 1.05x (benchmarks/NOTES.md session 20). Where the key tiles visit at most 8
    # query blocks on average (N 512 causal or not; 1.00 / 0.97x there) the separate dQ kernel,
    # whose dK/dV co-issues dP's wgmma as dQ does (`backward_configs`).
    # GQA: causal walks of at least 48 query blocks on average (N >= 8192) one query head a CTA
    # (`group_split_min_blocks`). H100, fwd+bwd over the whole group a CTA in one tuner call:
    # 32 / 8 heads 1.03x at N 8192, 1.05-1.07x at 16384, a group of 8 1.08x; at N 2048 one head
    # a CTA 0.96x, at 4096 1.00-1.01x (two calls); no mask at N 16384 1.00x (session 40).
    (128, "dkv"): KernelConfig(block_q=64, block_kv=64, co_issue_dkv=True, fused_dq=True,
                               dq_column_halves=True, co_issue_dq=True, dq_step_late=True,
                               compute_registers=240, tile_descriptors_in_step=True,
                               separate_dq_max_blocks=8, separate_dq_max_blocks_skewed=8,
                               group_split_min_blocks=48),
    # head_dim 256: dK and dV split by columns between the warpgroups of one key tile (H200,
    # fwd+bwd 1.33-1.41x split_dkv's two launches at N 4096 / 16384, causal and not, in one tuner
    # run; benchmarks/NOTES.md session 8), with dQ fused in (FA3's head_dim 256 backward: no dQ
    # kernel), q in two stages beside one dO slot, the tiles' descriptors built in the step, 240
    # registers (H200, fwd+bwd 1.08-1.14x the separate head-split kernels at N 4096 / 16384,
    # causal and not; session 21), each step's last dQ part sent under the next step's first
    # wgmma (H200, fwd+bwd 1.03-1.06x from N 2048, 1.00-1.01x below; session 26). Where the key
    # tiles visit at most 16 query blocks on average (N 512 and 1024, causal or not) the
    # separate kernels (`backward_configs`; H100, N 1024: 1.10 / 1.08x the fused kernel in a
    # tuner run, 1.09 / 1.07x in a sweep; N 512 1.27x; session 35).
    # GQA: causal walks of at least 48 query blocks on average (N >= 8192) one query head a CTA
    # (`group_split_min_blocks`). H100, fwd+bwd over the whole group a CTA in one tuner call:
    # 16 / 4 heads 1.23 / 1.18x at N 8192 / 16384, 16 / 8 1.14 / 1.12x; two parts of the group
    # 1.03-1.12x (session 43).
    (256, "dkv"): KernelConfig(block_q=64, block_kv=64, head_split=True, fused_dq=True,
                               one_do_slot=True, defer_last_dq_part=True, compute_registers=240,
                               tile_descriptors_in_step=True, separate_dq_max_blocks=16,
                               separate_dq_max_blocks_skewed=16, group_split_min_blocks=48),
}


def kernel_config(head_dim: int, pass_: str) -> KernelConfig:
  """The table's config for one kernel ("fwd", "dq" or "dkv") at `head_dim`."""
  if pass_ not in PASSES:
    raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
  if (head_dim, pass_) not in DEFAULTS:
    raise ValueError(f"no Mosaic GPU {pass_} tiling for head_dim {head_dim} "
                     f"(supported: {SUPPORTED_HEAD_DIMS})")
  return DEFAULTS[(head_dim, pass_)]


def forward_config(head_dim: int, dtype_bytes: int = 2) -> KernelConfig:
  del dtype_bytes  # the table is for 2-byte inputs, the only ones the kernels take
  return kernel_config(head_dim, "fwd")


def dq_config(head_dim: int, dtype_bytes: int = 2) -> KernelConfig:
  del dtype_bytes
  return kernel_config(head_dim, "dq")


def dkv_config(head_dim: int, dtype_bytes: int = 2) -> KernelConfig:
  del dtype_bytes
  return kernel_config(head_dim, "dkv")
