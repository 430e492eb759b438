"""Advantage estimators against hand-computed values and independent per-row python loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lit_offpolicy.advantages import GAE, GRPO, RLOO, Advantage, Reinforce, ReinforcePlusPlus

NAN = math.nan
EPS = 1e-6


def padded(rows, length, fill=NAN, dtype=torch.float64):
    """(len(rows), length) tensor: each row's values, then ``fill``."""
    return torch.tensor([list(row) + [fill] * (length - len(row)) for row in rows], dtype=dtype)


def mask_of(lengths, length, dtype=torch.int64):
    return torch.tensor([[1] * n + [0] * (length - n) for n in lengths], dtype=dtype)


def random_rows(lengths, seed):
    rng = random.Random(seed)
    return [[rng.uniform(-2.0, 2.0) for _ in range(n)] for n in lengths]


def ref_gae(rewards, values, gamma, lambd):
    """GAE over one row's valid tokens, written out with python floats."""
    advantages = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lambd * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


def ref_return_to_go(rewards, gamma):
    return [sum(gamma ** (k - t) * rewards[k] for k in range(t, len(rewards))) for t in range(len(rewards))]


def assert_rows(actual, expected_rows, length, tol=1e-12):
    """``actual`` holds ``expected_rows`` then exact zeros.

    ``tol``: float64 against python floats, the same ≤ 5-term sums, products and one square root in
    another order: a few eps64 (2.2e-16) × values ≤ ~10 is ~1e-14; 1e-12 leaves 100× to spare."""
    expected = padded(expected_rows, length, fill=0.0)
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=0)


LENGTHS = [3, 0, 1, 5, 2]
T = 5


# --- GAE -----------------------------------------------------------------------------------------------


def test_gae_hand_computed():
    rewards = padded([[0.0, 0.0, 1.0]], 3)
    values = padded([[0.5, 0.2, 0.1]], 3)
    advantages, returns = GAE(gamma=0.9, lambd=0.8)(rewards, mask_of([3], 3), values)
    # t=2: δ = 1 − 0.1 = 0.9; t=1: δ = 0.9·0.1 − 0.2 = −0.11, A = −0.11 + 0.72·0.9 = 0.538;
    # t=0: δ = 0.9·0.2 − 0.5 = −0.32, A = −0.32 + 0.72·0.538 = 0.06736
    assert_rows(advantages, [[0.06736, 0.538, 0.9]], 3)
    assert_rows(returns, [[0.56736, 0.738, 1.0]], 3)


def test_gae_lambda_one_is_monte_carlo_minus_value_and_lambda_zero_is_td():
    rewards = padded([[1.0, 2.0, 3.0, NAN]], 4)
    values = padded([[0.5, 1.0, 1.5, NAN]], 4)
    mask = mask_of([3], 4)
    advantages, returns = GAE(gamma=1.0, lambd=1.0)(rewards, mask, values)
    assert_rows(advantages, [[6.0 - 0.5, 5.0 - 1.0, 3.0 - 1.5]], 4)
    assert_rows(returns, [[6.0, 5.0, 3.0]], 4)
    advantages, _ = GAE(gamma=0.5, lambd=0.0)(rewards, mask, values)
    assert_rows(advantages, [[1.0 + 0.5 * 1.0 - 0.5, 2.0 + 0.5 * 1.5 - 1.0, 3.0 - 1.5]], 4)


def test_gae_matches_python_loop_in_float64():
    rewards, values = random_rows(LENGTHS, 1), random_rows(LENGTHS, 2)
    advantages, returns = GAE(gamma=0.97, lambd=0.9)(
        padded(rewards, T), mask_of(LENGTHS, T), padded(values, T)
    )
    assert advantages.dtype == returns.dtype == torch.float64
    expected = [ref_gae(r, v, 0.97, 0.9) for r, v in zip(rewards, values, strict=True)]
    assert_rows(advantages, [a for a, _ in expected], T)
    assert_rows(returns, [g for _, g in expected], T)


def test_gae_single_token_response():
    advantages, returns = GAE()(padded([[2.0]], 3), mask_of([1], 3), padded([[0.75]], 3))
    assert_rows(advantages, [[1.25]], 3)
    assert_rows(returns, [[2.0]], 3)


# --- REINFORCE / REINFORCE++ ---------------------------------------------------------------------------


def test_reinforce_hand_computed():
    advantages, returns = Reinforce(gamma=0.5)(padded([[0.0, 0.0, 1.0], [2.0]], 3), mask_of([3, 1], 3))
    assert_rows(advantages, [[0.25, 0.5, 1.0], [2.0]], 3)
    assert_rows(returns, [[0.25, 0.5, 1.0], [2.0]], 3)


def test_reinforce_matches_python_loop_in_float64():
    rewards = random_rows(LENGTHS, 3)
    advantages, returns = Reinforce(gamma=0.9)(padded(rewards, T), mask_of(LENGTHS, T))
    assert advantages.dtype == torch.float64
    assert_rows(advantages, [ref_return_to_go(r, 0.9) for r in rewards], T)
    assert_rows(returns, [ref_return_to_go(r, 0.9) for r in rewards], T)


def test_reinforce_plus_plus_whitens_returns_over_valid_tokens():
    rewards = random_rows(LENGTHS, 4)
    advantages, returns = ReinforcePlusPlus(gamma=0.95)(padded(rewards, T), mask_of(LENGTHS, T))
    returns_to_go = [ref_return_to_go(r, 0.95) for r in rewards]
    flat = [g for row in returns_to_go for g in row]
    mean = sum(flat) / len(flat)
    var = sum((g - mean) ** 2 for g in flat) / (len(flat) - 1)
    assert_rows(advantages, [[(g - mean) / math.sqrt(var + 1e-8) for g in row] for row in returns_to_go], T)
    assert_rows(returns, returns_to_go, T)


def test_reinforce_plus_plus_hand_computed():
    # returns-to-go (γ=1): [3, 2] and [4] → mean 3, unbiased var 1 → A = (G − 3) / √(1 + 1e-8)
    advantages, returns = ReinforcePlusPlus()(padded([[1.0, 2.0], [4.0]], 2), mask_of([2, 1], 2))
    scale = 1 / math.sqrt(1 + 1e-8)
    assert_rows(advantages, [[0.0, -scale], [scale]], 2)
    assert_rows(returns, [[3.0, 2.0], [4.0]], 2)


# --- GRPO / RLOO ---------------------------------------------------------------------------------------


def outcome_rewards(scores, lengths, length):
    """Each score on the last valid token of its row (nothing for an empty row), NaN padding."""
    rows = [[0.0] * (n - 1) + [s] if n else [] for s, n in zip(scores, lengths, strict=True)]
    return padded(rows, length)


def test_grpo_hand_computed():
    # group "p": scores 3, 1, 2 → mean 2, std 1; group "q": 0, 4 → mean 2, std √8
    lengths = [2, 1, 3, 2, 3]
    rewards = outcome_rewards([3.0, 0.0, 1.0, 2.0, 4.0], lengths, 3)
    group_ids = ["p", "q", "p", "p", "q"]
    advantages, returns = GRPO()(rewards, mask_of(lengths, 3), group_ids=group_ids)
    per_sample = [1 / (1 + EPS), -2 / (math.sqrt(8) + EPS), -1 / (1 + EPS), 0.0, 2 / (math.sqrt(8) + EPS)]
    expected = [[a] * n for a, n in zip(per_sample, lengths, strict=True)]
    assert_rows(advantages, expected, 3)
    assert_rows(returns, expected, 3)
    advantages, _ = GRPO(norm_by_std=False)(rewards, mask_of(lengths, 3), group_ids=group_ids)
    assert_rows(advantages, [[a] * n for a, n in zip([1.0, -2.0, -1.0, 0.0, 2.0], lengths, strict=True)], 3)


def test_grpo_sums_to_zero_per_group_and_scores_sum_all_valid_tokens():
    lengths = [4, 3, 1, 4, 2, 2]
    rewards = random_rows(lengths, 5)
    group_ids = torch.tensor([7, 7, 7, 9, 9, 9])
    advantages, _ = GRPO()(padded(rewards, 4), mask_of(lengths, 4), group_ids=group_ids)
    per_sample = advantages[:, 0]
    for group in (7, 9):
        # float64: a 3-term sum of advantages ≤ ~2 that cancels: ≲ 3 eps64 × 2 ≈ 1e-15
        assert abs(per_sample[group_ids == group].sum().item()) < 1e-12
    scores = [sum(r) for r in rewards]
    for members in ([0, 1, 2], [3, 4, 5]):
        group = [scores[i] for i in members]
        mean = sum(group) / 3
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / 2)
        for i in members:
            # float64, mean, std and quotient in another order: ≲ 10 eps64 × |A| ≤ 2 ≈ 4e-15
            assert abs(per_sample[i].item() - (scores[i] - mean) / (std + EPS)) < 1e-12


def test_grpo_group_of_one_keeps_its_score():
    rewards = outcome_rewards([0.5, 1.0, 0.0], [2, 2, 2], 2)
    advantages, _ = GRPO()(rewards, mask_of([2, 2, 2], 2), group_ids=["solo", "pair", "pair"])
    assert_rows(
        advantages,
        [[0.5 / (1 + EPS)] * 2, [0.5 / (1 / math.sqrt(2) + EPS)] * 2, [-0.5 / (1 / math.sqrt(2) + EPS)] * 2],
        2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("score", [0.1, 1 / 3, 7.0, -2.3])
@pytest.mark.parametrize("estimator", [GRPO(), GRPO(norm_by_std=False), RLOO()])
def test_group_of_equal_rewards_gives_exact_zeros(estimator, score, dtype):
    lengths = [3, 2, 1, 3]
    rewards = outcome_rewards([score] * 4, lengths, 3).to(dtype)
    advantages, returns = estimator(rewards, mask_of(lengths, 3), group_ids=[0, 0, 0, 0])
    assert torch.isfinite(advantages).all()
    assert (advantages == 0).all() and (returns == 0).all()


def test_empty_responses_stay_out_of_groups_and_get_zero():
    lengths = [2, 0, 2, 0]
    rewards = outcome_rewards([1.0, 5.0, 0.0, 5.0], lengths, 2)
    mask = mask_of(lengths, 2)
    advantages, _ = GRPO()(rewards, mask, group_ids=[0, 0, 0, 1])
    std = math.sqrt(0.5)
    assert_rows(advantages, [[0.5 / (std + EPS)] * 2, [], [-0.5 / (std + EPS)] * 2, []], 2)
    advantages, _ = RLOO()(rewards, mask, group_ids=[0, 0, 0, 1])
    assert_rows(advantages, [[1.0, 1.0], [], [-1.0, -1.0], []], 2)


def test_rloo_hand_computed_and_group_of_one_is_zero():
    # group a: 3, 1, 2 → A_i = s_i − mean of the others = 1.5, −1.5, 0; group b alone → 0
    lengths = [1, 2, 3, 2]
    rewards = outcome_rewards([3.0, 1.0, 2.0, 9.0], lengths, 3)
    advantages, returns = RLOO()(rewards, mask_of(lengths, 3), group_ids=("a", "a", "a", "b"))
    expected = [[1.5], [-1.5] * 2, [0.0] * 3, [0.0] * 2]
    assert_rows(advantages, expected, 3)
    assert_rows(returns, expected, 3)


def test_rloo_matches_leave_one_out_loop():
    lengths = [3, 1, 2, 3, 3]
    rewards = random_rows(lengths, 6)
    group_ids = [0, 1, 0, 1, 0]
    advantages, _ = RLOO()(padded(rewards, 3), mask_of(lengths, 3), group_ids=group_ids)
    scores = [sum(r) for r in rewards]
    for i, group in enumerate(group_ids):
        others = [s for j, s in enumerate(scores) if group_ids[j] == group and j != i]
        # float64, the leave-one-out mean in another order: ≲ 5 eps64 × |scores| ≤ 10 ≈ 1e-14
        assert abs(advantages[i, 0].item() - (scores[i] - sum(others) / len(others))) < 1e-12


def test_group_ids_kinds_and_order_do_not_matter():
    lengths = [2, 3, 1, 2, 3, 1]
    rewards, mask = padded(random_rows(lengths, 7), 3), mask_of(lengths, 3)
    reference, _ = GRPO()(rewards, mask, group_ids=[0, 1, 0, 1, 0, 1])
    for group_ids in (torch.tensor([5, -2, 5, -2, 5, -2]), ("x", "y", "x", "y", "x", "y"), [(1, "a"), 2] * 3):
        # exact: the same float64 operations in the same order, whatever the ids' type
        torch.testing.assert_close(GRPO()(rewards, mask, group_ids=group_ids)[0], reference, atol=0, rtol=0)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled, _ = GRPO()(rewards[order], mask[order], group_ids=[[0, 1, 0, 1, 0, 1][i] for i in order])
    # float64, each group's 3-term mean and std summed in another order: ≲ 10 eps64 × |A| ≤ 2 ≈ 4e-15
    torch.testing.assert_close(shuffled, reference[order], atol=1e-12, rtol=0)


# --- shared behaviour ----------------------------------------------------------------------------------

ESTIMATORS = [GAE(gamma=0.9, lambd=0.7), Reinforce(gamma=0.9), GRPO(), RLOO(), ReinforcePlusPlus(gamma=0.9)]
GROUP_IDS = [0, 0, 1, 1, 1]


def run(estimator, rewards, mask, values):
    return estimator(rewards, mask, values=values, group_ids=GROUP_IDS)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("garbage", [NAN, math.inf, 1e30, -7.0])
def test_padding_content_does_not_change_results(estimator, garbage):
    rewards, values = random_rows(LENGTHS, 8), random_rows(LENGTHS, 9)
    mask = mask_of(LENGTHS, T)
    clean = run(estimator, padded(rewards, T, 0.0), mask, padded(values, T, 0.0))
    dirty = run(estimator, padded(rewards, T, garbage), mask, padded(values, T, garbage))
    for a, b in zip(clean, dirty, strict=True):  # exact: padding is masked out before any arithmetic
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert (b[mask == 0] == 0).all()


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.float32])
def test_mask_dtypes_give_the_same_results(estimator, mask_dtype):
    rewards, values = padded(random_rows(LENGTHS, 10), T), padded(random_rows(LENGTHS, 11), T)
    reference = run(estimator, rewards, mask_of(LENGTHS, T), values)
    other = run(estimator, rewards, mask_of(LENGTHS, T, dtype=mask_dtype), values)
    for a, b in zip(reference, other, strict=True):  # exact: the mask only selects, in any dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_bfloat16_is_computed_in_float32_and_cast_back(estimator):
    rewards = padded(random_rows(LENGTHS, 12), T).to(torch.bfloat16)
    values = padded(random_rows(LENGTHS, 13), T).to(torch.bfloat16)
    mask = mask_of(LENGTHS, T)
    low = run(estimator, rewards, mask, values)
    high = run(estimator, rewards.float(), mask, values.float())
    for a, b in zip(low, high, strict=True):
        assert a.dtype == torch.bfloat16
        # exact: the same float32 operations on the same (bf16-representable) inputs, then one cast
        torch.testing.assert_close(a, b.to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_outputs_never_require_grad(estimator):
    rewards = padded(random_rows(LENGTHS, 14), T, 0.0).float().requires_grad_()
    values = padded(random_rows(LENGTHS, 15), T, 0.0).float().requires_grad_()
    for out in run(estimator, rewards, mask_of(LENGTHS, T), values):
        assert not out.requires_grad
        assert out.shape == rewards.shape and out.dtype == torch.float32


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_all_empty_batch_gives_zeros(estimator):
    rewards = torch.full((5, 3), NAN)
    for out in run(estimator, rewards, torch.zeros(5, 3), rewards.clone()):
        assert (out == 0).all()


def test_needs_flags():
    assert GAE.needs_values and not GAE.needs_groups
    assert GRPO.needs_groups and RLOO.needs_groups and not GRPO.needs_values
    for cls in (Reinforce, ReinforcePlusPlus):
        assert not cls.needs_values and not cls.needs_groups
    assert all(isinstance(e, Advantage) for e in ESTIMATORS)


# --- errors --------------------------------------------------------------------------------------------


def test_gae_without_values_raises():
    with pytest.raises(ValueError, match="GAE needs critic values"):
        GAE()(torch.zeros(2, 3), torch.ones(2, 3))


@pytest.mark.parametrize("estimator", [GRPO(), RLOO()], ids=lambda e: type(e).__name__)
def test_group_estimators_without_group_ids_raise(estimator):
    with pytest.raises(ValueError, match="group_ids=None"):
        estimator(torch.zeros(2, 3), torch.ones(2, 3))


@pytest.mark.parametrize("group_ids", [[0, 1, 2], torch.tensor([0, 1, 2]), torch.zeros(2, 1)])
def test_group_ids_of_wrong_length_raise(group_ids):
    with pytest.raises(ValueError, match="group_ids"):
        GRPO()(torch.zeros(2, 3), torch.ones(2, 3), group_ids=group_ids)


def test_shape_mismatch_names_the_tensors():
    with pytest.raises(ValueError, match=r"token_level_rewards\[2, 3\].*response_mask\[2, 4\]"):
        Reinforce()(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"values\[2, 2\]"):
        GAE()(torch.zeros(2, 3), torch.ones(2, 3), values=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="token_level_rewards"):
        Reinforce()(torch.zeros(3), torch.ones(3))


def test_mask_that_is_not_right_padded_raises():
    with pytest.raises(ValueError, match="response_mask row 1"):
        Reinforce()(torch.zeros(2, 3), torch.tensor([[1, 1, 0], [0, 1, 1]]))


@pytest.mark.parametrize(
    "make, option",
    [
        (lambda: GAE(gamma=1.5), "gamma"),
        (lambda: GAE(lambd=-0.1), "lambd"),
        (lambda: GAE(gamma=math.nan), "gamma"),
        (lambda: Reinforce(gamma=-1.0), "gamma"),
        (lambda: ReinforcePlusPlus(gamma=2.0), "gamma"),
        (lambda: GRPO(norm_by_std="yes"), "norm_by_std"),
    ],
)
def test_bad_settings_name_the_option(make, option):
    with pytest.raises(ValueError, match=option):
        make()
