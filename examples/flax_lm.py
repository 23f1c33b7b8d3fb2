"""A small decoder-only language model in Flax NNX, trained once with Flax's default attention and
once with `pallas_attn.flax_attention_fn`, from the same initial parameters on the same batches.

  python -m examples.flax_lm --quick                 # CPU: tiny model, 40 steps, well under a minute
  python -m examples.flax_lm --steps 300 --seq 1024 --batch 8 --d-model 512 --heads 8 \
      --dtype bfloat16 --out-dir /tmp/flax_lm      # Hopper GPU: the Mosaic GPU kernels

The model: token + learned position embeddings, `layers` pre-LayerNorm blocks (causal
`nnx.MultiHeadAttention` whose `attention_fn` is the one compared, then a GELU MLP), a final
LayerNorm and an output head tied to the token embedding. Dropout is 0: the runs are
deterministic, so the two loss curves differ only by the attention's rounding.

The corpus is synthetic and needs no download: each sequence is a walk of `period` tokens on a
fixed random Markov chain (every token has `branching` possible successors), repeated to fill the
sequence. A model that learns only the chain's transitions reaches a loss of about H, the chain's
entropy rate; one whose attention also learns to copy (look `period` tokens back) pays H only on
the first walk, about (period - 1) * H / seq per token. Both floors are printed, so a falling curve
can be read against them: the drop below H is the attention's work.

Printed: both loss curves side by side and their largest difference, which pallas_attn
implementation served the attention (on CPU the portable blocked path; on a Hopper GPU with
bf16/f16 and head_dim 64/128/256 the Mosaic GPU kernels), time per training step with the first
`timing_warmup` steps excluded, XLA's temporaries for one compiled step, and the allocator's
peak (`memory_stats()`, None on CPU). With `--out-dir`, curves.json and loss_curves.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax  # installed with flax (one of its dependencies)
from flax import nnx

import pallas_attn
from pallas_attn import dispatch

ATTENTIONS = {
    # With dropout 0 and no sown weights this calls jax.nn.dot_product_attention (XLA), which
    # forms the [seq, seq] scores of every head.
    "flax": nnx.dot_product_attention,
    "pallas_attn": pallas_attn.flax_attention_fn,
}
# pallas_attn runs first: the allocator's peak is a high-water mark of the whole process, so the
# second run's peak is only its own when it is the larger one (dense attention's, as expected).
RUN_ORDER = ("pallas_attn", "flax")


@dataclasses.dataclass(frozen=True)
class Config:
  """One training run; both attentions get the same one."""

  steps: int = 300
  batch: int = 8
  seq: int = 256  # tokens the model sees; each batch holds seq + 1 (inputs and shifted targets)
  vocab: int = 64
  branching: int = 3  # successors per token in the Markov chain
  period: int = 16  # length of the walk that each sequence repeats
  d_model: int = 256
  heads: int = 4  # head_dim = d_model // heads; the Mosaic GPU kernels take 64, 128 or 256
  layers: int = 4
  mlp_ratio: int = 4
  dtype: str | None = None  # activations; None: bfloat16 on a GPU (the kernels' dtype), else f32
  learning_rate: float = 3e-3
  warmup_steps: int = 30
  remat: bool = False  # nnx.remat (jax.checkpoint) around every block
  seed: int = 0
  timing_warmup: int = 3  # first steps left out of the step times (compilation, allocation)

  def __post_init__(self):
    if self.d_model % self.heads:
      raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")
    if not 1 <= self.period <= self.seq:
      raise ValueError(f"period {self.period} must be in [1, seq={self.seq}]")
    if not 1 <= self.branching <= self.vocab:
      raise ValueError(f"branching {self.branching} must be in [1, vocab={self.vocab}]")
    for what in ("timing_warmup", "warmup_steps"):
      if self.steps <= getattr(self, what):
        raise ValueError(f"steps {self.steps} must exceed {what} {getattr(self, what)}")

  @property
  def activation_dtype(self) -> jnp.dtype:
    if self.dtype is not None:
      return jnp.dtype(self.dtype)
    return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)


# Small enough that both runs, compilation included, take seconds on two CPU cores.
QUICK = Config(steps=40, batch=16, seq=64, vocab=16, branching=2, period=8, d_model=32, heads=2,
               layers=2, learning_rate=1e-2, warmup_steps=5)


# ------------------------------------------------------------------------------------------------
# The corpus.


def markov_chain(vocab: int, branching: int, rng: np.random.Generator) -> np.ndarray:
  """[vocab, vocab] transition probabilities: each row puts random weights on `branching`
  randomly chosen successors, so the next token is predictable but not certain."""
  transitions = np.zeros((vocab, vocab))
  for row in transitions:
    successors = rng.choice(vocab, size=branching, replace=False)
    row[successors] = rng.dirichlet(np.ones(branching))
  return transitions


def entropy_rate(transitions: np.ndarray) -> float:
  """The chain's entropy per token in nats: the loss of a model that knows the transitions."""
  stationary = np.full(len(transitions), 1 / len(transitions))
  for _ in range(1000):  # power iteration; the chain is small
    stationary = stationary @ transitions
  logs = np.log(np.where(transitions > 0, transitions, 1.0))
  return float(-(stationary * (transitions * logs).sum(axis=1)).sum())


def sample_walks(transitions: np.ndarray, count: int, length: int,
                 rng: np.random.Generator) -> np.ndarray:
  """[count, length] int32 walks on the chain, each from a uniformly drawn first token."""
  vocab = len(transitions)
  cdf = np.cumsum(transitions, axis=1)
  walks = np.empty((count, length), np.int32)
  walks[:, 0] = rng.integers(vocab, size=count)
  for i in range(1, length):
    u = rng.random((count, 1))
    # The clip guards against a cdf whose last entry rounds to slightly below u.
    walks[:, i] = np.minimum((cdf[walks[:, i - 1]] < u).sum(axis=1), vocab - 1)
  return walks


def make_batches(cfg: Config) -> tuple[np.ndarray, float]:
  """All training batches, [steps, batch, seq + 1] int32 (a walk of `period` tokens, repeated),
  made up front so that both runs see the same data and step times exclude it; and the chain's
  entropy rate. Batch i depends only on the seed and i, not on the number of steps."""
  transitions = markov_chain(cfg.vocab, cfg.branching, np.random.default_rng(cfg.seed))
  repeats = -(-(cfg.seq + 1) // cfg.period)
  batches = [
      np.tile(sample_walks(transitions, cfg.batch, cfg.period,
                           np.random.default_rng([cfg.seed, step])), (1, repeats))
      for step in range(cfg.steps)]
  return np.stack(batches)[:, :, :cfg.seq + 1], entropy_rate(transitions)


def loss_floors(cfg: Config, entropy: float) -> dict[str, float]:
  """Per-token losses of a model that knows the chain (about H: the jumps from a walk's end back
  to its start are not transitions of the chain) and of one that also copies (H on the first
  walk's period - 1 predictions, 0 afterwards)."""
  return {"chain only": entropy, "with copying": entropy * (cfg.period - 1) / cfg.seq}


# ------------------------------------------------------------------------------------------------
# The model.


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, cfg: Config, attention_fn, rngs: nnx.Rngs):
    dtype, d = cfg.activation_dtype, cfg.d_model
    self.attention_norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    # No q/k/v biases: the key bias's gradient is zero in exact arithmetic (softmax ignores a
    # constant added to a row), and Adam would turn the two attentions' different rounding noise
    # there into different updates, a difference that says nothing about either attention.
    # keep_rngs=False: with dropout 0 the module needs no random state, so the model's state is
    # only its parameters.
    self.attention = nnx.MultiHeadAttention(
        num_heads=cfg.heads, in_features=d, decode=False, dropout_rate=0.0, use_bias=False,
        attention_fn=attention_fn, dtype=dtype, keep_rngs=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    # is_causal rather than a causal mask: pallas_attn then skips the blocks above the diagonal
    # (a mask would send it to the dense reference path).
    x = x + self.attention(self.attention_norm(x), is_causal=True, deterministic=True)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


def _apply_block(block: Block, x):
  return block(x)


class LanguageModel(nnx.Module):
  """Decoder-only LM: tokens [batch, seq] -> next-token logits [batch, seq, vocab], float32."""

  def __init__(self, cfg: Config, attention_fn, rngs: nnx.Rngs):
    dtype = cfg.activation_dtype
    self.token_embedding = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, rngs=rngs)
    self.position_embedding = nnx.Embed(cfg.seq, cfg.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, attention_fn, rngs) for _ in range(cfg.layers)])
    self.final_norm = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.remat = cfg.remat

  def __call__(self, tokens):
    x = self.token_embedding(tokens) + self.position_embedding(jnp.arange(tokens.shape[1]))
    # With remat, the backward pass recomputes each block from its input instead of keeping all
    # of its activations from the forward pass.
    apply_block = nnx.remat(_apply_block) if self.remat else _apply_block
    for block in self.blocks:
      x = apply_block(block, x)
    # The head is tied to the token embedding; logits in float32 for the softmax cross-entropy.
    return self.token_embedding.attend(self.final_norm(x)).astype(jnp.float32)


# ------------------------------------------------------------------------------------------------
# Training.


@dataclasses.dataclass(frozen=True)
class RunResult:
  attention: str  # a key of ATTENTIONS
  implementation: str  # what computed the attention
  losses: tuple[float, ...]  # one per step
  step_ms: tuple[float, ...]  # one per step after the first timing_warmup
  compile_s: float
  temp_bytes: int | None  # XLA's temporaries for one compiled training step
  allocator_peak_bytes: int | None  # the process's high-water mark after this run (None on CPU)

  @property
  def median_step_ms(self) -> float:
    return statistics.median(self.step_ms)


def pallas_implementation(cfg: Config) -> str:
  """Which pallas_attn implementation serves the model's attention calls, and why (no bias or
  mask here, so it is the Mosaic GPU kernels when they can, else the portable blocked path)."""
  head_dim = cfg.d_model // cfg.heads
  call = dispatch.AttentionCall(batch=cfg.batch, q_len=cfg.seq, kv_len=cfg.seq, heads_q=cfg.heads,
                                heads_kv=cfg.heads, head_dim=head_dim,
                                dtype=cfg.activation_dtype, has_bias=False, has_mask=False)
  reason = dispatch.mosaic_gpu_unsupported_reason(call)
  return "mosaic_gpu" if reason is None else f"blocked_jax ({reason})"


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                cfg.steps)
  # Clipping keeps the first steps (random init, high loss) from throwing the run off.
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation):
  """(params, opt_state, tokens [batch, seq + 1]) -> (params, opt_state, loss): a pure function of
  the parameter state, so that it can be lowered and compiled once and its memory read."""

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, donate_argnums=(0, 1))


def temp_bytes(compiled) -> int | None:
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def allocator_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()  # None on CPU
  return None if stats is None else stats.get("peak_bytes_in_use")


def train(cfg: Config, attention: str, batches: np.ndarray) -> RunResult:
  """Trains a fresh model (initialized from cfg.seed, so every attention starts from the same
  parameters) on `batches` with the named attention."""
  model = LanguageModel(cfg, ATTENTIONS[attention], nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model, nnx.Param)  # fails if the model held any other state
  optimizer = make_optimizer(cfg)
  opt_state = optimizer.init(params)
  start = time.perf_counter()
  step = make_train_step(graphdef, optimizer).lower(params, opt_state, batches[0]).compile()
  compile_s = time.perf_counter() - start
  losses, step_ms = [], []
  for tokens in batches:
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, tokens)
    losses.append(float(loss))  # waits for the step to finish
    step_ms.append((time.perf_counter() - start) * 1e3)
  implementation = pallas_implementation(cfg) if attention == "pallas_attn" else "jax.nn (xla)"
  return RunResult(attention, implementation, tuple(losses), tuple(step_ms[cfg.timing_warmup:]),
                   compile_s, temp_bytes(step), allocator_peak_bytes())


# ------------------------------------------------------------------------------------------------
# Reporting.


def max_loss_difference(runs: dict[str, RunResult]) -> float | None:
  if len(runs) < 2:
    return None
  curves = np.array([r.losses for r in runs.values()])  # [runs, steps]
  return float(np.ptp(curves, axis=0).max())


def _mib(n: int | None) -> str:
  return "None" if n is None else f"{n / 2**20:.1f} MiB"


def print_report(cfg: Config, runs: dict[str, RunResult], floors: dict[str, float],
                 log_every: int):
  names = list(runs)
  print("loss floors: " + ", ".join(f"{what} {x:.3f}" for what, x in floors.items())
        + f"; uniform guess ln(vocab) {np.log(cfg.vocab):.3f}")
  print(f"{'step':>6}" + "".join(f"{name:>14}" for name in names)
        + ("        |diff|" if len(names) == 2 else ""))
  for i in sorted({*range(0, cfg.steps, log_every), cfg.steps - 1}):
    losses = [runs[name].losses[i] for name in names]
    diff = f"{abs(losses[0] - losses[1]):14.2e}" if len(names) == 2 else ""
    print(f"{i:>6}" + "".join(f"{x:14.5f}" for x in losses) + diff)
  max_diff = max_loss_difference(runs)
  if max_diff is not None:
    print(f"max |loss difference| over {cfg.steps} steps: {max_diff:.3e}")
  tokens_per_step = cfg.batch * cfg.seq
  for name, run in runs.items():
    ms = run.median_step_ms
    print(f"{name:>12}: {run.implementation}; step {ms:.2f} ms median "
          f"(min {min(run.step_ms):.2f}, mean {statistics.fmean(run.step_ms):.2f}, over "
          f"{len(run.step_ms)} steps after {cfg.timing_warmup} warm-up), "
          f"{tokens_per_step / ms * 1e3:,.0f} tokens/s; compile {run.compile_s:.1f} s; "
          f"step temporaries {_mib(run.temp_bytes)}; allocator peak "
          f"{_mib(run.allocator_peak_bytes)}")
  if len(runs) == 2 and all(r.allocator_peak_bytes is not None for r in runs.values()):
    print("(the allocator peak is the process's high-water mark: the second run's is its own "
          "only if it is larger; run one --attention per process for both)")


def save_outputs(out_dir: pathlib.Path, cfg: Config, runs: dict[str, RunResult],
                 floors: dict[str, float]):
  """curves.json (config, per-step losses and times, memory) and, with matplotlib, a plot."""
  out_dir.mkdir(parents=True, exist_ok=True)
  record = {"config": dataclasses.asdict(cfg), "activation_dtype": str(cfg.activation_dtype),
            "device": str(jax.devices()[0].device_kind), "loss_floors": floors,
            "max_loss_difference": max_loss_difference(runs),
            "runs": {name: dataclasses.asdict(run) for name, run in runs.items()}}
  (out_dir / "curves.json").write_text(json.dumps(record, indent=1))
  try:
    import matplotlib  # the 'bench' extra; the plot is optional
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot")
    return
  fig, ax = plt.subplots(figsize=(7, 4))
  # Dashed over solid: where the curves agree, both stay visible.
  for (name, run), style in zip(runs.items(), ("-", "--")):
    ax.plot(run.losses, style, label=f"{name} ({run.implementation.split(' ')[0]})")
  for what, floor in floors.items():
    ax.axhline(floor, color="gray", linestyle=":", linewidth=1)
    ax.annotate(what, (0, floor), textcoords="offset points", xytext=(2, 2), fontsize=8)
  ax.set(xlabel="step", ylabel="training loss (nats)",
         title=f"Flax LM, seq {cfg.seq}, {cfg.activation_dtype}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_dir / "loss_curves.png", dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv=None) -> tuple[Config, argparse.Namespace]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="the tiny CPU preset (flags given as well override it)")
  # Config fields: None means the preset's value.
  for field in dataclasses.fields(Config):
    flag = "--" + field.name.replace("_", "-")
    if isinstance(field.default, bool):
      p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
    elif field.name == "dtype":
      p.add_argument(flag, default=None, choices=["float32", "bfloat16", "float16"],
                     help="activations (default: bfloat16 on a GPU, float32 elsewhere)")
    else:
      p.add_argument(flag, type=type(field.default), default=None,
                     help=f"default {field.default} ({getattr(QUICK, field.name)} with --quick)")
  p.add_argument("--attention", choices=["both", *ATTENTIONS], default="both")
  p.add_argument("--log-every", type=int, default=None, help="rows of the loss table")
  p.add_argument("--out-dir", type=pathlib.Path, default=None,
                 help="write curves.json and loss_curves.png there")
  args = p.parse_args(argv)
  preset = QUICK if args.quick else Config()
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if getattr(args, f.name) is not None}
  return dataclasses.replace(preset, **overrides), args


def main(argv=None) -> dict:
  """Runs the comparison; returns {"config", "loss_floors", "runs": {name: RunResult},
  "max_loss_difference"} for callers such as the tests."""
  cfg, args = parse_args(argv)
  print(f"{jax.devices()[0].device_kind}: {cfg}; activations {cfg.activation_dtype}")
  batches, entropy = make_batches(cfg)
  floors = loss_floors(cfg, entropy)
  names = RUN_ORDER if args.attention == "both" else (args.attention,)
  runs = {name: train(cfg, name, batches) for name in names}
  print_report(cfg, runs, floors, args.log_every or max(1, cfg.steps // 15))
  if args.out_dir is not None:
    save_outputs(args.out_dir, cfg, runs, floors)
    print(f"wrote {args.out_dir}/curves.json")
  return {"config": cfg, "loss_floors": floors, "runs": runs,
          "max_loss_difference": max_loss_difference(runs)}


if __name__ == "__main__":
  main()
