"""Helpers of the multi-device tests: meshes of simulated CPU devices (conftest.py asks XLA for 8)
and the collectives of a compiled program."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...],
             axis_type: AxisType = AxisType.Explicit) -> Mesh:
  """A mesh of the first prod(shape) CPU devices (also on a machine with a GPU)."""
  devices = jax.devices("cpu")
  needed = int(np.prod(shape))
  if len(devices) < needed:
    pytest.skip(f"needs {needed} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count), "
                f"has {len(devices)}")
  return Mesh(np.asarray(devices[:needed]).reshape(shape), names,
              axis_types=(axis_type,) * len(shape))


def collectives(compiled) -> dict[str, int]:
  """How many of each collective a compiled program (`jit(f).lower(...).compile()`) runs."""
  text = compiled.as_text()
  counts = {}
  for name in COLLECTIVES:
    # An instruction: `%name.3 = f32[...] all-gather(...)`, or its async `-start` half.
    count = len(re.findall(rf"[\s)}}]{name}(?:-start)?\(", text))
    if count:
      counts[name] = count
  return counts


def local_shapes(compiled) -> list[str]:
  """The shapes of the per-device array entry parameters of a compiled SPMD program (not
  scalars, nor the interpreter's ordering token[])."""
  entry = re.search(r"ENTRY[^\n]*", compiled.as_text()).group(0)
  return re.findall(r"param[.\w]*: ([a-z0-9]+\[[0-9,]+\])", entry)
