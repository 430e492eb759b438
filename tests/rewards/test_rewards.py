import time

import pytest

from lit_offpolicy.rewards import (
    REWARDS,
    BoxedMath,
    ExactAnswer,
    IsolatedReward,
    RewardConfig,
    RewardContractError,
    RewardInputs,
    RewardOutput,
    WeightedRewards,
    function_metrics,
)
from lit_offpolicy.rewards.verifiers import last_boxed


def test_exact_answer_strips_and_cuts_at_eos_and_newline():
    responses = ["46", " 46 ", "46<eos>junk", "46\n47", "4 6", "046", "-7", "47", "", "<eos>46", None]
    answers = ["46", "46", "46", "46", "46", "46", "-7", "46", "46", "46", "46"]
    out = ExactAnswer()(completions=responses, answer=answers)
    assert out == RewardOutput([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], num_malformed=3)


def test_exact_answer_with_another_eos_token():
    assert ExactAnswer(eos_token="</s>")(completions=["12</s>3"], answer=["12"]).scores == [1.0]


def test_built_ins_read_completions_in_chat_form():
    chat = [[{"role": "assistant", "content": "46"}], [{"role": "assistant", "content": "\\boxed{7}"}], []]
    assert ExactAnswer()(completions=chat, answer=["46", "7", "1"]).scores == [1.0, 0.0, 0.0]
    assert BoxedMath()(completions=chat, answer=["46", "7", "1"]).scores == [0.0, 1.0, 0.0]


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
    out = BoxedMath()(completions=responses, answer=answers)
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
    out = BoxedMath()(completions=responses, answer=["42"] * len(responses))
    assert out.scores == [0.0] * 7 + [1.0]
    assert out.num_malformed == 6


def test_huge_numbers_do_not_hang():
    start = time.perf_counter()
    out = BoxedMath()(
        completions=["\\boxed{1e999999999}", "\\boxed{" + "9" * 10_000 + "}"], answer=["1", "1"]
    )
    assert out.scores == [0.0, 0.0] and time.perf_counter() - start < 1.0


def test_lengths_must_match():
    with pytest.raises(ValueError, match="got 2 completions but 1 answers"):
        ExactAnswer()(completions=["1", "2"], answer=["1"])


def test_registry():
    assert set(REWARDS) == {"exact", "boxed", "math_verify", "gsm8k", "format", "model", "code", "judge"}
    assert isinstance(REWARDS.resolve("exact"), ExactAnswer)
    assert REWARDS.resolve("exact", eos_token="</s>").eos_token == "</s>"
    assert isinstance(REWARDS.resolve("boxed"), BoxedMath)
    with pytest.raises(ValueError, match="reward='math'.*'exact', 'boxed'"):
        REWARDS.resolve("math")


def length_reward(completions: list[str], **columns) -> list[float]:
    """A plain function as a reward, written for TRL: the completion's length."""
    return [float(len(c)) for c in completions]


def test_a_function_or_class_plugs_in_by_import_path():
    assert REWARDS.resolve(f"{__name__}:length_reward") is length_reward
    assert isinstance(REWARDS.resolve("lit_offpolicy.rewards:BoxedMath"), BoxedMath)
    with pytest.raises(ValueError, match="reward.fn='nowhere:reward' cannot be imported"):
        RewardConfig(fn="nowhere:reward").build()
    with pytest.raises(ValueError, match="reward='lit_offpolicy.rewards:RewardOutput' gives a RewardOutput"):
        REWARDS.resolve("lit_offpolicy.rewards:RewardOutput", scores=[], num_malformed=0)


def test_reward_config_builds_isolated_or_in_process():
    isolated = RewardConfig(fn="boxed", timeout=5.0, workers=2).build()
    assert isinstance(isolated, IsolatedReward) and isinstance(isolated.rewards.functions["boxed"], BoxedMath)
    assert (isolated.timeout, isolated.num_workers) == (5.0, 2)
    in_process = RewardConfig(fn=f"{__name__}:length_reward", timeout=None).build()
    assert in_process.functions == {"length_reward": length_reward}
    with pytest.raises(ValueError, match="reward.workers=0 is out of range"):
        RewardConfig(workers=0)


# ----------------------------------------------------------------------------- the reward contract (TRL's)

PROBLEMS = [
    {
        "prompt": "<|user|>2+3=<|assistant|>",
        "raw_prompt": [{"role": "user", "content": "2+3="}],
        "answer": "5",
        "columns": {"answer": 5, "data_source": "toy", "extra_info": {"index": 7}, "prompts": "shadowed"},
    },
    {"prompt": "4+4=", "answer": "8"},  # a built-in task's problem: no columns, no raw prompt
]


def test_inputs_repeat_each_row_for_its_samples_and_carry_every_column():
    inputs = RewardInputs.of(PROBLEMS, ["5", "6", "8", "x"], [[1], [2], [3], [4, 5]], n=2)
    kwargs = inputs.kwargs()
    assert set(kwargs) == {"prompts", "completions", "completion_ids", "answer", "data_source", "extra_info"}
    chat = [{"role": "user", "content": "2+3="}]
    assert kwargs["prompts"] == [chat, chat, "4+4=", "4+4="]
    assert kwargs["completions"] == [
        [{"role": "assistant", "content": "5"}],
        [{"role": "assistant", "content": "6"}],
        "8",
        "x",
    ]
    assert kwargs["completion_ids"] == [[1], [2], [3], [4, 5]]
    assert kwargs["answer"] == ["5", "5", "8", "8"]  # the row's answer as answer_key selected it, a string
    assert kwargs["data_source"] == ["toy", "toy", None, None]
    assert kwargs["extra_info"] == [{"index": 7}, {"index": 7}, None, None]  # nested, as stored
    assert inputs.select([3, 0]).kwargs()["completions"] == ["x", [{"role": "assistant", "content": "5"}]]
    with pytest.raises(ValueError, match="3 completions for 2 prompts × 2 samples"):
        RewardInputs.of(PROBLEMS, ["a", "b", "c"], [[1], [2], [3]], n=2)


def exact_or_none(completions, answer, data_source, **columns):
    """1/0 on rows of source "toy", None (does not apply) elsewhere."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if s != "toy" else float(t == a) for t, a, s in zip(texts, answer, data_source, strict=True)]


def length_or_none(completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]


def test_weighted_rewards_sum_what_applies_and_log_each_function():
    inputs = RewardInputs.of(PROBLEMS, ["5", "6", "8", "x"], [[1], [2], [3], [4, 5]], n=2)
    rewards = WeightedRewards({"exact": exact_or_none, "length": length_or_none}, weights=[2.0, 0.5])
    out = rewards(inputs)
    # exact: 1, 0 on the "toy" rows, None on the others; length: 1, 1, 1, 2 tokens
    assert out.by_function == {"exact": [1.0, 0.0, None, None], "length": [1.0, 1.0, 1.0, 2.0]}
    assert out.scores == [2 * 1 + 0.5 * 1, 2 * 0 + 0.5 * 1, 0.5 * 1, 0.5 * 2]
    assert function_metrics([out, out]) == {
        "reward/fn/exact/mean": 0.5,
        "reward/fn/exact/error_fraction": 0.0,
        "reward/fn/exact/none_fraction": 0.5,
        "reward/fn/length/mean": 1.25,
        "reward/fn/length/error_fraction": 0.0,
        "reward/fn/length/none_fraction": 0.0,
    }
    with pytest.raises(ValueError, match="reward.weights has 1 values for 2 reward functions"):
        WeightedRewards({"a": length_or_none, "b": length_or_none}, weights=[1.0])


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (
            [1.0],
            "reward 'bad' returned 1 values for 2 completions; expected one float or None per completion",
        ),
        (["1", 0.0], "reward 'bad' returned '1' \\(str\\); expected a float or None"),
        ([True, 0.0], "reward 'bad' returned True \\(bool\\); expected a float or None"),
        (0.5, "reward 'bad' returned a float; expected a list with one float or None per completion"),
    ],
)
def test_a_reward_breaking_the_contract_is_named(returned, message):
    inputs = RewardInputs.of(PROBLEMS[1:], ["8", "9"], [[1], [2]], n=2)
    rewards = WeightedRewards({"bad": lambda **kwargs: returned})
    with pytest.raises(RewardContractError, match=message):
        rewards(inputs)


def test_an_isolated_contract_breach_stops_but_a_raising_reward_scores_zero():
    inputs = RewardInputs.of(PROBLEMS[1:], ["8"], [[1]])
    breach = IsolatedReward(WeightedRewards({"bad": lambda **kwargs: [1.0, 2.0]}), timeout=10.0)
    try:
        with pytest.raises(RewardContractError, match="reward 'bad' returned 2 values for 1 completions"):
            breach(inputs)
    finally:
        breach.close()


def test_reward_config_takes_a_list_with_weights_and_names_each_function():
    rewards = RewardConfig(
        fn=["exact", f"{__name__}:length_reward", "exact"], weights=[1, 2, 3], timeout=None
    )
    built = rewards.build()
    assert list(built.functions) == ["exact", "length_reward", "exact_2"]
    assert built.weights == {"exact": 1.0, "length_reward": 2.0, "exact_2": 3.0}
    out = built(RewardInputs.of(PROBLEMS[1:], ["8", "12"], [[1], [2]], n=2))
    assert out.scores == [1 + 2 * 1 + 3 * 1, 0 + 2 * 2 + 0]
    with pytest.raises(ValueError, match="reward.weights has 2 values for 1 reward functions in reward.fn"):
        RewardConfig(fn="exact", weights=[1.0, 2.0])


def test_a_list_may_hold_class_paths_with_init_args():
    fn = ["exact", {"class_path": "lit_offpolicy.rewards.ExactAnswer", "init_args": {"eos_token": "</s>"}}]
    built = RewardConfig(fn=fn, timeout=None).build()
    assert list(built.functions) == ["exact", "ExactAnswer"]
    assert built.functions["ExactAnswer"].eos_token == "</s>"
