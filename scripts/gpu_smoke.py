"""Compile and check the Mosaic GPU kernels on a Hopper GPU, then time them next to cuDNN.

Usage (on the H200): PYTHONPATH=. python scripts/gpu_smoke.py
Prints one line per case (relative L2 errors of out, lse, dq, dk, dv against the float32 reference)
and a few forward / forward+backward timings. A quick check between full test runs.
"""

import dataclasses
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_attn as pa
from pallas_attn.mosaic_gpu import config
from pallas_attn.mosaic_gpu import ops


def rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  if not np.isfinite(a).all():
    return float("nan")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(batch, t, s, hq, hk, d, causal, window, lens, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(t * 7 + s), 4)
  q = jax.random.normal(ks[0], (batch, t, hq, d), dtype)
  k = jax.random.normal(ks[1], (batch, s, hk, d), dtype)
  v = jax.random.normal(ks[2], (batch, s, hk, d), dtype)
  do = jax.random.normal(ks[3], (batch, t, hq, d), dtype)
  kw = dict(is_causal=causal, local_window_size=window)
  if lens:
    kw.update(query_seq_lengths=jnp.array([t, t // 2][:batch], jnp.int32),
              key_value_seq_lengths=jnp.array([s // 2, 0][:batch], jnp.int32))

  def run(impl, upcast):
    def loss(q, k, v):
      if upcast:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
      o, l = pa.attention(q, k, v, implementation=impl, return_residual=True, **kw)
      return jnp.vdot(o.astype(jnp.float32), do.astype(jnp.float32)), (o, l)
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

  # Poison the allocator: the kernels' output buffers likely reuse this NaN-filled memory, so
  # tiles a kernel fails to write show up as NaN.
  poison = jnp.full((batch * max(t, s) * hq * d * 8,), jnp.nan, jnp.float32)
  poison.block_until_ready()
  del poison
  (_, (o, l)), g = run("mosaic_gpu", False)
  (_, (ro, rl)), rg = run("reference", True)
  fin = np.asarray(rl) > -1e30
  errs = [rel(o, ro), rel(np.where(fin, l, 0), np.where(fin, rl, 0))] + [rel(a, b) for a, b in zip(g, rg)]
  return errs


def bench(fn, *args, iters=20, reps=5):
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return float(np.median(times)) * 1e3


def main():
  print(jax.devices(), jax.__version__, flush=True)
  cases = [] if "--perf-only" in sys.argv else [
      (1, 256, 256, 2, 2, 64, False, None, False),
      (1, 256, 256, 2, 2, 128, True, None, False),
      (1, 113, 203, 4, 2, 128, True, None, False),
      (2, 1000, 1000, 4, 1, 64, False, (100, 20), True),
      (1, 1, 239, 2, 2, 128, False, None, False),
      (2, 1023, 1024, 4, 4, 128, True, None, True),
      (1, 512, 512, 2, 2, 256, True, None, False),
  ]
  bad = 0
  for c in cases:
    try:
      errs = check(*c)
      ok = all(e < 2e-2 for e in errs)
      bad += not ok
      print("OK " if ok else "BAD", c, " ".join(f"{e:.2e}" for e in errs), flush=True)
    except Exception:
      bad += 1
      print("ERR", c, flush=True)
      traceback.print_exc()
  for d, causal in [(128, False), (128, True), (64, False), (256, False)]:
    b, n, h = 4, 4096, 2048 // d
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks)
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1)
    spec = pa.MaskSpec(is_causal=causal)
    base = config.forward_config(d)

    def variant(ping_pong):
      cfg = dataclasses.replace(base, ping_pong=ping_pong)
      return lambda q, k, v: ops.attention(q, k, v, None, None, scale=d ** -0.5, spec=spec,
                                           fwd_cfg=cfg)[0]

    for name, f in [
        ("mosaic ping-pong", variant(True)),
        ("mosaic plain", variant(False)),
        ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")),
    ]:
      try:
        fwd_ms = bench(jax.jit(f), q, k, v)
        g = jax.jit(jax.grad(lambda q, k, v: jnp.vdot(f(q, k, v).astype(jnp.float32), q.astype(jnp.float32)), (0, 1, 2)))
        bwd_ms = bench(g, q, k, v)
        print(f"d={d} causal={causal} {name}: fwd {fwd_ms:.3f} ms {flops / fwd_ms / 1e9:.0f} TF/s; "
              f"fwd+bwd {bwd_ms:.3f} ms {3.5 * flops / bwd_ms / 1e9:.0f} TF/s", flush=True)
      except Exception as e:
        print(f"d={d} causal={causal} {name}: ERR {type(e).__name__}: {str(e)[:300]}", flush=True)
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
