"""`flax_attention_fn`: pallas_attn as the `attention_fn` of Flax attention modules.

`flax.nnx.MultiHeadAttention(..., attention_fn=pallas_attn.flax_attention_fn)` and
`flax.linen.MultiHeadDotProductAttention(..., attention_fn=pallas_attn.flax_attention_fn)`.
Flax calls attention functions with its own keywords (dropout, dtype, precision, module) and
float masks with any number of leading batch axes; this maps them onto `attention`. Flax's bias
and mask become `attention`'s (served by the blocked path: no [T, S] weights in memory).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_attn.api import attention


def flax_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                      dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                      precision=None, module=None, is_causal=False,
                      force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                      attn_weights_value_einsum=None, *, implementation=None, interpret=False,
                      deterministic_backward=False):
  """Flax-compatible `attention_fn` on top of pallas_attn.attention.

  - dtype: like flax's promote_dtype, q/k/v are cast to `dtype` (or their common dtype).
  - mask: any dtype (nonzero = attend), broadcastable to [batch..., heads, T, S]; cast to bool.
    bias: broadcastable likewise; both go to `attention` as they are.
  - several leading batch axes are flattened into one (as flax's default does).
  - dropout (dropout_rate > 0 and not deterministic): `attention`'s dropout with dropout_rng.
    broadcast_dropout=True (Flax's default) shares one keep-mask across batch and heads, as Flax
    does. Same distribution as Flax's, not the same bits: Flax draws a [T, S] mask with
    jax.random.bernoulli, pallas_attn hashes each element's indices (`pallas_attn.dropout`), so
    no mask is ever stored.
  - precision / force_fp32_for_softmax: the kernels already compute scores and softmax in
    float32; nothing to do.
  - deterministic (Flax's: dropout off) is not `attention`'s deterministic_backward (gradients
    the same to the bit from run to run), which this function takes as a keyword of its own
    (`functools.partial(flax_attention_fn, deterministic_backward=True)`).
  - `module` (sowing the weights) needs the [T, S] weights, which exact FlashAttention never
    forms: NotImplementedError.
  """
  del precision, force_fp32_for_softmax
  dropout = {}
  if dropout_rate > 0.0 and not deterministic:
    if dropout_rng is None:
      raise ValueError("dropout_rate > 0 with deterministic=False needs a dropout_rng")
    dropout = dict(dropout_rate=float(dropout_rate), dropout_rng=dropout_rng,
                   broadcast_dropout=bool(broadcast_dropout))
  if module is not None:
    raise NotImplementedError("pallas_attn: sow_weights needs the attention weights, which "
                              "are never materialized")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    raise NotImplementedError("pallas_attn: custom attention einsums are not supported")
  dtype = dtype or jnp.result_type(query, key, value)
  query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  batch_shape = query.shape[:-3]

  def to_4d(x, trailing):  # [batch..., *trailing] (broadcastable) -> [prod(batch), *trailing]
    if x is None:
      return None
    x = jnp.asarray(x)
    x = x.reshape((1,) * (len(batch_shape) + len(trailing) - x.ndim) + x.shape)
    lead = x.shape[:len(batch_shape)]
    if len(batch_shape) != 1:
      if all(d == 1 for d in lead):
        x = x.reshape((1,) + x.shape[len(batch_shape):])
      else:
        x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
        x = x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])
    return x

  q, k, v = (to_4d(x, x.shape[-3:]) for x in (query, key, value))
  if mask is not None:
    mask = to_4d(jnp.asarray(mask) != 0, (None,) * 3)
  bias = to_4d(bias, (None,) * 3)
  out = attention(q, k, v, bias, mask, is_causal=is_causal, implementation=implementation,
                  interpret=interpret, deterministic_backward=deterministic_backward, **dropout)
  return out.reshape(query.shape[:-1] + value.shape[-1:])
