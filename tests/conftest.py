"""Shared pytest setup for the pallas_attn suite.

- float64 stays off (jax's default): every dtype in the suite is explicit.
- `seed` / `rng_key`: a fresh, per-test PRNG seed derived from the test id (different for every
  test and parametrization, identical from run to run, so a failure reproduces).
- tests/ is put on sys.path so that `import cases` works under any --import-mode.
- CPU-only runs compile with fewer LLVM optimizations (see below): compile time dominates.
- GPU runs compile the dense references without GEMM autotuning (see below).
- The CPU backend has 8 (simulated) devices, for the multi-device tests (`multidevice.py`).
Nothing here skips tests: the `gpu` marker is deselected by pyproject's addopts, not skipped.
"""

import importlib.metadata
import os
import sys
import zlib


def _has_gpu_plugin() -> bool:
  names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
  return any(n.startswith(("jax-cuda", "jax_cuda")) for n in names)


# CPU-only runs: most of the suite's time is XLA compiling small programs; the LLVM backend's
# optimizations roughly halve that and change nothing the tests look at (the programs run for
# milliseconds). Must happen before jax initializes a backend. Not applied where a CUDA plugin is
# installed (GPU runs compile the real kernels as users do), nor when
# PALLAS_ATTN_TEST_FULL_OPT=1, nor when XLA_FLAGS already sets these options.
if os.environ.get("PALLAS_ATTN_TEST_FULL_OPT") != "1" and not _has_gpu_plugin():
  _flags = os.environ.get("XLA_FLAGS", "")
  for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in _flags:
      _flags = f"{_flags} {_flag}".strip()
  os.environ["XLA_FLAGS"] = _flags

# GPU runs: the `gpu` tests compare the kernels with XLA's dense references, whose speed does not
# matter, and several test workers share the one GPU. XLA's GEMM autotuning of those references
# time-slices the GPU between the workers (the sweep measured compiles 6-20x slower with 15
# processes autotuning at once: benchmarks/NOTES.md session 6), so it is off here (level 0: XLA's
# default GEMM configs). Not when PALLAS_ATTN_TEST_FULL_OPT=1 or XLA_FLAGS already sets it.
if (os.environ.get("PALLAS_ATTN_TEST_FULL_OPT") != "1" and _has_gpu_plugin()
    and "--xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()

# The multi-device tests (test_sharding.py, test_ring.py) run on simulated CPU devices, which XLA
# makes when asked before it creates the CPU backend. Tests on one device use the first one and
# see no difference.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                             f"--xla_force_host_platform_device_count=8").strip()

from pallas_attn import interpreter_threads  # noqa: E402

# The Mosaic GPU interpreter needs more XLA CPU threads than 2 cores give (see that module).
interpreter_threads.configure()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

jax.config.update("jax_enable_x64", False)


def _seed_for(nodeid: str) -> int:
  return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


@pytest.fixture
def seed(request) -> int:
  """An int seed unique to this test (and parametrization)."""
  return _seed_for(request.node.nodeid)


@pytest.fixture
def rng_key(seed) -> jax.Array:
  """A fresh PRNG key unique to this test."""
  return jax.random.key(seed)
