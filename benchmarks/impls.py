"""The implementations compared, by name, and the two functions each one is timed as.

Every implementation is a callable `attend(q, k, v, *, is_causal)` on [batch, seq, heads,
head_dim] arrays; on the masked shapes it also gets `window` (local_window_size=(window, 0)) and
`segment_len` (packed documents: pallas_attn gets segment ids, jax.nn and tokamax, which have none,
a dense boolean mask). The sweep times it as
  fwd:     (q, k, v) -> out
  fwd_bwd: (q, k, v, d_out) -> (dq, dk, dv), through `jax.vjp` with a random cotangent d_out,
and checks both against the float32 reference (`pallas_attn.reference_attention` on upcast inputs).

tokamax is optional: when `import tokamax` fails its entries stay in the registry with the
import error as the reason they cannot run, so results files say why they are missing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

import pallas_attn
from benchmarks.shapes import Shape

NAMES = (
    "pallas_attn:mosaic_gpu",
    "pallas_attn:mosaic_gpu_mask_fn",
    # The Mosaic GPU kernels with deterministic_backward=True (dQ from its own kernel): what
    # bitwise-repeatable gradients cost. Its forward is the default's.
    "pallas_attn:mosaic_gpu_deterministic",
    "pallas_attn:blocked_jax",
    "pallas_attn:reference",
    "jax_xla",
    "jax_cudnn",
    "tokamax_mosaic",
    "tokamax_triton",
)

# What runs by default on each platform. cudnn and tokamax need an NVIDIA GPU; on the CPU the
# Mosaic GPU kernels run in the Pallas interpreter.
DEFAULT_NAMES = {
    "gpu": tuple(n for n in NAMES if n != "pallas_attn:mosaic_gpu_deterministic"),
    "cpu": ("pallas_attn:mosaic_gpu", "pallas_attn:blocked_jax", "pallas_attn:reference",
            "jax_xla"),
}

# The interpreter runs a kernel's every thread in Python-driven XLA code: only the smallest CPU
# shape is worth its minutes.
INTERPRET_MAX_SCORES = 2 * 128 * 128


@dataclasses.dataclass(frozen=True)
class Impl:
  name: str
  attend: Callable | None  # (q, k, v, *, is_causal) -> out; None when unavailable
  unavailable: str | None = None  # why it cannot run here
  interpret: bool = False  # runs in the Pallas interpreter (slow: few iterations, small shapes)
  portable: bool = False  # a portable or dense path: on the GPU swept on a subset (see `wanted`)
  version: str | None = None


@functools.cache
def _tokamax():
  """(module, None) or (None, why it cannot be imported)."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except  (any failure means "not available")
    return None, f"tokamax is not importable: {type(e).__name__}: {e}"
  return tokamax, None


def _window(window: int | None):
  return None if window is None else (window, 0)


def _document_ids(seq: int, segment_len: int) -> jax.Array:
  """int32 [seq] document ids, built inside the timed function (an iota: no extra argument)."""
  return jnp.arange(seq, dtype=jnp.int32) // segment_len


def _document_mask(seq: int, segment_len: int | None) -> jax.Array | None:
  """bool [1, 1, seq, seq]: query and key in the same document (for APIs without segment ids)."""
  if segment_len is None:
    return None
  ids = _document_ids(seq, segment_len)
  return (ids[:, None] == ids[None, :])[None, None]


def _pallas_attn(implementation: str, interpret: bool, deterministic_backward: bool = False):
  def attend(q, k, v, *, is_causal, window=None, segment_len=None):
    ids = None
    if segment_len is not None:
      ids = jnp.broadcast_to(_document_ids(q.shape[1], segment_len), q.shape[:2])
    return pallas_attn.attention(q, k, v, is_causal=is_causal, implementation=implementation,
                                 interpret=interpret, local_window_size=_window(window),
                                 segment_ids=ids, deterministic_backward=deterministic_backward)
  return attend


def _pallas_attn_mask_fn(interpret: bool):
  """The Mosaic GPU kernels with the masked shapes' window and documents written as one
  FlexAttention-style mask_fn instead of local_window_size / segment_ids: what the block tables
  built from mask_fn (`mosaic_gpu.block_mask`) skip, against the native arguments' skipping."""
  def attend(q, k, v, *, is_causal, window=None, segment_len=None):
    def mask_fn(b, h, q_idx, kv_idx):
      keep = []
      if window is not None:
        keep.append(q_idx - kv_idx <= window)
      if segment_len is not None:
        keep.append(q_idx // segment_len == kv_idx // segment_len)
      return functools.reduce(jnp.logical_and, keep)

    masked = window is not None or segment_len is not None
    return pallas_attn.attention(q, k, v, is_causal=is_causal, implementation="mosaic_gpu",
                                 interpret=interpret, mask_fn=mask_fn if masked else None)
  return attend


def _jax_nn(implementation: str):
  def attend(q, k, v, *, is_causal, window=None, segment_len=None):
    return jax.nn.dot_product_attention(q, k, v, mask=_document_mask(q.shape[1], segment_len),
                                        is_causal=is_causal, local_window_size=_window(window),
                                        implementation=implementation)
  return attend


def _tokamax_impl(name: str, implementation: str) -> Impl:
  tokamax, why = _tokamax()
  if tokamax is None:
    return Impl(name, None, unavailable=why)

  def attend(q, k, v, *, is_causal, window=None, segment_len=None):
    masking = {}  # only what the call needs: an older tokamax may lack an argument
    if window is not None:
      masking["local_window_size"] = _window(window)
    if segment_len is not None:
      masking["mask"] = _document_mask(q.shape[1], segment_len)
    return tokamax.dot_product_attention(q, k, v, is_causal=is_causal,
                                         implementation=implementation, **masking)
  return Impl(name, attend, version=getattr(tokamax, "__version__", None))


def get(name: str, platform: str) -> Impl:
  """The implementation called `name` (a full name from NAMES, or its unique suffix, e.g.
  "blocked_jax" or "cudnn") on `platform` ("cpu" or "gpu")."""
  name = resolve(name)
  on_cpu = platform == "cpu"
  if name == "pallas_attn:mosaic_gpu_mask_fn":
    return Impl(name, _pallas_attn_mask_fn(on_cpu), interpret=on_cpu,
                version=pallas_attn.__version__)
  if name == "pallas_attn:mosaic_gpu_deterministic":
    return Impl(name, _pallas_attn("mosaic_gpu", on_cpu, deterministic_backward=True),
                interpret=on_cpu, version=pallas_attn.__version__)
  if name.startswith("pallas_attn:"):
    which = name.split(":", 1)[1]
    interpret = on_cpu and which == "mosaic_gpu"
    return Impl(name, _pallas_attn(which, interpret), interpret=interpret,
                portable=which != "mosaic_gpu", version=pallas_attn.__version__)
  if name == "jax_xla":
    return Impl(name, _jax_nn("xla"), version=jax.__version__)
  if name == "jax_cudnn":
    return Impl(name, _jax_nn("cudnn"), version=jax.__version__)
  return _tokamax_impl(name, name.removeprefix("tokamax_"))


def resolve(name: str) -> str:
  if name in NAMES:
    return name
  matches = [n for n in NAMES if n.split(":")[-1] == name or n.endswith("_" + name)]
  if len(matches) != 1:
    raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(NAMES)}")
  return matches[0]


def wanted(impl: Impl, shape: Shape, platform: str) -> bool:
  """Whether the default plan measures `impl` at `shape` (--all-pairs measures every pair).

  The interpreter gets only the smallest shapes. On the GPU the portable paths (the blocked pure
  JAX path and the dense reference) are measured on the FlashAttention sweep at head_dim 128 only:
  they are there to show the gap to the kernels, and the whole grid would add a third to the
  sweep's time.
  """
  if impl.name == "pallas_attn:mosaic_gpu_mask_fn":  # only the masked shapes have a mask_fn
    return shape.family == "masked" and (not impl.interpret
                                         or shape.score_elements <= INTERPRET_MAX_SCORES)
  if impl.interpret:
    return shape.score_elements <= INTERPRET_MAX_SCORES
  if impl.portable and platform != "cpu":
    return shape.family == "fa" and shape.head_dim == 128
  return True


# ---- the timed functions and their inputs --------------------------------------------------


def fwd_fn(attend, causal: bool, masking: dict | None = None):
  return lambda q, k, v: attend(q, k, v, is_causal=causal, **(masking or {}))


def fwd_bwd_fn(attend, causal: bool, masking: dict | None = None):
  def fwd_bwd(q, k, v, d_out):
    _, vjp = jax.vjp(fwd_fn(attend, causal, masking), q, k, v)
    return vjp(d_out)
  return fwd_bwd


def timed_fn(attend, shape: Shape, pass_: str):
  return (fwd_fn if pass_ == "fwd" else fwd_bwd_fn)(attend, shape.causal, shape.masking)


def arg_specs(shape: Shape, pass_: str, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
  """Abstract arguments of the timed function (compiling needs no data)."""
  q = jax.ShapeDtypeStruct((shape.batch, shape.seq_q, shape.heads_q, shape.head_dim), dtype)
  kv = jax.ShapeDtypeStruct((shape.batch, shape.seq_kv, shape.heads_kv, shape.head_dim), dtype)
  return (q, kv, kv) if pass_ == "fwd" else (q, kv, kv, q)


def random_inputs(shape: Shape, dtype, seed: int):
  """Fresh standard-normal q, k, v and cotangent d_out (generated on the device)."""
  specs = arg_specs(shape, "fwd_bwd", dtype)
  keys = jax.random.split(jax.random.key(seed), len(specs))
  return tuple(jax.random.normal(key, s.shape, s.dtype) for key, s in zip(keys, specs))


def reference_fns(shape: Shape):
  """The float32 oracle: (fwd, fwd_bwd) over float32 copies of the inputs."""
  def attend(q, k, v, *, is_causal, window=None, segment_len=None):
    # Packed documents as a dense mask: an oracle independent of the segment-id paths.
    spec = pallas_attn.MaskSpec(is_causal=is_causal, local_window=_window(window))
    mask = _document_mask(q.shape[1], segment_len)
    out, _ = pallas_attn.reference_attention(q, k, v, mask=mask, spec=spec,
                                             scale=1 / math.sqrt(shape.head_dim))
    return out

  def upcast(fn):
    return lambda *args: fn(*(a.astype(jnp.float32) for a in args))
  return (upcast(fwd_fn(attend, shape.causal, shape.masking)),
          upcast(fwd_bwd_fn(attend, shape.causal, shape.masking)))
