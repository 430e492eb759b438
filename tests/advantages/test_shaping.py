"""Reward and advantage shaping against hand-computed values and independent python loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lit_offpolicy.advantages import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    normalize_rewards,
    token_level_rewards,
    whiten_advantages,
)

NAN = math.nan
EPS = 1e-6


def close(actual, expected, tol=1e-12):
    """``tol``: float64 against python floats, the same few-term sums, one square root and a quotient in
    another order: ≲ 10 eps64 (2.2e-16) × values ≤ ~10 ≈ 2e-14, so 1e-12 leaves 50×. Float32 callers
    compare exact values (placements, clips) or pass a bound of their own."""
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# --- RunningMoments ------------------------------------------------------------------------------------


def test_running_moments_match_the_whole_stream():
    batches = [[1.0, 2.0, 3.0], [10.0], [-4.0, 0.5], [2.0, 2.0, 7.25, -1.0]]
    moments = RunningMoments()
    assert (moments.mean, moments.std, moments.count) == (0.0, 1.0, 0)
    seen = []
    for batch in batches:
        batch_mean, batch_std = moments.update(torch.tensor(batch, dtype=torch.float64))
        seen += batch
        # float64 against statistics' exact-rational means: ≲ 10 eps64 × (≤ 10 values ≤ 10) ≈ 2e-13
        assert batch_mean == pytest.approx(statistics.mean(batch), abs=1e-12)
        assert batch_std == pytest.approx(statistics.stdev(batch) if len(batch) > 1 else 0.0, abs=1e-12)
        assert moments.mean == pytest.approx(statistics.mean(seen), abs=1e-12)
        assert moments.std == pytest.approx(statistics.stdev(seen), abs=1e-12)
        assert moments.count == len(seen)


def test_running_moments_hand_computed_and_std_one_until_two_values():
    moments = RunningMoments()
    assert moments.update(torch.tensor([4.0])) == (4.0, 0.0)
    assert (moments.mean, moments.std) == (4.0, 1.0)
    moments.update(torch.tensor([[2.0, 6.0]], dtype=torch.bfloat16))  # any shape and dtype
    assert moments.mean == 4.0
    assert moments.std == 2.0  # Σ(x − 4)² = 8 over n − 1 = 2


def test_running_moments_state_dict_round_trip():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 5.0, 2.0]))
    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.state_dict() == moments.state_dict()
    for m in (moments, restored):
        m.update(torch.tensor([3.0, -1.0]))
    assert (restored.mean, restored.std, restored.count) == (moments.mean, moments.std, moments.count)


@pytest.mark.parametrize("values", [torch.tensor([]), torch.tensor([1.0, NAN]), torch.tensor([math.inf])])
def test_running_moments_reject_empty_or_non_finite_batches(values):
    moments = RunningMoments()
    with pytest.raises(ValueError, match="RunningMoments.update"):
        moments.update(values)
    assert moments.count == 0


def test_running_moments_reject_foreign_state():
    with pytest.raises(ValueError, match="sum_squares"):
        RunningMoments().load_state_dict({"mean": 0.0, "var": 1.0, "count": 1})


# --- normalize_rewards ---------------------------------------------------------------------------------

SCORES = [1.0, 2.0, 3.0, 4.0]
BATCH_STD = math.sqrt(5 / 3)  # mean 2.5, Σ(x − 2.5)² = 5


def test_no_normalization_returns_scores_as_given():
    scores = torch.tensor(SCORES)
    assert normalize_rewards(scores) is scores


@pytest.mark.parametrize(
    "shift, scale, expected",
    [
        (False, False, [(x - 2.5) / (BATCH_STD + EPS) for x in SCORES]),
        (True, False, [x - 2.5 for x in SCORES]),
        (False, True, [x / (BATCH_STD + EPS) for x in SCORES]),
    ],
)
def test_batch_normalization(shift, scale, expected):
    scores = torch.tensor(SCORES, dtype=torch.float64)
    normalized = normalize_rewards(scores, "batch", reward_shift=shift, reward_scale=scale)
    assert normalized.dtype == torch.float64
    close(normalized, expected)


@pytest.mark.parametrize(
    "shift, scale, expected",
    [
        # group a: 1, 3 → mean 2, std √2; group b: 2, 6, 7 → mean 5, std √7; group c: 4 alone → mean 0, std 1
        (
            False,
            False,
            [
                -1 / (2**0.5 + EPS),
                -3 / (7**0.5 + EPS),
                1 / (2**0.5 + EPS),
                1 / (7**0.5 + EPS),
                4 / (1 + EPS),
                2 / (7**0.5 + EPS),
            ],
        ),
        (True, False, [-1.0, -3.0, 1.0, 1.0, 4.0, 2.0]),
        (
            False,
            True,
            [
                1 / (2**0.5 + EPS),
                2 / (7**0.5 + EPS),
                3 / (2**0.5 + EPS),
                6 / (7**0.5 + EPS),
                4 / (1 + EPS),
                7 / (7**0.5 + EPS),
            ],
        ),
    ],
)
def test_group_normalization(shift, scale, expected):
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 4.0, 7.0], dtype=torch.float64)
    group_ids = ["a", "b", "a", "b", "c", "b"]
    normalized = normalize_rewards(
        scores, "group", group_ids=group_ids, reward_shift=shift, reward_scale=scale
    )
    close(normalized, expected)


def test_group_of_equal_scores_normalizes_to_exact_zeros():
    scores = torch.tensor([0.1, 0.1, 0.1, 1 / 3, 1 / 3])
    normalized = normalize_rewards(scores, "group", group_ids=torch.tensor([0, 0, 0, 1, 1]))
    assert (normalized == 0).all()


def test_running_normalization_uses_the_stream_including_this_batch():
    moments = RunningMoments()
    first = normalize_rewards(torch.tensor([1.0, 3.0], dtype=torch.float64), "running", running=moments)
    close(first, [-1 / (2**0.5 + EPS), 1 / (2**0.5 + EPS)])
    # stream 1, 3, 5, 7: mean 4, std √(20/3)
    second = normalize_rewards(torch.tensor([5.0, 7.0], dtype=torch.float64), "running", running=moments)
    std = math.sqrt(20 / 3)
    close(second, [1 / (std + EPS), 3 / (std + EPS)])
    shifted = normalize_rewards(
        torch.tensor([4.0], dtype=torch.float64), "running", running=moments, reward_shift=True
    )
    close(shifted, [0.0])  # stream mean stays 4
    scaled = normalize_rewards(
        torch.tensor([4.0], dtype=torch.float64), "running", running=moments, reward_scale=True
    )
    close(scaled, [4 / (2 + EPS)])  # stream 1, 3, 5, 7, 4, 4: Σ(x − 4)² = 20 over 5 → std 2
    assert moments.count == 6


def test_normalize_rewards_dtypes():
    assert normalize_rewards(torch.tensor([1, 0, 1]), "batch").dtype == torch.float32
    low = normalize_rewards(torch.tensor(SCORES, dtype=torch.bfloat16), "batch")
    assert low.dtype == torch.bfloat16
    expected = normalize_rewards(torch.tensor(SCORES), "batch").to(torch.bfloat16)
    # exact: the same float32 operations on the same (bf16-representable) scores, then one cast
    torch.testing.assert_close(low, expected, atol=0, rtol=0)


def test_single_sample_batch_keeps_its_score():
    close(normalize_rewards(torch.tensor([3.0], dtype=torch.float64), "batch"), [3 / (1 + EPS)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reward_norm": "global"}, r"reward_norm='global'.*'batch', 'group', 'running'"),
        ({"reward_norm": "group"}, "group_ids=None"),
        ({"reward_norm": "running"}, "running=None"),
        ({"reward_norm": "batch", "reward_shift": True, "reward_scale": True}, "reward_shift=True"),
        ({"reward_shift": True}, "reward_norm=None"),
        ({"reward_norm": "batch", "reward_scale": "yes"}, "reward_scale='yes'"),
        ({"reward_norm": "group", "group_ids": [0, 0]}, "group_ids"),
    ],
)
def test_normalize_rewards_errors_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        normalize_rewards(torch.tensor(SCORES), **kwargs)


def test_normalize_rewards_needs_one_score_per_sample():
    with pytest.raises(ValueError, match="scores"):
        normalize_rewards(torch.ones(2, 2), "batch")


# --- clip_rewards --------------------------------------------------------------------------------------


def test_clip_rewards():
    scores = torch.tensor([-3.0, -0.5, 0.0, 2.5])
    assert clip_rewards(scores, None) is scores
    close(clip_rewards(scores, 1.0), [-1.0, -0.5, 0.0, 1.0])
    clipped = clip_rewards(torch.tensor([2, -1, 0]), 0.5)
    assert clipped.dtype == torch.float32
    close(clipped, [0.5, -0.5, 0.0])


@pytest.mark.parametrize("reward_clip", [0.0, -1.0, math.nan, math.inf])
def test_clip_rewards_rejects_bad_bounds(reward_clip):
    with pytest.raises(ValueError, match="reward_clip"):
        clip_rewards(torch.zeros(3), reward_clip)


# --- token_level_rewards -------------------------------------------------------------------------------

LENGTHS = [2, 0, 3, 1]


def mask_of(lengths, length=3):
    return torch.tensor([[1] * n + [0] * (length - n) for n in lengths])


def test_score_goes_on_the_last_valid_token():
    rewards = token_level_rewards(torch.tensor([1.0, 2.0, 3.0, -4.0], dtype=torch.float64), mask_of(LENGTHS))
    assert rewards.dtype == torch.float64
    close(rewards, [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0], [-4.0, 0.0, 0.0]])


def test_kl_penalty_on_every_valid_token():
    kl = torch.tensor([[0.5, 1.0, NAN], [NAN, NAN, NAN], [0.25, -0.5, 2.0], [1.0, NAN, 9.0]])
    rewards = token_level_rewards(torch.tensor([1.0, 2.0, 3.0, -4.0]), mask_of(LENGTHS), kl=kl, kl_coef=0.1)
    # float32: kl_coef × kl, then one subtraction, on values ≤ 4.1: 2 roundings of ≤ 0.5 ulp(4.1) = 2.4e-7
    close(rewards, [[-0.05, 0.9, 0.0], [0.0, 0.0, 0.0], [-0.025, 0.05, 2.8], [-4.1, 0.0, 0.0]], tol=1e-6)


def test_token_level_rewards_dtypes_and_mask_kinds():
    for mask in (mask_of(LENGTHS).bool(), mask_of(LENGTHS).float()):
        rewards = token_level_rewards(torch.tensor([1, 0, 1, 1]), mask)
        assert rewards.dtype == torch.float32
        close(rewards, [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert token_level_rewards(torch.ones(4, dtype=torch.bfloat16), mask_of(LENGTHS)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scores": torch.zeros(3)}, "scores"),
        ({"kl": torch.zeros(4, 2)}, r"kl\[4, 2\]"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"response_mask": torch.tensor([[1, 0, 1]] * 4)}, "response_mask row 0"),
    ],
)
def test_token_level_rewards_errors(kwargs, message):
    arguments = {"scores": torch.zeros(4), "response_mask": mask_of(LENGTHS)} | kwargs
    with pytest.raises(ValueError, match=message):
        token_level_rewards(**arguments)


# --- whiten_advantages / clip_advantages ---------------------------------------------------------------


def test_whiten_advantages_over_valid_tokens():
    rows = [[1.0, 2.0], [], [4.0, -1.0, 0.5], [3.0]]
    advantages = torch.tensor(
        [[1.0, 2.0, NAN], [NAN] * 3, [4.0, -1.0, 0.5], [3.0, math.inf, NAN]], dtype=torch.float64
    )
    flat = [a for row in rows for a in row]
    mean, var = statistics.mean(flat), statistics.variance(flat)
    expected = [[(a - mean) / math.sqrt(var + 1e-8) for a in row] + [0.0] * (3 - len(row)) for row in rows]
    whitened = whiten_advantages(advantages, mask_of([2, 0, 3, 1]))
    assert whitened.dtype == torch.float64
    close(whitened, expected)


def test_whiten_advantages_with_fewer_than_two_valid_tokens():
    close(whiten_advantages(torch.tensor([[5.0, NAN]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])
    close(whiten_advantages(torch.full((2, 2), NAN), torch.zeros(2, 2)), [[0.0, 0.0], [0.0, 0.0]])


def test_whiten_advantages_bfloat16():
    advantages = torch.tensor([[1.0, 2.0], [4.0, -1.0]])
    whitened = whiten_advantages(advantages.to(torch.bfloat16), torch.ones(2, 2))
    assert whitened.dtype == torch.bfloat16
    expected = whiten_advantages(advantages.to(torch.bfloat16).float(), torch.ones(2, 2)).to(torch.bfloat16)
    # exact: the same float32 operations on the same inputs, then one cast
    torch.testing.assert_close(whitened, expected, atol=0, rtol=0)


def test_clip_advantages_and_fraction_of_valid_tokens():
    advantages = torch.tensor([[3.0, -0.5, NAN, 99.0], [-2.5, 1.0, 2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    clipped, fraction = clip_advantages(advantages, mask, 2.0)
    close(clipped, [[2.0, -0.5, 0.0, 0.0], [-2.0, 1.0, 2.0, 0.0]])
    assert fraction == 2 / 5  # 3.0 and −2.5; 2.0 sits on the bound, padding does not count
    assert clip_advantages(advantages, torch.zeros(2, 4), 1.0)[1] == 0.0


def test_clip_advantages_off_and_bad_bounds():
    advantages = torch.tensor([[3.0, -7.0]])
    assert clip_advantages(advantages, torch.ones(1, 2), None) == (advantages, 0.0)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="advantage_clip"):
            clip_advantages(advantages, torch.ones(1, 2), bad)
    with pytest.raises(ValueError, match="response_mask"):
        clip_advantages(advantages, torch.ones(1, 3), 1.0)
