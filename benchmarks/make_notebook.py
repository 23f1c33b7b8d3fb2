"""Writes notebooks/benchmarks.ipynb from the cells below (so that the notebook is reviewed as
Python), and with --execute runs it and saves it with its outputs.

  python -m benchmarks.make_notebook --execute      # after a new results file: commit the output

The notebook loads benchmarks/results/h200.jsonl when it exists, else cpu.jsonl. Environment:
  PALLAS_ATTN_NOTEBOOK_SMALL=1   run a tiny CPU sweep in the notebook instead (what CI does)
  PALLAS_ATTN_NOTEBOOK_RERUN=1   re-run the sweep on this machine first (the full one on a GPU);
                                 PALLAS_ATTN_NOTEBOOK_RERUN_ARGS passes flags, e.g. "--quick"
"""

from __future__ import annotations

import argparse
import pathlib

import nbformat
from nbformat import v4

from benchmarks import nbexec

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "benchmarks.ipynb"

CELLS = [
    ("md", """# pallas_attn benchmarks

FlashAttention in JAX (`pallas_attn`) against `jax.nn.dot_product_attention` (xla, cudnn) and
tokamax (mosaic, triton), measured in one run by `python -m benchmarks.run` (see
`benchmarks/README.md`). This notebook reads the committed results file: the H200 sweep
(`benchmarks/results/h200.jsonl`) when it exists, else the small CPU sweep (`cpu.jsonl`), which
runs the interpreter and the portable path on tiny shapes: its speeds say nothing about GPUs.

Regenerate after a new run: `python -m benchmarks.make_notebook --execute`."""),
    ("code", """import os

# PALLAS_ATTN_NOTEBOOK_SMALL=1: run a tiny CPU sweep here instead of loading results (CI does this).
SMALL = os.environ.get("PALLAS_ATTN_NOTEBOOK_SMALL") == "1"
# PALLAS_ATTN_NOTEBOOK_RERUN=1: re-run the sweep on this machine first (the full sweep on a GPU).
RERUN = os.environ.get("PALLAS_ATTN_NOTEBOOK_RERUN") == "1"
RERUN_ARGS = os.environ.get("PALLAS_ATTN_NOTEBOOK_RERUN_ARGS", "").split()""", ["parameters"]),
    ("code", """import pathlib
import sys
import tempfile

ROOT = pathlib.Path.cwd().resolve()
while not (ROOT / "benchmarks" / "run.py").exists() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt

from benchmarks import plots, report

RESULTS = ROOT / "benchmarks" / "results\""""),
    ("code", """if SMALL:
    from benchmarks import run
    path = pathlib.Path(tempfile.mkdtemp()) / "small.jsonl"
    run.main(["--shapes", "tiny", "--impls", "blocked_jax,reference,xla", "--repeats", "2",
              "--max-calls", "2", "--ceiling-size", "256", "--no-max-seq-search", "--quiet",
              "--out", str(path)])
elif RERUN:
    import jax
    from benchmarks import run
    device = jax.devices()[0]
    path = run.default_out(device.device_kind, "cpu" if device.platform == "cpu" else "gpu")
    run.main(RERUN_ARGS + ["--out", str(path)])
else:
    path = RESULTS / "h200.jsonl"
    if not path.exists():
        path = RESULTS / "cpu.jsonl"
rows = report.load(path)
first = next((r for r in rows if r.get("device")), {})
dates = sorted({r["date"] for r in rows if r.get("date")})
runs = len({r.get("run_id") for r in rows if r.get("run_id")})
# The tables keep each measurement's newest row; the dates span the runs the file holds.
print(f"{len(rows)} rows from {path.name} ({runs} runs): {first.get('device')}, "
      f"jax {first.get('jax_version')}, {dates[0] if dates else '?'} to {dates[-1] if dates else '?'}")
ceiling = report.ceiling(rows)
if ceiling:
    print(f"matmul ceiling ({ceiling['dtype']} {ceiling['m']}^3, same timing method): "
          f"{ceiling['tflops']:.4g} TFLOP/s")"""),
    ("md", """## Speed

FLOPs are counted the FlashAttention way: forward `4·B·H·Sq·Skv·D` (halved when causal),
forward+backward 3.5× forward; TFLOP/s = FLOPs / median time. Each call is timed the same way
for every implementation: warm-up calls, then repeats of up to 20 calls enqueued back to back with
one sync at the end; the median repeat's time per call. The table gives TFLOP/s and, in
parentheses, the speed relative to cuDNN at the same shape (relative to jax's xla path where cuDNN
did not run, as on a CPU)."""),
    ("code", """print(report.speed_table(rows))"""),
    ("code", """plots.tflops_vs_seq(rows, head_dims=(64, 128))
plt.show()"""),
    ("md", """Speed relative to the baseline (cuDNN on a GPU), and as a share of the matmul rate measured
in the same run (the rate the attention's own matmuls could reach)."""),
    ("code", """plots.ratio_vs_seq(rows, head_dims=(64, 128))
plt.show()
plots.metric_vs_seq(rows, "pct_of_matmul", head_dims=(64, 128), ylabel="% of matmul ceiling")
plt.show()"""),
    ("md", """Grouped-query attention (32 query heads over 8 kv heads) and decode-like calls (a few
queries over a long KV cache; these are bound by reading K and V, so `gb_per_s`, the fewest bytes
moved per second, is the number to read)."""),
    ("code", """other = [r for r in rows if r.get("family") in ("gqa", "decode", "cpu_gqa", "cpu_decode")]
print(report.speed_table(other) if other else "no GQA / decode rows")
for r in report.attention_rows(other):
    if r.get("family") in ("decode", "cpu_decode") and report.ok(r):
        print(f"{report.shape_label(r):28s} {r['pass']:8s} {report.SHORT[r['implementation']]:12s}"
              f" {r['ms']:.4g} ms  {r['gb_per_s']:.4g} GB/s")"""),
    ("md", """## Memory

Dense attention materializes the `[batch, heads, N, N]` score matrix; FlashAttention keeps one
tile of it at a time. Peak memory per call against sequence length, from the out-of-memory
search (`--max-seq-search`: batch 1, 16 heads of 128, causal, doubling N until a call fails) when
the file has one, else from the sweep's compiled memory. The dotted line marks where the dense
path runs out of memory."""),
    ("code", """plots.memory_vs_seq(rows)
plt.show()
print(report.max_seq_table(rows) or "no out-of-memory search in this file")"""),
    ("md", """### The worked numbers

One head's score matrix at N = 8192 in bf16 is 8192² × 2 bytes = 128 MiB; the call holds one per
head and batch element (and softmax keeps them in float32). Against that, what each
implementation's compiled call allocates beyond its inputs and outputs
(`memory_analysis().temp_size_in_bytes`). On the CPU file the same arithmetic is worked at its
longest sequence."""),
    ("code", """print(plots.worked_memory_text(rows, seq=8192, head_dim=128))
plots.worked_memory(rows, seq=8192, head_dim=128)
plt.show()"""),
    ("md", """## Correctness

Each result is checked against `pallas_attn.reference_attention` in float32 on the same
(upcast) inputs: `max |out − ref| / max |ref|`, for forward+backward the worst of dq, dk, dv
(cotangent: random normal). jax's xla path computes plain attention in bf16, so its error is the
scale to judge the others by (FlashAttention's criterion: within about 2× of it)."""),
    ("code", """plots.error_panel(rows)
plt.show()
print(report.check_table(rows))
print(report.error_lines(rows) or "no failures")"""),
]


def build() -> nbformat.NotebookNode:
  nb = v4.new_notebook()
  for kind, source, *tags in CELLS:
    cell = v4.new_markdown_cell(source) if kind == "md" else v4.new_code_cell(source)
    if tags:
      cell.metadata["tags"] = tags[0]
    nb.cells.append(cell)
  nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python",
                               "name": "python3"}
  nb.metadata["language_info"] = {"name": "python"}
  return nb


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--execute", action="store_true", help="run it and keep the outputs")
  parser.add_argument("--out", default=str(NOTEBOOK))
  args = parser.parse_args(argv)
  nb = build()
  if args.execute:
    nbexec.execute(nb, cwd=NOTEBOOK.parent)
  nbformat.validate(nb)
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  nbformat.write(nb, args.out)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
