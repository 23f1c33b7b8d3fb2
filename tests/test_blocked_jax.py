"""The portable blocked path (implementation="blocked_jax") on every shared case and dtype, plus
explicit small block sizes so that short sequences also span many blocks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
from pallas_attn import blocked_jax
from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn import reference


@pytest.mark.parametrize("case", cases.case_params(cases.ALL_DTYPES))
def test_blocked_jax_matches_reference(case, seed):
  cases.check_case(case, "blocked_jax", seed=seed)


@pytest.mark.parametrize("case", [pytest.param(c.replace(dtype=dtype), id=c.replace(dtype=dtype).id)
                                  for c in cases.ALIGNMENT_CASES
                                  for dtype in (cases.F32, cases.BF16)])
def test_bottom_right_alignment_matches_reference(case, seed):
  cases.check_case(case, "blocked_jax", seed=seed)


# Random combinations of the position masks (`cases.random_case`), the dtypes in turn.
@pytest.mark.parametrize("case", [cases.random_case(i, (8, 16, 40, 64), cases.ALL_DTYPES)
                                  for i in range(10)], ids=lambda case: case.id)
def test_blocked_jax_random_cases(case, seed):
  cases.check_case(case, "blocked_jax", seed=seed)


# Block sizes that do not divide the lengths and differ between q and kv: many partial tiles,
# skipped tiles (causal/window) and tiles that straddle the window edges and the kv lengths.
_BLOCK_CASES = [
    ("causal_113x203", 16, 8),
    ("causal_203x113", 8, 24),
    ("window_l32_r8_203x113", 24, 16),
    ("causal_window_l16_emptyrows_203x64", 16, 16),
    ("window_lengths_emptyrows_113x203", 8, 32),
    ("lengths_kv0_113x203", 32, 8),
    ("gqa_causal_lengths_113x203", 16, 40),
]


@functools.partial(jax.jit, static_argnames=("case", "block_q", "block_kv", "blocked"))
def _direct_vjp(q, k, v, do, q_lengths, kv_lengths, *, case, block_q, block_kv, blocked):
  scale = case.scale if case.scale is not None else 1.0 / np.sqrt(case.head_dim)
  spec = mask_lib.MaskSpec(is_causal=case.is_causal, local_window=case.window_pair)

  def f(q, k, v):
    if blocked:
      out, lse = blocked_jax.attention(q, k, v, q_lengths, kv_lengths, scale=scale, spec=spec,
                                       block_q=block_q, block_kv=block_kv)
      return numerics.finalize_empty_rows(out, lse, v, q_lengths)
    return reference.reference_attention(q, k, v, scale=scale, spec=spec, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths)

  out, vjp, lse = jax.vjp(f, q, k, v, has_aux=True)
  return out, lse, vjp(do)


@pytest.mark.parametrize("name,block_q,block_kv", _BLOCK_CASES,
                         ids=[f"{n}-bq{bq}-bkv{bk}" for n, bq, bk in _BLOCK_CASES])
def test_small_blocks(name, block_q, block_kv, seed):
  case = cases.get_case(name)
  q, k, v, do = cases.make_inputs(case, seed)
  q_lengths, kv_lengths = case.lengths()
  run = functools.partial(_direct_vjp, q, k, v, do, q_lengths, kv_lengths, case=case,
                          block_q=block_q, block_kv=block_kv)
  out, lse, grads = run(blocked=True)
  ref_out, ref_lse, ref_grads = run(blocked=False)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)  # [B, H, T]
  empty = ref_lse == numerics.MASK_VALUE
  np.testing.assert_array_equal(empty, np.repeat(case.empty_rows()[:, None], case.heads_q, 1))
  np.testing.assert_array_equal(lse[empty], numerics.MASK_VALUE)
  assert cases.rel_err(lse[~empty], ref_lse[~empty]) <= 1e-6
  for got, want, what in zip((out, *grads), (ref_out, *ref_grads), cases.QUANTITIES):
    err = cases.rel_err(got, want)
    assert err <= 2e-5, f"{what}: rel err {err:.3e} with blocks ({block_q}, {block_kv})"


def test_default_blocks_are_8_aligned_and_at_most_128():
  for q_len, kv_len in [(1, 1), (17, 1000), (1000, 17), (128, 129), (1023, 1024)]:
    bq, bk = blocked_jax.default_blocks(q_len, kv_len)
    assert bq % 8 == 0 and bk % 8 == 0
    assert bq <= 128 and bk <= 128
    assert bq >= min(q_len, 128) and bk >= min(kv_len, 128)


# A peaked softmax amplifies rounding in delta = rowsum(dO * O); the blocked path keeps the float32
# output for it (the residual), which this case needs to stay within 2x of the reference.
@pytest.mark.parametrize("dtype", [cases.BF16, cases.F16], ids=cases.dtype_name)
def test_peaky_softmax_gradients(dtype, seed):
  case = cases.get_case("peaky_scale4_128x128").replace(dtype=dtype)
  cases.check_case(case, "blocked_jax", seed=seed, compare_jax_nn=False)
