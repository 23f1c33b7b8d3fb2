"""The kernels of one attention shape, run once each for Nsight Compute to profile.

  ncu --clock-control none -k regex:'mosaic_gpu|sdpa|fmha|flash|prop' --set full -c 12 \\
      -o $OUT/prof python3 -m benchmarks.stall_profile --head-dim 128 --seq 4096

Runs forward + backward of ours (the table's kernels) and of cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`), and our dK/dV kernel that also makes
dQ (the table's fused layout forced on), on one FlashAttention-sweep shape (batch * seq = 16384
tokens, heads * head_dim = 2048, bf16, random normal inputs). Each call blocks before the next,
so the profiler sees each implementation's kernels in order. Timing belongs to the benchmark and
the tuner; this only gives the profiler something to read (stall reasons, pipe use, spills).
`--fwd-variants a,b`: instead, the forward kernel alone of each of those `benchmarks.tune`
variants, in that order, at each length of `--seq` (which then may list several: 16384,4096),
to set the forwards' counters side by side. `--heads 32/8`: instead, forward + backward of ours
and of cuDNN alone at that many query / kv heads (batch * seq = 16384 tokens still), to set a
GQA backward beside the MHA one (`--heads 16/16`) kernel by kernel.
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import bwd_parts
from benchmarks import impls


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--seq", default="4096", help="the sequence length (with --fwd-variants: lengths)")
  p.add_argument("--causal", action="store_true")
  p.add_argument("--fwd-variants", default=None,
                 help="comma-separated benchmarks.tune variants: run only their forwards")
  p.add_argument("--heads", default=None,
                 help="Q/KV: run only ours and cuDNN's fwd+bwd at that many query / kv heads")
  args = p.parse_args(argv)
  if args.heads:
    heads_q, heads_kv = map(int, args.heads.split("/"))
    run_heads(heads_q, heads_kv, args.head_dim, int(args.seq), args.causal)
    return
  if args.fwd_variants:
    for seq in map(int, args.seq.split(",")):
      for name in args.fwd_variants.split(","):
        run_forward(name, args.head_dim, seq, args.causal)
    return
  args.seq = int(args.seq)
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


def run_heads(heads_q: int, heads_kv: int, head_dim: int, seq: int, causal: bool):
  """Forward + backward of ours, then of cuDNN, at `heads_q` query heads over `heads_kv` kv
  heads (batch * seq = `bwd_parts.TOKENS`), each blocked on: no other launch before them, so
  our backward is the profiler's second Mosaic GPU launch."""
  batch = max(1, bwd_parts.TOKENS // seq)
  q, _, _, d_out = bwd_parts.inputs(batch, seq, heads_q, head_dim, jax.numpy.bfloat16)
  _, k, v, _ = bwd_parts.inputs(batch, seq, heads_kv, head_dim, jax.numpy.bfloat16, seed=1)
  for name in ("pallas_attn:mosaic_gpu", "jax_cudnn"):
    fn = jax.jit(impls.fwd_bwd_fn(impls.get(name, "gpu").attend, causal))
    jax.block_until_ready(fn(q, k, v, d_out))
    print(f"ran {name} fwd+bwd at {heads_q}/{heads_kv} heads", flush=True)


def run_forward(variant: str, head_dim: int, seq: int, causal: bool):
  """One forward of tuner variant `variant` at a sweep shape, blocked on (no gradient is taken,
  so only the forward kernel runs)."""
  from benchmarks import tune  # (the tuner's variant table)
  q, k, v, _ = bwd_parts.sweep_inputs(head_dim, seq)
  attend = tune.attend_fn(variant, head_dim, interpret=False)
  jax.block_until_ready(jax.jit(lambda q, k, v: attend(q, k, v, is_causal=causal))(q, k, v))
  print(f"ran the forward of {variant} at N {seq}", flush=True)


if __name__ == "__main__":
  main()
