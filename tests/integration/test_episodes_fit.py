"""Multi-turn episodes through a CLI fit: configs/async.yaml with episodes of ``CountdownEnvironment``
(tests/helpers/episodes.py), trained asynchronously. The episodes themselves are tested on the engines
in tests/rollout/test_episodes.py."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import yaml
from helpers.fits import ASYNC_CONFIG

from lit_offpolicy.cli import main


@pytest.mark.slow
def test_async_fit_trains_on_episodes_through_the_cli(tiny_model_dir, tmp_path, monkeypatch):
    """configs/async.yaml with episodes of the CountdownEnvironment: 2 steps, env/* logged."""
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    config = yaml.safe_load(ASYNC_CONFIG.read_text())
    rollout = config["trainer"]["callbacks"][0]
    rollout["init_args"].update(
        reward={"fn": {"class_path": "helpers.HashReward"}, "timeout": None},
        sampling={"n": 2, "temperature": 1.0, "max_tokens": 4, "seed": 0},
        validation={"every_n_steps": 2},
        episodes={
            "environment": {"class_path": "helpers.episodes.CountdownEnvironment", "init_args": {"turns": 2}},
            "max_turns": 3,
            "max_response_tokens": 80,
        },
    )
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "logs"), "name": "episodes"},
    }
    main(
        [
            "fit",
            "--config",
            str(ASYNC_CONFIG),
            "--model.init_args.model_path",
            tiny_model_dir,
            "--trainer.max_steps",
            "2",
            "--trainer.logger",
            json.dumps(logger),
            "--trainer.callbacks",
            json.dumps([rollout]),
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--data.batch_size",
            "2",
            "--data.num_val_samples",
            "4",
        ]
    )
    (metrics,) = (tmp_path / "logs").glob("episodes/version_*/metrics.csv")
    with metrics.open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("actor/pg_loss")]
    assert len(rows) == 2
    # every episode took both turns: turn 1's tool call (an error), turn 2 done (its final turn may run
    # to max_tokens, which counts the episode as truncated, as a single-turn response at its limit)
    for row in rows:
        assert float(row["env/turns_mean"]) == 2.0 and float(row["env/tool_calls_mean"]) == 1.0
        assert float(row["env/tool_error_fraction"]) == 1.0
