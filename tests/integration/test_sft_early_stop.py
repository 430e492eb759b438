"""A run stopped by its validation target before ``trainer.max_steps`` says which rule stopped it: the
SFT warm-up (ValAccuracy), the RL run (the Rollout's ``validation``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from helpers import CONFIGS
from helpers.cli_runs import rl_callbacks, small_fit_args

from lit_offpolicy.cli import main
from lit_offpolicy.cli.command import _may_stop_early


def test_an_early_stop_prints_one_line_naming_the_rule(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A warm-up that stopped at step 90 of 600 said nothing of ``stop_at``; ``stop_at: 0.0`` holds at
    every evaluation: at the start and at step 2, ``stop_after=2`` evaluations in a row."""
    monkeypatch.chdir(tmp_path)
    rule = {"every_n_steps": 2, "max_response_length": 2, "stop_at": 0.0, "stop_after": 2}
    callbacks = [{"class_path": "lit_offpolicy.callbacks.ValAccuracy", "init_args": rule}]
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "sft_tiny.yaml"),
            "--model.init_args.model_path",
            tiny_model_dir,
            "--trainer.max_steps",
            "6",
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            json.dumps(callbacks),
            "--data.batch_size",
            "4",
            "--data.num_val_samples",
            "8",
        ]
    )
    stops = [line for line in capsys.readouterr().out.splitlines() if "stopped at step" in line]
    assert stops == [
        "lit-offpolicy: stopped at step 2 of trainer.max_steps=6: val/accuracy 0 >= ValAccuracy.stop_at=0.0 "
        "at 2 evaluation(s) in a row (ValAccuracy.stop_after=2)"
    ]


def test_an_rl_run_stopped_by_its_validation_target_says_so(tiny_model_dir, tmp_path, capsys):
    """The Rollout's ``validation.stop_at`` (configs/demo.yaml stops at 0.9): the same one line, its
    options named as the Rollout's (``validation.``)."""
    callbacks = rl_callbacks(tmp_path)
    callbacks[0]["init_args"]["validation"] = {"every_n_steps": 1, "stop_at": 0.0, "stop_after": 2}
    main(
        [
            *small_fit_args("grpo", tiny_model_dir, tmp_path, 5, callbacks),
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    stops = [line for line in capsys.readouterr().out.splitlines() if "stopped at step" in line]
    assert len(stops) == 1 and stops[0].startswith(
        "lit-offpolicy: stopped at step 1 of trainer.max_steps=5: "
    ), stops
    assert stops[0].endswith(
        ">= validation.stop_at=0.0 at 2 evaluation(s) in a row (validation.stop_after=2)"
    )


def test_the_start_up_line_about_an_early_stop_only_where_one_can_come():
    """configs/demo.yaml's rule (every 10 steps, 3 in a row, the start counted) can stop a run from step
    20 on: said for 500 steps or none, not for 5 (a new user's 5-step run was told it may stop early)."""
    rule = SimpleNamespace(every_n_steps=10, stop_after=3)
    assert [_may_stop_early(rule, steps) for steps in (5, 20, 21, 500, -1)] == [
        False,
        False,
        True,
        True,
        True,
    ]
