"""How much device memory a call needs, and the longest sequence it runs before running out.

Two measures, recorded side by side:
- compiled: XLA's `memory_analysis()` of the compiled call. `temp_bytes` are the temporaries it
  allocates beyond its inputs and outputs (the N x N scores of a dense path live here);
  `peak_bytes` = arguments + outputs + temporaries - aliased, what one call holds at once. Known on
  every backend, before anything runs.
- allocator: on a GPU, the allocator's `peak_bytes_in_use` (`device.memory_stats()`). That peak is
  a high-water mark since the process started and JAX cannot reset it, so a call's own peak is
  known only when the call raises the mark; `AllocatorPeak` reports it then, minus what was in use
  before the call's inputs were made, and None otherwise. The out-of-memory search runs each
  implementation in a fresh process so that every step raises the mark.
"""

from __future__ import annotations

import jax

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM")


def compiled_memory(compiled) -> dict:
  """temp_bytes and peak_bytes of a compiled call (None where the backend reports nothing)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (some backends do not implement it)
    stats = None
  if stats is None:
    return {"temp_bytes": None, "peak_bytes": None}
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
          - stats.alias_size_in_bytes)
  return {"temp_bytes": int(stats.temp_size_in_bytes), "peak_bytes": int(peak)}


def allocator_stats(device=None) -> dict | None:
  device = device or jax.devices()[0]
  try:
    return device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None


def device_memory_limit(device=None) -> int | None:
  """Bytes the allocator may hand out (None on backends without allocator stats)."""
  stats = allocator_stats(device)
  return None if not stats else stats.get("bytes_limit")


class AllocatorPeak:
  """Brackets one measurement: `start()` before its inputs are made, `stop()` after its first
  call; `bytes` is then that call's peak (inputs included) or None (see the module docstring)."""

  def __init__(self, device=None):
    self.device = device or jax.devices()[0]
    self.bytes = None
    self._base = self._peak = None

  def start(self):
    stats = allocator_stats(self.device)
    if stats and "peak_bytes_in_use" in stats:
      self._base, self._peak = stats.get("bytes_in_use", 0), stats["peak_bytes_in_use"]
    return self

  def stop(self):
    stats = allocator_stats(self.device)
    if self._peak is not None and stats and stats.get("peak_bytes_in_use", 0) > self._peak:
      self.bytes = int(stats["peak_bytes_in_use"] - self._base)
    return self.bytes


def is_oom(error: BaseException | str) -> bool:
  text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
  return any(marker in text for marker in OOM_MARKERS)


def describe_error(error: BaseException) -> tuple[str, str]:
  """(kind, one-line message): kind is "oom", "unsupported" or "error"."""
  lines = [l.strip() for l in str(error).strip().splitlines() if l.strip()]
  message = f"{type(error).__name__}: {lines[0] if lines else ''}"
  if is_oom(error):
    return "oom", "out of memory: " + message[:300]
  if isinstance(error, (NotImplementedError, ValueError, TypeError, ImportError)):
    return "unsupported", message[:300]
  return "error", message[:300]


def search_seqs(start: int, cap: int) -> list[int]:
  """start, 2*start, ... up to cap: the out-of-memory search's ladder."""
  seqs, seq = [], start
  while seq <= cap:
    seqs.append(seq)
    seq *= 2
  return seqs


def max_seq_search(step, seqs: list[int], emit) -> int | None:
  """Runs `step(seq) -> row` up the ladder `seqs`, emitting each row, and stops at the first row
  with an error (out of memory, usually). Returns the largest seq that ran (None if none did)."""
  largest = None
  for seq in seqs:
    row = step(seq)
    emit(row)
    if row["error"] is not None:
      break
    largest = seq
  return largest
