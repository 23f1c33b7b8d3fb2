"""The blocked path never materializes a [q_len, kv_len] array, forward or backward.

The jaxpr of `jax.jit(jax.grad(loss))` is walked recursively (pjit, custom_vjp, while/scan/cond
bodies, every jaxpr held in an equation's params) and every value whose shape has one axis equal
to the query length (or a padded size of it) and another equal to the key length (or a padded
size) is flagged. The lengths, 1000 and 1100, differ from each other, from every block size and
from every other dimension, so a hit can only be a score-like array. The same walker flags the
reference implementation (so the check can fail), and the compiled HLO is checked the same way.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import cases
import pallas_attn

Q_LEN, KV_LEN = 1000, 1100
B, HQ, HKV, D = 2, 4, 2, 64

VARIANTS = {
    "plain": dict(),
    "causal_window_lengths_gqa": dict(is_causal=True, local_window_size=(200, 0),
                                      query_seq_lengths=jnp.asarray([Q_LEN, 700], jnp.int32),
                                      key_value_seq_lengths=jnp.asarray([KV_LEN, 0], jnp.int32)),
    "window_noncausal": dict(local_window_size=(64, 32)),
}


def _args(dtype=jnp.float32):
  q = jax.ShapeDtypeStruct((B, Q_LEN, HQ, D), dtype)
  kv = jax.ShapeDtypeStruct((B, KV_LEN, HKV, D), dtype)
  return q, kv, kv, q


def _grad_fn(implementation, return_residual=False, **kwargs):
  def loss(q, k, v, do):
    out = pallas_attn.attention(q, k, v, implementation=implementation,
                                return_residual=return_residual, **kwargs)
    if return_residual:
      out, lse = out
      return jnp.vdot(out, do).astype(jnp.float32) + lse.sum()
    return jnp.vdot(out, do).astype(jnp.float32)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _check_blocked(report):
  assert not report, "materialized [q_len, kv_len] values:\n" + "\n".join(
      f"  {path}  {prim}  {shape} {dtype}" for path, prim, shape, dtype in report.offenders[:20])
  # The walk must have reached the loops of the forward and the custom_vjp backward, else the
  # test would pass vacuously.
  assert report.primitives.get("while", 0) + report.primitives.get("scan", 0) >= 3, (
      report.primitives)
  assert report.num_values > 200


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocked_jaxpr_has_no_quadratic_value(variant, dtype):
  fn = _grad_fn("blocked_jax", **VARIANTS[variant])
  _check_blocked(cases.find_quadratic_intermediates(fn, *_args(dtype), q_len=Q_LEN,
                                                    kv_len=KV_LEN))


def test_blocked_jaxpr_with_residual_and_default_dispatch():
  fn = _grad_fn(None, return_residual=True, is_causal=True)  # None picks blocked_jax on CPU
  _check_blocked(cases.find_quadratic_intermediates(fn, *_args(), q_len=Q_LEN, kv_len=KV_LEN))


# Score modifications on the blocked path: the only [q_len, kv_len]-sized values allowed are the
# caller's own bias and mask and, in the backward pass, the bias gradient (a buffer of the bias's
# shape that the tiles are scattered into).
FEATURE_VARIANTS = {
    "bias_heads_segments_causal": dict(bias=(1, HQ, Q_LEN, KV_LEN), is_causal=True),
    "bias_batch_mask_everything": dict(
        bias=(B, 1, Q_LEN, KV_LEN), mask=(1, 1, Q_LEN, KV_LEN), is_causal=True,
        causal_alignment="bottom_right", logits_soft_cap=30.0, alibi=True, dropout_rate=0.1,
        mask_fn=lambda b, h, i, j: (i + j) % 7 != 0, score_fn=lambda s, b, h, i, j: s * 0.9),
}


@pytest.mark.parametrize("variant", list(FEATURE_VARIANTS))
def test_blocked_score_modifications_have_no_quadratic_value_but_the_bias(variant):
  options = dict(FEATURE_VARIANTS[variant])
  bias_shape, mask_shape = options.pop("bias"), options.pop("mask", None)
  alibi = options.pop("alibi", False)
  dropout_rate = options.get("dropout_rate", 0.0)

  def loss(q, k, v, do, bias, mask, q_ids, kv_ids, slopes, key):
    out = pallas_attn.attention(
        q, k, v, bias, mask, segment_ids=(q_ids, kv_ids), alibi_slopes=slopes,
        dropout_rng=key if dropout_rate else None, implementation="blocked_jax", **options)
    return jnp.vdot(out, do).astype(jnp.float32)

  sds = jax.ShapeDtypeStruct
  args = (*_args(), sds(bias_shape, jnp.float32),
          None if mask_shape is None else sds(mask_shape, jnp.bool_),
          sds((B, Q_LEN), jnp.int32), sds((B, KV_LEN), jnp.int32),
          sds((HQ,), jnp.float32) if alibi else None, jax.random.key(0))
  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4)))
  report = cases.find_quadratic_intermediates(fn, *args, q_len=Q_LEN, kv_len=KV_LEN)
  allowed = {bias_shape, mask_shape}
  seen_bias = [o for o in report.offenders if o[2] == bias_shape]
  assert seen_bias, "the bias (an input) should have been seen: is the walk blind?"
  report.offenders = [o for o in report.offenders if o[2] not in allowed]
  _check_blocked(report)


def test_walker_flags_the_reference():
  """The reference materializes [B, H, T, S] scores: the walker must say so, including inside
  the jit and in the backward pass."""
  report = cases.find_quadratic_intermediates(_grad_fn("reference", is_causal=True), *_args(),
                                              q_len=Q_LEN, kv_len=KV_LEN)
  assert report
  shapes = {shape for _, _, shape, _ in report.offenders}
  assert (B, HQ, Q_LEN, KV_LEN) in shapes, shapes
  assert all(path.startswith("/jit") for path, *_ in report.offenders), report.offenders[:3]
  # Also a padded size on either axis counts.
  padded = cases.find_quadratic_intermediates(
      jax.jit(lambda x: jnp.pad(x, ((0, 24), (0, 52)))),
      jax.ShapeDtypeStruct((Q_LEN, KV_LEN), jnp.float32), q_len=Q_LEN, kv_len=KV_LEN)
  assert (1024, 1152) in {shape for _, _, shape, _ in padded.offenders}


def test_walker_enters_nested_jaxprs():
  """Quadratic values hidden in a cond branch, a while body, a scan body, a remat and a
  custom_vjp call (forward, not differentiated: the call keeps its own jaxpr) are all found, and
  the path says where."""
  ones = lambda: jnp.ones(KV_LEN)

  @jax.custom_vjp
  def hidden(x):
    return jnp.outer(x, ones()).sum(1)

  hidden.defvjp(lambda x: (hidden(x), None), lambda _, g: (g,))

  def f(x, p):
    a = jax.lax.cond(p, lambda x: jnp.outer(x, ones()).sum(), lambda x: 0.0, x)
    b = jax.lax.fori_loop(0, jnp.int32(p) + 1,
                          lambda i, c: c + jnp.outer(x, ones()).sum(), 0.0)
    c = jax.lax.scan(lambda c, _: (c + jnp.outer(x, ones()).sum(), None), 0.0, None, length=2)[0]
    d = jax.checkpoint(lambda x: jnp.outer(x, ones()).sum())(x)
    return a + b + c + d + hidden(x).sum()

  x = jax.ShapeDtypeStruct((Q_LEN,), jnp.float32)
  p = jax.ShapeDtypeStruct((), bool)
  report = cases.find_quadratic_intermediates(jax.jit(f), x, p, q_len=Q_LEN, kv_len=KV_LEN)
  paths = " ".join(path for path, *_ in report.offenders)
  for where in ("cond.branches", "while.body_jaxpr", "scan.jaxpr", "remat2.jaxpr",
                "custom_vjp_call.call_jaxpr"):
    assert where in paths, (where, paths)
  # And the backward of the custom_vjp, once differentiated (inlined into the outer jaxpr).
  hidden.defvjp(lambda x: (x, None), lambda _, g: (jnp.outer(g, ones()).sum(1),))
  report = cases.find_quadratic_intermediates(jax.grad(lambda x: hidden(x).sum()), x,
                                              q_len=Q_LEN, kv_len=KV_LEN)
  assert report


def _hlo_texts(fn, args):
  lowered = fn.lower(*args)
  return lowered.as_text(), lowered.compile().as_text()


@pytest.mark.parametrize("variant", ["plain", "causal_window_lengths_gqa"])
def test_blocked_compiled_hlo_has_no_quadratic_buffer(variant):
  fn = _grad_fn("blocked_jax", **VARIANTS[variant])
  stablehlo, hlo = _hlo_texts(fn, _args())
  for name, text in (("StableHLO", stablehlo), ("compiled HLO", hlo)):
    found = cases.find_quadratic_in_text(text, q_len=Q_LEN, kv_len=KV_LEN)
    assert not found, f"{name} has quadratic shapes {found}"
  # Sanity: the parser does see the inputs' shapes in both texts.
  for text in (stablehlo, hlo):
    assert cases.find_quadratic_in_text(text, q_len=Q_LEN, kv_len=HQ, q_sizes={Q_LEN},
                                        kv_sizes={HQ}), "no [.., q_len, heads, ..] shape parsed"


def test_hlo_check_flags_the_reference():
  stablehlo, hlo = _hlo_texts(_grad_fn("reference"), _args())
  for text in (stablehlo, hlo):
    assert (B, HQ, Q_LEN, KV_LEN) in cases.find_quadratic_in_text(text, q_len=Q_LEN,
                                                                  kv_len=KV_LEN)
