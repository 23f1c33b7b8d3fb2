"""JAX's persistent compilation cache, as the sweep uses it: on in a block, and hits counted.

The compile pre-pass (`precompile.py`) fills the cache from worker processes; the timing process
turns the same directory on and its compiles load from it. JAX keys an entry on the lowered module
(debug locations left out), the backend and the compile options, so a worker and the timing
process that trace the same function get the same key. What the cache cannot save is the Python
work before the key exists: tracing and lowering (Pallas kernels are lowered in Python), which the
rows record as `lower_s`.
"""

from __future__ import annotations

import contextlib
import pathlib
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

# Per thread: `sweep.compile_all` may build several calls at once, each in its own thread, and JAX
# records the hit event in the thread that compiles.
_hits = threading.local()
_listening = False
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def _on_event(event: str, **_):
  if event == "/jax/compilation_cache/cache_hits":
    _hits.count = hits() + 1


def hits() -> int:
  """Persistent-cache hits seen so far by the calling thread."""
  return getattr(_hits, "count", 0)


def active() -> bool:
  """Whether compiles in this process read and write a persistent cache."""
  return bool(jax.config.jax_compilation_cache_dir) and jax.config.jax_enable_compilation_cache


def entries(path) -> int:
  """Executables stored in a cache directory (one `*-cache` file each)."""
  path = pathlib.Path(path)
  return len(list(path.glob("*-cache"))) if path.is_dir() else 0


@contextlib.contextmanager
def enabled(path):
  """Every compile in the block goes through the persistent cache at `path` (None: no change).

  Everything is cached, however small or quick to build: the pre-pass exists to move every
  compile out of the timing process. JAX initializes its cache once per process, so the cache is
  reset on entry and on exit (a test run may use several directories in one process)."""
  global _listening
  if path is None:
    yield
    return
  pathlib.Path(path).mkdir(parents=True, exist_ok=True)
  if not _listening:
    jax.monitoring.register_event_listener(_on_event)
    _listening = True
  before = {name: getattr(jax.config, name) for name in _SETTINGS}
  jax_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor
  try:
    yield
  finally:
    jax_cache.reset_cache()
    for name, value in before.items():
      jax.config.update(name, value)
