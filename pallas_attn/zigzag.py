"""The zigzag sequence layout that balances causal ring attention.

Cut a causal sequence into P contiguous shards and device P-1's queries see P times the keys of
device 0's. Cut it instead into 2P chunks and give device i chunks i and 2P-1-i, an early chunk
and its mirror from the end: every device then holds the same share of the causal triangle. In
zigzag order the chunks run 0, 2P-1, 1, 2P-2, ..., P-1, P, so that splitting the zigzag-ordered
sequence into P contiguous shards gives each device its pair.

- `positions`, `to_zigzag`, `from_zigzag`: whole arrays, for data kept in zigzag order (token
  ids, positions, labels), permuted once on the host or at the input of a program (a gather: on
  arrays already split over the sequence, use the two below or ring_attention's own layout).
- `shard_to_zigzag`, `shard_from_zigzag`: inside `shard_map`, one device's shard of the naturally
  ordered sequence (device i holds chunks 2i and 2i+1) to its zigzag pair and back, with two
  collective permutes and no gather. Every device holds one even and one odd chunk in both
  layouts, so the even chunks move by one permutation of the devices and the odd ones by another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def chunk_order(num_shards: int) -> np.ndarray:
  """The natural index of each of the 2 * num_shards chunks, in zigzag order."""
  order = np.empty(2 * num_shards, np.int64)
  order[0::2] = np.arange(num_shards)
  order[1::2] = 2 * num_shards - 1 - np.arange(num_shards)
  return order


def check_divisible(seq_len: int, num_shards: int, what: str = "sequence length"):
  if seq_len % (2 * num_shards):
    raise ValueError(f"the zigzag layout cuts the {what} ({seq_len}) into 2 x {num_shards} equal "
                     f"chunks; {seq_len} is not a multiple of {2 * num_shards}")


def positions(seq_len: int, num_shards: int) -> np.ndarray:
  """[seq_len]: the natural position of each row of a zigzag-ordered sequence."""
  check_divisible(seq_len, num_shards)
  chunk = seq_len // (2 * num_shards)
  return (chunk_order(num_shards)[:, None] * chunk + np.arange(chunk)).reshape(-1)


def to_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
  """`x` with its sequence axis (default 1, as in [batch, seq, heads, head_dim]) in zigzag order."""
  return jnp.take(x, positions(x.shape[axis], num_shards), axis=axis)


def from_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
  """The inverse of `to_zigzag`."""
  return jnp.take(x, np.argsort(positions(x.shape[axis], num_shards)), axis=axis)


def _home(chunk: int, num_shards: int) -> int:
  """The device that holds natural chunk `chunk` in the zigzag layout."""
  return chunk if chunk < num_shards else 2 * num_shards - 1 - chunk


def _swap_unless_even(a, b, axis_name: str):
  """(a, b) on devices i even, (b, a) on odd ones: device i's zigzag pair (i, 2P-1-i) starts with
  its even chunk exactly when i is even."""
  even = lax.axis_index(axis_name) % 2 == 0
  return jnp.where(even, a, b), jnp.where(even, b, a)


def shard_to_zigzag(x: jax.Array, axis_name: str, num_shards: int, axis: int = 1) -> jax.Array:
  """Inside shard_map over `axis_name`: natural chunks (2i, 2i+1) of device i -> its zigzag pair."""
  p = num_shards
  even, odd = jnp.split(x, 2, axis=axis)  # natural chunks 2i and 2i + 1
  even = lax.ppermute(even, axis_name, [(i, _home(2 * i, p)) for i in range(p)])
  odd = lax.ppermute(odd, axis_name, [(i, _home(2 * i + 1, p)) for i in range(p)])
  return jnp.concatenate(_swap_unless_even(even, odd, axis_name), axis=axis)


def shard_from_zigzag(x: jax.Array, axis_name: str, num_shards: int, axis: int = 1) -> jax.Array:
  """Inside shard_map over `axis_name`: the inverse of `shard_to_zigzag`."""
  p = num_shards
  even, odd = _swap_unless_even(*jnp.split(x, 2, axis=axis), axis_name)
  # Device j's even chunk is j (j even) or 2P-1-j (j odd); natural chunk c goes to device c // 2.
  even_chunk = lambda j: j if j % 2 == 0 else 2 * p - 1 - j
  even = lax.ppermute(even, axis_name, [(j, even_chunk(j) // 2) for j in range(p)])
  odd = lax.ppermute(odd, axis_name, [(j, (2 * p - 1 - even_chunk(j)) // 2) for j in range(p)])
  return jnp.concatenate([even, odd], axis=axis)
