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
  # Forward only: FlashAttention-3's ping-pong. The two compute warpgroups meet at a barrier
  # twice per key block, offset by one meeting, so one's softmax runs while the other's matmuls
  # hold the tensor cores.
  ping_pong: bool = True
  # dK/dV only: compute dV and dK in two launches (when both accumulators don't fit registers).
  split_dkv: bool = False

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
  tiles of a warpgroup in registers (2 x 32 + head_dim / 2 per thread). head_dim 256: q and dO
  take 128 KiB, so the K/V ring gets one slot (64 KiB x 2 for two would overflow 227 KiB)."""
  del dtype_bytes
  return KernelConfig(block_q=64, block_kv=64, stages=1 if head_dim > 128 else 2)


def dkv_config(head_dim: int, dtype_bytes: int = 2) -> KernelConfig:
  """dK/dV tiles: K and V per compute warpgroup, a q/dO ring. The dK and dV accumulators of a
  64-row key tile take head_dim registers per thread; at head_dim 256 they don't fit together,
  so dV and dK are separate launches, and the ring has one slot (K/V take 128 KiB)."""
  del dtype_bytes
  if head_dim > 128:
    return KernelConfig(block_q=64, block_kv=64, stages=1, split_dkv=True)
  return KernelConfig(block_q=64, block_kv=64, stages=2)
