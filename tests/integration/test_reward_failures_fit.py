"""A reward that fails on every sample ends the run with one line after ``reward.max_failed_steps``
steps, ``last.ckpt`` saved; a reward factory given by import path is refused at start-up; a reward
worker SIGKILLed mid-step is replaced and its samples scored again, and one that dies on every call
ends the run with one line."""

from __future__ import annotations

import csv
import sys

import pytest
from helpers.cli_runs import fit_fails_with_one_line, read_metrics, rl_callbacks, small_fit_args

from lit_offpolicy.cli import main

# the README's reward ("Your model, your data, your reward"): it reads chat completions, so on the
# built-in task's string prompts every sample raises TypeError
README_REWARD = """
import os
import signal
from pathlib import Path


def accuracy(completions, **kwargs):
    return [float(c[0]["content"].strip() == "4") for c in completions]


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        return [0.0 for _ in completion_ids]

    return soft_overlong_punishment_reward


def killed_once(completions, answer, **kwargs):
    try:  # the first call only, made atomic (two workers may score at once): SIGKILL, as the OOM killer
        os.close(os.open(Path(__file__).with_name("killed"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return [float(c.strip() == a) for c, a in zip(completions, answer)]
    os.kill(os.getpid(), signal.SIGKILL)


def always_killed(completions, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "failing_rewards.py").write_text(README_REWARD)
    sys.modules.pop("failing_rewards", None)
    yield tmp_path
    sys.modules.pop("failing_rewards", None)


def _args(tmp_path, reward: dict, steps: int, validation_every: int | None = 100) -> list[str]:
    callbacks = rl_callbacks(tmp_path)
    for callback in callbacks:
        if callback["class_path"] == "lit_offpolicy.callbacks.Rollout":
            callback["init_args"]["reward"] = reward
            callback["init_args"]["validation"] = {"every_n_steps": validation_every, "stop_at": None}
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


def test_a_reward_worker_killed_mid_step_is_replaced_and_the_run_goes_on(user_rewards, tiny_model_dir):
    """The first scoring call SIGKILLs its worker: the step's samples are scored again by a new worker
    (none counts as an error), ``reward/worker_restarts`` logs the one restart, and all steps run."""
    out = user_rewards / "out"
    reward = {"fn": "failing_rewards:killed_once", "timeout": 60, "workers": 2}
    main(small_fit_args("grpo", tiny_model_dir, out, 3, _args(out, reward, 3, validation_every=None)))
    assert (user_rewards / "killed").exists()
    rows = [row for row in read_metrics(out / "logs") if row.get("reward/worker_restarts")]
    assert [float(row["reward/worker_restarts"]) for row in rows] == [1.0, 0.0, 0.0]
    assert {float(row["reward/error_fraction"]) for row in rows} == {0.0}
    assert (out / "checkpoints" / "last.ckpt").is_file()


def test_a_reward_that_kills_every_worker_ends_the_run_with_one_line(user_rewards, tiny_model_dir, capsys):
    out = user_rewards / "out"
    reward = {"fn": "failing_rewards:always_killed", "timeout": 60, "max_worker_restarts": 2}
    args = small_fit_args("grpo", tiny_model_dir, out, 3, _args(out, reward, 3, validation_every=None))
    line = fit_fails_with_one_line(args, capsys)
    assert line.startswith(
        "lit-offpolicy: error: reward.fn: reward 'always_killed': its worker process died 3 times in a row "
        "(killed by SIGKILL the last time), more than reward.max_worker_restarts=2"
    ), line
    checkpoint = line.rsplit("; saved ", 1)[1]
    assert (
        checkpoint == str(out / "checkpoints" / "last.ckpt") and (out / "checkpoints" / "last.ckpt").is_file()
    )
