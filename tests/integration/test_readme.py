"""The README's "Your model, your data, your reward" blocks, run as they are: its reward module and
its YAML, on a tiny Qwen2 and our GSM8K-layout fixture (only the model and data paths, and the
response length, are replaced)."""

from __future__ import annotations

import re
import sys

import pytest
from helpers import FIXTURES, REPO

from lit_offpolicy.cli import main
from lit_offpolicy.core.tensorboard import latest_run, read_scalars

SECTION = "## Your model, your data, your reward"


def readme_blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


@pytest.mark.slow
def test_your_model_your_data_your_reward(tmp_path, monkeypatch):
    (python,), (config,) = readme_blocks("python"), readme_blocks("yaml")
    assert len(config.strip().splitlines()) < 15, "the README promises under 15 lines"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    (tmp_path / "my_rewards.py").write_text(python)
    main(["create-tiny-model", "models/tiny-qwen2", "--arch", "qwen2"])
    fixture = FIXTURES / "gsm8k_tiny.jsonl"
    main(["prepare-data", "gsm8k", "--input", str(fixture), "--val-size", "8", "--output", "data/gsm8k"])
    config = config.replace("/models/Qwen2.5-0.5B-Instruct", "models/tiny-qwen2").replace(
        "max_tokens: 512", "max_tokens: 16"
    )
    (tmp_path / "my_run.yaml").write_text(config)
    grpo = str(REPO / "configs" / "grpo.yaml")
    main(
        [
            "fit",
            "--config",
            grpo,
            "--config",
            "my_run.yaml",
            "--trainer.max_steps",
            "2",
            "--data.batch_size",
            "4",
        ]
    )

    run = latest_run(tmp_path / "outputs" / "logs" / "rl")
    assert len(read_scalars(run, "reward/accuracy/mean")) == 2
    assert len(read_scalars(run, "reward/math_verify/mean")) == 2
    assert (tmp_path / "outputs" / "actor" / "config.json").is_file()
    assert (tmp_path / "outputs" / "checkpoints" / "last.ckpt").is_file()
