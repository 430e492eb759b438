"""``update.sequence_parallel: 2`` through the CLI on 4 CPU ranks (gloo): 2 sequence groups of 2 ranks,
data-parallel over the groups, under DDP and under FSDP2. Each trains 2 RL steps and resumes from its
``last`` checkpoint for a third; the rows' exactness is tests/training/test_sequence_parallel.py's.
The four commands run one after another in the same 4 ranks (tests/helpers/cli_fits.py): one start-up
of each rank, not four. (README.md's 2-rank command runs in its own processes in CI's documented
commands.)"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from helpers import CONFIGS, REPO, subprocess_env
from helpers.cli_runs import (
    fit_fails_with_one_line,
    is_finite_number,
    rl_callbacks,
    small_fit_args,
)

STRATEGIES = ("fsdp", "ddp")


def _fit_args(model_dir: str, out, strategy: str, steps: int, *extra: str) -> list[str]:
    args = small_fit_args("grpo", model_dir, out, steps, rl_callbacks(out))
    args += ["--trainer", str(CONFIGS / "strategy" / f"{strategy}.yaml"), "--trainer.accelerator", "cpu"]
    return [*args, "--trainer.devices", "4", "--model.init_args.update.sequence_parallel", "2", *extra]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    """Per strategy: 2 steps into its own directory, then ``--ckpt_path last`` to 3, all in one launch;
    the directories and the stderr of each first fit."""
    base = tmp_path_factory.mktemp("sequence_parallel_fit")
    outs = {strategy: base / strategy for strategy in STRATEGIES}
    commands = []
    for strategy, out in outs.items():
        commands.append(_fit_args(tiny_model_dir, out, strategy, 2))
        commands.append(_fit_args(tiny_model_dir, out, strategy, 3, "--ckpt_path", "last"))
    (base / "runs.json").write_text(json.dumps(commands))
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "cli_fits.py"), str(base / "runs.json")],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=400,  # 4 fits of 2-3 steps: about 90 s beside the rest of make test
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # the stderr of the ranks, command by command: rank 0's "cli_fits: command K" opens each
    per_command = result.stderr.split("cli_fits: command ")[1:]
    return {"outs": outs, "stderr": {s: per_command[2 * i] for i, s in enumerate(STRATEGIES)}}


@pytest.mark.slow  # 4 processes, 4 fits
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_sequence_groups_of_two_ranks_train_and_resume(runs, strategy):
    out = runs["outs"][strategy]
    assert "update.sequence_parallel=2: 2 sequence group(s) of 2 ranks" in runs["stderr"][strategy]
    assert (out / "checkpoints" / "last.ckpt").exists()  # FSDP2's: a directory of shards
    logs = sorted((out / "logs").glob("*/version_*/metrics.csv"))  # the run's, then the resumed run's
    assert len(logs) == 2, logs
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
