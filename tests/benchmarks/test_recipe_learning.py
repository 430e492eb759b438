"""benchmarks/learning/recipe_learning.py's verdict: a recipe learns iff its reward and its val/accuracy
rise."""

import pytest

from benchmarks.learning.recipe_learning import Result, passes, start_end


def test_start_and_end_are_the_means_of_the_first_and_last_five_steps():
    curve = [(step, float(step)) for step in range(12)]  # out of order on purpose below
    assert start_end(list(reversed(curve))) == (2.0, 9.0)


def test_a_curve_too_short_for_a_start_and_an_end_is_named():
    with pytest.raises(RuntimeError, match="9 reward/mean points"):
        start_end([(step, 0.0) for step in range(9)])


@pytest.mark.parametrize(
    ("result", "learned"),
    [
        (Result(0.80, 0.90, 0.44, 0.59), True),
        (Result(0.80, 0.90, 0.44, 0.44), False),  # the reward rose, greedy accuracy did not
        (Result(0.80, 0.79, 0.44, 0.59), False),  # accuracy rose, the reward did not
        (None, False),  # the run failed
    ],
)
def test_a_run_passes_only_where_reward_and_val_accuracy_both_rise(result, learned):
    assert passes(result) is learned
