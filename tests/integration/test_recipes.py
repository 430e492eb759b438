"""The GSM8K GRPO recipe: its CPU twin trains a few steps end to end from the commands its header
gives (a tiny Qwen2, our GSM8K-layout fixture through prepare-data, the gsm8k and format rewards);
the GPU recipe parses into a complete config."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml
from helpers import FIXTURES, REPO

from lit_offpolicy.cli import main
from lit_offpolicy.core.tensorboard import latest_run, read_scalars
from lit_offpolicy.rewards import CodeExecutionReward

FIXTURE = FIXTURES / "gsm8k_tiny.jsonl"
CODE_FIXTURE = FIXTURES / "code_tiny.jsonl"


@pytest.mark.slow
def test_the_cpu_twin_trains_from_its_own_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe writes under outputs/, here tmp_path/outputs
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    main(["create-tiny-model", "outputs/tiny-qwen2", "--arch", "qwen2"])
    main(
        [
            "prepare-data",
            "gsm8k",
            "--input",
            str(FIXTURE),
            "--val-size",
            "8",
            "--output",
            "outputs/gsm8k-tiny",
        ]
    )
    recipe = str(REPO / "configs" / "recipes" / "gsm8k_grpo_cpu.yaml")
    main(["fit", "--config", recipe, "--trainer.max_steps", "3", "--data.batch_size", "4"])

    run = latest_run(tmp_path / "outputs" / "gsm8k-tiny" / "logs" / "grpo")
    assert [step for step, _ in read_scalars(run, "reward/fn/gsm8k/mean")] == [0, 1, 2]
    assert len(read_scalars(run, "reward/fn/FormatReward/mean")) == 3
    assert [step for step, _ in read_scalars(run, "val/openai/gsm8k/accuracy")] == [0]
    assert len(read_scalars(run, "actor/kl_loss")) == 3
    assert (tmp_path / "outputs" / "gsm8k-tiny" / "actor" / "config.json").is_file()
    assert (tmp_path / "outputs" / "gsm8k-tiny" / "checkpoints" / "last.ckpt").is_file()


def test_the_gpu_recipe_is_a_complete_config(tmp_path, monkeypatch, capsys):
    """``--print_config`` resolves every class and option without loading the model or the data."""
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "recipes" / "gsm8k_grpo.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    rollout = config["trainer"]["callbacks"][0]["init_args"]
    assert rollout["engine"]["class_path"] == "lit_offpolicy.rollout.VLLMEngineSpec"
    assert (rollout["sampling"]["n"], rollout["sampling"]["max_tokens"]) == (5, 1024)
    assert rollout["reward"]["fn"] == "math_verify"
    assert config["data"]["answer_key"] == "reward_model.ground_truth"
    assert config["model"]["init_args"]["optim"]["lr"] == 1.0e-6


@pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (CI runs as root)")
def test_the_code_recipe_trains_with_sandboxed_code_rewards(tmp_path, monkeypatch):
    """configs/recipes/code_grpo_cpu.yaml through the CLI: the reward runs every sample's code in the
    sandbox (the random model writes no code block: 0 and malformed); the fixture's own reference
    solutions score 1 each, so the tests themselves are right."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    (tmp_path / "tests" / "fixtures" / "code_tiny.jsonl").write_bytes(CODE_FIXTURE.read_bytes())
    main(["create-tiny-model", "outputs/tiny-qwen2", "--arch", "qwen2"])
    recipe = str(REPO / "configs" / "recipes" / "code_grpo_cpu.yaml")
    main(["fit", "--config", recipe, "--trainer.max_steps", "2"])

    run = latest_run(tmp_path / "outputs" / "code-tiny" / "logs" / "grpo")
    assert [value for _, value in read_scalars(run, "reward/fn/CodeExecutionReward/none_fraction")] == [
        0.0,
        0.0,
    ]
    assert len(read_scalars(run, "reward/malformed_fraction")) == 2
    rows = [json.loads(line) for line in CODE_FIXTURE.read_text().splitlines()]
    references = [f"```python\n{row['code']}\n```" for row in rows]
    scores = CodeExecutionReward(timeout_s=10.0)(references, test_list=[row["test_list"] for row in rows])
    assert scores.scores == [1.0] * len(rows)


def test_the_judge_recipe_trains_with_a_language_model_as_judge(tmp_path, monkeypatch):
    """configs/recipes/judge_grpo_cpu.yaml through the CLI, with the controlled judge of
    tests/rewards/test_judge.py at outputs/judge: it rates by the template's last character, the
    completion's, so its parsed share is the share of completions that end in a digit."""
    from rewards.test_judge import write_controlled_judge

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    main(["create-tiny-model", "outputs/tiny-init"])
    write_controlled_judge(tmp_path / "outputs" / "judge", "outputs/tiny-init")
    recipe = str(REPO / "configs" / "recipes" / "judge_grpo_cpu.yaml")
    main(["fit", "--config", recipe, "--trainer.max_steps", "2"])

    run = latest_run(tmp_path / "outputs" / "judge-tiny" / "logs" / "grpo")
    unparsed = [value for _, value in read_scalars(run, "reward/judge_unparsed_fraction")]
    none = [value for _, value in read_scalars(run, "reward/fn/JudgeReward/none_fraction")]
    assert len(unparsed) == 2 and unparsed == pytest.approx(none, abs=1e-6)  # float32 logs of k / 64
    assert len(read_scalars(run, "reward/fn/exact/mean")) == 2
