"""Benchmarks for pallas_attn: the sweep runner (`python -m benchmarks.run`), its report and plots.

Modules, one job each: `shapes` (what is swept), `impls` (name -> attention callable),
`timing` (how a call is timed, the FLOP formula, the matmul ceiling), `memory` (compiled and
allocator memory, the out-of-memory search), `run` (the command line), `report` (tables from a
results file), `plots` (the notebook's figures).
"""
