"""The pure functions of the RL step (``lit_offpolicy.training``: frozen, shaping, loss_mask, filled,
optim, update), against numbers computed by hand in float64, and ``prepare`` writing each Experience
field once, through ``fill``.

Tolerances: inputs are float64, so tensors compare to 1e-12 (1e-15 for a single product or sum of
two), a few float64 roundings of values of order 1; scalar metrics compare with ``pytest.approx``'s
relative 1e-6, which holds for any metric read back through float32 (eps 1.2e-7) after a handful of
operations. The overlong penalty's mean is computed in float32 (the scores' dtype): abs 1e-7 is one
float32 eps of a value of order 1.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch
from torch import nn

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import RunningMoments
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.training.filled import FILLED, fill
from lit_offpolicy.training.frozen import FrozenPasses, checked_source, frozen_passes
from lit_offpolicy.training.loss_mask import loss_mask, truncated_responses
from lit_offpolicy.training.optim import lr_factor
from lit_offpolicy.training.options import (
    AdvantageShaping,
    KLOptions,
    OptimOptions,
    RewardShaping,
    UpdateOptions,
)
from lit_offpolicy.training.passes import Passes
from lit_offpolicy.training.shaping import Batch, estimate_advantages, gather_batch, shape_rewards
from lit_offpolicy.training.update import accumulated_loss, in_sample_order, mini_batches

F64 = torch.float64


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def _experience(
    lengths: list[int], width: int = 4, scores=None, action_mask=None, truncated=None
) -> Experience:
    """B samples with one-token prompts and responses of ``lengths`` tokens, right-padded to ``width``."""
    size = len(lengths)
    mask = _mask(lengths, width)
    return Experience(
        prompt_ids=torch.ones(size, 1, dtype=torch.long),
        prompt_mask=torch.ones(size, 1, dtype=torch.long),
        response_ids=mask * 5,
        response_mask=mask,
        rollout_log_probs=-0.5 * mask.to(F64),
        scores=torch.tensor(scores if scores is not None else [0.0] * size, dtype=F64),
        group_ids=torch.arange(size),
        policy_versions=torch.zeros(size, dtype=torch.long),
        action_mask=action_mask,
        truncated=truncated,
    )


def _batch(lengths: list[int], scores: list[float], kl: torch.Tensor | None = None, width: int = 4) -> Batch:
    mask = _mask(lengths, width)
    return Batch(
        scores=torch.tensor(scores, dtype=F64),
        group_ids=torch.arange(len(lengths)),
        response_mask=mask,
        action_mask=None,
        policy_mask=mask,
        values=None,
        kl=kl,
        mine=slice(0, len(lengths)),
        width=width,
    )


# ----------------------------------------------------------------------------- frozen passes


class _NoForward(nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("no pass should run")


def test_frozen_passes_take_pi_rollout_in_bypass_mode_and_leave_what_has_no_model():
    exp = _experience([2, 3])
    exp.ref_log_probs = torch.full((2, 4), -1.0, dtype=F64)  # held from before: no reference keeps it
    passes = Passes(_NoForward(), None, None, False, None, False)
    frozen = frozen_passes(exp, OldLogProbs.ROLLOUT, [torch.arange(2)], passes)
    assert frozen.old_log_probs is exp.rollout_log_probs
    assert frozen.ref_log_probs is exp.ref_log_probs and frozen.values is None
    assert frozen_passes(exp, OldLogProbs.UPDATE, [torch.arange(2)], passes).old_log_probs is None


def test_checked_source_defaults_to_the_first_allowed_and_refuses_the_others():
    correction, update, kl = RolloutCorrection.disabled(), UpdateOptions(), KLOptions()
    assert checked_source(None, 4, correction, update, kl) is OldLogProbs.RECOMPUTE
    assert checked_source(OldLogProbs.UPDATE, 4, correction, update, kl) is OldLogProbs.UPDATE
    with pytest.raises(ValueError, match="old_log_probs='rollout' is not supported here"):
        checked_source(OldLogProbs.ROLLOUT, 4, correction, update, kl)
    with pytest.raises(ValueError, match="allowed values: 'recompute'$"):  # two optimizer steps
        checked_source(OldLogProbs.UPDATE, 4, correction, UpdateOptions(ppo_epochs=2), kl)


# ----------------------------------------------------------------------------- shaping


def test_gather_batch_on_one_process_is_the_experience_with_the_reward_kl():
    action = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]])
    exp = _experience([3, 4], action_mask=action)
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.1, -0.2, -0.3, -0.4]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.4, -0.2, -0.1, -0.9]], dtype=F64)
    values = torch.arange(8, dtype=F64).reshape(2, 4)
    frozen = FrozenPasses(old_log_probs=old, ref_log_probs=ref, values=values)
    batch = gather_batch(exp, frozen, KLOptions(use_in_reward=True, penalty="kl"))
    expected_kl = [[0.5, -1.0, 0.0, 0.0], [0.3, 0.0, -0.2, 0.5]]  # k1: log π_old − log π_ref
    torch.testing.assert_close(batch.kl, torch.tensor(expected_kl, dtype=F64), rtol=0, atol=1e-15)
    assert batch.policy_mask.tolist() == [[1, 0, 1, 0], [1, 1, 1, 1]]
    assert batch.values is values and batch.mine == slice(0, 2) and batch.width == 4
    assert torch.equal(batch.own(batch.kl), batch.kl)
    assert gather_batch(exp, frozen, KLOptions(use_loss=True)).kl is None


def test_shape_rewards_by_hand():
    """Scores 1, 0, 0.5 of responses of 2, 4, 3 tokens (L_max 4, L_cache 2): DAPO penalties 0, −1, −½;
    batch normalization of 1, −1, 0 (mean 0, unbiased std 1); clip at 0.9; − ½ · 0.2 per token."""
    kl = torch.full((3, 4), 0.2, dtype=F64)
    options = RewardShaping(norm="batch", clip=0.9, overlong_buffer_length=2)
    shaped = shape_rewards(_batch([2, 4, 3], [1.0, 0.0, 0.5], kl), options, RunningMoments(), kl_coef=0.5)
    normalized = 1.0 / (1.0 + 1e-6)  # (x − 0) / (std + 1e-6), then clipped to 0.9
    assert normalized > 0.9
    expected = [
        [-0.1, 0.9 - 0.1, 0.0, 0.0],
        [-0.1, -0.1, -0.1, -0.9 - 0.1],
        [-0.1, -0.1, 0.0 - 0.1, 0.0],
    ]
    torch.testing.assert_close(shaped.rewards, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    assert list(shaped.metrics) == ["reward/overlong_penalty_mean", "actor/reward_kl", "actor/kl_coef"]
    assert shaped.metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.5, abs=1e-7)
    assert shaped.reward_kl == shaped.metrics["actor/reward_kl"] == pytest.approx(0.2, abs=1e-15)
    assert shaped.metrics["actor/kl_coef"] == 0.5


def test_shape_rewards_without_options_puts_the_score_on_the_last_token_and_updates_running_moments():
    running = RunningMoments()
    shaped = shape_rewards(_batch([1, 3], [2.0, -1.0]), RewardShaping(), running, kl_coef=0.2)
    expected = [[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0]]
    assert shaped.rewards.tolist() == expected and shaped.reward_kl is None and shaped.metrics == {}
    assert running.count == 0
    shape_rewards(_batch([1, 3], [2.0, -1.0]), RewardShaping(norm="running"), running, kl_coef=0.2)
    assert running.count == 2 and running.mean == pytest.approx(0.5)


def test_the_overlong_buffer_must_stay_below_the_response_width():
    options = RewardShaping(overlong_buffer_length=4)
    with pytest.raises(
        ValueError, match=r"overlong_buffer_length=4 must be smaller .* allowed values: 1\.\.3"
    ):
        shape_rewards(_batch([2, 4], [1.0, 0.0]), options, RunningMoments(), kl_coef=0.0)


def _fixed_estimator(advantages: list[list[float]], returns: list[list[float]], calls: list):
    def estimator(rewards, response_mask, values=None, group_ids=None, action_mask=None):
        calls.append((rewards, response_mask, values, group_ids, action_mask))
        return torch.tensor(advantages, dtype=F64), torch.tensor(returns, dtype=F64)

    return estimator


def test_estimate_advantages_clips_by_hand():
    """Valid tokens 2 + 3: advantages 2, −1 | 0.5, 3, −4 clipped at 1.5 (3 of 5 clipped)."""
    calls: list = []
    advantages = [[2.0, -1.0, 0.0, 0.0], [0.5, 3.0, -4.0, 0.0]]
    returns = [[1.0, 1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 0.0]]
    batch, rewards = _batch([2, 3], [0.0, 0.0]), torch.zeros(2, 4, dtype=F64)
    batch = dataclasses.replace(batch, values=torch.zeros(2, 4, dtype=F64))  # a critic: value targets logged
    shaped = estimate_advantages(
        _fixed_estimator(advantages, returns, calls), batch, rewards, AdvantageShaping(clip=1.5)
    )
    (call,) = calls
    assert call[0] is rewards and call[1] is batch.response_mask and call[3] is batch.group_ids
    expected = [[1.5, -1.0, 0.0, 0.0], [0.5, 1.5, -1.5, 0.0]]
    assert shaped.advantages.tolist() == expected and shaped.returns.tolist() == returns
    assert list(shaped.metrics) == [
        "actor/advantage_clipfrac",
        "actor/advantages_mean",
        "critic/returns_mean",
    ]
    assert shaped.metrics["actor/advantage_clipfrac"] == pytest.approx(3 / 5)
    assert shaped.metrics["actor/advantages_mean"] == pytest.approx((1.5 - 1.0 + 0.5 + 1.5 - 1.5) / 5)
    assert shaped.metrics["critic/returns_mean"] == pytest.approx((1 + 1 + 2 + 2 + 2) / 5)


def test_estimate_advantages_whitens_by_hand():
    """(A − mean) / √(var + 1e-8) over the 5 valid tokens, unbiased var; padding stays 0."""
    values = [2.0, -1.0, 0.5, 3.0, -4.0]
    mean = sum(values) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 4 + 1e-8)
    advantages = [[2.0, -1.0, 0.0, 0.0], [0.5, 3.0, -4.0, 0.0]]
    estimator = _fixed_estimator(advantages, advantages, [])
    batch, rewards = _batch([2, 3], [0.0, 0.0]), torch.zeros(2, 4, dtype=F64)
    shaped = estimate_advantages(estimator, batch, rewards, AdvantageShaping(whiten=True))
    w = [(v - mean) / std for v in values]
    expected = [[w[0], w[1], 0.0, 0.0], [w[2], w[3], w[4], 0.0]]
    torch.testing.assert_close(shaped.advantages, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    assert list(shaped.metrics) == ["actor/advantages_mean"]  # no critic: no critic/* metric
    assert shaped.metrics["actor/advantages_mean"] == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------- loss mask


def test_truncated_responses_only_with_mask_truncated_and_finish_reasons():
    exp = _experience([2, 4], truncated=torch.tensor([False, True]))
    assert truncated_responses(exp, mask_truncated=False) is None
    assert truncated_responses(exp, mask_truncated=True).tolist() == [False, True]
    with pytest.raises(ValueError, match="mask_truncated=True needs each response's finish reason"):
        truncated_responses(_experience([2, 4]), mask_truncated=True)


def test_loss_mask_is_the_policy_mask_less_truncated_rows():
    action = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 0]])
    exp = _experience([2, 4, 3], action_mask=action, truncated=torch.tensor([False, True, False]))
    truncated = truncated_responses(exp, mask_truncated=True)
    before = loss_mask(exp, None, RolloutCorrection.disabled(), truncated)  # π_old not known yet
    expected = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert before.loss_mask.tolist() == expected and before.is_weights is None and before.metrics == {}
    after = loss_mask(exp, exp.rollout_log_probs, RolloutCorrection.disabled(), truncated)
    assert after.loss_mask.tolist() == expected and after.is_weights is None
    assert after.metrics and all(name.startswith("rollout_corr/") for name in after.metrics)
    assert after.metrics["rollout_corr/kl"] == pytest.approx(0.0)  # π_old = π_rollout
    untouched = loss_mask(exp, exp.rollout_log_probs, RolloutCorrection.disabled(), None)
    assert torch.equal(untouched.loss_mask, exp.policy_mask)


# ----------------------------------------------------------------------------- fill


def test_fill_writes_the_step_fields_only():
    exp = _experience([2, 3])
    advantages = torch.ones(2, 4, dtype=F64)
    fill(exp, advantages=advantages, is_weights=None)
    assert exp.advantages is advantages and exp.is_weights is None
    with pytest.raises(ValueError, match=r"fill: \['scores'\] are not fields the step fills"):
        fill(exp, scores=torch.zeros(2))


class _Recording(Experience):
    """An Experience that records each later write of a field the step fills, with the writer's file."""

    def __setattr__(self, name, value):
        if name in FILLED and self.__dict__.get("_recording"):
            self.__dict__["_writes"].append((name, sys._getframe(1).f_code.co_filename))
        object.__setattr__(self, name, value)


@pytest.mark.parametrize(
    ("options", "source"),
    [({}, OldLogProbs.UPDATE), ({"rollout_correction": "seq_is_rs"}, OldLogProbs.RECOMPUTE)],
)
def test_prepare_writes_each_field_once_through_fill(tiny_model_dir, options, source):
    module = OffPolicyModule(model_path=tiny_model_dir, **options)
    rollout = _experience([2, 4, 3], scores=[1.0, 0.0, 0.5])
    exp = _Recording(**{field.name: getattr(rollout, field.name) for field in dataclasses.fields(rollout)})
    exp.__dict__.update(_recording=True, _writes=[])
    assert module.old_log_probs_source(len(exp)) is source
    module.prepare(exp, source)
    names = [name for name, _ in exp._writes]
    assert sorted(names) == sorted(FILLED), names  # every field once
    assert {writer.rsplit("/", 1)[-1] for _, writer in exp._writes} == {"filled.py"}
    assert (exp.old_log_probs is None) is (source is OldLogProbs.UPDATE)


# ----------------------------------------------------------------------------- optimizer and update


def test_lr_factor_by_hand():
    """Warm-up of 2 steps, then decay over the remaining 8 of 10 to min_lr_ratio 0.1."""
    cosine = lr_factor(OptimOptions(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1), 10)
    linear = lr_factor(OptimOptions(warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.1), 10)
    assert [cosine(0), cosine(1), cosine(2)] == [0.5, 1.0, 1.0]
    assert cosine(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # progress ¼
    assert cosine(6) == pytest.approx(0.55) and linear(6) == pytest.approx(0.55)  # progress ½
    assert linear(4) == pytest.approx(0.1 + 0.9 * 0.75)
    assert cosine(10) == pytest.approx(0.1) and linear(14) == pytest.approx(0.1)  # past the end: held
    assert lr_factor(OptimOptions(lr_schedule="cosine"), None)(5) == 1.0  # no total: constant
    assert lr_factor(OptimOptions(), 10)(7) == 1.0


def test_mini_batches_shuffle_each_epoch_with_one_generator():
    exp = _experience([1, 2, 3, 4, 1, 2])
    exp.scores = torch.arange(6, dtype=F64)  # each sample's index
    minis = list(mini_batches(exp, UpdateOptions(ppo_epochs=2, mini_batch_size=4), seed=3))
    assert [len(m) for m in minis] == [4, 2, 4, 2]
    generator = torch.Generator().manual_seed(3)
    for epoch in range(2):
        order = torch.randperm(6, generator=generator)
        got = torch.cat([minis[2 * epoch].scores, minis[2 * epoch + 1].scores]).long()
        assert got.tolist() == order.tolist()
    whole = list(mini_batches(exp, UpdateOptions(ppo_epochs=2), seed=3))
    assert [m.scores.tolist() for m in whole] == [list(range(6))] * 2  # one mini-batch: not shuffled


def test_in_sample_order_puts_rows_back():
    parts = [(torch.tensor([2, 0]), torch.tensor([[2.0], [0.0]])), (torch.tensor([1]), torch.tensor([[1.0]]))]
    assert in_sample_order(parts, torch.device("cpu")).tolist() == [[0.0], [1.0], [2.0]]


def test_accumulated_loss_by_hand():
    """A micro-batch holding 5 of the mini-batch's 9 tokens (2 of its 3 sequences)."""
    mini = _experience([2, 4, 3])
    mini.loss_mask = mini.response_mask
    micro = mini.select(torch.tensor([0, 2]))
    actor, critic = torch.tensor(2.0, dtype=F64), torch.tensor(3.0, dtype=F64)
    token_mean = accumulated_loss(actor, critic, micro, mini, "token-mean", value_coef=0.5)
    assert token_mean.item() == pytest.approx(2.0 * 5 / 9 + 0.5 * 3.0 * 5 / 9)
    seq_mean = accumulated_loss(actor, None, micro, mini, "seq-mean-token-mean", value_coef=0.5)
    assert seq_mean.item() == pytest.approx(2.0 * 2 / 3)


def test_adamw_is_fused_for_plain_cpu_and_cuda_parameters():
    """``fused_applies``: plain CPU parameters take AdamW's fused kernel (in place, no per-parameter
    temporaries); a parameter on another device (meta here), or none at all, keeps the default. The
    CUDA branch needs a GPU, which CI lacks: it is not run here."""
    from lit_offpolicy.training.optim import fused_applies, optimizer_and_schedule
    from lit_offpolicy.training.options import OptimOptions

    actor = torch.nn.Linear(3, 2)
    assert fused_applies(list(actor.parameters()))
    assert not fused_applies([])
    assert not fused_applies([*actor.parameters(), torch.nn.Parameter(torch.zeros(2, device="meta"))])
    optimizer = optimizer_and_schedule(actor, None, OptimOptions(lr=1e-3), 10)["optimizer"]
    assert optimizer.param_groups[0]["fused"] is True


def test_fused_adamw_steps_as_the_per_parameter_loop():
    """The fused CPU kernel computes AdamW's update (Loshchilov & Hutter 2019) as torch's per-parameter
    loop does: in float64 the weights after 3 steps agree to 1e-12 (a few ulps of the moments'
    arithmetic, far below one step's lr · 1 = 1e-2)."""
    torch.manual_seed(0)
    start = torch.randn(5, 4, dtype=F64)
    grads = [torch.randn(5, 4, dtype=F64) for _ in range(3)]
    weights = []
    for fused in (True, None):
        weight = torch.nn.Parameter(start.clone())
        optimizer = torch.optim.AdamW([weight], lr=1e-2, weight_decay=0.1, fused=fused)
        for grad in grads:
            weight.grad = grad.clone()
            optimizer.step()
        weights.append(weight.detach())
    assert (weights[0] - start).abs().max() > 1e-3  # the steps moved the weights
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-12)
