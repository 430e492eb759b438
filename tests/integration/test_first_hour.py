"""Options that used to fail only after the first step, with a traceback, now end the command with one
line before it (issue #33): a micro-batch token budget smaller than a sample, and a ``--ckpt_path`` of
another algorithm's config. And the start-up line that says what ``trainer.max_steps`` counts."""

from __future__ import annotations

import lightning
import pytest
import torch
from helpers import REPO
from helpers.cli_runs import fit_fails_with_one_line

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.cli import main
from lit_offpolicy.training.options import KLOptions


@pytest.fixture(autouse=True)
def _no_traceback(monkeypatch):
    monkeypatch.delenv("LIT_OFFPOLICY_TRACEBACK", raising=False)


def fit(config: str, model_path) -> list[str]:
    return [
        "fit",
        "--config",
        str(REPO / "configs" / f"{config}.yaml"),
        "--model.init_args.model_path",
        str(model_path),
    ]


def test_a_token_budget_smaller_than_the_longest_sample_ends_with_one_line_before_the_first_step(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """configs/grpo.yaml: prompts up to data.max_prompt_length=64 tokens, responses up to
    sampling.max_tokens=5; a budget of 40 used to stop the first step that made a long sample."""
    monkeypatch.chdir(tmp_path)
    options = ["--model.init_args.update.max_tokens_per_micro_batch", "40", "--trainer.max_steps", "1"]
    error = fit_fails_with_one_line([*fit("grpo", tiny_model_dir), *options], capsys)
    assert error == (
        "lit-offpolicy: error: update.max_tokens_per_micro_batch=40 is smaller than the longest possible "
        "sample: data.max_prompt_length=64 + sampling.max_tokens=5 = 69 tokens; set it to at least 69 "
        "(or lower those options)"
    )


def ppo_checkpoint(model_dir: str, path) -> str:
    """A checkpoint of configs/ppo.yaml's components (actor, critic, reference), as Lightning saves one."""
    module = OffPolicyModule(
        model_path=model_dir, critic_path=model_dir, advantage="gae", kl=KLOptions(use_in_reward=True)
    )
    state = {"state_dict": module.state_dict(), "epoch": 0, "global_step": 0}
    torch.save({**state, "pytorch-lightning_version": lightning.__version__}, path)
    return str(path)


def test_another_algorithms_checkpoint_ends_with_one_line_naming_what_differs(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """A PPO checkpoint (critic, reference) given to configs/dapo.yaml (neither) used to end with
    load_state_dict's ``Unexpected key(s)`` traceback."""
    checkpoint = ppo_checkpoint(tiny_model_dir, tmp_path / "ppo.ckpt")
    monkeypatch.chdir(tmp_path)
    error = fit_fails_with_one_line([*fit("dapo", tiny_model_dir), "--ckpt_path", checkpoint], capsys)
    assert error.startswith(
        f"lit-offpolicy: error: --ckpt_path {checkpoint}: another configuration's checkpoint (the checkpoint "
        "has a critic, a reference model this run has not); "
    )
    assert "set model.init_args.model_path to that run's HFExport directory" in error


def test_the_start_up_says_how_many_optimizer_steps_max_steps_makes_an_rl_step(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """configs/dapo.yaml: 128 prompts x 4 samples in mini-batches of 128, 4 optimizer steps per RL step
    (stopped before the first step by another config's checkpoint)."""
    checkpoint = ppo_checkpoint(tiny_model_dir, tmp_path / "ppo.ckpt")
    monkeypatch.chdir(tmp_path)
    options = ["--ckpt_path", checkpoint, "--trainer.max_steps", "3"]
    with pytest.raises(SystemExit):
        main([*fit("dapo", tiny_model_dir), *options])
    assert (
        "lit-offpolicy: trainer.max_steps=3 counts optimizer steps; an RL step makes up to 4 "
        "(update.ppo_epochs=1 x 4 mini-batch(es) of update.mini_batch_size=128), so about 1 RL step(s)\n"
    ) in capsys.readouterr().out
