"""`pallas_attn.attention` as a drop-in for `jax.nn.dot_product_attention`: argument checking
(the score-modification arguments included), rank-3 inputs, transformations (jit, vmap, grad,
remat), dispatch, bias and mask."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import dispatch
from pallas_attn import numerics

B, T, S, HQ, HKV, D = 2, 17, 23, 4, 2, 64


def _sds(shape, dtype=jnp.float32):
  key_dtype = jnp.issubdtype(dtype, jax.dtypes.prng_key)  # (jnp.dtype rejects key dtypes)
  return jax.ShapeDtypeStruct(shape, dtype if key_dtype else jnp.dtype(dtype))


_KEY = jax.random.key(0).dtype


def _abstract_call(q=(B, T, HQ, D), k=(B, S, HKV, D), v=None, dtype=jnp.float32, *,
                   k_dtype=None, v_dtype=None, bias=None, mask=None, q_lengths=None,
                   kv_lengths=None, abstract=None, **kwargs):
  """Call `attention` under jax.eval_shape on abstract inputs: nothing is computed, lowered or
  compiled, so an error raised here is raised while checking the arguments.
  bias / mask / q_lengths / kv_lengths are (shape, dtype) pairs; `abstract` maps any other
  argument name to a (shape, dtype) pair or a tuple of them (e.g. a segment id pair)."""
  v = k if v is None else v
  arrays = dict(query=_sds(q, dtype), key=_sds(k, k_dtype or dtype),
                value=_sds(v, v_dtype or dtype))
  for name, spec in (("bias", bias), ("mask", mask), ("query_seq_lengths", q_lengths),
                     ("key_value_seq_lengths", kv_lengths), *(abstract or {}).items()):
    if spec is not None:
      pair_of_specs = isinstance(spec[0], tuple) and isinstance(spec[1], tuple)
      arrays[name] = tuple(_sds(*s) for s in spec) if pair_of_specs else _sds(*spec)
  return jax.eval_shape(lambda arrays: pallas_attn.attention(**arrays, **kwargs), arrays)


def _shape_re(shape) -> str:
  return re.escape(str(tuple(shape)))


_TABLE = jnp.ones((3,), jnp.float32)  # closed over by a score_fn: the kernels cannot take it

# (id, kwargs for _abstract_call, exception type, regex the message must match)
BAD_INPUTS = [
    ("query_rank2", dict(q=(T, D), k=(S, D)), ValueError, r"query.*" + _shape_re((T, D))),
    ("query_rank5", dict(q=(1, B, T, HQ, D), k=(1, B, S, HKV, D)), ValueError,
     r"query.*" + _shape_re((1, B, T, HQ, D))),
    ("rank_mismatch", dict(k=(S, HKV, D)), ValueError,
     r"same rank.*query " + _shape_re((B, T, HQ, D)) + r".*key " + _shape_re((S, HKV, D))),
    ("head_dim_mismatch", dict(k=(B, S, HKV, 32)), ValueError,
     r"key head_dim 32 != query head_dim 64.*" + _shape_re((B, S, HKV, 32))),
    ("heads_not_divisible", dict(q=(B, T, 3, D)), ValueError,
     r"query heads \(3\).*multiple of key/value heads \(2\).*" + _shape_re((B, T, 3, D))),
    ("batch_mismatch", dict(k=(3, S, HKV, D)), ValueError,
     r"batch mismatch.*query " + _shape_re((B, T, HQ, D)) + r".*key " + _shape_re((3, S, HKV, D))),
    ("key_value_length_mismatch", dict(v=(B, S + 1, HKV, D)), ValueError,
     r"key and value must have the same shape.*key " + _shape_re((B, S, HKV, D)) +
     r".*value " + _shape_re((B, S + 1, HKV, D))),
    ("key_value_heads_mismatch", dict(v=(B, S, 1, D)), ValueError,
     r"key and value.*" + _shape_re((B, S, 1, D))),
    ("q_lengths_wrong_shape", dict(q_lengths=((B, 1), jnp.int32)), ValueError,
     r"query_seq_lengths must have shape \(batch,\) = \(2,\), got " + _shape_re((B, 1))),
    ("kv_lengths_wrong_batch", dict(kv_lengths=((B + 1,), jnp.int32)), ValueError,
     r"key_value_seq_lengths must have shape \(batch,\) = \(2,\), got " + _shape_re((B + 1,))),
    ("q_lengths_float", dict(q_lengths=((B,), jnp.float32)), TypeError,
     r"query_seq_lengths must be int32.*float32"),
    ("kv_lengths_uint8", dict(kv_lengths=((B,), jnp.uint8)), TypeError,
     r"key_value_seq_lengths must be int32.*uint8"),
    ("lengths_with_rank3", dict(q=(T, HQ, D), k=(S, HKV, D), q_lengths=((2,), jnp.int32)),
     ValueError, r"query_seq_lengths must have shape \(batch,\) = \(1,\).*\(2,\)"),
    ("int32_inputs", dict(dtype=jnp.int32), TypeError, r"query dtype.*float.*got int32"),
    ("mixed_dtypes", dict(k_dtype=jnp.bfloat16), TypeError,
     r"share a dtype.*query float32.*key bfloat16"),
    ("mask_not_bool", dict(mask=((B, 1, T, S), jnp.float32)), TypeError,
     r"mask must be boolean.*float32"),
    ("mask_wrong_shape", dict(mask=((B, 1, T, S + 1), bool)), ValueError,
     r"mask shape " + _shape_re((B, 1, T, S + 1)) + r".*" + _shape_re((B, HQ, T, S))),
    ("mask_rank3_wrong_heads", dict(mask=((HKV, T, S), bool)), ValueError,
     r"mask shape " + _shape_re((1, HKV, T, S))),
    ("mask_kv_heads", dict(mask=((B, HKV, T, S), bool)), ValueError,
     r"mask shape " + _shape_re((B, HKV, T, S))),
    ("bias_rank5", dict(bias=((1, B, HQ, T, S), jnp.float32)), ValueError,
     r"bias must have rank <= 4.*" + _shape_re((1, B, HQ, T, S))),
    ("bias_wrong_q_len", dict(bias=((1, 1, T + 1, S), jnp.float32)), ValueError,
     r"bias shape " + _shape_re((1, 1, T + 1, S)) + r".*axis 2"),
    ("unknown_implementation", dict(implementation="cudnn"), ValueError,
     r"implementation must be one of.*blocked_jax.*mosaic_gpu.*reference.*'cudnn'"),
    ("negative_window", dict(local_window_size=(-1, 3)), ValueError,
     r"local_window_size must be non-negative.*\(-1, 3\)"),
    ("window_triple", dict(local_window_size=(1, 2, 3)), ValueError,
     r"local_window_size must be an int or \(left, right\)"),
    ("mosaic_float32", dict(implementation="mosaic_gpu"), ValueError,
     r"mosaic_gpu.*bfloat16 or float16.*float32"),
    ("mosaic_float32_interpret", dict(implementation="mosaic_gpu", interpret=True), ValueError,
     r"mosaic_gpu.*bfloat16 or float16.*float32"),
    ("mosaic_head_dim", dict(q=(B, T, HQ, 40), k=(B, S, HKV, 40), dtype=jnp.bfloat16,
                             implementation="mosaic_gpu", interpret=True), ValueError,
     r"mosaic_gpu.*head_dim.*40"),
    # The score-modification arguments.
    ("segment_ids_single_needs_equal_lengths", dict(abstract=dict(segment_ids=((B, T), jnp.int32))),
     ValueError, rf"single segment_ids array needs q_len == kv_len \(got {T} and {S}\)"),
    ("segment_ids_float", dict(q=(B, T, HQ, D), k=(B, T, HKV, D),
                               abstract=dict(segment_ids=((B, T), jnp.float32))),
     TypeError, r"segment_ids must be int32; got float32"),
    ("q_segment_ids_wrong_shape", dict(abstract=dict(segment_ids=(((B, S), jnp.int32),
                                                                  ((B, S), jnp.int32)))),
     ValueError, rf"q_segment_ids must have shape \(batch, seq\) = \({B}, {T}\); got "
     + _shape_re((B, S))),
    ("segment_ids_triple", dict(abstract=dict(segment_ids=(((B, T), jnp.int32),) * 3)),
     ValueError, r"segment_ids must be one array or a pair.*3"),
    ("bad_alignment", dict(causal_alignment="bottom_left"), ValueError,
     r"causal_alignment must be one of \('top_left', 'bottom_right'\); got 'bottom_left'"),
    ("soft_cap_negative", dict(logits_soft_cap=-1.0), ValueError,
     r"logits_soft_cap must be positive; got -1.0"),
    ("soft_cap_array", dict(abstract=dict(logits_soft_cap=((), jnp.float32))), TypeError,
     r"logits_soft_cap must be a Python float"),
    ("alibi_wrong_heads", dict(abstract=dict(alibi_slopes=((HKV,), jnp.float32))), ValueError,
     rf"alibi_slopes must have shape \(heads_q,\) = \({HQ},\) or \(batch, heads_q\) = "
     rf"\({B}, {HQ}\); got \({HKV},\)"),
    ("alibi_int", dict(abstract=dict(alibi_slopes=((HQ,), jnp.int32))), TypeError,
     r"alibi_slopes must be floating point.*int32"),
    ("dropout_rate_one", dict(dropout_rate=1.0), ValueError, r"dropout_rate must be in \[0, 1\)"),
    ("dropout_without_rng", dict(dropout_rate=0.1), ValueError,
     r"dropout_rate=0.1 needs dropout_rng"),
    ("dropout_rng_batch_of_keys", dict(dropout_rate=0.1, abstract=dict(dropout_rng=((2,), _KEY))),
     TypeError, r"dropout_rng must be one PRNG key.*shape \(2,\)"),
    ("dropout_rng_float", dict(dropout_rate=0.1, abstract=dict(dropout_rng=((2,), jnp.float32))),
     TypeError, r"dropout_rng must be one PRNG key.*float32"),
    ("broadcast_dropout_not_bool", dict(broadcast_dropout="yes"), TypeError,
     r"broadcast_dropout must be a bool"),
    ("mask_fn_not_callable", dict(mask_fn=3), TypeError, r"mask_fn must be callable; got int"),
    ("mask_fn_float", dict(mask_fn=lambda b, h, i, j: (i - j) * 1.0), TypeError,
     r"mask_fn must return booleans.*float32"),
    ("mask_fn_wrong_shape", dict(mask_fn=lambda b, h, i, j: jnp.ones((T + 1, 1), bool)),
     ValueError, rf"mask_fn returned shape \({T + 1}, 1\), which does not broadcast to "
     r"\[batch, heads, q_len, kv_len\] = " + _shape_re((B, HQ, T, S))),
    ("score_fn_int", dict(score_fn=lambda s, b, h, i, j: i - j), TypeError,
     r"score_fn must return floating scores; got int32"),
    ("mosaic_score_fn_closes_over_array",
     dict(dtype=jnp.bfloat16, score_fn=lambda s, b, h, i, j: s + _TABLE[h % 3],
          mask_fn=lambda b, h, i, j: i >= j, implementation="mosaic_gpu", interpret=True),
     NotImplementedError, r"mosaic_gpu' cannot trace mask_fn / score_fn.*score_fn closes over "
     r"arrays \(float32\[3\]\)"),
    ("mosaic_alibi_per_batch", dict(dtype=jnp.bfloat16,
                                    abstract=dict(alibi_slopes=((B, HQ), jnp.float32)),
                                    implementation="mosaic_gpu", interpret=True),
     NotImplementedError, r"mosaic_gpu' does not support alibi_slopes_per_batch"),
]


@pytest.mark.parametrize("kwargs,exc,match", [p[1:] for p in BAD_INPUTS],
                         ids=[p[0] for p in BAD_INPUTS])
def test_bad_input_raises_before_lowering(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    _abstract_call(**kwargs)


def test_good_abstract_call_passes():
  """The baseline of BAD_INPUTS is valid (so each failure above is due to its one change)."""
  out = _abstract_call(q_lengths=((B,), jnp.int32), kv_lengths=((B,), jnp.int32))
  assert out.shape == (B, T, HQ, D) and out.dtype == jnp.float32
  out = _abstract_call(bias=((1, HQ, T, S), jnp.float32), mask=((B, 1, 1, S), bool))
  assert out.shape == (B, T, HQ, D)
  out = _abstract_call(
      abstract=dict(segment_ids=(((B, T), jnp.int32), ((B, S), jnp.int32)),
                    alibi_slopes=((B, HQ), jnp.float32), dropout_rng=((), _KEY)),
      causal_alignment="bottom_right", is_causal=True, logits_soft_cap=30, dropout_rate=0.1,
      broadcast_dropout=True, mask_fn=lambda b, h, i, j: i >= j,
      score_fn=lambda s, b, h, i, j: s + 0.0 * b)
  assert out.shape == (B, T, HQ, D)


def test_non_array_input_raises_type_error():
  with pytest.raises(TypeError, match=r"query must be an array, got list"):
    pallas_attn.attention([[1.0]], jnp.ones((1, 1, 1)), jnp.ones((1, 1, 1)))


def test_mosaic_gpu_without_hopper_says_interpret(monkeypatch):
  """The message when no Hopper GPU is visible (forced here, so the check runs everywhere)."""
  monkeypatch.setattr(dispatch, "_has_hopper_gpu", lambda: False)
  with pytest.raises(ValueError, match=r"mosaic_gpu.*no Hopper GPU.*interpret=True"):
    _abstract_call(dtype=jnp.bfloat16, implementation="mosaic_gpu")


def test_mosaic_gpu_on_this_machine():
  """Without monkeypatching: on a machine without a GPU (this CPU suite's machine), asking for the
  kernels without interpret raises and points at interpret=True; where a Hopper GPU is visible,
  the same call is accepted by dispatch."""
  dispatch._has_hopper_gpu.cache_clear()
  call = dispatch.AttentionCall(batch=B, q_len=T, kv_len=S, heads_q=HQ, heads_kv=HKV,
                                head_dim=D, dtype=jnp.dtype(jnp.bfloat16), has_bias=False,
                                has_mask=False)
  if dispatch._has_hopper_gpu():
    assert dispatch.choose(call, "mosaic_gpu") is dispatch._IMPLEMENTATIONS["mosaic_gpu"]
  else:
    with pytest.raises(ValueError, match=r"no Hopper GPU.*interpret=True"):
      _abstract_call(dtype=jnp.bfloat16, implementation="mosaic_gpu")


# ------------------------------------------------------------------------------------------------
# Helpers for the numeric tests.


def _inputs(rng_key, q=(B, T, HQ, D), kv=(B, S, HKV, D), dtype=jnp.float32):
  kq, kk, kv_, kd = jax.random.split(rng_key, 4)
  return (jax.random.normal(kq, q, jnp.float32).astype(dtype),
          jax.random.normal(kk, kv, jnp.float32).astype(dtype),
          jax.random.normal(kv_, kv, jnp.float32).astype(dtype),
          jax.random.normal(kd, q, jnp.float32).astype(dtype))


def _assert_close(got, want, tol=2e-5, what=""):
  err = cases.rel_err(np.asarray(got, np.float64), np.asarray(want, np.float64))
  assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


def _jax_nn(*args, **kwargs):
  with jax.default_matmul_precision("highest"):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)


# ------------------------------------------------------------------------------------------------
# Rank 3, jit, vmap, grad, remat, residual.


@pytest.mark.parametrize("implementation", ["blocked_jax", "reference", None])
@pytest.mark.parametrize("is_causal", [False, True])
def test_rank3_matches_jax_nn(rng_key, implementation, is_causal):
  q, k, v, do = _inputs(rng_key, q=(T, HQ, D), kv=(S, HKV, D))
  ours = functools.partial(pallas_attn.attention, is_causal=is_causal,
                           implementation=implementation)
  theirs = functools.partial(_jax_nn, is_causal=is_causal)

  @jax.jit
  def run(q, k, v):
    results = []
    for fn in (ours, theirs):
      out, vjp, lse = jax.vjp(lambda *a: fn(*a, return_residual=True), q, k, v, has_aux=True)
      results.append((out, lse, vjp(do)))
    return results

  (out, lse, grads), (want, want_lse, want_grads) = run(q, k, v)
  assert out.shape == (T, HQ, D) and lse.shape == (T, HQ) and lse.dtype == jnp.float32
  _assert_close(out, want, what="out")
  _assert_close(lse, want_lse, tol=1e-6, what="lse")
  for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv")):
    assert g.shape == w.shape
    _assert_close(g, w, what=name)


def test_rank3_mask_and_bias_match_jax_nn(rng_key):
  q, k, v, _ = _inputs(rng_key, q=(T, HQ, D), kv=(S, HKV, D))
  k1, k2 = jax.random.split(jax.random.fold_in(rng_key, 1))
  bias = jax.random.normal(k1, (HQ, T, S))  # rank 3: jax.nn adds the batch axis
  mask = jax.random.bernoulli(k2, 0.7, (1, T, S))
  out, want = jax.jit(lambda *a: (pallas_attn.attention(*a), _jax_nn(*a)))(q, k, v, bias, mask)
  _assert_close(out, want, what="out")


def test_low_rank_mask_bias_and_unbatched_lengths_match_jax_nn(rng_key):
  """jax.nn gives bias/mask of rank < 4 leading axes of 1 (batched inputs too), and takes
  lengths of shape (1,) with unbatched inputs."""
  q, k, v, _ = _inputs(rng_key)
  k1, k2 = jax.random.split(jax.random.fold_in(rng_key, 2))
  bias = jax.random.normal(k1, (T, S))
  mask = jax.random.bernoulli(k2, 0.7, (HQ, T, S))
  out, want = jax.jit(lambda *a: (pallas_attn.attention(*a), _jax_nn(*a)))(q, k, v, bias, mask)
  _assert_close(out, want, what="out (rank-2 bias, rank-3 mask)")
  q3, k3, v3 = q[0], k[0], v[0]
  lengths = jnp.asarray([T - 3], jnp.int32), jnp.asarray([S - 5], jnp.int32)
  kw = lambda ql, kl: dict(query_seq_lengths=ql, key_value_seq_lengths=kl)
  out, want = jax.jit(lambda q, k, v, ql, kl: (
      pallas_attn.attention(q, k, v, is_causal=True, **kw(ql, kl)),
      _jax_nn(q, k, v, is_causal=True, **kw(ql, kl))))(q3, k3, v3, *lengths)
  _assert_close(out, want, what="out (unbatched, lengths (1,))")


@pytest.mark.parametrize("implementation", ["blocked_jax", "reference"])
def test_jit_matches_eager(rng_key, implementation):
  q, k, v, _ = _inputs(rng_key)
  f = functools.partial(pallas_attn.attention, is_causal=True, implementation=implementation)
  np.testing.assert_allclose(jax.jit(f)(q, k, v), f(q, k, v), rtol=1e-6, atol=1e-6)


def test_vmap_over_extra_batch_axis(rng_key):
  """vmap over a leading axis (with per-example lengths) equals looping over it."""
  q, k, v, _ = _inputs(rng_key, q=(3, B, T, HQ, D), kv=(3, B, S, HKV, D))
  kv_lengths = jnp.asarray([[S, 5], [1, S], [0, 12]], jnp.int32)
  f = functools.partial(pallas_attn.attention, is_causal=True, implementation="blocked_jax",
                        return_residual=True)
  g = lambda q, k, v, kl: f(q, k, v, key_value_seq_lengths=kl)
  out, lse = jax.jit(jax.vmap(g))(q, k, v, kv_lengths)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]
  one = jax.jit(lambda *a: (g(*a), _jax_nn(*a[:3], is_causal=True, key_value_seq_lengths=a[3])))
  for i in range(3):
    (o_i, l_i), want = one(q[i], k[i], v[i], kv_lengths[i])
    np.testing.assert_allclose(out[i], o_i, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(lse[i] == numerics.MASK_VALUE, l_i == numerics.MASK_VALUE)
    _assert_close(out[i], want, what=f"out[{i}] vs jax.nn")


@pytest.mark.parametrize("implementation", ["blocked_jax", "reference"])
def test_grad_under_jit(rng_key, implementation):
  q, k, v, do = _inputs(rng_key)
  q_lengths = jnp.asarray([T, 9], jnp.int32)

  def loss(fn, q, k, v):
    return jnp.vdot(fn(q, k, v, is_causal=True, local_window_size=(5, 0),
                       query_seq_lengths=q_lengths), do)

  ours = jax.jit(jax.grad(functools.partial(loss, functools.partial(
      pallas_attn.attention, implementation=implementation)), (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(functools.partial(loss, _jax_nn), (0, 1, 2)))(q, k, v)
  for g, w, name in zip(ours, want, ("dq", "dk", "dv")):
    _assert_close(g, w, what=name)
  np.testing.assert_array_equal(ours[0][1, 9:], 0.0)  # rows past the query length: zero dq


def test_checkpoint_remat(rng_key):
  q, k, v, do = _inputs(rng_key)
  f = functools.partial(pallas_attn.attention, is_causal=True, implementation="blocked_jax")
  loss = lambda fn: lambda q, k, v: jnp.vdot(fn(q, k, v), do)
  plain = jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)
  for policy in (None, jax.checkpoint_policies.nothing_saveable):
    remat = jax.jit(jax.grad(loss(jax.checkpoint(f, policy=policy)), (0, 1, 2)))(q, k, v)
    for g, w in zip(remat, plain):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("implementation", ["blocked_jax", "reference"])
def test_return_residual_shape_and_dtype(rng_key, dtype, implementation):
  q, k, v, _ = _inputs(rng_key, dtype=dtype)
  f = functools.partial(pallas_attn.attention, implementation=implementation)

  @jax.jit
  def run(q, k, v):
    # The residual carries no gradient (stop_gradient, as in jax.nn).
    dq = jax.grad(lambda q: f(q, k, v, return_residual=True)[1].astype(jnp.float32).sum())(q)
    return f(q, k, v), f(q, k, v, return_residual=True), dq

  out, (out2, lse), dq = run(q, k, v)
  assert not isinstance(out, tuple)
  assert out.shape == (B, T, HQ, D) and out.dtype == dtype
  assert lse.shape == (B, T, HQ) and lse.dtype == jnp.float32
  np.testing.assert_array_equal(out, out2)
  # The lse is the natural-log logsumexp of the scaled scores.
  qf, kf = (np.asarray(x, np.float64) for x in (q, k))
  kf = np.repeat(kf, HQ // HKV, axis=2)
  s = np.einsum("bthd,bshd->bhts", qf, kf) / np.sqrt(D)
  m = s.max(-1, keepdims=True)
  want = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0].transpose(0, 2, 1)
  np.testing.assert_allclose(lse, want, rtol=1e-5)
  np.testing.assert_array_equal(dq, 0)


def test_default_scale_and_int_window(rng_key):
  q, k, v, _ = _inputs(rng_key)
  f = functools.partial(pallas_attn.attention, q, k, v, implementation="reference")
  # Arguments are normalized before dispatch: equal normalized calls trace identically.
  assert str(jax.make_jaxpr(lambda: f())()) == str(
      jax.make_jaxpr(lambda: f(scale=1 / np.sqrt(D)))())
  windows = [3, (3, 3), [3, 3], np.int64(3)]
  jaxprs = {str(jax.make_jaxpr(lambda: f(local_window_size=w))()) for w in windows}
  assert len(jaxprs) == 1
  out = jax.jit(lambda q, k, v: pallas_attn.attention(q, k, v, local_window_size=3))(q, k, v)
  _assert_close(out, _jax_nn(q, k, v, local_window_size=(3, 3)), what="window 3")


# ------------------------------------------------------------------------------------------------
# Dispatch; bias and mask.


def _call(has_bias=False, has_mask=False, dtype=jnp.float32, head_dim=D, interpret=False):
  return dispatch.AttentionCall(batch=B, q_len=T, kv_len=S, heads_q=HQ, heads_kv=HKV,
                                head_dim=head_dim, dtype=jnp.dtype(dtype), has_bias=has_bias,
                                has_mask=has_mask, interpret=interpret)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_default_dispatch_on_cpu(dtype):
  assert jax.default_backend() == "cpu"
  impls = dispatch._IMPLEMENTATIONS
  assert dispatch.choose(_call(dtype=dtype), None) is impls["blocked_jax"]
  assert dispatch.choose(_call(dtype=dtype, has_bias=True), None) is impls["blocked_jax"]
  assert dispatch.choose(_call(dtype=dtype, has_mask=True), None) is impls["blocked_jax"]
  assert dispatch.choose(_call(dtype=dtype, has_bias=True, has_mask=True), None) is impls[
      "blocked_jax"]


_FEATURE_FLAGS = ["has_bias", "has_mask", "has_segment_ids", "bottom_right", "has_alibi",
                  "alibi_per_batch", "has_soft_cap", "has_dropout", "has_mask_fn", "has_score_fn"]
_KERNEL_FEATURE_FLAGS = ("has_bias", "has_mask", "has_segment_ids", "bottom_right", "has_alibi",
                         "has_soft_cap", "has_dropout", "has_mask_fn", "has_score_fn")


@pytest.mark.parametrize("flag", _FEATURE_FLAGS)
def test_dispatch_of_each_feature(flag):
  """In the interpreter (so that dtype, head_dim and GPU are no obstacle), the Mosaic GPU kernels
  are chosen exactly for what they serve (bias, mask, bottom-right alignment, segment ids,
  per-head ALiBi slopes, soft-cap, dropout, traceable mask_fn / score_fn); else blocked_jax,
  which, like the reference, serves every feature. Asking mosaic_gpu for the others raises
  NotImplementedError naming the feature."""
  call = dataclasses.replace(_call(dtype=jnp.bfloat16, interpret=True), **{flag: True})
  impls = dispatch._IMPLEMENTATIONS
  feature = call.features()[-1]
  for name in ("blocked_jax", "reference"):
    assert dispatch.choose(call, name) is impls[name]
  if flag in _KERNEL_FEATURE_FLAGS:
    assert dispatch.choose(call, None) is impls["mosaic_gpu"]
    assert dispatch.mosaic_gpu_unsupported_reason(call) is None
    return
  assert dispatch.choose(call, None) is impls["blocked_jax"]
  assert feature in dispatch.mosaic_gpu_unsupported_reason(call)
  with pytest.raises(NotImplementedError, match=rf"mosaic_gpu' does not support {feature}"):
    dispatch.choose(call, "mosaic_gpu")


def test_default_dispatch_results(rng_key):
  """implementation=None gives bit-for-bit the blocked path, with or without bias/mask."""
  q, k, v, _ = _inputs(rng_key)
  bias = jax.random.normal(jax.random.fold_in(rng_key, 1), (1, HQ, T, S))
  mask = jax.random.bernoulli(jax.random.fold_in(rng_key, 2), 0.8, (B, 1, T, S))
  f = pallas_attn.attention
  kw = dict(is_causal=True, return_residual=True)
  for got, want in ((f(q, k, v, **kw), f(q, k, v, implementation="blocked_jax", **kw)),
                    (f(q, k, v, bias, **kw), f(q, k, v, bias, implementation="blocked_jax", **kw)),
                    (f(q, k, v, None, mask, **kw),
                     f(q, k, v, None, mask, implementation="blocked_jax", **kw))):
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("implementation", [None, "reference"])
@pytest.mark.parametrize(
    "bias_shape,mask_shape",
    [((B, HQ, T, S), None), ((1, 1, T, S), None), (None, (B, HQ, T, S)), (None, (B, 1, 1, S)),
     ((1, HQ, 1, S), (1, 1, T, S))],
    ids=["bias_full", "bias_bcast", "mask_full", "mask_keys", "bias_and_mask"])
def test_bias_and_mask_match_jax_nn(rng_key, implementation, bias_shape, mask_shape):
  """Output, lse and gradients (q, k, v and the bias) with bias/mask, against jax.nn, combined
  with causal masking and kv lengths (a mask row may be fully masked: mean of v, as jax.nn)."""
  q, k, v, do = _inputs(rng_key)
  k1, k2 = jax.random.split(jax.random.fold_in(rng_key, 7))
  bias = None if bias_shape is None else jax.random.normal(k1, bias_shape) * 2
  mask = None if mask_shape is None else jax.random.bernoulli(k2, 0.6, mask_shape)
  if mask is not None:
    mask = mask.at[..., 3, :].set(False) if mask.shape[2] > 1 else mask
  kv_lengths = jnp.asarray([S, 11], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=kv_lengths, return_residual=True)

  ours = functools.partial(pallas_attn.attention, implementation=implementation)

  @jax.jit
  def run(q, k, v, bias, mask):
    results = []
    for fn in (ours, _jax_nn):
      (out, lse), vjp = jax.vjp(lambda *a: fn(*a, mask, **kw), q, k, v, bias)
      results.append((out, lse, vjp((do, jnp.zeros_like(lse)))))
    return results

  (out, lse, grads), (want, want_lse, want_grads) = run(q, k, v, bias, mask)
  _assert_close(out, want, what="out")
  np.testing.assert_array_equal(lse == numerics.MASK_VALUE, want_lse == numerics.MASK_VALUE)
  live = want_lse != numerics.MASK_VALUE
  _assert_close(lse[live], want_lse[live], tol=1e-6, what="lse")
  for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv", "dbias")):
    if w is None:
      assert g is None
      continue
    assert g.shape == w.shape, name
    _assert_close(g, w, what=name)


@pytest.mark.parametrize("kwargs,finalized", [
    (dict(), False),
    (dict(is_causal=True), False),
    (dict(is_causal=True, causal_alignment="bottom_right"), False),  # kv_len >= q_len
    (dict(local_window_size=(4, 4)), False),
    (dict(logits_soft_cap=5.0), False),
    (dict(key_value_seq_lengths=np.array([20, 9])), True),
    (dict(query_seq_lengths=np.array([20, 9])), True),
    (dict(mask=np.ones((1, 1, 17, 24), bool)), True),
    (dict(mask_fn=lambda b, h, i, j: i >= j), True),
    (dict(bias=np.zeros((1, 1, 17, 24), np.float32)), True),
    (dict(local_window_size=(0, 0), causal_alignment="bottom_right", is_causal=True), False),
])
def test_empty_row_pass_runs_only_where_a_row_can_be_empty(kwargs, finalized, monkeypatch):
  """The pass that gives empty rows jax.nn's values reads and rewrites the whole output: it is
  traced only when lengths, masks, the user's functions, a bias or the band can empty a row."""
  calls = []
  original = pallas_attn.numerics.finalize_empty_rows
  monkeypatch.setattr(pallas_attn.numerics, "finalize_empty_rows",
                      lambda *a: calls.append(1) or original(*a))
  q = jax.ShapeDtypeStruct((2, 17, 2, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((2, 24, 2, 64), jnp.float32)
  jax.eval_shape(lambda q, k, v: pallas_attn.attention(q, k, v, implementation="blocked_jax",
                                                       **kwargs), q, kv, kv)
  assert bool(calls) == finalized


def test_band_past_the_keys_still_gets_jax_nn_values():
  """Bottom-right causal with more queries than keys empties the first rows: the pass runs and
  they match jax.nn (mean of v)."""
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (1, 9, 2, 32))
  k, v = (jax.random.normal(key, (1, 4, 2, 32)) for key in keys[1:])
  got = pallas_attn.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              implementation="blocked_jax")
  np.testing.assert_allclose(np.asarray(got[0, 0]), np.asarray(v[0].mean(axis=0)), rtol=1e-5,
                             atol=1e-6)
  assert np.isfinite(np.asarray(got)).all()
