"""What a ``lit-offpolicy fit`` with the vLLM engine prints, and what it refuses before vLLM loads."""

import os
import re
import subprocess
import sys

import pytest
from helpers import CONFIGS, subprocess_env
from helpers.cli_runs import fit_fails_with_one_line

from lit_offpolicy.models import create_tiny_model

pytestmark = pytest.mark.slow

VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
MAX_LINES = 15
"""Issue #33: a 3-step run prints at most this many lines besides its progress bar."""
# a frame of the run's progress bar (StepProgress: "RL step"; Lightning's "Training" before it)
BAR_FRAME = re.compile(r"(RL step|Training|step): *(\d+%)?\|[^|]*\|[^\[]*\[[^\]]*\]")


def console_lines(output: str) -> list[str]:
    """The lines a user reads: of each line the text after its last carriage return (what a terminal
    shows), without the run's progress-bar frames; blank lines left out."""
    shown = (BAR_FRAME.sub("", line.split("\r")[-1]).strip() for line in output.split("\n"))
    return [line for line in shown if line]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def vllm_fit_args(model_dir: str, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--config",
        str(CONFIGS / "rollout" / "vllm.yaml"),
        "--model.init_args.model_path",
        model_dir,
        "--trainer.max_steps",
        "3",
        "--data.batch_size",
        "2",
        "--data.num_val_samples",
        "4",
        *extra,
    ]


def test_a_three_step_vllm_fit_prints_at_most_15_lines_and_logs_vllm_to_a_file(model_dir, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "lit_offpolicy", *vllm_fit_args(model_dir)],
        cwd=tmp_path,  # the configs write under outputs/
        env=subprocess_env(**VLLM_ENV),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = console_lines(run.stdout + run.stderr)
    assert len(lines) <= MAX_LINES, "\n".join(lines)
    (log_file,) = tmp_path.glob("outputs/logs/rl/version_0/vllm.log")
    (said,) = [line for line in lines if "vLLM's log" in line]
    assert str(log_file.relative_to(tmp_path)) in said and "WARNING" in said
    log = log_file.read_text()
    assert "WARNING" in log  # vLLM's start-up warnings went there
    assert "RotaryEmbedding: Failed to load weights" not in log  # said at every sync, benign
    for noise in ("INFO", "Setting accelerator to CPU", "srun", "Writing model shards", "FutureWarning"):
        assert not any(noise in line for line in lines), noise


def test_prompts_and_responses_longer_than_the_model_are_refused_before_vllm_loads(
    model_dir, capsys, monkeypatch
):
    def no_vllm():
        raise AssertionError("vLLM was loaded before the lengths were checked")

    monkeypatch.setattr("lit_offpolicy.rollout.vllm_engine.import_vllm", no_vllm)
    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(os.environ.get("TMPDIR", "/tmp"))
    line = fit_fails_with_one_line(vllm_fit_args(model_dir, "--data.max_prompt_length", "200"), capsys)
    for text in ("data.max_prompt_length=200", "sampling.max_tokens=5", "205", "max_position_embeddings=128"):
        assert text in line, line


def test_a_prompt_too_long_for_the_engine_during_the_fit_ends_with_one_line(model_dir, capsys, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    from lit_offpolicy.rollout import EngineLimitError

    def too_long(self, subcommand):  # what VLLMEngine.generate raises for such a prompt
        raise EngineLimitError("a prompt of 130 tokens does not fit the vLLM engine's max_model_len=128")

    monkeypatch.setattr(LightningCLI, "_run_subcommand", too_long)
    monkeypatch.chdir(os.environ.get("TMPDIR", "/tmp"))
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.init_args.model_path", model_dir]
    line = fit_fails_with_one_line(args, capsys)
    assert line.endswith("a prompt of 130 tokens does not fit the vLLM engine's max_model_len=128")
