"""Thread budget the Mosaic GPU interpreter needs from XLA's CPU runtime.

The interpreter runs every warpgroup of a CTA as a host thread executing its own XLA computation,
and a warpgroup blocked on a barrier holds one of the XLA CPU client's worker threads. That pool
has as many threads as cores unless `PJRT_NPROC` says otherwise, so on a 2-core machine a
3-warpgroup kernel can leave the warpgroup that would release the barrier without a thread: a
deadlock (seen here, intermittently). A larger pool avoids it. It must be set before JAX creates
its CPU backend.
"""

from __future__ import annotations

import os
import warnings

MIN_THREADS = 16


def configure() -> None:
  """Ask XLA for enough CPU threads for the interpreter; call before JAX's first computation."""
  os.environ.setdefault("PJRT_NPROC", str(MIN_THREADS))


def warn_if_too_few() -> None:
  """Warn when interpreting on a machine whose XLA pool may be too small (see module doc)."""
  configured = os.environ.get("PJRT_NPROC")
  threads = int(configured) if configured and configured.isdigit() else os.cpu_count() or 1
  if threads < MIN_THREADS:
    warnings.warn(
        f"interpret=True with an XLA CPU pool of {threads} threads may deadlock; set "
        f"PJRT_NPROC={MIN_THREADS} (or call pallas_attn.interpreter_threads.configure()) "
        f"before JAX's first computation", RuntimeWarning, stacklevel=3)
