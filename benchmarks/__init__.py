"""Benchmarks for pallas_attn: the sweep runner (`python -m benchmarks.run`), its report and plots.

Modules, one job each: `shapes` (what is swept), `impls` (name -> attention callable),
`timing` (how a call is timed, the FLOP formula, the matmul ceiling), `memory` (compiled and
allocator memory, the out-of-memory search), `run` (the command line), `report` (tables from a
results file), `plots` (the notebook's figures).
"""

# The CPU sweep runs the Mosaic GPU kernels in the interpreter, which needs more XLA CPU threads
# than a small machine's core count (see pallas_attn.interpreter_threads); before JAX starts.
from pallas_attn import interpreter_threads as _interpreter_threads

_interpreter_threads.configure()
