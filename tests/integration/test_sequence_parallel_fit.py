"""``update.sequence_parallel: 2`` through the CLI on 4 CPU ranks (gloo): 2 sequence groups of 2 ranks,
data-parallel over the groups, under DDP and under FSDP2. Each trains 2 RL steps and resumes from its
``last`` checkpoint for a third; the rows' exactness is tests/training/test_sequence_parallel.py's."""

from __future__ import annotations

import csv

import pytest
from helpers import CONFIGS
from helpers.cli_runs import (
    fit_fails_with_one_line,
    is_finite_number,
    rl_callbacks,
    run_cli,
    small_fit_args,
)


def _fit(model_dir: str, out, strategy: str, steps: int, *extra: str):
    args = small_fit_args("grpo", model_dir, out, steps, rl_callbacks(out))
    args += ["--trainer", str(CONFIGS / "strategy" / f"{strategy}.yaml"), "--trainer.accelerator", "cpu"]
    args += ["--trainer.devices", "4", "--model.init_args.update.sequence_parallel", "2", *extra]
    result = run_cli(*args, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow  # 4 processes, twice
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_sequence_groups_of_two_ranks_train_and_resume(tiny_model_dir, tmp_path, strategy):
    first = _fit(tiny_model_dir, tmp_path, strategy, 2)
    assert "update.sequence_parallel=2: 2 sequence group(s) of 2 ranks" in first.stderr
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()  # FSDP2's: a directory of shards
    _fit(tiny_model_dir, tmp_path, strategy, 3, "--ckpt_path", "last")
    logs = sorted((tmp_path / "logs").glob("*/version_*/metrics.csv"))  # the run's, then the resumed run's
    rows = [row for path in logs for row in csv.DictReader(path.open()) if row.get("actor/pg_loss")]
    steps = sorted(int(row["step"]) for row in rows)
    assert steps == [0, 1, 2], steps  # 2 steps, then the third after the resume
    assert all(is_finite_number(row["actor/pg_loss"]) for row in rows)
    assert all(float(row["actor/grad_norm"]) > 0 for row in rows)  # the hash reward gives advantages


def test_a_size_the_run_cannot_split_ends_with_one_line_before_the_ranks_start(
    tiny_model_dir, tmp_path, capsys
):
    args = small_fit_args("grpo", tiny_model_dir, tmp_path, 1, rl_callbacks(tmp_path))
    line = fit_fails_with_one_line([*args, "--model.init_args.update.sequence_parallel", "2"], capsys)
    assert line.endswith(
        "update.sequence_parallel=2 does not divide the 1 trainer ranks; allowed values: "
        "a divisor of the world size (1)"
    )
    three = ["--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "3"]
    line = fit_fails_with_one_line([*args, *three, "--model.init_args.update.sequence_parallel", "3"], capsys)
    assert "update.sequence_parallel=3 does not divide the model's 4 attention heads" in line
