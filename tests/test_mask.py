"""Block ranges against the element predicate, exhaustively on small grids."""

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
