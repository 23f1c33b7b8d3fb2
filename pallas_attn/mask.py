"""What a query may see: the static mask description and the block ranges it implies.

Every implementation (reference, portable blocked path, Mosaic GPU kernels) asks the same two
questions of a `MaskSpec`: is key `j` visible from query `i` (`visible`), and which key blocks can hold
a visible key for a given query block (`kv_block_range`). Answering both here keeps the three paths
from drifting apart.

Semantics follow `jax.nn.dot_product_attention` (jax 0.11.2) exactly:
- `is_causal` is aligned top-left: query i sees key j iff j <= i, with no offset when the query and
  key lengths differ.
- `local_window = (left, right)`: query i sees key j iff i - left <= j <= i + right (also top-left).
- `q_lengths[b]` / `kv_lengths[b]`: queries at or past q_lengths[b] and keys at or past
  kv_lengths[b] take no part.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the mask (the per-batch lengths are traced arrays, passed separately)."""

  is_causal: bool = False
  local_window: tuple[int, int] | None = None

  def __post_init__(self):
    if self.local_window is not None:
      left, right = self.local_window
      if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative, got {self.local_window}")

  @property
  def left(self) -> int | None:
    """How far back a query sees (None: unbounded)."""
    return None if self.local_window is None else self.local_window[0]

  @property
  def right(self) -> int | None:
    """How far ahead a query sees (None: unbounded); causal caps it at 0."""
    right = None if self.local_window is None else self.local_window[1]
    if self.is_causal:
      right = 0 if right is None else min(right, 0)
    return right

  @property
  def is_banded(self) -> bool:
    """True when position alone (not lengths) can hide a key."""
    return self.left is not None or self.right is not None


def visible(spec: MaskSpec, q_pos: jax.Array, kv_pos: jax.Array,
            q_length=None, kv_length=None) -> jax.Array:
  """Whether the query at `q_pos` sees the key at `kv_pos` (broadcasting).

  `q_length` / `kv_length` are scalars or arrays broadcastable against the positions; None means
  no limit. Written with plain comparisons so it traces inside Pallas kernels too.
  """
  ok = None

  def both(a, b):
    return b if a is None else a & b

  if spec.right is not None:
    ok = both(ok, kv_pos <= q_pos + spec.right)
  if spec.left is not None:
    ok = both(ok, kv_pos >= q_pos - spec.left)
  if kv_length is not None:
    ok = both(ok, kv_pos < kv_length)
  if q_length is not None:
    ok = both(ok, q_pos < q_length)
  if ok is None:
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(kv_pos)), bool)
  return ok


def kv_block_range(spec: MaskSpec, q_start, block_q: int, block_kv: int, num_kv_blocks,
                   kv_length=None):
  """The half-open range [lo, hi) of key blocks that may hold a key visible from queries
  [q_start, q_start + block_q). Blocks outside it are skipped entirely (never loaded, never
  multiplied), forward and backward. Works on Python ints and traced int32 scalars alike.
  """
  lo = 0
  hi = num_kv_blocks
  if spec.left is not None:
    lo = jnp.maximum(q_start - spec.left, 0) // block_kv
  if spec.right is not None:
    last_key = q_start + block_q - 1 + spec.right
    hi = jnp.minimum(hi, jnp.maximum(last_key // block_kv + 1, 0))
  if kv_length is not None:
    hi = jnp.minimum(hi, (kv_length + block_kv - 1) // block_kv)
  hi = jnp.maximum(hi, lo)
  return lo, hi


def q_block_range(spec: MaskSpec, kv_start, block_kv: int, block_q: int, num_q_blocks,
                  q_length=None):
  """The half-open range [lo, hi) of query blocks that may see a key in
  [kv_start, kv_start + block_kv): the transpose of `kv_block_range`, used by the dK/dV pass."""
  lo = 0
  hi = num_q_blocks
  if spec.right is not None:
    # query i sees key j only if i >= j - right.
    lo = jnp.maximum(kv_start - spec.right, 0) // block_q
  if spec.left is not None:
    # query i sees key j only if i <= j + left.
    last_query = kv_start + block_kv - 1 + spec.left
    hi = jnp.minimum(hi, last_query // block_q + 1)
  if q_length is not None:
    hi = jnp.minimum(hi, (q_length + block_q - 1) // block_q)
  hi = jnp.maximum(hi, lo)
  return lo, hi


def block_needs_mask(spec: MaskSpec, q_start, block_q: int, kv_start, block_kv: int,
                     kv_length=None):
  """True when some (query, key) pair in the tile is hidden by position or kv length, so the
  kernel must apply the element mask; interior tiles skip that work. (Query lengths are handled
  on the log-sum-exp, not on scores.)"""
  need = False
  q_end = q_start + block_q - 1
  kv_end = kv_start + block_kv - 1
  if spec.right is not None:
    need = need | (kv_end > q_start + spec.right)
  if spec.left is not None:
    need = need | (kv_start < q_end - spec.left)
  if kv_length is not None:
    need = need | (kv_end >= kv_length)
  return need
