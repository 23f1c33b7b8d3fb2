"""Which implementation serves a call, and the uniform calling convention they share.

Every implementation is called as
  impl(query, key, value, arrays, *, scale, spec, mods, q_lengths, kv_lengths, interpret,
       deterministic_backward)
with `arrays` a `score_mods.ScoreArrays` (the dynamic bias, mask, segment ids, ALiBi slopes and
dropout seed, None where absent), `spec` the positional `mask.MaskSpec` and `mods` the static
`score_mods.ScoreMods`, and returns (out [batch, q_len, heads_q, head_dim] in the input dtype,
lse [batch, heads_q, q_len] float32 with +inf on rows that saw no key); see `numerics`.

Each implementation declares the optional features it serves (`SUPPORTED_FEATURES`); asking one
explicitly for a feature it lacks raises NotImplementedError, and `implementation=None` only picks
an implementation that serves every feature of the call.
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
  has_segment_ids: bool = False
  bottom_right: bool = False  # causal_alignment="bottom_right" on a causal or windowed call
  has_alibi: bool = False
  alibi_per_batch: bool = False  # alibi_slopes of shape (batch, heads_q) with batch > 1
  has_soft_cap: bool = False
  has_dropout: bool = False
  has_mask_fn: bool = False
  has_score_fn: bool = False
  # Why mask_fn / score_fn cannot be traced into the Mosaic GPU kernels (they close over arrays,
  # or use a primitive the lowering lacks: `element_fns_problem`); None when they can or are
  # absent.
  element_fns_problem: str | None = None

  def features(self) -> tuple[str, ...]:
    """The optional features this call uses, named as `attention`'s arguments."""
    flags = dict(bias=self.has_bias, mask=self.has_mask, segment_ids=self.has_segment_ids,
                 causal_alignment=self.bottom_right, alibi_slopes=self.has_alibi,
                 alibi_slopes_per_batch=self.alibi_per_batch,
                 logits_soft_cap=self.has_soft_cap, dropout_rate=self.has_dropout,
                 mask_fn=self.has_mask_fn, score_fn=self.has_score_fn)
    return tuple(name for name, used in flags.items() if used)


_ALL_FEATURES = frozenset(("bias", "mask", "segment_ids", "causal_alignment", "alibi_slopes",
                           "alibi_slopes_per_batch", "logits_soft_cap", "dropout_rate", "mask_fn",
                           "score_fn"))
# The optional features each implementation serves. The Mosaic GPU kernels take their masking
# from `mask.py` (block ranges and `tile_mask` -> `mask.visible`), which folds the alignment
# offset in; segment ids, one ALiBi slope per query head (constants there: differentiating them
# raises, see `mosaic_gpu.mods.constant_slopes`), the soft-cap and dropout (the keep-mask
# regenerated per tile from the same hash as the portable path; verified on an H200 by
# tests/test_mosaic_gpu_dropout.py's `gpu` tests) are computed in the kernels (`mosaic_gpu.mods`),
# and so are a bias (differentiable: a dbias kernel reduces its gradient to its own broadcast
# shape) and a boolean mask, read tile by tile from their [batch|1, heads_q|1, q_len|1, kv_len|1]
# arrays. mask_fn / score_fn are traced into the kernels when they can be (pure functions of the
# indices and the score: `AttentionCall.element_fns_problem` says when not, and then only the
# portable path serves the call).
SUPPORTED_FEATURES = {
    "mosaic_gpu": frozenset(("bias", "mask", "causal_alignment", "segment_ids", "alibi_slopes",
                             "logits_soft_cap", "dropout_rate", "mask_fn", "score_fn")),
    "blocked_jax": _ALL_FEATURES,
    "reference": _ALL_FEATURES,
}


def element_fns_problem(mask_fn, score_fn) -> str | None:
  """Why mask_fn / score_fn cannot run inside the Mosaic GPU kernels (None: they can, or there
  are none). Traces them abstractly; cheap, and only done when one is given."""
  if mask_fn is None and score_fn is None:
    return None
  from pallas_attn.mosaic_gpu import mods  # imported lazily: it pulls in the Mosaic GPU lowering
  return mods.element_fns_problem(mask_fn, score_fn)


def unsupported_features(call: AttentionCall, implementation: str) -> tuple[str, ...]:
  """The features of `call` that `implementation` does not serve (empty when it serves all)."""
  return tuple(f for f in call.features() if f not in SUPPORTED_FEATURES[implementation])


def _reference_impl(query, key, value, arrays, *, scale, spec, mods, q_lengths, kv_lengths,
                    interpret, deterministic_backward):
  # (jnp only: as deterministic as XLA is; see `attention`'s deterministic_backward.)
  del interpret, deterministic_backward
  out, lse = reference.reference_attention(query, key, value, scale=scale, spec=spec,
                                           q_lengths=q_lengths, kv_lengths=kv_lengths,
                                           mods=mods, arrays=arrays)
  # The reference already gives fully masked rows jax.nn's values (its lse is finite there), so
  # the shared post-processing in the API leaves them as they are.
  return out, lse


def _blocked_jax_impl(query, key, value, arrays, *, scale, spec, mods, q_lengths, kv_lengths,
                      interpret, deterministic_backward):
  # (Its backward sums in loops of a fixed order: as deterministic as XLA is.)
  del interpret, deterministic_backward
  return blocked_jax.attention(query, key, value, q_lengths, kv_lengths, arrays, scale=scale,
                               spec=spec, mods=mods)


def _mosaic_gpu_impl(query, key, value, arrays, *, scale, spec, mods, q_lengths, kv_lengths,
                     interpret, deterministic_backward):
  # `choose` refuses this before tracing; kept here so that no path can drop it silently.
  slopes = arrays.alibi_slopes
  if slopes is not None and slopes.shape[0] != 1:
    raise NotImplementedError("implementation='mosaic_gpu' does not support per-batch ALiBi "
                              "slopes yet")
  if interpret:
    interpreter_threads.warn_if_too_few()
  from pallas_attn.mosaic_gpu import ops  # imported lazily: it pulls in the Mosaic GPU lowering
  return ops.attention(query, key, value, q_lengths, kv_lengths, scale=scale, spec=spec,
                       interpret=interpret, logits_soft_cap=mods.logits_soft_cap,
                       q_segment_ids=arrays.q_segment_ids, kv_segment_ids=arrays.kv_segment_ids,
                       alibi_slopes=None if slopes is None else slopes[0],
                       dropout_rate=mods.dropout_rate,
                       dropout_seed=arrays.dropout_seed if mods.dropout_rate > 0.0 else None,
                       broadcast_dropout=mods.broadcast_dropout,
                       mask_fn=mods.mask_fn, score_fn=mods.score_fn, bias=arrays.bias,
                       mask=arrays.mask, deterministic_backward=deterministic_backward)


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
  missing = unsupported_features(call, "mosaic_gpu")
  if missing:
    return f"the Mosaic GPU kernels do not support {', '.join(missing)} yet"
  if call.element_fns_problem is not None:
    return f"the Mosaic GPU kernels cannot trace mask_fn / score_fn: {call.element_fns_problem}"
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
  """The implementation for `call`: the one asked for (checked), or the fastest that applies.

  Raises NotImplementedError when the one asked for lacks a feature of the call (or, for
  mosaic_gpu, cannot trace its mask_fn / score_fn), ValueError when
  the Mosaic GPU kernels cannot run it (dtype, head_dim, no Hopper GPU)."""
  if implementation is not None:
    if implementation not in _IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {sorted(_IMPLEMENTATIONS)} or None; "
                       f"got {implementation!r}")
    missing = unsupported_features(call, implementation)
    if missing:
      raise NotImplementedError(
          f"implementation={implementation!r} does not support {', '.join(missing)}; use "
          f"implementation='blocked_jax' (any backend, O(N) memory) or None, which picks an "
          f"implementation that does")
    if implementation == "mosaic_gpu" and call.element_fns_problem is not None:
      raise NotImplementedError(
          f"implementation='mosaic_gpu' cannot trace mask_fn / score_fn into its kernels: "
          f"{call.element_fns_problem}; use implementation='blocked_jax' or None, which serve "
          f"any mask_fn / score_fn")
    if implementation == "mosaic_gpu":
      reason = mosaic_gpu_unsupported_reason(call)
      if reason is not None:
        raise ValueError(f"implementation='mosaic_gpu' cannot serve this call: {reason}")
    return _IMPLEMENTATIONS[implementation]
  if mosaic_gpu_unsupported_reason(call) is None:
    return _IMPLEMENTATIONS["mosaic_gpu"]
  return _IMPLEMENTATIONS["blocked_jax"]  # serves every feature
