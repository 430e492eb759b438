"""The console script as a user runs it: the working directory on the import path, a later config's
list replacing an earlier one (``key+:`` appending), ``--rollout.FIELD`` and what ``fit --help`` shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import CONFIGS

from lit_offpolicy.cli import main

LIT_OFFPOLICY = Path(sys.executable).with_name("lit-offpolicy")

OWN_ROLLOUT = """\
trainer:
  callbacks:
    - {class_path: lit_offpolicy.callbacks.Rollout, init_args: {sampling: {n: 2}}}
    - {class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {dirpath: ckpt}}
    - {class_path: lit_offpolicy.callbacks.HFExport, init_args: {dirpath: actor}}
"""


def command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LIT_OFFPOLICY), *args], cwd=cwd, capture_output=True, text=True)


def printed_callbacks(*args: str, cwd: Path) -> list[dict]:
    """The callbacks ``lit-offpolicy fit ARGS --print_config`` prints (the console script, in ``cwd``)."""
    result = command("fit", *args, "--print_config", cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return yaml.safe_load(result.stdout)["trainer"]["callbacks"]


def parsed_callbacks(*args: str, cwd: Path, monkeypatch, capsys) -> list[dict]:
    """``printed_callbacks`` in this process (the same parser; a console script's start-up is 4 s)."""
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]


def test_console_script_imports_from_the_working_directory(tmp_path):
    """``my_module:name`` next to the user imports under the console script, as under ``python -m``."""
    (tmp_path / "my_callbacks.py").write_text(
        "from lightning.pytorch import Callback\nclass Hello(Callback): pass\n"
    )
    grpo = str(CONFIGS / "grpo.yaml")
    callbacks = printed_callbacks("--config", grpo, "--trainer.callbacks+=my_callbacks.Hello", cwd=tmp_path)
    assert callbacks[-1]["class_path"] == "my_callbacks.Hello"


def test_a_later_configs_list_replaces_the_earlier_one(tmp_path, monkeypatch, capsys):
    (tmp_path / "mine.yaml").write_text(OWN_ROLLOUT)
    for base in ("grpo.yaml", "dapo.yaml"):
        callbacks = parsed_callbacks(
            "--config",
            str(CONFIGS / base),
            "--config",
            "mine.yaml",
            cwd=tmp_path,
            monkeypatch=monkeypatch,
            capsys=capsys,
        )
        rollout = callbacks[0]["init_args"]
        assert rollout["sampling"]["n"] == 2
        assert rollout["sampling"]["temperature"] == 1.0  # the class default, not the base config's 0.7
        assert rollout["validation"]["stop_at"] is None  # no early stop the user did not ask for
        assert rollout["filter_groups"] is False  # DAPO's dynamic sampling is not kept
        assert callbacks[1]["init_args"]["every_n_train_steps"] is None


def test_plus_appends_to_the_earlier_list(tmp_path, monkeypatch, capsys):
    extra = "{class_path: lightning.pytorch.callbacks.LearningRateMonitor}"
    (tmp_path / "more.yaml").write_text(f"trainer:\n  callbacks+:\n    - {extra}\n")
    callbacks = parsed_callbacks(
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--config",
        "more.yaml",
        cwd=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert [c["class_path"].rsplit(".", 1)[-1] for c in callbacks] == [
        "Rollout",
        "ModelCheckpoint",
        "HFExport",
        "LearningRateMonitor",
    ]
    assert callbacks[0]["init_args"]["sampling"]["temperature"] == 0.7  # the base's Rollout, untouched


def test_rollout_options_from_the_command_line(tmp_path, monkeypatch, capsys):
    grpo = str(CONFIGS / "grpo.yaml")
    callbacks = parsed_callbacks(
        "--config",
        grpo,
        "--rollout.sampling.n",
        "3",
        "--rollout.reward.fn=gsm8k",
        cwd=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    rollout = callbacks[0]["init_args"]
    assert rollout["sampling"]["n"] == 3
    assert rollout["sampling"]["temperature"] == 0.7  # the rest of the config's Rollout stays
    assert rollout["reward"]["fn"] == "gsm8k"
    assert [c["class_path"].rsplit(".", 1)[-1] for c in callbacks] == [
        "Rollout",
        "ModelCheckpoint",
        "HFExport",
    ]


def test_fit_help_names_the_options_users_change_most(tmp_path):
    result = command("fit", "--help", cwd=tmp_path)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for option in ("--model.init_args.model_path", "--model.init_args.optim.lr", "--rollout.sampling.n"):
        assert option in text
    assert "--rollout.reward.fn" in text


def test_a_run_that_may_stop_early_says_so_at_start_up(capsys):
    from types import SimpleNamespace

    from lit_offpolicy.callbacks import Rollout
    from lit_offpolicy.cli.command import _print_destinations
    from lit_offpolicy.rollout.evaluation import ValidationConfig

    early = Rollout(validation=ValidationConfig(every_n_steps=10, stop_at=0.9, stop_after=3))
    trainer = SimpleNamespace(global_rank=0, logger=None, log_dir=None, callbacks=[early], max_steps=500)
    _print_destinations(trainer)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "stops early" in line]
    assert "0.9" in line and "3 evaluation" in line and "max_steps=500" in line and "stop_at: null" in line

    trainer.callbacks = [Rollout(validation=ValidationConfig(every_n_steps=10))]
    _print_destinations(trainer)
    assert "stops early" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "command, message",
    [
        (
            ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--trainer.max_step", "2", "--print_config"],
            "unrecognized arguments: --trainer.max_step 2 (did you mean '--trainer.max_steps'?) "
            "(options: lit-offpolicy fit --help)",
        ),
        (
            [
                "fit",
                "--config",
                str(CONFIGS / "grpo.yaml"),
                "--model.init_args.optim.l",
                "1",
                "--print_config",
            ],
            "model.init_args: unrecognized arguments: --optim.l=1 (options: lit-offpolicy fit --help)",
        ),
        (
            ["create-tiny-model", "never-written", "--over"],
            "create-tiny-model: unrecognized arguments: --over",
        ),
    ],
)
def test_an_abbreviated_option_is_an_error_naming_it(command, message, tmp_path, monkeypatch, capsys):
    """argparse took an option's prefix for it: ``--trainer.max_step 2`` set ``--trainer.max_steps``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"lit-offpolicy: error: {message}"]
    assert not (tmp_path / "never-written").exists()


def test_the_full_option_name_still_sets_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "grpo.yaml"), "--trainer.max_steps", "2", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["max_steps"] == 2
