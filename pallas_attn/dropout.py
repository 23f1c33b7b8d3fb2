"""Attention-weight dropout without a stored mask: a counter-based hash of the element's indices.

Whether probability P[b, h, i, j] is kept is a pure function of (seed, b, h, i, j), so any block
of the keep-mask can be regenerated anywhere (forward tile loop, both backward loops, the dense
reference) and the [q_len, kv_len] mask never exists in memory. The hash is MurmurHash3's 32-bit
block mixing and finalizer (Appleby, public domain), written in uint32 jnp operations: each index
is absorbed as one 32-bit word, then the finalizer avalanches every input bit into the output.
Element (b, h, i, j) is kept iff hash >= rate * 2^32, i.e. with probability 1 - rate (to within
2^-32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# MurmurHash3 x86_32 constants.
_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_N = np.uint32(0xE6546B64)
_F1 = np.uint32(0x85EBCA6B)
_F2 = np.uint32(0xC2B2AE35)


def _rotl(x, r: int):
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _absorb(h, word):
  """One MurmurHash3 block step: mix a 32-bit word into the running hash."""
  k = _rotl(jnp.asarray(word).astype(jnp.uint32) * _C1, 15) * _C2
  h = _rotl(h ^ k, 13)
  return h * np.uint32(5) + _N


def _finalize(h, num_words: int):
  h = h ^ np.uint32(4 * num_words)
  h = (h ^ (h >> np.uint32(16))) * _F1
  h = (h ^ (h >> np.uint32(13))) * _F2
  return h ^ (h >> np.uint32(16))


def hash_indices(seed: jax.Array, *indices: jax.Array) -> jax.Array:
  """uint32 hash of (seed[0], seed[1], *indices), broadcasting the index arrays.

  seed: uint32 [2]. Indices are absorbed in order, so words of small broadcast shape (batch,
  head) are mixed before the result grows to the full tile.
  """
  h = _absorb(seed[0], seed[1])
  for index in indices:
    h = _absorb(h, index)
  return _finalize(h, 1 + len(indices))


def threshold(rate: float) -> np.uint32:
  """The uint32 below which a hash means "dropped": round(rate * 2^32), capped."""
  return np.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def keep_mask(seed: jax.Array, batch, head, q_pos, kv_pos, rate: float) -> jax.Array:
  """bool, the broadcast shape of the index arrays: True where the weight is kept (probability
  1 - rate). seed: uint32 [2] (see `seed_from_key`)."""
  return hash_indices(seed, batch, head, q_pos, kv_pos) >= threshold(rate)


# `keep_mask` in two halves, for kernels: the running hash after (seed, batch, head) is computed
# once per (batch, head) outside, the positions are absorbed per tile. Same arithmetic, so the
# same bits as `keep_mask`.
def row_prefix(seed: jax.Array, batch, head) -> jax.Array:
  """uint32, broadcast shape of batch and head: the hash state after (seed, batch, head)."""
  return _absorb(_absorb(_absorb(seed[0], seed[1]), batch), head)


def keep_from_prefix(prefix, q_pos, kv_pos, rate: float) -> jax.Array:
  """`keep_mask` from the `row_prefix` of its (seed, batch, head)."""
  return _finalize(_absorb(_absorb(prefix, q_pos), kv_pos), 5) >= threshold(rate)


def seed_from_key(key: jax.Array) -> jax.Array:
  """uint32 [2] hash seed drawn from a PRNG key (typed `jax.random.key` or raw uint32 [2])."""
  return jax.random.bits(key, (2,), jnp.uint32)
