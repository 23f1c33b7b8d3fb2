"""The differentiable Mosaic GPU attention: padding to whole tiles, the forward kernel, and a
`jax.custom_vjp` whose backward pass runs the dQ and dK/dV kernels."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import bwd
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import fwd
from pallas_attn.mosaic_gpu import mods as mods_lib

_WGS = config_lib.COMPUTE_WARPGROUPS


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything static about one call (a custom_vjp non-differentiable argument)."""

  scale: float
  spec: mask_lib.MaskSpec
  interpret: bool
  fwd_cfg: config_lib.KernelConfig
  dq_cfg: config_lib.KernelConfig
  dkv_cfg: config_lib.KernelConfig
  mods: mods_lib.KernelMods = mods_lib.KernelMods()


def attention(q, k, v, q_lengths, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
              interpret: bool = False, fwd_cfg: config_lib.KernelConfig | None = None,
              logits_soft_cap: float | None = None, q_segment_ids=None, kv_segment_ids=None,
              alibi_slopes=None):
  """q [B, T, Hq, D], k/v [B, S, Hkv, D] (bf16/f16), lengths int32 [B] or None.
  `fwd_cfg` overrides the forward tiles (benchmarks compare variants with it).

  Score modifiers (see `mods`), applied in the kernels:
    logits_soft_cap: static float: logits become cap * tanh(logit / cap).
    q_segment_ids, kv_segment_ids: int [B, T] and [B, S], both or neither: query i sees key j
      only where their ids are equal (packed sequences).
    alibi_slopes: float32 [Hq]: adds -slope[h] * |i - j| to the scaled logits. Constants: no
      gradient flows to them, and differentiating with respect to them raises TypeError (use
      `jax.lax.stop_gradient` on trainable slopes, or the portable path to train them).

  Returns (out [B, T, Hq, D], lse [B, Hq, T] float32 with +inf on rows that saw no key).
  """
  q_len, head_dim = q.shape[1], q.shape[-1]
  mods, mod_arrays = mods_lib.from_arguments(q, k, logits_soft_cap, q_segment_ids,
                                             kv_segment_ids, alibi_slopes)
  static = _Static(
      scale=scale, spec=spec, interpret=interpret,
      fwd_cfg=fwd_cfg or config_lib.forward_config(head_dim), dq_cfg=config_lib.dq_config(head_dim),
      dkv_cfg=config_lib.dkv_config(head_dim), mods=mods)
  # Pad both sequences to whole tiles of every kernel (padded rows and keys fail the length test).
  q_multiple = math.lcm(_WGS * static.fwd_cfg.block_q, _WGS * static.dq_cfg.block_q,
                        static.dkv_cfg.block_q)
  kv_multiple = math.lcm(static.fwd_cfg.block_kv, static.dq_cfg.block_kv,
                         _WGS * static.dkv_cfg.block_kv)
  padded = mask_lib.pad_to_tiles(q, k, v, q_lengths, kv_lengths, q_multiple, kv_multiple)
  mod_arrays = mod_arrays.padded(padded[0].shape[1], padded[1].shape[1])
  out, lse = _attention(static, *padded, mod_arrays)
  return out[:, :q_len], lse[:, :, :q_len]


def _forward(static: _Static, q, k, v, q_lengths, kv_lengths, mod_arrays):
  return fwd.forward(q, k, v, q_lengths, kv_lengths, scale=static.scale, spec=static.spec,
                     cfg=static.fwd_cfg, interpret=static.interpret, mods=static.mods,
                     mod_arrays=mod_arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, q_lengths, kv_lengths, mod_arrays):
  return _forward(static, q, k, v, q_lengths, kv_lengths, mod_arrays)


def _attention_fwd(static, q, k, v, q_lengths, kv_lengths, mod_arrays):
  out, lse = _forward(static, q, k, v, q_lengths, kv_lengths, mod_arrays)
  return (out, lse), (q, k, v, out, lse, q_lengths, kv_lengths, mod_arrays)


def _attention_bwd(static, res, cotangents):
  q, k, v, out, lse, q_lengths, kv_lengths, mod_arrays = res
  d_out, _ = cotangents  # the lse leaves the API under stop_gradient
  # delta_i = rowsum(dO_i * O_i): one fused elementwise pass, [B, Hq, T] float32.
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
  d_out = d_out.astype(q.dtype)
  common = dict(scale=static.scale, spec=static.spec, interpret=static.interpret,
                mods=static.mods, mod_arrays=mod_arrays)
  dq = bwd.dq(q, k, v, d_out, lse, delta, kv_lengths, cfg=static.dq_cfg, **common)
  if static.interpret:
    # The interpreter keeps one global model of shared memory and runs each warpgroup as a
    # thread that blocks on barriers; two kernels interpreted at once (XLA may run the
    # independent dQ and dK/dV calls concurrently) can deadlock. Order them.
    dq, q = jax.lax.optimization_barrier((dq, q))
  dk, dv = bwd.dkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, cfg=static.dkv_cfg,
                   **common)
  # No cotangent for the lengths, the segment ids nor the ALiBi slopes (constants: see
  # `mods.constant_slopes`).
  return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
