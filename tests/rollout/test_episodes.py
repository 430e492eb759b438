"""Multi-turn episodes (``rollout/episodes.py``) on real engines and tiny models: turns, observations
and the action mask line up, limits truncate, a one-turn episode is the engine's generation, the HF
and vLLM engines write the same greedy episodes (a CLI fit on episodes:
tests/integration/test_episodes_fit.py).

``CountdownEnvironment`` (tests/helpers/episodes.py) is a user's environment: an untrained tiny model
writes no tool calls, so the built-in ``ToolEnvironment`` would end every episode after one turn (it
is tested on its own in tests/environments/test_environments.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers.episodes import CountdownEnvironment
from helpers.tolerances import reordered_sums

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.environments import EpisodeConfig
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer
from lit_offpolicy.rollout import HFEngine, SamplingParams
from lit_offpolicy.rollout.engine import WeightSyncHook
from lit_offpolicy.rollout.episodes import EpisodeRunner, observation_text
from lit_offpolicy.training.forward import frozen_log_probs


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
    # float32, cached decoding against batched teacher forcing on a tiny Qwen3: sums of ≤ 384 terms (MLP,
    # vocab) grouped otherwise in both blocks, on both paths: 2 × 2 × eps32 × √384 × max|lp| ≤ 7 ≈ 6.5e-5
    atol = reordered_sums(recomputed[policy], terms=384, stages=2)
    torch.testing.assert_close(recomputed[policy], exp.rollout_log_probs[policy], atol=atol, rtol=0)


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
        # vLLM's CPU kernels (its own attention, fused MLP and log-softmax) against HF's, both float32,
        # over ≤ 3 turns of ≤ 64 tokens: as tests/integration/test_vllm_engine.py, 1e-4
        torch.testing.assert_close(
            torch.tensor(episode.log_probs), torch.tensor(expected.log_probs), atol=1e-4, rtol=0
        )


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
