"""Context parallelism: one long sequence, ring attention on N devices against attention on one.

  python -m benchmarks.ring                       # 128k tokens, 16 heads of 128, bf16, causal,
                                                  # on 1, 2, 4, 8 of the visible GPUs
  python -m benchmarks.ring --seq 262144 --devices 8 --max-seq
  python -m benchmarks.ring --cpu-smoke           # tiny, on 4 simulated CPU devices (CI)

For every device count N and pass (forward; forward+backward) it times four programs:
- `single`: `pallas_attn.attention` on one device (the baseline; N = 1 only);
- `ring`: `pallas_attn.ring_attention` over N devices;
- `compute_only`: the same ring program with its transfers left out (each device keeps its own
  k/v shard: wrong numbers, the right kernels), traced with the ring's `pass_on` replaced by the
  identity;
- `comm_only`: the ring's transfers alone: P hops of the k/v shards (and, for the backward, P more
  with the float32 dK/dV accumulators).
Derived: speedup = single / ring, scaling efficiency = speedup / N, exposed communication =
ring - compute_only, and the share of the communication hidden behind compute,
overlap = (compute_only + comm_only - ring) / min(compute_only, comm_only), clipped to [0, 1]
(1: fully hidden, 0: serialized). `--max-seq` also doubles the sequence until a configuration no
longer fits (compiled memory per device over the allocator's limit, or out of memory when run).

Timing and FLOPs as in `benchmarks.timing` (FLOPs of the whole problem; tflops_per_device divides
by N). Rows go to results/ring-<device>.jsonl (one JSON object per measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_attn
from benchmarks import memory
from benchmarks import shapes as shapes_lib
from benchmarks import sweep
from benchmarks import timing
from pallas_attn import ring as ring_lib

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("single", "ring", "compute_only", "comm_only")
SMOKE_DEVICES = 4


@dataclasses.dataclass(frozen=True)
class Problem:
  """One long-sequence attention problem and how it is run."""

  seq: int
  batch: int = 1
  heads_q: int = 16
  heads_kv: int = 16
  head_dim: int = 128
  causal: bool = True
  dtype: str = "bfloat16"
  implementation: str | None = None
  interpret: bool = False

  @property
  def shape(self) -> shapes_lib.Shape:
    return shapes_lib.Shape(self.batch, self.seq, self.seq, self.heads_q, self.heads_kv,
                            self.head_dim, self.causal, "ring")


def _mesh(devices) -> Mesh:
  return Mesh(np.asarray(devices), ("seq",))


def _inputs(problem: Problem, mesh: Mesh, seed: int = 0):
  """q, k, v, d_out: standard normal, sharded over the sequence."""
  sharding = NamedSharding(mesh, PartitionSpec(None, "seq"))
  q_shape = (problem.batch, problem.seq, problem.heads_q, problem.head_dim)
  kv_shape = (problem.batch, problem.seq, problem.heads_kv, problem.head_dim)
  keys = jax.random.split(jax.random.key(seed), 4)
  draw = jax.jit(lambda key, shape: jax.random.normal(key, shape, problem.dtype),
                 static_argnums=1, out_shardings=sharding)
  return tuple(draw(key, shape) for key, shape in zip(keys, (q_shape, kv_shape, kv_shape,
                                                             q_shape)))


def _attend(problem: Problem, mesh: Mesh, variant: str):
  if variant == "single":
    return lambda q, k, v: pallas_attn.attention(
        q, k, v, is_causal=problem.causal, implementation=problem.implementation,
        interpret=problem.interpret)
  return lambda q, k, v: pallas_attn.ring_attention(
      q, k, v, mesh=mesh, seq_axis="seq", is_causal=problem.causal,
      implementation=problem.implementation, interpret=problem.interpret)


def _rotations_only(mesh: Mesh, pass_: str):
  """The ring's transfers without its kernels (see the module docstring)."""
  p = mesh.shape["seq"]

  def rotate(x):
    return lax.ppermute(x, "seq", [(j, (j + 1) % p) for j in range(p)])

  def shard(q, k, v, d_out):
    del q, d_out
    k, v = lax.fori_loop(0, p, lambda i, kv: rotate(kv), (k, v))
    if pass_ == "fwd":
      return k, v
    grads = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (k, v), grads = lax.fori_loop(0, p, lambda i, c: (rotate(c[0]), rotate(c[1])),
                                  ((k, v), grads))
    return k, v, *grads

  spec = PartitionSpec(None, "seq")
  outs = 2 if pass_ == "fwd" else 4
  return jax.shard_map(shard, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * outs,
                       check_vma=False)


@contextlib.contextmanager
def _without_transfers():
  """Trace the ring with every device keeping its own shard (the `compute_only` variant)."""
  with mock.patch.object(ring_lib._Ring, "pass_on", lambda self, x: x):  # pylint: disable=protected-access
    yield


def compile_variant(problem: Problem, mesh: Mesh, variant: str, pass_: str, args):
  """The compiled program of one variant and pass (fresh closures: no trace cache is shared)."""
  if variant == "comm_only":
    return jax.jit(_rotations_only(mesh, pass_)).lower(*args).compile()
  attend = _attend(problem, mesh, variant)
  if pass_ == "fwd":
    fn = lambda q, k, v, d_out: attend(q, k, v)
  else:
    fn = lambda q, k, v, d_out: jax.vjp(attend, q, k, v)[1](d_out)
  tracing = _without_transfers() if variant == "compute_only" else contextlib.nullcontext()
  with tracing:
    return jax.jit(fn).lower(*args).compile()


def _prepare(problem: Problem, devices: list, variant: str, pass_: str):
  """(compiled program, its inputs, its compiled peak bytes per device) over `devices`."""
  mesh = _mesh(devices)
  args = _inputs(problem, mesh)
  compiled = compile_variant(problem, mesh, variant, pass_, args)
  return compiled, args, memory.compiled_memory(compiled)["peak_bytes"]


def measure(problem: Problem, devices: list, variant: str, pass_: str,
            cfg: timing.TimingConfig, ctx: dict) -> dict:
  """One row: time per call (or why there is none), FLOPs and compiled memory per device, for
  the program over `devices`."""
  num_devices = len(devices)
  row = {"kind": "ring", "variant": variant, "devices": num_devices, "pass": pass_,
         **dataclasses.asdict(problem), "flops": timing.attention_flops(problem.shape, pass_),
         "ms": None, "tflops": None, "tflops_per_device": None, "peak_bytes": None,
         "error": None, "error_kind": None, **ctx}
  try:
    compiled, args, row["peak_bytes"] = _prepare(problem, devices, variant, pass_)
    result, _ = timing.time_compiled(compiled, args, cfg)
  except Exception as error:  # pylint: disable=broad-except  (a failed row says why)
    row["error_kind"], row["error"] = memory.describe_error(error)
    return row
  row["ms"] = result.ms
  if variant != "comm_only":
    row["tflops"] = row["flops"] / result.ms / 1e9
    row["tflops_per_device"] = row["tflops"] / num_devices
  return row


def summarize(rows: list[dict]) -> list[dict]:
  """Per (devices, pass): speedup, scaling efficiency, exposed communication and overlap."""
  ms = {(r["devices"], r["pass"], r["variant"]): r["ms"] for r in rows if r["ms"] is not None}
  out = []
  for (n, pass_, variant), ring_ms in sorted(ms.items()):
    if variant != "ring":
      continue
    single = ms.get((1, pass_, "single"))
    compute, comm = ms.get((n, pass_, "compute_only")), ms.get((n, pass_, "comm_only"))
    summary = {"kind": "ring_summary", "devices": n, "pass": pass_, "ring_ms": ring_ms,
               "single_ms": single, "speedup": None, "scaling_efficiency": None,
               "exposed_comm_ms": None, "overlap": None}
    if single:
      summary["speedup"] = single / ring_ms
      summary["scaling_efficiency"] = single / ring_ms / n
    if compute is not None:
      summary["exposed_comm_ms"] = ring_ms - compute
    if compute is not None and comm is not None and n > 1 and min(compute, comm) > 0:
      hidden = (compute + comm - ring_ms) / min(compute, comm)
      summary["overlap"] = float(np.clip(hidden, 0.0, 1.0))
    out.append(summary)
  return out


def max_seq(problem: Problem, devices: list, pass_: str, cap: int, ctx: dict) -> dict:
  """The longest sequence (doubling from problem.seq, up to cap) that compiles within the
  allocator's limit per device and runs once over `devices`."""
  limit = memory.device_memory_limit(devices[0])
  num_devices = len(devices)
  variant = "single" if num_devices == 1 else "ring"
  fits, seq, why = None, problem.seq, None
  while seq <= cap:
    try:
      compiled, args, peak = _prepare(dataclasses.replace(problem, seq=seq), devices, variant,
                                      pass_)
      if limit is not None and peak is not None and peak > limit:
        why = f"compiled peak {peak / 2**30:.1f} GiB > limit {limit / 2**30:.1f} GiB"
        break
      jax.block_until_ready(compiled(*args))
    except Exception as error:  # pylint: disable=broad-except
      why = memory.describe_error(error)[1]
      break
    fits, seq = seq, seq * 2
  return {"kind": "ring_max_seq", "devices": num_devices, "pass": pass_, "variant": variant,
          "max_seq": fits, "first_failure": why or f"none up to the cap ({cap})", **ctx}


def print_tables(rows: list[dict], summaries: list[dict]):
  print(f"{'devices':>7} {'pass':>8} {'variant':>13} {'ms':>10} {'TFLOP/s/dev':>12}  error")
  for r in rows:
    ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
    tf = "-" if r["tflops_per_device"] is None else f"{r['tflops_per_device']:.2f}"
    print(f"{r['devices']:>7} {r['pass']:>8} {r['variant']:>13} {ms:>10} {tf:>12}  "
          f"{r['error'] or ''}")
  print(f"\n{'devices':>7} {'pass':>8} {'speedup':>8} {'efficiency':>10} {'exposed ms':>10} "
        f"{'overlap':>8}")
  fmt = lambda x, f: "-" if x is None else format(x, f)
  for s in summaries:
    print(f"{s['devices']:>7} {s['pass']:>8} {fmt(s['speedup'], '.2f'):>8} "
          f"{fmt(s['scaling_efficiency'], '.2f'):>10} {fmt(s['exposed_comm_ms'], '.3f'):>10} "
          f"{fmt(s['overlap'], '.2f'):>8}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seq", type=int, default=131072)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16, help="query heads")
  p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--no-causal", dest="causal", action="store_false")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--devices", default=None, help="device counts, default 1,2,4,8 (1,2,4 with "
                 "--cpu-smoke); those beyond the visible devices are skipped")
  p.add_argument("--passes", default="fwd,fwd_bwd")
  p.add_argument("--implementation", default=None, help="mosaic_gpu or blocked_jax (default: "
                 "the kernels on a Hopper GPU, else blocked_jax)")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--max-seq", action="store_true", help="also search the longest sequence")
  p.add_argument("--max-seq-cap", type=int, default=1 << 21)
  p.add_argument("--out", type=pathlib.Path, default=None)
  p.add_argument("--cpu-smoke", action="store_true",
                 help=f"tiny problem on {SMOKE_DEVICES} simulated CPU devices, one repeat")
  p.add_argument("--quiet", action="store_true")
  return p.parse_args(argv)


def _simulate_cpu_devices(count: int):
  """Ask XLA for `count` CPU devices; it listens only before JAX starts its backend (a process
  that started it already, e.g. the test suite, keeps the devices it has)."""
  flag = "--xla_force_host_platform_device_count"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={count}".strip()


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.cpu_smoke:
    _simulate_cpu_devices(SMOKE_DEVICES)
    devices = jax.devices("cpu")
    problem = Problem(seq=64, heads_q=4, heads_kv=2, head_dim=16, causal=args.causal,
                      dtype="float32", implementation=args.implementation or "blocked_jax")
    counts = args.devices or f"1,2,{SMOKE_DEVICES}"
    cfg = timing.TimingConfig(warmup=1, repeats=1, max_calls=1)
  else:
    devices = jax.devices()
    problem = Problem(seq=args.seq, batch=args.batch, heads_q=args.heads,
                      heads_kv=args.kv_heads or args.heads, head_dim=args.head_dim,
                      causal=args.causal, dtype=args.dtype, implementation=args.implementation)
    counts = args.devices or "1,2,4,8"
    cfg = timing.TimingConfig(repeats=args.repeats)
  device_lists = [devices[:int(n)] for n in counts.split(",") if int(n) <= len(devices)]
  passes = args.passes.split(",")
  ctx = sweep.run_context()
  rows = []
  for pass_ in passes:
    for on in device_lists:
      for variant in (("single", "ring") if len(on) == 1 else VARIANTS[1:]):
        rows.append(measure(problem, on, variant, pass_, cfg, ctx))
        if not args.quiet:
          print(f"{len(on)} devices {pass_} {variant}: {rows[-1]['ms']} ms "
                f"{rows[-1]['error'] or ''}", file=sys.stderr, flush=True)
  summaries = summarize(rows)
  extra = []
  if args.max_seq:
    extra = [max_seq(problem, on, pass_, args.max_seq_cap, ctx)
             for pass_ in passes for on in device_lists]
  name = "cpu-smoke" if args.cpu_smoke else ctx["device"].replace(" ", "_").lower()
  out = args.out or RESULTS / f"ring-{name}.jsonl"
  out.parent.mkdir(parents=True, exist_ok=True)
  with open(out, "w") as f:
    for row in rows + summaries + extra:
      f.write(json.dumps(row) + "\n")
  if not args.quiet:
    print_tables(rows, summaries)
    for row in extra:
      print(f"max seq: {row['devices']} devices {row['pass']}: {row['max_seq']} "
            f"(then: {row['first_failure']})")
    print(f"\nwrote {out}")
  return rows + summaries + extra


if __name__ == "__main__":
  main()
