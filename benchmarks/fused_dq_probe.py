"""Where the fused dK/dV/dQ kernel's time goes: the kernel with parts of its dQ work taken out.

  python -m benchmarks.fused_dq_probe --probes parts --seqs 16384,4096 --out $OUT/probe.jsonl

A timing probe, not a variant: the probes that take work out (`store`, `skip_reduce`,
`no_dq_mma`, ...) compute a wrong dQ on purpose (dK and dV stay right) and exist only to be
timed against the real kernel, beside the unfused dK/dV kernel, all on the same inputs with
their repeats interleaved (`timing.time_interleaved`). They swap functions of
`pallas_attn.mosaic_gpu.common` while one call traces and compiles, and put them back after.
The table's fused layout at `--head-dim` (128: the fused dQ in column halves, a step late; 256:
the fused head split), forced fused at every length; GPU only (it compiles). benchmarks/NOTES.md
sessions 17 (head_dim 128) and 25 (256) have the numbers.

Probe sets (--probes):
- `reduce`: the TMA reduce-add as it is; a plain TMA store instead (same bytes, no reduction in
  L2); the reduce-add without its wait for the tile's last read (`no_read_wait`); none (the
  float32 part written to shared memory only); two grid orders (head_dim 128).
- `parts`: no dQ wgmma (the dS^T tiles still written and met on), and no reduce-add either; the
  unfused dK/dV kernel as the table runs it (dP co-issued, 232 registers) and with the fused
  kernel's own knobs (240 registers, no dP co-issue).
- `knobs`: the fused kernel with its float32 tile swizzled, with dP co-issued, and both.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import bwd_parts
from benchmarks import report
from benchmarks import timing
import pallas_attn
from pallas_attn import numerics
from pallas_attn.mosaic_gpu import bwd
from pallas_attn.mosaic_gpu import common
from pallas_attn.mosaic_gpu import config as config_lib


def _store_instead(part, smem, dest, partials, pending=0):
  """common.reduce_add's copy without its reduction: a plain TMA store (dQ wrong)."""
  del partials
  plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
  smem[...] = part
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dest)


def _no_read_wait(part, smem, dest, partials, pending=0):
  """common.reduce_add without its wait for the last copy's read of the tile: the tile may be
  rewritten while a reduce-add still reads it (dQ wrong); the same bytes move."""
  del pending
  smem[...] = part
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dest, reduction_op=None if partials else "add")


def _no_copy(part, smem, dest, partials, pending=0):
  """The float32 part written to shared memory, never copied out (dQ wrong)."""
  del dest, partials, pending
  smem[...] = part
  plgpu.commit_smem()


def _without_product(accumulating, between, shape, staging=None):
  """common.matmul_accs_then_product without the product's wgmmas: `between()` still writes
  the dS^T tiles and meets; the part is zeros (dQ wrong)."""
  del staging

  def issue(acc_refs):
    for acc_ref, (_, lhs, rhs) in zip(acc_refs, accumulating):
      plgpu.wgmma(acc_ref, lhs, rhs)
    between()

  accs = pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc, _, _ in accumulating))
  plgpu.wgmma_wait(0)
  return accs, plgpu.layout_cast(jnp.zeros(shape, jnp.float32), common.WGMMA)


def probes(name: str, head_dim: int = 128) -> dict:
  """{probe: (swaps of `common` functions, dK/dV config, fused)} of probe set `name` at
  `head_dim`."""
  _, fused, unfused_table = bwd_parts.layouts(head_dim)
  no_reduce = dict(reduce_add=_no_copy)
  no_product = dict(matmul_accs_then_product=_without_product)
  # (The tiles' orders and dP's co-issue: head_dim 128's plain fused kernel only; the head
  # split walks both warpgroups over one key tile and issues dP^T alone.)
  plain = not fused.head_split
  sets = {
      "reduce": {
          "store": (dict(reduce_add=_store_instead), fused, True),
          "no_read_wait": (dict(reduce_add=_no_read_wait), fused, True),
          "skip_reduce": (no_reduce, fused, True),
          **({
              "tiles_first": ({}, dataclasses.replace(
                  fused, grid_order=("tiles", "heads", "batch")), True),
              "tiles_last": ({}, dataclasses.replace(
                  fused, grid_order=("heads", "batch", "tiles")), True),
          } if plain else {}),
      },
      "parts": {
          "skip_reduce": (no_reduce, fused, True),
          "no_dq_mma": (no_product, fused, True),
          "no_dq_mma_no_reduce": ({**no_product, **no_reduce}, fused, True),
          "unfused_table": ({}, unfused_table, False),
          "unfused_same_knobs": ({}, dataclasses.replace(fused, **config_lib.UNFUSED_DQ), False),
      },
      "knobs": {
          "swizzle_f32": ({}, dataclasses.replace(fused, swizzle_f32=True), True),
          **({
              "co_dp": ({}, dataclasses.replace(fused, co_issue_dp=True), True),
              "co_dp_swizzle": ({}, dataclasses.replace(fused, co_issue_dp=True,
                                                        swizzle_f32=True), True),
          } if plain else {}),
      },
  }
  # The real kernel first (the ratios' base) and again last (the noise to read them against).
  return {"fused": ({}, fused, True), **sets[name], "fused_again": ({}, fused, True)}


def lowered(swaps: dict, cfg, fused: bool, args, spec, platforms=None):
  """The probe's backward call on `args` (their head_dim the probe's), lowered (for
  `platforms`; None: this backend's) with `swaps` in `common` while it traces."""
  saved = {name: getattr(common, name) for name in swaps}
  for name, fn in swaps.items():
    setattr(common, name, fn)
  try:
    call = bwd.dqkv if fused else bwd.dkv
    fn = jax.jit(lambda q, k, v, d_out, lse, delta, lengths: call(
        q, k, v, d_out, lse, delta, lengths, lengths, scale=1 / math.sqrt(q.shape[-1]), spec=spec,
        cfg=cfg, interpret=False))
    return fn.trace(*args).lower(lowering_platforms=platforms)
  finally:
    for name, fn in saved.items():
      setattr(common, name, fn)


def run_shape(probe_set: str, seq: int, is_causal: bool, head_dim: int = 128) -> list[dict]:
  q, k, v, d_out, out, lse, lengths = bwd_parts.shape_arrays(head_dim, seq, is_causal,
                                                             interpret=False)
  spec = pallas_attn.MaskSpec(is_causal=is_causal)
  args = (q, k, v, d_out, lse, numerics.delta(d_out, out), lengths)
  batch = q.shape[0]
  fns = {name: lowered(*probe, args, spec).compile()
         for name, probe in probes(probe_set, head_dim).items()}
  timings = timing.time_interleaved([(fn, args) for fn in fns.values()])
  base = timings[0].ms
  return [dict(probe_set=probe_set, probe=name, head_dim=head_dim, seq=seq, batch=batch,
               causal=is_causal, ms=t.ms, ratio=base / t.ms, repeat_ms=t.repeat_ms)
          for name, t in zip(fns, timings)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--probes", choices=("reduce", "parts", "knobs"), default="parts")
  parser.add_argument("--head-dim", type=int, default=128, choices=(128, 256))
  parser.add_argument("--seqs", default="16384,4096")
  parser.add_argument("--causal", default="false", help="comma list of false/true")
  parser.add_argument("--out", default=None, help="JSON lines file for the rows")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("fused_dq_probe compiles the kernels: it needs a Hopper GPU")
  for is_causal in (c.strip() == "true" for c in args.causal.split(",")):
    for seq in (int(s) for s in args.seqs.split(",")):
      rows = run_shape(args.probes, seq, is_causal, args.head_dim)
      print(f"seq {seq} causal {is_causal}: " + ", ".join(
          f"{r['probe']} {r['ms']:.3f} ms ({r['ratio']:.3f}x)" for r in rows), flush=True)
      if args.out:
        report.append_rows(args.out, rows)


if __name__ == "__main__":
  main()
