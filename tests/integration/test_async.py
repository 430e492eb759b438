"""Asynchronous rollouts (AsyncRollout): bounded staleness under a slow trainer and a slow producer,
max_staleness=0 = the synchronous path, dropping and regenerating, resume, errors and clean shutdown.

Real parts only: the tiny Llama, the HF engine (the producer's own copy), real Lightning Trainers and
real threads. Delays come from a real callback and a real reward function that sleep. The reward is
``HashReward`` (tests/helpers/__init__.py): an untrained model scores 0 everywhere, so no gradient would flow.
"""

from __future__ import annotations

import csv
import json
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import yaml
from helpers import HashReward
from helpers.fits import (
    ASYNC_CONFIG,
    BATCH_SIZE,
    N_SAMPLES,
    MemoryLogger,
    make_async,
    make_data,
    make_rollout,
    make_trainer,
    released_after_fit,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.callbacks.async_rollout import prompt_stream
from lit_offpolicy.cli import main
from lit_offpolicy.rollout import VLLMEngineSpec
from lit_offpolicy.rollout.buffer import ProducerError, PromptLedger
from lit_offpolicy.rollout.evaluation import ValidationConfig
from lit_offpolicy.training.options import OptimOptions

PRODUCER = "lit-offpolicy-rollout-producer"


class SlowReward(HashReward):
    """HashReward that takes ``seconds`` per batch: a slow producer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, completions, **columns):
        time.sleep(self.seconds)
        return super().__call__(completions, **columns)


class FailingReward(HashReward):
    """HashReward that raises on its ``fail_at``-th call (1-based)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, 0
        self.error = ValueError("reward server unreachable")

    def __call__(self, completions, **columns):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return super().__call__(completions, **columns)


class SlowStep(L.Callback):
    """Sleeps ``seconds`` at the end of every training step: a slow trainer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


class StalenessProbe(L.Callback):
    """After the rollout callback: the staleness of every sample each step trains on, and its prompts."""

    def __init__(self) -> None:
        self.ages: list[list[int]] = []
        self.prompts: list[tuple[str, ...]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        versions = batch["experience"].policy_versions
        self.ages.append((pl_module.policy_version - versions).tolist())
        self.prompts.append(tuple(batch["prompt"]))


class InterruptAt(L.Callback):
    """Raises KeyboardInterrupt (as Ctrl+C would) at the end of step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def fit(model_dir: str, rollout: L.Callback, steps: int, extra: tuple = (), ckpt_path=None, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(model_path=model_dir, advantage="grpo", optim=OptimOptions(lr=1e-3))
    probe, logger = StalenessProbe(), MemoryLogger()
    trainer = make_trainer([rollout, probe, *extra], max_steps=steps, logger=logger, **trainer_kwargs)
    trainer.fit(module, datamodule=make_data(model_dir), ckpt_path=ckpt_path)
    return SimpleNamespace(
        module=module, trainer=trainer, logger=logger, ages=probe.ages, prompts=probe.prompts
    )


def producer_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == PRODUCER]


def batch_indices(model_dir: str, prompts: list[tuple[str, ...]]) -> list[int]:
    """The position of each prompt batch in the producer's stream (epochs 0, 1, ...)."""
    data = make_data(model_dir)
    data.setup("fit")
    stream = prompt_stream(data.train_dataloader(), PromptLedger())
    position = {tuple(next(stream).prompts): index for index in range(40)}
    return [position[batch] for batch in prompts]


# ----------------------------------------------------------------------------- on-policy = synchronous


def test_max_staleness_zero_reproduces_the_synchronous_metrics(tiny_model_dir):
    """Same seed, 3 steps: every logged reward/*, rollout/*, actor/*, critic/*, rollout_corr/* value is
    identical to the synchronous Rollout's (where the actor itself generates), bit for bit."""
    asynchronous = fit(tiny_model_dir, make_async(max_staleness=0), 3)
    synchronous = fit(tiny_model_dir, make_rollout(), 3)

    names = sorted(
        {
            name
            for _, metrics in synchronous.logger.rows
            for name in metrics
            if name.split("/")[0] in ("reward", "rollout", "actor", "critic", "rollout_corr")
            and name != "rollout/tokens_per_second"
        }
    )
    assert {"reward/mean", "rollout/response_length_mean", "actor/pg_loss", "rollout_corr/kl"} <= set(names)
    assert asynchronous.ages == [[0] * BATCH_SIZE * N_SAMPLES] * 3
    assert asynchronous.prompts == synchronous.prompts
    for name in names:
        values = asynchronous.logger.values(name)
        assert len(values) == 3, name
        assert values == synchronous.logger.values(name), name
    assert asynchronous.logger.values("rollout/dropped") == [0.0] * 3
    assert not producer_threads()


# ----------------------------------------------------------------------------- the staleness bound


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_slow_trainer_trains_no_sample_older_than_max_staleness(tiny_model_dir, max_staleness):
    """A trainer much slower than the producer: the producer runs ahead until backpressure stops it."""
    run = fit(tiny_model_dir, make_async(max_staleness=max_staleness), 6, extra=(SlowStep(0.3),))
    ages = [age for step in run.ages for age in step]
    assert len(ages) == 6 * BATCH_SIZE * N_SAMPLES
    assert max(ages) == max_staleness, "the producer should have run exactly max_staleness ahead"
    assert min(ages) >= 0
    assert run.logger.values("rollout/staleness_max") == [float(max(step)) for step in run.ages]
    assert sum(run.logger.values("rollout/producer_idle")) > 0.5, "backpressure should have held it"
    assert max(run.logger.values("rollout/queue_depth")) >= 1
    assert batch_indices(tiny_model_dir, run.prompts) == list(range(6)), "in order, none lost"
    assert not producer_threads()


@pytest.mark.slow
def test_slow_producer_trains_no_sample_older_than_max_staleness(tiny_model_dir):
    """A producer slower than the trainer (0.3 s per reward call): the trainer waits for it."""
    run = fit(tiny_model_dir, make_async(reward=SlowReward(0.3), max_staleness=2), 5)
    ages = [age for step in run.ages for age in step]
    assert len(ages) == 5 * BATCH_SIZE * N_SAMPLES
    assert min(ages) >= 0 and max(ages) <= 2
    assert sum(run.logger.values("rollout/trainer_idle")) > 0.5, "the trainer should have waited"
    assert run.logger.values("rollout/dropped")[-1] == 0.0
    assert not producer_threads()


@pytest.mark.slow
@pytest.mark.parametrize("stale_policy", ["drop", "regenerate"])
def test_engine_lagging_by_sync_every_drops_or_regenerates_stale_batches(tiny_model_dir, stale_policy):
    """sync_every=2, max_staleness=1: the engine serves a version for two steps, so some batches it
    sampled ahead are 2 versions old when their turn comes; they never reach the trainer."""
    rollout = make_async(max_staleness=1, sync_every=2, stale_policy=stale_policy)
    run = fit(tiny_model_dir, rollout, 6, extra=(SlowStep(0.2),))
    ages = [age for step in run.ages for age in step]
    assert max(ages) <= 1
    dropped = run.logger.values("rollout/dropped")[-1]
    assert dropped > 0 and dropped % (BATCH_SIZE * N_SAMPLES) == 0
    indices = batch_indices(tiny_model_dir, run.prompts)
    if stale_policy == "drop":
        assert indices == sorted(indices) and len(set(indices)) == 6
        skipped = set(range(indices[-1] + 1)) - set(indices)
        assert len(skipped) == dropped // (BATCH_SIZE * N_SAMPLES), "the prompts skipped are the dropped ones"
    else:
        assert sorted(indices) == list(range(6)), "regenerated prompts are trained later, none lost"
        assert indices != sorted(indices)
    assert not producer_threads()


@pytest.mark.slow
def test_vllm_engine_samples_in_the_producer_thread(tiny_model_dir):
    """The in-process vLLM engine (real, on CPU) driven from the producer thread, one version ahead."""
    engine = VLLMEngineSpec(max_model_len=128, enforce_eager=True)
    rollout = make_async(max_staleness=1, engine=engine)
    run = fit(tiny_model_dir, rollout, 4, extra=(SlowStep(0.3),))
    assert [max(step) for step in run.ages] == [0, 1, 1, 1]
    assert run.logger.values("rollout/policy_version") == [0.0, 0.0, 1.0, 2.0]
    assert not producer_threads()


# ----------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resumed_run_neither_replays_nor_loses_prompts(tiny_model_dir, tmp_path):
    """3 steps (checkpoint each step, the producer a batch ahead), resumed to 6 = 6 uninterrupted steps."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    options = {"enable_checkpointing": True, "default_root_dir": tmp_path}
    first = fit(tiny_model_dir, make_async(max_staleness=1), 3, extra=(checkpoint, SlowStep(0.2)), **options)
    resumed = fit(
        tiny_model_dir, make_async(max_staleness=1), 6, ckpt_path=str(tmp_path / "last.ckpt"), **options
    )
    whole = fit(tiny_model_dir, make_async(max_staleness=1), 6)
    assert first.prompts + resumed.prompts == whole.prompts
    assert batch_indices(tiny_model_dir, whole.prompts) == list(range(6))
    assert resumed.module.policy_version == 6
    assert max(age for step in first.ages + resumed.ages for age in step) <= 1


# ----------------------------------------------------------------------------- errors and shutdown


def test_producer_error_surfaces_in_the_trainer_with_its_cause(tiny_model_dir):
    reward = FailingReward(fail_at=3)
    with pytest.raises(ProducerError, match="reward server unreachable") as raised:
        fit(tiny_model_dir, make_async(reward=reward, max_staleness=1), 6)
    assert raised.value.__cause__ is reward.error
    assert not producer_threads()


def test_keyboard_interrupt_stops_the_producer(tiny_model_dir):
    """Lightning turns Ctrl+C into a graceful shutdown and ``SystemExit(1)``; the producer is joined."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            fit(tiny_model_dir, make_async(max_staleness=2), 6, extra=(InterruptAt(2),))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    assert not producer_threads()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_staleness": -1}, "max_staleness=-1 is out of range"),
        (
            {"stale_policy": "skip"},
            "stale_policy='skip' is not supported; allowed values: 'drop', 'regenerate'",
        ),
        (
            {"max_staleness": 1, "sync_every": 4, "validation": ValidationConfig(every_n_steps=0)},
            "max_staleness=1 must be at least sync_every - 1 = 3",
        ),
    ],
)
def test_bad_options_fail_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        callbacks.AsyncRollout(**options)


# ----------------------------------------------------------------------------- the shipped config


@pytest.mark.slow
def test_async_config_trains_through_the_cli(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    config = yaml.safe_load(ASYNC_CONFIG.read_text())
    trainer_callbacks = config["trainer"]["callbacks"]
    assert [c["class_path"].rsplit(".", 1)[-1] for c in trainer_callbacks][:2] == [
        "AsyncRollout",
        "RolloutCorrectionLogger",
    ]
    rollout = trainer_callbacks[0]
    rollout["init_args"]["reward"] = {"fn": {"class_path": "helpers.HashReward"}, "timeout": None}
    rollout["init_args"]["sampling"]["n"] = 4
    rollout["init_args"]["validation"]["every_n_steps"] = 2
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "logs"), "name": "async"},
    }
    main(
        [
            "fit",
            "--config",
            str(ASYNC_CONFIG),
            "--model.init_args.model_path",
            tiny_model_dir,
            "--trainer.max_steps",
            "4",
            "--trainer.logger",
            json.dumps(logger),
            "--trainer.callbacks",
            json.dumps([rollout, trainer_callbacks[1]]),
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--data.batch_size",
            "4",
            "--data.num_val_samples",
            "8",
        ]
    )
    (metrics,) = (tmp_path / "logs").glob("async/version_*/metrics.csv")
    rows = [row for row in _read_csv(metrics) if row.get("actor/pg_loss")]
    assert len(rows) == 4
    assert all(float(row["rollout/staleness_max"]) <= 1 for row in rows)
    assert all(row["rollout_corr/rollout_is_mean"] for row in rows), "seq_is_rs computes IS weights"
    assert not producer_threads()


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed"])
def test_async_rollout_releases_reward_and_engine_on_every_path(tiny_model_dir, fail):
    """After the producer stops: the reward's workers and the engine are released, whether the run
    finished or failed (Lightning calls ``on_exception``, not ``teardown``, after an error)."""
    reward_closed, engine_closed, engine = released_after_fit(
        tiny_model_dir, callbacks.AsyncRollout, fail, max_staleness=1
    )
    assert reward_closed >= 1 and engine_closed == 1 and engine is None
    assert not producer_threads()
