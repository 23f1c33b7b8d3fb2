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

import collections
import contextlib
import dataclasses
import fcntl
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
from typing import Callable, Sequence

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


# Niceness of the workers that compile while the sweep is timed: the timing process's host
# enqueue comes first whenever both want a core.
KERNEL_WORKER_NICE = 10
# How long the timing process waits for one compile a worker has taken before building it itself.
FETCH_WAIT_S = 120.0


# Device-phase workers at once on a GPU (`--device-compile-processes`). XLA's autotuning runs its
# candidate kernels on the one GPU; workers autotuning at once share it by time-slicing their CUDA
# contexts, so more of them do not finish the phase sooner: on the H200, 15 at once took 316 s for
# 117 compiles (29 s of compiling each) where 8 at once had taken ~4.5 s each (NOTES.md, sessions
# 5-6). The other workers build the kernel compiles (host cores only) meanwhile.
DEVICE_PROCESSES_GPU = 3


def default_processes(on_gpu: bool) -> int:
  """Workers for the pre-pass: off on the CPU (two cores: the timing process would wait for the
  same cores), else one per core but the timing process's. Host memory is not the limit: a worker
  holds ~2-3 GiB (JAX, tokamax, a CUDA context), 15 of them ~40 GiB of the H200 host's 128."""
  return max(1, (os.cpu_count() or 1) - 1) if on_gpu else 0


def default_device_processes(on_gpu: bool, processes: int) -> int:
  """Of `processes` workers, how many autotune at once in the pipeline's device phase: at most
  DEVICE_PROCESSES_GPU on a GPU; every worker on the CPU (there is no device to share)."""
  return min(processes, DEVICE_PROCESSES_GPU) if on_gpu else processes


def device_worker_count(requested: int | None, processes: int, on_gpu: bool) -> int:
  """The device-phase workers for a request (`--device-compile-processes`; None: the default),
  between 0 and `processes`."""
  if requested is None:
    return default_device_processes(on_gpu, processes)
  return max(0, min(requested, processes))


def gpu_visible() -> bool:
  """Whether this host has an NVIDIA GPU, asked without starting a JAX backend: the timing
  process starts its backend (and takes 75% of the GPU's memory) after the pre-pass."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  return any(pathlib.Path("/dev").glob("nvidia[0-9]*"))


def worker_env(processes: int, phase: str | None = None) -> dict:
  """The workers' environment: no up-front allocation. The device phase's workers (XLA autotuning)
  allocate through the platform allocator, which gives the memory back as soon as a candidate is
  timed (a BFC pool keeps its high-water mark until the process exits, and the timing process
  needs 75% of the card while they run on), and share the card through a ledger (`MemoryLedger`)
  instead of a fixed 1/N fraction each (which made the larger dense calls fail in every worker:
  34 in run 20261130T175504Z). `PALLAS_ATTN_PREPASS_ALLOCATOR=bfc` restores the fixed fractions.
  The kernel phase's workers never run anything on the device: a tiny share."""
  env = dict(os.environ)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["PYTHONUNBUFFERED"] = "1"
  if phase == "kernel":
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.02"
  elif phase == "device" and os.environ.get("PALLAS_ATTN_PREPASS_ALLOCATOR", "platform") == \
      "platform":
    env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
  else:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(0.25, 0.9 / max(processes, 1)):.3f}"
  return env


def gpu_memory_bytes() -> int | None:
  """The first GPU's memory, from nvidia-smi (no JAX backend is started); None if unknown."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    return int(float(out.split()[0]) * 2 ** 20)
  except Exception:  # pylint: disable=broad-except
    return None


def ledger_budget(total: int | None, processes: int) -> int:
  """Device bytes the device phase's autotuning may hold at once: 85% of the card less a CUDA
  context (~0.6 GiB) per worker; 64 GiB when the card's size is unknown. `processes` is every
  worker alive during the device phase, not only the device-phase ones: the kernel-phase workers
  start with it (pipelined) and each holds a context on the card too."""
  if not total:
    return 64 * 2 ** 30
  return max(2 ** 30, int(total * 0.85 - processes * 0.6 * 2 ** 30))  # an int: a worker flag


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


def job_key(label: str) -> str:
  """A compile's file name in the pre-pass's directories (claims, done markers)."""
  return hashlib.sha1(label.encode()).hexdigest()


def _claim(path: pathlib.Path) -> bool:
  """Takes a compile for this worker: creating the file succeeds in exactly one process."""
  try:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
  except FileExistsError:
    return False
  return True


def _field(job, name: str, index: int, default):
  return getattr(job, name, job[index] if len(job) > index else default)


def order_jobs(jobs: Sequence, phase: str | None) -> list:
  """The order a worker of `phase` takes the sweep's compiles in.

  "device": only the compiles that run kernels on the device (`sweep.Job.device`), longest first
  (they must all be done before the first call is timed, so the phase ends when its longest chain
  does: longest-processing-time-first). "kernel": only the others, in plan order (the timing process
  takes the shapes in plan order and waits for each shape's). None: everything, device compiles
  first (longest first), then the rest in plan order. Jobs may be (label, thunk) pairs (device
  False, cost 1)."""
  device = [j for j in jobs if _field(j, "device", 2, False)]
  other = [j for j in jobs if not _field(j, "device", 2, False)]
  device = sorted(device, key=lambda j: -_field(j, "cost_s", 3, 1.0))  # stable: plan order on ties
  if phase == "device":
    return device
  if phase == "kernel":
    return other
  return device + other


class MemoryLedger:
  """Device memory the workers' autotuning holds, shared through a file under an exclusive lock
  (fcntl.flock: released by the kernel if a worker dies). A compile starts when its guess fits
  beside what the others hold, or when nothing else is held (one too big for the card then runs
  alone and fails alone, as it would in the timing process)."""

  def __init__(self, path, budget: int):
    self.path, self.budget = pathlib.Path(path), budget
    self.path.touch(exist_ok=True)
    self.key = str(os.getpid())

  def _update(self, change: Callable[[dict], bool]) -> bool:
    with open(self.path, "r+", encoding="utf-8") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      try:
        text = f.read()
        held = json.loads(text) if text.strip() else {}
        ok = change(held)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(held))
        f.flush()
        return ok
      finally:
        fcntl.flock(f, fcntl.LOCK_UN)

  def try_hold(self, nbytes: int) -> bool:
    """Records `nbytes` as this worker's if they fit now; False (nothing recorded) otherwise."""
    def change(held):
      used = sum(v for k, v in held.items() if k != self.key)
      if nbytes and used and used + nbytes > self.budget:
        return False
      held[self.key] = nbytes
      return True
    return self._update(change)

  def release(self):
    self._update(lambda held: held.pop(self.key, None) is not None)

  def held(self) -> int:
    text = self.path.read_text()
    return sum(json.loads(text).values()) if text.strip() else 0


def work(jobs: Sequence, workdir, deadline: float | None, executables: str | None = None,
         phase: str | None = None, ledger: MemoryLedger | None = None):
  """One worker's loop over the sweep's compiles (`sweep.Job`s or (label, thunk) pairs, the same
  list in every worker), in `order_jobs(jobs, phase)`: take the first one not taken yet (and, with
  a ledger, whose device memory fits now), build it, hand its executable over to `executables`
  (when given), mark it done, log it; stop at `deadline` (time.time())."""
  workdir = pathlib.Path(workdir)
  claims, done = workdir / "claims", workdir / "done"
  claims.mkdir(parents=True, exist_ok=True)
  done.mkdir(parents=True, exist_ok=True)
  pending = order_jobs(jobs, phase)
  with open(workdir / f"report-{os.getpid()}.jsonl", "a", encoding="utf-8") as log:
    while pending:
      if deadline and time.time() > deadline:
        break
      taken = None
      for job in list(pending):
        label = job[0]
        key = job_key(label)
        if (claims / key).exists():
          pending.remove(job)
          continue
        mem = _field(job, "mem_bytes", 4, 0)
        if ledger is not None and not ledger.try_hold(mem):
          continue  # does not fit beside the others' autotuning now: try a smaller one
        if not _claim(claims / key):
          if ledger is not None:
            ledger.release()
          pending.remove(job)
          continue
        taken = job
        break
      if taken is None:
        if pending:
          time.sleep(POLL_S / 5)
        continue
      pending.remove(taken)
      label, thunk = taken[0], taken[1]
      begin = time.time()
      start = time.perf_counter()
      handed_over, built = False, None
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
      finally:
        if ledger is not None:
          ledger.release()
      (done / job_key(label)).touch()  # after the executable: done and absent means not handed
      log.write(json.dumps({"job": label, "s": time.perf_counter() - start, "start": begin,
                            "phase": phase, "error": error, "handed_over": handed_over}) + "\n")
      log.flush()
      del built


# ---- the main-process side -------------------------------------------------------------------


def _breakdown(reports: list[dict]) -> str:
  """Compile-seconds per implementation (the label's first word), most first."""
  if not reports:
    return ""
  by = collections.defaultdict(lambda: [0, 0.0, 0])
  for r in reports:
    b = by[r["job"].split()[0]]
    b[0] += 1
    b[1] += r["s"]
    b[2] += r["error"] is not None
  parts = [f"{name.replace('pallas_attn:', '')} {n}/{s:.0f}s{f' ({f} failed)' if f else ''}"
           for name, (n, s, f) in sorted(by.items(), key=lambda kv: -kv[1][1])]
  return "calls/compile-seconds: " + ", ".join(parts)


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
  device_phase_s: float | None = None  # pipelined: until the first call could be timed
  waited_s: float = 0.0  # pipelined: the timing process waiting for workers' compiles
  self_built: int = 0  # pipelined: compiles the timing process took itself (none had started)
  breakdown: str = ""
  device_processes: int | None = None  # pipelined: workers in the device phase (autotuning)
  kernel_built: int = 0  # pipelined: compiles the kernel-phase workers built (no error)
  kernel_built_early: int = 0  # pipelined: ... of them finished before the first call was timed
  kernel_failed: int = 0  # pipelined: kernel-phase compiles that raised

  def summary(self) -> str:
    text = (f"compile pre-pass: {self.processes} processes built {self.compiled} calls in "
            f"{self.seconds:.0f} s ({self.compile_s:.0f} s of compiling in all"
            f"{f'; {self.failed} failed, left to the timing process' if self.failed else ''}); "
            f"cache entries {self.entries_before} -> {self.entries_after}; "
            f"{self.handed_over} executables handed over")
    lines = [text]
    if self.device_phase_s is not None:
      kernel_workers = self.processes - (self.device_processes or 0)
      lines.append(f"  pipelined: {self.device_processes} device-phase workers (autotuning; "
                   f"{kernel_workers} kernel-phase workers beside them from the start) done after "
                   f"{self.device_phase_s:.0f} s, before the first call was timed; kernel-phase "
                   f"workers built {self.kernel_built} calls ({self.kernel_built_early} of them "
                   f"before timing started"
                   f"{f', {self.kernel_failed} failed' if self.kernel_failed else ''}); the timing "
                   f"process then waited {self.waited_s:.0f} s for workers' compiles and built "
                   f"{self.self_built} no worker had started")
    if self.breakdown:
      lines.append(f"  {self.breakdown}")
    return "\n".join(lines + [f"  {line}" for line in self.worker_failures])


def _worker_cmd(argv: list[str], workdir: pathlib.Path, cache: str, deadline: float | None,
                executables: str | None, phase: str | None = None,
                ledger_bytes: int | None = None) -> list[str]:
  return [sys.executable, "-m", "benchmarks.run", *argv, "--compile-worker", str(workdir),
          "--compile-cache", cache, "--compile-deadline", str(deadline or 0), "--quiet",
          *(["--compile-executables", executables] if executables else []),
          *(["--compile-phase", phase] if phase else []),
          *(["--compile-ledger-bytes", str(ledger_bytes)] if ledger_bytes else [])]


def _reports(workdir: pathlib.Path) -> list[dict]:
  rows = []
  for path in sorted(workdir.glob("report-*.jsonl")):
    rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return rows


def _stop(procs):
  for p in procs:
    if p.poll() is None:
      p.terminate()
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _wait(procs, workdir: pathlib.Path, deadline: float | None, quiet: bool):
  """Waits for the workers, reporting progress; terminates those still running GRACE_S past the
  deadline (a worker stops claiming compiles at the deadline by itself)."""
  next_report = time.time() + REPORT_EVERY_S
  while any(p.poll() is None for p in procs):
    now = time.time()
    if deadline and now > deadline + GRACE_S:
      _stop(procs)
      break
    if not quiet and now > next_report:
      print(f"compile pre-pass: {len(_reports(workdir))} calls built", file=sys.stderr,
            flush=True)
      next_report = now + REPORT_EVERY_S
    time.sleep(POLL_S)


def _tail(path: pathlib.Path, lines: int = 3) -> str:
  text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
  return " | ".join(text[-lines:])


def lower_priority(phase: str | None):
  """A kernel-phase worker lowers its own priority first thing (the threads it starts later, XLA's
  compile pools among them, inherit it): the timing process's host enqueue comes first."""
  if phase == "kernel":
    try:
      os.nice(KERNEL_WORKER_NICE)
    except OSError:
      pass


def phases_at_start(processes: int, device_processes: int) -> list[str]:
  """The phase of each worker the pipeline starts with: `device_processes` device-phase workers
  (at most `processes`), the others kernel-phase workers from the start."""
  device = max(0, min(device_processes, processes))
  return ["device"] * device + ["kernel"] * (processes - device)


class Pipeline:
  """The pipelined pre-pass: compiles in worker processes while the sweep is timed.

  1. `start_device_phase()` starts `processes` workers. `device_processes` of them (3 on a GPU,
     `--device-compile-processes`) build the compiles that run kernels on the device (XLA's
     autotuning: jax_xla, blocked_jax, the references), longest first, sharing the card's memory
     through a `MemoryLedger`: no more, because one GPU's autotuning does not go faster with more
     processes (they time-slice the card: 15 at once made each compile ~6x slower). The others
     start as kernel-phase workers at once (below). As each device-phase worker runs out of
     compiles and exits, a kernel-phase worker takes its core. `wait_device_phase()` returns when
     the last device-phase worker has exited: only then does the timing process start its backend,
     so no autotuning ever runs on the device while a call is timed.
  2. The kernel-phase workers (niced) build everything else (Mosaic GPU and Triton kernels, cuDNN)
     in plan order, during the device phase and while the timing process times the shapes in plan
     order. For each compile it `fetch`es: the worker's executable when done; when no worker has
     taken it yet, it takes it and builds it itself (it would only wait otherwise); when a worker
     is building it, it waits. A claim file per compile: each is built once, by whoever claims it.
  3. `finish()`: stops the workers and says what they did.

  Deadlines (both from construction): the device-phase workers stop taking compiles after
  `budget_s` (the compile budget; GRACE_S later they are stopped and the timing process builds
  what is left); the kernel-phase workers after `kernel_budget_s` (the run's --time-budget: they
  are of use as long as the sweep is timed), or never (None: `finish()` stops them).
  """

  def __init__(self, argv: list[str], processes: int, cache: str, budget_s: float | None,
               quiet: bool, executables: str | None, device_processes: int | None = None,
               kernel_budget_s: float | None = None):
    self.argv, self.processes, self.cache, self.quiet = argv, processes, cache, quiet
    self.executables = executables
    gpu = gpu_visible()
    self.device_processes = device_worker_count(device_processes, processes, gpu)
    now = time.time()
    self.deadline = now + budget_s if budget_s else None  # the device phase's
    self.kernel_deadline = now + kernel_budget_s if kernel_budget_s else None
    if self.kernel_deadline and self.deadline:  # never before the device phase's
      self.kernel_deadline = max(self.kernel_deadline, self.deadline)
    self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="pallas_attn_prepass_"))
    (self.workdir / "claims").mkdir()
    (self.workdir / "done").mkdir()
    self.device_procs, self.kernel_procs = [], []
    self.procs, self.logs = [], []  # every worker and its log, in the order they started
    self.started = time.perf_counter()
    self.device_phase_s = None
    self.device_phase_end = None  # time.time() when the last device-phase worker had exited
    self.waited_s, self.self_built = 0.0, 0
    self.finished = None  # finish()'s Prepass once called
    self.before = compile_cache.entries(cache)
    # Every worker holds a CUDA context on the card during the device phase (see ledger_budget).
    self.ledger_bytes = ledger_budget(gpu_memory_bytes() if gpu else None, processes)

  def _spawn(self, phase: str):
    log = self.workdir / f"worker-{len(self.logs)}-{phase}.log"
    self.logs.append(log)
    device = phase == "device"
    with open(log, "w", encoding="utf-8") as f:
      proc = subprocess.Popen(  # pylint: disable=consider-using-with
          _worker_cmd(self.argv, self.workdir, self.cache,
                      self.deadline if device else self.kernel_deadline, self.executables, phase,
                      self.ledger_bytes if device else None),
          cwd=ROOT, env=worker_env(self.device_processes if device else self.processes, phase),
          stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
    (self.device_procs if device else self.kernel_procs).append(proc)
    self.procs.append(proc)

  def start_device_phase(self):
    """Starts every worker: the device-phase ones and, beside them, the kernel-phase ones."""
    phases = phases_at_start(self.processes, self.device_processes)
    if not self.quiet:
      print(f"compile pre-pass (pipelined): {self.processes} processes, "
            f"{phases.count('device')} in the device phase, {phases.count('kernel')} kernel-phase "
            f"from the start -> {self.cache}", file=sys.stderr, flush=True)
    for phase in phases:
      self._spawn(phase)

  def wait_device_phase(self):
    """Blocks until every device-phase worker has exited (terminated GRACE_S past the deadline),
    starting a kernel-phase worker in each one's place as it exits."""
    next_report = time.time() + REPORT_EVERY_S
    replaced = set()
    while True:
      for i, p in enumerate(self.device_procs):
        if p.poll() is not None and i not in replaced:
          replaced.add(i)
          self._spawn("kernel")
      if len(replaced) == len(self.device_procs):
        break
      now = time.time()
      if self.deadline and now > self.deadline + GRACE_S:
        _stop(self.device_procs)
        continue
      if not self.quiet and now > next_report:
        print(f"compile pre-pass: {len(_reports(self.workdir))} calls built (device phase)",
              file=sys.stderr, flush=True)
        next_report = now + REPORT_EVERY_S
      time.sleep(POLL_S / 5)
    self.device_phase_s = time.perf_counter() - self.started
    self.device_phase_end = time.time()
    if not self.quiet:
      reports = _reports(self.workdir)
      kernel = sum(r.get("phase") == "kernel" for r in reports)
      print(f"compile pre-pass: device phase done after {self.device_phase_s:.0f} s "
            f"({len(reports) - kernel} device-phase calls built by {self.device_processes} "
            f"workers, {kernel} kernel-phase calls beside them); timing starts", file=sys.stderr,
            flush=True)

  def _workers_alive(self) -> bool:
    return any(p.poll() is None for p in self.kernel_procs + self.device_procs)

  def fetch(self, label: str, build: Callable, *, is_build: bool = True):
    """The compile called `label` for the timing process: a worker's executable (waiting while a
    worker builds it), or `build()` here when no worker took it, it failed, or did not load."""
    key = job_key(label)
    done, claim = self.workdir / "done" / key, self.workdir / "claims" / key
    start = time.perf_counter()
    while not done.exists():
      if not claim.exists() and _claim(claim):
        self.self_built += 1
        return build()  # nobody has started it: faster to build it than to wait
      if not self._workers_alive() or time.perf_counter() - start > FETCH_WAIT_S:
        break
      time.sleep(0.02)
    self.waited_s += time.perf_counter() - start
    from benchmarks import sweep  # pylint: disable=import-outside-toplevel  (a cycle otherwise)
    return sweep._handed_over_or(  # pylint: disable=protected-access
        build, executable_file(self.executables, label), is_build=is_build) \
        if self.executables else build()

  def finish(self) -> Prepass:
    """Stops the workers (they are done or past use once the sweep ends) and reports."""
    if self.finished is not None:
      return self.finished
    _stop(self.kernel_procs + self.device_procs)
    reports = _reports(self.workdir)
    failures = [f"worker {i} exited with {p.returncode}: {_tail(log)}"
                for i, (p, log) in enumerate(zip(self.procs, self.logs))
                if p.returncode and p.returncode not in (-15, -9)]
    shutil.rmtree(self.workdir, ignore_errors=True)
    ok = [r for r in reports if r["error"] is None]
    kernel = [r for r in reports if r.get("phase") == "kernel"]
    kernel_ok = [r for r in kernel if r["error"] is None]
    end = self.device_phase_end
    self.finished = Prepass(processes=self.processes, seconds=time.perf_counter() - self.started,
                   compiled=len(ok), failed=len(reports) - len(ok),
                   compile_s=sum(r["s"] for r in reports),
                   handed_over=sum(bool(r.get("handed_over")) for r in reports),
                   entries_before=self.before, entries_after=compile_cache.entries(self.cache),
                   worker_failures=failures, device_phase_s=self.device_phase_s,
                   waited_s=self.waited_s, self_built=self.self_built,
                   breakdown=_breakdown(reports), device_processes=self.device_processes,
                   kernel_built=len(kernel_ok), kernel_failed=len(kernel) - len(kernel_ok),
                   kernel_built_early=sum(end is not None and r["start"] + r["s"] <= end
                                          for r in kernel_ok))
    return self.finished


def run_prepass(argv: list[str], processes: int, cache: str, budget_s: float | None,
                quiet: bool, executables: str | None = None) -> Prepass:
  """The pre-pass without the pipeline (`--no-compile-pipeline`): starts `processes` workers over
  every compile (the device ones first, longest first), waits for them (at most `budget_s` plus a
  grace period), and returns what they did. Never raises for a worker's sake: whatever a worker did
  not build, the timing process compiles itself."""
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
                 worker_failures=failures, breakdown=_breakdown(reports))


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
