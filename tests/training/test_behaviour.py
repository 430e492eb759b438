"""π_old of a stale token (``training.behaviour``): its own π_rollout where no rollout correction reaches
the loss, by hand in float64, and through the module's TOPR loss on the tiny model (issue #38).

Tolerances: the selection is exact (``torch.equal``). The module's loss runs in float64 on values of
order 1 summed over ≤ 24 tokens: 1e-12 is far above that many float64 roundings (24 · 2.2e-16 ≈ 5e-15
relative) and far below the difference a wrong π_old makes (a ratio ≠ 1 on about half of the tokens).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.experiences import fixed_experience

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.losses import TOPR
from lit_offpolicy.training.behaviour import loss_old_log_probs
from lit_offpolicy.training.forward import policy_log_probs

F64 = torch.float64


def _two_samples(policy_versions, token_versions=None) -> Experience:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return Experience(
        prompt_ids=torch.ones(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=mask * 5,
        response_mask=mask,
        rollout_log_probs=torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 0.0]], dtype=F64),
        scores=torch.zeros(2, dtype=F64),
        group_ids=torch.arange(2),
        policy_versions=torch.tensor(policy_versions),
        token_versions=None if token_versions is None else torch.tensor(token_versions),
    )


OLD = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]], dtype=F64)


def test_a_stale_sample_takes_its_rollout_log_probs_and_a_fresh_one_keeps_pi_old():
    exp = _two_samples([4, 5])
    anchored = loss_old_log_probs(OLD, exp, 5, RolloutCorrection.disabled())
    assert torch.equal(anchored[0], exp.rollout_log_probs[0])  # sampled by version 4, trained at 5
    assert torch.equal(anchored[1], OLD[1])  # sampled by version 5: on-policy
    # the same batch trained at version 4 (synchronous) keeps π_old everywhere
    synchronous = dataclasses.replace(exp, policy_versions=torch.tensor([4, 4]))
    assert torch.equal(loss_old_log_probs(OLD, synchronous, 4, RolloutCorrection.disabled()), OLD)


def test_partial_rollouts_anchor_token_by_token():
    # a response resumed under version 5 after two tokens of version 3 (partial rollouts)
    exp = _two_samples([3, 5], token_versions=[[3, 3, 5], [5, 5, 5]])
    anchored = loss_old_log_probs(OLD, exp, 5, RolloutCorrection.disabled())
    expected = torch.tensor([[-1.0, -2.0, -0.3], [-0.4, -0.5, 0.0]], dtype=F64)
    assert torch.equal(anchored, expected)


@pytest.mark.parametrize("preset", ["seq_is_rs", "token_tis", "geo_rs", "pure_is"])
def test_a_correction_that_reaches_the_loss_keeps_pi_old(preset):
    correction = RolloutCorrection.from_preset(preset)
    assert correction.changes_the_loss
    exp = _two_samples([4, 4])
    assert loss_old_log_probs(OLD, exp, 5, correction) is OLD


def test_a_correction_that_only_logs_anchors_like_none():
    exp = _two_samples([4, 4])
    correction = RolloutCorrection.disabled()
    assert not correction.changes_the_loss
    assert torch.equal(loss_old_log_probs(OLD, exp, 5, correction), exp.rollout_log_probs)


# ----------------------------------------------------------------------------- the module, end to end


def _topr_module(model_dir: str, version: int) -> OffPolicyModule:
    module = OffPolicyModule(
        model_path=model_dir, policy_loss=TOPR(loss_agg_mode="token-mean"), logprob_chunk_size=None
    ).double()
    module.policy_version = version
    return module


@pytest.mark.parametrize("source", [OldLogProbs.RECOMPUTE, OldLogProbs.UPDATE])
def test_topr_tapers_a_stale_negative_token_by_its_ratio_to_pi_rollout(tiny_model_dir, source):
    """TOPR's negative weight is clip(π_θ / μ, 0, 1) with μ the policy that sampled the token
    (Le Roux et al. 2025, eq. 8): by hand from the token log-probs, and 1 (plain REINFORCE) on the same
    batch when it is on-policy."""
    losses = {}
    for stale in (False, True):
        module = _topr_module(tiny_model_dir, version=3)
        exp = fixed_experience(tiny_model_dir)
        scores = (torch.arange(len(exp)) % 3 == 0).to(exp.scores.dtype)  # a third right, the rest 0
        versions = torch.full((len(exp),), 2 if stale else 3)
        exp = dataclasses.replace(exp, scores=scores, policy_versions=versions, token_versions=None)
        module.prepare(exp, source)
        _, _, metrics = module.micro_batch_loss(exp, source is OldLogProbs.UPDATE)
        with torch.no_grad():
            pi, _ = policy_log_probs(module.actor, exp, exp.temperature)
        mask = exp.loss_mask.bool()
        mu = exp.rollout_log_probs.to(F64) if stale else pi
        ratio = torch.exp(pi - mu)
        negative = (exp.scores <= 0)[:, None].expand_as(pi)
        assert (negative & mask).any() and (~negative & mask).any()
        weight = torch.where(negative, ratio.clamp(0.0, 1.0), torch.ones_like(ratio))
        expected = (-weight * exp.advantages * pi)[mask].sum() / mask.sum()
        assert metrics["actor/pg_loss"].item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-12)
        assert metrics["actor/ratio_mean"].item() == pytest.approx(ratio[mask].mean().item(), rel=1e-12)
        losses[stale] = metrics["actor/pg_loss"].item()
    assert losses[True] != pytest.approx(losses[False], rel=1e-6), "the stale batch must see its own μ"
