"""The shipped configs through the ``lit-offpolicy`` CLI: every algorithm trains, ``--print_config`` gives a
config that runs as is, a bad option fails cleanly, and the SFT warm-up exports a loadable actor.

Real parts only (tiny Llama, HF engine, Lightning Trainer on CPU). Output paths go to pytest's tmp
directories. The RL runs replace the exact-match reward by ``helpers.HashReward`` (a RewardFn, the
public protocol, given by class_path): an untrained model scores 0 everywhere, which would leave every
advantage and gradient 0.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import CONFIGS
from helpers.cli_runs import (
    HASH_REWARD,
    RL_STEPS,
    class_path,
    csv_logger,
    fit_fails_with_one_line,
    is_finite_number,
    read_metrics,
    redirect,
    rl_callbacks,
    run_cli,
    small_fit_args,
)

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.cli import main
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer

ALGORITHMS = [
    "grpo",
    "ppo",
    "reinforce",
    "vanilla",
    "tis",
    "topr",
    "cispo",
    "kimi15",
    "gspo",
    "dapo",
    "dr_grpo",
    "distill",
]


class SaveActorAtEnd(L.Callback):
    """Saves the trained actor's state dict and the step count to ``path`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        actor = {name: tensor.detach().clone() for name, tensor in pl_module.actor.state_dict().items()}
        torch.save({"global_step": trainer.global_step, "actor": actor}, self.path)


@pytest.fixture(autouse=True)
def cli_argv(monkeypatch):
    """``main(args)`` runs in-process: pytest's own arguments must not look like CLI arguments."""
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])


# ----------------------------------------------------------------------------- every algorithm trains


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_algorithm_config_trains_three_steps(algorithm, tiny_model_dir, tmp_path):
    run_callbacks = rl_callbacks(tmp_path)
    if algorithm == "dapo":  # keep the config's dynamic sampling
        config = yaml.safe_load((CONFIGS / "dapo.yaml").read_text())
        (dapo_rollout,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("Rollout")]
        (rollout,) = [c for c in run_callbacks if c["class_path"].endswith("Rollout")]
        for name in ("filter_groups", "max_sampling_rounds"):
            rollout["init_args"][name] = dapo_rollout["init_args"][name]
        rollout["init_args"]["sampling"]["max_tokens"] = dapo_rollout["init_args"]["sampling"]["max_tokens"]
    args = small_fit_args(algorithm, tiny_model_dir, tmp_path, RL_STEPS, run_callbacks)
    if algorithm == "ppo":
        args += ["--model.init_args.critic_path", tiny_model_dir]
    if algorithm in ("gspo", "dapo"):  # the config's mini-batch of 128 is more than 4 prompts x 4 samples
        args += ["--model.init_args.update.mini_batch_size", "16"]
    if algorithm == "distill":  # a teacher that disagrees with the student: its own random weights
        teacher = str(create_tiny_model(tmp_path / "teacher", seed=1))
        args += ["--model.init_args.distill.teacher_path", teacher]
    main(args)

    rows = read_metrics(tmp_path / "logs")
    train_rows = [row for row in rows if row.get("actor/pg_loss")]
    assert [int(row["step"]) for row in train_rows] == list(range(RL_STEPS))
    assert [float(row["actor/policy_version"]) for row in train_rows] == [1.0, 2.0, 3.0]
    for row in train_rows:
        assert is_finite_number(row["actor/pg_loss"]), row
        if algorithm == "distill":
            assert float(row["distill/reverse_kl"]) != 0.0 and is_finite_number(row["distill/reverse_kl"]), (
                row
            )
    # every scalar logged anywhere is finite
    for row in rows:
        for name, value in row.items():
            if value:
                assert is_finite_number(value), (name, row)
    assert any(float(row["actor/grad_norm"]) > 0 for row in train_rows), "no gradient in 3 steps"
    assert [float(row["val/accuracy"]) for row in rows if row.get("val/accuracy")], "no evaluation logged"
    if algorithm == "ppo":
        assert all(is_finite_number(row["critic/vf_loss"]) for row in train_rows)
    if algorithm == "gspo":
        assert all(is_finite_number(row["actor/gspo_seq_ratio_mean"]) for row in train_rows)
    if algorithm == "dapo":  # overlong penalty ≤ 0 every step; the group filter and its rounds ran
        penalties = [float(row["reward/overlong_penalty_mean"]) for row in train_rows]
        assert all(-1 <= p <= 0 for p in penalties) and min(penalties) < 0, penalties  # untrained: long
        assert all(
            is_finite_number(row["rollout/filtered_groups_fraction"])
            for row in rows
            if row.get("rollout/filtered_groups_fraction")
        )
        assert any(row.get("rollout/sampling_rounds") for row in rows)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "actor" / "config.json").is_file()


# ----------------------------------------------------------------------------- print_config round trip


@pytest.mark.slow
def test_print_config_is_complete_and_runs_as_is(tiny_model_dir, tmp_path):
    result = run_cli("fit", "--config", "configs/grpo.yaml", "--print_config")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)

    assert {"seed_everything", "trainer", "model", "data", "ckpt_path"} <= printed.keys()
    model = printed["model"]
    assert model["class_path"] == "lit_offpolicy.OffPolicyModule"
    module_options = set(inspect.signature(OffPolicyModule.__init__).parameters) - {"self"}
    assert module_options <= model["init_args"].keys()
    assert model["init_args"]["policy_loss"]["class_path"] == "lit_offpolicy.losses.PPO"
    assert model["init_args"]["advantage"]["class_path"] == "lit_offpolicy.advantages.GRPO"
    data_options = set(inspect.signature(PromptDataModule.__init__).parameters) - {"self"}
    assert data_options <= printed["data"].keys()
    trainer = printed["trainer"]
    printed_callbacks = {c["class_path"]: c["init_args"] for c in trainer["callbacks"]}
    rollout_options = set(inspect.signature(callbacks.Rollout.__init__).parameters) - {"self"}
    assert rollout_options <= printed_callbacks["lit_offpolicy.callbacks.Rollout"].keys()
    assert "lit_offpolicy.callbacks.HFExport" in printed_callbacks
    assert "lightning.pytorch.callbacks.ModelCheckpoint" in printed_callbacks

    # substitute the model and the output paths only, and train one step from the file as it is
    model["init_args"]["model_path"] = tiny_model_dir
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    for callback in trainer["callbacks"]:
        if "dirpath" in callback["init_args"]:
            callback["init_args"]["dirpath"] = redirect(callback["init_args"]["dirpath"], tmp_path)
    trainer["max_steps"] = 1
    config = tmp_path / "grpo-printed.yaml"
    config.write_text(yaml.safe_dump(printed, sort_keys=False))
    main(["fit", "--config", str(config)])

    assert (tmp_path / "actor" / "model.safetensors").is_file()
    assert list((tmp_path / "logs").glob("rl/version_*/events.out.tfevents.*"))


@pytest.mark.parametrize(
    "configs",
    [[f"{name}.yaml"] for name in [*ALGORITHMS, "async", "sft_tiny"]]
    + [["grpo.yaml", "rollout/vllm.yaml"], ["grpo.yaml", "lora.yaml"]],
    ids=lambda configs: "+".join(configs),
)
def test_every_config_prints(configs, capsys):
    """``--print_config`` of every shipped config: parsed and checked against the signatures; no model
    is loaded."""
    args = ["fit"] + [arg for name in configs for arg in ("--config", str(CONFIGS / name))]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] in ("lit_offpolicy.OffPolicyModule", "lit_offpolicy.sft.SFTModule")
    for callback in printed["trainer"]["callbacks"]:
        if callback["class_path"].endswith("Rollout"):  # the groups, every field filled in
            assert {"n", "temperature", "max_tokens", "seed"} <= callback["init_args"]["sampling"].keys()
            assert {"fn", "timeout", "workers", "start_method"} <= callback["init_args"]["reward"].keys()


# ----------------------------------------------------------------------------- a bad option fails cleanly


def test_unknown_policy_loss_fails_cleanly(tiny_model_dir, capsys):
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.init_args.model_path", tiny_model_dir]
    line = fit_fails_with_one_line([*args, "--model.init_args.policy_loss", "nope"], capsys)
    expected = (
        "policy_loss='nope' is not supported; "
        "allowed values: 'ppo', 'vanilla', 'tis', 'topr', 'cispo', 'kimi15', 'gspo'"
    )
    assert expected in line, line


# ----------------------------------------------------------------------------- SFT warm-up and export


def test_sft_config_trains_and_exports_a_loadable_actor(tiny_model_dir, tmp_path):
    config = yaml.safe_load((CONFIGS / "sft_tiny.yaml").read_text())
    sft_callbacks = copy.deepcopy(config["trainer"]["callbacks"])
    (export,) = [c for c in sft_callbacks if c["class_path"] == "lit_offpolicy.callbacks.HFExport"]
    export["init_args"]["dirpath"] = redirect(export["init_args"]["dirpath"], tmp_path)
    saved = tmp_path / "trained.pt"
    sft_callbacks.append({"class_path": class_path(SaveActorAtEnd), "init_args": {"path": str(saved)}})
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "sft_tiny.yaml"),
            "--model.init_args.model_path",
            tiny_model_dir,
            "--trainer.max_steps",
            "5",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.logger",
            csv_logger(tmp_path / "logs", "sft"),
            "--trainer.callbacks",
            json.dumps(sft_callbacks),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
        ]
    )

    trained = torch.load(saved, weights_only=True)
    assert trained["global_step"] == 5
    losses = [float(row["sft/loss"]) for row in read_metrics(tmp_path / "logs") if row.get("sft/loss")]
    assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses)

    export_dir = Path(export["init_args"]["dirpath"])
    exported = load_actor(export_dir).state_dict()
    assert exported.keys() == trained["actor"].keys()
    for name, tensor in trained["actor"].items():
        assert torch.equal(exported[name], tensor), f"exported {name} differs from the trained actor"
    initial = load_actor(tiny_model_dir).state_dict()
    changed = [name for name, tensor in exported.items() if not torch.equal(initial[name], tensor)]
    assert changed, "5 SFT steps changed nothing"
    tokenizer = load_tokenizer(export_dir)
    assert tokenizer.decode(tokenizer("12+30=").input_ids, skip_special_tokens=True) == "12+30="


# ----------------------------------------------------------------------------- vLLM rollouts


@pytest.mark.slow
def test_grpo_with_the_vllm_engine_runs_five_steps(tiny_model_dir, tmp_path):
    """configs/grpo.yaml + configs/rollout/vllm.yaml: real in-process vLLM on CPU samples every step."""
    rollout_callbacks = yaml.safe_load((CONFIGS / "rollout" / "vllm.yaml").read_text())["trainer"][
        "callbacks"
    ]
    for callback in rollout_callbacks:
        init_args = callback["init_args"]
        if callback["class_path"] == "lit_offpolicy.callbacks.Rollout":
            init_args["reward"] = HASH_REWARD
            init_args["sampling"]["n"] = 4
            init_args["validation"]["every_n_steps"] = 5
        if "dirpath" in init_args:
            init_args["dirpath"] = redirect(init_args["dirpath"], tmp_path)
    main(small_fit_args("grpo", tiny_model_dir, tmp_path, 5, rollout_callbacks))
    rows = read_metrics(tmp_path / "logs")
    train_rows = [row for row in rows if row.get("actor/pg_loss")]
    assert len(train_rows) == 5
    assert all(is_finite_number(row["actor/pg_loss"]) for row in train_rows)
    # the engine serves the version it was synced to: one behind the trainer after each step
    assert [float(row["rollout/policy_version"]) for row in rows if row.get("rollout/policy_version")] == [
        0.0,
        1.0,
        2.0,
        3.0,
        4.0,
    ]
    # vLLM's π_rollout against the trainer's π_old (float32, same weights): measured every step, tiny.
    # Each token's log-ratio r is within 1e-4 (tests/integration/test_vllm_engine.py), so is their
    # mean, kl, and chi2_token = mean(e^{2r}) − 1 ≈ mean(2r) within 2e-4 (< 1e-3)
    for row in train_rows:
        assert abs(float(row["rollout_corr/kl"])) < 1e-4, row["rollout_corr/kl"]
        assert abs(float(row["rollout_corr/chi2_token"])) < 1e-3, row["rollout_corr/chi2_token"]
    assert [float(row["val/accuracy"]) for row in rows if row.get("val/accuracy")], "no evaluation logged"


# ----------------------------------------------------------------------------- rollout correction in training


@pytest.mark.parametrize("preset", ["seq_is_rs", "geo_mis", "ppo_is_bypass", "pure_is"])
def test_rollout_correction_presets_train(preset, tiny_model_dir, tmp_path):
    """Each mode (standard, bypass, pure IS) runs through the trainer and logs its rollout_corr/* metrics."""
    args = small_fit_args("grpo", tiny_model_dir, tmp_path, 2, rl_callbacks(tmp_path))
    main([*args, "--model.init_args.rollout_correction", preset])
    train_rows = [row for row in read_metrics(tmp_path / "logs") if row.get("actor/pg_loss")]
    assert len(train_rows) == 2
    for row in train_rows:
        assert is_finite_number(row["actor/pg_loss"])
        assert is_finite_number(row["rollout_corr/chi2_token"])
        # on-policy HF rollouts: π_old = π_rollout up to float32 noise, so nothing is rejected
        assert float(row["rollout_corr/rollout_rs_masked_fraction"]) == 0.0
    if preset == "pure_is":
        assert "actor/is_weight_mean" in train_rows[0]
    if preset == "seq_is_rs":
        # on-policy: a sequence's weight is exp(Σ r) over ≤ 5 tokens whose log-ratios are float32
        # noise, ≤ 2 × 4 × eps32 × √512 × |lp| ≤ 8 ≈ 1.7e-4 each (helpers.tolerances): within 1e-3 of 1
        assert abs(float(train_rows[0]["rollout_corr/rollout_is_mean"]) - 1.0) < 1e-3
    if preset == "geo_mis":  # geometric rejection within [0.999, 1.001] and veto: nothing to drop on-policy
        assert float(train_rows[0]["rollout_corr/rollout_is_veto_fraction"]) == 0.0
