"""How a call is timed, what it is credited with, and the matmul ceiling it is compared to.

The method, the same for every implementation: a compiled function and its inputs; `warmup`
blocking calls; one more blocking call to estimate the time per call; then `repeats` repeats, each
enqueuing `calls` calls back to back and blocking once on the last output (device work on one
stream runs in order, so the last output being ready means all are done). No host sync between the
calls of a repeat, so launch latency is hidden as it is in a model. `calls` is chosen so a repeat
lasts about `target_repeat_s` (at most `max_calls`, at least 1): short calls get many, long calls
few. The reported time is the median repeat's time per call.

FLOPs are counted the FlashAttention way (Dao et al.): forward 4 * B * Hq * Sq * Skv * D (two
matmuls of 2 * Sq * Skv * D each, per batch and head), halved when causal; forward+backward 3.5x
forward (the backward does five matmuls to the forward's two, 2.5x). The masked shapes (a sliding
window, packed documents) are credited the same dense causal count: what they skip shows as a
higher rate (benchmarks/masking.py says how much there is to skip).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.shapes import Shape

PASSES = ("fwd", "fwd_bwd")

FLOP_FORMULA = ("forward FLOPs = 4*B*Hq*Sq*Skv*D (x1/2 when causal); "
                "forward+backward = 3.5 x forward; TFLOP/s = FLOPs / median time")


def attention_flops(shape: Shape, pass_: str) -> float:
  """FLOPs credited to one call (FlashAttention convention, see the module docstring)."""
  flops = 4.0 * shape.batch * shape.heads_q * shape.seq_q * shape.seq_kv * shape.head_dim
  if shape.causal:
    flops /= 2
  if pass_ == "fwd_bwd":
    flops *= 3.5
  elif pass_ != "fwd":
    raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
  return flops


def attention_min_bytes(shape: Shape, pass_: str, itemsize: int) -> int:
  """The fewest bytes a call must move through memory: forward reads q, k, v and writes out;
  forward+backward also reads q, k, v, out, d_out and writes dq, dk, dv. (Decode shapes are judged
  by this, not by FLOPs.)"""
  q = o = shape.batch * shape.seq_q * shape.heads_q * shape.head_dim
  kv = shape.batch * shape.seq_kv * shape.heads_kv * shape.head_dim
  fwd = q + 2 * kv + o
  total = fwd if pass_ == "fwd" else fwd + (q + 2 * kv + o + o) + (q + 2 * kv)
  return total * itemsize


@dataclasses.dataclass(frozen=True)
class TimingConfig:
  warmup: int = 2
  repeats: int = 7
  max_calls: int = 20
  target_repeat_s: float = 0.05


@dataclasses.dataclass(frozen=True)
class Timing:
  ms: float  # median repeat's time per call
  repeat_ms: tuple[float, ...]  # every repeat's time per call
  calls: int  # calls enqueued per repeat


def _warm_up(fn, args, warmup: int):
  """`warmup` blocking calls (at least one): (the first call's output, the last call's seconds)."""
  for i in range(max(1, warmup)):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    estimate = time.perf_counter() - start
    if i == 0:
      first = out
    del out
  return first, estimate


def _calls_per_repeat(estimate_s: float, cfg: TimingConfig) -> int:
  return max(1, min(cfg.max_calls, math.ceil(cfg.target_repeat_s / max(estimate_s, 1e-7))))


def _one_repeat_ms(fn, args, calls: int) -> float:
  """`calls` calls enqueued back to back, one block on the last: milliseconds per call."""
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls * 1e3


def time_compiled(fn, args, cfg: TimingConfig = TimingConfig()):
  """Times `fn(*args)` by the method in the module docstring.

  The last warm-up call (at least one is made) is timed alone to choose `calls`; with
  `repeats=0` that single call is the result (the out-of-memory search runs each size once).
  Returns (Timing, the output of the first call), so that callers can check the result without
  running the function again.
  """
  first, estimate = _warm_up(fn, args, cfg.warmup)
  if cfg.repeats == 0:
    return Timing(estimate * 1e3, (estimate * 1e3,), 1), first
  calls = _calls_per_repeat(estimate, cfg)
  repeat_ms = [_one_repeat_ms(fn, args, calls) for _ in range(cfg.repeats)]
  return Timing(statistics.median(repeat_ms), tuple(repeat_ms), calls), first


def time_interleaved(calls: list[tuple], cfg: TimingConfig = TimingConfig()) -> list[Timing]:
  """Times several `(fn, args)` by the same method, their repeats interleaved: round r runs one
  repeat of each, starting at the r-th (a rotated order), so that a drift of the device over the
  measurement (clocks, temperature: 1-6% within one tuner call on the H200, benchmarks/NOTES.md
  session 7) falls on all of them alike instead of on whichever ran last. `repeats` rounds
  (at least one); each function keeps its own number of calls per repeat."""
  per_repeat = [_calls_per_repeat(_warm_up(fn, args, cfg.warmup)[1], cfg) for fn, args in calls]
  repeat_ms: list[list[float]] = [[] for _ in calls]
  for round_ in range(max(1, cfg.repeats)):
    for k in range(len(calls)):
      i = (round_ + k) % len(calls)
      fn, args = calls[i]
      repeat_ms[i].append(_one_repeat_ms(fn, args, per_repeat[i]))
  return [Timing(statistics.median(ms), tuple(ms), n) for ms, n in zip(repeat_ms, per_repeat)]


def matmul_ceiling(n: int, dtype, cfg: TimingConfig = TimingConfig(), seed: int = 0) -> dict:
  """An n x n x n matmul in `dtype`, timed like the attention calls: the rate the attention
  kernels' matmuls could reach on this device, measured in the same run."""
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (n, n), dtype)
  b = jax.random.normal(kb, (n, n), dtype)
  compiled = jax.jit(jnp.matmul).lower(a, b).compile()
  timing, _ = time_compiled(compiled, (a, b), cfg)
  flops = 2.0 * n ** 3
  return {"m": n, "n": n, "k": n, "ms": timing.ms, "tflops": flops / timing.ms / 1e9,
          "calls_per_repeat": timing.calls, "repeats": len(timing.repeat_ms)}
