"""Partial rollouts through a real fit: AsyncRollout(partial_rollouts) with its producer thread, the tiny
Llama and the HF engine, whose generations wait, in a real forward pre-hook, for the trainer's next
weight push, so that every push arrives while the producer is generating. The engine-level cuts are
tested in tests/rollout/test_partial_rollouts.py.
"""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from helpers.fits import BATCH_SIZE, N_SAMPLES, MemoryLogger, make_async, make_data, make_trainer
from helpers.tolerances import reordered_sums

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.models import load_actor
from lit_offpolicy.rollout import SamplingParams
from lit_offpolicy.rollout.rounds import mixed_version_fraction
from lit_offpolicy.training.forward import frozen_log_probs
from lit_offpolicy.training.options import OptimOptions


class PushMidGeneration(L.Callback):
    """After the rollout callback built its engine: from its second generation on (the first is the
    batch of step 0, before any push), the engine's model waits before the generation's third forward
    (its second sampled token) until the trainer has handed weights over (``wait_s`` at most); the
    engine then cuts the responses at the next token. Each batch j ≥ 1 starts before the push of
    version j (its staleness bound lets it start while step j − 1 trains), so every push lands in the
    middle of a generation however fast the machine generates. (A fixed slowdown of the engine raced
    the trainer's steps: on a slow machine a generation ended before the push.)"""

    def __init__(self, rollout: callbacks.AsyncRollout, wait_s: float = 60.0) -> None:
        self.rollout, self.wait_s = rollout, wait_s
        self.generations = self.forwards = 0

    def on_fit_start(self, trainer, pl_module):
        engine = self.rollout.worker.engine
        generate = engine.generate

        def counted(*args, **kwargs):
            self.generations, self.forwards = self.generations + 1, 0
            return generate(*args, **kwargs)

        engine.generate = counted
        engine.model.register_forward_pre_hook(self._wait_for_a_push)

    def _wait_for_a_push(self, *args) -> None:
        self.forwards += 1
        if self.generations < 2 or self.forwards != 3:
            return
        deadline = time.monotonic() + self.wait_s
        while not self.rollout._weights_pending() and time.monotonic() < deadline:
            time.sleep(0.005)


class RecordVersions(L.Callback):
    """Each step's experience, and the actor's weights at every version (0 before the first step)."""

    def __init__(self) -> None:
        self.experiences: list[tuple[int, Experience]] = []
        self.weights: dict[int, dict] = {}

    def on_train_start(self, trainer, pl_module):
        self.weights[0] = {k: v.detach().clone() for k, v in pl_module.actor.state_dict().items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.experiences.append((pl_module.policy_version, batch["experience"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = pl_module.actor.state_dict()
        self.weights[pl_module.policy_version] = {k: v.detach().clone() for k, v in state.items()}


def test_async_partial_rollouts_train_on_mixed_version_responses_with_each_tokens_log_prob(tiny_model_dir):
    """AsyncRollout(partial_rollouts) with max_staleness 1, every weight push made to land while the
    next batch is generated (``PushMidGeneration``), so from step 1 on responses are cut and resumed;
    each token's π_rollout is its version's log-prob (recomputed here with that version's weights),
    staleness is per token and at most 1."""
    L.seed_everything(0, verbose=False)
    rollout = make_async(
        max_staleness=1, partial_rollouts=True, sampling=SamplingParams(n=N_SAMPLES, max_tokens=8, seed=0)
    )
    record, logger = RecordVersions(), MemoryLogger()
    module = OffPolicyModule(model_path=tiny_model_dir, advantage="grpo", optim=OptimOptions(lr=1e-3))
    steps = 4
    trainer = make_trainer([rollout, PushMidGeneration(rollout), record], max_steps=steps, logger=logger)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))

    assert len(record.experiences) == steps
    reference = load_actor(tiny_model_dir).eval()
    mixed_fractions = logger.values("rollout/mixed_version_fraction")
    for (version, exp), mixed, staleness_max, staleness_mean in zip(
        record.experiences,
        mixed_fractions,
        logger.values("rollout/staleness_max"),
        logger.values("rollout/staleness_mean"),
        strict=True,
    ):
        assert len(exp) == BATCH_SIZE * N_SAMPLES
        valid = exp.response_mask.bool()
        versions = exp.token_versions
        assert torch.equal(versions[:, 0], exp.policy_versions)
        assert (versions.diff(dim=1) >= 0).all(), "a later token sampled by older weights"
        ages = version - versions[valid]
        assert ages.min() >= 0 and ages.max() <= 1
        assert staleness_max == ages.max().item()
        # float32 means of ≤ 64 small integers and a ratio of counts: ≤ 2 roundings ≪ approx's rel 1e-6
        assert staleness_mean == pytest.approx(ages.float().mean().item())
        assert mixed == pytest.approx(mixed_version_fraction(exp))
        expected = torch.zeros_like(exp.rollout_log_probs)
        for v in versions[valid].unique().tolist():
            reference.load_state_dict(record.weights[v])
            at_v = frozen_log_probs(reference, exp, exp.temperature, 16)
            expected = torch.where(versions == v, at_v, expected)
        # float32, cached decoding across weight pushes against batched teacher forcing with each token's
        # version: sums of ≤ 512 terms regrouped in the 4 blocks, on both paths (helpers.tolerances)
        atol = reordered_sums(expected[valid], terms=512, stages=4)
        torch.testing.assert_close(exp.rollout_log_probs[valid], expected[valid], rtol=0, atol=atol)
    assert mixed_fractions[0] == 0  # batch 0 is generated before any push
    assert min(mixed_fractions[1:]) > 0, "a weight push did not cut a generation: the test is vacuous"
