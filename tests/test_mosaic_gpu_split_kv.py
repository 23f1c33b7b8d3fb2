"""Split-KV decode (`pallas_attn.mosaic_gpu.split_kv`): the forward over key chunks merged by
their lse, against the float32 reference and jax.nn; the heuristic that picks the chunk count.

On the CPU the kernels run in the Mosaic GPU interpreter, with the chunk count forced (the
heuristic would not split such short keys); the `gpu` tests compile them at the real decode
shape and check that the dispatched call splits:
  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_split_kv.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import ops
from pallas_attn.mosaic_gpu import split_kv
from test_mosaic_gpu import _poison_allocator

_c = cases._c  # pylint: disable=protected-access

# The forward's tiles at head_dim 128: 128 rows per CTA, keys padded to 128 (`ops._Static`).
_ROWS_PER_CTA = config_lib.COMPUTE_WARPGROUPS * config_lib.kernel_config(128, "fwd").block_q
_KV_BLOCK = 128


def _splits(batch, q_len, kv_len, heads_q, heads_kv, head_dim=128, pack_gqa=None):
  """The heuristic's choice for a call of these shapes (packed as `ops.attention` packs it)."""
  if pack_gqa is None:
    pack_gqa = heads_q > heads_kv and q_len < _ROWS_PER_CTA
  return split_kv.num_splits((batch, q_len, heads_q, head_dim), (batch, kv_len, heads_kv, head_dim),
                             pack_gqa=pack_gqa, rows_per_cta=_ROWS_PER_CTA, kv_block=_KV_BLOCK)


def test_heuristic_splits_decode_not_prefill():
  # Decode: b16, 32 query heads over 8 kv heads, 32k keys: 128 CTAs unsplit, under 2 waves of
  # 132 SMs. 256 key tiles: 2 chunks (3 would not divide them: padding would copy K and V).
  for q_len in (1, 16):
    assert _splits(16, q_len, 32768, 32, 8) == 2
    assert _splits(16, q_len, 30001, 32, 8) == 3  # padded anyway: any count
  # Batch 1: 8 CTAs; chunks of at least 8 tiles (1024 keys) bound the split.
  assert _splits(1, 1, 32768, 32, 8) == 32
  assert _splits(1, 1, 4096, 32, 8) == 4
  # Too few keys for two chunks of 8 tiles: no split.
  assert _splits(1, 1, 1500, 32, 8) == 1
  assert _splits(1, 1, 1000, 4, 2) == 1
  # Prefill: thousands of CTAs already.
  assert _splits(4, 4096, 4096, 16, 16) == 1
  assert _splits(1, 16384, 16384, 16, 16) == 1
  assert _splits(16, 1024, 1024, 16, 16) == 1
  assert _splits(2, 4096, 4096, 32, 8) == 1
  # MHA decode unpacked: b16 x 32 heads = 512 CTAs, about 4 waves.
  assert _splits(16, 1, 32768, 32, 32) == 1


def test_heuristic_chunks_divide_whole_tiles():
  """Keys that are whole tiles are split into counts that divide them: the reshape stays free."""
  for batch in (1, 2, 3, 5, 16):
    for kv_len in (2048, 4096, 12288, 32768, 40960):
      splits = _splits(batch, 1, kv_len, 32, 8)
      assert (kv_len // _KV_BLOCK) % splits == 0, (batch, kv_len, splits)
      assert splits == 1 or kv_len // splits >= split_kv.MIN_BLOCKS_PER_SPLIT * _KV_BLOCK


def test_combine_matches_softmax_over_all_keys():
  """Merging the chunks' (out, lse) is the softmax over the union; chunks without keys (+inf)
  weigh nothing, and rows with no key in any chunk come out as the unsplit forward's: 0, +inf."""
  rng = np.random.default_rng(0)
  batch, splits, q_len, heads, head_dim, chunk = 2, 3, 4, 2, 8, 5
  scores = rng.standard_normal((batch, splits, heads, q_len, chunk)) * 3
  values = rng.standard_normal((batch, splits, chunk, heads, head_dim))
  seen = rng.random((batch, splits, heads, q_len)) < 0.6  # the chunk gives the row its keys
  seen[0, :, 1, 2] = False  # a row with no key at all
  seen[1, :, 0, 0] = [False, False, True]
  scores = np.where(seen[..., None], scores, -np.inf)
  with np.errstate(divide="ignore"):  # log(0) = -inf where unseen
    lse_parts = np.log(np.exp(scores).sum(-1))
  p = np.exp(scores - np.where(seen, lse_parts, 0.0)[..., None])
  out_parts = np.einsum("bshtk,bskhd->bsthd", p, values)
  lse_parts = np.where(seen, lse_parts, np.inf)
  out, lse = split_kv.combine(jnp.asarray(out_parts, jnp.float32),
                              jnp.asarray(lse_parts, jnp.float32))
  # The softmax over all chunks' keys at once.
  all_scores = np.moveaxis(scores, 1, -2).reshape(batch, heads, q_len, splits * chunk)
  all_values = values.reshape(batch, splits * chunk, heads, head_dim)
  any_seen = seen.any(axis=1)
  with np.errstate(divide="ignore"):
    want_lse = np.where(any_seen, np.log(np.exp(all_scores).sum(-1)), np.inf)
  weights = np.exp(all_scores - np.where(any_seen, want_lse, 0.0)[..., None])
  want_out = np.einsum("bhtk,bkhd->bthd", weights, all_values)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
  np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
  assert lse[0, 1, 2] == numerics.EMPTY_LSE and np.all(np.asarray(out)[0, 2, 1] == 0)


@pytest.fixture
def split_log(monkeypatch):
  """Records the chunk count of every split forward traced during the test."""
  log = []
  forward = split_kv.forward

  def logged(forward_pass, splits, *args):
    log.append(splits)
    return forward(forward_pass, splits, *args)

  monkeypatch.setattr(split_kv, "forward", logged)
  return log


# (case, chunks forced): odd lengths, chunks past a batch element's key length (empty: lse +inf,
# weight 0), a batch element with no key at all (every chunk empty: jax.nn's mean of v), rows
# past the query length.
FORCED_CASES = (
    (_c("split_gqa_1x1000", 2, 1, 1000, 4, 2, kv_lengths=[1000, 130]), 3),
    (_c("split_gqa_3x1537", 3, 3, 1537, 4, 2, q_lengths=[3, 2, 3], kv_lengths=[1537, 400, 0]),
     4),
    # One query, bottom-right causal: hides no key, so the keys split (no GQA group: unpacked).
    (_c("split_br_causal_1x1000", 1, 1, 1000, 2, 2, is_causal=True,
        causal_alignment="bottom_right"), 2),
)


@pytest.mark.parametrize("case,splits", [pytest.param(c.replace(dtype=cases.BF16), s,
                                                      id=f"{c.name}-split{s}")
                                         for c, s in FORCED_CASES])
def test_interpreted_split_matches_reference(case, splits, seed, monkeypatch, split_log):
  monkeypatch.setattr(split_kv, "num_splits", lambda *args, **kwargs: splits)
  cases.check_case(case, "mosaic_gpu", interpret=True, seed=seed,
                   compare_jax_nn=case.causal_alignment == "top_left")
  assert split_log and set(split_log) == {splits}  # the forward split (the backward never does)


@functools.partial(jax.jit, static_argnames=("impl",))
def _soft_cap_vjp(q, k, v, do, kv_lengths, *, impl):
  def f(q, k, v):
    if impl == "reference":
      out, lse = pallas_attn.attention(q, k, v, key_value_seq_lengths=kv_lengths,
                                       logits_soft_cap=2.0, implementation="reference",
                                       return_residual=True)
      return out, jnp.swapaxes(lse, 1, 2)
    out, lse = ops.attention(q, k, v, None, kv_lengths, scale=q.shape[-1] ** -0.5,
                             spec=mask_lib.MaskSpec(), interpret=True, logits_soft_cap=2.0,
                             kv_splits=3)
    return numerics.finalize_empty_rows(out, lse, v, None)  # as `pallas_attn.attention` does

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return out, lse, vjp((do, jnp.zeros_like(lse)))


def test_interpreted_split_soft_cap(seed, split_log):
  """The soft-cap is elementwise: it splits too (the chunk count through `kv_splits`)."""
  batch, q_len, kv_len, heads_q, heads_kv, head_dim = 2, 3, 1537, 4, 2, 64
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = [(batch, q_len, heads_q, head_dim), (batch, kv_len, heads_kv, head_dim),
            (batch, kv_len, heads_kv, head_dim), (batch, q_len, heads_q, head_dim)]
  q, k, v, do = (jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16)
                 for key, s in zip(keys, shapes))
  kv_lengths = jnp.array([kv_len, 700], jnp.int32)  # chunks of 640: batch 1's third is empty
  out, lse, grads = _soft_cap_vjp(q, k, v, do, kv_lengths, impl="mosaic_gpu")
  assert split_log == [3]
  up = lambda x: x.astype(jnp.float32)
  ref_out, ref_lse, ref_grads = _soft_cap_vjp(up(q), up(k), up(v), up(do), kv_lengths,
                                              impl="reference")
  tol = cases.TOLERANCES[cases.BF16]
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  errors = dict(out=cases.rel_err(out, ref_out), lse=cases.rel_err(lse, ref_lse),
                **{name: cases.rel_err(g, r)
                   for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
  failed = {name: err for name, err in errors.items() if not err <= tol[name]}
  assert not failed, f"rel errors over {tol}: {failed} (all: {errors})"


def test_split_only_where_exact(split_log):
  """Causal with several queries (position matters) and position-reading modifiers never split,
  whatever `kv_splits` asks; a call that traces the kernels only (eval_shape) shows it."""
  q = jax.ShapeDtypeStruct((1, 4, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)
  trace = lambda **kw: jax.eval_shape(functools.partial(
      ops.attention, **{"scale": 0.125, "interpret": True, "kv_splits": 4, **kw}), q, k, k, None,
      None)
  trace(spec=mask_lib.MaskSpec(is_causal=True, offset=4096 - 4))
  trace(spec=mask_lib.MaskSpec(), alibi_slopes=jnp.ones((4,), jnp.float32))
  assert split_log == []
  trace(spec=mask_lib.MaskSpec(), logits_soft_cap=30.0)
  assert split_log == [4]
  with pytest.raises(ValueError, match="kv_splits"):
    trace(spec=mask_lib.MaskSpec(), kv_splits=0)


def _decode_inputs(q_len, kv_len, seed):
  """q, k, v of the decode shape: random normals, or only their shapes when seed is None."""
  shapes = [(16, q_len, 32, 128), (16, kv_len, 8, 128), (16, kv_len, 8, 128)]
  if seed is None:
    return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(key, s, jnp.bfloat16) for key, s in zip(keys, shapes)]


@pytest.mark.parametrize("q_len", [1, 16])
def test_dispatched_decode_call_splits(q_len, split_log):
  """`pallas_attn.attention(implementation="mosaic_gpu")` at the decode shape takes the split
  path with the heuristic's count (traced only: eval_shape runs no kernel)."""
  q, k, v = _decode_inputs(q_len, 32768, None)
  jax.eval_shape(functools.partial(pallas_attn.attention, implementation="mosaic_gpu",
                                   interpret=True), q, k, v)
  assert split_log == [_splits(16, q_len, 32768, 32, 8)] == [2]


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 16])
def test_gpu_dispatched_decode_call_splits(q_len, seed, split_log):
  """Compiled on the GPU: the dispatched call splits, and its output is finite."""
  q, k, v = _decode_inputs(q_len, 32768, seed)
  out = jax.jit(functools.partial(pallas_attn.attention, implementation="mosaic_gpu"))(q, k, v)
  assert split_log == [_splits(16, q_len, 32768, 32, 8)] and split_log[0] > 1
  assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,kv_len", [(1, 32768), (16, 32768), (1, 30001), (16, 30001)])
def test_gpu_decode_split_matches_reference(q_len, kv_len, seed, split_log):
  _poison_allocator(64 << 20)
  # Key lengths that leave chunks empty (17, 0: every chunk) or cut one mid-tile.
  kv_lengths = [kv_len, kv_len - 1, 17, 0, 30000, 12345, 16384, 16385] * 2
  case = _c(f"decode_split_{q_len}x{kv_len}", 16, q_len, kv_len, 32, 8, head_dim=128,
            dtype=cases.BF16, kv_lengths=kv_lengths)
  cases.check_case(case, "mosaic_gpu", seed=seed)
  assert split_log and split_log[0] == _splits(16, q_len, kv_len, 32, 8) > 1
