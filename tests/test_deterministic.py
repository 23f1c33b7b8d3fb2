"""`deterministic_backward=True`: gradients equal to the bit from run to run.

The Mosaic GPU backward by default makes dQ inside its dK/dV kernel, each key tile's CTA adding
its part into a float32 dQ with TMA reduce-adds in whatever order the CTAs get there; with the
flag, dQ comes from the dQ kernel (`config.separate_dq`), which sums a query tile's key blocks in
registers in a fixed order. On the CPU: which kernels the flag lowers, through every entry point
(`attention`, the Flax adapter, the ring's chunk kernels), and its gradients in the interpreter
against the reference. On a Hopper GPU (`gpu`): repeated gradients equal to the bit, and against
the reference, at every head_dim.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import chunk_kernels
from pallas_attn import dispatch
from pallas_attn import flax_adapter
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import ops
from test_mosaic_gpu import _poison_allocator

_BF16_TOL = 2e-2  # relative L2 of a bf16 gradient against the float32 reference


@pytest.mark.parametrize("head_dim", config_lib.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_deterministic_backward_never_fuses_dq(head_dim, is_causal):
  """At N 16384 the table fuses dQ into the dK/dV kernel at every head_dim; the flag never does,
  and keeps the dK/dV kernel's layout (head split or not) in the dQ kernel's tiles."""
  spec = pallas_attn.MaskSpec(is_causal=is_causal)
  table = ops._static(head_dim, 1.0, spec, False)
  assert ops._backward_configs(table, 16384, 16384)[1].fused_dq
  determ = ops._static(head_dim, 1.0, spec, False, deterministic=True)
  for seq in (512, 1000, 16384):
    dq_cfg, dkv_cfg = ops._backward_configs(determ, seq, seq)
    assert not dkv_cfg.fused_dq
    assert dq_cfg == table.dq_cfg
    assert (dkv_cfg.block_q, dkv_cfg.block_kv) == (dq_cfg.block_q, dq_cfg.block_kv)
    assert dkv_cfg.head_split == table.dkv_cfg.head_split
  assert determ.fwd_cfg == table.fwd_cfg


def test_separate_dq_leaves_an_unfused_pair_alone():
  dq_cfg, dkv_cfg = config_lib.kernel_config(128, "dq"), config_lib.kernel_config(128, "dkv")
  unfused = config_lib.separate_dq(dq_cfg, dkv_cfg)
  assert config_lib.separate_dq(*unfused) == unfused


def _kernels_lowered(loss, *args) -> int:
  """Mosaic GPU kernels in the CUDA lowering of loss's gradient (lowered on the CPU)."""
  lowered = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(
      lowering_platforms=("cuda",))
  return lowered.as_text().count("mosaic_gpu_v2")


# head_dim 64, N 2048, not causal: the table's backward is one kernel (dK/dV with dQ fused in)
# beside the forward; deterministic, the dQ kernel is a third.
_Q = jax.ShapeDtypeStruct((1, 2048, 2, 64), jnp.bfloat16)


@pytest.mark.parametrize("deterministic,kernels", [(False, 2), (True, 3)])
def test_attention_lowers_the_dq_kernel_when_deterministic(deterministic, kernels, monkeypatch):
  # (Lowered for CUDA on the CPU: let the dispatcher take the kernels without a GPU in sight.)
  monkeypatch.setattr(dispatch, "_has_hopper_gpu", lambda: True)

  def loss(q, k, v):
    out = pallas_attn.attention(q, k, v, implementation="mosaic_gpu",
                                deterministic_backward=deterministic)
    return out.astype(jnp.float32).sum()

  assert _kernels_lowered(loss, _Q, _Q, _Q) == kernels


@pytest.mark.parametrize("deterministic,kernels", [(False, 1), (True, 2)])
def test_ring_chunk_backward_lowers_the_dq_kernel_when_deterministic(deterministic, kernels):
  call = dispatch.AttentionCall(batch=1, q_len=2048, kv_len=2048, heads_q=2, heads_kv=2,
                                head_dim=64, dtype=jnp.dtype(jnp.bfloat16), has_bias=False,
                                has_mask=False, interpret=True)
  chunk = chunk_kernels.select("mosaic_gpu", call, deterministic_backward=deterministic)
  assert chunk.deterministic_backward == deterministic
  chunk = dataclasses.replace(chunk, interpret=False)  # (lowered for CUDA below)
  stats = jax.ShapeDtypeStruct((1, 2, 2048), jnp.float32)

  def backward(q, k, v, d_out, lse, delta):
    return chunk.backward(q, k, v, d_out, lse, delta, None, None, scale=0.125, is_causal=False)

  lowered = jax.jit(backward).trace(_Q, _Q, _Q, _Q, stats, stats).lower(
      lowering_platforms=("cuda",))
  assert lowered.as_text().count("mosaic_gpu_v2") == kernels


def test_flax_adapter_passes_deterministic_backward(monkeypatch):
  """Flax's `deterministic` (dropout off) and `deterministic_backward` reach `attention` as
  two different things."""
  seen = {}

  def fake_attention(q, k, v, bias, mask, **kwargs):
    seen.update(kwargs)
    return q

  monkeypatch.setattr(flax_adapter, "attention", fake_attention)
  x = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  attend = functools.partial(flax_adapter.flax_attention_fn, deterministic_backward=True)
  attend(x, x, x, dropout_rate=0.1, deterministic=True)
  assert seen["deterministic_backward"] is True
  assert "dropout_rate" not in seen  # Flax's deterministic=True: no dropout


def _grads(q, k, v, d_out, **kwargs):
  def f(q, k, v):
    return pallas_attn.attention(q, k, v, **kwargs)

  out, vjp = jax.vjp(f, q, k, v)
  return (out,) + vjp(d_out)


def _inputs(seed, batch, q_len, kv_len, heads_q, heads_kv, head_dim):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = [(batch, q_len, heads_q, head_dim), (batch, kv_len, heads_kv, head_dim),
            (batch, kv_len, heads_kv, head_dim), (batch, q_len, heads_q, head_dim)]
  return [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
          for key, shape in zip(keys, shapes)]


def _check_against_reference(inputs, got, **kwargs):
  upcast = [x.astype(jnp.float32) for x in inputs]
  want = jax.jit(functools.partial(_grads, implementation="reference", **kwargs))(*upcast)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    err = cases.rel_err(np.asarray(g, np.float32), np.asarray(w))
    assert err <= _BF16_TOL, f"{name}: relative L2 error {err:.3e} > {_BF16_TOL}"


def test_interpreted_deterministic_backward_matches_reference(seed):
  """GQA, not causal, odd lengths, head_dim 64 (whose table fuses dQ at any length without a
  mask): the interpreter runs the separate dQ kernel and the unfused dK/dV kernel."""
  inputs = _inputs(seed, 1, 113, 203, 4, 2, 64)
  got = jax.jit(functools.partial(_grads, implementation="mosaic_gpu", interpret=True,
                                  deterministic_backward=True))(*inputs)
  _check_against_reference(inputs, got)


# ---------------------------------------------------------------------------------------------
# GPU.

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("head_dim,is_causal,heads", [
    (64, False, (8, 8)), (128, False, (8, 2)), (128, True, (8, 8)), (256, False, (4, 4)),
    (256, True, (4, 2))])
def test_gpu_deterministic_backward_repeats_to_the_bit(head_dim, is_causal, heads, seed):
  """Three runs of the same gradient, the allocator poisoned with NaN before each: equal to the
  bit, and close to the float32 reference. Lengths where the table would fuse dQ (2000 rows:
  over the separate-dQ bounds at every head_dim), not a multiple of the tiles."""
  inputs = _inputs(seed, 2, 2000, 2000, *heads, head_dim)
  run = jax.jit(functools.partial(_grads, implementation="mosaic_gpu", is_causal=is_causal,
                                  deterministic_backward=True))
  runs = []
  for _ in range(3):
    _poison_allocator(64 << 20)
    runs.append([np.asarray(x) for x in run(*inputs)])
  for again in runs[1:]:
    for name, first, other in zip(("out", "dq", "dk", "dv"), runs[0], again):
      np.testing.assert_array_equal(first.view(np.uint16), other.view(np.uint16),
                                    err_msg=f"{name} differs between runs")
  _check_against_reference(inputs, runs[0], is_causal=is_causal)
