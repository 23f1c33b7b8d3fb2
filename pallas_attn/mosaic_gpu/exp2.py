"""exp2 of a score tile split between the SFU and the FMA pipe (FlashAttention-4's trick).

An H100/H200 SM evaluates 16 `ex2.approx` a clock (the SFU, MUFU.EX2) but issues 128 float32
adds and fused multiply-adds. A [64, 128] tile of one warpgroup needs 8192 exponentials: 512
clocks of SFU, as long as the tile's two matmuls take at head_dim 64. `exp2_tile` sends the last
`fma_cols` columns of the tile through a polynomial on the FMA pipe instead (Cody-Waite range
reduction, then a degree-3 minimax polynomial), so both pipes share the work. Measured on the
H200 (benchmarks/NOTES.md session 11) it is slower at every split (0.88-0.99x): the tiles are
bound by instruction issue, not by the SFU. Kept as `KernelConfig.exp2_fma_cols`, off in the
table.

Accuracy: relative error below 7.6e-5 for every x in [-125, 0] (the SFU's own is ~2e-7; below
2^-125 a result may flush to 0, as the SFU's `.ftz` does); the probabilities are rounded to bf16
(2^-8) or f16 (2^-11) before P V, so the difference is far below what the output keeps. 2^x is
exactly 0 for x <= -127 and for -inf (hidden scores), as the SFU gives, so a row that sees no
key still sums to exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Minimax polynomial for 2^f on f in [-0.5, 0.5] (relative error), lowest degree first.
_POLY = (0.999928144190672, 0.6932609729047163, 0.24260998935426914, 0.05517109382050589)
# Adding 1.5 * 2^23 to a float32 of magnitude below 2^22 rounds it to an integer held in the
# low mantissa bits (round to nearest even); the extra 127 is float32's exponent bias, so those
# bits shifted left by 23 are already the exponent field of 2^round(x).
_ROUND_BIAS = 1.5 * 2.0 ** 23 + 127.0
# Below this, 2^x is taken as 0: round(x) = -127 makes an exponent field of 0, i.e. 0.0.
_X_MIN = -127.0


def exp2_fma(x: jax.Array) -> jax.Array:
  """2^x for float32 x <= 0 (or -inf) with adds, multiplies and integer shifts only."""
  x = jnp.maximum(x, _X_MIN)  # (-inf -> -127 -> 0.0)
  # (The barrier keeps compilers from folding (x + c) - c into x, which XLA's simplifier does.)
  shifted = lax.optimization_barrier(x + _ROUND_BIAS)
  whole = shifted - _ROUND_BIAS  # round(x), exactly
  frac = x - whole  # in [-0.5, 0.5], exactly
  poly = _POLY[3]
  for c in _POLY[2::-1]:
    poly = poly * frac + c
  exponent = lax.shift_left(lax.bitcast_convert_type(shifted, jnp.int32), 23)
  return poly * lax.bitcast_convert_type(exponent, jnp.float32)  # poly * 2^round(x)


def exp2_tile(x: jax.Array, fma_cols: int) -> jax.Array:
  """2^x of a [rows, cols] float32 tile: the first cols - fma_cols columns on the SFU
  (jnp.exp2), the last `fma_cols` by `exp2_fma`. Column slices of a WGMMA-layout tile at
  multiples of 8 are whole registers, so the split and the concatenation move no data."""
  if not fma_cols:
    return jnp.exp2(x)
  cols = x.shape[1]
  if fma_cols == cols:
    return exp2_fma(x)
  return jnp.concatenate([jnp.exp2(x[:, :cols - fma_cols]), exp2_fma(x[:, cols - fma_cols:])],
                         axis=1)
