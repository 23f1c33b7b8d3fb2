"""Times the Mosaic GPU kernels' config variants against the table's defaults, in one process.

  python -m benchmarks.tune --shapes d128_anchors --variants all --out $OUT/tune.jsonl
  python -m benchmarks.tune --list                # the variants and what they change

A variant (VARIANTS) changes some fields of the forward, dQ and dK/dV configs of
`pallas_attn.mosaic_gpu.config.DEFAULTS` at the shape's head_dim (the others stay the table's).
For each shape: every variant's calls (fwd, and fwd_bwd through jax.vjp) compile in threads
(before any is timed: nothing compiles while a call is timed); then the default runs on fresh
random inputs, and each variant, with the allocator poisoned with NaN before its first call,
must match the default's outputs on the same inputs (max |variant - default| / max |default|
<= --max-rel-err, no NaN) before it is timed. The checked calls of a shape are timed together,
their repeats interleaved (`timing.time_interleaved`: warm-up, then rounds in which each runs
one repeat of K calls enqueued and one sync, in an order rotated every round; the median of its
repeats), so that the device's drift during the call falls on all variants alike; the default's
executable runs among them twice, the second as `default_again`, whose ratio to the default is
the noise to read the variants' ratios against. A variant that does not fit the shared memory,
matches nothing new (the same kernels as the default), fails or is wrong gets a row saying so
and is not timed. Past --budget-s the rest is recorded as skipped. The table
printed at the end has one line per variant, TFLOP/s and the ratio to the default per shape and
pass; the winners go into config.DEFAULTS.

--ptxas records each newly compiled kernel's registers and spills (ptxas -v, through Mosaic GPU's
MOSAIC_GPU_DUMP_PTXAS, read from the process's stdout), compiling one call at a time.
On the CPU the kernels run in the interpreter (a smoke test: tiny shapes, one timed call).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks import impls as impls_lib
from benchmarks import memory
from benchmarks import report
from benchmarks import shapes as shapes_lib
from benchmarks import sweep
from benchmarks import timing
from benchmarks.shapes import Shape
import pallas_attn
from pallas_attn.mosaic_gpu import bwd
from pallas_attn.mosaic_gpu import common
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import fwd
from pallas_attn.mosaic_gpu import ops

KERNELS = config_lib.PASSES  # ("fwd", "dq", "dkv"): the three kernels a variant may change
TILES_FIRST = ("tiles", "heads", "batch")
TILES_LAST = ("heads", "batch", "tiles")

# Two compute warpgroups in the forward (the table's head_dim 64 forward has three, which take no
# ping-pong and at most 160 registers): what the ping-pong and 240-register variants run with.
_TWO_WGS = dict(compute_warpgroups=2, compute_registers=232)
_TWO_WGS_REGS240 = dict(_TWO_WGS, compute_registers=240)  # FlashAttention-3's split (240 / 24)
# The forward without the overlap, with the ping-pong (what one-slot rings need: the overlap
# frees V a step late).
_PLAIN_FWD = dict(overlap_qk=False, ping_pong=True, **_TWO_WGS)
_THREE_WGS = dict(compute_warpgroups=3, ping_pong=False, compute_registers=160)


def _from_unfused(**changes) -> dict:
  """dK/dV changes from the unfused kernel at 232 registers with its descriptors hoisted (head_dim
  128's table before session 15), whatever the table fuses now: the dQ-in-dK/dV layouts are
  named in full."""
  return {**config_lib.UNFUSED_DQ,
          "compute_registers": config_lib.KernelConfig.compute_registers, **changes}


# The fused dQ with dV's, dK's and dQ's wgmmas issued together and dP's awaited alone.
_FUSED_CO_DKV_DQ = _from_unfused(fused_dq=True, co_issue_dp=False, co_issue_dkv=True,
                                 co_issue_dq=True)

# name -> {kernel: field changes to the table's config at the shape's head_dim}. "default" first.
# Ordered as issue #4 lists them (causal balance, forward tiles, forward overlap, dQ, dK/dV).
VARIANTS: dict[str, dict[str, dict]] = {
    "default": {},
    # a. Causal load balance and launch order.
    "reverse_q": {"fwd": dict(reverse_q_tiles=True), "dq": dict(reverse_q_tiles=True)},
    "tiles_first": {k: dict(grid_order=TILES_FIRST) for k in KERNELS},
    "tiles_last": {k: dict(grid_order=TILES_LAST) for k in KERNELS},
    "reverse_q_tiles_last": {"fwd": dict(reverse_q_tiles=True, grid_order=TILES_LAST),
                             "dq": dict(reverse_q_tiles=True, grid_order=TILES_LAST),
                             "dkv": dict(grid_order=TILES_LAST)},
    # b. Forward tiles.
    "fwd_kv64": {"fwd": dict(block_kv=64)},
    "fwd_kv64_3st": {"fwd": dict(block_kv=64, stages=3)},
    # Deeper rings for decode (few rows, a long K/V stream: bytes in flight per SM matter).
    "fwd_kv64_4st": {"fwd": dict(block_kv=64, stages=4)},
    "fwd_kv64_6st": {"fwd": dict(block_kv=64, stages=6)},
    "fwd_kv128": {"fwd": dict(block_kv=128)},
    "fwd_kv128_1st": {"fwd": dict(block_kv=128, stages=1, **_PLAIN_FWD)},
    "fwd_kv128_3st": {"fwd": dict(block_kv=128, stages=3)},
    "fwd_kv192": {"fwd": dict(block_kv=192)},
    "fwd_kv192_1st": {"fwd": dict(block_kv=192, stages=1, **_PLAIN_FWD)},
    "fwd_kv256": {"fwd": dict(block_kv=256)},
    "fwd_kv256_1st": {"fwd": dict(block_kv=256, stages=1, **_PLAIN_FWD)},
    "fwd_no_ping_pong": {"fwd": dict(ping_pong=False)},
    # e. FA3's intra-warpgroup overlap (tile j's softmax under tile j - 1's P V; session 10:
    # in place, K and V refilled on their own releases), with the ping-pong turns (one a step).
    # The table has it on at head_dim 128 and 256 without the turns (`fwd_overlap_no_pp`).
    "fwd_overlap_turns": {"fwd": dict(overlap_qk=True, ping_pong=True, **_TWO_WGS)},
    # The table's head_dim 128 forward takes the turns on non-causal rows of <= 16 key blocks
    # (`turns_max_blocks`, session 32); without them:
    "fwd_no_short_turns": {"fwd": dict(turns_max_blocks=0)},
    "fwd_overlap_turns_regs240": {"fwd": dict(overlap_qk=True, ping_pong=True,
                                              **_TWO_WGS_REGS240)},
    "fwd_overlap_3st": {"fwd": dict(overlap_qk=True, ping_pong=True, stages=3, **_TWO_WGS)},
    # The table's forward at head_dim 128 and 256 before session 10: the ping-pong alone.
    "fwd_ping_pong": {"fwd": _PLAIN_FWD},
    "fwd_ping_pong_3st": {"fwd": dict(_PLAIN_FWD, stages=3)},
    "fwd_overlap_no_pp_3st": {"fwd": dict(overlap_qk=True, ping_pong=False, stages=3)},
    "fwd_overlap_no_pp_regs240": {"fwd": dict(overlap_qk=True, ping_pong=False,
                                              **_TWO_WGS_REGS240)},
    "fwd_overlap_no_pp_kv192_regs240": {"fwd": dict(overlap_qk=True, ping_pong=False,
                                                    block_kv=192, **_TWO_WGS_REGS240)},
    "fwd_overlap_kv64_3st": {"fwd": dict(overlap_qk=True, block_kv=64, stages=3)},
    "fwd_overlap_no_pp": {"fwd": dict(overlap_qk=True, ping_pong=False)},
    "fwd_overlap_kv64_no_pp": {"fwd": dict(overlap_qk=True, block_kv=64, ping_pong=False)},
    # f. Forward instruction count and epilogue (benchmarks/FWD_GAP_ANALYSIS.md).
    "fwd_fold_scale": {"fwd": dict(fold_scale=True)},
    "fwd_no_fold_scale": {"fwd": dict(fold_scale=False)},  # (the table folds since session 7)
    "fwd_ro_store": {"fwd": dict(read_only_store_wait=True)},
    "fwd_fold_ro": {"fwd": dict(fold_scale=True, read_only_store_wait=True)},
    # g. The persistent forward grid (one CTA per SM, FWD_GAP_ANALYSIS.md P2); with heaviest
    # causal tiles first (the q tiles axis slowest, reversed), and with the two options above.
    "fwd_persistent": {"fwd": dict(persistent=True)},
    # The next item's q loaded after the walk's loops, not from their last step (session 24).
    "fwd_persistent_q_late": {"fwd": dict(persistent=True, next_q_after_walk=True)},
    "fwd_persistent_q_late_descriptors_in_step": {"fwd": dict(
        persistent=True, next_q_after_walk=True, tile_descriptors_in_step=True)},
    # head_dim 128's table (session 24) at the other head dims: the next q after the loops where
    # the table runs persistent, and causal rows up to 100 blocks persistent too.
    "fwd_q_late": {"fwd": dict(next_q_after_walk=True)},
    "fwd_q_late_skewed100": {"fwd": dict(next_q_after_walk=True,
                                         persistent_max_blocks_skewed=100)},
    "fwd_persistent_heavy_first": {"fwd": dict(persistent=True, reverse_q_tiles=True,
                                               grid_order=TILES_LAST)},
    "fwd_persistent_fold_ro": {"fwd": dict(persistent=True, fold_scale=True,
                                           read_only_store_wait=True)},
    # Units of two query tiles (T - 1 - t, t) of one head: every causal unit weighs the same.
    "fwd_persistent_pairs": {"fwd": dict(persistent=True, pair_q_tiles=True)},
    "fwd_persistent_pairs_ro": {"fwd": dict(persistent=True, pair_q_tiles=True,
                                            read_only_store_wait=True)},
    # The persistent rows without the tile pairs (a pair walks one head's K/V twice, a tile after
    # the other), and with the tiles axis fastest: the query tiles of one head on neighbouring
    # CTAs at once. Since session 33 the table pairs skewed (causal) tiles only, so
    # `fwd_no_pairs` changes the causal rows alone (H100: 0.61-0.96x there).
    "fwd_no_pairs": {"fwd": dict(pair_q_tiles=False)},
    "fwd_tiles_first": {"fwd": dict(grid_order=TILES_FIRST)},
    "fwd_tiles_first_no_pairs": {"fwd": dict(grid_order=TILES_FIRST, pair_q_tiles=False)},
    # Causal rows as single tiles heaviest first, the rounds alternating direction, instead of
    # pairs (session 30): at every number of (batch, kv head)s, and never.
    "fwd_snake": {"fwd": dict(snake_max_kv_heads=1 << 20)},
    "fwd_no_snake": {"fwd": dict(snake_max_kv_heads=0)},
    # Causal rows persistent (in the snake where it applies) up to 300 key blocks a tile on
    # average: N 32768 / 65536 at head_dim 128, one tile a CTA in the table.
    "fwd_skewed300": {"fwd": dict(persistent_max_blocks_skewed=300)},
    # The one-tile-a-CTA grid where the table runs short rows persistent (session 12).
    "fwd_not_persistent": {"fwd": dict(persistent=False, persistent_max_blocks=0,
                                       persistent_max_blocks_skewed=0)},
    # h. Part of each score tile's exp2 on the FMA pipe (FlashAttention-4's trick, against the
    # SFU's 16 a clock), with the table's forward and with the overlap (H200, session 11:
    # 0.85-0.99x at d64 and d128, slower with every column moved; off).
    "fwd_exp2_fma16": {"fwd": dict(exp2_fma_cols=16)},
    "fwd_exp2_fma24": {"fwd": dict(exp2_fma_cols=24)},
    "fwd_exp2_fma32": {"fwd": dict(exp2_fma_cols=32)},
    "fwd_exp2_fma48": {"fwd": dict(exp2_fma_cols=48)},
    "fwd_exp2_fma24_overlap": {"fwd": dict(exp2_fma_cols=24, overlap_qk=True, ping_pong=False)},
    "fwd_exp2_fma32_overlap": {"fwd": dict(exp2_fma_cols=32, overlap_qk=True, ping_pong=False)},
    # i. Three compute warpgroups over one K/V ring (FlashAttention-3's head_dim 64 forward:
    # 192-row CTAs, 160 registers a compute thread, no ping-pong).
    "fwd_3wg": {"fwd": dict(_THREE_WGS)},
    "fwd_3wg_overlap": {"fwd": dict(_THREE_WGS, overlap_qk=True)},
    "fwd_3wg_kv64": {"fwd": dict(_THREE_WGS, block_kv=64)},
    "fwd_3wg_3st": {"fwd": dict(_THREE_WGS, stages=3)},
    "fwd_3wg_overlap_3st": {"fwd": dict(_THREE_WGS, overlap_qk=True, stages=3)},
    "fwd_3wg_3st_one_tile_grid": {"fwd": dict(_THREE_WGS, stages=3, persistent_max_blocks=0,
                                              persistent_max_blocks_skewed=0)},
    # c. dQ tiles.
    "dq_kv128": {"dq": dict(block_kv=128)},
    "dq_kv128_1st": {"dq": dict(block_kv=128, stages=1)},
    "dq_3st": {"dq": dict(stages=3)},
    "dq_2st": {"dq": dict(stages=2)},
    # d. dK/dV tiles.
    "dkv_q128": {"dkv": _from_unfused(block_q=128)},
    "dkv_q128_1st": {"dkv": _from_unfused(block_q=128, stages=1)},
    "dkv_3st": {"dkv": dict(stages=3)},
    "dkv_2st": {"dkv": dict(stages=2)},
    # g. One backward launch: dQ made in the dK/dV kernel (TMA reduce-add; no dQ kernel).
    "dkv_fused_dq": {"dkv": _from_unfused(fused_dq=True)},
    "dkv_fused_dq_q128": {"dkv": _from_unfused(fused_dq=True, block_q=128)},
    "dkv_fused_dq_1st": {"dkv": _from_unfused(fused_dq=True, stages=1)},
    # head_dim 256 (128 too): one key tile shared by both warpgroups, dK and dV split by columns
    # (benchmarks/NOTES.md session 8), against split_dkv's two launches.
    "dkv_head_split": {"dkv": _from_unfused(head_split=True, split_dkv=False, stages=2)},
    "dkv_head_split_1st": {"dkv": _from_unfused(head_split=True, split_dkv=False, stages=1)},
    # Warpgroup 1 makes dP a step ahead (benchmarks/NOTES.md session 9: 0.91-0.97x; off).
    "head_split_dp_ahead": {"dq": dict(dp_ahead=True), "dkv": _from_unfused(dp_ahead=True)},
    "dq_head_split": {"dq": dict(head_split=True, stages=2)},
    "dq_head_split_1st": {"dq": dict(head_split=True, stages=1)},
    "head_split": {"dq": dict(head_split=True, stages=2),
                   "dkv": _from_unfused(head_split=True, split_dkv=False, stages=2)},
    # Session 16: the head split with dQ fused in (FA3's head_dim 256 backward: no dQ kernel,
    # one stage beside the float32 dQ halves).
    "head_split_fused_dq": {"dkv": _from_unfused(head_split=True, split_dkv=False,
                                                 fused_dq=True, stages=1)},
    "head_split_fused_dq_regs240": {"dkv": _from_unfused(head_split=True, split_dkv=False,
                                                         fused_dq=True, stages=1,
                                                         compute_registers=240)},
    # head_dim 256 before session 8: dV, then dK, in two launches with one-slot rings; dQ with
    # its [64, 256] accumulator and a one-slot ring.
    "dkv_split_launches": {"dkv": _from_unfused(head_split=False, split_dkv=True, stages=1)},
    "dq_one_warpgroup_1st": {"dq": dict(head_split=False, stages=1)},
    # h. The fused dQ in column halves (FA3's layout: each warpgroup half of dQ's columns from
    # both warpgroups' dS^T; head_dim >= 128).
    "dkv_dq_halves": {"dkv": _from_unfused(fused_dq=True, dq_column_halves=True)},
    "dkv_dq_halves_1st": {"dkv": _from_unfused(fused_dq=True, dq_column_halves=True, stages=1)},
    # i. FlashAttention-3's register split: 240 per compute thread, 24 for the producer (the
    # table: 232 / 40), for the kernels that spill (the fused dQ at 128, the head split at 256).
    "regs240": {k: dict(_TWO_WGS_REGS240) for k in KERNELS},
    "dkv_fused_dq_regs240": {"dkv": _from_unfused(fused_dq=True, compute_registers=240)},
    "dkv_dq_halves_regs240": {"dkv": _from_unfused(fused_dq=True, dq_column_halves=True,
                                                   compute_registers=240)},
    "head_split_dp_ahead_regs240": {"dq": dict(dp_ahead=True, compute_registers=240),
                                    "dkv": _from_unfused(dp_ahead=True, compute_registers=240)},
    # j. Swizzled float32 tiles (the fused dQ part, the head split's dP hand-over).
    "swizzle_f32": {k: dict(swizzle_f32=True) for k in KERNELS},
    "dkv_fused_dq_swizzled": {"dkv": _from_unfused(fused_dq=True, swizzle_f32=True)},
    "dkv_dq_halves_swizzled": {"dkv": _from_unfused(fused_dq=True, dq_column_halves=True,
                                                    swizzle_f32=True)},
    "dkv_fused_dq_swizzled_regs240": {"dkv": _from_unfused(fused_dq=True, swizzle_f32=True,
                                                           compute_registers=240)},
    # k. dP's wgmma issued behind S's, P made while dP runs (dQ and dK/dV kernels).
    "co_issue_dp": {"dq": dict(co_issue_dp=True), "dkv": dict(co_issue_dp=True)},
    "co_issue_dp_regs240": {k: dict(co_issue_dp=True, compute_registers=240)
                            for k in ("dq", "dkv")},
    "co_issue_dp_dkv": {"dq": dict(co_issue_dp=True), "dkv": dict(co_issue_dp=True,
                                                                  co_issue_dkv=True)},
    "co_issue_dkv": {"dkv": dict(co_issue_dkv=True)},
    # dQ's wgmma left running into the next step (H200, session 10: 0.91-0.96x; off).
    "dq_in_flight": {"dq": dict(dq_in_flight=True)},
    "dq_in_flight_3st": {"dq": dict(dq_in_flight=True, stages=3)},
    # FlashAttention-3's intra-warpgroup overlap in the backward: the step before's dQ wgmma
    # (dK wgmma) issued behind this step's S and dP (S^T and dP^T), this step's dS made under
    # it. The dK/dV ones run the separate dQ kernel at every length. H200, d128 fwd+bwd:
    # 0.95-1.00x and 0.91-0.99x (benchmarks/NOTES.md session 18); off.
    "overlap_dq": {"dq": dict(overlap_dq=True, stages=3)},
    "overlap_dq_2st": {"dq": dict(overlap_dq=True)},
    "overlap_dkv": {"dkv": _from_unfused(block_q=64, overlap_dkv=True, stages=3)},
    "overlap_dkv_regs240": {"dkv": _from_unfused(block_q=64, overlap_dkv=True, stages=3,
                                                 compute_registers=240)},
    "overlap_dq_dkv": {"dq": dict(overlap_dq=True, stages=3),
                       "dkv": _from_unfused(block_q=64, overlap_dkv=True, stages=3,
                                            compute_registers=240)},
    # head_dim 128's backward before session 9 (every wgmma awaited before the next is issued).
    "no_co_issue": {"dq": dict(co_issue_dp=False),
                    "dkv": dict(co_issue_dp=False, co_issue_dkv=False)},
    # head_dim 64: the separate dQ kernel with both co-issues, against the fused dQ.
    "separate_dq_co_issue": {"dq": dict(co_issue_dp=True),
                             "dkv": _from_unfused(block_q=64, co_issue_dp=True,
                                                  co_issue_dkv=True)},
    "dkv_fused_dq_swizzled_regs240_co_dkv": {"dkv": _from_unfused(fused_dq=True, swizzle_f32=True,
                                                                  compute_registers=240,
                                                                  co_issue_dkv=True)},
    "dkv_fused_dq_co_issue": {"dkv": _from_unfused(fused_dq=True, co_issue_dp=True)},
    "dkv_fused_dq_co_issue_regs240": {"dkv": _from_unfused(fused_dq=True, co_issue_dp=True,
                                                           compute_registers=240)},
    # m. The fused dQ's wgmma issued behind dK's (and dV's), dS^T written while dK runs
    # (session 13: in the table at head_dim 64, with co_issue_dkv). head_dim 64:
    "dkv_one_at_a_time": {"dkv": dict(co_issue_dkv=False, co_issue_dq=False,
                                      dq_step_late=False)},  # (till then)
    "dkv_co_issue_dq_only": {"dkv": dict(co_issue_dkv=False, co_issue_dq=True)},
    "dkv_co_issue_dq_regs240": {"dkv": dict(co_issue_dq=True, compute_registers=240)},
    # head_dim 128 (the table had the separate dQ kernel): plain fused and column halves, dP's
    # wgmma not co-issued (the fused kernel cannot hold its extra tile, session 9).
    "dkv_fused_co_dkv_dq": {"dkv": _FUSED_CO_DKV_DQ},
    "dkv_fused_co_dkv_dq_regs240": {"dkv": dict(_FUSED_CO_DKV_DQ, compute_registers=240)},
    "dkv_halves_co_dkv_dq": {"dkv": dict(_FUSED_CO_DKV_DQ, dq_column_halves=True)},
    "dkv_halves_co_dkv_dq_regs240": {"dkv": dict(_FUSED_CO_DKV_DQ, dq_column_halves=True,
                                                 compute_registers=240)},
    "dkv_halves_co_all_regs240": {"dkv": _from_unfused(fused_dq=True, dq_column_halves=True,
                                                       co_issue_dq=True, compute_registers=240)},
    # The separate dQ kernel again (where the table fuses: head_dim 64).
    "dkv_separate_dq": {"dkv": _from_unfused(block_q=64)},
    # n. Session 14. The separate kernels with dP's wgmma co-issued (head_dim 128's table), at
    # head_dim 64's short rows, where the fused dQ's float32 passes (zero, then scale and cast:
    # 320 MiB of traffic whatever N is) are ~10% of the time: what the table runs there since
    # (`separate_dq_max_blocks_skewed`), and at every length with this variant.
    "separate_dq_co_dp": {"dq": dict(co_issue_dp=True),
                          "dkv": _from_unfused(block_q=64, co_issue_dp=True)},
    # head_dim 64's fused kernel at every length (the table takes the separate kernels for
    # causal rows of a few blocks since session 14: `separate_dq_max_blocks_skewed`).
    # At head_dim 128 (session 15): the fused dQ in column halves a step late at every length
    # (the table runs it where the key tiles visit over 128 query blocks on average);
    # `separate_dq_co_dp` is head_dim 128's table before.
    "dkv_always_fused": {"dkv": dict(separate_dq_max_blocks_skewed=0,
                                     separate_dq_max_blocks=0)},
    # Session 35: the separate kernels on rows of up to 16 key-tile visits (head_dim 256 N 1024,
    # causal and not; head_dim 64 N 512-2048), and up to 4 without a mask (head_dim 64 N 512),
    # where the deterministic backward's sweep (the separate kernels everywhere) ran 1.07-1.09x
    # / 1.05x the table on an H100.
    "dkv_separate_dq_up_to_16": {"dkv": dict(separate_dq_max_blocks=16,
                                             separate_dq_max_blocks_skewed=16)},
    "dkv_separate_dq_up_to_4": {"dkv": dict(separate_dq_max_blocks=4)},
    # Session 36. head_dim 64's dK/dV/dQ kernel with dQ in row halves (each warpgroup 64 of the
    # 128 query rows, from both warpgroups' dS^T tiles: half the float32 reduce-add bytes and
    # dQ registers of the whole block's), in the table a step late at 240 registers since
    # session 38. Against it: the whole-block dQ (the table before), and the row halves co-issued
    # in lockstep or a step late at 232 registers (session 38's H100 tuner run: 0.92-1.00x and
    # 0.95-1.02x the table's).
    "dkv_whole_dq": {"dkv": dict(dq_row_halves=False, dq_step_late=False,
                                 compute_registers=232)},
    "dkv_row_halves_lockstep": {"dkv": dict(dq_row_halves=True, dq_step_late=False,
                                            compute_registers=232)},
    "dkv_row_halves_late_regs232": {"dkv": dict(dq_row_halves=True, compute_registers=232)},
    # Session 39. A kv head's query-head group over 2 or 4 CTAs (`group_parts`), each walking
    # its share of the group's heads and writing its own dK / dV partials (added after; at 4 parts
    # of a group of 4 each CTA walks one head, as MHA's do). GQA rows only.
    "dkv_group_parts2": {"dkv": dict(group_parts=2)},
    "dkv_group_parts4": {"dkv": dict(group_parts=4)},
    # The table's split of long causal groups off: each CTA walks its kv head's whole group;
    # and the rule where the table has none (head_dim 64, 256's head split; session 40).
    "dkv_group_whole": {"dkv": dict(group_split_min_blocks=0)},
    "dkv_group_split48": {"dkv": dict(group_split_min_blocks=48)},
    "dkv_group_split16": {"dkv": dict(group_split_min_blocks=16)},
    # head_dim 128's dQ kernel over 128-key blocks (wgmma N 128 for S and dP: a sixth fewer
    # shared-memory bytes per FLOP than N 64, whose operand reads alone fill the 128 B a clock).
    "dq_kv128_regs240": {"dq": dict(block_kv=128, compute_registers=240)},
    # The dQ kernel's q and dO as register A operands (S's and dP's wgmmas read only K and V from
    # shared memory: a third fewer of its bytes), 64 registers more at head_dim 128.
    "dq_lhs_in_registers": {"dq": dict(dq_lhs_in_registers=True)},
    "dq_lhs_in_registers_regs240": {"dq": dict(dq_lhs_in_registers=True, compute_registers=240)},
    # o. Session 15. The fused dQ in column halves with each step's dQ wgmmas a step late (the
    # two warpgroups' dS^T tiles of the step before: they no longer meet, in lockstep, at every
    # step's), as the halves above with both co-issues.
    "dkv_halves_late": {"dkv": dict(_FUSED_CO_DKV_DQ, dq_column_halves=True, dq_step_late=True)},
    "dkv_halves_late_regs240": {"dkv": dict(_FUSED_CO_DKV_DQ, dq_column_halves=True,
                                            dq_step_late=True, compute_registers=240)},
    # ... with dV's wgmma awaited before dP^T's (P^T's bf16 copy dead in dP^T's phase, the
    # register peak), and with dP's wgmma co-issued too.
    "dkv_halves_late_dv_first": {"dkv": dict(_FUSED_CO_DKV_DQ, co_issue_dkv=False,
                                             dq_column_halves=True, dq_step_late=True,
                                             compute_registers=240)},
    "dkv_halves_late_co_dp": {"dkv": dict(_FUSED_CO_DKV_DQ, co_issue_dp=True,
                                          dq_column_halves=True, dq_step_late=True,
                                          compute_registers=240)},
    # Session 20. The K / V tiles' wgmma descriptors built in each step instead of hoisted out
    # of the walk and spilled: the table's dK/dV of then (fused at N 16384 only, the separate
    # kernels below), and the fused layout at every length with it.
    "dkv_descriptors_in_step": {"dkv": dict(tile_descriptors_in_step=True)},
    "dkv_halves_late_descriptors_in_step_regs240": {"dkv": dict(
        _FUSED_CO_DKV_DQ, dq_column_halves=True, dq_step_late=True, compute_registers=240,
        tile_descriptors_in_step=True)},
    # Session 21. head_dim 256: the head split's loop-invariant tiles (dK/dV: K and V, 16
    # descriptors each; dQ: q and dO) indexed in the step, and the fused head split with them
    # (its 1044 B of spills a thread: 0 in the same PTX with the descriptors at their uses).
    "dq_descriptors_in_step": {"dq": dict(tile_descriptors_in_step=True)},
    "descriptors_in_step": {k: dict(tile_descriptors_in_step=True) for k in ("dq", "dkv")},
    "head_split_fused_dq_descriptors_in_step": {"dkv": _from_unfused(
        head_split=True, split_dkv=False, fused_dq=True, stages=1, tile_descriptors_in_step=True)},
    "head_split_fused_dq_descriptors_in_step_regs240": {"dkv": _from_unfused(
        head_split=True, split_dkv=False, fused_dq=True, stages=1, compute_registers=240,
        tile_descriptors_in_step=True)},
    # ... with q in two stages beside one dO slot (FA3's d256 backward) and one float32 dQ tile
    # a warpgroup.
    "head_split_fused_dq_two_q_stages": {"dkv": _from_unfused(
        head_split=True, split_dkv=False, fused_dq=True, stages=2, one_do_slot=True,
        compute_registers=240, tile_descriptors_in_step=True)},
    # Session 22. The forward's q tile (QK^T's A operand: 8 descriptors at head_dim 128) indexed
    # in the step, and with it block_kv 192 (FA3's head_dim 128 forward takes 176 keys, which
    # Mosaic GPU's P V cannot: its contraction must be whole 64-element groups). H200: 1.01-1.03x
    # / 0.95-0.99x causal; block_kv 192 spills as much as with the descriptors hoisted (324-1352
    # B), 0.58-1.04x at lengths it divides (preset d128_kv192).
    "fwd_descriptors_in_step": {"fwd": dict(tile_descriptors_in_step=True)},
    "fwd_kv192_descriptors_in_step_regs240": {"fwd": dict(
        block_kv=192, tile_descriptors_in_step=True, **_TWO_WGS_REGS240)},
    # Session 26. head_dim 256's fused head split: each warpgroup's last dQ part of a step sent
    # under the next step's first wgmma. (Session 25 tried dS^T made in warpgroup 1 or under
    # dV's wgmma, 0.93-1.02x and 0.96-0.99x, warpgroup 0's second part through the dP^T tile,
    # 0.92-0.94x, commits bfaa3ca and c384c9d; session 26 each part out in two column halves
    # through two half-width tiles, 0.93-1.00x, commit 57d356e.)
    "defer_last_dq_part": {"dkv": dict(defer_last_dq_part=True)},
    # (Session 27 tried CTA pairs on neighbouring key tiles summing each dQ part with the peer's
    # through distributed shared memory before one reduce-add, `dq_pair_sum`: 0.61-0.69x, the
    # pairs without the exchange 0.93-0.98x; commits 83a68c6 and 20fbca9.)
    # (Session 23 tried the overlapped forward's P carried in float32 and its P V wait pinned
    # behind the step's exp2s: 0.87-0.99x, removed; commit b03a50f has them.)
}

_DEFAULT = "default"
DEFAULT_AGAIN = "default_again"  # the row of the default timed again after the variants


def variant_configs(name: str, head_dim: int) -> dict[str, config_lib.KernelConfig]:
  """{kernel: KernelConfig} of variant `name` at `head_dim` (ValueError: an invalid config)."""
  return {k: dataclasses.replace(config_lib.kernel_config(head_dim, k), **VARIANTS[name].get(k, {}))
          for k in KERNELS}


_SCRATCH = {"fwd": fwd.scratch_types, "dq": bwd.dq_scratch_types, "dkv": bwd.dkv_scratch_types}


def why_not(name: str, shape: Shape, dtype) -> str | None:
  """Why variant `name` is not measured at `shape` (None: it is): an invalid or oversized config,
  or the same configs as the default's."""
  table_dkv = config_lib.kernel_config(shape.head_dim, "dkv")
  dkv_changes = VARIANTS[name].get("dkv", {})
  if ((dkv_changes.get("fused_dq") or dkv_changes.get("overlap_dkv"))
      and not dkv_changes.get("head_split") and (table_dkv.split_dkv or table_dkv.head_split)):
    return f"does not apply: head_dim {shape.head_dim} splits dK and dV"
  if (VARIANTS[name].get("dq", {}).get("tile_descriptors_in_step")
      and not config_lib.kernel_config(shape.head_dim, "dq").head_split):
    return (f"does not apply: the dQ kernel builds its descriptors in the step only in the head "
            f"split (head_dim 256), not at {shape.head_dim}")
  if dkv_changes.get("co_issue_dq") and not dkv_changes.get("fused_dq", table_dkv.fused_dq):
    return (f"does not apply: co_issue_dq is the fused dQ's option, and head_dim "
            f"{shape.head_dim}'s table has the separate dQ kernel")
  if dkv_changes.get("co_issue_dq") and dkv_changes.get("head_split", table_dkv.head_split):
    return (f"does not apply: head_dim {shape.head_dim}'s head split issues its fused dQ behind "
            f"dK's wgmma already")
  if (any(c.get("dp_ahead") for c in VARIANTS[name].values())
      and not config_lib.kernel_config(shape.head_dim, "dq").head_split):
    return f"does not apply: dp_ahead is a head_split option (head_dim 256), not {shape.head_dim}"
  plain_dq_options = [option
                      for option in ("dq_in_flight", "dq_lhs_in_registers", "overlap_dq")
                      if VARIANTS[name].get("dq", {}).get(option)]
  if plain_dq_options and config_lib.kernel_config(shape.head_dim, "dq").head_split:
    return (f"does not apply: {plain_dq_options[0]} is the plain dQ kernel's, not head_dim "
            f"{shape.head_dim}'s")
  if dkv_changes.get("defer_last_dq_part") and not (table_dkv.head_split and table_dkv.fused_dq):
    return (f"does not apply: defer_last_dq_part is an option of the fused head split (head_dim "
            f"256), not head_dim {shape.head_dim}'s")
  if dkv_changes.get("split_dkv") and shape.head_dim != 256:
    return f"does not apply: dK and dV in two launches is head_dim 256's, not {shape.head_dim}'s"
  if any(c.get("head_split") for c in VARIANTS[name].values()) and shape.head_dim % 128:
    return f"does not apply: head_split needs head_dim a multiple of 128, not {shape.head_dim}"
  if dkv_changes.get("dq_column_halves") and shape.head_dim < 128:
    return f"does not apply: dQ column halves need head_dim >= 128, not {shape.head_dim}"
  # The row-halves variants (on or off: the whole-block dQ is head_dim 64's table before them)
  # change the table's fused kernel; `_from_unfused` ones name every fused-dQ field, fused_dq
  # included, and build from the unfused kernel instead.
  if ("dq_row_halves" in dkv_changes and "fused_dq" not in dkv_changes
      and table_dkv.block_q % 128):
    return (f"does not apply: dQ row halves (on or off) are a layout of the dK/dV kernel's "
            f"128-row query blocks (head_dim 64's), not head_dim {shape.head_dim}'s "
            f"{table_dkv.block_q}")
  if ((dkv_changes.get("group_parts", 1) > 1 or "group_split_min_blocks" in dkv_changes)
      and shape.heads_q == shape.heads_kv):
    return "does not apply: group_parts splits a GQA group, and this shape has none"
  try:
    cfgs = variant_configs(name, shape.head_dim)
  except ValueError as e:
    return f"invalid: {e}"
  for kernel, cfg in cfgs.items():
    # The forward may drop Pallas's reduction scratch to fit (common.compiler_params_within_smem).
    need = common.smem_bytes(_SCRATCH[kernel](cfg, shape.head_dim, dtype, interpret=False))
    if need > config_lib.SMEM_BYTES:
      return f"does not fit: {kernel} needs {need / 1024:.1f} KiB of shared memory (227 KiB)"
  if name != _DEFAULT and cfgs == variant_configs(_DEFAULT, shape.head_dim):
    return "same configs as the default"
  return None


def changes_pass(name: str, shape: Shape, pass_: str) -> bool:
  """Whether the variant runs other kernels than the default in `pass_` ("fwd": the forward
  kernel only; "fwd_bwd": all three)."""
  cfgs, base = variant_configs(name, shape.head_dim), variant_configs(_DEFAULT, shape.head_dim)
  kernels = ("fwd",) if pass_ == "fwd" else KERNELS
  return name == _DEFAULT or any(cfgs[k] != base[k] for k in kernels)


def attend_fn(name: str, head_dim: int, interpret: bool):
  """`attend(q, k, v, *, is_causal)` running variant `name` (what impls.timed_fn wraps)."""
  cfgs = variant_configs(name, head_dim)

  def attend(q, k, v, *, is_causal, window=None, segment_len=None):
    if window is not None or segment_len is not None:
      raise NotImplementedError("benchmarks.tune times unmasked and causal shapes only")
    out, _ = ops.attention(q, k, v, None, None, scale=1.0 / math.sqrt(head_dim),
                           spec=pallas_attn.MaskSpec(is_causal=is_causal), interpret=interpret,
                           fwd_cfg=cfgs["fwd"], dq_cfg=cfgs["dq"], dkv_cfg=cfgs["dkv"])
    return out
  return attend


# ---- ptxas -v through Mosaic GPU ------------------------------------------------------------

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> list[dict]:
  """[{"entry", "registers", "spill_stores", "spill_loads"}] per kernel in `ptxas -v` output."""
  kernels = []
  for line in text.splitlines():
    if m := _PTXAS_ENTRY.search(line):
      kernels.append({"entry": m.group(1), "registers": None, "spill_stores": None,
                      "spill_loads": None})
    elif kernels and (m := _PTXAS_SPILLS.search(line)):
      kernels[-1]["spill_stores"], kernels[-1]["spill_loads"] = int(m.group(1)), int(m.group(2))
    elif kernels and (m := _PTXAS_REGISTERS.search(line)):
      kernels[-1]["registers"] = int(m.group(1))
  return kernels


@contextlib.contextmanager
def captured_stdout(sink: list):
  """Appends to `sink` what anything in the process (C++ included) writes to file descriptor 1
  inside the block."""
  sys.stdout.flush()
  saved = os.dup(1)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 1)
    try:
      yield
    finally:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)
      tmp.seek(0)
      sink.append(tmp.read().decode(errors="replace"))


# ---- the measurement loop -------------------------------------------------------------------


def _poison_allocator(num_bytes: int):
  """Fill and free a NaN buffer so that the next allocations likely reuse NaN memory: a tile a
  variant fails to write shows up as NaN instead of the default's leftover values."""
  poison = jnp.full((num_bytes // 4,), jnp.nan, jnp.float32)
  poison.block_until_ready()
  poison.delete()


@dataclasses.dataclass(frozen=True)
class TuneConfig:
  variants: tuple[str, ...]
  passes: tuple[str, ...] = timing.PASSES
  dtype: str = "bf16"
  timing: timing.TimingConfig = timing.TimingConfig()
  max_rel_err: float = 2e-2
  compile_workers: int = 1
  budget_s: float | None = None
  ptxas: bool = False
  seed: int = 0

  @property
  def jnp_dtype(self):
    return sweep.DTYPES[self.dtype]


def _row(ctx: dict, name: str, shape: Shape, pass_: str, cfg: TuneConfig) -> dict:
  try:
    configs = {k: dataclasses.asdict(c) for k, c in variant_configs(name, shape.head_dim).items()}
  except ValueError:
    configs = None
  plain = lambda x: json.loads(json.dumps(x))  # tuples as lists: the row reads back equal
  return {"kind": "tune", "variant": name, "changes": plain(VARIANTS[name]),
          "configs": plain(configs),
          **shape.fields(), "dtype": cfg.dtype, "pass": pass_, "ms": None, "tflops": None,
          "ratio_to_default": None, "max_rel_err_vs_default": None, "compile_s": None,
          "calls_per_repeat": None, "ptxas": None, "error": None, "error_kind": None,
          "flops": timing.attention_flops(shape, pass_), **ctx}


def _compile_jobs(shape: Shape, names, cfg: TuneConfig, interpret: bool) -> dict:
  """{(variant, pass): thunk -> ((compiled, seconds), ptxas text or None)}."""
  def job(name, pass_):
    impl = impls_lib.Impl(name, attend_fn(name, shape.head_dim, interpret), interpret=interpret)
    if not cfg.ptxas:
      return sweep.compile_call(impl, shape, pass_, cfg.jnp_dtype), None
    out: list[str] = []
    with captured_stdout(out):
      result = sweep.compile_call(impl, shape, pass_, cfg.jnp_dtype)
    return result, out[0]
  return {(name, p): (lambda name=name, p=p: job(name, p))
          for name in names for p in cfg.passes if changes_pass(name, shape, p)}


def _skip(row: dict, kind: str, why: str) -> dict:
  row["error_kind"], row["error"] = kind, why
  return row


def run(shapes: list[Shape], cfg: TuneConfig, emit, interpret: bool, ctx: dict | None = None,
        log=lambda text: None):
  """Measures every (shape, variant, pass), calling `emit(row)` for each row when known."""
  ctx = ctx or sweep.run_context()
  start = time.perf_counter()
  over_budget = lambda: cfg.budget_s is not None and time.perf_counter() - start > cfg.budget_s
  dtype = cfg.jnp_dtype
  order = (_DEFAULT, *[n for n in cfg.variants if n != _DEFAULT])  # the default is the baseline
  plans = []  # per shape: (variants measured, {variant: why not measured, or None})
  for shape in shapes:
    why = {name: why_not(name, shape, dtype) for name in order}
    plans.append(([n for n in order if why[n] is None], why))
  # --ptxas reads the process's stdout, one compilation at a time: no threads. Nothing compiles
  # while a call is timed (see benchmarks/sweep.py: background compiles starve the timing thread).
  workers = 1 if cfg.ptxas else cfg.compile_workers
  for index, (shape, (names, why)) in enumerate(zip(shapes, plans)):
    compiled = None
    if not over_budget():
      log(f"compiling {len(names)} variants at {shape.name}")
      compiled = sweep.compile_all(_compile_jobs(shape, names, cfg, interpret), workers)
    _time_shape(shape, index, order, why, compiled, cfg, emit, ctx, over_budget, log)
    del compiled


def _time_shape(shape, index, order, why, compiled, cfg: TuneConfig, emit, ctx, over_budget, log):
  """Checks one shape's variants against the default (checked first), then times the ones that
  passed together, their repeats interleaved (`timing.time_interleaved`), with the default's
  executable a second time as `default_again`: its ratio to the default is the noise that the
  variants' ratios are to be read against. `compiled` None: skipped. Emits the shape's rows in
  `order` once they are all known."""
  inputs = None if compiled is None else impls_lib.random_inputs(shape, cfg.jnp_dtype,
                                                                 cfg.seed + index)
  default_out = {}
  poison_bytes = max(256 << 20, 4 * sum(x.size * x.dtype.itemsize for x in inputs or ()))
  rows, to_time = [], []  # to_time: (row, executable, args) checked, to be timed together
  for name in order:
    for p in cfg.passes:
      row = _row(ctx, name, shape, p, cfg)
      rows.append(row)
      if why[name] is not None:
        _skip(row, "same" if why[name].startswith("same") else "unsupported", why[name])
      elif not changes_pass(name, shape, p):
        _skip(row, "same", f"runs the default's kernels in {p}")
      elif compiled is None or over_budget():
        _skip(row, "skipped", "skipped: --budget-s exhausted")
      else:
        log(f"{name} {p} {shape.name}")
        checked = _check(row, name, p, compiled[(name, p)], inputs, default_out, poison_bytes,
                         cfg)
        if checked is not None:
          to_time.append((row, *checked))
  for row, executable, args in list(to_time):
    if row["variant"] == _DEFAULT:
      again = dict(_row(ctx, _DEFAULT, shape, row["pass"], cfg), variant=DEFAULT_AGAIN,
                   compile_s=row["compile_s"], max_rel_err_vs_default=0.0)
      rows.append(again)
      to_time.append((again, executable, args))
  if to_time:
    timings = timing.time_interleaved([(fn, args) for _, fn, args in to_time], cfg.timing)
    for (row, _, _), t in zip(to_time, timings):
      row["ms"], row["calls_per_repeat"] = t.ms, t.calls
      row["tflops"] = row["flops"] / t.ms / 1e9
  default_tflops = {r["pass"]: r["tflops"] for r in rows if r["variant"] == _DEFAULT}
  for row in rows:
    if row["tflops"] and default_tflops.get(row["pass"]):
      row["ratio_to_default"] = row["tflops"] / default_tflops[row["pass"]]
    emit(row)


def _check(row, name, pass_, compiled, inputs, default_out, poison_bytes, cfg: TuneConfig):
  """The variant's first call (on poisoned memory) against the default's output: (executable,
  args) to be timed, or None with the row's error set."""
  (result, ptxas_text), err = compiled
  if err is not None:
    row["error_kind"], row["error"] = memory.describe_error(err)
    return None
  executable, row["compile_s"] = result
  args = inputs[:3] if pass_ == "fwd" else inputs
  captured: list[str] = []
  try:
    with captured_stdout(captured) if cfg.ptxas else contextlib.nullcontext():
      _poison_allocator(poison_bytes)
      first = jax.block_until_ready(executable(*args))  # the kernels may build on first call
    if name == _DEFAULT:
      if sweep.max_rel_err(first, first) is None:  # NaN where the poison was left unwritten
        row["error_kind"], row["error"] = "wrong", "wrong: non-finite values (not timed)"
        return None
      default_out[pass_] = first
    elif pass_ not in default_out:
      row["error_kind"], row["error"] = "error", "not checked (the default failed): not timed"
      return None
    else:
      rel = sweep.max_rel_err(first, default_out[pass_])
      row["max_rel_err_vs_default"] = rel
      if rel is None or rel > cfg.max_rel_err:
        what = "non-finite values" if rel is None else f"rel err {rel:.2e} vs the default"
        row["error_kind"], row["error"] = "wrong", f"wrong: {what} (not timed)"
        return None
    del first
  except Exception as e:  # pylint: disable=broad-except
    row["error_kind"], row["error"] = memory.describe_error(e)
    return None
  finally:
    if cfg.ptxas:
      row["ptxas"] = parse_ptxas((ptxas_text or "") + "".join(captured))
  return executable, args


# ---- the table ------------------------------------------------------------------------------

_SHORT = {"same": "=", "unsupported": "n/a", "skipped": "skip", "wrong": "WRONG",
          "oom": "oom", "error": "ERR"}


def table(rows: list[dict]) -> str:
  """One line per variant; per shape and pass "TFLOP/s (ratio to the default)", or why not."""
  rows = [r for r in rows if r.get("kind") == "tune"]
  columns = list(dict.fromkeys((report.shape_label(r), r["pass"]) for r in rows))
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  cell = {(r["variant"], report.shape_label(r), r["pass"]): r for r in rows}

  def text(r):
    if r is None:
      return ""
    if r["error_kind"]:
      return _SHORT.get(r["error_kind"], "ERR")
    ratio = "" if r["ratio_to_default"] is None else f" ({r['ratio_to_default']:.2f})"
    return f"{r['tflops']:.3g}{ratio}"

  header = ["variant"] + [f"{label} {p}" for label, p in columns]
  lines = [[v] + [text(cell.get((v, label, p))) for label, p in columns] for v in variants]
  legend = ("TFLOP/s (ratio to default); '=' same kernels as the default, 'n/a' does not fit or "
            "invalid, 'WRONG' differs from the default, 'skip' over budget, 'ERR' failed")
  return report._table(header, lines) + "\n" + legend  # pylint: disable=protected-access


def ptxas_table(rows: list[dict]) -> str:
  """Registers and spills per kernel compiled (--ptxas), per variant and head_dim."""
  lines = []
  for r in rows:
    for k in r.get("ptxas") or ():
      lines.append([r["variant"], f"d{r['head_dim']}", r["pass"], k["entry"][:40],
                    str(k["registers"]), str(k["spill_stores"]), str(k["spill_loads"])])
  header = ["variant", "d", "pass", "kernel", "registers", "spill stores", "spill loads"]
  if not lines:
    return "(no ptxas output captured)"
  return report._table(header, lines)  # pylint: disable=protected-access


# ---- command line ---------------------------------------------------------------------------


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--shapes", default=None,
                 help=f"comma-separated presets from {sorted(shapes_lib.PRESETS)} (default: "
                      "d128_anchors on a GPU, tune_smoke on the CPU)")
  p.add_argument("--variants", default="all",
                 help="comma-separated names from VARIANTS (a trailing * matches a prefix: "
                      "'fwd_*'), or 'all'; the default always runs")
  p.add_argument("--passes", default="fwd,fwd_bwd")
  p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
  p.add_argument("--out", default=None, help="JSON lines file (one row per measurement)")
  p.add_argument("--budget-s", type=float, default=420.0,
                 help="wall seconds; past it the rest is recorded as skipped (0: no limit)")
  p.add_argument("--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--max-calls", type=int, default=20)
  p.add_argument("--max-rel-err", type=float, default=2e-2,
                 help="largest max|variant - default| / max|default| accepted")
  p.add_argument("--ptxas", action="store_true",
                 help="record registers and spills per kernel (MOSAIC_GPU_DUMP_PTXAS; compiles "
                      "one call at a time)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--list", action="store_true", help="print the variants and exit")
  p.add_argument("--quiet", action="store_true", help="no progress lines, no table")
  return p.parse_args(argv)


def select_variants(spec: str) -> list[str]:
  """Variant names from "all" or a comma-separated list whose entries may end in "*" (a prefix:
  "fwd_*" is every forward variant)."""
  if spec == "all":
    return list(VARIANTS)
  names = []
  for item in (v for v in spec.split(",") if v):
    matches = ([n for n in VARIANTS if n.startswith(item[:-1])] if item.endswith("*")
               else [item] if item in VARIANTS else [])
    if not matches:
      raise SystemExit(f"unknown variant {item!r}; choose from {list(VARIANTS)}")
    names += [n for n in matches if n not in names]
  return names


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.list:
    for name, changes in VARIANTS.items():
      print(f"{name:24s} {changes}")
    return []
  if args.ptxas:
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # read by Mosaic GPU at each compilation
  on_cpu = sweep.platform() == "cpu"
  names = select_variants(args.variants)
  # The interpreter: one timed call (it is a smoke test of the loop, not a measurement).
  timing_cfg = (timing.TimingConfig(warmup=1, repeats=0) if on_cpu else
                timing.TimingConfig(warmup=args.warmup, repeats=args.repeats,
                                    max_calls=args.max_calls))
  cfg = TuneConfig(variants=tuple(dict.fromkeys([_DEFAULT] + names)),
                   passes=tuple(p for p in args.passes.split(",") if p), dtype=args.dtype,
                   timing=timing_cfg, max_rel_err=args.max_rel_err,
                   compile_workers=args.compile_workers, budget_s=args.budget_s or None,
                   ptxas=args.ptxas, seed=args.seed)
  shapes = shapes_lib.preset(args.shapes or ("tune_smoke" if on_cpu else "d128_anchors"))
  rows: list[dict] = []
  out = None if args.out is None else pathlib.Path(args.out).open("w")  # closed below

  def emit(row):
    rows.append(row)
    if out is not None:
      out.write(json.dumps(row) + "\n")
      out.flush()

  log = (lambda text: None) if args.quiet else (lambda text: print(text, file=sys.stderr,
                                                                   flush=True))
  try:
    run(shapes, cfg, emit, interpret=on_cpu, log=log)
  finally:
    if out is not None:
      out.close()
  if not args.quiet:
    print(table(rows))
    if args.ptxas:
      print(ptxas_table(rows))
    skipped = sum(r["error_kind"] == "skipped" for r in rows)
    if skipped:
      print(f"{skipped} measurements skipped: --budget-s {args.budget_s:g} exhausted")
  return rows


if __name__ == "__main__":
  main()
