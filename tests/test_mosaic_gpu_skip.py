"""Block tables: the Mosaic GPU kernels skip tiles by segment ids (packed documents).

- The table builder (`mosaic_gpu.block_table`) against a brute-force numpy computation: which
  tiles are visited and which need no mask, that a skipped tile really holds no visible pair and
  an unmasked one no hidden pair, and the compacted per-CTA lists.
- The kernels over the tables (interpreter, short cases; `gpu`: compiled on a Hopper GPU) against
  the dense float32 reference of test_mosaic_gpu_mods.py: out, lse, dq, dk, dv.
  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_skip.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import dropout
from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import block_table
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import ops
from test_mosaic_gpu import _poison_allocator
from test_mosaic_gpu_dropout import RATE, _inputs
from test_mosaic_gpu_mods import _case, _check, _kernel_vjp

_WGS = config_lib.COMPUTE_WARPGROUPS

# ---------------------------------------------------------------------------------------------
# The table builder against brute force.


def _packed_ids(rng, batch: int, length: int, docs: int):
  """int32 [batch, length]: sorted ids of `docs` documents of random uneven lengths."""
  cuts = np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False), axis=-1)
  return np.stack([np.searchsorted(cuts, np.arange(length), side="right")
                   for _ in range(batch)]).astype(np.int32)


def _dense_truth(spec, q_ids, kv_ids, q_lengths, kv_lengths, q_pad, kv_pad):
  """bool [batch, q_pad, kv_pad]: pair visibility (position, lengths, segments); padded keys and
  rows past their length see nothing. Ids are edge-padded (as `mask.segment_block_bounds`)."""
  pad = lambda ids, n: np.pad(ids, ((0, 0), (0, n - ids.shape[1])), mode="edge")
  q_ids, kv_ids = pad(q_ids, q_pad), pad(kv_ids, kv_pad)
  q_pos, kv_pos = np.arange(q_pad)[:, None], np.arange(kv_pad)[None, :]
  pos = np.asarray(mask_lib.visible(spec, q_pos, kv_pos))
  pos = pos & (kv_pos < kv_lengths[:, None, None]) & (q_pos < q_lengths[:, None, None])
  return pos & (q_ids[:, :, None] == kv_ids[:, None, :])


def _tiles(x, block_q, block_kv):
  batch, q_pad, kv_pad = x.shape
  return x.reshape(batch, q_pad // block_q, block_q, kv_pad // block_kv, block_kv)


_BUILDER_CASES = [
    pytest.param(mask_lib.MaskSpec(), 64, 128, id="full_64x128"),
    pytest.param(mask_lib.MaskSpec(is_causal=True), 64, 64, id="causal_64x64"),
    pytest.param(mask_lib.MaskSpec(is_causal=True, offset=37), 64, 128, id="causal_offset_64x128"),
    pytest.param(mask_lib.MaskSpec(local_window=(200, 40)), 64, 64, id="window_64x64"),
]


@pytest.mark.parametrize("spec, block_q, block_kv", _BUILDER_CASES)
@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_block_visibility_matches_brute_force(spec, block_q, block_kv, order):
  rng = np.random.default_rng(0)
  batch, q_len, kv_len = 3, 700, 530
  q_pad, kv_pad = mask_lib.round_up(q_len, 2 * block_q), mask_lib.round_up(kv_len, 2 * block_kv)
  q_ids, kv_ids = _packed_ids(rng, batch, q_len, 6), _packed_ids(rng, batch, kv_len, 6)
  if order == "unsorted":  # documents in another order: ranges overlap more, fewer tiles skipped
    relabel = np.array([3, 0, 5, 1, 4, 2])
    q_ids, kv_ids = relabel[q_ids], relabel[kv_ids]
  q_ids[1], kv_ids[1] = 0, 0  # one document: positions alone decide
  kv_ids[2, :150] = 99  # keys of a segment no query shares
  q_lengths, kv_lengths = np.array([q_len, 650, 300]), np.array([kv_len, 500, kv_len])
  nq, nk = q_pad // block_q, kv_pad // block_kv
  vis = block_table.block_visibility(
      spec, jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32),
      block_q=block_q, block_kv=block_kv, num_q_blocks=nq, num_kv_blocks=nk,
      q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))
  visible, full = (np.asarray(x)[:, 0] for x in vis)  # heads axis of size 1
  assert visible.shape == (batch, nq, nk)

  pairs = _tiles(_dense_truth(spec, q_ids, kv_ids, q_lengths, kv_lengths, q_pad, kv_pad),
                 block_q, block_kv)
  # Skipped tiles hold no visible pair.
  assert not (pairs.any(axis=(2, 4)) & ~visible).any()
  # Unmasked tiles: every pair with a query inside its length is visible.
  live_rows = _tiles(np.broadcast_to((np.arange(q_pad) < q_lengths[:, None])[:, :, None],
                                     pairs.shape[:1] + (q_pad, kv_pad)), block_q, block_kv)
  assert (pairs | ~live_rows).all(axis=(2, 4))[full].all()

  # And exactly what the positional block test and the per-block id bounds say: a tile is
  # visited where the band (causal / window) meets it, its key block starts before the key length
  # and its query block before the query length, and the id ranges overlap; it is unmasked where
  # every pair (every row: the block test ignores query lengths) is in the band and before the
  # key length, and both blocks hold one and the same id.
  everyone = np.full_like(q_lengths, q_pad), np.full_like(kv_lengths, kv_pad)
  zeros = np.zeros_like(q_ids), np.zeros_like(kv_ids)
  band = _tiles(_dense_truth(spec, *zeros, *everyone, q_pad, kv_pad), block_q, block_kv)
  band_lengths = _tiles(_dense_truth(spec, *zeros, everyone[0], kv_lengths, q_pad, kv_pad),
                        block_q, block_kv)
  starts = lambda n, block: np.arange(n)[None, :] * block
  live = ((starts(nq, block_q) < q_lengths[:, None])[:, :, None]
          & (starts(nk, block_kv) < kv_lengths[:, None])[:, None, :])
  edge = lambda ids, n: np.pad(ids, ((0, 0), (0, n - ids.shape[1])), mode="edge")
  q_blocks = edge(q_ids, q_pad).reshape(batch, nq, block_q)
  kv_blocks = edge(kv_ids, kv_pad).reshape(batch, nk, block_kv)
  q_lo, q_hi = q_blocks.min(-1)[:, :, None], q_blocks.max(-1)[:, :, None]
  kv_lo, kv_hi = kv_blocks.min(-1)[:, None], kv_blocks.max(-1)[:, None]
  want_visible = band.any(axis=(2, 4)) & live & (q_lo <= kv_hi) & (kv_lo <= q_hi)
  np.testing.assert_array_equal(visible, want_visible)
  want_full = (band_lengths.all(axis=(2, 4)) & want_visible & (q_lo == q_hi) & (kv_lo == kv_hi)
               & (q_lo == kv_lo))
  np.testing.assert_array_equal(full, want_full)
  assert full.any() and (visible & ~full).any() and (~visible).any()  # the case has all three


def _check_lists(table, visible, full):
  """Each CTA's list: the blocks any of its rows visits, increasing, with each row's mode."""
  entries, counts = (np.asarray(x)[:, 0] for x in table)
  batch, rows, cols = visible.shape
  mode = np.where(full, block_table.FULL, np.where(visible, block_table.MASKED, block_table.SKIP))
  mode = mode.reshape(batch, rows // _WGS, _WGS, cols)
  for b in range(batch):
    for tile in range(rows // _WGS):
      want = np.flatnonzero((mode[b, tile] != block_table.SKIP).any(axis=0))
      got = entries[b, tile, :counts[b, tile]]
      blocks = [int(block_table.decode(e, 0)[0]) for e in got]
      assert blocks == list(want), (b, tile)
      for wg in range(_WGS):
        modes = [int(block_table.decode(e, wg)[1]) for e in got]
        assert modes == list(mode[b, tile, wg, want]), (b, tile, wg)


def test_block_tables_list_each_cta_blocks():
  rng = np.random.default_rng(1)
  batch, length, block = 2, 1000, 64
  padded = mask_lib.round_up(length, 2 * block)
  ids = jnp.asarray(_packed_ids(rng, batch, length, 7))
  lengths = jnp.asarray([length, 900], jnp.int32)
  vis = block_table.block_visibility(
      mask_lib.MaskSpec(is_causal=True), lengths, lengths, block_q=block, block_kv=block,
      num_q_blocks=padded // block, num_kv_blocks=padded // block, q_segment_ids=ids,
      kv_segment_ids=ids)
  visible, full = (np.asarray(x)[:, 0] for x in vis)
  _check_lists(block_table.query_major(vis), visible, full)
  _check_lists(block_table.key_major(vis), visible.swapaxes(1, 2), full.swapaxes(1, 2))
  # Packed documents: most tiles are skipped (the causal half and more).
  assert visible.mean() < 0.4


def test_block_mask_is_anded_in():
  """A caller's per-head block mask pair narrows the table and gives it a heads axis."""
  lengths = jnp.asarray([256], jnp.int32)
  ids = jnp.zeros((1, 256), jnp.int32)
  heads, n = 3, 4
  can = jnp.asarray(np.random.default_rng(2).random((1, heads, n, n)) < 0.5)
  vis = block_table.block_visibility(
      mask_lib.MaskSpec(), lengths, lengths, block_q=64, block_kv=64, num_q_blocks=n,
      num_kv_blocks=n, q_segment_ids=ids, kv_segment_ids=ids,
      block_mask=block_table.BlockVisibility(can, jnp.zeros_like(can)))
  np.testing.assert_array_equal(vis.visible, can)
  assert not np.asarray(vis.full).any()
  assert block_table.query_major(vis).counts.shape == (1, heads, n // _WGS)


def test_tables_hold_no_quadratic_value():
  """Building the tables (forward, dQ, dK/dV) stores nothing of size q_len x kv_len."""
  q_len, kv_len = 1000, 1100
  q = jax.ShapeDtypeStruct((2, q_len, 2, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, 64), jnp.bfloat16)
  ids = (jax.ShapeDtypeStruct((2, q_len), jnp.int32), jax.ShapeDtypeStruct((2, kv_len), jnp.int32))

  def loss(q, k, v, q_ids, kv_ids):
    out, _ = ops.attention(q, k, v, None, None, scale=0.125, spec=mask_lib.MaskSpec(is_causal=True),
                           interpret=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    return out.astype(jnp.float32).sum()

  report = cases.find_quadratic_intermediates(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, *ids,
                                              q_len=q_len, kv_len=kv_len)
  assert not report, report.offenders[:10]
  assert report.primitives.get("argsort", 0) + report.primitives.get("sort", 0) >= 2, (
      report.primitives)  # the walk saw the tables being built


# ---------------------------------------------------------------------------------------------
# The kernels over the tables.

# 300 queries, 5 documents of uneven lengths; the first 20 keys are of a segment no query shares
# (rows of the first document see no key). GQA 4 over 2 (2 over 1 with lengths). Causal: tiles of
# the dQ and dK/dV grids (64 x 64) inside the second document are FULL (no mask); not causal, the
# long third document makes FULL tiles of the forward's 64 x 128 grid too.
_KERNEL_CASES = {c.name: c for c in (
    _case("docs_causal_300x300", 1, 300, 300, 4, 2, is_causal=True,
          segment_cuts=((0.1, 0.7, 0.8, 0.9),), foreign_keys=20),
    _case("docs_lengths_300x333", 1, 300, 333, 2, 1, q_lengths=(250,), kv_lengths=(320,),
          segment_cuts=((0.04, 0.1, 0.93, 0.96),), foreign_keys=20),
)}


@pytest.mark.parametrize("name", list(_KERNEL_CASES))
def test_interpreted_kernels_skip_by_segment(name, seed):
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  _check(_KERNEL_CASES[name], seed, interpret=True)
  assert interpret_pallas_call.get_races().races_found is False


def test_skipping_kernels_lower_for_cuda():
  """The table reads and the per-entry branches pass the real Mosaic GPU lowering (on the CPU)."""
  for head_dim in (64, 256):
    case = _KERNEL_CASES["docs_causal_300x300"].with_base(head_dim=head_dim)
    q, k, v, do = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.inputs(0))
    args = (q, k, v, do, *case.segment_ids(), None, *case.base.lengths())
    lowered = _kernel_vjp.trace(*args, case=case, interpret=False).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 3


def _gpu_params():
  """2048 x 2048, 8 documents of uneven lengths (and a foreign segment), at head_dim 128 and 64."""
  cuts = ((0.1, 0.15, 0.3, 0.5, 0.55, 0.7, 0.9),) * 2
  params = []
  for head_dim in (128, 64):
    for causal in (True, False):
      name = f"docs8_{'causal_' if causal else ''}2048x2048"
      c = _case(name, 2, 2048, 2048, 4, 2, is_causal=causal, segment_cuts=cuts,
                foreign_keys=100).with_base(head_dim=head_dim)
      params.append(pytest.param(c, id=f"{name}-d{head_dim}"))
  c = _KERNEL_CASES["docs_lengths_300x333"].with_base(head_dim=128)
  params.append(pytest.param(c, id=f"{c.name}-d128"))
  return params


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_params())
def test_gpu_kernels_skip_by_segment(case, seed):
  _poison_allocator(64 << 20)
  _check(case, seed, interpret=False)


def test_benchmark_skipped_fraction_is_what_the_forward_table_visits():
  """benchmarks/masking.py reports the Mosaic GPU forward's skipped tiles: those its block table
  leaves out (8 documents of 2048 in 16384, causal: ~94%)."""
  from benchmarks import masking
  from benchmarks.shapes import Shape
  shape = Shape(1, 16384, 16384, 1, 1, 128, True, "docs", segment_len=2048)
  cfg = config_lib.forward_config(shape.head_dim)
  lengths = jnp.asarray([shape.seq_q], jnp.int32)
  ids = jnp.asarray(masking.segment_ids(shape))
  vis = block_table.block_visibility(
      masking.mask_spec(shape), lengths, lengths, block_q=cfg.block_q, block_kv=cfg.block_kv,
      num_q_blocks=shape.seq_q // cfg.block_q, num_kv_blocks=shape.seq_kv // cfg.block_kv,
      q_segment_ids=ids, kv_segment_ids=ids)
  skipped = 1.0 - float(np.asarray(vis.visible).mean())
  reported = masking.masking_fields("pallas_attn:mosaic_gpu", shape)["skipped_block_fraction"]
  assert reported == pytest.approx(skipped, abs=1e-12)
  assert skipped > 0.93


def test_interpreted_dropout_over_tables(seed):
  """Dropout over block tables (the keep-mask regenerated from positions on FULL tiles, which load
  no segment ids), against the portable path."""
  q, k, v, do, key = _inputs(1, 200, 200, 2, 1, 64, seed)
  ids = jnp.asarray((np.arange(200) >= 190)[None], jnp.int32)  # documents [0, 190), [190, 200)

  def kernels(q, k, v):
    out, lse = ops.attention(q, k, v, None, None, scale=0.125, spec=mask_lib.MaskSpec(),
                             interpret=True, q_segment_ids=ids, kv_segment_ids=ids,
                             dropout_rate=RATE, dropout_seed=dropout.seed_from_key(key))
    return out, jnp.swapaxes(lse, 1, 2)  # as the API returns it

  def portable(q, k, v):
    return pallas_attn.attention(q, k, v, segment_ids=ids, implementation="blocked_jax",
                                 dropout_rate=RATE, dropout_rng=key, return_residual=True)

  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  got, want = _outputs_and_grads(kernels, q, k, v, do), _outputs_and_grads(portable, *up)
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    err = cases.rel_err(g, w)
    assert err < (1e-4 if name == "lse" else 2e-2), f"{name}: rel err {err:.3e}"


def _outputs_and_grads(f, q, k, v, do):
  """(out, lse, dq, dk, dv) of `f(q, k, v) -> (out, lse)` with the output cotangent `do`."""
  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
  return (out, lse, *vjp((do, jnp.zeros_like(lse))))
