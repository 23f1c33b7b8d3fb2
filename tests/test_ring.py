"""Ring attention (`pallas_attn.ring_attention`) on 2, 4 and 8 simulated CPU devices against the
single-device float32 reference: output and gradients (random cotangent), causal (zigzag) and
not, GQA/MQA, lengths, batch/head mesh axes; the compiled program rotates k/v with
collective-permutes and gathers nothing. Also: the zigzag helpers, the per-chunk passes that the
ring merges (both implementations, the Mosaic GPU kernels in the interpreter), and bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import cases
import multidevice
import pallas_attn
from pallas_attn import chunk_kernels
from pallas_attn import numerics
from pallas_attn import zigzag


@dataclasses.dataclass(frozen=True)
class RingCase:
  """A `cases.Case` plus the mesh it runs on: `mesh_shape` over `axes`, whose "seq" axis splits
  the sequence ("data" the batch, "model" the heads, where present)."""

  case: cases.Case
  mesh_shape: tuple[int, ...]
  axes: tuple[str, ...] = ("seq",)
  axis_type: AxisType = AxisType.Explicit

  @property
  def id(self):
    mesh = "x".join(f"{a}{n}" for a, n in zip(self.axes, self.mesh_shape))
    return f"{self.case.id}-{mesh}-{self.axis_type.name.lower()}"

  def axis(self, name):
    return name if name in self.axes else None


def _c(name, batch, seq, heads_q, heads_kv, mesh_shape, axes=("seq",), dtype=cases.F32,
       axis_type=AxisType.Explicit, **kw):
  case = cases.Case(batch=batch, q_len=seq, kv_len=seq, heads_q=heads_q, heads_kv=heads_kv,
                    head_dim=16, dtype=dtype, name=name, **kw)
  return RingCase(case, mesh_shape, axes, axis_type)


RING_CASES = [
    _c("causal_mha", 1, 16, 2, 2, (2,), is_causal=True),
    _c("causal_gqa", 2, 40, 4, 2, (4,), is_causal=True, axis_type=AxisType.Auto),
    _c("causal_gqa", 1, 48, 4, 2, (8,), dtype=cases.BF16, is_causal=True),
    # 52 rows: shards of 13, no multiple of any block size.
    _c("full_gqa_52", 2, 52, 4, 2, (4,)),
    _c("full_mqa", 1, 64, 4, 1, (8,), dtype=cases.BF16),
    # Rows past the query length, and a batch element whose keys are all padding: every row of it
    # is empty (jax.nn: the mean of all values), so every chunk pair of it is too.
    _c("causal_lengths", 2, 32, 2, 1, (2,), is_causal=True, q_lengths=[29, 32],
       kv_lengths=[21, 0]),
    _c("full_lengths", 2, 24, 2, 2, (4,), q_lengths=[24, 7], kv_lengths=[17, 24]),
    _c("causal_gqa_data", 2, 32, 4, 2, (2, 4), ("data", "seq"), is_causal=True),
    _c("causal_gqa_model", 1, 32, 4, 2, (4, 2), ("seq", "model"), is_causal=True,
       axis_type=AxisType.Auto),
]


def _spec(rc: RingCase):
  return PartitionSpec(rc.axis("data"), "seq", rc.axis("model"), None)


@functools.cache
def _ring_vjp(rc: RingCase, layout: str = "natural", implementation: str = "blocked_jax"):
  """The compiled `(out, (dq, dk, dv))` of ring attention for this case, and its mesh."""
  mesh = multidevice.cpu_mesh(rc.mesh_shape, rc.axes, rc.axis_type)

  def run(q, k, v, do, q_lengths, kv_lengths):
    def f(q, k, v):
      return pallas_attn.ring_attention(
          q, k, v, mesh=mesh, seq_axis="seq", batch_axis=rc.axis("data"),
          head_axis=rc.axis("model"), is_causal=rc.case.is_causal, layout=layout,
          query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
          implementation=implementation)

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)

  return jax.jit(run), mesh


def _run(rc: RingCase, inputs, layout: str = "natural"):
  fn, mesh = _ring_vjp(rc, layout)
  sharding = NamedSharding(mesh, _spec(rc))
  args = [jax.device_put(x, sharding) for x in inputs] + list(rc.case.lengths())
  compiled = fn.lower(*args).compile()
  out, grads = compiled(*args)
  return compiled, out, grads, sharding


def _assert_close(got, want, dtype, what):
  tol = cases.TOLERANCES[np.dtype(dtype)]
  for name, g, w in zip(cases.QUANTITIES, got, want):
    assert g.dtype == dtype, f"{what} {name}: dtype {g.dtype}"
    err = cases.rel_err(np.asarray(g, np.float64), w)
    assert err <= tol[name], f"{what} {name}: rel err {err:.2e} > {tol[name]:.0e}"


@pytest.mark.parametrize("rc", RING_CASES, ids=lambda rc: rc.id)
def test_ring_matches_reference(rc: RingCase, seed):
  inputs = cases.make_inputs(rc.case, seed)
  compiled, out, grads, sharding = _run(rc, inputs)
  oracle = cases.run_oracle(rc.case, inputs)
  _assert_close((out, *grads), [oracle[n] for n in cases.QUANTITIES], rc.case.dtype, rc.id)
  for x in (out, *grads):
    assert x.sharding.is_equivalent_to(sharding, 4), f"result sharded as {x.sharding}"
  # k/v travel by collective-permutes; nothing is gathered. (With lengths, the mean of v that
  # jax.nn gives empty rows is an all-reduce of [batch, heads, head_dim].)
  ops = multidevice.collectives(compiled)
  assert ops.get("collective-permute", 0) > 0, ops
  assert not {"all-gather", "all-to-all", "reduce-scatter"} & set(ops), ops
  if rc.case.q_lengths is None and rc.case.kv_lengths is None:
    assert set(ops) == {"collective-permute"}, ops
  seq_shards = rc.mesh_shape[rc.axes.index("seq")]
  q_shape = rc.case.shapes()[0]
  for shape in multidevice.local_shapes(compiled)[:4]:  # q, k, v, do: one shard per device
    assert f",{q_shape[1] // seq_shards}," in shape, multidevice.local_shapes(compiled)


@pytest.mark.parametrize("name", ["causal_gqa", "full_lengths"])
def test_zigzag_layout_skips_the_permutation(name, seed):
  """layout="zigzag" on zigzag-ordered inputs gives the zigzag-ordered result of the natural
  layout; causal, without moving q, k, v in and out back out (the natural layout's permutes)."""
  rc = next(rc for rc in RING_CASES if rc.case.name == name and rc.mesh_shape == (4,))
  p = rc.mesh_shape[0]
  inputs = cases.make_inputs(rc.case, seed)
  natural, out, grads, _ = _run(rc, inputs)
  zig = [zigzag.to_zigzag(x, p) for x in inputs]
  zigzagged, z_out, z_grads, _ = _run(rc, zig, layout="zigzag")
  for got, want in zip((z_out, *z_grads), (out, *grads)):
    np.testing.assert_allclose(zigzag.from_zigzag(np.asarray(got), p), want, rtol=1e-6,
                               atol=1e-6)
  n, z = (multidevice.collectives(c)["collective-permute"] for c in (natural, zigzagged))
  if rc.case.is_causal:
    assert n - z >= 4 * 2, (n, z)  # each of q, k, v, out moves its two chunks


def test_zigzag_order_and_round_trip():
  np.testing.assert_array_equal(zigzag.chunk_order(4), [0, 7, 1, 6, 2, 5, 3, 4])
  np.testing.assert_array_equal(zigzag.positions(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
  for p in (1, 2, 3, 4, 6):
    np.testing.assert_array_equal(zigzag.from_zigzag(zigzag.to_zigzag(x, p), p), x)
  with pytest.raises(ValueError, match="24.*not a multiple of 10"):
    zigzag.to_zigzag(x, 5)


# ---------------------------------------------------------------------------------------------
# The per-chunk passes the ring is built from.


def _chunk_check(kernels: chunk_kernels.ChunkKernels, case: cases.Case, split: int, seed: int,
                 tol: float):
  """Attention over keys [0, split) and [split, S) separately, merged by lse, equals attention
  over all keys; the backward pass of each chunk from the *global* lse and delta gives dq in two
  summands and dk/dv chunk by chunk. Batch element 1 has no valid key in the second chunk: its
  rows there see nothing, which the merge must ignore."""
  q, k, v, do = cases.make_inputs(case, seed)
  scale = 1.0 / np.sqrt(case.head_dim)
  kv_len = case.kv_len
  valid = jnp.asarray([kv_len, split], jnp.int32)  # element 1: keys past `split` are padding
  chunk_lengths = [jnp.minimum(valid, split), jnp.clip(valid - split, 0, kv_len - split)]
  pieces = [slice(0, split), slice(split, kv_len)]

  @jax.jit
  def run(q, k, v, do):
    parts = [kernels.forward(q, k[:, s], v[:, s], None, n, scale=scale, is_causal=False)
             for s, n in zip(pieces, chunk_lengths)]
    out, lse = numerics.merge_partials(*parts[0], *parts[1])
    delta = numerics.delta(do, out)
    grads = [kernels.backward(q, k[:, s], v[:, s], do, lse, delta, None, n, scale=scale,
                              is_causal=False) for s, n in zip(pieces, chunk_lengths)]
    dq = grads[0][0].astype(jnp.float32) + grads[1][0].astype(jnp.float32)
    dk = jnp.concatenate([g[1] for g in grads], axis=1)
    dv = jnp.concatenate([g[2] for g in grads], axis=1)
    return out, lse, (dq, dk, dv), parts[1][1]

  out, lse, grads, lse_second = run(q, k, v, do)
  assert np.isinf(np.asarray(lse_second)[1]).all(), "element 1 sees nothing in chunk 2"
  ref = cases.run_oracle(case.replace(kv_lengths=(kv_len, split)), (q, k, v, do))
  assert cases.rel_err(np.asarray(jnp.swapaxes(lse, 1, 2), np.float64), ref.lse) <= 1e-5
  for name, got in zip(cases.QUANTITIES, (out, *grads)):
    err = cases.rel_err(np.asarray(got, np.float64), ref[name])
    assert err <= tol, f"{name}: rel err {err:.2e}"


def test_blocked_jax_chunk_passes_merge(seed):
  case = cases.Case(batch=2, q_len=40, kv_len=56, heads_q=4, heads_kv=2, head_dim=16, name="c")
  _chunk_check(chunk_kernels.ChunkKernels("blocked_jax"), case, split=24, seed=seed, tol=2e-5)


def test_mosaic_gpu_chunk_passes_merge_interpreted(seed):
  case = cases.Case(batch=2, q_len=64, kv_len=128, heads_q=2, heads_kv=1, head_dim=64,
                    dtype=cases.BF16, name="c")
  _chunk_check(chunk_kernels.ChunkKernels("mosaic_gpu", interpret=True), case, split=64,
               seed=seed, tol=2e-2)


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("shape_q,shape_kv,kw,match", [
    ((1, 12, 2, 16), (1, 12, 2, 16), dict(is_causal=True), r"12.*not a multiple of 8"),
    ((1, 10, 2, 16), (1, 10, 2, 16), {}, r"q_len \(10\) is not a multiple of mesh axis 'seq'"),
    ((1, 12, 2, 16), (1, 12, 2, 16), dict(layout="zigzag", is_causal=False),
     r"not a multiple of 8"),
    ((1, 16, 2, 16), (1, 24, 2, 16), dict(is_causal=True), r"q_len == kv_len"),
    ((1, 16, 2, 16), (1, 16, 2, 16), dict(seq_axis="sequence"), r"'sequence' is not an axis"),
    ((1, 16, 2, 16), (1, 16, 2, 16), dict(head_axis="seq"), r"must differ"),
    ((1, 16, 3, 16), (1, 16, 3, 16), dict(seq_axis="model", head_axis="seq"),
     r"heads_kv \(3\) is not a multiple of mesh axis 'seq'"),
    ((1, 16, 3, 16), (1, 16, 2, 16), {}, r"multiple of heads_kv"),
    ((1, 16, 2, 16), (1, 16, 2, 16), dict(implementation="reference"), r"'reference'"),
], ids=["causal_not_2P", "not_P", "zigzag_not_2P", "causal_lengths_differ", "unknown_axis",
        "same_axis", "heads_not_split", "gqa_heads", "reference_impl"])
def test_bad_input_raises_value_error(shape_q, shape_kv, kw, match):
  mesh = multidevice.cpu_mesh((4, 2), ("seq", "model"))
  kw = dict(seq_axis="seq") | kw
  q, kv = jnp.ones(shape_q), jnp.ones(shape_kv)
  with pytest.raises(ValueError, match=match):
    pallas_attn.ring_attention(q, kv, kv, mesh=mesh, **kw)


def test_eager_vjp_of_the_ring(seed):
  """Called outside jit (as in a notebook), forward and gradients: the ring runs its own jit
  (shard_map over the mesh inside a custom_vjp cannot be lowered eagerly otherwise)."""
  mesh = jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2])
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, do = (jax.random.normal(key, (1, 32, 2, 16)) for key in keys)
  ring = functools.partial(pallas_attn.ring_attention, mesh=mesh, seq_axis="seq", is_causal=True)
  dense = functools.partial(pallas_attn.attention, is_causal=True, implementation="reference")
  (out, vjp), (ref_out, ref_vjp) = jax.vjp(ring, q, k, v), jax.vjp(dense, q, k, v)
  for got, want in zip((out, *vjp(do)), (ref_out, *ref_vjp(do))):
    assert cases.rel_err(got, want) < 1e-5
