"""exp2 on the FMA pipe (`mosaic_gpu.exp2`): its accuracy, its zeros, and the tile split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import exp2


def test_exp2_fma_relative_error_over_the_softmax_range():
  """Every argument a softmax tile gives (x <= 0) down to where 2^x leaves the normal floats,
  at the polynomial's bound (7.5e-5), and both sides of each rounding boundary."""
  x = np.concatenate([np.linspace(-125.0, 0.0, 500_001),
                      np.arange(-125, 1) + 0.5, np.arange(-125, 1) + 0.4999,
                      np.arange(-125, 1) - 0.4999]).astype(np.float32)
  x = x[x <= 0]
  got = np.asarray(jax.jit(exp2.exp2_fma)(x), np.float64)
  want = np.exp2(x.astype(np.float64))
  rel = np.abs(got - want) / want
  assert rel.max() < 7.6e-5, (x[rel.argmax()], rel.max())
  assert abs(np.mean((got - want) / want)) < 1e-5  # no bias the row sums would accumulate


def test_exp2_fma_hidden_scores_are_exactly_zero():
  """-inf (a hidden score), huge negatives and everything from -127 down give 0.0 exactly, so
  a row that sees no key keeps l == 0 (numerics.finish's empty-row test)."""
  x = jnp.array([-jnp.inf, -3.4e38, -1e30, -1e6, -200.0, -127.0, -126.6], jnp.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(exp2.exp2_fma)(x)), 0.0)


@pytest.mark.parametrize("fma_cols", [0, 8, 24, 128])
def test_exp2_tile_splits_by_columns(fma_cols):
  """The first columns are jnp.exp2's exactly, the last `fma_cols` the polynomial's."""
  x = -jnp.abs(jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)) * 8.0
  x = x.at[3, :].set(-jnp.inf)
  got = np.asarray(jax.jit(lambda x: exp2.exp2_tile(x, fma_cols))(x))
  sfu = 128 - fma_cols
  np.testing.assert_array_equal(got[:, :sfu], np.asarray(jnp.exp2(x[:, :sfu])))
  np.testing.assert_array_equal(got[:, sfu:], np.asarray(exp2.exp2_fma(x[:, sfu:])))
  np.testing.assert_allclose(got, np.exp2(np.asarray(x, np.float64)), rtol=7.6e-5, atol=0)
  assert (got[3] == 0).all()


@pytest.mark.parametrize("cols", [4, 12, -8, 136])
def test_exp2_fma_cols_must_be_whole_registers_of_the_tile(cols):
  with pytest.raises(ValueError, match="exp2_fma_cols must be a multiple of 8"):
    config_lib.KernelConfig(64, 128, exp2_fma_cols=cols)
