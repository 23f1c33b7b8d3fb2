"""Whether the gradients repeat to the bit: the same fwd+bwd run again and again, by default and
with `deterministic_backward=True`.

  python -m benchmarks.determinism_probe --head-dims 64,128,256 --seqs 4096 --runs 5 \
      --out $OUT/determinism.jsonl

For each FlashAttention-sweep shape (batch * seq = 16384 tokens, heads * head_dim = 2048), causal
and not, the jitted gradient of <attention(q, k, v), d_out> runs `runs` times on the same inputs;
each gradient (dq, dk, dv) is compared with the first run's to the bit. A row says how many runs
differed, the largest fraction of elements that did, and the largest difference relative to the
gradient's RMS. What it costs in time is the benchmark's business (`benchmarks.run --impls
mosaic_gpu,mosaic_gpu_deterministic --passes fwd_bwd`), not this probe's.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_attn
from benchmarks import bwd_parts
from benchmarks import report

GRADS = ("dq", "dk", "dv")


@functools.partial(jax.jit, static_argnames=("is_causal", "deterministic", "interpret"))
def _grads(q, k, v, d_out, *, is_causal: bool, deterministic: bool, interpret: bool):
  def f(q, k, v):
    return pallas_attn.attention(q, k, v, is_causal=is_causal, implementation="mosaic_gpu",
                                 interpret=interpret, deterministic_backward=deterministic)

  return jax.vjp(f, q, k, v)[1](d_out)


def compare_runs(runs: list[tuple[np.ndarray, ...]]) -> dict:
  """{grad: {differing_runs, max_fraction, max_rel_diff}} of runs 2.. against run 1."""
  stats = {}
  for i, name in enumerate(GRADS):
    first = runs[0][i].astype(np.float32)
    rms = float(np.sqrt(np.mean(np.square(first.astype(np.float64))))) or 1.0
    differing, fraction, rel = 0, 0.0, 0.0
    for other in runs[1:]:
      other = other[i].astype(np.float32)
      unequal = first.view(np.uint32) != other.view(np.uint32)
      if unequal.any():
        differing += 1
        fraction = max(fraction, float(unequal.mean()))
        rel = max(rel, float(np.max(np.abs(first - other))) / rms)
    stats[name] = dict(differing_runs=differing, max_fraction=fraction, max_rel_diff=rel)
  return stats


def probe_shape(head_dim: int, seq: int, is_causal: bool, deterministic: bool, runs: int,
                interpret: bool = False, tokens: int = bwd_parts.TOKENS,
                hidden: int = bwd_parts.HIDDEN) -> dict:
  """One row: the shape, the flag and `compare_runs` of `runs` gradients."""
  q, k, v, d_out = bwd_parts.sweep_inputs(head_dim, seq, tokens, hidden)
  results = []
  for _ in range(runs):
    grads = _grads(q, k, v, d_out, is_causal=is_causal, deterministic=deterministic,
                   interpret=interpret)
    results.append(tuple(np.asarray(g) for g in grads))
  return dict(head_dim=head_dim, seq=seq, batch=q.shape[0], heads=q.shape[2],
              causal=is_causal, deterministic_backward=deterministic, runs=runs,
              device=jax.devices()[0].device_kind, **compare_runs(results))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--head-dims", default="64,128,256")
  p.add_argument("--seqs", default="4096")
  p.add_argument("--causal", default="false,true")
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--out", default=None, help="jsonl rows (default: print only)")
  args = p.parse_args(argv)
  interpret = jax.default_backend() == "cpu"
  rows = []
  for head_dim in map(int, args.head_dims.split(",")):
    for seq in map(int, args.seqs.split(",")):
      for is_causal in (c.strip() == "true" for c in args.causal.split(",")):
        for deterministic in (False, True):
          row = probe_shape(head_dim, seq, is_causal, deterministic, args.runs, interpret)
          rows.append(row)
          cells = "  ".join(f"{g} {row[g]['differing_runs']}/{args.runs - 1} runs differ "
                            f"({row[g]['max_fraction']:.1e} of elements, "
                            f"{row[g]['max_rel_diff']:.1e} x RMS)" for g in GRADS)
          print(f"d{head_dim} N{seq} {'causal' if is_causal else 'full  '} "
                f"{'deterministic' if deterministic else 'default      '}  {cells}", flush=True)
  if args.out:
    report.append_rows(args.out, rows)


if __name__ == "__main__":
  main()
