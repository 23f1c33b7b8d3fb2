"""Block masks of the element masks (`pallas_attn.mosaic_gpu.block_mask`): the tiles a boolean
mask or a mask_fn hides entirely are skipped by the Mosaic GPU kernels' block tables, and the
tiles they keep whole are computed without an element mask.

The classification is checked against a brute-force any / all over each tile of the dense
[q_len, kv_len] mask; the kernels with the resulting tables are checked against the dense float32
reference in the interpreter (structured boolean masks here; mask_fn cases with skipped and
full tiles in test_mosaic_gpu_flex.py), and the tables are checked to skip what they should.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import block_mask
from pallas_attn.mosaic_gpu import block_table
from pallas_attn.mosaic_gpu import mods as mods_lib
from pallas_attn.mosaic_gpu import ops

FINE = block_mask.FINE


def window_48(b, h, q_idx, kv_idx):
  return jnp.abs(q_idx - kv_idx) < 48


def documents_of_128(b, h, q_idx, kv_idx):
  return (q_idx // 128) == (kv_idx // 128)


def head_windows(b, h, q_idx, kv_idx):  # query head h sees keys within 64 * (h + 1)
  return jnp.abs(q_idx - kv_idx) < 64 * (h + 1)


def batch_prefix(b, h, q_idx, kv_idx):  # batch element b sees the first 100 * (b + 1) keys
  return kv_idx < 100 * (b + 1)


def _dense_keep(mask_fn, batch: int, heads: int, q_len: int, kv_len: int, padded_q: int,
                padded_kv: int) -> np.ndarray:
  """bool [batch, heads, padded_q, padded_kv]: mask_fn on every pair, positions clipped into the
  unpadded lengths (as the kernels give them)."""
  q_idx = np.minimum(np.arange(padded_q), q_len - 1)[:, None]
  kv_idx = np.minimum(np.arange(padded_kv), kv_len - 1)[None, :]
  out = np.zeros((batch, heads, padded_q, padded_kv), bool)
  for b in range(batch):
    for h in range(heads):
      out[b, h] = np.broadcast_to(np.asarray(mask_fn(jnp.int32(b), jnp.int32(h),
                                                     jnp.asarray(q_idx), jnp.asarray(kv_idx))),
                                  (padded_q, padded_kv))
  return out


def _tiles(keep: np.ndarray, block_q: int, block_kv: int):
  b, h, t, s = keep.shape
  x = keep.reshape(b, h, t // block_q, block_q, s // block_kv, block_kv)
  return x.any(axis=(3, 5)), x.all(axis=(3, 5))


def _element_fns_call(mask_fn, batch: int, heads: int, q_len: int, kv_len: int):
  q = jax.ShapeDtypeStruct((batch, q_len, heads, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((batch, kv_len, heads, 64), jnp.bfloat16)
  mods, arrays = mods_lib.from_arguments(q, k, None, None, None, None, mask_fn=mask_fn)
  return mods, arrays


@pytest.mark.parametrize("mask_fn,uses", [
    (window_48, (False, False)), (head_windows, (False, True)), (batch_prefix, (True, False)),
    (lambda b, h, i, j: (b + h + i) >= j, (True, True))])
def test_index_dependence(mask_fn, uses):
  assert block_mask.index_dependence(mask_fn) == uses


@pytest.mark.parametrize("mask_fn", [window_48, documents_of_128, head_windows, batch_prefix],
                         ids=lambda f: f.__name__)
def test_mask_fn_tiles_match_brute_force(mask_fn, monkeypatch):
  batch, heads, q_len, kv_len = 2, 3, 300, 333
  padded_q, padded_kv = 384, 384
  # Small loop steps: the chunked loop (several steps, a remainder) is what runs at scale.
  monkeypatch.setattr(block_mask, "_CHUNK_ELEMENTS", 3 * FINE * padded_kv)
  mods, arrays = _element_fns_call(mask_fn, batch, heads, q_len, kv_len)
  fine = block_mask.fine_visibility(mods, arrays, padded_q, padded_kv)
  want_visible, want_full = _tiles(_dense_keep(mask_fn, batch, heads, q_len, kv_len, padded_q,
                                               padded_kv), FINE, FINE)
  shape = (batch, heads, padded_q // FINE, padded_kv // FINE)
  uses_batch, uses_head = block_mask.index_dependence(mask_fn)
  assert fine.visible.shape == (batch if uses_batch else 1, heads if uses_head else 1,
                                *shape[2:])
  np.testing.assert_array_equal(np.broadcast_to(fine.visible, shape), want_visible)
  np.testing.assert_array_equal(np.broadcast_to(fine.full, shape), want_full)
  # The coarse tiles of the forward kernel (64 x 128) are the brute force's at that size too.
  coarse = block_mask.coarsen(fine, 64, 128)
  want_visible, want_full = _tiles(_dense_keep(mask_fn, batch, heads, q_len, kv_len, padded_q,
                                               padded_kv), 64, 128)
  np.testing.assert_array_equal(np.broadcast_to(coarse.visible, want_visible.shape),
                                want_visible)
  np.testing.assert_array_equal(np.broadcast_to(coarse.full, want_full.shape), want_full)


@pytest.mark.parametrize("shape", [(2, 3, 384, 256), (1, 1, 1, 256), (2, 1, 384, 1),
                                   (1, 3, 1, 1)])
def test_mask_tiles_match_brute_force(shape, seed):
  rng = np.random.default_rng(seed)
  # Blocks of constant value with some noise: tiles of every kind (empty, full, mixed).
  mask = rng.random(shape) < 0.5
  mask |= (np.arange(shape[3]) // 128 % 2 == 0)[None, None, None, :]
  mods = mods_lib.KernelMods(mask=mods_lib.BroadcastAxes.of(shape))
  fine = block_mask.fine_visibility(mods, mods_lib.ModArrays(mask=jnp.asarray(mask, jnp.int8)),
                                    384, 256)
  full_shape = (shape[0], shape[1], 384, 256)
  want_visible, want_full = _tiles(np.broadcast_to(mask, full_shape), FINE, FINE)
  np.testing.assert_array_equal(np.broadcast_to(fine.visible, want_visible.shape),
                                want_visible)
  np.testing.assert_array_equal(np.broadcast_to(fine.full, want_full.shape), want_full)


def test_group_union_is_any_visible_all_full():
  rng = np.random.default_rng(0)
  visible = rng.random((2, 6, 4, 5)) < 0.5
  full = visible & (rng.random(visible.shape) < 0.5)
  union = block_mask.group_union(block_table.BlockVisibility(jnp.asarray(visible),
                                                             jnp.asarray(full)), 3)
  np.testing.assert_array_equal(union.visible, visible.reshape(2, 2, 3, 4, 5).any(axis=2))
  np.testing.assert_array_equal(union.full, full.reshape(2, 2, 3, 4, 5).all(axis=2))


def test_window_mask_fn_tables_skip_and_unmask():
  """A sliding window written as mask_fn, 2048 x 2048: the forward table visits only the tiles
  the window reaches and marks the ones inside it unmasked (as the positional window would)."""
  q_len = kv_len = 2048

  def window_256(b, h, q_idx, kv_idx):
    return jnp.abs(q_idx - kv_idx) < 256

  mods, arrays = _element_fns_call(window_256, 1, 2, q_len, kv_len)
  static = ops._static(64, 0.125, mask_lib.MaskSpec(), True, None, None, None, mods)
  fine = block_mask.fine_visibility(mods, arrays.padded(q_len, kv_len), q_len, kv_len)
  lengths = jnp.full((1,), q_len, jnp.int32)
  cfg = static.fwd_cfg
  vis = ops._visibility(static, cfg, lengths, lengths, q_len, kv_len, arrays, fine)
  nq, nk = q_len // cfg.block_q, kv_len // cfg.block_kv
  i = np.arange(nq)[:, None] * cfg.block_q
  j = np.arange(nk)[None, :] * cfg.block_kv
  # Tile [i, i + bq) x [j, j + bk): some pair within 256 / every pair within 256.
  near = np.maximum(j - (i + cfg.block_q - 1), i - (j + cfg.block_kv - 1)) < 256
  far = np.maximum(np.abs(i - (j + cfg.block_kv - 1)), np.abs(i + cfg.block_q - 1 - j)) < 256
  np.testing.assert_array_equal(np.asarray(vis.visible)[0, 0], near)
  np.testing.assert_array_equal(np.asarray(vis.full)[0, 0], far)
  assert near.mean() < 0.3 and far.sum() > 0
  table = block_table.query_major(vis)
  assert int(table.counts.max()) < nk // 2


# ---------------------------------------------------------------------------------------------
# The kernels with element-mask tables, in the interpreter, against the reference.


def _structured_masks(batch: int, heads: int, q_len: int, kv_len: int, seed: int):
  """Boolean masks with empty, full and mixed tiles: documents of 96 per batch element (shifted
  by the batch index), and a key padding mask."""
  q_doc = (np.arange(q_len)[None, :] + 40 * np.arange(batch)[:, None]) // 96
  kv_doc = (np.arange(kv_len)[None, :] + 40 * np.arange(batch)[:, None]) // 96
  documents = q_doc[:, None, :, None] == kv_doc[:, None, None, :]  # [B, 1, T, S]
  rng = np.random.default_rng(seed)
  valid = np.arange(kv_len)[None, :] < rng.integers(kv_len // 2, kv_len, (batch, 1))
  return {"documents_B1TS": documents, "key_padding_B11S": valid[:, None, None, :],
          "head_documents_1HTS": np.stack([documents[0, 0], ~documents[0, 0]] * (heads // 2))[
              None]}


_MASKS = ["documents_B1TS", "key_padding_B11S", "head_documents_1HTS"]


def _check_structured_mask(name: str, seed: int, *, q_len: int, kv_len: int, head_dim: int,
                           interpret: bool):
  batch, heads_q, heads_kv = 2, 4, 2
  mask = jnp.asarray(_structured_masks(batch, heads_q, q_len, kv_len, seed)[name])
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (batch, q_len, heads_q, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, kv_len, heads_kv, head_dim), jnp.bfloat16)
          for key in keys[1:3])
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)

  def run(q, k, v, do, implementation):
    def f(q, k, v):
      return pallas_attn.attention(q, k, v, mask=mask, is_causal=True,
                                   implementation=implementation,
                                   interpret=interpret and implementation == "mosaic_gpu")

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))

  got = jax.jit(lambda *a: run(*a, "mosaic_gpu"))(q, k, v, do)
  want = jax.jit(lambda *a: run(*a, "reference"))(*(x.astype(jnp.float32)
                                                     for x in (q, k, v, do)))
  failures = []
  for quantity, g, w in zip(cases.QUANTITIES, got, want):
    err = cases.rel_err(np.asarray(g, np.float32), w)
    if not err <= cases.TOLERANCES[cases.BF16][quantity]:
      failures.append(f"{quantity}: rel err {err:.3e}")
  assert not failures, f"{name}: " + "; ".join(failures)


@pytest.mark.parametrize("name", _MASKS)
def test_interpreted_structured_masks_match_reference(name, seed):
  _check_structured_mask(name, seed, q_len=300, kv_len=333, head_dim=64, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", _MASKS)
def test_gpu_structured_masks_match_reference(name, head_dim, seed):
  from test_mosaic_gpu import _poison_allocator
  _poison_allocator(256 << 20)
  _check_structured_mask(name, seed, q_len=1000, kv_len=1537, head_dim=head_dim,
                         interpret=False)


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpreted"),
                                       pytest.param(False, id="gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("head_dim,variant", [(128, "dq_column_halves_step_late"),
                                               (64, "dq_row_halves_step_late")])
def test_fused_dq_a_step_late_walks_a_block_table(interpret, head_dim, variant, seed):
  """The fused dQ in halves (of the columns at head_dim 128, of the rows at 64) a step late
  (`dq_step_late`) over a block table, whose skipped entries both warpgroups step as masked
  ones: the pending dQ carried through them."""
  from test_mosaic_gpu import _VARIANTS, _poison_allocator, kernel_table
  with kernel_table(head_dim, _VARIANTS[variant]):
    if not interpret:
      _poison_allocator(256 << 20)
    _check_structured_mask("documents_B1TS", seed, q_len=300 if interpret else 1000,
                           kv_len=333 if interpret else 1537, head_dim=head_dim,
                           interpret=interpret)


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpreted"),
                                       pytest.param(False, id="gpu", marks=pytest.mark.gpu)])
def test_group_parts_walk_the_group_union_table(interpret, seed):
  """A group of 2 query heads in two dK/dV CTAs (`group_parts`), each walking the kv head's
  block table (the union over the group's per-head documents) for its own head."""
  from test_mosaic_gpu import _VARIANTS, _poison_allocator, kernel_table
  with kernel_table(128, _VARIANTS["group_parts_2"]):
    if not interpret:
      _poison_allocator(256 << 20)
    _check_structured_mask("head_documents_1HTS", seed, q_len=300 if interpret else 1000,
                           kv_len=333 if interpret else 1537, head_dim=128,
                           interpret=interpret)


def test_position_only_mask_fn_is_classified_while_tracing():
  """A mask_fn of positions alone costs nothing per call: its tiles are computed while tracing
  (concrete arrays, equal to the per-call evaluation). One that reads the head index has none:
  it is evaluated in the program (a loop over chunks)."""
  mods, arrays = _element_fns_call(window_48, 2, 3, 300, 333)
  tiles = block_mask.position_tiles(mods, 384, 384)
  assert not any(isinstance(x, jax.core.Tracer) for x in tiles)
  per_call = block_mask.fine_visibility(mods, arrays, 384, 384)
  np.testing.assert_array_equal(tiles.visible, per_call.visible)
  np.testing.assert_array_equal(tiles.full, per_call.full)
  traced = jax.make_jaxpr(lambda a: block_mask.fine_visibility(mods, a, 384, 384, tiles))(arrays)
  assert "scan" not in {eqn.primitive.name for eqn in traced.jaxpr.eqns}
  head_mods, _ = _element_fns_call(head_windows, 2, 3, 300, 333)
  assert block_mask.position_tiles(head_mods, 384, 384) is None
