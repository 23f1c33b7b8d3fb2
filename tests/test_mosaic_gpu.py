"""The Mosaic GPU kernels (forward, dQ, dK/dV) against the float32 reference.

On the CPU they run in the Mosaic GPU interpreter (`interpret=True`, races detected), short cases
only: every masking feature appears there. Tests marked `gpu` compile the kernels for real on a
Hopper GPU: every case at head_dim 64, 128 and 256, both dtypes, long sequences (8k to 32k), with
the allocator poisoned with NaN so that tiles a kernel fails to write show up.
Run those on the H200 with: PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu.py
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import dispatch
from pallas_attn.mosaic_gpu import bwd
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import ops

LOW = (cases.BF16, cases.F16)


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter.


@pytest.mark.parametrize("case", cases.case_params((cases.BF16,), small=True, head_dim=64))
def test_interpreted_kernels_match_reference_bf16(case, seed):
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)


_F16_CASES = ("causal_113x203", "gqa_causal_lengths_113x203", "window_l32_r8_203x113",
              "lengths_kv0_113x203")


@pytest.mark.parametrize("name", _F16_CASES)
def test_interpreted_kernels_match_reference_f16(name, seed):
  case = cases.get_case(name).replace(dtype=cases.F16, head_dim=64)
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)


# Bottom-right alignment needs nothing of the kernels: their block ranges and tile masks come from
# mask.py, which folds the offset in. Checked here in the interpreter, T < S and T > S (rows that
# see no key).
@pytest.mark.parametrize("name", ["br_causal_113x203", "br_causal_203x113"])
def test_interpreted_kernels_bottom_right_alignment(name, seed):
  case = cases.get_case(name).replace(dtype=cases.BF16, head_dim=64)
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)


def test_interpreted_head_dim_128(seed):
  case = cases.get_case("gqa_causal_113x203").replace(dtype=cases.BF16, head_dim=128)
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)


def test_interpreter_found_no_race():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  case = cases.get_case("gqa_causal_lengths_113x203").replace(dtype=cases.BF16)
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=1)
  assert interpret_pallas_call.get_races().races_found is False


def test_kernel_path_has_no_quadratic_value():
  q_len, kv_len = 200, 330
  q = jax.ShapeDtypeStruct((1, q_len, 2, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, kv_len, 1, 64), jnp.bfloat16)

  def loss(q, k, v, do):
    out = pallas_attn.attention(q, k, v, is_causal=True, implementation="mosaic_gpu",
                                interpret=True)
    return jnp.vdot(out, do).astype(jnp.float32)

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  report = cases.find_quadratic_intermediates(fn, q, kv, kv, q, q_len=q_len, kv_len=kv_len)
  assert not report, report.offenders[:10]
  assert report.num_values > 100


def test_explicit_mosaic_gpu_without_hopper_says_so():
  if dispatch._has_hopper_gpu():
    pytest.skip("a Hopper GPU is present: the kernels compile for real")
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="no Hopper GPU.*interpret=True"):
    pallas_attn.attention(q, q, q, implementation="mosaic_gpu")


# ---------------------------------------------------------------------------------------------
# Kernel variants (config.KernelConfig options other than the table's): the tuner's candidates
# (benchmarks/tune.py), each combining several options so that few runs cover them all.

_K = config_lib.KernelConfig
_THREE_WGS = _K(64, 128, compute_warpgroups=3, ping_pong=False, compute_registers=160,
               fold_scale=True)
# The table's head_dim 64 dK/dV/dQ kernel at every length (the table itself takes the separate
# dQ kernel on rows of a few blocks: `separate_dq_max_blocks(_skewed)`).
_D64_ALWAYS_FUSED = dataclasses.replace(config_lib.DEFAULTS[(64, "dkv")],
                                        separate_dq_max_blocks_skewed=0, separate_dq_max_blocks=0)
# ... and head_dim 128's (its K / V tiles' descriptors built in the step), which the table runs
# where key tiles visit over 8 query blocks.
_D128_ALWAYS_FUSED = dataclasses.replace(config_lib.DEFAULTS[(128, "dkv")],
                                         separate_dq_max_blocks_skewed=0, separate_dq_max_blocks=0)
# name -> {pass: config}; the table's entry for the other passes.
_VARIANTS = {
    "kv192_reversed_tiles_first": {
        "fwd": _K(64, 192, reverse_q_tiles=True, grid_order=("tiles", "heads", "batch")),
        "dq": _K(64, 128, stages=3, reverse_q_tiles=True),
        "dkv": _K(128, 64, stages=3, grid_order=("heads", "batch", "tiles"))},
    "kv256_3stages_no_ping_pong_tiles_last": {
        "fwd": _K(64, 256, stages=3, ping_pong=False, grid_order=("heads", "batch", "tiles")),
        "dq": _K(64, 128, stages=1, grid_order=("tiles", "heads", "batch")),
        "dkv": _K(128, 64, stages=1)},
    "kv64_3stages": {"fwd": _K(64, 64, stages=3), "dq": _K(64, 64, stages=3),
                     "dkv": _K(64, 64, stages=3)},
    "overlap_qk_kv64_3stages": {"fwd": _K(64, 64, stages=3, overlap_qk=True)},
    # Two slots with the ping-pong (the producer refills K and V on their own releases).
    "overlap_qk": {"fwd": _K(64, 128, overlap_qk=True, fold_scale=True)},
    "overlap_qk_no_ping_pong": {"fwd": _K(64, 128, overlap_qk=True, ping_pong=False)},
    "fold_scale_ro_store": {"fwd": _K(64, 128, fold_scale=True, read_only_store_wait=True)},
    "fold_scale_overlap_qk": {"fwd": _K(64, 64, stages=3, overlap_qk=True, fold_scale=True)},
    # head_dim 256's backward before the head split: dQ with a [64, 256] accumulator per
    # warpgroup; dV, then dK, in two launches.
    "split_launches": {"dq": _K(64, 64, stages=1), "dkv": _K(64, 64, stages=1, split_dkv=True)},
    "fused_dq": {"dkv": _K(64, 64, fused_dq=True)},
    "fused_dq_q128": {"dkv": _K(128, 64, fused_dq=True)},
    "dq_column_halves": {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True)},
    "dq_column_halves_1stage": {"dkv": _K(64, 64, stages=1, fused_dq=True,
                                          dq_column_halves=True)},
    # The dQ part through a swizzled float32 tile.
    "fused_dq_swizzled": {"dkv": _K(64, 64, fused_dq=True, swizzle_f32=True)},
    "dq_column_halves_swizzled": {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True,
                                            swizzle_f32=True)},
    # dP's wgmma issued behind S's (P made while dP is on the tensor cores), in both kernels
    # and in the fused dK/dV/dQ one.
    "co_issue_dp": {"dq": _K(64, 64, co_issue_dp=True),
                    "dkv": _K(64, 64, co_issue_dp=True, co_issue_dkv=True)},
    "fused_dq_co_issue_dp": {"dkv": _K(64, 64, fused_dq=True, co_issue_dp=True,
                                       swizzle_f32=True, compute_registers=240)},
    # The fused dQ's wgmma issued behind dK's (and dV's), dS^T written while dK's runs: as the
    # table runs head_dim 64, with both co-issues at 128, and in column halves.
    "fused_dq_co_issue_dq": {"dkv": _K(128, 64, fused_dq=True, co_issue_dq=True)},
    "fused_dq_co_issue_dkv_dq": {"dkv": _K(64, 64, fused_dq=True, co_issue_dkv=True,
                                           co_issue_dq=True)},
    "dq_column_halves_co_issue_dq": {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True,
                                               co_issue_dkv=True, co_issue_dq=True,
                                               compute_registers=240)},
    # ... with each step's dQ wgmmas a step late (the dS^T tiles of the step before).
    "dq_column_halves_step_late": {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True,
                                             co_issue_dkv=True, co_issue_dq=True,
                                             dq_step_late=True, compute_registers=240)},
    "table_d64_always_fused": {"dkv": _D64_ALWAYS_FUSED},
    # ... with dQ of the whole 128-row query block in each warpgroup (the table before session
    # 38), in row halves (each warpgroup 64 of the 128 query rows, from both warpgroups' dS^T)
    # in lockstep, and those a step late (the table since).
    "dq_whole_block": {"dkv": dataclasses.replace(
        _D64_ALWAYS_FUSED, dq_row_halves=False, dq_step_late=False, compute_registers=232)},
    "dq_row_halves": {"dkv": dataclasses.replace(
        _D64_ALWAYS_FUSED, dq_row_halves=True, dq_step_late=False, compute_registers=232)},
    "dq_row_halves_step_late": {"dkv": dataclasses.replace(
        _D64_ALWAYS_FUSED, dq_row_halves=True, dq_step_late=True, compute_registers=240)},
    # ... and head_dim 128's.
    "table_d128_always_fused": {"dkv": _D128_ALWAYS_FUSED},
    # A kv head's query-head group over group_parts CTAs, each writing its own dK / dV
    # partials, added up after the kernel: head_dim 128's table, 2 heads a CTA of a group of 4
    # (1 of a group of 2); head_dim 64's, 1 head a CTA (2 of a group of 2: gcd); the separate
    # dK/dV kernel beside the dQ kernel.
    "group_parts_2": {"dkv": dataclasses.replace(_D128_ALWAYS_FUSED, group_parts=2)},
    "group_parts_4_d64": {"dkv": dataclasses.replace(_D64_ALWAYS_FUSED, group_parts=4)},
    "group_parts_2_unfused": {"dkv": _K(64, 64, co_issue_dp=True, co_issue_dkv=True,
                                        group_parts=2)},
    # The table's rule (`group_split_min_blocks`) at a threshold short tests reach: causal
    # walks of at least 2 query blocks on average go one query head a CTA.
    "group_split": {"dkv": dataclasses.replace(_D128_ALWAYS_FUSED, group_split_min_blocks=2)},
    # The K and V tiles' indices through an optimization barrier in each step (the fused
    # kernel's: `table_d128_always_fused`) in the separate dK/dV kernel, with and without the
    # overlap (the same products either way).
    "descriptors_in_step": {"dkv": _K(64, 64, co_issue_dp=True, co_issue_dkv=True,
                                      tile_descriptors_in_step=True)},
    "overlap_dkv_descriptors_in_step": {"dkv": _K(64, 64, stages=3, overlap_dkv=True,
                                                  tile_descriptors_in_step=True)},
    # q and dO as the register A operands of S's and dP's wgmmas (interpreted: from shared
    # memory, the same products), with dQ's wgmma left running (dS through shared memory).
    "dq_lhs_in_registers": {"dq": _K(64, 64, co_issue_dp=True, dq_lhs_in_registers=True,
                                     dq_in_flight=True), "dkv": _K(64, 64)},
    # dQ's wgmma left running into the next step (dS through two shared-memory tiles).
    # (The dK/dV kernel named too: at head_dim 64 the table's makes dQ itself, and no dQ kernel
    # would run.)
    "dq_in_flight": {"dq": _K(64, 64, co_issue_dp=True, dq_in_flight=True),
                     "dkv": _K(64, 64)},
    "dq_in_flight_3stages": {"dq": _K(64, 64, stages=3, dq_in_flight=True), "dkv": _K(64, 64)},
    # 128 query rows a warpgroup over 64-key blocks: warpgroup 0's causal range ends two blocks
    # before warpgroup 1's, so it releases two ring slots (of 2) after its last dQ wgmma.
    "dq_in_flight_q128": {"dq": _K(128, 64, dq_in_flight=True), "dkv": _K(64, 64)},
    # The step before's dQ wgmma issued behind this step's S and dP (dS kept in registers;
    # interpreted, staged through shared memory), with 2 and 3 slots, and 128 query rows (the
    # flush before a release: warpgroup 0 of a causal CTA skips two blocks after its last).
    "overlap_dq": {"dq": _K(64, 64, stages=3, overlap_dq=True), "dkv": _K(64, 64)},
    "overlap_dq_2stages": {"dq": _K(64, 64, overlap_dq=True), "dkv": _K(64, 64)},
    "overlap_dq_q128": {"dq": _K(128, 64, overlap_dq=True), "dkv": _K(64, 64)},
    # The same in the dK/dV kernel: the step before's dK wgmma behind this step's S^T and dP^T
    # (carried across the GQA group's heads, flushed before a skipped block).
    "overlap_dkv": {"dkv": _K(64, 64, stages=3, overlap_dkv=True)},
    "overlap_dkv_2stages": {"dkv": _K(64, 64, overlap_dkv=True)},
    "overlap_dkv_q128": {"dkv": _K(128, 64, overlap_dkv=True)},
    # Part of each score tile's exp2 on the FMA pipe: with the ping-pong (its masked columns
    # are the polynomial's at a causal diagonal), with the overlap, and every column.
    "exp2_fma": {"fwd": _K(64, 128, fold_scale=True, exp2_fma_cols=24)},
    "exp2_fma_overlap_qk": {"fwd": _K(64, 128, overlap_qk=True, ping_pong=False,
                                      fold_scale=True, exp2_fma_cols=32)},
    "exp2_fma_whole_tile": {"fwd": _K(64, 64, stages=3, exp2_fma_cols=64)},
    # The persistent grid (fwd.INTERPRET_CTAS = 3 CTAs in the interpreter, each walking several
    # (batch, head, q tile) items): plain, and heaviest causal tiles first with the overlap.
    "persistent": {"fwd": _K(64, 128, persistent=True)},
    "persistent_heavy_first_overlap_qk": {
        "fwd": _K(64, 64, stages=3, overlap_qk=True, fold_scale=True, reverse_q_tiles=True,
                  grid_order=("heads", "batch", "tiles"), persistent=True)},
    # Units of two query tiles (T - 1 - t, then t), as the table runs short rows: persistent
    # where the tiles visit at most 4 key blocks of 128 (3 where they are skewed: the causal
    # 460 x 460 case's tiles visit 1 to 4, 2.5 on average), the overlap without turns.
    "persistent_pairs": {"fwd": _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True,
                                   persistent_max_blocks=4, persistent_max_blocks_skewed=3,
                                   pair_q_tiles=True)},
    "persistent_pairs_ping_pong": {"fwd": _K(64, 64, persistent=True, pair_q_tiles=True)},
    # The same where skewed with the snake schedule: single tiles heaviest first, the rounds
    # alternating direction (16 units on 3 CTAs: the last, partial round runs backwards; 32
    # units: forwards).
    "persistent_snake": {"fwd": _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True,
                                   persistent_max_blocks=4, persistent_max_blocks_skewed=3,
                                   pair_q_tiles=True, snake_max_kv_heads=4)},
    # The forward's q tile indexed in the step (its QK^T descriptors built there): the
    # overlapped walk at block_kv 192 (and the plain one below, three warpgroups).
    "fwd_kv192_descriptors_in_step": {"fwd": _K(64, 192, overlap_qk=True, ping_pong=False,
                                                fold_scale=True, compute_registers=240,
                                                tile_descriptors_in_step=True)},
    # Three compute warpgroups (192-row CTAs; FlashAttention-3's head_dim 64 forward): a CTA's
    # last tile partly past the rows, with the overlap, persistent with tile pairs, and
    # persistent with the q tile indexed in the step.
    "three_warpgroups": {"fwd": _THREE_WGS},
    "three_warpgroups_overlap_qk": {"fwd": dataclasses.replace(_THREE_WGS, overlap_qk=True)},
    "three_warpgroups_persistent_pairs": {"fwd": dataclasses.replace(
        _THREE_WGS, persistent_max_blocks=4, persistent_max_blocks_skewed=4, pair_q_tiles=True)},
    "three_warpgroups_persistent_descriptors_in_step": {"fwd": dataclasses.replace(
        _THREE_WGS, persistent=True, pair_q_tiles=True, tile_descriptors_in_step=True)},
}
# Two query tiles of 128 rows and several key blocks at every block_kv, odd lengths.
_CAUSAL_203 = cases.get_case("causal_113x203").replace(q_len=203, name="causal_203x203")
# Persistent: batch 2 x 4 query heads (GQA 2) x 2 or 3 q tiles: 16 or 24 items on 3 CTAs.
_GQA_203 = cases.get_case("gqa_causal_113x203").replace(q_len=203, is_causal=False,
                                                         name="gqa_203x203")
_GQA_CAUSAL_203 = _GQA_203.replace(is_causal=True, name="gqa_causal_203x203")
# 4 query tiles of 128 rows a head (2 tile pairs).
_GQA_CAUSAL_460 = _GQA_CAUSAL_203.replace(q_len=460, kv_len=460, name="gqa_causal_460")
_GQA_CAUSAL_LENGTHS_330 = cases.get_case("gqa_causal_lengths_113x203").replace(
    q_len=330, kv_len=330, q_lengths=[330, 201], kv_lengths=[150, 330],
    name="gqa_causal_lengths_330x330")
# MQA with as many queries as keys: too many to pack the group into tile rows (`gqa_pack`), so
# the backward walks the group (mqa_113x203's 113 queries are packed: one head a kv head).
_MQA_203 = cases.get_case("mqa_113x203").replace(q_len=203, name="mqa_203x203")
_VARIANT_CASES = [
    ("kv192_reversed_tiles_first", _CAUSAL_203),
    ("kv192_reversed_tiles_first", cases.get_case("mqa_113x203")),  # dK/dV sums a group of 4
    ("kv256_3stages_no_ping_pong_tiles_last", cases.get_case("window_l32_r8_203x113")),
    ("kv64_3stages", cases.get_case("causal_113x203")),
    ("overlap_qk_kv64_3stages", _CAUSAL_203),
    ("overlap_qk_kv64_3stages", cases.get_case("lengths_kv0_113x203")),  # rows with no key
    ("overlap_qk_no_ping_pong", cases.get_case("window_l32_r8_203x113")),
    # Unmasked tiles (folded) next to masked ones (scaled by the scorer) in one running max.
    ("fold_scale_ro_store", _CAUSAL_203),
    ("fold_scale_overlap_qk", _CAUSAL_203),
    ("overlap_qk", _CAUSAL_203),
    ("overlap_qk", _GQA_CAUSAL_LENGTHS_330),  # skipped blocks take their turns too
    ("overlap_qk", cases.get_case("window_l32_r8_203x113")),
    # dQ from the dK/dV kernel: a group of 4 summed per kv head, masked end tiles, rows with no
    # key, and the bigger query block.
    ("fused_dq", _CAUSAL_203),
    ("fused_dq", cases.get_case("mqa_113x203")),
    ("fused_dq", cases.get_case("gqa_causal_lengths_113x203")),
    ("fused_dq", cases.get_case("lengths_kv0_113x203")),
    ("fused_dq_q128", cases.get_case("window_l32_r8_203x113")),
    # head_dim 128: a [64, 128] dQ part from two warpgroups per key tile.
    ("fused_dq", cases.get_case("gqa_causal_113x203").replace(head_dim=128)),
    # head_dim 128, each warpgroup a [64, 64] half of dQ from both warpgroups' dS^T: both step
    # every query block (zeros where their keys see none: causal diagonals, a window, key
    # lengths, rows with no key), a group of 4 summed per kv head; one stage (the dS^T tiles of
    # a slot rewritten at the next step).
    ("dq_column_halves", _CAUSAL_203.replace(head_dim=128)),
    ("dq_column_halves", cases.get_case("mqa_113x203").replace(head_dim=128)),
    ("dq_column_halves", cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    ("dq_column_halves", cases.get_case("lengths_kv0_113x203").replace(head_dim=128)),
    ("dq_column_halves_1stage", cases.get_case("window_l32_r8_203x113").replace(head_dim=128)),
    ("fused_dq_swizzled", cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    ("fused_dq_swizzled", cases.get_case("mqa_113x203")),
    ("dq_column_halves_swizzled", _CAUSAL_203.replace(head_dim=128)),
    ("co_issue_dp", _CAUSAL_203.replace(head_dim=128)),
    ("co_issue_dp", cases.get_case("gqa_causal_lengths_113x203")),
    ("fused_dq_co_issue_dp", cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    ("fused_dq_co_issue_dq", _CAUSAL_203),
    ("fused_dq_co_issue_dq", cases.get_case("gqa_causal_lengths_113x203")),
    ("fused_dq_co_issue_dkv_dq", cases.get_case("mqa_113x203").replace(head_dim=128)),
    ("dq_column_halves_co_issue_dq", _CAUSAL_203.replace(head_dim=128)),
    ("dq_column_halves_co_issue_dq", cases.get_case("lengths_kv0_113x203").replace(head_dim=128)),
    ("dq_lhs_in_registers", cases.get_case("gqa_causal_lengths_113x203")),
    # A step late: the pending dQ carried across the group's heads and flushed after the walk,
    # key tiles of no visible query (the first step's "step before" is the zeroed slot), and
    # several steps a head with lengths (the block-table walk: tests/test_block_mask.py).
    ("dq_column_halves_step_late", _CAUSAL_203.replace(head_dim=128)),
    ("dq_column_halves_step_late",
     cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    ("dq_column_halves_step_late", cases.get_case("lengths_kv0_113x203").replace(head_dim=128)),
    ("table_d64_always_fused", _CAUSAL_203),
    ("table_d128_always_fused", cases.get_case("mqa_113x203").replace(head_dim=128)),
    ("table_d64_always_fused", cases.get_case("gqa_causal_lengths_113x203")),
    ("table_d64_always_fused", cases.get_case("mqa_113x203")),  # not causal
    # head_dim 64's whole-block dQ (the table before session 38).
    ("dq_whole_block", _CAUSAL_203),
    ("dq_whole_block", cases.get_case("gqa_causal_lengths_113x203")),
    # head_dim 64's row halves: both warpgroups step every query block of the CTA, a group of 4
    # per kv head, rows with no key; a step late, the pending dQ across heads and key tiles
    # with no visible query.
    ("dq_row_halves", _CAUSAL_203),
    ("dq_row_halves", cases.get_case("gqa_causal_lengths_113x203")),
    # (causal and mqa_113x203 a step late: the table's, `table_d64_always_fused` above.)
    ("dq_row_halves_step_late", cases.get_case("lengths_kv0_113x203")),
    ("dq_row_halves_step_late", cases.get_case("window_l32_r8_203x113")),
    ("table_d128_always_fused", _GQA_CAUSAL_LENGTHS_330.replace(head_dim=128)),
    # A group of 4 in two parts (MQA), a group of 2 in two with lengths (and CTAs with no
    # visible query), a window; one head a part at head_dim 64, causal, and gcd(4, 2) parts of
    # a group of 2; the separate dK/dV kernel in parts.
    ("group_parts_2", _MQA_203.replace(head_dim=128)),
    ("group_parts_2", _GQA_CAUSAL_LENGTHS_330.replace(head_dim=128)),
    ("group_parts_2", cases.get_case("br_gqa_causal_window_l16_113x203").replace(head_dim=128)),
    ("group_parts_4_d64", cases.get_case("mqa_causal_203x113")),
    ("group_parts_4_d64", cases.get_case("gqa_causal_lengths_113x203")),
    ("group_parts_2_unfused", _MQA_203),
    # The rule splits the causal group of 2 with lengths (one head a CTA), not the
    # non-causal MQA walk (its tiles alike: the whole group of 4 in one CTA).
    ("group_split", _GQA_CAUSAL_LENGTHS_330.replace(head_dim=128)),
    ("group_split", _MQA_203.replace(head_dim=128)),
    ("descriptors_in_step", cases.get_case("mqa_113x203").replace(head_dim=128)),
    ("overlap_dkv_descriptors_in_step", cases.get_case("gqa_causal_lengths_113x203")),
    ("dq_in_flight", _CAUSAL_203.replace(head_dim=128)),
    ("dq_in_flight", cases.get_case("gqa_causal_lengths_113x203")),  # CTAs with no key block
    ("dq_in_flight_3stages", _CAUSAL_203),  # up to 4 key blocks a CTA, 3 slots
    ("dq_in_flight_q128", _CAUSAL_203),
    ("overlap_dq", _CAUSAL_203.replace(head_dim=128)),
    ("overlap_dq", cases.get_case("gqa_causal_lengths_113x203")),  # CTAs with no key block
    ("overlap_dq_2stages", cases.get_case("window_l32_r8_203x113")),
    ("overlap_dq_q128", _CAUSAL_203),
    ("overlap_dkv", _CAUSAL_203.replace(head_dim=128)),
    ("overlap_dkv", cases.get_case("gqa_causal_lengths_113x203")),  # key tiles past every query
    ("overlap_dkv_2stages", cases.get_case("window_l32_r8_203x113")),
    ("overlap_dkv_q128", _CAUSAL_203),
    ("exp2_fma", _CAUSAL_203),
    ("exp2_fma", cases.get_case("lengths_kv0_113x203")),  # rows with no key: l stays 0
    ("exp2_fma_overlap_qk", _CAUSAL_203.replace(head_dim=128)),
    ("exp2_fma_whole_tile", cases.get_case("window_l32_r8_203x113")),
    ("split_launches", cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=256)),
    ("persistent", _GQA_203),
    ("persistent", _GQA_CAUSAL_203),
    ("persistent", cases.get_case("lengths_kv0_113x203")),  # items with no key at all
    ("persistent_heavy_first_overlap_qk", _GQA_CAUSAL_203),
    # 4 query tiles a head (2 pairs), 16 units on 3 CTAs; causal with lengths; 3 tiles (odd:
    # single tiles); and past persistent_max_blocks (the one-tile grid).
    ("persistent_pairs", _GQA_CAUSAL_460),
    ("persistent_pairs_ping_pong", _GQA_CAUSAL_LENGTHS_330.replace(q_len=460, kv_len=460,
                                                                   q_lengths=[460, 201])),
    ("persistent_pairs", cases.get_case("mha_17x17").replace(q_len=113, kv_len=600,
                                                             name="mha_113x600")),
    ("persistent_snake", _GQA_CAUSAL_203),
    ("persistent_snake", _GQA_CAUSAL_LENGTHS_330.replace(q_len=460, kv_len=460,
                                                         q_lengths=[460, 201])),
    ("fwd_kv192_descriptors_in_step", _CAUSAL_203),
    ("fwd_kv192_descriptors_in_step", _GQA_CAUSAL_LENGTHS_330),
    ("three_warpgroups_persistent_descriptors_in_step", _GQA_CAUSAL_203),
    ("three_warpgroups", _CAUSAL_203),  # 256 rows: the second CTA's last two tiles are past
    ("three_warpgroups", cases.get_case("gqa_causal_lengths_113x203")),
    ("three_warpgroups", cases.get_case("lengths_kv0_113x203")),
    ("three_warpgroups_overlap_qk", _CAUSAL_203),
    ("three_warpgroups_persistent_pairs", _GQA_CAUSAL_460),
    ("three_warpgroups_persistent_pairs", cases.get_case("window_l32_r8_203x113")),
]


@contextlib.contextmanager
def kernel_table(head_dim: int, configs: dict):
  """config.DEFAULTS with `configs` ({pass: KernelConfig}) at `head_dim`, so that calls through
  the public API use them. jax's caches are cleared on entry and exit: a trace made with the
  other table must not be reused."""
  saved = dict(config_lib.DEFAULTS)
  config_lib.DEFAULTS.update({(head_dim, p): cfg for p, cfg in configs.items()})
  jax.clear_caches()
  try:
    yield
  finally:
    config_lib.DEFAULTS.clear()
    config_lib.DEFAULTS.update(saved)
    jax.clear_caches()


def test_kernel_table_reaches_the_kernels():
  """The patched table is what a call uses (else the variant tests would test the defaults)."""
  configs = _VARIANTS["kv64_3stages"]
  with kernel_table(64, configs):
    static = ops._static(64, 1.0, pallas_attn.MaskSpec(), True)
  assert (static.fwd_cfg, static.dq_cfg, static.dkv_cfg) == (
      configs["fwd"], configs["dq"], configs["dkv"])
  assert ops._static(64, 1.0, pallas_attn.MaskSpec(), True).fwd_cfg == config_lib.DEFAULTS[
      (64, "fwd")]


@pytest.mark.parametrize("variant,case", [pytest.param(v, c.replace(dtype=cases.BF16),
                                                       id=f"{v}-{c.name}")
                                          for v, c in _VARIANT_CASES])
def test_interpreted_variants_match_reference(variant, case, seed):
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  with kernel_table(case.head_dim, _VARIANTS[variant]):
    cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)
  assert interpret_pallas_call.get_races().races_found is False


_PERSISTENT_FORWARDS = [
    # head_dim 256: the output goes out in two column halves through a half-width tile of its
    # own (no room for a whole one).
    pytest.param(256, _K(64, 64, persistent=True), {}, id="d256-out_tile_halves"),
    # head_dim 128 with 192-key blocks: no room for even half a tile; the output goes through
    # the q tile, so each next q waits for the store.
    pytest.param(128, _K(64, 192, persistent=True), {}, id="d128-kv192-shared_out_tile"),
    # The next q loaded after the walk's loops (`next_q_after_walk`): the table's overlapped
    # d128 forward, and the plain walk at d64.
    pytest.param(128, _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True,
                         persistent=True, next_q_after_walk=True), {}, id="d128-q_after_walk"),
    pytest.param(64, _K(64, 64, persistent=True, next_q_after_walk=True),
                 dict(kv_lengths=[203, 120]), id="d64-q_after_walk_lengths"),
    # The block-table walk (segment ids) and every modifier that reads per-item arrays.
    pytest.param(64, _K(64, 64, persistent=True, reverse_q_tiles=True), dict(
        q_segment_ids=True, logits_soft_cap=20.0, dropout_rate=0.1, kv_lengths=[203, 120]),
                 id="d64-segments_softcap_dropout_lengths"),
]


@pytest.mark.parametrize("mods", [
    pytest.param(dict(kv_lengths=[203, 120]), id="lengths"),
    pytest.param(dict(q_segment_ids=True), id="segments"),  # a block table: two warpgroups walk it
])
def test_interpreted_three_warpgroups_equal_two(mods, seed):
  """Three compute warpgroups compute each 64-row tile as two do: identical out and lse."""
  _assert_forwards_identical(64, mods, seed, _THREE_WGS, _THREE_WGS.two_warpgroups())


def test_three_warpgroups_config():
  """Registers of four warpgroups (128 a thread at launch), no ping-pong, forward only."""
  assert _THREE_WGS.rows_per_cta == 192 and _THREE_WGS.producer_registers == 32
  assert _THREE_WGS.two_warpgroups().rows_per_cta == 128
  with pytest.raises(ValueError, match="ping_pong"):
    _K(64, 128, compute_warpgroups=3, compute_registers=160)
  with pytest.raises(ValueError, match="compute_registers must be .* from 128 to 160"):
    _K(64, 128, compute_warpgroups=3, ping_pong=False)
  with pytest.raises(ValueError, match="dq_cfg: the backward kernels run 2"):
    ops._static(64, 1.0, pallas_attn.MaskSpec(), True, dq_cfg=_THREE_WGS)


@pytest.mark.parametrize("head_dim,cfg,mods", _PERSISTENT_FORWARDS)
def test_interpreted_persistent_forward_equals_default(head_dim, cfg, mods, seed):
  """The persistent forward computes every tile as the one-tile CTA does: identical out and lse
  (batch 2 x 4 query heads x 2 q tiles on 3 CTAs, causal, GQA)."""
  _assert_forwards_identical(head_dim, mods, seed, cfg, dataclasses.replace(cfg, persistent=False))


def _assert_forwards_identical(head_dim, mods, seed, cfg, other_cfg):
  """The interpreted forwards of `cfg` and `other_cfg` give bit-identical out and lse, without
  races (batch 2, 203 rows and keys, 4 query heads over 2, causal; `mods`: dropout_rate,
  logits_soft_cap, q_segment_ids=True (two documents a row), kv_lengths (a list))."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (2, 203, 4, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 203, 2, head_dim), jnp.bfloat16) for key in keys[1:])
  kwargs = dict(mods)
  if kwargs.pop("q_segment_ids", False):
    segments = jnp.stack([jnp.arange(203) // 70, jnp.arange(203) // 150]).astype(jnp.int32)
    kwargs.update(q_segment_ids=segments, kv_segment_ids=segments)
  if "dropout_rate" in kwargs:
    kwargs["dropout_seed"] = jnp.array([3, 4], jnp.uint32)
  kv_lengths = kwargs.pop("kv_lengths", None)
  kv_lengths = None if kv_lengths is None else jnp.array(kv_lengths, jnp.int32)
  run = lambda c: ops.attention(q, k, v, None, kv_lengths, scale=head_dim ** -0.5,
                                spec=pallas_attn.MaskSpec(is_causal=True), interpret=True,
                                fwd_cfg=c, kv_splits=1, **kwargs)
  for g, w in zip(run(cfg), run(other_cfg)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  assert interpret_pallas_call.get_races().races_found is False


# head_dim -> configs: every option, and the largest tiles that fit, at least once.
_LOWERED_VARIANTS = [
    (64, {"fwd": _K(64, 256, stages=3), "dq": _K(64, 128, stages=3), "dkv": _K(128, 64, 3)}),
    (128, {"fwd": _K(64, 192), "dq": _K(64, 128), "dkv": _K(128, 64)}),
    (128, {"fwd": _K(64, 64, stages=3, reverse_q_tiles=True, ping_pong=False,
                     grid_order=("tiles", "heads", "batch")),
           "dq": _K(64, 64, stages=3, reverse_q_tiles=True, grid_order=("heads", "batch", "tiles")),
           "dkv": _K(64, 64, stages=3, grid_order=("tiles", "heads", "batch"))}),
    (256, {"fwd": _K(64, 128, stages=1)}),
    (128, {"fwd": _K(64, 128, stages=3, overlap_qk=True)}),
    (128, {"fwd": _K(64, 128, overlap_qk=True, fold_scale=True)}),
    (256, {"fwd": _K(64, 64, overlap_qk=True, fold_scale=True, compute_registers=240)}),
    (256, {"fwd": _K(64, 64, overlap_qk=True, ping_pong=False)}),
    (128, {"fwd": _K(64, 128, fold_scale=True, read_only_store_wait=True)}),
    (128, {"dkv": _K(64, 64, fused_dq=True)}),
    (64, {"dkv": _K(128, 64, fused_dq=True)}),
    (128, {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True)}),
    (128, {"fwd": _K(64, 128, persistent=True)}),
    (64, {"fwd": _K(64, 128, stages=3, overlap_qk=True, fold_scale=True, reverse_q_tiles=True,
                    grid_order=("heads", "batch", "tiles"), persistent=True)}),
    (256, {"fwd": _K(64, 64, persistent=True)}),  # the output in two column halves
    (128, {"fwd": _K(64, 192, persistent=True)}),  # the output through the q tile
    (128, {"fwd": _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True,
                     persistent_max_blocks=1 << 20, pair_q_tiles=True)}),
    (128, {"fwd": _VARIANTS["fwd_kv192_descriptors_in_step"]["fwd"]}),
    (64, {"fwd": _THREE_WGS}),
    (64, {"fwd": dataclasses.replace(_THREE_WGS, overlap_qk=True, persistent=True,
                                     pair_q_tiles=True)}),
    (64, {"fwd": _K(64, 128, fold_scale=True, exp2_fma_cols=24)}),
    (128, {"fwd": _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True,
                     exp2_fma_cols=32)}),
    (256, {"fwd": _K(64, 64, overlap_qk=True, ping_pong=False, exp2_fma_cols=64)}),
    # FlashAttention-3's register split (240 / 24) in every kind of kernel (the fused dK/dV/dQ
    # one below, with co_issue_dp; a fused dK/dV config would leave the dQ kernel unbuilt).
    (128, {"fwd": _K(64, 128, compute_registers=240), "dq": _K(64, 64, compute_registers=240),
           "dkv": _K(64, 64, compute_registers=240)}),
    (256, {"dq": _K(64, 64, head_split=True, compute_registers=240),
           "dkv": _K(64, 64, head_split=True, dp_ahead=True, compute_registers=240)}),
    # Swizzled float32 tiles: the fused dQ part (whole, and column halves), the dP hand-over.
    (128, {"dkv": _K(64, 64, fused_dq=True, swizzle_f32=True)}),
    (128, {"dkv": _K(64, 64, fused_dq=True, co_issue_dp=True, compute_registers=240)}),
    (64, {"dq": _K(64, 128, co_issue_dp=True), "dkv": _K(128, 64, co_issue_dp=True)}),
    (128, {"dkv": _K(64, 64, co_issue_dp=True, co_issue_dkv=True)}),
    (128, {"dq": _K(64, 64, co_issue_dp=True, dq_in_flight=True)}),
    (64, {"dq": _K(64, 128, stages=3, dq_in_flight=True),
          "dkv": _K(64, 64, co_issue_dp=True, co_issue_dkv=True)}),
    (256, {"dkv": _K(64, 64, stages=1, split_dkv=True, co_issue_dp=True, co_issue_dkv=True)}),
    (64, {"dkv": _K(128, 64, fused_dq=True, swizzle_f32=True)}),
    (128, {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True, swizzle_f32=True)}),
    (256, {"dq": _K(64, 64, head_split=True, swizzle_f32=True),
           "dkv": _K(64, 64, head_split=True, swizzle_f32=True)}),
    (64, {"dkv": _K(128, 64, fused_dq=True, co_issue_dq=True)}),
    (64, {"dkv": _K(128, 64, fused_dq=True, co_issue_dkv=True, co_issue_dq=True)}),
    (128, {"dkv": _K(64, 64, fused_dq=True, co_issue_dkv=True, co_issue_dq=True,
                     compute_registers=240)}),
    (128, {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True, co_issue_dp=True,
                     co_issue_dkv=True, co_issue_dq=True)}),
    (128, {"dq": _K(64, 64, co_issue_dp=True, dq_lhs_in_registers=True)}),
    (128, _VARIANTS["dq_column_halves_step_late"]),
    (64, _VARIANTS["dq_row_halves"]),
    (64, _VARIANTS["dq_row_halves_step_late"]),
    (128, {"dq": _K(64, 64, dq_lhs_in_registers=True, dq_in_flight=True,
                    compute_registers=240)}),
    (128, {"dq": _K(64, 64, stages=3, overlap_dq=True)}),
    (128, {"dq": _K(64, 64, stages=3, overlap_dq=True),
           "dkv": _K(64, 64, stages=3, overlap_dkv=True)}),
    (64, {"dkv": _K(128, 64, overlap_dkv=True, compute_registers=240)}),
    (128, {"dq": _K(64, 64, overlap_dq=True, dq_lhs_in_registers=True, compute_registers=240)}),
    (64, {"dq": _K(64, 64, co_issue_dp=True, dq_lhs_in_registers=True), "dkv": _K(64, 64)}),
]


def test_register_split_is_checked():
  """The producer keeps what the compute warpgroups leave of the launch (3 x 168 per thread)."""
  assert _K(64, 64).producer_registers == 40
  assert _K(64, 64, compute_registers=240).producer_registers == 24
  for bad in (236, 248, 160):
    with pytest.raises(ValueError, match="compute_registers"):
      _K(64, 64, compute_registers=bad)


def test_co_issue_dq_needs_the_fused_dq():
  with pytest.raises(ValueError, match="co_issue_dq.*fused_dq=True"):
    _K(64, 64, co_issue_dq=True)


@pytest.mark.parametrize("changes", [dict(dq_column_halves=False), dict(co_issue_dq=False)])
def test_dq_step_late_needs_co_issued_halves(changes):
  fields = dict(fused_dq=True, dq_column_halves=True, co_issue_dq=True, dq_step_late=True)
  _K(64, 64, **fields)
  _K(128, 64, **{**fields, "dq_column_halves": False, "dq_row_halves": True})
  with pytest.raises(ValueError, match="dq_step_late.*dq_row_halves=True, and co_issue_dq"):
    _K(64, 64, **{**fields, **changes})


@pytest.mark.parametrize("fields,message", [
    (dict(block_q=64, fused_dq=True, dq_row_halves=True), "dq_row_halves needs block_q a multiple"),
    (dict(block_q=128, dq_row_halves=True), "dq_row_halves is a layout of the fused dQ"),
    (dict(block_q=128, fused_dq=True, dq_row_halves=True, dq_column_halves=True), "take one"),
    (dict(block_q=128, fused_dq=True, dq_row_halves=True, head_split=True), "head_split"),
])
def test_dq_row_halves_is_checked(fields, message):
  with pytest.raises(ValueError, match=message):
    _K(block_kv=64, **fields)


def test_group_parts_is_checked():
  """group_parts splits the dK/dV kernel's group, in parts that divide it."""
  assert [_K(64, 64, group_parts=4).group_parts_for(g) for g in (1, 2, 4, 8, 6)] == [1, 2, 4, 4, 2]
  with pytest.raises(ValueError, match="group_parts must be >= 1"):
    _K(64, 64, group_parts=0)


def test_group_split_rule():
  """`group_split_min_blocks`: one query head a CTA where the key tiles' walks are skewed
  (causal) and long enough on average; the whole group otherwise, and an explicit group_parts
  wins."""
  causal_16 = [32 - 2 * t for t in range(16)]  # 16 key tiles of 2 blocks over 32 query blocks
  assert sum(causal_16) / 16 == 17
  rule = _K(64, 64, group_split_min_blocks=17)
  assert [rule.group_parts_for(g, causal_16) for g in (1, 2, 4, 6)] == [1, 2, 4, 6]
  assert _K(64, 64, group_split_min_blocks=18).group_parts_for(4, causal_16) == 1  # too short
  assert rule.group_parts_for(4, [32] * 16) == 1  # not skewed (no mask)
  assert rule.group_parts_for(4, []) == 1  # no key tiles
  assert rule.group_parts_for(4) == 1
  assert _K(64, 64, group_parts=2, group_split_min_blocks=17).group_parts_for(4, causal_16) == 2
  with pytest.raises(ValueError, match="group_split_min_blocks must be >= 0"):
    _K(64, 64, group_split_min_blocks=-1)


def test_table_splits_long_causal_groups():
  """head_dim 128's table splits a causal group of 4 at N 16384 (the measured gain) and keeps
  it whole at N 4096 and without a mask."""
  cfg = config_lib.DEFAULTS[(128, "dkv")]
  blocks = lambda n, causal: bwd.key_tile_blocks(
      pallas_attn.MaskSpec(is_causal=causal), n, n, cfg)
  assert cfg.group_parts_for(4, blocks(16384, True)) == 4
  assert cfg.group_parts_for(4, blocks(4096, True)) == 1
  assert cfg.group_parts_for(4, blocks(16384, False)) == 1


@pytest.mark.parametrize("head_dim,is_causal,window,seq,fused", [
    (64, True, None, 1024, False),  # key tiles visit 1 to 8 query blocks: 4.5 on average
    (64, True, None, 2048, False),  # 8.5
    (64, True, None, 4096, True),  # 16.5
    (64, False, None, 512, False),  # 4 each
    (64, False, None, 1024, True),  # 8 each
    (64, True, (256, 0), 4096, False),  # a window: 3 each but the last two tiles' (not skewed)
    (128, True, None, 512, False),  # head_dim 128: 4.5 on average
    (128, False, None, 512, False),  # 8 each
    (128, True, None, 1024, True),  # 8.5 on average
    (128, False, None, 8192, True),  # 128 each
    (128, True, None, 16384, True),  # 129 on average
    (128, False, None, 16384, True),  # 256
    (256, False, None, 512, False),  # head_dim 256 (the head split): 8 each
    (256, False, None, 1024, False),  # 16 each
    (256, True, None, 1024, False),  # 8.5 on average
    (256, True, None, 2048, True),  # 16.5 on average
    (256, False, None, 2048, True),  # 32 each
    (256, False, None, 16384, True),  # 256
])
def test_backward_fuses_dq_by_the_key_tiles_visits(head_dim, is_causal, window, seq, fused):
  """`separate_dq_max_blocks(_skewed)`: rows of a few blocks take the separate dQ kernel, and
  the dK/dV config unfused in the dQ kernel's tiles, with its dP co-issue and registers."""
  spec = pallas_attn.MaskSpec(is_causal=is_causal, local_window=window)
  static = ops._static(head_dim, 1.0, spec, False)
  dq_cfg, dkv_cfg = ops._backward_configs(static, seq, seq)
  assert dq_cfg == static.dq_cfg
  assert dkv_cfg.fused_dq == fused
  if fused or not static.dkv_cfg.fused_dq:
    assert dkv_cfg == static.dkv_cfg
  else:
    assert (dkv_cfg.block_q, dkv_cfg.block_kv, dkv_cfg.co_issue_dp,
            dkv_cfg.compute_registers) == (dq_cfg.block_q, dq_cfg.block_kv, dq_cfg.co_issue_dp,
                                           dq_cfg.compute_registers)
    assert not (dkv_cfg.co_issue_dq or dkv_cfg.dq_column_halves or dkv_cfg.dq_step_late
                or dkv_cfg.tile_descriptors_in_step or dkv_cfg.one_do_slot)
    assert dkv_cfg.head_split == static.dkv_cfg.head_split
    assert dkv_cfg.co_issue_dkv == static.dkv_cfg.co_issue_dkv


def _lowered_backward(q, k, *, is_causal: bool, **cfgs) -> str:
  """The text of `ops.attention`'s forward + backward at q / k's shapes (v like k; `cfgs`:
  fwd_cfg, dq_cfg, dkv_cfg overrides), lowered for CUDA (the Pallas -> Mosaic GPU lowering the
  interpreter does not run)."""

  def loss(q, k, v):
    out, _ = ops.attention(q, k, v, None, None, scale=0.1,
                           spec=pallas_attn.MaskSpec(is_causal=is_causal), **cfgs)
    return out.astype(jnp.float32).sum()

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("is_causal,seq,kernels", [(True, 1000, 3), (False, 300, 3),
                                                   (False, 1000, 2)])
def test_short_rows_lower_the_separate_dq_kernel(is_causal, seq, kernels):
  """Through the table at head_dim 64: causal 1000 rows (4.5 visits a key tile on average) and
  300 rows (3 each), forward, dQ and dK/dV kernels; 1000 rows not causal (8 each), the forward
  and the dK/dV kernel that makes dQ."""
  q = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)
  assert _lowered_backward(q, q, is_causal=is_causal).count("mosaic_gpu_v2") == kernels


def test_dq_lhs_in_registers_is_the_plain_dq_kernels():
  with pytest.raises(ValueError, match="dq_lhs_in_registers.*head_split"):
    _K(64, 64, head_split=True, dq_lhs_in_registers=True)


def test_separate_dq_max_blocks_is_checked():
  with pytest.raises(ValueError, match="separate_dq_max_blocks_skewed"):
    _K(128, 64, fused_dq=True, separate_dq_max_blocks_skewed=-1)


def test_backward_overlaps_are_checked():
  with pytest.raises(ValueError, match="overlap_dq needs stages >= 2"):
    _K(64, 64, stages=1, overlap_dq=True)
  with pytest.raises(ValueError, match="overlap_dq is a layout"):
    _K(64, 64, overlap_dq=True, dq_in_flight=True)
  with pytest.raises(ValueError, match="overlap_dkv needs stages >= 2"):
    _K(64, 64, stages=1, overlap_dkv=True)
  with pytest.raises(ValueError, match="overlap_dkv is a layout"):
    _K(64, 64, overlap_dkv=True, fused_dq=True)


def test_dq_in_flight_needs_two_slots():
  """A K slot is released at the next step's first wait, which waits for the next block."""
  with pytest.raises(ValueError, match="stages >= 2"):
    _K(64, 64, stages=1, dq_in_flight=True)


@pytest.mark.parametrize("block_kv,kv_len,padded", [(192, 4096, 4096), (192, 100, 192),
                                                     (256, 1000, 1024), (128, 1000, 1024)])
def test_forward_key_blocks_reach_past_keys_unpadded(block_kv, kv_len, padded):
  """K and V are padded to the backward's tiles (128 keys here) and to one forward block at
  least, not to whole forward blocks: a last block of 192 past the 4096 keys is read as the TMA
  copy's zeros (interpreted: the kv192 variant cases above), not copied."""
  q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, kv_len, 2, 64), jnp.bfloat16)
  forward = functools.partial(ops.forward, scale=0.1, spec=pallas_attn.MaskSpec(),
                              fwd_cfg=_K(64, block_kv, overlap_qk=True, ping_pong=False))
  jaxpr = jax.make_jaxpr(lambda q, k, v: forward(q, k, v, None, None))(q, k, k)
  kernel_inputs = [eqn.invars for eqn in _all_eqns(jaxpr.jaxpr)
                   if eqn.primitive.name == "mpmd_map"]  # (the plgpu.kernel launch)
  assert len(kernel_inputs) == 1
  assert [v.aval.shape[1] for v in kernel_inputs[0][1:3]] == [padded, padded]


@pytest.mark.parametrize("head_dim,configs", _LOWERED_VARIANTS,
                         ids=[f"d{d}-{i}" for i, (d, _) in enumerate(_LOWERED_VARIANTS)])
def test_variant_kernels_lower_for_cuda(head_dim, configs):
  """The variants pass the Pallas -> Mosaic GPU lowering, which the interpreter does not run
  (and whose shared-memory check is the real one: block_kv 192 at head_dim 128 fits)."""
  q = jax.ShapeDtypeStruct((1, 300, 2, head_dim), jnp.bfloat16)
  text = _lowered_backward(q, q, is_causal=True,
                           **{f"{p}_cfg": cfg for p, cfg in configs.items()})
  fused_dq = configs.get("dkv", config_lib.kernel_config(head_dim, "dkv")).fused_dq
  # forward, dQ, dK/dV; or forward and dK/dV making dQ
  assert text.count("mosaic_gpu_v2") >= (2 if fused_dq else 3)


@pytest.mark.parametrize("head_dim,variant", [(128, "group_parts_2"), (64, "group_parts_4_d64")])
def test_group_parts_lower_for_cuda(head_dim, variant):
  """The dK/dV kernel over a group of 8 in parts passes the lowering for CUDA, its grid over
  (kv head, part) and its outputs one [B, S, Hkv * parts, D] partial each, added after."""
  q = jax.ShapeDtypeStruct((1, 300, 8, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 300, 1, head_dim), jnp.bfloat16)
  dkv_cfg = _VARIANTS[variant]["dkv"]
  text = _lowered_backward(q, k, is_causal=True, dkv_cfg=dkv_cfg)
  parts = dkv_cfg.group_parts_for(8)
  assert 1 < parts < 8
  assert f"1x384x{parts}x{head_dim}xbf16" in text  # (keys padded to 384)


@pytest.mark.parametrize("is_causal", [True, False])
def test_group_split_lowers_one_head_a_cta(is_causal):
  """The rule at the call: a causal group of 4 (its key tiles visit 6, 4, 2 and 0 query blocks)
  lowers one query head a dK/dV CTA, its partials [B, S, Hq, D]; without a mask, the whole
  group ([B, S, Hkv, D], which the kernel writes anyway)."""
  q = jax.ShapeDtypeStruct((1, 300, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 500, 2, 128), jnp.bfloat16)
  text = _lowered_backward(q, k, is_causal=is_causal, dkv_cfg=_VARIANTS["group_split"]["dkv"])
  assert ("1x512x8x128xbf16" in text) == is_causal  # (keys padded to 512)
  assert "1x512x2x128xbf16" in text


@pytest.mark.parametrize("schedule_kind,num_q_tiles,units_other,num_ctas", [
    (kind, *shape) for kind in ("strided", "paired", "snake")
    for shape in ((8, 32, 132), (4, 6, 5), (2, 3, 7), (128, 16, 132), (5, 7, 4))
    if not (kind == "paired" and shape[0] % 2)])  # (pairs: an even tile count)
def test_persistent_schedule_covers_every_item_once(schedule_kind, num_q_tiles, units_other,
                                                    num_ctas):
  """Every (batch x head, q tile) item goes to exactly one CTA step. Under a causal mask (tile
  t of T weighs t + 1 key blocks): with pairs each unit is tiles T - 1 - t and t, so every
  CTA's load is whole units of T + 1 tiles, and the CTAs' loads differ by one unit at most;
  the snake (units heaviest first: the forward reverses the q tiles, as here) balances single
  tiles to within one tile, and at b1 h16 N 16384 (128 tiles of 128 rows on 132 CTAs) to 0.3%
  of the mean load, where the 1024 pairs leave the most loaded CTA 3% over it."""
  from pallas_attn.mosaic_gpu import fwd
  paired, snake = schedule_kind == "paired", schedule_kind == "snake"
  tiles = num_q_tiles // 2 if paired else num_q_tiles
  sizes = (("heads", units_other), ("q_tiles", tiles))
  total = units_other * tiles
  schedule = fwd._Schedule(sizes, min(num_ctas, total), num_q_tiles if paired else 0, snake)
  weight = (lambda t: num_q_tiles - t) if snake else (lambda t: t + 1)  # (the snake's reversed)
  seen, loads = [], []
  for cta in range(schedule.num_ctas):
    steps = int(schedule.count(cta))
    items = [schedule.item(cta, step) for step in range(steps)]
    seen += [(int(c["heads"]), int(c["q_tiles"])) for c in items]
    loads.append(sum(weight(int(c["q_tiles"])) for c in items))
  assert sorted(seen) == [(h, t) for h in range(units_other) for t in range(num_q_tiles)]
  mean = sum(loads) / len(loads)
  if paired:
    assert all(load % (num_q_tiles + 1) == 0 for load in loads), loads
    assert max(loads) - min(loads) <= num_q_tiles + 1, loads
  if snake:
    assert max(loads) - min(loads) <= num_q_tiles, loads
  if (num_q_tiles, units_other, num_ctas) == (128, 16, 132) and schedule_kind != "strided":
    assert max(loads) / mean < (1.005 if snake else 1.04), (schedule_kind, max(loads) / mean)


def _all_eqns(jaxpr):
  """The equations of `jaxpr` and of every jaxpr nested in their parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)  # (a ClosedJaxpr's, or a custom call's function)
        if hasattr(inner, "eqns"):
          yield from _all_eqns(inner)


def test_persistent_max_blocks_picks_the_grid():
  """persistent_max_blocks(_skewed) turn the persistent grid on where the query tiles visit
  that many key blocks on average (skewed: the largest over 1.25x the mean), and the forward's
  launch then has one CTA per (interpreter) SM; past it, one CTA per query tile."""
  from pallas_attn.mosaic_gpu import fwd
  cfg = _K(64, 128, persistent_max_blocks=4, persistent_max_blocks_skewed=2, pair_q_tiles=True)
  assert cfg.runs_persistent([4, 4, 4]) and not cfg.runs_persistent([5, 5])
  assert cfg.runs_persistent([1, 2, 3]) and not cfg.runs_persistent([1, 2, 3, 4])  # skewed
  assert _K(64, 128, persistent=True).runs_persistent([1000])
  assert not _K(64, 128, pair_q_tiles=True).runs_persistent([1])
  with pytest.raises(ValueError, match="persistent_max_blocks"):
    _K(64, 128, persistent_max_blocks=-1)
  # The snake schedule: skewed tiles (causal) and at most snake_max_kv_heads (batch, kv head)s.
  snake_cfg = _K(64, 128, snake_max_kv_heads=32)
  assert snake_cfg.snakes([1, 2, 3, 4], 32) and not snake_cfg.snakes([1, 2, 3, 4], 33)
  assert not snake_cfg.snakes([4, 4, 4], 1) and not cfg.snakes([1, 2, 3, 4], 1)
  with pytest.raises(ValueError, match="snake_max_kv_heads"):
    _K(64, 128, snake_max_kv_heads=-1)
  # turns_max_blocks: the overlap takes the ping-pong's turns on unskewed tiles of few blocks.
  overlap = _K(64, 128, overlap_qk=True, ping_pong=False, turns_max_blocks=8)
  turns = overlap.for_tiles([8, 8])
  assert turns.overlap_qk and turns.ping_pong and turns.turns_max_blocks == 8
  assert overlap.for_tiles([9, 9]) is overlap and overlap.for_tiles([]) is overlap
  assert overlap.for_tiles([1, 2, 3, 4]) is overlap  # (skewed: causal)
  assert not _K(64, 128, overlap_qk=True, ping_pong=False).for_tiles([1]).ping_pong  # (0: never)
  three = _K(64, 128, overlap_qk=True, ping_pong=False, compute_warpgroups=3,
             compute_registers=160, turns_max_blocks=8)
  assert three.for_tiles([1]) is three  # (the turns pair two warpgroups)
  with pytest.raises(ValueError, match="turns_max_blocks"):
    _K(64, 128, turns_max_blocks=-1)
  # pair_q_tiles: only where the tiles are skewed (causal); equal tiles stay single.
  assert cfg.for_tiles([1, 2, 3, 4]) is cfg
  assert cfg.for_tiles([4, 4, 4]) == dataclasses.replace(cfg, pair_q_tiles=False)
  causal, full = pallas_attn.MaskSpec(is_causal=True), pallas_attn.MaskSpec()
  assert fwd._tile_blocks(causal, 4, cfg, 512) == [1, 2, 3, 4]
  assert fwd._tile_blocks(full, 2, cfg, 640) == [5, 5]
  window = pallas_attn.MaskSpec(local_window=(100, 0))
  assert fwd._tile_blocks(window, 4, cfg, 512) == [1, 2, 2, 2]

  def grid(spec, seq):
    q = jnp.zeros((2, seq, 4, 64), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda q: ops.forward(q, q, q, None, None, scale=0.125, spec=spec,
                                                 interpret=True, fwd_cfg=cfg))(q)
    (call,) = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "mpmd_map"]
    (mesh,) = call.params["meshes"]
    return mesh.grid

  assert grid(full, 512) == (fwd.INTERPRET_CTAS,)
  assert grid(full, 640) == (4, 5, 2)  # (heads, q tiles, batch)
  assert grid(causal, 384) == (fwd.INTERPRET_CTAS,)  # 1, 2, 3 blocks: 2 on average
  assert grid(causal, 512) == (4, 4, 2)  # 2.5 on average


def test_persistent_output_tile_where_it_fits():
  """A persistent forward stores its output through a whole tile of its own at head_dim 64 and
  128 (192 KiB at 128), through a half-width one at 256 (a whole one: 256 KiB; a half: 225),
  through the q tile where not even a half fits (128 with 192-key blocks)."""
  from pallas_attn.mosaic_gpu import common, fwd
  assert fwd.out_tile_columns(_K(64, 128, persistent=True), 128, jnp.bfloat16) == 128
  assert fwd.out_tile_columns(_K(64, 128, stages=3, persistent=True), 64, jnp.bfloat16) == 64
  assert fwd.out_tile_columns(_K(64, 64, persistent=True), 256, jnp.bfloat16) == 128
  assert fwd.out_tile_columns(_K(64, 192, persistent=True), 128, jnp.bfloat16) == 0
  assert fwd.out_tile_columns(_K(64, 128), 128, jnp.bfloat16) == 0
  for cfg, head_dim in [(_K(64, 128, persistent=True), 128), (_K(64, 64, persistent=True), 256)]:
    scratch = fwd.scratch_types(cfg, head_dim, jnp.bfloat16, interpret=False)
    assert common.smem_bytes(scratch) <= config_lib.SMEM_BYTES


@pytest.mark.parametrize("head_dim,pass_,cfg", [(128, "dq", _K(64, 128, stages=3)),
                                                (128, "dkv", _K(128, 64, stages=3)),
                                                (256, "fwd", _K(64, 128))])
def test_variant_over_shared_memory_says_so(head_dim, pass_, cfg):
  # (256 rows: the separate dQ kernel's tiles, which the short rows take, divide them)
  q = jnp.zeros((1, 256, 1, head_dim), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"needs .* KiB of shared memory, more than the 227 KiB"):
    jax.eval_shape(lambda q: jax.grad(lambda q: ops.attention(
        q, q, q, None, None, scale=0.1, spec=pallas_attn.MaskSpec(),
        **{f"{pass_}_cfg": cfg})[0].astype(jnp.float32).sum())(q), q)


def test_overlap_qk_needs_two_slots():
  with pytest.raises(ValueError, match="overlap_qk needs stages >= 2"):
    _K(64, 128, stages=1, overlap_qk=True)
  with pytest.raises(ValueError, match="overlap_qk needs"):
    _K(64, 128, stages=1, overlap_qk=True, ping_pong=False)
  assert _K(64, 128, stages=2, overlap_qk=True).overlap_qk


def test_smem_budget_counts_as_mosaic_gpu_does(monkeypatch):
  """`common.smem_bytes` (what the tuner and the checks use) equals Mosaic GPU's own count."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  from pallas_attn.mosaic_gpu import bwd, common, fwd
  counted = []
  size = mgpu_core._smem_tree_size
  monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda t: counted.append(size(t)) or size(t))
  fwd_cfg, dq_cfg, dkv_cfg = _K(64, 192), _K(64, 128), _K(128, 64)
  q = jax.ShapeDtypeStruct((1, 300, 2, 128), jnp.bfloat16)
  _lowered_backward(q, q, is_causal=False, fwd_cfg=fwd_cfg, dq_cfg=dq_cfg, dkv_cfg=dkv_cfg)
  bf16 = jnp.bfloat16
  assert counted == [
      common.smem_bytes(fwd.scratch_types(fwd_cfg, 128, bf16, interpret=False)),  # no reserve
      common.smem_bytes(bwd.dq_scratch_types(dq_cfg, 128, bf16, interpret=False)),
      common.smem_bytes(bwd.dkv_scratch_types(dkv_cfg, 128, bf16, interpret=False))]
  assert counted[0] > config_lib.SMEM_BYTES - common.REDUCTION_SCRATCH_BYTES


# ---------------------------------------------------------------------------------------------
# GPU: real compilation on a Hopper GPU.

# A very peaked softmax (logits of standard deviation 32): the kernels take delta = rowsum(dO * O)
# from the bf16 / f16 output, as FlashAttention and cuDNN do, and dS = P (dP - delta) amplifies the
# output's rounding: dQ and dK measure 2.7-3.4x the low-precision reference's error here, past the
# criterion's 2x (README, "Gradient precision with a peaked softmax"). Held to 4x, so that a worse
# rounding still shows.
@pytest.mark.parametrize("dtype", LOW, ids=cases.dtype_name)
def test_interpreted_peaky_softmax_gradients(dtype, seed):
  case = cases.get_case("peaky_scale4_128x128").replace(dtype=dtype, head_dim=64)
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed, compare_jax_nn=False,
                   criterion_factor=4.0)


# Random combinations of the position masks (`cases.random_case`); many more run compiled below.
@pytest.mark.parametrize("case", [cases.random_case(i, (64, 128), LOW) for i in range(6)],
                         ids=lambda case: case.id)
def test_interpreted_kernels_random_cases(case, seed):
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)


gpu = pytest.mark.gpu


def _poison_allocator(num_bytes: int):
  """Fill and free a NaN buffer so that the next allocations likely reuse NaN memory: a tile the
  kernel never writes then fails the comparison instead of passing on leftover values."""
  poison = jnp.full((num_bytes // 4,), jnp.nan, jnp.float32)
  poison.block_until_ready()
  poison.delete()


def _gpu_params():
  """Every case in bf16 at head_dim 128 and in f16 at head_dim 64; a masking subset at 256."""
  at_256 = {"causal_113x203", "gqa_causal_lengths_113x203", "window_l32_r8_203x113",
            "lengths_kv0_113x203", "causal_1023x1024", "mha_1000x1000"}
  params = []
  for dtype, head_dim in [(cases.BF16, 128), (cases.F16, 64), (cases.BF16, 256)]:
    for p in cases.case_params((dtype,), head_dim=head_dim):
      case = p.values[0]
      if head_dim == 256 and case.name not in at_256:
        continue
      params.append(pytest.param(case, id=f"{case.id}-d{head_dim}"))
  return params


@gpu
@pytest.mark.parametrize("case", _gpu_params())
def test_gpu_kernels_match_reference(case, seed):
  _poison_allocator(64 << 20)
  cases.check_case(case, "mosaic_gpu", seed=seed)


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", LOW, ids=cases.dtype_name)
def test_gpu_peaky_softmax_gradients(dtype, head_dim, seed):
  _poison_allocator(64 << 20)
  case = cases.get_case("peaky_scale4_128x128").replace(dtype=dtype, head_dim=head_dim)
  cases.check_case(case, "mosaic_gpu", seed=seed, compare_jax_nn=False, criterion_factor=4.0)


@gpu
@pytest.mark.parametrize("case", [cases.random_case(i, (64, 128, 256), LOW) for i in range(64)],
                         ids=lambda case: case.id)
def test_gpu_kernels_random_cases(case, seed):
  _poison_allocator(64 << 20)
  cases.check_case(case, "mosaic_gpu", seed=seed)


@gpu
@pytest.mark.parametrize("case", [pytest.param(c.replace(dtype=cases.BF16, head_dim=128),
                                               id=f"{c.name}-bf16-d128")
                                  for c in cases.ALIGNMENT_CASES])
def test_gpu_kernels_bottom_right_alignment(case, seed):
  _poison_allocator(64 << 20)
  cases.check_case(case, "mosaic_gpu", seed=seed)


_LONG = [(8192, False), (8192, True), (16384, True), (32768, False), (32768, True)]


@functools.partial(jax.jit, static_argnames=("implementation", "is_causal"))
def _long_run(q, k, v, do, *, implementation, is_causal):
  def f(q, k, v):
    return pallas_attn.attention(q, k, v, is_causal=is_causal, implementation=implementation,
                                 return_residual=True)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return out, lse, vjp((do, jnp.zeros_like(lse)))


@gpu
@pytest.mark.parametrize("seq,is_causal", _LONG, ids=[f"{n}-{'causal' if c else 'full'}"
                                                      for n, c in _LONG])
def test_gpu_long_sequences(seq, is_causal, seed):
  """Long sequences against the portable path in float32 (O(N) memory; itself checked against
  the dense reference above)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  shape_q, shape_kv = (1, seq, 4, 128), (1, seq, 2, 128)
  q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
  k = jax.random.normal(keys[1], shape_kv, jnp.bfloat16)
  v = jax.random.normal(keys[2], shape_kv, jnp.bfloat16)
  do = jax.random.normal(keys[3], shape_q, jnp.bfloat16)
  _poison_allocator(1 << 30)
  out, lse, grads = _long_run(q, k, v, do, implementation="mosaic_gpu", is_causal=is_causal)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  ref_out, ref_lse, ref_grads = _long_run(*up, implementation="blocked_jax", is_causal=is_causal)
  assert cases.rel_err(lse, ref_lse) < 1e-4
  for got, want, what in zip((out, *grads), (ref_out, *ref_grads), cases.QUANTITIES):
    assert np.isfinite(np.asarray(got, np.float32)).all(), what
    err = cases.rel_err(got, want)
    assert err < 1e-2, f"{what}: rel err {err:.3e}"


# The interpreter's variants resized for head_dim 128 (whose shared memory holds fewer stages).
_GPU_VARIANTS = {
    "kv192_reversed_tiles_first": {
        "fwd": _K(64, 192, reverse_q_tiles=True, grid_order=("tiles", "heads", "batch")),
        "dq": _K(64, 128, reverse_q_tiles=True),
        "dkv": _K(128, 64, grid_order=("heads", "batch", "tiles"))},
    "kv256_1stage_no_ping_pong_tiles_last": {
        "fwd": _K(64, 256, stages=1, ping_pong=False, grid_order=("heads", "batch", "tiles")),
        "dq": _K(64, 128, stages=1, grid_order=("tiles", "heads", "batch")),
        "dkv": _K(128, 64, stages=1)},
    "kv64_3stages": _VARIANTS["kv64_3stages"],
    "overlap_qk_3stages": {"fwd": _K(64, 128, stages=3, overlap_qk=True)},
    "overlap_qk": _VARIANTS["overlap_qk"],
    # The forward of the table before session 10: the ping-pong without the overlap.
    "ping_pong": {"fwd": _K(64, 128, fold_scale=True)},
    "overlap_qk_regs240": {"fwd": _K(64, 128, overlap_qk=True, fold_scale=True,
                                     compute_registers=240)},
    "overlap_qk_kv64_no_ping_pong": {"fwd": _K(64, 64, overlap_qk=True, ping_pong=False)},
    "fused_dq": {"dkv": _K(64, 64, fused_dq=True)},
    "dq_column_halves": {"dkv": _K(64, 64, fused_dq=True, dq_column_halves=True)},
    "fused_dq_swizzled": _VARIANTS["fused_dq_swizzled"],
    "dq_column_halves_swizzled": _VARIANTS["dq_column_halves_swizzled"],
    "co_issue_dp": _VARIANTS["co_issue_dp"],
    "dq_in_flight": _VARIANTS["dq_in_flight"],
    "overlap_dq": _VARIANTS["overlap_dq"],
    "overlap_dq_2stages": _VARIANTS["overlap_dq_2stages"],
    "overlap_dkv": _VARIANTS["overlap_dkv"],
    "overlap_dkv_2stages": _VARIANTS["overlap_dkv_2stages"],
    "overlap_dq_dkv": {"dq": _K(64, 64, stages=3, overlap_dq=True),
                       "dkv": _K(64, 64, stages=3, overlap_dkv=True, compute_registers=240)},
    "fused_dq_co_issue_dp": _VARIANTS["fused_dq_co_issue_dp"],
    "fused_dq_co_issue_dkv_dq": _VARIANTS["fused_dq_co_issue_dkv_dq"],
    "dq_column_halves_co_issue_dq": _VARIANTS["dq_column_halves_co_issue_dq"],
    "dq_column_halves_step_late": _VARIANTS["dq_column_halves_step_late"],
    "dq_row_halves": _VARIANTS["dq_row_halves"],  # (head_dim 64: `_GPU_VARIANT_HEAD_DIMS`)
    "dq_row_halves_step_late": _VARIANTS["dq_row_halves_step_late"],
    "table_d128_always_fused": _VARIANTS["table_d128_always_fused"],
    "group_parts_2": _VARIANTS["group_parts_2"],
    "group_parts_4_d64": _VARIANTS["group_parts_4_d64"],
    "group_split": _VARIANTS["group_split"],
    "descriptors_in_step": _VARIANTS["descriptors_in_step"],
    "overlap_dkv_descriptors_in_step": _VARIANTS["overlap_dkv_descriptors_in_step"],
    "persistent": {"fwd": _K(64, 128, persistent=True)},
    # The forward's q tile indexed in the step: the table's forward, and at block_kv 192.
    "fwd_descriptors_in_step": {"fwd": dataclasses.replace(config_lib.DEFAULTS[(128, "fwd")],
                                                           tile_descriptors_in_step=True)},
    "fwd_kv192_descriptors_in_step": _VARIANTS["fwd_kv192_descriptors_in_step"],
    "exp2_fma_overlap_qk": _VARIANTS["exp2_fma_overlap_qk"],
    "persistent_heavy_first": {"fwd": _K(64, 128, reverse_q_tiles=True,
                                         grid_order=("heads", "batch", "tiles"),
                                         persistent=True)},
    "persistent_pairs": _VARIANTS["persistent_pairs"],
    # The table's dQ kernel with q and dO in registers, and with 240 registers.
    "dq_lhs_in_registers": {"dq": _K(64, 64, co_issue_dp=True, dq_lhs_in_registers=True)},
    "dq_lhs_in_registers_regs240": {"dq": _K(64, 64, co_issue_dp=True, dq_lhs_in_registers=True,
                                             compute_registers=240)},
}


# The GPU variants' head_dim where not 128: head_dim 64's dK/dV/dQ kernel with dQ in row halves
# (layouts only head_dim 64 takes), and in group parts.
_GPU_VARIANT_HEAD_DIMS = {"dq_row_halves": 64, "dq_row_halves_step_late": 64,
                          "group_parts_4_d64": 64}


@gpu
@pytest.mark.parametrize("variant,case", [
    pytest.param(v, c.replace(dtype=cases.BF16, head_dim=d), id=f"{v}-{c.name}-d{d}")
    for v in _GPU_VARIANTS
    for d in (_GPU_VARIANT_HEAD_DIMS.get(v, 128),)
    for c in (cases.get_case("causal_1023x1024"), cases.get_case("mha_1000x1000"),
              cases.get_case("gqa_causal_window_lengths_1000x1000"),
              cases.get_case("gqa_causal_lengths_113x203"))])
def test_gpu_variants_match_reference(variant, case, seed):
  with kernel_table(case.head_dim, _GPU_VARIANTS[variant]):
    _poison_allocator(64 << 20)
    cases.check_case(case, "mosaic_gpu", seed=seed)


# The forward layouts the table does not use at the other head dims: the overlap at d64 (a
# [64, 64] accumulator beside a [64, 128] S), with and without turns; the ping-pong turns with
# the overlap at d256 ([64, 256] beside [64, 64], 240 registers), and the plain ping-pong there.
_GPU_FORWARD_LAYOUTS = {
    "d64_overlap": (64, _K(64, 128, overlap_qk=True, fold_scale=True, ping_pong=False)),
    "d64_overlap_turns": (64, _K(64, 128, overlap_qk=True, fold_scale=True)),
    "d256_overlap_turns": (256, _K(64, 64, overlap_qk=True, fold_scale=True,
                                   compute_registers=240)),
    "d256_ping_pong": (256, _K(64, 64, fold_scale=True)),
    # Part of the exp2 on the FMA pipe at head_dim 64, whose tiles it was meant to relieve.
    "d64_exp2_fma": (64, _K(64, 128, fold_scale=True, exp2_fma_cols=24)),
    "d64_exp2_fma_overlap": (64, _K(64, 128, overlap_qk=True, fold_scale=True, ping_pong=False,
                                    exp2_fma_cols=32)),
    # Three compute warpgroups (1000 rows: the last 192-row CTA partly past them), with the
    # overlap, and persistent with tile pairs.
    "d64_three_warpgroups": (64, _THREE_WGS),
    "d64_three_warpgroups_overlap": (64, dataclasses.replace(_THREE_WGS, overlap_qk=True)),
    "d64_three_warpgroups_persistent": (64, dataclasses.replace(
        _THREE_WGS, overlap_qk=True, persistent=True, pair_q_tiles=True)),
    # The q tile indexed in the step, in the table's d64 and d256 forwards.
    "d64_descriptors_in_step": (64, dataclasses.replace(config_lib.DEFAULTS[(64, "fwd")],
                                                        tile_descriptors_in_step=True)),
    "d256_descriptors_in_step": (256, dataclasses.replace(config_lib.DEFAULTS[(256, "fwd")],
                                                          tile_descriptors_in_step=True)),
}


@gpu
@pytest.mark.parametrize("variant,case", [
    pytest.param(v, c.replace(dtype=cases.F16 if d == 64 else cases.BF16, head_dim=d),
                 id=f"{v}-{c.name}")
    for v, (d, _) in _GPU_FORWARD_LAYOUTS.items()
    for c in (cases.get_case("causal_1023x1024"), cases.get_case("mha_1000x1000"),
              cases.get_case("gqa_causal_window_lengths_1000x1000"))])
def test_gpu_forward_layouts_other_head_dims(variant, case, seed):
  head_dim, cfg = _GPU_FORWARD_LAYOUTS[variant]
  with kernel_table(head_dim, {"fwd": cfg}):
    _poison_allocator(64 << 20)
    cases.check_case(case, "mosaic_gpu", seed=seed)


# The fused dK/dV/dQ layouts at head_dim 64 the table does not run (it issues dV's, dK's and
# dQ's wgmmas together): every wgmma awaited in turn (the table till session 13), the dQ wgmma
# behind dK's alone, and the table's with 240 registers (the _GPU_VARIANTS above run at 128).
_GPU_D64_BACKWARD_LAYOUTS = {
    "d64_fused_one_at_a_time": _K(128, 64, fused_dq=True),
    "d64_fused_co_issue_dq": _VARIANTS["fused_dq_co_issue_dq"]["dkv"],
    "d64_fused_co_issue_dkv_dq_regs240": _K(128, 64, fused_dq=True, co_issue_dkv=True,
                                            co_issue_dq=True, compute_registers=240),
    # The table's fused kernel on the causal rows the table gives the separate kernels, and the
    # table's before session 38 (whole-block dQ).
    "d64_table_always_fused": _VARIANTS["table_d64_always_fused"]["dkv"],
    "d64_whole_block_dq": _VARIANTS["dq_whole_block"]["dkv"],
}


@gpu
@pytest.mark.parametrize("variant,case", [
    pytest.param(v, c.replace(dtype=cases.BF16, head_dim=64), id=f"{v}-{c.name}")
    for v in _GPU_D64_BACKWARD_LAYOUTS
    for c in (cases.get_case("causal_1023x1024"), cases.get_case("mha_1000x1000"),
              cases.get_case("gqa_causal_window_lengths_1000x1000"))])
def test_gpu_d64_backward_layouts(variant, case, seed):
  with kernel_table(64, {"dkv": _GPU_D64_BACKWARD_LAYOUTS[variant]}):
    _poison_allocator(64 << 20)
    cases.check_case(case, "mosaic_gpu", seed=seed)


# Persistent forwards with many more (batch, head, q tile) items than the H200's 132 CTAs, so
# every CTA walks several (the variant cases above have fewer items than SMs): name -> (batch,
# seq, heads_q, heads_kv, head_dim, causal, q_lengths, kv_lengths, config).
_PERSISTENT_GPU = {
    "b4_s4096_h16_d128": (4, 4096, 16, 16, 128, False, None, None, _K(64, 128, persistent=True)),
    "b4_s4096_h16_d128_causal_heavy_first": (
        4, 4096, 16, 16, 128, True, None, None,
        _K(64, 128, reverse_q_tiles=True, grid_order=("heads", "batch", "tiles"),
           persistent=True)),
    "b16_s1024_h16_d128": (16, 1024, 16, 16, 128, False, None, None,
                           _K(64, 128, persistent=True)),
    "b3_s1000_gqa4_d64_causal_lengths": (3, 1000, 8, 2, 64, True, [1000, 617, 5],
                                         [1000, 555, 0], _K(64, 128, persistent=True)),
    "b2_s2000_h8_d256_causal": (2, 2000, 8, 8, 256, True, None, None,
                                _K(64, 64, persistent=True)),
    # head_dim 256 as the table runs short rows (its output in two column halves); head_dim
    # 128 with 192-key blocks, whose output goes through the q tile.
    "b32_s512_h8_d256": (32, 512, 8, 8, 256, False, None, None,
                         _K(64, 64, overlap_qk=True, ping_pong=False, fold_scale=True,
                            persistent=True, pair_q_tiles=True)),
    "b4_s1000_h8_d128_kv192_lengths": (4, 1000, 8, 8, 128, False, None, [1000, 700, 64, 999],
                                       _K(64, 192, persistent=True)),
    # Tile pairs (T - 1 - t, t) as units, with the overlap as the table runs them.
    "b16_s1024_h16_d128_causal_pairs": (
        16, 1024, 16, 16, 128, True, None, None,
        _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True, persistent=True,
           pair_q_tiles=True)),
    "b16_s1024_h16_d128_q_after_walk": (
        16, 1024, 16, 16, 128, False, None, None,
        _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True, persistent=True,
           pair_q_tiles=True, next_q_after_walk=True)),
    "b3_s1000_gqa4_d256_causal_lengths_q_after_walk": (
        3, 1000, 8, 2, 256, True, [1000, 617, 5], [1000, 555, 0],
        _K(64, 64, overlap_qk=True, ping_pong=False, fold_scale=True, persistent=True,
           pair_q_tiles=True, next_q_after_walk=True)),
    "b4_s2048_h32_d64_causal_three_warpgroups_q_after_walk": (
        4, 2048, 32, 32, 64, True, None, None,
        dataclasses.replace(_THREE_WGS, persistent=True, pair_q_tiles=True,
                            next_q_after_walk=True)),
    # The snake schedule as the table would run it at head_dim 128 and 256 (causal rows).
    "b4_s4096_h16_d128_causal_snake": (
        4, 4096, 16, 16, 128, True, None, None,
        _K(64, 128, overlap_qk=True, ping_pong=False, fold_scale=True, persistent=True,
           pair_q_tiles=True, next_q_after_walk=True, snake_max_kv_heads=64)),
    "b3_s1000_gqa4_d256_causal_lengths_snake": (
        3, 1000, 8, 2, 256, True, [1000, 617, 5], [1000, 555, 0],
        _K(64, 64, overlap_qk=True, ping_pong=False, fold_scale=True, persistent=True,
           pair_q_tiles=True, next_q_after_walk=True, snake_max_kv_heads=64)),
    # The table at causal N 32768 (persistent up to 300 key blocks a tile, in the snake; the
    # "default" it is compared with is itself, so the check is the portable path's).
    "b1_s32768_h16_d128_causal_table": (1, 32768, 16, 16, 128, True, None, None,
                                        config_lib.DEFAULTS[(128, "fwd")]),
    "b4_s4096_h32_d64_causal_pairs": (
        4, 4096, 32, 32, 64, True, None, None,
        _K(64, 128, fold_scale=True, persistent=True, pair_q_tiles=True)),
    "b3_s1000_gqa4_d256_causal_lengths_pairs": (
        3, 1000, 8, 2, 256, True, [1000, 617, 5], [1000, 555, 0],
        _K(64, 64, overlap_qk=True, ping_pong=False, fold_scale=True, persistent=True,
           pair_q_tiles=True)),
}


@gpu
@pytest.mark.parametrize("name", list(_PERSISTENT_GPU))
def test_gpu_persistent_forward_many_items(name, seed):
  """Against the default (one CTA per tile) kernel, which computes each tile the same way, and,
  without lengths, against the portable path in float32."""
  batch, seq, heads_q, heads_kv, head_dim, causal, q_lengths, kv_lengths, cfg = (
      _PERSISTENT_GPU[name])
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (batch, seq, heads_q, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, seq, heads_kv, head_dim), jnp.bfloat16)
          for key in keys[1:])
  as_lengths = lambda x: None if x is None else jnp.array(x, jnp.int32)
  q_lengths, kv_lengths = as_lengths(q_lengths), as_lengths(kv_lengths)

  def run(implementation, *args):
    return pallas_attn.attention(*args, is_causal=causal, implementation=implementation,
                                 query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                                 return_residual=True)

  _poison_allocator(1 << 30)
  with kernel_table(head_dim, {"fwd": cfg}):
    out, lse = jax.block_until_ready(run("mosaic_gpu", q, k, v))
  want_out, want_lse = run("mosaic_gpu", q, k, v)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  assert cases.rel_err(out, want_out) < 1e-3
  if q_lengths is None and kv_lengths is None:
    ref_out, ref_lse = run("blocked_jax", *(x.astype(jnp.float32) for x in (q, k, v)))
    assert cases.rel_err(lse, ref_lse) < 1e-4
    assert cases.rel_err(out, ref_out) < 1e-2
