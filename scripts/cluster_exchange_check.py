"""Does a float32 [64, 64] WGMMA-layout tile go from registers into the peer CTA's shared memory
(`plgpu.async_store_smem`, completing on the peer's barrier), as a two-CTA cluster dQ pre-sum
would need? GPU only (the interpreter has no cluster stores). Prints OK or the mismatch.

  python scripts/cluster_exchange_check.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.mosaic_gpu import common

STEPS, ROWS, COLS = 6, 64, 64


def kernel(out_ref, tile, recv_full, tile_free, *, arrivals):
  rank = lax.axis_index("pair")
  wg = lax.axis_index("wg")

  def part(step, who):
    rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, COLS), 0, layout=common.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, COLS), 1, layout=common.WGMMA)
    return (rows * COLS + cols + 10000 * who + 100000 * step + 1000000 * wg).astype(jnp.float32)

  def body(step, carry):
    @pl.when(step > 0)
    def _():
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(tile_free.at[wg])  # my tile is free (both CTAs see it)
      plgpu.barrier_wait(tile_free.at[wg])  # and the peer's
    plgpu.async_store_smem(part(step, rank), tile.at[wg], recv_full.at[wg],
                           cluster_idx=1 - rank, cluster_dim="pair")
    plgpu.barrier_wait(recv_full.at[wg])
    summed = plgpu.load(tile.at[wg], (), layout=common.WGMMA) + part(step, 1 - rank) * 0.5
    tile.at[wg][...] = summed
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile.at[wg], out_ref.at[step, rank, wg])
    return carry

  lax.fori_loop(0, STEPS, body, 0)
  plgpu.wait_smem_to_gmem(0)


def run(arrivals: int):
  fn = plgpu.kernel(
      functools.partial(kernel, arrivals=arrivals),
      out_type=jax.ShapeDtypeStruct((STEPS, 2, 2, ROWS, COLS), jnp.float32),
      scratch_types=[
          common.f32_tile((2, ROWS, COLS), True),
          plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
          plgpu.ClusterBarrier(collective_axes=("pair",), num_barriers=2),
      ],
      grid=(1,), grid_names=("g",), cluster=(2,), cluster_names=("pair",),
      num_threads=2, thread_name="wg")
  got = np.asarray(jax.jit(fn)())
  base = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS)
  want = np.zeros_like(got, dtype=np.float64)
  for step in range(STEPS):
    for rank in range(2):
      for wg in range(2):
        # the peer's part (its rank's mark) plus half of the same values made here
        sent = base + 10000 * (1 - rank) + 100000 * step + 1000000 * wg
        want[step, rank, wg] = 1.5 * sent
  err = np.abs(got - want).max()
  return err


if __name__ == "__main__":
  # Pallas counts a plain barrier's arrivals per warpgroup (x128 threads in the lane lowering),
  # and each of the sending warpgroup's threads arrives (expecting its bytes): 1.
  for arrivals in (1,):
    try:
      err = run(arrivals)
      print(f"arrivals={arrivals}: max abs err {err}", "OK" if err == 0 else "MISMATCH",
            flush=True)
    except Exception as e:  # noqa: BLE001 (a feasibility check: report and go on)
      print(f"arrivals={arrivals}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
