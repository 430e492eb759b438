"""The agents' endpoint: token in, token out with Qwen3's real chat template, branches, the OpenAI
errors, failing agents, and the trainer's log-probs against the engine's on recorded episodes."""

from __future__ import annotations

import copy
import dataclasses
import threading

import openai
import pytest
import torch
from helpers.agents import TOOLS, qwen3_agent_model

from lit_offpolicy.core.generation import Generation
from lit_offpolicy.correction.metrics import offpolicy_metrics
from lit_offpolicy.models import load_actor, load_tokenizer
from lit_offpolicy.rewards import RewardConfig
from lit_offpolicy.rollout import HFEngine, SamplingParams
from lit_offpolicy.rollout.agents import AgentConfig, AgentRunner
from lit_offpolicy.rollout.agents.transcript import BudgetError, Transcript, chat_key
from lit_offpolicy.rollout.rounds import sample_agent_round
from lit_offpolicy.training.forward import frozen_log_probs

SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return qwen3_agent_model(tmp_path_factory.mktemp("agents") / "qwen3")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    return HFEngine(load_actor(model_dir, torch.float32), tokenizer.eos_token_id, tokenizer.pad_token_id)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def sampled(tokenizer, text: str, finish: str = "stop") -> Generation:
    """A reply as an engine returns it: the text's tokens (and the end-of-turn token when it stopped)."""
    ids = encode(tokenizer, text) + ([tokenizer.eos_token_id] if finish == "stop" else [])
    return Generation(ids, [-0.5] * len(ids), finish)


def chat_call(transcript: Transcript, messages, reply_text: str, reply: dict, tools=TOOLS, finish="stop"):
    """Plan a chat call, 'sample' ``reply_text`` for it and record it as the endpoint does."""
    plan = transcript.plan_chat(messages, tools, {})
    generation = sampled(transcript.tokenizer, reply_text, finish)
    transcript.record(plan, generation, 3, "chat", chat_key(messages, tools, reply), reply_text)
    return plan, generation


THINKING_REPLY = (
    '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
)
REPLY_MESSAGE = {
    "role": "assistant",
    "content": "<think>\nadd them\n</think>",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    ],
}


def test_a_call_that_extends_the_last_is_prompted_with_its_exact_tokens_under_qwen3s_template(tokenizer):
    transcript = Transcript(tokenizer, max_prompt_tokens=1024, max_response_tokens=512)
    messages = [{"role": "user", "content": "3+4=?"}]
    first, reply = chat_call(transcript, messages, THINKING_REPLY, REPLY_MESSAGE)
    later = [
        *messages,
        REPLY_MESSAGE,
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
        {"role": "user", "content": "so?"},
    ]
    plan = transcript.plan_chat(later, TOOLS, {})
    added = (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nso?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert plan.prompt == first.prompt + reply.token_ids + encode(tokenizer, added)
    assert plan.added == encode(tokenizer, added)
    # re-rendering the conversation (what a client of a plain server gets) drops the <think> block
    # the engine sampled: the tokens the trainer would see are not the engine's
    rendered = encode(
        tokenizer,
        tokenizer.apply_chat_template(later, tools=TOOLS, tokenize=False, add_generation_prompt=True),
    )
    assert rendered != plan.prompt and "add them" not in tokenizer.decode(rendered)
    transcript.record(plan, sampled(tokenizer, "7"), 4, "chat", ((), ""), "7")
    (branch,) = transcript.branches
    assert branch.prompt == first.prompt
    assert branch.tokens == reply.token_ids + plan.added + sampled(tokenizer, "7").token_ids
    assert branch.actions == [1] * len(reply.token_ids) + [0] * len(plan.added) + [1] * (
        len(encode(tokenizer, "7")) + 1
    )
    assert branch.versions == [3] * (len(reply.token_ids) + len(plan.added)) + [4] * (
        len(encode(tokenizer, "7")) + 1
    )
    assert all(lp == 0.0 for lp, a in zip(branch.log_probs, branch.actions, strict=True) if not a)


def test_a_reply_cut_by_length_gets_its_end_of_turn_as_context(tokenizer):
    transcript = Transcript(tokenizer, 1024, 512)
    messages = [{"role": "user", "content": "hi"}]
    first, reply = chat_call(
        transcript, messages, "abc", {"role": "assistant", "content": "abc"}, tools=None, finish="length"
    )
    plan = transcript.plan_chat(
        [*messages, {"role": "assistant", "content": "abc"}, {"role": "user", "content": "more"}], None, {}
    )
    assert plan.added[0] == tokenizer.eos_token_id  # never sampled: context, not trained on
    assert plan.prompt == first.prompt + reply.token_ids + plan.added


def test_an_edited_history_starts_a_branch_trained_only_on_its_own_sampled_tokens(tokenizer):
    transcript = Transcript(tokenizer, 1024, 512)
    messages = [{"role": "user", "content": "3+4=?"}]
    chat_call(transcript, messages, THINKING_REPLY, REPLY_MESSAGE)
    edited = {**REPLY_MESSAGE, "content": "I will add."}
    later = [*messages, edited, {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
    plan = transcript.plan_chat(later, TOOLS, {})
    assert plan.parent is None
    assert plan.prompt == encode(
        tokenizer,
        tokenizer.apply_chat_template(later, tools=TOOLS, tokenize=False, add_generation_prompt=True),
    )
    transcript.record(plan, sampled(tokenizer, "7"), 3, "chat", ((), ""), "7")
    first, second = transcript.branches
    assert second.prompt == plan.prompt and second.actions == [1] * len(second.tokens)
    assert first.actions == [1] * len(first.tokens)
    # other tools, or an assistant turn the agent wrote itself, do not extend either
    assert transcript.plan_chat(later, None, {}).parent is None
    written = [
        *messages,
        REPLY_MESSAGE,
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"},
    ]
    assert transcript.plan_chat(written, TOOLS, {}).parent is None


def test_two_calls_from_one_point_fork_the_branch(tokenizer):
    transcript = Transcript(tokenizer, 1024, 512)
    messages = [{"role": "user", "content": "a"}]
    chat_call(transcript, messages, "b", {"role": "assistant", "content": "b"}, tools=None)
    history = [*messages, {"role": "assistant", "content": "b"}]
    one = transcript.plan_chat([*history, {"role": "user", "content": "c"}], None, {})
    other = transcript.plan_chat([*history, {"role": "user", "content": "d"}], None, {})
    transcript.record(one, sampled(tokenizer, "e"), 0, "chat", ((), ""), "e")
    transcript.record(other, sampled(tokenizer, "f"), 0, "chat", ((), ""), "f")
    first, fork = transcript.branches
    assert first.tokens == one.prompt[len(first.prompt) :] + sampled(tokenizer, "e").token_ids
    assert fork.tokens == other.prompt[len(fork.prompt) :] + sampled(tokenizer, "f").token_ids
    assert fork.prompt == first.prompt


def test_text_and_token_id_prompts_extend_by_their_exact_tokens(tokenizer):
    transcript = Transcript(tokenizer, 64, 64)
    plan = transcript.plan_text("1+2=")
    transcript.record(plan, sampled(tokenizer, "3"), 0, "text", ("1+2=" + "3",), "3")
    later = transcript.plan_text("1+2=3 and")
    assert later.prompt == plan.prompt + sampled(tokenizer, "3").token_ids + encode(tokenizer, " and")
    ids = [5, 6, 7]
    start = transcript.plan_ids(ids)
    transcript.record(start, Generation([8, 9], [-1.0, -1.0], "length"), 0, "ids", ((5, 6, 7, 8, 9),), "")
    assert transcript.plan_ids([5, 6, 7, 8, 9, 10]).added == [10]
    assert transcript.plan_ids([5, 6, 7, 8, 10]).parent is None


def test_budgets_refuse_a_long_prompt_and_a_full_episode(tokenizer):
    transcript = Transcript(tokenizer, max_prompt_tokens=4, max_response_tokens=3)
    with pytest.raises(BudgetError, match="agent.max_prompt_tokens=4"):
        transcript.plan_ids(list(range(5)))
    plan = transcript.plan_ids([1, 2])
    assert transcript.room(plan) == 3
    transcript.record(plan, Generation([3, 4], [-1.0, -1.0], "length"), 0, "ids", ((1, 2, 3, 4),), "")
    with pytest.raises(BudgetError, match="agent.max_response_tokens=3"):
        transcript.plan_ids([1, 2, 3, 4, 5])


# the endpoint, with the HF engine and the openai client


def run(engine, tokenizer, agent: str, problems=None, params=SAMPLING, reward="exact", **options):
    config = AgentConfig(fn=agent, **{"max_prompt_tokens": 700, "max_response_tokens": 96, **options})
    runner = AgentRunner(config, tokenizer)
    rows = problems or [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+1=", "answer": "2"}]
    try:
        return runner.run(engine, rows, params, RewardConfig(fn=reward, timeout=None).build())
    finally:
        runner.close()


def recorded_kl(engine, tokenizer, model_dir) -> float:
    """``rollout_corr/kl`` of two-call episodes recorded through the endpoint on ``engine``: the
    trainer's recomputed log-probs of the sampled tokens against the engine's."""
    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+1=", "answer": "2"}]
    config = AgentConfig(fn="helpers.agents:two_calls", max_prompt_tokens=700, max_response_tokens=96)
    runner = AgentRunner(config, tokenizer)
    try:
        round_ = sample_agent_round(
            engine, RewardConfig(fn="exact", timeout=None).build(), runner, rows, SAMPLING,
            special_tokens=False, first_group=10,
        )  # fmt: skip
    finally:
        runner.close()
    exp = round_.experience
    assert exp.group_ids.tolist() == [10, 10, 11, 11]
    assert round_.episodes.calls == 8 and round_.episodes.samples == 4
    actions = exp.action_mask.bool() & exp.response_mask.bool()
    assert ((~actions) & exp.response_mask.bool()).any(), "the tool results are context"
    recomputed = frozen_log_probs(load_actor(model_dir, torch.float32), exp, 1.0, micro_batches=2)
    return offpolicy_metrics(recomputed, exp.rollout_log_probs, actions)["kl"].abs().item()


def test_the_trainer_recomputes_the_hf_engines_recorded_log_probs(engine, tokenizer, model_dir):
    # the mean of float32 differences of ≤ 1e-5 each (as test_episodes' bound), of either sign
    assert recorded_kl(engine, tokenizer, model_dir) <= 1e-6


@pytest.mark.slow
def test_the_trainer_recomputes_the_vllm_engines_recorded_log_probs(tokenizer, model_dir):
    from lit_offpolicy.rollout.vllm_engine import VLLMEngine

    vllm = VLLMEngine(model_dir, max_model_len=1024)
    try:
        assert recorded_kl(vllm, tokenizer, model_dir) <= 1e-6
    finally:
        vllm.close()


def test_the_openai_errors_name_what_is_wrong(engine, tokenizer):
    config = AgentConfig(
        fn="helpers.agents:two_calls", max_prompt_tokens=700, max_response_tokens=96, max_calls=2
    )
    runner = AgentRunner(config, tokenizer)
    runner.start()
    endpoint, stop = runner.endpoint, threading.Event()
    session = endpoint.open(Transcript(tokenizer, 700, 96), SAMPLING, 8, config.max_calls)
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0, timeout=20)
    messages = [{"role": "user", "content": "hi"}]
    runner.queue.add_running(1)
    server = threading.Thread(target=runner.queue.serve, args=(engine, stop.is_set, None))
    server.start()
    try:
        cases = [
            (dict(model="gpt-4o"), openai.NotFoundError, "'gpt-4o' is not served here"),
            (dict(n=2), openai.BadRequestError, "n=2 is not supported"),
            (
                dict(temperature=0.3),
                openai.BadRequestError,
                "temperature=0.3 differs from this run's sampling.temperature=1.0",
            ),
            (dict(stream=True), openai.BadRequestError, "stream=true"),
            (dict(extra_body={"best_of": 3}), openai.BadRequestError, "unsupported parameter 'best_of'"),
            (
                dict(messages=[{"role": "user", "content": "7" * 800}]),
                openai.BadRequestError,
                "over agent.max_prompt_tokens=700",
            ),
            (dict(messages=[{"content": "no role"}]), openai.BadRequestError, "messages must be"),
        ]
        for change, error, text in cases:
            with pytest.raises(error, match=text):
                client.chat.completions.create(**{"model": "policy", "messages": messages, **change})
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=endpoint.base_url, api_key="sk-guess", max_retries=0).models.list()
        assert [m.id for m in client.models.list().data] == ["policy"]
        for _ in range(2):  # refused calls do not count towards max_calls=2; these do
            client.chat.completions.create(model="policy", messages=messages, temperature=1.0)
        with pytest.raises(openai.RateLimitError, match="max_calls=2"):
            client.chat.completions.create(model="policy", messages=messages)
        with pytest.raises(openai.BadRequestError, match=r"token ids must be in \[0, 384\)"):
            client.completions.create(model="policy", prompt=[1, -3])
        assert session.rejected == 9 and len(session.transcript.calls) == 2
        endpoint.close(session)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="policy", messages=messages)
    finally:
        stop.set()
        runner.queue.wake()
        server.join(timeout=30)
        runner.close()


def test_the_model_calls_tools_as_tool_calls_and_the_tool_results_extend_the_episode(tokenizer):
    batch = run(FixedReply(tokenizer), tokenizer, "helpers.agents:tool_caller", max_response_tokens=200)
    assert batch.scores == [1.0] * 4, batch.rewards.first_error
    assert batch.counts.tool_calls == 8 and batch.counts.samples == 4  # two calls, one branch each


class FixedReply:
    """An engine that answers every prompt with one tool call (what a trained model would write)."""

    policy_version = 0

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        text = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
        return [[sampled(self.tokenizer, text)] for _ in prompts]


def test_failing_agents_score_as_failed_and_the_step_goes_on(engine, tokenizer):
    batch = run(engine, tokenizer, "helpers.agents:raises")
    assert batch.counts.failed == 4 and batch.scores == [0.0] * 4
    assert "raised ValueError: the agent's own bug" in batch.rewards.first_error
    assert batch.rewards.first_error.startswith("agent helpers.agents:raises")
    batch = run(engine, tokenizer, "helpers.agents:returns_text")
    assert batch.counts.failed == 4 and "returned str" in batch.rewards.first_error
    batch = run(engine, tokenizer, "helpers.agents:never_calls")
    # no call answered: one empty sample per episode, in its row's group
    assert batch.groups == [0, 0, 1, 1] and all(not g.token_ids for g in batch.generations)


def test_hanging_agents_are_cancelled_at_the_time_limit(engine, tokenizer):
    import time

    started = time.perf_counter()
    batch = run(engine, tokenizer, "helpers.agents:hangs", timeout_s=2.0)
    assert batch.counts.timed_out == 4 and batch.counts.calls == 4
    batch = run(engine, tokenizer, "helpers.agents:hangs_sync", timeout_s=1.0)
    assert batch.counts.timed_out == 4
    assert time.perf_counter() - started < 30


def test_plain_http_and_text_agents_and_the_reward_function(engine, tokenizer):
    batch = run(engine, tokenizer, "helpers.agents:plain_http")
    assert batch.scores == [0.25] * 4 and batch.counts.calls == 4
    batch = run(engine, tokenizer, "helpers.agents:completions_agent")
    assert batch.counts.samples == 4 and batch.counts.calls == 8
    batch = run(engine, tokenizer, "helpers.agents:two_calls", reward="exact")
    assert batch.counts.handed_to_reward == 4 and set(batch.rewards.by_function) == {
        "agent helpers.agents:two_calls",
        "exact",
    }
    batch = run(engine, tokenizer, "helpers.agents:edits_history")
    assert batch.counts.samples == 8 and batch.groups == [0, 0, 0, 0, 1, 1, 1, 1]


def test_the_readmes_agent_runs_on_string_and_chat_prompts(engine, tokenizer, tmp_path, monkeypatch):
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = [b for b in readme.split("```python\n")[1:] if "async def solve(client, row)" in b]
    (tmp_path / "readme_agent.py").write_text(block.split("```")[0])  # the reward beside it too
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "x", "raw_prompt": [{"role": "user", "content": "2+2="}], "answer": "4"},
    ]
    batch = run(engine, tokenizer, "readme_agent:solve", problems=rows)
    assert batch.counts.calls == 4 and batch.counts.failed == 0, batch.rewards.first_error


def test_the_options_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="agent.fn is required"):
        AgentConfig()
    with pytest.raises(ValueError, match=r"expected \(client, row\) or \(base_url, api_key, row\)"):
        AgentConfig(fn="helpers.agents:user_text").build()
    with pytest.raises(ValueError, match="agent.concurrency"):
        AgentConfig(fn="helpers.agents:two_calls", concurrency=0)
    assert dataclasses.replace(AgentConfig(fn="x:y"), max_call_tokens=4).call_tokens(8) == 4


class FailingEngine(FixedReply):
    """An engine that dies on its second ``generate`` (a lost server, an out-of-memory kill)."""

    calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("the engine died")
        return super().generate(prompts, params)


def test_an_engine_that_dies_mid_rollout_ends_it_at_once_with_its_error(tokenizer):
    import time

    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="the engine died"):
        run(FailingEngine(tokenizer), tokenizer, "helpers.agents:hangs_after_two_calls", timeout_s=600.0)
    assert time.perf_counter() - started < 30  # not the agents' 600 s time-out


def test_the_agent_demos_warm_up_traces_are_the_episodes_the_endpoint_records(tmp_path):
    """The demo's warm-up teaches exactly the tokens an episode of its agent records: an engine that
    writes the traces' replies (the call, then the answer) gives the traces' tokens and masks."""
    from lit_offpolicy.data.tasks import get_task
    from lit_offpolicy.examples.agent_demo import create_agent_model, traces
    from lit_offpolicy.examples.tool_demo import tool_call

    tokenizer = load_tokenizer(str(create_agent_model(tmp_path / "model", seed=0)))
    rows = get_task("multistep").train(3, seed=0)

    class Scripted(FixedReply):
        def generate(self, prompts, params):
            replies = []
            for prompt in prompts:
                text = self.tokenizer.decode(prompt, skip_special_tokens=True)
                row = next(r for r in rows if text.startswith(r["prompt"]))
                reply = row["answer"] if "<tool_response>" in text else tool_call(row["prompt"][:-1])
                replies.append([sampled(self.tokenizer, reply)])
            return replies

    params = SamplingParams(n=1, temperature=1.0, max_tokens=96)
    batch = run(
        Scripted(tokenizer),
        tokenizer,
        "lit_offpolicy.examples.calculator_agent:solve",
        rows,
        params,
        max_response_tokens=160,
    )
    assert batch.scores == [1.0, 1.0, 1.0]
    for (ids, mask), prompt, generation in zip(
        traces(rows, tokenizer), batch.prompt_ids, batch.generations, strict=True
    ):
        assert ids == prompt + generation.token_ids
        assert mask == [0] * len(prompt) + generation.action_mask


def test_validation_samples_greedily_whatever_temperature_the_agent_asks(engine, tokenizer):
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=4)
    config = AgentConfig(
        fn="helpers.agents:asks_temperature_one", max_prompt_tokens=64, max_response_tokens=16
    )
    runner = AgentRunner(config, tokenizer)
    rows = [{"prompt": "3+4=", "answer": "7"}]
    try:
        scores = runner.episode_scores(engine, rows, greedy, RewardConfig(fn="exact", timeout=None).build())
        assert scores == [1.0]  # the agent's 1.0 for a call that went through
        training = runner.run(engine, rows, greedy, None)  # a training rollout at temperature 0 refuses it
        assert training.counts.failed == 1 and "temperature=1.0 differs" in training.rewards.first_error
    finally:
        runner.close()


def test_a_template_that_raises_is_a_400_naming_messages(tokenizer):
    from lit_offpolicy.rollout.agents.endpoint import AgentEndpoint
    from lit_offpolicy.rollout.agents.openai_api import APIError

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{ raise_exception('only user turns, please') }}"
    endpoint = AgentEndpoint(strict, None, "policy", "127.0.0.1", 0, 5.0)
    try:
        session = endpoint.open(Transcript(strict, 64, 64), SAMPLING, 8, 2)
        with pytest.raises(APIError, match="cannot render these messages: only user turns, please") as error:
            endpoint.chat(session, {"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        assert error.value.status == 400 and error.value.param == "messages"
    finally:
        endpoint.shutdown()
