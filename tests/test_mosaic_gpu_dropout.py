"""Attention-weight dropout inside the Mosaic GPU kernels (forward, dQ, dK/dV) against the
portable path (`implementation="blocked_jax"`, float32), which draws its keep-mask from the same
hash (`pallas_attn.dropout`): the kernels regenerate it per tile and must agree bit for bit, so
out, lse and the three gradients (random cotangent) agree to bf16 tolerances.

`pallas_attn.mosaic_gpu.ops.attention` is called directly, and once through `pallas_attn.attention`
(the dispatcher routes dropout to the kernels: `implementation=None` on a Hopper GPU, or
"mosaic_gpu"). The `gpu` tests compile the kernels on a Hopper GPU:
  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_dropout.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import cases
import multidevice
import pallas_attn
from pallas_attn import dropout
from pallas_attn import mask as mask_lib
from pallas_attn import sharding
from pallas_attn.mosaic_gpu import mods as mods_lib
from pallas_attn.mosaic_gpu import ops
from test_mosaic_gpu import _poison_allocator

RATE = 0.3

# (batch, q_len, kv_len, heads_q, heads_kv, is_causal, broadcast_dropout)
_CASES = {
    # Odd lengths: padded rows and keys, a key tile straddling the length; GQA: the dK/dV kernel
    # regenerates the mask of every query head of its group.
    "gqa_causal_77x150": (1, 77, 150, 4, 2, True, False),
    # One mask for every (batch, head): batch and head hashed as 0.
    "broadcast_2x2_100x130": (2, 100, 130, 2, 2, False, True),
}


@functools.partial(jax.jit, static_argnames=("is_causal", "broadcast", "interpret"))
def _kernel_outputs(q, k, v, do, key, *, is_causal, broadcast, interpret):
  def f(q, k, v):
    return ops.attention(q, k, v, None, None, scale=1.0 / np.sqrt(q.shape[-1]),
                         spec=mask_lib.MaskSpec(is_causal=is_causal), interpret=interpret,
                         dropout_rate=RATE, dropout_seed=dropout.seed_from_key(key),
                         broadcast_dropout=broadcast)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  # lse [B, Hq, T] -> [B, T, Hq], as the API returns it.
  return (out, jnp.swapaxes(lse, 1, 2), *vjp((do, jnp.zeros_like(lse))))


@functools.partial(jax.jit, static_argnames=("is_causal", "broadcast"))
def _portable_outputs(q, k, v, do, key, *, is_causal, broadcast):
  def f(q, k, v):
    return pallas_attn.attention(q, k, v, is_causal=is_causal, implementation="blocked_jax",
                                 dropout_rate=RATE, dropout_rng=key,
                                 broadcast_dropout=broadcast, return_residual=True)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return (out, lse, *vjp((do, jnp.zeros_like(lse))))


def _inputs(batch, q_len, kv_len, heads_q, heads_kv, head_dim, seed):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (batch, q_len, heads_q, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, kv_len, heads_kv, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, kv_len, heads_kv, head_dim), jnp.bfloat16)
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  return q, k, v, do, keys[4]


def _check(batch, q_len, kv_len, heads_q, heads_kv, is_causal, broadcast, *, seed, interpret,
           head_dim=64):
  q, k, v, do, key = _inputs(batch, q_len, kv_len, heads_q, heads_kv, head_dim, seed)
  static = dict(is_causal=is_causal, broadcast=broadcast)
  got = _kernel_outputs(q, k, v, do, key, interpret=interpret, **static)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = _portable_outputs(*up, key, **static)
  failures = []
  for name, g, w in zip(("out", "lse", *cases.QUANTITIES[1:]), got, want):
    err = cases.rel_err(g, w)  # NaN (fails) on any non-finite entry
    if not err < (1e-4 if name == "lse" else 2e-2):
      failures.append(f"{name}: rel err {err:.3e}")
  assert not failures, "; ".join(failures)


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter.


@pytest.mark.parametrize("name", list(_CASES))
def test_interpreted_dropout_matches_portable(name, seed):
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  _check(*_CASES[name], seed=seed, interpret=True)
  assert interpret_pallas_call.get_races().races_found is False


def test_interpreted_dropout_in_the_overlapped_forward(seed):
  """The table's head_dim 128 forward (`overlap_qk`) drops tile j's weights while tile j - 1's
  P V runs: the regenerated keep-mask must meet the right tile."""
  from pallas_attn.mosaic_gpu import config as config_lib
  assert config_lib.kernel_config(128, "fwd").overlap_qk
  _check(*_CASES["gqa_causal_77x150"], seed=seed, interpret=True, head_dim=128)


def _api_outputs(q, k, v, do, key, implementation, interpret):
  def f(q, k, v):
    return pallas_attn.attention(q, k, v, is_causal=True, implementation=implementation,
                                 interpret=interpret, dropout_rate=RATE, dropout_rng=key,
                                 return_residual=True)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return (out, lse, *vjp((do, jnp.zeros_like(lse))))


def _check_api(implementation, *, interpret, q_len, kv_len, head_dim):
  q, k, v, do, key = _inputs(1, q_len, kv_len, 2, 1, head_dim, 3)
  got = jax.jit(functools.partial(_api_outputs, implementation=implementation,
                                  interpret=interpret))(q, k, v, do, key)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = _portable_outputs(*up, key, is_causal=True, broadcast=False)
  for name, g, w in zip(("out", "lse", *cases.QUANTITIES[1:]), got, want):
    assert cases.rel_err(g, w) < (1e-4 if name == "lse" else 2e-2), name


def test_attention_routes_dropout_to_the_kernels():
  """Through the API: dispatch serves dropout with the kernels (interpreted here)."""
  from pallas_attn import dispatch
  call = dispatch.AttentionCall(batch=1, q_len=70, kv_len=90, heads_q=2, heads_kv=1, head_dim=64,
                                dtype=jnp.dtype(jnp.bfloat16), has_bias=False, has_mask=False,
                                interpret=True, has_dropout=True)
  assert dispatch.choose(call, None) is dispatch._IMPLEMENTATIONS["mosaic_gpu"]
  _check_api("mosaic_gpu", interpret=True, q_len=70, kv_len=90, head_dim=64)


@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256: dV and dK in two launches
def test_dropout_kernels_lower_for_cuda(head_dim):
  """The real Pallas -> Mosaic GPU lowering of the three kernels with dropout (the uint32 hash in
  the WGMMA layout, the prefix read from GMEM), which the interpreter does not exercise."""
  q, k, v, do, key = _inputs(1, 77, 150, 4, 2, head_dim, 0)
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, do)]
  lowered = _kernel_outputs.trace(*args, key, is_causal=True, broadcast=False,
                                  interpret=False).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("mosaic_gpu") >= 3  # forward, dQ, dK/dV (or dV and dK)


def test_dropout_arguments_are_checked():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  kw = dict(scale=0.125, spec=mask_lib.MaskSpec(), interpret=True)
  with pytest.raises(ValueError, match="needs dropout_seed"):
    ops.attention(q, q, q, None, None, dropout_rate=0.1, **kw)
  with pytest.raises(ValueError, match="dropout_rate must be"):
    ops.attention(q, q, q, None, None, dropout_rate=1.0, dropout_seed=jnp.zeros(2, jnp.uint32),
                  **kw)
  with pytest.raises(ValueError, match="dropout_seed must be integers of shape"):
    ops.attention(q, q, q, None, None, dropout_rate=0.1, dropout_seed=jnp.zeros(3, jnp.uint32),
                  **kw)


# ---------------------------------------------------------------------------------------------
# GPU: real compilation on a Hopper GPU.


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(_CASES))
def test_gpu_dropout_matches_portable(name, head_dim, seed):
  _poison_allocator(64 << 20)
  batch, _, _, heads_q, heads_kv, is_causal, broadcast = _CASES[name]
  _check(batch, 1000, 1000, heads_q, heads_kv, is_causal, broadcast, seed=seed, interpret=False,
         head_dim=head_dim)


@pytest.mark.gpu
def test_gpu_attention_picks_the_kernels_for_dropout():
  """implementation=None on the H200: the compiled kernels, against the portable path."""
  _poison_allocator(64 << 20)
  _check_api(None, interpret=False, q_len=1000, kv_len=1000, head_dim=128)


# ---------------------------------------------------------------------------------------------
# Sharded: each device's kernels must hash global (batch, head) indices. The kernels cannot run
# on several devices in the interpreter; a stand-in pass that writes the dropout prefix it is
# given into its output checks that `sharding.batch_head_parallel` hands every shard the prefix
# rows of its own global batch elements and heads.


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=lambda t: t.name.lower())
def test_sharded_passes_get_global_dropout_prefix(axis_type):
  batch, q_len, heads_q, heads_kv, head_dim = 4, 8, 4, 2, 16
  mesh = multidevice.cpu_mesh((2, 2), ("data", "model"), axis_type)
  q = jnp.zeros((batch, q_len, heads_q, head_dim), jnp.float32)
  k = jnp.zeros((batch, q_len, heads_kv, head_dim), jnp.float32)
  _, arrays = mods_lib.from_arguments(q, k, None, None, None, None, RATE,
                                      dropout.seed_from_key(jax.random.key(0)), False)

  def stand_in(q, k, v, q_lengths, kv_lengths, *mod_arrays):
    prefix = mods_lib.ModArrays(*mod_arrays).dropout_prefix  # uint32 [B, Hq] of this shard
    low = (prefix & 0xFFFF).astype(jnp.float32)  # exact in float32
    out = q + low[:, None, :, None]
    return out, jnp.broadcast_to(low[:, :, None], (q.shape[0], q.shape[2], q.shape[1]))

  def run(q, k, prefix):
    operands = (q, k, k, None, None, *arrays._replace(dropout_prefix=prefix))
    return sharding.batch_head_parallel(stand_in, sharding.FORWARD, *operands)

  want = stand_in(q, k, k, None, None, *arrays)
  qs, ks = (jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))) for x in (q, k))
  got = jax.jit(run)(qs, ks, arrays.dropout_prefix)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
