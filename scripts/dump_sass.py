"""Dump the SASS of one of the table's kernels at one shape, and count its instructions.

Usage (on the H200): PYTHONPATH=. python scripts/dump_sass.py --head-dim 64 --out $OUT/sass
(`--kernel dq|dkv|dqkv`: the backward's kernels as `benchmarks.bwd_parts` runs them: the table's
dQ kernel, its dK/dV kernel without dQ, and the dK/dV kernel that also makes dQ, the table's fused
layout forced on; default the forward, `--fwd-variant` a tuner variant's.)
Mosaic GPU writes the kernel's PTX, ptxas log and SASS under --out (MOSAIC_GPU_DUMP_*; nvdisasm
comes from CUDA_ROOT, which the device image's pip-installed CUDA does not set). Then the
mnemonics of each dumped file that holds SASS (HGMMA instructions) are counted, whole kernel and
per loop body (the instructions between a backward branch's target and the branch), so the
softmax's share of a step's issue slots can be read off without the GPU.
"""

import argparse
import collections
import os
import pathlib
import re
import sys

_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"^\s*(\.L_\w+):")
_BRANCH_TARGET = re.compile(r"\bBRA\b[^;]*?(?:0x([0-9a-f]+)|(\.L_\w+))")


def count_sass(text: str) -> dict:
  """{"kernel": Counter of base mnemonics, "loops": [(start, end, Counter), ...]} of one SASS
  listing; a loop is the range of a backward branch (to an address or a label)."""
  ops, addr_ops, labels, branches, pending = collections.Counter(), [], {}, [], []
  for line in text.splitlines():
    label = _LABEL.match(line)
    if label:
      pending.append(label.group(1))
      continue
    m = _OPCODE.search(line)
    if not m:
      continue
    addr = int(_ADDR.search(line).group(1), 16)
    for name in pending:
      labels[name] = addr
    pending = []
    op = m.group(1).split(".")[0]
    ops[op] += 1
    addr_ops.append((addr, op))
    b = _BRANCH_TARGET.search(line)
    if op == "BRA" and b:
      branches.append((addr, b.group(1), b.group(2)))
  loops = []
  for at, hex_target, label in branches:
    target = int(hex_target, 16) if hex_target else labels.get(label)
    if target is not None and target < at:
      body = collections.Counter(op for a, op in addr_ops if target <= a <= at)
      loops.append((target, at, body))
  return {"kernel": ops, "loops": loops}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--causal", action="store_true")
  p.add_argument("--kernel", choices=("fwd", "dq", "dkv", "dqkv"), default="fwd")
  p.add_argument("--fwd-variant", default=None,
                 help="with --kernel fwd: the forward of this benchmarks.tune variant instead of "
                      "the table's")
  p.add_argument("--out", required=True, help="folder for Mosaic GPU's dumps")
  p.add_argument("--keep", default=None,
                 help="copy the SASS listing to this file (the dump folder holds many files; with "
                      "several kernels, the last one listed)")
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  os.environ.setdefault("CUDA_ROOT", "/usr/local/cuda-13.0")
  os.environ.update(MOSAIC_GPU_DUMP_TO=str(out), MOSAIC_GPU_DUMP_SASS="1",
                    MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
  import jax  # after the environment: Mosaic GPU reads it when it compiles
  import jax.numpy as jnp
  import pallas_attn as pa

  if args.kernel != "fwd":
    from benchmarks import bwd_parts  # (imports jax: after the environment too)
    arrays = bwd_parts.shape_arrays(args.head_dim, args.seq, args.causal, interpret=False)
    jax.block_until_ready(bwd_parts.parts(args.head_dim, args.causal, interpret=False)[
        args.kernel](*arrays))
  else:
    heads = 2048 // args.head_dim
    shape = (16384 // args.seq, args.seq, heads, args.head_dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(3))
    if args.fwd_variant:
      from benchmarks import tune
      from pallas_attn.mosaic_gpu import ops
      cfg = tune.variant_configs(args.fwd_variant, args.head_dim)["fwd"]
      fwd = jax.jit(lambda q, k, v: ops.forward(
          q, k, v, None, None, scale=args.head_dim ** -0.5,
          spec=pa.MaskSpec(is_causal=args.causal), fwd_cfg=cfg)[0])
    else:
      fwd = jax.jit(lambda q, k, v: pa.attention(q, k, v, is_causal=args.causal,
                                                 implementation="mosaic_gpu"))
    fwd(q, k, v).block_until_ready()
  for path in sorted(f for f in out.rglob("*") if f.is_file()):
    text = path.read_text(errors="replace")
    if "HGMMA" not in text:  # (the PTX and the ptxas log)
      continue
    counts = count_sass(text)
    if args.keep and path.suffix != ".ptx":
      pathlib.Path(args.keep).write_text(text)
    print(f"== {path.name}: {sum(counts['kernel'].values())} instructions")
    print("  kernel:", dict(counts["kernel"].most_common(24)))
    for start, end, body in counts["loops"]:
      print(f"  loop {start:#x}-{end:#x}: {sum(body.values())} instructions:",
            dict(body.most_common(20)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
