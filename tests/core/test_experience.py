"""Experience.from_generations: packing prompts (left-padded) and responses (right-padded) by hand."""

from __future__ import annotations

import pytest
import torch

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.generation import Generation

PAD = 0


def _pack(**kwargs) -> Experience:
    prompts = [[5, 6, 7], [8]]
    generations = [
        [Generation([11, 12], [-0.5, -1.5], "length"), Generation([13], [-0.25], "stop")],
        [Generation([], [], "length"), Generation([14, 15, 16], [-1.0, -2.0, -3.0], "stop")],
    ]
    return Experience.from_generations(
        prompts, generations, [1.0, 0.0, 0.5, 0.25], PAD, policy_version=3, **kwargs
    )


def test_prompts_are_left_padded_and_responses_right_padded():
    exp = _pack()
    assert exp.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8], [0, 0, 8]]
    assert exp.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert exp.response_ids.tolist() == [[11, 12, 0], [13, 0, 0], [0, 0, 0], [14, 15, 16]]
    assert exp.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]]
    assert exp.rollout_log_probs.dtype == torch.float32
    assert exp.rollout_log_probs.tolist() == [
        [-0.5, -1.5, 0.0],
        [-0.25, 0.0, 0.0],
        [0.0, 0.0, 0.0],
        [-1.0, -2.0, -3.0],
    ]
    assert exp.group_ids.tolist() == [0, 0, 1, 1]
    assert exp.scores.tolist() == [1.0, 0.0, 0.5, 0.25]
    assert exp.prompt_ids.dtype == exp.response_mask.dtype == torch.long


def test_response_width_pads_further_and_refuses_less_than_the_longest():
    exp = _pack(response_width=5)
    assert exp.response_ids.shape == exp.response_mask.shape == exp.rollout_log_probs.shape == (4, 5)
    assert exp.response_mask.sum(dim=1).tolist() == [2, 1, 0, 3]
    with pytest.raises(ValueError, match="response_width=2 is shorter than the longest response"):
        _pack(response_width=2)


def test_all_empty_responses_give_zero_width():
    generations = [[Generation([], [], "length")], [Generation([], [], "stop")]]
    exp = Experience.from_generations([[5], [6, 7]], generations, [0.0, 1.0], PAD, policy_version=0)
    assert exp.response_ids.shape == exp.rollout_log_probs.shape == (2, 0)
    assert exp.prompt_ids.tolist() == [[0, 5], [6, 7]]


def test_cat_repads_prompts_to_the_widest_part_and_keeps_sample_order():
    first = _pack()  # prompts of width 3, group ids 0, 1
    second = Experience.from_generations(
        [[9, 9, 9, 9]],
        [[Generation([21], [-0.125], "stop")]],
        [0.75],
        PAD,
        policy_version=4,
        group_offset=7,
        response_width=3,
    )
    both = Experience.cat([first, second], pad_token_id=PAD)
    assert both.prompt_ids.tolist() == [[0, 5, 6, 7], [0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 8], [9, 9, 9, 9]]
    assert both.prompt_mask.tolist() == [[0, 1, 1, 1]] * 2 + [[0, 0, 0, 1]] * 2 + [[1, 1, 1, 1]]
    assert both.response_ids.tolist() == first.response_ids.tolist() + [[21, 0, 0]]
    assert both.rollout_log_probs[-1].tolist() == [-0.125, 0.0, 0.0]
    assert both.scores.tolist() == [1.0, 0.0, 0.5, 0.25, 0.75]
    assert both.group_ids.tolist() == [0, 0, 1, 1, 7]
    assert both.policy_versions.tolist() == [3, 3, 3, 3, 4]
    assert both.old_log_probs is None and both.temperature == first.temperature
    assert torch.equal(Experience.cat([first], PAD).prompt_ids, first.prompt_ids)


def test_cat_refuses_no_parts_mixed_temperatures_and_fields_set_in_some_parts_only():
    with pytest.raises(ValueError, match="at least one part"):
        Experience.cat([], PAD)
    with pytest.raises(ValueError, match="different temperatures"):
        Experience.cat([_pack(temperature=1.0), _pack(temperature=0.7)], PAD)
    scored = _pack()
    scored.advantages = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="advantages is set in some parts only"):
        Experience.cat([scored, _pack()], PAD)
    with pytest.raises(ValueError, match=r"response_ids has per-sample shapes \[\(3,\), \(5,\)\]"):
        Experience.cat([_pack(), _pack(response_width=5)], PAD)
