"""The running-statistics recurrence and the reference implementation.

1. A worked example small enough to check by hand: scores [0, 1, 2] over values [10, 20, 30]
   give sum(v * softmax(s)) = (10 + 20e + 30e^2) / (1 + e + e^2) = 25.752104; adding 1000 to
   every score changes nothing (the max is subtracted). Run through
   `numerics.online_softmax_step` one score at a time and through `pallas_attn.attention`.
2. 390 random score vectors of lengths 1..39 against a float64 numpy softmax, through the
   recurrence (one score at a time and in uneven chunks) and through `attention`.
3. The reference implementation against jax.nn.dot_product_attention(implementation="xla") in
   float32 on every shared case: output, residual lse, gradients.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import numerics

SCORES = [0.0, 1.0, 2.0]
VALUES = [10.0, 20.0, 30.0]
E = math.e
EXPECTED = (10 + 20 * E + 30 * E**2) / (1 + E + E**2)  # 25.752103826...
EXPECTED_LSE = 2.0 + math.log(1 + math.exp(-1) + math.exp(-2))  # 2.4076059644...


def test_worked_example_constant():
  assert abs(EXPECTED - 25.752104) < 1e-6


def _recurrence(scores, values, chunks):
  """Feed [rows, n] scores and values through online_softmax_step, `chunks` columns at a time
  (a list of chunk widths summing to n). Each row is its own one-query problem: statistics are
  [rows, 1], score tiles [rows, 1, width], value tiles [rows, width, head_dim=1].
  Returns (out [rows], lse [rows])."""
  rows = scores.shape[0]
  m = jnp.full((rows, 1), numerics.M_INIT, jnp.float32)
  l = jnp.zeros((rows, 1), jnp.float32)
  acc = jnp.zeros((rows, 1, 1), jnp.float32)
  start = 0
  for width in chunks:
    s = scores[:, None, start:start + width]
    v = values[:, start:start + width, None]
    m, l, acc = numerics.online_softmax_step(m, l, acc, s, v, jnp.float32)
    start += width
  assert start == scores.shape[1]
  out, lse = numerics.finish(m, l, acc, jnp.float32)
  return out[:, 0, 0], lse[:, 0]


@pytest.mark.parametrize("offset", [0.0, 1000.0])
@pytest.mark.parametrize("chunks", [[1, 1, 1], [3], [2, 1], [1, 2]], ids=str)
def test_worked_example_recurrence(offset, chunks):
  scores = jnp.asarray([SCORES], jnp.float32) + offset
  values = jnp.asarray([VALUES], jnp.float32)
  out, lse = _recurrence(scores, values, chunks)
  np.testing.assert_allclose(float(out[0]), 25.752104, rtol=0, atol=1e-6 * 25.752104)
  np.testing.assert_allclose(float(out[0]), EXPECTED, rtol=1e-6)
  np.testing.assert_allclose(float(lse[0]), EXPECTED_LSE + offset, rtol=1e-6)


def test_worked_example_recurrence_step_by_step():
  """The intermediate statistics after each score, by hand: the running max, the running sum of
  exp(s - max) and the unnormalized accumulator are rescaled by exp(m_old - m_new)."""
  m = jnp.full((1,), numerics.M_INIT, jnp.float32)  # one query: [rows=1]
  l = jnp.zeros((1,), jnp.float32)
  acc = jnp.zeros((1, 1), jnp.float32)  # [rows=1, head_dim=1]
  expected = [  # (m, l, acc) after scores[:i+1]
      (0.0, 1.0, 10.0),
      (1.0, math.exp(-1) + 1, 10 * math.exp(-1) + 20),
      (2.0, math.exp(-2) + math.exp(-1) + 1, 10 * math.exp(-2) + 20 * math.exp(-1) + 30),
  ]
  for s, v, (m_want, l_want, acc_want) in zip(SCORES, VALUES, expected):
    m, l, acc = numerics.online_softmax_step(m, l, acc, jnp.asarray([[s]], jnp.float32),
                                             jnp.asarray([[v]], jnp.float32), jnp.float32)
    assert m.shape == l.shape == (1,) and acc.shape == (1, 1)
    np.testing.assert_allclose([float(m[0]), float(l[0]), float(acc[0, 0])],
                               [m_want, l_want, acc_want], rtol=1e-6)


def _one_query(scores, values, dtype=jnp.float32):
  """One-query attention whose logits are exactly `scores` ([batch, n]): head_dim 1, q = 1,
  k = scores, v = values, scale 1."""
  scores = np.asarray(scores, np.float32)  # built on the host: no per-shape eager programs
  batch, n = scores.shape
  q = np.ones((batch, 1, 1, 1), dtype)
  k = scores.reshape(batch, n, 1, 1).astype(dtype)
  v = np.asarray(values, np.float32).reshape(batch, n, 1, 1).astype(dtype)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


@pytest.mark.parametrize("implementation", ["blocked_jax", "reference"])
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_worked_example_attention(implementation, offset):
  q, k, v = _one_query([[s + offset for s in SCORES]], [VALUES])
  out, lse = pallas_attn.attention(q, k, v, scale=1.0, implementation=implementation,
                                   return_residual=True)
  assert out.shape == (1, 1, 1, 1) and lse.shape == (1, 1, 1)
  np.testing.assert_allclose(float(out[0, 0, 0, 0]), 25.752104, rtol=0, atol=1e-6 * 25.752104)
  np.testing.assert_allclose(float(out[0, 0, 0, 0]), EXPECTED, rtol=1e-6)
  np.testing.assert_allclose(float(lse[0, 0, 0]), EXPECTED_LSE + offset, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Random score vectors against float64 numpy.

MAX_LEN = 39
PER_LEN = 10


def _random_problems(seed):
  """PER_LEN score/value vectors for every length 1..MAX_LEN (390 in all), padded to MAX_LEN.

  Scores mix scales: unit normals, normals * 10 (peaked softmax: the running max changes and the
  old statistics must be rescaled), and a per-row offset up to +-1000 (stability)."""
  rng_scores, rng_values, rng_offset = jax.random.split(jax.random.key(seed), 3)
  rows = MAX_LEN * PER_LEN
  lengths = np.repeat(np.arange(1, MAX_LEN + 1), PER_LEN)
  spread = np.tile(np.array([1.0, 1.0, 3.0, 10.0, 10.0]), rows // 5 + 1)[:rows, None]
  scores = np.asarray(jax.random.normal(rng_scores, (rows, MAX_LEN))) * spread
  offset = np.array(jax.random.uniform(rng_offset, (rows, 1), minval=-1000, maxval=1000))
  offset[::3] = 0.0
  scores = (scores + offset).astype(np.float32)
  values = np.asarray(jax.random.normal(rng_values, (rows, MAX_LEN)), np.float32) * 5
  return lengths, scores, values


def _numpy_softmax(lengths, scores, values):
  """float64 sum(v * softmax(s)) and logsumexp over the first `length` entries of each row."""
  outs, lses = [], []
  for n, s, v in zip(lengths, scores.astype(np.float64), values.astype(np.float64)):
    s, v = s[:n], v[:n]
    m = s.max()
    w = np.exp(s - m)
    outs.append((w * v).sum() / w.sum())
    lses.append(m + np.log(w.sum()))
  return np.asarray(outs), np.asarray(lses)


def _check_against_numpy(lengths, out, lse, want_out, want_lse, what):
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  assert out.shape == want_out.shape and lse.shape == want_lse.shape
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse)), what
  # Each output is a convex combination of values of magnitude ~5: compare at the scale of the
  # row's values.
  scale = np.maximum(np.abs(want_out), 1.0)
  bad = np.abs(out - want_out) > 2e-5 * scale
  assert not bad.any(), (f"{what}: {bad.sum()} of {len(out)} rows off, e.g. length "
                         f"{lengths[bad][0]}: {out[bad][0]!r} vs {want_out[bad][0]!r}")
  bad_lse = np.abs(lse - want_lse) > 1e-6 * np.maximum(np.abs(want_lse), 1.0)
  assert not bad_lse.any(), f"{what}: lse off on {bad_lse.sum()} rows"


def test_random_softmax_recurrence(seed):
  """All 390 rows through the recurrence, -inf padded to MAX_LEN: one score at a time, and in
  uneven chunks (the padding -inf scores must not disturb the statistics)."""
  lengths, scores, values = _random_problems(seed)
  want_out, want_lse = _numpy_softmax(lengths, scores, values)
  col = np.arange(MAX_LEN)[None, :]
  padded = np.where(col < lengths[:, None], scores, -np.inf).astype(np.float32)
  for chunks in ([1] * MAX_LEN, [7, 1, 13, 5, 8, 5], [MAX_LEN]):
    run = jax.jit(functools.partial(_recurrence, chunks=chunks))
    out, lse = run(jnp.asarray(padded), jnp.asarray(values))
    _check_against_numpy(lengths, out, lse, want_out, want_lse, f"recurrence, chunks {chunks}")


@functools.partial(jax.jit, static_argnames=("implementation",))
def _one_query_attention(q, k, v, kv_lengths, implementation):
  return pallas_attn.attention(q, k, v, scale=1.0, key_value_seq_lengths=kv_lengths,
                               implementation=implementation, return_residual=True)


def test_random_softmax_attention_per_length(seed):
  """For every length 1..39, one call of `attention(implementation="blocked_jax")` with a batch of
  10 one-query problems whose logits are the random scores (39 calls, 390 problems)."""
  lengths, scores, values = _random_problems(seed)
  want_out, want_lse = _numpy_softmax(lengths, scores, values)
  outs, lses = [], []
  for n in range(1, MAX_LEN + 1):
    rows = lengths == n
    q, k, v = _one_query(scores[rows, :n], values[rows, :n])
    out, lse = _one_query_attention(q, k, v, None, "blocked_jax")
    outs.append(np.asarray(out).reshape(-1))
    lses.append(np.asarray(lse).reshape(-1))
  _check_against_numpy(lengths, np.concatenate(outs), np.concatenate(lses), want_out, want_lse,
                       "attention(blocked_jax), one call per length")


@pytest.mark.parametrize("implementation", ["blocked_jax", "reference"])
def test_random_softmax_attention_batched(implementation, seed):
  """The same 390 problems in a single call: kv_len 39 and key_value_seq_lengths = length."""
  lengths, scores, values = _random_problems(seed)
  want_out, want_lse = _numpy_softmax(lengths, scores, values)
  q, k, v = _one_query(scores, values)
  out, lse = _one_query_attention(q, k, v, jnp.asarray(lengths, jnp.int32), implementation)
  _check_against_numpy(lengths, np.asarray(out).reshape(-1), np.asarray(lse).reshape(-1),
                       want_out, want_lse, f"attention({implementation}), one batched call")


# ------------------------------------------------------------------------------------------------
# The reference against jax.nn.


@pytest.mark.parametrize("case", cases.case_params((cases.F32,)))
def test_reference_matches_jax_nn_f32(case, seed):
  inputs = cases.make_inputs(case, seed)
  got = cases.run_attention(case, "reference", inputs)
  want = cases.run_jax_nn(case, inputs)
  for name in cases.QUANTITIES:
    err = cases.rel_err(got[name], want[name])
    assert err <= 1e-5, f"{name}: reference vs jax.nn rel err {err:.3e}"
    # Same exact zeros as jax.nn (rows past the query length, keys nothing sees, ...).
    np.testing.assert_array_equal(cases._zero_rows(got[name]), cases._zero_rows(want[name]),
                                  err_msg=f"{name}: exactly-zero rows differ from jax.nn")
  # jax.nn's residual is meaningful in float32: compare it everywhere; fully masked rows are
  # MASK_VALUE in both, exactly.
  empty = np.broadcast_to(case.empty_rows()[:, :, None], got.lse.shape)
  np.testing.assert_array_equal(want.lse[empty], np.float32(numerics.MASK_VALUE))
  np.testing.assert_array_equal(got.lse[empty], np.float32(numerics.MASK_VALUE))
  assert not (want.lse[~empty] == np.float32(numerics.MASK_VALUE)).any()
  if (~empty).any():
    assert cases.rel_err(got.lse[~empty], want.lse[~empty]) <= 1e-6
  for name in ("out", "lse", "dq", "dk", "dv"):
    assert got.dtypes[name] == np.float32


def test_expected_zero_rows_match_jax_nn():
  """`cases.expected_zero_rows` (what the checks demand) is what jax.nn does, on the cases that
  have fully masked rows and padded keys."""
  for name in ("window_lengths_emptyrows_113x203", "lengths_kv0_113x203",
               "window8_emptyrows_203x64", "qlengths_only_65x33"):
    case = cases.get_case(name)
    want = cases.run_jax_nn(case, cases.make_inputs(case, 0))
    expected = cases.expected_zero_rows(case)
    for q in cases.QUANTITIES:
      zero = cases._zero_rows(want[q])
      must = np.broadcast_to(expected[q][:, :, None], zero.shape)
      if q in ("out", "dv"):
        np.testing.assert_array_equal(zero, must, err_msg=f"{name}: {q}")
      else:
        # dq/dk may also be exactly zero where they are only mathematically zero: a query that
        # sees a single key has a one-hot softmax, whose Jacobian vanishes.
        assert not (must & ~zero).any(), f"{name}: {q}"
  # The case that motivates the exception: keys past kv length get dv from fully masked rows.
  case = cases.get_case("window_lengths_emptyrows_113x203")
  expected = cases.expected_zero_rows(case)
  assert not expected["dv"][0, 60] and expected["dk"][0, 60]
