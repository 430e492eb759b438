"""Partial rollouts: a weight sync cuts the responses being generated, which resume under the new
weights; every token records the version that sampled it and its log-prob under that version.

Real parts only: tiny Llamas and the HF engine. The tests trigger the sync after a chosen number of
tokens; the fit with AsyncRollout and its producer thread is in
tests/integration/test_partial_rollouts_fit.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engines import EOS, PAD, PROMPTS, teacher_forced_log_probs, tiny_llama
from helpers.tolerances import reordered_sums

from lit_offpolicy import callbacks
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.rollout import Generation, HFEngine, SamplingParams
from lit_offpolicy.rollout.buffer import token_staleness
from lit_offpolicy.rollout.engine import EngineSpec, WeightSyncHook
from lit_offpolicy.rollout.rounds import mixed_version_fraction


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
            # float32, cached decoding (re-prefilled after the sync) against one full pass of each model:
            # as in tests/rollout/test_hf_engine.py, 2 × 2 × eps32 × √128 × max|lp| ≈ 2e-5
            atol = reordered_sums(expected, terms=128, stages=2)
            torch.testing.assert_close(torch.tensor(gen.log_probs), expected, rtol=0, atol=atol)
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
    assert mixed_version_fraction(exp) == pytest.approx(1 / 3)  # 1 of 3, one rounding ≪ rel 1e-6
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
