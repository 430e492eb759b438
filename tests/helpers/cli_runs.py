"""Runs of the ``lit-offpolicy`` CLI on the shipped configs, small: the tiny model, a few steps, a CSV
logger, ``helpers.HashReward`` (given by class_path: an untrained model scores 0 everywhere with the
exact-match reward, which would leave every advantage and gradient 0), outputs under a test's directory."""

from __future__ import annotations

import copy
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import CONFIGS, REPO, subprocess_env
from lit_offpolicy.cli import main

RL_STEPS = 3
HASH_REWARD = {"fn": {"class_path": "helpers.HashReward"}, "timeout": None}


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def csv_logger(save_dir: Path, name: str) -> str:
    return json.dumps(
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(save_dir), "name": name},
        }
    )


def read_metrics(save_dir: Path) -> list[dict[str, str]]:
    (path,) = save_dir.glob("*/version_*/metrics.csv")
    with path.open() as file:
        return list(csv.DictReader(file))


def redirect(path: str, out: Path) -> str:
    """An output path of a config (``outputs/actor``) moved under ``out``."""
    return str(out / Path(path).name)


def rl_callbacks(out: Path) -> list[dict]:
    """The callbacks of configs/base/trainer.yaml: small rollouts, hash reward, outputs under ``out``."""
    base = yaml.safe_load((CONFIGS / "base" / "trainer.yaml").read_text())
    result = copy.deepcopy(base["callbacks"])
    for callback in result:
        init_args = callback.setdefault("init_args", {})
        if callback["class_path"] == "lit_offpolicy.callbacks.Rollout":
            init_args["reward"] = HASH_REWARD
            init_args["sampling"]["n"] = 4
            init_args["validation"]["every_n_steps"] = RL_STEPS
        if "dirpath" in init_args:
            init_args["dirpath"] = redirect(init_args["dirpath"], out)
    names = {c["class_path"].rsplit(".", 1)[-1] for c in result}
    assert names == {"Rollout", "ModelCheckpoint", "HFExport"}
    return result


def small_fit_args(config: str, model_dir: str, out: Path, steps: int, callbacks: list[dict]) -> list[str]:
    """``fit`` arguments for a short run of ``configs/<config>.yaml`` on the tiny model, output in ``out``."""
    return [
        "fit",
        "--config",
        str(CONFIGS / f"{config}.yaml"),
        "--model.init_args.model_path",
        model_dir,
        "--trainer.max_steps",
        str(steps),
        "--trainer.logger",
        csv_logger(out / "logs", config),
        "--trainer.callbacks",
        json.dumps(callbacks),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--data.batch_size",
        "4",
        "--data.num_val_samples",
        "8",
    ]


def is_finite_number(text: str) -> bool:
    return math.isfinite(float(text))


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m lit_offpolicy ARGS`` from the repository root."""
    env = subprocess_env()
    env.pop("LIT_OFFPOLICY_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "-m", "lit_offpolicy", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def fit_fails_with_one_line(args: list[str], capsys, alone: bool = False) -> str:
    """Run ``lit-offpolicy ARGS``; assert it exits 2 with one ``lit-offpolicy: error:`` line (with
    ``alone``: and nothing else on stderr) and no traceback; return that line."""
    line, stderr = fit_fails_with_one_line_and_stderr(args, capsys)
    if alone:
        assert stderr.splitlines() == [line], stderr[-2000:]
    return line


def fit_fails_with_one_line_and_stderr(args: list[str], capsys) -> tuple[str, str]:
    """``fit_fails_with_one_line``'s checks; that line and the whole stderr (the warnings before it)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    error_lines = [line for line in captured.err.splitlines() if line.startswith("lit-offpolicy: error:")]
    assert len(error_lines) == 1, captured.err[-2000:]
    assert "Traceback" not in captured.err + captured.out
    return error_lines[0], captured.err
