"""Tile sizes and pipeline depth for the Mosaic GPU kernels, chosen by one pure function.

Shared-memory budget on Hopper: 227 KiB per CTA. Forward (2 compute warpgroups, a ring of
`stages` K/V slots), bf16/f16 (2 bytes):
  q/o tiles   2 * block_q * head_dim * 2
  k ring      stages * block_kv * head_dim * 2
  v ring      stages * block_kv * head_dim * 2
  head_dim 128, block_q 64, block_kv 128, 2 stages: 32 + 64 + 64 = 160 KiB.
  head_dim 256, block_q 64, block_kv 64,  2 stages: 64 + 64 + 64 = 192 KiB.
dQ kernel: q and dO tiles per compute warpgroup plus the K/V ring (same arithmetic as above with
q counted twice). dK/dV kernel: K and V tiles per compute warpgroup, a ring of q/dO tiles.
Registers bound the accumulators: a warpgroup (128 threads) holding dK and dV for a 64-row key
tile at head_dim 128 spends 2 * 64 * 128 * 4 / 128 = 512 bytes (128 registers) per thread.
"""

from __future__ import annotations

import dataclasses

SUPPORTED_HEAD_DIMS = (64, 128, 256)
BACKWARD_HEAD_DIMS = (64, 128)
SMEM_BYTES = 227 * 1024
# Two warpgroups compute (each owns `block_q` query rows, or `block_kv` key rows in dK/dV); a third
# issues the TMA copies.
COMPUTE_WARPGROUPS = 2


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tile sizes of one kernel launch. block_q / block_kv are per compute warpgroup."""

  block_q: int
  block_kv: int
  stages: int = 2

  def __post_init__(self):
    if self.block_q % 64 or self.block_kv % 64:
      raise ValueError(f"block_q ({self.block_q}) and block_kv ({self.block_kv}) must be "
                       f"multiples of 64 (the wgmma tile height)")
    if self.stages < 1:
      raise ValueError(f"stages must be >= 1, got {self.stages}")


def forward_config(head_dim: int, dtype_bytes: int = 2) -> KernelConfig:
  """Forward tiles: the largest key block whose K/V ring fits beside the two q tiles."""
  block_q = 64
  for block_kv in (128, 64):
    cfg = KernelConfig(block_q=block_q, block_kv=block_kv, stages=2)
    smem = (COMPUTE_WARPGROUPS * block_q + 2 * cfg.stages * block_kv) * head_dim * dtype_bytes
    if smem <= SMEM_BYTES - 4096:  # headroom for barriers and the lse tile
      return cfg
  raise ValueError(f"no forward tiling fits head_dim {head_dim}")


def dq_config(head_dim: int, dtype_bytes: int = 2) -> KernelConfig:
  """dQ tiles: q and dO per compute warpgroup, a K/V ring. block_kv 64 keeps the S, dP and dQ
  tiles of a warpgroup (3 x 32 + head_dim / 2 registers per thread at head_dim 128) in registers."""
  del dtype_bytes
  if head_dim not in BACKWARD_HEAD_DIMS:
    return KernelConfig(block_q=64, block_kv=64)
  return KernelConfig(block_q=64, block_kv=64, stages=2)


def dkv_config(head_dim: int, dtype_bytes: int = 2) -> KernelConfig:
  """dK/dV tiles: K and V per compute warpgroup, a q/dO ring. The dK and dV accumulators of a
  64-row key tile take head_dim registers per thread, so the query tile stays at 64."""
  del dtype_bytes
  if head_dim not in BACKWARD_HEAD_DIMS:
    return KernelConfig(block_q=64, block_kv=64)
  return KernelConfig(block_q=64, block_kv=64, stages=2)
