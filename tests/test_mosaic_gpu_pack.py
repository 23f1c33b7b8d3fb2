"""Decode-shaped GQA calls, served by the kernels with the group's query heads packed into tile
rows (`pallas_attn.mosaic_gpu.gqa_pack`), against the float32 reference and jax.nn.

On the CPU the kernels run in the Mosaic GPU interpreter; the `gpu` tests compile them:
  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_pack.py
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import cases
from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import gqa_pack
from test_mosaic_gpu import _poison_allocator

_c = cases._c  # pylint: disable=protected-access

# Each is packed (checked below): GQA, fewer queries than a CTA's 128 rows, no position mask.
PACKED_CASES = (
    _c("decode_gqa_1x300", 2, 1, 300, 8, 2, kv_lengths=[300, 123]),
    _c("decode_gqa_lengths_13x77", 2, 13, 77, 6, 2, q_lengths=[13, 5], kv_lengths=[0, 77]),
    # Bottom-right causal with one query hides no key: packed with the mask dropped.
    _c("decode_br_causal_1x200", 1, 1, 200, 4, 1, is_causal=True, causal_alignment="bottom_right"),
)
# Position matters (causal with several queries): not packed, served as before.
UNPACKED_CASES = (
    _c("decode_br_causal_16x200", 1, 16, 200, 4, 1, is_causal=True,
       causal_alignment="bottom_right"),
)


def _packs(case: cases.Case, rows_per_cta: int = 128) -> bool:
  offset = mask_lib.alignment_offset(case.causal_alignment, case.q_len, case.kv_len)
  spec = mask_lib.MaskSpec(is_causal=case.is_causal, local_window=case.window_pair,
                           offset=offset)
  q_shape = (case.batch, case.q_len, case.heads_q, case.head_dim)
  return gqa_pack.should_pack(q_shape, case.heads_kv, spec, case.kv_len, True, rows_per_cta)


def test_which_calls_pack():
  assert all(_packs(c) for c in PACKED_CASES)
  assert not any(_packs(c) for c in UNPACKED_CASES)
  assert not _packs(cases.get_case("causal_113x203").replace(heads_q=4, heads_kv=2))  # causal
  assert not _packs(cases.get_case("mha_17x17"))  # no group to pack
  assert not _packs(PACKED_CASES[0].replace(q_len=128))  # a CTA's rows: nothing to gain
  q_shape = (1, 1, 8, 64)  # a modifier that reads positions or heads
  assert not gqa_pack.should_pack(q_shape, 2, mask_lib.MaskSpec(), 300, False, 128)


def test_packing_is_a_relabelling():
  """Row t * G + g of kv head j holds (query t, head j * G + g); the stats follow; both invert."""
  batch, q_len, kv_heads, group, head_dim = 2, 3, 2, 4, 5
  rng = np.random.default_rng(0)
  x = rng.standard_normal((batch, q_len, kv_heads * group, head_dim)).astype(np.float32)
  packed = np.asarray(gqa_pack.pack_rows(jnp.asarray(x), kv_heads))
  for t in range(q_len):
    for j in range(kv_heads):
      for g in range(group):
        np.testing.assert_array_equal(packed[:, t * group + g, j], x[:, t, j * group + g])
  np.testing.assert_array_equal(gqa_pack.unpack_rows(packed, group), x)
  stats = rng.standard_normal((batch, kv_heads * group, q_len)).astype(np.float32)
  packed_stats = np.asarray(gqa_pack.pack_stats(jnp.asarray(stats), kv_heads))
  np.testing.assert_array_equal(packed_stats[:, 1, 2 * group + 3], stats[:, 1 * group + 3, 2])
  np.testing.assert_array_equal(gqa_pack.unpack_stats(packed_stats, group), stats)


@pytest.mark.parametrize("case", [pytest.param(c.replace(dtype=cases.BF16), id=c.name)
                                  for c in PACKED_CASES + UNPACKED_CASES])
def test_interpreted_decode_matches_reference(case, seed):
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed,
                   compare_jax_nn=case.causal_alignment == "top_left")


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 16])
def test_gpu_decode_matches_reference(q_len, seed):
  _poison_allocator(64 << 20)
  case = _c(f"decode_gqa_{q_len}x4000", 4, q_len, 4000, 32, 8, head_dim=128, dtype=cases.BF16,
            kv_lengths=[4000, 3001, 17, 2500])
  assert _packs(case)
  cases.check_case(case, "mosaic_gpu", seed=seed)
