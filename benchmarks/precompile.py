"""The compile pre-pass: worker processes fill JAX's persistent compilation cache before timing.

On the H200 the sweep is compile-bound (XLA autotuning for the dense paths, Python lowering for the
Pallas kernels). Compiling in threads while another thread times (session 3) starved the timing
thread of the GIL. Processes share no GIL: before the sweep, `run_prepass` starts N copies of
`benchmarks.run` with the sweep's own arguments plus `--compile-worker DIR`; each builds the same
plan, claims the sweep's compiles one at a time in plan order (an exclusive file per compile, so
the fastest worker takes the next one), lowers and compiles it with the cache on, never runs it,
and exits. All workers have exited before the timing process times its first call; its compiles
then load from the cache. A compile that failed or never ran in a worker is simply a cache miss:
the timing process compiles it itself, as it would without the pre-pass.

The cache saves XLA's compile but not tracing and lowering, which the timing process would
still do for every call (the cache key is the lowered module; on the H200 only 51-57% of the
timing process's builds hit, and building took ~1.4 s per call). So each worker also hands its
executables over: serialized (`jax.experimental.serialize_executable`) into a directory that
lives for this run only (nothing stale can load), one file per compile, named by its label. The
timing process loads a handed-over executable instead of building the call, and builds it as
before when there is none or loading fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jax
from jax.experimental import serialize_executable

from benchmarks import compile_cache
from benchmarks import memory

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A worker past the deadline finishes the compile it is in (XLA's autotuning of a large dense
# call takes up to ~35 s on the H200), then stops; past this much more it is terminated.
GRACE_S = 45.0
POLL_S = 0.5
REPORT_EVERY_S = 15.0


def default_processes(on_gpu: bool) -> int:
  """Workers for the pre-pass: off on the CPU (two cores: the timing process would wait for the
  same cores), else one per spare core up to 8 (each XLA compile uses a few threads itself)."""
  return min(8, (os.cpu_count() or 1) - 1) if on_gpu else 0


def gpu_visible() -> bool:
  """Whether this host has an NVIDIA GPU, asked without starting a JAX backend: the timing
  process starts its backend (and takes 75% of the GPU's memory) after the pre-pass."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  return any(pathlib.Path("/dev").glob("nvidia[0-9]*"))


def worker_env(processes: int) -> dict:
  """The workers' environment: no up-front allocation and a small share each, so that N of them
  fit beside each other (the GPU memory they use is XLA's autotuning buffers)."""
  env = dict(os.environ)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(0.25, 0.9 / max(processes, 1)):.3f}"
  env["PYTHONUNBUFFERED"] = "1"
  return env


@contextlib.contextmanager
def cache_dir(path: str | None, needed: bool):
  """The cache directory: `path` (kept), a temporary one removed at exit when the pre-pass runs
  without one, or None (no cache)."""
  if path is not None:
    yield str(path)
  elif needed:
    tmp = tempfile.mkdtemp(prefix="pallas_attn_jax_cache_")
    try:
      yield tmp
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  else:
    yield None


@contextlib.contextmanager
def executables_dir(needed: bool):
  """A directory for the workers' executables, removed when the run ends; None when not needed."""
  if not needed:
    yield None
    return
  tmp = tempfile.mkdtemp(prefix="pallas_attn_executables_")
  try:
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def executable_file(directory, label: str) -> pathlib.Path:
  """Where the executable of the compile called `label` is handed over."""
  return pathlib.Path(directory) / (hashlib.sha1(label.encode()).hexdigest() + ".pkl")


def save_executable(path: pathlib.Path, compiled) -> None:
  payload, in_tree, out_tree = serialize_executable.serialize(compiled)
  tmp = path.with_suffix(".tmp")
  with open(tmp, "wb") as f:
    pickle.dump((payload, in_tree, out_tree), f)
  tmp.rename(path)  # whole or absent: the timing process never reads half a file


def load_executable(path: pathlib.Path):
  """The executable saved at `path`, on the first device: the sweep's calls run on one device
  (left to itself, loading spreads it over every local device)."""
  with open(path, "rb") as f:
    payload, in_tree, out_tree = pickle.load(f)
  return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                   execution_devices=jax.devices()[:1])


# ---- the worker side -------------------------------------------------------------------------


def _claim(path: pathlib.Path) -> bool:
  """Takes a compile for this worker: creating the file succeeds in exactly one process."""
  try:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
  except FileExistsError:
    return False
  return True


def work(jobs: list[tuple[str, Callable]], workdir, deadline: float | None,
         executables: str | None = None):
  """One worker's loop over the sweep's compiles ([(label, thunk)], the same list in every
  worker): claim the next unclaimed one, build it, hand its executable over to `executables`
  (when given), log it; stop at `deadline` (time.time())."""
  workdir = pathlib.Path(workdir)
  claims = workdir / "claims"
  claims.mkdir(parents=True, exist_ok=True)
  with open(workdir / f"report-{os.getpid()}.jsonl", "a", encoding="utf-8") as log:
    for index, (label, thunk) in enumerate(jobs):
      if deadline and time.time() > deadline:
        break
      if not _claim(claims / str(index)):
        continue
      start = time.perf_counter()
      handed_over = False
      try:
        built = thunk()
        error = None
        if executables is not None:
          try:  # a sweep.Build, or a bare executable (the float32 reference)
            save_executable(executable_file(executables, label),
                            getattr(built, "executable", built))
            handed_over = True
          except Exception:  # pylint: disable=broad-except  (the cache entry still serves)
            pass
      except Exception as e:  # pylint: disable=broad-except  (the timing process retries it)
        error = " ".join(memory.describe_error(e))[:300]
      log.write(json.dumps({"job": label, "s": time.perf_counter() - start,
                            "error": error, "handed_over": handed_over}) + "\n")
      log.flush()


# ---- the main-process side -------------------------------------------------------------------


@dataclasses.dataclass
class Prepass:
  """What a pre-pass did, for the run's summary."""
  processes: int
  seconds: float
  compiled: int  # compiles that succeeded in a worker
  failed: int  # compiles that raised in a worker (the timing process tries them again)
  compile_s: float  # their seconds summed: what one process would have spent
  handed_over: int  # executables serialized for the timing process
  entries_before: int
  entries_after: int
  worker_failures: list[str]

  def summary(self) -> str:
    text = (f"compile pre-pass: {self.processes} processes built {self.compiled} calls in "
            f"{self.seconds:.0f} s ({self.compile_s:.0f} s of compiling in all"
            f"{f'; {self.failed} failed, left to the timing process' if self.failed else ''}); "
            f"cache entries {self.entries_before} -> {self.entries_after}; "
            f"{self.handed_over} executables handed over")
    return "\n".join([text] + [f"  {line}" for line in self.worker_failures])


def _worker_cmd(argv: list[str], workdir: pathlib.Path, cache: str, deadline: float | None,
                executables: str | None) -> list[str]:
  return [sys.executable, "-m", "benchmarks.run", *argv, "--compile-worker", str(workdir),
          "--compile-cache", cache, "--compile-deadline", str(deadline or 0), "--quiet",
          *(["--compile-executables", executables] if executables else [])]


def _reports(workdir: pathlib.Path) -> list[dict]:
  rows = []
  for path in sorted(workdir.glob("report-*.jsonl")):
    rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return rows


def _wait(procs, workdir: pathlib.Path, deadline: float | None, quiet: bool):
  """Waits for the workers, reporting progress; terminates those still running GRACE_S past the
  deadline (a worker stops claiming compiles at the deadline by itself)."""
  next_report = time.time() + REPORT_EVERY_S
  while any(p.poll() is None for p in procs):
    now = time.time()
    if deadline and now > deadline + GRACE_S:
      for p in procs:
        if p.poll() is None:
          p.terminate()
      for p in procs:
        try:
          p.wait(timeout=10)
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
      break
    if not quiet and now > next_report:
      print(f"compile pre-pass: {len(_reports(workdir))} calls built", file=sys.stderr,
            flush=True)
      next_report = now + REPORT_EVERY_S
    time.sleep(POLL_S)


def _tail(path: pathlib.Path, lines: int = 3) -> str:
  text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
  return " | ".join(text[-lines:])


def run_prepass(argv: list[str], processes: int, cache: str, budget_s: float | None,
                quiet: bool, executables: str | None = None) -> Prepass:
  """Runs the pre-pass for the sweep that `argv` (benchmarks.run's arguments) describes: starts
  `processes` workers, waits for them (at most `budget_s` plus a grace period), and returns what
  they did. Never raises for a worker's sake: whatever a worker did not build, the timing process
  compiles itself."""
  started = time.perf_counter()
  deadline = time.time() + budget_s if budget_s else None
  before = compile_cache.entries(cache)
  with tempfile.TemporaryDirectory(prefix="pallas_attn_prepass_") as tmp:
    workdir = pathlib.Path(tmp)
    if not quiet:
      print(f"compile pre-pass: {processes} processes -> {cache}", file=sys.stderr, flush=True)
    procs, logs = [], []
    for i in range(processes):
      logs.append(workdir / f"worker-{i}.log")
      with open(logs[-1], "w", encoding="utf-8") as log:
        procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
            _worker_cmd(argv, workdir, cache, deadline, executables), cwd=ROOT,
            env=worker_env(processes),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    _wait(procs, workdir, deadline, quiet)
    reports = _reports(workdir)
    failures = [f"worker {i} exited with {p.returncode}: {_tail(log)}"
                for i, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
  ok = [r for r in reports if r["error"] is None]
  return Prepass(processes=processes, seconds=time.perf_counter() - started, compiled=len(ok),
                 failed=len(reports) - len(ok), compile_s=sum(r["s"] for r in reports),
                 handed_over=sum(bool(r.get("handed_over")) for r in reports),
                 entries_before=before, entries_after=compile_cache.entries(cache),
                 worker_failures=failures)


def main_summary(rows: list[dict]) -> str | None:
  """How the timing process's builds went: seconds spent, the part spent lowering (which no cache
  saves), how many were workers' executables loaded as they were, and how many of the others
  loaded from the persistent cache."""
  built = [r for r in rows if r.get("kind") == "attention" and r.get("compile_s") is not None]
  if not built:
    return None
  handed = [r for r in built if r.get("handed_over")]
  others = [r for r in built if not r.get("handed_over")]
  hits = [r for r in others if r.get("cache_hit")]
  lower = sum(r.get("lower_s") or 0.0 for r in built)
  text = (f"timing process: {len(built)} calls built in {sum(r['compile_s'] for r in built):.0f} s "
          f"({lower:.0f} s tracing and lowering)")
  if handed:
    text += f"; {len(handed)} handed over by the workers"
  if any(r.get("cache_hit") is not None for r in others):
    text += f"; {len(hits)} of the other {len(others)} from the cache"
  return text
