"""The pieces of the tests' Lightning fits: the tiny Llama's data module, a small seeded Rollout
callback scored by ``HashReward``, a quiet CPU Trainer, a logger kept in memory, and a hand-made
experience (``fixed_experience``) for steps without a rollout.

Real parts only: the built-in tiny Llama (``create_tiny_model``), the HF rollout engine, a real
``lightning.Trainer`` on CPU. The one user-supplied part is the reward: an untrained tiny model
never answers an addition right, so the exact-match reward is 0 everywhere, every advantage is 0 and
no gradient flows. ``HashReward`` (a RewardFn, the public protocol) scores each response with a hash
of its text instead: deterministic, and different within a group.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

from helpers import CONFIGS, HashReward
from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.rewards import RewardConfig
from lit_offpolicy.rollout import HFEngineSpec, SamplingParams
from lit_offpolicy.rollout.evaluation import ValidationConfig

BATCH_SIZE = 4  # prompts per RL step
N_SAMPLES = 4  # responses per prompt (the GRPO group size)


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def values(self, name: str) -> list[float]:
        """Every logged value of ``name``, in logging order."""
        return [metrics[name] for _, metrics in self.rows if name in metrics]


class RecordPrepare(L.Callback):
    """At the start of each step (after the Rollout callback, before any update), run the module's
    ``prepare`` on a copy of the step's experience and keep both."""

    def __init__(self) -> None:
        self.records: list[tuple[Experience, dict[str, float]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        experience = copy.deepcopy(batch["experience"])
        metrics = pl_module.prepare(experience)
        self.records.append((experience, metrics))


def on_policy(experience: Experience, version: int) -> Experience:
    """A copy of ``experience`` sampled by ``version`` (every token), as a synchronous Rollout hands
    it to the trainer at that version: not stale, so π_old is the trainer's (``training.behaviour``)."""
    copied = copy.deepcopy(experience)
    copied.policy_versions = torch.full_like(copied.policy_versions, version)
    copied.token_versions = None
    return copied


class FixedExperience(L.Callback):
    """Feeds the same hand-made experience to every step, on-policy (instead of a Rollout callback)."""

    def __init__(self, experience: Experience) -> None:
        self.experience = experience

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch["experience"] = on_policy(self.experience, pl_module.policy_version)


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def rollout_options(reward=None, seed: int | None = 0, **kwargs) -> dict:
    """The rollout callbacks' arguments of these tests: small, seeded, scored in-process by ``reward``
    (default ``HashReward``), no evaluation and no sample logging; ``kwargs`` override."""
    options = {
        "sampling": SamplingParams(n=N_SAMPLES, max_tokens=5, seed=seed),
        "reward": RewardConfig(fn=reward or HashReward(), timeout=None),
        "validation": ValidationConfig(every_n_steps=0),
        "sync_every": 1,
        "log_samples_every_n_steps": 0,
    }
    return {**options, **kwargs}


def make_rollout(**kwargs) -> callbacks.Rollout:
    return callbacks.Rollout(**rollout_options(**kwargs))


def make_data(model_dir: str) -> PromptDataModule:
    return PromptDataModule(tokenizer_path=model_dir, batch_size=BATCH_SIZE, num_val_samples=8)


def make_trainer(callbacks: list, max_steps: int, logger=False, **kwargs) -> L.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "logger": logger,
        "callbacks": callbacks,
        "log_every_n_steps": 1,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**options, **kwargs})


# ----------------------------------------------------------------------------- teardown


class ClosableReward(HashReward):
    """HashReward that counts ``close`` calls (as ``IsolatedReward`` stops its workers there)."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class ClosableHFEngineSpec(HFEngineSpec):
    """The HF engine, whose ``close`` calls are counted."""

    def __init__(self) -> None:
        self.closed = 0

    def build(self, context):
        engine = super().build(context)
        engine.close = self._count
        return engine

    def _count(self) -> None:
        self.closed += 1


class FailAt(L.Callback):
    """Raises at the end of step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("the trainer failed")


def released_after_fit(model_dir: str, rollout_class, fail: bool, **kwargs) -> tuple[int, int, object]:
    """Fit 2 steps (or fail at step 1); how often reward and engine were closed, and the engine left."""
    reward, spec = ClosableReward(), ClosableHFEngineSpec()
    rollout = rollout_class(**rollout_options(reward=reward, engine=spec, **kwargs))
    trainer = make_trainer([rollout, FailAt(1)] if fail else [rollout], max_steps=2)
    module = OffPolicyModule(model_path=model_dir)
    if fail:
        with pytest.raises(RuntimeError, match="the trainer failed"):
            trainer.fit(module, datamodule=make_data(model_dir))
    else:
        trainer.fit(module, datamodule=make_data(model_dir))
    return reward.closed, spec.closed, rollout.worker.engine


# ----------------------------------------------------------------------------- asynchronous rollouts

ASYNC_CONFIG = CONFIGS / "async.yaml"


def make_async(reward=None, **kwargs) -> callbacks.AsyncRollout:
    return callbacks.AsyncRollout(**rollout_options(reward=reward, **kwargs))
