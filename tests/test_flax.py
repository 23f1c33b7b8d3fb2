"""pallas_attn.attention inside Flax attention modules (`attention_fn`).

What the modules call (flax 0.12, read from site-packages):
- `flax.nnx.MultiHeadAttention` calls
    attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
                 broadcast_dropout=..., deterministic=..., dtype=..., precision=...,
                 module=self-or-None, is_causal=..., [input_positions=...])
  unconditionally, so a function without those keywords fails with a TypeError.
- `flax.linen.MultiHeadDotProductAttention` calls attention_fn(query, key, value, **kw) with kw
  filtered down to the names in attention_fn's signature among mask, dropout_rng, dropout_rate,
  broadcast_dropout, deterministic, dtype, precision, force_fp32_for_softmax,
  qk_attn_weights_einsum, attn_weights_value_einsum (plus module=self when sow_weights).
  So pallas_attn.attention itself receives only `mask`.
- q/k/v are [batch..., length, heads, head_dim] (possibly several batch axes); masks come from
  make_attention_mask / make_causal_mask: float32 (1.0 = attend) of shape [batch..., 1, T, S].

`pallas_attn.flax_attention_fn` is the adapter; it is exercised here against the modules'
default attention. Flax's attention-weight dropout maps onto pallas_attn's hashed dropout: same
semantics (broadcast_dropout shares the mask across batch and heads), not the same random bits,
so dropout is checked by its properties, not against Flax's numbers.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen
from flax import nnx

import cases
import pallas_attn


flax_attention_fn = pallas_attn.flax_attention_fn


F, H, HKV = 32, 4, 2  # features, heads, kv heads; head_dim = 64 / 4 = 16
QKV = 64


def _x(rng_key, *shape):
  return jax.random.normal(rng_key, shape, jnp.float32)


def _close(got, want, tol=2e-5, what=""):
  err = cases.rel_err(np.asarray(got), np.asarray(want))
  assert err <= tol, f"{what}: rel err {err:.3e}"


def _close_grads(grads, want_grads, tol=5e-5):
  """Per-parameter relative error, measured against max(||want||, 1e-2 * ||all grads||): the key
  projection's bias has a gradient that is mathematically zero (softmax ignores a constant added
  to every logit of a row), so both sides hold rounding noise there."""
  leaves = jax.tree_util.tree_leaves_with_path(grads)
  want_leaves = jax.tree.leaves(want_grads)
  assert len(leaves) == len(want_leaves)
  total = math.sqrt(sum(float(np.sum(np.square(np.asarray(w, np.float64)))) for w in want_leaves))
  for (path, g), w in zip(leaves, want_leaves):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-2 * total)
    assert err <= tol, f"grad {jax.tree_util.keystr(path)}: rel err {err:.3e}"


# ------------------------------------------------------------------------------------------------
# nnx.


def _nnx_pair(adapter, **kw):
  make = lambda fn: nnx.MultiHeadAttention(num_heads=H, in_features=F, qkv_features=QKV,
                                           decode=False, rngs=nnx.Rngs(0), attention_fn=fn, **kw)
  ours, default = make(adapter), make(nnx.dot_product_attention)
  # Same parameters (same seed), so any difference is the attention function.
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(default, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  return ours, default


@pytest.mark.parametrize("setting", ["plain", "is_causal", "causal_and_padding_mask",
                                     "cross_gqa", "extra_batch_axis"])
def test_nnx_multihead_attention_matches_default(rng_key, setting):
  k1, k2, k3 = jax.random.split(rng_key, 3)
  kw, call = {}, {}
  x = _x(k1, 2, 37, F)
  inputs = (x,)
  if setting == "is_causal":
    call = dict(is_causal=True)
  elif setting == "causal_and_padding_mask":
    valid = jnp.arange(37)[None, :] < jnp.asarray([37, 20])[:, None]
    call = dict(mask=nnx.combine_masks(nnx.make_causal_mask(x[..., 0]),
                                       nnx.make_attention_mask(valid, valid)))
    assert call["mask"].dtype == jnp.float32 and call["mask"].shape == (2, 1, 37, 37)
  elif setting == "cross_gqa":
    kw = dict(num_kv_heads=HKV)
    inputs = (x, _x(k2, 2, 53, F))
  elif setting == "extra_batch_axis":
    inputs = (_x(k3, 3, 2, 29, F),)
    call = dict(is_causal=True)
  ours, default = _nnx_pair(flax_attention_fn, **kw)

  @nnx.jit
  def forward_and_grad(model, inputs, do):
    def loss(model):
      out = model(*inputs, **call)
      return jnp.vdot(out, do), out
    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return out, grads

  do = _x(jax.random.fold_in(rng_key, 9), *inputs[0].shape)
  out, grads = forward_and_grad(ours, inputs, do)
  want, want_grads = forward_and_grad(default, inputs, do)
  assert out.shape == want.shape == inputs[0].shape
  _close(out, want, what="output")
  _close_grads(grads, want_grads)


def test_nnx_plain_attention_needs_an_adapter(rng_key):
  """pallas_attn.attention as-is is not an nnx attention_fn (nnx passes deterministic, dtype,
  precision, module, ...): this documents why the adapter exists; if the signature grows these
  keywords this test says so."""
  model = nnx.MultiHeadAttention(num_heads=H, in_features=F, qkv_features=QKV, decode=False,
                                 rngs=nnx.Rngs(0), attention_fn=pallas_attn.attention)
  with pytest.raises(TypeError, match="unexpected keyword"):
    model(_x(rng_key, 2, 9, F))


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_nnx_dropout(rng_key, broadcast_dropout):
  """deterministic=True is the module without dropout (equal to Flax's default attention);
  deterministic=False drops weights: the output moves, is reproducible from the module's rngs,
  and the parameters get finite gradients."""
  x = _x(rng_key, 2, 19, F)
  make = lambda fn: nnx.MultiHeadAttention(
      num_heads=H, in_features=F, qkv_features=QKV, decode=False, dropout_rate=0.3,
      broadcast_dropout=broadcast_dropout, rngs=nnx.Rngs(0), attention_fn=fn)

  @functools.partial(nnx.jit, static_argnames="deterministic")
  def run(model, deterministic):
    return model(x, deterministic=deterministic)

  plain = run(make(flax_attention_fn), True)
  _close(plain, run(make(nnx.dot_product_attention), True), what="deterministic")

  @nnx.jit
  def dropped_and_grads(model):
    return nnx.value_and_grad(lambda m: jnp.vdot(m(x, deterministic=False), x))(model)

  (value, grads), (again, _) = dropped_and_grads(make(flax_attention_fn)), dropped_and_grads(
      make(flax_attention_fn))
  assert value == again  # the same rngs seed: the same keep-mask
  assert abs(value - jnp.vdot(plain, x)) > 1e-3 * abs(value)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert cases.rel_err(np.asarray(run(make(flax_attention_fn), False)), np.asarray(plain)) > 0.05


def test_adapter_broadcast_dropout_shares_the_mask_over_batch_axes_and_heads(rng_key):
  """Flax's broadcast_dropout=True (its default): one keep-mask for every batch element (several
  batch axes here) and head; identical inputs everywhere then give identical outputs."""
  q = jnp.broadcast_to(_x(rng_key, 1, 1, 11, 1, 16), (2, 3, 11, H, 16))
  k = jnp.broadcast_to(_x(jax.random.fold_in(rng_key, 1), 1, 1, 13, 1, 16), (2, 3, 13, H, 16))
  run = lambda broadcast: np.asarray(jax.jit(functools.partial(
      flax_attention_fn, dropout_rate=0.5, deterministic=False, broadcast_dropout=broadcast))(
          q, k, k, dropout_rng=jax.random.key(3)))
  shared = run(True)
  np.testing.assert_array_equal(shared, np.broadcast_to(shared[:1, :1, :, :1], shared.shape))
  separate = run(False)
  assert not np.array_equal(separate[0, 0], separate[1, 2])
  with pytest.raises(ValueError, match="dropout_rng"):
    flax_attention_fn(q, k, k, dropout_rate=0.5, deterministic=False)


def test_linen_dropout(rng_key):
  """linen passes dropout_rng from the 'dropout' stream: reproducible per key, moves the output."""
  x = _x(rng_key, 2, 17, F)
  model = _linen_model(flax_attention_fn, dropout_rate=0.3)
  params = model.init(jax.random.fold_in(rng_key, 1), x, deterministic=True)
  run = jax.jit(lambda key: model.apply(params, x, deterministic=False, rngs=dict(dropout=key)))
  a, b = run(jax.random.key(1)), run(jax.random.key(2))
  np.testing.assert_array_equal(a, run(jax.random.key(1)))
  assert cases.rel_err(np.asarray(a), np.asarray(b)) > 0.05
  plain = model.apply(params, x, deterministic=True)
  assert cases.rel_err(np.asarray(a), np.asarray(plain)) > 0.05


# ------------------------------------------------------------------------------------------------
# linen.


def _linen_model(fn, **kw):
  return linen.MultiHeadDotProductAttention(num_heads=H, qkv_features=QKV, attention_fn=fn, **kw)


@pytest.mark.parametrize("attention_fn", ["adapter", "pallas_attn.attention"])
@pytest.mark.parametrize("setting", ["plain", "causal_mask", "cross_padding_mask"])
def test_linen_multihead_attention_matches_default(rng_key, attention_fn, setting):
  k1, k2, k3 = jax.random.split(rng_key, 3)
  xq = _x(k1, 2, 41, F)
  xkv = xq
  mask = None
  if setting == "causal_mask":
    mask = linen.make_causal_mask(xq[..., 0])
  elif setting == "cross_padding_mask":
    xkv = _x(k2, 2, 23, F)
    mask = linen.make_attention_mask(jnp.ones((2, 41), bool),
                                     jnp.arange(23)[None, :] < jnp.asarray([23, 5])[:, None])
  if attention_fn == "adapter":
    fn = flax_attention_fn
  else:
    # linen only passes the keywords in the signature: here just `mask`, which pallas_attn
    # requires to be boolean (flax's masks are float32).
    fn = pallas_attn.attention
    mask = None if mask is None else mask.astype(bool)
  default = _linen_model(linen.dot_product_attention)
  params = default.init(k3, xq, xkv, mask=mask)

  def loss(model, params, do):
    out = model.apply(params, xq, xkv, mask=mask)
    return jnp.vdot(out, do), out

  do = _x(jax.random.fold_in(rng_key, 5), *xq.shape)
  grad = lambda model: jax.jit(jax.grad(functools.partial(loss, model), has_aux=True))(params, do)
  grads, out = grad(_linen_model(fn))
  want_grads, want = grad(default)
  _close(out, want, what="output")
  _close_grads(grads, want_grads)


def test_linen_bf16_module(rng_key):
  """dtype=bfloat16 modules hand bf16 q/k/v to the attention function; the result stays bf16 and
  close to the default attention in the same precision."""
  x = _x(rng_key, 2, 33, F)
  mask = linen.make_causal_mask(x[..., 0])
  default = _linen_model(linen.dot_product_attention, dtype=jnp.bfloat16)
  ours = _linen_model(flax_attention_fn, dtype=jnp.bfloat16)
  params = default.init(jax.random.fold_in(rng_key, 1), x, mask=mask)
  out = jax.jit(lambda p: ours.apply(p, x, mask=mask))(params)
  want = jax.jit(lambda p: default.apply(p, x, mask=mask))(params)
  assert out.dtype == want.dtype == jnp.bfloat16
  _close(out, want, tol=2e-2, what="bf16 output")
