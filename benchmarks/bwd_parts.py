"""Times the backward's parts one by one: where a Mosaic GPU backward's time goes.

  python -m benchmarks.bwd_parts --head-dim 128 --seqs 2048,4096,8192,16384 --out $OUT/parts.jsonl

For each FlashAttention-sweep shape (batch * seq = 16384 tokens, heads * head_dim = 2048) the
parts run on the same inputs and are timed together, their repeats interleaved
(`timing.time_interleaved`):
- `delta`: rowsum(dO * O), the XLA fusion before the kernels;
- `dq`: the separate dQ kernel (the table's dQ config); this and the next two include delta,
  as the backward does;
- `dkv`: the dK/dV kernel unfused (what the backward runs beside `dq`);
- `dqkv`: the dK/dV kernel that also makes dQ (the table's fused layout, forced on at every
  length), with its float32 dQ passes;
- `dq_passes`: those passes alone, on arrays of dQ's size: a float32 zero, then scale and cast;
- `backward`: `ops.backward` as the table chooses (what fwd+bwd runs after the forward).
With every shape launching as many CTAs (2048 at head_dim 128) and each CTA's walk growing with
seq, the rows give each kernel's cost per CTA as fixed + per step: the end of the output is the
least-squares line of each part's time against seq, over the non-causal rows (`fit`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks import timing
import pallas_attn
from pallas_attn import numerics
from pallas_attn.mosaic_gpu import bwd
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import ops

TOKENS = 16384
HIDDEN = 2048


def inputs(batch: int, seq: int, heads: int, head_dim: int, dtype, seed: int = 0):
  """Fresh standard-normal q, k, v and d_out [batch, seq, heads, head_dim]."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, d_out = (jax.random.normal(key, (batch, seq, heads, head_dim), dtype)
                    for key in keys)
  return q, k, v, d_out


def sweep_inputs(head_dim: int, seq: int, tokens: int = TOKENS, hidden: int = HIDDEN,
                 dtype=jnp.bfloat16) -> tuple:
  """`inputs` of one sweep shape: batch * seq = `tokens`, heads * head_dim = `hidden`."""
  heads, batch = max(1, hidden // head_dim), max(1, tokens // seq)
  return inputs(batch, seq, heads, head_dim, dtype)


def shape_arrays(head_dim: int, seq: int, is_causal: bool, interpret: bool,
                 tokens: int = TOKENS, hidden: int = HIDDEN, dtype=jnp.bfloat16) -> tuple:
  """(q, k, v, d_out, out, lse, lengths) of one sweep shape (`sweep_inputs`), out and lse from
  the table's forward."""
  q, k, v, d_out = sweep_inputs(head_dim, seq, tokens, hidden, dtype)
  lengths = jnp.full((q.shape[0],), seq, jnp.int32)
  out, lse = jax.jit(lambda q, k, v: ops.forward(
      q, k, v, lengths, lengths, scale=1.0 / math.sqrt(head_dim),
      spec=pallas_attn.MaskSpec(is_causal=is_causal), interpret=interpret))(q, k, v)
  return q, k, v, d_out, out, lse, lengths


def layouts(head_dim: int) -> tuple:
  """(dQ config, fused dK/dV config, unfused dK/dV config) at `head_dim`: the table's dQ; its
  dK/dV layout that makes dQ, forced on at every length; and the dK/dV kernel the backward
  runs beside the dQ kernel (the table's separate kernels)."""
  dq_cfg = config_lib.dq_config(head_dim)
  table_dkv = config_lib.dkv_config(head_dim)
  fused = dataclasses.replace(table_dkv, separate_dq_max_blocks=0,
                              separate_dq_max_blocks_skewed=0)
  never = dataclasses.replace(table_dkv, separate_dq_max_blocks=1 << 30,
                              separate_dq_max_blocks_skewed=1 << 30)
  return dq_cfg, fused, config_lib.backward_configs(dq_cfg, never, [1])[1]


def parts(head_dim: int, is_causal: bool, interpret: bool) -> dict:
  """{part name: fn(q, k, v, d_out, out, lse, lengths) -> arrays}, jitted."""
  scale = 1.0 / math.sqrt(head_dim)
  spec = pallas_attn.MaskSpec(is_causal=is_causal)
  dq_cfg, fused, unfused = layouts(head_dim)
  common = dict(scale=scale, spec=spec, interpret=interpret)

  def delta(q, k, v, d_out, out, lse, lengths):
    return numerics.delta(d_out, out)

  def dq(q, k, v, d_out, out, lse, lengths):
    return bwd.dq(q, k, v, d_out, lse, numerics.delta(d_out, out), lengths, cfg=dq_cfg,
                  **common)

  def dkv(q, k, v, d_out, out, lse, lengths):
    return bwd.dkv(q, k, v, d_out, lse, numerics.delta(d_out, out), lengths, lengths,
                   cfg=unfused, **common)

  def dqkv(q, k, v, d_out, out, lse, lengths):
    return bwd.dqkv(q, k, v, d_out, lse, numerics.delta(d_out, out), lengths, lengths,
                    cfg=fused, **common)

  def dq_passes(q, k, v, d_out, out, lse, lengths):
    # A zeroed float32 dQ, then its scale and cast: two passes, as around the fused kernel
    # (the barrier keeps XLA from fusing them into one bf16 write).
    zero = jax.lax.optimization_barrier(jnp.zeros(q.shape, jnp.float32))
    return (zero * scale).astype(q.dtype)

  def backward(q, k, v, d_out, out, lse, lengths):
    return ops.backward(q, k, v, d_out, lse, numerics.delta(d_out, out), lengths, lengths,
                        **common)

  fns = dict(delta=delta, dq=dq, dkv=dkv, dqkv=dqkv, dq_passes=dq_passes, backward=backward)
  return {name: jax.jit(fn) for name, fn in fns.items()}


def run_shape(head_dim: int, seq: int, is_causal: bool, interpret: bool, cfg: timing.TimingConfig,
              tokens: int = TOKENS, hidden: int = HIDDEN, dtype=jnp.bfloat16) -> list[dict]:
  args = shape_arrays(head_dim, seq, is_causal, interpret, tokens, hidden, dtype)
  batch, _, heads, _ = args[0].shape
  fns = parts(head_dim, is_causal, interpret)
  timings = timing.time_interleaved([(fn, args) for fn in fns.values()], cfg)
  return [dict(head_dim=head_dim, seq=seq, batch=batch, heads=heads, causal=is_causal, part=name,
               ms=t.ms, repeat_ms=t.repeat_ms) for name, t in zip(fns, timings)]


def fit(rows: list[dict]) -> str:
  """Per part, the least-squares line ms = fixed + per_seq * seq over the non-causal rows."""
  lines = ["| part | fixed (ms) | per 1k seq (ms) | share fixed at the shortest |", "|---|---|---|---|"]
  by_part: dict[str, list[tuple[int, float]]] = {}
  for row in rows:
    if not row["causal"]:
      by_part.setdefault(row["part"], []).append((row["seq"], row["ms"]))
  for part, points in by_part.items():
    if len(points) < 2:
      continue
    slope, fixed = np.polyfit(*zip(*points), 1)
    shortest = min(points)
    lines.append(f"| {part} | {fixed:.3f} | {slope * 1e3:.3f} | "
                 f"{fixed / shortest[1]:.1%} (seq {shortest[0]}) |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seqs", default="2048,4096,8192,16384")
  parser.add_argument("--causal", default="false,true", help="comma list of false/true")
  parser.add_argument("--tokens", type=int, default=TOKENS, help="batch * seq")
  parser.add_argument("--hidden", type=int, default=HIDDEN, help="heads * head_dim")
  parser.add_argument("--out", default=None, help="JSON lines file for the rows")
  args = parser.parse_args(argv)
  interpret = jax.default_backend() != "gpu"
  cfg = timing.TimingConfig() if not interpret else timing.TimingConfig(warmup=1, repeats=1,
                                                                          max_calls=1)
  seqs = [int(s) for s in args.seqs.split(",")]
  rows = []
  for is_causal in (c.strip() == "true" for c in args.causal.split(",")):
    for seq in seqs:
      shape_rows = run_shape(args.head_dim, seq, is_causal, interpret, cfg, args.tokens,
                             args.hidden)
      rows += shape_rows
      print(f"d{args.head_dim} seq {seq} causal={is_causal}: " + ", ".join(
          f"{r['part']} {r['ms']:.3f}" for r in shape_rows), flush=True)
      if args.out:
        report.append_rows(args.out, shape_rows)
  print(fit(rows))
  return rows


if __name__ == "__main__":
  main()
