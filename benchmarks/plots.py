"""The notebook's figures, drawn from results rows (see `report.load`).

Each function takes the rows of a results file and returns a matplotlib Figure; they adapt to what
the file holds (the CPU file has one head_dim and tiny sequences, the H200 file the full sweep).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib import transforms

from benchmarks import report

PASS_TITLE = {"fwd": "forward", "fwd_bwd": "forward + backward"}
_CYCLE = plt.rcParams["axes.prop_cycle"].by_key()["color"]
COLORS = {name: _CYCLE[i % len(_CYCLE)] for i, name in enumerate(report.ORDER)}
MARKERS = dict(zip(report.ORDER, "o^sDvP*"))
BF16_EPS = 2.0 ** -8  # bf16's unit roundoff: one rounding of the output costs up to this


def _style(name):
  return {"color": COLORS.get(name), "marker": MARKERS.get(name, "o"),
          "label": report.SHORT.get(name, name)}


def self_attention_rows(rows, kind: str = "attention") -> list[dict]:
  """Rows of plain self-attention (seq_q == seq_kv, heads_q == heads_kv): the seq sweeps."""
  return [r for r in report.attention_rows(rows, kind)
          if r["seq_q"] == r["seq_kv"] and r["heads_q"] == r["heads_kv"]
          and r["family"] in ("fa", "long", "cpu", "max_seq")]


def _panels(rows, head_dims):
  """(head_dim, causal) pairs to draw, in order."""
  present = sorted({(r["head_dim"], r["causal"]) for r in rows})
  if head_dims:
    chosen = [p for p in present if p[0] in head_dims]
    present = chosen or present
  return present


def _mark_failures(ax, xs, name):
  """An x at the foot of the axis where a call did not run (out of memory, unsupported)."""
  if not xs:
    return
  trans = transforms.blended_transform_factory(ax.transData, ax.transAxes)
  ax.scatter(xs, [0.03] * len(xs), transform=trans, marker="x", color=COLORS.get(name), s=40,
             clip_on=False, zorder=5)


def metric_vs_seq(rows, metric: str = "tflops", head_dims=(64, 128), ylabel: str | None = None,
                  title: str | None = None):
  """One panel per (pass, head_dim, causal): `metric` against sequence length, a line per
  implementation; an x marks a call that did not run."""
  rows = self_attention_rows(rows)
  panels = _panels(rows, head_dims)
  passes = [p for p in ("fwd", "fwd_bwd") if any(r["pass"] == p for r in rows)]
  if not rows or not panels or not passes:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.text(0.5, 0.5, "no rows to plot", ha="center", va="center")
    ax.axis("off")
    return fig
  fig, axes = plt.subplots(len(passes), len(panels), squeeze=False, sharex=True,
                           figsize=(3.6 * len(panels) + 1, 3.0 * len(passes) + 0.6))
  for i, pass_ in enumerate(passes):
    for j, (head_dim, causal) in enumerate(panels):
      ax = axes[i][j]
      mine = [r for r in rows if r["pass"] == pass_ and r["head_dim"] == head_dim
              and r["causal"] == causal]
      for name in report.impl_names(mine):
        pts = sorted((r["seq_q"], r[metric]) for r in mine
                     if r["implementation"] == name and report.ok(r) and r.get(metric) is not None)
        if pts:
          ax.plot(*zip(*pts), **_style(name))
        _mark_failures(ax, sorted(r["seq_q"] for r in mine
                                  if r["implementation"] == name and not report.ok(r)
                                  and r.get("error_kind") != "skipped"), name)
      ax.set_xscale("log", base=2)
      ax.set_ylim(bottom=0)
      ax.set_title(f"{PASS_TITLE[pass_]}, d={head_dim}{', causal' if causal else ''}",
                   fontsize=9)
      ax.grid(alpha=0.3)
      if j == 0:
        ax.set_ylabel(ylabel or metric)
      if i == len(passes) - 1:
        ax.set_xlabel("sequence length")
  handles = {}
  for ax in axes.flat:
    for h, l in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(l, h)
  order = [report.SHORT.get(n, n) for n in report.ORDER]
  handles = dict(sorted(handles.items(),
                        key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
  fig.legend(list(handles.values()), list(handles), loc="upper center",
             ncol=min(7, len(handles)), fontsize=8, frameon=False)
  footer = "x at the foot of a panel: did not run (out of memory / unsupported)"
  fig.suptitle(f"{title}\n{footer}" if title else footer, y=0.0, fontsize=8, va="bottom")
  fig.tight_layout(rect=(0, 0.07 if title else 0.04, 1, 0.93))
  return fig


def tflops_vs_seq(rows, head_dims=(64, 128)):
  from benchmarks.timing import FLOP_FORMULA  # pylint: disable=import-outside-toplevel
  return metric_vs_seq(rows, "tflops", head_dims, "TFLOP/s", FLOP_FORMULA)


def ratio_vs_seq(rows, baseline: str | None = None, head_dims=(64, 128)):
  """Speed relative to `baseline` (cuDNN where it ran, else jax's xla path): > 1 is faster."""
  baseline = baseline or report.baseline_name(rows)
  attn = report.attention_rows(rows)
  base = {(report.measurement_key(r)[1:]): r for r in attn
          if r["implementation"] == baseline and report.ok(r)}
  with_ratio = []
  for r in attn:
    b = base.get(report.measurement_key(r)[1:])
    r = dict(r, ratio=(b["ms"] / r["ms"]) if b and report.ok(r) else None)
    with_ratio.append(r)
  fig = metric_vs_seq(with_ratio, "ratio", head_dims,
                      f"speed / {report.SHORT.get(baseline, baseline)}")
  for ax in fig.axes:
    ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
  return fig


def memory_vs_seq(rows):
  """Peak memory per call against sequence length, from the out-of-memory search when the file has
  one (batch 1: the allocator's peak on a GPU, else the compiled peak), else from the sweep
  (compiled peak). The first failing length is marked; the device's memory is a dashed line."""
  search = self_attention_rows(rows, kind="max_seq")
  source = search or [r for r in self_attention_rows(rows) if not r["causal"]]
  if not source:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.text(0.5, 0.5, "no rows to plot", ha="center", va="center")
    ax.axis("off")
    return fig
  if not search:  # the sweep: one head_dim, the largest present
    head_dim = max(r["head_dim"] for r in source)
    source = [r for r in source if r["head_dim"] == head_dim]
  passes = [p for p in ("fwd", "fwd_bwd") if any(r["pass"] == p for r in source)]
  fig, axes = plt.subplots(1, len(passes), squeeze=False, figsize=(5.2 * len(passes), 3.6))
  limit = next((r.get("memory_limit_bytes") for r in search if r.get("memory_limit_bytes")),
               None) or next((r.get("device_memory_bytes") for r in rows
                              if r.get("device_memory_bytes")), None)
  any_row = source[0]
  for ax, pass_ in zip(axes[0], passes):
    mine = [r for r in source if r["pass"] == pass_]
    for name in report.impl_names(mine):
      ran = sorted((r["seq_q"], (r.get("alloc_peak_bytes") or r["peak_bytes"]) / 2**30)
                   for r in mine if r["implementation"] == name and r.get("error") is None
                   and r.get("peak_bytes") is not None)
      if ran:
        ax.plot(*zip(*ran), **_style(name))
      failed = sorted(r["seq_q"] for r in mine if r["implementation"] == name
                      and r.get("error_kind") == "oom")
      if failed:
        ax.axvline(failed[0], color=COLORS.get(name), ls=":", lw=1)
        ax.annotate(f"{report.SHORT.get(name, name)} OOM at {failed[0]}", (failed[0], 0.97),
                    xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=7, color=COLORS.get(name))
    if limit:
      ax.axhline(limit / 2**30, color="0.3", ls="--", lw=1)
      ax.annotate(f"memory limit {limit / 2**30:.3g} GiB", (0.01, limit / 2**30),
                  xycoords=("axes fraction", "data"), va="bottom", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak memory per call, GiB")
    ax.grid(alpha=0.3, which="both")
    what = ("out-of-memory search" if search else
            f"sweep, b×s={any_row['batch'] * any_row['seq_q']}" if any_row["family"] == "fa"
            else "sweep")
    ax.set_title(f"{PASS_TITLE[pass_]}: {what}, h={any_row['heads_q']}, "
                 f"d={any_row['head_dim']}", fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def worked_shape(rows, seq: int = 8192, head_dim: int = 128) -> dict | None:
  """The non-causal self-attention row to work the memory example on: seq x head_dim when the
  file has it, else its longest sequence."""
  cands = [r for r in self_attention_rows(rows) if not r["causal"] and r["family"] != "max_seq"]
  exact = [r for r in cands if r["seq_q"] == seq and r["head_dim"] == head_dim]
  if exact:
    return exact[0]
  return max(cands, key=lambda r: (r["seq_q"], r["head_dim"]), default=None)


def worked_memory_text(rows, seq: int = 8192, head_dim: int = 128) -> str:
  """The arithmetic: one head's N x N score matrix, then the whole call's, then what each
  implementation's compiled call allocates beyond its inputs and outputs."""
  row = worked_shape(rows, seq, head_dim)
  one_head_8k = 8192 * 8192 * 2
  lines = [f"one head's 8192 x 8192 score matrix in bf16: 8192^2 x 2 B = "
           f"{one_head_8k / 2**20:.0f} MiB"]
  if row is None:
    return lines[0]
  n, b, h = row["seq_q"], row["batch"], row["heads_q"]
  one = n * n * 2
  lines += [f"worked at b={b}, N={n}, h={h}, d={row['head_dim']} (non-causal):",
            f"  one head's N x N scores, bf16: {one / 2**20:.4g} MiB",
            f"  all {b} x {h} heads, bf16: {b * h * one / 2**20:.4g} MiB "
            f"(float32, as softmax keeps them: {2 * b * h * one / 2**20:.4g} MiB)",
            "  compiled temporaries per call (memory_analysis), MiB:"]
  same = [r for r in report.attention_rows(rows)
          if report.measurement_key(r)[2:] == report.measurement_key(row)[2:]]
  for name in report.impl_names(same):
    cells = []
    for p in ("fwd", "fwd_bwd"):
      r = next((r for r in same if r["implementation"] == name and r["pass"] == p), None)
      if r is None:
        continue
      cells.append(f"{p} " + (f"{r['temp_bytes'] / 2**20:.4g}" if r.get("temp_bytes") is not None
                              else report.ERROR_LABEL.get(r.get("error_kind"), "-")))
    lines.append(f"    {report.SHORT.get(name, name):12s} " + ", ".join(cells))
  return "\n".join(lines)


def worked_memory(rows, seq: int = 8192, head_dim: int = 128):
  """Bars: each implementation's compiled temporaries at the worked shape, against the size of
  one head's and all heads' score matrices."""
  row = worked_shape(rows, seq, head_dim)
  fig, ax = plt.subplots(figsize=(7.5, 3.4))
  if row is None:
    ax.text(0.5, 0.5, "no rows to plot", ha="center", va="center")
    ax.axis("off")
    return fig
  same = [r for r in report.attention_rows(rows)
          if report.measurement_key(r)[2:] == report.measurement_key(row)[2:]]
  names = report.impl_names(same)
  width = 0.38
  for k, p in enumerate(("fwd", "fwd_bwd")):
    vals = []
    for name in names:
      r = next((r for r in same if r["implementation"] == name and r["pass"] == p), None)
      vals.append((r or {}).get("temp_bytes") or 0)
    ax.bar([i + (k - 0.5) * width for i in range(len(names))], [v / 2**20 for v in vals],
           width, label=PASS_TITLE[p], color=["C0", "C1"][k], alpha=0.85)
  n, b, h = row["seq_q"], row["batch"], row["heads_q"]
  ax.axhline(n * n * 2 / 2**20, color="k", ls=":", lw=1)
  ax.annotate(f"one head's N×N, bf16 ({n * n * 2 / 2**20:.3g} MiB)", (0.01, n * n * 2 / 2**20),
              xycoords=("axes fraction", "data"), va="bottom", fontsize=7)
  ax.axhline(b * h * n * n * 2 / 2**20, color="k", ls="--", lw=1)
  ax.annotate(f"all {b}×{h} heads' N×N, bf16 ({b * h * n * n * 2 / 2**20:.4g} MiB)",
              (0.01, b * h * n * n * 2 / 2**20), xycoords=("axes fraction", "data"),
              va="bottom", fontsize=7)
  ax.set_xticks(range(len(names)), [report.SHORT.get(x, x) for x in names], fontsize=8)
  ax.set_yscale("symlog", linthresh=1e-2)
  ax.set_ylabel("compiled temporaries, MiB")
  ax.set_title(f"memory at b={b}, N={n}, h={h}, d={row['head_dim']}", fontsize=9)
  ax.legend(fontsize=8, loc="center right")
  fig.tight_layout()
  return fig


def error_panel(rows):
  """Largest relative error against the float32 reference, per implementation and pass, with
  bf16's unit roundoff for scale (the FlashAttention criterion: a kernel should be within about
  2x of what plain attention computed in bf16, here jax's xla path, gets)."""
  attn = [r for r in report.attention_rows(rows) if r.get("max_rel_err") is not None]
  names = report.impl_names(attn)
  fig, ax = plt.subplots(figsize=(7.5, 3.2))
  if not names:
    ax.text(0.5, 0.5, "no checked rows", ha="center", va="center")
    ax.axis("off")
    return fig
  width = 0.38
  for k, p in enumerate(("fwd", "fwd_bwd")):
    vals = [max((r["max_rel_err"] for r in attn if r["implementation"] == n and r["pass"] == p),
                default=0) for n in names]
    ax.bar([i + (k - 0.5) * width for i in range(len(names))], vals, width,
           label=f"{PASS_TITLE[p]}" + (" (worst of dq, dk, dv)" if p == "fwd_bwd" else ""),
           color=["C0", "C1"][k], alpha=0.85)
  ax.axhline(BF16_EPS, color="k", ls=":", lw=1)
  ax.annotate("bf16 unit roundoff 2^-8", (0.01, BF16_EPS), xycoords=("axes fraction", "data"),
              va="bottom", fontsize=7)
  ax.set_xticks(range(len(names)), [report.SHORT.get(x, x) for x in names], fontsize=8)
  ax.set_yscale("log")
  smallest = min((r["max_rel_err"] for r in attn if r["max_rel_err"] > 0), default=1e-3)
  ax.set_ylim(bottom=min(1e-4, smallest / 3))
  ax.set_ylabel("max |out − ref| / max |ref|")
  ax.set_title("error against the float32 reference (worst over the checked shapes)", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig
