"""DAPO's group filter, dynamic sampling and GRESO's pre-rollout filter (``lit_offpolicy.rollout.filtering``)
on hand values; the runs that filter are in tests/integration/test_filtering_fit.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from lit_offpolicy import callbacks
from lit_offpolicy.rollout import SamplingParams
from lit_offpolicy.rollout.filtering import (
    ROUND_GROWTH_LIMIT,
    PromptHistory,
    draw_problems,
    first_groups,
    group_count,
    informative_samples,
    next_round_size,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_informative_samples_hand_values(dtype):
    scores = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.25, 0.5, 0.5], dtype=dtype)
    group_ids = torch.arange(4).repeat_interleave(4)
    expected = torch.tensor([True] * 4 + [False] * 8 + [True] * 4)
    assert torch.equal(informative_samples(scores, group_ids), expected)


def test_informative_samples_reads_groups_in_any_order_and_never_keeps_a_single_sample():
    # groups 7: (1, 0) mixed, 3: (2, 2) uniform, 5: (0.5) alone, interleaved
    scores = torch.tensor([1.0, 2.0, 0.5, 0.0, 2.0])
    group_ids = torch.tensor([7, 3, 5, 7, 3])
    assert informative_samples(scores, group_ids).tolist() == [True, False, False, True, False]


def test_informative_samples_tells_apart_scores_one_ulp_apart_and_handles_no_samples():
    one = torch.tensor(1.0, dtype=torch.float64)
    scores = torch.stack([one, torch.nextafter(one, torch.tensor(2.0, dtype=torch.float64))])
    assert informative_samples(scores, torch.tensor([0, 0])).tolist() == [True, True]
    assert informative_samples(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_informative_samples_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one value per sample"):
        informative_samples(torch.zeros(4), torch.zeros(3, dtype=torch.long))


def test_first_groups_keeps_whole_groups_in_order_of_first_appearance():
    group_ids = torch.tensor([7, 7, 3, 3, 9, 9, 7])  # 7 first, then 3, then 9; a late sample of 7
    assert group_count(group_ids) == 3
    assert first_groups(group_ids, 1).tolist() == [0, 1, 6]
    assert first_groups(group_ids, 2).tolist() == [0, 1, 2, 3, 6]
    assert first_groups(group_ids, 3).tolist() == list(range(7))
    assert first_groups(group_ids, 0).tolist() == []
    assert first_groups(torch.tensor([], dtype=torch.long), 2).tolist() == []


def test_filter_groups_needs_more_than_one_sample_per_prompt():
    with pytest.raises(
        ValueError, match=r"filter_groups=True needs groups: sampling.n=1; allowed values: n >= 2"
    ):
        callbacks.Rollout(sampling=SamplingParams(n=1), filter_groups=True)


# ----------------------------------------------------------------- re-sampling (DAPO's dynamic sampling)


def test_next_round_size_fills_the_shortfall_at_the_rate_seen_with_a_fifth_to_spare():
    # 5 informative groups of 20 prompts (rate 1/4); 10 short of 15: 10 × 4 × 1.2 = 48 prompts
    assert next_round_size(target=15, informative=5, sampled=20) == 48
    assert next_round_size(target=15, informative=14, sampled=20) == 2  # ceil(1 × 4/3 × 1.2)
    assert next_round_size(target=8, informative=1, sampled=8) == 8 * ROUND_GROWTH_LIMIT  # 84, capped
    assert next_round_size(target=8, informative=0, sampled=8) == 8 * ROUND_GROWTH_LIMIT
    assert next_round_size(target=8, informative=8, sampled=8) == 0
    assert next_round_size(target=8, informative=11, sampled=30) == 0


def test_draw_problems_is_seeded_draws_with_replacement_and_refuses_an_empty_pool():
    pool = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(5)]
    first = draw_problems(pool, 12, seed="resample/0/3/0/1")
    assert len(first) == 12 and all(problem in pool for problem in first)
    assert first == draw_problems(pool, 12, seed="resample/0/3/0/1")
    assert first != draw_problems(pool, 12, seed="resample/0/3/0/2")
    with pytest.raises(ValueError, match="no training problems"):
        draw_problems([], 3, seed="x")


def test_max_sampling_rounds_needs_filter_groups_and_at_least_one_round():
    with pytest.raises(ValueError, match=r"max_sampling_rounds=3 re-samples .* set filter_groups=True"):
        callbacks.Rollout(sampling=SamplingParams(n=4), max_sampling_rounds=3)
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        callbacks.Rollout(sampling=SamplingParams(n=4), filter_groups=True, max_sampling_rounds=0)


# ----------------------------------------------------------------- GRESO's pre-rollout filter


def test_prompt_history_keeps_a_prompt_with_probability_explore_to_the_power_of_its_streak():
    history = PromptHistory(explore=0.5)
    assert history.keep_probability("1+1=") == 1.0  # never seen
    history.record(["1+1=", "2+2="], [False, True])
    history.record(["1+1=", "2+2="], [False, False])
    assert history.streaks == {"1+1=": 2, "2+2=": 1}
    assert history.keep_probability("1+1=") == 0.25
    assert history.keep_probability("2+2=") == 0.5
    history.record(["1+1="], [True])  # an informative group ends the streak
    assert history.keep_probability("1+1=") == 1.0
    with pytest.raises(ValueError):
        history.record(["1+1="], [True, False])


def test_prompt_history_select_draws_once_per_problem_and_counts_the_skipped():
    history = PromptHistory(explore=0.5)
    history.record(["a", "b"], [False, False])  # a: 0.5, b: 0.5, c: 1
    history.record(["b"], [False])  # b: 0.25
    problems = [{"prompt": p} for p in ("a", "b", "c", "a", "b", "c")]
    draws = random.Random(7)
    expected = [p for p in problems if draws.random() < {"a": 0.5, "b": 0.25, "c": 1.0}[p["prompt"]]]
    assert history.select(problems, random.Random(7)) == expected
    assert history.skipped == len(problems) - len(expected) > 0
    assert sum(p["prompt"] == "c" for p in expected) == 2  # probability 1: always kept


def test_prompt_history_draw_fills_the_count_and_falls_back_to_unfiltered_draws():
    pool = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(6)]
    history = PromptHistory(explore=0.01)
    history.record([p["prompt"] for p in pool[:5]], [False] * 5)  # only 5+0= keeps probability 1
    history.record([p["prompt"] for p in pool[:5]], [False] * 5)  # the others 1e-4
    drawn = history.draw(pool, 8, random.Random(0))
    assert len(drawn) == 8 and all(p["prompt"] == "5+0=" for p in drawn)
    assert history.skipped > 0
    history.record(["5+0="], [False])
    history.record(["5+0="], [False])  # every problem at 1e-4: the 100 × 8 candidates run out
    drawn = history.draw(pool, 8, random.Random(0))
    assert len(drawn) == 8 and all(p in pool for p in drawn)
    with pytest.raises(ValueError, match="no training problems"):
        history.draw([], 1, random.Random(0))


def test_prompt_history_state_round_trips_and_explore_of_one_never_skips():
    history = PromptHistory(explore=1.0)
    history.record(["a", "b"], [False, True])
    assert history.select([{"prompt": "a"}] * 20, random.Random(1)) == [{"prompt": "a"}] * 20
    restored = PromptHistory(explore=1.0)
    restored.load_state_dict(history.state_dict())
    assert restored.streaks == {"a": 1, "b": 0}


def test_pre_rollout_filter_needs_filter_groups_and_a_probability_in_0_1():
    with pytest.raises(ValueError, match=r"pre_rollout_filter=0.5 skips .* set filter_groups=True"):
        callbacks.Rollout(sampling=SamplingParams(n=4), pre_rollout_filter=0.5)
    for explore in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"pre_rollout_filter=.* allowed values: \(0.0, 1.0\]"):
            callbacks.Rollout(sampling=SamplingParams(n=4), filter_groups=True, pre_rollout_filter=explore)


def test_drawing_prompts_needs_a_data_module_with_training_problems():
    """The check reads only ``trainer.datamodule``; a namespace stands in for a trainer whose data
    module has no ``train_problems`` (any LightningDataModule but ours)."""
    trainer = SimpleNamespace(datamodule=SimpleNamespace())
    rollout = callbacks.Rollout(
        sampling=SamplingParams(n=4), filter_groups=True, max_sampling_rounds=2, pre_rollout_filter=0.5
    )
    with pytest.raises(
        ValueError, match=r"max_sampling_rounds=2 and pre_rollout_filter=0.5 draw prompts from the data"
    ):
        rollout.worker.start(trainer, host=None)
