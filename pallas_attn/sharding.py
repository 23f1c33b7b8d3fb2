"""Batch- and head-parallel calls of one attention pass, for inputs sharded under `jit`.

The Mosaic GPU kernels are custom calls: XLA's partitioner cannot look inside them, and left alone
it would gather q, k and v onto every device and run the whole kernel there. Attention is
independent across batch elements and kv heads, so each device can run the pass on its own shard.
`batch_head_parallel(fn, layout, *operands)` arranges that:

- Mesh axes of type Explicit (`jax.make_mesh`'s default): the shardings are part of the argument
  types, so they are read at trace time and `fn` runs under `jax.shard_map`.
- Otherwise (Auto axes: `jax.sharding.Mesh`, shardings given to `jit`):
  `jax.experimental.custom_partitioning` with a Shardy sharding rule; the partitioner calls back at
  compile time with the shardings it chose, and gets `fn` to run on each shard.

Either way the query's sharding decides (k, v and the rest follow it): its batch axis keeps the
mesh axes it is split over, and its head axis keeps them when the kv heads divide by them, so that
a kv head and its group of query heads (GQA) stay on one device; with a single kv head (MQA) only
the query heads are split, and the devices' shares of dK/dV are summed. Any other split is undone
(the partitioner gathers it): a pass needs whole sequences and whole head_dim vectors
(`pallas_attn.ring_attention` is the way to split sequences).

The portable `blocked_jax` path needs none of this: it is plain JAX, which XLA partitions itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class Layout:
  """The axes of a pass's operands and results, one letter per axis: "b" batch, "h" query heads,
  "k" kv heads; any other letter (sequence, head_dim) is never split. Operand 0 is the query."""

  operands: tuple[str, ...]
  results: tuple[str, ...]


# The Mosaic GPU kernels' score-modifier operands (`mosaic_gpu.mods.ModArrays`), after the
# lengths: q_segment_ids [B, T], kv_segment_ids [B, S], alibi_slopes [Hq], dropout_prefix
# [B, Hq] (the dropout hash state of each global (batch, head): sharded, it stays global),
# batch_index [B] and head_index [Hq] (the global indices mask_fn / score_fn get), then
# bias and mask [B|1, Hq|1, T|1, S|1] (their letters depend on which axes broadcast:
# `with_pairs`).
_MOD_ARRAYS = ("bt", "bs", "h", "bh", "b", "h")
# forward(q, k, v, q_lengths, kv_lengths, *mod_arrays) -> (out, lse)
FORWARD = Layout(operands=("bthd", "bskd", "bskd", "b", "b", *_MOD_ARRAYS),
                 results=("bthd", "bht"))
# backward(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, *mod_arrays) -> (dq, dk, dv)
BACKWARD = Layout(operands=("bthd", "bskd", "bskd", "bthd", "bht", "bht", "b", "b", *_MOD_ARRAYS),
                  results=("bthd", "bskd", "bskd"))
# A size-1 (broadcast) axis of a bias or mask: a letter of its own, never split.
_BROADCAST_LETTERS = "wxyz"


def pair_axes(shape) -> str:
  """The layout letters of a bias or mask [B|1, Hq|1, T|1, S|1]."""
  return "".join(full if n > 1 else one
                 for n, full, one in zip(shape, "bhts", _BROADCAST_LETTERS))


def with_pairs(layout: Layout, bias_shape=None, mask_shape=None, dbias: bool = False) -> Layout:
  """`layout` (FORWARD or BACKWARD) with its bias and mask operands, and with the bias gradient
  as a last result when `dbias`. A bias gradient over a broadcast batch or head axis is each
  device's part of a sum: `_per_shard` adds the parts."""
  pairs = tuple(pair_axes(s) if s is not None else "" for s in (bias_shape, mask_shape))
  results = layout.results + ((pair_axes(bias_shape),) if dbias else ())
  return Layout(operands=layout.operands + pairs, results=results)


def with_replicated(layout: Layout, count: int) -> Layout:
  """`layout` with `count` more operands of rank 4 that every shard gets whole (letters that are
  never split), e.g. tables computed from static values alone."""
  return Layout(operands=layout.operands + (_BROADCAST_LETTERS,) * count,
                results=layout.results)


_SPLIT_LETTERS = "bhk"


@dataclasses.dataclass(frozen=True)
class _Split:
  """The mesh axes (a PartitionSpec entry: None, a name or a tuple of names) of each split axis."""

  batch: str | tuple[str, ...] | None = None
  heads_q: str | tuple[str, ...] | None = None
  heads_kv: str | tuple[str, ...] | None = None

  def spec(self, axes: str) -> PartitionSpec:
    by_letter = dict(b=self.batch, h=self.heads_q, k=self.heads_kv)
    return PartitionSpec(*(by_letter.get(letter) for letter in axes))


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _choose_split(q_spec: PartitionSpec, mesh_shape, batch: int, heads_kv: int) -> _Split:
  """Keep the query's batch and head splits where every device's shard is whole (see the module
  docstring); drop the rest."""
  q_spec = tuple(q_spec) + (None,) * (4 - len(q_spec))
  size = lambda entry: math.prod(mesh_shape[name] for name in _names(entry))
  batch_axes = q_spec[0] if batch % size(q_spec[0]) == 0 else None
  head_axes = q_spec[2]
  if size(head_axes) == 1:
    return _Split(batch=batch_axes)
  if heads_kv % size(head_axes) == 0:
    return _Split(batch=batch_axes, heads_q=head_axes, heads_kv=head_axes)
  if heads_kv == 1:  # MQA: every device keeps the one kv head
    return _Split(batch=batch_axes, heads_q=head_axes)
  return _Split(batch=batch_axes)


def batch_head_parallel(fn: Callable, layout: Layout, *operands, auto_axes: bool = True):
  """`fn(*operands)`, computed shard by shard over the batch and head axes when the operands are
  sharded under `jit` (see the module docstring); a plain call on one device.

  `fn` takes and returns arrays laid out as `layout` says (operands that are None are passed on as
  None); it must be a per-shard computation: attention of each batch element and query head.
  auto_axes=False: outside Explicit meshes, call `fn` as it is. For the Mosaic GPU interpreter,
  whose ordered host callbacks custom_partitioning cannot lower.
  """
  present = [i for i, x in enumerate(operands) if x is not None]
  arrays = [operands[i] for i in present]
  axes = [layout.operands[i] for i in present]

  def call(*arrays):
    full = list(operands)
    for i, x in zip(present, arrays):
      full[i] = x
    return fn(*full)

  query, key = operands[0], operands[1]
  q_sharding = jax.typeof(query).sharding
  mesh = getattr(q_sharding, "mesh", None)
  if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
    split = _choose_split(q_sharding.spec, mesh.shape, query.shape[0], key.shape[2])
    return _shard_map(call, mesh, split, arrays, axes, layout.results)
  if not auto_axes:
    return call(*arrays)
  return _fold_vmap(_partitioned(call, axes, layout.results))(*arrays)


def _summed_axes(split: _Split, result: str) -> tuple[str, ...]:
  """The mesh axes over which a result laid out as `result` is a sum of the devices' parts: the
  split batch axes when it has no batch axis; the split query-head axes when it has neither the
  query heads nor split kv heads (dK, dV under MQA; a bias gradient broadcast over heads)."""
  axes = ()
  if "b" not in result:
    axes += _names(split.batch)
  if "h" not in result and not ("k" in result and split.heads_kv is not None):
    axes += _names(split.heads_q)
  return axes


def _per_shard(call, split: _Split, results: Sequence[str]):
  """`call` on one device's shards, the results that are parts of a sum over devices
  (`_summed_axes`) added up."""
  summed_axes = [_summed_axes(split, a) for a in results]
  if not any(summed_axes):
    return call

  def summed(*arrays):
    return tuple(lax.psum(y, axes) if axes else y
                 for y, axes in zip(call(*arrays), summed_axes))

  return summed


def _shard_map(call, mesh, split: _Split, arrays, axes: Sequence[str], results: Sequence[str]):
  in_specs = tuple(split.spec(a) for a in axes)
  given = {a: jax.typeof(x).sharding for a, x in zip(reversed(axes), reversed(arrays))}
  # (An operand off the mesh, e.g. a bias made inside the jit, has no sharding to give back.)
  given = {a: s for a, s in given.items() if not getattr(s, "mesh", mesh).empty}
  arrays = [jax.sharding.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(arrays, in_specs)]
  out_specs = tuple(split.spec(a) for a in results)
  # check_vma=False: a pass's loops need not type their carries as varying over the mesh.
  outs = jax.shard_map(_per_shard(call, split, results), mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)(*arrays)
  # A result laid out like an operand gets that operand's sharding back (a gradient's type must be
  # its primal's), also where the split above dropped part of it.
  return tuple(y if a not in given else jax.sharding.reshard(y, given[a])
               for y, a in zip(outs, results))


def _sharding_rule(axes: Sequence[str], results: Sequence[str]):
  """Shardy's einsum-like rule: one factor per letter. The query heads (h) and the kv heads (k)
  are separate factors: `_choose_split` relates them, and a compound factor (k g) would let
  Shardy split one mesh axis into sub-axes that a NamedSharding cannot name. Factors other than
  b, h and k must stay whole."""
  side = lambda group: ", ".join(" ".join(a) for a in group)
  # Listed in the order the rule first names them, as Shardy requires.
  whole = tuple(dict.fromkeys(l for a in (*axes, *results) for l in a if l not in _SPLIT_LETTERS))
  return f"{side(axes)} -> {side(results)}", whole


def _partitioned(call, axes: Sequence[str], results: Sequence[str]):
  partitioned = custom_partitioning(call)

  def partition(mesh, arg_shapes, result_shapes):
    q_sharding = arg_shapes[0].sharding
    if not isinstance(q_sharding, NamedSharding):
      raise NotImplementedError(f"pallas_attn under jit needs shardings over a named mesh; got "
                                f"{type(q_sharding).__name__}")
    batch = arg_shapes[0].shape[0]
    split = _choose_split(q_sharding.spec, mesh.shape, batch, arg_shapes[1].shape[2])
    named = lambda a: NamedSharding(mesh, split.spec(a))
    return (mesh, _per_shard(call, split, results), tuple(named(a) for a in results),
            tuple(named(a) for a in axes))

  rule, whole = _sharding_rule(axes, results)
  partitioned.def_partition(partition=partition, sharding_rule=rule,
                            need_replication_factors=whole)
  return partitioned


def _fold_vmap(fn):
  """`fn` under `jax.vmap` by folding the mapped axis into the batch axis (axis 0 of every operand
  and result); custom_partitioning has no batching rule of its own."""
  folded = jax.custom_batching.custom_vmap(fn)

  @folded.def_vmap
  def rule(axis_size, in_batched, *arrays):
    arrays = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
              for x, batched in zip(arrays, in_batched)]
    outs = folded(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays))
    return tuple(y.reshape(axis_size, -1, *y.shape[1:]) for y in outs), (True,) * len(outs)

  return folded
