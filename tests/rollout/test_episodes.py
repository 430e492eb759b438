"""Multi-turn episodes (``rollout/episodes.py``) on real engines and tiny models: turns, observations
and the action mask line up, limits truncate, a one-turn episode is the engine's generation, the HF
and vLLM engines write the same greedy episodes, and a CLI fit trains on episodes asynchronously.

``CountdownEnvironment`` is a user's environment: an untrained tiny model writes no tool calls, so
the built-in ``ToolEnvironment`` would end every episode after one turn (it is tested on its own in
tests/test_environments.py).
"""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
import yaml
from test_async import CONFIG

from lit_offpolicy.cli import main
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.environments import Environment, EpisodeConfig, EpisodeState, Observation
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer
from lit_offpolicy.rollout import HFEngine, SamplingParams
from lit_offpolicy.rollout.engine import WeightSyncHook
from lit_offpolicy.rollout.episodes import EpisodeRunner, observation_text
from lit_offpolicy.training.forward import frozen_log_probs


class CountdownEnvironment(Environment):
    """Answers turn t < ``turns`` with "seen t" and the problem's ``padding`` (one tool call, an error
    on odd turns) and ends the episode at turn ``turns`` with a reward of 0.5."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns

    def step(self, episode: EpisodeState) -> Observation:
        turn = len(episode.turns)
        if turn >= self.turns:
            return Observation(reward=0.5, done=True)
        text = f"seen {turn}{episode.problem.get('padding', '')}"
        return Observation(text=text, tool_calls=1, tool_errors=turn % 2)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return str(create_tiny_model(tmp_path_factory.mktemp("qwen3") / "m", seed=0, arch="qwen3"))


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    tokenizer = load_tokenizer(qwen_dir)
    engine = HFEngine(load_actor(qwen_dir, torch.float32), tokenizer.eos_token_id, tokenizer.pad_token_id)
    return tokenizer, engine


def problems(tokenizer) -> list[dict]:
    texts = ["3+4*5=", "(7-9)+2="]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in texts
    ]
    return [{"prompt": p, "answer": "0"} for p in prompts]


def runner(tokenizer, turns: int, **limits) -> EpisodeRunner:
    config = EpisodeConfig(environment=CountdownEnvironment(turns), **limits)
    return EpisodeRunner(config.build(), config, tokenizer, chat=True)


GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6)


def test_observations_follow_the_chat_template_between_turns(qwen):
    tokenizer, _ = qwen
    text = observation_text(tokenizer, "seen 1", chat=True)
    assert text == "\n<|im_start|>tool\nseen 1<|im_end|>\n<|im_start|>assistant\n"
    assert observation_text(tokenizer, "7", chat=False) == "\n<tool_response>\n7\n</tool_response>\n"


def test_turns_and_observations_line_up_with_the_action_mask_and_the_log_probs(qwen, qwen_dir):
    tokenizer, engine = qwen
    rows = problems(tokenizer)
    batch = runner(tokenizer, turns=3, max_response_tokens=64).run(
        engine, rows, GREEDY, add_special_tokens=False
    )
    observation = {
        t: tokenizer(observation_text(tokenizer, f"seen {t}", True), add_special_tokens=False).input_ids
        for t in (1, 2)
    }
    cut_last_turns = 0  # a final turn that ran to max_tokens leaves its episode truncated
    for prompt, (episode,) in zip(batch.prompt_ids, batch.generations, strict=True):
        # turn, observation 1, turn, observation 2, turn: each turn is greedy given everything before it
        context, expected_tokens, expected_actions = list(prompt), [], []
        for turn in range(3):
            (generated,) = engine.generate([context], GREEDY)[0]
            expected_tokens += generated.token_ids
            expected_actions += [1] * len(generated.token_ids)
            context += generated.token_ids
            if turn < 2:
                expected_tokens += observation[turn + 1]
                expected_actions += [0] * len(observation[turn + 1])
                context += observation[turn + 1]
        assert episode.token_ids == expected_tokens
        assert episode.action_mask == expected_actions
        assert all(lp == 0.0 for lp, a in zip(episode.log_probs, episode.action_mask, strict=True) if not a)
        assert episode.finish_reason == generated.finish_reason
        cut_last_turns += generated.finish_reason == "length"
    assert batch.rewards == [0.5, 0.5]
    assert batch.counts.metrics() == {
        "env/turns_mean": 3.0,
        "env/tool_calls_mean": 2.0,
        "env/tool_error_fraction": 0.5,
        "env/truncated_fraction": cut_last_turns / 2,
    }
    # the trainer's teacher-forced recompute over turns and observations reproduces π_rollout on the turns
    exp = Experience.from_generations(
        batch.prompt_ids, batch.generations, [0.0, 0.0], tokenizer.pad_token_id, 0
    )
    recomputed = frozen_log_probs(load_actor(qwen_dir, torch.float32), exp, 1.0, micro_batches=2)
    policy = exp.policy_mask.bool()
    torch.testing.assert_close(recomputed[policy], exp.rollout_log_probs[policy], atol=1e-5, rtol=0)


def test_limits_end_episodes_as_truncated(qwen):
    tokenizer, engine = qwen
    rows = problems(tokenizer)
    one_turn = runner(tokenizer, turns=3, max_turns=1).run(engine, rows, GREEDY, add_special_tokens=False)
    assert all(e.action_mask == [1] * len(e.token_ids) for (e,) in one_turn.generations)
    assert all(e.finish_reason == "length" for (e,) in one_turn.generations)
    assert one_turn.counts.metrics()["env/truncated_fraction"] == 1.0
    # room for turn 1 (6 tokens) but not for its observation and one more token
    tight = runner(tokenizer, turns=3, max_response_tokens=12).run(
        engine, rows, GREEDY, add_special_tokens=False
    )
    assert [len(e.token_ids) for (e,) in tight.generations] == [6, 6]
    assert tight.counts.truncated == 2 and tight.counts.turns == 2
    # a turn cut by the room left ends the episode unanswered: episode 0's longer observation leaves it
    # 3 tokens for turn 2, episode 1 has room for all 6 (and is answered, then out of room)
    rows[0] = {**rows[0], "padding": " and more and more"}
    obs = observation_text(tokenizer, "seen 1 and more and more", True)
    longer = len(tokenizer(obs, add_special_tokens=False).input_ids)
    cut = runner(tokenizer, turns=3, max_response_tokens=6 + longer + 3).run(
        engine, rows, GREEDY, add_special_tokens=False
    )
    (first,), (second,) = cut.generations
    assert len(first.token_ids) == 6 + longer + 3 and first.finish_reason == "length"
    assert second.action_mask.count(1) == 12
    assert (cut.counts.turns, cut.counts.tool_calls, cut.counts.truncated) == (4, 3, 2)


def test_a_one_turn_episode_is_the_engines_generation(qwen):
    tokenizer, engine = qwen
    rows = problems(tokenizer)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5)
    batch = runner(tokenizer, turns=1).run(engine, rows, params, add_special_tokens=False)
    direct = engine.generate(batch.prompt_ids, params)
    for episodes, generations in zip(batch.generations, direct, strict=True):
        for episode, generation in zip(episodes, generations, strict=True):
            assert (episode.token_ids, episode.log_probs, episode.finish_reason) == (
                generation.token_ids,
                generation.log_probs,
                generation.finish_reason,
            )
            assert episode.action_mask == [1] * len(episode.token_ids)
    assert batch.completion_ids == [g.token_ids for group in direct for g in group]


@pytest.mark.slow
def test_hf_and_vllm_engines_write_the_same_greedy_episodes(qwen, qwen_dir):
    from lit_offpolicy.rollout.vllm_engine import VLLMEngine

    tokenizer, hf = qwen
    rows = problems(tokenizer)
    vllm = VLLMEngine(qwen_dir)
    try:
        ours = runner(tokenizer, turns=3, max_response_tokens=64).run(
            vllm, rows, GREEDY, add_special_tokens=False
        )
    finally:
        vllm.close()
    reference = runner(tokenizer, turns=3, max_response_tokens=64).run(
        hf, rows, GREEDY, add_special_tokens=False
    )
    for (episode,), (expected,) in zip(ours.generations, reference.generations, strict=True):
        assert episode.token_ids == expected.token_ids and episode.action_mask == expected.action_mask
        assert sum(episode.action_mask) < len(episode.token_ids), "the episodes hold observations"
        torch.testing.assert_close(
            torch.tensor(episode.log_probs), torch.tensor(expected.log_probs), atol=1e-4, rtol=0
        )


@pytest.mark.slow
def test_async_fit_trains_on_episodes_through_the_cli(tiny_model_dir, tmp_path, monkeypatch):
    """configs/async.yaml with episodes of the CountdownEnvironment: 2 steps, env/* logged."""
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    config = yaml.safe_load(CONFIG.read_text())
    rollout = config["trainer"]["callbacks"][0]
    rollout["init_args"].update(
        reward={"fn": {"class_path": "conftest.HashReward"}, "timeout": None},
        sampling={"n": 2, "temperature": 1.0, "max_tokens": 4, "seed": 0},
        validation={"every_n_steps": 2},
        episodes={
            "environment": {"class_path": "test_episodes.CountdownEnvironment", "init_args": {"turns": 2}},
            "max_turns": 3,
            "max_response_tokens": 80,
        },
    )
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "logs"), "name": "episodes"},
    }
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--model.init_args.model_path",
            tiny_model_dir,
            "--trainer.max_steps",
            "2",
            "--trainer.logger",
            json.dumps(logger),
            "--trainer.callbacks",
            json.dumps([rollout]),
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--data.batch_size",
            "2",
            "--data.num_val_samples",
            "4",
        ]
    )
    (metrics,) = (tmp_path / "logs").glob("episodes/version_*/metrics.csv")
    with metrics.open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("actor/pg_loss")]
    assert len(rows) == 2
    # every episode took both turns: turn 1's tool call (an error), turn 2 done (its final turn may run
    # to max_tokens, which counts the episode as truncated, as a single-turn response at its limit)
    for row in rows:
        assert float(row["env/turns_mean"]) == 2.0 and float(row["env/tool_calls_mean"]) == 1.0
        assert float(row["env/tool_error_fraction"]) == 1.0


def test_partial_rollouts_record_each_turns_versions_and_observations_take_the_last(qwen_dir):
    """A weight sync during turn 1 (partial rollouts): the episode's tokens record the versions that
    sampled them, observations the version of the token before them, turn 2 the new version."""
    tokenizer = load_tokenizer(qwen_dir)
    engine = HFEngine(load_actor(qwen_dir, torch.float32), tokenizer.eos_token_id, tokenizer.pad_token_id)
    weights = {name: tensor * 1.01 for name, tensor in engine.model.state_dict().items()}
    calls = {"pending": 0, "applied": False}

    def pending() -> bool:
        calls["pending"] += 1
        return calls["pending"] >= 3 and not calls["applied"]

    def apply() -> None:
        engine.load_weights(weights, version=1)
        calls["applied"] = True

    hook = WeightSyncHook(pending, apply)
    batch = runner(tokenizer, turns=2).run(engine, problems(tokenizer)[:1], GREEDY, False, sync=hook)
    ((episode,),) = batch.generations
    assert calls["applied"] and len(episode.versions) == len(episode.token_ids)
    first_observation = episode.action_mask.index(0)
    turn_1, rest = episode.versions[:first_observation], episode.versions[first_observation:]
    assert turn_1[0] == 0 and turn_1[-1] == 1 and turn_1 == sorted(turn_1)
    assert set(rest) == {1}
