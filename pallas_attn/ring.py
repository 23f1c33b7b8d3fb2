"""Context parallelism: exact attention over sequences sharded across devices (ring attention).

Each device on the mesh axis `seq_axis` (P devices) holds one shard of q, k and v along the
sequence. The key/value shards travel around the ring of devices (`lax.ppermute` to the next one)
while every device runs its queries against the shard it holds, merging the partial results by
their log-sum-exp (`numerics.merge_partials`). Sending the next shard does not depend on the
current step's kernels, so the transfer can overlap them; no device ever holds more than its own
queries and two key/value shards.

Causal: contiguous shards would leave device P-1 with P times the work of device 0, so the ring
runs on the zigzag layout (`zigzag`): device i holds chunks i and 2P-1-i (C rows each), the
"low" and the "high" half of its shard. Against the shard of device j:
  j == i  the diagonal: one causal call over the local 2C rows (the local order puts the early
          chunk first, so the causal mask of local positions is the global one);
  j < i   both query chunks see all of chunk j and none of chunk 2P-1-j: one 2C x C call;
  j > i   only the high query chunk sees j's shard, and all of it: one C x 2C call.
Every step then costs each device 2C^2 scores. Non-causal: contiguous shards, full calls.

Backward (a `jax.custom_vjp`): the key/value shards go around the ring again, each with its
dK/dV accumulator; every device adds the contribution of its chunk pair, computed by the
implementation's backward pass from the *global* lse and delta = rowsum(dO * O) (so exp(s - lse)
are the exact probabilities), and after P hops every accumulator is back home. dQ stays local.

Sequence lengths: valid positions are a prefix of the sequence, and a zigzag shard (an early
chunk, then a later one) keeps them a prefix locally, so every chunk pair takes plain lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from pallas_attn import api
from pallas_attn import chunk_kernels
from pallas_attn import dispatch
from pallas_attn import numerics
from pallas_attn import zigzag

Layout = Literal["natural", "zigzag"]


@dataclasses.dataclass(frozen=True)
class _Pair:
  """What one ring step computes: local query rows and shard keys ("all", or the "low" / "high"
  zigzag chunk of the shard), with or without the causal mask."""

  rows: str
  keys: str
  is_causal: bool


_FULL = _Pair("all", "all", is_causal=False)
_DIAGONAL = _Pair("all", "all", is_causal=True)
_BELOW = _Pair("all", "low", is_causal=False)  # the shard of an earlier device
_ABOVE = _Pair("high", "all", is_causal=False)  # the shard of a later device


@dataclasses.dataclass(frozen=True)
class _Ring:
  """Everything static about one ring attention call (a custom_vjp non-differentiable argument)."""

  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  seq_axis: str
  batch_axis: str | None
  head_axis: str | None
  is_causal: bool
  zigzag: bool  # shards hold zigzag chunk pairs (always when causal)
  scale: float
  kernels: chunk_kernels.ChunkKernels

  @property
  def size(self) -> int:
    return self.mesh.shape[self.seq_axis]

  def spec(self, kind: str) -> PartitionSpec:
    """"seq": [batch, seq, heads, head_dim]; "stat": [batch, heads, seq]; "lengths": [batch]."""
    return dict(seq=PartitionSpec(self.batch_axis, self.seq_axis, self.head_axis, None),
                stat=PartitionSpec(self.batch_axis, self.head_axis, self.seq_axis),
                lengths=PartitionSpec(self.batch_axis))[kind]

  def shard_map(self, fn, in_kinds, out_kinds):
    """`fn(self, *shards)` on every device's shards of arguments laid out as `in_kinds`."""
    in_specs = tuple(self.spec(k) for k in in_kinds)
    mapped = jax.shard_map(functools.partial(fn, self), mesh=self.mesh, in_specs=in_specs,
                           out_specs=tuple(self.spec(k) for k in out_kinds), check_vma=False)
    explicit = AxisType.Explicit in self.mesh.axis_types

    def call(*args):
      if explicit:  # explicit shardings are types: shard_map wants them to be its in_specs
        args = [jax.sharding.reshard(x, NamedSharding(self.mesh, spec))
                for x, spec in zip(args, in_specs)]
      return mapped(*args)

    return call

  @property
  def pairs(self) -> tuple[_Pair, ...]:
    return (_DIAGONAL, _BELOW, _ABOVE) if self.is_causal else (_FULL,)

  def pair_index(self, step, device):
    """Which of `pairs` the ring step `step` computes on `device` (it holds the shard of device
    (device - step) mod P: earlier than its own when device >= step > 0)."""
    if not self.is_causal:
      return 0
    return jnp.where(step == 0, 0, jnp.where(device >= step, 1, 2))

  def pass_on(self, x):
    """Send `x` to the next device of the ring, receive the previous device's."""
    return lax.ppermute(x, self.seq_axis, [(j, (j + 1) % self.size) for j in range(self.size)])

  def chunk(self, part: str, owner, shard_len: int, lengths) -> tuple[_Rows, jax.Array]:
    """The `part` of `owner`'s shard (shard_len rows), and how many of its rows lie before the
    global `lengths` [B]: the chunk's own int32 lengths [B]."""
    if self.zigzag:
      half = shard_len // 2
      chunks = dict(all=(owner, 2 * self.size - 1 - owner), low=(owner,),
                    high=(2 * self.size - 1 - owner,))[part]
      rows = dict(all=_Rows(0, shard_len), low=_Rows(0, half), high=_Rows(half, half))[part]
      size = half
    else:
      chunks, rows, size = (owner,), _Rows(0, shard_len), shard_len
    count = sum(jnp.clip(lengths - c * size, 0, size) for c in chunks)
    return rows, count.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Rows:
  """Rows [start, start + size) of a sequence axis."""

  start: int
  size: int

  def of(self, x, axis: int = 1):
    return lax.slice_in_dim(x, self.start, self.start + self.size, axis=axis)

  def set(self, x, y, axis: int = 1):
    """x with these rows replaced by y. (Not `x.at[:, rows].set(y)`: over the whole axis that
    traces to a scatter without indices, which crashed XLA's CPU compiler.)"""
    return y if y.shape == x.shape else lax.dynamic_update_slice_in_dim(x, y, self.start, axis)

  def add(self, x, y, axis: int = 1):
    return self.set(x, self.of(x, axis) + y.astype(x.dtype), axis)


# ---------------------------------------------------------------------------------------------
# One device's side of the ring (inside shard_map).


def _forward_shard(ring: _Ring, q, k, v, q_lengths, kv_lengths):
  device = lax.axis_index(ring.seq_axis)

  def pair_forward(pair, owner, k, v, out, lse):
    rows, q_count = ring.chunk(pair.rows, device, q.shape[1], q_lengths)
    keys, kv_count = ring.chunk(pair.keys, owner, k.shape[1], kv_lengths)
    part_out, part_lse = ring.kernels.forward(rows.of(q), keys.of(k), keys.of(v), q_count,
                                              kv_count, scale=ring.scale,
                                              is_causal=pair.is_causal)
    part_out, part_lse = numerics.merge_partials(rows.of(out), rows.of(lse, 2), part_out, part_lse)
    return rows.set(out, part_out), rows.set(lse, part_lse, 2)

  branches = [functools.partial(pair_forward, pair) for pair in ring.pairs]

  def step(i, carry):
    kv, out, lse = carry
    arriving = ring.pass_on(kv)  # in flight while this step computes
    owner = (device - i) % ring.size
    out, lse = lax.switch(ring.pair_index(i, device), branches, owner, *kv, out, lse)
    return arriving, out, lse

  batch, q_len, heads, _ = q.shape
  init = ((k, v), jnp.zeros(q.shape, jnp.float32),
          jnp.full((batch, heads, q_len), numerics.EMPTY_LSE, jnp.float32))
  _, out, lse = lax.fori_loop(0, ring.size, step, init)
  return out, lse


def _backward_shard(ring: _Ring, q, k, v, out, lse, d_out, q_lengths, kv_lengths):
  device = lax.axis_index(ring.seq_axis)
  delta = numerics.delta(d_out, out)

  def pair_backward(pair, owner, k, v, dq, dk, dv):
    rows, q_count = ring.chunk(pair.rows, device, q.shape[1], q_lengths)
    keys, kv_count = ring.chunk(pair.keys, owner, k.shape[1], kv_lengths)
    part_dq, part_dk, part_dv = ring.kernels.backward(
        rows.of(q), keys.of(k), keys.of(v), rows.of(d_out), rows.of(lse, 2), rows.of(delta, 2),
        q_count, kv_count, scale=ring.scale, is_causal=pair.is_causal)
    return rows.add(dq, part_dq), keys.add(dk, part_dk), keys.add(dv, part_dv)

  branches = [functools.partial(pair_backward, pair) for pair in ring.pairs]

  def step(i, carry):
    kv, (dk, dv), dq = carry
    arriving = ring.pass_on(kv)
    owner = (device - i) % ring.size
    dq, dk, dv = lax.switch(ring.pair_index(i, device), branches, owner, *kv, dq, dk, dv)
    # The accumulators follow their shard; after the P-th hop they are home.
    return arriving, ring.pass_on((dk, dv)), dq

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  _, (dk, dv), dq = lax.fori_loop(0, ring.size, step, ((k, v), (zeros(k), zeros(v)), zeros(q)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---------------------------------------------------------------------------------------------
# The differentiable ring, on global arrays in the ring's layout.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, q_lengths, kv_lengths):
  return _ring_attention_fwd(ring, q, k, v, q_lengths, kv_lengths)[0]


def _ring_attention_fwd(ring: _Ring, q, k, v, q_lengths, kv_lengths):
  out, lse = ring.shard_map(_forward_shard, ("seq", "seq", "seq", "lengths", "lengths"),
                            ("seq", "stat"))(q, k, v, q_lengths, kv_lengths)
  # The float32 output is kept for delta = rowsum(dO * O), as blocked_jax does.
  return (out.astype(q.dtype), lse), (q, k, v, out, lse, q_lengths, kv_lengths)


def _ring_attention_bwd(ring: _Ring, res, cotangents):
  q, k, v, out, lse, q_lengths, kv_lengths = res
  d_out, _ = cotangents  # the lse only marks empty rows (under stop_gradient)
  dq, dk, dv = ring.shard_map(
      _backward_shard, ("seq", "seq", "seq", "seq", "stat", "seq", "lengths", "lengths"),
      ("seq", "seq", "seq"))(q, k, v, out, lse, d_out, q_lengths, kv_lengths)
  return dq, dk, dv, None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _to_zigzag_shards(ring: _Ring, *xs):
  return tuple(zigzag.shard_to_zigzag(x, ring.seq_axis, ring.size) for x in xs)


def _from_zigzag_shards(ring: _Ring, *xs):
  return tuple(zigzag.shard_from_zigzag(x, ring.seq_axis, ring.size) for x in xs)


# ---------------------------------------------------------------------------------------------
# The public function.


def _check_axis(mesh, name: str, axis) -> None:
  if axis is not None and axis not in mesh.axis_names:
    raise ValueError(f"{name}={axis!r} is not an axis of the mesh (axes {mesh.axis_names})")


def _check_split(what: str, size: int, mesh, axis, shapes: str) -> None:
  if axis is not None and size % mesh.shape[axis]:
    raise ValueError(f"{what} ({size}) is not a multiple of mesh axis {axis!r} "
                     f"({mesh.shape[axis]} devices); {shapes}")


def ring_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                   mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, seq_axis: str,
                   is_causal: bool = False, scale: float | None = None,
                   query_seq_lengths: jax.Array | None = None,
                   key_value_seq_lengths: jax.Array | None = None,
                   batch_axis: str | None = None, head_axis: str | None = None,
                   layout: Layout = "natural",
                   implementation: chunk_kernels.ChunkImplementation | None = None,
                   interpret: bool = False, deterministic_backward: bool = False) -> jax.Array:
  """Exact attention with q, k and v sharded over the sequence: ring attention (see the module
  docstring). Same numbers as `pallas_attn.attention` (up to float rounding), differentiable.

  Args:
    query: [batch, q_len, heads_q, head_dim].
    key, value: [batch, kv_len, heads_kv, head_dim]; heads_q % heads_kv == 0 (GQA/MQA).
    mesh: the device mesh (Explicit or Auto axes).
    seq_axis: the mesh axis (P devices) that splits the sequences.
    is_causal: query i sees key j iff j <= i; needs q_len == kv_len.
    scale: multiplies q.k; default 1/sqrt(head_dim).
    query_seq_lengths, key_value_seq_lengths: int32 [batch], as in `attention`.
    batch_axis, head_axis: mesh axes that also split the batch and the heads (each device then
      holds a [batch/B, seq/P, heads/H, head_dim] block); heads_kv must divide by head_axis.
    layout: the sequence order of query, key, value and the result. "natural": the order of
      the tokens; with is_causal the ring moves the shards to the zigzag layout and back itself
      (two collective permutes each way). "zigzag": already in `zigzag.to_zigzag` order with
      `num_shards` = P (e.g. the token ids were permuted once, outside the model): nothing moves,
      and the result is in zigzag order too.
    implementation: "mosaic_gpu", "blocked_jax" or None (the Mosaic GPU kernels where they
      support the call, else blocked_jax).
    interpret: run the Mosaic GPU kernels in the interpreter.
    deterministic_backward: gradients equal to the bit from run to run, as in `attention` (the
      ring sums the chunk pairs' gradients in a fixed order already).

  Lengths: q_len and kv_len must divide into P equal shards, into 2P chunks with is_causal or
  layout="zigzag" (ValueError otherwise).

  Returns:
    out [batch, q_len, heads_q, head_dim] in the input dtype and layout, sharded like the inputs'
    shards: PartitionSpec(batch_axis, seq_axis, head_axis, None).
  """
  shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
  if query.ndim != 4 or key.ndim != 4 or key.shape != value.shape:
    raise ValueError(f"ring_attention takes query [batch, q_len, heads_q, head_dim] and key, value "
                     f"[batch, kv_len, heads_kv, head_dim] of one shape; got {shapes}")
  batch, q_len, heads_q, head_dim = query.shape
  _, kv_len, heads_kv, kv_head_dim = key.shape
  if key.shape[0] != batch or kv_head_dim != head_dim or heads_q % heads_kv:
    raise ValueError(f"key/value must match the query's batch and head_dim, and heads_q must be a "
                     f"multiple of heads_kv; got {shapes}")
  if not query.dtype == key.dtype == value.dtype:
    raise TypeError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, "
                    f"{value.dtype}")
  for name, axis in (("seq_axis", seq_axis), ("batch_axis", batch_axis),
                     ("head_axis", head_axis)):
    _check_axis(mesh, name, axis)
  axes = [a for a in (seq_axis, batch_axis, head_axis) if a is not None]
  if len(set(axes)) != len(axes):
    raise ValueError(f"seq_axis, batch_axis and head_axis must differ; got {axes}")
  if layout not in ("natural", "zigzag"):
    raise ValueError(f"layout must be 'natural' or 'zigzag'; got {layout!r}")
  if is_causal and q_len != kv_len:
    raise ValueError(f"causal ring attention needs q_len == kv_len; got {shapes}")
  num_shards = mesh.shape[seq_axis]
  use_zigzag = is_causal or layout == "zigzag"
  for what, length in (("q_len", q_len), ("kv_len", kv_len)):
    if use_zigzag:
      zigzag.check_divisible(length, num_shards, f"{what} of {shapes}")
    else:
      _check_split(what, length, mesh, seq_axis, shapes)
  _check_split("batch", batch, mesh, batch_axis, shapes)
  _check_split("heads_kv", heads_kv, mesh, head_axis, shapes)

  call = dispatch.AttentionCall(
      batch=batch, q_len=q_len // num_shards, kv_len=kv_len // num_shards, heads_q=heads_q,
      heads_kv=heads_kv, head_dim=head_dim, dtype=jnp.dtype(query.dtype), has_bias=False,
      has_mask=False, interpret=interpret)
  ring = _Ring(mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, head_axis=head_axis,
               is_causal=bool(is_causal), zigzag=use_zigzag,
               scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
               kernels=chunk_kernels.select(implementation, call,
                                            deterministic_backward=deterministic_backward))

  q_lengths = api._check_lengths("query_seq_lengths", query_seq_lengths, batch)  # pylint: disable=protected-access
  kv_lengths = api._check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)  # pylint: disable=protected-access
  return _ring_program(ring, is_causal and layout == "natural", query, key, value, q_lengths,
                       kv_lengths)


# Under jit even when called eagerly: shard_map over the mesh's abstract form, inside a
# custom_vjp, can only be lowered as part of a jitted computation (an eager jax.vjp of the ring
# fails otherwise).
@functools.partial(jax.jit, static_argnums=(0, 1))
def _ring_program(ring: _Ring, permute: bool, query, key, value, q_lengths, kv_lengths):
  """The ring (see `ring_attention`) on checked arguments; lengths None or int32 [batch]."""
  batch, q_len = query.shape[:2]
  kv_len = key.shape[1]
  num_shards = ring.mesh.shape[ring.seq_axis]
  given_lengths = q_lengths is not None or kv_lengths is not None
  if permute:
    query, key, value = ring.shard_map(_to_zigzag_shards, ("seq",) * 3, ("seq",) * 3)(
        query, key, value)
  full = lambda n: jnp.full((batch,), n, jnp.int32)
  q_lengths = full(q_len) if q_lengths is None else q_lengths
  kv_lengths = full(kv_len) if kv_lengths is None else kv_lengths
  out, lse = _ring_attention(ring, query, key, value, q_lengths, kv_lengths)
  if given_lengths:
    # Rows can be empty only with lengths: give them jax.nn's values, as `attention` does.
    out, _ = numerics.finalize_empty_rows(out, lse, value, None)
    rows = zigzag.positions(q_len, num_shards) if ring.zigzag else np.arange(q_len)
    out = jnp.where((rows[None, :] < q_lengths[:, None])[:, :, None, None], out, 0)
  if permute:
    out, = ring.shard_map(_from_zigzag_shards, ("seq",), ("seq",))(out)
  return out
