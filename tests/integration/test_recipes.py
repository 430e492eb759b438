"""The GSM8K GRPO recipe: its CPU twin trains a few steps end to end from the commands its header
gives (a tiny Qwen2, our GSM8K-layout fixture through prepare-data, the gsm8k and format rewards);
the GPU recipe parses into a complete config."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import yaml
from helpers import FIXTURES, REPO

from lit_offpolicy.cli import main
from lit_offpolicy.core.tensorboard import latest_run, read_scalars
from lit_offpolicy.examples import judge_data
from lit_offpolicy.rewards import CodeExecutionReward

FIXTURE = FIXTURES / "gsm8k_tiny.jsonl"
CODE_FIXTURE = FIXTURES / "code_tiny.jsonl"
RECIPES = REPO / "configs" / "recipes"
UNTRAINED_QWEN2 = ("--model.init_args.model_path", "outputs/tiny-qwen2")


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
    """configs/recipes/code_grpo_cpu.yaml through the CLI, from the untrained model instead of its warm-up
    (benchmarks/learning/recipe_learning.py runs that): the reward runs every sample's code in the sandbox
    (the random model writes no code block: 0 and malformed); the fixture's own reference solutions, fenced
    as the warm-up learns them (column `solution`), score 1 each, so the tests themselves are right."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    (tmp_path / "tests" / "fixtures" / "code_tiny.jsonl").write_bytes(CODE_FIXTURE.read_bytes())
    main(["create-tiny-model", "outputs/tiny-qwen2", "--arch", "qwen2"])
    recipe = str(REPO / "configs" / "recipes" / "code_grpo_cpu.yaml")
    main(["fit", "--config", recipe, "--trainer.max_steps", "2", *UNTRAINED_QWEN2])  # 2 RL steps

    run = latest_run(tmp_path / "outputs" / "code-tiny" / "logs" / "grpo")
    assert [value for _, value in read_scalars(run, "reward/fn/CodeExecutionReward/none_fraction")] == [
        0.0,
        0.0,
    ]
    assert len(read_scalars(run, "reward/malformed_fraction")) == 2
    rows = [json.loads(line) for line in CODE_FIXTURE.read_text().splitlines()]
    assert [row["solution"] for row in rows] == [f"```python\n{row['code']}\n```" for row in rows]
    solutions = [row["solution"] for row in rows]
    scores = CodeExecutionReward(timeout_s=10.0)(solutions, test_list=[row["test_list"] for row in rows])
    assert scores.scores == [1.0] * len(rows)


def test_the_judge_recipe_trains_with_a_language_model_as_judge(tmp_path, monkeypatch):
    """configs/recipes/judge_grpo_cpu.yaml through the CLI from the untrained model, with the controlled
    judge of tests/rewards/test_judge.py at outputs/judge (the recipe's grader is
    benchmarks/learning/recipe_learning.py's): it rates by the template's last character, which the recipe's
    template ends without a digit, so every answer is unparsed and counted so."""
    from rewards.test_judge import write_controlled_judge

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    main(["create-tiny-model", "outputs/tiny-init"])
    write_controlled_judge(tmp_path / "outputs" / "judge", "outputs/tiny-init")
    recipe = str(REPO / "configs" / "recipes" / "judge_grpo_cpu.yaml")
    main(
        [
            "fit",
            "--config",
            recipe,
            "--trainer.max_steps",
            "2",
            "--model.init_args.model_path",
            "outputs/tiny-init",
            *("--data.batch_size", "8"),  # of 64: every round of sampling is judged, up to 6 a step
        ]
    )

    run = latest_run(tmp_path / "outputs" / "judge-tiny" / "logs" / "grpo")
    unparsed = [value for _, value in read_scalars(run, "reward/judge_unparsed_fraction")]
    none = [value for _, value in read_scalars(run, "reward/fn/JudgeReward/none_fraction")]
    assert unparsed == none == [1.0, 1.0]
    assert len(read_scalars(run, "reward/fn/exact/mean")) == 2


@pytest.mark.parametrize(
    "recipe", ["code_sft_cpu", "code_grpo_cpu", "judge_sft_cpu", "judge_grpo_cpu"], ids=str
)
def test_the_cpu_recipes_and_their_warm_ups_are_complete_configs(recipe, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(RECIPES / f"{recipe}.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["model_path"]


def _yaml(name: str) -> dict:
    return yaml.safe_load((RECIPES / name).read_text())


def test_each_rl_recipe_starts_from_what_its_warm_up_writes():
    """The warm-ups' HFExport directories are the RL recipes' model paths; the judge's grader is trained
    on the files judge_data writes, with the judge's own template, and its ratings parse."""
    exports = {
        name: next(c for c in _yaml(name)["trainer"]["callbacks"] if c["class_path"].endswith("HFExport"))
        for name in ("code_sft_cpu.yaml", "judge_sft_cpu.yaml")
    }
    assert (
        _yaml("code_grpo_cpu.yaml")["model"]["init_args"]["model_path"]
        == (exports["code_sft_cpu.yaml"]["init_args"]["dirpath"])
    )
    rollout = _yaml("judge_grpo_cpu.yaml")["trainer"]["callbacks"][0]["init_args"]
    judge = rollout["reward"]["fn"][1]["init_args"]
    assert judge["model_path"] == exports["judge_sft_cpu.yaml"]["init_args"]["dirpath"]
    assert judge["template"] == judge_data.TEMPLATE
    assert _yaml("judge_grpo_cpu.yaml")["model"]["init_args"]["model_path"] == "outputs/sft-tiny"
    assert _yaml("judge_sft_cpu.yaml")["data"]["train_files"] == ["outputs/judge-data/train.jsonl"]
    assert _yaml("judge_sft_cpu.yaml")["data"]["val_files"] == ["outputs/judge-data/val.jsonl"]
    parse = re.compile(judge["parser"])
    assert [parse.search(r).group(1) for r in (judge_data.RIGHT, judge_data.WRONG)] == ["9", "0"]


def test_the_code_recipe_scores_every_problem_at_every_step():
    """docs/recipes.md: its rise is measurable because each step's reward/mean averages all of the
    fixture's problems (which ones a step drew added as much noise as the gain) and val/accuracy is
    greedy pass@1 on all of them."""
    data = _yaml("code_grpo_cpu.yaml")["data"]
    problems = len(CODE_FIXTURE.read_text().splitlines())
    assert data["train_files"] == data["val_files"] == ["tests/fixtures/code_tiny.jsonl"]
    assert data["batch_size"] == data["num_val_samples"] == problems


def test_the_judge_is_taught_to_rate_9_exactly_the_sums(tmp_path):
    judge_data.main([str(tmp_path), "--train", "400", "--val", "20"])
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 400 and len((tmp_path / "val.jsonl").read_text().splitlines()) == 20
    form = re.compile(r"Rate (\d+)\+(\d+)=(.*) \(the sum is (\d+)\) from 0 to 9: ")
    right = 0
    for row in rows:
        a, b, completion, total = form.fullmatch(row["prompt"]).groups()
        assert int(total) == int(a) + int(b)
        assert row["answer"] == ("9" if completion == total else "0")
        right += row["answer"] == "9"
    assert 0.4 < right / len(rows) < 0.6  # half right: the grader cannot score well by one answer
