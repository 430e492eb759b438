"""DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, section 3.4): the soft punishment
of responses in the last ``overlong_buffer_length`` tokens before ``max_tokens`` (eq. 13), and the
filtering of truncated responses out of the loss; by hand, then through ``OffPolicyModule.prepare``.
"""

import pytest
import torch

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GRPO, overlong_penalty
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.rollout import Generation
from lit_offpolicy.training.options import RewardShaping

MAX_TOKENS = 5


def test_penalty_below_inside_and_at_the_end_of_the_buffer():
    """L_max = 10, L_cache = 4, so the buffer is lengths 7..10 and L_max − L_cache = 6:
    |y| ≤ 6 → 0; 7 → (6 − 7)/4 = −0.25; 8 → −0.5; 9 → −0.75; 10 = L_max → (6 − 10)/4 = −1; 12 → −1."""
    lengths = torch.tensor([0, 1, 5, 6, 7, 8, 9, 10, 12])
    want = [0.0, 0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, max_length=10, buffer_length=4).tolist() == want
    # the factor scales it: 0.5 · (−0.25, −0.5, −0.75, −1)
    half = overlong_penalty(lengths, max_length=10, buffer_length=4, penalty_factor=0.5)
    assert half.tolist() == [0.5 * w for w in want]


def test_penalty_at_the_papers_sizes():
    """DAPO: 20,480 max tokens, the last 4,096 the punishment buffer: 16,384 tokens → 0,
    18,432 → (16,384 − 18,432)/4,096 = −0.5, 20,479 → −4,095/4,096, 20,480 → −1."""
    lengths = torch.tensor([16384, 18432, 20479, 20480])
    got = overlong_penalty(lengths, max_length=20480, buffer_length=4096)
    # float32 default of assert_close (rtol 1.3e-6, atol 1e-5): quotients of integers < 2^24, ≤ 1 rounding
    torch.testing.assert_close(got, torch.tensor([0.0, -0.5, -4095 / 4096, -1.0]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer_length": 10}, r"overlong_buffer_length=10 is out of range; allowed values: \[1, 10\)"),
        ({"buffer_length": 0}, "overlong_buffer_length=0 is out of range"),
        ({"buffer_length": 4, "penalty_factor": -1.0}, "overlong_penalty_factor=-1.0 is out of range"),
    ],
)
def test_penalty_bad_arguments_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(torch.tensor([3]), max_length=10, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overlong_buffer_length": -4}, "reward_shaping.overlong_buffer_length=-4 is not supported"),
        ({"overlong_buffer_length": 0}, "reward_shaping.overlong_buffer_length=0 is not supported"),
        ({"overlong_buffer_length": 2.5}, "reward_shaping.overlong_buffer_length=2.5 is not supported"),
        ({"overlong_penalty_factor": -0.5}, "reward_shaping.overlong_penalty_factor=-0.5 is out of range"),
        ({"mask_truncated": "yes"}, "reward_shaping.mask_truncated='yes' is not supported"),
    ],
)
def test_bad_options_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardShaping(**kwargs)


def group_experience(pad_token_id: int) -> Experience:
    """One prompt, 4 responses of 2, 3, 4 and 5 tokens (5 = max tokens, cut: finish reason "length"),
    scores 1, 1, 0, 0, padded to MAX_TOKENS as the rollout worker pads them."""
    generations = [
        Generation([7] * n, [-1.0] * n, "length" if n == MAX_TOKENS else "stop") for n in (2, 3, 4, 5)
    ]
    return Experience.from_generations(
        [[5, 6]],
        [generations],
        [1.0, 1.0, 0.0, 0.0],
        pad_token_id=pad_token_id,
        policy_version=0,
        response_width=MAX_TOKENS,
    )


def test_experience_records_truncated_responses():
    exp = group_experience(pad_token_id=0)
    assert exp.truncated.tolist() == [False, False, False, True]
    assert exp.select(torch.tensor([3, 0])).truncated.tolist() == [True, False]
    assert Experience.cat([exp, exp], pad_token_id=0).truncated.tolist() == [False, False, False, True] * 2


@pytest.fixture(scope="module")
def module_for(tiny_model_dir):
    def make(**shaping) -> OffPolicyModule:
        return OffPolicyModule(
            model_path=tiny_model_dir,
            advantage=GRPO(norm_by_std=False),
            reward_shaping=RewardShaping(**shaping),
        )

    return make


def test_prepare_adds_the_penalty_before_the_advantages(module_for):
    """L_max = 5, L_cache = 2, L_max − L_cache = 3: lengths 2, 3 → 0; 4 → (3 − 4)/2 = −0.5; 5 → −1.
    Shaped scores 1, 1, −0.5, −1, group mean 0.125; GRPO without std: 0.875, 0.875, −0.625, −1.125 on
    every valid token. reward/overlong_penalty_mean = (−0.5 − 1)/4 = −0.375."""
    module = module_for(overlong_buffer_length=2)
    exp = group_experience(module.tokenizer.pad_token_id)
    metrics = module.prepare(exp)
    # default tolerances (approx rel 1e-6; assert_close float32 rtol 1.3e-6, atol 1e-5): dyadic hand
    # values that float32 holds exactly, through a 4-term mean: exact or an ulp (1.2e-7 relative) off
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.375)
    want = torch.tensor([0.875, 0.875, -0.625, -1.125])[:, None] * exp.response_mask
    torch.testing.assert_close(exp.advantages * exp.response_mask, want)
    assert exp.scores.tolist() == [1.0, 1.0, 0.0, 0.0]  # the reward as scored stays in the experience
    assert torch.equal(exp.loss_mask, exp.response_mask)  # nothing masked without mask_truncated


def test_penalty_factor_scales_the_shaped_scores(module_for):
    """factor 0.5: shaped 1, 1, −0.25, −0.5, mean 0.3125: advantages 0.6875, 0.6875, −0.5625, −0.8125."""
    module = module_for(overlong_buffer_length=2, overlong_penalty_factor=0.5)
    exp = group_experience(module.tokenizer.pad_token_id)
    # default tolerances: dyadic values exact in float32, a 4-term mean: exact or an ulp off
    assert module.prepare(exp)["reward/overlong_penalty_mean"] == pytest.approx(-0.1875)
    torch.testing.assert_close(exp.advantages[:, 0], torch.tensor([0.6875, 0.6875, -0.5625, -0.8125]))


@pytest.mark.parametrize("source", [OldLogProbs.RECOMPUTE, OldLogProbs.UPDATE])
def test_mask_truncated_leaves_the_cut_response_out_of_the_loss(module_for, source):
    """Only the 5-token response was cut: its loss-mask row is 0, the others keep their tokens. Its
    score still enters the group: advantages (no penalty) 1 − 0.5 = 0.5, 0.5, −0.5, −0.5."""
    module = module_for(mask_truncated=True)
    exp = group_experience(module.tokenizer.pad_token_id)
    metrics = module.prepare(exp, source)
    # default tolerances: dyadic values exact in float32, a 4-term mean: exact or an ulp off
    assert metrics["actor/masked_truncated_fraction"] == pytest.approx(0.25)
    assert "reward/overlong_penalty_mean" not in metrics
    assert exp.loss_mask.sum(dim=1).tolist() == [2, 3, 4, 0]
    assert torch.equal(exp.loss_mask[:3], exp.response_mask[:3])
    torch.testing.assert_close(exp.advantages[:, 0], torch.tensor([0.5, 0.5, -0.5, -0.5]))


def test_buffer_as_long_as_max_tokens_is_a_clear_error(module_for):
    module = module_for(overlong_buffer_length=MAX_TOKENS)
    with pytest.raises(ValueError, match=r"overlong_buffer_length=5 must be smaller .*max_tokens=5.*1\.\.4"):
        module.prepare(group_experience(module.tokenizer.pad_token_id))


def test_mask_truncated_without_finish_reasons_is_a_clear_error(module_for):
    module = module_for(mask_truncated=True)
    exp = group_experience(module.tokenizer.pad_token_id)
    exp.truncated = None
    with pytest.raises(ValueError, match="mask_truncated=True needs each response's finish reason"):
        module.prepare(exp)
