"""`pallas_attn.attention` on inputs sharded over batch and heads, under `jit`, on 2, 4 and 8
simulated CPU devices: results keep the inputs' sharding, match the single-device reference
(output and gradients, random cotangent), and the compiled program gathers nothing.

The portable path is plain JAX that XLA partitions itself. The Mosaic GPU kernels are opaque to
XLA, so `sharding.batch_head_parallel` runs them shard by shard; its two mechanisms (shard_map
for Explicit mesh axes, custom_partitioning for Auto ones) are checked here on the portable
passes, which stand in for the kernels (the Mosaic GPU interpreter cannot run on several
devices at once in jax 0.11.2), and the kernels' sharded program is compiled and inspected.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import cases
import multidevice
import pallas_attn
from pallas_attn import blocked_jax
from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn import sharding

GATHERS = {"all-gather", "all-to-all", "reduce-scatter", "collective-permute"}


@dataclasses.dataclass(frozen=True)
class ShardedCase:
  case: cases.Case
  mesh_shape: tuple[int, ...]
  spec: P  # of q (and of k, v, but for a single kv head: MQA)
  axis_type: AxisType = AxisType.Explicit

  @property
  def id(self):
    return f"{self.case.id}-{'x'.join(map(str, self.mesh_shape))}-{self.axis_type.name.lower()}"


def _c(name, batch, heads_q, heads_kv, mesh_shape, spec, axis_type=AxisType.Explicit, **kw):
  case = cases.Case(batch=batch, q_len=40, kv_len=56, heads_q=heads_q, heads_kv=heads_kv,
                    head_dim=16, name=name, **kw)
  return ShardedCase(case, mesh_shape, spec, axis_type)


SHARDED_CASES = [
    _c("causal_gqa", 4, 8, 4, (2, 4), P("data", None, "model"), is_causal=True),
    _c("causal_gqa", 4, 8, 4, (2, 4), P("data", None, "model"), AxisType.Auto, is_causal=True),
    _c("mqa_lengths", 2, 4, 1, (2, 2), P("data", None, "model"), AxisType.Auto,
       kv_lengths=[50, 3]),
    _c("window", 2, 2, 2, (2, 1), P("data"), local_window=(8, 2),
       dtype=cases.BF16),
]


@functools.cache
def _attention_vjp(sc: ShardedCase):
  def run(q, k, v, do, q_lengths, kv_lengths):
    def f(q, k, v):
      return pallas_attn.attention(q, k, v, query_seq_lengths=q_lengths,
                                   key_value_seq_lengths=kv_lengths, **sc.case.static_kwargs())

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)

  return jax.jit(run)


def _put(mesh, spec, arrays):
  return [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]


@pytest.mark.parametrize("sc", SHARDED_CASES, ids=lambda sc: sc.id)
def test_attention_keeps_batch_and_head_sharding(sc: ShardedCase, seed):
  mesh = multidevice.cpu_mesh(sc.mesh_shape, ("data", "model"), sc.axis_type)
  inputs = cases.make_inputs(sc.case, seed)
  kv_spec = sc.spec if sc.case.heads_kv > 1 else P("data")
  q, k, v, do = inputs
  args = _put(mesh, sc.spec, (q,)) + _put(mesh, kv_spec, (k, v)) + _put(mesh, sc.spec, (do,)) + [
      None if x is None else jax.device_put(x, NamedSharding(mesh, P("data")))
      for x in sc.case.lengths()]
  compiled = _attention_vjp(sc).lower(*args).compile()
  out, grads = compiled(*args)
  assert not GATHERS & set(multidevice.collectives(compiled))
  for x, spec in zip((out, *grads), (sc.spec, sc.spec, kv_spec, kv_spec)):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), x.sharding
  oracle = cases.run_oracle(sc.case, inputs)
  tol = cases.TOLERANCES[sc.case.dtype]
  for name, got in zip(cases.QUANTITIES, (out, *grads)):
    err = cases.rel_err(np.asarray(got, np.float64), oracle[name])
    assert err <= tol[name], f"{name}: rel err {err:.2e}"


# ---------------------------------------------------------------------------------------------
# batch_head_parallel, with the portable passes standing in for the kernels.

_SPEC = mask_lib.MaskSpec(is_causal=True)


def _forward(q, k, v, q_lengths, kv_lengths):
  return blocked_jax.forward(q, k, v, q_lengths, kv_lengths, scale=0.25, spec=_SPEC)


def _backward(q, k, v, d_out, lse, delta, q_lengths, kv_lengths):
  return blocked_jax.backward(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, scale=0.25,
                              spec=_SPEC)


def _passes(q, k, v, do, kv_lengths, parallel=True):
  call = sharding.batch_head_parallel if parallel else lambda fn, layout, *args: fn(*args)
  out, lse = call(_forward, sharding.FORWARD, q, k, v, None, kv_lengths)
  delta = numerics.delta(do, out)
  return (out, lse), call(_backward, sharding.BACKWARD, q, k, v, do, lse, delta, None,
                          kv_lengths)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=lambda t: t.name)
@pytest.mark.parametrize("heads_q,heads_kv,split_heads", [(8, 4, True), (8, 1, True),
                                                          (4, 2, False)],
                         ids=["gqa", "mqa", "heads_2_of_4"])
def test_batch_head_parallel_runs_each_shard(axis_type, heads_q, heads_kv, split_heads, seed):
  """The shards stay where they are (GQA: kv heads split like their query heads; MQA: query
  heads split, the kv head on every device); 2 kv heads over 4 devices cannot be split, and are
  gathered instead (the fallback, still correct)."""
  mesh = multidevice.cpu_mesh((2, 4), ("data", "model"), axis_type)
  keys = jax.random.split(jax.random.key(seed), 4)
  q, do = (jax.random.normal(kk, (2, 24, heads_q, 16)) for kk in keys[:2])
  k, v = (jax.random.normal(kk, (2, 40, heads_kv, 16)) for kk in keys[2:])
  kv_lengths = jnp.asarray([40, 17], jnp.int32)
  spec = P("data", None, "model")
  kv_spec = spec if split_heads and heads_kv > 1 else P("data")
  args = _put(mesh, spec, (q,)) + _put(mesh, kv_spec, (k, v)) + _put(mesh, spec, (do,)) + [
      jax.device_put(kv_lengths, NamedSharding(mesh, P("data")))]
  compiled = jax.jit(_passes).lower(*args).compile()
  (out, lse), grads = compiled(*args)
  (want_out, want_lse), want_grads = jax.jit(functools.partial(_passes, parallel=False))(
      q, k, v, do, kv_lengths)
  for got, want in zip((out, lse, *grads), (want_out, want_lse, *want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  ops = set(multidevice.collectives(compiled))
  if split_heads:
    assert not GATHERS & ops, ops
    assert multidevice.local_shapes(compiled)[0] == f"f32[1,24,{heads_q // 4},16]"
  checked = ((out, spec), (grads[0], spec)) + (((lse, P("data", "model")),) if split_heads else ())
  for x, x_spec in checked:
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, x_spec), x.ndim), x.sharding


def test_batch_head_parallel_under_vmap(seed):
  """custom_partitioning has no batching rule: a vmapped axis is folded into the batch."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q, do = (jax.random.normal(kk, (3, 2, 24, 4, 16)) for kk in keys[:2])
  k, v = (jax.random.normal(kk, (3, 2, 40, 2, 16)) for kk in keys[2:])
  kv_lengths = jnp.asarray([[40, 5], [1, 40], [0, 12]], jnp.int32)
  got = jax.jit(jax.vmap(_passes))(q, k, v, do, kv_lengths)
  for i in range(3):
    want = _passes(q[i], k[i], v[i], do[i], kv_lengths[i], parallel=False)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-5)


def test_mosaic_gpu_sharded_program_runs_per_shard():
  """The kernels under jit with batch/head-sharded inputs (Explicit axes: shard_map): every
  device's program takes its own [1, T, 2, D] shard, and nothing is gathered. Compiled only: the
  interpreter cannot run on several devices at once (see the module docstring)."""
  mesh = multidevice.cpu_mesh((2, 2), ("data", "model"))
  q = jax.ShapeDtypeStruct((2, 40, 4, 64), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("data", None, "model")))
  kv = jax.ShapeDtypeStruct((2, 40, 2, 64), jnp.bfloat16, sharding=q.sharding)

  def loss(q, k, v, do):
    out = pallas_attn.attention(q, k, v, is_causal=True, implementation="mosaic_gpu",
                                interpret=True)
    return (out.astype(jnp.float32) * do).sum()

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, q).compile()
  assert not GATHERS & set(multidevice.collectives(compiled))
  assert multidevice.local_shapes(compiled)[:3] == ["bf16[1,40,2,64]", "bf16[1,40,1,64]",
                                                    "bf16[1,40,1,64]"]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=lambda t: t.name)
@pytest.mark.parametrize("bias_shape", [(1, 8, 24, 40), (1, 1, 24, 1)], ids=["1HTS", "11T1"])
def test_batch_head_parallel_sums_a_broadcast_bias_gradient(axis_type, bias_shape, seed):
  """The gradient of a bias broadcast over batch (and heads) is, on each device, its shard's
  part of a sum: the parts are added (`sharding.with_pairs`, `_summed_axes`). A stand-in pass
  whose "dS" is q summed over head_dim, reduced over the bias's broadcast axes as the dbias
  kernel reduces."""
  mesh = multidevice.cpu_mesh((2, 4), ("data", "model"), axis_type)
  keys = jax.random.split(jax.random.key(seed), 2)
  q = jax.random.normal(keys[0], (2, 24, 8, 16))
  k = jax.random.normal(keys[1], (2, 40, 4, 16))
  bias = jnp.zeros(bias_shape)
  broadcast = tuple(a for a, n in enumerate(bias_shape) if n == 1)

  def stand_in(q, k, q_lengths, kv_lengths, *mod_arrays):
    d_s = jnp.einsum("bthd->bht", q)[..., None] * jnp.ones(k.shape[1])  # [B, H, T, S]
    return q * 2.0, d_s.sum(axis=broadcast, keepdims=True)

  # The stand-in's operands: q, k, the lengths, four other mod arrays, then bias and mask.
  layout = sharding.with_pairs(sharding.Layout(operands=("bthd", "bskd", "b", "b", "bt", "bs",
                                                         "h", "bh"), results=("bthd",)),
                               bias_shape, None, dbias=True)
  run = lambda q, k, bias: sharding.batch_head_parallel(stand_in, layout, q, k, None, None, None,
                                                        None, None, None, bias, None)
  args = _put(mesh, P("data", None, "model"), (q, k)) + [bias]
  got = jax.jit(run)(*args)
  want = stand_in(q, k, None, None)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


def test_mosaic_gpu_sharded_program_with_bias_and_mask():
  """As above, with a bias shared by the batch ([1, H, T, S], split over heads like q) and a key
  mask ([B, 1, 1, S]): nothing is gathered; the bias gradient's batch parts are summed (an
  all-reduce, not a gather). Compiled only."""
  mesh = multidevice.cpu_mesh((2, 2), ("data", "model"))
  q = jax.ShapeDtypeStruct((2, 40, 4, 64), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("data", None, "model")))
  kv = jax.ShapeDtypeStruct((2, 40, 2, 64), jnp.bfloat16, sharding=q.sharding)
  bias = jax.ShapeDtypeStruct((1, 4, 40, 40), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "model")))
  mask = jax.ShapeDtypeStruct((2, 1, 1, 40), jnp.bool_, sharding=NamedSharding(mesh, P("data")))

  def loss(q, k, v, bias, mask, do):
    out = pallas_attn.attention(q, k, v, bias, mask, is_causal=True,
                                implementation="mosaic_gpu", interpret=True)
    return (out.astype(jnp.float32) * do).sum()

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, kv, kv, bias, mask,
                                                                 q).compile()
  collectives = set(multidevice.collectives(compiled))
  assert not GATHERS & collectives, collectives
  assert "all-reduce" in collectives
