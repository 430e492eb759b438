"""The degenerate-reward guard (``rollout.degenerate.DegenerateRewardDetector``, warned by the rollout
callbacks): one line per metric that holds its degenerate value for N RL steps in a row; issue #47."""

from __future__ import annotations

import lightning as L
import pytest
from helpers.fits import make_data, make_rollout, make_trainer

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.rollout.degenerate import DegenerateRewardDetector


def _feed(detector: DegenerateRewardDetector, steps: list[dict[str, float]]) -> list[list[str]]:
    return [detector.observe(step, metrics) for step, metrics in enumerate(steps)]


def _fired(warnings: list[list[str]]) -> dict[int, list[str]]:
    return {step: lines for step, lines in enumerate(warnings) if lines}


def test_a_malformed_fraction_held_at_one_warns_once_at_the_nth_step():
    steps = [{"reward/malformed_fraction": 1.0, "reward/std": 0.3, "reward/mean": 0.0}] * 12
    fired = _fired(_feed(DegenerateRewardDetector(steps=5), steps))
    assert list(fired) == [4]
    (line,) = fired[4]
    assert "\n" not in line
    assert line.startswith("lit-offpolicy: warning: degenerate reward: reward/malformed_fraction has been 1 ")
    assert "for 5 RL steps in a row (to step 4, reward/mean 0)" in line
    assert "```python" in line and "SFT" in line and "configs/recipes/code_sft_cpu.yaml" in line


def test_each_metric_is_named_once_in_its_own_line():
    steps = [
        {
            "reward/malformed_fraction": 1.0,
            "reward/judge_unparsed_fraction": 1.0,
            "reward/unscored_fraction": 1.0,
            "reward/std": 0.0,
        }
    ] * 6
    fired = _fired(_feed(DegenerateRewardDetector(steps=3), steps))
    assert list(fired) == [2]
    names = [line.split("degenerate reward: ")[1].split(" has been")[0] for line in fired[2]]
    assert names == [
        "reward/malformed_fraction",
        "reward/judge_unparsed_fraction",
        "reward/unscored_fraction",
        "reward/std",
    ]
    judge, unscored, constant = fired[2][1:]
    assert "parser" in judge and "configs/recipes/judge_sft_cpu.yaml" in judge
    assert "raised, timed out or returned None" in unscored
    assert "same reward" in constant and "advantages are 0" in constant


@pytest.mark.parametrize(
    "values",
    [
        [1.0] * 4 + [0.75] + [1.0] * 4,  # broken by one step under 1: never 5 in a row
        [0.99] * 10,  # almost, not all
        [None] * 10,  # absent (no judge in the run)
        [1.0, None] * 5,  # a step without the metric breaks the run
    ],
    ids=["broken-run", "below-one", "absent", "absent-between"],
)
def test_no_warning_unless_held_for_n_steps(values):
    steps = [{"reward/judge_unparsed_fraction": v} if v is not None else {} for v in values]
    assert not _fired(_feed(DegenerateRewardDetector(steps=5), steps))


def test_a_spread_above_zero_is_not_constant():
    steps = [{"reward/std": 1e-3}] * 10
    assert not _fired(_feed(DegenerateRewardDetector(steps=5), steps))


def test_a_metric_that_recovers_and_falls_back_is_not_named_twice():
    steps = [{"reward/malformed_fraction": v} for v in [1.0] * 3 + [0.5] + [1.0] * 3]
    assert list(_fired(_feed(DegenerateRewardDetector(steps=3), steps))) == [2]


@pytest.mark.slow  # a tiny run's console, not floats: test-numerics leaves it out
def test_a_run_that_never_writes_the_answer_format_is_told_so(tiny_model_dir, capsys):
    """The untrained tiny Llama never writes gsm8k's '#### N' line: every sample is malformed and scores
    0, so reward/malformed_fraction and reward/std name themselves, once each, on stderr."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(model_path=tiny_model_dir, advantage="grpo")
    trainer = make_trainer([make_rollout(reward="gsm8k")], max_steps=6)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    lines = [line for line in capsys.readouterr().err.splitlines() if "degenerate reward" in line]
    assert [line.split(": ")[3].split(" has")[0] for line in lines] == [
        "reward/malformed_fraction",
        "reward/std",
    ]
    assert all("(to step 4, reward/mean 0)" in line for line in lines)
