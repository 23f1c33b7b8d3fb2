"""The kernels of one attention shape, run once each for Nsight Compute to profile.

  ncu --clock-control none -k regex:'mosaic_gpu|sdpa|fmha|flash|prop' --set full -c 12 \\
      -o $OUT/prof python3 -m benchmarks.stall_profile --head-dim 128 --seq 4096

Runs forward + backward of ours (the table's kernels) and of cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`), and our dK/dV kernel that also makes
dQ (the table's fused layout forced on), on one FlashAttention-sweep shape (batch * seq = 16384
tokens, heads * head_dim = 2048, bf16, random normal inputs). Each call blocks before the next,
so the profiler sees each implementation's kernels in order. Timing belongs to the benchmark and
the tuner; this only gives the profiler something to read (stall reasons, pipe use, spills).
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import bwd_parts
from benchmarks import impls


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--causal", action="store_true")
  args = p.parse_args(argv)
  q, k, v, d_out, out, lse, lengths = bwd_parts.shape_arrays(args.head_dim, args.seq,
                                                              args.causal, interpret=False)
  calls = {name: jax.jit(impls.fwd_bwd_fn(impls.get(name, "gpu").attend, args.causal))
           for name in ("pallas_attn:mosaic_gpu", "jax_cudnn")}
  fused = bwd_parts.parts(args.head_dim, args.causal, interpret=False)["dqkv"]
  for name, fn in calls.items():
    jax.block_until_ready(fn(q, k, v, d_out))
    print(f"ran {name} fwd+bwd", flush=True)
  jax.block_until_ready(fused(q, k, v, d_out, out, lse, lengths))
  print("ran the fused dK/dV/dQ kernel", flush=True)


if __name__ == "__main__":
  main()
