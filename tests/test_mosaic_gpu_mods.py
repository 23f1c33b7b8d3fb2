"""Score modifiers inside the Mosaic GPU kernels (soft-cap, segment ids, ALiBi) against a dense
float32 reference written here.

`pallas_attn.mosaic_gpu.ops.attention` is called directly (the API wiring comes later), so its
own conventions are checked: lse +inf on rows that see no key, and nothing asserted about the
output of those rows (the API replaces it). On the CPU the kernels run in the Mosaic GPU
interpreter, short cases only; the `gpu` tests compile them for real on a Hopper GPU:
  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_mods.py
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import pallas_attn
from pallas_attn import mask as mask_lib
from pallas_attn.mosaic_gpu import ops
from pallas_attn.mosaic_gpu import config as config_lib
from test_mosaic_gpu import _poison_allocator, kernel_table


@dataclasses.dataclass(frozen=True)
class ModCase:
  """A `cases.Case` (shapes, causal mask, lengths; bf16) with score modifiers.

  Segments: per batch element, the cut points as fractions of the length (the same fractions cut
  the queries and the keys); the first `foreign_keys` keys of batch element 0 get an id no query
  has, so that, causally, the first rows see no key.
  """

  base: cases.Case
  soft_cap: float | None = None
  q_gain: float = 1.0  # multiplies q, so that the soft-cap saturates
  segment_cuts: tuple[tuple[float, ...], ...] | None = None
  foreign_keys: int = 0
  alibi: bool = False

  @property
  def name(self) -> str:
    return self.base.name

  @property
  def spec(self) -> mask_lib.MaskSpec:
    return mask_lib.MaskSpec(is_causal=self.base.is_causal)

  @property
  def scale(self) -> float:
    return 1.0 / np.sqrt(self.base.head_dim)

  def with_base(self, **kw) -> ModCase:
    return dataclasses.replace(self, base=self.base.replace(**kw))

  def segment_ids(self):
    """(q ids int32 [B, T], kv ids int32 [B, S]) or (None, None)."""
    if self.segment_cuts is None:
      return None, None

    def ids(length, cuts):
      return np.searchsorted(np.asarray(cuts) * length, np.arange(length), side="right")

    q_ids = np.stack([ids(self.base.q_len, c) for c in self.segment_cuts]).astype(np.int32)
    kv_ids = np.stack([ids(self.base.kv_len, c) for c in self.segment_cuts]).astype(np.int32)
    kv_ids[0, :self.foreign_keys] = 1000
    return jnp.asarray(q_ids), jnp.asarray(kv_ids)

  def alibi_slopes(self):
    """The usual geometric ALiBi slopes 2^(-8 (h + 1) / H), or None."""
    if not self.alibi:
      return None
    heads = self.base.heads_q
    return jnp.asarray(2.0 ** (-8.0 * (np.arange(heads) + 1) / heads), jnp.float32)

  def inputs(self, seed: int):
    """bf16 q, k, v and a random output cotangent (q scaled by `q_gain`)."""
    q, k, v, do = cases.make_inputs(self.base, seed)
    q = (q.astype(jnp.float32) * self.q_gain).astype(jnp.bfloat16)
    return q, k, v, do


def _case(name, batch, q_len, kv_len, heads_q, heads_kv, *, is_causal=False, q_lengths=None,
          kv_lengths=None, **mods) -> ModCase:
  base = cases.Case(batch=batch, q_len=q_len, kv_len=kv_len, heads_q=heads_q, heads_kv=heads_kv,
                    head_dim=64, is_causal=is_causal, q_lengths=q_lengths,
                    kv_lengths=kv_lengths, dtype=cases.BF16, name=name)
  return ModCase(base, **mods)


_CASES = {c.name: c for c in (
    # cap 5 with logits of std ~4: tanh saturates on the large logits.
    _case("softcap5_113x203", 1, 113, 203, 2, 2, soft_cap=5.0, q_gain=4.0),
    # Batch 0: segments [0, 38), [38, 120), [120, 150): the middle one spans the 64-row query
    # tiles and the 128-key forward tile; its first 6 keys belong to no query, so rows 0-5 see
    # no key. Batch 1: five segments.
    _case("segments_causal_150x150", 2, 150, 150, 2, 2, is_causal=True,
          segment_cuts=((0.25, 0.8), (0.1, 0.3, 0.6, 0.9)), foreign_keys=6),
    _case("alibi_causal_113x203", 1, 113, 203, 2, 2, is_causal=True, alibi=True),
    # Not causal: ALiBi's |i - j| on both sides of the diagonal. Logits of std ~12 against a cap
    # of 20.
    _case("all_gqa_lengths_113x203", 1, 113, 203, 4, 2, q_lengths=(100,), kv_lengths=(190,),
          soft_cap=20.0, q_gain=12.0, segment_cuts=((0.3, 0.7),), alibi=True),
)}


def _dense_reference(case: ModCase, q, k, v, q_ids, kv_ids, slopes):
  """out [B, T, Hq, D], lse [B, Hq, T] and the row mask `has_key` [B, Hq, T], float32.

  Rows that see no key get zero probabilities (the kernels' convention before the API)."""
  base = case.base
  groups = base.heads_q // base.heads_kv
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  s = case.scale * jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST)
  if slopes is not None:
    distance = np.abs(np.arange(base.q_len)[:, None] - np.arange(base.kv_len)[None, :])
    s = s - slopes[None, :, None, None] * distance.astype(np.float32)
  if case.soft_cap is not None:
    s = case.soft_cap * jnp.tanh(s / case.soft_cap)
  keep = jnp.asarray(base.visible())[:, None]  # causal and lengths, [B, 1, T, S]
  if q_ids is not None:
    keep &= q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  keep = jnp.broadcast_to(keep, s.shape)
  has_key = keep.any(-1)
  # A finite fill keeps every gradient finite; empty rows are zeroed below.
  s = jnp.where(keep, s, -1e30)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.exp(s - lse[..., None]) * has_key[..., None]
  out = jnp.einsum("bhts,bshd->bthd", p, v, precision=jax.lax.Precision.HIGHEST)
  return out, lse, has_key


def _reference(case: ModCase, up, mod_args):
  """((out, lse, has_key), vjp of (out) -> (dq, dk, dv)) of the dense float32 reference."""
  q, k, v, _ = up

  def f(q, k, v):
    out, lse, has_key = _dense_reference(case, q, k, v, *mod_args)
    return out, (lse, has_key)

  out, vjp, (lse, has_key) = jax.vjp(f, q, k, v, has_aux=True)
  return (out, lse, has_key), vjp


@functools.partial(jax.jit, static_argnames=("case", "interpret"))
def _kernel_vjp(q, k, v, do, q_ids, kv_ids, slopes, q_lengths, kv_lengths, *, case, interpret):
  def f(q, k, v):
    return ops.attention(q, k, v, q_lengths, kv_lengths, scale=case.scale, spec=case.spec,
                         interpret=interpret, logits_soft_cap=case.soft_cap,
                         q_segment_ids=q_ids, kv_segment_ids=kv_ids, alibi_slopes=slopes)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return out, lse, vjp((do, jnp.zeros_like(lse)))


def _check(case: ModCase, seed: int, interpret: bool):
  q, k, v, do = case.inputs(seed)
  mod_args = (*case.segment_ids(), case.alibi_slopes())
  out, lse, grads = _kernel_vjp(q, k, v, do, *mod_args, *case.base.lengths(), case=case,
                                interpret=interpret)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  (ref_out, ref_lse, has_key), ref_vjp = _reference(case, up, mod_args)
  ref_grads = ref_vjp(up[3])

  has_key = np.asarray(has_key)  # [B, Hq, T]
  assert has_key.any(), "the case hides every row"
  rows = np.swapaxes(has_key, 1, 2)  # [B, T, Hq]: the layout of out and dq
  lse = np.asarray(lse)
  failures = []
  if not np.all(lse[~has_key] == np.inf):
    failures.append(f"lse of {np.sum(lse[~has_key] != np.inf)} rows that see no key != +inf")
  err = cases.rel_err(lse[has_key], np.asarray(ref_lse)[has_key])
  if not err <= cases.TOLERANCES[cases.BF16]["lse"]:
    failures.append(f"lse: rel err {err:.3e}")
  got = dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2])
  want = dict(out=ref_out, dq=ref_grads[0], dk=ref_grads[1], dv=ref_grads[2])
  for name in cases.QUANTITIES:
    x, ref = np.asarray(got[name], np.float32), np.asarray(want[name])
    if name in ("out", "dq"):  # rows that see no key: nothing to compare (the API fills them)
      x, ref = x[rows], ref[rows]
    err = cases.rel_err(x, ref)
    if not err <= cases.TOLERANCES[cases.BF16][name]:
      failures.append(f"{name}: rel err {err:.3e} > {cases.TOLERANCES[cases.BF16][name]:.1e}")
  assert not failures, f"{case.name} (d{case.base.head_dim}): " + "; ".join(failures)


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter.


@pytest.mark.parametrize("name", list(_CASES))
def test_interpreted_modifiers_match_dense_reference(name, seed):
  _check(_CASES[name], seed, interpret=True)


@pytest.mark.parametrize("name", ["softcap5_113x203", "alibi_causal_113x203"])
def test_interpreted_modifiers_in_the_overlapped_forward(name, seed):
  """The table's head_dim 128 forward (`overlap_qk`: tile j's modified logits and softmax made
  while tile j - 1's P V runs) with a soft-cap, and with ALiBi under a causal mask; the cases
  above run at head_dim 64, whose forward is the ping-pong one."""
  assert config_lib.kernel_config(128, "fwd").overlap_qk
  _check(_CASES[name].with_base(head_dim=128), seed, interpret=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_modifier_kernels_lower_for_cuda(head_dim):
  """The Pallas -> Mosaic GPU lowering (layouts, which loads and ops it accepts) runs on the CPU:
  it rejects what the interpreter lets pass (e.g. an "optimized" load from GMEM). Compiling the
  lowered module to PTX still needs the GPU (the `gpu` tests)."""
  case = _CASES["all_gqa_lengths_113x203"].with_base(head_dim=head_dim)
  q, k, v, do = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.inputs(0))
  args = (q, k, v, do, *case.segment_ids(), case.alibi_slopes(), *case.base.lengths())
  lowered = _kernel_vjp.trace(*args, case=case, interpret=False).lower(
      lowering_platforms=("cuda",))
  assert lowered.as_text().count("mosaic_gpu") >= 3  # forward, dQ, dK/dV


def test_alibi_slopes_refuse_differentiation():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  slopes = jnp.asarray([0.5, 0.25], jnp.float32)

  def loss(slopes):
    out, _ = ops.attention(q, q, q, None, None, scale=0.125, spec=mask_lib.MaskSpec(),
                           interpret=True, alibi_slopes=slopes)
    return out.astype(jnp.float32).mean()

  with pytest.raises(TypeError, match="stop_gradient"):
    jax.eval_shape(jax.grad(loss), slopes)
  # Constant slopes (stop_gradient) trace fine: only tracing here, nothing runs.
  jax.eval_shape(jax.grad(lambda s: loss(jax.lax.stop_gradient(s))), slopes)


def test_modifier_arguments_are_checked():
  q = jnp.zeros((2, 64, 2, 64), jnp.bfloat16)
  ids = jnp.zeros((2, 64), jnp.int32)
  kw = dict(scale=0.125, spec=mask_lib.MaskSpec(), interpret=True)
  with pytest.raises(ValueError, match="both or neither"):
    ops.attention(q, q, q, None, None, q_segment_ids=ids, **kw)
  with pytest.raises(ValueError, match="kv_segment_ids must be integers of shape"):
    ops.attention(q, q, q, None, None, q_segment_ids=ids, kv_segment_ids=ids[:, :10], **kw)
  with pytest.raises(ValueError, match="alibi_slopes must have shape"):
    ops.attention(q, q, q, None, None, alibi_slopes=jnp.ones((3,)), **kw)
  with pytest.raises(ValueError, match="logits_soft_cap must be a positive"):
    ops.attention(q, q, q, None, None, logits_soft_cap=0.0, **kw)


# ---------------------------------------------------------------------------------------------
# GPU: real compilation on a Hopper GPU.


def _gpu_params():
  """Every case at head_dim 128 and 64, as given and stretched to 1000 x 1000."""
  params = []
  for head_dim in (128, 64):
    for case in _CASES.values():
      base = case.base
      longer = case.with_base(name=base.name.rsplit("_", 1)[0] + "_1000x1000", q_len=1000,
                              kv_len=1000, q_lengths=base.q_lengths and (900,) * base.batch,
                              kv_lengths=base.kv_lengths and (950,) * base.batch)
      for c in (case, longer):
        c = c.with_base(head_dim=head_dim)
        params.append(pytest.param(c, id=f"{c.name}-d{head_dim}"))
  return params


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_params())
def test_gpu_modifiers_match_dense_reference(case, seed):
  _poison_allocator(64 << 20)
  _check(case, seed, interpret=False)


# ---------------------------------------------------------------------------------------------
# Through `pallas_attn.attention`: the dispatcher hands segment ids, per-head ALiBi slopes, the
# soft-cap and the bottom-right alignment to the kernels; the portable path (float32, itself
# checked against the dense reference in test_features.py) is the oracle.


def _api_outputs(q, k, v, do, segment_ids, slopes, *, implementation, interpret, is_causal,
                 alignment, soft_cap):
  def f(q, k, v):
    return pallas_attn.attention(
        q, k, v, is_causal=is_causal, causal_alignment=alignment, segment_ids=segment_ids,
        alibi_slopes=jax.lax.stop_gradient(slopes), logits_soft_cap=soft_cap,
        implementation=implementation, interpret=interpret, return_residual=True)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return (out, lse, *vjp((do, jnp.zeros_like(lse))))


def _check_api_against_portable(q_len, kv_len, *, is_causal, alignment, soft_cap, seed,
                                interpret, head_dim=64):
  keys = jax.random.split(jax.random.key(seed), 5)
  batch, heads_q, heads_kv = 2, 4, 2
  q = jax.random.normal(keys[0], (batch, q_len, heads_q, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, kv_len, heads_kv, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, kv_len, heads_kv, head_dim), jnp.bfloat16)
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  # Packed documents: sorted ids with cuts at different places in the two batch elements.
  q_ids = jnp.stack([jnp.arange(q_len) * 3 // q_len, jnp.arange(q_len) * 2 // q_len])
  kv_ids = jnp.stack([jnp.arange(kv_len) * 3 // kv_len, jnp.arange(kv_len) * 2 // kv_len])
  segment_ids = (q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32))
  slopes = 2.0 ** (-8.0 * (jnp.arange(heads_q) + 1) / heads_q)
  common = dict(is_causal=is_causal, alignment=alignment, soft_cap=soft_cap)
  got = jax.jit(functools.partial(_api_outputs, implementation="mosaic_gpu", interpret=interpret,
                                  **common))(q, k, v, do, segment_ids, slopes)
  up = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = jax.jit(functools.partial(_api_outputs, implementation="blocked_jax", interpret=False,
                                   **common))(*up, segment_ids, slopes)
  for name, g, w in zip(("out", "lse", *cases.QUANTITIES[1:]), got, want):
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    err = cases.rel_err(g, w)
    assert err < (1e-4 if name == "lse" else 2e-2), f"{name}: rel err {err:.3e}"


_DQ_IN_FLIGHT = config_lib.KernelConfig(64, 64, co_issue_dp=True, dq_in_flight=True)


def test_interpreted_dq_in_flight_through_block_table(seed):
  """dQ's wgmma left running into the next step (`dq_in_flight`) while the dQ kernel walks a
  block table: segment ids (blocks skipped between computed ones), lengths."""
  with kernel_table(128, {"dq": _DQ_IN_FLIGHT}):
    _check(_CASES["segments_causal_150x150"].with_base(head_dim=128), seed, interpret=True)
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  assert interpret_pallas_call.get_races().races_found is False


@pytest.mark.gpu
def test_gpu_dq_in_flight_through_block_table(seed):
  with kernel_table(128, {"dq": _DQ_IN_FLIGHT}):
    _poison_allocator(64 << 20)
    _check(_CASES["segments_causal_150x150"].with_base(head_dim=128), seed, interpret=False)


# FlashAttention-3's overlap in both backward kernels (each step's dS made under the step
# before's dQ wgmma, or its dK wgmma), 2 slots: the flush before each skipped block.
_OVERLAPPED_BACKWARD = {"dq": config_lib.KernelConfig(64, 64, overlap_dq=True),
                        "dkv": config_lib.KernelConfig(64, 64, overlap_dkv=True)}


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpreted"),
                                       pytest.param(False, id="gpu", marks=pytest.mark.gpu)])
def test_overlapped_backward_through_block_table(interpret, seed):
  """`overlap_dq` and `overlap_dkv` while the kernels walk block tables: segment ids (blocks
  skipped between computed ones, rows that see no key)."""
  with kernel_table(128, _OVERLAPPED_BACKWARD):
    if not interpret:
      _poison_allocator(64 << 20)
    _check(_CASES["segments_causal_150x150"].with_base(head_dim=128), seed, interpret=interpret)
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    assert interpret_pallas_call.get_races().races_found is False


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpreted"),
                                       pytest.param(False, id="gpu", marks=pytest.mark.gpu)])
def test_modifiers_in_the_fused_d128_backward(interpret, seed):
  """The table's head_dim 128 dK/dV kernel where it makes dQ too (rows of over 128 blocks: the
  column halves a step late), on every modifier at once with GQA and lengths."""
  from test_mosaic_gpu import _VARIANTS
  with kernel_table(128, _VARIANTS["table_d128_always_fused"]):
    if not interpret:
      _poison_allocator(64 << 20)
    _check(_CASES["all_gqa_lengths_113x203"].with_base(head_dim=128), seed, interpret=interpret)


def test_interpreted_modifiers_through_attention(seed):
  _check_api_against_portable(77, 150, is_causal=True, alignment="bottom_right", soft_cap=5.0,
                              seed=seed, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_modifiers_through_attention(head_dim, seed):
  _poison_allocator(64 << 20)
  _check_api_against_portable(1000, 1537, is_causal=True, alignment="bottom_right", soft_cap=20.0,
                              seed=seed, interpret=False, head_dim=head_dim)
