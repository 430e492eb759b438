"""The README's "Your model, your data, your reward" blocks, run as a user runs them: the installed
``lit-offpolicy`` console script in a fresh directory holding ``my_rewards.py`` and ``my_run.yaml``
exactly as the README prints them, with a tiny Qwen2 and our GSM8K-layout fixture at the paths the
README names. Only the step count is changed, on the command line (``--trainer.max_steps``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES, REPO

from lit_offpolicy.cli import main
from lit_offpolicy.core.tensorboard import latest_run, read_scalars
from lit_offpolicy.models import create_tiny_model

SECTION = "## Your model, your data, your reward"
LIT_OFFPOLICY = Path(sys.executable).with_name("lit-offpolicy")
"""The console script a user runs (``lit_offpolicy.cli:main``), not ``main()`` in this process."""
MODEL = "models/Qwen2.5-0.5B-Instruct"
"""The README's model directory, relative to where the command runs."""


def readme_blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([str(LIT_OFFPOLICY), *args], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def make_eos_likely(directory: Path) -> None:
    """Give the random tiny model an eos at about 3 in 4 tokens, so that the README's
    ``max_tokens: 512`` stays and responses still end after a few tokens on the CPU: the last
    attention layer adds a constant 1000 to hidden dimension 0 (its value bias through ``o_proj``),
    which dominates the residual stream, and the eos row of the head reads that dimension with logit 5."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory)
    eos = AutoTokenizer.from_pretrained(directory).eos_token_id
    attention = model.model.layers[-1].self_attn
    with torch.no_grad():
        attention.v_proj.weight.zero_()
        attention.v_proj.bias.zero_()
        attention.v_proj.bias[0] = 1.0
        attention.o_proj.weight.zero_()
        attention.o_proj.weight[0, 0] = 1000.0
        # after the final RMSNorm dimension 0 is about norm.weight[0] * sqrt(hidden): scale it to 5
        scale = model.model.norm.weight[0] * model.config.hidden_size**0.5
        model.lm_head.weight[eos, 0] = 5.0 / scale
    model.save_pretrained(directory)


def test_readme_model_path_is_relative():
    """The README's model path is one the test (and a user) can create where they run."""
    (config,) = readme_blocks("yaml")
    assert f"model_path: {MODEL}" in config


def test_readme_is_a_short_page_that_links_the_figures():
    """A newcomer's page: under 200 lines; the benchmark figures and the status live in docs/benchmarks.md."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert "docs/benchmarks.md" in text and "benchmarks:start" not in text


@pytest.mark.slow
def test_your_model_your_data_your_reward(tmp_path, monkeypatch):
    (python,), (config,) = readme_blocks("python"), readme_blocks("yaml")  # its agent: test_agents.py
    assert len(config.strip().splitlines()) <= 15, "the README's run fits in 15 lines"
    (tmp_path / "my_rewards.py").write_text(python)
    (tmp_path / "my_run.yaml").write_text(config)
    # the user's model and data, made in this process (each console script start imports for seconds)
    create_tiny_model(tmp_path / MODEL, arch="qwen2")
    make_eos_likely(tmp_path / MODEL)
    fixture = FIXTURES / "gsm8k_tiny.jsonl"  # 64 rows: 56 for training, more than the README's batch_size
    monkeypatch.chdir(tmp_path)
    main(["prepare-data", "gsm8k", "--input", str(fixture), "--val-size", "8", "--output", "data/gsm8k"])
    grpo = str(REPO / "configs" / "grpo.yaml")
    # the one change to the README's run: 1 step instead of configs/base/trainer.yaml's 500
    run("fit", "--config", grpo, "--config", "my_run.yaml", "--trainer.max_steps", "1", cwd=tmp_path)

    run_dir = latest_run(tmp_path / "outputs" / "logs" / "rl")
    for name in ("accuracy", "math_verify"):  # each reward function's own mean, logged at the step
        scalars = read_scalars(run_dir, f"reward/fn/{name}/mean") or read_scalars(
            run_dir, f"reward/{name}/mean"
        )
        assert len(scalars) == 1, name
    assert (tmp_path / "outputs" / "actor" / "config.json").is_file()
    assert (tmp_path / "outputs" / "checkpoints" / "last.ckpt").is_file()
