"""Shared attention test cases and numeric checks, for every implementation of `pallas_attn`.

Usage from a test file (tests/ is put on sys.path by tests/conftest.py):

    import cases

    @pytest.mark.parametrize("case", cases.case_params((jnp.bfloat16, jnp.float16), small=True,
                                                       head_dim=64))
    def test_mosaic(case, seed):
      cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed)

What `check_case` checks, for one `Case` (shapes, mask, dtype) and one implementation:

* inputs are fresh `jax.random.normal` draws (never zeros), cast to the case dtype; the output
  cotangent is random too (never `.sum()`), so every gradient entry is exercised;
* the oracle is `attention(..., implementation="reference")` run in float32 on the upcast
  inputs (so the oracle sees exactly the values the implementation sees);
* metric: relative L2 error ||x - ref|| / ||ref|| (the RMS of x - ref when ref is all zeros);
  dq / dk rows that are zero only in exact arithmetic (`rounding_zero_rows`: a query that sees
  one key) are left out of it and held to their RMS difference instead;
* two bounds, both must hold, for the output and dq/dk/dv:
    - a fixed per-dtype tolerance (`TOLERANCES`);
    - the FlashAttention criterion: err(impl) <= 2 * err(reference run in the same low precision
      on the same inputs) + `FLOORS[dtype]` (for float32 the low-precision reference *is* the
      oracle, so this reduces to the floor; `criterion_factor` changes the 2 where a test says
      why);
* NaN/inf never pass;
* lse (return_residual=True) is float32, compared on rows that see at least one key; rows that
  see no key (fully masked, or at/after their query length) must be exactly `numerics.MASK_VALUE`,
  as jax.nn gives;
* result dtypes equal the input dtype (out, dq, dk, dv);
* exact zeros required by the mask (`expected_zero_rows`): rows at/after query_seq_lengths have
  zero output and zero dq; fully masked rows have zero dq; keys no valid row sees get zero dk,
  and zero dv unless some valid row of that batch element is fully masked (jax.nn spreads such a
  row uniformly over *all* keys, padded ones included, so they get do / kv_len);
* semantics agree with `jax.nn.dot_product_attention(implementation="xla")` (float32, upcast
  inputs, highest matmul precision): same values within the tolerance, jax.nn is zero wherever
  the mask says so, and every row exactly zero here is exactly zero in jax.nn too.

Also here: `find_quadratic_intermediates` / `find_quadratic_in_text` (no [q_len, kv_len] value
in a traced or compiled program), used by test_no_quadratic.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
from pallas_attn import numerics

F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)
ALL_DTYPES = (F32, BF16, F16)
LOW_PRECISION_DTYPES = (BF16, F16)

_DTYPE_NAMES = {F32: "f32", BF16: "bf16", F16: "f16"}

QUANTITIES = ("out", "dq", "dk", "dv")

# Fixed relative-L2 tolerances per dtype, for the output, the gradients and the lse.
TOLERANCES: dict[np.dtype, dict[str, float]] = {
    F32: dict(out=1e-5, dq=2e-5, dk=2e-5, dv=1e-5, lse=1e-5),
    BF16: dict(out=1.5e-2, dq=2e-2, dk=2e-2, dv=1.5e-2, lse=1e-4),
    F16: dict(out=1e-2, dq=1e-2, dk=1e-2, dv=1e-2, lse=1e-4),
}
# Absolute floor of the FlashAttention criterion: err <= 2 * err(low-precision reference) + floor.
FLOORS: dict[np.dtype, float] = {F32: 2e-5, BF16: 1e-3, F16: 2e-4}


def dtype_name(dtype) -> str:
  return _DTYPE_NAMES.get(np.dtype(dtype), np.dtype(dtype).name)


# ------------------------------------------------------------------------------------------------
# Cases.


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: shapes, mask, dtype. Hashable (it is a static jit argument)."""

  batch: int
  q_len: int
  kv_len: int
  heads_q: int
  heads_kv: int
  head_dim: int
  is_causal: bool = False
  local_window: int | tuple[int, int] | None = None
  q_lengths: Sequence[int] | None = None
  kv_lengths: Sequence[int] | None = None
  dtype: Any = F32
  scale: float | None = None
  causal_alignment: str = "top_left"  # "bottom_right": jax.nn cannot express it (not compared)
  name: str = ""

  def __post_init__(self):
    # Lists are accepted but stored as tuples so that the case stays hashable.
    for field in ("q_lengths", "kv_lengths", "local_window"):
      value = getattr(self, field)
      if isinstance(value, (list, tuple)):
        object.__setattr__(self, field, tuple(int(x) for x in value))
    object.__setattr__(self, "dtype", np.dtype(self.dtype))
    for field in ("q_lengths", "kv_lengths"):
      value = getattr(self, field)
      if value is not None and len(value) != self.batch:
        raise ValueError(f"{self.name}: {field} needs {self.batch} entries, got {value}")

  def replace(self, **kw) -> "Case":
    return dataclasses.replace(self, **kw)

  @property
  def id(self) -> str:
    return f"{self.name}-{dtype_name(self.dtype)}"

  @property
  def window_pair(self) -> tuple[int, int] | None:
    if self.local_window is None or isinstance(self.local_window, tuple):
      return self.local_window
    return (int(self.local_window), int(self.local_window))

  def shapes(self):
    q = (self.batch, self.q_len, self.heads_q, self.head_dim)
    kv = (self.batch, self.kv_len, self.heads_kv, self.head_dim)
    return q, kv

  def lengths(self):
    """(query_seq_lengths, key_value_seq_lengths) as int32 arrays or None."""
    as_arr = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    return as_arr(self.q_lengths), as_arr(self.kv_lengths)

  @property
  def offset(self) -> int:
    """Query t sits on the diagonal at key t + offset (FlashAttention's bottom-right alignment)."""
    return self.kv_len - self.q_len if self.causal_alignment == "bottom_right" else 0

  def static_kwargs(self) -> dict:
    """The keyword arguments of `attention` / `jax.nn.dot_product_attention` besides lengths
    (causal_alignment only when it is not jax.nn's top-left)."""
    kwargs = dict(scale=self.scale, is_causal=self.is_causal, local_window_size=self.local_window)
    if self.causal_alignment != "top_left":
      kwargs["causal_alignment"] = self.causal_alignment
    return kwargs

  # Masks in numpy, straight from the jax.nn definition (independent of pallas_attn.mask).
  def visible(self) -> np.ndarray:
    """[batch, q_len, kv_len] bool: query t of batch b sees key s."""
    t = np.arange(self.q_len)[:, None] + self.offset
    s = np.arange(self.kv_len)[None, :]
    vis = np.ones((self.q_len, self.kv_len), bool)
    if self.is_causal:
      vis &= s <= t
    if self.window_pair is not None:
      left, right = self.window_pair
      vis &= (t <= s + left) & (t >= s - right)
    vis = np.broadcast_to(vis, (self.batch, self.q_len, self.kv_len)).copy()
    if self.q_lengths is not None:
      vis &= np.arange(self.q_len)[None, :, None] < np.asarray(self.q_lengths)[:, None, None]
    if self.kv_lengths is not None:
      vis &= np.arange(self.kv_len)[None, None, :] < np.asarray(self.kv_lengths)[:, None, None]
    return vis

  def valid_rows(self) -> np.ndarray:
    """[batch, q_len] bool: the row is before its query length."""
    rows = np.ones((self.batch, self.q_len), bool)
    if self.q_lengths is not None:
      rows &= np.arange(self.q_len)[None, :] < np.asarray(self.q_lengths)[:, None]
    return rows

  def empty_rows(self) -> np.ndarray:
    """[batch, q_len] bool: the row sees no key (fully masked or past its query length)."""
    return ~self.visible().any(-1)


def _c(name, batch, q_len, kv_len, heads_q, heads_kv, head_dim=64, **kw) -> Case:
  return Case(batch=batch, q_len=q_len, kv_len=kv_len, heads_q=heads_q, heads_kv=heads_kv,
              head_dim=head_dim, name=name, **kw)


# Small cases (lengths <= 256): cheap enough for an interpreter; every feature appears here.
SMALL_CASES: tuple[Case, ...] = (
    _c("mha_17x17", 2, 17, 17, 2, 2),
    _c("single_1x1", 1, 1, 1, 2, 2),
    _c("noncausal_1x17", 2, 1, 17, 2, 2),
    _c("causal_17x1", 2, 17, 1, 2, 2, is_causal=True),
    _c("causal_113x203", 1, 113, 203, 2, 2, is_causal=True),
    _c("causal_203x113", 1, 203, 113, 2, 2, is_causal=True),
    _c("causal_1x239", 2, 1, 239, 2, 2, is_causal=True),
    _c("gqa_causal_113x203", 2, 113, 203, 4, 2, is_causal=True),
    _c("mqa_113x203", 1, 113, 203, 4, 1),
    _c("mqa_causal_203x113", 1, 203, 113, 4, 1, is_causal=True),
    _c("window16_113x203", 1, 113, 203, 2, 2, local_window=16),
    _c("window_l32_r8_203x113", 1, 203, 113, 2, 2, local_window=(32, 8)),
    _c("window_l24_r0_noncausal_113x203", 1, 113, 203, 2, 2, local_window=(24, 0)),
    # T > S: rows t >= 64 + 8 see no key at all (fully masked rows -> mean of v).
    _c("window8_emptyrows_203x64", 1, 203, 64, 2, 2, local_window=8),
    _c("causal_window_l16_emptyrows_203x64", 1, 203, 64, 4, 2, is_causal=True,
       local_window=(16, 4)),
    # Batch 1 has kv length 0 (every row fully masked); rows past q length are padding.
    _c("lengths_kv0_113x203", 3, 113, 203, 2, 2, q_lengths=[113, 50, 7],
       kv_lengths=[203, 0, 120]),
    _c("gqa_causal_lengths_113x203", 2, 113, 203, 4, 2, is_causal=True,
       q_lengths=[100, 113], kv_lengths=[37, 203]),
    # Valid rows fully masked by the window while keys past kv length exist: jax.nn gives those
    # padded keys a nonzero dv (the uniform row covers every key).
    _c("window_lengths_emptyrows_113x203", 2, 113, 203, 2, 2, local_window=8,
       q_lengths=[90, 113], kv_lengths=[50, 203]),
    _c("qlengths_only_65x33", 2, 65, 33, 2, 2, q_lengths=[0, 40]),
    # Rows 7 on see no key: dv is mostly the empty rows' share, a sum of d_out over ~190 rows
    # and the group's heads (it exceeded the FlashAttention bound when summed in bf16 / f16).
    _c("window5_mostly_empty_rows_200x2", 2, 200, 2, 4, 2, local_window=5),
    _c("user_scale_65x129", 2, 65, 129, 2, 2, scale=0.3),
    _c("small_headdim_user_scale_33x47", 2, 33, 47, 2, 1, head_dim=16, scale=0.25),
)

# Long cases: several blocks in both directions, lengths not multiples of any block size.
LARGE_CASES: tuple[Case, ...] = (
    _c("mha_1000x1000", 1, 1000, 1000, 2, 2),
    _c("causal_1023x1024", 1, 1023, 1024, 2, 2, is_causal=True),
    _c("gqa_causal_window_lengths_1000x1000", 2, 1000, 1000, 4, 2, is_causal=True,
       local_window=(100, 0), q_lengths=[1000, 617], kv_lengths=[1000, 555]),
)

ALL_CASES = SMALL_CASES + LARGE_CASES

# FlashAttention's bottom-right alignment (query t sees key s iff s <= t + kv_len - q_len). Not in
# ALL_CASES: jax.nn, which the shared checks also compare against, has no such option.
ALIGNMENT_CASES: tuple[Case, ...] = (
    _c("br_causal_113x203", 1, 113, 203, 2, 2, is_causal=True, causal_alignment="bottom_right"),
    # T > S: the first 90 rows see no key (mean of v).
    _c("br_causal_203x113", 1, 203, 113, 2, 2, is_causal=True, causal_alignment="bottom_right"),
    _c("br_gqa_causal_window_l16_113x203", 2, 113, 203, 4, 2, is_causal=True,
       local_window=(16, 4), causal_alignment="bottom_right"),
    _c("br_window_l8_r2_lengths_203x64", 2, 203, 64, 2, 2, local_window=(8, 2),
       kv_lengths=[64, 30], causal_alignment="bottom_right"),
)

# Very peaked softmax (logit std 16 at head_dim 16, 32 at 64): the low-precision backward's rounding
# is amplified by the cancellation in dP - delta. Not in ALL_CASES: see
# test_blocked_jax.test_peaky_softmax_gradients and test_mosaic_gpu's peaky tests.
PEAKY_CASES: tuple[Case, ...] = (
    _c("peaky_scale4_128x128", 2, 128, 128, 4, 2, head_dim=16, scale=4.0),
)


# Lengths of `random_case`: 1 and 2 (a row or a key alone), odd ones and block multiples.
_RANDOM_LENGTHS = (1, 2, 17, 64, 113, 130, 200)


def random_case(index: int, head_dims: Sequence[int], dtypes: Sequence) -> Case:
  """Case `index` of a fixed sequence of random problems: the position masks drawn together
  (causal and its alignment, windows of either form, query and key lengths, zero ones included,
  GQA groups, a user scale) at short lengths, so that their interactions are tested beyond the
  named cases. The same index always gives the same case; `dtypes[index % len(dtypes)]`."""
  rng = np.random.default_rng(index)
  batch = int(rng.integers(1, 4))
  q_len = int(rng.choice(_RANDOM_LENGTHS))
  kv_len = q_len if rng.random() < 0.4 else int(rng.choice(_RANDOM_LENGTHS))
  heads_kv = int(rng.choice([1, 2]))
  heads_q = heads_kv * int(rng.choice([1, 2, 3]))
  kw = {}
  if rng.random() < 0.5:
    kw["is_causal"] = True
  if rng.random() < 0.3:
    kw["causal_alignment"] = "bottom_right"
  if rng.random() < 0.35:
    left, right = (int(x) for x in rng.integers(0, 48, 2))
    kw["local_window"] = (left, right) if rng.random() < 0.7 else left
  if rng.random() < 0.35:
    kw["q_lengths"] = [int(x) for x in rng.integers(0, q_len + 1, batch)]
  if rng.random() < 0.35:
    kw["kv_lengths"] = [int(x) for x in rng.integers(0, kv_len + 1, batch)]
  if rng.random() < 0.3:  # (up to 2x jax.nn's at head_dim 64: peaked rows are PEAKY_CASES')
    kw["scale"] = float(np.round(rng.uniform(0.05, 0.25), 3))
  return _c(f"random{index}", batch, q_len, kv_len, heads_q, heads_kv,
            head_dim=int(rng.choice(head_dims)), dtype=dtypes[index % len(dtypes)], **kw)


def get_case(name: str) -> Case:
  for case in ALL_CASES + PEAKY_CASES + ALIGNMENT_CASES:
    if case.name == name:
      return case
  raise KeyError(name)


def case_params(dtypes=ALL_DTYPES, small: bool = False, head_dim: int | None = None,
                marks=()) -> list:
  """`pytest.param(Case, id="<name>-<dtype>")` for every case and dtype.

  small: only the short cases (lengths <= 256; all features still covered).
  head_dim: override every case's head_dim (e.g. 64 for kernels with a fixed set of head dims).
  marks: extra pytest marks for every param.
  """
  base = SMALL_CASES if small else ALL_CASES
  params = []
  for case in base:
    for dtype in dtypes:
      c = case.replace(dtype=np.dtype(dtype))
      if head_dim is not None:
        c = c.replace(head_dim=head_dim)
      params.append(pytest.param(c, id=c.id, marks=marks))
  return params


# ------------------------------------------------------------------------------------------------
# Running one case.


def _normal(key, shape, dtype) -> jax.Array:
  """`jax.random.normal` draws of `shape`, cast to `dtype`.

  Drawn as a flat vector whose length is rounded up to a power of two (then cut and reshaped on
  the host) so that the random-number program compiles for a handful of sizes instead of once per
  shape; the cast happens in numpy for the same reason.
  """
  size = int(np.prod(shape))
  padded = max(1024, 1 << (size - 1).bit_length())
  flat = np.asarray(jax.random.normal(key, (padded,), jnp.float32))
  return jnp.asarray(flat[:size].reshape(shape).astype(np.dtype(dtype)))


def make_inputs(case: Case, seed: int):
  """Fresh random q, k, v and output cotangent `do` in the case dtype (drawn in float32 from
  `jax.random.normal`; never zeros)."""
  q_shape, kv_shape = case.shapes()
  kq, kk, kv, kdo = jax.random.split(jax.random.key(seed), 4)
  return (_normal(kq, q_shape, case.dtype), _normal(kk, kv_shape, case.dtype),
          _normal(kv, kv_shape, case.dtype), _normal(kdo, q_shape, case.dtype))


@dataclasses.dataclass
class Result:
  """One run: out [B,T,Hq,D], lse [B,T,Hq] float32, and the gradients of <out, do>.

  Held in float32 on the host: it holds every value of the case dtypes exactly, and at half
  float64's bytes the long split-KV cases (dk, dv of 16 x 32768 x 8 x 128 in four results) fit
  four pytest workers in the GPU machine's host memory (in float64 they crashed a worker).
  `rel_err` sums in float64.
  """

  out: np.ndarray
  lse: np.ndarray
  dq: np.ndarray
  dk: np.ndarray
  dv: np.ndarray
  dtypes: dict

  def __getitem__(self, name):
    return getattr(self, name)


def _to_result(out, lse, grads) -> Result:
  dq, dk, dv = grads
  arrays = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
  dtypes = {k: np.dtype(x.dtype) for k, x in arrays.items()}
  host = {k: np.asarray(x).astype(np.float32) for k, x in arrays.items()}
  return Result(**host, dtypes=dtypes)


@functools.partial(jax.jit, static_argnames=("case", "implementation", "interpret"))
def _attention_vjp(q, k, v, do, q_lengths, kv_lengths, *, case, implementation, interpret):
  def f(q, k, v):
    out, lse = pallas_attn.attention(
        q, k, v, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        implementation=implementation, return_residual=True, interpret=interpret,
        **case.static_kwargs())
    return out, lse

  out, vjp, lse = jax.vjp(f, q, k, v, has_aux=True)
  return out, lse, vjp(do)


@functools.partial(jax.jit, static_argnames=("case",))
def _jax_nn_vjp(q, k, v, do, q_lengths, kv_lengths, *, case):
  def f(q, k, v):
    with jax.default_matmul_precision("highest"):
      out, lse = jax.nn.dot_product_attention(
          q, k, v, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
          implementation="xla", return_residual=True, **case.static_kwargs())
    return out, lse

  out, vjp, lse = jax.vjp(f, q, k, v, has_aux=True)
  return out, lse, vjp(do)


def run_attention(case: Case, implementation: str, inputs, interpret: bool = False) -> Result:
  """`attention(..., implementation, return_residual=True)` and its vjp, under jit."""
  q, k, v, do = inputs
  q_lengths, kv_lengths = case.lengths()
  return _to_result(*_attention_vjp(q, k, v, do, q_lengths, kv_lengths, case=case,
                                    implementation=implementation, interpret=interpret))


def _upcast(inputs):
  return tuple(jnp.asarray(np.asarray(x).astype(np.float32)) for x in inputs)


def run_oracle(case: Case, inputs) -> Result:
  """The reference implementation in float32 on the upcast inputs."""
  return run_attention(case.replace(dtype=F32), "reference", _upcast(inputs))


def run_jax_nn(case: Case, inputs) -> Result:
  """jax.nn.dot_product_attention(implementation="xla") in float32 on the upcast inputs."""
  q, k, v, do = _upcast(inputs)
  q_lengths, kv_lengths = case.lengths()
  return _to_result(*_jax_nn_vjp(q, k, v, do, q_lengths, kv_lengths,
                                 case=case.replace(dtype=F32)))


# ------------------------------------------------------------------------------------------------
# Metrics and checks.


_REL_ERR_CHUNK = 1 << 22  # elements: 32 MiB of float64 a temporary


def rel_err(x, ref) -> float:
  """||x - ref|| / ||ref|| in float64; NaN if x has a non-finite entry (NaN never passes a `<=`
  test). When ref is all zeros (e.g. dq of a query that sees a single key), the RMS of x - ref:
  the inputs are unit normals, so a gradient entry is O(1) and the RMS plays the same role.
  Summed in chunks, so the float64 temporaries stay small however large the arrays are."""
  x, ref = np.asarray(x), np.asarray(ref)
  if x.shape != ref.shape:
    raise AssertionError(f"shape mismatch: {x.shape} vs reference {ref.shape}")
  x, ref = x.reshape(-1), ref.reshape(-1)
  diff_sq = norm_sq = 0.0
  for start in range(0, x.size, _REL_ERR_CHUNK):
    x_chunk = x[start:start + _REL_ERR_CHUNK].astype(np.float64)
    if not np.all(np.isfinite(x_chunk)):
      return float("nan")
    ref_chunk = ref[start:start + _REL_ERR_CHUNK].astype(np.float64)
    diff_chunk = x_chunk - ref_chunk
    diff_sq += float(np.dot(diff_chunk, diff_chunk))
    norm_sq += float(np.dot(ref_chunk, ref_chunk))
  diff, norm = np.sqrt(diff_sq), np.sqrt(norm_sq)
  return diff / norm if norm > 0 else diff / np.sqrt(max(x.size, 1))


def rounding_zero_rows(case: Case) -> dict[str, np.ndarray]:
  """Rows of dq / dk that are zero in exact arithmetic but round to tiny values: [B, T] / [B, S].

  A query that sees one key has dS = P (dP - delta) = 1 * (dP - dP) = 0, so its dq row is zero;
  a key seen only by such queries gets no dk. In float arithmetic dP and delta are summed in
  different orders and the row is rounding noise, in the oracle too, where a relative error
  would compare noise with noise. `check_case` holds those rows to an absolute bound instead
  (their RMS difference, as for a reference that is all zeros) and leaves them out of the
  relative errors. Rows `expected_zero_rows` makes exactly zero are not included.
  """
  vis = case.visible()
  one_key = vis.sum(axis=-1) == 1  # [B, T]
  seen_by_more = (vis & ~one_key[:, :, None]).any(axis=1)  # [B, S]
  return dict(dq=one_key & case.valid_rows(), dk=vis.any(axis=1) & ~seen_by_more)


def _split_rows(x: np.ndarray, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
  """(x with `rows` [B, T|S] zeroed, x's entries on `rows`) of an [B, T|S, H, D] array."""
  if rows is None or not rows.any():
    return x, x[:0]
  return np.where(rows[:, :, None, None], 0, x), x[rows]


def _relative_and_noise_errors(x, ref, rows) -> tuple[float, float]:
  """(`rel_err` of x off `rows`, RMS of x - ref on them (0.0 without any))."""
  x_signal, x_noise = _split_rows(x, rows)
  ref_signal, ref_noise = _split_rows(ref, rows)
  noise = 0.0
  if x_noise.size:
    diff = x_noise.astype(np.float64) - ref_noise.astype(np.float64)
    noise = float(np.sqrt(np.mean(diff * diff)))
  return rel_err(x_signal, ref_signal), noise


def _zero_rows(x: np.ndarray) -> np.ndarray:
  """[..., D] -> [...] bool: every entry of the last axis is exactly zero."""
  return np.all(x == 0, axis=-1)


def expected_zero_rows(case: Case) -> dict[str, np.ndarray]:
  """Which rows jax.nn's semantics make exactly zero, from the mask alone.

  out/dq: [B, T] (same for every head): rows at/after the query length (dq also on valid rows
  that are fully masked: their output is the mean of v, which does not depend on q).
  dk/dv: [B, S]: keys no valid row sees get no dk; nor dv, unless a valid row of that batch
  element is fully masked (its uniform softmax row covers every key).
  """
  vis = case.visible()
  valid = case.valid_rows()
  empty = case.empty_rows()
  seen = vis.any(axis=1)  # [B, S]
  valid_empty = (valid & empty).any(axis=1)  # [B]
  return dict(out=~valid, dq=empty, dk=~seen, dv=~seen & ~valid_empty[:, None])


@dataclasses.dataclass
class CheckReport:
  case: Case
  implementation: str
  errors: dict  # quantity -> error vs the oracle
  reference_errors: dict  # quantity -> error of the low-precision reference vs the oracle
  bounds: dict
  jax_nn_errors: dict
  failures: list

  def __str__(self):
    lines = [f"{self.case.id} via {self.implementation}:"]
    for name in self.errors:
      lines.append(f"  {name:4s} err {self.errors[name]:.3e}  low-prec ref err "
                   f"{self.reference_errors.get(name, 0.0):.3e}  bound {self.bounds[name]:.3e}"
                   f"  vs jax.nn {self.jax_nn_errors.get(name, float('nan')):.3e}")
    return "\n".join(lines)


def check_case(case: Case, implementation: str, interpret: bool = False, seed: int = 0, *,
               compare_jax_nn: bool = True, raise_on_failure: bool = True,
               criterion_factor: float = 2.0) -> CheckReport:
  """Run `case` through `attention(..., implementation=implementation, interpret=interpret)` and
  check output, lse and gradients against the float32 reference and jax.nn (see module doc).

  Returns a `CheckReport` (errors per quantity); raises AssertionError listing every failed check
  unless raise_on_failure=False (then the failures are in report.failures). `criterion_factor`:
  the FlashAttention criterion's multiple of the low-precision reference's error (2).
  """
  dtype = case.dtype
  tol = TOLERANCES[dtype]
  compare_jax_nn = compare_jax_nn and case.causal_alignment == "top_left"
  inputs = make_inputs(case, seed)
  got = run_attention(case, implementation, inputs, interpret=interpret)
  oracle = run_oracle(case, inputs)
  low_ref = run_attention(case, "reference", inputs) if dtype != F32 else None
  failures = []

  # dtypes and shapes.
  q_shape, kv_shape = case.shapes()
  want_shapes = dict(out=q_shape, lse=q_shape[:3], dq=q_shape, dk=kv_shape, dv=kv_shape)
  for name, shape in want_shapes.items():
    if got[name].shape != shape:
      failures.append(f"{name} shape {got[name].shape} != {shape}")
    want_dtype = F32 if name == "lse" else dtype
    if got.dtypes[name] != want_dtype:
      failures.append(f"{name} dtype {got.dtypes[name]} != {want_dtype}")
    if not np.all(np.isfinite(got[name])):
      failures.append(f"{name} has {np.sum(~np.isfinite(got[name]))} non-finite entries")
  if failures:
    raise AssertionError(f"{case.id} via {implementation}: " + "; ".join(failures))

  errors, ref_errors, bounds = {}, {}, {}
  noise_rows = rounding_zero_rows(case)
  for name in QUANTITIES:
    err, noise = _relative_and_noise_errors(got[name], oracle[name], noise_rows.get(name))
    ref_err = 0.0 if low_ref is None else _relative_and_noise_errors(
        low_ref[name], oracle[name], noise_rows.get(name))[0]
    bound = min(tol[name], criterion_factor * ref_err + FLOORS[dtype])
    errors[name], ref_errors[name], bounds[name] = err, ref_err, bound
    if not err <= bound:
      failures.append(f"{name}: rel err {err:.3e} > bound {bound:.3e} (tolerance {tol[name]:.1e}, "
                      f"{criterion_factor:g} x low-precision reference {ref_err:.3e} + "
                      f"{FLOORS[dtype]:.0e})")
    if not noise <= tol[name]:
      failures.append(f"{name}: RMS {noise:.3e} > {tol[name]:.1e} on rows that are zero in "
                      f"exact arithmetic (`rounding_zero_rows`)")

  # lse: compared on rows that see a key; exactly MASK_VALUE on the others.
  empty = np.broadcast_to(case.empty_rows()[:, :, None], got.lse.shape)
  err = rel_err(got.lse[~empty], oracle.lse[~empty]) if (~empty).any() else 0.0
  errors["lse"], bounds["lse"] = err, tol["lse"]
  if not err <= tol["lse"]:
    failures.append(f"lse: rel err {err:.3e} > {tol['lse']:.1e} on rows that see a key")
  mask_value = np.float64(np.float32(numerics.MASK_VALUE))
  bad = empty & (got.lse != mask_value)
  if bad.any():
    b, t, h = np.argwhere(bad)[0]
    failures.append(f"lse of {bad.sum()} fully masked rows != MASK_VALUE {mask_value:.7e} "
                    f"(e.g. [b={b}, t={t}, h={h}] = {got.lse[b, t, h]!r})")

  # Semantics: rows/keys that must be exactly zero.
  expected = expected_zero_rows(case)
  for name in QUANTITIES:
    zero = _zero_rows(got[name])  # [B, T|S, H]
    must_be_zero = np.broadcast_to(expected[name][:, :, None], zero.shape)
    bad = must_be_zero & ~zero
    if bad.any():
      b, i, h = np.argwhere(bad)[0]
      failures.append(f"{name}: {bad.sum()} rows should be exactly zero (e.g. [b={b}, {i}, h={h}])")

  jax_nn_errors = {}
  if compare_jax_nn:
    ref_nn = run_jax_nn(case, inputs)
    for name in QUANTITIES:
      err, noise = _relative_and_noise_errors(got[name], ref_nn[name], noise_rows.get(name))
      jax_nn_errors[name] = err
      if not max(err, noise) <= tol[name]:
        failures.append(f"{name}: rel err vs jax.nn {err:.3e} (RMS {noise:.3e} on rows zero "
                        f"in exact arithmetic) > {tol[name]:.1e}")
      # The rows the mask makes zero are zero in jax.nn too (else our reading of it is stale),
      # and a row exactly zero here is exactly zero in jax.nn (nothing dropped). Rows that are
      # only mathematically zero (a query that sees one key has dq = 0) may round to tiny values.
      zero_nn, zero = _zero_rows(ref_nn[name]), _zero_rows(got[name])
      must_be_zero = np.broadcast_to(expected[name][:, :, None], zero.shape)
      if (must_be_zero & ~zero_nn).any():
        failures.append(f"{name}: jax.nn is not zero on rows the mask zeroes: the jax.nn "
                        f"semantics differ from `expected_zero_rows`")
      bad = zero & ~zero_nn
      if bad.any():
        b, i, h = np.argwhere(bad)[0]
        failures.append(
            f"{name}: {int(bad.sum())} rows are exactly zero here but not in jax.nn "
            f"(e.g. [b={b}, {i}, h={h}]; jax.nn row norm "
            f"{np.linalg.norm(ref_nn[name][b, i, h]):.3e})")
    nn_lse_err = rel_err(got.lse[~empty], ref_nn.lse[~empty]) if (~empty).any() else 0.0
    jax_nn_errors["lse"] = nn_lse_err
    if not nn_lse_err <= tol["lse"]:
      failures.append(f"lse: rel err vs jax.nn {nn_lse_err:.3e} > {tol['lse']:.1e}")
    if (ref_nn.lse[empty] != mask_value).any():
      failures.append("jax.nn's lse on fully masked rows is not MASK_VALUE: the convention moved")

  report = CheckReport(case, implementation, errors, ref_errors, bounds, jax_nn_errors, failures)
  if failures and raise_on_failure:
    raise AssertionError(f"{report}\nfailures:\n  " + "\n  ".join(failures))
  return report


# ------------------------------------------------------------------------------------------------
# Memory: no [q_len, kv_len]-sized intermediate.


def padded_sizes(n: int, blocks: Sequence[int] = (8, 16, 32, 64, 128, 256)) -> set[int]:
  """`n` and `n` rounded up to every block size an implementation might pad to."""
  return {n} | {(n + b - 1) // b * b for b in blocks}


def _sub_jaxprs(value):
  """Jaxprs held by an equation parameter (a Jaxpr, a ClosedJaxpr, or lists/tuples/dicts of
  them, e.g. cond branches), found by duck typing so any primitive's params are covered."""
  if hasattr(value, "eqns") and hasattr(value, "invars"):  # core.Jaxpr
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value, "consts"):  # core.ClosedJaxpr
    yield value.jaxpr
  elif isinstance(value, (list, tuple)):
    for v in value:
      yield from _sub_jaxprs(v)
  elif isinstance(value, dict):
    for v in value.values():
      yield from _sub_jaxprs(v)


def walk_jaxpr(jaxpr, path: str = ""):
  """Every (path, primitive name or 'invar'/'constvar'/'outvar', aval) in `jaxpr` and,
  recursively, in the jaxprs of its equations' params (pjit, custom_vjp/custom_jvp calls,
  while/scan/cond bodies, remat, pallas_call kernels, ...)."""
  if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr, "consts"):
    jaxpr = jaxpr.jaxpr
  for kind, variables in (("invar", jaxpr.invars), ("constvar", jaxpr.constvars)):
    for var in variables:
      yield path, kind, var.aval
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    for var in eqn.outvars:
      yield path, name, var.aval
    for pname, value in eqn.params.items():
      for i, sub in enumerate(_sub_jaxprs(value)):
        yield from walk_jaxpr(sub, f"{path}/{name}.{pname}[{i}]")


def _is_quadratic(shape, q_sizes, kv_sizes) -> bool:
  shape = tuple(shape)
  for i, a in enumerate(shape):
    for j, b in enumerate(shape):
      if i != j and a in q_sizes and b in kv_sizes:
        return True
  return False


@dataclasses.dataclass
class QuadraticReport:
  offenders: list  # (path, primitive, shape, dtype)
  primitives: dict  # primitive name -> count of values seen (shows the walk went deep)
  num_values: int

  def __bool__(self):
    return bool(self.offenders)


def find_quadratic_intermediates(fn, *args, q_len: int, kv_len: int,
                                 q_sizes: set[int] | None = None,
                                 kv_sizes: set[int] | None = None) -> QuadraticReport:
  """Trace `fn(*args)` (e.g. `jax.jit(jax.grad(loss))`) to a jaxpr and list every value, at any
  depth, whose shape has one axis of a query size and another of a key size: a materialized
  [.., q_len, .., kv_len, ..] score-like array. Sizes default to the lengths and their
  `padded_sizes`; pick q_len/kv_len distinct from each other, from every block size and from the
  other dimensions so that a hit is unambiguous."""
  q_sizes = padded_sizes(q_len) if q_sizes is None else set(q_sizes)
  kv_sizes = padded_sizes(kv_len) if kv_sizes is None else set(kv_sizes)
  if q_sizes & kv_sizes:
    raise ValueError(f"query sizes {q_sizes} and key sizes {kv_sizes} overlap: pick lengths "
                     f"further apart")
  closed = jax.make_jaxpr(fn)(*args)
  offenders, primitives, count = [], {}, 0
  for path, prim, aval in walk_jaxpr(closed):
    count += 1
    primitives[prim] = primitives.get(prim, 0) + 1
    shape = getattr(aval, "shape", ())
    if _is_quadratic(shape, q_sizes, kv_sizes):
      offenders.append((path or "/", prim, tuple(shape), str(getattr(aval, "dtype", ""))))
  return QuadraticReport(offenders, primitives, count)


_HLO_SHAPE = re.compile(r"\b(?:pred|[suf]\d+|bf16)\[([0-9,]+)\]")
_MLIR_SHAPE = re.compile(r"tensor<((?:\d+x)+)[a-z]")


def find_quadratic_in_text(text: str, *, q_len: int, kv_len: int, q_sizes=None,
                           kv_sizes=None) -> list[tuple[int, ...]]:
  """The distinct quadratic shapes in HLO text (`f32[1,2,1000,1100]`, from
  `jit(f).lower(...).compile().as_text()`) or StableHLO text (`tensor<1x2x1000x1100xf32>`, from
  `jit(f).lower(...).as_text()`)."""
  q_sizes = padded_sizes(q_len) if q_sizes is None else set(q_sizes)
  kv_sizes = padded_sizes(kv_len) if kv_sizes is None else set(kv_sizes)
  shapes = {tuple(int(d) for d in m.split(",") if d) for m in _HLO_SHAPE.findall(text)}
  shapes |= {tuple(int(d) for d in m.split("x") if d) for m in _MLIR_SHAPE.findall(text)}
  return sorted(s for s in shapes if _is_quadratic(s, q_sizes, kv_sizes))
