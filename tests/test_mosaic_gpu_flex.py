"""FlexAttention-style `mask_fn` / `score_fn` traced into the Mosaic GPU kernels (forward, dQ,
dK/dV), through `pallas_attn.attention(..., implementation="mosaic_gpu")`, against the dense
float32 reference (`implementation="reference"`, the same element functions on the whole grid):
out, lse and the three gradients with a random cotangent, at odd lengths, causal, GQA, with
batch-, head- and position-dependent functions and their composition with the soft-cap.

On the CPU the kernels run in the Mosaic GPU interpreter (short cases); the `gpu` tests compile
them on a Hopper GPU:
  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_flex.py
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import multidevice
from pallas_attn import dispatch
from pallas_attn import mask as mask_lib
from pallas_attn import sharding
from pallas_attn.mosaic_gpu import mods as mods_lib
from pallas_attn.mosaic_gpu import ops
from test_mosaic_gpu import _poison_allocator


# The user functions: index arithmetic only, as FlexAttention's mask_mod / score_mod.
def sliding_window(b, h, q_idx, kv_idx):
  return jnp.abs(q_idx - kv_idx) < 40


def documents(b, h, q_idx, kv_idx):  # packed documents of 50 positions
  return (q_idx // 50) == (kv_idx // 50)


def even_heads_see_all(b, h, q_idx, kv_idx):  # odd query heads: causal
  return (h % 2 == 0) | (kv_idx <= q_idx)


def first_batch_causal(b, h, q_idx, kv_idx):  # batch 0 causal, the others see everything
  return (b != 0) | (kv_idx <= q_idx)


def aligned_documents(b, h, q_idx, kv_idx):  # documents of 128: whole tiles inside one
  return (q_idx // 128) == (kv_idx // 128)


def head_windows(b, h, q_idx, kv_idx):  # query head h sees keys within 64 * (h + 1)
  return jnp.abs(q_idx - kv_idx) < 64 * (h + 1)


def relative_position(s, b, h, q_idx, kv_idx):
  return s + 0.05 * (q_idx - kv_idx).astype(jnp.float32) * (h + 1).astype(jnp.float32)


def halve_above_one(s, b, h, q_idx, kv_idx):  # jax.nn.relu: a custom_jvp, inlined in the kernels
  return s - 0.5 * jax.nn.relu(s - 1.0)


def tanh_cap(s, b, h, q_idx, kv_idx):  # a soft-cap whose strength depends on the batch
  cap = 2.0 + b.astype(jnp.float32)
  return cap * jnp.tanh(s / cap)


@dataclasses.dataclass(frozen=True)
class FlexCase:
  name: str
  batch: int
  q_len: int
  kv_len: int
  heads_q: int
  heads_kv: int
  mask_fn: Callable | None = None
  score_fn: Callable | None = None
  is_causal: bool = False
  soft_cap: float | None = None
  q_gain: float = 1.0  # multiplies q: larger logits, so that tanh saturates
  alibi: bool = False  # the geometric slopes 2^(-8 (h + 1) / H), constants
  alignment: str = "top_left"

  def at(self, q_len: int, kv_len: int) -> FlexCase:
    return dataclasses.replace(self, name=f"{self.name.rsplit('_', 1)[0]}_{q_len}x{kv_len}",
                               q_len=q_len, kv_len=kv_len)


_CASES = [
    FlexCase("window_kink_causal_77x150", 1, 77, 150, 2, 2, mask_fn=sliding_window,
             score_fn=halve_above_one, is_causal=True, q_gain=2.0),
    FlexCase("documents_relpos_gqa_77x150", 1, 77, 150, 4, 2, mask_fn=documents,
             score_fn=relative_position),
    FlexCase("heads_relpos_gqa_causal_77x150", 1, 77, 150, 4, 2, mask_fn=even_heads_see_all,
             score_fn=relative_position, is_causal=True),
    # score_fn before the soft-cap (API order): two tanh in a row, both saturating.
    FlexCase("batch_tanh_softcap_2x100x130", 2, 100, 130, 2, 1, mask_fn=first_batch_causal,
             score_fn=tanh_cap, soft_cap=2.5, q_gain=4.0),
    # Everything in the kernels at once: ALiBi before score_fn before the soft-cap, the causal
    # diagonal moved by the bottom-right offset while mask_fn and score_fn see plain positions.
    # Block skipping from mask_fn (`block_mask`): tiles of other documents are skipped, those
    # inside one are computed without any element mask (the forward's 64 x 128 tiles too).
    FlexCase("aligned_documents_relpos_gqa_300x333", 1, 300, 333, 4, 2,
             mask_fn=aligned_documents, score_fn=relative_position),
    # A window per query head: per-head forward / dQ tables, one dK/dV table per kv head (the
    # union of its group's).
    FlexCase("head_windows_gqa_causal_300x333", 1, 300, 333, 4, 2, mask_fn=head_windows,
             is_causal=True),
    FlexCase("all_bottom_right_gqa_77x150", 1, 77, 150, 4, 2, mask_fn=sliding_window,
             score_fn=relative_position, is_causal=True, soft_cap=5.0, q_gain=2.0, alibi=True,
             alignment="bottom_right"),
]


def _inputs(case: FlexCase, head_dim: int, seed: int):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (case.batch, case.q_len, case.heads_q, head_dim)) * case.q_gain
  kv_shape = (case.batch, case.kv_len, case.heads_kv, head_dim)
  k, v = (jax.random.normal(key, kv_shape) for key in keys[1:3])
  do = jax.random.normal(keys[3], q.shape)
  return tuple(x.astype(jnp.bfloat16) for x in (q, k, v, do))


@functools.partial(jax.jit, static_argnames=("case", "implementation", "interpret"))
def _outputs(q, k, v, do, *, case: FlexCase, implementation: str, interpret: bool):
  slopes = None
  if case.alibi:
    slopes = 2.0 ** (-8.0 * (jnp.arange(case.heads_q) + 1) / case.heads_q)

  def f(q, k, v):
    return pallas_attn.attention(q, k, v, is_causal=case.is_causal, mask_fn=case.mask_fn,
                                 score_fn=case.score_fn, logits_soft_cap=case.soft_cap,
                                 alibi_slopes=slopes, causal_alignment=case.alignment,
                                 implementation=implementation, interpret=interpret,
                                 return_residual=True)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return (out, lse, *vjp((do, jnp.zeros_like(lse))))


def _check(case: FlexCase, seed: int, *, interpret: bool, head_dim: int = 64):
  q, k, v, do = _inputs(case, head_dim, seed)
  got = _outputs(q, k, v, do, case=case, implementation="mosaic_gpu", interpret=interpret)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = _outputs(*up, case=case, implementation="reference", interpret=False)
  failures = []
  for name, g, w in zip(("out", "lse", *cases.QUANTITIES[1:]), got, want):
    g = np.asarray(g, np.float32)
    if not np.isfinite(g).all():
      failures.append(f"{name}: {np.sum(~np.isfinite(g))} non-finite values")
      continue
    err = cases.rel_err(g, w)
    tol = 1e-4 if name == "lse" else cases.TOLERANCES[cases.BF16][name]
    if not err <= tol:
      failures.append(f"{name}: rel err {err:.3e} > {tol:.1e}")
  assert not failures, f"{case.name} (d{head_dim}): " + "; ".join(failures)


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter.


@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
def test_interpreted_flex_matches_reference(case, seed):
  _check(case, seed, interpret=True)


@functools.partial(jax.jit, static_argnames=("case",))
def _compiled_kernels_vjp(q, k, v, do, *, case: FlexCase):
  """The kernels for the GPU (`ops.attention`, no interpreter), differentiated."""
  slopes = None
  if case.alibi:
    slopes = 2.0 ** (-8.0 * (jnp.arange(case.heads_q) + 1) / case.heads_q)
  spec = mask_lib.MaskSpec(is_causal=case.is_causal, offset=mask_lib.alignment_offset(
      case.alignment, q.shape[1], k.shape[1]))

  def f(q, k, v):
    return ops.attention(q, k, v, None, None, scale=q.shape[-1] ** -0.5, spec=spec,
                         logits_soft_cap=case.soft_cap, alibi_slopes=slopes,
                         mask_fn=case.mask_fn, score_fn=case.score_fn)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return out, lse, vjp((do, jnp.zeros_like(lse)))


@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
def test_flex_kernels_lower_for_cuda(case):
  """The Pallas -> Mosaic GPU lowering of the traced user functions (forward, dQ, dK/dV) runs on
  the CPU: it rejects ops and layouts the interpreter lets pass. Compiling to PTX needs the GPU
  (the `gpu` tests)."""
  args = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs(case, 64, 0))
  lowered = _compiled_kernels_vjp.trace(*args, case=case).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("mosaic_gpu") >= 3  # forward, dQ, dK/dV


# ---------------------------------------------------------------------------------------------
# Sharded: the kernels of a batch/head shard must pass the user's functions global indices. The
# kernels cannot run on several devices in the interpreter; a stand-in pass that writes the index
# operands it is given into its output checks that `sharding.batch_head_parallel` hands every
# shard the indices of its own global batch elements and query heads.


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=lambda t: t.name.lower())
def test_sharded_passes_get_global_indices(axis_type):
  batch, q_len, heads_q, heads_kv, head_dim = 4, 8, 4, 2, 16
  mesh = multidevice.cpu_mesh((2, 2), ("data", "model"), axis_type)
  q = jnp.zeros((batch, q_len, heads_q, head_dim), jnp.float32)
  k = jnp.zeros((batch, q_len, heads_kv, head_dim), jnp.float32)
  _, arrays = mods_lib.from_arguments(q, k, None, None, None, None, mask_fn=documents)

  def stand_in(q, k, v, q_lengths, kv_lengths, *mod_arrays):
    mod_arrays = mods_lib.ModArrays(*mod_arrays)
    index = 10 * mod_arrays.batch_index[:, None] + mod_arrays.head_index[None, :]  # [B, Hq]
    index = index.astype(jnp.float32)
    out = q + index[:, None, :, None]
    return out, jnp.broadcast_to(index[:, :, None], (q.shape[0], q.shape[2], q.shape[1]))

  def run(q, k, batch_index, head_index):
    operands = (q, k, k, None, None,
                *arrays._replace(batch_index=batch_index, head_index=head_index))
    return sharding.batch_head_parallel(stand_in, sharding.FORWARD, *operands)

  want = stand_in(q, k, k, None, None, *arrays)
  qs, ks = (jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))) for x in (q, k))
  got = jax.jit(run)(qs, ks, arrays.batch_index, arrays.head_index)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ---------------------------------------------------------------------------------------------
# Functions the kernels cannot take: the automatic choice falls back to the portable path, the
# explicit one refuses.

_TABLE = jnp.asarray([3, 1, 4, 1, 5], jnp.int32)


def _closes_over_array(b, h, q_idx, kv_idx):
  return kv_idx <= q_idx + _TABLE[h % 5]


def test_closed_over_array_picks_blocked_jax_or_refuses():
  q = jax.random.normal(jax.random.key(0), (1, 70, 2, 64), jnp.bfloat16)
  call = dict(mask_fn=_closes_over_array, interpret=True)
  problem = dispatch.element_fns_problem(_closes_over_array, None)
  assert problem is not None and "closes over arrays (int32[5])" in problem
  with pytest.raises(NotImplementedError, match=r"mosaic_gpu.*mask_fn.*closes over arrays"):
    pallas_attn.attention(q, q, q, implementation="mosaic_gpu", **call)
  got = pallas_attn.attention(q, q, q, **call)  # auto: the portable path
  want = pallas_attn.attention(q, q, q, implementation="blocked_jax", **call)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("mask_fn,score_fn,problem", [
    (lambda b, h, i, j: jax.lax.population_count(i) > 2, None,
     r"mask_fn uses population_count, which the Mosaic GPU lowering does not implement"),
    (None, lambda s, b, h, i, j: s + jax.lax.erf_inv(s / 100.0),
     r"score_fn uses erf_inv, which the Mosaic GPU lowering does not implement"),
    (lambda b, h, i, j: h[:, 0] > i, None,
     r"mask_fn cannot be traced on a kernel tile.*IndexError"),
    # Rank 4 on the API's index arrays (accepted there), rank 4 on a kernel's 2-D tile too.
    (lambda b, h, i, j: jnp.reshape(i >= j, (1, 1, *(i >= j).shape[-2:])), None,
     r"mask_fn returned shape \(1, 1, 64, 64\) on a \[64, 64\] tile"),
], ids=["primitive_without_lowering", "score_fn_primitive", "indexes_scalar_head",
        "rank_4_result"])
def test_untraceable_functions_are_refused(mask_fn, score_fn, problem):
  """Each reason the kernels cannot take a function is named; the explicit choice raises it."""
  assert re.search(problem, dispatch.element_fns_problem(mask_fn, score_fn))
  q = jnp.zeros((1, 70, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=problem):
    jax.eval_shape(functools.partial(pallas_attn.attention, mask_fn=mask_fn, score_fn=score_fn,
                                     implementation="mosaic_gpu", interpret=True), q, q, q)


def test_traceable_functions_pass_the_kernel_check():
  for case in _CASES:
    assert dispatch.element_fns_problem(case.mask_fn, case.score_fn) is None, case.name


# ---------------------------------------------------------------------------------------------
# GPU: real compilation on a Hopper GPU.


def _gpu_params():
  params = []
  for head_dim in (128, 64):
    for case in _CASES:
      for c in (case, case.at(1000, 1000)):
        params.append(pytest.param(c, head_dim, id=f"{c.name}-d{head_dim}"))
  return params


@pytest.mark.gpu
@pytest.mark.parametrize("case,head_dim", _gpu_params())
def test_gpu_flex_matches_reference(case, head_dim, seed):
  _poison_allocator(64 << 20)
  _check(case, seed, interpret=False, head_dim=head_dim)
