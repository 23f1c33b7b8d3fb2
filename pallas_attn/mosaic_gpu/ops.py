"""The differentiable Mosaic GPU attention: padding to whole tiles, the forward kernel, and a
`jax.custom_vjp` whose backward pass runs the dQ and dK/dV kernels. `forward` and `backward` are
the two passes alone (the backward from a caller's lse and delta), for `pallas_attn.ring`.
With a bias, the backward pass also runs the dbias kernel (`dbias.py`), but only when the bias
is differentiated: the custom_vjp's forward rule sees which inputs are perturbed
(`symbolic_zeros=True`) and tells the backward rule through the residuals' structure.

The custom_vjp runs each pass through `sharding.batch_head_parallel`: the kernels are custom calls
that XLA's partitioner would otherwise replicate (gathering q, k and v) under a sharded `jit`."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn import sharding
from pallas_attn.mosaic_gpu import bwd
from pallas_attn.mosaic_gpu import dbias as dbias_lib
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

  # Both sequences are padded to whole tiles of every kernel (padded rows and keys fail the
  # length test).
  @property
  def q_multiple(self) -> int:
    return math.lcm(_WGS * self.fwd_cfg.block_q, _WGS * self.dq_cfg.block_q, self.dkv_cfg.block_q)

  @property
  def kv_multiple(self) -> int:
    return math.lcm(self.fwd_cfg.block_kv, self.dq_cfg.block_kv, _WGS * self.dkv_cfg.block_kv)


def _static(head_dim: int, scale: float, spec: mask_lib.MaskSpec, interpret: bool,
            fwd_cfg: config_lib.KernelConfig | None = None,
            mods: mods_lib.KernelMods = mods_lib.KernelMods()) -> _Static:
  return _Static(
      scale=scale, spec=spec, interpret=interpret,
      fwd_cfg=fwd_cfg or config_lib.forward_config(head_dim), dq_cfg=config_lib.dq_config(head_dim),
      dkv_cfg=config_lib.dkv_config(head_dim), mods=mods)


def attention(q, k, v, q_lengths, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
              interpret: bool = False, fwd_cfg: config_lib.KernelConfig | None = None,
              logits_soft_cap: float | None = None, q_segment_ids=None, kv_segment_ids=None,
              alibi_slopes=None, dropout_rate: float = 0.0, dropout_seed=None,
              broadcast_dropout: bool = False, bias=None, mask=None):
  """q [B, T, Hq, D], k/v [B, S, Hkv, D] (bf16/f16), lengths int32 [B] or None.
  `fwd_cfg` overrides the forward tiles (benchmarks compare variants with it).

  Score modifiers (see `mods`), applied in the kernels:
    logits_soft_cap: static float: logits become cap * tanh(logit / cap).
    q_segment_ids, kv_segment_ids: int [B, T] and [B, S], both or neither: query i sees key j
      only where their ids are equal (packed sequences).
    alibi_slopes: float32 [Hq]: adds -slope[h] * |i + offset - j| to the scaled logits.
      Constants: no gradient flows to them, and differentiating with respect to them raises
      TypeError (use `jax.lax.stop_gradient` on trainable slopes, or the portable path to train
      them).
    dropout_rate: static float in [0, 1): attention-weight dropout inside the kernels, the same
      keep-mask as the portable path (`pallas_attn.dropout`); kept weights are scaled by
      1 / (1 - rate); the lse stays that of the undropped softmax.
    dropout_seed: uint32 or int32 [2] (`pallas_attn.dropout.seed_from_key(key)`); needed when
      dropout_rate > 0.
    broadcast_dropout: one keep-mask for every batch element and head.
    bias: float [B|1, Hq|1, T|1, S|1] (size-1 axes broadcast), added to the scaled logits
      before ALiBi and the soft-cap. Differentiable: its gradient has its own shape (the dbias
      kernel sums over the broadcast axes; it runs only when the bias is differentiated).
      float32, bfloat16 and float16 are read as they are, other float dtypes cast to float32.
    mask: bool, shaped like bias; False hides the score (after the soft-cap, like the
      positional mask). A row it hides entirely gets lse +inf.

  Returns (out [B, T, Hq, D], lse [B, Hq, T] float32 with +inf on rows that saw no key).
  """
  mods, mod_arrays = mods_lib.from_arguments(q, k, logits_soft_cap, q_segment_ids,
                                             kv_segment_ids, alibi_slopes, dropout_rate,
                                             dropout_seed, broadcast_dropout, bias, mask)
  static = _static(q.shape[-1], scale, spec, interpret, fwd_cfg, mods)
  return _attention(static, q, k, v, q_lengths, kv_lengths, *mod_arrays)


def forward(q, k, v, q_lengths, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
            interpret: bool = False, fwd_cfg: config_lib.KernelConfig | None = None):
  """The forward kernel alone (not differentiable), on one device's arrays. Arguments and
  results as `attention`."""
  return _forward_pass(_static(q.shape[-1], scale, spec, interpret, fwd_cfg), q, k, v, q_lengths,
                       kv_lengths)


def backward(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, *, scale: float,
             spec: mask_lib.MaskSpec, interpret: bool = False):
  """The dQ and dK/dV kernels alone (not differentiable), on one device's arrays, from the
  caller's lse and delta [B, Hq, T] float32: lse of each query row's whole softmax (which may span
  keys outside `k`; +inf marks rows that see no key), delta = `numerics.delta(d_out, out)` of the
  whole output. Returns (dq [B, T, Hq, D], dk, dv [B, S, Hkv, D]) in the input dtype."""
  return _backward_pass(_static(q.shape[-1], scale, spec, interpret), q, k, v, d_out, lse, delta,
                        q_lengths, kv_lengths)


def _forward_pass(static: _Static, q, k, v, q_lengths, kv_lengths, *mod_arrays):
  q_len = q.shape[1]
  padded = mask_lib.pad_to_tiles(q, k, v, q_lengths, kv_lengths, static.q_multiple,
                                 static.kv_multiple)
  mod_arrays = mods_lib.ModArrays(*mod_arrays).padded(padded[0].shape[1], padded[1].shape[1])
  out, lse = fwd.forward(*padded, scale=static.scale, spec=static.spec, cfg=static.fwd_cfg,
                         interpret=static.interpret, mods=static.mods, mod_arrays=mod_arrays)
  return out[:, :q_len], lse[:, :, :q_len]


def _backward_pass(static: _Static, q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                   *mod_arrays, with_dbias: bool = False):
  """(dq, dk, dv), and the bias gradient (float32, the bias's shape) when `with_dbias`."""
  q_len, kv_len = q.shape[1], k.shape[1]
  q, k, v, q_lengths, kv_lengths = mask_lib.pad_to_tiles(
      q, k, v, q_lengths, kv_lengths, static.q_multiple, static.kv_multiple)
  d_out, lse, delta = mask_lib.pad_row_inputs(d_out.astype(q.dtype), lse, delta,
                                              static.q_multiple)
  mod_arrays = mods_lib.ModArrays(*mod_arrays).padded(q.shape[1], k.shape[1])
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
  grads = (dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len])
  if not with_dbias:
    return grads
  if static.interpret:  # one interpreted kernel at a time (see above)
    (dk, dv), q = jax.lax.optimization_barrier(((dk, dv), q))
    grads = (dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len])
  d_bias = dbias_lib.dbias(q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                           bias_shape=mod_arrays.bias.shape, cfg=static.dq_cfg, **common)
  # Back to the bias's own extent: cut the padding of full q / kv axes.
  return grads + (d_bias[:, :, :q_len if d_bias.shape[2] > 1 else 1,
                         :kv_len if d_bias.shape[3] > 1 else 1],)


def _pair_shapes(mod_arrays):
  """The shapes of the bias and mask operands (None where absent)."""
  arrays = mods_lib.ModArrays(*mod_arrays)
  return tuple(None if x is None else x.shape for x in (arrays.bias, arrays.mask))


def _sharded_forward(static: _Static, q, k, v, q_lengths, kv_lengths, *mod_arrays):
  layout = sharding.with_pairs(sharding.FORWARD, *_pair_shapes(mod_arrays))
  return sharding.batch_head_parallel(functools.partial(_forward_pass, static), layout,
                                      q, k, v, q_lengths, kv_lengths, *mod_arrays,
                                      auto_axes=not static.interpret)


# mod_arrays: the fields of `mods.ModArrays` (q_segment_ids, kv_segment_ids, alibi_slopes,
# dropout_prefix, bias, mask), each None when absent.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, q_lengths, kv_lengths, *mod_arrays):
  return _sharded_forward(static, q, k, v, q_lengths, kv_lengths, *mod_arrays)


def _attention_fwd(static, *primals):
  # symbolic_zeros: each array comes as (value, perturbed). Only the bias's bit matters: its
  # gradient costs a kernel of its own, run only when the bias is differentiated.
  bias = mods_lib.ModArrays(*primals[5:]).bias
  with_dbias = bias is not None and bias.perturbed
  q, k, v, q_lengths, kv_lengths, *mod_arrays = jax.tree.map(lambda p: p.value, primals)
  out, lse = _sharded_forward(static, q, k, v, q_lengths, kv_lengths, *mod_arrays)
  # The residuals' structure carries the static `with_dbias` to the backward rule.
  dbias_marker = () if with_dbias else None
  return (out, lse), (q, k, v, out, lse, q_lengths, kv_lengths, tuple(mod_arrays), dbias_marker)


def _attention_bwd(static, res, cotangents):
  q, k, v, out, lse, q_lengths, kv_lengths, mod_arrays, dbias_marker = res
  with_dbias = dbias_marker is not None
  d_out, _ = cotangents  # the lse leaves the API under stop_gradient
  if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
    d_out = jnp.zeros_like(out)
  layout = sharding.with_pairs(sharding.BACKWARD, *_pair_shapes(mod_arrays), dbias=with_dbias)
  grads = sharding.batch_head_parallel(
      functools.partial(_backward_pass, static, with_dbias=with_dbias), layout,
      q, k, v, d_out, lse, numerics.delta(d_out, out), q_lengths, kv_lengths, *mod_arrays,
      auto_axes=not static.interpret)
  dq, dk, dv = grads[:3]
  # No cotangent for the lengths, the segment ids, the dropout prefix, the mask nor the ALiBi
  # slopes (constants: see `mods.constant_slopes`).
  d_mods = mods_lib.ModArrays()
  if with_dbias:
    d_mods = d_mods._replace(bias=grads[3].astype(mods_lib.ModArrays(*mod_arrays).bias.dtype))
  return (dq, dk, dv, None, None) + tuple(d_mods)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
