"""The two passes of one implementation over a chunk of queries and a chunk of keys.

Context parallelism (`pallas_attn.ring`) computes attention piecewise: each device runs the forward
pass of its queries against one key/value chunk at a time and merges the partial results by their
log-sum-exp, then runs the backward pass of each chunk pair from the *global* lse and delta. It
needs, from an implementation, exactly the non-differentiable `forward` and `backward` that
`blocked_jax` and `mosaic_gpu.ops` expose (and build their own custom_vjp from).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from pallas_attn import blocked_jax
from pallas_attn import dispatch
from pallas_attn import interpreter_threads
from pallas_attn import mask as mask_lib

ChunkImplementation = Literal["mosaic_gpu", "blocked_jax"]


@dataclasses.dataclass(frozen=True)
class ChunkKernels:
  """One implementation's passes on one device's arrays (hashable: a static configuration).

  Shapes: q, d_out [B, T, Hq, D]; k, v [B, S, Hkv, D]; lse, delta [B, Hq, T] float32 (+inf lse on
  rows that see no key); lengths int32 [B]: the chunk's rows and keys at or past them take no part.
  """

  implementation: ChunkImplementation
  interpret: bool = False
  # The Mosaic GPU backward with dQ from its own kernel (`attention`'s deterministic_backward).
  deterministic_backward: bool = False

  def forward(self, q, k, v, q_lengths, kv_lengths, *, scale: float, is_causal: bool):
    """(out [B, T, Hq, D] float32, lse [B, Hq, T] float32) of q against this chunk's keys."""
    spec = mask_lib.MaskSpec(is_causal=is_causal)
    if self.implementation == "blocked_jax":
      return blocked_jax.forward(q, k, v, q_lengths, kv_lengths, scale=scale, spec=spec)
    from pallas_attn.mosaic_gpu import ops  # lazily, as dispatch does: the Mosaic GPU lowering
    out, lse = ops.forward(q, k, v, q_lengths, kv_lengths, scale=scale, spec=spec,
                           interpret=self.interpret)
    return out.astype(jnp.float32), lse

  def backward(self, q, k, v, d_out, lse, delta, q_lengths, kv_lengths, *, scale: float,
               is_causal: bool):
    """(dq, dk, dv) of this chunk pair, in the input dtype; lse and delta are the global ones."""
    spec = mask_lib.MaskSpec(is_causal=is_causal)
    if self.implementation == "blocked_jax":
      return blocked_jax.backward(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, scale=scale,
                                  spec=spec)
    from pallas_attn.mosaic_gpu import ops
    return ops.backward(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, scale=scale, spec=spec,
                        interpret=self.interpret, deterministic=self.deterministic_backward)


def select(implementation: str | None, call: dispatch.AttentionCall, *,
           deterministic_backward: bool = False) -> ChunkKernels:
  """The kernels for `call` (one device's chunk shapes): the ones asked for (checked), or the
  Mosaic GPU kernels where they support the call, else the portable blocked path."""
  if implementation not in (None, "mosaic_gpu", "blocked_jax"):
    raise ValueError(f"ring attention runs implementation 'mosaic_gpu', 'blocked_jax' or None; "
                     f"got {implementation!r}")
  reason = dispatch.mosaic_gpu_unsupported_reason(call)
  if implementation == "mosaic_gpu" and reason is not None:
    raise ValueError(f"implementation='mosaic_gpu' cannot serve this call: {reason}")
  if implementation is None:
    implementation = "mosaic_gpu" if reason is None else "blocked_jax"
  if implementation == "mosaic_gpu" and call.interpret:
    interpreter_threads.warn_if_too_few()
  return ChunkKernels(implementation, interpret=call.interpret,
                      deterministic_backward=bool(deterministic_backward))
