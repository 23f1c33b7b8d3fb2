"""Reads a results file (JSON lines) and prints its tables; the notebook uses the same functions.

  python -m benchmarks.report benchmarks/results/h200.jsonl

Tables: speed (per shape and pass, each implementation's TFLOP/s and its ratio to cuDNN, or to
jax's xla path where cuDNN did not run), memory (compiled temporaries), the out-of-memory search,
and a per-implementation summary of checks and failures.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from benchmarks.shapes import masking_suffix

SHORT = {
    "pallas_attn:mosaic_gpu": "mosaic_gpu",
    "pallas_attn:mosaic_gpu_mask_fn": "mgpu_mask_fn",
    "pallas_attn:mosaic_gpu_deterministic": "mgpu_determ",
    "pallas_attn:blocked_jax": "blocked_jax",
    "pallas_attn:reference": "reference",
    "jax_xla": "xla",
    "jax_cudnn": "cudnn",
    "tokamax_mosaic": "tok_mosaic",
    "tokamax_triton": "tok_triton",
}
ORDER = list(SHORT)
# window and segment_len (the masked shapes) are absent from older rows: read as None there.
SHAPE_KEYS = ("family", "batch", "seq_q", "seq_kv", "heads_q", "heads_kv", "head_dim", "causal",
              "window", "segment_len")
ERROR_LABEL = {"oom": "OOM", "unsupported": "unsup", "error": "error", "skipped": "skip",
               "wrong": "NaN"}


def load(path) -> list[dict]:
  """The rows of a results file ([] if it does not exist)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_rows(path, rows) -> None:
  """Append `rows` to the results file at `path` (JSON lines), the probes' --out."""
  with open(path, "a") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)


def measurement_key(row: dict) -> tuple:
  """What identifies a measurement: implementation, pass, dtype and shape."""
  return (row["implementation"], row["pass"], row["dtype"]) + _shape_key(row)


def attention_rows(rows, kind: str = "attention") -> list[dict]:
  """Rows of one kind; where a measurement was repeated (appended runs) the last one wins, unless
  the last one was skipped (a --resume run that ran out of time)."""
  latest = {}
  for row in rows:
    if row.get("kind", "attention") == kind:
      key = measurement_key(row)
      if row.get("error_kind") != "skipped" or key not in latest:
        latest[key] = row
  return list(latest.values())


def disturbed(rows, spread: float = 1.10) -> list[dict]:
  """Measured rows whose slowest repeat took over `spread` times their fastest (a repeat the
  device or the host was disturbed in); rows without `repeat_ms` (before session 13) are not
  judged."""
  return [r for r in rows if r.get("repeat_ms") and r.get("error") is None
          and max(r["repeat_ms"]) > spread * min(r["repeat_ms"])]


def done_keys(rows) -> frozenset:
  """Measurements that already have a result (anything but skipped): what --resume leaves out."""
  return frozenset(measurement_key(r) for r in rows
                   if r.get("kind", "attention") == "attention"
                   and r.get("error_kind") != "skipped")


def ceiling(rows) -> dict | None:
  found = [r for r in rows if r.get("kind") == "matmul_ceiling"]
  return found[-1] if found else None


def ok(row) -> bool:
  return row.get("error") is None and row.get("ms") is not None


def baseline_name(rows) -> str:
  """What speed ratios are taken against: cuDNN when it ran at all, else jax's xla path."""
  return "jax_cudnn" if any(ok(r) and r["implementation"] == "jax_cudnn" for r in rows) \
      else "jax_xla"


def impl_names(rows) -> list[str]:
  present = {r["implementation"] for r in rows}
  return [n for n in ORDER if n in present] + sorted(present - set(ORDER))


def shape_label(row) -> str:
  heads = (f"h{row['heads_q']}" if row["heads_q"] == row["heads_kv"]
           else f"h{row['heads_q']}/{row['heads_kv']}")
  seq = (f"s{row['seq_q']}" if row["seq_q"] == row["seq_kv"]
         else f"s{row['seq_q']}x{row['seq_kv']}")
  return (f"b{row['batch']} {seq} {heads} d{row['head_dim']}{' causal' if row['causal'] else ''}"
          + masking_suffix(row.get("window"), row.get("segment_len")))


def _shape_key(row):
  return tuple(row.get(k) for k in SHAPE_KEYS)


def _grouped(rows):
  """{(shape key, pass): {impl: row}} in first-seen order."""
  groups: dict = {}
  for row in rows:
    groups.setdefault((_shape_key(row), row["pass"]), {})[row["implementation"]] = row
  return groups


def _mib(x) -> str:
  return "-" if x is None else f"{x / 2**20:.3g}"


def _table(header: list[str], lines: list[list[str]]) -> str:
  widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h)
            for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines])


def _rate_cell(by_pass: dict, name: str, baseline: str, scale: float) -> str:
  """"fwd/fwd_bwd (ratio/ratio)": rates in the table's unit, ratios = baseline time / this time."""
  rates, ratios = [], []
  for pass_ in ("fwd", "fwd_bwd"):
    if pass_ not in by_pass:
      continue
    row = by_pass[pass_].get(name)
    base = by_pass[pass_].get(baseline)
    if row is None:
      rates.append("")
      ratios.append("")
    elif not ok(row):
      rates.append(ERROR_LABEL.get(row.get("error_kind"), "error"))
      ratios.append("-")
    else:
      rates.append(f"{row['tflops'] * scale:.3g}")
      ratios.append(f"{base['ms'] / row['ms']:.2g}" if base is not None and ok(base) else "-")
  if not any(rates):
    return ""
  cell = "/".join(rates)
  if name != baseline and any(r not in ("", "-") for r in ratios):
    cell += f" ({'/'.join(ratios)})"
  return cell


def speed_table(rows, baseline: str | None = None) -> str:
  """One line per shape: each implementation's forward/forward+backward TFLOP/s (GFLOP/s when
  every rate is below 1 TFLOP/s, as on a CPU) and, in parentheses, its speed relative to
  `baseline` in each pass (baseline time / its time: > 1 is faster)."""
  rows = attention_rows(rows)
  if not rows:
    return "(no attention rows)"
  baseline = baseline or baseline_name(rows)
  names = impl_names(rows)
  rates = [r["tflops"] for r in rows if ok(r)]
  giga = bool(rates) and max(rates) < 1
  shapes: dict = {}
  for row in rows:
    shapes.setdefault(_shape_key(row), {}).setdefault(row["pass"], {})[row["implementation"]] = row
  lines = []
  for by_pass in shapes.values():
    any_row = next(iter(next(iter(by_pass.values())).values()))
    lines.append([shape_label(any_row)]
                 + [_rate_cell(by_pass, n, baseline, 1e3 if giga else 1) for n in names])
  passes = "/".join(p for p in ("fwd", "fwd_bwd") if any(r["pass"] == p for r in rows))
  relative = (f"(speed relative to {SHORT.get(baseline, baseline)}, per pass: its time / this time)"
              if any(ok(r) and r["implementation"] == baseline for r in rows)
              else f"(no {SHORT.get(baseline, baseline)} rows to compare with)")
  return (f"{'GFLOP/s' if giga else 'TFLOP/s'} {passes}; {relative}\n"
          + _table(["shape"] + [SHORT.get(n, n) for n in names], lines))


def memory_table(rows) -> str:
  """One line per shape: each implementation's compiled temporaries in MiB, forward/forward+
  backward (and the allocator's peak per call in brackets where it was seen)."""
  rows = attention_rows(rows)
  names = impl_names(rows)
  shapes: dict = {}
  for row in rows:
    shapes.setdefault(_shape_key(row), {}).setdefault(row["implementation"], {})[row["pass"]] = row
  lines = []
  for by_impl in shapes.values():
    any_row = next(iter(next(iter(by_impl.values())).values()))
    cells = [shape_label(any_row)]
    for name in names:
      temps, peaks = [], []
      for pass_, row in sorted(by_impl.get(name, {}).items()):
        temps.append(_mib(row["temp_bytes"]) if row.get("temp_bytes") is not None
                     else ERROR_LABEL.get(row.get("error_kind"), "-"))
        if row.get("alloc_peak_bytes") is not None:
          peaks.append(_mib(row["alloc_peak_bytes"]))
      cells.append("/".join(temps) + (f" [{'/'.join(peaks)}]" if peaks else ""))
    lines.append(cells)
  return ("compiled temporaries per call, MiB, fwd/fwd_bwd (memory_analysis); "
          "[allocator peak of the call, MiB, where measured]\n"
          + _table(["shape"] + [SHORT.get(n, n) for n in names], lines))


def max_seq_table(rows) -> str:
  """The out-of-memory search: the longest sequence each implementation ran, per pass."""
  rows = attention_rows(rows, kind="max_seq")
  if not rows:
    return ""
  lines = []
  for name in impl_names(rows):
    for pass_ in ("fwd", "fwd_bwd"):
      mine = sorted((r for r in rows if r["implementation"] == name and r["pass"] == pass_),
                    key=lambda r: r["seq_q"])
      if not mine:
        continue
      good = [r for r in mine if r.get("error") is None]
      bad = [r for r in mine if r.get("error") is not None]
      largest = good[-1] if good else None
      lines.append([
          SHORT.get(name, name), pass_,
          str(largest["seq_q"]) if largest else "none",
          _mib(largest and (largest.get("alloc_peak_bytes") or largest.get("peak_bytes"))),
          (f"{bad[0]['seq_q']}: {bad[0]['error'][:60]}" if bad else "none up to the cap")])
  return ("out-of-memory search (batch 1, hidden 2048, causal): longest sequence run\n"
          + _table(["impl", "pass", "max seq", "its peak MiB", "first failure"], lines))


def _unmasked_twin(row, by_key: dict):
  """The same implementation, pass and dims without the window or documents (None if absent)."""
  key = measurement_key(dict(row, window=None, segment_len=None))
  twins = [r for k, r in by_key.items() if k[:3] + k[4:] == key[:3] + key[4:]]
  return next((r for r in twins if ok(r)), None)


def masked_table(rows) -> str:
  """The masked shapes (sliding window, packed documents): per implementation and pass, the time,
  the visible share of the scores, the share of pallas_attn's tiles skipped, and the speedup over
  the same call without the mask (plain causal; from any family, matched on the dims)."""
  rows = attention_rows(rows)
  masked = [r for r in rows if r.get("window") is not None or r.get("segment_len") is not None]
  if not masked:
    return ""
  by_key = {measurement_key(r): r for r in rows}
  lines = []
  for row in masked:
    twin = _unmasked_twin(row, by_key)
    frac = lambda x: "-" if x is None else f"{x:.3f}"
    name = SHORT.get(row["implementation"], row["implementation"])
    ms = f"{row['ms']:.3g}" if ok(row) else ERROR_LABEL.get(row.get("error_kind"), "error")
    lines.append([shape_label(row), name + (" (dense mask)" if row.get("dense_mask") else ""),
                  row["pass"], ms, frac(row.get("visible_fraction")),
                  frac(row.get("skipped_block_fraction")),
                  f"{twin['ms'] / row['ms']:.2f}x" if twin and ok(row) else "-"])
  return ("masked paths: ms per call; visible = share of (query, key) pairs the mask keeps; "
          "skipped = share of pallas_attn's forward tiles never computed; vs unmasked = time of "
          "the same call without the mask / this time (the TFLOP/s above credit the dense causal "
          "count)\n"
          + _table(["shape", "impl", "pass", "ms", "visible", "skipped", "vs unmasked"], lines))


def check_table(rows) -> str:
  """Per implementation: how many measurements ran, failed (by kind), and the largest error."""
  rows = attention_rows(rows)
  lines = []
  for name in impl_names(rows):
    mine = [r for r in rows if r["implementation"] == name]
    fails: dict = {}
    for r in mine:
      if not ok(r):
        fails[r.get("error_kind") or "error"] = fails.get(r.get("error_kind") or "error", 0) + 1
    errs = {}
    for p in ("fwd", "fwd_bwd"):
      vals = [r["max_rel_err"] for r in mine if r["pass"] == p and r.get("max_rel_err") is not None]
      errs[p] = f"{max(vals):.2e}" if vals else "-"
    lines.append([name, str(sum(ok(r) for r in mine)),
                  ", ".join(f"{n} {k}" for k, n in sorted(fails.items())) or "-",
                  errs["fwd"], errs["fwd_bwd"]])
  return ("checks: max relative error vs the float32 reference (max|out-ref| / max|ref|; "
          "fwd_bwd: worst of dq, dk, dv)\n"
          + _table(["implementation", "ran", "failed", "max err fwd", "max err fwd_bwd"], lines))


def error_lines(rows, limit: int = 12) -> str:
  """Distinct failure messages of the sweep (not skips; the out-of-memory search's failures are in
  its own table), one line each."""
  seen: dict = {}
  for r in attention_rows(rows):
    if r.get("error") and r.get("error_kind") != "skipped":
      # Sizes differ from shape to shape: one line per message with the numbers left out.
      message = re.sub(r"\d+(\.\d+)?", "#", r["error"])
      seen.setdefault((r["implementation"], message), []).append(r)
  out = [f"  {SHORT.get(impl, impl)} x{len(rs)}: {err[:110]}"
         for (impl, err), rs in list(seen.items())[:limit]]
  if len(seen) > limit:
    out.append(f"  ... and {len(seen) - limit} more")
  return "failures:\n" + "\n".join(out) if out else ""


def summary(rows, memory: bool = True) -> str:
  """Everything `python -m benchmarks.run` prints at the end (the memory table is long on a GPU:
  leave it out there with memory=False; the results file has it)."""
  from benchmarks.timing import FLOP_FORMULA  # pylint: disable=import-outside-toplevel
  parts = []
  ctx = next((r for r in rows if r.get("device")), None)
  if ctx:
    parts.append(f"device: {ctx['device']}  jax {ctx['jax_version']}  {ctx['date']}")
  parts.append(FLOP_FORMULA)
  ceil = ceiling(rows)
  if ceil:
    parts.append(f"matmul ceiling ({ceil['dtype']} {ceil['m']}^3, timed the same way): "
                 f"{ceil['tflops']:.4g} TFLOP/s")
  skipped = sum(r.get("error_kind") == "skipped" for r in attention_rows(rows))
  for table in (speed_table(rows), memory_table(rows) if memory else "", masked_table(rows),
                max_seq_table(rows), check_table(rows), error_lines(rows)):
    if table:
      parts.append(table)
  if skipped:
    parts.append(f"{skipped} measurements were skipped by --time-budget: run again with --resume "
                 "(and the same --out) to finish")
  return "\n\n".join(parts)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path", nargs="?", default="benchmarks/results/h200.jsonl")
  args = parser.parse_args(argv)
  rows = load(args.path)
  if not rows:
    raise SystemExit(f"no rows in {args.path}")
  print(summary(rows))


if __name__ == "__main__":
  main()
