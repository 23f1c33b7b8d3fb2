"""`bias` and boolean `mask` inside the Mosaic GPU kernels (forward, dQ, dK/dV and the dbias
kernel), through `pallas_attn.attention(..., implementation="mosaic_gpu")`, against the dense
float32 reference (`implementation="reference"`) on the same bf16 values.

The reference is given the bias broadcast to the full [batch, heads, q_len, kv_len] grid, so its
bias gradient is dS itself; the expected dbias is dS summed over the bias's broadcast axes. A bias
constant along the keys does not change the softmax: its exact gradient is 0, and the kernels'
is bf16 rounding noise (delta comes from the bf16 output), so a relative error would mean
nothing. The cases with such biases therefore soft-cap the logits, under which a per-row or
scalar bias does change the weights.

On the CPU the kernels run in the Mosaic GPU interpreter (short cases); the `gpu` tests compile
them on a Hopper GPU:  PYTHONPATH=. python3 -m pytest -m gpu tests/test_mosaic_gpu_bias.py
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
from test_mosaic_gpu import _poison_allocator

_DBIAS_TOL = 2e-2
_CANCELLATION = 1e-3  # see _dbias_err
_EMPTY_ROW = 3  # a query row that a mask with a q axis hides entirely (in batch element 0)


@dataclasses.dataclass(frozen=True)
class BiasCase:
  """Shapes, and the bias / mask patterns as four letters of "BHTS" or "1" (size-1 axis)."""

  name: str
  batch: int
  q_len: int
  kv_len: int
  heads_q: int
  heads_kv: int
  bias: str | None = None
  mask: str | None = None
  is_causal: bool = False
  soft_cap: float | None = None
  head_dim: int = 64

  def shape(self, pattern: str) -> tuple[int, ...]:
    sizes = dict(B=self.batch, H=self.heads_q, T=self.q_len, S=self.kv_len)
    return tuple(sizes.get(letter, 1) for letter in pattern)

  def replace(self, **kw) -> BiasCase:
    return dataclasses.replace(self, **kw)

  def inputs(self, seed: int):
    """bf16 q, k, v, dO; the bias (bf16, std 2) or None; the mask or None."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q_shape = (self.batch, self.q_len, self.heads_q, self.head_dim)
    kv_shape = (self.batch, self.kv_len, self.heads_kv, self.head_dim)
    q = jax.random.normal(keys[0], q_shape, jnp.bfloat16)
    k = jax.random.normal(keys[1], kv_shape, jnp.bfloat16)
    v = jax.random.normal(keys[2], kv_shape, jnp.bfloat16)
    do = jax.random.normal(keys[3], q_shape, jnp.bfloat16)
    bias = mask = None
    if self.bias is not None:
      bias = (2.0 * jax.random.normal(keys[4], self.shape(self.bias))).astype(jnp.bfloat16)
    if self.mask is not None:
      mask = np.array(jax.random.bernoulli(keys[5], 0.8, self.shape(self.mask)))
      if "T" in self.mask:
        mask[0, :, _EMPTY_ROW, :] = False
      mask = jnp.asarray(mask)
    return q, k, v, do, bias, mask


def _outputs(q, k, v, do, bias, mask, *, case: BiasCase, implementation: str, interpret: bool):
  """out, lse and the gradients (dq, dk, dv, dbias) of `attention` with a random cotangent."""

  def f(q, k, v, bias):
    return pallas_attn.attention(q, k, v, bias, mask, is_causal=case.is_causal,
                                 logits_soft_cap=case.soft_cap, implementation=implementation,
                                 interpret=interpret, return_residual=True)

  (out, lse), vjp = jax.vjp(f, q, k, v, bias)
  return out, lse, vjp((do, jnp.zeros_like(lse)))


def _dbias_err(got, want, magnitude) -> float:
  """Relative L2 error of a bias gradient, with the denominator floored at _CANCELLATION of the
  summed magnitudes |dS|.

  A broadcast bias's gradient sums dS over its broadcast axes, and along the keys those terms
  cancel (exactly without a soft-cap). Under a soft-cap a scalar bias's gradient is a sum of
  ~1e7 terms whose magnitudes add up to ~6e4 times the result (the H200 case at 1000 x 1537
  keys: 1.0 against a sum of |dS| of 64344). No float32 kernel is accurate relative to such a
  result: the GPU's tanh.approx (approx_math) alone is off by ~5e-4 per term. What a kernel can
  be held to is an error small against what it sums; 2e-2 x 1e-3 of it still catches one
  dropped or doubled 64 x 64 tile (~3e-4 of the sum for that case), and for a bias with a full
  key axis the floor stays far below |want| (no cancellation), so the plain relative error
  decides."""
  floor = _CANCELLATION * np.linalg.norm(magnitude)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor))


def _check(case: BiasCase, seed: int, interpret: bool):
  q, k, v, do, bias, mask = case.inputs(seed)
  run = functools.partial(_outputs, case=case)
  out, lse, grads = jax.jit(functools.partial(run, implementation="mosaic_gpu",
                                              interpret=interpret))(q, k, v, do, bias, mask)
  full_shape = case.shape("BHTS")
  up = [x.astype(jnp.float32) for x in (q, k, v, do, bias)]
  up[4] = jnp.broadcast_to(up[4], full_shape)  # its gradient: dS on the whole grid
  ref_out, ref_lse, ref_grads = jax.jit(functools.partial(run, implementation="reference",
                                                          interpret=False))(*up, mask)
  failures = []
  for name, got, want in zip(("out", *cases.QUANTITIES[1:]), (out, *grads[:3]),
                             (ref_out, *ref_grads[:3])):
    err = cases.rel_err(np.asarray(got, np.float32), want)
    if not err <= cases.TOLERANCES[cases.BF16][name]:
      failures.append(f"{name}: rel err {err:.3e}")
  # lse: finite rows relatively; rows that see no key exactly jax.nn's value (the API's).
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  empty = ref_lse == np.float32(pallas_attn.numerics.MASK_VALUE)
  if "T" in (case.mask or "") and not empty.any():
    failures.append("the mask's empty row is not empty in the reference")
  if not np.array_equal(lse[empty], ref_lse[empty]):
    failures.append("lse of rows that see no key != MASK_VALUE")
  err = cases.rel_err(lse[~empty], ref_lse[~empty])
  if not err <= cases.TOLERANCES[cases.BF16]["lse"]:
    failures.append(f"lse: rel err {err:.3e}")
  # dbias: dS summed over the bias's broadcast axes.
  axes = tuple(a for a, n in enumerate(bias.shape) if n == 1 and full_shape[a] > 1)
  ds = np.asarray(ref_grads[3], np.float64)
  want = ds.sum(axis=axes, keepdims=True)
  if grads[3].shape != bias.shape or grads[3].dtype != bias.dtype:
    failures.append(f"dbias is {grads[3].dtype}{list(grads[3].shape)}, the bias "
                    f"{bias.dtype}{list(bias.shape)}")
  else:
    err = _dbias_err(np.asarray(grads[3], np.float64), want,
                     np.abs(ds).sum(axis=axes, keepdims=True))
    if not err <= _DBIAS_TOL:  # NaN fails too
      failures.append(f"dbias: rel err {err:.3e}")
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    if interpret_pallas_call.get_races().races_found:
      failures.append("the interpreter found a data race")
  assert not failures, f"{case.name}: " + "; ".join(failures)


_CASES = {c.name: c for c in (
    BiasCase("full_bias_causal_77x150", 2, 77, 150, 2, 2, bias="BHTS", is_causal=True),
    # GQA (2 query heads over 1); the bias is shared by the batch, the mask by the heads.
    BiasCase("head_bias_batch_mask_gqa_causal_77x150", 2, 77, 150, 2, 1, bias="1HTS",
             mask="B1TS", is_causal=True),
    # A key bias and a key mask (padding style); the soft-cap bounds bias and scores together.
    BiasCase("key_bias_key_mask_softcap_77x150", 2, 77, 150, 2, 2, bias="B11S", mask="111S",
             soft_cap=2.0),
    # A bias constant along the keys and a mask that hides whole rows per head. Under the
    # soft-cap such a bias changes the softmax (without, its gradient would be exactly 0).
    BiasCase("row_bias_head_mask_gqa_causal_softcap_77x150", 1, 77, 150, 4, 2, bias="11T1",
             mask="1HT1", is_causal=True, soft_cap=3.0),
    # One scalar bias (soft-capped, as above); a full mask, transposed for the dK/dV kernel.
    BiasCase("scalar_bias_full_mask_softcap_150x77", 1, 150, 77, 2, 2, bias="1111",
             mask="BHTS", soft_cap=3.0),
)}


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter.


@pytest.mark.parametrize("name", list(_CASES))
def test_interpreted_bias_and_mask_match_reference(name, seed):
  _check(_CASES[name], seed, interpret=True)


def _lowered_text(case: BiasCase, *, bias_grad: bool) -> str:
  q, k, v, do, bias, mask = (None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
                             for x in case.inputs(0))

  def grads(q, k, v, do, bias, mask):
    def f(q, k, v, bias):
      if not bias_grad:
        bias = jax.lax.stop_gradient(bias)
      return ops.attention(q, k, v, None, None, scale=0.125,
                           spec=mask_lib.MaskSpec(is_causal=case.is_causal), bias=bias,
                           mask=mask, logits_soft_cap=case.soft_cap)[0]

    return jax.vjp(f, q, k, v, bias)[1](do)

  return jax.jit(grads).trace(q, k, v, do, bias, mask).lower(
      lowering_platforms=("cuda",)).as_text()


_LOWERED = [pytest.param(_CASES["head_bias_batch_mask_gqa_causal_77x150"].replace(head_dim=d),
                         id=f"full_tiles-d{d}") for d in (64, 128, 256)]
_LOWERED += [pytest.param(_CASES[n], id=n) for n in (
    "key_bias_key_mask_softcap_77x150", "row_bias_head_mask_gqa_causal_softcap_77x150",
    "scalar_bias_full_mask_softcap_150x77")]


@pytest.mark.parametrize("case", _LOWERED)
def test_bias_kernels_lower_for_cuda(case):
  """The forward, dQ, dK/dV and dbias kernels with every kind of bias / mask tile lower for CUDA
  on the CPU (the lowering refuses loads the interpreter accepts: see test_mosaic_gpu_mods)."""
  text = _lowered_text(case, bias_grad=True)
  assert text.count("mosaic_gpu") >= 4


def test_dbias_kernel_runs_only_when_the_bias_is_differentiated():
  case = _CASES["full_bias_causal_77x150"]
  with_grad = _lowered_text(case, bias_grad=True).count("mosaic_gpu")
  without = _lowered_text(case, bias_grad=False).count("mosaic_gpu")
  assert with_grad > without >= 3


def test_key_bias_and_mask_make_no_quadratic_value():
  """A bias and a mask over the keys ([B, 1, 1, S]) keep the kernel path O(N), forward and
  backward, the bias gradient included (its kernel writes block_q partial rows, not q_len)."""
  q_len, kv_len = 200, 330
  q = jax.ShapeDtypeStruct((2, q_len, 2, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, kv_len, 1, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((2, 1, 1, kv_len), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 1, 1, kv_len), jnp.bool_)

  def loss(q, k, v, bias, mask, do):
    out = pallas_attn.attention(q, k, v, bias, mask, is_causal=True,
                                implementation="mosaic_gpu", interpret=True)
    return jnp.vdot(out, do).astype(jnp.float32)

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  report = cases.find_quadratic_intermediates(fn, q, kv, kv, bias, mask, q, q_len=q_len,
                                              kv_len=kv_len)
  assert not report, report.offenders[:10]
  assert report.num_values > 100


def test_bias_and_mask_arguments_are_checked():
  q = jnp.zeros((2, 64, 2, 64), jnp.bfloat16)
  kw = dict(scale=0.125, spec=mask_lib.MaskSpec(), interpret=True)
  with pytest.raises(ValueError, match=r"bias must have shape \[batch\|1"):
    ops.attention(q, q, q, None, None, bias=jnp.zeros((2, 3, 64, 64)), **kw)
  with pytest.raises(ValueError, match="mask must be boolean"):
    ops.attention(q, q, q, None, None, mask=jnp.ones((1, 1, 64, 64), jnp.float32), **kw)


# ---------------------------------------------------------------------------------------------
# GPU: real compilation on a Hopper GPU.


def _gpu_params():
  """Every case at 2 x 4 query heads over 2 kv heads, head_dim 128, as 1000 x 1000 and
  1000 x 1537; two at head_dim 64 and 256 (the split dK/dV launches)."""
  params = []
  for case in _CASES.values():
    for q_len, kv_len in ((1000, 1000), (1000, 1537)):
      c = case.replace(batch=2, heads_q=4, heads_kv=2, q_len=q_len, kv_len=kv_len, head_dim=128,
                       name=f"{case.name.rsplit('_', 1)[0]}_{q_len}x{kv_len}")
      params.append(pytest.param(c, id=f"{c.name}-d128"))
  for name, head_dim in (("full_bias_causal_77x150", 64),
                         ("head_bias_batch_mask_gqa_causal_77x150", 256)):
    c = _CASES[name].replace(batch=2, heads_q=4, heads_kv=2, q_len=1000, kv_len=1000,
                             head_dim=head_dim, name=name.replace("77x150", "1000x1000"))
    params.append(pytest.param(c, id=f"{c.name}-d{head_dim}"))
  return params


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_params())
def test_gpu_bias_and_mask_match_reference(case, seed):
  _poison_allocator(256 << 20)
  _check(case, seed, interpret=False)
