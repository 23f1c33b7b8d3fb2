"""The head-split dQ and dK/dV kernels (`KernelConfig.head_split`, `mosaic_gpu/head_split.py`):
both compute warpgroups on one query (dQ) or key (dK/dV) tile, the accumulators split by
columns, P / dP / dS meeting in shared memory.

Interpreted (CPU): the positional masks, GQA sums, lengths, rows with no key, one and two stages,
the modifiers (soft-cap, ALiBi per head, segment ids through the block table) and dropout, at
head_dim 128 and 256, against the references; the interpreter's race detector watches the
meetings. Lowered for CUDA: the real Mosaic GPU lowering and the shared-memory budget at 256.
The `gpu` tests compile it on a Hopper GPU:
  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_head_split.py
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
import test_mosaic_gpu_dropout as dropout_tests
import test_mosaic_gpu_mods as mods_tests
from pallas_attn.mosaic_gpu import block_table
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import ops
from test_mosaic_gpu import _GQA_CAUSAL_LENGTHS_330, _poison_allocator, kernel_table

_K = config_lib.KernelConfig
HEAD_SPLIT = _K(64, 64, head_split=True)
HEAD_SPLIT_1STAGE = _K(64, 64, stages=1, head_split=True)
# Warpgroup 1 makes each block's dP a step ahead (dP under warpgroup 0's softmax).
DP_AHEAD = _K(64, 64, head_split=True, dp_ahead=True)
# dP handed over through a swizzled float32 tile.
SWIZZLED = _K(64, 64, head_split=True, swizzle_f32=True)
# dQ made in the dK/dV kernel, in column halves (one stage beside the float32 dQ halves).
FUSED = _K(64, 64, stages=1, head_split=True, fused_dq=True)
# The tiles every step reads the same (K and V; the dQ kernel's q and dO) indexed in the step.
IN_STEP = _K(64, 64, head_split=True, tile_descriptors_in_step=True)
FUSED_IN_STEP = _K(64, 64, stages=1, head_split=True, fused_dq=True, compute_registers=240,
                   tile_descriptors_in_step=True)
# ... with q in two stages beside one dO slot and one float32 dQ tile a warpgroup.
TWO_Q_STAGES = _K(64, 64, head_split=True, fused_dq=True, one_do_slot=True,
                  compute_registers=240, tile_descriptors_in_step=True)
# ... each warpgroup's last dQ part of a step sent under the next step's first wgmma.
DEFERRED = dataclasses.replace(TWO_Q_STAGES, defer_last_dq_part=True)
# A kv head's query-head group over 2 CTAs (`group_parts`), each writing its own dK / dV
# partials; and the table's rule at a threshold short tests reach (causal walks of at least 2
# query blocks on average: one query head a CTA).
DEFERRED_PARTS = dataclasses.replace(DEFERRED, group_parts=2)
HEAD_SPLIT_PARTS = dataclasses.replace(HEAD_SPLIT, group_parts=2)
DEFERRED_SPLIT = dataclasses.replace(DEFERRED, group_split_min_blocks=2)


def _both(cfg):
  """The table's dQ and dK/dV entries both `cfg` (the dK/dV entry alone where it fuses dQ:
  then the dQ entry is the plain head split, which the dbias kernel also takes)."""
  return {"dq": HEAD_SPLIT if cfg.fused_dq else cfg, "dkv": cfg}


def _no_race():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  assert interpret_pallas_call.get_races().races_found is False


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter.

_CAUSAL_203 = cases.get_case("causal_113x203").replace(q_len=203, name="causal_203x203")
# The group in parts: causal MQA's 4 heads in 2 CTAs of 2 (the fused dQ's head and the carried
# part's from the part's first head), a group of 2 with key lengths one head a CTA (the separate
# kernels), and the rule splitting a causal group of 2 with lengths (its key tiles visit 3.5
# query blocks on average; 113 x 203's 0.75 would not split). Interpreted and on the GPU.
_PARTS = {
    "deferred_parts2": (DEFERRED_PARTS,
                        cases.get_case("mqa_causal_203x113").replace(head_dim=256)),
    "split_parts2": (HEAD_SPLIT_PARTS,
                     cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    "deferred_rule": (DEFERRED_SPLIT, _GQA_CAUSAL_LENGTHS_330.replace(head_dim=128)),
}

_INTERPRETED = [
    # Several query blocks per key tile on both sides of the diagonal.
    (HEAD_SPLIT, _CAUSAL_203.replace(head_dim=256)),
    # A group of 4 query heads summed per kv head.
    (HEAD_SPLIT, cases.get_case("mqa_113x203").replace(head_dim=256)),
    # Key lengths (a tile straddling one, tiles wholly past one), rows with no key.
    (HEAD_SPLIT, cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    (HEAD_SPLIT_1STAGE, cases.get_case("lengths_kv0_113x203").replace(head_dim=256)),
    (HEAD_SPLIT_1STAGE, cases.get_case("window_l32_r8_203x113").replace(head_dim=128)),
    # dP a step ahead: several steps per CTA, GQA groups walked as one ring, CTAs with no step.
    (DP_AHEAD, cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=256)),
    (DP_AHEAD, cases.get_case("lengths_kv0_113x203").replace(head_dim=128)),
    (SWIZZLED, cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=256)),
    # dQ fused in, each step's parts sent in the step (TWO_Q_STAGES): several query blocks per
    # key tile both sides of the diagonal, a GQA group with key lengths and rows with no key;
    # and with one stage.
    (TWO_Q_STAGES, _CAUSAL_203.replace(head_dim=256)),
    (TWO_Q_STAGES, cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    (FUSED, cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=256)),
    # The separate kernels with the tiles indexed through the optimization barrier.
    (IN_STEP, _CAUSAL_203.replace(head_dim=256)),
    # The table's head_dim 256 layout (DEFERRED: the last dQ part of a step sent in the next):
    # several steps per key tile both sides of the diagonal, a group of 4 query heads adding
    # into one dQ each (the carried part's head changes between steps), key lengths, rows with
    # no key and CTAs with no step; at head_dim 128 (one part a step, the one deferred) and
    # beside two dQ tiles a warpgroup (one stage).
    (DEFERRED, _CAUSAL_203.replace(head_dim=256)),
    (DEFERRED, cases.get_case("mqa_113x203").replace(head_dim=256)),
    (DEFERRED, cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=128)),
    (DEFERRED, cases.get_case("lengths_kv0_113x203").replace(head_dim=256)),
    (dataclasses.replace(FUSED, defer_last_dq_part=True),
     cases.get_case("gqa_causal_lengths_113x203").replace(head_dim=256)),
    *_PARTS.values(),
]


@pytest.mark.parametrize("cfg,case", [
    pytest.param(cfg, c.replace(dtype=cases.BF16),
                 id=(f"{cfg.stages}st{'-ahead' if cfg.dp_ahead else ''}"
                     f"{'-swizzled' if cfg.swizzle_f32 else ''}"
                     f"{'-fused' if cfg.fused_dq else ''}"
                     f"{'-in_step' if cfg.tile_descriptors_in_step else ''}"
                     f"{'-one_do_slot' if cfg.one_do_slot else ''}"
                     f"{'-deferred' if cfg.defer_last_dq_part else ''}"
                     f"{f'-parts{cfg.group_parts}' if cfg.group_parts > 1 else ''}"
                     f"{'-split' if cfg.group_split_min_blocks else ''}-{c.name}-d{c.head_dim}"))
    for cfg, c in _INTERPRETED])
def test_interpreted_head_split_matches_reference(cfg, case, seed):
  with kernel_table(case.head_dim, _both(cfg)):
    cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)
  _no_race()


def test_interpreted_head_split_dq_reversed_beside_plain_dkv(seed):
  """The dQ kernel alone split (the dK/dV kernel the plain one), its query tiles last first."""
  case = _CAUSAL_203.replace(head_dim=128, dtype=cases.BF16)
  with kernel_table(128, {"dq": _K(64, 64, head_split=True, reverse_q_tiles=True)}):
    cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)
  _no_race()


@pytest.mark.parametrize("name,head_dim,cfg", [("all_gqa_lengths_113x203", 256, HEAD_SPLIT),
                                               ("segments_causal_150x150", 128, HEAD_SPLIT),
                                               ("segments_causal_150x150", 128, DP_AHEAD),
                                               ("all_gqa_lengths_113x203", 256, DEFERRED),
                                               ("segments_causal_150x150", 256, DEFERRED),
                                               ("all_gqa_lengths_113x203", 128, DEFERRED_PARTS)])
def test_interpreted_head_split_with_modifiers(name, head_dim, cfg, seed):
  """Soft-cap (dS times its derivative), ALiBi per query head of the group (in parts: from the
  part's first head), segment ids (the block table with one list per key tile), lengths."""
  with kernel_table(head_dim, _both(cfg)):
    mods_tests._check(mods_tests._CASES[name].with_base(head_dim=head_dim), seed,
                      interpret=True)
  _no_race()


def test_interpreted_head_split_with_dropout(seed):
  """Warpgroup 0 regenerates the keep-mask: dV takes the dropped P, dP is dropped before dS."""
  with kernel_table(256, _both(HEAD_SPLIT)):
    batch, q_len, kv_len, heads_q, heads_kv, is_causal, broadcast = (
        dropout_tests._CASES["gqa_causal_77x150"])
    dropout_tests._check(batch, q_len, kv_len, heads_q, heads_kv, is_causal, broadcast,
                         seed=seed, interpret=True, head_dim=256)
  _no_race()


def test_tables_with_one_block_per_cta():
  """rows_per_cta=1: one list per key block (key_major) or query block (query_major), both
  warpgroups' modes that block's."""
  visible = jnp.array([[1, 0, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]], bool).T  # [q 3, kv 4]
  full = visible & jnp.array([[1, 0, 0], [0, 0, 1], [0, 1, 1], [0, 0, 0]], bool).T
  vis = block_table.BlockVisibility(visible[None, None], full[None, None])
  table = block_table.key_major(vis, rows_per_cta=1)
  assert table.counts.tolist() == [[[2, 1, 3, 0]]]
  for tile, want in enumerate([[(0, 2), (2, 1)], [(2, 2)], [(0, 1), (1, 2), (2, 2)], []]):
    got = []
    for entry in np.asarray(table.entries[0, 0, tile, :len(want)]):
      block, mode0 = block_table.decode(entry, 0)
      assert block_table.decode(entry, 1)[1] == mode0
      got.append((int(block), int(mode0)))
    assert got == want, (tile, got)
  by_query = block_table.query_major(vis, rows_per_cta=1)
  assert by_query.counts.tolist() == [[[2, 1, 3]]]
  assert [int(block_table.decode(e, 1)[0]) for e in by_query.entries[0, 0, 1, :1]] == [2]
  with pytest.raises(ValueError, match="rows_per_cta"):
    block_table.key_major(vis, rows_per_cta=3)


def test_head_split_config_is_checked():
  with pytest.raises(ValueError, match="head_split"):
    _K(64, 64, head_split=True, split_dkv=True)
  for fused_option in ("dq_column_halves", "co_issue_dq", "dq_step_late"):
    with pytest.raises(ValueError, match="head_split is a layout of its own"):
      _K(64, 64, head_split=True, fused_dq=True, **{fused_option: True})
  with pytest.raises(ValueError, match="one_do_slot"):
    _K(64, 64, stages=1, head_split=True, fused_dq=True, one_do_slot=True)
  with pytest.raises(ValueError, match="one_do_slot"):
    _K(64, 64, head_split=True, one_do_slot=True)
  with pytest.raises(ValueError, match="takes no dp_ahead"):
    _K(64, 64, head_split=True, fused_dq=True, dp_ahead=True)
  assert FUSED.fused_dq and FUSED.head_split
  with pytest.raises(ValueError, match="dp_ahead"):
    _K(64, 64, dp_ahead=True)
  with pytest.raises(ValueError, match="dp_ahead"):
    _K(64, 64, stages=1, head_split=True, dp_ahead=True)
  with pytest.raises(ValueError, match="dq_in_flight"):
    _K(64, 64, head_split=True, dq_in_flight=True)
  with pytest.raises(ValueError, match="defer_last_dq_part"):
    _K(64, 64, head_split=True, defer_last_dq_part=True)
  # Where the separate dQ kernel runs, the option goes with the fused dQ (`UNFUSED_DQ`).
  unfused = config_lib.backward_configs(
      HEAD_SPLIT, dataclasses.replace(DEFERRED, separate_dq_max_blocks=4), [1])[1]
  assert not unfused.fused_dq and not unfused.defer_last_dq_part
  q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 128"):
    stats = jnp.zeros((1, 1, 64), jnp.float32)
    ops.backward(q, q, q, q, stats, stats, None, None, scale=1.0, spec=pallas_attn.MaskSpec(),
                 interpret=True, dkv_cfg=HEAD_SPLIT)
  with pytest.raises(ValueError, match="multiple of 128"):
    ops.backward(q, q, q, q, stats, stats, None, None, scale=1.0, spec=pallas_attn.MaskSpec(),
                 interpret=True, dq_cfg=HEAD_SPLIT, dkv_cfg=_K(64, 64))  # (not fused)


@pytest.mark.parametrize("head_dim,cfg", [(256, HEAD_SPLIT), (128, HEAD_SPLIT),
                                          (256, HEAD_SPLIT_1STAGE), (256, DP_AHEAD),
                                          (256, FUSED), (128, FUSED), (256, IN_STEP),
                                          (256, FUSED_IN_STEP), (256, TWO_Q_STAGES),
                                          (256, DEFERRED), (128, DEFERRED)])
def test_head_split_lowers_for_cuda(head_dim, cfg):
  """The real lowering (the interpreter runs neither register operands nor the TMA rules), and
  the shared-memory check: two stages fit at head_dim 256 (dK/dV 226 KiB, dQ 218 KiB), and
  one beside the fused dQ's float32 halves (226 KiB), or two q stages beside one dO slot and
  one float32 dQ tile a warpgroup (225 KiB)."""
  q = jax.ShapeDtypeStruct((1, 300, 2, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    out, _ = ops.attention(q, k, v, None, None, scale=0.1,
                           spec=pallas_attn.MaskSpec(is_causal=True), dq_cfg=cfg, dkv_cfg=cfg)
    return out.astype(jnp.float32).sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
      lowering_platforms=("cuda",))
  # forward, dQ (none when fused in), one dK/dV
  assert lowered.as_text().count("mosaic_gpu_v2") == (2 if cfg.fused_dq else 3)


def test_fused_head_split_needs_its_stage():
  """Two stages of the q / dO ring do not fit beside the float32 dQ halves at head_dim 256:
  the shared-memory check says so before lowering."""
  q = jax.ShapeDtypeStruct((1, 256, 1, 256), jnp.bfloat16)
  two_stages = _K(64, 64, head_split=True, fused_dq=True)

  def loss(q):
    out, _ = ops.attention(q, q, q, None, None, scale=0.1, spec=pallas_attn.MaskSpec(),
                           dq_cfg=HEAD_SPLIT, dkv_cfg=two_stages)
    return out.astype(jnp.float32).sum()

  with pytest.raises(ValueError, match="shared memory"):
    jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",))


# ---------------------------------------------------------------------------------------------
# GPU: real compilation on a Hopper GPU.


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [pytest.param(HEAD_SPLIT, id="split"),
                                 pytest.param(DP_AHEAD, id="dp_ahead"),
                                 pytest.param(SWIZZLED, id="swizzled"),
                                 pytest.param(FUSED, id="fused"),
                                 pytest.param(IN_STEP, id="in_step"),
                                 pytest.param(FUSED_IN_STEP, id="fused_in_step"),
                                 pytest.param(TWO_Q_STAGES, id="two_q_stages"),
                                 pytest.param(DEFERRED, id="deferred")])
@pytest.mark.parametrize("case", [
    pytest.param(c.replace(dtype=cases.BF16, head_dim=d), id=f"{c.name}-d{d}")
    for d in (256, 128)
    for c in (cases.get_case("causal_1023x1024"), cases.get_case("mha_1000x1000"),
              cases.get_case("gqa_causal_window_lengths_1000x1000"),
              cases.get_case("gqa_causal_lengths_113x203"))])
def test_gpu_head_split_matches_reference(case, cfg, seed):
  with kernel_table(case.head_dim, _both(cfg)):
    _poison_allocator(64 << 20)
    cases.check_case(case, "mosaic_gpu", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,case", [
    pytest.param(cfg, c.replace(dtype=cases.BF16, head_dim=d), id=f"{name}-{c.name}-d{d}")
    for name, (cfg, c) in _PARTS.items()
    for d in (256, 128)])
def test_gpu_head_split_in_parts(cfg, case, seed):
  """The group over several CTAs (their dK / dV partials summed) at both head dims."""
  with kernel_table(case.head_dim, _both(cfg)):
    _poison_allocator(64 << 20)
    cases.check_case(case, "mosaic_gpu", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [pytest.param(HEAD_SPLIT, id="split"),
                                 pytest.param(FUSED, id="fused"),
                                 pytest.param(FUSED_IN_STEP, id="fused_in_step"),
                                 pytest.param(TWO_Q_STAGES, id="two_q_stages"),
                                 pytest.param(DEFERRED, id="deferred")])
@pytest.mark.parametrize("name", list(mods_tests._CASES))
def test_gpu_head_split_with_modifiers(name, cfg, seed):
  with kernel_table(256, _both(cfg)):
    _poison_allocator(64 << 20)
    mods_tests._check(mods_tests._CASES[name].with_base(head_dim=256), seed, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [pytest.param(HEAD_SPLIT, id="split"),
                                 pytest.param(FUSED, id="fused"),
                                 pytest.param(TWO_Q_STAGES, id="two_q_stages"),
                                 pytest.param(DEFERRED, id="deferred")])
def test_gpu_head_split_with_dropout(cfg, seed):
  with kernel_table(256, _both(cfg)):
    _poison_allocator(64 << 20)
    batch, _, _, heads_q, heads_kv, is_causal, broadcast = (
        dropout_tests._CASES["gqa_causal_77x150"])
    dropout_tests._check(batch, 1000, 1000, heads_q, heads_kv, is_causal, broadcast,
                         seed=seed, interpret=False, head_dim=256)
