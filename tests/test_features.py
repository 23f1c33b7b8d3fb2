"""Issue #5's score modifications through `pallas_attn.attention`: bias, boolean mask, segment ids,
bottom-right alignment, one-sided windows, soft-cap, ALiBi, dropout, mask_fn and score_fn, alone
and combined.

1. The reference against a dense float32 computation written here from the definitions (masks
   and biases built in numpy on the whole grid): output, lse and the q/k/v/bias gradients.
2. blocked_jax against the reference: output, lse, dq/dk/dv and the bias / ALiBi-slope gradients
   with a random cotangent, float32 and bfloat16, GQA, T != S, odd lengths; and with small blocks,
   so that short sequences span many tiles (tile edges, padded tiles, skipped tiles).
3. Dropout: keep rate, determinism, key dependence, rate 0, the mask shared across batch/heads.
4. Block skipping for segment ids and mask_fn (NaN values in skipped tiles must not leak).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import blocked_jax
from pallas_attn import dropout
from pallas_attn import numerics

B, HQ, HKV, D = 2, 4, 2, 16


def _normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _sorted_ids(key, batch, length, num_segments=3):
  """Packed-sequence ids: non-decreasing per row."""
  return jnp.sort(jax.random.randint(key, (batch, length), 0, num_segments), axis=1).astype(
      jnp.int32)


def _segments(key, t, s):
  """segment_ids as one array when t == s, else a (q, kv) pair of sorted ids drawn from the
  same few values, so that most rows meet some keys and some rows meet none."""
  if t == s:
    return _sorted_ids(key, B, t)
  kq, kk = jax.random.split(key)
  return (_sorted_ids(kq, B, t), _sorted_ids(kk, B, s))


def _mask(key, shape, p=0.7):
  mask = jax.random.bernoulli(key, p, shape)
  if shape[2] > 3:
    mask = mask.at[..., 3, :].set(False)  # a fully masked row: jax.nn's mean of v
  return mask


_SLOPES = jnp.asarray([2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4], jnp.float32)  # ALiBi's, for 4 heads


def _mask_fn(b, h, i, j):
  return ((i - j) % 3 != 1) | (h == 0) | (b == 1)


def _score_fn(s, b, h, i, j):
  return s * (1.0 - 0.1 * h) + jnp.sin(0.1 * i - 0.05 * j) + 0.2 * b


# name -> (key, t, s) -> attention keyword arguments
FEATURES = {
    "bias_full": lambda r, t, s: dict(bias=_normal(r, (B, HQ, t, s))),
    "bias_heads_keys": lambda r, t, s: dict(bias=_normal(r, (1, HQ, 1, s))),
    # (A bias constant along the keys would not change the softmax: its gradient is zero.)
    "bias_batch_keys": lambda r, t, s: dict(bias=_normal(r, (B, 1, 1, s))),
    "mask_keys": lambda r, t, s: dict(mask=_mask(r, (1, 1, 1, s))),
    "mask_rows_causal": lambda r, t, s: dict(mask=_mask(r, (B, 1, t, s)), is_causal=True),
    "segments_causal": lambda r, t, s: dict(segment_ids=_segments(r, t, s), is_causal=True),
    "bottom_right_causal_window": lambda r, t, s: dict(
        is_causal=True, local_window_size=(5, 0), causal_alignment="bottom_right"),
    "window_left_only": lambda r, t, s: dict(local_window_size=(4, 0)),
    "window_right_only": lambda r, t, s: dict(local_window_size=(0, 3)),
    "softcap_window": lambda r, t, s: dict(logits_soft_cap=2.0, local_window_size=(6, 2)),
    "alibi_causal": lambda r, t, s: dict(alibi_slopes=_SLOPES, is_causal=True),
    "alibi_batched_bottom_right": lambda r, t, s: dict(
        alibi_slopes=_normal(r, (B, HQ)) ** 2, causal_alignment="bottom_right"),
    "dropout": lambda r, t, s: dict(dropout_rate=0.25, dropout_rng=r),
    "mask_fn": lambda r, t, s: dict(mask_fn=_mask_fn),
    "score_fn": lambda r, t, s: dict(score_fn=_score_fn),
    "bias_and_mask": lambda r, t, s: dict(bias=_normal(r, (1, 1, t, s)),
                                          mask=_mask(jax.random.fold_in(r, 1), (B, 1, t, s))),
    "everything": lambda r, t, s: dict(
        bias=_normal(r, (1, HQ, t, s)), mask=_mask(jax.random.fold_in(r, 1), (B, 1, t, s)),
        segment_ids=_segments(jax.random.fold_in(r, 2), t, s), is_causal=True,
        causal_alignment="bottom_right", logits_soft_cap=3.0, alibi_slopes=_SLOPES,
        dropout_rate=0.2, dropout_rng=jax.random.fold_in(r, 3), mask_fn=_mask_fn,
        score_fn=_score_fn),
}
_DIFFERENTIABLE = ("bias", "alibi_slopes")


def _split(kwargs):
  """(differentiable arrays, other arrays, static values) of an attention call's kwargs."""
  diff = {n: x for n, x in kwargs.items() if n in _DIFFERENTIABLE}
  is_array = lambda x: isinstance(x, jax.Array) or (
      isinstance(x, tuple) and all(isinstance(y, jax.Array) for y in x))
  arrays = {n: x for n, x in kwargs.items() if n not in diff and is_array(x)}
  static = {n: x for n, x in kwargs.items() if n not in diff and n not in arrays}
  return diff, arrays, static


def _run(implementation, inputs, kwargs):
  """attention(..., return_residual=True) and the vjp of a random cotangent, under a fresh jit:
  (out, lse [B, T, H], {"dq", "dk", "dv", "dbias", "dalibi_slopes"}) as float64 numpy."""
  q, k, v, do = inputs
  diff, arrays, static = _split(kwargs)

  @jax.jit
  def run(q, k, v, diff, arrays):
    def f(q, k, v, diff):
      return pallas_attn.attention(q, k, v, implementation=implementation, return_residual=True,
                                   **diff, **arrays, **static)

    (out, lse), vjp = jax.vjp(f, q, k, v, diff)
    return out, lse, vjp((do, jnp.zeros_like(lse)))

  out, lse, (dq, dk, dv, ddiff) = run(q, k, v, diff, arrays)
  grads = dict(dq=dq, dk=dk, dv=dv, **{f"d{n}": g for n, g in ddiff.items()})
  for name, g in grads.items():  # gradients come back in the dtype of their primal
    primal = {"dq": q, "dk": k, "dv": v}.get(name, diff.get(name[1:]))
    assert g.dtype == primal.dtype, (name, g.dtype, primal.dtype)
  as64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  return as64(out), np.asarray(lse), {n: as64(g) for n, g in grads.items()}


def _inputs(key, t, s, dtype):
  kq, kk, kv, kd = jax.random.split(key, 4)
  return (_normal(kq, (B, t, HQ, D), dtype), _normal(kk, (B, s, HKV, D), dtype),
          _normal(kv, (B, s, HKV, D), dtype), _normal(kd, (B, t, HQ, D), dtype))


def _upcast(tree):
  floating = lambda x: hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
  return jax.tree.map(lambda x: x.astype(jnp.float32) if floating(x) else x, tree)


def _assert_matches(got, want, tol: dict, what: str):
  out, lse, grads = got
  want_out, want_lse, want_grads = want
  assert lse.dtype == np.float32, f"{what}: lse dtype {lse.dtype}"
  empty = want_lse == np.float32(numerics.MASK_VALUE)
  np.testing.assert_array_equal(lse == np.float32(numerics.MASK_VALUE), empty,
                                err_msg=f"{what}: rows that see no key differ")
  errors = {"out": cases.rel_err(out, want_out)}
  if (~empty).any():
    errors["lse"] = cases.rel_err(lse[~empty], want_lse[~empty])
  assert set(grads) == set(want_grads), (what, set(grads), set(want_grads))
  errors.update({n: cases.rel_err(g, want_grads[n]) for n, g in grads.items()})
  bad = {n: e for n, e in errors.items() if not e <= tol.get(n, tol["dq"])}
  assert not bad, f"{what}: rel errors {bad} exceed {tol}"


_F32_TOL = dict(out=1e-5, lse=1e-5, dq=2e-5)
_BF16_TOL = dict(out=1.5e-2, lse=1e-4, dq=2e-2)


# ------------------------------------------------------------------------------------------------
# 1. The reference against a dense computation written from the definitions.


def _dense_terms(kwargs, t, s):
  """The call's masks and additive terms on the whole grid, built in numpy from the definitions:
  (keep [B|1, H|1, t, s] bool, additive constant [.., t, s] (ALiBi), the seed of dropout)."""
  b = np.arange(B)[:, None, None, None]
  h = np.arange(HQ)[None, :, None, None]
  i = np.arange(t)[None, None, :, None]
  j = np.arange(s)[None, None, None, :]
  offset = s - t if kwargs.get("causal_alignment") == "bottom_right" else 0
  keep = np.ones((B, HQ, t, s), bool)
  if kwargs.get("is_causal"):
    keep &= j <= i + offset
  if "local_window_size" in kwargs:
    left, right = kwargs["local_window_size"]
    keep &= (i + offset - left <= j) & (j <= i + offset + right)
  if "mask" in kwargs:
    keep &= np.asarray(kwargs["mask"])
  if "segment_ids" in kwargs:
    ids = kwargs["segment_ids"]
    q_ids, kv_ids = ids if isinstance(ids, tuple) else (ids, ids)
    keep &= np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]
  if "mask_fn" in kwargs:
    keep &= np.asarray(kwargs["mask_fn"](b, h, i, j))
  alibi = np.zeros((1, 1, t, s), np.float32)
  if "alibi_slopes" in kwargs:
    slopes = np.asarray(kwargs["alibi_slopes"]).reshape(-1, HQ, 1, 1)
    alibi = -slopes * np.abs(i + offset - j)
  seed = dropout.seed_from_key(kwargs["dropout_rng"]) if "dropout_rng" in kwargs else None
  return keep, alibi.astype(np.float32), seed


def _dense_attention(q, k, v, bias, *, kwargs):
  """Softmax attention in float32 on the whole grid, straight from the documented order."""
  t, s = q.shape[1], k.shape[1]
  keep, alibi, seed = _dense_terms(kwargs, t, s)
  k, v = (jnp.repeat(x, HQ // HKV, axis=2) for x in (k, v))
  logits = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") / math.sqrt(D)
  if bias is not None:
    logits = logits + bias
  logits = logits + alibi
  if "score_fn" in kwargs:
    b, h, i, j = np.ogrid[:B, :HQ, :t, :s]
    logits = kwargs["score_fn"](logits, b, h, i, j)
  if "logits_soft_cap" in kwargs:
    cap = kwargs["logits_soft_cap"]
    logits = cap * jnp.tanh(logits / cap)
  logits = jnp.where(keep, logits, numerics.MASK_VALUE)
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  if seed is not None:
    rate = kwargs["dropout_rate"]
    b, h, i, j = np.ogrid[:B, :HQ, :t, :s]
    kept = dropout.keep_mask(seed, b, h, i, j, rate)
    # Rows that see no key keep their uniform weights, undropped (the documented convention).
    probs = jnp.where(keep.any(-1, keepdims=True), jnp.where(kept, probs / (1 - rate), 0.0),
                      probs)
  out = jnp.einsum("bhts,bshd->bthd", probs, v, precision="highest")
  return out, lse.transpose(0, 2, 1)


def _run_dense(inputs, kwargs):
  q, k, v, do = inputs
  bias = kwargs.get("bias")

  @jax.jit  # the other arguments are closed over as constants (numpy masks are built from them)
  def run(q, k, v, do, bias):
    f = lambda q, k, v, bias: _dense_attention(q, k, v, bias, kwargs=kwargs)
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    return out, lse, vjp((do, jnp.zeros_like(lse)))

  out, lse, (dq, dk, dv, dbias) = run(q, k, v, do, bias)
  grads = dict(dq=dq, dk=dk, dv=dv)
  if bias is not None:
    grads["dbias"] = dbias
  return (np.asarray(out, np.float64), np.asarray(lse),
          {n: np.asarray(g, np.float64) for n, g in grads.items()})


@pytest.mark.parametrize("feature", list(FEATURES))
def test_reference_matches_dense_definition(feature, rng_key):
  t, s = 17, 23
  inputs = _inputs(rng_key, t, s, jnp.float32)
  kwargs = FEATURES[feature](jax.random.fold_in(rng_key, 1), t, s)
  got = _run("reference", inputs, kwargs)
  got[2].pop("dalibi_slopes", None)  # the dense side folds ALiBi into a constant
  _assert_matches(got, _run_dense(inputs, kwargs), _F32_TOL, f"reference, {feature}")


# ------------------------------------------------------------------------------------------------
# 2. blocked_jax against the reference.

# (dtype, q_len, kv_len, features): odd lengths, T != S both ways, a single query.
_SHAPES = [
    ("f32", 113, 37, tuple(FEATURES)),
    ("bf16", 17, 23, tuple(FEATURES)),
    ("f32", 1, 17, ("bias_full", "mask_keys", "segments_causal", "bottom_right_causal_window",
                    "alibi_batched_bottom_right", "dropout", "everything")),
]


def _params():
  for dtype, t, s, features in _SHAPES:
    for feature in features:
      yield pytest.param(feature, dtype, t, s, id=f"{feature}-{dtype}-{t}x{s}")


@pytest.mark.parametrize("feature,dtype,t,s", list(_params()))
def test_blocked_matches_reference(feature, dtype, t, s, rng_key):
  dtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
  inputs = _inputs(rng_key, t, s, dtype)
  kwargs = FEATURES[feature](jax.random.fold_in(rng_key, 1), t, s)
  if "bias" in kwargs:
    kwargs["bias"] = kwargs["bias"].astype(dtype)
  got = _run("blocked_jax", inputs, kwargs)
  # The oracle: the reference in float32 on the very values the blocked path saw.
  want = _run("reference", _upcast(inputs), _upcast(kwargs))
  tol = _F32_TOL if dtype == jnp.float32 else _BF16_TOL
  _assert_matches(got, want, tol, f"blocked_jax, {feature}")


# Small blocks: lengths that span many tiles, do not divide the blocks and differ from each other.
_SMALL_BLOCKS = [
    ("bias_full", 16, 8), ("bias_heads_keys", 8, 16), ("bias_batch_keys", 16, 24),
    ("mask_rows_causal", 16, 8), ("segments_causal", 8, 8), ("alibi_batched_bottom_right", 16, 8),
    ("bottom_right_causal_window", 8, 16), ("dropout", 16, 8), ("mask_fn", 8, 8),
    ("everything", 16, 8),
]


@pytest.mark.parametrize("feature,block_q,block_kv", _SMALL_BLOCKS,
                         ids=[f"{f}-bq{bq}-bkv{bk}" for f, bq, bk in _SMALL_BLOCKS])
def test_blocked_small_blocks_match_reference(feature, block_q, block_kv, rng_key, monkeypatch):
  # The public path with the tile sizes forced (each _run traces afresh, so nothing is cached
  # across the patch).
  monkeypatch.setattr(blocked_jax, "default_blocks", lambda q_len, kv_len: (block_q, block_kv))
  t, s = 45, 61
  inputs = _inputs(rng_key, t, s, jnp.float32)
  kwargs = FEATURES[feature](jax.random.fold_in(rng_key, 1), t, s)
  _assert_matches(_run("blocked_jax", inputs, kwargs), _run("reference", inputs, kwargs),
                  _F32_TOL, f"blocked_jax {feature} with blocks ({block_q}, {block_kv})")


def test_rank3_inputs_with_segment_ids_and_alibi(rng_key):
  """Unbatched (rank-3) inputs take [seq] segment ids and [heads] slopes."""
  q, k, v, _ = _inputs(rng_key, 19, 19, jnp.float32)
  ids = _sorted_ids(jax.random.fold_in(rng_key, 1), 1, 19)[0]
  f = functools.partial(pallas_attn.attention, segment_ids=ids, alibi_slopes=_SLOPES,
                        is_causal=True)
  out = jax.jit(lambda q, k, v: f(q, k, v, implementation="blocked_jax"))(q[0], k[0], v[0])
  want = jax.jit(lambda q, k, v: f(q, k, v, implementation="reference", segment_ids=ids[None]))(
      q[:1], k[:1], v[:1])
  assert out.shape == (19, HQ, D)
  assert cases.rel_err(out, want[0]) <= 1e-5


# ------------------------------------------------------------------------------------------------
# 3. Dropout.


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_keep_rate(rate):
  seed = dropout.seed_from_key(jax.random.key(int(rate * 10)))
  b, h, i, j = np.ogrid[:2, :4, :128, :128]
  keep = np.asarray(jax.jit(dropout.keep_mask, static_argnums=5)(seed, b, h, i, j, rate))
  assert abs(keep.mean() - (1 - rate)) < 0.01, keep.mean()
  # No (batch, head), row or column is degenerate.
  per_head = keep.mean(axis=(2, 3))
  assert np.all(np.abs(per_head - (1 - rate)) < 0.03), per_head
  assert np.all(np.abs(keep.mean(axis=3) - (1 - rate)) < 0.25)
  assert np.all(np.abs(keep.mean(axis=2) - (1 - rate)) < 0.25)
  # Neighbouring elements are not correlated (the hash avalanches every index bit).
  same = (keep[..., 1:] == keep[..., :-1]).mean()
  assert abs(same - (rate**2 + (1 - rate) ** 2)) < 0.01, same


def test_dropout_determinism_and_keys(rng_key):
  q, k, v, _ = _inputs(rng_key, 33, 33, jnp.float32)

  @functools.partial(jax.jit, static_argnames="rate")
  def run(key, rate):
    return pallas_attn.attention(q, k, v, dropout_rate=rate, dropout_rng=key,
                                 return_residual=True)

  key = jax.random.key(7)
  out, lse = run(key, rate=0.3)
  np.testing.assert_array_equal(out, run(jax.random.key(7), rate=0.3)[0])
  assert cases.rel_err(run(jax.random.key(8), rate=0.3)[0], out) > 0.05
  # Raw uint32 keys work as well.
  np.testing.assert_array_equal(run(jax.random.key_data(key), rate=0.3)[0], out)
  # Rate 0 is no dropout at all, whatever the key; the lse is that of the undropped softmax.
  plain, plain_lse = jax.jit(lambda: pallas_attn.attention(q, k, v, return_residual=True))()
  np.testing.assert_array_equal(run(key, rate=0.0)[0], plain)
  np.testing.assert_allclose(lse, plain_lse, rtol=1e-6)


def test_dropout_averages_to_no_dropout(rng_key):
  """Over many keys the dropped output averages to the undropped one (unbiased scaling)."""
  q, k, v, _ = _inputs(rng_key, 8, 64, jnp.float32)
  keys = jax.random.split(jax.random.fold_in(rng_key, 1), 256)
  outs = jax.jit(jax.vmap(lambda key: pallas_attn.attention(q, k, v, dropout_rate=0.5,
                                                            dropout_rng=key)))(keys)
  want = jax.jit(pallas_attn.attention)(q, k, v)
  assert cases.rel_err(outs.mean(0), want) < 0.1
  assert cases.rel_err(outs[0], want) > 0.2


def test_broadcast_dropout_shares_the_mask(rng_key):
  """With broadcast_dropout every batch element and head uses one keep-mask: identical inputs
  across heads and batch give identical outputs; without it they differ."""
  q, k, v, _ = _inputs(rng_key, 16, 24, jnp.float32)
  q = jnp.broadcast_to(q[:1, :, :1], q.shape)
  k, v = (jnp.broadcast_to(x[:1, :, :1], x.shape) for x in (k, v))
  run = lambda broadcast: jax.jit(functools.partial(
      pallas_attn.attention, dropout_rate=0.4, broadcast_dropout=broadcast))(
          q, k, v, dropout_rng=jax.random.key(0))
  shared = np.asarray(run(True))
  np.testing.assert_array_equal(shared, np.broadcast_to(shared[:1, :, :1], shared.shape))
  separate = np.asarray(run(False))
  assert not np.array_equal(separate[:, :, 0], separate[:, :, 1])
  assert not np.array_equal(separate[0], separate[1])


# ------------------------------------------------------------------------------------------------
# 4. Block skipping: a skipped tile is never computed, so NaN values in it cannot leak (a masked
# but computed tile would give 0 * NaN = NaN in P.V).


@pytest.mark.parametrize("how", ["segment_ids", "mask_fn"])
def test_blocked_skips_tiles_that_cannot_meet(how, rng_key, monkeypatch):
  monkeypatch.setattr(blocked_jax, "default_blocks", lambda q_len, kv_len: (16, 16))
  t = 48
  q, k, v, _ = _inputs(rng_key, t, t, jnp.float32)
  v = v.at[:, 16:].set(jnp.nan)  # keys of segments 1 and 2
  ids = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // 16, (B, t))
  kwargs = (dict(segment_ids=ids) if how == "segment_ids" else
            dict(mask_fn=lambda b, h, i, j: i // 16 == j // 16))
  out = jax.jit(lambda q, k, v: pallas_attn.attention(q, k, v, implementation="blocked_jax",
                                                      **kwargs))(q, k, v)
  assert np.isfinite(np.asarray(out[:, :16])).all(), "a tile of other segments was computed"
  assert np.isnan(np.asarray(out[:, 16:])).all()
  want = jax.jit(functools.partial(pallas_attn.attention, implementation="reference"))(
      q[:, :16], k[:, :16], v[:, :16])
  assert cases.rel_err(out[:, :16], want) <= 1e-6
