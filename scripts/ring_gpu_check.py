"""Ring attention on the visible GPUs against `attention` on one GPU: outputs and gradients.

  PYTHONPATH=. python3 scripts/ring_gpu_check.py [seq]   (default 16384; bf16, causal and not)
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_attn


def rel_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(seq: int):
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("seq",))
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, seq, 16, 128), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, seq, 8, 128), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, seq, 8, 128), jnp.bfloat16)
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  # The inputs as a context-parallel model holds them: split over the sequence.
  by_seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
  q, k, v, do = (jax.device_put(x, by_seq) for x in (q, k, v, do))
  for causal in (True, False):
    def ring(q, k, v):
      return pallas_attn.ring_attention(q, k, v, mesh=mesh, seq_axis="seq", is_causal=causal)

    def single(q, k, v):
      return pallas_attn.attention(q, k, v, is_causal=causal)

    def with_grads(fn):
      def run(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do))
      return jax.jit(run)  # under jit, as models call it (the ring needs a concrete mesh)

    results = [jax.device_get(with_grads(fn)(q, k, v, do)) for fn in (ring, single)]
    errs = [rel_err(a, b) for a, b in zip(*results)]
    finite = all(np.isfinite(np.asarray(x, np.float32)).all() for x in results[0])
    print(f"{len(devices)} GPUs, seq {seq}, causal={causal}: rel L2 err (out, dq, dk, dv) vs one "
          f"GPU = {', '.join(f'{e:.2e}' for e in errs)}; finite={finite}", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 16384)
