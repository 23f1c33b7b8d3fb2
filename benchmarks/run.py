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

On a GPU the sweep's compiles are first built by worker processes into JAX's persistent
compilation cache (`--compile-processes`, see precompile.py); the timing process then loads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks import compile_cache
from benchmarks import impls as impls_lib
from benchmarks import memory
from benchmarks import precompile
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
  p.add_argument("--compile-processes", type=int, default=None,
                 help="worker processes that compile the sweep and hand their executables to the "
                      "timing process (see --compile-pipeline; default: cores - 1 on a GPU, 0 on "
                      "the CPU)")
  p.add_argument("--compile-pipeline", action=argparse.BooleanOptionalAction, default=True,
                 help="with --compile-processes: the compiles that autotune on the device are "
                      "built first (longest first), the sweep is timed as soon as they are done, "
                      "and the workers build the rest (kernels) while it is timed, shape by shape "
                      "ahead of it; --no-compile-pipeline: every compile is built before anything "
                      "is timed")
  p.add_argument("--device-compile-processes", type=int, default=None,
                 help="with the pipeline: how many of the --compile-processes workers build the "
                      "compiles that autotune on the device at once; the others build kernels "
                      "(host cores only) from the start. Default 3 on a GPU: XLA's autotuning "
                      "runs candidate kernels on the one GPU, so more processes time-slice it and "
                      "each compile gets slower (15 at once: ~6x slower per compile on the H200); "
                      "every worker on the CPU")
  p.add_argument("--compile-cache", default=None,
                 help="the persistent compilation cache's directory, kept after the run (a later "
                      "run with the same shapes then loads every call from it); default: a "
                      "temporary directory when --compile-processes > 0, else no cache")
  p.add_argument("--compile-budget", type=float, default=None,
                 help="seconds after which the pre-pass's workers take no more compiles (the "
                      "timing process compiles the rest itself); counts against --time-budget "
                      "(default: half of --time-budget, no limit without one)")
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
  # A pre-pass worker (precompile.py): its shared directory and the time it stops claiming.
  p.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--compile-deadline", type=float, default=0, help=argparse.SUPPRESS)
  p.add_argument("--compile-executables", default=None, help=argparse.SUPPRESS)
  p.add_argument("--compile-phase", default=None, choices=["device", "kernel"],
                 help=argparse.SUPPRESS)
  p.add_argument("--compile-ledger-bytes", type=int, default=0, help=argparse.SUPPRESS)
  return p.parse_args(argv)


class Progress:
  """tqdm when it is installed, else one printed line per step (on stderr)."""

  def __init__(self, total: int | None, quiet: bool):
    self.total, self.quiet, self.count = total, quiet, 0
    self.bar = None
    if not quiet:
      try:
        import tqdm  # pylint: disable=import-outside-toplevel
        # No monitor thread: nothing but the timing thread may want the GIL while calls are timed.
        tqdm.tqdm.monitor_interval = 0
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


def search_share(left_s: float, searches_left: int) -> float:
  """The time budget of the next out-of-memory search (one implementation and pass): an equal
  share of what is left, so that one slow ladder (the blocked path runs its O(N^2) work at every
  step) cannot starve the others; what a search leaves unused goes to the ones after it. (The
  first H200 search, first come first served, spent ~400 of 420 s on pallas_attn's two paths and
  never reached tokamax: benchmarks/NOTES.md session 6.)"""
  return max(1.0, left_s / max(1, searches_left))


def _search_in_subprocesses(args, impl_list, passes, out: Writer, ctx: dict,
                            budget_s: float | None, started: float):
  """On a GPU each (implementation, pass) is searched in a fresh process: the allocator's peak
  cannot be reset, and a fresh process lets every step of the ladder raise it (see memory.py)."""
  searches = [(impl, pass_) for impl in impl_list if impl.attend is not None for pass_ in passes]
  for impl in impl_list:
    if impl.attend is None:  # nothing to run: record why, without starting a process
      cfg = sweep.SweepConfig(dtype=args.dtype, passes=passes)
      sweep.max_seq_rows(impl, [args.max_seq_start or 16384], cfg, execute=False,
                         memory_limit=None, emit=out, ctx=ctx)
  for i, (impl, pass_) in enumerate(searches):
    with tempfile.TemporaryDirectory() as tmp:
      part = pathlib.Path(tmp) / "part.jsonl"
      left = (search_share(budget_s - (time.perf_counter() - started), len(searches) - i)
              if budget_s else 0)
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


def configure(args, on_gpu: bool):
  """(shapes, implementations, SweepConfig) for the arguments on this platform. The pre-pass's
  workers call it too, so that they build exactly the calls the sweep will time."""
  plat = "gpu" if on_gpu else "cpu"
  if args.shapes:
    preset = args.shapes
  elif on_gpu:
    preset = "quick" if args.quick else "full"
  else:
    preset = "tiny" if args.quick else "cpu"
  shapes = shapes_lib.preset(preset)
  names = ([impls_lib.resolve(n) for n in args.impls.split(",")] if args.impls
           else list(impls_lib.DEFAULT_NAMES[plat]))
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
  cfg = sweep.SweepConfig(
      dtype=args.dtype, passes=passes, timing=timing_cfg,
      check_max_scores=int(args.check_max_scores or (2 ** 29 if on_gpu else 2 ** 30)),
      compile_workers=args.compile_workers or 1, seed=args.seed,
      time_budget_s=_time_budget(args, on_gpu) or None, all_pairs=args.all_pairs)
  return shapes, impl_list, cfg


def _time_budget(args, on_gpu: bool) -> float:
  """--time-budget, or its platform default (0: no limit)."""
  return args.time_budget if args.time_budget is not None else (420 if on_gpu else 0)


def _out_path(args, plat: str) -> pathlib.Path:
  return pathlib.Path(args.out) if args.out else default_out(jax.devices()[0].device_kind, plat)


def _done(args, out_path: pathlib.Path) -> frozenset:
  """--resume: the measurements the results file already holds."""
  return report.done_keys(report.load(out_path)) if args.resume else frozenset()


def _compile_worker(args):
  """--compile-worker DIR, started by the pre-pass: build the sweep's compiles it claims into
  --compile-cache, then exit. Nothing runs and nothing is timed; the results file is only read."""
  precompile.lower_priority(args.compile_phase)  # before the backend starts its threads
  plat = sweep.platform()
  shapes, impl_list, cfg = configure(args, plat != "cpu")
  planned = sweep.plan(shapes, impl_list, cfg, plat, _done(args, _out_path(args, plat)))
  ledger = None
  if args.compile_phase == "device" and args.compile_ledger_bytes and plat != "cpu":
    ledger = precompile.MemoryLedger(pathlib.Path(args.compile_worker) / "ledger.json",
                                     args.compile_ledger_bytes)
  with compile_cache.enabled(args.compile_cache):
    precompile.work(sweep.compile_jobs(planned, cfg), args.compile_worker,
                    args.compile_deadline or None, args.compile_executables,
                    args.compile_phase, ledger)


def _prepass_processes(args) -> int:
  if args.list or args.shapes == "none":
    return 0
  if args.compile_processes is not None:
    return max(0, args.compile_processes)
  return precompile.default_processes(precompile.gpu_visible())


def _device_processes(args, processes: int, on_gpu: bool) -> int:
  """How many of the pipeline's `processes` workers autotune at once (--device-compile-processes,
  default 3 on a GPU)."""
  return precompile.device_worker_count(args.device_compile_processes, processes, on_gpu)


def main(argv=None) -> list[dict]:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.compile_worker:
    _compile_worker(args)
    return []
  started = time.perf_counter()
  processes = _prepass_processes(args)
  with (precompile.cache_dir(args.compile_cache, processes > 0) as cache,
        precompile.executables_dir(processes > 0) as executables):
    prepass = pipeline = None
    if processes:
      # Before this process starts its backend: on a GPU that takes 75% of the memory, which the
      # workers' autotuning needs while they run.
      on_gpu = precompile.gpu_visible()
      budget = _time_budget(args, on_gpu)
      compile_budget = args.compile_budget if args.compile_budget is not None else budget / 2
      if args.compile_pipeline:
        # The device phase stops at the compile budget (the timing process builds what is left);
        # the kernel-phase workers are of use as long as the sweep is timed: the whole budget.
        pipeline = precompile.Pipeline(argv, processes, cache, compile_budget or None,
                                       args.quiet, executables,
                                       device_processes=_device_processes(args, processes, on_gpu),
                                       kernel_budget_s=budget or None)
        pipeline.start_device_phase()
        try:
          pipeline.wait_device_phase()
        except BaseException:
          pipeline.finish()
          raise
      else:
        prepass = precompile.run_prepass(argv, processes, cache, compile_budget or None,
                                         args.quiet, executables)
        if not args.quiet:
          print(prepass.summary(), file=sys.stderr, flush=True)
    try:
      with compile_cache.enabled(cache):
        return _run(args, started, prepass, executables, pipeline)
    finally:
      if pipeline is not None:  # no worker outlives the run
        pipeline.finish()


def _run(args, started: float, prepass: precompile.Prepass | None,
         executables: str | None = None,
         pipeline: precompile.Pipeline | None = None) -> list[dict]:
  """The sweep, the out-of-memory search and the summary (the pre-pass, if any, is done; a
  pipelined one has done its device phase and builds the rest while the sweep is timed)."""
  plat = sweep.platform()
  on_gpu = plat != "cpu"
  ctx = sweep.run_context()
  if args.run_id:
    ctx["run_id"] = args.run_id
  shapes, impl_list, cfg = configure(args, on_gpu)
  cfg = dataclasses.replace(cfg, executables_dir=executables, handover=pipeline)
  out_path = _out_path(args, plat)
  done = _done(args, out_path)
  if args.list:
    print_plan(sweep.plan(shapes, impl_list, cfg, plat, done), cfg, out_path)
    return []
  out = Writer(out_path, args.append or args.resume)
  try:
    return _sweep_and_search(args, started, prepass, pipeline, cfg, shapes, impl_list, plat, ctx,
                             done, out, out_path)
  finally:
    out.close()
    if pipeline is not None:
      pipeline.finish()


def _sweep_and_search(args, started, prepass, pipeline, cfg, shapes, impl_list, plat, ctx, done,
                      out, out_path) -> list[dict]:
  on_gpu = plat != "cpu"
  budget = cfg.time_budget_s
  try:
    ceiling_n = args.ceiling_size if args.ceiling_size is not None else (8192 if on_gpu else 512)
    ceiling_tflops = None
    if ceiling_n and sweep.plan(shapes, impl_list, cfg, plat, done):
      dtype = sweep.DTYPES[args.dtype]
      row = {"kind": "matmul_ceiling", "implementation": "matmul", "dtype": jnp.dtype(dtype).name,
             **timing.matmul_ceiling(ceiling_n, dtype, cfg.timing), **ctx}
      ceiling_tflops = row["tflops"]
      out(row)

    plan = sweep.plan(shapes, impl_list, cfg, plat, done)
    progress = Progress(sum(len(tasks) for _, tasks in plan), args.quiet)
    if budget:  # the pre-pass and the ceiling count against it
      left = max(0.0, budget - (time.perf_counter() - started))
      cfg = dataclasses.replace(cfg, time_budget_s=left)
    sweep.run_sweep(shapes, impl_list, cfg, out, progress, ceiling_tflops, ctx, done)
    progress.close()
    if pipeline is not None:  # its workers are done or of no more use: free their cores
      prepass = pipeline.finish()

    search = args.max_seq_search if args.max_seq_search is not None else not on_gpu
    if search:
      start = args.max_seq_start or (16384 if on_gpu else 1024)
      cap = args.max_seq_cap or (262144 if on_gpu else 65536)
      limit = (int(args.memory_limit_gib * 2 ** 30) if args.memory_limit_gib is not None
               else memory.device_memory_limit() if on_gpu else 2 ** 30)
      if on_gpu and not args.in_process_search:
        _search_in_subprocesses(args, [i for i in impl_list if not i.interpret], cfg.passes, out,
                                ctx, budget, started)
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
    for line in (prepass.summary() if prepass else None, precompile.main_summary(out.rows)):
      if line:
        print(line)
    print(f"\n{len(out.rows)} rows -> {out_path}  ({time.perf_counter() - started:.0f} s)")
  return out.rows


if __name__ == "__main__":
  main()
