"""Times what surrounds the attention kernels' steps: the delta pass and the last wave's tail.

  python -m benchmarks.overhead_probe --probes delta,waves --out $OUT/overhead.jsonl

- `delta`: rowsum(dO * O) [B, H, T] float32 before the backward kernels, written several ways
  (the einsum `numerics.delta` uses, a multiply-and-sum then a transpose, the sum left in
  [B, T, H]), beside a read of both inputs (the bandwidth floor) on the FlashAttention sweep's
  d128 arrays (16384 tokens x 16 heads x 128: 64 MiB each in bf16).
- `waves`: forward and forward+backward (ours and cuDNN's) at head_dim 128 shapes whose CTA
  count (128 query rows a CTA, the table's layout) fills the 132 SMs' last wave to different
  depths: b1 s16384 h16 (2048 CTAs, 15.52 waves), h33 (4224, 32.0), h15 (1920, 14.55) and
  s16896 h15 (1980, 15.0). If a partial last wave costs a whole one, TFLOP/s follows the wave
  efficiency ctas / (132 * ceil(ctas / 132)).
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from benchmarks import impls
from benchmarks import report
from benchmarks import shapes
from benchmarks import timing
from pallas_attn import numerics
from pallas_attn.mosaic_gpu import config as config_lib

NUM_SMS = config_lib.NUM_SMS  # an H100 / H200 SXM
ROWS_PER_CTA = 128


def _delta_variants() -> dict:
  f32 = jnp.float32

  def einsum(d_out, out):
    return numerics.delta(d_out, out)

  def sum_then_transpose(d_out, out):
    return jnp.swapaxes(jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1), 1, 2)

  def sum_no_transpose(d_out, out):
    return jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)

  def bf16_dot(d_out, out):
    return jnp.einsum("bthd,bthd->bht", d_out, out, preferred_element_type=f32)

  def read_both(d_out, out):  # the floor: every byte of both read once, a scalar written
    return jnp.sum(d_out.astype(f32)) + jnp.sum(out.astype(f32))

  fns = dict(einsum=einsum, sum_then_transpose=sum_then_transpose,
             sum_no_transpose=sum_no_transpose, bf16_dot=bf16_dot, read_both=read_both)
  return {name: jax.jit(fn) for name, fn in fns.items()}


def delta_rows(cfg: timing.TimingConfig, batch: int = 4, seq: int = 4096, heads: int = 16,
               head_dim: int = 128) -> list[dict]:
  k1, k2 = jax.random.split(jax.random.key(0))
  d_out = jax.random.normal(k1, (batch, seq, heads, head_dim), jnp.bfloat16)
  out = jax.random.normal(k2, (batch, seq, heads, head_dim), jnp.bfloat16)
  fns = _delta_variants()
  want = fns["einsum"](d_out, out)
  rows = []
  timings = timing.time_interleaved([(fn, (d_out, out)) for fn in fns.values()], cfg)
  bytes_read = 2 * d_out.size * d_out.dtype.itemsize
  for (name, fn), t in zip(fns.items(), timings):
    got = fn(d_out, out)
    err = None
    if name != "read_both":
      got = got if got.shape == want.shape else jnp.swapaxes(got, 1, 2)
      err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    rows.append(dict(probe="delta", variant=name, ms=t.ms, repeat_ms=t.repeat_ms,
                     tb_per_s=bytes_read / (t.ms * 1e-3) / 1e12, max_rel_err=err))
  return rows


WAVE_SHAPES = ((1, 16384, 16), (1, 16384, 33), (1, 16384, 15), (1, 16896, 15))  # batch, seq, heads
WAVE_IMPLS = ("pallas_attn:mosaic_gpu", "jax_cudnn")


def wave_ctas(batch: int, seq: int, heads: int) -> int:
  """CTAs of a forward / backward kernel launch of 128-row tiles at this shape."""
  return batch * heads * math.ceil(seq / ROWS_PER_CTA)


def wave_rows(cfg: timing.TimingConfig, head_dim: int = 128) -> list[dict]:
  rows = []
  for batch, seq, heads in WAVE_SHAPES:
    shape = shapes.Shape(batch, seq, seq, heads, heads, head_dim, causal=False, family="waves")
    args = impls.random_inputs(shape, jnp.bfloat16, seed=1)
    ctas = wave_ctas(batch, seq, heads)
    calls = {}
    for name in WAVE_IMPLS:
      attend = impls.get(name, "gpu").attend
      for pass_ in ("fwd", "fwd_bwd"):
        calls[(name, pass_)] = (jax.jit(impls.timed_fn(attend, shape, pass_)),
                                args[:3] if pass_ == "fwd" else args)
    timings = timing.time_interleaved(list(calls.values()), cfg)
    for (name, pass_), t in zip(calls, timings):
      rows.append(dict(probe="waves", impl=name, pass_=pass_, batch=batch, seq=seq, heads=heads,
                       ctas=ctas, wave_efficiency=ctas / (NUM_SMS * math.ceil(ctas / NUM_SMS)),
                       ms=t.ms, repeat_ms=t.repeat_ms,
                       tflops=timing.attention_flops(shape, pass_) / (t.ms * 1e-3) / 1e12))
    del args
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--probes", default="delta,waves")
  p.add_argument("--out", default=None)
  p.add_argument("--repeats", type=int, default=9)
  args = p.parse_args(argv)
  cfg = timing.TimingConfig(repeats=args.repeats)
  rows = []
  for probe in args.probes.split(","):
    rows += {"delta": delta_rows, "waves": wave_rows}[probe](cfg)
  for row in rows:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
           if k != "repeat_ms"}, flush=True)
  if args.out:
    report.append_rows(args.out, rows)


if __name__ == "__main__":
  main()
