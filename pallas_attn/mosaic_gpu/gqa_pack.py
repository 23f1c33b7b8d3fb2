"""Decode-shaped GQA calls: the query heads of a group packed into the rows of one kernel tile.

A CTA of the kernels owns `rows_per_cta` (128) query rows of one query head and streams that
head's kv head through shared memory. With a few queries (decoding over a KV cache: q_len 1 to
16) almost every row of the tile is padding, and the `group` query heads that share a kv head
each stream the whole K/V again: a call of batch 16, 32 query heads over 8 kv heads and one query
runs 512 CTAs that read 4x the K/V bytes, each CTA using one row of 128.

Packing views q [B, T, Hkv * G, D] as [B, T * G, Hkv, D] (row r = t * G + g holds query t of
query head kv_head * G + g) and runs the unchanged kernels with one query head per kv head: each
CTA covers up to 128 (query, head) rows of one kv head, and K/V are read once per kv head. The lse
and delta [B, Hq, T] are viewed the same way ([B, Hkv, T * G]); the lengths scale by G.

It is exact only where a row's visible keys do not depend on its query position or query head:
no causal band or window (or one that hides no key, as bottom-right causal with one query), and
no modifier that reads the position or the head (segment ids, ALiBi, dropout, bias, masks,
mask/score functions). The soft-cap is elementwise and stays.
"""

from __future__ import annotations

from pallas_attn import mask as mask_lib


def positional_mask(spec: mask_lib.MaskSpec, q_len: int, kv_len: int) -> mask_lib.MaskSpec | None:
  """`spec` as a mask that ignores query positions (MaskSpec() when it hides no key from any
  query of [0, q_len)), or None when query positions matter."""
  if not spec.is_banded:
    return spec
  hides_nothing = (spec.is_causal and spec.local_window is None and q_len >= 1
                   and spec.offset >= kv_len - 1)  # query 0 already sees the last key
  return mask_lib.MaskSpec() if hides_nothing else None


def should_pack(q_shape, kv_heads: int, spec: mask_lib.MaskSpec, kv_len: int,
                position_free_mods: bool, rows_per_cta: int) -> bool:
  """Pack when the call has a GQA group, fewer queries than a CTA has rows (packing then never
  adds CTAs or work), and rows that are interchangeable (see the module doc)."""
  _, q_len, heads_q, _ = q_shape
  group = heads_q // kv_heads
  return (group > 1 and q_len < rows_per_cta and position_free_mods
          and positional_mask(spec, q_len, kv_len) is not None)


def pack_rows(x, kv_heads: int):
  """[B, T, Hkv * G, D] -> [B, T * G, Hkv, D], row t * G + g = (query t, head kv_head * G + g)."""
  batch, q_len, heads_q, head_dim = x.shape
  group = heads_q // kv_heads
  x = x.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 1, 3, 2, 4)
  return x.reshape(batch, q_len * group, kv_heads, head_dim)


def unpack_rows(x, group: int):
  """The inverse of `pack_rows`: [B, T * G, Hkv, D] -> [B, T, Hkv * G, D]."""
  batch, rows, kv_heads, head_dim = x.shape
  x = x.reshape(batch, rows // group, group, kv_heads, head_dim).transpose(0, 1, 3, 2, 4)
  return x.reshape(batch, rows // group, kv_heads * group, head_dim)


def pack_stats(x, kv_heads: int):
  """Row statistics (lse, delta) [B, Hkv * G, T] -> [B, Hkv, T * G], in `pack_rows`' order."""
  batch, heads_q, q_len = x.shape
  group = heads_q // kv_heads
  x = x.reshape(batch, kv_heads, group, q_len).transpose(0, 1, 3, 2)
  return x.reshape(batch, kv_heads, q_len * group)


def unpack_stats(x, group: int):
  """The inverse of `pack_stats`: [B, Hkv, T * G] -> [B, Hkv * G, T]."""
  batch, kv_heads, rows = x.shape
  x = x.reshape(batch, kv_heads, rows // group, group).transpose(0, 1, 3, 2)
  return x.reshape(batch, kv_heads * group, rows // group)


def pack_lengths(q_lengths, group: int):
  """Query lengths in packed rows (None stays None)."""
  return None if q_lengths is None else q_lengths * group
