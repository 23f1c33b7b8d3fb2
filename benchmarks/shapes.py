"""What the benchmark sweeps: one frozen `Shape` per attention problem, grouped in presets.

The main family is the FlashAttention papers' sweep: batch x seq = 16384 tokens and hidden size
2048, i.e. 32 heads of 64, 16 heads of 128 or 8 heads of 256, seq 512 ... 16384, causal and not.
Around it: long context at batch 1, grouped-query attention (32 query heads over 8 kv heads) and
decode-like calls (a few queries over a long KV cache), and the masked paths (a sliding window,
packed documents). The CPU presets are tiny versions of the same families, small enough for the
interpreter and the portable path on two cores.
"""

from __future__ import annotations

import dataclasses

TOKENS = 16384  # batch x seq in the FlashAttention papers' sweep
HIDDEN = 2048  # heads x head_dim in the same sweep


@dataclasses.dataclass(frozen=True)
class Shape:
  """One attention problem: q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_kv, heads_kv,
  head_dim]."""

  batch: int
  seq_q: int
  seq_kv: int
  heads_q: int
  heads_kv: int
  head_dim: int
  causal: bool
  family: str  # "fa", "long", "gqa", "decode", "masked", "cpu", ...: which question it answers
  # The masked paths: query i sees keys i - window ... i (local_window_size=(window, 0)), and/or
  # only keys of its own document, the sequence cut into documents of segment_len tokens.
  window: int | None = None
  segment_len: int | None = None

  def __post_init__(self):
    for name in ("batch", "seq_q", "seq_kv", "heads_q", "heads_kv", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"Shape.{name} must be positive, got {getattr(self, name)}")
    if self.segment_len is not None and (self.segment_len < 1 or self.seq_q != self.seq_kv):
      raise ValueError(f"segment_len ({self.segment_len}) needs seq_q == seq_kv and >= 1")
    if self.window is not None and self.window < 0:
      raise ValueError(f"Shape.window must be non-negative, got {self.window}")
    if self.heads_q % self.heads_kv:
      raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv "
                       f"({self.heads_kv})")

  @property
  def name(self) -> str:
    heads = (f"h{self.heads_q}" if self.heads_q == self.heads_kv
             else f"h{self.heads_q}/{self.heads_kv}")
    seq = f"s{self.seq_q}" if self.seq_q == self.seq_kv else f"s{self.seq_q}x{self.seq_kv}"
    return (f"b{self.batch} {seq} {heads} d{self.head_dim}{' causal' if self.causal else ''}"
            + masking_suffix(self.window, self.segment_len))

  @property
  def masking(self) -> dict:
    """The masked-path arguments of the timed call ({} for a plain shape)."""
    return {k: v for k, v in (("window", self.window), ("segment_len", self.segment_len))
            if v is not None}

  @property
  def score_elements(self) -> int:
    """Entries of the full [batch, heads_q, seq_q, seq_kv] score matrix (what dense paths hold)."""
    return self.batch * self.heads_q * self.seq_q * self.seq_kv

  def fields(self) -> dict:
    """The shape's columns in a results row."""
    return dataclasses.asdict(self)


def masking_suffix(window: int | None, segment_len: int | None) -> str:
  """" win1024", " doc2048" or "" in a shape's name (also the report's labels)."""
  return ((f" win{window}" if window is not None else "")
          + (f" doc{segment_len}" if segment_len is not None else ""))


def fa_sweep(seqs=(512, 1024, 2048, 4096, 8192, 16384), head_dims=(64, 128, 256),
             causal=(False, True)) -> list[Shape]:
  """The FlashAttention papers' sweep: 16384 tokens, hidden 2048."""
  return [Shape(TOKENS // s, s, s, HIDDEN // d, HIDDEN // d, d, c, "fa")
          for d in head_dims for c in causal for s in seqs]


def long_context(seqs=(32768, 65536), causal=(False, True)) -> list[Shape]:
  """Batch 1, 16 heads of 128: where dense attention runs out of memory."""
  return [Shape(1, s, s, 16, 16, 128, c, "long") for c in causal for s in seqs]


def gqa(seqs=(4096, 16384), causal=(True,)) -> list[Shape]:
  """Grouped-query attention, 32 query heads over 8 kv heads of 128 (Llama-style), 16k tokens."""
  return [Shape(TOKENS // s, s, s, 32, 8, 128, c, "gqa") for c in causal for s in seqs]


def decode(q_lens=(1, 16), kv_len=32768, batch=16) -> list[Shape]:
  """A few new queries over a long KV cache (GQA 32/8): bound by reading K and V."""
  return [Shape(batch, q, kv_len, 32, 8, 128, False, "decode") for q in q_lens]


def masked(seq=16384, window=1024, segment_len=2048) -> list[Shape]:
  """The masked paths at batch 1, 16 heads of 128, causal: a sliding window of `window` keys back,
  and packed documents of `segment_len` tokens (compare with the plain causal shape of the same
  size in `fa`). FLOPs are credited as for dense causal attention (see timing.py)."""
  return [Shape(1, seq, seq, 16, 16, 128, True, "masked", window=window),
          Shape(1, seq, seq, 16, 16, 128, True, "masked", segment_len=segment_len)]


def masked_tiny() -> list[Shape]:
  """The masked family on the CPU: the first two small enough for the interpreter."""
  return [Shape(1, 128, 128, 2, 2, 64, True, "cpu_masked", window=32),
          Shape(1, 128, 128, 2, 2, 64, True, "cpu_masked", segment_len=32),
          Shape(1, 512, 512, 2, 2, 64, True, "cpu_masked", window=128),
          Shape(1, 512, 512, 2, 2, 64, True, "cpu_masked", segment_len=128)]


def cpu_sweep() -> list[Shape]:
  """Tiny shapes for the CPU paths: two lengths, an odd one, causal and not, GQA and decode."""
  return ([Shape(1, s, s, 2, 2, 64, c, "cpu") for c in (False, True) for s in (128, 200, 256)]
          + [Shape(1, 128, 128, 4, 2, 64, True, "cpu_gqa"),
             Shape(1, 16, 256, 4, 2, 64, False, "cpu_decode")])


def tiny_sweep() -> list[Shape]:
  """The smallest useful sweep (tests, the notebook's CI mode)."""
  return [Shape(1, 128, 128, 2, 2, 64, False, "cpu"),
          Shape(1, 96, 96, 2, 2, 64, True, "cpu"),
          Shape(1, 64, 64, 4, 2, 64, True, "cpu_gqa")]


# Preset name -> shapes. The order is the order they run in: the peers' anchor shapes (N = 1024,
# 4096, 16384) come first, so that a run cut short by --time-budget still holds the comparisons
# that matter most.
def _full() -> list[Shape]:
  first = fa_sweep(seqs=(1024, 4096, 16384))
  rest = [s for s in fa_sweep() if s not in first]
  return first + gqa() + decode() + long_context() + rest


PRESETS = {
    "full": _full,
    "quick": lambda: (fa_sweep(seqs=(1024, 4096, 16384)) + gqa(seqs=(16384,)) + decode(q_lens=(16,))
                      + long_context(seqs=(32768,), causal=(True,))),
    "fa": fa_sweep,
    "fa_quick": lambda: fa_sweep(seqs=(1024, 4096, 16384)),
    "fa_d256": lambda: fa_sweep(head_dims=(256,)),
    "fa_d128": lambda: fa_sweep(head_dims=(128,)),
    "fa_d64": lambda: fa_sweep(head_dims=(64,)),
    # The four shapes issue #3's closing table quotes (head_dim 128, N = 4096 / 16384).
    "d128_anchors": lambda: fa_sweep(seqs=(4096, 16384), head_dims=(128,)),
    # head_dim 128 at the FlashAttention sweep's other lengths (the anchors' complement).
    "d128_rest": lambda: fa_sweep(seqs=(512, 1024, 2048, 8192), head_dims=(128,)),
    "long": long_context,
    "long_causal": lambda: long_context(causal=(True,)),
    # Causal N 32768 with more (batch, kv head)s (the snake's bound: 32) and at head_dim 256.
    "long_causal_batched": lambda: ([Shape(b, 32768, 32768, 16, 16, 128, True, "long")
                                     for b in (2, 4)]
                                    + [Shape(1, 32768, 32768, 8, 8, 256, True, "long")]),
    "gqa": gqa,
    # GQA's dK/dV group split (`group_split_min_blocks`, benchmarks/NOTES.md session 40): causal
    # 32 / 8 at N 2048 / 8192 / 16384, a group of 8 (32 / 4), no mask, and head_dim 64.
    "gqa_split": lambda: ([Shape(TOKENS // s, s, s, 32, 8, 128, True, "gqa")
                           for s in (2048, 8192, 16384)]
                          + [Shape(1, 16384, 16384, 32, 4, 128, True, "gqa"),
                             Shape(1, 16384, 16384, 32, 8, 128, False, "gqa"),
                             Shape(1, 16384, 16384, 32, 8, 64, True, "gqa")]),
    # The split at head_dim 256 (the head split's dK/dV kernel): causal groups of 4 and 2 at
    # N 8192 / 16384, hidden 4096 query-side, and the MHA row beside them (per-FLOP ratios).
    "gqa_split_d256": lambda: ([Shape(TOKENS // s, s, s, 16, kv, 256, True, "gqa")
                                for s in (8192, 16384) for kv in (4, 8)]
                               + [Shape(1, 16384, 16384, 16, 16, 256, True, "gqa")]),
    # The d256 split below its threshold: causal groups of 4 and 2 at N 4096 / 2048, and a group
    # of 4 with no mask at N 16384 (no skew: only `group_parts` splits it).
    "gqa_split_d256_short": lambda: ([Shape(TOKENS // s, s, s, 16, kv, 256, True, "gqa")
                                      for s in (4096, 2048) for kv in (4, 8)]
                                     + [Shape(1, 16384, 16384, 16, 4, 256, False, "gqa")]),
    "decode": decode,
    "masked": masked,
    "masked_tiny": masked_tiny,
    "cpu": cpu_sweep,
    "tiny": tiny_sweep,
    # benchmarks/tune.py on the H200: the d128 anchors at N = 4096, and d64 / d256 (their gaps to
    # cuDNN are the largest: forward at d64, forward+backward at d256).
    "tune_mix": lambda: (fa_sweep(seqs=(4096,), head_dims=(128,))
                         + fa_sweep(seqs=(4096,), head_dims=(64, 256), causal=(False,))),
    # head_dim 256, both passes' anchors (the dK/dV layouts: benchmarks/NOTES.md session 8).
    "tune_d256": lambda: fa_sweep(seqs=(4096, 16384), head_dims=(256,)),
    # The other head_dim 256 lengths of the FlashAttention sweep.
    "d256_rest": lambda: fa_sweep(seqs=(512, 1024, 2048, 8192), head_dims=(256,)),
    # head_dim 128 at lengths that 128, 192 and 384 divide (b4 s4224, b1 s16896, the anchors' 16896
    # tokens; causal and not): forward key blocks of 192 time without padding K and V.
    "d128_kv192": lambda: [Shape(b, s, s, 16, 16, 128, c, "fa") for c in (False, True)
                           for b, s in ((4, 4224), (1, 16896))],
    # One d128 causal shape (benchmarks/tune.py --ptxas: registers hardly depend on the shape).
    "tune_d128": lambda: fa_sweep(seqs=(4096,), head_dims=(128,), causal=(True,)),
    # head_dim 64 at the anchors' lengths (N = 4096 / 16384, causal and not).
    "d64_anchors": lambda: fa_sweep(seqs=(4096, 16384), head_dims=(64,)),
    # head_dim 64 at N = 2048 / 8192, causal and not: with `d64_anchors`, every length where its
    # backward fuses dQ into the dK/dV kernel.
    "d64_rest": lambda: fa_sweep(seqs=(2048, 8192), head_dims=(64,)),
    # head_dim 64 at N = 4096, causal and not (its backward fuses dQ into the dK/dV kernel).
    "tune_d64": lambda: fa_sweep(seqs=(4096,), head_dims=(64,)),
    # Short sequences (FWD_GAP_ANALYSIS.md #2: the per-CTA fixed cost of a 4- or 8-block tile),
    # head_dim 128 at N = 512 / 1024 and head_dim 64 at N = 1024, causal and not.
    "tune_short": lambda: (fa_sweep(seqs=(512, 1024), head_dims=(128,))
                           + fa_sweep(seqs=(1024,), head_dims=(64,))),
    # head_dim 64's short rows (N = 512 / 1024 / 2048, causal and not), where the fixed passes
    # around the kernels weigh most.
    "d64_short": lambda: fa_sweep(seqs=(512, 1024, 2048), head_dims=(64,)),
    # The persistent forward's short rows at head_dim 128 (N 512 / 1024 / 2048, causal and
    # not: 4-16 key blocks a tile, where an item's ramp and epilogue weigh most).
    "short_d128": lambda: fa_sweep(seqs=(512, 1024, 2048), head_dims=(128,)),
    # The causal rows the persistent forward runs (the forward's schedule under a skewed load):
    # head_dim 128 and 256 from N 2048, GQA 32 / 8, head_dim 64 up to N 8192.
    "causal_persistent": lambda: (fa_sweep(seqs=(2048, 4096, 8192, 16384), head_dims=(128, 256),
                                           causal=(True,))
                                  + gqa() + fa_sweep(seqs=(2048, 4096, 8192), head_dims=(64,),
                                                     causal=(True,))),
    # benchmarks/tune.py's CPU smoke test: one causal shape, one head.
    "tune_smoke": lambda: [Shape(1, 96, 96, 1, 1, 64, True, "cpu")],
    "none": lambda: [],
}


def preset(names: str | list[str]) -> list[Shape]:
  """Shapes of one or more comma-separated presets, duplicates dropped, order kept."""
  if isinstance(names, str):
    names = [n for n in names.split(",") if n]
  shapes: list[Shape] = []
  for name in names:
    if name not in PRESETS:
      raise ValueError(f"unknown shape preset {name!r}; choose from {sorted(PRESETS)}")
    shapes += [s for s in PRESETS[name]() if s not in shapes]
  return shapes


def max_seq_shape(seq: int, head_dim: int = 128) -> Shape:
  """The out-of-memory search's shape: batch 1, hidden 2048, causal (memory barely depends on
  causality; the causal call is twice as fast to run)."""
  return Shape(1, seq, seq, HIDDEN // head_dim, HIDDEN // head_dim, head_dim, True, "max_seq")
