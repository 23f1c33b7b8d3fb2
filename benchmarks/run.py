"""The benchmark's main job: run a sweep, write one JSON line per measurement, print the tables.

  python -m benchmarks.run            # GPU: the full sweep -> benchmarks/results/<gpu>.jsonl
                                      # CPU: a small sweep  -> benchmarks/results/cpu.jsonl
  python -m benchmarks.run --quick    # GPU: the anchor shapes only (N = 1024, 4096, 16384, ...)
  python -m benchmarks.run --max-seq-search --shapes none   # only the out-of-memory search

With a GPU it measures every implementation (pallas_attn's three, jax.nn's xla and cudnn, tokamax's
mosaic and triton when `import tokamax` works) on the presets in `shapes`. Without one it runs the
CPU paths (the Mosaic GPU kernels in the Pallas interpreter, the portable blocked path, the dense
reference, jax.nn's xla) on tiny shapes, so that a new user sees it work anywhere. Every result is
checked against a float32 reference where that fits, and every row says how much memory the call
needs. See benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp

from benchmarks import impls as impls_lib
from benchmarks import memory
from benchmarks import report
from benchmarks import shapes as shapes_lib
from benchmarks import sweep
from benchmarks import timing

RESULTS = pathlib.Path(__file__).parent / "results"


def default_out(device_kind: str, plat: str) -> pathlib.Path:
  """results/cpu.jsonl, results/h200.jsonl, or results/<device kind>.jsonl."""
  if plat == "cpu":
    return RESULTS / "cpu.jsonl"
  kind = device_kind.lower().replace("nvidia", "").strip()
  slug = "".join(c if c.isalnum() else "_" for c in kind).strip("_") or "gpu"
  return RESULTS / f"{'h200' if 'h200' in slug else slug}.jsonl"


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      description="Benchmark pallas_attn against jax.nn (xla, cudnn) and tokamax.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="GPU: the 'quick' preset and 5 repeats (CPU: the 'tiny' preset)")
  p.add_argument("--shapes", default=None,
                 help=f"comma-separated presets from {sorted(shapes_lib.PRESETS)} "
                      "(default: full on a GPU, cpu on the CPU)")
  p.add_argument("--impls", default=None,
                 help=f"comma-separated implementations (or suffixes) from {impls_lib.NAMES} "
                      "(default: all on a GPU; the CPU paths on the CPU)")
  p.add_argument("--passes", default="fwd,fwd_bwd", help="fwd and/or fwd_bwd")
  p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
  p.add_argument("--out", default=None, help="results file (default: results/<device>.jsonl)")
  p.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
  p.add_argument("--resume", action="store_true",
                 help="append to --out, measuring only what it does not hold yet (rows recorded "
                      "as skipped are measured again): finishes a run cut short by --time-budget")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--repeats", type=int, default=None, help="default 7 (5 with --quick, 3 on CPU)")
  p.add_argument("--max-calls", type=int, default=None,
                 help="most calls enqueued per repeat (default 20 on a GPU, 5 on the CPU)")
  p.add_argument("--target-repeat-ms", type=float, default=None,
                 help="aim for repeats this long (default 25, 20 with --quick)")
  p.add_argument("--compile-workers", type=int, default=1,
                 help="threads compiling a shape's calls before they are timed; more is faster "
                      "on a many-core host, but XLA's GPU autotuner then times its candidates "
                      "concurrently and may pick worse kernels for the xla path")
  p.add_argument("--time-budget", type=float, default=None,
                 help="seconds; once spent, the remaining measurements are recorded as skipped "
                      "(default 420 on a GPU, so one command ends within 8 minutes; 0: no limit)")
  p.add_argument("--check-max-scores", type=float, default=None,
                 help="check against the f32 reference where batch*heads*seq_q*seq_kv <= this "
                      "(default 2^29 on a GPU: N <= 2048 at head_dim 128, and decode; 2^30 on the "
                      "CPU: everything)")
  p.add_argument("--all-pairs", action="store_true",
                 help="measure every implementation at every shape (by default the portable "
                      "paths run on a subset on the GPU, the interpreter on the smallest shapes)")
  p.add_argument("--ceiling-size", type=int, default=None,
                 help="n of the n^3 matmul ceiling (default 8192 on a GPU, 512 on the CPU; 0: none)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max-seq-search", action=argparse.BooleanOptionalAction, default=None,
                 help="also find each implementation's longest sequence before out of memory "
                      "(batch 1, hidden 2048, head_dim 128, causal, doubling the sequence; "
                      "default: on for the CPU, where it only compiles; off on a GPU)")
  p.add_argument("--max-seq-start", type=int, default=None,
                 help="first sequence of the search (default 16384 on a GPU, 1024 on the CPU)")
  p.add_argument("--max-seq-cap", type=int, default=None,
                 help="last sequence of the search (default 262144 on a GPU, 65536 on the CPU)")
  p.add_argument("--memory-limit-gib", type=float, default=None,
                 help="in the search, a call whose compiled peak exceeds this counts as out of "
                      "memory without running (default: the allocator's limit on a GPU, 1 GiB on "
                      "the CPU, where the search only compiles)")
  p.add_argument("--list", action="store_true",
                 help="print what would be measured (shapes, implementations, counts) and exit")
  p.add_argument("--quiet", action="store_true", help="no progress bar, no tables")
  p.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
  p.add_argument("--in-process-search", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


class Progress:
  """tqdm when it is installed, else one printed line per step (on stderr)."""

  def __init__(self, total: int | None, quiet: bool):
    self.total, self.quiet, self.count = total, quiet, 0
    self.bar = None
    if not quiet:
      try:
        import tqdm  # pylint: disable=import-outside-toplevel
        self.bar = tqdm.tqdm(total=total, unit="call", dynamic_ncols=True, file=sys.stderr)
      except ImportError:
        pass

  def step(self, text: str):
    """Before each measurement: the previous one is done."""
    if self.quiet:
      return
    if self.count and self.bar is not None:
      self.bar.update(1)
    self.count += 1
    if self.bar is not None:
      self.bar.set_description_str(text[:60])
    else:
      print(f"[{self.count}/{self.total or '?'}] {text}", file=sys.stderr, flush=True)

  def note(self, text: str):
    if self.bar is not None:
      self.bar.set_description_str(text[:60])

  def close(self):
    if self.bar is not None:
      self.bar.update(1 if self.count else 0)
      self.bar.close()


class Writer:
  """Appends each row to the results file as soon as it exists (a run cut short keeps its rows)."""

  def __init__(self, path: pathlib.Path, append: bool):
    path.parent.mkdir(parents=True, exist_ok=True)
    self.path, self.rows = path, []
    self.file = open(path, "a" if append else "w")  # pylint: disable=consider-using-with

  def __call__(self, row: dict):
    self.rows.append(row)
    self.file.write(json.dumps(row) + "\n")
    self.file.flush()

  def close(self):
    self.file.close()


def _search_in_subprocesses(args, impl_list, passes, out: Writer, ctx: dict,
                            budget_s: float | None, started: float):
  """On a GPU each (implementation, pass) is searched in a fresh process: the allocator's peak
  cannot be reset, and a fresh process lets every step of the ladder raise it (see memory.py)."""
  for impl in impl_list:
    if impl.attend is None:  # nothing to run: record why, without starting a process
      cfg = sweep.SweepConfig(dtype=args.dtype, passes=passes)
      sweep.max_seq_rows(impl, [args.max_seq_start or 16384], cfg, execute=False,
                         memory_limit=None, emit=out, ctx=ctx)
      continue
    for pass_ in passes:
      with tempfile.TemporaryDirectory() as tmp:
        part = pathlib.Path(tmp) / "part.jsonl"
        left = max(1.0, budget_s - (time.perf_counter() - started)) if budget_s else 0
        cmd = [sys.executable, "-m", "benchmarks.run", "--shapes", "none", "--max-seq-search",
               "--in-process-search", "--impls", impl.name, "--passes", pass_, "--dtype",
               args.dtype, "--out", str(part), "--ceiling-size", "0", "--run-id", ctx["run_id"],
               "--time-budget", str(left)]
        for flag in ("max_seq_start", "max_seq_cap", "memory_limit_gib"):
          if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        if args.quiet:
          cmd.append("--quiet")
        else:
          print(f"out-of-memory search: {impl.name} {pass_} (own process)", file=sys.stderr,
                flush=True)
        done = subprocess.run(cmd, cwd=pathlib.Path(__file__).parent.parent, check=False,
                              stdout=subprocess.DEVNULL)
        rows = report.load(part)
        if done.returncode and not rows:
          print(f"  the search for {impl.name} {pass_} failed (exit {done.returncode})",
                file=sys.stderr)
        for row in rows:
          out(row)


def print_plan(plan, cfg: sweep.SweepConfig, out_path: pathlib.Path):
  """--list: the measurements a run would make, shape by shape."""
  for shape, tasks in plan:
    names = sorted({report.SHORT.get(impl.name, impl.name) for impl, _ in tasks})
    checked = "checked" if shape.score_elements <= cfg.check_max_scores else "unchecked"
    print(f"{shape.family:10s} {shape.name:30s} {len(tasks):3d} calls, {checked}: "
          f"{' '.join(names)}")
  print(f"{sum(len(t) for _, t in plan)} measurements at {len(plan)} shapes, passes "
        f"{'/'.join(cfg.passes)}, dtype {cfg.dtype} -> {out_path}")


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  started = time.perf_counter()
  plat = sweep.platform()
  on_gpu = plat != "cpu"
  ctx = sweep.run_context()
  if args.run_id:
    ctx["run_id"] = args.run_id

  if args.shapes:
    preset = args.shapes
  elif on_gpu:
    preset = "quick" if args.quick else "full"
  else:
    preset = "tiny" if args.quick else "cpu"
  shapes = shapes_lib.preset(preset)
  names = ([impls_lib.resolve(n) for n in args.impls.split(",")] if args.impls
           else list(impls_lib.DEFAULT_NAMES["gpu" if on_gpu else "cpu"]))
  impl_list = [impls_lib.get(n, plat) for n in names]
  passes = tuple(p for p in args.passes.split(",") if p)
  for p in passes:
    if p not in timing.PASSES:
      raise SystemExit(f"--passes: unknown pass {p!r}; choose from {timing.PASSES}")
  timing_cfg = timing.TimingConfig(
      warmup=args.warmup,
      repeats=args.repeats or (7 if on_gpu and not args.quick else 5 if on_gpu else 3),
      max_calls=args.max_calls or (20 if on_gpu else 5),
      target_repeat_s=(args.target_repeat_ms or (20 if args.quick else 25)) / 1e3)
  budget = args.time_budget if args.time_budget is not None else (420 if on_gpu else 0)
  cfg = sweep.SweepConfig(
      dtype=args.dtype, passes=passes, timing=timing_cfg,
      check_max_scores=int(args.check_max_scores or (2 ** 29 if on_gpu else 2 ** 30)),
      compile_workers=args.compile_workers or 1, seed=args.seed,
      time_budget_s=budget or None, all_pairs=args.all_pairs)

  out_path = pathlib.Path(args.out) if args.out else default_out(ctx["device"], plat)
  done = report.done_keys(report.load(out_path)) if args.resume else frozenset()
  if args.list:
    print_plan(sweep.plan(shapes, impl_list, cfg, plat, done), cfg, out_path)
    return []
  out = Writer(out_path, args.append or args.resume)
  try:
    ceiling_n = args.ceiling_size if args.ceiling_size is not None else (8192 if on_gpu else 512)
    ceiling_tflops = None
    if ceiling_n and sweep.plan(shapes, impl_list, cfg, plat, done):
      dtype = sweep.DTYPES[args.dtype]
      row = {"kind": "matmul_ceiling", "implementation": "matmul", "dtype": jnp.dtype(dtype).name,
             **timing.matmul_ceiling(ceiling_n, dtype, timing_cfg), **ctx}
      ceiling_tflops = row["tflops"]
      out(row)

    plan = sweep.plan(shapes, impl_list, cfg, plat, done)
    progress = Progress(sum(len(tasks) for _, tasks in plan), args.quiet)
    sweep.run_sweep(shapes, impl_list, cfg, out, progress, ceiling_tflops, ctx, done)
    progress.close()

    search = args.max_seq_search if args.max_seq_search is not None else not on_gpu
    if search:
      start = args.max_seq_start or (16384 if on_gpu else 1024)
      cap = args.max_seq_cap or (262144 if on_gpu else 65536)
      limit = (int(args.memory_limit_gib * 2 ** 30) if args.memory_limit_gib is not None
               else memory.device_memory_limit() if on_gpu else 2 ** 30)
      if on_gpu and not args.in_process_search:
        _search_in_subprocesses(args, [i for i in impl_list if not i.interpret], passes, out, ctx,
                                cfg.time_budget_s, started)
      else:
        progress = Progress(None, args.quiet)
        for impl in impl_list:
          if impl.interpret:
            continue  # the interpreter at 16k tokens would take hours
          sweep.max_seq_rows(impl, memory.search_seqs(start, cap), cfg, execute=on_gpu,
                             memory_limit=limit, emit=out, progress=progress, ctx=ctx)
        progress.close()
  finally:
    out.close()

  if not args.quiet:
    print(report.summary(report.load(out_path), memory=not on_gpu))
    print(f"\n{len(out.rows)} rows -> {out_path}  ({time.perf_counter() - started:.0f} s)")
  return out.rows


if __name__ == "__main__":
  main()
