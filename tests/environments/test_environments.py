"""Environments of multi-turn episodes: the calculator, tool-call parsing and ``ToolEnvironment`` on
every kind of bad input (each answered with an error text and counted, never raised)."""

from __future__ import annotations

import os
import time

import pytest

from lit_offpolicy.environments import (
    EpisodeConfig,
    EpisodeState,
    ToolCall,
    ToolEnvironment,
    calculator,
    parse_tool_calls,
)


def sleepy(seconds: float) -> str:
    """A tool that hangs."""
    time.sleep(seconds)
    return "woke up"


def vanish() -> str:
    """A tool whose process ends without an answer."""
    os._exit(3)


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3+4*5", "23"), ("(7-9)+2", "0"), ("7/2", "3.5"), ("6/3", "2"), ("-2**3 % 5", "2"), (" 9 // 2 ", "4")],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "is not arithmetic"),
        ("x + 1", "is not arithmetic"),
        ("'a' * 3", "is not arithmetic"),
        ("2 ** 1000", "exponent 1000 is too large"),
        ("3 +", "cannot parse"),
        ("1" * 201, "at most 200 characters"),
    ],
)
def test_calculator_refuses_everything_else(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_parse_tool_calls_reads_every_call_and_names_each_defect():
    text = (
        'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {oops}}</tool_call>'
        '<tool_call>["calculator"]</tool_call>'
        '<tool_call>{"name": "calculator"'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert calls[1].error.startswith("malformed tool call: invalid JSON")
    assert calls[2].error == 'malformed tool call: expected {"name": <string>, "arguments": <object>}'
    assert calls[3].error == "malformed tool call: no </tool_call> after <tool_call>"
    assert parse_tool_calls("the answer is 23") == []


def step(environment: ToolEnvironment, turn: str):
    return environment.step(EpisodeState(problem={"prompt": "p", "answer": "a"}, turns=[turn]))


def test_a_turn_without_a_tool_call_ends_the_episode_and_a_call_answers_with_the_result():
    environment = ToolEnvironment()
    final = step(environment, "23")
    assert final.done and final.text == "" and final.tool_calls == 0
    answered = step(
        environment, call("calculator", expression="3+4*5") + call("calculator", expression="2*3")
    )
    assert not answered.done
    assert (answered.text, answered.tool_calls, answered.tool_errors) == ("23\n6", 2, 0)


@pytest.mark.parametrize(
    ("turn", "text"),
    [
        ('<tool_call>{"name": calculator}</tool_call>', "error: malformed tool call: invalid JSON"),
        ("<tool_call>", "error: malformed tool call: no </tool_call> after <tool_call>"),
        (call("search", query="x"), "error: unknown tool 'search'; available: calculator, sleepy, vanish"),
        (
            call("calculator", expression="1/0"),
            "error: calculator raised ZeroDivisionError: division by zero",
        ),
        (call("calculator", expr="1"), "error: calculator raised TypeError"),
        (call("sleepy", seconds=30), "error: sleepy timed out after 0.5 s"),
        (call("vanish"), "error: vanish exited without a result"),
    ],
    ids=["bad-json", "unclosed", "unknown-tool", "raises", "bad-arguments", "hangs", "exits"],
)
def test_bad_calls_answer_with_an_error_and_are_counted(turn, text):
    environment = ToolEnvironment(
        tools=["calculator", f"{__name__}:sleepy", sleepy.__module__ + ":vanish"], timeout=0.5
    )
    started = time.perf_counter()
    observation = step(environment, turn)
    assert time.perf_counter() - started < 5
    assert observation.text.startswith(text)
    assert (observation.done, observation.tool_calls, observation.tool_errors) == (False, 1, 1)


def test_calls_past_the_limit_of_a_turn_are_answered_with_an_error():
    environment = ToolEnvironment(max_calls_per_turn=1)
    observation = step(environment, call("calculator", expression="1") + call("calculator", expression="2"))
    assert observation.text == "1\nerror: more than 1 tool calls in one turn"
    assert (observation.tool_calls, observation.tool_errors) == (2, 1)


def test_bad_settings_name_the_option():
    with pytest.raises(ValueError, match="tools='python' is not supported; allowed values: 'calculator'"):
        ToolEnvironment(tools=["python"])
    with pytest.raises(ValueError, match="timeout"):
        ToolEnvironment(timeout=0)
    with pytest.raises(
        ValueError, match="episodes.environment='gym' is not supported; allowed values: 'tools'"
    ):
        EpisodeConfig(environment="gym").build()
    with pytest.raises(ValueError, match="episodes.max_turns"):
        EpisodeConfig(max_turns=0)
    assert isinstance(EpisodeConfig().build(), ToolEnvironment)
    assert EpisodeConfig(max_turn_tokens=64, max_response_tokens=48).turn_tokens(16) == 48
    assert EpisodeConfig(max_response_tokens=48).turn_tokens(16) == 16


def test_the_tool_demo_traces_are_episodes_the_tool_environment_answers_alike(tiny_model_dir):
    """tool_demo's warm-up traces: prompt, call + eos, the observation ToolEnvironment would show for
    that call, answer + eos; the loss mask is 1 on the policy's tokens only."""
    from lit_offpolicy.examples.tool_demo import tool_call, traces
    from lit_offpolicy.models import load_tokenizer
    from lit_offpolicy.rollout.episodes import observation_text

    tokenizer = load_tokenizer(tiny_model_dir)
    (ids, mask), (direct, direct_mask) = (
        traces([{"prompt": "3+4*5=", "answer": "23"}], tokenizer, with_tool)[0] for with_tool in (True, False)
    )
    call = tool_call("3+4*5")
    answer = ToolEnvironment().step(EpisodeState(problem={}, turns=[call]))
    shown = observation_text(tokenizer, answer.text, chat=False)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    eos = [tokenizer.eos_token_id]
    prompt = tokenizer("3+4*5=").input_ids
    assert ids == prompt + encode(call) + eos + encode(shown) + encode("23") + eos
    policy = [0] * len(prompt) + [1] * (len(encode(call)) + 1) + [0] * len(encode(shown)) + [1] * 3
    assert mask == policy and answer.text == "23"
    assert direct == prompt + encode("23") + eos and direct_mask == [0] * len(prompt) + [1] * 3
