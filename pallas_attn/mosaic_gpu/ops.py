"""The differentiable Mosaic GPU attention: padding to whole tiles, the forward kernel, and a
`jax.custom_vjp` whose backward pass runs the dQ and dK/dV kernels. `forward` and `backward` are
the two passes alone (the backward from a caller's lse and delta), for `pallas_attn.ring`.
With a bias, the backward pass also runs the dbias kernel (`dbias.py`), but only when the bias
is differentiated: the custom_vjp's forward rule sees which inputs are perturbed
(`symbolic_zeros=True`) and tells the backward rule through the residuals' structure.

The custom_vjp runs each pass through `sharding.batch_head_parallel`: the kernels are custom calls
that XLA's partitioner would otherwise replicate (gathering q, k and v) under a sharded `jit`."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_attn import mask as mask_lib
from pallas_attn import numerics
from pallas_attn import sharding
from pallas_attn.mosaic_gpu import block_mask
from pallas_attn.mosaic_gpu import block_table
from pallas_attn.mosaic_gpu import bwd
from pallas_attn.mosaic_gpu import dbias as dbias_lib
from pallas_attn.mosaic_gpu import config as config_lib
from pallas_attn.mosaic_gpu import fwd
from pallas_attn.mosaic_gpu import gqa_pack
from pallas_attn.mosaic_gpu import mods as mods_lib
from pallas_attn.mosaic_gpu import split_kv

_WGS = config_lib.COMPUTE_WARPGROUPS


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything static about one call (a custom_vjp non-differentiable argument)."""

  scale: float
  spec: mask_lib.MaskSpec
  interpret: bool
  fwd_cfg: config_lib.KernelConfig
  dq_cfg: config_lib.KernelConfig
  dkv_cfg: config_lib.KernelConfig
  mods: mods_lib.KernelMods = mods_lib.KernelMods()
  # Decode-shaped GQA: the group's query heads packed into the rows of one tile (`gqa_pack`).
  pack_gqa: bool = False
  # Decode-shaped calls: the forward over key chunks, merged by lse (`split_kv`). 1: one pass;
  # None: `split_kv.num_splits` of each shard's shapes; n > 1: n chunks.
  kv_splits: int | None = 1

  # Both sequences are padded to whole tiles of every kernel (padded rows and keys fail the
  # length test).
  @property
  def q_multiple(self) -> int:
    # (A three-warpgroup forward's last CTA may reach past these rows: its warpgroups there skip.)
    return math.lcm(_WGS * self.fwd_cfg.block_q, _WGS * self.dq_cfg.block_q, self.dkv_cfg.block_q)

  # K and V are padded to whole tiles of the backward kernels (`kv_multiple`). The forward
  # walks them in its own key blocks over `fwd_kv_multiple`, the length its masks, tables and
  # modifier arrays are padded to: where its block_kv does not divide the arrays' length (block_kv
  # 192), its last block reaches past K and V, and the TMA copies fill that part with zeros
  # (keys the length test hides), so that K and V are not copied to a longer array.
  @property
  def kv_multiple(self) -> int:
    return math.lcm(self.dq_cfg.block_kv, _WGS * self.dkv_cfg.block_kv)

  @property
  def fwd_kv_multiple(self) -> int:
    return math.lcm(self.fwd_cfg.block_kv, self.kv_multiple)


def _static(head_dim: int, scale: float, spec: mask_lib.MaskSpec, interpret: bool,
            fwd_cfg: config_lib.KernelConfig | None = None,
            dq_cfg: config_lib.KernelConfig | None = None,
            dkv_cfg: config_lib.KernelConfig | None = None,
            mods: mods_lib.KernelMods = mods_lib.KernelMods(),
            deterministic: bool = False) -> _Static:
  """The call's static part; a config left None is the table's (`config.DEFAULTS`).
  `deterministic`: the backward makes dQ in its own kernel (`config.separate_dq`), never by
  reduce-adds whose order varies."""
  for name, cfg in (("dq_cfg", dq_cfg), ("dkv_cfg", dkv_cfg)):
    if cfg is not None and cfg.compute_warpgroups != _WGS:
      raise ValueError(f"{name}: the backward kernels run {_WGS} compute warpgroups, got "
                       f"compute_warpgroups={cfg.compute_warpgroups} (a forward-only option)")
  dq_cfg = dq_cfg or config_lib.kernel_config(head_dim, "dq")
  dkv_cfg = dkv_cfg or config_lib.kernel_config(head_dim, "dkv")
  if deterministic:
    dq_cfg, dkv_cfg = config_lib.separate_dq(dq_cfg, dkv_cfg)
  return _Static(scale=scale, spec=spec, interpret=interpret,
                 fwd_cfg=fwd_cfg or config_lib.kernel_config(head_dim, "fwd"), dq_cfg=dq_cfg,
                 dkv_cfg=dkv_cfg, mods=mods)


def attention(q, k, v, q_lengths, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
              interpret: bool = False, fwd_cfg: config_lib.KernelConfig | None = None,
              dq_cfg: config_lib.KernelConfig | None = None,
              dkv_cfg: config_lib.KernelConfig | None = None,
              logits_soft_cap: float | None = None, q_segment_ids=None, kv_segment_ids=None,
              alibi_slopes=None, dropout_rate: float = 0.0, dropout_seed=None,
              broadcast_dropout: bool = False, mask_fn=None, score_fn=None, bias=None,
              mask=None, kv_splits: int | None = None, deterministic_backward: bool = False):
  """q [B, T, Hq, D], k/v [B, S, Hkv, D] (bf16/f16), lengths int32 [B] or None.
  `fwd_cfg`, `dq_cfg`, `dkv_cfg` override the table's tiles of the forward, dQ and dK/dV kernels
  (benchmarks/tune.py compares variants with them). `kv_splits` overrides the number of key
  chunks of the forward (`split_kv`; None: its heuristic), used only where splitting is exact.
  `deterministic_backward`: gradients the same to the bit from run to run (dQ from its own
  kernel: `config.separate_dq`).

  Score modifiers (see `mods`), applied in the kernels:
    logits_soft_cap: static float: logits become cap * tanh(logit / cap).
    q_segment_ids, kv_segment_ids: int [B, T] and [B, S], both or neither: query i sees key j
      only where their ids are equal (packed sequences).
    alibi_slopes: float32 [Hq]: adds -slope[h] * |i + offset - j| to the scaled logits.
      Constants: no gradient flows to them, and differentiating with respect to them raises
      TypeError (use `jax.lax.stop_gradient` on trainable slopes, or the portable path to train
      them).
    dropout_rate: static float in [0, 1): attention-weight dropout inside the kernels, the same
      keep-mask as the portable path (`pallas_attn.dropout`); kept weights are scaled by
      1 / (1 - rate); the lse stays that of the undropped softmax.
    dropout_seed: uint32 or int32 [2] (`pallas_attn.dropout.seed_from_key(key)`); needed when
      dropout_rate > 0.
    broadcast_dropout: one keep-mask for every batch element and head.
    mask_fn, score_fn: FlexAttention-style functions (as `pallas_attn.attention` takes them),
      traced into the kernels: mask_fn(b, h, q_idx, kv_idx) -> bool and
      score_fn(s, b, h, q_idx, kv_idx) -> s on each tile, with b, h int32 scalars (global batch
      index, query head) and q_idx, kv_idx int32 tiles of positions. Functions that close over
      arrays or use primitives the Mosaic GPU lowering lacks raise NotImplementedError
      (`mods.element_fns_problem`).
    bias: float [B|1, Hq|1, T|1, S|1] (size-1 axes broadcast), added to the scaled logits
      before ALiBi and the soft-cap. Differentiable: its gradient has its own shape (the dbias
      kernel sums over the broadcast axes; it runs only when the bias is differentiated).
      float32, bfloat16 and float16 are read as they are, other float dtypes cast to float32.
    mask: bool, shaped like bias; False hides the score (after the soft-cap, like the
      positional mask). A row it hides entirely gets lse +inf.

  Returns (out [B, T, Hq, D], lse [B, Hq, T] float32 with +inf on rows that saw no key).
  """
  mods, mod_arrays = mods_lib.from_arguments(q, k, logits_soft_cap, q_segment_ids,
                                             kv_segment_ids, alibi_slopes, dropout_rate,
                                             dropout_seed, broadcast_dropout, mask_fn=mask_fn,
                                             score_fn=score_fn, bias=bias, mask=mask)
  static = _static(q.shape[-1], scale, spec, interpret, fwd_cfg, dq_cfg, dkv_cfg, mods,
                   deterministic=deterministic_backward)
  position_free_mods = mods == mods_lib.KernelMods(soft_cap=mods.soft_cap)
  if gqa_pack.should_pack(q.shape, k.shape[2], spec, k.shape[1], position_free_mods,
                          static.fwd_cfg.rows_per_cta):
    static = dataclasses.replace(
        static, spec=gqa_pack.positional_mask(spec, q.shape[1], k.shape[1]), pack_gqa=True)
  if kv_splits is not None and kv_splits < 1:
    raise ValueError(f"kv_splits must be None or a positive int, got {kv_splits}")
  if split_kv.exact(spec, q.shape[1], k.shape[1], position_free_mods):
    static = dataclasses.replace(
        static, spec=gqa_pack.positional_mask(spec, q.shape[1], k.shape[1]), kv_splits=kv_splits)
  return _attention(static, q, k, v, q_lengths, kv_lengths, *mod_arrays)


def forward(q, k, v, q_lengths, kv_lengths, *, scale: float, spec: mask_lib.MaskSpec,
            interpret: bool = False, fwd_cfg: config_lib.KernelConfig | None = None):
  """The forward kernel alone (not differentiable), on one device's arrays. Arguments and
  results as `attention`."""
  return _forward_pass(_static(q.shape[-1], scale, spec, interpret, fwd_cfg=fwd_cfg), q, k, v,
                       q_lengths, kv_lengths)


def backward(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, *, scale: float,
             spec: mask_lib.MaskSpec, interpret: bool = False,
             dq_cfg: config_lib.KernelConfig | None = None,
             dkv_cfg: config_lib.KernelConfig | None = None, deterministic: bool = False):
  """The dQ and dK/dV kernels alone (not differentiable), on one device's arrays, from the
  caller's lse and delta [B, Hq, T] float32: lse of each query row's whole softmax (which may span
  keys outside `k`; +inf marks rows that see no key), delta = `numerics.delta(d_out, out)` of the
  whole output. `dq_cfg`, `dkv_cfg` as in `attention`; `deterministic` as its
  `deterministic_backward`. Returns (dq [B, T, Hq, D], dk, dv [B, S, Hkv, D]) in the input
  dtype."""
  static = _static(q.shape[-1], scale, spec, interpret, dq_cfg=dq_cfg, dkv_cfg=dkv_cfg,
                   deterministic=deterministic)
  return _backward_pass(static, q, k, v, d_out, lse, delta, q_lengths, kv_lengths)


def _visibility(static: _Static, cfg: config_lib.KernelConfig, q_lengths, kv_lengths,
                q_len: int, kv_len: int, mod_arrays: mods_lib.ModArrays,
                element_blocks: block_table.BlockVisibility | None):
  """The tiles of `cfg`'s grid over the padded lengths that positions, segment ids and the
  element masks (`element_blocks`: `block_mask.fine_visibility`) leave visible
  (`block_table.block_visibility`); None without segment ids and element masks: the kernels then
  skip by position alone, in the kernel."""
  if not static.mods.segment_ids and element_blocks is None:
    return None
  return block_table.block_visibility(
      static.spec, q_lengths, kv_lengths, block_q=cfg.block_q, block_kv=cfg.block_kv,
      num_q_blocks=q_len // cfg.block_q, num_kv_blocks=kv_len // cfg.block_kv,
      q_segment_ids=mod_arrays.q_segment_ids, kv_segment_ids=mod_arrays.kv_segment_ids,
      block_mask=(None if element_blocks is None
                  else block_mask.coarsen(element_blocks, cfg.block_q, cfg.block_kv)))


def _table(visibility, build):
  return None if visibility is None else build(visibility)


def _split_operands(operands):
  """The passes' trailing operands: (`mods.ModArrays`, mask_fn's precomputed tiles or None)
  (see `_mask_fn_tile_operands`); the public `forward` / `backward` pass none."""
  count = len(mods_lib.ModArrays._fields)
  mod_arrays = mods_lib.ModArrays(*operands[:count])
  tiles = operands[count:]
  if not tiles or tiles[0] is None:
    return mod_arrays, None
  return mod_arrays, block_table.BlockVisibility(*tiles)


def _mask_fn_tile_operands(static: _Static, q_len: int, kv_len: int, kv_multiple: int) -> tuple:
  """(visible, full): the FINE tiles of a mask_fn of positions alone over the padded grid (keys
  padded to `kv_multiple`: the forward's or the backward's), computed while tracing
  (`block_mask.position_tiles`) and passed to the sharded passes as replicated operands; (None,
  None) otherwise."""
  padded = (mask_lib.round_up(q_len, static.q_multiple), mask_lib.round_up(kv_len, kv_multiple))
  tiles = block_mask.position_tiles(static.mods, *padded)
  return (None, None) if tiles is None else tuple(tiles)


def _forward_pass(static: _Static, q, k, v, q_lengths, kv_lengths, *mod_arrays):
  # (On one shard's arrays: the heuristic counts this device's CTAs.)
  splits = static.kv_splits or split_kv.num_splits(
      q.shape, k.shape, pack_gqa=static.pack_gqa, rows_per_cta=static.fwd_cfg.rows_per_cta,
      kv_block=static.fwd_kv_multiple)
  if splits > 1:
    unsplit = functools.partial(_forward_pass, dataclasses.replace(static, kv_splits=1))
    return split_kv.forward(unsplit, splits, static.fwd_kv_multiple, q, k, v, q_lengths,
                            kv_lengths, *mod_arrays)
  if static.pack_gqa:
    kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    out, lse = _forward_pass(dataclasses.replace(static, pack_gqa=False),
                             gqa_pack.pack_rows(q, kv_heads), k, v,
                             gqa_pack.pack_lengths(q_lengths, group), kv_lengths, *mod_arrays)
    return gqa_pack.unpack_rows(out, group), gqa_pack.unpack_stats(lse, group)
  q_len = q.shape[1]
  # (K and V at least one key block long: a TMA copy may reach past an array's end, not be
  # longer than it.)
  padded = mask_lib.pad_to_tiles(q, k, v, q_lengths, kv_lengths, static.q_multiple,
                                 static.kv_multiple, min_kv_len=static.fwd_cfg.block_kv)
  padded_lens = padded[0].shape[1], mask_lib.round_up(k.shape[1], static.fwd_kv_multiple)
  mod_arrays, mask_fn_tiles = _split_operands(mod_arrays)
  padded_arrays = mod_arrays.padded(*padded_lens)
  element_blocks = block_mask.fine_visibility(static.mods, padded_arrays, *padded_lens,
                                              mask_fn_tiles)
  table = _table(_visibility(static, static.fwd_cfg, *padded[3:], *padded_lens, mod_arrays,
                             element_blocks), block_table.query_major)
  # (A block table's entries are per pair of query blocks: a three-warpgroup config walks it
  # with two. The tiles are the same, so is the table.)
  fwd_cfg = static.fwd_cfg if table is None else static.fwd_cfg.two_warpgroups()
  out, lse = fwd.forward(*padded, scale=static.scale, spec=static.spec, cfg=fwd_cfg,
                         interpret=static.interpret, mods=static.mods,
                         mod_arrays=padded_arrays, table=table, kv_len=padded_lens[1])
  return out[:, :q_len], lse[:, :, :q_len]


def _backward_pass(static: _Static, q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                   *mod_arrays, with_dbias: bool = False):
  """(dq, dk, dv), and the bias gradient (float32, the bias's shape) when `with_dbias`."""
  if static.pack_gqa:  # (never with a bias: packing needs position-free modifiers)
    kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    dq, dk, dv = _backward_pass(
        dataclasses.replace(static, pack_gqa=False), gqa_pack.pack_rows(q, kv_heads), k, v,
        gqa_pack.pack_rows(d_out, kv_heads), gqa_pack.pack_stats(lse, kv_heads),
        gqa_pack.pack_stats(delta, kv_heads), gqa_pack.pack_lengths(q_lengths, group),
        kv_lengths, *mod_arrays)
    return gqa_pack.unpack_rows(dq, group), dk, dv
  q_len, kv_len = q.shape[1], k.shape[1]
  q, k, v, q_lengths, kv_lengths = mask_lib.pad_to_tiles(
      q, k, v, q_lengths, kv_lengths, static.q_multiple, static.kv_multiple)
  d_out, lse, delta = mask_lib.pad_row_inputs(d_out.astype(q.dtype), lse, delta,
                                              static.q_multiple)
  mod_arrays, mask_fn_tiles = _split_operands(mod_arrays)
  padded_arrays = mod_arrays.padded(q.shape[1], k.shape[1])
  element_blocks = block_mask.fine_visibility(static.mods, padded_arrays, q.shape[1], k.shape[1],
                                              mask_fn_tiles)
  visibility = functools.partial(_visibility, static, q_lengths=q_lengths,
                                 kv_lengths=kv_lengths, q_len=q.shape[1], kv_len=k.shape[1],
                                 mod_arrays=mod_arrays, element_blocks=element_blocks)
  dq_cfg, dkv_cfg = _backward_configs(static, q.shape[1], k.shape[1])
  fused_dq = dkv_cfg.fused_dq  # (then no dQ kernel, no dQ table)
  dq_visibility = None if fused_dq else visibility(dq_cfg)
  same_tiles = (dkv_cfg.block_q, dkv_cfg.block_kv) == (dq_cfg.block_q, dq_cfg.block_kv)
  dkv_visibility = (dq_visibility if same_tiles and not fused_dq
                    else visibility(dkv_cfg))
  if dkv_visibility is not None:  # one list per kv head, for its whole query-head group
    dkv_visibility = block_mask.group_union(dkv_visibility, q.shape[2] // k.shape[2])
  common = dict(scale=static.scale, spec=static.spec, interpret=static.interpret,
                mods=static.mods, mod_arrays=padded_arrays)
  dkv_table = _table(dkv_visibility, functools.partial(
      block_table.key_major, rows_per_cta=1 if dkv_cfg.head_split else _WGS))
  if fused_dq:  # one launch: dK/dV with dQ added in
    dq, dk, dv = bwd.dqkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                          cfg=dkv_cfg, table=dkv_table, **common)
  else:
    dq = bwd.dq(q, k, v, d_out, lse, delta, kv_lengths, cfg=dq_cfg,
                table=_table(dq_visibility, functools.partial(
                    block_table.query_major,
                    rows_per_cta=1 if dq_cfg.head_split else _WGS)), **common)
    if static.interpret:
      # The interpreter keeps one global model of shared memory and runs each warpgroup as a
      # thread that blocks on barriers; two kernels interpreted at once (XLA may run the
      # independent dQ and dK/dV calls concurrently) can deadlock. Order them.
      dq, q = jax.lax.optimization_barrier((dq, q))
    dk, dv = bwd.dkv(q, k, v, d_out, lse, delta, q_lengths, kv_lengths, cfg=dkv_cfg,
                     table=dkv_table, **common)
  grads = (dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len])
  if not with_dbias:
    return grads
  if static.interpret:  # one interpreted kernel at a time (see above)
    (dk, dv), q = jax.lax.optimization_barrier(((dk, dv), q))
    grads = (dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len])
  d_bias = dbias_lib.dbias(q, k, v, d_out, lse, delta, q_lengths, kv_lengths,
                           bias_shape=common["mod_arrays"].bias.shape, cfg=static.dq_cfg,
                           **common)
  # Back to the bias's own extent: cut the padding of full q / kv axes.
  return grads + (d_bias[:, :, :q_len if d_bias.shape[2] > 1 else 1,
                         :kv_len if d_bias.shape[3] > 1 else 1],)


def _backward_configs(static: _Static, q_len: int, kv_len: int):
  """The (dQ, dK/dV) configs of a backward over the padded lengths: the static ones, or their
  separate-dQ form for rows of a few blocks (`config.backward_configs`) where its tiles
  divide the lengths (padded for the static ones)."""
  dq_cfg, dkv_cfg = config_lib.backward_configs(
      static.dq_cfg, static.dkv_cfg, bwd.key_tile_blocks(static.spec, q_len, kv_len,
                                                         static.dkv_cfg))
  if q_len % math.lcm(_WGS * dq_cfg.block_q, dkv_cfg.block_q) or kv_len % math.lcm(
      dq_cfg.block_kv, _WGS * dkv_cfg.block_kv):
    return static.dq_cfg, static.dkv_cfg
  return dq_cfg, dkv_cfg


def _pair_shapes(mod_arrays):
  """The shapes of the bias and mask operands (None where absent)."""
  arrays = mods_lib.ModArrays(*mod_arrays)
  return tuple(None if x is None else x.shape for x in (arrays.bias, arrays.mask))


def _sharded_forward(static: _Static, q, k, v, q_lengths, kv_lengths, *mod_arrays):
  # (+ the two mask_fn tile operands [1, 1, nq, nk], whole on every shard)
  layout = sharding.with_replicated(
      sharding.with_pairs(sharding.FORWARD, *_pair_shapes(mod_arrays)), 2)
  tiles = _mask_fn_tile_operands(static, q.shape[1], k.shape[1], static.fwd_kv_multiple)
  return sharding.batch_head_parallel(functools.partial(_forward_pass, static), layout,
                                      q, k, v, q_lengths, kv_lengths, *mod_arrays, *tiles,
                                      auto_axes=not static.interpret)


# mod_arrays: the fields of `mods.ModArrays` (q_segment_ids, kv_segment_ids, alibi_slopes,
# dropout_prefix, batch_index, head_index, bias, mask), each None when absent.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, q_lengths, kv_lengths, *mod_arrays):
  return _sharded_forward(static, q, k, v, q_lengths, kv_lengths, *mod_arrays)


def _attention_fwd(static, *primals):
  # symbolic_zeros: each array comes as (value, perturbed). Only the bias's bit matters: its
  # gradient costs a kernel of its own, run only when the bias is differentiated.
  bias = mods_lib.ModArrays(*primals[5:]).bias
  with_dbias = bias is not None and bias.perturbed
  q, k, v, q_lengths, kv_lengths, *mod_arrays = jax.tree.map(lambda p: p.value, primals)
  out, lse = _sharded_forward(static, q, k, v, q_lengths, kv_lengths, *mod_arrays)
  # The residuals' structure carries the static `with_dbias` to the backward rule.
  dbias_marker = () if with_dbias else None
  return (out, lse), (q, k, v, out, lse, q_lengths, kv_lengths, tuple(mod_arrays), dbias_marker)


def _attention_bwd(static, res, cotangents):
  q, k, v, out, lse, q_lengths, kv_lengths, mod_arrays, dbias_marker = res
  with_dbias = dbias_marker is not None
  d_out, _ = cotangents  # the lse leaves the API under stop_gradient
  if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
    d_out = jnp.zeros_like(out)
  layout = sharding.with_replicated(
      sharding.with_pairs(sharding.BACKWARD, *_pair_shapes(mod_arrays), dbias=with_dbias), 2)
  tiles = _mask_fn_tile_operands(static, q.shape[1], k.shape[1], static.kv_multiple)
  grads = sharding.batch_head_parallel(
      functools.partial(_backward_pass, static, with_dbias=with_dbias), layout,
      q, k, v, d_out, lse, numerics.delta(d_out, out), q_lengths, kv_lengths, *mod_arrays,
      *tiles, auto_axes=not static.interpret)
  dq, dk, dv = grads[:3]
  # No cotangent for the lengths, the segment ids, the dropout prefix, the mask nor the ALiBi
  # slopes (constants: see `mods.constant_slopes`).
  d_mods = mods_lib.ModArrays()
  if with_dbias:
    d_mods = d_mods._replace(bias=grads[3].astype(mods_lib.ModArrays(*mod_arrays).bias.dtype))
  return (dq, dk, dv, None, None) + tuple(d_mods)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
