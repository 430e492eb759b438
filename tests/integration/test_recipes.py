"""The GSM8K GRPO recipe: its CPU twin trains a few steps end to end from the commands its header
gives (a tiny Qwen2, our GSM8K-layout fixture through prepare-data, the gsm8k and format rewards);
the GPU recipe parses into a complete config."""

from __future__ import annotations

import sys

import pytest
import yaml
from helpers import FIXTURES, REPO

from lit_offpolicy.cli import main
from lit_offpolicy.core.tensorboard import latest_run, read_scalars

FIXTURE = FIXTURES / "gsm8k_tiny.jsonl"


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
