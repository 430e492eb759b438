"""The demo's pieces: the stop rule, the run's seed reaching sampling, the quiet console, and the demo's
RL stage with every seed the README lists (a few steps each: the full runs are measured, not tested)."""

from __future__ import annotations

import os
import re
import shutil

import lightning as L
import pytest
import yaml
from helpers import REPO
from helpers.fits import make_data, make_rollout, make_trainer, rollout_options
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.callbacks import AsyncRollout, StepProgress
from lit_offpolicy.cli import OffPolicyCLI, main
from lit_offpolicy.cli.console import IRRELEVANT_LIGHTNING_WARNINGS
from lit_offpolicy.core.tensorboard import latest_run, read_scalars
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.examples.demo import DEMO_SEEDS, HOLD, RL_CONFIGS, TARGET, summarize
from lit_offpolicy.models import create_tiny_model
from lit_offpolicy.rollout.evaluation import AccuracyTarget, ValidationConfig
from lit_offpolicy.training.options import OptimOptions

# ----------------------------------------------------------------------------- the stop rule


def test_accuracy_target_counts_consecutive_evaluations():
    target = AccuracyTarget(0.9, evaluations=3)
    reached = [target.reached(value) for value in (0.95, 0.91, 0.89, 0.9, 0.93, 0.97, 0.5)]
    # 0.89 breaks the run; 0.9 itself counts (at or above); the third in a row reaches it
    assert reached == [False, False, False, False, False, True, False]
    assert target.held == 0


def test_accuracy_target_of_one_evaluation_stops_at_the_first():
    target = AccuracyTarget(0.4)
    assert [target.reached(v) for v in (0.1, 0.39999, 0.4)] == [False, False, True]


@pytest.mark.parametrize(
    ("threshold", "evaluations", "option"), [(1.5, 1, "stop_at"), (0.9, 0, "stop_after")]
)
def test_accuracy_target_refuses_bad_values(threshold, evaluations, option):
    with pytest.raises(ValueError, match=f"{option}=.*allowed values"):
        AccuracyTarget(threshold, evaluations)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stop_at": 1.5}, "validation.stop_at=1.5 is out of range; allowed values"),
        ({"stop_at": 0.9, "stop_after": 0}, "validation.stop_after=0 is out of range; allowed values"),
        (
            {"stop_at": 0.9, "every_n_steps": 0},
            "validation.stop_at=0.9 needs evaluations: set validation.every_n_steps",
        ),
        ({"stop_at": 0.9, "every_n_steps": None}, "validation.stop_at=0.9 needs evaluations"),
    ],
)
def test_validation_refuses_a_bad_stop_rule_by_its_dotted_name(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_rollout(validation=ValidationConfig(**options))


def test_validation_without_stop_at_has_no_target():
    assert ValidationConfig().target() is None
    assert make_rollout().target is None
    assert make_rollout().state_dict() == {"target_held": 0}
    assert ValidationConfig(stop_at=0.9, stop_after=3).target() == AccuracyTarget(0.9, 3)


@pytest.mark.parametrize(("stop_at", "steps"), [(0.0, 2), (1.0, 4)])
def test_rollout_stops_once_the_target_has_held(stop_at, steps, tiny_model_dir):
    """Evaluations before step 1 and after each step: a target of 0 held for 3 evaluations is reached
    after step 2; a target of 1 (every validation answer scoring 1) is not, so all 4 steps run."""
    module = OffPolicyModule(model_path=tiny_model_dir, advantage="grpo", optim=OptimOptions(lr=1e-4))
    rollout = make_rollout(validation=ValidationConfig(every_n_steps=1, stop_at=stop_at, stop_after=3))
    trainer = make_trainer([rollout], max_steps=4)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    assert trainer.global_step == steps
    assert rollout.state_dict() == {"target_held": 3 if stop_at == 0.0 else 0}


def test_async_rollout_keeps_the_held_count_with_its_own_state():
    validation = ValidationConfig(every_n_steps=1, stop_at=0.5, stop_after=3)
    saved = AsyncRollout(**rollout_options(validation=validation))
    saved.target.held, saved.dropped = 2, 5
    state = saved.state_dict()
    assert state["target_held"] == 2 and state["dropped"] == 5 and "ledger" in state
    restored = AsyncRollout(**rollout_options(validation=validation))
    restored.load_state_dict(state)
    assert (restored.target.held, restored.dropped) == (2, 5)


def test_rollout_seed_defaults_to_the_runs_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored (or removed) after the test
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert make_rollout(seed=None).worker.run_seed is None
    L.seed_everything(7, verbose=False)
    assert make_rollout(seed=None).worker.run_seed == 7
    assert make_rollout(seed=3).worker.run_seed == 3  # an explicit sampling.seed wins


# ----------------------------------------------------------------------------- the demo's summary


def curve(*values: float) -> list[tuple[int, float]]:
    return [(10 * i, v) for i, v in enumerate(values)]


def test_summary_passes_a_climb_that_holds_the_target():
    summary = summarize(curve(0.45, 0.7, 0.91, 0.88, 0.9, 0.92, 0.95))
    assert summary == {
        "start": 0.45,
        "peak": 0.95,
        "final": 0.95,
        "first_step_at_target": 20,
        "last_step": 60,
        "passed": True,
    }


@pytest.mark.parametrize(
    "values",
    [
        (0.45, 0.8, 0.95, 0.89),  # reached but not held at the end
        (0.62, 0.9, 0.9, 0.91),  # held, but a climb of 0.29 is not RL's doing
        (0.9, 0.95),  # fewer evaluations than the hold needs
    ],
)
def test_summary_fails_what_is_not_a_held_climb(values):
    assert not summarize(curve(*values))["passed"]


def test_demo_success_rule_is_the_configs_stop_rule():
    """The demo judges a run by the rule that stops it: the Rollout validation of its last RL config."""
    with open(os.path.join(REPO, RL_CONFIGS[-1])) as file:
        trainer = yaml.safe_load(file)["trainer"]
    (rollout,) = [c for c in trainer["callbacks"] if c["class_path"] == "lit_offpolicy.callbacks.Rollout"]
    validation = rollout["init_args"]["validation"]
    assert (validation["stop_at"], validation["stop_after"]) == (TARGET, HOLD)


# ----------------------------------------------------------------------------- the demo's RL stage


@pytest.mark.parametrize("seed", [DEMO_SEEDS[0], DEMO_SEEDS[-1]])
def test_demo_rl_stage_runs_with_the_listed_seeds(seed, tmp_path, monkeypatch, capsys, recwarn):
    """The RL configs as the demo runs them (``--seed_everything S --data.seed S``), for 2 steps, from a
    tiny model of that seed placed where the config expects the warm-up: outputs go under tmp_path.
    The first and the last listed seed: a seed changes the numbers, not the code path (``make demo``
    runs a seed in full)."""
    monkeypatch.chdir(tmp_path)
    create_tiny_model(tmp_path / "outputs" / "sft-tiny", seed=seed)
    configs = [arg for config in RL_CONFIGS for arg in ("--config", os.path.join(REPO, config))]
    seeded = ["--seed_everything", str(seed), "--data.seed", str(seed)]
    main(["fit", *configs, *seeded, "--trainer.max_steps", "2"])

    run = latest_run(tmp_path / "outputs" / "logs" / "rl")
    assert [step for step, _ in read_scalars(run, "actor/policy_version")] == [0, 1]
    assert [step for step, _ in read_scalars(run, "rollout/filtered_groups_fraction")] == [0, 1]
    assert [step for step, _ in read_scalars(run, "rollout/sampling_rounds")] == [0, 1]
    assert [step for step, _ in read_scalars(run, "rollout/skipped_prompts")] == [0, 1]
    assert [step for step, _ in read_scalars(run, "val/accuracy")] == [0]
    assert [step for step, _ in read_scalars(run, "timing/evaluate")] == [0]
    assert (tmp_path / "outputs" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "outputs" / "actor" / "model.safetensors").is_file()
    # the console says where things go, and none of Lightning's warnings that do not apply to RL
    printed = capsys.readouterr()
    assert (
        "lit-offpolicy: logs in outputs/logs/rl/version_0 (tensorboard --logdir outputs/logs)" in printed.out
    )
    checkpoints = os.path.realpath(tmp_path / "outputs" / "checkpoints")  # ModelCheckpoint resolves it
    assert f"lit-offpolicy: ModelCheckpoint writes to {checkpoints}" in printed.out
    assert "lit-offpolicy: HFExport writes to outputs/actor" in printed.out
    # the progress bar counts the run's steps (not an epoch's batches) and shows the main metrics
    assert re.search(
        r"step: 100%\|[^|]*\| 2/2 \[.*reward/mean=[-\d.e]+, val/accuracy=[\d.e-]+, actor/pg_loss=",
        printed.out + printed.err,
    )
    irrelevant = [message for message, _ in IRRELEVANT_LIGHTNING_WARNINGS]
    shown = [str(w.message) for w in recwarn if any(re.search(m, str(w.message)) for m in irrelevant)]
    assert not shown
    shutil.rmtree(tmp_path / "outputs")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([], StepProgress),
        (["--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], TQDMProgressBar),
    ],
)
def test_cli_counts_steps_unless_the_config_names_a_progress_bar(extra, expected, tiny_model_dir, tmp_path):
    args = [
        "--config",
        os.path.join(REPO, "configs", "topr.yaml"),
        "--model.init_args.model_path",
        tiny_model_dir,
    ]
    args += ["--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path), *extra]
    cli = OffPolicyCLI(L.LightningModule, PromptDataModule, subclass_mode_model=True, run=False, args=args)
    assert type(cli.trainer.progress_bar_callback) is expected
    assert sum(isinstance(c, ProgressBar) for c in cli.trainer.callbacks) == 1
