import time

import pytest

from lit_offpolicy.rewards import REWARDS, BoxedMath, ExactAnswer, IsolatedReward, RewardConfig, RewardOutput
from lit_offpolicy.rewards.verifiers import last_boxed


def test_exact_answer_strips_and_cuts_at_eos_and_newline():
    responses = ["46", " 46 ", "46<eos>junk", "46\n47", "4 6", "046", "-7", "47", "", "<eos>46", None]
    answers = ["46", "46", "46", "46", "46", "46", "-7", "46", "46", "46", "46"]
    out = ExactAnswer()(responses, answers)
    assert out == RewardOutput([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], num_malformed=3)


def test_exact_answer_with_another_eos_token():
    assert ExactAnswer(eos_token="</s>")(["12</s>3"], ["12"]).scores == [1.0]


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{}", ""),
        ("\\boxed{3} and \\boxed{4", None),
        ("no box at all", None),
        ("\\boxed 5", None),
    ],
)
def test_last_boxed_balances_braces(text, boxed):
    assert last_boxed(text) == boxed


def test_boxed_math_normalises_and_compares_numbers():
    responses = [
        "the answer is \\boxed{ 1 2 }",  # spaces dropped
        "\\boxed{-3}",
        "\\boxed{-3.0}",  # numbers compare numerically
        "\\boxed{0.5}",
        "\\boxed{2/4}",
        "\\boxed{x + 1}",  # non-numbers compare as strings
        "\\boxed{\\frac{1}{2}}",
        "\\boxed{7}",
        "\\boxed{1e3}",  # exponents are not parsed as numbers
    ]
    answers = ["12", "-3", "-3", "1/2", "0.5", "x+1", "\\frac{1}{2}", "8", "1000"]
    out = BoxedMath()(responses, answers)
    assert out.scores == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert out.num_malformed == 0


def test_boxed_math_counts_garbage_as_malformed_without_raising():
    responses = [
        "",
        "42",
        "\\boxed{42",
        "}}}{{{\\boxed",
        "\x00\xff\\boxed{{{",
        None,
        "\\boxed{1/0}",
        "\\boxed{42}",
    ]
    out = BoxedMath()(responses, ["42"] * len(responses))
    assert out.scores == [0.0] * 7 + [1.0]
    assert out.num_malformed == 6


def test_huge_numbers_do_not_hang():
    start = time.perf_counter()
    out = BoxedMath()(["\\boxed{1e999999999}", "\\boxed{" + "9" * 10_000 + "}"], ["1", "1"])
    assert out.scores == [0.0, 0.0] and time.perf_counter() - start < 1.0


def test_lengths_must_match():
    with pytest.raises(ValueError, match="got 2 responses but 1 answers"):
        ExactAnswer()(["1", "2"], ["1"])


def test_registry():
    assert set(REWARDS) == {"exact", "boxed"}
    assert isinstance(REWARDS.resolve("exact"), ExactAnswer)
    assert REWARDS.resolve("exact", eos_token="</s>").eos_token == "</s>"
    assert isinstance(REWARDS.resolve("boxed"), BoxedMath)
    with pytest.raises(ValueError, match="reward='math'.*'exact', 'boxed'"):
        REWARDS.resolve("math")


def length_reward(responses: list[str], answers: list[str]) -> RewardOutput:
    """A plain function as a reward: the response's length."""
    return RewardOutput([float(len(r)) for r in responses], num_malformed=0)


def test_a_function_or_class_plugs_in_by_import_path():
    assert REWARDS.resolve(f"{__name__}:length_reward") is length_reward
    assert isinstance(REWARDS.resolve("lit_offpolicy.rewards:BoxedMath"), BoxedMath)
    with pytest.raises(ValueError, match="reward.fn='nowhere:reward' cannot be imported"):
        RewardConfig(fn="nowhere:reward").build()
    with pytest.raises(ValueError, match="reward='lit_offpolicy.rewards:RewardOutput' gives a RewardOutput"):
        REWARDS.resolve("lit_offpolicy.rewards:RewardOutput", scores=[], num_malformed=0)


def test_reward_config_builds_isolated_or_in_process():
    isolated = RewardConfig(fn="boxed", timeout=5.0, workers=2).build()
    assert isinstance(isolated, IsolatedReward) and isinstance(isolated.reward_fn, BoxedMath)
    assert (isolated.timeout, isolated.num_workers) == (5.0, 2)
    assert RewardConfig(fn=f"{__name__}:length_reward", timeout=None).build() is length_reward
    with pytest.raises(ValueError, match="reward.workers=0 is out of range"):
        RewardConfig(workers=0)
