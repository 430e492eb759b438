"""``trainer.max_time`` reached mid-run: the step in flight finishes, ``last.ckpt`` holds it, the CLI
exits 0, and ``--ckpt_path last`` continues from that step."""

from __future__ import annotations

import torch
from helpers.cli_runs import read_metrics, rl_callbacks, small_fit_args

from lit_offpolicy.cli import main


def _args(out, model_dir: str, steps: int) -> list[str]:
    callbacks = rl_callbacks(out)
    for callback in callbacks:
        if callback["class_path"].endswith("ModelCheckpoint"):  # no periodic save before the limit
            callback["init_args"]["every_n_train_steps"] = 1000
        if callback["class_path"].endswith("Rollout"):
            callback["init_args"]["validation"] = {"every_n_steps": None, "stop_at": None}
    return small_fit_args("grpo", model_dir, out, steps, callbacks)


def test_max_time_ends_the_run_with_a_resumable_last_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["lit-offpolicy"])
    out = tmp_path / "out"
    main([*_args(out, tiny_model_dir, 10_000), "--trainer.max_time", "00:00:00:03"])  # returns: exit 0
    last = out / "checkpoints" / "last.ckpt"
    stopped_at = torch.load(last, weights_only=True)["global_step"]
    logged = max(int(row["step"]) for row in read_metrics(out / "logs") if row.get("actor/pg_loss"))
    assert 1 <= stopped_at < 10_000 and stopped_at == logged + 1  # the step in flight finished and is saved

    main([*_args(out, tiny_model_dir, stopped_at + 2), "--ckpt_path", "last"])
    assert torch.load(last, weights_only=True)["global_step"] == stopped_at + 2
