"""Which implementation serves a call, and the uniform calling convention they share.

Every implementation is called as
  impl(query, key, value, bias, mask, *, scale, spec, q_lengths, kv_lengths, interpret)
and returns (out [batch, q_len, heads_q, head_dim] in the input dtype,
lse [batch, heads_q, q_len] float32 with +inf on rows that saw no key); see `numerics`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_attn import blocked_jax
from pallas_attn import interpreter_threads
from pallas_attn import reference


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """The static facts of one call that decide which implementation can serve it."""

  batch: int
  q_len: int
  kv_len: int
  heads_q: int
  heads_kv: int
  head_dim: int
  dtype: jnp.dtype
  has_bias: bool
  has_mask: bool
  interpret: bool = False


def _reference_impl(query, key, value, bias, mask, *, scale, spec, q_lengths, kv_lengths,
                    interpret):
  del interpret
  out, lse = reference.reference_attention(query, key, value, bias, mask, scale=scale, spec=spec,
                                           q_lengths=q_lengths, kv_lengths=kv_lengths)
  # The reference already gives fully masked rows jax.nn's values (its lse is finite there), so
  # the shared post-processing in the API leaves them as they are.
  return out, lse


def _no_bias_or_mask(name: str, bias, mask):
  if bias is not None or mask is not None:
    what = "bias" if bias is not None else "mask"
    raise NotImplementedError(
        f"implementation={name!r} does not support `{what}` yet; use implementation='reference' "
        f"or None (which picks it)")


def _blocked_jax_impl(query, key, value, bias, mask, *, scale, spec, q_lengths, kv_lengths,
                      interpret):
  del interpret
  _no_bias_or_mask("blocked_jax", bias, mask)
  return blocked_jax.attention(query, key, value, q_lengths, kv_lengths, scale=scale, spec=spec)


def _mosaic_gpu_impl(query, key, value, bias, mask, *, scale, spec, q_lengths, kv_lengths,
                     interpret):
  _no_bias_or_mask("mosaic_gpu", bias, mask)
  if interpret:
    interpreter_threads.warn_if_too_few()
  from pallas_attn.mosaic_gpu import ops  # imported lazily: it pulls in the Mosaic GPU lowering
  return ops.attention(query, key, value, q_lengths, kv_lengths, scale=scale, spec=spec,
                       interpret=interpret)


_IMPLEMENTATIONS = {
    "mosaic_gpu": _mosaic_gpu_impl,
    "blocked_jax": _blocked_jax_impl,
    "reference": _reference_impl,
}


@functools.cache
def _has_hopper_gpu() -> bool:
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return False
  return any(getattr(d, "compute_capability", "") == "9.0" for d in devices)


def mosaic_gpu_unsupported_reason(call: AttentionCall) -> str | None:
  """Why the Mosaic GPU kernels cannot serve `call` (None when they can)."""
  from pallas_attn.mosaic_gpu import config as mgpu_config
  if call.has_bias or call.has_mask:
    return "bias/mask are not supported by the Mosaic GPU kernels yet"
  if call.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"the Mosaic GPU kernels take bfloat16 or float16 inputs, got {call.dtype}"
  if call.head_dim not in mgpu_config.SUPPORTED_HEAD_DIMS:
    return (f"the Mosaic GPU kernels support head_dim in {mgpu_config.SUPPORTED_HEAD_DIMS}, "
            f"got {call.head_dim}")
  if not call.interpret and not _has_hopper_gpu():
    return ("no Hopper GPU (sm90) is visible to JAX; pass interpret=True to run the kernels in "
            "the Mosaic GPU interpreter on the CPU")
  return None


def choose(call: AttentionCall, implementation: str | None):
  """The implementation for `call`: the one asked for (checked), or the fastest that applies."""
  if implementation is not None:
    if implementation not in _IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {sorted(_IMPLEMENTATIONS)} or None; "
                       f"got {implementation!r}")
    if implementation == "mosaic_gpu":
      reason = mosaic_gpu_unsupported_reason(call)
      if reason is not None:
        raise ValueError(f"implementation='mosaic_gpu' cannot serve this call: {reason}")
    return _IMPLEMENTATIONS[implementation]
  if mosaic_gpu_unsupported_reason(call) is None:
    return _IMPLEMENTATIONS["mosaic_gpu"]
  if call.has_bias or call.has_mask:
    return _IMPLEMENTATIONS["reference"]
  return _IMPLEMENTATIONS["blocked_jax"]
