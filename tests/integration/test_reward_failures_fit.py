"""A reward that fails on every sample ends the run with one line after ``reward.max_failed_steps``
steps, ``last.ckpt`` saved; a reward factory given by import path is refused at start-up."""

from __future__ import annotations

import csv
import sys

import pytest
from helpers.cli_runs import fit_fails_with_one_line, rl_callbacks, small_fit_args

# the README's reward ("Your model, your data, your reward"): it reads chat completions, so on the
# built-in task's string prompts every sample raises TypeError
README_REWARD = """
def accuracy(completions, **kwargs):
    return [float(c[0]["content"].strip() == "4") for c in completions]


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        return [0.0 for _ in completion_ids]

    return soft_overlong_punishment_reward
"""


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "failing_rewards.py").write_text(README_REWARD)
    sys.modules.pop("failing_rewards", None)
    yield tmp_path
    sys.modules.pop("failing_rewards", None)


def _args(tmp_path, reward: dict, steps: int) -> list[str]:
    callbacks = rl_callbacks(tmp_path)
    for callback in callbacks:
        if callback["class_path"] == "lit_offpolicy.callbacks.Rollout":
            callback["init_args"]["reward"] = reward
            callback["init_args"]["validation"]["every_n_steps"] = 100
    return callbacks


def test_a_reward_failing_on_every_sample_stops_the_run_after_max_failed_steps(
    user_rewards, tiny_model_dir, capsys
):
    out = user_rewards / "out"
    reward = {"fn": "failing_rewards:accuracy", "timeout": 30, "max_failed_steps": 2}
    args = small_fit_args("grpo", tiny_model_dir, out, 6, _args(out, reward, 6))
    line = fit_fails_with_one_line(args, capsys)
    assert line.startswith(
        "lit-offpolicy: error: reward.fn: reward 'accuracy' failed on every sample: 'accuracy' raised "
        "TypeError: string indices must be integers"
    ), line
    assert "for 2 steps in a row (reward.max_failed_steps=2); saved " in line
    checkpoint = line.rsplit("saved ", 1)[1]
    assert checkpoint.endswith("last.ckpt") and (out / "checkpoints" / "last.ckpt").is_file()
    ((path),) = (out / "logs").glob("*/version_*/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    column = "reward/fn/accuracy/error_fraction"
    errors = [float(row[column]) for row in rows if row.get(column)]
    assert errors and set(errors) == {1.0}  # the failing step's own row is not flushed before the stop
    names = set(rows[0])
    assert "reward/fn/accuracy/none_fraction" in names and "reward/accuracy/mean" not in names
    assert not [name for name in names if name.startswith("critic/")]  # GRPO has no critic


def test_a_reward_factory_by_import_path_ends_with_one_line(user_rewards, tiny_model_dir, capsys):
    out = user_rewards / "out"
    reward = {"fn": "failing_rewards:get_soft_overlong_punishment", "timeout": None}
    args = small_fit_args("grpo", tiny_model_dir, out, 1, _args(out, reward, 1))
    line = fit_fails_with_one_line(args, capsys)
    assert "takes (max_completion_len, soft_punish_cache), not a reward's completions and **kwargs" in line
    assert "{class_path: failing_rewards.get_soft_overlong_punishment, init_args:" in line
