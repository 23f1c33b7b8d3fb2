"""examples/flax_lm.py: the Flax language model trained with Flax's default attention and with
pallas_attn.flax_attention_fn, in its --quick mode (float32 on the CPU, where pallas_attn runs its
portable blocked path), called in-process through main(argv) as the command line calls it."""

import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # examples/ is not an installed package

from examples import flax_lm  # noqa: E402

# Largest difference allowed between two float32 loss curves that differ only in how attention
# sums (one softmax over the row vs. pallas_attn's blocked online softmax; or, for remat, XLA's
# fusion of the recomputed blocks). A loss of 1-3 nats has a float32 rounding unit of 1.2e-7 to
# 2.4e-7, and 40 Adam steps carry a few units' difference forward; measured: 2.4e-7 over the quick
# run. 1e-5 leaves 40x room, while an attention that is wrong (a mask, a scale, a gradient) moves
# the loss by 1e-2 or more within a few steps.
LOSS_TOL = 1e-5


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """Both attentions, --quick, with nnx.remat around every block."""
  out_dir = tmp_path_factory.mktemp("flax_lm")
  return flax_lm.main(["--quick", "--remat", "--out-dir", str(out_dir)]), out_dir


@pytest.mark.parametrize("attention", list(flax_lm.ATTENTIONS))
def test_loss_falls(quick_run, attention):
  result, _ = quick_run
  losses = np.asarray(result["runs"][attention].losses)
  assert losses.shape == (flax_lm.QUICK.steps,) and np.all(np.isfinite(losses))
  # At init the loss is about ln(vocab) = 2.77 (2.96 measured); the quick run's last steps are
  # between 0.75 and 1.0 (the chain-only floor is 0.37). Halving it means the model is learning
  # the chain's transitions.
  assert losses[-5:].mean() < 0.5 * losses[:5].mean(), losses


def test_curves_agree(quick_run):
  result, _ = quick_run
  runs = result["runs"]
  assert runs["pallas_attn"].implementation.startswith("blocked_jax")
  assert result["max_loss_difference"] <= LOSS_TOL
  np.testing.assert_allclose(runs["pallas_attn"].losses, runs["flax"].losses, rtol=0,
                             atol=LOSS_TOL)


def test_remat_changes_no_loss(quick_run):
  """Batch i and the warm-up learning rates do not depend on --steps, so a short run without
  remat must reproduce the first steps of the remat run (the loss of step i uses the learning
  rates of steps < i: those of the warm-up, 5 steps in the quick preset)."""
  result, _ = quick_run
  steps = flax_lm.QUICK.warmup_steps + 1
  plain = flax_lm.main(["--quick", "--no-remat", "--attention", "pallas_attn", "--steps",
                        str(steps), "--timing-warmup", "1"])
  assert not plain["config"].remat and result["config"].remat
  np.testing.assert_allclose(plain["runs"]["pallas_attn"].losses,
                             result["runs"]["pallas_attn"].losses[:steps], rtol=0, atol=LOSS_TOL)


def test_writes_curves(quick_run):
  result, out_dir = quick_run
  record = json.loads((out_dir / "curves.json").read_text())
  assert record["config"]["remat"] is True
  assert set(record["runs"]) == set(flax_lm.ATTENTIONS)
  for name, run in record["runs"].items():
    assert run["losses"] == list(result["runs"][name].losses)
    assert len(run["step_ms"]) == flax_lm.QUICK.steps - flax_lm.QUICK.timing_warmup
    assert run["allocator_peak_bytes"] is None  # the CPU has no allocator statistics
  pytest.importorskip("matplotlib")
  assert (out_dir / "loss_curves.png").stat().st_size > 0
