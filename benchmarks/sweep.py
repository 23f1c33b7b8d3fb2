"""The measurement loop: shapes x implementations x passes -> result rows.

For each shape: compile every (implementation, pass) it is measured with (in parallel threads when
asked; compiling needs no data), draw fresh random inputs, compute the float32 reference once, then
time the calls one after another, each checked against the reference. Nothing compiles while a
call is timed: compiling in background threads (tried on the H200, session 3) starved the timing
thread of the GIL, so the device idled between enqueued calls and rates came out 10-100x low.
Compiling ahead in other processes (`precompile.py`) is safe: they share no GIL, the compiles that
autotune on the device are done before the first call is timed, the rest (host cores only, niced
workers) go on while it is timed, and the executables are handed over serialized.
Anything that fails (an unsupported shape, a missing package, out of memory) becomes a row whose
`error` says why, and the sweep goes on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import time
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import compile_cache
from benchmarks import impls as impls_lib
from benchmarks import masking
from benchmarks import memory
from benchmarks import precompile
from benchmarks import report
from benchmarks import shapes as shapes_lib
from benchmarks import timing
from benchmarks.timing import TimingConfig
from benchmarks.shapes import Shape

DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "f16": jnp.float16,
          "float16": jnp.float16, "f32": jnp.float32, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  dtype: str = "bf16"
  passes: tuple[str, ...] = timing.PASSES
  timing: TimingConfig = TimingConfig()
  # The interpreter is slow: one warm-up call and one timed call.
  interpret_timing: TimingConfig = TimingConfig(warmup=1, repeats=1, max_calls=1)
  # Check against the float32 reference where the full score matrix has at most this many entries
  # (the reference materializes it, with its gradient, in float32).
  check_max_scores: int = 2 ** 30
  compile_workers: int = 1  # threads building one shape's calls, all joined before it is timed
  seed: int = 0
  time_budget_s: float | None = None  # past it, remaining measurements are recorded as skipped
  all_pairs: bool = False  # measure every implementation at every shape (see impls.wanted)
  # The compile pre-pass's executables (precompile.py), loaded instead of built; None: build all.
  executables_dir: str | None = None
  # The pipelined pre-pass (precompile.Pipeline): `fetch(label, build, is_build)` waits for a
  # worker's executable, or builds the call here when no worker has taken it. None: see above.
  handover: Any = None

  @property
  def jnp_dtype(self):
    return DTYPES[self.dtype]


class NullProgress:
  """What the loops report to: `step(text)` before each measurement, `note(text)` for work between
  measurements (compiling a shape's calls)."""

  def step(self, text: str):
    pass

  def note(self, text: str):
    pass


def run_context() -> dict:
  """Columns shared by every row of one run."""
  device = jax.devices()[0]
  now = datetime.datetime.now(datetime.timezone.utc)
  return {"device": device.device_kind, "platform": device.platform,
          "device_memory_bytes": memory.device_memory_limit(device),
          "jax_version": jax.__version__, "date": now.date().isoformat(),
          "run_id": now.strftime("%Y%m%dT%H%M%SZ")}


def platform() -> str:
  return "cpu" if jax.devices()[0].platform == "cpu" else "gpu"


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def attention_row(ctx: dict, impl: impls_lib.Impl, shape: Shape, pass_: str, dtype) -> dict:
  """A row with every column present; measurements fill in the None ones."""
  return {"kind": "attention", "implementation": impl.name, **shape.fields(),
          "dtype": _dtype_name(dtype), "pass": pass_, "ms": None, "tflops": None,
          "gb_per_s": None, "pct_of_matmul": None,
          "flops": timing.attention_flops(shape, pass_), "peak_bytes": None, "temp_bytes": None,
          "alloc_peak_bytes": None, "max_rel_err": None, "error": None, "error_kind": None,
          "compile_s": None, "lower_s": None, "cache_hit": None, "handed_over": None,
          "measure_s": None,
          "calls_per_repeat": None, "repeats": None, "repeat_ms": None,
          "interpret": impl.interpret, "impl_version": impl.version,
          **masking.masking_fields(impl.name, shape), **ctx}


def _fail(row: dict, error: BaseException) -> dict:
  row["error_kind"], row["error"] = memory.describe_error(error)
  return row


@dataclasses.dataclass(frozen=True)
class Build:
  """A compiled call and what building it cost in this process."""
  executable: Any
  compile_s: float  # tracing, lowering and XLA's compile (or the persistent cache's load)
  lower_s: float  # tracing and lowering alone: Python work that no compilation cache saves
  cache_hit: bool | None  # loaded from the persistent cache; None when none is enabled
  handed_over: bool = False  # a pre-pass worker's executable, loaded instead of built


def build_call(impl: impls_lib.Impl, shape: Shape, pass_: str, dtype) -> Build:
  """Compiles one implementation's timed function; raises what compiling raises."""
  if impl.attend is None:
    raise ImportError(impl.unavailable)
  fn = impls_lib.timed_fn(impl.attend, shape, pass_)
  hits = compile_cache.hits()
  start = time.perf_counter()
  lowered = jax.jit(fn).lower(*impls_lib.arg_specs(shape, pass_, dtype))
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  end = time.perf_counter()
  hit = compile_cache.hits() > hits if compile_cache.active() else None
  return Build(compiled, end - start, lowered_at - start, hit)


def compile_call(impl: impls_lib.Impl, shape: Shape, pass_: str, dtype):
  """(compiled, seconds) for one implementation's timed function; raises what compiling raises."""
  build = build_call(impl, shape, pass_, dtype)
  return build.executable, build.compile_s


def _attempt(thunk):
  try:
    return thunk(), None
  except Exception as e:  # pylint: disable=broad-except
    return None, e


def compile_all(jobs: dict, workers: int) -> dict:
  """{key: thunk} -> {key: (result, None) or (None, exception)}, in `workers` threads. A job that
  fails in a thread is retried on the main thread, so threading can never be the cause."""
  if workers <= 1 or len(jobs) <= 1:
    return {key: _attempt(thunk) for key, thunk in jobs.items()}
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {key: pool.submit(_attempt, thunk) for key, thunk in jobs.items()}
    results = {key: f.result() for key, f in futures.items()}
  return {key: (_attempt(jobs[key]) if err is not None else (res, err))
          for key, (res, err) in results.items()}


@jax.jit
def _rel_err(out, ref):
  out = out.astype(jnp.float32)
  err = jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
  return jnp.where(jnp.all(jnp.isfinite(out)), err, jnp.nan)


def max_rel_err(outs, refs) -> float | None:
  """max |out - ref| / max |ref| (each output against its own reference's largest entry; the
  worst over the outputs), in float32 on the device; None when an output holds a NaN or inf."""
  errs = [float(_rel_err(o, r)) for o, r in zip(jax.tree.leaves(outs), jax.tree.leaves(refs))]
  return None if any(np.isnan(e) for e in errs) else max(errs)


def _fill_timing(row: dict, t: timing.Timing, shape: Shape, pass_: str, itemsize: int,
                 ceiling_tflops: float | None):
  row["ms"] = t.ms
  row["tflops"] = row["flops"] / t.ms / 1e9
  row["gb_per_s"] = timing.attention_min_bytes(shape, pass_, itemsize) / t.ms / 1e6
  row["calls_per_repeat"], row["repeats"] = t.calls, len(t.repeat_ms)
  row["repeat_ms"] = list(t.repeat_ms)  # (their spread tells a disturbed measurement)
  if ceiling_tflops:
    row["pct_of_matmul"] = 100.0 * row["tflops"] / ceiling_tflops


def _args_bytes(args) -> int:
  return sum(a.size * a.dtype.itemsize for a in args)


def measure(compiled, args, row: dict, shape: Shape, pass_: str, cfg: timing.TimingConfig,
            refs=None, ceiling_tflops: float | None = None) -> dict:
  """Times one compiled call into `row` (plus its allocator peak and its error vs `refs`)."""
  peak = memory.AllocatorPeak().start()
  try:
    t, first = timing.time_compiled(compiled, args, cfg)
  except Exception as e:  # pylint: disable=broad-except
    return _fail(row, e)
  extra = peak.stop()
  if extra is not None:
    row["alloc_peak_bytes"] = extra + _args_bytes(args)
  _fill_timing(row, t, shape, pass_, args[0].dtype.itemsize, ceiling_tflops)
  if refs is not None:
    row["max_rel_err"] = max_rel_err(first, refs)
    if row["max_rel_err"] is None:
      row["error_kind"], row["error"] = "wrong", "non-finite values in the output"
  return row


def measurement_key(impl_name: str, shape: Shape, pass_: str, dtype) -> tuple:
  """The identity of a measurement, as `report.measurement_key` reads it from a row."""
  return report.measurement_key({"implementation": impl_name, "pass": pass_,
                                 "dtype": _dtype_name(dtype), **shape.fields()})


def plan(shapes: Iterable[Shape], impls: list[impls_lib.Impl], cfg: SweepConfig, plat: str,
         done: frozenset = frozenset()):
  """[(shape, [(impl, pass), ...]), ...]: what the sweep measures, shape by shape, leaving out the
  measurements in `done` (keys from `measurement_key`, for --resume)."""
  out = []
  for shape in shapes:
    tasks = [(impl, p) for impl in impls for p in cfg.passes
             if (cfg.all_pairs or impls_lib.wanted(impl, shape, plat))
             and measurement_key(impl.name, shape, p, cfg.jnp_dtype) not in done]
    if tasks:
      out.append((shape, tasks))
  return out


def _shape_jobs(shape: Shape, tasks, cfg: SweepConfig, check: bool) -> dict:
  """{(name, pass): thunk} compiling what one shape is measured with (and its f32 reference);
  with `cfg.executables_dir`, each thunk first tries the pre-pass's executable."""
  dtype = cfg.jnp_dtype
  jobs = {(impl.name, p): (lambda impl=impl, p=p: build_call(impl, shape, p, dtype))
          for impl, p in tasks}
  if check:
    ref_fwd, ref_bwd = impls_lib.reference_fns(shape)
    for p, fn in (("fwd", ref_fwd), ("fwd_bwd", ref_bwd)):
      if p in cfg.passes:
        jobs[("reference_f32", p)] = (
            lambda fn=fn, p=p: jax.jit(fn).lower(*impls_lib.arg_specs(shape, p, dtype)).compile(
                compiler_options=REFERENCE_COMPILER_OPTIONS))
  if cfg.handover is not None:
    jobs = {key: functools.partial(cfg.handover.fetch, job_label(*key, shape), thunk,
                                   is_build=key[0] != "reference_f32")
            for key, thunk in jobs.items()}
  elif cfg.executables_dir is not None:
    jobs = {key: functools.partial(_handed_over_or, thunk, precompile.executable_file(
        cfg.executables_dir, job_label(*key, shape)), is_build=key[0] != "reference_f32")
            for key, thunk in jobs.items()}
  return jobs


def job_label(name: str, pass_: str, shape: Shape) -> str:
  """A compile's name, the same in the pre-pass's workers and the timing process."""
  return f"{name} {pass_} {shape.name}"


def _handed_over_or(build, path, *, is_build: bool):
  """The pre-pass's executable at `path` if there is one that loads, else `build()`."""
  if path.exists():
    start = time.perf_counter()
    try:
      executable = precompile.load_executable(path)
    except Exception:  # pylint: disable=broad-except  (built here instead)
      executable = None
    if executable is not None:
      return (Build(executable, time.perf_counter() - start, 0.0, None, handed_over=True)
              if is_build else executable)
  return build()


# XLA options of the float32 reference's compiles. It only checks results, so its matmuls need no
# autotuning, which runs candidate kernels on the GPU (79 s a compile when 15 pre-pass processes
# autotuned on one H200 at once, benchmarks/NOTES.md session 6); without it the compile uses the
# host alone and is built beside the kernels while the sweep is timed.
REFERENCE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}
# Compiles that run candidate kernels on the device (XLA's GPU autotuner: the dense and blocked
# XLA paths, timed as they are shipped). In the pipelined pre-pass they are all built before the
# first call is timed; the rest (Mosaic GPU and Triton kernels, cuDNN's custom call, the float32
# reference) only use the host's cores and are built while the sweep is timed.
DEVICE_COMPILES = frozenset({"jax_xla", "pallas_attn:blocked_jax", "pallas_attn:reference"})
# Rough seconds per compile on the H200 at a 16k-token shape (session 3-5 rows), for ordering
# only: the device compiles go longest first (`precompile.order_jobs`), the others in plan order.
_COST_S = {"jax_xla": (3.0, 6.0), "pallas_attn:blocked_jax": (6.0, 9.0),
           "pallas_attn:reference": (4.0, 11.0)}
_DENSE = frozenset({"jax_xla", "pallas_attn:reference"})


class Job(NamedTuple):
  """One compile of the sweep, as the pre-pass's workers see it."""
  label: str
  thunk: Callable
  device: bool = False  # its compile runs kernels on the device (DEVICE_COMPILES)
  cost_s: float = 1.0  # a guess at its compile time, for longest-first ordering
  mem_bytes: int = 0  # a guess at the device memory its autotuning takes
  shape_index: int = 0  # its shape's place in the plan


def job_estimate(name: str, pass_: str, shape: Shape) -> tuple[float, int]:
  """(seconds, device bytes) guessed for compiling `name`'s `pass_` at `shape`: the seconds grow
  with the score matrix (XLA's autotuning times bigger candidates); a dense path's autotuning holds
  the float32 score matrix (twice for the backward)."""
  fwd_s, bwd_s = _COST_S.get(name, (2.0, 4.0))
  size = shape.score_elements / 2 ** 31
  cost = (fwd_s if pass_ == "fwd" else bwd_s) * (0.5 + min(size, 4.0))
  mem = 0
  if name in _DENSE:
    mem = shape.score_elements * 4 * (1 if pass_ == "fwd" else 2)
  elif name in DEVICE_COMPILES:
    mem = 2 ** 30
  return cost, mem


def _checked(shape: Shape, cfg: SweepConfig) -> bool:
  """Whether the shape's results are compared with the float32 reference."""
  return shape.score_elements <= cfg.check_max_scores


def compile_jobs(planned, cfg: SweepConfig) -> list[Job]:
  """Every compile the sweep of `planned` (from `plan`) will make, in the order it makes them
  (what the compile pre-pass builds ahead of it), with what the pre-pass orders them by."""
  return [Job(job_label(name, p, shape), thunk, name in DEVICE_COMPILES,
              *job_estimate(name, p, shape), index)
          for index, (shape, tasks) in enumerate(planned)
          for (name, p), thunk in _shape_jobs(shape, tasks, cfg, _checked(shape, cfg)).items()]


def run_sweep(shapes: Iterable[Shape], impls: list[impls_lib.Impl], cfg: SweepConfig,
              emit: Callable[[dict], None], progress=NullProgress(),
              ceiling_tflops: float | None = None, ctx: dict | None = None,
              done: frozenset = frozenset()):
  """Measures the plan, calling `emit(row)` for each row as soon as it is known.

  Each shape's calls are compiled (in `cfg.compile_workers` threads), then timed one after
  another; rows come out in plan order."""
  ctx = ctx or run_context()
  plat = platform()
  start = time.perf_counter()
  planned = plan(shapes, impls, cfg, plat, done)
  checked = [_checked(shape, cfg) for shape, _ in planned]
  over_budget = lambda: (cfg.time_budget_s is not None
                         and time.perf_counter() - start > cfg.time_budget_s)
  for index, (shape, tasks) in enumerate(planned):
    skipping = over_budget()
    compiled = {}
    if not skipping:
      jobs = _shape_jobs(shape, tasks, cfg, checked[index])
      progress.note(f"compiling {len(jobs)} calls at {shape.name}")
      compiled = compile_all(jobs, cfg.compile_workers)
    _time_shape(shape, tasks, index, cfg, compiled, None if skipping else checked[index],
                emit, progress, ceiling_tflops, ctx, over_budget)
    del compiled


def _reference_outputs(compiled: dict, inputs, passes) -> dict:
  """{pass: float32 reference outputs} for the passes whose reference compiled and ran."""
  refs = {}
  for p in passes:
    ref_compiled, err = compiled[("reference_f32", p)]
    if err is None:
      try:
        refs[p] = jax.block_until_ready(ref_compiled(*inputs[:3 if p == "fwd" else 4]))
      except Exception:  # pylint: disable=broad-except  (unchecked rather than failed)
        pass
  return refs


def _time_shape(shape: Shape, tasks, index: int, cfg: SweepConfig, compiled: dict,
                check: bool | None, emit, progress, ceiling_tflops, ctx: dict, over_budget):
  """Times one shape's compiled calls one after another; `check` None: the shape is skipped."""
  dtype = cfg.jnp_dtype
  skipping = check is None
  inputs = None if skipping else impls_lib.random_inputs(shape, dtype, cfg.seed + index)
  refs = _reference_outputs(compiled, inputs, cfg.passes) if check else {}
  for impl, p in tasks:
    progress.step(f"{impl.name} {p} {shape.name}")
    row = attention_row(ctx, impl, shape, p, dtype)
    if skipping or over_budget():
      row["error_kind"], row["error"] = "skipped", "skipped: --time-budget exhausted"
      emit(row)
      continue
    result, err = compiled[(impl.name, p)]
    if err is not None:
      emit(_fail(row, err))
      continue
    executable = result.executable
    row["compile_s"], row["lower_s"], row["cache_hit"], row["handed_over"] = (
        result.compile_s, result.lower_s, result.cache_hit, result.handed_over)
    row.update(memory.compiled_memory(executable))
    cfg_t = cfg.interpret_timing if impl.interpret else cfg.timing
    args = inputs[:3] if p == "fwd" else inputs
    start = time.perf_counter()
    measure(executable, args, row, shape, p, cfg_t, refs.get(p), ceiling_tflops)
    row["measure_s"] = time.perf_counter() - start
    emit(row)
    del executable, result


def max_seq_rows(impl: impls_lib.Impl, seqs: list[int], cfg: SweepConfig, execute: bool,
                 memory_limit: int | None, emit: Callable[[dict], None],
                 progress=NullProgress(), ctx: dict | None = None,
                 head_dim: int = 128):
  """The out-of-memory search for one implementation (see memory.max_seq_search)."""
  ctx = ctx or run_context()
  dtype = cfg.jnp_dtype
  start = time.perf_counter()
  for p in cfg.passes:
    def step(seq, p=p):
      shape = shapes_lib.max_seq_shape(seq, head_dim)
      progress.step(f"{impl.name} {p} {shape.name} (max-seq search)")
      row = attention_row(ctx, impl, shape, p, dtype)
      row["kind"], row["executed"], row["memory_limit_bytes"] = "max_seq", False, memory_limit
      if cfg.time_budget_s is not None and time.perf_counter() - start > cfg.time_budget_s:
        row["error_kind"], row["error"] = "skipped", "skipped: --time-budget exhausted"
        return row
      try:
        executable, row["compile_s"] = compile_call(impl, shape, p, dtype)
      except Exception as e:  # pylint: disable=broad-except
        return _fail(row, e)
      row.update(memory.compiled_memory(executable))
      if memory_limit is not None and (row["peak_bytes"] or 0) > memory_limit:
        row["error_kind"] = "oom"
        row["error"] = (f"out of memory: compiled peak {row['peak_bytes'] / 2**30:.1f} GiB exceeds "
                        f"the {memory_limit / 2**30:.1f} GiB limit (not run)")
        return row
      if execute:
        row["executed"] = True
        args = impls_lib.random_inputs(shape, dtype, cfg.seed + seq)
        one_call = timing.TimingConfig(warmup=1, repeats=0)  # its first call, timed alone
        measure(executable, args[:3] if p == "fwd" else args, row, shape, p, one_call)
      return row
    memory.max_seq_search(step, seqs, emit)
