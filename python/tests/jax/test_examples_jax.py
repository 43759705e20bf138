"""The JAX example (python/examples/jax_train_lm_head.py) runs, and its loss falls, with both of
xent.jax's losses."""

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jax_train_lm_head.py"


def _example():
    spec = importlib.util.spec_from_file_location("jax_train_lm_head", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    module = _example()
    if not module.TEXT.exists():
        pytest.skip(f"{module.TEXT} is not on this system (Debian ships it)")
    return module


@pytest.mark.parametrize("fused", [True, False], ids=["linear_cross_entropy", "cross_entropy"])
def test_loss_falls_within_a_few_steps(example, fused):
    losses, vocab = example.train(40, batch=64, fused=fused)
    assert len(losses) == 40
    assert all(math.isfinite(v) for v in losses), losses
    # A fresh head predicts about uniformly: log V at the start.
    assert abs(losses[0] - math.log(vocab)) < 1.0
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.85 * first, (first, last)


def test_both_losses_give_the_same_first_step(example):
    fused, _ = example.train(1, batch=32, fused=True)
    logits, _ = example.train(1, batch=32, fused=False)
    assert fused[0] == pytest.approx(logits[0], rel=1e-5)


def test_main_writes_the_curve_and_prints_the_final_loss(example, tmp_path, capsys):
    assert example.main(["--steps", "5", "--batch", "16", "--out", str(tmp_path)]) == 0
    rows = (tmp_path / "jax_lm_head_loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss" and len(rows) == 6
    printed = capsys.readouterr().out
    assert "5 steps of 16" in printed and "over the last 5" in printed
    assert (tmp_path / "jax_lm_head_loss.png").exists() == (
        importlib.util.find_spec("matplotlib") is not None
    )
