"""The benchmark harness (benchmarks/): the CPU sweep's rows, failures as rows, the report, the
out-of-memory search, the results files' schema, and the notebook executed in its CI mode."""

import json
import pathlib
import statistics
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

from benchmarks import bwd_parts  # noqa: E402
from benchmarks import compile_cache  # noqa: E402
from benchmarks import determinism_probe  # noqa: E402
from benchmarks import fused_dq_probe  # noqa: E402
from benchmarks import impls  # noqa: E402
from benchmarks import masking  # noqa: E402
from benchmarks import overhead_probe  # noqa: E402
from benchmarks import precompile  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks import run  # noqa: E402
from benchmarks import shapes  # noqa: E402
from benchmarks import sweep  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks import tune  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pallas_attn  # noqa: E402
from pallas_attn.mosaic_gpu import config as config_lib  # noqa: E402

# bf16 inputs and outputs: one rounding of the output is up to 2^-8 = 3.9e-3 of its largest entry.
MAX_REL_ERR = 2e-2

# Column -> accepted types, for every attention row (None where the value may be unknown).
SCHEMA = {
    "kind": (str,), "implementation": (str,), "family": (str,), "batch": (int,),
    "seq_q": (int,), "seq_kv": (int,), "heads_q": (int,), "heads_kv": (int,),
    "head_dim": (int,), "causal": (bool,), "dtype": (str,), "pass": (str,),
    "ms": (float, type(None)), "tflops": (float, type(None)), "gb_per_s": (float, type(None)),
    "pct_of_matmul": (float, type(None)), "flops": (float,), "peak_bytes": (int, type(None)),
    "temp_bytes": (int, type(None)), "alloc_peak_bytes": (int, type(None)),
    "max_rel_err": (float, type(None)), "error": (str, type(None)),
    "error_kind": (str, type(None)), "device": (str,), "platform": (str,),
    "jax_version": (str,), "date": (str,), "run_id": (str,),
}
PORTABLE = ("pallas_attn:blocked_jax", "pallas_attn:reference", "jax_xla")


def check_schema(row):
  for key, types in SCHEMA.items():
    assert key in row, f"row lacks {key!r}: {row}"
    assert isinstance(row[key], types), f"{key}={row[key]!r} is not {types} in {row}"
  assert row["implementation"] in impls.NAMES
  assert row["pass"] in timing.PASSES
  assert (row["error"] is None) == (row["error_kind"] is None)
  if row["error"] is None:
    assert row["ms"] > 0 and row["tflops"] > 0 and row["peak_bytes"] > 0
    if row.get("repeat_ms") is not None:  # (rows before session 13 have none)
      # Every repeat's time is kept; the reported time is their median.
      assert len(row["repeat_ms"]) == row["repeats"] >= 1
      assert row["ms"] == statistics.median(row["repeat_ms"])


@pytest.fixture(scope="module")
def cpu_sweep(tmp_path_factory):
  """The CPU sweep in its tiny mode, as the command line runs it."""
  out = tmp_path_factory.mktemp("bench") / "cpu.jsonl"
  rows = run.main(["--quick", "--out", str(out), "--quiet", "--repeats", "1", "--max-calls", "2",
                   "--ceiling-size", "128", "--no-max-seq-search"])
  return out, rows


def test_sweep_writes_one_row_per_measurement(cpu_sweep):
  out, rows = cpu_sweep
  assert [json.loads(line) for line in out.read_text().splitlines()] == rows
  ceiling = [r for r in rows if r["kind"] == "matmul_ceiling"]
  assert len(ceiling) == 1 and ceiling[0]["tflops"] > 0
  attn = [r for r in rows if r["kind"] == "attention"]
  for row in attn:
    check_schema(row)
    assert row["error"] is not None or row["repeat_ms"], row
  keys = {(r["implementation"], r["pass"], r["seq_q"], r["causal"], r["heads_q"]) for r in attn}
  assert len(keys) == len(attn)
  for shape in shapes.tiny_sweep():
    for name in impls.DEFAULT_NAMES["cpu"]:
      for pass_ in timing.PASSES:
        assert (name, pass_, shape.seq_q, shape.causal, shape.heads_q) in keys


def test_cpu_paths_run_and_match_the_reference(cpu_sweep):
  _, rows = cpu_sweep
  attn = [r for r in rows if r["kind"] == "attention"]
  for row in attn:
    if row["implementation"] in PORTABLE:
      assert row["error"] is None, row
    if row["error"] is None:  # the interpreter's row may say why the kernels could not run
      assert row["max_rel_err"] is not None and row["max_rel_err"] < MAX_REL_ERR, row
      assert row["temp_bytes"] is not None and row["pct_of_matmul"] > 0
    else:
      assert row["implementation"] == "pallas_attn:mosaic_gpu" and row["interpret"], row


def test_report_tables(cpu_sweep):
  _, rows = cpu_sweep
  text = report.summary(rows)
  for label in ("blocked_jax", "reference", "xla", "max err fwd_bwd", "compiled temporaries"):
    assert label in text
  assert "GFLOP/s fwd/fwd_bwd" in text  # CPU rates are below 1 TFLOP/s


def test_disturbed_rows_are_the_spread_ones():
  row = lambda repeats, error=None: {"repeat_ms": repeats, "error": error}
  rows = [row([1.0, 1.05, 1.02]), row([1.0, 1.3, 1.01]), row([1.0, 2.0], "oom"), row(None), {}]
  assert report.disturbed(rows) == [rows[1]]


def test_resume_has_nothing_left(cpu_sweep):
  _, rows = cpu_sweep
  impl_list = [impls.get(n, "cpu") for n in impls.DEFAULT_NAMES["cpu"]]
  cfg = sweep.SweepConfig()
  assert sweep.plan(shapes.tiny_sweep(), impl_list, cfg, "cpu")
  assert sweep.plan(shapes.tiny_sweep(), impl_list, cfg, "cpu", report.done_keys(rows)) == []


def test_failures_become_rows_and_the_sweep_goes_on():
  def refuses(q, k, v, *, is_causal):
    raise NotImplementedError("this shape is not supported")
  impl_list = [impls.Impl("tokamax_mosaic", None, unavailable="tokamax is not importable"),
               impls.Impl("jax_cudnn", refuses),
               impls.get("jax_xla", "cpu")]
  rows = []
  cfg = sweep.SweepConfig(passes=("fwd",), timing=timing.TimingConfig(warmup=1, repeats=1))
  sweep.run_sweep(shapes.tiny_sweep()[:1], impl_list, cfg, rows.append)
  by_name = {r["implementation"]: r for r in rows}
  assert by_name["tokamax_mosaic"]["error_kind"] == "unsupported"
  assert "tokamax is not importable" in by_name["tokamax_mosaic"]["error"]
  assert by_name["jax_cudnn"]["error"].startswith("NotImplementedError: this shape")
  assert by_name["jax_xla"]["error"] is None and by_name["jax_xla"]["max_rel_err"] < MAX_REL_ERR
  for row in rows:
    check_schema(row)


def test_masked_fractions_are_exact():
  """Visible pairs and skipped tiles against closed forms: causal, a causal window, documents."""
  n, blk = 1024, 128
  nb = n // blk
  causal = shapes.Shape(1, n, n, 1, 1, 64, True, "x")
  assert masking.visible_fraction(causal) == (n * (n + 1) / 2) / n ** 2
  assert masking.skipped_block_fraction(causal, blk, blk, True) == 1 - (nb + 1) / 2 / nb
  w = 256  # query i sees keys i - 256 ... i
  window = shapes.Shape(1, n, n, 1, 1, 64, True, "x", window=w)
  assert masking.visible_fraction(window) == ((w + 1) * n - w * (w + 1) / 2) / n ** 2
  # Query block b (queries 128b ... 128b + 127) reaches back to key 128b - 256: blocks b - 2 ... b.
  computed = sum(min(b, w // blk) + 1 for b in range(nb))
  assert masking.skipped_block_fraction(window, blk, blk, False) == 1 - computed / nb ** 2
  doc = 256
  docs = shapes.Shape(1, n, n, 1, 1, 64, True, "x", segment_len=doc)
  assert masking.visible_fraction(docs) == (n // doc) * (doc * (doc + 1) / 2) / n ** 2
  per_doc = doc // blk
  in_docs = (n // doc) * per_doc * (per_doc + 1) / 2
  assert masking.skipped_block_fraction(docs, blk, blk, True) == 1 - in_docs / nb ** 2
  assert masking.skipped_block_fraction(docs, blk, blk, False) == \
      masking.skipped_block_fraction(causal, blk, blk, False)  # no segment skipping: causal only
  fields = masking.masking_fields("jax_cudnn", docs)
  assert fields["dense_mask"] and fields["skipped_block_fraction"] is None
  assert not masking.masking_fields("pallas_attn:mosaic_gpu", docs)["dense_mask"]
  with pytest.raises(ValueError, match="segment_len"):
    shapes.Shape(1, 8, 16, 1, 1, 64, False, "x", segment_len=4)


def test_masked_paths_match_the_reference():
  """The masked family's CPU variant: pallas_attn with local_window_size / segment_ids (the
  interpreter at the smallest size), jax.nn's xla with a window / a dense document mask, each
  against the float32 reference (a dense mask); and the report's masked table."""
  impl_list = [impls.get(n, "cpu") for n in impls.DEFAULT_NAMES["cpu"]]
  rows = []
  cfg = sweep.SweepConfig(timing=timing.TimingConfig(warmup=1, repeats=1, max_calls=1))
  sweep.run_sweep(shapes.masked_tiny(), impl_list, cfg, rows.append)
  ran = set()
  for row in rows:
    check_schema(row)
    assert row["window"] is not None or row["segment_len"] is not None
    assert 0 < row["visible_fraction"] < 1
    if row["error"] is None:
      assert row["max_rel_err"] is not None and row["max_rel_err"] < MAX_REL_ERR, row
      ran.add((row["implementation"], row["segment_len"] is not None))
    else:
      assert row["implementation"] == "pallas_attn:mosaic_gpu" and row["interpret"], row
    assert row["dense_mask"] == (row["implementation"] == "jax_xla"
                                 and row["segment_len"] is not None)
  for name in PORTABLE:
    assert {(name, False), (name, True)} <= ran
  assert any(r["implementation"] == "pallas_attn:mosaic_gpu" for r in rows)
  text = report.summary(rows)
  assert "masked paths" in text and "win128" in text and "doc128" in text


def test_max_seq_search_stops_the_dense_path_first():
  """Compile-only, against a small limit: the dense path's N x N scores exceed it first."""
  cfg = sweep.SweepConfig(passes=("fwd",))
  largest = {}
  for name in ("pallas_attn:blocked_jax", "jax_xla"):
    rows = []
    sweep.max_seq_rows(impls.get(name, "cpu"), [512, 1024, 2048], cfg, execute=False,
                       memory_limit=64 * 2**20, emit=rows.append)
    for row in rows:
      check_schema(dict(row, ms=1.0, tflops=1.0) if row["error"] is None else row)
      assert row["kind"] == "max_seq"
    largest[name] = max([r["seq_q"] for r in rows if r["error"] is None], default=0)
    if name == "jax_xla":
      assert rows[-1]["error_kind"] == "oom"
  assert largest["pallas_attn:blocked_jax"] > largest["jax_xla"]


def test_flop_formula():
  shape = shapes.Shape(2, 1024, 1024, 16, 16, 128, False, "fa")
  assert timing.attention_flops(shape, "fwd") == 4 * 2 * 16 * 1024 * 1024 * 128
  causal = shapes.Shape(2, 1024, 1024, 16, 16, 128, True, "fa")
  assert timing.attention_flops(causal, "fwd_bwd") == 3.5 * timing.attention_flops(shape, "fwd") / 2


def test_default_results_file_names_the_device():
  assert run.default_out("cpu", "cpu").name == "cpu.jsonl"
  assert run.default_out("NVIDIA H200", "gpu").name == "h200.jsonl"
  assert run.default_out("NVIDIA H100 80GB HBM3", "gpu").name == "h100_80gb_hbm3.jsonl"


def test_presets_follow_the_papers_sweep():
  fa = shapes.preset("fa")
  assert len(fa) == 36
  assert all(s.batch * s.seq_q == 16384 and s.heads_q * s.head_dim == 2048 for s in fa)
  full = shapes.preset("full")
  assert {s.family for s in full} == {"fa", "long", "gqa", "decode"}
  assert len(full) == len(set(full))
  with pytest.raises(ValueError, match="multiple of heads_kv"):
    shapes.Shape(1, 8, 8, 3, 2, 64, False, "x")


@pytest.mark.parametrize("name", ["cpu.jsonl", "h200.jsonl"])
def test_committed_results_follow_the_schema(name):
  rows = report.load(ROOT / "benchmarks" / "results" / name)
  if not rows:
    pytest.skip(f"no committed {name}")
  for row in rows:
    if row["kind"] in ("attention", "max_seq"):
      check_schema(dict(row, ms=1.0, tflops=1.0) if row["kind"] == "max_seq" else row)
  assert "TFLOP/s" in report.summary(rows) or "GFLOP/s" in report.summary(rows)  # old rows too


def test_notebook_matches_its_generator():
  nbformat = pytest.importorskip("nbformat")
  from benchmarks import make_notebook  # pylint: disable=import-outside-toplevel
  committed = nbformat.read(make_notebook.NOTEBOOK, as_version=4)
  built = make_notebook.build()
  assert [(c.cell_type, c.source) for c in committed.cells] == \
      [(c.cell_type, c.source) for c in built.cells], \
      "notebooks/benchmarks.ipynb is stale: run python -m benchmarks.make_notebook --execute"


def test_notebook_runs_in_its_small_cpu_mode():
  pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  from benchmarks import make_notebook  # pylint: disable=import-outside-toplevel
  from benchmarks import nbexec  # pylint: disable=import-outside-toplevel
  nb = make_notebook.build()
  nbexec.execute(nb, cwd=make_notebook.NOTEBOOK.parent,
                 env={"PALLAS_ATTN_NOTEBOOK_SMALL": "1", "PALLAS_ATTN_NOTEBOOK_RERUN": "0"},
                 timeout=120)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert sum("image/png" in o.get("data", {}) for o in outputs) >= 5
  text = "".join(o.get("text", "") for o in outputs)
  assert "rows from small.jsonl" in text and "max err fwd" in text


def test_ring_benchmark_cpu_smoke(tmp_path):
  """benchmarks.ring in its CPU mode (simulated devices, the portable path): every variant is
  timed, and the summary derives speedup, efficiency and overlap from them."""
  from benchmarks import ring  # pylint: disable=import-outside-toplevel
  out = tmp_path / "ring.jsonl"
  rows = ring.main(["--cpu-smoke", "--devices", "1,2", "--passes", "fwd", "--quiet",
                    "--out", str(out)])
  assert [json.loads(line) for line in out.read_text().splitlines()] == rows
  timed = [r for r in rows if r["kind"] == "ring"]
  assert {(r["devices"], r["variant"]) for r in timed} == {
      (1, "single"), (1, "ring"), (2, "ring"), (2, "compute_only"), (2, "comm_only")}
  for r in timed:
    assert r["error"] is None and r["ms"] > 0, r
  summary = {r["devices"]: r for r in rows if r["kind"] == "ring_summary"}
  assert summary[2]["speedup"] > 0 and summary[2]["scaling_efficiency"] > 0
  assert summary[2]["exposed_comm_ms"] is not None
  assert summary[2]["overlap"] is None or 0.0 <= summary[2]["overlap"] <= 1.0


def test_time_interleaved_rotates_the_order_and_keeps_each_functions_calls():
  """Each round runs one repeat of every function, starting one later each round; a function's
  calls per repeat come from its own warm-up (a slow one gets fewer); each gets `repeats`
  repeats and the median of them."""
  log = []

  def recorder(name, seconds):
    def fn(x):
      log.append(name)
      time.sleep(seconds)
      return x
    return fn

  x = jnp.ones(())
  # (A call of the fast ones must stay under target / max_calls = 50 ms, even on a loaded CI
  # machine: a 5 ms margin failed there once.)
  cfg = timing.TimingConfig(warmup=1, repeats=3, max_calls=4, target_repeat_s=0.2)
  fast, slow, third = recorder("a", 0.0), recorder("b", 0.3), recorder("c", 0.0)
  timings = timing.time_interleaved([(fast, (x,)), (slow, (x,)), (third, (x,))], cfg)
  assert [t.calls for t in timings] == [4, 1, 4]
  assert [len(t.repeat_ms) for t in timings] == [3, 3, 3]
  assert timings[1].ms >= 300 > timings[0].ms
  timed = log[3:]  # after one warm-up call each
  starts, i = [], 0
  for _ in range(3):  # three rounds: a run of calls per function, in a rotated order
    starts.append(timed[i])
    for _ in range(3):
      name = timed[i]
      i += {"a": 4, "b": 1, "c": 4}[name]
  assert starts == ["a", "b", "c"] and i == len(timed)


# ---- benchmarks/tune.py: kernel config variants ----------------------------------------------

def test_tune_smoke_in_the_interpreter(tmp_path):
  """The tuner's loop with the real kernels (interpreted): the default and one variant are
  built, checked against each other and timed; the file holds the returned rows."""
  out = tmp_path / "tune.jsonl"
  rows = tune.main(["--variants", "fwd_kv64", "--passes", "fwd", "--out", str(out), "--quiet",
                    "--compile-workers", "1"])
  assert [json.loads(line) for line in out.read_text().splitlines()] == rows
  by_variant = {r["variant"]: r for r in rows}
  assert set(by_variant) == {"default", "fwd_kv64", tune.DEFAULT_AGAIN}
  again = by_variant[tune.DEFAULT_AGAIN]
  assert again["error"] is None and again["max_rel_err_vs_default"] == 0.0
  variant = by_variant["fwd_kv64"]
  assert variant["error"] is None and variant["ms"] > 0 and variant["ratio_to_default"] > 0
  assert 0 <= variant["max_rel_err_vs_default"] < MAX_REL_ERR
  assert variant["configs"]["fwd"]["block_kv"] == 64
  assert by_variant["default"]["configs"]["fwd"]["block_kv"] == 128


def _fake_kernels(monkeypatch, wrong: dict):
  """tune.attend_fn replaced by the dense reference (fast on the CPU), times `wrong[variant]`."""
  def attend_fn(name, head_dim, interpret):
    del interpret
    def attend(q, k, v, *, is_causal, window=None, segment_len=None):
      spec = pallas_attn.MaskSpec(is_causal=is_causal)
      out, _ = pallas_attn.reference_attention(q, k, v, spec=spec, scale=head_dim ** -0.5)
      return out * wrong.get(name, 1.0)
    return attend
  monkeypatch.setattr(tune, "attend_fn", attend_fn)


def test_tune_refuses_wrong_variants_and_does_not_time_them(monkeypatch):
  _fake_kernels(monkeypatch, {"fwd_kv64": 1.1, "dq_kv128": float("nan")})
  cfg = tune.TuneConfig(variants=("default", "fwd_kv64", "dq_kv128", "fwd_kv128"),
                        timing=timing.TimingConfig(warmup=1, repeats=1, max_calls=1))
  rows = []
  tune.run([shapes.Shape(1, 64, 64, 2, 2, 64, True, "cpu")], cfg, rows.append, interpret=True)
  got = {(r["variant"], r["pass"]): r for r in rows}
  for pass_ in timing.PASSES:
    assert got[("default", pass_)]["error"] is None and got[("default", pass_)]["ms"] > 0
    wrong = got[("fwd_kv64", pass_)]
    assert wrong["error_kind"] == "wrong" and wrong["ms"] is None, wrong
    assert wrong["max_rel_err_vs_default"] > 0.05
    assert got[("fwd_kv128", pass_)]["error_kind"] == "same"  # the default's configs at d64
    assert got[(tune.DEFAULT_AGAIN, pass_)]["ratio_to_default"] > 0
  assert got[("dq_kv128", "fwd")]["error_kind"] == "same"  # dQ does not run in the forward
  nan_row = got[("dq_kv128", "fwd_bwd")]
  assert nan_row["error_kind"] == "wrong" and "non-finite" in nan_row["error"]
  text = tune.table(rows)
  assert "WRONG" in text and "fwd_kv64" in text


def test_tune_budget_skips_the_rest_and_says_so(monkeypatch):
  _fake_kernels(monkeypatch, {})
  cfg = tune.TuneConfig(variants=("default", "fwd_kv64"), passes=("fwd",), budget_s=1e-9,
                        timing=timing.TimingConfig(warmup=1, repeats=1, max_calls=1))
  rows = []
  tune.run(shapes.preset("tune_smoke"), cfg, rows.append, interpret=True)
  assert rows and all(r["error_kind"] == "skipped" for r in rows)
  assert "--budget-s" in rows[0]["error"] and "skip" in tune.table(rows)


def test_tune_variants_are_valid_or_say_why_not():
  """Every variant builds at every head_dim, or names why it is not measured; the ones issue #4
  asks for fit where expected (block_kv 192 forward at head_dim 128)."""
  for head_dim in config_lib.SUPPORTED_HEAD_DIMS:
    shape = shapes.Shape(1, 4096, 4096, 2048 // head_dim, 2048 // head_dim, head_dim, True, "fa")
    for name in tune.VARIANTS:
      why = tune.why_not(name, shape, jnp.bfloat16)
      assert why is None or why.startswith(("does not fit", "same configs", "does not apply")), (
          name, why)
  d128 = shapes.Shape(4, 4096, 4096, 16, 16, 128, True, "fa")
  for name in ("fwd_kv192", "fwd_kv64_3st", "fwd_overlap_3st", "dq_kv128", "dq_3st", "dkv_q128",
               "reverse_q", "tiles_first", "tiles_last", "fwd_persistent",
               "fwd_persistent_heavy_first", "fwd_persistent_fold_ro", "dkv_fused_dq",
               "dkv_dq_halves", "dkv_dq_halves_1st"):
    assert tune.why_not(name, d128, jnp.bfloat16) is None, name
  assert tune.why_not("fwd_kv256", d128, jnp.bfloat16).startswith("does not fit")
  d64 = shapes.Shape(4, 4096, 4096, 32, 32, 64, False, "fa")
  for name in ("dkv_whole_dq", "dkv_row_halves_lockstep", "dkv_row_halves_late_regs232"):
    assert tune.why_not(name, d64, jnp.bfloat16) is None, name
    assert tune.why_not(name, d128, jnp.bfloat16).startswith("does not apply"), name


# ---- benchmarks/bwd_parts.py and fused_dq_probe.py: the backward taken apart ------------------

def test_bwd_parts_agree_and_are_timed_in_the_interpreter():
  """The parts are the real kernels: the separate dQ and dK/dV kernels, the fused one and the
  table's backward give the same gradients (interpreted, 128 rows of head_dim 128), and every
  part gets a timed row; the fit of two lengths names each part."""
  q, k, v, d_out = bwd_parts.inputs(1, 128, 1, 128, jnp.bfloat16, seed=3)
  lengths = jnp.full((1,), 128, jnp.int32)
  out = jax.nn.dot_product_attention(q, k, v).astype(q.dtype)
  lse = jax.nn.logsumexp(jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(128),
                         axis=-1)
  fns = bwd_parts.parts(128, is_causal=False, interpret=True)
  args = (q, k, v, d_out, out, lse, lengths)
  dq, (dk, dv) = fns["dq"](*args), fns["dkv"](*args)
  for grads in (fns["dqkv"](*args), fns["backward"](*args)):
    for got, want in zip(grads, (dq, dk, dv)):
      assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))) <= (
          2e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))
  cfg = timing.TimingConfig(warmup=1, repeats=1, max_calls=1)
  rows = [row for seq in (128, 256) for row in bwd_parts.run_shape(128, seq, False, True, cfg,
                                                                    tokens=seq, hidden=128)]
  assert {row["part"] for row in rows} == set(fns) and all(row["ms"] > 0 for row in rows)
  fit = bwd_parts.fit(rows)
  assert all(f"| {part} |" in fit for part in fns)


def test_determinism_probe_counts_differing_bits():
  """`compare_runs` sees one flipped bit in one run of three; the probe runs the real kernels
  (interpreted, deterministic: nothing differs) and names its row."""
  a = np.arange(12, dtype=np.float32).reshape(3, 4) + 1.0
  b = a.copy()
  b[1, 2] = np.nextafter(b[1, 2], np.float32(np.inf))
  stats = determinism_probe.compare_runs([(a, a, a), (a, a, a), (b, a, a)])
  assert stats["dq"]["differing_runs"] == 1 and stats["dq"]["max_fraction"] == 1 / 12
  assert stats["dq"]["max_rel_diff"] > 0
  assert stats["dk"] == dict(differing_runs=0, max_fraction=0.0, max_rel_diff=0.0)
  row = determinism_probe.probe_shape(64, 128, False, True, runs=2, interpret=True, tokens=128,
                                      hidden=64)
  assert (row["batch"], row["heads"], row["deterministic_backward"]) == (1, 1, True)
  assert all(row[g]["differing_runs"] == 0 for g in determinism_probe.GRADS)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_fused_dq_probes_lower_for_cuda_and_put_common_back(head_dim):
  """Every probe of every set lowers for CUDA (128 rows; at head_dim 256 the fused head split),
  and the functions it swaps into `common` while it traces are the originals again after."""
  from pallas_attn.mosaic_gpu import common
  originals = common.reduce_add, common.matmul_accs_then_product
  q = jax.ShapeDtypeStruct((1, 128, 1, head_dim), jnp.bfloat16)
  stats = jax.ShapeDtypeStruct((1, 1, 128), jnp.float32)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  args = (q, q, q, q, stats, stats, lengths)
  for name in ("reduce", "parts", "knobs"):
    probes = fused_dq_probe.probes(name, head_dim)
    assert all(cfg.head_split == (head_dim == 256) for _, cfg, _ in probes.values())
    for probe in probes.values():
      text = fused_dq_probe.lowered(*probe, args, pallas_attn.MaskSpec(),
                                    platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text
  assert (common.reduce_add, common.matmul_accs_then_product) == originals


def test_tune_parses_ptxas_output():
  text = """ptxas info    : Compiling entry function 'mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_gpu_kernel
    0 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function 'other' for 'sm_90a'
ptxas info    : Used 90 registers"""
  assert tune.parse_ptxas(text) == [
      {"entry": "mosaic_gpu_kernel", "registers": 168, "spill_stores": 24, "spill_loads": 16},
      {"entry": "other", "registers": 90, "spill_stores": None, "spill_loads": None}]


def test_tune_times_nothing_unchecked_when_the_default_fails(monkeypatch):
  _fake_kernels(monkeypatch, {"default": float("nan")})
  cfg = tune.TuneConfig(variants=("default", "fwd_kv64"), passes=("fwd",),
                        timing=timing.TimingConfig(warmup=1, repeats=1, max_calls=1))
  rows = []
  tune.run(shapes.preset("tune_smoke"), cfg, rows.append, interpret=True)
  assert rows and all(r["ms"] is None for r in rows), rows
  by_variant = {r["variant"]: r for r in rows}
  assert by_variant["default"]["error_kind"] == "wrong"
  assert "not checked" in by_variant["fwd_kv64"]["error"]


# ---- benchmarks/precompile.py: the compile pre-pass in worker processes ----------------------

SMALL_SWEEP = ["--quick", "--impls", "blocked_jax,jax_xla", "--passes", "fwd", "--quiet",
               "--repeats", "1", "--max-calls", "2", "--ceiling-size", "0",
               "--no-max-seq-search"]


def _measured(rows) -> dict:
  return {report.measurement_key(r): r for r in rows if r["kind"] == "attention"}


@pytest.mark.parametrize("pipeline", ["--compile-pipeline", "--no-compile-pipeline"])
def test_compile_prepass_fills_the_cache_and_the_sweep_loads_it(tmp_path, pipeline):
  """Two worker processes build the sweep's compiles into the persistent cache; the timing
  process then loads every call from it and measures the same rows as a run without them."""
  cache = tmp_path / "cache"
  plain = run.main(SMALL_SWEEP + ["--out", str(tmp_path / "plain.jsonl"),
                                  "--compile-processes", "0"])
  rows = run.main(SMALL_SWEEP + ["--out", str(tmp_path / "prepass.jsonl"), pipeline,
                                 "--compile-processes", "2", "--compile-cache", str(cache)])
  # Each of 3 shapes: 2 implementations and the float32 reference, built by the workers.
  assert compile_cache.entries(cache) >= 9
  got, want = _measured(rows), _measured(plain)
  assert set(got) == set(want) and len(got) == 6
  for key, row in got.items():
    check_schema(row)
    assert row["error"] is None, row
    # The workers' executables, loaded as they are: no tracing, lowering or compiling here.
    assert row["handed_over"] is True and row["lower_s"] == 0.0, row
    assert row["measure_s"] > 0
    # The same inputs through the same executable (built in another process): the same error.
    assert row["max_rel_err"] == pytest.approx(want[key]["max_rel_err"], rel=1e-6), key
  assert all(r["cache_hit"] is None for r in want.values())  # no cache without --compile-cache
  assert not any(r["handed_over"] for r in want.values())


def test_compile_prepass_survives_its_workers_failing(tmp_path):
  """A worker that dies builds nothing and is reported; the pre-pass itself does not raise."""
  done = precompile.run_prepass(["--shapes", "no_such_preset"], 1, str(tmp_path), None, True)
  assert done.compiled == 0 and len(done.worker_failures) == 1
  assert "no_such_preset" in done.worker_failures[0]


def test_handed_over_executable_runs_like_the_built_one(tmp_path):
  """An executable serialized in one place and loaded in another computes the same; a file that
  does not load falls back to building."""
  fn = jax.jit(lambda x: jnp.sin(x) * 2.0)
  x = jnp.arange(8, dtype=jnp.float32)
  path = precompile.executable_file(tmp_path, "sin")
  precompile.save_executable(path, fn.lower(x).compile())
  np.testing.assert_array_equal(precompile.load_executable(path)(x), fn(x))
  broken = precompile.executable_file(tmp_path, "broken")
  broken.write_bytes(b"not a pickle")
  built = sweep._handed_over_or(lambda: "built", broken, is_build=False)
  assert built == "built"
  missing = sweep._handed_over_or(lambda: "built", tmp_path / "none.pkl", is_build=False)
  assert missing == "built"


def test_compile_workers_claim_each_compile_once(tmp_path):
  built = []
  jobs = [(str(i), lambda i=i: built.append(i)) for i in range(3)]
  jobs.append(("fails", lambda: 1 / 0))
  precompile.work(jobs, tmp_path, None)
  precompile.work(jobs, tmp_path, None)  # a second worker finds everything claimed
  assert built == [0, 1, 2]
  reports = [json.loads(line) for p in tmp_path.glob("report-*.jsonl")
             for line in p.read_text().splitlines()]
  assert [r["job"] for r in reports] == ["0", "1", "2", "fails"]
  assert "ZeroDivisionError" in reports[-1]["error"]


def _job(label, device=False, cost=1.0, mem=0, index=0):
  return sweep.Job(label, lambda: label, device, cost, mem, index)


def test_device_compiles_come_first_longest_first_and_kernels_in_plan_order():
  jobs = [_job("mosaic a", index=0), _job("xla a", True, 2.0, index=0),
          _job("tokamax a", index=0), _job("xla b", True, 9.0, index=1),
          _job("ref b", True, 2.0, index=1), _job("mosaic b", index=1)]
  labels = lambda js: [j[0] for j in js]
  assert labels(precompile.order_jobs(jobs, "device")) == ["xla b", "xla a", "ref b"]
  assert labels(precompile.order_jobs(jobs, "kernel")) == ["mosaic a", "tokamax a", "mosaic b"]
  assert labels(precompile.order_jobs(jobs, None)) == ["xla b", "xla a", "ref b", "mosaic a",
                                                        "tokamax a", "mosaic b"]
  # bare (label, thunk) pairs: no device compiles, plan order
  assert labels(precompile.order_jobs([("x", None), ("y", None)], None)) == ["x", "y"]


def test_job_estimates_mark_the_autotuning_compiles_and_grow_with_the_shape():
  small, big = shapes.preset("fa")[0], shapes.preset("long")[-1]
  assert small.score_elements < big.score_elements
  cfg = sweep.SweepConfig(passes=("fwd", "fwd_bwd"), check_max_scores=2 ** 29)
  impl_list = [impls.get(n, "gpu") for n in ("jax_xla", "pallas_attn:mosaic_gpu")]
  jobs = sweep.compile_jobs(sweep.plan([small, big], impl_list, cfg, "gpu"), cfg)
  by = {j.label: j for j in jobs}
  assert all(j.device == (j.label.split()[0] in sweep.DEVICE_COMPILES) for j in jobs)
  assert any(j.label.startswith("reference_f32") for j in jobs)  # the small shape is checked
  # the float32 reference is built without autotuning: a host-only compile
  assert not any(j.device for j in jobs if j.label.startswith("reference_f32"))
  xla_small = by[sweep.job_label("jax_xla", "fwd_bwd", small)]
  xla_big = by[sweep.job_label("jax_xla", "fwd_bwd", big)]
  assert xla_big.cost_s > xla_small.cost_s and xla_big.mem_bytes > xla_small.mem_bytes > 0
  assert by[sweep.job_label("pallas_attn:mosaic_gpu", "fwd", big)].mem_bytes == 0
  assert [j.shape_index for j in jobs] == sorted(j.shape_index for j in jobs)


def test_memory_ledger_admits_what_fits_and_a_big_one_alone(tmp_path):
  path = tmp_path / "ledger.json"
  a, b = precompile.MemoryLedger(path, 10), precompile.MemoryLedger(path, 10)
  b.key = "other"
  assert a.try_hold(6) and a.held() == 6
  assert not b.try_hold(5)  # 6 + 5 > 10
  assert b.try_hold(4) and a.held() == 10
  b.release()
  a.release()
  assert a.held() == 0
  assert b.try_hold(50)  # too big for the budget: admitted when nothing else is held
  assert not a.try_hold(1) and a.try_hold(0)  # nothing needed: always admitted
  b.release()


class _Proc:
  def __init__(self, alive):
    self.alive = alive

  def poll(self):
    return None if self.alive else 0


def test_pipeline_fetch_loads_a_workers_executable_builds_an_untaken_one_and_waits(tmp_path):
  """The timing process's side of the pipelined pre-pass, without processes: a compile a worker
  finished is loaded; one no worker took is built here (and claimed, so no worker builds it); one
  a worker failed, or that a dead worker had taken, is built here."""
  executables = tmp_path / "exe"
  executables.mkdir()
  pipe = precompile.Pipeline(["--quick"], 1, str(tmp_path / "cache"), None, True,
                             str(executables))
  try:
    pipe.wait_device_phase()  # no device-phase workers: done at once
    fn = jax.jit(lambda x: x + 1.0)
    x = jnp.arange(4, dtype=jnp.float32)
    # done by a worker, handed over
    (pipe.workdir / "claims" / precompile.job_key("done one")).touch()
    precompile.save_executable(precompile.executable_file(executables, "done one"),
                               fn.lower(x).compile())
    (pipe.workdir / "done" / precompile.job_key("done one")).touch()
    got = pipe.fetch("done one", lambda: "built")
    assert got.handed_over and np.allclose(got.executable(x), x + 1.0)
    # nobody took it: built here, and claimed
    assert pipe.fetch("untaken", lambda: "built") == "built" and pipe.self_built == 1
    assert (pipe.workdir / "claims" / precompile.job_key("untaken")).exists()
    # a worker failed it (done, nothing handed over)
    (pipe.workdir / "claims" / precompile.job_key("failed")).touch()
    (pipe.workdir / "done" / precompile.job_key("failed")).touch()
    assert pipe.fetch("failed", lambda: "built", is_build=False) == "built"
    # taken by a worker that died before finishing it
    (pipe.workdir / "claims" / precompile.job_key("orphan")).touch()
    pipe.kernel_procs = [_Proc(alive=False)]
    assert pipe.fetch("orphan", lambda: "built") == "built"
    # taken by a live worker that finishes it while the timing process waits
    (pipe.workdir / "claims" / precompile.job_key("late")).touch()
    pipe.kernel_procs = [_Proc(alive=True)]
    import threading
    threading.Timer(0.3, lambda: (pipe.workdir / "done" / precompile.job_key("late")).touch()
                    ).start()
    assert pipe.fetch("late", lambda: "built") == "built"  # done, nothing handed over
    assert pipe.waited_s >= 0.25
  finally:
    pipe.kernel_procs = []
    summary = pipe.finish()
  assert summary.self_built == 1 and "pipelined" in summary.summary()


def test_compile_workers_take_device_compiles_that_fit_the_ledger(tmp_path):
  """A device-phase worker skips a compile whose memory does not fit beside what others hold and
  takes a smaller one; kernel compiles are not its business."""
  built = []
  jobs = [sweep.Job("big", lambda: built.append("big"), True, 9.0, 8),
          sweep.Job("small", lambda: built.append("small"), True, 1.0, 2),
          sweep.Job("kernel", lambda: built.append("kernel"), False, 1.0, 0)]
  ledger = precompile.MemoryLedger(tmp_path / "ledger.json", 10)
  other = precompile.MemoryLedger(tmp_path / "ledger.json", 10)
  other.key = "someone else"
  assert other.try_hold(5)
  import threading
  threading.Timer(0.5, other.release).start()
  precompile.work(jobs, tmp_path, None, None, "device", ledger)
  assert built == ["small", "big"] and ledger.held() == 0
  assert sorted(p.name for p in (tmp_path / "done").iterdir()) == sorted(
      precompile.job_key(label) for label in ("big", "small"))


def test_device_phase_worker_command_parses():
  """The device-phase worker's flags parse (an H200-sized card once gave a float ledger size,
  which every worker rejected at start, so the autotuning compiles all fell to the timing
  process)."""
  budget = precompile.ledger_budget(150_754_820_096, 15)
  assert isinstance(budget, int) and 2 ** 30 <= budget < 150_754_820_096
  cmd = precompile._worker_cmd(["--shapes", "tiny"], pathlib.Path("/tmp/w"), "/tmp/c", 12.5,
                               "/tmp/e", phase="device", ledger_bytes=budget)
  args = run.parse_args(cmd[cmd.index("benchmarks.run") + 1:])
  assert args.compile_ledger_bytes == budget and args.compile_phase == "device"


def test_out_of_memory_searches_share_the_budget():
  """Each (implementation, pass) search gets an equal share of the time left, unused time
  passing on to the later ones: a slow ladder cannot starve the peers searched after it."""
  assert run.search_share(420.0, 10) == pytest.approx(42.0)
  assert run.search_share(100.0, 1) == pytest.approx(100.0)  # the last search gets the rest
  assert run.search_share(-5.0, 3) == 1.0  # past the budget: one second (the search skips)

# ---- the pipeline's device phase, capped (session 6) ----------------------------------------

H200_BYTES = 150_754_820_096


class _FakePopen:
  """A worker process that never starts: its command line and environment are kept to read."""

  def __init__(self, cmd, env=None, **_):
    self.cmd, self.env, self.returncode = cmd, env, None
    self.args = run.parse_args(cmd[cmd.index("benchmarks.run") + 1:])

  def poll(self):
    return self.returncode

  def exit(self, code=0):
    self.returncode = code

  def terminate(self):
    if self.returncode is None:
      self.returncode = -15

  kill = terminate

  def wait(self, timeout=None):  # pylint: disable=unused-argument
    return self.returncode


def _fake_h200(monkeypatch):
  """An H200 host to the pipeline (a GPU of that size), its workers never started."""
  monkeypatch.setattr(precompile, "gpu_visible", lambda: True)
  monkeypatch.setattr(precompile, "gpu_memory_bytes", lambda: H200_BYTES)
  monkeypatch.setattr(precompile.subprocess, "Popen", _FakePopen)
  monkeypatch.delenv("PALLAS_ATTN_PREPASS_ALLOCATOR", raising=False)


def test_pipeline_caps_device_workers_and_starts_kernel_workers_beside_them(tmp_path,
                                                                             monkeypatch):
  """15 workers with 3 in the device phase: 3 device-phase workers (the ledger, the compile
  budget's deadline) and 12 kernel-phase workers at once (the time budget's deadline); each
  device-phase worker that exits is replaced by a kernel-phase one; the summary says so."""
  import time
  _fake_h200(monkeypatch)
  begin = time.time()
  pipe = precompile.Pipeline(["--shapes", "tiny"], 15, str(tmp_path / "cache"), 270.0, True,
                             str(tmp_path / "exe"), device_processes=3, kernel_budget_s=540.0)
  try:
    pipe.start_device_phase()
    device, kernel = list(pipe.device_procs), list(pipe.kernel_procs)
    assert [p.args.compile_phase for p in device] == ["device"] * 3
    assert [p.args.compile_phase for p in kernel] == ["kernel"] * 12
    # device phase: the compile budget, the ledger for every worker's context on the card
    for p in device:
      assert begin + 269 < p.args.compile_deadline < begin + 275
      assert p.args.compile_ledger_bytes == precompile.ledger_budget(H200_BYTES, 15)
      assert p.env["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"
    # kernel phase: the whole time budget, no ledger, a tiny memory share
    for p in kernel:
      assert begin + 539 < p.args.compile_deadline < begin + 545
      assert p.args.compile_ledger_bytes == 0
      assert p.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.02"
    # The device phase lasts until every device-phase worker has exited, each replaced.
    for p in device:
      p.exit()
    pipe.wait_device_phase()
    assert len(pipe.device_procs) == 3 and len(pipe.kernel_procs) == 15
    assert all(p.args.compile_phase == "kernel" and p.args.compile_deadline > begin + 539
               for p in pipe.kernel_procs[12:])
    # what the workers reported: one device-phase compile, two kernel-phase ones (one of them
    # before timing started), one kernel-phase failure
    now = time.time()
    reports = [{"job": "jax_xla fwd a", "s": 4.0, "start": now - 10, "phase": "device"},
               {"job": "mosaic fwd a", "s": 1.0, "start": now - 10, "phase": "kernel"},
               {"job": "mosaic fwd b", "s": 1.0, "start": now + 5, "phase": "kernel"},
               {"job": "cudnn fwd b", "s": 1.0, "start": now - 10, "phase": "kernel",
                "error": "boom"}]
    (pipe.workdir / "report-1.jsonl").write_text("".join(
        json.dumps({"error": None, "handed_over": True, **r}) + "\n" for r in reports))
  finally:
    done = pipe.finish()
  assert all(p.returncode == -15 for p in pipe.kernel_procs)  # finish() stops them
  assert (done.device_processes, done.kernel_built, done.kernel_built_early,
          done.kernel_failed) == (3, 2, 1, 1)
  text = done.summary()
  assert "3 device-phase workers" in text and "12 kernel-phase workers" in text
  assert "kernel-phase workers built 2 calls (1 of them before timing started, 1 failed)" in text


def test_pipeline_phases_at_start():
  assert precompile.phases_at_start(15, 3) == ["device"] * 3 + ["kernel"] * 12
  assert precompile.phases_at_start(2, 3) == ["device"] * 2  # never more than the workers
  assert precompile.phases_at_start(4, 0) == ["kernel"] * 4
  # 3 on a GPU (one GPU's autotuning does not scale with processes); every worker on the CPU
  assert precompile.default_device_processes(True, 15) == 3
  assert precompile.default_device_processes(True, 2) == 2
  assert precompile.default_device_processes(False, 2) == 2


def test_device_compile_processes_flag_and_default():
  args = run.parse_args([])
  assert args.device_compile_processes is None
  assert run._device_processes(args, 15, on_gpu=True) == 3
  assert run._device_processes(args, 2, on_gpu=False) == 2
  args = run.parse_args(["--device-compile-processes", "5"])
  assert args.device_compile_processes == 5
  assert run._device_processes(args, 15, on_gpu=True) == 5
  assert run._device_processes(args, 4, on_gpu=True) == 4  # at most the workers


class _StopHere(Exception):
  pass


def test_run_gives_the_pipeline_the_device_cap_and_both_deadlines(tmp_path, monkeypatch):
  """benchmarks.run makes the Pipeline with --device-compile-processes (3 by default on a GPU),
  the compile budget for the device phase and --time-budget for the kernel phase."""
  made = []

  class Recorder:
    def __init__(self, *args, **kwargs):
      made.append((args, kwargs))

    def start_device_phase(self):
      raise _StopHere

    def finish(self):
      pass

  monkeypatch.setattr(precompile, "Pipeline", Recorder)
  monkeypatch.setattr(precompile, "gpu_visible", lambda: True)
  common = ["--shapes", "tiny", "--compile-processes", "15", "--time-budget", "540", "--quiet",
            "--out", str(tmp_path / "out.jsonl"), "--compile-cache", str(tmp_path / "cache")]
  for extra, want in (([], 3), (["--device-compile-processes", "5"], 5)):
    with pytest.raises(_StopHere):
      run.main(common + extra)
    args, kwargs = made.pop()
    assert args[1] == 15 and args[3] == 270  # processes, the compile budget (half)
    assert kwargs["device_processes"] == want and kwargs["kernel_budget_s"] == 540


def test_device_and_kernel_workers_split_the_compiles_each_built_once(tmp_path):
  """A kernel-phase worker started beside the device-phase ones takes only the kernel compiles,
  in plan order; the device-phase worker only the device ones; nothing is built twice."""
  built = []
  jobs = [sweep.Job(label, lambda label=label: built.append(label), device, cost, 0, index)
          for label, device, cost, index in (("mosaic a", False, 1.0, 0), ("xla a", True, 2.0, 0),
                                             ("tokamax a", False, 1.0, 0), ("xla b", True, 9.0, 1),
                                             ("mosaic b", False, 1.0, 1))]
  precompile.work(jobs, tmp_path, None, None, "kernel")
  assert built == ["mosaic a", "tokamax a", "mosaic b"]
  precompile.work(jobs, tmp_path, None, None, "device")
  precompile.work(jobs, tmp_path, None, None, "kernel")  # a second kernel worker: nothing left
  assert built == ["mosaic a", "tokamax a", "mosaic b", "xla b", "xla a"]
  reports = [json.loads(line) for p in tmp_path.glob("report-*.jsonl")
             for line in p.read_text().splitlines()]
  assert {r["job"]: r["phase"] for r in reports} == {
      "mosaic a": "kernel", "tokamax a": "kernel", "mosaic b": "kernel", "xla b": "device",
      "xla a": "device"}


# ---- benchmarks/overhead_probe.py: the delta pass and the last wave -----------------------------

def test_overhead_probe_delta_forms_agree_and_waves_count_ctas():
  keys = jax.random.split(jax.random.key(5), 2)
  d_out, out = (jax.random.normal(key, (2, 37, 3, 16), jnp.bfloat16) for key in keys)
  fns = overhead_probe._delta_variants()
  want = np.einsum("bthd,bthd->bht", np.asarray(d_out, np.float32), np.asarray(out, np.float32))
  for name, fn in fns.items():
    got = np.asarray(fn(d_out, out))
    if name == "read_both":
      np.testing.assert_allclose(got, np.asarray(d_out, np.float32).sum()
                                 + np.asarray(out, np.float32).sum(), rtol=1e-4)
      continue
    got = got if got.shape == want.shape else np.swapaxes(got, 1, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
  rows = overhead_probe.delta_rows(timing.TimingConfig(warmup=1, repeats=1), batch=1, seq=64,
                                   heads=2, head_dim=16)
  assert [r["variant"] for r in rows] == list(fns)
  assert all(r["ms"] > 0 and (r["max_rel_err"] is None or r["max_rel_err"] < 1e-6)
             for r in rows)
  # The wave shapes: 2048 CTAs of 128 rows fill 15.52 waves of 132 SMs; 4224 and 1980 fill them.
  ctas = [overhead_probe.wave_ctas(*shape) for shape in overhead_probe.WAVE_SHAPES]
  assert ctas == [2048, 4224, 1920, 1980]
  assert [c % overhead_probe.NUM_SMS == 0 for c in ctas] == [False, True, False, True]


def test_overhead_probe_wave_rows_time_each_impl_and_pass(monkeypatch):
  # The GPU's pair replaced by two paths that run here; one small shape.
  monkeypatch.setattr(overhead_probe, "WAVE_SHAPES", ((1, 200, 2),))
  monkeypatch.setattr(overhead_probe, "WAVE_IMPLS", ("pallas_attn:blocked_jax", "jax_xla"))
  rows = overhead_probe.wave_rows(timing.TimingConfig(warmup=1, repeats=1), head_dim=16)
  assert [(r["impl"], r["pass_"]) for r in rows] == [
      ("pallas_attn:blocked_jax", "fwd"), ("pallas_attn:blocked_jax", "fwd_bwd"),
      ("jax_xla", "fwd"), ("jax_xla", "fwd_bwd")]
  for r in rows:
    assert r["ctas"] == 2 * 2 and r["wave_efficiency"] == pytest.approx(4 / 132)
    flops = 4 * 2 * 200 * 200 * 16 * (1.0 if r["pass_"] == "fwd" else 3.5)
    assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)


def test_sink_descriptors_recomputes_each_descriptor_at_its_uses():
  """scripts/sink_descriptors.py: a descriptor made before a loop is removed there and made again,
  in a fresh register, in front of each instruction that reads it; other lines stay."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import sink_descriptors
  ptx = "\n".join([
      "\t.reg .b64 \t%rd<9>;",
      "\tor.b64 \t%rd5, %rd4, 4611686568183201792;",
      "\tadd.s64 \t%rd6, %rd4, 4611686568183201794;",
      "\tadd.s64 \t%rd7, %rd4, 16;",  # (a small constant: an address, not a descriptor)
      "$L__BB0_1:",
      "\twgmma {%r1}, %rd5, %rd6, p;",
      "\twgmma {%r1}, %rd5, %rd7, p;",
  ])
  text, descriptors, uses = sink_descriptors.sink(ptx)
  assert (descriptors, uses) == (2, 3)
  assert text.split("\n") == [
      "\t.reg .b64 \t%rd<12>;",
      "\tadd.s64 \t%rd7, %rd4, 16;",
      "$L__BB0_1:",
      "\tor.b64 \t%rd9, %rd4, 4611686568183201792;",
      "\tadd.s64 \t%rd10, %rd4, 4611686568183201794;",
      "\twgmma {%r1}, %rd9, %rd10, p;",
      "\tor.b64 \t%rd11, %rd4, 4611686568183201792;",
      "\twgmma {%r1}, %rd11, %rd7, p;",
  ]


# ---- benchmarks/dkv_schedule_model.py ------------------------------------------------------

def test_dkv_schedule_model_walks_every_step_once():
  """Every (query head, query block) a causal key tile sees is walked once, whatever the group
  parts; the list schedule ends at or past the mean load; the miss share is a share, and a
  cache too small for any reuse misses every step."""
  from benchmarks import dkv_schedule_model as model
  walks = {parts: model.cta_walks(512, 2, 8, 2, parts) for parts in (1, 2, 4)}
  for parts, w in walks.items():
    assert len(w) == 2 * 4 * 2 * parts  # batch x key tiles x kv heads x parts
    assert sorted(s for walk in w for s in walk) == sorted(s for walk in walks[1] for s in walk)
  assert max(len(w) for w in walks[4]) * 4 == max(len(w) for w in walks[1])
  assert model.makespan(walks[1], num_sms=3) >= 1.0
  assert 0.0 < model.miss_share(walks[2], num_sms=3) < 1.0
  assert model.miss_share(walks[2], num_sms=3, cache_bytes=0) == 1.0

