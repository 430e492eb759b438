"""Partial rollouts: a weight sync cuts the responses being generated, which resume under the new
weights; every token records the version that sampled it and its log-prob under that version.

Real parts only: tiny Llamas, the HF engine, a real Lightning fit with AsyncRollout and its producer
thread. The engine-level tests trigger the sync after a chosen number of tokens; the fit slows the
engine's forward passes (a real forward pre-hook that sleeps) so that every weight push arrives while
the producer is generating.
"""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from test_async import make_async
from test_hf_engine import EOS, PAD, PROMPTS, teacher_forced_log_probs, tiny_llama
from test_trainer import BATCH_SIZE, N_SAMPLES, MemoryLogger, make_data, make_trainer

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.models import load_actor
from lit_offpolicy.rollout import Generation, HFEngine, SamplingParams
from lit_offpolicy.rollout.buffer import token_staleness
from lit_offpolicy.rollout.engine import EngineSpec, WeightSyncHook
from lit_offpolicy.rollout.worker import mixed_version_fraction
from lit_offpolicy.training.forward import frozen_log_probs
from lit_offpolicy.training.options import OptimOptions


class SyncAfter:
    """A weight sync that becomes pending after ``tokens`` sampling steps and loads ``weights`` as
    ``version`` into ``engine`` when applied (once)."""

    def __init__(self, engine: HFEngine, weights: dict, version: int, tokens: int) -> None:
        self.engine, self.weights, self.version, self.tokens = engine, weights, version, tokens
        self.steps = 0
        self.applied = 0

    def pending(self) -> bool:
        self.steps += 1
        return self.applied == 0 and self.steps >= self.tokens

    def apply(self) -> None:
        self.applied += 1
        self.engine.load_weights(self.weights, self.version)

    def hook(self) -> WeightSyncHook:
        return WeightSyncHook(self.pending, self.apply)


@pytest.mark.parametrize("cut_after", [1, 3])
def test_a_response_cut_by_a_sync_carries_each_tokens_version_and_its_log_prob(cut_after):
    old, new = tiny_llama(0), tiny_llama(1)
    engine = HFEngine(old, EOS, PAD, copy_model=True)
    sync = SyncAfter(engine, new.state_dict(), version=1, tokens=cut_after)
    params = SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=0)
    outputs = engine.generate(PROMPTS, params, sync=sync.hook())

    assert sync.applied == 1 and engine.policy_version == 1
    mixed = 0
    for prompt, group in zip(PROMPTS, outputs, strict=True):
        for gen in group:
            before = min(cut_after, len(gen.token_ids))
            assert gen.versions == [0] * before + [1] * (len(gen.token_ids) - before)
            by_old = teacher_forced_log_probs(old, prompt, gen.token_ids, 0.9)
            by_new = teacher_forced_log_probs(new, prompt, gen.token_ids, 0.9)
            expected = torch.cat([by_old[:before], by_new[before:]])
            torch.testing.assert_close(torch.tensor(gen.log_probs), expected, rtol=0, atol=2e-5)
            if before < len(gen.token_ids):  # resumed: the old weights would have given other log-probs
                mixed += 1
                assert (by_old - by_new)[before:].abs().max() > 1e-3
    assert mixed > 0, "no response was resumed: the checks above would be vacuous"

    again = HFEngine(old, EOS, PAD, copy_model=True)
    repeat = again.generate(PROMPTS, params, sync=SyncAfter(again, new.state_dict(), 1, cut_after).hook())
    assert repeat == outputs  # seeded: the same cut gives the same responses


def test_a_sync_that_never_comes_changes_nothing():
    model = tiny_llama(0)
    params = SamplingParams(n=4, max_tokens=6, stop_token_ids=(3,), seed=0)
    plain = HFEngine(model, EOS, PAD).generate(PROMPTS, params)
    hooked = HFEngine(model, EOS, PAD).generate(PROMPTS, params, sync=WeightSyncHook(lambda: False, None))
    for plain_group, hooked_group in zip(plain, hooked, strict=True):
        for a, b in zip(plain_group, hooked_group, strict=True):
            assert (a.token_ids, a.log_probs, a.finish_reason) == (b.token_ids, b.log_probs, b.finish_reason)
            assert a.versions is None and b.versions == [0] * len(b.token_ids)


def test_a_response_that_ends_at_the_cut_is_not_resumed():
    old, new = tiny_llama(0), tiny_llama(1)
    engine = HFEngine(old, EOS, PAD, copy_model=True)
    sync = SyncAfter(engine, new.state_dict(), version=1, tokens=4)
    (group,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, seed=0), sync=sync.hook())
    # the cut comes with the last allowed token: nothing is left to resume, no weights are loaded
    assert group[0].finish_reason in ("length", "stop") and group[0].versions == [0] * len(group[0].token_ids)
    assert sync.applied == 0


def test_experience_keeps_token_versions_and_the_oldest_as_the_samples_version():
    generations = [
        [
            Generation([4, 5, 6], [-0.1, -0.2, -0.3], "length", [2, 2, 3]),
            Generation([7], [-0.5], "stop", [3]),
        ],
        [Generation([8, 9], [-0.4, -0.6], "stop")],  # not recorded: the engine's version
    ]
    exp = Experience.from_generations(
        [[1, 2], [3]], generations, [1.0, 0.0, 0.5], pad_token_id=PAD, policy_version=3, response_width=4
    )
    assert exp.token_versions.tolist() == [[2, 2, 3, 3], [3, 3, 3, 3], [3, 3, 3, 3]]
    assert exp.policy_versions.tolist() == [2, 3, 3]
    assert mixed_version_fraction(exp) == pytest.approx(1 / 3)
    # per valid token: 5 − [2, 2, 3], 5 − [3], 5 − [3, 3]
    assert token_staleness(5, exp).tolist() == [3, 3, 2, 2, 2, 2]
    both = Experience.cat([exp, exp.select(torch.tensor([0]))], PAD)
    assert both.token_versions.tolist()[-1] == [2, 2, 3, 3]
    exp.token_versions = None  # a hand-built experience: each sample's version for all its tokens
    assert token_staleness(5, exp).tolist() == [3, 3, 3, 2, 2, 2]


class PlainEngineSpec(EngineSpec):
    """A user's engine spec that does not declare partial rollouts (never built here)."""

    def build(self, context):
        raise AssertionError("not built")


def test_partial_rollouts_need_an_engine_that_can_resume():
    with pytest.raises(
        ValueError, match=r"partial_rollouts=True needs an engine .*'hf', 'vllm'.*PlainEngineSpec"
    ):
        callbacks.AsyncRollout(engine=PlainEngineSpec(), partial_rollouts=True)
    assert callbacks.AsyncRollout(engine="vllm", partial_rollouts=True).worker.sync_hook is not None


class SlowEngine(L.Callback):
    """After the rollout callback built its engine: every forward of the engine's model sleeps first."""

    def __init__(self, rollout: callbacks.AsyncRollout, seconds: float) -> None:
        self.rollout, self.seconds = rollout, seconds

    def on_fit_start(self, trainer, pl_module):
        self.rollout.worker.engine.model.register_forward_pre_hook(lambda *args: time.sleep(self.seconds))


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
    """AsyncRollout(partial_rollouts) with max_staleness 1 and an engine slower than the trainer:
    every weight push lands while the next batch is generated, so from step 1 on responses are cut
    and resumed; each token's π_rollout is its version's log-prob (recomputed here with that
    version's weights), staleness is per token and at most 1."""
    L.seed_everything(0, verbose=False)
    rollout = make_async(
        max_staleness=1, partial_rollouts=True, sampling=SamplingParams(n=N_SAMPLES, max_tokens=8, seed=0)
    )
    record, logger = RecordVersions(), MemoryLogger()
    module = OffPolicyModule(model_path=tiny_model_dir, advantage="grpo", optim=OptimOptions(lr=1e-3))
    steps = 4
    trainer = make_trainer([rollout, SlowEngine(rollout, 0.05), record], max_steps=steps, logger=logger)
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
        assert staleness_mean == pytest.approx(ages.float().mean().item())
        assert mixed == pytest.approx(mixed_version_fraction(exp))
        expected = torch.zeros_like(exp.rollout_log_probs)
        for v in versions[valid].unique().tolist():
            reference.load_state_dict(record.weights[v])
            at_v = frozen_log_probs(reference, exp, exp.temperature, 16)
            expected = torch.where(versions == v, at_v, expected)
        torch.testing.assert_close(exp.rollout_log_probs[valid], expected[valid], rtol=0, atol=2e-5)
    assert mixed_fractions[0] == 0  # batch 0 is generated before any push
    assert min(mixed_fractions[1:]) > 0, "a weight push did not cut a generation: the test is vacuous"
