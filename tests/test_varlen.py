"""`varlen_attention` (FlashAttention's packed variable-length layout) against each sequence
attended on its own with the reference: outputs, lse and gradients, padding rows, an empty key
sequence, GQA, causal and windowed self-attention; the portable path and the interpreted Mosaic
GPU kernels on the CPU, the compiled kernels on a Hopper GPU (`gpu`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from test_mosaic_gpu import _poison_allocator

_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _cu(lengths):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _inputs(seed, total_q, total_k, heads_q, heads_kv, head_dim, dtype):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = [(total_q, heads_q, head_dim), (total_k, heads_kv, head_dim),
            (total_k, heads_kv, head_dim), (total_q, heads_q, head_dim)]
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _vjp(fn, q, k, v, d_out):
  (out, lse), pullback = jax.vjp(fn, q, k, v)
  return (out, lse) + pullback((d_out, jnp.zeros_like(lse)))


def _per_sequence(q, k, v, d_out, q_lengths, k_lengths, **kwargs):
  """out, lse, dq, dk, dv of each sequence attended alone (float32 reference), packed back;
  padding rows and keys zero (their lse: whatever, not compared)."""
  q, k, v, d_out = (x.astype(jnp.float32) for x in (q, k, v, d_out))
  outs = [np.zeros(q.shape, np.float32), np.zeros(q.shape[:2], np.float32),
          np.zeros(q.shape, np.float32), np.zeros(k.shape, np.float32),
          np.zeros(k.shape, np.float32)]
  qs, ks = _cu(q_lengths), _cu(k_lengths)
  for i in range(len(q_lengths)):
    rows, keys = slice(int(qs[i]), int(qs[i + 1])), slice(int(ks[i]), int(ks[i + 1]))
    if rows.start == rows.stop or keys.start == keys.stop:
      continue  # (no rows; or no keys: zeros, as varlen_attention gives)
    fn = functools.partial(pallas_attn.attention, implementation="reference",
                           return_residual=True, **kwargs)
    got = _vjp(lambda q, k, v: fn(q[None], k[None], v[None]), q[rows], k[keys], v[keys],
               d_out[rows][None])
    # (out and lse carry the batch axis of 1 the call added; the gradients are the slices'.)
    for out, x, where, batched in zip(outs, got, (rows, rows, rows, keys, keys),
                                      (True, True, False, False, False)):
      out[where] = np.asarray(x)[0] if batched else np.asarray(x)
  return outs


def _check(seed, q_lengths, k_lengths, total_q, total_k, *, heads=(4, 2), head_dim=64,
           dtype=jnp.float32, self_attention=True, implementation="blocked_jax",
           interpret=False, **kwargs):
  q, k, v, d_out = _inputs(seed, total_q, total_k, *heads, head_dim, dtype)
  cu_k = None if self_attention else _cu(k_lengths)
  fn = functools.partial(pallas_attn.varlen_attention, cu_seqlens_q=_cu(q_lengths),
                         cu_seqlens_k=cu_k, implementation=implementation, interpret=interpret,
                         return_residual=True, **kwargs)
  got = jax.jit(functools.partial(_vjp, fn))(q, k, v, d_out)
  want = _per_sequence(q, k, v, d_out, q_lengths, k_lengths, **kwargs)
  used_q = int(sum(q_lengths))
  has_keys = np.repeat(np.asarray(k_lengths) > 0, q_lengths)
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    g = np.asarray(g, np.float32)
    if name == "lse":  # rows that see keys
      g, w = g[:used_q][has_keys], w[:used_q][has_keys]
    err = cases.rel_err(g, w)
    assert err <= _TOL[dtype], f"{name}: relative L2 error {err:.3e} > {_TOL[dtype]}"
  # Padding rows: zero output, zero gradient (exactly).
  assert not np.any(np.asarray(got[0], np.float32)[used_q:])
  assert not np.any(np.asarray(got[2], np.float32)[used_q:])


_LENGTHS = [1, 17, 113, 60]  # 191 tokens in 200: 9 rows of padding


@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True),
                                    dict(local_window_size=(8, 0))],
                         ids=["full", "causal", "window"])
def test_self_attention_matches_each_sequence_alone(kwargs, seed):
  _check(seed, _LENGTHS, _LENGTHS, 200, 200, **kwargs)


def test_cross_attention_and_an_empty_key_sequence(seed):
  """Separate boundaries; the third query sequence has no keys: zeros, no gradient."""
  _check(seed, [5, 40, 9, 30], [23, 1, 0, 70], 90, 100, self_attention=False)


def test_interpreted_kernels_match_each_sequence_alone(seed):
  _check(seed, _LENGTHS, _LENGTHS, 200, 200, dtype=jnp.bfloat16, implementation="mosaic_gpu",
         interpret=True, is_causal=True)


def test_bad_arguments_say_what_is_wrong():
  x = jnp.ones((10, 2, 64), jnp.float32)
  cu = _cu([4, 6])
  with pytest.raises(ValueError, match="query .total_tokens, heads, head_dim."):
    pallas_attn.varlen_attention(x[None], x, x, cu)
  with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
    pallas_attn.varlen_attention(x, x, x, cu.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"cu_seqlens_q must be \[num_seqs \+ 1\]"):
    pallas_attn.varlen_attention(x, x, x, cu[:1])
  with pytest.raises(ValueError, match=r"never decrease and end at most at the 10 packed"):
    pallas_attn.varlen_attention(x, x, x, _cu([4, 7]))
  with pytest.raises(ValueError, match=r"must start at 0"):
    pallas_attn.varlen_attention(x, x, x, jnp.asarray([1, 4], jnp.int32))
  with pytest.raises(ValueError, match="packed alike"):
    pallas_attn.varlen_attention(x, x, x, cu, cu, is_causal=True)
  with pytest.raises(ValueError, match="total_k .12. must equal query's total_q .10."):
    pallas_attn.varlen_attention(x, jnp.ones((12, 2, 64)), jnp.ones((12, 2, 64)), cu)
  with pytest.raises(ValueError, match="as many sequences"):
    pallas_attn.varlen_attention(x, x, x, cu, _cu([4, 3, 3]))


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_kernels_match_each_sequence_alone(is_causal, seed):
  """Sequences of 1 to 3000 tokens (tiles where sequences meet, tiles inside one), bf16,
  head_dim 128, GQA; the allocator poisoned with NaN."""
  _poison_allocator(64 << 20)
  lengths = [1000, 17, 3000, 113, 1]
  _check(seed, lengths, lengths, 4200, 4200, heads=(8, 2), head_dim=128, dtype=jnp.bfloat16,
         implementation="mosaic_gpu", is_causal=is_causal)


def test_boundaries_as_jit_arguments(seed):
  """cu_seqlens traced (new boundaries each batch, one compile): the same result as constant."""
  q, k, v, _ = _inputs(seed, 200, 200, 4, 2, 64, jnp.float32)
  cu = _cu(_LENGTHS)
  attend = functools.partial(pallas_attn.varlen_attention, implementation="blocked_jax",
                             is_causal=True)
  traced = jax.jit(lambda q, k, v, cu: attend(q, k, v, cu))(q, k, v, cu)
  np.testing.assert_allclose(np.asarray(traced), np.asarray(jax.jit(
      lambda q, k, v: attend(q, k, v, cu))(q, k, v)), rtol=1e-6, atol=1e-6)
