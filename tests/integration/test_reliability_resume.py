"""Resume after faults: SIGTERM and SIGUSR1 save a checkpoint before the run stops, and a run resumed
from it continues exactly as the uninterrupted run (step, policy version, optimizer, RNG, engine
weights, prompt stream). A real SIGKILL of a ``lit-offpolicy fit`` process is in
``test_reliability_sigkill.py``.

Real parts: the tiny Llama, the HF engine, Lightning Trainers on CPU, real signals sent to this
process (Lightning's and our handlers run as they would under SLURM, minus the requeue).
Rollouts are unseeded (``seed=None``), so sampling draws from the global torch RNG: a resumed run
samples the same responses only if the RNG state was restored.
"""

from __future__ import annotations

import logging
import os
import signal
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers.experiences import fixed_experience
from helpers.fits import FixedExperience, MemoryLogger, clone_state, make_data, make_trainer, rollout_options
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.training.checkpointing import AtomicCheckpointIO, PreemptionCheckpoint, requeue_slurm_job
from lit_offpolicy.training.options import OptimOptions

MAX_STEPS = 4


class SendSignal(L.Callback):
    """Sends ``signum`` to this process at the start of training step ``at_step`` (1-based)."""

    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.at_step:
            os.kill(os.getpid(), self.signum)


class Record(L.Callback):
    """Per step: the prompts, the sampled responses and the RNG state when the step starts; the
    engine's weights and the actor's when training starts."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_start(self, trainer, pl_module):
        rollout = next(c for c in trainer.callbacks if isinstance(c, callbacks.Rollout))
        self.engine_at_start = clone_state(rollout.worker.engine.model)
        self.actor_at_start = clone_state(pl_module.actor)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # runs after Rollout's hook, which sampled: the RNG state before sampling is kept by the rollout
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "prompts": list(batch["prompt"]),
                "responses": batch["experience"].response_ids.clone(),
            }
        )


def make_rollout() -> callbacks.Rollout:
    # sync_every=2: the engine holds its own copy of the weights, pushed every 2 steps
    return callbacks.Rollout(**rollout_options(seed=None, sync_every=2))


def fit(model_dir: str, directory, extra: list, ckpt_path: str | None = None):
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(model_path=model_dir, optim=OptimOptions(lr=1e-3))
    record, logger = Record(), MemoryLogger()
    trainer = make_trainer(
        [make_rollout(), record, *extra],
        max_steps=MAX_STEPS,
        logger=logger,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=directory,
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in extra),
    )
    trainer.fit(module, datamodule=make_data(model_dir), ckpt_path=ckpt_path)
    return SimpleNamespace(module=module, trainer=trainer, record=record, logger=logger)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    result = SimpleNamespace(uninterrupted=fit(tiny_model_dir, root / "whole", []))
    signals = (
        ("sigterm", signal.SIGTERM, SystemExit),
        ("sigusr1", signal.SIGUSR1, None),
        ("sigint", signal.SIGINT, None),
    )
    for name, signum, stops in signals:
        directory = root / name
        preemption = PreemptionCheckpoint(dirpath=str(directory / "ckpt"))
        # as configs/base/trainer.yaml: a ModelCheckpoint keeping last.ckpt where the signal saves it (a
        # run stopped by Ctrl-C or SIGUSR1 ends its epoch; that save must not be redone there)
        keeper = ModelCheckpoint(dirpath=str(directory / "ckpt"), save_last=True, every_n_train_steps=10)
        extra = [SendSignal(signum, at_step=2), preemption, keeper]
        if stops is None:
            interrupted = fit(tiny_model_dir, directory, extra)
        else:
            with pytest.raises(stops):
                fit(tiny_model_dir, directory, extra)
            interrupted = None
        resumed = fit(tiny_model_dir, directory, [], ckpt_path=preemption.saved_path)
        run = SimpleNamespace(preemption=preemption, interrupted=interrupted, resumed=resumed)
        setattr(result, name, run)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sigterm", "sigusr1", "sigint"])
def test_signal_saves_last_checkpoint_at_the_end_of_the_step(runs, name):
    run = getattr(runs, name)
    assert run.preemption.saved_path.endswith(os.path.join("ckpt", "last.ckpt"))
    saved = torch.load(run.preemption.saved_path, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2, "the step in which the signal arrived is finished, then saved"
    assert saved["lit_offpolicy"]["policy_version"] == 2
    assert saved["optimizer_states"][0]["state"], "AdamW moments are in the checkpoint"
    assert {"torch", "python", "numpy"} <= saved["lit_offpolicy"]["rng"].keys()
    if run.interrupted is not None:  # SIGUSR1 and Ctrl-C stop the run cleanly after the save
        assert run.interrupted.trainer.global_step == 2
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL, "handler restored after the run"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "handler restored"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sigterm", "sigusr1", "sigint"])
def test_resumed_run_continues_exactly_as_the_uninterrupted_one(runs, name):
    whole, resumed = runs.uninterrupted, getattr(runs, name).resumed
    assert resumed.trainer.global_step == MAX_STEPS
    assert resumed.module.policy_version == MAX_STEPS
    assert [s["global_step"] for s in resumed.record.steps] == [2, 3]
    for got, expected in zip(resumed.record.steps, whole.record.steps[2:], strict=True):
        assert got["prompts"] == expected["prompts"], "data position"
        # unseeded sampling: equal only when the global torch RNG was restored
        assert torch.equal(got["responses"], expected["responses"]), "RNG state"
    # optimizer state, weights and RNG together: the final actor is the uninterrupted run's
    final_whole, final_resumed = whole.module.actor.state_dict(), resumed.module.actor.state_dict()
    # the resumed steps repeat the uninterrupted run's float32 operations on the same inputs: equal to
    # the bit; 1e-6 (≈ 10 ulps of weights ≤ 1) absorbs last bits only, far below an AdamW step (lr)
    for parameter, tensor in final_whole.items():
        assert torch.allclose(final_resumed[parameter], tensor, atol=1e-6, rtol=0), parameter
    # the engine starts from the restored actor, not from the model directory
    for parameter, tensor in resumed.record.actor_at_start.items():
        assert torch.equal(resumed.record.engine_at_start[parameter], tensor), parameter
    initial = whole.record.actor_at_start
    assert any(not torch.equal(initial[p], t) for p, t in resumed.record.engine_at_start.items())


class BreakStepOnSignal(L.Callback):
    """At the start of step ``at_step`` (1-based), after the rollout, what a SIGTERM to the run's group
    does to a run on launched rollout servers: the signal is recorded and the step cannot go on
    (``PreemptionCheckpoint.stop_now``, as ``callbacks.rollout.saves_last_when_stopped`` calls it)."""

    def __init__(self, preemption: PreemptionCheckpoint, at_step: int) -> None:
        self.preemption, self.at_step = preemption, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.at_step:
            self.preemption.requested_by = signal.SIGTERM
            self.preemption.stop_now(trainer, RuntimeError("the rollout servers ended with the signal"))


@pytest.mark.slow
def test_a_step_the_signal_broke_is_run_and_logged_at_its_own_index_after_the_resume(
    runs, tiny_model_dir, tmp_path
):
    """A new user's finding: resumed after a step the signal broke, the run logged each step one index late
    and ended a step early (Lightning restored the broken step's batch as stepped)."""
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt"))
    with pytest.raises(SystemExit):
        fit(tiny_model_dir, tmp_path, [BreakStepOnSignal(preemption, at_step=3), preemption])
    assert torch.load(preemption.saved_path, map_location="cpu", weights_only=True)["global_step"] == 2
    resumed = fit(tiny_model_dir, tmp_path, [], ckpt_path=preemption.saved_path)
    assert [step["global_step"] for step in resumed.record.steps] == [2, 3]
    logged = [step for step, metrics in resumed.logger.rows if "actor/pg_loss" in metrics]
    whole = [step for step, metrics in runs.uninterrupted.logger.rows if "actor/pg_loss" in metrics]
    assert logged == whole[2:] == [2, 3], (logged, whole)
    for got, expected in zip(resumed.record.steps, runs.uninterrupted.record.steps[2:], strict=True):
        assert got["prompts"] == expected["prompts"], "data position"


class SignalProbe(L.Callback):
    """Records the SIGUSR1 and SIGTERM handlers in force during training."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}


def test_signals_are_handled_between_steps_under_slurm_auto_requeue(tiny_model_dir, tmp_path, monkeypatch):
    """Under SLURM with auto-requeue, Lightning's handlers save a checkpoint (SIGUSR1) and broadcast
    (SIGTERM) inside the handler, mid-step; PreemptionCheckpoint takes both over for the run, treats
    SIGUSR1 as the requeue signal, and gives them back afterwards. Here SLURM's variables are set by
    hand and no signal is sent; tests/integration/test_slurm.py sends them on a real cluster."""
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "rl", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    for name, value in {**slurm, "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)
    preemption, probe = PreemptionCheckpoint(dirpath=str(tmp_path)), SignalProbe()
    before = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(
        [FixedExperience(fixed_experience(tiny_model_dir)), preemption, probe],
        max_steps=1,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        default_root_dir=tmp_path,
    )
    trainer.fit(OffPolicyModule(model_path=tiny_model_dir), datamodule=make_data(tiny_model_dir))
    assert probe.handlers == {s: preemption._on_signal for s in (signal.SIGUSR1, signal.SIGTERM)}
    assert preemption._weight(signal.SIGUSR1) == 2, "SIGUSR1 asks for a requeue under SLURM"
    assert preemption.saved_path is None, "no signal, no save"
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_weightiest_signal_decides():
    """SIGTERM (end) outweighs SLURM's requeue signal, which outweighs a plain stop (SIGINT, or
    SIGUSR1 off SLURM); the handler only records it, whatever the order of arrival."""
    preemption = PreemptionCheckpoint()
    preemption._on_signal(signal.SIGUSR1, None)
    assert preemption.requested_by == signal.SIGUSR1 and preemption._weight(signal.SIGUSR1) == 1
    preemption._requeue_signal = signal.SIGUSR1  # as under SLURMEnvironment(auto_requeue=True)
    assert preemption._weight(signal.SIGUSR1) == 2
    preemption._on_signal(signal.SIGTERM, None)
    preemption._on_signal(signal.SIGUSR1, None)
    assert preemption.requested_by == signal.SIGTERM
    assert preemption._weight(None) == 0 and preemption.saved_path is None


def test_a_requeue_whose_scontrol_gets_the_jobs_sigterm_still_reports_it(tmp_path, monkeypatch, caplog):
    """SLURM requeueing a job sends SIGTERM to its processes, the ``scontrol requeue`` that asked for it
    among them (a real job: tests/integration/test_slurm.py, where on a loaded machine it ended with
    status −15 and the run warned that the requeue had failed). A stand-in ``scontrol`` on PATH gets
    that SIGTERM before it answers; it ignores it and reports the requeue."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nkill -TERM $$\necho "$@" > {tmp_path / "asked"}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    with caplog.at_level(logging.INFO):
        requeue_slurm_job()
    assert (tmp_path / "asked").read_text().split() == ["requeue", "42"]
    said = [record.getMessage() for record in caplog.records]
    assert "requeued SLURM job 42" in said and not [line for line in said if "could not" in line], said
