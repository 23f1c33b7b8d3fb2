"""Move a PTX file's hoisted wgmma descriptors to their uses, to see what ptxas spills without them.

Usage (the CPU has ptxas 13.0, the device's): python scripts/sink_descriptors.py KERNEL.ptx OUT.ptx
then `ptxas -arch=sm_90a -v OUT.ptx -o /dev/null`. A descriptor is a definition
`%rdN = %rdB (or | +) C` with a 64-bit constant C of 12 digits or more (the layout bits of
Mosaic GPU's shared-memory descriptors); each is removed and recomputed right in front of every
instruction that reads it, in a new register. The PTX from `scripts/dump_sass.py --kernel dqkv`
(benchmarks/NOTES.md session 20) goes from 228 / 360 B of spill stores / loads to 8 / 20.
"""

import re
import sys

_DESCRIPTOR = re.compile(r"^\s*(or\.b64|add\.s64)\s+(%rd\d+), (%rd\d+), (\d{12,});\s*$")
_REGISTER = re.compile(r"%rd\d+\b")
_DECLARATION = re.compile(r"\.reg \.b64 \t%rd<(\d+)>;")


def sink(ptx: str) -> tuple[str, int, int]:
  """(the PTX with every descriptor recomputed at its uses, descriptors, uses)."""
  lines = ptx.split("\n")
  defs = {}
  for i, line in enumerate(lines):
    m = _DESCRIPTOR.match(line)
    if m:
      defs[m.group(2)] = (i, m.group(1), m.group(3), m.group(4))
  def_lines = {i for i, *_ in defs.values()}
  next_reg = int(_DECLARATION.search(ptx).group(1))
  first_reg, out = next_reg, []
  for i, line in enumerate(lines):
    if i in def_lines:
      continue
    for reg in dict.fromkeys(r for r in _REGISTER.findall(line) if r in defs):
      _, op, base, constant = defs[reg]
      new = f"%rd{next_reg}"
      next_reg += 1
      out.append(f"\t{op} \t{new}, {base}, {constant};")
      line = re.sub(re.escape(reg) + r"\b", new, line)
    out.append(line)
  text = _DECLARATION.sub(f".reg .b64 \t%rd<{next_reg}>;", "\n".join(out), count=1)
  return text, len(defs), next_reg - first_reg


def main(argv=None):
  args = sys.argv[1:] if argv is None else argv
  if len(args) != 2:
    raise SystemExit(__doc__)
  text, descriptors, uses = sink(open(args[0]).read())
  open(args[1], "w").write(text)
  print(f"{descriptors} descriptors recomputed at {uses} uses -> {args[1]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
