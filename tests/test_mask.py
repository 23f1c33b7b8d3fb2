"""Block ranges and segment-id block bounds against the element predicate, exhaustively on
small grids; the alignment offset against its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import mask as mask_lib

SPECS = [
    mask_lib.MaskSpec(),
    mask_lib.MaskSpec(is_causal=True),
    mask_lib.MaskSpec(local_window=(5, 0)),
    mask_lib.MaskSpec(local_window=(3, 9)),
    mask_lib.MaskSpec(is_causal=True, local_window=(17, 4)),
    mask_lib.MaskSpec(local_window=(0, 0)),
    # Bottom-right alignment: the diagonal shifted by kv_len - q_len, either sign.
    mask_lib.MaskSpec(is_causal=True, offset=16),
    mask_lib.MaskSpec(is_causal=True, offset=-10),
    mask_lib.MaskSpec(local_window=(3, 9), offset=-20),
    mask_lib.MaskSpec(is_causal=True, local_window=(17, 4), offset=5),
    mask_lib.MaskSpec(local_window=(4, 0), offset=70),
]


def _visible_grid(spec, q_len, kv_len, q_length, kv_length):
  q = np.arange(q_len)[:, None]
  k = np.arange(kv_len)[None, :]
  return np.asarray(mask_lib.visible(spec, q, k, q_length, kv_length))


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("block_q,block_kv", [(8, 8), (8, 16), (16, 8)])
def test_block_ranges_cover_exactly_the_visible_tiles(spec, block_q, block_kv):
  q_len, kv_len = 48, 64
  nq, nk = q_len // block_q, kv_len // block_kv

  def tiles(q_length, kv_length):  # [nq, nk, block_q, block_kv]
    vis = _visible_grid(spec, q_len, kv_len, q_length, kv_length)
    return vis.reshape(nq, block_q, nk, block_kv).transpose(0, 2, 1, 3)

  for q_length, kv_length in [(48, 64), (30, 21), (48, 0), (7, 64)]:
    # Forward / dQ orientation: key blocks for each query block.
    by_kv = tiles(None, kv_length)
    for i in range(nq):
      lo, hi = (int(x) for x in mask_lib.kv_block_range(spec, i * block_q, block_q, block_kv,
                                                       nk, kv_length))
      flo, fhi = (int(x) for x in mask_lib.kv_full_range(spec, i * block_q, block_q, block_kv,
                                                        lo, hi, kv_length))
      assert lo <= flo <= fhi <= hi
      for j in range(nk):
        if by_kv[i, j].any():
          assert lo <= j < hi, (i, j, lo, hi)
        if flo <= j < fhi:
          assert by_kv[i, j].all(), (i, j, flo, fhi)
    # dK/dV orientation: query blocks for each key block.
    by_q = tiles(q_length, None)
    by_pos = tiles(None, None)
    for j in range(nk):
      lo, hi = (int(x) for x in mask_lib.q_block_range(spec, j * block_kv, block_kv, block_q,
                                                      nq, q_length))
      flo, fhi = (int(x) for x in mask_lib.q_full_range(spec, j * block_kv, block_kv, block_q,
                                                       lo, hi))
      assert lo <= flo <= fhi <= hi
      for i in range(nq):
        if by_q[i, j].any():
          assert lo <= i < hi, (j, i, lo, hi)
        if flo <= i < fhi:
          assert by_pos[i, j].all(), (j, i, flo, fhi)


@pytest.mark.parametrize("alignment,offset", [("top_left", 0), ("bottom_right", 30 - 20)])
def test_alignment_offset(alignment, offset):
  assert mask_lib.alignment_offset(alignment, 20, 30) == offset
  spec = mask_lib.MaskSpec(is_causal=True, offset=offset)
  vis = _visible_grid(spec, 20, 30, None, None)
  # Bottom-right: the last query sees every key; top-left: query i sees keys 0..i.
  want = np.arange(30)[None, :] <= np.arange(20)[:, None] + offset
  np.testing.assert_array_equal(vis, want)
  with pytest.raises(ValueError, match="causal_alignment"):
    mask_lib.alignment_offset("center", 20, 30)


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("block_q,block_kv", [(8, 8), (8, 16), (16, 8)])
def test_segment_blocks_meet_never_hides_a_visible_tile(sort, block_q, block_kv):
  """Where `segment_blocks_meet` says False, no query of the block shares an id with a key of
  the other (in any batch element); with sorted ids it also says False somewhere."""
  q_len, kv_len = 45, 61  # not multiples of the blocks: the padding repeats the last id
  nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
  kq, kk = jax.random.split(jax.random.key(block_q * block_kv + sort))
  q_ids = jax.random.randint(kq, (2, q_len), 0, 5).astype(jnp.int32)
  kv_ids = jax.random.randint(kk, (2, kv_len), 0, 5).astype(jnp.int32)
  if sort:
    q_ids, kv_ids = jnp.sort(q_ids, axis=1), jnp.sort(kv_ids, axis=1)
  meet = np.asarray(mask_lib.segment_blocks_meet(q_ids, kv_ids, block_q, block_kv, nq, nk))
  assert meet.shape == (nq, nk)
  same = np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]  # [2, T, S]
  for i in range(nq):
    for j in range(nk):
      tile = same[:, i * block_q:(i + 1) * block_q, j * block_kv:(j + 1) * block_kv]
      if tile.any():
        assert meet[i, j], (i, j)
  if sort:
    assert not meet.all()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (3, 0), (0, 2), (5, 7)])
@pytest.mark.parametrize("offset", [-9, -1, 0, 4])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (7, 3), (3, 7), (12, 12)])
def test_every_row_sees_a_key_matches_brute_force(is_causal, window, offset, q_len, kv_len):
  spec = mask_lib.MaskSpec(is_causal=is_causal, local_window=window, offset=offset)
  q_pos = np.arange(q_len)[:, None]
  kv_pos = np.arange(kv_len)[None, :]
  dense = np.asarray(mask_lib.visible(spec, jnp.asarray(q_pos), jnp.asarray(kv_pos)))
  dense = np.broadcast_to(dense, (q_len, kv_len))
  assert mask_lib.every_row_sees_a_key(spec, q_len, kv_len) == bool(dense.any(axis=1).all())
