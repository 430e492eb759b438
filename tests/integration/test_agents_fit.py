"""A user's agent (tests/helpers/agents.py) trained through the CLI: synchronous and asynchronous
rollouts, 2 steps each, ``agent/*`` logged; an agent that fails on every episode ends the run with one
line naming it. The endpoint itself is tested in tests/rollout/test_agents.py."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import yaml
from helpers.cli_runs import fit_fails_with_one_line, fit_fails_with_one_line_and_stderr, run_cli
from helpers.fits import ASYNC_CONFIG

from lit_offpolicy.cli import main

AGENT = {
    "fn": "helpers.agents:completions_scored_by_reward",
    "max_prompt_tokens": 32,
    "max_response_tokens": 16,
}


def fit_args(model_dir: str, out, rollout: dict, steps: int = 2) -> list[str]:
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(out / "logs"), "name": "agent"},
    }
    return [
        "fit", "--config", str(ASYNC_CONFIG), "--model.init_args.model_path", model_dir,
        "--trainer.max_steps", str(steps), "--trainer.logger", json.dumps(logger),
        "--trainer.callbacks", json.dumps([rollout]), "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--data.batch_size", "2", "--data.num_val_samples", "4",
    ]  # fmt: skip


def rollout_callback(class_path: str, agent: dict, **options) -> dict:
    config = yaml.safe_load(ASYNC_CONFIG.read_text())
    rollout = config["trainer"]["callbacks"][0]
    init = {
        key: value
        for key, value in rollout["init_args"].items()
        if class_path.endswith("AsyncRollout") or "stale" not in key
    }
    init.update(
        sampling={"n": 2, "temperature": 1.0, "max_tokens": 4, "seed": 0},
        validation={"every_n_steps": 2},
        reward={"fn": {"class_path": "helpers.HashReward"}, "timeout": None},
        agent=agent,
        **options,
    )
    return {"class_path": class_path, "init_args": init}


@pytest.mark.slow
@pytest.mark.parametrize("callback", ["Rollout", "AsyncRollout"])
def test_an_agent_trains_through_the_cli(callback, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    rollout = rollout_callback(f"lit_offpolicy.callbacks.{callback}", AGENT)
    main(fit_args(tiny_model_dir, tmp_path, rollout))
    (metrics,) = (tmp_path / "logs").glob("agent/version_*/metrics.csv")
    with metrics.open() as file:
        rows = list(csv.DictReader(file))
    steps = [row for row in rows if row.get("actor/pg_loss")]
    assert len(steps) == 2
    for row in steps:  # two calls per episode, one branch (the second extends the first)
        assert float(row["agent/calls_mean"]) == 2.0 and float(row["agent/samples_per_episode"]) == 1.0
        assert float(row["agent/failed_fraction"]) == 0.0
        assert float(row["actor/grad_norm"]) > 0
    assert any(row.get("val/accuracy") for row in rows)  # validation ran the agent too


def test_an_agent_failing_on_every_episode_stops_the_run_with_one_line(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    agent = {**AGENT, "fn": "helpers.agents:raises"}
    rollout = rollout_callback("lit_offpolicy.callbacks.Rollout", agent)
    rollout["init_args"]["reward"]["max_failed_steps"] = 2
    line = fit_fails_with_one_line(fit_args(tiny_model_dir, tmp_path, rollout, steps=5), capsys)
    assert line.startswith(
        "lit-offpolicy: error: agent.fn: every episode failed; the first: agent helpers.agents:raises raised "
        "ValueError: the agent's own bug, for 2 steps in a row (reward.max_failed_steps=2)"
    ), line


@pytest.mark.slow  # 2 processes
def test_each_trainer_rank_serves_its_own_agents(tiny_model_dir, tmp_path):
    rollout = rollout_callback("lit_offpolicy.callbacks.Rollout", AGENT)
    ddp = ["--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2"]
    result = run_cli(*fit_args(tiny_model_dir, tmp_path, rollout), *ddp, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    (metrics,) = (tmp_path / "logs").glob("agent/version_*/metrics.csv")
    with metrics.open() as file:
        steps = [row for row in csv.DictReader(file) if row.get("actor/pg_loss")]
    assert len(steps) == 2
    assert all(float(row["agent/calls_mean"]) == 2.0 and float(row["actor/grad_norm"]) > 0 for row in steps)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        ("helpers.agents:user_text", "expected (client, row) or (base_url, api_key, row)"),
        ("helpers.agentz:two_calls", "cannot be imported"),
    ],
)
def test_a_wrong_agent_ends_with_one_line_before_any_model_loads(
    fn, expected, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    rollout = rollout_callback("lit_offpolicy.callbacks.Rollout", {**AGENT, "fn": fn})
    line, stderr = fit_fails_with_one_line_and_stderr(fit_args(tiny_model_dir, tmp_path, rollout), capsys)
    assert "Loading weights" not in stderr
    assert expected in line and f"agent.fn='{fn}'" in line, line
